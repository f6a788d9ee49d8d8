//! `SmcStream` (the listener is in `listen.rs`).

mod in_place;
#[cfg(feature = "tokio")]
pub(crate) use in_place::{
    fill_bounce, finish_read, finish_write, read_plan, too_many, write_plan, Finished, ReadGot,
    WriteGot, BOUNCE_MAX,
};
pub use in_place::{ReadSpace, WriteSpace};

use crate::ctx::{self, Shared, Want};
use crate::provider::AnyProvider;
use crate::rendezvous::{peer_offered_smc, peer_offered_smc_by_cookie, socket_for};
use crate::{handshake, FALLBACK_NO_RENDEZVOUS};
use smc_engine::endpoint::{
    ConnError, ConnId, ConnStatus, Endpoint, FastConn, FastRead, FastWrite, MaySleep, ReadLease,
    ReadPlan, WriteLease, WritePlan,
};
use smc_proto::clc_stream::FailReason;
use smc_proto::close::CloseEvent;
use smc_wire::clc::DeclineCode;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a connection runs over TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fallback {
    /// Our reason, as `smcss` shows it (e.g. `0x03010000`: the peer did not offer SMC).
    pub reason: DeclineCode,
    /// The peer's Decline code, when the peer declined.
    pub peer: Option<DeclineCode>,
}

impl Fallback {
    /// The reason as smc-tools' 32-bit code.
    pub fn code(&self) -> u32 {
        self.reason.to_u32()
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TCP fallback: {}", self.reason)?;
        if let Some(p) = self.peer {
            write!(f, " (peer: {p})")?;
        }
        Ok(())
    }
}

/// How a connection moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// SMC-R.
    SmcR,
    /// Plain TCP, and why.
    Tcp(Fallback),
}

/// A connection: SMC-R when both ends could, TCP otherwise.
pub struct SmcStream {
    /// The TCP socket, shared by every handle of the connection (as a
    /// duplicate descriptor would be; `try_clone` costs no descriptor).
    tcp: Arc<TcpStream>,
    mode: Mode,
    /// SMC-R: the device's endpoint and our connection on it.
    smc: Option<Arc<SmcConn>>,
    /// TCP bytes that arrived behind the CLC messages (data after a Decline).
    pending: Arc<Mutex<Vec<u8>>>,
    opts: Arc<Opts>,
}

/// Socket options shared by all handles of a connection (like the fd's).
#[derive(Default)]
struct Opts {
    nonblocking: AtomicBool,
    read_timeout: Mutex<Option<Duration>>,
    write_timeout: Mutex<Option<Duration>>,
}

impl Drop for Opts {
    /// The last handle is gone: the registry takes the connection off its
    /// list (`SmcStream`'s last field: its TCP socket, and its SMC-R
    /// connection with it, are dropped by then).
    fn drop(&mut self) {
        crate::registry::ended();
    }
}

/// One SMC-R connection; released when the last handle goes away.
pub(crate) struct SmcConn {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: ConnId,
    /// Whether dropping the last handle waits for the close to leave (see
    /// [`LINGER`]); the tokio adapter does not block its runtime.
    pub(crate) linger: AtomicBool,
    /// The TCP socket of the established connection, watched for its end
    /// while the connection lives ([`Shared::watch_tcp`]) and closed after
    /// the SMC close has gone out, as Linux releases the TCP socket after
    /// the SMC close (af_smc.c `smc_release` → `__smc_release`).
    tcp: Option<Arc<TcpStream>>,
    /// Bytes and requests, for the registry.
    pub(crate) stats: Arc<crate::registry::ConnStats>,
    /// The readiness descriptor, once asked for ([`SmcConn::readiness`]).
    ready: std::sync::OnceLock<Arc<ctx::ConnReadiness>>,
    /// The process generation that made it: in a forked child the
    /// connection is the parent's (see `crate::fork`).
    born: usize,
    /// The connection's fast path (`FastConn`), once asked for.
    fast: std::sync::OnceLock<Option<FastConn<AnyProvider>>>,
}

impl SmcConn {
    /// What the connection shows its waiters (`ctx::ConnReadiness`: its
    /// peer signal, the watch that sets what is shown), made at the first
    /// call.
    pub(crate) fn shown(&self) -> io::Result<&ctx::ConnReadiness> {
        if let Some(r) = self.ready.get() {
            return Ok(r);
        }
        // (the endpoint's lock serializes creation)
        let ep = self.shared.lock();
        if self.ready.get().is_none() {
            let r = self.shared.readiness(&ep, self.id)?;
            let _ = self.ready.set(r);
        }
        drop(ep);
        Ok(self.ready.get().expect("set above"))
    }

    /// The connection's readiness descriptor, made at the first call.
    pub(crate) fn readiness(&self) -> io::Result<&Arc<crate::readiness::Readiness>> {
        let r = self.shown()?;
        if let Some(fd) = r.shown.fd() {
            return Ok(fd);
        }
        // (then set to the level once more: a change in between went to
        // the other waiters only)
        let now = self.fast_conn().map_or(ctx::GONE, ctx::shown_level);
        let fd = r.shown.fd_or_make(now)?;
        self.shared.refresh_one(r);
        Ok(fd)
    }

    /// What an async stream's tasks wait on (the tokio adapter: the
    /// readiness descriptor's level, with wakers in place of a
    /// descriptor), made at the first call.
    #[cfg(feature = "tokio")]
    pub(crate) fn task_ready(&self) -> io::Result<&Arc<crate::readiness::TaskReady>> {
        let r = self.shown()?;
        let now = self.fast_conn().map_or(ctx::GONE, ctx::shown_level);
        let t = r.shown.tasks_or_make(now);
        self.shared.refresh_one(r);
        Ok(t)
    }

    /// After an operation of ours through the endpoint changed the
    /// connection: its readiness descriptor shows it (the fast path's and
    /// the connection's core's own changes show without this).
    pub(crate) fn note(&self) {
        if let Some(r) = self.ready.get() {
            self.shared.refresh_one(r);
        }
    }

    /// Writes all of `buf` through the connection's fast path, without the
    /// endpoint's lock, if the connection can (`FastConn::try_write`): a
    /// direct write of an established connection that leaves nothing for
    /// the endpoint to do. `None`: it could not, nothing was written.
    /// A readiness descriptor shows what it changed (the core's watch).
    fn try_fast_write(&self, buf: &[u8]) -> Option<usize> {
        let f = self.fast_conn()?;
        // The peer's reader, woken by this write, may take this CPU at once
        // and answer before this thread is back from its call; with the
        // doorbell held meanwhile, that answer's CDC waits for this thread
        // (`Shared::take_held_cdc`), which reads next as a rule, instead of
        // signalling the completion channel and waking the progress thread.
        let held = ctx::bells_on()
            .then(|| f.doorbell())
            .flatten()
            .filter(|b| b.hold());
        // (the peer's reader woken once the write let go of its locks)
        let r = smc_rdma::shm::defer_wakes(|| f.try_write(buf));
        if held.is_some_and(|b| b.release()) {
            self.shared.take_held_cdc(f);
        }
        match r {
            Ok(FastWrite::Wrote(n)) => Some(n),
            // the endpoint learns of the broken link at its next pump: now
            Ok(FastWrite::WroteLinkBroke(n)) => {
                let mut ep = self.shared.lock();
                self.shared.pump(&mut ep);
                Some(n)
            }
            // (an error shows through the endpoint's write)
            Ok(FastWrite::Declined) | Err(_) => None,
        }
    }

    /// Reads into `buf` through the connection's fast path, without the
    /// endpoint's lock, if the connection can (`FastConn::try_read`): bytes
    /// that have arrived, copied out, with the consumer-cursor update they
    /// make due. `None`: it could not (nothing has arrived, among other
    /// things), nothing was read. A readiness descriptor shows what it
    /// changed, as for writes.
    fn try_fast_read(&self, buf: &mut [u8]) -> Option<usize> {
        let f = self.fast_conn()?;
        match smc_rdma::shm::defer_wakes(|| f.try_read(buf)) {
            FastRead::Read { n, .. } => Some(n),
            // the endpoint learns of the broken link at its next pump: now
            FastRead::ReadLinkBroke(n) => {
                let mut ep = self.shared.lock();
                self.shared.pump(&mut ep);
                Some(n)
            }
            FastRead::Declined => None,
        }
    }

    /// After a read that took bytes: if it left nothing to read and the
    /// peer signal had fired, the signal is spent, and is drained and armed
    /// here, where the read makes it so, as TCP's readable ends with the
    /// read that empties the queue. Otherwise a level-triggered event loop
    /// that reads once per event (redis, hiredis) would be woken by it
    /// again at its next wait, for a look that finds nothing
    /// (`SmcStream::signalled_events`). A CDC that came between the read
    /// and the arm found the signal taken and wrote nothing: looked for
    /// after the arm, and if it brought bytes, the signal is written here
    /// for it.
    ///
    /// Only for level-triggered pollers: an edge-triggered one is woken by
    /// a write of the signal only, which the peer makes for every CDC, so
    /// a spent signal costs it nothing, and a drain here would be a system
    /// call per message more (nginx).
    fn rearm_if_emptied(&self) {
        let Some(s) = self
            .signal()
            .filter(|s| s.polled() && s.bell.poll_level() && s.bell.polled_taken())
        else {
            return;
        };
        let Some(f) = self.fast_conn() else { return };
        if f.level().readable != 0 {
            return;
        }
        if !s.bell.arm_polled() {
            return;
        }
        self.shared.take_held_cdc(f);
        f.refresh();
        if f.level().readable != 0 {
            // (an eventfd counts: a write of 1 makes it readable, and the
            // next arm drains it; a full counter cannot happen with writes
            // of 1 that a drain resets)
            let _ = rustix::io::write(&s.fd, &1u64.to_ne_bytes());
        }
    }

    /// The connection's peer signal (`ctx::PeerSignal`), once its readiness
    /// descriptor exists and where the device has one.
    fn signal(&self) -> Option<&ctx::PeerSignal> {
        self.ready.get()?.signal.as_deref()
    }

    /// The connection's fast-path handle.
    fn fast_conn(&self) -> Option<&FastConn<AnyProvider>> {
        self.fast
            .get_or_init(|| self.shared.lock().fast_conn(self.id))
            .as_ref()
    }

    /// Connection `id` of `shared`, handshaking (released if dropped).
    pub(crate) fn handshaking(shared: Arc<Shared>, id: ConnId) -> SmcConn {
        SmcConn {
            shared,
            id,
            linger: AtomicBool::new(false),
            tcp: None,
            stats: Arc::default(),
            ready: std::sync::OnceLock::new(),
            born: crate::fork::generation(),
            fast: std::sync::OnceLock::new(),
        }
    }

    /// The handshake reached SMC-R on `tcp`: watched from now on.
    pub(crate) fn established(mut self, tcp: Arc<TcpStream>, linger: bool) -> SmcConn {
        self.shared.watch_tcp(&tcp, self.id);
        self.linger.store(linger, Ordering::Relaxed);
        self.tcp = Some(tcp);
        self
    }

    /// The TCP socket of an established connection.
    #[cfg(feature = "tokio")]
    pub(crate) fn tcp(&self) -> Option<&Arc<TcpStream>> {
        self.tcp.as_ref()
    }
}

/// Reads and writes of at least this many bytes copy outside the endpoint's
/// lock (a lease); smaller ones copy under it, where the copy costs less than
/// the lease's second trip to the lock (callgrind, 64-byte messages: about
/// 8 200 instructions each under the lock, 9 100 with leases).
const LEASE_MIN: usize = 4096;

/// How long a blocking write waits for room in the peer's RMB before it
/// copies into the send buffer instead: about the time a reader takes to copy
/// out a quarter of a 1 MiB RMB.
const DIRECT_WAIT: Duration = Duration::from_micros(40);

/// How long closing a connection waits for its unsent data and close CDC to
/// leave: Linux's `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) plus a margin (the
/// engine goes on in the background, see the crate documentation). Linux's
/// close() blocks the same way; in
/// user space it matters more: a process that exits right after close() takes
/// its unsent data with it, there is no kernel to finish the job.
const LINGER: Duration = Duration::from_secs(3);

impl Drop for SmcConn {
    fn drop(&mut self) {
        if crate::fork::parents(self.born) {
            // The parent's connection, in a forked child: the parent goes on
            // with it; nothing here is released or sent (the endpoint stays,
            // held by the parent generation's context).
            return;
        }
        self.stats.retire();
        if let Some(t) = &self.tcp {
            // (still open: `self.tcp` is dropped after this)
            self.shared.unwatch_tcp(t);
        }
        let id = self.id;
        {
            let mut ep = self.shared.lock();
            ep.release(id);
            self.shared.pump(&mut ep);
            if !self.linger.load(Ordering::Relaxed) || ep.close_sent(id) {
                return;
            }
        }
        // (a connection freed meanwhile counts as sent: its handle finds
        // nothing, whatever took its slot)
        let _ = self.shared.run(
            Want::CloseSent(id),
            Some(Instant::now() + LINGER),
            false,
            |ep| ep.close_sent(id).then_some(Ok(())),
        );
    }
}

impl fmt::Debug for SmcStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcStream")
            .field("tcp", &self.tcp)
            .field("mode", &self.mode)
            .finish()
    }
}

/// `op`, after which `c`'s readiness descriptor shows what it changed.
fn noted<R>(
    c: &SmcConn,
    ep: &mut Endpoint<AnyProvider>,
    op: impl FnOnce(&mut Endpoint<AnyProvider>) -> R,
) -> R {
    let r = op(ep);
    c.note();
    r
}

pub(crate) fn no_smc(reason: DeclineCode) -> Mode {
    Mode::Tcp(Fallback { reason, peer: None })
}

/// Whether a client socket was opted in to the SMC option before its
/// `connect()`, and its cookie if known (the rendezvous' key: read once).
#[derive(Clone, Copy)]
enum Opted {
    No,
    Yes,
    Cookie(u64),
}

impl From<bool> for Opted {
    fn from(opted: bool) -> Opted {
        if opted {
            Opted::Yes
        } else {
            Opted::No
        }
    }
}

pub(crate) fn no_rendezvous() -> Mode {
    no_smc(DeclineCode::from_u32(FALLBACK_NO_RENDEZVOUS))
}

pub(crate) fn conn_error(e: ConnError) -> io::Error {
    match e {
        ConnError::NotConnected => {
            io::Error::new(io::ErrorKind::NotConnected, "SMC connection is gone")
        }
        ConnError::Closed => io::Error::new(
            io::ErrorKind::BrokenPipe,
            "SMC connection closed for writing",
        ),
        ConnError::Reset => io::Error::new(
            io::ErrorKind::ConnectionReset,
            "SMC connection reset by peer",
        ),
        ConnError::Aborted => io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "SMC connection aborted (link lost or peer misbehaved)",
        ),
    }
}

pub(crate) fn fail_error(r: FailReason) -> io::Error {
    match r {
        FailReason::Timeout => io::Error::new(io::ErrorKind::TimedOut, "SMC handshake timed out"),
        FailReason::TcpClosed => io::Error::new(
            io::ErrorKind::ConnectionReset,
            "TCP connection lost during the SMC handshake",
        ),
        FailReason::Protocol(e) => io::Error::new(
            io::ErrorKind::InvalidData,
            format!("SMC handshake failed: {e}"),
        ),
    }
}

impl SmcStream {
    /// Connects like `TcpStream::connect`, trying every address in turn.
    pub fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<SmcStream> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(&a, None) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "no addresses to connect to")
        }))
    }

    /// Connects with a timeout for the TCP connection (the CLC handshake has its own).
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<SmcStream> {
        Self::connect_one(addr, Some(timeout))
    }

    fn connect_one(addr: &SocketAddr, timeout: Option<Duration>) -> io::Result<SmcStream> {
        let (fd, cookie) = socket_for(addr)?;
        let tcp = match timeout {
            None => {
                rustix::net::connect(&fd, addr)?;
                TcpStream::from(fd)
            }
            Some(t) => {
                // non-blocking connect, then wait for writability
                rustix::io::ioctl_fionbio(&fd, true)?;
                match rustix::net::connect(&fd, addr) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::INPROGRESS) => {
                        let mut pfd = [rustix::event::PollFd::new(
                            &fd,
                            rustix::event::PollFlags::OUT,
                        )];
                        let ts = rustix::event::Timespec {
                            tv_sec: t.as_secs() as i64,
                            tv_nsec: i64::from(t.subsec_nanos()),
                        };
                        if rustix::event::poll(&mut pfd, Some(&ts))? == 0 {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "connection timed out",
                            ));
                        }
                        if let Some(e) = rustix::net::sockopt::socket_error(&fd)?.err() {
                            return Err(e.into());
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
                rustix::io::ioctl_fionbio(&fd, false)?;
                TcpStream::from(fd)
            }
        };
        let opted = match cookie {
            Some(c) => Opted::Cookie(c),
            None => Opted::No,
        };
        Self::after_connect(tcp, opted, (None, None), Some(addr.ip()))
    }

    /// A stream over `tcp`, a TCP socket connected in blocking mode: runs
    /// the client's CLC handshake if `opted` (the socket was opted in to
    /// the SMC option, [`crate::opt_in`], before its connect) and the peer's
    /// SYN-ACK offered SMC; TCP otherwise. For programs that create and
    /// connect their sockets themselves (the preload library).
    pub fn from_connected(tcp: TcpStream, opted: bool) -> io::Result<SmcStream> {
        Self::after_connect(tcp, Opted::from(opted), (None, None), None)
    }

    /// [`Self::from_connected`] with an RMB of at least `rmb` and a send
    /// buffer of at least `sndbuf` bytes if the connection is SMC-R (`None`:
    /// the process's, see [`crate::set_buffer_sizes`]): what a socket's
    /// `SO_RCVBUF`/`SO_SNDBUF` ask of an AF_SMC socket in Linux.
    pub fn from_connected_sized(
        tcp: TcpStream,
        opted: bool,
        rmb: Option<usize>,
        sndbuf: Option<usize>,
    ) -> io::Result<SmcStream> {
        Self::after_connect(tcp, Opted::from(opted), (rmb, sndbuf), None)
    }

    /// `peer`: the address connected to, if the caller knows it (one
    /// system call less per connection).
    fn after_connect(
        mut tcp: TcpStream,
        opted: Opted,
        ask: ctx::Bufs,
        peer: Option<std::net::IpAddr>,
    ) -> io::Result<SmcStream> {
        let offered = match opted {
            Opted::No => {
                return Ok(SmcStream::tcp_only(
                    tcp,
                    ctx::Role::Client,
                    no_rendezvous(),
                    Vec::new(),
                ));
            }
            Opted::Yes => peer_offered_smc(tcp.as_fd()),
            Opted::Cookie(c) => peer_offered_smc_by_cookie(c),
        };
        if !offered {
            // The SYN-ACK lacked the option: no CLC at all (Linux: PEERNOSMC).
            return Ok(SmcStream::tcp_only(
                tcp,
                ctx::Role::Client,
                no_smc(DeclineCode::PeerNoSmc),
                Vec::new(),
            ));
        }
        let local = tcp.local_addr()?.ip();
        let peer = match peer {
            Some(p) => p,
            None => tcp.peer_addr()?.ip(),
        };
        match ctx::endpoint_for(local, peer, ctx::Role::Client) {
            ctx::Device::Endpoint(shared) => {
                let id = ctx::connect_in(&mut shared.lock(), local, ask);
                SmcStream::finish_handshake(tcp, shared, id)
            }
            dev => {
                let unavailable = matches!(dev, ctx::Device::Unavailable);
                let f = handshake::client(&mut tcp, unavailable).inspect_err(|_| {
                    crate::registry::handshake_error(ctx::Role::Client);
                })?;
                Ok(SmcStream::tcp_only(
                    tcp,
                    ctx::Role::Client,
                    Mode::Tcp(f),
                    Vec::new(),
                ))
            }
        }
    }

    pub(crate) fn tcp_only(
        tcp: TcpStream,
        role: ctx::Role,
        mode: Mode,
        pending: Vec<u8>,
    ) -> SmcStream {
        let tcp = Arc::new(tcp);
        crate::registry::stream(&tcp, role, mode, None);
        SmcStream {
            tcp,
            mode,
            smc: None,
            pending: Arc::new(Mutex::new(pending)),
            opts: Arc::new(Opts::default()),
        }
    }

    /// An SMC-R stream whose handshake `conn` finished on `tcp` (blocking).
    pub(crate) fn smc(tcp: TcpStream, role: ctx::Role, conn: SmcConn) -> SmcStream {
        let tcp = Arc::new(tcp);
        crate::registry::stream(
            &tcp,
            role,
            Mode::SmcR,
            Some((&conn.shared, conn.id, &conn.stats)),
        );
        SmcStream {
            tcp: tcp.clone(),
            mode: Mode::SmcR,
            smc: Some(Arc::new(conn.established(tcp, true))),
            pending: Arc::new(Mutex::new(Vec::new())),
            opts: Arc::new(Opts::default()),
        }
    }

    fn finish_handshake(tcp: TcpStream, shared: Arc<Shared>, id: ConnId) -> io::Result<SmcStream> {
        let conn = SmcConn::handshaking(shared.clone(), id);
        let (status, leftover) = handshake::with_endpoint(&tcp, &shared, id)?;
        match status {
            ConnStatus::Smc => Ok(SmcStream::smc(tcp, ctx::Role::Client, conn)),
            ConnStatus::Fallback { reason, peer } => Ok(SmcStream::tcp_only(
                tcp,
                ctx::Role::Client,
                Mode::Tcp(Fallback { reason, peer }),
                leftover,
            )),
            ConnStatus::Failed(r) => {
                crate::registry::handshake_error(ctx::Role::Client);
                Err(fail_error(r))
            }
            ConnStatus::Handshaking => {
                crate::registry::handshake_error(ctx::Role::Client);
                Err(io::Error::other("SMC handshake did not finish"))
            }
        }
    }

    /// The connection's parts, for the tokio adapter (takes the pending bytes,
    /// which other handles of the connection then no longer see).
    #[cfg(feature = "tokio")]
    pub(crate) fn into_parts(self) -> Parts {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        Parts {
            tcp: self.tcp,
            mode: self.mode,
            smc: self.smc,
            pending,
        }
    }

    /// A stream from its parts (the TCP socket in blocking mode).
    #[cfg(feature = "tokio")]
    pub(crate) fn from_parts(p: Parts) -> SmcStream {
        SmcStream {
            tcp: p.tcp,
            mode: p.mode,
            smc: p.smc,
            pending: Arc::new(Mutex::new(p.pending)),
            opts: Arc::new(Opts::default()),
        }
    }

    /// The SMC-R connection `conn` on `tcp` as a stream in non-blocking
    /// mode, for the tokio adapter, whose reads and writes take the fast
    /// path through it and wait in the reactor: the TCP socket's own mode
    /// is left as it is (other handles share it).
    #[cfg(feature = "tokio")]
    pub(crate) fn nonblocking_view(tcp: Arc<TcpStream>, conn: Arc<SmcConn>) -> SmcStream {
        let opts = Opts::default();
        opts.nonblocking.store(true, Ordering::Relaxed);
        SmcStream {
            tcp,
            mode: Mode::SmcR,
            smc: Some(conn),
            pending: Arc::default(),
            opts: Arc::new(opts),
        }
    }

    fn timeout(m: &Mutex<Option<Duration>>) -> Option<Instant> {
        let t = *m.lock().unwrap_or_else(|e| e.into_inner());
        t.map(|t| Instant::now() + t)
    }

    /// The SMC-R connection, if the stream is one; `ENOTCONN` in a forked
    /// child for a connection made before the fork (the parent's, see
    /// `crate::fork`).
    fn smc_conn(&self) -> io::Result<Option<&Arc<SmcConn>>> {
        match &self.smc {
            Some(c) if crate::fork::parents(c.born) => Err(crate::fork::parents_error()),
            c => Ok(c.as_ref()),
        }
    }

    fn nonblocking(&self) -> bool {
        self.opts.nonblocking.load(Ordering::Relaxed)
    }

    /// Whether the stream is in non-blocking mode ([`Self::set_nonblocking`]).
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking()
    }

    /// Reads with the copy out of the RMB made after the endpoint's lock is
    /// released (a [`ReadLease`]): other threads' messages are not held up
    /// behind it, and the lock is held for bookkeeping only.
    fn smc_read(&self, c: &SmcConn, buf: &mut [u8], nonblocking: bool) -> io::Result<usize> {
        enum Got {
            Done(usize),
            Lease(ReadLease),
        }
        if let Some(n) = (!buf.is_empty()).then(|| c.try_fast_read(buf)).flatten() {
            c.rearm_if_emptied();
            return Ok(n);
        }
        // (after the fast path, which never waits: the option's lock is
        // taken by reads that may)
        let deadline = Self::timeout(&self.opts.read_timeout);
        if !buf.is_empty() {
            // a non-blocking reader that finds nothing, with nothing for the
            // endpoint to do (the link's receive CQ taken, nothing of the
            // connection waiting for it): no lock, no pump (an event loop
            // reads until it would block, every time)
            if let (true, Some(f)) = (nonblocking, c.fast_conn()) {
                // An event loop that waits on the peer's signal: armed again
                // before the look below (and drained: a signal whose bytes
                // a read took may still be there), so that the peer's next
                // CDC signals it unless the look finds that CDC.
                // (also when a read before armed it, `rearm_if_emptied`: a
                // peer's write for a SEND that took the bell before that arm
                // may have landed after its drain, and a level-triggered
                // loop that reads to WouldBlock would be woken by it again
                // and again)
                if let Some(s) = c.signal().filter(|s| s.polled()) {
                    s.bell.arm_polled();
                }
                match f.may_sleep() {
                    MaySleep::Sleep => return Err(io::ErrorKind::WouldBlock.into()),
                    MaySleep::Again => {
                        if let Some(n) = c.try_fast_read(buf) {
                            return Ok(n);
                        }
                    }
                    MaySleep::Busy | MaySleep::No => {}
                }
            }
            // a blocking reader waits on its connection's doorbell where it can
            if let (false, Some(f)) = (nonblocking, c.fast_conn()) {
                if let Some(n) = c
                    .shared
                    .read_on_bell(c.id, f, deadline, || c.try_fast_read(buf))
                {
                    return Ok(n);
                }
            }
        }
        let _busy = c.shared.busy();
        let got = c
            .shared
            .run(Want::Read(c.id), deadline, nonblocking, |ep| {
                noted(c, ep, |ep| {
                    match if ep.readable(c.id).min(buf.len()) < LEASE_MIN {
                        // a small copy costs less under the lock than a lease does
                        Ok(ReadPlan::NoWindow)
                    } else {
                        ep.read_lease(c.id, buf.len())
                    } {
                        Ok(ReadPlan::Lease(l)) => Some(Ok(Got::Lease(l))),
                        Ok(ReadPlan::Empty) if buf.is_empty() || ep.peer_done(c.id) => {
                            Some(Ok(Got::Done(0)))
                        }
                        Ok(ReadPlan::Empty) => None,
                        Ok(ReadPlan::NoWindow) => match ep.read_into(c.id, buf) {
                            Ok(0) if buf.is_empty() || ep.peer_done(c.id) => Some(Ok(Got::Done(0))),
                            Ok(0) => None,
                            Ok(n) => Some(Ok(Got::Done(n))),
                            Err(e) => Some(Err(conn_error(e))),
                        },
                        Err(e) => Some(Err(conn_error(e))),
                    }
                })
            })?;
        let l = match got {
            Got::Done(n) => return Ok(n),
            Got::Lease(l) => l,
        };
        let copied = l.copy_to(buf);
        let n = if copied.is_ok() { l.len() } else { 0 };
        let committed = in_place::commit_read(c, n);
        // bytes copied are delivered (a failed commit shows at the next read)
        copied.map_err(conn_error)?;
        if n == 0 {
            committed.map_err(conn_error)?;
        }
        Ok(n)
    }

    /// Writes straight into the peer's RMB when it has room, with the copy
    /// made after the endpoint's lock is released (a [`WriteLease`]), else
    /// through the send buffer.
    fn smc_write(&self, c: &SmcConn, buf: &[u8], nonblocking: bool) -> io::Result<usize> {
        enum Wrote {
            Done(usize),
            Lease(WriteLease),
        }
        if buf.is_empty() {
            return Ok(0);
        }
        if let Some(n) = c.try_fast_write(buf) {
            return Ok(n);
        }
        let deadline = Self::timeout(&self.opts.write_timeout);
        let op = |ep: &mut Endpoint<AnyProvider>, buffer: bool| {
            let r = if buffer {
                ep.write(c.id, buf)
            } else {
                ep.write_unbuffered(c.id, buf)
            };
            c.note();
            match r {
                Ok(0) => None,
                Ok(n) => Some(Ok(n)),
                Err(e) => Some(Err(conn_error(e))),
            }
        };
        // A blocking write whose data could go straight into the peer's RMB
        // waits up to DIRECT_WAIT for room there before copying into the send
        // buffer (see `Endpoint::write_unbuffered`); that wait, sleeps
        // included, ends at DIRECT_WAIT. A non-blocking one looks once.
        let until = Instant::now() + DIRECT_WAIT;
        let first = deadline.map_or(until, |d| d.min(until));
        let _busy = c.shared.busy();
        let direct = c
            .shared
            .run(Want::Write(c.id), Some(first), nonblocking, |ep| {
                let plan = if buf.len() < LEASE_MIN {
                    // a small copy costs less under the lock than a lease does
                    Ok(WritePlan::NotDirect)
                } else {
                    ep.write_lease(c.id, buf)
                };
                match plan {
                    Ok(WritePlan::Lease(l)) => Some(Ok(Wrote::Lease(l))),
                    Ok(WritePlan::NoRoom) => None,
                    Ok(WritePlan::NotDirect) => op(ep, false).map(|r| r.map(Wrote::Done)),
                    Err(e) => Some(Err(conn_error(e))),
                }
            });
        match direct {
            Ok(Wrote::Done(n)) => return Ok(n),
            Ok(Wrote::Lease(l)) => {
                let copied = l.copy_from(buf).is_ok();
                let mut ep = c.shared.lock();
                let r = ep.write_commit(c.id, &l, copied);
                c.shared.after_lease(&mut ep, c.id);
                c.note();
                drop(ep);
                match r {
                    Ok(true) => return Ok(l.len()),
                    // not announced: written again below
                    Ok(false) => {}
                    Err(e) => return Err(conn_error(e)),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
        c.shared
            .run(Want::Write(c.id), deadline, nonblocking, |ep| op(ep, true))
    }

    fn do_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_with(buf, false)
    }

    /// Reads as `read`, without blocking if `dont_wait` (`MSG_DONTWAIT`)
    /// even in blocking mode.
    pub fn read_with(&self, buf: &mut [u8], dont_wait: bool) -> io::Result<usize> {
        let nonblocking = dont_wait || self.nonblocking();
        if let Some(c) = self.smc_conn()? {
            let r = self.smc_read(c, buf, nonblocking);
            if let Ok(n) = r {
                c.stats.rx(n);
            }
            return r;
        }
        {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if !p.is_empty() {
                let n = buf.len().min(p.len());
                buf[..n].copy_from_slice(&p[..n]);
                p.drain(..n);
                return Ok(n);
            }
        }
        if dont_wait {
            let (n, _) = rustix::net::recv(&*self.tcp, buf, rustix::net::RecvFlags::DONTWAIT)?;
            return Ok(n);
        }
        (&*self.tcp).read(buf)
    }

    /// Copies into `buf` what a read would return, without taking it, as
    /// `recv(MSG_PEEK)`: waits for bytes as a read does (unless non-blocking
    /// or `dont_wait`), `Ok(0)` at the end of the stream. On SMC-R the bytes
    /// stay in the receive buffer, where the connection's readiness shows
    /// them. `None`: not an SMC-R connection.
    pub fn peek_with(&self, buf: &mut [u8], dont_wait: bool) -> Option<io::Result<usize>> {
        let c = match self.smc_conn() {
            Ok(Some(c)) => c,
            Ok(None) => return None,
            Err(e) => return Some(Err(e)),
        };
        if buf.is_empty() {
            return Some(Ok(0));
        }
        let nonblocking = dont_wait || self.nonblocking();
        let deadline = Self::timeout(&self.opts.read_timeout);
        let _busy = c.shared.busy();
        Some(c.shared.run(Want::Read(c.id), deadline, nonblocking, |ep| {
            noted(c, ep, |ep| match ep.read_peek(c.id, buf) {
                Ok(0) if ep.peer_done(c.id) => Some(Ok(0)),
                Ok(0) => None,
                // (the peek holds the bytes as a lease does: given
                // back, none taken)
                Ok(n) => Some(ep.read_commit(c.id, 0).map(|()| n).map_err(conn_error)),
                Err(e) => Some(Err(conn_error(e))),
            })
        }))
    }

    fn do_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.write_with(buf, false)
    }

    /// Writes as `write`, without blocking if `dont_wait` (`MSG_DONTWAIT`)
    /// even in blocking mode. (Writing after the end of the connection is
    /// `BrokenPipe` without a signal, as `send(MSG_NOSIGNAL)`.)
    pub fn write_with(&self, buf: &[u8], dont_wait: bool) -> io::Result<usize> {
        let nonblocking = dont_wait || self.nonblocking();
        match self.smc_conn()? {
            Some(c) => {
                let r = self.smc_write(c, buf, nonblocking);
                if let Ok(n) = r {
                    c.stats.tx(n);
                }
                r
            }
            None => {
                let mut f = rustix::net::SendFlags::NOSIGNAL;
                if dont_wait {
                    f |= rustix::net::SendFlags::DONTWAIT;
                }
                Ok(rustix::net::send(&*self.tcp, buf, f)?)
            }
        }
    }

    /// Sends one byte of urgent (out-of-band) data, as `send(MSG_OOB)`.
    pub fn send_oob(&self, byte: u8) -> io::Result<()> {
        match self.smc_conn()? {
            Some(c) => {
                let deadline = Self::timeout(&self.opts.write_timeout);
                c.shared
                    .run(Want::Write(c.id), deadline, self.nonblocking(), |ep| {
                        noted(c, ep, |ep| match ep.write_oob(c.id, byte) {
                            Ok(true) => Some(Ok(())),
                            Ok(false) => None,
                            Err(e) => Some(Err(conn_error(e))),
                        })
                    })
            }
            None => {
                rustix::net::send(&*self.tcp, &[byte], rustix::net::SendFlags::OOB)?;
                Ok(())
            }
        }
    }

    /// Receives the peer's urgent byte, if one arrived (`recv(MSG_OOB)`); on TCP
    /// this is the kernel's out-of-band byte.
    pub fn recv_oob(&self) -> io::Result<Option<u8>> {
        match self.smc_conn()? {
            Some(c) => {
                let mut ep = c.shared.lock();
                c.shared.pump(&mut ep);
                let r = ep.read_oob(c.id).map_err(conn_error);
                c.note();
                r
            }
            None => {
                let mut b = [0u8; 1];
                match rustix::net::recv(&*self.tcp, &mut b, rustix::net::RecvFlags::OOB) {
                    Ok((1, _)) => Ok(Some(b[0])),
                    Ok(_) => Ok(None),
                    Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::AGAIN) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

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
    /// shows there and not on the readiness descriptor. It is drained and
    /// armed again by the reads: never read from or write to it. Without
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
        let Ok(Some(c)) = self.smc_conn() else { return };
        let Some(s) = c.signal() else { return };
        if on {
            if s.pollers.fetch_add(1, Ordering::AcqRel) == 0 {
                // (every CDC before this signalled the completion channel:
                // nothing came unannounced, no look needed)
                s.bell.arm_polled();
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
        // A CDC the peer signalled may still wait in the receive queue,
        // announced to nobody else: taken now, and what it brought shows
        // on the readiness descriptor.
        if let Some(f) = c.fast_conn() {
            c.shared.take_held_cdc(f);
            f.refresh();
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
    /// values), after taking what the peer signalled through
    /// [`SmcStream::signal_fd`] (so that its data, end of file and room
    /// show together, in one event); a signal with nothing behind it is
    /// drained. For an event loop whose wait the signal ended. `None`:
    /// not known here (not SMC-R, no readiness descriptor).
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
                // triggered wait would see it again and again. Drained
                // and armed again, then a look for what came before the
                // arm (a CDC that another thread applies meanwhile shows
                // here or on the readiness descriptor, never on neither).
                s.bell.arm_polled();
                c.shared.take_held_cdc(f);
            }
            if spent || taken {
                f.refresh();
            }
        }
        Some(ctx::shown_level(f).epoll_events())
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

    /// The bytes a read would return now without waiting, as `FIONREAD`
    /// counts them, without taking any (a CDC that has come is taken off
    /// the link first, so that what it brought counts). `None`: not an
    /// SMC-R connection (a fallback's bytes are the TCP socket's).
    pub fn readable_bytes(&self) -> Option<usize> {
        let Ok(Some(c)) = self.smc_conn() else {
            return None;
        };
        let f = c.fast_conn()?;
        c.shared.take_held_cdc(f);
        Some(f.level().readable)
    }

    /// The connection's TCP socket (on SMC-R, the one its CLC handshake ran
    /// on, which stays open as long as the connection). Not for polling:
    /// SMC-R data never shows on it ([`SmcStream::readiness_fd`] does).
    pub fn tcp_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tcp.as_fd()
    }

    /// TCP bytes that arrived behind the CLC messages and were not read yet
    /// (a fallback connection only): a read returns them without blocking
    /// though the TCP socket may not poll readable.
    pub fn has_pending(&self) -> bool {
        !self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// SMC-R, or TCP with the reason.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// An SMC-R connection's RMB and send buffer sizes in bytes, as its
    /// handshake took them (see [`crate::set_buffer_sizes`]); `None` over
    /// TCP, or in a forked child (the connection is the parent's).
    pub fn buffer_sizes(&self) -> Option<(usize, usize)> {
        let c = self.smc.as_ref()?;
        if crate::fork::parents(c.born) {
            return None;
        }
        let d = c.shared.lock().conn_diag(c.id)?;
        (d.rmbe_len > 0).then_some((d.rmbe_len, d.sndbuf_len))
    }

    /// Whether dropping the last handle waits for the SMC close to leave
    /// (a connection queued in a listener does not: nobody wrote on it).
    pub(crate) fn set_linger(&self, on: bool) {
        if let Some(c) = &self.smc {
            c.linger.store(on, Ordering::Relaxed);
        }
    }

    /// An SMC-R connection that was reset or aborted (its peer is gone).
    pub(crate) fn smc_gone(&self) -> bool {
        use smc_proto::close::CloseState;
        self.smc.as_ref().is_some_and(|c| {
            crate::fork::parents(c.born)
                || matches!(
                    c.shared.lock().close_state(c.id),
                    None | Some(CloseState::Closed)
                        | Some(CloseState::ProcessAbort)
                        | Some(CloseState::PeerAbortWait)
                )
        })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Shuts down the read, write or both halves. On SMC-R, shutting down the
    /// write side gives the peer end-of-file after everything written before.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self.smc_conn()? {
            Some(c) => {
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    let mut ep = c.shared.lock();
                    ep.close(c.id, CloseEvent::AppShutdownWrite);
                    c.shared.pump(&mut ep);
                    c.note();
                }
                Ok(())
            }
            None => self.tcp.shutdown(how),
        }
    }

    /// `TCP_NODELAY` (SMC-R sends at once anyway).
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)
    }

    /// Non-blocking mode.
    ///
    /// The readiness descriptor ([`SmcStream::readiness_fd`]) is not made
    /// here: a program that polls its streams itself never needs it, and
    /// keeping one exact costs system calls at every change of the stream's
    /// state. A reactor asks for it when it registers.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.opts.nonblocking.store(on, Ordering::Relaxed);
        self.tcp.set_nonblocking(on)
    }

    /// Read timeout (`None`: block). A zero duration is an error, as in std.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(t)?;
        *self
            .opts
            .read_timeout
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = t;
        Ok(())
    }

    /// Write timeout (`None`: block). A zero duration is an error, as in std.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)?;
        *self
            .opts
            .write_timeout
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = t;
        Ok(())
    }

    /// Another handle to the same connection (sharing its TCP socket: no
    /// further descriptor).
    pub fn try_clone(&self) -> io::Result<SmcStream> {
        Ok(SmcStream {
            tcp: self.tcp.clone(),
            mode: self.mode,
            smc: self.smc.clone(),
            pending: self.pending.clone(),
            opts: self.opts.clone(),
        })
    }
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.do_read(buf)
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.do_write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for &SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.do_read(buf)
    }
}

impl Write for &SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.do_write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What a stream is made of, for the tokio adapter.
#[cfg(feature = "tokio")]
pub(crate) struct Parts {
    pub(crate) tcp: Arc<TcpStream>,
    pub(crate) mode: Mode,
    pub(crate) smc: Option<Arc<SmcConn>>,
    /// TCP bytes that arrived behind the CLC messages.
    pub(crate) pending: Vec<u8>,
}

impl std::os::fd::AsFd for SmcStream {
    /// The stream's readiness descriptor ([`SmcStream::readiness_fd`]), for
    /// reactors (mio registers it). On SMC-R it is created at the first
    /// call; if that fails (no descriptor left) this panics: call
    /// `readiness_fd()` first to get the error.
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self.readiness_fd() {
            Ok(fd) => fd,
            Err(e) => panic!("smc: cannot create the stream's readiness descriptor: {e}"),
        }
    }
}

impl std::os::fd::AsRawFd for SmcStream {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.as_fd().as_raw_fd()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::SmcListener;
    use std::os::fd::AsFd;

    /// The shared-memory device of this test process (root: BPF), as the
    /// integration tests' `common::setup` makes it.
    pub(crate) fn setup() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let tag = format!("smc-shm-test-{}", std::process::id());
            std::env::remove_var("SMC_RS_CONFIG_DIR");
            crate::use_loopback_device(&tag);
            if std::env::var_os("SMC_RS_RUN_DIR").is_none() {
                std::env::set_var(
                    "SMC_RS_RUN_DIR",
                    std::env::temp_dir().join(tag).join("registry"),
                );
            }
        });
    }

    /// One of these tests at a time: all share this process's endpoint and
    /// its link groups, and those that hold the endpoint's lock count on
    /// their link carrying only their own CDCs meanwhile (another test's
    /// handshake puts LLC messages on it, which wait for the endpoint and
    /// keep CDCs behind them from a reader's dispatch, as they must).
    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        ONE.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A read of bytes that have arrived copies them out through the
    /// connection's fast path (`FastConn::try_read`): it finishes while
    /// another thread holds the endpoint's lock.
    #[test]
    fn a_read_of_arrived_bytes_does_not_wait_for_the_endpoint_lock() {
        let _one = serial();
        setup();
        let l = SmcListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let acc = std::thread::spawn(move || l.accept().unwrap().0);
        let mut c = SmcStream::connect(addr).unwrap();
        let mut s = acc.join().unwrap();
        assert_eq!(s.mode(), Mode::SmcR, "both ends on the shm device");
        // a first message (its read makes the connection's handle, which
        // takes the lock once)
        c.write_all(&[1; 64]).unwrap();
        let mut b = [0u8; 64];
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, [1; 64]);
        c.write_all(&[2; 64]).unwrap();
        let conn = s.smc.clone().unwrap();
        // the server's endpoint takes the message's CDC
        let mut arrived = false;
        for _ in 0..1_000_000 {
            let mut ep = conn.shared.lock();
            conn.shared.pump(&mut ep);
            if ep.readable(conn.id) >= 64 {
                arrived = true;
                break;
            }
            drop(ep);
            std::thread::yield_now();
        }
        assert!(arrived, "the second message arrives");
        let ep = conn.shared.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut b = [0u8; 64];
                let r = (&s).read(&mut b).map(|n| (n, b[0]));
                let _ = tx.send(r.map_err(|e| e.kind()));
            });
            // (a deadlock detector, not a latency bound)
            let got = rx.recv_timeout(Duration::from_secs(30));
            drop(ep);
            assert_eq!(got, Ok(Ok((64, 2))), "read while the endpoint is locked");
        });
    }

    /// Whether `fd` polls readable within `secs`.
    fn readable(fd: std::os::fd::BorrowedFd<'_>, secs: i64) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut p = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
        let t = Timespec {
            tv_sec: secs,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut p, Some(&t)).unwrap();
        p[0].revents().contains(PollFlags::IN)
    }

    /// The SMC-R connection of `s`.
    #[cfg(feature = "tokio")]
    pub(crate) fn conn_of(s: &SmcStream) -> Arc<SmcConn> {
        s.smc.clone().expect("an SMC-R stream")
    }

    /// Whether a poller of `c`'s peer signal is registered and the signal
    /// is armed for it, not signalled since: the poller waits, or is about
    /// to, and the peer's next SEND writes the signal.
    #[cfg(feature = "tokio")]
    pub(crate) fn signal_armed(c: &SmcConn) -> bool {
        c.signal()
            .is_some_and(|s| s.polled() && !s.bell.polled_taken())
    }

    /// An established pair on this process's shm device.
    pub(crate) fn smc_pair() -> (SmcStream, SmcStream) {
        setup();
        let l = SmcListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let acc = std::thread::spawn(move || l.accept().unwrap().0);
        let c = SmcStream::connect(addr).unwrap();
        let s = acc.join().unwrap();
        assert_eq!(s.mode(), Mode::SmcR, "both ends on the shm device");
        (c, s)
    }

    /// A connection with a readiness descriptor reads what has arrived
    /// through the fast path too, and its descriptor shows what the read
    /// changed, all while another thread holds the endpoint's lock.
    #[test]
    fn a_readiness_connection_reads_and_shows_it_without_the_endpoint_lock() {
        let _one = serial();
        let (mut c, mut s) = smc_pair();
        let fd = s.readiness_fd().unwrap().try_clone_to_owned().unwrap();
        assert!(!readable(fd.as_fd(), 0), "nothing arrived yet");
        // a first message (its read makes the connection's handles)
        c.write_all(&[1; 64]).unwrap();
        assert!(readable(fd.as_fd(), 10), "the first message shows");
        let mut b = [0u8; 64];
        s.read_exact(&mut b).unwrap();
        c.write_all(&[2; 64]).unwrap();
        assert!(readable(fd.as_fd(), 10), "the second message shows");
        let conn = s.smc.clone().unwrap();
        let ep = conn.shared.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut b = [0u8; 64];
                let r = (&s).read(&mut b).map(|n| (n, b[0]));
                let _ = tx.send(r.map_err(|e| e.kind()));
            });
            // (a deadlock detector, not a latency bound)
            let got = rx.recv_timeout(Duration::from_secs(30));
            let after = readable(fd.as_fd(), 0);
            drop(ep);
            assert_eq!(got, Ok(Ok((64, 2))), "read while the endpoint is locked");
            assert!(!after, "the descriptor shows the read before any pump");
        });
    }

    /// A writer whose held doorbell a CDC took (`Shared::take_held_cdc`)
    /// applies it without the endpoint while other connections' readers
    /// sleep on their own doorbells: the peer's SENDs ring those, so a
    /// pump would only cost every write of a server with a thread per
    /// connection the endpoint's lock. (With a thread parked through the
    /// endpoint it still pumps: that thread learns of CDCs only so.)
    #[test]
    fn a_held_cdc_is_applied_without_a_pump_while_readers_sleep_on_their_doorbells() {
        let _one = serial();
        let (mut ca, mut sa) = smc_pair();
        let (mut cb, mut sb) = smc_pair();
        // a message each way on both, for their handles and grants
        for (c, s) in [(&mut ca, &mut sa), (&mut cb, &mut sb)] {
            c.write_all(&[1; 64]).unwrap();
            let mut b = [0u8; 64];
            s.read_exact(&mut b).unwrap();
            s.write_all(&[2; 64]).unwrap();
            c.read_exact(&mut b).unwrap();
        }
        let conn = ca.smc.clone().unwrap();
        let fast = conn.fast_conn().expect("a fast handle");
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut b = [0u8; 64];
                (&cb).read_exact(&mut b).map(|()| b[0])
            });
            // until the reader has spun and sleeps on its doorbell
            let mut asleep = false;
            for _ in 0..10_000 {
                if conn.shared.sleepers() > 0 {
                    asleep = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(asleep, "the reader of the second connection sleeps");
            let ep = conn.shared.lock();
            let (tx, rx) = std::sync::mpsc::channel();
            let shared = &conn.shared;
            scope.spawn(move || {
                shared.take_held_cdc(fast);
                let _ = tx.send(());
            });
            // (a deadlock detector, not a latency bound)
            let got = rx.recv_timeout(Duration::from_secs(30));
            drop(ep);
            sb.write_all(&[3; 64]).unwrap();
            let read = reader.join().unwrap().unwrap();
            assert_eq!(got, Ok(()), "applied while the endpoint is locked");
            assert_eq!(read, 3, "the reader is woken");
        });
    }

    /// A CDC applied by another connection's reader (its dispatch of the
    /// link's receive CQ, `FastConn::try_read`) sets the descriptor of the
    /// connection it announces data for, from that reader's thread: no pump
    /// (here: the endpoint's lock held all along) has to come first.
    #[test]
    fn a_cdc_dispatched_by_another_reader_sets_the_descriptor() {
        let _one = serial();
        let (ca, mut sa) = smc_pair();
        let (cb, sb) = smc_pair();
        let fd = sa.readiness_fd().unwrap().try_clone_to_owned().unwrap();
        // both connections' handles and grants: a message each way on
        // each, and a read of B that finds nothing (the endpoint's read
        // gives B its grant to take the link's receive CQ)
        for (mut c, mut s) in [(&ca, &sa), (&cb, &sb)] {
            for _ in 0..3 {
                c.write_all(&[1; 64]).unwrap();
                let mut b = [0u8; 64];
                s.read_exact(&mut b).unwrap();
                s.write_all(&[3; 64]).unwrap();
                c.read_exact(&mut b).unwrap();
            }
        }
        sb.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        assert_eq!(
            (&sb).read(&mut b).map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock)
        );
        assert!(!readable(fd.as_fd(), 0), "nothing for A yet");
        let conn = sa.smc.clone().unwrap();
        let ep = conn.shared.lock();
        std::thread::scope(|scope| {
            let t = scope.spawn(|| {
                // (the client's fast write: no endpoint lock either)
                (&ca).write_all(&[5; 64]).unwrap();
                // B's reader finds nothing of its own, takes the CQ (A's
                // CDC), then waits for the endpoint
                let mut b = [0u8; 64];
                (&sb).read(&mut b).map_err(|e| e.kind())
            });
            // (a deadlock detector, not a latency bound)
            let shown = readable(fd.as_fd(), 30);
            drop(ep);
            assert!(shown, "A's descriptor set before any pump");
            assert_eq!(t.join().unwrap(), Err(io::ErrorKind::WouldBlock));
        });
        let mut b = [0u8; 64];
        sa.read_exact(&mut b).unwrap();
        assert_eq!(b, [5; 64]);
    }

    /// A non-blocking read that finds nothing, on a connection the endpoint
    /// has nothing to do for, says so without the endpoint's lock (an event
    /// loop's last read of every event).
    #[test]
    fn a_nonblocking_read_that_finds_nothing_does_not_wait_for_the_endpoint_lock() {
        let _one = serial();
        let (mut c, mut s) = smc_pair();
        let _fd = s.readiness_fd().unwrap();
        for _ in 0..3 {
            c.write_all(&[1; 64]).unwrap();
            let mut b = [0u8; 64];
            s.read_exact(&mut b).unwrap();
        }
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        // (the first look through the endpoint gives the grant to take the
        // link's receive CQ)
        assert_eq!(
            (&s).read(&mut b).map_err(|e| e.kind()),
            Err(io::ErrorKind::WouldBlock)
        );
        let conn = s.smc.clone().unwrap();
        let ep = conn.shared.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut b = [0u8; 64];
                let _ = tx.send((&s).read(&mut b).map_err(|e| e.kind()));
            });
            // (a deadlock detector, not a latency bound)
            let got = rx.recv_timeout(Duration::from_secs(30));
            drop(ep);
            assert_eq!(got, Ok(Err(io::ErrorKind::WouldBlock)));
        });
    }
}
