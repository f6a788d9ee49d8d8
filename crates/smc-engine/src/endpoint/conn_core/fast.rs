//! A connection's fast path (docs/FAST-PATH.md, step 4): its handle
//! ([`FastConn`]), the grants that let it write and poll its link without the
//! endpoint ([`FastTx`], [`FastRx`]), and the core's halves of those writes
//! and reads.

use super::{lock, names_bell, ConnCore, ConnLevel, CoreRef, TokenTable, Watch};
use crate::endpoint::conn::ConnError;
use crate::endpoint::link::{LinkTx, WrKind};
use crate::endpoint::ConnId;
use smc_proto::close::CloseState;
use smc_rdma::{Doorbell, MemoryRegion, Provider};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// A grant to poll the receive CQ of the connection's link without the
/// endpoint ([`FastConn::try_read`], `cdc_recv::dispatch`): the link's
/// receive side, its group and the endpoint's token table, valid while the
/// connection's link epoch is the one it was made on and the link is open
/// to it (`LinkRx::open`: the group's only link, active).
pub(in crate::endpoint) struct FastRx<P: Provider> {
    pub(in crate::endpoint) rx: Arc<crate::endpoint::link::LinkRx<P>>,
    pub(in crate::endpoint) tokens: Arc<TokenTable<P>>,
    pub(in crate::endpoint) lgr: crate::endpoint::LgrId,
    pub(in crate::endpoint) slot: usize,
    pub(in crate::endpoint) epoch: u64,
}

/// A grant to write directly without the endpoint ([`ConnCore::fast_write`]):
/// the link's send side and where the peer's RMB is on it, as the endpoint's
/// own direct write found them (`Endpoint::write_direct`), valid while the
/// connection's link epoch is the one it was made on and the link's send
/// side is open (`TxBook::open`).
pub(in crate::endpoint) struct FastTx<P: Provider> {
    pub(in crate::endpoint) tx: Arc<LinkTx<P>>,
    pub(in crate::endpoint) id: ConnId,
    pub(in crate::endpoint) slot: usize,
    pub(in crate::endpoint) epoch: u64,
    pub(in crate::endpoint) rkey: u32,
    /// The peer's RMBE, as the link addresses it.
    pub(in crate::endpoint) rmbe_addr: u64,
    /// Largest write the device takes inline.
    pub(in crate::endpoint) max_inline: usize,
}

/// What [`FastConn::try_read`] dispatches a link's receive CQ with.
type DispatchGrant<P> = (
    Arc<crate::endpoint::link::LinkRx<P>>,
    Arc<TokenTable<P>>,
    crate::endpoint::LgrId,
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
/// from [`Endpoint::fast_conn`](crate::endpoint::Endpoint::fast_conn). Every call either
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
    rx: Weak<crate::endpoint::link::LinkRx<P>>,
    tokens: Arc<TokenTable<P>>,
    lgr: crate::endpoint::LgrId,
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
    pub(in crate::endpoint) fn new(core: CoreRef<P>) -> FastConn<P> {
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
        crate::endpoint::cdc_recv::dispatch_all(&rx, &tokens, l) == Some(true)
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
                    crate::endpoint::cdc_recv::dispatch(&rx, &g.tokens, g.lgr);
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
        if !crate::endpoint::cdc_recv::dispatch(&rx, &tokens, l) {
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

    /// What TCP's `FIONREAD` would say of the connection now
    /// (`DataPath::inq`: up to the urgent byte's mark, none at it).
    pub fn inq(&self) -> usize {
        lock(&self.core)
            .dp
            .as_ref()
            .map_or(0, smc_proto::datapath::DataPath::inq)
    }

    /// Whether the peer's urgent byte waits: neither fetched
    /// (`recv(MSG_OOB)`) nor passed by a read (TCP's `POLLPRI`, tcp.c
    /// `tcp_poll` while `TCP_URG_VALID`; Linux's SMC while `SMC_URG_VALID`,
    /// `smc_poll`). Asked only by a poller that waits for it, not part of
    /// [`Self::level`], which every change of the connection computes.
    pub fn urgent_waiting(&self) -> bool {
        let k = lock(&self.core);
        k.oob.is_some()
            && k.dp
                .as_ref()
                .is_some_and(smc_proto::datapath::DataPath::urgent_valid)
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
    /// with nothing to read, its read side open and nothing the endpoint
    /// must act on (nothing unsent, no lease, close, urgent byte or
    /// violation), able to poll its link alone, and that poll, made now,
    /// leaving nothing for the endpoint ([`MaySleep`]).
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
            || k.read_shut
            || k.validation.is_some()
            || k.dp.as_ref().is_none_or(|dp| {
                dp.unsent() > 0 || dp.cdc_wanted() || dp.urgent_pending() || dp.close_pending()
            })
        {
            return MaySleep::No;
        }
        drop(k);
        match crate::endpoint::cdc_recv::dispatch_all(&rx, &tokens, l) {
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

impl<P: Provider> ConnCore<P> {
    /// The fast path's write (see [`FastConn::try_write`]): the conditions
    /// of the endpoint's direct write (`Endpoint::direct_plan`) that the
    /// connection can see, the link's as the grant recorded them, and what
    /// keeps the endpoint from having to learn of it: the write leaves the
    /// connection with nothing to send or wait for (room in its send
    /// buffer, nothing unsent, no close, urgent byte or move), and the link
    /// with a free SEND and send slot, so that no sleeping driver has to
    /// arm its send CQ for this CDC's completion (`endpoint/arm.rs`). With
    /// every SEND in flight, where the peer's RMB is mapped, it writes
    /// without a CDC (corked) and lists the connection for the endpoint
    /// (`LinkTx::cork`), whose send CQ is armed then anyway.
    #[inline]
    pub(in crate::endpoint) fn fast_write(
        &mut self,
        data: &[u8],
    ) -> std::result::Result<FastWrite, ConnError> {
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
        if !book.open {
            return Ok(FastWrite::Declined);
        }
        if !f
            .tx
            .has_room(&mut book, f.id, |seq, n| dp.on_cdcs_sent(seq, n).is_ok())
        {
            // Every SEND of the link in flight (the endpoint posted the last
            // one, and the release of its lock armed the send CQ for a
            // sleeping driver; an awake one arms it before it sleeps, as
            // `Endpoint::arm` does while the SENDs are all taken): the bytes
            // go into the peer's RMB through the window, their CDC owed
            // (corked, as the endpoint's direct write does then), and the
            // connection is listed for the endpoint's flush. With one SEND
            // left, the endpoint's write takes it, as before.
            let win = match &self.peer_window {
                Some((slot, rkey, w)) if *slot == f.slot && *rkey == f.rkey => w,
                _ => return Ok(FastWrite::Declined),
            };
            if book.sends_in_flight < book.max_sends {
                return Ok(FastWrite::Declined);
            }
            let n = super::cork_into(dp, win, data);
            if n == 0 {
                return Ok(FastWrite::Declined);
            }
            self.direct_sent = dp.sent_total();
            f.tx.cork(&mut book, f.id);
            // A completion that came since the look above may have woken
            // the driver before the connection was listed: looked at again,
            // and if it freed a SEND the CDC goes now.
            if f.tx
                .has_room(&mut book, f.id, |seq, k| dp.on_cdcs_sent(seq, k).is_ok())
            {
                if let Some(batch) = dp.poll_tx() {
                    let posted = book.post(
                        &*f.tx.qp,
                        WrKind::Cdc(f.id, batch.cdc.seqno),
                        &batch.cdc.encode(),
                        names_bell(&batch.cdc, batch.brings_data).then_some(f.rkey),
                        dp.wants_completion(),
                    );
                    match posted {
                        Ok(()) => f.tx.fast_cdcs.add(&*book),
                        Err(e) => {
                            f.tx.broke(&mut book, e);
                            return Ok(FastWrite::WroteLinkBroke(n));
                        }
                    }
                }
            }
            return Ok(FastWrite::Wrote(n));
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
                dp.wants_completion(),
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
    pub(in crate::endpoint) fn fast_read(&mut self, buf: &mut [u8]) -> FastRead {
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
        // (a cursor update, no data for the peer's reader, see `names_bell`;
        // unless it announces bytes written before without a CDC)
        match book.post(
            &f.tx.qp,
            WrKind::Cdc(f.id, batch.cdc.seqno),
            &batch.cdc.encode(),
            names_bell(&batch.cdc, batch.brings_data).then_some(f.rkey),
            dp.wants_completion(),
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
}
