//! Progress: [`Endpoint::pump`] does everything due at a time — handshake,
//! close and peer-gone deadlines, link-group timers (TEST_LINK, LLC
//! timeouts, idle groups), device events, completions and LLC output, sending
//! — and frees finished connections; the completion channel a driver sleeps
//! on between pumps ([`Endpoint::notify_fd`]; what it arms: `endpoint/arm.rs`).
//!
//! Linux runs the same from tasklets and work queues (smc_wr.c completion
//! tasklets, smc_core.c `smc_lgr_free_work`, smc_close.c timers); here time
//! is passed in. Spec: `protocol-clc.md` §4.6 (handshake timeouts),
//! `protocol-llc-cdc.md` §1.5 (LLC timers), §5.6 (close timeouts, idle
//! groups).

use super::conn::{ConnStatus, Phase};
use super::conn_core::lock;
use super::timers::earliest;
use super::{ConnId, Endpoint, LgrId, Result};
use crate::state::{LgrEvent, LgrState};
use smc_proto::clc_stream::FailReason;
use smc_proto::close::{CloseEvent, CloseFlags};
use smc_proto::link::LINK_SLOTS;
use smc_proto::Timestamp;
use smc_rdma::{CompletionChannel, CompletionQueue, Provider, QueuePair};

impl<P: Provider> Endpoint<P> {
    /// Does everything due at `now`: CLC timeouts, LLC traffic, completions,
    /// received CDCs, data and cursor updates, keepalives, link failover.
    /// Connection timers (handshake, close and peer-gone deadlines) run when
    /// due (see `endpoint/timers.rs`); after a link, handshake or close
    /// event (`sweep_due`) the pump walks every connection, once, otherwise
    /// only those that a timer or an event names, so that neither a message
    /// nor an idle endpoint costs more with more idle connections.
    pub fn pump(&mut self, now: Timestamp) -> Result<()> {
        self.now = now;
        self.poll_device_events();
        if self.reap_at.is_some_and(|t| now >= t) {
            // (the connections these completions finish are freed by the
            // next pump, `due`; for a CDC still in flight then, the
            // driver's next arm arms its send CQ: `reap_looked`)
            self.reap_at = None;
            self.reap_looked = true;
            self.poll_sends_in_flight()?;
        }
        // (events of this pump that call for a sweep set `sweep_due` again,
        // for the next one)
        let sweep = std::mem::take(&mut self.sweep_due);
        if sweep && !self.held_validations.is_empty() {
            // (those of a group that is gone: nothing left to judge)
            let lgrs = &self.lgrs;
            self.held_validations.retain(|h| lgrs.get(h.0).is_some());
        }
        // (the common case, nothing due, touches no list)
        let timers_due = !self.due.is_empty()
            || self
                .timers
                .peek()
                .is_some_and(|std::cmp::Reverse((t, _))| *t <= now);
        let mut ids = Vec::new();
        if sweep || timers_due {
            ids = std::mem::take(&mut self.scratch_due);
            ids.clear();
            if sweep {
                // every connection's timers are looked at and armed, the
                // heap's entries stay (they find nothing, or what is due anyway)
                self.due.clear();
                ids.extend(self.conns.ids());
            } else {
                self.take_due(now, &mut ids);
            }
            for &id in &ids {
                self.conn_timers(id, now);
            }
        }
        // The groups' timers are looked at when the earliest is due, or
        // after an event (what changes a group's timers sets `sweep_due`,
        // or `lgr_recheck` when an LLC message came in): a message's pump
        // does not pay for them.
        let recheck = std::mem::take(&mut self.lgr_recheck);
        if recheck && !sweep {
            // A connection's event or an LLC message before this pump: a
            // group may be done (a walk of the groups, not of the
            // connections; as in a sweep, the pump after the group's end).
            self.reap_lgrs();
        }
        let lgr_timers = recheck || sweep || self.lgr_next.is_some_and(|t| now >= t);
        let mut lgr_next: Option<Timestamp> = None;
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            if !sweep && !lgr_timers && self.lgr_quiet(l) {
                // Nothing can have come in on its links and nothing waits
                // there: only what its connections have to send (a message
                // on another group's connection costs this one next to
                // nothing, so that it does not cost more with more groups).
                if self.marked_in(l) {
                    self.flush_tx(l, false)?;
                    self.drain_lgr(l, now)?;
                }
                continue;
            }
            self.retry_rkey_flows(l, now);
            self.pump_lgr(l, now, sweep)?;
            if !lgr_timers {
                continue;
            }
            // The group's timers after what its links received: a driver
            // that sleeps until a deadline is woken by it and by nothing
            // else, so an answer (a TEST_LINK response) that came in
            // meanwhile must count before the wait for it is over.
            let idle_timeout = self.cfg.lgr_idle_timeout;
            let mut idle_expired = false;
            let mut fired = false;
            let mut next = None;
            // (the linger of a group without connections, see `poll_timeout`)
            let mut linger = None;
            if let Some(lg) = self.lgrs.get_mut(l) {
                next = lg.group.poll_timeout();
                if next.is_some_and(|t| now >= t) {
                    // (a keepalive's wait for a peer whose process is
                    // stopped goes on: `LinkGroup::peer_paused`)
                    for (slot, res) in lg.links.iter().enumerate() {
                        if let Some(r) = res {
                            if lg.group.keepalive_overdue(slot, now) && r.qp.peer_paused() {
                                lg.group.peer_paused(slot, now);
                            }
                        }
                    }
                    fired = true;
                    lg.group.on_timeout(now);
                }
                if lg.tokens.is_empty() && lg.state == LgrState::Active {
                    let since = *lg.idle_since.get_or_insert(now);
                    idle_expired = now >= since + idle_timeout;
                    linger = Some(since + idle_timeout);
                } else {
                    lg.idle_since = None;
                }
            }
            if idle_expired {
                fired = true;
                linger = None;
                self.lgr_step(l, LgrEvent::IdleExpired);
            }
            if fired {
                self.timer_events += 1;
                // what the timers decided goes out now
                self.drain_lgr(l, now)?;
                next = self.lgrs.get(l).and_then(|lg| lg.group.poll_timeout());
            }
            lgr_next = earliest(earliest(lgr_next, next), linger);
        }
        if lgr_timers {
            self.lgr_next = lgr_next;
        }
        // connections that this pump's sending and receiving may have
        // finished (`conn_due`) are freed now, not at the next pump
        // (those this pump's events marked stay marked: the next pump looks
        // at their timers, `conn_event`)
        if sweep {
            let mut all = self.conns.walk();
            while let Some(id) = all.next(&self.conns) {
                self.reap(id);
            }
            self.reap_lgrs();
        } else if !ids.is_empty() || !self.due.is_empty() {
            ids.extend_from_slice(&self.due);
            for &id in &ids {
                self.reap(id);
            }
        }
        if ids.capacity() > 0 {
            self.scratch_due = ids;
        }
        self.prune_timers();
        // A driver arms, then pumps once more before it sleeps: what that
        // pump posted may be waited for by its send completion.
        self.arm_sends()?;
        Ok(())
    }

    /// Connection `id`'s timers at `now` (see `endpoint/timers.rs`); arms its
    /// next deadline.
    fn conn_timers(&mut self, id: ConnId, now: Timestamp) {
        let due = match self.conns.get(id).map(|c| &c.phase) {
            Some(&Phase::AwaitAccept { deadline, .. })
            | Some(&Phase::AwaitProposal { deadline })
            | Some(&Phase::AwaitConfirm { deadline, .. }) => now >= deadline,
            _ => false,
        };
        if due {
            self.sweep_due = true;
            self.timer_events += 1;
            match self.conns.get(id).map(|c| &c.phase) {
                // (the client goes on over TCP: `give_up_on_accept`)
                Some(Phase::AwaitAccept { .. }) => self.give_up_on_accept(id),
                _ => self.finish(id, ConnStatus::Failed(FailReason::Timeout)),
            }
        }
        match self.conns.get(id).map(|c| &c.phase) {
            Some(&Phase::AwaitLateDecline { version, deadline }) if now >= deadline => {
                self.sweep_due = true;
                self.timer_events += 1;
                self.send_late_decline(id, version);
            }
            Some(&Phase::LateDeclined { reason, deadline }) if now >= deadline => {
                self.sweep_due = true;
                self.timer_events += 1;
                self.finish(id, ConnStatus::Fallback { reason, peer: None });
            }
            _ => {}
        }
        if matches!(
            self.conns.get(id).map(|c| &c.phase),
            Some(Phase::AwaitLgr { .. })
        ) {
            self.retry_parked(id, now);
        }
        if let Some(c) = self.conns.get_mut(id) {
            let (tcp_gone, close_waits) = match &mut c.phase {
                Phase::Smc {
                    tcp_gone_deadline,
                    close_wait,
                } => (
                    tcp_gone_deadline.take_if(|d| now >= *d).is_some(),
                    close_wait.is_some(),
                ),
                _ => (false, false),
            };
            // (its core only when the TCP end's grace ran out or a close
            // waits for unsent data: a sweep walks every connection)
            if !tcp_gone && !close_waits {
                self.arm_conn_timer(id);
                return;
            }
            let mut k = lock(&c.core);
            // (a peer that closed during the grace changed nothing here)
            if tcp_gone && !k.closer.rx_flags().any_close() {
                self.sweep_due = true;
                self.timer_events += 1;
                // treated like an abort from the peer: ECONNRESET
                k.close_event(CloseEvent::Peer(CloseFlags {
                    done_writing: false,
                    closed: false,
                    abort: true,
                }));
                // Its link may have died with it, silently (a peer
                // whose device went away sends no DELETE_LINK): then
                // our CDCs on it never complete where the transport
                // retries forever (rxe at retry count 7), and the
                // connection, released, would wait for them until
                // the next keepalive. Probe the link now: unanswered,
                // it goes down after SMC_LLC_WAIT_TIME and, as the
                // last link, ends the group (Linux `smcr_link_down`).
                if let (Some(l), Some(slot)) = (c.lgr, k.link) {
                    if let Some(lg) = self.lgrs.get_mut(l) {
                        lg.group.probe_link(slot, now);
                    }
                }
            }
            let unsent = k.unsent();
            c.phase.close_progress(unsent, now);
            let expired = c
                .phase
                .close_wait()
                .and_then(|w| w.take_if(|w| now >= w.deadline))
                .is_some();
            if expired {
                self.sweep_due = true;
                self.timer_events += 1;
                if unsent.is_some_and(|n| n > 0) {
                    // Data a write accepted cannot go: an abort, never a
                    // close after a shortened stream (see `Endpoint::close`).
                    // (the abort flag goes out whatever the close state: a
                    // peer's abort may have closed it, while our final close
                    // still waited for the data)
                    k.close_event(CloseEvent::Kill { can_send: true });
                    if let Some(dp) = k.dp.as_mut() {
                        dp.set_close_flags(CloseFlags {
                            abort: true,
                            ..dp.close_flags_sent()
                        });
                    }
                    drop(k);
                    self.event_aborted(id, super::events::AbortCause::Local);
                    self.mark_tx(id);
                }
            }
        }
        self.arm_conn_timer(id);
    }

    fn pump_lgr(&mut self, l: LgrId, now: Timestamp, sweep: bool) -> Result<()> {
        self.drain_lgr(l, now)?;
        for slot in 0..LINK_SLOTS {
            // (pumps run in every waiting loop: skip empty slots cheaply)
            let present = self.lgrs.get(l).is_some_and(|lg| lg.links[slot].is_some());
            if !present {
                continue;
            }
            // a fast post that failed is a failed post of the endpoint's
            // (`ConnCore::fast_write`)
            let fast_error = self
                .lgrs
                .get(l)
                .and_then(|lg| lg.links[slot].as_ref())
                .and_then(super::link::LinkRes::take_fast_error);
            if let Some(e) = fast_error {
                self.link_error(l, slot, e)?;
            }
            self.poll_recv(l, slot, now)?;
            self.poll_send(l, slot)?;
        }
        self.settle_validations(l, now)?;
        self.drain_lgr(l, now)?;
        self.flush_tx(l, sweep)?;
        // a link that failed while sending is dealt with now, not next time
        self.drain_lgr(l, now)?;
        self.close_fast(l);
        self.open_rx(l);
        Ok(())
    }

    /// Whether group `l` has nothing to do but its connections' sending:
    /// active, no rkey flow queued, nothing the group's state machine has
    /// for the driver already (a port event between pumps queues a link's
    /// failure, the client's invitation, the server's wish for a link:
    /// with no message or timer to follow they would wait for the group's
    /// keepalive), every link connected with nothing to poll on either CQ
    /// (`CompletionQueue::may_have_work`, which the providers without a
    /// cheap look answer `true`: their groups are always pumped) and
    /// nothing left by a receive dispatch without the device lock
    /// (`LinkRx::attention`) or by a fast path's reap of the send CQ
    /// (`LinkTx::has_reaped`). A group
    /// in any other state, or whose timers are due, is pumped whole.
    fn lgr_quiet(&self, l: LgrId) -> bool {
        let Some(lg) = self.lgrs.get(l) else {
            return true;
        };
        lg.state == LgrState::Active
            && lg.rkey_queue.is_empty()
            && !self.holds_validations(l)
            && !lg.group.has_work()
            && lg.links.iter().flatten().all(|r| {
                r.connected
                    && !r.tx.scq.may_have_work()
                    && !r.tx.has_reaped()
                    && !r.rx.cq.may_have_work()
                    && !r.rx.attention()
            })
    }

    /// Whether a connection of group `l` is marked to send (`mark_tx`).
    fn marked_in(&self, l: LgrId) -> bool {
        self.tx_dirty.iter().any(|&id| {
            self.conns
                .get(id)
                .is_some_and(|c| c.tx_dirty && c.lgr == Some(l))
        })
    }

    /// Frees connection `id` if it is closed and released.
    fn reap(&mut self, id: ConnId) {
        let finished = self.conns.get(id).is_some_and(|c| {
            // CDCs of a dead link group never complete; do not wait for them.
            let lgr_dead = c
                .lgr
                .is_none_or(|l| self.lgrs.get(l).is_none_or(|lg| lg.group.is_terminated()));
            lock(&c.core).reapable(lgr_dead)
        });
        if !finished {
            return;
        }
        if let Some(l) = self.conns.get(id).and_then(|c| c.lgr) {
            self.detach(id, l);
            self.pool_bufs(id, l);
        }
        self.conns.remove(id);
        self.reap_looked = false;
        // (its group may be done, a Proposal parked for it may go on: the
        // next pump looks, without a sweep of every connection)
        self.lgr_recheck = true;
        self.due.append(&mut self.parked);
    }

    /// Frees the link groups that died (in a sweep: the pump after the
    /// group's end, not the one that posted its last LLC message).
    fn reap_lgrs(&mut self) {
        let mut groups = self.lgrs.walk();
        while let Some(l) = groups.next(&self.lgrs) {
            let dead = self
                .lgrs
                .get(l)
                .is_some_and(|lg| lg.state == LgrState::Terminating && lg.tokens.is_empty());
            if dead {
                // (connections parked for a first contact decide again)
                self.sweep_due = true;
                self.lgr_step(l, LgrEvent::LastConnGone);
            }
        }
    }

    /// A descriptor that becomes readable when an armed completion queue gets a
    /// completion (the endpoint's completion channel); with a second device
    /// ([`Self::open_second_device`]) also when either device has an
    /// asynchronous event (a port going down), see `endpoint/devices.rs`.
    pub fn notify_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match &self.wake {
            Some(w) => w.as_fd(),
            None => self.chan.fd(),
        }
    }

    /// Consumes the notification on [`Self::notify_fd`], if any (the
    /// devices' events are taken by the next [`Self::pump`]).
    pub fn take_notification(&self) -> bool {
        let first = self.chan.try_get_event().unwrap_or(false);
        let second = self
            .chan2
            .as_ref()
            .is_some_and(|c| c.try_get_event().unwrap_or(false));
        first || second
    }

    /// How many times a connection was looked at for something to send (one
    /// connection each time), so far: a diagnostic of what pumps cost, which
    /// grows with the connections that had something to do, not with the
    /// idle ones.
    pub fn conn_flushes(&self) -> u64 {
        self.conn_flushes
    }

    /// Writes of the endpoint's that went straight into the peer's RMB
    /// without a CDC of their own while their link's SENDs were all in
    /// flight, so far (their CDC went with the next batch:
    /// `DataPath::write_corked`); the fast path's own corked writes
    /// (`ConnCore::fast_write`) are not counted here.
    pub fn corked_writes(&self) -> u64 {
        self.corked_writes
    }

    /// Work completions processed so far: when it moves, [`Self::pump`] did
    /// something (data, cursor updates, LLC) that a waiter may care about.
    pub fn completions(&self) -> u64 {
        self.completions
    }

    /// Whether a [`Self::pump`] now could find anything new on the links (a
    /// cheap look for busy-waiting callers; may say `true` spuriously). It
    /// does not cover timers or device events: a caller that stops pumping on
    /// `false` must still pump now and then.
    pub fn may_have_work(&self) -> bool {
        self.lgrs.values().any(|lg| {
            lg.links.iter().flatten().any(|r| {
                r.tx.scq.may_have_work()
                    || r.tx.has_reaped()
                    || r.rx.cq.may_have_work()
                    || r.rx.attention()
            })
        })
    }
}
