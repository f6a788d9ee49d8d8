//! # smc-engine — the SMC-R engine driven over an RDMA provider
//!
//! [`LinkEnd`] is one end of an SMC-R link with one connection on it: it owns the
//! provider objects (device, PD, CQs, RC QP, receive buffers, RMB, send buffer)
//! and carries out what the sans-I/O engine pieces decide — the link group's LLC
//! messages ([`smc_proto::link`]), the connection's RDMA WRITEs and CDCs
//! ([`smc_proto::datapath`]) and its close flags ([`smc_proto::close`]). It is
//! generic over [`smc_rdma::Provider`], so the same code runs over the
//! deterministic `sim` fabric (tests, seeds, faults) and the `shm` device.
//!
//! This is the first vertical slice of the driver: one link, one connection, the
//! CLC values exchanged by the caller. The endpoint (CLC over TCP, several link
//! groups, many connections) builds on it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod endpoint;
pub mod simulate;

use smc_proto::close::{CloseEvent, CloseFlags, Closer, Outcome};
use smc_proto::datapath::{DataPath, DataPathConfig, Violation};
use smc_proto::link::{LgrConfig, LgrOutput, LinkGroup, LocalPort, PeerPort};
use smc_proto::Timestamp;
use smc_rdma::{
    Access, CompletionQueue, Device, MemoryRegion, Payload, ProtectionDomain, Provider, QpCap,
    QpModify, QueuePair, RecvWr, RemoteMr, RemoteQp, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};
use smc_wire::WrMessage;
use std::collections::HashMap;
use std::time::Duration;

/// Receive buffers posted per link (Linux: 3 × 16 = 48).
pub const RECV_SLOTS: usize = 48;
/// Bytes per receive buffer: a v1 message is 44 bytes, SMC-Rv2 LLC up to 8192.
pub const RECV_SLOT_LEN: usize = 8192;

/// What one end was built with.
#[derive(Clone, Copy, Debug)]
pub struct EndConfig {
    /// Link-group parameters (role, LLC version, keepalive).
    pub lgr: LgrConfig,
    /// Our send buffer.
    pub sndbuf_len: usize,
    /// Our RMB (one RMBE).
    pub rmb_len: usize,
}

/// Identifies our posted work requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WrKind {
    Llc,
    Write,
    Cdc(u16),
}

/// One end of a link with one connection.
pub struct LinkEnd<P: Provider> {
    dev: P::Device,
    _pd: P::Pd,
    scq: P::Cq,
    rcq: P::Cq,
    qp: P::Qp,
    recv: P::Mr,
    rmb: P::Mr,
    sndbuf: P::Mr,
    psn: u32,
    cfg: EndConfig,
    /// The link group (one link, slot 0).
    pub lgr: LinkGroup,
    dp: Option<DataPath>,
    /// The connection's close state.
    pub closer: Closer,
    peer_rmb: Option<RemoteMr>,
    next_wr: u64,
    wrs: HashMap<u64, WrKind>,
    /// Engine outputs not consumed by the driver itself (link up/down, ...).
    pub events: Vec<LgrOutput>,
    /// A peer CDC that could not be true, if one arrived (the connection must die).
    pub violation: Option<Violation>,
    /// Completions with an error status seen on this link.
    pub errors: Vec<WorkCompletion>,
}

/// Errors of the slice driver.
pub type Result<T> = smc_rdma::Result<T>;

impl<P: Provider> LinkEnd<P> {
    /// Opens `dev_name` on `provider` and builds the link's resources; the QP is in
    /// INIT with every receive buffer posted.
    pub fn open(provider: &P, dev_name: &str, cfg: EndConfig) -> Result<LinkEnd<P>> {
        let dev = provider.open_device(dev_name)?;
        let pd = dev.alloc_pd()?;
        let scq = dev.create_cq(1024, None)?;
        let rcq = dev.create_cq(1024, None)?;
        let qp = pd.create_qp(
            &scq,
            &rcq,
            QpCap {
                max_send_wr: 3 * 16,
                max_recv_wr: RECV_SLOTS as u32,
                max_inline_data: 64,
            },
        )?;
        qp.modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        })?;
        let recv = pd.alloc_mr(RECV_SLOTS * RECV_SLOT_LEN, Access::LOCAL_WRITE)?;
        let rmb = pd.alloc_mr(cfg.rmb_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let sndbuf = pd.alloc_mr(cfg.sndbuf_len, Access::LOCAL_WRITE)?;
        for i in 0..RECV_SLOTS {
            let sge = recv.sge(i * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
            qp.post_recv(&RecvWr {
                wr_id: i as u64,
                sges: &[sge],
            })?;
        }
        let psn = qp.qp_num().wrapping_mul(2_654_435_761) & 0x00ff_ffff;
        Ok(LinkEnd {
            dev,
            _pd: pd,
            scq,
            rcq,
            qp,
            recv,
            rmb,
            sndbuf,
            psn,
            lgr: LinkGroup::new(cfg.lgr),
            cfg,
            dp: None,
            closer: Closer::new(),
            peer_rmb: None,
            next_wr: 1 << 32,
            wrs: HashMap::new(),
            events: Vec::new(),
            violation: None,
            errors: Vec::new(),
        })
    }

    /// Our end as CLC announces it.
    pub fn local_port(&self) -> Result<LocalPort> {
        let port = self.dev.query_port(1)?;
        let gid = port.gids.first().map(|g| g.gid).unwrap_or_default();
        Ok(LocalPort {
            gid,
            mac: self
                .dev
                .info()
                .ports
                .first()
                .map(|_| gid_mac(&gid))
                .unwrap_or_default(),
            qpn: self.qp.qp_num(),
            psn: self.psn,
            mtu: port.active_mtu,
        })
    }

    /// Our RMB as CLC announces it (rkey, address, length).
    pub fn rmb(&self) -> RemoteMr {
        self.rmb.remote()
    }

    /// Connects the QP to the peer (RTR, RTS), starts the first-contact
    /// CONFIRM_LINK exchange, and sets up the connection on the link with the
    /// peer's RMB and alert token (both from CLC).
    pub fn connect(
        &mut self,
        peer: PeerPort,
        peer_rmb: RemoteMr,
        peer_token: u32,
        now: Timestamp,
    ) -> Result<()> {
        let local = self.local_port()?;
        let mtu = smc_rdma::Mtu::from_code(peer.mtu).map_or(local.mtu, |m| m.min(local.mtu));
        self.qp.modify(&QpModify::Rtr {
            remote: RemoteQp {
                gid: peer.gid,
                qp_num: peer.qpn,
            },
            sgid_index: 0,
            rq_psn: peer.psn,
            path_mtu: mtu,
            min_rnr_timer: Duration::from_micros(640),
        })?;
        // Linux: timeout 15 (~134 ms), retry 7, rnr_retry 7 (infinite) (§4.3).
        self.qp.modify(&QpModify::Rts {
            sq_psn: self.psn,
            timeout: Duration::from_millis(134),
            retry_cnt: 7,
            rnr_retry: 7,
        })?;
        self.lgr.add_first_link(local, peer, now);
        self.peer_rmb = Some(peer_rmb);
        self.dp = Some(DataPath::new(DataPathConfig {
            sndbuf_len: self.cfg.sndbuf_len,
            rmbe_len: self.cfg.rmb_len,
            peer_rmbe_len: peer_rmb.len as usize,
            peer_token,
        }));
        Ok(())
    }

    /// The link is confirmed and usable.
    pub fn is_active(&self) -> bool {
        self.lgr.active_slots().next().is_some()
    }

    fn wr_id(&mut self, kind: WrKind) -> u64 {
        self.next_wr += 1;
        self.wrs.insert(self.next_wr, kind);
        self.next_wr
    }

    fn post_llc(&mut self, bytes: &[u8]) -> Result<()> {
        let wr_id = self.wr_id(WrKind::Llc);
        self.qp.post_send(&SendWr {
            wr_id,
            op: SendOp::Send,
            payload: Payload::Inline(bytes),
            signaled: true,
        })
    }

    /// Does everything that is due: LLC messages out, completions in, received
    /// messages dispatched, data and cursor updates out, timers. A work request the
    /// QP refuses (it went to ERR) is a link failure, handled like an error
    /// completion; only other provider errors are returned.
    pub fn pump(&mut self, now: Timestamp) -> Result<()> {
        self.lgr.on_timeout(now);
        let r = (|| {
            self.drain_lgr()?;
            self.poll_recv(now)?;
            self.poll_send()?;
            self.drain_lgr()?;
            self.flush_tx()
        })();
        match r {
            Err(smc_rdma::Error::InvalidState { .. })
                if self.qp.state() == smc_rdma::QpState::Err =>
            {
                self.lgr.on_link_failure(0);
                self.drain_lgr()
            }
            r => r,
        }
    }

    fn drain_lgr(&mut self) -> Result<()> {
        while let Some(o) = self.lgr.poll_output() {
            match o {
                LgrOutput::SendLlc { msg, .. } => {
                    let bytes = msg.encode();
                    self.post_llc(&bytes)?;
                }
                LgrOutput::Terminated { reason } => {
                    // The link group is gone: the connection dies (§5.5).
                    self.closer.handle(CloseEvent::Kill { can_send: false });
                    self.events.push(LgrOutput::Terminated { reason });
                }
                LgrOutput::LinkActive { slot } => {
                    // First contact confirmed: the connection is established.
                    self.closer.handle(CloseEvent::Established);
                    self.events.push(LgrOutput::LinkActive { slot });
                }
                e => self.events.push(e),
            }
        }
        Ok(())
    }

    fn poll_recv(&mut self, now: Timestamp) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let n = self.rcq.poll(&mut wcs)?;
            for wc in wcs.iter().take(n) {
                if wc.status != WcStatus::Success {
                    self.errors.push(*wc);
                    if wc.status != WcStatus::WrFlushError {
                        self.lgr.on_link_failure(0);
                    }
                    continue;
                }
                let slot = wc.wr_id as usize;
                let mut buf = vec![0u8; wc.byte_len as usize];
                self.recv.read_at(slot * RECV_SLOT_LEN, &mut buf)?;
                self.lgr.on_rx_activity(0, now);
                match WrMessage::decode(&buf) {
                    Ok(WrMessage::Llc(m)) => self.lgr.on_llc(0, m, now),
                    Ok(WrMessage::Cdc(c)) => self.on_cdc(&c),
                    Err(_) => self.lgr.dropped += 1,
                }
                let sge = self.recv.sge(slot * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
                self.qp.post_recv(&RecvWr {
                    wr_id: wc.wr_id,
                    sges: &[sge],
                })?;
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn on_cdc(&mut self, c: &smc_wire::cdc::CdcMessage) {
        let Some(dp) = self.dp.as_mut() else {
            return;
        };
        match dp.on_cdc(c) {
            Ok(r) if r.close.any() => {
                let o = self.closer.handle(CloseEvent::Peer(r.close));
                self.apply_close(o);
            }
            Ok(_) => {}
            Err(v) => {
                self.violation = Some(v);
                let o = self.closer.handle(CloseEvent::Kill { can_send: true });
                self.apply_close(o);
            }
        }
    }

    fn apply_close(&mut self, o: Outcome) {
        if let (Some(f), Some(dp)) = (o.send_cdc, self.dp.as_mut()) {
            dp.set_close_flags(f);
        }
    }

    fn poll_send(&mut self) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let n = self.scq.poll(&mut wcs)?;
            for wc in wcs.iter().take(n) {
                let kind = self.wrs.remove(&wc.wr_id);
                if wc.status != WcStatus::Success {
                    self.errors.push(*wc);
                    self.lgr.on_link_failure(0);
                    continue;
                }
                if let (Some(WrKind::Cdc(seq)), Some(dp)) = (kind, self.dp.as_mut()) {
                    if let Err(v) = dp.on_cdc_sent(seq) {
                        self.violation = Some(v);
                    }
                }
                debug_assert!(wc.opcode == WcOpcode::Send || wc.opcode == WcOpcode::RdmaWrite);
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn flush_tx(&mut self) -> Result<()> {
        if !self.is_active() {
            return Ok(());
        }
        let (Some(peer), true) = (self.peer_rmb, self.dp.is_some()) else {
            return Ok(());
        };
        // Linux keeps at most 16 SENDs outstanding per link (§4.1).
        while self
            .wrs
            .values()
            .filter(|k| matches!(k, WrKind::Cdc(_)))
            .count()
            < 16
        {
            let Some(batch) = self.dp.as_mut().and_then(DataPath::poll_tx) else {
                break;
            };
            for w in &batch.writes {
                let sges: Vec<_> = w
                    .src
                    .as_slice()
                    .iter()
                    .map(|&(off, len)| self.sndbuf.sge(off, len as u32))
                    .collect::<Result<_>>()?;
                let wr_id = self.wr_id(WrKind::Write);
                self.qp.post_send(&SendWr {
                    wr_id,
                    op: SendOp::RdmaWrite {
                        remote_addr: peer.addr + w.peer_offset as u64,
                        rkey: peer.rkey,
                    },
                    payload: Payload::Sges(&sges),
                    signaled: false,
                })?;
                self.wrs.remove(&wr_id); // unsignaled: no completion on success
            }
            let bytes = batch.cdc.encode();
            let wr_id = self.wr_id(WrKind::Cdc(batch.cdc.seqno));
            self.qp.post_send(&SendWr {
                wr_id,
                op: SendOp::Send,
                payload: Payload::Inline(&bytes),
                signaled: true,
            })?;
        }
        Ok(())
    }

    /// The application writes: copies as much of `data` as the send buffer takes.
    pub fn write(&mut self, data: &[u8]) -> Result<usize> {
        if !self.closer.can_write() {
            return Ok(0);
        }
        let Some(dp) = self.dp.as_mut() else {
            return Ok(0);
        };
        let chunks = dp.sndbuf_free_chunks(data.len());
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            self.sndbuf.write_at(off, &data[n..n + len])?;
            n += len;
        }
        dp.produced(n);
        Ok(n)
    }

    /// The application reads up to `max` bytes.
    pub fn read(&mut self, max: usize) -> Result<Vec<u8>> {
        let Some(dp) = self.dp.as_mut() else {
            return Ok(Vec::new());
        };
        let chunks = dp.readable_chunks(max);
        let mut out = Vec::with_capacity(chunks.total());
        for &(off, len) in chunks.as_slice() {
            let start = out.len();
            out.resize(start + len, 0);
            self.rmb.read_at(off, &mut out[start..])?;
        }
        dp.consumed(out.len());
        Ok(out)
    }

    /// Unsent or unconfirmed bytes of ours.
    pub fn unacked(&self) -> usize {
        self.dp.as_ref().map_or(0, DataPath::unacked)
    }

    /// `shutdown(SHUT_WR)` / `close()` / abort, as the application asks.
    pub fn close_event(&mut self, ev: CloseEvent) {
        let o = self.closer.handle(ev);
        self.apply_close(o);
    }

    /// Close flags we have sent.
    pub fn tx_close_flags(&self) -> CloseFlags {
        self.closer.tx_flags()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }
}

/// The MAC inside a RoCE v1 link-local GID (inverse of modified EUI-64); zero
/// for other GIDs (RoCE v2 links carry no MAC in this slice).
fn gid_mac(g: &smc_wire::types::Gid) -> smc_wire::types::Mac {
    let b = g.0;
    if b[0] == 0xfe && b[1] == 0x80 && b[11] == 0xff && b[12] == 0xfe {
        smc_wire::types::Mac([b[8] ^ 2, b[9], b[10], b[13], b[14], b[15]])
    } else {
        smc_wire::types::Mac::default()
    }
}

/// The CLC view of `end` for its peer.
pub fn peer_view<P: Provider>(end: &LinkEnd<P>) -> Result<PeerPort> {
    let l = end.local_port()?;
    Ok(PeerPort {
        gid: l.gid,
        mac: l.mac,
        qpn: l.qpn,
        psn: l.psn,
        mtu: l.mtu.code(),
    })
}
