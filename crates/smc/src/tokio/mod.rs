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
//! [`AsyncFd`](::tokio::io::unix::AsyncFd) at the stream's first wait,
//! which the peer's SEND writes for every CDC it brings while the stream
//! waits. So a message wakes the task that waits for its connection and no
//! other, and it is the peer that wakes it: no thread of ours takes the CDC
//! first to pass it on.
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
//!
//! Files: this one the stream, `wait.rs` how its tasks wait, `clc.rs` the
//! CLC steps over the tokio socket, `listen.rs` the listener.

mod clc;
mod listen;
mod wait;

pub use listen::SmcListener;

use clc::{client_no_device, with_endpoint};
use wait::{Chan, ConnWait, Dir};

use crate::ctx;
use crate::provider::AnyProvider;
use crate::rendezvous::{peer_offered_smc_by_cookie, socket_for};
use crate::stream::ahead::Ahead;
use crate::stream::{
    fail_error, fill_bounce, finish_read, finish_write, no_rendezvous, no_smc, read_plan, too_many,
    write_plan, Fallback, Finished, Mode, Parts, ReadGot, ReadSpace, SmcConn, WriteGot, WriteSpace,
    BOUNCE_MAX,
};
use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use ::tokio::net::{lookup_host, TcpStream, ToSocketAddrs};
use smc_engine::endpoint::{ConnStatus, Endpoint};
use smc_proto::clc_stream::OwedAnswer;
use smc_proto::close::CloseEvent;
use smc_wire::clc::DeclineCode;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
    /// The server's answer still to take off the stream, before any of its
    /// bytes go to `pending` (`crate::stream::ahead`; boxed: it is rare).
    answer: Option<Box<Ahead>>,
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

impl SmcStream {
    fn tcp_only(tcp: TcpStream, role: ctx::Role, mode: Mode, pending: Vec<u8>) -> SmcStream {
        SmcStream::tcp_owing(tcp, role, mode, pending, None)
    }

    /// [`SmcStream::tcp_only`] for a client whose server's answer is still
    /// due on the stream (`owed`).
    fn tcp_owing(
        tcp: TcpStream,
        role: ctx::Role,
        mode: Mode,
        pending: Vec<u8>,
        owed: Option<OwedAnswer>,
    ) -> SmcStream {
        let mut s = SmcStream {
            _listed: crate::registry::stream_fd(tcp.as_fd(), role, mode),
            io: Io::Tcp(tcp),
            mode,
            pending: Vec::new(),
            pending_at: 0,
            answer: None,
        };
        s.set_ahead(Ahead::new(pending, owed));
        s
    }

    /// What was read ahead of the socket: its bytes first, or the answer
    /// still owed (which they are part of).
    fn set_ahead(&mut self, a: Ahead) {
        if a.owes() {
            self.answer = Some(Box::new(a));
        } else {
            self.pending = a.into_parts().0;
            self.pending_at = 0;
        }
    }

    /// Takes the server's owed answer off the stream, if there is one:
    /// ready once it is gone, with what followed it in `pending`.
    fn poll_answer_off(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Io::Tcp(tcp) = &mut self.io else {
            return Poll::Ready(Ok(()));
        };
        while let Some(a) = self.answer.as_mut() {
            let mut buf = [0u8; 1024];
            let mut rb = ReadBuf::new(&mut buf);
            ready!(Pin::new(&mut *tcp).poll_read(cx, &mut rb))?;
            match rb.filled() {
                [] => a.ended(),
                got => a.came(got),
            }
            if !a.owes() {
                let a = self.answer.take().expect("looked at above");
                self.set_ahead(*a);
                break;
            }
        }
        Poll::Ready(Ok(()))
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
                    answer: None,
                })
            }
            ConnStatus::Fallback { reason, peer } => Ok(Self::tcp_owing(
                tcp,
                role,
                Mode::Tcp(Fallback { reason, peer }),
                leftover,
                conn.shared.lock().owed_answer(conn.id),
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
                conn.wait_close.store(false, Ordering::Relaxed);
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
        let mut s = SmcStream {
            _listed: listed,
            io,
            mode: p.mode,
            pending: Vec::new(),
            pending_at: 0,
            answer: None,
        };
        s.set_ahead(Ahead::new(p.pending, p.owed));
        Ok(s)
    }

    /// The blocking stream (in blocking mode, without timeouts).
    pub fn into_std(self) -> io::Result<crate::SmcStream> {
        let mut pending = self.pending;
        pending.drain(..self.pending_at);
        let owed = self.answer.and_then(|a| a.into_parts().1);
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
            owed,
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
        std::future::poll_fn(|cx| self.poll_answer_off(cx)).await?;
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
        ready!(this.poll_answer_off(cx))?;
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
