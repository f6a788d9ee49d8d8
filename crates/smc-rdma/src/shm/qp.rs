//! Queue pairs: the QP's state as the data path (`Core`), the device thread
//! (`Ctl`, `Heartbeat`) and the rendezvous (`OutLink`, `Inbound`) see it,
//! pending work requests, and [`ShmQp`], the verbs [`QueuePair`]: state
//! transitions (`modify`, the documented table in `verbs.rs`), posting sends
//! and receives. The QP's behaviour is spread by concern:
//!
//! * `qp_rendezvous.rs` — finding and authenticating the peer QP (RTR, RTS);
//! * `qp_region.rs` — handing our regions to the peer and mapping its;
//! * `qp_fail.rs` — moving to ERR, flushing, letting go of the link;
//! * `qp_progress.rs` — executing SENDs and WRITEs into the peer's ring and
//!   regions, taking received slots into posted receives.
//!
//! Semantics are those of an InfiniBand RC QP: WRs of a QP complete in
//! order, an RDMA WRITE lands before a later SEND is seen (RC ordering),
//! RNR retries follow `rnr_retry` (7 = forever).

use super::cq::CqInner;
use super::device::{port_attr, DevShared};
use super::mr::{new_ring, PeerMr, RemoteMem};
use super::netdev::gid_table;
use super::{lock, KeyMap};

use super::layout::*;
use super::qp_progress::PayloadView;
use super::wire::Msg;
use crate::sys::{EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wire;

pub(super) enum OwnedPayload {
    Inline(Vec<u8>),
    /// An inline payload of up to [`SMALL`] bytes (a CDC, an LLC message)
    /// without a heap allocation.
    Small([u8; SMALL], u8),
    /// Local memory (one SGE without a heap allocation).
    Sges(Sges),
    /// Published at post already (`QpInner::publish_at_post`): nothing
    /// left to gather.
    Sent,
}

impl OwnedPayload {
    pub(super) fn view(&self) -> PayloadView<'_> {
        match self {
            OwnedPayload::Inline(d) => PayloadView::Bytes(d),
            OwnedPayload::Small(b, n) => PayloadView::Bytes(&b[..usize::from(*n)]),
            OwnedPayload::Sges(s) => PayloadView::Sges(s.as_slice()),
            OwnedPayload::Sent => PayloadView::Bytes(&[]),
        }
    }
}

/// Inline payloads up to this size are kept in the WR itself.
const SMALL: usize = 64;

/// A posted receive: its WR id, its scatter list, and the list's length in
/// bytes (summed at post, not at every message that lands in it).
pub(super) struct PostedRecv {
    pub(super) wr_id: u64,
    pub(super) sges: Sges,
    pub(super) cap: u64,
}

impl PostedRecv {
    fn new(wr_id: u64, sges: &[Sge]) -> PostedRecv {
        PostedRecv {
            wr_id,
            sges: Sges::new(sges),
            cap: sges.iter().map(|s| s.length as u64).sum(),
        }
    }
}

/// A WR's scatter/gather list, the common single SGE without allocation.
pub(super) enum Sges {
    One([Sge; 1]),
    Many(Vec<Sge>),
}

impl Sges {
    pub(super) fn new(s: &[Sge]) -> Sges {
        match s {
            [one] => Sges::One([*one]),
            s => Sges::Many(s.to_vec()),
        }
    }

    pub(super) fn as_slice(&self) -> &[Sge] {
        match self {
            Sges::One(s) => s,
            Sges::Many(v) => v,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum Stage {
    Queued,
    Published {
        seq: u64,
        rnr_since: Option<Instant>,
    },
    Done(WcStatus),
}

pub(super) struct Pending {
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    pub(super) payload: OwnedPayload,
    pub(super) signaled: bool,
    pub(super) len: u32,
    pub(super) stage: Stage,
    /// The peer region whose doorbell this SEND rings once published
    /// (`QueuePair::post_send_ringing`).
    pub(super) bell: Option<u32>,
}

/// The data path's view of the verified peer: its ring and channels.
pub(super) struct Link {
    pub(super) peer_ring: Arc<SharedMem>,
    pub(super) peer_rx_efd: Option<Arc<EventFd>>,
    pub(super) peer_tx_efd: Option<Arc<EventFd>>,
    /// Our producer index in the peer's ring (kept here, not read back from
    /// the ring the peer can write).
    pub(super) tail: u64,
    /// The peer's consumer index (`R_HEAD` of its ring) when last read: the
    /// ring has at least the room it shows (the peer's index only grows),
    /// so a post reads the peer's word, a cache line the peer writes with
    /// every message it takes, only when this shows the ring full.
    pub(super) peer_head: u64,
}

impl Link {
    /// Whether the peer's ring has a free slot for our next SEND.
    pub(super) fn ring_room(&mut self) -> bool {
        if self.tail.wrapping_sub(self.peer_head) < NSLOTS {
            return true;
        }
        self.peer_head = Ring(&self.peer_ring).h(R_HEAD).load(Acquire);
        self.tail.wrapping_sub(self.peer_head) < NSLOTS
    }
}

pub(super) struct Core {
    pub(super) state: QpState,
    pub(super) access: Access,
    pub(super) ring: Arc<SharedMem>,
    /// The ring's memfd until it is handed to the peer (at RTR).
    pub(super) ring_fd: Option<OwnedFd>,
    /// Our consumer index in our ring (kept here, not read back from the
    /// ring the peer can write).
    pub(super) head: u64,
    pub(super) rq_psn: u32,
    pub(super) sq_psn: u32,
    pub(super) timeout: Duration,
    retry_cnt: u8,
    pub(super) rnr_retry: u8,
    min_rnr_timer: Duration,
    pub(super) rq: VecDeque<PostedRecv>,
    pub(super) sq: VecDeque<Pending>,
    pub(super) link: Option<Link>,
    pub(super) recv_posted: u64,
    /// The peer's ring head (how far it consumed our SENDs) when the send
    /// queue last looked at acknowledgements (see `may_have_work`).
    pub(super) seen_peer_head: u64,
    /// The peer region the last WRITE or doorbell named, with
    /// [`QpInner::remote_gen`] when it was looked up: the next post to the
    /// same region (a connection's WRITE and its CDC name the same RMB)
    /// takes it from here, without the lock and lookup of `remote`
    /// (`QpInner::peer_region_in`).
    pub(super) last_remote: Option<(u64, Arc<PeerMr>)>,
    /// A WR of the send queue failed (a NAK, RNR retries exhausted, a bad
    /// gather): nothing is published at post any more
    /// (`QpInner::publishes_at_post`); the QP fails once that WR is at the
    /// front of the queue.
    pub(super) stalled: bool,
}

impl Core {
    pub(super) fn new(ring: Arc<SharedMem>, ring_fd: Option<OwnedFd>) -> Core {
        Core {
            state: QpState::Reset,
            access: Access::NONE,
            ring,
            ring_fd,
            head: 0,
            rq_psn: 0,
            sq_psn: 0,
            timeout: Duration::from_millis(100),
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: Duration::from_millis(1),
            rq: VecDeque::new(),
            sq: VecDeque::new(),
            link: None,
            recv_posted: 0,
            seen_peer_head: 0,
            last_remote: None,
            stalled: false,
        }
    }
}

/// The connection a QP dialed (its peer's inbound one): hello and auth go
/// out on it, region requests and their answers.
pub(super) struct OutLink {
    pub(super) sock: Arc<SeqPacket>,
    pub(super) nonce: u64,
    /// Serializes requests; the request id counter.
    pub(super) req: Mutex<u32>,
}

/// A connection a peer dialed to one of our QPs, with its hello.
pub(super) struct Inbound {
    pub(super) id: u64,
    pub(super) sock: Arc<SeqPacket>,
    pub(super) hello: Msg,
    /// The ring and eventfds of the hello, until it is verified.
    pub(super) fds: Vec<OwnedFd>,
    /// The auth proof, once it arrived.
    pub(super) auth: Option<u64>,
    /// The auth proof was checked: regions may be handed out.
    pub(super) authed: bool,
    /// Region requests (id, rkey, flags) that arrived before `authed`.
    pub(super) deferred: VecDeque<(u32, u32, u32)>,
}

/// Rendezvous state of a QP. Taken only briefly (never across a blocking
/// call), by the device thread, by `modify` and by a data path that holds
/// `core` (lock order: `core`, then `ctl`).
#[derive(Default)]
pub(super) struct Ctl {
    /// Hellos are taken (the QP is in INIT, RTR or RTS).
    pub(super) accepting: bool,
    /// The access rights granted through the QP (INIT).
    pub(super) access: Access,
    pub(super) remote: Option<RemoteQp>,
    pub(super) sgid: Gid,
    pub(super) rq_psn: Option<u32>,
    pub(super) sq_psn: Option<u32>,
    pub(super) rtr_at: Option<Instant>,
    pub(super) out: Option<Arc<OutLink>>,
    /// Hellos not verified yet.
    pub(super) cands: Vec<Inbound>,
    pub(super) next_id: u64,
    pub(super) bad_hellos: u32,
    /// The verified inbound connection.
    pub(super) inb: Option<Inbound>,
    /// A verified link the data path has not taken into `core` yet.
    pub(super) ready: Option<Link>,
}

impl Ctl {
    pub(super) fn clear_links(&mut self) {
        self.accepting = false;
        self.out = None;
        self.cands.clear();
        self.inb = None;
        self.ready = None;
        self.rtr_at = None;
    }
}

pub(super) struct QpInner {
    pub(super) dev: Arc<DevShared>,
    pub(super) qpn: u32,
    pub(super) pd: u32,
    pub(super) cap: QpCap,
    pub(super) send_cq: Arc<CqInner>,
    pub(super) recv_cq: Arc<CqInner>,
    pub(super) core: Mutex<Core>,
    /// The device thread's view of the link, kept apart from `core`: the
    /// application's threads take `core` for every post and poll, and a busy
    /// QP would otherwise starve the heartbeat (seen: two threads pumping one
    /// QP kept `core` taken for over a second, and the peer declared us dead).
    pub(super) hb: Mutex<Option<Heartbeat>>,
    /// The QP is in RTR or RTS (heartbeats are checked only then).
    pub(super) live: AtomicBool,
    pub(super) ctl: Mutex<Ctl>,
    /// The peer's regions mapped for this QP, by rkey. They go with the link
    /// (ERR, RESET, destruction), and when the peer deregisters them.
    pub(super) remote: Mutex<KeyMap<u32, Arc<PeerMr>>>,
    /// Changes of `remote` so far (each one with its lock held): a region
    /// remembered in `Core::last_remote` under an older count is looked up
    /// again.
    pub(super) remote_gen: AtomicU64,
    /// The device thread wanted to fail the QP while `core` was busy.
    pub(super) fail_pending: AtomicBool,
    pub(super) fail_what: Mutex<(Option<WcStatus>, bool)>,
    /// A SEND found a peer region's doorbell armed for a poller without
    /// the region's eventfd here (`PeerMr::efd_want`): the next ringing post
    /// looks whether its region is to be fetched again for it (so that the
    /// others need not look).
    pub(super) bell_fd_wanted: AtomicBool,
    /// The receive ring the QP was made with, for looks without `core`'s
    /// lock (`recv_may_have`); `core` holds it too, until a RESET replaces
    /// it ([`Self::ring_replaced`]).
    pub(super) ring: Arc<SharedMem>,
    /// A RESET gave the QP another ring: looks without the lock say
    /// "maybe" from then on.
    pub(super) ring_replaced: AtomicBool,
    /// `core`'s consumer index in the ring, published by the QP's lock
    /// holders once the completions of the slots they consumed are in the
    /// receive CQ (see `recv_may_have`).
    pub(super) head_seen: AtomicU64,
}

/// Heartbeat state of a connected QP (device thread only).
pub(super) struct Heartbeat {
    pub(super) own_ring: Arc<SharedMem>,
    pub(super) peer_ring: Arc<SharedMem>,
    pub(super) last_hb: u64,
    pub(super) last_hb_change: Instant,
    /// The peer's process was stopped when its silence was last looked at
    /// (`device_thread::tick`).
    pub(super) seen_stopped: bool,
}

pub(super) fn wc(
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
    qp_num: u32,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm,
        qp_num,
    }
}

pub(super) fn send_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
        _ => WcOpcode::RdmaWrite,
    }
}

/// Why a peer region could not be had.
pub(super) struct FetchError {
    pub(super) status: WcStatus,
    pub(super) why: String,
    /// This process lacked a resource (a descriptor, address space).
    pub(super) local: bool,
}

impl FetchError {
    pub(super) fn remote(status: WcStatus, why: impl Into<String>) -> FetchError {
        FetchError {
            status,
            why: why.into(),
            local: false,
        }
    }
    fn into_error(self) -> Error {
        if self.local {
            Error::Io(std::io::Error::other(self.why))
        } else {
            Error::Connect(self.why)
        }
    }
}

pub(super) fn is_local_shortage(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOMEM)
    ) || e.kind() == std::io::ErrorKind::Other
}

/// An RC queue pair of an `shm` device; destroyed on drop.
pub struct ShmQp {
    pub(super) inner: Arc<QpInner>,
}

impl ShmQp {
    /// Test hook for the threat-model tests: asks the peer for its region
    /// `rkey` over this QP's link as a WRITE would, but without the writer's
    /// own checks (what a hostile peer running its own code would do), and
    /// says whether the peer handed it out. Nothing is kept.
    #[doc(hidden)]
    pub fn peer_hands_out(&self, rkey: u32) -> bool {
        self.inner.fetch_region(rkey).is_ok()
    }

    /// Test hook for the threat-model tests: what the peer hands out for its
    /// region `rkey` over this QP's link, as a hostile peer's own code would
    /// keep it — the memfd the region lives in, and the region's offset and
    /// length in it — or `None` if it refuses.
    #[doc(hidden)]
    pub fn peer_region_memfd(&self, rkey: u32) -> Option<(OwnedFd, u64, usize)> {
        let (m, fd, _) = self.inner.ask_region(rkey, 0).ok()?;
        Some((fd, m.z, m.y as usize))
    }
}

impl ShmQp {
    /// Posts a send WR, ringing the peer's doorbell `bell` once a SEND is
    /// published (see `QpInner::progress_send`).
    fn post(&self, wr: &SendWr<'_>, bell: Option<u32>) -> Result<()> {
        let q = &self.inner;
        if let Some(k) = bell {
            q.fetch_bell_fd(k);
        }

        let mut c = lock(&q.core);
        if q.fail_pending.load(Relaxed) {
            let (first, event) = *lock(&q.fail_what);
            q.fail_locked(&mut c, first, event);
        }
        if c.state != QpState::Rts {
            return Err(Error::InvalidState {
                op: "post_send",
                state: c.state,
            });
        }
        validate_send(wr, &q.cap, SLOT_PAYLOAD as u32)?;
        q.adopt_ready(&mut c);
        if c.sq.len() >= q.cap.max_send_wr as usize {
            q.progress_locked(&mut c);
            if c.sq.len() >= q.cap.max_send_wr as usize {
                return Err(Error::QueueFull);
            }
        }
        if let (SendOp::RdmaWrite { remote_addr, rkey }, Payload::Inline(d)) = (wr.op, wr.payload) {
            if q.executes_at_post(&c, wr.signaled) {
                if let Ok((m, off)) =
                    q.check_remote_in(&mut c.last_remote, rkey, remote_addr, d.len())
                {
                    if m.mem.write(off, d).is_ok() {
                        if wr.signaled {
                            q.send_cq.push(wc(
                                wr.wr_id,
                                WcStatus::Success,
                                WcOpcode::RdmaWrite,
                                d.len() as u32,
                                None,
                                q.qpn,
                            ));
                        }
                        return Ok(());
                    }
                }
                // anything wrong: queue it, progress reports the error in order
            }
        }
        if matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)) {
            // (the acknowledgements of earlier SENDs, their completions:
            // first, so that the slot this one takes has none left unseen,
            // as a rule)
            q.ack_front(&mut c);
            if q.publishes_at_post(&mut c) {
                if let Ok(p) = q.publish_at_post(&mut c, wr, bell) {
                    c.sq.push_back(p);
                    return Ok(());
                }
                // (its payload could not be gathered: queued, it fails in order)
            }
        }
        let payload = match wr.payload {
            Payload::Inline(d) if d.len() <= SMALL => {
                let mut b = [0u8; SMALL];
                b[..d.len()].copy_from_slice(d);
                OwnedPayload::Small(b, d.len() as u8)
            }
            Payload::Inline(d) => OwnedPayload::Inline(d.to_vec()),
            Payload::Sges(s) => OwnedPayload::Sges(Sges::new(s)),
        };
        c.sq.push_back(Pending {
            wr_id: wr.wr_id,
            op: wr.op,
            payload,
            signaled: wr.signaled,
            len: wr.payload.len() as u32,
            stage: Stage::Queued,
            bell: bell.filter(|_| matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_))),
        });
        q.progress_send(&mut c);
        Ok(())
    }
}

impl QueuePair for ShmQp {
    fn qp_num(&self) -> u32 {
        self.inner.qpn
    }

    /// The peer's process is stopped (its device thread in state `T` or `t`,
    /// see `device_thread::peer_stopped`): a look at `/proc`, made only
    /// when a keepalive goes unanswered.
    fn peer_paused(&self) -> bool {
        let q = &self.inner;
        let hb = lock(&q.hb);
        let Some(h) = hb.as_ref() else {
            return false;
        };
        let state = super::device_thread::peer_thread_state(q.dev.pidns, &Ring(&h.own_ring));
        super::device_thread::peer_stopped(state)
    }

    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        let q = &self.inner;
        if lock(&q.core).state != QpState::Rts {
            return None;
        }
        let (m, off) = q.check_remote(rkey, addr, len).ok()?;
        Some(MemWindow::new(Arc::new(RemoteMem(m)), off, len))
    }

    /// Maps the peer's region now (asking its owner over the link), so that
    /// WRITEs to it later need nothing this process may lack by then (a
    /// descriptor for the moment of the mapping).
    fn prepare_remote(&self, rkey: u32, addr: u64, len: usize) -> Result<()> {
        let q = &self.inner;
        let st = lock(&q.core).state;
        if !matches!(st, QpState::Rtr | QpState::Rts) {
            return Err(Error::InvalidState {
                op: "prepare_remote",
                state: st,
            });
        }
        let m = q.peer_region(rkey).map_err(FetchError::into_error)?;
        m.check(addr, len).map_err(|_| {
            Error::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are not writable in the peer's region {rkey:#x}"
            ))
        })?;
        Ok(())
    }

    fn state(&self) -> QpState {
        lock(&self.inner.core).state
    }

    fn modify(&self, m: &QpModify) -> Result<()> {
        let q = &self.inner;
        let cur = lock(&q.core).state;
        let next = cur.next(m.kind())?;
        match *m {
            QpModify::Init { port, access } => {
                if port != 1 {
                    return Err(Error::NoSuchPort(port));
                }
                let mut c = lock(&q.core);
                c.access = access;
                Ring(&c.ring)
                    .h(R_ACCESS)
                    .store(access.bits() as u64, Release);
                let mut ctl = lock(&q.ctl);
                ctl.access = access;
                ctl.accepting = true;
            }
            QpModify::Rtr {
                remote,
                sgid_index,
                rq_psn,
                path_mtu,
                min_rnr_timer,
            } => {
                if !q.dev.port_up.load(Acquire) {
                    return Err(Error::Connect("port is down".into()));
                }
                let active = port_attr(&q.dev.netdev).active_mtu;
                if path_mtu > active {
                    return Err(Error::InvalidArgument(format!(
                        "path MTU {path_mtu:?} exceeds the port's active MTU {active:?}"
                    )));
                }
                let gids = gid_table(&q.dev.netdev);
                let sgid = gids
                    .get(sgid_index as usize)
                    .ok_or_else(|| Error::InvalidArgument(format!("no GID index {sgid_index}")))?
                    .gid;
                // The peer looks us up by this GID: make sure it is registered
                // even if the address appeared since the last device tick.
                q.dev.publish_gids();
                {
                    let mut c = lock(&q.core);
                    c.rq_psn = rq_psn & 0xff_ffff;
                    c.min_rnr_timer = min_rnr_timer;
                    Ring(&c.ring)
                        .h(R_RNR_TIMER)
                        .store(min_rnr_timer.as_nanos() as u64, Release);
                }
                q.dial(remote, sgid, rq_psn & 0xff_ffff)?;
            }
            QpModify::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
            } => {
                if retry_cnt > 7 || rnr_retry > 7 {
                    return Err(Error::InvalidArgument("retry counts are 0..=7".into()));
                }
                {
                    let mut c = lock(&q.core);
                    if cur == QpState::Rtr {
                        c.sq_psn = sq_psn & 0xff_ffff;
                    }
                    c.timeout = timeout;
                    c.retry_cnt = retry_cnt;
                    c.rnr_retry = rnr_retry;
                }
                if cur == QpState::Rtr {
                    q.on_rts(sq_psn & 0xff_ffff);
                }
            }
            QpModify::Err => {
                q.fail(None, false);
                return Ok(());
            }
            QpModify::Reset => {
                let (ring, ring_fd) = new_ring()?;
                q.ring_replaced.store(true, SeqCst);
                let mut c = lock(&q.core);
                // RESET discards outstanding WRs without completions (as verbs
                // does) but still tells the peer that this end is gone.
                c.sq.clear();
                c.rq.clear();
                q.fail_locked(&mut c, None, false);
                q.release_link(&mut c);
                *lock(&q.ctl) = Ctl::default();
                *c = Core::new(ring, ring_fd);
                return Ok(());
            }
        }
        let mut c = lock(&q.core);
        if c.state != cur {
            return Err(Error::InvalidState {
                op: "modify (state changed concurrently)",
                state: c.state,
            });
        }
        c.state = next;
        q.live
            .store(matches!(next, QpState::Rtr | QpState::Rts), SeqCst);
        q.adopt_ready(&mut c);
        Ok(())
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.post(wr, None)
    }

    fn post_send_ringing(&self, wr: &SendWr<'_>, bell_rkey: u32) -> Result<()> {
        super::qp_progress::defer_wakes(|| self.post(wr, Some(bell_rkey)))
    }

    fn recv_in_place(&self, buf: &mut [u8]) -> InPlace {
        self.inner.recv_in_place(buf)
    }

    #[inline]
    fn recv_may_have(&self) -> bool {
        self.inner.recv_may_have()
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let q = &self.inner;
        let mut c = lock(&q.core);
        if !c.state.can_post_recv() {
            return Err(Error::InvalidState {
                op: "post_recv",
                state: c.state,
            });
        }
        if c.state == QpState::Err {
            q.recv_cq.push(wc(
                wr.wr_id,
                WcStatus::WrFlushError,
                WcOpcode::Recv,
                0,
                None,
                q.qpn,
            ));
            return Ok(());
        }
        if c.rq.len() >= q.cap.max_recv_wr as usize {
            return Err(Error::QueueFull);
        }
        c.rq.push_back(PostedRecv::new(wr.wr_id, wr.sges));
        c.recv_posted += 1;
        let n = c.recv_posted;
        Ring(&c.ring).h(R_RECV_CREDITS).store(n, Release);
        Ok(())
    }
}

impl Drop for ShmQp {
    fn drop(&mut self) {
        let q = &self.inner;
        {
            let mut c = lock(&q.core);
            q.fail_locked(&mut c, None, false);
            q.release_link(&mut c);
            c.ring_fd = None;
        }
        lock(&q.dev.qps).remove(&q.qpn);
        q.dev.reg.release_qpn(q.qpn, &q.dev.sock_path);
        q.dev.wake.signal();
    }
}

impl QpInner {
    pub(super) fn efd_flags(&self) -> u32 {
        let rx = self.recv_cq.chan.as_ref();
        let tx = self.send_cq.chan.as_ref();
        let mut f = 0;
        if rx.is_some() {
            f |= wire::F_RX_CHAN;
        }
        if tx.is_some() {
            f |= wire::F_TX_CHAN;
        }
        if let (Some(a), Some(b)) = (rx, tx) {
            if Arc::ptr_eq(a, b) {
                f |= wire::F_SAME_CHAN;
            }
        }
        f
    }
}
