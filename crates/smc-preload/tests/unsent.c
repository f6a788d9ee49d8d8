/* A writer that exits right after its last write, and a reader that starts
 * reading late: over TCP the kernel delivers what the writer wrote after it
 * exited. Also what SIOCOUTQ and SIOCOUTQNSD say while the reader has not
 * read.
 *   unsent reader PORTFILE PAUSE_MS  accepts one connection, waits
 *                                    PAUSE_MS, reads to end of file;
 *                                    prints the bytes and their hash, or
 *                                    the error that ended the reading
 *   unsent writer PORT BYTES         connects, writes BYTES, prints their
 *                                    hash and its send queues, and exits
 * It knows nothing of SMC. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "portfile.h"

static void die(const char *m) { fprintf(stderr, "unsent: %s: %s\n", m, strerror(errno)); exit(2); }

static unsigned long fnv(unsigned long h, const unsigned char *b, size_t n) {
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ul; }
    return h;
}

static void reader(const char *portfile, int pause_ms) {
    int l = listen_to_portfile(portfile, INADDR_LOOPBACK, 1);
    if (l < 0) die("listen");
    int s = accept(l, NULL, NULL);
    if (s < 0) die("accept");
    usleep(pause_ms * 1000);
    static unsigned char b[1 << 16];
    unsigned long h = 1469598103934665603ul, total = 0;
    for (;;) {
        ssize_t n = read(s, b, sizeof b);
        if (n < 0) {
            printf("reader got %lu bytes, then %s\n", total, strerrorname_np(errno));
            return;
        }
        if (n == 0) break;
        h = fnv(h, b, n);
        total += n;
    }
    printf("reader got %lu bytes hash %016lx\n", total, h);
}

static void writer(int port, long bytes) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a)) die("connect");
    static unsigned char b[1 << 16];
    unsigned long h = 1469598103934665603ul, x = 12345;
    for (long done = 0; done < bytes;) {
        size_t n = bytes - done < (long)sizeof b ? bytes - done : sizeof b;
        for (size_t i = 0; i < n; i++) { x = x * 6364136223846793005ul + 1; b[i] = x >> 56; }
        h = fnv(h, b, n);
        for (size_t off = 0; off < n;) {
            ssize_t w = write(c, b + off, n - off);
            if (w <= 0) die("write");
            off += w;
        }
        done += n;
    }
    int q = -1, nsd = -1;
    ioctl(c, SIOCOUTQ, &q);
    ioctl(c, SIOCOUTQNSD, &nsd);
    printf("writer wrote %ld bytes hash %016lx\n", bytes, h);
    printf("writer SIOCOUTQ %s, SIOCOUTQNSD %s\n", q > 0 ? "some" : "none", nsd >= 0 && nsd <= q ? "at most that" : "more");
    /* exits without closing: exit() closes it */
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 4 && !strcmp(argv[1], "reader"))
        reader(argv[2], atoi(argv[3]));
    else if (argc == 4 && !strcmp(argv[1], "writer"))
        writer(atoi(argv[2]), atol(argv[3]));
    else {
        fprintf(stderr, "usage: unsent reader PORTFILE PAUSE_MS | unsent writer PORT BYTES\n");
        return 2;
    }
    return 0;
}
