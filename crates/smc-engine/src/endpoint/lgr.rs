//! Link groups: the [`Lgr`] record (its links' provider objects next to
//! smc-proto's [`LinkGroup`]), creation, the life-cycle steps
//! ([`LgrState`]), connections joining and leaving a group, the choice of a
//! connection's link, the first link's connection, and readying a link's QP
//! for a peer's RMB.
//!
//! Spec: `protocol-llc-cdc.md` §6 (link groups and links, reuse rules,
//! connection → link assignment), §1.7 (first-contact link), §1.11 (the
//! rtoken table: one (rkey, address) per RMB and link), §5.6 (idle groups).
//! Linux: smc_core.c (`smc_lgr_create`, `smc_conn_create`,
//! `smcr_lgr_conn_assign_link`), smc_ib.c `smc_ib_ready_link`.

use super::conn::Phase;
use super::conn_core::{lock, TokenEntry};
use super::events::AbortCause;
use super::gid::LocalGid;
use super::link::LinkRes;
use super::rkey::RkeyFlow;
use super::{ConnId, Endpoint, LgrId, Result};
use crate::state::{HandshakePhase, LgrAction, LgrEvent, LgrState};
use smc_proto::close::CloseEvent;
use smc_proto::link::{LgrConfig, LinkGroup, PeerPort, Role, LINK_SLOTS};
use smc_proto::Timestamp;
use smc_rdma::{Device, MemoryRegion, Provider, QueuePair};
use smc_wire::clc::{DeclineCode, SMC_V2};
use smc_wire::llc::LlcVersion;
use smc_wire::types::{Eid, Gid, RmbeSize, SystemId};
use std::collections::{BTreeMap, VecDeque};

/// What a first contact agreed for its link group (SMC v2.1 first-contact
/// extension; v1 groups take the defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Limits {
    pub(super) release: u8,
    pub(super) max_conns: u8,
    pub(super) max_links: u8,
}

pub(super) struct Lgr<P: Provider> {
    /// One protection domain for all links of the group on the endpoint's
    /// first device (see `endpoint/link.rs`).
    pub(super) pd: P::Pd,
    /// The group's PD on the second device and its buffers registered there,
    /// from its first link on that device (`endpoint/devices.rs`).
    pub(super) second: Option<super::devices::SecondPd<P>>,
    /// Provider objects of each link, by smc-proto link slot. A slot holds
    /// objects while smc-proto's slot holds the link, and briefly before: a
    /// further link offered and not yet accepted.
    pub(super) links: [Option<LinkRes<P>>; LINK_SLOTS],
    pub(super) state: LgrState,
    pub(super) group: LinkGroup,
    pub(super) role: Role,
    pub(super) version: u8,
    pub(super) peer_system_id: SystemId,
    /// The peer GID of the CLC exchange that created the group (reuse and
    /// first-contact serialization match on it, §6).
    pub(super) peer_gid: Gid,
    /// Our GID on the group's links (and its table index, the QPs' source
    /// GID): the one the connection that created the group chose (see
    /// `endpoint/gid.rs`); only connections with the same GID join.
    pub(super) local: LocalGid,
    /// The SMC v2 release the first contact agreed (first-contact extension).
    pub(super) release: u8,
    /// The peer's first-contact extension and the agreed EID (v2; what
    /// `smcr -d linkgroup` shows).
    pub(super) peer_v2: Option<crate::state::PeerV2>,
    pub(super) eid: Option<Eid>,
    pub(super) tokens: BTreeMap<u32, ConnId>,
    /// The sum of the RMB sizes of the connections in `tokens` (what
    /// [`RmbCrowding`](crate::endpoint::RmbCrowding) weighs): added in
    /// `attach`, taken off in `detach`, which comes before a connection's
    /// core gives its RMB up.
    pub(super) rmb_held: usize,
    pub(super) rkey_queue: VecDeque<RkeyFlow>,
    /// Released RMBs and send buffers kept registered for reuse (Linux keeps
    /// them in per-size pools, §4.4): a late RDMA WRITE from the peer lands in
    /// memory we still own, and the next connection skips registration.
    pub(super) free_bufs: Vec<(P::Mr, P::Mr)>,
    /// rkeys of pooled RMBs that the peer still knows: with a single link a
    /// released RMB is not deleted at the peer (no DELETE_RKEY), so a
    /// connection that reuses it needs no CONFIRM_RKEY either — the peer finds
    /// the rkey already in its table (Linux's smc_rtoken_add returns the
    /// existing row). Two LLC round trips less per reusing connection, the
    /// buffer reuse the connection-setup target asks for. Cleared when a link
    /// is added (its column of the peer's table lacks these rkeys).
    pub(super) known_rkeys: std::collections::HashSet<u32>,
    pub(super) idle_since: Option<Timestamp>,
    pub(super) rr: usize,
    /// The group has had two usable links at once, so its connections can
    /// fail over: they keep the failover reserve in the peer's RMBE
    /// (`Endpoint::group_can_fail_over`). Never cleared: a group that lost
    /// a link gets it back (the server adds it again), and a reserve set only
    /// then could come too late for an RMBE filled meanwhile.
    pub(super) multi_link: bool,
}

/// Where the peer's RMBE is: the row of its RMB in the link group's rtoken table
/// (one (rkey, address) per link, §1.11) and the RMBE inside the RMB.
#[derive(Clone, Copy, Debug)]
pub(super) struct PeerRmb {
    pub(super) row: usize,
    pub(super) offset: u64,
}

/// The Decline code for a failed [`QueuePair::prepare_remote`] (see
/// `Endpoint::prepare_peer_rmb`).
fn prepare_error_code(e: &smc_rdma::Error) -> DeclineCode {
    // ENOMEM, ENFILE, EMFILE: this process is short of memory or descriptors
    const OUT_OF_RESOURCES: [i32; 3] = [12, 23, 24];
    match e {
        smc_rdma::Error::Io(io)
            if io.kind() == std::io::ErrorKind::OutOfMemory
                || io
                    .raw_os_error()
                    .is_some_and(|n| OUT_OF_RESOURCES.contains(&n)) =>
        {
            DeclineCode::Mem
        }
        _ => DeclineCode::ErrRtok,
    }
}

impl<P: Provider> Endpoint<P> {
    /// A new link group whose links use our GID `local`, with the `limits`
    /// the CLC exchange agreed, which our CONFIRM_LINK and first-contact CLC
    /// repeat.
    pub(super) fn new_lgr(
        &mut self,
        role: Role,
        version: u8,
        peer_system_id: SystemId,
        peer_gid: Gid,
        local: LocalGid,
        limits: Limits,
    ) -> Result<LgrId> {
        let pd = self.dev.alloc_pd()?;
        // The first link is slot 0 (§1.7); its QP goes out in CLC.
        let psn = self.psns.next_psn();
        let first = LinkRes::new(&self.dev, &pd, &self.chan, self.limits, psn)?;
        let id = self.next_lgr_id;
        self.next_lgr_id = self.next_lgr_id.wrapping_add(0x100);
        let group = LinkGroup::new(LgrConfig {
            id,
            role,
            version: if version >= SMC_V2 {
                LlcVersion::V2_LE
            } else {
                LlcVersion::V1
            },
            max_links: limits.max_links,
            max_conns: limits.max_conns,
            testlink_interval: self.cfg.testlink,
        });
        let mut group = group;
        group.set_redundancy(self.redundancy);
        let l = Lgr {
            pd,
            second: None,
            links: [Some(first), None, None],
            state: LgrState::Creating,
            group,
            role,
            version,
            peer_system_id,
            peer_gid,
            local,
            release: limits.release,
            peer_v2: None,
            eid: None,
            tokens: BTreeMap::new(),
            rmb_held: 0,
            rkey_queue: VecDeque::new(),
            free_bufs: Vec::new(),
            known_rkeys: std::collections::HashSet::new(),
            idle_since: None,
            rr: 0,
            multi_link: false,
        };
        Ok(self.lgrs.insert(l))
    }

    /// Keeps what a v2 first contact told about the peer and agreed on
    /// (Linux smc_clc.c `smc_conn_save_peer_info_fce`; the EID:
    /// `lgr->negotiated_eid`).
    pub(super) fn keep_first_contact(
        &mut self,
        l: LgrId,
        fce: Option<&smc_wire::clc::FirstContactExt>,
        eid: Option<Eid>,
    ) {
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        if lg.version < SMC_V2 {
            return;
        }
        if let Some(f) = fce {
            lg.peer_v2 = Some(crate::state::PeerV2 {
                host: f.hostname_str(),
                os: f.os_type,
                direct: f.v2_direct,
            });
        }
        if eid.is_some() {
            lg.eid = eid;
        }
    }

    /// One step of a link group's life cycle ([`LgrState::on`]) and its action.
    /// `MoveConnections` is the caller's (it knows which link failed).
    pub(super) fn lgr_step(&mut self, l: LgrId, ev: LgrEvent) -> LgrAction {
        let Some(lg) = self.lgrs.get_mut(l) else {
            return LgrAction::Nothing;
        };
        let (next, action) = lg.state.on(ev);
        lg.state = next;
        match action {
            LgrAction::Nothing | LgrAction::MoveConnections => {}
            LgrAction::EstablishWaiting => {
                let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                for id in ids {
                    if matches!(
                        self.conn(id).map(|c| &c.phase),
                        Some(Phase::AwaitLink { .. })
                    ) {
                        // Both ends are past CONFIRM_LINK and count the
                        // connection established: a peer RMB we cannot ready
                        // now costs it its life (an abort CDC, which needs no
                        // rkey), as on a reused group's Confirm.
                        let slot = self.core(id).and_then(|k| k.link);
                        let prepared = slot.is_some_and(|s| self.prepare_peer_rmb(id, s).is_ok());
                        self.established(id);
                        if !prepared {
                            self.abort_now(id);
                        }
                    }
                }
            }
            // Linux: DELETE_LINK ALL|ORDERLY, program initiated (§5.6).
            LgrAction::DeleteAll => lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, true),
            // (no link is active: nothing is sent)
            LgrAction::Abandon => lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, false),
            LgrAction::KillConnections => {
                let v = lg.version;
                let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                for id in ids {
                    let phase = self.conn(id).map(|c| c.phase.kind());
                    match phase {
                        // The first-contact link never came up after the CLC
                        // exchange: the late decline, without crossing the
                        // peer's (Linux: TIMEOUT_CL after the CONFIRM_LINK wait).
                        Some(HandshakePhase::AwaitLink) => self.late_decline(id),
                        // Our CONFIRM_RKEY flow died with the group; the peer
                        // waits for our Accept / Confirm and sends nothing
                        // meanwhile, so our Decline cannot cross one.
                        Some(HandshakePhase::ClientRkey | HandshakePhase::ServerRkey) => {
                            self.decline(id, v, DeclineCode::TimeoutCl)
                        }
                        // AwaitConfirm stays: the client's Confirm may already be
                        // on its way, and a Decline now would leave it to reach
                        // our application as data. It is read (Linux reads it
                        // too, `smc_listen_work`) and declined then — a first
                        // contact has no link left to run on; a client on a
                        // reused group is established once it sent its Confirm:
                        // the Confirm establishes ours and the kill follows.
                        Some(HandshakePhase::AwaitConfirm) => {}
                        Some(HandshakePhase::Smc) => {
                            self.event_aborted(id, AbortCause::GroupTerminated);
                            if let Some(mut k) = self.core(id) {
                                k.closer.handle(CloseEvent::Kill { can_send: false });
                            }
                        }
                        _ => {}
                    }
                }
            }
            LgrAction::Free => {
                if let Some(lg) = self.lgrs.remove(l) {
                    for res in lg.links.iter().flatten() {
                        res.shut();
                    }
                }
            }
        }
        action
    }

    /// Attaches connection `id` to group `l` on link `slot`: RMB and send buffer
    /// from the group's pool or its PD.
    pub(super) fn attach(&mut self, id: ConnId, l: LgrId, slot: usize) -> Result<()> {
        let (rmb_ask, sndbuf_ask) = self.conns.get(id).map_or((None, None), |c| c.bufs);
        let rmb_len = RmbeSize::for_size(
            rmb_ask.unwrap_or_else(|| self.default_rmb_len()),
            RmbeSize::MAX_CLASS,
        )
        .bytes();
        // (a send buffer asked for is rounded as an RMB is, as Linux does,
        // so that pooled ones fit the next connection that asks alike)
        let sndbuf_len = sndbuf_ask.map_or(self.cfg.sndbuf_len, |n| {
            RmbeSize::for_size(n, RmbeSize::MAX_CLASS).bytes()
        });
        let lg = self
            .lgrs
            .get_mut(l)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such link group".into()))?;
        let (rmb, sndbuf) = lg.take_bufs(rmb_len, sndbuf_len, &mut self.events.bufs)?;
        // (on the group's second device too, if it has links there)
        if let Err(e) = lg.share_bufs(&rmb, &sndbuf) {
            lg.free_bufs.push((rmb, sndbuf));
            return Err(e);
        }
        let c = self
            .conns
            .get_mut(id)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such connection".into()))?;
        if lg.tokens.insert(c.token, id).is_none() {
            lg.rmb_held += rmb.len();
        }
        c.lgr = Some(l);
        {
            let mut k = lock(&c.core);
            k.set_link(Some(slot));
            k.rmb = Some(rmb);
            k.sndbuf = Some(sndbuf);
        }
        // (where its CDCs go, see `endpoint/conn_core/`)
        self.by_token.write().insert(
            c.token,
            TokenEntry {
                id,
                lgr: l,
                core: c.core.clone(),
            },
        );
        Ok(())
    }

    /// The RMB size of a connection that asks for none: the configured one,
    /// or the crowded one once the RMBs held exceed the budget
    /// ([`RmbCrowding`](crate::endpoint::RmbCrowding)).
    fn default_rmb_len(&self) -> usize {
        let len = self.cfg.rmb_len;
        match self.cfg.rmb_crowding {
            Some(c) if self.rmb_held().saturating_add(len) > c.budget => c.len.min(len),
            _ => len,
        }
    }

    /// RMB bytes the connections of every link group hold.
    pub(super) fn rmb_held(&self) -> usize {
        self.lgrs.values().map(|lg| lg.rmb_held).sum()
    }

    pub(super) fn detach(&mut self, id: ConnId, l: LgrId) {
        let token = self.conns.get(id).map(|c| c.token);
        if let Some(t) = token {
            self.by_token.write().remove(&t);
        }
        let rmb_len = self
            .core(id)
            .and_then(|k| k.rmb.as_ref().map(MemoryRegion::len))
            .unwrap_or(0);
        let empty = match self.lgrs.get_mut(l) {
            Some(lg) => {
                let attached = token.is_some_and(|t| lg.tokens.remove(&t).is_some());
                if attached {
                    lg.rmb_held = lg.rmb_held.saturating_sub(rmb_len);
                }
                attached && lg.tokens.is_empty()
            }
            None => false,
        };
        if empty {
            self.lgr_step(l, LgrEvent::LastConnGone);
        }
    }

    /// Link `slot` of group `l` became active in a group that already had
    /// one (ADD_LINK after the first contact, or again after a loss):
    /// established connections move to it from the busiest links until the
    /// loads differ by one at most, so the load spreads back over both
    /// links (issue 17). Linux moves connections only off a failed link
    /// (smc_core.c `smc_switch_conns`) and puts new ones on the least used
    /// link (`smc_conn_create`); moving a healthy connection is ours
    /// ([`Self::move_connection`]: each side picks the link of what it
    /// sends, which the peer accepts on any link of the group), so a Linux
    /// peer sees nothing but our WRITEs and CDCs on the other link.
    pub(super) fn spread_to(&mut self, l: LgrId, slot: usize) {
        let mut loads = self.link_loads(l);
        let Some(lg) = self.lgrs.get(l) else {
            return;
        };
        let mut candidates: Vec<(usize, ConnId)> = lg
            .tokens
            .values()
            .filter_map(|&id| {
                let k = self.core(id)?;
                let from = k.link.filter(|&s| s != slot && k.move_to.is_none())?;
                Some((from, id))
            })
            .collect();
        candidates.sort_unstable();
        loop {
            let Some(busiest) = (0..LINK_SLOTS)
                .filter(|&s| s != slot)
                .max_by_key(|&s| (loads[s], std::cmp::Reverse(s)))
            else {
                return;
            };
            if loads[busiest] <= loads[slot] + 1 {
                return;
            }
            let Some(i) = candidates.iter().position(|&(from, _)| from == busiest) else {
                return;
            };
            let (_, id) = candidates.swap_remove(i);
            loads[busiest] -= 1;
            if self.move_connection(id, slot) {
                loads[slot] += 1;
            }
        }
    }

    /// Connections per link slot of a group.
    fn link_loads(&self, l: LgrId) -> [usize; LINK_SLOTS] {
        let mut n = [0; LINK_SLOTS];
        if let Some(lg) = self.lgrs.get(l) {
            for id in lg.tokens.values() {
                let slot = self.core(*id).and_then(|k| k.link);
                if let Some(x) = slot.and_then(|s| n.get_mut(s)) {
                    *x += 1;
                }
            }
        }
        n
    }

    /// The usable link for a connection (§6): active and connected, other than
    /// `except`, and — for a connection that already has a peer RMB (`row`) —
    /// with the peer's rkey for it on that link; the one with the fewest
    /// connections, the lowest slot among equals.
    pub(super) fn pick_link(
        &self,
        l: LgrId,
        row: Option<usize>,
        except: Option<usize>,
    ) -> Option<usize> {
        let lg = self.lgrs.get(l)?;
        let loads = self.link_loads(l);
        lg.group
            .active_slots()
            .filter(|&s| Some(s) != except)
            .filter(|&s| {
                lg.links
                    .get(s)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.connected)
            })
            .filter(|&s| {
                row.is_none_or(|r| {
                    lg.group
                        .rtoken(r)
                        .is_some_and(|t| t.get(s).is_some_and(Option::is_some))
                })
            })
            .min_by_key(|&s| (loads[s], s))
    }

    /// First contact: connects the first link's QP to the peer's and starts
    /// the CONFIRM_LINK exchange (§1.7). The peer RMB of the connection is
    /// readied once the link is active ([`LgrAction::EstablishWaiting`]): a
    /// provider may reach peer memory only over a link both ends have
    /// brought to RTS (the shm device authenticates its peer then), and the
    /// client's QP reaches RTS only with the CONFIRM_LINK request. Errors are
    /// the Decline code ERR_RDYLNK (as Linux's failed `smc_ib_ready_link`).
    pub(super) fn connect_first_link(
        &mut self,
        l: LgrId,
        peer: PeerPort,
        now: Timestamp,
    ) -> std::result::Result<(), DeclineCode> {
        let mtu = self
            .dev
            .query_port(1)
            .map_err(|_| DeclineCode::ErrRdyLnk)?
            .active_mtu;
        let mac = self.mac;
        let lg = self
            .lgrs
            .get_mut(l)
            .filter(|lg| !lg.group.is_terminated())
            .ok_or(DeclineCode::ErrRdyLnk)?;
        let gid = lg.local;
        let res = lg.links[0].as_mut().ok_or(DeclineCode::ErrRdyLnk)?;
        res.connect(&peer, mtu, gid.index)
            .map_err(|_| DeclineCode::ErrRdyLnk)?;
        let local = res.local_port(gid.gid, mac, mtu);
        lg.group.add_first_link(local, peer, now);
        self.lgr_step(l, LgrEvent::FirstLinkConnected);
        Ok(())
    }

    /// Readies the QP of link `slot` for the RDMA WRITEs of connection `id`
    /// into the peer's RMB element ([`QueuePair::prepare_remote`]): called when
    /// the connection's peer RMB becomes known on a connected QP — before it
    /// counts as established — and when it moves or fails over to another
    /// link, where the peer's RMB has that link's rkey. A provider that needs
    /// resources of this process to reach peer memory takes them here, where a
    /// failure costs this connection only, not at a WRITE, where it would fail
    /// the QP and every connection on it. The Decline code of a failure: MEM
    /// when this process is out of resources (Linux's code for its own memory
    /// shortage), else ERR_RTOK — the peer's RMB cannot be reached (Linux's
    /// code when the peer's rkey / address cannot be taken into its rtoken
    /// table, `smc_rtoken_add`).
    pub(super) fn prepare_peer_rmb(
        &self,
        id: ConnId,
        slot: usize,
    ) -> std::result::Result<(), DeclineCode> {
        let c = self.conns.get(id).ok_or(DeclineCode::IntErr)?;
        let k = lock(&c.core);
        let (Some(l), Some(peer), Some(dp)) = (c.lgr, k.peer_rmb, k.dp.as_ref()) else {
            return Err(DeclineCode::IntErr);
        };
        let lg = self.lgrs.get(l).ok_or(DeclineCode::IntErr)?;
        let (rkey, base) = lg
            .group
            .rtoken(peer.row)
            .and_then(|t| t.get(slot).copied().flatten())
            .ok_or(DeclineCode::ErrRtok)?;
        let len = dp.config().peer_rmbe_len;
        // (an address from LLC for another link is checked here, as the one
        // from CLC was by `check_peer_values`)
        let addr = base
            .checked_add(peer.offset)
            .filter(|a| a.checked_add(len as u64).is_some())
            .ok_or(DeclineCode::ErrRtok)?;
        let res = lg
            .links
            .get(slot)
            .and_then(Option::as_ref)
            .ok_or(DeclineCode::IntErr)?;
        res.qp
            .prepare_remote(rkey, addr, len)
            .map_err(|e| prepare_error_code(&e))
    }
}
