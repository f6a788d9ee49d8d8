//! `shutdown` and `close` of an SMC-R stream as a TCP socket's: the read side
//! shut down ends reads (also a reader already waiting), `SO_LINGER` with a
//! zero timeout resets the peer, and a connection that is over is not
//! connected. Each against a TCP connection doing the same, so that what is
//! asserted is TCP's behaviour, not a guess at it.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;
const ERR: u32 = libc::EPOLLERR as u32;
const HUP: u32 = libc::EPOLLHUP as u32;
const RDHUP: u32 = libc::EPOLLRDHUP as u32;

fn smc_pair() -> (SmcStream, SmcStream) {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let a = thread::spawn(move || l.accept().unwrap().0);
    let c = SmcStream::connect(addr).unwrap();
    let s = a.join().unwrap();
    assert_eq!((c.mode(), s.mode()), (Mode::SmcR, Mode::SmcR));
    // (events are looked at through the readiness descriptor's state)
    c.readiness_fd().unwrap();
    s.readiness_fd().unwrap();
    (c, s)
}

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let s = l.accept().unwrap().0;
    (c, s)
}

/// What `poll` shows of a TCP socket now (as epoll bits).
fn tcp_events(t: &TcpStream) -> u32 {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut p = [PollFd::new(
        t,
        PollFlags::IN | PollFlags::OUT | PollFlags::RDHUP,
    )];
    poll(&mut p, Some(&rustix::event::Timespec::default())).unwrap();
    u32::from(p[0].revents().bits()) & (IN | OUT | ERR | HUP | RDHUP)
}

fn smc_events(s: &SmcStream) -> u32 {
    s.ready_events().expect("a readiness descriptor") & (IN | OUT | ERR | HUP | RDHUP)
}

/// A read of up to 64 bytes in another thread, started now: its result.
fn read_in_thread<S: Read + Send + 'static>(mut s: S) -> mpsc::Receiver<std::io::Result<usize>> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut b = [0u8; 64];
        let _ = tx.send(s.read(&mut b));
    });
    rx
}

/// `shutdown(SHUT_RD)`: a reader waiting in another thread returns 0, later
/// reads return 0 at once, what the peer still sends is read, the stream
/// shows readable with `EPOLLRDHUP`; both sides shut by this side show
/// `EPOLLHUP` too.
#[test]
fn the_read_side_shut_down_ends_reads_as_on_tcp() {
    let (tc, mut ts) = tcp_pair();
    let (sc, mut ss) = smc_pair();
    let waiting_tcp = read_in_thread(tc.try_clone().unwrap());
    let waiting_smc = read_in_thread(sc.try_clone().unwrap());
    thread::sleep(Duration::from_millis(200));
    tc.shutdown(Shutdown::Read).unwrap();
    sc.shutdown(Shutdown::Read).unwrap();
    let t = Duration::from_secs(5);
    assert_eq!(waiting_tcp.recv_timeout(t).unwrap().unwrap(), 0, "TCP");
    assert_eq!(
        waiting_smc
            .recv_timeout(t)
            .expect("the waiting reader returns")
            .unwrap(),
        0
    );
    let mut b = [0u8; 16];
    assert_eq!((&tc).read(&mut b).unwrap(), 0);
    assert_eq!((&sc).read(&mut b).unwrap(), 0);
    assert_eq!(tcp_events(&tc), IN | OUT | RDHUP);
    assert_eq!(smc_events(&sc), IN | OUT | RDHUP);
    // the peer is not told: it writes on, and that is read
    ts.write_all(b"after").unwrap();
    ss.write_all(b"after").unwrap();
    thread::sleep(Duration::from_millis(100));
    assert_eq!((&tc).read(&mut b).unwrap(), 5);
    assert_eq!((&sc).read(&mut b).unwrap(), 5);
    assert_eq!(&b[..5], b"after");
    tc.shutdown(Shutdown::Write).unwrap();
    sc.shutdown(Shutdown::Write).unwrap();
    assert_eq!(tcp_events(&tc), IN | OUT | HUP | RDHUP);
    assert_eq!(smc_events(&sc), IN | OUT | HUP | RDHUP);
}

/// `SO_LINGER` on with a zero timeout, then close: the peer's read fails
/// with `ECONNRESET` (not end of file), and its stream shows `EPOLLERR`.
#[test]
fn a_close_with_zero_linger_resets_the_peer() {
    let (tc, ts) = tcp_pair();
    let (sc, ss) = smc_pair();
    rustix::net::sockopt::set_socket_linger(&tc, Some(Duration::ZERO)).unwrap();
    sc.set_linger(Some(Duration::ZERO)).unwrap();
    assert_eq!(sc.linger().unwrap(), Some(Duration::ZERO));
    drop(tc);
    drop(sc);
    let t = Duration::from_secs(5);
    let tcp = read_in_thread(ts.try_clone().unwrap())
        .recv_timeout(t)
        .unwrap();
    assert_eq!(tcp.unwrap_err().kind(), ErrorKind::ConnectionReset, "TCP");
    let smc = read_in_thread(ss.try_clone().unwrap())
        .recv_timeout(t)
        .unwrap();
    assert_eq!(smc.unwrap_err().kind(), ErrorKind::ConnectionReset);
    assert_ne!(smc_events(&ss) & ERR, 0, "{:#x}", smc_events(&ss));
    assert_ne!(smc_events(&ss) & HUP, 0);
}

/// Both directions shut down, each by one side: `shutdown` again is
/// `ENOTCONN`, as on a TCP socket in `TCP_CLOSE`; and a zero linger that was
/// not asked for leaves the close orderly.
#[test]
fn a_connection_over_is_not_connected() {
    let (mut tc, mut ts) = tcp_pair();
    let (mut sc, mut ss) = smc_pair();
    let mut b = [0u8; 8];
    tc.shutdown(Shutdown::Write).unwrap();
    sc.shutdown(Shutdown::Write).unwrap();
    assert_eq!(ts.read(&mut b).unwrap(), 0);
    assert_eq!(ss.read(&mut b).unwrap(), 0);
    ts.shutdown(Shutdown::Write).unwrap();
    ss.shutdown(Shutdown::Write).unwrap();
    assert_eq!(tc.read(&mut b).unwrap(), 0);
    assert_eq!(sc.read(&mut b).unwrap(), 0);
    thread::sleep(Duration::from_millis(100));
    for (what, e) in [
        ("TCP, the first to shut", tc.shutdown(Shutdown::Read)),
        ("TCP, the second", ts.shutdown(Shutdown::Read)),
        ("SMC-R, the first to shut", sc.shutdown(Shutdown::Read)),
        ("SMC-R, the second", ss.shutdown(Shutdown::Read)),
    ] {
        assert_eq!(e.unwrap_err().kind(), ErrorKind::NotConnected, "{what}");
    }
    assert_eq!(sc.linger().unwrap(), None);
}
