//! `smc-demo` — SMC-R next to TCP, between two processes on this host.
//!
//! ```text
//! smc-demo                 start a server process, connect to it over SMC-R and
//!                          over plain TCP, print mode, latency and throughput
//! smc-demo serve           the server half (prints its two ports, then serves)
//! ```
//!
//! Needs root for the SYN-option rendezvous (BPF), or the rendezvous installed
//! for this user (`smc-rendezvous install`); without it both connections run
//! over TCP and the demo says why. Devices: if `SMC_RDMA_SHM_CONFIG` is not
//! set, the demo declares a shared-memory device bound to `lo` in a temporary
//! directory.
#![forbid(unsafe_code)]

use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const PING: usize = 64;
const CHUNK: usize = 256 * 1024;

/// Ping-pong rounds (`SMC_DEMO_ROUNDS`, default 20000).
fn rounds() -> usize {
    std::env::var("SMC_DEMO_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000)
}

/// Bulk bytes (`SMC_DEMO_BULK_MIB`, default 512 MiB), a whole number of chunks.
fn bulk() -> usize {
    let mib: usize = std::env::var("SMC_DEMO_BULK_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    (mib << 20).max(CHUNK) / CHUNK * CHUNK
}

/// Server: echo ping-pongs, then swallow a bulk stream and answer its size.
fn serve_conn(mut s: impl Read + Write) -> std::io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut ping = [0u8; PING];
    for _ in 0..rounds() {
        s.read_exact(&mut ping)?;
        s.write_all(&ping)?;
    }
    let mut total = 0u64;
    while total < bulk() as u64 {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    s.write_all(&total.to_le_bytes())?;
    Ok(())
}

fn serve() -> ExitCode {
    let smc = match SmcListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smc-demo serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tcp = match TcpListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smc-demo serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{} {}",
        smc.local_addr().map(|a| a.port()).unwrap_or(0),
        tcp.local_addr().map(|a| a.port()).unwrap_or(0)
    );
    let _ = std::io::stdout().flush();
    let t = std::thread::spawn(move || {
        if let Ok((s, _)) = tcp.accept() {
            let _ = s.set_nodelay(true);
            let _ = serve_conn(s);
        }
    });
    match smc.accept() {
        Ok((s, _)) => {
            eprintln!("smc-demo serve: accepted, mode {:?}", s.mode());
            let _ = serve_conn(s);
        }
        Err(e) => eprintln!("smc-demo serve: accept: {e}"),
    }
    let _ = t.join();
    ExitCode::SUCCESS
}

struct Figures {
    median_rtt: Duration,
    p99_rtt: Duration,
    gbps: f64,
}

fn measure(mut s: impl Read + Write) -> std::io::Result<Figures> {
    let mut ping = [7u8; PING];
    let mut rtts = Vec::with_capacity(rounds());
    for _ in 0..rounds() {
        let t = Instant::now();
        s.write_all(&ping)?;
        s.read_exact(&mut ping)?;
        rtts.push(t.elapsed());
    }
    rtts.sort();
    let buf = vec![0x5au8; CHUNK];
    let t = Instant::now();
    let mut sent = 0;
    while sent < bulk() {
        s.write_all(&buf)?;
        sent += CHUNK;
    }
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack)?;
    let secs = t.elapsed().as_secs_f64();
    if u64::from_le_bytes(ack) != bulk() as u64 {
        return Err(std::io::Error::other(
            "server received a different byte count",
        ));
    }
    Ok(Figures {
        median_rtt: rtts[rtts.len() / 2],
        p99_rtt: rtts[rtts.len() * 99 / 100],
        gbps: bulk() as f64 / secs / 1e9,
    })
}

fn main() -> ExitCode {
    smc::use_loopback_device("smc-demo");
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return serve();
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("smc-demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut child = match Command::new(exe)
        .arg("serve")
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("smc-demo: cannot start the server process: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let ports: Vec<u16> = line
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    let [smc_port, tcp_port] = ports[..] else {
        eprintln!("smc-demo: the server process did not start");
        let _ = child.kill();
        return ExitCode::FAILURE;
    };
    println!(
        "server process {} listening: SMC on 127.0.0.1:{smc_port}, TCP on 127.0.0.1:{tcp_port}",
        child.id()
    );

    let smc = match SmcStream::connect(("127.0.0.1", smc_port)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("smc-demo: SMC connect: {e}");
            let _ = child.kill();
            return ExitCode::FAILURE;
        }
    };
    let mode = match smc.mode() {
        Mode::SmcR => "SMC-R (shared-memory device)".to_string(),
        Mode::Tcp(f) => format!("TCP ({f})"),
    };
    let smc_fig = measure(smc);
    let tcp_fig = TcpStream::connect(("127.0.0.1", tcp_port)).and_then(|s| {
        s.set_nodelay(true)?;
        measure(s)
    });
    let _ = child.wait();
    let (smc_fig, tcp_fig) = match (smc_fig, tcp_fig) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            eprintln!(
                "smc-demo: measurement failed: smc {:?} tcp {:?}",
                a.err(),
                b.err()
            );
            return ExitCode::FAILURE;
        }
    };
    println!();
    println!("connection 1: SmcStream   mode {mode}");
    println!("connection 2: TcpStream   mode TCP (plain std socket)");
    println!();
    println!(
        "{:<34} {:>14} {:>14} {:>10}",
        "", "SmcStream", "TcpStream", "ratio"
    );
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{:<34} {:>11.1} us {:>11.1} us {:>9.2}x",
        format!("{PING} B ping-pong RTT, median"),
        us(smc_fig.median_rtt),
        us(tcp_fig.median_rtt),
        us(smc_fig.median_rtt) / us(tcp_fig.median_rtt)
    );
    println!(
        "{:<34} {:>11.1} us {:>11.1} us {:>9.2}x",
        format!("{PING} B ping-pong RTT, p99"),
        us(smc_fig.p99_rtt),
        us(tcp_fig.p99_rtt),
        us(smc_fig.p99_rtt) / us(tcp_fig.p99_rtt)
    );
    println!(
        "{:<34} {:>9.2} GB/s {:>9.2} GB/s {:>9.2}x",
        format!("{} MiB one-way stream", bulk() >> 20),
        smc_fig.gbps,
        tcp_fig.gbps,
        smc_fig.gbps / tcp_fig.gbps
    );
    println!("\n(ratios: SMC / TCP; lower is better for RTT, higher for throughput)");
    ExitCode::SUCCESS
}
