//! Issue 13, finding 4 (a): 10,000 concurrent SMC-R connections between two
//! processes, each moving a few bytes both ways, with at most 2 descriptors
//! per connection on each side (the kernel's SMC costs one: its TCP socket).
//! Here a connection costs its TCP socket and a share of its link group's
//! (the QP's sockets and eventfd, the PD's arena memfds that its RMBs live
//! in): about one.
//!
//! Small buffers (`SMC_RMB_KIB`, `SMC_SNDBUF_KIB` = 16) keep the memory
//! modest; the server is this test binary started again. Both processes
//! raise their soft descriptor limit to the hard one; a hard limit that
//! cannot hold the connections fails the test (it is never scaled down).

mod common;

use common::{fd_kinds, fds, line_with, set_nofile, setup, Reaped};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufReader, Read, Write};
use std::process::{Command, Stdio};

/// Connections of test (a).
const CONNS: usize = 10_000;

/// Descriptors a process may have besides its connections' budget (the
/// test harness, the device, the CLC listener).
const CONSTANT: usize = 200;

/// Raises the soft descriptor limit as far as the connections may need:
/// their 2 each and the constant, or as far as the hard limit goes (which
/// cannot be raised without CAP_SYS_RESOURCE). A hard limit below what the
/// connections need at the least — a TCP socket each and the constant —
/// fails here, with a clear message, rather than somewhere in the middle.
fn raise_nofile() {
    let want = (2 * CONNS + CONSTANT) as u64;
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let r = rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(want),
            maximum: Some(lim.maximum.map_or(want, |m| m.max(want))),
        },
    );
    if r.is_err() {
        set_nofile(lim.maximum.unwrap_or(want));
    }
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    assert!(
        soft >= (CONNS + CONSTANT) as u64,
        "the descriptor limit ({soft}, hard {:?}) cannot hold {CONNS} connections: they need \
         at least {} (a TCP socket each and {CONSTANT}); raise the hard RLIMIT_NOFILE",
        lim.maximum,
        CONNS + CONSTANT
    );
}

/// Checks the budget while connections are being set up (so that a process
/// that spends more than 2 per connection fails on the budget, not on
/// running out of descriptors at the limit).
fn check_budget(side: &str, used: usize, conns: usize) {
    assert!(
        used <= 2 * conns + CONSTANT,
        "{side}: {used} descriptors for {conns} connections (at most 2 each and {CONSTANT}): {}",
        fd_kinds()
    );
}

fn small_buffers() {
    std::env::set_var("SMC_RMB_KIB", "16");
    std::env::set_var("SMC_SNDBUF_KIB", "16");
}

fn many_server() {
    raise_nofile();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let base = fds();
    let n = CONNS;
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) => panic!("server: connection {i}: {e}; descriptors: {}", fd_kinds()),
        };
        assert_eq!(s.mode(), Mode::SmcR, "server side, connection {i}");
        held.push(s);
        if (i + 1) % 1000 == 0 {
            check_budget("server", fds() - base, i + 1);
        }
    }
    // every connection moves a few bytes each way
    for s in &mut held {
        let mut b = [0u8; 8];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    }
    println!("server fds {} base {base} {}", fds(), fd_kinds());
    std::io::stdout().flush().unwrap();
    // until the client is done
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
}

#[test]
fn finding4_ten_thousand_smc_r_connections_at_two_descriptors_each() {
    small_buffers();
    setup();
    if std::env::var_os("SMC_F4_MANY_SERVER").is_some() {
        return many_server();
    }
    let n = CONNS;
    raise_nofile();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "finding4_ten_thousand_smc_r_connections_at_two_descriptors_each",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SMC_F4_MANY_SERVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut child = Reaped(child);
    let port = line_with(&mut out, "port ")[5..].parse::<u16>().unwrap();
    let base = fds();
    let mut conns = Vec::with_capacity(n);
    for i in 0..n {
        let c = SmcStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| {
            panic!(
                "connection {i}: {e}; this process's descriptors: {}",
                fd_kinds()
            )
        });
        assert_eq!(c.mode(), Mode::SmcR, "connection {i}");
        conns.push(c);
        if (i + 1) % 1000 == 0 {
            check_budget("client", fds() - base, i + 1);
        }
    }
    for (i, c) in conns.iter_mut().enumerate() {
        c.write_all(&(i as u64).to_le_bytes()).unwrap();
    }
    for (i, c) in conns.iter_mut().enumerate() {
        let mut b = [0u8; 8];
        c.read_exact(&mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), i as u64, "connection {i}");
    }
    let client = fds() - base;
    let line = line_with(&mut out, "server fds ");
    let v: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let server = v[0] - v[1];
    drop(child.0.stdin.take());
    eprintln!("client: {}\n{line}", fd_kinds());
    eprintln!(
        "{n} connections: client {client} descriptors ({:.2} each), server {server} ({:.2} each)",
        client as f64 / n as f64,
        server as f64 / n as f64
    );
    drop(conns);
    assert!(child.0.wait().unwrap().success(), "server failed");
    check_budget("client", client, n);
    assert!(
        server <= 2 * n + CONSTANT,
        "server: {server} descriptors for {n} connections (at most 2 each and {CONSTANT}): {line}"
    );
}
