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
//!   rundir and registers under `gid-<hex>/` for each of its GIDs and under
//!   `qpn-<hex6>` for each of its QPs (see [`registry`] for the layout, the
//!   allocation and the clean-up of entries left by dead processes). Moving a
//!   QP to RTR looks up the instance owning (GID, QPN), connects to its
//!   socket and exchanges, with `SCM_RIGHTS`, each side's receive ring (a
//!   memfd) and the eventfds of its completion channels.
//! * Registered memory is a memfd (`pd.alloc_mr`), so an RDMA WRITE is one
//!   memcpy straight into the peer's mapping after the rkey, bounds, PD and
//!   access rights were checked against the region's header (which lives in
//!   the shared memory, so deregistration revokes access at once). A violation
//!   completes the WR with `RemoteAccessError` and moves the writer's QP to
//!   ERR; nothing outside the region is ever touched.
//! * SENDs (and WRITE WITH IMMEDIATE) are slots of the peer's receive ring,
//!   published with a release store *after* any earlier WRITE's copy, so the
//!   receiver sees written data before a later SEND (RC ordering). The
//!   receiver moves published slots into its posted receive buffers when its
//!   CQ is polled; the slot's state word is the ACK. With no receive posted
//!   the slot waits (RNR) until `rnr_retry` is exhausted (7 = forever).
//! * There is no data-path thread: posting copies in the caller's thread, and
//!   polling a CQ makes progress. The device thread only handles rendezvous,
//!   port state, heartbeats and peer death (socket hang-up or a heartbeat
//!   that stops for `peer_timeout`), moving QPs to ERR with a `QpFatal` event.
//!
//! This module has no `unsafe`: mapping and raw copies live in [`crate::sys`].
#![forbid(unsafe_code)]

pub mod layout;
pub mod registry;

use registry::Registry;
pub use registry::{QPN_MAX, QPN_MIN};

use crate::sys::{self, EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use layout::*;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub use layout::SLOT_PAYLOAD as MAX_SEND_SIZE;

/// Inline payloads are copied at post time: an inline RDMA WRITE posted on an
/// idle send queue goes straight from the caller's buffer into the peer's
/// region (one copy, like a CPU store), so any size up to the largest region
/// is allowed. Behind queued WRs it is kept in a heap copy until its turn.
const MAX_INLINE: u32 = 1 << 30;

/// A map keyed by keys, QP numbers and GIDs, looked up for every WR: hashed
/// with a multiply-rotate (FxHash's) instead of SipHash, which cost more than
/// the rest of a 64-byte RDMA WRITE's checks. Only this device inserts
/// entries (its own keys and QPs, and regions a peer proved to exist), so
/// the hash needs no protection against chosen collisions.
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

/// `$SMC_RDMA_RUNDIR`, else `/run/smc-rs` if usable, else
/// `$XDG_RUNTIME_DIR/smc-rs`, else `/tmp/smc-rs`.
pub fn default_rundir() -> PathBuf {
    if let Some(d) = std::env::var_os("SMC_RDMA_RUNDIR") {
        return d.into();
    }
    let run = PathBuf::from("/run/smc-rs");
    if std::fs::create_dir_all(&run).is_ok() {
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

// ------------------------------------------------------------------ wire

const MSG_MAGIC: u32 = 0x534d_4352;
const K_HELLO: u32 = 1;
const K_HELLO_ACK: u32 = 2;
const K_MR_REQ: u32 = 3;
const K_MR_RESP: u32 = 4;
const K_NAK: u32 = 5;
const MSG_LEN: usize = 48;

#[derive(Clone, Copy, Debug, Default)]
struct Msg {
    kind: u32,
    src_qpn: u32,
    dst_qpn: u32,
    gid: Gid,
    pd: u32,
    rkey: u32,
    flags: u32,
}

impl Msg {
    fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        for (i, v) in [
            MSG_MAGIC,
            self.kind,
            self.src_qpn,
            self.dst_qpn,
            self.pd,
            self.rkey,
            self.flags,
        ]
        .iter()
        .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        b[28..44].copy_from_slice(&self.gid.0);
        b
    }
    fn decode(b: &[u8]) -> Option<Msg> {
        if b.len() != MSG_LEN {
            return None;
        }
        let w = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        if w(0) != MSG_MAGIC {
            return None;
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[28..44]);
        Some(Msg {
            kind: w(1),
            src_qpn: w(2),
            dst_qpn: w(3),
            pd: w(4),
            rkey: w(5),
            flags: w(6),
            gid: Gid(gid),
        })
    }
}

fn recv_msg(s: &SeqPacket) -> std::io::Result<(Msg, Vec<OwnedFd>)> {
    let mut b = [0u8; 64];
    let (n, fds) = s.recv(&mut b)?;
    let m = Msg::decode(&b[..n])
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad message"))?;
    Ok((m, fds))
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

struct LocalMr {
    lkey: u32,
    rkey: u32,
    pd: u32,
    mem: SharedMem,
    len: usize,
    iova: u64,
    access: Access,
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
    port_up: AtomicBool,
    events: Mutex<VecDeque<AsyncEvent>>,
    event_fd: EventFd,
    lkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    rkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    qps: Mutex<KeyMap<u32, Weak<QpInner>>>,
    /// Peer regions by (peer GID, peer QPN, rkey).
    remote_mrs: Mutex<KeyMap<(Gid, u32, u32), Arc<SharedMem>>>,
    next_id: AtomicU32,
    salt: u32,
    stop: AtomicBool,
    frozen: AtomicBool,
    /// Test hook: the port is down whatever the interface says.
    forced_down: AtomicBool,
    wake: EventFd,
}

impl DevShared {
    fn id(&self) -> u32 {
        let n = self.next_id.fetch_add(1, Relaxed);
        (n << 8) | ((n.wrapping_mul(0x9e37_79b9) ^ self.salt) >> 24)
    }
    fn raise(&self, ev: AsyncEvent) {
        lock(&self.events).push_back(ev);
        self.event_fd.signal();
    }
    fn qp_list(&self) -> Vec<Arc<QpInner>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }
    /// Adds this instance to `gid-<hex>/` of every current GID of the netdev
    /// (also GIDs that appeared since the last call).
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

    /// Looks up (or fetches over the peer instance's socket) the region
    /// `rkey` of the peer QP of link `l`.
    fn remote_mr(&self, l: &Link, rkey: u32) -> std::result::Result<Arc<SharedMem>, WcStatus> {
        let key = (l.peer_gid, l.peer_qpn, rkey);
        if let Some(m) = lock(&self.remote_mrs).get(&key) {
            if MrView(m).h(MR_VALID).load(Acquire) == 1 {
                return Ok(m.clone());
            }
        }
        lock(&self.remote_mrs).remove(&key);
        let s = match &l.peer_sock {
            Some(p) => SeqPacket::connect(p).ok(),
            None => self.reg.connect(&l.peer_gid, l.peer_qpn).ok().map(|c| c.0),
        }
        .ok_or(WcStatus::RetryExceeded)?;
        s.set_read_timeout(Duration::from_secs(2))
            .map_err(|_| WcStatus::RetryExceeded)?;
        s.send(
            &Msg {
                kind: K_MR_REQ,
                rkey,
                ..Default::default()
            }
            .encode(),
            &[],
        )
        .map_err(|_| WcStatus::RetryExceeded)?;
        let (m, mut fds) = recv_msg(&s).map_err(|_| WcStatus::RetryExceeded)?;
        if m.kind != K_MR_RESP || fds.len() != 1 {
            return Err(WcStatus::RemoteAccessError);
        }
        let mem = SharedMem::map(fds.remove(0)).map_err(|_| WcStatus::RemoteAccessError)?;
        let v = MrView(&mem);
        if mem.len() < HDR
            || v.h(0).load(Acquire) != MR_MAGIC
            || v.h(MR_RKEY).load(Acquire) != rkey as u64
        {
            return Err(WcStatus::RemoteAccessError);
        }
        let mem = Arc::new(mem);
        lock(&self.remote_mrs).insert(key, mem.clone());
        Ok(mem)
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
        if sys::link(&d.netdev)?.is_none() {
            return Err(Error::Config(format!(
                "device {}: network interface {} does not exist",
                d.name, d.netdev
            )));
        }
        static INSTANCE: AtomicU32 = AtomicU32::new(0);
        std::fs::create_dir_all(&cfg.rundir)?;
        let pid = std::process::id();
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let salt = (t.subsec_nanos() ^ pid.rotate_left(16)).wrapping_mul(0x85eb_ca6b);
        let seq = INSTANCE.fetch_add(1, Relaxed);
        let tag = format!("dev-{}-{pid}-{seq}-{:08x}", d.name, salt ^ seq);
        let reg = Registry::new(&cfg.rundir);
        let sock_path = reg.sock_path(&tag);
        let listener = {
            // Bind and listen under the lock: a concurrent sweep must never
            // see the socket file before it accepts connections.
            let g = reg.lock();
            reg.sweep(&g);
            SeqPacket::listen(&sock_path)?
        };
        let sh = Arc::new(DevShared {
            name: d.name.clone(),
            netdev: d.netdev.clone(),
            reg,
            tag,
            sock_path,
            links: Mutex::new(vec![]),
            peer_timeout: cfg.peer_timeout,
            poll_interval: cfg.poll_interval,
            port_up: AtomicBool::new(netdev_up(&d.netdev)),
            events: Mutex::new(VecDeque::new()),
            event_fd: EventFd::new()?,
            lkeys: Mutex::new(KeyMap::default()),
            rkeys: Mutex::new(KeyMap::default()),
            qps: Mutex::new(KeyMap::default()),
            remote_mrs: Mutex::new(KeyMap::default()),
            next_id: AtomicU32::new(1),
            salt,
            stop: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            forced_down: AtomicBool::new(false),
            wake: EventFd::new()?,
        });
        sh.publish_gids();
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("shm-{}", d.name))
            .spawn(move || device_thread(s2, listener))?;
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
            let mut c = lock(&qp.core);
            if let Some(l) = c.link.as_mut() {
                l.sock = None;
            }
            c.extra_socks.clear();
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
            pd: self.sh.id(),
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

fn device_thread(sh: Arc<DevShared>, listener: SeqPacket) {
    let mut last_tick = Instant::now();
    let mut ticks: u64 = 0;
    while !sh.stop.load(Acquire) {
        if sh.frozen.load(Acquire) {
            // Hung on purpose (test hook): no answers, no heartbeats.
            let _ = sh.wake.wait(sh.poll_interval);
            continue;
        }
        // Gather descriptors: listener, wake, and the link sockets of live QPs
        // (a failed QP's socket may stay hung-up; polling it would spin).
        let qps = sh.qp_list();
        let mut fds = vec![
            (listener.as_fd().as_raw_fd(), libc::POLLIN, 0i16),
            (sh.wake.as_fd().as_raw_fd(), libc::POLLIN, 0),
        ];
        let mut owners = vec![];
        for qp in &qps {
            // bounded, like `tick`: the holder may be waiting for this thread
            let Some(c) = lock_within(&qp.core, Duration::from_millis(5)) else {
                continue;
            };
            if matches!(c.state, QpState::Err | QpState::Reset) {
                continue;
            }
            if let Some(s) = c.link.as_ref().and_then(|l| l.sock.as_ref()) {
                fds.push((s.as_fd().as_raw_fd(), libc::POLLIN, 0));
                owners.push(qp.clone());
            }
            for s in &c.extra_socks {
                fds.push((s.as_fd().as_raw_fd(), libc::POLLIN, 0));
                owners.push(qp.clone());
            }
        }
        let _ = sys::poll_raw(&mut fds, Some(sh.poll_interval));
        if sh.stop.load(Acquire) {
            break;
        }
        if fds[1].2 != 0 {
            sh.wake.drain();
        }
        if fds[0].2 & libc::POLLIN != 0 && !sh.frozen.load(Acquire) {
            if let Ok(s) = listener.accept() {
                // Each request gets its own short-lived thread: a handler may
                // wait for a QP lock whose holder is itself waiting for an
                // answer from this device (an MR fetch under the QP lock, two
                // QPs of one process connecting to each other), and one
                // serial handler would turn that into a 2 s stall and a
                // failed link. Requests are rare (QP connect, first use of a
                // peer region).
                // (If no thread can be had, the socket closes and the
                // requester sees its request fail.)
                let sh2 = sh.clone();
                let _ = std::thread::Builder::new()
                    .name("shm-req".into())
                    .spawn(move || handle_conn(&sh2, s));
            }
        }
        for (i, qp) in owners.iter().enumerate() {
            if fds[i + 2].2 != 0 && !sh.frozen.load(Acquire) {
                // Any traffic or hang-up on a link socket means the peer closed it.
                qp.fail(Some(WcStatus::RetryExceeded), true);
            }
        }
        if last_tick.elapsed() >= sh.poll_interval {
            last_tick = Instant::now();
            ticks += 1;
            if !sh.frozen.load(Acquire) {
                tick(&sh, &qps, ticks);
            }
        }
    }
    // Dropping the listener and (on crash) the link sockets closes them.
}

fn tick(sh: &DevShared, qps: &[Arc<QpInner>], ticks: u64) {
    let up = netdev_up(&sh.netdev) && !sh.forced_down.load(Acquire);
    if up != sh.port_up.swap(up, AcqRel) {
        if up {
            sh.raise(AsyncEvent::PortActive { port: 1 });
        } else {
            sh.raise(AsyncEvent::PortError { port: 1 });
            for qp in qps {
                qp.fail(None, false);
            }
        }
    }
    if ticks.is_multiple_of(25) {
        sh.publish_gids();
    }
    let now = Instant::now();
    for qp in qps {
        let mut dead = false;
        {
            // Only the heartbeat lock: `core` may be taken by the QP's owner
            // (posting, polling, or fetching a peer region over a rendezvous
            // socket that this very thread may have to answer), and the
            // heartbeat must go on regardless.
            let mut hb = lock(&qp.hb);
            let Some(h) = hb.as_mut() else { continue };
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
        if dead {
            qp.fail(Some(WcStatus::RetryExceeded), true);
        }
    }
}

fn handle_conn(sh: &DevShared, s: SeqPacket) {
    let _ = s.set_read_timeout(Duration::from_secs(1));
    let Ok((m, fds)) = recv_msg(&s) else { return };
    let nak = |s: &SeqPacket| {
        let _ = s.send(
            &Msg {
                kind: K_NAK,
                ..Default::default()
            }
            .encode(),
            &[],
        );
    };
    match m.kind {
        K_MR_REQ => {
            let mr = lock(&sh.rkeys).get(&m.rkey).cloned();
            match mr {
                Some(mr) => {
                    let _ = s.send(
                        &Msg {
                            kind: K_MR_RESP,
                            rkey: m.rkey,
                            ..Default::default()
                        }
                        .encode(),
                        &[mr.mem.fd()],
                    );
                }
                None => nak(&s),
            }
        }
        K_HELLO => {
            let qp = lock(&sh.qps).get(&m.dst_qpn).and_then(Weak::upgrade);
            let Some(qp) = qp else { return nak(&s) };
            match qp.accept_hello(&m, fds) {
                Ok(reply_fds) => {
                    let bf: Vec<BorrowedFd<'_>> = reply_fds.iter().map(|f| f.as_fd()).collect();
                    let flags = qp.efd_flags();
                    let ok = s
                        .send(
                            &Msg {
                                kind: K_HELLO_ACK,
                                src_qpn: qp.qpn,
                                dst_qpn: m.src_qpn,
                                pd: qp.pd,
                                flags,
                                ..Default::default()
                            }
                            .encode(),
                            &bf,
                        )
                        .is_ok();
                    if ok {
                        let mut c = lock(&qp.core);
                        match c.link.as_mut() {
                            Some(l) if l.sock.is_none() => l.sock = Some(s),
                            _ => c.extra_socks.push(s),
                        }
                        drop(c);
                        sh.wake.signal();
                    }
                }
                Err(_) => nak(&s),
            }
        }
        _ => nak(&s),
    }
}

// ------------------------------------------------------------------ PD / MR

/// A protection domain of an `shm` device.
pub struct ShmPd {
    dev: Arc<DevShared>,
    pd: u32,
}

impl ProtectionDomain for ShmPd {
    type P = ShmProvider;

    fn alloc_mr(&self, len: usize, access: Access) -> Result<ShmMr> {
        if len == 0 || len > (1 << 32) - HDR {
            return Err(Error::InvalidArgument(format!(
                "memory region length {len} out of range"
            )));
        }
        let lkey = self.dev.id();
        let rkey = lkey.rotate_left(13) ^ 0x5bd1_e995 ^ self.dev.salt;
        let mem = SharedMem::create(&format!("smc-mr-{lkey:x}"), HDR + len)?;
        let iova = (lkey as u64) << 32;
        let v = MrView(&mem);
        v.h(MR_RKEY).store(rkey as u64, Relaxed);
        v.h(MR_LEN).store(len as u64, Relaxed);
        v.h(MR_ACCESS).store(access.bits() as u64, Relaxed);
        v.h(MR_IOVA).store(iova, Relaxed);
        v.h(MR_PD).store(self.pd as u64, Relaxed);
        v.h(MR_VALID).store(1, Relaxed);
        v.h(0).store(MR_MAGIC, Release);
        let mr = Arc::new(LocalMr {
            lkey,
            rkey,
            pd: self.pd,
            mem,
            len,
            iova,
            access,
        });
        lock(&self.dev.lkeys).insert(lkey, mr.clone());
        lock(&self.dev.rkeys).insert(rkey, mr.clone());
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
        let qpn = self.dev.reg.alloc_qpn(&self.dev.sock_path)?;
        let ring = match new_ring(qpn) {
            Ok(r) => r,
            Err(e) => {
                self.dev.reg.release_qpn(qpn, &self.dev.sock_path);
                return Err(e);
            }
        };
        let inner = Arc::new(QpInner {
            dev: self.dev.clone(),
            qpn,
            pd: self.pd,
            cap,
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
            core: Mutex::new(Core::new(ring)),
            hb: Mutex::new(None),
            live: AtomicBool::new(false),
        });
        lock(&self.dev.qps).insert(qpn, Arc::downgrade(&inner));
        lock(&send_cq.inner.qps).push(Arc::downgrade(&inner));
        if !Arc::ptr_eq(&send_cq.inner, &recv_cq.inner) {
            lock(&recv_cq.inner.qps).push(Arc::downgrade(&inner));
        }
        Ok(ShmQp { inner })
    }
}

fn new_ring(qpn: u32) -> Result<Arc<SharedMem>> {
    let m = SharedMem::create(&format!("smc-ring-{qpn:x}"), RING_LEN)?;
    Ring(&m).h(0).store(RING_MAGIC, Release);
    Ok(Arc::new(m))
}

/// A memory region of an `shm` device (a memfd shared with peers).
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
        Ok(self.mr.mem.read(HDR + off, buf)?)
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.mr.len)?;
        Ok(self.mr.mem.write(HDR + off, data)?)
    }
    fn window(&self) -> Option<MemWindow> {
        Some(MemWindow::new(self.mr.clone(), HDR, self.mr.len))
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

/// A peer's region mapped here, as a [`QueuePair::remote_window`] gives it:
/// each copy into it first checks that the peer still has it registered,
/// as each executed WRITE does.
struct RemoteMem(Arc<SharedMem>);

impl MappedMem for RemoteMem {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        Ok(self.0.read(off, buf)?)
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        if MrView(&self.0).h(MR_VALID).load(Acquire) != 1 {
            return Err(Error::InvalidArgument(
                "the peer's memory region is no longer registered".into(),
            ));
        }
        Ok(self.0.write(off, data)?)
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        // Revoke remote access first: peers check this word before each write.
        MrView(&self.mr.mem).h(MR_VALID).store(0, SeqCst);
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
            if Arc::ptr_eq(&qp.recv_cq, &self.inner) && !c.rq.is_empty() {
                let r = Ring(&c.ring);
                if r.h(R_TAIL).load(Acquire) != r.h(R_HEAD).load(Relaxed) {
                    return true;
                }
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

struct Link {
    peer_qpn: u32,
    peer_gid: Gid,
    /// The peer instance's socket (for region look-ups), when known.
    peer_sock: Option<PathBuf>,
    peer_pd: u32,
    peer_ring: Arc<SharedMem>,
    peer_rx_efd: Option<EventFd>,
    peer_tx_efd: Option<EventFd>,
    sock: Option<SeqPacket>,
}

struct Core {
    state: QpState,
    access: Access,
    ring: Arc<SharedMem>,
    remote: Option<RemoteQp>,
    rq_psn: u32,
    sq_psn: u32,
    timeout: Duration,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: Duration,
    rq: VecDeque<(u64, Sges)>,
    sq: VecDeque<Pending>,
    link: Option<Link>,
    extra_socks: Vec<SeqPacket>,
    recv_posted: u64,
    /// The peer's ring head (how far it consumed our SENDs) when the send
    /// queue last looked at acknowledgements (see `may_have_work`).
    seen_peer_head: u64,
}

impl Core {
    fn new(ring: Arc<SharedMem>) -> Core {
        Core {
            state: QpState::Reset,
            access: Access::NONE,
            ring,
            remote: None,
            rq_psn: 0,
            sq_psn: 0,
            timeout: Duration::from_millis(100),
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: Duration::from_millis(1),
            rq: VecDeque::new(),
            sq: VecDeque::new(),
            link: None,
            extra_socks: vec![],
            recv_posted: 0,
            seen_peer_head: 0,
        }
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

impl QpInner {
    fn efd_flags(&self) -> u32 {
        (self.recv_cq.chan.is_some() as u32) | ((self.send_cq.chan.is_some() as u32) << 1)
    }

    /// Descriptors we hand to the peer: our ring, then our channels' eventfds.
    fn hello_fds(&self, ring: &SharedMem) -> std::io::Result<Vec<OwnedFd>> {
        let mut v = vec![ring.fd().try_clone_to_owned()?];
        if let Some(c) = &self.recv_cq.chan {
            v.push(c.as_fd().try_clone_to_owned()?);
        }
        if let Some(c) = &self.send_cq.chan {
            v.push(c.as_fd().try_clone_to_owned()?);
        }
        Ok(v)
    }

    fn make_link(
        &self,
        m: &Msg,
        gid: Gid,
        mut fds: Vec<OwnedFd>,
        sock: Option<SeqPacket>,
        peer_sock: Option<PathBuf>,
    ) -> Result<Link> {
        let want = 1 + (m.flags & 1) as usize + ((m.flags >> 1) & 1) as usize;
        if fds.len() != want {
            return Err(Error::Connect(format!(
                "peer sent {} descriptors, expected {want}",
                fds.len()
            )));
        }
        let mut it = fds.drain(..);
        let ring = SharedMem::map(it.next().expect("counted"))?;
        if Ring::check(&ring).is_none() {
            return Err(Error::Connect("peer ring is malformed".into()));
        }
        let rx = if m.flags & 1 != 0 {
            it.next().map(EventFd::from_owned)
        } else {
            None
        };
        let tx = if m.flags & 2 != 0 {
            it.next().map(EventFd::from_owned)
        } else {
            None
        };
        Ok(Link {
            peer_qpn: m.src_qpn,
            peer_gid: gid,
            peer_sock,
            peer_pd: m.pd,
            peer_ring: Arc::new(ring),
            peer_rx_efd: rx,
            peer_tx_efd: tx,
            sock,
        })
    }

    fn start_heartbeat(&self, own: &Arc<SharedMem>, l: &Link) {
        *lock(&self.hb) = Some(Heartbeat {
            own_ring: own.clone(),
            peer_ring: l.peer_ring.clone(),
            last_hb: 0,
            last_hb_change: Instant::now(),
        });
    }

    /// Passive side of the rendezvous (device thread).
    fn accept_hello(&self, m: &Msg, fds: Vec<OwnedFd>) -> Result<Vec<OwnedFd>> {
        let mut c = lock(&self.core);
        if matches!(c.state, QpState::Reset | QpState::Err) {
            return Err(Error::InvalidState {
                op: "accept connection",
                state: c.state,
            });
        }
        if let Some(r) = c.remote {
            if r.qp_num != m.src_qpn || r.gid != m.gid {
                return Err(Error::Connect("connection from an unexpected peer".into()));
            }
        }
        match &c.link {
            Some(l) if l.peer_qpn != m.src_qpn || l.peer_gid != m.gid => {
                return Err(Error::Connect("QP already connected elsewhere".into()))
            }
            Some(_) => {}
            None => {
                let peer_sock = self.dev.reg.resolve(&m.gid, m.src_qpn).ok();
                let l = self.make_link(m, m.gid, fds, None, peer_sock)?;
                self.start_heartbeat(&c.ring, &l);
                c.link = Some(l);
            }
        }
        Ok(self.hello_fds(&c.ring)?)
    }

    /// Active side of the rendezvous (INIT → RTR).
    fn connect(&self, remote: RemoteQp, sgid: Gid) -> Result<()> {
        let ring = {
            let c = lock(&self.core);
            if let Some(l) = &c.link {
                if l.peer_qpn == remote.qp_num && l.peer_gid == remote.gid {
                    return Ok(()); // the peer connected to us first
                }
                return Err(Error::Connect("QP already connected elsewhere".into()));
            }
            c.ring.clone()
        };
        let (s, path) = self
            .dev
            .reg
            .connect(&remote.gid, remote.qp_num)
            .map_err(Error::Connect)?;
        s.set_read_timeout(Duration::from_secs(2))?;
        let fds = self.hello_fds(&ring)?;
        let bf: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        let hello = Msg {
            kind: K_HELLO,
            src_qpn: self.qpn,
            dst_qpn: remote.qp_num,
            gid: sgid,
            pd: self.pd,
            flags: self.efd_flags(),
            rkey: 0,
        };
        s.send(&hello.encode(), &bf)?;
        let (m, rfds) = recv_msg(&s).map_err(|e| {
            Error::Connect(format!("no answer from peer QP {}: {e}", remote.qp_num))
        })?;
        if m.kind != K_HELLO_ACK {
            return Err(Error::Connect(format!(
                "peer QP {} refused the connection",
                remote.qp_num
            )));
        }
        let mut c = lock(&self.core);
        match &mut c.link {
            Some(l) if l.peer_qpn == remote.qp_num && l.peer_gid == remote.gid => {
                if l.sock.is_none() {
                    l.sock = Some(s);
                } else {
                    c.extra_socks.push(s);
                }
            }
            Some(_) => return Err(Error::Connect("QP already connected elsewhere".into())),
            None => {
                let l = self.make_link(&m, remote.gid, rfds, Some(s), Some(path))?;
                self.start_heartbeat(&c.ring, &l);
                c.link = Some(l);
            }
        }
        drop(c);
        self.dev.wake.signal();
        Ok(())
    }

    /// Moves to ERR: the first outstanding WR gets `first` (if any), all
    /// others flush. Marks both rings closed so the peer notices.
    fn fail(&self, first: Option<WcStatus>, event: bool) {
        let mut c = lock(&self.core);
        self.fail_locked(&mut c, first, event);
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
        self.progress_recv(c);
        if matches!(c.state, QpState::Err | QpState::Reset) {
            return; // a bad message among them failed the QP already
        }
        c.state = QpState::Err;
        self.live.store(false, SeqCst);
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
        if event {
            self.dev.raise(AsyncEvent::QpFatal { qp_num: self.qpn });
        }
    }

    /// The progress that can complete into `cq`: receives for the QP's
    /// receive CQ, sends for its send CQ (both when they are one). Polling
    /// one CQ of a QP need not also do the other direction's work, which its
    /// own poll does (a pump polls both).
    fn progress_for(&self, cq: &Arc<CqInner>) {
        let mut c = lock(&self.core);
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return;
        }
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
                    dst.copy_from(pos, &mr.mem, HDR + off, s.length as usize)
                        .map_err(|_| WcStatus::LocalQpOperationError)?;
                    pos += s.length as usize;
                }
                Ok(())
            }
        }
    }

    /// Checks the peer region for a WRITE and returns (mapping, byte offset).
    fn check_remote(
        &self,
        l: &Link,
        rkey: u32,
        addr: u64,
        len: usize,
    ) -> std::result::Result<(Arc<SharedMem>, usize), WcStatus> {
        let pr = Ring(&l.peer_ring);
        if !Access::from_bits(pr.h(R_ACCESS).load(Acquire) as u32).contains(Access::REMOTE_WRITE) {
            return Err(WcStatus::RemoteAccessError);
        }
        let m = self.dev.remote_mr(l, rkey)?;
        let v = MrView(&m);
        let ok_hdr = v.h(MR_VALID).load(Acquire) == 1
            && v.h(MR_PD).load(Acquire) == l.peer_pd as u64
            && Access::from_bits(v.h(MR_ACCESS).load(Acquire) as u32)
                .contains(Access::REMOTE_WRITE);
        let mlen = (v.h(MR_LEN).load(Acquire) as usize).min(m.len() - HDR);
        let off = addr.checked_sub(v.h(MR_IOVA).load(Acquire));
        match off {
            Some(off) if ok_hdr && check_range(off as usize, len, mlen).is_ok() => {
                Ok((m, HDR + off as usize))
            }
            _ => Err(WcStatus::RemoteAccessError),
        }
    }

    fn progress_send(&self, c: &mut Core) {
        if let Some(l) = c.link.as_ref() {
            // before the slot states: a consume after this load shows later
            c.seen_peer_head = Ring(&l.peer_ring).h(R_HEAD).load(Acquire);
        }
        let Some(l) = c.link.as_ref() else { return };
        if c.sq.is_empty() {
            return;
        }
        let pr = Ring(&l.peer_ring);
        // The clock is read only while some SEND waits for a receive (RNR).
        let mut now_cache = None;
        let mut now = || *now_cache.get_or_insert_with(Instant::now);
        let rnr_budget = || {
            Duration::from_nanos(pr.h(R_RNR_TIMER).load(Relaxed)).max(Duration::from_micros(10))
                * (c.rnr_retry as u32 + 1)
        };
        let credits = pr.h(R_RECV_CREDITS).load(Acquire);
        // 1. ACKs of published slots, RNR timers.
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
                    if c.rnr_retry != 7
                        && now().duration_since(since) > rnr_budget()
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
        // 2. Execute queued WRs in order (they are the tail of the queue).
        let queued = matches!(c.sq.back().map(|p| p.stage), Some(Stage::Queued));
        let mut tail = pr.h(R_TAIL).load(Relaxed);
        let head = pr.h(R_HEAD).load(Acquire);
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
            if needs_slot && tail.wrapping_sub(head) >= NSLOTS {
                break; // ring full: stays queued
            }
            let result: std::result::Result<Option<(u64, u64)>, WcStatus> = (|| {
                match p.op {
                    SendOp::RdmaWrite { remote_addr, rkey }
                    | SendOp::RdmaWriteWithImm {
                        remote_addr, rkey, ..
                    } => {
                        let (m, off) = self.check_remote(l, rkey, remote_addr, p.len as usize)?;
                        self.gather(&p.payload, &m, off)?;
                    }
                    _ => {
                        self.gather(&p.payload, &l.peer_ring, Ring::slot(tail) + SLOT_HDR)?;
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
            let p = &mut c.sq[i];
            match result {
                Err(s) => {
                    p.stage = Stage::Done(s);
                    break;
                }
                Ok(None) => p.stage = Stage::Done(WcStatus::Success),
                Ok(Some((op, imm))) => {
                    let psn = (c.sq_psn as u64).wrapping_add(tail) & 0xff_ffff;
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
        if published && pr.h(R_RX_NOTIFY).swap(0, SeqCst) == 1 {
            if let Some(e) = &l.peer_rx_efd {
                e.signal();
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

    fn progress_recv(&self, c: &mut Core) {
        {
            // nothing published at the head (the usual case): no more work
            let r = Ring(&c.ring);
            let head = r.h(R_HEAD).load(Relaxed);
            if r.s(head, S_STATE).load(SeqCst) >> 3 != head {
                return;
            }
        }
        let ring = c.ring.clone();
        let r = Ring(&ring);
        let mut consumed = false;
        loop {
            let head = r.h(R_HEAD).load(Relaxed);
            let w = r.s(head, S_STATE).load(SeqCst);
            if w >> 3 != head {
                break;
            }
            match w & 7 {
                ST_CANCELLED => {
                    r.h(R_HEAD).store(head.wrapping_add(1), Release);
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
                                            .copy_from(HDR + off as usize, &ring, src, n)
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
            if r.s(head, S_STATE)
                .compare_exchange(head << 3 | ST_PUBLISHED, head << 3 | next, SeqCst, SeqCst)
                .is_err()
            {
                // The sender withdrew it (RNR retries exhausted): skip, keep the receive.
                r.h(R_HEAD).store(head.wrapping_add(1), Release);
                continue;
            }
            r.h(R_HEAD).store(head.wrapping_add(1), Release);
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
        if consumed && r.h(R_TX_NOTIFY).swap(0, SeqCst) == 1 {
            if let Some(e) = c.link.as_ref().and_then(|l| l.peer_tx_efd.as_ref()) {
                e.signal();
            }
        }
    }
}

/// An RC queue pair of an `shm` device; destroyed on drop.
pub struct ShmQp {
    inner: Arc<QpInner>,
}

impl QueuePair for ShmQp {
    fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        let q = &self.inner;
        let c = lock(&q.core);
        if c.state != QpState::Rts {
            return None;
        }
        let (m, off) = q.check_remote(c.link.as_ref()?, rkey, addr, len).ok()?;
        Some(MemWindow::new(Arc::new(RemoteMem(m)), off, len))
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
                Ring(&c.ring).h(R_PD).store(q.pd as u64, Release);
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
                    c.remote = Some(remote);
                    c.rq_psn = rq_psn & 0xff_ffff;
                    c.min_rnr_timer = min_rnr_timer;
                    Ring(&c.ring)
                        .h(R_RNR_TIMER)
                        .store(min_rnr_timer.as_nanos() as u64, Release);
                }
                q.connect(remote, sgid)?;
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
                let mut c = lock(&q.core);
                c.sq_psn = sq_psn & 0xff_ffff;
                c.timeout = timeout;
                c.retry_cnt = retry_cnt;
                c.rnr_retry = rnr_retry;
            }
            QpModify::Err => {
                q.fail(None, false);
                return Ok(());
            }
            QpModify::Reset => {
                let mut c = lock(&q.core);
                // RESET discards outstanding WRs without completions (as verbs
                // does) but still tells the peer that this end is gone.
                c.sq.clear();
                c.rq.clear();
                q.fail_locked(&mut c, None, false);
                *c = Core::new(new_ring(q.qpn)?);
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
        Ok(())
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let q = &self.inner;
        let mut c = lock(&q.core);
        if c.state != QpState::Rts {
            return Err(Error::InvalidState {
                op: "post_send",
                state: c.state,
            });
        }
        validate_send(wr, &q.cap, SLOT_PAYLOAD as u32)?;
        if c.sq.len() >= q.cap.max_send_wr as usize {
            q.progress_locked(&mut c);
            if c.sq.len() >= q.cap.max_send_wr as usize {
                return Err(Error::QueueFull);
            }
        }
        if let (SendOp::RdmaWrite { remote_addr, rkey }, Payload::Inline(d)) = (wr.op, wr.payload) {
            if q.executes_at_post(&c, wr.signaled) {
                if let Some(l) = c.link.as_ref() {
                    if let Ok((m, off)) = q.check_remote(l, rkey, remote_addr, d.len()) {
                        if m.write(off, d).is_ok() {
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
        self.inner.fail(None, false);
        let mut c = lock(&self.inner.core);
        c.link = None;
        c.extra_socks.clear();
        drop(c);
        lock(&self.inner.dev.qps).remove(&self.inner.qpn);
        self.inner
            .dev
            .reg
            .release_qpn(self.inner.qpn, &self.inner.dev.sock_path);
        self.inner.dev.wake.signal();
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
    fn msg_roundtrip() {
        let m = Msg {
            kind: K_HELLO,
            src_qpn: 5,
            dst_qpn: 9,
            gid: Gid([7; 16]),
            pd: 3,
            rkey: 11,
            flags: 2,
        };
        let d = Msg::decode(&m.encode()).unwrap();
        assert_eq!(
            (d.kind, d.src_qpn, d.dst_qpn, d.gid, d.pd, d.rkey, d.flags),
            (1, 5, 9, Gid([7; 16]), 3, 11, 2)
        );
        assert!(Msg::decode(&[0u8; MSG_LEN]).is_none());
        assert!(Msg::decode(&[0u8; 3]).is_none());
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
