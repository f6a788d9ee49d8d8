//! `sim`: a deterministic in-process simulated RDMA fabric.
//!
//! All devices of one [`SimFabric`] live in one process and share a virtual
//! clock. Posting a work request only queues a message; nothing is delivered
//! until the test moves time forward with [`SimFabric::advance`] or
//! [`SimFabric::run_until_idle`]. Latency jitter comes from a seeded
//! splitmix64 generator, so a run is a pure function of its seed and the
//! calls made. Faults can be injected: extra delay, QP error, port down/up, a
//! device that stops answering and a device that dies; a device may retry as
//! Soft-RoCE does ([`SimFabric::set_rxe_retry`]).
//!
//! The transport model follows RC: messages of one QP are delivered in order
//! (go-back-N: a message that gets no answer is retried after the QP timeout,
//! blocking those behind it), RNR NAKs are retried after the responder's
//! `min_rnr_timer` up to `rnr_retry` times (7 = forever), an invalid rkey,
//! out-of-bounds address or missing remote-write right NAKs the request and
//! moves the requester to ERR with `RemoteAccessError`, and on ERR all
//! outstanding WRs flush with `WrFlushError`.
#![forbid(unsafe_code)]

use crate::sys::EventFd;
use crate::verbs::*;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The attributes a QP was brought to RTR and RTS with
/// ([`SimFabric::qp_attrs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimQpAttrs {
    /// Index of the source GID in the port's table.
    pub sgid_index: u16,
    /// Path MTU.
    pub path_mtu: Option<Mtu>,
    /// RNR NAK timer the QP asks its peer to wait.
    pub min_rnr_timer: Duration,
    /// Local ACK timeout.
    pub timeout: Duration,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7: for ever).
    pub rnr_retry: u8,
}

/// A point on the fabric's virtual clock (nanoseconds since creation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SimInstant(pub u64);

impl SimInstant {
    /// Time elapsed since `earlier` (saturating).
    pub fn since(self, earlier: SimInstant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

const MAX_MSG: u32 = 1 << 30;
const MAX_INLINE: u32 = 256;

#[derive(Debug)]
struct DevSt {
    name: String,
    gid: Gid,
    /// The port's GID table (index order); `gid` is its first entry.
    gids: Vec<GidEntry>,
    netdev: Option<String>,
    port_up: bool,
    unresponsive: bool,
    /// Its QPs' peers take it for a stopped process ([`SimFabric::set_paused`]).
    paused: bool,
    /// Requesters on this device retry forever at a transport retry count
    /// of 7 ([`SimFabric::set_rxe_retry`]).
    rxe_retry: bool,
    extra_delay: u64,
    events: VecDeque<AsyncEvent>,
    efd: Arc<EventFd>,
}

#[derive(Debug)]
struct MrSt {
    dev: usize,
    pd: u32,
    /// The region's bytes, shared by every registration of the same memory
    /// (`SimPd::share_mr`).
    data: Arc<Mutex<Vec<u8>>>,
    addr: u64,
    access: Access,
}

impl MrSt {
    fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn len(&self) -> usize {
        self.bytes().len()
    }
}

#[derive(Debug)]
struct Out {
    id: u64,
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    len: u32,
    result: Option<WcStatus>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum MsgOp {
    Send,
    Write,
    WriteImm,
}

#[derive(Debug)]
struct Msg {
    out_id: u64,
    op: MsgOp,
    data: Vec<u8>,
    imm: Option<u32>,
    remote_addr: u64,
    rkey: u32,
}

#[derive(Debug)]
struct QpSt {
    dev: usize,
    pd: u32,
    state: QpState,
    cap: QpCap,
    send_cq: u32,
    recv_cq: u32,
    access: Access,
    remote: Option<RemoteQp>,
    /// The source GID chosen at RTR (`sgid_index` into the port's table).
    sgid: Option<Gid>,
    /// What the QP was connected with (RTR and RTS), for tests.
    attrs: SimQpAttrs,
    min_rnr_timer: u64,
    timeout: u64,
    retry_cnt: u8,
    rnr_retry: u8,
    rq: VecDeque<(u64, Vec<Sge>)>,
    sq: VecDeque<Out>,
    inflight: VecDeque<Msg>,
    tx_scheduled: bool,
    retries: u32,
    rnr_retries: u32,
    next_out: u64,
}

#[derive(Debug, Default)]
struct CqSt {
    entries: VecDeque<WorkCompletion>,
    armed: bool,
    channel: Option<Arc<EventFd>>,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum EvKind {
    Tx {
        qpn: u32,
    },
    Ack {
        qpn: u32,
        out_id: u64,
        status: WcStatusOrd,
    },
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone, Copy)]
struct WcStatusOrd(u8);

const STATUSES: [WcStatus; 11] = [
    WcStatus::Success,
    WcStatus::LocalLengthError,
    WcStatus::LocalQpOperationError,
    WcStatus::LocalProtectionError,
    WcStatus::WrFlushError,
    WcStatus::RemoteInvalidRequest,
    WcStatus::RemoteAccessError,
    WcStatus::RemoteOperationError,
    WcStatus::RetryExceeded,
    WcStatus::RnrRetryExceeded,
    WcStatus::FatalError,
];

impl WcStatusOrd {
    fn of(s: WcStatus) -> Self {
        WcStatusOrd(STATUSES.iter().position(|x| *x == s).unwrap_or(0) as u8)
    }
    fn get(self) -> WcStatus {
        STATUSES[self.0 as usize]
    }
}

#[derive(Debug)]
struct St {
    now: u64,
    seq: u64,
    rng: u64,
    latency: u64,
    jitter: u64,
    events: BinaryHeap<Reverse<(u64, u64, EvKind)>>,
    devs: Vec<DevSt>,
    mrs: HashMap<u32, MrSt>,
    qps: HashMap<u32, QpSt>,
    cqs: HashMap<u32, CqSt>,
    next_id: u32,
    trace: Vec<String>,
    /// Devices' inline limit (see [`SimFabric::set_max_inline`]).
    max_inline: u32,
    /// What devices say of SENDs in flight (see [`SimFabric::set_max_sends`]).
    max_sends: Option<u32>,
    /// Largest memory region that can be registered (see
    /// [`SimFabric::set_max_mr_len`]).
    max_mr_len: usize,
}

impl St {
    fn rand(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn id(&mut self) -> u32 {
        self.next_id += 1;
        // mix in random bits so stale keys from other runs/devices never match
        (self.next_id << 8) | (self.rand() as u32 & 0xff)
    }
    fn lat(&mut self, dev_a: usize, dev_b: Option<usize>) -> u64 {
        let j = if self.jitter > 0 {
            self.rand() % (self.jitter + 1)
        } else {
            0
        };
        let extra =
            self.devs[dev_a].extra_delay + dev_b.map(|d| self.devs[d].extra_delay).unwrap_or(0);
        self.latency + j + extra
    }
    /// One-way latency on the path of QP `qpn` (both ends' injected delay count).
    fn path_lat(&mut self, qpn: u32) -> u64 {
        let Some(q) = self.qps.get(&qpn) else {
            return self.latency;
        };
        let (a, r) = (q.dev, q.remote);
        let b = r.and_then(|r| self.dev_by_gid(r.gid));
        self.lat(a, b)
    }
    fn schedule(&mut self, at: u64, kind: EvKind) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, kind)));
    }
    fn push_wc(&mut self, cq: u32, wc: WorkCompletion) {
        self.trace.push(format!("t={} cq={cq} {:?}", self.now, wc));
        if let Some(c) = self.cqs.get_mut(&cq) {
            c.entries.push_back(wc);
            if c.armed {
                c.armed = false;
                if let Some(ch) = &c.channel {
                    ch.signal();
                }
            }
        }
    }
    fn raise(&mut self, dev: usize, ev: AsyncEvent) {
        self.trace.push(format!("t={} dev={dev} {ev:?}", self.now));
        let d = &mut self.devs[dev];
        d.events.push_back(ev);
        d.efd.signal();
    }
    fn dev_by_gid(&self, gid: Gid) -> Option<usize> {
        self.devs
            .iter()
            .position(|d| d.gids.iter().any(|e| e.gid == gid))
    }

    /// Moves a QP to ERR, completing the failing WR with `failing.1` and
    /// flushing everything else.
    fn qp_error(&mut self, qpn: u32, failing: Option<(u64, WcStatus)>, event: bool) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if qp.state == QpState::Err {
            return;
        }
        qp.state = QpState::Err;
        qp.inflight.clear();
        qp.tx_scheduled = false;
        let (scq, rcq, dev) = (qp.send_cq, qp.recv_cq, qp.dev);
        let outs: Vec<Out> = qp.sq.drain(..).collect();
        let rqs: Vec<(u64, Vec<Sge>)> = qp.rq.drain(..).collect();
        for o in outs {
            let status = match (o.result, failing) {
                (Some(WcStatus::Success), _) => {
                    if !o.signaled {
                        continue;
                    }
                    WcStatus::Success
                }
                (_, Some((id, s))) if id == o.id => s,
                (Some(s), _) => s,
                (None, _) => WcStatus::WrFlushError,
            };
            self.push_wc(
                scq,
                WorkCompletion {
                    wr_id: o.wr_id,
                    status,
                    opcode: o.opcode,
                    byte_len: 0,
                    imm: None,
                    qp_num: qpn,
                },
            );
        }
        for (wr_id, _) in rqs {
            self.push_wc(
                rcq,
                WorkCompletion {
                    wr_id,
                    status: WcStatus::WrFlushError,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                    qp_num: qpn,
                },
            );
        }
        if event {
            self.raise(dev, AsyncEvent::QpFatal { qp_num: qpn });
        }
    }

    fn emit_done(&mut self, qpn: u32) {
        let mut out = vec![];
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        while qp.sq.front().is_some_and(|o| o.result.is_some()) {
            let o = qp.sq.pop_front().expect("front exists");
            let status = o.result.expect("checked");
            if o.signaled || status != WcStatus::Success {
                out.push(WorkCompletion {
                    wr_id: o.wr_id,
                    status,
                    opcode: o.opcode,
                    byte_len: o.len,
                    imm: None,
                    qp_num: qpn,
                });
            }
        }
        let cq = qp.send_cq;
        for wc in out {
            self.push_wc(cq, wc);
        }
    }

    fn read_local(&self, qp: &QpSt, sges: &[Sge]) -> Option<Vec<u8>> {
        let mut v = Vec::new();
        for s in sges {
            let mr = self.mrs.get(&s.lkey)?;
            if mr.dev != qp.dev || mr.pd != qp.pd {
                return None;
            }
            let off = s.addr.checked_sub(mr.addr)? as usize;
            check_range(off, s.length as usize, mr.len()).ok()?;
            v.extend_from_slice(&mr.bytes()[off..off + s.length as usize]);
        }
        Some(v)
    }

    fn tx(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        if qp.state != QpState::Rts || qp.inflight.is_empty() {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.tx_scheduled = false;
            }
            return;
        }
        let src_dev = qp.dev;
        let remote = qp.remote;
        // Find the responder; None = no answer at all.
        let sgid = qp.sgid;
        let dst: Option<u32> = remote.and_then(|r| {
            let d = self.dev_by_gid(r.gid)?;
            let dv = &self.devs[d];
            if !dv.port_up || dv.unresponsive || !self.devs[src_dev].port_up {
                return None;
            }
            let q = self.qps.get(&r.qp_num)?;
            // As rxe's `check_addr`: a responder takes a packet only when its
            // source address is the responder's destination GID and its
            // destination the responder's own source GID (the two ends
            // announced the GIDs they connect with).
            let addressed = q.sgid == Some(r.gid) && q.remote.map(|x| x.gid) == sgid;
            (q.dev == d && addressed && matches!(q.state, QpState::Rtr | QpState::Rts))
                .then_some(r.qp_num)
        });
        let outcome = match dst {
            None => Outcome::NoAnswer,
            Some(d) => self.deliver(qpn, d),
        };
        let now = self.now;
        let lat = self.path_lat(qpn);
        let qp = self.qps.get_mut(&qpn).expect("exists");
        match outcome {
            Outcome::Ok => {
                let m = qp.inflight.pop_front().expect("non-empty");
                qp.retries = 0;
                qp.rnr_retries = 0;
                let more = !qp.inflight.is_empty();
                if !more {
                    qp.tx_scheduled = false;
                }
                self.schedule(
                    now + lat,
                    EvKind::Ack {
                        qpn,
                        out_id: m.out_id,
                        status: WcStatusOrd::of(WcStatus::Success),
                    },
                );
                if more {
                    self.schedule(now, EvKind::Tx { qpn });
                }
            }
            Outcome::NoAnswer => {
                // (rxe: a retry count of 7 never runs out, see `set_rxe_retry`)
                let forever = qp.retry_cnt == 7 && self.devs[src_dev].rxe_retry;
                if !forever {
                    qp.retries += 1;
                }
                if qp.retries > qp.retry_cnt as u32 {
                    let id = qp.inflight.front().map(|m| m.out_id).unwrap_or(0);
                    self.qp_error(qpn, Some((id, WcStatus::RetryExceeded)), false);
                } else {
                    let t = qp.timeout;
                    self.schedule(now + t, EvKind::Tx { qpn });
                }
            }
            Outcome::Rnr => {
                qp.rnr_retries += 1;
                if qp.rnr_retry != 7 && qp.rnr_retries > qp.rnr_retry as u32 {
                    let id = qp.inflight.front().map(|m| m.out_id).unwrap_or(0);
                    self.qp_error(qpn, Some((id, WcStatus::RnrRetryExceeded)), false);
                } else {
                    let d = remote.map(|r| r.qp_num).unwrap_or(0);
                    let t = self.qps.get(&d).map(|q| q.min_rnr_timer).unwrap_or(0);
                    self.schedule(now + t + lat, EvKind::Tx { qpn });
                }
            }
            Outcome::Nak(s) => {
                let m = qp.inflight.pop_front().expect("non-empty");
                qp.inflight.clear();
                qp.tx_scheduled = false;
                self.schedule(
                    now + lat,
                    EvKind::Ack {
                        qpn,
                        out_id: m.out_id,
                        status: WcStatusOrd::of(s),
                    },
                );
            }
        }
    }

    fn ack(&mut self, qpn: u32, out_id: u64, status: WcStatus) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if qp.state == QpState::Err || qp.state == QpState::Reset {
            return;
        }
        if let Some(o) = qp.sq.iter_mut().find(|o| o.id == out_id) {
            if status == WcStatus::Success {
                o.result = Some(WcStatus::Success);
            } else {
                self.qp_error(qpn, Some((out_id, status)), false);
                return;
            }
        }
        self.emit_done(qpn);
    }

    fn step(&mut self, until: u64) -> bool {
        match self.events.peek() {
            Some(Reverse((t, _, _))) if *t <= until => {}
            _ => return false,
        }
        let Reverse((t, _, kind)) = self.events.pop().expect("peeked");
        self.now = self.now.max(t);
        match kind {
            EvKind::Tx { qpn } => self.tx(qpn),
            EvKind::Ack {
                qpn,
                out_id,
                status,
            } => self.ack(qpn, out_id, status.get()),
        }
        true
    }
}

enum Outcome {
    Ok,
    NoAnswer,
    Rnr,
    Nak(WcStatus),
}

impl St {
    /// Responder-side execution of the head message.
    fn deliver(&mut self, src: u32, dst: u32) -> Outcome {
        let m = &self.qps[&src].inflight[0];
        let (op, len) = (m.op, m.data.len());
        // (a WRITE of zero bytes touches no memory: its R_Key and address
        // are not checked, IBTA C9-88)
        if matches!(op, MsgOp::Write | MsgOp::WriteImm) && len > 0 {
            let (rkey, addr) = (m.rkey, m.remote_addr);
            let dq = &self.qps[&dst];
            let ok = dq.access.contains(Access::REMOTE_WRITE)
                && self.mrs.get(&rkey).is_some_and(|mr| {
                    mr.dev == dq.dev
                        && mr.pd == dq.pd
                        && mr.access.contains(Access::REMOTE_WRITE)
                        && addr
                            .checked_sub(mr.addr)
                            .is_some_and(|off| check_range(off as usize, len, mr.len()).is_ok())
                });
            if !ok {
                return Outcome::Nak(WcStatus::RemoteAccessError);
            }
        }
        if matches!(op, MsgOp::Send | MsgOp::WriteImm) && self.qps[&dst].rq.is_empty() {
            return Outcome::Rnr;
        }
        let m = &self.qps[&src].inflight[0];
        let (data, imm, addr, rkey) = (m.data.clone(), m.imm, m.remote_addr, m.rkey);
        if matches!(op, MsgOp::Write | MsgOp::WriteImm) && len > 0 {
            let mr = self.mrs.get_mut(&rkey).expect("checked");
            let off = (addr - mr.addr) as usize;
            mr.bytes()[off..off + len].copy_from_slice(&data);
        }
        if matches!(op, MsgOp::Send | MsgOp::WriteImm) {
            let dq = self.qps.get_mut(&dst).expect("exists");
            let (wr_id, sges) = dq.rq.pop_front().expect("checked");
            let rcq = dq.recv_cq;
            let ddev = dq.dev;
            let dpd = dq.pd;
            let mut status = WcStatus::Success;
            if op == MsgOp::Send {
                let cap: u64 = sges.iter().map(|s| s.length as u64).sum();
                if cap < len as u64 {
                    status = WcStatus::LocalLengthError;
                } else {
                    let mut rest = &data[..];
                    for s in &sges {
                        if rest.is_empty() {
                            break;
                        }
                        let n = rest.len().min(s.length as usize);
                        let ok = self.mrs.get_mut(&s.lkey).and_then(|mr| {
                            if mr.dev != ddev
                                || mr.pd != dpd
                                || !mr.access.contains(Access::LOCAL_WRITE)
                            {
                                return None;
                            }
                            let off = s.addr.checked_sub(mr.addr)? as usize;
                            check_range(off, n, mr.len()).ok()?;
                            mr.bytes()[off..off + n].copy_from_slice(&rest[..n]);
                            Some(())
                        });
                        if ok.is_none() {
                            status = WcStatus::LocalProtectionError;
                            break;
                        }
                        rest = &rest[n..];
                    }
                }
            }
            let opcode = if op == MsgOp::Send {
                WcOpcode::Recv
            } else {
                WcOpcode::RecvRdmaWithImm
            };
            if status != WcStatus::Success {
                // Responder error: its WR completes with the error and the responder QP fails.
                self.push_wc(
                    rcq,
                    WorkCompletion {
                        wr_id,
                        status,
                        opcode,
                        byte_len: 0,
                        imm: None,
                        qp_num: dst,
                    },
                );
                self.qp_error(dst, None, false);
                return Outcome::Nak(WcStatus::RemoteInvalidRequest);
            }
            self.push_wc(
                rcq,
                WorkCompletion {
                    wr_id,
                    status,
                    opcode,
                    byte_len: len as u32,
                    imm,
                    qp_num: dst,
                },
            );
        }
        Outcome::Ok
    }
}

/// The simulated fabric; also the [`Provider`] for its devices.
#[derive(Clone, Debug)]
pub struct SimFabric {
    st: Arc<Mutex<St>>,
}

impl SimFabric {
    /// A new empty fabric whose randomness derives from `seed`
    /// (default latency 2 µs, no jitter).
    pub fn new(seed: u64) -> SimFabric {
        SimFabric {
            st: Arc::new(Mutex::new(St {
                now: 0,
                seq: 0,
                rng: seed,
                latency: 2_000,
                jitter: 0,
                events: BinaryHeap::new(),
                devs: vec![],
                mrs: HashMap::new(),
                qps: HashMap::new(),
                cqs: HashMap::new(),
                next_id: 0,
                trace: vec![],
                max_inline: MAX_INLINE,
                max_sends: None,
                max_mr_len: usize::MAX,
            })),
        }
    }

    fn st(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a device with one active port; its GID is a link-local GID
    /// derived from a MAC generated from the seed, listed as RoCE v1 (index
    /// 0) and RoCE v2 (index 1). Returns the device name.
    pub fn add_device(&self, name: &str, netdev: Option<&str>) -> Result<String> {
        self.add_device_with_addrs(name, netdev, &[], true)
    }

    /// Adds a device whose port's GID table is built the way the kernel
    /// builds a RoCE port's from its network interface: the link-local GID
    /// from the MAC, then one GID per address of `addrs` (IPv4 ones
    /// IPv4-mapped, `::ffff:a.b.c.d`), each as a RoCE v1 entry (when
    /// `roce_v1`) followed by a RoCE v2 entry. rxe has no RoCE v1 GIDs
    /// (`roce_v1` false); mlx5 lists both. Returns the device name.
    pub fn add_device_with_addrs(
        &self,
        name: &str,
        netdev: Option<&str>,
        addrs: &[std::net::IpAddr],
        roce_v1: bool,
    ) -> Result<String> {
        let mut st = self.st();
        if st.devs.iter().any(|d| d.name == name) {
            return Err(Error::Config(format!("device {name} exists")));
        }
        let r = st.rand().to_be_bytes();
        let mac = [0x02, r[0], r[1], r[2], r[3], st.devs.len() as u8];
        let link_local = Gid::roce_v1_link_local(smc_wire::types::Mac(mac));
        let mut gids: Vec<GidEntry> = Vec::new();
        for g in std::iter::once(link_local).chain(addrs.iter().map(|&a| Gid::from_ip(a))) {
            let types: &[GidType] = if roce_v1 {
                &[GidType::RoceV1, GidType::RoceV2]
            } else {
                &[GidType::RoceV2]
            };
            for &t in types {
                gids.push(GidEntry {
                    index: gids.len() as u16,
                    gid: g,
                    gid_type: t,
                });
            }
        }
        st.devs.push(DevSt {
            name: name.into(),
            gid: link_local,
            gids,
            netdev: netdev.map(Into::into),
            port_up: true,
            unresponsive: false,
            paused: false,
            rxe_retry: false,
            extra_delay: 0,
            events: VecDeque::new(),
            efd: Arc::new(EventFd::new()?),
        });
        Ok(name.into())
    }

    fn dev_idx(&self, name: &str) -> Result<usize> {
        self.st()
            .devs
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| Error::NoSuchDevice(name.into()))
    }

    /// Current virtual time.
    pub fn now(&self) -> SimInstant {
        SimInstant(self.st().now)
    }

    /// Sets the devices' inline limit (default 256 bytes, an RNIC's order of
    /// magnitude). A large limit models the shm device, which takes inline
    /// payloads of any size: senders then write large data straight from the
    /// caller's buffer, a path a simulation should cover too. Set it before
    /// QPs are created.
    pub fn set_max_inline(&self, max_inline: u32) {
        self.st().max_inline = max_inline;
    }

    /// Sets what devices say of the SENDs a link may keep in flight
    /// (`DeviceInfo::max_sends`; default none, as an RNIC's): more models the
    /// shm device, whose peers post receives for them. Set it before QPs
    /// are created.
    pub fn set_max_sends(&self, max_sends: Option<u32>) {
        self.st().max_sends = max_sends;
    }

    /// Fault: memory regions larger than `len` bytes cannot be registered
    /// (as a device out of resources refuses them).
    pub fn set_max_mr_len(&self, len: usize) {
        self.st().max_mr_len = len;
    }

    /// Sets base one-way latency and uniform jitter (0..=jitter, seeded).
    pub fn set_latency(&self, base: Duration, jitter: Duration) {
        let mut st = self.st();
        st.latency = ns(base);
        st.jitter = ns(jitter);
    }

    /// Processes every event due within `dt` and moves the clock by `dt`.
    pub fn advance(&self, dt: Duration) {
        let mut st = self.st();
        let until = st.now.saturating_add(ns(dt));
        while st.step(until) {}
        st.now = until;
    }

    /// Processes events until none is left or `limit` of virtual time passed;
    /// returns true when idle.
    pub fn run_until_idle(&self, limit: Duration) -> bool {
        let mut st = self.st();
        let until = st.now.saturating_add(ns(limit));
        while st.step(until) {}
        st.events.is_empty()
    }

    /// Completion/event trace (for determinism checks).
    pub fn trace(&self) -> Vec<String> {
        self.st().trace.clone()
    }

    /// Fault: adds `extra` one-way delay to every message from or to `dev`.
    pub fn inject_delay(&self, dev: &str, extra: Duration) -> Result<()> {
        let i = self.dev_idx(dev)?;
        self.st().devs[i].extra_delay = ns(extra);
        Ok(())
    }

    /// The attributes QP `qp_num` was connected with (`None`: no such QP).
    pub fn qp_attrs(&self, qp_num: u32) -> Option<SimQpAttrs> {
        self.st().qps.get(&qp_num).map(|q| q.attrs)
    }

    /// Fault: moves a QP to ERR (flushing) and raises `QpFatal`.
    pub fn fail_qp(&self, qp_num: u32) {
        self.st().qp_error(qp_num, None, true);
    }

    /// Fault: port down (raises `PortError`, moves the device's QPs to ERR) or up
    /// (raises `PortActive`).
    pub fn set_port(&self, dev: &str, up: bool) -> Result<()> {
        let i = self.dev_idx(dev)?;
        let mut st = self.st();
        if st.devs[i].port_up == up {
            return Ok(());
        }
        st.devs[i].port_up = up;
        if up {
            st.raise(i, AsyncEvent::PortActive { port: 1 });
        } else {
            st.raise(i, AsyncEvent::PortError { port: 1 });
            let mut qps: Vec<u32> = st
                .qps
                .iter()
                .filter(|(_, q)| q.dev == i)
                .map(|(n, _)| *n)
                .collect();
            qps.sort();
            for q in qps {
                st.qp_error(q, None, false);
            }
        }
        Ok(())
    }

    /// Fault: port down or up as Soft-RoCE has it when its interface goes
    /// down (rxe_net.c `rxe_port_down`): `PortError` / `PortActive`, but the
    /// device's QPs stay as they are — nothing is flushed, and what they
    /// send is not answered while the port is down (their requesters retry,
    /// see [`Self::set_rxe_retry`]).
    pub fn set_port_keep_qps(&self, dev: &str, up: bool) -> Result<()> {
        let i = self.dev_idx(dev)?;
        let mut st = self.st();
        if st.devs[i].port_up == up {
            return Ok(());
        }
        st.devs[i].port_up = up;
        let ev = if up {
            AsyncEvent::PortActive { port: 1 }
        } else {
            AsyncEvent::PortError { port: 1 }
        };
        st.raise(i, ev);
        Ok(())
    }

    /// Requesters on `dev` retry unanswered requests forever when their
    /// transport retry count is 7, as Soft-RoCE does (rxe_comp.c,
    /// `COMPST_ERROR_RETRY`, decrements the count only when it is not 7, as
    /// for the RNR retry count): a send to a peer QP that vanished then never
    /// completes, instead of ending in `RetryExceeded` after 7 retries as on
    /// an RNIC.
    pub fn set_rxe_retry(&self, dev: &str, on: bool) -> Result<()> {
        let i = self.dev_idx(dev)?;
        self.st().devs[i].rxe_retry = on;
        Ok(())
    }

    /// Fault: the device stops answering (its QPs silently drop every request;
    /// requesters time out into `RetryExceeded`), or resumes.
    pub fn set_unresponsive(&self, dev: &str, on: bool) -> Result<()> {
        let i = self.dev_idx(dev)?;
        self.st().devs[i].unresponsive = on;
        Ok(())
    }

    /// The QPs connected to `dev`'s say that their peer is a stopped process
    /// (`QueuePair::peer_paused`), as the shm device tells of a peer that
    /// got `SIGSTOP`; with [`Self::set_unresponsive`] the peer then answers
    /// nothing meanwhile, as a stopped one.
    pub fn set_paused(&self, dev: &str, on: bool) -> Result<()> {
        let i = self.dev_idx(dev)?;
        self.st().devs[i].paused = on;
        Ok(())
    }
}

impl Provider for SimFabric {
    type Device = SimDevice;
    type Pd = SimPd;
    type Mr = SimMr;
    type Cq = SimCq;
    type Channel = SimChannel;
    type Qp = SimQp;

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let names: Vec<String> = self.st().devs.iter().map(|d| d.name.clone()).collect();
        names
            .iter()
            .map(|n| Ok(self.open_device(n)?.info()))
            .collect()
    }

    fn open_device(&self, name: &str) -> Result<SimDevice> {
        let dev = self.dev_idx(name)?;
        let efd = self.st().devs[dev].efd.clone();
        Ok(SimDevice {
            f: self.clone(),
            dev,
            efd,
        })
    }
}

/// An opened simulated device.
#[derive(Debug)]
pub struct SimDevice {
    f: SimFabric,
    dev: usize,
    efd: Arc<EventFd>,
}

impl SimDevice {
    /// The device's GID (index 0).
    pub fn gid(&self) -> Gid {
        self.f.st().devs[self.dev].gid
    }
    /// The fabric.
    pub fn fabric(&self) -> &SimFabric {
        &self.f
    }
}

impl Device for SimDevice {
    type P = SimFabric;

    fn info(&self) -> DeviceInfo {
        // (the fabric's lock once: a guard in the literal lives to its end)
        let (name, max_inline, max_sends) = {
            let st = self.f.st();
            (st.devs[self.dev].name.clone(), st.max_inline, st.max_sends)
        };
        DeviceInfo {
            name,
            ports: vec![self.query_port(1).expect("port 1 exists")],
            max_msg_size: MAX_MSG,
            max_inline,
            max_sends,
        }
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(Error::NoSuchPort(port));
        }
        let st = self.f.st();
        let d = &st.devs[self.dev];
        Ok(PortAttr {
            port_num: 1,
            state: if d.port_up {
                PortState::Active
            } else {
                PortState::Down
            },
            active_mtu: Mtu::Mtu1024,
            gids: d.gids.clone(),
            netdev: d.netdev.clone(),
        })
    }

    fn alloc_pd(&self) -> Result<SimPd> {
        let pd = self.f.st().id();
        Ok(SimPd {
            f: self.f.clone(),
            dev: self.dev,
            pd,
        })
    }

    fn create_channel(&self) -> Result<SimChannel> {
        Ok(SimChannel {
            efd: Arc::new(EventFd::new()?),
            dev: self.dev,
        })
    }

    fn create_cq(&self, _depth: u32, channel: Option<&SimChannel>) -> Result<SimCq> {
        // As verbs: a completion channel belongs to the device (context)
        // that created it, and `ibv_create_cq` with another device's
        // channel fails (the kernel's uverbs looks the channel's descriptor
        // up among the context's own objects, EBADF otherwise).
        if channel.is_some_and(|c| c.dev != self.dev) {
            return Err(Error::InvalidArgument(
                "a CQ's completion channel must be of the CQ's own device".into(),
            ));
        }
        let mut st = self.f.st();
        let id = st.id();
        st.cqs.insert(
            id,
            CqSt {
                channel: channel.map(|c| c.efd.clone()),
                ..Default::default()
            },
        );
        Ok(SimCq {
            f: self.f.clone(),
            id,
        })
    }

    fn poll_async_event(&self) -> Option<AsyncEvent> {
        let mut st = self.f.st();
        let d = &mut st.devs[self.dev];
        let e = d.events.pop_front();
        if d.events.is_empty() {
            d.efd.drain();
        }
        e
    }

    fn async_fd(&self) -> BorrowedFd<'_> {
        self.efd.as_fd()
    }
}

/// A simulated protection domain.
#[derive(Debug)]
pub struct SimPd {
    f: SimFabric,
    dev: usize,
    pd: u32,
}

impl ProtectionDomain for SimPd {
    type P = SimFabric;

    fn alloc_mr(&self, len: usize, access: Access) -> Result<SimMr> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length memory region".into()));
        }
        let mut st = self.f.st();
        if len > st.max_mr_len {
            return Err(Error::InvalidArgument(format!(
                "memory region of {len} bytes: the device registers at most {}",
                st.max_mr_len
            )));
        }
        let key = st.id();
        let addr = 0x7f00_0000_0000u64 + ((key as u64) << 24);
        st.mrs.insert(
            key,
            MrSt {
                dev: self.dev,
                pd: self.pd,
                data: Arc::new(Mutex::new(vec![0; len])),
                addr,
                access,
            },
        );
        Ok(SimMr {
            f: self.f.clone(),
            key,
            addr,
            len,
            access,
        })
    }

    /// A new key and address (on this PD's device) for the same bytes.
    fn share_mr(&self, mr: &SimMr, access: Access) -> Result<SimMr> {
        let mut st = self.f.st();
        let data = st
            .mrs
            .get(&mr.key)
            .ok_or_else(|| Error::InvalidArgument("memory region deregistered".into()))?
            .data
            .clone();
        let key = st.id();
        let addr = 0x7f00_0000_0000u64 + ((key as u64) << 24);
        st.mrs.insert(
            key,
            MrSt {
                dev: self.dev,
                pd: self.pd,
                data,
                addr,
                access,
            },
        );
        Ok(SimMr {
            f: self.f.clone(),
            key,
            addr,
            len: mr.len,
            access,
        })
    }

    fn create_qp(&self, send_cq: &SimCq, recv_cq: &SimCq, cap: QpCap) -> Result<SimQp> {
        let mut st = self.f.st();
        if cap.max_inline_data > st.max_inline {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data > {}",
                st.max_inline
            )));
        }
        let qpn = st.id() & 0x00ff_ffff;
        st.qps.insert(
            qpn,
            QpSt {
                dev: self.dev,
                pd: self.pd,
                state: QpState::Reset,
                cap,
                send_cq: send_cq.id,
                recv_cq: recv_cq.id,
                access: Access::NONE,
                remote: None,
                sgid: None,
                attrs: SimQpAttrs::default(),
                min_rnr_timer: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                rq: VecDeque::new(),
                sq: VecDeque::new(),
                inflight: VecDeque::new(),
                tx_scheduled: false,
                retries: 0,
                rnr_retries: 0,
                next_out: 0,
            },
        );
        Ok(SimQp {
            f: self.f.clone(),
            qpn,
        })
    }
}

/// A simulated memory region (the bytes live in the fabric).
#[derive(Debug)]
pub struct SimMr {
    f: SimFabric,
    key: u32,
    addr: u64,
    len: usize,
    access: Access,
}

impl MemoryRegion for SimMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn access(&self) -> Access {
        self.access
    }
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        check_range(off, buf.len(), self.len)?;
        let st = self.f.st();
        buf.copy_from_slice(&st.mrs[&self.key].bytes()[off..off + buf.len()]);
        Ok(())
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.len)?;
        let mut st = self.f.st();
        st.mrs.get_mut(&self.key).expect("registered").bytes()[off..off + data.len()]
            .copy_from_slice(data);
        Ok(())
    }
    fn window(&self) -> Option<MemWindow> {
        let m = SimMapped {
            f: self.f.clone(),
            key: self.key,
            remote: false,
        };
        Some(MemWindow::new(Arc::new(m), 0, self.len))
    }
}

/// A region of the fabric seen through a [`MemWindow`]: copies reach its
/// bytes at once, with no latency and no fault (as the shm device's do).
struct SimMapped {
    f: SimFabric,
    key: u32,
    /// A peer's region: each copy checks that it is still open to remote
    /// writes, as a delivered WRITE does.
    remote: bool,
}

impl MappedMem for SimMapped {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        let st = self.f.st();
        let mr = st
            .mrs
            .get(&self.key)
            .ok_or_else(|| Error::InvalidArgument("memory region deregistered".into()))?;
        check_range(off, buf.len(), mr.len())?;
        buf.copy_from_slice(&mr.bytes()[off..off + buf.len()]);
        Ok(())
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        let mut st = self.f.st();
        let mr = st
            .mrs
            .get_mut(&self.key)
            .ok_or_else(|| Error::InvalidArgument("memory region deregistered".into()))?;
        if self.remote && !mr.access.contains(Access::REMOTE_WRITE) {
            return Err(Error::InvalidArgument("no remote write access".into()));
        }
        check_range(off, data.len(), mr.len())?;
        mr.bytes()[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
}

impl Drop for SimMr {
    fn drop(&mut self) {
        self.f.st().mrs.remove(&self.key);
    }
}

/// A simulated completion queue.
#[derive(Debug)]
pub struct SimCq {
    f: SimFabric,
    id: u32,
}

impl CompletionQueue for SimCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut st = self.f.st();
        let cq = st.cqs.get_mut(&self.id).expect("cq exists");
        let mut n = 0;
        while n < out.len() {
            match cq.entries.pop_front() {
                Some(wc) => {
                    out[n] = wc;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }
    fn req_notify(&self) -> Result<()> {
        self.f.st().cqs.get_mut(&self.id).expect("cq exists").armed = true;
        Ok(())
    }
    /// Exact: the fabric puts every completion (flushes of a failed QP
    /// included) into the queue when virtual time delivers it, so an empty
    /// queue has nothing for a poll. (Answering `true`, as providers without
    /// a cheap look do, would hide from the simulation the engine's skipping
    /// of quiet link groups, `Endpoint::pump`.)
    fn may_have_work(&self) -> bool {
        self.f
            .st()
            .cqs
            .get(&self.id)
            .is_some_and(|cq| !cq.entries.is_empty())
    }
}

impl Drop for SimCq {
    fn drop(&mut self) {
        self.f.st().cqs.remove(&self.id);
    }
}

/// A simulated completion channel (a real eventfd signalled when virtual
/// time delivers a completion to an armed CQ). `wait` blocks in real time,
/// so with a single-threaded test it only returns already pending events.
#[derive(Debug)]
pub struct SimChannel {
    efd: Arc<EventFd>,
    /// The device that created it (see `create_cq`).
    dev: usize,
}

impl CompletionChannel for SimChannel {
    fn fd(&self) -> BorrowedFd<'_> {
        self.efd.as_fd()
    }
    fn try_get_event(&self) -> Result<bool> {
        Ok(self.efd.drain())
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        Ok(self.efd.wait(timeout)?)
    }
}

/// A simulated RC queue pair.
#[derive(Debug)]
pub struct SimQp {
    f: SimFabric,
    qpn: u32,
}

impl QueuePair for SimQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// Exact, as `SimCq::may_have_work`: a receive is taken only from the
    /// receive CQ, which the fabric fills when virtual time delivers it.
    fn recv_may_have(&self) -> bool {
        let st = self.f.st();
        st.qps
            .get(&self.qpn)
            .and_then(|q| st.cqs.get(&q.recv_cq))
            .is_some_and(|cq| !cq.entries.is_empty())
    }

    fn state(&self) -> QpState {
        self.f
            .st()
            .qps
            .get(&self.qpn)
            .map(|q| q.state)
            .unwrap_or(QpState::Err)
    }

    fn modify(&self, m: &QpModify) -> Result<()> {
        let mut guard = self.f.st();
        let st = &mut *guard;
        let qp = st.qps.get_mut(&self.qpn).expect("qp exists");
        let next = qp.state.next(m.kind())?;
        match *m {
            QpModify::Init { port, access } => {
                if port != 1 {
                    return Err(Error::NoSuchPort(port));
                }
                qp.access = access;
            }
            QpModify::Rtr {
                remote,
                sgid_index,
                path_mtu,
                min_rnr_timer,
                ..
            } => {
                if path_mtu > Mtu::Mtu1024 {
                    return Err(Error::InvalidArgument(format!(
                        "path MTU {path_mtu:?} exceeds the port's active MTU Mtu1024"
                    )));
                }
                let Some(sgid) = st.devs[qp.dev]
                    .gids
                    .get(usize::from(sgid_index))
                    .map(|e| e.gid)
                else {
                    return Err(Error::InvalidArgument(format!("no GID index {sgid_index}")));
                };
                qp.sgid = Some(sgid);
                qp.remote = Some(remote);
                qp.attrs.sgid_index = sgid_index;
                qp.attrs.path_mtu = Some(path_mtu);
                qp.attrs.min_rnr_timer = min_rnr_timer;
                qp.min_rnr_timer = ns(min_rnr_timer);
            }
            QpModify::Rts {
                timeout,
                retry_cnt,
                rnr_retry,
                ..
            } => {
                if retry_cnt > 7 || rnr_retry > 7 {
                    return Err(Error::InvalidArgument("retry counts are 0..=7".into()));
                }
                qp.timeout = ns(timeout);
                qp.retry_cnt = retry_cnt;
                qp.rnr_retry = rnr_retry;
                qp.attrs.timeout = timeout;
                qp.attrs.retry_cnt = retry_cnt;
                qp.attrs.rnr_retry = rnr_retry;
            }
            QpModify::Err => {
                st.qp_error(self.qpn, None, false);
                return Ok(());
            }
            QpModify::Reset => {
                qp.rq.clear();
                qp.sq.clear();
                qp.inflight.clear();
                qp.tx_scheduled = false;
                qp.remote = None;
                qp.sgid = None;
            }
        }
        qp.state = next;
        Ok(())
    }

    /// What a WRITE delivered now would reach, with the responder's checks
    /// (`St::deliver`) made now; the path's state (ports, latency, faults) is
    /// not consulted, as the copy does not travel.
    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        let st = self.f.st();
        let qp = st.qps.get(&self.qpn)?;
        if qp.state != QpState::Rts {
            return None;
        }
        let dq = st.qps.get(&qp.remote?.qp_num)?;
        let mr = st.mrs.get(&rkey)?;
        let off = addr.checked_sub(mr.addr)? as usize;
        let ok = dq.access.contains(Access::REMOTE_WRITE)
            && mr.dev == dq.dev
            && mr.pd == dq.pd
            && mr.access.contains(Access::REMOTE_WRITE)
            && check_range(off, len, mr.len()).is_ok();
        let m = SimMapped {
            f: self.f.clone(),
            key: rkey,
            remote: true,
        };
        ok.then(|| MemWindow::new(Arc::new(m), off, len))
    }

    /// Nothing to acquire in the simulation; checks that a WRITE of `len`
    /// bytes at `rkey`/`addr` would be accepted by the responder now, as the
    /// shm device does when it maps the region.
    fn peer_paused(&self) -> bool {
        let st = self.f.st();
        st.qps
            .get(&self.qpn)
            .and_then(|qp| qp.remote)
            .and_then(|r| st.qps.get(&r.qp_num))
            .is_some_and(|peer| st.devs[peer.dev].paused)
    }

    fn prepare_remote(&self, rkey: u32, addr: u64, len: usize) -> Result<()> {
        let st = self.f.st();
        let qp = st
            .qps
            .get(&self.qpn)
            .ok_or_else(|| Error::InvalidArgument("no such QP".into()))?;
        if !matches!(qp.state, QpState::Rtr | QpState::Rts) {
            return Err(Error::InvalidState {
                op: "prepare_remote",
                state: qp.state,
            });
        }
        let dq = qp
            .remote
            .and_then(|r| st.qps.get(&r.qp_num))
            .ok_or_else(|| Error::Connect("the peer QP is gone".into()))?;
        let ok = st.mrs.get(&rkey).is_some_and(|mr| {
            dq.access.contains(Access::REMOTE_WRITE)
                && mr.dev == dq.dev
                && mr.pd == dq.pd
                && mr.access.contains(Access::REMOTE_WRITE)
                && addr
                    .checked_sub(mr.addr)
                    .is_some_and(|off| check_range(off as usize, len, mr.len()).is_ok())
        });
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are not writable in the peer's region {rkey:#x}"
            )));
        }
        Ok(())
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let mut st = self.f.st();
        let qp = st.qps.get(&self.qpn).expect("qp exists");
        if qp.state != QpState::Rts {
            return Err(Error::InvalidState {
                op: "post_send",
                state: qp.state,
            });
        }
        validate_send(wr, &qp.cap, MAX_MSG)?;
        if qp.sq.len() >= qp.cap.max_send_wr as usize {
            return Err(Error::QueueFull);
        }
        let data = match wr.payload {
            Payload::Inline(d) => Some(d.to_vec()),
            Payload::Sges(s) => st.read_local(qp, s),
        };
        let (op, imm, remote_addr, rkey, opcode) = match wr.op {
            SendOp::Send => (MsgOp::Send, None, 0, 0, WcOpcode::Send),
            SendOp::SendWithImm(i) => (MsgOp::Send, Some(i), 0, 0, WcOpcode::Send),
            SendOp::RdmaWrite { remote_addr, rkey } => {
                (MsgOp::Write, None, remote_addr, rkey, WcOpcode::RdmaWrite)
            }
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => (
                MsgOp::WriteImm,
                Some(imm),
                remote_addr,
                rkey,
                WcOpcode::RdmaWrite,
            ),
        };
        let qp = st.qps.get_mut(&self.qpn).expect("qp exists");
        qp.next_out += 1;
        let id = qp.next_out;
        qp.sq.push_back(Out {
            id,
            wr_id: wr.wr_id,
            opcode,
            signaled: wr.signaled,
            len: wr.payload.len() as u32,
            result: None,
        });
        let Some(data) = data else {
            st.qp_error(self.qpn, Some((id, WcStatus::LocalProtectionError)), false);
            return Ok(());
        };
        qp.inflight.push_back(Msg {
            out_id: id,
            op,
            data,
            imm,
            remote_addr,
            rkey,
        });
        if !qp.tx_scheduled {
            qp.tx_scheduled = true;
            let at = st.now + st.path_lat(self.qpn);
            st.schedule(at, EvKind::Tx { qpn: self.qpn });
        }
        Ok(())
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let mut st = self.f.st();
        let qp = st.qps.get_mut(&self.qpn).expect("qp exists");
        if !qp.state.can_post_recv() {
            return Err(Error::InvalidState {
                op: "post_recv",
                state: qp.state,
            });
        }
        if qp.rq.len() >= qp.cap.max_recv_wr as usize {
            return Err(Error::QueueFull);
        }
        if qp.state == QpState::Err {
            let cq = qp.recv_cq;
            st.push_wc(
                cq,
                WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushError,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm: None,
                    qp_num: self.qpn,
                },
            );
            return Ok(());
        }
        qp.rq.push_back((wr.wr_id, wr.sges.to_vec()));
        Ok(())
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        self.f.st().qps.remove(&self.qpn);
    }
}
