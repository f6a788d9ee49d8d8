//! `SmcStream` (the listener is in `listen.rs`).

pub(crate) mod ahead;
mod connect;
mod in_place;
mod rw;
mod signal;
#[cfg(feature = "tokio")]
pub(crate) use in_place::{
    fill_bounce, finish_read, finish_write, read_plan, too_many, write_plan, Finished, ReadGot,
    WriteGot, BOUNCE_MAX,
};
pub use in_place::{ReadSpace, WriteSpace};

use crate::ctx::{self, Shared, Want};
use crate::provider::AnyProvider;
use crate::FALLBACK_NO_RENDEZVOUS;
use smc_engine::endpoint::{ConnError, ConnId, Endpoint, FastConn, FastRead, FastWrite};
use smc_proto::clc_stream::FailReason;
use smc_proto::close::CloseEvent;
use smc_wire::clc::DeclineCode;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// A fallback's bytes read ahead of its socket (data after a Decline),
    /// and a server's answer still to take off the stream (`ahead.rs`).
    pending: Arc<Mutex<ahead::Ahead>>,
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
    pub(crate) wait_close: AtomicBool,
    /// `SO_LINGER`, in milliseconds ([`NO_LINGER`]: off): 0 makes dropping
    /// the last handle abort the connection, more is how long that drop
    /// waits for the close to leave, in place of [`LINGER`]
    /// ([`SmcStream::set_linger`]).
    linger_ms: AtomicU64,
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
    /// peer signal had fired, the signal is spent, and is armed again
    /// (drained where a poller waits on it level-triggered, `PeerSignal::arm`)
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
        if !s.arm() {
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
            wait_close: AtomicBool::new(false),
            linger_ms: AtomicU64::new(NO_LINGER),
            tcp: None,
            stats: Arc::default(),
            ready: std::sync::OnceLock::new(),
            born: crate::fork::generation(),
            fast: std::sync::OnceLock::new(),
        }
    }

    /// The handshake reached SMC-R on `tcp`: watched from now on.
    pub(crate) fn established(mut self, tcp: Arc<TcpStream>, wait_close: bool) -> SmcConn {
        self.shared.watch_tcp(&tcp, self.id);
        self.wait_close.store(wait_close, Ordering::Relaxed);
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

/// `SmcConn::linger_ms` without `SO_LINGER`.
const NO_LINGER: u64 = u64::MAX;

/// The process exits (see [`crate::exiting`]): a close waits for its unsent
/// data until the peer took none of it for [`EXIT_IDLE`].
pub(crate) static EXITING: AtomicBool = AtomicBool::new(false);

/// How long a close at exit waits for a peer that takes none of its unsent
/// data: as long as the engine waits for one after a close before it aborts
/// the connection, which it would do in a process that lived on.
const EXIT_IDLE: Duration = smc_engine::endpoint::MAX_STREAM_WAIT;

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
            if self.linger_ms.load(Ordering::Relaxed) == 0 {
                ep.release_reset(id);
            } else {
                ep.release(id);
            }
            self.shared.pump(&mut ep);
            if !self.wait_close.load(Ordering::Relaxed) || ep.close_sent(id) {
                return;
            }
        }
        // (a connection freed meanwhile counts as sent: its handle finds
        // nothing, whatever took its slot)
        // (Linux's AF_SMC waits the socket's linger time in its place,
        // af_smc.c `smc_close_active`)
        let wait = match self.linger_ms.load(Ordering::Relaxed) {
            NO_LINGER => LINGER,
            ms => Duration::from_millis(ms),
        };
        let (mut unsent, mut idle) = (usize::MAX, Duration::ZERO);
        loop {
            let r = self.shared.run(
                Want::CloseSent(id),
                Some(Instant::now() + wait),
                false,
                |ep| ep.close_sent(id).then_some(Ok(())),
            );
            if r.is_ok() || !EXITING.load(Ordering::Acquire) {
                return;
            }
            // (at exit: on while the peer takes some, see `crate::exiting`)
            let now = self.shared.lock().unsent(id);
            if now < unsent {
                (unsent, idle) = (now, Duration::ZERO);
            } else {
                idle += wait;
            }
            if now == 0 || idle >= EXIT_IDLE {
                return;
            }
        }
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

/// Whether a connection in close state `s` is over as a TCP connection in
/// `TCP_CLOSE` is: reset or aborted, or both directions shut (each by one
/// side, whose FINs a TCP socket would have exchanged).
pub(crate) fn over(s: smc_proto::close::CloseState) -> bool {
    use smc_proto::close::CloseState;
    matches!(
        s,
        CloseState::Closed
            | CloseState::ProcessAbort
            | CloseState::PeerAbortWait
            | CloseState::AppFinCloseWait
            | CloseState::AppCloseWait2
            | CloseState::PeerCloseWait2
    )
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
            .bytes
            .is_empty()
    }

    /// A fallback connection whose server's CLC answer is still to be taken
    /// off its TCP stream (the client stopped waiting for it, see
    /// [`Endpoint::owed_answer`]): its reads must go through this stream,
    /// not to the socket, until the answer is gone. The socket may poll
    /// readable for the answer's bytes while a read then finds no data.
    pub fn answer_owed(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .owes()
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
    pub(crate) fn set_wait_close(&self, on: bool) {
        if let Some(c) = &self.smc {
            c.wait_close.store(on, Ordering::Relaxed);
        }
    }

    /// Ends the connection at once with an abort, dropping what is unsent:
    /// the peer's reads fail with `ECONNRESET`, and this stream's calls find
    /// it gone (`ENOTCONN`). What TCP does when a connected socket is
    /// disconnected (`connect` to `AF_UNSPEC`, tcp.c `tcp_disconnect`, which
    /// sends a reset). On a TCP fallback connection: nothing (the caller
    /// disconnects the socket itself).
    pub fn abort(&self) {
        if let Some(c) = &self.smc {
            if crate::fork::parents(c.born) {
                return;
            }
            let mut ep = c.shared.lock();
            ep.release_reset(c.id);
            c.shared.pump(&mut ep);
            c.shared.app_changed(&ep);
            c.note();
        }
    }

    /// `SO_LINGER`, set on the TCP socket. On SMC-R a zero timeout makes
    /// the close of the last handle an abort: what is unsent is dropped
    /// and the peer's reads fail with `ECONNRESET`, as a TCP socket closed
    /// so sends a reset (tcp.c `__tcp_close`). A timeout above zero is how
    /// long that close waits for unsent data to leave (3 s without one;
    /// the engine sends on after it, as long as the process lives).
    pub fn set_linger(&self, linger: Option<Duration>) -> io::Result<()> {
        rustix::net::sockopt::set_socket_linger(&*self.tcp, linger)?;
        self.note_linger(linger);
        Ok(())
    }

    /// What the connection has not delivered yet: `(queued, unsent)`, the
    /// bytes in its send buffer (not written to the peer, or written and
    /// their CDC not completed: `SIOCOUTQ`) and those of them not written
    /// to the peer (`SIOCOUTQNSD`), as Linux's AF_SMC counts them (af_smc.c
    /// `smc_ioctl`). `None`: not an SMC-R connection (a fallback's queues are
    /// the TCP socket's).
    pub fn send_queue(&self) -> Option<(usize, usize)> {
        let c = self.smc_conn().ok()??;
        let mut ep = c.shared.lock();
        Some((ep.send_queue(c.id), ep.unsent(c.id)))
    }

    /// For a caller that must behave as a TCP socket: a write after the
    /// peer closed the connection (not only its sending side) is TCP's
    /// first write into `CLOSE_WAIT`, which succeeds and draws the peer's
    /// reset. If that is where the connection stands, it takes the end that
    /// reset brings now (`Endpoint::reset_by_write`: writes `EPIPE`, its
    /// readiness the error, once, and the end; reads the end of file) and
    /// this returns `true`: the caller counts the write as done, its bytes
    /// reaching nobody, as TCP's. `false` otherwise, and for a connection
    /// that is not SMC-R. The stream's own writes fail there with
    /// `ECONNRESET`, as Linux's AF_SMC's do (smc_tx.c `smc_tx_sendmsg`).
    pub fn reset_by_write(&self) -> bool {
        let Ok(Some(c)) = self.smc_conn() else {
            return false;
        };
        let reset = c.shared.lock().reset_by_write(c.id);
        reset
    }

    /// For a caller that must behave as a TCP socket: the connection
    /// reports its end as TCP would (`Endpoint::set_tcp_errors`): a reset
    /// by the peer after its orderly close is `EPIPE`, the error of a reset
    /// in `CLOSE_WAIT`; one after both sides ended their streams, or the
    /// peer's process going away after its close, is no error (reads find
    /// the end of file, and a write then draws the reset,
    /// [`SmcStream::reset_by_write`]). The stream's own errors are Linux
    /// AF_SMC's (`ECONNRESET`, `ECONNABORTED`). Nothing for a connection
    /// that is not SMC-R.
    pub fn report_errors_as_tcp(&self) {
        if let Ok(Some(c)) = self.smc_conn() {
            c.shared.lock().set_tcp_errors(c.id);
        }
    }

    /// `SO_LINGER` of the TCP socket.
    pub fn linger(&self) -> io::Result<Option<Duration>> {
        Ok(rustix::net::sockopt::socket_linger(&*self.tcp)?)
    }

    /// Takes `SO_LINGER` from the TCP socket, where it was set directly (an
    /// interposed `setsockopt`) or before the connection was made (a
    /// listener's accepted sockets inherit it, as in Linux's
    /// `sk_clone_lock`): see [`Self::set_linger`].
    pub fn take_socket_linger(&self) -> io::Result<()> {
        let l = self.linger()?;
        self.note_linger(l);
        Ok(())
    }

    fn note_linger(&self, linger: Option<Duration>) {
        if let Some(c) = &self.smc {
            // (0 only for a zero timeout: a shorter one than 1 ms waits 1 ms)
            let ms = linger.map_or(NO_LINGER, |d| match d.is_zero() {
                true => 0,
                false => d.as_millis().clamp(1, u128::from(NO_LINGER - 1)) as u64,
            });
            c.linger_ms.store(ms, Ordering::Relaxed);
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
    /// write side gives the peer end-of-file after everything written before;
    /// shutting down the read side tells the peer nothing, and reads find
    /// end of file once what arrived is read, as on a TCP socket.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self.smc_conn()? {
            Some(c) => {
                let mut ep = c.shared.lock();
                if ep.close_state(c.id).is_none_or(over) {
                    // (as TCP's in TCP_CLOSE, af_inet.c inet_shutdown)
                    return Err(io::ErrorKind::NotConnected.into());
                }
                if matches!(how, Shutdown::Read | Shutdown::Both) {
                    ep.shutdown_read(c.id);
                    // (a reader waiting in another thread returns too)
                    c.shared.app_changed(&ep);
                }
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    ep.close(c.id, CloseEvent::AppShutdownWrite);
                    c.shared.pump(&mut ep);
                }
                c.note();
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
    /// The server's answer still to take off the stream (see `ahead.rs`).
    pub(crate) owed: Option<smc_proto::clc_stream::OwedAnswer>,
}

#[cfg(feature = "tokio")]
impl SmcStream {
    /// The connection's parts, for the tokio adapter (takes the pending bytes,
    /// which other handles of the connection then no longer see).
    pub(crate) fn into_parts(self) -> Parts {
        let ahead = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let (pending, owed) = ahead.into_parts();
        Parts {
            tcp: self.tcp,
            mode: self.mode,
            smc: self.smc,
            pending,
            owed,
        }
    }

    /// A stream from its parts (the TCP socket in blocking mode).
    pub(crate) fn from_parts(p: Parts) -> SmcStream {
        SmcStream {
            tcp: p.tcp,
            mode: p.mode,
            smc: p.smc,
            pending: Arc::new(Mutex::new(ahead::Ahead::new(p.pending, p.owed))),
            opts: Arc::new(Opts::default()),
        }
    }

    /// The SMC-R connection `conn` on `tcp` as a stream in non-blocking
    /// mode, for the tokio adapter, whose reads and writes take the fast
    /// path through it and wait in the reactor: the TCP socket's own mode
    /// is left as it is (other handles share it).
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

    /// A peek of the whole length (`peek_all_with`, as `recv(MSG_PEEK |
    /// MSG_WAITALL)`) waits until all of it has come and takes nothing;
    /// without waiting, or at the end of the stream, it returns what there
    /// is.
    #[test]
    fn a_peek_of_the_whole_length_waits_for_all_of_it() {
        let _one = serial();
        let (mut c, s) = smc_pair();
        c.write_all(b"ab").unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        while s.readable_bytes() != Some(2) {
            assert!(Instant::now() < end, "the first bytes arrive");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut b = [0u8; 5];
        assert_eq!(s.peek_all_with(&mut b, true).unwrap().unwrap(), 2);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                (&c).write_all(b"cde").unwrap();
            });
            assert_eq!(s.peek_all_with(&mut b, false).unwrap().unwrap(), 5);
        });
        assert_eq!(&b, b"abcde");
        assert_eq!(s.readable_bytes(), Some(5), "a peek takes nothing");
        c.shutdown(Shutdown::Write).unwrap();
        // at the end of the stream: what there is
        let mut b = [0u8; 8];
        assert_eq!(s.peek_all_with(&mut b, false).unwrap().unwrap(), 5);
    }

    /// A write of nothing says whether the connection can be written, as
    /// TCP's does: 0, also to a peer that shut its own writing down;
    /// `BrokenPipe` after our own shutdown of writing.
    #[test]
    fn a_write_of_nothing_says_our_shutdown_of_writing() {
        let _one = serial();
        let (c, s) = smc_pair();
        assert_eq!(c.write_with(&[], true).unwrap(), 0);
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(
            c.write_with(&[], true).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
        let mut b = [0u8; 1];
        assert_eq!((&s).read(&mut b).unwrap(), 0, "the peer's end of file");
        assert_eq!(s.write_with(&[], true).unwrap(), 0, "half closed");
    }
}
