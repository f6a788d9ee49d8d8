//! `listen()`, `accept()`, `accept4()`: the listener of an opted-in socket.

use super::*;

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let real_listen = real!(listen: fn(c_int, c_int) -> c_int);
    let Some(Entry::Fresh { opted, bufs }) = get(fd) else {
        // SAFETY: the caller's arguments, unchanged (so for every call below).
        return unsafe { real_listen(fd, backlog) };
    };
    // (before the real listen: a SYN may come at once; an unbound socket
    // has port 0 here, and gets a port no list names)
    let port = rustix::net::getsockname(borrow(fd))
        .ok()
        .and_then(|a| SocketAddr::try_from(a).ok())
        .map_or(0, |a| a.port());
    let selected = selected(fd, opted, selection().listen(port));
    // SAFETY: as above.
    let r = unsafe { real_listen(fd, backlog) };
    let opted = match selected {
        Ok(opted) => opted,
        Err(list) => {
            if r == 0 {
                report_unselected("listen", fd, None, list);
            }
            return r;
        }
    };
    if r != 0 {
        return r;
    }
    if !opted {
        drop(remove(fd));
        return r;
    }
    // (its driver starts at the first accept or poll: see Entry::Passive)
    drop(insert(fd, Entry::Passive(bufs)));
    if let Ok(at) = rustix::net::getsockname(borrow(fd)) {
        if let Ok(at) = SocketAddr::try_from(at) {
            let mut w = lock(&WAITING);
            w.retain(|&(f, _, _)| f != fd);
            w.push((fd, at, crate::lifecycle::forks()));
            WAITING_N.store(w.len(), Ordering::Release);
        }
    }
    r
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's listening sockets, with their addresses, whose
/// handshakes wait for the program's first accept or poll
/// ([`Entry::Passive`]). Kept from `listen()` on; an entry whose descriptor
/// no longer is such a socket is passed over (and dropped).
/// (With the fork count at its `listen()`, see `rescue.rs`.)
static WAITING: Mutex<Vec<(RawFd, SocketAddr, u64)>> = Mutex::new(Vec::new());

/// Entries in [`WAITING`] (a look without its lock).
static WAITING_N: AtomicUsize = AtomicUsize::new(0);

/// A connect of this process to `to`, about to be made: one of the
/// process's own listening sockets that has not been used yet would take
/// it, so that socket's listener starts now and runs the handshakes in its
/// driver thread, as an event-driven server's does. Otherwise the program,
/// blocked in this connect until the server's side of the handshake
/// answers, would wait for itself until the client gives up (a program
/// that connects to its own listener before it accepts, as test suites and
/// socket-pair emulations do; TCP completes such a connect in the kernel).
/// (Not a listener in use already: a thread may be blocked in the kernel's
/// `accept` on it, [`Entry::LazyListener`], which a driver would race for
/// the connection; that thread's first use of the connection runs its
/// handshake, or the library's rescue of the queue, `rescue.rs`, when the
/// connection waits there.)
pub(crate) fn serve_own(to: SocketAddr) {
    if WAITING_N.load(Ordering::Acquire) == 0 {
        return;
    }
    let same = |at: SocketAddr| {
        let canon = |ip: std::net::IpAddr| match ip {
            std::net::IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
            v4 => v4,
        };
        at.port() == to.port() && (at.ip().is_unspecified() || canon(at.ip()) == canon(to.ip()))
    };
    let fds: Vec<RawFd> = {
        let mut w = lock(&WAITING);
        w.retain(|&(fd, _, _)| matches!(get_raw(fd), Some(Entry::Passive(_))));
        WAITING_N.store(w.len(), Ordering::Release);
        w.iter()
            .filter(|&&(_, at, _)| same(at))
            .map(|&(fd, _, _)| fd)
            .collect()
    };
    for fd in fds {
        let _one = lock(&ONE);
        let bufs = match get_raw(fd) {
            Some(Entry::Passive(_)) if was_inherited(fd) && !smc::is_opted_in(borrow(fd)) => {
                // (as `activate`: the kernel serves it)
                drop(remove(fd));
                continue;
            }
            Some(Entry::Passive(b)) => b,
            _ => continue,
        };
        let flags = real_fcntl(fd, libc::F_GETFL, 0);
        start_listener(fd, bufs, flags >= 0 && flags & libc::O_NONBLOCK != 0);
    }
}

/// One listener started at a time ([`activate`], [`serve_own`]).
static ONE: Mutex<()> = Mutex::new(());

/// Starts the listener of a listening socket (Entry::Passive) on its first
/// use; the entry `fd` has then.
pub(crate) fn activate(fd: RawFd) -> Option<Entry> {
    let _one = lock(&ONE);
    let Some(Entry::Passive(bufs)) = get(fd) else {
        return get(fd);
    };
    if was_inherited(fd) && !smc::is_opted_in(borrow(fd)) {
        // (its SYN-ACKs carry no SMC option: the kernel serves it)
        drop(remove(fd));
        return None;
    }
    restore_env();
    let flags = real_fcntl(fd, libc::F_GETFL, 0);
    let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
    if !nonblock {
        crate::table::keep_spare();
        // (its connections are made at their first use, see
        // Entry::LazyListener; those nobody accepts are the rescue's)
        let forks = lock(&WAITING)
            .iter()
            .find(|&&(f, _, _)| f == fd)
            .map(|&(_, _, n)| n);
        let r = forks.and_then(|n| crate::rescue::start(fd, n));
        let e = Entry::LazyListener(bufs, r);
        drop(insert(fd, e.clone()));
        return Some(e);
    }
    start_listener(fd, bufs, nonblock)
}

/// Starts the listener (and its driver thread) of listening socket `fd`
/// (opted in; the application's `nonblock`), in `fd`'s entry from now on.
fn start_listener(fd: RawFd, bufs: Bufs, nonblock: bool) -> Option<Entry> {
    USED.store(true, Ordering::Release);
    match dup_own(fd).and_then(|own| SmcListener::from_listening(TcpListener::from(own), true)) {
        Ok(l) => {
            let _ = l.set_nonblocking(nonblock);
            let l = Arc::new(Lst {
                l,
                nonblock: AtomicBool::new(nonblock),
            });
            l.l.set_buffer_sizes(bufs.0, bufs.1);
            drop(insert(fd, Entry::Listener(l.clone())));
            Some(Entry::Listener(l))
        }
        Err(e) => {
            if debug() {
                eprintln!("libsmc-preload: listener on fd {fd} stays TCP: {e}");
            }
            drop(remove(fd));
            None
        }
    }
}

/// `fd`'s entry, a listener started if it is one.
pub(crate) fn get_active(fd: RawFd) -> Option<Entry> {
    match get(fd)? {
        Entry::Passive(_) => activate(fd),
        e => Some(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let real_accept4 = real!(accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int);
    let l = match get_active(fd) {
        Some(Entry::Listener(l)) => l,
        Some(Entry::LazyListener(bufs, r)) => {
            let (nfd, settled) = match r {
                // SAFETY: the caller's arguments, unchanged.
                Some(r) => unsafe { crate::rescue::accept_of(&r, fd, addr, len, flags) },
                // SAFETY: as above.
                None => (unsafe { real_accept4(fd, addr, len, flags) }, false),
            };
            if nfd >= 0 && !settled {
                accepted_lazily(nfd, bufs);
            }
            return nfd;
        }
        // SAFETY: the caller's arguments, unchanged.
        _ => return unsafe { real_accept4(fd, addr, len, flags) },
    };
    let (s, peer) = match l.l.accept() {
        Ok(x) => x,
        Err(e) => return fail(&e),
    };
    let cmd = if flags & libc::SOCK_CLOEXEC != 0 {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    let nfd = real_fcntl(s.tcp_fd().as_raw_fd(), cmd, 0);
    if nfd < 0 {
        // (no descriptor for it, EMFILE: it waits for the next accept, as
        // a TCP connection waits in the kernel's queue; dropped, its client
        // would read end of file)
        let e = errno();
        l.l.unaccept(s, peer);
        set_errno(e);
        return nfd;
    }
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    // (the file's O_NONBLOCK, shared with the library's duplicate)
    let _ = s.set_nonblocking(nonblock);
    // SAFETY: the caller's address buffer and its length.
    unsafe { write_sockaddr(peer, addr, len) };
    report("accept", &s);
    adopt(nfd, s, nonblock);
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { accept4(fd, addr, len, 0) }
}

/// A connection `accept()` took from a lazy listener (see
/// [`Entry::LazyListener`]): one whose client offered SMC gets its handshake
/// at its first use; the others are plain TCP, the kernel's.
fn accepted_lazily(nfd: RawFd, bufs: Bufs) {
    let own = match dup_own(nfd) {
        Ok(o) => o,
        Err(e) => {
            // Out of descriptors for a handle of the library's: the
            // connection is made plain TCP on the reserve descriptor (the
            // client, if it offered SMC, is declined and falls back), as
            // TCP serves a program at its limit; a program that holds
            // fewer SMC-R connections than TCP ones there still has every
            // connection it accepts.
            let plain = crate::table::with_spare(|| {
                let own = dup_own(nfd).ok()?;
                match smc::deferred::classify(TcpStream::from(own), true) {
                    smc::deferred::Deferred::Ready(s) => {
                        report("accept", &s);
                        Some(())
                    }
                    smc::deferred::Deferred::Pending(p) => p.decline().ok().map(drop),
                }
            });
            if plain.is_none() {
                // (without a handle the library cannot take the handshake;
                // the client's Proposal would be read as data)
                if debug() {
                    eprintln!("libsmc-preload: accepted fd {nfd} shut down: {e}");
                }
                let _ = rustix::net::shutdown(borrow(nfd), rustix::net::Shutdown::Both);
            }
            return;
        }
    };
    match smc::deferred::classify(TcpStream::from(own), true) {
        smc::deferred::Deferred::Ready(s) => {
            report("accept", &s);
            // (plain TCP with nothing read ahead: left to the kernel)
            drop(s);
        }
        smc::deferred::Deferred::Pending(mut p) => {
            p.set_buffer_sizes(bufs.0, bufs.1);
            let l = Lazy {
                pending: Mutex::new(Some(p)),
                done: OnceLock::new(),
            };
            let l = Arc::new(l);
            drop(insert(nfd, Entry::Lazy(l.clone())));
            crate::late::watch(&l);
        }
    }
}

/// The first use of `fd`, an accepted connection whose handshake was left
/// for it (see [`Lazy`]): runs the handshake (the first of the descriptors
/// sharing `l` to get here does, unless the library's thread for unused
/// connections did, `late.rs`), and puts the outcome in `fd`'s place.
pub(crate) fn first_use(fd: RawFd, l: &Arc<Lazy>) -> Option<Entry> {
    {
        let mut p = l.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pending) = p.take() {
            let conn = match settle(pending, borrow(fd)) {
                Ok(c) => c,
                Err(e) => {
                    // Another process that shares the socket (a fork) took
                    // the connection first: it is gone here, not there.
                    if debug() {
                        eprintln!("libsmc-preload: fd {fd}: {e}");
                    }
                    exec::stand_in(fd);
                    None
                }
            };
            let _ = l.done.set(conn);
        }
    }
    match l.done.get().cloned().flatten() {
        Some(c) => {
            drop(insert(fd, Entry::Stream(c.clone())));
            Some(Entry::Stream(c))
        }
        None => {
            drop(remove(fd));
            None
        }
    }
}

/// Runs the handshake of `pending`, an accepted connection's, in the
/// calling thread (blocking, at most the CLC timeouts): the connection for
/// the table, or none (plain TCP, the kernel's; or a handshake that failed,
/// whose socket, `shut`, is shut down: the program reads end of file, as
/// from a client that gave up, where the listener's driver would have
/// closed it before `accept()` returned it). `Err`: another process sharing
/// the socket (a fork) took the connection (`NotConnected`).
pub(crate) fn settle(
    pending: smc::deferred::PendingSmc,
    shut: BorrowedFd<'_>,
) -> io::Result<Option<Arc<Conn>>> {
    // (the application's O_NONBLOCK, set on the shared file meanwhile or
    // at accept4)
    let fl = rustix::fs::fcntl_getfl(pending.tcp_fd());
    let nonblock = fl.is_ok_and(|f| f.contains(rustix::fs::OFlags::NONBLOCK));
    match pending.handshake() {
        Ok(s) => {
            report("accept", &s);
            let c = carried(s, nonblock);
            if c.is_some() {
                USED.store(true, Ordering::Release);
            }
            Ok(c)
        }
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Err(e),
        Err(e) => {
            if debug() {
                eprintln!("libsmc-preload: accepted connection: {e}");
            }
            let _ = rustix::net::shutdown(shut, rustix::net::Shutdown::Both);
            Ok(None)
        }
    }
}
