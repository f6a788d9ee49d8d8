//! Readiness: `poll`, `ppoll`, `select`, `pselect`, `epoll_ctl`.

use super::*;

/// What a poll on an SMC descriptor waits on instead: its readiness
/// descriptor, and whether a read would return at once (bytes read ahead).
/// (`look`: whether to look for bytes read ahead; `epoll_ctl` does not ask.)
pub(crate) fn poll_target(fd: c_int, look: bool) -> Option<(RawFd, bool, Entry)> {
    match get_active(fd)? {
        Entry::Stream(c) => {
            let now = look
                && (c.s.has_pending()
                    || !c
                        .peeked
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .is_empty());
            let r = c.s.readiness_fd().ok()?.as_raw_fd();
            Some((r, now, Entry::Stream(c)))
        }
        Entry::Listener(l) => {
            let r = l.l.readiness_fd().ok()?.as_raw_fd();
            Some((r, false, Entry::Listener(l)))
        }
        Entry::Connecting(p) => Some((p.user.as_raw_fd(), false, Entry::Connecting(p))),
        Entry::Remote(r) => Some((r.ready, r.has_held(), Entry::Remote(r))),
        Entry::Fresh { .. }
        | Entry::Passive(_)
        | Entry::LazyListener(..)
        | Entry::Lazy(_)
        | Entry::Failed(_) => None,
    }
}

/// Runs `f` on a copy of `fds` whose SMC descriptors are replaced by their
/// readiness descriptors, and copies the results back. A connection polled
/// for readable has its peer's signal watched for the poll's duration and
/// in the copy too, after the caller's entries (as an epoll set that has
/// it, `signal_ctl`): data it announces does not show on the readiness
/// descriptor. A signal that
/// fired is readable for the caller only if the connection is
/// (`SmcStream::signalled_events` takes its CDC, or drains a spent one);
/// when spent signals were all that ended the poll, it is run again (a few
/// times at most, as `epoll_wait`), as if nothing had woken it.
pub(crate) unsafe fn poll_via(
    fds: *mut pollfd,
    n: nfds_t,
    mut f: impl FnMut(*mut pollfd, nfds_t, bool) -> c_int,
) -> Option<c_int> {
    if COUNT.load(Ordering::Acquire) == 0 || fds.is_null() || n == 0 {
        return None;
    }
    // SAFETY: the caller's `n` pollfds.
    let user = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let mut copy: Vec<pollfd> = user.to_vec();
    // (held until the poll returns: the descriptors stay open)
    let mut keep = Vec::new();
    // (events a connection has now that its readiness descriptor cannot
    // show: bytes read ahead, the peer's urgent byte)
    let mut now: Vec<i16> = vec![0; copy.len()];
    let mut pend = vec![None; copy.len()];
    // (caller's entry, peer signal)
    let mut signals = Vec::new();
    // (the same for connections a parent serves: see share.rs)
    let mut rsignals = Vec::new();
    let mut watched: Vec<Arc<Conn>> = Vec::new();
    for (k, p) in copy.iter_mut().enumerate() {
        if let Some((r, ready, e)) = poll_target(p.fd, true) {
            p.fd = r;
            if ready && p.events & libc::POLLIN != 0 {
                now[k] |= libc::POLLIN;
            }
            if let Entry::Stream(c) = &e {
                if p.events & libc::POLLPRI != 0 && c.s.urgent_waiting() {
                    now[k] |= libc::POLLPRI;
                }
            }
            match &e {
                Entry::Connecting(c) => pend[k] = Some(c.clone()),
                // (a poll for POLLPRI alone is not woken by the urgent
                // byte's coming, only shown one that waits: README)
                Entry::Stream(c) if p.events & libc::POLLIN != 0 => {
                    // The peer signals this poll too, as it does an epoll
                    // set that has the connection (`signal_ctl`): a
                    // `poll`/`select` loop is woken by the peer's SEND
                    // itself, not by a progress thread that took the CDC.
                    if c.s.signal_fd().is_some() {
                        level_unless_in_epoll(c);
                        c.s.watch_signal_level(true);
                        watched.push(c.clone());
                    }
                    if let Some(sfd) = c.s.signal_fd().filter(|_| c.s.signal_polled()) {
                        signals.push((k, sfd.as_raw_fd(), c.clone()));
                    }
                }
                Entry::Remote(r) if p.events & libc::POLLIN != 0 => {
                    if let Some(sfd) = r.signal {
                        rsignals.push((k, sfd, r.clone()));
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
    for sfd in signals
        .iter()
        .map(|s| s.1)
        .chain(rsignals.iter().map(|s| s.1))
    {
        copy.push(pollfd {
            fd: sfd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    let ready = now.clone();
    for round in 0.. {
        now.clone_from(&ready);
        let any_now = now.iter().any(|x| *x != 0);
        let r = f(copy.as_mut_ptr(), copy.len() as nfds_t, any_now);
        if r < 0 {
            let e = errno();
            unwatch(watched);
            set_errno(e);
            return Some(r);
        }
        for (i, (k, _, c)) in signals.iter().enumerate() {
            if copy[n as usize + i].revents & libc::POLLIN != 0 {
                if c.s
                    .signalled_events()
                    .is_some_and(|e| e & libc::EPOLLIN as u32 != 0)
                {
                    now[*k] |= libc::POLLIN;
                }
                if user[*k].events & libc::POLLPRI != 0 && c.s.urgent_waiting() {
                    now[*k] |= libc::POLLPRI;
                }
            }
        }
        for (i, (k, _, r)) in rsignals.iter().enumerate() {
            if copy[n as usize + signals.len() + i].revents & libc::POLLIN != 0
                && r.look() & libc::EPOLLIN as u32 != 0
            {
                now[*k] |= libc::POLLIN;
            }
        }
        let shown = (0..n as usize).any(|k| now[k] != 0 || copy[k].revents != 0);
        if shown || r == 0 || round >= RETRIES {
            break;
        }
    }
    unwatch(watched);
    let mut count = 0;
    for (k, (u, c)) in user.iter_mut().zip(copy.iter()).enumerate() {
        u.revents = c.revents | now[k];
        // (looked up at an end only, which is rare: a poll per event loop
        // turn pays nothing for it)
        if u.revents & libc::POLLHUP != 0
            && matches!(get(u.fd), Some(Entry::Stream(c)) if c.error_pending())
        {
            // (a reset or abort: POLLERR too, as a TCP socket's sk_err
            // shows; the readiness descriptor can show the end only)
            u.revents |= libc::POLLERR;
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
    // SAFETY: the caller's pollfds.
    unsafe { expose_polled(fds, n) };
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
    // SAFETY: the caller's pollfds.
    unsafe { expose_polled(fds, n) };
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

/// Epoll sets of ours among `n` pollfds at `fds` are exposed
/// (`interest::expose`): their waiter is the kernel's poll.
unsafe fn expose_polled(fds: *const pollfd, n: nfds_t) {
    if fds.is_null() || n == 0 {
        return;
    }
    // SAFETY: the caller's `n` pollfds.
    let p = unsafe { std::slice::from_raw_parts(fds, n as usize) };
    crate::interest::expose_polled(p.iter().map(|p| p.fd));
}

/// `select`/`pselect`: `real` if no SMC descriptor is in the sets, else
/// The end of a poll's watch of its connections' peer signals: what they
/// signalled and nobody took shows on their readiness descriptors again
/// (`SmcStream::watch_signal`).
fn unwatch(watched: Vec<Arc<Conn>>) {
    for c in watched {
        c.s.watch_signal_level(false);
    }
}

/// A connection's signal that no epoll set has (only `poll` and `select`
/// wait on it, level-triggered) is written by the peer once per arm, not
/// at every SEND (`SmcStream::signal_level`): the poll drains it when it
/// arms it again. Otherwise the sets' registrations decide
/// ([`signal_mode`]). (Under the connection's records' lock, which
/// `signal_ctl` holds when it changes the mode.)
fn level_unless_in_epoll(c: &Conn) {
    let regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
    if regs.sig.is_empty() {
        c.s.signal_level(true);
    }
}

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
    crate::interest::expose_polled(
        (0..nfds_c).filter(|&fd| isset(rd, fd) || isset(wr, fd) || isset(ex, fd)),
    );
    let ours = COUNT.load(Ordering::Acquire) != 0
        && (0..nfds_c).any(|fd| {
            (isset(rd, fd) || isset(wr, fd) || isset(ex, fd))
                && matches!(
                    get(fd),
                    Some(
                        Entry::Stream(_)
                            | Entry::Remote(_)
                            | Entry::Listener(_)
                            | Entry::Connecting(_)
                            | Entry::Passive(_)
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
        let target = poll_target(fd, false);
        if !matches!(target, Some((_, _, Entry::Stream(_)))) {
            // SAFETY: the caller's event.
            unsafe { data_given_away(epfd, op, ev) };
            if op == libc::EPOLL_CTL_ADD {
                // (a set of ours put in another: what it has must be in
                // the kernel, which the other's waiter asks)
                crate::interest::expose(fd);
            }
        }
        let p = match target {
            Some((_, _, Entry::Connecting(p))) => p,
            // SAFETY: as below.
            Some((r, _, Entry::Stream(c))) => {
                return unsafe { crate::interest::conn_ctl(&c, epfd, op, r, ev) }
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
/// event data, for readable only: `EPOLLIN` with the application's
/// `EPOLLET` and `EPOLLONESHOT` while the application waits there for
/// readable (and `EPOLLET` of the library's for a level-triggered one in a
/// set whose waits are the library's, [`edge_here`]). So an event loop
/// asleep in that set is woken by the peer's SEND itself; its read then
/// takes the CDC.
///
/// When the application stops waiting for readable (a `MOD` without
/// `EPOLLIN`, or a `DEL`: event loops such as redis' and wrk's take a
/// socket out of their set and put it back twice per request) the signal's
/// registration is left as it is, and only the record of what the
/// application asks for changes: no system call of ours beside each of
/// theirs. Should the signal fire meanwhile, `epoll_wait` drops its
/// readable and only then turns the registration off (`fix_events`); data
/// it announced waits to be read, as in a TCP socket's receive queue, and
/// shows when the application asks for readable again (the `MOD` that
/// turns the registration back on makes the kernel look at the eventfd
/// again). The registration leaves the set with the connection.
/// (`regs`: the connection's records, `Conn::regs`, locked by the caller.)
pub(crate) fn signal_ctl(
    c: &Arc<Conn>,
    regs: &mut Regs,
    epfd: c_int,
    op: c_int,
    ev: *const libc::epoll_event,
) {
    let Some(sfd) = c.s.signal_fd() else { return };
    let sets = &mut regs.sig;
    let sfd = sfd.as_raw_fd();
    // SAFETY: the caller's event, if any.
    let ev = (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { *ev });
    let at = sets.iter().position(|&(s, _, _, _)| s == epfd);
    let keep = (libc::EPOLLET | libc::EPOLLONESHOT | libc::EPOLLWAKEUP) as u32;
    let events = |e: &libc::epoll_event| {
        if e.events & libc::EPOLLIN as u32 != 0 {
            libc::EPOLLIN as u32 | e.events & keep
        } else {
            0
        }
    };
    match (at, ev) {
        (None, Some(e)) => {
            let mine = events(&e) | e.events & libc::EPOLLEXCLUSIVE as u32;
            // (an edge-triggered or exclusive registration's signal is
            // written for every CDC from before it is made on)
            if mine & EDGE != 0 {
                c.s.signal_level(false);
            }
            let here = edge_here(epfd, mine);
            // Listed under the data before the kernel has the signal: an
            // event its ADD queues (a count a late write left in the
            // descriptor) or a CDC's write right after the arm below can
            // reach a thread already waiting in the set (the one that
            // finishes a non-blocking connect makes this registration while
            // the application's waits), and unlisted it would pass as the
            // kernel reported it: readable, for a connection that may have
            // nothing to read (wrk counts the read that would block as an
            // error). Listed, `fix_events` reports what the connection has.
            let early = e.events & crate::interest::ASKABLE != 0;
            let displaced = if early {
                note_signalled(epfd, None, Some(e.u64), c)
            } else {
                Vec::new()
            };
            if ctl_own(
                epfd,
                libc::EPOLL_CTL_ADD,
                sfd,
                kernel_events(mine, here),
                e.u64,
            ) == 0
            {
                note_signal_set(epfd);
                sets.push((epfd, mine, e.u64, here));
                signal_mode(c, sets);
                c.s.watch_signal(true);
                if early {
                    quiet_displaced(displaced, epfd, e.u64);
                } else {
                    list_signal(c, regs, epfd, None, &e);
                }
            } else if early {
                forget_signalled(Arc::as_ptr(c), &[(epfd, mine, e.u64, here)]);
            }
        }
        (Some(k), Some(e)) => {
            let mine = events(&e);
            let was = sets[k].2;
            // (not waiting for readable, same data: left as registered, see
            // above; an edge-triggered or one-shot registration is armed
            // again by every MOD, as the application's own)
            let lazy = mine == 0 && e.u64 == was;
            // (new data the application waits under: listed before the
            // kernel reports the signal under it, as for an ADD; the old
            // entry goes once the kernel has the new data)
            let early = e.u64 != was && e.events & crate::interest::ASKABLE != 0;
            let displaced = if early {
                note_signalled(epfd, None, Some(e.u64), c)
            } else {
                Vec::new()
            };
            if !lazy && ((mine, e.u64) != (sets[k].1, sets[k].2) || mine & keep != 0) {
                // (as for an ADD)
                if mine & EDGE != 0 && sets[k].1 & EDGE == 0 {
                    c.s.signal_level(false);
                }
                let here = edge_here(epfd, mine);
                ctl_own(
                    epfd,
                    libc::EPOLL_CTL_MOD,
                    sfd,
                    kernel_events(mine, here),
                    e.u64,
                );
                sets[k].1 = mine;
                sets[k].2 = e.u64;
                sets[k].3 = here;
                signal_mode(c, sets);
            }
            // (what the application asks for is its record's, `Rdy::want`:
            // the map changes only with the data, or to put back an entry
            // that went, see `Conn::unlisted`, which one change clears only
            // for a connection in one set)
            let unlisted = c.unlisted.load(Ordering::Acquire);
            if unlisted && sets.len() == 1 {
                c.unlisted.store(false, Ordering::Release);
            }
            if early {
                keep_signalled(epfd, Some(was), e.u64, c);
                quiet_displaced(displaced, epfd, e.u64);
            } else if e.u64 != was || unlisted {
                list_signal(c, regs, epfd, Some(was), &e);
            }
        }
        // Out of the set for the application: left as registered (see
        // above), and in the map; its record asks for nothing now.
        (Some(_), None) | (None, None) => {}
    }
}

/// Connection `c`'s signal is registered in `epfd` under `e`'s data (from
/// `old`; `regs` its records, locked): its entry of [`SIGNALLED`] follows
/// (see [`quiet_displaced`] for the connections it may find there). A
/// registration that asks for no events (the application's `EPOLL_CTL_ADD`
/// or `EPOLL_CTL_MOD` with none) keeps an entry it has under the data but
/// makes none: `fix_events` shows an event under the data as what the
/// connections there ask for and have, and one that asks for nothing shows
/// nothing, so the events of a descriptor that is not a connection under
/// the same data (`data_given_away`) were dropped for good. It stays out of
/// the map instead (`Conn::unlisted`: its next change that asks for events
/// puts it there), and what it left registered under the data is turned
/// off (the signal) or cut down to no events (the readiness descriptor,
/// `interest::quiet`), so that nothing of it reports there but `EPOLLERR`
/// and `EPOLLHUP`, as the kernel reports them for any registration.
fn list_signal(
    c: &Arc<Conn>,
    regs: &mut Regs,
    epfd: c_int,
    old: Option<u64>,
    e: &libc::epoll_event,
) {
    if e.events & crate::interest::ASKABLE != 0 {
        let others = note_signalled(epfd, old, Some(e.u64), c);
        quiet_displaced(others, epfd, e.u64);
        return;
    }
    if keep_signalled(epfd, old, e.u64, c) {
        return;
    }
    c.unlisted.store(true, Ordering::Release);
    turn_off(c, &mut regs.sig, epfd, Some(e.u64));
    crate::interest::quiet(c, &mut regs.rdy, epfd, e.u64);
}

/// Tells the connection how its signal's registrations `sets` wait
/// (`SmcStream::signal_level`): level-triggered unless one is
/// edge-triggered or exclusive (an exclusive one wakes one waiter per
/// write). `poll` and `select` wait level-triggered. A registration left
/// edge-triggered while the application does not wait for readable (see
/// [`signal_ctl`]) still counts: it is armed again as it was.
///
/// And whether the kernel has every registration of the signal
/// edge-triggered (`SmcStream::signal_edge_only`): then it needs no drain
/// when it is armed again, a system call per message saved. A registration
/// that asks for no events (turned off) waits for nothing; a connection a
/// child may poll (`Conn::forked`) is drained always.
pub(crate) fn signal_mode(c: &Conn, sets: &[(c_int, u32, u64, bool)]) {
    c.s.signal_level(sets.iter().all(|&(_, ev, _, _)| ev & EDGE == 0));
    let edge = |&(_, ev, _, here): &(c_int, u32, u64, bool)| {
        ev & libc::EPOLLIN as u32 == 0 || ev & libc::EPOLLET as u32 != 0 || here
    };
    c.s.signal_edge_only(!c.forked.load(Ordering::Acquire) && sets.iter().all(edge));
}

/// Whether the signal's registration asking for `mine` in `epfd` goes to
/// the kernel edge-triggered though the application's is level-triggered:
/// in a set whose waits are this library's (`interest::virtual_set`), which
/// reports what a connection still has to read after an event itself, as a
/// level-triggered registration would (`interest::before_wait`), so that
/// the signal need not be drained whenever it is armed again (one system
/// call per message fewer: `SmcStream::signal_edge_only`). Not for the
/// kernel's own flags (edge-triggered, one-shot, exclusive: theirs as
/// asked), nor in a set that another waiter watches in the kernel (direct).
fn edge_here(epfd: c_int, mine: u32) -> bool {
    mine & libc::EPOLLIN as u32 != 0
        && crate::interest::plain(mine)
        && crate::interest::virtual_set(epfd)
}

/// What the kernel registers for the signal asking for `mine`, with
/// `EPOLLET` where the library keeps the level itself ([`edge_here`]).
fn kernel_events(mine: u32, here: bool) -> u32 {
    if here {
        mine | libc::EPOLLET as u32
    } else {
        mine
    }
}

/// Registrations that need the peer signal written for every CDC
/// ([`signal_mode`]).
const EDGE: u32 = (libc::EPOLLET | libc::EPOLLEXCLUSIVE) as u32;

/// The application's epoll sets that a peer signal was registered in
/// (`signal_ctl`): when one is closed, the records of its registrations
/// go with it ([`set_closing`]).
static SIGNAL_SETS: Mutex<Vec<c_int>> = Mutex::new(Vec::new());

/// Entries of [`SIGNAL_SETS`] (a look without the lock).
static SIGNAL_SETS_N: AtomicUsize = AtomicUsize::new(0);

fn note_signal_set(epfd: c_int) {
    let mut v = SIGNAL_SETS.lock().unwrap_or_else(|e| e.into_inner());
    if !v.contains(&epfd) {
        v.push(epfd);
        SIGNAL_SETS_N.store(v.len(), Ordering::Release);
    }
}

/// Descriptor `fd` is about to be closed (or replaced by `dup2`/`dup3`):
/// if it is an epoll set with peer signals registered, the kernel drops
/// their registrations with it, and so do the connections' records of them
/// ([`Conn::regs`], [`SIGNALLED`]). Without this, a set created
/// later under the same number looked like the old one: the signal seemed
/// registered there and was not (a connection added to it was never woken
/// by its peer). Before the close, so that a set another thread creates
/// under the number at once is not mistaken for the old one.
pub(crate) fn set_closing(fd: c_int) {
    // (the records of the connections' registrations there: interest.rs)
    let ours = crate::interest::set_closing(fd);
    let mut signalled = false;
    if SIGNAL_SETS_N.load(Ordering::Acquire) != 0 {
        let mut v = SIGNAL_SETS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = v.iter().position(|&e| e == fd) {
            v.swap_remove(i);
            SIGNAL_SETS_N.store(v.len(), Ordering::Release);
            signalled = true;
        }
    }
    if signalled {
        let mut g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = g.as_mut() {
            m.retain(|&(ep, _, _), _| ep != fd);
            SIGNALLED_N.store(m.len(), Ordering::Release);
        }
    }
    if !ours && !signalled {
        return;
    }
    // (rare: an event loop closes its set once; a scan of the table then)
    for c in streams() {
        let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
        regs.sig.retain(|&(ep, _, _, _)| ep != fd);
        regs.rdy.retain(|x| x.epfd != fd);
    }
}

/// The registrations of peer signals in the application's epoll sets, by
/// (set, event data, connection): the connection (what the application
/// asks for there is in the connection's record, `interest::asked`, so
/// that the changes of an event loop's interest around each request need
/// not lock this). `epoll_wait` reports such a connection's events whole
/// (`fix_events`). Two connections the application gave the same data in
/// a set are both there: an event under the data may be either's, and
/// shows what each asks for and has (the kernel's registrations cannot
/// tell whose it is). (Ordered, not hashed: it is looked up for every
/// event of a connection, and a few comparisons of integers cost less than
/// hashing them with the standard library's DoS-resistant hasher, which
/// keys chosen by the application itself do not need; the connection,
/// by its address, comes last, so that those under one data are a range.)
type Signalled = std::collections::BTreeMap<(c_int, u64, usize), std::sync::Weak<Conn>>;

static SIGNALLED: Mutex<Option<Signalled>> = Mutex::new(None);

/// Registrations in [`SIGNALLED`] (a look without the lock).
static SIGNALLED_N: AtomicUsize = AtomicUsize::new(0);

/// The connections in `m` under `data` in `epfd`.
fn signalled_under(
    m: &Signalled,
    epfd: c_int,
    data: u64,
) -> impl Iterator<Item = &std::sync::Weak<Conn>> {
    // (one search, for the first: the rest follow it)
    m.range((epfd, data, 0)..)
        .take_while(move |&(&(e, d, _), _)| e == epfd && d == data)
        .map(|(_, w)| w)
}

/// Moves connection `c`'s entry `(epfd, old)` of [`SIGNALLED`] to
/// `(epfd, new)` (event data). Returns the other connections under the new
/// data: if the application took one out of the set before it gave its
/// data to `c`, its signal may still be registered under it (see
/// [`signal_ctl`], [`quiet_displaced`]).
fn note_signalled(
    epfd: c_int,
    old: Option<u64>,
    new: Option<u64>,
    c: &Arc<Conn>,
) -> Vec<Arc<Conn>> {
    let p = Arc::as_ptr(c) as usize;
    let mut g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(Default::default);
    if let Some(d) = old {
        m.remove(&(epfd, d, p));
    }
    let mut others = Vec::new();
    if let Some(d) = new {
        m.insert((epfd, d, p), Arc::downgrade(c));
        others.extend(
            signalled_under(m, epfd, d)
                .filter_map(std::sync::Weak::upgrade)
                .filter(|o| !Arc::ptr_eq(o, c)),
        );
    }
    SIGNALLED_N.store(m.len(), Ordering::Release);
    others
}

/// Connection `c`'s entry `(epfd, old)` of [`SIGNALLED`] goes, unless it
/// is under `new`; returns whether `c` has an entry under `(epfd, new)`
/// (see [`list_signal`]).
fn keep_signalled(epfd: c_int, old: Option<u64>, new: u64, c: &Arc<Conn>) -> bool {
    let p = Arc::as_ptr(c) as usize;
    let mut g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(Default::default);
    if let Some(d) = old.filter(|&d| d != new) {
        if m.remove(&(epfd, d, p)).is_some() {
            SIGNALLED_N.store(m.len(), Ordering::Release);
        }
    }
    m.contains_key(&(epfd, new, p))
}

/// The application registers a descriptor that is not an SMC-R connection
/// in `epfd` under `ev`'s data: a connection's signal left registered
/// there under that data after the application stopped waiting on it
/// (see [`signal_ctl`]) is turned off first and its entry goes, so that
/// neither reports for the other.
///
/// # Safety
/// `ev` as `epoll_ctl` takes it.
unsafe fn data_given_away(epfd: c_int, op: c_int, ev: *const libc::epoll_event) {
    if op == libc::EPOLL_CTL_DEL || ev.is_null() || SIGNALLED_N.load(Ordering::Acquire) == 0 {
        return;
    }
    // SAFETY: the caller's event.
    let data = unsafe { (*ev).u64 };
    let under: Vec<Arc<Conn>> = {
        let g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
        let Some(m) = g.as_ref() else { return };
        signalled_under(m, epfd, data)
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    };
    for o in under {
        // (its lock before the map's, as everywhere)
        let mut regs = o.regs.lock().unwrap_or_else(|e| e.into_inner());
        // (only an entry the application took out of the set: one it still
        // waits on under the same data stays, as two descriptors under one
        // data are the application's to tell apart)
        if crate::interest::asked(&regs.rdy, epfd, data) != 0 {
            continue;
        }
        {
            let mut g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
            let Some(m) = g.as_mut() else { return };
            if m.remove(&(epfd, data, Arc::as_ptr(&o) as usize)).is_none() {
                continue;
            }
            SIGNALLED_N.store(m.len(), Ordering::Release);
            o.unlisted.store(true, Ordering::Release);
        }
        turn_off(&o, &mut regs.sig, epfd, Some(data));
        crate::interest::quiet(&o, &mut regs.rdy, epfd, data);
    }
}

/// The application gave `data` in `epfd` to another connection besides
/// `others`: one that asks for nothing there under that data (the
/// application took it out of the set, or left it with no events), if its
/// signal is still registered there under that data, has it turned off and
/// its readiness descriptor's registration cut down (`interest::quiet`), so
/// that it never fires under the other's data. (The caller holds the other's
/// lock: theirs are only tried; a thread that has one is changing that
/// connection's registrations itself. Left as they are, they stay in the
/// map: `fix_events` shows nothing of them, and turns them off when they
/// fire.)
fn quiet_displaced(others: Vec<Arc<Conn>>, epfd: c_int, data: u64) {
    for o in others {
        let Ok(mut regs) = o.regs.try_lock() else {
            continue;
        };
        if crate::interest::asked(&regs.rdy, epfd, data) != 0 {
            continue;
        }
        turn_off(&o, &mut regs.sig, epfd, Some(data));
        crate::interest::quiet(&o, &mut regs.rdy, epfd, data);
    }
}

/// Turns connection `c`'s signal registration in `epfd` off (no events),
/// if it has events there (and, with `data`, is under that data).
pub(crate) fn turn_off(
    c: &Conn,
    sets: &mut [(c_int, u32, u64, bool)],
    epfd: c_int,
    data: Option<u64>,
) {
    let Some(sfd) = c.s.signal_fd() else { return };
    let Some(k) = sets.iter().position(|&(s, _, _, _)| s == epfd) else {
        return;
    };
    if sets[k].1 == 0 || data.is_some_and(|d| d != sets[k].2) {
        return;
    }
    ctl_own(epfd, libc::EPOLL_CTL_MOD, sfd.as_raw_fd(), 0, sets[k].2);
    sets[k].1 = 0;
    sets[k].3 = false;
}

/// Connection `c` (at `ptr`) is gone: its entries leave [`SIGNALLED`].
pub(crate) fn forget_signalled(ptr: *const Conn, sets: &[(c_int, u32, u64, bool)]) {
    let mut g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(m) = g.as_mut() else { return };
    for &(ep, _, d, _) in sets {
        m.remove(&(ep, d, ptr as usize));
    }
    SIGNALLED_N.store(m.len(), Ordering::Release);
}

/// After the real `epoll_wait` on `epfd` returned `n` events in `events`:
/// an event of a connection whose peer signal is in the set shows what the
/// kernel reported and, of what the application asked for there, what the
/// connection has now, its CDC taken (data, end of file and room in one
/// event, as TCP's poll reports them), and once (the readiness descriptor
/// and the signal are two registrations under the application's data).
/// An event that is the signal's readable alone with nothing to read (a
/// spent signal, drained now) is dropped, unless `keep_all`. Under data
/// the application gave two connections in the set, the event shows what
/// it shows for either. Returns the new count.
unsafe fn fix_events(
    epfd: c_int,
    events: *mut libc::epoll_event,
    n: c_int,
    keep_all: bool,
) -> c_int {
    if n <= 0 || SIGNALLED_N.load(Ordering::Acquire) == 0 || events.is_null() {
        return n;
    }
    // SAFETY: the `n` events the kernel wrote.
    let ev = unsafe { std::slice::from_raw_parts_mut(events, n as usize) };
    // (event, connection under its data), in the events' order
    let mut found = Vec::new();
    {
        let g = SIGNALLED.lock().unwrap_or_else(|e| e.into_inner());
        let Some(m) = g.as_ref() else { return n };
        for (i, e) in ev.iter().enumerate() {
            for c in signalled_under(m, epfd, e.u64).filter_map(std::sync::Weak::upgrade) {
                found.push((i, c));
            }
        }
    }
    if found.is_empty() {
        return n;
    }
    let mut drop_at = vec![false; ev.len()];
    // The readiness descriptor and the signal are two registrations under
    // the application's data: what they reported is merged into the first
    // event of the data, the others dropped.
    // (first event of the data, its connections in `found`)
    let mut firsts: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
    let mut j = 0;
    while j < found.len() {
        let i = found[j].0;
        let end = j + found[j..].iter().take_while(|(k, _)| *k == i).count();
        let data = ev[i].u64;
        match firsts.iter().find(|(f, _)| ev[*f].u64 == data) {
            Some(&(first, _)) => {
                ev[first].events |= ev[i].events;
                drop_at[i] = true;
            }
            None => firsts.push((i, j..end)),
        }
        j = end;
    }
    let inn = libc::EPOLLIN as u32;
    // (connections to report again at the next wait, `interest::mark_in`)
    let mut ins = Vec::new();
    for (i, run) in firsts {
        let orig = ev[i].events;
        let (mut fixed, mut kept) = (0, 0);
        for (_, c) in &found[run.clone()] {
            let Some(now) = c.s.signalled_events() else {
                // (not known here: as the kernel reported it)
                fixed |= orig;
                continue;
            };
            let asked = {
                let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
                let asked = crate::interest::asked(&regs.rdy, epfd, ev[i].u64);
                if orig & inn != 0 && asked & inn == 0 && now & inn != 0 {
                    // The signal, left registered while the application
                    // does not wait for readable (`signal_ctl`), fired for
                    // data that waits to be read: off until the application
                    // waits for it, or a level-triggered set would report
                    // it again and again. (A signal with nothing behind it
                    // was drained and armed again by the look above: it
                    // stays.)
                    turn_off(c, &mut regs.sig, epfd, None);
                }
                if now & asked & inn != 0 {
                    // (a level-triggered registration whose signal the
                    // kernel has edge-triggered: reported again while
                    // readable)
                    ins.extend(crate::interest::mark_in(c, &mut regs, epfd));
                }
                asked
            };
            // (the urgent byte's `EPOLLPRI`, which the readiness
            // descriptor cannot show, looked up only for who asks for it)
            let pri = libc::EPOLLPRI as u32;
            let now = if asked & pri != 0 && c.s.urgent_waiting() {
                now | pri
            } else {
                now
            };
            // What the application's registration shows (the readiness
            // descriptor's may ask for more, left in place: interest.rs).
            let mask =
                crate::interest::shown_mask(c, epfd, ev[i].u64, orig, now).unwrap_or(u32::MAX);
            // What the kernel reported stands, but for readable: the
            // signal's says only that something came, which may have been
            // read already (an event loop takes readable to mean data: wrk
            // counts a read that would block as an error), and it may fire
            // while the application does not ask for readable. The rest of
            // what the application asked for is added.
            // (an error is reported whatever was asked for, as the kernel
            // reports EPOLLERR)
            let err = if c.err_taken.load(Ordering::Acquire) {
                0
            } else {
                now & libc::EPOLLERR as u32
            };
            fixed |=
                ((orig & !inn) | (orig & now & asked & inn) | (now & asked & !inn)) & mask | err;
            kept |= orig & mask;
        }
        if fixed != 0 || (keep_all && kept != 0) {
            // (a one-shot registration reports once: see `fire_once`)
            let mut once = None;
            for (_, c) in &found[run] {
                let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(first) = crate::interest::fire_once(c, &mut regs, epfd, ev[i].u64) {
                    once = Some(once.unwrap_or(false) | first);
                }
            }
            if once == Some(false) {
                drop_at[i] = true;
                continue;
            }
        }
        if fixed != 0 {
            ev[i].events = fixed;
        } else if keep_all && kept != 0 {
            ev[i].events = kept;
        } else {
            drop_at[i] = true;
        }
    }
    crate::interest::note_ins(epfd, ins);
    let mut k = 0;
    for i in 0..ev.len() {
        if !drop_at[i] {
            ev[k] = ev[i];
            k += 1;
        }
    }
    k as c_int
}

/// Before `fork()`: the child may wait on the peer signal of every
/// connection open now with `poll`, level-triggered (`share.rs`), so each
/// is drained whenever it is armed again, and when its last poller here
/// goes, from now on (`Conn::forked`, `SmcStream::signal_shared`).
pub(crate) fn signals_forked() {
    if COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    for c in streams() {
        c.forked.store(true, Ordering::Release);
        c.s.signal_edge_only(false);
        c.s.signal_shared();
    }
}

/// Connection `c`'s signal, registered in `epfd` edge-triggered for a
/// level-triggered registration of the application's ([`edge_here`]; `sets`
/// its registrations, `Conn::regs`, locked), goes level-triggered there,
/// as the application asked: for a waiter that the kernel alone wakes. A
/// signal that announced bytes not read yet has its count above 0 (nothing
/// drained it since: a drain comes with the arm that ends what it
/// announced), or has it once the peer's write lands, so the kernel's
/// level shows them, in this set only (a write of ours would be an edge in
/// every set that has the signal).
pub(crate) fn signal_level_in(c: &Conn, sets: &mut [(c_int, u32, u64, bool)], epfd: c_int) {
    let Some(sfd) = c.s.signal_fd() else { return };
    let Some(x) = sets.iter_mut().find(|x| x.0 == epfd && x.3) else {
        return;
    };
    ctl_own(epfd, libc::EPOLL_CTL_MOD, sfd.as_raw_fd(), x.1, x.2);
    x.3 = false;
    signal_mode(c, sets);
}

/// Whether connection `c` ended in an error that its next call reports (a
/// reset or an abort): `EPOLLERR`, which its readiness descriptor cannot
/// show (`smc::readiness::Level::err`).
pub(crate) fn failed(c: &Conn) -> bool {
    c.s.ready_events()
        .is_some_and(|e| e & libc::EPOLLERR as u32 != 0)
}

/// Waits again after `fix_events` dropped every event (spent signals).
const RETRIES: u32 = 3;

/// Milliseconds left of an `epoll_wait` timeout that started at `t0`.
fn left_ms(timeout: c_int, t0: std::time::Instant) -> c_int {
    if timeout < 0 {
        return timeout;
    }
    let spent = t0.elapsed().as_millis().min(c_int::MAX as u128) as c_int;
    (timeout - spent).max(0)
}

/// `epoll_wait` and its variants on `epfd`: `real(events, max, zero)`
/// waits as the caller asked, for what is left of its timeout (`zero`: not
/// at all), and `expired()` says whether the timeout is over. Events ready
/// in this process (`interest::before_wait`) are reported with the
/// kernel's, from a kernel wait that does not sleep.
unsafe fn wait_via(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    mut real: impl FnMut(*mut libc::epoll_event, c_int, bool) -> c_int,
    expired: impl Fn() -> bool,
) -> c_int {
    if maxevents <= 0 || events.is_null() {
        // (the kernel's answer: EINVAL, EFAULT)
        return real(events, maxevents, false);
    }
    let w = crate::interest::before_wait(epfd);
    if let Some(w) = w.as_ref().filter(|w| !w.ours.is_empty()) {
        let max = maxevents as usize;
        // (room for both, half each at least; one event alternates)
        let mut room = max - w.ours.len().min(max.div_ceil(2));
        if max == 1 && !w.ours_first {
            room = 1;
        }
        let n = if room > 0 {
            real(events, room as c_int, true)
        } else {
            0
        };
        if n < 0 {
            return n;
        }
        // SAFETY: the events just written.
        let k = unsafe { fix_events(epfd, events, n, false) } as usize;
        // SAFETY: the caller's `maxevents` events.
        let out = unsafe { std::slice::from_raw_parts_mut(events, max) };
        let mut total = k;
        for e in &w.ours {
            if total == max {
                break;
            }
            if out[..k].iter().any(|x| x.u64 == e.u64) {
                // (the kernel's event for it shows its state already)
                continue;
            }
            out[total] = *e;
            total += 1;
        }
        return total as c_int;
    }
    for round in 0.. {
        let n = real(events, maxevents, false);
        // SAFETY: the events just written. (Everything dropped: wait on,
        // as if nothing had woken the set; a few times only, then the
        // events go out as they are, rather than a loop here.)
        let k = unsafe { fix_events(epfd, events, n, round >= RETRIES) };
        if k != 0 || n <= 0 || expired() {
            return k;
        }
    }
    unreachable!()
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    let real = real!(epoll_wait: fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int);
    let t0 = std::time::Instant::now();
    // SAFETY: the caller's arguments (the timeout what is left of it).
    unsafe {
        wait_via(
            epfd,
            events,
            maxevents,
            |e, m, zero| real(epfd, e, m, if zero { 0 } else { left_ms(timeout, t0) }),
            || left_ms(timeout, t0) == 0,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real = real!(epoll_pwait: fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int);
    let t0 = std::time::Instant::now();
    // SAFETY: as `epoll_wait`, with the caller's mask.
    unsafe {
        wait_via(
            epfd,
            events,
            maxevents,
            |e, m, zero| {
                let t = if zero { 0 } else { left_ms(timeout, t0) };
                real(epfd, e, m, t, sigmask)
            },
            || left_ms(timeout, t0) == 0,
        )
    }
}

/// `epoll_pwait` with a timeout in nanoseconds.
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real = real!(epoll_pwait2: fn(c_int, *mut libc::epoll_event, c_int, *const libc::timespec, *const libc::sigset_t) -> c_int);
    // SAFETY: the caller's timeout, if any (NULL: none).
    let limit = (!timeout.is_null()).then(|| unsafe { *timeout }).map(|t| {
        std::time::Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        )
    });
    let t0 = std::time::Instant::now();
    let left = move || limit.map(|l| l.saturating_sub(t0.elapsed()));
    // SAFETY: as `epoll_pwait`.
    unsafe {
        wait_via(
            epfd,
            events,
            maxevents,
            |e, m, zero| {
                let t = if zero {
                    Some(std::time::Duration::ZERO)
                } else {
                    left()
                };
                let ts = t.map(|d| libc::timespec {
                    tv_sec: d.as_secs() as libc::time_t,
                    tv_nsec: d.subsec_nanos() as libc::c_long,
                });
                let p = ts
                    .as_ref()
                    .map_or(std::ptr::null(), |t| t as *const libc::timespec);
                real(epfd, e, m, p, sigmask)
            },
            || left().is_some_and(|d| d.is_zero()),
        )
    }
}
