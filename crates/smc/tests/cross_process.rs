//! smc↔smc between two real processes: 1 GiB each way at once over SMC-R,
//! every byte checked against the sender's pattern and a hash of each stream
//! compared across the processes (root: BPF).
//!
//! The server half is this same test binary, started again with
//! `SMC_XP_SERVER=1`; it prints its port and, at the end, the hash of what it
//! received and of what it sent.

mod common;
use common::{pattern, Fnv};

use common::{setup, spawn_self};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::thread;

const TOTAL: u64 = 1 << 30;
const CHUNK: usize = 256 * 1024;

/// Sends TOTAL bytes of direction `dir`; returns their hash.
fn send(mut s: impl Write, dir: u8) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < TOTAL {
        let n = (TOTAL - off).min(CHUNK as u64) as usize;
        for (k, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(dir, off + k as u64);
        }
        s.write_all(&buf[..n]).expect("write");
        h.feed(&buf[..n]);
        off += n as u64;
    }
    s.flush().expect("flush");
    h.0
}

/// Receives TOTAL bytes of direction `dir`, checking each; returns their hash.
fn receive(mut s: impl Read, dir: u8) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < TOTAL {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "end of stream after {off} of {TOTAL} bytes");
        for (k, &b) in buf[..n].iter().enumerate() {
            let o = off + k as u64;
            assert_eq!(b, pattern(dir, o), "byte {o} of direction {dir} is wrong");
        }
        h.feed(&buf[..n]);
        off += n as u64;
    }
    h.0
}

fn server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), Mode::SmcR, "server side mode");
    let tx = s.try_clone().unwrap();
    let sender = thread::spawn(move || send(tx, 1));
    let got = receive(&s, 0);
    let sent = sender.join().unwrap();
    println!("server received {got:016x} sent {sent:016x}");
}

#[test]
fn one_gib_each_way_between_two_processes() {
    setup();
    if std::env::var_os("SMC_XP_SERVER").is_some() {
        return server();
    }
    let (mut child, mut out, port) = spawn_self(
        "one_gib_each_way_between_two_processes",
        &[("SMC_XP_SERVER", "1".as_ref())],
    );
    let s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(s.mode(), Mode::SmcR, "client side mode");
    let tx = s.try_clone().unwrap();
    let sender = thread::spawn(move || send(tx, 0));
    let got = receive(&s, 1);
    let sent = sender.join().unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "server process failed: {rest}");
    let line = rest
        .lines()
        .find_map(|l| l.find("server received").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("no result from the server: {rest}"));
    assert_eq!(
        line.trim(),
        format!("server received {sent:016x} sent {got:016x}"),
        "the two processes saw different streams"
    );
}

const EXIT_TOTAL: u64 = 12 << 20;

/// A process that writes and exits at once loses nothing: closing waits until
/// its unsent data and close have left, as there is no kernel to finish the
/// close once it is gone. 12 MiB is far more than the 1 MiB RMB and 1 MiB send
/// buffer, and the reader is slow, so data is still queued when it closes.
#[test]
fn a_process_exiting_right_after_close_loses_nothing() {
    setup();
    if std::env::var_os("SMC_XP_EXITER").is_some() {
        let l = SmcListener::bind("127.0.0.1:0").unwrap();
        println!("port {}", l.local_addr().unwrap().port());
        std::io::stdout().flush().unwrap();
        let (mut s, _) = l.accept().unwrap();
        assert_eq!(s.mode(), Mode::SmcR, "server side mode");
        let mut buf = vec![0u8; CHUNK];
        let mut off = 0u64;
        while off < EXIT_TOTAL {
            let n = (EXIT_TOTAL - off).min(CHUNK as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(2, off + k as u64);
            }
            s.write_all(&buf[..n]).expect("write");
            off += n as u64;
        }
        drop(s);
        // no unwinding, no test harness teardown: gone right after the close
        std::process::exit(0);
    }
    let (mut child, _out, port) = spawn_self(
        "a_process_exiting_right_after_close_loses_nothing",
        &[("SMC_XP_EXITER", "1".as_ref())],
    );
    let mut s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(s.mode(), Mode::SmcR, "client side mode");
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    loop {
        // a slow reader: the writer finishes and closes with data queued
        thread::sleep(std::time::Duration::from_micros(300));
        let n = s.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        for (k, &b) in buf[..n].iter().enumerate() {
            let o = off + k as u64;
            assert_eq!(b, pattern(2, o), "byte {o} is wrong");
        }
        off += n as u64;
    }
    assert_eq!(off, EXIT_TOTAL, "end of stream after {off} bytes");
    assert!(child.wait().unwrap().success(), "writer process failed");
}
