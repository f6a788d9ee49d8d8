//! Completion queues and channels: [`ShmCq`] holds work completions and,
//! when polled, makes progress on its QPs (there is no data-path thread);
//! an armed CQ signals its [`ShmChannel`], an eventfd, at its next
//! completion (the verbs `ibv_req_notify_cq` / `ibv_get_cq_event` pair).
//!
//! One arm, one event, as `ibv_req_notify_cq` has it. The event of an arm
//! can be raised in two places: by the peer, which sees the notify word we
//! set in a ring (`R_RX_NOTIFY` in ours, `R_TX_NOTIFY` in its) and swaps it
//! to 0 before it writes our eventfd, or here, when a poll of ours moves a
//! completion into the queue. Whoever swaps a word first tells the sleeper;
//! a completion pushed here signals only when no word of its QP was taken
//! (see [`CqInner::push`]), so a peer's wake-up is not followed by a second
//! one of our own for the same arm.

use super::lock;
use super::qp::{QpInner, Stage};
use super::qp_progress::slot_taken;

use super::layout::*;
use crate::sys::{EventFd, SharedMem};
use crate::verbs::*;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering::{Acquire, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub(super) struct CqInner {
    /// Completions queued (only through [`Self::push_as`] and
    /// [`ShmCq::poll`], which keep [`Self::queued`]).
    pub(super) entries: Mutex<VecDeque<WorkCompletion>>,
    /// How many `entries` holds, written with its lock held: a look without
    /// the lock (`QpInner::recv_may_have`, `ShmCq::may_have_work`).
    pub(super) queued: AtomicUsize,
    pub(super) armed: AtomicBool,
    pub(super) chan: Option<Arc<EventFd>>,
    pub(super) qps: Mutex<Vec<Weak<QpInner>>>,
    /// The notify words the last `req_notify` set to 1, by QP number: a
    /// word found 0 again means that QP's peer took the arm's event and
    /// signalled the channel itself.
    pub(super) claims: Mutex<Vec<Claim>>,
}

/// A ring notify word a peer swaps to 0 when it signals us (see the module
/// documentation).
pub(super) struct Claim {
    qpn: u32,
    ring: Arc<SharedMem>,
    word: usize,
}

impl CqInner {
    /// Queues `wc`; signals the channel if the CQ is armed and the event of
    /// the arm has not been raised yet. A completion after an arm therefore
    /// wakes the sleeper exactly once: here, or by the peer of its QP that
    /// took the word first (it signals right after its swap). Only the
    /// words of `wc`'s own QP are looked at, so a peer that clears its words
    /// without signalling can hold back the wake-ups of its own link's
    /// messages, which it could withhold anyway, and no other QP's; a QP's
    /// failure signals regardless (`QpInner::fail_locked`).
    pub(super) fn push(&self, wc: WorkCompletion) {
        self.push_as(false, wc)
    }

    /// Queues `wc` as [`Self::push`] does, or, `rang`: a SEND for which the
    /// peer rang a doorbell instead of signalling us, without raising the
    /// arm's event (the next completion does).
    pub(super) fn push_as(&self, rang: bool, wc: WorkCompletion) {
        if rang {
            self.queue(wc);
            return;
        }
        let qpn = wc.qp_num;
        self.queue(wc);
        if self.armed.swap(false, SeqCst) {
            // (taken: the arm is spent, and its rings need not stay mapped)
            let claims = std::mem::take(&mut *lock(&self.claims));
            let mut told = false;
            for c in claims.iter().filter(|c| c.qpn == qpn) {
                // (swapped in any case: the word's peer must not signal again)
                told |= Ring(&c.ring).h(c.word).swap(0, SeqCst) == 0;
            }
            if !told {
                self.signal();
            }
        }
    }

    /// Appends `wc` to the entries.
    fn queue(&self, wc: WorkCompletion) {
        let mut e = lock(&self.entries);
        e.push_back(wc);
        self.queued.store(e.len(), SeqCst);
    }

    /// Signals the channel, armed or not.
    pub(super) fn signal(&self) {
        if let Some(c) = &self.chan {
            c.signal();
        }
    }
}

/// A completion queue. Polling it also makes progress on its QPs.
pub struct ShmCq {
    pub(super) inner: Arc<CqInner>,
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
        self.inner.queued.store(e.len(), SeqCst);
        Ok(n)
    }

    /// Looks without progressing: completions queued, a QP busy elsewhere, a
    /// SEND of the peer waiting in our ring for a posted receive, the peer
    /// having consumed (ACKed or refused) one of ours since the send queue
    /// last looked, or a SEND of ours still queued or waiting for a receive
    /// credit (RNR retries are timed). Spinning on this instead of polling
    /// spares the locks and clock reads of a whole progress pass.
    fn may_have_work(&self) -> bool {
        if self.inner.queued.load(SeqCst) > 0 {
            return true;
        }
        let qps = lock(&self.inner.qps);
        for qp in qps.iter().filter_map(Weak::upgrade) {
            // (a failure the device thread could not apply: the next
            // progress does, and flushes what is outstanding)
            if qp.fail_pending.load(std::sync::atomic::Ordering::Acquire) {
                return true;
            }
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

    /// Sets the notify words of the CQ's QPs, records them, then arms: a
    /// completion pushed before `armed` is set signals nobody (the caller
    /// polls after arming, as with verbs), and a push after it finds the
    /// words of this arm (never a stale 0 of an earlier one, which it would
    /// take for a peer's signal).
    fn req_notify(&self) -> Result<()> {
        let qps: Vec<Arc<QpInner>> = lock(&self.inner.qps)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut claims = Vec::with_capacity(qps.len());
        for qp in qps {
            let c = lock(&qp.core);
            if Arc::ptr_eq(&qp.recv_cq, &self.inner) {
                Ring(&c.ring).h(R_RX_NOTIFY).store(1, SeqCst);
                claims.push(Claim {
                    qpn: qp.qpn,
                    ring: c.ring.clone(),
                    word: R_RX_NOTIFY,
                });
            }
            if Arc::ptr_eq(&qp.send_cq, &self.inner) {
                if let Some(l) = &c.link {
                    Ring(&l.peer_ring).h(R_TX_NOTIFY).store(1, SeqCst);
                    claims.push(Claim {
                        qpn: qp.qpn,
                        ring: l.peer_ring.clone(),
                        word: R_TX_NOTIFY,
                    });
                }
            }
        }
        // (not under a QP's lock: `push` takes this one under it)
        *lock(&self.inner.claims) = claims;
        self.inner.armed.store(true, SeqCst);
        Ok(())
    }
}

/// A completion channel: an eventfd that peers in other processes signal too.
pub struct ShmChannel {
    pub(super) inner: Arc<EventFd>,
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
