//! An event loop asleep in `epoll_wait` is woken by the peer's SEND itself
//! (`SmcStream::signal_fd`, the shared-memory device's polled doorbell),
//! not by this process's progress thread after it pumped: one wake-up per
//! message, as over TCP, and no thread hop (issue 16's event-driven
//! servers, docs/FAST-PATH.md). The loop here registers the descriptors
//! as the preload library does for an application's epoll set. Alone in
//! its test binary: the process's threads are counted.

mod common;

use common::setup;
use rustix::event::epoll;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

/// The signal is on unless `SMC_PEER_SIGNAL=0` (read once per process):
/// these tests are about it, whatever the environment they run in says
/// (the echo server's process inherits the setting).
fn signals_on() {
    std::env::set_var("SMC_PEER_SIGNAL", "1");
}

/// An epoll set with `c`'s readiness descriptor (data 7) and, if `signal`,
/// its peer signal (data 8), as `smc-preload`'s `epoll_ctl` registers them
/// (which gives both the application's data).
fn event_loop_set(c: &SmcStream, flags: epoll::EventFlags, signal: bool) -> OwnedFd {
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    epoll::add(
        &ep,
        c.readiness_fd().unwrap(),
        epoll::EventData::new_u64(7),
        flags,
    )
    .unwrap();
    if signal {
        let sfd = c.signal_fd().expect("the shm device signals event loops");
        let only_in = epoll::EventFlags::IN | (flags & epoll::EventFlags::ET);
        epoll::add(&ep, sfd, epoll::EventData::new_u64(8), only_in).unwrap();
        c.watch_signal(true);
    }
    ep
}

/// Waits in `ep` (at most `limit`); the events' data.
fn wait(ep: &OwnedFd, limit: Duration) -> Vec<u64> {
    let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 8];
    let ts = rustix::event::Timespec {
        tv_sec: limit.as_secs() as _,
        tv_nsec: limit.subsec_nanos() as _,
    };
    let (got, _) = loop {
        match epoll::wait(ep, &mut buf, Some(&ts)) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r.unwrap(),
        }
    };
    got.iter().map(|e| e.data.u64()).collect()
}

/// How an event loop's waits ended.
#[derive(Default, Debug)]
struct Waits {
    /// Woken by the peer's signal (data 8).
    by_signal: usize,
    /// Woken by the readiness descriptor alone (data 7).
    by_readiness: usize,
    /// Woken, and the read after found nothing.
    empty: usize,
}

/// Reads `want` bytes from non-blocking `c` as an event loop does: read
/// until it would block, then wait in `ep`.
fn read_by_loop(c: &mut SmcStream, ep: &OwnedFd, want: usize, w: &mut Waits) -> Vec<u8> {
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    let give_up = Instant::now() + Duration::from_secs(10);
    let mut woke = false;
    while got.len() < want {
        assert!(
            Instant::now() < give_up,
            "no data after 10 s ({} of {want})",
            got.len()
        );
        match c.read(&mut b[..(want - got.len()).min(256)]) {
            Ok(0) => panic!("end of file"),
            Ok(n) => {
                got.extend_from_slice(&b[..n]);
                woke = false;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if woke {
                    w.empty += 1;
                }
                let ev = wait(ep, Duration::from_secs(10));
                assert!(
                    ev.iter().all(|&d| d == 7 || d == 8),
                    "unexpected data {ev:?}"
                );
                if ev.contains(&8) {
                    w.by_signal += 1;
                } else if ev.contains(&7) {
                    w.by_readiness += 1;
                }
                woke = !ev.is_empty();
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    got
}

fn pair() -> (SmcStream, SmcStream) {
    signals_on();
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = SmcStream::connect(addr).unwrap();
    let (s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    assert_eq!(s.mode(), Mode::SmcR);
    (c, s)
}

/// The echo server, in a child process (this test binary again, with
/// `SMC_PS_ECHO=ROUNDS`): reads 64-byte messages (blocking) and answers
/// each with its complement. Its doorbell waits do not spin (a blocking
/// reader that spins first lets the CDCs that come meanwhile signal its
/// completion channel; not what is counted here).
fn echo_server(rounds: usize) {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), Mode::SmcR);
    let mut b = [0u8; 64];
    for _ in 0..rounds {
        s.read_exact(&mut b).unwrap();
        for x in &mut b {
            *x = !*x;
        }
        s.write_all(&b).unwrap();
    }
    // until the client has the last answer and closes
    let _ = s.read(&mut b);
}

/// Request/response from an event loop in this process to the echo server
/// in another: how the loop's waits ended, and the progress thread's
/// wake-ups meanwhile.
fn ping_pong_from_a_loop(test: &str, flags: epoll::EventFlags, signal: bool) -> (Waits, u64) {
    const WARM: usize = 100;
    let (mut child, _out, port) = common::spawn_self(
        test,
        &[
            ("SMC_PS_ECHO", format!("{}", WARM + ROUNDS).as_ref()),
            ("SMC_SPIN_US", "0".as_ref()),
        ],
    );
    let mut c = SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, flags, signal);
    let mut before = 0;
    let mut w = Waits::default();
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = common::switches_of("smc-progress");
            w = Waits::default();
        }
        let m = [i as u8; 64];
        let mut sent = 0;
        while sent < 64 {
            match c.write(&m[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    wait(&ep, Duration::from_millis(10));
                }
                Err(e) => panic!("write: {e}"),
            }
        }
        let got = read_by_loop(&mut c, &ep, 64, &mut w);
        assert_eq!(got, [!(i as u8); 64], "answer {i}");
    }
    let woken = common::switches_of("smc-progress") - before;
    drop(c);
    assert!(child.wait().unwrap().success(), "the echo server failed");
    (w, woken)
}

const WAKE_TEST: &str = "an_event_loop_is_woken_by_the_peer_not_by_the_progress_thread";
const ROUNDS: usize = 2000;

#[test]
fn an_event_loop_is_woken_by_the_peer_not_by_the_progress_thread() {
    std::env::set_var("SMC_RS_REGISTRY", "0");
    signals_on();
    setup();
    if let Ok(n) = std::env::var("SMC_PS_ECHO") {
        return echo_server(n.parse().unwrap());
    }
    let level = ping_pong_from_a_loop(WAKE_TEST, epoll::EventFlags::IN, true);
    let edge = ping_pong_from_a_loop(
        WAKE_TEST,
        epoll::EventFlags::IN | epoll::EventFlags::ET,
        true,
    );
    // the same loop on the readiness descriptor alone
    let without = ping_pong_from_a_loop(WAKE_TEST, epoll::EventFlags::IN, false);
    eprintln!(
        "{ROUNDS} answers: level {level:?}, edge {edge:?}, without the signal {without:?} \
         (waits, progress thread wake-ups)"
    );
    for (what, (w, _)) in [("level", &level), ("edge", &edge)] {
        let woke = w.by_signal + w.by_readiness;
        // Nearly every answer that found the loop asleep woke it through
        // the peer's signal (some come through the completion channel: a
        // CDC of the peer's while the signal was still spent, e.g. a
        // cursor update just before an answer), and the readiness
        // descriptor did not show the same bytes again.
        assert!(
            w.by_signal * 10 >= woke * 9,
            "{what}-triggered: {} of {woke} wake-ups by the peer's signal",
            w.by_signal
        );
        // at most a few wake-ups for nothing (a signal whose bytes a read
        // had taken already)
        assert!(
            w.empty <= ROUNDS / 20,
            "{what}-triggered: {} of {woke} wake-ups found nothing to read",
            w.empty
        );
    }
    assert_eq!(without.0.by_signal, 0);
}

#[test]
fn without_a_poller_the_readiness_descriptor_shows_the_data_again() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN, true);
    // one message through the signal
    s.write_all(b"one").unwrap();
    let got = read_by_loop(&mut c, &ep, 3, &mut Waits::default());
    assert_eq!(got, b"one");
    // the next one arrives while the loop still polls the signal, and is
    // not read; then the poller leaves
    s.write_all(b"two").unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !c.signal_taken() {
        assert!(Instant::now() < until, "the peer did not signal");
        std::thread::sleep(Duration::from_millis(1));
    }
    c.watch_signal(false);
    // the readiness descriptor alone shows it now
    let only = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    epoll::add(
        &only,
        c.readiness_fd().unwrap(),
        epoll::EventData::new_u64(7),
        epoll::EventFlags::IN,
    )
    .unwrap();
    assert_eq!(wait(&only, Duration::from_secs(5)), vec![7]);
    let mut b = [0u8; 8];
    assert_eq!(c.read(&mut b).unwrap(), 3);
    assert_eq!(&b[..3], b"two");
    // and nothing more
    assert!(c
        .read(&mut b)
        .is_err_and(|e| e.kind() == ErrorKind::WouldBlock));
    assert!(wait(&only, Duration::from_millis(50)).is_empty());
    drop(ep);
}

#[test]
fn a_level_triggered_loop_does_not_spin_on_a_spent_signal() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN, true);
    for i in 0..200u32 {
        s.write_all(&i.to_le_bytes()).unwrap();
        let got = read_by_loop(&mut c, &ep, 4, &mut Waits::default());
        assert_eq!(got, i.to_le_bytes());
        // everything read: the set is quiet (a stale signal would make a
        // level-triggered loop spin); at most one wake-up for a signal
        // whose write came after the read, then quiet
        let mut b = [0u8; 4];
        let mut woke = 0;
        while !wait(&ep, Duration::from_millis(if woke == 0 { 2 } else { 20 })).is_empty() {
            assert!(c
                .read(&mut b)
                .is_err_and(|e| e.kind() == ErrorKind::WouldBlock));
            woke += 1;
            assert!(
                woke <= 1,
                "round {i}: the loop wakes again and again with nothing to read"
            );
        }
    }
    let _ = c.as_fd();
}

/// A level-triggered loop that reads once per wake-up and takes all there
/// is (redis' and hiredis' way: one read of up to 16 KiB per event, none to
/// `WouldBlock`) is not woken again by the signal that read spent: the read
/// that empties the connection drains the signal and arms it. (A wake-up
/// with nothing to read remains possible where the peer's write of the
/// signal lands after that read took its CDC: rare, not every message.)
#[test]
fn a_read_that_empties_the_connection_spends_the_signal() {
    const N: u32 = 200;
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN, true);
    c.signal_level(true);
    let mut b = [0u8; 64];
    let mut spent_wakeups = 0;
    for i in 0..N {
        s.write_all(&i.to_le_bytes()).unwrap();
        let n = wait_and_read(&mut c, &ep, &mut b, &format!("message {i}"));
        assert_eq!(&b[..n], i.to_le_bytes(), "message {i}");
        if !wait(&ep, Duration::from_millis(5)).is_empty() {
            assert!(c
                .read(&mut b)
                .is_err_and(|e| e.kind() == ErrorKind::WouldBlock));
            spent_wakeups += 1;
        }
    }
    assert!(
        spent_wakeups <= N / 10,
        "{spent_wakeups} of {N} messages woke the loop again with nothing to read"
    );
}

/// An edge-triggered loop that reads what it expects and waits again
/// without a read that would block (as nginx does when a read returns less
/// than it asked for) is woken by every message: the peer signals again
/// until the loop arms the signal anew.
#[test]
fn an_edge_triggered_loop_that_does_not_drain_is_woken_by_each_message() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN | epoll::EventFlags::ET, true);
    let mut b = [0u8; 4];
    for i in 0..100u32 {
        s.write_all(&i.to_le_bytes()).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let mut got = 0;
        while got < 4 {
            match c.read(&mut b[got..]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    assert!(Instant::now() < until, "message {i} woke nothing");
                    wait(&ep, Duration::from_secs(5));
                }
                Err(e) => panic!("read: {e}"),
            }
            if got == 4 {
                break;
            }
        }
        assert_eq!(b, i.to_le_bytes());
        // the next message must wake the loop (no read to WouldBlock here)
        if i < 99 {
            s.write_all(&(i + 1000).to_le_bytes()).unwrap();
            let ev = wait(&ep, Duration::from_secs(5));
            assert!(!ev.is_empty(), "message after {i}: no event");
            let mut x = [0u8; 4];
            let mut got = 0;
            while got < 4 {
                match c.read(&mut x[got..]) {
                    Ok(n) => got += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        wait(&ep, Duration::from_millis(100));
                    }
                    Err(e) => panic!("read: {e}"),
                }
            }
            assert_eq!(x, (i + 1000).to_le_bytes());
        }
    }
}

/// Waits in `ep` and reads non-blocking `c` into `b` until a read takes
/// bytes (a wake-up whose read finds nothing waits again), for 5 s at most;
/// how many. `what`: the message, for the failures.
fn wait_and_read(c: &mut SmcStream, ep: &OwnedFd, b: &mut [u8], what: &str) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        assert!(
            !wait(ep, Duration::from_secs(5)).is_empty(),
            "{what} woke nothing"
        );
        match c.read(b) {
            Ok(n) => return n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(Instant::now() < until, "{what} never read");
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Whether `fd` polls readable now.
fn readable_now(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut p = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    rustix::event::poll(&mut p, Some(&rustix::event::Timespec::default())).unwrap() == 1
}

/// A loop whose every registration of the signal is edge-triggered in the
/// kernel (`SmcStream::signal_edge_only`, as `smc-preload` registers it for
/// an application's level-triggered set whose level it keeps itself) is
/// woken by each message, and the read that empties the connection arms
/// the signal again without draining it: the count left does not wake an
/// edge-triggered registration, and the drain would be a system call per
/// message. Where a poller may wait level-triggered (the default, or a
/// `poll` watching it, `SmcStream::watch_signal_level`), the same read
/// drains it.
#[test]
fn an_edge_only_signal_is_armed_again_without_a_drain() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN | epoll::EventFlags::ET, true);
    // (the application's registration level-triggered: the peer writes
    // the signal once per arm)
    c.signal_level(true);
    let sfd = c.signal_fd().unwrap().try_clone_to_owned().unwrap();
    let mut b = [0u8; 64];
    // (the peer fetches the signal's eventfd once a SEND of its finds the
    // bell armed for a poller, and signals the completion channel until
    // then: warmed up until its SENDs write the signal)
    c.signal_edge_only(true);
    let mut warm = 0;
    while !readable_now(sfd.as_fd()) {
        warm += 1;
        assert!(warm < 100, "the peer never writes the signal");
        s.write_all(&[1]).unwrap();
        wait_and_read(&mut c, &ep, &mut b, "a warm-up message");
    }
    for (i, mode) in ["edge", "default", "edge", "poll", "edge"]
        .iter()
        .enumerate()
    {
        c.signal_edge_only(*mode == "edge");
        if *mode == "poll" {
            c.signal_edge_only(true);
            c.watch_signal_level(true);
        }
        for k in 0..20u32 {
            s.write_all(&k.to_le_bytes()).unwrap();
            let n = wait_and_read(&mut c, &ep, &mut b, &format!("{mode} {i}: message {k}"));
            assert_eq!(&b[..n], k.to_le_bytes());
            // (the wait was woken by the signal's write: the peer takes the
            // bell before it publishes the CDC, so the readiness descriptor
            // does not show what the signal announced)
            assert_eq!(
                readable_now(sfd.as_fd()),
                *mode == "edge",
                "{mode} {i}: message {k}: the signal drained (false) or left (true)"
            );
        }
        if *mode == "poll" {
            c.watch_signal_level(false);
        }
    }
}

/// A `poll`'s watch of the signal arms it without a drain, and its end
/// drains only what a peer's SEND signalled since the arm: a `poll` or
/// `select` watches at every call, and a drain that finds nothing is a
/// system call for nothing. A count a late write left (here a write of the
/// test's own) stays then, unless another process may wait on the
/// descriptor (`SmcStream::signal_shared`, a forked child): its waits would
/// see it again and again, so the last poller's going drains it always.
#[test]
fn a_polls_watch_drains_only_what_was_signalled_unless_shared() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let sfd = c.signal_fd().unwrap().try_clone_to_owned().unwrap();
    let late_write = || {
        rustix::io::write(&sfd, &1u64.to_ne_bytes()).unwrap();
    };
    let mut b = [0u8; 64];
    // (warmed up until the peer's SENDs write the signal: it fetches the
    // eventfd once a SEND of its finds the bell armed for a poller)
    let read_one = |c: &mut SmcStream, b: &mut [u8]| {
        let t0 = Instant::now();
        loop {
            match c.read(b) {
                Ok(n) if n > 0 => return,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    assert!(t0.elapsed() < Duration::from_secs(5), "the byte never came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => panic!("read: {r:?}"),
            }
        }
    };
    let mut warm = 0;
    loop {
        c.watch_signal_level(true);
        s.write_all(&[1]).unwrap();
        let t0 = Instant::now();
        while !readable_now(sfd.as_fd()) && t0.elapsed() < Duration::from_millis(200) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if readable_now(sfd.as_fd()) {
            break;
        }
        c.watch_signal_level(false);
        read_one(&mut c, &mut b);
        // (a write of a SEND that came late, after all: not this test's)
        std::thread::sleep(Duration::from_millis(20));
        if readable_now(sfd.as_fd()) {
            let mut n = [0u8; 8];
            rustix::io::read(&sfd, &mut n).unwrap();
        }
        warm += 1;
        assert!(warm < 100, "the peer never writes the signal");
    }
    // what the peer signalled: drained by the watch's end
    c.watch_signal_level(false);
    assert!(
        !readable_now(sfd.as_fd()),
        "a signalled count left undrained"
    );
    read_one(&mut c, &mut b);
    // a count nobody signalled since the arm: neither the watch nor its end
    // makes a system call for it
    late_write();
    c.watch_signal_level(true);
    c.watch_signal_level(false);
    assert!(
        readable_now(sfd.as_fd()),
        "a poll's watch drained a signal no SEND took"
    );
    // (the look a wake-up brings arms it again drained)
    c.watch_signal_level(true);
    assert_eq!(
        c.signalled_events().map(|e| e & libc::EPOLLIN as u32),
        Some(0)
    );
    assert!(!readable_now(sfd.as_fd()), "the look left the count");
    c.watch_signal_level(false);
    // shared with a child: the last poller's going drains it always
    c.signal_shared();
    late_write();
    c.watch_signal_level(true);
    c.watch_signal_level(false);
    assert!(
        !readable_now(sfd.as_fd()),
        "a signal shared with a child left a count"
    );
}

/// A connection's end drains its signal whatever it holds: the signal is
/// its RMB's doorbell descriptor, which the next connection on that RMB
/// takes over, and a count left there (a write that landed after a poller's
/// disarm found nothing to drain) would be readiness of nothing to that
/// connection's event loop: a read that would block, which some programs
/// count as an error (wrk).
#[test]
fn a_connections_end_drains_its_signal() {
    let (c, _s) = pair();
    let sfd = c.signal_fd().unwrap().try_clone_to_owned().unwrap();
    c.watch_signal_level(true);
    c.watch_signal_level(false);
    rustix::io::write(&sfd, &1u64.to_ne_bytes()).unwrap();
    assert!(readable_now(sfd.as_fd()));
    drop(c);
    assert!(
        !readable_now(sfd.as_fd()),
        "the RMB's doorbell descriptor kept a count past its connection"
    );
}
