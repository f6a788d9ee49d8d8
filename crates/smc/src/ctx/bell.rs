//! A blocking reader's wait on its connection's doorbell
//! (docs/FAST-PATH.md, steps 5 and 6): the peer's CDC wakes that reader
//! alone, once, instead of the endpoint's leader and then a follower.

use super::spin::{max_spinners, SpinTurns};
use super::wait::{keep_woken, spare_woken, Waiter, Want};
use super::Shared;
use crate::provider::AnyProvider;
use smc_engine::endpoint::ConnId;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

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

impl Shared {
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
        let woken = spare_woken();
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
        let bell = fast.doorbell()?;
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
        let mut woken = self.bell_register(id, bell)?;
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
                match self.bell_register(id, bell) {
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
        keep_woken(woken);
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
}
