//! SMC-R for real: SmcListener and SmcStream over loopback, the SYN option from
//! the BPF rendezvous, CLC on the TCP connection, then data over the shared-memory
//! device bound to `lo` (root: BPF).

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use smc_wire::clc::DeclineCode;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2654435761) >> 11) as u8
}

#[test]
fn smc_r_between_two_sockets_of_this_library() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    const N: usize = 4 << 20;
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mode = s.mode();
        // echo everything back, then close after the client's EOF
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0;
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
            total += n;
        }
        (mode, total)
    });
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(
        c.mode(),
        Mode::SmcR,
        "both ends offered SMC and have the shm device"
    );
    let data: Vec<u8> = (0..N).map(pattern).collect();
    let reader = {
        let mut r = c.try_clone().unwrap();
        thread::spawn(move || {
            let mut got = vec![0u8; N];
            r.read_exact(&mut got).unwrap();
            got
        })
    };
    c.write_all(&data).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    assert!(got == data, "echoed data differs");
    let (mode, total) = srv.join().unwrap();
    assert_eq!(mode, Mode::SmcR);
    assert_eq!(total, N);
}

#[test]
fn smc_r_over_ipv6_loopback() {
    setup();
    let l = SmcListener::bind("[::1]:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        s.mode()
    });
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.write_all(b"v6!!").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"v6!!");
    assert_eq!(srv.join().unwrap(), Mode::SmcR);
}

#[test]
fn a_server_that_vanishes_mid_handshake_fails_the_connect_clearly() {
    setup();
    // a listener that offers SMC on its SYN-ACK, reads the Proposal and closes
    let fd = common::opted_in_socket();
    rustix::net::bind(&fd, &"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap()).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; 8];
        s.read_exact(&mut head).unwrap();
        head
    });
    let r = SmcStream::connect(addr);
    let head = srv.join().unwrap();
    assert_eq!(
        &head[..4],
        &[0xE2, 0xD4, 0xC3, 0xD9],
        "a CLC message was sent"
    );
    assert_eq!(head[4], 1, "it is a Proposal");
    let e = match r {
        Ok(s) => panic!("connect succeeded: {:?}", s.mode()),
        Err(e) => e,
    };
    // Linux: the CLC read sees the peer's FIN, connect() fails with ECONNRESET
    // (no fallback: the TCP connection itself is gone)
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
}

/// The server half of the next test: this binary started again with a shm
/// config that declares no device.
fn server_without_a_device() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = l.accept().unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    s.write_all(&b).unwrap();
    println!("server mode {:?}", s.mode());
}

#[test]
fn a_server_without_a_device_declines_no_device_not_different_prefix() {
    setup();
    if std::env::var_os("SMC_NODEV_SERVER").is_some() {
        return server_without_a_device();
    }
    // Same rundir, no device: that process's connections have no endpoint.
    let cfg = std::path::PathBuf::from(std::env::var_os("SMC_RDMA_SHM_CONFIG").unwrap());
    let nodev = cfg.with_file_name("shm-nodev.conf");
    std::fs::write(&nodev, "# no device\n").unwrap();
    let (mut child, mut out, port) = common::spawn_self(
        "a_server_without_a_device_declines_no_device_not_different_prefix",
        &[
            ("SMC_NODEV_SERVER", "1".as_ref()),
            ("SMC_RDMA_SHM_CONFIG", nodev.as_os_str()),
        ],
    );
    let mut c = SmcStream::connect(("127.0.0.1", port)).unwrap();
    let mut b = *b"ping";
    c.write_all(&b).unwrap();
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping", "the connection goes on over TCP");
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "server failed: {rest}");
    // Both ends are on lo's 127.0.0.0/8: the prefixes agree, and what the
    // server lacks is a device (Linux: NOSMCDEV, 0x03030000).
    assert_eq!(
        c.mode(),
        Mode::Tcp(smc::Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::NoSmcDev)
        })
    );
    assert!(
        rest.contains(&format!(
            "server mode {:?}",
            Mode::Tcp(smc::Fallback {
                reason: DeclineCode::NoSmcDev,
                peer: None
            })
        )),
        "server side: {rest}"
    );
}

/// Two threads write into one stream and two read from the other end at the
/// same time (reads and writes copy outside the endpoint's lock, each with
/// the connection's bytes lent to it alone): every byte arrives exactly
/// once, none is lost, repeated or overwritten.
#[test]
fn concurrent_readers_and_writers_of_one_stream_lose_and_repeat_nothing() {
    setup();
    const EACH: usize = 3 << 20;
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        assert_eq!(s.mode(), Mode::SmcR);
        let writers: Vec<_> = [1u8, 2u8]
            .into_iter()
            .map(|tag| {
                let mut w = s.try_clone().unwrap();
                thread::spawn(move || {
                    // pieces of many sizes, so that writes straddle the
                    // ring's end and each other
                    let buf = vec![tag; 70_001];
                    let mut left = EACH;
                    let mut i = 0usize;
                    while left > 0 {
                        let n = left.min(1 + pattern(i) as usize * 271);
                        w.write_all(&buf[..n]).unwrap();
                        left -= n;
                        i += 1;
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        s.shutdown(std::net::Shutdown::Write).unwrap();
        s
    });
    let c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    let readers: Vec<_> = (0..2)
        .map(|k| {
            let mut r = c.try_clone().unwrap();
            thread::spawn(move || {
                let mut count = [0usize; 256];
                let mut buf = vec![0u8; 40_000 + k * 13_331];
                let mut i = 0usize;
                loop {
                    let want = 1 + (pattern(i + k) as usize * 157) % buf.len();
                    let n = r.read(&mut buf[..want]).unwrap();
                    if n == 0 {
                        return count;
                    }
                    for &b in &buf[..n] {
                        count[usize::from(b)] += 1;
                    }
                    i += 1;
                }
            })
        })
        .collect();
    let mut total = [0usize; 256];
    for r in readers {
        for (t, n) in total.iter_mut().zip(r.join().unwrap()) {
            *t += n;
        }
    }
    let _s = srv.join().unwrap();
    assert_eq!(total[1], EACH, "bytes of writer 1");
    assert_eq!(total[2], EACH, "bytes of writer 2");
    assert_eq!(
        total.iter().sum::<usize>(),
        2 * EACH,
        "no byte that nobody wrote"
    );
}
