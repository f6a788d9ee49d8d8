//! # Async SMC sockets for tokio (cargo feature `tokio`)
//!
//! [`SmcListener`] and [`SmcStream`] mirror `tokio::net::TcpListener` and
//! `tokio::net::TcpStream`: `SmcListener::bind(addr).await`,
//! `listener.accept().await`, `SmcStream::connect(addr).await`, and the stream
//! is [`AsyncRead`] + [`AsyncWrite`]. A connection is negotiated exactly as by
//! the blocking [`crate::SmcStream`] (SYN option, CLC handshake, SMC-R or TCP
//! fallback with the reason in [`SmcStream::mode`]); the two kinds interoperate
//! on the wire and convert into each other ([`SmcStream::from_std`],
//! [`SmcStream::into_std`], and the same for the listener).
//!
//! Enable it with `smc = { ..., features = ["tokio"] }`; it needs a tokio
//! runtime with I/O and time enabled (`rt` plus `net` and `time`, or `full`).
//!
//! ```no_run
//! use smc::tokio::{SmcListener, SmcStream};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # async fn demo() -> std::io::Result<()> {
//! let listener = SmcListener::bind("127.0.0.1:7000").await?;
//! tokio::spawn(async move {
//!     while let Ok((mut s, _peer)) = listener.accept().await {
//!         tokio::spawn(async move {
//!             let mut buf = vec![0u8; 65536];
//!             while let Ok(n @ 1..) = s.read(&mut buf).await {
//!                 if s.write_all(&buf[..n]).await.is_err() {
//!                     break;
//!                 }
//!             }
//!         });
//!     }
//! });
//! let mut c = SmcStream::connect("127.0.0.1:7000").await?;
//! println!("{:?}", c.mode()); // SmcR, or Tcp(reason)
//! c.write_all(b"ping").await?;
//! let mut b = [0u8; 4];
//! c.read_exact(&mut b).await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## How a task waits
//!
//! Nothing blocks a runtime thread and nothing runs on the blocking pool. A
//! read or write of an SMC-R stream is the blocking stream's in
//! non-blocking mode: its fast path moves the bytes without the endpoint's
//! lock when the connection can (the copy out of our RMB or into the
//! peer's, and the CDC), else the endpoint runs in the task's own poll. If
//! it would block (nothing to read, send buffer or peer window full), the
//! task waits for its own connection, as an event loop under `smc_run`
//! waits on the connection's readiness descriptor, with its waker in place
//! of a descriptor (`readiness::TaskReady`: whichever thread changes the
//! connection wakes the task that waits for what it now shows, a pump's
//! abort or a send completion too, with no system call), and, on the
//! shared-memory device, on the connection's peer signal
//! ([`crate::SmcStream::signal_fd`]), an eventfd registered with
//! [`AsyncFd`] at the stream's first wait, which the peer's SEND writes
//! for every CDC it brings while the stream waits. So a message wakes the
//! task that waits for its connection and no other, and it is the peer
//! that wakes it: no thread of ours takes the CDC first to pass it on.
//! The CDC waits in the link's receive queue for the task, whose next
//! read or write takes it. The reading task waits in the signal's read
//! slot, the writing task in a `readable()` future of its own on it (an
//! `AsyncFd` keeps one waker per slot). Reads and writes in place wait the
//! same way.
//!
//! A stream's `poll_shutdown` waits for its close to leave: for a
//! completion of the device, which it learns of through the endpoint's
//! completion channel. It is registered with the endpoint for that (a pump
//! that takes completions wakes only the tasks whose wait can now end),
//! and, if no other stream does, watches the channel itself through its
//! own duplicate of the channel's descriptor; one woken by a signal that
//! was not for it gives the watch up. Whoever pumps wakes the others: the
//! device's progress thread, which sleeps on the completion channel while
//! no blocking call is in the endpoint, or a blocking stream's thread of
//! the same process.
//!
//! Timers (close deadlines, keepalives, handshake deadlines) run in the
//! device's progress thread, which sleeps until the engine's next deadline
//! (`Endpoint::poll_timeout`); a pump that fires one wakes every waiting
//! task, and so does one that reports a link or connection event (a link
//! down, a connection moved or aborted) or a watched TCP connection's end:
//! a task learns of an abort too.
//!
//! On a `current_thread` runtime the only thread never sleeps anywhere but in
//! the reactor: a client task and a server task of the same process may
//! exchange any amount of data on it (the writer waits for the reader's
//! cursor update in the reactor, the reader's poll sends that update).
//!
//! ## Handshakes
//!
//! The CLC handshake is async too: the task writes the endpoint's CLC output
//! to the TCP socket and, while it waits for the peer's next CLC message,
//! sleeps until the socket is readable or the engine's next deadline (one
//! timer, from `Endpoint::poll_timeout`: the handshake's 6 s deadline is
//! one); while a step runs over the device (first contact confirms the
//! link, rkeys are exchanged), also until the completion channel signals or
//! a pump takes completions. Without an SMC device the Proposal/Decline
//! exchange runs on the TCP socket alone.
//!
//! `SmcListener::accept` runs the handshakes of all connections that have
//! arrived concurrently, inside the listener, and returns the first one that
//! finishes: a client that stays silent delays no one else. Each handshake
//! has a waker of its own, and a wake-up polls only the handshakes it
//! concerns. Handshakes make progress while some task polls `accept` (a
//! server normally always does). A connection whose handshake fails is
//! closed and skipped, as by the blocking listener. Up to 4096 handshakes run
//! at once; later connections wait in the kernel's backlog. Device selection
//! reads the PNET table and the interface list when a connection arrives, in
//! the accepting task (small files, no network waits).
//!
//! An SMC-R stream's TCP socket is watched by the device's endpoint for its
//! end (as the blocking stream's), not by the reactor.

use crate::ctx::{self, Shared};
use crate::handshake::{self, client_reply, client_start, server_reply};
use crate::listen::out_of_resources;
use crate::provider::AnyProvider;
use crate::rendezvous::{peer_offered_smc, peer_offered_smc_by_cookie, socket_for};
use crate::stream::{
    fail_error, fill_bounce, finish_read, finish_write, no_rendezvous, no_smc, read_plan, too_many,
    write_plan, Fallback, Finished, Mode, Parts, ReadGot, ReadSpace, SmcConn, WriteGot, WriteSpace,
    BOUNCE_MAX,
};
use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use ::tokio::net::{lookup_host, TcpListener, TcpStream, ToSocketAddrs};
use smc_engine::endpoint::{ConnStatus, Endpoint};
use smc_engine::state::HandshakePhase;
use smc_proto::clc_stream::ClcReader;
use smc_proto::close::CloseEvent;
use smc_wire::clc::{ClcMessage, ClcType, DeclineCode, CLC_WAIT_TIME};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll, Wake, Waker};
use std::time::Duration;

/// How long the listener stops taking connections after running out of a
/// resource (descriptors, memory): they wait in the kernel's backlog, and
/// `accept` does not spin on the error.
const PAUSE: Duration = Duration::from_millis(100);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type WaitFuture = Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

/// Which of a stream's waits.
#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

/// A stream's sleep on the device's completion channel: its own duplicate
/// of the channel's descriptor, registered with the reactor on first use.
/// The reader (and the handshake) waits in the `AsyncFd`'s read slot, the
/// writer in a `readable()` future of its own: both are woken by a signal.
struct Chan {
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
    fn fd(&mut self, shared: &Shared) -> io::Result<Arc<AsyncFd<OwnedFd>>> {
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
    fn poll_signal(
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
    fn poll_op<R>(
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
    fn release(&self, shared: &Shared) {
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
struct ConnWait {
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
    fn new(conn: &SmcConn, nb: &crate::SmcStream) -> io::Result<ConnWait> {
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
    fn done(&mut self, dir: Dir) {
        let i = matches!(dir, Dir::Write) as usize;
        if std::mem::take(&mut self.registered[i]) {
            self.tasks.forget(i == 1);
        }
    }

    /// A read went on: a signal the reactor reported is spent (the read
    /// took the CDC; the next one signals again, and a read that finds
    /// nothing arms the signal for it first). Left standing, it would end
    /// the next wait at once, for a look that finds nothing.
    fn read_went_on(&mut self) {
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
    fn poll(
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

/// The SMC-R half of a stream (its TCP socket is in the connection).
struct Smc {
    conn: Arc<SmcConn>,
    /// The connection as a non-blocking stream of the library's: reads
    /// and writes go through its fast path, as an event loop's do.
    nb: crate::SmcStream,
    /// Waits for the connection's data and room ([`ConnWait`]).
    wait: Option<ConnWait>,
    /// The close's wait for its completion (the device's channel).
    chan: Chan,
    /// `poll_shutdown` closed the write side already.
    shut_wr: bool,
}

impl Smc {
    fn new(tcp: Arc<std::net::TcpStream>, conn: Arc<SmcConn>, chan: Chan) -> Smc {
        Smc {
            nb: crate::SmcStream::nonblocking_view(tcp, conn.clone()),
            conn,
            wait: None,
            chan,
            shut_wr: false,
        }
    }

    /// Waits as [`ConnWait::poll`] says (registered at the first wait).
    fn poll_wait(&mut self, dir: Dir, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.wait.is_none() {
            self.wait = Some(ConnWait::new(&self.conn, &self.nb)?);
        }
        let w = self.wait.as_mut().expect("made above");
        w.poll(dir, &self.nb, cx)
    }

    /// Runs `op` on the endpoint (pumped if it cannot go on at first)
    /// until it returns `Some`, waiting for the connection in between.
    fn poll_locked<R>(
        &mut self,
        dir: Dir,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&mut Endpoint<AnyProvider>) -> Option<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        loop {
            let r = {
                let shared = &self.conn.shared;
                let mut ep = shared.lock();
                let mut r = op(&mut ep);
                if r.is_none() {
                    shared.pump(&mut ep);
                    r = op(&mut ep);
                }
                if r.is_some() {
                    // (sends what the operation produced)
                    shared.pump(&mut ep);
                }
                r
            };
            self.conn.note();
            if let Some(r) = r {
                return Poll::Ready(self.went_on(dir, r));
            }
            ready!(self.poll_wait(dir, cx))?;
        }
    }

    fn poll_read(&mut self, cx: &mut Context<'_>, dst: &mut [u8]) -> Poll<io::Result<usize>> {
        loop {
            match self.nb.read_with(dst, true) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(self.went_on(Dir::Read, r)),
            }
            ready!(self.poll_wait(Dir::Read, cx))?;
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            match self.nb.write_with(buf, true) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(self.went_on(Dir::Write, r)),
            }
            ready!(self.poll_wait(Dir::Write, cx))?;
        }
    }

    /// An operation in direction `dir` ended with `r` (see
    /// [`ConnWait::done`]).
    fn went_on<R>(&mut self, dir: Dir, r: R) -> R {
        if let Some(w) = &mut self.wait {
            match dir {
                Dir::Read => w.read_went_on(),
                Dir::Write => w.done(dir),
            }
        }
        r
    }
}

impl Drop for Smc {
    fn drop(&mut self) {
        self.chan.release(&self.conn.shared);
        if let Some(w) = self.wait.take() {
            // (deregistered first: the signal's CDCs go to the endpoint's
            // channel again once nobody polls it)
            drop(w);
            self.nb.watch_signal(false);
        }
    }
}

/// How a stream moves data.
enum Io {
    Tcp(TcpStream),
    Smc(Smc),
}

/// An async connection: SMC-R when both ends could, TCP otherwise
/// (`tokio::net::TcpStream`-shaped).
pub struct SmcStream {
    io: Io,
    mode: Mode,
    /// Keeps a fallback connection listed in the registry.
    _listed: Option<crate::registry::Token>,
    /// TCP bytes that arrived behind the CLC messages (data after a Decline),
    /// read before the socket.
    pending: Vec<u8>,
    pending_at: usize,
}

impl fmt::Debug for SmcStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcStream")
            .field("local", &self.local_addr().ok())
            .field("peer", &self.peer_addr().ok())
            .field("mode", &self.mode)
            .finish()
    }
}

async fn write_all(tcp: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        tcp.writable().await?;
        match tcp.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one CLC message, never a byte beyond it (the peer's TCP data may
/// follow a Decline); 6 s at most, as Linux waits.
async fn read_clc(tcp: &TcpStream, expected: ClcType) -> io::Result<ClcMessage> {
    let read = async {
        let mut reader = ClcReader::new();
        loop {
            let mut buf = vec![0u8; reader.wanted().max(1)];
            tcp.readable().await?;
            let n = match tcp.try_read(&mut buf) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "SMC handshake failed: the peer closed the connection",
                    ))
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            match reader.feed(&buf[..n], expected).1 {
                None => {}
                Some(Ok(m)) => return Ok(m),
                Some(Err(e)) => return Err(handshake::protocol_error(e)),
            }
        }
    };
    ::tokio::time::timeout(CLC_WAIT_TIME, read)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "SMC handshake failed: no CLC message within 6 s",
            ))
        })
}

/// Client without a device: Proposal (or Decline), then the server's answer.
async fn client_no_device(tcp: &TcpStream, unavailable: bool) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let (first, done) = client_start(local, unavailable);
    write_all(tcp, &first).await?;
    if let Some(f) = done {
        return Ok(f);
    }
    let (answer, f) = client_reply(local, read_clc(tcp, ClcType::Accept).await?)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Server without a device: the client's Proposal, declined.
async fn server_no_device(tcp: &TcpStream, unavailable: bool) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let m = read_clc(tcp, ClcType::Proposal).await?;
    let (answer, f) = server_reply(local, unavailable, m)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Whether the handshake waits for the peer's next CLC message (rather than
/// for a step over the device).
fn awaits_clc(phase: Option<HandshakePhase>) -> bool {
    matches!(
        phase,
        Some(HandshakePhase::AwaitAccept)
            | Some(HandshakePhase::AwaitProposal)
            | Some(HandshakePhase::AwaitConfirm)
    )
}

/// Waits until the TCP socket is readable or the engine's next deadline
/// (`until`: the handshake's own is one) has come; while a step runs over
/// the device (`rdma`), also until the endpoint takes completions (`seen`:
/// its count when the caller last looked). A handshake waiting for the
/// peer's CLC message does not wake for the device's traffic.
async fn handshake_wait(
    tcp: &TcpStream,
    shared: &Shared,
    chan: &mut Chan,
    seen: u64,
    rdma: bool,
    until: Option<std::time::Instant>,
) -> io::Result<()> {
    let mut armed = false;
    // (no deadline: the handshake has none left, the events end the wait)
    let mut tick = until.map(|u| Box::pin(::tokio::time::sleep_until(u.into())));
    std::future::poll_fn(|cx| {
        if rdma {
            let mut ep = shared.lock();
            if !armed {
                // arm, then look once more: a completion before arming signals nobody
                ep.arm().map_err(io::Error::other)?;
                armed = true;
            }
            // (any progress: the handshake's step is not one connection's data)
            shared.wake_on_progress(&mut ep, None, cx.waker());
            if shared.pump(&mut ep) != seen {
                return Poll::Ready(Ok(()));
            }
        }
        if tcp.poll_read_ready(cx).is_ready() {
            return Poll::Ready(Ok(()));
        }
        if rdma {
            if let Poll::Ready(r) = chan.poll_signal(Dir::Read, shared, cx) {
                return Poll::Ready(r);
            }
        }
        match tick.as_mut() {
            Some(t) => t.as_mut().poll(cx).map(Ok),
            None => Poll::Pending,
        }
    })
    .await
}

/// The CLC handshake driven by the endpoint (a device serves this
/// connection). Returns the connection's status and the TCP bytes that
/// followed the CLC messages (the peer's first data after a Decline).
async fn with_endpoint(
    tcp: &TcpStream,
    conn: &SmcConn,
    chan: &mut Chan,
) -> io::Result<(ConnStatus, Vec<u8>)> {
    let (shared, id) = (&*conn.shared, conn.id);
    let mut leftover = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let (out, status, seen, rdma, until) = {
            let mut ep = shared.lock();
            let rdma = !awaits_clc(ep.handshake_phase(id));
            // (pumped only when the device has a part in the next step, or
            // a deadline is due)
            let seen = if rdma {
                shared.pump(&mut ep)
            } else {
                ep.completions()
            };
            let until = shared.next_wake(&mut ep);
            (ep.clc_output(id), ep.status(id), seen, rdma, until)
        };
        if !out.is_empty() {
            write_all(tcp, &out).await?;
        }
        if let Some(r) = handshake::ended(status) {
            return r.map(|s| (s, leftover));
        }
        match tcp.try_read(&mut buf) {
            Ok(n) => handshake::take_input(shared, id, &buf[..n], &mut leftover),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                handshake_wait(tcp, shared, chan, seen, rdma, until).await?
            }
            Err(e) => {
                shared.lock().tcp_closed(id);
                return Err(e);
            }
        }
    }
}

impl SmcStream {
    fn tcp_only(tcp: TcpStream, role: ctx::Role, mode: Mode, pending: Vec<u8>) -> SmcStream {
        SmcStream {
            _listed: crate::registry::stream_fd(tcp.as_fd(), role, mode),
            io: Io::Tcp(tcp),
            mode,
            pending,
            pending_at: 0,
        }
    }

    /// Connects like `tokio::net::TcpStream::connect`, trying every address in
    /// turn.
    pub async fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<SmcStream> {
        let mut last = None;
        for a in lookup_host(addr).await? {
            match Self::connect_one(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "no addresses to connect to")
        }))
    }

    async fn connect_one(addr: SocketAddr) -> io::Result<SmcStream> {
        let (fd, cookie) = socket_for(&addr)?;
        rustix::io::ioctl_fionbio(&fd, true)?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) | Err(rustix::io::Errno::INPROGRESS) => {}
            Err(e) => return Err(e.into()),
        }
        let tcp = TcpStream::from_std(std::net::TcpStream::from(fd))?;
        tcp.writable().await?;
        if let Some(e) = tcp.take_error()? {
            return Err(e);
        }
        let Some(cookie) = cookie else {
            return Ok(Self::tcp_only(
                tcp,
                ctx::Role::Client,
                no_rendezvous(),
                Vec::new(),
            ));
        };
        if !peer_offered_smc_by_cookie(cookie) {
            // The SYN-ACK lacked the option: no CLC at all (Linux: PEERNOSMC).
            let mode = no_smc(DeclineCode::PeerNoSmc);
            return Ok(Self::tcp_only(tcp, ctx::Role::Client, mode, Vec::new()));
        }
        // (the peer is the address connected to; the cookie read once, as
        // `SmcStream::connect` does)
        let local = tcp.local_addr()?.ip();
        let peer = addr.ip();
        match ctx::endpoint_for(local, peer, ctx::Role::Client) {
            ctx::Device::Endpoint(shared) => {
                let id = ctx::connect_in(&mut shared.lock(), local, (None, None));
                Self::finish_handshake(tcp, ctx::Role::Client, SmcConn::handshaking(shared, id))
                    .await
            }
            dev => {
                let unavailable = matches!(dev, ctx::Device::Unavailable);
                let f = client_no_device(&tcp, unavailable)
                    .await
                    .inspect_err(|_| crate::registry::handshake_error(ctx::Role::Client))?;
                Ok(Self::tcp_only(
                    tcp,
                    ctx::Role::Client,
                    Mode::Tcp(f),
                    Vec::new(),
                ))
            }
        }
    }

    /// Runs the handshake of `conn` (released if it does not end in SMC-R).
    async fn finish_handshake(
        tcp: TcpStream,
        role: ctx::Role,
        conn: SmcConn,
    ) -> io::Result<SmcStream> {
        let mut chan = Chan::default();
        let (status, leftover) = with_endpoint(&tcp, &conn, &mut chan)
            .await
            .inspect_err(|_| crate::registry::handshake_error(role))?;
        match status {
            ConnStatus::Smc => {
                // the endpoint watches the socket from now on, not the reactor
                let tcp = Arc::new(tcp.into_std()?);
                crate::registry::stream(
                    &tcp,
                    role,
                    Mode::SmcR,
                    Some((&conn.shared, conn.id, &conn.stats)),
                );
                let conn = Arc::new(conn.established(tcp.clone(), false));
                Ok(SmcStream {
                    _listed: None,
                    io: Io::Smc(Smc::new(tcp, conn, chan)),
                    mode: Mode::SmcR,
                    pending: Vec::new(),
                    pending_at: 0,
                })
            }
            ConnStatus::Fallback { reason, peer } => Ok(Self::tcp_only(
                tcp,
                role,
                Mode::Tcp(Fallback { reason, peer }),
                leftover,
            )),
            ConnStatus::Failed(r) => {
                crate::registry::handshake_error(role);
                Err(fail_error(r))
            }
            ConnStatus::Handshaking => {
                crate::registry::handshake_error(role);
                Err(io::Error::other("SMC handshake did not finish"))
            }
        }
    }

    /// An async stream from a blocking one (from this library's listener or
    /// connect). Must be called inside a tokio runtime. A TCP stream's socket
    /// is put in non-blocking mode, which other handles of it (`try_clone`)
    /// share.
    pub fn from_std(s: crate::SmcStream) -> io::Result<SmcStream> {
        let p = s.into_parts();
        let mut listed = None;
        let io = match p.smc {
            Some(conn) => {
                // dropping it must not block the runtime (see poll_shutdown)
                conn.linger.store(false, Ordering::Relaxed);
                Io::Smc(Smc::new(p.tcp, conn, Chan::default()))
            }
            None => {
                // (listed while this stream lives, the Arc is going)
                listed = crate::registry::rebind(&p.tcp);
                // other handles keep their own descriptor
                let tcp = Arc::try_unwrap(p.tcp).or_else(|t| t.try_clone())?;
                tcp.set_nonblocking(true)?;
                Io::Tcp(TcpStream::from_std(tcp)?)
            }
        };
        Ok(SmcStream {
            _listed: listed,
            io,
            mode: p.mode,
            pending: p.pending,
            pending_at: 0,
        })
    }

    /// The blocking stream (in blocking mode, without timeouts).
    pub fn into_std(self) -> io::Result<crate::SmcStream> {
        let mut pending = self.pending;
        pending.drain(..self.pending_at);
        let (tcp, smc) = match self.io {
            Io::Smc(s) => {
                let tcp = s
                    .conn
                    .tcp()
                    .cloned()
                    .ok_or_else(|| io::Error::other("SMC-R stream without its TCP socket"))?;
                (tcp, Some(s.conn.clone()))
            }
            Io::Tcp(t) => {
                let tcp = t.into_std()?;
                tcp.set_nonblocking(false)?;
                (Arc::new(tcp), None)
            }
        };
        Ok(crate::SmcStream::from_parts(Parts {
            tcp,
            mode: self.mode,
            smc,
            pending,
        }))
    }

    /// SMC-R, or TCP with the reason.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Writes in place, as [`crate::SmcStream::write_in_place`]: waits
    /// (without blocking the runtime) for room, lends up to `max` bytes of
    /// it — with SMC-R on the shared-memory device the peer's RMB itself —
    /// to `f`, and sends the bytes `f` says it filled; returns their count.
    /// Where the connection cannot lend its memory the space is a buffer of
    /// the library's, written whole afterwards.
    pub async fn write_in_place<F>(&mut self, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&mut WriteSpace<'_>) -> io::Result<usize>,
    {
        if max == 0 {
            return Ok(0);
        }
        if let Io::Smc(smc) = &mut self.io {
            let id = smc.conn.id;
            // (as the blocking stream's non-blocking mode: a task does not
            // block its thread)
            let lease = std::future::poll_fn(|cx| {
                smc.poll_locked(Dir::Write, cx, |ep| write_plan(ep, id, max, true))
            })
            .await?;
            let conn = &smc.conn;
            match lease {
                WriteGot::Lease(l) => {
                    let r = f(&mut WriteSpace::rmb(&l));
                    return match finish_write(conn, &l, r)? {
                        Finished::Sent(n) => Ok(n),
                        Finished::Again(b) => self.write_whole_async(&b).await,
                    };
                }
                WriteGot::Bounce(n) => return self.bounce_write_async(n, f).await,
            }
        }
        self.bounce_write_async(max, f).await
    }

    /// [`Self::write_in_place`] through a buffer of `max` bytes at most,
    /// written whole.
    async fn bounce_write_async<F>(&mut self, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&mut WriteSpace<'_>) -> io::Result<usize>,
    {
        let (buf, n) = fill_bounce(max, f)?;
        self.write_whole_async(&buf[..n]).await
    }

    /// Writes all of `buf` (bytes produced already).
    async fn write_whole_async(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let k = std::future::poll_fn(|cx| Pin::new(&mut *self).poll_write(cx, &buf[done..]))
                .await?;
            if k == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            done += k;
        }
        Ok(done)
    }

    /// Reads in place, as [`crate::SmcStream::read_in_place`]: waits
    /// (without blocking the runtime) for received bytes, lends up to `max`
    /// of them where they are — with SMC-R on the shared-memory device, in
    /// our RMB — to `f`, and consumes the bytes `f` says it took; returns
    /// their count, 0 at end of file without calling `f`.
    pub async fn read_in_place<F>(&mut self, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&ReadSpace<'_>) -> io::Result<usize>,
    {
        if max == 0 {
            return Ok(0);
        }
        let tcp = match &mut self.io {
            Io::Smc(smc) => {
                let id = smc.conn.id;
                let mut bounce = Vec::new();
                let got = std::future::poll_fn(|cx| {
                    smc.poll_locked(Dir::Read, cx, |ep| read_plan(ep, id, max, &mut bounce))
                })
                .await?;
                let conn = &smc.conn;
                return match got {
                    ReadGot::Eof => Ok(0),
                    ReadGot::Lease(l) => {
                        let r = f(&ReadSpace::rmb(&l));
                        finish_read(conn, l.len(), r)
                    }
                    ReadGot::Peeked(n) => {
                        let r = f(&ReadSpace::buf(&bounce[..n]));
                        finish_read(conn, n, r)
                    }
                };
            }
            Io::Tcp(t) => t,
        };
        if self.pending_at < self.pending.len() {
            let rest = &self.pending[self.pending_at..];
            let len = rest.len().min(max);
            let k = f(&ReadSpace::buf(&rest[..len]))?;
            if k > len {
                return Err(too_many(k, len));
            }
            self.pending_at += k;
            if self.pending_at == self.pending.len() {
                self.pending = Vec::new();
                self.pending_at = 0;
            }
            return Ok(k);
        }
        let mut buf = vec![0u8; max.min(BOUNCE_MAX)];
        let n = tcp.peek(&mut buf).await?;
        if n == 0 {
            return Ok(0);
        }
        let k = f(&ReadSpace::buf(&buf[..n]))?;
        if k > n {
            return Err(too_many(k, n));
        }
        // (the peeked bytes are queued: taking them does not wait)
        let mut done = 0;
        while done < k {
            let mut rb = ReadBuf::new(&mut buf[done..k]);
            std::future::poll_fn(|cx| Pin::new(&mut *tcp).poll_read(cx, &mut rb)).await?;
            match rb.filled().len() {
                0 => break,
                m => done += m,
            }
        }
        Ok(k)
    }

    fn std_tcp(&self) -> Option<&std::net::TcpStream> {
        match &self.io {
            Io::Smc(s) => s.conn.tcp().map(|t| &**t),
            Io::Tcp(_) => None,
        }
    }

    fn no_socket() -> io::Error {
        io::Error::other("SMC-R stream without its TCP socket")
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match &self.io {
            Io::Tcp(t) => t.peer_addr(),
            Io::Smc(_) => self.std_tcp().ok_or_else(Self::no_socket)?.peer_addr(),
        }
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.io {
            Io::Tcp(t) => t.local_addr(),
            Io::Smc(_) => self.std_tcp().ok_or_else(Self::no_socket)?.local_addr(),
        }
    }

    /// `TCP_NODELAY` (SMC-R sends at once anyway).
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match &self.io {
            Io::Tcp(t) => t.set_nodelay(on),
            Io::Smc(_) => self.std_tcp().ok_or_else(Self::no_socket)?.set_nodelay(on),
        }
    }

    /// Whether `TCP_NODELAY` is set.
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.io {
            Io::Tcp(t) => t.nodelay(),
            Io::Smc(_) => self.std_tcp().ok_or_else(Self::no_socket)?.nodelay(),
        }
    }
}

impl AsyncRead for SmcStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let tcp = match &mut this.io {
            Io::Smc(smc) => {
                let n = ready!(smc.poll_read(cx, buf.initialize_unfilled()))?;
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            Io::Tcp(t) => t,
        };
        if this.pending_at < this.pending.len() {
            let rest = &this.pending[this.pending_at..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pending_at += n;
            if this.pending_at == this.pending.len() {
                this.pending = Vec::new();
                this.pending_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SmcStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Smc(smc) => {
                if buf.is_empty() {
                    return Poll::Ready(Ok(0));
                }
                smc.poll_write(cx, buf)
            }
            Io::Tcp(t) => Pin::new(t).poll_write(cx, buf),
        }
    }

    /// Data is posted as it is written (SMC-R) or handed to the kernel (TCP).
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Smc(_) => Poll::Ready(Ok(())),
            Io::Tcp(t) => Pin::new(t).poll_flush(cx),
        }
    }

    /// Shuts down the write side, as `SmcStream::shutdown(Shutdown::Write)`:
    /// the peer reads end-of-file after everything written before.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            // Ready once the data written and the shutdown have left: a
            // process may exit right after, and no kernel finishes sending
            // for it (dropping an async stream does not wait, so as not to
            // block the runtime; the engine still sends in the background
            // while the process lives).
            Io::Smc(Smc {
                conn,
                chan,
                shut_wr,
                ..
            }) => {
                let id = conn.id;
                if !*shut_wr {
                    *shut_wr = true;
                    let mut ep = conn.shared.lock();
                    ep.close(id, CloseEvent::AppShutdownWrite);
                    conn.shared.pump(&mut ep);
                }
                let want = ctx::Want::CloseSent(id);
                chan.poll_op(Dir::Write, want, &conn.shared, cx, |ep| {
                    ep.close_sent(id).then_some(Ok(()))
                })
            }
            Io::Tcp(t) => Pin::new(t).poll_shutdown(cx),
        }
    }
}

/// A connection's handshake, run inside the listener.
type Handshake = Pin<Box<dyn Future<Output = io::Result<SmcStream>> + Send>>;

/// Wake-ups of a listener: the tasks waiting in `accept` (the handshakes
/// run inside the listener, polled by whichever task accepts), and which
/// handshakes were woken (each has a waker of its own, so that a wake-up
/// polls only the handshakes it concerns).
#[derive(Default)]
struct ListenWake {
    accept: Mutex<Vec<Waker>>,
    woken: Mutex<Vec<u64>>,
}

impl ListenWake {
    fn register(&self, w: &Waker) {
        let mut v = lock(&self.accept);
        if !v.iter().any(|x| x.will_wake(w)) {
            v.push(w.clone());
        }
    }
}

impl Wake for ListenWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let v = std::mem::take(&mut *lock(&self.accept));
        for w in v {
            w.wake();
        }
    }
}

/// The waker of one handshake of a listener.
struct HandshakeWaker {
    key: u64,
    listen: Arc<ListenWake>,
}

impl Wake for HandshakeWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.listen.woken).push(self.key);
        self.listen.wake_by_ref();
    }
}

/// A handshake in progress inside a listener.
struct Slot {
    fut: Handshake,
    addr: SocketAddr,
    waker: Waker,
}

#[derive(Default)]
struct Handshakes {
    next_key: u64,
    slots: HashMap<u64, Slot>,
    /// Finished connections taken over from a blocking listener.
    ready: Vec<(SmcStream, SocketAddr)>,
    /// Taking connections is paused after running out of a resource.
    paused: Option<Pin<Box<::tokio::time::Sleep>>>,
}

/// An async listener whose connections use SMC-R when the client can
/// (`tokio::net::TcpListener`-shaped).
pub struct SmcListener {
    tcp: TcpListener,
    opted: bool,
    hs: Mutex<Handshakes>,
    wake: Arc<ListenWake>,
    /// Listed in the registry (smcss) while this lives.
    _listed: Option<crate::registry::Token>,
}

impl fmt::Debug for SmcListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcListener")
            .field("tcp", &self.tcp)
            .field("opted", &self.opted)
            .finish()
    }
}

/// A freshly accepted connection: ready at once, or handshaking.
enum Arrival {
    Ready(SmcStream),
    Handshake(Handshake),
}

impl SmcListener {
    /// Binds like `tokio::net::TcpListener::bind` (the first address that works).
    pub async fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<SmcListener> {
        let mut last = None;
        for a in lookup_host(addr).await? {
            match crate::SmcListener::bind(a).and_then(Self::from_std) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no addresses to bind")))
    }

    /// An async listener from a blocking one. Must be called inside a tokio
    /// runtime. Connections the blocking listener had finished are kept;
    /// those still in their handshake are closed.
    pub fn from_std(l: crate::SmcListener) -> io::Result<SmcListener> {
        let (tcp, opted, ready) = l.into_parts()?;
        tcp.set_nonblocking(true)?;
        // (taken from the end: the oldest last)
        let ready = ready
            .into_iter()
            .rev()
            .map(|(s, a)| SmcStream::from_std(s).map(|s| (s, a)))
            .collect::<io::Result<Vec<_>>>()?;
        let wake = Arc::default();
        let listed = crate::registry::listener(tcp.as_fd());
        Ok(SmcListener {
            tcp: TcpListener::from_std(tcp)?,
            opted,
            hs: Mutex::new(Handshakes {
                ready,
                ..Handshakes::default()
            }),
            wake,
            _listed: listed,
        })
    }

    /// The blocking listener (in blocking mode). Connections still in their
    /// handshake, or finished but not accepted, are closed.
    pub fn into_std(self) -> io::Result<crate::SmcListener> {
        let tcp = self.tcp.into_std()?;
        tcp.set_nonblocking(false)?;
        crate::SmcListener::from_parts(tcp, self.opted)
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Accepts the next connection whose handshake has finished (SMC-R or a
    /// TCP fallback). Cancel-safe: a dropped `accept` loses no connection.
    pub async fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    /// Polls for the next connection whose handshake has finished. After the
    /// listener ran out of descriptors or memory taking a connection, the
    /// error is returned once (as `TcpListener::poll_accept` returns it) and
    /// no connection is taken for 100 ms (they wait in the kernel's backlog).
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(SmcStream, SocketAddr)>> {
        // register first: a wake-up between the polls below is not lost
        self.wake.register(cx.waker());
        let mut hs = lock(&self.hs);
        if let Some(r) = hs.ready.pop() {
            return Poll::Ready(Ok(r));
        }
        let woken = std::mem::take(&mut *lock(&self.wake.woken));
        for (i, key) in woken.iter().enumerate() {
            let Some(slot) = hs.slots.get_mut(key) else {
                continue;
            };
            let waker = slot.waker.clone();
            let Poll::Ready(r) = slot.fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
                continue;
            };
            let slot = hs.slots.remove(key).expect("polled just now");
            // (a connection that failed its handshake is closed; serve the others)
            if let Ok(s) = r {
                // the others woken are polled next time
                lock(&self.wake.woken).extend_from_slice(&woken[i + 1..]);
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok((s, slot.addr)));
            }
        }
        if let Some(p) = &mut hs.paused {
            if p.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            hs.paused = None;
        }
        let lw = Waker::from(self.wake.clone());
        let mut lcx = Context::from_waker(&lw);
        while hs.slots.len() < crate::listen::MAX_HANDSHAKES {
            let (tcp, addr) = match self.tcp.poll_accept(&mut lcx) {
                Poll::Pending => break,
                Poll::Ready(Ok(c)) => c,
                Poll::Ready(Err(e)) if out_of_resources(&e) => {
                    let mut p = Box::pin(::tokio::time::sleep(PAUSE));
                    let _ = p.as_mut().poll(cx);
                    hs.paused = Some(p);
                    return Poll::Ready(Err(e));
                }
                // that connection only (ECONNABORTED, ...)
                Poll::Ready(Err(_)) => continue,
            };
            match self.arrival(tcp) {
                Ok(Arrival::Ready(s)) => return Poll::Ready(Ok((s, addr))),
                Ok(Arrival::Handshake(mut fut)) => {
                    let key = hs.next_key;
                    hs.next_key += 1;
                    let waker = Waker::from(Arc::new(HandshakeWaker {
                        key,
                        listen: self.wake.clone(),
                    }));
                    match fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                        Poll::Pending => {
                            hs.slots.insert(key, Slot { fut, addr, waker });
                        }
                        Poll::Ready(Ok(s)) => return Poll::Ready(Ok((s, addr))),
                        Poll::Ready(Err(_)) => {}
                    }
                }
                Err(_) => {}
            }
        }
        Poll::Pending
    }

    fn arrival(&self, tcp: TcpStream) -> io::Result<Arrival> {
        if !self.opted {
            return Ok(Arrival::Ready(SmcStream::tcp_only(
                tcp,
                ctx::Role::Server,
                no_rendezvous(),
                Vec::new(),
            )));
        }
        if !peer_offered_smc(tcp.as_fd()) {
            let mode = no_smc(DeclineCode::PeerNoSmc);
            return Ok(Arrival::Ready(SmcStream::tcp_only(
                tcp,
                ctx::Role::Server,
                mode,
                Vec::new(),
            )));
        }
        let local = tcp.local_addr()?.ip();
        let peer = tcp.peer_addr()?.ip();
        Ok(Arrival::Handshake(
            match ctx::endpoint_for(local, peer, ctx::Role::Server) {
                ctx::Device::Endpoint(shared) => {
                    let id = ctx::accept_in(&mut shared.lock(), local, (None, None));
                    // the connection is released if the handshake is dropped unpolled
                    Box::pin(SmcStream::finish_handshake(
                        tcp,
                        ctx::Role::Server,
                        SmcConn::handshaking(shared, id),
                    ))
                }
                ctx::Device::IfOnHost(shared) => Box::pin(async move {
                    // nothing is sent before the client's first bytes are
                    // there; then the device serves it only if it is on this
                    // host (see `ctx::Device::IfOnHost`)
                    let mut b = [0u8; 1];
                    match ::tokio::time::timeout(CLC_WAIT_TIME, tcp.peek(&mut b)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(Ok(_)) => {
                            return Err(io::Error::new(
                                io::ErrorKind::ConnectionReset,
                                "SMC handshake failed: the peer closed the connection",
                            ))
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(_) => {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "SMC handshake failed: no CLC message within 6 s",
                            ))
                        }
                    }
                    if ctx::shm_reaches(peer) {
                        let id = ctx::accept_in(&mut shared.lock(), local, (None, None));
                        SmcStream::finish_handshake(
                            tcp,
                            ctx::Role::Server,
                            SmcConn::handshaking(shared, id),
                        )
                        .await
                    } else {
                        drop(shared);
                        let f = server_no_device(&tcp, false).await?;
                        Ok(SmcStream::tcp_only(
                            tcp,
                            ctx::Role::Server,
                            Mode::Tcp(f),
                            Vec::new(),
                        ))
                    }
                }),
                dev => {
                    let unavailable = matches!(dev, ctx::Device::Unavailable);
                    Box::pin(async move {
                        let f = server_no_device(&tcp, unavailable).await?;
                        Ok(SmcStream::tcp_only(
                            tcp,
                            ctx::Role::Server,
                            Mode::Tcp(f),
                            Vec::new(),
                        ))
                    })
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use crate::stream::tests::{conn_of, serial, signal_armed, smc_pair};
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    use tokio::io::AsyncReadExt;

    /// A task that waits to read is woken by the peer's SEND itself and
    /// reads through the connection's fast path: its read finishes while
    /// another thread holds the endpoint's lock, which a wake-up through a
    /// pump of the endpoint (the progress thread's, or the task's own)
    /// would wait for.
    #[test]
    fn a_waiting_task_is_woken_by_the_peer_and_reads_without_the_endpoint_lock() {
        let _one = serial();
        let (mut c, mut s) = smc_pair();
        // a message each way (the first reads and writes make the
        // connection's fast-path handles, which take the lock once)
        let mut b = [0u8; 64];
        c.write_all(&[1; 64]).unwrap();
        s.read_exact(&mut b).unwrap();
        s.write_all(&[1; 64]).unwrap();
        c.read_exact(&mut b).unwrap();
        let conn = conn_of(&s);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut ts = {
            let _in = rt.enter();
            super::SmcStream::from_std(s).unwrap()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (wtx, wrx) = std::sync::mpsc::channel::<u8>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            // the task reads message after message until the client closes;
            // the client writes each when told, and says when it wrote it
            scope.spawn(move || {
                rt.block_on(async {
                    loop {
                        let mut b = [0u8; 64];
                        let r = ts.read_exact(&mut b).await.map(|n| (n, b[0]));
                        let end = r.is_err();
                        let _ = tx.send(r.map_err(|e| e.kind()));
                        if end {
                            break;
                        }
                    }
                })
            });
            scope.spawn(move || {
                for v in wrx {
                    if c.write_all(&[v; 64]).is_err() {
                        break;
                    }
                    let _ = done_tx.send(());
                }
            });
            // (the task's read that found nothing armed the signal; the
            // previous message's SEND took it, so each wait is the task's
            // own)
            let waits = || {
                let t0 = Instant::now();
                while !signal_armed(&conn) {
                    assert!(t0.elapsed() < Duration::from_secs(30), "the task waits");
                    std::thread::sleep(Duration::from_millis(1));
                }
            };
            // a first message while the task waits: the client's SEND finds
            // the doorbell armed for a poller and fetches the signal's
            // eventfd (`QpInner::fetch_bell_fd`); this one may still be
            // announced through the endpoint
            waits();
            wtx.send(2).unwrap();
            let first = rx.recv_timeout(Duration::from_secs(30));
            assert_eq!(first, Ok(Ok((64, 2))));
            // then one while the endpoint is locked. The client shares this
            // process's endpoint: its write may need the lock too (a CDC
            // of ours held for it, a send slot to reap), and a round where
            // it did says nothing of the reader; it is let go and tried
            // again with the next message.
            let mut shown = false;
            for v in 3..13u8 {
                waits();
                let ep = conn.shared.lock();
                wtx.send(v).unwrap();
                let wrote = done_rx.recv_timeout(Duration::from_secs(2)).is_ok();
                // (a deadlock detector, not a latency bound)
                let got = rx.recv_timeout(Duration::from_secs(if wrote { 30 } else { 0 }));
                drop(ep);
                if !wrote {
                    // (the write goes on once the lock is free)
                    assert!(done_rx.recv_timeout(Duration::from_secs(30)).is_ok());
                    let late = got.or_else(|_| rx.recv_timeout(Duration::from_secs(30)));
                    assert_eq!(late, Ok(Ok((64, v))));
                    continue;
                }
                assert_eq!(got, Ok(Ok((64, v))), "read while the endpoint is locked");
                shown = true;
                break;
            }
            assert!(shown, "the client's writes all needed the endpoint's lock");
            drop(wtx);
        });
    }
}
