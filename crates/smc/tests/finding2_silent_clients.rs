//! Issue 13, finding 2: clients that open an SMC-capable connection and then
//! say nothing (or drip their Proposal a byte at a time) must not hold up
//! anyone else's handshake, with the blocking listener and the tokio one
//! alike. Linux handshakes every connection on its own work item
//! (af_smc.c `smc_tcp_listen_work` → `smc_listen_work`), apart from
//! accept().
//!
//! 500 silent SMC-opted TCP connections are held open against a listener;
//! then well-behaved clients connect one after another: each must get SMC-R,
//! with a median connect time of at most 10 ms (the bound the issue states).

mod common;

use common::{opted_in_socket, setup};
use smc::{Mode, SmcStream};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

/// The two tests measure times: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const SILENT: usize = 500;
const GOOD: usize = 30;

/// Opens `n` SMC-opted TCP connections to `addr` that never send a byte.
fn silent(addr: SocketAddr, n: usize) -> Vec<OwnedFd> {
    (0..n)
        .map(|_| {
            let fd = opted_in_socket();
            rustix::io::ioctl_fionbio(&fd, true).unwrap();
            match rustix::net::connect(&fd, &addr) {
                Ok(()) | Err(rustix::io::Errno::INPROGRESS) => {}
                Err(e) => panic!("connect: {e}"),
            }
            fd
        })
        .collect()
}

/// The bytes of a real Proposal of this process (captured from our own
/// client by an opted-in listener that then closes).
fn a_proposal() -> Vec<u8> {
    let fd = opted_in_socket();
    rustix::net::bind(&fd, &"127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; 8];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head[4], 1, "a Proposal");
        let mut m = head.to_vec();
        m.resize(usize::from(u16::from_be_bytes([head[5], head[6]])), 0);
        s.read_exact(&mut m[8..]).unwrap();
        m
    });
    let _ = SmcStream::connect(addr);
    srv.join().unwrap()
}

/// Clients that send a Proposal one byte every 20 ms (about 2 s each, well
/// within the 6 s CLC wait) and then wait; returns their threads.
fn drip(addr: SocketAddr, n: usize, proposal: &[u8]) -> Vec<thread::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let p = proposal.to_vec();
            thread::spawn(move || {
                let fd = opted_in_socket();
                rustix::net::connect(&fd, &addr).unwrap();
                let mut s = TcpStream::from(fd);
                for b in p {
                    if s.write_all(&[b]).is_err() {
                        return;
                    }
                    thread::sleep(Duration::from_millis(20));
                }
                let mut sink = [0u8; 256];
                s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
                let _ = s.read(&mut sink);
            })
        })
        .collect()
}

/// Connects `n` good clients one after another with `connect`; returns the
/// times each took to reach SMC-R, or what went wrong.
fn good_clients(
    n: usize,
    mut connect: impl FnMut() -> std::io::Result<Mode>,
) -> Result<Vec<Duration>, String> {
    let mut times = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        match connect() {
            Ok(Mode::SmcR) => times.push(t.elapsed()),
            Ok(m) => {
                return Err(format!(
                    "client {i} fell back: {m:?} after {:?}",
                    t.elapsed()
                ))
            }
            Err(e) => return Err(format!("client {i} failed: {e} after {:?}", t.elapsed())),
        }
    }
    Ok(times)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// No single client may wait anywhere near a silent client's 6 s CLC
/// timeout: that would be the stall this finding is about.
const STALL: Duration = Duration::from_secs(2);

fn check(what: &str, times: &[Duration]) {
    let m = median(times.to_vec());
    let max = times.iter().max().copied().unwrap_or_default();
    eprintln!("{what}: median {m:?}, max {max:?}");
    assert!(
        m <= Duration::from_millis(10),
        "median connect time {m:?} {what}: {times:?}"
    );
    assert!(max < STALL, "a client stalled {max:?} {what}: {times:?}");
}

fn raise_nofile() {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let want = lim.maximum.unwrap_or(65536).min(65536);
    if lim.current.unwrap_or(u64::MAX) < want {
        rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(want),
                maximum: lim.maximum,
            },
        )
        .unwrap();
    }
}

/// The scenario against a listener at `addr` that accepts and holds every
/// connection: silent clients, then good ones (measured), then drip-fed
/// Proposals while more good ones connect (measured).
fn scenario(addr: SocketAddr, mut connect: impl FnMut() -> std::io::Result<Mode>) {
    // the first contact (link group set-up) is not what is measured
    assert_eq!(connect().unwrap(), Mode::SmcR, "first contact");
    let proposal = a_proposal();
    let _silent = silent(addr, SILENT);
    // the listener has taken them (or left them in the kernel's backlog)
    thread::sleep(Duration::from_millis(300));
    let times = good_clients(GOOD, &mut connect).unwrap_or_else(|e| panic!("{e}"));
    check(&format!("with {SILENT} silent connections"), &times);
    let drips = drip(addr, 20, &proposal);
    thread::sleep(Duration::from_millis(100));
    let times = good_clients(GOOD, &mut connect).unwrap_or_else(|e| panic!("{e}"));
    check("with 20 drip-fed Proposals", &times);
    for d in drips {
        d.join().unwrap();
    }
}

#[test]
fn finding2_silent_clients_do_not_stall_the_blocking_listener() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    raise_nofile();
    let l = smc::SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept() {
            held.push(s);
        }
    });
    scenario(addr, || SmcStream::connect(addr).map(|s| s.mode()));
}

#[cfg(feature = "tokio")]
#[test]
fn finding2_silent_clients_do_not_stall_the_tokio_listener() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    raise_nofile();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let l = rt
        .block_on(smc::tokio::SmcListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = l.local_addr().unwrap();
    rt.spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    // async clients on the same runtime
    scenario(addr, || {
        rt.block_on(smc::tokio::SmcStream::connect(addr))
            .map(|s| s.mode())
    });
}

/// The driver's side effects end with the listener: a non-blocking accept
/// says WouldBlock while only handshakes are pending, and dropping the
/// listener closes the connections still in their handshake (the driver,
/// which holds them, has ended).
#[test]
fn finding2_a_dropped_listener_closes_its_pending_handshakes() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let l = smc::SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let pending: Vec<TcpStream> = silent(addr, 3).into_iter().map(TcpStream::from).collect();
    thread::sleep(Duration::from_millis(200));
    l.set_nonblocking(true).unwrap();
    match l.accept() {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock),
        Ok((s, _)) => panic!("a silent client was accepted: {:?}", s.mode()),
    }
    drop(l);
    for mut s in pending {
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut b = [0u8; 16];
        assert!(
            matches!(s.read(&mut b), Ok(0)),
            "a pending connection stays open after the listener is gone"
        );
    }
}
