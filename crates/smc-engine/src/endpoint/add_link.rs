//! Further links negotiated with the peer: the driver's part of smc-proto's
//! ADD_LINK flow (`protocol-llc-cdc.md` §1.8) — a server prepares the new
//! link's QP and starts the flow once its group has one usable link and
//! wants another; a client prepares and connects a QP for the server's offer;
//! the server connects its QP to the client's answer; a flow that ended
//! before its link existed frees the QP. The rkeys announced for the new link
//! are those of every RMB in use, on the new link's device (the group's
//! second PD when the link is on the endpoint's second device, see
//! `endpoint/devices.rs`; one PD per group and device, see
//! `endpoint/link.rs`).
//!
//! Linux: smc_llc.c `smc_llc_srv_add_link`, `smc_llc_cli_add_link`;
//! smc_core.c `smcr_link_init`.

use super::{Endpoint, LgrId};
use smc_proto::link::{PeerPort, Redundancy, Role};
use smc_proto::Timestamp;
use smc_rdma::{MemoryRegion, Provider};

impl<P: Provider> Endpoint<P> {
    /// Whether and how link groups add further links (§1.8): off by default
    /// (one link per group; a peer's ADD_LINK is rejected, and as a server
    /// we agree on max_links 1). On, a server agrees on two links and adds
    /// the second after the first contact, and again after one was lost; a
    /// client answers (or, without an alternate path on either side,
    /// rejects). Applies to existing groups too.
    ///
    /// `alternate` declares a second path: the endpoint's second device
    /// ([`Self::open_second_device`]), on which further links go; without
    /// one, all links of a group share the device's port, and its failure
    /// takes every link.
    pub fn set_redundancy(&mut self, r: Redundancy) {
        self.redundancy = r;
        for lg in self.lgrs.iter_mut().flatten() {
            lg.group.set_redundancy(r);
        }
    }

    /// The rkey list of a new link on the second device (`second`) or the
    /// first: every RMB in use as (rkey on an existing link — the first
    /// usable one, where the flow runs —, rkey on the new link, address on
    /// the new link).
    pub(super) fn add_link_rkeys(&self, l: LgrId, second: bool) -> Vec<(u32, u32, u64)> {
        let Some(lg) = self.lgrs.get(l).and_then(Option::as_ref) else {
            return Vec::new();
        };
        let via = lg.group.active_slots().next().unwrap_or(0);
        lg.tokens
            .values()
            .filter_map(|&id| {
                let k = self.core(id)?;
                let m = k.rmb.as_ref()?;
                let (old, _) = lg.rmb_token(via, m.rkey(), m.addr());
                let (new, addr) = lg.rmb_token_on(second, m.rkey(), m.addr());
                Some((old, new, addr))
            })
            .collect()
    }

    /// Server: starts the ADD_LINK flow if group `l` wants one now. True if
    /// it started (or could not and gave up), so that outputs may follow.
    pub(super) fn maybe_add_link(&mut self, l: LgrId, now: Timestamp) -> bool {
        let ready = self.lgrs.get(l).and_then(Option::as_ref).is_some_and(|lg| {
            lg.role == Role::Server
                && lg.state.accepts_connections()
                && lg.group.can_start_add_link()
        });
        if !ready {
            return false;
        }
        let mtu = self.port_mtu;
        let mac = self.mac;
        let psn = self.psns.next_psn();
        let slot = self.lgrs.get(l).and_then(Option::as_ref).and_then(|lg| {
            lg.group
                .add_slot()
                .filter(|&s| lg.links.get(s).is_some_and(Option::is_none))
        });
        let res = slot.and_then(|_| self.new_link(l, psn).ok());
        let rkeys = res
            .as_ref()
            .map(|r| self.add_link_rkeys(l, r.on.is_some()))
            .unwrap_or_default();
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return false;
        };
        let (Some(slot), Some(res)) = (slot, res) else {
            // no QP for it now: wait for the next trigger
            lg.group.add_link_unavailable();
            return true;
        };
        let (gid, mtu) = res.port(lg.local, mtu);
        let local = res.local_port(gid.gid, mac, mtu);
        lg.links[slot] = Some(res);
        // the peer's table gets the new link's column from this flow; a
        // pooled RMB it still knows needs CONFIRM_RKEY again to get one
        lg.known_rkeys.clear();
        if !lg.group.start_add_link(slot, local, &rkeys, now) {
            if let Some(r) = lg.links[slot].take() {
                r.shut();
            }
            lg.group.add_link_unavailable();
        }
        true
    }

    /// Client: the server offers a link in `slot`: a QP for it, connected to
    /// the server's (RTR and RTS: the server sends CONFIRM_LINK on it only
    /// after our response), and our response; a QP we cannot make or
    /// connect rejects the offer.
    pub(super) fn on_add_link_offer(
        &mut self,
        l: LgrId,
        slot: usize,
        peer: PeerPort,
        now: Timestamp,
    ) {
        let mtu = self.port_mtu;
        let mac = self.mac;
        let psn = self.psns.next_psn();
        let free = self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .is_some_and(|lg| lg.links.get(slot).is_some_and(Option::is_none));
        let res = free.then(|| self.new_link(l, psn).ok()).flatten();
        let rkeys = res
            .as_ref()
            .map(|r| self.add_link_rkeys(l, r.on.is_some()))
            .unwrap_or_default();
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return;
        };
        let Some(mut res) = res else {
            lg.group.refuse_add_link();
            return;
        };
        let (gid, mtu) = res.port(lg.local, mtu);
        if res.connect(&peer, mtu, gid.index).is_err() {
            res.shut();
            lg.group.refuse_add_link();
            return;
        }
        let local = res.local_port(gid.gid, mac, mtu);
        lg.links[slot] = Some(res);
        lg.known_rkeys.clear();
        lg.group.accept_add_link(local, &rkeys, now);
    }

    /// Server: the client answered; our QP in `slot` connects to its end.
    pub(super) fn on_connect_link(&mut self, l: LgrId, slot: usize, peer: PeerPort) {
        let mtu = self.port_mtu;
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return;
        };
        let group = lg.local;
        let ok = lg
            .links
            .get_mut(slot)
            .and_then(Option::as_mut)
            .is_some_and(|r| {
                let (gid, mtu) = r.port(group, mtu);
                r.connect(&peer, mtu, gid.index).is_ok()
            });
        if !ok {
            lg.group.on_link_failure(slot);
        }
    }

    /// An ADD_LINK flow ended before its link existed: its QP goes.
    pub(super) fn on_add_link_failed(&mut self, l: LgrId, slot: usize) {
        if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
            if lg.group.link(slot).is_none() {
                if let Some(r) = lg.links.get_mut(slot).and_then(Option::take) {
                    r.shut();
                }
            }
        }
    }
}

impl<P: Provider> Endpoint<P> {
    /// The redundancy type of group `l` (Linux's SINGLE, SYMMETRIC, ...).
    pub fn link_group_type(&self, l: LgrId) -> Option<smc_proto::link::LgrType> {
        Some(self.lgrs.get(l)?.as_ref()?.group.lgr_type())
    }

    /// An ADD_LINK flow runs in group `l`.
    pub fn adding_link(&self, l: LgrId) -> bool {
        self.lgrs
            .get(l)
            .and_then(Option::as_ref)
            .is_some_and(|lg| lg.group.adding_link())
    }
}
