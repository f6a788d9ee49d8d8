//! The process-wide SMC state: the provider (shm and libibverbs devices,
//! [`crate::provider`]), one endpoint per device shared by every connection
//! through it ([`Shared`]), and the choice of device for a connection.
//!
//! By concern:
//! - this file: an endpoint's shared state, its lock ([`Locked`]) and pump,
//!   the device's progress thread, and the process's devices and endpoints;
//! - `select`: which device and endpoint a connection uses;
//! - `wait`: threads that wait for an endpoint (the leader on the
//!   completion channel, parked followers);
//! - `bell`: a blocking reader's wait on its connection's doorbell;
//! - `spin`: whether and how a wait spins before it sleeps;
//! - `shown`: what each connection shows its waiters (readiness
//!   descriptors, the peer's signal);
//! - `tcp_watch`: the TCP ends of established connections, watched for a
//!   peer that is gone;
//! - `tasks`: the tokio adapter's waiting tasks;
//! - `bufs`: the buffer sizes asked for and the defaults.

mod bell;
mod bufs;
mod select;
mod shown;
mod spin;
#[cfg(feature = "tokio")]
mod tasks;
mod tcp_watch;
mod wait;

pub(crate) use bell::bells_on;
pub(crate) use bufs::{accept_in, connect_in, Asked, Bufs, ASKED};
pub use select::redundancy;
pub(crate) use select::{
    endpoint_for, interface_of, open_devices_for_listener, shm_reaches, Device, Role,
};
pub(crate) use shown::{shown_level, ConnReadiness, PeerSignal, GONE};
pub(crate) use spin::{may_spin, Spin};
pub(crate) use wait::Want;

use crate::provider::{AnyProvider, Kind};
use rustix::event::{epoll, PollFd, PollFlags, Timespec};
use select::Choice;
use smc_engine::endpoint::{ConnId, Endpoint};
use smc_proto::Timestamp;
use smc_wire::types::{Mac, SystemId};
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
#[cfg(feature = "tokio")]
use tasks::TaskWait;
use tcp_watch::Unwatched;
use wait::Waiter;

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
/// means to wait for it to make progress (`wait`, `bell`): a thread that
/// cannot go on pumps the endpoint for a short while
/// ([`spin_time`](spin::spin_time)), then sleeps. Of the sleeping threads
/// exactly one, the *leader*, arms the completion queues and sleeps in
/// `poll()` on the endpoint's completion channel; the others are parked until
/// a pump finds that their connection can go on, and a blocking reader sleeps
/// on its connection's doorbell, which the peer's CDC rings. While some
/// thread spins nobody is armed, so the peer posts without a system call and
/// nothing here makes one.
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
    /// such a move for a leader without one; waking the leader for it would
    /// be two context switches per connection (its wake-up and its sleep).
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

    /// The application changed a connection in a way its waiters must see
    /// and no pump reports (a `shutdown(SHUT_RD)` ends its reads): the
    /// threads and tasks that can go on now are woken (with the endpoint
    /// locked, as [`Self::pump`]).
    pub(crate) fn app_changed(&self, ep: &Endpoint<AnyProvider>) {
        if self.sleepers.load(Ordering::Acquire) > 0 {
            self.wake(ep, false);
        }
        #[cfg(feature = "tokio")]
        self.wake_tasks(ep, false);
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
    /// This network namespace's addresses, recently read (see
    /// [`in_namespace`](select::in_namespace)).
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
