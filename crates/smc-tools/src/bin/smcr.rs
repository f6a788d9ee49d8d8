//! `smcr` — SMC-R administration in smc-tools' `ip`-style syntax (spec `tools.md`
//! §2.5): options before the object, any unambiguous prefix of a keyword accepted.
//! Implemented objects: `ueid`. The others (`info`, `linkgroup`, `device`,
//! `stats`) need the socket library's state API and say so.

use serde_json::json;
use smc_config::store::{ConfigDir, Table, UpdateError};
use smc_config::ueid::{parse_ueid, UeidError, UeidTable};
use std::process::ExitCode;

const USAGE: &str = "Usage: smcr  [ OPTIONS ] OBJECT {COMMAND | help}
where  OBJECT := {info | linkgroup | device | stats | ueid}
       OPTIONS := {-v[ersion] | -d[etails] | -dd[etails] | -a[bsolute] | --json}
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
    let objects = ["device", "linkgroup", "info", "stats", "ueid", "help"];
    match matches(object, &objects) {
        Some("ueid") => ueid(cmd, &opts),
        Some("help") => {
            eprint!("{USAGE}");
            ExitCode::from(USAGE_ERROR)
        }
        Some(other) => {
            eprintln!(
                "Error: Object \"{other}\" needs the smc-rs socket library's state interface, \
                 which is not available yet."
            );
            ExitCode::FAILURE
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
