//! `smc-rendezvous`: install, inspect or remove the host-wide SMC SYN-option rendezvous.
//!
//! ```text
//! smc-rendezvous install           # load/attach if needed and open it to every user
//! smc-rendezvous install --group G # ... to root and the members of group G only
//! smc-rendezvous install --root-only
//! smc-rendezvous status            # print ids, pin dir, cgroup, access, attached (changes nothing;
//!                                  # exit 3 if not installed)
//! smc-rendezvous uninstall         # detach + unpin every version
//! smc-rendezvous uninstall-stale   # detach + unpin every version except this build's
//! smc-rendezvous detach-orphans    # detach our programs whose pins were lost (bpffs wiped)
//! ```
//! Options: `--cgroup <dir>` (default: the cgroup2 root), `--namespace <name>` (default smc-rs).

use std::path::PathBuf;
use std::process::ExitCode;

use smc_bpf::{Access, Config, Rendezvous, RendezvousError};

const USAGE: &str = "usage: smc-rendezvous [--cgroup DIR] [--namespace NAME] status|install [--everyone|--group GROUP|--root-only]|uninstall|uninstall-stale|detach-orphans";

/// A group name (from /etc/group) or number.
fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse() {
        return Some(n);
    }
    let groups = std::fs::read_to_string("/etc/group").ok()?;
    groups.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then_some(())?;
        f.nth(1)?.parse().ok()
    })
}

fn print(r: &Rendezvous, cfg: &Config) {
    println!(
        "prog_id={} map_id={} loaded_now={} pin_dir={} cgroup={}",
        r.prog_id(),
        r.map_id(),
        r.loaded_by_this_open(),
        r.pin_dir().display(),
        r.cgroup().display()
    );
    match smc_bpf::access_of(&cfg.namespace_dir()) {
        Ok(a) => println!("usable without privileges by: {a}"),
        Err(e) => println!("access unknown: {e}"),
    }
    match smc_bpf::attached_programs(r.cgroup()) {
        Ok(ids) => {
            println!(
                "sock_ops programs attached to {}: {ids:?}",
                r.cgroup().display()
            );
            let yes = ids.contains(&r.prog_id());
            println!("attached: {}", if yes { "yes" } else { "no" });
        }
        Err(e) => println!("BPF_PROG_QUERY failed: {e}"),
    }
}

/// Exit code of `status` when nothing is installed (as an init script's
/// `status` for a service that is not running).
const NOT_INSTALLED: u8 = 3;

fn main() -> ExitCode {
    let mut cfg = Config::default();
    let mut cmd = None;
    let mut access = Access::Everyone;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--cgroup" => cfg.cgroup = args.next().map(PathBuf::from),
            "--namespace" => cfg.namespace = args.next().unwrap_or_default(),
            "--everyone" => access = Access::Everyone,
            "--root-only" => access = Access::Root,
            "--group" => {
                let name = args.next().unwrap_or_default();
                match group_id(&name) {
                    Some(g) => access = Access::Group(g),
                    None => {
                        eprintln!("smc-rendezvous: no group {name:?} in /etc/group");
                        return ExitCode::from(2);
                    }
                }
            }
            "status" | "install" | "uninstall" | "uninstall-stale" | "detach-orphans" => {
                cmd = Some(a)
            }
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let result: Result<(), RendezvousError> = match cmd.as_deref() {
        Some("status") => match Rendezvous::inspect(&cfg) {
            Ok(Some(r)) => {
                print(&r, &cfg);
                Ok(())
            }
            Ok(None) => {
                println!(
                    "not installed: no rendezvous of this build at {} (`smc-rendezvous install` installs it)",
                    cfg.pin_dir().display()
                );
                return ExitCode::from(NOT_INSTALLED);
            }
            Err(e) => Err(e),
        },
        Some("install") => smc_bpf::set_access(&cfg, access).map(|r| print(&r, &cfg)),
        Some("uninstall") => smc_bpf::uninstall(&cfg).map(|r| println!("{r:?}")),
        Some("detach-orphans") => {
            smc_bpf::detach_orphans(&cfg).map(|ids| println!("detached {ids:?}"))
        }
        Some("uninstall-stale") => {
            smc_bpf::uninstall_other_versions(&cfg).map(|r| println!("{r:?}"))
        }
        _ => {
            eprintln!("{USAGE}");
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
