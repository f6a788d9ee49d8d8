//! One link of a link group as the endpoint holds it: the provider objects (RC
//! QP, send and receive CQs, receive buffers) and the work-request bookkeeping.
//!
//! Spec: `protocol-llc-cdc.md` §4.1–§4.3 (per-link send slots, 48 receive WRs,
//! QP attributes), §6 (a link is one RC QP pair; each has its own PSN and peer
//! QPN/GID), §9 (CDCs and their RDMA WRITEs go on the same QP, RC ordering).
//!
//! Linux gives every link its own protection domain and registers each RMB once
//! per link, hence one rkey per (RMB, link) (§4.3). Here the links of a group
//! on the endpoint's (first) device share the group's protection domain, so an
//! RMB has one rkey on all of them; links on a second device share a second
//! PD of the group, where every buffer of the group is registered again
//! (`ProtectionDomain::share_mr`, `endpoint/devices.rs`) with its own rkey
//! and address. rkeys are announced per link (CONFIRM_RKEY entries for the
//! other links, the rkey list of a link's bring-up), and a peer's per-link
//! rkeys are kept in its per-link rtoken columns.

use smc_proto::link::{LocalPort, PeerPort};
use smc_rdma::{
    Access, CompletionQueue, Device, InPlace, MemoryRegion, Payload, ProtectionDomain, Provider,
    QpCap, QpModify, QpState, QueuePair, RecvWr, RemoteQp, SendOp, SendWr, Sge, WcStatus,
};
use smc_wire::types::{Gid, IbMtu, Mac};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::gid::LocalGid;
use super::{ConnId, Result};

/// A link on the endpoint's second device (`endpoint/devices.rs`): its
/// source GID and port MTU there, and the lkeys its WRITEs use for the
/// group's send buffers (registered again on that device's PD).
pub(super) struct OtherDevice {
    pub gid: LocalGid,
    pub mtu: IbMtu,
    /// A send buffer's lkey on the first device → its (lkey, address) on
    /// this one, and its address on the first.
    pub lkeys: HashMap<u32, super::devices::OnSecond>,
}

/// Receive buffers posted per link (Linux: 3 × 16 = 48).
pub(super) const RECV_SLOTS: usize = 48;
/// Bytes per receive buffer (SMC-Rv2 LLC messages are up to 8 KiB).
pub(super) const RECV_SLOT_LEN: usize = 8192;
/// SENDs in flight per link, unless the device says otherwise
/// (`DeviceInfo::max_sends`). Linux sends at most `SMC_WR_BUF_CNT` (16)
/// and posts three times as many receive buffers (`smc_ib_create_queue_pair`,
/// as `RECV_SLOTS` here); twice that many still leaves a peer of either kind
/// receive buffers to spare. One link carries many connections, and a
/// write that finds all of its SENDs in flight, with no completion come in
/// to take (`LinkTx::reap`), leaves the fast path for the endpoint (the
/// counts are in smc-preload's README). More than a
/// peer has posted would only meet RNR NAKs, which the QP retries for ever
/// (`rnr_retry` 7, as Linux's `SMC_QP_RNR_RETRY`).
pub const MAX_SENDS: usize = 32;
/// The most SENDs in flight a device may ask for.
pub(super) const MAX_SENDS_CAP: usize = 64;
/// Receive buffers a link posts beyond the SENDs its peer may have in
/// flight when the device asks for more than [`MAX_SENDS`] (its peers are
/// ours and do the same): room for LLC messages.
const RECV_SPARE: usize = 8;
/// Send completions a fast path's reap ([`LinkTx::reap`]) leaves for the
/// endpoint at most: beyond that the fast path goes through the endpoint,
/// whose pump takes them (a bound on what waits, when no driver pumps).
const REAPED_MAX: usize = 4 * MAX_SENDS;
/// Send-queue depth: every SEND may be preceded by two RDMA WRITEs (Linux
/// `smc_ib_create_queue_pair`: `SMC_WR_BUF_CNT * 3`).
const SQ_DEPTH: usize = 3 * MAX_SENDS_CAP;

/// What a device allows a link: inline payloads and SENDs in flight
/// (`DeviceInfo::max_inline`, `DeviceInfo::max_sends`). An endpoint with a
/// second device keeps what both allow ([`LinkLimits::both`]): a
/// connection may move to a link on either.
#[derive(Clone, Copy, Debug)]
pub(super) struct LinkLimits {
    /// Largest inline payload: writes up to this size go from the
    /// application's buffer straight to the peer (see `Endpoint::write`).
    pub max_inline: u32,
    /// SENDs a link may keep in flight, where the device says.
    pub max_sends: Option<u32>,
}

impl LinkLimits {
    /// What `info`'s device allows.
    pub fn of(info: &smc_rdma::DeviceInfo) -> LinkLimits {
        LinkLimits {
            max_inline: info.max_inline,
            max_sends: info.max_sends,
        }
    }

    /// What both `self` and `other` allow.
    pub fn both(self, other: LinkLimits) -> LinkLimits {
        LinkLimits {
            max_inline: self.max_inline.min(other.max_inline),
            max_sends: match (self.max_sends, other.max_sends) {
                (Some(a), Some(b)) => Some(a.min(b)),
                _ => None,
            },
        }
    }
}

/// SENDs in flight on a link of a device that says `asked`
/// (`DeviceInfo::max_sends`), and the receive buffers the link posts.
fn send_limits(asked: Option<u32>) -> (usize, usize) {
    match asked {
        None => (MAX_SENDS, RECV_SLOTS),
        Some(n) => {
            let n = (n as usize).clamp(1, MAX_SENDS_CAP);
            (n, RECV_SLOTS.max(n + RECV_SPARE))
        }
    }
}
/// One CDC SEND in how many a link posts signaled at least, when it may
/// keep `max_sends` in flight (the ones between ask for no completion). Selective
/// signaling, as verbs allows (an RC send queue completes in order, so one
/// completion completes every work request before it): a completion costs
/// the device a CQ entry and the endpoint its poll and bookkeeping, per
/// message where every SEND is signaled (as Linux's are, smc_wr.c
/// `smc_wr_tx_send`). A quarter of the SENDs in flight, so that a link
/// whose SENDs are all in flight always has signaled ones among them.
pub fn signal_every(max_sends: usize) -> usize {
    (max_sends / 4).clamp(1, 16)
}

/// Registered send slots for SENDs above the inline limit: one small slot
/// per send-queue entry (CDCs and the LLC messages we send are 44 bytes),
/// and a few that take an SMC-Rv2 LLC message of up to 8 KiB (Linux
/// `SMC_WR_BUF_V2_SIZE`; its LLC flows send one at a time).
const SMALL_SLOT: usize = 64;
const LARGE_SLOTS: usize = 4;
const LARGE_SLOT: usize = RECV_SLOT_LEN;
/// Linux `SMC_QP_MIN_RNR_TIMER` 5: the IB RNR NAK timer code for 60 µs.
pub(super) const MIN_RNR_TIMER: Duration = Duration::from_micros(60);
/// Linux `SMC_QP_TIMEOUT` 15: the local ACK timeout code for 4.096 µs ×
/// 2^15 (providers round up to the next code, which this is).
pub(super) const QP_TIMEOUT: Duration = Duration::from_nanos(4096 << 15);

/// What a work request of the send queue carried, to act on its completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WrKind {
    /// An LLC message.
    Llc,
    /// A CDC of a connection, with its seqno.
    Cdc(ConnId, u16),
    /// A failover validation CDC (§2.4): nothing to do on completion.
    Validation,
    /// A zero-length RDMA WRITE posted signaled behind unsignaled CDCs
    /// ([`TxBook::probe`]): its completion completes them; nothing else.
    Probe,
}

/// A work request of the link's send queue that completes into the send
/// CQ, or is completed by a later one that does (see [`TxBook::post`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct InFlight {
    pub wr_id: u64,
    pub kind: WrKind,
    /// The registered send slot it holds (a SEND above the inline limit).
    slot: Option<SendSlot>,
    /// Posted signaled: its own completion comes.
    pub signaled: bool,
}

/// A registered send slot (see `LinkRes::post`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SendSlot {
    Small(u16),
    Large(u16),
}

impl SendSlot {
    fn offset(self) -> usize {
        match self {
            SendSlot::Small(i) => usize::from(i) * SMALL_SLOT,
            SendSlot::Large(i) => SQ_DEPTH * SMALL_SLOT + usize::from(i) * LARGE_SLOT,
        }
    }
}

/// One link's provider objects and send bookkeeping.
pub(super) struct LinkRes<P: Provider> {
    /// The QP (shared with [`LinkTx`] and [`LinkRx`]: posting takes `&self`,
    /// providers synchronize it internally).
    pub qp: Arc<P::Qp>,
    /// The receive side: its CQ, the receive buffers and their re-posting,
    /// behind a lock of the link's own.
    pub rx: Arc<LinkRx<P>>,
    /// Our initial send PSN.
    pub psn: u32,
    /// The peer's end, once known.
    pub peer_gid: Gid,
    pub peer_qpn: u32,
    /// The QP is connected (RTR and RTS with the peer's values).
    pub connected: bool,
    /// The link's path MTU once connected: the smaller of ours and the
    /// peer's.
    pub path_mtu: Option<IbMtu>,
    /// Server: the link id chosen when this (further) link was offered.
    pub offered_id: u8,
    /// The QP with its send bookkeeping behind a lock of the link's own,
    /// which a connection's fast path holds (`ConnCore::fast_write`).
    pub tx: Arc<LinkTx<P>>,
    /// The send CQ was armed by the last [`Self::arm`] or since (an armed CQ
    /// stays armed until its event, which wakes the driver, who arms again).
    pub send_armed: bool,
    /// Whether its receive CQ was ever armed ([`Self::arm`]): a link made
    /// while a driver sleeps is not, and `Endpoint::arm_new_links` arms it.
    pub recv_armed: bool,
    /// The endpoint opened the link's send side to the fast path
    /// (`TxBook::open`, kept here to look at without its lock).
    pub fast_granted: bool,
    /// `Some`: the link is on the endpoint's second device.
    pub on: Option<OtherDevice>,
    /// The QP's connect was handed out and has not come back yet
    /// ([`LinkBringup`], `endpoint/add_link.rs`).
    pub bringup: Option<PendingBringup>,
}

/// A connect of a link's QP handed out ([`LinkRes::begin_connect`]): what
/// its completion finishes.
pub(super) struct PendingBringup {
    /// Which bring-up (an endpoint-wide serial: a late report of one whose
    /// link is gone finds nothing).
    pub id: u64,
    pub peer: PeerPort,
    pub path_mtu: IbMtu,
    /// LLC messages for this link that came before its QP was connected
    /// (a server's CONFIRM_LINK): posted once it is.
    pub held: Vec<Vec<u8>>,
}

/// The connect of a link's QP to the peer's (INIT → RTR → RTS), to run
/// where the endpoint is not held (see `endpoint/add_link.rs`): the modify
/// to RTR may block (verbs resolves the peer's MAC there, waiting for ARP),
/// and the QP is synchronized by the provider. Its result goes back to
/// [`super::Endpoint::handle_link_bringup`] with [`Self::id`].
pub struct LinkBringup<P: Provider> {
    id: u64,
    qp: Arc<P::Qp>,
    rtr: QpModify,
    rts: QpModify,
}

impl<P: Provider> LinkBringup<P> {
    /// Which bring-up this is.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Modifies the QP to RTR and RTS.
    pub fn run(&self) -> Result<()> {
        self.qp.modify(&self.rtr)?;
        self.qp.modify(&self.rts)
    }
}

impl<P: Provider> std::fmt::Debug for LinkBringup<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkBringup")
            .field("id", &self.id)
            .field("rtr", &self.rtr)
            .finish_non_exhaustive()
    }
}

/// A link's send side as a connection's fast path uses it without the
/// endpoint (docs/FAST-PATH.md, step 4): the QP, and the work-request and
/// send-slot bookkeeping under a lock of the link's own. The endpoint posts
/// through the same lock ([`LinkRes::post`] and the rest), so the two never
/// disagree on what is in flight.
pub(super) struct LinkTx<P: Provider> {
    pub qp: Arc<P::Qp>,
    /// The send CQ. Polled only with [`Self::book`] held, by the endpoint
    /// (`Endpoint::poll_send`) or by a connection's fast path that finds
    /// every SEND in flight ([`Self::reap`]), so that the two take
    /// completions in the send queue's order; armed and looked at without.
    pub scq: P::Cq,
    book: Mutex<TxBook<P>>,
    /// [`TxBook::reaped`] has completions, or [`TxBook::corked`]
    /// connections, for the endpoint: the link's group is not quiet until
    /// its next poll of the send CQ took them.
    reaped: AtomicBool,
    /// Set when a fast post failed ([`TxBook::broken`]): the endpoint's next
    /// pump looks.
    attention: AtomicBool,
    /// CDCs the fast path posted, not yet counted by the endpoint.
    pub fast_cdcs: Uncounted,
}

/// CDCs a link's send or receive side took without the endpoint, not yet
/// counted by it: changed under that side's `book` lock only (so a load
/// and a store, no locked add, on the data path), read without it by the
/// endpoint's statistics (`Endpoint::msg_counts`), which would otherwise
/// lag until the endpoint next polls the link (seconds, with its driver
/// asleep).
#[derive(Default)]
pub(super) struct Uncounted(AtomicU64);

impl Uncounted {
    /// One more (the caller holds the side's `book`).
    #[inline]
    pub fn add<B>(&self, _book: &B) {
        let n = self.0.load(Ordering::Relaxed);
        self.0.store(n + 1, Ordering::Relaxed);
    }

    /// The count, reset (the caller holds the side's `book`).
    pub fn take<B>(&self, _book: &B) -> u64 {
        let n = self.0.load(Ordering::Relaxed);
        self.0.store(0, Ordering::Relaxed);
        n
    }

    /// The count, without the lock (a statistic: one being added may be
    /// missed).
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A link's receive side (docs/FAST-PATH.md, step 4): the receive CQ, the
/// registered receive buffers and the QP they are posted to again, polled
/// under a lock of the link's own ([`Self::book`]) so that one poller at a
/// time takes completions, copies their buffers out and re-posts them, in
/// the CQ's order (the LLC and CDC order of the link, §4.2), whether it
/// holds the device lock or not.
pub(super) struct LinkRx<P: Provider> {
    qp: Arc<P::Qp>,
    recv: P::Mr,
    /// The receive CQ. Arming it and looking whether it may have work need
    /// no lock (`CompletionQueue` takes `&self`); polling it does.
    pub cq: P::Cq,
    book: Mutex<RxBook>,
    /// A dispatch without the device lock left something in [`RxBook`] for
    /// the endpoint (`RxBook::queue`, flush marks, the link's activity, the
    /// completions it counted): the link's group is not quiet until the
    /// endpoint's next poll of the link took it.
    attention: AtomicBool,
    /// The endpoint lets connections poll this link without it
    /// (`Endpoint::open_rx`: the group's only link, active); closed when the
    /// link is stopped or released.
    open: AtomicBool,
    /// CDCs a dispatch without the device lock applied, not yet counted by
    /// the endpoint.
    pub cdcs: Uncounted,
    /// A connection polled the CQ itself (`cdc_recv::dispatch`) since the
    /// endpoint last armed it or left it unarmed (`Endpoint::arm_unpolled`).
    polled: AtomicBool,
}

/// What a link's receive poller keeps under [`LinkRx`]'s lock: the buffers
/// a poll fills, kept so that a poll does not initialize them each time.
#[derive(Default)]
pub(super) struct RxBook {
    /// One receive buffer's bytes (a CDC or LLC message), copied out before
    /// the buffer is posted again.
    pub msg: Vec<u8>,
    /// The completions of one poll.
    pub wcs: Vec<smc_rdma::WorkCompletion>,
    /// What a dispatch without the device lock (`cdc_recv::dispatch`) left
    /// for the endpoint, in the link's order: once anything is here, the
    /// dispatch stops and leaves every later receive where it is, and the
    /// endpoint's poll takes these before it takes those (`LinkRx::next`),
    /// so that the link's LLC and CDC order holds.
    pub queue: VecDeque<RxLeft>,
    /// Connections that CDCs applied by such a dispatch marked to send
    /// (`Endpoint::mark_tx`), each once.
    pub marks: Vec<ConnId>,
    /// Such a dispatch received something on the link (the group's
    /// `on_rx_activity`, at the endpoint's next poll).
    pub active: bool,
    /// Completions such a dispatch applied, not yet counted by the
    /// endpoint (its CDCs: [`LinkRx::cdcs`]).
    pub completions: u64,
    /// The completions of the last CQ poll not handed out yet by
    /// [`LinkRx::next`]: `wcs[at..polled]`.
    at: usize,
    polled: usize,
    /// The last receive taken in place was the last there, or (a provider
    /// without receives in place) the last CQ poll did not fill its array:
    /// once its completions are handed out, the next [`LinkRx::next`] says
    /// there is nothing more without looking. For this hold of the lock
    /// only (cleared when it is taken): the next poller looks.
    drained: bool,
}

/// A receive that [`LinkRx::next`] hands out.
#[derive(Clone, Copy)]
pub(super) struct Recv {
    pub wc: smc_rdma::WorkCompletion,
    /// Taken in place (`QueuePair::recv_in_place`): its message is in
    /// [`RxBook::msg`] already and its buffer posted again; else its message
    /// is in its receive buffer ([`LinkRx::peek`]), to be posted again
    /// ([`LinkRx::repost`]).
    pub in_place: bool,
}

/// A receive completion that a dispatch without the device lock left to the
/// endpoint (see [`RxBook::queue`]).
pub(super) enum RxLeft {
    /// Not looked at, or not for the dispatch to handle (LLC, a failed
    /// completion, a CDC of an unknown token or of another group, a
    /// connection not yet established): its receive buffer is not posted
    /// again yet, and the endpoint handles it as if it had polled it now.
    Wc(smc_rdma::WorkCompletion),
    /// The same for a receive taken in place: its message (its buffer is
    /// posted again already).
    Msg(smc_rdma::WorkCompletion, LeftMsg),
    /// A CDC applied to connection `.0` that left the endpoint something to
    /// do: an abort or a finished close.
    Done(ConnId, super::conn_core::CdcDone),
    /// Posting a receive buffer again failed.
    Repost(smc_rdma::Error),
}

/// The bytes of a message taken in place that a dispatch left to the
/// endpoint ([`RxLeft::Msg`]): a CDC or an LLC message of SMC-R v1 (44
/// bytes) kept as it is, a longer one on the heap.
pub(super) enum LeftMsg {
    Short([u8; 64], u8),
    Long(Box<[u8]>),
}

impl LeftMsg {
    pub fn new(b: &[u8]) -> LeftMsg {
        let mut short = [0u8; 64];
        match short.get_mut(..b.len()) {
            Some(s) => {
                s.copy_from_slice(b);
                LeftMsg::Short(short, b.len() as u8)
            }
            None => LeftMsg::Long(b.into()),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            LeftMsg::Short(b, n) => &b[..usize::from(*n)],
            LeftMsg::Long(b) => b,
        }
    }
}

impl RxBook {
    /// Whether the receive [`LinkRx::next`] handed out last was the last
    /// one its poll saw, so that the next call would return `None` without
    /// looking (the next holder of the lock looks again).
    #[inline]
    pub fn nothing_left(&self) -> bool {
        self.at >= self.polled && self.drained
    }

    /// Whether a dispatch leaves the endpoint something to do here: what it
    /// left in the queue, completions it applied, connections it marked
    /// (the link's [`LinkRx::attention`] once the dispatch lets go).
    #[inline]
    pub fn leaves_work(&self) -> bool {
        self.completions > 0 || !self.queue.is_empty() || !self.marks.is_empty()
    }
}

impl<P: Provider> LinkRx<P> {
    /// The link's receive side, locked for a poll (a panic while it was
    /// held leaves at worst a receive buffer not posted again, which the
    /// link survives with one buffer fewer: it is used as it is).
    #[inline]
    pub fn book(&self) -> MutexGuard<'_, RxBook> {
        let mut b = self.book.lock().unwrap_or_else(PoisonError::into_inner);
        b.drained = false;
        b
    }

    /// The link's receive side for a dispatch that must not wait: `None`
    /// while another poller has it.
    #[inline]
    pub fn try_book(&self) -> Option<MutexGuard<'_, RxBook>> {
        let mut b = match self.book.try_lock() {
            Ok(b) => b,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        b.drained = false;
        Some(b)
    }

    /// Whether connections may poll the link without the endpoint.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Opens or closes the link to connections' own polls.
    pub fn set_open(&self, on: bool) {
        if self.open.load(Ordering::Relaxed) != on {
            self.open.store(on, Ordering::Release);
        }
    }

    /// Whether a dispatch left something for the endpoint (see
    /// [`RxBook::queue`]).
    #[inline]
    pub fn attention(&self) -> bool {
        self.attention.load(Ordering::SeqCst)
    }

    /// Sets or clears [`Self::attention`] (the caller holds `book`).
    #[inline]
    pub fn set_attention(&self, _book: &RxBook, on: bool) {
        self.attention.store(on, Ordering::SeqCst);
    }

    /// Copies the message of receive completion `wr_id` (`len` bytes) into
    /// `book.msg` without posting its buffer again (the caller holds
    /// `book`); its length.
    fn peek(&self, book: &mut RxBook, wr_id: u64, len: u32) -> Result<usize> {
        if book.msg.len() != RECV_SLOT_LEN {
            book.msg.resize(RECV_SLOT_LEN, 0);
        }
        let n = (len as usize).min(RECV_SLOT_LEN);
        self.recv
            .read_at(wr_id as usize * RECV_SLOT_LEN, &mut book.msg[..n])?;
        Ok(n)
    }

    /// Posts receive buffer `wr_id` again (the caller holds `book`).
    fn repost(&self, _book: &RxBook, wr_id: u64) -> Result<()> {
        let sge = self
            .recv
            .sge(wr_id as usize * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
        self.qp.post_recv(&RecvWr {
            wr_id,
            sges: &[sge],
        })
    }

    /// Notes a poll of a connection's own (see [`Self::take_polled`]): a
    /// load, and a store only the first time after a take (the line stays
    /// shared between the cores of pollers that find it set).
    #[inline]
    pub fn note_polled(&self) {
        if !self.polled.load(Ordering::Relaxed) {
            self.polled.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a connection polled the CQ itself since the last take.
    pub fn take_polled(&self) -> bool {
        self.polled.load(Ordering::Relaxed) && self.polled.swap(false, Ordering::Relaxed)
    }

    /// Whether [`Self::next`] would hand out nothing now (the caller holds
    /// `book`), by the provider's look without its locks
    /// (`QueuePair::recv_may_have`): a reader that comes before its data,
    /// or an event loop's look at a connection whose CDCs another look took
    /// already, then costs no lock of the QP or its CQ.
    #[inline]
    pub fn quiet(&self, book: &RxBook) -> bool {
        book.at >= book.polled && !self.qp.recv_may_have()
    }

    /// The link's next receive, in the order the peer sent them (the
    /// caller holds `book`): what the receive CQ holds first, then a
    /// message taken in place where the provider has them
    /// (`QueuePair::recv_in_place`: no copy into a receive buffer, no
    /// completion, no post of the buffer again). `None`: nothing more now.
    pub fn next(&self, book: &mut RxBook) -> Result<Option<Recv>> {
        // (a few rounds at most: a CQ said to hold completions gives some)
        for _ in 0..4 {
            if book.at < book.polled {
                let wc = book.wcs[book.at];
                book.at += 1;
                return Ok(Some(Recv {
                    wc,
                    in_place: false,
                }));
            }
            if std::mem::take(&mut book.drained) {
                return Ok(None);
            }
            if book.msg.len() != RECV_SLOT_LEN {
                book.msg.resize(RECV_SLOT_LEN, 0);
            }
            let unsupported = match self.qp.recv_in_place(&mut book.msg) {
                InPlace::Got { wr_id, len, more } => {
                    book.drained = !more;
                    return Ok(Some(Recv {
                        wc: smc_rdma::WorkCompletion {
                            wr_id,
                            status: smc_rdma::WcStatus::Success,
                            opcode: smc_rdma::WcOpcode::Recv,
                            byte_len: len,
                            imm: None,
                            qp_num: self.qp.qp_num(),
                        },
                        in_place: true,
                    }));
                }
                InPlace::Empty => return Ok(None),
                InPlace::CqFirst => false,
                InPlace::Unsupported => true,
            };
            book.polled = self.poll(book)?;
            book.at = 0;
            if unsupported {
                // (a poll that did not fill the array took everything)
                book.drained = book.polled < book.wcs.len();
                if book.polled == 0 {
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }

    /// The message of `r` in `book.msg` ([`Self::peek`] unless it is there
    /// already); its length.
    #[inline]
    pub fn message(&self, book: &mut RxBook, r: &Recv) -> Result<usize> {
        if r.in_place {
            return Ok((r.wc.byte_len as usize).min(book.msg.len()));
        }
        self.peek(book, r.wc.wr_id, r.wc.byte_len)
    }

    /// Posts the receive buffer of `r` again unless it is already
    /// ([`Self::repost`]).
    #[inline]
    pub fn release(&self, book: &RxBook, r: &Recv) -> Result<()> {
        if r.in_place {
            return Ok(());
        }
        self.repost(book, r.wc.wr_id)
    }

    /// Polls the receive CQ into `book.wcs` (the caller holds `book`).
    #[inline]
    fn poll(&self, book: &mut RxBook) -> Result<usize> {
        if book.wcs.len() != super::cdc_send::POLL_BATCH {
            book.wcs.resize(
                super::cdc_send::POLL_BATCH,
                smc_rdma::WorkCompletion::default(),
            );
        }
        self.cq.poll(&mut book.wcs)
    }
}

/// The send bookkeeping of a link (see [`LinkTx`]).
pub(super) struct TxBook<P: Provider> {
    /// SENDs in flight (and probes, [`Self::probe`]), oldest first, signaled
    /// or not: an RC send queue completes in order, so a completion
    /// completes its own work request and every one before it
    /// ([`Self::complete`]).
    pub wrs: VecDeque<InFlight>,
    /// CDC SENDs posted unsignaled since the last signaled work request
    /// (see [`Self::post`]).
    unsignaled: usize,
    /// One CDC in this many at least is signaled ([`signal_every`]).
    signal_every: usize,
    /// The QP's inline limit: longer SENDs go from `sendbuf`.
    max_inline: usize,
    /// Registered send slots (when the inline limit is below the longest
    /// message): SQ_DEPTH small ones, then LARGE_SLOTS large ones.
    sendbuf: Option<P::Mr>,
    free_small: Vec<u16>,
    free_large: Vec<u16>,
    pub sends_in_flight: usize,
    /// The most SENDs in flight on this link ([`send_limits`]).
    pub max_sends: usize,
    pub next_wr: u64,
    /// Connections may write directly on this link without the endpoint
    /// (`ConnCore::fast_write`): set by the endpoint's own direct write,
    /// which checked the link's conditions (`Endpoint::direct_plan`),
    /// cleared when they no longer hold (`Endpoint::close_fast`) and when
    /// the link is stopped or released.
    pub open: bool,
    /// A fast post failed with this: the link is broken, for the endpoint
    /// to handle (`Endpoint::take_fast_errors`).
    pub broken: Option<smc_rdma::Error>,
    /// Send completions a connection's fast path took off the send CQ
    /// ([`LinkTx::reap`]) and left to the endpoint, with what each one's
    /// work request carried (its send slot and place in flight are free
    /// already): the endpoint handles them before what it polls itself.
    pub reaped: Vec<(smc_rdma::WorkCompletion, Option<WrKind>)>,
    /// Connections whose fast path wrote bytes without a CDC while every
    /// SEND of the link was in flight (`ConnCore::fast_write`, corked): the
    /// endpoint's next poll of the send CQ marks them for its flush
    /// ([`LinkTx::take_completions`]), so that their CDC goes out with the
    /// slot a completion frees, whoever writes next.
    pub corked: Vec<ConnId>,
}

impl<P: Provider> LinkRes<P> {
    /// A new link: CQs, an RC QP in INIT on port 1 and its receive buffers posted.
    /// A link's QP with its CQs on the endpoint's completion channel `chan`,
    /// within `limits` (inline payloads, SENDs in flight: [`send_limits`]),
    /// starting at the (random) initial send PSN `psn`.
    pub fn new(
        dev: &P::Device,
        pd: &P::Pd,
        chan: &P::Channel,
        limits: LinkLimits,
        psn: u32,
    ) -> Result<LinkRes<P>> {
        let max_inline = limits.max_inline;
        let (max_sends, recv_slots) = send_limits(limits.max_sends);
        let scq = dev.create_cq(1024, Some(chan))?;
        let rcq = dev.create_cq(1024, Some(chan))?;
        let qp = pd.create_qp(
            &scq,
            &rcq,
            QpCap {
                max_send_wr: SQ_DEPTH as u32,
                max_recv_wr: recv_slots as u32,
                max_inline_data: max_inline,
            },
        )?;
        qp.modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        })?;
        let recv = pd.alloc_mr(recv_slots * RECV_SLOT_LEN, Access::LOCAL_WRITE)?;
        for i in 0..recv_slots {
            let sge = recv.sge(i * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
            qp.post_recv(&RecvWr {
                wr_id: i as u64,
                sges: &[sge],
            })?;
        }
        let psn = psn & 0x00ff_ffff;
        // Linux sends every message from registered buffers (its QPs have
        // `max_inline_data` 0); we send inline what the device takes inline
        // and the rest from registered slots, so that a device with a small
        // inline limit (or none) carries CDCs and v2 LLC messages of up to
        // 8 KiB all the same.
        let sendbuf = if (max_inline as usize) < LARGE_SLOT {
            Some(pd.alloc_mr(
                SQ_DEPTH * SMALL_SLOT + LARGE_SLOTS * LARGE_SLOT,
                Access::LOCAL_WRITE,
            )?)
        } else {
            None
        };
        let qp = Arc::new(qp);
        let tx = Arc::new(LinkTx {
            qp: qp.clone(),
            scq,
            reaped: AtomicBool::new(false),
            book: Mutex::new(TxBook {
                wrs: VecDeque::new(),
                unsignaled: 0,
                signal_every: signal_every(max_sends),
                max_inline: max_inline as usize,
                sendbuf,
                free_small: (0..SQ_DEPTH as u16).rev().collect(),
                free_large: (0..LARGE_SLOTS as u16).rev().collect(),
                sends_in_flight: 0,
                max_sends,
                next_wr: 1 << 32,
                open: false,
                broken: None,
                reaped: Vec::new(),
                corked: Vec::new(),
            }),
            attention: AtomicBool::new(false),
            fast_cdcs: Uncounted::default(),
        });
        let rx = Arc::new(LinkRx {
            qp: qp.clone(),
            recv,
            cq: rcq,
            book: Mutex::new(RxBook::default()),
            attention: AtomicBool::new(false),
            open: AtomicBool::new(false),
            cdcs: Uncounted::default(),
            polled: AtomicBool::new(false),
        });
        Ok(LinkRes {
            qp,
            rx,
            psn,
            peer_gid: Gid::ZERO,
            peer_qpn: 0,
            connected: false,
            path_mtu: None,
            offered_id: 0,
            tx,
            send_armed: false,
            recv_armed: false,
            fast_granted: false,
            on: None,
            bringup: None,
        })
    }

    /// Our end of the link.
    pub fn local_port(&self, gid: Gid, mac: Mac, mtu: IbMtu) -> LocalPort {
        LocalPort {
            gid,
            mac,
            qpn: self.qp.qp_num(),
            psn: self.psn,
            mtu,
        }
    }

    /// Connects the QP to the peer's (INIT → RTR → RTS) with Linux's
    /// attributes (smc_ib.c `smc_ib_modify_qp_init`, `_rtr`, `_rts`): path
    /// MTU the smaller of the port's and the peer's, the source GID at
    /// `sgid_index` of the port's table (the group's GID), RNR timer code 5
    /// (60 µs, `SMC_QP_MIN_RNR_TIMER`), local ACK timeout code 15 (4.096 µs
    /// × 2^15 ≈ 134 ms, `SMC_QP_TIMEOUT`), retry and RNR retry 7
    /// (`SMC_QP_RETRY_CNT`, `SMC_QP_RNR_RETRY`). The provider adds the rest
    /// as Linux sets it: P_Key index 0, one outstanding RDMA READ/atomic
    /// each way, GRH hop limit 1 (a direct link, `v2_direct`), traffic
    /// class and flow label 0.
    pub fn connect(&mut self, peer: &PeerPort, local_mtu: IbMtu, sgid_index: u16) -> Result<()> {
        let b = self.begin_connect(peer, local_mtu, sgid_index, 0);
        let r = b.run();
        match r {
            Ok(()) => {
                self.finish_connect();
            }
            Err(_) => self.bringup = None,
        }
        r
    }

    /// [`Self::connect`] handed out: the modifies to run (anywhere, see
    /// [`LinkBringup`]) as bring-up `id`; [`Self::finish_connect`] once
    /// they succeeded.
    pub fn begin_connect(
        &mut self,
        peer: &PeerPort,
        local_mtu: IbMtu,
        sgid_index: u16,
        id: u64,
    ) -> LinkBringup<P> {
        let mtu = smc_rdma::Mtu::from_code(peer.mtu).map_or(local_mtu, |m| m.min(local_mtu));
        self.bringup = Some(PendingBringup {
            id,
            peer: *peer,
            path_mtu: mtu,
            held: Vec::new(),
        });
        LinkBringup {
            id,
            qp: self.qp.clone(),
            rtr: QpModify::Rtr {
                remote: RemoteQp {
                    gid: peer.gid,
                    qp_num: peer.qpn,
                },
                sgid_index,
                rq_psn: peer.psn,
                path_mtu: mtu,
                min_rnr_timer: MIN_RNR_TIMER,
            },
            rts: QpModify::Rts {
                sq_psn: self.psn,
                timeout: QP_TIMEOUT,
                retry_cnt: 7,
                rnr_retry: 7,
            },
        }
    }

    /// The handed-out connect succeeded: the link is connected; the LLC
    /// messages held for it meanwhile, to post now.
    pub fn finish_connect(&mut self) -> Vec<Vec<u8>> {
        let Some(b) = self.bringup.take() else {
            return Vec::new();
        };
        self.peer_gid = b.peer.gid;
        self.peer_qpn = b.peer.qpn;
        self.path_mtu = Some(b.path_mtu);
        self.connected = true;
        b.held
    }

    /// The link's send bookkeeping, locked.
    #[inline]
    pub fn book(&self) -> MutexGuard<'_, TxBook<P>> {
        self.tx.book()
    }

    /// Posts a signaled SEND (an LLC message or a validation CDC): inline
    /// when the device takes it inline, else from a registered send slot,
    /// held until its completion.
    pub fn post(&mut self, kind: WrKind, bytes: &[u8]) -> Result<()> {
        self.tx.book().post(&self.qp, kind, bytes, None, true)
    }

    /// Posts a connection's CDC as [`Self::post`] does, signaled if the
    /// connection `wants` its completion or the link's turn says
    /// ([`TxBook::post`]), ringing the doorbell of the peer's RMB `bell`
    /// (its rkey on this link) if given and the peer's reader sleeps on it
    /// (`QueuePair::post_send_ringing`).
    pub fn post_cdc(
        &mut self,
        kind: WrKind,
        bytes: &[u8],
        bell: Option<u32>,
        wants: bool,
    ) -> Result<()> {
        self.tx.book().post(&self.qp, kind, bytes, bell, wants)
    }

    /// [`TxBook::probe`] on this link.
    pub fn probe(&mut self, rkey: u32, addr: u64) -> Result<bool> {
        self.tx.book().probe(&self.qp, rkey, addr)
    }

    /// SENDs in flight, signaled or not.
    pub fn sends_in_flight(&self) -> usize {
        self.book().sends_in_flight
    }

    /// Whether every SEND the link may have in flight is.
    pub fn sends_full(&self) -> bool {
        let b = self.book();
        b.sends_in_flight >= b.max_sends
    }

    /// Posts an unsignaled RDMA WRITE of `sges` to the peer's `(rkey, addr)`.
    /// (`sges` name the send buffer by its lkey on the first device; a link
    /// on the second device uses that buffer's registration there.)
    pub fn post_write(&mut self, sges: &[Sge], rkey: u32, remote_addr: u64) -> Result<()> {
        let mut book = self.tx.book();
        book.next_wr += 1;
        let mut local = [Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; 2];
        let sges = match &self.on {
            Some(on) if sges.len() <= local.len() => {
                for (d, s) in local.iter_mut().zip(sges) {
                    let (lkey, here, first) = on.lkeys.get(&s.lkey).copied().ok_or_else(|| {
                        smc_rdma::Error::InvalidArgument(
                            "a send buffer not registered on the link's device".into(),
                        )
                    })?;
                    let addr = s.addr.wrapping_sub(first).wrapping_add(here);
                    *d = Sge { lkey, addr, ..*s };
                }
                &local[..sges.len()]
            }
            Some(_) => {
                return Err(smc_rdma::Error::InvalidArgument(
                    "more than two pieces in one WRITE".into(),
                ))
            }
            None => sges,
        };
        self.qp.post_send(&SendWr {
            wr_id: book.next_wr,
            op: SendOp::RdmaWrite { remote_addr, rkey },
            payload: Payload::Sges(sges),
            signaled: false,
        })
    }

    /// Posts an unsignaled inline RDMA WRITE of `data` (copied at post time)
    /// to the peer's `(rkey, addr)`.
    pub fn post_write_inline(&mut self, data: &[u8], rkey: u32, remote_addr: u64) -> Result<()> {
        self.tx
            .book()
            .post_write_inline(&self.qp, data, rkey, remote_addr)
    }

    /// Asks the receive CQ, and the send CQ if `send`, to signal the
    /// endpoint's channel at their next completion (see `endpoint/arm.rs`).
    pub fn arm(&mut self, send: bool) -> Result<()> {
        // (false also when an earlier arm may still hold: `arm_sends` then
        // arms again rather than trust it)
        self.send_armed = false;
        if send {
            self.arm_send()?;
        }
        self.rx.cq.req_notify()?;
        self.recv_armed = true;
        self.rx.take_polled();
        Ok(())
    }

    /// [`Self::arm`], but the receive CQ only if no connection polled it
    /// itself since the last arm (see `Endpoint::arm_unpolled`): whether it
    /// was armed.
    pub fn arm_unpolled(&mut self, send: bool) -> Result<bool> {
        if !self.recv_armed || !self.rx.take_polled() {
            self.arm(send)?;
            return Ok(true);
        }
        self.send_armed = false;
        if send {
            self.arm_send()?;
        }
        Ok(false)
    }

    /// Asks the send CQ to signal the endpoint's channel at its next completion.
    pub fn arm_send(&mut self) -> Result<()> {
        self.tx.scq.req_notify()?;
        self.send_armed = true;
        Ok(())
    }

    /// The QP has failed (posting to it fails with this, completions flush).
    pub fn failed(&self) -> bool {
        self.qp.state() == QpState::Err
    }

    /// Stops the link's QP: outstanding work requests flush.
    pub fn shut(&self) {
        self.book().open = false;
        self.rx.set_open(false);
        let _ = self.qp.modify(&QpModify::Err);
    }

    /// A fast post on this link failed since the last look: the error, to
    /// handle as a failed post of the endpoint's own (`Endpoint::link_error`).
    pub fn take_fast_error(&self) -> Option<smc_rdma::Error> {
        if !self.tx.attention.load(Ordering::Acquire) {
            return None;
        }
        self.tx.attention.store(false, Ordering::Release);
        self.book().broken.take()
    }
}

impl<P: Provider> Drop for LinkRes<P> {
    fn drop(&mut self) {
        // connections may still hold the link's send side: no fast post
        // once the endpoint has let the link go, nor a poll of its receive side
        self.book().open = false;
        self.rx.set_open(false);
    }
}

impl<P: Provider> LinkTx<P> {
    /// The link's send bookkeeping, locked. A panic while it was held
    /// cannot have left it half-updated in a way a poisoned lock would
    /// guard against any better: it is used as it is.
    #[inline]
    pub fn book(&self) -> MutexGuard<'_, TxBook<P>> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the send completions that have come (the caller holds
    /// `book`), for connection `me`'s fast path, which finds every SEND in
    /// flight (without this it would go through the endpoint, whose pump is
    /// where completions were taken): their SENDs leave the flight and give
    /// back their send slots now. Completed CDCs of `me`'s own are handed
    /// to `own`, a run of consecutive ones at once (the first seqno and how
    /// many), which applies them if it can (see `ConnCore::fast_write`);
    /// a run it refuses is offered again one CDC at a time. Every other
    /// completion, and `me`'s from the first that `own` refuses, wait in
    /// [`TxBook::reaped`] for the endpoint, which does the rest (a CDC's
    /// connection told, a failed one's link) at its next pump, in the send
    /// queue's order. Whether it took any. Nothing is taken while
    /// [`REAPED_MAX`] wait already: the fast path then goes through the
    /// endpoint, which takes them.
    pub fn reap(
        &self,
        book: &mut TxBook<P>,
        me: ConnId,
        mut own: impl FnMut(u16, usize) -> bool,
    ) -> bool {
        if book.reaped.len() >= REAPED_MAX {
            return false;
        }
        let mine = |k: &Option<WrKind>| matches!(k, Some(WrKind::Cdc(id, _)) if *id == me);
        // (a CDC of `me`'s that waits for the endpoint is older than any
        // taken now: applying a later one first would confirm it twice)
        let mut inline = !book.reaped.iter().any(|(_, k)| mine(k));
        let mut wcs = [smc_rdma::WorkCompletion::default(); 16];
        let mut took = false;
        // (a failed poll: the endpoint's own poll meets it again)
        while let Ok(n) = self.scq.poll(&mut wcs) {
            // `me`'s CDCs completed in a row: a completion of the first
            // (to stand for them all), its seqno, how many
            let mut run: Option<(smc_rdma::WorkCompletion, u16, usize)> = None;
            for wc in &wcs[..n] {
                book.complete(wc, |book, wc, kind| {
                    if let Some(WrKind::Cdc(id, seq)) = kind {
                        if inline && id == me && wc.status == WcStatus::Success {
                            match &mut run {
                                Some((_, first, len)) if first.wrapping_add(*len as u16) == seq => {
                                    *len += 1;
                                }
                                _ => {
                                    if let Some(r) = run.take() {
                                        own_run(book, me, r, &mut inline, &mut own);
                                    }
                                    run = Some((wc, seq, 1));
                                }
                            }
                            return;
                        }
                    }
                    // (before anything else, in the send queue's order)
                    if let Some(r) = run.take() {
                        own_run(book, me, r, &mut inline, &mut own);
                    }
                    // (a probe that did its work leaves nothing to do)
                    if kind != Some(WrKind::Probe) || wc.status != WcStatus::Success {
                        book.reaped.push((wc, kind));
                    }
                });
            }
            if let Some(r) = run.take() {
                own_run(book, me, r, &mut inline, &mut own);
            }
            took |= n > 0;
            if n < wcs.len() {
                break;
            }
        }
        if !book.reaped.is_empty() {
            self.reaped.store(true, Ordering::Release);
        }
        took
    }

    /// Whether a fast post of connection `me` may take a SEND and its send
    /// slot now, leaving one of each to spare for the endpoint (its
    /// flushes, LLC messages): after a [`Self::reap`] (with `own`) if every
    /// SEND seemed in flight.
    #[inline]
    pub fn has_room(
        &self,
        book: &mut TxBook<P>,
        me: ConnId,
        own: impl FnMut(u16, usize) -> bool,
    ) -> bool {
        let room = |b: &TxBook<P>| {
            b.sends_in_flight + 1 < b.max_sends
                && b.has_free_slots()
                && (!b.takes_slot(smc_wire::cdc::CDC_LEN) || b.free_small() >= 2)
        };
        room(book) || (self.reap(book, me, own) && room(book))
    }

    /// Connection `me`'s fast path wrote without a CDC (the caller holds
    /// `book`): listed for the endpoint ([`TxBook::corked`]), whose
    /// `arm_sends` at its lock's next release, or next poll of the send CQ,
    /// marks it for the flush.
    pub fn cork(&self, book: &mut TxBook<P>, me: ConnId) {
        if !book.corked.contains(&me) {
            book.corked.push(me);
        }
        self.reaped.store(true, Ordering::Release);
    }

    /// Whether [`Self::reap`] left completions, or [`Self::cork`]
    /// connections, for the endpoint.
    pub fn has_reaped(&self) -> bool {
        self.reaped.load(Ordering::Acquire)
    }

    /// The endpoint's poll of the send CQ (`Endpoint::poll_send`): what
    /// [`Self::reap`] took, then up to `wcs.len()` completions of the CQ,
    /// each with what its work request carried, in the send queue's order,
    /// into `out`; the CDCs the fast path posted since the last call are
    /// added to `cdc_sent`, and the connections that corked since
    /// ([`TxBook::corked`]) to `corked`. Whether the CQ may have more.
    pub fn take_completions(
        &self,
        wcs: &mut [smc_rdma::WorkCompletion],
        out: &mut Vec<(smc_rdma::WorkCompletion, Option<WrKind>)>,
        cdc_sent: &mut u64,
        corked: &mut Vec<ConnId>,
    ) -> Result<bool> {
        let mut book = self.book();
        *cdc_sent += self.fast_cdcs.take(&book);
        corked.append(&mut book.corked);
        out.append(&mut book.reaped);
        self.reaped.store(false, Ordering::Release);
        let n = self.scq.poll(wcs)?;
        for wc in &wcs[..n] {
            book.complete(wc, |_, wc, kind| out.push((wc, kind)));
        }
        Ok(n == wcs.len())
    }

    /// A fast post failed with `e` (the caller holds `book`): the link
    /// takes no more, and the endpoint's next pump handles the error.
    pub fn broke(&self, book: &mut TxBook<P>, e: smc_rdma::Error) {
        book.open = false;
        book.broken.get_or_insert(e);
        self.attention.store(true, Ordering::Release);
    }
}

/// A run of `me`'s CDC completions that [`LinkTx::reap`] found (a
/// completion of the first, its seqno, how many), handed to `own` at once,
/// else one by one while `own` takes them; from the first it refuses on,
/// they wait for the endpoint as every other completion does.
fn own_run<P: Provider>(
    book: &mut TxBook<P>,
    me: ConnId,
    (wc, first, len): (smc_rdma::WorkCompletion, u16, usize),
    inline: &mut bool,
    own: &mut impl FnMut(u16, usize) -> bool,
) {
    if own(first, len) {
        return;
    }
    let mut seq = first;
    for _ in 0..len {
        if !(*inline && own(seq, 1)) {
            *inline = false;
            book.reaped.push((wc, Some(WrKind::Cdc(me, seq))));
        }
        seq = seq.wrapping_add(1);
    }
}

impl<P: Provider> TxBook<P> {
    /// Posts a SEND on `qp` (see [`LinkRes::post`]), a CDC that rings the
    /// doorbell of the peer's RMB `bell` when its reader sleeps on it
    /// ([`LinkRes::post_cdc`]; an inline SEND only, as CDCs are). LLC
    /// messages and validation CDCs are signaled, and so is a CDC whose
    /// connection `wants` its completion (`DataPath::wants_completion`:
    /// a close, a send buffer filling up) or that ends a run of
    /// [`signal_every`] unsignaled ones; the rest complete with the next
    /// signaled one, and whoever waits for one of them while nothing
    /// signaled follows has a probe posted ([`Self::probe`]).
    pub fn post(
        &mut self,
        qp: &P::Qp,
        kind: WrKind,
        bytes: &[u8],
        bell: Option<u32>,
        wants: bool,
    ) -> Result<()> {
        self.next_wr += 1;
        let wr_id = self.next_wr;
        let signaled =
            wants || !matches!(kind, WrKind::Cdc(..)) || self.unsignaled + 1 >= self.signal_every;
        let slot = if bytes.len() <= self.max_inline {
            let wr = SendWr {
                wr_id,
                op: SendOp::Send,
                payload: Payload::Inline(bytes),
                signaled,
            };
            match bell {
                Some(k) => qp.post_send_ringing(&wr, k)?,
                None => qp.post_send(&wr)?,
            }
            None
        } else {
            let slot = self.take_slot(bytes.len())?;
            let posted = self.post_from_slot(qp, wr_id, slot, bytes, signaled);
            if let Err(e) = posted {
                self.give_slot(slot);
                return Err(e);
            }
            Some(slot)
        };
        self.wrs.push_back(InFlight {
            wr_id,
            kind,
            slot,
            signaled,
        });
        self.unsignaled = if signaled { 0 } else { self.unsignaled + 1 };
        self.sends_in_flight += 1;
        Ok(())
    }

    /// The connection whose CDC is the newest work request in flight, if
    /// that one went unsignaled: its completion, and those of the
    /// unsignaled ones before it, only a later signaled one can bring
    /// ([`Self::probe`]). (Only CDCs go unsignaled.)
    pub fn unsignaled_tail(&self) -> Option<ConnId> {
        match self.wrs.back() {
            Some(&InFlight {
                kind: WrKind::Cdc(id, _),
                signaled: false,
                ..
            }) => Some(id),
            _ => None,
        }
    }

    /// Posts a signaled zero-length RDMA WRITE to the peer's `(rkey, addr)`
    /// (a place in one of its RMBs on this link) if the newest work request
    /// in flight is unsignaled: its completion completes every one before
    /// it, in the send queue's order. For a waiter whose CDC went
    /// unsignaled and that nothing else would complete (a connection that
    /// stopped writing, a move between links). The peer's device executes
    /// it and no one there sees it (a WRITE without immediate data consumes
    /// no receive, IBTA C9-88 needs no access for zero bytes). Whether it
    /// posted one.
    pub fn probe(&mut self, qp: &P::Qp, rkey: u32, addr: u64) -> Result<bool> {
        if self.unsignaled_tail().is_none() {
            return Ok(false);
        }
        self.next_wr += 1;
        qp.post_send(&SendWr {
            wr_id: self.next_wr,
            op: SendOp::RdmaWrite {
                remote_addr: addr,
                rkey,
            },
            payload: Payload::Sges(&[]),
            signaled: true,
        })?;
        self.wrs.push_back(InFlight {
            wr_id: self.next_wr,
            kind: WrKind::Probe,
            slot: None,
            signaled: true,
        });
        self.unsignaled = 0;
        Ok(true)
    }

    fn post_from_slot(
        &self,
        qp: &P::Qp,
        wr_id: u64,
        slot: SendSlot,
        bytes: &[u8],
        signaled: bool,
    ) -> Result<()> {
        let buf = self
            .sendbuf
            .as_ref()
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no send buffer".into()))?;
        let at = slot.offset();
        buf.write_at(at, bytes)?;
        let sge = buf.sge(at, bytes.len() as u32)?;
        qp.post_send(&SendWr {
            wr_id,
            op: SendOp::Send,
            payload: Payload::Sges(&[sge]),
            signaled,
        })
    }

    /// A free send slot that takes `len` bytes.
    fn take_slot(&mut self, len: usize) -> Result<SendSlot> {
        let slot = if len <= SMALL_SLOT {
            self.free_small.pop().map(SendSlot::Small)
        } else if len <= LARGE_SLOT {
            self.free_large.pop().map(SendSlot::Large)
        } else {
            return Err(smc_rdma::Error::InvalidArgument(format!(
                "a SEND of {len} bytes exceeds the largest LLC message"
            )));
        };
        slot.ok_or(smc_rdma::Error::QueueFull)
    }

    fn give_slot(&mut self, slot: SendSlot) {
        match slot {
            SendSlot::Small(i) => self.free_small.push(i),
            SendSlot::Large(i) => self.free_large.push(i),
        }
    }

    /// Posts an unsignaled inline RDMA WRITE on `qp` (see
    /// [`LinkRes::post_write_inline`]).
    pub fn post_write_inline(
        &mut self,
        qp: &P::Qp,
        data: &[u8],
        rkey: u32,
        remote_addr: u64,
    ) -> Result<()> {
        self.next_wr += 1;
        qp.post_send(&SendWr {
            wr_id: self.next_wr,
            op: SendOp::RdmaWrite { remote_addr, rkey },
            payload: Payload::Inline(data),
            signaled: false,
        })
    }

    /// The completion `wc` came: takes its work request out of those in
    /// flight with every one posted before it, which an RC send queue
    /// completed first (unsignaled ones without a completion of their own,
    /// so successfully: a failed one always completes), handing each to
    /// `each` in the send queue's order with the completion it counts as
    /// (`wc` itself for its own, with its `wr_id` for the others, a
    /// success). Their send slots are free again, and their places in
    /// flight. A completion of no SEND in flight (an unsignaled WRITE's
    /// flushed by a failed QP) is handed on with `None`, after the SENDs
    /// posted before it.
    #[inline]
    pub fn complete(
        &mut self,
        wc: &smc_rdma::WorkCompletion,
        mut each: impl FnMut(&mut Self, smc_rdma::WorkCompletion, Option<WrKind>),
    ) {
        // (work-request ids grow with every post on the link)
        while let Some(&w) = self.wrs.front().filter(|w| w.wr_id <= wc.wr_id) {
            self.wrs.pop_front();
            if let Some(s) = w.slot {
                self.give_slot(s);
            }
            if w.kind != WrKind::Probe {
                self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
            }
            if w.wr_id == wc.wr_id {
                each(self, *wc, Some(w.kind));
                return;
            }
            let done = smc_rdma::WorkCompletion {
                wr_id: w.wr_id,
                status: WcStatus::Success,
                opcode: match w.kind {
                    WrKind::Probe => smc_rdma::WcOpcode::RdmaWrite,
                    _ => smc_rdma::WcOpcode::Send,
                },
                byte_len: 0,
                ..*wc
            };
            each(self, done, Some(w.kind));
        }
        each(self, *wc, None);
    }

    /// Whether a SEND of any size could take a send slot now (inline ones
    /// need none).
    pub fn has_free_slots(&self) -> bool {
        self.sendbuf.is_none() || (!self.free_small.is_empty() && !self.free_large.is_empty())
    }

    /// Whether a SEND of `len` bytes takes a send slot (else it goes inline).
    pub fn takes_slot(&self, len: usize) -> bool {
        len > self.max_inline
    }

    /// Small send slots free.
    pub fn free_small(&self) -> usize {
        self.free_small.len()
    }
}
