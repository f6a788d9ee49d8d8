//! Time, as quinn-proto has it: the endpoint says when it next needs to run
//! ([`Endpoint::poll_timeout`]) and is called then
//! ([`Endpoint::handle_timeout`]), so that a driver sleeps until that
//! deadline or an event, never on a period, and an idle endpoint costs
//! nothing.
//!
//! What waits for a time:
//!
//! * each connection: its handshake deadline (`protocol-clc.md` §4.6), the
//!   late-Decline waits, the peer-gone grace after its TCP end, the close
//!   wait for unsent data (`endpoint/close.rs`; Linux's
//!   `SMC_MAX_STREAM_WAIT_TIMEOUT`, §5.6 of `protocol-llc-cdc.md`). Their earliest is kept in a heap of
//!   `(deadline, connection)`, so that neither asking for the next deadline
//!   nor running the due ones walks the idle connections. An entry is
//!   pushed when a connection's earliest deadline comes before the one it
//!   has in the heap (`Conn::timer_at`); a later or cleared deadline leaves
//!   the entry, which is dropped (and the connection re-armed) once it is
//!   at the top (`prune_timers`, after every pump).
//! * each link group: smc-proto's [`LinkGroup::poll_timeout`] (CONFIRM_LINK
//!   and LLC request waits, TEST_LINK, §1.5 and §1.10) and the linger of a
//!   group without connections (Linux `smc_lgr_schedule_free_work`, §5.6).
//!   Each pump looks at every group and keeps the earliest (`lgr_next`),
//!   so that asking costs next to nothing (a driver asks whenever it
//!   releases the endpoint); what changes a group's timers between pumps
//!   (a handshake, a link event, a close) also sets `sweep_due`, a received
//!   LLC message `lgr_recheck`.
//! * the freeing of connections whose last CDC's completion the driver did
//!   not arm for (`reap_at`, `endpoint/arm.rs`): a look at the send CQs.
//! * work that an event left for the next pump (`sweep_due`, connections
//!   to look at, `due`): due at once.
//!
//! [`LinkGroup::poll_timeout`]: smc_proto::link::LinkGroup::poll_timeout

use super::conn::{Conn, Phase};
use super::{ConnId, Endpoint, Result};
use smc_proto::Timestamp;
use smc_rdma::Provider;
use std::cmp::Reverse;

/// Connection deadlines, earliest first (see the module documentation).
pub(super) type TimerHeap = std::collections::BinaryHeap<Reverse<(Timestamp, ConnId)>>;

/// The earliest time at which connection `c` has something due.
pub(super) fn conn_deadline<P: Provider>(c: &Conn<P>) -> Option<Timestamp> {
    match &c.phase {
        Phase::AwaitAccept { deadline, .. }
        | Phase::AwaitProposal { deadline }
        | Phase::AwaitLgr { deadline, .. }
        | Phase::AwaitConfirm { deadline, .. }
        | Phase::AwaitLateDecline { deadline, .. }
        | Phase::LateDeclined { deadline, .. } => Some(*deadline),
        Phase::Smc {
            tcp_gone_deadline,
            close_wait,
        } => earliest(*tcp_gone_deadline, close_wait.map(|w| w.deadline)),
        _ => None,
    }
}

/// The earlier of two optional times (`None`: no time).
pub(super) fn earliest(a: Option<Timestamp>, b: Option<Timestamp>) -> Option<Timestamp> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl<P: Provider> Endpoint<P> {
    /// When [`Self::handle_timeout`] must next be called: the earliest
    /// deadline of anything the endpoint waits for, a time already past when
    /// an event left work for the next pump, `None` when nothing waits for a
    /// time. Events on the completion channel ([`Self::notify_fd`]) and calls
    /// into the endpoint come on top; after any call, this may have moved
    /// earlier.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        if self.sweep_due || self.lgr_recheck || !self.due.is_empty() {
            return Some(self.now);
        }
        let conn = self.timers.peek().map(|Reverse((d, _))| *d);
        earliest(earliest(conn, self.lgr_next), self.reap_at)
    }

    /// Runs what is due at `now` (and whatever else a [`Self::pump`] finds:
    /// it is one).
    pub fn handle_timeout(&mut self, now: Timestamp) -> Result<()> {
        self.pump(now)
    }

    /// How many timers have fired so far (a connection's deadline passed, a
    /// link group's timer ran): when it moves, a pump changed something a
    /// waiter may care about without a completion.
    pub fn timer_events(&self) -> u64 {
        self.timer_events
    }

    /// Keeps connection `id`'s earliest deadline in the heap.
    pub(super) fn arm_conn_timer(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(id) else {
            return;
        };
        let Some(d) = conn_deadline(c) else {
            return;
        };
        if c.timer_at.is_none_or(|t| d < t) {
            c.timer_at = Some(d);
            self.timers.push(Reverse((d, id)));
        }
    }

    /// Drops heap entries at the top that no longer stand for a deadline
    /// (the connection's deadline was cleared, moved later, or the
    /// connection is gone), re-arming their connections: the next deadline
    /// reported is a real one, and an established connection does not wake
    /// its driver at the end of its handshake's wait.
    pub(super) fn prune_timers(&mut self) {
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            let c = self.conns.get_mut(id);
            let live = c
                .as_ref()
                .is_some_and(|c| c.timer_at == Some(t) && conn_deadline(c).is_some_and(|d| d <= t));
            if live {
                return;
            }
            self.timers.pop();
            if let Some(c) = c {
                if c.timer_at == Some(t) {
                    c.timer_at = None;
                }
            }
            self.arm_conn_timer(id);
        }
    }

    /// Connection `id` is to be looked at by the next pump (its timers, and
    /// whether it can be freed), without a sweep of every connection.
    pub(super) fn conn_due(&mut self, id: ConnId) {
        self.due.push(id);
    }

    /// A step of connection `id`'s handshake or close (a CLC message, an
    /// rkey flow's end, a close, its TCP end): the next pump looks at it
    /// (its timers, whether it can be freed, what it has to send), at the
    /// groups (it may have joined or left one), and at the Proposals parked
    /// for a first contact (this may have been that first contact's step);
    /// not at every connection, so that setting up and closing N
    /// connections costs O(N), not O(N²).
    pub(super) fn conn_event(&mut self, id: ConnId) {
        self.conn_due(id);
        self.mark_tx(id);
        self.lgr_recheck = true;
        self.due.append(&mut self.parked);
    }

    /// Takes the connections whose heap entry is due at `now` into `out`
    /// (and those an event marked, `due`).
    pub(super) fn take_due(&mut self, now: Timestamp, out: &mut Vec<ConnId>) {
        out.append(&mut self.due);
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            if let Some(c) = self.conns.get_mut(id) {
                // (an entry for an earlier deadline superseded this one's
                // place: the connection's own entry is still in the heap)
                if c.timer_at == Some(t) {
                    c.timer_at = None;
                }
            }
            out.push(id);
        }
    }
}
