//! What each connection shows its waiters: its readiness descriptor's
//! level (`crate::readiness`), set by whichever thread changes the
//! connection, and the peer's own signal where the device has one.

use super::bell::bells_on;
use super::Shared;
use crate::provider::AnyProvider;
use smc_engine::endpoint::{ConnId, ConnLevel, Endpoint, FastConn};
use smc_proto::close::CloseState;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// What a connection shows its waiters (its readiness descriptor, an
/// async stream's tasks: `readiness::Shown`), set under the connection's
/// own lock (`FastConn::watch`) by whichever thread changes it: a read or
/// write of the fast path or of the endpoint, a CDC applied by the
/// endpoint's pump or by another reader's dispatch, a send completion.
pub(crate) struct ConnReadiness {
    /// The connection (`None`: gone from the endpoint when this was made;
    /// it shows the end).
    fast: Option<FastConn<AnyProvider>>,
    pub(crate) shown: Arc<crate::readiness::Shown>,
    /// The peer's direct signal, where the device has one (see
    /// [`PeerSignal`]).
    pub(crate) signal: Option<Arc<PeerSignal>>,
}

impl Drop for ConnReadiness {
    fn drop(&mut self) {
        // (the core outlives the handle until the endpoint frees it)
        if let Some(f) = &self.fast {
            f.watch(None);
        }
        if let Some(s) = &self.signal {
            if s.pollers.load(Ordering::Acquire) > 0 {
                s.bell.disarm_polled();
            }
            // (drained whatever came: the region's next connection shares
            // the descriptor, and a count left would be readiness of
            // nothing to its pollers: a read that finds nothing, which
            // some programs take for an error, wrk among them)
            s.bell.drain_polled();
            // (the region's next connection starts with pollers of its own)
            s.bell.set_poll_level(false);
        }
    }
}

/// A descriptor the peer makes readable itself when a CDC for the
/// connection comes while the application's event loop waits
/// (`Bell::arm_polled`), so that the loop is woken by the peer's SEND, not
/// by our progress thread after it pumped (a wake-up and a thread hop per
/// message). An event loop polls it beside the readiness descriptor, as
/// readable only (`SmcStream::signal_fd`); reading the connection takes
/// what the signal announced. It cannot be the readiness descriptor
/// itself: the peer would need that descriptor's control end, with which
/// it could also show a false hang-up or writability; all it can do with
/// this one is make it readable (at worst a wake-up for nothing).
///
/// While it is readable for a CDC that the peer signalled, the readiness
/// descriptor does not show the data that CDC brought (it would be a
/// second system call and wake-up for the same bytes): the application
/// sees the connection readable through this one. It is armed again (and
/// drained where a poller waits on it level-triggered, [`PeerSignal::arm`])
/// only where a look for CDCs follows (a read that would block, the
/// event loop's wait: `SmcStream::signalled_events`).
pub(crate) struct PeerSignal {
    pub(crate) bell: smc_rdma::Doorbell,
    /// The bell's descriptor, duplicated for this connection (a region's
    /// bell outlives a connection when its buffer is used again, and an
    /// epoll set keeps a registration while its descriptor is open).
    pub(crate) fd: OwnedFd,
    /// Pollers registered ([`SmcStream::watch_signal`]): the bell is armed
    /// for them while there is one.
    ///
    /// [`SmcStream::watch_signal`]: crate::SmcStream::watch_signal
    pub(crate) pollers: AtomicUsize,
    /// Whether an `epoll` registration of the descriptor may be
    /// level-triggered (until the poller says otherwise,
    /// [`SmcStream::signal_edge_only`]).
    ///
    /// [`SmcStream::signal_edge_only`]: crate::SmcStream::signal_edge_only
    pub(crate) level_epoll: AtomicBool,
    /// `poll`s and `select`s that watch the descriptor now
    /// ([`SmcStream::watch_signal_level`]), level-triggered all.
    ///
    /// [`SmcStream::watch_signal_level`]: crate::SmcStream::watch_signal_level
    pub(crate) level_polls: AtomicUsize,
    /// A forked child may wait on the descriptor too
    /// ([`SmcStream::signal_shared`]): the last poller's going drains it
    /// always, where it drains only what a peer signalled since the arm
    /// otherwise (a count a late write left would wake the child's waits
    /// until something here arms the signal again).
    ///
    /// [`SmcStream::signal_shared`]: crate::SmcStream::signal_shared
    pub(crate) shared: AtomicBool,
}

impl PeerSignal {
    /// Whether a poller is registered.
    #[inline]
    pub(crate) fn polled(&self) -> bool {
        self.pollers.load(Ordering::Acquire) > 0
    }

    /// Arms the bell for the pollers again (`Bell::arm_polled`), the
    /// descriptor drained only where a poller may wait on it
    /// level-triggered: a count left in it would wake such a poller again
    /// and again, while an edge-triggered one is woken by a write only, and
    /// the drain would be a system call per message for nothing
    /// (`Bell::arm_polled_undrained`).
    #[inline]
    pub(crate) fn arm(&self) -> bool {
        if self.level_epoll.load(Ordering::Acquire) || self.level_polls.load(Ordering::Acquire) > 0
        {
            self.bell.arm_polled()
        } else {
            self.bell.arm_polled_undrained()
        }
    }
}

/// What connection `f`'s readiness descriptor shows for its level now.
pub(crate) fn shown_level(f: &FastConn<AnyProvider>) -> crate::readiness::Level {
    level(&f.level())
}

/// The peer signal of a connection whose device has one (`Bell::poll_fd`).
fn peer_signal(f: &FastConn<AnyProvider>) -> Option<Arc<PeerSignal>> {
    if !bells_on() || !signals_on() {
        return None;
    }
    let bell = f.bell()?;
    let fd = smc_rdma::sys::dup_out_of_the_way(bell.poll_fd()?).ok()?;
    Some(Arc::new(PeerSignal {
        fd,
        bell,
        pollers: AtomicUsize::new(0),
        level_epoll: AtomicBool::new(true),
        level_polls: AtomicUsize::new(0),
        shared: AtomicBool::new(false),
    }))
}

/// Whether event loops are woken by the peer directly where the device can
/// (`PeerSignal`); `SMC_PEER_SIGNAL=0`: through the progress thread, as on
/// devices without the signal (to compare the two).
pub(crate) fn signals_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMC_PEER_SIGNAL").map_or(true, |v| v != "0"))
}

/// A connection that is over, as its readiness descriptor shows it.
pub(crate) const GONE: crate::readiness::Level = crate::readiness::Level {
    readable: true,
    writable: true,
    eof: true,
    hup: true,
    err: false,
};

/// What a connection's readiness descriptor shows: readable and writable as
/// [`Want::Read`](super::Want::Read) and [`Want::Write`](super::Want::Write)
/// are ready, end of file once the peer sends nothing more, the end once
/// the connection is over.
fn level(l: &ConnLevel) -> crate::readiness::Level {
    // (also both directions shut, each by one side: EPOLLHUP as a TCP
    // socket whose sk_shutdown is SHUTDOWN_MASK, tcp.c tcp_poll, and as
    // af_smc.c smc_poll)
    let gone = crate::stream::over(l.close);
    // (both directions shut by this side, SHUT_RD and SHUT_WR: the same)
    let both_here = l.read_shut && l.close == CloseState::PeerCloseWait1;
    crate::readiness::Level {
        readable: l.readable > 0,
        writable: l.sndbuf_free > 0 || l.peer_closed,
        eof: l.peer_done,
        hup: gone || both_here,
        err: l.failed,
    }
}

impl Shared {
    /// What connection `id` shows its waiters from now on (with the
    /// endpoint locked): its descriptor and its tasks' side are made when
    /// asked for (`SmcConn::readiness`, `SmcConn::task_ready`).
    pub(crate) fn readiness(
        &self,
        ep: &Endpoint<AnyProvider>,
        id: ConnId,
    ) -> io::Result<Arc<ConnReadiness>> {
        let fast = ep.fast_conn(id);
        let shown = Arc::new(crate::readiness::Shown::default());
        let signal = fast.as_ref().and_then(peer_signal);
        if let Some(f) = &fast {
            let to = shown.clone();
            let sig = signal.clone();
            f.watch(Some(Arc::new(move |l: &ConnLevel| {
                let now = level(l);
                // The peer's signal shows these bytes. (Once they are
                // read it stays readable, spent, until a read that finds
                // nothing or the event loop's wait arms it again: both
                // look for CDCs after arming, which this cannot do here —
                // a CDC published and not yet applied would be announced
                // by nothing.)
                let held = now.readable
                    && sig
                        .as_ref()
                        .is_some_and(|s| s.polled() && s.bell.polled_taken());
                to.set(now, held)
            })));
        }
        let r = Arc::new(ConnReadiness {
            fast,
            shown,
            signal,
        });
        let mut v = self.readiness.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&r));
        self.readied.store(v.len(), Ordering::SeqCst);
        drop(v);
        self.kick_lazy();
        Ok(r)
    }

    /// Sets one connection's readiness descriptor (after a change through
    /// the endpoint).
    pub(crate) fn refresh_one(&self, r: &ConnReadiness) {
        match &r.fast {
            Some(f) => f.refresh(),
            None => r.shown.set(GONE, false),
        }
    }

    /// Sets every readiness descriptor of the endpoint to its connection's
    /// state (with the endpoint locked, after a pump: what the engine
    /// changed without the connection's core seeing it, a failover's or a
    /// timer's abort; nothing to do without descriptors).
    pub(super) fn refresh_readiness(&self) {
        if self.readied.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut v = self.readiness.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| match w.upgrade() {
            Some(r) => {
                self.refresh_one(&r);
                true
            }
            None => false,
        });
        self.readied.store(v.len(), Ordering::Release);
    }
}
