//! The ends of connections and listeners under smc_run as on plain TCP
//! (tests/conform_close.c): `shutdown(SHUT_RD)` (a reader waiting in
//! another thread returns, what the peer still sends is read), both sides
//! shut by one side (`EPOLLHUP`), `shutdown` of a connection that is over
//! (`ENOTCONN`), a close with `SO_LINGER` 0 (a reset: `EPOLLERR`,
//! `ECONNRESET`, reported once by a read, a write or `SO_ERROR`, then end
//! of file and `EPIPE`), also inherited from the listener, a close with
//! `SO_LINGER` 8 s (it waits until the peer, reading 4 s later, took the
//! data), a write after the peer's close (it succeeds; the reset it draws
//! ends the connection with `EPIPE`, taken by the next write or
//! `SO_ERROR`, while reads find the end of file; a `sendfile` and a
//! `splice` too), the
//! peer's reset after its end of stream (`EPIPE` in `CLOSE_WAIT`, nothing
//! once both sides ended; reads find the end of file), a peer process
//! that closes and exits (nothing shows but the end of file until a write
//! draws the reset),
//! `connect(AF_UNSPEC)` and
//! a new connection of the same socket (its data to the new peer, a reset
//! for the old one), `shutdown` of a listening socket (a thread polling it
//! woken, `accept` then `EINVAL`), an `accept` out of descriptors
//! (`EMFILE`: the connection waits for the next one, as in the kernel's
//! queue), and every connection made by a blocking connect to the
//! program's own listener before its `accept`.

mod common;

use common::*;

fn run(s: &Setup, exe: &std::path::Path, preload: bool) -> String {
    let _ = std::fs::remove_file(s.dir.join("state"));
    let out = under(s, preload, exe, &[]).output().unwrap();
    ok_output(&format!("conform_close (smc_run: {preload})"), &out)
}

#[test]
fn ends_of_connections_and_listeners_as_on_plain_tcp() {
    let s = setup("close");
    let exe = compile_c("conform_close", &s.dir);
    let plain = run(&s, &exe, false);
    // what the script must have exercised (on plain TCP)
    for l in [
        "waiting read returned 0",
        "poll after SHUT_RD: IN OUT RDHUP",
        "read what came = 4 'late'",
        "poll both shut here: IN OUT HUP RDHUP",
        "client shutdown again = -1 ENOTCONN",
        "server shutdown again = -1 ENOTCONN",
        "close waited for the reader: yes",
        "the reader got all: yes",
        "poll after the reset: IN OUT ERR HUP RDHUP",
        "poll after the reset, no events asked: ERR HUP",
        "read after the reset = -1 ECONNRESET",
        "read again after the reset = 0 ''",
        "send after the reset = -1 EPIPE",
        "poll after the reset was reported: IN OUT HUP RDHUP",
        "SO_ERROR after the inherited reset: ECONNRESET",
        "SO_ERROR after the inherited reset: 0",
        "poll after the peer's close: IN OUT RDHUP",
        "send after the peer's close = 4",
        "poll after the send drew a reset: IN OUT ERR HUP RDHUP",
        "read after the drawn reset = 0 ''",
        "send after the drawn reset = -1 EPIPE",
        "sendfile after the peer's close = 65536",
        "splice after the peer's close = 4",
        "its offset after = 65536",
        "SO_ERROR after the drawn reset: EPIPE",
        "poll after the error was taken: IN OUT HUP RDHUP",
        "send again after the drawn reset = -1 EPIPE",
        "read after SO_ERROR took the reset = 0 ''",
        "poll after the end and reset: IN OUT ERR HUP RDHUP",
        "read after the end and reset = 0 ''",
        "send after the end and reset = -1 EPIPE",
        "SO_ERROR after the end and reset: EPIPE",
        "SO_ERROR after the end and reset: 0",
        "poll after the peer's data: IN OUT ERR HUP RDHUP",
        "read after the reset = -1 ECONNRESET",
        "read again after the reset = 0 ''",
        "peer send after the reset = -1 EPIPE",
        "peer poll after the reset was taken: IN OUT HUP RDHUP",
        "read what the gone peer sent = 3 'bye'",
        "SO_ERROR with the peer process gone: 0",
        "send to the gone peer = 1",
        "poll after the send to the gone peer: IN OUT ERR HUP RDHUP",
        "send again to the gone peer = -1 EPIPE",
        "old peer poll: IN OUT ERR HUP RDHUP",
        "new peer reads = 3 'new'",
        "old peer reads = -1 ECONNRESET",
        "poller of a blocking listener woken: at once, HUP 1",
        "poller of a non-blocking listener woken: at once, HUP 1",
        "accept after shutdown = -1 EINVAL",
        "SO_ERROR of a reset not polled: ECONNRESET",
        "SO_ERROR again: 0",
        "splice into a 4 KiB pipe = 4096",
        "accept with nothing to accept = -1 EAGAIN",
        "accept returned after the timeout: yes",
        "splice socket to a file = -1 EINVAL",
        "read what splice left = 7 'spliced'",
        "accept ran out of descriptors before all: 1",
        "accepted after: 8 of 8",
        "connections that carried their byte: 8",
    ] {
        assert!(plain.contains(l), "plain run lacks {l:?}:\n{plain}");
    }
    assert!(s.modes().is_empty());
    for round in 0..2 {
        let smc = run(&s, &exe, true);
        assert_same(&plain, &smc, &format!("round {round}"));
        // 58 connection ends: both ends of those in this process, the
        // client end of the two whose server is a child process, all
        // SMC-R but the two of the one a disconnected socket made after,
        // which falls back (its socket is no longer opted in to the SMC
        // option)
        let modes = s.modes();
        assert_eq!(modes.len(), 58, "{modes:?}");
        assert_eq!(
            modes.iter().filter(|m| m.ends_with(" SMC-R")).count(),
            56,
            "{modes:?}"
        );
    }
}
