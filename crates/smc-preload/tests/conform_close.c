/* Conformance of the ends of connections and listeners: shutdown, close with
 * SO_LINGER 0, connect(AF_UNSPEC), shutdown of a listening socket, and a
 * connect to the program's own listener before it accepts. Prints one line
 * per call (result or errno name, readiness events), so that a run under
 * smc_run can be compared with a plain run (tests/calls_close.rs asserts
 * identical output). Both ends of each connection live in this process; each
 * wait for an event is bounded, and what is printed does not depend on
 * timing. It knows nothing of SMC. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *m) { fprintf(stderr, "%s: %s\n", m, strerror(errno)); exit(2); }

static long show(const char *name, long r) {
    if (r < 0)
        printf("%s = -1 %s\n", name, strerrorname_np(errno));
    else
        printf("%s = %ld\n", name, r);
    fflush(stdout);
    return r;
}

static const short ALL = POLLIN | POLLPRI | POLLOUT | POLLRDHUP;

static void show_revents(const char *name, short r) {
    printf("%s:%s%s%s%s%s%s\n", name, r & POLLIN ? " IN" : "", r & POLLPRI ? " PRI" : "",
           r & POLLOUT ? " OUT" : "", r & POLLERR ? " ERR" : "", r & POLLHUP ? " HUP" : "",
           r & POLLRDHUP ? " RDHUP" : "");
    fflush(stdout);
}

/* what poll shows of fd for `events`, once it shows all of `until` (or 5 s
 * passed): the state an event brings, whenever it arrives */
static void poll_until(const char *name, int fd, short events, short until) {
    struct pollfd p = { fd, events, 0 };
    for (int i = 0; i < 500; i++) {
        p.revents = 0;
        if (poll(&p, 1, 10) < 0)
            die("poll");
        if ((p.revents & until) == until)
            break;
    }
    show_revents(name, p.revents);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* a listener on 127.0.0.1, blocking */
static int listener(struct sockaddr_in *a) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    socklen_t al = sizeof *a;
    *a = (struct sockaddr_in){ AF_INET, 0, { htonl(INADDR_LOOPBACK) } };
    if (l < 0 || bind(l, (void *)a, sizeof *a) || listen(l, 8) || getsockname(l, (void *)a, &al))
        die("listener");
    return l;
}

/* a connection to the program's own listener, connected before it is
 * accepted (blocking connect, then accept) */
static void pair(int *c, int *s) {
    struct sockaddr_in a;
    int l = listener(&a);
    *c = socket(AF_INET, SOCK_STREAM, 0);
    if (*c < 0 || connect(*c, (void *)&a, sizeof a))
        die("connect");
    *s = accept(l, NULL, NULL);
    if (*s < 0)
        die("accept");
    close(l);
}

static void recv_show(const char *name, int fd, int flags) {
    char b[32];
    long n = recv(fd, b, sizeof b, flags);
    if (n < 0)
        printf("%s = -1 %s\n", name, strerrorname_np(errno));
    else
        printf("%s = %ld '%.*s'\n", name, n, (int)n, b);
    fflush(stdout);
}

/* SO_ERROR of fd, printed as "SO_ERROR <what>: <error or 0>" */
static void so_error(const char *what, int fd) {
    int e = -1;
    socklen_t el = sizeof e;
    show("getsockopt SO_ERROR", getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el));
    printf("SO_ERROR %s: %s\n", what, e ? strerrorname_np(e) : "0");
    fflush(stdout);
}

static int waited_fd;
static void *blocked_read(void *arg) {
    char b[8];
    long n = read(waited_fd, b, sizeof b);
    *(long *)arg = n < 0 ? -errno : n;
    return NULL;
}

/* reads fd to its end 4 s from now; the bytes read */
static int late_fd;
static void *late_reader(void *arg) {
    static char b[65536];
    long *got = arg, n;
    usleep(4000000);
    while ((n = read(late_fd, b, sizeof b)) > 0)
        *got += n;
    return NULL;
}

static int listening;
static void *blocked_poll(void *arg) {
    struct pollfd p = { listening, POLLIN, 0 };
    int n = poll(&p, 1, 5000);
    *(short *)arg = n > 0 ? p.revents : 0;
    return NULL;
}

int main(void) {
    int c, s;
    char b[8];

    /* own SHUT_RD: a reader waiting in another thread returns 0, reads
     * return 0, what the peer still sends is read */
    pair(&c, &s);
    long got = 99;
    pthread_t t;
    waited_fd = c;
    pthread_create(&t, NULL, blocked_read, &got);
    usleep(100000);
    show("shutdown SHUT_RD", shutdown(c, SHUT_RD));
    pthread_join(t, NULL);
    printf("waiting read returned %ld\n", got);
    poll_until("poll after SHUT_RD", c, ALL, POLLIN | POLLRDHUP);
    show("read after SHUT_RD", read(c, b, sizeof b));
    show("peer writes", write(s, "late", 4));
    poll_until("poll with data after SHUT_RD", c, ALL, POLLIN);
    recv_show("read what came", c, MSG_DONTWAIT);
    show("shutdown SHUT_WR too", shutdown(c, SHUT_WR));
    poll_until("poll both shut here", c, ALL, POLLHUP);
    recv_show("recv both shut here", c, MSG_DONTWAIT);
    close(c);
    close(s);

    /* both directions shut, one by each side: over */
    pair(&c, &s);
    show("client SHUT_WR", shutdown(c, SHUT_WR));
    show("server reads the end", read(s, b, sizeof b));
    show("server SHUT_WR", shutdown(s, SHUT_WR));
    show("client reads the end", read(c, b, sizeof b));
    poll_until("client poll over", c, ALL, POLLHUP);
    show("client shutdown again", shutdown(c, SHUT_RDWR));
    poll_until("server poll over", s, ALL, POLLHUP);
    show("server shutdown again", shutdown(s, SHUT_RDWR));
    close(c);
    close(s);

    /* the peer closes with SO_LINGER on and 0 s: a reset */
    pair(&c, &s);
    struct linger lg = { 1, 0 };
    show("setsockopt SO_LINGER 0", setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg));
    close(s);
    poll_until("poll after the reset", c, ALL, POLLHUP | POLLERR);
    poll_until("poll after the reset, no events asked", c, 0, POLLHUP | POLLERR);
    recv_show("read after the reset", c, MSG_DONTWAIT);
    /* the error is reported once, as TCP's sk_err */
    recv_show("read again after the reset", c, MSG_DONTWAIT);
    show("send after the reset", send(c, "x", 1, MSG_NOSIGNAL));
    poll_until("poll after the reset was reported", c, ALL, POLLHUP);
    show("shutdown after the reset", shutdown(c, SHUT_WR));
    close(c);

    /* SO_LINGER with a timeout: the close waits for the data to leave (up
     * to the timeout), here until the peer reads, 4 s later; the peer gets
     * all of it */
    {
        static char big[65536];
        long sent = 0, got = 0;
        pair(&c, &s);
        if (fcntl(c, F_SETFL, O_NONBLOCK))
            die("fcntl");
        for (;;) {
            long w = write(c, big, sizeof big);
            if (w <= 0)
                break;
            sent += w;
        }
        if (fcntl(c, F_SETFL, 0))
            die("fcntl");
        struct linger lg8 = { 1, 8 };
        show("setsockopt SO_LINGER 8", setsockopt(c, SOL_SOCKET, SO_LINGER, &lg8, sizeof lg8));
        late_fd = s;
        pthread_create(&t, NULL, late_reader, &got);
        double t0 = now();
        show("close with unsent data", close(c));
        printf("close waited for the reader: %s\n", now() - t0 >= 3.5 ? "yes" : "no");
        pthread_join(t, NULL);
        printf("the reader got all: %s\n", got == sent ? "yes" : "no");
        close(s);
    }

    /* accepted sockets take SO_LINGER from their listener */
    {
        struct sockaddr_in a;
        int l = listener(&a);
        show("listener SO_LINGER 0", setsockopt(l, SOL_SOCKET, SO_LINGER, &lg, sizeof lg));
        c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (void *)&a, sizeof a))
            die("connect");
        s = accept(l, NULL, NULL);
        close(l);
        close(s);
        poll_until("poll after the inherited reset", c, ALL, POLLHUP | POLLERR);
        for (int i = 0; i < 2; i++)
            so_error("after the inherited reset", c);
        recv_show("read after SO_ERROR took the reset", c, MSG_DONTWAIT);
        close(c);
    }

    /* a write after the peer closed: TCP's succeeds, and its data draws
     * the peer's reset, which in CLOSE_WAIT makes the socket's error EPIPE
     * and ends it (reads still find the end of file); once with a write
     * taking the error, once with SO_ERROR, once with a sendfile() of a
     * 64 KiB file and once with a splice() from a pipe as the first write */
    for (int how = 0; how < 4; how++) {
        pair(&c, &s);
        close(s);
        poll_until("poll after the peer's close", c, ALL, POLLIN | POLLRDHUP);
        if (how < 2) {
            show("send after the peer's close", send(c, "late", 4, MSG_NOSIGNAL));
        } else if (how == 3) {
            int pp[2];
            if (pipe(pp) || write(pp[1], "late", 4) != 4)
                die("pipe");
            show("splice after the peer's close", splice(pp[0], NULL, c, NULL, 4, 0));
            close(pp[0]);
            close(pp[1]);
        } else {
            static char big[65536];
            FILE *t = tmpfile();
            if (!t || fwrite(big, 1, sizeof big, t) != sizeof big || fflush(t))
                die("tmpfile");
            off_t off = 0;
            show("sendfile after the peer's close", sendfile(c, fileno(t), &off, sizeof big));
            printf("its offset after = %ld\n", (long)off);
            fclose(t);
        }
        poll_until("poll after the send drew a reset", c, ALL, POLLHUP | POLLERR);
        recv_show("read after the drawn reset", c, MSG_DONTWAIT);
        if (how != 1) {
            show("send after the drawn reset", send(c, "x", 1, MSG_NOSIGNAL));
        } else {
            so_error("after the drawn reset", c);
        }
        poll_until("poll after the error was taken", c, ALL, POLLHUP);
        show("send again after the drawn reset", send(c, "x", 1, MSG_NOSIGNAL));
        recv_show("read again after the drawn reset", c, MSG_DONTWAIT);
        close(c);
    }

    /* the peer's reset after its end of stream (it shut down writing, then
     * closed with our data unread): TCP's FIN and then its RST. In
     * CLOSE_WAIT the reset's error is EPIPE, and reads still find the end
     * of file; once taken by a send, once by SO_ERROR. Then the same reset
     * after both sides ended their streams: TCP's peer sends none from a
     * connection that is over, nothing fails. */
    for (int how = 0; how < 3; how++) {
        pair(&c, &s);
        show("send what the peer leaves unread", send(c, "unread", 6, 0));
        poll_until("peer poll with the data", s, POLLIN, POLLIN);
        show("peer shutdown SHUT_WR", shutdown(s, SHUT_WR));
        poll_until("poll after the peer's end", c, ALL, POLLIN | POLLRDHUP);
        if (how == 2) {
            show("shutdown SHUT_WR after the peer's end", shutdown(c, SHUT_WR));
            poll_until("peer poll after our end", s, ALL, POLLRDHUP);
        }
        close(s);
        if (how < 2)
            poll_until("poll after the end and reset", c, ALL, POLLERR);
        else
            usleep(200000);
        poll_until("poll after it", c, ALL, 0);
        recv_show("read after the end and reset", c, MSG_DONTWAIT);
        if (how == 0) {
            show("send after the end and reset", send(c, "x", 1, MSG_NOSIGNAL));
        } else {
            so_error("after the end and reset", c);
        }
        poll_until("poll after the error was taken", c, ALL, 0);
        show("send again after the end and reset", send(c, "x", 1, MSG_NOSIGNAL));
        recv_show("read again after the end and reset", c, MSG_DONTWAIT);
        close(c);
    }

    /* data after our own shutdown of both directions: TCP's socket, in
     * FIN_WAIT with its receiving shut down, answers it with a reset
     * (tcp_input.c, TCPAbortOnData): ECONNRESET here, once, then the end;
     * the peer, which had our FIN, takes EPIPE */
    for (int how = 0; how < 2; how++) {
        pair(&c, &s);
        if (how == 0) {
            show("shutdown SHUT_RDWR", shutdown(c, SHUT_RDWR));
        } else {
            show("shutdown SHUT_RD", shutdown(c, SHUT_RD));
            show("shutdown SHUT_WR after SHUT_RD", shutdown(c, SHUT_WR));
        }
        poll_until("peer poll after our shutdown", s, ALL, POLLRDHUP);
        show("peer send after our shutdown", send(s, "hello", 5, MSG_NOSIGNAL));
        poll_until("poll after the peer's data", c, ALL, POLLERR);
        poll_until("peer poll after its data", s, ALL, POLLERR);
        recv_show("read after the reset", c, MSG_DONTWAIT);
        recv_show("read again after the reset", c, MSG_DONTWAIT);
        show("send after the reset", send(c, "x", 1, MSG_NOSIGNAL));
        poll_until("poll after the reset was taken", c, ALL, 0);
        show("peer send after the reset", send(s, "x", 1, MSG_NOSIGNAL));
        show("peer send again after the reset", send(s, "x", 1, MSG_NOSIGNAL));
        recv_show("peer read after the reset", s, MSG_DONTWAIT);
        poll_until("peer poll after the reset was taken", s, ALL, 0);
        close(c);
        close(s);
    }

    /* a peer process that closes (or shuts down writing) and exits: its
     * kernel keeps what is left of a TCP connection, so nothing shows but
     * the end of file, until a write draws the reset (EPIPE) */
    for (int how = 0; how < 2; how++) {
        struct sockaddr_in a;
        int l = listener(&a);
        fflush(stdout);
        pid_t kid = fork();
        if (kid < 0)
            die("fork");
        if (kid == 0) {
            int k = accept(l, NULL, NULL);
            if (k < 0 || send(k, "bye", 3, 0) != 3)
                _exit(1);
            if (how == 0)
                close(k);
            else
                shutdown(k, SHUT_WR);
            _exit(0);
        }
        close(l);
        c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0 || connect(c, (void *)&a, sizeof a))
            die("connect");
        int st;
        if (waitpid(kid, &st, 0) != kid || st != 0)
            die("the peer process");
        poll_until("poll after the peer process went", c, ALL, POLLIN | POLLRDHUP);
        usleep(200000);
        poll_until("poll a while after", c, ALL, 0);
        recv_show("read what the gone peer sent", c, 0);
        recv_show("read after", c, MSG_DONTWAIT);
        so_error("with the peer process gone", c);
        show("send to the gone peer", send(c, "x", 1, MSG_NOSIGNAL));
        poll_until("poll after the send to the gone peer", c, ALL, POLLERR);
        show("send again to the gone peer", send(c, "x", 1, MSG_NOSIGNAL));
        recv_show("read after the sends", c, MSG_DONTWAIT);
        close(c);
    }

    /* connect(AF_UNSPEC) dissolves the connection (a reset for the peer);
     * the socket then connects elsewhere, and its data goes there */
    {
        int s1, s2;
        pair(&c, &s1);
        struct sockaddr un = { AF_UNSPEC };
        show("connect AF_UNSPEC", connect(c, &un, sizeof un));
        poll_until("old peer poll", s1, ALL, POLLHUP | POLLERR);
        struct sockaddr_in a;
        int l = listener(&a);
        show("connect elsewhere", connect(c, (void *)&a, sizeof a));
        s2 = accept(l, NULL, NULL);
        close(l);
        show("write", write(c, "new", 3));
        poll_until("new peer poll", s2, POLLIN, POLLIN);
        recv_show("new peer reads", s2, MSG_DONTWAIT);
        recv_show("old peer reads", s1, MSG_DONTWAIT);
        close(c);
        close(s1);
        close(s2);
    }

    /* shutdown of a listening socket wakes a thread polling it; accept
     * fails then (blocking, and non-blocking as an event loop's) */
    for (int nb = 0; nb < 2; nb++) {
        struct sockaddr_in a;
        listening = listener(&a);
        if (nb && fcntl(listening, F_SETFL, O_NONBLOCK))
            die("fcntl");
        short rev = 0;
        pthread_create(&t, NULL, blocked_poll, &rev);
        usleep(100000);
        double t0 = now();
        show("shutdown listener", shutdown(listening, SHUT_RDWR));
        pthread_join(t, NULL);
        printf("poller of a %s listener woken: %s, HUP %d\n", nb ? "non-blocking" : "blocking",
               now() - t0 < 2.5 ? "at once" : "late", !!(rev & POLLHUP));
        show("accept after shutdown", accept(listening, NULL, NULL));
        close(listening);
    }
    /* the reset seen first by SO_ERROR, with no poll before it */
    pair(&c, &s);
    show("setsockopt SO_LINGER 0 (no poll)", setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg));
    close(s);
    {
        int e = 0;
        for (int i = 0; i < 500 && !e; i++) {
            socklen_t el = sizeof e;
            if (getsockopt(c, SOL_SOCKET, SO_ERROR, &e, &el))
                die("getsockopt");
            if (!e)
                usleep(10000);
        }
        printf("SO_ERROR of a reset not polled: %s\n", e ? strerrorname_np(e) : "0");
        socklen_t el = sizeof e;
        getsockopt(c, SOL_SOCKET, SO_ERROR, &e, &el);
        printf("SO_ERROR again: %s\n", e ? strerrorname_np(e) : "0");
    }
    close(c);

    /* splice into a pipe with less room than asked for: what fits */
    {
        int q[2];
        static char big[65536];
        pair(&c, &s);
        if (pipe(q) || fcntl(q[1], F_SETPIPE_SZ, 4096) < 0)
            die("pipe");
        if (write(s, big, sizeof big) != (long)sizeof big)
            die("write");
        poll_until("poll before the splice", c, POLLIN, POLLIN);
        usleep(100000);
        show("splice into a 4 KiB pipe", splice(c, NULL, q[1], NULL, sizeof big, 0));
        close(q[0]);
        close(q[1]);
        close(c);
        close(s);
    }

    /* a blocking accept bounded by the listener's SO_RCVTIMEO (a listener
     * whose first connection came from this process: its driver's) */
    {
        struct sockaddr_in a;
        int l = listener(&a);
        c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (void *)&a, sizeof a))
            die("connect");
        s = accept(l, NULL, NULL);
        struct timeval tv = { 0, 200000 };
        show("listener SO_RCVTIMEO", setsockopt(l, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv));
        double t0 = now();
        show("accept with nothing to accept", accept(l, NULL, NULL));
        printf("accept returned after the timeout: %s\n",
               now() - t0 >= 0.15 && now() - t0 < 2.5 ? "yes" : "no");
        /* splice with no pipe: refused, as TCP's */
        FILE *f = tmpfile();
        if (!f)
            die("tmpfile");
        show("peer writes for splice", write(s, "spliced", 7));
        poll_until("poll before splice to a file", c, POLLIN, POLLIN);
        show("splice socket to a file", splice(c, NULL, fileno(f), NULL, 7, 0));
        recv_show("read what splice left", c, MSG_DONTWAIT);
        fclose(f);
        close(c);
        close(s);
        close(l);
    }

    /* accept out of descriptors (EMFILE): the connection waits for the next
     * accept, as in the kernel's queue; once there are descriptors again,
     * every connection is there and carries its byte */
    {
        enum { N = 8 };
        struct sockaddr_in a;
        int l = listener(&a), cs[N], ss[N], got = 0, emfile = 0;
        if (fcntl(l, F_SETFL, O_NONBLOCK))
            die("fcntl");
        poll(&(struct pollfd){ l, POLLIN, 0 }, 1, 0);
        for (int i = 0; i < N; i++) {
            cs[i] = socket(AF_INET, SOCK_STREAM, 0);
            if (cs[i] < 0 || connect(cs[i], (void *)&a, sizeof a))
                die("connect");
        }
        /* (a connect returns once the client's part of the handshake is
         * done; the server's end of it, which under smc_run takes
         * descriptors of this process, is given time to finish before
         * the limit leaves it none: see the preload's README, "Not yet") */
        usleep(300000);
        struct rlimit was, low;
        if (getrlimit(RLIMIT_NOFILE, &was))
            die("getrlimit");
        /* the lowest free descriptor: with one more, the limit is reached */
        int probe = dup(0);
        close(probe);
        low = was;
        low.rlim_cur = probe + 1;
        if (setrlimit(RLIMIT_NOFILE, &low))
            die("setrlimit");
        for (int tries = 0; tries < 500 && got < N; tries++) {
            int fd = accept(l, NULL, NULL);
            if (fd >= 0)
                ss[got++] = fd;
            else if (errno == EMFILE) {
                emfile = 1;
                break;
            } else
                usleep(10000);
        }
        if (setrlimit(RLIMIT_NOFILE, &was))
            die("setrlimit");
        printf("accept ran out of descriptors before all: %d\n", emfile && got < N);
        for (int tries = 0; tries < 500 && got < N; tries++) {
            poll(&(struct pollfd){ l, POLLIN, 0 }, 1, 10);
            int fd = accept(l, NULL, NULL);
            if (fd >= 0)
                ss[got++] = fd;
        }
        printf("accepted after: %d of %d\n", got, N);
        int carried = 0;
        for (int i = 0; i < N; i++)
            if (write(cs[i], "x", 1) != 1)
                die("write");
        for (int i = 0; i < got; i++) {
            char c;
            struct pollfd p = { ss[i], POLLIN, 0 };
            if (poll(&p, 1, 5000) == 1 && read(ss[i], &c, 1) == 1 && c == 'x')
                carried++;
        }
        printf("connections that carried their byte: %d\n", carried);
        for (int i = 0; i < N; i++)
            close(cs[i]);
        for (int i = 0; i < got; i++)
            close(ss[i]);
        close(l);
    }
    return 0;
}
