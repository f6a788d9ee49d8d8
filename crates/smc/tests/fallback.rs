//! SmcStream / SmcListener against plain std sockets and against each other, over
//! loopback with the real SYN-option rendezvous (root: BPF). No RDMA device is
//! configured here, so every pair ends on TCP — with the reason Linux would give.

mod common;

use smc::{Fallback, Mode, SmcListener, SmcStream};
use smc_wire::clc::DeclineCode;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

fn require_root() {
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "these tests need root (BPF); CI runs as root"
    );
}

fn echo_once(mut s: impl Read + Write) {
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).unwrap();
    s.write_all(&buf).unwrap();
}

#[test]
fn smc_client_to_plain_tcp_server() {
    require_root();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut first = [0u8; 5];
        s.read_exact(&mut first).unwrap();
        s.write_all(&first).unwrap();
        first
    });
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(
        c.mode(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::PeerNoSmc,
            peer: None
        })
    );
    assert_eq!(
        c.mode().clone(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::from_u32(0x0301_0000),
            peer: None
        })
    );
    c.write_all(b"hello").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"hello");
    assert_eq!(
        &srv.join().unwrap(),
        b"hello",
        "no CLC bytes reach a plain peer"
    );
}

#[test]
fn plain_tcp_client_to_smc_server() {
    require_root();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mode = s.mode();
        echo_once(s);
        mode
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"howdy").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"howdy");
    assert_eq!(
        srv.join().unwrap(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::PeerNoSmc,
            peer: None
        })
    );
}

fn smc_pair(bind: &str) {
    let l = SmcListener::bind(bind).unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mode = s.mode();
        echo_once(&s);
        mode
    });
    let mut c = SmcStream::connect(addr).unwrap();
    // no SMC device wired in yet: the client declines NOSMCDEV, both go on on TCP
    assert_eq!(
        c.mode(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::NoSmcDev,
            peer: None
        })
    );
    c.write_all(b"12345").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"12345", "TCP data follows the Decline intact");
    assert_eq!(
        srv.join().unwrap(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::NoSmcDev)
        })
    );
}

#[test]
fn smc_to_smc_without_a_device_declines_and_continues_on_tcp() {
    require_root();
    smc_pair("127.0.0.1:0");
}

#[test]
fn smc_to_smc_over_ipv6() {
    require_root();
    smc_pair("[::1]:0");
}

#[test]
fn garbage_instead_of_clc_fails_that_connection_only() {
    require_root();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        // the garbage connection is dropped inside accept(); the next one is served
        let (s, _) = l.accept().unwrap();
        let mode = s.mode();
        echo_once(&s);
        mode
    });
    // a client that offers SMC on its SYN but then speaks HTTP
    let fd = common::opted_in_socket();
    rustix::net::connect(&fd, &addr).unwrap();
    let mut bad = TcpStream::from(fd);
    bad.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut sink = [0u8; 16];
    assert!(
        matches!(bad.read(&mut sink), Ok(0) | Err(_)),
        "the server closes the garbage connection"
    );
    // a well-behaved client still gets served
    let mut c = SmcStream::connect(addr).unwrap();
    c.write_all(b"still").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"still");
    assert!(matches!(srv.join().unwrap(), Mode::Tcp(_)));
}

#[test]
fn a_client_that_vanishes_mid_handshake_fails_that_connection_only() {
    require_root();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        echo_once(&s);
    });
    // offers SMC, starts a CLC message (the eyecatcher) and disappears
    let fd = common::opted_in_socket();
    rustix::net::connect(&fd, &addr).unwrap();
    let mut gone = TcpStream::from(fd);
    gone.write_all(&[0xE2, 0xD4, 0xC3, 0xD9, 0x01]).unwrap();
    drop(gone);
    let mut c = SmcStream::connect(addr).unwrap();
    c.write_all(b"after").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"after");
    srv.join().unwrap();
}

/// Issue 14: a Decline sent without a device carries this process's system
/// ID, as Linux's carries its `local_systemid`, not an all-zero one. Two
/// connections of one process carry the same one.
#[test]
fn a_decline_without_a_device_carries_this_processs_system_id() {
    require_root();
    let fd = common::opted_in_socket();
    rustix::net::bind(&fd, &"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap()).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        (0..2)
            .map(|_| {
                let (mut s, _) = l.accept().unwrap();
                let mut head = [0u8; 8];
                s.read_exact(&mut head).unwrap();
                assert_eq!(head[4], 4, "no device: a Decline, not a Proposal");
                let len = usize::from(u16::from_be_bytes([head[5], head[6]]));
                let mut msg = head.to_vec();
                msg.resize(len, 0);
                s.read_exact(&mut msg[8..]).unwrap();
                smc_wire::clc::Decline::decode(&msg).unwrap().peer_id
            })
            .collect::<Vec<_>>()
    });
    for _ in 0..2 {
        let c = SmcStream::connect(addr).unwrap();
        assert!(matches!(c.mode(), Mode::Tcp(_)));
    }
    let ids = srv.join().unwrap();
    assert_ne!(
        ids[0],
        smc_wire::types::SystemId::default(),
        "all-zero system ID"
    );
    assert_eq!(ids[0], ids[1], "one system ID per process");
}
