/* What a new image, or a forked child, finds on an inherited descriptor of an
 * SMC-R connection (tests/exec_fork.rs). Knows nothing of SMC.
 *   exec server PORTFILE     accepts one connection, echoes it, says how it ended
 *   exec server2 PORTFILE    the same for two connections at once
 *   exec server-fork PORTFILE  accepts two connections, each served by a
 *                            child it forks (and closes in itself)
 *   exec server-inetd PORTFILE  the same, each child execing `stdio` with
 *                            the connection as its stdin and stdout
 *   exec stdio               echoes stdin to stdout until end of file
 *   exec server-exec PORTFILE  the same, after an exec that the listening
 *                            socket crosses
 *   exec server-static PORTFILE PROG  the same, the exec (execl) into PROG
 *                            (a static build of this program: no library)
 *   exec server-noenv PORTFILE  the same, the exec (execve) into this
 *                            program with LD_PRELOAD left out of its environment
 *   exec server-spawn PORTFILE PROG  the listening socket handed to PROG
 *                            (posix_spawnp), which serves it; waits for it
 *   exec server-execfail PORTFILE  an exec (execlp) of a program that is
 *                            not there fails; then serves one connection
 *   exec server-leak PORTFILE PROG  forks a child that execs PROG (`idle`)
 *                            with the listening socket left open, waits for
 *                            it, then serves one connection itself
 *   exec server-system PORTFILE  the listening socket handed to this program
 *                            (`serve`) by system(), LD_PRELOAD unset first
 *   exec server-popen PORTFILE  the same by popen(), its output relayed
 *   exec server-system-env PORTFILE  the same by system() of
 *                            `env -u LD_PRELOAD` (the shell has the library)
 *   exec server-queue PORTFILE  a non-blocking listening socket (its port
 *                            in PORTFILE) that waits until a connection is
 *                            ready to accept, leaves it unaccepted and
 *                            execs `serve-poll` on the socket (port in
 *                            PORTFILE.2 then)
 *   exec server-queue-blocking PORTFILE  the same with a blocking one
 *   exec server-queue-plain PORTFILE  the same, the exec (execve) with
 *                            LD_PRELOAD left out of its environment
 *   exec serve-poll FD PORTFILE  writes FD's port to PORTFILE, then echoes
 *                            one connection of the listening socket FD
 *                            (poll, accept)
 *   exec hold PORT           connects, says "connected", waits for its stdin
 *                            to end, then says what a ping does (never blocks)
 *   exec idle                exits
 *   exec serve FD [PORTFILE] serves the listening socket FD (its port
 *                            written to PORTFILE first)
 *   exec pings PORT          two pings, then close
 *   exec client PORT fork    pings, forks a child that execs `after` on the
 *                            connection's descriptor, then pings again
 *   exec client PORT self    pings, then execs `after` itself
 *   exec client PORT use     pings, forks a child that pings on the
 *                            inherited connection (poll first, and a read
 *                            that SO_RCVTIMEO ends) and then
 *                            runs `pings` on a connection of its own, then
 *                            pings again once the child is done
 *   exec client PORT both    pings, forks; parent and child each write
 *                            1 MiB at once (bytes 'P' and 'C'), the child
 *                            leaving by _exit (no close); then the parent
 *                            half-closes and counts what comes back
 *   exec client PORT handoff pings, forks a child and closes its own copy;
 *                            the child (once the parent closed) pings twice
 *                            on the inherited connection (epoll, then a
 *                            blocking read), sends a file on it (sendfile),
 *                            half-closes it and reads the server's end
 *   exec client PORT plain   pings, then execs `after` itself (execle) with
 *                            LD_PRELOAD left out of its environment
 *   exec client PORT spawn   pings, spawns `after` on the connection's
 *                            descriptor (posix_spawn), waits, pings again
 *   exec client PORT spawn-stdin  the same with the descriptor close-on-exec
 *                            and the spawn's file actions putting it on the
 *                            child's stdin; the parent's stays close-on-exec
 *   exec client PORT system  pings, runs `after` on the connection's
 *                            descriptor by system(), pings again
 *   exec client PORT system-plain  the same, `after` run through
 *                            `env -u LD_PRELOAD` (no library there)
 *   exec client PORT popen   the same by popen(), its output relayed
 *   exec client PORT vfork   pings, vforks a child that moves the
 *                            connection's descriptor to 100 and execs
 *                            `after` on it, then pings again
 *   exec after FD            what each call on FD does (never blocks)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what) { perror(what); exit(2); }

static const char *err(ssize_t r) {
    if (r >= 0) return "ok";
    return errno == ENOTCONN ? "ENOTCONN" : errno == EPIPE ? "EPIPE" : errno == EAGAIN ? "EAGAIN"
         : errno == ECONNABORTED ? "ECONNABORTED" : errno == ECONNRESET ? "ECONNRESET" : strerror(errno);
}

/* Writes `l`'s port to `portfile` (the tests wait for it). */
static void write_port(int l, const char *portfile) {
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    if (getsockname(l, (struct sockaddr *)&a, &al)) die("getsockname");
    FILE *f = fopen(portfile, "w");
    if (!f) die("portfile");
    fprintf(f, "%d\n", ntohs(a.sin_port));
    fclose(f);
}

/* A listening socket on 127.0.0.1, its port written to `portfile` if not NULL. */
static int listen_loopback(const char *portfile) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4)) die("listen");
    if (portfile) write_port(l, portfile);
    return l;
}

static int serve(int l);
static int serve_fd(int c);
static int serve2(int l);

extern char **environ;

/* environ without LD_PRELOAD (a program that clears it for its children) */
static char **env_without_preload(void) {
    static char *env[256];
    int n = 0;
    for (char **e = environ; *e && n < 255; e++)
        if (strncmp(*e, "LD_PRELOAD=", 11)) env[n++] = *e;
    env[n] = NULL;
    return env;
}

/* The listening socket crosses an exec into a program without the library:
 * `how` is "static" (execl into `prog`, a static build), "noenv" (execve
 * into this program without LD_PRELOAD), "spawn" (posix_spawnp of `prog`). */
static int server_plain(const char *portfile, const char *how, const char *prog, const char *self) {
    /* (the port is written once the exec, spawn or child is done: a client
     * that came before would have been offered SMC, the limit the README
     * states for the accept queue) */
    int l = listen_loopback(NULL);
    char fd[16];
    snprintf(fd, sizeof fd, "%d", l);
    fflush(stdout);
    if (!strcmp(how, "static")) {
        execl(prog, prog, "serve", fd, portfile, (char *)NULL);
        die("execl");
    }
    if (!strcmp(how, "noenv")) {
        execve(self, (char *[]){(char *)self, "serve", fd, (char *)portfile, NULL}, env_without_preload());
        die("execve");
    }
    if (!strcmp(how, "execfail")) {
        if (execlp("no-such-exec-static", "no-such-exec-static", "serve", fd, (char *)NULL) != -1 || errno != ENOENT)
            die("execlp of nothing");
        write_port(l, portfile);
        return serve(l);
    }
    if (!strcmp(how, "leak")) {
        pid_t c = fork();
        if (c < 0) die("fork");
        if (c == 0) {
            execl(prog, prog, "idle", (char *)NULL);
            die("execl");
        }
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) { printf("child failed\n"); return 1; }
        write_port(l, portfile);
        return serve(l);
    }
    if (!strcmp(how, "system") || !strcmp(how, "popen") || !strcmp(how, "system-env")) {
        /* (a program that clears its children's environment first; or,
         * system-env, a command that runs its program without it) */
        int env = !strcmp(how, "system-env");
        if (!env) unsetenv("LD_PRELOAD");
        char cmd[4096];
        snprintf(cmd, sizeof cmd, "%s'%s' serve %s '%s'", env ? "env -u LD_PRELOAD " : "", self, fd, portfile);
        if (strcmp(how, "popen")) {
            int st = system(cmd);
            if (!WIFEXITED(st) || WEXITSTATUS(st)) { printf("system failed\n"); return 1; }
            return 0;
        }
        FILE *f = popen(cmd, "r");
        if (!f) die("popen");
        char line[256];
        while (fgets(line, sizeof line, f)) fputs(line, stdout);
        int st = pclose(f);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { printf("popen failed\n"); return 1; }
        return 0;
    }
    pid_t p;
    int e = posix_spawnp(&p, prog, NULL, NULL, (char *[]){(char *)prog, "serve", fd, (char *)portfile, NULL}, environ);
    if (e) { errno = e; die("posix_spawnp"); }
    close(l);
    int st;
    if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st)) { printf("spawned server failed\n"); return 1; }
    return 0;
}

static int server(const char *portfile, const char *then_exec, int two) {
    int l = listen_loopback(portfile);
    if (then_exec) {
        /* the listening socket crosses the exec (as in nginx's upgrade) */
        char fd[16];
        snprintf(fd, sizeof fd, "%d", l);
        fflush(stdout);
        execv(then_exec, (char *[]){(char *)then_exec, "serve", fd, NULL});
        die("execv");
    }
    return two ? serve2(l) : serve(l);
}

static int serve(int l) {
    int c = accept(l, NULL, NULL);
    if (c < 0) die("accept");
    return serve_fd(c);
}

static int serve_fd(int c) {
    char buf[256];
    long total = 0;
    for (;;) {
        ssize_t n = read(c, buf, sizeof buf);
        if (n <= 0) {
            printf("server end %s after %ld\n", n == 0 ? "eof" : "error", total);
            return 0;
        }
        if (write(c, buf, n) != n) die("server write");
        total += n;
    }
}

/* Echoes two connections at once (one poll loop), each until its end. */
static int serve2(int l) {
    struct pollfd p[3] = {{.fd = l, .events = POLLIN}, {.fd = -1}, {.fd = -1}};
    long total[3] = {0};
    int accepted = 0, ended = 0;
    char buf[256];
    while (ended < 2) {
        if (poll(p, 3, -1) < 0) die("poll");
        if (p[0].revents & POLLIN) {
            int c = accept(l, NULL, NULL);
            if (c < 0) die("accept");
            p[1 + accepted] = (struct pollfd){.fd = c, .events = POLLIN};
            if (++accepted == 2) p[0].fd = -1;
        }
        for (int i = 1; i < 3; i++) {
            if (p[i].fd < 0 || !p[i].revents) continue;
            ssize_t n = read(p[i].fd, buf, sizeof buf);
            if (n <= 0) {
                printf("server end %s after %ld\n", n == 0 ? "eof" : "error", total[i]);
                close(p[i].fd);
                p[i].fd = -1;
                ended++;
                continue;
            }
            if (write(p[i].fd, buf, n) != n) die("server write");
            total[i] += n;
        }
    }
    return 0;
}

static int after(int fd);
static int pings(int port);

/* A connection left in the listening socket's queue across an exec
 * (`nonblock`: the socket's mode; `plain`: the exec without LD_PRELOAD). */
static int server_queue(const char *portfile, const char *self, int nonblock, int plain) {
    int l = listen_loopback(portfile);
    if (nonblock && fcntl(l, F_SETFL, O_NONBLOCK)) die("fcntl");
    struct pollfd p = {.fd = l, .events = POLLIN};
    if (poll(&p, 1, 20000) != 1) die("poll for the queued connection");
    char fd[16], port2[4096];
    snprintf(fd, sizeof fd, "%d", l);
    snprintf(port2, sizeof port2, "%s.2", portfile);
    fflush(stdout);
    char *args[] = {(char *)self, "serve-poll", fd, port2, NULL};
    if (plain) execve(self, args, env_without_preload());
    else execv(self, args);
    die("execv");
    return 2;
}

static int serve_poll(int l, const char *portfile) {
    write_port(l, portfile);
    struct pollfd p = {.fd = l, .events = POLLIN};
    if (poll(&p, 1, 20000) != 1) die("poll");
    int c = accept(l, NULL, NULL);
    if (c < 0) die("accept");
    if (fcntl(c, F_SETFL, 0)) die("fcntl");
    return serve_fd(c);
}

/* A client whose connection the server has not accepted yet: what a ping
 * does once the test says so (stdin ends). */
static int hold(int port) {
    signal(SIGPIPE, SIG_IGN);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) die("connect");
    printf("connected\n");
    char b[64];
    while (read(0, b, sizeof b) > 0) {}
    struct pollfd p = {.fd = s, .events = POLLIN};
    int n = poll(&p, 1, 10000);
    ssize_t r = n == 1 ? recv(s, b, sizeof b, MSG_DONTWAIT) : -1;
    const char *re = n == 1 ? (r == 0 ? "eof" : r > 0 ? "data" : err(r)) : "timeout";
    ssize_t w = send(s, "ping1", 5, MSG_DONTWAIT);
    printf("held read=%s write=%s\n", re, err(w));
    return 0;
}

/* Accepts two connections, one forked child each (inetd: the child execs
 * `stdio` on it), and waits for both. */
static int server_fork(const char *portfile, const char *inetd) {
    int l = listen_loopback(portfile);
    pid_t kids[2];
    for (int i = 0; i < 2; i++) {
        int c = accept(l, NULL, NULL);
        if (c < 0) die("accept");
        fflush(stdout);
        kids[i] = fork();
        if (kids[i] < 0) die("fork");
        if (kids[i] == 0) {
            close(l);
            if (inetd) {
                if (dup2(c, 0) < 0 || dup2(c, 1) < 0) die("dup2");
                close(c);
                execv(inetd, (char *[]){(char *)inetd, "stdio", NULL});
                die("execv");
            }
            exit(serve_fd(c) ? 1 : 0);
        }
        close(c);
    }
    for (int i = 0; i < 2; i++) {
        int st;
        if (waitpid(kids[i], &st, 0) != kids[i] || !WIFEXITED(st) || WEXITSTATUS(st)) {
            printf("server child failed\n");
            return 1;
        }
    }
    printf("server done\n");
    return 0;
}

/* inetd's program: echoes stdin to stdout, then says how much on stderr. */
static int stdio(void) {
    char buf[256];
    long total = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n < 0) die("stdio read");
        if (n == 0) break;
        if (write(1, buf, n) != n) die("stdio write");
        total += n;
    }
    fprintf(stderr, "stdio eof after %ld\n", total);
    return 0;
}


static void ping(int s, const char *msg) {
    char buf[16] = {0};
    size_t n = strlen(msg), got = 0;
    if (write(s, msg, n) != (ssize_t)n) die("client write");
    while (got < n) {
        ssize_t r = read(s, buf + got, n - got);
        if (r <= 0) die("client read");
        got += r;
    }
    if (memcmp(buf, msg, n)) { fprintf(stderr, "wrong echo\n"); exit(2); }
}

static int client(int port, const char *mode, const char *self) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) die("connect");
    ping(s, "ping1");
    char fd[16];
    snprintf(fd, sizeof fd, "%d", s);
    fflush(stdout);
    if (!strcmp(mode, "self")) {
        execv(self, (char *[]){(char *)self, "after", fd, NULL});
        die("execv");
    }
    if (!strcmp(mode, "plain")) {
        execle(self, self, "after", fd, (char *)NULL, env_without_preload());
        die("execle");
    }
    if (!strcmp(mode, "spawn") || !strcmp(mode, "spawn-stdin")) {
        pid_t c;
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        int stdin_ = !strcmp(mode, "spawn-stdin");
        if (stdin_) {
            if (fcntl(s, F_SETFD, FD_CLOEXEC)) die("fcntl");
            posix_spawn_file_actions_adddup2(&fa, s, 0);
        }
        int e = posix_spawn(&c, self, &fa, NULL, (char *[]){(char *)self, "after", stdin_ ? "0" : fd, NULL}, environ);
        if (e) { errno = e; die("posix_spawn"); }
        posix_spawn_file_actions_destroy(&fa);
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
        if (stdin_ && !(fcntl(s, F_GETFD) & FD_CLOEXEC)) { fprintf(stderr, "close-on-exec lost\n"); return 1; }
        ping(s, "ping2");
        printf("parent ok\n");
        close(s);
        return 0;
    }
    if (!strcmp(mode, "system") || !strcmp(mode, "system-plain") || !strcmp(mode, "popen")) {
        char cmd[4096];
        snprintf(cmd, sizeof cmd, "%s'%s' after %s", strcmp(mode, "system-plain") ? "" : "env -u LD_PRELOAD ",
                 self, fd);
        int st;
        if (strcmp(mode, "popen")) {
            st = system(cmd);
        } else {
            FILE *f = popen(cmd, "r");
            if (!f) die("popen");
            char line[256];
            while (fgets(line, sizeof line, f)) fputs(line, stdout);
            st = pclose(f);
        }
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
        if (strcmp(mode, "popen")) {
            /* system()'s own contract, with the connection open: the
             * command's status, 127 for a shell that cannot run it, and
             * SIGINT's action as it was */
            st = system("exit 3");
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 3) { fprintf(stderr, "exit 3: %#x\n", st); return 1; }
            st = system("exec /nonexistent/program");
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 127) { fprintf(stderr, "127: %#x\n", st); return 1; }
            struct sigaction sa;
            if (sigaction(SIGINT, NULL, &sa) || sa.sa_handler != SIG_DFL) { fprintf(stderr, "SIGINT\n"); return 1; }
        }
        ping(s, "ping2");
        printf("parent ok\n");
        close(s);
        return 0;
    }
    if (!strcmp(mode, "vfork")) {
        /* (the child moves the descriptor before its exec, as a CGI
         * server or a shell's redirection does: a dup2 and a close in
         * memory it shares with the parent) */
        char *args[] = {(char *)self, "after", "100", NULL};
        pid_t c = vfork();
        if (c < 0) die("vfork");
        if (c == 0) {
            if (dup2(s, 100) != 100 || close(s)) _exit(126);
            execv(self, args);
            _exit(127);
        }
        int st;
        if (waitpid(c, &st, 0) != c || !WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
        ping(s, "ping2");
        printf("parent ok\n");
        close(s);
        return 0;
    }
    pid_t p = fork();
    if (p < 0) die("fork");
    if (p == 0 && !strcmp(mode, "use")) {
        /* the inherited connection, then one of the child's own */
        struct pollfd pf = {.fd = s, .events = POLLOUT};
        if (poll(&pf, 1, 5000) != 1 || !(pf.revents & POLLOUT)) die("child poll");
        /* a blocking read with SO_RCVTIMEO and nothing to read gives up
         * (EAGAIN), as on the TCP socket the child shares */
        struct timeval rt = {0, 150000};
        if (setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &rt, sizeof rt)) die("child SO_RCVTIMEO");
        char tb[8];
        ssize_t tr = read(s, tb, sizeof tb);
        if (tr != -1 || errno != EAGAIN) { fprintf(stderr, "child read with SO_RCVTIMEO: %zd %s\n", tr, strerror(errno)); exit(2); }
        rt.tv_usec = 0;
        if (setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &rt, sizeof rt)) die("child SO_RCVTIMEO 0");
        ping(s, "child1");
        printf("child ok\n");
        fflush(stdout);
        exit(pings(port));
    }
    if (!strcmp(mode, "both")) {
        size_t n = 1 << 20;
        char *b = malloc(n);
        if (!b) die("malloc");
        memset(b, p == 0 ? 'C' : 'P', n);
        for (size_t off = 0; off < n;) {
            ssize_t w = write(s, b + off, n - off);
            if (w <= 0) die(p == 0 ? "child write" : "parent write");
            off += w;
        }
        if (p == 0) _exit(0);
        int st;
        if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
        if (shutdown(s, SHUT_WR)) die("shutdown");
        size_t cp = 0, cc = 0, other = 0;
        for (;;) {
            ssize_t r = read(s, b, n);
            if (r < 0) die("parent read");
            if (r == 0) break;
            for (ssize_t i = 0; i < r; i++) {
                if (b[i] == 'P') cp++;
                else if (b[i] == 'C') cc++;
                else other++;
            }
        }
        printf("parent got P=%zu C=%zu other=%zu\n", cp, cc, other);
        close(s);
        return 0;
    }
    if (!strcmp(mode, "handoff")) {
        if (p > 0) {
            close(s);
            int st;
            if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
            printf("parent ok\n");
            return 0;
        }
        usleep(300000); /* (the parent's close first) */
        if (write(s, "child1", 6) != 6) die("child write");
        int ep = epoll_create1(0);
        struct epoll_event ev = {.events = EPOLLIN}, out;
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev)) die("epoll");
        if (epoll_wait(ep, &out, 1, 5000) != 1) die("child epoll_wait");
        char b[8] = {0};
        size_t got = 0;
        while (got < 6) {
            ssize_t r = read(s, b + got, 6 - got);
            if (r <= 0) die("child read");
            got += r;
        }
        if (memcmp(b, "child1", 6)) { fprintf(stderr, "wrong echo\n"); exit(2); }
        ping(s, "child2");
        /* sendfile into it, the echo read back */
        FILE *f = tmpfile();
        if (!f || fputs("child3", f) < 0 || fflush(f)) die("tmpfile");
        off_t at = 0;
        if (sendfile(s, fileno(f), &at, 6) != 6 || at != 6) die("child sendfile");
        got = 0;
        while (got < 6) {
            ssize_t r = read(s, b + got, 6 - got);
            if (r <= 0) die("child read");
            got += r;
        }
        if (memcmp(b, "child3", 6)) { fprintf(stderr, "wrong echo\n"); exit(2); }
        fclose(f);
        if (shutdown(s, SHUT_WR)) die("shutdown");
        ssize_t r = read(s, b, 1);
        if (r != 0) { fprintf(stderr, "no end: %zd\n", r); exit(2); }
        close(s);
        printf("child ok\n");
        return 0;
    }
    if (p == 0) {
        execv(self, (char *[]){(char *)self, "after", fd, NULL});
        die("execv");
    }
    int st;
    if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child failed\n"); return 1; }
    ping(s, "ping2");
    printf("parent ok\n");
    close(s);
    return 0;
}

static int pings(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) die("connect");
    ping(s, "ping1");
    ping(s, "ping2");
    close(s);
    printf("pings ok\n");
    return 0;
}

static int after(int fd) {
    signal(SIGPIPE, SIG_IGN);
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLOUT};
    int n = poll(&p, 1, 5000);
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
    const char *re = err(r);
    ssize_t w = send(fd, "x", 1, MSG_DONTWAIT);
    const char *we = err(w);
    struct sockaddr_storage a;
    socklen_t al = sizeof a;
    int g = getpeername(fd, (struct sockaddr *)&a, &al);
    printf("after poll=%d hup=%d read=%s write=%s peer=%s\n", n, !!(p.revents & POLLHUP), re, we,
           g == 0 ? "ok" : err(-1));
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 3 && !strcmp(argv[1], "server")) return server(argv[2], NULL, 0);
    if (argc >= 3 && !strcmp(argv[1], "server2")) return server(argv[2], NULL, 1);
    if (argc >= 3 && !strcmp(argv[1], "server-fork")) return server_fork(argv[2], NULL);
    if (argc >= 3 && !strcmp(argv[1], "server-inetd")) return server_fork(argv[2], argv[0]);
    if (argc >= 2 && !strcmp(argv[1], "stdio")) return stdio();
    if (argc >= 3 && !strcmp(argv[1], "server-exec")) return server(argv[2], argv[0], 0);
    if (argc >= 4 && !strcmp(argv[1], "server-static")) return server_plain(argv[2], "static", argv[3], argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-noenv")) return server_plain(argv[2], "noenv", NULL, argv[0]);
    if (argc >= 4 && !strcmp(argv[1], "server-spawn")) return server_plain(argv[2], "spawn", argv[3], argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-execfail")) return server_plain(argv[2], "execfail", NULL, argv[0]);
    if (argc >= 4 && !strcmp(argv[1], "server-leak")) return server_plain(argv[2], "leak", argv[3], argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-system")) return server_plain(argv[2], "system", NULL, argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-popen")) return server_plain(argv[2], "popen", NULL, argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-system-env")) return server_plain(argv[2], "system-env", NULL, argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "server-queue")) return server_queue(argv[2], argv[0], 1, 0);
    if (argc >= 3 && !strcmp(argv[1], "server-queue-blocking")) return server_queue(argv[2], argv[0], 0, 0);
    if (argc >= 3 && !strcmp(argv[1], "server-queue-plain")) return server_queue(argv[2], argv[0], 0, 1);
    if (argc >= 4 && !strcmp(argv[1], "serve-poll")) return serve_poll(atoi(argv[2]), argv[3]);
    if (argc >= 3 && !strcmp(argv[1], "hold")) return hold(atoi(argv[2]));
    if (argc >= 2 && !strcmp(argv[1], "idle")) return 0;
    if (argc >= 4 && !strcmp(argv[1], "serve")) write_port(atoi(argv[2]), argv[3]);
    if (argc >= 3 && !strcmp(argv[1], "serve")) return serve(atoi(argv[2]));
    if (argc >= 3 && !strcmp(argv[1], "pings")) return pings(atoi(argv[2]));
    if (argc >= 4 && !strcmp(argv[1], "client")) return client(atoi(argv[2]), argv[3], argv[0]);
    if (argc >= 3 && !strcmp(argv[1], "after")) return after(atoi(argv[2]));
    fprintf(stderr, "usage: see exec.c\n");
    return 2;
}
