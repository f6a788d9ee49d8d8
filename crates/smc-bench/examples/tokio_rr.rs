//! Request/response through the tokio adapter (`smc::tokio`), SMC-R and
//! TCP (`tokio::net`) side by side, rounds interleaved: a client process
//! with a task per connection on one runtime thread, against a server
//! process (this program started again) with a task per connection on one
//! runtime thread too, each task writing a request and reading the answer
//! as fast as it comes. `RR_CONNS` connections (default 10) of `RR_SIZE`
//! bytes each way (default 16 KiB); `RR_CONNS=1 RR_SIZE=64` is a 64 B
//! ping-pong, whose round trip is printed too. With `RR_SETUP=1` every
//! transaction is a connection of its own (connect, one request and answer,
//! close): connection setup, as `smc-bench`'s setup row measures it.
//!
//! ```text
//! cargo build --release -p smc-bench --example tokio_rr
//! taskset -c 0 target/release/examples/tokio_rr [SECONDS [ROUNDS [TRANSPORT]]]
//! ```
//!
//! TRANSPORT `smc` or `tcp` runs one alone (to profile it). Pin the process
//! to one CPU (`taskset -c 0`) or let each side have its own: the server is
//! started with the client's CPU set, so `TOKIO_RR_SERVER_CPU=1` puts it on
//! CPU 1 instead. Run as root (SMC-R needs the rendezvous BPF program).

use smc::tokio::{SmcListener, SmcStream};
use smc::Mode;
use std::io::{self, BufRead, BufReader, ErrorKind};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

fn conns() -> usize {
    env_or("RR_CONNS", 10)
}

fn size() -> usize {
    env_or("RR_SIZE", 16 * 1024)
}

/// Whether every transaction is a connection of its own (`RR_SETUP=1`).
fn setup() -> bool {
    std::env::var("RR_SETUP").is_ok_and(|v| v == "1")
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Answers every request of one connection until the client closes it.
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) {
    let mut b = vec![0u8; size()];
    while s.read_exact(&mut b).await.is_ok() && s.write_all(&b).await.is_ok() {}
}

async fn serve(smc: bool) -> io::Result<()> {
    let mut tasks = Vec::new();
    // (connections per transaction: served until the client stops; the
    // client's end of the run ends this process)
    let n = if setup() { usize::MAX } else { conns() };
    if smc {
        let l = SmcListener::bind("127.0.0.1:0").await?;
        println!("port {}", l.local_addr()?.port());
        for _ in 0..n {
            let (s, _) = l.accept().await?;
            tasks.push(tokio::spawn(echo(s)));
        }
    } else {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("port {}", l.local_addr()?.port());
        for _ in 0..n {
            let (s, _) = l.accept().await?;
            s.set_nodelay(true)?;
            tasks.push(tokio::spawn(echo(s)));
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

/// Transactions of one connection within `dur`.
async fn client<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, dur: Duration) -> io::Result<u64> {
    let req = vec![0x5au8; size()];
    let mut resp = vec![0u8; size()];
    let t0 = Instant::now();
    let mut n = 0;
    // (at least one: a connection per transaction calls this with no time)
    loop {
        s.write_all(&req).await?;
        s.read_exact(&mut resp).await?;
        n += 1;
        if t0.elapsed() >= dur {
            return Ok(n);
        }
    }
}

/// Connections of one transaction each within `dur`.
async fn connecting(smc: bool, port: u16, dur: Duration) -> io::Result<u64> {
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < dur {
        if smc {
            let s = SmcStream::connect(("127.0.0.1", port)).await?;
            if s.mode() != Mode::SmcR {
                return Err(io::Error::other(format!("not SMC-R: {:?}", s.mode())));
            }
            client(s, Duration::ZERO).await?;
        } else {
            let s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            s.set_nodelay(true)?;
            client(s, Duration::ZERO).await?;
        }
        n += 1;
    }
    Ok(n)
}

/// Transactions per second over `dur`, against a server process.
fn run(smc: bool, dur: Duration) -> io::Result<f64> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["__server", if smc { "smc" } else { "tcp" }])
        .stdout(Stdio::piped());
    let mut child = cmd.spawn()?;
    if let Ok(cpu) = std::env::var("TOKIO_RR_SERVER_CPU") {
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", &cpu, &child.id().to_string()])
            .stdout(Stdio::null())
            .status();
    }
    let mut out = BufReader::new(child.stdout.take().ok_or(ErrorKind::BrokenPipe)?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| io::Error::other(format!("server said {line:?}")))?;
    let tps = runtime()?.block_on(async {
        let mut tasks = Vec::new();
        if setup() {
            let t0 = Instant::now();
            let mut loops = Vec::new();
            for _ in 0..conns() {
                loops.push(tokio::spawn(connecting(smc, port, dur)));
            }
            let mut n = 0;
            for t in loops {
                n += t.await.map_err(io::Error::other)??;
            }
            return Ok(n as f64 / t0.elapsed().as_secs_f64());
        }
        for _ in 0..conns() {
            if smc {
                let s = SmcStream::connect(("127.0.0.1", port)).await?;
                if s.mode() != Mode::SmcR {
                    return Err(io::Error::other(format!("not SMC-R: {:?}", s.mode())));
                }
                tasks.push(tokio::spawn(client(s, dur)));
            } else {
                let s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                s.set_nodelay(true)?;
                tasks.push(tokio::spawn(client(s, dur)));
            }
        }
        let t0 = Instant::now();
        let mut n = 0;
        for t in tasks {
            n += t.await.map_err(io::Error::other)??;
        }
        Ok(n as f64 / t0.elapsed().as_secs_f64())
    })?;
    // (a server that serves connections until told otherwise)
    if setup() {
        let _ = child.kill();
    }
    let _ = child.wait();
    Ok(tps)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    smc::use_loopback_device("smc-bench-tokio-rr");
    if args.get(1).map(String::as_str) == Some("__server") {
        let smc = args.get(2).map(String::as_str) == Some("smc");
        return match runtime().and_then(|rt| rt.block_on(serve(smc))) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tokio_rr server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let secs: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let transport = args.get(3).map(String::as_str);
    let dur = Duration::from_secs_f64(secs);
    println!(
        "tokio request/response, {} connections (a task each, one runtime thread per side), {} B each way, {secs} s per run",
        conns(),
        size()
    );
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let mut r = [f64::NAN; 2];
        for (k, smc) in [true, false].into_iter().enumerate() {
            if transport.is_some_and(|t| t != if smc { "smc" } else { "tcp" }) {
                continue;
            }
            match run(smc, dur) {
                Ok(v) => r[k] = v,
                Err(e) => {
                    eprintln!("tokio_rr: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        // (one connection: the round trip is the inverse of its rate)
        let rtt = |tps: f64| 1e6 / tps;
        if conns() == 1 {
            println!(
                "round {round}: SMC-R {:>8.0} tps ({:.2} us each)  TCP {:>8.0} tps ({:.2} us)  SMC/TCP {:.2}x",
                r[0],
                rtt(r[0]),
                r[1],
                rtt(r[1]),
                r[0] / r[1]
            );
        } else {
            println!(
                "round {round}: SMC-R {:>8.0} tps  TCP {:>8.0} tps  SMC/TCP {:.2}x",
                r[0],
                r[1],
                r[0] / r[1]
            );
        }
        ratios.push(r[0] / r[1]);
    }
    ratios.sort_by(f64::total_cmp);
    println!("  median SMC/TCP {:.2}x", ratios[ratios.len() / 2]);
    ExitCode::SUCCESS
}
