//! The read/write family's edges under `smc_run` as on plain TCP: a C
//! program (tests/conform_rw.c, which knows nothing of SMC) makes the calls
//! on both ends of a connection in one process and prints each result; its
//! output under `smc_run`, with the connection over SMC-R, must equal its
//! plain output line by line. (root: the SYN-option rendezvous loads a BPF
//! program.)

mod common;

use common::*;

fn conform_rw(s: &Setup, preload: bool) -> String {
    let exe = compile_c("conform_rw", &s.dir);
    let out = under(s, preload, &exe, &[]).output().unwrap();
    ok_output(&format!("conform_rw (smc_run: {preload})"), &out)
}

/// What the script must exercise (seen on plain TCP): a line each for the
/// cases that once went otherwise under `smc_run`.
const KEY_LINES: &[&str] = &[
    // reads of nothing wait as reads do, and return 0 (read/readv at once)
    "main recv(c, 0, MSG_DONTWAIT) empty = -1 EAGAIN",
    "main recv(c, 0, MSG_PEEK|MSG_DONTWAIT) empty = -1 EAGAIN",
    "main recvmsg(c, iovlen 0, MSG_DONTWAIT) empty = -1 EAGAIN",
    "main read(c, 0) empty = 0",
    "main recv(c, 0) O_NONBLOCK empty = -1 EAGAIN",
    "main recv(c, 0) blocking waited yes",
    "main recv(c, 0, MSG_PEEK) blocking waited yes",
    "main recv(c, 0) with data = 0",
    "main recv(c, 0) SO_RCVTIMEO empty = 0",
    "main recv(c, 0) at EOF = 0",
    // writes of nothing say the connection's state
    "main write(c, 0) after SHUT_WR = -1 EPIPE",
    "main send(c, 0, MSG_NOSIGNAL) after SHUT_WR = -1 EPIPE",
    "main writev(c, {b,0}) after SHUT_WR = 0",
    // NULL buffers
    "main read(c, NULL, 4) O_NONBLOCK empty = -1 EAGAIN",
    "main read(c, NULL, 4) = -1 EFAULT",
    "main readv(c, {b,3},{NULL,5}) = -1 EFAULT",
    "main after NULL reads FIONREAD 10",
    "main read(c, NULL, 4) blocking waited yes",
    "main read(c, NULL, 4) at EOF = 0",
    "main write(c, NULL, 4) = -1 EFAULT",
    "main writev(c, {abc,3},{NULL,5}) = -1 EFAULT",
    "main sendmsg(c, {abc,3},{NULL,5}) = -1 EFAULT",
    "main peer read after the NULL writes = 1 'Z'",
    "main readv(c, NULL, 1) = -1 EFAULT",
    // MSG_TRUNC
    "main recv(c, NULL, 4, MSG_TRUNC) = 4",
    "main b after MSG_TRUNC 'xxx'",
    "main recv(c, NULL, 100, MSG_PEEK|MSG_TRUNC) = 4",
    "main after MSG_PEEK|MSG_TRUNC FIONREAD 4",
    "main b after recvmsg MSG_TRUNC 'xxx'",
    "main recv(c, NULL, 100000, MSG_TRUNC) of 60000 = 60000",
    "main recv(c, NULL, 150000, MSG_TRUNC|MSG_WAITALL) = 150000",
    // iovec counts
    "main writev(c, 1025 iovecs) = -1 EINVAL",
    "main readv(c, -1 iovecs) = -1 EINVAL",
    "main sendmsg(c, iovlen 1025) = -1 EMSGSIZE",
    "main recvmsg(c, iovlen 1025) = -1 EMSGSIZE",
    "main peer after the refused writes FIONREAD 0",
    "main writev(c, 1024 iovecs) = 1024",
    // MSG_ERRQUEUE
    "main recv(c, MSG_ERRQUEUE) = -1 EAGAIN",
    "main recvmsg(c, MSG_ERRQUEUE) = -1 EAGAIN",
    "main recv(c, MSG_DONTWAIT) = 5 'hello'",
    // MSG_PEEK|MSG_WAITALL
    "main recv(c, 5, MSG_PEEK|MSG_WAITALL) = 5 'abcde'",
    "main recv(c, 5, MSG_PEEK|MSG_WAITALL) waited yes",
    "main recv(c, 5, MSG_PEEK|MSG_WAITALL|MSG_DONTWAIT) = 2 'de'",
    "main recv(c, 5, MSG_PEEK|MSG_WAITALL) SO_RCVTIMEO = 2 'de'",
    "main recv(c, 5, MSG_PEEK|MSG_WAITALL) at EOF = 2 'ab'",
    // what recvmsg and recvfrom write back
    "main failed recvmsg: namelen 77 controllen 11 flags 0x55",
    "main recvmsg without a name: namelen 77 controllen 0 flags 0",
    "main recvmsg with a name: namelen 0 controllen 0 flags 0",
    "main recvfrom without an address: alen 55",
    "main failed recvfrom: alen 55",
    // urgent data: the mark, MSG_OOB once and not past the mark
    "main before the mark FIONREAD 2",
    "main urgent byte waiting: poll IN PRI, select 2 read exception",
    "main at the mark: 1",
    "main at the mark: poll PRI, select 1 exception",
    "main urgent byte taken: poll, select 0",
    "main past the second mark: poll, select 0",
    "main at the second mark, bytes after it FIONREAD 0",
    "main recv(c, 1, MSG_OOB) = 1 'c'",
    "main recv(c, 1, MSG_OOB) again = -1 EINVAL",
    "main recv(c, 16) past it = 2 'gh'",
    "main recv(c, 1, MSG_OOB) past the mark = -1 EINVAL",
    // ... and in line (SO_OOBINLINE), also set after the byte came
    "main in line, before the mark FIONREAD 5",
    "main recv(c, 16) in line, up to the mark = 2 'ij'",
    "main in line at the mark: 1",
    "main in line, at the mark: poll IN PRI, select 2 read exception",
    "main recv(c, 1, MSG_OOB) in line = -1 EINVAL",
    "main recv(c, 16) in line, from the mark = 3 'klm'",
    "main in line past the mark: 0",
    "main recv(c, 16) in line after it came, from the mark = 2 'pq'",
    // ... and one alone, with the reader at its mark: a read passes it
    "main alone, urgent byte waiting: poll PRI, select 1 exception",
    "main alone at the mark: 1",
    "main recv(c, 16, MSG_DONTWAIT) alone, past it = 2 'st'",
    // a forked child on its parent's connection
    "child recv(c, 0, MSG_DONTWAIT) empty = -1 EAGAIN",
    "child read(c, NULL, 4) = -1 EFAULT",
    "child recv(c, NULL, 3, MSG_TRUNC) = 3",
    "child recv(c, 16) = 7 '3456789'",
    // a one-shot epoll registration: one event per arming (the readiness
    // descriptor and the peer signal are two of the kernel's)
    "main one-shot: epoll_wait, a write = 1",
    "main one-shot fired: epoll_wait, a write = 0",
    "main one-shot fired: epoll_wait, another write = 0",
    "main one-shot re-armed: epoll_wait = 1",
    "main one-shot re-armed: epoll_wait, a write = 1",
    "main done",
];

/// Zero-length reads and writes, NULL buffers, `MSG_TRUNC`, iovec counts,
/// `MSG_ERRQUEUE`, `MSG_PEEK | MSG_WAITALL`, what `recvmsg`/`recvfrom`
/// write back, urgent data (`SIOCATMARK`, `MSG_OOB`, `FIONREAD`, `POLLPRI`,
/// `select`'s exceptional condition, `SO_OOBINLINE`), and a one-shot epoll
/// registration's events
/// (tests/conform_rw.c) give the same results and errno values on an SMC-R
/// connection under smc_run as on plain TCP, also in a forked child on its
/// parent's connection.
#[test]
fn read_write_edges_under_smc_run_as_plain_tcp() {
    let s = setup("conform-rw");
    let plain = conform_rw(&s, false);
    for l in KEY_LINES {
        assert!(
            plain.lines().any(|x| x == *l),
            "plain run lacks {l:?}:\n{plain}"
        );
    }
    assert!(s.modes().is_empty());
    let smc = conform_rw(&s, true);
    assert_same(&plain, &smc, &format!("under smc_run:\n{smc}"));
    // the two connections (the cases', the one-shot case's), both ends
    let modes = s.modes();
    assert_eq!(modes.len(), 4, "{modes:?}");
    assert!(modes.iter().all(|m| m.ends_with(" SMC-R")), "{modes:?}");
}
