//! Issue 13, finding 7 (the socket library's part): processes started
//! together. Each of them declares the shared loopback device
//! (`smc::use_loopback_device`) and makes its first contact with one server
//! at the same moment. None may fall back: not for a configuration file
//! that another process was rewriting at the time it read it, and not for a
//! system ID that another live process has too (the server would take the
//! two for one peer and offer one of them the other's link group, which it
//! must decline with SYNCERR, 0x04000000).
//!
//! The parent is the server; the clients are this test binary started again
//! with `SMC_F7_CLIENT` set, without `SMC_RDMA_SHM_CONFIG`, so that each
//! declares the device itself.

use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TEST: &str = "finding7_processes_started_together_all_get_smc_r";

/// Clients per round, and rounds (each round starts fresh processes).
const CLIENTS: usize = 40;
const ROUNDS: usize = 3;

fn client() {
    let tag = std::env::var("SMC_F7_TAG").unwrap();
    let port: u16 = std::env::var("SMC_F7_PORT").unwrap().parse().unwrap();
    let go = PathBuf::from(std::env::var_os("SMC_F7_GO").unwrap());
    println!("ready");
    std::io::stdout().flush().unwrap();
    // all clients leave this loop within a millisecond of each other
    let end = Instant::now() + Duration::from_secs(60);
    while !go.exists() {
        assert!(Instant::now() < end, "no go signal");
        std::thread::sleep(Duration::from_micros(200));
    }
    smc::use_loopback_device(&tag);
    let mut s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"x").unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).unwrap();
    let code = match s.mode() {
        Mode::SmcR => 0,
        Mode::Tcp(f) => f.code(),
    };
    println!("mode {code:#010x} {:?}", s.mode());
    std::io::stdout().flush().unwrap();
    // stay until the server saw every client, so that no group ends early
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
}

fn spawn(
    exe: &Path,
    tag: &str,
    port: u16,
    go: &Path,
) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut c = Command::new(exe)
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_F7_CLIENT", "1")
        .env("SMC_F7_TAG", tag)
        .env("SMC_F7_PORT", port.to_string())
        .env("SMC_F7_GO", go)
        .env_remove("SMC_RDMA_SHM_CONFIG")
        .env_remove("SMC_RS_CONFIG_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(c.stdout.take().unwrap());
    (c, out)
}

fn line_with(out: &mut BufReader<std::process::ChildStdout>, marker: &str) -> String {
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "client exited early");
        if let Some(i) = line.find(marker) {
            return line[i..].trim().to_string();
        }
    }
}

#[test]
fn finding7_processes_started_together_all_get_smc_r() {
    if std::env::var_os("SMC_F7_CLIENT").is_some() {
        return client();
    }
    assert_eq!(rustix::process::geteuid().as_raw(), 0, "needs root (BPF)");
    let tag = format!("smc-f7-test-{}", std::process::id());
    let dir = std::env::temp_dir().join(&tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::env::remove_var("SMC_RDMA_SHM_CONFIG");
    std::env::remove_var("SMC_RS_CONFIG_DIR");
    // the server declares the device first; every client declares it again
    smc::use_loopback_device(&tag);
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let total = CLIENTS * ROUNDS;
    // the server is up before the clients start (it has read the configuration)
    let warm = std::thread::spawn(move || SmcStream::connect(("127.0.0.1", port)).unwrap());
    let (s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), Mode::SmcR, "the server's own first connection");
    drop((s, warm.join().unwrap()));
    let server = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..total {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            held.push(s.mode());
        }
        held
    });
    let exe = std::env::current_exe().unwrap();
    let mut bad = Vec::new();
    for round in 0..ROUNDS {
        let go = dir.join(format!("go-{round}"));
        let mut kids: Vec<_> = (0..CLIENTS).map(|_| spawn(&exe, &tag, port, &go)).collect();
        for (_, out) in &mut kids {
            line_with(out, "ready");
        }
        std::fs::write(&go, b"").unwrap();
        for (i, (_, out)) in kids.iter_mut().enumerate() {
            let l = line_with(out, "mode ");
            if !l.starts_with("mode 0x00000000") {
                bad.push(format!("round {round} client {i}: {l}"));
            }
        }
        for (mut c, _) in kids {
            drop(c.stdin.take());
            assert!(c.wait().unwrap().success());
        }
    }
    let modes = server.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let server_bad: Vec<_> = modes.iter().filter(|m| **m != Mode::SmcR).collect();
    assert!(
        bad.is_empty() && server_bad.is_empty(),
        "clients that fell back: {bad:#?}\nserver side: {server_bad:?}"
    );
}
