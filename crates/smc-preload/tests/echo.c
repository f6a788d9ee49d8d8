/* A plain TCP program for the preload's tests: an echo server that serves
 * one connection with non-blocking sockets and poll() (or epoll, edge
 * triggered), and a client that sends N bytes, half-closes, and checks that
 * the same bytes come back. It knows nothing of SMC. */
#define _GNU_SOURCE
/* built as distributions build (fortified read/recv/poll: __read_chk ...) */
#ifndef _FORTIFY_SOURCE
#define _FORTIFY_SOURCE 2
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *m) { perror(m); exit(2); }
static unsigned char pat(size_t i) { return (unsigned char)((i * 2654435761u) >> 11); }

static void wait_fd(int fd, short ev, int ep) {
    if (ep >= 0) {
        struct epoll_event e;
        int n = epoll_wait(ep, &e, 1, 20000);
        if (n != 1) { fprintf(stderr, "epoll_wait: %d\n", n); exit(3); }
        return;
    }
    struct pollfd p = { fd, ev, 0 };
    int n = poll(&p, 1, 20000);
    if (n != 1) { fprintf(stderr, "poll: %d\n", n); exit(3); }
}

/* server PORTFILE [epoll]: listens on 127.0.0.1:0, writes the port to
 * PORTFILE, echoes one connection until EOF. */
static int server(const char *portfile, int use_epoll) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0) die("socket");
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    if (bind(l, (struct sockaddr *)&a, sizeof a)) die("bind");
    if (listen(l, 16)) die("listen");
    socklen_t al = sizeof a;
    if (getsockname(l, (struct sockaddr *)&a, &al)) die("getsockname");
    FILE *f = fopen(portfile, "w");
    fprintf(f, "%d\n", ntohs(a.sin_port));
    fclose(f);
    /* wait for the client with poll on the listener (non-blocking accept) */
    fcntl(l, F_SETFL, fcntl(l, F_GETFL) | O_NONBLOCK);
    struct pollfd pl = { l, POLLIN, 0 };
    if (poll(&pl, 1, 20000) != 1) die("poll listener");
    int s = accept4(l, NULL, NULL, SOCK_NONBLOCK);
    if (s < 0) die("accept4");
    int ep = -1;
    if (use_epoll) {
        ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event e = { .events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = s };
        if (epoll_ctl(ep, EPOLL_CTL_ADD, s, &e)) die("epoll_ctl");
    }
    static char buf[65536];
    /* a length known only at run time: the fortified read (__read_chk) */
    const char *c = getenv("ECHO_CHUNK");
    size_t chunk = strtoul(c ? c : "65536", NULL, 0);
    size_t total = 0;
    for (;;) {
        ssize_t n = read(s, buf, chunk);
        if (n == 0) break;
        if (n < 0) {
            if (errno != EAGAIN) die("read");
            wait_fd(s, POLLIN, ep);
            continue;
        }
        total += n;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = send(s, buf + off, n - off, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno != EAGAIN) die("send");
                struct pollfd p = { s, POLLOUT, 0 };
                if (poll(&p, 1, 20000) != 1) die("poll out");
                continue;
            }
            off += w;
        }
    }
    shutdown(s, SHUT_WR);
    printf("server echoed %zu\n", total);
    close(s);
    close(l);
    return 0;
}

/* client PORT N [fork]: sends N bytes, half-closes, reads them back. With
 * "fork", a child process first closes its copy of the connection and exits
 * (as a child does before exec): the parent's connection must go on. */
static int client(int port, size_t n, int forked) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) die("socket");
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    if (connect(s, (struct sockaddr *)&a, sizeof a)) die("connect");
    if (forked) {
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid == 0) { close(s); _exit(0); }
        int st;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) die("child");
    }
    unsigned char *out = malloc(n), *in = malloc(n);
    for (size_t i = 0; i < n; i++) out[i] = pat(i);
    /* writes and reads interleaved (the echo comes back while we send) */
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    size_t sent = 0, got = 0;
    int shut = 0;
    while (got < n || !shut) {
        struct pollfd p = { s, POLLIN | (sent < n ? POLLOUT : 0), 0 };
        if (poll(&p, 1, 20000) != 1) die("poll");
        if ((p.revents & POLLOUT) && sent < n) {
            struct iovec v[2] = { { out + sent, (n - sent) / 2 }, { out + sent + (n - sent) / 2, n - sent - (n - sent) / 2 } };
            ssize_t w = writev(s, v, 2);
            if (w < 0 && errno != EAGAIN) die("writev");
            if (w > 0) sent += w;
        }
        if (sent == n && !shut) { if (shutdown(s, SHUT_WR)) die("shutdown"); shut = 1; }
        if (p.revents & (POLLIN | POLLHUP)) {
            ssize_t r = recv(s, in + got, n - got, 0);
            if (r < 0 && errno != EAGAIN) die("recv");
            if (r == 0 && got < n) { fprintf(stderr, "early EOF at %zu\n", got); exit(4); }
            if (r > 0) got += r;
        }
    }
    char c;
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) & ~O_NONBLOCK);
    if (recv(s, &c, 1, 0) != 0) { fprintf(stderr, "no EOF\n"); exit(4); }
    if (memcmp(in, out, n)) { fprintf(stderr, "data differs\n"); exit(5); }
    printf("client ok %zu\n", n);
    close(s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "server")) return server(argv[2], argc > 3 && !strcmp(argv[3], "epoll"));
    if (argc >= 4 && !strcmp(argv[1], "client"))
        return client(atoi(argv[2]), strtoul(argv[3], NULL, 0), argc > 4 && !strcmp(argv[4], "fork"));
    fprintf(stderr, "usage: echo server PORTFILE [epoll] | echo client PORT N [fork]\n");
    return 1;
}
