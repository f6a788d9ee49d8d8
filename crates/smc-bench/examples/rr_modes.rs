//! Request/response (10 connections, 16 KiB each way) in two program shapes,
//! SMC-R and TCP side by side: a thread per connection on each side (blocking
//! streams, as `smc-bench` measures it), and one thread per side polling all
//! of its non-blocking streams (no thread ever sleeps or wakes). Comparing the
//! two separates what waking threads costs from what the copies cost — see
//! the README's Performance notes.
//!
//! ```text
//! cargo run --release -p smc-bench --example rr_modes [-- SECONDS [ROUNDS [SHAPE [TRANSPORT]]]]
//! ```
//!
//! SHAPE `threads` or `polling` and TRANSPORT `smc` or `tcp` run one of them
//! alone (to profile it).
//!
//! Run as root (SMC-R needs the rendezvous BPF program). The server half is
//! this program again, started as `rr_modes __server SHAPE TRANSPORT`.

use smc::{Mode, SmcListener, SmcStream};
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Connections (`RR_CONNS`, default 10) and bytes each way per transaction
/// (`RR_SIZE`, default 16 KiB): `RR_CONNS=1 RR_SIZE=64` is a 64 B ping-pong
/// whose system calls and context switches `perf stat` can count per message.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

fn conn_count() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| env_or("RR_CONNS", 10))
}

fn size() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| env_or("RR_SIZE", 16 * 1024))
}

trait Stream: Read + Write + Send {
    fn nonblocking(&self) -> io::Result<()>;
}
impl Stream for SmcStream {
    fn nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
}
impl Stream for TcpStream {
    fn nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
}

fn accept(smc: bool) -> io::Result<Vec<Box<dyn Stream>>> {
    let mut out: Vec<Box<dyn Stream>> = Vec::new();
    if smc {
        let l = SmcListener::bind("127.0.0.1:0")?;
        println!("port {}", l.local_addr()?.port());
        io::stdout().flush()?;
        for _ in 0..conn_count() {
            out.push(Box::new(l.accept()?.0));
        }
    } else {
        let l = TcpListener::bind("127.0.0.1:0")?;
        println!("port {}", l.local_addr()?.port());
        io::stdout().flush()?;
        for _ in 0..conn_count() {
            let (s, _) = l.accept()?;
            s.set_nodelay(true)?;
            out.push(Box::new(s));
        }
    }
    Ok(out)
}

fn connect(smc: bool, port: u16) -> io::Result<Box<dyn Stream>> {
    if smc {
        let s = SmcStream::connect(("127.0.0.1", port))?;
        if s.mode() != Mode::SmcR {
            return Err(io::Error::other(format!("not SMC-R: {:?}", s.mode())));
        }
        Ok(Box::new(s))
    } else {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_nodelay(true)?;
        Ok(Box::new(s))
    }
}

/// One connection's place in its current message: bytes done, and whether it
/// is sending (else receiving).
struct Step {
    buf: Vec<u8>,
    at: usize,
    sending: bool,
}

impl Step {
    fn new(sending: bool) -> Step {
        Step {
            buf: vec![0x5a; size()],
            at: 0,
            sending,
        }
    }

    /// Moves `s` along without blocking: whether a byte moved, and whether
    /// a message was completed in the direction it was going.
    fn advance(&mut self, s: &mut dyn Stream) -> io::Result<(bool, bool)> {
        let r = if self.sending {
            s.write(&self.buf[self.at..])
        } else {
            s.read(&mut self.buf[self.at..])
        };
        match r {
            Ok(0) if !self.sending => Err(io::Error::new(ErrorKind::UnexpectedEof, "peer closed")),
            Ok(0) => Ok((false, false)),
            Ok(n) => {
                self.at += n;
                if self.at < size() {
                    return Ok((true, false));
                }
                self.at = 0;
                self.sending = !self.sending;
                Ok((true, true))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok((false, false)),
            Err(e) => Err(e),
        }
    }
}

fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted
    )
}

fn server(polling: bool, smc: bool) -> io::Result<()> {
    let mut conns = accept(smc)?;
    if polling {
        for c in &conns {
            c.nonblocking()?;
        }
        let mut steps: Vec<Step> = (0..conn_count()).map(|_| Step::new(false)).collect();
        loop {
            let mut moved = false;
            for (c, st) in conns.iter_mut().zip(&mut steps) {
                match st.advance(c.as_mut()) {
                    Ok((m, _)) => moved |= m,
                    // the client is done (it may close mid-message)
                    Err(e) if gone(&e) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            if !moved {
                // (as smc-bench's polling shape: on one core, the peer's turn)
                std::thread::yield_now();
            }
        }
    }
    let hs: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let mut b = vec![0u8; size()];
                while c.read_exact(&mut b).is_ok() && c.write_all(&b).is_ok() {}
            })
        })
        .collect();
    for h in hs {
        let _ = h.join();
    }
    Ok(())
}

/// Transactions per second over `dur` in one shape and transport.
fn run(polling: bool, smc: bool, dur: Duration) -> io::Result<f64> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "__server",
            if polling { "polling" } else { "threads" },
            if smc { "smc" } else { "tcp" },
        ])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or(ErrorKind::BrokenPipe)?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| io::Error::other(format!("server said {line:?}")))?;
    let mut conns = (0..conn_count())
        .map(|_| connect(smc, port))
        .collect::<io::Result<Vec<_>>>()?;
    let tps = if polling {
        for c in &conns {
            c.nonblocking()?;
        }
        let mut steps: Vec<Step> = (0..conn_count()).map(|_| Step::new(true)).collect();
        let t0 = Instant::now();
        let mut n = 0u64;
        while t0.elapsed() < dur {
            let mut moved = false;
            for (c, st) in conns.iter_mut().zip(&mut steps) {
                // a response received completes a transaction
                let (m, done) = st.advance(c.as_mut())?;
                moved |= m;
                if done && st.sending {
                    n += 1;
                }
            }
            if !moved {
                std::thread::yield_now();
            }
        }
        n as f64 / t0.elapsed().as_secs_f64()
    } else {
        let hs: Vec<_> = conns
            .drain(..)
            .map(|mut c| {
                std::thread::spawn(move || -> io::Result<f64> {
                    let req = vec![0x5au8; size()];
                    let mut resp = vec![0u8; size()];
                    let t0 = Instant::now();
                    let mut n = 0u64;
                    while t0.elapsed() < dur {
                        c.write_all(&req)?;
                        c.read_exact(&mut resp)?;
                        n += 1;
                    }
                    Ok(n as f64 / t0.elapsed().as_secs_f64())
                })
            })
            .collect();
        let mut sum = 0.0;
        for h in hs {
            sum += h
                .join()
                .map_err(|_| io::Error::other("client thread panicked"))??;
        }
        sum
    };
    drop(conns);
    let _ = child.wait();
    Ok(tps)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    smc::use_loopback_device("smc-bench-rr-modes");
    if args.get(1).map(String::as_str) == Some("__server") {
        let polling = args.get(2).map(String::as_str) == Some("polling");
        let smc = args.get(3).map(String::as_str) == Some("smc");
        return match server(polling, smc) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rr_modes server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let secs: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let dur = Duration::from_secs_f64(secs);
    let shape = args.get(3).map(String::as_str);
    let transport = args.get(4).map(String::as_str);
    println!(
        "request/response, {} connections, {} B each way, {secs} s per run, rounds interleaved",
        conn_count(),
        size()
    );
    for polling in [false, true] {
        if shape.is_some_and(|s| s != if polling { "polling" } else { "threads" }) {
            continue;
        }
        let mut ratios = vec![];
        for round in 0..rounds {
            let mut r = [0.0f64; 2];
            for (k, smc) in [true, false].into_iter().enumerate() {
                if transport.is_some_and(|t| t != if smc { "smc" } else { "tcp" }) {
                    r[k] = f64::NAN;
                    continue;
                }
                match run(polling, smc, dur) {
                    Ok(v) => r[k] = v,
                    Err(e) => {
                        eprintln!("rr_modes: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            println!(
                "{:<38} round {}: SMC-R {:>8.0} tps  TCP {:>8.0} tps  SMC/TCP {:.2}x",
                if polling {
                    "one thread per side, polling"
                } else {
                    "a thread per connection, blocking"
                },
                round + 1,
                r[0],
                r[1],
                r[0] / r[1]
            );
            ratios.push(r[0] / r[1]);
        }
        ratios.sort_by(f64::total_cmp);
        println!("  median SMC/TCP {:.2}x", ratios[ratios.len() / 2]);
    }
    ExitCode::SUCCESS
}
