//! A connection as the endpoint holds it: its record ([`Conn`]), where its
//! handshake stands ([`Phase`], whose kind is [`HandshakePhase`]), what the
//! application sees of it ([`ConnStatus`], [`ConnError`]), and the
//! connection table (ids, alert tokens).
//!
//! Linux keeps the same per connection in `struct smc_connection` (smc.h);
//! the alert token that routes the peer's CDCs to it (`protocol-llc-cdc.md`
//! §2.1) is handed out per link group there (smc_core.c
//! `smc_lgr_register_conn`), here per endpoint, so it is unique in every
//! group.

use super::conn_core::{lock, ConnCore, CoreRef};
use super::gid::ConnGids;
use super::{ConnId, Endpoint, LgrId};
use crate::state::HandshakePhase;
use smc_proto::clc_stream::{ClcReader, FailReason, OwedAnswer};
use smc_proto::link::Role;
use smc_proto::Timestamp;
use smc_rdma::Provider;
use smc_wire::cdc::CdcMessage;
use smc_wire::clc::{AcceptConfirm, DeclineCode, Proposal};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

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
    /// Linux: smc_core.c `smc_conn_kill` (from `smc_lgr_terminate` when the
    /// last link is gone) and smc_close.c `smc_close_active_abort` set
    /// `sk_err = ECONNABORTED`, which `SO_ERROR` and poll's EPOLLERR report
    /// and a writer blocked in smc_tx.c `smc_tx_sendmsg` gets (through
    /// `sk_stream_error`); never ECONNRESET, which only a peer's abort
    /// gives. Its later calls differ: smc_rx.c `smc_rx_recvmsg` ends at the
    /// abort flag `smc_close_abort` set before it looks at `sk_err` (end of
    /// stream, after what was received), af_smc.c `smc_sendmsg` refuses a
    /// socket no longer active with EPIPE. Here reads and writes both keep
    /// reporting ECONNABORTED: an end of stream would pass for the peer's
    /// orderly close.
    Aborted,
}

#[derive(Clone, Debug)]
pub(super) enum Phase {
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
    AwaitLgr {
        proposal: Box<Proposal>,
        deadline: Timestamp,
    },
    ServerRkey {
        accept: Box<AcceptConfirm>,
        version: u8,
        /// CDCs that arrived before the data path exists (see `AwaitConfirm`).
        early: VecDeque<CdcMessage>,
    },
    AwaitConfirm {
        version: u8,
        first_contact: bool,
        deadline: Timestamp,
        /// CDCs that arrived before the data path exists. A client that
        /// reuses a link group may write as soon as it has sent its CLC
        /// Confirm, and its RDMA SEND can overtake that Confirm on TCP; Linux
        /// processes such a CDC as soon as the token is known
        /// (smc_cdc_rx_handler), so we keep it and apply it once the Confirm
        /// is in. Cursors are cumulative, so when more than
        /// [`EARLY_CDC_MAX`](super::cdc_recv::EARLY_CDC_MAX) pile up the
        /// oldest can be dropped (not one that marks an urgent byte, which
        /// no later CDC names again). Only these two server phases hold them: the
        /// connection has a token the peer knows and no data path yet.
        early: VecDeque<CdcMessage>,
    },
    // both
    /// First contact: CLC done (`since`: our Confirm went out / theirs came
    /// in), the CONFIRM_LINK exchange runs.
    AwaitLink {
        version: u8,
        since: Timestamp,
    },
    /// The link failed after the CLC exchange: the peer's Decline is read
    /// until `deadline`, then we decline (see [`SERVER_LATE_DECLINE_WAIT`](super::handshake::SERVER_LATE_DECLINE_WAIT)).
    AwaitLateDecline {
        version: u8,
        deadline: Timestamp,
    },
    /// Our late Decline (`reason`) is out; until `deadline` the first bytes
    /// from the peer are looked at for a Decline that crossed it.
    LateDeclined {
        reason: DeclineCode,
        deadline: Timestamp,
    },
    /// Established: data moves over RDMA. Nothing leaves this phase (the
    /// connection is freed once closed).
    Smc {
        /// The TCP connection ended; without a close CDC by then the peer is
        /// dead (see [`PEER_GONE_GRACE`](super::PEER_GONE_GRACE)).
        tcp_gone_deadline: Option<Timestamp>,
        /// The application closed while data was unsent: how long the close
        /// waits for it (see `Endpoint::close`).
        close_wait: Option<CloseWait>,
    },
    Done(ConnStatus),
    /// A client that had no Accept in time declined (`reason`) and is plain
    /// TCP from here (its status says fallback); the server's answer to the
    /// Proposal is still due on the TCP stream, ahead of its data, and the
    /// caller takes it off there ([`Endpoint::owed_answer`]; see
    /// `Endpoint::give_up_on_accept`).
    Unanswered {
        reason: DeclineCode,
        answer: OwedAnswer,
    },
}

impl Phase {
    pub(super) fn kind(&self) -> HandshakePhase {
        match self {
            Phase::AwaitAccept { .. } => HandshakePhase::AwaitAccept,
            Phase::ClientRkey { .. } => HandshakePhase::ClientRkey,
            Phase::AwaitProposal { .. } => HandshakePhase::AwaitProposal,
            Phase::AwaitLgr { .. } => HandshakePhase::AwaitLgr,
            Phase::ServerRkey { .. } => HandshakePhase::ServerRkey,
            Phase::AwaitConfirm { .. } => HandshakePhase::AwaitConfirm,
            Phase::AwaitLink { .. } => HandshakePhase::AwaitLink,
            Phase::AwaitLateDecline { .. } => HandshakePhase::AwaitLateDecline,
            Phase::LateDeclined { .. } => HandshakePhase::LateDeclined,
            Phase::Smc { .. } => HandshakePhase::Smc,
            Phase::Done(_) | Phase::Unanswered { .. } => HandshakePhase::Done,
        }
    }
}

pub(super) struct Conn<P: Provider> {
    pub(super) role: Role,
    pub(super) phase: Phase,
    /// The GIDs this connection may use, from its local address.
    pub(super) gids: ConnGids,
    pub(super) lgr: Option<LgrId>,
    pub(super) token: u32,
    pub(super) reader: ClcReader,
    pub(super) out: VecDeque<u8>,
    /// The data path: buffers, cursors, leases, close state, link (see
    /// `endpoint/conn_core/`).
    pub(super) core: CoreRef<P>,
    /// The deadline of this connection's entry in the timer heap, if it has
    /// one (see `endpoint/timers.rs`; the endpoint's bookkeeping, not the
    /// connection's: every phase may have a deadline).
    pub(super) timer_at: Option<Timestamp>,
    /// Listed in `Endpoint::tx_dirty`: something may have given the
    /// connection something to send since it last had nothing.
    pub(super) tx_dirty: bool,
    /// The RMB and send buffer sizes asked for this connection
    /// ([`Endpoint::set_buffer_sizes`]); `None`: the endpoint's.
    pub(super) bufs: (Option<usize>, Option<usize>),
}

impl<P: Provider> Endpoint<P> {
    /// The next alert token: what the peer puts into every CDC for the
    /// connection, so it routes them (§2.1). Never 0 (Linux never hands out 0,
    /// and a check of the peer's refuses it, see `negotiate::check_peer_values`),
    /// and, once the counter has wrapped, none that a live connection holds.
    fn next_alert_token(&mut self) -> u32 {
        loop {
            let token = self.next_token;
            self.next_token = self.next_token.wrapping_add(1);
            if self.next_token == 0 {
                self.next_token = 1;
                self.tokens_wrapped = true;
            }
            let taken = self.tokens_wrapped && self.conns.values().any(|c| c.token == token);
            if token != 0 && !taken {
                return token;
            }
        }
    }

    pub(super) fn new_conn(&mut self, role: Role, phase: Phase, gids: ConnGids) -> ConnId {
        let token = self.next_alert_token();
        let c = Conn {
            role,
            phase,
            gids,
            lgr: None,
            token,
            reader: ClcReader::new(),
            out: VecDeque::new(),
            core: Arc::new(Mutex::new(ConnCore::new())),
            timer_at: None,
            tx_dirty: false,
            bufs: (None, None),
        };
        let id = self.conns.insert(c);
        // its handshake deadline
        self.arm_conn_timer(id);
        id
    }

    /// Asks for an RMB of `rmb_len` and a send buffer of `sndbuf_len` bytes
    /// for connection `id` instead of the endpoint's sizes (`None`: the
    /// endpoint's), as a socket's `SO_RCVBUF`/`SO_SNDBUF` size its RMB and
    /// send buffer in Linux (smc_core.c `__smc_buf_create`: the size class
    /// at or above the request, 16 KiB the least). Takes effect when the
    /// handshake gives the connection its buffers: call it right after
    /// [`Self::connect`] or [`Self::accept`]. The RMB goes down the size
    /// classes as ever when one that large cannot be registered; the size
    /// taken is what the CLC message announces.
    pub fn set_buffer_sizes(
        &mut self,
        id: ConnId,
        rmb_len: Option<usize>,
        sndbuf_len: Option<usize>,
    ) {
        if let Some(c) = self.conn(id) {
            c.bufs = (rmb_len, sndbuf_len);
        }
    }

    pub(super) fn conn(&mut self, id: ConnId) -> Option<&mut Conn<P>> {
        self.conns.get_mut(id)
    }

    /// How the connection stands.
    pub fn status(&self, id: ConnId) -> Option<ConnStatus> {
        let c = self.conns.get(id)?;
        Some(match &c.phase {
            Phase::Smc { .. } => ConnStatus::Smc,
            Phase::Done(s) => s.clone(),
            &Phase::Unanswered { reason, .. } => ConnStatus::Fallback { reason, peer: None },
            _ => ConnStatus::Handshaking,
        })
    }

    /// Connection `id`'s data path, locked.
    pub(super) fn core(&self, id: ConnId) -> Option<MutexGuard<'_, ConnCore<P>>> {
        self.conns.get(id).map(|c| lock(&c.core))
    }
}

impl<P: Provider> Drop for Conn<P> {
    fn drop(&mut self) {
        // A fast-path handle may outlive the connection's record: it keeps
        // no link alive.
        lock(&self.core).fast = None;
    }
}

/// An established connection's close that waits for its unsent data
/// (`Endpoint::close`): sent anyway at `deadline`, which starts over
/// whenever the peer has taken some of the `unsent` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CloseWait {
    pub(super) deadline: Timestamp,
    /// Unsent bytes when `deadline` was last set.
    pub(super) unsent: usize,
}

impl CloseWait {
    pub(super) fn new(unsent: usize, now: Timestamp) -> CloseWait {
        CloseWait {
            deadline: now + super::close::MAX_STREAM_WAIT,
            unsent,
        }
    }
}

impl Phase {
    /// The close's wait for unsent data, if one runs.
    pub(super) fn close_wait(&mut self) -> Option<&mut Option<CloseWait>> {
        match self {
            Phase::Smc { close_wait, .. } => Some(close_wait),
            _ => None,
        }
    }

    /// A close that waits for unsent data waits on each time the peer has
    /// taken some of it (`unsent`: what is left, with a data path).
    pub(super) fn close_progress(&mut self, unsent: Option<usize>, now: Timestamp) {
        if let (Some(Some(w)), Some(unsent)) = (self.close_wait(), unsent) {
            if unsent < w.unsent {
                *w = CloseWait::new(unsent, now);
            }
        }
    }
}
