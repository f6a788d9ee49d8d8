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
//! open and silent meanwhile, to see what the number of connections costs
//! each message: in this process both ends of each (the first 254 share
//! the measured connection's link group), or with `MSG_COST_IDLE_PEER=process`
//! their other ends in a second process (this program started again), so
//! that 10,000 fit under a hard descriptor limit of 20,000 (a link group
//! holds 255 connections: they take 40 groups besides the measured one's).
//! The messages are written and read in `measured_loop`, so that callgrind
//! can count them alone (`--toggle-collect=*measured_loop*`).

use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

/// The other ends of the idle connections, in a process of their own
/// (`MSG_COST_IDLE_PEER=process`): this program started again with
/// `MSG_COST_IDLE_SERVE=N`, which accepts N connections, says so, and holds
/// them until its stdin ends.
fn serve_idle(n: usize) -> std::io::Result<()> {
    raise_nofile(n);
    let l = SmcListener::bind("127.0.0.1:0")?;
    println!("port {}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    let held = (0..n)
        .map(|_| l.accept().map(|(s, _)| s))
        .collect::<std::io::Result<Vec<_>>>()?;
    println!("accepted {}", held.len());
    std::io::stdout().flush()?;
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    Ok(())
}

/// The soft descriptor limit as high as `conns` TCP sockets need (at most
/// the hard limit).
fn raise_nofile(conns: usize) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let want = (2 * conns + 200) as u64;
    if lim.current.is_none_or(|c| c >= want) {
        return;
    }
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(lim.maximum.map_or(want, |m| m.min(want))),
            maximum: lim.maximum,
        },
    );
}

/// The idle connections, whose other ends a second process holds: the
/// client ends, and that process (ended when its stdin is closed).
fn idle_elsewhere(idle: usize) -> std::io::Result<(Vec<SmcStream>, std::process::Child)> {
    use std::io::BufRead;
    raise_nofile(idle);
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env("MSG_COST_IDLE_SERVE", idle.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("idle peer said {line:?}")))?;
    let clients = (0..idle)
        .map(|_| SmcStream::connect(("127.0.0.1", port)))
        .collect::<std::io::Result<Vec<_>>>()?;
    line.clear();
    out.read_line(&mut line)?;
    if !line.starts_with("accepted") {
        return Err(std::io::Error::other(format!("idle peer said {line:?}")));
    }
    Ok((clients, child))
}

/// The messages: what callgrind counts (`--toggle-collect=*measured_loop*`).
#[inline(never)]
fn measured_loop(
    c: &mut SmcStream,
    s: &mut SmcStream,
    out: &[u8],
    inp: &mut [u8],
    count: u32,
) -> std::io::Result<()> {
    for _ in 0..count {
        c.write_all(out)?;
        s.read_exact(inp)?;
    }
    Ok(())
}

fn run(size: usize, count: u32, idle: usize) -> std::io::Result<f64> {
    let elsewhere =
        idle > 0 && std::env::var("MSG_COST_IDLE_PEER").is_ok_and(|v| v.trim() == "process");
    let (mut far, mut peer) = (Vec::new(), None);
    if elsewhere {
        let (c, p) = idle_elsewhere(idle)?;
        far = c;
        peer = Some(p);
    }
    let here = if elsewhere { 0 } else { idle };
    raise_nofile(2 * here + 2);
    let l = SmcListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let acceptor = std::thread::spawn(move || {
        (0..=here)
            .map(|_| l.accept().map(|(s, _)| s))
            .collect::<std::io::Result<Vec<_>>>()
    });
    let mut clients = (0..=here)
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
    measured_loop(&mut c, &mut s, &out, &mut inp, count)?;
    let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(count);
    drop((clients, servers, far));
    if let Some(mut p) = peer {
        drop(p.stdin.take());
        p.wait()?;
    }
    Ok(us)
}

fn main() -> ExitCode {
    smc::use_loopback_device("smc-bench-msg-cost");
    if let Some(n) = std::env::var("MSG_COST_IDLE_SERVE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return match serve_idle(n) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("msg_cost idle peer: {e}");
                ExitCode::FAILURE
            }
        };
    }
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
