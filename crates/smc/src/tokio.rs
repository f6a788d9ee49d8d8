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
//! read or write runs the `smc-engine` endpoint in the task's own poll, as the
//! blocking stream does in its thread: try the operation, pump the endpoint,
//! try again. If it still cannot go on (nothing to read, send buffer or peer
//! window full), the task arms the device's completion queues, pumps and tries
//! once more — a completion that arrived before arming signals nobody — and
//! then waits for the endpoint's completion channel to become readable.
//!
//! Each stream direction (read and write) has its own duplicate of the
//! channel's descriptor, registered with tokio's reactor through
//! [`AsyncFd`]: every duplicate is a separate registration in the reactor's
//! epoll set, so one signal wakes every waiting task of every connection on
//! the device (an `AsyncFd` keeps one waker per direction, so it is never
//! shared between tasks). A woken task clears its readiness and retries; a
//! task woken for another connection's completion finds nothing, re-arms and
//! sleeps again. The channel is not drained here: epoll reports each signal
//! as a new edge.
//!
//! An edge is lost, though, if someone drains the channel before the reactor
//! collects it — a blocking stream's thread of the same process sleeping on
//! the channel does. So a waiting task is also registered with the endpoint,
//! while it is locked, and every pump that takes completions wakes the
//! registered tasks (as it wakes sleeping threads): the drainer pumps right
//! after draining, and the device's progress thread pumps every millisecond.
//!
//! Timers (close deadlines, keepalives) run in the device's progress thread,
//! which pumps the endpoint every millisecond; what they change ends in a
//! completion (a CDC, a flushed work request) that this pump or the next
//! takes, which wakes the waiting tasks: a task learns of an abort too.
//!
//! On a `current_thread` runtime the only thread never sleeps anywhere but in
//! the reactor: a client task and a server task of the same process may
//! exchange any amount of data on it (the writer waits for the reader's
//! cursor update in the reactor, the reader's poll sends that update).
//!
//! ## Handshakes
//!
//! The CLC handshake is async too: the task writes the endpoint's CLC output
//! to the TCP socket, and sleeps until the socket is readable, the completion
//! channel signals (first contact confirms the link over RDMA) or a 5 ms tick
//! passes (the engine's 6 s handshake deadlines). Without an SMC device the
//! Proposal/Decline exchange runs on the TCP socket alone.
//!
//! `SmcListener::accept` runs the handshakes of all connections that have
//! arrived concurrently, inside the listener, and returns the first one that
//! finishes: a client that stays silent delays no one else. Handshakes make
//! progress while some task polls `accept` (a server normally always does). A
//! connection whose handshake fails is closed and skipped, as by the
//! blocking listener. Up to 128 handshakes run at once; later connections
//! wait in the kernel's backlog. Device selection reads the PNET table and the
//! interface list when a connection arrives, in the accepting task (small
//! files, no network waits).

use crate::ctx::{self, Shared};
use crate::handshake::{self, client_reply, client_start, server_reply};
use crate::rendezvous::{rendezvous, socket_for};
use crate::stream::{
    conn_error, fail_error, no_rendezvous, no_smc, Fallback, Mode, Parts, SmcConn,
};
use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use ::tokio::net::{lookup_host, TcpListener, TcpStream, ToSocketAddrs};
use smc_engine::endpoint::{ConnStatus, Endpoint};
use smc_proto::clc_stream::ClcReader;
use smc_proto::close::CloseEvent;
use smc_rdma::shm::ShmProvider;
use smc_wire::clc::{ClcMessage, ClcType, DeclineCode, CLC_WAIT_TIME};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll, Wake, Waker};
use std::time::Duration;

/// How often a handshake looks at the engine's deadlines while it waits.
const HANDSHAKE_TICK: Duration = Duration::from_millis(5);

/// Handshakes a listener runs at once.
const MAX_HANDSHAKES: usize = 128;

/// Wake-ups one poll handles before it yields to the runtime.
const MAX_ROUNDS: usize = 3;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One direction's sleep on the device's completion channel: its own
/// duplicate of the channel's descriptor, registered with the reactor on
/// first use.
#[derive(Default)]
struct Waiter(Option<AsyncFd<OwnedFd>>);

impl Waiter {
    /// Ready once the channel signalled since the last time (the readiness is
    /// consumed); otherwise registers `cx` for the next signal.
    fn poll_signal(&mut self, shared: &Shared, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.0.is_none() {
            // `with_interest` is deprecated since tokio 1.53 because a generic
            // `AsRawFd` can name a descriptor it does not own; its unsafe
            // successor's contract (the descriptor stays open and the same
            // for the `AsyncFd`'s lifetime) holds by construction for an
            // `OwnedFd`, which this crate cannot state in `unsafe` code.
            #[allow(deprecated)]
            let fd = AsyncFd::with_interest(shared.notify_dup()?, Interest::READABLE)?;
            self.0 = Some(fd);
        }
        let Some(fd) = &self.0 else {
            return Poll::Pending;
        };
        let mut guard = ready!(fd.poll_read_ready(cx))?;
        guard.clear_ready();
        Poll::Ready(Ok(()))
    }

    /// Runs `op` on the endpoint until it returns `Some`, sleeping on the
    /// completion channel in between.
    fn poll_op<R>(
        &mut self,
        shared: &Shared,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&mut Endpoint<ShmProvider>) -> Option<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        for _ in 0..MAX_ROUNDS {
            if let Some(r) = shared.try_or_arm(cx.waker(), &mut op) {
                return Poll::Ready(r);
            }
            ready!(self.poll_signal(shared, cx))?;
        }
        // signals keep coming (other connections' traffic): let others run
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The SMC-R half of a stream.
struct Smc {
    conn: Arc<SmcConn>,
    rd: Waiter,
    wr: Waiter,
    /// `poll_shutdown` closed the write side already.
    shut_wr: bool,
}

/// An async connection: SMC-R when both ends could, TCP otherwise
/// (`tokio::net::TcpStream`-shaped).
pub struct SmcStream {
    tcp: TcpStream,
    mode: Mode,
    smc: Option<Smc>,
    /// TCP bytes that arrived behind the CLC messages (data after a Decline),
    /// read before the socket.
    pending: Vec<u8>,
    pending_at: usize,
}

impl fmt::Debug for SmcStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcStream")
            .field("tcp", &self.tcp)
            .field("mode", &self.mode)
            .finish()
    }
}

fn peer_offered_smc(tcp: &TcpStream) -> bool {
    let r = rendezvous().ok();
    let offered = r.is_some_and(|r| r.peer_offered_smc(tcp.as_fd()).unwrap_or(false));
    if let Some(r) = r {
        r.forget(tcp.as_fd());
    }
    offered
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
async fn client_no_device(tcp: &TcpStream) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let (first, done) = client_start(local);
    write_all(tcp, &first).await?;
    if let Some(f) = done {
        return Ok(f);
    }
    let (answer, f) = client_reply(local, read_clc(tcp, ClcType::Accept).await?)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Server without a device: the client's Proposal, declined.
async fn server_no_device(tcp: &TcpStream) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let (answer, f) = server_reply(local, read_clc(tcp, ClcType::Proposal).await?)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Waits until the TCP socket is readable, the endpoint takes completions
/// (`seen`: its count when the caller last looked) or [`HANDSHAKE_TICK`]
/// passes.
async fn handshake_wait(
    tcp: &TcpStream,
    shared: &Shared,
    w: &mut Waiter,
    seen: u64,
) -> io::Result<()> {
    let mut armed = false;
    let mut tick = std::pin::pin!(::tokio::time::sleep(HANDSHAKE_TICK));
    std::future::poll_fn(|cx| {
        {
            let mut ep = shared.lock();
            if !armed {
                // arm, then look once more: a completion before arming signals nobody
                ep.arm().map_err(io::Error::other)?;
                armed = true;
            }
            shared.wake_on_progress(&mut ep, cx.waker());
            if shared.pump(&mut ep) != seen {
                return Poll::Ready(Ok(()));
            }
        }
        if tcp.poll_read_ready(cx).is_ready() {
            return Poll::Ready(Ok(()));
        }
        if let Poll::Ready(r) = w.poll_signal(shared, cx) {
            return Poll::Ready(r);
        }
        tick.as_mut().poll(cx).map(Ok)
    })
    .await
}

/// The CLC handshake driven by the endpoint (a device serves this
/// connection). Returns the connection's status and the TCP bytes that
/// followed the CLC messages (the peer's first data after a Decline).
async fn with_endpoint(
    tcp: &TcpStream,
    conn: &SmcConn,
    w: &mut Waiter,
) -> io::Result<(ConnStatus, Vec<u8>)> {
    let (shared, id) = (&*conn.shared, conn.id);
    let mut leftover = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let (out, status, seen) = {
            let mut ep = shared.lock();
            let seen = shared.pump(&mut ep);
            (ep.clc_output(id), ep.status(id), seen)
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
                handshake_wait(tcp, shared, w, seen).await?
            }
            Err(e) => {
                shared.lock().tcp_closed(id);
                return Err(e);
            }
        }
    }
}

impl SmcStream {
    fn tcp_only(tcp: TcpStream, mode: Mode, pending: Vec<u8>) -> SmcStream {
        SmcStream {
            tcp,
            mode,
            smc: None,
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
        let (fd, opted) = socket_for(&addr)?;
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
        if !opted {
            return Ok(Self::tcp_only(tcp, no_rendezvous(), Vec::new()));
        }
        if !peer_offered_smc(&tcp) {
            // The SYN-ACK lacked the option: no CLC at all (Linux: PEERNOSMC).
            let mode = no_smc(DeclineCode::PeerNoSmc);
            return Ok(Self::tcp_only(tcp, mode, Vec::new()));
        }
        let local = tcp.local_addr()?.ip();
        match ctx::endpoint_for(local) {
            Some(shared) => {
                let id = shared.lock().connect(local, ctx::now());
                Self::finish_handshake(
                    tcp,
                    SmcConn {
                        shared,
                        id,
                        linger: AtomicBool::new(false),
                    },
                )
                .await
            }
            None => {
                let f = client_no_device(&tcp).await?;
                Ok(Self::tcp_only(tcp, Mode::Tcp(f), Vec::new()))
            }
        }
    }

    /// Runs the handshake of `conn` (released if it does not end in SMC-R).
    async fn finish_handshake(tcp: TcpStream, conn: SmcConn) -> io::Result<SmcStream> {
        let mut rd = Waiter::default();
        let (status, leftover) = with_endpoint(&tcp, &conn, &mut rd).await?;
        match status {
            ConnStatus::Smc => Ok(SmcStream {
                tcp,
                mode: Mode::SmcR,
                smc: Some(Smc {
                    conn: Arc::new(conn),
                    rd,
                    wr: Waiter::default(),
                    shut_wr: false,
                }),
                pending: Vec::new(),
                pending_at: 0,
            }),
            ConnStatus::Fallback { reason, peer } => Ok(Self::tcp_only(
                tcp,
                Mode::Tcp(Fallback { reason, peer }),
                leftover,
            )),
            ConnStatus::Failed(r) => Err(fail_error(r)),
            ConnStatus::Handshaking => Err(io::Error::other("SMC handshake did not finish")),
        }
    }

    /// An async stream from a blocking one (from this library's listener or
    /// connect). Must be called inside a tokio runtime. The TCP socket is put
    /// in non-blocking mode, which other handles of it (`try_clone`) share.
    pub fn from_std(s: crate::SmcStream) -> io::Result<SmcStream> {
        let p = s.into_parts();
        p.tcp.set_nonblocking(true)?;
        Ok(SmcStream {
            tcp: TcpStream::from_std(p.tcp)?,
            mode: p.mode,
            smc: p.smc.map(|conn| {
                // dropping it must not block the runtime (see poll_shutdown)
                conn.linger.store(false, Ordering::Relaxed);
                Smc {
                    conn,
                    rd: Waiter::default(),
                    wr: Waiter::default(),
                    shut_wr: false,
                }
            }),
            pending: p.pending,
            pending_at: 0,
        })
    }

    /// The blocking stream (in blocking mode, without timeouts).
    pub fn into_std(self) -> io::Result<crate::SmcStream> {
        let tcp = self.tcp.into_std()?;
        tcp.set_nonblocking(false)?;
        let mut pending = self.pending;
        pending.drain(..self.pending_at);
        Ok(crate::SmcStream::from_parts(Parts {
            tcp,
            mode: self.mode,
            smc: self.smc.map(|s| s.conn),
            pending,
        }))
    }

    /// SMC-R, or TCP with the reason.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// `TCP_NODELAY` (SMC-R sends at once anyway).
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)
    }

    /// Whether `TCP_NODELAY` is set.
    pub fn nodelay(&self) -> io::Result<bool> {
        self.tcp.nodelay()
    }
}

impl AsyncRead for SmcStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(Smc { conn, rd, .. }) = &mut this.smc {
            let dst = buf.initialize_unfilled();
            let n = ready!(rd.poll_op(&conn.shared, cx, |ep| {
                match ep.read_into(conn.id, dst) {
                    Ok(0) if dst.is_empty() || ep.peer_done(conn.id) => Some(Ok(0)),
                    Ok(0) => None,
                    Ok(n) => Some(Ok(n)),
                    Err(e) => Some(Err(conn_error(e))),
                }
            }))?;
            buf.advance(n);
            return Poll::Ready(Ok(()));
        }
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
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for SmcStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match &mut this.smc {
            Some(Smc { conn, wr, .. }) => {
                if buf.is_empty() {
                    return Poll::Ready(Ok(0));
                }
                wr.poll_op(&conn.shared, cx, |ep| match ep.write(conn.id, buf) {
                    Ok(0) => None,
                    Ok(n) => Some(Ok(n)),
                    Err(e) => Some(Err(conn_error(e))),
                })
            }
            None => Pin::new(&mut this.tcp).poll_write(cx, buf),
        }
    }

    /// Data is posted as it is written (SMC-R) or handed to the kernel (TCP).
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match &this.smc {
            Some(_) => Poll::Ready(Ok(())),
            None => Pin::new(&mut this.tcp).poll_flush(cx),
        }
    }

    /// Shuts down the write side, as `SmcStream::shutdown(Shutdown::Write)`:
    /// the peer reads end-of-file after everything written before.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match &mut this.smc {
            // Ready once the data written and the shutdown have left: a
            // process may exit right after, and no kernel finishes sending
            // for it (dropping an async stream does not wait, so as not to
            // block the runtime; the engine still sends in the background
            // while the process lives).
            Some(Smc {
                conn, wr, shut_wr, ..
            }) => {
                let id = conn.id;
                if !*shut_wr {
                    *shut_wr = true;
                    let mut ep = conn.shared.lock();
                    ep.close(id, CloseEvent::AppShutdownWrite);
                    conn.shared.pump(&mut ep);
                }
                wr.poll_op(&conn.shared, cx, |ep| ep.close_sent(id).then_some(Ok(())))
            }
            None => Pin::new(&mut this.tcp).poll_shutdown(cx),
        }
    }
}

/// A connection's handshake, run inside the listener.
type Handshake = Pin<Box<dyn Future<Output = io::Result<SmcStream>> + Send>>;

/// Wakes every task waiting in `accept` (the handshakes run inside the
/// listener, polled by whichever task accepts; this waker stands for all).
#[derive(Default)]
struct Wakers(Mutex<Vec<Waker>>);

impl Wakers {
    fn register(&self, w: &Waker) {
        let mut v = lock(&self.0);
        if !v.iter().any(|x| x.will_wake(w)) {
            v.push(w.clone());
        }
    }
}

impl Wake for Wakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let v = std::mem::take(&mut *lock(&self.0));
        for w in v {
            w.wake();
        }
    }
}

/// An async listener whose connections use SMC-R when the client can
/// (`tokio::net::TcpListener`-shaped).
pub struct SmcListener {
    tcp: TcpListener,
    opted: bool,
    handshakes: Mutex<Vec<(Handshake, SocketAddr)>>,
    wakers: Arc<Wakers>,
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
    /// runtime.
    pub fn from_std(l: crate::SmcListener) -> io::Result<SmcListener> {
        let (tcp, opted) = l.into_parts();
        tcp.set_nonblocking(true)?;
        Ok(SmcListener {
            tcp: TcpListener::from_std(tcp)?,
            opted,
            handshakes: Mutex::new(Vec::new()),
            wakers: Arc::default(),
        })
    }

    /// The blocking listener (in blocking mode). Connections still in their
    /// handshake are closed.
    pub fn into_std(self) -> io::Result<crate::SmcListener> {
        let tcp = self.tcp.into_std()?;
        tcp.set_nonblocking(false)?;
        Ok(crate::SmcListener::from_parts(tcp, self.opted))
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

    /// Polls for the next connection whose handshake has finished.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(SmcStream, SocketAddr)>> {
        // register first: a wake-up between the polls below is not lost
        self.wakers.register(cx.waker());
        let waker = Waker::from(self.wakers.clone());
        let mut icx = Context::from_waker(&waker);
        let mut hs = lock(&self.handshakes);
        let mut i = 0;
        while i < hs.len() {
            match hs[i].0.as_mut().poll(&mut icx) {
                Poll::Pending => i += 1,
                Poll::Ready(r) => {
                    let (_, addr) = hs.remove(i);
                    match r {
                        Ok(s) => return Poll::Ready(Ok((s, addr))),
                        // this connection failed its handshake; serve the others
                        Err(_) => continue,
                    }
                }
            }
        }
        while hs.len() < MAX_HANDSHAKES {
            let (tcp, addr) = match self.tcp.poll_accept(&mut icx) {
                Poll::Pending => break,
                Poll::Ready(r) => r?,
            };
            match self.arrival(tcp) {
                Ok(Arrival::Ready(s)) => return Poll::Ready(Ok((s, addr))),
                Ok(Arrival::Handshake(mut h)) => match h.as_mut().poll(&mut icx) {
                    Poll::Pending => hs.push((h, addr)),
                    Poll::Ready(Ok(s)) => return Poll::Ready(Ok((s, addr))),
                    Poll::Ready(Err(_)) => {}
                },
                Err(_) => {}
            }
        }
        Poll::Pending
    }

    fn arrival(&self, tcp: TcpStream) -> io::Result<Arrival> {
        if !self.opted {
            return Ok(Arrival::Ready(SmcStream::tcp_only(
                tcp,
                no_rendezvous(),
                Vec::new(),
            )));
        }
        if !peer_offered_smc(&tcp) {
            let mode = no_smc(DeclineCode::PeerNoSmc);
            return Ok(Arrival::Ready(SmcStream::tcp_only(tcp, mode, Vec::new())));
        }
        let local = tcp.local_addr()?.ip();
        Ok(Arrival::Handshake(match ctx::endpoint_for(local) {
            Some(shared) => {
                let id = shared.lock().accept(ctx::now());
                // the connection is released if the handshake is dropped unpolled
                let conn = SmcConn {
                    shared,
                    id,
                    linger: AtomicBool::new(false),
                };
                Box::pin(SmcStream::finish_handshake(tcp, conn))
            }
            None => Box::pin(async move {
                let f = server_no_device(&tcp).await?;
                Ok(SmcStream::tcp_only(tcp, Mode::Tcp(f), Vec::new()))
            }),
        }))
    }
}
