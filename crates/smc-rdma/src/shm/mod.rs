//! `shm`: a shared-memory RDMA device for processes on one host (also in
//! different network namespaces of that host).
//!
//! * Devices are declared in a [`ShmConfig`] and bound to a network
//!   interface. The GID table derives from it as RoCE does: a RoCE v1 GID
//!   (and its v2 twin) from the MAC's link-local address, and RoCE v2 GIDs
//!   from the interface's IP addresses. The port state follows the
//!   interface's operational state (polled by a per-device event thread).
//! * A device may be opened any number of times, by one process or many, as
//!   processes share the port of a real RNIC: every opening (an *instance*)
//!   sees the same GID table and has its own QPs, regions and PDs. QPs are
//!   addressed by (GID, QPN), as in SMC's CLC messages; QP numbers are unique
//!   per rundir (so host-wide for every GID), allocated from a lock-protected
//!   registry in the rundir and never reused while their QP lives.
//! * Every instance listens on its own unix `SOCK_SEQPACKET` socket in the
//!   rundir and registers its GIDs and QPs there (see [`registry`]). At RTR
//!   a QP dials the instance owning the peer's (GID, QPN) and hands it its
//!   receive ring (a sealed memfd) and its channels' eventfds, with a proof
//!   of the peer's PSN; the peer uses them only once it checked the proof
//!   (at its RTS), and hands out a region only on that connection, after a
//!   second proof over both PSNs, only for its own QP's protection domain
//!   and only if registered for remote access ([`wire`] has the protocol,
//!   the crate README the threat model).
//! * Registered memory is memfd-backed (`pd.alloc_mr`), so an RDMA WRITE is
//!   one memcpy straight into the peer's mapping. The remote-access regions
//!   of a PD are ranges of a few memfds of that PD (`arena.rs`), handed out
//!   as (memfd, offset, length); the peer maps only the range. The writer
//!   checks bounds and access against what the owner told it (and the
//!   region's validity word, so deregistration stops a correct writer at
//!   once); these checks catch bugs, the owner's protection is that it
//!   hands a region only to the QP it is meant for. A violation completes
//!   the WR with `RemoteAccessError` and moves the writer's QP to ERR;
//!   nothing outside the region is ever touched.
//! * SENDs (and WRITE WITH IMMEDIATE) are slots of the peer's receive ring,
//!   published with a release store *after* any earlier WRITE's copy, so the
//!   receiver sees written data before a later SEND (RC ordering). The
//!   receiver moves published slots into its posted receive buffers when its
//!   CQ is polled; the slot's state word is the ACK. With no receive posted
//!   the slot waits (RNR) until `rnr_retry` is exhausted (7 = forever). The
//!   receiver keeps its own consumer index (and the sender its producer
//!   index) in process memory: ring words the peer can write are signals,
//!   never bookkeeping.
//! * Descriptors: a mapping keeps no descriptor. The remote-access regions
//!   of a PD share a few memfds (kept to hand them out); a local-only
//!   region, a peer's region or ring, keep none. A connected QP holds the
//!   socket it dialed, the socket its peer dialed and the peer's channel
//!   eventfd(s).
//! * There is no data-path thread: posting copies in the caller's thread, and
//!   polling a CQ makes progress. The device thread only handles rendezvous,
//!   region requests, port state, heartbeats and peer death (socket hang-up
//!   or a heartbeat that stops for `peer_timeout`), moving QPs to ERR with a
//!   `QpFatal` event. It never blocks on a peer (non-blocking sockets) nor
//!   for long on a QP lock, and keeps one descriptor in reserve so that a
//!   process out of descriptors refuses new connections instead of spinning.
//!
//! This module has no `unsafe`: mapping and raw copies live in [`crate::sys`].
#![forbid(unsafe_code)]

mod arena;
pub mod layout;
pub mod registry;
pub mod wire;

use arena::Arena;

use registry::Registry;
pub use registry::{QPN_MAX, QPN_MIN};

use crate::sys::{self, EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use layout::*;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use wire::{Kind, Msg};

pub use layout::SLOT_PAYLOAD as MAX_SEND_SIZE;

/// Inline payloads are copied at post time: an inline RDMA WRITE posted on an
/// idle send queue goes straight from the caller's buffer into the peer's
/// region (one copy, like a CPU store), so any size up to the largest region
/// is allowed. Behind queued WRs it is kept in a heap copy until its turn.
const MAX_INLINE: u32 = 1 << 30;

/// Largest region (`alloc_mr`), and the largest a peer may announce.
const MAX_REGION: usize = (1 << 32) - HDR;

/// How long a dialer waits for the acceptor to take its hello, and a
/// region request for its answer.
const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// Accepted connections that have not sent their hello yet (a stranger can
/// open many; more are closed at once).
const MAX_PENDING: usize = 64;
/// How long an accepted connection may take to send its hello.
const PENDING_WAIT: Duration = Duration::from_secs(2);
/// Unverified hellos held per QP (before its RTS).
const MAX_CANDIDATES: usize = 4;
/// Hellos with a wrong proof a QP refuses before it refuses all hellos (each
/// is a 2^-24 guess of a PSN; the bound keeps the odds of a stranger's
/// guess at 2^-20).
const MAX_BAD_HELLOS: u32 = 16;
/// Region requests that may wait for the peer's authentication.
const MAX_DEFERRED: usize = 64;
/// The peer's RNR timer is clamped to this (IB's largest is 491.52 ms).
const MAX_RNR_TIMER: Duration = Duration::from_secs(1);

/// A map keyed by keys, QP numbers and GIDs, looked up for every WR: hashed
/// with a multiply-rotate (FxHash's) instead of SipHash, which cost more than
/// the rest of a 64-byte RDMA WRITE's checks. Keys are random, and only this
/// device inserts entries (its own keys and QPs, and regions the peer
/// handed us), so the hash needs no protection against chosen collisions.
type KeyMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// See [`KeyMap`].
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Locks `m` unless it stays held for longer than `limit`.
fn lock_within<T>(m: &Mutex<T>, limit: Duration) -> Option<MutexGuard<'_, T>> {
    let start = Instant::now();
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if start.elapsed() >= limit {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

fn random_u64() -> Result<u64> {
    Ok(wire::random_u64()?)
}

/// A random 32-bit key not yet in `map` (and never 0).
fn fresh_key<V>(map: &KeyMap<u32, V>) -> Result<u32> {
    loop {
        let k = random_u64()? as u32;
        if k != 0 && !map.contains_key(&k) {
            return Ok(k);
        }
    }
}

// ------------------------------------------------------------------ config

/// One declared device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmDeviceConfig {
    /// Device name (`shm0`).
    pub name: String,
    /// The network interface it is bound to.
    pub netdev: String,
}

/// `shm` provider configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Declared devices.
    pub devices: Vec<ShmDeviceConfig>,
    /// Directory of the rendezvous sockets (shared by all netns of the host).
    pub rundir: PathBuf,
    /// A peer whose heartbeat stops this long is declared dead.
    pub peer_timeout: Duration,
    /// Period of the device thread (port state, heartbeats).
    pub poll_interval: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            devices: vec![],
            rundir: default_rundir(),
            peer_timeout: Duration::from_millis(1000),
            poll_interval: Duration::from_millis(20),
        }
    }
}

/// `$SMC_RDMA_RUNDIR`, else `/run/smc-rs` if usable (created mode 1777 if
/// missing, see the README's threat model), else `$XDG_RUNTIME_DIR/smc-rs`,
/// else `/tmp/smc-rs`.
pub fn default_rundir() -> PathBuf {
    if let Some(d) = std::env::var_os("SMC_RDMA_RUNDIR") {
        return d.into();
    }
    let run = PathBuf::from("/run/smc-rs");
    if registry::create_rundir(&run).is_ok() {
        return run;
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(x).join("smc-rs");
    }
    PathBuf::from("/tmp/smc-rs")
}

impl ShmConfig {
    /// Parses the text form:
    ///
    /// ```text
    /// # comment
    /// rundir /run/smc-rs
    /// peer_timeout_ms 1000
    /// poll_interval_ms 20
    /// device shm0 netdev eth0
    /// ```
    pub fn parse(text: &str) -> Result<ShmConfig> {
        let mut c = ShmConfig::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let w: Vec<&str> = line.split_whitespace().collect();
            let bad = || Error::Config(format!("line {}: cannot parse {line:?}", n + 1));
            let ms = |s: &str| {
                s.parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|_| bad())
            };
            match w.as_slice() {
                ["rundir", d] => c.rundir = PathBuf::from(d),
                ["peer_timeout_ms", v] => c.peer_timeout = ms(v)?,
                ["poll_interval_ms", v] => c.poll_interval = ms(v)?,
                ["device", name, "netdev", nd] => {
                    if c.devices.iter().any(|d| d.name == *name) {
                        return Err(Error::Config(format!(
                            "line {}: device {name} declared twice",
                            n + 1
                        )));
                    }
                    c.devices.push(ShmDeviceConfig {
                        name: name.to_string(),
                        netdev: nd.to_string(),
                    })
                }
                _ => return Err(bad()),
            }
        }
        if c.poll_interval.is_zero() || c.peer_timeout < c.poll_interval * 2 {
            return Err(Error::Config(
                "need poll_interval > 0 and peer_timeout >= 2 * poll_interval".into(),
            ));
        }
        Ok(c)
    }

    /// Renders the text form.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "rundir {}\npeer_timeout_ms {}\npoll_interval_ms {}\n",
            self.rundir.display(),
            self.peer_timeout.as_millis(),
            self.poll_interval.as_millis()
        );
        for d in &self.devices {
            s += &format!("device {} netdev {}\n", d.name, d.netdev);
        }
        s
    }
}

// ------------------------------------------------------------------ netdev

// Interface facts come from the caller's network namespace (socket ioctls,
// getifaddrs), never from /sys/class/net: a process that entered a namespace
// with setns alone (`nsenter --net`) still sees the sysfs of the namespace that
// mounted it, which lacks our interfaces or has others under the same names.

fn netdev_up(netdev: &str) -> bool {
    sys::link(netdev).ok().flatten().is_some_and(|l| l.up)
}

fn netdev_mac(netdev: &str) -> Option<[u8; 6]> {
    sys::link(netdev).ok().flatten()?.mac
}

/// The RoCE-style GID table of `netdev`.
pub fn gid_table(netdev: &str) -> Vec<GidEntry> {
    let mut out = vec![];
    let mut push = |gid: Gid, t: GidType| {
        let index = out.len() as u16;
        out.push(GidEntry {
            index,
            gid,
            gid_type: t,
        });
    };
    if let Some(mac) = netdev_mac(netdev) {
        let g = Gid::roce_v1_link_local(smc_wire::types::Mac(mac));
        push(g, GidType::RoceV1);
        push(g, GidType::RoceV2);
    }
    let ll = netdev_mac(netdev).map(|m| Gid::roce_v1_link_local(smc_wire::types::Mac(m)));
    for ip in sys::if_addrs(netdev).unwrap_or_default() {
        let g = Gid::from_ip(ip);
        if Some(g) == ll {
            continue;
        }
        push(g, GidType::RoceV1);
        push(g, GidType::RoceV2);
    }
    out
}

// ------------------------------------------------------------------ device

/// The `shm` provider: enumerates and opens the configured devices.
#[derive(Clone, Debug)]
pub struct ShmProvider {
    cfg: Arc<ShmConfig>,
}

impl ShmProvider {
    /// A provider for `cfg`.
    pub fn new(cfg: ShmConfig) -> ShmProvider {
        ShmProvider { cfg: Arc::new(cfg) }
    }
    /// Reads the configuration from the file named by `$SMC_RDMA_SHM_CONFIG`.
    pub fn from_env() -> Result<ShmProvider> {
        let p = std::env::var_os("SMC_RDMA_SHM_CONFIG")
            .ok_or_else(|| Error::Config("SMC_RDMA_SHM_CONFIG is not set".into()))?;
        let text = std::fs::read_to_string(&p)?;
        Ok(ShmProvider::new(ShmConfig::parse(&text)?))
    }
    /// The configuration.
    pub fn config(&self) -> &ShmConfig {
        &self.cfg
    }
}

fn info_for(name: &str, netdev: &str) -> DeviceInfo {
    DeviceInfo {
        name: name.into(),
        ports: vec![port_attr(netdev)],
        max_msg_size: SLOT_PAYLOAD as u32,
        max_inline: MAX_INLINE,
    }
}

fn port_attr(netdev: &str) -> PortAttr {
    let mtu = sys::link(netdev).ok().flatten().map_or(1500, |l| l.mtu);
    PortAttr {
        port_num: 1,
        state: if netdev_up(netdev) {
            PortState::Active
        } else {
            PortState::Down
        },
        active_mtu: Mtu::for_ethernet_mtu(mtu as usize).unwrap_or(Mtu::Mtu256),
        gids: gid_table(netdev),
        netdev: Some(netdev.into()),
    }
}

impl Provider for ShmProvider {
    type Device = ShmDevice;
    type Pd = ShmPd;
    type Mr = ShmMr;
    type Cq = ShmCq;
    type Channel = ShmChannel;
    type Qp = ShmQp;

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(self
            .cfg
            .devices
            .iter()
            .map(|d| info_for(&d.name, &d.netdev))
            .collect())
    }

    fn open_device(&self, name: &str) -> Result<ShmDevice> {
        let d = self
            .cfg
            .devices
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| Error::NoSuchDevice(name.into()))?;
        ShmDevice::open(&self.cfg, d)
    }
}

/// A region registered here: its header page and bytes at `base` of `mem`,
/// a slice of its PD's arena chunk if it may be handed to a peer
/// (REMOTE_WRITE), else a mapping of its own without a descriptor. The
/// bookkeeping lives here, in process memory, never in the shared header a
/// peer can write.
struct LocalMr {
    lkey: u32,
    rkey: u32,
    pd: u32,
    mem: Arc<SharedMem>,
    base: usize,
    len: usize,
    iova: u64,
    access: Access,
    /// The arena range, given back (and its pages freed) when the last
    /// user of the region (a window lent, a WR being executed) is gone.
    _slice: Option<arena::Slice>,
}

impl LocalMr {
    /// Byte `off` of the region, in `mem`.
    fn at(&self, off: usize) -> usize {
        self.base + HDR + off
    }
}

struct DevShared {
    name: String,
    netdev: String,
    reg: Registry,
    tag: String,
    sock_path: PathBuf,
    links: Mutex<Vec<PathBuf>>,
    peer_timeout: Duration,
    poll_interval: Duration,
    /// A QP that has not met its verified peer this long after its RTR fails.
    rendezvous_timeout: Duration,
    port_up: AtomicBool,
    /// The ioctl socket the port state is read through: a tick needs no new
    /// descriptor (out of descriptors, a fresh socket per look failed, the
    /// port read as down and every QP of the device failed with it).
    probe: sys::LinkProbe,
    events: Mutex<VecDeque<AsyncEvent>>,
    event_fd: EventFd,
    lkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    rkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    qps: Mutex<KeyMap<u32, Weak<QpInner>>>,
    stop: AtomicBool,
    frozen: AtomicBool,
    /// Test hook: the port is down whatever the interface says.
    forced_down: AtomicBool,
    wake: EventFd,
}

impl DevShared {
    fn raise(&self, ev: AsyncEvent) {
        lock(&self.events).push_back(ev);
        self.event_fd.signal();
    }
    fn qp_list(&self) -> Vec<Arc<QpInner>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }
    /// Registers this instance under every current GID of the netdev (also
    /// GIDs that appeared since the last call).
    fn publish_gids(&self) {
        let mut gids: Vec<Gid> = gid_table(&self.netdev).iter().map(|g| g.gid).collect();
        gids.dedup();
        let new = self.reg.publish(&gids, &self.tag, &self.sock_path);
        let mut links = lock(&self.links);
        for p in new {
            if !links.contains(&p) {
                links.push(p);
            }
        }
    }
    fn unpublish(&self) {
        let links: Vec<PathBuf> = lock(&self.links).drain(..).collect();
        self.reg.unpublish(&links, &self.sock_path);
    }
    fn local_mr(&self, lkey: u32) -> Option<Arc<LocalMr>> {
        lock(&self.lkeys).get(&lkey).cloned()
    }
}

/// An opened `shm` device. A device may be opened any number of times, in
/// one process or in many: each opening is an instance with its own QPs,
/// regions and rendezvous socket, sharing the GIDs of the interface.
pub struct ShmDevice {
    sh: Arc<DevShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ShmDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmDevice({} on {})", self.sh.name, self.sh.netdev)
    }
}

impl ShmDevice {
    fn open(cfg: &ShmConfig, d: &ShmDeviceConfig) -> Result<ShmDevice> {
        use std::sync::atomic::AtomicU32;
        if sys::link(&d.netdev)?.is_none() {
            return Err(Error::Config(format!(
                "device {}: network interface {} does not exist",
                d.name, d.netdev
            )));
        }
        static INSTANCE: AtomicU32 = AtomicU32::new(0);
        registry::create_rundir(&cfg.rundir)?;
        let pid = std::process::id();
        let seq = INSTANCE.fetch_add(1, Relaxed);
        // The name only has to be unique; nothing is derived from it.
        let tag = format!("dev-{}-{pid}-{seq}-{:08x}", d.name, random_u64()? as u32);
        let reg = Registry::new(&cfg.rundir);
        let sock_path = reg.sock_path(&tag);
        let listener = {
            // Bind and listen under the lock: a concurrent sweep must never
            // see the socket file before it accepts connections.
            let g = reg.lock();
            reg.sweep(&g);
            let l = SeqPacket::listen(&sock_path)?;
            // Any user may connect (what they can get is decided by the
            // rendezvous proofs, see the README's threat model).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o666))?;
            l
        };
        listener.set_nonblocking()?;
        let sh = Arc::new(DevShared {
            name: d.name.clone(),
            netdev: d.netdev.clone(),
            reg,
            tag,
            sock_path,
            links: Mutex::new(vec![]),
            peer_timeout: cfg.peer_timeout,
            poll_interval: cfg.poll_interval,
            rendezvous_timeout: (cfg.peer_timeout * 8).max(Duration::from_secs(2)),
            port_up: AtomicBool::new(netdev_up(&d.netdev)),
            probe: sys::LinkProbe::new()?,
            events: Mutex::new(VecDeque::new()),
            event_fd: EventFd::new()?,
            lkeys: Mutex::new(KeyMap::default()),
            rkeys: Mutex::new(KeyMap::default()),
            qps: Mutex::new(KeyMap::default()),
            stop: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            forced_down: AtomicBool::new(false),
            wake: EventFd::new()?,
        });
        sh.publish_gids();
        let reserve = EventFd::new()?;
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("shm-{}", d.name))
            .spawn(move || device_thread(s2, listener, reserve));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                sh.unpublish();
                return Err(e.into());
            }
        };
        Ok(ShmDevice {
            sh,
            thread: Some(thread),
        })
    }

    /// Test hook: behave as if this process died — close every connection,
    /// stop the device thread (no more heartbeats) and unpublish the device.
    pub fn simulate_crash(&self) {
        self.sh.frozen.store(true, SeqCst);
        for qp in self.sh.qp_list() {
            let mut ctl = lock(&qp.ctl);
            ctl.out = None;
            ctl.inb = None;
            ctl.cands.clear();
        }
        self.sh.stop.store(true, SeqCst);
        self.sh.wake.signal();
    }

    /// Test hook: behave as if this process hung (no heartbeats, no answers).
    pub fn freeze(&self) {
        self.sh.frozen.store(true, SeqCst);
    }

    /// Test hook: behave as if the bound interface went down (`true`) or
    /// follow it again (`false`), for this instance only — for interfaces a
    /// test must not really take down, such as `lo`. Takes effect at the
    /// next device-thread tick, with the same events and QP errors as a real
    /// change of the interface.
    pub fn force_port_down(&self, down: bool) {
        self.sh.forced_down.store(down, SeqCst);
        self.sh.wake.signal();
    }

    /// The bound network interface.
    pub fn netdev(&self) -> &str {
        &self.sh.netdev
    }
}

impl Drop for ShmDevice {
    fn drop(&mut self) {
        self.sh.stop.store(true, SeqCst);
        self.sh.wake.signal();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.sh.unpublish();
    }
}

impl Device for ShmDevice {
    type P = ShmProvider;

    fn info(&self) -> DeviceInfo {
        info_for(&self.sh.name, &self.sh.netdev)
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(Error::NoSuchPort(port));
        }
        let mut p = port_attr(&self.sh.netdev);
        // Report the state the device thread acted on (events and QP errors
        // are consistent with it).
        p.state = if self.sh.port_up.load(Acquire) {
            PortState::Active
        } else {
            PortState::Down
        };
        Ok(p)
    }

    fn alloc_pd(&self) -> Result<ShmPd> {
        Ok(ShmPd {
            dev: self.sh.clone(),
            pd: random_u64()? as u32,
            arena: Arena::new(),
        })
    }

    fn create_channel(&self) -> Result<ShmChannel> {
        Ok(ShmChannel {
            inner: Arc::new(EventFd::new()?),
        })
    }

    fn create_cq(&self, _depth: u32, channel: Option<&ShmChannel>) -> Result<ShmCq> {
        Ok(ShmCq {
            inner: Arc::new(CqInner {
                entries: Mutex::new(VecDeque::new()),
                armed: AtomicBool::new(false),
                chan: channel.map(|c| c.inner.clone()),
                qps: Mutex::new(vec![]),
            }),
        })
    }

    fn poll_async_event(&self) -> Option<AsyncEvent> {
        let mut q = lock(&self.sh.events);
        let e = q.pop_front();
        // The descriptor is signalled once per event raised: with no event
        // queued there is nothing to drain (and no system call to make — the
        // engine asks on every pump).
        if e.is_some() && q.is_empty() {
            self.sh.event_fd.drain();
        }
        e
    }

    fn async_fd(&self) -> BorrowedFd<'_> {
        self.sh.event_fd.as_fd()
    }
}

// ------------------------------------------------------------------ device thread

/// What a polled socket is to the device thread.
enum Role {
    /// Accepted, no hello yet (index into the pending list).
    Pending(usize),
    /// A QP's inbound connection: the verified one or a candidate (by id).
    Inbound(Arc<QpInner>, u64),
    /// The connection a QP dialed (watched for hang-up only).
    Out(Arc<QpInner>),
}

fn device_thread(sh: Arc<DevShared>, listener: SeqPacket, reserve: EventFd) {
    let mut reserve = Some(reserve);
    let mut pending: Vec<(Arc<SeqPacket>, Instant)> = vec![];
    let mut accept_paused_until: Option<Instant> = None;
    let mut last_tick = Instant::now();
    let mut ticks: u64 = 0;
    while !sh.stop.load(Acquire) {
        if sh.frozen.load(Acquire) {
            // Hung on purpose (test hook): no answers, no heartbeats.
            let _ = sh.wake.wait(sh.poll_interval);
            continue;
        }
        let qps = sh.qp_list();
        // The sockets to watch, with the Arcs held across the poll so no
        // descriptor number is closed (and reused) under it.
        let mut socks: Vec<(Arc<SeqPacket>, Role, i16)> = vec![];
        for (i, (s, _)) in pending.iter().enumerate() {
            socks.push((s.clone(), Role::Pending(i), libc::POLLIN));
        }
        for qp in &qps {
            // bounded: nobody holds `ctl` for long, but the device thread
            // must never wait on a QP
            let Some(ctl) = lock_within(&qp.ctl, Duration::from_millis(5)) else {
                continue;
            };
            if let Some(o) = &ctl.out {
                // Hang-up only (an unread answer must not make us spin).
                socks.push((o.sock.clone(), Role::Out(qp.clone()), 0));
            }
            for b in ctl.inb.iter().chain(ctl.cands.iter()) {
                socks.push((
                    b.sock.clone(),
                    Role::Inbound(qp.clone(), b.id),
                    libc::POLLIN,
                ));
            }
        }
        let listen = accept_paused_until.is_none_or(|t| Instant::now() >= t);
        let mut fds = vec![
            (
                listener.as_fd().as_raw_fd(),
                if listen { libc::POLLIN } else { 0 },
                0i16,
            ),
            (sh.wake.as_fd().as_raw_fd(), libc::POLLIN, 0),
        ];
        fds.extend(
            socks
                .iter()
                .map(|(s, _, ev)| (s.as_fd().as_raw_fd(), *ev, 0)),
        );
        let _ = sys::poll_raw(&mut fds, Some(sh.poll_interval));
        if sh.stop.load(Acquire) {
            break;
        }
        if fds[1].2 != 0 {
            sh.wake.drain();
        }
        if fds[0].2 & libc::POLLIN != 0 && !sh.frozen.load(Acquire) {
            accept_paused_until = None;
            accept_all(
                &sh,
                &listener,
                &mut pending,
                &mut reserve,
                &mut accept_paused_until,
            );
        }
        let mut done_pending = vec![];
        for (i, (s, role, _)) in socks.iter().enumerate() {
            let rev = fds[i + 2].2;
            if rev == 0 || sh.frozen.load(Acquire) {
                continue;
            }
            match role {
                Role::Pending(p) => {
                    if !on_pending(&sh, s) {
                        done_pending.push(*p);
                    }
                }
                Role::Inbound(qp, id) => qp.on_inbound(*id),
                Role::Out(qp) => qp.on_out_hangup(s),
            }
        }
        // Routed or dropped connections leave the pending list (the QP holds
        // a routed one now).
        let now = Instant::now();
        let mut i = 0;
        pending.retain(|(_, since)| {
            let keep = !done_pending.contains(&i) && now.duration_since(*since) < PENDING_WAIT;
            i += 1;
            keep
        });
        if last_tick.elapsed() >= sh.poll_interval {
            last_tick = Instant::now();
            ticks += 1;
            if !sh.frozen.load(Acquire) {
                tick(&sh, &qps, ticks);
            }
            if reserve.is_none() {
                reserve = EventFd::new().ok();
            }
        }
    }
    // Dropping the listener and the pending connections closes them.
}

/// Accepts what is queued on the listener. Out of descriptors (EMFILE,
/// ENFILE), the connection cannot even be accepted and the listener stays
/// readable: the reserve descriptor is given up to accept and close it (the
/// dialer sees its connection refused), and accepting pauses for a tick
/// instead of spinning.
fn accept_all(
    sh: &DevShared,
    listener: &SeqPacket,
    pending: &mut Vec<(Arc<SeqPacket>, Instant)>,
    reserve: &mut Option<EventFd>,
    paused_until: &mut Option<Instant>,
) {
    for _ in 0..MAX_PENDING {
        match listener.accept_nonblocking() {
            Ok(s) => {
                if pending.len() >= MAX_PENDING {
                    continue; // closed at once: a flood costs only its senders
                }
                pending.push((Arc::new(s), Instant::now()));
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                if reserve.take().is_some() {
                    drop(listener.accept_nonblocking());
                    *reserve = EventFd::new().ok();
                }
                *paused_until = Some(Instant::now() + sh.poll_interval);
                return;
            }
            Err(_) => return, // WouldBlock: all taken
        }
    }
}

/// The first message of an accepted connection: a hello for one of our QPs,
/// which then holds the connection, or the connection is closed. Returns
/// whether the connection stays pending.
fn on_pending(sh: &DevShared, s: &Arc<SeqPacket>) -> bool {
    let mut b = [0u8; 128];
    let (m, fds) = match s.try_recv(&mut b) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
        Err(_) | Ok((0, _)) => return false,
        Ok((n, fds)) => (Msg::decode(&b[..n]), fds),
    };
    let Some(m) = m.filter(|m| m.kind == Kind::Hello) else {
        return false;
    };
    let Some(qp) = lock(&sh.qps).get(&m.b).and_then(Weak::upgrade) else {
        return false;
    };
    qp.on_hello(s.clone(), m, fds);
    false
}

fn tick(sh: &DevShared, qps: &[Arc<QpInner>], ticks: u64) {
    // A look that fails (not a "down" answer) changes nothing.
    let up = match sh.probe.link(&sh.netdev) {
        Ok(l) => l.is_some_and(|l| l.up),
        Err(_) => sh.port_up.load(Acquire),
    } && !sh.forced_down.load(Acquire);
    if up != sh.port_up.swap(up, AcqRel) {
        if up {
            sh.raise(AsyncEvent::PortActive { port: 1 });
        } else {
            sh.raise(AsyncEvent::PortError { port: 1 });
            for qp in qps {
                qp.fail_async(None, false);
            }
        }
    }
    if ticks.is_multiple_of(25) {
        sh.publish_gids();
    }
    let now = Instant::now();
    for qp in qps {
        if qp.fail_pending.load(Acquire) {
            let (first, event) = *lock(&qp.fail_what);
            qp.fail_async(first, event);
            continue;
        }
        let mut dead = false;
        {
            // Only the heartbeat lock: `core` may be taken by the QP's owner
            // (posting, polling, or fetching a peer region), and the
            // heartbeat must go on regardless.
            let mut hb = lock(&qp.hb);
            if let Some(h) = hb.as_mut() {
                let live = qp.live.load(SeqCst);
                Ring(&h.peer_ring).h(R_PROD_HB).fetch_add(1, Release);
                let own = Ring(&h.own_ring);
                let v = own.h(R_PROD_HB).load(Acquire);
                if v != h.last_hb {
                    h.last_hb = v;
                    h.last_hb_change = now;
                }
                if live && now.duration_since(h.last_hb_change) > sh.peer_timeout {
                    dead = true;
                }
                if live && Ring(&h.peer_ring).h(R_CONS_CLOSED).load(Acquire) != 0
                    || own.h(R_PROD_CLOSED).load(Acquire) != 0
                {
                    dead = true;
                }
            }
        }
        // A QP that never met its verified, authenticated peer fails too.
        if let Some(ctl) = lock_within(&qp.ctl, Duration::from_millis(5)) {
            let waiting = ctl.rtr_at.is_some_and(|t| {
                now.duration_since(t) > sh.rendezvous_timeout
                    && !ctl.inb.as_ref().is_some_and(|b| b.authed)
            });
            dead |= waiting && qp.live.load(SeqCst);
        }
        if dead {
            qp.fail_async(Some(WcStatus::RetryExceeded), true);
        }
        // A verified link `core` was too busy to take.
        let ready = lock_within(&qp.ctl, Duration::from_millis(5)).and_then(|mut c| c.ready.take());
        if let Some(l) = ready {
            qp.install_link(l);
        }
        // Peer regions deregistered since: unmap (windows lent keep theirs).
        if let Ok(mut m) = qp.remote.try_lock() {
            m.retain(|_, r| r.valid());
        }
    }
}

// ------------------------------------------------------------------ PD / MR

/// A protection domain of an `shm` device.
pub struct ShmPd {
    dev: Arc<DevShared>,
    pd: u32,
    /// Where its remote-access regions live (this PD's only).
    arena: Arc<Arena>,
}

impl ProtectionDomain for ShmPd {
    type P = ShmProvider;

    /// Keys and the address are random (a peer learns them only when the
    /// owner's application tells it, as over a CLC exchange). A region with
    /// REMOTE_WRITE is a range of this PD's arena, whose memfd is handed to
    /// a peer that asks for the region on an authenticated link of a QP of
    /// this PD; any other region has a memfd of its own, closed at once: it
    /// never leaves the process.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<ShmMr> {
        if len == 0 || len > MAX_REGION {
            return Err(Error::InvalidArgument(format!(
                "memory region length {len} out of range"
            )));
        }
        let (mem, base, slice) = if access.contains(Access::REMOTE_WRITE) {
            let s = self.arena.alloc(HDR + len)?;
            (s.mem().clone(), s.offset(), Some(s))
        } else {
            let mut mem = SharedMem::create("smc-mr", HDR + len)?;
            mem.close_fd();
            (Arc::new(mem), 0, None)
        };
        // Page aligned, below 2^63, so iova + len never overflows.
        let iova = (random_u64()? >> 1 & !0xfff).max(0x1000);
        let mut lkeys = lock(&self.dev.lkeys);
        let mut rkeys = lock(&self.dev.rkeys);
        let lkey = fresh_key(&lkeys)?;
        let rkey = fresh_key(&rkeys)?;
        // The header is what a correct writer checks (it catches bugs, and
        // tells a writer still holding a region that went from the one
        // that took its range since); the owner itself never reads it back.
        let v = MrView(&mem, base);
        v.h(MR_RKEY).store(rkey as u64, Relaxed);
        v.h(MR_LEN).store(len as u64, Relaxed);
        v.h(MR_ACCESS).store(access.bits() as u64, Relaxed);
        v.h(MR_IOVA).store(iova, Relaxed);
        v.h(MR_PD).store(self.pd as u64, Relaxed);
        v.h(MR_VALID).store(1, Release);
        v.h(0).store(MR_MAGIC, Release);
        let mr = Arc::new(LocalMr {
            lkey,
            rkey,
            pd: self.pd,
            mem,
            base,
            len,
            iova,
            access,
            _slice: slice,
        });
        lkeys.insert(lkey, mr.clone());
        rkeys.insert(rkey, mr.clone());
        Ok(ShmMr {
            dev: self.dev.clone(),
            mr,
        })
    }

    fn create_qp(&self, send_cq: &ShmCq, recv_cq: &ShmCq, cap: QpCap) -> Result<ShmQp> {
        if cap.max_inline_data > MAX_INLINE {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data > {MAX_INLINE}"
            )));
        }
        let (ring, ring_fd) = new_ring()?;
        let qpn = self.dev.reg.alloc_qpn(&self.dev.sock_path)?;
        let inner = Arc::new(QpInner {
            dev: self.dev.clone(),
            qpn,
            pd: self.pd,
            cap,
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
            core: Mutex::new(Core::new(ring, ring_fd)),
            hb: Mutex::new(None),
            live: AtomicBool::new(false),
            ctl: Mutex::new(Ctl::default()),
            remote: Mutex::new(KeyMap::default()),
            fail_pending: AtomicBool::new(false),
            fail_what: Mutex::new((None, false)),
        });
        lock(&self.dev.qps).insert(qpn, Arc::downgrade(&inner));
        lock(&send_cq.inner.qps).push(Arc::downgrade(&inner));
        if !Arc::ptr_eq(&send_cq.inner, &recv_cq.inner) {
            lock(&recv_cq.inner.qps).push(Arc::downgrade(&inner));
        }
        Ok(ShmQp { inner })
    }
}

/// A new receive ring: the mapping, and its memfd until it is handed to the
/// peer at RTR.
fn new_ring() -> Result<(Arc<SharedMem>, Option<OwnedFd>)> {
    let mut m = SharedMem::create("smc-ring", RING_LEN)?;
    Ring(&m).h(0).store(RING_MAGIC, Release);
    let fd = m.fd().map(|f| f.try_clone_to_owned()).transpose()?;
    m.close_fd();
    Ok((Arc::new(m), fd))
}

/// A memory region of an `shm` device (shared memory: a slice of its PD's
/// arena if registered for remote access, else a mapping of its own).
pub struct ShmMr {
    dev: Arc<DevShared>,
    mr: Arc<LocalMr>,
}

impl MemoryRegion for ShmMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey
    }
    fn addr(&self) -> u64 {
        self.mr.iova
    }
    fn len(&self) -> usize {
        self.mr.len
    }
    fn access(&self) -> Access {
        self.mr.access
    }
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        check_range(off, buf.len(), self.mr.len)?;
        Ok(self.mr.mem.read(self.mr.at(off), buf)?)
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.mr.len)?;
        Ok(self.mr.mem.write(self.mr.at(off), data)?)
    }
    fn window(&self) -> Option<MemWindow> {
        Some(MemWindow::new(self.mr.clone(), self.mr.at(0), self.mr.len))
    }
}

impl MappedMem for LocalMr {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        Ok(self.mem.read(off, buf)?)
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        Ok(self.mem.write(off, data)?)
    }
}

/// A peer's region mapped here for one QP: what its owner told us about it
/// (in process memory), and the mapping (no descriptor kept).
struct PeerMr {
    mem: SharedMem,
    rkey: u32,
    iova: u64,
    len: usize,
    access: Access,
}

impl PeerMr {
    /// Still registered by its owner (a correct writer stops at once when
    /// the owner deregisters it). The owner may give the region's range to
    /// another region of its PD afterwards: that one has other keys.
    fn valid(&self) -> bool {
        let v = MrView(&self.mem, 0);
        v.h(MR_VALID).load(Acquire) == 1
            && v.h(MR_RKEY).load(Relaxed) == u64::from(self.rkey)
            && v.h(MR_IOVA).load(Relaxed) == self.iova
    }
    /// The byte offset in the mapping of a WRITE of `len` bytes at `addr`.
    fn check(&self, addr: u64, len: usize) -> std::result::Result<usize, WcStatus> {
        let off = addr
            .checked_sub(self.iova)
            .ok_or(WcStatus::RemoteAccessError)?;
        if !self.access.contains(Access::REMOTE_WRITE)
            || !self.valid()
            || check_range(off as usize, len, self.len).is_err()
        {
            return Err(WcStatus::RemoteAccessError);
        }
        Ok(HDR + off as usize)
    }
}

/// A peer's region mapped here, as a [`QueuePair::remote_window`] gives it:
/// each copy into it first checks that the peer still has it registered,
/// as each executed WRITE does.
struct RemoteMem(Arc<PeerMr>);

impl MappedMem for RemoteMem {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        Ok(self.0.mem.read(off, buf)?)
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        if !self.0.valid() {
            return Err(Error::InvalidArgument(
                "the peer's memory region is no longer registered".into(),
            ));
        }
        Ok(self.0.mem.write(off, data)?)
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        // Revoke remote access first: peers check this word before each write.
        MrView(&self.mr.mem, self.mr.base)
            .h(MR_VALID)
            .store(0, SeqCst);
        lock(&self.dev.lkeys).remove(&self.mr.lkey);
        lock(&self.dev.rkeys).remove(&self.mr.rkey);
    }
}

// ------------------------------------------------------------------ CQ / channel

struct CqInner {
    entries: Mutex<VecDeque<WorkCompletion>>,
    armed: AtomicBool,
    chan: Option<Arc<EventFd>>,
    qps: Mutex<Vec<Weak<QpInner>>>,
}

impl CqInner {
    fn push(&self, wc: WorkCompletion) {
        lock(&self.entries).push_back(wc);
        if self.armed.swap(false, SeqCst) {
            if let Some(c) = &self.chan {
                c.signal();
            }
        }
    }
}

/// A completion queue. Polling it also makes progress on its QPs.
pub struct ShmCq {
    inner: Arc<CqInner>,
}

impl CompletionQueue for ShmCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        {
            // Progress under the list lock (no per-poll allocation). Lock order
            // is CQ list, then QP core, everywhere (see `req_notify`).
            let mut l = lock(&self.inner.qps);
            let mut dead = false;
            for w in l.iter() {
                match w.upgrade() {
                    Some(qp) => qp.progress_for(&self.inner),
                    None => dead = true,
                }
            }
            if dead {
                l.retain(|w| w.strong_count() > 0);
            }
        }
        let mut e = lock(&self.inner.entries);
        let n = out.len().min(e.len());
        for (slot, wc) in out.iter_mut().zip(e.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    /// Looks without progressing: completions queued, a QP busy elsewhere, a
    /// SEND of the peer waiting in our ring for a posted receive, the peer
    /// having consumed (ACKed or refused) one of ours since the send queue
    /// last looked, or a SEND of ours still queued or waiting for a receive
    /// credit (RNR retries are timed). Spinning on this instead of polling
    /// spares the locks and clock reads of a whole progress pass.
    fn may_have_work(&self) -> bool {
        if !lock(&self.inner.entries).is_empty() {
            return true;
        }
        let qps = lock(&self.inner.qps);
        for qp in qps.iter().filter_map(Weak::upgrade) {
            let c = match qp.core.try_lock() {
                Ok(c) => c,
                Err(std::sync::TryLockError::WouldBlock) => return true,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            };
            if !matches!(c.state, QpState::Rtr | QpState::Rts) {
                continue;
            }
            if Arc::ptr_eq(&qp.recv_cq, &self.inner)
                && !c.rq.is_empty()
                && slot_taken(&c.ring, c.head)
            {
                return true;
            }
            if Arc::ptr_eq(&qp.send_cq, &self.inner) && !c.sq.is_empty() {
                let Some(l) = c.link.as_ref() else {
                    return true;
                };
                let pr = Ring(&l.peer_ring);
                if pr.h(R_HEAD).load(Acquire) != c.seen_peer_head {
                    return true;
                }
                let credits = pr.h(R_RECV_CREDITS).load(Acquire);
                let waiting = c.sq.iter().any(|p| match p.stage {
                    Stage::Queued => true,
                    Stage::Published { seq, .. } => credits <= seq,
                    Stage::Done(_) => true,
                });
                if waiting {
                    return true;
                }
            }
        }
        false
    }

    fn req_notify(&self) -> Result<()> {
        self.inner.armed.store(true, SeqCst);
        let qps: Vec<Arc<QpInner>> = lock(&self.inner.qps)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for qp in qps {
            let c = lock(&qp.core);
            if Arc::ptr_eq(&qp.recv_cq, &self.inner) {
                Ring(&c.ring).h(R_RX_NOTIFY).store(1, SeqCst);
            }
            if Arc::ptr_eq(&qp.send_cq, &self.inner) {
                if let Some(l) = &c.link {
                    Ring(&l.peer_ring).h(R_TX_NOTIFY).store(1, SeqCst);
                }
            }
        }
        Ok(())
    }
}

/// A completion channel: an eventfd that peers in other processes signal too.
pub struct ShmChannel {
    inner: Arc<EventFd>,
}

impl CompletionChannel for ShmChannel {
    fn fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
    fn try_get_event(&self) -> Result<bool> {
        Ok(self.inner.drain())
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        Ok(self.inner.wait(timeout)?)
    }
}

// ------------------------------------------------------------------ QP

enum OwnedPayload {
    Inline(Vec<u8>),
    /// An inline payload of up to [`SMALL`] bytes (a CDC, an LLC message)
    /// without a heap allocation.
    Small([u8; SMALL], u8),
    /// Local memory (one SGE without a heap allocation).
    Sges(Sges),
}

/// Inline payloads up to this size are kept in the WR itself.
const SMALL: usize = 64;

/// A WR's scatter/gather list, the common single SGE without allocation.
enum Sges {
    One([Sge; 1]),
    Many(Vec<Sge>),
}

impl Sges {
    fn new(s: &[Sge]) -> Sges {
        match s {
            [one] => Sges::One([*one]),
            s => Sges::Many(s.to_vec()),
        }
    }

    fn as_slice(&self) -> &[Sge] {
        match self {
            Sges::One(s) => s,
            Sges::Many(v) => v,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Stage {
    Queued,
    Published {
        seq: u64,
        rnr_since: Option<Instant>,
    },
    Done(WcStatus),
}

struct Pending {
    wr_id: u64,
    op: SendOp,
    payload: OwnedPayload,
    signaled: bool,
    len: u32,
    stage: Stage,
}

/// The data path's view of the verified peer: its ring and channels.
struct Link {
    peer_ring: Arc<SharedMem>,
    peer_rx_efd: Option<Arc<EventFd>>,
    peer_tx_efd: Option<Arc<EventFd>>,
    /// Our producer index in the peer's ring (kept here, not read back from
    /// the ring the peer can write).
    tail: u64,
}

struct Core {
    state: QpState,
    access: Access,
    ring: Arc<SharedMem>,
    /// The ring's memfd until it is handed to the peer (at RTR).
    ring_fd: Option<OwnedFd>,
    /// Our consumer index in our ring (kept here, not read back from the
    /// ring the peer can write).
    head: u64,
    rq_psn: u32,
    sq_psn: u32,
    timeout: Duration,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: Duration,
    rq: VecDeque<(u64, Sges)>,
    sq: VecDeque<Pending>,
    link: Option<Link>,
    recv_posted: u64,
    /// The peer's ring head (how far it consumed our SENDs) when the send
    /// queue last looked at acknowledgements (see `may_have_work`).
    seen_peer_head: u64,
}

impl Core {
    fn new(ring: Arc<SharedMem>, ring_fd: Option<OwnedFd>) -> Core {
        Core {
            state: QpState::Reset,
            access: Access::NONE,
            ring,
            ring_fd,
            head: 0,
            rq_psn: 0,
            sq_psn: 0,
            timeout: Duration::from_millis(100),
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: Duration::from_millis(1),
            rq: VecDeque::new(),
            sq: VecDeque::new(),
            link: None,
            recv_posted: 0,
            seen_peer_head: 0,
        }
    }
}

/// The connection a QP dialed (its peer's inbound one): hello and auth go
/// out on it, region requests and their answers.
struct OutLink {
    sock: Arc<SeqPacket>,
    nonce: u64,
    /// Serializes requests; the request id counter.
    req: Mutex<u32>,
}

/// A connection a peer dialed to one of our QPs, with its hello.
struct Inbound {
    id: u64,
    sock: Arc<SeqPacket>,
    hello: Msg,
    /// The ring and eventfds of the hello, until it is verified.
    fds: Vec<OwnedFd>,
    /// The auth proof, once it arrived.
    auth: Option<u64>,
    /// The auth proof was checked: regions may be handed out.
    authed: bool,
    /// Region requests (id, rkey) that arrived before `authed`.
    deferred: VecDeque<(u32, u32)>,
}

/// Rendezvous state of a QP. Taken only briefly (never across a blocking
/// call), by the device thread, by `modify` and by a data path that holds
/// `core` (lock order: `core`, then `ctl`).
#[derive(Default)]
struct Ctl {
    /// Hellos are taken (the QP is in INIT, RTR or RTS).
    accepting: bool,
    /// The access rights granted through the QP (INIT).
    access: Access,
    remote: Option<RemoteQp>,
    sgid: Gid,
    rq_psn: Option<u32>,
    sq_psn: Option<u32>,
    rtr_at: Option<Instant>,
    out: Option<Arc<OutLink>>,
    /// Hellos not verified yet.
    cands: Vec<Inbound>,
    next_id: u64,
    bad_hellos: u32,
    /// The verified inbound connection.
    inb: Option<Inbound>,
    /// A verified link the data path has not taken into `core` yet.
    ready: Option<Link>,
}

impl Ctl {
    fn clear_links(&mut self) {
        self.accepting = false;
        self.out = None;
        self.cands.clear();
        self.inb = None;
        self.ready = None;
        self.rtr_at = None;
    }
}

struct QpInner {
    dev: Arc<DevShared>,
    qpn: u32,
    pd: u32,
    cap: QpCap,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    core: Mutex<Core>,
    /// The device thread's view of the link, kept apart from `core`: the
    /// application's threads take `core` for every post and poll, and a busy
    /// QP would otherwise starve the heartbeat (seen: two threads pumping one
    /// QP kept `core` taken for over a second, and the peer declared us dead).
    hb: Mutex<Option<Heartbeat>>,
    /// The QP is in RTR or RTS (heartbeats are checked only then).
    live: AtomicBool,
    ctl: Mutex<Ctl>,
    /// The peer's regions mapped for this QP, by rkey. They go with the link
    /// (ERR, RESET, destruction), and when the peer deregisters them.
    remote: Mutex<KeyMap<u32, Arc<PeerMr>>>,
    /// The device thread wanted to fail the QP while `core` was busy.
    fail_pending: AtomicBool,
    fail_what: Mutex<(Option<WcStatus>, bool)>,
}

/// Heartbeat state of a connected QP (device thread only).
struct Heartbeat {
    own_ring: Arc<SharedMem>,
    peer_ring: Arc<SharedMem>,
    last_hb: u64,
    last_hb_change: Instant,
}

fn wc(
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
    qp_num: u32,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm,
        qp_num,
    }
}

fn send_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
        _ => WcOpcode::RdmaWrite,
    }
}

/// Why a peer region could not be had.
struct FetchError {
    status: WcStatus,
    why: String,
    /// This process lacked a resource (a descriptor, address space).
    local: bool,
}

impl FetchError {
    fn remote(status: WcStatus, why: impl Into<String>) -> FetchError {
        FetchError {
            status,
            why: why.into(),
            local: false,
        }
    }
    fn into_error(self) -> Error {
        if self.local {
            Error::Io(std::io::Error::other(self.why))
        } else {
            Error::Connect(self.why)
        }
    }
}

fn is_local_shortage(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOMEM)
    ) || e.kind() == std::io::ErrorKind::Other
}

impl QpInner {
    fn efd_flags(&self) -> u32 {
        let rx = self.recv_cq.chan.as_ref();
        let tx = self.send_cq.chan.as_ref();
        let mut f = 0;
        if rx.is_some() {
            f |= wire::F_RX_CHAN;
        }
        if tx.is_some() {
            f |= wire::F_TX_CHAN;
        }
        if let (Some(a), Some(b)) = (rx, tx) {
            if Arc::ptr_eq(a, b) {
                f |= wire::F_SAME_CHAN;
            }
        }
        f
    }

    // ---------------------------------------------------------------- rendezvous

    /// Active side (INIT → RTR): hands our ring and channels to the instance
    /// owning the peer's (GID, QPN), with the proof of the peer's PSN, and
    /// waits until it holds them. Holds no lock while it waits.
    fn dial(&self, remote: RemoteQp, sgid: Gid, rq_psn: u32) -> Result<()> {
        {
            let mut ctl = lock(&self.ctl);
            ctl.remote = Some(remote);
            ctl.sgid = sgid;
            ctl.rq_psn = Some(rq_psn);
            ctl.rtr_at = Some(Instant::now());
            // Hellos held in INIT from anybody but the peer named now go.
            ctl.cands
                .retain(|c| c.hello.a == remote.qp_num && c.hello.gid == remote.gid);
        }
        let ring_fd = lock(&self.core).ring_fd.take();
        let put_back = |fd: Option<OwnedFd>| {
            if let Some(fd) = fd {
                lock(&self.core).ring_fd.get_or_insert(fd);
            }
        };
        let Some(ring_fd) = ring_fd else {
            return Err(Error::InvalidState {
                op: "connect (the ring was handed out already; RESET first)",
                state: QpState::Init,
            });
        };
        let r = (|| {
            let (s, _) = self
                .dev
                .reg
                .connect(&remote.gid, remote.qp_num)
                .map_err(Error::Connect)?;
            s.set_read_timeout(ANSWER_WAIT)?;
            s.set_write_timeout(ANSWER_WAIT)?;
            let nonce = random_u64()?;
            let flags = self.efd_flags();
            let hello = Msg {
                kind: Kind::Hello,
                a: self.qpn,
                b: remote.qp_num,
                c: flags,
                gid: sgid,
                x: nonce,
                y: wire::hello_proof(rq_psn, &sgid, self.qpn, remote.qp_num, nonce),
                z: 0,
            };
            let mut fds = vec![ring_fd.as_fd()];
            if let Some(c) = &self.recv_cq.chan {
                fds.push(c.as_fd());
            }
            if let Some(c) = &self.send_cq.chan {
                if flags & wire::F_SAME_CHAN == 0 {
                    fds.push(c.as_fd());
                }
            }
            s.send(&hello.encode(), &fds)?;
            let mut b = [0u8; 128];
            let answer = match s.recv(&mut b) {
                Ok((n, _)) => Msg::decode(&b[..n]),
                Err(e) => {
                    return Err(Error::Connect(format!(
                        "no answer from peer QP {}: {e}",
                        remote.qp_num
                    )))
                }
            };
            if answer.map(|m| m.kind) != Some(Kind::Received) {
                return Err(Error::Connect(format!(
                    "peer QP {} refused the connection",
                    remote.qp_num
                )));
            }
            Ok(Arc::new(OutLink {
                sock: Arc::new(s),
                nonce,
                req: Mutex::new(0),
            }))
        })();
        match r {
            Ok(out) => {
                drop(ring_fd); // handed to the peer: we keep only the mapping
                lock(&self.ctl).out = Some(out);
                self.dev.wake.signal();
                Ok(())
            }
            Err(e) => {
                put_back(Some(ring_fd));
                Err(e)
            }
        }
    }

    /// RTS: we know our own PSN now. Prove both PSNs on the connection we
    /// dialed, and check the hellos and auth we were holding.
    fn on_rts(&self, sq_psn: u32) {
        let auth = {
            let mut ctl = lock(&self.ctl);
            if ctl.sq_psn.is_some() {
                None // RTS → RTS: attributes only
            } else {
                ctl.sq_psn = Some(sq_psn);
                match (&ctl.out, ctl.remote, ctl.rq_psn) {
                    (Some(o), Some(r), Some(rq)) => Some((
                        o.clone(),
                        Msg {
                            y: wire::auth_proof(sq_psn, rq, &ctl.sgid, self.qpn, r.qp_num, o.nonce),
                            ..Msg::new(Kind::Auth)
                        },
                    )),
                    _ => None,
                }
            }
        };
        if let Some((o, m)) = auth {
            if o.sock.send(&m.encode(), &[]).is_err() {
                self.fail_async(Some(WcStatus::RetryExceeded), true);
                return;
            }
        }
        self.try_verify();
        self.dev.wake.signal();
    }

    /// A hello for this QP (device thread). It is held if it can be: the QP
    /// takes hellos, is not connected yet, the hello names the peer set at
    /// RTR (if any) and carries exactly the descriptors its flags announce.
    fn on_hello(&self, sock: Arc<SeqPacket>, m: Msg, fds: Vec<OwnedFd>) {
        let id = {
            let mut ctl = lock(&self.ctl);
            let want = 1
                + usize::from(m.c & wire::F_RX_CHAN != 0)
                + usize::from(m.c & wire::F_TX_CHAN != 0 && m.c & wire::F_SAME_CHAN == 0);
            let same_ok = m.c & wire::F_SAME_CHAN == 0
                || m.c & (wire::F_RX_CHAN | wire::F_TX_CHAN) == wire::F_RX_CHAN | wire::F_TX_CHAN;
            let named = ctl.remote.is_none_or(|r| r.qp_num == m.a && r.gid == m.gid);
            if !ctl.accepting
                || ctl.inb.is_some()
                || ctl.bad_hellos >= MAX_BAD_HELLOS
                || ctl.cands.len() >= MAX_CANDIDATES
                || !named
                || fds.len() != want
                || !same_ok
                || m.c & !(wire::F_RX_CHAN | wire::F_TX_CHAN | wire::F_SAME_CHAN) != 0
            {
                return; // dropping the socket closes it: the dialer's RTR fails
            }
            ctl.next_id += 1;
            let id = ctl.next_id;
            ctl.cands.push(Inbound {
                id,
                sock,
                hello: m,
                fds,
                auth: None,
                authed: false,
                deferred: VecDeque::new(),
            });
            id
        };
        // Verify at once if we can (in RTS), so that a dialer whose RTR
        // returned finds us connected.
        self.try_verify();
        let ctl = lock(&self.ctl);
        let held = ctl.inb.iter().chain(ctl.cands.iter()).find(|b| b.id == id);
        if let Some(b) = held {
            if b.sock
                .try_send(&Msg::new(Kind::Received).encode(), &[])
                .is_err()
            {
                let s = b.sock.clone();
                drop(ctl);
                self.drop_inbound(&s);
            }
        }
    }

    /// Forgets an inbound connection (a candidate; the verified one fails
    /// the QP). It leaves the device thread's poll set at once, also when
    /// the failure itself has to wait for a busy `core`.
    fn drop_inbound(&self, s: &Arc<SeqPacket>) {
        let mut ctl = lock(&self.ctl);
        if ctl.inb.as_ref().is_some_and(|b| Arc::ptr_eq(&b.sock, s)) {
            ctl.inb = None;
            drop(ctl);
            self.fail_async(Some(WcStatus::RetryExceeded), true);
        } else {
            ctl.cands.retain(|c| !Arc::ptr_eq(&c.sock, s));
        }
    }

    /// Checks held hellos and auth against the PSNs, once both are known:
    /// the first hello with a right proof becomes the link (its ring mapped,
    /// its eventfds kept), the others are dropped; a right auth on the
    /// linked connection opens the regions to it, a wrong one fails the QP.
    fn try_verify(&self) {
        let mut link = None;
        let mut bad = false;
        {
            let mut ctl = lock(&self.ctl);
            let (Some(remote), Some(rq), Some(sq)) = (ctl.remote, ctl.rq_psn, ctl.sq_psn) else {
                return;
            };
            if ctl.inb.is_none() && !ctl.cands.is_empty() {
                let cands = std::mem::take(&mut ctl.cands);
                for mut c in cands {
                    let h = c.hello;
                    let right = h.a == remote.qp_num
                        && h.gid == remote.gid
                        && h.y == wire::hello_proof(sq, &h.gid, h.a, self.qpn, h.x);
                    if ctl.inb.is_some() {
                        continue; // linked already: the others close
                    }
                    if !right {
                        ctl.bad_hellos += 1;
                        continue;
                    }
                    match self.make_link(&mut c) {
                        Ok(l) => {
                            link = Some(l);
                            ctl.inb = Some(c);
                        }
                        Err(_) => bad = true,
                    }
                }
            }
            let qpn = self.qpn;
            if let Some(b) = ctl.inb.as_mut() {
                if let (false, Some(p)) = (b.authed, b.auth) {
                    let h = b.hello;
                    if p == wire::auth_proof(rq, sq, &h.gid, h.a, qpn, h.x) {
                        b.authed = true;
                    } else {
                        bad = true;
                    }
                }
            }
            if !bad {
                let access = ctl.access;
                if let Some(b) = ctl.inb.as_mut().filter(|b| b.authed) {
                    while let Some((id, rkey)) = b.deferred.pop_front() {
                        if !self.serve_region(access, &b.sock, id, rkey) {
                            bad = true;
                            break;
                        }
                    }
                }
            }
        }
        if let Some(l) = link {
            self.install_link(l);
        }
        if bad {
            self.fail_async(Some(WcStatus::RemoteInvalidRequest), true);
        }
    }

    /// Maps a verified hello's ring and takes its eventfds.
    fn make_link(&self, c: &mut Inbound) -> Result<Link> {
        let m = c.hello;
        let mut it = std::mem::take(&mut c.fds).into_iter();
        let missing = || Error::Connect("the hello's descriptors are missing".into());
        let ring = SharedMem::map_peer(it.next().ok_or_else(missing)?, RING_LEN)?;
        if Ring::check(&ring).is_none() {
            return Err(Error::Connect("peer ring is malformed".into()));
        }
        let mut efd = |present: bool| -> Result<Option<Arc<EventFd>>> {
            if !present {
                return Ok(None);
            }
            let fd = it.next().ok_or_else(missing)?;
            // Anything else (a pipe, a socket) could block our signal.
            if !sys::is_eventfd(fd.as_fd()) {
                return Err(Error::Connect("peer channel is not an eventfd".into()));
            }
            sys::set_nonblocking(fd.as_fd())?;
            Ok(Some(Arc::new(EventFd::from_owned(fd))))
        };
        let rx = efd(m.c & wire::F_RX_CHAN != 0)?;
        let tx = if m.c & wire::F_SAME_CHAN != 0 {
            rx.clone()
        } else {
            efd(m.c & wire::F_TX_CHAN != 0)?
        };
        Ok(Link {
            peer_ring: Arc::new(ring),
            peer_rx_efd: rx,
            peer_tx_efd: tx,
            tail: 0,
        })
    }

    /// Hands a verified link to the data path (now, or at its next look if
    /// `core` is busy; the device thread's tick retries too).
    fn install_link(&self, l: Link) {
        match lock_within(&self.core, Duration::from_millis(5)) {
            Some(mut c) => self.adopt(&mut c, l),
            None => {
                lock(&self.ctl).ready = Some(l);
                self.dev.wake.signal();
            }
        }
    }

    /// The data path takes a verified link, and the heartbeat starts.
    fn adopt(&self, c: &mut Core, l: Link) {
        if !matches!(c.state, QpState::Rtr | QpState::Rts) || c.link.is_some() {
            return;
        }
        // We may be armed already: ask the peer to signal our consumption.
        Ring(&l.peer_ring).h(R_TX_NOTIFY).store(1, SeqCst);
        *lock(&self.hb) = Some(Heartbeat {
            own_ring: c.ring.clone(),
            peer_ring: l.peer_ring.clone(),
            last_hb: 0,
            last_hb_change: Instant::now(),
        });
        c.link = Some(l);
        // Sends queued meanwhile can go now: wake whoever waits to poll.
        if let Some(ch) = &self.send_cq.chan {
            ch.signal();
        }
    }

    /// A link the device thread verified while `core` was busy.
    fn adopt_ready(&self, c: &mut Core) {
        if c.link.is_none() {
            if let Ok(mut ctl) = self.ctl.try_lock() {
                if let Some(l) = ctl.ready.take() {
                    drop(ctl);
                    self.adopt(c, l);
                }
            }
        }
    }

    /// Messages on an inbound connection (device thread): auth, region
    /// requests. Anything else, or a hang-up, ends it.
    fn on_inbound(&self, id: u64) {
        let mut verify = false;
        let mut end = None;
        {
            let mut guard = lock(&self.ctl);
            let ctl = &mut *guard;
            let access = ctl.access;
            let Some(b) = ctl
                .inb
                .iter_mut()
                .chain(ctl.cands.iter_mut())
                .find(|b| b.id == id)
            else {
                return;
            };
            for _ in 0..16 {
                let mut buf = [0u8; 128];
                let m = match b.sock.try_recv(&mut buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) | Ok((0, _)) => None,
                    Ok((n, fds)) if fds.is_empty() => Msg::decode(&buf[..n]),
                    Ok(_) => None,
                };
                match m {
                    Some(m) if m.kind == Kind::Auth && b.auth.is_none() => {
                        b.auth = Some(m.y);
                        verify = true;
                    }
                    Some(m) if m.kind == Kind::MrReq && b.authed => {
                        if !self.serve_region(access, &b.sock, m.a, m.b) {
                            end = Some(b.sock.clone());
                            break;
                        }
                    }
                    Some(m) if m.kind == Kind::MrReq && b.deferred.len() < MAX_DEFERRED => {
                        b.deferred.push_back((m.a, m.b));
                    }
                    _ => {
                        end = Some(b.sock.clone());
                        break;
                    }
                }
            }
        }
        if let Some(s) = end {
            self.drop_inbound(&s);
        } else if verify {
            self.try_verify();
        }
    }

    /// Answers a region request on the verified, authenticated inbound
    /// connection: the memfd of the region's arena chunk (which holds
    /// remote-access regions of this PD only), with the region's offset and
    /// length in it, if the region is of this QP's PD, registered for remote
    /// writes, and the QP grants remote writes; else a refusal. False if the
    /// peer does not take the answer (it stopped reading).
    fn serve_region(&self, qp_access: Access, s: &SeqPacket, id: u32, rkey: u32) -> bool {
        let mr = lock(&self.dev.rkeys).get(&rkey).cloned().filter(|mr| {
            mr.pd == self.pd
                && mr.access.contains(Access::REMOTE_WRITE)
                && qp_access.contains(Access::REMOTE_WRITE)
        });
        let r = match mr.as_ref().and_then(|mr| Some((mr, mr.mem.fd()?))) {
            Some((mr, fd)) => s.try_send(
                &Msg {
                    a: id,
                    b: rkey,
                    c: mr.access.bits(),
                    x: mr.iova,
                    y: mr.len as u64,
                    z: mr.base as u64,
                    ..Msg::new(Kind::MrResp)
                }
                .encode(),
                &[fd],
            ),
            None => s.try_send(
                &Msg {
                    a: id,
                    b: rkey,
                    ..Msg::new(Kind::Nak)
                }
                .encode(),
                &[],
            ),
        };
        r.is_ok()
    }

    /// The connection we dialed hung up (device thread): the peer's QP or
    /// process is gone, or it refused our hello.
    fn on_out_hangup(&self, s: &Arc<SeqPacket>) {
        let mut ctl = lock(&self.ctl);
        let current = ctl.out.as_ref().is_some_and(|o| Arc::ptr_eq(&o.sock, s));
        if current && sys::poll_one(s.as_fd(), 0, Some(Duration::ZERO)).is_ok_and(|r| r != 0) {
            // out of the poll set at once (a request in flight keeps its own
            // reference and sees the hang-up itself)
            ctl.out = None;
            drop(ctl);
            self.fail_async(Some(WcStatus::RetryExceeded), true);
        }
    }

    /// Asks the peer for its region `rkey` on the connection we dialed: the
    /// answer and the memfd the region lives in. Holds no lock of ours but
    /// the request lock while it waits.
    fn ask_region(&self, rkey: u32) -> std::result::Result<(Msg, OwnedFd), FetchError> {
        let out = lock(&self.ctl).out.clone().ok_or_else(|| {
            FetchError::remote(WcStatus::RetryExceeded, "the QP is not connected")
        })?;
        let mut next = lock(&out.req);
        *next = next.wrapping_add(1);
        let id = *next;
        let gone = |e: std::io::Error| {
            FetchError::remote(
                WcStatus::RetryExceeded,
                format!("peer does not answer: {e}"),
            )
        };
        let req = Msg {
            a: id,
            b: rkey,
            ..Msg::new(Kind::MrReq)
        };
        out.sock.send(&req.encode(), &[]).map_err(gone)?;
        let deadline = Instant::now() + ANSWER_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FetchError::remote(
                    WcStatus::RetryExceeded,
                    "peer did not answer the region request",
                ));
            }
            out.sock.set_read_timeout(left).map_err(gone)?;
            let mut b = [0u8; 128];
            let (m, mut fds) = match out.sock.recv(&mut b) {
                Ok((0, _)) => return Err(gone(std::io::ErrorKind::UnexpectedEof.into())),
                Ok((n, fds)) => (Msg::decode(&b[..n]), fds),
                Err(e) if is_local_shortage(&e) => {
                    return Err(FetchError {
                        status: WcStatus::LocalQpOperationError,
                        why: format!("cannot take the peer's region: {e}"),
                        local: true,
                    })
                }
                Err(e) => return Err(gone(e)),
            };
            let Some(m) = m else {
                return Err(FetchError::remote(
                    WcStatus::RemoteInvalidRequest,
                    "malformed answer",
                ));
            };
            if m.a != id || !matches!(m.kind, Kind::MrResp | Kind::Nak) {
                continue; // the late answer of a request that timed out
            }
            let refused = |why: &str| FetchError::remote(WcStatus::RemoteAccessError, why);
            if m.kind == Kind::Nak {
                return Err(refused("the peer refused the region"));
            }
            let len = m.y as usize;
            if m.b != rkey || fds.len() != 1 || len == 0 || len > MAX_REGION {
                return Err(refused("malformed region answer"));
            }
            return Ok((m, fds.remove(0)));
        }
    }

    /// Fetches the peer's region `rkey` ([`QpInner::ask_region`]) and maps
    /// it: only its range of the memfd, which is closed then.
    fn fetch_region(&self, rkey: u32) -> std::result::Result<Arc<PeerMr>, FetchError> {
        let (m, fd) = self.ask_region(rkey)?;
        let refused = |why: &str| FetchError::remote(WcStatus::RemoteAccessError, why);
        let len = m.y as usize;
        let mem = SharedMem::map_peer_range(fd, m.z, HDR + len).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                refused("the peer's region is not a range of a sealed memfd")
            } else {
                FetchError {
                    status: WcStatus::LocalQpOperationError,
                    why: format!("cannot map the peer's region: {e}"),
                    local: true,
                }
            }
        })?;
        let v = MrView(&mem, 0);
        if v.h(0).load(Acquire) != MR_MAGIC
            || v.h(MR_RKEY).load(Acquire) != u64::from(rkey)
            || v.h(MR_IOVA).load(Acquire) != m.x
        {
            return Err(refused("the peer's region header is wrong"));
        }
        Ok(Arc::new(PeerMr {
            mem,
            rkey,
            iova: m.x,
            len,
            access: Access::from_bits(m.c),
        }))
    }

    /// The peer's region `rkey` for this QP: mapped already, or fetched now.
    fn peer_region(&self, rkey: u32) -> std::result::Result<Arc<PeerMr>, FetchError> {
        {
            let mut m = lock(&self.remote);
            match m.get(&rkey) {
                Some(r) if r.valid() => return Ok(r.clone()),
                Some(_) => {
                    m.remove(&rkey);
                }
                None => {}
            }
        }
        let r = self.fetch_region(rkey)?;
        debug_assert_eq!(r.rkey, rkey);
        lock(&self.remote).insert(rkey, r.clone());
        Ok(r)
    }

    /// Checks the peer region for a WRITE and returns (mapping, byte offset).
    fn check_remote(
        &self,
        rkey: u32,
        addr: u64,
        len: usize,
    ) -> std::result::Result<(Arc<PeerMr>, usize), WcStatus> {
        let m = self.peer_region(rkey).map_err(|e| e.status)?;
        let off = m.check(addr, len)?;
        Ok((m, off))
    }

    // ---------------------------------------------------------------- errors

    /// Moves to ERR: the first outstanding WR gets `first` (if any), all
    /// others flush. Marks both rings closed so the peer notices.
    fn fail(&self, first: Option<WcStatus>, event: bool) {
        let mut c = lock(&self.core);
        self.fail_locked(&mut c, first, event);
    }

    /// [`QpInner::fail`] from the device thread, which must not wait for a
    /// busy `core`: then the data path (at its next poll) or the next tick
    /// does it.
    fn fail_async(&self, first: Option<WcStatus>, event: bool) {
        match lock_within(&self.core, Duration::from_millis(5)) {
            Some(mut c) => {
                self.fail_pending.store(false, SeqCst);
                self.fail_locked(&mut c, first, event);
            }
            None => {
                *lock(&self.fail_what) = (first, event);
                self.fail_pending.store(true, SeqCst);
            }
        }
    }

    fn fail_locked(&self, c: &mut Core, mut first: Option<WcStatus>, event: bool) {
        if matches!(c.state, QpState::Err | QpState::Reset) {
            return;
        }
        // What the peer completed before the failure is received first: a
        // published slot is a whole message in our ring, as a packet the HCA
        // had received and acknowledged. (A peer process that posts its last
        // data and exits hangs up its socket at once; those messages must not
        // be flushed with the rest.)
        if matches!(c.state, QpState::Rtr | QpState::Rts) {
            self.progress_recv(c);
            if matches!(c.state, QpState::Err | QpState::Reset) {
                return; // a bad message among them failed the QP already
            }
        }
        c.state = QpState::Err;
        self.live.store(false, SeqCst);
        self.fail_pending.store(false, SeqCst);
        Ring(&c.ring).h(R_CONS_CLOSED).store(1, SeqCst);
        if let Some(l) = &c.link {
            let pr = Ring(&l.peer_ring);
            pr.h(R_PROD_CLOSED).store(1, SeqCst);
            for p in &c.sq {
                if let Stage::Published { seq, .. } = p.stage {
                    let _ = pr.s(seq, S_STATE).compare_exchange(
                        seq << 3 | ST_PUBLISHED,
                        seq << 3 | ST_CANCELLED,
                        SeqCst,
                        SeqCst,
                    );
                }
            }
            if let Some(e) = &l.peer_rx_efd {
                e.signal();
            }
        }
        for p in c.sq.drain(..) {
            let status = match p.stage {
                Stage::Done(WcStatus::Success) if !p.signaled => continue,
                Stage::Done(s) => s,
                _ => first.take().unwrap_or(WcStatus::WrFlushError),
            };
            self.send_cq
                .push(wc(p.wr_id, status, send_opcode(p.op), 0, None, self.qpn));
        }
        for (wr_id, _) in c.rq.drain(..) {
            self.recv_cq.push(wc(
                wr_id,
                WcStatus::WrFlushError,
                WcOpcode::Recv,
                0,
                None,
                self.qpn,
            ));
        }
        self.release_link(c);
        if event {
            self.dev.raise(AsyncEvent::QpFatal { qp_num: self.qpn });
        }
    }

    /// Lets go of everything the link holds: sockets, the peer's ring,
    /// eventfds and regions (windows lent keep their mapping until dropped).
    fn release_link(&self, c: &mut Core) {
        c.link = None;
        lock(&self.ctl).clear_links();
        *lock(&self.hb) = None;
        lock(&self.remote).clear();
        self.dev.wake.signal();
    }

    // ---------------------------------------------------------------- progress

    /// The progress that can complete into `cq`: receives for the QP's
    /// receive CQ, sends for its send CQ (both when they are one). Polling
    /// one CQ of a QP need not also do the other direction's work, which its
    /// own poll does (a pump polls both).
    fn progress_for(&self, cq: &Arc<CqInner>) {
        let mut c = lock(&self.core);
        if self.fail_pending.load(Relaxed) {
            let (first, event) = *lock(&self.fail_what);
            self.fail_locked(&mut c, first, event);
        }
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        self.adopt_ready(&mut c);
        if Arc::ptr_eq(&self.recv_cq, cq) {
            self.progress_recv(&mut c);
        }
        if c.state == QpState::Rts && Arc::ptr_eq(&self.send_cq, cq) {
            self.progress_send(&mut c);
        }
    }

    /// Whether a WRITE posted now may land at once instead of queueing (and
    /// having its inline payload copied twice): everything before it has been
    /// executed already — SENDs published to the peer's ring and not refused
    /// for lack of a receive (RC executes in order and stops behind an RNR'd
    /// SEND) — so landing now keeps the order. A signaled WRITE also needs an
    /// empty queue: its completion must not overtake earlier ones. (A bulk
    /// sender posts each WRITE while its previous CDC still waits for the
    /// peer's ACK; queueing those copied 256 KiB into a fresh Vec each time.)
    fn executes_at_post(&self, c: &Core, signaled: bool) -> bool {
        if c.sq.is_empty() {
            return true;
        }
        if signaled {
            return false;
        }
        let Some(l) = c.link.as_ref() else {
            return false;
        };
        let credits = Ring(&l.peer_ring).h(R_RECV_CREDITS).load(Acquire);
        c.sq.iter().all(|p| match p.stage {
            Stage::Published { seq, .. } => credits > seq,
            Stage::Done(st) => st == WcStatus::Success,
            Stage::Queued => false,
        })
    }

    fn progress_locked(&self, c: &mut Core) {
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        self.adopt_ready(c);
        self.progress_recv(c);
        if c.state == QpState::Rts {
            self.progress_send(c);
        }
    }

    /// Copies `len` bytes of the WR's payload to `dst` at `dst_off`.
    fn gather(
        &self,
        p: &OwnedPayload,
        dst: &SharedMem,
        dst_off: usize,
    ) -> std::result::Result<(), WcStatus> {
        match p {
            OwnedPayload::Inline(d) => dst
                .write(dst_off, d)
                .map_err(|_| WcStatus::LocalQpOperationError),
            OwnedPayload::Small(b, n) => dst
                .write(dst_off, &b[..usize::from(*n)])
                .map_err(|_| WcStatus::LocalQpOperationError),
            OwnedPayload::Sges(sges) => {
                let mut pos = dst_off;
                for s in sges.as_slice() {
                    let mr = self
                        .dev
                        .local_mr(s.lkey)
                        .ok_or(WcStatus::LocalProtectionError)?;
                    if mr.pd != self.pd {
                        return Err(WcStatus::LocalProtectionError);
                    }
                    let off = s
                        .addr
                        .checked_sub(mr.iova)
                        .ok_or(WcStatus::LocalProtectionError)?
                        as usize;
                    check_range(off, s.length as usize, mr.len)
                        .map_err(|_| WcStatus::LocalProtectionError)?;
                    dst.copy_from(pos, &mr.mem, mr.at(off), s.length as usize)
                        .map_err(|_| WcStatus::LocalQpOperationError)?;
                    pos += s.length as usize;
                }
                Ok(())
            }
        }
    }

    fn progress_send(&self, c: &mut Core) {
        if let Some(l) = c.link.as_ref() {
            // before the slot states: a consume after this load shows later
            c.seen_peer_head = Ring(&l.peer_ring).h(R_HEAD).load(Acquire);
        }
        if c.sq.is_empty() {
            return;
        }
        // The clock is read only while some SEND waits for a receive (RNR).
        let mut now_cache = None;
        let mut now = || *now_cache.get_or_insert_with(Instant::now);
        let rnr_retry = c.rnr_retry;
        let (credits, head, rnr_budget) = match c.link.as_ref() {
            Some(l) => {
                let pr = Ring(&l.peer_ring);
                // the peer's timer, within what IB allows (the word is the peer's)
                let timer = Duration::from_nanos(pr.h(R_RNR_TIMER).load(Relaxed))
                    .clamp(Duration::from_micros(10), MAX_RNR_TIMER);
                (
                    pr.h(R_RECV_CREDITS).load(Acquire),
                    pr.h(R_HEAD).load(Acquire),
                    timer.saturating_mul(u32::from(rnr_retry) + 1),
                )
            }
            None => (0, 0, Duration::ZERO),
        };
        // 1. ACKs of published slots, RNR timers.
        if let Some(l) = c.link.as_ref() {
            let pr = Ring(&l.peer_ring);
            for p in c.sq.iter_mut() {
                if let Stage::Published { seq, rnr_since } = &mut p.stage {
                    let w = pr.s(*seq, S_STATE).load(SeqCst);
                    let s = *seq;
                    if w == s << 3 | ST_CONSUMED {
                        p.stage = Stage::Done(WcStatus::Success);
                    } else if w == s << 3 | ST_NAK {
                        p.stage = Stage::Done(WcStatus::RemoteInvalidRequest);
                        break; // later WRs flush
                    } else if credits <= s {
                        let since = *rnr_since.get_or_insert_with(&mut now);
                        if rnr_retry != 7
                            && now().duration_since(since) > rnr_budget
                            && pr
                                .s(s, S_STATE)
                                .compare_exchange(
                                    s << 3 | ST_PUBLISHED,
                                    s << 3 | ST_CANCELLED,
                                    SeqCst,
                                    SeqCst,
                                )
                                .is_ok()
                        {
                            p.stage = Stage::Done(WcStatus::RnrRetryExceeded);
                            break; // later WRs flush
                        }
                    } else {
                        *rnr_since = None;
                    }
                }
            }
        }
        // 2. Execute queued WRs in order (they are the tail of the queue).
        // Without a link yet (the peer has not dialed us) only WRITEs ahead
        // of any SEND can go: they need the peer's region, not its ring.
        let queued = matches!(c.sq.back().map(|p| p.stage), Some(Stage::Queued));
        let mut tail = c.link.as_ref().map_or(0, |l| l.tail);
        let mut published = false;
        // RC: while an earlier SEND is refused with RNR, the responder does not
        // execute anything behind it, so a later WRITE must not land either.
        let mut rnr_blocked = false;
        for i in 0..if queued { c.sq.len() } else { 0 } {
            let p = &c.sq[i];
            match p.stage {
                Stage::Queued => {}
                Stage::Done(s) if s != WcStatus::Success => break,
                Stage::Published { seq, .. } => {
                    rnr_blocked |= credits <= seq;
                    continue;
                }
                _ => continue,
            }
            let needs_slot = !matches!(p.op, SendOp::RdmaWrite { .. });
            if rnr_blocked && !needs_slot {
                break;
            }
            let ring = c.link.as_ref().map(|l| &*l.peer_ring);
            if needs_slot && (ring.is_none() || tail.wrapping_sub(head) >= NSLOTS) {
                break; // no link yet, or ring full: stays queued
            }
            let result: std::result::Result<Option<(u64, u64)>, WcStatus> = (|| {
                match p.op {
                    SendOp::RdmaWrite { remote_addr, rkey }
                    | SendOp::RdmaWriteWithImm {
                        remote_addr, rkey, ..
                    } => {
                        let (m, off) = self.check_remote(rkey, remote_addr, p.len as usize)?;
                        self.gather(&p.payload, &m.mem, off)?;
                    }
                    _ => {
                        let r = ring.expect("checked above");
                        self.gather(&p.payload, r, Ring::slot(tail) + SLOT_HDR)?;
                    }
                }
                let (op, imm) = match p.op {
                    SendOp::RdmaWrite { .. } => return Ok(None),
                    SendOp::Send => (OP_SEND, None),
                    SendOp::SendWithImm(i) => (OP_SEND_IMM, Some(i)),
                    SendOp::RdmaWriteWithImm { imm, .. } => (OP_WRITE_IMM, Some(imm)),
                };
                Ok(Some((op, imm.map(|i| i as u64 | 1 << 32).unwrap_or(0))))
            })();
            let len = p.len as u64;
            let sq_psn = c.sq_psn;
            let p = &mut c.sq[i];
            match result {
                Err(s) => {
                    p.stage = Stage::Done(s);
                    break;
                }
                Ok(None) => p.stage = Stage::Done(WcStatus::Success),
                Ok(Some((op, imm))) => {
                    let pr = Ring(ring.expect("a slot op has a ring"));
                    let psn = (sq_psn as u64).wrapping_add(tail) & 0xff_ffff;
                    pr.s(tail, S_META).store(op | len << 32, Relaxed);
                    pr.s(tail, S_IMM).store(imm | psn << 40, Relaxed);
                    // Publish: everything above (including earlier WRITE copies) happens-before.
                    pr.s(tail, S_STATE).store(tail << 3 | ST_PUBLISHED, SeqCst);
                    p.stage = Stage::Published {
                        seq: tail,
                        rnr_since: None,
                    };
                    tail = tail.wrapping_add(1);
                    pr.h(R_TAIL).store(tail, Release);
                    published = true;
                }
            }
        }
        if let Some(l) = c.link.as_mut() {
            l.tail = tail;
            if published && Ring(&l.peer_ring).h(R_RX_NOTIFY).swap(0, SeqCst) == 1 {
                if let Some(e) = &l.peer_rx_efd {
                    e.signal();
                }
            }
        }
        // 3. Complete in order.
        while let Some(Stage::Done(s)) = c.sq.front().map(|p| p.stage) {
            let p = c.sq.pop_front().expect("front exists");
            if s != WcStatus::Success {
                c.sq.push_front(p);
                self.fail_locked(c, None, false);
                return;
            }
            if p.signaled {
                self.send_cq
                    .push(wc(p.wr_id, s, send_opcode(p.op), p.len, None, self.qpn));
            }
        }
    }

    /// Takes published slots of our ring into posted receives. The slots are
    /// the peer's to write, so everything read from them is checked, the
    /// consumer index is ours (in `core`), and one pass looks at most at one
    /// ring's worth of slots: a peer rewriting slots under us can make us
    /// NAK and fail the QP, never loop, panic or copy out of bounds.
    fn progress_recv(&self, c: &mut Core) {
        {
            // nothing published at the head (the usual case): no more work
            if !slot_taken(&c.ring, c.head) {
                return;
            }
        }
        let ring = c.ring.clone();
        let r = Ring(&ring);
        let mut consumed = false;
        for _ in 0..NSLOTS {
            let head = c.head;
            let w = r.s(head, S_STATE).load(SeqCst);
            if w >> 3 != head {
                break;
            }
            match w & 7 {
                ST_CANCELLED => {
                    c.head = head.wrapping_add(1);
                    r.h(R_HEAD).store(c.head, Release);
                    continue;
                }
                ST_PUBLISHED => {}
                _ => break,
            }
            let Some((wr_id, sges)) = c.rq.front() else {
                break;
            }; // RNR
            let (wr_id, sges) = (*wr_id, sges.as_slice());
            let meta = r.s(head, S_META).load(Relaxed);
            let immw = r.s(head, S_IMM).load(Relaxed);
            let (op, len) = (meta & 0xffff_ffff, (meta >> 32) as usize);
            let imm = (immw & (1 << 32) != 0).then_some(immw as u32);
            let psn = (immw >> 40) as u32 & 0xff_ffff;
            let opcode = if op == OP_WRITE_IMM {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let expect_psn = (c.rq_psn as u64).wrapping_add(head) as u32 & 0xff_ffff;
            let mut status = WcStatus::Success;
            if !matches!(op, OP_SEND | OP_SEND_IMM | OP_WRITE_IMM) || psn != expect_psn {
                status = WcStatus::RemoteInvalidRequest;
            } else if op != OP_WRITE_IMM {
                let cap: u64 = sges.iter().map(|s| s.length as u64).sum();
                if len > SLOT_PAYLOAD || len as u64 > cap {
                    status = WcStatus::LocalLengthError;
                } else {
                    let mut src = Ring::slot(head) + SLOT_HDR;
                    let mut rest = len;
                    for s in sges {
                        if rest == 0 {
                            break;
                        }
                        let n = rest.min(s.length as usize);
                        let ok = self.dev.local_mr(s.lkey).is_some_and(|mr| {
                            mr.pd == self.pd
                                && mr.access.contains(Access::LOCAL_WRITE)
                                && s.addr.checked_sub(mr.iova).is_some_and(|off| {
                                    check_range(off as usize, n, mr.len).is_ok()
                                        && mr
                                            .mem
                                            .copy_from(mr.at(off as usize), &ring, src, n)
                                            .is_ok()
                                })
                        });
                        if !ok {
                            status = WcStatus::LocalProtectionError;
                            break;
                        }
                        src += n;
                        rest -= n;
                    }
                }
            }
            let next = if status == WcStatus::Success {
                ST_CONSUMED
            } else {
                ST_NAK
            };
            c.head = head.wrapping_add(1);
            if r.s(head, S_STATE)
                .compare_exchange(head << 3 | ST_PUBLISHED, head << 3 | next, SeqCst, SeqCst)
                .is_err()
            {
                // The sender withdrew it (RNR retries exhausted): skip, keep the receive.
                r.h(R_HEAD).store(c.head, Release);
                continue;
            }
            r.h(R_HEAD).store(c.head, Release);
            c.rq.pop_front();
            consumed = true;
            self.recv_cq.push(wc(
                wr_id,
                status,
                opcode,
                if status == WcStatus::Success {
                    len as u32
                } else {
                    0
                },
                imm,
                self.qpn,
            ));
            if status != WcStatus::Success {
                self.fail_locked(c, None, false);
                break;
            }
        }
        if consumed {
            if let Some(l) = c.link.as_ref() {
                if r.h(R_TX_NOTIFY).swap(0, SeqCst) == 1 {
                    if let Some(e) = &l.peer_tx_efd {
                        e.signal();
                    }
                }
            }
        }
    }
}

/// Whether the sender wrote slot `seq` of `ring` (published or withdrew it).
fn slot_taken(ring: &SharedMem, seq: u64) -> bool {
    let w = Ring(ring).s(seq, S_STATE).load(SeqCst);
    w >> 3 == seq && w & 7 != 0
}

/// An RC queue pair of an `shm` device; destroyed on drop.
pub struct ShmQp {
    inner: Arc<QpInner>,
}

impl ShmQp {
    /// Test hook for the threat-model tests: asks the peer for its region
    /// `rkey` over this QP's link as a WRITE would, but without the writer's
    /// own checks (what a hostile peer running its own code would do), and
    /// says whether the peer handed it out. Nothing is kept.
    #[doc(hidden)]
    pub fn peer_hands_out(&self, rkey: u32) -> bool {
        self.inner.fetch_region(rkey).is_ok()
    }

    /// Test hook for the threat-model tests: what the peer hands out for its
    /// region `rkey` over this QP's link, as a hostile peer's own code would
    /// keep it — the memfd the region lives in, and the region's offset and
    /// length in it — or `None` if it refuses.
    #[doc(hidden)]
    pub fn peer_region_memfd(&self, rkey: u32) -> Option<(OwnedFd, u64, usize)> {
        let (m, fd) = self.inner.ask_region(rkey).ok()?;
        Some((fd, m.z, m.y as usize))
    }
}

impl QueuePair for ShmQp {
    fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        let q = &self.inner;
        if lock(&q.core).state != QpState::Rts {
            return None;
        }
        let (m, off) = q.check_remote(rkey, addr, len).ok()?;
        Some(MemWindow::new(Arc::new(RemoteMem(m)), off, len))
    }

    /// Maps the peer's region now (asking its owner over the link), so that
    /// WRITEs to it later need nothing this process may lack by then (a
    /// descriptor for the moment of the mapping).
    fn prepare_remote(&self, rkey: u32, addr: u64, len: usize) -> Result<()> {
        let q = &self.inner;
        let st = lock(&q.core).state;
        if !matches!(st, QpState::Rtr | QpState::Rts) {
            return Err(Error::InvalidState {
                op: "prepare_remote",
                state: st,
            });
        }
        let m = q.peer_region(rkey).map_err(FetchError::into_error)?;
        m.check(addr, len).map_err(|_| {
            Error::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are not writable in the peer's region {rkey:#x}"
            ))
        })?;
        Ok(())
    }

    fn state(&self) -> QpState {
        lock(&self.inner.core).state
    }

    fn modify(&self, m: &QpModify) -> Result<()> {
        let q = &self.inner;
        let cur = lock(&q.core).state;
        let next = cur.next(m.kind())?;
        match *m {
            QpModify::Init { port, access } => {
                if port != 1 {
                    return Err(Error::NoSuchPort(port));
                }
                let mut c = lock(&q.core);
                c.access = access;
                Ring(&c.ring)
                    .h(R_ACCESS)
                    .store(access.bits() as u64, Release);
                let mut ctl = lock(&q.ctl);
                ctl.access = access;
                ctl.accepting = true;
            }
            QpModify::Rtr {
                remote,
                sgid_index,
                rq_psn,
                path_mtu,
                min_rnr_timer,
            } => {
                if !q.dev.port_up.load(Acquire) {
                    return Err(Error::Connect("port is down".into()));
                }
                let active = port_attr(&q.dev.netdev).active_mtu;
                if path_mtu > active {
                    return Err(Error::InvalidArgument(format!(
                        "path MTU {path_mtu:?} exceeds the port's active MTU {active:?}"
                    )));
                }
                let gids = gid_table(&q.dev.netdev);
                let sgid = gids
                    .get(sgid_index as usize)
                    .ok_or_else(|| Error::InvalidArgument(format!("no GID index {sgid_index}")))?
                    .gid;
                // The peer looks us up by this GID: make sure it is registered
                // even if the address appeared since the last device tick.
                q.dev.publish_gids();
                {
                    let mut c = lock(&q.core);
                    c.rq_psn = rq_psn & 0xff_ffff;
                    c.min_rnr_timer = min_rnr_timer;
                    Ring(&c.ring)
                        .h(R_RNR_TIMER)
                        .store(min_rnr_timer.as_nanos() as u64, Release);
                }
                q.dial(remote, sgid, rq_psn & 0xff_ffff)?;
            }
            QpModify::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
            } => {
                if retry_cnt > 7 || rnr_retry > 7 {
                    return Err(Error::InvalidArgument("retry counts are 0..=7".into()));
                }
                {
                    let mut c = lock(&q.core);
                    if cur == QpState::Rtr {
                        c.sq_psn = sq_psn & 0xff_ffff;
                    }
                    c.timeout = timeout;
                    c.retry_cnt = retry_cnt;
                    c.rnr_retry = rnr_retry;
                }
                if cur == QpState::Rtr {
                    q.on_rts(sq_psn & 0xff_ffff);
                }
            }
            QpModify::Err => {
                q.fail(None, false);
                return Ok(());
            }
            QpModify::Reset => {
                let (ring, ring_fd) = new_ring()?;
                let mut c = lock(&q.core);
                // RESET discards outstanding WRs without completions (as verbs
                // does) but still tells the peer that this end is gone.
                c.sq.clear();
                c.rq.clear();
                q.fail_locked(&mut c, None, false);
                q.release_link(&mut c);
                *lock(&q.ctl) = Ctl::default();
                *c = Core::new(ring, ring_fd);
                return Ok(());
            }
        }
        let mut c = lock(&q.core);
        if c.state != cur {
            return Err(Error::InvalidState {
                op: "modify (state changed concurrently)",
                state: c.state,
            });
        }
        c.state = next;
        q.live
            .store(matches!(next, QpState::Rtr | QpState::Rts), SeqCst);
        q.adopt_ready(&mut c);
        Ok(())
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let q = &self.inner;
        let mut c = lock(&q.core);
        if q.fail_pending.load(Relaxed) {
            let (first, event) = *lock(&q.fail_what);
            q.fail_locked(&mut c, first, event);
        }
        if c.state != QpState::Rts {
            return Err(Error::InvalidState {
                op: "post_send",
                state: c.state,
            });
        }
        validate_send(wr, &q.cap, SLOT_PAYLOAD as u32)?;
        q.adopt_ready(&mut c);
        if c.sq.len() >= q.cap.max_send_wr as usize {
            q.progress_locked(&mut c);
            if c.sq.len() >= q.cap.max_send_wr as usize {
                return Err(Error::QueueFull);
            }
        }
        if let (SendOp::RdmaWrite { remote_addr, rkey }, Payload::Inline(d)) = (wr.op, wr.payload) {
            if q.executes_at_post(&c, wr.signaled) {
                if let Ok((m, off)) = q.check_remote(rkey, remote_addr, d.len()) {
                    if m.mem.write(off, d).is_ok() {
                        if wr.signaled {
                            q.send_cq.push(wc(
                                wr.wr_id,
                                WcStatus::Success,
                                WcOpcode::RdmaWrite,
                                d.len() as u32,
                                None,
                                q.qpn,
                            ));
                        }
                        return Ok(());
                    }
                }
                // anything wrong: queue it, progress reports the error in order
            }
        }
        let payload = match wr.payload {
            Payload::Inline(d) if d.len() <= SMALL => {
                let mut b = [0u8; SMALL];
                b[..d.len()].copy_from_slice(d);
                OwnedPayload::Small(b, d.len() as u8)
            }
            Payload::Inline(d) => OwnedPayload::Inline(d.to_vec()),
            Payload::Sges(s) => OwnedPayload::Sges(Sges::new(s)),
        };
        c.sq.push_back(Pending {
            wr_id: wr.wr_id,
            op: wr.op,
            payload,
            signaled: wr.signaled,
            len: wr.payload.len() as u32,
            stage: Stage::Queued,
        });
        q.progress_send(&mut c);
        Ok(())
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let q = &self.inner;
        let mut c = lock(&q.core);
        if !c.state.can_post_recv() {
            return Err(Error::InvalidState {
                op: "post_recv",
                state: c.state,
            });
        }
        if c.state == QpState::Err {
            q.recv_cq.push(wc(
                wr.wr_id,
                WcStatus::WrFlushError,
                WcOpcode::Recv,
                0,
                None,
                q.qpn,
            ));
            return Ok(());
        }
        if c.rq.len() >= q.cap.max_recv_wr as usize {
            return Err(Error::QueueFull);
        }
        c.rq.push_back((wr.wr_id, Sges::new(wr.sges)));
        c.recv_posted += 1;
        let n = c.recv_posted;
        Ring(&c.ring).h(R_RECV_CREDITS).store(n, Release);
        Ok(())
    }
}

impl Drop for ShmQp {
    fn drop(&mut self) {
        let q = &self.inner;
        {
            let mut c = lock(&q.core);
            q.fail_locked(&mut c, None, false);
            q.release_link(&mut c);
            c.ring_fd = None;
        }
        lock(&q.dev.qps).remove(&q.qpn);
        q.dev.reg.release_qpn(q.qpn, &q.dev.sock_path);
        q.dev.wake.signal();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_roundtrip_and_errors() {
        let c = ShmConfig::parse(
            "# x\nrundir /tmp/r\npeer_timeout_ms 500\npoll_interval_ms 10\ndevice shm0 netdev lo\n",
        )
        .unwrap();
        assert_eq!(
            c.devices,
            vec![ShmDeviceConfig {
                name: "shm0".into(),
                netdev: "lo".into()
            }]
        );
        assert_eq!(c.peer_timeout, Duration::from_millis(500));
        assert_eq!(ShmConfig::parse(&c.to_text()).unwrap(), c);
        assert!(ShmConfig::parse("device a netdev x\ndevice a netdev y").is_err());
        assert!(ShmConfig::parse("bogus").is_err());
        assert!(ShmConfig::parse("poll_interval_ms 0").is_err());
    }

    #[test]
    fn loopback_gids_and_unknown_netdev() {
        let g = gid_table("lo");
        assert!(g
            .iter()
            .any(|e| e.gid == Gid::from_ip("127.0.0.1".parse().unwrap())
                && e.gid_type == GidType::RoceV2));
        let dir = std::env::temp_dir().join(format!("smc-unit-{}", std::process::id()));
        let cfg = ShmConfig {
            devices: vec![ShmDeviceConfig {
                name: "x".into(),
                netdev: "nonexistent0".into(),
            }],
            rundir: dir,
            ..Default::default()
        };
        assert!(matches!(
            ShmProvider::new(cfg).open_device("x"),
            Err(Error::Config(_))
        ));
    }
}
