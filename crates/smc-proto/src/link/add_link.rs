//! The ADD_LINK flow (`protocol-llc-cdc.md` §1.8): a server adds a further
//! link to a group whose first link is up; the client answers, the rkeys of
//! every RMB travel both ways (v1: ADD_LINK_CONT messages, alternating and
//! the server's first; v2: the ADD_LINK extension of request and response),
//! and the CONFIRM_LINK exchange on the new link makes it active.
//!
//! Linux: smc_llc.c `smc_llc_srv_add_link`, `smc_llc_cli_add_link`,
//! `smc_llc_srv_rkey_exchange`, `smc_llc_cli_rkey_exchange`,
//! `smc_llc_add_link_cont`, `smc_llc_srv_conf_link`, `smc_llc_cli_conf_link`,
//! `smc_llc_cli_add_link_reject`.
//!
//! The flow holds the group's local LLC flow slot (§1.6): no rkey flow of
//! ours starts while it runs, so every RMB in use is either in the rkey
//! exchange or announced afterwards for the new link too. The driver owns the
//! new link's QP: a server prepares it before [`LinkGroup::start_add_link`]
//! and connects it at [`LgrOutput::ConnectLink`]; a client prepares and
//! connects it at [`LgrOutput::AddLinkOffer`] and answers with
//! [`LinkGroup::accept_add_link`] or [`LinkGroup::refuse_add_link`]. A flow
//! that fails before the new link has a record ends with
//! [`LgrOutput::AddLinkFailed`] (the driver frees the QP); later, the link
//! goes down as any other ([`LgrOutput::LinkDown`], DELETE_LINK to the peer).

use super::{LgrOutput, Link, LinkGroup, LinkState, LocalPort, PeerPort, Role, LINK_SLOTS};
use crate::Timestamp;
use smc_wire::llc::{
    self, AddLink, AddLinkCont, AddLinkRkey, AddLinkV2Ext, ByteOrder, LlcMessage, ReqAddLink,
    FLAG_ADD_LNK_REJ, FLAG_RESP, RKEYS_PER_CONT_MSG,
};
use smc_wire::types::{Gid, Mac};
use std::collections::VecDeque;

/// How a link group takes part in adding links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Redundancy {
    /// Add links at all: a server starts the ADD_LINK flow after the first
    /// link (and after a link was lost), a client answers one. Off, every
    /// ADD_LINK request is rejected at once, as Linux's client does when it
    /// has no alternate path.
    pub enabled: bool,
    /// We have an alternate device/port for a further link. Without one the
    /// new link runs on the port of the existing link (Linux's "asymmetric
    /// local"), and a client rejects the request of a server that has none
    /// either ("no alternate path", §1.8 client step 1).
    pub alternate: bool,
}

/// Redundancy of a link group (Linux `enum smc_lgr_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LgrType {
    /// No usable link (first contact in progress, or all gone).
    None,
    /// One link.
    Single,
    /// Two links over different ports on both sides.
    Symmetric,
    /// Two links sharing our port.
    AsymmetricLocal,
    /// Two links sharing the peer's port.
    AsymmetricPeer,
}

/// Where an ADD_LINK flow is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Server: our ADD_LINK request is out, waiting for the response.
    AwaitResponse,
    /// Client: the driver prepares our QP for the server's request.
    AwaitLocal,
    /// v1 rkey exchange: waiting for the peer's next ADD_LINK_CONT.
    AwaitCont,
    /// CONFIRM_LINK on the new link (its record is ACTIVATING).
    Confirming,
}

/// An ADD_LINK flow in progress (ours as a server, or the server's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct AddFlow {
    /// The new link's slot.
    pub(super) slot: usize,
    /// The existing link that carries ADD_LINK and ADD_LINK_CONT.
    pub(super) via: usize,
    pub(super) link_id: u8,
    pub(super) local: Option<LocalPort>,
    pub(super) peer: Option<PeerPort>,
    /// Our rkey triples still to send (v1).
    pub(super) to_send: VecDeque<AddLinkRkey>,
    /// How many the peer still has to send (v1, from its last ADD_LINK_CONT).
    pub(super) peer_left: usize,
    /// The new link shares our port / the peer's port.
    pub(super) asym_local: bool,
    pub(super) asym_peer: bool,
    pub(super) stage: Stage,
    pub(super) deadline: Timestamp,
}

/// How often a failed ADD_LINK flow is tried again before the next trigger
/// (see `LinkGroup::add_flow_failed`).
pub(super) const ADD_RETRIES: u8 = 3;

fn triples(rkeys: &[(u32, u32, u64)]) -> VecDeque<AddLinkRkey> {
    rkeys
        .iter()
        .take(llc::RMBS_PER_LGR_MAX)
        .map(|&(rmb_key, rmb_key_new, rmb_vaddr_new)| AddLinkRkey {
            rmb_key,
            rmb_key_new,
            rmb_vaddr_new,
        })
        .collect()
}

impl LinkGroup {
    /// How this group takes part in adding links (off by default).
    pub fn set_redundancy(&mut self, r: Redundancy) {
        self.redundancy = r;
    }

    /// The group's redundancy type.
    pub fn lgr_type(&self) -> LgrType {
        let active: Vec<&Link> = self
            .links
            .iter()
            .flatten()
            .filter(|l| l.state == LinkState::Active)
            .collect();
        match active.len() {
            0 => LgrType::None,
            1 => LgrType::Single,
            _ if active.iter().any(|l| l.asym_local) => LgrType::AsymmetricLocal,
            _ if active.iter().any(|l| l.asym_peer) => LgrType::AsymmetricPeer,
            _ => LgrType::Symmetric,
        }
    }

    /// An ADD_LINK flow is running (ours or the peer's).
    pub fn add_flow_running(&self) -> bool {
        self.add.is_some()
    }

    /// The server may start an ADD_LINK flow now (§1.8 server triggers: the
    /// first link just confirmed, a link lost and one left, the driver's
    /// [`Self::request_add_link`]): redundancy on, more than one link
    /// agreed, exactly one usable link, no LLC flow running, a free slot.
    pub fn can_start_add_link(&self) -> bool {
        self.cfg.role == Role::Server
            && self.redundancy.enabled
            && self.add_wanted
            && self.cfg.max_links > 1
            && self.terminated.is_none()
            && self.add.is_none()
            && self.local_flow.is_none()
            && self.usable_links() == 1
            && !self
                .links
                .iter()
                .flatten()
                .any(|l| l.state == LinkState::Activating)
            && self.add_slot().is_some()
    }

    /// The driver cannot prepare a QP for the wanted link now: no attempt
    /// until the next trigger.
    pub fn add_link_unavailable(&mut self) {
        self.add_wanted = false;
    }

    /// Asks for another ADD_LINK attempt (e.g. a port came back, §1.8).
    pub fn request_add_link(&mut self) {
        self.want_add_link();
    }

    /// A trigger (§1.8): the server adds a link when it can, with the
    /// retries of a failed flow counted anew.
    pub(super) fn want_add_link(&mut self) {
        self.add_wanted = true;
        self.add_tries = 0;
        self.add_retry_at = None;
    }

    /// Server: our ADD_LINK flow failed without a link (rejected, no
    /// answer in time, the new link not confirmed). Linux tries again only
    /// at the next trigger (smc_llc.c `smc_llc_process_srv_add_link` ends
    /// there; a port coming up on either side, `smcr_port_add`, the
    /// client's invitation, or a link lost are the triggers). A failure
    /// may be passing, though — the client still busy with a flow of its
    /// own, or with the DELETE_LINK of the link being replaced, when our
    /// request came — and then no trigger follows: the flow is tried again
    /// `WAIT_TIME` later, at most [`ADD_RETRIES`] times per trigger (a
    /// client that has no path for it says so each time; its group is not
    /// asked forever).
    fn add_flow_failed(&mut self, now: Timestamp) {
        if self.cfg.role == Role::Server
            && self.redundancy.enabled
            && self.add_tries < ADD_RETRIES
            && self.terminated.is_none()
        {
            self.add_tries += 1;
            self.add_retry_at = Some(now + llc::WAIT_TIME);
        }
    }

    /// The retry of a failed flow is due: wanted again if the group still
    /// has one usable link.
    pub(super) fn add_retry_due(&mut self, now: Timestamp) {
        if self.add_retry_at.is_some_and(|t| now >= t) {
            self.add_retry_at = None;
            if self.usable_links() == 1 {
                self.add_wanted = true;
            }
        }
    }

    /// Client: a port or device of ours came up (Linux smc_core.c
    /// `smcr_port_add` → smc_llc.c `smc_llc_add_link_local`, run as
    /// `smc_llc_cli_add_link_invite`): a group with one usable link invites
    /// the server to add one (§1.8: the server runs its own ADD_LINK flow
    /// when it can, our own ADD_LINK flow is never started by a client).
    /// v2: a REQ_ADD_LINK naming `gids`, the new port's GIDs
    /// (`smc_llc_send_request_add_link`); v1: an ADD_LINK request carrying
    /// the new port's MAC and GID (`alt`) and nothing else, which servers
    /// take as the invitation. Nothing without redundancy, with more than one
    /// usable link (Linux skips SYMMETRIC and ASYMMETRIC_PEER groups; an
    /// asymmetric one of ours is replaced by the driver instead), or while an
    /// ADD_LINK flow runs. Whether an invitation went out.
    pub fn invite_add_link(&mut self, gids: &[Gid], alt: Option<(Mac, Gid)>) -> bool {
        if self.cfg.role != Role::Client
            || !self.redundancy.enabled
            || self.cfg.max_links <= 1
            || self.terminated.is_some()
            || self.add.is_some()
            || self.usable_links() != 1
        {
            return false;
        }
        let Some(via) = self.active_slots().next() else {
            return false;
        };
        let msg = if self.cfg.version.is_v2() {
            LlcMessage::ReqAddLink(ReqAddLink {
                version: self.cfg.version,
                flags: 0,
                gids: gids.iter().copied().take(2).collect(),
            })
        } else {
            let Some((mac, gid)) = alt else {
                return false;
            };
            LlcMessage::AddLink(AddLink {
                version: self.cfg.version,
                flags: 0,
                reject_reason: 0,
                sender_mac: mac,
                sender_gid: gid,
                sender_qpn: 0,
                link_num: 0,
                qp_mtu: 0,
                initial_psn: 0,
                ext: None,
            })
        };
        self.out.push_back(LgrOutput::SendLlc { slot: via, msg });
        true
    }

    /// The slot a new link takes: the lowest free one, or the highest for a
    /// link that shares our port (Linux `smc_llc_alloc_alt_link`).
    pub fn add_slot(&self) -> Option<usize> {
        let free = |s: &usize| self.links[*s].is_none();
        if self.redundancy.alternate {
            (0..LINK_SLOTS).find(free)
        } else {
            (0..LINK_SLOTS).rev().find(free)
        }
    }

    /// Server: starts the ADD_LINK flow for the new link whose QP the driver
    /// prepared in `slot` ([`Self::add_slot`]; state INIT, receive buffers
    /// posted): `local` is its end, `rkeys` every RMB in use as (rkey on the
    /// existing link, rkey on the new link, address on the new link). The
    /// request goes out on the usable link. False if the flow cannot start
    /// ([`Self::can_start_add_link`]).
    pub fn start_add_link(
        &mut self,
        slot: usize,
        local: LocalPort,
        rkeys: &[(u32, u32, u64)],
        now: Timestamp,
    ) -> bool {
        if !self.can_start_add_link() || self.add_slot() != Some(slot) {
            return false;
        }
        let Some(via) = self.active_slots().next() else {
            return false;
        };
        self.add_wanted = false;
        let link_id = self.next_link_id();
        let to_send = triples(rkeys);
        let msg = self.add_link_msg(false, link_id, &local, local.mtu.code(), &to_send);
        self.out.push_back(LgrOutput::SendLlc { slot: via, msg });
        self.add = Some(AddFlow {
            slot,
            via,
            link_id,
            local: Some(local),
            peer: None,
            to_send,
            peer_left: 0,
            asym_local: !self.redundancy.alternate,
            asym_peer: false,
            stage: Stage::AwaitResponse,
            deadline: now + llc::WAIT_TIME,
        });
        true
    }

    /// Client: the driver prepared and connected our QP for the server's
    /// offer ([`LgrOutput::AddLinkOffer`]); `local` is its end, `rkeys` as
    /// for [`Self::start_add_link`]. Sends the ADD_LINK response.
    pub fn accept_add_link(&mut self, local: LocalPort, rkeys: &[(u32, u32, u64)], now: Timestamp) {
        let Some(mut f) = self.add.take() else {
            return;
        };
        let Some(peer) = f.peer.filter(|_| f.stage == Stage::AwaitLocal) else {
            self.add = Some(f);
            return;
        };
        f.local = Some(local);
        f.to_send = triples(rkeys);
        // (Linux: the response's MTU is the smaller of ours and the server's)
        let mtu = local.mtu.code().min(peer.mtu);
        let msg = self.add_link_msg(true, f.link_id, &local, mtu, &f.to_send);
        self.out.push_back(LgrOutput::SendLlc { slot: f.via, msg });
        self.new_link_record(&f, local, peer);
        if self.cfg.version.is_v2() {
            // v2: the server's rkeys came with its request; CONFIRM_LINK
            // follows on the new link
            if let Some(req) = self.pending_request.take() {
                self.store_ext_rkeys(f.slot, &req);
            }
            f.to_send.clear();
            self.enter_confirming(f, now);
        } else {
            f.stage = Stage::AwaitCont;
            f.deadline = now + llc::WAIT_TIME;
            self.add = Some(f);
        }
    }

    /// Client: the driver could not prepare a QP for the server's offer:
    /// the request is rejected.
    pub fn refuse_add_link(&mut self) {
        if let Some(f) = self.add.take() {
            if let Some(req) = self.pending_request.take() {
                let msg = LlcMessage::AddLink(AddLink::reject_for(&req));
                self.out.push_back(LgrOutput::SendLlc { slot: f.via, msg });
            }
            self.out
                .push_back(LgrOutput::AddLinkFailed { slot: f.slot });
            self.after_flow();
        }
    }

    fn add_link_msg(
        &self,
        response: bool,
        link_id: u8,
        local: &LocalPort,
        mtu: u8,
        rkeys: &VecDeque<AddLinkRkey>,
    ) -> LlcMessage {
        let v2 = self.cfg.version.is_v2();
        LlcMessage::AddLink(AddLink {
            version: self.cfg.version,
            flags: if response { FLAG_RESP } else { 0 },
            reject_reason: 0,
            sender_mac: local.mac,
            sender_gid: local.gid,
            sender_qpn: local.qpn,
            link_num: link_id,
            qp_mtu: mtu,
            initial_psn: local.psn,
            // v2: every RMB's rkeys in the extension (Linux
            // `smc_llc_fill_ext_v2`), no ADD_LINK_CONT
            ext: v2.then(|| AddLinkV2Ext {
                v2_direct: true,
                client_target_gid: local.gid,
                num_rkeys_order: ByteOrder::Little,
                rkeys: rkeys
                    .iter()
                    .copied()
                    .take(llc::ADD_LINK_V2_MAX_RKEYS)
                    .collect(),
            }),
        })
    }

    /// The new link's record, ACTIVATING; its CONFIRM_LINK wait starts with
    /// the confirming stage.
    fn new_link_record(&mut self, f: &AddFlow, local: LocalPort, peer: PeerPort) {
        self.links[f.slot] = Some(Link {
            link_id: f.link_id,
            state: LinkState::Activating,
            local,
            peer,
            peer_link_uid: 0,
            last_rx: Timestamp::ZERO,
            testlink_sent: None,
            confirm_deadline: None,
            first_contact: false,
            asym_local: f.asym_local,
            asym_peer: f.asym_peer,
        });
    }

    /// §1.8 step 7: CONFIRM_LINK on the new link, within
    /// `SMC_LLC_WAIT_FIRST_TIME` (the server sends the request).
    fn enter_confirming(&mut self, mut f: AddFlow, now: Timestamp) {
        f.stage = Stage::Confirming;
        f.deadline = now + llc::WAIT_FIRST_TIME;
        if let Some(l) = self.links[f.slot].as_mut() {
            l.confirm_deadline = Some(f.deadline);
            l.last_rx = now;
        }
        if self.cfg.role == Role::Server {
            let msg = self.confirm_link_msg(f.slot, false);
            self.out.push_back(LgrOutput::SendLlc { slot: f.slot, msg });
        }
        self.add = Some(f);
    }

    /// v1: our next ADD_LINK_CONT (up to two triples; `num_rkeys` counts
    /// what we still have including these; the client's carries RESP).
    fn send_cont(&mut self, f: &mut AddFlow) {
        let n = f.to_send.len().min(usize::from(u8::MAX)) as u8;
        let take = f.to_send.len().min(RKEYS_PER_CONT_MSG);
        let rkeys: Vec<AddLinkRkey> = f.to_send.drain(..take).collect();
        let msg = LlcMessage::AddLinkCont(AddLinkCont {
            version: llc::LlcVersion::V1,
            flags: if self.cfg.role == Role::Client {
                FLAG_RESP
            } else {
                0
            },
            link_num: f.link_id,
            num_rkeys: n,
            rkeys,
        });
        self.out.push_back(LgrOutput::SendLlc { slot: f.via, msg });
    }

    /// An ADD_LINK (request or response) arrived on `slot`.
    pub(super) fn on_add_link(&mut self, slot: usize, a: AddLink, now: Timestamp) {
        match (self.cfg.role, a.is_response()) {
            (Role::Client, false) => self.on_add_link_request(slot, a, now),
            (Role::Server, true) => self.on_add_link_response(a, now),
            // A client's ADD_LINK request is only an invitation (v1, §1.8):
            // the server runs its own flow when it can.
            (Role::Server, false) if self.redundancy.enabled => self.want_add_link(),
            // Without redundancy it is rejected as before.
            (Role::Server, false) => {
                let msg = LlcMessage::AddLink(AddLink::reject_for(&a));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            // a response outside our flow is dropped (§1.6 rule 3)
            (Role::Client, true) => self.dropped += 1,
        }
    }

    fn on_add_link_request(&mut self, slot: usize, a: AddLink, now: Timestamp) {
        let reject = |g: &mut LinkGroup| {
            let msg = LlcMessage::AddLink(AddLink::reject_for(&a));
            g.out.push_back(LgrOutput::SendLlc { slot, msg });
        };
        if !self.redundancy.enabled || self.cfg.max_links <= 1 {
            return reject(self);
        }
        if self.add.is_some() {
            // the same flow again: Linux drops it silently (§1.6 rule 2)
            self.dropped += 1;
            return;
        }
        if self.local_flow.is_some() {
            // one of our rkey flows holds the slot: Linux parks the first
            // conflicting request and runs it when the flow ends
            if self.delayed_add.is_none() {
                self.delayed_add = Some((slot, a, now));
            } else {
                self.dropped += 1;
            }
            return;
        }
        // A further link only next to one usable link (Linux refuses
        // when the group is not SINGLE and an asymmetric link is needed;
        // we add at most one), with an MTU and a free slot.
        let via_peer = self.link(slot).map(|l| l.peer);
        let Some(via_peer) = via_peer.filter(|_| self.usable_links() == 1) else {
            return reject(self);
        };
        // The server offers its existing port again: it has no alternate.
        let server_same_port = a.sender_gid == via_peer.gid
            && (self.cfg.version.is_v2() || a.sender_mac == via_peer.mac);
        if server_same_port && !self.redundancy.alternate {
            return reject(self);
        }
        let Some(new_slot) = self.add_slot() else {
            return reject(self);
        };
        if a.qp_mtu == 0 || self.slot_of_link_id(a.link_num).is_some() || a.link_num == 0 {
            return reject(self);
        }
        let peer = PeerPort {
            gid: a.sender_gid,
            mac: a.sender_mac,
            qpn: a.sender_qpn,
            psn: a.initial_psn,
            mtu: a.qp_mtu,
        };
        self.add = Some(AddFlow {
            slot: new_slot,
            via: slot,
            link_id: a.link_num,
            local: None,
            peer: Some(peer),
            to_send: VecDeque::new(),
            peer_left: 0,
            asym_local: !self.redundancy.alternate,
            asym_peer: server_same_port,
            stage: Stage::AwaitLocal,
            deadline: now + llc::WAIT_TIME,
        });
        self.pending_request = Some(a);
        self.out.push_back(LgrOutput::AddLinkOffer {
            slot: new_slot,
            link_id: self.add.as_ref().map_or(0, |f| f.link_id),
            peer,
        });
    }

    /// v2: the peer's rkeys for the new link from its ADD_LINK extension.
    fn store_ext_rkeys(&mut self, slot: usize, a: &AddLink) {
        if let Some(e) = &a.ext {
            let entries: Vec<(u32, u32, u64)> = e
                .rkeys
                .iter()
                .take(llc::RKEYS_PER_MSG_V2)
                .map(|k| (k.rmb_key, k.rmb_key_new, k.rmb_vaddr_new))
                .collect();
            self.add_link_rtokens(slot, &entries);
        }
    }

    fn on_add_link_response(&mut self, a: AddLink, now: Timestamp) {
        let Some(mut f) = self.add.take() else {
            self.dropped += 1;
            return;
        };
        if f.stage != Stage::AwaitResponse {
            self.dropped += 1;
            self.add = Some(f);
            return;
        }
        let Some(local) = f.local else {
            self.add = Some(f);
            return;
        };
        if a.flags & FLAG_ADD_LNK_REJ != 0 || a.qp_mtu == 0 {
            // the client has no path for it (now): the group stays as it is
            self.out
                .push_back(LgrOutput::AddLinkFailed { slot: f.slot });
            self.after_flow();
            self.add_flow_failed(now);
            return;
        }
        let via_peer = self.link(f.via).map(|l| l.peer);
        // The client answered with its existing port: asymmetric on its side.
        f.asym_peer = via_peer.is_some_and(|p| {
            a.sender_gid == p.gid && (self.cfg.version.is_v2() || a.sender_mac == p.mac)
        });
        let peer = PeerPort {
            gid: a.sender_gid,
            mac: a.sender_mac,
            qpn: a.sender_qpn,
            psn: a.initial_psn,
            mtu: a.qp_mtu,
        };
        f.peer = Some(peer);
        self.new_link_record(&f, local, peer);
        self.out
            .push_back(LgrOutput::ConnectLink { slot: f.slot, peer });
        if self.cfg.version.is_v2() {
            self.store_ext_rkeys(f.slot, &a);
            f.to_send.clear();
            self.enter_confirming(f, now);
        } else {
            // v1: the server's ADD_LINK_CONT first (§1.8 step 6)
            self.send_cont(&mut f);
            f.stage = Stage::AwaitCont;
            f.deadline = now + llc::WAIT_TIME;
            self.add = Some(f);
        }
    }

    /// An ADD_LINK_CONT arrived (v1 rkey exchange).
    pub(super) fn on_add_link_cont(&mut self, c: &AddLinkCont, now: Timestamp) {
        let Some(mut f) = self.add.take() else {
            self.dropped += 1;
            return;
        };
        if f.stage != Stage::AwaitCont || c.link_num != f.link_id {
            self.dropped += 1;
            self.add = Some(f);
            return;
        }
        let got: Vec<(u32, u32, u64)> = c
            .rkeys
            .iter()
            .take(usize::from(c.num_rkeys).min(RKEYS_PER_CONT_MSG))
            .map(|k| (k.rmb_key, k.rmb_key_new, k.rmb_vaddr_new))
            .collect();
        self.add_link_rtokens(f.slot, &got);
        f.peer_left = usize::from(c.num_rkeys).saturating_sub(got.len());
        if self.cfg.role == Role::Client {
            // the client answers each of the server's with one of its own
            self.send_cont(&mut f);
        }
        if f.to_send.is_empty() && f.peer_left == 0 {
            self.enter_confirming(f, now);
            return;
        }
        if self.cfg.role == Role::Server {
            self.send_cont(&mut f);
        }
        f.deadline = now + llc::WAIT_TIME;
        self.add = Some(f);
    }

    /// The flow's link became active: the flow ends.
    pub(super) fn add_flow_link_active(&mut self, slot: usize) {
        if self.add.as_ref().is_some_and(|f| f.slot == slot) {
            self.add = None;
            self.add_tries = 0;
            self.add_retry_at = None;
            self.after_flow();
        }
    }

    /// Link `slot` went down: a flow that needs it ends (the new link
    /// itself, or the link that carries the exchange before CONFIRM_LINK).
    /// A new link without a record yet is freed by the driver at
    /// [`LgrOutput::AddLinkFailed`].
    pub(super) fn add_flow_link_down(&mut self, slot: usize) {
        let Some(f) = self.add.as_ref() else { return };
        let ends = f.slot == slot || (f.via == slot && f.stage != Stage::Confirming);
        if !ends {
            return;
        }
        let Some(f) = self.add.take() else { return };
        self.pending_request = None;
        if self.links[f.slot].is_none() {
            self.out
                .push_back(LgrOutput::AddLinkFailed { slot: f.slot });
        } else if f.slot != slot {
            // the new link goes down too (DELETE_LINK on a survivor, if any)
            self.link_down(f.slot, super::DownReason::Failure);
        }
        self.after_flow();
    }

    /// The flow's timer.
    pub(super) fn add_flow_timeout(&mut self, now: Timestamp) {
        let Some(f) = self.add.as_ref() else { return };
        if now < f.deadline {
            return;
        }
        let slot = f.slot;
        if self.links[slot].is_some() {
            // (DELETE_LINK for the new link id on the old link, §1.8 step 7)
            self.link_down(slot, super::DownReason::ConfirmLinkTimeout);
        } else {
            self.add = None;
            self.pending_request = None;
            self.out.push_back(LgrOutput::AddLinkFailed { slot });
            self.after_flow();
        }
        self.add_flow_failed(now);
    }

    /// The local flow slot is free again: a parked ADD_LINK request runs.
    pub(super) fn after_flow(&mut self) {
        if self.add.is_some() || self.local_flow.is_some() {
            return;
        }
        self.pending_request = None;
        if let Some((slot, a, now)) = self.delayed_add.take() {
            if self
                .link(slot)
                .is_some_and(|l| l.state == LinkState::Active)
            {
                self.on_add_link_request(slot, a, now);
            }
        }
    }

    /// A link went down while another is left: a server tries to add one
    /// again (§1.9: "if the group became SINGLE ... tries to add").
    pub(super) fn add_flow_after_loss(&mut self) {
        if self.cfg.role == Role::Server && self.usable_links() == 1 {
            self.want_add_link();
        }
    }
}
