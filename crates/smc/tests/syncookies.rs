//! A SYN-ACK with a SYN cookie offers no SMC: a listener whose SYN queue
//! overflowed (a burst of clients, a SYN flood) answers with cookies, and
//! the connection a cookie's ACK makes has no saved SYN, so the server takes
//! it for plain TCP. Had the SYN-ACK carried the SMC option, the client
//! would start the CLC handshake and the server's application would read
//! the Proposal as data (and the client's connect would fail). Run in a
//! network namespace of its own with `net.ipv4.tcp_syncookies = 2` (a
//! cookie for every SYN), so that nothing else on the host is touched.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::process::Command;

const CHILD: &str = "SMC_SYNCOOKIE_CHILD";

#[test]
fn a_syn_ack_with_a_syn_cookie_offers_no_smc() {
    if std::env::var_os(CHILD).is_some() {
        return in_the_namespace();
    }
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF, network namespaces); CI runs as root"
    );
    let out = Command::new("unshare")
        .arg("--net")
        .arg(std::env::current_exe().unwrap())
        .args([
            "a_syn_ack_with_a_syn_cookie_offers_no_smc",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .expect("run unshare (util-linux)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("both ends plain TCP, 3 connections intact"),
        "{text}"
    );
}

/// In a fresh network namespace: every SYN answered with a cookie; three
/// connections between an `SmcListener` and `SmcStream`s fall back to TCP
/// on both ends, and what each client writes comes back whole.
fn in_the_namespace() {
    let up = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .expect("run ip (iproute2)");
    assert!(up.success());
    std::fs::write("/proc/sys/net/ipv4/tcp_syncookies", "2").unwrap();
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    const N: usize = 3;
    let srv = std::thread::spawn(move || {
        (0..N)
            .map(|_| {
                let (mut s, _) = l.accept().unwrap();
                let mut b = [0u8; 5];
                s.read_exact(&mut b).unwrap();
                s.write_all(&b).unwrap();
                (s.mode(), b)
            })
            .collect::<Vec<_>>()
    });
    for _ in 0..N {
        let mut c = SmcStream::connect(addr).expect("a connect that falls back");
        assert!(matches!(c.mode(), Mode::Tcp(_)), "{:?}", c.mode());
        c.write_all(b"hello").unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello");
    }
    for (mode, got) in srv.join().unwrap() {
        assert!(matches!(mode, Mode::Tcp(_)), "{mode:?}");
        assert_eq!(
            &got, b"hello",
            "the server read its client's bytes, nothing else"
        );
    }
    println!("both ends plain TCP, {N} connections intact");
}
