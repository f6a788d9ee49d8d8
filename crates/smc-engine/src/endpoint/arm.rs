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
//! progress (its last CDC must complete before the connection is freed,
//! see `reap`), a failover or move (they wait for the old link's CDCs).

use super::conn::{Conn, Phase};
use super::conn_core::lock;
use super::link::MAX_SENDS;
use super::{Endpoint, LgrId, Result};
use crate::state::LgrState;
use smc_proto::close::CloseState;
use smc_proto::link::LinkState;
use smc_rdma::Provider;

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
        for l in 0..self.lgrs.len() {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                let send = self.awaits_send_completions(l, slot);
                if let Some(res) = self.link_res_mut(l, slot) {
                    res.arm(send)?;
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
        for l in 0..self.lgrs.len() {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                let send = self.awaits_send_completions(l, slot);
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
        for l in 0..self.lgrs.len() {
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
                if unarmed && self.awaits_send_completions(l, slot) {
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
        for l in 0..self.lgrs.len() {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                // (the look at the send side only for a link to arm: this
                // runs at every release of the endpoint's lock)
                if self.link_res_mut(l, slot).is_none_or(|r| r.recv_armed) {
                    continue;
                }
                let send = self.awaits_send_completions(l, slot);
                if let Some(res) = self.link_res_mut(l, slot) {
                    res.arm(send)?;
                    armed = true;
                }
            }
        }
        Ok(armed)
    }

    fn link_res_mut(&mut self, l: LgrId, slot: usize) -> Option<&mut super::link::LinkRes<P>> {
        self.lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .and_then(|lg| lg.links.get_mut(slot))
            .and_then(Option::as_mut)
    }

    /// Whether something waits for a send completion of link `slot` of
    /// group `l` (see the module documentation).
    fn awaits_send_completions(&self, l: LgrId, slot: usize) -> bool {
        let Some(lg) = self.lgrs.get(l).and_then(Option::as_ref) else {
            return false;
        };
        let Some(res) = lg.links.get(slot).and_then(Option::as_ref) else {
            return false;
        };
        // What is in flight, copied out: the link's send lock is not held
        // while a connection's core is locked (the fast path takes them the
        // other way round, `ConnCore::fast_write`).
        let mut cdcs = [0 as super::ConnId; MAX_SENDS];
        let mut n = 0;
        {
            let book = res.book();
            if book.wrs.is_empty() {
                // nothing signaled in flight: no send completion to wait for (a
                // failed QP also flushes its receives, on the receive CQ)
                return false;
            }
            if book.sends_in_flight >= MAX_SENDS || !book.has_free_slots() {
                return true;
            }
            for &(_, kind, _) in &book.wrs {
                match kind {
                    super::link::WrKind::Llc | super::link::WrKind::Validation => return true,
                    super::link::WrKind::Cdc(id, _) => {
                        // (more than fit: wait for them, to be safe)
                        let Some(at) = cdcs.get_mut(n) else {
                            return true;
                        };
                        *at = id;
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
            return true;
        }
        cdcs[..n].iter().any(|&id| {
            self.conns
                .get(id)
                .and_then(Option::as_ref)
                .is_some_and(|c| conn_awaits_send_completion(c, slot))
        })
    }
}

/// Whether connection `c`, with a CDC in flight on link `slot`, may wait for
/// its completion: anything but an open connection on that link with room in
/// its send buffer and nothing left to send.
fn conn_awaits_send_completion<P: Provider>(c: &Conn<P>, slot: usize) -> bool {
    if !matches!(c.phase, Phase::Smc { .. }) || c.close_deadline.is_some() || c.tx_dirty {
        return true;
    }
    let k = lock(&c.core);
    if k.link != Some(slot)
        || k.move_to.is_some()
        || k.validation.is_some()
        || k.closer.state() != CloseState::Active
    {
        return true;
    }
    k.dp.as_ref().is_none_or(|dp| {
        dp.sndbuf_free() == 0
            || dp.unsent() > 0
            || dp.cdc_wanted()
            || dp.urgent_pending()
            || dp.close_pending()
    })
}
