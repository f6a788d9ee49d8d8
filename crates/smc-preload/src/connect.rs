//! `connect()`, blocking and non-blocking (the library's connect thread).

use super::*;

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let real_connect = real!(connect: fn(c_int, *const sockaddr, socklen_t) -> c_int);
    let Some(Entry::Fresh { opted, bufs }) = get(fd) else {
        // SAFETY: the caller's arguments, unchanged.
        let r = unsafe { real_connect(fd, addr, len) };
        // SAFETY: the caller's address, if of a family's size at least.
        let unspec = !addr.is_null()
            && len as usize >= std::mem::size_of::<libc::sa_family_t>()
            && c_int::from(unsafe { (*addr).sa_family }) == libc::AF_UNSPEC;
        if r == 0 && unspec {
            disconnected(fd);
        }
        return r;
    };
    // SAFETY: the caller's address of `len` bytes.
    let Some(to) = (unsafe { sockaddr_of(addr, len) }) else {
        drop(remove(fd));
        // SAFETY: as above.
        return unsafe { real_connect(fd, addr, len) };
    };
    let opted = match selected(fd, opted, selection().connect(to)) {
        Ok(opted) => opted,
        Err(list) => {
            // SAFETY: as above.
            let r = unsafe { real_connect(fd, addr, len) };
            let e = errno();
            report_unselected("connect", fd, Some(to), list);
            set_errno(e);
            return r;
        }
    };
    USED.store(true, Ordering::Release);
    restore_env();
    if opted {
        crate::listen::serve_own(to);
    }
    let flags = real_fcntl(fd, libc::F_GETFL, 0);
    let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
    // SAFETY: as above.
    let r = unsafe { real_connect(fd, addr, len) };
    if r != 0 {
        let e = errno();
        if nonblock && e == libc::EINPROGRESS {
            connect_in_background(fd, opted, bufs);
        }
        set_errno(e);
        return r;
    }
    // Connected at once (a blocking socket): the handshake follows, blocking.
    if nonblock {
        real_fcntl(fd, libc::F_SETFL, (flags & !libc::O_NONBLOCK) as c_ulong);
    }
    let made = dup_own(fd).and_then(|own| {
        SmcStream::from_connected_sized(TcpStream::from(own), opted, bufs.0, bufs.1)
    });
    let s = match made {
        Ok(s) => s,
        Err(e) => {
            // The TCP connection stands, its handshake failed: shut down,
            // as a failed non-blocking connect's (`connect_thread`), so that
            // a program that reads it anyway finds no CLC bytes there.
            let _ = rustix::net::shutdown(borrow(fd), rustix::net::Shutdown::Both);
            drop(remove(fd));
            if nonblock {
                real_fcntl(fd, libc::F_SETFL, flags as c_ulong);
            }
            return fail(&e);
        }
    };
    report("connect", &s);
    if nonblock {
        real_fcntl(fd, libc::F_SETFL, flags as c_ulong);
    }
    adopt(fd, s, nonblock);
    0
}

/// A connected socket was disconnected (`connect` to `AF_UNSPEC`, which the
/// kernel did): its SMC-R connection ends with an abort, as the kernel
/// reset the TCP one (tcp.c `tcp_disconnect`), and the socket may connect
/// again, with SMC-R if it is opted in. (Without this the socket's next
/// connection would carry its data over the old one, to the old peer.)
fn disconnected(fd: RawFd) {
    if let Some(Entry::Stream(c)) = get(fd) {
        c.s.abort();
        let opted = smc::is_opted_in(borrow(fd));
        let old = insert(
            fd,
            Entry::Fresh {
                opted,
                bufs: (None, None),
            },
        );
        drop(old);
    }
}

/// After a non-blocking connect's `EINPROGRESS`: the rest runs in a thread
/// (see [`Pend`]). If that cannot start, the socket is left to the kernel
/// (plain TCP: the peer declines or times out its handshake).
pub(crate) fn connect_in_background(fd: RawFd, opted: bool, bufs: Bufs) {
    let started = (|| -> io::Result<()> {
        let own = dup_own(fd)?;
        let (user, ctl) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            None,
        )?;
        let (user, ctl) = (dup_own(user.as_raw_fd())?, dup_own(ctl.as_raw_fd())?);
        // (the kernel raises it to its minimum; one datagram then fills it)
        rustix::net::sockopt::set_socket_send_buffer_size(&user, 1)?;
        rustix::net::send(&user, &[0u8; 1024], rustix::net::SendFlags::empty())?;
        let p = Arc::new(Pend {
            user,
            ctl,
            reg: Mutex::new(Some(Vec::new())),
        });
        drop(insert(fd, Entry::Connecting(p.clone())));
        let t = std::thread::Builder::new()
            .name("smc-connect".into())
            .spawn(move || connect_thread(fd, own, opted, bufs, p));
        if let Err(e) = t {
            drop(remove(fd));
            return Err(e);
        }
        Ok(())
    })();
    if let Err(e) = started {
        if debug() {
            eprintln!("libsmc-preload: connect on fd {fd} stays TCP: {e}");
        }
        drop(remove(fd));
    }
}

pub(crate) fn connect_thread(fd: RawFd, own: OwnedFd, opted: bool, bufs: Bufs, p: Arc<Pend>) {
    let mut pfd = [rustix::event::PollFd::new(
        &own,
        rustix::event::PollFlags::OUT,
    )];
    while let Err(rustix::io::Errno::INTR) = rustix::event::poll(&mut pfd, None) {}
    // (getpeername rather than SO_ERROR: the error stays for the application)
    let connected = rustix::net::getpeername(&own).is_ok();
    let made = if connected {
        // the handshake runs blocking (the file's flag, the application's
        // socket's too: its calls meanwhile are answered by the library)
        let _ = rustix::io::ioctl_fionbio(&own, false);
        Some(SmcStream::from_connected_sized(
            TcpStream::from(own),
            opted,
            bufs.0,
            bufs.1,
        ))
    } else {
        drop(own);
        None
    };
    let mut reg = p.reg.lock().unwrap_or_else(|e| e.into_inner());
    let ours = matches!(get(fd), Some(Entry::Connecting(q)) if Arc::ptr_eq(&p, &q));
    if !ours {
        // closed meanwhile: `made` goes with the thread
        *reg = None;
        drop(reg);
        let _ = rustix::net::recv(&p.ctl, &mut [0u8; 1024], rustix::net::RecvFlags::DONTWAIT);
        return;
    }
    // The application's registrations move from the connect's descriptor
    // to what now stands for the socket before the socket's new entry is
    // published: meanwhile the application's `epoll_ctl` on it waits for
    // `reg` (its entry still says connecting), so that none of its
    // operations lands before the move's, which would undo it.
    let registrations = reg.take().unwrap_or_default();
    let real_ctl = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    let move_to = |target: c_int, c: Option<&Arc<Conn>>| {
        for (ep, mut ev) in registrations.iter().copied() {
            // SAFETY: epoll_ctl on the application's epoll set with an
            // event of our own; `user` and `target` are open.
            unsafe {
                real_ctl(
                    ep,
                    libc::EPOLL_CTL_DEL,
                    p.user.as_raw_fd(),
                    std::ptr::null_mut(),
                );
                match c {
                    Some(c) => {
                        crate::interest::conn_ctl(c, ep, libc::EPOLL_CTL_ADD, target, &mut ev)
                    }
                    None => real_ctl(ep, libc::EPOLL_CTL_ADD, target, &mut ev),
                };
            }
        }
    };
    match made {
        Some(Ok(s)) => {
            report("connect", &s);
            // (the application's O_NONBLOCK, also after a fallback)
            let _ = s.set_nonblocking(true);
            match carried(s, true) {
                Some(c) => {
                    let r = c.s.readiness_fd().map_or(fd, |r| r.as_raw_fd());
                    move_to(r, Some(&c));
                    drop(insert(fd, Entry::Stream(c)));
                }
                None => {
                    move_to(fd, None);
                    drop(remove(fd));
                }
            }
        }
        Some(Err(e)) => {
            // a failed handshake ends the connection, as a reset would,
            // and SO_ERROR says why
            if debug() {
                eprintln!("libsmc-preload: connect on fd {fd}: handshake failed: {e}");
            }
            drop(insert(fd, Entry::Failed(errno_of(&e))));
            let _ = rustix::io::ioctl_fionbio(borrow(fd), true);
            let _ = rustix::net::shutdown(borrow(fd), rustix::net::Shutdown::Both);
            move_to(fd, None);
        }
        None => {
            move_to(fd, None);
            drop(remove(fd));
        }
    }
    drop(reg);
    // pollers wake up, and look again
    let _ = rustix::net::recv(&p.ctl, &mut [0u8; 1024], rustix::net::RecvFlags::DONTWAIT);
}

/// Carries `s` on the application's `fd`, or leaves it to the kernel if it
/// is plain TCP with nothing read ahead.
pub(crate) fn adopt(fd: RawFd, s: SmcStream, nonblock: bool) {
    match carried(s, nonblock) {
        Some(c) => drop(insert(fd, Entry::Stream(c))),
        None => drop(remove(fd)),
    }
}

/// `s` as the library carries it (in `nonblock` mode), or `None` if it is
/// plain TCP with nothing read ahead and no server's answer to take off its
/// stream (`SmcStream::answer_owed`): the kernel's (dropping `s` closes the
/// library's duplicate only).
pub(crate) fn carried(s: SmcStream, nonblock: bool) -> Option<Arc<Conn>> {
    if s.mode() != Mode::SmcR && !s.has_pending() && !s.answer_owed() {
        return None;
    }
    let _ = s.set_nonblocking(nonblock);
    crate::sockopt::take_timeouts(&s, true);
    crate::sockopt::take_linger(&s);
    crate::sockopt::take_oob_inline(&s);
    Some(Arc::new(Conn::new(s)))
}
