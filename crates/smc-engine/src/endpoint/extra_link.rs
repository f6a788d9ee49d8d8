//! Further links of a link group without the ADD_LINK flow, for tests (the
//! negotiated way is `endpoint/add_link.rs`): each end offers a prepared QP
//! ([`LinkOffer`], what ADD_LINK and ADD_LINK_CONT carry), then accepts the
//! other's; the CONFIRM_LINK exchange follows.
//!
//! Spec: `protocol-llc-cdc.md` §1.8 (adding a link). Linux: smc_llc.c
//! `smc_llc_srv_add_link`, `smc_llc_cli_add_link`.

use super::link::LinkRes;
use super::{Endpoint, LgrId, Result};
use smc_proto::link::{PeerPort, Role, LINK_SLOTS};
use smc_proto::Timestamp;
use smc_rdma::{Device, Provider, QueuePair};
use smc_wire::types::{Gid, Mac};

/// What one side offers for a further link of a group: what the ADD_LINK and
/// ADD_LINK_CONT messages of §1.8 would carry. Tests only
/// ([`Endpoint::extra_link_offer`]); endpoints negotiate by ADD_LINK.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkOffer {
    /// GID of the new link's port.
    pub gid: Gid,
    /// MAC of the new link's port.
    pub mac: Mac,
    /// QP number of the new link.
    pub qpn: u32,
    /// Initial PSN of the new link's QP.
    pub psn: u32,
    /// Path MTU (IB enum).
    pub mtu: u8,
    /// The link id (the server's choice; 0 from a client).
    pub link_id: u8,
    /// Every in-use RMB: (rkey on an existing link, rkey on the new link,
    /// address on the new link).
    pub rkeys: Vec<(u32, u32, u64)>,
}

impl<P: Provider> Endpoint<P> {
    /// Tests only (endpoints negotiate by ADD_LINK, §1.8): prepares a
    /// further link of an active group — a QP in the lowest free slot, in INIT
    /// with its receive buffers posted — and returns what the peer needs to know
    /// (what ADD_LINK and ADD_LINK_CONT would carry). Both ends offer, then both
    /// accept the other's offer with [`Self::extra_link_accept`]; the
    /// CONFIRM_LINK exchange then runs on the new link, and once it is active new
    /// connections may be assigned to it and failed links' connections move to it.
    ///
    /// Offer only when [`Self::extra_link_ready`] holds on both ends: the rkey
    /// list is taken now, so no rkey flow may be under way (Linux's ADD_LINK
    /// flow excludes them, §1.6); CONFIRM_RKEY flows wait until the new link is
    /// confirmed and then announce their RMB for it too.
    #[doc(hidden)]
    pub fn extra_link_offer(&mut self, l: LgrId) -> Result<LinkOffer> {
        let mtu = self.dev.query_port(1)?.active_mtu;
        let bad = |m: &str| smc_rdma::Error::InvalidArgument(m.into());
        if !self.extra_link_ready(l) {
            return Err(bad("link group not ready for a further link"));
        }
        let rkeys = self.add_link_rkeys(l, false);
        let lg = self.lgrs.get_mut(l).ok_or_else(|| bad("no link group"))?;
        let slot = lg
            .group
            .free_slot()
            .ok_or_else(|| bad("no free link slot"))?;
        let psn = self.psns.next_psn();
        let mut res: LinkRes<P> = LinkRes::new(&self.dev, &lg.pd, &self.chan, self.limits, psn)?;
        lg.known_rkeys.clear();
        if lg.role == Role::Server {
            res.offered_id = lg.group.next_link_id();
        }
        let offer = LinkOffer {
            gid: lg.local.gid,
            mac: self.mac,
            qpn: res.qp.qp_num(),
            psn: res.psn,
            mtu: mtu.code(),
            link_id: res.offered_id,
            rkeys,
        };
        lg.links[slot] = Some(res);
        Ok(offer)
    }

    /// Test and simulation only: a further link may be offered now — the group
    /// is active, has a free slot, no link is being added and no rkey flow is
    /// running or queued.
    #[doc(hidden)]
    pub fn extra_link_ready(&self, l: LgrId) -> bool {
        self.lgrs.get(l).is_some_and(|lg| {
            lg.state.accepts_connections()
                && !lg.group.is_terminated()
                && !lg.group.adding_link()
                && !lg.group.local_flow_busy()
                && lg.rkey_queue.is_empty()
                && lg
                    .group
                    .free_slot()
                    .is_some_and(|s| lg.links.get(s).is_some_and(Option::is_none))
        })
    }

    /// Test and simulation only: connects the link prepared by
    /// [`Self::extra_link_offer`] to the peer's offered link, records the peer's
    /// rkeys for it and starts its CONFIRM_LINK exchange. Returns its slot.
    #[doc(hidden)]
    pub fn extra_link_accept(
        &mut self,
        l: LgrId,
        peer: &LinkOffer,
        now: Timestamp,
    ) -> Result<usize> {
        let mtu = self.dev.query_port(1)?.active_mtu;
        let mac = self.mac;
        let bad = |m: &str| smc_rdma::Error::InvalidArgument(m.into());
        let lg = self.lgrs.get_mut(l).ok_or_else(|| bad("no link group"))?;
        let slot = (0..LINK_SLOTS)
            .find(|&s| {
                lg.group.link(s).is_none()
                    && lg
                        .links
                        .get(s)
                        .and_then(Option::as_ref)
                        .is_some_and(|r| !r.connected)
            })
            .ok_or_else(|| bad("no offered link"))?;
        let res = lg.links[slot]
            .as_mut()
            .ok_or_else(|| bad("no offered link"))?;
        let link_id = match lg.role {
            Role::Server => res.offered_id,
            Role::Client => peer.link_id,
        };
        let peer_port = PeerPort {
            gid: peer.gid,
            mac: peer.mac,
            qpn: peer.qpn,
            psn: peer.psn,
            mtu: peer.mtu,
        };
        res.connect(&peer_port, mtu, lg.local.index)?;
        let local = res.local_port(lg.local.gid, mac, mtu);
        if lg.group.add_link(link_id, local, peer_port, now) != Some(slot) {
            return Err(bad("link group refused the link"));
        }
        lg.group.add_link_rtokens(slot, &peer.rkeys);
        Ok(slot)
    }
}
