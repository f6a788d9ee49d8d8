//! Receiving: the receive completions of a link, each message dispatched by
//! its type byte — LLC to the link group, a CDC to the connection whose alert
//! token it carries, whatever link it came on — and a CDC applied to its
//! connection: cursors, urgent byte, close flags, violations.
//!
//! Spec: `protocol-llc-cdc.md` §0 (framing), §2 (CDC messages, §2.3 sequence
//! numbers, §2.4 failover validation), §3.4 (receive side), §3.5 (urgent
//! data), §4.2 (per-link receive side), §9. Linux: smc_wr.c
//! (`smc_wr_rx_tasklet_fn`), smc_cdc.c (`smc_cdc_rx_handler`,
//! `smc_cdc_msg_recv`).

use super::cdc_send::POLL_BATCH;
use super::conn::Phase;
use super::conn_core::{lock, CdcDone};
use super::link::RECV_SLOT_LEN;
use super::{ConnId, Endpoint, LgrId, Result};
use smc_proto::Timestamp;
use smc_rdma::{
    CompletionQueue, MemoryRegion, Provider, QueuePair, RecvWr, WcStatus, WorkCompletion,
};
use smc_wire::cdc::CdcMessage;
use smc_wire::WrMessage;

/// CDCs kept per connection while its CLC Confirm is still on the way.
pub(super) const EARLY_CDC_MAX: usize = 64;

impl<P: Provider> Endpoint<P> {
    /// Receive completions of link `slot`: LLC to the link group (as arrived on
    /// that link), CDCs to the connection of their token, whatever link they
    /// came on (§9).
    pub(super) fn poll_recv(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        // one receive buffer's bytes (a CDC or LLC message), copied out before
        // the buffer is posted again
        let mut msg = std::mem::take(&mut self.scratch_msg);
        msg.resize(RECV_SLOT_LEN, 0);
        let mut wcs = std::mem::take(&mut self.scratch_wcs);
        wcs.resize(POLL_BATCH, WorkCompletion::default());
        let r = self.poll_recv_with(l, slot, now, &mut msg, &mut wcs);
        self.scratch_msg = msg;
        self.scratch_wcs = wcs;
        r
    }

    fn poll_recv_with(
        &mut self,
        l: LgrId,
        slot: usize,
        now: Timestamp,
        msg: &mut [u8],
        wcs: &mut [WorkCompletion],
    ) -> Result<()> {
        loop {
            let Some(res) = self
                .lgrs
                .get_mut(l)
                .and_then(Option::as_mut)
                .and_then(|lg| lg.links.get_mut(slot))
                .and_then(Option::as_mut)
            else {
                return Ok(());
            };
            let n = res.rcq.poll(wcs)?;
            self.completions += n as u64;
            for wc in wcs.iter().take(n) {
                let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                    return Ok(());
                };
                let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                    return Ok(());
                };
                if wc.status != WcStatus::Success {
                    if wc.status != WcStatus::WrFlushError {
                        lg.group.on_link_failure(slot);
                    }
                    continue;
                }
                let at = wc.wr_id as usize * RECV_SLOT_LEN;
                let buf = &mut msg[..(wc.byte_len as usize).min(RECV_SLOT_LEN)];
                res.recv.read_at(at, buf)?;
                let reposted = res.recv.sge(at, RECV_SLOT_LEN as u32).and_then(|sge| {
                    res.qp.post_recv(&RecvWr {
                        wr_id: wc.wr_id,
                        sges: &[sge],
                    })
                });
                lg.group.on_rx_activity(slot, now);
                match WrMessage::decode(buf) {
                    Ok(WrMessage::Llc(m)) => {
                        self.llc_received += 1;
                        lg.group.on_llc(slot, m, now);
                        // (an LLC flow may have started or moved its deadline)
                        self.lgr_recheck = true;
                    }
                    Ok(WrMessage::Cdc(c)) => {
                        self.cdc_received += 1;
                        // The CDC carries the receiver's alert token (§2.1),
                        // of a connection of this link's group.
                        match self.by_token.get(&c.token).filter(|e| e.lgr == l) {
                            Some(e) => {
                                let id = e.id;
                                let done = {
                                    let mut k = lock(&e.core);
                                    k.dp.is_some().then(|| k.on_cdc(&c))
                                };
                                self.cdc_done(id, &c, done);
                            }
                            None => lg.group.dropped += 1,
                        }
                    }
                    Err(_) => lg.group.dropped += 1,
                }
                if let Err(e) = reposted {
                    self.link_error(l, slot, e)?;
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Applies the peer's CDC `m` to connection `id` (found by its id; the
    /// receive loop above finds the core by the CDC's token instead).
    pub(super) fn on_cdc(&mut self, id: ConnId, m: &CdcMessage) {
        let done = self
            .core(id)
            .and_then(|mut k| k.dp.is_some().then(|| k.on_cdc(m)));
        self.cdc_done(id, m, done);
    }

    /// What follows a CDC for connection `id`: `done`, what its data path
    /// made of it (see `ConnCore::on_cdc`), or `None` when it has none yet
    /// and the CDC is kept for it (see `Phase::AwaitConfirm`).
    fn cdc_done(&mut self, id: ConnId, m: &CdcMessage, done: Option<CdcDone>) {
        self.mark_tx(id);
        let Some(done) = done else {
            let Some(c) = self.conn(id) else { return };
            if let Phase::ServerRkey { early, .. } | Phase::AwaitConfirm { early, .. } =
                &mut c.phase
            {
                if early.len() >= EARLY_CDC_MAX {
                    early.pop_front();
                }
                early.push_back(*m);
            }
            return;
        };
        if let Some(cause) = done.aborted {
            self.event_aborted(id, cause);
        }
        // the peer's close may have been the last step: it may be freed
        if done.finished {
            self.conn_due(id);
        }
    }
}
