//! `smc_run [-d] [-h] [-r SIZE] [-t SIZE] [-v] [-p PORTS] [-a DESTS] COMMAND
//! [ARGS]`: runs COMMAND
//! with its TCP sockets over SMC-R where both ends can (`tools.md` §2.1:
//! smc-tools' options, messages and exit codes). It preloads
//! `libsmc_preload.so` from this workspace, found next to this program (cargo
//! puts both in `target/<profile>/`, an install puts both in one place) or
//! named by `SMC_PRELOAD_LIB`, appended to any `LD_PRELOAD`.
#![forbid(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{exit, Command};

const USAGE: &str = "Usage: smc_run [ OPTIONS ] COMMAND

Run COMMAND using SMC for TCP sockets

   -d         enable debug mode
   -h         display this message
   -r <SIZE>  request receive buffer size in Bytes
   -t <SIZE>  request transmit buffer size in Bytes
   -v         display version info
   -p <PORTS> convert only connections to, and listeners on, these ports
              (e.g. 6379,8000-8100; sets SMC_RUN_PORTS)
   -a <DESTS> convert only connections to these addresses or prefixes
              (e.g. 10.0.0.0/8,fd00::/8; sets SMC_RUN_DESTS)

Other TCP sockets stay plain TCP. With -d (SMC_DEBUG) each connection
prints one line: SMC-R, or TCP and the reason.
";

// (the bin uses the parsers only)
#[allow(dead_code)]
#[path = "../select.rs"]
mod select;

const LIB: &str = "libsmc_preload.so";

fn fail(msg: &str) -> ! {
    eprintln!("smc_run: Error: {msg}");
    exit(1)
}

/// SIZE: digits with an optional single k/K/m/M suffix, in bytes.
fn size(s: &str) -> Option<u64> {
    let (digits, mult) = match s.as_bytes().last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 1u64 << 10),
        b'm' | b'M' => (&s[..s.len() - 1], 1u64 << 20),
        _ => (s, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(mult)
}

/// Raises `net.core.<name>` to `bytes` if it is smaller (a silent attempt
/// that needs root, as the script's `sysctl -w`).
fn raise_sysctl(name: &str, bytes: u64) {
    let path = format!("/proc/sys/net/core/{name}");
    let cur = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    if cur.is_some_and(|c| c < bytes) {
        let _ = std::fs::write(&path, bytes.to_string());
    }
}

/// The preload library: `SMC_PRELOAD_LIB`, else next to this program
/// (`cargo build`'s `target/<profile>/`), else in `deps/` below it, else in
/// `../lib/<multiarch>/` or `../lib/` (an install: `install.sh` puts
/// `bin/smc_run` and `lib/<multiarch>/libsmc_preload.so` under a prefix, as
/// Debian puts libraries in `/usr/lib/x86_64-linux-gnu/`).
fn library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SMC_PRELOAD_LIB") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    // (`cargo test` leaves the library in `deps/` only)
    [
        dir.join(LIB),
        dir.join("deps").join(LIB),
        dir.join("../lib").join(multiarch()).join(LIB),
        dir.join("../lib").join(LIB),
    ]
    .into_iter()
    // the newest, should an older build have left one behind
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(t, _)| *t)
    .map(|(_, p)| p)
}

/// Debian's multiarch directory name of this build (`x86_64-linux-gnu`).
fn multiarch() -> String {
    let arch = match std::env::consts::ARCH {
        "x86" => "i386",
        "powerpc64" => "powerpc64le",
        a => a,
    };
    format!("{arch}-linux-gnu")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut debug = false;
    let mut i = 0;
    // getopt "dhr:t:vp:a:", stopping at the first operand (the command)
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') || a.len() < 2 {
            break;
        }
        let flags: Vec<char> = a[1..].chars().collect();
        let mut k = 0;
        while k < flags.len() {
            match flags[k] {
                'd' => debug = true,
                'h' => {
                    print!("{USAGE}");
                    exit(0)
                }
                'v' => {
                    println!(
                        "smc_run utility, smc-tools-1.8.5 (smc-rs {})",
                        env!("CARGO_PKG_VERSION")
                    );
                    exit(0)
                }
                c @ ('r' | 't' | 'p' | 'a') => {
                    let rest: String = flags[k + 1..].iter().collect();
                    let val = if !rest.is_empty() {
                        rest
                    } else {
                        i += 1;
                        match args.get(i) {
                            Some(v) => v.clone(),
                            None => {
                                eprintln!("smc_run: option requires an argument -- '{c}'");
                                fail(&format!("Invalid option: -{c}"))
                            }
                        }
                    };
                    if c == 'p' || c == 'a' {
                        let (var, ok) = if c == 'p' {
                            ("SMC_RUN_PORTS", select::parse_ports(&val).map(|_| ()))
                        } else {
                            ("SMC_RUN_DESTS", select::parse_dests(&val).map(|_| ()))
                        };
                        if let Err(e) = ok {
                            fail(&e)
                        }
                        std::env::set_var(var, &val);
                        k = flags.len();
                        continue;
                    }
                    let Some(bytes) = size(&val) else {
                        eprintln!("Error: Invalid buffer size specified: '{val}'");
                        exit(1)
                    };
                    if c == 'r' {
                        raise_sysctl("rmem_max", bytes);
                        std::env::set_var("SMC_RCVBUF", bytes.to_string());
                    } else {
                        raise_sysctl("wmem_max", bytes);
                        std::env::set_var("SMC_SNDBUF", bytes.to_string());
                    }
                    k = flags.len();
                    continue;
                }
                c => fail(&format!("Invalid option: -{c}")),
            }
            k += 1;
        }
        i += 1;
    }
    let Some(cmd) = args.get(i) else {
        fail("Missing command parameter")
    };
    // (lists from the environment are checked as the options are)
    let ports = std::env::var("SMC_RUN_PORTS").ok();
    let dests = std::env::var("SMC_RUN_DESTS").ok();
    if let Err(e) = select::Select::from_env(ports.as_deref(), dests.as_deref()) {
        fail(&e)
    }
    std::env::set_var("SMC_DEBUG", if debug { "1" } else { "0" });
    let Some(lib) = library() else {
        fail(&format!(
            "cannot find {LIB} next to smc_run (build it with `cargo build -p smc-preload`, or set SMC_PRELOAD_LIB)"
        ))
    };
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{p}:{}", lib.display()),
        _ => lib.display().to_string(),
    };
    let err = Command::new(cmd)
        .args(&args[i + 1..])
        .env("LD_PRELOAD", preload)
        .exec();
    eprintln!("smc_run: {cmd}: {err}");
    exit(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}
