//! The process-wide SMC state: the provider (shm and libibverbs devices,
//! [`crate::provider`]), one endpoint per device, and device selection for a
//! connection (`tools.md` §6): the interface of the connection's local
//! address, through the PNET table or the port's own interface (or its
//! RoCE v2 GID) to a device port, as Linux chooses (smc_pnet.c
//! `smc_pnet_find_roce_resource`), except that a shared-memory device serves
//! only peers on this host (see [`pick`] and [`shm_reaches`]).

use crate::provider::{AnyProvider, Kind};
use rustix::event::{epoll, PollFd, PollFlags, Timespec};
use smc_config::pnet::{base_netdev, candidates, PnetTable, PortInfo, Route};
use smc_config::store::{ConfigDir, Table};
use smc_config::ueid::UeidTable;
use smc_engine::endpoint::{ConnId, ConnLevel, Endpoint, EndpointConfig, FastConn, RmbCrowding};
use smc_proto::close::CloseState;
use smc_proto::negotiate::IfAddr;
use smc_proto::Timestamp;
use smc_rdma::{GidType, PortState};
use smc_wire::types::{Mac, SystemId};
use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// What this process's SMC endpoints hold right now (the library's state API;
/// `smcss` / `smcr linkgroup` will be built on it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// The device.
    pub device: String,
    /// Live link groups (each a QP to one peer, in one role).
    pub link_groups: usize,
    /// Live SMC connections (handshaking, established or closing).
    pub connections: usize,
    /// The usable links of each live link group (2 where a group added a
    /// second link by ADD_LINK, see [`redundancy`]).
    pub links: Vec<usize>,
    /// Of those, the links on the endpoint's second device, per group (1
    /// in a two-link group over both devices; 0 where both links share the
    /// first, an asymmetric group).
    pub second_device_links: Vec<usize>,
}

/// One entry per device this process has used for SMC.
pub fn state() -> Vec<DeviceState> {
    let Some(ctx) = context() else {
        return Vec::new();
    };
    let eps = ctx.endpoints.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<DeviceState> = eps
        .iter()
        .map(|(name, s)| {
            let ep = s.lock();
            let n = ep.link_groups();
            let mut links = Vec::new();
            let mut second_device_links = Vec::new();
            for l in ep.link_group_ids() {
                let usable = ep.usable_links(l);
                links.push(usable.len());
                second_device_links.push(
                    usable
                        .iter()
                        .filter(|&&s| ep.link_on_second_device(l, s) == Some(true))
                        .count(),
                );
            }
            DeviceState {
                device: name.clone(),
                link_groups: n,
                connections: ep.connections(),
                links,
                second_device_links,
            }
        })
        .collect();
    v.sort_by(|a, b| a.device.cmp(&b.device));
    v
}

/// An endpoint on one device, shared by every connection through it, and the
/// means to wait for it to make progress.
///
/// Waiting (DEVELOPERS.md: "a short bounded spin, then sleep on a kernel
/// object"): a thread that cannot go on pumps the endpoint in a loop for
/// [`spin_time`]; then it sleeps. Of the sleeping threads exactly one, the
/// *leader*, arms the completion queues and sleeps in `poll()` on the
/// endpoint's completion channel; the others wait on a condition variable that
/// is signalled whenever anyone's pump takes a work completion, or when the
/// leader wakes up. While some thread spins nobody is armed, so the peer posts
/// without a system call and nothing here makes one.
pub(crate) struct Shared {
    ep: Mutex<Endpoint<AnyProvider>>,
    /// The endpoint's completion-channel descriptor (a dup, to poll without the lock).
    notify: OwnedFd,
    /// The endpoint's completion count when last looked at.
    gen: AtomicU64,
    /// Threads parked until their connection can go on (see [`Waiter`]).
    waiters: Mutex<Vec<Waiter>>,
    /// The connections that threads sleeping in [`Shared::run`] wait for,
    /// once per thread (see [`Shared::bell_register`]); changed with
    /// `waiters` locked.
    run_conns: Mutex<Vec<ConnId>>,
    /// Threads in a reader's doorbell wait, spinning or asleep (see
    /// `SmcStream`'s read): counted with [`Shared::active`] for the spin
    /// rule.
    pub(crate) bell_waiting: AtomicUsize,
    /// Parked threads to unpark once the endpoint lock is released (see
    /// [`Locked`]), and their count, readable without the lock.
    to_unpark: Mutex<Vec<std::thread::Thread>>,
    unparks: AtomicUsize,
    /// `waiters.len()`, readable without the lock.
    sleepers: AtomicUsize,
    /// How many of them are parked threads, not readers on their doorbell:
    /// only those wait for a pump to learn of a CDC (a reader's doorbell is
    /// rung by the peer's SEND itself).
    parked: AtomicUsize,
    /// Application threads inside [`Shared::run`] (the progress thread leads
    /// the sleepers only while there are none, see [`progress_loop`]).
    active: AtomicUsize,
    /// Application threads in a read or write of a stream, including its
    /// copy outside the lock (see [`Shared::busy`]).
    busy: AtomicUsize,
    /// Whether a leader is polling `notify`.
    leader: Mutex<bool>,
    spin: Spin,
    /// The TCP sockets of this endpoint's SMC-R connections, watched for
    /// their end (see [`Shared::watch_tcp`]); polled by whoever sleeps on
    /// `notify` and by the progress thread.
    watch: OwnedFd,
    /// Sockets given to [`Shared::watch_tcp`] and not yet in `watch`, oldest
    /// first (see [`Shared::register_watches`]).
    unwatched: Mutex<std::collections::VecDeque<Unwatched>>,
    /// When connections whose TCP connection ended are reset, if their peer
    /// sent no close by then: every waiting thread and task looks again.
    recheck_at: Mutex<std::collections::VecDeque<Instant>>,
    /// Tasks of the tokio adapter waiting for their connection (or, a
    /// handshake's step over the device, for any progress): a pump that takes
    /// completions wakes those whose connection can go on, as [`Self::wake`]
    /// chooses the parked threads, and every one after a timer or an engine
    /// event. (The task that watches the completion channel in the reactor,
    /// [`Self::task_watcher`], loses its edge when a sleeping thread drains
    /// the channel first; that thread pumps next, and its pump wakes the
    /// tasks the completion concerns.)
    #[cfg(feature = "tokio")]
    tasks: Mutex<Vec<TaskWait>>,
    /// Which waiting stream of the tokio adapter watches the completion
    /// channel in its runtime's reactor (0: none; see `crate::tokio`): one,
    /// so that a signal wakes one task, not every waiting one.
    #[cfg(feature = "tokio")]
    task_watcher: AtomicU64,
    /// The readiness descriptors of this endpoint's connections (see
    /// [`crate::readiness`]), set after every pump that took completions,
    /// and their count, readable without the lock (none: no cost).
    readiness: Mutex<Vec<std::sync::Weak<ConnReadiness>>>,
    readied: AtomicUsize,
    /// The engine's count of fired timers when last looked at: a timer
    /// (a handshake or close deadline, a peer taken for gone) changes a
    /// connection without a completion, so every waiter looks again.
    timers_seen: AtomicU64,
    /// Wakes the leader from its `poll()` (a timerfd) when the engine's
    /// next deadline moved before the one it sleeps until, then (see
    /// [`Locked`]): the call that moved it sets the timer, and the leader
    /// sleeps on without a wake-up now. A new handshake's deadline (6 s) is
    /// such a move for a leader without one; waking the leader for it cost
    /// two context switches per connection.
    kick: OwnedFd,
    /// Taken by whoever sets [`Self::kick`]: the timer and
    /// [`Self::leader_until`] move together, so that a later deadline set
    /// after an earlier one cannot win.
    kick_lock: Mutex<()>,
    /// The engine time the leader sleeps until, in nanoseconds, its
    /// `poll()` timeout or [`Self::kick`] ([`NOBODY_SLEEPS`]: no leader
    /// sleeps, or it was woken already).
    leader_until: AtomicU64,
    /// Descriptors (eventfds) of threads that wait outside [`Shared::run`],
    /// on a socket too (blocking handshakes, [`Shared::progress_fd`]): rung
    /// by every pump that took completions or fired timers; and their
    /// count, readable without the lock.
    fd_waiters: Mutex<Vec<Arc<Waker>>>,
    fd_waiting: AtomicUsize,
    /// The progress thread sleeps as the leader with receive CQs that
    /// connections poll themselves left unarmed (`Endpoint::arm_unpolled`),
    /// until its own deadline: whoever starts to wait for a pump meanwhile
    /// (a follower, a readiness descriptor, a descriptor waiter) kicks it
    /// ([`Self::kick_lazy`]), and it arms everything at its next sleep.
    lazy: AtomicBool,
    /// How long the progress thread's next such sleep lasts at most, in
    /// microseconds (doubled by each one up to [`LAZY_MAX`], reset to
    /// [`LAZY_MIN`] by a full arm).
    lazy_for: AtomicU64,
    /// This endpoint, for the threads that connect the QPs of added links
    /// (see [`Shared::start_bringups`]); set once it is shared.
    me: OnceLock<std::sync::Weak<Shared>>,
}

/// [`Shared::leader_until`] when there is nothing to kick.
const NOBODY_SLEEPS: u64 = u64::MAX;

/// The shortest and longest sleep of the progress thread with receive CQs
/// left unarmed for threads that poll them ([`Shared::lazy`]), in
/// microseconds: what a CDC that no poller takes and nobody waits for (an
/// LLC request, a connection whose reader is elsewhere) may wait for the
/// progress thread, against the progress-thread wake-ups it saves (one per
/// arm otherwise, each for a CDC the poller takes first).
const LAZY_MIN: u64 = 1_000;
const LAZY_MAX: u64 = 16_000;

/// Where the engine's next deadline is, as an instant (`None`: it waits for
/// nothing but events).
pub(crate) fn engine_deadline(ep: &Endpoint<AnyProvider>) -> Option<Instant> {
    ep.poll_timeout().map(|t| origin() + t)
}

/// A time in the engine's clock as [`Shared::leader_until`] holds it.
fn nanos(t: Timestamp) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(NOBODY_SLEEPS - 1)
}

/// `poll()`'s timeout until `until` (`None`: none).
pub(crate) fn timespec_until(until: Option<Instant>) -> Option<Timespec> {
    until.map(|u| {
        let d = u.saturating_duration_since(Instant::now());
        Timespec {
            tv_sec: d.as_secs() as i64,
            tv_nsec: i64::from(d.subsec_nanos()),
        }
    })
}

/// A sleep that ends within this anyway does not watch the TCP ends of
/// the established connections: it looks at them when it ends. Every
/// connection's orderly close ends its TCP connection too (right after
/// its close CDC, which is what counts), and a watching sleeper would be
/// woken by each one for nothing; a dead peer, whose TCP end is what the
/// watch is for, is taken for dead only `PEER_GONE_GRACE` after it anyway.
const WATCH_SLACK: Duration = Duration::from_millis(20);

/// Whether a sleep until `until` watches the TCP ends (see [`WATCH_SLACK`]).
fn watches_tcp_ends(until: Option<Instant>) -> bool {
    until.is_none_or(|u| u.saturating_duration_since(Instant::now()) > WATCH_SLACK)
}

/// A TCP socket to watch for its end, not yet in the epoll set: weakly held,
/// so that a socket the watch is the last to know of is closed (a forked
/// child's copy of the list keeps no parent connection's TCP end open).
struct Unwatched {
    tcp: std::sync::Weak<std::net::TcpStream>,
    id: ConnId,
    since: Instant,
}

/// Whether `fd` polls readable now.
fn fd_ready(fd: &OwnedFd) -> bool {
    let mut pfd = [PollFd::new(fd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut pfd, Some(&zero)), Ok(n) if n > 0)
}

/// An eventfd's count taken (it polls readable no more).
fn drain_eventfd(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// An eventfd rung.
fn ring_eventfd(fd: &OwnedFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Sets timerfd `fd` to expire `after` from now (at once: zero disarms a
/// timerfd, so at least a nanosecond).
fn set_timer(fd: &OwnedFd, after: Duration) {
    use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
    let after = after.max(Duration::from_nanos(1));
    let spec = Itimerspec {
        it_interval: Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: Timespec {
            tv_sec: after.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: after.subsec_nanos().into(),
        },
    };
    let _ = timerfd_settime(fd, TimerfdTimerFlags::empty(), &spec);
}

fn new_timerfd() -> io::Result<OwnedFd> {
    use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
    Ok(timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
    )?)
}

fn new_eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?)
}

/// The eventfd of a [`ProgressFd`], and whether it was rung since its
/// owner last cleared it: a pump rings it once per wake-up, not once per
/// message while its owner is busy elsewhere.
pub(crate) struct Waker {
    fd: OwnedFd,
    rung: AtomicBool,
}

impl Waker {
    fn ring(&self) {
        if !self.rung.swap(true, Ordering::AcqRel) {
            ring_eventfd(&self.fd);
        }
    }
}

/// A thread's registration to be woken by the endpoint's progress (see
/// [`Shared::progress_fd`]); unregistered when dropped.
pub(crate) struct ProgressFd {
    shared: Arc<Shared>,
    fd: Arc<Waker>,
}

impl ProgressFd {
    /// Readable once a pump took completions or fired timers since the last
    /// [`Self::clear`].
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.fd.as_fd()
    }

    /// Takes the wake-up; the caller looks at the endpoint after this (a
    /// pump from now on rings again).
    pub(crate) fn clear(&self) {
        drain_eventfd(&self.fd.fd);
        self.fd.rung.store(false, Ordering::Release);
    }
}

impl Drop for ProgressFd {
    fn drop(&mut self) {
        let mut v = self
            .shared
            .fd_waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        v.retain(|x| !Arc::ptr_eq(x, &self.fd));
        self.shared.fd_waiting.store(v.len(), Ordering::Release);
    }
}

/// What a connection shows its waiters (its readiness descriptor, an
/// async stream's tasks: `readiness::Shown`), set under the connection's
/// own lock (`FastConn::watch`) by whichever thread changes it: a read or
/// write of the fast path or of the endpoint, a CDC applied by the
/// endpoint's pump or by another reader's dispatch, a send completion.
pub(crate) struct ConnReadiness {
    /// The connection (`None`: gone from the endpoint when this was made;
    /// it shows the end).
    fast: Option<FastConn<AnyProvider>>,
    pub(crate) shown: Arc<crate::readiness::Shown>,
    /// The peer's direct signal, where the device has one (see
    /// [`PeerSignal`]).
    pub(crate) signal: Option<Arc<PeerSignal>>,
}

impl Drop for ConnReadiness {
    fn drop(&mut self) {
        // (the core outlives the handle until the endpoint frees it)
        if let Some(f) = &self.fast {
            f.watch(None);
        }
        if let Some(s) = &self.signal {
            if s.pollers.load(Ordering::Acquire) > 0 {
                s.bell.disarm_polled();
            }
            // (the region's next connection starts with pollers of its own)
            s.bell.set_poll_level(false);
        }
    }
}

/// A descriptor the peer makes readable itself when a CDC for the
/// connection comes while the application's event loop waits
/// (`Bell::arm_polled`), so that the loop is woken by the peer's SEND, not
/// by our progress thread after it pumped (a wake-up and a thread hop per
/// message). An event loop polls it beside the readiness descriptor, as
/// readable only (`SmcStream::signal_fd`); reading the connection takes
/// what the signal announced. It cannot be the readiness descriptor
/// itself: the peer would need that descriptor's control end, with which
/// it could also show a false hang-up or writability; all it can do with
/// this one is make it readable (at worst a wake-up for nothing).
///
/// While it is readable for a CDC that the peer signalled, the readiness
/// descriptor does not show the data that CDC brought (it would be a
/// second system call and wake-up for the same bytes): the application
/// sees the connection readable through this one. It is drained and armed
/// again only where a look for CDCs follows (a read that would block, the
/// event loop's wait: `SmcStream::signalled_events`).
pub(crate) struct PeerSignal {
    pub(crate) bell: smc_rdma::Doorbell,
    /// The bell's descriptor, duplicated for this connection (a region's
    /// bell outlives a connection when its buffer is used again, and an
    /// epoll set keeps a registration while its descriptor is open).
    pub(crate) fd: OwnedFd,
    /// Pollers registered ([`SmcStream::watch_signal`]): the bell is armed
    /// for them while there is one.
    ///
    /// [`SmcStream::watch_signal`]: crate::SmcStream::watch_signal
    pub(crate) pollers: AtomicUsize,
}

impl PeerSignal {
    /// Whether a poller is registered.
    #[inline]
    pub(crate) fn polled(&self) -> bool {
        self.pollers.load(Ordering::Acquire) > 0
    }
}

/// What connection `f`'s readiness descriptor shows for its level now.
pub(crate) fn shown_level(f: &FastConn<AnyProvider>) -> crate::readiness::Level {
    level(&f.level())
}

/// The peer signal of a connection whose device has one (`Bell::poll_fd`).
fn peer_signal(f: &FastConn<AnyProvider>) -> Option<Arc<PeerSignal>> {
    if !bells_on() || !signals_on() {
        return None;
    }
    let bell = f.bell()?;
    let fd = smc_rdma::sys::dup_out_of_the_way(bell.poll_fd()?).ok()?;
    Some(Arc::new(PeerSignal {
        fd,
        bell,
        pollers: AtomicUsize::new(0),
    }))
}

/// Whether event loops are woken by the peer directly where the device can
/// (`PeerSignal`); `SMC_PEER_SIGNAL=0`: through the progress thread, as on
/// devices without the signal (to compare the two).
pub(crate) fn signals_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMC_PEER_SIGNAL").map_or(true, |v| v != "0"))
}

/// A connection that is over, as its readiness descriptor shows it.
pub(crate) const GONE: crate::readiness::Level = crate::readiness::Level {
    readable: true,
    writable: true,
    eof: true,
    hup: true,
};

/// What a connection's readiness descriptor shows: readable and writable as
/// [`Want::Read`] and [`Want::Write`] are ready, end of file once the peer
/// sends nothing more, the end once the connection is over.
fn level(l: &ConnLevel) -> crate::readiness::Level {
    // (also both directions shut, each by one side: EPOLLHUP as a TCP
    // socket whose sk_shutdown is SHUTDOWN_MASK, tcp.c tcp_poll, and as
    // af_smc.c smc_poll)
    let gone = matches!(
        l.close,
        CloseState::Closed
            | CloseState::ProcessAbort
            | CloseState::PeerAbortWait
            | CloseState::AppFinCloseWait
            | CloseState::AppCloseWait2
            | CloseState::PeerCloseWait2
    );
    crate::readiness::Level {
        readable: l.readable > 0,
        writable: l.sndbuf_free > 0 || l.peer_closed,
        eof: l.peer_done,
        hup: gone,
    }
}

/// What a waiting thread waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// Data, end of file or an error on the connection.
    Read(ConnId),
    /// Send-buffer space or an error on the connection.
    Write(ConnId),
    /// A released connection's data and close have left (or it is gone).
    CloseSent(ConnId),
}

/// A parked follower: woken by whoever pumps once its connection can go on,
/// so one connection's traffic does not wake every other waiting thread.
struct Waiter {
    want: Want,
    thread: std::thread::Thread,
    woken: Arc<AtomicBool>,
    /// A reader that sleeps on its connection's doorbell (see
    /// [`Shared::bell_register`]) is woken by ringing it, not by unparking.
    bell: Option<smc_rdma::Doorbell>,
}

/// A task of the tokio adapter waiting (see [`Shared::wake_on_progress`]).
#[cfg(feature = "tokio")]
struct TaskWait {
    /// What for (`None`: any progress of the endpoint).
    want: Option<Want>,
    waker: std::task::Waker,
}

impl Want {
    fn conn(self) -> ConnId {
        match self {
            Want::Read(id) | Want::Write(id) | Want::CloseSent(id) => id,
        }
    }

    fn ready(self, ep: &Endpoint<AnyProvider>) -> bool {
        let (id, more) = match self {
            Want::Read(id) => (id, ep.readable(id) > 0 || ep.peer_done(id)),
            Want::Write(id) => (id, ep.sndbuf_free(id) > 0 || ep.peer_closed(id)),
            Want::CloseSent(id) => (id, ep.close_sent(id)),
        };
        more || matches!(
            ep.close_state(id),
            None | Some(CloseState::Closed)
                | Some(CloseState::ProcessAbort)
                | Some(CloseState::PeerAbortWait)
        )
    }
}

/// Whether spinning pays off here. It does when the peer answers within the
/// spin time, i.e. when both sides have a core; on a machine with more
/// runnable threads than cores, or with both processes on one CPU, a spinning
/// thread takes the CPU the peer needs and every wait ends in a sleep anyway,
/// only later. So after [`SPIN_MISSES_OFF`] waits in a row that had to sleep,
/// waits sleep at once, and now and then one spins again to see whether
/// things have changed: every [`SPIN_PROBE_EVERY`]th wait at first, half as
/// often after each probe that had to sleep too, down to every
/// [`SPIN_PROBE_MAX`]th, since each probe that misses costs a whole spin
/// time of a CPU the peer needed (on one CPU: a ping-pong's 99th
/// percentile). (The handshakes keep
/// one of their own: theirs wait for a peer's whole handshake step, not for
/// one message.)
#[derive(Default)]
pub(crate) struct Spin {
    misses: AtomicU32,
    off: AtomicBool,
    waits: AtomicU32,
    /// Waits between probes while off (0: [`SPIN_PROBE_EVERY`]).
    probe_every: AtomicU32,
}

const SPIN_MISSES_OFF: u32 = 8;
const SPIN_PROBE_EVERY: u32 = 32;
const SPIN_PROBE_MAX: u32 = 4096;

impl Spin {
    /// How long the next wait may spin.
    pub(crate) fn budget(&self) -> Duration {
        if !self.off.load(Ordering::Relaxed) {
            return spin_time();
        }
        if self.waits.fetch_add(1, Ordering::Relaxed) + 1 >= self.probe_every() {
            self.waits.store(0, Ordering::Relaxed);
            return spin_time();
        }
        Duration::ZERO
    }

    /// Waits between probes while spinning is off.
    fn probe_every(&self) -> u32 {
        match self.probe_every.load(Ordering::Relaxed) {
            0 => SPIN_PROBE_EVERY,
            n => n,
        }
    }

    /// A wait ended while spinning.
    pub(crate) fn hit(&self) {
        self.misses.store(0, Ordering::Relaxed);
        self.off.store(false, Ordering::Relaxed);
        self.probe_every.store(0, Ordering::Relaxed);
    }

    /// A wait spun for `budget` and then had to sleep.
    pub(crate) fn miss(&self, budget: Duration) {
        if budget.is_zero() {
            return;
        }
        if self.off.load(Ordering::Relaxed) {
            // a probe that missed: the next one comes later
            let later = (self.probe_every() * 2).min(SPIN_PROBE_MAX);
            self.probe_every.store(later, Ordering::Relaxed);
        } else if self.misses.fetch_add(1, Ordering::Relaxed) + 1 >= SPIN_MISSES_OFF {
            self.off.store(true, Ordering::Relaxed);
        }
    }
}

/// Most threads of a process that spin while waiting: half the CPUs it may
/// use (at least one).
fn max_spinners() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .max(1)
    })
}

/// Whether the calling thread may run on more than one CPU: only then may
/// a wait spin on pause instructions (on a single CPU that holds the core
/// its peer needs; [`SpinTurns`] yields it there instead, and the listener
/// and handshake waits do not spin). Its affinity, looked at again every
/// [`AFFINITY_RECHECK`]: a program (or `taskset -p`) may pin its threads
/// after they first waited.
pub(crate) fn may_spin() -> bool {
    use std::cell::Cell;
    thread_local! {
        static SEEN: Cell<Option<(Instant, bool)>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    SEEN.with(|seen| match seen.get() {
        Some((at, many)) if now.saturating_duration_since(at) < AFFINITY_RECHECK => many,
        _ => {
            let many = rustix::thread::sched_getaffinity(None).map_or(true, |s| s.count() > 1);
            seen.set(Some((now, many)));
            many
        }
    })
}

/// How long a thread's CPU affinity, as [`may_spin`] found it, is taken as
/// still holding.
const AFFINITY_RECHECK: Duration = Duration::from_millis(100);

/// The turns of one waiting thread's spin ([`Self::pause`] between two
/// looks). A thread that may use one CPU gives it up (`sched_yield`)
/// instead of pausing: its peer, when it runs on that CPU too, answers
/// meanwhile, and the answer is found at the next look without a sleep and
/// a wake-up (a doorbell held while spinning is not rung).
///
/// - A yield that came back sooner than a switch to another thread and
///   back takes ([`YIELD_RAN_NOBODY`]) ran nobody: the peer is elsewhere
///   (or not runnable), and the rest of the wait pauses, each look sooner
///   than a system call would allow.
/// - A yield that came back only after [`YIELD_RAN_LONG`] gave the CPU to
///   a thread with work of its own: a busy process beside ours, which keeps
///   the CPU for its time slice (a millisecond or more) while the answer
///   may come from a peer on another CPU at once (or a host that took the
///   CPU away). The thread's waits then pause as they did before yielding
///   (and sleep when that runs out, as before) for [`YIELD_OFF_MIN`]; for
///   twice as long as the last time (up to [`YIELD_OFF_MAX`]) when that
///   came within ten such periods of the last yield that ran long. A busy
///   neighbour then costs a waiting thread one of its slices about once a
///   second; a peer on the same CPU that now and then takes that long to
///   answer (a wait in some thousands) costs the waits of the next
///   millisecond what they cost before yielding.
///
/// With more CPUs the peer runs elsewhere and pausing is the cheaper look
/// from the start.
pub(crate) struct SpinTurns {
    /// Whether the next turn yields (`None`: not known before the first).
    yielding: Option<bool>,
}

impl SpinTurns {
    pub(crate) fn new() -> SpinTurns {
        SpinTurns { yielding: None }
    }

    /// Between two looks of the wait; returns the time after it.
    pub(crate) fn pause(&mut self) -> Instant {
        use std::cell::Cell;
        thread_local! {
            /// The last yield of this thread that ran long, and for how
            /// long it turned yielding off.
            static OFF: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
        }
        let yielding = *self.yielding.get_or_insert_with(|| {
            !may_spin()
                && OFF
                    .with(Cell::get)
                    .is_none_or(|(at, off)| Instant::now() >= at + off)
        });
        if !yielding {
            std::hint::spin_loop();
            return Instant::now();
        }
        let before = Instant::now();
        std::thread::yield_now();
        let after = Instant::now();
        let took = after.saturating_duration_since(before);
        if took < YIELD_RAN_NOBODY {
            self.yielding = Some(false);
        } else if took > YIELD_RAN_LONG {
            OFF.with(|o| {
                let off = match o.get() {
                    Some((at, off)) if after.saturating_duration_since(at) < off * 10 => {
                        (off * 2).min(YIELD_OFF_MAX)
                    }
                    _ => YIELD_OFF_MIN,
                };
                o.set(Some((after, off)));
            });
            self.yielding = Some(false);
        }
        after
    }
}

/// Less than two context switches take: a `sched_yield` that returned
/// within this ran no other thread (the call alone is a system call's
/// entry and exit).
const YIELD_RAN_NOBODY: Duration = Duration::from_micros(1);

/// A `sched_yield` that returned only after this ran a thread that did more
/// than answer a message: far longer than a peer's answer takes (a few
/// microseconds), shorter than a time slice of the scheduler (0.75 ms and
/// more).
const YIELD_RAN_LONG: Duration = Duration::from_micros(500);

/// How long a thread whose yield ran long pauses instead of yielding: at
/// first, and at most (see [`SpinTurns`]).
const YIELD_OFF_MIN: Duration = Duration::from_millis(1);
const YIELD_OFF_MAX: Duration = Duration::from_secs(1);

/// How long a waiting thread polls before it sleeps (`SMC_SPIN_US`, default 50 µs).
pub(crate) fn spin_time() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        Duration::from_micros(
            std::env::var("SMC_SPIN_US")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(50),
        )
    })
}

/// The device's progress thread: handles what no application thread waits
/// for (the peer's LLC requests, keepalives, the last CDCs of released
/// connections, timers). While application threads are busy in [`Shared::run`]
/// or in a stream's read or write ([`Shared::busy`]) it watches only the TCP
/// ends, without arming anything (their pumps do the work, one of them
/// leads the sleepers, and an armed CQ would make the peer signal every
/// message); while none is, it sleeps as the leader on the completion
/// channel, so a peer's request (e.g. CONFIRM_RKEY during a handshake) is
/// answered at once.
///
/// Time as the engine reports it ([`Endpoint::poll_timeout`]): the thread
/// sleeps until the engine's next deadline or an event, never on a period,
/// so an idle process is not woken at all.
fn progress_loop(weak: std::sync::Weak<Shared>) {
    loop {
        let Some(s) = weak.upgrade() else { return };
        let (seen, next) = {
            let mut ep = s.lock();
            let seen = s.pump(&mut ep);
            (seen, s.next_wake(&mut ep))
        };
        s.recheck_if_due();
        if s.active.load(Ordering::Acquire) == 0 && s.busy.load(Ordering::Acquire) == 0 {
            if s.sleep(None, seen, None, next) {
                s.hand_over();
            }
        } else {
            // The application threads pump; TCP ends are looked at here.
            // Once they are gone this thread leads again: it looks whether
            // they are every BUSY_LOOK while they poll (threads that spin
            // on non-blocking calls need a leader soon after they stop),
            // every IDLE_SLEEP while one of them sleeps as the leader (it
            // arms the completion queues and runs the timers).
            let led = s.leader_until.load(Ordering::Acquire) != NOBODY_SLEEPS;
            let look = Instant::now() + if led { IDLE_SLEEP } else { BUSY_LOOK };
            s.poll_watch(next.map_or(look, |n| n.min(look)));
        }
    }
}

/// Whether blocking readers wait on their connections' doorbells where the
/// device has them (docs/FAST-PATH.md, steps 5 and 6); `SMC_BELL=0`: they
/// wait through the leader and its followers, as on devices without
/// doorbells (to compare the two).
pub(crate) fn bells_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMC_BELL").map_or(true, |v| v != "0"))
}

/// How long a reader sleeps on its doorbell at most when another thread
/// had its link's receive CQ as it looked (see `Shared::read_on_bell`): that
/// poll may have come before the peer's SEND, whose doorbell the reader had
/// not yet armed.
const BELL_BUSY_WAIT: Duration = Duration::from_millis(2);

/// After a TCP end, everyone waiting looks again this long after the
/// engine's grace (its pump must have run past the deadline).
const RECHECK_MARGIN: Duration = Duration::from_millis(20);

/// While application threads are in the endpoint and one of them sleeps as
/// the leader, how often the progress thread looks whether they still are
/// (it leads the sleepers, arming the completion queues, only once they are
/// gone).
const IDLE_SLEEP: Duration = Duration::from_millis(20);

/// The same while none of them sleeps as the leader (they poll).
const BUSY_LOOK: Duration = Duration::from_millis(1);

impl Shared {
    fn new(ep: Endpoint<AnyProvider>) -> io::Result<Shared> {
        let notify = ep.notify_fd().try_clone_to_owned()?;
        let watch = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        Ok(Shared {
            watch,
            unwatched: Mutex::new(std::collections::VecDeque::new()),
            recheck_at: Mutex::new(std::collections::VecDeque::new()),
            gen: AtomicU64::new(ep.completions()),
            ep: Mutex::new(ep),
            notify,
            waiters: Mutex::new(Vec::new()),
            run_conns: Mutex::new(Vec::new()),
            bell_waiting: AtomicUsize::new(0),
            to_unpark: Mutex::new(Vec::new()),
            unparks: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            leader: Mutex::new(false),
            spin: Spin::default(),
            #[cfg(feature = "tokio")]
            tasks: Mutex::new(Vec::new()),
            #[cfg(feature = "tokio")]
            task_watcher: AtomicU64::new(0),
            readiness: Mutex::new(Vec::new()),
            readied: AtomicUsize::new(0),
            timers_seen: AtomicU64::new(0),
            kick: new_timerfd()?,
            kick_lock: Mutex::new(()),
            leader_until: AtomicU64::new(NOBODY_SLEEPS),
            fd_waiters: Mutex::new(Vec::new()),
            fd_waiting: AtomicUsize::new(0),
            lazy: AtomicBool::new(false),
            lazy_for: AtomicU64::new(LAZY_MIN),
            me: OnceLock::new(),
        })
    }

    /// Connects the QPs of links added by ADD_LINK that the engine handed
    /// out ([`Endpoint::take_link_bringup`]), each on a thread of its own,
    /// without the endpoint's lock: verbs' modify to RTR resolves the
    /// peer's MAC by a neighbour lookup and may wait for ARP a second or
    /// more (an address of the peer that does not answer), which under the
    /// lock held up every connection of the endpoint. Linux does its QP
    /// modify in its LLC worker (smc_llc.c `smc_llc_cli_add_link`). The
    /// thread reports the result to the engine
    /// ([`Endpoint::handle_link_bringup`]) and pumps, which sends what
    /// follows (the ADD_LINK response, a CONFIRM_LINK); the ADD_LINK flow's
    /// deadlines run meanwhile as ever. Rare (a link added), so a thread
    /// each rather than one kept.
    fn start_bringups(&self, ep: &mut Endpoint<AnyProvider>) {
        if ep.link_bringups_waiting() == 0 {
            return;
        }
        let me = self.me.get().cloned();
        while let Some(b) = ep.take_link_bringup() {
            let id = b.id();
            let Some(me) = me.clone() else {
                // (not shared yet: cannot happen, the engine hands none out
                // before its first pump)
                let _ = ep.handle_link_bringup(id, b.run(), now());
                continue;
            };
            let spawned = std::thread::Builder::new()
                .name("smc-link-up".into())
                .spawn(move || {
                    let r = b.run();
                    if let Some(s) = me.upgrade() {
                        let mut ep = s.lock();
                        let _ = ep.handle_link_bringup(id, r, now());
                        s.pump(&mut ep);
                    }
                });
            if let Err(e) = spawned {
                crate::registry::error("thread_start", format!("link bring-up: {e}"));
                let _ = ep.handle_link_bringup(id, Err(smc_rdma::Error::Io(e)), now());
            }
        }
    }

    fn waiters(&self) -> MutexGuard<'_, Vec<Waiter>> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the parked threads whose connection can go on (`all`: every
    /// one). Called with the endpoint locked: the threads are unparked when
    /// it is released ([`Locked`]), as a woken thread's first step is to take
    /// that lock.
    fn wake(&self, ep: &Endpoint<AnyProvider>, all: bool) {
        let mut w = self.waiters();
        let mut u = self.to_unpark.lock().unwrap_or_else(|e| e.into_inner());
        w.retain(|x| {
            if all || x.want.ready(ep) {
                x.woken.store(true, Ordering::Release);
                match &x.bell {
                    Some(b) => {
                        b.ring();
                    }
                    None => u.push(x.thread.clone()),
                }
                false
            } else {
                true
            }
        });
        self.unparks.store(u.len(), Ordering::Release);
        self.count_waiters(&w, Ordering::Release);
    }

    /// Unparks the threads [`Self::wake`] chose (after the endpoint lock is
    /// released).
    fn unpark_chosen(&self) {
        if self.unparks.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut u = self.to_unpark.lock().unwrap_or_else(|e| e.into_inner());
        self.unparks.store(0, Ordering::Release);
        for t in u.drain(..) {
            t.unpark();
        }
    }

    /// Marks the calling thread busy in a read or write until the guard
    /// drops, its copy outside the lock (a lease) included: the progress
    /// thread keeps out of the way then, as it does while threads are in
    /// [`Shared::run`] (else it would arm the completion queues during the
    /// copy and be woken, with a system call on the peer's side, by every
    /// message, which costs a one-way stream much of its throughput).
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(&self.busy)
    }

    /// After a read or write lease of connection `id` ended (with the
    /// endpoint locked): threads and tasks that were turned away while it was
    /// out look again (without a completion nothing else would wake them).
    pub(crate) fn after_lease(&self, ep: &mut Endpoint<AnyProvider>, id: ConnId) {
        if !ep.take_lease_waited(id) {
            return;
        }
        if self.sleepers.load(Ordering::Acquire) > 0 {
            self.wake(ep, false);
        }
        #[cfg(feature = "tokio")]
        self.wake_tasks(ep, false);
    }

    /// Watches the TCP socket of the established connection `id` for its end
    /// (EOF, RST, error). In Linux an SMC connection and its TCP connection
    /// end together (smc_close.c `smc_close_active_abort` aborts the TCP
    /// socket with the connection, af_smc.c `__smc_release` releases it with
    /// the socket); a user-space peer whose process dies or misbehaves takes
    /// its TCP socket away and may send no close CDC. So the engine is told
    /// ([`Endpoint::tcp_closed`]) and resets the connection unless the peer's
    /// close arrives within `PEER_GONE_GRACE` (a peer closing normally shuts
    /// its TCP connection down right after its close CDC). One epoll set per
    /// endpoint, no descriptor or thread per connection. The socket must stay
    /// open until [`Shared::unwatch_tcp`].
    ///
    /// It joins the epoll set only once it has lived [`WATCH_SLACK`], or
    /// before a sleep that watches the TCP ends ([`Self::register_watches`]):
    /// most short connections close (orderly, with their close CDC) before
    /// that and never cost the two `epoll_ctl` calls; a dead peer is taken
    /// for dead `PEER_GONE_GRACE` after its TCP end anyway. A leader asleep
    /// for longer is woken (its timer) when the socket is due.
    pub(crate) fn watch_tcp(&self, tcp: &Arc<std::net::TcpStream>, id: ConnId) {
        let since = Instant::now();
        self.unwatched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Unwatched {
                tcp: Arc::downgrade(tcp),
                id,
                since,
            });
        self.kick_at(nanos(
            (since + WATCH_SLACK).saturating_duration_since(origin()),
        ));
    }

    /// Puts the sockets given to [`Self::watch_tcp`] into the epoll set:
    /// all of them (`all`, before a sleep that watches the TCP ends) or
    /// those that waited [`WATCH_SLACK`].
    fn register_watches(&self, all: bool) {
        let mut q = self.unwatched.lock().unwrap_or_else(|e| e.into_inner());
        if q.is_empty() {
            return;
        }
        let now = Instant::now();
        while let Some(u) = q.front() {
            if !all && now.saturating_duration_since(u.since) < WATCH_SLACK {
                break;
            }
            let Some(u) = q.pop_front() else { break };
            // (the list stays locked: `unwatch_tcp` of this socket, which
            // comes before its close, waits for the registration)
            if let Some(tcp) = u.tcp.upgrade() {
                // one event is all it takes (ONESHOT): a socket that ended
                // stays readable. Without the watch the connection still
                // works; it is reset only when the peer's device says the
                // peer is gone.
                let _ = epoll::add(
                    &self.watch,
                    tcp.as_fd(),
                    epoll::EventData::new_u64(u.id.to_bits()),
                    epoll::EventFlags::RDHUP | epoll::EventFlags::ONESHOT,
                );
            }
        }
    }

    /// Stops watching a socket given to [`Shared::watch_tcp`] (before it is closed).
    pub(crate) fn unwatch_tcp(&self, tcp: &Arc<std::net::TcpStream>) {
        {
            let mut q = self.unwatched.lock().unwrap_or_else(|e| e.into_inner());
            // (the newest first: most connections that end soon are)
            if let Some(i) = q
                .iter()
                .rposition(|u| std::ptr::eq(u.tcp.as_ptr(), Arc::as_ptr(tcp)))
            {
                q.remove(i);
                return;
            }
        }
        let _ = epoll::delete(&self.watch, tcp.as_fd());
    }

    /// Tells the engine of the watched TCP connections that ended (with the
    /// endpoint locked). Handshakes fail at once; established connections are
    /// reset after `PEER_GONE_GRACE` unless their peer closes meanwhile, so
    /// everyone waiting looks again now and then.
    fn take_tcp_ends(&self, ep: &mut Endpoint<AnyProvider>) {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 64];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let Ok((got, _)) = epoll::wait(&self.watch, &mut buf, Some(&zero)) else {
            return;
        };
        if got.is_empty() {
            return;
        }
        // What came before the TCP ends first: a peer closes its connections
        // with a close CDC, then its TCP socket, and a TCP end after the
        // close CDC changes nothing.
        self.pump(ep);
        let mut changed = false;
        for ev in got.iter() {
            let data = ev.data;
            let d = data.u64();
            // (a connection freed meanwhile: its handle finds nothing, even
            // where a new connection took its slot)
            changed |= ep.tcp_closed(ConnId::from_bits(d));
        }
        if !changed {
            self.pump(ep);
            return;
        }
        self.recheck_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Instant::now() + smc_engine::endpoint::PEER_GONE_GRACE + RECHECK_MARGIN);
        self.pump(ep);
        self.wake(ep, true);
        self.refresh_readiness();
        #[cfg(feature = "tokio")]
        self.wake_tasks(ep, true);
    }

    /// Waits until `until` for a watched TCP connection to end, and deals
    /// with it (the progress thread, while application threads pump).
    fn poll_watch(&self, until: Instant) {
        let ts = timespec_until(Some(until));
        let watching = watches_tcp_ends(Some(until));
        self.register_watches(watching);
        let ended = if watching {
            let mut pfd = [PollFd::new(&self.watch, PollFlags::IN)];
            matches!(rustix::event::poll(&mut pfd, ts.as_ref()), Ok(n) if n > 0)
        } else {
            let _ = rustix::event::poll(&mut [], ts.as_ref());
            fd_ready(&self.watch)
        };
        if ended {
            let mut ep = self.lock();
            self.take_tcp_ends(&mut ep);
        }
    }

    /// Once the grace after a TCP end has passed: the connections it reset
    /// wake their waiters (a reset need not come with a completion).
    fn recheck_if_due(&self) {
        let due = {
            let mut r = self.recheck_at.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let mut due = false;
            while r.front().is_some_and(|t| now >= *t) {
                r.pop_front();
                due = true;
            }
            due
        };
        if due {
            let mut ep = self.lock();
            self.pump(&mut ep);
            self.wake(&ep, true);
            self.refresh_readiness();
            #[cfg(feature = "tokio")]
            self.wake_tasks(&ep, true);
        }
    }

    /// Wakes one parked thread (any), to take over as the leader.
    fn wake_one(&self) {
        let mut w = self.waiters();
        // (a reader on its doorbell does not lead: it sleeps there again)
        if let Some(i) = w.iter().rposition(|x| x.bell.is_none()) {
            let x = w.remove(i);
            x.woken.store(true, Ordering::Release);
            x.thread.unpark();
        }
        self.count_waiters(&w, Ordering::Release);
    }

    /// Registers a reader of connection `id` about to sleep on its doorbell
    /// (docs/FAST-PATH.md, step 6): a pump that finds the connection ready
    /// (an abort, a timer) rings it as it unparks the others. `None`: a
    /// thread waits for the same connection through [`Self::run`] (e.g. a
    /// writer for room): that one's wake-ups come through the completion
    /// channel, which a CDC that rings a doorbell does not signal, so the
    /// reader waits through `run` too.
    pub(crate) fn bell_register(
        &self,
        id: ConnId,
        bell: &smc_rdma::Doorbell,
    ) -> Option<Arc<AtomicBool>> {
        let mut w = self.waiters();
        if self.run_waits(&w, id) {
            return None;
        }
        let woken = Arc::new(AtomicBool::new(false));
        w.push(Waiter {
            want: Want::Read(id),
            thread: std::thread::current(),
            woken: woken.clone(),
            bell: Some(bell.clone()),
        });
        self.count_waiters(&w, Ordering::Release);
        Some(woken)
    }

    /// Ends a [`Self::bell_register`] (if no pump took it already).
    pub(crate) fn bell_unregister(&self, woken: &Arc<AtomicBool>) {
        if woken.load(Ordering::Acquire) {
            return;
        }
        let mut w = self.waiters();
        w.retain(|x| !Arc::ptr_eq(&x.woken, woken));
        self.count_waiters(&w, Ordering::Release);
    }

    /// Whether a thread of [`Self::run`] sleeps (or is about to) for
    /// connection `id` (with the waiters locked).
    fn run_waits(&self, _w: &MutexGuard<'_, Vec<Waiter>>, id: ConnId) -> bool {
        self.run_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&id)
    }

    /// A thread of [`Self::run`] is about to sleep for connection `id`:
    /// listed until [`Self::run_unlist`], and the readers of `id` on its
    /// doorbell are woken to wait through `run` too (see
    /// [`Self::bell_register`]).
    fn run_list(&self, id: ConnId) {
        let mut w = self.waiters();
        self.run_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(id);
        // (taken as a pump's wake-up takes them: the reader registers
        // again, finds this thread listed and waits through `run`)
        w.retain(|x| match &x.bell {
            Some(b) if x.want.conn() == id => {
                x.woken.store(true, Ordering::Release);
                b.ring();
                false
            }
            _ => true,
        });
        self.count_waiters(&w, Ordering::Release);
    }

    fn run_unlist(&self, id: ConnId) {
        let _w = self.waiters();
        let mut v = self.run_conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = v.iter().position(|&c| c == id) {
            v.swap_remove(i);
        }
    }

    pub(crate) fn lock(&self) -> Locked<'_> {
        Locked {
            guard: Some(self.ep.lock().unwrap_or_else(|e| e.into_inner())),
            shared: self,
        }
    }

    /// Pumps the endpoint and wakes the sleepers if it took completions.
    /// Returns the completion count seen.
    pub(crate) fn pump(&self, ep: &mut Endpoint<AnyProvider>) -> u64 {
        let _ = self.try_pump(ep);
        ep.completions()
    }

    /// [`Self::pump`] for callers that act on a provider error (the handshake).
    pub(crate) fn try_pump(
        &self,
        ep: &mut Endpoint<AnyProvider>,
    ) -> smc_engine::endpoint::Result<()> {
        let r = ep.pump(now());
        // (a link up or down, a connection moved or aborted: rare, and what
        // it changes is not looked at per connection, so everyone looks)
        let evented = crate::registry::engine_events(ep);
        let n = ep.completions();
        let moved = self.gen.swap(n, Ordering::AcqRel) != n;
        let t = ep.timer_events();
        // (a load first: timers fire rarely, a pump runs per message)
        let fired = self.timers_seen.load(Ordering::Acquire) != t
            && self.timers_seen.swap(t, Ordering::AcqRel) != t;
        let all = fired || evented;
        // (parked threads wake on engine events only through the readiness
        // check of `wake`: an event that lets a read or write go on makes it
        // ready, and waking every parked thread on each link event costs a
        // wake-up per thread for nothing)
        if (moved || fired) && self.sleepers.load(Ordering::Acquire) > 0 {
            self.wake(ep, fired);
        }
        #[cfg(feature = "tokio")]
        if moved || all {
            self.wake_tasks(ep, all);
        }
        if moved || all {
            // (the connections' own changes — a CDC applied, a send
            // completed, a close event — their cores tell their watches
            // themselves, whichever thread made them; only what the engine
            // does around them, a link's failover or a timer's abort, needs
            // every descriptor looked at: one look per connection per pump
            // would make each message cost as many as there are connections)
            if all {
                self.refresh_readiness();
            }
            if self.fd_waiting.load(Ordering::Acquire) > 0 {
                for fd in self
                    .fd_waiters
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                {
                    fd.ring();
                }
            }
        }
        r
    }

    /// What connection `id` shows its waiters from now on (with the
    /// endpoint locked): its descriptor and its tasks' side are made when
    /// asked for (`SmcConn::readiness`, `SmcConn::task_ready`).
    pub(crate) fn readiness(
        &self,
        ep: &Endpoint<AnyProvider>,
        id: ConnId,
    ) -> io::Result<Arc<ConnReadiness>> {
        let fast = ep.fast_conn(id);
        let shown = Arc::new(crate::readiness::Shown::default());
        let signal = fast.as_ref().and_then(peer_signal);
        if let Some(f) = &fast {
            let to = shown.clone();
            let sig = signal.clone();
            f.watch(Some(Arc::new(move |l: &ConnLevel| {
                let now = level(l);
                // The peer's signal shows these bytes. (Once they are
                // read it stays readable, spent, until a read that finds
                // nothing or the event loop's wait arms it again: both
                // look for CDCs after arming, which this cannot do here —
                // a CDC published and not yet applied would be announced
                // by nothing.)
                let held = now.readable
                    && sig
                        .as_ref()
                        .is_some_and(|s| s.polled() && s.bell.polled_taken());
                to.set(now, held)
            })));
        }
        let r = Arc::new(ConnReadiness {
            fast,
            shown,
            signal,
        });
        let mut v = self.readiness.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&r));
        self.readied.store(v.len(), Ordering::SeqCst);
        drop(v);
        self.kick_lazy();
        Ok(r)
    }

    /// Sets one connection's readiness descriptor (after a change through
    /// the endpoint).
    pub(crate) fn refresh_one(&self, r: &ConnReadiness) {
        match &r.fast {
            Some(f) => f.refresh(),
            None => r.shown.set(GONE, false),
        }
    }

    /// Sets every readiness descriptor of the endpoint to its connection's
    /// state (with the endpoint locked, after a pump: what the engine
    /// changed without the connection's core seeing it, a failover's or a
    /// timer's abort; nothing to do without descriptors).
    fn refresh_readiness(&self) {
        if self.readied.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut v = self.readiness.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| match w.upgrade() {
            Some(r) => {
                self.refresh_one(&r);
                true
            }
            None => false,
        });
        self.readied.store(v.len(), Ordering::Release);
    }

    /// When a thread that sleeps next should wake for the engine: its next
    /// deadline. One already past is run now (a pump); if that leaves
    /// work due at once (the pump's events ask for another), the sleep
    /// is short rather than none.
    pub(crate) fn next_wake(&self, ep: &mut Endpoint<AnyProvider>) -> Option<Instant> {
        let next = engine_deadline(ep)?;
        let now = Instant::now();
        if next > now {
            return Some(next);
        }
        self.pump(ep);
        engine_deadline(ep).map(|n| n.max(now + Duration::from_micros(100)))
    }

    /// Registers the calling thread to be woken, through a descriptor it can
    /// poll beside others (a socket), by every pump that takes completions
    /// or fires timers: a thread that waits for the endpoint outside
    /// [`Self::run`] (a blocking handshake, a listener's handshake while a
    /// step of it runs over the device).
    pub(crate) fn progress_fd(self: &Arc<Self>) -> io::Result<ProgressFd> {
        let fd = Arc::new(Waker {
            fd: new_eventfd()?,
            rung: AtomicBool::new(false),
        });
        let mut v = self.fd_waiters.lock().unwrap_or_else(|e| e.into_inner());
        v.push(fd.clone());
        self.fd_waiting.store(v.len(), Ordering::SeqCst);
        drop(v);
        self.kick_lazy();
        Ok(ProgressFd {
            shared: self.clone(),
            fd,
        })
    }

    /// Runs `op` on the endpoint until it returns `Some`: pump, try, spin for
    /// [`spin_time`], then sleep until completions arrive. `deadline` passed or
    /// `nonblocking` set: `WouldBlock`, as a socket with a timeout says.
    pub(crate) fn run<R>(
        &self,
        want: Want,
        deadline: Option<Instant>,
        nonblocking: bool,
        mut op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> io::Result<R> {
        struct Active<'a>(&'a Shared, Option<ConnId>);
        impl Drop for Active<'_> {
            fn drop(&mut self) {
                if let Some(id) = self.1 {
                    self.0.run_unlist(id);
                }
                self.0.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.active.fetch_add(1, Ordering::AcqRel);
        let mut active = Active(self, None);
        // (end of the spin phase, its budget) once a first try failed
        let mut spin: Option<(Instant, Duration)> = None;
        let mut turns = SpinTurns::new();
        let mut slept = false;
        // whether the last sleep was as the leader
        let mut led = false;
        loop {
            let seen = {
                let mut ep = self.lock();
                // Try first (another thread's pump may have done the work), then
                // pump and try again.
                let mut r = op(&mut ep);
                // While spinning, a whole pump only when the links may have
                // something new (the spin is short; timers wait for the next
                // full pump): a pump's locks and clock reads are most of what
                // a spinning round trip costs.
                if r.is_none() && (spin.is_none() || ep.may_have_work()) {
                    self.pump(&mut ep);
                    r = op(&mut ep);
                }
                if let Some(r) = r {
                    // send what the operation produced (data, a cursor update)
                    // for this connection alone: a whole pump walks every
                    // connection and link, and with many connections per
                    // process that cost, under the endpoint lock, is what
                    // limits request/response rates
                    let _ = ep.flush(want.conn());
                    if spin.is_some() && !slept {
                        self.spin.hit();
                    }
                    drop(ep);
                    if led {
                        self.hand_over();
                    }
                    return r;
                }
                ep.completions()
            };
            if nonblocking {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                if led {
                    self.hand_over();
                }
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let (until, budget) = *spin.get_or_insert_with(|| {
                // More threads waiting here than half the CPUs: a spinning
                // one would take the core (and the endpoint lock) that the
                // others and the peer need, so wait without spinning.
                // (Sleeping waiters count too: letting the one awake thread
                // spin while nine slept cost request/response a third of its
                // rate. The price: a process with a thread parked in a read,
                // a dedicated reader, does not spin in other waits.)
                let b = if self.active.load(Ordering::Relaxed)
                    + self.bell_waiting.load(Ordering::Relaxed)
                    > max_spinners()
                {
                    Duration::ZERO
                } else {
                    self.spin.budget()
                };
                (now + b, b)
            });
            if now < until {
                // (the time after it: the loop's next look reads its own)
                let _ = turns.pause();
                continue;
            }
            if !slept {
                self.spin.miss(budget);
                slept = true;
            }
            if active.1.is_none() {
                self.run_list(want.conn());
                active.1 = Some(want.conn());
            }
            led = self.sleep(Some(want), seen, deadline, None);
        }
    }

    /// A blocking read of connection `id` that found nothing: waits on the
    /// connection's doorbell (docs/FAST-PATH.md, step 6) instead of through
    /// [`Self::run`]'s leader and followers, so that the peer's CDC wakes
    /// this thread alone, once: `read` (the fast read, which takes the
    /// link's completions itself) is tried while the wait may spin (the
    /// rule of [`Self::run`]), then the doorbell is armed, looked behind
    /// ([`FastConn::may_sleep`](smc_engine::endpoint::FastConn::may_sleep))
    /// and slept on, until `read` reads. `None`: the device has no
    /// doorbells, the connection needs the endpoint (or another thread
    /// waits for it through [`Self::run`]), or `deadline` passed: the
    /// caller goes through [`Self::run`].
    pub(crate) fn read_on_bell(
        &self,
        id: ConnId,
        fast: &smc_engine::endpoint::FastConn<AnyProvider>,
        deadline: Option<Instant>,
        mut read: impl FnMut() -> Option<usize>,
    ) -> Option<usize> {
        use smc_engine::endpoint::MaySleep;
        if !bells_on() {
            return None;
        }
        let bell = fast.bell()?;
        struct Count<'a>(&'a AtomicUsize);
        impl Drop for Count<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.bell_waiting.fetch_add(1, Ordering::AcqRel);
        let _count = Count(&self.bell_waiting);
        let budget = if self.active.load(Ordering::Relaxed)
            + self.bell_waiting.load(Ordering::Relaxed)
            > max_spinners()
        {
            Duration::ZERO
        } else {
            self.spin.budget()
        };
        let mut now = Instant::now();
        let until = now + budget;
        let mut looked = false;
        // The doorbell held while this thread spins (`Bell::hold`), as a
        // writer holds it through its call: a CDC that comes meanwhile takes
        // it and is left for this thread's look, instead of signalling the
        // completion channel, whose progress thread would wake only to find
        // that this thread took the CDC already.
        let held = !budget.is_zero() && bell.hold();
        let mut got = None;
        let mut turns = SpinTurns::new();
        // (a look after every pause, the last one too: a yield on one CPU
        // may run the peer for longer than the whole budget, a writer
        // filling the RMB, and what it wrote is this wait's hit, not a miss;
        // misses turn spinning off, and then every CDC of that writer wakes
        // this thread, which takes the CPU from it at once)
        if !budget.is_zero() {
            loop {
                if let Some(n) = read() {
                    got = Some(n);
                    break;
                }
                if now >= until {
                    break;
                }
                looked = true;
                now = turns.pause();
            }
        }
        // (taken: by the CDC just read, or one after it, which nobody was
        // told of; the held answer's look takes it, as after a write)
        let taken = held && bell.release();
        if let Some(n) = got {
            // (only what came while this thread spun says spinning
            // pays: data there at the first look says nothing)
            if looked {
                self.spin.hit();
            }
            if taken {
                self.take_held_cdc(fast);
            }
            return Some(n);
        }
        self.spin.miss(budget);
        let mut woken = self.bell_register(id, &bell)?;
        let mut again = false;
        let got = loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                break None;
            }
            bell.arm();
            match fast.may_sleep() {
                MaySleep::Sleep => bell.wait(left),
                MaySleep::Busy => {
                    bell.wait(Some(left.map_or(BELL_BUSY_WAIT, |l| l.min(BELL_BUSY_WAIT))))
                }
                MaySleep::Again => again = true,
                MaySleep::No => break None,
            }
            if let Some(n) = read() {
                break Some(n);
            }
            // something arrived that the fast read does not take alone (a
            // cursor update it may not send, among others): the endpoint's
            if std::mem::take(&mut again) {
                break None;
            }
            // a pump found the connection ready (an abort, a timer) and
            // took the registration: the read above saw what it could, the
            // wait goes on registered again
            if woken.load(Ordering::Acquire) {
                if bell.release() {
                    self.take_held_cdc(fast);
                }
                match self.bell_register(id, &bell) {
                    Some(w) => woken = w,
                    None => return None,
                }
            }
        };
        // (rung since the last arm: the ring's SEND was read above, but
        // one that took the bell after it and was published after that
        // look signalled nobody: taken here, as after a hold)
        if bell.release() {
            self.take_held_cdc(fast);
        }
        self.bell_unregister(&woken);
        got
    }

    /// After a fast write of connection `fast` held its doorbell
    /// (`Bell::hold`) and a CDC took it (`Bell::release`): that CDC
    /// signalled neither a reader nor the completion channel, so this thread
    /// applies it (as a reader's dispatch would), and when that is not the
    /// whole story (another thread had the link's receive CQ, something
    /// waits for the endpoint, or a thread or task of this process waits
    /// through the endpoint and may want what came) pumps, as the progress
    /// thread would have done had the channel been signalled.
    pub(crate) fn take_held_cdc(&self, fast: &smc_engine::endpoint::FastConn<AnyProvider>) {
        if fast.take_held_cdc() && !self.has_waiters() {
            return;
        }
        let mut ep = self.lock();
        self.pump(&mut ep);
    }

    /// Threads registered as waiting (parked, or asleep on a doorbell).
    #[cfg(test)]
    pub(crate) fn sleepers(&self) -> usize {
        self.sleepers.load(Ordering::Acquire)
    }

    /// `sleepers` and `parked` after a change of the waiters (with them
    /// locked).
    fn count_waiters(&self, w: &[Waiter], order: Ordering) {
        let parked = w.iter().filter(|x| x.bell.is_none()).count();
        self.parked.store(parked, order);
        self.sleepers.store(w.len(), order);
    }

    /// Whether a thread sleeps through the endpoint, parked, or (with the
    /// tokio adapter) a task waits for its progress: what a CDC that took a
    /// held doorbell may concern besides its own connection. Not a reader
    /// asleep on its doorbell: the peer's SEND of its CDC rang that
    /// (`Bell::ring`), whoever applies the CDC; a reader of the held
    /// connection itself could not be one (`Bell::hold` succeeds only on a
    /// doorbell nobody waits on, and a reader that arms it after the hold
    /// is rung through the word, as after any hold); and a pump for what
    /// else concerns them (an abort, a finished close) is made when the
    /// dispatch leaves it in the link's queue (`FastConn::take_held_cdc`
    /// false).
    fn has_waiters(&self) -> bool {
        if self.parked.load(Ordering::Acquire) > 0 {
            return true;
        }
        #[cfg(feature = "tokio")]
        if !self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            return true;
        }
        false
    }

    /// Wakes the tasks whose connection can go on (`all`: every one), as
    /// [`Self::wake`] chooses the threads (called with the endpoint locked).
    #[cfg(feature = "tokio")]
    fn wake_tasks(&self, ep: &Endpoint<AnyProvider>, all: bool) {
        let mut v = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|t| {
            if all || t.want.is_none_or(|w| w.ready(ep)) {
                t.waker.wake_by_ref();
                false
            } else {
                true
            }
        });
    }

    /// Wakes `waker` at the next pump that finds `want` can be met (`None`:
    /// at the next pump that takes completions), or that fires a timer or
    /// sees an engine event. Call with the endpoint locked (`_ep`), after
    /// looking at it: nothing between the look and the registration is
    /// missed.
    #[cfg(feature = "tokio")]
    pub(crate) fn wake_on_progress(
        &self,
        _ep: &mut Endpoint<AnyProvider>,
        want: Option<Want>,
        waker: &std::task::Waker,
    ) {
        let mut v = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if !v.iter().any(|t| t.want == want && t.waker.will_wake(waker)) {
            v.push(TaskWait {
                want,
                waker: waker.clone(),
            });
        }
    }

    /// Makes the stream wait `me` (nonzero) the one that watches the
    /// completion channel in the reactor, unless another one does; whether
    /// it is (now or already).
    #[cfg(feature = "tokio")]
    pub(crate) fn watch_channel(&self, me: u64) -> bool {
        match self
            .task_watcher
            .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(w) => w == me,
        }
    }

    /// The stream wait `me` no longer watches the completion channel (if it did).
    #[cfg(feature = "tokio")]
    pub(crate) fn unwatch_channel(&self, me: u64) {
        let _ = self
            .task_watcher
            .compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// One attempt at `op` that never waits, for a task that sleeps elsewhere
    /// (the tokio adapter): try, pump, try; if `op` still cannot go on, arm the
    /// completion queues, then pump and try once more (a completion that came
    /// before arming signals nobody). `None`: the queues are armed, the
    /// completion channel ([`Shared::notify_dup`]) will signal the next
    /// completion, and `waker` is woken by the next pump after which `want`
    /// can be met.
    #[cfg(feature = "tokio")]
    pub(crate) fn try_or_arm<R>(
        &self,
        want: Want,
        waker: &std::task::Waker,
        mut op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> Option<io::Result<R>> {
        let mut ep = self.lock();
        let mut r = op(&mut ep);
        if r.is_none() {
            self.pump(&mut ep);
            r = op(&mut ep);
        }
        if r.is_none() {
            if let Err(e) = ep.arm() {
                return Some(Err(io::Error::other(e)));
            }
            self.pump(&mut ep);
            r = op(&mut ep);
        }
        match r {
            // send what the operation produced (data, cursor updates)
            Some(_) => {
                self.pump(&mut ep);
            }
            None => self.wake_on_progress(&mut ep, Some(want), waker),
        }
        r
    }

    /// A descriptor of the endpoint's completion channel, for one waiter of
    /// its own (each duplicate is a separate registration in an epoll set).
    #[cfg(feature = "tokio")]
    pub(crate) fn notify_dup(&self) -> io::Result<OwnedFd> {
        self.notify.try_clone()
    }

    /// Sleeps until completions arrive after `seen` (the leader) or `want` can
    /// be met (a follower), the caller's `deadline`, or the engine's next
    /// deadline (the leader looks when it arms, and is kicked if it moves
    /// earlier while it sleeps; a follower looks before it parks; `next`: as
    /// the caller saw it, if it did).
    /// Returns whether this thread slept as the leader.
    fn sleep(
        &self,
        want: Option<Want>,
        seen: u64,
        deadline: Option<Instant>,
        next: Option<Instant>,
    ) -> bool {
        let earliest = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut until = earliest(deadline, next);
        let mut leader = self.leader.lock().unwrap_or_else(|e| e.into_inner());
        if self.gen.load(Ordering::Acquire) != seen {
            return false;
        }
        if *leader {
            let Some(want) = want else {
                // the progress thread does not follow: it has nothing to wait for
                drop(leader);
                let soon = Instant::now() + Duration::from_millis(1);
                let t = until.map_or(soon, |u| u.min(soon));
                std::thread::sleep(t.saturating_duration_since(Instant::now()));
                return false;
            };
            drop(leader);
            // (the engine's next deadline only now: a round trip that does
            // not sleep does not pay for it)
            if next.is_none() {
                let mut ep = self.lock();
                until = earliest(until, self.next_wake(&mut ep));
            }
            let woken = Arc::new(AtomicBool::new(false));
            {
                let mut w = self.waiters();
                w.push(Waiter {
                    want,
                    thread: std::thread::current(),
                    woken: woken.clone(),
                    bell: None,
                });
                self.count_waiters(&w, Ordering::SeqCst);
            }
            self.kick_lazy();
            // a pump between `seen` and the registration woke nobody: look again
            if self.gen.load(Ordering::Acquire) == seen {
                while !woken.load(Ordering::Acquire) {
                    let Some(end) = until else {
                        std::thread::park();
                        continue;
                    };
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    std::thread::park_timeout(left);
                }
            }
            if !woken.load(Ordering::Acquire) {
                let mut w = self.waiters();
                w.retain(|x| !Arc::ptr_eq(&x.woken, &woken));
                self.count_waiters(&w, Ordering::Release);
            }
            return false;
        }
        *leader = true;
        drop(leader);
        // (the progress thread, when nothing waits that only a pump serves:
        // see `lazy`)
        let lazy = want.is_none() && {
            self.lazy.store(true, Ordering::SeqCst);
            self.may_arm_lazily()
        };
        let (quiet, until) = {
            let mut ep = self.lock();
            // arm, then look once more: a completion before arming signals nobody
            let armed = if lazy {
                ep.arm_unpolled()
            } else {
                ep.arm().map(|()| 0)
            };
            let left = *armed.as_ref().unwrap_or(&0);
            let quiet = armed.is_ok() && self.pump(&mut ep) == seen;
            let lazy_until = if left > 0 {
                let d = self.lazy_for.load(Ordering::Relaxed);
                self.lazy_for
                    .store((d * 2).min(LAZY_MAX), Ordering::Relaxed);
                Some(Instant::now() + Duration::from_micros(d))
            } else {
                self.lazy.store(false, Ordering::SeqCst);
                self.lazy_for.store(LAZY_MIN, Ordering::Relaxed);
                None
            };
            let next = self.next_wake(&mut ep);
            // (a tcp end's recheck is due then too)
            let recheck = self
                .recheck_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .front()
                .copied();
            let until = earliest(earliest(earliest(deadline, next), recheck), lazy_until);
            // from here on a call that moves the engine's next deadline
            // before `until` kicks this sleep (see `Locked`)
            let at = until.map_or(NOBODY_SLEEPS - 1, |u| {
                nanos(u.saturating_duration_since(origin()))
            });
            self.leader_until.store(at, Ordering::SeqCst);
            // (one who started to wait before that store found nobody to
            // kick: looked at again after it)
            let quiet = quiet && (!self.lazy.load(Ordering::SeqCst) || self.may_arm_lazily());
            (quiet, until)
        };
        let mut tcp_ended = false;
        if quiet {
            let watching = watches_tcp_ends(until);
            self.register_watches(watching);
            let mut pfd = [
                PollFd::new(&self.notify, PollFlags::IN),
                PollFd::new(
                    &self.watch,
                    if watching {
                        PollFlags::IN
                    } else {
                        PollFlags::empty()
                    },
                ),
                PollFd::new(&self.kick, PollFlags::IN),
            ];
            let ts = timespec_until(until);
            let _ = rustix::event::poll(&mut pfd, ts.as_ref());
            tcp_ended = if watching {
                !pfd[1].revents().is_empty()
            } else {
                fd_ready(&self.watch)
            };
            if !pfd[2].revents().is_empty() {
                // (a timerfd reads as its count of expirations, like an eventfd)
                drain_eventfd(&self.kick);
            }
        }
        self.leader_until.store(NOBODY_SLEEPS, Ordering::Release);
        self.lazy.store(false, Ordering::SeqCst);
        {
            let mut ep = self.lock();
            ep.take_notification();
            // whatever woke us, the waiters it concerns go on
            self.pump(&mut ep);
            if tcp_ended {
                self.take_tcp_ends(&mut ep);
            }
        }
        *self.leader.lock().unwrap_or_else(|e| e.into_inner()) = false;
        // Back to the caller, which tries again and most likely sleeps again
        // as the leader; if it leaves instead, it hands over (`hand_over`).
        // (Waking a follower to take over here would cost a wake-up for every
        // completion that was not the leader's own.)
        true
    }

    /// Whether the progress thread may leave polled receive CQs unarmed
    /// (see [`Self::lazy`]): nobody waits for a pump — no follower or
    /// doorbell sleeper, no readiness descriptor (an event loop waits on it
    /// for CDCs the progress thread applies), no descriptor waiter, no
    /// thread in the endpoint.
    fn may_arm_lazily(&self) -> bool {
        self.sleepers.load(Ordering::SeqCst) == 0
            && self.readied.load(Ordering::SeqCst) == 0
            && self.fd_waiting.load(Ordering::SeqCst) == 0
            && self.active.load(Ordering::SeqCst) == 0
            && self.busy.load(Ordering::SeqCst) == 0
    }

    /// Called after starting to wait for a pump (the count that says so
    /// stored): a progress thread asleep with receive CQs unarmed wakes
    /// now, and arms them at its next sleep.
    fn kick_lazy(&self) {
        if self.lazy.load(Ordering::SeqCst) {
            self.kick_at(0);
        }
    }

    /// Makes the sleeping leader, if there is one, wake at engine time `at`
    /// (nanoseconds; 0: now) if that is before the time it sleeps until.
    fn kick_at(&self, at: u64) {
        let _k = self.kick_lock.lock().unwrap_or_else(|e| e.into_inner());
        let until = self.leader_until.load(Ordering::Acquire);
        if until == NOBODY_SLEEPS || at >= until {
            return;
        }
        // (a leader that woke meanwhile stored NOBODY_SLEEPS: then it
        // looks at the engine anyway, and the timer set would only be early)
        let next = if at == 0 { NOBODY_SLEEPS } else { at };
        if self
            .leader_until
            .compare_exchange(until, next, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let when = origin() + Duration::from_nanos(at);
        set_timer(&self.kick, when.saturating_duration_since(Instant::now()));
    }

    /// After leaving the waiting loop as the last leader: a parked follower
    /// takes over, if nobody else has.
    fn hand_over(&self) {
        let vacant = !*self.leader.lock().unwrap_or_else(|e| e.into_inner());
        if vacant && self.sleepers.load(Ordering::Acquire) > 0 {
            self.wake_one();
        }
    }
}

/// See [`Shared::busy`].
pub(crate) struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How many pumps [`Locked`]'s release runs at most for work a call left
/// for the next pump (each may leave some for the one after); beyond, the
/// sleeping leader is kicked to do the rest.
const DROP_PUMPS: usize = 3;

/// The locked endpoint. Threads that a pump under this lock found ready are
/// unparked when it is released, not while it is held: woken at once, a
/// thread would run (on the other core, or in place of the pumping one) only
/// to block on the lock again.
pub(crate) struct Locked<'a> {
    guard: Option<MutexGuard<'a, Endpoint<AnyProvider>>>,
    shared: &'a Shared,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Endpoint<AnyProvider>;
    fn deref(&self) -> &Self::Target {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // (what the calls under the lock handed out, to run without it)
        if !std::thread::panicking() {
            if let Some(ep) = self.guard.as_mut() {
                self.shared.start_bringups(ep);
            }
        }
        let until = self.shared.leader_until.load(Ordering::Acquire);
        if until != NOBODY_SLEEPS {
            // The leader armed what was waited for when it went to sleep;
            // a call since may wait for a send completion too (a write that
            // filled the send buffer or took the last send slot, a close):
            // that is armed now, then looked at once (`Endpoint::arm_sends`).
            // (not while unwinding: no pump in a panicking thread)
            let look = !std::thread::panicking();
            // (and the receive CQs of links made meanwhile — a first
            // contact's: its CONFIRM_LINK comes on them)
            let armed = |ep: &mut MutexGuard<'_, Endpoint<AnyProvider>>| -> smc_rdma::Result<bool> {
                let new = ep.arm_new_links()?;
                Ok(ep.arm_sends()? || new)
            };
            let missed = match self.guard.as_mut().filter(|_| look).map(armed) {
                Some(Ok(true)) => {
                    if let Some(ep) = self.guard.as_mut() {
                        self.shared.pump(ep);
                    }
                    false
                }
                Some(Ok(false)) | None => false,
                Some(Err(_)) => true,
            };
            // A call may have left work for a pump now (a handshake's or a
            // close's step: `Endpoint::poll_timeout` is now): done here,
            // under the lock this thread holds, rather than by the leader,
            // which would be woken for it (two context switches for each
            // step of each connection's setup and close).
            // A pump can leave work for the next one (a freed connection's
            // group is looked at by the pump after, as are the events that
            // call for a sweep): those run here too, a few rounds at most.
            if look {
                if let Some(ep) = self.guard.as_mut() {
                    for _ in 0..DROP_PUMPS {
                        if ep.poll_timeout().is_none_or(|t| t > now()) {
                            break;
                        }
                        self.shared.pump(ep);
                    }
                }
            }
            // It may also have given the engine an earlier deadline than
            // the one the leader sleeps until (a close's wait for unsent
            // data, a new handshake): its timer moves there, and it sleeps
            // on until then. An arming that failed wakes it at once.
            let earlier = self
                .guard
                .as_ref()
                .and_then(|ep| ep.poll_timeout())
                .map(nanos)
                .filter(|&t| t < until);
            if missed {
                self.shared.kick_at(0);
            } else if let Some(t) = earlier {
                self.shared.kick_at(t);
            }
        }
        drop(self.guard.take());
        self.shared.unpark_chosen();
    }
}

struct Context {
    provider: AnyProvider,
    /// The instance part of this process's system ID, and the lock that
    /// keeps it unique among the processes of the device directory (see
    /// [`crate::sysid`]).
    instance: u16,
    _instance_lock: Option<OwnedFd>,
    endpoints: Mutex<HashMap<String, Arc<Shared>>>,
    /// Recent device candidates per local address (see [`endpoint_for`]).
    #[allow(clippy::type_complexity)]
    selection: Mutex<HashMap<IpAddr, (Instant, Option<Arc<Choice>>)>>,
    /// This network namespace's addresses, recently read (see [`in_namespace`]).
    #[allow(clippy::type_complexity)]
    addrs: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>>,
}

fn origin() -> Instant {
    static O: OnceLock<Instant> = OnceLock::new();
    *O.get_or_init(Instant::now)
}

/// The engine's clock: time since the first use in this process.
pub(crate) fn now() -> Timestamp {
    origin().elapsed()
}

/// The devices and endpoints of this process (of its generation: a forked
/// child starts with none, see `crate::fork`).
static CONTEXT: crate::fork::PerFork<Context> = crate::fork::PerFork::new();

/// The endpoints this process has opened, by device, and the devices its
/// provider offers (for the registry, `crate::registry`); nothing if no
/// connection has looked for a device yet (the registry does not open the
/// provider).
#[allow(clippy::type_complexity)]
pub(crate) fn endpoints_and_devices(
    with_devices: bool,
) -> Option<(
    Vec<(String, Arc<Shared>)>,
    Vec<(Kind, smc_rdma::DeviceInfo)>,
)> {
    let ctx = CONTEXT.get()?;
    let mut eps: Vec<(String, Arc<Shared>)> = ctx
        .endpoints
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(n, s)| (n.clone(), s.clone()))
        .collect();
    eps.sort_by(|a, b| a.0.cmp(&b.0));
    let devices = if with_devices {
        ctx.provider.devices_by_kind().unwrap_or_default()
    } else {
        Vec::new()
    };
    Some((eps, devices))
}

/// Buffer sizes asked for (RMB, send buffer; `None`: not asked, the
/// process's or the endpoint's then, see [`crate::set_buffer_sizes`]).
pub(crate) type Bufs = (Option<usize>, Option<usize>);

/// [`Bufs`] readable without a lock (0: not asked): the process's, and a
/// listener's (a forked child reads its parent's copy).
#[derive(Default)]
pub(crate) struct Asked(AtomicUsize, AtomicUsize);

impl Asked {
    pub(crate) const fn new() -> Asked {
        Asked(AtomicUsize::new(0), AtomicUsize::new(0))
    }

    pub(crate) fn get(&self) -> Bufs {
        let some = |n: usize| (n > 0).then_some(n);
        (
            some(self.0.load(Ordering::Relaxed)),
            some(self.1.load(Ordering::Relaxed)),
        )
    }

    pub(crate) fn set(&self, (rmb, snd): Bufs) {
        self.0.store(rmb.unwrap_or(0), Ordering::Relaxed);
        self.1.store(snd.unwrap_or(0), Ordering::Relaxed);
    }
}

/// What [`crate::set_buffer_sizes`] asked for.
pub(crate) static ASKED: Asked = Asked::new();

/// A client connection's start in `ep` ([`Endpoint::connect`]) with the
/// buffer sizes asked for it (`ask`), else those this process asked for.
pub(crate) fn connect_in(ep: &mut Endpoint<AnyProvider>, local: IpAddr, ask: Bufs) -> ConnId {
    let id = ep.connect(local, now());
    sized(ep, id, ask);
    id
}

/// A server connection's start in `ep` ([`Endpoint::accept`]), likewise.
pub(crate) fn accept_in(ep: &mut Endpoint<AnyProvider>, local: IpAddr, ask: Bufs) -> ConnId {
    let id = ep.accept(local, now());
    sized(ep, id, ask);
    id
}

/// Gives connection `id` the sizes `ask` names, the process's for the rest.
fn sized(ep: &mut Endpoint<AnyProvider>, id: ConnId, ask: Bufs) {
    let (rmb, snd) = ASKED.get();
    let (rmb, snd) = (ask.0.or(rmb), ask.1.or(snd));
    if rmb.is_some() || snd.is_some() {
        ep.set_buffer_sizes(id, rmb, snd);
    }
}

/// This process's devices and endpoints; `None` in a process forked more
/// than `fork::MAX_GENERATIONS` deep (its connections use TCP).
fn context() -> Option<&'static Context> {
    CONTEXT.get_or_init(|| {
        // shm devices are declared in the file named by SMC_RDMA_SHM_CONFIG,
        // verbs devices are whatever libibverbs finds; without either this
        // process has no SMC device and its connections decline.
        let provider = AnyProvider::from_env();
        let (instance, lock) =
            crate::sysid::allocate(provider.shm().map(|p| p.config().rundir.as_path()));
        Context {
            provider,
            instance,
            _instance_lock: lock,
            endpoints: Mutex::new(HashMap::new()),
            selection: Mutex::new(HashMap::new()),
            addrs: Mutex::new(None),
        }
    })
}

/// This process's system ID with the MAC of the port it speaks for (every
/// endpoint's, and that of the Declines sent without one).
pub(crate) fn system_id(mac: Mac) -> SystemId {
    SystemId::new(context().map_or(0, |c| c.instance), mac)
}

/// Default size of a connection's RMB (4 MiB) while the endpoint's
/// connections hold no more than [`RMB_BUDGET`] of RMBs. A one-way stream
/// with a smaller one waits for consumer-cursor CDCs more often (at 64 KiB,
/// one round trip for every 32 KiB), and with an RMB no larger than a core's
/// L2 cache its copies cost more per byte (most likely because the lines the
/// writer stores into were just read into the reader's cache).
/// `smc-bench --only bulk` with `SMC_RMB_KIB` compares sizes. An idle
/// connection's buffers are memory mappings that take pages only where data
/// went through, and they are reused for the next connection of the link
/// group. `SMC_RMB_KIB` / `SMC_SNDBUF_KIB` set other sizes for every
/// connection (the analogue of Linux's `net.smc.rmem` / `wmem`).
const DEFAULT_RMB: usize = 4 << 20;

/// RMB bytes an endpoint's connections may hold before a new one gets a
/// [`CROWDED_RMB`]: two default RMBs, so that a program's second connection
/// (iperf3's data connection after its control connection, a stream each
/// way) still streams at full speed.
const RMB_BUDGET: usize = 2 * DEFAULT_RMB;

/// The RMB of a connection that joins others holding [`RMB_BUDGET`] or more:
/// the largest Linux gives an SMC-R connection (`net.smc.rmem`,
/// Documentation/networking/smc-sysctl.rst). Request/response over many
/// connections then copies through rings that stay in the caches together,
/// where 4 MiB rings each send every message's copies to memory.
const CROWDED_RMB: usize = 512 << 10;

/// Default size of each connection's send buffer (1 MiB): it holds only
/// what cannot go straight into the peer's RMB yet (`Endpoint::write`).
const DEFAULT_SNDBUF: usize = 1 << 20;

/// The RMB size of this process's connections.
fn rmb_len() -> usize {
    buf_len("SMC_RMB_KIB", DEFAULT_RMB)
}

/// Above how many bytes of RMBs held a new connection gets the smaller RMB,
/// and that RMB (`smc_engine::endpoint::RmbCrowding`); none when
/// `SMC_RMB_KIB` fixes every connection's size.
fn rmb_crowding() -> Option<RmbCrowding> {
    if std::env::var_os("SMC_RMB_KIB").is_some() {
        return None;
    }
    Some(RmbCrowding {
        budget: buf_len("SMC_RMB_BUDGET_KIB", RMB_BUDGET),
        len: buf_len("SMC_RMB_CROWDED_KIB", CROWDED_RMB),
    })
}

/// The send buffer size of this process's connections.
fn sndbuf_len() -> usize {
    buf_len("SMC_SNDBUF_KIB", DEFAULT_SNDBUF)
}

/// Buffer size from `var` (KiB), else `default`.
fn buf_len(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .map_or(default, |k| k << 10)
}

/// The interface that owns `local`, or whose prefix covers it (all of
/// 127.0.0.0/8 is lo's, though only 127.0.0.1 is configured), with all of that
/// interface's addresses: what the CLC prefix rules compare.
/// `Err`: the interface list could not be read (out of descriptors or
/// memory).
#[allow(clippy::type_complexity)]
pub(crate) fn interface_of(local: IpAddr) -> io::Result<Option<(String, Vec<IfAddr>)>> {
    let addrs = smc_rdma::sys::interface_addrs()?;
    let local = match local {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(local, IpAddr::V4),
        v4 => v4,
    };
    let covers = |a: &smc_rdma::sys::InterfaceAddr| match (a.addr, local) {
        (IpAddr::V4(n), IpAddr::V4(l)) => {
            let m = u32::MAX
                .checked_shl(32 - u32::from(a.prefix_len.min(32)))
                .unwrap_or(0);
            u32::from(n) & m == u32::from(l) & m
        }
        (IpAddr::V6(n), IpAddr::V6(l)) => {
            let m = u128::MAX
                .checked_shl(128 - u32::from(a.prefix_len.min(128)))
                .unwrap_or(0);
            u128::from(n) & m == u128::from(l) & m
        }
        _ => false,
    };
    let Some(found) = addrs
        .iter()
        .find(|a| a.addr == local)
        .or_else(|| addrs.iter().find(|a| covers(a)))
    else {
        return Ok(None);
    };
    let ifname = found.ifname.clone();
    let if_addrs = addrs
        .iter()
        .filter(|a| a.ifname == ifname)
        .map(|a| IfAddr {
            addr: a.addr,
            prefix_len: a.prefix_len,
        })
        .collect();
    Ok(Some((ifname, if_addrs)))
}

/// The device for a connection, as [`endpoint_for`] found it.
pub(crate) enum Device {
    /// The endpoint of the device serving the connection's interface.
    Endpoint(Arc<Shared>),
    /// (Server) Only a shared-memory device serves the connection, and the
    /// client's address is not one of our network namespace: the device
    /// serves it only if the client turns out to be on this host. Ask
    /// [`shm_reaches`] once the client's first CLC bytes are there (it
    /// opened its device before sending them), before the handshake starts
    /// on the endpoint; if not, decline as without a device.
    IfOnHost(Arc<Shared>),
    /// No SMC device serves it: decline "no SMC device" (or what the prefix
    /// rules say).
    None,
    /// The selection could not be made now (out of descriptors or memory,
    /// the device failed to open): decline with "insufficient resources"
    /// (Linux's SMC_CLC_DECL_MEM), and look again for the next connection.
    Unavailable,
}

/// Which end of the connection asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// The connecting side: it must decide before its Proposal.
    Client,
    /// The accepting side: it may wait for the client's first bytes.
    Server,
}

/// A device port that may serve connections from one local address
/// ([`smc_config::pnet::candidates`]), with its provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) device: String,
    pub(crate) kind: Kind,
    /// The port has a RoCE v1 GID (SMC-R v1 may be offered).
    pub(crate) roce_v1: bool,
    /// The port has a RoCE v2 GID (SMC-R v2 may be offered).
    pub(crate) roce_v2: bool,
}

/// The candidates for one local address, in the kernel's order, and what an
/// endpoint opened for one of them is configured with.
struct Choice {
    candidates: Vec<Candidate>,
    /// (kind, candidate, alternate): the devices that may carry a v2 group's
    /// further link when the group's first is on the candidate's.
    v2_alternates: Vec<(Kind, String, String)>,
    base: String,
    if_addrs: Vec<IfAddr>,
    ueids: Vec<smc_wire::types::Eid>,
}

/// Which candidate a connection uses (see [`pick`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pick<'a> {
    /// This one.
    Use(&'a Candidate),
    /// This shared-memory device, if the peer is on this host after all
    /// (see [`shm_reaches`]).
    IfOnHost(&'a Candidate),
    /// None.
    Nothing,
}

/// Chooses among the candidates of a connection's local address. The kernel
/// takes the first (smc_pnet.c `smc_pnet_find_roce_by_pnetid`); a
/// shared-memory device, though, serves only peers on this host (it is
/// reached through the rundir, never through the wire), so when the peer's
/// address is not one of our network namespace the first device of another
/// provider is taken, and a shared-memory device only once the peer is
/// known to be on this host.
pub(crate) fn pick(candidates: &[Candidate], peer_in_namespace: bool) -> Pick<'_> {
    if peer_in_namespace {
        return candidates.first().map_or(Pick::Nothing, Pick::Use);
    }
    if let Some(c) = candidates.iter().find(|c| c.kind != Kind::Shm) {
        return Pick::Use(c);
    }
    candidates.first().map_or(Pick::Nothing, Pick::IfOnHost)
}

/// The endpoint for a connection from `local` to `peer` (see [`Device`]).
pub(crate) fn endpoint_for(local: IpAddr, peer: IpAddr, role: Role) -> Device {
    let Some(ctx) = context() else {
        return Device::None;
    };
    let Ok(choice) = choice_for(ctx, local) else {
        return Device::Unavailable;
    };
    let Some(choice) = choice else {
        return Device::None;
    };
    let Ok(peer_here) = in_namespace(ctx, peer) else {
        return Device::Unavailable;
    };
    let (cand, if_on_host) = match pick(&choice.candidates, peer_here) {
        Pick::Use(c) => (c, false),
        Pick::IfOnHost(c) => (c, true),
        Pick::Nothing => return Device::None,
    };
    // A client decides now: its Proposal would name the device. (The
    // server's endpoint is open by now if it listens on this host: a
    // listener opens its shared-memory devices when it is bound.)
    if if_on_host && role == Role::Client && !shm_reaches(peer) {
        return Device::None;
    }
    match endpoint_of(ctx, &choice, cand) {
        Ok(s) if if_on_host && role == Role::Server => Device::IfOnHost(s),
        Ok(s) => Device::Endpoint(s),
        Err(()) => Device::Unavailable,
    }
}

/// Opens the shared-memory devices that serve connections to `addr` (every
/// address of our network namespace if it is unspecified), for a listener
/// bound there: a device registers the GIDs of its interface in the rundir
/// when it is opened, and a client in another network namespace of this
/// host proposes over its own shared-memory device only once the server's
/// address is registered there (see [`shm_reaches`]), which without this
/// would wait for the listener's first connection. Failures are left for
/// the connections to meet.
pub(crate) fn open_devices_for_listener(addr: IpAddr) {
    let Some(ctx) = context() else {
        return;
    };
    let locals: Vec<IpAddr> = if addr.is_unspecified() {
        let Ok(all) = smc_rdma::sys::interface_addrs() else {
            return;
        };
        let mut seen = std::collections::HashSet::new();
        all.into_iter()
            .filter(|a| seen.insert(a.ifname.clone()))
            .map(|a| a.addr)
            .collect()
    } else {
        vec![addr]
    };
    for local in locals {
        if let Ok(Some(choice)) = choice_for(ctx, local) {
            for c in choice.candidates.iter().filter(|c| c.kind == Kind::Shm) {
                let _ = endpoint_of(ctx, &choice, c);
            }
        }
    }
}

/// How long a device choice for a local address, and the list of this
/// namespace's addresses, are reused.
const SELECTION_TTL: Duration = Duration::from_secs(1);

/// The candidates for `local`, kept for [`SELECTION_TTL`]: device selection
/// reads the pnet and UEID tables, the interface list (netlink) and the
/// ports, and a connection-per-request client would redo that for every
/// connection (a changed table or port state takes effect within that
/// second). `Ok(None)`: no device serves `local`; `Err`: it could not be
/// found out now (not kept: the next connection looks again).
fn choice_for(ctx: &Context, local: IpAddr) -> Result<Option<Arc<Choice>>, ()> {
    let mut cache = ctx.selection.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, choice)) = cache.get(&local) {
        if at.elapsed() < SELECTION_TTL {
            return Ok(choice.clone());
        }
    }
    let choice = find_candidates(ctx, local)?.map(Arc::new);
    cache.insert(local, (Instant::now(), choice.clone()));
    Ok(choice)
}

fn find_candidates(ctx: &Context, local: IpAddr) -> Result<Option<Choice>, ()> {
    let Some((ifname, if_addrs)) = interface_of(local)
        .map_err(|e| crate::registry::error("interfaces", format!("interface list: {e}")))?
    else {
        return Ok(None);
    };
    let devices = ctx
        .provider
        .devices_by_kind()
        .map_err(|e| crate::registry::error("devices", format!("device list: {e}")))?;
    if devices.is_empty() {
        return Ok(None);
    }
    let base = base_netdev(Path::new("/sys/class/net"), &ifname);
    let dir = ConfigDir::from_env();
    let pnet = PnetTable::load(&dir).unwrap_or_default();
    let ueids = UeidTable::load(&dir)
        .map(|t| t.eids().to_vec())
        .unwrap_or_default();
    let local4 = match local {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    };
    let route = Route {
        base_netdev: &base,
        // SMC-R v2 needs a UEID, and Linux 6.12 offers it over IPv4 only
        // (af_smc.c `smc_find_proposal_devices`)
        v2_gid: local4
            .filter(|_| !ueids.is_empty())
            .map(smc_wire::types::Gid::from_ipv4),
    };
    let ports: Vec<(Kind, PortInfo)> = devices
        .into_iter()
        .flat_map(|(kind, d)| {
            // The engine drives port 1 of its device (RoCE RNICs show each
            // port as a device of its own: mlx5_0, mlx5_1): other ports are
            // no candidates.
            d.ports
                .into_iter()
                .filter(|p| p.port_num == 1)
                .map(move |p| {
                    let v2 = |g: &&smc_rdma::GidEntry| g.gid_type == GidType::RoceV2;
                    (
                        kind,
                        PortInfo {
                            device: d.name.clone(),
                            port: p.port_num,
                            netdev: p.netdev.clone(),
                            active: p.state == PortState::Active,
                            roce_v1: p.gids.iter().any(|g| g.gid_type == GidType::RoceV1),
                            roce_v2: p.gids.iter().filter(v2).map(|g| g.gid).collect(),
                        },
                    )
                })
        })
        .collect();
    let infos: Vec<PortInfo> = ports.iter().map(|(_, p)| p.clone()).collect();
    let candidates: Vec<Candidate> = candidates(&pnet, &route, &infos)
        .iter()
        .filter_map(|sel| {
            let (device, port) = sel.port();
            ports
                .iter()
                .find(|(_, p)| p.device == device && p.port == port)
        })
        .map(|(kind, p)| Candidate {
            device: p.device.clone(),
            kind: *kind,
            roce_v1: p.roce_v1,
            roce_v2: !p.roce_v2.is_empty(),
        })
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    // each candidate's alternate devices for a v2 group (another device on
    // the group's subnet, see `smc_config::pnet::v2_alternates`)
    let prefix = local4.and_then(|l| {
        if_addrs
            .iter()
            .find(|a| a.addr == IpAddr::V4(l))
            .map(|a| (l, a.prefix_len))
    });
    let mut v2_alternates = Vec::new();
    for c in candidates.iter().filter(|c| c.roce_v2) {
        let Some((l, len)) = prefix.filter(|_| route.v2_gid.is_some()) else {
            break;
        };
        for (d, _) in smc_config::pnet::v2_alternates(&pnet, (&c.device, 1), l, len, &infos) {
            if let Some((k, _)) = ports.iter().find(|(k, p)| *k == c.kind && p.device == d) {
                v2_alternates.push((*k, c.device.clone(), d));
            }
        }
    }
    Ok(Some(Choice {
        candidates,
        v2_alternates,
        base,
        if_addrs,
        ueids,
    }))
}

/// Whether link groups add a second link by ADD_LINK (`SMC_REDUNDANCY=1`;
/// off by default): an endpoint then opens the next device of its
/// address's candidates (another port of the same PNET ID), or for SMC-R
/// v2 another device on the address's subnet, as its second device, on
/// which the further link goes (see `Endpoint::set_redundancy`,
/// `Endpoint::open_second_device`).
pub fn redundancy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMC_REDUNDANCY").is_ok_and(|v| v.trim() == "1"))
}

/// The endpoint of `cand`'s device, opened now if this process has none yet.
fn endpoint_of(ctx: &Context, choice: &Choice, cand: &Candidate) -> Result<Arc<Shared>, ()> {
    let device = cand.device.as_str();
    let mut eps = ctx.endpoints.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = eps.get(device) {
        return Ok(s.clone());
    }
    // (from our network namespace: /sys/class/net may belong to another one)
    let mac = smc_rdma::sys::link(&choice.base)
        .ok()
        .flatten()
        .and_then(|l| l.mac)
        .map(Mac)
        .unwrap_or_default();
    let cfg = EndpointConfig {
        system_id: SystemId::new(ctx.instance, mac),
        device: device.to_string(),
        // SMC-R v1 needs a RoCE v1 GID, v2 a RoCE v2 GID and a UEID
        // (smc_pnet.c `smc_pnet_determine_gid`, af_smc.c
        // `smc_find_proposal_devices`)
        offer_v2: !choice.ueids.is_empty() && cand.roce_v2,
        ueids: choice.ueids.clone(),
        offer_v1: cand.roce_v1,
        if_addrs: choice.if_addrs.clone(),
        rmb_len: rmb_len(),
        rmb_crowding: rmb_crowding(),
        sndbuf_len: sndbuf_len(),
        testlink: Some(Duration::from_secs(30)),
        max_conns: 255,
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        lgr_idle_timeout: Duration::from_secs(600),
    };
    let mut ep = Endpoint::new(&ctx.provider, cfg)
        .map_err(|e| crate::registry::error("endpoint_open", format!("device {device}: {e}")))?;
    if redundancy() {
        // The alternate device: the next candidate of the same provider for
        // this address, i.e. another port in the interface's PNET ID (Linux
        // smc_llc.c `smc_llc_find_alt_link`, smc_pnet.c: an alternate
        // device of the link group's PNET ID). Without one, further links
        // share this device's port.
        // Or, for SMC-R v2 groups, a device on the group's IP subnet (Linux
        // smc_ib.c `smc_ib_determine_gid_rcu`: a v2 group's alternate GID
        // must be on the subnet of its source address).
        let alt = choice
            .candidates
            .iter()
            .find(|c| c.kind == cand.kind && c.device != cand.device)
            .map(|c| c.device.as_str())
            .or_else(|| {
                choice
                    .v2_alternates
                    .iter()
                    .find(|(k, first, _)| *k == cand.kind && *first == cand.device)
                    .map(|(_, _, alt)| alt.as_str())
            });
        let alternate = alt.is_some_and(|alt| match ep.open_second_device(&ctx.provider, alt) {
            Ok(()) => true,
            Err(e) => {
                crate::registry::error(
                    "endpoint_open",
                    format!("second device {alt} of {device}: {e}"),
                );
                false
            }
        });
        ep.set_redundancy(smc_proto::link::Redundancy {
            enabled: true,
            alternate,
        });
    }
    // QPs of added links connect on threads of their own, not under the
    // endpoint's lock (`Shared::start_bringups`)
    ep.set_hand_out_bringups(true);
    let shared =
        Arc::new(Shared::new(ep).map_err(|e| {
            crate::registry::error("endpoint_open", format!("device {device}: {e}"))
        })?);
    let _ = shared.me.set(Arc::downgrade(&shared));
    // Control traffic nobody waits for (LLC requests, keepalives, the final CDCs
    // of released connections) is handled by a small progress thread; data moves
    // in the application's threads.
    let weak = Arc::downgrade(&shared);
    std::thread::Builder::new()
        .name(format!("smc-progress-{device}"))
        .spawn(move || progress_loop(weak))
        .map_err(|e| {
            crate::registry::error("thread_start", format!("progress thread of {device}: {e}"))
        })?;
    eps.insert(device.to_string(), shared.clone());
    Ok(shared)
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn unmapped(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether `addr` is an address of our network namespace: a loopback
/// address, or one assigned to one of its interfaces (read at most every
/// [`SELECTION_TTL`]). `Err`: the interface list could not be read.
fn in_namespace(ctx: &Context, addr: IpAddr) -> Result<bool, ()> {
    let addr = unmapped(addr);
    if addr.is_loopback() {
        return Ok(true);
    }
    let mut cache = ctx.addrs.lock().unwrap_or_else(|e| e.into_inner());
    let list = match &*cache {
        Some((at, list)) if at.elapsed() < SELECTION_TTL => list.clone(),
        _ => {
            let list: Arc<Vec<IpAddr>> = Arc::new(
                smc_rdma::sys::interface_addrs()
                    .map_err(|_| ())?
                    .into_iter()
                    .map(|a| a.addr)
                    .collect(),
            );
            *cache = Some((Instant::now(), list.clone()));
            list
        }
    };
    Ok(list.contains(&addr))
}

/// Whether this process's shared-memory devices can reach a peer at
/// `peer`, i.e. whether the peer is on this host: `peer` is an address of
/// our network namespace, or a shared-memory device whose interface has
/// that address is registered in our rundir (every shm device registers
/// the GIDs of its interface's addresses there when it is opened, see
/// `smc_rdma::shm::registry`). The second covers processes in other network
/// namespaces of this host that share the rundir (what the shm device
/// needs to reach them); a peer on another machine never has its address
/// there.
pub(crate) fn shm_reaches(peer: IpAddr) -> bool {
    let Some(ctx) = context() else {
        return false;
    };
    if in_namespace(ctx, peer).unwrap_or(false) {
        return true;
    }
    ctx.provider.shm().is_some_and(|p| {
        registered_in_rundir(
            &p.config().rundir,
            &smc_wire::types::Gid::from_ip(unmapped(peer)),
        )
    })
}

/// Whether the shm rundir `dir` has a device registered under `gid`:
/// an entry `gid-<hex>.<instance>` (or the single-owner `gid-<hex>`), the
/// names `smc_rdma::shm::registry` documents.
fn registered_in_rundir(dir: &Path, gid: &smc_wire::types::Gid) -> bool {
    let name = format!("gid-{}", gid.to_hex());
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    rd.flatten().any(|e| {
        let n = e.file_name();
        let n = n.to_string_lossy();
        n.strip_prefix(name.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(device: &str, kind: Kind) -> Candidate {
        Candidate {
            device: device.into(),
            kind,
            roce_v1: true,
            roce_v2: true,
        }
    }

    /// Which candidate a connection takes, by where its peer is: the
    /// kernel's first, except that a shared-memory device never serves a
    /// peer elsewhere.
    #[test]
    fn a_shared_memory_device_only_for_peers_of_this_host() {
        let shm = cand("shm-eth0", Kind::Shm);
        let shm2 = cand("shm-eth0b", Kind::Shm);
        let rxe = cand("rxe0", Kind::Verbs);
        let mlx = cand("mlx5_0", Kind::Verbs);
        // (candidates, peer in our namespace, expected)
        let rows: Vec<(Vec<&Candidate>, bool, Pick<'_>, &str)> = vec![
            (
                vec![&shm, &rxe],
                true,
                Pick::Use(&shm),
                "local peer: the first",
            ),
            (
                vec![&rxe, &shm],
                true,
                Pick::Use(&rxe),
                "local peer: the first",
            ),
            (
                vec![&shm, &rxe],
                false,
                Pick::Use(&rxe),
                "peer elsewhere: not shm",
            ),
            (
                vec![&shm, &rxe, &mlx],
                false,
                Pick::Use(&rxe),
                "the first that is not shm",
            ),
            (vec![&mlx], false, Pick::Use(&mlx), "verbs serves any peer"),
            (vec![&shm], true, Pick::Use(&shm), "local peer over shm"),
            (
                vec![&shm, &shm2],
                false,
                Pick::IfOnHost(&shm),
                "only shm: if on this host",
            ),
            (vec![], true, Pick::Nothing, "no candidates"),
            (vec![], false, Pick::Nothing, "no candidates"),
        ];
        for (cands, here, want, why) in rows {
            let cands: Vec<Candidate> = cands.into_iter().cloned().collect();
            let got = pick(&cands, here);
            // (compared by device: `want` borrows the rows' candidates)
            let name = |p: Pick<'_>| match p {
                Pick::Use(c) => format!("use {}", c.device),
                Pick::IfOnHost(c) => format!("if on host {}", c.device),
                Pick::Nothing => "nothing".into(),
            };
            assert_eq!(name(got), name(want), "{why}");
        }
    }

    /// A peer address is of this host for the shm device when a device of
    /// our rundir registered its GID (`gid-<hex>.<instance>`, or the
    /// single-owner `gid-<hex>`), and only then.
    #[test]
    fn the_rundir_says_which_addresses_are_of_this_host() {
        let dir = std::env::temp_dir().join(format!("smc-ctx-rundir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gid = |a: &str| smc_wire::types::Gid::from_ip(a.parse().unwrap());
        let (a, b, c) = (gid("10.0.0.1"), gid("10.0.0.2"), gid("10.0.0.3"));
        assert!(!registered_in_rundir(&dir, &a), "empty rundir");
        std::fs::write(dir.join(format!("gid-{}.dev-x-1-0-ab", a.to_hex())), "").unwrap();
        std::fs::write(dir.join(format!("gid-{}", b.to_hex())), "").unwrap();
        // a longer name that only starts like c's is not c's entry
        std::fs::write(dir.join(format!("gid-{}00.dev", c.to_hex())), "").unwrap();
        assert!(registered_in_rundir(&dir, &a));
        assert!(registered_in_rundir(&dir, &b));
        assert!(!registered_in_rundir(&dir, &c));
        assert!(!registered_in_rundir(&dir.join("missing"), &a));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod spin_tests {
    use super::{Spin, SPIN_MISSES_OFF, SPIN_PROBE_EVERY, SPIN_PROBE_MAX};

    /// The waits (1-based) among the next `n` that may spin, each of which
    /// then has to sleep.
    fn spinning_waits(s: &Spin, n: u32) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 1..=n {
            let b = s.budget();
            if b.is_zero() {
                s.miss(b);
                continue;
            }
            out.push(i);
            s.miss(b);
        }
        out
    }

    /// Spinning stops after a run of waits that had to sleep anyway; the
    /// probes that look whether it pays again come less and less often
    /// while they miss, and a hit turns it back on.
    #[test]
    fn probes_that_miss_come_less_and_less_often() {
        let s = Spin::default();
        // on at first, off after SPIN_MISSES_OFF misses
        assert_eq!(
            spinning_waits(&s, SPIN_MISSES_OFF),
            (1..=SPIN_MISSES_OFF).collect::<Vec<_>>()
        );
        // then a probe every 32nd wait, 64th, 128th ...
        let probes = spinning_waits(&s, 32 + 64 + 128 + 256);
        assert_eq!(probes, vec![32, 96, 224, 480]);
        // ... never rarer than every SPIN_PROBE_MAX-th
        spinning_waits(&s, 4 * SPIN_PROBE_MAX);
        let late = spinning_waits(&s, 2 * SPIN_PROBE_MAX);
        assert_eq!(late.len(), 2, "{late:?}");
        assert_eq!(late[1] - late[0], SPIN_PROBE_MAX);
        // a probe that hits turns spinning on again
        let waits = (1..=SPIN_PROBE_MAX)
            .find(|_| !s.budget().is_zero())
            .expect("a probe");
        assert!(waits <= SPIN_PROBE_MAX);
        s.hit();
        assert_eq!(
            spinning_waits(&s, SPIN_MISSES_OFF),
            (1..=SPIN_MISSES_OFF).collect::<Vec<_>>(),
            "on again after a hit"
        );
        // and the next run of misses starts from probes every 32nd wait
        assert_eq!(spinning_waits(&s, SPIN_PROBE_EVERY), vec![SPIN_PROBE_EVERY]);
    }
}
