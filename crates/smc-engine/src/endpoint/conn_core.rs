//! A connection's data path as a thing of its own ([`ConnCore`]): its
//! [`DataPath`] (cursors, CDC sequence numbers, send-buffer bookkeeping), its
//! buffers, the leases lent on them, its close state, and the link it sends
//! on (slot, the peer RMB's place in the group's rtoken table, and a link
//! epoch that a failover or a move bumps). The endpoint holds it as
//! [`CoreRef`] (`Arc<Mutex<_>>`) in the connection's record and, by alert
//! token, in a table that a received CDC is dispatched through
//! (`Endpoint::on_cdc`); whoever else gets the `Arc` may lock it without the
//! endpoint (docs/FAST-PATH.md, step 4): a connection's handle
//! ([`FastConn`]) writes directly that way, on the link's own send lock
//! ([`LinkTx`]); everything else still comes through the endpoint.
//!
//! The methods here are the per-connection halves of the endpoint's data
//! path (`write.rs`, `read.rs`, `lease.rs`, `cdc_send.rs`, `cdc_recv.rs`,
//! `close.rs`): what needs only the connection. What needs the link group
//! (the link's state and rkey, posting on its QP, link errors) or the
//! endpoint's lists (flush marks, events, timers) stays there, and these
//! methods say what it has to do next.
//!
//! Spec: `protocol-llc-cdc.md` §2 (CDC), §3 (data transfer), §5 (close).
//! Linux keeps the same in `struct smc_connection` (smc.h), under the
//! socket's lock and `conn->send_lock`.

use super::conn::ConnError;
use super::events::AbortCause;
use super::lease::{ReadLease, ReadPlan};
use super::lgr::PeerRmb;
use super::link::{LinkRes, LinkTx, WrKind};
use super::ConnId;
use smc_proto::close::{CloseEvent, CloseState, Closer};
use smc_proto::datapath::{DataPath, Violation};
use smc_rdma::{Doorbell, MemWindow, MemoryRegion, Provider};
use smc_wire::cdc::{CdcMessage, RingChunks};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

/// A connection's data path, shared between the endpoint and whoever holds a
/// handle to the connection.
pub(super) type CoreRef<P> = Arc<Mutex<ConnCore<P>>>;

/// Locks a connection's core. A panic while one was held cannot have left
/// it half-updated in a way that a poisoned lock would guard against any
/// better (the engine does not panic on peer input): the data is used as it
/// is.
#[inline]
pub(super) fn lock<P: Provider>(core: &CoreRef<P>) -> MutexGuard<'_, ConnCore<P>> {
    core.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The per-connection data-path state (see the module documentation).
pub(super) struct ConnCore<P: Provider> {
    /// Established (the phase is `Smc`): data may move.
    pub(super) established: bool,
    /// The link (slot) the connection is assigned to.
    pub(super) link: Option<usize>,
    /// Bumped whenever the connection changes link (failover, move): a lease
    /// planned on an older epoch is not committed.
    pub(super) epoch: u64,
    /// A requested move to this link, done once no CDC is in flight on the old one.
    pub(super) move_to: Option<usize>,
    /// A failover validation CDC to send first on the new link (§2.4).
    pub(super) validation: Option<CdcMessage>,
    pub(super) rmb: Option<P::Mr>,
    pub(super) sndbuf: Option<P::Mr>,
    pub(super) dp: Option<DataPath>,
    pub(super) closer: Closer,
    pub(super) peer_rmb: Option<PeerRmb>,
    pub(super) violation: Option<Violation>,
    /// The peer's latest urgent (out-of-band) byte, until the application reads it.
    pub(super) oob: Option<u8>,
    /// The send cursor (absolute) after the last direct write: data up to
    /// here never was in the send buffer and cannot be replayed.
    pub(super) direct_sent: u64,
    /// A [`ReadLease`] is out: other reads find nothing until its commit.
    pub(super) read_leased: bool,
    /// A [`WriteLease`](super::WriteLease) is out: nothing else is written (or sent) until its
    /// commit, as it copies to where the next bytes go.
    pub(super) write_leased: bool,
    /// A write found the send buffer full and none has taken bytes since
    /// (the full send buffer is counted once per wait).
    pub(super) tx_full_noted: bool,
    /// Something was refused because of a lease since the last
    /// `Endpoint::take_lease_waited`.
    pub(super) lease_waited: bool,
    /// The window onto the peer's RMB that write leases lend, with the link
    /// slot and rkey it was made for (made again when they change).
    pub(super) peer_window: Option<(usize, u32, MemWindow)>,
    /// What the fast path writes with (see [`FastTx`]); `None` until a
    /// direct write of the endpoint granted it, and again from every change
    /// of link on.
    pub(super) fast: Option<FastTx<P>>,
    /// What a reader that finds nothing polls its link's receive CQ with
    /// (see [`FastRx`]); `None` until the endpoint's read found nothing on
    /// the link, and again from every change of link on.
    pub(super) fast_rx: Option<FastRx<P>>,
    /// The RMB's doorbell, once a reader asked for it ([`FastConn::bell`]):
    /// rung by every CDC applied to the connection (`Self::on_cdc`), which
    /// wakes a reader that sleeps on it whoever took the CDC.
    pub(super) bell: Option<Doorbell>,
    /// Told of the connection's [`ConnLevel`] after every change of it made
    /// here or by the fast path ([`FastConn::watch`]).
    pub(super) watch: Option<Watch>,
    /// Set by a read of the fast path that left nothing to read, cleared
    /// by every CDC applied to the connection (the only thing that makes
    /// bytes readable): while set, a reader of the fast path knows without
    /// the core's lock that it has to poll its link first
    /// ([`FastConn::try_read`]). Shared with the connection's handles.
    pub(super) drained: Arc<AtomicBool>,
}

/// What a connection's readiness depends on, as its core has it: what the
/// endpoint's `readable`, `sndbuf_free`, `peer_done`, `peer_closed` and
/// `close_state` tell of it, read together under the core's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLevel {
    /// Bytes received and not yet read.
    pub readable: usize,
    /// Bytes a write could take now (`DataPath::sndbuf_free`): a write
    /// blocks exactly when this is 0 (and the connection open).
    pub sndbuf_free: usize,
    /// The peer sends nothing more (end of file once `readable` is read).
    pub peer_done: bool,
    /// The peer closed or aborted (as opposed to only shutting down its
    /// write side).
    pub peer_closed: bool,
    /// The connection's close state.
    pub close: CloseState,
}

/// Told of a connection's [`ConnLevel`] ([`FastConn::watch`]), with the
/// connection's core locked: the calls are ordered by that lock, so the
/// last one tells the state as it is, whichever thread made it. It must
/// not lock the connection, its link or the endpoint.
pub type Watch = Arc<dyn Fn(&ConnLevel) + Send + Sync>;

/// A grant to poll the receive CQ of the connection's link without the
/// endpoint ([`FastConn::try_read`], `cdc_recv::dispatch`): the link's
/// receive side, its group and the endpoint's token table, valid while the
/// connection's link epoch is the one it was made on and the link is open
/// to it (`LinkRx::open`: the group's only link, active).
pub(super) struct FastRx<P: Provider> {
    pub(super) rx: Arc<super::link::LinkRx<P>>,
    pub(super) tokens: Arc<TokenTable<P>>,
    pub(super) lgr: super::LgrId,
    pub(super) slot: usize,
    pub(super) epoch: u64,
}

/// A grant to write directly without the endpoint ([`ConnCore::fast_write`]):
/// the link's send side and where the peer's RMB is on it, as the endpoint's
/// own direct write found them (`Endpoint::write_direct`), valid while the
/// connection's link epoch is the one it was made on and the link's send
/// side is open (`TxBook::open`).
pub(super) struct FastTx<P: Provider> {
    pub(super) tx: Arc<LinkTx<P>>,
    pub(super) id: ConnId,
    pub(super) slot: usize,
    pub(super) epoch: u64,
    pub(super) rkey: u32,
    /// The peer's RMBE, as the link addresses it.
    pub(super) rmbe_addr: u64,
    /// Largest write the device takes inline.
    pub(super) max_inline: usize,
}

/// What [`FastConn::try_read`] dispatches a link's receive CQ with.
type DispatchGrant<P> = (
    Arc<super::link::LinkRx<P>>,
    Arc<TokenTable<P>>,
    super::LgrId,
);

/// What a write of the fast path did ([`FastConn::try_write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastWrite {
    /// Written straight into the peer's RMB, with its CDC.
    Wrote(usize),
    /// Written, but posting failed: the link is broken, and the endpoint
    /// learns of it at its next pump, which should come soon (as a write
    /// of the endpoint, this write itself succeeded).
    WroteLinkBroke(usize),
    /// Not done: the connection cannot finish this write alone (not
    /// established, no room, no free send slot, its link changing, a close,
    /// a lease, or anything else the endpoint must see). Nothing changed:
    /// write through the endpoint (`Endpoint::write`).
    Declined,
}

/// What a read of the fast path did ([`FastConn::try_read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastRead {
    /// Read into the buffer.
    Read {
        /// Bytes read (at least one).
        n: usize,
        /// The read made a CDC due (a consumer-cursor update, §3.4), and it
        /// was posted.
        cdc: bool,
    },
    /// Read, but posting the consumer-cursor update failed: the link is
    /// broken, and the endpoint learns of it at its next pump, which should
    /// come soon (the bytes read are the caller's all the same).
    ReadLinkBroke(usize),
    /// Not done: nothing to read yet, or the connection cannot finish this
    /// read alone (not established, closing, a lease, urgent data, or a
    /// cursor update it may not send itself). Nothing changed: read
    /// through the endpoint (`Endpoint::read_into`).
    Declined,
}

/// A connection's handle for the fast path (docs/FAST-PATH.md, step 4):
/// what an established connection can do on its own, without the endpoint
/// (and so without the lock a driver keeps it under). Cloneable; obtained
/// from [`Endpoint::fast_conn`](super::Endpoint::fast_conn). Every call either
/// finishes or declines without a change (but for send completions it took
/// on the way, `LinkTx::reap`, whose effects are the endpoint's), and the
/// caller then goes through the endpoint.
pub struct FastConn<P: Provider> {
    core: CoreRef<P>,
    /// [`Self::doorbell`], looked up once.
    held_bell: OnceLock<Option<Doorbell>>,
    /// The core's [`ConnCore::drained`].
    drained: Arc<AtomicBool>,
    /// The link (receive side, token table, group) of the first grant to
    /// poll it that a read found ([`FastRx`]), for reads that know they
    /// have to poll without looking at the core ([`Self::try_read`]). Not
    /// kept up to date: a read polls it only while it is open to
    /// connections, which a link is only as its group's one active link,
    /// and any connection of the group may poll that one. (Weak: a handle
    /// does not keep a link that its connection has left alive.)
    rx_link: OnceLock<RxLink<P>>,
}

/// See [`FastConn::rx_link`].
struct RxLink<P: Provider> {
    rx: Weak<super::link::LinkRx<P>>,
    tokens: Arc<TokenTable<P>>,
    lgr: super::LgrId,
}

impl<P: Provider> Clone for RxLink<P> {
    fn clone(&self) -> Self {
        RxLink {
            rx: self.rx.clone(),
            tokens: self.tokens.clone(),
            lgr: self.lgr,
        }
    }
}

impl<P: Provider> Clone for FastConn<P> {
    fn clone(&self) -> Self {
        FastConn {
            core: self.core.clone(),
            held_bell: self.held_bell.clone(),
            drained: self.drained.clone(),
            rx_link: self.rx_link.clone(),
        }
    }
}

impl<P: Provider> FastConn<P> {
    pub(super) fn new(core: CoreRef<P>) -> FastConn<P> {
        let drained = lock(&core).drained.clone();
        FastConn {
            core,
            held_bell: OnceLock::new(),
            drained,
            rx_link: OnceLock::new(),
        }
    }

    /// The connection's doorbell ([`Self::bell`]), looked up at the first
    /// call only: for a writer that holds it ([`smc_rdma::Bell::hold`]) on every
    /// write.
    pub fn doorbell(&self) -> Option<&Doorbell> {
        self.held_bell.get_or_init(|| self.bell()).as_ref()
    }

    /// After a [`smc_rdma::Bell::hold`] that a CDC took ([`smc_rdma::Bell::release`]): takes the
    /// link's receive CQ as a reader's dispatch does, so that the CDC that
    /// took it is applied. Whether everything found was (`false`: another
    /// thread had the CQ, or something waits for the endpoint, which must
    /// then pump).
    pub fn take_held_cdc(&self) -> bool {
        // (also when the connection has bytes to read already: a dispatch
        // for another connection may have applied some of its CDCs, not
        // necessarily the one that took the doorbell, which may still
        // wait in the receive CQ)
        let Some((rx, tokens, l)) = lock(&self.core).link_grant(true) else {
            return false;
        };
        super::cdc_recv::dispatch_all(&rx, &tokens, l) == Some(true)
    }

    /// Writes all of `data` straight into the peer's RMB with its CDC, if
    /// the connection can do that alone now (see [`FastWrite`]); the same
    /// as the direct path of `Endpoint::write` on the wire (inline RDMA
    /// WRITEs and one CDC).
    #[inline]
    pub fn try_write(&self, data: &[u8]) -> std::result::Result<FastWrite, ConnError> {
        let mut k = lock(&self.core);
        let r = k.fast_write(data);
        if matches!(r, Ok(FastWrite::Wrote(_) | FastWrite::WroteLinkBroke(_))) {
            k.watched();
        }
        r
    }

    /// Reads into `buf` straight from the RMB what has arrived, if the
    /// connection can do that alone now (see [`FastRead`]), and posts the
    /// consumer-cursor update that the read makes due (§3.4) as
    /// [`Self::try_write`] posts its CDC; the same as `Endpoint::read_into`
    /// followed by the endpoint's flush.
    ///
    /// When nothing has arrived yet, it takes what its link's receive CQ
    /// holds without the endpoint (`cdc_recv::dispatch`: CDCs applied to
    /// their connections, whatever else left for the endpoint's next
    /// pump), if the connection may poll that link alone (the grant of
    /// `FastRx`: one active link in its group), and looks again.
    #[inline]
    pub fn try_read(&self, buf: &mut [u8]) -> FastRead {
        // A reader that emptied the connection and has seen no CDC applied
        // to it since polls its link first (a reader that comes before its
        // data, the common case), without a look at the core that would
        // only decline; then it reads, whatever the poll found.
        if !buf.is_empty() && self.drained.load(Ordering::Acquire) {
            if let Some(g) = self.rx_link.get() {
                if let Some(rx) = g.rx.upgrade().filter(|rx| rx.is_open()) {
                    // (the link's receive lock is taken before a
                    // connection's core, as below)
                    super::cdc_recv::dispatch(&rx, &g.tokens, g.lgr);
                    drop(rx);
                    let mut k = lock(&self.core);
                    let r = k.fast_read(buf);
                    if r != FastRead::Declined {
                        k.watched();
                    }
                    return r;
                }
            }
        }
        let mut k = lock(&self.core);
        let r = k.fast_read(buf);
        if r != FastRead::Declined {
            k.watched();
            return r;
        }
        if buf.is_empty() {
            return r;
        }
        let Some((rx, tokens, l)) = k.dispatch_grant() else {
            return r;
        };
        drop(k);
        if self.rx_link.get().is_none() {
            let _ = self.rx_link.set(RxLink {
                rx: Arc::downgrade(&rx),
                tokens: tokens.clone(),
                lgr: l,
            });
        }
        // (the link's receive lock is taken before a connection's core,
        // by the endpoint's poll as here)
        if !super::cdc_recv::dispatch(&rx, &tokens, l) {
            return r;
        }
        let mut k = lock(&self.core);
        let r = k.fast_read(buf);
        if r != FastRead::Declined {
            k.watched();
        }
        r
    }

    /// Has `w` told of the connection's level after every change the core
    /// sees from now on (a CDC applied by whichever thread took it, a read
    /// or write of the fast path, a send completion, a close event; `None`:
    /// no more), and tells it the level now. Changes made through the
    /// endpoint's reads and writes are told by [`Self::refresh`].
    pub fn watch(&self, w: Option<Watch>) {
        let mut k = lock(&self.core);
        k.watch = w;
        k.watched();
    }

    /// Tells the watch ([`Self::watch`]) the connection's level now.
    pub fn refresh(&self) {
        lock(&self.core).watched();
    }

    /// What the connection's readiness depends on now.
    pub fn level(&self) -> ConnLevel {
        lock(&self.core).level()
    }

    /// The doorbell of the connection's RMB (`MemoryRegion::doorbell`), if
    /// the device has doorbells: a reader arms it, asks [`Self::may_sleep`]
    /// and then sleeps on it; the peer's next CDC for the connection rings
    /// it (`QueuePair::post_send_ringing`), as does whoever applies a CDC
    /// to the connection here (docs/FAST-PATH.md, step 6).
    pub fn bell(&self) -> Option<Doorbell> {
        let mut k = lock(&self.core);
        if k.bell.is_none() {
            k.bell = k.rmb.as_ref().and_then(|m| m.doorbell());
        }
        k.bell.clone()
    }

    /// After the reader armed the doorbell ([`Self::bell`]): whether it may
    /// sleep on it until a CDC comes — the connection established and open,
    /// with nothing to read and nothing the endpoint must act on (nothing
    /// unsent, no lease, close, urgent byte or violation), able to poll its
    /// link alone, and that poll, made now, leaving nothing for the endpoint
    /// ([`MaySleep`]).
    pub fn may_sleep(&self) -> MaySleep {
        let k = lock(&self.core);
        let Some((rx, tokens, l)) = k.dispatch_grant() else {
            return if k.dp.as_ref().is_some_and(|dp| dp.readable() > 0) {
                MaySleep::Again
            } else {
                MaySleep::No
            };
        };
        if k.write_leased
            || k.validation.is_some()
            || k.dp
                .as_ref()
                .is_none_or(|dp| dp.unsent() > 0 || dp.urgent_pending() || dp.close_pending())
        {
            return MaySleep::No;
        }
        drop(k);
        match super::cdc_recv::dispatch_all(&rx, &tokens, l) {
            None => MaySleep::Busy,
            Some(false) => MaySleep::No,
            Some(true) => {
                if lock(&self.core)
                    .dp
                    .as_ref()
                    .is_some_and(|dp| dp.readable() > 0)
                {
                    MaySleep::Again
                } else {
                    MaySleep::Sleep
                }
            }
        }
    }
}

/// Whether a reader may sleep on its connection's doorbell now
/// ([`FastConn::may_sleep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaySleep {
    /// Yes: nothing to read, the link's receive CQ taken (after the caller
    /// armed the doorbell) and nothing left for the endpoint; a CDC for the
    /// connection from now on rings the doorbell.
    Sleep,
    /// Not now: something arrived: read again.
    Again,
    /// Another thread polls the link: it applies what it finds, and rings
    /// the doorbell for a CDC of the connection, but may have looked before
    /// the peer's last SEND was there (which then signalled the armed
    /// completion channel, if any; sleep a bounded time).
    Busy,
    /// No: the endpoint has to act (wait through it).
    No,
}

/// What a write into the send buffer did ([`ConnCore::write_buffered`]),
/// for the endpoint's counters and flush marks.
pub(super) struct Buffered {
    /// Bytes taken.
    pub(super) n: usize,
    /// The write was larger than the whole send buffer.
    pub(super) too_small: bool,
    /// The write was larger than the peer's RMB.
    pub(super) peer_too_small: bool,
    /// Nothing was taken for want of room, the first time in this wait.
    pub(super) full: bool,
}

/// What the completion of a CDC's send left ([`ConnCore::on_cdc_sent`]).
pub(super) struct CdcSent {
    /// Bytes still unsent (a close that waits for them waits on while the
    /// peer takes some: `Conn::close_progress`).
    pub(super) unsent: Option<usize>,
    /// The connection's close is finished: once its last CDC completed it
    /// may be freed.
    pub(super) finished: bool,
}

/// What a received CDC did to its connection ([`ConnCore::on_cdc`]).
#[derive(Default)]
pub(super) struct CdcDone {
    /// It began an abort, for this reason.
    pub(super) aborted: Option<AbortCause>,
    /// The connection's close is finished: it may be freed.
    pub(super) finished: bool,
}

/// One step of sending ([`ConnCore::flush_step`]).
pub(super) enum FlushStep {
    /// A batch (or the validation CDC) went out: the next may follow.
    Posted,
    /// Nothing is left to send.
    Clean,
    /// Nothing more can go now (link busy or unusable, no rkey, not established).
    Blocked,
    /// Posting on the link failed: the link is broken.
    LinkError(smc_rdma::Error),
}

/// Whether a CDC names the peer's doorbell (`QueuePair::post_send_ringing`):
/// only one that brings data and nothing else the peer's application must
/// see at once — no close, abort or urgent byte. An event loop that the
/// doorbell wakes directly (`Bell::arm_polled`) learns "readable" from it
/// and no more, so a CDC that ends the connection goes through the peer's
/// completion channel, whose applier shows it on the readiness descriptor
/// whole (an end of file with its `EPOLLRDHUP` in one event, as Linux shows
/// a FIN, tcp.c `tcp_poll`), and a cursor update, which brings nothing to
/// read, wakes no reader. A reader asleep on the doorbell is woken by that
/// applier then (`ConnCore::on_cdc` rings it).
fn names_bell(cdc: &CdcMessage, brings_data: bool) -> bool {
    brings_data
        && cdc.conn_flags.is_empty()
        && !cdc.prod_flags.urg_data_pending()
        && !cdc.prod_flags.urg_data_present()
}

impl<P: Provider> ConnCore<P> {
    pub(super) fn new() -> ConnCore<P> {
        ConnCore {
            established: false,
            link: None,
            epoch: 0,
            move_to: None,
            validation: None,
            rmb: None,
            sndbuf: None,
            dp: None,
            closer: Closer::new(),
            peer_rmb: None,
            violation: None,
            oob: None,
            direct_sent: 0,
            read_leased: false,
            write_leased: false,
            tx_full_noted: false,
            lease_waited: false,
            peer_window: None,
            fast: None,
            fast_rx: None,
            bell: None,
            watch: None,
            drained: Arc::default(),
        }
    }

    /// What the connection's readiness depends on now.
    pub(super) fn level(&self) -> ConnLevel {
        ConnLevel {
            readable: self.readable(),
            sndbuf_free: self.dp.as_ref().map_or(0, DataPath::sndbuf_free),
            peer_done: self.closer.peer_done(),
            peer_closed: self.closer.rx_flags().any_close(),
            close: self.closer.state(),
        }
    }

    /// Tells the watch, if any, the connection's level (after a change).
    #[inline]
    pub(super) fn watched(&self) {
        if let Some(w) = &self.watch {
            w(&self.level());
        }
    }

    /// Changes the connection's link (a failover, a move, a relink for an
    /// abort): leases planned before are not committed.
    pub(super) fn set_link(&mut self, to: Option<usize>) {
        self.link = to;
        self.epoch = self.epoch.wrapping_add(1);
        self.fast = None;
        self.fast_rx = None;
    }

    /// The fast path's write (see [`FastConn::try_write`]): the conditions
    /// of the endpoint's direct write (`Endpoint::direct_plan`) that the
    /// connection can see, the link's as the grant recorded them, and what
    /// keeps the endpoint from having to learn of it: the write leaves the
    /// connection with nothing to send or wait for (room in its send
    /// buffer, nothing unsent, no close, urgent byte or move), and the link
    /// with a free SEND and send slot, so that no sleeping driver has to
    /// arm its send CQ for this CDC's completion (`endpoint/arm.rs`).
    #[inline]
    pub(super) fn fast_write(&mut self, data: &[u8]) -> std::result::Result<FastWrite, ConnError> {
        let Some(f) = self.fast.as_ref() else {
            return Ok(FastWrite::Declined);
        };
        if f.epoch != self.epoch || self.link != Some(f.slot) {
            self.fast = None;
            return Ok(FastWrite::Declined);
        }
        if self.write_leased
            || !self.established
            || self.move_to.is_some()
            || self.validation.is_some()
            || self.closer.state() != CloseState::Active
            || self.peer_rmb.is_none()
        {
            return Ok(FastWrite::Declined);
        }
        let Some(dp) = self.dp.as_mut() else {
            return Ok(FastWrite::Declined);
        };
        let n = data.len();
        if n == 0 || n > f.max_inline {
            return Ok(FastWrite::Declined);
        }
        let mut book = f.tx.book();
        // A completion of this connection's own CDCs that this write's reap
        // takes is applied here, as `Endpoint::poll_send` would: with
        // nothing unsent and no close (checked above) the endpoint would
        // have nothing to flush or finish for it, and the connection had
        // room in its send buffer already (`n < sndbuf_free`), so no thread
        // or task can be waiting to write (only a completion gives room, and
        // the endpoint's wakes them): it only grows, told to the watch after
        // the write (`FastConn::try_write`).
        if !book.open
            || !f
                .tx
                .has_room(&mut book, f.id, |seq, n| dp.on_cdcs_sent(seq, n).is_ok())
        {
            return Ok(FastWrite::Declined);
        }
        // (declined unless nothing is unsent, urgent or closing before these
        // bytes and the peer's RMBE and the send buffer have room for them)
        let Some((dst, cdc)) = dp.poll_tx_direct(n) else {
            return Ok(FastWrite::Declined);
        };
        self.direct_sent = dp.sent_total();
        let qp = &*f.tx.qp;
        let mut posted = Ok(());
        let mut at = 0;
        // The peer's RMBE mapped here, where the provider has it
        // (`QueuePair::remote_window`, the shared-memory device; made with
        // the grant, `Endpoint::grant_fast`): the write copies into it
        // itself instead of posting a WRITE, then posts its CDC, which the
        // QP orders after the copy as after a WRITE.
        let win = match &self.peer_window {
            Some((slot, rkey, w)) if *slot == f.slot && *rkey == f.rkey => Some(w),
            _ => None,
        };
        for &(peer_offset, len) in dst.as_slice() {
            let part = &data[at..at + len];
            // (a copy the window refuses, the region gone, is posted as a
            // WRITE, which fails the way the peer's loss of it should)
            let copied = win.is_some_and(|win| win.write_at(peer_offset, part).is_ok());
            if !copied {
                let addr = f.rmbe_addr + peer_offset as u64;
                posted = book.post_write_inline(qp, part, f.rkey, addr);
                if posted.is_err() {
                    break;
                }
            }
            at += len;
        }
        if posted.is_ok() {
            posted = book.post(
                qp,
                WrKind::Cdc(f.id, cdc.seqno),
                &cdc.encode(),
                names_bell(&cdc, n > 0).then_some(f.rkey),
            );
        }
        match posted {
            Ok(()) => {
                f.tx.fast_cdcs.add(&*book);
                Ok(FastWrite::Wrote(n))
            }
            // (as the endpoint's direct write: what did not go out stays
            // accounted as in flight, the link is down)
            Err(e) => {
                f.tx.broke(&mut book, e);
                Ok(FastWrite::WroteLinkBroke(n))
            }
        }
    }

    /// The fast path's read (see [`FastConn::try_read`]): what
    /// `Endpoint::read_into` would do when the endpoint has nothing to act
    /// on — an established, open connection without leases, urgent data
    /// or a violation, with bytes to read — and, when the read makes a CDC
    /// due, only where `fast_write` could post one: with a valid grant, on
    /// an open link with a SEND and send slot to spare beyond this one,
    /// and nothing else of the connection waiting to be sent (so the CDC
    /// carries the cursor alone, as the endpoint's flush would send it).
    /// What a reader that found nothing polls its link's receive CQ with
    /// ([`FastConn::try_read`]): `None` unless the connection has nothing
    /// to read yet and could read alone (established, active close state,
    /// no read lease or violation) and holds a valid grant to poll its
    /// link ([`FastRx`]).
    fn dispatch_grant(&self) -> Option<DispatchGrant<P>> {
        self.link_grant(false)
    }

    /// [`Self::dispatch_grant`], also while the connection has bytes to
    /// read if `with_bytes`.
    fn link_grant(&self, with_bytes: bool) -> Option<DispatchGrant<P>> {
        let dp = self.dp.as_ref()?;
        let f = self.fast_rx.as_ref()?;
        if (dp.readable() > 0 && !with_bytes)
            || !self.established
            || self.read_leased
            || self.violation.is_some()
            || self.closer.state() != CloseState::Active
            || f.epoch != self.epoch
            || self.link != Some(f.slot)
            || self.move_to.is_some()
            || !f.rx.is_open()
        {
            return None;
        }
        Some((f.rx.clone(), f.tokens.clone(), f.lgr))
    }

    #[inline]
    pub(super) fn fast_read(&mut self, buf: &mut [u8]) -> FastRead {
        // (nothing to read first, without the rest: the common case of a
        // reader that comes before its data)
        if self.dp.as_ref().is_none_or(|dp| dp.readable() == 0) {
            return FastRead::Declined;
        }
        self.fast_read_some(buf)
    }

    /// [`Self::fast_read`] once there are bytes to read.
    fn fast_read_some(&mut self, buf: &mut [u8]) -> FastRead {
        let (Some(dp), Some(rmb)) = (self.dp.as_mut(), self.rmb.as_ref()) else {
            return FastRead::Declined;
        };
        let n = buf.len().min(dp.readable());
        // Bytes the peer sent before it closed or shut down its write side
        // (its close CDC often comes in the same dispatch as its last data)
        // are read here too; what follows them, the end of file, is the
        // endpoint's to tell.
        let active = self.closer.state() == CloseState::Active;
        let peer_finished = matches!(
            self.closer.state(),
            CloseState::AppCloseWait1 | CloseState::AppCloseWait2
        ) && !self.closer.rx_flags().abort;
        if n == 0
            || !self.established
            || self.read_leased
            || self.violation.is_some()
            || !(active || peer_finished)
            || dp.urgent_signalled()
        {
            return FastRead::Declined;
        }
        let mut post = None;
        let plan = dp.plan_consume(n);
        if plan.cdc_owed() {
            let Some(f) = self.fast.as_ref() else {
                return FastRead::Declined;
            };
            // (a cursor update after the peer's close: the endpoint's call)
            if !active
                || f.epoch != self.epoch
                || self.link != Some(f.slot)
                || self.write_leased
                || self.move_to.is_some()
                || self.validation.is_some()
                || dp.unsent() > 0
                || dp.urgent_pending()
                || dp.close_pending()
            {
                return FastRead::Declined;
            }
            let mut book = f.tx.book();
            // (the connection's own completions applied as in `fast_write`,
            // where it has room in its send buffer: else a writer may wait
            // for them, whom the endpoint wakes)
            let room = dp.sndbuf_free() > 0;
            if !book.open
                || !f.tx.has_room(&mut book, f.id, |seq, n| {
                    room && dp.on_cdcs_sent(seq, n).is_ok()
                })
            {
                return FastRead::Declined;
            }
            post = Some((f, book));
        }
        let chunks = dp.readable_chunks(n);
        let mut at = 0;
        for &(off, len) in chunks.as_slice() {
            if rmb.read_at(off, &mut buf[at..at + len]).is_err() {
                // (nothing consumed: the endpoint's read reports it)
                return FastRead::Declined;
            }
            at += len;
        }
        debug_assert_eq!(at, n);
        dp.consume_planned(plan);
        if dp.readable() == 0 {
            self.drained.store(true, Ordering::Release);
        }
        let Some((f, mut book)) = post else {
            return FastRead::Read { n, cdc: false };
        };
        // (nothing unsent, no close or urgent byte: a CDC alone)
        let Some(batch) = dp.poll_tx() else {
            return FastRead::Read { n, cdc: false };
        };
        debug_assert!(batch.writes.is_empty(), "a cursor update carries no data");
        // (a cursor update: no data for the peer's reader, see `names_bell`)
        match book.post(
            &f.tx.qp,
            WrKind::Cdc(f.id, batch.cdc.seqno),
            &batch.cdc.encode(),
            None,
        ) {
            Ok(()) => {
                f.tx.fast_cdcs.add(&*book);
                FastRead::Read { n, cdc: true }
            }
            // (as a failed post of the endpoint's flush: the CDC stays
            // accounted as in flight, the link is down)
            Err(e) => {
                f.tx.broke(&mut book, e);
                FastRead::ReadLinkBroke(n)
            }
        }
    }

    /// The data path, when there is one (SMC: from the Accept / Confirm on).
    #[inline]
    pub(super) fn smc(&mut self) -> Result<&mut DataPath, ConnError> {
        self.dp.as_mut().ok_or(ConnError::NotConnected)
    }

    /// The error a closed or failed connection's reads and writes see.
    pub(super) fn close_error(&self) -> ConnError {
        match self.closer.error() {
            Some(smc_proto::close::CloseError::Reset) => ConnError::Reset,
            Some(smc_proto::close::CloseError::Aborted) => ConnError::Aborted,
            // writing to a peer that closed: ECONNRESET, as Linux
            None if self.closer.rx_flags().any_close() && !self.closer.tx_flags().any() => {
                ConnError::Reset
            }
            None => ConnError::Closed,
        }
    }

    /// Hands `ev` to the closer; close flags it wants sent go into the data path.
    pub(super) fn close_event(&mut self, ev: CloseEvent) {
        let o = self.closer.handle(ev);
        if let (Some(f), Some(dp)) = (o.send_cdc, self.dp.as_mut()) {
            dp.set_close_flags(f);
        }
        self.watched();
    }

    /// `shutdown(SHUT_WR)` or `close()` (see `Endpoint::close`). `Some`: the
    /// close waits for this many unsent bytes (the endpoint's close timer).
    pub(super) fn close(&mut self, ev: CloseEvent) -> Option<usize> {
        let o = self.closer.handle(ev);
        if let (Some(f), Some(dp)) = (o.send_cdc, self.dp.as_mut()) {
            dp.set_close_flags(f);
            if dp.close_pending() {
                return Some(dp.unsent());
            }
        }
        None
    }

    /// Bytes not sent yet, if there is a data path (for the close timer).
    pub(super) fn unsent(&self) -> Option<usize> {
        self.dp.as_ref().map(DataPath::unsent)
    }

    /// Whether a closed connection has nothing left to send (see
    /// `Endpoint::close_sent`).
    pub(super) fn close_sent(&self) -> bool {
        if !self.established || self.link.is_none() {
            return true;
        }
        let Some(dp) = self.dp.as_ref() else {
            return true;
        };
        if matches!(
            self.closer.state(),
            CloseState::Closed | CloseState::ProcessAbort | CloseState::PeerAbortWait
        ) {
            return true;
        }
        !dp.close_pending() && dp.close_flags_sent().any() && dp.unsent() == 0
    }

    /// Whether a finished connection's last CDC went out and completed (or
    /// its group is dead, `lgr_dead`): it may be freed.
    pub(super) fn reapable(&self, lgr_dead: bool) -> bool {
        // Our final CDC must have gone out and completed: the peer waits for
        // it (PEERCLOSEWAIT) and may still write until then. After a failover
        // it is sent again on the new link.
        self.closer.is_finished()
            && (lgr_dead
                || (self.validation.is_none()
                    && self.dp.as_ref().is_none_or(|dp| {
                        dp.cdcs_in_flight() == 0 && !dp.close_pending() && !dp.cdc_wanted()
                    })))
    }

    /// Copies into the send buffer (the buffered path of `Endpoint::write`).
    pub(super) fn write_buffered(&mut self, data: &[u8]) -> Result<Buffered, ConnError> {
        self.smc()?;
        if !self.closer.can_write() {
            return Err(self.close_error());
        }
        let none = Buffered {
            n: 0,
            too_small: false,
            peer_too_small: false,
            full: false,
        };
        if self.write_leased {
            // the lease copies to where these bytes would go: wait for it
            self.lease_waited = true;
            return Ok(none);
        }
        let (Some(dp), Some(sndbuf)) = (self.dp.as_mut(), self.sndbuf.as_ref()) else {
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
        // (smc_tx.c `smc_tx_sendmsg`: a send larger than the send buffer or
        // the peer's RMB, and a send that must wait for room)
        let (whole, peer) = (sndbuf.len(), dp.config().peer_rmbe_len);
        let noted = std::mem::replace(&mut self.tx_full_noted, n == 0 && !data.is_empty());
        Ok(Buffered {
            n,
            too_small: n > 0 && data.len() > whole,
            peer_too_small: n > 0 && data.len() > peer,
            full: n == 0 && !data.is_empty() && !noted,
        })
    }

    /// Where the bytes a read of up to `max` bytes takes now are in the RMB,
    /// and how many (see `Endpoint::readable_now`).
    #[inline]
    pub(super) fn readable_now(
        &mut self,
        max: usize,
    ) -> Result<Option<(RingChunks, usize)>, ConnError> {
        self.smc()?;
        if self.closer.error().is_some() && self.dp.as_ref().is_none_or(|dp| dp.readable() == 0) {
            // A peer that closed in order and then went away (its process
            // exited, taking the link) sent everything: end of file, not an
            // error, as the kernel's socket would have finished that close.
            let rx = self.closer.rx_flags();
            if (rx.done_writing || rx.closed) && !rx.abort {
                return Ok(None);
            }
            return Err(self.close_error());
        }
        let Some(dp) = self.dp.as_mut().filter(|_| self.rmb.is_some()) else {
            return Err(ConnError::NotConnected);
        };
        if self.read_leased {
            // a lease has the readable bytes (they still count as readable,
            // so this is no end of file): wait for its commit
            self.lease_waited = true;
            return Ok(None);
        }
        // (nothing to read, the common case of a reader that waits: no
        // chunks to work out)
        let chunks = if max == 0 || dp.readable() == 0 {
            RingChunks::default()
        } else {
            dp.readable_chunks(max)
        };
        let n: usize = chunks.as_slice().iter().map(|&(_, l)| l).sum();
        if n == 0 {
            dp.consumed(0);
            return Ok(None);
        }
        Ok(Some((chunks, n)))
    }

    /// Reads into `buf` straight from the RMB (see `Endpoint::read_into`):
    /// bytes read, and whether a consumer-cursor update may be due.
    #[inline]
    pub(super) fn read_into(&mut self, buf: &mut [u8]) -> Result<(usize, bool), ConnError> {
        let n = self.copy_readable(buf)?;
        if n == 0 {
            return Ok((0, false));
        }
        Ok((n, self.read_commit(n)?))
    }

    /// Copies the bytes a read of `buf.len()` would take into `buf`,
    /// consuming nothing; how many (0: none now, see `readable_now`).
    fn copy_readable(&mut self, buf: &mut [u8]) -> Result<usize, ConnError> {
        let Some((chunks, n)) = self.readable_now(buf.len())? else {
            return Ok(0);
        };
        let rmb = self.rmb.as_ref().ok_or(ConnError::NotConnected)?;
        let mut at = 0;
        for &(off, len) in chunks.as_slice() {
            if rmb.read_at(off, &mut buf[at..at + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            at += len;
        }
        debug_assert_eq!(at, n);
        Ok(n)
    }

    /// `n` read bytes' space in the RMB is free (see `Endpoint::read_commit`);
    /// true if a consumer-cursor update may be due.
    #[inline]
    pub(super) fn read_commit(&mut self, n: usize) -> Result<bool, ConnError> {
        self.smc()?;
        self.read_leased = false;
        let dp = self.dp.as_mut().ok_or(ConnError::NotConnected)?;
        Ok(dp.consumed(n) > 0)
    }

    /// See `Endpoint::read_peek`.
    pub(super) fn read_peek(&mut self, buf: &mut [u8]) -> Result<usize, ConnError> {
        let n = self.copy_readable(buf)?;
        if n > 0 {
            self.read_leased = true;
        }
        Ok(n)
    }

    /// See `Endpoint::read_lease`.
    pub(super) fn read_lease(&mut self, max: usize) -> Result<ReadPlan, ConnError> {
        let Some((chunks, n)) = self.readable_now(max)? else {
            return Ok(ReadPlan::Empty);
        };
        match self.rmb.as_ref().and_then(MemoryRegion::window) {
            Some(win) => {
                self.read_leased = true;
                Ok(ReadPlan::Lease(ReadLease::new(win, chunks, n)))
            }
            None => Ok(ReadPlan::NoWindow),
        }
    }

    /// Bytes received and not yet read.
    #[inline]
    pub(super) fn readable(&self) -> usize {
        self.dp.as_ref().map_or(0, DataPath::readable)
    }

    /// Applies a CDC of the peer (`Endpoint::on_cdc`) to an established data
    /// path: cursors, urgent byte, close flags, violations.
    #[inline]
    pub(super) fn on_cdc(&mut self, m: &CdcMessage) -> CdcDone {
        let d = self.apply_cdc(m);
        // (whoever applied it: a reactor waiting on the connection's
        // readiness learns of the data from this thread)
        self.watched();
        d
    }

    fn apply_cdc(&mut self, m: &CdcMessage) -> CdcDone {
        let Some(dp) = self.dp.as_mut() else {
            return CdcDone::default();
        };
        let r = dp.on_cdc(m);
        // (a load first: the line stays shared while nobody drained it)
        if self.drained.load(Ordering::Relaxed) {
            self.drained.store(false, Ordering::Release);
        }
        // (under the core's lock: the woken reader looks at the core next)
        if let Some(b) = &self.bell {
            b.ring();
        }
        // Keep the urgent byte apart at once: normal reads skip it and its RMB
        // space is then reused, while recv(MSG_OOB) may come later (TCP keeps it).
        if let (Some(off), Some(rmb)) = (dp.urgent_offset(), self.rmb.as_ref()) {
            let mut b = [0u8; 1];
            if rmb.read_at(off, &mut b).is_ok() {
                self.oob = Some(b[0]);
                dp.urgent_taken();
            }
        }
        let aborting =
            |s: CloseState| matches!(s, CloseState::PeerAbortWait | CloseState::ProcessAbort);
        let was_aborting = aborting(self.closer.state());
        let cause = match r {
            Ok(r) if r.close.any() => {
                self.close_event(CloseEvent::Peer(r.close));
                AbortCause::Peer
            }
            Ok(_) => return CdcDone::default(),
            Err(v) => {
                // A broken peer, or loss shown by a failover validation (§2.4):
                // abort, with a CDC that says so. (A kill closes at once, never
                // passing through an aborting state: an abort of a connection
                // that was open.)
                self.violation = Some(v);
                let open = !matches!(self.closer.state(), CloseState::Init | CloseState::Closed);
                self.close_event(CloseEvent::Kill { can_send: true });
                return CdcDone {
                    aborted: (open && !was_aborting).then_some(AbortCause::Violation),
                    finished: self.closer.is_finished(),
                };
            }
        };
        let now_aborting = !was_aborting && aborting(self.closer.state());
        CdcDone {
            aborted: now_aborting.then_some(cause),
            finished: self.closer.is_finished(),
        }
    }

    /// The send of our CDC `seq` on link `slot` completed (see
    /// `Endpoint::poll_send`). `None` if the connection has moved off that
    /// link since.
    #[inline]
    pub(super) fn on_cdc_sent(&mut self, slot: usize, seq: u16) -> Option<CdcSent> {
        if self.link != Some(slot) {
            return None;
        }
        if let Some(Err(v)) = self.dp.as_mut().map(|dp| dp.on_cdc_sent(seq)) {
            self.violation = Some(v);
        }
        // (room in the send buffer again)
        self.watched();
        Some(CdcSent {
            unsent: self.unsent(),
            finished: self.closer.is_finished(),
        })
    }

    /// The connection's own conditions for the direct path of
    /// `Endpoint::write` (the link's are the endpoint's): its link slot and
    /// the peer RMB's place. `lessee`: asked for the commit of the write
    /// lease, which other writers wait for.
    #[inline]
    pub(super) fn direct_ready(
        &mut self,
        lessee: bool,
    ) -> Result<(usize, PeerRmb), super::write::Direct> {
        use super::write::Direct;
        if self.write_leased && !lessee {
            self.lease_waited = true;
            return Err(Direct::NoRoom);
        }
        let (Some(slot), Some(dp), Some(peer)) = (self.link, self.dp.as_ref(), self.peer_rmb)
        else {
            return Err(Direct::No);
        };
        if !self.established
            || self.move_to.is_some()
            || self.validation.is_some()
            || !self.closer.can_write()
            || dp.unsent() > 0
            || dp.urgent_pending()
            || dp.close_pending()
        {
            return Err(Direct::No);
        }
        Ok((slot, peer))
    }

    /// Produces `n` bytes that go straight into the peer's RMB at `rmbe_addr`
    /// (with `rkey`) and posts them on `res`: the inline WRITEs of `data`
    /// (`None`: a lease copied them already) and their CDC. The inner result
    /// is the link's: an error there means the link is broken.
    #[inline]
    pub(super) fn post_direct(
        &mut self,
        id: ConnId,
        res: &mut LinkRes<P>,
        n: usize,
        rkey: u32,
        rmbe_addr: u64,
        data: Option<&[u8]>,
    ) -> Result<smc_rdma::Result<()>, ConnError> {
        let dp = self.smc()?;
        dp.produced_direct(n);
        let Some(batch) = dp.poll_tx() else {
            return Err(ConnError::Aborted);
        };
        debug_assert_eq!(
            batch.writes.iter().map(|w| w.len).sum::<usize>(),
            n,
            "the batch writes everything produced"
        );
        self.direct_sent = dp.sent_total();
        let mut posted = Ok(());
        if let Some(data) = data {
            let mut at = 0;
            for w in &batch.writes {
                let addr = rmbe_addr + w.peer_offset as u64;
                posted = res.post_write_inline(&data[at..at + w.len], rkey, addr);
                if posted.is_err() {
                    break;
                }
                at += w.len;
            }
        }
        if posted.is_ok() {
            let kind = WrKind::Cdc(id, batch.cdc.seqno);
            posted = if names_bell(&batch.cdc, n > 0) {
                res.post_cdc(kind, &batch.cdc.encode(), rkey)
            } else {
                res.post(kind, &batch.cdc.encode())
            };
        }
        Ok(posted)
    }

    /// One batch of what the connection has to send, posted on link `res`
    /// (its link, usable and with a free send slot): the validation CDC
    /// first after a failover (§2.4), else WRITEs of the send buffer and
    /// their CDC. `rtoken`: the peer RMB's rkey and address on the link
    /// (§3.2 step 4); without one only a CDC can go.
    #[inline]
    pub(super) fn flush_step(
        &mut self,
        id: ConnId,
        res: &mut LinkRes<P>,
        rtoken: Option<(u32, u64)>,
    ) -> smc_rdma::Result<FlushStep> {
        if let Some(v) = self.validation.take() {
            return Ok(match res.post(WrKind::Validation, &v.encode()) {
                Ok(()) => FlushStep::Posted,
                Err(e) => FlushStep::LinkError(e),
            });
        }
        let (Some(dp), Some(peer), Some(sndbuf)) =
            (self.dp.as_mut(), self.peer_rmb, self.sndbuf.as_ref())
        else {
            return Ok(FlushStep::Blocked);
        };
        if rtoken.is_none() && dp.unsent() > 0 {
            return Ok(FlushStep::Blocked);
        }
        let (rkey, base) = rtoken.unwrap_or_default();
        let Some(batch) = dp.poll_tx() else {
            return Ok(FlushStep::Clean);
        };
        let mut posted = Ok(());
        for w in &batch.writes {
            // the send-buffer pieces (one, or two where it wraps)
            let sge = |&(off, len): &(usize, usize)| sndbuf.sge(off, len as u32);
            let (one, two);
            let sges: &[smc_rdma::Sge] = match w.src.as_slice() {
                [a] => {
                    one = [sge(a)?];
                    &one
                }
                [a, b] => {
                    two = [sge(a)?, sge(b)?];
                    &two
                }
                _ => &[],
            };
            let addr = base + peer.offset + w.peer_offset as u64;
            posted = res.post_write(sges, rkey, addr);
            if posted.is_err() {
                break;
            }
        }
        if posted.is_ok() {
            let cdc = WrKind::Cdc(id, batch.cdc.seqno);
            posted = match rtoken {
                Some((rkey, _)) if names_bell(&batch.cdc, !batch.writes.is_empty()) => {
                    res.post_cdc(cdc, &batch.cdc.encode(), rkey)
                }
                _ => res.post(cdc, &batch.cdc.encode()),
            };
        }
        // A batch that did not go out stays accounted as in flight: the
        // link is down, and the failover rewind sends it again.
        Ok(match posted {
            Ok(()) => FlushStep::Posted,
            Err(e) => FlushStep::LinkError(e),
        })
    }

    /// A requested move happens once nothing of the connection is in flight
    /// on the old link (see the module documentation of `endpoint.rs`).
    /// False: not yet.
    #[inline]
    pub(super) fn settle_move(&mut self) -> bool {
        let Some(to) = self.move_to else {
            return true;
        };
        let quiet =
            self.validation.is_none() && self.dp.as_ref().is_none_or(|dp| dp.cdcs_in_flight() == 0);
        if !quiet {
            return false;
        }
        self.set_link(Some(to));
        self.move_to = None;
        true
    }
}

/// An entry of the endpoint's table of connections by alert token (see
/// `Endpoint::by_token`): written when a connection joins a link group and
/// removed when it leaves, so that a received CDC finds its connection's
/// core with one lookup.
pub(super) struct TokenEntry<P: Provider> {
    pub(super) id: ConnId,
    /// The group the connection is in: a CDC counts only on that group's links.
    pub(super) lgr: super::LgrId,
    pub(super) core: CoreRef<P>,
}

/// Hashes alert tokens: ours, handed out in sequence (`next_alert_token`),
/// so a multiplication spreads them; a peer's CDC only looks one up.
#[derive(Clone, Copy, Default)]
pub(super) struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The endpoint's connections by alert token.
pub(super) type TokenMap<P> =
    std::collections::HashMap<u32, TokenEntry<P>, std::hash::BuildHasherDefault<TokenHasher>>;

/// The token table as the endpoint and its links' receive dispatch share it
/// (docs/FAST-PATH.md, step 4): written by the endpoint only, when a
/// connection joins or leaves a link group (`Endpoint::attach`,
/// `Endpoint::detach`), read by whoever applies a received CDC, with or
/// without the device lock.
pub(super) struct TokenTable<P: Provider>(std::sync::RwLock<TokenMap<P>>);

impl<P: Provider> Default for TokenTable<P> {
    fn default() -> Self {
        TokenTable(std::sync::RwLock::new(TokenMap::default()))
    }
}

impl<P: Provider> TokenTable<P> {
    /// The table for lookups. A panic while it was written cannot have left
    /// a half-inserted entry (a `HashMap` insert or remove either happened
    /// or did not): it is used as it is.
    #[inline]
    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, TokenMap<P>> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table for the endpoint's changes.
    pub(super) fn write(&self) -> std::sync::RwLockWriteGuard<'_, TokenMap<P>> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::names_bell;
    use smc_wire::cdc::{CdcMessage, ConnStateFlags, ProducerFlags};

    /// Only a CDC that brings data and nothing the peer's application must
    /// see with it names the doorbell; a write-blocked or cursor-update
    /// request flag does not change what the reader sees, so it does not
    /// keep the doorbell from ringing.
    #[test]
    fn only_plain_data_cdcs_name_the_doorbell() {
        let data = CdcMessage::default();
        assert!(names_bell(&data, true));
        assert!(!names_bell(&data, false), "a cursor update wakes no reader");
        for f in [
            ProducerFlags::WRITE_BLOCKED,
            ProducerFlags::CONS_CURS_UPD_REQ,
        ] {
            let c = CdcMessage {
                prod_flags: f,
                ..data
            };
            assert!(names_bell(&c, true), "{f:?}");
        }
        for f in [
            ProducerFlags::URG_DATA_PENDING,
            ProducerFlags::URG_DATA_PRESENT,
        ] {
            let c = CdcMessage {
                prod_flags: f,
                ..data
            };
            assert!(!names_bell(&c, true), "urgent data: {f:?}");
        }
        for f in [
            ConnStateFlags::PEER_DONE_WRITING,
            ConnStateFlags::PEER_CONN_CLOSED,
            ConnStateFlags::PEER_CONN_ABORT,
        ] {
            let c = CdcMessage {
                conn_flags: f,
                ..data
            };
            assert!(!names_bell(&c, true), "an end: {f:?}");
        }
    }
}
