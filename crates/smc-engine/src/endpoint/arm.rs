//! Which completion queues a sleeping driver arms ([`Endpoint::arm`]): every
//! link's receive CQ, and a link's send CQ only while something waits for
//! one of its send completions. A send completion frees a send slot and the
//! send-buffer space of its CDC's data (`DataPath::on_cdc_sent`, RFC 7609
//! §4.5: the sender's buffer is released when the CDC's send completed, as
//! in the kernel's smc_cdc.c `smc_cdc_tx_handler`); a reader waiting for
//! data needs none of that, and with the send CQ armed the peer would wake
//! it for the completion of its own last message (the shared-memory device
//! signals the sender when it consumes its SEND).
//!
//! Whatever can only be unblocked by a send completion keeps the send CQ
//! armed: a link whose send slots are all taken (CDCs and LLC messages wait
//! for one), LLC messages and failover validation CDCs in flight, a link
//! or group that is not plainly up, and CDCs of connections that are not
//! plainly open with room to write — a full send buffer (a writer waits), data
//! not yet sent or a CDC owed (a flush may wait for a slot), a close in
//! progress that waits for more than the completion of its last CDC, a
//! failover or move (they wait for the old link's CDCs).
//!
//! Only signaled work requests count: a CDC posted unsignaled (selective
//! signaling, `TxBook::post`) completes with a later signaled one, and
//! whoever needs the completion of one that nothing follows has a probe
//! posted behind it (`TxBook::probe`: a move between links, a count of
//! unconfirmed bytes, `Endpoint::send_queue`, a look of the tools,
//! `Endpoint::settle_sends`); a writer waiting for send-buffer space and a
//! close have their CDCs signaled (`DataPath::wants_completion`).
//!
//! A close needs no wake-up for its CDC's completion (`SendWait`): while
//! the connection waits for the peer's close, that completion frees nothing
//! (the peer's close, which wakes the driver on the receive side anyway,
//! does); once it is closed and released, only the freeing waits, and the
//! driver looks after [`REAP_AFTER`] for every connection that closed
//! meanwhile (`reap_at`) instead of waking for each (once: should a look
//! find a CDC still in flight, the driver arms for it until a connection is
//! freed again, `reap_looked`). On the shared-memory
//! device, where the peer signals a SEND's completion when it takes the
//! message, that is a wake-up and two context switches per connection less
//! for a program that opens and closes connections one after another.

use super::conn::{Conn, Phase};
use super::conn_core::lock;
use super::link::MAX_SENDS_CAP;
use super::{Endpoint, LgrId, Result};
use crate::state::LgrState;
use smc_proto::close::CloseState;
use smc_proto::link::LinkState;
use smc_rdma::Provider;
use std::time::Duration;

/// How long a finished connection may wait for its last CDC's completion
/// before the driver looks (see the module documentation): its buffers go
/// back to the pool that much later at most.
pub(super) const REAP_AFTER: Duration = Duration::from_millis(10);

/// The connections of a group (finished ones included) from which on the
/// driver wakes for the freeing of each again: a quarter of the 255 a group
/// may hold (Linux `SMC_RMBS_PER_LGR_MAX`).
const LAZY_REAP_MAX_CONNS: usize = 64;

/// What a sleeping driver does about a link's send completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum SendWait {
    /// Nothing waits for them.
    No,
    /// Only the freeing of finished connections: a look after [`REAP_AFTER`].
    Lazy,
    /// Something is blocked until one comes: arm the send CQ.
    Now,
}

impl<P: Provider> Endpoint<P> {
    /// Asks the completion queues to signal the endpoint's descriptor
    /// ([`Self::notify_fd`]) at their next completion: every receive CQ, and
    /// the send CQs whose completions something waits for (see the module
    /// documentation). Arm, then [`Self::pump`] once more (a completion may
    /// have come in before arming), then sleep on the descriptor: nothing is
    /// missed, and while nobody sleeps peers post without a system call.
    /// What starts to wait for a send completion while a driver sleeps is
    /// armed by [`Self::arm_sends`].
    pub fn arm(&mut self) -> Result<()> {
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                let send = self.send_wait(l, slot);
                if let Some(res) = self.link_res_mut(l, slot) {
                    res.arm(send == SendWait::Now)?;
                }
            }
        }
        Ok(())
    }

    /// [`Self::arm`] for a driver that wakes by itself soon (a deadline of
    /// its own): a link's receive CQ that connections polled themselves
    /// since its last arm is left unarmed. Threads that poll their
    /// connections without sleeping (`FastConn::try_read`) take the link's
    /// CDCs themselves, and an armed CQ would have the peer signal the
    /// driver's channel after every arm, waking it for a CDC a poller takes
    /// first (on one core, two context switches each time). What the
    /// pollers leave is taken by the driver's next look. Returns how many
    /// receive CQs were left unarmed: 0 means as [`Self::arm`]. The driver
    /// must not sleep beyond its deadline then, and must arm fully once
    /// something waits that only a pump can serve.
    pub fn arm_unpolled(&mut self) -> Result<usize> {
        let mut left = 0;
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                let send = self.send_wait(l, slot) == SendWait::Now;
                if let Some(res) = self.link_res_mut(l, slot) {
                    if !res.arm_unpolled(send)? {
                        left += 1;
                    }
                }
            }
        }
        Ok(left)
    }

    /// Arms the send CQs that something waits on now and that [`Self::arm`]
    /// (or an earlier call of this) left unarmed, and polls each of them
    /// once (a completion may have come in before arming): for what starts
    /// waiting while a driver sleeps on [`Self::notify_fd`] (a write that
    /// filled the send buffer or took the last send slot, a close), and at
    /// the end of every [`Self::pump`] (the look after [`Self::arm`] may
    /// post CDCs that something waits on). Returns whether it armed any;
    /// then what the poll took is handled by the next pump. Cheap when
    /// there is nothing to arm: it looks at the signaled SENDs in flight, a
    /// few per link. Completions a connection's fast path took meanwhile
    /// are handled too (then it returns `true`).
    pub fn arm_sends(&mut self) -> Result<bool> {
        let mut armed = false;
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                // Completions a connection's fast path took off the send CQ
                // since the last poll (`LinkTx::reap`) are out of the CQ and
                // its notification, and out of the SENDs in flight looked at
                // below: handled now, and the pump that follows does the
                // rest (a waiter's may be among them).
                if self
                    .link_res_mut(l, slot)
                    .is_some_and(|res| res.tx.has_reaped())
                {
                    self.poll_send(l, slot)?;
                    armed = true;
                }
                let unarmed = self
                    .link_res_mut(l, slot)
                    .is_some_and(|res| !res.send_armed && !res.book().wrs.is_empty());
                if unarmed && self.send_wait(l, slot) == SendWait::Now {
                    if let Some(res) = self.link_res_mut(l, slot) {
                        res.arm_send()?;
                        armed = true;
                    }
                    self.poll_send(l, slot)?;
                }
            }
        }
        Ok(armed)
    }

    /// Arms the receive CQs of links made since the sleeping driver's
    /// [`Self::arm`] (a first contact's link, an added one), whose first
    /// messages (the peer's CONFIRM_LINK or ADD_LINK) would otherwise wait
    /// for whatever wakes that driver next. Returns whether it armed any;
    /// then a [`Self::pump`] takes what came before.
    pub fn arm_new_links(&mut self) -> Result<bool> {
        let mut armed = false;
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                // (the look at the send side only for a link to arm: this
                // runs at every release of the endpoint's lock)
                if self.link_res_mut(l, slot).is_none_or(|r| r.recv_armed) {
                    continue;
                }
                let send = self.send_wait(l, slot) == SendWait::Now;
                if let Some(res) = self.link_res_mut(l, slot) {
                    res.arm(send)?;
                    armed = true;
                }
            }
        }
        Ok(armed)
    }

    /// Polls the send CQ of every link with signaled SENDs in flight (see
    /// `reap_at`).
    pub(super) fn poll_sends_in_flight(&mut self) -> Result<()> {
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                if self
                    .link_res_mut(l, slot)
                    .is_some_and(|res| !res.book().wrs.is_empty())
                {
                    self.poll_send(l, slot)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn link_res_mut(
        &mut self,
        l: LgrId,
        slot: usize,
    ) -> Option<&mut super::link::LinkRes<P>> {
        self.lgrs
            .get_mut(l)
            .and_then(|lg| lg.links.get_mut(slot))
            .and_then(Option::as_mut)
    }

    /// What waits for a send completion of link `slot` of group `l` (see
    /// the module documentation); a [`SendWait::Lazy`] one is noted in
    /// `reap_at`, for [`Self::poll_timeout`].
    fn send_wait(&mut self, l: LgrId, slot: usize) -> SendWait {
        match self.send_wait_of(l, slot) {
            // (a look found a CDC still in flight, nothing was freed since:
            // a wake-up when it completes rather than a look every
            // `REAP_AFTER` while the peer does not take it)
            SendWait::Lazy if self.reap_looked => SendWait::Now,
            SendWait::Lazy => {
                let at = self.now + REAP_AFTER;
                self.reap_at = Some(self.reap_at.map_or(at, |t| t.min(at)));
                SendWait::Lazy
            }
            w => w,
        }
    }

    /// For a caller that needs the completions of link `slot` of group `l`
    /// that may be among the unsignaled CDCs at the end of its send queue,
    /// which no completion would come for while nothing more is posted: a
    /// probe behind them (`TxBook::probe`), into the peer RMB of connection
    /// `id` (whose rkey on the link is known).
    pub(super) fn probe_tail(&mut self, l: LgrId, slot: usize, id: super::ConnId) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        let Some(peer) = lock(&c.core).peer_rmb else {
            return;
        };
        if let Some(lg) = self.lgrs.get_mut(l) {
            probe_link(lg, slot, peer);
        }
    }

    fn send_wait_of(&self, l: LgrId, slot: usize) -> SendWait {
        let Some(lg) = self.lgrs.get(l) else {
            return SendWait::No;
        };
        let Some(res) = lg.links.get(slot).and_then(Option::as_ref) else {
            return SendWait::No;
        };
        // What is in flight, copied out: the link's send lock is not held
        // while a connection's core is locked (the fast path takes them the
        // other way round, `ConnCore::fast_write`).
        let mut cdcs: [Option<super::ConnId>; MAX_SENDS_CAP] = [None; MAX_SENDS_CAP];
        let mut n = 0;
        {
            let book = res.book();
            if !book.wrs.iter().any(|w| w.signaled) {
                // nothing signaled in flight: no send completion to wait for (a
                // failed QP also flushes its receives, on the receive CQ)
                return SendWait::No;
            }
            // (a connection that wrote without a CDC, `TxBook::corked`, waits
            // for a slot too)
            if book.sends_in_flight >= book.max_sends
                || !book.has_free_slots()
                || !book.corked.is_empty()
            {
                return SendWait::Now;
            }
            // (only signaled work requests: their completions come. An
            // unsignaled CDC completes with a later one, and what waits for
            // one of those that nothing follows has a probe posted itself
            // (`TxBook::probe`: a move, `Endpoint::send_queue`); a writer
            // waiting for send-buffer space, a close, have theirs signaled,
            // `DataPath::wants_completion`)
            for w in book.wrs.iter().filter(|w| w.signaled) {
                match w.kind {
                    super::link::WrKind::Llc | super::link::WrKind::Validation => {
                        return SendWait::Now
                    }
                    // (it completes what came before it: nothing of its own)
                    super::link::WrKind::Probe => {}
                    super::link::WrKind::Cdc(id, _) => {
                        // (more than fit: wait for them, to be safe)
                        let Some(at) = cdcs.get_mut(n) else {
                            return SendWait::Now;
                        };
                        *at = Some(id);
                        n += 1;
                    }
                }
            }
        }
        if lg.state != LgrState::Active
            || lg
                .group
                .link(slot)
                .is_none_or(|k| k.state != LinkState::Active)
        {
            return SendWait::Now;
        }
        let w = cdcs[..n]
            .iter()
            .flatten()
            .map(|&id| {
                self.conns
                    .get(id)
                    .map_or(SendWait::No, |c| conn_send_wait(c, slot))
            })
            .max()
            .unwrap_or(SendWait::No);
        // (finished connections count against the group's connections until
        // they are freed: a group that programs fill faster than the looks
        // free them would send new connections to a new group)
        if w == SendWait::Lazy && lg.tokens.len() >= LAZY_REAP_MAX_CONNS {
            return SendWait::Now;
        }
        w
    }
}

/// [`super::link::TxBook::probe`] on link `slot` of group `lg`, into the
/// peer's RMB `peer` (a connection's, whose rkey on that link is known).
pub(super) fn probe_link<P: Provider>(
    lg: &mut super::lgr::Lgr<P>,
    slot: usize,
    peer: super::lgr::PeerRmb,
) {
    let Some((rkey, base)) = lg
        .group
        .rtoken(peer.row)
        .and_then(|t| t.get(slot).copied().flatten())
    else {
        return;
    };
    if let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) {
        // (a post that fails has a failed QP, which the receive side's
        // flush reports: the link's failure is handled there)
        let _ = res.probe(rkey, base.wrapping_add(peer.offset));
    }
}

/// What connection `c`, with a CDC in flight on link `slot`, waits for of
/// its completion: nothing while it is open with room to write and nothing
/// to send, or has sent its close and waits for the peer's; the freeing
/// alone once it is finished; anything else may be blocked on it.
fn conn_send_wait<P: Provider>(c: &Conn<P>, slot: usize) -> SendWait {
    // (a close's wait for unsent data, `close_deadline`, is the data path's
    // unsent bytes and pending close flags below)
    if !matches!(c.phase, Phase::Smc { .. }) || c.tx_dirty {
        return SendWait::Now;
    }
    let k = lock(&c.core);
    if k.link != Some(slot) || k.move_to.is_some() || k.validation.is_some() {
        return SendWait::Now;
    }
    let quiet = match k.closer.state() {
        // (the completion frees nothing before the peer's close, whose
        // arrival wakes the driver on the receive side anyway)
        CloseState::Active
        | CloseState::PeerCloseWait1
        | CloseState::PeerCloseWait2
        | CloseState::PeerFinCloseWait => SendWait::No,
        CloseState::Closed if k.closer.is_finished() => SendWait::Lazy,
        _ => return SendWait::Now,
    };
    let blocked = k.dp.as_ref().is_none_or(|dp| {
        dp.sndbuf_free() == 0
            || dp.unsent() > 0
            || dp.cdc_wanted()
            || dp.urgent_pending()
            || dp.close_pending()
    });
    if blocked {
        SendWait::Now
    } else {
        quiet
    }
}
