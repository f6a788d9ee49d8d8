//! The client side of the CLC handshake: [`Endpoint::connect`] sends the
//! Proposal; the server's Accept either makes a first contact (a new link
//! group, its first link's CONFIRM_LINK exchange) or joins the link group the
//! Accept names (CONFIRM_RKEY for our RMB, then our Confirm).
//!
//! Spec: `protocol-clc.md` §4.2 (client flow), §4.5 (first contact),
//! `protocol-llc-cdc.md` §1.7 (first link), §1.11 (CONFIRM_RKEY before the
//! Confirm of a reused group), §6 (which link). Linux: af_smc.c
//! `__smc_connect`, `smc_connect_rdma`.

use super::conn::Phase;
use super::lgr::Limits;
use super::{ConnId, Endpoint};
use smc_proto::clc_stream::{ClcReader, OwedAnswer};
use smc_proto::link::{PeerPort, Role};
use smc_proto::negotiate::{self, ClientAgreement};
use smc_proto::Timestamp;
use smc_rdma::Provider;
use smc_wire::clc::{
    AcceptConfirm, AcceptConfirmKind, ClcMessage, Decline, DeclineCode, Proposal, CLC_WAIT_TIME,
    SMC_V1, SMC_V2,
};
use std::net::IpAddr;

impl<P: Provider> Endpoint<P> {
    /// Client: the TCP connection to the peer is up and the peer offered SMC on its
    /// SYN-ACK. Queues the Proposal (or a Decline when we have nothing to offer).
    /// `local_ip` is the TCP connection's local address: it chooses the
    /// GIDs (see `endpoint/gid.rs`; no SMC-R v2 over IPv6).
    pub fn connect(&mut self, local_ip: IpAddr, now: Timestamp) -> ConnId {
        self.now = self.now.max(now);
        let gids = self.conn_gids(local_ip);
        match negotiate::build_proposal(local_ip, &self.caps(&gids)) {
            Ok(p) => {
                let id = self.new_conn(
                    Role::Client,
                    Phase::AwaitAccept {
                        proposal: Box::new(p.clone()),
                        deadline: now + CLC_WAIT_TIME,
                    },
                    gids,
                );
                self.send_clc(id, &ClcMessage::Proposal(p));
                id
            }
            Err(code) => {
                let id = self.new_conn(Role::Client, Phase::AwaitProposal { deadline: now }, gids);
                self.decline(id, SMC_V1, code);
                id
            }
        }
    }

    /// No Accept (nor Decline) came within `CLC_WAIT_TIME`: the client
    /// declines (SMC_CLC_DECL_TIMEOUT, the timeout class's code) and the
    /// connection goes on over TCP, where Linux's client fails its connect
    /// with ETIMEDOUT (af_smc.c `__smc_connect`, `protocol-clc.md` §4.2 step
    /// 6). Linux's server never lets a Proposal wait that long (its listen
    /// worker runs every handshake); a server in user space runs one only
    /// when its process gets to it, and a TCP client would have been served
    /// late rather than refused. The server answers the Proposal when it
    /// reads it and then finds our Decline where it waits for the Confirm,
    /// which ends its handshake in a fallback (Linux `smc_listen_work`), so
    /// its answer is due on the stream ahead of its data: the caller takes
    /// it off ([`Endpoint::owed_answer`]; `clc_stream::OwedAnswer`).
    pub(super) fn give_up_on_accept(&mut self, id: ConnId) {
        let system_id = self.cfg.system_id;
        let Some(c) = self.conn(id) else { return };
        let Phase::AwaitAccept { proposal, .. } = &c.phase else {
            return;
        };
        // (the class of the versions proposed, as Linux's client declines)
        let version = if proposal.v2_ext.is_some() {
            SMC_V2
        } else {
            SMC_V1
        };
        // (the part of the answer that came before the wait ended)
        let answer = OwedAnswer::resume(c.reader.held());
        let reason = DeclineCode::Timeout;
        let d = Decline::new(version, system_id, reason);
        self.send_clc(id, &ClcMessage::Decline(d));
        self.drop_handshake_resources(id);
        if let Some(c) = self.conn(id) {
            c.reader = ClcReader::new();
            c.phase = Phase::Unanswered { reason, answer };
        }
    }

    /// The server's answer still due on the TCP stream of a client that
    /// stopped waiting for it ([`ConnStatus::Fallback`] with
    /// SMC_CLC_DECL_TIMEOUT): the caller takes it off the stream before it
    /// hands the stream's bytes to the application. `None` for every other
    /// connection.
    ///
    /// [`ConnStatus::Fallback`]: super::ConnStatus::Fallback
    pub fn owed_answer(&self, id: ConnId) -> Option<OwedAnswer> {
        match &self.conns.get(id)?.phase {
            Phase::Unanswered { answer, .. } => Some(answer.clone()),
            _ => None,
        }
    }

    pub(super) fn client_on_accept(
        &mut self,
        id: ConnId,
        proposal: &Proposal,
        a: AcceptConfirm,
        now: Timestamp,
    ) {
        let agreement: ClientAgreement = match negotiate::client_check_accept(proposal, &a)
            .and_then(|x| negotiate::check_peer_values(&a).map(|()| x))
        {
            Ok(x) => x,
            Err(code) => return self.decline(id, a.version, code),
        };
        let version = agreement.version;
        // our GID for the version the server chose (one we offered)
        let Some(local) = self.conn(id).and_then(|c| c.gids.for_version(version)) else {
            return self.decline(id, version, DeclineCode::ModeUnsupp);
        };
        let peer = PeerPort {
            gid: a.gid,
            mac: a.mac,
            qpn: a.qpn,
            psn: a.psn,
            mtu: a.qp_mtu,
        };
        if a.first_contact {
            let limits = Limits {
                release: agreement.release,
                max_conns: agreement.max_conns,
                max_links: agreement.max_links,
            };
            let l = match self.new_lgr(Role::Client, version, a.peer_id, a.gid, local, limits) {
                Ok(l) => l,
                Err(_) => return self.decline(id, version, DeclineCode::Mem),
            };
            self.keep_first_contact(l, a.fce.as_ref(), agreement.eid);
            if self.attach(id, l, 0).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
            }
            if let Err(code) = self.connect_first_link(l, peer, now) {
                return self.decline(id, version, code);
            }
            match self.our_accept_confirm(
                id,
                version,
                true,
                agreement.eid,
                AcceptConfirmKind::Confirm,
            ) {
                Some(m) => self.send_clc(id, &ClcMessage::Confirm(m)),
                None => return self.decline(id, version, DeclineCode::IntErr),
            }
            if let Some(c) = self.conn(id) {
                c.phase = Phase::AwaitLink {
                    version,
                    since: now,
                };
            }
        } else {
            // Reuse: the group the server chose must be one of ours, and the
            // connection goes on the link whose peer QP the Accept names (§4.5, §6).
            let group = |lg: &super::lgr::Lgr<P>| {
                lg.role == Role::Client
                    && lg.state.accepts_connections()
                    && !lg.group.is_terminated()
                    && lg.peer_system_id == a.peer_id
                    && lg.local == local
            };
            let found = self.lgrs.iter().find_map(|(i, lg)| {
                let lg = Some(lg).filter(|lg| group(lg))?;
                let slot = lg.group.active_slots().find(|&s| {
                    lg.links
                        .get(s)
                        .and_then(Option::as_ref)
                        .is_some_and(|r| r.connected && r.peer_qpn == a.qpn && r.peer_gid == a.gid)
                })?;
                Some((i, slot))
            });
            let Some((l, slot)) = found else {
                // A group with the peer but not the link the Accept names: it
                // went down since the server chose it (its DELETE_LINK may
                // have overtaken the Accept). Linux's client declines this
                // connection with NOSRVLINK, which — unlike SYNCERR, "no such
                // group" — does not make the server end the group
                // (af_smc.c `smc_connect_rdma`).
                let code = if self.lgrs.values().any(group) {
                    DeclineCode::NoSrvLink
                } else {
                    DeclineCode::SyncErr
                };
                return self.decline(id, version, code);
            };
            if self.attach(id, l, slot).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
            }
            // the server waits for our Confirm: a Decline now is clean
            if let Err(code) = self.prepare_peer_rmb(id, slot) {
                return self.decline(id, version, code);
            }
            let Some(confirm) = self.our_accept_confirm(
                id,
                version,
                false,
                agreement.eid,
                AcceptConfirmKind::Confirm,
            ) else {
                return self.decline(id, version, DeclineCode::IntErr);
            };
            // Announce our RMB with CONFIRM_RKEY before the Confirm (§1.11).
            if let Some(c) = self.conn(id) {
                c.phase = Phase::ClientRkey {
                    confirm: Box::new(confirm),
                };
            }
            if !self.start_rkey_flow(id, l, now) {
                self.decline(id, version, DeclineCode::ErrRegBuf);
            }
        }
    }
}
