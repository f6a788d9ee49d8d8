//! Links and link groups: first-contact CONFIRM_LINK, the LLC requests a Linux peer
//! sends and expects answers to, rkey flows, TEST_LINK keepalive, DELETE_LINK.
//!
//! Spec: `protocol-llc-cdc.md` §1.5 (timers), §1.6 (LLC flow serialization), §1.7
//! (first-contact link setup), §1.8 step 6–7 (a further link's rkeys and its
//! CONFIRM_LINK), §1.9 (DELETE_LINK), §1.10 (keepalive), §1.11 (CONFIRM_RKEY /
//! DELETE_RKEY), §6 (link group model), §7.2–§7.3 (a link fails: survivors carry
//! on, the last one ends the group), §9 (which link carries what), §11 (interop
//! notes: what a Linux peer expects); captures README §8 (ADD_LINK reject shape on
//! v2, double DELETE_LINK ALL).
//!
//! A [`LinkGroup`] holds up to three link slots (Linux `SMC_LINKS_PER_LGR_MAX`); the
//! engine never assumes a single link. With [`Redundancy`] on, a server adds a
//! further link by the ADD_LINK flow of §1.8 (`link/add_link.rs`) after the first
//! link is confirmed and after a link was lost, and a client answers it; off (the
//! default), an ADD_LINK request is rejected at once, as Linux's own single-port
//! client does (§11 item 3), and a REQ_ADD_LINK gets the negative response. A
//! further link whose QP parameters and rkeys were exchanged by other means joins
//! with [`LinkGroup::add_link`] and [`LinkGroup::add_link_rtokens`] and runs the
//! CONFIRM_LINK exchange of §1.8 step 7 on the new link. When one of several links
//! fails, the group stays up: the driver moves that link's connections (§7.2) and
//! the group tells the peer with DELETE_LINK on a surviving link (§1.9), then the
//! driver frees the slot with [`LinkGroup::clear_link`].
//!
//! Sans-I/O: inputs are [`LinkGroup::on_llc`], [`LinkGroup::on_timeout`]
//! and the request methods; outputs are drained with [`LinkGroup::poll_output`].

mod add_link;

pub use add_link::{LgrType, Redundancy};

use crate::Timestamp;
use core::fmt;
use smc_wire::llc::{
    self, AddLink, ConfirmLink, ConfirmRkey, DeleteLink, DeleteRkey, LinkRtoken, LlcMessage,
    LlcVersion, ReqAddLink, TestLink,
};
use smc_wire::types::{Gid, IbMtu, Mac};
use std::collections::VecDeque;
use std::time::Duration;

/// Link slots per link group (`SMC_LINKS_PER_LGR_MAX`).
pub const LINK_SLOTS: usize = llc::LINKS_PER_LGR_MAX;

/// Which side of the CLC handshake created the link group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// We connected.
    Client,
    /// We accepted.
    Server,
}

/// State of one link (`protocol-llc-cdc.md` §6 "Link states").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkState {
    /// Created, QP coming up, CONFIRM_LINK pending.
    Activating,
    /// Usable.
    Active,
    /// Down or being cleared; the slot is freed once the driver released the QP.
    Inactive,
}

/// Our end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPort {
    /// GID used on the link.
    pub gid: Gid,
    /// Port MAC.
    pub mac: Mac,
    /// QP number.
    pub qpn: u32,
    /// Our initial send PSN.
    pub psn: u32,
    /// Our port's active MTU.
    pub mtu: IbMtu,
}

/// The peer's end of a link, from CLC (first contact) or ADD_LINK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerPort {
    /// Peer GID.
    pub gid: Gid,
    /// Peer MAC.
    pub mac: Mac,
    /// Peer QP number.
    pub qpn: u32,
    /// Peer initial PSN.
    pub psn: u32,
    /// Peer MTU (raw enum as received).
    pub mtu: u8,
}

/// One link.
#[derive(Clone, Debug)]
pub struct Link {
    /// Link id (`link_num`), assigned by the server; 0 until a client learns it.
    pub link_id: u8,
    /// State.
    pub state: LinkState,
    /// Our end.
    pub local: LocalPort,
    /// The peer's end.
    pub peer: PeerPort,
    /// The peer's link user id (diagnostic).
    pub peer_link_uid: u32,
    last_rx: Timestamp,
    /// Waiting for a TEST_LINK response since.
    testlink_sent: Option<Timestamp>,
    /// CONFIRM_LINK deadline while Activating.
    confirm_deadline: Option<Timestamp>,
    /// The link of the first contact (CONFIRM_LINK eye-catcher check, §1.3).
    first_contact: bool,
    /// Added over our existing port (Linux "asymmetric local").
    asym_local: bool,
    /// Added over the peer's existing port ("asymmetric peer").
    asym_peer: bool,
}

/// Why a link went down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownReason {
    /// No CONFIRM_LINK in time during first contact (CLC code TIMEOUT_CL).
    ConfirmLinkTimeout,
    /// The first-contact CONFIRM_LINK lacked the "no RMBE eyecatcher" bits (RMBE_EC).
    RmbeEyecatcher,
    /// TEST_LINK went unanswered (§1.10).
    KeepaliveTimeout,
    /// The peer deleted the link (DELETE_LINK).
    DeletedByPeer(u32),
    /// The driver reported a QP/port failure.
    Failure,
}

/// Something the driver must do or know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LgrOutput {
    /// Post this LLC message as a SEND on the link in `slot`.
    SendLlc {
        /// Link slot.
        slot: usize,
        /// The message.
        msg: LlcMessage,
    },
    /// The link in `slot` is active (first-contact confirmation done).
    LinkActive {
        /// Link slot.
        slot: usize,
    },
    /// The link in `slot` is down; its connections must move or die.
    LinkDown {
        /// Link slot.
        slot: usize,
        /// Why.
        reason: DownReason,
    },
    /// The whole link group is gone (no usable link, or DELETE_LINK ALL): kill every
    /// connection of the group (§5.5).
    Terminated {
        /// DELETE_LINK reason code (ours or the peer's).
        reason: u32,
    },
    /// Client: the server offers a further link (ADD_LINK, §1.8). Prepare a
    /// QP in `slot`, connect it to `peer` (RTR, RTS) and answer with
    /// [`LinkGroup::accept_add_link`], or [`LinkGroup::refuse_add_link`].
    AddLinkOffer {
        /// The slot the new link takes.
        slot: usize,
        /// Its link id (the server's).
        link_id: u8,
        /// The server's end of it.
        peer: PeerPort,
    },
    /// Server: the client answered our ADD_LINK: connect the new link's QP
    /// in `slot` to `peer` (RTR, RTS); a failure is reported with
    /// [`LinkGroup::on_link_failure`].
    ConnectLink {
        /// The new link's slot.
        slot: usize,
        /// The client's end of it.
        peer: PeerPort,
    },
    /// An ADD_LINK flow ended before its link existed (rejected, timed out,
    /// refused): free the QP prepared in `slot`.
    AddLinkFailed {
        /// The slot.
        slot: usize,
    },
    /// One of our rkey flows finished.
    RkeyFlowDone {
        /// The caller's identifier for the flow.
        tag: u64,
        /// Positive response in time.
        ok: bool,
    },
}

/// A peer RMB as known per link slot: (rkey, address) valid on that link.
pub type Rtoken = [Option<(u32, u64)>; LINK_SLOTS];

/// A link that is gone: its peer port (how a CLC message names a link,
/// §1.11) and the peer RMBs' rkeys on it, each with the RMB's row.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FormerLink {
    gid: Gid,
    qpn: u32,
    rkeys: Vec<(u32, usize)>,
}

/// Our LLC request awaiting its response (the local flow slot, §1.6).
#[derive(Clone, Debug, PartialEq, Eq)]
enum LocalFlow {
    ConfirmRkey {
        tag: u64,
        deadline: Timestamp,
        /// The link the request went out on.
        via: usize,
    },
    DeleteRkey {
        tag: u64,
        deadline: Timestamp,
        via: usize,
    },
}

/// Link group parameters agreed in CLC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LgrConfig {
    /// Local link group id (diagnostic; part of `link_uid`).
    pub id: u32,
    /// Our role.
    pub role: Role,
    /// v1 or v2 LLC framing (v2 when the CLC version was 2).
    pub version: LlcVersion,
    /// Negotiated links per group.
    pub max_links: u8,
    /// Negotiated connections per group.
    pub max_conns: u8,
    /// TEST_LINK interval; `None` disables the keepalive.
    pub testlink_interval: Option<Duration>,
}

/// A link group.
#[derive(Clone, Debug)]
pub struct LinkGroup {
    cfg: LgrConfig,
    links: [Option<Link>; LINK_SLOTS],
    rtokens: Vec<Option<Rtoken>>,
    /// The last links cleared, oldest first, at most `LINK_SLOTS` (see
    /// [`LinkGroup::find_former_rtoken`]).
    former: VecDeque<FormerLink>,
    local_flow: Option<LocalFlow>,
    out: VecDeque<LgrOutput>,
    terminated: Option<u32>,
    /// How this group takes part in adding links.
    redundancy: Redundancy,
    /// The ADD_LINK flow in progress (it holds the local flow slot, §1.6).
    add: Option<add_link::AddFlow>,
    /// A server trigger for the ADD_LINK flow is pending (§1.8).
    add_wanted: bool,
    /// Server: when a failed ADD_LINK flow is tried again, and how many
    /// times it was since the last trigger (see `add_link::ADD_RETRIES`).
    add_retry_at: Option<Timestamp>,
    add_tries: u8,
    /// Client: the ADD_LINK request being answered (for a reject).
    pending_request: Option<AddLink>,
    /// An ADD_LINK request that came while our rkey flow ran (§1.6 rule 2:
    /// Linux parks the first conflicting one).
    delayed_add: Option<(usize, AddLink, Timestamp)>,
    /// Unknown or unexpected LLC messages dropped (Linux drops them silently too).
    pub dropped: u64,
}

/// The rtoken table is full or the message asked for too many entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtokenTableFull;

impl fmt::Display for RtokenTableFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rtoken table full ({} peer RMBs)", llc::RMBS_PER_LGR_MAX)
    }
}

impl LinkGroup {
    /// A new link group (first contact) with no link yet.
    pub fn new(cfg: LgrConfig) -> LinkGroup {
        LinkGroup {
            cfg,
            links: [None, None, None],
            rtokens: Vec::new(),
            former: VecDeque::new(),
            local_flow: None,
            out: VecDeque::new(),
            terminated: None,
            redundancy: Redundancy::default(),
            add: None,
            add_wanted: false,
            add_retry_at: None,
            add_tries: 0,
            pending_request: None,
            delayed_add: None,
            dropped: 0,
        }
    }

    /// The agreed parameters.
    pub fn config(&self) -> &LgrConfig {
        &self.cfg
    }

    /// The link in `slot`.
    pub fn link(&self, slot: usize) -> Option<&Link> {
        self.links.get(slot).and_then(Option::as_ref)
    }

    /// Number of usable (active) links.
    pub fn usable_links(&self) -> usize {
        self.active_slots().count()
    }

    /// Slots of active links.
    pub fn active_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.links
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(l, Some(l) if l.state == LinkState::Active))
            .map(|(i, _)| i)
    }

    /// The group is terminated (every link gone or DELETE_LINK ALL).
    pub fn is_terminated(&self) -> bool {
        self.terminated.is_some()
    }

    /// The driver has something to do for the group without any message
    /// or timer: outputs waiting (a call of the driver's, such as a port
    /// event's [`Self::on_link_failure`], queued them), or a server's
    /// ADD_LINK flow that can start.
    pub fn has_work(&self) -> bool {
        !self.out.is_empty() || self.can_start_add_link()
    }

    /// Next output for the driver.
    pub fn poll_output(&mut self) -> Option<LgrOutput> {
        self.out.pop_front()
    }

    fn link_uid(&self, link_id: u8) -> u32 {
        // Linux: lgr id read as a host u32 plus the link id, sent big-endian.
        self.cfg.id.wrapping_add(u32::from(link_id))
    }

    /// First contact: the link created from the CLC exchange, in slot 0. A server
    /// assigns link id 1 and sends CONFIRM_LINK (its QP must be in RTS); a client
    /// waits up to 4 s for it (2 s and 4 s as in Linux, §1.5). Call once the QP is
    /// ready.
    pub fn add_first_link(&mut self, local: LocalPort, peer: PeerPort, now: Timestamp) -> usize {
        let (link_id, wait) = match self.cfg.role {
            Role::Server => (1, llc::SERVER_FIRST_CONFIRM_LINK_WAIT),
            Role::Client => (0, llc::CLIENT_FIRST_CONFIRM_LINK_WAIT),
        };
        self.set_activating(0, link_id, local, peer, now, wait, true);
        0
    }

    /// Puts a link in `slot` in state ACTIVATING, waiting `wait` from `now`
    /// for CONFIRM_LINK; a server sends the request on it at once.
    #[allow(clippy::too_many_arguments)]
    fn set_activating(
        &mut self,
        slot: usize,
        link_id: u8,
        local: LocalPort,
        peer: PeerPort,
        now: Timestamp,
        wait: Duration,
        first_contact: bool,
    ) {
        self.links[slot] = Some(Link {
            link_id,
            state: LinkState::Activating,
            local,
            peer,
            peer_link_uid: 0,
            last_rx: now,
            testlink_sent: None,
            confirm_deadline: Some(now + wait),
            first_contact,
            asym_local: false,
            asym_peer: false,
        });
        if self.cfg.role == Role::Server {
            let msg = self.confirm_link_msg(slot, false);
            self.out.push_back(LgrOutput::SendLlc { slot, msg });
        }
    }

    /// The link id a server gives its next link: the lowest non-zero id that no
    /// usable link has (Linux `smcr_next_link_id` steps a counter, skipping 0 and
    /// ids in use; any unused id is equally valid on the wire, §6).
    pub fn next_link_id(&self) -> u8 {
        (1..=u8::MAX)
            .find(|id| self.slot_of_link_id(*id).is_none())
            .unwrap_or(1)
    }

    /// The lowest free link slot, if any (not the one an ADD_LINK flow
    /// holds for its link).
    pub fn free_slot(&self) -> Option<usize> {
        let held = self.add.as_ref().map(|f| f.slot);
        (0..LINK_SLOTS).find(|&s| self.links[s].is_none() && Some(s) != held)
    }

    /// A further link, whose QP parameters (and the rkeys of §1.8 step 6) were
    /// exchanged outside this machine: it takes the lowest free slot in state
    /// ACTIVATING, and the CONFIRM_LINK exchange of §1.8 step 7 runs on it — a
    /// server sends the request on the new link, a client waits for it; both wait
    /// at most `SMC_LLC_WAIT_FIRST_TIME` (5 s). `link_id` is the server's choice
    /// ([`Self::next_link_id`] on the server). The QP must be ready (RTS). `None`
    /// if every slot is taken or the group is terminated.
    ///
    /// This stands in for the ADD_LINK flow (§1.8 steps 1–6), which a later
    /// version adds; the engine uses it only between two of our endpoints.
    pub fn add_link(
        &mut self,
        link_id: u8,
        local: LocalPort,
        peer: PeerPort,
        now: Timestamp,
    ) -> Option<usize> {
        if self.terminated.is_some()
            || self.slot_of_link_id(link_id).is_some()
            || self.add.is_some()
        {
            return None;
        }
        let slot = self.free_slot()?;
        self.set_activating(slot, link_id, local, peer, now, llc::WAIT_FIRST_TIME, false);
        Some(slot)
    }

    /// Frees the slot of a link that went down (INACTIVE), once the driver has
    /// released its QP; the peer RMBs' rkeys for that link are forgotten (Linux
    /// clears the link's rtoken column with the link). False if the link is not
    /// inactive.
    pub fn clear_link(&mut self, slot: usize) -> bool {
        match self.links.get(slot) {
            Some(Some(l)) if l.state == LinkState::Inactive => {}
            _ => return false,
        }
        let peer = self.links[slot].take().map(|l| l.peer);
        let mut rkeys = Vec::new();
        for (i, row) in self.rtokens.iter_mut().enumerate() {
            if let Some((rkey, _)) = row.as_mut().and_then(|r| r.get_mut(slot)?.take()) {
                rkeys.push((rkey, i));
            }
        }
        if let Some(p) = peer {
            if self.former.len() == LINK_SLOTS {
                self.former.pop_front();
            }
            self.former.push_back(FormerLink {
                gid: p.gid,
                qpn: p.qpn,
                rkeys,
            });
        }
        true
    }

    fn confirm_link_msg(&self, slot: usize, response: bool) -> LlcMessage {
        let l = self.link(slot).cloned();
        let (mac, gid, qpn, link_id) = l
            .map(|l| (l.local.mac, l.local.gid, l.local.qpn, l.link_id))
            .unwrap_or_default();
        LlcMessage::ConfirmLink(ConfirmLink::new(
            self.cfg.version,
            response,
            mac,
            gid,
            qpn,
            link_id,
            self.link_uid(link_id),
            self.cfg.max_links,
            if self.cfg.version.is_v2() {
                self.cfg.max_conns
            } else {
                0
            },
        ))
    }

    fn activate(&mut self, slot: usize) {
        if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
            l.state = LinkState::Active;
            l.confirm_deadline = None;
            let first = l.first_contact;
            self.out.push_back(LgrOutput::LinkActive { slot });
            // §1.7 step 5: after the first contact, a server adds a link
            if first && self.cfg.role == Role::Server {
                self.want_add_link();
            }
            self.add_flow_link_active(slot);
        }
    }

    fn link_down(&mut self, slot: usize, reason: DownReason) {
        let mut link_id = 0;
        let mut was_active = false;
        if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
            if l.state == LinkState::Inactive {
                return;
            }
            link_id = l.link_id;
            was_active = l.state == LinkState::Active;
            l.state = LinkState::Inactive;
            l.testlink_sent = None;
            l.confirm_deadline = None;
            self.out.push_back(LgrOutput::LinkDown { slot, reason });
        }
        self.add_flow_link_down(slot);
        let survivor = self.active_slots().next();
        match survivor {
            None if self.terminated.is_none() => self.terminate_quietly(llc::DEL_LOST_PATH),
            None => {}
            // Another link carries on: the driver moves the connections (it sees
            // LinkDown first), then the peer learns which link is gone — DELETE_LINK
            // on a surviving link, orderly with "lost path" for a link that failed,
            // not orderly for an added link that never got confirmed (§1.8 step 7,
            // §1.9, §7.2 step 3). A link the peer deleted needs no answer beyond the
            // response already queued. Linux's server then waits 2 s for the
            // response and its client does not; neither does anything with it but
            // clear the link, so we send and clear at once, like the client.
            Some(s) if link_id != 0 && !matches!(reason, DownReason::DeletedByPeer(_)) => {
                let orderly = reason != DownReason::ConfirmLinkTimeout;
                let msg = LlcMessage::DeleteLink(DeleteLink::request(
                    self.cfg.version,
                    link_id,
                    orderly,
                    llc::DEL_LOST_PATH,
                ));
                self.out.push_back(LgrOutput::SendLlc { slot: s, msg });
            }
            Some(_) => {}
        }
        // Our rkey flow whose request went out on this link gets no answer
        // now: it ends at once rather than at its timeout, as Linux's
        // `smc_llc_wait` stops waiting when the link it waits on is no
        // longer usable (smc_llc.c; `smc_llc_do_confirm_rkey` and
        // `smc_llc_do_delete_rkey` then fail). An ADD_LINK request parked
        // behind it (§1.6) runs now instead of after the flow's 2 s, when
        // the server's own wait for its answer would be over too.
        let flow_via = match self.local_flow {
            Some(
                LocalFlow::ConfirmRkey { tag, via, .. } | LocalFlow::DeleteRkey { tag, via, .. },
            ) => Some((tag, via)),
            None => None,
        };
        if let Some((tag, _)) = flow_via.filter(|&(_, via)| via == slot) {
            self.local_flow = None;
            self.out
                .push_back(LgrOutput::RkeyFlowDone { tag, ok: false });
            if survivor.is_some() {
                self.after_flow();
            }
        }
        // A link lost leaves the server one to add again (§1.9). So does one
        // the peer deleted before it was confirmed: a client that replaces
        // the link our ADD_LINK flow was bringing up (an asymmetric one,
        // its port back meanwhile) sends no further trigger, and Linux's
        // server adds again once a client's DELETE_LINK leaves the group
        // single (smc_llc.c `smc_llc_process_srv_delete_link`).
        let deleted = matches!(reason, DownReason::DeletedByPeer(_));
        if (was_active || deleted) && survivor.is_some() {
            self.add_flow_after_loss();
        }
    }

    fn terminate_quietly(&mut self, reason: u32) {
        self.terminated = Some(reason);
        self.add = None;
        self.delayed_add = None;
        self.pending_request = None;
        for l in self.links.iter_mut().flatten() {
            l.state = LinkState::Inactive;
        }
        if let Some(f) = self.local_flow.take() {
            let tag = match f {
                LocalFlow::ConfirmRkey { tag, .. } | LocalFlow::DeleteRkey { tag, .. } => tag,
            };
            self.out
                .push_back(LgrOutput::RkeyFlowDone { tag, ok: false });
        }
        self.out.push_back(LgrOutput::Terminated { reason });
    }

    /// Ends the link group on our initiative: DELETE_LINK ALL on an active link
    /// (§1.9; `orderly` for an idle group expiring), then termination.
    pub fn terminate(&mut self, reason: u32, orderly: bool) {
        if self.terminated.is_some() {
            return;
        }
        let first_active = self.active_slots().next();
        if let Some(slot) = first_active {
            let msg =
                LlcMessage::DeleteLink(DeleteLink::delete_all(self.cfg.version, orderly, reason));
            self.out.push_back(LgrOutput::SendLlc { slot, msg });
        }
        self.terminate_quietly(reason);
    }

    /// The driver saw the link's QP fail (error completion, port down, async event).
    pub fn on_link_failure(&mut self, slot: usize) {
        self.link_down(slot, DownReason::Failure);
    }

    // ------------------------------------------------------------------ rtokens

    /// Records a peer RMB announced in CLC (first contact or reuse) for `slot`;
    /// returns its row. An identical existing row is reused ("already in list").
    pub fn add_rtoken(
        &mut self,
        slot: usize,
        rkey: u32,
        vaddr: u64,
    ) -> Result<usize, RtokenTableFull> {
        if let Some(i) = self.find_rtoken(slot, rkey) {
            return Ok(i);
        }
        let mut row: Rtoken = [None; LINK_SLOTS];
        if let Some(c) = row.get_mut(slot) {
            *c = Some((rkey, vaddr));
        }
        match self.rtokens.iter().position(Option::is_none) {
            Some(i) => {
                // (a row reused: the former rkeys were another RMB's)
                self.forget_former_row(i);
                self.rtokens[i] = Some(row);
                Ok(i)
            }
            None if self.rtokens.len() < llc::RMBS_PER_LGR_MAX => {
                self.rtokens.push(Some(row));
                Ok(self.rtokens.len() - 1)
            }
            None => Err(RtokenTableFull),
        }
    }

    /// The peer's rkeys for a further link (what ADD_LINK_CONT carries, §1.4.3):
    /// each `(rkey known on an existing link, rkey on the new link, address on the
    /// new link)` fills the new link's column of the matching row. Entries for
    /// RMBs we do not know are ignored; returns how many rows were updated.
    pub fn add_link_rtokens(&mut self, slot: usize, entries: &[(u32, u32, u64)]) -> usize {
        let mut n = 0;
        for &(old, new, vaddr) in entries {
            let row = self.rtokens.iter_mut().flatten().find(|r| {
                r.iter()
                    .enumerate()
                    .any(|(s, c)| s != slot && matches!(c, Some((k, _)) if *k == old))
            });
            if let Some(cell) = row.and_then(|r| r.get_mut(slot)) {
                *cell = Some((new, vaddr));
                n += 1;
            }
        }
        n
    }

    /// The row of the peer RMB whose rkey on `slot` is `rkey`.
    pub fn find_rtoken(&self, slot: usize, rkey: u32) -> Option<usize> {
        self.rtokens.iter().position(
            |r| matches!(r, Some(row) if matches!(row.get(slot), Some(Some((k, _))) if *k == rkey)),
        )
    }

    /// The row of the peer RMB whose rkey was `rkey` on a link that is gone
    /// now, the one to the peer port `gid`/`qpn`. A CLC Accept or Confirm
    /// names the peer's RMB by its rkey on the link the connection was on
    /// when it was sent (§1.11); the link can go down while it is on its
    /// way, and its column with it (`clear_link`). The row, with the RMB's
    /// rkeys on the other links (CONFIRM_RKEY, ADD_LINK_CONT), is what lets
    /// the connection fail over to one of those as Linux's
    /// `smc_switch_conns` (smc_core.c) moves a handshaking connection with
    /// the rest of its group. The rkeys of the last `LINK_SLOTS` links
    /// cleared are kept, while their rows are.
    pub fn find_former_rtoken(&self, gid: Gid, qpn: u32, rkey: u32) -> Option<usize> {
        self.former
            .iter()
            .filter(|f| f.gid == gid && f.qpn == qpn)
            .flat_map(|f| &f.rkeys)
            .find(|&&(k, _)| k == rkey)
            .map(|&(_, row)| row)
    }

    /// A row that is freed or taken by another RMB: its rkeys on gone links
    /// find it no more.
    fn forget_former_row(&mut self, row: usize) {
        for f in &mut self.former {
            f.rkeys.retain(|&(_, r)| r != row);
        }
    }

    /// A peer RMB row.
    pub fn rtoken(&self, row: usize) -> Option<&Rtoken> {
        self.rtokens.get(row).and_then(Option::as_ref)
    }

    /// Number of peer RMBs known.
    pub fn rtoken_count(&self) -> usize {
        self.rtokens.iter().flatten().count()
    }

    fn slot_of_link_id(&self, id: u8) -> Option<usize> {
        self.links
            .iter()
            .position(|l| matches!(l, Some(l) if l.link_id == id && l.state != LinkState::Inactive))
    }

    // ------------------------------------------------------------ local flows

    /// Starts a CONFIRM_RKEY flow announcing our new RMB (§1.11): entry 0 for the
    /// link in `slot`, the other entries for our other active links
    /// (`others`: (slot, rkey, vaddr)). `tag` comes back in [`LgrOutput::RkeyFlowDone`].
    /// Returns false if another local flow is running, or a further link is
    /// being added (the caller retries later): Linux's ADD_LINK flow holds the
    /// flow slot until the new link is confirmed (§1.6), so every RMB is either
    /// in the new link's rkey exchange or announced afterwards for it too.
    pub fn start_confirm_rkey(
        &mut self,
        slot: usize,
        rkey: u32,
        vaddr: u64,
        others: &[(usize, u32, u64)],
        tag: u64,
        now: Timestamp,
    ) -> bool {
        if self.local_flow.is_some() || self.terminated.is_some() || self.adding_link() {
            return false;
        }
        let others: Vec<LinkRtoken> = others
            .iter()
            .filter_map(|&(s, rkey, vaddr)| {
                self.link(s).map(|l| LinkRtoken {
                    link_id: l.link_id,
                    rkey,
                    vaddr,
                })
            })
            .collect();
        let msg =
            LlcMessage::ConfirmRkey(ConfirmRkey::request(self.cfg.version, rkey, vaddr, &others));
        self.out.push_back(LgrOutput::SendLlc { slot, msg });
        self.local_flow = Some(LocalFlow::ConfirmRkey {
            tag,
            deadline: now + llc::WAIT_TIME,
            via: slot,
        });
        true
    }

    /// A further link is being added (ACTIVATING, not the first contact's).
    pub fn adding_link(&self) -> bool {
        self.add.is_some()
            || self
                .links
                .iter()
                .flatten()
                .any(|l| l.state == LinkState::Activating && !l.first_contact)
    }

    /// One of our LLC request flows is waiting for its response (§1.6).
    pub fn local_flow_busy(&self) -> bool {
        self.local_flow.is_some()
    }

    /// Starts a DELETE_RKEY flow for our released RMB (its rkey on `slot`).
    pub fn start_delete_rkey(&mut self, slot: usize, rkey: u32, tag: u64, now: Timestamp) -> bool {
        if self.local_flow.is_some() || self.terminated.is_some() || self.add.is_some() {
            return false;
        }
        let msg = LlcMessage::DeleteRkey(DeleteRkey::request(self.cfg.version, vec![rkey]));
        self.out.push_back(LgrOutput::SendLlc { slot, msg });
        self.local_flow = Some(LocalFlow::DeleteRkey {
            tag,
            deadline: now + llc::WAIT_TIME,
            via: slot,
        });
        true
    }

    // ------------------------------------------------------------------ input

    /// An LLC message arrived on the link in `slot` (§1.6 dispatch rules).
    pub fn on_llc(&mut self, slot: usize, msg: LlcMessage, now: Timestamp) {
        if self.terminated.is_some() {
            self.dropped += 1;
            return;
        }
        match self.links.get_mut(slot).and_then(Option::as_mut) {
            // A link that went down takes no more part in the group; what it still
            // delivers is stale (its connections have moved away).
            Some(l) if l.state != LinkState::Inactive => l.last_rx = now,
            _ => {
                self.dropped += 1;
                return;
            }
        }
        let v = self.cfg.version;
        match msg {
            LlcMessage::TestLink(t) if !t.is_response() => {
                let msg = LlcMessage::TestLink(TestLink::response_to(&t));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            LlcMessage::TestLink(_) => {
                if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
                    l.testlink_sent = None;
                }
            }
            LlcMessage::ConfirmLink(c) => self.on_confirm_link(slot, &c),
            // Without redundancy every request is rejected at once, so that a
            // Linux server does not stall its accept path (§11 item 3).
            LlcMessage::AddLink(a) => self.on_add_link(slot, a, now),
            LlcMessage::AddLinkCont(c) => self.on_add_link_cont(&c, now),
            LlcMessage::ReqAddLink(r) if !r.is_response() => {
                if self.cfg.role == Role::Server {
                    // (a v2 client's invitation: with redundancy on, the
                    // server runs its own ADD_LINK flow when it can, §1.8)
                    if self.redundancy.enabled {
                        self.want_add_link();
                    }
                    let msg = LlcMessage::ReqAddLink(ReqAddLink::response_to(&r));
                    self.out.push_back(LgrOutput::SendLlc { slot, msg });
                } else {
                    self.dropped += 1;
                }
            }
            LlcMessage::ConfirmRkey(c) if !c.is_response() => {
                let ok = self.store_peer_rkeys(slot, &c).is_ok();
                let msg = LlcMessage::ConfirmRkey(ConfirmRkey::response_to(&c, ok));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            LlcMessage::ConfirmRkey(c) => {
                if let Some(LocalFlow::ConfirmRkey { tag, .. }) = self.local_flow {
                    self.local_flow = None;
                    self.out.push_back(LgrOutput::RkeyFlowDone {
                        tag,
                        ok: !c.is_negative(),
                    });
                    self.after_flow();
                } else {
                    self.dropped += 1;
                }
            }
            LlcMessage::DeleteRkey(d) if !d.is_response() => {
                let mut unknown = Vec::new();
                for &k in &d.rkeys {
                    match self.find_rtoken(slot, k) {
                        Some(row) => {
                            self.rtokens[row] = None;
                            self.forget_former_row(row);
                        }
                        None => unknown.push(k),
                    }
                }
                let msg =
                    LlcMessage::DeleteRkey(DeleteRkey::response_to(&d, |k| unknown.contains(&k)));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            LlcMessage::DeleteRkey(d) => {
                if let Some(LocalFlow::DeleteRkey { tag, .. }) = self.local_flow {
                    self.local_flow = None;
                    self.out.push_back(LgrOutput::RkeyFlowDone {
                        tag,
                        ok: !d.is_negative(),
                    });
                    self.after_flow();
                } else {
                    self.dropped += 1;
                }
            }
            LlcMessage::DeleteLink(d) if !d.is_response() => self.on_delete_link(slot, &d, v),
            // CONFIRM_RKEY_CONT is never sent by Linux and ignored when received;
            // responses to flows we never run (ADD_LINK, DELETE_LINK, ...) too.
            _ => self.dropped += 1,
        }
    }

    fn on_confirm_link(&mut self, slot: usize, c: &ConfirmLink) {
        let activating = matches!(self.link(slot), Some(l) if l.state == LinkState::Activating);
        let expected = match self.cfg.role {
            Role::Client => !c.is_response(),
            Role::Server => c.is_response(),
        };
        // (a further link is confirmed only once its rkeys are exchanged)
        let early = self
            .add
            .as_ref()
            .is_some_and(|f| f.slot == slot && f.stage != add_link::Stage::Confirming);
        if !activating || !expected || early {
            self.dropped += 1;
            return;
        }
        let first_contact = self.link(slot).is_some_and(|l| l.first_contact);
        // The eye-catcher bits are checked only on the first contact (§1.3).
        if first_contact && !c.no_rmbe_eyec() {
            self.link_down(slot, DownReason::RmbeEyecatcher);
            return;
        }
        if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
            if self.cfg.role == Role::Client && first_contact {
                // The client adopts the link id the server assigned (§1.7 step
                // 2); an added link has the id of its ADD_LINK (§1.8).
                l.link_id = c.link_num;
            }
            l.peer_link_uid = c.link_uid;
        }
        if self.cfg.role == Role::Client {
            let msg = self.confirm_link_msg(slot, true);
            self.out.push_back(LgrOutput::SendLlc { slot, msg });
        }
        self.activate(slot);
    }

    fn store_peer_rkeys(&mut self, slot: usize, c: &ConfirmRkey) -> Result<(), RtokenTableFull> {
        if usize::from(c.num_rkeys) > LINK_SLOTS - 1 {
            return Err(RtokenTableFull);
        }
        let row = self.add_rtoken(slot, c.rkey, c.vaddr)?;
        for t in c.additional() {
            if let Some(s) = self.slot_of_link_id(t.link_id) {
                if let Some(Some(r)) = self.rtokens.get_mut(row) {
                    if let Some(cell) = r.get_mut(s) {
                        *cell = Some((t.rkey, t.vaddr));
                    }
                }
            }
        }
        Ok(())
    }

    fn on_delete_link(&mut self, slot: usize, d: &DeleteLink, v: LlcVersion) {
        if d.is_all() {
            // The peer ends the group. A Linux server echoes its own DELETE_LINK
            // ALL (orderly, with the peer's reason) before tearing down (captures §7.1).
            if self.cfg.role == Role::Server {
                let msg = LlcMessage::DeleteLink(DeleteLink::delete_all(v, true, d.reason));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            self.terminate_quietly(d.reason);
            return;
        }
        match self.slot_of_link_id(d.link_num) {
            None => {
                let msg = LlcMessage::DeleteLink(DeleteLink::response_to(d, llc::DEL_NOLNK));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
            }
            Some(target) => {
                let msg = LlcMessage::DeleteLink(DeleteLink::response_to(d, 0));
                self.out.push_back(LgrOutput::SendLlc { slot, msg });
                self.link_down(target, DownReason::DeletedByPeer(d.reason));
            }
        }
    }

    // ------------------------------------------------------------------ timers

    /// When [`Self::on_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.terminated.is_some() {
            return None;
        }
        let mut t: Option<Timestamp> = match &self.local_flow {
            Some(
                LocalFlow::ConfirmRkey { deadline, .. } | LocalFlow::DeleteRkey { deadline, .. },
            ) => Some(*deadline),
            None => None,
        };
        let mut earliest = |x: Timestamp| t = Some(t.map_or(x, |t| t.min(x)));
        if let Some(f) = &self.add {
            earliest(f.deadline);
        }
        if let Some(r) = self.add_retry_at {
            earliest(r);
        }
        for l in self.links.iter().flatten() {
            if let Some(d) = l.confirm_deadline {
                earliest(d);
            }
            if l.state == LinkState::Active {
                if let Some(sent) = l.testlink_sent {
                    earliest(sent + llc::WAIT_TIME);
                } else if let Some(iv) = self.cfg.testlink_interval {
                    earliest(l.last_rx + iv);
                }
            }
        }
        t
    }

    /// Runs the timers due at `now`.
    pub fn on_timeout(&mut self, now: Timestamp) {
        if self.terminated.is_some() {
            return;
        }
        match self.local_flow {
            Some(
                LocalFlow::ConfirmRkey { tag, deadline, .. }
                | LocalFlow::DeleteRkey { tag, deadline, .. },
            ) if now >= deadline => {
                self.local_flow = None;
                self.out
                    .push_back(LgrOutput::RkeyFlowDone { tag, ok: false });
                self.after_flow();
            }
            _ => {}
        }
        self.add_flow_timeout(now);
        self.add_retry_due(now);
        for slot in 0..LINK_SLOTS {
            enum Due {
                Nothing,
                Down(DownReason),
                SendTestLink,
            }
            let due = match self.link(slot) {
                Some(l) if l.confirm_deadline.is_some_and(|d| now >= d) => {
                    Due::Down(DownReason::ConfirmLinkTimeout)
                }
                Some(l) if l.state == LinkState::Active => {
                    match (l.testlink_sent, self.cfg.testlink_interval) {
                        (Some(sent), _) if now >= sent + llc::WAIT_TIME => {
                            Due::Down(DownReason::KeepaliveTimeout)
                        }
                        (None, Some(iv)) if now >= l.last_rx + iv => Due::SendTestLink,
                        _ => Due::Nothing,
                    }
                }
                _ => Due::Nothing,
            };
            match due {
                Due::Nothing => {}
                Due::Down(r) => self.link_down(slot, r),
                Due::SendTestLink => {
                    if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
                        l.testlink_sent = Some(now);
                    }
                    let msg = LlcMessage::TestLink(TestLink::request(self.cfg.version));
                    self.out.push_back(LgrOutput::SendLlc { slot, msg });
                }
            }
        }
    }

    /// The peer of the link in `slot` is alive but paused (its process is
    /// stopped, as the provider can tell on one host): a TEST_LINK request
    /// it has left unanswered for `SMC_LLC_WAIT_TIME` waits on, from `now`,
    /// instead of taking the link down. A TCP peer's kernel answers
    /// keepalives for a stopped process; here the peer answers itself once
    /// it runs again (the request waits in its receive queue), and its
    /// death still ends the link (the provider's QP error). Returns whether
    /// a wait was extended.
    pub fn peer_paused(&mut self, slot: usize, now: Timestamp) -> bool {
        let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        match l.testlink_sent {
            Some(sent) if l.state == LinkState::Active && now >= sent + llc::WAIT_TIME => {
                l.testlink_sent = Some(now);
                true
            }
            _ => false,
        }
    }

    /// Whether the TEST_LINK request on the link in `slot` has gone
    /// unanswered for `SMC_LLC_WAIT_TIME` at `now` (the next timer run
    /// takes the link down, unless [`Self::peer_paused`] says otherwise).
    pub fn keepalive_overdue(&self, slot: usize, now: Timestamp) -> bool {
        self.link(slot).is_some_and(|l| {
            l.state == LinkState::Active
                && l.testlink_sent.is_some_and(|s| now >= s + llc::WAIT_TIME)
        })
    }

    /// Asks the peer of the link in `slot` for a sign of life now — a TEST_LINK
    /// request (§1.10) — rather than once the keepalive interval has passed
    /// without one: the driver has reason to think the peer is gone. As for the
    /// keepalive's own request (Linux `smc_llc_testlink_work`), no answer within
    /// `SMC_LLC_WAIT_TIME` takes the link down. Nothing happens if the link is
    /// not active or a request is already out.
    pub fn probe_link(&mut self, slot: usize, now: Timestamp) {
        if self.terminated.is_some() {
            return;
        }
        let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if l.state != LinkState::Active || l.testlink_sent.is_some() {
            return;
        }
        l.testlink_sent = Some(now);
        let msg = LlcMessage::TestLink(TestLink::request(self.cfg.version));
        self.out.push_back(LgrOutput::SendLlc { slot, msg });
    }

    /// Any completed receive on the link counts as a sign of life (§1.10).
    pub fn on_rx_activity(&mut self, slot: usize, now: Timestamp) {
        if let Some(l) = self.links.get_mut(slot).and_then(Option::as_mut) {
            l.last_rx = now;
        }
    }
}
