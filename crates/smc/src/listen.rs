//! `SmcListener`: CLC handshakes run apart from `accept()`, all at once.
//!
//! Linux's listening SMC socket takes every TCP connection off its internal
//! TCP listener in a work item (af_smc.c `smc_tcp_listen_work`) and runs each
//! connection's handshake in a work item of its own (`smc_listen_work`);
//! finished connections, SMC-R or fallback, wait in the accept queue
//! (`smc_accept_enqueue`) for `accept()`. A client that sends nothing after
//! its SYN delays no one else.
//!
//! Here one driver thread per listener does the same: it accepts TCP
//! connections, steps every pending handshake without blocking
//! ([`Accepting::step`]) as its socket becomes readable (or, while a step
//! runs over the device, as the endpoint makes progress), and queues the
//! finished connections. `accept()` takes from that queue. The queue is bounded like a
//! backlog: while it is full the driver leaves new TCP connections in the
//! kernel's backlog. At most [`MAX_HANDSHAKES`] handshakes run at once, each
//! with its own CLC deadlines (6 s per expected message). No thread per
//! connection.

use crate::ctx::Role;
use crate::handshake::{Accepting, Progress};
use crate::readiness::{Level, Readiness};
use crate::rendezvous::{peer_offered_smc, socket_for};
use crate::stream::{no_rendezvous, no_smc, Mode, SmcStream};
use rustix::event::{PollFd, PollFlags, Timespec};
use smc_wire::clc::DeclineCode;
use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The kernel backlog of the TCP listener, and the bound of the queue of
/// finished connections waiting for `accept()`.
const BACKLOG: usize = 128;

/// Handshakes a listener runs at once; further connections wait in the
/// kernel's backlog. Each costs its TCP socket and a few hundred bytes.
pub(crate) const MAX_HANDSHAKES: usize = 4096;

/// TCP connections taken from the kernel in one round, before the pending
/// handshakes get their turn, while they come faster than one a round;
/// else one a round (see `drive`).
const ACCEPT_BATCH: usize = 64;

/// How often pending handshakes are looked at without an event (the
/// engine's deadlines), and queued connections checked for a reset.
const TICK: Duration = Duration::from_millis(100);

/// While a handshake step runs over the device (link confirmation, rkey
/// exchange, a first contact it waits for) and no progress descriptor could
/// be had for its endpoint ([`Watch`]), how soon it is looked at again.
const RDMA_TICK: Duration = Duration::from_millis(1);

/// How long the listener stops taking connections after running out of a
/// resource (descriptors, memory): they wait in the kernel's backlog rather
/// than having the driver spin on the error.
const PAUSE: Duration = Duration::from_millis(100);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Finished connections waiting for `accept()`.
#[derive(Default)]
struct Queue {
    ready: VecDeque<(SmcStream, SocketAddr)>,
    /// A resource error of the TCP listener, for the next `accept()` (as
    /// `TcpListener::accept` would return it).
    error: Option<io::Error>,
    /// The listener is dropped: the driver ends.
    stop: bool,
    /// The driver stopped taking connections because `ready` was full.
    full: bool,
    /// Shut down ([`SmcListener::shutdown`]): listens no more.
    shut: bool,
}

struct Inner {
    tcp: TcpListener,
    /// The local address of every connection it accepts, if it is bound to
    /// one (not a wildcard): one system call less per connection.
    local: Option<std::net::IpAddr>,
    opted: bool,
    nonblocking: AtomicBool,
    q: Mutex<Queue>,
    cv: Condvar,
    /// Wakes the driver from its poll (an eventfd).
    wake: OwnedFd,
    /// Readable while `accept()` would not block, once asked for
    /// ([`SmcListener::readiness_fd`]): the TCP listener's own readiness
    /// says nothing, as the driver takes its connections.
    ready: std::sync::OnceLock<Readiness>,
    /// Listed in the registry (smcss) while this lives.
    _listed: Option<crate::registry::Token>,
    /// The buffer sizes asked for its connections
    /// ([`SmcListener::set_buffer_sizes`]).
    ask: crate::ctx::Asked,
}

impl Inner {
    fn wake_driver(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn push(&self, s: SmcStream, addr: SocketAddr) {
        // until someone accepts it, dropping it need not wait for its close
        s.set_wait_close(false);
        let mut q = lock(&self.q);
        q.ready.push_back((s, addr));
        self.show(&q);
        drop(q);
        self.cv.notify_one();
    }

    /// The readiness descriptor, if any, shows whether `accept()` would
    /// block (with the queue locked). A listening TCP socket never polls
    /// writable.
    fn show(&self, q: &Queue) {
        if let Some(r) = self.ready.get() {
            r.set(if q.shut {
                // (as a TCP socket in TCP_CLOSE with its receive side shut
                // down polls, tcp.c tcp_poll)
                Level {
                    readable: true,
                    writable: true,
                    eof: true,
                    hup: true,
                    err: false,
                }
            } else {
                Level {
                    readable: !q.ready.is_empty() || q.error.is_some(),
                    ..Level::default()
                }
            });
        }
    }
}

/// A listener taken apart: the listening socket, whether it is opted in,
/// and the connections that finished their handshake.
#[cfg(feature = "tokio")]
pub(crate) type Parts = (TcpListener, bool, Vec<(SmcStream, SocketAddr)>);

/// A listener whose connections use SMC-R when the client can.
pub struct SmcListener {
    inner: Arc<Inner>,
    /// The handshake driver (opted-in listeners only).
    driver: Option<std::thread::JoinHandle<()>>,
    /// The process generation that made it (see `crate::fork`): in a forked
    /// child the driver is the parent's, and so are the connections it
    /// accepts.
    born: usize,
}

impl fmt::Debug for SmcListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcListener")
            .field("tcp", &self.inner.tcp)
            .field("opted", &self.inner.opted)
            .finish()
    }
}

impl SmcListener {
    /// Binds like `TcpListener::bind` (the first address that works).
    pub fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<SmcListener> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match Self::bind_one(&a) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no addresses to bind")))
    }

    fn bind_one(addr: &SocketAddr) -> io::Result<SmcListener> {
        let (fd, cookie) = socket_for(addr)?;
        let opted = cookie.is_some();
        rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
        rustix::net::bind(&fd, addr)?;
        rustix::net::listen(&fd, BACKLOG as i32)?;
        if opted {
            // (so that clients in other network namespaces of this host find
            // our shared-memory devices from the first connection on)
            crate::ctx::open_devices_for_listener(addr.ip());
        }
        Self::start(TcpListener::from(fd), opted, Vec::new())
    }

    /// A listener over `tcp`, a TCP socket already listening: runs the
    /// handshakes of its connections in a driver thread if `opted` (the
    /// socket was opted in to the SMC option, [`crate::opt_in`], before its
    /// `listen()`); TCP connections otherwise. The socket is put in
    /// non-blocking mode (the driver polls it). For programs that create
    /// their listening sockets themselves (the preload library).
    pub fn from_listening(tcp: TcpListener, opted: bool) -> io::Result<SmcListener> {
        if opted {
            if let Ok(a) = tcp.local_addr() {
                crate::ctx::open_devices_for_listener(a.ip());
            }
        }
        Self::start(tcp, opted, Vec::new())
    }

    /// A listener on `tcp`, with a driver if it is opted in; `ready` are
    /// connections already finished.
    fn start(
        tcp: TcpListener,
        opted: bool,
        ready: Vec<(SmcStream, SocketAddr)>,
    ) -> io::Result<SmcListener> {
        tcp.set_nonblocking(opted)?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?;
        let listed = crate::registry::listener(tcp.as_fd());
        let local = tcp
            .local_addr()
            .ok()
            .map(|a| a.ip())
            .filter(|ip| !ip.is_unspecified());
        let inner = Arc::new(Inner {
            tcp,
            local,
            opted,
            nonblocking: AtomicBool::new(false),
            q: Mutex::new(Queue {
                ready: ready.into(),
                ..Queue::default()
            }),
            cv: Condvar::new(),
            wake,
            ready: std::sync::OnceLock::new(),
            _listed: listed,
            ask: crate::ctx::Asked::new(),
        });
        let driver = if opted {
            let i = inner.clone();
            let port = i.tcp.local_addr().map_or(0, |a| a.port());
            Some(
                std::thread::Builder::new()
                    .name(format!("smc-listen-{port}"))
                    .spawn(move || drive(&i))?,
            )
        } else {
            None
        };
        Ok(SmcListener {
            inner,
            driver,
            born: crate::fork::generation(),
        })
    }

    /// Stops the driver; pending handshakes are closed. Returns the TCP
    /// listener (in blocking mode) and the finished connections not yet
    /// accepted.
    #[cfg(feature = "tokio")]
    fn stop(mut self) -> io::Result<Parts> {
        if crate::fork::parents(self.born) {
            return Err(crate::fork::parents_error());
        }
        self.stop_driver();
        let inner = self.inner.clone();
        drop(self);
        let inner = Arc::into_inner(inner).expect("the driver has ended");
        let q = inner.q.into_inner().unwrap_or_else(|e| e.into_inner());
        let _ = inner.tcp.set_nonblocking(false);
        Ok((inner.tcp, inner.opted, q.ready.into()))
    }

    fn stop_driver(&mut self) {
        if crate::fork::parents(self.born) {
            // (the driver is a thread of the parent's: none to stop here, and
            // its state stays as it was)
            std::mem::forget(self.driver.take());
            std::mem::forget(self.inner.clone());
            return;
        }
        if let Some(d) = self.driver.take() {
            lock(&self.inner.q).stop = true;
            self.inner.wake_driver();
            let _ = d.join();
        }
    }

    /// The listening socket, whether it is opted in to the SMC option, and
    /// the connections that finished their handshake (those still in it are
    /// closed).
    #[cfg(feature = "tokio")]
    pub(crate) fn into_parts(self) -> io::Result<Parts> {
        self.stop()
    }

    /// A listener from its parts.
    #[cfg(feature = "tokio")]
    pub(crate) fn from_parts(tcp: TcpListener, opted: bool) -> io::Result<SmcListener> {
        Self::start(tcp, opted, Vec::new())
    }

    /// Accepts the next connection whose handshake has finished (SMC-R or a
    /// TCP fallback). Handshakes run in the listener's driver thread whether
    /// or not someone is in `accept()`; a connection whose handshake fails (a
    /// peer sending garbage, vanishing or staying silent for 6 s) is closed
    /// there, as Linux's listen worker does. If the listener ran out of
    /// descriptors or memory taking a connection, the error is returned once
    /// (as `TcpListener::accept` returns it) and the connection waits in the
    /// kernel's backlog.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        if self.driver.is_some() && crate::fork::parents(self.born) {
            return Err(crate::fork::parents_error());
        }
        if self.driver.is_none() {
            let (tcp, addr) = self.inner.tcp.accept()?;
            return Ok((
                SmcStream::tcp_only(tcp, Role::Server, no_rendezvous(), Vec::new()),
                addr,
            ));
        }
        let mut q = lock(&self.inner.q);
        // (the listening socket's SO_RCVTIMEO bounds a blocking accept, as
        // the kernel's inet_csk_accept waits sock_rcvtimeo: EAGAIN then;
        // looked up once the queue is empty)
        let mut until: Option<Option<Instant>> = None;
        loop {
            if q.shut {
                // (af_inet.c inet_accept: not listening)
                return Err(io::ErrorKind::InvalidInput.into());
            }
            if let Some((s, addr)) = q.ready.pop_front() {
                let resume = std::mem::take(&mut q.full);
                self.inner.show(&q);
                drop(q);
                if resume {
                    self.inner.wake_driver();
                }
                s.set_wait_close(true);
                return Ok((s, addr));
            }
            if let Some(e) = q.error.take() {
                self.inner.show(&q);
                return Err(e);
            }
            if self.inner.nonblocking.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let until = *until.get_or_insert_with(|| {
                rustix::net::sockopt::socket_timeout(
                    &self.inner.tcp,
                    rustix::net::sockopt::Timeout::Recv,
                )
                .ok()
                .flatten()
                .filter(|t| !t.is_zero())
                .map(|t| Instant::now() + t)
            });
            q = match until {
                None => self.inner.cv.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let left = t.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    self.inner
                        .cv
                        .wait_timeout(q, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Shuts the listening socket down as `shutdown(2)` does a listening TCP
    /// socket: with its read side (`Read`, `Both`) it listens no more — the
    /// connections nobody accepted yet are reset, as the kernel resets those
    /// in its accept queue (inet_connection_sock.c `inet_csk_listen_stop`),
    /// `accept()` fails with `EINVAL` (af_inet.c `inet_accept`), and a
    /// thread waiting in `accept()` or on the readiness descriptor returns
    /// (servers stop their accepting threads so). `Write` alone changes
    /// nothing here, as on TCP.
    pub fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        use std::net::Shutdown;
        let h = match how {
            Shutdown::Read => rustix::net::Shutdown::Read,
            Shutdown::Write => rustix::net::Shutdown::Write,
            Shutdown::Both => rustix::net::Shutdown::Both,
        };
        rustix::net::shutdown(&self.inner.tcp, h)?;
        if how == Shutdown::Write || self.driver.is_none() || crate::fork::parents(self.born) {
            return Ok(());
        }
        let waiting = {
            let mut q = lock(&self.inner.q);
            q.shut = true;
            q.stop = true;
            self.inner.show(&q);
            std::mem::take(&mut q.ready)
        };
        self.inner.cv.notify_all();
        self.inner.wake_driver();
        for (s, _) in waiting {
            // (a reset, not an orderly close: their clients were never served)
            let _ = s.set_linger(Some(Duration::ZERO));
        }
        Ok(())
    }

    /// Puts a connection [`Self::accept`] returned back at the head of the
    /// queue, for the next `accept()`: its caller could not take it (the
    /// preload found no descriptor for it, `EMFILE`), and a TCP listener
    /// leaves a connection it cannot hand out in its queue.
    pub fn unaccept(&self, s: SmcStream, addr: SocketAddr) {
        s.set_wait_close(false);
        let mut q = lock(&self.inner.q);
        q.ready.push_front((s, addr));
        self.inner.show(&q);
        drop(q);
        self.inner.cv.notify_one();
    }

    /// An iterator over incoming connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SmcStream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.tcp.local_addr()
    }

    /// The descriptor that polls readable exactly when `accept()` would
    /// not block, for `poll()`, `select()` and `epoll`, also what `AsFd`
    /// returns. With a handshake driver (the listener is opted in to the
    /// SMC option) it is a readiness descriptor set by the library
    /// whenever a finished connection is queued or taken (created at the
    /// first call, which can fail: no descriptor left); without one, the
    /// TCP listener itself.
    pub fn readiness_fd(&self) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        if self.driver.is_none() {
            return Ok(self.inner.tcp.as_fd());
        }
        if self.inner.ready.get().is_none() {
            let q = lock(&self.inner.q);
            if self.inner.ready.get().is_none() {
                let _ = self.inner.ready.set(Readiness::new(Level::default())?);
                self.inner.show(&q);
            }
        }
        Ok(self.inner.ready.get().expect("set above").as_fd())
    }

    /// Asks for an RMB of at least `rmb` and a send buffer of at least
    /// `sndbuf` bytes for the SMC-R connections whose handshakes start from
    /// now on (`None`: the process's sizes, see [`crate::set_buffer_sizes`]),
    /// as a listening AF_SMC socket's `SO_RCVBUF`/`SO_SNDBUF` size its
    /// accepted sockets' buffers in Linux.
    pub fn set_buffer_sizes(&self, rmb: Option<usize>, sndbuf: Option<usize>) {
        self.inner.ask.set((rmb, sndbuf));
    }

    /// What [`Self::set_buffer_sizes`] asked for.
    pub fn buffer_sizes(&self) -> (Option<usize>, Option<usize>) {
        self.inner.ask.get()
    }

    /// Non-blocking accept: `WouldBlock` while no finished connection waits.
    /// Turning it on also creates the readiness descriptor
    /// ([`SmcListener::readiness_fd`]), as a reactor will ask for it next.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        if self.driver.is_none() {
            return self.inner.tcp.set_nonblocking(on);
        }
        if on {
            self.readiness_fd()?;
        }
        self.inner.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }
}

impl std::os::fd::AsFd for SmcListener {
    /// The listener's readiness descriptor ([`SmcListener::readiness_fd`]).
    /// If it cannot be created (no descriptor left) this panics: call
    /// `readiness_fd()` or `set_nonblocking(true)` first to get the error.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self.readiness_fd() {
            Ok(fd) => fd,
            Err(e) => panic!("smc: cannot create the listener's readiness descriptor: {e}"),
        }
    }
}

impl std::os::fd::AsRawFd for SmcListener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.as_fd().as_raw_fd()
    }
}

impl Drop for SmcListener {
    /// Stops the driver: handshakes in progress and connections nobody
    /// accepted are closed.
    fn drop(&mut self) {
        self.stop_driver();
    }
}

/// A freshly accepted TCP connection: ready at once, or handshaking.
enum Arrival {
    Ready(SmcStream),
    Handshake(Accepting),
}

/// The mode of a connection a listener takes that runs no CLC handshake:
/// the listener is not opted in, or the client's SYN lacked the SMC option
/// (no CLC at all, Linux: PEERNOSMC). `None`: a handshake follows. (The
/// tokio listener asks the same.)
pub(crate) fn without_handshake(opted: bool, tcp: std::os::fd::BorrowedFd<'_>) -> Option<Mode> {
    if !opted {
        Some(no_rendezvous())
    } else if !peer_offered_smc(tcp) {
        Some(no_smc(DeclineCode::PeerNoSmc))
    } else {
        None
    }
}

fn arrival(
    tcp: std::net::TcpStream,
    peer: SocketAddr,
    local: Option<std::net::IpAddr>,
    opted: bool,
    ask: crate::ctx::Bufs,
) -> io::Result<Arrival> {
    if let Some(mode) = without_handshake(opted, tcp.as_fd()) {
        return Ok(Arrival::Ready(SmcStream::tcp_only(
            tcp,
            Role::Server,
            mode,
            Vec::new(),
        )));
    }
    Ok(Arrival::Handshake(Accepting::start_from(
        tcp,
        ask,
        peer.ip(),
        local,
    )?))
}

/// Out of a resource the system may give back later (accept(2): EMFILE,
/// ENFILE, ENOBUFS, ENOMEM): the connection stays in the backlog. (The
/// tokio listener asks the same.)
pub(crate) fn out_of_resources(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error().map(rustix::io::Errno::from_raw_os_error),
        Some(rustix::io::Errno::MFILE)
            | Some(rustix::io::Errno::NFILE)
            | Some(rustix::io::Errno::NOBUFS)
            | Some(rustix::io::Errno::NOMEM)
    )
}

/// A handshake in progress and what it waits for.
struct Pending {
    hs: Accepting,
    addr: SocketAddr,
    wait: Progress,
    /// Stepped in this round of the driver and not over: its peer's next
    /// CLC message is likely microseconds away (see [`SPIN_MAX`]).
    fresh: bool,
}

/// The endpoints whose progress the driver waits for: those of the
/// handshakes whose step runs over the device (one registration each, however
/// many of their handshakes wait, e.g. Proposals parked while a first contact
/// with their peer runs). A pump of the endpoint that takes completions or
/// fires timers (the progress thread's, on the completion channel) rings it.
#[derive(Default)]
struct Watch {
    regs: Vec<(Arc<crate::ctx::Shared>, crate::ctx::ProgressFd)>,
}

/// Whether `p` waits for a step over the device.
fn on_device(p: &Pending) -> bool {
    matches!(p.wait, Progress::Wait { rdma: true, .. })
}

impl Watch {
    /// Registers for the endpoints of `pending` whose handshakes wait for a
    /// device step, drops the others. Returns whether a registration is
    /// new: a pump between that handshake's last look and the registration
    /// rang nobody, so it is looked at again at once. (An endpoint no
    /// registration could be had for, out of descriptors, is tried again
    /// next round; its handshakes are looked at every [`RDMA_TICK`].)
    fn update(&mut self, pending: &[Pending]) -> bool {
        let mut wanted: Vec<&Arc<crate::ctx::Shared>> = Vec::new();
        for p in pending.iter().filter(|p| on_device(p)) {
            if let Some(e) = p.hs.endpoint() {
                if !wanted.iter().any(|w| Arc::ptr_eq(w, e)) {
                    wanted.push(e);
                }
            }
        }
        self.regs
            .retain(|(e, _)| wanted.iter().any(|w| Arc::ptr_eq(w, e)));
        let mut new = false;
        for e in wanted {
            if self.regs.iter().any(|(r, _)| Arc::ptr_eq(r, e)) {
                continue;
            }
            if let Ok(fd) = e.progress_fd() {
                self.regs.push((e.clone(), fd));
                new = true;
            }
        }
        new
    }

    /// Whether `p` waits for a device step of an endpoint not watched.
    fn blind(&self, p: &Pending) -> bool {
        on_device(p)
            && p.hs
                .endpoint()
                .is_none_or(|e| !self.regs.iter().any(|(r, _)| Arc::ptr_eq(r, e)))
    }

    /// Whether `p` waits for a device step of `e`.
    fn of(p: &Pending, e: &Arc<crate::ctx::Shared>) -> bool {
        on_device(p) && p.hs.endpoint().is_some_and(|x| Arc::ptr_eq(x, e))
    }
}

/// Handshakes that moved in a round are stepped again in a loop for up to
/// `ctx::spin_time()` before the driver sleeps in `poll()`, when there are
/// at most this many of them and more than one CPU: the client answers an
/// Accept within microseconds, and a driver that slept would be woken for
/// every CLC message (a wake-up costs more than the spin; the client's
/// `handshake::with_endpoint` spins the same way). A flood of new
/// connections is not spun on.
const SPIN_MAX: usize = 4;

/// The driver thread: takes TCP connections, steps handshakes, queues
/// finished connections, until the listener is dropped.
fn drive(inner: &Inner) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut paused_until: Option<Instant> = None;
    let mut next_tick = Instant::now() + TICK;
    let mut wake_buf = [0u8; 8];
    let gate = crate::ctx::Spin::default();
    let mut watch = Watch::default();
    // The last round took as many connections as it could and did not see
    // the kernel's queue empty: this one takes a batch. While connections
    // come one at a time a round takes one, and the `accept` that would
    // find the queue empty is left to the next poll, which the handshake
    // needs anyway (the client's Proposal comes after its connect).
    let mut more_waiting = false;
    loop {
        let (stop, room) = {
            let mut q = lock(&inner.q);
            let room = q.ready.len() < BACKLOG;
            q.full = !room;
            (q.stop, room)
        };
        if stop {
            return;
        }
        let now = Instant::now();
        if paused_until.is_some_and(|t| now >= t) {
            paused_until = None;
        }
        let accepting = room && pending.len() < MAX_HANDSHAKES && paused_until.is_none();
        let registered = watch.update(&pending);
        // (a device step without a progress descriptor: looked at soon)
        let rdma = pending.iter().any(|p| watch.blind(p));
        let timeout = if registered {
            Some(Duration::ZERO)
        } else if rdma {
            Some(RDMA_TICK)
        } else if !pending.is_empty() || !lock(&inner.q).ready.is_empty() {
            Some(next_tick.saturating_duration_since(now))
        } else {
            paused_until.map(|t| t.saturating_duration_since(now))
        };
        // poll: the wake-up, the listener (if taking connections), every
        // pending handshake's socket, then the progress descriptors of the
        // endpoints whose device steps they wait for
        let (woken, listener_ready, ready): (bool, bool, Vec<bool>) = {
            let mut pfd = Vec::with_capacity(pending.len() + 4);
            pfd.push(PollFd::new(&inner.wake, PollFlags::IN));
            pfd.push(PollFd::new(
                &inner.tcp,
                if accepting {
                    PollFlags::IN
                } else {
                    PollFlags::empty()
                },
            ));
            for p in &pending {
                let f = match p.wait {
                    Progress::Wait { write: true, .. } => PollFlags::OUT,
                    _ => PollFlags::IN,
                };
                pfd.push(PollFd::new(p.hs.tcp(), f));
            }
            for (_, fd) in &watch.regs {
                pfd.push(PollFd::from_borrowed_fd(fd.fd(), PollFlags::IN));
            }
            let ts = timeout.map(|t| Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: i64::from(t.subsec_nanos()),
            });
            let _ = rustix::event::poll(&mut pfd, ts.as_ref());
            let r: Vec<bool> = pfd.iter().map(|p| !p.revents().is_empty()).collect();
            let mut ready = r[2..2 + pending.len()].to_vec();
            for ((e, fd), &rung) in watch.regs.iter().zip(&r[2 + pending.len()..]) {
                // (after a new registration all of them are looked at now)
                if rung || registered {
                    // drained before the steps that look: a ring after
                    // this still wakes the next poll
                    if rung {
                        fd.clear();
                    }
                    for (k, p) in pending.iter().enumerate() {
                        if Watch::of(p, e) {
                            ready[k] = true;
                        }
                    }
                }
            }
            (r[0], r[1], ready)
        };
        if woken {
            let _ = rustix::io::read(&inner.wake, &mut wake_buf);
        }
        let now = Instant::now();
        let tick = now >= next_tick;
        if tick {
            next_tick = now + TICK;
        }
        // step the handshakes that can go on (all of them at a tick, for
        // their deadlines)
        for (k, p) in pending.iter_mut().enumerate() {
            let due = ready.get(k).copied().unwrap_or(false) || tick || watch.blind(p);
            p.fresh = false;
            if due {
                p.wait = p.hs.step();
                p.fresh = p.wait != Progress::Done && ready.get(k).copied().unwrap_or(false);
            }
        }
        queue_finished(inner, &mut pending);
        if tick {
            // queued SMC-R connections reset meanwhile (their TCP connection
            // ended, their peer is gone): nobody will want them
            let mut q = lock(&inner.q);
            q.ready.retain(|(s, _)| !s.smc_gone());
            inner.show(&q);
        }
        if accepting && listener_ready {
            let batch = if more_waiting { ACCEPT_BATCH } else { 1 };
            more_waiting = false;
            for k in 0..batch {
                if pending.len() >= MAX_HANDSHAKES || lock(&inner.q).ready.len() >= BACKLOG {
                    break;
                }
                match inner.tcp.accept() {
                    Ok((tcp, addr)) => {
                        more_waiting = k + 1 == batch;
                        match arrival(tcp, addr, inner.local, inner.opted, inner.ask.get()) {
                            Ok(Arrival::Ready(s)) => inner.push(s, addr),
                            Ok(Arrival::Handshake(mut hs)) => {
                                // (the client's Proposal comes after its
                                // connect returns, and a client on this
                                // driver's only CPU has most likely not run
                                // since it woke the driver: a look now would
                                // find nothing, the next poll says when it is
                                // there; with more CPUs it may be, and
                                // `spin` looks again soon)
                                let wait = if crate::ctx::may_spin() {
                                    hs.step()
                                } else {
                                    Progress::Wait {
                                        write: false,
                                        rdma: false,
                                    }
                                };
                                if wait == Progress::Done {
                                    if let Some(s) = hs.into_stream() {
                                        inner.push(s, addr);
                                    }
                                } else {
                                    pending.push(Pending {
                                        hs,
                                        addr,
                                        wait,
                                        fresh: true,
                                    });
                                }
                            }
                            // this connection could not be set up; it is closed
                            Err(_) => {}
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if out_of_resources(&e) => {
                        paused_until = Some(Instant::now() + PAUSE);
                        let mut q = lock(&inner.q);
                        if q.error.is_none() {
                            q.error = Some(e);
                            inner.show(&q);
                            inner.cv.notify_all();
                        }
                        break;
                    }
                    // that connection only (ECONNABORTED, ...)
                    Err(_) => {}
                }
            }
        } else {
            more_waiting = false;
        }
        spin(inner, &mut pending, &gate);
    }
}

/// Moves the handshakes of `pending` that finished into the accept queue,
/// in the order their connections arrived, and keeps the others in theirs:
/// connections that finish in the same round are accepted in the order they
/// connected, as TCP's accept queue gives them.
fn queue_finished(inner: &Inner, pending: &mut Vec<Pending>) {
    for p in pending.extract_if(.., |p| p.wait == Progress::Done) {
        if let Some(s) = p.hs.into_stream() {
            inner.push(s, p.addr);
        }
    }
}

/// Steps the handshakes that moved this round again, without sleeping, for
/// up to the spin time or until none is left (see [`SPIN_MAX`]). `gate`
/// learns whether that pays: on a core shared with the clients a spin never
/// sees their answer (they cannot run meanwhile), and the driver then sleeps
/// at once (see [`crate::ctx::Spin`]).
fn spin(inner: &Inner, pending: &mut Vec<Pending>, gate: &crate::ctx::Spin) {
    let hot = pending.iter().filter(|p| p.fresh).count();
    if hot == 0 || hot > SPIN_MAX || !crate::ctx::may_spin() {
        return;
    }
    let budget = gate.budget();
    if budget.is_zero() {
        return;
    }
    let end = Instant::now() + budget;
    while Instant::now() < end {
        let mut any = false;
        for p in pending.iter_mut().filter(|p| p.fresh) {
            any = true;
            p.wait = p.hs.step();
        }
        queue_finished(inner, pending);
        if !any {
            gate.hit();
            return;
        }
        std::hint::spin_loop();
    }
    gate.miss(budget);
}
