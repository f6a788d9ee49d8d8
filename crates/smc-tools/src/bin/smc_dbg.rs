//! `smc_dbg` — everything an issue about smc-rs needs, in one report
//! (smc-tools' `smc_dbg`, spec `tools.md` §2.6): versions, the environment,
//! the live registry as `smcss` and `smcr` show it, the PNET and UEID
//! tables, the rendezvous and the RDMA devices. `-t` writes the sections as
//! files into `/tmp/smc_dbg-<pid>.tgz` instead.

use smc::registry::files;
use smc_config::pnet::PnetTable;
use smc_config::store::{ConfigDir, Table};
use smc_config::ueid::UeidTable;
use smc_tools::getopt::{self, Opt};
use smc_tools::view::{self, SmcrOpts, SsOpts};
use std::fmt::Write as _;
use std::process::ExitCode;

const PROG: &str = "smc_dbg";

const USAGE: &str = "Usage: smc_dbg [ OPTIONS ]

Collect debug information about smc-rs

   -h, --help     display this message
   -t, --tgz      write the report into /tmp/smc_dbg-<pid>.tgz
   -v, --version  display version info
";

const OPTS: &[Opt] = &[
    Opt {
        short: Some('h'),
        long: "help",
        has_arg: false,
    },
    Opt {
        short: Some('t'),
        long: "tgz",
        has_arg: false,
    },
    Opt {
        short: Some('v'),
        long: "version",
        has_arg: false,
    },
];

fn read(p: &str) -> String {
    std::fs::read_to_string(p).map_or_else(|e| format!("({e})"), |s| s.trim().to_string())
}

fn sections() -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    v.push((
        "version",
        format!(
            "{}\nkernel {}\nhost {}\n",
            smc_tools::version(),
            read("/proc/sys/kernel/osrelease"),
            read("/proc/sys/kernel/hostname")
        ),
    ));
    let mut env = String::new();
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("SMC_") || k == "XDG_RUNTIME_DIR")
        .collect();
    vars.sort();
    for (k, val) in vars {
        let _ = writeln!(env, "{k}={val}");
    }
    v.push(("environment", env));
    let procs = smc_tools::live_processes();
    let mut reg = format!("run directory {}\n", files::run_dir().display());
    for d in files::scan_dirs() {
        for p in files::read(&d, false) {
            let _ = writeln!(
                reg,
                "{}: pid {} ({}) uid {} smc-rs {}",
                d.display(),
                p.pid,
                p.json["comm"].as_str().unwrap_or(""),
                p.json["uid"],
                p.json["smc_rs"].as_str().unwrap_or("")
            );
            if let Some(errs) = p.json["errors"].as_object() {
                for (kind, msg) in errs {
                    let n = &p.json["counters"]["errors"][kind];
                    let _ = writeln!(
                        reg,
                        "  error {kind} ({n} times), last: {}",
                        msg.as_str().unwrap_or("")
                    );
                }
            }
        }
    }
    v.push(("registry", reg));
    let all_debug = SsOpts {
        all: true,
        debug: true,
        ..SsOpts::default()
    };
    v.push(("smcss --all --debug", view::smcss(&procs, &all_debug)));
    v.push((
        "smcss --smcr",
        view::smcss(
            &procs,
            &SsOpts {
                smcr: true,
                ..SsOpts::default()
            },
        ),
    ));
    let dir = ConfigDir::from_env();
    let pnet = match PnetTable::load(&dir) {
        Ok(t) => t
            .entries()
            .iter()
            .map(|e| e.smc_pnet_line() + "\n")
            .collect(),
        Err(e) => format!("(PNET table unreadable: {e})\n"),
    };
    v.push(("smc_pnet", pnet));
    let ueid = match UeidTable::load(&dir) {
        Ok(t) => t.eids().iter().map(|e| format!("{e}\n")).collect(),
        Err(e) => format!("(UEID table unreadable: {e})\n"),
    };
    v.push(("smcr ueid", ueid));
    let d = SmcrOpts {
        details: 1,
        absolute: false,
    };
    v.push((
        "smcr -d linkgroup link-show",
        view::link_show(&procs, &d, None, None, None),
    ));
    v.push(("smcr -d linkgroup", view::linkgroup_show(&procs, &d, None)));
    v.push((
        "smcr -d device",
        view::device_show(
            &procs,
            &d,
            None,
            None,
            std::path::Path::new("/sys/class/infiniband"),
        ),
    ));
    v.push((
        "smcr info",
        view::info(&procs, &read("/proc/sys/kernel/hostname")),
    ));
    let own = files::run_dir();
    let live = files::read(&own, false);
    let c = files::counters(&own, &live, false);
    v.push(("smcr -d stats", view::stats(&c, view::gauges(&procs), &d)));
    // (looked at, not installed: a report must not change the host)
    let cfg = smc_bpf::Config::default();
    let rdv = if cfg.pin_dir().exists() {
        format!(
            "installed by this build: pins under {}\n",
            cfg.pin_dir().display()
        )
    } else {
        let others: Vec<String> = std::fs::read_dir(cfg.namespace_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "not installed by this build ({} missing; other builds' pins: {:?}); the first smc-rs connection installs it\n",
            cfg.pin_dir().display(),
            others
        )
    };
    v.push(("rendezvous", rdv));
    let mut rdma = String::new();
    match std::fs::read_dir("/sys/class/infiniband") {
        Ok(rd) => {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            for n in names {
                let base = format!("/sys/class/infiniband/{n}");
                let _ = writeln!(
                    rdma,
                    "{n}: node_guid {} port 1 state {}",
                    read(&format!("{base}/node_guid")),
                    read(&format!("{base}/ports/1/state"))
                );
            }
        }
        Err(e) => {
            let _ = writeln!(rdma, "no RDMA devices ({e})");
        }
    }
    if let Ok(cfg) = std::env::var("SMC_RDMA_SHM_CONFIG") {
        let _ = writeln!(rdma, "shm devices ({cfg}):\n{}", read(&cfg));
    }
    v.push(("rdma devices", rdma));
    v
}

fn main() -> ExitCode {
    let p = match getopt::parse_args_or_exit(PROG, USAGE, OPTS) {
        Ok(p) => p,
        Err(code) => return code,
    };
    if !p.positional.is_empty() {
        eprint!("{USAGE}");
        return ExitCode::FAILURE;
    }
    let secs = sections();
    if !p.has("tgz") {
        for (title, body) in secs {
            println!("===== {title} =====");
            print!("{body}");
            if !body.ends_with('\n') && !body.is_empty() {
                println!();
            }
        }
        return ExitCode::SUCCESS;
    }
    let name = format!("smc_dbg-{}", std::process::id());
    let dir = std::env::temp_dir().join(&name);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        for (title, body) in &secs {
            let file: String = title
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            std::fs::write(dir.join(file), body)?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        eprintln!("{PROG}: {e}");
        return ExitCode::FAILURE;
    }
    let tgz = std::env::temp_dir().join(format!("{name}.tgz"));
    let st = std::process::Command::new("tar")
        .arg("czf")
        .arg(&tgz)
        .arg("-C")
        .arg(std::env::temp_dir())
        .arg(&name)
        .status();
    let _ = std::fs::remove_dir_all(&dir);
    match st {
        Ok(s) if s.success() => {
            println!("Debug output written to {}", tgz.display());
            ExitCode::SUCCESS
        }
        Ok(s) => {
            eprintln!("{PROG}: tar failed ({s})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{PROG}: cannot run tar: {e}");
            ExitCode::FAILURE
        }
    }
}
