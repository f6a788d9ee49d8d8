//! Readiness descriptors (`SmcStream::readiness_fd`, `AsFd`): an SMC-R
//! stream's descriptor polls readable and writable exactly when a read or
//! a write would not block, for poll() and epoll (level- and
//! edge-triggered); a listener's polls readable exactly when accept()
//! would not block. (root: BPF)

mod common;

use common::setup;
use rustix::event::{epoll, PollFd, PollFlags, Timespec};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::net::TcpListener;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// Generous bound for a state change to show (never reached when it works).
const LONG: Timespec = Timespec {
    tv_sec: 10,
    tv_nsec: 0,
};
const NOW: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 0,
};

fn poll(fd: BorrowedFd<'_>, want: PollFlags, t: &Timespec) -> PollFlags {
    let mut p = [PollFd::from_borrowed_fd(fd, want | PollFlags::RDHUP)];
    rustix::event::poll(&mut p, Some(t)).unwrap();
    p[0].revents()
}

fn pair() -> (SmcStream, SmcStream) {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let c = SmcStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    assert_eq!(s.mode(), Mode::SmcR);
    (c, s)
}

/// Reads until WouldBlock; returns the bytes read.
fn drain(s: &SmcStream) -> usize {
    let mut total = 0;
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match (&*s).read(&mut buf) {
            Ok(0) => return total,
            Ok(n) => total += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return total,
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Writes until WouldBlock; returns the bytes written.
fn fill(s: &SmcStream) -> usize {
    let buf = vec![7u8; 256 << 10];
    let mut total = 0;
    loop {
        match (&*s).write(&buf) {
            Ok(n) => total += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return total,
            Err(e) => panic!("write: {e}"),
        }
    }
}

#[test]
fn an_smc_r_stream_polls_as_its_reads_and_writes_would_go() {
    let (c, s) = pair();
    c.set_nonblocking(true).unwrap();
    s.set_nonblocking(true).unwrap();
    let (cfd, sfd) = (c.as_fd(), s.as_fd());
    assert_ne!(
        cfd.as_raw_fd(),
        c.tcp_fd().as_raw_fd(),
        "not the TCP socket"
    );
    let both = PollFlags::IN | PollFlags::OUT;
    // nothing to read yet, room to write
    assert_eq!(poll(sfd, both, &NOW), PollFlags::OUT);
    assert_eq!(drain(&s), 0);
    // data: readable (a pump in another thread, or the progress thread, shows it)
    (&c).write_all(b"hello").unwrap();
    assert!(poll(sfd, PollFlags::IN, &LONG).contains(PollFlags::IN));
    assert_eq!(drain(&s), 5);
    assert_eq!(
        poll(sfd, both, &NOW),
        PollFlags::OUT,
        "read it all: not readable"
    );
    // the peer stops reading: the writer fills up and stops being writable
    let sent = fill(&c);
    assert!(sent > 0);
    assert!(
        !poll(cfd, both, &NOW).contains(PollFlags::OUT),
        "full: not writable"
    );
    assert!(poll(sfd, PollFlags::IN, &LONG).contains(PollFlags::IN));
    // the reader takes it all: writable again
    let mut got = 0;
    while got < sent {
        assert!(poll(sfd, PollFlags::IN, &LONG).contains(PollFlags::IN));
        got += drain(&s);
    }
    assert_eq!(got, sent);
    assert!(poll(cfd, PollFlags::OUT, &LONG).contains(PollFlags::OUT));
    // end of file: readable with RDHUP, and a read says 0 without blocking
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let p = poll(sfd, PollFlags::IN, &LONG);
    assert!(p.contains(PollFlags::IN | PollFlags::RDHUP), "{p:?}");
    assert_eq!((&s).read(&mut [0u8; 8]).unwrap(), 0);
    assert!(poll(sfd, PollFlags::IN, &NOW).contains(PollFlags::IN | PollFlags::RDHUP));
}

/// Writable shows for as long as writes go through, also past a send
/// buffer's worth of bytes written straight into the peer's RMB (they take
/// no send-buffer space), and not once a write blocks. (A writer that waited
/// for the descriptor when it was not shown writable, as iperf3 does,
/// stalled there while the peer's RMB had room.) The descriptor shows what
/// the connection's last look saw: a send completion that freed send-buffer
/// space since is taken by the next write itself, or by the progress
/// thread, which it wakes (its send CQ is armed while the buffer is full),
/// and then shown; so past the first send buffer's worth a descriptor not
/// shown writable must turn writable soon (`SETTLE`) where a write would go
/// through, and stay not writable where it would block. (Within the first,
/// where nothing can lag, the check is immediate: a level that counted
/// direct bytes as unacknowledged failed it right at the send buffer's
/// size.)
#[test]
fn a_writer_polls_writable_exactly_while_its_writes_go_through() {
    // (on a loaded machine the progress thread may take a while to run)
    const SETTLE: Timespec = Timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    let (c, s) = pair();
    c.set_nonblocking(true).unwrap();
    s.set_nonblocking(true).unwrap();
    let cfd = c.as_fd();
    let buf = vec![7u8; 64 << 10];
    // (up to a send buffer's worth written, the room shown is at least what
    // was not written yet, and none only if every byte so far still waited
    // for its completion: the check is immediate there)
    let sndbuf = c.buffer_sizes().unwrap().1;
    let mut sent = 0;
    loop {
        let shown = poll(cfd, PollFlags::OUT, &NOW).contains(PollFlags::OUT)
            || (sent > sndbuf && poll(cfd, PollFlags::OUT, &SETTLE).contains(PollFlags::OUT));
        match (&c).write(&buf) {
            Ok(n) => {
                assert!(
                    shown,
                    "not shown writable, yet a write took {n} after {sent}"
                );
                sent += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                assert!(!shown, "shown writable, yet a write blocked after {sent}");
                break;
            }
            Err(e) => panic!("write: {e}"),
        }
    }
    // (the peer's RMB, then the send buffer: more than either)
    let rmb = s.buffer_sizes().unwrap().0;
    assert!(
        sent > rmb.max(sndbuf),
        "{sent} bytes before the first block (RMB {rmb}, send buffer {sndbuf})"
    );
    let mut got = 0;
    while got < sent {
        assert!(poll(s.as_fd(), PollFlags::IN, &LONG).contains(PollFlags::IN));
        got += drain(&s);
    }
    assert_eq!(got, sent);
    assert!(poll(cfd, PollFlags::OUT, &LONG).contains(PollFlags::OUT));
    assert!((&c).write(&buf).unwrap() > 0);
}

fn wait(ep: &std::os::fd::OwnedFd, t: &Timespec) -> Vec<(u64, epoll::EventFlags)> {
    let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 8];
    let (got, _) = epoll::wait(ep, &mut buf, Some(t)).unwrap();
    got.iter().map(|e| (e.data.u64(), e.flags)).collect()
}

#[test]
fn epoll_level_and_edge_triggered_on_an_smc_r_stream() {
    use epoll::EventFlags as E;
    let (c, s) = pair();
    s.set_nonblocking(true).unwrap();
    let lt = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    let et = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    epoll::add(&lt, &s, epoll::EventData::new_u64(1), E::IN | E::RDHUP).unwrap();
    epoll::add(
        &et,
        &s,
        epoll::EventData::new_u64(2),
        E::IN | E::RDHUP | E::ET,
    )
    .unwrap();
    assert!(wait(&lt, &NOW).is_empty());
    assert!(wait(&et, &NOW).is_empty());
    (&c).write_all(b"abc").unwrap();
    assert_eq!(wait(&et, &LONG), vec![(2, E::IN)]);
    assert!(wait(&et, &NOW).is_empty(), "edge: reported once");
    // (LONG, not NOW: the thread that made the descriptor readable wakes
    // each epoll set in turn, and this thread may already run between the
    // two wake-ups: `lt` may not have its event yet; a TCP socket in two
    // epoll sets is the same)
    assert_eq!(wait(&lt, &LONG), vec![(1, E::IN)]);
    // a partial read leaves it readable: level says so again, edge does not
    let mut b = [0u8; 1];
    assert_eq!((&s).read(&mut b).unwrap(), 1);
    assert_eq!(wait(&lt, &NOW), vec![(1, E::IN)]);
    assert!(wait(&et, &NOW).is_empty());
    assert_eq!(drain(&s), 2);
    assert!(wait(&lt, &NOW).is_empty(), "drained: not readable");
    // the next data is a new edge
    (&c).write_all(b"d").unwrap();
    assert_eq!(wait(&et, &LONG), vec![(2, E::IN)]);
    assert_eq!(drain(&s), 1);
    drop(c);
    let ev = wait(&lt, &LONG);
    assert_eq!(ev.len(), 1);
    assert!(ev[0].1.contains(E::IN | E::RDHUP), "{ev:?}");
}

#[test]
fn a_listener_polls_readable_when_accept_would_not_block() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let lfd = l.as_fd();
    assert!(poll(lfd, PollFlags::IN | PollFlags::OUT, &NOW).is_empty());
    assert!(l.accept().unwrap_err().kind() == io::ErrorKind::WouldBlock);
    let c = SmcStream::connect(l.local_addr().unwrap()).unwrap();
    assert_eq!(poll(lfd, PollFlags::IN, &LONG), PollFlags::IN);
    let (s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), Mode::SmcR);
    assert!(
        poll(lfd, PollFlags::IN, &NOW).is_empty(),
        "taken: not readable"
    );
    drop((c, s));
}

/// A fallback stream's descriptor is its TCP socket.
#[test]
fn a_fallback_stream_polls_on_its_tcp_socket() {
    setup();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = SmcStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert!(matches!(c.mode(), Mode::Tcp(_)));
    assert_eq!(c.as_fd().as_raw_fd(), c.tcp_fd().as_raw_fd());
    assert!(poll(c.as_fd(), PollFlags::IN, &NOW).is_empty());
    s.write_all(b"x").unwrap();
    assert_eq!(poll(c.as_fd(), PollFlags::IN, &LONG), PollFlags::IN);
}
