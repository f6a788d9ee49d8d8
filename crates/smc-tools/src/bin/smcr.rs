//! `smcr` — SMC-R administration in smc-tools' `ip`-style syntax (spec `tools.md`
//! §2.5): options before the object, any unambiguous prefix of a keyword accepted.
//! `info`, `linkgroup`, `device` and `stats` show what the processes using
//! smc-rs publish in the live registry (`smc::registry`); `stats reset`
//! resets the counters of all of them (and of those that exited); `ueid`
//! edits the UEID table.

use serde_json::json;
use smc_config::store::{ConfigDir, Table, UpdateError};
use smc_config::ueid::{parse_ueid, UeidError, UeidTable};
use smc_tools::view::{self, SmcrOpts};
use std::process::ExitCode;

const USAGE: &str = "Usage: smcr  [ OPTIONS ] OBJECT {COMMAND | help}
where  OBJECT := {info | linkgroup | device | stats | ueid}
       OPTIONS := {-v[ersion] | -d[etails] | -dd[etails] | -a[bsolute] | --json | --prometheus}
";

const LINKGROUP_USAGE: &str = "Usage: smcr linkgroup [show | link-show] [all | LG-ID]
                                   [ibdev <dev>]
                                   [netdev <dev>]
";

const DEVICE_USAGE: &str = "Usage: smcr device [show] [all]
                          [ibdev <dev>]
                          [netdev <dev>]
";

const INFO_USAGE: &str = "Usage: smcr info [show]
";

const STATS_USAGE: &str = "Usage: smcr stats [show | reset | json]
";

const UEID_USAGE: &str = "Usage: smcr ueid [show]
       smcr ueid add <eid>
       smcr ueid del <eid>
       smcr ueid flush
";

/// Exit status smc-tools uses for usage errors.
const USAGE_ERROR: u8 = 255;

#[derive(Default)]
struct Options {
    details: u8,
    absolute: bool,
    json: bool,
    prometheus: bool,
}

impl Options {
    fn view(&self) -> SmcrOpts {
        SmcrOpts {
            details: self.details,
            absolute: self.absolute,
        }
    }
}

/// First keyword of `words` (in priority order) that `arg` is a prefix of.
fn matches<'a>(arg: &str, words: &[&'a str]) -> Option<&'a str> {
    if arg.is_empty() {
        return None;
    }
    words.iter().copied().find(|w| w.starts_with(arg))
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("{msg}");
    ExitCode::from(USAGE_ERROR)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = Options::default();
    let mut rest = args.as_slice();
    while let Some((a, tail)) = rest.split_first() {
        if !a.starts_with('-') || a == "-" {
            break;
        }
        let name = a.trim_start_matches('-');
        match name {
            "dd" => opts.details = 2,
            "ad" | "da" => {
                opts.absolute = true;
                opts.details = opts.details.max(1);
            }
            "json" => opts.json = true,
            "prometheus" => opts.prometheus = true,
            "h" | "help" => {
                eprint!("{USAGE}");
                return ExitCode::from(USAGE_ERROR);
            }
            _ if !name.is_empty() && "version".starts_with(name) => {
                println!("smcr utility, {}", smc_tools::version());
                return ExitCode::SUCCESS;
            }
            _ if !name.is_empty() && "details".starts_with(name) => {
                opts.details = opts.details.max(1)
            }
            _ if !name.is_empty() && "absolute".starts_with(name) => opts.absolute = true,
            _ => {
                return usage_error(&format!(
                    "Error: Option \"{a}\" is unknown, try \"smcr help\"."
                ))
            }
        }
        rest = tail;
    }
    let Some((object, cmd)) = rest.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::from(USAGE_ERROR);
    };
    // (our own options, not smc-tools', are also taken after the object)
    let cmd: Vec<String> = cmd
        .iter()
        .filter(|a| match a.as_str() {
            "--json" => {
                opts.json = true;
                false
            }
            "--prometheus" => {
                opts.prometheus = true;
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    let cmd = cmd.as_slice();
    let objects = ["device", "linkgroup", "info", "stats", "ueid", "help"];
    match matches(object, &objects) {
        Some("ueid") => ueid(cmd, &opts),
        Some("info") => info(cmd, &opts),
        Some("linkgroup") => linkgroup(cmd, &opts),
        Some("device") => device(cmd, &opts),
        Some("stats") => stats(cmd, &opts),
        Some(_) => {
            eprint!("{USAGE}");
            ExitCode::from(USAGE_ERROR)
        }
        None if "seid".starts_with(object.as_str()) && !object.is_empty() => {
            usage_error("Error: Object \"seid\" is valid for SMC-D only, try \"smcr help\".")
        }
        None => usage_error(&format!(
            "Error: Object \"{object}\" is unknown, try \"smcr help\"."
        )),
    }
}

fn report(e: UpdateError<UeidError>) -> ExitCode {
    match e {
        UpdateError::Io(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!("Error: Operation not permitted");
        }
        UpdateError::Io(e) => eprintln!("Error: {e}"),
        UpdateError::Rejected(e) => eprintln!("Error: {e}"),
    }
    ExitCode::FAILURE
}

fn ueid(cmd: &[String], opts: &Options) -> ExitCode {
    let dir = ConfigDir::from_env();
    let words = ["show", "add", "del", "flush", "help"];
    let (sub, args) = match cmd.split_first() {
        None => ("show", &[][..]),
        Some((c, a)) => match matches(c, &words) {
            Some(w) => (w, a),
            None => {
                eprintln!("Error: Command \"{c}\" is unknown.");
                eprint!("{UEID_USAGE}");
                return ExitCode::from(USAGE_ERROR);
            }
        },
    };
    let one_arg = |args: &[String]| -> Option<String> {
        match args {
            [a] => Some(a.clone()),
            _ => None,
        }
    };
    match sub {
        "show" => {
            if !args.is_empty() {
                eprint!("{UEID_USAGE}");
                return ExitCode::from(USAGE_ERROR);
            }
            let table = match UeidTable::load(&dir) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("Error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if opts.json {
                let v: Vec<_> = table.eids().iter().map(|e| json!(e.to_string())).collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                for e in table.eids() {
                    println!("{e}");
                }
            }
            ExitCode::SUCCESS
        }
        "add" | "del" => {
            let Some(arg) = one_arg(args) else {
                eprint!("{UEID_USAGE}");
                return ExitCode::from(USAGE_ERROR);
            };
            let eid = match parse_ueid(&arg) {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("Error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let r = if sub == "add" {
                UeidTable::modify(&dir, |t| t.add(eid))
            } else {
                UeidTable::modify(&dir, |t| t.del(&eid))
            };
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => report(e),
            }
        }
        "flush" => match UeidTable::modify(&dir, |t| {
            t.flush();
            Ok(())
        }) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => report(e),
        },
        _ => {
            eprint!("{UEID_USAGE}");
            ExitCode::from(USAGE_ERROR)
        }
    }
}

fn command_usage(usage: &str) -> ExitCode {
    eprint!("{usage}");
    ExitCode::from(USAGE_ERROR)
}

fn info(cmd: &[String], opts: &Options) -> ExitCode {
    match cmd {
        [] => {}
        [c] if matches(c, &["show"]).is_some() => {}
        _ => return command_usage(INFO_USAGE),
    }
    let procs = smc_tools::live_processes();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    if opts.json {
        let text = view::info(&procs, &host);
        let mut m = serde_json::Map::new();
        for line in text.lines() {
            if let Some((k, v)) = line.split_once(':') {
                m.insert(k.trim().to_string(), json!(v.trim()));
            }
        }
        println!("{}", serde_json::Value::Object(m));
    } else {
        print!("{}", view::info(&procs, &host));
    }
    ExitCode::SUCCESS
}

/// `[all | LG-ID] [ibdev DEV] [netdev DEV]` (at most 4 words). `None`: bad syntax.
#[allow(clippy::type_complexity)]
fn selection(
    args: &[String],
    with_id: bool,
) -> Option<(Option<u32>, Option<String>, Option<String>)> {
    if args.len() > 4 {
        return None;
    }
    let (mut id, mut ibdev, mut netdev) = (None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "all" => {}
            "ibdev" => ibdev = Some(it.next()?.clone()),
            "netdev" => netdev = Some(it.next()?.clone()),
            x if with_id && id.is_none() => {
                let hex = x.trim_start_matches("0x").trim_start_matches("0X");
                id = Some(u32::from_str_radix(hex, 16).ok()?);
            }
            _ => return None,
        }
    }
    Some((id, ibdev, netdev))
}

fn linkgroup(cmd: &[String], opts: &Options) -> ExitCode {
    let (sub, args) = match cmd.split_first() {
        None => ("show", &[][..]),
        Some((c, a)) => match matches(c, &["show", "link-show", "help"]) {
            Some("help") => return command_usage(LINKGROUP_USAGE),
            Some(w) => (w, a),
            // (no sub-command: the selection follows at once)
            None => ("show", cmd),
        },
    };
    let Some((id, ibdev, netdev)) = selection(args, true) else {
        return command_usage(LINKGROUP_USAGE);
    };
    let procs = smc_tools::live_processes();
    if opts.json {
        let v: Vec<serde_json::Value> = procs
            .iter()
            .flat_map(|p| {
                p["link_groups"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|lg| id.is_none_or(|i| lg["id"].as_u64() == Some(u64::from(i & !0xff))))
                    .map(|mut lg| {
                        lg["pid"] = p["pid"].clone();
                        lg["comm"] = p["comm"].clone();
                        lg
                    })
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
        return ExitCode::SUCCESS;
    }
    if sub == "show" {
        print!("{}", view::linkgroup_show(&procs, &opts.view(), id));
    } else {
        print!(
            "{}",
            view::link_show(
                &procs,
                &opts.view(),
                id,
                ibdev.as_deref(),
                netdev.as_deref()
            )
        );
    }
    ExitCode::SUCCESS
}

fn device(cmd: &[String], opts: &Options) -> ExitCode {
    let args = match cmd.split_first() {
        None => &[][..],
        Some((c, a)) => match matches(c, &["show", "help"]) {
            Some("help") => return command_usage(DEVICE_USAGE),
            Some(_) => a,
            None => cmd,
        },
    };
    let Some((_, ibdev, netdev)) = selection(args, false) else {
        return command_usage(DEVICE_USAGE);
    };
    let procs = smc_tools::live_processes();
    if opts.json {
        let mut v: Vec<serde_json::Value> = Vec::new();
        for p in &procs {
            for d in p["devices"].as_array().cloned().unwrap_or_default() {
                if !v.iter().any(|x| x["ib_dev"] == d["ib_dev"]) {
                    v.push(d);
                }
            }
        }
        println!("{}", serde_json::Value::Array(v));
        return ExitCode::SUCCESS;
    }
    print!(
        "{}",
        view::device_show(
            &procs,
            &opts.view(),
            ibdev.as_deref(),
            netdev.as_deref(),
            std::path::Path::new("/sys/class/infiniband"),
        )
    );
    ExitCode::SUCCESS
}

fn stats(cmd: &[String], opts: &Options) -> ExitCode {
    let sub = match cmd {
        [] => "show",
        [c] => match matches(c, &["show", "reset", "json", "help"]) {
            Some("help") | None => return command_usage(STATS_USAGE),
            Some(w) => w,
        },
        _ => return command_usage(STATS_USAGE),
    };
    let dir = smc::registry::files::run_dir();
    let live = smc::registry::files::read(&dir, true);
    let procs: Vec<serde_json::Value> = live.iter().map(|e| e.json.clone()).collect();
    let gauges = view::gauges(&procs);
    // (Prometheus counters never go backwards: always absolute)
    let absolute = opts.absolute || opts.prometheus;
    let c = smc::registry::files::counters(&dir, &live, absolute);
    if opts.prometheus {
        print!("{}", view::prometheus(&c, gauges));
    } else if opts.json || sub == "json" {
        println!("{}", view::stats_json(&c, gauges, absolute));
    } else {
        print!("{}", view::stats(&c, gauges, &opts.view()));
    }
    if sub == "reset" {
        // smc-tools prints the values, then resets
        if let Err(e) = smc::registry::files::reset(&dir) {
            eprintln!("Error: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
