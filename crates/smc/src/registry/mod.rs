//! The live registry: what this process's SMC sockets, link groups, links
//! and devices are doing, and its counters, published for `smcss` and
//! `smcr` (smc-tools' views of the kernel's sock_diag and `SMC_GEN_NETLINK`,
//! `tools.md` §4). There is no kernel socket table here: each process
//! publishes a file of its own in the user's run directory ([`files`]),
//! rewritten whole (temporary file + rename) by a registry thread, and only
//! when its content changed.
//!
//! The thread sleeps until there is something to look at, so that an idle
//! process (connections established, no data, no events) is not woken by
//! it:
//! - a connection event (a socket listed or ended, a handshake failed, an
//!   error, an engine event to log: `Registry::note_change`) wakes it,
//!   and it looks at most every `EVENT_PERIOD` (100 ms);
//! - activity, data counted by a read or write or the engine pumped
//!   (received CDCs and LLC messages, closes, timers: `active`), has it
//!   look at most every `IDLE_PERIOD` (1 s), and once more after the last
//!   (the flag is not ordered with the counts); an idle link group's
//!   TEST_LINK (every 30 s) is such a pump, and changes its LLC counts;
//! - while an SMC-R connection that ended is still listed (its TCP socket
//!   is closed once its close has gone out, with no event of its own), it
//!   looks every `EVENT_PERIOD`;
//! - devices (port states) are looked at with a look at most every
//!   `DEVICE_PERIOD` (5 s), and 5 s after a link went down (a port going
//!   down takes its links down; no engine event names the port itself). A
//!   port that changes under no link, or comes back up, shows at the next
//!   look 5 s after the last device look.
//!
//! Each look and the pause after it take at least `COST_FACTOR` times the
//! look's own time.
//!
//! The data path does not pay for it: sockets are registered at connection
//! events (one short lock per connection), counted bytes are relaxed atomic
//! adds in the connection's own counters, activity is one relaxed load per
//! read, write or pump while the flag is set (the first after a look sets
//! it, and rings the thread if it sleeps), and everything else (addresses,
//! engine state, devices) is looked at by the registry thread.
//! `SMC_RS_REGISTRY=0` turns the registry off for the process.
//!
//! The engine's facts come from its read-only views (`conn_diag`,
//! `lgr_diag`, `msg_counts`): cursors and flags of each connection's last
//! CDCs, its link's GIDs, the link groups' links and peers, the CDC and LLC
//! messages of each endpoint. Link events (up, down, a connection moved,
//! aborted) are the engine's own ([`smc_engine::endpoint::EngineEvent`]),
//! drained where the endpoint is pumped (`engine_events`): counted there,
//! and logged (`log`) by the registry thread with the group's LG-ID, as
//! are handshake results and failures.

pub mod files;
mod log;

use crate::ctx::{self, Role, Shared};
use crate::stream::Mode;
use serde_json::{json, Value};
use smc_config::store::Table;
use smc_engine::endpoint::{ConnId, Endpoint, EngineEvent, LgrId};
use smc_engine::state::{BufCounts, ConnDiag, LgrDiag, MsgCounts};
use smc_proto::close::CloseState;
use smc_proto::link::LinkState;
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, Weak};
use std::time::{Duration, Instant};

/// Bytes and requests (successful reads and writes) of an SMC-R
/// connection; added to the process's totals when the connection ends.
#[derive(Default)]
pub(crate) struct ConnStats {
    rx_bytes: AtomicU64,
    tx_bytes: AtomicU64,
    rx_cnt: AtomicU64,
    tx_cnt: AtomicU64,
    /// Reads and writes by payload size ([`bucket`]).
    rx_hist: Hist,
    tx_hist: Hist,
    retired: AtomicBool,
}

/// Buckets of Linux's size histograms (smc_stats.h `SMC_BUF_MAX`): up to
/// 8 KiB, 16 KiB, ... 1024 KiB, more.
const BUCKETS: usize = 9;
/// Their names in `smcr stats json` (`SMC_USR_TX_BUF_8K` ... `_G_1024K`).
pub const BUCKET_NAMES: [&str; BUCKETS] = [
    "8K", "16K", "32K", "64K", "128K", "256K", "512K", "1024K", "G_1024K",
];

type Hist = [AtomicU64; BUCKETS];

/// The bucket of a size (smc_stats.h `SMC_STAT_PAYLOAD_SUB`: the bit length
/// of `(len - 1) >> 13`, at most 8).
#[inline]
fn bucket(len: usize) -> usize {
    let x = (len.max(1) - 1) >> 13;
    ((usize::BITS - x.leading_zeros()) as usize).min(BUCKETS - 1)
}

fn hist_get(h: &Hist) -> [u64; BUCKETS] {
    std::array::from_fn(|i| h[i].load(Relaxed))
}

fn hist_add(h: &Hist, v: &[u64; BUCKETS]) {
    for (a, b) in h.iter().zip(v) {
        a.fetch_add(*b, Relaxed);
    }
}

fn hist_json(v: &[u64; BUCKETS]) -> Value {
    let m: serde_json::Map<String, Value> = BUCKET_NAMES
        .iter()
        .zip(v)
        .map(|(k, n)| ((*k).to_string(), json!(n)))
        .collect();
    Value::Object(m)
}

impl ConnStats {
    /// A read that returned `n` bytes (the kernel counts a request's size
    /// only when it moved data: smc_rx.c `SMC_STAT_RMB_RX_SIZE_SMALL`...).
    #[inline]
    pub(crate) fn rx(&self, n: usize) {
        active();
        self.rx_bytes.fetch_add(n as u64, Relaxed);
        self.rx_cnt.fetch_add(1, Relaxed);
        if n > 0 {
            self.rx_hist[bucket(n)].fetch_add(1, Relaxed);
        }
    }

    /// A write that took `n` bytes.
    #[inline]
    pub(crate) fn tx(&self, n: usize) {
        active();
        self.tx_bytes.fetch_add(n as u64, Relaxed);
        self.tx_cnt.fetch_add(1, Relaxed);
        if n > 0 {
            self.tx_hist[bucket(n)].fetch_add(1, Relaxed);
        }
    }

    fn get(&self) -> [u64; 4] {
        [
            self.rx_bytes.load(Relaxed),
            self.tx_bytes.load(Relaxed),
            self.rx_cnt.load(Relaxed),
            self.tx_cnt.load(Relaxed),
        ]
    }

    /// The connection ended: its counts move to the process's totals.
    pub(crate) fn retire(&self) {
        if self.retired.swap(true, Relaxed) {
            return;
        }
        if let Some(r) = registry() {
            let [a, b, c, d] = self.get();
            r.retired.rx_bytes.fetch_add(a, Relaxed);
            r.retired.tx_bytes.fetch_add(b, Relaxed);
            r.retired.rx_cnt.fetch_add(c, Relaxed);
            r.retired.tx_cnt.fetch_add(d, Relaxed);
            hist_add(&r.retired.rx_hist, &hist_get(&self.rx_hist));
            hist_add(&r.retired.tx_hist, &hist_get(&self.tx_hist));
            r.note_change();
        }
    }
}

/// An SMC-R connection's endpoint, id and counters.
type SmcRef = (Weak<Shared>, ConnId, Arc<ConnStats>);

/// What a registered socket is.
enum What {
    Listen,
    Stream {
        role: Role,
        mode: Mode,
        tcp: Weak<TcpStream>,
        smc: Option<SmcRef>,
    },
}

/// What does not change about a socket (looked up once).
#[derive(Clone)]
struct Info {
    inode: u64,
    uid: u32,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

struct Entry {
    /// Alive while the socket is.
    alive: Weak<dyn Any + Send + Sync>,
    what: What,
    info: Option<Info>,
}

struct Registry {
    dir: PathBuf,
    entries: Mutex<Vec<Entry>>,
    /// A connection event since the last snapshot (set with
    /// [`Registry::note_change`], which rings `bell`).
    changed: AtomicBool,
    /// Wakes the registry thread.
    bell: Bell,
    /// The registry thread waits without looking at [`ACTIVITY`] (set
    /// before it reads it): the first activity since rings `bell`.
    asleep: AtomicBool,
    thread: Once,
    /// Per side (client 0, server 1).
    smc: [AtomicU64; 2],
    fallback: [AtomicU64; 2],
    hs_err: [AtomicU64; 2],
    /// (side, our reason) and (side, the peer's Decline code) → count.
    reasons: Mutex<BTreeMap<(usize, u32), u64>>,
    peer_reasons: Mutex<BTreeMap<(usize, u32), u64>>,
    /// Counts of the connections that have ended.
    retired: ConnStats,
    /// Snapshots that could not be published.
    errors: AtomicU64,
    /// Other failures by kind: count and last message (see [`error`]).
    errors_by_kind: Mutex<BTreeMap<&'static str, (u64, String)>>,
    /// Sizes of the RMBs and send buffers of SMC-R connections ([`bucket`]).
    rmb_hist: Hist,
    sndbuf_hist: Hist,
    /// Link events of the engines ([`engine_events`]).
    link_up: AtomicU64,
    link_down: AtomicU64,
    failover: AtomicU64,
    aborts: AtomicU64,
    /// Engine events (with their endpoint's devices) not yet logged, at
    /// most [`PENDING_MAX`], and those dropped beyond.
    pending: Mutex<Vec<(Devices, EngineEvent)>>,
    pending_lost: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process generation's registry, if on (once per generation: a
/// forked child publishes its own connections, under its own pid, see
/// `crate::fork`).
static REGISTRY: crate::fork::PerFork<Option<Registry>> = crate::fork::PerFork::new();

/// The registry, made at the first call.
fn registry() -> Option<&'static Registry> {
    REGISTRY
        .get_or_init(|| {
            if std::env::var("SMC_RS_REGISTRY").is_ok_and(|v| v == "0") {
                return None;
            }
            Some(Registry {
                dir: files::run_dir(),
                entries: Mutex::new(Vec::new()),
                changed: AtomicBool::new(true),
                bell: Bell::default(),
                asleep: AtomicBool::new(false),
                thread: Once::new(),
                smc: Default::default(),
                fallback: Default::default(),
                hs_err: Default::default(),
                reasons: Mutex::new(BTreeMap::new()),
                peer_reasons: Mutex::new(BTreeMap::new()),
                retired: ConnStats::default(),
                errors: AtomicU64::new(0),
                errors_by_kind: Mutex::new(BTreeMap::new()),
                rmb_hist: Default::default(),
                sndbuf_hist: Default::default(),
                link_up: AtomicU64::new(0),
                link_down: AtomicU64::new(0),
                failover: AtomicU64::new(0),
                aborts: AtomicU64::new(0),
                pending: Mutex::new(Vec::new()),
                pending_lost: AtomicU64::new(0),
            })
        })?
        .as_ref()
}

/// The registry if it was made (not making it: for what runs when a
/// connection or socket ends, and on the data path).
fn registry_made() -> Option<&'static Registry> {
    REGISTRY.get()?.as_ref()
}

/// Data moved or the engine ran since the registry thread last looked: the
/// counts, cursors and states it publishes may have changed. Set with
/// [`active`]; the thread clears it when it looks. (One flag for the
/// process, every generation's: a forked child's registry thread clears it
/// at its first look.)
static ACTIVITY: AtomicBool = AtomicBool::new(false);

/// Notes activity for the registry thread: a relaxed load while the flag is
/// set (the data path's cost, per message); the first since the thread's
/// last look sets it and wakes the thread if it waits for nothing else.
#[inline]
fn active() {
    if !ACTIVITY.load(Relaxed) {
        activity_begins();
    }
}

#[cold]
#[inline(never)]
fn activity_begins() {
    // (SeqCst with the thread's `asleep` store and `ACTIVITY` load: either
    // it sees the flag before it waits, or this sees it asleep and rings)
    if !ACTIVITY.swap(true, SeqCst) {
        if let Some(r) = registry_made() {
            if r.asleep.load(SeqCst) {
                r.bell.ring();
            }
        }
    }
}

/// A socket ended (its last handle is gone): the registry thread looks, to
/// take it off the list. Called after the socket's `Arc` that the registry
/// watches has gone.
pub(crate) fn ended() {
    if let Some(r) = registry_made() {
        r.note_change();
    }
}

/// Wakes the registry thread (a flag under a mutex, and a condition
/// variable: a ring while the thread is busy is kept for its next wait).
#[derive(Default)]
struct Bell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        *lock(&self.rung) = true;
        self.cv.notify_one();
    }

    /// Waits for a ring, or until `until`.
    fn wait(&self, until: Option<Instant>) {
        let mut rung = lock(&self.rung);
        while !*rung {
            match until {
                None => rung = self.cv.wait(rung).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let now = Instant::now();
                    if now >= t {
                        return;
                    }
                    rung = self
                        .cv
                        .wait_timeout(rung, t - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        *rung = false;
    }
}

fn side(role: Role) -> usize {
    match role {
        Role::Client => 0,
        Role::Server => 1,
    }
}

fn info_of(fd: BorrowedFd<'_>) -> Info {
    let st = rustix::fs::fstat(fd).ok();
    let addr = |a: Option<rustix::net::SocketAddrAny>| a.and_then(|a| SocketAddr::try_from(a).ok());
    Info {
        inode: st.as_ref().map_or(0, |s| s.st_ino),
        uid: st.as_ref().map_or(0, |s| s.st_uid),
        local: addr(rustix::net::getsockname(fd).ok()),
        peer: addr(rustix::net::getpeername(fd).ok().flatten()),
    }
}

/// Starts the registry thread, if it runs in this process, at the first SMC
/// socket (before its first connection, so that the thread is there from
/// the process's first connection on, not from some later one).
pub(crate) fn start() {
    log::init();
    if let Some(r) = registry() {
        r.start();
    }
}

impl Registry {
    fn add(&'static self, e: Entry) {
        lock(&self.entries).push(e);
        self.note_change();
        self.start();
    }

    /// A connection event: the thread looks (at most every
    /// [`EVENT_PERIOD`]); it is woken by the first since its last look.
    /// (A read-modify-write: if the flag was still set, the thread's look
    /// that clears it comes after, and sees what the caller changed.)
    fn note_change(&self) {
        if !self.changed.swap(true, SeqCst) {
            self.bell.ring();
        }
    }

    fn start(&'static self) {
        self.thread.call_once(|| {
            // (no thread, no registry: the connection works all the same;
            // the failure is counted where the tools can see it if a later
            // start succeeds)
            if let Err(e) = std::thread::Builder::new()
                .name("smc-registry".into())
                .spawn(move || self.run())
            {
                self.errors.fetch_add(1, Relaxed);
                tracing::error!(target: "smc", kind = "thread_start", error = %e, "registry thread did not start");
            }
        });
    }
}

/// Keeps a socket listed while it lives (for sockets not held in an
/// `Arc<TcpStream>`: listeners, the tokio adapter's fallback connections).
pub(crate) struct Token(#[allow(dead_code)] Arc<Listed>);

/// What a [`Token`] holds: when the last goes, the socket is off the list,
/// and the registry thread is told.
pub(crate) struct Listed;

impl Drop for Listed {
    fn drop(&mut self) {
        // (the entry's `Weak` is dead already: the look that follows
        // removes it)
        ended();
    }
}

/// A TCP (fallback) connection of the tokio adapter, established: counted,
/// and listed while the returned token lives.
#[cfg(feature = "tokio")]
pub(crate) fn stream_fd(fd: BorrowedFd<'_>, role: Role, mode: Mode) -> Option<Token> {
    log_result(role, mode, fd);
    let r = registry()?;
    r.count(role, mode, None);
    let token = Arc::new(Listed);
    let weak: Weak<Listed> = Arc::downgrade(&token);
    r.add(Entry {
        alive: weak,
        what: What::Stream {
            role,
            mode,
            tcp: Weak::new(),
            smc: None,
        },
        info: Some(info_of(fd)),
    });
    Some(Token(token))
}

/// A listed connection's socket leaves its `Arc` (the tokio adapter takes
/// it over): it stays listed while the returned token lives.
#[cfg(feature = "tokio")]
pub(crate) fn rebind(tcp: &Arc<TcpStream>) -> Option<Token> {
    let r = registry()?;
    let token = Arc::new(Listed);
    let mut es = lock(&r.entries);
    let e = es.iter_mut().find(|e| match &e.what {
        What::Stream { tcp: t, .. } => std::ptr::eq(t.as_ptr(), Arc::as_ptr(tcp)),
        What::Listen => false,
    })?;
    if e.info.is_none() {
        e.info = Some(info_of(tcp.as_fd()));
    }
    let weak: Weak<Listed> = Arc::downgrade(&token);
    e.alive = weak;
    Some(Token(token))
}

/// The name of a reason code in logs: the kernel's macro name without
/// `SMC_CLC_DECL_`, or smc-rs's own.
fn code_name(code: u32) -> String {
    if code == crate::FALLBACK_NO_RENDEZVOUS {
        return "NO_RENDEZVOUS".into();
    }
    smc_wire::clc::DeclineCode::from_u32(code)
        .name()
        .map_or_else(
            || format!("{code:#010x}"),
            |n| n.trim_start_matches("SMC_CLC_DECL_").to_string(),
        )
}

/// The log event of a connection's handshake result.
fn log_result(role: Role, mode: Mode, fd: BorrowedFd<'_>) {
    let role = role_name(role);
    // (the addresses are looked up only when the event is enabled)
    let addrs = || {
        let i = info_of(fd);
        (
            i.local.map(|a| a.to_string()).unwrap_or_default(),
            i.peer.map(|a| a.to_string()).unwrap_or_default(),
        )
    };
    match mode {
        Mode::SmcR => {
            if tracing::enabled!(target: "smc", tracing::Level::INFO) {
                let (local, peer) = addrs();
                tracing::info!(target: "smc", role, local, peer, mode = "SMCR", "connection established");
            }
        }
        Mode::Tcp(f) => {
            if tracing::enabled!(target: "smc", tracing::Level::INFO) {
                let (local, peer) = addrs();
                let code = f.code();
                let peer_code = f.peer.map(|p| format!("{:#010x}", p.to_u32()));
                tracing::info!(
                    target: "smc",
                    role, local, peer, mode = "TCP",
                    reason = format!("{code:#010x}").as_str(),
                    reason_name = code_name(code).as_str(),
                    peer_reason = peer_code.as_deref().unwrap_or("none"),
                    "connection fell back to TCP"
                );
            }
        }
    }
}

impl Registry {
    /// `bufs`: an SMC-R connection's RMB and send buffer sizes.
    fn count(&self, role: Role, mode: Mode, bufs: Option<(usize, usize)>) {
        let s = side(role);
        match mode {
            Mode::SmcR => {
                self.smc[s].fetch_add(1, Relaxed);
                if let Some((rmb, snd)) = bufs {
                    self.rmb_hist[bucket(rmb)].fetch_add(1, Relaxed);
                    self.sndbuf_hist[bucket(snd)].fetch_add(1, Relaxed);
                }
            }
            Mode::Tcp(f) => {
                self.fallback[s].fetch_add(1, Relaxed);
                *lock(&self.reasons).entry((s, f.code())).or_default() += 1;
                if let Some(p) = f.peer {
                    *lock(&self.peer_reasons).entry((s, p.to_u32())).or_default() += 1;
                }
            }
        }
    }
}

/// A connection is established (SMC-R or TCP fallback): counted and listed
/// until its TCP socket is closed. `smc`: its endpoint and id, SMC-R only.
pub(crate) fn stream(
    tcp: &Arc<TcpStream>,
    role: Role,
    mode: Mode,
    smc: Option<(&Arc<Shared>, ConnId, &Arc<ConnStats>)>,
) {
    log_result(role, mode, tcp.as_fd());
    let Some(r) = registry() else { return };
    // (the sizes the connection's handshake took: its own or the process's)
    let bufs = smc
        .and_then(|(sh, id, _)| sh.lock().conn_diag(id))
        .map(|d| (d.rmbe_len, d.sndbuf_len));
    r.count(role, mode, bufs);
    let weak: Weak<TcpStream> = Arc::downgrade(tcp);
    r.add(Entry {
        alive: weak.clone(),
        what: What::Stream {
            role,
            mode,
            tcp: weak,
            smc: smc.map(|(sh, id, st)| (Arc::downgrade(sh), id, st.clone())),
        },
        info: None,
    });
}

/// A listener: listed while the returned token lives.
pub(crate) fn listener(fd: BorrowedFd<'_>) -> Option<Token> {
    let r = registry()?;
    let token = Arc::new(Listed);
    let weak: Weak<Listed> = Arc::downgrade(&token);
    r.add(Entry {
        alive: weak,
        what: What::Listen,
        info: Some(info_of(fd)),
    });
    Some(Token(token))
}

/// Something failed that would otherwise only show as "no SMC device" or a
/// fallback (a device that does not open, a broken configuration, a thread
/// that cannot start): counted by `kind`, the last message kept, both
/// published (`counters.errors`, `errors`).
pub(crate) fn error(kind: &'static str, msg: String) {
    tracing::warn!(target: "smc", kind, error = msg.as_str(), "smc-rs error");
    if let Some(r) = registry() {
        let mut e = lock(&r.errors_by_kind);
        let slot = e.entry(kind).or_insert((0, String::new()));
        slot.0 += 1;
        slot.1 = msg;
        r.note_change();
    }
}

/// The failures this process recorded with `error` so far: kind, count,
/// last message (for `smc_chk`, which runs the library itself).
pub fn errors() -> Vec<(&'static str, u64, String)> {
    registry().map_or_else(Vec::new, |r| {
        lock(&r.errors_by_kind)
            .iter()
            .map(|(k, (n, m))| (*k, *n, m.clone()))
            .collect()
    })
}

/// A handshake failed: the connection is closed (neither SMC-R nor TCP).
pub(crate) fn handshake_error(role: Role) {
    tracing::info!(target: "smc", role = role_name(role), "handshake failed: connection closed");
    if let Some(r) = registry() {
        r.hs_err[side(role)].fetch_add(1, Relaxed);
        r.note_change();
    }
}

/// The state name smcss prints (`tools.md` §2.2) and Linux's number.
pub fn state_name(s: CloseState) -> (&'static str, u8) {
    match s {
        CloseState::Active => ("ACTIVE", 1),
        CloseState::Init => ("INIT", 2),
        CloseState::Closed => ("CLOSED", 7),
        CloseState::PeerCloseWait1 => ("PEERCLOSEWAIT1", 20),
        CloseState::PeerCloseWait2 => ("PEERCLOSEWAIT2", 21),
        CloseState::AppCloseWait1 => ("APPCLOSEWAIT1", 22),
        CloseState::AppCloseWait2 => ("APPCLOSEWAIT2", 23),
        CloseState::AppFinCloseWait => ("APPFINCLOSEWAIT1", 24),
        CloseState::PeerFinCloseWait => ("PEERFINCLOSEWAIT", 25),
        CloseState::PeerAbortWait => ("PEERABORTWAIT", 26),
        CloseState::ProcessAbort => ("PROCESSABORT", 27),
    }
}

/// Linux's shutdown mask for a close state (bit 0: receive side shut down,
/// bit 1: send side; af_smc.c keeps it in `sk_shutdown`).
fn shutdown_of(s: CloseState) -> u8 {
    match s {
        CloseState::Active | CloseState::Init => 0,
        CloseState::PeerCloseWait1 => 2,
        CloseState::AppCloseWait1 => 1,
        _ => 3,
    }
}

/// Engine events kept for the registry thread to log (the first wakes it,
/// see [`Registry::note_change`]); beyond, they are counted but not logged.
const PENDING_MAX: usize = 1024;

/// The devices of the endpoint an engine event came from: its (first)
/// device, which names the endpoint and, with the engine's id, its link
/// groups (the LG-ID key); and its second device, if it has one, on which
/// some of its links run.
#[derive(Clone, Debug, Default)]
struct Devices {
    first: String,
    second: Option<String>,
}

impl Devices {
    /// The device of a link on the second device (`second`) or the first.
    fn of(&self, second: bool) -> &str {
        match (&self.second, second) {
            (Some(d), true) => d,
            _ => &self.first,
        }
    }
}

/// Takes the engine's link and connection events (see
/// [`Endpoint::poll_event`]) where the endpoint is pumped, with its lock
/// held: counts them, and queues them for the registry thread to log (or
/// logs them at once, without LG-ID, when the registry is off). Nothing
/// queued costs one check. Returns whether there were any.
pub(crate) fn engine_events<P: smc_rdma::Provider>(ep: &mut Endpoint<P>) -> bool {
    // (a pump: received CDCs and LLC messages, closes, timers may have
    // changed what the registry publishes)
    active();
    let Some(first) = ep.poll_event() else {
        return false;
    };
    let r = registry();
    let devs = Devices {
        first: ep.device_name().to_string(),
        second: ep.second_device_name().map(str::to_string),
    };
    let mut next = Some(first);
    while let Some(e) = next {
        match r {
            Some(r) => {
                let n = match e {
                    EngineEvent::LinkUp { .. } => &r.link_up,
                    EngineEvent::LinkDown { .. } => &r.link_down,
                    EngineEvent::ConnMoved { .. } => &r.failover,
                    EngineEvent::ConnAborted { .. } => &r.aborts,
                };
                n.fetch_add(1, Relaxed);
                let mut p = lock(&r.pending);
                if p.len() < PENDING_MAX {
                    p.push((devs.clone(), e));
                } else {
                    r.pending_lost.fetch_add(1, Relaxed);
                }
            }
            None => log_event(&devs, None, &e),
        }
        next = ep.poll_event();
    }
    if let Some(r) = r {
        r.note_change();
        // (rung even when a look is due already: the thread logs the events
        // at its next turn, whereas its next look may be seconds away — it
        // waits COST_FACTOR times as long as the last look took, 15 s after
        // a look of 0.3 s under emulation — and the process may be gone by
        // then: the interop VMs lost every link event after the first)
        r.bell.ring();
    }
    true
}

/// One engine event as a `tracing` event (target `smc`): `device` is the
/// device of the event's link (of a moved connection: the link it moved
/// to, `from_device` the failed one's), a connection's abort names the
/// endpoint's.
fn log_event(devs: &Devices, lg_id: Option<u32>, e: &EngineEvent) {
    let lg = lg_id.map(|id| format!("{id:08x}")).unwrap_or_default();
    let lg = lg.as_str();
    match *e {
        EngineEvent::LinkUp {
            lgr_id,
            slot,
            second,
            ..
        } => {
            let dev = devs.of(second);
            tracing::info!(target: "smc", lg_id = lg, engine_lgr = lgr_id, link_id = slot + 1, device = dev, "link up")
        }
        EngineEvent::LinkDown {
            lgr_id,
            slot,
            second,
            reason,
            ..
        } => {
            let dev = devs.of(second);
            let reason = format!("{reason:?}");
            tracing::warn!(target: "smc", lg_id = lg, engine_lgr = lgr_id, link_id = slot + 1, device = dev, reason = reason.as_str(), "link down")
        }
        EngineEvent::ConnMoved {
            lgr_id,
            token,
            from,
            to,
            from_second,
            to_second,
            ..
        } => {
            let (dev, from_dev) = (devs.of(to_second), devs.of(from_second));
            tracing::info!(
                target: "smc",
                lg_id = lg, engine_lgr = lgr_id, token, from_link = from + 1, to_link = to + 1, device = dev, from_device = from_dev,
                "connection moved to another link (failover)"
            )
        }
        EngineEvent::ConnAborted { token, cause, .. } => {
            let dev = devs.first.as_str();
            tracing::warn!(target: "smc", lg_id = lg, token, device = dev, cause = cause.name(), "connection aborted")
        }
    }
}

/// LG-IDs a registry thread takes from its run directory at a time.
const LG_ID_BLOCK: u32 = 16;

/// Looks after connection events at most this often.
const EVENT_PERIOD: Duration = Duration::from_millis(100);
/// A snapshot and the pause after it take at least this many times the
/// snapshot's own time (the thread's CPU share stays under 2 %).
const COST_FACTOR: u32 = 50;
/// Connections looked at per hold of an endpoint's lock.
const LOCK_BATCH: usize = 256;
/// Looks for activity (counts, cursors, states) at most this often.
const IDLE_PERIOD: Duration = Duration::from_secs(1);
/// Looks at the devices at most this often.
const DEVICE_PERIOD: Duration = Duration::from_secs(5);

/// Feeds what is written to a hasher.
struct HashWriter(std::collections::hash_map::DefaultHasher);

impl std::io::Write for HashWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        std::hash::Hasher::write(&mut self.0, b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the engine says about an SMC-R connection.
#[derive(Clone, Copy)]
struct Facts {
    state: Option<CloseState>,
    diag: Option<ConnDiag>,
}

/// A link group as the engine describes it: (device index, group index,
/// the engine's description).
type LgrSeen = (usize, LgrId, LgrDiag);

/// What the registry thread remembers between snapshots: the LG-IDs it
/// gave out.
#[derive(Default)]
struct Watch {
    /// (device, the engine's group id) -> LG-ID.
    lg_ids: HashMap<(String, u32), u32>,
    /// LG-IDs left of the block taken from the run directory: (next, end).
    free_ids: (u32, u32),
}

impl Watch {
    /// The LG-ID of a link group: unique among the processes of the run
    /// directory (a counter there hands out blocks), stable while the group
    /// lives; the low byte is left for the link id, as the kernel's.
    fn lg_id(&mut self, dir: &std::path::Path, key: (String, u32)) -> u32 {
        if let Some(id) = self.lg_ids.get(&key) {
            return *id;
        }
        if self.free_ids.0 >= self.free_ids.1 {
            self.free_ids = match files::alloc_lg_ids(dir, LG_ID_BLOCK) {
                Ok(first) => (first, first + LG_ID_BLOCK),
                Err(e) => {
                    error("lg_id", format!("LG-ID counter in {}: {e}", dir.display()));
                    // (unique in this process at least)
                    let n = 0xff_0000 + self.lg_ids.len() as u32 % 0xffff;
                    (n, n + 1)
                }
            };
        }
        let id = (self.free_ids.0 & 0xff_ffff) << 8;
        self.free_ids.0 += 1;
        self.lg_ids.insert(key, id);
        id
    }
}

/// A GID as smcss and smcr print it: eight groups of four hex digits.
fn gid_str(g: &smc_wire::types::Gid) -> String {
    let mut s = String::with_capacity(39);
    for (i, pair) in g.0.chunks(2).enumerate() {
        if i > 0 {
            s.push(':');
        }
        s.push_str(&format!("{:02x}{:02x}", pair[0], pair[1]));
    }
    s
}

fn link_state_name(s: LinkState) -> &'static str {
    match s {
        LinkState::Activating => "LINK_ACTIVATING",
        LinkState::Active => "LINK_ACTIVE",
        LinkState::Inactive => "LINK_INACTIVE",
    }
}

fn cursor_json(c: smc_wire::cdc::Cursor) -> Value {
    json!({"wrap": c.wrap, "count": c.count})
}

impl Registry {
    fn run(&'static self) {
        let _ = files::ensure_dir(&self.dir);
        // processes of this user that died left their entries: counted
        // into the totals and removed
        let _ = files::read(&self.dir, true);
        let pid = std::process::id();
        let start = files::start_time(pid).unwrap_or(0);
        let comm = std::fs::read_to_string("/proc/self/comm")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let path = self.dir.join(format!("{pid}.json"));
        // (a hash of the last document written, not the text: with
        // thousands of sockets it is megabytes, and a process near its
        // memory-map limit should not hold two such buffers for us)
        let mut last: Option<u64> = None;
        let mut last_look = Instant::now() - IDLE_PERIOD;
        let mut devices: (Option<Instant>, Value) = (None, json!([]));
        let mut watch = Watch::default();
        // (a snapshot of many sockets costs more: the next waits at least
        // COST_FACTOR times as long as the last took, so that the thread
        // takes a bounded share of a CPU and of the endpoints' locks)
        let mut not_before = Instant::now();
        // the last look listed an SMC-R connection that has ended, its TCP
        // socket not yet closed (closing waits for the close to go out,
        // `stream.rs` LINGER, with no event at its end): look again
        let mut closing = false;
        // a link went down while the devices had been looked at less than
        // DEVICE_PERIOD ago (it may be their port that went down, which
        // no engine event names): look at them once that has passed
        let mut devices_owed = false;
        // the last look was made for activity: one more follows, for what
        // the data path counted as the flag was cleared (its flag is a
        // relaxed load, not ordered with the counts it guards)
        let mut trailing = false;
        loop {
            if self.log_events(&mut watch) {
                devices_owed = true;
            }
            // What is due, and when: nothing while nothing happens, so that
            // an idle process is not woken by this thread.
            let active = trailing || {
                // (asleep before ACTIVITY is read: activity that this load
                // does not see rings, see `activity_begins`; not while a
                // trailing look is due anyway, so that data flowing does
                // not ring once a look)
                self.asleep.store(true, SeqCst);
                let a = ACTIVITY.load(SeqCst);
                if a {
                    self.asleep.store(false, Relaxed);
                }
                a
            };
            let mut due: Option<Instant> = None;
            let mut want = |t: Instant| due = Some(due.map_or(t, |d| d.min(t)));
            if self.changed.load(Relaxed) || closing {
                want(last_look + EVENT_PERIOD);
            }
            if active {
                want(last_look + IDLE_PERIOD);
            }
            if devices_owed {
                want(devices.0.map_or(last_look, |t| t + DEVICE_PERIOD));
            }
            let due = due.map(|d| d.max(not_before));
            if due.is_none_or(|d| Instant::now() < d) {
                self.bell.wait(due);
                self.asleep.store(false, Relaxed);
                continue;
            }
            self.asleep.store(false, Relaxed);
            // (cleared before the look: what happens during it is seen by
            // the next one)
            self.changed.swap(false, SeqCst);
            trailing = ACTIVITY.swap(false, SeqCst);
            last_look = Instant::now();
            let refresh = devices.0.is_none_or(|t| t.elapsed() >= DEVICE_PERIOD);
            if refresh {
                devices_owed = false;
            }
            let (body, ending) = self.snapshot(&mut watch, refresh, &mut devices);
            closing = ending;
            let mut doc = json!({
                "version": files::VERSION,
                "pid": pid,
                "start_time": start,
                "uid": rustix::process::geteuid().as_raw(),
                "comm": comm,
                "smc_rs": env!("CARGO_PKG_VERSION"),
            });
            if let (Value::Object(d), Value::Object(b)) = (&mut doc, body) {
                d.extend(b);
            }
            let hash = {
                let mut h = HashWriter(std::collections::hash_map::DefaultHasher::new());
                let _ = serde_json::to_writer(&mut h, &doc);
                std::hash::Hasher::finish(&h.0)
            };
            if last != Some(hash) {
                // (the directory may have been removed meanwhile)
                let ok = files::ensure_dir(&self.dir)
                    .and_then(|()| {
                        files::write_atomic_with(&path, |w| {
                            serde_json::to_writer(w, &doc).map_err(std::io::Error::other)
                        })
                    })
                    .is_ok();
                if ok {
                    last = Some(hash);
                } else {
                    self.errors.fetch_add(1, Relaxed);
                }
            }
            not_before = last_look + last_look.elapsed() * COST_FACTOR;
        }
    }

    /// Logs the engine events drained since the last look, with the LG-ID
    /// of their group (the one `smcr linkgroup` shows). Returns whether a
    /// link went down.
    fn log_events(&self, watch: &mut Watch) -> bool {
        let evs = std::mem::take(&mut *lock(&self.pending));
        let down = evs
            .iter()
            .any(|(_, e)| matches!(e, EngineEvent::LinkDown { .. }));
        for (devs, e) in evs {
            let mut lg = |id: u32| Some(watch.lg_id(&self.dir, (devs.first.clone(), id)));
            let lg_id = match e {
                EngineEvent::LinkUp { lgr_id, .. }
                | EngineEvent::LinkDown { lgr_id, .. }
                | EngineEvent::ConnMoved { lgr_id, .. } => lg(lgr_id),
                EngineEvent::ConnAborted { lgr_id, .. } => lgr_id.and_then(lg),
            };
            log_event(&devs, lg_id, &e);
        }
        let lost = self.pending_lost.swap(0, Relaxed);
        if lost > 0 {
            tracing::warn!(target: "smc", lost, "engine events not logged (too many at once)");
        }
        down
    }

    /// The process's state as JSON (without the header), and whether an
    /// SMC-R connection that has ended is still listed (its TCP socket open
    /// while its close goes out).
    fn snapshot(
        &self,
        watch: &mut Watch,
        refresh_devices: bool,
        devices: &mut (Option<Instant>, Value),
    ) -> (Value, bool) {
        // the live sockets, with their static facts
        struct Live {
            what: Option<(Role, Mode, Option<SmcRef>)>,
            info: Info,
        }
        // the new sockets' addresses and inodes, looked up without the
        // lock that connection events take
        let new: Vec<Arc<TcpStream>> = lock(&self.entries)
            .iter()
            .filter(|e| e.info.is_none())
            .filter_map(|e| match &e.what {
                What::Stream { tcp, .. } => tcp.upgrade(),
                What::Listen => None,
            })
            .collect();
        let found: HashMap<usize, Info> = new
            .iter()
            .map(|t| (Arc::as_ptr(t) as usize, info_of(t.as_fd())))
            .collect();
        let mut live = Vec::new();
        {
            let mut es = lock(&self.entries);
            es.retain(|e| e.alive.strong_count() > 0);
            for e in es.iter_mut() {
                if e.info.is_none() {
                    if let What::Stream { tcp, .. } = &e.what {
                        // (the Arcs in `new` are alive: no address reused)
                        e.info = found.get(&(tcp.as_ptr() as usize)).cloned();
                    }
                }
                let Some(info) = e.info.clone() else { continue };
                let what = match &e.what {
                    What::Listen => None,
                    What::Stream {
                        role, mode, smc, ..
                    } => Some((*role, *mode, smc.clone())),
                };
                live.push(Live { what, info });
            }
        }
        drop(new);
        let found = ctx::endpoints_and_devices(refresh_devices);
        // (no devices yet, before the first socket opens them: looked at
        // again at the next look, not DEVICE_PERIOD later)
        let refresh_devices = refresh_devices && found.is_some();
        let (eps, devs) = found.unwrap_or_default();
        let dev_index = |sh: &Arc<Shared>| eps.iter().position(|(_, s)| Arc::ptr_eq(s, sh));
        // every endpoint's link groups and message counts, one lock each
        let mut groups: Vec<LgrSeen> = Vec::new();
        let mut msgs = MsgCounts::default();
        let mut bufs = BufCounts::default();
        for (di, (_, sh)) in eps.iter().enumerate() {
            let mut ep = sh.lock();
            // (the completions of CDCs that no one waited for: this look's
            // `tx_fin` shows those that came, and the next the rest; a
            // failure is the link's, for the next pump)
            let _ = ep.settle_sends();
            let m = ep.msg_counts();
            msgs.cdc_sent += m.cdc_sent;
            msgs.cdc_received += m.cdc_received;
            msgs.llc_sent += m.llc_sent;
            msgs.llc_received += m.llc_received;
            let b = ep.buf_counts();
            bufs.alloc += b.alloc;
            bufs.reuse += b.reuse;
            bufs.rmb_downgrade += b.rmb_downgrade;
            bufs.tx_full += b.tx_full;
            bufs.tx_too_small += b.tx_too_small;
            bufs.tx_peer_too_small += b.tx_peer_too_small;
            for l in ep.link_group_ids() {
                if let Some(d) = ep.lgr_diag(l) {
                    groups.push((di, l, d));
                }
            }
        }
        let ids: Vec<u32> = groups
            .iter()
            .map(|(di, _, d)| watch.lg_id(&self.dir, (eps[*di].0.clone(), d.id)))
            .collect();
        let id_of = |di: usize, l: LgrId| {
            groups
                .iter()
                .zip(&ids)
                .find(|((d, x, _), _)| *d == di && *x == l)
                .map(|((_, _, g), id)| (*id, g))
        };
        let mut sockets = Vec::new();
        // LG-ID -> (conns, conns per link slot)
        let mut lgr_conns: HashMap<u32, (u32, [u32; 3])> = HashMap::new();
        let mut usage = (0u64, 0u64);
        let mut bytes = self.retired.get();
        let mut ending = false;
        let mut rx_hist = hist_get(&self.retired.rx_hist);
        let mut tx_hist = hist_get(&self.retired.tx_hist);
        // the engine's facts of the SMC-R connections, a batch of them per
        // hold of their endpoint's lock
        let mut facts: Vec<Option<(Option<usize>, Facts)>> = vec![None; live.len()];
        // (endpoint, [(index in `live`, connection)])
        type ByEndpoint = Vec<(Arc<Shared>, Vec<(usize, ConnId)>)>;
        let mut by_ep: ByEndpoint = Vec::new();
        for (i, l) in live.iter().enumerate() {
            if let Some((_, Mode::SmcR, Some((sh, id, _)))) = &l.what {
                let Some(sh) = sh.upgrade() else { continue };
                match by_ep.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &sh)) {
                    Some((_, v)) => v.push((i, *id)),
                    None => by_ep.push((sh, vec![(i, *id)])),
                }
            }
        }
        for (sh, list) in &by_ep {
            let di = dev_index(sh);
            for batch in list.chunks(LOCK_BATCH) {
                let ep = sh.lock();
                for &(i, id) in batch {
                    facts[i] = Some((
                        di,
                        Facts {
                            state: ep.close_state(id),
                            diag: ep.conn_diag(id),
                        },
                    ));
                }
            }
        }
        let fmt_addr = |a: Option<SocketAddr>| a.map(|a| a.to_string());
        for (l, fact) in live.iter().zip(&facts) {
            let mut s = json!({
                "inode": l.info.inode,
                "uid": l.info.uid,
                "local": fmt_addr(l.info.local),
                "peer": fmt_addr(l.info.peer),
                "intf": 0,
            });
            match &l.what {
                None => {
                    s["state"] = json!("LISTEN");
                    s["state_num"] = json!(10);
                    s["mode"] = json!(null);
                }
                Some((role, Mode::Tcp(f), _)) => {
                    s["state"] = json!("ACTIVE");
                    s["state_num"] = json!(1);
                    s["mode"] = json!("TCP");
                    s["role"] = json!(role_name(*role));
                    s["fallback"] = json!({
                        "reason": f.code(),
                        "peer": f.peer.map(|p| p.to_u32()),
                    });
                }
                Some((role, Mode::SmcR, smc)) => {
                    s["mode"] = json!("SMCR");
                    s["role"] = json!(role_name(*role));
                    let mut state = CloseState::Closed;
                    if let Some((_, _, st)) = smc {
                        ending |= st.retired.load(Relaxed);
                        if !st.retired.load(Relaxed) {
                            let [a, b, c, d] = st.get();
                            s["rx_bytes"] = json!(a);
                            s["tx_bytes"] = json!(b);
                            s["rx_cnt"] = json!(c);
                            s["tx_cnt"] = json!(d);
                            bytes[0] += a;
                            bytes[1] += b;
                            bytes[2] += c;
                            bytes[3] += d;
                            for (x, y) in rx_hist.iter_mut().zip(hist_get(&st.rx_hist)) {
                                *x += y;
                            }
                            for (x, y) in tx_hist.iter_mut().zip(hist_get(&st.tx_hist)) {
                                *x += y;
                            }
                        }
                        if let Some((di, f)) = fact {
                            if let Some(cs) = f.state {
                                state = cs;
                            }
                            if let Some(d) = f.diag {
                                self.describe(&mut s, &d, *di, &id_of, &eps, &mut lgr_conns);
                                if !matches!(state, CloseState::Closed) {
                                    usage.0 += d.rmbe_len as u64;
                                    usage.1 += d.sndbuf_len as u64;
                                }
                            }
                        }
                    }
                    let (name, num) = state_name(state);
                    s["state"] = json!(name);
                    s["state_num"] = json!(num);
                    s["shutdown"] = json!(shutdown_of(state));
                }
            }
            sockets.push(s);
        }
        // link groups of every endpoint, idle ones included
        let mut lgrs = Vec::new();
        let mut links_on: HashMap<String, (u32, bool)> = HashMap::new();
        for ((di, l, g), id) in groups.iter().zip(&ids) {
            let dev = &eps[*di].0;
            let (conns, per_link) = lgr_conns.get(id).copied().unwrap_or_default();
            let mut links = Vec::new();
            let mut usable = 0;
            for k in &g.links {
                let active = k.state == LinkState::Active;
                usable += usize::from(active);
                let link_id = if k.link_id == 0 {
                    k.slot as u8 + 1
                } else {
                    k.link_id
                };
                links.push(json!({
                    "id": link_id,
                    "slot": k.slot,
                    "uid": id | u32::from(link_id),
                    "peer_uid": k.peer_link_uid,
                    "state": link_state_name(k.state),
                    "conns": per_link.get(k.slot).copied().unwrap_or(0),
                    "qp": k.qpn,
                    "peer_qp": k.peer_qpn,
                    "gid": gid_str(&k.gid),
                    "peer_gid": gid_str(&k.peer_gid),
                    "ib_dev": dev,
                    "ib_port": 1,
                }));
            }
            let ty = match usable {
                0 => "NONE",
                1 => "SINGLE",
                _ => "SYM",
            };
            let e = links_on.entry(dev.clone()).or_default();
            e.0 += links.len() as u32;
            e.1 |= ty == "SINGLE";
            let role = match g.role {
                smc_proto::link::Role::Client => Role::Client,
                smc_proto::link::Role::Server => Role::Server,
            };
            lgrs.push(json!({
                "id": id,
                "device": dev,
                "index": l.slot(),
                "role": role_name(role),
                "type": ty,
                "state": format!("{:?}", g.state).to_uppercase(),
                "vlan": 0,
                "conns": conns,
                "version": g.version,
                "release": g.release,
                // (v2: the peer's first-contact extension, the agreed EID)
                "peer_host": g.peer_v2.as_ref().map(|p| p.host.clone()),
                "peer_os": g.peer_v2.as_ref().map(|p| p.os),
                "direct": g.peer_v2.as_ref().map(|p| p.direct),
                "eid": g.eid.map(|e| String::from_utf8_lossy(&e.0).trim_end_matches([' ', '\0']).to_string()),
                "peer_system_id": g.peer_system_id.0.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                "gid": gid_str(&g.gid),
                "links": links,
            }));
        }
        watch.lg_ids.retain(|_, id| ids.contains(id));
        if refresh_devices {
            let pnet = smc_config::pnet::PnetTable::load(&smc_config::store::ConfigDir::from_env())
                .unwrap_or_default();
            let list: Vec<Value> = devs
                .iter()
                .map(|(kind, d)| {
                    let ports: Vec<Value> = d
                        .ports
                        .iter()
                        .map(|p| {
                            let id = pnet.pnetid_of_port(&d.name, p.port_num).or_else(|| {
                                p.netdev.as_deref().and_then(|n| pnet.pnetid_of_interface(n))
                            });
                            json!({
                                "port": p.port_num,
                                "net_dev": p.netdev,
                                "state": if p.state == smc_rdma::PortState::Active { "ACTIVE" } else { "INACTIVE" },
                                "pnet_id": id.map(|i| i.as_str().to_string()),
                                "pnet_user": id.is_some(),
                            })
                        })
                        .collect();
                    json!({"ib_dev": d.name, "kind": kind.as_str(), "ports": ports})
                })
                .collect();
            *devices = (Some(Instant::now()), Value::Array(list));
        }
        let mut devs_json = devices.1.clone();
        if let Value::Array(list) = &mut devs_json {
            for d in list.iter_mut() {
                let name = d["ib_dev"].as_str().unwrap_or_default().to_string();
                let (links, crit) = links_on.get(&name).copied().unwrap_or_default();
                d["links"] = json!(links);
                d["crit"] = json!(crit);
                d["in_use"] = json!(eps.iter().any(|(n, _)| *n == name));
            }
        }
        let per_side = |a: &[AtomicU64; 2]| json!({"client": a[0].load(Relaxed), "server": a[1].load(Relaxed)});
        let by_code = |m: &Mutex<BTreeMap<(usize, u32), u64>>| {
            let m = lock(m);
            let mut v = json!({"client": {}, "server": {}});
            for ((s, code), n) in m.iter() {
                let side = if *s == 0 { "client" } else { "server" };
                v[side][format!("{code:#010x}")] = json!(n);
            }
            v
        };
        let (err_counts, err_last) = {
            let e = lock(&self.errors_by_kind);
            let mut counts = serde_json::Map::new();
            let mut last = serde_json::Map::new();
            for (k, (n, m)) in e.iter() {
                counts.insert((*k).to_string(), json!(n));
                last.insert((*k).to_string(), json!(m));
            }
            (Value::Object(counts), Value::Object(last))
        };
        let doc = json!({
            "errors": err_last,
            "sockets": sockets,
            "link_groups": lgrs,
            "devices": devs_json,
            "counters": {
                "smc": per_side(&self.smc),
                "fallback": per_side(&self.fallback),
                "handshake_errors": per_side(&self.hs_err),
                "fallback_reasons": by_code(&self.reasons),
                "peer_decline_reasons": by_code(&self.peer_reasons),
                "rx_bytes": bytes[0],
                "tx_bytes": bytes[1],
                "rx_cnt": bytes[2],
                "tx_cnt": bytes[3],
                "rx_hist": hist_json(&rx_hist),
                "tx_hist": hist_json(&tx_hist),
                "rmb_hist": hist_json(&hist_get(&self.rmb_hist)),
                "sndbuf_hist": hist_json(&hist_get(&self.sndbuf_hist)),
                "cdc_sent": msgs.cdc_sent,
                "cdc_received": msgs.cdc_received,
                "llc_sent": msgs.llc_sent,
                "llc_received": msgs.llc_received,
                // (the engine takes and registers an RMB and a send buffer
                // together: each count is half of its pairs)
                "rmb_alloc": bufs.alloc / 2,
                "sndbuf_alloc": bufs.alloc / 2,
                "rmb_reuse": bufs.reuse / 2,
                "sndbuf_reuse": bufs.reuse / 2,
                "rmb_downgrade": bufs.rmb_downgrade,
                "tx_full": bufs.tx_full,
                "tx_too_small": bufs.tx_too_small,
                "tx_peer_too_small": bufs.tx_peer_too_small,
                "link_up": self.link_up.load(Relaxed),
                "link_down": self.link_down.load(Relaxed),
                "conn_moves": self.failover.load(Relaxed),
                "aborts": self.aborts.load(Relaxed),
                "registry_errors": self.errors.load(Relaxed),
                "errors": err_counts,
            },
            "gauges": {"rmb_usage": usage.0, "sndbuf_usage": usage.1},
        });
        (doc, ending)
    }

    /// An SMC-R socket's engine facts into its JSON: token, buffers,
    /// cursors, its link group and link (counted there).
    fn describe<'g>(
        &self,
        s: &mut Value,
        d: &ConnDiag,
        di: Option<usize>,
        id_of: &dyn Fn(usize, LgrId) -> Option<(u32, &'g LgrDiag)>,
        eps: &[(String, Arc<Shared>)],
        lgr_conns: &mut HashMap<u32, (u32, [u32; 3])>,
    ) {
        s["token"] = json!(d.token);
        s["sndbuf"] = json!(d.sndbuf_len);
        s["rmb"] = json!(d.rmbe_len);
        s["peer_rmb"] = json!(d.peer_rmbe_len);
        if let Some(c) = d.cursors {
            s["cursors"] = json!({
                "rx_prod": cursor_json(c.rx_prod),
                "rx_cons": cursor_json(c.rx_cons),
                "tx_prod": cursor_json(c.tx_prod),
                "tx_cons": cursor_json(c.tx_cons),
                "tx_prep": cursor_json(c.tx_prep),
                "tx_sent": cursor_json(c.tx_sent),
                "tx_fin": cursor_json(c.tx_fin),
            });
            s["rx_flags"] = json!(c.rx_flags);
            s["tx_flags"] = json!(c.tx_flags);
        }
        let (Some(di), Some(lg)) = (di, d.lgr) else {
            return;
        };
        s["device"] = json!(eps[di].0);
        let Some((id, g)) = id_of(di, lg) else { return };
        s["lgr_id"] = json!(id);
        let e = lgr_conns.entry(id).or_default();
        e.0 += 1;
        if let Some(slot) = d.link {
            if let Some(x) = e.1.get_mut(slot) {
                *x += 1;
            }
            if let Some(k) = g.links.iter().find(|k| k.slot == slot) {
                let link_id = if k.link_id == 0 {
                    slot as u8 + 1
                } else {
                    k.link_id
                };
                s["link_id"] = json!(link_id);
                s["gid"] = json!(gid_str(&k.gid));
                s["peer_gid"] = json!(gid_str(&k.peer_gid));
                s["ib_port"] = json!(1);
            }
        }
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Client => "CLNT",
        Role::Server => "SERV",
    }
}
