//! Passive side of the `shm` conformance suite and benchmark, run as a
//! separate process (possibly inside another network namespace).
//!
//! `smc-rdma-peer suite CONFIG DEVICE [k=v ...]` — serve the conformance line
//! protocol on stdin/stdout (see `smc_rdma::conformance::serve`).
//! `smc-rdma-peer pong CONFIG DEVICE MODE` — benchmark echo peer (MODE = poll|block).
//! `smc-rdma-peer qpns CONFIG DEVICE N` — open DEVICE, print `ready`, wait
//! for a line on stdin, create N QPs at once, print `qpns <n>...` and keep
//! them until stdin closes (QP-number uniqueness tests).
//! `smc-rdma-peer stranger RUNDIR MILLIS` — a local process with no
//! connection trying everything the device's interfaces allow (see
//! [`stranger`]); prints one `report k=v ...` line.
//!
//! In `suite` mode three process-level commands join the line protocol:
//! `exhaust` (lower the descriptor limit to what is open plus a few, then
//! open descriptors until none is left; answers how many were taken),
//! `release` (close them again) and `hang` (the device thread stops
//! answering, as a hung process's: `ShmDevice::freeze`).
#![forbid(unsafe_code)]

use smc_rdma::conformance::{serve_with, ConnParams, Endpoint, EndpointInfo, LocalPeer};
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
    let usage = || {
        Error::Config(
            "usage: smc-rdma-peer suite|pong|qpns CONFIG DEVICE [args] | stranger RUNDIR MILLIS"
                .into(),
        )
    };
    if let [_, m, dir, ms] = args {
        if m == "stranger" {
            let ms = ms.parse().map_err(|_| usage())?;
            let r = stranger::run(std::path::Path::new(dir), ms)?;
            println!("report {r}");
            return Ok(());
        }
    }
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
            let mut fillers: Vec<std::fs::File> = vec![];
            let mut extra = |w: &[&str], peer: &mut LocalPeer<ShmProvider>| match w.first().copied()
            {
                Some("exhaust") => Some(exhaust(&mut fillers)),
                Some("hang") => {
                    peer.ep.dev.freeze();
                    Some(Ok(String::new()))
                }
                Some("release") => {
                    let n = fillers.len();
                    fillers.clear();
                    Some(Ok(n.to_string()))
                }
                _ => None,
            };
            serve_with(&mut peer, stdin_lines(), &mut out, &mut extra)
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

/// Runs this process out of descriptors: the soft limit goes down to what is
/// open plus a few (so that filling it is quick), and the rest is taken.
fn exhaust(fillers: &mut Vec<std::fs::File>) -> Result<String> {
    let open = std::fs::read_dir("/proc/self/fd")?.count() as u64;
    smc_rdma::sys::set_open_files_limit(open + 16)?;
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => fillers.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(fillers.len().to_string())
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

/// A process with no connection that tries what the device's own interfaces
/// allow a hostile local process, against whatever QPs live in a rundir:
///
/// 1. reads every file of the rundir (registry, sockets, links);
/// 2. connects to every instance socket and asks, on fresh connections, for
///    regions by rkeys guessed and derived from the names (the derivation
///    of earlier versions: socket-name salt and a counter);
/// 3. sends hellos to every registered QP from every QP number and GID it
///    could claim, with a guessed proof, its own ring and eventfd; where a
///    hello is held it follows with an auth and region requests;
/// 4. keeps those connections for MILLIS, then looks whether anybody wrote
///    its ring (a SEND or a heartbeat) or signalled its eventfd.
///
/// Reports what it got: `fds` (descriptors received), `bytes` (non-zero
/// bytes seen through them), `ring_writes`, `signals`, and how much it
/// tried (`sockets`, `requests`, `hellos`, `held`).
mod stranger {
    use smc_rdma::shm::layout::*;
    use smc_rdma::shm::wire::{self, Kind, Msg};
    use smc_rdma::sys::{EventFd, SeqPacket, SharedMem};
    use smc_rdma::{Gid, Result};
    use std::os::fd::{AsFd, OwnedFd};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    #[derive(Default)]
    struct Report {
        files: usize,
        sockets: usize,
        requests: usize,
        hellos: usize,
        held: usize,
        fds: usize,
        bytes: usize,
        ring_writes: u64,
        signals: u64,
    }

    /// rkeys that names and counters would give under the old derivation.
    fn derived_rkeys(sock: &Path) -> Vec<u32> {
        let name = sock.file_stem().map(|s| s.to_string_lossy().to_string());
        let w: Vec<String> = name
            .unwrap_or_default()
            .split('-')
            .map(String::from)
            .collect();
        let (Some(seq), Some(hex)) = (
            w.get(w.len().wrapping_sub(2))
                .and_then(|s| s.parse::<u32>().ok()),
            w.last().and_then(|s| u32::from_str_radix(s, 16).ok()),
        ) else {
            return vec![];
        };
        let salt = hex ^ seq;
        (1..=64u32)
            .map(|n| {
                let lkey = (n << 8) | ((n.wrapping_mul(0x9e37_79b9) ^ salt) >> 24);
                lkey.rotate_left(13) ^ 0x5bd1_e995 ^ salt
            })
            .collect()
    }

    fn rand32() -> u32 {
        wire::random_u64().unwrap_or(0x1234_5678) as u32
    }

    /// Takes whatever comes back within a short while; counts descriptors
    /// and looks through them.
    fn answers(c: &SeqPacket, r: &mut Report) -> Vec<Msg> {
        let _ = c.set_read_timeout(Duration::from_millis(100));
        let mut out = vec![];
        for _ in 0..8 {
            let mut b = [0u8; 128];
            match c.recv(&mut b) {
                Ok((0, _)) | Err(_) => break,
                Ok((n, fds)) => {
                    look_through(fds, r);
                    if let Some(m) = Msg::decode(&b[..n]) {
                        out.push(m);
                    }
                }
            }
        }
        out
    }

    fn look_through(fds: Vec<OwnedFd>, r: &mut Report) {
        for fd in fds {
            r.fds += 1;
            if let Ok(m) = SharedMem::map(fd) {
                let mut buf = vec![0u8; m.len().min(1 << 20)];
                if m.read(0, &mut buf).is_ok() {
                    r.bytes += buf.iter().filter(|b| **b != 0).count();
                }
            }
        }
    }

    pub fn run(dir: &Path, ms: u64) -> Result<String> {
        let mut r = Report::default();
        let mut socks: Vec<PathBuf> = vec![];
        let mut qpns: Vec<u32> = vec![];
        let mut gids: Vec<Gid> = vec![];
        for e in std::fs::read_dir(dir)?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let p = e.path();
            // Everything is readable; nothing in it may help (links name
            // sockets, files hold a lock and a cursor).
            r.files += 1;
            if e.file_type().is_ok_and(|t| t.is_file()) {
                let _ = std::fs::read(&p);
            } else {
                let _ = std::fs::read_link(&p);
            }
            if name.ends_with(".sock") {
                socks.push(p.clone());
            }
            if let Some(h) = name.strip_prefix("qpn-") {
                if let Ok(q) = u32::from_str_radix(h, 16) {
                    qpns.push(q);
                }
            }
            if let Some(h) = name.strip_prefix("gid-") {
                if let Some(g) = Gid::from_hex(&h[..h.len().min(32)]) {
                    if !gids.contains(&g) {
                        gids.push(g);
                    }
                }
            }
        }
        if gids.is_empty() {
            gids.push(Gid::ZERO);
        }
        // 2. region requests on fresh connections
        let mut seen = std::collections::HashSet::new();
        for s in &socks {
            let mut keys = derived_rkeys(s);
            keys.extend((0..64).map(|_| rand32()));
            for rkey in keys {
                let Ok(c) = SeqPacket::connect(s) else {
                    continue;
                };
                if seen.insert(s.clone()) {
                    r.sockets += 1;
                }
                r.requests += 1;
                let req = Msg {
                    a: 1,
                    b: rkey,
                    ..Msg::new(Kind::MrReq)
                };
                let _ = c.send(&req.encode(), &[]);
                answers(&c, &mut r);
            }
        }
        // 3. forged hellos, held open
        let ring = SharedMem::create("stranger-ring", RING_LEN)?;
        ring.atomic(0)?.store(RING_MAGIC, Ordering::Release);
        let efd = EventFd::new()?;
        let mut held = vec![];
        for s in &socks {
            for &dst in &qpns {
                for &src in qpns
                    .iter()
                    .filter(|q| **q != dst)
                    .chain([0x00ff_fff0].iter())
                {
                    for gid in &gids {
                        let Ok(c) = SeqPacket::connect(s) else {
                            continue;
                        };
                        r.hellos += 1;
                        let flags = wire::F_RX_CHAN | wire::F_TX_CHAN | wire::F_SAME_CHAN;
                        let hello = Msg {
                            kind: Kind::Hello,
                            a: src,
                            b: dst,
                            c: flags,
                            gid: *gid,
                            x: u64::from(rand32()),
                            y: u64::from(rand32()),
                            z: 0,
                        };
                        let Some(ring_fd) = ring.fd() else { continue };
                        let _ = c.send(&hello.encode(), &[ring_fd, efd.as_fd()]);
                        let got = answers(&c, &mut r);
                        if got.iter().any(|m| m.kind == Kind::Received) {
                            r.held += 1;
                            let auth = Msg {
                                y: u64::from(rand32()),
                                ..Msg::new(Kind::Auth)
                            };
                            let _ = c.send(&auth.encode(), &[]);
                            for rkey in derived_rkeys(s).into_iter().take(8) {
                                let req = Msg {
                                    a: 2,
                                    b: rkey,
                                    ..Msg::new(Kind::MrReq)
                                };
                                let _ = c.send(&req.encode(), &[]);
                            }
                            answers(&c, &mut r);
                            held.push(c);
                        }
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(ms));
        for c in &held {
            answers(c, &mut r);
        }
        // 4. did anybody take us for its peer?
        for seq in 0..NSLOTS {
            if ring.atomic(Ring::slot(seq))?.load(Ordering::Acquire) != 0 {
                r.ring_writes += 1;
            }
        }
        r.ring_writes += ring.atomic(R_PROD_HB)?.load(Ordering::Acquire);
        r.signals += u64::from(efd.drain());
        Ok(format!(
            "files={} sockets={} requests={} hellos={} held={} fds={} bytes={} ring_writes={} signals={}",
            r.files, r.sockets, r.requests, r.hellos, r.held, r.fds, r.bytes, r.ring_writes, r.signals
        ))
    }
}
