//! The client side of each workload, for one transport. Every connection's
//! mode goes into a [`Tally`]; the caller decides what a fallback means.

use crate::conn::{Conn, Transport};
use crate::peer::ServerProc;
use crate::poll::Step;
use crate::sys::{self, CpuTime};
use crate::wire::{Header, Job, CLC_ACCEPT, CLC_CONFIRM, CLC_PROPOSAL, HEADER_LEN, MAX_GROUP};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Connection modes seen: label -> count.
pub type Tally = BTreeMap<String, u64>;

/// No single read or write of a measurement may block longer than this: a
/// stalled data path becomes an error, not a hung benchmark.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

fn open(t: Transport, port: u16, job: Job, tally: &mut Tally) -> io::Result<Conn> {
    let mut c = Conn::connect(t, port)?;
    *tally.entry(c.label()).or_default() += 1;
    c.set_read_timeout(Some(IO_TIMEOUT))?;
    c.set_write_timeout(Some(IO_TIMEOUT))?;
    c.write_all(&Header(job).encode())?;
    Ok(c)
}

/// The sample at quantile `q` (0..=1) of sorted samples (nearest rank).
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Ping-pong round-trip times.
#[derive(Clone, Copy, Debug)]
pub struct PingPong {
    /// Median RTT, microseconds.
    pub median_us: f64,
    /// 99th percentile RTT, microseconds.
    pub p99_us: f64,
}

/// `iters` round trips of `size`-byte messages on one connection (after
/// `warmup` unrecorded ones); one RTT sample per message.
pub fn pingpong(
    t: Transport,
    port: u16,
    size: usize,
    iters: usize,
    warmup: usize,
    tally: &mut Tally,
) -> io::Result<PingPong> {
    let mut c = open(
        t,
        port,
        Job::Echo {
            req: size as u64,
            resp: size as u64,
        },
        tally,
    )?;
    let out = vec![0xa5u8; size];
    let mut back = vec![0u8; size];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        c.write_all(&out)?;
        c.read_exact(&mut back)?;
        if i >= warmup {
            samples.push(t0.elapsed());
        }
    }
    samples.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Ok(PingPong {
        median_us: us(quantile(&samples, 0.5)),
        p99_us: us(quantile(&samples, 0.99)),
    })
}

/// Request/response over `conns` connections, one client thread each, for
/// `dur`: transactions per second (sum of the threads' rates).
pub fn request_response(
    t: Transport,
    port: u16,
    conns: usize,
    size: usize,
    dur: Duration,
    tally: &mut Tally,
) -> io::Result<f64> {
    let barrier = Barrier::new(conns);
    let results: Vec<(io::Result<f64>, Tally)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..conns)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut tally = Tally::new();
                    let conn = open(
                        t,
                        port,
                        Job::Echo {
                            req: size as u64,
                            resp: size as u64,
                        },
                        &mut tally,
                    );
                    // Every thread reaches the barrier, connected or not.
                    barrier.wait();
                    let r = conn.and_then(|mut c| {
                        let req = vec![0xa5u8; size];
                        let mut resp = vec![0u8; size];
                        // one unrecorded transaction: the connection is warm
                        c.write_all(&req)?;
                        c.read_exact(&mut resp)?;
                        let t0 = Instant::now();
                        let mut n = 0u64;
                        while t0.elapsed() < dur {
                            c.write_all(&req)?;
                            c.read_exact(&mut resp)?;
                            n += 1;
                        }
                        Ok(n as f64 / t0.elapsed().as_secs_f64())
                    });
                    (r, tally)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    (
                        Err(io::Error::other("client thread panicked")),
                        Tally::new(),
                    )
                })
            })
            .collect()
    });
    let mut tps = 0.0;
    for (r, tl) in results {
        for (k, v) in tl {
            *tally.entry(k).or_default() += v;
        }
        tps += r?;
    }
    Ok(tps)
}

/// Request/response over `conns` connections in the polling shape: this
/// thread alone drives them all, non-blocking (see `poll.rs`), against one
/// polling server thread. Timing starts once every connection has completed
/// one transaction. Transactions per second over `dur`.
pub fn request_response_polling(
    t: Transport,
    port: u16,
    conns: usize,
    size: usize,
    dur: Duration,
    tally: &mut Tally,
) -> io::Result<f64> {
    static GROUP: AtomicU32 = AtomicU32::new(1);
    let job = Job::PollEcho {
        size: size as u64,
        group: GROUP.fetch_add(1, Ordering::Relaxed),
        count: u32::try_from(conns)
            .ok()
            .filter(|&c| (1..=MAX_GROUP).contains(&c))
            .ok_or_else(|| io::Error::other("polling group of 1..=1024 connections"))?,
    };
    let mut cs = (0..conns)
        .map(|_| open(t, port, job, tally))
        .collect::<io::Result<Vec<_>>>()?;
    for c in &cs {
        c.set_nonblocking(true)?;
    }
    let mut steps: Vec<Step> = (0..conns).map(|_| Step::new(size, true)).collect();
    let mut warm = vec![false; conns];
    let mut start: Option<Instant> = None;
    let mut n = 0u64;
    let mut last = Instant::now();
    loop {
        let mut moved = false;
        for ((c, st), w) in cs.iter_mut().zip(&mut steps).zip(&mut warm) {
            let m = st.advance(c)?;
            moved |= m.bytes;
            // a response received (the step turned to sending) ends a transaction
            if m.message && st.sending {
                *w = true;
                if start.is_some() {
                    n += 1;
                }
            }
        }
        let now = Instant::now();
        match start {
            None if warm.iter().all(|&w| w) => start = Some(now),
            Some(t0) if now - t0 >= dur => return Ok(n as f64 / (now - t0).as_secs_f64()),
            _ => {}
        }
        if moved {
            last = now;
        } else if now - last > IO_TIMEOUT {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("polling: nothing moved for {} s", IO_TIMEOUT.as_secs()),
            ));
        } else {
            std::thread::yield_now();
        }
    }
}

/// One-way bulk transfer.
#[derive(Clone, Copy, Debug)]
pub struct Bulk {
    /// Payload bytes per second / 1e9, until the receiver's count came back.
    pub gbps: f64,
    /// CPU seconds (user + system, both processes) per GiB moved.
    pub cpu_s_per_gib: f64,
    /// User seconds per GiB, both processes (clock-tick resolution).
    pub user_s_per_gib: f64,
    /// System seconds per GiB, both processes (clock-tick resolution).
    pub sys_s_per_gib: f64,
}

/// Streams `total` bytes in `chunk`-byte writes; the server answers its count.
/// CPU time of both processes is taken right before the first byte and right
/// after the answer. `in_place`: through the zero-copy API on both sides
/// (`Conn::write_in_place`, `Conn::take_in_place`).
pub fn bulk(
    t: Transport,
    server: &mut ServerProc,
    total: u64,
    chunk: usize,
    in_place: bool,
    tally: &mut Tally,
) -> io::Result<Bulk> {
    let port = match t {
        Transport::Smc => server.smc_port,
        Transport::Tcp => server.tcp_port,
    };
    let job = if in_place {
        Job::SinkInPlace { total }
    } else {
        Job::Sink { total }
    };
    let mut c = open(t, port, job, tally)?;
    let buf = vec![0x5au8; chunk];
    let s0 = server.cpu()?;
    let c0 = CpuTime::now();
    let t0 = Instant::now();
    let mut left = total;
    while left > 0 {
        let n = chunk.min(left.try_into().unwrap_or(usize::MAX));
        if in_place {
            let k = c.write_in_place(&buf[..n])?;
            if k == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            left -= k as u64;
        } else {
            c.write_all(&buf[..n])?;
            left -= n as u64;
        }
    }
    let mut ack = [0u8; 8];
    c.read_exact(&mut ack)?;
    let secs = t0.elapsed().as_secs_f64();
    let c1 = CpuTime::now();
    let s1 = server.cpu()?;
    let got = u64::from_le_bytes(ack);
    if got != total {
        return Err(io::Error::other(format!(
            "the server received {got} of {total} bytes"
        )));
    }
    let (cc, sc) = (c1.since(c0), s1.since(s0));
    let gib = total as f64 / f64::from(1u32 << 30);
    let tick = sys::tick_secs();
    Ok(Bulk {
        gbps: total as f64 / secs / 1e9,
        cpu_s_per_gib: (cc.secs() + sc.secs()) / gib,
        user_s_per_gib: (cc.user_ticks + sc.user_ticks) as f64 * tick / gib,
        sys_s_per_gib: (cc.sys_ticks + sc.sys_ticks) as f64 * tick / gib,
    })
}

/// Connection setup: connect, one 64 B request and response, close; `n`
/// times or until `cap` has passed. Connections per second. `clc`: over
/// TCP, three messages of the CLC handshake's sizes go first (the client's
/// Proposal, the server's Accept, the client's Confirm, each its own
/// message, as SMC-R sends them before its first byte of data): the setup
/// reference `Job::OnceAfterClc`.
pub fn setup(
    t: Transport,
    port: u16,
    n: usize,
    cap: Duration,
    clc: bool,
    tally: &mut Tally,
) -> io::Result<f64> {
    const MSG: usize = 64;
    let (req_len, resp_len) = (MSG as u64, MSG as u64);
    let header = Header(if clc {
        Job::OnceAfterClc {
            req: req_len,
            resp: resp_len,
        }
    } else {
        Job::Once {
            req: req_len,
            resp: resp_len,
        }
    })
    .encode();
    // The header goes in the same write as the first message: one message.
    let mut first = header.to_vec();
    first.resize(HEADER_LEN + if clc { CLC_PROPOSAL } else { MSG }, 0x42);
    let req = [0x42; MSG];
    let mut resp = vec![0u8; MSG.max(CLC_ACCEPT)];
    let t0 = Instant::now();
    let mut done = 0usize;
    while done < n && t0.elapsed() < cap {
        let mut c = Conn::connect(t, port)?;
        *tally.entry(c.label()).or_default() += 1;
        c.set_read_timeout(Some(IO_TIMEOUT))?;
        c.write_all(&first)?;
        if clc {
            c.read_exact(&mut resp[..CLC_ACCEPT])?;
            c.write_all(&[0xa3; CLC_CONFIRM])?;
            c.write_all(&req)?;
        }
        c.read_exact(&mut resp[..MSG])?;
        drop(c);
        done += 1;
    }
    Ok(done as f64 / t0.elapsed().as_secs_f64())
}

/// What a memory probe process saw: (resident, mapped) bytes of itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MemProbe {
    /// Before any connection.
    pub base: (u64, u64),
    /// With one idle connection open.
    pub one: (u64, u64),
    /// With `1 + n` idle connections open.
    pub all: (u64, u64),
    /// The further connections (`n`).
    pub n: u64,
    /// Modes of all connections.
    pub modes: Tally,
}

/// Idle cost of one connection, measured in a fresh process.
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    /// Resident bytes the first connection added (includes per-process and
    /// per-link-group setup).
    pub first_rss: f64,
    /// Mapped bytes the first connection added.
    pub first_mapped: f64,
    /// Resident bytes per further connection.
    pub each_rss: f64,
    /// Mapped bytes per further connection.
    pub each_mapped: f64,
}

/// Runs `<this exe> __mem-probe smc|tcp PORT N` and reads its [`MemProbe`].
pub fn memory(t: Transport, port: u16, n: usize, tally: &mut Tally) -> io::Result<Memory> {
    let out = Command::new(std::env::current_exe()?)
        .args(["__mem-probe", t.key(), &port.to_string(), &n.to_string()])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "memory probe process failed ({})",
            out.status
        )));
    }
    let p: MemProbe = serde_json::from_slice(&out.stdout).map_err(|e| {
        io::Error::other(format!(
            "memory probe said {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        ))
    })?;
    for (k, v) in &p.modes {
        *tally.entry(k.clone()).or_default() += v;
    }
    let d = |a: u64, b: u64| a as f64 - b as f64;
    let per = p.n.max(1) as f64;
    Ok(Memory {
        first_rss: d(p.one.0, p.base.0),
        first_mapped: d(p.one.1, p.base.1),
        each_rss: d(p.all.0, p.one.0) / per,
        each_mapped: d(p.all.1, p.one.1) / per,
    })
}

/// The memory probe process: opens 1 + N idle connections, printing its own
/// memory before, after the first and after all as one JSON line.
pub fn mem_probe_main(args: &[String]) -> ExitCode {
    let run = || -> io::Result<MemProbe> {
        let (t, port, n) = match args {
            [t, port, n] => (
                match t.as_str() {
                    "smc" => Transport::Smc,
                    "tcp" => Transport::Tcp,
                    _ => return Err(io::Error::other("transport must be smc or tcp")),
                },
                port.parse::<u16>().map_err(io::Error::other)?,
                n.parse::<u64>().map_err(io::Error::other)?,
            ),
            _ => return Err(io::Error::other("usage: __mem-probe smc|tcp PORT N")),
        };
        let mut modes = Tally::new();
        let mut conns = Vec::new();
        let idle = |modes: &mut Tally| -> io::Result<Conn> {
            let mut c = open(t, port, Job::Idle, modes)?;
            let mut b = [0u8; 1];
            c.read_exact(&mut b)?; // the server holds it now
            Ok(c)
        };
        let base = sys::memory()?;
        conns.push(idle(&mut modes)?);
        let one = sys::memory()?;
        for _ in 0..n {
            conns.push(idle(&mut modes)?);
        }
        let all = sys::memory()?;
        // A clean close on both sides before this process exits (an exit with
        // open SMC connections looks like a crash to the server).
        for c in &conns {
            c.shutdown_write()?;
        }
        for mut c in conns {
            let mut b = [0u8; 16];
            while c.read(&mut b)? > 0 {}
        }
        Ok(MemProbe {
            base,
            one,
            all,
            n,
            modes,
        })
    };
    match run() {
        Ok(p) => {
            println!("{}", serde_json::to_string(&p).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("smc-bench memory probe: {e}");
            ExitCode::FAILURE
        }
    }
}
