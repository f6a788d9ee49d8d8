//! A QP's errors: moving to ERR (the first outstanding WR gets the error,
//! the others flush, as verbs specifies), marking both rings closed so the
//! peer notices, raising `QpFatal`, and letting go of everything the link
//! holds. The device thread fails a QP without waiting for a busy data path.

use super::qp::{send_opcode, wc, Core, PostedRecv, QpInner, Stage};
use super::{lock, lock_within};

use super::layout::*;
use crate::verbs::*;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

impl QpInner {
    /// Moves to ERR: the first outstanding WR gets `first` (if any), all
    /// others flush. Marks both rings closed so the peer notices.
    pub(super) fn fail(&self, first: Option<WcStatus>, event: bool) {
        let mut c = lock(&self.core);
        self.fail_locked(&mut c, first, event);
    }

    /// [`QpInner::fail`] from the device thread, which must not wait for a
    /// busy `core`: then the data path (at its next poll) or the next tick
    /// does it.
    pub(super) fn fail_async(&self, first: Option<WcStatus>, event: bool) {
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

    pub(super) fn fail_locked(&self, c: &mut Core, mut first: Option<WcStatus>, event: bool) {
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
        // (a peer that took an event and died before signalling it: see below)
        let had_peer = c.link.is_some();
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
        for PostedRecv { wr_id, .. } in c.rq.drain(..) {
            self.recv_cq.push(wc(
                wr_id,
                WcStatus::WrFlushError,
                WcOpcode::Recv,
                0,
                None,
                self.qpn,
            ));
        }
        // Whoever sleeps on our channels looks, armed or not: the event of an
        // arm may have been taken by the peer (its notify word swapped) that
        // then died before it wrote our eventfd, and the flush completions
        // above would not signal again for that arm (see `CqInner::push`).
        if had_peer {
            self.send_cq.signal();
            if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                self.recv_cq.signal();
            }
        }
        self.release_link(c);
        if event {
            self.dev.raise(AsyncEvent::QpFatal { qp_num: self.qpn });
        }
    }

    /// Lets go of everything the link holds: sockets, the peer's ring,
    /// eventfds and regions (windows lent keep their mapping until dropped).
    pub(super) fn release_link(&self, c: &mut Core) {
        c.link = None;
        lock(&self.ctl).clear_links();
        *lock(&self.hb) = None;
        let mut m = lock(&self.remote);
        m.clear();
        self.remote_changed(&m);
        drop(m);
        c.last_remote = None;
        self.dev.wake.signal();
    }
}
