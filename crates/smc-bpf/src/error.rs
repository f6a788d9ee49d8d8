//! [`RendezvousError`]: why the SYN-option rendezvous is unavailable or failed.

use std::fmt;
use std::path::PathBuf;

/// Why the rendezvous cannot be used. Every variant's `Display` says what to do about it, and
/// [`RendezvousError::fallback_reason`] gives a short, distinct code for the TCP-fallback log.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The process lacks capabilities to load/attach BPF (`missing` lists them, from
    /// `/proc/self/status`), or the kernel answered `EPERM`/`EACCES` at step `op`.
    NoPrivilege {
        op: &'static str,
        missing: Vec<&'static str>,
        errno: Option<i32>,
    },
    /// The rendezvous is installed (or its bpffs is mounted) but the pins at `path` are not
    /// open to this user (`uid`): an administrator opens them with `smc-rendezvous install`
    /// (every user) or `smc-rendezvous install --group GROUP`.
    AccessDenied { path: PathBuf, uid: u32 },
    /// No cgroup v2 hierarchy was found, or the configured path is not a cgroup2 directory.
    NoCgroup2 {
        path: Option<PathBuf>,
        detail: String,
    },
    /// No BPF filesystem at `path` and it could not be mounted.
    NoBpffs { path: PathBuf, detail: String },
    /// The kernel lacks something the rendezvous needs (`bpf(2)`, LRU hash maps, the TCP header
    /// option helpers of Linux 5.10, ...).
    Unsupported { what: String, errno: i32 },
    /// The verifier refused the program; `log` is its level-1 log.
    VerifierRejected { errno: i32, log: String },
    /// An object pinned at `path` is not what this build expects.
    IncompatiblePin { path: PathBuf, detail: String },
    /// A file-system step (`mkdir`, `open`, lock) failed.
    Io {
        op: &'static str,
        path: PathBuf,
        errno: i32,
    },
    /// Another `bpf(2)` or socket step failed.
    Kernel { op: &'static str, errno: i32 },
    /// `opt_in`/`peer_offered_smc` on something that is not a TCP socket.
    NotTcpSocket,
    /// `opt_in` after `connect()`/`listen()`: the SYN has already been built. `state` is the
    /// kernel TCP state (`tcpi_state`).
    TooLate { state: u8 },
    /// The socket is opted in but its handshake has not completed (non-blocking connect still
    /// in progress).
    NotEstablished,
}

impl RendezvousError {
    /// A short, stable reason code for "fell back to TCP because ..." logs and statistics.
    pub fn fallback_reason(&self) -> &'static str {
        match self {
            RendezvousError::NoPrivilege { .. } => "rendezvous-no-privilege",
            RendezvousError::AccessDenied { .. } => "rendezvous-access-denied",
            RendezvousError::NoCgroup2 { .. } => "rendezvous-no-cgroup2",
            RendezvousError::NoBpffs { .. } => "rendezvous-no-bpffs",
            RendezvousError::Unsupported { .. } => "rendezvous-kernel-unsupported",
            RendezvousError::VerifierRejected { .. } => "rendezvous-verifier-rejected",
            RendezvousError::IncompatiblePin { .. } => "rendezvous-incompatible-pin",
            RendezvousError::Io { .. } => "rendezvous-io",
            RendezvousError::Kernel { .. } => "rendezvous-kernel-error",
            RendezvousError::NotTcpSocket => "rendezvous-not-tcp",
            RendezvousError::TooLate { .. } => "rendezvous-opt-in-too-late",
            RendezvousError::NotEstablished => "rendezvous-not-established",
        }
    }

    /// The errno behind the error, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RendezvousError::NoPrivilege { errno, .. } => *errno,
            RendezvousError::Unsupported { errno, .. }
            | RendezvousError::VerifierRejected { errno, .. }
            | RendezvousError::Io { errno, .. }
            | RendezvousError::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

fn errstr(errno: i32) -> String {
    std::io::Error::from_raw_os_error(errno).to_string()
}

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RendezvousError::NoPrivilege { op, missing, errno } => {
                write!(f, "SMC SYN-option rendezvous needs privileges to load a BPF program ({op}")?;
                if let Some(e) = errno {
                    write!(f, ": {}", errstr(*e))?;
                }
                write!(f, ")")?;
                if !missing.is_empty() {
                    write!(f, "; missing capabilities: {}", missing.join(", "))?;
                }
                write!(
                    f,
                    "; run as root or grant CAP_BPF and CAP_NET_ADMIN, or have an administrator install it once for every user with `smc-rendezvous install` (it stays pinned)"
                )
            }
            RendezvousError::AccessDenied { path, uid } => write!(
                f,
                "the SMC SYN-option rendezvous at {} is not installed or not open to this user (uid {uid}); an administrator opens it to every user with `smc-rendezvous install`, or to a group with `smc-rendezvous install --group GROUP`",
                path.display()
            ),
            RendezvousError::NoCgroup2 { path, detail } => {
                write!(f, "SMC SYN-option rendezvous needs a cgroup v2 hierarchy")?;
                if let Some(p) = path {
                    write!(f, " at {}", p.display())?;
                }
                write!(f, ": {detail}; mount one with `mount -t cgroup2 none /sys/fs/cgroup/unified` or configure the cgroup path")
            }
            RendezvousError::NoBpffs { path, detail } => write!(
                f,
                "SMC SYN-option rendezvous needs a BPF filesystem at {}: {detail}; mount it with `mount -t bpf bpf {}`",
                path.display(),
                path.display()
            ),
            RendezvousError::Unsupported { what, errno } => write!(
                f,
                "this kernel cannot run the SMC SYN-option rendezvous: {what} ({}); Linux >= 5.10 with CONFIG_BPF_SYSCALL and CONFIG_CGROUP_BPF is required",
                errstr(*errno)
            ),
            RendezvousError::VerifierRejected { errno, log } => write!(
                f,
                "the kernel verifier rejected the SMC rendezvous program ({}); verifier log:\n{log}",
                errstr(*errno)
            ),
            RendezvousError::IncompatiblePin { path, detail } => write!(
                f,
                "the BPF object pinned at {} is not the one this build expects ({detail}); remove it with smc_bpf::uninstall or `rm -r` of its directory",
                path.display()
            ),
            RendezvousError::Io { op, path, errno } => {
                write!(f, "SMC rendezvous: {op} {} failed: {}", path.display(), errstr(*errno))
            }
            RendezvousError::Kernel { op, errno } => write!(f, "SMC rendezvous: {op} failed: {}", errstr(*errno)),
            RendezvousError::NotTcpSocket => write!(f, "SMC rendezvous: not a TCP socket"),
            RendezvousError::TooLate { state } => write!(
                f,
                "SMC rendezvous: opt-in must happen before connect()/listen() (socket is in TCP state {state})"
            ),
            RendezvousError::NotEstablished => {
                write!(f, "SMC rendezvous: the TCP handshake of this socket has not completed yet")
            }
        }
    }
}

impl std::error::Error for RendezvousError {}
