//! Issue 13, finding 3 at library level: many short-lived client processes
//! each connect over SMC-R, echo and exit (half of them closing first, half
//! just exiting). Once they are gone, their link groups must end at once (a
//! dead peer's link fails, and a group without a usable link is terminated,
//! smc_core.c `smc_lgr_terminate_sched` after `smcr_link_down`), and the
//! server's connections, link groups, descriptors, memfds, threads and
//! resident memory return to their baseline.
//!
//! The server and the clients are this test binary started again.

mod common;

use common::{line_with, setup, Reaped};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const TEST: &str = "finding3_short_lived_client_processes_leave_nothing_behind";

const CLIENTS: usize = 40;
/// Clients alive at once.
const BATCH: usize = 8;

/// How long the server may take to end the groups of dead peers and free
/// what they held.
const SETTLE: Duration = Duration::from_secs(10);

/// Resident memory the server may keep for good (allocator caches).
const RSS_SLACK_KIB: u64 = 8 << 10;

/// conns, groups, threads, fds, memfds, rss (KiB) of this process.
fn counts() -> [u64; 6] {
    common::held()
}

fn server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    thread::spawn(move || {
        while let Ok((mut s, _)) = l.accept() {
            assert_eq!(s.mode(), Mode::SmcR, "server side");
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    for line in std::io::stdin().lines() {
        if line.unwrap().trim() == "counts" {
            let c = counts();
            println!(
                "counts {} {} {} {} {} {}",
                c[0], c[1], c[2], c[3], c[4], c[5]
            );
            std::io::stdout().flush().unwrap();
        }
    }
}

fn client() {
    let port: u16 = std::env::var("SMC_F3_PORT").unwrap().parse().unwrap();
    let mut s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(s.mode(), Mode::SmcR, "client side");
    let msg: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    s.write_all(&msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
    if std::env::var_os("SMC_F3_CLOSE").is_some() {
        drop(s);
    }
    // no unwinding, no harness teardown: the process is gone right here
    std::process::exit(0);
}

fn run_client(port: u16, close: bool) -> Reaped {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_F3_CLIENT", "1")
        .env("SMC_F3_PORT", port.to_string())
        .stdout(Stdio::null());
    if close {
        cmd.env("SMC_F3_CLOSE", "1");
    }
    Reaped(cmd.spawn().unwrap())
}

/// Waits until `counts` are back at `base`; returns how long it took.
fn settle(counts: &mut dyn FnMut() -> [u64; 6], base: [u64; 6], what: &str) -> Duration {
    let names = [
        "connections",
        "link groups",
        "threads",
        "fds",
        "memfds",
        "rss KiB",
    ];
    let t0 = Instant::now();
    loop {
        let c = counts();
        let over: Vec<String> = (0..6)
            .filter(|&i| {
                let slack = if i == 5 { RSS_SLACK_KIB } else { 0 };
                c[i] > base[i].saturating_add(slack)
            })
            .map(|i| format!("{} {} (baseline {})", names[i], c[i], base[i]))
            .collect();
        if over.is_empty() {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < SETTLE,
            "{what}: not back at the baseline after {SETTLE:?}: {}",
            over.join(", ")
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn finding3_short_lived_client_processes_leave_nothing_behind() {
    setup();
    if std::env::var_os("SMC_F3_SERVER").is_some() {
        return server();
    }
    if std::env::var_os("SMC_F3_CLIENT").is_some() {
        return client();
    }
    let mut srv = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_F3_SERVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sin = srv.stdin.take().unwrap();
    let mut sout = BufReader::new(srv.stdout.take().unwrap());
    let _srv = Reaped(srv);
    let port: u16 = line_with(&mut sout, "port ")[5..].parse().unwrap();
    let mut counts = || {
        writeln!(sin, "counts").unwrap();
        sin.flush().unwrap();
        let l = line_with(&mut sout, "counts ");
        let v: Vec<u64> = l[7..]
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        [v[0], v[1], v[2], v[3], v[4], v[5]]
    };
    // the first client opens the server's device: not part of the baseline
    let mut warm = run_client(port, true);
    assert!(warm.0.wait().unwrap().success(), "first client failed");
    let zero = [0, 0, u64::MAX, u64::MAX, u64::MAX, u64::MAX];
    settle(&mut counts, zero, "after the first client");
    thread::sleep(Duration::from_millis(300));
    let base = counts();
    eprintln!("baseline: {base:?}");
    let mut started = 0;
    while started < CLIENTS {
        let batch: Vec<Reaped> = (0..BATCH.min(CLIENTS - started))
            .map(|k| run_client(port, (started + k) % 2 == 0))
            .collect();
        started += batch.len();
        for mut c in batch {
            assert!(c.0.wait().unwrap().success(), "a client failed");
        }
    }
    let took = settle(
        &mut counts,
        base,
        &format!("after {CLIENTS} client processes"),
    );
    eprintln!("back at the baseline {took:?} after the last client");
}
