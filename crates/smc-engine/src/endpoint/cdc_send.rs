//! Sending: what connections have to send posted on their link — batches of
//! RDMA WRITEs into the peer's RMB followed by their CDC, the failover
//! validation CDC first after a failover — the marks that say which
//! connections may have something to send, and the send completions that
//! confirm CDCs.
//!
//! Spec: `protocol-llc-cdc.md` §2 (CDC), §3.1–§3.3 (sender state, how much
//! may be written and where, when the sender stops), §4.1 (per-link send
//! side), §9 (a connection's WRITEs and CDCs on one QP). Linux: smc_tx.c
//! (`smc_tx_sndbuf_nonempty`, `smcr_tx_rdma_writes`), smc_cdc.c
//! (`smc_cdc_msg_send`, `smc_cdc_tx_handler`).

use super::conn_core::{lock, FlushStep};
use super::link::WrKind;
use super::{ConnId, Endpoint, LgrId, Result};

/// Completions taken from a CQ per poll.
pub(super) const POLL_BATCH: usize = 16;
use smc_proto::link::LinkState;
use smc_rdma::{Provider, WcStatus, WorkCompletion};

impl<P: Provider> Endpoint<P> {
    /// [`Self::unacked`] for `SIOCOUTQ` (af_smc.c `smc_ioctl`), up to
    /// date: the send completions that came are taken first; and where the
    /// connection's CDCs may wait for one that no one asked for
    /// (`TxBook::post`: selective signaling), a probe asks
    /// (`TxBook::probe`), so that the count falls to zero as on Linux once
    /// they are through, for a caller that asks again.
    pub fn send_queue(&mut self, id: ConnId) -> usize {
        let Some((l, slot)) = self
            .conns
            .get(id)
            .and_then(|c| Some((c.lgr?, lock(&c.core).link?)))
        else {
            return 0;
        };
        // (a failure is the link's, handled by the next pump)
        let _ = self.poll_send(l, slot);
        let n = self.unacked(id);
        if n > self.unsent(id) {
            self.probe_tail(l, slot, id);
        }
        n
    }

    /// Takes the send completions that came on every link, and asks for
    /// those of the unsignaled CDCs that nothing followed (`TxBook::probe`),
    /// which come by the next call: for views that show what completed
    /// (`conn_diag`'s `tx_fin`, smcss -d) and should lag no more than one
    /// look behind, while the data path asks for a completion only where
    /// something waits for it (`DataPath::wants_completion`).
    pub fn settle_sends(&mut self) -> Result<()> {
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            for slot in 0..smc_proto::link::LINK_SLOTS {
                let busy = self
                    .link_res_mut(l, slot)
                    .is_some_and(|res| !res.book().wrs.is_empty());
                if !busy {
                    continue;
                }
                self.poll_send(l, slot)?;
                let tail = self
                    .link_res_mut(l, slot)
                    .and_then(|res| res.book().unsignaled_tail());
                if let Some(id) = tail {
                    self.probe_tail(l, slot, id);
                }
            }
        }
        Ok(())
    }

    /// Send completions of link `slot`. A CDC's completion counts only while its
    /// connection is still on that link: after a failover the connection has
    /// rewound past everything the old link had in flight.
    pub(super) fn poll_send(&mut self, l: LgrId, slot: usize) -> Result<()> {
        let mut wcs = std::mem::take(&mut self.scratch_wcs);
        wcs.resize(POLL_BATCH, WorkCompletion::default());
        let mut sent = std::mem::take(&mut self.scratch_sent);
        let r = self.poll_send_with(l, slot, &mut wcs, &mut sent);
        sent.clear();
        self.scratch_wcs = wcs;
        self.scratch_sent = sent;
        r
    }

    fn poll_send_with(
        &mut self,
        l: LgrId,
        slot: usize,
        wcs: &mut [WorkCompletion],
        sent: &mut Vec<(WorkCompletion, Option<WrKind>)>,
    ) -> Result<()> {
        loop {
            let Some(lg) = self.lgrs.get_mut(l) else {
                return Ok(());
            };
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                return Ok(());
            };
            // (what a connection's fast path reaped first: the send queue's
            // order, see `LinkTx::reap`)
            sent.clear();
            let mut corked = std::mem::take(&mut self.scratch_ids);
            corked.clear();
            let more = res
                .tx
                .take_completions(wcs, sent, &mut self.cdc_sent, &mut corked)?;
            // (connections whose fast path owes a CDC: flushed as soon as
            // a slot is free, see `TxBook::corked`)
            for &id in &corked {
                if let Some(c) = self.conns.get_mut(id) {
                    if !c.tx_dirty {
                        c.tx_dirty = true;
                        self.tx_dirty.push(id);
                    }
                }
            }
            self.scratch_ids = corked;
            self.completions += sent.len() as u64;
            let now = self.now;
            let mut failed = false;
            for &(wc, kind) in sent.iter() {
                if wc.status != WcStatus::Success {
                    failed = true;
                    continue;
                }
                // A CDC whose send completed (at most one per completion).
                // Its connection is marked (`mark_tx`), its data path told,
                // and a finished one listed to be freed (`conn_due`); none
                // of that looks at the link, whose failure (below) is the
                // group's.
                if let Some(WrKind::Cdc(id, seq)) = kind {
                    // (`mark_tx` by hand: the link is borrowed here)
                    let Some(c) = self.conns.get_mut(id) else {
                        continue;
                    };
                    if !c.tx_dirty {
                        c.tx_dirty = true;
                        self.tx_dirty.push(id);
                    }
                    let done = lock(&c.core).on_cdc_sent(slot, seq);
                    if let Some(done) = done {
                        // A close that waits for unsent data waits on while
                        // the peer takes some.
                        c.phase.close_progress(done.unsent, now);
                        if done.finished {
                            self.due.push(id);
                        }
                    }
                }
            }
            if failed {
                lg.group.on_link_failure(slot);
            }
            if !more {
                return Ok(());
            }
        }
    }

    /// Posts what the group's connections have to send, each on its own link.
    pub(super) fn flush_tx(&mut self, l: LgrId, sweep: bool) -> Result<()> {
        if !sweep && self.tx_dirty.is_empty() {
            // (no connection is marked: nothing to look at)
            return Ok(());
        }
        let Some(lg) = self.lgrs.get_mut(l) else {
            return Ok(());
        };
        if lg.group.usable_links() == 0 {
            return Ok(());
        }
        // Only the connections marked as maybe having something to send (an
        // application call, a CDC in either direction, a timer: `mark_tx`)
        // are flushed, so that a message's cost does not grow with the number
        // of idle connections; all of them after link and handshake events
        // (`sweep_due`). Round robin,
        // a few batches per connection per pass, so that one busy connection
        // cannot take every send slot of its link.
        let mut ids = std::mem::take(&mut self.scratch_ids);
        ids.clear();
        // The marks are taken out: flushing re-marks a connection that still
        // has something to send, into a fresh list. Marks of other groups go
        // back after.
        // (the list swapped in is a kept spare, so that marking allocates nothing)
        let spare = std::mem::take(&mut self.scratch_marked);
        let mut marked = std::mem::replace(&mut self.tx_dirty, spare);
        if sweep {
            ids.extend(lg.tokens.values().copied());
        }
        // this group's marked connections are flushed now (once each: a list
        // can hold an id twice after a flush outside this pass); the others'
        // marks go back
        marked.retain(|&id| match self.conns.get_mut(id) {
            Some(c) if c.tx_dirty && c.lgr == Some(l) => {
                c.tx_dirty = false;
                if !sweep {
                    ids.push(id);
                }
                false
            }
            Some(c) => c.tx_dirty,
            None => false,
        });
        if !ids.is_empty() {
            lg.rr = (lg.rr + 1) % ids.len();
            ids.rotate_left(lg.rr);
        }
        let mut r = Ok(());
        for &id in &ids {
            r = self.flush_conn(l, id);
            if r.is_err() {
                break;
            }
        }
        self.scratch_ids = ids;
        self.tx_dirty.extend_from_slice(&marked);
        marked.clear();
        self.scratch_marked = marked;
        r
    }

    /// Connection `id` may have something to send: flush it at the next pump.
    pub(super) fn mark_tx(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(id) {
            if !c.tx_dirty {
                c.tx_dirty = true;
                self.tx_dirty.push(id);
            }
        }
    }

    /// Posts what connection `id` of group `l` has to send: a few batches
    /// (WRITEs and their CDC), as the send slots of its link allow.
    fn flush_conn(&mut self, l: LgrId, id: ConnId) -> Result<()> {
        self.conn_flushes += 1;
        if let Some(c) = self.conns.get_mut(id) {
            c.tx_dirty = false;
        }
        // Its latest mark is spent: the next pump would only drop it (and a
        // pump that finds no marks looks at none).
        if self.tx_dirty.last() == Some(&id) {
            self.tx_dirty.pop();
        }
        // clean only when the data path said it has nothing to send
        let clean = self.flush_conn_batches(l, id);
        if !matches!(clean, Ok(true)) {
            self.mark_tx(id);
        }
        clean.map(|_| ())
    }

    /// [`Self::flush_conn`]'s batches; `Ok(true)` when nothing is left to send.
    fn flush_conn_batches(&mut self, l: LgrId, id: ConnId) -> Result<bool> {
        let Some(c) = self.conns.get(id) else {
            return Ok(true);
        };
        let mut k = lock(&c.core);
        for _ in 0..4 {
            let Some(lg) = self.lgrs.get_mut(l) else {
                return Ok(true);
            };
            if !k.established {
                break;
            }
            if !k.settle_move() {
                // (the move waits for its CDCs on the old link, which may
                // be unsignaled ones that no completion would come for while
                // nothing follows them: a probe asks, `TxBook::probe`)
                if let (Some(slot), Some(peer)) = (k.link, k.peer_rmb) {
                    super::arm::probe_link(lg, slot, peer);
                }
                break;
            }
            let Some(slot) = k.link else { break };
            let usable = lg
                .group
                .link(slot)
                .is_some_and(|k| k.state == LinkState::Active);
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                break;
            };
            if !usable || res.sends_full() {
                break;
            }
            // the peer RMB's rkey and address on this link (§3.2 step 4)
            let rtoken = k.peer_rmb.and_then(|peer| {
                lg.group
                    .rtoken(peer.row)
                    .and_then(|t| t.get(slot).copied().flatten())
            });
            match k.flush_step(id, res, rtoken)? {
                FlushStep::Posted => self.cdc_sent += 1,
                FlushStep::Clean => return Ok(true),
                FlushStep::Blocked => break,
                FlushStep::LinkError(e) => {
                    drop(k);
                    self.link_error(l, slot, e)?;
                    break;
                }
            }
        }
        Ok(false)
    }

    /// Sends what connection `id` has to send now (data written into the send
    /// buffer, a due consumer-cursor update) without a whole [`Self::pump`]:
    /// the cheap follow-up of a read or write.
    pub fn flush(&mut self, id: ConnId) -> Result<()> {
        let Some(l) = self.conns.get(id).and_then(|c| c.lgr) else {
            return Ok(());
        };
        if self
            .lgrs
            .get(l)
            .is_none_or(|lg| lg.group.usable_links() == 0)
        {
            return Ok(());
        }
        self.flush_conn(l, id)?;
        self.drain_lgr(l, self.now)
    }
}
