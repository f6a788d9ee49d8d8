//! The `verbs` provider conformance suite and benchmark across two machines.
//!
//! ```text
//! verbs-conformance devices
//! verbs-conformance passive --listen ADDR:PORT --device rxe0 --netdev IF
//! verbs-conformance suite   --peer ADDR:PORT   --device rxe0 --netdev IF [--cases a,b]
//! verbs-conformance bench   --peer ADDR:PORT   --device rxe0 [--rtt-n N] [--write-mib M]
//! verbs-conformance shutdown --peer ADDR:PORT
//! (internal, started by `passive`: session DEVICE NETDEV k=v...; pong DEVICE)
//! ```
#![forbid(unsafe_code)]

use smc_rdma::conformance::ConnParams;
use smc_rdma::{Device, Provider};
use smc_verbs::{bench, remote, VerbsProvider};
use std::io::Write;

fn opt(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    opt(args, name).ok_or_else(|| format!("missing {name}"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("verbs-conformance: {e}");
            println!("error {e}");
            std::process::exit(2);
        }
    }
}

fn run(args: &[String]) -> Result<i32, String> {
    let s = |e: smc_rdma::Error| e.to_string();
    match args.get(1).map(|s| s.as_str()) {
        Some("devices") => {
            if let Err(why) = VerbsProvider::availability() {
                println!("no RDMA devices: {why}");
            }
            let p = VerbsProvider::new();
            let devs = p.devices().map_err(s)?;
            if devs.is_empty() {
                println!("no RDMA devices");
            }
            for d in devs {
                println!(
                    "device {} max_msg_size={} max_inline={}",
                    d.name, d.max_msg_size, d.max_inline
                );
                for port in &d.ports {
                    println!(
                        "  port {} state={:?} active_mtu={:?} netdev={}",
                        port.port_num,
                        port.state,
                        port.active_mtu,
                        port.netdev.as_deref().unwrap_or("-")
                    );
                    for g in &port.gids {
                        println!("    gid[{}] {} {:?}", g.index, g.gid, g.gid_type);
                    }
                }
                // Opening also exercises the context and the async fd.
                let dev = p.open_device(&d.name).map_err(s)?;
                let _ = dev.async_fd();
            }
            Ok(0)
        }
        Some("passive") => {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            remote::serve_passive(
                &need(args, "--listen")?,
                &exe,
                &need(args, "--device")?,
                &need(args, "--netdev")?,
            )
            .map_err(s)?;
            Ok(0)
        }
        Some("session") => {
            let (dev, nd) = match args {
                [_, _, d, n, ..] => (d, n),
                _ => return Err("usage: session DEVICE NETDEV k=v...".into()),
            };
            let params = ConnParams::from_args(args[4..].iter().map(|s| s.as_str())).map_err(s)?;
            remote::session(dev, nd, params).map_err(s)?;
            Ok(0)
        }
        Some("pong") => {
            bench::pong(args.get(2).ok_or("usage: pong DEVICE")?).map_err(s)?;
            Ok(0)
        }
        Some("suite") => {
            let only: Vec<String> = opt(args, "--cases")
                .map(|c| {
                    c.split(',')
                        .filter(|x| !x.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default();
            let t = std::time::Instant::now();
            let res = remote::run_suite(
                &need(args, "--device")?,
                &need(args, "--netdev")?,
                &need(args, "--peer")?,
                &only,
            );
            let failed: Vec<&str> = res
                .iter()
                .filter(|r| r.result.is_err())
                .map(|r| r.name)
                .collect();
            let secs = t.elapsed().as_secs_f64();
            if res.is_empty() {
                println!("SMCV-RESULT: FAIL no cases ran");
                return Ok(1);
            }
            if failed.is_empty() {
                println!(
                    "SMCV-RESULT: PASS {}/{} cases in {secs:.1}s",
                    res.len(),
                    res.len()
                );
                Ok(0)
            } else {
                println!(
                    "SMCV-RESULT: FAIL {}/{} cases failed in {secs:.1}s: {}",
                    failed.len(),
                    res.len(),
                    failed.join(",")
                );
                Ok(1)
            }
        }
        Some("bench") => {
            let n = opt(args, "--rtt-n")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1000);
            let mib = opt(args, "--write-mib")
                .and_then(|v| v.parse().ok())
                .unwrap_or(64);
            let r =
                bench::run(&need(args, "--device")?, &need(args, "--peer")?, n, mib).map_err(s)?;
            let (p50, mean, p99, cnt) = r.rtt_poll_us;
            println!("SMCV-BENCH send_rtt_poll msg=64B n={cnt} p50={p50:.0}us mean={mean:.0}us p99={p99:.0}us");
            let (p50, mean, p99, cnt) = r.rtt_block_us;
            println!("SMCV-BENCH send_rtt_channel msg=64B n={cnt} p50={p50:.0}us mean={mean:.0}us p99={p99:.0}us");
            let (bw, bytes, msg) = r.write_mib_s;
            println!(
                "SMCV-BENCH write_bw msg={}KiB depth=16 bytes={bytes} bw={bw:.2}MiB/s",
                msg / 1024
            );
            Ok(0)
        }
        Some("shutdown") => {
            let peer = need(args, "--peer")?;
            let mut st = std::net::TcpStream::connect(&peer).map_err(|e| e.to_string())?;
            writeln!(st, "shutdown").map_err(|e| e.to_string())?;
            Ok(0)
        }
        _ => Err(
            "usage: verbs-conformance devices|passive|suite|bench|shutdown ... (see source)".into(),
        ),
    }
}
