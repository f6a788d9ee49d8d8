//! Passive side of the `shm` conformance suite and benchmark, run as a
//! separate process (possibly inside another network namespace).
//!
//! `smc-rdma-peer suite CONFIG DEVICE [k=v ...]` — serve the conformance line
//! protocol on stdin/stdout (see `smc_rdma::conformance::serve`).
//! `smc-rdma-peer pong CONFIG DEVICE MODE` — benchmark echo peer (MODE = poll|block).
//! `smc-rdma-peer qpns CONFIG DEVICE N` — open DEVICE, print `ready`, wait
//! for a line on stdin, create N QPs at once, print `qpns <n>...` and keep
//! them until stdin closes (QP-number uniqueness tests).
#![forbid(unsafe_code)]

use smc_rdma::conformance::{serve, ConnParams, Endpoint, EndpointInfo, LocalPeer};
use smc_rdma::shm::{ShmConfig, ShmProvider};
use smc_rdma::*;
use std::io::{BufRead, Write};
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Err(e) = run(&args) {
        eprintln!("smc-rdma-peer: {e}");
        println!("error {e}");
        std::process::exit(1);
    }
}

fn stdin_lines() -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn run(args: &[String]) -> Result<()> {
    let usage =
        || Error::Config("usage: smc-rdma-peer suite|pong|qpns CONFIG DEVICE [args]".into());
    let (mode, cfg, dev) = match args {
        [_, m, c, d, ..] => (m.as_str(), c, d),
        _ => return Err(usage()),
    };
    let cfg = ShmConfig::parse(&std::fs::read_to_string(cfg)?)?;
    let provider = ShmProvider::new(cfg);
    match mode {
        "suite" => {
            let params = ConnParams::from_args(args[4..].iter().map(|s| s.as_str()))?;
            let mut peer = LocalPeer::new(Endpoint::open(&provider, dev, params)?);
            let out = std::io::stdout();
            let mut out = out.lock();
            serve(&mut peer, stdin_lines(), &mut out)
        }
        "pong" => pong(
            &provider,
            dev,
            args.get(4).map(|s| s.as_str()) == Some("block"),
        ),
        "qpns" => {
            let n: usize = args.get(4).and_then(|s| s.parse().ok()).ok_or_else(usage)?;
            qpns(&provider, dev, n)
        }
        _ => Err(usage()),
    }
}

/// Creates `n` QPs on a fresh instance of `dev` and reports their numbers.
fn qpns(provider: &ShmProvider, dev: &str, n: usize) -> Result<()> {
    let d = provider.open_device(dev)?;
    let pd = d.alloc_pd()?;
    let cq = d.create_cq(16, None)?;
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let lines = stdin_lines();
    let _ = lines.recv();
    let mut qps = Vec::with_capacity(n);
    for _ in 0..n {
        qps.push(pd.create_qp(&cq, &cq, QpCap::default())?);
    }
    let nums: Vec<String> = qps.iter().map(|q| q.qp_num().to_string()).collect();
    writeln!(out, "qpns {}", nums.join(" "))?;
    out.flush()?;
    while lines.recv().is_ok() {}
    Ok(())
}

/// Echo peer for the latency benchmark: every received SEND is answered
/// with a SEND of the same size.
fn pong(provider: &ShmProvider, dev: &str, block: bool) -> Result<()> {
    let ep = Endpoint::open(provider, dev, ConnParams::default())?;
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "info {}", ep.info().to_line())?;
    out.flush()?;
    let lines = stdin_lines();
    let l = lines
        .recv()
        .map_err(|_| Error::Connect("no peer info".into()))?;
    let info = EndpointInfo::from_line(l.trim_start_matches("connect "))?;
    for i in 0..64u64 {
        let sge = ep.mr.sge(64 * i as usize, 64)?;
        ep.qp.post_recv(&RecvWr {
            wr_id: i,
            sges: &[sge],
        })?;
    }
    ep.connect(&info)?;
    writeln!(out, "ok")?;
    out.flush()?;
    let mut wcs = [WorkCompletion::default(); 16];
    loop {
        if block {
            ep.rcq.req_notify()?;
        }
        let n = ep.rcq.poll(&mut wcs)?;
        if n == 0 {
            if ep.qp.state() == QpState::Err {
                return Ok(());
            }
            if block {
                ep.chan.wait(Duration::from_millis(100))?;
            }
            let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
            continue;
        }
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                return Ok(());
            }
            let sge = ep.mr.sge(64 * w.wr_id as usize, 64)?;
            ep.qp.post_recv(&RecvWr {
                wr_id: w.wr_id,
                sges: &[sge],
            })?;
            let reply = SendWr {
                wr_id: w.wr_id,
                op: SendOp::Send,
                payload: Payload::Inline(&[0u8; 44][..w.byte_len.min(44) as usize]),
                signaled: false,
            };
            while let Err(Error::QueueFull) = ep.qp.post_send(&reply) {
                let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
            }
        }
        let _ = ep.scq.poll(&mut [WorkCompletion::default(); 16]);
    }
}
