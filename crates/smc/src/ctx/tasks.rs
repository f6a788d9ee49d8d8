//! The tokio adapter's tasks waiting for an endpoint: woken by the pumps
//! that find their connection can go on, and one of them watching the
//! completion channel in its runtime's reactor (see `crate::tokio`).

use super::wait::Want;
use super::Shared;
use crate::provider::AnyProvider;
use smc_engine::endpoint::Endpoint;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

/// A task of the tokio adapter waiting (see [`Shared::wake_on_progress`]).
pub(super) struct TaskWait {
    /// What for (`None`: any progress of the endpoint).
    want: Option<Want>,
    waker: std::task::Waker,
}

impl Shared {
    /// Wakes the tasks whose connection can go on (`all`: every one), as
    /// [`Self::wake`] chooses the threads (called with the endpoint locked).
    pub(super) fn wake_tasks(&self, ep: &Endpoint<AnyProvider>, all: bool) {
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
    pub(crate) fn notify_dup(&self) -> io::Result<OwnedFd> {
        self.notify.try_clone()
    }
}
