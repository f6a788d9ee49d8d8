//! `smc-rendezvous`: install, inspect or remove the host-wide SMC SYN-option rendezvous.
//!
//! ```text
//! smc-rendezvous status            # load/attach if needed, print ids, pin dir, cgroup
//! smc-rendezvous uninstall         # detach + unpin every version
//! smc-rendezvous uninstall-stale   # detach + unpin every version except this build's
//! smc-rendezvous detach-orphans    # detach our programs whose pins were lost (bpffs wiped)
//! ```
//! Options: `--cgroup <dir>` (default: the cgroup2 root), `--namespace <name>` (default smc-rs).

use std::path::PathBuf;
use std::process::ExitCode;

use smc_bpf::{Config, Rendezvous};

fn main() -> ExitCode {
    let mut cfg = Config::default();
    let mut cmd = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--cgroup" => cfg.cgroup = args.next().map(PathBuf::from),
            "--namespace" => cfg.namespace = args.next().unwrap_or_default(),
            "status" | "install" | "uninstall" | "uninstall-stale" | "detach-orphans" => {
                cmd = Some(a)
            }
            _ => {
                eprintln!("usage: smc-rendezvous [--cgroup DIR] [--namespace NAME] status|install|uninstall|uninstall-stale|detach-orphans");
                return ExitCode::from(2);
            }
        }
    }
    let result = match cmd.as_deref() {
        Some("status") | Some("install") => Rendezvous::open_with(&cfg).map(|r| {
            println!(
                "prog_id={} map_id={} loaded_now={} pin_dir={} cgroup={}",
                r.prog_id(),
                r.map_id(),
                r.loaded_by_this_open(),
                r.pin_dir().display(),
                r.cgroup().display()
            );
            match smc_bpf::attached_programs(r.cgroup()) {
                Ok(ids) => println!(
                    "sock_ops programs attached to {}: {ids:?}",
                    r.cgroup().display()
                ),
                Err(e) => println!("BPF_PROG_QUERY failed: {e}"),
            }
        }),
        Some("uninstall") => smc_bpf::uninstall(&cfg).map(|r| println!("{r:?}")),
        Some("detach-orphans") => {
            smc_bpf::detach_orphans(&cfg).map(|ids| println!("detached {ids:?}"))
        }
        Some("uninstall-stale") => {
            smc_bpf::uninstall_other_versions(&cfg).map(|r| println!("{r:?}"))
        }
        _ => {
            eprintln!("usage: smc-rendezvous [--cgroup DIR] [--namespace NAME] status|install|uninstall|uninstall-stale|detach-orphans");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("smc-rendezvous: {e} [{}]", e.fallback_reason());
            ExitCode::FAILURE
        }
    }
}
