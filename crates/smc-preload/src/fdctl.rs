//! Calls on the descriptor itself: `shutdown`, `close`, `dup`, `dup2`, `dup3`,
//! `fcntl`, `fcntl64`, `ioctl`.

use super::*;

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(Entry::Remote(r)) = get(fd) {
        return match r.shutdown(how) {
            Ok(()) => 0,
            Err(e) => fail(&e),
        };
    }
    if let Some(Entry::Passive(_)) = get_raw(fd) {
        // (not started: the kernel's socket is all there is, and once it
        // listens no more, the kernel's it stays)
        // SAFETY: the caller's arguments, unchanged.
        let r = unsafe { real!(shutdown: fn(c_int, c_int) -> c_int)(fd, how) };
        if r == 0 && how != libc::SHUT_WR {
            drop(remove(fd));
        }
        return r;
    }
    // (a listener's driver takes the connections: it must stop, and the
    // application's waits are on its readiness descriptor; an SMC-R
    // connection's data is the stream's)
    let ours: Option<&dyn Fn(std::net::Shutdown) -> io::Result<()>> = match get(fd) {
        Some(Entry::Listener(l)) => Some(&move |h| l.l.shutdown(h)),
        Some(Entry::Stream(c)) if c.s.mode() == Mode::SmcR => Some(&move |h| c.s.shutdown(h)),
        _ => None,
    };
    if let Some(shut) = ours {
        let h = match how {
            libc::SHUT_RD => std::net::Shutdown::Read,
            libc::SHUT_WR => std::net::Shutdown::Write,
            libc::SHUT_RDWR => std::net::Shutdown::Both,
            _ => {
                set_errno(libc::EINVAL);
                return -1;
            }
        };
        return match shut(h) {
            Ok(()) => 0,
            Err(e) => fail(&e),
        };
    }
    // SAFETY: the caller's arguments, unchanged.
    unsafe { real!(shutdown: fn(c_int, c_int) -> c_int)(fd, how) }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    // (not while a spawn has a stand-in on it: see exec.rs)
    let spawn = (COUNT.load(Ordering::Acquire) > 0)
        .then(|| exec::SPAWN.read().unwrap_or_else(|e| e.into_inner()));
    let old = remove(fd);
    crate::poll::set_closing(fd);
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(close: fn(c_int) -> c_int)(fd) };
    let e = errno();
    // (before the drop, which may close the library's own descriptors)
    drop(spawn);
    // the last handle of an SMC-R connection closes it (after its data left)
    drop(old);
    set_errno(e);
    r
}

/// After `nfd` became a duplicate of `fd`: it carries what `fd` carries.
pub(crate) fn duplicated(fd: c_int, nfd: c_int) {
    if nfd < 0 || nfd == fd {
        return;
    }
    let old = match get_raw(fd) {
        Some(e) => insert(nfd, e),
        None => remove(nfd),
    };
    drop(old);
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // (a duplicate of an epoll set of ours is waited on under its own number)
    crate::interest::expose_polled(std::iter::once(fd));
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup: fn(c_int) -> c_int)(fd) };
    duplicated(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, nfd: c_int) -> c_int {
    crate::interest::expose_polled(std::iter::once(fd));
    if fd != nfd {
        // (the descriptor at `nfd` is closed by the call)
        crate::poll::set_closing(nfd);
    }
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup2: fn(c_int, c_int) -> c_int)(fd, nfd) };
    duplicated(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, nfd: c_int, flags: c_int) -> c_int {
    crate::interest::expose_polled(std::iter::once(fd));
    if fd != nfd {
        // (the descriptor at `nfd` is closed by the call)
        crate::poll::set_closing(nfd);
    }
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup3: fn(c_int, c_int, c_int) -> c_int)(fd, nfd, flags) };
    duplicated(fd, r);
    r
}

/// `O_NONBLOCK` set on `fd` by the application.
pub(crate) fn nonblocking_set(fd: c_int, on: bool) {
    // (a connection whose handshake waits for its first use has the
    // socket's own flag, which the real call just set)
    match get_raw(fd) {
        Some(Entry::Stream(c)) => {
            let _ = c.s.set_nonblocking(on);
        }
        Some(Entry::Remote(r)) => r.set_nonblocking(on),
        Some(Entry::Listener(l)) => {
            l.nonblock.store(on, Ordering::Relaxed);
            let _ = l.l.set_nonblocking(on);
            // the driver's socket stays non-blocking
            let _ = rustix::io::ioctl_fionbio(borrow(fd), true);
        }
        _ => {}
    }
}

/// `fcntl` (variadic in C; its one argument, if any, is passed in the
/// register the third parameter takes on the ABIs Linux runs on).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    dup_ahead(fd, cmd);
    let r = real_fcntl(fd, cmd, arg);
    fcntl_after(fd, cmd, arg, r)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    dup_ahead(fd, cmd);
    // SAFETY: as `fcntl`.
    let r = unsafe { real!(fcntl64: fn(c_int, c_int, c_ulong) -> c_int)(fd, cmd, arg) };
    fcntl_after(fd, cmd, arg, r)
}

/// Before `fcntl(fd, cmd, ...)`: a duplicate of an epoll set of ours is
/// waited on under its own number (see `dup`).
fn dup_ahead(fd: c_int, cmd: c_int) {
    if matches!(cmd, libc::F_DUPFD | libc::F_DUPFD_CLOEXEC) {
        crate::interest::expose_polled(std::iter::once(fd));
    }
}

pub(crate) fn fcntl_after(fd: c_int, cmd: c_int, arg: c_ulong, r: c_int) -> c_int {
    if r < 0 || COUNT.load(Ordering::Acquire) == 0 {
        return r;
    }
    match cmd {
        libc::F_SETFL => nonblocking_set(fd, arg as c_int & libc::O_NONBLOCK != 0),
        libc::F_GETFL => match get_raw(fd) {
            Some(Entry::Listener(l)) => {
                let nb = if l.nonblock.load(Ordering::Relaxed) {
                    libc::O_NONBLOCK
                } else {
                    0
                };
                return (r & !libc::O_NONBLOCK) | nb;
            }
            // (blocking meanwhile for the handshake)
            Some(Entry::Connecting(_)) => return r | libc::O_NONBLOCK,
            _ => {}
        },
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => duplicated(fd, r),
        _ => {}
    }
    r
}

/// `SIOCATMARK` (asm-generic/sockios.h): at the urgent byte's mark.
const SIOCATMARK: c_ulong = 0x8905;

/// `SIOCOUTQNSD` (linux/sockios.h): bytes not sent (`SIOCOUTQ`, which is
/// `TIOCOUTQ`, counts those not acknowledged too).
const SIOCOUTQNSD: c_ulong = 0x894B;

/// `ioctl` (variadic in C, as `fcntl`).
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    if COUNT.load(Ordering::Acquire) != 0 && req == libc::FIONREAD as c_ulong && !arg.is_null() {
        // what a read would return now: read ahead without waiting
        let n = match get(fd) {
            Some(Entry::Stream(c)) => Some(Ok(crate::share::fionread(&c))),
            Some(Entry::Remote(r)) => Some(r.fionread()),
            _ => None,
        };
        match n {
            Some(Ok(n)) => {
                // SAFETY: FIONREAD's argument is an int.
                unsafe { *(arg as *mut c_int) = n.min(c_int::MAX as usize) as c_int };
                return 0;
            }
            Some(Err(e)) => return fail(&e),
            None => {}
        }
    }
    if COUNT.load(Ordering::Acquire) != 0 && req == SIOCATMARK && !arg.is_null() {
        // the mark of the urgent byte in the SMC-R stream, not in its TCP
        // socket's (a fallback's, or a child's use of its parent's
        // connection, asks the kernel's)
        if let Some(Entry::Stream(c)) = get(fd) {
            match c.s.at_urgent_mark() {
                Ok(Some(at)) => {
                    // SAFETY: SIOCATMARK's argument is an int.
                    unsafe { *(arg as *mut c_int) = c_int::from(at) };
                    return 0;
                }
                Ok(None) => {}
                Err(e) => return fail(&e),
            }
        }
    }
    if COUNT.load(Ordering::Acquire) != 0
        && (req == libc::TIOCOUTQ as c_ulong || req == SIOCOUTQNSD)
        && !arg.is_null()
    {
        // What the connection has not delivered, not its TCP socket's (the
        // CLC bytes, long gone).
        if let Some(Entry::Stream(c)) = get(fd) {
            if let Some((queued, unsent)) = c.s.send_queue() {
                let n = if req == SIOCOUTQNSD { unsent } else { queued };
                // SAFETY: SIOCOUTQ's and SIOCOUTQNSD's argument is an int.
                unsafe { *(arg as *mut c_int) = n.min(c_int::MAX as usize) as c_int };
                return 0;
            }
        }
    }
    // SAFETY: the caller's arguments, unchanged.
    let r = unsafe { real!(ioctl: fn(c_int, c_ulong, *mut c_void) -> c_int)(fd, req, arg) };
    if r == 0 && req == libc::FIONBIO as c_ulong && !arg.is_null() {
        // SAFETY: FIONBIO's argument is an int.
        nonblocking_set(fd, unsafe { *(arg as *const c_int) } != 0);
    }
    r
}
