//! A small benchmark through the provider between two machines: SEND round
//! trip (busy polling and completion-channel wake-ups) and RDMA WRITE
//! bandwidth. The passive side is [`pong`], started by
//! [`crate::remote::serve_passive`] for a `bench` hello.
#![forbid(unsafe_code)]

use crate::provider::VerbsProvider;
use smc_rdma::conformance::{ConnParams, Endpoint, EndpointInfo};
use smc_rdma::*;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const SLOTS: u64 = 64;
const MSG: u32 = 64;

fn post_slot(ep: &Endpoint<VerbsProvider>, i: u64) -> Result<()> {
    let sge = ep.mr.sge((MSG as u64 * i) as usize, MSG)?;
    ep.qp.post_recv(&RecvWr {
        wr_id: i,
        sges: &[sge],
    })
}

/// Echo peer on stdin/stdout: every received SEND is answered by a SEND of
/// the same size; WRITEs need no help. It always waits on the completion
/// channel when idle; only the active side busy-polls in the `poll` figure. Ends when the QP fails or stdin closes.
pub fn pong(dev: &str) -> Result<()> {
    let ep = Endpoint::open(&VerbsProvider::new(), dev, ConnParams::default())?;
    let mut out = std::io::stdout();
    writeln!(out, "info {}", ep.info().to_line())?;
    out.flush()?;
    let mut l = String::new();
    std::io::stdin().lock().read_line(&mut l)?;
    let info = EndpointInfo::from_line(l.trim().trim_start_matches("connect "))?;
    for i in 0..SLOTS {
        post_slot(&ep, i)?;
    }
    ep.connect(&info)?;
    writeln!(out, "ok")?;
    out.flush()?;
    // stdin EOF (the active side is done) ends the loop.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut s = String::new();
        while std::io::stdin().lock().read_line(&mut s).unwrap_or(0) > 0 {
            s.clear();
        }
        let _ = tx.send(());
    });
    let mut wcs = [WorkCompletion::default(); 16];
    let mut sent = 0u64;
    loop {
        if rx.try_recv().is_ok() {
            return Ok(());
        }
        let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
        let mut n = ep.rcq.poll(&mut wcs)?;
        if n == 0 {
            if ep.qp.state() == QpState::Err {
                return Ok(());
            }
            // Idle: block on the completion channel (arm, re-poll, wait), so
            // the echo side does not compete for the VM's single vCPU.
            ep.rcq.req_notify()?;
            n = ep.rcq.poll(&mut wcs)?;
            if n == 0 {
                ep.chan.wait(Duration::from_millis(100))?;
                continue;
            }
        }
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                return Ok(());
            }
            post_slot(&ep, w.wr_id)?;
            sent += 1;
            let reply = SendWr {
                wr_id: w.wr_id,
                op: SendOp::Send,
                payload: Payload::Inline(&[0u8; MSG as usize][..w.byte_len.min(MSG) as usize]),
                signaled: sent.is_multiple_of(16),
            };
            loop {
                match ep.qp.post_send(&reply) {
                    Err(Error::QueueFull) => {
                        let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
                    }
                    r => break r?,
                }
            }
        }
    }
}

/// Benchmark figures.
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// SEND round trips with busy polling (µs): p50, mean, p99, count.
    pub rtt_poll_us: (f64, f64, f64, usize),
    /// SEND round trips waiting on the completion channel (µs).
    pub rtt_block_us: (f64, f64, f64, usize),
    /// WRITE bandwidth in MiB/s, bytes written, message size.
    pub write_mib_s: (f64, u64, usize),
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64, usize) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0, 0);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let mean = v.iter().sum::<f64>() / n as f64;
    (v[n / 2], mean, v[(n * 99 / 100).min(n - 1)], n)
}

fn rtt(ep: &Endpoint<VerbsProvider>, n: usize, block: bool) -> Result<Vec<f64>> {
    let mut wcs = [WorkCompletion::default(); 16];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = Instant::now();
        ep.qp.post_send(&SendWr {
            wr_id: i,
            op: SendOp::Send,
            payload: Payload::Inline(&[7u8; MSG as usize]),
            signaled: i % 16 == 15,
        })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
            if block {
                ep.rcq.req_notify()?;
            }
            let k = ep.rcq.poll(&mut wcs)?;
            if k > 0 {
                for w in &wcs[..k] {
                    if w.status != WcStatus::Success {
                        return Err(Error::Connect(format!("receive failed: {w:?}")));
                    }
                    post_slot(ep, w.wr_id)?;
                }
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Connect("no reply within 10 s".into()));
            }
            if block {
                ep.chan.wait(Duration::from_millis(100))?;
            }
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(lat)
}

fn write_bw(
    ep: &Endpoint<VerbsProvider>,
    remote: &RemoteMr,
    msg: usize,
    total: u64,
    limit: Duration,
) -> Result<(f64, u64)> {
    let depth = 16u64;
    let sge = ep.mr.sge(0, msg as u32)?;
    let (mut posted, mut done) = (0u64, 0u64);
    let slots = (remote.len as usize / msg).max(1) as u64;
    let t = Instant::now();
    let mut wcs = [WorkCompletion::default(); 16];
    while done * (msg as u64) < total && t.elapsed() < limit {
        while posted - done < depth && posted * (msg as u64) < total {
            ep.qp.post_send(&SendWr {
                wr_id: posted,
                op: SendOp::RdmaWrite {
                    remote_addr: remote.addr + (posted % slots) * msg as u64,
                    rkey: remote.rkey,
                },
                payload: Payload::Sges(&[sge]),
                signaled: true,
            })?;
            posted += 1;
        }
        let k = ep.scq.poll(&mut wcs)?;
        for w in &wcs[..k] {
            if w.status != WcStatus::Success {
                return Err(Error::Connect(format!("write failed: {w:?}")));
            }
        }
        done += k as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = done * msg as u64;
    Ok((bytes as f64 / secs / (1024.0 * 1024.0), bytes))
}

/// Runs the benchmark against the supervisor at `peer`.
pub fn run(dev: &str, peer: &str, rtt_n: usize, write_mib: u64) -> Result<BenchResult> {
    let ep = Endpoint::open(&VerbsProvider::new(), dev, ConnParams::default())?;
    let s = TcpStream::connect(peer)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    writeln!(w, "bench")?;
    let mut l = String::new();
    r.read_line(&mut l)?;
    let remote = EndpointInfo::from_line(
        l.trim()
            .strip_prefix("info ")
            .ok_or_else(|| Error::Connect(format!("bad bench hello reply {l:?}")))?,
    )?;
    for i in 0..SLOTS {
        post_slot(&ep, i)?;
    }
    writeln!(w, "connect {}", ep.info().to_line())?;
    l.clear();
    r.read_line(&mut l)?;
    if l.trim() != "ok" {
        return Err(Error::Connect(format!("peer: {}", l.trim())));
    }
    ep.connect(&remote)?;
    let warm = rtt(&ep, 20, false)?;
    drop(warm);
    let rtt_poll_us = stats(rtt(&ep, rtt_n, false)?);
    let rtt_block_us = stats(rtt(&ep, (rtt_n / 4).max(10), true)?);
    let msg = 64 * 1024;
    let (mib_s, bytes) = write_bw(
        &ep,
        &remote.mr,
        msg,
        write_mib << 20,
        Duration::from_secs(60),
    )?;
    Ok(BenchResult {
        rtt_poll_us,
        rtt_block_us,
        write_mib_s: (mib_s, bytes, msg),
    })
}
