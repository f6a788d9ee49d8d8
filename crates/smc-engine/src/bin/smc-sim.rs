//! `smc-sim` — the deterministic SMC-R simulation from the command line.
//!
//! ```text
//! smc-sim run [--seeds N] [--start S]   run seeds S..S+N (default 0..1000), summary at the end
//! smc-sim replay SEED                   run one seed and print its event trace
//! ```
#![forbid(unsafe_code)]

use smc_engine::simulate;
use std::process::ExitCode;

fn usage() -> ExitCode {
    eprintln!("usage: smc-sim run [--seeds N] [--start S] | smc-sim replay SEED");
    ExitCode::from(2)
}

fn num(v: Option<&String>) -> Option<u64> {
    v.and_then(|s| s.parse().ok())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("run") => {
            let (mut n, mut start) = (1000u64, 0u64);
            let mut it = args.iter().skip(1);
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--seeds" => match num(it.next()) {
                        Some(x) => n = x,
                        None => return usage(),
                    },
                    "--start" => match num(it.next()) {
                        Some(x) => start = x,
                        None => return usage(),
                    },
                    _ => return usage(),
                }
            }
            let t = std::time::Instant::now();
            let (mut smc, mut not_smc, mut bytes, mut faults, mut aborts, mut failed) =
                (0, 0, 0u64, 0, 0, 0);
            let (mut two_links, mut failovers, mut moves, mut add_faults) = (0, 0, 0, 0);
            let (mut two_devices, mut handshake_resets) = (0, 0);
            let (mut prepare_runs, mut prepare_failures, mut prepare_victims, mut late) =
                (0, 0, 0, 0);
            for seed in start..start + n {
                match simulate::run(seed) {
                    Ok(r) => {
                        smc += r.smc;
                        not_smc += r.not_smc;
                        bytes += r.bytes;
                        faults += usize::from(r.fault.is_some());
                        aborts += r.aborts;
                        two_links += usize::from(r.second_link);
                        two_devices += usize::from(r.second_device);
                        handshake_resets += r.handshake_resets;
                        failovers += usize::from(r.survivable_fault);
                        moves += r.moves;
                        add_faults += usize::from(r.add_link_fault);
                        prepare_runs += usize::from(r.prepare_faults);
                        prepare_failures += r.prepare_failures;
                        prepare_victims += r.prepare_victims;
                        late += usize::from(r.confirm_link_fault);
                    }
                    Err(e) => {
                        failed += 1;
                        eprintln!("{e}");
                    }
                }
            }
            println!(
                "{} seeds in {:.1?}: {} passed, {} failed; {smc} SMC-R connections, {not_smc} fallen back or failed in the handshake, {aborts} aborts, {faults} runs with a fault, {:.1} MiB delivered",
                n,
                t.elapsed(),
                n - failed,
                failed,
                bytes as f64 / (1 << 20) as f64
            );
            println!(
                "  {two_links} runs with a second link ({two_devices} over second devices), {failovers} of them lost one link (failover), {moves} connection moves, {add_faults} QP failures during ADD_LINK, {handshake_resets} handshakes reset by a port going down"
            );
            println!(
                "  {prepare_runs} runs with failing prepare_remote: {prepare_failures} failures ended {prepare_victims} connections; {late} runs lost a first link right after the CLC exchange"
            );
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Some("replay") => {
            let Some(seed) = num(args.get(1)) else {
                return usage();
            };
            match simulate::run(seed) {
                Ok(r) => {
                    for line in &r.trace {
                        println!("{line}");
                    }
                    println!(
                        "seed {seed}: passed ({} SMC-R, {} not SMC, {} bytes, virtual time {:?})",
                        r.smc, r.not_smc, r.bytes, r.virtual_time
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => usage(),
    }
}
