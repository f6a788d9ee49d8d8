//! Further links negotiated with the peer: the driver's part of smc-proto's
//! ADD_LINK flow (`protocol-llc-cdc.md` §1.8) — a server prepares the new
//! link's QP and starts the flow once its group has one usable link and
//! wants another; a client prepares and connects a QP for the server's offer;
//! the server connects its QP to the client's answer; a flow that ended
//! before its link existed frees the QP. The rkeys announced for the new link
//! are those of every RMB in use (one protection domain per group, so an
//! RMB's rkey is the same on every link, see `endpoint/link.rs`).
//!
//! Linux: smc_llc.c `smc_llc_srv_add_link`, `smc_llc_cli_add_link`;
//! smc_core.c `smcr_link_init`.

use super::link::LinkRes;
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
    /// All links of a group use the endpoint's device (one device per
    /// endpoint in this version), so `alternate` declares a second path
    /// the driver knows of; a port failure still takes every link.
    pub fn set_redundancy(&mut self, r: Redundancy) {
        self.redundancy = r;
        for lg in self.lgrs.iter_mut().flatten() {
            lg.group.set_redundancy(r);
        }
    }

    /// The rkey list of a new link: every RMB in use as (rkey on the
    /// existing links, rkey on the new link, address on the new link).
    pub(super) fn add_link_rkeys(&self, l: LgrId) -> Vec<(u32, u32, u64)> {
        let Some(lg) = self.lgrs.get(l).and_then(Option::as_ref) else {
            return Vec::new();
        };
        lg.tokens
            .values()
            .filter_map(|&id| {
                let k = self.core(id)?;
                k.rmb.as_ref().map(|m| (m.rkey(), m.rkey(), m.addr()))
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
        let rkeys = self.add_link_rkeys(l);
        let mtu = self.port_mtu;
        let mac = self.mac;
        let psn = self.psns.next_psn();
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return false;
        };
        let slot = lg
            .group
            .add_slot()
            .filter(|&s| lg.links.get(s).is_some_and(Option::is_none));
        let res = slot.and_then(|_| {
            LinkRes::<P>::new(&self.dev, &lg.pd, &self.chan, self.max_inline, psn).ok()
        });
        let (Some(slot), Some(res)) = (slot, res) else {
            // no QP for it now: wait for the next trigger
            lg.group.add_link_unavailable();
            return true;
        };
        let local = res.local_port(lg.local.gid, mac, mtu);
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
        let rkeys = self.add_link_rkeys(l);
        let mtu = self.port_mtu;
        let mac = self.mac;
        let psn = self.psns.next_psn();
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return;
        };
        let free = lg.links.get(slot).is_some_and(Option::is_none);
        let res = free
            .then(|| LinkRes::<P>::new(&self.dev, &lg.pd, &self.chan, self.max_inline, psn).ok())
            .flatten();
        let Some(mut res) = res else {
            lg.group.refuse_add_link();
            return;
        };
        if res.connect(&peer, mtu, lg.local.index).is_err() {
            res.shut();
            lg.group.refuse_add_link();
            return;
        }
        let local = res.local_port(lg.local.gid, mac, mtu);
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
        let index = lg.local.index;
        let ok = lg
            .links
            .get_mut(slot)
            .and_then(Option::as_mut)
            .is_some_and(|r| r.connect(&peer, mtu, index).is_ok());
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
