//! The server side of the CLC handshake: [`Endpoint::accept`] waits for the
//! Proposal; the server picks the version, reuses a link group of the same
//! peer or creates one (waiting for a first contact with that peer that is
//! still running), sends the Accept and takes the client's Confirm.
//!
//! Spec: `protocol-clc.md` §4.3 (server flow), §4.4 (version negotiation),
//! §4.5 (first contact), `protocol-llc-cdc.md` §6 (reuse rules, at most
//! `max_conns` per group). Linux: af_smc.c `smc_listen_work` (and
//! `smc_server_lgr_pending`, held for a whole first contact).

use super::conn::Phase;
use super::lgr::{Lgr, Limits};
use super::{ConnId, Endpoint};
use smc_proto::link::{PeerPort, Role};
use smc_proto::negotiate::{self, ServerChoice};
use smc_proto::Timestamp;
use smc_rdma::Provider;
use smc_wire::clc::{
    AcceptConfirm, AcceptConfirmKind, ClcMessage, DeclineCode, Proposal, CLC_WAIT_TIME, SMC_V2,
};
use std::collections::VecDeque;
use std::net::IpAddr;

impl<P: Provider> Endpoint<P> {
    /// Server: a TCP connection whose SYN carried the SMC option was accepted
    /// at the local address `local_ip` (which chooses the GIDs, as for
    /// [`Self::connect`]); waits for the Proposal.
    pub fn accept(&mut self, local_ip: IpAddr, now: Timestamp) -> ConnId {
        self.now = self.now.max(now);
        let gids = self.conn_gids(local_ip);
        self.new_conn(
            Role::Server,
            Phase::AwaitProposal {
                deadline: now + CLC_WAIT_TIME,
            },
            gids,
        )
    }

    /// `park_until`: how long the Proposal may wait for a first contact with the
    /// same peer that is still running (`None`: no waiting).
    pub(super) fn server_on_proposal(
        &mut self,
        id: ConnId,
        p: Proposal,
        now: Timestamp,
        park_until: Option<Timestamp>,
    ) {
        let dversion = negotiate::decline_version(&p);
        let gids = self.conn(id).map(|c| c.gids).unwrap_or_default();
        let choice: ServerChoice = match negotiate::server_choose(&p, &self.caps(&gids)) {
            Ok(c) => c,
            Err(code) => return self.decline(id, dversion, code),
        };
        let version = choice.version;
        let Some(local) = gids.for_version(version) else {
            return self.decline(id, dversion, DeclineCode::IntErr);
        };
        // The group is the peer's by the Proposal's system id and GID, as
        // Linux keeps them (`smc_lgr_create` takes `ini->peer_systemid`,
        // `smc_link_save_peer_info` the Proposal's GID): a v2-only Proposal
        // carries an all-zero system id, every time (captures §8.4).
        let (peer_id, peer_gid) = match &p.v2_ext {
            Some(ext) if version >= SMC_V2 => (p.peer_id, ext.roce_v2_gid),
            _ => (p.peer_id, p.gid),
        };
        let max_conns = self.cfg.max_conns.min(choice.max_conns);
        let max = usize::from(max_conns);
        let same_peer = |lg: &Lgr<P>| {
            lg.role == Role::Server
                && !lg.group.is_terminated()
                && lg.version == version
                && lg.peer_system_id == peer_id
                && lg.peer_gid == peer_gid
                && lg.local == local
        };
        // §6: a group with an active link to the peer's GID and room for one more.
        let reuse = self.lgrs.iter().find_map(|(l, lg)| {
            let fits = same_peer(lg)
                && lg.state.accepts_connections()
                && lg.tokens.len() < max
                && lg.group.active_slots().any(|s| {
                    lg.links
                        .get(s)
                        .and_then(Option::as_ref)
                        .is_some_and(|r| r.connected && r.peer_gid == peer_gid)
                });
            fits.then_some(l)
        });
        // A first contact with this peer is under way: wait for it (Linux holds
        // `smc_server_lgr_pending` for a whole first contact, so the next
        // connection finds the new group and joins it).
        let pending = self
            .lgrs
            .values()
            .any(|lg| same_peer(lg) && lg.state.first_contact_pending());
        if let (None, true, Some(deadline)) = (reuse, pending, park_until) {
            if now < deadline {
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::AwaitLgr {
                        proposal: Box::new(p),
                        deadline,
                    };
                }
                self.parked.push(id);
                return;
            }
        }
        match reuse {
            Some(l) => {
                let Some(slot) = self.pick_link(l, None, None) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                if self.attach(id, l, slot).is_err() {
                    return self.decline(id, dversion, DeclineCode::Mem);
                }
                let Some(accept) = self.our_accept_confirm(
                    id,
                    version,
                    false,
                    choice.eid,
                    AcceptConfirmKind::Accept,
                ) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::ServerRkey {
                        accept: Box::new(accept),
                        version,
                        early: VecDeque::new(),
                    };
                }
                if !self.start_rkey_flow(id, l, now) {
                    self.decline(id, dversion, DeclineCode::ErrRegBuf);
                }
            }
            None => {
                // One link per group: we cannot add a second (ADD_LINK is not
                // negotiated), so we offer max_links 1, as a Linux server
                // with `smcr_max_links_per_lgr` 1 does; a Linux client then
                // waits for no ADD_LINK after CONFIRM_LINK (af_smc.c
                // `smcr_clnt_conf_first_link` waits SMC_LLC_WAIT_TIME for
                // one when max_links > 1), and a Linux server with max_links
                // 1 sends none either (smc_llc.c `smc_llc_srv_add_link`).
                // (with redundancy on, the negotiated two: the ADD_LINK
                // flow follows the first link, `endpoint/add_link.rs`)
                let limits = Limits {
                    release: choice.release,
                    max_conns,
                    max_links: if self.redundancy.enabled {
                        choice.max_links
                    } else {
                        1
                    },
                };
                let l = match self.new_lgr(Role::Server, version, peer_id, peer_gid, local, limits)
                {
                    Ok(l) => l,
                    Err(_) => return self.decline(id, dversion, DeclineCode::Mem),
                };
                self.keep_first_contact(l, None, choice.eid);
                if self.attach(id, l, 0).is_err() {
                    return self.decline(id, dversion, DeclineCode::Mem);
                }
                let Some(accept) = self.our_accept_confirm(
                    id,
                    version,
                    true,
                    choice.eid,
                    AcceptConfirmKind::Accept,
                ) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                self.send_clc(id, &ClcMessage::Accept(accept));
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::AwaitConfirm {
                        version,
                        first_contact: true,
                        deadline: now + CLC_WAIT_TIME,
                        early: VecDeque::new(),
                    };
                }
            }
        }
    }

    pub(super) fn server_on_confirm(
        &mut self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        c: AcceptConfirm,
        now: Timestamp,
    ) {
        if let Err(code) = negotiate::check_peer_values(&c) {
            return self.decline(id, version, code);
        }
        if first_contact {
            // what our Accept said (rebuilt from the group) against the Confirm
            let ours = self.our_accept_confirm(id, version, true, None, AcceptConfirmKind::Accept);
            if let Some(Err(code)) = ours.map(|a| negotiate::server_check_confirm(&a, &c)) {
                return self.decline(id, version, code);
            }
        }
        let lgr_alive = self
            .conn(id)
            .and_then(|x| x.lgr)
            .is_some_and(|l| self.lgrs.get(l).is_some_and(|lg| !lg.group.is_terminated()));
        if first_contact && !lgr_alive {
            // the group died while the Confirm was on its way: no link to ready
            return self.decline(id, version, DeclineCode::ErrRdyLnk);
        }
        if !self.setup_datapath(id, &c) {
            return self.decline(id, version, DeclineCode::ErrRtok);
        }
        if first_contact {
            let Some(l) = self.conn(id).and_then(|x| x.lgr) else {
                return self.decline(id, version, DeclineCode::IntErr);
            };
            // (the group keeps the Proposal's system id: see `server_on_proposal`)
            let peer = PeerPort {
                gid: c.gid,
                mac: c.mac,
                qpn: c.qpn,
                psn: c.psn,
                mtu: c.qp_mtu,
            };
            // the client's first-contact extension: its host name, OS
            self.keep_first_contact(l, c.fce.as_ref(), None);
            // (the client waits for CONFIRM_LINK or our Decline)
            if let Err(code) = self.connect_first_link(l, peer, now) {
                return self.decline(id, version, code);
            }
            if let Some(x) = self.conn(id) {
                x.phase = Phase::AwaitLink {
                    version,
                    since: now,
                };
            }
        } else {
            // A reused group's client counts itself established once its
            // Confirm went out: a Decline now would leave it an SMC connection
            // whose peer is gone. A peer RMB we cannot ready costs this
            // connection its life instead: established, and aborted at once
            // (the abort CDC needs no rkey), so the client sees a reset.
            // (a group that died meanwhile kills the connection anyway)
            // A link whose QP failed meanwhile (its failure not yet taken in)
            // cannot be readied either, but that is the link's fault, not the
            // connection's: it goes down now and the connection fails over
            // to a link that can reach the peer's RMB (§7.2), or dies with the
            // group if none is left. Nor can one whose peer's QP failed,
            // which this end learns of only from the peer's DELETE_LINK or
            // its own next send: the connection then sends on another link
            // of the group that reaches the peer's RMB, as each end picks
            // the link it sends on (§7.2: after a failover the two ends may
            // use different links), and is aborted only if none does.
            let slot = self.core(id).and_then(|k| k.link);
            let l = self.conn(id).and_then(|x| x.lgr);
            let link_failed = slot.zip(l).filter(|&(s, l)| {
                self.lgrs
                    .get(l)
                    .and_then(|lg| lg.links.get(s)?.as_ref())
                    .is_some_and(super::link::LinkRes::failed)
            });
            let prepared = !lgr_alive
                || link_failed.is_some()
                || slot.is_some_and(|s| self.prepare_peer_rmb(id, s).is_ok());
            self.established(id);
            if let Some((s, l)) = link_failed {
                // (the next pump carries out the failover)
                if let Some(lg) = self.lgrs.get_mut(l) {
                    lg.group.on_link_failure(s);
                }
            } else if !prepared && !slot.is_some_and(|s| self.send_elsewhere(id, s)) {
                self.abort_now(id);
            }
        }
    }

    /// Points connection `id`, just established, whose peer RMB could not
    /// be readied on its link `from`, at another link of its group that
    /// has the peer's rkey for that RMB and can ready it. Nothing went out
    /// on `from` for it yet, so there is nothing to send again (as for a
    /// handshake that a failover re-points). False if no link can.
    fn send_elsewhere(&mut self, id: ConnId, from: usize) -> bool {
        let Some(l) = self.conn(id).and_then(|c| c.lgr) else {
            return false;
        };
        let row = self.core(id).and_then(|k| k.peer_rmb.map(|p| p.row));
        let Some(to) = row.and_then(|r| self.pick_link(l, Some(r), Some(from))) else {
            return false;
        };
        if self.prepare_peer_rmb(id, to).is_err() {
            return false;
        }
        if let Some(mut k) = self.core(id) {
            k.set_link(Some(to));
        }
        self.event_moved(l, id, from, to);
        true
    }

    /// A Proposal waiting for a first contact with the same peer
    /// ([`HandshakePhase::AwaitLgr`](crate::state::HandshakePhase::AwaitLgr)) is decided again: it joins the group once
    /// that is usable, waits on while the first contact runs, and makes its own
    /// first contact when that failed or the wait is over.
    pub(super) fn retry_parked(&mut self, id: ConnId, now: Timestamp) {
        let Some(Phase::AwaitLgr { proposal, deadline }) = self.conn(id).map(|c| c.phase.clone())
        else {
            return;
        };
        self.server_on_proposal(id, *proposal, now, Some(deadline));
    }
}
