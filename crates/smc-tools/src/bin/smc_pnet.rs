//! `smc_pnet` — show and change the PNET table, with smc-tools' syntax, messages
//! and output (spec `tools.md` §2.3), plus `--json`.
//!
//! The table lives in `$SMC_RS_CONFIG_DIR/pnet.conf` (default `/etc/smc-rs`).

use serde_json::json;
use smc_config::pnet::{PnetEntry, PnetError, PnetId, PnetTable, PnetTarget};
use smc_config::store::{ConfigDir, Table, UpdateError};
use smc_tools::getopt::{self, Opt};
use std::process::ExitCode;

const PROG: &str = "smc_pnet";

const USAGE: &str = "Usage: smc_pnet [ OPTIONS ] [pnetid]
\t-h, --help            this message
\t-v, --version         show version information
\t-a, --add             add a pnetid entry, requires interface or ib/ism device
\t-d, --delete          delete a pnetid entry
\t-s, --show            show a pnetid entry
\t-f, --flush           flush the complete pnet table
\t-I, --interface       Ethernet interface name of a pnetid entry
\t-D, --ibdevice        Infiniband/ISM device name of a pnetid entry
\t-P, --ibport          Infiniband device port (default: 1)
\t    --json            print entries as JSON
\t
\tno OPTIONS            show complete pnet table
";

const OPTS: &[Opt] = &[
    Opt {
        short: Some('h'),
        long: "help",
        has_arg: false,
    },
    Opt {
        short: Some('v'),
        long: "version",
        has_arg: false,
    },
    Opt {
        short: Some('a'),
        long: "add",
        has_arg: false,
    },
    Opt {
        short: Some('d'),
        long: "delete",
        has_arg: false,
    },
    Opt {
        short: Some('s'),
        long: "show",
        has_arg: false,
    },
    Opt {
        short: Some('f'),
        long: "flush",
        has_arg: false,
    },
    Opt {
        short: Some('I'),
        long: "interface",
        has_arg: true,
    },
    Opt {
        short: Some('D'),
        long: "ibdevice",
        has_arg: true,
    },
    Opt {
        short: Some('P'),
        long: "ibport",
        has_arg: true,
    },
    Opt {
        short: None,
        long: "json",
        has_arg: false,
    },
];

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("{PROG}: {msg}");
    ExitCode::FAILURE
}

fn update_error(e: UpdateError<PnetError>) -> ExitCode {
    match e {
        UpdateError::Io(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            fail("Operation not permitted")
        }
        UpdateError::Io(e) => fail(e),
        UpdateError::Rejected(e) => fail(e),
    }
}

fn print(entries: &[&PnetEntry], json: bool) {
    if json {
        let v: Vec<_> = entries
            .iter()
            .map(|e| match &e.target {
                PnetTarget::Eth(i) => json!({"pnetid": e.pnetid.as_str(), "interface": i}),
                PnetTarget::Ib { device, port } => {
                    json!({"pnetid": e.pnetid.as_str(), "ibdevice": device, "ibport": port})
                }
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
    } else {
        for e in entries {
            println!("{}", e.smc_pnet_line());
        }
    }
}

fn main() -> ExitCode {
    let p = match getopt::parse_args_or_exit(PROG, USAGE, OPTS) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let json = p.has("json");
    let actions: Vec<&str> = ["add", "delete", "show", "flush"]
        .into_iter()
        .filter(|a| p.has(a))
        .collect();
    if actions.len() > 1 {
        return fail("only one of -a, -d, -s or -f may be given");
    }
    if p.positional.len() > 1 {
        return fail("too many parameters");
    }
    let pnetid_arg = p.positional.first().map(String::as_str);
    let interface = p.value("interface");
    let ibdevice = p.value("ibdevice");
    let ibport = match p.value("ibport") {
        None => 1u8,
        Some(s) => match smc_tools::strtoul0(s) {
            Some(0) => 1,
            Some(n @ 1..=2) => n as u8,
            _ => return fail(format!("invalid ib port:{s}")),
        },
    };
    let dir = ConfigDir::from_env();
    let pnetid = || -> Result<PnetId, ExitCode> {
        match pnetid_arg {
            Some(s) => PnetId::parse(s).map_err(fail),
            None => Err(fail("pnetid missing")),
        }
    };
    let warn_ignored = || {
        if let Some(i) = interface {
            eprintln!("{PROG}: interface {i} ignored");
        }
        if let Some(d) = ibdevice {
            eprintln!("{PROG}: device {d} ignored");
        }
        if p.has("ibport") {
            eprintln!("{PROG}: ibport {ibport} ignored");
        }
    };
    match actions.first().copied() {
        Some("add") => {
            let id = match pnetid() {
                Ok(id) => id,
                Err(c) => return c,
            };
            if interface.is_none() && ibdevice.is_none() {
                return fail("interface or device missing");
            }
            match PnetTable::modify(&dir, |t| {
                t.add(&id, interface, ibdevice.map(|d| (d, ibport)))
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => update_error(e),
            }
        }
        Some("delete") => {
            warn_ignored();
            let id = match pnetid() {
                Ok(id) => id,
                Err(c) => return c,
            };
            match PnetTable::modify(&dir, |t| t.delete(&id)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => update_error(e),
            }
        }
        Some("flush") => {
            if pnetid_arg.is_some() {
                return fail("-f takes no parameters");
            }
            match PnetTable::modify(&dir, |t| {
                t.flush();
                Ok(())
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => update_error(e),
            }
        }
        Some("show") | None => {
            if actions.is_empty() && (interface.is_some() || ibdevice.is_some()) {
                return fail("-I, -D and -P need -a");
            }
            if !actions.is_empty() {
                warn_ignored();
            }
            let table = match PnetTable::load(&dir) {
                Ok(t) => t,
                Err(e) => return fail(e),
            };
            match pnetid_arg {
                Some(_) if !actions.is_empty() => {
                    let id = match pnetid() {
                        Ok(id) => id,
                        Err(c) => return c,
                    };
                    match table.show(&id) {
                        Ok(rows) => {
                            print(&rows, json);
                            ExitCode::SUCCESS
                        }
                        Err(e) => fail(e),
                    }
                }
                Some(_) => fail("a pnetid needs -a, -d or -s"),
                None => {
                    print(&table.entries().iter().collect::<Vec<_>>(), json);
                    ExitCode::SUCCESS
                }
            }
        }
        Some(_) => fail("internal error: unknown action"),
    }
}
