//! A connection's data path as a thing of its own ([`ConnCore`]): its
//! [`DataPath`] (cursors, CDC sequence numbers, send-buffer bookkeeping), its
//! buffers, the leases lent on them, its close state, and the link it sends
//! on (slot, the peer RMB's place in the group's rtoken table, and a link
//! epoch that a failover or a move bumps). The endpoint holds it as
//! [`CoreRef`] (`Arc<Mutex<_>>`) in the connection's record and, by alert
//! token, in a table that a received CDC is dispatched through
//! (`Endpoint::on_cdc`); whoever else gets the `Arc` may lock it without the
//! endpoint (docs/FAST-PATH.md, step 4): a connection's handle
//! ([`FastConn`]) writes and reads directly that way, on the link's own
//! send and receive locks ([`LinkTx`](super::link::LinkTx),
//! [`LinkRx`](super::link::LinkRx)); everything else still comes through
//! the endpoint. The handle, its grants and the core's halves of its calls
//! are in `fast.rs`, the table by alert token in `tokens.rs`.
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
use super::link::{LinkRes, WrKind};
use super::ConnId;
use smc_proto::close::{CloseEvent, CloseState, Closer};
use smc_proto::datapath::{DataPath, Violation};
use smc_rdma::{Doorbell, MemWindow, MemoryRegion, Provider};
use smc_wire::cdc::{CdcMessage, RingChunks};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

mod fast;
mod tokens;

pub use fast::{FastConn, FastRead, FastWrite, MaySleep};
pub(super) use fast::{FastRx, FastTx};
pub(super) use tokens::{TokenEntry, TokenTable};

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
    /// The application shut down its read side (`shutdown(SHUT_RD)`): once
    /// what arrived is read, reads find end of file instead of waiting, as
    /// on Linux, where af_smc.c `smc_shutdown` sets `RCV_SHUTDOWN` in
    /// `sk_shutdown`, at which smc_rx.c `smc_rx_recvmsg` (and tcp.c
    /// `tcp_recvmsg_locked`) stop. The peer is not told; what it still
    /// sends is received and readable.
    pub(super) read_shut: bool,
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
    /// Nothing more comes to read: the peer sends nothing more, or the
    /// application shut down its read side (end of file once `readable`
    /// is read).
    pub peer_done: bool,
    /// The application shut down its read side (`shutdown(SHUT_RD)`).
    pub read_shut: bool,
    /// Reset by the peer or aborted: reads and writes fail.
    pub failed: bool,
    /// The peer closed or aborted (as opposed to only shutting down its
    /// write side).
    pub peer_closed: bool,
    /// The connection's close state, as readiness shows it
    /// (`Closer::shown_state`).
    pub close: CloseState,
}

/// Told of a connection's [`ConnLevel`] ([`FastConn::watch`]), with the
/// connection's core locked: the calls are ordered by that lock, so the
/// last one tells the state as it is, whichever thread made it. It must
/// not lock the connection, its link or the endpoint.
pub type Watch = Arc<dyn Fn(&ConnLevel) + Send + Sync>;

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

/// Copies as much of `data` as the connection may write into the peer's
/// RMB through its window `win` and accounts it as written without a CDC
/// (`DataPath::write_corked`): the bytes written, 0 if the window refused
/// them (the region gone) or the data path takes none now.
fn cork_into(dp: &mut DataPath, win: &MemWindow, data: &[u8]) -> usize {
    // (copied first, accounted after: bytes beyond the producer cursor the
    // peer has been told of are nothing to it until a CDC says so; within
    // the peer's free space, as `write_corked` counts it, never over bytes
    // it has not read)
    let n = dp.corkable(data.len());
    if n == 0 {
        return 0;
    }
    let dst = dp.peer_write_chunks(n);
    let mut at = 0;
    for &(off, len) in dst.as_slice() {
        if win.write_at(off, &data[at..at + len]).is_err() {
            return 0;
        }
        at += len;
    }
    let done = dp.write_corked(at);
    debug_assert_eq!(done, dst, "corked where the chunks were planned");
    done.as_slice().iter().map(|&(_, len)| len).sum()
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
            read_shut: false,
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
            peer_done: self.read_done(),
            read_shut: self.read_shut,
            failed: self.closer.error().is_some(),
            peer_closed: self.closer.rx_flags().any_close(),
            close: self.closer.shown_state(),
        }
    }

    /// Whether data that comes now resets the connection, as it does a TCP
    /// socket whose application shut down both its sending and its
    /// receiving (`CloseEvent::Reset`): only for a connection that reports
    /// its errors as TCP's (`Closer::set_tcp_errors`: Linux's SMC has no
    /// such reset), not released (a close's end is the peer's to draw,
    /// `Endpoint::reset_by_write`).
    fn resets_on_data(&self) -> bool {
        let tx = self.closer.tx_flags();
        self.read_shut
            && tx.done_writing
            && !tx.closed
            && !tx.abort
            && !self.closer.released()
            && self.closer.tcp_errors()
    }

    /// Nothing more comes to read (see [`ConnLevel::peer_done`]).
    pub(super) fn read_done(&self) -> bool {
        self.closer.peer_done() || self.read_shut
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
            // (`EPIPE`, and reads find the end of file: `readable_now`)
            Some(smc_proto::close::CloseError::ResetInCloseWait) => ConnError::Closed,
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
            // A peer that ended its stream in order sent everything, whatever
            // ended the connection after (its process exited, taking the
            // link; its abort): end of file, not an error, as TCP's socket
            // after the FIN (`Closer::peer_ended_in_order`).
            if self.closer.peer_ended_in_order() {
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
        let resets = self.resets_on_data();
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
            Ok(r) if r.new_data > 0 && resets => {
                // (what came is dropped, as TCP drops the segment it
                // answers with the reset: reads find the error, then the
                // end)
                while dp.consumed(usize::MAX) > 0 {}
                let open = !matches!(self.closer.state(), CloseState::Init | CloseState::Closed);
                self.close_event(CloseEvent::Reset);
                return CdcDone {
                    aborted: open.then_some(AbortCause::DataAfterShutdown),
                    finished: self.closer.is_finished(),
                };
            }
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
        let wants = dp.wants_completion();
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
            let bell = names_bell(&batch.cdc, batch.brings_data).then_some(rkey);
            posted = res.post_cdc(kind, &batch.cdc.encode(), bell, wants);
        }
        Ok(posted)
    }

    /// Copies up to `n` bytes of `data` into the peer's RMB through its
    /// window (made with the fast path's grant) without a CDC, while the
    /// link has no send slot for one (`Endpoint::direct_plan`'s corked
    /// plan): accounted as written, their CDC owed (`DataPath::write_corked`;
    /// the caller marks the connection for the flush that sends it). The
    /// bytes written: 0 if the window refused them (the region gone) or the
    /// connection cannot write directly now.
    pub(super) fn write_corked(&mut self, n: usize, data: &[u8]) -> usize {
        let (Some(dp), Some((_, _, win))) = (self.dp.as_mut(), self.peer_window.as_ref()) else {
            return 0;
        };
        let n = cork_into(dp, win, &data[..n.min(data.len())]);
        self.direct_sent = dp.sent_total();
        n
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
            let bell = rtoken
                .map(|(rkey, _)| rkey)
                .filter(|_| names_bell(&batch.cdc, batch.brings_data));
            posted = res.post_cdc(cdc, &batch.cdc.encode(), bell, dp.wants_completion());
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
