//! A client handshake that waits for the server's Accept sleeps until TCP
//! data (or its deadline) comes, not on the endpoint's progress: while other
//! connections of the process move data, every pump of the endpoint that
//! takes completions rings the descriptors registered for its progress, and
//! the handshaking thread woke for each one (issue 15: a message wakes only
//! the thread that waits for it). Root: the BPF rendezvous.

mod common;

use common::{opted_in_socket, setup};
use smc::{Mode, SmcListener, SmcStream};
use smc_wire::clc::{ClcHeader, ClcMessage, Decline, DeclineCode, CLC_HEADER_LEN, SMC_V1};
use smc_wire::types::{Mac, SystemId};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

/// Voluntary context switches of the calling thread so far.
fn my_switches() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap()
}

/// A server that takes one connection, reads its Proposal, and declines it
/// only after `delay` (a busy server; the client waits for its answer).
fn slow_server(delay: Duration) -> (SocketAddr, thread::JoinHandle<()>) {
    let fd = opted_in_socket();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    rustix::net::bind(&fd, &addr).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut m = vec![0u8; CLC_HEADER_LEN];
        s.read_exact(&mut m).unwrap();
        let len = usize::from(ClcHeader::peek(&m).unwrap().length);
        m.resize(len, 0);
        s.read_exact(&mut m[CLC_HEADER_LEN..]).unwrap();
        assert!(matches!(
            ClcMessage::decode(&m).unwrap(),
            ClcMessage::Proposal(_)
        ));
        thread::sleep(delay);
        let d = Decline::new(
            SMC_V1,
            SystemId::new(0x7e57, Mac([2, 0, 0, 0, 0x7e, 0x57])),
            DeclineCode::NoSmcRDev,
        );
        s.write_all(&ClcMessage::Decline(d).encode()).unwrap();
        // the client's first data, then its end
        let mut b = [0u8; 16];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
    });
    (addr, t)
}

#[test]
fn a_client_waiting_for_the_accept_is_not_woken_by_other_connections_traffic() {
    // (the registry's own thread is not the one counted; off all the same)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    setup();
    // Traffic on the endpoint the handshake uses: one SMC-R connection of
    // this process pinging back and forth until the handshake is over.
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let mut c = SmcStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    let stop = AtomicBool::new(false);
    let pings = AtomicU64::new(0);
    thread::scope(|sc| {
        sc.spawn(|| {
            let mut b = [0u8; 64];
            while s.read_exact(&mut b).is_ok() {
                if s.write_all(&b).is_err() {
                    break;
                }
            }
        });
        sc.spawn(|| {
            let mut b = [7u8; 64];
            while !stop.load(Ordering::Relaxed) {
                c.write_all(&b).unwrap();
                c.read_exact(&mut b).unwrap();
                pings.fetch_add(1, Ordering::Relaxed);
            }
            drop(c);
        });
        // traffic is flowing
        while pings.load(Ordering::Relaxed) < 100 {
            thread::sleep(Duration::from_millis(1));
        }
        let (addr, server) = slow_server(Duration::from_millis(500));
        let before_pings = pings.load(Ordering::Relaxed);
        let before = my_switches();
        let mut h = SmcStream::connect(addr).unwrap();
        let woken = my_switches() - before;
        let during = pings.load(Ordering::Relaxed) - before_pings;
        stop.store(true, Ordering::Relaxed);
        assert!(
            matches!(h.mode(), Mode::Tcp(f) if f.reason == DeclineCode::PeerDecl),
            "{:?}",
            h.mode()
        );
        h.write_all(b"after").unwrap();
        drop(h);
        server.join().unwrap();
        assert!(
            during > 100,
            "only {during} round trips on the other connection meanwhile"
        );
        // The TCP answer, the endpoint lock taken a few times (the other
        // connection's threads hold it often): a handful. Woken by its
        // pumps, the handshake was woken about once per round trip.
        assert!(
            woken < 50,
            "the handshake woke {woken} times while the other connection made {during} round trips"
        );
    });
}
