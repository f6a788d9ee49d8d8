/* The preload's conformance test of the read/write family's edges: reads
 * and writes of nothing, NULL buffers, MSG_TRUNC, iovec counts,
 * MSG_ERRQUEUE, MSG_PEEK|MSG_WAITALL, what recvmsg and recvfrom write back,
 * and what a one-shot epoll registration reports while writes arrive, each
 * call's result printed one per line ("NAME = R" or "NAME = -1 ERRNO"),
 * so that a run under smc_run can be compared with a plain run (the test,
 * calls_rw.rs, asserts identical output). Both ends of each connection live
 * in this process (a listener on 127.0.0.1:0, connect, accept); where a
 * call must find bytes, the script waits until FIONREAD shows them, and a
 * call that must wait is woken by a thread that writes 200 ms later (the
 * line says whether it waited, by the clock: at least 100 ms), so the
 * output does not depend on timing. Last, a forked child makes some of the
 * calls on a connection of its parent's. It knows nothing of SMC.
 *   conform_rw */
#define _GNU_SOURCE
#ifndef _FORTIFY_SOURCE
#define _FORTIFY_SOURCE 2
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *who = "main";

/* a NULL and a negative count the compiler cannot see (the calls below
 * pass them on purpose) */
static void *volatile nul;
static volatile int minus_one = -1;

/* iovecs of one byte each, more than IOV_MAX */
static struct iovec v1[1100];
static char x1[1100];

static void die(const char *m) { fprintf(stderr, "%s: %s: %s\n", who, m, strerror(errno)); exit(2); }

/* a call's result: "NAME = R" or "NAME = -1 ERRNO" */
static long show(const char *name, long r) {
    if (r < 0)
        printf("%s %s = -1 %s\n", who, name, strerrorname_np(errno));
    else
        printf("%s %s = %ld\n", who, name, r);
    fflush(stdout);
    return r;
}

/* a read's result with the bytes it returned */
static void show_bytes(const char *name, long r, const char *b) {
    if (r < 0)
        printf("%s %s = -1 %s\n", who, name, strerrorname_np(errno));
    else
        printf("%s %s = %ld '%.*s'\n", who, name, r, (int)r, b);
    fflush(stdout);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int inq(int fd) {
    int q = -1;
    if (ioctl(fd, FIONREAD, &q) < 0) die("FIONREAD");
    return q;
}

static void show_inq(const char *name, int fd) {
    printf("%s %s FIONREAD %d\n", who, name, inq(fd));
    fflush(stdout);
}

/* waits until fd has `n` bytes to read */
static void arrive(int fd, int n) {
    for (int i = 0; i < 1000; i++) {
        if (inq(fd) >= n) return;
        struct pollfd p = { fd, POLLIN, 0 };
        poll(&p, 1, 10);
        usleep(1000);
    }
    fprintf(stderr, "%s: %d bytes never came (%d)\n", who, n, inq(fd));
    exit(3);
}

static void write_all(int fd, const void *b, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = write(fd, (const char *)b + done, n - done);
        if (r <= 0) die("write");
        done += r;
    }
}

/* takes everything there is to read */
static void empty(int fd) {
    char b[4096];
    while (recv(fd, b, sizeof b, MSG_DONTWAIT) > 0) {}
}

/* a thread that writes `data` to `fd` after 200 ms */
struct late { int fd; const char *data; size_t n; pthread_t t; };
static void *late_thread(void *arg) {
    struct late *l = arg;
    usleep(200000);
    write_all(l->fd, l->data, l->n);
    return NULL;
}
static void late_write(struct late *l, int fd, const char *data, size_t n) {
    l->fd = fd; l->data = data; l->n = n;
    if (pthread_create(&l->t, NULL, late_thread, l)) die("pthread_create");
}
static void late_join(struct late *l) { pthread_join(l->t, NULL); }

static void show_waited(const char *name, double since) {
    printf("%s %s waited %s\n", who, name, now() - since >= 0.1 ? "yes" : "no");
    fflush(stdout);
}

static void set_rcvtimeo(int fd, long us) {
    struct timeval tv = { us / 1000000, us % 1000000 };
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv)) die("SO_RCVTIMEO");
}

static void set_nonblock(int fd, int on) {
    int fl = fcntl(fd, F_GETFL);
    if (fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK)) die("F_SETFL");
}

static volatile sig_atomic_t sigpipes;
static void on_sigpipe(int s) { (void)s; sigpipes++; }

/* a connection, both ends: *c connected, *s accepted. The listener is
 * non-blocking and polled before the connect, as an event loop's would be,
 * so that a connect in this thread does not wait for the accept. */
static void pair(int *c, int *s) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    if (l < 0) die("socket");
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t al = sizeof a;
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 8) ||
        getsockname(l, (struct sockaddr *)&a, &al))
        die("listen");
    set_nonblock(l, 1);
    struct pollfd p = { l, POLLIN, 0 };
    poll(&p, 1, 0);
    *c = socket(AF_INET, SOCK_STREAM, 0);
    if (*c < 0 || connect(*c, (struct sockaddr *)&a, sizeof a)) die("connect");
    p.revents = 0;
    if (poll(&p, 1, 10000) != 1) die("poll listener");
    *s = accept(l, NULL, NULL);
    if (*s < 0) die("accept");
    close(l);
}

/* 1. reads of nothing: recv waits for bytes as any read does (EAGAIN
 * without), then returns 0; read and readv of nothing return 0 at once */
static void zero_length(int c, int s) {
    char b[16];
    struct iovec z = { b, 0 };
    struct msghdr m = { .msg_iov = &z, .msg_iovlen = 0 };
    show("recv(c, 0, MSG_DONTWAIT) empty", recv(c, b, 0, MSG_DONTWAIT));
    show("recv(c, 0, MSG_PEEK|MSG_DONTWAIT) empty", recv(c, b, 0, MSG_PEEK | MSG_DONTWAIT));
    show("recvfrom(c, 0, MSG_DONTWAIT) empty", recvfrom(c, b, 0, MSG_DONTWAIT, NULL, NULL));
    show("recvmsg(c, iovlen 0, MSG_DONTWAIT) empty", recvmsg(c, &m, MSG_DONTWAIT));
    show("read(c, 0) empty", read(c, b, 0));
    show("readv(c, {b,0}) empty", readv(c, &z, 1));
    show("readv(c, 0 iovecs) empty", readv(c, &z, 0));
    set_nonblock(c, 1);
    show("recv(c, 0) O_NONBLOCK empty", recv(c, b, 0, 0));
    show("read(c, 0) O_NONBLOCK empty", read(c, b, 0));
    set_nonblock(c, 0);

    struct late l;
    double t = now();
    late_write(&l, s, "x", 1);
    show("recv(c, 0) blocking", recv(c, b, 0, 0));
    show_waited("recv(c, 0) blocking", t);
    late_join(&l);
    arrive(c, 1);
    show("recv(c, 0) with data", recv(c, b, 0, 0));
    show("recv(c, 0, MSG_PEEK) with data", recv(c, b, 0, MSG_PEEK));
    show("recvmsg(c, iovlen 0) with data", recvmsg(c, &m, 0));
    show_inq("after reads of nothing", c);
    empty(c);

    t = now();
    late_write(&l, s, "y", 1);
    show("recv(c, 0, MSG_PEEK) blocking", recv(c, b, 0, MSG_PEEK));
    show_waited("recv(c, 0, MSG_PEEK) blocking", t);
    late_join(&l);
    arrive(c, 1);
    empty(c);

    set_rcvtimeo(c, 200000);
    t = now();
    show("recv(c, 0) SO_RCVTIMEO empty", recv(c, b, 0, 0));
    show_waited("recv(c, 0) SO_RCVTIMEO empty", t);
    set_rcvtimeo(c, 0);

    /* writes of nothing */
    show("write(c, 0)", write(c, b, 0));
    show("send(c, 0)", send(c, b, 0, 0));
    show("writev(c, 0 iovecs)", writev(c, &z, 0));
    show("sendmsg(c, iovlen 0)", sendmsg(c, &m, 0));
}

/* 2. NULL buffers with a length: a read waits as any read does and then
 * faults (EFAULT, nothing taken; 0 at the end of the stream); a write
 * faults and sends nothing */
static void null_buffers(int c, int s) {
    char b[16];
    show("recv(c, NULL, 4, MSG_DONTWAIT) empty", recv(c, nul, 4, MSG_DONTWAIT));
    set_nonblock(c, 1);
    show("read(c, NULL, 4) O_NONBLOCK empty", read(c, nul, 4));
    set_nonblock(c, 0);
    write_all(s, "0123456789", 10);
    arrive(c, 10);
    show("read(c, NULL, 4)", read(c, nul, 4));
    show("recv(c, NULL, 4, 0)", recv(c, nul, 4, 0));
    show("recv(c, NULL, 4, MSG_PEEK)", recv(c, nul, 4, MSG_PEEK));
    show("read(c, NULL, 0)", read(c, nul, 0));
    show("recv(c, NULL, 0, 0)", recv(c, nul, 0, 0));
    struct iovec v2[2] = { { b, 3 }, { nul, 5 } };
    show("readv(c, {b,3},{NULL,5})", readv(c, v2, 2));
    struct msghdr m = { .msg_iov = v2, .msg_iovlen = 2 };
    show("recvmsg(c, {b,3},{NULL,5})", recvmsg(c, &m, 0));
    show_inq("after NULL reads", c);
    memset(b, 0, sizeof b);
    show_bytes("read(c, 10)", read(c, b, 10), b);

    double t = now();
    struct late l;
    late_write(&l, s, "late", 4);
    show("read(c, NULL, 4) blocking", read(c, nul, 4));
    show_waited("read(c, NULL, 4) blocking", t);
    late_join(&l);
    show_inq("after the blocking NULL read", c);
    empty(c);

    show("readv(c, NULL, 1)", readv(c, nul, 1));
    show("writev(c, NULL, 1)", writev(c, nul, 1));
    m.msg_iov = nul;
    m.msg_iovlen = 1;
    show("recvmsg(c, msg_iov NULL, 1)", recvmsg(c, &m, MSG_DONTWAIT));
    show("sendmsg(c, msg_iov NULL, 1)", sendmsg(c, &m, 0));

    show("write(c, NULL, 4)", write(c, nul, 4));
    show("send(c, NULL, 4, 0)", send(c, nul, 4, 0));
    show("sendto(c, NULL, 4, 0)", sendto(c, nul, 4, 0, NULL, 0));
    struct iovec w2[2] = { { "abc", 3 }, { nul, 5 } };
    show("writev(c, {abc,3},{NULL,5})", writev(c, w2, 2));
    m.msg_iov = w2;
    m.msg_iovlen = 2;
    show("sendmsg(c, {abc,3},{NULL,5})", sendmsg(c, &m, 0));
    show("write(c, NULL, 0)", write(c, nul, 0));
    /* none of it went: the peer's next bytes are the marker */
    write_all(c, "Z", 1);
    arrive(s, 1);
    memset(b, 0, sizeof b);
    show_bytes("peer read after the NULL writes", recv(s, b, sizeof b, MSG_DONTWAIT), b);
}

/* 3. MSG_TRUNC: takes the bytes without copying them (the buffer is not
 * touched, may be NULL), and counts them; with MSG_PEEK only counts */
static void msg_trunc(int c, int s) {
    char b[16];
    write_all(s, "0123456789", 10);
    arrive(c, 10);
    show("recv(c, NULL, 4, MSG_TRUNC)", recv(c, nul, 4, MSG_TRUNC));
    strcpy(b, "xxx");
    show("recv(c, b, 2, MSG_TRUNC)", recv(c, b, 2, MSG_TRUNC));
    printf("%s b after MSG_TRUNC '%s'\n", who, b);
    show("recv(c, NULL, 100, MSG_PEEK|MSG_TRUNC)", recv(c, nul, 100, MSG_PEEK | MSG_TRUNC));
    show_inq("after MSG_PEEK|MSG_TRUNC", c);
    memset(b, 0, sizeof b);
    show_bytes("read(c, 1)", read(c, b, 1), b);
    show("recv(c, NULL, 100, MSG_TRUNC)", recv(c, nul, 100, MSG_TRUNC));
    show_inq("after MSG_TRUNC", c);
    show("recv(c, NULL, 4, MSG_TRUNC|MSG_DONTWAIT) empty", recv(c, nul, 4, MSG_TRUNC | MSG_DONTWAIT));

    write_all(s, "abcdef", 6);
    arrive(c, 6);
    strcpy(b, "xxx");
    struct iovec v = { b, 2 };
    struct msghdr m = { .msg_iov = &v, .msg_iovlen = 1 };
    show("recvmsg(c, {b,2}, MSG_TRUNC)", recvmsg(c, &m, MSG_TRUNC));
    printf("%s b after recvmsg MSG_TRUNC '%s'\n", who, b);
    memset(b, 0, sizeof b);
    show_bytes("read(c, 10)", read(c, b, 10), b);

    /* more than one round of the library's scratch buffer */
    static char big[60000];
    memset(big, 'b', sizeof big);
    write_all(s, big, sizeof big);
    arrive(c, sizeof big);
    show("recv(c, NULL, 100000, MSG_TRUNC) of 60000", recv(c, nul, 100000, MSG_TRUNC));
    show_inq("after the large MSG_TRUNC", c);
    static char bigger[150000];
    struct late l;
    late_write(&l, s, bigger, sizeof bigger);
    show("recv(c, NULL, 150000, MSG_TRUNC|MSG_WAITALL)",
         recv(c, nul, sizeof bigger, MSG_TRUNC | MSG_WAITALL));
    late_join(&l);
    show_inq("after MSG_TRUNC|MSG_WAITALL", c);

    write_all(s, "ab", 2);
    arrive(c, 2);
    set_rcvtimeo(c, 200000);
    double t = now();
    show("recv(c, NULL, 5, MSG_TRUNC|MSG_WAITALL) SO_RCVTIMEO", recv(c, nul, 5, MSG_TRUNC | MSG_WAITALL));
    show_waited("recv(c, NULL, 5, MSG_TRUNC|MSG_WAITALL) SO_RCVTIMEO", t);
    set_rcvtimeo(c, 0);
}

/* 4. iovec counts: more than IOV_MAX (or fewer than 0) is EINVAL for
 * readv/writev, more than IOV_MAX EMSGSIZE for recvmsg/sendmsg; 0 is fine */
static void iov_counts(int c, int s) {
    struct iovec *v = v1;
    char *x = x1;
    show("writev(c, 1025 iovecs)", writev(c, v, 1025));
    show("writev(c, -1 iovecs)", writev(c, v, minus_one));
    show("readv(c, 1025 iovecs)", readv(c, v, 1025));
    show("readv(c, -1 iovecs)", readv(c, v, minus_one));
    struct msghdr m = { .msg_iov = v, .msg_iovlen = 1025 };
    show("sendmsg(c, iovlen 1025)", sendmsg(c, &m, 0));
    show("recvmsg(c, iovlen 1025)", recvmsg(c, &m, MSG_DONTWAIT));
    struct iovec huge[2] = { { x, 1 }, { x, (size_t)SSIZE_MAX + 1 } };
    show("readv(c, iov_len > SSIZE_MAX)", readv(c, huge, 2));
    show("writev(c, iov_len > SSIZE_MAX)", writev(c, huge, 2));
    usleep(50000);
    show_inq("peer after the refused writes", s);
    show("writev(c, 1024 iovecs)", writev(c, v, 1024));
    arrive(s, 1024);
    show_inq("peer after writev of 1024", s);
    show("readv(s, 1024 iovecs)", readv(s, v, 1024));
    m.msg_iovlen = 1024;
    write_all(c, x, 1024);
    arrive(s, 1024);
    show("recvmsg(s, iovlen 1024)", recvmsg(s, &m, 0));
    show("sendmsg(c, iovlen 1024)", sendmsg(c, &m, 0));
    arrive(s, 1024);
    empty(s);
}

/* 5. MSG_ERRQUEUE reads the socket's error queue (empty: EAGAIN), never
 * the connection's bytes */
static void errqueue(int c, int s) {
    char b[16], cb[64];
    write_all(s, "hello", 5);
    arrive(c, 5);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, MSG_ERRQUEUE)", recv(c, b, 10, MSG_ERRQUEUE), b);
    show_bytes("recvfrom(c, MSG_ERRQUEUE)", recvfrom(c, b, 10, MSG_ERRQUEUE, NULL, NULL), b);
    struct iovec v = { b, 10 };
    struct msghdr m = { .msg_iov = &v, .msg_iovlen = 1, .msg_control = cb, .msg_controllen = sizeof cb };
    show("recvmsg(c, MSG_ERRQUEUE)", recvmsg(c, &m, MSG_ERRQUEUE));
    show_inq("after MSG_ERRQUEUE", c);
    show_bytes("recv(c, MSG_DONTWAIT)", recv(c, b, 10, MSG_DONTWAIT), b);
}

/* 6. MSG_PEEK|MSG_WAITALL waits until the whole length can be peeked, or
 * the timeout; without waiting it returns what is there */
static void peek_waitall(int c, int s) {
    char b[16];
    write_all(s, "ab", 2);
    arrive(c, 2);
    struct late l;
    double t = now();
    late_write(&l, s, "cde", 3);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 5, MSG_PEEK|MSG_WAITALL)", recv(c, b, 5, MSG_PEEK | MSG_WAITALL), b);
    show_waited("recv(c, 5, MSG_PEEK|MSG_WAITALL)", t);
    late_join(&l);
    show_inq("after MSG_PEEK|MSG_WAITALL", c);
    memset(b, 0, sizeof b);
    show_bytes("read(c, 3)", read(c, b, 3), b);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 5, MSG_PEEK|MSG_WAITALL|MSG_DONTWAIT)",
               recv(c, b, 5, MSG_PEEK | MSG_WAITALL | MSG_DONTWAIT), b);
    set_nonblock(c, 1);
    show_bytes("recv(c, 5, MSG_PEEK|MSG_WAITALL) O_NONBLOCK", recv(c, b, 5, MSG_PEEK | MSG_WAITALL), b);
    set_nonblock(c, 0);
    set_rcvtimeo(c, 200000);
    t = now();
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 5, MSG_PEEK|MSG_WAITALL) SO_RCVTIMEO", recv(c, b, 5, MSG_PEEK | MSG_WAITALL), b);
    show_waited("recv(c, 5, MSG_PEEK|MSG_WAITALL) SO_RCVTIMEO", t);
    set_rcvtimeo(c, 0);
    empty(c);
    set_rcvtimeo(c, 200000);
    show("recv(c, 5, MSG_PEEK) SO_RCVTIMEO empty", recv(c, b, 5, MSG_PEEK));
    set_rcvtimeo(c, 0);
}

/* 7. what recvmsg and recvfrom write back: nothing after a failure; after
 * a success no control messages, no flags, and an address length of 0
 * where an address was asked for */
static void recvmsg_fields(int c, int s) {
    char b[16], name[32], cb[32];
    struct iovec v = { b, 1 };
    struct msghdr m = { .msg_name = name, .msg_namelen = 77, .msg_iov = &v, .msg_iovlen = 1,
                        .msg_control = cb, .msg_controllen = 11, .msg_flags = 0x55 };
    show("recvmsg(c, MSG_DONTWAIT) empty", recvmsg(c, &m, MSG_DONTWAIT));
    printf("%s failed recvmsg: namelen %u controllen %zu flags %#x\n", who, m.msg_namelen,
           m.msg_controllen, m.msg_flags);
    write_all(s, "0123", 4);
    arrive(c, 4);
    m.msg_name = NULL;
    show("recvmsg(c, no name)", recvmsg(c, &m, 0));
    printf("%s recvmsg without a name: namelen %u controllen %zu flags %#x\n", who, m.msg_namelen,
           m.msg_controllen, m.msg_flags);
    m.msg_name = name;
    m.msg_namelen = 77;
    m.msg_controllen = 11;
    m.msg_flags = 0x55;
    show("recvmsg(c, with a name)", recvmsg(c, &m, 0));
    printf("%s recvmsg with a name: namelen %u controllen %zu flags %#x\n", who, m.msg_namelen,
           m.msg_controllen, m.msg_flags);
    socklen_t al = 55;
    show("recvfrom(c, addr NULL, &alen)", recvfrom(c, b, 1, 0, NULL, &al));
    printf("%s recvfrom without an address: alen %u\n", who, al);
    struct sockaddr_in sa;
    al = sizeof sa;
    show("recvfrom(c, addr, &alen)", recvfrom(c, b, 1, 0, (struct sockaddr *)&sa, &al));
    printf("%s recvfrom with an address: alen %u\n", who, al);
    al = 55;
    show("recvfrom(c, addr, &alen, MSG_DONTWAIT) empty", recvfrom(c, b, 1, MSG_DONTWAIT, (struct sockaddr *)&sa, &al));
    printf("%s failed recvfrom: alen %u\n", who, al);
}

/* what poll shows of fd for POLLIN|POLLPRI right now, and select's
 * exceptional condition */
static void show_pri(const char *name, int fd) {
    struct pollfd p = { fd, POLLIN | POLLPRI, 0 };
    if (poll(&p, 1, 0) < 0)
        die("poll");
    fd_set r, e;
    FD_ZERO(&r);
    FD_ZERO(&e);
    FD_SET(fd, &r);
    FD_SET(fd, &e);
    struct timeval t = { 0, 0 };
    int n = select(fd + 1, &r, NULL, &e, &t);
    printf("%s %s: poll%s%s, select %d%s%s\n", who, name, p.revents & POLLIN ? " IN" : "",
           p.revents & POLLPRI ? " PRI" : "", n, FD_ISSET(fd, &r) ? " read" : "",
           FD_ISSET(fd, &e) ? " exception" : "");
    fflush(stdout);
}

/* urgent data: a normal read stops at the urgent byte's mark (SIOCATMARK
 * then says so) and the next skips the byte; recv(MSG_OOB) takes it once,
 * and finds nothing (EINVAL) once a read went past the mark */
static void urgent(int c, int s) {
    char b[16];
    int at;
    write_all(s, "ab", 2);
    show("send(s, 1, MSG_OOB)", send(s, "c", 1, MSG_OOB));
    usleep(100000);
    show_inq("before the mark", c);
    show_pri("urgent byte waiting", c);
    at = -1;
    show("ioctl(c, SIOCATMARK) before the mark", ioctl(c, SIOCATMARK, &at));
    printf("%s at the mark: %d\n", who, at);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 16) up to the mark", recv(c, b, sizeof b, 0), b);
    at = -1;
    show("ioctl(c, SIOCATMARK) at the mark", ioctl(c, SIOCATMARK, &at));
    printf("%s at the mark: %d\n", who, at);
    show_pri("at the mark", c);
    show_bytes("recv(c, 1, MSG_OOB)", recv(c, b, 1, MSG_OOB), b);
    show_pri("urgent byte taken", c);
    show("recv(c, 1, MSG_OOB) again", recv(c, b, 1, MSG_OOB | MSG_DONTWAIT));
    show("recv(c, 16, MSG_DONTWAIT) after it", recv(c, b, sizeof b, MSG_DONTWAIT));
    write_all(s, "de", 2);
    show("send(s, 1, MSG_OOB) again", send(s, "f", 1, MSG_OOB));
    write_all(s, "gh", 2);
    usleep(100000);
    show_bytes("recv(c, 16) up to the second mark", recv(c, b, sizeof b, 0), b);
    show_inq("at the second mark, bytes after it", c);
    show_pri("at the second mark, bytes after it", c);
    show_bytes("recv(c, 16) past it", recv(c, b, sizeof b, MSG_DONTWAIT), b);
    show_pri("past the second mark", c);
    at = -1;
    show("ioctl(c, SIOCATMARK) past the mark", ioctl(c, SIOCATMARK, &at));
    printf("%s at the mark: %d\n", who, at);
    show("recv(c, 1, MSG_OOB) past the mark", recv(c, b, 1, MSG_OOB | MSG_DONTWAIT));
}

/* SO_OOBINLINE: the urgent byte stays in the stream; a read stops before
 * it, the next returns it with what follows, recv(MSG_OOB) finds nothing;
 * set after the byte came, it counts for that byte too */
static void urgent_inline(int c, int s) {
    char b[16];
    int on = 1, off = 0, at, v;
    socklen_t vl = sizeof v;
    show("setsockopt(c, SO_OOBINLINE, 1)", setsockopt(c, SOL_SOCKET, SO_OOBINLINE, &on, sizeof on));
    v = -1;
    show("getsockopt(c, SO_OOBINLINE)", getsockopt(c, SOL_SOCKET, SO_OOBINLINE, &v, &vl));
    printf("%s in line: %d\n", who, v);
    write_all(s, "ij", 2);
    show("send(s, 1, MSG_OOB) in line", send(s, "k", 1, MSG_OOB));
    write_all(s, "lm", 2);
    usleep(100000);
    show_inq("in line, before the mark", c);
    show_pri("in line, urgent byte waiting", c);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 16) in line, up to the mark", recv(c, b, sizeof b, 0), b);
    at = -1;
    show("ioctl(c, SIOCATMARK) in line, at the mark", ioctl(c, SIOCATMARK, &at));
    printf("%s in line at the mark: %d\n", who, at);
    show_inq("in line, at the mark", c);
    show_pri("in line, at the mark", c);
    show("recv(c, 1, MSG_OOB) in line", recv(c, b, 1, MSG_OOB | MSG_DONTWAIT));
    show_bytes("recv(c, 16) in line, from the mark", recv(c, b, sizeof b, MSG_DONTWAIT), b);
    at = -1;
    show("ioctl(c, SIOCATMARK) in line, past the mark", ioctl(c, SIOCATMARK, &at));
    printf("%s in line past the mark: %d\n", who, at);
    show_pri("in line, past the mark", c);
    show("setsockopt(c, SO_OOBINLINE, 0)", setsockopt(c, SOL_SOCKET, SO_OOBINLINE, &off, sizeof off));
    write_all(s, "no", 2);
    show("send(s, 1, MSG_OOB) out of line", send(s, "p", 1, MSG_OOB));
    write_all(s, "q", 1);
    usleep(100000);
    show("setsockopt(c, SO_OOBINLINE, 1) after it came", setsockopt(c, SOL_SOCKET, SO_OOBINLINE, &on, sizeof on));
    show_inq("in line after it came", c);
    show_bytes("recv(c, 16) in line after it came", recv(c, b, sizeof b, 0), b);
    show_bytes("recv(c, 16) in line after it came, from the mark", recv(c, b, sizeof b, MSG_DONTWAIT), b);
    show("setsockopt(c, SO_OOBINLINE, 0) again", setsockopt(c, SOL_SOCKET, SO_OOBINLINE, &off, sizeof off));
}

/* an urgent byte that comes to a reader that has read everything: the
 * reader stands at its mark, and a read there passes the byte and returns
 * what came after it */
static void urgent_alone(int c, int s) {
    char b[16];
    int at;
    show("send(s, 1, MSG_OOB) alone", send(s, "r", 1, MSG_OOB));
    usleep(100000);
    show_pri("alone, urgent byte waiting", c);
    write_all(s, "st", 2);
    usleep(100000);
    at = -1;
    show("ioctl(c, SIOCATMARK) alone", ioctl(c, SIOCATMARK, &at));
    printf("%s alone at the mark: %d\n", who, at);
    show_inq("alone, bytes after it", c);
    show_bytes("recv(c, 16, MSG_DONTWAIT) alone, past it", recv(c, b, sizeof b, MSG_DONTWAIT), b);
    show("recv(c, 1, MSG_OOB) alone, past it", recv(c, b, 1, MSG_OOB | MSG_DONTWAIT));
}

/* at the end of the stream: everything above returns 0 at once */
static void at_eof(int c, int s) {
    char b[16];
    write_all(s, "ab", 2);
    shutdown(s, SHUT_WR);
    arrive(c, 2);
    memset(b, 0, sizeof b);
    show_bytes("recv(c, 5, MSG_PEEK|MSG_WAITALL) at EOF", recv(c, b, 5, MSG_PEEK | MSG_WAITALL), b);
    show_bytes("read(c, 5) at EOF", read(c, b, 5), b);
    show("recv(c, 0, MSG_DONTWAIT) at EOF", recv(c, b, 0, MSG_DONTWAIT));
    show("recv(c, 0) at EOF", recv(c, b, 0, 0));
    show("read(c, NULL, 4) at EOF", read(c, nul, 4));
    show("recv(c, NULL, 4, MSG_TRUNC) at EOF", recv(c, nul, 4, MSG_TRUNC));
    show("recv(c, 5, MSG_PEEK|MSG_WAITALL) at EOF, empty", recv(c, b, 5, MSG_PEEK | MSG_WAITALL));
}

/* writes of nothing after our own shutdown of sending: EPIPE (and
 * SIGPIPE) as any write, but writev of nothing returns 0 */
static void after_shutdown(int c) {
    char b[4];
    struct iovec z = { b, 0 };
    struct msghdr m = { .msg_iov = &z, .msg_iovlen = 0 };
    shutdown(c, SHUT_WR);
    sigpipes = 0;
    show("write(c, 0) after SHUT_WR", write(c, b, 0));
    printf("%s SIGPIPE %d\n", who, (int)sigpipes);
    show("send(c, 0, MSG_NOSIGNAL) after SHUT_WR", send(c, b, 0, MSG_NOSIGNAL));
    show("sendmsg(c, iovlen 0, MSG_NOSIGNAL) after SHUT_WR", sendmsg(c, &m, MSG_NOSIGNAL));
    show("writev(c, {b,0}) after SHUT_WR", writev(c, &z, 1));
    show("write(c, NULL, 4) after SHUT_WR", write(c, nul, 4));
    show("write(c, 1) after SHUT_WR", write(c, "x", 1));
    printf("%s SIGPIPE %d\n", who, (int)sigpipes);
}

/* a forked child on its parent's connection: the same rules */
static void in_child(int c, int s) {
    char b[16];
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        who = "child";
        show("recv(c, 0, MSG_DONTWAIT) empty", recv(c, b, 0, MSG_DONTWAIT));
        show("recv(c, NULL, 4, MSG_DONTWAIT) empty", recv(c, nul, 4, MSG_DONTWAIT));
        show("read(c, 0) empty", read(c, b, 0));
        show("writev(c, 1025 iovecs)", writev(c, v1, 1025));
        show("write(c, NULL, 4)", write(c, nul, 4));
        show("write(c, 0)", write(c, b, 0));
        write_all(s, "0123456789", 10);
        arrive(c, 10);
        show("read(c, NULL, 4)", read(c, nul, 4));
        show("recv(c, 0)", recv(c, b, 0, 0));
        show("recv(c, NULL, 3, MSG_TRUNC)", recv(c, nul, 3, MSG_TRUNC));
        show("recv(c, MSG_ERRQUEUE)", recv(c, b, 10, MSG_ERRQUEUE));
        memset(b, 0, sizeof b);
        show_bytes("recv(c, 16)", recv(c, b, sizeof b, 0), b);
        fflush(stdout);
        _exit(0);
    }
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "child failed\n");
        exit(2);
    }
}

/* one epoll_wait on `ep` for at most `ms`: the number of events; with
 * `byte`, written to `w` by a thread 200 ms into the wait */
static void ep_count(const char *name, int ep, int ms, int w, const char *byte) {
    struct epoll_event out[4];
    struct late l;
    if (byte)
        late_write(&l, w, byte, 1);
    show(name, epoll_wait(ep, out, 4, ms));
    if (byte)
        late_join(&l);
}

/* 8. a one-shot epoll registration reports one event per arming (ADD or
 * MOD), however many writes arrive after it fired; each write here comes
 * from a thread 200 ms into a wait */
static void epoll_oneshot(void) {
    int c, s;
    pair(&c, &s);
    set_nonblock(c, 1);
    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    struct epoll_event e = { .events = EPOLLIN | EPOLLONESHOT, .data.fd = c };
    show("epoll_ctl(ADD, c, IN|ONESHOT)", epoll_ctl(ep, EPOLL_CTL_ADD, c, &e));
    ep_count("one-shot: epoll_wait, a write", ep, 2000, s, "1");
    ep_count("one-shot fired: epoll_wait, a write", ep, 500, s, "2");
    ep_count("one-shot fired: epoll_wait, another write", ep, 500, s, "3");
    arrive(c, 3);
    ep_count("one-shot fired: epoll_wait, 3 bytes there", ep, 100, s, NULL);
    show("epoll_ctl(MOD, c, IN|ONESHOT) 3 bytes there", epoll_ctl(ep, EPOLL_CTL_MOD, c, &e));
    ep_count("one-shot re-armed: epoll_wait", ep, 1000, s, NULL);
    ep_count("one-shot fired again: epoll_wait", ep, 100, s, NULL);
    empty(c);
    show("epoll_ctl(MOD, c, IN|ONESHOT) nothing there", epoll_ctl(ep, EPOLL_CTL_MOD, c, &e));
    ep_count("one-shot re-armed: epoll_wait, a write", ep, 2000, s, "4");
    ep_count("one-shot fired: epoll_wait, a write", ep, 500, s, "5");
    close(ep);
    close(c);
    close(s);
}

int main(void) {
    signal(SIGPIPE, on_sigpipe);
    for (int i = 0; i < 1100; i++) { v1[i].iov_base = x1 + i; v1[i].iov_len = 1; x1[i] = 'v'; }
    int c, s;
    pair(&c, &s);
    zero_length(c, s);
    null_buffers(c, s);
    msg_trunc(c, s);
    iov_counts(c, s);
    errqueue(c, s);
    peek_waitall(c, s);
    recvmsg_fields(c, s);
    urgent(c, s);
    urgent_inline(c, s);
    urgent_alone(c, s);
    in_child(c, s);
    at_eof(c, s);
    after_shutdown(c);
    close(c);
    close(s);
    epoll_oneshot();
    printf("%s done\n", who);
    return 0;
}
