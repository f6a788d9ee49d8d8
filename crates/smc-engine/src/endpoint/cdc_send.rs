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

use super::conn::Phase;
use super::link::{WrKind, MAX_SENDS};
use super::{ConnId, Endpoint, LgrId, Result};
use smc_proto::link::LinkState;
use smc_rdma::{CompletionQueue, MemoryRegion, Provider, WcStatus, WorkCompletion};

impl<P: Provider> Endpoint<P> {
    /// Send completions of link `slot`. A CDC's completion counts only while its
    /// connection is still on that link: after a failover the connection has
    /// rewound past everything the old link had in flight.
    pub(super) fn poll_send(&mut self, l: LgrId, slot: usize) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 16];
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                return Ok(());
            };
            let n = res.scq.poll(&mut wcs)?;
            self.completions += n as u64;
            // CDCs whose send completed (at most one per completion)
            let mut done = [(0 as ConnId, 0u16); 16];
            let mut ndone = 0;
            let mut failed = false;
            for wc in wcs.iter().take(n) {
                let kind = res.complete(wc.wr_id);
                if kind.is_some() {
                    res.sends_in_flight = res.sends_in_flight.saturating_sub(1);
                }
                if wc.status != WcStatus::Success {
                    failed = true;
                    continue;
                }
                if let (Some(WrKind::Cdc(id, seq)), Some(d)) = (kind, done.get_mut(ndone)) {
                    *d = (id, seq);
                    ndone += 1;
                }
            }
            if failed {
                lg.group.on_link_failure(slot);
            }
            let now = self.now;
            for &(id, seq) in &done[..ndone] {
                self.mark_tx(id);
                if let Some(c) = self.conn(id) {
                    if c.link != Some(slot) {
                        continue;
                    }
                    if let Some(Err(v)) = c.dp.as_mut().map(|dp| dp.on_cdc_sent(seq)) {
                        c.violation = Some(v);
                    }
                    // A close that waits for unsent data waits on while the
                    // peer takes some; a connection whose close is done may
                    // be freed once its last CDC completed.
                    super::pump::close_progress(c, now);
                    if c.closer.is_finished() {
                        self.conn_due(id);
                    }
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Posts what the group's connections have to send, each on its own link.
    pub(super) fn flush_tx(&mut self, l: LgrId, sweep: bool) -> Result<()> {
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
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
        marked.retain(
            |&id| match self.conns.get_mut(id).and_then(Option::as_mut) {
                Some(c) if c.tx_dirty && c.lgr == Some(l) => {
                    c.tx_dirty = false;
                    if !sweep {
                        ids.push(id);
                    }
                    false
                }
                Some(c) => c.tx_dirty,
                None => false,
            },
        );
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
        if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
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
        if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
            c.tx_dirty = false;
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
        for _ in 0..4 {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(true);
            };
            let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
                return Ok(true);
            };
            if !matches!(c.phase, Phase::Smc { .. }) {
                break;
            }
            // A requested move happens once nothing of the connection is in
            // flight on the old link (see the module documentation).
            if let Some(to) = c.move_to {
                let quiet = c.validation.is_none()
                    && c.dp.as_ref().is_none_or(|dp| dp.cdcs_in_flight() == 0);
                if !quiet {
                    break;
                }
                c.link = Some(to);
                c.move_to = None;
            }
            let Some(slot) = c.link else { break };
            let usable = lg
                .group
                .link(slot)
                .is_some_and(|k| k.state == LinkState::Active);
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                break;
            };
            if !usable || res.sends_in_flight >= MAX_SENDS {
                break;
            }
            // After a failover the validation CDC goes first (§2.4).
            if let Some(v) = c.validation.take() {
                if let Err(e) = res.post(WrKind::Validation, &v.encode()) {
                    self.link_error(l, slot, e)?;
                    break;
                }
                self.cdc_sent += 1;
                continue;
            }
            let (Some(dp), Some(peer), Some(sndbuf)) =
                (c.dp.as_mut(), c.peer_rmb, c.sndbuf.as_ref())
            else {
                break;
            };
            // the peer RMB's rkey and address on this link (§3.2 step 4);
            // without one only a CDC can go (nothing left to write)
            let rtoken = lg
                .group
                .rtoken(peer.row)
                .and_then(|t| t.get(slot).copied().flatten());
            if rtoken.is_none() && dp.unsent() > 0 {
                break;
            }
            let (rkey, base) = rtoken.unwrap_or_default();
            let Some(batch) = dp.poll_tx() else {
                return Ok(true);
            };
            let mut posted = Ok(());
            for w in &batch.writes {
                // the send-buffer pieces (one, or two where it wraps)
                let sge = |&(off, len): &(usize, usize)| sndbuf.sge(off, len as u32);
                let (one, two);
                let sges: &[smc_rdma::Sge] = match w.src.as_slice() {
                    [a] => {
                        one = [sge(a)?];
                        &one
                    }
                    [a, b] => {
                        two = [sge(a)?, sge(b)?];
                        &two
                    }
                    _ => &[],
                };
                let addr = base + peer.offset + w.peer_offset as u64;
                posted = res.post_write(sges, rkey, addr);
                if posted.is_err() {
                    break;
                }
            }
            if posted.is_ok() {
                posted = res.post(WrKind::Cdc(id, batch.cdc.seqno), &batch.cdc.encode());
                self.cdc_sent += u64::from(posted.is_ok());
            }
            // A batch that did not go out stays accounted as in flight: the
            // link is down, and the failover rewind sends it again.
            if let Err(e) = posted {
                self.link_error(l, slot, e)?;
                break;
            }
        }
        Ok(false)
    }

    /// Sends what connection `id` has to send now (data written into the send
    /// buffer, a due consumer-cursor update) without a whole [`Self::pump`]:
    /// the cheap follow-up of a read or write.
    pub fn flush(&mut self, id: ConnId) -> Result<()> {
        let Some(l) = self
            .conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.lgr)
        else {
            return Ok(());
        };
        if self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .is_none_or(|lg| lg.group.usable_links() == 0)
        {
            return Ok(());
        }
        self.flush_conn(l, id)?;
        self.drain_lgr(l, self.now)
    }
}
