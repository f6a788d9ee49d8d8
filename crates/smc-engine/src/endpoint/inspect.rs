//! Read-only views of connections and link groups, for tests, the
//! simulation, tools and diagnostics: roles, tokens, links, link-group
//! states and buffers, a debug dump.

use super::conn_core::lock;
use super::{ConnId, Endpoint, LgrId};
use crate::state::{ConnDiag, HandshakePhase, LgrDiag, LgrState, LinkDiag, MsgCounts};
use smc_proto::datapath::{DataPath, Violation};
use smc_proto::link::Role;
use smc_rdma::{Provider, QueuePair};

impl<P: Provider> Endpoint<P> {
    /// Which side of the handshake a connection is.
    pub fn role(&self, id: ConnId) -> Option<Role> {
        self.conns.get(id).map(|c| c.role)
    }

    /// A connection's alert token (unique among the live connections of its
    /// link group; with the id it tells a connection from a later one that
    /// reuses the id).
    pub fn alert_token(&self, id: ConnId) -> Option<u32> {
        self.conns.get(id).map(|c| c.token)
    }

    /// Unsent or unconfirmed bytes of ours on a connection: its send buffer's
    /// data not written to the peer yet, or written and their CDC not
    /// completed, as far as the endpoint has taken its send completions
    /// ([`Self::send_queue`] takes them). Linux's `SIOCOUTQ` of an SMC
    /// socket (af_smc.c `smc_ioctl`: the send buffer's length less its free
    /// space, which a completed CDC gives back).
    pub fn unacked(&self, id: ConnId) -> usize {
        self.core(id)
            .and_then(|k| k.dp.as_ref().map(DataPath::unacked))
            .unwrap_or(0)
    }

    /// Bytes of ours on a connection not written to the peer's RMB yet (0
    /// once it is gone): what its close still waits for. Linux's
    /// `SIOCOUTQNSD` of an SMC socket (af_smc.c `smc_ioctl`,
    /// `smc_tx_prepared_sends`).
    pub fn unsent(&self, id: ConnId) -> usize {
        self.core(id).and_then(|k| k.unsent()).unwrap_or(0)
    }

    /// Live link groups.
    pub fn link_groups(&self) -> usize {
        self.lgrs.len()
    }

    /// The handles of the live link groups.
    pub fn link_group_ids(&self) -> impl Iterator<Item = LgrId> + '_ {
        self.lgrs.ids()
    }

    /// Connections of the link group a connection uses.
    pub fn link_group_of(&self, id: ConnId) -> Option<LgrId> {
        self.conns.get(id)?.lgr
    }

    /// Connections still allocated (not yet reaped).
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// LLC messages posted so far (requests and responses, every group).
    pub fn llc_sent(&self) -> u64 {
        self.llc_sent
    }

    /// Peer RMBs a link group knows (its rtoken table) and our released buffers
    /// it keeps for reuse.
    pub fn link_group_buffers(&self, l: LgrId) -> Option<(usize, usize)> {
        self.lgrs
            .get(l)
            .map(|lg| (lg.group.rtoken_count(), lg.free_bufs.len()))
    }

    /// QP number of a link group's first link (lowest slot; for fault injection
    /// in tests).
    pub fn qp_num(&self, l: LgrId) -> Option<u32> {
        let lg = self.lgrs.get(l)?;
        lg.links.iter().flatten().map(|r| r.qp.qp_num()).next()
    }

    /// QP number of the link in `slot` of a link group.
    pub fn link_qp_num(&self, l: LgrId, slot: usize) -> Option<u32> {
        let lg = self.lgrs.get(l)?;
        lg.links.get(slot)?.as_ref().map(|r| r.qp.qp_num())
    }

    /// State of the QP of the link in `slot` of a link group.
    pub fn link_qp_state(&self, l: LgrId, slot: usize) -> Option<smc_rdma::QpState> {
        let lg = self.lgrs.get(l)?;
        lg.links.get(slot)?.as_ref().map(|r| r.qp.state())
    }

    /// Slots of a link group's usable (active) links.
    pub fn usable_links(&self, l: LgrId) -> Vec<usize> {
        self.lgrs
            .get(l)
            .map(|lg| lg.group.active_slots().collect())
            .unwrap_or_default()
    }

    /// A link group's life-cycle state.
    pub fn link_group_state(&self, l: LgrId) -> Option<LgrState> {
        Some(self.lgrs.get(l)?.state)
    }

    /// The link (slot) a connection is assigned to.
    pub fn link_of(&self, id: ConnId) -> Option<usize> {
        self.core(id)?.link
    }

    /// Where a connection's handshake stands.
    pub fn handshake_phase(&self, id: ConnId) -> Option<HandshakePhase> {
        Some(self.conns.get(id)?.phase.kind())
    }

    /// Debug dump of a connection's data path and close state.
    pub fn debug_conn(&self, id: ConnId) -> String {
        match self.conns.get(id) {
            Some(c) => {
                let k = lock(&c.core);
                let lg = c.lgr.and_then(|l| self.lgrs.get(l));
                let rtoken = k.peer_rmb.and_then(|p| lg?.group.rtoken(p.row).copied());
                let sends: Vec<usize> = lg
                    .map(|lg| {
                        lg.links
                            .iter()
                            .flatten()
                            .map(|r| r.sends_in_flight())
                            .collect()
                    })
                    .unwrap_or_default();
                format!(
                    "token {} lgr {:?} link {:?} move_to {:?} validation {} peer rtoken {:?} \
                     usable {:?} sends in flight {:?} {:?} {:?} {:?}",
                    c.token,
                    c.lgr,
                    k.link,
                    k.move_to,
                    k.validation.is_some(),
                    rtoken,
                    lg.map(|lg| lg.group.active_slots().collect::<Vec<_>>()),
                    sends,
                    c.phase,
                    k.closer,
                    k.dp
                )
            }
            None => "gone".into(),
        }
    }

    /// The violation that killed a connection, if any.
    pub fn violation(&self, id: ConnId) -> Option<Violation> {
        self.core(id)?.violation
    }

    /// What `smcss -d`/`-R` show of a connection: token, buffer sizes,
    /// cursors and flags of its last CDCs, its link group and link.
    pub fn conn_diag(&self, id: ConnId) -> Option<ConnDiag> {
        let c = self.conns.get(id)?;
        let k = lock(&c.core);
        let cfg = k.dp.as_ref().map(|dp| *dp.config());
        Some(ConnDiag {
            token: c.token,
            sndbuf_len: cfg.map_or(0, |x| x.sndbuf_len),
            rmbe_len: cfg.map_or(0, |x| x.rmbe_len),
            peer_rmbe_len: cfg.map_or(0, |x| x.peer_rmbe_len),
            cursors: k.dp.as_ref().map(DataPath::diag),
            lgr: c.lgr,
            link: k.link,
        })
    }

    /// What `smcr -d linkgroup` and `link-show -dd` show of a link group.
    pub fn lgr_diag(&self, l: LgrId) -> Option<LgrDiag> {
        let lg = self.lgrs.get(l)?;
        let links = (0..lg.links.len())
            .filter_map(|slot| {
                let k = lg.group.link(slot)?;
                Some(LinkDiag {
                    slot,
                    link_id: k.link_id,
                    state: k.state,
                    gid: k.local.gid,
                    qpn: k.local.qpn,
                    peer_gid: k.peer.gid,
                    peer_qpn: k.peer.qpn,
                    peer_link_uid: k.peer_link_uid,
                })
            })
            .collect();
        Some(LgrDiag {
            state: lg.state,
            role: lg.role,
            id: lg.group.config().id,
            version: lg.version,
            release: lg.release,
            peer_system_id: lg.peer_system_id,
            gid: lg.local.gid,
            links,
            peer_v2: lg.peer_v2.clone(),
            eid: lg.eid,
        })
    }

    /// Received CDCs that a reader applied without the device lock
    /// (`FastConn::try_read`), so far, as far as the endpoint's pumps have
    /// taken them (counted in [`Self::msg_counts`] too).
    pub fn cdc_dispatched(&self) -> u64 {
        self.cdc_dispatched
    }

    /// CDC and LLC messages this endpoint sent and received so far.
    pub fn msg_counts(&self) -> MsgCounts {
        // (the links' own counts that no poll of the endpoint has taken
        // yet: the fast path's sent CDCs until a send completion, and the
        // CDCs a reader's own dispatch applied until the endpoint polls the
        // link, which with the driver asleep can be seconds away)
        let (mut sent, mut received) = (0, 0);
        for r in self.lgrs.values().flat_map(|lg| lg.links.iter().flatten()) {
            sent += r.tx.fast_cdcs.get();
            received += r.rx.cdcs.get();
        }
        MsgCounts {
            cdc_sent: self.cdc_sent + sent,
            cdc_received: self.cdc_received + received,
            llc_sent: self.llc_sent,
            llc_received: self.llc_received,
        }
    }
}
