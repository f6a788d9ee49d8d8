//! What one short SMC-R connection costs both processes: a client connects,
//! sends a 64 B request, reads the 64 B answer and closes, N times, against
//! a server process (this program started again) that accepts, answers and
//! closes. Prints connections per second and how many were SMC-R; the
//! system calls and context switches per connection come from the tools
//! that count them for both processes, e.g. on one CPU:
//!
//! ```text
//! cargo build --release -p smc-bench --example setup_cost
//! perf stat -e context-switches -- taskset -c 0 target/release/examples/setup_cost 5000
//! strace -f -c -- taskset -c 0 target/release/examples/setup_cost 2000
//! ```
//!
//! and per thread (which thread of which process switches how often), the
//! kernel's own counts over one second of a longer run:
//!
//! ```text
//! taskset -c 0 target/release/examples/setup_cost 50000 &
//! snap() { for p in $(pgrep -f examples/setup_cost); do for t in /proc/$p/task/*; do
//!   echo "$t $(cat $t/comm) $(awk '/ctxt_switches/ {s += $2} END {print s}' $t/status)"
//! done; done; }
//! sleep 1; snap > a; sleep 1; snap > b; join a b | awk '{print $1, $2, $5 - $3}'
//! ```
//!
//! (divide by N plus the 50 warm-up connections). Run as root (SMC-R needs
//! the rendezvous BPF program); the device is a shared-memory one on `lo`
//! (`smc::use_loopback_device`) unless `SMC_RDMA_SHM_CONFIG` names another.
//! `smc-bench --only setup` measures the same workload side by side with TCP.

mod common;

use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

const WARM: usize = 50;

fn serve() -> ExitCode {
    let l = match SmcListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => {
            eprintln!("setup_cost: bind: {e}");
            return ExitCode::FAILURE;
        }
    };
    let port = l.local_addr().map_or(0, |a| a.port());
    println!("{port}");
    let _ = std::io::stdout().flush();
    // (until the client kills it)
    loop {
        let Ok((mut s, _)) = l.accept() else { continue };
        let mut b = [0u8; 64];
        if s.read_exact(&mut b).is_ok() {
            let _ = s.write_all(&b);
        }
    }
}

fn one(port: u16, smc: &mut usize) -> std::io::Result<()> {
    let mut s = SmcStream::connect(("127.0.0.1", port))?;
    if s.mode() == Mode::SmcR {
        *smc += 1;
    }
    let mut b = [7u8; 64];
    s.write_all(&b)?;
    s.read_exact(&mut b)
}

fn main() -> ExitCode {
    // (the server, started below, inherits the device)
    smc::use_loopback_device("smc-bench-setup-cost");
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        return serve();
    }
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (mut child, port) = match common::start_server("setup_cost") {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut smc = 0;
    let run = |count: usize, smc: &mut usize| -> std::io::Result<()> {
        for _ in 0..count {
            one(port, smc)?;
        }
        Ok(())
    };
    let mut warm = 0;
    let t0 = Instant::now();
    let r = run(WARM, &mut warm).and_then(|()| {
        let t = Instant::now();
        run(n, &mut smc).map(|()| t)
    });
    let _ = child.kill();
    let _ = child.wait();
    match r {
        Ok(t) => {
            let s = t.elapsed().as_secs_f64();
            println!(
                "{n} connections ({smc} SMC-R) {:.0} conn/s, {:.1} us each ({:.1} s in all)",
                n as f64 / s,
                s * 1e6 / n as f64,
                t0.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("setup_cost: {e}");
            ExitCode::FAILURE
        }
    }
}
