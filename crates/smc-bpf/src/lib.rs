//! SMC SYN-option rendezvous: make this library's TCP sockets carry the SMC experimental TCP
//! option (kind 254, length 6, ExID `0xE2D4C3D9`, bytes `fe 06 e2 d4 c3 d9`) on their SYN and
//! SYN-ACK exactly as Linux `AF_SMC` does, and tell each side whether its peer sent it.
//!
//! Plain sockets cannot add TCP options, so a cgroup `sock_ops` eBPF program does it. The
//! program is **assembled in Rust** ([`asm`], [`program`]) and loaded with raw `bpf(2)`
//! syscalls (the private `sys` module is the only one with `unsafe`): building needs nothing but the Rust
//! toolchain — no clang, libbpf, bpftool or aya.
//!
//! # Semantics (same as the kernel's AF_SMC)
//! * Only sockets that were [opted in](Rendezvous::opt_in) before `connect()`/`listen()` are
//!   touched. Every other socket on the host is left alone.
//! * An opted-in client puts the option on its SYN (and SYN retransmissions); after the
//!   handshake it knows whether the SYN-ACK carried it.
//! * An opted-in listener echoes the option on a SYN-ACK **only if the SYN carried it**; each
//!   accepted socket knows whether its SYN carried it. A listener that did not opt in sends no
//!   option and its accepted sockets report `false`.
//! * Nothing else (final ACK, data, FIN) carries the option: the program switches its header
//!   callbacks off once the connection is established.
//!
//! # Design
//! * **Map: `BPF_MAP_TYPE_LRU_HASH`, key = socket cookie (`u64`), value = `u32` flags.**
//!   User space gets the cookie with `getsockopt(SO_COOKIE)`, the program with
//!   `bpf_get_socket_cookie()`. This needs no BTF (an `SK_STORAGE` map would need a hand-made
//!   BTF blob and pointer-typed helper arguments), and cookies are never reused, so a stale
//!   entry can never be mistaken for a new socket. Accepted children are recognised by the
//!   `STATE_CB` callback flag they inherit from an opted-in listener. Entries never leak:
//!   the program deletes a socket's entry when it reaches `TCP_CLOSE` (this also covers
//!   crashed processes and resets), [`Rendezvous::forget`] deletes it on close, and LRU
//!   eviction (65 536 entries) is the backstop for sockets opted in but never used.
//! * **One shared instance per host.** The first process loads the map and program and pins
//!   them under `<bpffs>/smc-rs/v<N>-<fingerprint>/{cookies,prog}` (default bpffs
//!   `/sys/fs/bpf`, mounted if needed); later processes open the pins with `BPF_OBJ_GET`. The
//!   directory name contains a hash of the instruction stream and map geometry, so a process
//!   never reuses a program of another build. The program is attached with
//!   `BPF_PROG_ATTACH` + `BPF_F_ALLOW_MULTI` to the cgroup v2 root (or a configured cgroup),
//!   so it sees every process's sockets and coexists with other sock_ops programs. Attachment
//!   and pins outlive the processes on purpose; [`uninstall`] removes them.
//! * **Races and crashes.** Install and reuse happen under an exclusive `flock` on
//!   `<bpffs>/smc-rs` (released by the kernel if the holder dies). Order: pin the map, then
//!   load and pin the program (the pinned program is the commit marker), then attach unless
//!   `BPF_PROG_QUERY` shows it attached already (checking on every open also heals a manual
//!   detach). A process that dies mid-install leaves at most a pinned map without a program
//!   (or, if pins are wiped, an attached but unpinned program); the next installer removes the
//!   map and detaches such orphans ([`detach_orphans`]) before installing again.
//! * **Several builds at once** (an upgrade while old processes run): each build has its own
//!   pin directory, map and attached program, and each decides ownership from its own map (see
//!   [`program`]), so both keep working; only a SYN-ACK then carries 4 extra bytes of NOP
//!   padding (both reserve space, the kernel pads the unused reservation). [`uninstall_other_versions`] (or `smc-rendezvous uninstall-stale`) removes old
//!   builds once none of their processes is left.

//!
//! # Limits
//! * Needs `CAP_BPF` (or `CAP_SYS_ADMIN`) and `CAP_NET_ADMIN` to install (load, pin,
//!   attach). A process without them opens an installed instance if the pins' modes let it
//!   ([`Access`], set by `smc-rendezvous install`); else [`RendezvousError::NoPrivilege`] (not
//!   installed, with the missing capabilities) or [`RendezvousError::AccessDenied`].
//! * Opted-in listeners keep each accepted socket's SYN (`TCP_SAVE_SYN`, ~60–100 bytes) until
//!   the socket closes or user space reads `TCP_SAVED_SYN`. With SYN cookies there is no saved
//!   SYN, so the accepted socket reports `false` (the kernel's SMC also gives up then).
//! * A socket whose connection already reached `TCP_CLOSE` (reset) before
//!   [`Rendezvous::peer_offered_smc`] is asked reports `false`: its entry is gone.

#![deny(unsafe_code)]

pub mod asm;
mod error;
pub mod program;
mod sys;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use error::RendezvousError;

/// How long [`Rendezvous::shared`] keeps an error an administrator can cure before it tries
/// to open the rendezvous again.
pub const RETRY_AFTER: Duration = Duration::from_secs(2);

/// Version of the pin layout and map protocol; part of the pin directory name.
pub const LAYOUT_VERSION: u32 = 1;

const PROG_PIN: &str = "prog";
/// Kernel-visible program name (`bpf_prog_info.name`); identifies orphans.
pub const PROG_NAME: &str = "smc_rs_synopt";
const MAP_PIN: &str = "cookies";
const BPF_FS_MAGIC: u64 = 0xcafe_4a11;
const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;
const TCP_CLOSE: u8 = 7;

/// Where the shared instance lives and which cgroup it is attached to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Mount point of the BPF filesystem (default `/sys/fs/bpf`).
    pub bpffs: PathBuf,
    /// Directory under `bpffs` holding every version of our pins (default `smc-rs`).
    pub namespace: String,
    /// cgroup v2 directory to attach to; `None` = the root of the cgroup2 mount found in
    /// `/proc/self/mountinfo`, which covers every process on the host.
    pub cgroup: Option<PathBuf>,
    /// Mount a bpffs at `bpffs` if none is mounted there (default true).
    pub mount_bpffs: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            bpffs: PathBuf::from("/sys/fs/bpf"),
            namespace: "smc-rs".to_string(),
            cgroup: None,
            mount_bpffs: true,
        }
    }
}

impl Config {
    /// `<bpffs>/<namespace>`: the lock directory and parent of every version's pins.
    pub fn namespace_dir(&self) -> PathBuf {
        self.bpffs.join(&self.namespace)
    }

    /// `<bpffs>/<namespace>/v<LAYOUT_VERSION>-<fingerprint>`: this build's pins.
    pub fn pin_dir(&self) -> PathBuf {
        self.namespace_dir().join(instance_tag())
    }
}

/// Directory name of this build's pins.
pub fn instance_tag() -> String {
    format!("v{LAYOUT_VERSION}-{:016x}", program::fingerprint())
}

/// What the rendezvous knows about one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketStatus {
    /// Not opted in (nor accepted from an opted-in listener), or already closed and forgotten.
    Untracked,
    /// Opted in; the handshake has not completed.
    OptedIn,
    /// Handshake completed. `peer_smc`: the peer's SYN (`passive`) or SYN-ACK carried the
    /// option.
    Established { peer_smc: bool, passive: bool },
}

/// Handle to the shared, attached rendezvous program and its map.
#[derive(Debug)]
pub struct Rendezvous {
    map: sys::CookieMap,
    prog: OwnedFd,
    prog_id: u32,
    map_id: u32,
    pin_dir: PathBuf,
    cgroup: PathBuf,
    loaded_here: bool,
}

impl Rendezvous {
    /// Opens the host-wide instance with the default [`Config`]: loads, pins and attaches the
    /// program if no process did yet, else reuses the pinned one.
    pub fn open() -> Result<Rendezvous, RendezvousError> {
        Rendezvous::open_with(&Config::default())
    }

    /// A process-wide instance opened once with the default config. An error is kept too, so
    /// that a socket layer can log it once and fall back to TCP cheaply for later sockets; the
    /// errors an administrator can cure while the process runs (`NoPrivilege`: not installed
    /// yet; `AccessDenied`: not open to this user yet) are kept for [`RETRY_AFTER`] only, then
    /// the open is tried again, so a long-running program gets the rendezvous for the sockets
    /// it makes after `smc-rendezvous install`.
    pub fn shared() -> Result<&'static Rendezvous, RendezvousError> {
        static SHARED: OnceLock<Rendezvous> = OnceLock::new();
        static LAST_ERR: Mutex<Option<(Instant, RendezvousError)>> = Mutex::new(None);
        if let Some(r) = SHARED.get() {
            return Ok(r);
        }
        let mut last = LAST_ERR.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = SHARED.get() {
            return Ok(r);
        }
        if let Some((at, e)) = last.as_ref() {
            let curable = matches!(
                e,
                RendezvousError::NoPrivilege { .. } | RendezvousError::AccessDenied { .. }
            );
            if !curable || at.elapsed() < RETRY_AFTER {
                return Err(e.clone());
            }
        }
        match Rendezvous::open() {
            Ok(r) => {
                *last = None;
                Ok(SHARED.get_or_init(|| r))
            }
            Err(e) => {
                *last = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// [`Rendezvous::open`] with an explicit configuration.
    ///
    /// A process without `CAP_BPF`/`CAP_NET_ADMIN` cannot install or attach anything; it
    /// opens the installed instance's pins instead, as far as their file modes let it (see
    /// [`Access`] and [`set_access`]), and gets [`RendezvousError::NoPrivilege`] if nothing is
    /// installed, [`RendezvousError::AccessDenied`] if the pins are not open to it.
    ///
    /// A process with the capabilities but not root's files (a service granted `CAP_BPF` and
    /// `CAP_NET_ADMIN` under its own uid) that is refused on the way uses the installed
    /// instance the same way.
    pub fn open_with(cfg: &Config) -> Result<Rendezvous, RendezvousError> {
        let missing = missing_capabilities();
        if !missing.is_empty() {
            return open_installed(cfg, missing);
        }
        match Rendezvous::open_privileged(cfg) {
            Err(e @ RendezvousError::NoPrivilege { .. }) => open_installed(cfg, Vec::new())
                .map_err(|second| match second {
                    // installed but not open to us: say that, it is what to act on
                    RendezvousError::AccessDenied { .. } => second,
                    _ => e,
                }),
            r => r,
        }
    }

    /// The installed instance of `cfg`'s namespace, opened read-only, as it is: nothing is
    /// loaded, pinned or attached (what `smc-rendezvous status` shows). `None` if this build's
    /// instance is not installed; [`RendezvousError::AccessDenied`] if its pins are not open
    /// to this process.
    pub fn inspect(cfg: &Config) -> Result<Option<Rendezvous>, RendezvousError> {
        match open_installed(cfg, Vec::new()) {
            // (its only `NoPrivilege`: nothing installed)
            Err(RendezvousError::NoPrivilege { .. }) => Ok(None),
            r => r.map(Some),
        }
    }

    /// Install or reuse, attach if needed: the path of a process with the capabilities.
    fn open_privileged(cfg: &Config) -> Result<Rendezvous, RendezvousError> {
        let cgroup = resolve_cgroup(cfg)?;
        let cgroup_dir = open_cgroup(&cgroup)?;
        ensure_bpffs(&cfg.bpffs, cfg.mount_bpffs)?;
        let _lock = lock_namespace(&cfg.namespace_dir())?;

        let pin_dir = cfg.pin_dir();
        let prog_pin = pin_dir.join(PROG_PIN);
        let map_pin = pin_dir.join(MAP_PIN);
        let (map, prog, loaded_here) = if exists(&prog_pin) {
            let (map, prog) = open_pinned(&map_pin, &prog_pin, 0)?;
            (map, prog, false)
        } else {
            // A fresh install is the moment to drop programs whose pins were lost (bpffs
            // unmounted or wiped while they stayed attached): nobody can reach their maps.
            let _ = detach_orphans_locked(cfg, cgroup_dir.as_fd());
            let (map, prog) = install(&pin_dir, &map_pin, &prog_pin)?;
            // A new build's pins get the access the administrator gave the namespace.
            let access = access_of(&cfg.namespace_dir())?;
            apply_access_to_version(&pin_dir, access)?;
            (map, prog, true)
        };
        let prog_id = sys::prog_info(prog.as_fd())
            .map_err(|e| kerr("BPF_OBJ_GET_INFO_BY_FD (prog)", e))?
            .id;
        // Attach unless already attached (the kernel refuses a second multi-attach of the same
        // program with EINVAL). Doing this on every open heals a manual detach.
        let attached = sys::prog_query(cgroup_dir.as_fd(), sys::ATTACH_CGROUP_SOCK_OPS)
            .map_err(|e| kerr("BPF_PROG_QUERY on the cgroup", e))?;
        if !attached.contains(&prog_id) {
            sys::prog_attach(
                cgroup_dir.as_fd(),
                prog.as_fd(),
                sys::ATTACH_CGROUP_SOCK_OPS,
                sys::F_ALLOW_MULTI,
            )
            .map_err(|e| kerr("BPF_PROG_ATTACH to the cgroup", e))?;
        }
        let map_id = sys::map_info(map.as_fd())
            .map_err(|e| kerr("BPF_OBJ_GET_INFO_BY_FD (map)", e))?
            .id;
        Ok(Rendezvous {
            map,
            prog,
            prog_id,
            map_id,
            pin_dir,
            cgroup,
            loaded_here,
        })
    }

    /// Opts a fresh TCP socket in: its SYN (client) or its SYN-ACKs (listener, when the SYN
    /// offered SMC) will carry the option. Must be called before `connect()`/`listen()`.
    pub fn opt_in(&self, fd: BorrowedFd<'_>) -> Result<(), RendezvousError> {
        check_tcp(fd)?;
        let state = sys::tcp_state(fd).map_err(|e| kerr("getsockopt(TCP_INFO)", e))?;
        if state != TCP_CLOSE {
            return Err(RendezvousError::TooLate { state });
        }
        self.opt_in_new(fd)
    }

    /// [`Self::opt_in`] for a socket the caller has just created itself with
    /// `socket(AF_INET[6], SOCK_STREAM, 0)`: TCP, not yet connected, so the type
    /// and state checks are skipped (a connection's setup pays one `getsockopt` for
    /// its cookie and the map update, not five system calls).
    pub fn opt_in_new(&self, fd: BorrowedFd<'_>) -> Result<(), RendezvousError> {
        self.opt_in_new_cookie(fd).map(drop)
    }

    /// [`Self::opt_in_new`], returning the socket's cookie: a socket keeps its
    /// cookie for life, so the caller can look its entry up after `connect()`
    /// ([`Self::take_peer_offered_smc_by_cookie`]) without reading it again.
    pub fn opt_in_new_cookie(&self, fd: BorrowedFd<'_>) -> Result<u64, RendezvousError> {
        let cookie = socket_cookie(fd)?;
        self.map
            .update(cookie, program::VAL_WANT, 0)
            .map_err(|e| kerr("BPF_MAP_UPDATE_ELEM (opt in)", e))?;
        Ok(cookie)
    }

    /// [`Self::peer_offered_smc`] then [`Self::forget`], with one cookie read and
    /// no socket type check: a socket that is no TCP socket has no entry
    /// (`Ok(false)`), and one that is not a socket fails the cookie read.
    pub fn take_peer_offered_smc(&self, fd: BorrowedFd<'_>) -> Result<bool, RendezvousError> {
        self.take_peer_offered_smc_by_cookie(socket_cookie(fd)?)
    }

    /// [`Self::take_peer_offered_smc`] by the socket's cookie (see
    /// [`Self::opt_in_new_cookie`]).
    pub fn take_peer_offered_smc_by_cookie(&self, cookie: u64) -> Result<bool, RendezvousError> {
        let v = self
            .map
            .lookup_and_delete(cookie)
            .map_err(|e| kerr("BPF_MAP_LOOKUP_AND_DELETE_ELEM", e))?;
        offered(status_of(v))
    }

    /// After `connect()` returned (client) or `accept()` (server): did the peer offer SMC?
    /// `Ok(false)` for sockets that were not opted in (or whose listener was not).
    pub fn peer_offered_smc(&self, fd: BorrowedFd<'_>) -> Result<bool, RendezvousError> {
        offered(self.status(fd)?)
    }

    /// What the program recorded for this socket.
    pub fn status(&self, fd: BorrowedFd<'_>) -> Result<SocketStatus, RendezvousError> {
        check_tcp(fd)?;
        self.status_by_cookie(socket_cookie(fd)?)
    }

    /// [`Rendezvous::status`] by socket cookie (see [`socket_cookie`]); works after close.
    pub fn status_by_cookie(&self, cookie: u64) -> Result<SocketStatus, RendezvousError> {
        let v = self
            .map
            .lookup(cookie)
            .map_err(|e| kerr("BPF_MAP_LOOKUP_ELEM", e))?;
        Ok(status_of(v))
    }

    /// Takes the socket's entry for this caller alone: `Ok(true)` if this call
    /// removed it, `Ok(false)` if it was gone already (another process sharing
    /// the socket took it first, or the connection closed and the program
    /// removed it). For a connection accepted in one process and used in
    /// another (a fork): the map's delete is the arbiter, so of several
    /// processes racing for one socket exactly one gets `true`, and runs the
    /// CLC handshake on it. Look at [`Rendezvous::peer_offered_smc`] first.
    pub fn claim(&self, fd: BorrowedFd<'_>) -> Result<bool, RendezvousError> {
        let cookie = socket_cookie(fd)?;
        self.map
            .delete(cookie)
            .map_err(|e| kerr("BPF_MAP_DELETE_ELEM", e))
    }

    /// Takes the SMC option away from a listening socket that was opted in: its SYN-ACKs
    /// carry no option from now on and the connections it accepts from now on report
    /// `peer_smc: false`, so every new client falls back to plain TCP (a program that will not
    /// run the CLC handshake, e.g. after an exec that drops the library, must not be offered
    /// SMC). Covers every listener on the socket's port and family in its network namespace (see
    /// [`program::listen_key`]). Returns whether the socket was opted in; undone by
    /// [`Rendezvous::opt_in_listener_again`]. Connections whose SYN-ACK left before the call
    /// are not changed: their clients were offered SMC.
    pub fn opt_out_listener(&self, fd: BorrowedFd<'_>) -> Result<bool, RendezvousError> {
        let (cookie, key) = self.listener_keys(fd)?;
        if !matches!(self.status_by_cookie(cookie)?, SocketStatus::OptedIn) {
            // (not ours: another listener of the port keeps its key)
            return Ok(false);
        }
        self.map
            .update(key, program::VAL_OPTED_OUT, 0)
            .map_err(|e| kerr("BPF_MAP_UPDATE_ELEM (opt out)", e))?;
        let _ = self.map.delete(cookie);
        Ok(true)
    }

    /// Undoes [`Rendezvous::opt_out_listener`] (an exec that failed): the listener offers SMC
    /// again.
    pub fn opt_in_listener_again(&self, fd: BorrowedFd<'_>) -> Result<(), RendezvousError> {
        let (cookie, key) = self.listener_keys(fd)?;
        self.map
            .update(cookie, program::VAL_WANT, 0)
            .and_then(|()| self.map.update(key, program::VAL_WANT, 0))
            .map_err(|e| kerr("BPF_MAP_UPDATE_ELEM (listener)", e))
    }

    /// A listening socket's cookie and port key.
    fn listener_keys(&self, fd: BorrowedFd<'_>) -> Result<(u64, u64), RendezvousError> {
        check_tcp(fd)?;
        let cookie = socket_cookie(fd)?;
        let netns = sys::netns_cookie(fd).map_err(|e| kerr("getsockopt(SO_NETNS_COOKIE)", e))?;
        let (family, port) = sys::local_port(fd).map_err(|e| kerr("getsockname", e))?;
        Ok((cookie, program::listen_key(netns, family, port)))
    }

    /// Drops the socket's entry (call before closing it). Never fails: an entry that is
    /// already gone (the program removes it at `TCP_CLOSE`) is fine.
    pub fn forget(&self, fd: BorrowedFd<'_>) {
        if let Ok(cookie) = sys::socket_cookie(fd) {
            let _ = self.map.delete(cookie);
        }
    }

    /// Kernel id of the attached program (same in every process sharing the instance).
    pub fn prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Kernel id of the cookie map.
    pub fn map_id(&self) -> u32 {
        self.map_id
    }

    /// Whether this `open` loaded the program (false: reused the pinned instance).
    pub fn loaded_by_this_open(&self) -> bool {
        self.loaded_here
    }

    /// Where the program and map are pinned.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// The cgroup v2 directory the program is attached to.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// The program fd (e.g. for `BPF_PROG_QUERY` comparisons).
    pub fn prog_fd(&self) -> BorrowedFd<'_> {
        self.prog.as_fd()
    }
}

/// `getsockopt(SO_COOKIE)`: the key the program uses for this socket.
pub fn socket_cookie(fd: BorrowedFd<'_>) -> Result<u64, RendezvousError> {
    sys::socket_cookie(fd).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTSOCK) => RendezvousError::NotTcpSocket,
        _ => kerr("getsockopt(SO_COOKIE)", e),
    })
}

/// Ids of the sock_ops programs attached directly to a cgroup v2 directory.
pub fn attached_programs(cgroup: &Path) -> Result<Vec<u32>, RendezvousError> {
    let dir = open_cgroup(cgroup)?;
    sys::prog_query(dir.as_fd(), sys::ATTACH_CGROUP_SOCK_OPS).map_err(|e| kerr("BPF_PROG_QUERY", e))
}

/// Detaches, from the configured cgroup, every attached program named [`PROG_NAME`] that is
/// not pinned as `<bpffs>/<any namespace>/<any version>/prog`: instances whose pins were lost
/// (bpffs unmounted or wiped) while they stayed attached. Returns their ids.
pub fn detach_orphans(cfg: &Config) -> Result<Vec<u32>, RendezvousError> {
    let cgroup = resolve_cgroup(cfg)?;
    let cgroup_dir = open_cgroup(&cgroup)?;
    ensure_bpffs(&cfg.bpffs, cfg.mount_bpffs)?;
    let _lock = lock_namespace(&cfg.namespace_dir())?;
    detach_orphans_locked(cfg, cgroup_dir.as_fd())
}

fn detach_orphans_locked(
    cfg: &Config,
    cgroup: BorrowedFd<'_>,
) -> Result<Vec<u32>, RendezvousError> {
    let attached = sys::prog_query(cgroup, sys::ATTACH_CGROUP_SOCK_OPS)
        .map_err(|e| kerr("BPF_PROG_QUERY", e))?;
    let mut pinned = Vec::new();
    for ns in std::fs::read_dir(&cfg.bpffs)
        .into_iter()
        .flatten()
        .flatten()
    {
        for ver in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            let pin = ver.path().join(PROG_PIN);
            if let Ok(fd) = sys::obj_get(&pin) {
                if let Ok(info) = sys::prog_info(fd.as_fd()) {
                    pinned.push(info.id);
                }
            }
        }
    }
    let mut detached = Vec::new();
    for id in attached {
        if pinned.contains(&id) {
            continue;
        }
        let Ok(fd) = sys::prog_fd_by_id(id) else {
            continue;
        };
        let Ok(info) = sys::prog_info(fd.as_fd()) else {
            continue;
        };
        if info.name() != PROG_NAME.as_bytes() {
            continue;
        }
        match sys::prog_detach(cgroup, fd.as_fd(), sys::ATTACH_CGROUP_SOCK_OPS) {
            Ok(()) => detached.push(id),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(kerr("BPF_PROG_DETACH (orphan)", e)),
        }
    }
    Ok(detached)
}

/// What [`uninstall`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UninstallReport {
    /// Pin directories removed (every version found under the namespace).
    pub removed: Vec<PathBuf>,
    /// How many of their programs were detached from the configured cgroup.
    pub detached: usize,
}

/// Detaches every version of the program from the configured cgroup and removes all pins and
/// the namespace directory. For tests and tools; processes still holding a [`Rendezvous`]
/// keep their fds, but their new sockets no longer get the option.
pub fn uninstall(cfg: &Config) -> Result<UninstallReport, RendezvousError> {
    remove_versions(cfg, None)
}

/// Like [`uninstall`], but keeps this build's instance: removes the programs of other
/// (older or newer) builds, e.g. after an upgrade once no process of the old build is left.
/// While two builds are attached, both act on opted-in sockets (see the crate docs).
pub fn uninstall_other_versions(cfg: &Config) -> Result<UninstallReport, RendezvousError> {
    remove_versions(cfg, Some(&instance_tag()))
}

fn remove_versions(cfg: &Config, keep: Option<&str>) -> Result<UninstallReport, RendezvousError> {
    let ns = cfg.namespace_dir();
    let mut report = UninstallReport::default();
    if !exists(&ns) {
        return Ok(report);
    }
    let cgroup = resolve_cgroup(cfg)?;
    let cgroup_dir = open_cgroup(&cgroup)?;
    let lock = lock_namespace(&ns)?;
    let entries = std::fs::read_dir(&ns).map_err(|e| ioerr("read_dir", &ns, e))?;
    for entry in entries.flatten() {
        let dir = entry.path();
        if keep.is_some_and(|k| entry.file_name() == k) {
            continue;
        }
        let prog_pin = dir.join(PROG_PIN);
        if let Ok(prog) = sys::obj_get(&prog_pin) {
            match sys::prog_detach(
                cgroup_dir.as_fd(),
                prog.as_fd(),
                sys::ATTACH_CGROUP_SOCK_OPS,
            ) {
                Ok(()) => report.detached += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(kerr("BPF_PROG_DETACH", e)),
            }
        }
        for pin in [PROG_PIN, MAP_PIN] {
            let p = dir.join(pin);
            if exists(&p) {
                std::fs::remove_file(&p).map_err(|e| ioerr("unlink", &p, e))?;
            }
        }
        std::fs::remove_dir(&dir).map_err(|e| ioerr("rmdir", &dir, e))?;
        report.removed.push(dir);
    }
    if keep.is_none() {
        // Openers blocked on the lock notice the unlinked directory and retry.
        std::fs::remove_dir(&ns).map_err(|e| ioerr("rmdir", &ns, e))?;
    }
    drop(lock);
    Ok(report)
}

/// Who may use an installed rendezvous without `CAP_BPF`/`CAP_NET_ADMIN`.
///
/// Using it means opening the pinned map read-write (`BPF_OBJ_GET`, for which the kernel
/// checks the pin's file mode as `open(2)` would: kernel/bpf/inode.c `bpf_obj_do_get`) and
/// the pinned program read-only, then looking up, updating and deleting map entries through
/// that fd, which needs no capability (kernel/bpf/syscall.c `map_update_elem` checks only
/// that the fd was opened for writing; `kernel.unprivileged_bpf_disabled` gates map and
/// program *creation*, not this). Nobody without the capabilities can load, attach or
/// detach anything. The access is kept in the modes of `<bpffs>/<namespace>`, so a build
/// installed later (an upgrade) gets the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only root (pins 0600, directories 0700): what a process that installs the rendezvous
    /// on its own leaves behind.
    Root,
    /// Root and the members of this group (pins 0660/0640 and directories 0750, group-owned).
    Group(u32),
    /// Every user of the host, as the kernel's AF_SMC (pins 0666/0644, directories 0755).
    Everyone,
}

impl Access {
    /// (directory mode, map pin mode, program pin mode, group) for this access.
    fn modes(self) -> (u32, u32, u32, u32) {
        match self {
            Access::Root => (0o700, 0o600, 0o600, 0),
            Access::Group(g) => (0o750, 0o660, 0o640, g),
            Access::Everyone => (0o755, 0o666, 0o644, 0),
        }
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Access::Root => write!(f, "root only"),
            Access::Group(g) => write!(f, "root and group {g}"),
            Access::Everyone => write!(f, "every user"),
        }
    }
}

/// The access the namespace directory's modes grant (see [`Access`]).
pub fn access_of(namespace_dir: &Path) -> Result<Access, RendezvousError> {
    let m = std::fs::metadata(namespace_dir).map_err(|e| ioerr("stat", namespace_dir, e))?;
    let mode = m.mode();
    Ok(if mode & 0o005 == 0o005 {
        Access::Everyone
    } else if mode & 0o050 == 0o050 {
        Access::Group(m.gid())
    } else {
        Access::Root
    })
}

/// Installs the rendezvous if needed (as [`Rendezvous::open_with`]) and sets who may use it
/// without privileges: the modes and group of `<bpffs>/<namespace>`, of every version's
/// directory and pins, and, unless `access` is [`Access::Root`], the search bit for others
/// on the bpffs mount point (bpffs is commonly mounted 0700; a search bit lets a process
/// reach pins whose names it knows, listing stays root's). Needs root.
pub fn set_access(cfg: &Config, access: Access) -> Result<Rendezvous, RendezvousError> {
    let r = Rendezvous::open_with(cfg)?;
    let ns = cfg.namespace_dir();
    let _lock = lock_namespace(&ns)?;
    let (dir_mode, _, _, gid) = access.modes();
    chmod_chown(&ns, dir_mode, gid)?;
    for entry in std::fs::read_dir(&ns)
        .map_err(|e| ioerr("read_dir", &ns, e))?
        .flatten()
    {
        apply_access_to_version(&entry.path(), access)?;
    }
    if access != Access::Root {
        let m = std::fs::metadata(&cfg.bpffs).map_err(|e| ioerr("stat", &cfg.bpffs, e))?;
        // Others' search bit: the mount point's group is not the access group.
        if m.mode() & 0o001 == 0 {
            let mode = (m.mode() & 0o7777) | 0o001;
            std::fs::set_permissions(&cfg.bpffs, std::fs::Permissions::from_mode(mode))
                .map_err(|e| ioerr("chmod", &cfg.bpffs, e))?;
        }
    }
    Ok(r)
}

/// Gives one version's directory and pins the modes of `access`.
fn apply_access_to_version(dir: &Path, access: Access) -> Result<(), RendezvousError> {
    let (dir_mode, map_mode, prog_mode, gid) = access.modes();
    chmod_chown(dir, dir_mode, gid)?;
    for (pin, mode) in [(MAP_PIN, map_mode), (PROG_PIN, prog_mode)] {
        let p = dir.join(pin);
        if exists(&p) {
            chmod_chown(&p, mode, gid)?;
        }
    }
    Ok(())
}

fn chmod_chown(p: &Path, mode: u32, gid: u32) -> Result<(), RendezvousError> {
    std::os::unix::fs::chown(p, None, Some(gid)).map_err(|e| ioerr("chown", p, e))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| ioerr("chmod", p, e))
}

/// The unprivileged open: the installed instance's pins, as far as their modes allow. Takes
/// no lock (the namespace directory may not be readable): the program pin is the commit
/// marker of an install, and the map is pinned before it.
fn open_installed(cfg: &Config, missing: Vec<&'static str>) -> Result<Rendezvous, RendezvousError> {
    let cgroup = resolve_cgroup(cfg)?;
    let not_installed = |missing: Vec<&'static str>| RendezvousError::NoPrivilege {
        op: "install (the rendezvous is not installed)",
        missing,
        errno: None,
    };
    if !sys::fs_magic(&cfg.bpffs).is_ok_and(|m| m == BPF_FS_MAGIC) {
        return Err(not_installed(missing));
    }
    let pin_dir = cfg.pin_dir();
    let prog_pin = pin_dir.join(PROG_PIN);
    let map_pin = pin_dir.join(MAP_PIN);
    let denied = || RendezvousError::AccessDenied {
        path: pin_dir.clone(),
        uid: sys::euid(),
    };
    // Told apart before the real opens so that their errors stay the kernel's.
    if let Err(e) = std::fs::symlink_metadata(&prog_pin) {
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => not_installed(missing),
            _ => denied(),
        });
    }
    let (map, prog) = match open_pinned(&map_pin, &prog_pin, sys::F_RDONLY) {
        Ok(x) => x,
        Err(RendezvousError::NoPrivilege { .. }) => return Err(denied()),
        Err(e) => return Err(e),
    };
    let prog_id = sys::prog_info(prog.as_fd())
        .map_err(|e| kerr("BPF_OBJ_GET_INFO_BY_FD (prog)", e))?
        .id;
    let map_id = sys::map_info(map.as_fd())
        .map_err(|e| kerr("BPF_OBJ_GET_INFO_BY_FD (map)", e))?
        .id;
    // Whether the program is still attached cannot be checked here (BPF_PROG_QUERY needs
    // CAP_NET_ADMIN); if an administrator detached it, SYNs carry no option and every
    // connection falls back to TCP, which is what a detach asks for.
    Ok(Rendezvous {
        map,
        prog,
        prog_id,
        map_id,
        pin_dir,
        cgroup,
        loaded_here: false,
    })
}

// ---------------------------------------------------------------------------------------------

fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn ioerr(op: &'static str, path: &Path, e: io::Error) -> RendezvousError {
    let errno = errno_of(&e);
    if errno == libc::EPERM || errno == libc::EACCES {
        return RendezvousError::NoPrivilege {
            op,
            missing: missing_capabilities(),
            errno: Some(errno),
        };
    }
    RendezvousError::Io {
        op,
        path: path.to_path_buf(),
        errno,
    }
}

/// Whether a connected socket's status says the peer offered SMC.
fn offered(s: SocketStatus) -> Result<bool, RendezvousError> {
    match s {
        SocketStatus::Untracked => Ok(false),
        SocketStatus::OptedIn => Err(RendezvousError::NotEstablished),
        SocketStatus::Established { peer_smc, .. } => Ok(peer_smc),
    }
}

/// A socket's status from its map value (`None`: no entry).
fn status_of(v: Option<u32>) -> SocketStatus {
    match v {
        None => SocketStatus::Untracked,
        Some(v) if v & program::VAL_ESTABLISHED != 0 => SocketStatus::Established {
            peer_smc: v & program::VAL_PEER_SMC != 0,
            passive: v & program::VAL_PASSIVE != 0,
        },
        Some(v) if v & program::VAL_WANT != 0 => SocketStatus::OptedIn,
        Some(_) => SocketStatus::Untracked,
    }
}

/// Classifies a failed kernel step.
fn kerr(op: &'static str, e: io::Error) -> RendezvousError {
    let errno = errno_of(&e);
    match errno {
        libc::EPERM | libc::EACCES => RendezvousError::NoPrivilege {
            op,
            missing: missing_capabilities(),
            errno: Some(errno),
        },
        libc::ENOSYS => RendezvousError::Unsupported {
            what: "no bpf(2) system call".into(),
            errno,
        },
        _ => RendezvousError::Kernel { op, errno },
    }
}

/// Capabilities the install path needs that `CapEff` in `/proc/self/status` lacks.
fn missing_capabilities() -> Vec<&'static str> {
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_BPF: u32 = 39;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return Vec::new(); // cannot tell; let the kernel decide
    };
    let Some(eff) = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    else {
        return Vec::new();
    };
    let has = |c: u32| eff & (1u64 << c) != 0;
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    missing
}

fn check_tcp(fd: BorrowedFd<'_>) -> Result<(), RendezvousError> {
    let ty = sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE).map_err(|e| {
        match e.raw_os_error() {
            Some(libc::ENOTSOCK) | Some(libc::EBADF) => RendezvousError::NotTcpSocket,
            _ => kerr("getsockopt(SO_TYPE)", e),
        }
    })?;
    let proto = sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL)
        .map_err(|e| kerr("getsockopt(SO_PROTOCOL)", e))?;
    if ty != libc::SOCK_STREAM || proto != libc::IPPROTO_TCP {
        return Err(RendezvousError::NotTcpSocket);
    }
    Ok(())
}

/// The configured cgroup, or the root of the cgroup2 mount.
fn resolve_cgroup(cfg: &Config) -> Result<PathBuf, RendezvousError> {
    if let Some(p) = &cfg.cgroup {
        return Ok(p.clone());
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| {
        RendezvousError::NoCgroup2 {
            path: None,
            detail: format!("cannot read /proc/self/mountinfo: {e}"),
        }
    })?;
    cgroup2_root_from_mountinfo(&mountinfo).ok_or_else(|| RendezvousError::NoCgroup2 {
        path: None,
        detail: "no cgroup2 file system is mounted (see /proc/self/mountinfo)".into(),
    })
}

/// Mount point of a cgroup2 mount whose root is the hierarchy root ("/").
fn cgroup2_root_from_mountinfo(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let f: Vec<&str> = pre.split_whitespace().collect();
        if f.get(3).copied()? != "/" {
            return None;
        }
        Some(PathBuf::from(unescape_mountinfo(f.get(4)?)))
    })
}

/// Undoes the octal escapes (`\040` etc.) of mountinfo paths.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn open_cgroup(path: &Path) -> Result<File, RendezvousError> {
    let magic = sys::fs_magic(path).map_err(|e| RendezvousError::NoCgroup2 {
        path: Some(path.to_path_buf()),
        detail: e.to_string(),
    })?;
    if magic != CGROUP2_SUPER_MAGIC {
        return Err(RendezvousError::NoCgroup2 {
            path: Some(path.to_path_buf()),
            detail: format!("not a cgroup2 directory (file system magic {magic:#x})"),
        });
    }
    File::open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => ioerr("open cgroup", path, e),
        _ => RendezvousError::NoCgroup2 {
            path: Some(path.to_path_buf()),
            detail: e.to_string(),
        },
    })
}

/// Makes sure a bpffs is mounted at `path`, mounting one if allowed.
fn ensure_bpffs(path: &Path, mount: bool) -> Result<(), RendezvousError> {
    let is_bpffs = |p: &Path| sys::fs_magic(p).map(|m| m == BPF_FS_MAGIC);
    let no = |detail: String| RendezvousError::NoBpffs {
        path: path.to_path_buf(),
        detail,
    };
    match is_bpffs(path) {
        Ok(true) => return Ok(()),
        Ok(false) if mount => {}
        Ok(false) => return Err(no("not a BPF file system and mounting is disabled".into())),
        Err(e) => return Err(no(e.to_string())),
    }
    // Serialise concurrent mounters on the (underlying) mount-point directory, then re-check:
    // two racing mounts would stack two bpffs instances and hide the first one's pins.
    let dir = File::open(path).map_err(|e| no(e.to_string()))?;
    dir.lock().map_err(|e| no(format!("lock: {e}")))?;
    if is_bpffs(path).unwrap_or(false) {
        return Ok(());
    }
    sys::mount_bpffs(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => RendezvousError::NoPrivilege {
            op: "mount bpffs",
            missing: missing_capabilities(),
            errno: e.raw_os_error(),
        },
        _ => no(format!("mount -t bpf failed: {e}")),
    })
}

/// Creates (if needed), opens and exclusively `flock`s the namespace directory. Retries if the
/// directory was removed by [`uninstall`] while we waited.
fn lock_namespace(ns: &Path) -> Result<File, RendezvousError> {
    for _ in 0..16 {
        match std::fs::DirBuilder::new().mode(0o700).create(ns) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ioerr("mkdir", ns, e)),
        }
        let f = match File::open(ns) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ioerr("open", ns, e)),
        };
        f.lock().map_err(|e| ioerr("flock", ns, e))?;
        match f.metadata() {
            Ok(m) if m.nlink() > 0 => return Ok(f),
            Ok(_) => continue, // removed while we waited
            Err(e) => return Err(ioerr("fstat", ns, e)),
        }
    }
    Err(RendezvousError::Io {
        op: "lock (directory keeps disappearing)",
        path: ns.to_path_buf(),
        errno: libc::ENOENT,
    })
}

/// Opens the pinned program (with `prog_flags`: 0, or [`sys::F_RDONLY`] for a process that
/// only needs to check it) and the map (read-write: opting in writes it).
fn open_pinned(
    map_pin: &Path,
    prog_pin: &Path,
    prog_flags: u32,
) -> Result<(sys::CookieMap, OwnedFd), RendezvousError> {
    let prog =
        sys::obj_get_flags(prog_pin, prog_flags).map_err(|e| kerr("BPF_OBJ_GET (prog)", e))?;
    let info =
        sys::prog_info(prog.as_fd()).map_err(|e| kerr("BPF_OBJ_GET_INFO_BY_FD (prog)", e))?;
    if info.prog_type != sys::PROG_TYPE_SOCK_OPS {
        return Err(RendezvousError::IncompatiblePin {
            path: prog_pin.to_path_buf(),
            detail: format!("program type {} is not sock_ops", info.prog_type),
        });
    }
    let map_fd = sys::obj_get(map_pin).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => RendezvousError::IncompatiblePin {
            path: map_pin.to_path_buf(),
            detail: "program pinned without its map".into(),
        },
        _ => kerr("BPF_OBJ_GET (map)", e),
    })?;
    let map =
        sys::CookieMap::from_fd(map_fd).map_err(|(_, info)| RendezvousError::IncompatiblePin {
            path: map_pin.to_path_buf(),
            detail: match info {
                Some(i) => format!(
                    "map type {} key {} value {} is not an LRU hash u64 -> u32",
                    i.map_type, i.key_size, i.value_size
                ),
                None => "not a BPF map".into(),
            },
        })?;
    Ok((map, prog))
}

/// Creates, loads and pins a new instance (caller holds the namespace lock).
fn install(
    pin_dir: &Path,
    map_pin: &Path,
    prog_pin: &Path,
) -> Result<(sys::CookieMap, OwnedFd), RendezvousError> {
    // Leftovers of a process that died mid-install: a map pinned without its program.
    if exists(map_pin) {
        std::fs::remove_file(map_pin).map_err(|e| ioerr("unlink stale map pin", map_pin, e))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(pin_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(ioerr("mkdir", pin_dir, e)),
    }
    let map =
        sys::CookieMap::create(program::MAP_MAX_ENTRIES, "smc_rs_cookies").map_err(|e| match e
            .raw_os_error()
        {
            Some(libc::EINVAL) => RendezvousError::Unsupported {
                what: "BPF_MAP_CREATE of an LRU hash map failed".into(),
                errno: libc::EINVAL,
            },
            _ => kerr("BPF_MAP_CREATE", e),
        })?;
    sys::obj_pin(map.as_fd(), map_pin).map_err(|e| kerr("BPF_OBJ_PIN (map)", e))?;
    let prog = load_program(&map)?;
    sys::obj_pin(prog.as_fd(), prog_pin).map_err(|e| kerr("BPF_OBJ_PIN (prog)", e))?;
    Ok((map, prog))
}

fn load_program(map: &sys::CookieMap) -> Result<OwnedFd, RendezvousError> {
    use std::os::fd::AsRawFd;
    let insns =
        program::build(map.as_fd().as_raw_fd()).map_err(|e| RendezvousError::VerifierRejected {
            errno: libc::EINVAL,
            log: format!("program did not assemble: {e}"),
        })?;
    load_insns(&insns)
}

/// Loads a sock_ops program; on failure, loads it again with a verifier log to explain why.
fn load_insns(insns: &[asm::Insn]) -> Result<OwnedFd, RendezvousError> {
    let insns = insns.to_vec();
    const NAME: &str = PROG_NAME;
    match sys::prog_load(
        sys::PROG_TYPE_SOCK_OPS,
        &insns,
        program::LICENSE,
        NAME,
        None,
    ) {
        Ok(fd) => return Ok(fd),
        // EACCES is also the verifier's "unsafe program" answer, so only EPERM and ENOSYS
        // skip the second load with a log.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::ENOSYS)) => {
            return Err(kerr("BPF_PROG_LOAD", e));
        }
        Err(_) => {}
    }
    // Load again with a verifier log to explain the failure.
    let mut size = 1 << 20;
    loop {
        let mut log = vec![0u8; size];
        match sys::prog_load(
            sys::PROG_TYPE_SOCK_OPS,
            &insns,
            program::LICENSE,
            NAME,
            Some(&mut log),
        ) {
            Ok(fd) => return Ok(fd), // transient failure; it loads now
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && size < (16 << 20) => size *= 4,
            Err(e) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]).into_owned();
                let errno = errno_of(&e);
                if text.trim().is_empty() {
                    return Err(kerr("BPF_PROG_LOAD", e));
                }
                if text.contains("unknown func") || text.contains("invalid func") {
                    return Err(RendezvousError::Unsupported {
                        what: format!(
                            "BPF helpers for TCP header options are missing (Linux >= 5.10 needed); verifier log:\n{text}"
                        ),
                        errno,
                    });
                }
                return Err(RendezvousError::VerifierRejected { errno, log: text });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_root_in_mountinfo() {
        let mi = "\
30 1 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
40 30 0:35 /sub /sys/fs/cgroup/bind rw - cgroup2 cgroup2 rw
41 30 0:35 / /sys/fs/cgroup/uni\\040fied rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_root_from_mountinfo(mi),
            Some(PathBuf::from("/sys/fs/cgroup/uni fied"))
        );
        assert_eq!(
            cgroup2_root_from_mountinfo("1 2 3:4 / / rw - ext4 /dev/x rw\n"),
            None
        );
    }

    #[test]
    fn instance_tag_is_versioned() {
        let t = instance_tag();
        assert!(t.starts_with(&format!("v{LAYOUT_VERSION}-")), "{t}");
        assert_eq!(t.len(), 2 + LAYOUT_VERSION.to_string().len() + 16);
        let cfg = Config::default();
        assert_eq!(cfg.pin_dir(), PathBuf::from("/sys/fs/bpf/smc-rs").join(t));
    }

    #[test]
    fn errors_have_distinct_reasons_and_actionable_text() {
        let errs = [
            RendezvousError::NoPrivilege {
                op: "x",
                missing: vec!["CAP_BPF"],
                errno: None,
            },
            RendezvousError::NoCgroup2 {
                path: None,
                detail: "d".into(),
            },
            RendezvousError::AccessDenied {
                path: "/p".into(),
                uid: 65534,
            },
            RendezvousError::NoBpffs {
                path: "/sys/fs/bpf".into(),
                detail: "d".into(),
            },
            RendezvousError::Unsupported {
                what: "w".into(),
                errno: libc::EINVAL,
            },
            RendezvousError::VerifierRejected {
                errno: libc::EACCES,
                log: "R1 invalid mem access".into(),
            },
            RendezvousError::IncompatiblePin {
                path: "/p".into(),
                detail: "d".into(),
            },
            RendezvousError::Io {
                op: "mkdir",
                path: "/p".into(),
                errno: libc::ENOENT,
            },
            RendezvousError::Kernel {
                op: "k",
                errno: libc::EINVAL,
            },
            RendezvousError::NotTcpSocket,
            RendezvousError::TooLate { state: 10 },
            RendezvousError::NotEstablished,
        ];
        let mut reasons: Vec<_> = errs.iter().map(|e| e.fallback_reason()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), errs.len());
        let s = errs[0].to_string();
        assert!(s.contains("CAP_BPF") && s.contains("root"), "{s}");
        assert!(errs[5].to_string().contains("R1 invalid mem access"));
        let denied = errs[2].to_string();
        assert!(
            denied.contains("smc-rendezvous install --group"),
            "{denied}"
        );
    }
}

/// Tests that need root (they load BPF objects). They fail loudly without it.
#[cfg(test)]
mod root_tests {
    use super::*;
    use crate::asm::{Asm, Reg};

    fn require_root() {
        assert!(
            missing_capabilities().is_empty(),
            "needs CAP_BPF + CAP_NET_ADMIN (run as root, as CI does)"
        );
    }

    #[test]
    fn verifier_rejection_carries_the_log() {
        require_root();
        // Reads R0 before writing it: the verifier must refuse and say so in its log.
        let mut a = Asm::new();
        a.exit();
        let insns = a.finish().unwrap();
        match load_insns(&insns) {
            Err(e @ RendezvousError::VerifierRejected { .. }) => {
                let RendezvousError::VerifierRejected { log, .. } = &e else {
                    unreachable!()
                };
                assert!(log.contains("R0"), "log: {log}");
                assert!(e.to_string().contains("verifier log"), "{e}");
            }
            other => panic!("expected VerifierRejected, got {other:?}"),
        }
        // And the real program passes.
        let map = sys::CookieMap::create(16, "smc_rs_t").unwrap();
        load_program(&map).unwrap_or_else(|e| panic!("{e}"));
        let mut a = Asm::new();
        a.mov64_imm(Reg::R0, 1).exit();
        load_insns(&a.finish().unwrap()).unwrap();
    }

    #[test]
    fn wrong_cgroup_or_bpffs_paths_give_typed_errors() {
        require_root();
        let cfg = Config {
            cgroup: Some(PathBuf::from("/tmp")),
            ..Config::default()
        };
        match Rendezvous::open_with(&cfg) {
            Err(e @ RendezvousError::NoCgroup2 { .. }) => {
                assert_eq!(e.fallback_reason(), "rendezvous-no-cgroup2");
                assert!(e.to_string().contains("/tmp"), "{e}");
            }
            other => panic!("expected NoCgroup2, got {other:?}"),
        }
        let cfg = Config {
            bpffs: PathBuf::from("/proc"),
            mount_bpffs: false,
            ..Config::default()
        };
        match Rendezvous::open_with(&cfg) {
            Err(e @ RendezvousError::NoBpffs { .. }) => {
                assert!(e.to_string().contains("mount -t bpf"), "{e}")
            }
            other => panic!("expected NoBpffs, got {other:?}"),
        }
    }
}
