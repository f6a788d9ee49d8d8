//! Threads that wait for an endpoint ([`Shared::run`]): a short bounded
//! spin, then sleep. Of the sleeping threads exactly one, the *leader*, arms
//! the completion queues and sleeps in `poll()` on the endpoint's completion
//! channel; the others are parked until a pump finds their connection can go
//! on ([`Waiter`]). The leader's sleep ends at the engine's next deadline,
//! which a call that moves it earlier kicks ([`Shared::kick_at`]).

use super::spin::{max_spinners, SpinTurns};
use super::tcp_watch::watches_tcp_ends;
use super::{
    drain_eventfd, fd_ready, nanos, origin, set_timer, timespec_until, Shared, LAZY_MAX, LAZY_MIN,
    NOBODY_SLEEPS,
};
use crate::provider::AnyProvider;
use rustix::event::{PollFd, PollFlags};
use smc_engine::endpoint::{ConnId, Endpoint};
use smc_proto::close::CloseState;
use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

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
pub(super) struct Waiter {
    pub(super) want: Want,
    pub(super) thread: std::thread::Thread,
    pub(super) woken: Arc<AtomicBool>,
    /// A reader that sleeps on its connection's doorbell (see
    /// [`Shared::bell_register`]) is woken by ringing it, not by unparking.
    pub(super) bell: Option<smc_rdma::Doorbell>,
}

impl Want {
    fn conn(self) -> ConnId {
        match self {
            Want::Read(id) | Want::Write(id) | Want::CloseSent(id) => id,
        }
    }

    pub(super) fn ready(self, ep: &Endpoint<AnyProvider>) -> bool {
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

thread_local! {
    /// The registration word of this thread's last wait ([`Waiter::woken`]:
    /// a doorbell wait's, `Shared::bell_register`, or a parked follower's),
    /// for its next one: a thread that sleeps at every message allocates it
    /// once, not at every wait.
    static SPARE_WOKEN: Cell<Option<Arc<AtomicBool>>> = const { Cell::new(None) };
}

/// A registration word, cleared: the spare one if nobody else holds it any
/// more (a pump that took the registration may still), else a new one.
pub(super) fn spare_woken() -> Arc<AtomicBool> {
    if let Some(mut a) = SPARE_WOKEN.try_with(Cell::take).ok().flatten() {
        if let Some(w) = Arc::get_mut(&mut a) {
            *w.get_mut() = false;
            return a;
        }
    }
    Arc::new(AtomicBool::new(false))
}

/// Keeps `woken` as this thread's spare (see [`spare_woken`]).
pub(super) fn keep_woken(woken: Arc<AtomicBool>) {
    let _ = SPARE_WOKEN.try_with(|s| s.set(Some(woken)));
}

impl Shared {
    pub(super) fn waiters(&self) -> MutexGuard<'_, Vec<Waiter>> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the parked threads whose connection can go on (`all`: every
    /// one). Called with the endpoint locked: the threads are unparked when
    /// it is released ([`Locked`](super::Locked)), as a woken thread's first step is to take
    /// that lock.
    pub(super) fn wake(&self, ep: &Endpoint<AnyProvider>, all: bool) {
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
    pub(super) fn unpark_chosen(&self) {
        if self.unparks.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut u = self.to_unpark.lock().unwrap_or_else(|e| e.into_inner());
        self.unparks.store(0, Ordering::Release);
        for t in u.drain(..) {
            t.unpark();
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

    /// Runs `op` on the endpoint until it returns `Some`: pump, try, spin for
    /// [`spin_time`](super::spin::spin_time), then sleep until completions
    /// arrive. `deadline` passed or `nonblocking` set: `WouldBlock`, as a
    /// socket with a timeout says.
    pub(crate) fn run<R>(
        &self,
        want: Want,
        deadline: Option<Instant>,
        nonblocking: bool,
        op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> io::Result<R> {
        self.run_until(want, move || deadline, nonblocking, op)
    }

    /// [`Self::run`] with its deadline worked out once the first try has
    /// failed (`deadline` is called then, and only then): an operation that
    /// succeeds at once reads no clock for a deadline it never needs.
    pub(crate) fn run_until<R>(
        &self,
        want: Want,
        deadline: impl FnOnce() -> Option<Instant>,
        nonblocking: bool,
        mut op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> io::Result<R> {
        let mut deadline_fn = Some(deadline);
        let mut deadline = None;
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
            if let Some(f) = deadline_fn.take() {
                deadline = f();
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
                // (Sleeping waiters count too: the one awake thread that
                // spins while the others sleep holds the core their peers'
                // answers and their own wake-ups need. The price: a process
                // with a thread parked in a read, a dedicated reader, does
                // not spin in other waits.)
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

    /// Threads registered as waiting (parked, or asleep on a doorbell).
    #[cfg(test)]
    pub(crate) fn sleepers(&self) -> usize {
        self.sleepers.load(Ordering::Acquire)
    }

    /// `sleepers` and `parked` after a change of the waiters (with them
    /// locked).
    pub(super) fn count_waiters(&self, w: &[Waiter], order: Ordering) {
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
    pub(super) fn has_waiters(&self) -> bool {
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

    /// Sleeps until completions arrive after `seen` (the leader) or `want` can
    /// be met (a follower), the caller's `deadline`, or the engine's next
    /// deadline (the leader looks when it arms, and is kicked if it moves
    /// earlier while it sleeps; a follower looks before it parks; `next`: as
    /// the caller saw it, if it did).
    /// Returns whether this thread slept as the leader.
    pub(super) fn sleep(
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
            let woken = spare_woken();
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
            keep_woken(woken);
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
    pub(super) fn kick_lazy(&self) {
        if self.lazy.load(Ordering::SeqCst) {
            self.kick_at(0);
        }
    }

    /// Makes the sleeping leader, if there is one, wake at engine time `at`
    /// (nanoseconds; 0: now) if that is before the time it sleeps until.
    pub(super) fn kick_at(&self, at: u64) {
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
    pub(super) fn hand_over(&self) {
        let vacant = !*self.leader.lock().unwrap_or_else(|e| e.into_inner());
        if vacant && self.sleepers.load(Ordering::Acquire) > 0 {
            self.wake_one();
        }
    }
}
