//! `listen()`, `accept()`, `accept4()`: the listener of an opted-in socket.

use super::*;

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let real_listen = real!(listen: fn(c_int, c_int) -> c_int);
    let Some(Entry::Fresh { opted }) = get(fd) else {
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
    drop(insert(fd, Entry::Passive));
    r
}

/// Starts the listener of a listening socket (Entry::Passive) on its first
/// use; the entry `fd` has then.
pub(crate) fn activate(fd: RawFd) -> Option<Entry> {
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(Entry::Passive) = get(fd) else {
        return get(fd);
    };
    if was_inherited(fd) && !smc::is_opted_in(borrow(fd)) {
        // (its SYN-ACKs carry no SMC option: the kernel serves it)
        drop(remove(fd));
        return None;
    }
    USED.store(true, Ordering::Release);
    restore_env();
    let flags = real_fcntl(fd, libc::F_GETFL, 0);
    let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
    match dup_own(fd).and_then(|own| SmcListener::from_listening(TcpListener::from(own), true)) {
        Ok(l) => {
            let _ = l.set_nonblocking(nonblock);
            let l = Arc::new(Lst {
                l,
                nonblock: AtomicBool::new(nonblock),
            });
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
        Entry::Passive => activate(fd),
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
    let Some(Entry::Listener(l)) = get_active(fd) else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe {
            real!(accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int)(
                fd, addr, len, flags,
            )
        };
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
