//! Closing: `shutdown` and `close` of the application (unsent data first;
//! after a `close`, an abort when the peer takes none for long), release
//! of a connection, aborts, the end of the TCP connection (a peer that
//! died), and the close state as the application sees it. The close
//! decisions are smc-proto's [`Closer`].
//!
//! Spec: `protocol-llc-cdc.md` §5 (close: what is sent, active and passive
//! transitions, §5.5 abort, §5.6 timeouts). Linux: smc_close.c
//! (`smc_close_active`, `smc_close_passive_work`, `smc_close_active_abort`).
//!
//! [`Closer`]: smc_proto::close::Closer

use super::conn::{CloseWait, ConnStatus, Phase};
use super::conn_core::lock;
use super::{ConnId, Endpoint};
use smc_proto::clc_stream::FailReason;
use smc_proto::close::{CloseEvent, CloseFlags, CloseState, Closer};
use smc_rdma::Provider;
use std::time::Duration;

/// How long after the TCP connection ended a close CDC may still arrive before
/// the peer is taken for dead.
pub const PEER_GONE_GRACE: Duration = Duration::from_secs(1);

/// Longest wait without progress for the send buffer to drain after a
/// `close()` before the connection is aborted (see [`Endpoint::close`]).
/// Linux's `SMC_MAX_STREAM_WAIT_TIMEOUT` is 2 s, spent blocked in close();
/// here the application's close blocks for about that long at most (the
/// `smc` crate's drop), and the engine waits on in the background.
pub const MAX_STREAM_WAIT: Duration = Duration::from_secs(30);

impl<P: Provider> Endpoint<P> {
    /// The TCP connection closed or failed during the handshake.
    ///
    /// On an SMC connection the TCP connection normally closes right after the
    /// peer's close CDC (the active closer shuts it down, §5.2). If no close or
    /// abort CDC has arrived within [`PEER_GONE_GRACE`] of the TCP end, the peer
    /// is taken for dead — a user-space peer whose process died cannot send a
    /// CDC, but its kernel closes the TCP socket — and the connection is reset.
    /// Its link is then probed with a TEST_LINK at once (see
    /// [`smc_proto::link::LinkGroup::probe_link`]): a peer whose device went
    /// away takes the link with it, and an unanswered probe ends the link
    /// (and a group left without one) after `SMC_LLC_WAIT_TIME`, so that a
    /// released connection does not wait for CDCs that cannot complete.
    ///
    /// Returns whether that changed something the connection's waiters may
    /// see, now or when the grace ends: not for an SMC-R connection whose
    /// peer had closed it already (its TCP end follows the close CDC, as
    /// Linux's `smc_close_active` closes the TCP socket after sending it),
    /// which needs no grace; nor for a connection already freed.
    pub fn tcp_closed(&mut self, id: ConnId) -> bool {
        if self.conn(id).is_none() {
            return false;
        }
        self.conn_event(id);
        let deadline = self.now + PEER_GONE_GRACE;
        if let Some(Phase::LateDeclined { reason, .. }) = self.conn(id).map(|c| c.phase.clone()) {
            // Our Decline is out and no crossed one came: the connection is on
            // TCP, and the peer's close is the application's end of file.
            self.finish(id, ConnStatus::Fallback { reason, peer: None });
            return true;
        }
        match self.status(id) {
            Some(ConnStatus::Handshaking) => {
                self.finish(id, ConnStatus::Failed(FailReason::TcpClosed))
            }
            Some(ConnStatus::Smc) => {
                if self.peer_closed(id) {
                    return false;
                }
                if let Some(Phase::Smc {
                    tcp_gone_deadline, ..
                }) = self.conn(id).map(|c| &mut c.phase)
                {
                    tcp_gone_deadline.get_or_insert(deadline);
                }
            }
            _ => {}
        }
        true
    }

    /// Kills an established connection of ours with an abort CDC to the peer
    /// (which needs no rkey: it can go whatever became of the peer's RMB).
    /// What the peer sent before comes first: a peer that wrote, closed and
    /// exited while this side was still establishing the connection (its
    /// RMB gone with it, so that this side cannot ready it) ended the
    /// connection in order, and the abort finds it so. (Called outside the
    /// link's receive poll; a failed poll is met again by the pump's own.)
    pub(super) fn abort_now(&mut self, id: ConnId) {
        let at = self.conn(id).and_then(|c| c.lgr);
        if let (Some(l), Some(slot)) = (at, self.core(id).and_then(|k| k.link)) {
            let now = self.now;
            let _ = self.poll_recv(l, slot, now);
        }
        self.mark_tx(id);
        self.event_aborted(id, super::events::AbortCause::Local);
        if let Some(mut k) = self.core(id) {
            k.close_event(CloseEvent::Kill { can_send: true });
        }
    }

    /// The application is done with the connection (`close()` on the socket). An
    /// SMC connection closes (an abort if received data is left unread) and is
    /// freed once the close completes; a fallen-back, failed or unfinished one is
    /// freed at once (its TCP socket is the caller's to close).
    pub fn release(&mut self, id: ConnId) {
        self.release_with(id, false);
    }

    /// [`Self::release`] with an abort whatever is left unread: a `close()`
    /// with `SO_LINGER` on and a zero timeout, for which TCP discards what
    /// is unsent and sends a reset (tcp.c `__tcp_close`, its
    /// `tcp_disconnect` branch), so the peer's next read fails with
    /// `ECONNRESET` rather than find end of file.
    pub fn release_reset(&mut self, id: ConnId) {
        self.release_with(id, true);
    }

    fn release_with(&mut self, id: ConnId, reset: bool) {
        // (the next pump frees the connection once it is finished)
        self.conn_event(id);
        let Some(c) = self.conns.get(id) else {
            return;
        };
        match &c.phase {
            Phase::Smc { .. } => {
                let unread_data =
                    reset || lock(&c.core).dp.as_ref().is_some_and(|dp| dp.unread() > 0);
                self.close(id, CloseEvent::AppClose { unread_data });
            }
            _ => {
                if matches!(self.status(id), Some(ConnStatus::Handshaking)) {
                    self.finish(id, ConnStatus::Failed(FailReason::TcpClosed));
                }
                if let Some(l) = self.conns.get_mut(id).and_then(|c| c.lgr.take()) {
                    self.detach(id, l);
                }
                self.conns.remove(id);
            }
        }
    }

    /// The peer closed (or aborted) the connection, as opposed to only shutting
    /// down its write side.
    pub fn peer_closed(&self, id: ConnId) -> bool {
        self.core(id)
            .is_some_and(|k| k.closer.rx_flags().any_close())
    }

    /// A write to connection `id` after the peer closed it, for a caller
    /// that must behave as a TCP socket (the preload library): the
    /// connection takes the reset TCP's peer answers such data with
    /// (`Closer::drawn_reset`: `EPIPE` from now on, reads at the end of
    /// file, its readiness showing the error and the end), and this
    /// returns `true`: the caller counts the write as done, as TCP's first
    /// write there succeeds. `false`, and nothing changes, anywhere else.
    /// [`Self::write`] itself fails there with `ECONNRESET`, as Linux's
    /// SMC does (smc_tx.c `smc_tx_sendmsg`).
    pub fn reset_by_write(&mut self, id: ConnId) -> bool {
        self.change_closer(id, Closer::drawn_reset)
    }

    /// Connection `id` reports its end as a TCP socket would, for a caller
    /// that stands in for one (the preload library): a reset or an abort
    /// after the peer's orderly close is `EPIPE` or nothing
    /// (`Closer::set_tcp_errors`), where Linux's SMC reports `ECONNRESET`
    /// or `ECONNABORTED`. Also for an end that came before.
    pub fn set_tcp_errors(&mut self, id: ConnId) {
        self.change_closer(id, |c| {
            c.set_tcp_errors();
            true
        });
    }

    /// Applies `f` to connection `id`'s closer; if it says it changed
    /// something, the connection's readiness and events show it. Whether it
    /// did (`false` for a connection that is gone).
    fn change_closer(&mut self, id: ConnId, f: impl FnOnce(&mut Closer) -> bool) -> bool {
        let Some(mut k) = self.core(id) else {
            return false;
        };
        if !f(&mut k.closer) {
            return false;
        }
        k.watched();
        drop(k);
        self.conn_event(id);
        true
    }

    /// `shutdown(SHUT_WR)` or `close()`. Unsent data goes out first, and the
    /// close flags with the last byte (§5.2); nothing is dropped while the
    /// peer takes some of it, as a TCP socket keeps sending what a write
    /// accepted after a shutdown or a close.
    ///
    /// After `close()` a peer that takes nothing for `MAX_STREAM_WAIT`
    /// (30 s) ends the wait: the connection is aborted, so that its reader
    /// gets an error rather than an end of file after a shortened stream.
    /// Linux waits `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) in close() and
    /// shutdown() (smc_close.c `smc_close_active`,
    /// `smc_close_shutdown_write` → `smc_close_stream_wait`), then sends the
    /// close flags ahead of the data left in its send buffer, which its
    /// reader takes for the end of the stream (smc_rx.c `smc_rx_recvmsg`
    /// stops at the receive shutdown that the flags set, with nothing
    /// readable): a reader that paused for 2 s (a loaded machine) would
    /// silently lose the end of the stream. Our send buffer (1 MiB by
    /// default) also holds far more than a slow reader takes in 2 s (Linux's
    /// holds 64 KiB). The wait starts over whenever the peer takes some (a
    /// failover's replay counts: its rewind releases the failover reserve,
    /// `DataPath::set_failover_reserve`).
    ///
    /// After `shutdown(SHUT_WR)` there is no bound: the connection lives on
    /// (the application still reads, and may close later, which starts the
    /// wait above).
    pub fn close(&mut self, id: ConnId, ev: CloseEvent) {
        self.conn_event(id);
        let now = self.now;
        let wait = self.core(id).and_then(|mut k| k.close(ev));
        let gives_up = matches!(ev, CloseEvent::AppClose { .. });
        if let (Some(unsent), Some(c), true) = (wait, self.conn(id), gives_up) {
            if let Some(w) = c.phase.close_wait() {
                *w = Some(CloseWait::new(unsent, now));
            }
        }
    }

    /// A connection's close state.
    pub fn close_state(&self, id: ConnId) -> Option<CloseState> {
        self.core(id).map(|k| k.closer.state())
    }

    /// Close flags we have sent on a connection.
    pub fn sent_close_flags(&self, id: ConnId) -> Option<CloseFlags> {
        self.core(id).map(|k| k.closer.tx_flags())
    }

    /// Whether a closed connection has nothing left to send: its data and its
    /// close (or abort) CDC have been handed to the device, or it is gone.
    /// Until then the process must stay for them to leave — a user-space
    /// connection has no kernel to finish the close after an exit (Linux's
    /// close() waits for pending sends the same way, up to
    /// `SMC_MAX_STREAM_WAIT_TIMEOUT`, §5.2). Posted is enough: waiting for the
    /// peer's acknowledgement as well would make every close cost a wake-up
    /// round trip; the shm device delivers
    /// what was posted even after the sender exits.
    pub fn close_sent(&self, id: ConnId) -> bool {
        self.core(id).is_none_or(|k| k.close_sent())
    }
}
