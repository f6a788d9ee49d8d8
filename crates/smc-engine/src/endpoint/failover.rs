//! Links going down and connections changing link: a failed link's
//! connections fail over to a usable link of their group (rewind, validation
//! CDC, replay) or are aborted; [`Endpoint::move_connection`] moves one
//! between healthy links. See the module documentation of `endpoint.rs`
//! ("Links") for the two ways.
//!
//! Spec: `protocol-llc-cdc.md` §7 (link failover: triggers, procedure, last
//! link), §2.4 (failover validation CDC). Linux: smc_core.c
//! (`smcr_link_down`, `smc_switch_conns`), smc_cdc.c
//! (`smcr_cdc_msg_send_validation`).

use super::conn::Phase;
use super::conn_core::lock;
use super::events::AbortCause;
use super::{ConnId, Endpoint, LgrId, Result};
use crate::state::{LgrAction, LgrEvent};
use smc_proto::close::{CloseEvent, CloseFlags};
use smc_proto::datapath::FAILOVER_RESERVE;
use smc_proto::Timestamp;
use smc_rdma::Provider;

impl<P: Provider> Endpoint<P> {
    /// Link `slot` of group `l` went down (§7). What it still completed or
    /// received counts; then its connections move to a usable link (§7.2) — or,
    /// with none left, stay to be killed when the group terminates (§7.3) — and
    /// its QP is stopped and its slot freed.
    pub(super) fn on_link_down(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        self.sweep_due = true;
        let usable_left = self
            .lgrs
            .get(l)
            .is_some_and(|lg| lg.group.usable_links() > 0);
        // (no receive dispatch of the connections' on it from here on: its
        // last poll below takes what one left, `cdc_recv::dispatch`)
        if let Some(res) = self
            .lgrs
            .get(l)
            .and_then(|lg| lg.links.get(slot))
            .and_then(Option::as_ref)
        {
            res.rx.set_open(false);
        }
        self.poll_send(l, slot)?;
        self.poll_recv(l, slot, now)?;
        if self.lgr_step(l, LgrEvent::LinkDown { usable_left }) == LgrAction::MoveConnections {
            let ids: Vec<ConnId> = self
                .lgrs
                .get(l)
                .map(|lg| lg.tokens.values().copied().collect())
                .unwrap_or_default();
            for id in ids {
                let Some(mut k) = self.core(id) else { continue };
                if k.move_to == Some(slot) {
                    k.move_to = None;
                }
                if k.link != Some(slot) {
                    continue;
                }
                let row = k.peer_rmb.map(|p| p.row);
                drop(k);
                match self.pick_link(l, row, Some(slot)) {
                    Some(to) => {
                        if self.failover(id, to) {
                            self.event_moved(l, id, slot, to);
                        } else {
                            self.event_aborted(id, AbortCause::FailoverLoss);
                        }
                    }
                    // No link has the peer's rkey for this RMB: it cannot be
                    // written any more. Abort; the abort CDC needs no rkey and
                    // goes out whatever the close state (a close CDC it may have
                    // owed could not go out either).
                    None => {
                        let to = self.pick_link(l, None, Some(slot));
                        self.event_aborted(id, AbortCause::NoLink);
                        if let Some(mut k) = self.core(id) {
                            k.set_link(to);
                            k.closer.handle(CloseEvent::Kill { can_send: true });
                            if let Some(dp) = k.dp.as_mut() {
                                dp.failover_rewind();
                                dp.set_close_flags(CloseFlags {
                                    done_writing: false,
                                    closed: false,
                                    abort: true,
                                });
                            }
                        }
                    }
                }
            }
        }
        if let Some(lg) = self.lgrs.get_mut(l) {
            if let Some(res) = lg.links.get_mut(slot).and_then(Option::take) {
                res.shut();
            }
            lg.group.clear_link(slot);
        }
        Ok(())
    }

    /// Moves connection `id` to link `to` because its link failed (§7.2): an
    /// established connection rewinds its sender and sends the failover
    /// validation CDC first; a handshake in progress is just re-pointed.
    /// False if the connection was aborted instead.
    fn failover(&mut self, id: ConnId, to: usize) -> bool {
        // the peer's RMB has the new link's rkey there: ready it first
        let smc = matches!(self.conn(id).map(|c| &c.phase), Some(Phase::Smc { .. }));
        let prepared = !smc || self.prepare_peer_rmb(id, to).is_ok();
        let Some(mut k) = self.core(id) else {
            return true;
        };
        let k = &mut *k;
        k.set_link(Some(to));
        k.move_to = None;
        if smc {
            if let Some(dp) = k.dp.as_mut() {
                // Written directly and not confirmed: not in the send buffer,
                // so it cannot be replayed; or the new link cannot reach the
                // peer's RMB. Abort this connection (only) rather than
                // deliver garbage or fail the new link's QP.
                if dp.replay_from() < k.direct_sent || !prepared {
                    // (a direct write: a group that had one link when it was
                    // written; see `write_direct`)
                    k.closer.handle(CloseEvent::Kill { can_send: true });
                    dp.failover_rewind();
                    dp.set_close_flags(CloseFlags {
                        done_writing: false,
                        closed: false,
                        abort: true,
                    });
                    return false;
                }
                k.validation = Some(dp.failover_rewind());
            }
        }
        true
    }

    /// Moves an established connection to the usable link `slot` of its group
    /// (both links healthy; a failed link's connections move by themselves).
    /// The connection stops sending on its old link and switches once none of
    /// its CDCs is in flight there, so nothing is sent twice and nothing of the
    /// old link can overtake the new one. False if the connection is not
    /// established, is already there, or the link is not usable for it (not
    /// active, the peer's rkey for its RMB is unknown on that link, or the
    /// link's QP cannot be readied for it, `QueuePair::prepare_remote`).
    pub fn move_connection(&mut self, id: ConnId, slot: usize) -> bool {
        self.sweep_due = true;
        let Some(c) = self.conns.get(id) else {
            return false;
        };
        let k = lock(&c.core);
        let (Some(l), Some(row)) = (c.lgr, k.peer_rmb.map(|p| p.row)) else {
            return false;
        };
        if !matches!(c.phase, Phase::Smc { .. }) || k.link == Some(slot) {
            return false;
        }
        drop(k);
        let usable = self.lgrs.get(l).is_some_and(|lg| {
            lg.group.active_slots().any(|s| s == slot)
                && lg
                    .links
                    .get(slot)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.connected)
                && lg
                    .group
                    .rtoken(row)
                    .is_some_and(|t| t.get(slot).is_some_and(Option::is_some))
        });
        // The peer's RMB has that link's rkey there: ready it before the
        // move; a connection that cannot be readied on the link stays where
        // it is, on its healthy link.
        let usable = usable && self.prepare_peer_rmb(id, slot).is_ok();
        if usable {
            if let Some(mut k) = self.core(id) {
                k.move_to = Some(slot);
            }
        }
        usable
    }
}

impl<P: Provider> Endpoint<P> {
    /// A link of group `l` became usable: once the group has two, it can
    /// fail over, and its connections keep the failover reserve in the
    /// peer's RMBE (`DataPath::set_failover_reserve`: Linux does not send
    /// again a consumer update lost with the failed link, and answers a
    /// request for it only when it reads bytes it has not seen). This covers
    /// the connections set up without it: while our redundancy was off
    /// (`set_redundancy` applies to existing groups), or in a group agreed on
    /// one link. Connections still in their handshake get it with their data
    /// path (`setup_datapath`, from `Lgr::multi_link`).
    pub(super) fn group_can_fail_over(&mut self, l: LgrId) {
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        if lg.multi_link || lg.group.usable_links() < 2 {
            return;
        }
        lg.multi_link = true;
        let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
        for id in ids {
            if let Some(dp) = self.core(id).as_mut().and_then(|k| k.dp.as_mut()) {
                dp.set_failover_reserve(FAILOVER_RESERVE);
            }
        }
    }
}
