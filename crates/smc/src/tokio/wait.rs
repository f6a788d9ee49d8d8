//! How a stream's task waits: for its connection's level (its own
//! readiness, the peer's signal) and, where it needs the endpoint, for the
//! completion channel in its runtime's reactor.

use crate::ctx::{self, Shared};
use crate::provider::AnyProvider;
use crate::stream::SmcConn;
use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;
use smc_engine::endpoint::Endpoint;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};

type WaitFuture = Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

/// Which of a stream's waits.
#[derive(Clone, Copy)]
pub(super) enum Dir {
    Read,
    Write,
}

/// A stream's sleep on the device's completion channel: its own duplicate
/// of the channel's descriptor, registered with the reactor on first use.
/// The reader (and the handshake) waits in the `AsyncFd`'s read slot, the
/// writer in a `readable()` future of its own: both are woken by a signal.
pub(super) struct Chan {
    fd: Option<Arc<AsyncFd<OwnedFd>>>,
    wr: Option<WaitFuture>,
    /// This stream's number: its read wait is `2 * id`, its write wait
    /// `2 * id + 1` as the watcher of the channel ([`Shared::watch_channel`]).
    id: u64,
}

/// The next [`Chan::id`] (0 means no watcher).
static NEXT_CHAN: AtomicU64 = AtomicU64::new(1);

impl Default for Chan {
    fn default() -> Self {
        Chan {
            fd: None,
            wr: None,
            id: NEXT_CHAN.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl Chan {
    pub(super) fn fd(&mut self, shared: &Shared) -> io::Result<Arc<AsyncFd<OwnedFd>>> {
        if let Some(fd) = &self.fd {
            return Ok(fd.clone());
        }
        // `with_interest` is deprecated since tokio 1.53 because a generic
        // `AsRawFd` can name a descriptor it does not own; its unsafe
        // successor's contract (the descriptor stays open and the same for
        // the `AsyncFd`'s lifetime) holds by construction for an `OwnedFd`,
        // which this crate cannot state in `unsafe` code.
        #[allow(deprecated)]
        let fd = Arc::new(AsyncFd::with_interest(
            shared.notify_dup()?,
            Interest::READABLE,
        )?);
        self.fd = Some(fd.clone());
        Ok(fd)
    }

    /// Ready once the channel signalled since the last time (the readiness
    /// seen is consumed); otherwise registers `cx` for the next signal.
    pub(super) fn poll_signal(
        &mut self,
        dir: Dir,
        shared: &Shared,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        let fd = self.fd(shared)?;
        match dir {
            Dir::Read => {
                let mut guard = ready!(fd.poll_read_ready(cx))?;
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
            Dir::Write => {
                let f = self.wr.get_or_insert_with(|| {
                    Box::pin(async move {
                        let mut guard = fd.readable().await?;
                        guard.clear_ready();
                        Ok(())
                    })
                });
                let r = ready!(f.as_mut().poll(cx));
                self.wr = None;
                Poll::Ready(r)
            }
        }
    }

    /// Runs `op` on the endpoint until it returns `Some`. In between the
    /// task is registered with the endpoint for `want` (a pump after which
    /// its connection can go on wakes it, see [`Shared::try_or_arm`]), and
    /// if no other waiting stream does, it watches the completion channel
    /// for everyone: woken by a signal, it pumps (which wakes the tasks the
    /// completion concerns), and one that was not for its own connection
    /// leaves the watch to the next task that waits (most likely the one the
    /// completion was for), so that traffic on one connection does not keep
    /// waking a task that waits for another.
    pub(super) fn poll_op<R>(
        &mut self,
        dir: Dir,
        want: ctx::Want,
        shared: &Shared,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        let me = 2 * self.id + matches!(dir, Dir::Write) as u64;
        let mut signalled = false;
        loop {
            if let Some(r) = shared.try_or_arm(want, cx.waker(), &mut op) {
                // (free for whoever waits next: this task may wait no more)
                self.unwatch(dir, me, shared);
                return Poll::Ready(r);
            }
            if signalled {
                self.unwatch(dir, me, shared);
                return Poll::Pending;
            }
            if !shared.watch_channel(me) {
                return Poll::Pending;
            }
            ready!(self.poll_signal(dir, shared, cx))?;
            signalled = true;
        }
    }

    /// Gives up watching the channel for wait `me`; a writer's pending
    /// wait on it ends too, so that the next signal does not wake its task.
    fn unwatch(&mut self, dir: Dir, me: u64, shared: &Shared) {
        shared.unwatch_channel(me);
        if matches!(dir, Dir::Write) {
            self.wr = None;
        }
    }

    /// Gives up watching the channel (the stream is dropped).
    pub(super) fn release(&self, shared: &Shared) {
        shared.unwatch_channel(2 * self.id);
        shared.unwatch_channel(2 * self.id + 1);
    }
}

/// The connection's peer signal, registered with the reactor as it is,
/// without a duplicate: the `Arc` keeps the descriptor open, and the same,
/// as long as the registration lives.
struct SignalFd(Arc<ctx::PeerSignal>);

impl AsRawFd for SignalFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd.as_raw_fd()
    }
}

/// A stream's waits for its own connection (issue 15: a message wakes
/// only the task that waits for its connection, and the peer's SEND wakes
/// it, not a thread of ours that took the CDC): the connection's level, as
/// its readiness descriptor would show it, with the tasks' wakers in
/// place of a descriptor (`readiness::TaskReady`: set by whichever thread
/// changes the connection, a pump's abort or a send completion too), and
/// its peer signal, which the peer writes for every CDC it sends while the
/// stream is registered (`crate::SmcStream::signal_fd`; the CDC waits for
/// this stream to take it). Made at the stream's first wait.
pub(super) struct ConnWait {
    tasks: Arc<crate::readiness::TaskReady>,
    signal: Option<Arc<AsyncFd<SignalFd>>>,
    /// The writing task's wait on the signal (the reading task's is the
    /// `AsyncFd`'s read slot, which keeps one waker).
    wr: Option<WaitFuture>,
    /// Whether a waker of the reading (`[0]`) and of the writing task is
    /// left with `tasks`.
    registered: [bool; 2],
}

impl ConnWait {
    pub(super) fn new(conn: &SmcConn, nb: &crate::SmcStream) -> io::Result<ConnWait> {
        let tasks = conn.task_ready()?.clone();
        let signal = match &conn.shown()?.signal {
            Some(s) => {
                // (`with_interest` is deprecated since tokio 1.53 because a
                // generic `AsRawFd` can name a descriptor it does not own;
                // its unsafe successor's contract, the descriptor open and
                // the same for the `AsyncFd`'s lifetime, holds by
                // construction: `SignalFd` holds it)
                #[allow(deprecated)]
                let fd = AsyncFd::with_interest(SignalFd(s.clone()), Interest::READABLE)?;
                // (edge-triggered, as tokio registers: the peer writes
                // the signal for every CDC, `SmcStream::signal_level`)
                nb.signal_level(false);
                // (and nothing else polls it: armed again without a drain)
                nb.signal_edge_only(true);
                nb.watch_signal(true);
                Some(Arc::new(fd))
            }
            None => None,
        };
        Ok(ConnWait {
            tasks,
            signal,
            wr: None,
            registered: [false; 2],
        })
    }

    /// The task of direction `dir` goes on (woken, or not waiting): a
    /// waker it left would be woken by the changes its own reads and
    /// writes make, for a look that finds nothing.
    pub(super) fn done(&mut self, dir: Dir) {
        let i = matches!(dir, Dir::Write) as usize;
        if std::mem::take(&mut self.registered[i]) {
            self.tasks.forget(i == 1);
        }
    }

    /// A read went on: a signal the reactor reported is spent (the read
    /// took the CDC; the next one signals again, and a read that finds
    /// nothing arms the signal for it first). Left standing, it would end
    /// the next wait at once, for a look that finds nothing.
    pub(super) fn read_went_on(&mut self) {
        self.done(Dir::Read);
        if let Some(sig) = &self.signal {
            // (a look at the reactor's record, no system call; the read
            // slot is this task's, which is not waiting)
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(Ok(mut g)) = sig.poll_read_ready(&mut cx) {
                g.clear_ready();
            }
        }
    }

    /// Ready when something changed for the connection that may let an
    /// operation in direction `dir` go on (the caller looks again);
    /// otherwise `cx` is registered for the next change. A signal from the
    /// peer that a writer sees takes what it announced first, so that the
    /// room it brought shows (a reader's next read takes it).
    pub(super) fn poll(
        &mut self,
        dir: Dir,
        nb: &crate::SmcStream,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(sig) = &self.signal {
            let fired = match dir {
                Dir::Read => match sig.poll_read_ready(cx) {
                    Poll::Ready(g) => {
                        g?.clear_ready();
                        true
                    }
                    Poll::Pending => false,
                },
                Dir::Write => {
                    let sig = sig.clone();
                    let f = self.wr.get_or_insert_with(|| {
                        Box::pin(async move {
                            sig.readable().await?.clear_ready();
                            Ok(())
                        })
                    });
                    match f.as_mut().poll(cx) {
                        Poll::Ready(r) => {
                            self.wr = None;
                            r?;
                            true
                        }
                        Poll::Pending => false,
                    }
                }
            };
            if fired {
                self.done(dir);
                if matches!(dir, Dir::Write) {
                    let _ = nb.signalled_events();
                }
                return Poll::Ready(Ok(()));
            }
        }
        let i = matches!(dir, Dir::Write) as usize;
        match self.tasks.poll(i == 1, cx.waker()) {
            Poll::Ready(()) => {
                self.done(dir);
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                self.registered[i] = true;
                Poll::Pending
            }
        }
    }
}
