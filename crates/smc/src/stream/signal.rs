//! An `SmcStream`'s readiness for event loops: its readiness descriptor,
//! the peer's signal, and the events a wait reports from them.

use super::SmcStream;
use crate::ctx;
use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

impl SmcStream {
    /// The descriptor that polls readable exactly when a read would not
    /// block (data, end of file, an error) and writable exactly when a write
    /// would not block, for `poll()`, `select()` and `epoll` (level- or
    /// edge-triggered), also what `AsFd` returns. On SMC-R it is the
    /// connection's readiness descriptor (an `AF_UNIX` datagram socket set
    /// by the library whenever the connection changes; created at the first
    /// call, which is why this can fail: no descriptor left); it shows
    /// `POLLRDHUP` once the peer sends nothing more and `POLLHUP` once the
    /// connection is over (reset, aborted or closed both ways; the error
    /// is the next read's or write's). Never read from or write to it. On
    /// TCP it is the TCP socket, except that bytes received behind a
    /// Decline and not read yet ([`SmcStream::has_pending`]) do not show.
    pub fn readiness_fd(&self) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        match self.smc_conn()? {
            Some(c) => Ok(c.readiness()?.as_fd()),
            None => Ok(self.tcp.as_fd()),
        }
    }

    /// A descriptor through which the peer wakes an event loop directly:
    /// the peer's SEND makes it readable when it brings something for this
    /// connection while the loop waits (`None`: not SMC-R, or the device
    /// cannot; on the shared-memory device it can). An event loop polls it
    /// for readable beside [`SmcStream::readiness_fd`], under the same
    /// event data, and says so with [`SmcStream::watch_signal`]; readable,
    /// it means "read the connection": data the peer announced through it
    /// shows there and not on the readiness descriptor. It is armed again
    /// (and drained, unless every poller is edge-triggered:
    /// [`SmcStream::signal_edge_only`]) by the reads: never read from or
    /// write to it. Without
    /// it (`mio` and other users of `AsFd`) the readiness descriptor shows
    /// everything, set by whichever thread of ours takes the peer's CDC.
    pub fn signal_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        let c = self.smc_conn().ok()??;
        Some(c.shown().ok()?.signal.as_ref()?.fd.as_fd())
    }

    /// Says that a poller of [`SmcStream::signal_fd`] registered (`true`)
    /// or left (`false`); the peer signals it while at least one is
    /// registered. When the last one leaves, what the peer signalled
    /// shows on the readiness descriptor again.
    pub fn watch_signal(&self, on: bool) {
        self.watch(on, true);
    }

    /// [`SmcStream::watch_signal`]; `drain`: the first poller's arm drains
    /// the descriptor.
    fn watch(&self, on: bool, drain: bool) {
        let Ok(Some(c)) = self.smc_conn() else { return };
        let Some(s) = c.signal() else { return };
        if on {
            if s.pollers.fetch_add(1, Ordering::AcqRel) == 0 {
                // (every CDC before this signalled the completion channel:
                // nothing came unannounced, no look needed)
                if drain {
                    s.bell.arm_polled();
                } else {
                    s.bell.arm_polled_undrained();
                }
            }
            return;
        }
        let left = s
            .pollers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if left != Ok(1) {
            return;
        }
        s.bell.disarm_polled();
        if s.shared.load(Ordering::Acquire) {
            s.bell.drain_polled();
        }
        // A CDC the peer signalled may still wait in the receive queue,
        // announced to nobody else: taken now, and what it brought shows
        // on the readiness descriptor.
        if let Some(f) = c.fast_conn() {
            c.shared.take_held_cdc(f);
            f.refresh();
        }
    }

    /// [`SmcStream::watch_signal`] for a `poll` or `select` (`on`: it
    /// starts watching; `false`: it is over), which waits on
    /// [`SmcStream::signal_fd`] level-triggered: while one does, the signal
    /// is drained whenever it is armed again (see
    /// [`SmcStream::signal_edge_only`]).
    pub fn watch_signal_level(&self, on: bool) {
        let Ok(Some(c)) = self.smc_conn() else { return };
        let Some(s) = c.signal() else { return };
        if on {
            s.level_polls.fetch_add(1, Ordering::AcqRel);
            // Not drained: what a peer signalled before is out of the
            // descriptor, drained when the last poller went
            // (`Bell::disarm_polled`), and a poll or select watches at
            // every call, where a drain that finds nothing is a system
            // call for nothing. A write that lands late (its SEND took the
            // word before that drain) wakes this poll once; its look at
            // the connection (`SmcStream::signalled_events`) arms the
            // signal again drained.
            self.watch(true, false);
        } else {
            self.watch_signal(false);
            let _ = s
                .level_polls
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    /// Says whether every `epoll` registration of [`SmcStream::signal_fd`]
    /// is edge-triggered in the kernel (`EPOLLET`; `false`, the default:
    /// one may not be). Then, and while no `poll` or `select` watches it
    /// ([`SmcStream::watch_signal_level`]), the signal is armed again
    /// without draining the descriptor: a count left in it does not wake an
    /// edge-triggered registration (a write does, whatever the count), and
    /// the drain is a system call per message saved (Linux fs/eventfd.c
    /// `eventfd_write` wakes the waiters at every write; fs/eventpoll.c
    /// `ep_poll_callback` queues an edge-triggered item at every wake-up).
    pub fn signal_edge_only(&self, edge: bool) {
        let Ok(Some(c)) = self.smc_conn() else { return };
        if let Some(s) = c.signal() {
            s.level_epoll.store(!edge, Ordering::Release);
        }
    }

    /// Says that another process may wait on [`SmcStream::signal_fd`] too
    /// (a child forked while the connection was open polls the descriptor
    /// it inherited): from now on the last poller's going here drains the
    /// descriptor whatever it holds, so that a count a peer's late write
    /// left does not wake that process's waits again and again.
    pub fn signal_shared(&self) {
        let Ok(Some(c)) = self.smc_conn() else { return };
        if let Some(s) = c.signal() {
            s.shared.store(true, Ordering::Release);
        }
    }

    /// Says how the pollers of [`SmcStream::signal_fd`] wait: `true`, all
    /// level-triggered (`poll`, `select`, `epoll` without `EPOLLET` or
    /// `EPOLLEXCLUSIVE`), so that the peer writes the signal once for all
    /// the CDCs that come until a look drains it
    /// ([`SmcStream::signalled_events`], a read that would block); `false`
    /// (the default), some wait edge-triggered, and the peer writes it for
    /// every CDC, as TCP wakes such a poller for every segment.
    pub fn signal_level(&self, level: bool) {
        let Ok(Some(c)) = self.smc_conn() else { return };
        if let Some(s) = c.signal() {
            s.bell.set_poll_level(level);
        }
    }

    /// What `epoll` would report for the connection now, as TCP's poll does
    /// (`EPOLLIN`, `EPOLLOUT`, `EPOLLRDHUP`, `EPOLLHUP` bits of `libc`'s
    /// values; not `EPOLLPRI`, which a poller that asks for it adds,
    /// [`SmcStream::urgent_waiting`]), after taking
    /// what the peer signalled through [`SmcStream::signal_fd`] (so that
    /// its data, end of file and room show together, in one event); a
    /// signal with nothing behind it is armed again (drained as
    /// [`SmcStream::signal_fd`] says). For an event loop whose
    /// wait the signal ended. `None`: not known here (not SMC-R, no
    /// readiness descriptor).
    pub fn signalled_events(&self) -> Option<u32> {
        self.events_after_signal(true)
    }

    /// What `epoll` would report for the connection now, as
    /// [`SmcStream::signalled_events`] says it (a CDC the peer signalled
    /// taken first), but without draining or arming the signal: a look for
    /// a poller that asks whether the connection can be written, which
    /// costs no system call. `None`: not known here.
    pub fn ready_events(&self) -> Option<u32> {
        self.events_after_signal(false)
    }

    /// [`SmcStream::signalled_events`] (`spent`: a spent signal drained and
    /// armed again) and [`SmcStream::ready_events`].
    fn events_after_signal(&self, spent: bool) -> Option<u32> {
        let Ok(Some(c)) = self.smc_conn() else {
            return None;
        };
        let (Some(f), Some(r)) = (c.fast_conn(), c.ready.get()) else {
            return None;
        };
        if let Some(s) = r.signal.as_ref().filter(|s| s.polled()) {
            let taken = s.bell.polled_taken();
            if taken {
                c.shared.take_held_cdc(f);
            }
            let rearm = spent && f.level().readable == 0;
            if rearm {
                // Nothing (more) to read: the signal is spent, or stale (a
                // peer's write that came after a drain), and a level-
                // triggered wait would see it again and again. Armed
                // again (drained where a poller waits level-triggered,
                // `PeerSignal::arm`), then a look for what came before the
                // arm (a CDC that another thread applies meanwhile shows
                // here or on the readiness descriptor, never on neither).
                s.arm();
                c.shared.take_held_cdc(f);
            }
            if spent || taken {
                f.refresh();
            }
        }
        Some(ctx::shown_level(f).epoll_events())
    }

    /// Whether the peer's urgent byte waits (TCP's `POLLPRI`,
    /// `FastConn::urgent_waiting`), which the readiness descriptor cannot
    /// show: a poller that asked for it adds it. `false` for a connection
    /// that is not SMC-R.
    pub fn urgent_waiting(&self) -> bool {
        let Ok(Some(c)) = self.smc_conn() else {
            return false;
        };
        c.fast_conn().is_some_and(|f| {
            c.shared.take_held_cdc(f);
            f.urgent_waiting()
        })
    }

    /// Whether a poller of [`SmcStream::signal_fd`] is registered
    /// ([`SmcStream::watch_signal`]): the peer signals it, and a poll of the
    /// connection must include it.
    pub fn signal_polled(&self) -> bool {
        let Ok(Some(c)) = self.smc_conn() else {
            return false;
        };
        c.signal().is_some_and(|s| s.polled())
    }

    /// Whether a CDC of the peer signalled [`SmcStream::signal_fd`] since it
    /// was last armed (what it brought may have been read already).
    pub fn signal_taken(&self) -> bool {
        let Ok(Some(c)) = self.smc_conn() else {
            return false;
        };
        c.signal()
            .is_some_and(|s| s.polled() && s.bell.polled_taken())
    }

    /// The bytes a read would return now without waiting, as TCP's
    /// `FIONREAD` counts them (up to the urgent byte's mark, none while the
    /// reader stands at it: `FastConn::inq`), without taking any (a CDC
    /// that has come is taken off the link first, so that what it brought
    /// counts). `None`: not an SMC-R connection (a fallback's bytes are the
    /// TCP socket's).
    pub fn readable_bytes(&self) -> Option<usize> {
        let Ok(Some(c)) = self.smc_conn() else {
            return None;
        };
        let f = c.fast_conn()?;
        c.shared.take_held_cdc(f);
        Some(f.inq())
    }
}
