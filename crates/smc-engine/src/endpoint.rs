//! An SMC-R endpoint: CLC handshakes, link groups shared by many connections,
//! the data path and close of every connection, over one RDMA device.
//!
//! Spec: `protocol-clc.md` §4 (client and server flows, first contact vs reuse,
//! version negotiation, timeouts), `protocol-llc-cdc.md` §1.7 (first-contact link),
//! §1.11 (CONFIRM_RKEY before the Accept / Confirm of a reused group), §6 (link
//! group reuse rules, at most `max_conns` connections per group), §9 (which link
//! carries what). The protocol decisions are smc-proto's ([`negotiate`],
//! [`LinkGroup`], [`DataPath`], [`Closer`]); this module owns the provider objects
//! and wires them together.
//!
//! The TCP connection that carries CLC is the caller's: it feeds received bytes to
//! [`Endpoint::clc_input`] and sends what [`Endpoint::clc_output`] returns. Time is
//! passed in; nothing here blocks or spawns threads.
//!
//! Limits of this version (later issues): one device and one link per group (an
//! ADD_LINK is rejected), RMBs are freed with their connection rather than pooled,
//! urgent data is not supported.
//!
//! [`negotiate`]: smc_proto::negotiate

use smc_proto::clc_stream::{self, ClcReader, FailReason, HandshakeEnd};
use smc_proto::close::{CloseEvent, CloseFlags, CloseState, Closer};
use smc_proto::datapath::{DataPath, DataPathConfig, Violation};
use smc_proto::link::{LgrConfig, LgrOutput, LinkGroup, LocalPort, PeerPort, Role};
use smc_proto::negotiate::{
    self, ClientAgreement, IfAddr, LocalCapabilities, RoceV1Port, ServerChoice,
};
use smc_proto::Timestamp;
use smc_rdma::{
    Access, CompletionChannel, CompletionQueue, Device, MemoryRegion, Payload, ProtectionDomain,
    Provider, QpCap, QpModify, QpState, QueuePair, RecvWr, RemoteMr, RemoteQp, SendOp, SendWr,
    WcStatus, WorkCompletion,
};
use smc_wire::clc::{
    AcceptConfirm, AcceptConfirmKind, ClcMessage, ClcType, Decline, DeclineCode, FceV2x,
    FirstContactExt, Proposal, CLC_WAIT_TIME, OS_LINUX, SMC_V1, SMC_V2,
};
use smc_wire::llc::LlcVersion;
use smc_wire::types::{Eid, Gid, Mac, RmbeSize, SystemId};
use smc_wire::WrMessage;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

/// Receive buffers posted per link (Linux: 3 × 16 = 48).
const RECV_SLOTS: usize = 48;
/// Bytes per receive buffer (SMC-Rv2 LLC messages are up to 8 KiB).
const RECV_SLOT_LEN: usize = 8192;
/// SENDs in flight per link (Linux `SMC_WR_BUF_CNT`).
const MAX_SENDS: usize = 16;
/// How long after the TCP connection ended a close CDC may still arrive before
/// the peer is taken for dead.
pub const PEER_GONE_GRACE: Duration = Duration::from_secs(1);
/// Longest wait for the send buffer to drain before a close (Linux
/// `SMC_MAX_STREAM_WAIT_TIMEOUT`).
const MAX_STREAM_WAIT: Duration = Duration::from_secs(2);

/// Handle of a connection.
pub type ConnId = usize;
/// Handle of a link group.
pub type LgrId = usize;

/// What an endpoint is and offers.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// This SMC instance's system id (random instance + a RoCE MAC).
    pub system_id: SystemId,
    /// The provider device to use.
    pub device: String,
    /// UEIDs (SMC-R v2 needs one shared with the peer).
    pub ueids: Vec<Eid>,
    /// Offer / accept SMC-R v1.
    pub offer_v1: bool,
    /// Offer / accept SMC-R v2.
    pub offer_v2: bool,
    /// Addresses of the interface the connections use (prefix rules).
    pub if_addrs: Vec<IfAddr>,
    /// RMB (receive buffer) per connection, rounded up to a size class.
    pub rmb_len: usize,
    /// Send buffer per connection.
    pub sndbuf_len: usize,
    /// TEST_LINK interval (Linux default 30 s; `None` disables).
    pub testlink: Option<Duration>,
    /// Connections per link group this side allows (server side, ≤ 255).
    pub max_conns: u8,
    /// Host name sent in the first-contact extension (v2).
    pub hostname: String,
    /// A link group without connections is ended after this long (Linux: 600 s
    /// on a server, 610 s on a client so the client's never expires first).
    pub lgr_idle_timeout: Duration,
}

/// Where a connection stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnStatus {
    /// The CLC handshake or the link confirmation is running.
    Handshaking,
    /// SMC-R: data moves over RDMA.
    Smc,
    /// Plain TCP on the same connection (the caller switches its socket over).
    Fallback {
        /// Our reason (as `smcss` shows).
        reason: DeclineCode,
        /// The peer's Decline code, if the peer declined.
        peer: Option<DeclineCode>,
    },
    /// The connection failed (no fallback): timeout, TCP error or protocol error.
    Failed(FailReason),
}

/// Errors the application sees on an SMC connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnError {
    /// No such connection (or not in SMC mode).
    NotConnected,
    /// The write side is shut down or the connection closed (`EPIPE`).
    Closed,
    /// Aborted by the peer (`ECONNRESET`).
    Reset,
    /// Killed locally: link group lost or peer misbehaved (`ECONNABORTED`).
    Aborted,
}

#[derive(Clone, Debug)]
enum Phase {
    // client
    AwaitAccept {
        proposal: Box<Proposal>,
        deadline: Timestamp,
    },
    ClientRkey {
        confirm: Box<AcceptConfirm>,
    },
    // server
    AwaitProposal {
        deadline: Timestamp,
    },
    ServerRkey {
        accept: Box<AcceptConfirm>,
        version: u8,
    },
    AwaitConfirm {
        version: u8,
        first_contact: bool,
        deadline: Timestamp,
    },
    // both
    AwaitLink,
    Smc,
    Done(ConnStatus),
}

/// An rkey flow waiting for the link group's LLC flow slot (§1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RkeyFlow {
    /// CONFIRM_RKEY for the RMB of this connection (its handshake waits).
    Confirm(ConnId),
    /// DELETE_RKEY for a released RMB.
    Delete(u32),
}

/// Flow tags: confirm flows carry the connection id, delete flows this bit.
const DELETE_TAG: u64 = 1 << 63;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WrKind {
    Llc,
    Cdc(ConnId, u16),
}

struct Lgr<P: Provider> {
    pd: P::Pd,
    scq: P::Cq,
    rcq: P::Cq,
    qp: P::Qp,
    recv: P::Mr,
    psn: u32,
    group: LinkGroup,
    role: Role,
    version: u8,
    peer_system_id: SystemId,
    peer_gid: Gid,
    peer_qpn: u32,
    connected: bool,
    tokens: BTreeMap<u32, ConnId>,
    wrs: HashMap<u64, WrKind>,
    sends_in_flight: usize,
    next_wr: u64,
    rkey_queue: VecDeque<RkeyFlow>,
    /// Released RMBs and send buffers kept registered for reuse (Linux keeps
    /// them in per-size pools, §4.4): a late RDMA WRITE from the peer lands in
    /// memory we still own, and the next connection skips registration.
    free_bufs: Vec<(P::Mr, P::Mr)>,
    idle_since: Option<Timestamp>,
    rr: usize,
}

struct Conn<P: Provider> {
    role: Role,
    phase: Phase,
    lgr: Option<LgrId>,
    token: u32,
    reader: ClcReader,
    out: VecDeque<u8>,
    rmb: Option<P::Mr>,
    sndbuf: Option<P::Mr>,
    dp: Option<DataPath>,
    closer: Closer,
    peer_rmb: Option<RemoteMr>,
    violation: Option<Violation>,
    /// When a close waiting for the send buffer to drain is sent anyway.
    close_deadline: Option<Timestamp>,
    /// The TCP connection ended; without a close CDC by then the peer is dead.
    tcp_gone_deadline: Option<Timestamp>,
    /// The peer's latest urgent (out-of-band) byte, until the application reads it.
    oob: Option<u8>,
    /// CDCs that arrived before the data path exists. A client that reuses a
    /// link group may write as soon as it has sent its CLC Confirm, and its
    /// RDMA SEND can overtake that Confirm on TCP; Linux processes such a CDC
    /// as soon as the token is known (smc_cdc_rx_handler), so we keep it and
    /// apply it once the Confirm is in. Cursors are cumulative, so when more
    /// than [`EARLY_CDC_MAX`] pile up the oldest can be dropped.
    early_cdcs: VecDeque<smc_wire::cdc::CdcMessage>,
}

/// CDCs kept per connection while its CLC Confirm is still on the way.
const EARLY_CDC_MAX: usize = 64;

/// An SMC-R endpoint on one device.
pub struct Endpoint<P: Provider> {
    cfg: EndpointConfig,
    dev: P::Device,
    /// One completion channel for every CQ of this endpoint: a single
    /// descriptor to sleep on (see [`Endpoint::arm`]).
    chan: P::Channel,
    /// Work completions taken from the CQs so far (progress indicator).
    completions: u64,
    /// Largest inline payload of the device: writes up to this size go from the
    /// application's buffer straight to the peer (see [`Endpoint::write`]).
    max_inline: u32,
    lgrs: Vec<Option<Lgr<P>>>,
    conns: Vec<Option<Conn<P>>>,
    next_token: u32,
    next_lgr_id: u32,
    gid: Gid,
    mac: Mac,
    /// Time of the latest input (for deadlines set from engine outputs).
    now: Timestamp,
}

/// Provider errors.
pub type Result<T> = smc_rdma::Result<T>;

impl<P: Provider> Endpoint<P> {
    /// Opens the configured device.
    pub fn new(provider: &P, cfg: EndpointConfig) -> Result<Endpoint<P>> {
        let dev = provider.open_device(&cfg.device)?;
        let port = dev.query_port(1)?;
        let gid = port.gids.first().map(|g| g.gid).unwrap_or_default();
        let mac = cfg.system_id.mac();
        let chan = dev.create_channel()?;
        let max_inline = dev.info().max_inline;
        Ok(Endpoint {
            cfg,
            dev,
            chan,
            completions: 0,
            max_inline,
            lgrs: Vec::new(),
            conns: Vec::new(),
            next_token: 1,
            next_lgr_id: 0x100,
            gid,
            mac,
            now: Duration::ZERO,
        })
    }

    fn caps(&self) -> LocalCapabilities {
        LocalCapabilities {
            system_id: self.cfg.system_id,
            v1: self.cfg.offer_v1.then_some(RoceV1Port {
                gid: self.gid,
                mac: self.mac,
            }),
            v2_gid: self.cfg.offer_v2.then_some(self.gid),
            ueids: self.cfg.ueids.clone(),
            if_addrs: self.cfg.if_addrs.clone(),
        }
    }

    fn new_conn(&mut self, role: Role, phase: Phase) -> ConnId {
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        let c = Conn {
            role,
            phase,
            lgr: None,
            token,
            reader: ClcReader::new(),
            out: VecDeque::new(),
            rmb: None,
            sndbuf: None,
            dp: None,
            closer: Closer::new(),
            peer_rmb: None,
            violation: None,
            close_deadline: None,
            tcp_gone_deadline: None,
            oob: None,
            early_cdcs: VecDeque::new(),
        };
        match self.conns.iter().position(Option::is_none) {
            Some(i) => {
                self.conns[i] = Some(c);
                i
            }
            None => {
                self.conns.push(Some(c));
                self.conns.len() - 1
            }
        }
    }

    fn conn(&mut self, id: ConnId) -> Option<&mut Conn<P>> {
        self.conns.get_mut(id).and_then(Option::as_mut)
    }

    /// Client: the TCP connection to the peer is up and the peer offered SMC on its
    /// SYN-ACK. Queues the Proposal (or a Decline when we have nothing to offer).
    pub fn connect(&mut self, local_ip: IpAddr, now: Timestamp) -> ConnId {
        match negotiate::build_proposal(local_ip, &self.caps()) {
            Ok(p) => {
                let id = self.new_conn(
                    Role::Client,
                    Phase::AwaitAccept {
                        proposal: Box::new(p.clone()),
                        deadline: now + CLC_WAIT_TIME,
                    },
                );
                self.send_clc(id, &ClcMessage::Proposal(p));
                id
            }
            Err(code) => {
                let id = self.new_conn(Role::Client, Phase::AwaitProposal { deadline: now });
                self.decline(id, SMC_V1, code);
                id
            }
        }
    }

    /// Server: a TCP connection whose SYN carried the SMC option was accepted;
    /// waits for the Proposal.
    pub fn accept(&mut self, now: Timestamp) -> ConnId {
        self.new_conn(
            Role::Server,
            Phase::AwaitProposal {
                deadline: now + CLC_WAIT_TIME,
            },
        )
    }

    /// How the connection stands.
    pub fn status(&self, id: ConnId) -> Option<ConnStatus> {
        let c = self.conns.get(id)?.as_ref()?;
        Some(match &c.phase {
            Phase::Smc => ConnStatus::Smc,
            Phase::Done(s) => s.clone(),
            _ => ConnStatus::Handshaking,
        })
    }

    /// Bytes to send on the connection's TCP socket (CLC messages).
    pub fn clc_output(&mut self, id: ConnId) -> Vec<u8> {
        self.conn(id)
            .map(|c| c.out.drain(..).collect())
            .unwrap_or_default()
    }

    fn send_clc(&mut self, id: ConnId, m: &ClcMessage) {
        if let Some(c) = self.conn(id) {
            c.out.extend(m.encode());
        }
    }

    fn finish(&mut self, id: ConnId, status: ConnStatus) {
        // A handshake that dies before SMC was reached releases what it took.
        let lgr = self.conn(id).and_then(|c| c.lgr.take());
        if let Some(l) = lgr {
            self.detach(id, l);
        }
        if let Some(c) = self.conn(id) {
            c.rmb = None;
            c.sndbuf = None;
            c.dp = None;
            c.phase = Phase::Done(status);
        }
    }

    fn decline(&mut self, id: ConnId, version: u8, code: DeclineCode) {
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
        let mut used = 0;
        while used < data.len() {
            let Some(c) = self.conn(id) else { return used };
            let expected = match c.phase {
                Phase::AwaitAccept { .. } => ClcType::Accept,
                Phase::AwaitProposal { .. } => ClcType::Proposal,
                Phase::AwaitConfirm { .. } => ClcType::Confirm,
                // a late Decline may still come while the link is being confirmed
                Phase::AwaitLink | Phase::ClientRkey { .. } | Phase::ServerRkey { .. } => {
                    ClcType::Decline
                }
                Phase::Smc | Phase::Done(_) => return used,
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

    /// The TCP connection closed or failed during the handshake.
    ///
    /// On an SMC connection the TCP connection normally closes right after the
    /// peer's close CDC (the active closer shuts it down, §5.2). If no close or
    /// abort CDC has arrived within [`PEER_GONE_GRACE`] of the TCP end, the peer
    /// is taken for dead — a user-space peer whose process died cannot send a
    /// CDC, but its kernel closes the TCP socket — and the connection is reset.
    pub fn tcp_closed(&mut self, id: ConnId) {
        let deadline = self.now + PEER_GONE_GRACE;
        match self.status(id) {
            Some(ConnStatus::Handshaking) => {
                self.finish(id, ConnStatus::Failed(FailReason::TcpClosed))
            }
            Some(ConnStatus::Smc) => {
                if let Some(c) = self.conn(id) {
                    c.tcp_gone_deadline.get_or_insert(deadline);
                }
            }
            _ => {}
        }
    }

    fn on_clc(&mut self, id: ConnId, m: ClcMessage, now: Timestamp) {
        if let ClcMessage::Decline(d) = &m {
            if d.out_of_sync {
                if let Some(l) = self.conn(id).and_then(|c| c.lgr) {
                    if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
                        lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, false);
                    }
                }
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
                self.server_on_proposal(id, p, now)
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

    // ------------------------------------------------------------- resources

    fn new_lgr(&mut self, role: Role, version: u8, peer_system_id: SystemId) -> Result<LgrId> {
        let pd = self.dev.alloc_pd()?;
        let scq = self.dev.create_cq(1024, Some(&self.chan))?;
        let rcq = self.dev.create_cq(1024, Some(&self.chan))?;
        let qp = pd.create_qp(
            &scq,
            &rcq,
            QpCap {
                max_send_wr: 3 * MAX_SENDS as u32,
                max_recv_wr: RECV_SLOTS as u32,
                max_inline_data: self.max_inline,
            },
        )?;
        qp.modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        })?;
        let recv = pd.alloc_mr(RECV_SLOTS * RECV_SLOT_LEN, Access::LOCAL_WRITE)?;
        for i in 0..RECV_SLOTS {
            let sge = recv.sge(i * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
            qp.post_recv(&RecvWr {
                wr_id: i as u64,
                sges: &[sge],
            })?;
        }
        let psn = qp.qp_num().wrapping_mul(2_654_435_761) & 0x00ff_ffff;
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
            max_links: 1,
            max_conns: self.cfg.max_conns,
            testlink_interval: self.cfg.testlink,
        });
        let l = Lgr {
            pd,
            scq,
            rcq,
            qp,
            recv,
            psn,
            group,
            role,
            version,
            peer_system_id,
            peer_gid: Gid::ZERO,
            peer_qpn: 0,
            connected: false,
            tokens: BTreeMap::new(),
            wrs: HashMap::new(),
            sends_in_flight: 0,
            next_wr: 1 << 32,
            rkey_queue: VecDeque::new(),
            free_bufs: Vec::new(),
            idle_since: None,
            rr: 0,
        };
        Ok(match self.lgrs.iter().position(Option::is_none) {
            Some(i) => {
                self.lgrs[i] = Some(l);
                i
            }
            None => {
                self.lgrs.push(Some(l));
                self.lgrs.len() - 1
            }
        })
    }

    fn local_port(&self, l: &Lgr<P>) -> Result<LocalPort> {
        Ok(LocalPort {
            gid: self.gid,
            mac: self.mac,
            qpn: l.qp.qp_num(),
            psn: l.psn,
            mtu: self.dev.query_port(1)?.active_mtu,
        })
    }

    /// Attaches connection `id` to group `l`: RMB and send buffer from its PD.
    fn attach(&mut self, id: ConnId, l: LgrId) -> Result<()> {
        let rmb_len = RmbeSize::for_size(self.cfg.rmb_len, RmbeSize::MAX_CLASS).bytes();
        let sndbuf_len = self.cfg.sndbuf_len;
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such link group".into()))?;
        let pooled = lg
            .free_bufs
            .iter()
            .position(|(r, s)| r.len() == rmb_len && s.len() == sndbuf_len);
        let (rmb, sndbuf) = match pooled {
            Some(i) => {
                let (r, s) = lg.free_bufs.swap_remove(i);
                // a reused RMB starts clean (Linux zeroes buffers on release)
                r.write_at(0, &vec![0u8; r.len()])?;
                (r, s)
            }
            None => (
                lg.pd
                    .alloc_mr(rmb_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
                lg.pd.alloc_mr(sndbuf_len, Access::LOCAL_WRITE)?,
            ),
        };
        let c = self
            .conns
            .get_mut(id)
            .and_then(Option::as_mut)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such connection".into()))?;
        lg.tokens.insert(c.token, id);
        c.lgr = Some(l);
        c.rmb = Some(rmb);
        c.sndbuf = Some(sndbuf);
        Ok(())
    }

    fn detach(&mut self, id: ConnId, l: LgrId) {
        let token = self.conns.get(id).and_then(Option::as_ref).map(|c| c.token);
        let empty = match self.lgrs.get_mut(l).and_then(Option::as_mut) {
            Some(lg) => {
                if let Some(t) = token {
                    lg.tokens.remove(&t);
                }
                lg.tokens.is_empty() && !lg.connected
            }
            None => false,
        };
        if empty {
            // a group that never came up has nothing left to wait for
            self.lgrs[l] = None;
        }
    }

    fn connect_qp(&mut self, l: LgrId, peer: PeerPort, now: Timestamp) -> Result<()> {
        let local = {
            let lg = self.lgrs.get(l).and_then(Option::as_ref);
            match lg {
                Some(lg) => self.local_port(lg)?,
                None => return Err(smc_rdma::Error::InvalidArgument("no link group".into())),
            }
        };
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no link group".into()))?;
        let mtu = smc_rdma::Mtu::from_code(peer.mtu).map_or(local.mtu, |m| m.min(local.mtu));
        lg.qp.modify(&QpModify::Rtr {
            remote: RemoteQp {
                gid: peer.gid,
                qp_num: peer.qpn,
            },
            sgid_index: 0,
            rq_psn: peer.psn,
            path_mtu: mtu,
            min_rnr_timer: Duration::from_micros(640),
        })?;
        // Linux: timeout 15 (~134 ms), retry 7, rnr_retry 7 (§4.3).
        lg.qp.modify(&QpModify::Rts {
            sq_psn: lg.psn,
            timeout: Duration::from_millis(134),
            retry_cnt: 7,
            rnr_retry: 7,
        })?;
        lg.peer_gid = peer.gid;
        lg.peer_qpn = peer.qpn;
        lg.connected = true;
        lg.group.add_first_link(local, peer, now);
        Ok(())
    }

    fn setup_datapath(&mut self, id: ConnId, peer: &AcceptConfirm) -> bool {
        let Some(l) = self.conn(id).and_then(|c| c.lgr) else {
            return false;
        };
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return false;
        };
        if lg
            .group
            .add_rtoken(0, peer.rmb_rkey, peer.rmb_vaddr)
            .is_err()
        {
            return false;
        }
        let sndbuf_len = self.cfg.sndbuf_len;
        let Some(c) = self.conn(id) else {
            return false;
        };
        let Some(rmb) = c.rmb.as_ref() else {
            return false;
        };
        let peer_len = peer.rmbe_size.bytes();
        // The peer writes at rmbe_size × (index − 1) of its RMB (§3.3).
        let off = peer_len as u64 * u64::from(peer.rmbe_idx.max(1) - 1);
        c.peer_rmb = Some(RemoteMr {
            addr: peer.rmb_vaddr + off,
            rkey: peer.rmb_rkey,
            len: peer_len as u64,
        });
        c.dp = Some(DataPath::new(DataPathConfig {
            sndbuf_len,
            rmbe_len: rmb.len(),
            peer_rmbe_len: peer_len,
            peer_token: peer.alert_token,
        }));
        // CDCs that overtook the CLC Confirm (see `Conn::early_cdcs`).
        let early = std::mem::take(&mut c.early_cdcs);
        for m in &early {
            self.on_cdc(id, m);
        }
        true
    }

    fn our_accept_confirm(
        &self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        eid: Option<Eid>,
        kind: AcceptConfirmKind,
    ) -> Option<AcceptConfirm> {
        let c = self.conns.get(id)?.as_ref()?;
        let lg = self.lgrs.get(c.lgr?)?.as_ref()?;
        let rmb = c.rmb.as_ref()?;
        let mtu = self.dev.query_port(1).ok()?.active_mtu;
        let v2 = version >= SMC_V2;
        Some(AcceptConfirm {
            version,
            first_contact,
            peer_id: self.cfg.system_id,
            gid: self.gid,
            mac: self.mac,
            qpn: lg.qp.qp_num(),
            rmb_rkey: rmb.rkey(),
            rmbe_idx: 1,
            alert_token: c.token,
            rmbe_size: RmbeSize::for_size(rmb.len(), RmbeSize::MAX_CLASS),
            qp_mtu: mtu.code(),
            rmb_vaddr: rmb.addr(),
            psn: lg.psn,
            eid: if v2 {
                eid.unwrap_or_default()
            } else {
                Eid::default()
            },
            fce: (v2 && first_contact).then(|| FirstContactExt {
                v2_direct: true,
                os_type: OS_LINUX,
                release: negotiate::OUR_RELEASE,
                hostname: FirstContactExt::hostname_from_str(&self.cfg.hostname),
                v2x: Some(FceV2x {
                    max_conns: self.cfg.max_conns,
                    max_links: 1,
                    feature_mask: 0,
                    vendor_opts: [0; 4],
                }),
            }),
            gid_list: (v2 && first_contact && kind == AcceptConfirmKind::Confirm)
                .then(|| vec![self.gid]),
        })
    }

    // --------------------------------------------------------------- client

    fn client_on_accept(
        &mut self,
        id: ConnId,
        proposal: &Proposal,
        a: AcceptConfirm,
        now: Timestamp,
    ) {
        let agreement: ClientAgreement = match negotiate::client_check_accept(proposal, &a) {
            Ok(x) => x,
            Err(code) => return self.decline(id, a.version, code),
        };
        let version = agreement.version;
        let peer = PeerPort {
            gid: a.gid,
            mac: a.mac,
            qpn: a.qpn,
            psn: a.psn,
            mtu: a.qp_mtu,
        };
        if a.first_contact {
            let l = match self.new_lgr(Role::Client, version, a.peer_id) {
                Ok(l) => l,
                Err(_) => return self.decline(id, version, DeclineCode::Mem),
            };
            if self.attach(id, l).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
            }
            if self.connect_qp(l, peer, now).is_err() {
                return self.decline(id, version, DeclineCode::ErrRdyLnk);
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
                c.phase = Phase::AwaitLink;
            }
        } else {
            // Reuse: the group the server chose must be one of ours (§4.5).
            let found = self.lgrs.iter().position(|lg| {
                matches!(lg, Some(lg) if lg.role == Role::Client
                    && lg.connected
                    && !lg.group.is_terminated()
                    && lg.peer_system_id == a.peer_id
                    && lg.peer_qpn == a.qpn
                    && lg.peer_gid == a.gid)
            });
            let Some(l) = found else {
                return self.decline(id, version, DeclineCode::SyncErr);
            };
            if self.attach(id, l).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
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
            if self.start_rkey_flow(id, l, now) {
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::ClientRkey {
                        confirm: Box::new(confirm),
                    };
                }
            } else {
                self.decline(id, version, DeclineCode::ErrRegBuf);
            }
        }
    }

    fn start_rkey_flow(&mut self, id: ConnId, l: LgrId, now: Timestamp) -> bool {
        let Some((rkey, addr)) = self
            .conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.rmb.as_ref())
            .map(|m| (m.rkey(), m.addr()))
        else {
            return false;
        };
        match self.lgrs.get_mut(l).and_then(Option::as_mut) {
            // One local LLC flow at a time (§1.6): a busy group queues the
            // connection and pump() starts its flow when the slot frees.
            Some(lg) => {
                if lg.rkey_queue.is_empty()
                    && lg
                        .group
                        .start_confirm_rkey(0, rkey, addr, &[], id as u64, now)
                {
                    return true;
                }
                lg.rkey_queue.push_back(RkeyFlow::Confirm(id));
                true
            }
            None => false,
        }
    }

    // --------------------------------------------------------------- server

    fn server_on_proposal(&mut self, id: ConnId, p: Proposal, now: Timestamp) {
        let dversion = negotiate::decline_version(&p);
        let choice: ServerChoice = match negotiate::server_choose(&p, &self.caps()) {
            Ok(c) => c,
            Err(code) => return self.decline(id, dversion, code),
        };
        let version = choice.version;
        let (peer_id, peer_gid) = match &p.v2_ext {
            Some(ext) if version >= SMC_V2 => (p.peer_id, ext.roce_v2_gid),
            _ => (p.peer_id, p.gid),
        };
        let max = usize::from(self.cfg.max_conns.min(choice.max_conns));
        let reuse = self.lgrs.iter().position(|lg| {
            matches!(lg, Some(lg) if lg.role == Role::Server
                && lg.connected
                && !lg.group.is_terminated()
                && lg.version == version
                && lg.peer_system_id == peer_id
                && lg.peer_gid == peer_gid
                && lg.tokens.len() < max)
        });
        match reuse {
            Some(l) => {
                if self.attach(id, l).is_err() {
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
                if self.start_rkey_flow(id, l, now) {
                    if let Some(c) = self.conn(id) {
                        c.phase = Phase::ServerRkey {
                            accept: Box::new(accept),
                            version,
                        };
                    }
                } else {
                    self.decline(id, dversion, DeclineCode::ErrRegBuf);
                }
            }
            None => {
                let l = match self.new_lgr(Role::Server, version, peer_id) {
                    Ok(l) => l,
                    Err(_) => return self.decline(id, dversion, DeclineCode::Mem),
                };
                if self.attach(id, l).is_err() {
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
                    };
                }
            }
        }
    }

    fn server_on_confirm(
        &mut self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        c: AcceptConfirm,
        now: Timestamp,
    ) {
        if !self.setup_datapath(id, &c) {
            return self.decline(id, version, DeclineCode::ErrRtok);
        }
        if first_contact {
            let Some(l) = self.conn(id).and_then(|x| x.lgr) else {
                return self.decline(id, version, DeclineCode::IntErr);
            };
            if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
                lg.peer_system_id = c.peer_id;
            }
            let peer = PeerPort {
                gid: c.gid,
                mac: c.mac,
                qpn: c.qpn,
                psn: c.psn,
                mtu: c.qp_mtu,
            };
            if self.connect_qp(l, peer, now).is_err() {
                return self.decline(id, version, DeclineCode::ErrRdyLnk);
            }
            if let Some(x) = self.conn(id) {
                x.phase = Phase::AwaitLink;
            }
        } else {
            self.established(id);
        }
    }

    fn established(&mut self, id: ConnId) {
        // The link group may have died between the Accept and the Confirm (a
        // reused group losing its link): the connection is born dead.
        let lgr_dead = self.conn(id).and_then(|c| c.lgr).is_none_or(|l| {
            self.lgrs
                .get(l)
                .and_then(Option::as_ref)
                .is_none_or(|lg| lg.group.is_terminated())
        });
        if let Some(c) = self.conn(id) {
            c.phase = Phase::Smc;
            c.closer.handle(CloseEvent::Established);
            if lgr_dead {
                c.closer.handle(CloseEvent::Kill { can_send: false });
            }
        }
    }

    // ------------------------------------------------------------ progress

    /// Does everything due at `now`: CLC timeouts, LLC traffic, completions,
    /// received CDCs, data and cursor updates, keepalives.
    pub fn pump(&mut self, now: Timestamp) -> Result<()> {
        self.now = now;
        for id in 0..self.conns.len() {
            let due = match self
                .conns
                .get(id)
                .and_then(Option::as_ref)
                .map(|c| &c.phase)
            {
                Some(Phase::AwaitAccept { deadline, .. })
                | Some(Phase::AwaitProposal { deadline })
                | Some(Phase::AwaitConfirm { deadline, .. }) => now >= *deadline,
                _ => false,
            };
            if due {
                self.finish(id, ConnStatus::Failed(FailReason::Timeout));
            }
            if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
                if c.tcp_gone_deadline.is_some_and(|d| now >= d) {
                    c.tcp_gone_deadline = None;
                    if !c.closer.rx_flags().any_close() {
                        // treated like an abort from the peer: ECONNRESET
                        let o = c.closer.handle(CloseEvent::Peer(CloseFlags {
                            done_writing: false,
                            closed: false,
                            abort: true,
                        }));
                        if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                            dp.set_close_flags(f);
                        }
                    }
                }
                if c.close_deadline.is_some_and(|d| now >= d) {
                    c.close_deadline = None;
                    if let Some(dp) = c.dp.as_mut() {
                        dp.discard_unsent();
                    }
                }
            }
        }
        for l in 0..self.lgrs.len() {
            if self.lgrs.get(l).and_then(Option::as_ref).is_none() {
                continue;
            }
            let idle_timeout = self.cfg.lgr_idle_timeout;
            if let Some(lg) = self.lgrs[l].as_mut() {
                lg.group.on_timeout(now);
                if lg.tokens.is_empty() && lg.connected && !lg.group.is_terminated() {
                    let since = *lg.idle_since.get_or_insert(now);
                    if now >= since + idle_timeout {
                        // Linux: DELETE_LINK ALL|ORDERLY, program initiated (§5.6).
                        lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, true);
                    }
                } else {
                    lg.idle_since = None;
                }
            }
            self.retry_rkey_flows(l, now);
            let r = self.pump_lgr(l, now);
            if let Err(e) = r {
                let failed = self.lgrs[l]
                    .as_ref()
                    .is_some_and(|lg| lg.qp.state() == QpState::Err);
                if !failed {
                    return Err(e);
                }
                if let Some(lg) = self.lgrs[l].as_mut() {
                    lg.group.on_link_failure(0);
                }
                self.drain_lgr(l)?;
            }
        }
        self.reap();
        Ok(())
    }

    fn pump_lgr(&mut self, l: LgrId, now: Timestamp) -> Result<()> {
        self.drain_lgr(l)?;
        self.poll_recv(l, now)?;
        self.poll_send(l)?;
        self.drain_lgr(l)?;
        self.flush_tx(l)
    }

    fn drain_lgr(&mut self, l: LgrId) -> Result<()> {
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let Some(o) = lg.group.poll_output() else {
                return Ok(());
            };
            match o {
                LgrOutput::SendLlc { msg, .. } => {
                    let bytes = msg.encode();
                    lg.post(WrKind::Llc, &bytes)?;
                }
                LgrOutput::LinkActive { .. } => {
                    let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                    for id in ids {
                        if matches!(
                            self.conns
                                .get(id)
                                .and_then(Option::as_ref)
                                .map(|c| &c.phase),
                            Some(Phase::AwaitLink)
                        ) {
                            self.established(id);
                        }
                    }
                }
                LgrOutput::LinkDown { .. } => {}
                LgrOutput::Terminated { .. } => {
                    let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                    for id in ids {
                        let phase = self
                            .conns
                            .get(id)
                            .and_then(Option::as_ref)
                            .map(|c| c.phase.clone());
                        match phase {
                            // The first-contact link never came up: decline and fall back
                            // (Linux: TIMEOUT_CL after the CONFIRM_LINK wait).
                            Some(Phase::AwaitLink)
                            | Some(Phase::ClientRkey { .. })
                            | Some(Phase::ServerRkey { .. }) => {
                                let v = self.lgrs[l].as_ref().map_or(SMC_V1, |lg| lg.version);
                                self.decline(id, v, DeclineCode::TimeoutCl);
                            }
                            Some(Phase::Smc) => {
                                if let Some(c) = self.conn(id) {
                                    c.closer.handle(CloseEvent::Kill { can_send: false });
                                }
                            }
                            _ => {}
                        }
                    }
                }
                LgrOutput::RkeyFlowDone { tag, .. } if tag & DELETE_TAG != 0 => {}
                LgrOutput::RkeyFlowDone { tag, ok } => self.on_rkey_done(tag as ConnId, ok),
            }
        }
    }

    fn on_rkey_done(&mut self, id: ConnId, ok: bool) {
        let phase = self.conn(id).map(|c| c.phase.clone());
        match phase {
            Some(Phase::ClientRkey { confirm }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Confirm(*confirm));
                    self.established(id);
                } else {
                    self.decline(id, confirm.version, DeclineCode::ErrRegBuf);
                }
            }
            Some(Phase::ServerRkey { accept, version }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Accept(*accept));
                    let deadline = self.now + CLC_WAIT_TIME;
                    if let Some(c) = self.conn(id) {
                        c.phase = Phase::AwaitConfirm {
                            version,
                            first_contact: false,
                            deadline,
                        };
                    }
                } else {
                    self.decline(id, version, DeclineCode::ErrRegBuf);
                }
            }
            _ => {}
        }
    }

    fn poll_recv(&mut self, l: LgrId, now: Timestamp) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let n = lg.rcq.poll(&mut wcs)?;
            self.completions += n as u64;
            for wc in wcs.iter().take(n) {
                let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                    return Ok(());
                };
                if wc.status != WcStatus::Success {
                    if wc.status != WcStatus::WrFlushError {
                        lg.group.on_link_failure(0);
                    }
                    continue;
                }
                let slot = wc.wr_id as usize;
                let mut buf = vec![0u8; wc.byte_len as usize];
                lg.recv.read_at(slot * RECV_SLOT_LEN, &mut buf)?;
                lg.group.on_rx_activity(0, now);
                let sge = lg.recv.sge(slot * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
                lg.qp.post_recv(&RecvWr {
                    wr_id: wc.wr_id,
                    sges: &[sge],
                })?;
                match WrMessage::decode(&buf) {
                    Ok(WrMessage::Llc(m)) => lg.group.on_llc(0, m, now),
                    Ok(WrMessage::Cdc(c)) => {
                        // The CDC carries the receiver's alert token (§2.1).
                        let Some(&id) = lg.tokens.get(&c.token) else {
                            lg.group.dropped += 1;
                            continue;
                        };
                        self.on_cdc(id, &c);
                    }
                    Err(_) => lg.group.dropped += 1,
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn on_cdc(&mut self, id: ConnId, m: &smc_wire::cdc::CdcMessage) {
        let Some(c) = self.conn(id) else { return };
        let Some(dp) = c.dp.as_mut() else {
            if matches!(
                c.phase,
                Phase::ServerRkey { .. } | Phase::AwaitConfirm { .. }
            ) {
                if c.early_cdcs.len() >= EARLY_CDC_MAX {
                    c.early_cdcs.pop_front();
                }
                c.early_cdcs.push_back(*m);
            }
            return;
        };
        let r = dp.on_cdc(m);
        // Keep the urgent byte apart at once: normal reads skip it and its RMB
        // space is then reused, while recv(MSG_OOB) may come later (TCP keeps it).
        if let (Some(off), Some(rmb)) = (dp.urgent_offset(), c.rmb.as_ref()) {
            let mut b = [0u8; 1];
            if rmb.read_at(off, &mut b).is_ok() {
                c.oob = Some(b[0]);
                dp.urgent_taken();
            }
        }
        match r {
            Ok(r) if r.close.any() => {
                let o = c.closer.handle(CloseEvent::Peer(r.close));
                if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                    dp.set_close_flags(f);
                }
            }
            Ok(_) => {}
            Err(v) => {
                c.violation = Some(v);
                let o = c.closer.handle(CloseEvent::Kill { can_send: true });
                if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                    dp.set_close_flags(f);
                }
            }
        }
    }

    fn poll_send(&mut self, l: LgrId) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let n = lg.scq.poll(&mut wcs)?;
            self.completions += n as u64;
            let mut done = Vec::new();
            for wc in wcs.iter().take(n) {
                let kind = lg.wrs.remove(&wc.wr_id);
                if kind.is_some() {
                    lg.sends_in_flight = lg.sends_in_flight.saturating_sub(1);
                }
                if wc.status != WcStatus::Success {
                    lg.group.on_link_failure(0);
                    continue;
                }
                if let Some(WrKind::Cdc(id, seq)) = kind {
                    done.push((id, seq));
                }
            }
            for (id, seq) in done {
                if let Some(c) = self.conn(id) {
                    if let Some(Err(v)) = c.dp.as_mut().map(|dp| dp.on_cdc_sent(seq)) {
                        c.violation = Some(v);
                    }
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn flush_tx(&mut self, l: LgrId) -> Result<()> {
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return Ok(());
        };
        if lg.group.active_slots().next().is_none() {
            return Ok(());
        }
        // Round robin, a few batches per connection per pass, so that one busy
        // connection cannot take every send slot of the link.
        let mut ids: Vec<ConnId> = lg.tokens.values().copied().collect();
        if !ids.is_empty() {
            lg.rr = (lg.rr + 1) % ids.len();
            ids.rotate_left(lg.rr);
        }
        for id in ids {
            for _ in 0..4 {
                let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                    return Ok(());
                };
                if lg.sends_in_flight >= MAX_SENDS {
                    return Ok(());
                }
                let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
                    break;
                };
                let (Some(dp), Some(peer), Some(sndbuf)) =
                    (c.dp.as_mut(), c.peer_rmb, c.sndbuf.as_ref())
                else {
                    break;
                };
                if !matches!(c.phase, Phase::Smc) {
                    break;
                }
                let Some(batch) = dp.poll_tx() else {
                    break;
                };
                for w in &batch.writes {
                    let sges: Vec<_> = w
                        .src
                        .as_slice()
                        .iter()
                        .map(|&(off, len)| sndbuf.sge(off, len as u32))
                        .collect::<Result<_>>()?;
                    lg.next_wr += 1;
                    lg.qp.post_send(&SendWr {
                        wr_id: lg.next_wr,
                        op: SendOp::RdmaWrite {
                            remote_addr: peer.addr + w.peer_offset as u64,
                            rkey: peer.rkey,
                        },
                        payload: Payload::Sges(&sges),
                        signaled: false,
                    })?;
                }
                let bytes = batch.cdc.encode();
                lg.post(WrKind::Cdc(id, batch.cdc.seqno), &bytes)?;
            }
        }
        Ok(())
    }

    fn retry_rkey_flows(&mut self, l: LgrId, now: Timestamp) {
        loop {
            let Some(&flow) = self
                .lgrs
                .get(l)
                .and_then(Option::as_ref)
                .and_then(|lg| lg.rkey_queue.front())
            else {
                return;
            };
            let confirm_rmb = match flow {
                RkeyFlow::Confirm(id) => Some(
                    self.conns
                        .get(id)
                        .and_then(Option::as_ref)
                        .and_then(|c| c.rmb.as_ref())
                        .map(|m| (m.rkey(), m.addr())),
                ),
                RkeyFlow::Delete(_) => None,
            };
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return;
            };
            let started = match (flow, confirm_rmb) {
                // the connection went away while waiting: drop its flow
                (RkeyFlow::Confirm(_), Some(None)) => true,
                (RkeyFlow::Confirm(id), Some(Some((rkey, addr)))) => {
                    lg.group
                        .start_confirm_rkey(0, rkey, addr, &[], id as u64, now)
                }
                (RkeyFlow::Delete(rkey), _) => {
                    lg.group
                        .start_delete_rkey(0, rkey, DELETE_TAG | u64::from(rkey), now)
                }
                (RkeyFlow::Confirm(_), None) => true,
            };
            if !started {
                return;
            }
            lg.rkey_queue.pop_front();
        }
    }

    /// Frees connections that are closed and released, and link groups that died.
    fn reap(&mut self) {
        for id in 0..self.conns.len() {
            let finished = self
                .conns
                .get(id)
                .and_then(Option::as_ref)
                .is_some_and(|c| {
                    // CDCs of a dead link group never complete; do not wait for them.
                    let lgr_dead = c.lgr.is_none_or(|l| {
                        self.lgrs
                            .get(l)
                            .and_then(Option::as_ref)
                            .is_none_or(|lg| lg.group.is_terminated())
                    });
                    // Our final CDC must have gone out and completed: the peer
                    // waits for it (PEERCLOSEWAIT) and may still write until then.
                    c.closer.is_finished()
                        && (lgr_dead
                            || c.dp
                                .as_ref()
                                .is_none_or(|dp| dp.cdcs_in_flight() == 0 && !dp.close_pending()))
                });
            if finished {
                if let Some(l) = self.conns[id].as_ref().and_then(|c| c.lgr) {
                    self.detach(id, l);
                    let bufs = self.conns[id]
                        .as_mut()
                        .and_then(|c| Some((c.rmb.take()?, c.sndbuf.take()?)));
                    if let (Some((rmb, sndbuf)), Some(lg)) =
                        (bufs, self.lgrs.get_mut(l).and_then(Option::as_mut))
                    {
                        if !lg.group.is_terminated() {
                            // The peer forgets this RMB (§1.11), then it is reused.
                            lg.rkey_queue.push_back(RkeyFlow::Delete(rmb.rkey()));
                            lg.free_bufs.push((rmb, sndbuf));
                        }
                    }
                }
                self.conns[id] = None;
            }
        }
        for l in 0..self.lgrs.len() {
            let dead = self.lgrs[l]
                .as_ref()
                .is_some_and(|lg| lg.group.is_terminated() && lg.tokens.is_empty());
            if dead {
                self.lgrs[l] = None;
            }
        }
    }

    // ------------------------------------------------------------ application

    fn smc_conn(&mut self, id: ConnId) -> std::result::Result<&mut Conn<P>, ConnError> {
        match self.conns.get_mut(id).and_then(Option::as_mut) {
            Some(c) if c.dp.is_some() => Ok(c),
            _ => Err(ConnError::NotConnected),
        }
    }

    fn close_error(c: &Conn<P>) -> ConnError {
        match c.closer.error() {
            Some(smc_proto::close::CloseError::Reset) => ConnError::Reset,
            Some(smc_proto::close::CloseError::Aborted) => ConnError::Aborted,
            // writing to a peer that closed: ECONNRESET, as Linux
            None if c.closer.rx_flags().any_close() && !c.closer.tx_flags().any() => {
                ConnError::Reset
            }
            None => ConnError::Closed,
        }
    }

    /// Writes as much of `data` as the send buffer takes; 0 means "would block".
    ///
    /// When nothing written earlier is still waiting and the peer has room, the
    /// bytes go out at once as inline RDMA WRITEs from `data` itself (copied at
    /// post time, §3.2: the send buffer only has to hold data that cannot be
    /// written yet), followed by their CDC: one copy instead of two. Otherwise
    /// they are copied into the send buffer and sent by [`Self::pump`].
    pub fn write(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        if let Some(n) = self.write_direct(id, data)? {
            return Ok(n);
        }
        self.write_buffered(id, data)
    }

    /// Copies into the send buffer; [`Self::pump`] sends it.
    fn write_buffered(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        let c = self.smc_conn(id)?;
        if !c.closer.can_write() {
            return Err(Self::close_error(c));
        }
        let (Some(dp), Some(sndbuf)) = (c.dp.as_mut(), c.sndbuf.as_ref()) else {
            return Err(ConnError::NotConnected);
        };
        let chunks = dp.sndbuf_free_chunks(data.len());
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            if sndbuf.write_at(off, &data[n..n + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            n += len;
        }
        dp.produced(n);
        Ok(n)
    }

    /// The direct path of [`Self::write`]; `None` when it does not apply.
    fn write_direct(
        &mut self,
        id: ConnId,
        data: &[u8],
    ) -> std::result::Result<Option<usize>, ConnError> {
        let max_inline = self.max_inline as usize;
        let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
            return Ok(None);
        };
        let (Some(l), Some(dp), Some(peer)) = (c.lgr, c.dp.as_mut(), c.peer_rmb) else {
            return Ok(None);
        };
        if !matches!(c.phase, Phase::Smc)
            || !c.closer.can_write()
            || dp.unsent() > 0
            || dp.urgent_pending()
            || dp.close_pending()
        {
            return Ok(None);
        }
        // Only whole writes: cutting a large write down to a small inline limit
        // (verbs: 64 bytes) would cost more than the copy it saves.
        let n = data.len().min(dp.sndbuf_free()).min(dp.peer_space());
        if n > max_inline {
            return Ok(None);
        }
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return Ok(None);
        };
        if n == 0 || lg.sends_in_flight >= MAX_SENDS || lg.group.active_slots().next().is_none() {
            return Ok(None);
        }
        dp.produced(n);
        let Some(batch) = dp.poll_tx() else {
            return Err(ConnError::Aborted);
        };
        let mut at = 0;
        for w in &batch.writes {
            lg.next_wr += 1;
            let r = lg.qp.post_send(&SendWr {
                wr_id: lg.next_wr,
                op: SendOp::RdmaWrite {
                    remote_addr: peer.addr + w.peer_offset as u64,
                    rkey: peer.rkey,
                },
                payload: Payload::Inline(&data[at..at + w.len]),
                signaled: false,
            });
            if r.is_err() {
                // The link is broken: the connection dies with it (the next
                // pump aborts it); like TCP, this write itself succeeded.
                lg.group.on_link_failure(0);
                return Ok(Some(n));
            }
            at += w.len;
        }
        debug_assert_eq!(at, n, "a direct write sends everything produced");
        let bytes = batch.cdc.encode();
        if lg.post(WrKind::Cdc(id, batch.cdc.seqno), &bytes).is_err() {
            lg.group.on_link_failure(0);
        }
        Ok(Some(n))
    }

    /// Sends one urgent byte (TCP `send(MSG_OOB)`): it goes into the stream after
    /// everything written before, flagged so that the peer can fetch it out of
    /// band. `Ok(false)` if the send buffer is full or the previous urgent byte has
    /// not gone out yet (try again later).
    pub fn write_oob(&mut self, id: ConnId, byte: u8) -> std::result::Result<bool, ConnError> {
        let c = self.smc_conn(id)?;
        if c.dp.as_ref().is_some_and(DataPath::urgent_pending) {
            return Ok(false);
        }
        // through the send buffer: the byte must still be unsent to be marked
        if self.write_buffered(id, &[byte])? == 0 {
            return Ok(false);
        }
        let c = self.smc_conn(id)?;
        Ok(c.dp.as_mut().is_some_and(DataPath::mark_urgent))
    }

    /// Fetches the peer's urgent byte (TCP `recv(MSG_OOB)`), once.
    pub fn read_oob(&mut self, id: ConnId) -> std::result::Result<Option<u8>, ConnError> {
        Ok(self.smc_conn(id)?.oob.take())
    }

    /// Reads up to `max` bytes. `Ok(empty)` with [`Self::peer_done`] true is
    /// end-of-file; `Ok(empty)` otherwise means "would block".
    pub fn read(&mut self, id: ConnId, max: usize) -> std::result::Result<Vec<u8>, ConnError> {
        let mut out = vec![0u8; max.min(self.readable(id))];
        let n = self.read_into(id, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads into `buf` straight from the receive buffer (one copy). `Ok(0)`
    /// with [`Self::peer_done`] true is end-of-file; `Ok(0)` otherwise means
    /// "would block" (or `buf` is empty).
    pub fn read_into(
        &mut self,
        id: ConnId,
        buf: &mut [u8],
    ) -> std::result::Result<usize, ConnError> {
        let c = self.smc_conn(id)?;
        if c.closer.error().is_some() && c.dp.as_ref().is_none_or(|dp| dp.readable() == 0) {
            return Err(Self::close_error(c));
        }
        let (Some(dp), Some(rmb)) = (c.dp.as_mut(), c.rmb.as_ref()) else {
            return Err(ConnError::NotConnected);
        };
        let chunks = dp.readable_chunks(buf.len());
        let mut at = 0;
        for &(off, len) in chunks.as_slice() {
            if rmb.read_at(off, &mut buf[at..at + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            at += len;
        }
        dp.consumed(at);
        Ok(at)
    }

    /// Asks every completion queue to signal the endpoint's descriptor
    /// ([`Self::notify_fd`]) at its next completion. Arm, then [`Self::pump`] once
    /// more (a completion may have come in before arming), then sleep on the
    /// descriptor: nothing is missed, and while nobody sleeps peers post without
    /// a system call.
    pub fn arm(&mut self) -> Result<()> {
        for lg in self.lgrs.iter().flatten() {
            lg.scq.req_notify()?;
            lg.rcq.req_notify()?;
        }
        Ok(())
    }

    /// A descriptor that becomes readable when an armed completion queue gets a
    /// completion (the endpoint's completion channel).
    pub fn notify_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.chan.fd()
    }

    /// Consumes the notification on [`Self::notify_fd`], if any.
    pub fn take_notification(&self) -> bool {
        self.chan.try_get_event().unwrap_or(false)
    }

    /// Work completions processed so far: when it moves, [`Self::pump`] did
    /// something (data, cursor updates, LLC) that a waiter may care about.
    pub fn completions(&self) -> u64 {
        self.completions
    }

    /// Bytes received and not yet read.
    pub fn readable(&self, id: ConnId) -> usize {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.dp.as_ref())
            .map_or(0, DataPath::readable)
    }

    /// The peer will send nothing more (EOF once the receive buffer is drained).
    pub fn peer_done(&self, id: ConnId) -> bool {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.closer.peer_done())
    }

    /// The application is done with the connection (`close()` on the socket). An
    /// SMC connection closes (an abort if received data is left unread) and is
    /// freed once the close completes; a fallen-back, failed or unfinished one is
    /// freed at once (its TCP socket is the caller's to close).
    pub fn release(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return;
        };
        match &c.phase {
            Phase::Smc => {
                let unread_data = c.dp.as_ref().is_some_and(|dp| dp.unread() > 0);
                self.close(id, CloseEvent::AppClose { unread_data });
            }
            _ => {
                if matches!(self.status(id), Some(ConnStatus::Handshaking)) {
                    self.finish(id, ConnStatus::Failed(FailReason::TcpClosed));
                }
                if let Some(l) = self.conns[id].as_mut().and_then(|c| c.lgr.take()) {
                    self.detach(id, l);
                }
                self.conns[id] = None;
            }
        }
    }

    /// The peer closed (or aborted) the connection, as opposed to only shutting
    /// down its write side.
    pub fn peer_closed(&self, id: ConnId) -> bool {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.closer.rx_flags().any_close())
    }

    /// `shutdown(SHUT_WR)` or `close()`. Unsent data goes out first; after
    /// `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) without room at the peer it is dropped
    /// and the close is sent anyway, as Linux does (§5.2).
    pub fn close(&mut self, id: ConnId, ev: CloseEvent) {
        let deadline = self.now + MAX_STREAM_WAIT;
        if let Some(c) = self.conn(id) {
            let o = c.closer.handle(ev);
            if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                dp.set_close_flags(f);
                if dp.close_pending() {
                    c.close_deadline = Some(deadline);
                }
            }
        }
    }

    /// Which side of the handshake a connection is.
    pub fn role(&self, id: ConnId) -> Option<Role> {
        self.conns.get(id)?.as_ref().map(|c| c.role)
    }

    /// A connection's close state.
    pub fn close_state(&self, id: ConnId) -> Option<CloseState> {
        self.conns.get(id)?.as_ref().map(|c| c.closer.state())
    }

    /// Close flags we have sent on a connection.
    pub fn sent_close_flags(&self, id: ConnId) -> Option<CloseFlags> {
        self.conns.get(id)?.as_ref().map(|c| c.closer.tx_flags())
    }

    /// Unsent or unconfirmed bytes of ours on a connection.
    pub fn unacked(&self, id: ConnId) -> usize {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.dp.as_ref())
            .map_or(0, DataPath::unacked)
    }

    /// Live link groups.
    pub fn link_groups(&self) -> usize {
        self.lgrs.iter().flatten().count()
    }

    /// Connections of the link group a connection uses.
    pub fn link_group_of(&self, id: ConnId) -> Option<LgrId> {
        self.conns.get(id)?.as_ref()?.lgr
    }

    /// Connections still allocated (not yet reaped).
    pub fn connections(&self) -> usize {
        self.conns.iter().flatten().count()
    }

    /// Peer RMBs a link group knows (its rtoken table) and our released buffers
    /// it keeps for reuse.
    pub fn link_group_buffers(&self, l: LgrId) -> Option<(usize, usize)> {
        self.lgrs
            .get(l)?
            .as_ref()
            .map(|lg| (lg.group.rtoken_count(), lg.free_bufs.len()))
    }

    /// QP number of a link group's link (for fault injection in tests).
    pub fn qp_num(&self, l: LgrId) -> Option<u32> {
        self.lgrs.get(l)?.as_ref().map(|lg| lg.qp.qp_num())
    }

    /// Debug dump of a connection's data path and close state.
    pub fn debug_conn(&self, id: ConnId) -> String {
        match self.conns.get(id).and_then(Option::as_ref) {
            Some(c) => format!(
                "token {} lgr {:?} {:?} {:?} {:?}",
                c.token, c.lgr, c.phase, c.closer, c.dp
            ),
            None => "gone".into(),
        }
    }

    /// The violation that killed a connection, if any.
    pub fn violation(&self, id: ConnId) -> Option<Violation> {
        self.conns.get(id)?.as_ref()?.violation
    }
}

impl<P: Provider> Lgr<P> {
    fn post(&mut self, kind: WrKind, bytes: &[u8]) -> Result<()> {
        self.next_wr += 1;
        self.wrs.insert(self.next_wr, kind);
        self.sends_in_flight += 1;
        self.qp.post_send(&SendWr {
            wr_id: self.next_wr,
            op: SendOp::Send,
            payload: Payload::Inline(bytes),
            signaled: true,
        })
    }
}
