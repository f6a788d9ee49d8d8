//! `smcss` — the SMC sockets of every process using smc-rs (from the live
//! registry, `smc::registry`), with smcss' options, columns and state names
//! (spec `tools.md` §2.2), a PID/Program column and `--json`.

use smc_tools::getopt::{self, Opt};
use smc_tools::view::{self, SsOpts};
use std::process::ExitCode;

const PROG: &str = "smcss";

const USAGE: &str = "Usage: smcss [ OPTIONS ]
\t-h, --help          this message
\t-v, --version       show version information
\t-a, --all           show all sockets
\t-l, --listening     show listening sockets
\t-d, --debug         show debug socket information
\t-W, --wide          do not truncate IP addresses
\t-D, --smcd          show detailed SMC-D information (shows only SMC-D sockets)
\t-R, --smcr          show detailed SMC-R information (shows only SMC-R sockets)
\t    --json          print the sockets as JSON
\tno OPTIONS          show all connected sockets
";

const fn opt(short: char, long: &'static str) -> Opt {
    Opt {
        short: Some(short),
        long,
        has_arg: false,
    }
}

const OPTS: &[Opt] = &[
    opt('h', "help"),
    opt('v', "version"),
    // (smc-tools before 1.6 spelled them -V and -e/--extended)
    opt('V', "Version"),
    opt('a', "all"),
    opt('l', "listening"),
    opt('d', "debug"),
    opt('e', "extended"),
    opt('W', "wide"),
    opt('D', "smcd"),
    opt('R', "smcr"),
    Opt {
        short: None,
        long: "json",
        has_arg: false,
    },
];

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("{msg}");
    eprint!("{USAGE}");
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let p = match getopt::parse(&args, OPTS) {
        Ok(p) => p,
        Err(e) => return usage_error(&format!("{PROG}: {e}")),
    };
    if p.has("help") {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if p.has("version") || p.has("Version") {
        println!("{PROG} utility, {}", smc_tools::version());
        return ExitCode::SUCCESS;
    }
    if let Some(extra) = p.positional.first() {
        return usage_error(&format!("{PROG}: unexpected argument '{extra}'"));
    }
    let o = SsOpts {
        all: p.has("all"),
        listening: p.has("listening"),
        debug: p.has("debug") || p.has("extended"),
        smcr: p.has("smcr"),
        smcd: p.has("smcd"),
        wide: p.has("wide"),
    };
    // smcss' rejected combinations, its messages
    let conflicts = [
        (
            o.smcr && o.smcd,
            "--smcd together with --smcr is not supported",
        ),
        (
            o.listening && o.debug,
            "--listening together with --debug is not supported",
        ),
        (
            o.listening && o.all,
            "--listening together with --all is not supported",
        ),
        (
            o.listening && o.smcr,
            "--listening together with --smcr is not supported",
        ),
        (
            o.listening && o.smcd,
            "--listening together with --smcd is not supported",
        ),
    ];
    if let Some((_, msg)) = conflicts.iter().find(|(c, _)| *c) {
        return usage_error(msg);
    }
    let procs = smc_tools::live_processes();
    if p.has("json") {
        println!(
            "{}",
            serde_json::Value::Array(view::smcss_sockets(&procs, &o))
        );
    } else {
        print!("{}", view::smcss(&procs, &o));
    }
    ExitCode::SUCCESS
}
