//! The CLC handshake, what client and server share: the CLC byte stream of a
//! connection ([`Endpoint::clc_input`], [`Endpoint::clc_output`]), dispatch of
//! received CLC messages, Declines and the fallback they cause, the late
//! decline after a failed first link, and the data path set up from the
//! peer's Accept / Confirm. The client's steps are in `handshake_client.rs`,
//! the server's in `handshake_server.rs`.
//!
//! Spec: `protocol-clc.md` §3 (messages), §4 (client and server flows,
//! first contact vs reuse, version negotiation, §4.6 timeouts),
//! `protocol-llc-cdc.md` §3.3 (the peer's RMB element). Linux: af_smc.c
//! (`__smc_connect`, `smc_listen_work`), smc_clc.c (`smc_clc_wait_msg`,
//! `smcr_clc_prep_confirm_accept`). The decisions are smc-proto's
//! (`negotiate`, `clc_stream`).

use super::conn::{ConnStatus, Phase};
use super::conn_core::lock;
use super::gid;
use super::gid::ConnGids;
use super::lgr::PeerRmb;
use super::{ConnId, Endpoint, EndpointConfig};
use smc_proto::clc_stream::{self, FailReason, HandshakeEnd};
use smc_proto::close::CloseEvent;
use smc_proto::datapath::{DataPath, DataPathConfig, FAILOVER_RESERVE};
use smc_proto::link::Role;
use smc_proto::negotiate::{self, LocalCapabilities, RoceV1Port};
use smc_proto::Timestamp;
use smc_rdma::{Device, GidEntry, MemoryRegion, Provider, QueuePair};
use smc_wire::clc::{
    AcceptConfirm, AcceptConfirmKind, ClcMessage, ClcType, Decline, DeclineCode, FceV2x,
    FirstContactExt, CLC_WAIT_TIME_SHORT, OS_LINUX, SMC_V2,
};
use smc_wire::types::{Eid, RmbeSize};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::Duration;

/// Longest time a server's Proposal waits for a first contact with the same peer
/// to finish ([`HandshakePhase::AwaitLgr`](crate::state::HandshakePhase::AwaitLgr)) before it makes its own: half the
/// client's wait for the Accept, so that the Accept still comes in time.
const LGR_PENDING_WAIT: Duration = Duration::from_secs(3);

/// Late declines (the first link failed, or its CONFIRM_LINK did not come,
/// after the CLC exchange: `protocol-clc.md` §4.2 step 8, §4.3 step 13, §4.6).
/// Linux waits for the link (server 2 s, client 4 s), then reads for the peer's
/// Decline for up to 1 s (`CLC_WAIT_TIME_SHORT`, `smc_clc_wait_msg`) and only
/// then sends its own TIMEOUT_CL; a Decline is never answered with one. When
/// both ends see the link fail at once (a QP error), that makes both decline
/// together: the Declines cross, and each end hands the other's to its
/// application as data (issue 13, finding 1). So the two roles wait
/// differently, and the server is the one that declines:
///
/// * the server reads for the client's Decline for [`SERVER_LATE_DECLINE_WAIT`]
///   after its link wait ended — long enough for a Decline already on its way,
///   and shorter than the 1 s a Linux client reads after its own link fails, so
///   that ours reaches a Linux client first when both see the failure together;
///   it declines at most 2.5 s after the Confirm (2 s link wait);
/// * the client reads for the server's Decline until [`CLIENT_LATE_DECLINE_WAIT`]
///   after its Confirm (Linux's 4 s + 1 s) and at least `CLC_WAIT_TIME_SHORT`
///   after its link failed — well after any server, ours or Linux's (2 s + 1 s
///   after the Confirm), has declined.
pub(super) const SERVER_LATE_DECLINE_WAIT: Duration = Duration::from_millis(500);

/// See [`SERVER_LATE_DECLINE_WAIT`].
const CLIENT_LATE_DECLINE_WAIT: Duration = Duration::from_secs(5);

/// After our own late Decline, how long the first bytes from the peer are
/// looked at for a Decline that crossed ours (a peer with other timers): it
/// was sent before ours arrived, so it is there within a round trip, ahead of
/// any application data.
const CROSSED_DECLINE_WAIT: Duration = CLC_WAIT_TIME_SHORT;

impl<P: Provider> Endpoint<P> {
    /// The GIDs a connection from `local` may use (see `endpoint/gid.rs`),
    /// for the versions this endpoint offers.
    pub(super) fn conn_gids(&mut self, local: IpAddr) -> ConnGids {
        let pick = |gids: &[GidEntry], cfg: &EndpointConfig| ConnGids {
            v1: cfg.offer_v1.then(|| gid::v1_gid(gids)).flatten(),
            v2: cfg
                .offer_v2
                .then(|| gid::v2_gid(gids, local, &cfg.if_addrs))
                .flatten(),
        };
        let g = pick(&self.gids, &self.cfg);
        // An IPv4 address the table lacks may have been added since it was
        // read: read it again, at most once a second.
        let missing = self.cfg.offer_v2 && g.v2.is_none() && gid::ipv4_of(local).is_some();
        let due = self
            .gids_reread
            .is_none_or(|t| self.now >= t + Duration::from_secs(1));
        if missing && due {
            self.gids_reread = Some(self.now);
            if let Ok(port) = self.dev.query_port(1) {
                self.gids = port.gids;
                return pick(&self.gids, &self.cfg);
            }
        }
        g
    }

    pub(super) fn caps(&self, gids: &ConnGids) -> LocalCapabilities {
        LocalCapabilities {
            system_id: self.cfg.system_id,
            v1: gids.v1.map(|g| RoceV1Port {
                gid: g.gid,
                mac: self.mac,
            }),
            v2_gid: gids.v2.map(|g| g.gid),
            ueids: self.cfg.ueids.clone(),
            if_addrs: self.cfg.if_addrs.clone(),
        }
    }

    /// Bytes to send on the connection's TCP socket (CLC messages).
    pub fn clc_output(&mut self, id: ConnId) -> Vec<u8> {
        self.conn(id)
            .map(|c| c.out.drain(..).collect())
            .unwrap_or_default()
    }

    pub(super) fn send_clc(&mut self, id: ConnId, m: &ClcMessage) {
        if let Some(c) = self.conn(id) {
            c.out.extend(m.encode());
        }
    }

    pub(super) fn finish(&mut self, id: ConnId, status: ConnStatus) {
        self.drop_handshake_resources(id);
        if let Some(c) = self.conn(id) {
            c.phase = Phase::Done(status);
        }
    }

    /// A handshake that dies before SMC was reached releases what it took: its
    /// place in the link group (a first contact's group then ends, see
    /// [`LgrState::on`](crate::state::LgrState::on)), its buffers and data path.
    pub(super) fn drop_handshake_resources(&mut self, id: ConnId) {
        let lgr = self.conn(id).and_then(|c| c.lgr.take());
        if let Some(l) = lgr {
            self.detach(id, l);
        }
        if let Some(mut k) = self.core(id) {
            k.set_link(None);
            k.move_to = None;
            k.validation = None;
            k.rmb = None;
            k.sndbuf = None;
            k.dp = None;
            k.peer_rmb = None;
            k.peer_window = None;
        }
    }

    /// The first link of a first contact failed, or its CONFIRM_LINK did not
    /// come in time, after the CLC exchange: read for the peer's Decline until
    /// the role's deadline, then decline (see [`SERVER_LATE_DECLINE_WAIT`]).
    /// The link group is of no more use to the connection and is let go now.
    pub(super) fn late_decline(&mut self, id: ConnId) {
        let now = self.now;
        let Some(c) = self.conn(id) else { return };
        let Phase::AwaitLink { version, since } = c.phase else {
            return;
        };
        let deadline = match c.role {
            Role::Server => now + SERVER_LATE_DECLINE_WAIT,
            Role::Client => (since + CLIENT_LATE_DECLINE_WAIT).max(now + CLC_WAIT_TIME_SHORT),
        };
        c.phase = Phase::AwaitLateDecline { version, deadline };
        self.conn_event(id);
        self.drop_handshake_resources(id);
    }

    /// No Decline from the peer by the deadline: ours goes out (TIMEOUT_CL, the
    /// code Linux sends after its CONFIRM_LINK wait), and the first bytes from
    /// the peer are still looked at for one that crossed it.
    pub(super) fn send_late_decline(&mut self, id: ConnId, version: u8) {
        let code = DeclineCode::TimeoutCl;
        let d = Decline::new(version, self.cfg.system_id, code);
        self.send_clc(id, &ClcMessage::Decline(d));
        let deadline = self.now + CROSSED_DECLINE_WAIT;
        if let Some(c) = self.conn(id) {
            c.phase = Phase::LateDeclined {
                reason: code,
                deadline,
            };
        }
    }

    pub(super) fn decline(&mut self, id: ConnId, version: u8, code: DeclineCode) {
        match clc_stream::decline(code) {
            HandshakeEnd::Fallback {
                reason,
                peer_diagnosis,
                send_decline,
            } => {
                if send_decline {
                    let d = Decline::new(version, self.cfg.system_id, code);
                    self.send_clc(id, &ClcMessage::Decline(d));
                }
                self.finish(
                    id,
                    ConnStatus::Fallback {
                        reason,
                        peer: peer_diagnosis,
                    },
                );
            }
            HandshakeEnd::Fail(r) => self.finish(id, ConnStatus::Failed(r)),
        }
    }

    /// Bytes received on the connection's TCP socket. Returns how many were CLC;
    /// the rest (after a fallback) is application data for the TCP stream.
    pub fn clc_input(&mut self, id: ConnId, data: &[u8], now: Timestamp) -> usize {
        self.now = now;
        // a handshake step (the connection may start sending)
        self.conn_event(id);
        let mut used = 0;
        while used < data.len() {
            let Some(c) = self.conn(id) else { return used };
            let expected = match c.phase {
                Phase::AwaitAccept { .. } => ClcType::Accept,
                Phase::AwaitProposal { .. } => ClcType::Proposal,
                Phase::AwaitConfirm { .. } => ClcType::Confirm,
                // a late Decline may still come while the link is being confirmed
                Phase::AwaitLink { .. }
                | Phase::AwaitLateDecline { .. }
                | Phase::ClientRkey { .. }
                | Phase::ServerRkey { .. }
                | Phase::AwaitLgr { .. } => ClcType::Decline,
                // the rest of a peer Decline that began to arrive before ours
                // went out
                Phase::LateDeclined { .. } if !c.reader.is_idle() => ClcType::Decline,
                Phase::LateDeclined { reason, .. } => {
                    // The first bytes after our late Decline: a Decline of the
                    // peer's that crossed ours is consumed, never handed to
                    // the application; anything else is its data.
                    let crossed = clc_stream::decline_at_head(&data[used..]);
                    let n = crossed.as_ref().map_or(0, |(n, _)| *n);
                    let peer = crossed.map(|(_, d)| d.diagnosis);
                    self.finish(id, ConnStatus::Fallback { reason, peer });
                    return used + n;
                }
                // (the server's answer is the caller's to take off:
                // `owed_answer`)
                Phase::Smc { .. } | Phase::Done(_) | Phase::Unanswered { .. } => return used,
            };
            let (n, msg) = c.reader.feed(&data[used..], expected);
            used += n;
            match msg {
                None => {}
                Some(Err(e)) => self.finish(id, ConnStatus::Failed(FailReason::Protocol(e))),
                Some(Ok(m)) => self.on_clc(id, m, now),
            }
            if n == 0 {
                break;
            }
        }
        used
    }

    fn on_clc(&mut self, id: ConnId, m: ClcMessage, now: Timestamp) {
        if let ClcMessage::Decline(d) = &m {
            if d.out_of_sync {
                if let Some(l) = self.conn(id).and_then(|c| c.lgr) {
                    if let Some(lg) = self.lgrs.get_mut(l) {
                        lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, false);
                    }
                }
            }
            if let Some(Phase::LateDeclined { reason, .. }) = self.conn(id).map(|c| c.phase.clone())
            {
                // it crossed ours
                let peer = Some(d.diagnosis);
                return self.finish(id, ConnStatus::Fallback { reason, peer });
            }
            let HandshakeEnd::Fallback {
                reason,
                peer_diagnosis,
                ..
            } = clc_stream::peer_declined(d.diagnosis)
            else {
                return;
            };
            self.finish(
                id,
                ConnStatus::Fallback {
                    reason,
                    peer: peer_diagnosis,
                },
            );
            return;
        }
        let phase = self.conn(id).map(|c| c.phase.clone());
        match (phase, m) {
            (Some(Phase::AwaitAccept { proposal, .. }), ClcMessage::Accept(a)) => {
                self.client_on_accept(id, &proposal, a, now)
            }
            (Some(Phase::AwaitProposal { .. }), ClcMessage::Proposal(p)) => {
                self.server_on_proposal(id, p, now, Some(now + LGR_PENDING_WAIT))
            }
            (
                Some(Phase::AwaitConfirm {
                    version,
                    first_contact,
                    ..
                }),
                ClcMessage::Confirm(c),
            ) => self.server_on_confirm(id, version, first_contact, c, now),
            (_, m) => self.finish(
                id,
                ConnStatus::Failed(FailReason::Protocol(clc_stream::ClcReadError::Unexpected(
                    m.msg_type(),
                ))),
            ),
        }
    }

    pub(super) fn setup_datapath(&mut self, id: ConnId, peer: &AcceptConfirm) -> bool {
        let Some((l, slot)) = self
            .conn(id)
            .and_then(|c| Some((c.lgr?, lock(&c.core).link?)))
        else {
            return false;
        };
        // The peer's element is at rmbe_size × (index − 1) of its RMB (§3.3);
        // the values were checked (`negotiate::check_peer_values`).
        let Some((off, peer_len)) = negotiate::peer_rmbe_range(peer) else {
            return false;
        };
        let Some(lg) = self.lgrs.get_mut(l) else {
            return false;
        };
        // The rkey in CLC is the peer RMB's on the link the CLC names (§1.11),
        // which the connection may have left since (see `Lgr::add_clc_rtoken`):
        // its row may already exist from CONFIRM_RKEY.
        let Ok(row) = lg.add_clc_rtoken(slot, peer) else {
            return false;
        };
        let can_fail_over =
            lg.multi_link || (self.redundancy.enabled && lg.group.config().max_links > 1);
        let Some(c) = self.conn(id) else {
            return false;
        };
        {
            let mut k = lock(&c.core);
            let Some(rmbe_len) = k.rmb.as_ref().map(MemoryRegion::len) else {
                return false;
            };
            // (the connection's own, which `Endpoint::set_buffer_sizes` may
            // have sized)
            let Some(sndbuf_len) = k.sndbuf.as_ref().map(MemoryRegion::len) else {
                return false;
            };
            k.peer_rmb = Some(PeerRmb { row, offset: off });
            let mut dp = DataPath::new(DataPathConfig {
                sndbuf_len,
                rmbe_len,
                peer_rmbe_len: peer_len,
                peer_token: peer.alert_token,
            });
            // A group that can fail over keeps a byte of the peer's RMBE
            // free on each connection, so that after a failover the peer
            // always gets bytes it has not seen and answers with its consumer
            // cursor (Linux does not send again an update lost with the
            // failed link; see `DataPath::set_failover_reserve`). That is a
            // group that has had two links, and one that expects a second
            // (redundancy on, two links agreed): its first connections may
            // fill the peer's RMBE before the second link comes, and a
            // reserve set only then would leave them without one until the
            // peer's next consumer update. A group agreed on one link costs
            // nothing; if it gets a second one all the same, its connections
            // get the reserve then (`Endpoint::group_can_fail_over`).
            if can_fail_over {
                dp.set_failover_reserve(FAILOVER_RESERVE);
            }
            k.dp = Some(dp);
        }
        // CDCs that overtook the CLC Confirm (see `Phase::AwaitConfirm`).
        let early = match &mut c.phase {
            Phase::ServerRkey { early, .. } | Phase::AwaitConfirm { early, .. } => {
                std::mem::take(early)
            }
            _ => VecDeque::new(),
        };
        for m in &early {
            self.on_cdc(id, m);
        }
        true
    }

    pub(super) fn our_accept_confirm(
        &self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        eid: Option<Eid>,
        kind: AcceptConfirmKind,
    ) -> Option<AcceptConfirm> {
        let c = self.conns.get(id)?;
        let lg = self.lgrs.get(c.lgr?)?;
        // the connection's link is the one this message names (§6)
        let k = lock(&c.core);
        let link = lg.links.get(k.link?)?.as_ref()?;
        let rmb = k.rmb.as_ref()?;
        // the RMB's rkey and address on the connection's link's device
        let (rmb_rkey, rmb_vaddr) = lg.rmb_token(k.link?, rmb.rkey(), rmb.addr());
        // Linux (smc_clc.c `smcr_clc_prep_confirm_accept`): an Accept names
        // our port's MTU, a Confirm the link's path MTU, the smaller of ours
        // and the peer's.
        // (a link on the endpoint's second device: its GID and port there)
        let (link_gid, port_mtu) = link.port(lg.local, self.port_mtu);
        let mtu = match kind {
            AcceptConfirmKind::Accept => port_mtu,
            AcceptConfirmKind::Confirm => link.path_mtu.unwrap_or(port_mtu),
        };
        let v2 = version >= SMC_V2;
        // The limits the CLC exchange agreed: a server's Accept offers them,
        // a client's Confirm repeats the Accept's, which a Linux server
        // checks (smc_clc.c `smc_clc_v2x_features_confirm_check`: another
        // max_conns or max_links is declined MAXCONNERR / MAXLINKERR).
        let limits = lg.group.config();
        Some(AcceptConfirm {
            version,
            first_contact,
            peer_id: self.cfg.system_id,
            // the link's GID, as Linux (`link->gid`): the group's, or the
            // second device's for a link there
            gid: link_gid.gid,
            mac: self.mac,
            qpn: link.qp.qp_num(),
            rmb_rkey,
            rmbe_idx: 1,
            alert_token: c.token,
            rmbe_size: RmbeSize::for_size(rmb.len(), RmbeSize::MAX_CLASS),
            qp_mtu: mtu.code(),
            rmb_vaddr,
            psn: link.psn,
            eid: if v2 {
                eid.unwrap_or_default()
            } else {
                Eid::default()
            },
            // (Linux `smc_clc_fill_fce_v2x`: the agreed release; its SMC-R
            // extension always has the v2.1 fields, zero before release 1)
            fce: (v2 && first_contact).then(|| FirstContactExt {
                v2_direct: true,
                os_type: OS_LINUX,
                release: lg.release,
                hostname: FirstContactExt::hostname_from_str(&self.cfg.hostname),
                v2x: Some(if lg.release >= smc_wire::clc::SMC_RELEASE_1 {
                    FceV2x {
                        max_conns: limits.max_conns,
                        max_links: limits.max_links,
                        feature_mask: 0,
                        vendor_opts: [0; 4],
                    }
                } else {
                    FceV2x {
                        max_conns: 0,
                        max_links: 0,
                        feature_mask: 0,
                        vendor_opts: [0; 4],
                    }
                }),
            }),
            // (Linux lists an alternate device's GID too, `smc_fill_gid_list`;
            // we have one device per endpoint)
            gid_list: (v2 && first_contact && kind == AcceptConfirmKind::Confirm)
                .then(|| vec![lg.local.gid]),
        })
    }

    pub(super) fn established(&mut self, id: ConnId) {
        // The link group may have died between the Accept and the Confirm (a
        // reused group losing its link): the connection is born dead.
        let lgr_dead = self
            .conn(id)
            .and_then(|c| c.lgr)
            .is_none_or(|l| self.lgrs.get(l).is_none_or(|lg| lg.group.is_terminated()));
        if let Some(c) = self.conn(id) {
            c.phase = Phase::Smc {
                tcp_gone_deadline: None,
                close_wait: None,
            };
            let mut k = lock(&c.core);
            k.established = true;
            k.closer.handle(CloseEvent::Established);
            if lgr_dead {
                k.closer.handle(CloseEvent::Kill { can_send: false });
            }
        }
        if lgr_dead {
            self.event_aborted(id, super::events::AbortCause::GroupTerminated);
        } else {
            // Its first blocking read may then sleep on the connection's
            // doorbell (`FastConn::may_sleep` needs the grant) instead of
            // through the endpoint, whose leader would be woken for the
            // peer's first CDC to wake it in turn: the one read of a short
            // connection (a request) paid that. Its writes may go direct
            // from the first (a read that owes the peer a cursor update
            // posts it that way too, or declines).
            self.grant_rx(id);
            if let Some(c) = self.conns.get(id) {
                let mut k = lock(&c.core);
                let max_inline = self.limits.max_inline as usize;
                if let Ok(p) =
                    Self::direct_plan(&mut k, c.lgr, &self.lgrs, max_inline, 1, false, false)
                {
                    Self::grant_fast(&mut self.lgrs, max_inline, id, &mut k, &p);
                }
            }
        }
    }
}
