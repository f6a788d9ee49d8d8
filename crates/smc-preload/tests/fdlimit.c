/* A server at its descriptor limit: it accepts connections (blocking) and
 * keeps them all, answering each client's one byte; at EMFILE it waits and
 * tries again, as servers do, until the clients are done.
 *   fdlimit server PORTFILE N  accepts until N connections were answered or
 *                              accept failed with EMFILE 40 times in a row;
 *                              prints what it got ("bad": a first byte that
 *                              was not the client's, or a read or an answer
 *                              that failed, each with a line of its own)
 *   fdlimit client PORT N      opens N connections, each writes 'x' and
 *                              waits up to 5 s for the answer; keeps them
 *   fdlimit limits             prints its soft descriptor limit, listens,
 *                              prints it again, and execs a shell that
 *                              prints it
 * It knows nothing of SMC. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "portfile.h"

static void die(const char *m) { fprintf(stderr, "fdlimit: %s: %s\n", m, strerror(errno)); exit(2); }

static void server(const char *portfile, int n) {
    int l = listen_to_portfile(portfile, INADDR_LOOPBACK, 128);
    if (l < 0) die("listen");
    int answered = 0, bad = 0, emfile = 0, in_a_row = 0;
    while (answered + bad < n && in_a_row < 40) {
        int s = accept(l, NULL, NULL);
        if (s < 0) {
            if (errno != EMFILE) die("accept");
            emfile++;
            in_a_row++;
            usleep(50000);
            continue;
        }
        in_a_row = 0;
        char b = 0;
        ssize_t r = read(s, &b, 1), w = -1;
        int rerr = r < 0 ? errno : 0;
        if (r == 1 && b == 'x' && (w = write(s, &b, 1)) == 1) {
            answered++;
        } else {
            /* (which: the client's CLC read as data, or a connection that
             * failed after its accept) */
            printf("bad: read %zd (%s) byte 0x%02x, write %zd (%s)\n", r,
                   r < 0 ? strerror(rerr) : "-", (unsigned char)b, w,
                   r == 1 && b == 'x' ? strerror(errno) : "-");
            bad++;
        }
    }
    printf("server answered %d bad %d emfile %s\n", answered, bad, emfile ? "yes" : "no");
}

static void client(int port, int n) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    int ok = 0;
    for (int i = 0; i < n; i++) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0) die("socket");
        if (connect(c, (struct sockaddr *)&a, sizeof a))
            continue;
        char b = 'x';
        if (write(c, &b, 1) != 1)
            continue;
        struct pollfd p = { c, POLLIN, 0 };
        if (poll(&p, 1, 5000) == 1 && read(c, &b, 1) == 1 && b == 'x')
            ok++;
    }
    printf("client answered %d\n", ok);
}

static void limits(void) {
    struct rlimit r;
    getrlimit(RLIMIT_NOFILE, &r);
    printf("limit before %lu\n", (unsigned long)r.rlim_cur);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1)) die("listen");
    getrlimit(RLIMIT_NOFILE, &r);
    printf("limit after listen %lu\n", (unsigned long)r.rlim_cur);
    execlp("sh", "sh", "-c", "echo limit after exec $(ulimit -S -n)", (char *)NULL);
    die("exec");
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 4 && !strcmp(argv[1], "server"))
        server(argv[2], atoi(argv[3]));
    else if (argc == 4 && !strcmp(argv[1], "client"))
        client(atoi(argv[2]), atoi(argv[3]));
    else if (argc == 2 && !strcmp(argv[1], "limits"))
        limits();
    else {
        fprintf(stderr, "usage: fdlimit server PORTFILE N | fdlimit client PORT N | fdlimit limits\n");
        return 2;
    }
    return 0;
}
