//! What a link group's LLC state machine (smc-proto's [`LinkGroup`]) decided,
//! carried out: LLC messages posted on the link smc-proto chose (CONFIRM_LINK,
//! TEST_LINK, DELETE_LINK, CONFIRM_RKEY, DELETE_RKEY and their responses),
//! links that came up or went down, a terminated group, finished rkey flows.
//! Also the device's asynchronous events and provider errors on posting,
//! which take links down.
//!
//! Received LLC messages reach smc-proto from `cdc_recv.rs` (one receive path
//! for both kinds). Spec: `protocol-llc-cdc.md` §1 (LLC), §1.9 (DELETE_LINK),
//! §1.10 (TEST_LINK), §7.1 (what takes a link down), §9 (which link carries
//! which message). Linux: smc_llc.c, smc_ib.c (`smc_ib_global_event_handler`,
//! `smc_ib_qp_event_handler`).
//!
//! [`LinkGroup`]: smc_proto::link::LinkGroup

use super::devices::port_up;
use super::link::{LinkRes, WrKind};
use super::rkey::DELETE_TAG;
use super::{ConnId, Endpoint, LgrId, Result};
use crate::state::{LgrAction, LgrEvent};
use smc_proto::link::{LgrOutput, LINK_SLOTS};
use smc_proto::Timestamp;
use smc_rdma::{AsyncEvent, Device, Provider};

impl<P: Provider> Endpoint<P> {
    /// A device event: a QP or the port failed — link down at once (§7.1) rather
    /// than at the next send or keepalive. A port coming back is a trigger for
    /// a server to add a link again (§7.4, Linux `smcr_port_add`).
    /// `second`: the event is the second device's (`endpoint/devices.rs`).
    pub(super) fn on_async_event(&mut self, second: bool, ev: AsyncEvent) {
        if !second {
            if let Ok(p) = self.dev.query_port(1) {
                self.port_mtu = p.active_mtu;
            }
        }
        // (the GIDs of the port that came up, for a client's invitation)
        let up_gids: Vec<smc_rdma::GidEntry> = match ev {
            AsyncEvent::PortActive { .. } if second => self
                .dev2
                .as_ref()
                .and_then(|d| d.query_port(1).ok())
                .map(|p| p.gids)
                .unwrap_or_default(),
            AsyncEvent::PortActive { .. } => self.gids.clone(),
            _ => Vec::new(),
        };
        let (mac, gids) = (self.mac, &self.gids);
        for lg in self.lgrs.values_mut() {
            if matches!(ev, AsyncEvent::PortActive { .. }) {
                lg.group.request_add_link();
                // A client invites the server (Linux `smcr_port_add`, for
                // either role; the client's part `smc_llc_cli_add_link_invite`)
                // with the port's GIDs of the group's kind (RoCE v1 or v2,
                // IPv4-mapped or not).
                let kind = |g: &smc_rdma::GidEntry| (g.gid_type, g.gid.to_ipv4_mapped().is_some());
                let want = gids.iter().find(|g| g.index == lg.local.index).map(kind);
                let of_kind: Vec<smc_wire::types::Gid> = up_gids
                    .iter()
                    .filter(|g| want.is_none_or(|w| kind(g) == w))
                    .map(|g| g.gid)
                    .collect();
                let alt = of_kind.first().map(|&g| (mac, g));
                lg.group.invite_add_link(&of_kind, alt);
                if let Some(slot) = Self::link_to_replace(second, lg) {
                    lg.group.on_link_failure(slot);
                }
            }
            for slot in 0..LINK_SLOTS {
                let Some(res) = lg.links[slot].as_ref() else {
                    continue;
                };
                // (the links on that device, all on its port 1)
                if Self::event_hits(second, ev, res) {
                    lg.group.on_link_failure(slot);
                }
            }
        }
        // (the groups' timers may have moved: a trigger resets the retries
        // of a failed ADD_LINK flow; this pump looks at them again)
        self.lgr_recheck = true;
    }

    /// The port of the second device (`second`) or the first came back:
    /// the link of group `lg` to replace by one over it, if the group has
    /// no link on that device and two usable ones sharing the other (the
    /// asymmetric link added when this port was lost, smc-proto's
    /// `add_flow_after_loss`). Taking it down moves its connections to the
    /// other link (§7.2, nothing lost) and tells the peer by DELETE_LINK;
    /// with one link left the server adds one again, on the device with
    /// fewer links of the group — the one that came back (see
    /// `endpoint/devices.rs`); a client's DELETE_LINK makes the server do
    /// so. Linux gets there from smc_core.c `smcr_port_add` (an ADD_LINK
    /// for the new port, or the v2 client's REQ_ADD_LINK) and smc_llc.c
    /// `smc_llc_delete_asym_link` once the group is symmetric again; here,
    /// with at most one ADD_LINK flow and two links wanted, the asymmetric
    /// link goes first. The one replaced: the one of the highest link id on
    /// the shared device (the last added), which both ends pick alike when
    /// both see their port come back.
    fn link_to_replace(second: bool, lg: &super::lgr::Lgr<P>) -> Option<usize> {
        let active: Vec<usize> = lg.group.active_slots().collect();
        let on = |s: usize| lg.links[s].as_ref().map(|r| r.on.is_some());
        if active.iter().any(|&s| on(s) == Some(second)) {
            return None;
        }
        let shared: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&s| on(s) == Some(!second))
            .collect();
        let id = |s: &usize| lg.group.link(*s).map_or(0, |l| l.link_id);
        (shared.len() >= 2)
            .then(|| shared.iter().copied().max_by_key(id))
            .flatten()
    }

    /// A link of group `l` became active: if a port came back while it was
    /// being added (the PortActive seen with the ADD_LINK flow under way,
    /// which then put the link next to the other), the asymmetric link is
    /// replaced now ([`Self::link_to_replace`]).
    fn replace_asymmetric_link(&mut self, l: LgrId) {
        let ups = [port_up(&self.dev), self.dev2.as_ref().is_some_and(port_up)];
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        for (second, is_up) in [false, true].into_iter().zip(ups) {
            if let Some(slot) = is_up.then(|| Self::link_to_replace(second, lg)).flatten() {
                lg.group.on_link_failure(slot);
                return;
            }
        }
    }

    /// A provider error while posting on link `slot`: a failed QP takes the link
    /// down (§7.1: "failure to post a send"); anything else is the caller's.
    pub(super) fn link_error(&mut self, l: LgrId, slot: usize, e: smc_rdma::Error) -> Result<()> {
        let Some(lg) = self.lgrs.get_mut(l) else {
            return Ok(());
        };
        let failed = lg
            .links
            .get(slot)
            .and_then(Option::as_ref)
            .is_none_or(LinkRes::failed);
        if !failed {
            return Err(e);
        }
        lg.group.on_link_failure(slot);
        Ok(())
    }

    pub(super) fn drain_lgr(&mut self, l: LgrId, now: Timestamp) -> Result<()> {
        loop {
            let Some(lg) = self.lgrs.get_mut(l) else {
                return Ok(());
            };
            let Some(o) = lg.group.poll_output() else {
                // a server that wants a further link starts its flow (§1.8)
                if self.maybe_add_link(l, now) {
                    // (its flow's deadline: see `endpoint/timers.rs`)
                    self.lgr_recheck = true;
                    continue;
                }
                return Ok(());
            };
            if !matches!(
                o,
                LgrOutput::SendLlc { .. } | LgrOutput::RkeyFlowDone { .. }
            ) {
                // links change what connections can send (an rkey flow's
                // end is its connection's alone: `on_rkey_done`)
                self.sweep_due = true;
            }
            match o {
                LgrOutput::SendLlc { slot, msg } => {
                    // LLC responses on the link of the request, the rest as
                    // smc-proto chose (§9); a link already released sends nothing.
                    let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                        continue;
                    };
                    let bytes = msg.encode();
                    if let Some(b) = res.bringup.as_mut() {
                        // (its QP is still being connected: the message
                        // goes once it is, `link_bringup_done`)
                        b.held.push(bytes);
                        continue;
                    }
                    self.llc_sent += 1;
                    if let Err(e) = res.post(WrKind::Llc, &bytes) {
                        self.link_error(l, slot, e)?;
                    }
                }
                LgrOutput::LinkActive { slot } => {
                    self.event_link_up(l, slot);
                    self.group_can_fail_over(l);
                    if self.lgr_step(l, LgrEvent::LinkActive) == LgrAction::Nothing {
                        // (a further link: the first's connections wait for
                        // it, `EstablishWaiting`)
                        self.spread_to(l, slot);
                    }
                    self.replace_asymmetric_link(l);
                }
                LgrOutput::LinkDown { slot, reason } => {
                    self.event_link_down(l, slot, reason);
                    self.on_link_down(l, slot, now)?
                }
                LgrOutput::Terminated { .. } => {
                    self.lgr_step(l, LgrEvent::Terminated);
                }
                LgrOutput::AddLinkOffer { slot, peer, .. } => {
                    self.on_add_link_offer(l, slot, peer, now)
                }
                LgrOutput::ConnectLink { slot, peer } => self.on_connect_link(l, slot, peer, now),
                LgrOutput::AddLinkFailed { slot } => self.on_add_link_failed(l, slot),
                LgrOutput::RkeyFlowDone { tag, .. } if tag & DELETE_TAG != 0 => {}
                LgrOutput::RkeyFlowDone { tag, ok } => {
                    // (a connection freed meanwhile: its id finds nothing)
                    let id = ConnId::from_bits(tag);
                    self.on_rkey_done(id, ok);
                    self.conn_event(id);
                }
            }
        }
    }
}
