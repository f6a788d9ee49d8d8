//! 10,000 idle SMC-R connections in one process cost no CPU (issue 15,
//! "Done when": "10,000 idle connections in one process cost no CPU when
//! idle"): over a few seconds of idleness no thread of the process but the
//! shm device's (which ticks on a period of its own: heartbeats, port
//! state) is woken or runs, and afterwards the connections still work, close
//! cleanly, and what the process held goes back to its baseline.
//!
//! A link group holds at most 255 connections (RFC 7609 §4.4.3; Linux
//! smc_core.h `SMC_RMBS_PER_LGR_MAX`): the 10,000 take 40 groups. The
//! server is this test binary started again (one process cannot hold both
//! ends: two TCP sockets per connection go past a hard RLIMIT_NOFILE of
//! 20,000). Small buffers (`SMC_RMB_KIB`, `SMC_SNDBUF_KIB` = 16) keep the
//! memory modest. Alone in its test binary: the whole process's context
//! switches are counted.

mod common;

use common::{held, line_with, pattern, setup, Fnv, Reaped};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TEST: &str = "ten_thousand_idle_connections_cost_no_cpu";

/// Connections.
const CONNS: usize = 10_000;

/// Connections that move data after the idle time (each a thread on the
/// server).
const BUSY: usize = 8;

/// Bytes each of them sends and gets back.
const BYTES: u64 = 256 << 10;

/// How long the process is left idle.
const IDLE: Duration = Duration::from_secs(3);

/// How long the client may take to be back at its baseline once the server
/// is gone (its groups end when their links fail).
const SETTLE: Duration = Duration::from_secs(10);

/// Descriptors besides the connections (the test harness, the device).
const CONSTANT: u64 = 200;

/// Raises the soft descriptor limit for the connections' TCP sockets.
fn raise_nofile() {
    let want = CONNS as u64 + CONSTANT;
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let hard = lim.maximum.unwrap_or(u64::MAX);
    assert!(
        hard >= want,
        "the hard descriptor limit ({hard}) cannot hold {CONNS} connections: raise it to {want}"
    );
    common::set_nofile(hard.min(2 * want));
}

fn small_buffers() {
    std::env::set_var("SMC_RMB_KIB", "16");
    std::env::set_var("SMC_SNDBUF_KIB", "16");
}

/// Per thread of this process: (comm, voluntary and involuntary context
/// switches, CPU time in clock ticks).
fn threads() -> Vec<(String, [u64; 2], u64)> {
    let mut v = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let (Ok(status), Ok(stat), Ok(comm)) = (
            std::fs::read_to_string(t.path().join("status")),
            std::fs::read_to_string(t.path().join("stat")),
            std::fs::read_to_string(t.path().join("comm")),
        ) else {
            continue; // a thread that just ended
        };
        let mut switches = [0; 2];
        for line in status.lines() {
            if let Some(n) = line.strip_prefix("voluntary_ctxt_switches:") {
                switches[0] = n.trim().parse::<u64>().unwrap();
            }
            if let Some(n) = line.strip_prefix("nonvoluntary_ctxt_switches:") {
                switches[1] = n.trim().parse::<u64>().unwrap();
            }
        }
        // utime and stime: fields 14 and 15, counted after the ")" that
        // ends the command name (which may hold spaces)
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        v.push((comm.trim().to_string(), switches, ticks));
    }
    v
}

/// (voluntary switches, involuntary switches, ticks) of the shm device's
/// thread and of all the others.
fn totals() -> ([u64; 3], [u64; 3]) {
    let (mut dev, mut others) = ([0; 3], [0; 3]);
    for (comm, s, t) in threads() {
        let x = if comm.starts_with("shm-") {
            &mut dev
        } else {
            &mut others
        };
        x[0] += s[0];
        x[1] += s[1];
        x[2] += t;
    }
    (dev, others)
}

fn server() {
    raise_nofile();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let mut held = Vec::with_capacity(CONNS);
    let mut echo = Vec::new();
    for i in 0..CONNS {
        let (mut s, _) = l.accept().unwrap();
        assert_eq!(s.mode(), Mode::SmcR, "server side, connection {i}");
        if i % (CONNS / BUSY) == 0 {
            echo.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 16 << 10];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    s.write_all(&buf[..n]).unwrap();
                }
            }));
        } else {
            held.push(s);
        }
    }
    println!("accepted");
    std::io::stdout().flush().unwrap();
    for e in echo {
        e.join().unwrap();
    }
    // until the client has closed its ends: then ours close too, cleanly
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(held);
    let deadline = Instant::now() + SETTLE;
    while live_conns() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("closed, {} left", live_conns());
    std::io::stdout().flush().unwrap();
}

/// SMC connections of this process.
fn live_conns() -> usize {
    smc::state().iter().map(|d| d.connections).sum()
}

#[test]
fn ten_thousand_idle_connections_cost_no_cpu() {
    // The registry of the tools (smcss) publishes this process's sockets
    // on a period of its own; it is not the data path's to count.
    std::env::set_var("SMC_RS_REGISTRY", "0");
    small_buffers();
    setup();
    if std::env::var_os("SMC_IDLE_MANY_SERVER").is_some() {
        return server();
    }
    raise_nofile();
    let t0 = Instant::now();
    let base = held();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_IDLE_MANY_SERVER", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut child = Reaped(child);
    let port = line_with(&mut out, "port ")[5..].parse::<u16>().unwrap();
    let mut conns = Vec::with_capacity(CONNS);
    for i in 0..CONNS {
        let c = SmcStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        assert_eq!(c.mode(), Mode::SmcR, "connection {i}");
        conns.push(c);
    }
    line_with(&mut out, "accepted");
    let setup_took = t0.elapsed();
    let st = smc::state();
    let groups: usize = st.iter().map(|d| d.link_groups).sum();
    assert_eq!(
        st.iter().map(|d| d.connections).sum::<usize>(),
        CONNS,
        "{st:?}"
    );
    // 255 at most in each (RFC 7609 §4.4.3): more groups opened as needed
    assert!(groups >= CONNS.div_ceil(255), "{groups} link groups");

    let peak = held();
    // what the handshakes left to do is over
    std::thread::sleep(Duration::from_millis(500));
    let (dev0, others0) = totals();
    std::thread::sleep(IDLE);
    let (dev1, others1) = totals();
    let d = |a: [u64; 3], b: [u64; 3]| [b[0] - a[0], b[1] - a[1], b[2] - a[2]];
    let (dev, others) = (d(dev0, dev1), d(others0, others1));
    eprintln!(
        "{CONNS} connections in {groups} link groups, set up in {setup_took:?}; idle for \
         {IDLE:?}: the shm device thread {} voluntary and {} involuntary context switches, \
         {} CPU ticks; the other threads {} and {} context switches, {} CPU ticks",
        dev[0], dev[1], dev[2], others[0], others[1], others[2]
    );
    // The engine and its drivers (the progress thread, the application
    // threads): the test thread's own sleep and little else (TEST_LINK runs
    // every 30 s), and no CPU.
    assert!(
        others[0] + others[1] < 10,
        "{} wake-ups in {IDLE:?} of an idle process with {CONNS} SMC-R connections: {:?}",
        others[0] + others[1],
        threads()
    );
    assert!(
        others[2] <= 2,
        "{} clock ticks of CPU in {IDLE:?} of an idle process with {CONNS} SMC-R connections",
        others[2]
    );
    // The shm device's thread stands for the adapter: it wakes for its
    // heartbeats (every `peer_timeout`/4 while it has QPs; port state comes
    // from rtnetlink), and nothing of the engine wakes it more often (the
    // bound allows a 20 ms period).
    let ms = IDLE.as_millis() as u64;
    assert!(
        dev[0] <= ms / 20 + 20,
        "{} wake-ups of the shm device thread in {IDLE:?}",
        dev[0]
    );

    // still usable: a few connections, spread over the groups, move
    // checksummed data both ways
    let busy: Vec<usize> = (0..BUSY).map(|k| k * (CONNS / BUSY)).collect();
    std::thread::scope(|sc| {
        for (k, c) in conns.iter_mut().enumerate() {
            if !busy.contains(&k) {
                continue;
            }
            sc.spawn(move || {
                let mut r = c.try_clone().unwrap();
                let reader = std::thread::spawn(move || {
                    let mut sum = Fnv::new();
                    let mut got = 0u64;
                    let mut buf = vec![0u8; 16 << 10];
                    while got < BYTES {
                        let n = r.read(&mut buf).unwrap();
                        assert!(n > 0, "connection {k}: end of file after {got} bytes");
                        sum.feed(&buf[..n]);
                        got += n as u64;
                    }
                    sum.0
                });
                let mut sum = Fnv::new();
                let mut off = 0u64;
                while off < BYTES {
                    let chunk: Vec<u8> = (off..(off + 4096).min(BYTES))
                        .map(|o| pattern(k as u8, o))
                        .collect();
                    sum.feed(&chunk);
                    c.write_all(&chunk).unwrap();
                    off += chunk.len() as u64;
                }
                assert_eq!(
                    reader.join().unwrap(),
                    sum.0,
                    "connection {k}: echo differs"
                );
            });
        }
    });

    // all close cleanly: ours, then the server's
    drop(conns);
    drop(child.0.stdin.take());
    let line = line_with(&mut out, "closed, ");
    assert_eq!(line, "closed, 0 left", "the server's ends");
    let deadline = Instant::now() + SETTLE;
    while live_conns() > 0 {
        assert!(
            Instant::now() < deadline,
            "connections left {SETTLE:?} after both sides closed: {:?}",
            smc::state()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(child.0.wait().unwrap().success(), "server failed");
    // Its peer gone, every link group ends (its links fail), and the
    // process is back at its baseline but for the device it opened.
    let names = ["conns", "groups", "threads", "fds", "memfds", "rss_kib"];
    // (the device: its thread and the progress thread; its descriptors;
    // the engine's connection table, which keeps its slots for the next
    // connections, and allocator caches: 3 KiB a connection at most, of
    // the peak's resident memory for the buffers and the connections)
    let slack = [0, 0, 4, 32, 8, 3 * CONNS as u64];
    let deadline = Instant::now() + SETTLE;
    loop {
        let now = held();
        let over: Vec<String> = (0..6)
            .filter(|&i| now[i] > base[i] + slack[i])
            .map(|i| format!("{} {} (baseline {})", names[i], now[i], base[i]))
            .collect();
        if over.is_empty() {
            eprintln!(
                "back at the baseline: {now:?} (before: {base:?}, with the connections: \
                 {peak:?}); {:?} in all",
                t0.elapsed()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not back at the baseline {SETTLE:?} after the server ended: {}",
            over.join(", ")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
