//! Completion queues and channels: [`ShmCq`] holds work completions and,
//! when polled, makes progress on its QPs (there is no data-path thread);
//! an armed CQ signals its [`ShmChannel`], an eventfd, at its next
//! completion (the verbs `ibv_req_notify_cq` / `ibv_get_cq_event` pair).

use super::lock;
use super::qp::{QpInner, Stage};
use super::qp_progress::slot_taken;

use super::layout::*;
use crate::sys::EventFd;
use crate::verbs::*;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, SeqCst};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub(super) struct CqInner {
    pub(super) entries: Mutex<VecDeque<WorkCompletion>>,
    pub(super) armed: AtomicBool,
    pub(super) chan: Option<Arc<EventFd>>,
    pub(super) qps: Mutex<Vec<Weak<QpInner>>>,
}

impl CqInner {
    pub(super) fn push(&self, wc: WorkCompletion) {
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
