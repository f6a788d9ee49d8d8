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

use super::gid::ConnGids;
use super::lgr::PeerRmb;
use super::{ConnId, Endpoint, LgrId};
use crate::state::HandshakePhase;
use smc_proto::clc_stream::{ClcReader, FailReason};
use smc_proto::close::Closer;
use smc_proto::datapath::{DataPath, Violation};
use smc_proto::link::Role;
use smc_proto::Timestamp;
use smc_rdma::{MemWindow, Provider};
use smc_wire::cdc::CdcMessage;
use smc_wire::clc::{AcceptConfirm, DeclineCode, Proposal};
use std::collections::VecDeque;

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
        /// oldest can be dropped. Only these two server phases hold them: the
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
    },
    Done(ConnStatus),
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
            Phase::Done(_) => HandshakePhase::Done,
        }
    }
}

pub(super) struct Conn<P: Provider> {
    pub(super) role: Role,
    pub(super) phase: Phase,
    /// The GIDs this connection may use, from its local address.
    pub(super) gids: ConnGids,
    pub(super) lgr: Option<LgrId>,
    /// The link (slot) the connection is assigned to.
    pub(super) link: Option<usize>,
    /// A requested move to this link, done once no CDC is in flight on the old one.
    pub(super) move_to: Option<usize>,
    /// A failover validation CDC to send first on the new link (§2.4).
    pub(super) validation: Option<CdcMessage>,
    pub(super) token: u32,
    pub(super) reader: ClcReader,
    pub(super) out: VecDeque<u8>,
    pub(super) rmb: Option<P::Mr>,
    pub(super) sndbuf: Option<P::Mr>,
    pub(super) dp: Option<DataPath>,
    pub(super) closer: Closer,
    pub(super) peer_rmb: Option<PeerRmb>,
    pub(super) violation: Option<Violation>,
    /// When a close waiting for the send buffer to drain is sent anyway.
    pub(super) close_deadline: Option<Timestamp>,
    /// The deadline of this connection's entry in the timer heap, if it has
    /// one (see `endpoint/timers.rs`).
    pub(super) timer_at: Option<Timestamp>,
    /// Unsent bytes when `close_deadline` was last set: the wait starts over
    /// whenever the peer has taken some (see `Endpoint::close`).
    pub(super) close_unsent: usize,
    /// The peer's latest urgent (out-of-band) byte, until the application reads it.
    pub(super) oob: Option<u8>,
    /// The send cursor (absolute) after the last direct write: data up to
    /// here never was in the send buffer and cannot be replayed.
    pub(super) direct_sent: u64,
    /// Listed in `Endpoint::tx_dirty`: something may have given the
    /// connection something to send since it last had nothing.
    pub(super) tx_dirty: bool,
    /// A [`ReadLease`](super::ReadLease) is out: other reads find nothing until its commit.
    pub(super) read_leased: bool,
    /// A [`WriteLease`](super::WriteLease) is out: nothing else is written (or sent) until its
    /// commit, as it copies to where the next bytes go.
    pub(super) write_leased: bool,
    /// A write found the send buffer full and none has taken bytes since
    /// (the full send buffer is counted once per wait).
    pub(super) tx_full_noted: bool,
    /// Something was refused because of a lease since the last
    /// [`Endpoint::take_lease_waited`].
    pub(super) lease_waited: bool,
    /// The window onto the peer's RMB that write leases lend, with the link
    /// slot and rkey it was made for (made again when they change).
    pub(super) peer_window: Option<(usize, u32, MemWindow)>,
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
            let taken =
                self.tokens_wrapped && self.conns.iter().flatten().any(|c| c.token == token);
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
            link: None,
            move_to: None,
            validation: None,
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
            timer_at: None,
            close_unsent: 0,
            oob: None,
            direct_sent: 0,
            read_leased: false,
            write_leased: false,
            tx_full_noted: false,
            lease_waited: false,
            peer_window: None,
            tx_dirty: false,
        };
        let id = match self.conns.iter().position(Option::is_none) {
            Some(i) => {
                self.conns[i] = Some(c);
                i
            }
            None => {
                self.conns.push(Some(c));
                self.conns.len() - 1
            }
        };
        // its handshake deadline
        self.arm_conn_timer(id);
        id
    }

    pub(super) fn conn(&mut self, id: ConnId) -> Option<&mut Conn<P>> {
        self.conns.get_mut(id).and_then(Option::as_mut)
    }

    /// How the connection stands.
    pub fn status(&self, id: ConnId) -> Option<ConnStatus> {
        let c = self.conns.get(id)?.as_ref()?;
        Some(match &c.phase {
            Phase::Smc { .. } => ConnStatus::Smc,
            Phase::Done(s) => s.clone(),
            _ => ConnStatus::Handshaking,
        })
    }

    pub(super) fn smc_conn(&mut self, id: ConnId) -> std::result::Result<&mut Conn<P>, ConnError> {
        match self.conns.get_mut(id).and_then(Option::as_mut) {
            Some(c) if c.dp.is_some() => Ok(c),
            _ => Err(ConnError::NotConnected),
        }
    }
}
