//! `shm` benchmark: RDMA WRITE bandwidth as a ratio to plain memcpy of the
//! same size (same run), and one-way SEND latency between two processes,
//! polled and blocking.
//!
//! Needs root (it creates a veth pair to bind the two devices to) and the
//! `smc-rdma-peer` binary next to the example:
//!
//! ```text
//! cargo build --release -p smc-rdma --bins --examples
//! target/release/examples/shm_bench
//! ```
#![forbid(unsafe_code)]

use smc_rdma::conformance::{ConnParams, Endpoint, EndpointInfo, ProcPeer};
use smc_rdma::shm::{ShmConfig, ShmDeviceConfig, ShmProvider};
use smc_rdma::*;
use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

struct Veth(String);
impl Drop for Veth {
    fn drop(&mut self) {
        ip(&["link", "del", &self.0]);
    }
}

fn main() -> Result<()> {
    if !smc_rdma::sys::is_root() {
        eprintln!("shm_bench needs root (it creates a veth pair); not run");
        std::process::exit(2);
    }
    let tag = std::process::id() % 100_000;
    let (a, b) = (format!("ba{tag}"), format!("bb{tag}"));
    if !ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]) {
        return Err(Error::Config("cannot create veth pair".into()));
    }
    let _veth = Veth(a.clone());
    ip(&["link", "set", &a, "up"]);
    ip(&["link", "set", &b, "up"]);
    std::thread::sleep(Duration::from_millis(100));
    let rundir = std::env::temp_dir().join(format!("smc-bench-{tag}"));
    std::fs::create_dir_all(&rundir)?;
    let cfg = ShmConfig {
        devices: vec![
            ShmDeviceConfig {
                name: "shmA".into(),
                netdev: a.clone(),
            },
            ShmDeviceConfig {
                name: "shmB".into(),
                netdev: b.clone(),
            },
        ],
        rundir: rundir.clone(),
        ..Default::default()
    };
    let cfg_path = rundir.join("shm.conf");
    std::fs::write(&cfg_path, cfg.to_text())?;
    let provider = ShmProvider::new(cfg);
    let peer_exe = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("smc-rdma-peer"))
        .ok_or_else(|| Error::Config("cannot locate smc-rdma-peer".into()))?;
    if !peer_exe.exists() {
        return Err(Error::Config(format!(
            "{} missing: cargo build --release -p smc-rdma --bins",
            peer_exe.display()
        )));
    }

    bandwidth(&provider, &peer_exe, &cfg_path)?;
    latency(&provider, &peer_exe, &cfg_path, false)?;
    latency(&provider, &peer_exe, &cfg_path, true)?;
    let _ = std::fs::remove_dir_all(&rundir);
    Ok(())
}

fn connect_peer(
    provider: &ShmProvider,
    mut cmd: Command,
    params: ConnParams,
) -> Result<(Endpoint<ShmProvider>, ProcPeer)> {
    let local = Endpoint::open(provider, "shmA", params)?;
    cmd.stderr(std::process::Stdio::inherit());
    let mut peer = ProcPeer::spawn(cmd)?;
    peer.cmd(&format!("connect {}", local.info().to_line()))?;
    local.connect(&peer.info)?;
    Ok((local, peer))
}

fn bandwidth(provider: &ShmProvider, exe: &std::path::Path, cfg: &std::path::Path) -> Result<()> {
    let mr_len = 2 << 20;
    let params = ConnParams {
        mr_len,
        ..Default::default()
    };
    let mut cmd = Command::new(exe);
    cmd.arg("suite")
        .arg(cfg)
        .arg("shmB")
        .args(params.to_args().split_whitespace());
    let (local, peer) = connect_peer(provider, cmd, params)?;
    let r = peer.info.mr;
    println!(
        "RDMA WRITE bandwidth (writer in this process, target region mapped from the peer process)"
    );
    println!(
        "{:>8} {:>12} {:>12} {:>7}",
        "size", "write GB/s", "memcpy GB/s", "ratio"
    );
    for size in [4096usize, 65536, 1 << 20] {
        let total: usize = 1 << 30;
        let iters = (total / size).max(64);
        local.mr.write_at(0, &vec![0xa5; size])?;
        let sge = local.mr.sge(0, size as u32)?;
        // warm-up (also fetches and caches the peer region)
        run_writes(&local, &sge, r, 64)?;
        let t = Instant::now();
        run_writes(&local, &sge, r, iters)?;
        let tw = t.elapsed();
        let src = vec![0x5au8; size];
        let mut dst = vec![0u8; size];
        for _ in 0..64 {
            dst.copy_from_slice(black_box(&src));
        }
        let t = Instant::now();
        for _ in 0..iters {
            black_box(&mut dst).copy_from_slice(black_box(&src));
        }
        let tm = t.elapsed();
        let gbs = |d: Duration| (size * iters) as f64 / d.as_secs_f64() / 1e9;
        println!(
            "{:>8} {:>12.2} {:>12.2} {:>7.2}",
            size,
            gbs(tw),
            gbs(tm),
            tm.as_secs_f64() / tw.as_secs_f64()
        );
    }
    Ok(())
}

fn run_writes(local: &Endpoint<ShmProvider>, sge: &Sge, r: RemoteMr, iters: usize) -> Result<()> {
    let mut wcs = [WorkCompletion::default(); 16];
    let mut outstanding = 0usize;
    for i in 0..iters {
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::RdmaWrite {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            payload: Payload::Sges(std::slice::from_ref(sge)),
            signaled: i % 16 == 15 || i + 1 == iters,
        };
        loop {
            match local.qp.post_send(&wr) {
                Ok(()) => break,
                Err(Error::QueueFull) => {
                    let n = local.scq.poll(&mut wcs)?;
                    outstanding -= n.min(outstanding);
                }
                Err(e) => return Err(e),
            }
        }
        if wr.signaled {
            outstanding += 1;
        }
    }
    while outstanding > 0 {
        let n = local.scq.poll(&mut wcs)?;
        for w in &wcs[..n] {
            if w.status != WcStatus::Success {
                return Err(Error::Connect(format!("write failed: {w:?}")));
            }
        }
        outstanding -= n.min(outstanding);
    }
    Ok(())
}

fn latency(
    provider: &ShmProvider,
    exe: &std::path::Path,
    cfg: &std::path::Path,
    block: bool,
) -> Result<()> {
    let mut cmd = Command::new(exe);
    cmd.arg("pong")
        .arg(cfg)
        .arg("shmB")
        .arg(if block { "block" } else { "poll" });
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let local = Endpoint::open(provider, "shmA", ConnParams::default())?;
    let mut child = cmd.spawn()?;
    use std::io::{BufRead, Write};
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut inp = child.stdin.take().expect("piped");
    let mut l = String::new();
    out.read_line(&mut l)?;
    let info = EndpointInfo::from_line(l.trim().trim_start_matches("info "))?;
    for i in 0..64u64 {
        let sge = local.mr.sge(64 * i as usize, 64)?;
        local.qp.post_recv(&RecvWr {
            wr_id: i,
            sges: &[sge],
        })?;
    }
    writeln!(inp, "connect {}", local.info().to_line())?;
    inp.flush()?;
    l.clear();
    out.read_line(&mut l)?;
    if l.trim() != "ok" {
        return Err(Error::Connect(format!("pong peer: {l}")));
    }
    local.connect(&info)?;
    let n = if block { 5_000 } else { 20_000 };
    let mut samples = Vec::with_capacity(n);
    let mut wcs = [WorkCompletion::default(); 4];
    let msg = [0x11u8; 44];
    for i in 0..n + 500 {
        let t = Instant::now();
        let s = SendWr {
            wr_id: i as u64,
            op: SendOp::Send,
            payload: Payload::Inline(&msg),
            signaled: i % 32 == 0,
        };
        local.qp.post_send(&s)?;
        let got = loop {
            let k = local.rcq.poll(&mut wcs)?;
            if k > 0 {
                break wcs[0];
            }
            if block {
                local.rcq.req_notify()?;
                let k = local.rcq.poll(&mut wcs)?;
                if k > 0 {
                    break wcs[0];
                }
                local.chan.wait(Duration::from_secs(1))?;
            }
        };
        if got.status != WcStatus::Success {
            return Err(Error::Connect(format!("recv failed: {got:?}")));
        }
        let sge = local.mr.sge(64 * got.wr_id as usize, 64)?;
        local.qp.post_recv(&RecvWr {
            wr_id: got.wr_id,
            sges: &[sge],
        })?;
        let _ = local.scq.poll(&mut wcs);
        if i >= 500 {
            samples.push(t.elapsed());
        }
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)] / 2;
    println!(
        "one-way 44-byte SEND latency, {} ({} round trips / 2): median {:.2} us, p99 {:.2} us",
        if block {
            "blocking (completion channel eventfd)"
        } else {
            "polled"
        },
        n,
        pct(0.5).as_secs_f64() * 1e6,
        pct(0.99).as_secs_f64() * 1e6
    );
    drop(inp);
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}
