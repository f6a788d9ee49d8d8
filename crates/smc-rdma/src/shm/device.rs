//! The provider and its devices: [`ShmProvider`] enumerates and opens the
//! configured devices; an opened [`ShmDevice`] (one *instance*) listens on
//! its own socket in the rundir, registers its GIDs and QPs in the
//! [`registry`], keeps its local regions by lkey and rkey
//! and its QPs by number, and queues the asynchronous events (port state,
//! fatal QPs) its device thread raises.

use super::arena::Arena;
use super::config::{ShmConfig, ShmDeviceConfig};
use super::cq::{CqInner, ShmChannel, ShmCq};
use super::device_thread::device_thread;
use super::mr::{ShmMr, ShmPd};
use super::netdev::{gid_table, netdev_up};
use super::qp::{QpInner, ShmQp};
use super::{lock, random_u64, KeyMap, MAX_INLINE};

use super::registry::Registry;

use super::layout::*;
use crate::sys::{self, EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::{arena, registry};

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

/// SENDs a link may keep in flight: every peer of this device is this
/// implementation, which posts a receive for each of them and a few more
/// (the engine's `RECV_SPARE`), and the ring holds [`NSLOTS`]. More than
/// the engine's default for RNIC peers, because one link carries many
/// connections and an event loop on one CPU writes to all of them before
/// its peer runs: a write that finds no SEND left goes through the send
/// buffer, for a progress thread to flush.
const MAX_SENDS: u32 = NSLOTS as u32 - 8;

fn info_for(name: &str, netdev: &str) -> DeviceInfo {
    DeviceInfo {
        name: name.into(),
        ports: vec![port_attr(netdev)],
        max_msg_size: SLOT_PAYLOAD as u32,
        max_inline: MAX_INLINE,
        max_sends: Some(MAX_SENDS),
    }
}

pub(super) fn port_attr(netdev: &str) -> PortAttr {
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
pub(super) struct LocalMr {
    pub(super) lkey: u32,
    pub(super) rkey: u32,
    pub(super) pd: u32,
    pub(super) mem: Arc<SharedMem>,
    pub(super) base: usize,
    pub(super) len: usize,
    pub(super) iova: u64,
    pub(super) access: Access,
    /// The arena range, given back (and its pages freed) when the last
    /// user of the region (a window lent, a WR being executed) is gone.
    pub(super) _slice: Option<arena::Slice>,
    /// Which registration of its memory this is (`layout::mr_reg_words`):
    /// 0 for the one that allocated it, further ones by `share_mr`.
    pub(super) slot: usize,
    /// The registration slots of this memory in use (a bit each), shared by
    /// all its registrations.
    pub(super) regs: Arc<Mutex<u32>>,
    /// A further registration keeps the memory of the first one (its arena
    /// range) alive.
    pub(super) _first: Option<Arc<LocalMr>>,
    /// The doorbell's state in this process, shared by the memory's
    /// registrations as the word is (one allocation per memory).
    pub(super) bell: Arc<BellLocal>,
}

/// A region's doorbell as its owner's process keeps it (`LocalMr::bell`);
/// kept here, never read back from the shared word, which the peer can
/// write.
#[derive(Default)]
pub(super) struct BellLocal {
    /// The eventfd a peer's SEND writes when it finds the doorbell armed for
    /// a poller (`layout::BELL_POLLED`): made when the owner first asks for
    /// it (`Bell::poll_fd`) and handed to peers that fetch the region after
    /// that. `None` inside: it could not be made (no descriptor left); SENDs
    /// then signal the owner's channel as for a region that nobody polls.
    /// Regions nobody polls cost no descriptor.
    pub(super) efd: std::sync::OnceLock<Option<EventFd>>,
    /// Threads of this process in the doorbell's wait (`Bell::wait`): the
    /// last one to leave a word still marked asleep takes the mark back
    /// (`ShmBell::wait`).
    pub(super) sleepers: std::sync::atomic::AtomicUsize,
    /// Whether the doorbell's pollers all wait level-triggered
    /// (`Bell::set_poll_level`).
    pub(super) level: std::sync::atomic::AtomicBool,
}

impl LocalMr {
    /// Byte `off` of the region, in `mem`.
    pub(super) fn at(&self, off: usize) -> usize {
        self.base + HDR + off
    }
}

pub(super) struct DevShared {
    pub(super) name: String,
    pub(super) netdev: String,
    pub(super) reg: Registry,
    tag: String,
    pub(super) sock_path: PathBuf,
    links: Mutex<Vec<PathBuf>>,
    pub(super) peer_timeout: Duration,
    pub(super) poll_interval: Duration,
    /// A QP that has not met its verified peer this long after its RTR fails.
    pub(super) rendezvous_timeout: Duration,
    pub(super) port_up: AtomicBool,
    /// The ioctl socket the port state is read through: a tick needs no new
    /// descriptor (out of descriptors, a fresh socket per look failed, the
    /// port read as down and every QP of the device failed with it).
    pub(super) probe: sys::LinkProbe,
    events: Mutex<VecDeque<AsyncEvent>>,
    event_fd: EventFd,
    pub(super) lkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    pub(super) rkeys: Mutex<KeyMap<u32, Arc<LocalMr>>>,
    pub(super) qps: Mutex<KeyMap<u32, Weak<QpInner>>>,
    pub(super) stop: AtomicBool,
    pub(super) frozen: AtomicBool,
    /// Test hook: the device thread spins without ticking (a thread that
    /// waits for a CPU on a loaded machine: runnable, no heartbeats).
    pub(super) starving: AtomicBool,
    /// The device thread's id (`gettid`), once it runs; written into each
    /// peer's ring with the heartbeat.
    pub(super) thread_id: std::sync::atomic::AtomicU32,
    /// This process's pid namespace (`sys::pid_namespace`).
    pub(super) pidns: u64,
    /// Test hook: the port is down whatever the interface says.
    pub(super) forced_down: AtomicBool,
    pub(super) wake: EventFd,
    /// One descriptor kept in reserve, given up for the moment a descriptor
    /// is needed and none is free ([`DevShared::with_reserve`]).
    reserve: Mutex<Option<EventFd>>,
}

impl DevShared {
    pub(super) fn raise(&self, ev: AsyncEvent) {
        lock(&self.events).push_back(ev);
        self.event_fd.signal();
    }
    pub(super) fn qp_list(&self) -> Vec<Arc<QpInner>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }
    /// Registers this instance under every current GID of the netdev (also
    /// GIDs that appeared since the last call).
    pub(super) fn publish_gids(&self) {
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
    pub(super) fn local_mr(&self, lkey: u32) -> Option<Arc<LocalMr>> {
        lock(&self.lkeys).get(&lkey).cloned()
    }

    /// Runs `f` with the reserve descriptor closed, so that the lowest free
    /// descriptor number is there for what `f` needs for a moment (a
    /// connection to accept and close, a peer's memfd to map and close),
    /// and makes the reserve again after (in the number `f` gave back).
    /// `None`, and `f` not run, if there is no reserve or another caller is
    /// using it: the caller fails as it would have without one (the device
    /// thread must not wait here for a fetch that waits for it).
    pub(super) fn with_reserve<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let mut r = self.reserve.try_lock().ok()?;
        r.take()?;
        let out = f();
        *r = EventFd::new().ok();
        Some(out)
    }

    /// Makes the reserve descriptor again if it could not be made after its
    /// last use (descriptors have come free since, perhaps).
    pub(super) fn keep_reserve(&self) {
        if let Ok(mut r) = self.reserve.try_lock() {
            if r.is_none() {
                *r = EventFd::new().ok();
            }
        }
    }
}

/// An opened `shm` device. A device may be opened any number of times, in
/// one process or in many: each opening is an instance with its own QPs,
/// regions and rendezvous socket, sharing the GIDs of the interface.
pub struct ShmDevice {
    pub(super) sh: Arc<DevShared>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
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
            starving: AtomicBool::new(false),
            thread_id: AtomicU32::new(0),
            pidns: sys::pid_namespace(),
            forced_down: AtomicBool::new(false),
            wake: EventFd::new()?,
            reserve: Mutex::new(Some(EventFd::new()?)),
        });
        sh.publish_gids();
        // (in the caller's network namespace, as the probe; without it the
        // device thread looks at the port every tick instead)
        let watch = sys::LinkWatch::new().ok();
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("shm-{}", d.name))
            .spawn(move || device_thread(s2, listener, watch));
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

    /// Test hook: behave as if the device thread waited for a CPU (`true`:
    /// it spins, runnable, with no heartbeats and no answers) or got one again
    /// (`false`).
    pub fn starve(&self, on: bool) {
        self.sh.starving.store(on, SeqCst);
        self.sh.wake.signal();
    }

    /// Test hook: behave as if the bound interface went down (`true`) or
    /// follow it again (`false`), for this instance only — for interfaces a
    /// test must not really take down, such as `lo`. Takes effect when the
    /// device thread wakes for it, with the same events and QP errors as a
    /// real change of the interface.
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
                queued: AtomicUsize::new(0),
                armed: AtomicBool::new(false),
                chan: channel.map(|c| c.inner.clone()),
                qps: Mutex::new(vec![]),
                claims: Mutex::new(vec![]),
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
