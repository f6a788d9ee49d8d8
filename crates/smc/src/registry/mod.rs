//! The live registry: what this process's SMC sockets, link groups, links
//! and devices are doing, and its counters, published for `smcss` and
//! `smcr` (smc-tools' views of the kernel's sock_diag and `SMC_GEN_NETLINK`,
//! `tools.md` §4). There is no kernel socket table here: each process
//! publishes a file of its own in the user's run directory ([`files`]),
//! rewritten whole (temporary file + rename) by a registry thread at most
//! every 100 ms after a connection event, else at most once a second while
//! something may have changed, and only when its content changed.
//!
//! The data path does not pay for it: sockets are registered at connection
//! events (one short lock per connection), counted bytes are relaxed atomic
//! adds in the connection's own counters, and everything else (addresses,
//! engine state, devices) is looked at by the registry thread.
//! `SMC_RS_REGISTRY=0` turns the registry off for the process.

pub mod files;

use crate::ctx::{self, Role, Shared};
use crate::stream::Mode;
use serde_json::{json, Value};
use smc_config::store::Table;
use smc_engine::endpoint::ConnId;
use smc_proto::close::CloseState;
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Bytes and requests (successful reads and writes) of an SMC-R
/// connection; added to the process's totals when the connection ends.
#[derive(Default)]
pub(crate) struct ConnStats {
    rx_bytes: AtomicU64,
    tx_bytes: AtomicU64,
    rx_cnt: AtomicU64,
    tx_cnt: AtomicU64,
    retired: AtomicBool,
}

impl ConnStats {
    /// A read that returned `n` bytes.
    #[inline]
    pub(crate) fn rx(&self, n: usize) {
        self.rx_bytes.fetch_add(n as u64, Relaxed);
        self.rx_cnt.fetch_add(1, Relaxed);
    }

    /// A write that took `n` bytes.
    #[inline]
    pub(crate) fn tx(&self, n: usize) {
        self.tx_bytes.fetch_add(n as u64, Relaxed);
        self.tx_cnt.fetch_add(1, Relaxed);
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
    /// A connection event since the last snapshot.
    changed: AtomicBool,
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
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn registry() -> Option<&'static Registry> {
    static R: OnceLock<Option<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        if std::env::var("SMC_RS_REGISTRY").is_ok_and(|v| v == "0") {
            return None;
        }
        Some(Registry {
            dir: files::run_dir(),
            entries: Mutex::new(Vec::new()),
            changed: AtomicBool::new(true),
            thread: Once::new(),
            smc: Default::default(),
            fallback: Default::default(),
            hs_err: Default::default(),
            reasons: Mutex::new(BTreeMap::new()),
            peer_reasons: Mutex::new(BTreeMap::new()),
            retired: ConnStats::default(),
            errors: AtomicU64::new(0),
            errors_by_kind: Mutex::new(BTreeMap::new()),
        })
    })
    .as_ref()
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
    if let Some(r) = registry() {
        r.start();
    }
}

impl Registry {
    fn add(&'static self, e: Entry) {
        lock(&self.entries).push(e);
        self.changed.store(true, Relaxed);
        self.start();
    }

    fn start(&'static self) {
        self.thread.call_once(|| {
            // (no thread, no registry: the connection works all the same;
            // the failure is counted where the tools can see it if a later
            // start succeeds)
            if std::thread::Builder::new()
                .name("smc-registry".into())
                .spawn(move || self.run())
                .is_err()
            {
                self.errors.fetch_add(1, Relaxed);
            }
        });
    }
}

/// Keeps a socket listed while it lives (for sockets not held in an
/// `Arc<TcpStream>`: the tokio adapter's fallback connections).
#[cfg(feature = "tokio")]
pub(crate) struct Token(#[allow(dead_code)] Arc<()>);

/// A TCP (fallback) connection of the tokio adapter, established: counted,
/// and listed while the returned token lives.
#[cfg(feature = "tokio")]
pub(crate) fn stream_fd(fd: BorrowedFd<'_>, role: Role, mode: Mode) -> Option<Token> {
    let r = registry()?;
    r.count(role, mode);
    let token = Arc::new(());
    let weak: Weak<()> = Arc::downgrade(&token);
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
    let token = Arc::new(());
    let mut es = lock(&r.entries);
    let e = es.iter_mut().find(|e| match &e.what {
        What::Stream { tcp: t, .. } => std::ptr::eq(t.as_ptr(), Arc::as_ptr(tcp)),
        What::Listen => false,
    })?;
    if e.info.is_none() {
        e.info = Some(info_of(tcp.as_fd()));
    }
    let weak: Weak<()> = Arc::downgrade(&token);
    e.alive = weak;
    Some(Token(token))
}

impl Registry {
    fn count(&self, role: Role, mode: Mode) {
        let s = side(role);
        match mode {
            Mode::SmcR => {
                self.smc[s].fetch_add(1, Relaxed);
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
    let Some(r) = registry() else { return };
    r.count(role, mode);
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

/// A listener: listed while `alive` lives.
pub(crate) fn listener<T: Any + Send + Sync>(alive: &Arc<T>, fd: BorrowedFd<'_>) {
    let Some(r) = registry() else { return };
    let weak: Weak<T> = Arc::downgrade(alive);
    r.add(Entry {
        alive: weak,
        what: What::Listen,
        info: Some(info_of(fd)),
    });
}

/// Something failed that would otherwise only show as "no SMC device" or a
/// fallback (a device that does not open, a broken configuration, a thread
/// that cannot start): counted by `kind`, the last message kept, both
/// published (`counters.errors`, `errors`).
pub(crate) fn error(kind: &'static str, msg: String) {
    if let Some(r) = registry() {
        let mut e = lock(&r.errors_by_kind);
        let slot = e.entry(kind).or_insert((0, String::new()));
        slot.0 += 1;
        slot.1 = msg;
        r.changed.store(true, Relaxed);
    }
}

/// A handshake failed: the connection is closed (neither SMC-R nor TCP).
pub(crate) fn handshake_error(role: Role) {
    if let Some(r) = registry() {
        r.hs_err[side(role)].fetch_add(1, Relaxed);
        r.changed.store(true, Relaxed);
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

/// Host-unique-ish LG-ID: the low 16 bits of the pid, then 8 bits of
/// (device, group), then the link id byte (smc-tools masks it off).
fn lg_id(pid: u32, dev: usize, lgr: usize) -> u32 {
    ((pid & 0xffff) << 16) | ((((dev << 5) + lgr) as u32 & 0xff) << 8)
}

const EVENT_PERIOD: Duration = Duration::from_millis(100);
/// A snapshot and the pause after it take at least this many times the
/// snapshot's own time (the thread's CPU share stays under 2 %).
const COST_FACTOR: u32 = 50;
/// Connections looked at per hold of an endpoint's lock.
const LOCK_BATCH: usize = 256;
const IDLE_PERIOD: Duration = Duration::from_secs(1);
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
    token: Option<u32>,
    lgr: Option<usize>,
    link: Option<usize>,
}

/// Per device: its link groups' roles seen (an idle group has no
/// connection to tell).
type Roles = HashMap<(String, usize), Role>;

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
        let mut roles = Roles::new();
        // (a snapshot of many sockets costs more: the next waits at least
        // COST_FACTOR times as long as the last took, so that the thread
        // takes a bounded share of a CPU and of the endpoints' locks)
        let mut not_before = Instant::now();
        loop {
            std::thread::sleep(EVENT_PERIOD);
            if Instant::now() < not_before {
                continue;
            }
            let event = self.changed.swap(false, Relaxed);
            if !event && last_look.elapsed() < IDLE_PERIOD {
                continue;
            }
            last_look = Instant::now();
            let refresh = devices.0.is_none_or(|t| t.elapsed() >= DEVICE_PERIOD);
            let body = self.snapshot(pid, &mut roles, refresh, &mut devices);
            let Some(body) = body else { continue };
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
            if last == Some(hash) {
                continue;
            }
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
            not_before = last_look + last_look.elapsed() * COST_FACTOR;
        }
    }

    /// The process's state as JSON (without the header).
    fn snapshot(
        &self,
        pid: u32,
        roles: &mut Roles,
        refresh_devices: bool,
        devices: &mut (Option<Instant>, Value),
    ) -> Option<Value> {
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
        let (rmb_len, sndbuf_len) = ctx::buffer_sizes();
        let (eps, devs) = ctx::endpoints_and_devices(refresh_devices).unwrap_or_default();
        let dev_index = |sh: &Arc<Shared>| eps.iter().position(|(_, s)| Arc::ptr_eq(s, sh));
        // per endpoint: the connections' engine facts, under one lock
        let mut sockets = Vec::new();
        // (device index, lgr) -> (conns, conns per link slot)
        let mut lgr_conns: BTreeMap<(usize, usize), (u32, [u32; 3])> = BTreeMap::new();
        let mut usage = (0u64, 0u64);
        let mut bytes = self.retired.get();
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
                            token: ep.alert_token(id),
                            lgr: ep.link_group_of(id),
                            link: ep.link_of(id),
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
                        }
                        if let Some((di, f)) = fact {
                            if let Some(cs) = f.state {
                                state = cs;
                            }
                            s["token"] = json!(f.token);
                            if let (Some(di), Some(lg)) = (*di, f.lgr) {
                                let slot = f.link;
                                s["device"] = json!(eps[di].0);
                                s["lgr_id"] = json!(lg_id(pid, di, lg));
                                s["link_id"] = json!(slot.map(|x| x + 1));
                                roles.entry((eps[di].0.clone(), lg)).or_insert(*role);
                                let e = lgr_conns.entry((di, lg)).or_default();
                                e.0 += 1;
                                if let Some(x) = slot.filter(|x| *x < 3) {
                                    e.1[x] += 1;
                                }
                            }
                            if !matches!(state, CloseState::Closed) {
                                usage.0 += rmb_len as u64;
                                usage.1 += sndbuf_len as u64;
                            }
                        }
                    }
                    let (name, num) = state_name(state);
                    s["state"] = json!(name);
                    s["state_num"] = json!(num);
                    s["shutdown"] = json!(shutdown_of(state));
                    s["sndbuf"] = json!(sndbuf_len);
                    s["rmb"] = json!(rmb_len);
                }
            }
            sockets.push(s);
        }
        // link groups of every endpoint, idle ones included
        let mut lgrs = Vec::new();
        let mut links_on: HashMap<String, (u32, bool)> = HashMap::new();
        for (di, (dev, sh)) in eps.iter().enumerate() {
            let ep = sh.lock();
            let n = ep.link_groups();
            let (mut found, mut l) = (0, 0);
            while found < n && l < 4096 {
                if let Some(st) = ep.link_group_state(l) {
                    found += 1;
                    let usable = ep.usable_links(l);
                    let (conns, per_link) = lgr_conns.get(&(di, l)).copied().unwrap_or_default();
                    let id = lg_id(pid, di, l);
                    let mut links = Vec::new();
                    for (slot, on_link) in per_link.iter().enumerate() {
                        let Some(qp) = ep.link_qp_num(l, slot) else {
                            continue;
                        };
                        let active = usable.contains(&slot);
                        links.push(json!({
                            "id": slot + 1,
                            "uid": id | (slot as u32 + 1),
                            "state": if active { "LINK_ACTIVE" } else { "LINK_ACTIVATING" },
                            "conns": on_link,
                            "qp": qp,
                            "ib_dev": dev,
                            "ib_port": 1,
                        }));
                    }
                    let ty = match usable.len() {
                        0 => "NONE",
                        1 => "SINGLE",
                        _ => "SYM",
                    };
                    let e = links_on.entry(dev.clone()).or_default();
                    e.0 += links.len() as u32;
                    e.1 |= ty == "SINGLE";
                    lgrs.push(json!({
                        "id": id,
                        "device": dev,
                        "index": l,
                        "role": roles.get(&(dev.clone(), l)).map(|r| role_name(*r)),
                        "type": ty,
                        "state": format!("{st:?}").to_uppercase(),
                        "vlan": 0,
                        "conns": conns,
                        "links": links,
                    }));
                }
                l += 1;
            }
        }
        roles.retain(|(d, l), _| lgrs.iter().any(|g| g["device"] == *d && g["index"] == *l));
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
        Some(json!({
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
                "registry_errors": self.errors.load(Relaxed),
                "errors": err_counts,
            },
            "gauges": {"rmb_usage": usage.0, "sndbuf_usage": usage.1},
        }))
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Client => "CLNT",
        Role::Server => "SERV",
    }
}
