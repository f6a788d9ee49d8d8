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

/// Voluntary context switches of this process's threads whose name starts
/// with `prefix`.
fn switches_of(prefix: &str) -> u64 {
    common::voluntary_switches_by_thread(false)
        .into_iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// An epoll set with `c`'s readiness descriptor and, if `signal`, its peer
/// signal, both under data 7 (as `smc-preload`'s `epoll_ctl` registers
/// them).
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
        epoll::add(&ep, sfd, epoll::EventData::new_u64(7), only_in).unwrap();
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

/// Reads `want` bytes from non-blocking `c` as an event loop does: read
/// until it would block, then wait in `ep`. Returns the bytes and how many
/// waits returned without anything to read (spurious wake-ups).
fn read_by_loop(c: &mut SmcStream, ep: &OwnedFd, want: usize) -> (Vec<u8>, usize) {
    let mut got = Vec::new();
    let mut empty = 0;
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
                    empty += 1;
                }
                let ev = wait(ep, Duration::from_secs(10));
                assert!(ev.iter().all(|&d| d == 7), "unexpected data {ev:?}");
                woke = !ev.is_empty();
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    (got, empty)
}

fn pair() -> (SmcStream, SmcStream) {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = SmcStream::connect(addr).unwrap();
    let (s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    assert_eq!(s.mode(), Mode::SmcR);
    (c, s)
}

/// An echo server on its own thread: reads 64-byte messages (blocking) and
/// answers each with its complement.
fn echo(mut s: SmcStream, rounds: usize) -> std::thread::JoinHandle<SmcStream> {
    std::thread::Builder::new()
        .name("echo".into())
        .spawn(move || {
            let mut b = [0u8; 64];
            for _ in 0..rounds {
                s.read_exact(&mut b).unwrap();
                for x in &mut b {
                    *x = !*x;
                }
                s.write_all(&b).unwrap();
            }
            s
        })
        .unwrap()
}

/// Request/response from an event loop: each answer wakes the loop through
/// the peer's signal; the progress thread sleeps through it.
fn ping_pong_from_a_loop(flags: epoll::EventFlags, signal: bool) -> u64 {
    std::env::set_var("SMC_RS_REGISTRY", "0");
    let (mut c, s) = pair();
    const WARM: usize = 100;
    const ROUNDS: usize = 2000;
    let server = echo(s, WARM + ROUNDS);
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, flags, signal);
    let mut before = 0;
    let mut spurious = 0;
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = switches_of("smc-progress");
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
        let (got, empty) = read_by_loop(&mut c, &ep, 64);
        assert_eq!(got, [!(i as u8); 64], "answer {i}");
        spurious += empty;
    }
    let woken = switches_of("smc-progress") - before;
    server.join().unwrap();
    // at most a few wake-ups for nothing (a signal whose bytes a read had
    // taken already)
    assert!(
        spurious <= ROUNDS / 20,
        "{spurious} of {ROUNDS} waits woke with nothing to read"
    );
    woken
}

#[test]
fn an_event_loop_is_woken_by_the_peer_not_by_the_progress_thread() {
    let level = ping_pong_from_a_loop(epoll::EventFlags::IN, true);
    let edge = ping_pong_from_a_loop(epoll::EventFlags::IN | epoll::EventFlags::ET, true);
    // Room for what the engine does on its own (a timer, a lock met busy,
    // an answer that came before the loop armed the signal).
    for (what, woken) in [("level", level), ("edge", edge)] {
        assert!(
            woken <= 2000 / 20,
            "{what}-triggered: the progress thread woke {woken} times for 2000 answers"
        );
    }
}

#[test]
fn without_a_poller_the_readiness_descriptor_shows_the_data_again() {
    let (mut c, mut s) = pair();
    c.set_nonblocking(true).unwrap();
    let ep = event_loop_set(&c, epoll::EventFlags::IN, true);
    // one message through the signal
    s.write_all(b"one").unwrap();
    let (got, _) = read_by_loop(&mut c, &ep, 3);
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
        let (got, _) = read_by_loop(&mut c, &ep, 4);
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
