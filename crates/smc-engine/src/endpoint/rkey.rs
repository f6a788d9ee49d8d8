//! rkey flows: CONFIRM_RKEY announces a connection's RMB to the peer before
//! its Accept / Confirm on a reused link group, DELETE_RKEY withdraws a
//! released one; one local LLC flow at a time per group, so flows wait in the
//! group's queue. An RMB the peer still knows needs no flow (see
//! `Lgr::known_rkeys`).
//!
//! Spec: `protocol-llc-cdc.md` §1.6 (LLC flow serialization), §1.11
//! (CONFIRM_RKEY / DELETE_RKEY), §9 (which link). Linux: smc_llc.c
//! `smc_llc_do_confirm_rkey`, `smc_llc_do_delete_rkey`.

use super::conn::Phase;
use super::{ConnId, Endpoint, LgrId};
use smc_proto::Timestamp;
use smc_rdma::{MemoryRegion, Provider};
use smc_wire::clc::{ClcMessage, DeclineCode, CLC_WAIT_TIME};

/// An rkey flow waiting for the link group's LLC flow slot (§1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RkeyFlow {
    /// CONFIRM_RKEY for the RMB of this connection (its handshake waits).
    Confirm(ConnId),
    /// DELETE_RKEY for a released RMB.
    Delete(u32),
}

/// Flow tags: confirm flows carry the connection id
/// ([`ConnId::to_bits`]: its slot in the high half never reaches 2^31, there
/// is no memory for that many connections), delete flows this bit.
pub(super) const DELETE_TAG: u64 = 1 << 63;

impl<P: Provider> Endpoint<P> {
    /// Announces the connection's RMB with CONFIRM_RKEY (§1.11); its phase must
    /// already say what follows ([`Self::on_rkey_done`]). An RMB the peer still
    /// knows from an earlier connection needs no flow (see `known_rkeys`).
    pub(super) fn start_rkey_flow(&mut self, id: ConnId, l: LgrId, now: Timestamp) -> bool {
        let Some(rkey) = self.core(id).and_then(|k| k.rmb.as_ref().map(|m| m.rkey())) else {
            return false;
        };
        let known = self.lgrs.get(l).is_some_and(|lg| {
            lg.links.iter().flatten().count() == 1 && lg.known_rkeys.contains(&rkey)
        });
        if known {
            self.on_rkey_done(id, true);
            return true;
        }
        match self.lgrs.get_mut(l) {
            // One local LLC flow at a time (§1.6): a busy group queues the
            // connection and pump() starts its flow when the slot frees.
            Some(lg) => lg.rkey_queue.push_back(RkeyFlow::Confirm(id)),
            None => return false,
        }
        self.retry_rkey_flows(l, now);
        true
    }

    pub(super) fn on_rkey_done(&mut self, id: ConnId, ok: bool) {
        let phase = self.conn(id).map(|c| c.phase.clone());
        match phase {
            Some(Phase::ClientRkey { confirm }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Confirm(*confirm));
                    self.established(id);
                } else {
                    self.decline(id, confirm.version, DeclineCode::ErrRegBuf);
                }
            }
            Some(Phase::ServerRkey {
                accept,
                version,
                early,
            }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Accept(*accept));
                    let deadline = self.now + CLC_WAIT_TIME;
                    if let Some(c) = self.conn(id) {
                        c.phase = Phase::AwaitConfirm {
                            version,
                            first_contact: false,
                            deadline,
                            early,
                        };
                    }
                } else {
                    self.decline(id, version, DeclineCode::ErrRegBuf);
                }
            }
            _ => {}
        }
    }

    pub(super) fn retry_rkey_flows(&mut self, l: LgrId, now: Timestamp) {
        loop {
            let Some(&flow) = self.lgrs.get(l).and_then(|lg| lg.rkey_queue.front()) else {
                return;
            };
            // CONFIRM_RKEY on the connection's link, entry 0 for that link and one
            // entry per other active link (the RMB's rkey and address on each
            // link's device, `devices`); DELETE_RKEY on the first usable link
            // (§9), with the rkey on that link.
            let confirm = match flow {
                RkeyFlow::Confirm(id) => Some(self.core(id).and_then(|k| {
                    Some((k.rmb.as_ref()?, k.link?)).map(|(m, slot)| (m.rkey(), m.addr(), slot))
                })),
                RkeyFlow::Delete(_) => None,
            };
            let Some(lg) = self.lgrs.get_mut(l) else {
                return;
            };
            let started = match (flow, confirm) {
                // the connection went away while waiting: drop its flow
                (RkeyFlow::Confirm(_), Some(None)) | (RkeyFlow::Confirm(_), None) => true,
                (RkeyFlow::Confirm(id), Some(Some((rkey, addr, slot)))) => {
                    let others: Vec<(usize, u32, u64)> = lg
                        .group
                        .active_slots()
                        .filter(|&s| s != slot)
                        .map(|s| {
                            let (k, a) = lg.rmb_token(s, rkey, addr);
                            (s, k, a)
                        })
                        .collect();
                    let (k, a) = lg.rmb_token(slot, rkey, addr);
                    lg.group
                        .start_confirm_rkey(slot, k, a, &others, id.to_bits(), now)
                }
                (RkeyFlow::Delete(rkey), _) => match lg.group.active_slots().min() {
                    Some(slot) => {
                        let (k, _) = lg.rmb_token(slot, rkey, 0);
                        lg.group
                            .start_delete_rkey(slot, k, DELETE_TAG | u64::from(rkey), now)
                    }
                    None => false,
                },
            };
            if !started {
                return;
            }
            lg.rkey_queue.pop_front();
        }
    }
}
