/* Connections a server lets wait: a server with a blocking listening socket
 * that serves one client at a time (an iterative server: the clients after
 * the first wait in the kernel's accept queue while it serves the first), or
 * that accepts a connection and uses it only later. Over TCP each client's
 * connect completes in the kernel at once, and its data waits for the
 * server; the server must get each client's data and its address, and each
 * client its answer.
 *   waiting server PORTFILE MODE HOLD N MODE: accept (blocking accepts),
 *                                       poll (poll, then accept: Python's
 *                                       socketserver), late (accepts all
 *                                       at once, reads each HOLD s later),
 *                                       steady (blocking accepts, each
 *                                       client served for HOLD s), daemon
 *                                       (as accept, in a child that the
 *                                       process forks after listen() before
 *                                       it exits), prefork (as accept, in
 *                                       a child forked after listen() while
 *                                       the parent lives on without
 *                                       accepting, as a prefork server's
 *                                       processes share their listener);
 *                                       serves N clients, the first for
 *                                       HOLD s
 *   waiting client PORT ID              connects, sends "hello ID" and its
 *                                       port, reads the echo
 * It knows nothing of SMC. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include "portfile.h"

static void die(const char *m) { fprintf(stderr, "waiting: %s: %s\n", m, strerror(errno)); exit(2); }

static void client(int port, int id) {
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0) die("socket");
    if (connect(c, (struct sockaddr *)&a, sizeof a)) die("connect");
    struct sockaddr_in me;
    socklen_t ml = sizeof me;
    if (getsockname(c, (struct sockaddr *)&me, &ml)) die("getsockname");
    char m[64];
    int n = snprintf(m, sizeof m, "hello %d from %d", id, ntohs(me.sin_port));
    if (write(c, m, n) != n) die("write");
    char b[64];
    ssize_t r = read(c, b, sizeof b);
    if (r < 0) die("read");
    printf("client %d got %.*s\n", id, (int)r, b);
}

/* reads the client's message and answers it (the echo) */
static void serve(int s, const struct sockaddr_in *peer) {
    char b[64];
    ssize_t n = read(s, b, sizeof b - 1);
    if (n <= 0) die("server read");
    b[n] = 0;
    /* the address accept() reported is the client's */
    char *from = strstr(b, " from ");
    int port_ok = from && atoi(from + 6) == ntohs(peer->sin_port);
    printf("server read %s (the peer's port %s)\n", b, port_ok ? "matches" : "DIFFERS");
    fflush(stdout);
    if (write(s, b, n) != n) die("server write");
    close(s);
}

enum { MAX = 16 };

static void server(const char *portfile, const char *mode, int hold, int n) {
    int l = listen_to_portfile(portfile, INADDR_ANY, 8);
    if (l < 0) die("listen");
    if (!strcmp(mode, "daemon")) {
        /* the listening socket is the child's alone once this exits */
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid > 0) exit(0);
        alarm(120);
    }
    if (!strcmp(mode, "prefork")) {
        /* both processes hold the listening socket; the parent only waits */
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid > 0) {
            int st;
            if (waitpid(pid, &st, 0) != pid) die("waitpid");
            exit(WIFEXITED(st) ? WEXITSTATUS(st) : 3);
        }
        alarm(120);
    }
    int late = !strcmp(mode, "late"), use_poll = !strcmp(mode, "poll");
    int steady = !strcmp(mode, "steady");
    int s[MAX];
    struct sockaddr_in peer[MAX];
    if (n > MAX) n = MAX;
    for (int i = 0; i < n; i++) {
        if (use_poll) {
            struct pollfd p = { l, POLLIN, 0 };
            if (poll(&p, 1, 60000) != 1) die("poll");
        }
        socklen_t pl = sizeof peer[i];
        s[i] = accept(l, (struct sockaddr *)&peer[i], &pl);
        if (s[i] < 0) die("accept");
        if (late)
            continue;
        if (i == 0 || steady)
            sleep(hold);
        serve(s[i], &peer[i]);
    }
    if (late) {
        sleep(hold);
        for (int i = 0; i < n; i++)
            serve(s[i], &peer[i]);
    }
    close(l);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 6 && !strcmp(argv[1], "server"))
        server(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
    else if (argc == 4 && !strcmp(argv[1], "client"))
        client(atoi(argv[2]), atoi(argv[3]));
    else {
        fprintf(stderr, "usage: waiting server PORTFILE MODE HOLD N | waiting client PORT ID\n");
        return 2;
    }
    return 0;
}
