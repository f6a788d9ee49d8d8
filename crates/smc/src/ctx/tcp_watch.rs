//! The TCP sockets of an endpoint's established connections, watched for
//! their end: a user-space peer that dies takes its TCP socket with it and
//! may send no close CDC (see [`Shared::watch_tcp`]).

use super::{fd_ready, nanos, origin, timespec_until, Shared};
use crate::provider::AnyProvider;
use rustix::event::{epoll, PollFd, PollFlags, Timespec};
use smc_engine::endpoint::{ConnId, Endpoint};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sleep that ends within this anyway does not watch the TCP ends of
/// the established connections: it looks at them when it ends. Every
/// connection's orderly close ends its TCP connection too (right after
/// its close CDC, which is what counts), and a watching sleeper would be
/// woken by each one for nothing; a dead peer, whose TCP end is what the
/// watch is for, is taken for dead only `PEER_GONE_GRACE` after it anyway.
const WATCH_SLACK: Duration = Duration::from_millis(20);

/// Whether a sleep until `until` watches the TCP ends (see [`WATCH_SLACK`]).
pub(super) fn watches_tcp_ends(until: Option<Instant>) -> bool {
    until.is_none_or(|u| u.saturating_duration_since(Instant::now()) > WATCH_SLACK)
}

/// A TCP socket to watch for its end, not yet in the epoll set: weakly held,
/// so that a socket the watch is the last to know of is closed (a forked
/// child's copy of the list keeps no parent connection's TCP end open).
pub(super) struct Unwatched {
    tcp: std::sync::Weak<std::net::TcpStream>,
    id: ConnId,
    since: Instant,
}

/// After a TCP end, everyone waiting looks again this long after the
/// engine's grace (its pump must have run past the deadline).
const RECHECK_MARGIN: Duration = Duration::from_millis(20);

impl Shared {
    /// Watches the TCP socket of the established connection `id` for its end
    /// (EOF, RST, error). In Linux an SMC connection and its TCP connection
    /// end together (smc_close.c `smc_close_active_abort` aborts the TCP
    /// socket with the connection, af_smc.c `__smc_release` releases it with
    /// the socket); a user-space peer whose process dies or misbehaves takes
    /// its TCP socket away and may send no close CDC. So the engine is told
    /// ([`Endpoint::tcp_closed`]) and resets the connection unless the peer's
    /// close arrives within `PEER_GONE_GRACE` (a peer closing normally shuts
    /// its TCP connection down right after its close CDC). One epoll set per
    /// endpoint, no descriptor or thread per connection. The socket must stay
    /// open until [`Shared::unwatch_tcp`].
    ///
    /// It joins the epoll set only once it has lived [`WATCH_SLACK`], or
    /// before a sleep that watches the TCP ends ([`Self::register_watches`]):
    /// most short connections close (orderly, with their close CDC) before
    /// that and never cost the two `epoll_ctl` calls; a dead peer is taken
    /// for dead `PEER_GONE_GRACE` after its TCP end anyway. A leader asleep
    /// for longer is woken (its timer) when the socket is due.
    pub(crate) fn watch_tcp(&self, tcp: &Arc<std::net::TcpStream>, id: ConnId) {
        let since = Instant::now();
        self.unwatched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Unwatched {
                tcp: Arc::downgrade(tcp),
                id,
                since,
            });
        self.kick_at(nanos(
            (since + WATCH_SLACK).saturating_duration_since(origin()),
        ));
    }

    /// Puts the sockets given to [`Self::watch_tcp`] into the epoll set:
    /// all of them (`all`, before a sleep that watches the TCP ends) or
    /// those that waited [`WATCH_SLACK`].
    pub(super) fn register_watches(&self, all: bool) {
        let mut q = self.unwatched.lock().unwrap_or_else(|e| e.into_inner());
        if q.is_empty() {
            return;
        }
        let now = Instant::now();
        while let Some(u) = q.front() {
            if !all && now.saturating_duration_since(u.since) < WATCH_SLACK {
                break;
            }
            let Some(u) = q.pop_front() else { break };
            // (the list stays locked: `unwatch_tcp` of this socket, which
            // comes before its close, waits for the registration)
            if let Some(tcp) = u.tcp.upgrade() {
                // one event is all it takes (ONESHOT): a socket that ended
                // stays readable. Without the watch the connection still
                // works; it is reset only when the peer's device says the
                // peer is gone.
                let _ = epoll::add(
                    &self.watch,
                    tcp.as_fd(),
                    epoll::EventData::new_u64(u.id.to_bits()),
                    epoll::EventFlags::RDHUP | epoll::EventFlags::ONESHOT,
                );
            }
        }
    }

    /// Stops watching a socket given to [`Shared::watch_tcp`] (before it is closed).
    pub(crate) fn unwatch_tcp(&self, tcp: &Arc<std::net::TcpStream>) {
        {
            let mut q = self.unwatched.lock().unwrap_or_else(|e| e.into_inner());
            // (the newest first: most connections that end soon are)
            if let Some(i) = q
                .iter()
                .rposition(|u| std::ptr::eq(u.tcp.as_ptr(), Arc::as_ptr(tcp)))
            {
                q.remove(i);
                return;
            }
        }
        let _ = epoll::delete(&self.watch, tcp.as_fd());
    }

    /// Tells the engine of the watched TCP connections that ended (with the
    /// endpoint locked). Handshakes fail at once; established connections are
    /// reset after `PEER_GONE_GRACE` unless their peer closes meanwhile, so
    /// everyone waiting looks again now and then.
    pub(super) fn take_tcp_ends(&self, ep: &mut Endpoint<AnyProvider>) {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 64];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let Ok((got, _)) = epoll::wait(&self.watch, &mut buf, Some(&zero)) else {
            return;
        };
        if got.is_empty() {
            return;
        }
        // What came before the TCP ends first: a peer closes its connections
        // with a close CDC, then its TCP socket, and a TCP end after the
        // close CDC changes nothing.
        self.pump(ep);
        let mut changed = false;
        for ev in got.iter() {
            let data = ev.data;
            let d = data.u64();
            // (a connection freed meanwhile: its handle finds nothing, even
            // where a new connection took its slot)
            changed |= ep.tcp_closed(ConnId::from_bits(d));
        }
        if !changed {
            self.pump(ep);
            return;
        }
        self.recheck_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Instant::now() + smc_engine::endpoint::PEER_GONE_GRACE + RECHECK_MARGIN);
        self.pump(ep);
        self.wake(ep, true);
        self.refresh_readiness();
        #[cfg(feature = "tokio")]
        self.wake_tasks(ep, true);
    }

    /// Waits until `until` for a watched TCP connection to end, and deals
    /// with it (the progress thread, while application threads pump).
    pub(super) fn poll_watch(&self, until: Instant) {
        let ts = timespec_until(Some(until));
        let watching = watches_tcp_ends(Some(until));
        self.register_watches(watching);
        let ended = if watching {
            let mut pfd = [PollFd::new(&self.watch, PollFlags::IN)];
            matches!(rustix::event::poll(&mut pfd, ts.as_ref()), Ok(n) if n > 0)
        } else {
            let _ = rustix::event::poll(&mut [], ts.as_ref());
            fd_ready(&self.watch)
        };
        if ended {
            let mut ep = self.lock();
            self.take_tcp_ends(&mut ep);
        }
    }

    /// Once the grace after a TCP end has passed: the connections it reset
    /// wake their waiters (a reset need not come with a completion).
    pub(super) fn recheck_if_due(&self) {
        let due = {
            let mut r = self.recheck_at.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let mut due = false;
            while r.front().is_some_and(|t| now >= *t) {
                r.pop_front();
                due = true;
            }
            due
        };
        if due {
            let mut ep = self.lock();
            self.pump(&mut ep);
            self.wake(&ep, true);
            self.refresh_readiness();
            #[cfg(feature = "tokio")]
            self.wake_tasks(&ep, true);
        }
    }
}
