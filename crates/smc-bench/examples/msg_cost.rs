//! The software cost of one message through SMC-R, without waiting or any
//! cross-core traffic: one thread writes N messages into one end of a
//! connection (over the shm device, both ends in this process) and reads
//! each from the other end at once. What a ping-pong round trip costs beyond
//! twice this is the handoff between the cores and the waiting.
//!
//! ```text
//! cargo run --release -p smc-bench --example msg_cost [-- SIZE [COUNT [IDLE]]]
//! ```
//!
//! Run as root (SMC-R needs the rendezvous BPF program); SIZE defaults to
//! 64 bytes, COUNT to 200 000. IDLE further connections (default 0) stay
//! open and silent in the same link group meanwhile, to see what the
//! number of connections costs each message.

use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

fn run(size: usize, count: u32, idle: usize) -> std::io::Result<f64> {
    let l = SmcListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let acceptor = std::thread::spawn(move || {
        (0..=idle)
            .map(|_| l.accept().map(|(s, _)| s))
            .collect::<std::io::Result<Vec<_>>>()
    });
    let mut clients = (0..=idle)
        .map(|_| SmcStream::connect(addr))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut servers = acceptor
        .join()
        .map_err(|_| std::io::Error::other("accept thread panicked"))??;
    let (mut c, mut s) = (clients.remove(0), servers.remove(0));
    if c.mode() != Mode::SmcR || s.mode() != Mode::SmcR {
        return Err(std::io::Error::other(format!(
            "not SMC-R: client {:?}, server {:?}",
            c.mode(),
            s.mode()
        )));
    }
    let out = vec![0x5au8; size];
    let mut inp = vec![0u8; size];
    let t0 = Instant::now();
    for _ in 0..count {
        c.write_all(&out)?;
        s.read_exact(&mut inp)?;
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(count);
    drop((clients, servers));
    Ok(us)
}

fn main() -> ExitCode {
    smc::use_loopback_device("smc-bench-msg-cost");
    let mut args = std::env::args().skip(1);
    let size: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let count: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let idle: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    match run(size, count.max(1), idle) {
        Ok(us) => {
            println!(
                "{size} B written and read by one thread: {us:.3} us per message \
                 ({count} messages, {idle} idle connections besides)"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("msg_cost: {e}");
            ExitCode::FAILURE
        }
    }
}
