//! The environment the library reads: `SMC_DEBUG` lines, the `SMC_RUN_STATE`
//! file, `SMC_SNDBUF`/`SMC_RCVBUF`, and the selection of the addresses and
//! ports that use SMC-R (see [`crate::select`]).

use super::*;

pub(crate) fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("SMC_DEBUG").is_ok_and(|v| !v.is_empty() && !v.starts_with('0'))
    })
}

/// Says how a connection runs (stderr with `SMC_DEBUG`, the `SMC_RUN_STATE` file).
pub(crate) fn report(role: &str, s: &SmcStream) {
    let how = match s.mode() {
        Mode::SmcR => "SMC-R".to_string(),
        Mode::Tcp(f) => format!("TCP {:#010x} {f}", f.code()),
    };
    let addr = |a: io::Result<SocketAddr>| a.map_or_else(|_| "?".into(), |a| a.to_string());
    report_line(&format!(
        "{} {role} {} {} {how}",
        std::process::id(),
        addr(s.local_addr()),
        addr(s.peer_addr())
    ));
}

pub(crate) fn report_line(line: &str) {
    if debug() {
        eprintln!("libsmc-preload: {line}");
    }
    if let Some(Some(f)) = STATE_FILE.get() {
        use std::io::Write;
        // (one write of an O_APPEND file: lines of processes sharing it stay whole)
        let _ = (&*f).write_all(format!("{line}\n").as_bytes());
    }
}

/// The `SMC_RUN_STATE` file, opened when the library is loaded: a process
/// that drops privileges later (nginx's workers, as www-data) still writes
/// to the file its root parent could open, through the inherited
/// descriptor (close-on-exec, numbered as the library's own).
pub(crate) static STATE_FILE: OnceLock<Option<std::fs::File>> = OnceLock::new();

pub(crate) fn open_state_file() -> Option<std::fs::File> {
    let path = std::env::var_os("SMC_RUN_STATE")?;
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .ok()?;
    Some(dup_own(f.as_raw_fd()).map(std::fs::File::from).unwrap_or(f))
}

/// A size from `SMC_SNDBUF` / `SMC_RCVBUF`: digits, optional k/m suffix.
pub(crate) fn env_size(var: &str) -> Option<c_int> {
    let v = std::env::var(var).ok()?;
    let (d, m) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 1 << 10),
        b'm' | b'M' => (&v[..v.len() - 1], 1 << 20),
        _ => (&v[..], 1),
    };
    d.parse::<c_int>().ok()?.checked_mul(m)
}

/// `SMC_RUN_PORTS` and `SMC_RUN_DESTS` (see [`select`]), read once. Lists
/// the library cannot read convert nothing (`smc_run` refuses them before
/// the program starts).
pub(crate) fn selection() -> &'static select::Select {
    static S: OnceLock<select::Select> = OnceLock::new();
    S.get_or_init(|| {
        let var = |k| std::env::var(k).ok();
        let (p, d) = (var("SMC_RUN_PORTS"), var("SMC_RUN_DESTS"));
        select::Select::from_env(p.as_deref(), d.as_deref()).unwrap_or_else(|e| {
            eprintln!("libsmc-preload: {e}: no socket is converted");
            select::Select {
                ports: Some(Vec::new()),
                dests: None,
            }
        })
    })
}

/// Under `SMC_RUN_PORTS`/`SMC_RUN_DESTS`: whether `fd`, about to connect
/// or listen (`verdict`), is converted. It is opted in to the SMC option
/// now, before its SYN or SYN-ACK, if so (`Ok(opted)`); if not it leaves
/// the table and the kernel serves it (`Err(list that excluded it)`).
/// Without a limit the opt-in was made at `socket()`.
pub(crate) fn selected(
    fd: RawFd,
    opted: bool,
    verdict: Result<(), &'static str>,
) -> Result<bool, &'static str> {
    let r = selected_as_asked(fd, opted, verdict);
    if r == Ok(true) {
        crate::lifecycle::room_for_smc();
    }
    r
}

fn selected_as_asked(
    fd: RawFd,
    opted: bool,
    verdict: Result<(), &'static str>,
) -> Result<bool, &'static str> {
    if selection().is_all() {
        return Ok(opted);
    }
    match verdict {
        Ok(()) => Ok(smc::opt_in(borrow(fd))),
        Err(list) => {
            drop(remove(fd));
            Err(list)
        }
    }
}

/// The report of a socket left to the kernel by `SMC_RUN_PORTS`/`DESTS`.
pub(crate) fn report_unselected(role: &str, fd: RawFd, peer: Option<SocketAddr>, list: &str) {
    let local = rustix::net::getsockname(borrow(fd))
        .ok()
        .and_then(|a| SocketAddr::try_from(a).ok())
        .map_or_else(|| "?".into(), |a| a.to_string());
    let peer = peer.map_or_else(|| "-".into(), |a| a.to_string());
    report_line(&format!(
        "{} {role} {local} {peer} TCP (not selected by {list})",
        std::process::id()
    ));
}
