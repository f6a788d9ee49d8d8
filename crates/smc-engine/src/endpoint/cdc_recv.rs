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

use super::conn::Phase;
use super::conn_core::{lock, CdcDone};
use super::link::RECV_SLOT_LEN;
use super::{ConnId, Endpoint, LgrId, Result};
use smc_proto::Timestamp;
use smc_rdma::{Provider, WcStatus};
use smc_wire::cdc::CdcMessage;
use smc_wire::WrMessage;

/// CDCs kept per connection while its CLC Confirm is still on the way.
pub(super) const EARLY_CDC_MAX: usize = 64;

impl<P: Provider> Endpoint<P> {
    /// Receive completions of link `slot`: LLC to the link group (as arrived on
    /// that link), CDCs to the connection of their token, whatever link they
    /// came on (§9). Polled under the link's receive lock (`LinkRx`), held
    /// for the whole poll, so that what the CQ gives is handled in its order.
    pub(super) fn poll_recv(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        let Some(rx) = self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .and_then(|lg| lg.links.get(slot))
            .and_then(Option::as_ref)
            .map(|res| res.rx.clone())
        else {
            return Ok(());
        };
        let mut book = rx.book();
        loop {
            let n = rx.poll(&mut book)?;
            self.completions += n as u64;
            for i in 0..n {
                let wc = book.wcs[i];
                let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                    return Ok(());
                };
                if lg.links.get(slot).and_then(Option::as_ref).is_none() {
                    return Ok(());
                }
                if wc.status != WcStatus::Success {
                    if wc.status != WcStatus::WrFlushError {
                        lg.group.on_link_failure(slot);
                    }
                    continue;
                }
                let (read, reposted) = rx.take(&mut book, wc.wr_id, wc.byte_len);
                read?;
                lg.group.on_rx_activity(slot, now);
                let len = (wc.byte_len as usize).min(RECV_SLOT_LEN);
                match WrMessage::decode(&book.msg[..len]) {
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
                        let found = {
                            let table = self.by_token.read();
                            table.get(&c.token).filter(|e| e.lgr == l).map(|e| {
                                let mut k = lock(&e.core);
                                (e.id, k.dp.is_some().then(|| k.on_cdc(&c)))
                            })
                        };
                        match found {
                            Some((id, done)) => self.cdc_done(id, &c, done),
                            None => lg.group.dropped += 1,
                        }
                    }
                    Err(_) => lg.group.dropped += 1,
                }
                if let Err(e) = reposted {
                    self.link_error(l, slot, e)?;
                }
            }
            if n < book.wcs.len() {
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
