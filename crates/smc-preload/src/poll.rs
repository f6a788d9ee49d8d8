//! Readiness: `poll`, `ppoll`, `select`, `pselect`, `epoll_ctl`.

use super::*;

/// What a poll on an SMC descriptor waits on instead: its readiness
/// descriptor, and whether a read would return at once (bytes read ahead).
pub(crate) fn poll_target(fd: c_int) -> Option<(RawFd, bool, Entry)> {
    match get_active(fd)? {
        Entry::Stream(c) => {
            // (a CDC the peer signalled is data for a read, though the
            // readiness descriptor does not show it: see `signal_ctl`)
            let now = c.s.has_pending()
                || c.s.signal_taken()
                || !c
                    .peeked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty();
            let r = c.s.readiness_fd().ok()?.as_raw_fd();
            Some((r, now, Entry::Stream(c)))
        }
        Entry::Listener(l) => {
            let r = l.l.readiness_fd().ok()?.as_raw_fd();
            Some((r, false, Entry::Listener(l)))
        }
        Entry::Connecting(p) => Some((p.user.as_raw_fd(), false, Entry::Connecting(p))),
        Entry::Fresh { .. }
        | Entry::Passive
        | Entry::LazyListener
        | Entry::Lazy(_)
        | Entry::Failed(_) => None,
    }
}

/// Runs `f` on a copy of `fds` whose SMC descriptors are replaced by their
/// readiness descriptors, and copies the results back. A connection that
/// also has its peer's signal polled in an epoll set (`signal_ctl`) has
/// that signal in the copy too, after the caller's entries, as readable:
/// data it announces does not show on the readiness descriptor.
pub(crate) unsafe fn poll_via(
    fds: *mut pollfd,
    n: nfds_t,
    f: impl FnOnce(*mut pollfd, nfds_t, bool) -> c_int,
) -> Option<c_int> {
    if COUNT.load(Ordering::Acquire) == 0 || fds.is_null() || n == 0 {
        return None;
    }
    // SAFETY: the caller's `n` pollfds.
    let user = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let mut copy: Vec<pollfd> = user.to_vec();
    // (held until the poll returns: the descriptors stay open)
    let mut keep = Vec::new();
    let mut now = vec![false; copy.len()];
    let mut pend = vec![None; copy.len()];
    // (caller's entry, peer signal)
    let mut signals = Vec::new();
    for (k, p) in copy.iter_mut().enumerate() {
        if let Some((r, ready, e)) = poll_target(p.fd) {
            p.fd = r;
            now[k] = ready && p.events & libc::POLLIN != 0;
            match &e {
                Entry::Connecting(c) => pend[k] = Some(c.clone()),
                Entry::Stream(c) if p.events & libc::POLLIN != 0 => {
                    if let Some(sfd) = c.s.signal_fd().filter(|_| c.s.signal_polled()) {
                        signals.push((k, sfd.as_raw_fd()));
                    }
                }
                _ => {}
            }
            keep.push(e);
        }
    }
    if keep.is_empty() {
        return None;
    }
    for &(_, sfd) in &signals {
        copy.push(pollfd {
            fd: sfd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    let any_now = now.iter().any(|x| *x);
    let r = f(copy.as_mut_ptr(), copy.len() as nfds_t, any_now);
    if r < 0 {
        return Some(r);
    }
    for (i, &(k, _)) in signals.iter().enumerate() {
        if copy[n as usize + i].revents & libc::POLLIN != 0 {
            now[k] = true;
        }
    }
    let mut count = 0;
    for (k, (u, c)) in user.iter_mut().zip(copy.iter()).enumerate() {
        u.revents = c.revents;
        if now[k] {
            u.revents |= libc::POLLIN;
        }
        if u.revents != 0
            && pend[k]
                .as_ref()
                .is_some_and(|p| p.reg.lock().unwrap_or_else(|e| e.into_inner()).is_none())
        {
            // a connect that finished during the poll: what the
            // connection's own descriptor shows now
            let mut again = [pollfd {
                fd: u.fd,
                events: u.events,
                revents: 0,
            }];
            // SAFETY: our own pollfd (through `poll`, which maps it).
            if unsafe { poll(again.as_mut_ptr(), 1, 0) } >= 0 {
                u.revents = again[0].revents;
            }
        }
        if u.revents != 0 {
            count += 1;
        }
    }
    drop(keep);
    Some(count)
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let real_poll = real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int);
    // SAFETY: the caller's pollfds; the real poll gets a copy of the same length.
    let via = unsafe {
        poll_via(fds, n, |p, n, now| {
            real_poll(p, n, if now { 0 } else { timeout })
        })
    };
    match via {
        Some(r) => r,
        // SAFETY: the caller's arguments, unchanged.
        None => unsafe { real_poll(fds, n, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real_ppoll = real!(ppoll: fn(*mut pollfd, nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int);
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as `poll`; the timeout and mask are the caller's.
    let via = unsafe {
        poll_via(fds, n, |p, n, now| {
            real_ppoll(p, n, if now { &zero } else { ts }, sigmask)
        })
    };
    match via {
        Some(r) => r,
        // SAFETY: the caller's arguments, unchanged.
        None => unsafe { real_ppoll(fds, n, ts, sigmask) },
    }
}

/// `select` on SMC descriptors: answered by `poll` on their readiness
/// descriptors (FD_SETSIZE bounds both).
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let real_select = real!(select: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int);
    let ts = (!tv.is_null()).then(|| {
        // SAFETY: the caller's timeout.
        let t = unsafe { &*tv };
        libc::timespec {
            tv_sec: t.tv_sec,
            tv_nsec: (t.tv_usec as libc::c_long).clamp(0, 999_999) * 1000,
        }
    });
    // SAFETY: the caller's sets; the real select gets the caller's arguments.
    unsafe {
        select_via(nfds, rd, wr, ex, ts, std::ptr::null(), || {
            real_select(nfds, rd, wr, ex, tv)
        })
    }
}

/// `pselect`, as `select` with `ppoll`'s signal mask.
#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real_pselect = real!(pselect: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int);
    // SAFETY: the caller's timeout.
    let t = (!ts.is_null()).then(|| unsafe { *ts });
    // SAFETY: as `select`.
    unsafe {
        select_via(nfds, rd, wr, ex, t, sigmask, || {
            real_pselect(nfds, rd, wr, ex, ts, sigmask)
        })
    }
}

/// `select`/`pselect`: `real` if no SMC descriptor is in the sets, else
/// `ppoll` (ours) on the same descriptors.
pub(crate) unsafe fn select_via(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: Option<libc::timespec>,
    sigmask: *const libc::sigset_t,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let isset = |s: *mut libc::fd_set, fd: c_int| {
        // SAFETY: the caller's set, for a descriptor below nfds.
        !s.is_null() && unsafe { libc::FD_ISSET(fd, s) }
    };
    let nfds_c = nfds.clamp(0, libc::FD_SETSIZE as c_int);
    let ours = COUNT.load(Ordering::Acquire) != 0
        && (0..nfds_c).any(|fd| {
            (isset(rd, fd) || isset(wr, fd) || isset(ex, fd))
                && matches!(
                    get(fd),
                    Some(
                        Entry::Stream(_)
                            | Entry::Listener(_)
                            | Entry::Connecting(_)
                            | Entry::Passive
                    )
                )
        });
    if !ours {
        return real();
    }
    let mut pfds: Vec<pollfd> = Vec::new();
    for fd in 0..nfds_c {
        let mut ev = 0;
        if isset(rd, fd) {
            ev |= libc::POLLIN;
        }
        if isset(wr, fd) {
            ev |= libc::POLLOUT;
        }
        if isset(ex, fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            pfds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: our own pollfds, the caller's timeout and mask.
    let r = unsafe { ppoll(pfds.as_mut_ptr(), pfds.len() as nfds_t, tsp, sigmask) };
    if r < 0 {
        return r;
    }
    for s in [rd, wr, ex] {
        if !s.is_null() {
            // SAFETY: the caller's set.
            unsafe { libc::FD_ZERO(s) };
        }
    }
    let mut count = 0;
    for p in &pfds {
        let mut mark = |s: *mut libc::fd_set, hit: bool| {
            if hit && !s.is_null() {
                // SAFETY: the caller's set, for a descriptor below nfds.
                unsafe { libc::FD_SET(p.fd, s) };
                count += 1;
            }
        };
        let bad = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
        mark(
            rd,
            p.events & libc::POLLIN != 0 && (p.revents & libc::POLLIN != 0 || bad),
        );
        mark(
            wr,
            p.events & libc::POLLOUT != 0 && (p.revents & libc::POLLOUT != 0 || bad),
        );
        mark(
            ex,
            p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0,
        );
    }
    count
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    let real_ctl = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    loop {
        let target = if COUNT.load(Ordering::Acquire) == 0 {
            None
        } else {
            poll_target(fd)
        };
        let p = match target {
            Some((_, _, Entry::Connecting(p))) => p,
            Some((r, _, Entry::Stream(c))) => {
                // SAFETY: as below.
                let n = unsafe { real_ctl(epfd, op, r, ev) };
                if n == 0 {
                    signal_ctl(&c, epfd, op, ev);
                }
                return n;
            }
            // SAFETY: the caller's arguments, with an SMC descriptor's
            // readiness descriptor in its place (it lives as long as the
            // connection).
            t => return unsafe { real_ctl(epfd, op, t.map_or(fd, |(r, _, _)| r), ev) },
        };
        let mut reg = p.reg.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = reg.as_mut() else {
            // done meanwhile: the connection's entry now
            continue;
        };
        // SAFETY: as above, with the connect's descriptor; the set is
        // recorded so that the thread moves it to the connection's.
        let r = unsafe { real_ctl(epfd, op, p.user.as_raw_fd(), ev) };
        if r == 0 {
            list.retain(|(e, _)| *e != epfd);
            if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
                // SAFETY: the caller's event.
                list.push((epfd, unsafe { *ev }));
            }
        }
        return r;
    }
}

/// After the application's `epoll_ctl(epfd, op, ..., ev)` on connection
/// `c` went through on its readiness descriptor: the connection's peer
/// signal (`SmcStream::signal_fd`) follows in the same set, under the same
/// event data, for as long as the application waits there for readable:
/// registered for `EPOLLIN` with the application's `EPOLLET` and
/// `EPOLLONESHOT`. So an event loop asleep in that set is woken by the
/// peer's SEND itself; its read then takes the CDC.
pub(crate) fn signal_ctl(c: &Conn, epfd: c_int, op: c_int, ev: *const libc::epoll_event) {
    let Some(sfd) = c.s.signal_fd() else { return };
    let sfd = sfd.as_raw_fd();
    let real_ctl = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    // SAFETY: the caller's event, if any.
    let ev = (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { *ev });
    let want = ev.filter(|e| e.events & libc::EPOLLIN as u32 != 0);
    let mut sets = c.signalled_in.lock().unwrap_or_else(|e| e.into_inner());
    let had = sets.contains(&epfd);
    let keep = (libc::EPOLLET | libc::EPOLLONESHOT | libc::EPOLLWAKEUP) as u32;
    match (had, want) {
        (false, Some(e)) => {
            let mut mine = libc::epoll_event {
                events: libc::EPOLLIN as u32 | e.events & (keep | libc::EPOLLEXCLUSIVE as u32),
                u64: e.u64,
            };
            // SAFETY: our own descriptor into the application's set.
            if unsafe { real_ctl(epfd, libc::EPOLL_CTL_ADD, sfd, &mut mine) } == 0 {
                sets.push(epfd);
                c.s.watch_signal(true);
            }
        }
        (true, Some(e)) => {
            let mut mine = libc::epoll_event {
                events: libc::EPOLLIN as u32 | e.events & keep,
                u64: e.u64,
            };
            // SAFETY: as above.
            unsafe { real_ctl(epfd, libc::EPOLL_CTL_MOD, sfd, &mut mine) };
        }
        (true, None) => {
            // SAFETY: as above.
            unsafe { real_ctl(epfd, libc::EPOLL_CTL_DEL, sfd, std::ptr::null_mut()) };
            sets.retain(|&s| s != epfd);
            drop(sets);
            c.s.watch_signal(false);
        }
        (false, None) => {}
    }
}
