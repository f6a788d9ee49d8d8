//! What one context switch between two processes on one CPU costs on this
//! host: this program and a copy of itself, both pinned to CPU, each call
//! `sched_yield` COUNT times, so that every call hands the CPU to the other
//! process. A ping-pong round trip between two processes that share a CPU
//! needs at least two such switches (whatever the transport: the answer is
//! computed by the other process), so twice this is the floor of any
//! one-core round trip, TCP's and SMC-R's (`smc-bench`'s `same` placement,
//! sockperf under `smc_run` in `crates/smc-preload/bench.sh`).
//!
//! ```text
//! cargo run --release -p smc-bench --example switch_cost [-- [COUNT [CPU]]]
//! ```
//!
//! COUNT defaults to 1,000,000, CPU to 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

fn pin(cpu: usize) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

fn yields(n: u64) {
    for _ in 0..n {
        std::thread::yield_now();
    }
}

/// The other process: pinned, says so, waits for the start, yields.
fn other(n: u64, cpu: usize) -> std::io::Result<()> {
    pin(cpu)?;
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go)?;
    yields(n);
    Ok(())
}

fn run(n: u64, cpu: usize) -> std::io::Result<f64> {
    pin(cpu)?;
    let me = std::env::current_exe()?;
    let mut child = Command::new(me)
        .args(["__other", &n.to_string(), &cpu.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        BufReader::new(out).read_line(&mut line)?;
    }
    if line.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        return Err(std::io::Error::other("the other process did not start"));
    }
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no pipe to the other process"))?;
    let t0 = Instant::now();
    stdin.write_all(&[1])?;
    yields(n);
    let st = child.wait()?;
    let t = t0.elapsed();
    if !st.success() {
        return Err(std::io::Error::other(format!(
            "the other process failed: {st}"
        )));
    }
    Ok(t.as_secs_f64() / (2 * n) as f64 * 1e9)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, default: u64| -> Result<u64, String> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse()
                .map_err(|_| format!("switch_cost: not a number: {s}"))
        })
    };
    if args.first().map(String::as_str) == Some("__other") {
        return match (num(1, 0), num(2, 0)) {
            (Ok(n), Ok(cpu)) => match other(n, cpu as usize) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("switch_cost (other process): {e}");
                    ExitCode::FAILURE
                }
            },
            _ => ExitCode::from(2),
        };
    }
    let (n, cpu) = match (num(0, 1_000_000), num(1, 0)) {
        (Ok(n), Ok(cpu)) if n > 0 && args.len() <= 2 => (n, cpu as usize),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
        _ => {
            eprintln!("usage: switch_cost [COUNT [CPU]] (COUNT > 0)");
            return ExitCode::from(2);
        }
    };
    match run(n, cpu) {
        Ok(ns) => {
            println!(
                "context switch between two processes on CPU {cpu} (sched_yield): {ns:.0} ns; \
                 a one-core round trip needs two: {:.2} us",
                2.0 * ns / 1000.0
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("switch_cost: {e}");
            ExitCode::FAILURE
        }
    }
}
