//! The table of the descriptors the library carries (connections, listeners,
//! connects in progress) and the errno helpers every call uses.

use super::*;

/// A connection the library carries.
pub(crate) struct Conn {
    pub(crate) s: SmcStream,
    /// Bytes read ahead for `MSG_PEEK` and `FIONREAD`, delivered first.
    pub(crate) peeked: Mutex<Vec<u8>>,
    /// The connection's registrations in the application's epoll sets
    /// (its peer signal's and its readiness descriptor's).
    pub(crate) regs: Mutex<Regs>,
    /// A registration of the connection's signal is not in the map of
    /// signals by (set, data) (`poll.rs`, `SIGNALLED`): its entry went when
    /// a descriptor that is not a connection was given its data, or it asks
    /// for no events (`poll::list_signal`). Its next registration change
    /// under the same data puts it back.
    pub(crate) unlisted: std::sync::atomic::AtomicBool,
    /// The connection's reset or abort was reported (by a read, a write or
    /// `SO_ERROR`): as a TCP socket's `sk_err`, it is reported once, and
    /// then reads find end of file, writes `EPIPE`, and `poll` no
    /// `POLLERR` (`Conn::report_once`).
    pub(crate) err_taken: std::sync::atomic::AtomicBool,
    /// The connection was open at a `fork()`: a child may wait on its
    /// peer signal with `poll`, level-triggered (`share.rs`), so the signal
    /// is drained whenever it is armed again (`poll::signal_mode`).
    pub(crate) forked: std::sync::atomic::AtomicBool,
}

/// A connection's registrations in the application's epoll sets.
#[derive(Default)]
pub(crate) struct Regs {
    /// The sets that have the connection's peer signal registered beside
    /// its readiness descriptor, with the events and data it is registered
    /// with there (`poll::signal_ctl`), and whether the kernel has it
    /// edge-triggered where the application asked for level
    /// (`poll::edge_here`).
    pub(crate) sig: Vec<(c_int, u32, u64, bool)>,
    /// The sets the application registered the connection in, with what
    /// it asked for and what the readiness descriptor is registered with
    /// (`interest.rs`).
    pub(crate) rdy: Vec<crate::interest::Rdy>,
}

impl Conn {
    pub(crate) fn new(s: SmcStream) -> Conn {
        // (a reset or abort after the peer's close as TCP reports them)
        s.report_errors_as_tcp();
        Conn {
            s,
            peeked: Mutex::new(Vec::new()),
            regs: Mutex::new(Regs::default()),
            unlisted: std::sync::atomic::AtomicBool::new(false),
            err_taken: std::sync::atomic::AtomicBool::new(false),
            forked: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether the connection is reset or aborted, its error not yet
    /// reported ([`Conn::err_taken`]): what `POLLERR` shows.
    pub(crate) fn error_pending(&self) -> bool {
        !self.err_taken.load(Ordering::Acquire) && crate::poll::failed(self)
    }

    /// A read's or write's error `e` as TCP reports its `sk_err`: once (the
    /// first report is marked, [`Conn::err_taken`]); after that `None`: a
    /// read finds end of file, a write `EPIPE` (net/core/sock.c
    /// `sock_error` takes the error; tcp.c `tcp_recvmsg_locked` then stops
    /// at the closed socket, `tcp_sendmsg_locked` fails with `EPIPE`).
    /// Other errors pass as they are.
    pub(crate) fn report_once(&self, e: io::Error) -> Option<io::Error> {
        if self.is_failure(&e) && self.err_taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(e)
    }

    /// Whether a write that failed with `e` is TCP's first write after the
    /// peer's close, which succeeds: the connection then takes the reset
    /// the write draws (`SmcStream::reset_by_write`), where an SMC socket
    /// fails it (`ECONNRESET` after the peer's close, `EPIPE` once its
    /// process went away after it).
    pub(crate) fn draws_reset(&self, e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        ) && self.s.reset_by_write()
    }

    /// Whether `e`, from a call on the connection, is its failure (TCP's
    /// `sk_err`) rather than a call's own error: a reset, an abort, or
    /// `EPIPE` when the connection shows it failed (the reset a write after
    /// the peer's close drew, `SmcStream::reset_by_write`; else `EPIPE` is
    /// a shutdown's, no `sk_err`).
    pub(crate) fn is_failure(&self, e: &io::Error) -> bool {
        match e.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => true,
            io::ErrorKind::BrokenPipe => crate::poll::failed(self),
            _ => false,
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // An epoll set keeps a registration while its descriptor is open
        // anywhere, and the signal's descriptor is the connection's own
        // duplicate, closed with it: out of the sets first, so that they
        // do not report it under the application's data after its close.
        let regs = std::mem::take(self.regs.get_mut().unwrap_or_else(|e| e.into_inner()));
        crate::interest::forget(self, &regs.rdy);
        let sets = regs.sig;
        if sets.is_empty() {
            return;
        }
        crate::poll::forget_signalled(self, &sets);
        if let Some(sfd) = self.s.signal_fd() {
            for (ep, _, _, _) in sets {
                // (a set closed meanwhile fails harmlessly)
                ctl_own(ep, libc::EPOLL_CTL_DEL, sfd.as_raw_fd(), 0, 0);
            }
        }
    }
}

/// A listener the library carries.
pub(crate) struct Lst {
    pub(crate) l: SmcListener,
    /// The application's `O_NONBLOCK` (the socket itself stays non-blocking
    /// for the listener's driver).
    pub(crate) nonblock: AtomicBool,
}

/// The SMC buffer sizes a program asked of a socket with
/// `setsockopt(SO_RCVBUF/SO_SNDBUF)` before its connect or listen (RMB,
/// send buffer; `None`: not asked), as Linux sizes an AF_SMC socket's by
/// them (smc_core.c `__smc_buf_create`).
pub(crate) type Bufs = (Option<usize>, Option<usize>);

#[derive(Clone)]
pub(crate) enum Entry {
    /// A TCP socket not yet connected or listening, and whether it is opted
    /// in to the SMC option.
    Fresh {
        opted: bool,
        bufs: Bufs,
    },
    /// A listening socket opted in to SMC whose listener (and its driver
    /// thread, which accepts and runs the handshakes) starts at the first
    /// `accept` or poll of it: a server that listens and then forks its
    /// workers (nginx's master) has not used the library before the fork,
    /// so each worker runs its own listener on the shared socket (see
    /// [`USED`]).
    Passive(Bufs),
    Stream(Arc<Conn>),
    Listener(Arc<Lst>),
    /// A listening socket opted in to SMC that was in blocking mode at its
    /// first use: `accept()` takes its connections from the kernel in the
    /// caller's thread, each with its handshake still to run ([`Entry::Lazy`]),
    /// so that a server that forks a process per connection has the
    /// handshake run in that process (see `smc::deferred`). Event-driven
    /// servers (non-blocking listeners) keep the listener's driver, which
    /// runs handshakes at once without holding up their loop. With the
    /// library's rescue of connections that wait in its queue, unless the
    /// socket is shared with another process
    /// (`rescue.rs`).
    LazyListener(Bufs, Option<Arc<crate::rescue::Rescue>>),
    /// An accepted connection whose client offered SMC, its handshake to run
    /// at its first use in whichever process (see [`Lazy`]); no lookup
    /// returns it ([`get`] runs the handshake).
    Lazy(Arc<Lazy>),
    /// A non-blocking `connect()` in progress (see [`Pend`]).
    Connecting(Arc<Pend>),
    /// In a forked child: an SMC-R connection its parent owns and serves
    /// for it (see `share.rs`).
    Remote(Arc<crate::share::Remote>),
    /// A non-blocking `connect()` whose handshake failed: the socket is shut
    /// down, and `getsockopt(SO_ERROR)` returns this errno once.
    Failed(c_int),
}

/// An accepted connection whose handshake runs at its first use (see
/// [`Entry::LazyListener`]): every call on it but `close` looks it up, and
/// the first lookup runs the handshake (blocking, at most the CLC
/// timeouts) and puts the connection in its place; descriptors duplicated
/// before share it and take the same outcome at their next lookup.
pub(crate) struct Lazy {
    pub(crate) pending: Mutex<Option<smc::deferred::PendingSmc>>,
    /// The outcome: the connection, or none (plain TCP, or a failed
    /// handshake whose socket is shut down).
    pub(crate) done: OnceLock<Option<Arc<Conn>>>,
}

impl Lazy {
    /// Whether its handshake ran (or it was given up).
    pub(crate) fn is_settled(&self) -> bool {
        self.done.get().is_some()
    }
}

/// A non-blocking `connect()` that returned `EINPROGRESS`: a thread of the
/// library waits for the TCP connection and runs the CLC handshake on it
/// (which must not wait for the application: the client speaks first, and
/// an application may wait for the server to speak), then puts the
/// connection in the table (SMC-R) or leaves the socket to the kernel (the
/// TCP connect failed, or fell back).
///
/// Meanwhile `poll`, `select` and `epoll` see `user`, an `AF_UNIX`
/// datagram socket that is neither readable nor writable (one datagram
/// from it to `ctl` fills its minimal send buffer, af_unix.c
/// `unix_writable`) until the thread is done, when it turns writable. The
/// epoll sets it was registered in move to the connection's own descriptor
/// (its readiness descriptor, or the TCP socket after a fallback or a
/// failed connect, where the kernel then shows `EPOLLERR`/`EPOLLHUP` and
/// `SO_ERROR` as for any TCP socket) before that, so an edge-triggered set
/// gets its edge from the connection's descriptor.
pub(crate) struct Pend {
    pub(crate) user: OwnedFd,
    pub(crate) ctl: OwnedFd,
    /// `(epoll fd, event)` of each epoll set holding `user`; `None` once
    /// the thread is done (the table has the connection's entry then).
    pub(crate) reg: Mutex<Option<Vec<(RawFd, libc::epoll_event)>>>,
}

/// What a read or write on `fd` goes to.
pub(crate) enum Io {
    Smc(Arc<Conn>),
    /// A connection the parent owns (in a forked child).
    Remote(Arc<crate::share::Remote>),
    /// A non-blocking connect in progress: `EAGAIN`, as TCP before the
    /// connection is established.
    Busy,
    Kernel,
}

pub(crate) fn io(fd: RawFd) -> Io {
    match get(fd) {
        Some(Entry::Stream(c)) => Io::Smc(c),
        Some(Entry::Remote(r)) => Io::Remote(r),
        Some(Entry::Connecting(_)) => Io::Busy,
        _ => Io::Kernel,
    }
}

pub(crate) fn busy<T: From<i8>>() -> T {
    set_errno(libc::EAGAIN);
    T::from(-1)
}

pub(crate) static TABLE: RwLock<FdMap> = RwLock::new(FdMap::new());

/// The table's entries, indexed by descriptor number: every interposed call
/// looks its descriptor up (an event loop makes several calls per request,
/// on as many connections as it serves), and an index costs no walk.
/// Grows to the highest descriptor it held (the kernel hands out the
/// lowest free number, so about as many slots as the process has
/// descriptors open).
#[derive(Default)]
pub(crate) struct FdMap {
    slots: Vec<Option<Entry>>,
    len: usize,
}

impl FdMap {
    pub(crate) const fn new() -> FdMap {
        FdMap {
            slots: Vec::new(),
            len: 0,
        }
    }

    pub(crate) fn get(&self, fd: RawFd) -> Option<&Entry> {
        let i = usize::try_from(fd).ok()?;
        self.slots.get(i)?.as_ref()
    }

    /// Sets `fd`'s entry; the one it replaces. (A negative number, which
    /// no call hands the table, is not kept.)
    pub(crate) fn insert(&mut self, fd: RawFd, e: Entry) -> Option<Entry> {
        let i = usize::try_from(fd).ok()?;
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        let old = self.slots[i].replace(e);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    pub(crate) fn remove(&mut self, fd: RawFd) -> Option<Entry> {
        let i = usize::try_from(fd).ok()?;
        let old = self.slots.get_mut(i)?.take();
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The entries in descriptor order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (RawFd, &Entry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, e)| Some((i as RawFd, e.as_ref()?)))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (RawFd, &mut Entry)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, e)| Some((i as RawFd, e.as_mut()?)))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.slots.iter().flatten()
    }

    /// Keeps the entries `f` says to keep (the others are dropped here).
    pub(crate) fn retain(&mut self, mut f: impl FnMut(RawFd, &mut Entry) -> bool) {
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.as_mut().is_some_and(|e| !f(i as RawFd, e)) {
                *s = None;
                self.len -= 1;
            }
        }
    }
}

/// Entries in the table: none, and every call passes straight through.
pub(crate) static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Set once this process made an SMC connection or listener (its engine,
/// threads and endpoint state exist).
pub(crate) static USED: AtomicBool = AtomicBool::new(false);

pub(crate) fn get(fd: RawFd) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    match get_raw(fd) {
        Some(Entry::Lazy(l)) => listen::first_use(fd, &l),
        e => e,
    }
}

/// `fd`'s entry as it is: an [`Entry::Lazy`] stays one (for what does not
/// use the connection: duplicating the descriptor, its file flags).
pub(crate) fn get_raw(fd: RawFd) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(fd)
        .cloned()
}

/// Every SMC-R connection in the table (a scan, for what is rare: an epoll
/// set closed or exposed).
pub(crate) fn streams() -> Vec<Arc<Conn>> {
    TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .filter_map(|e| match e {
            Entry::Stream(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

/// Sets `fd`'s entry; returns the one it replaces (drop it outside the lock).
pub(crate) fn insert(fd: RawFd, e: Entry) -> Option<Entry> {
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let old = t.insert(fd, e);
    COUNT.store(t.len(), Ordering::Release);
    old
}

pub(crate) fn remove(fd: RawFd) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let old = t.remove(fd);
    COUNT.store(t.len(), Ordering::Release);
    old
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

pub(crate) fn errno() -> c_int {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() }
}

/// The errno a socket call would have returned for `e`.
pub(crate) fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::NotConnected => libc::ENOTCONN,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Interrupted => libc::EINTR,
        // (a handshake the peer broke: af_smc.c says EPROTO too)
        io::ErrorKind::InvalidData => libc::EPROTO,
        _ => libc::EIO,
    }
}

pub(crate) fn fail<T: From<i8>>(e: &io::Error) -> T {
    set_errno(errno_of(e));
    T::from(-1)
}

pub(crate) fn borrow<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: only for descriptors the caller passed us, open for the
    // duration of the call that borrows them.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// A duplicate of `fd` (close-on-exec) for the library's own use, numbered
/// in the upper half of the descriptor limit (at most 4096 up) if there is
/// room: programs size their tables by the descriptors they open themselves
/// (wrk's event loop refuses a socket numbered above its size), so the
/// library's stay clear of the low numbers (as the readiness descriptors
/// do).
pub(crate) fn dup_own(fd: RawFd) -> io::Result<OwnedFd> {
    static BASE: OnceLock<RawFd> = OnceLock::new();
    let base = *BASE.get_or_init(|| {
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .map_or(512, |n| (n / 2).clamp(64, 4096)) as RawFd
    });
    rustix::io::fcntl_dupfd_cloexec(borrow(fd), base)
        .or_else(|_| rustix::io::fcntl_dupfd_cloexec(borrow(fd), 0))
        .map_err(io::Error::from)
}

/// One descriptor kept in reserve (open on `/dev/null`), given up for a
/// moment when the process has none left for the library (see
/// [`with_spare`]), as event loops keep one to shed connections at
/// `EMFILE`.
static SPARE: Mutex<Option<OwnedFd>> = Mutex::new(None);

/// Makes the reserve descriptor, unless there is one.
pub(crate) fn keep_spare() {
    let mut s = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    if s.is_none() {
        *s = rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()
        // (out of the way if there is room for that, else where it is)
        .map(|f| dup_own(f.as_raw_fd()).unwrap_or(f));
    }
}

/// Runs `f` with the reserve descriptor given up (its number free for `f`
/// to take), and makes it again after; `None` without one.
pub(crate) fn with_spare<T>(f: impl FnOnce() -> Option<T>) -> Option<T> {
    let mut s = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    s.take()?;
    let r = f();
    drop(s);
    keep_spare();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(e: &Entry) -> Option<c_int> {
        match e {
            Entry::Failed(n) => Some(*n),
            _ => None,
        }
    }

    #[test]
    fn the_fd_map_keeps_one_entry_per_descriptor() {
        let mut m = FdMap::new();
        assert!(m.get(3).is_none() && m.get(-1).is_none() && m.len() == 0);
        assert!(m.insert(7, Entry::Failed(7)).is_none());
        assert!(m.insert(2, Entry::Failed(2)).is_none());
        assert!(m.insert(-4, Entry::Failed(-4)).is_none(), "not kept");
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(7).and_then(failed), Some(7));
        assert!(m.get(3).is_none() && m.get(100).is_none() && m.get(-4).is_none());
        // replaced: the old one comes back, the count stays
        assert_eq!(
            m.insert(7, Entry::Failed(70)).as_ref().and_then(failed),
            Some(7)
        );
        assert_eq!(m.len(), 2);
        let seen: Vec<(RawFd, Option<c_int>)> = m.iter().map(|(fd, e)| (fd, failed(e))).collect();
        assert_eq!(seen, [(2, Some(2)), (7, Some(70))]);
        assert_eq!(m.values().count(), 2);
        for (fd, e) in m.iter_mut() {
            *e = Entry::Failed(fd + 1);
        }
        assert_eq!(m.get(2).and_then(failed), Some(3));
        assert!(m.insert(9, Entry::Failed(0)).is_none());
        m.retain(|fd, _| fd != 2);
        assert_eq!(m.len(), 2);
        assert!(m.get(2).is_none());
        assert_eq!(m.remove(9).as_ref().and_then(failed), Some(0));
        assert!(m.remove(9).is_none() && m.remove(-1).is_none() && m.remove(1000).is_none());
        assert_eq!(m.len(), 1);
        assert_eq!(std::mem::take(&mut m).len(), 1);
        assert_eq!(m.len(), 0);
    }
}
