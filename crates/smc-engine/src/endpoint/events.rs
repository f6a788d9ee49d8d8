//! Link and connection events as the engine decides them: a link up, a link
//! down (and why), a connection moved to another link by failover, a
//! connection aborted. Plain data in a bounded queue the driver drains
//! ([`Endpoint::poll_event`]) where it pumps the engine, to log and count
//! them (smc-tools' `smcr stats`; the kernel counts and traces the same
//! points: smc_core.c `smcr_link_down`, `smc_switch_conns`,
//! `smc_conn_kill`).

use super::{ConnId, Endpoint, LgrId};
use smc_proto::link::DownReason;
use smc_rdma::Provider;
use std::collections::VecDeque;

/// Events kept until the driver drains them; older ones are dropped (and
/// counted, [`Endpoint::events_lost`]) beyond this, so that a driver that
/// never drains costs bounded memory.
pub const EVENT_QUEUE_LEN: usize = 256;

/// Why a connection was aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortCause {
    /// Its link went down and no other link of the group could take it
    /// (no link left, or none with the peer's rkey for its RMB).
    NoLink,
    /// Its link failed and data it wrote directly cannot be replayed, or
    /// the new link could not be readied for the peer's RMB (§7.2).
    FailoverLoss,
    /// Its link group ended (no usable link, or DELETE_LINK ALL).
    GroupTerminated,
    /// The peer broke the protocol, or a failover validation showed loss.
    Violation,
    /// The peer sent an abort (its CDC's `peer_conn_abort`).
    Peer,
    /// This side could not ready the peer's RMB once established.
    Local,
    /// Data came after the application shut down both directions, and
    /// the connection stands in for a TCP socket, which resets then
    /// (`smc_proto::close::CloseEvent::Reset`).
    DataAfterShutdown,
}

impl AbortCause {
    /// A short name for logs and counters.
    pub fn name(self) -> &'static str {
        match self {
            AbortCause::NoLink => "no_link",
            AbortCause::FailoverLoss => "failover_loss",
            AbortCause::GroupTerminated => "group_terminated",
            AbortCause::Violation => "violation",
            AbortCause::Peer => "peer",
            AbortCause::Local => "local",
            AbortCause::DataAfterShutdown => "data_after_shutdown",
        }
    }
}

/// Something that happened to a link or a connection (see the module).
/// `lgr` is the group's index in this endpoint, `lgr_id` the engine's id
/// of it ([`crate::state::LgrDiag::id`]), `slot` a link slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// A link became active (first contact confirmed, or added by ADD_LINK).
    LinkUp {
        /// Group index.
        lgr: LgrId,
        /// The engine's id of the group.
        lgr_id: u32,
        /// Link slot.
        slot: usize,
        /// The link is on the endpoint's second device
        /// ([`Endpoint::second_device_name`]).
        second: bool,
    },
    /// A link went down.
    LinkDown {
        /// Group index.
        lgr: LgrId,
        /// The engine's id of the group.
        lgr_id: u32,
        /// Link slot.
        slot: usize,
        /// The link is on the endpoint's second device.
        second: bool,
        /// Why (smc-proto's reason).
        reason: DownReason,
    },
    /// A connection of a failed link moved to another link of its group.
    ConnMoved {
        /// Group index.
        lgr: LgrId,
        /// The engine's id of the group.
        lgr_id: u32,
        /// The connection.
        conn: ConnId,
        /// Its alert token.
        token: u32,
        /// The failed link's slot.
        from: usize,
        /// The new link's slot.
        to: usize,
        /// The failed link is on the endpoint's second device.
        from_second: bool,
        /// The new link is on the endpoint's second device.
        to_second: bool,
    },
    /// A connection was aborted.
    ConnAborted {
        /// The engine's id of its group, if it had one.
        lgr_id: Option<u32>,
        /// The connection.
        conn: ConnId,
        /// Its alert token.
        token: u32,
        /// Why.
        cause: AbortCause,
    },
}

/// The bounded queue.
#[derive(Default)]
pub(super) struct Events {
    q: VecDeque<EngineEvent>,
    lost: u64,
    /// Buffer events, counted only (see [`crate::state::BufCounts`]).
    pub(super) bufs: crate::state::BufCounts,
}

impl Events {
    pub(super) fn push(&mut self, ev: EngineEvent) {
        if self.q.len() >= EVENT_QUEUE_LEN {
            self.q.pop_front();
            self.lost += 1;
        }
        self.q.push_back(ev);
    }
}

impl<P: Provider> Endpoint<P> {
    /// The oldest event not yet taken, if any.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.q.pop_front()
    }

    /// Buffer events so far (`smcr stats`).
    pub fn buf_counts(&self) -> crate::state::BufCounts {
        self.events.bufs
    }

    /// The device this endpoint runs on.
    pub fn device_name(&self) -> &str {
        &self.cfg.device
    }

    /// The endpoint's second device, if it has one (the device of the
    /// events whose link is `second`).
    pub fn second_device_name(&self) -> Option<&str> {
        self.dev2_name.as_deref()
    }

    /// Whether link `slot` of group `l` is on the second device (false for
    /// a link already released).
    fn on_second(&self, l: LgrId, slot: usize) -> bool {
        self.link_on_second_device(l, slot).unwrap_or(false)
    }

    /// Events dropped because the queue was full.
    pub fn events_lost(&self) -> u64 {
        self.events.lost
    }

    /// The engine's id of group `l`.
    fn lgr_engine_id(&self, l: LgrId) -> Option<u32> {
        self.lgrs.get(l).map(|lg| lg.group.config().id)
    }

    pub(super) fn event_link_up(&mut self, l: LgrId, slot: usize) {
        let lgr_id = self.lgr_engine_id(l).unwrap_or(0);
        let second = self.on_second(l, slot);
        self.events.push(EngineEvent::LinkUp {
            lgr: l,
            lgr_id,
            slot,
            second,
        });
    }

    pub(super) fn event_link_down(&mut self, l: LgrId, slot: usize, reason: DownReason) {
        let lgr_id = self.lgr_engine_id(l).unwrap_or(0);
        let second = self.on_second(l, slot);
        self.events.push(EngineEvent::LinkDown {
            lgr: l,
            lgr_id,
            slot,
            second,
            reason,
        });
    }

    pub(super) fn event_moved(&mut self, l: LgrId, id: ConnId, from: usize, to: usize) {
        let lgr_id = self.lgr_engine_id(l).unwrap_or(0);
        let token = self.conns.get(id).map_or(0, |c| c.token);
        let (from_second, to_second) = (self.on_second(l, from), self.on_second(l, to));
        self.events.push(EngineEvent::ConnMoved {
            lgr: l,
            lgr_id,
            conn: id,
            token,
            from,
            to,
            from_second,
            to_second,
        });
    }

    pub(super) fn event_aborted(&mut self, id: ConnId, cause: AbortCause) {
        let (token, lgr) = self.conns.get(id).map_or((0, None), |c| (c.token, c.lgr));
        let lgr_id = lgr.and_then(|l| self.lgr_engine_id(l));
        self.events.push(EngineEvent::ConnAborted {
            lgr_id,
            conn: id,
            token,
            cause,
        });
    }
}
