//! The exec family: the library's connections across `execve` and its kin.

use super::*;

// ----- exec -----
//
// An SMC-R connection lives in the process image that made it: its buffers,
// its link and the threads that serve them. Its TCP socket is only the
// connection's identity (after the CLC handshake no data flows on it,
// RFC 7609 §2.2), so a new image that inherited the bare socket would wait
// forever on reads and send its writes where the peer never reads them.
// Before an exec the library therefore puts, on every descriptor that
// survives it (no `FD_CLOEXEC`) and names a connection of the library's, a
// fresh unconnected TCP socket of the same family: in the new image reads
// fail with `ENOTCONN`, writes with `EPIPE` (and `SIGPIPE`), `poll` shows
// `POLLHUP` at once, `getpeername` says `ENOTCONN` — a connection that is
// gone, never one that hangs or loses data silently. If the exec fails, the
// descriptors are put back as they were.
//
// What becomes of the connection itself: after `fork()` + exec in the
// child (inetd, CGI), the parent still has it and keeps using it; after an
// exec of the process itself, its image is gone, and the peer sees the
// connection end as when a process exits. Covered: `execve`, `execv`,
// `execvp`, `execvpe`, `fexecve`, `execveat`. The variadic `execl*` (which
// stable Rust cannot define) and `posix_spawn` (whose exec is glibc's own,
// not interposable) are not.

/// Identity of an open file (device, inode): the same socket under any
/// descriptor number.
pub(crate) fn file_id(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    let st = rustix::fs::fstat(fd).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// Before an exec: the connections' descriptors that would survive it get a
/// stand-in (see above); returns the originals (close-on-exec duplicates)
/// to put back should the exec fail.
pub(crate) fn detach_for_exec() -> Vec<(RawFd, OwnedFd)> {
    decline_lazy_for_exec();
    if !USED.load(Ordering::Acquire) {
        return Vec::new();
    }
    let ids: Vec<(u64, u64)> = {
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        t.iter()
            .filter_map(|(&fd, e)| match e {
                Entry::Stream(c) => file_id(c.s.tcp_fd()),
                // (its own duplicate is the connect thread's)
                Entry::Connecting(_) => file_id(borrow(fd)),
                _ => None,
            })
            .collect()
    };
    if ids.is_empty() {
        return Vec::new();
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let fds: Vec<RawFd> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut saved = Vec::new();
    for fd in fds {
        let survives = rustix::io::fcntl_getfd(borrow(fd))
            .is_ok_and(|f| !f.contains(rustix::io::FdFlags::CLOEXEC));
        if !survives || !file_id(borrow(fd)).is_some_and(|id| ids.contains(&id)) {
            continue;
        }
        let Ok(orig) = dup_own(fd) else { continue };
        if stand_in(fd) {
            saved.push((fd, orig));
        }
    }
    saved
}

/// Before an exec: an accepted connection whose handshake was left for its
/// first use (`Entry::Lazy`) and whose descriptor survives the exec is
/// declined (the client falls back to TCP), so the new image finds a plain
/// TCP connection on it — what inetd and CGI-style servers hand their
/// programs — with nothing of the CLC left to read. (One another process
/// took first is that process's: a stand-in, as above.) Not undone if the
/// exec fails: the connection is TCP then, and works as such.
fn decline_lazy_for_exec() {
    if COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let lazy: Vec<(RawFd, Arc<Lazy>)> = TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(&fd, e)| match e {
            Entry::Lazy(l) => Some((fd, l.clone())),
            _ => None,
        })
        .collect();
    for (fd, l) in lazy {
        let survives = rustix::io::fcntl_getfd(borrow(fd))
            .is_ok_and(|f| !f.contains(rustix::io::FdFlags::CLOEXEC));
        if !survives {
            continue;
        }
        let pending = l.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = pending {
            match p.decline() {
                // (dropping the library's duplicate; `fd` goes on as TCP)
                Ok(tcp) => drop(tcp),
                Err(e) if e.kind() == io::ErrorKind::NotConnected => {
                    stand_in(fd);
                }
                Err(_) => {
                    let _ = rustix::net::shutdown(borrow(fd), rustix::net::Shutdown::Both);
                }
            }
            let _ = l.done.set(None);
        }
        // (one whose handshake another descriptor ran to SMC-R stays: it
        // gets its stand-in below, and back if the exec fails)
        if l.done.get().is_some_and(Option::is_none) {
            drop(remove(fd));
        }
    }
}

/// Puts a fresh unconnected TCP socket of `fd`'s family, with its file
/// status flags, on descriptor `fd` (see above); whether it did. System
/// calls only (rustix's; none comes back here), so a forked child's
/// `pthread_atfork` handler may call it too.
pub(crate) fn stand_in(fd: RawFd) -> bool {
    use rustix::net::{AddressFamily, SocketType};
    let v6 = rustix::net::getsockname(borrow(fd))
        .is_ok_and(|a| a.address_family() == AddressFamily::INET6);
    let family = if v6 {
        AddressFamily::INET6
    } else {
        AddressFamily::INET
    };
    let Ok(s) = rustix::net::socket(family, SocketType::STREAM, None) else {
        return false;
    };
    if let Ok(fl) = rustix::fs::fcntl_getfl(borrow(fd)) {
        let _ = rustix::fs::fcntl_setfl(&s, fl);
    }
    let mut target = borrow_owned(fd);
    let done = rustix::io::dup2(&s, &mut target).is_ok();
    std::mem::forget(target);
    // (not `drop(s)`: std closes through the C library's `close`, which is
    // ours and takes the table's lock, held here in a forked child)
    let s = std::os::fd::IntoRawFd::into_raw_fd(s);
    // SAFETY: `s` was just made here and is owned by nothing else; it is
    // closed once, by a system call.
    unsafe { rustix::io::close(s) };
    done
}

/// `fd` as an `OwnedFd` for `dup2`'s target (forgotten after, never closed).
pub(crate) fn borrow_owned(fd: RawFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is open (just listed); the caller forgets the value, so
    // it is never closed through it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// After a failed exec: the descriptors as they were.
pub(crate) fn reattach_after_exec(saved: Vec<(RawFd, OwnedFd)>) {
    let e = errno();
    for (fd, orig) in saved {
        let mut target = borrow_owned(fd);
        let _ = rustix::io::dup2(&orig, &mut target);
        std::mem::forget(target);
    }
    set_errno(e);
}

/// An exec with the library's connections detached first (see above) and
/// put back if it fails.
fn around_exec(exec: impl FnOnce() -> c_int) -> c_int {
    let saved = detach_for_exec();
    let r = exec();
    reattach_after_exec(saved);
    r
}

pub(crate) type CPath = *const libc::c_char;

pub(crate) type CArgv = *const *const libc::c_char;

#[no_mangle]
pub unsafe extern "C" fn execve(path: CPath, argv: CArgv, envp: CArgv) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every exec below).
    around_exec(|| unsafe { real!(execve: fn(CPath, CArgv, CArgv) -> c_int)(path, argv, envp) })
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: CPath, argv: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(|| unsafe { real!(execv: fn(CPath, CArgv) -> c_int)(path, argv) })
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: CPath, argv: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(|| unsafe { real!(execvp: fn(CPath, CArgv) -> c_int)(file, argv) })
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: CPath, argv: CArgv, envp: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(|| unsafe { real!(execvpe: fn(CPath, CArgv, CArgv) -> c_int)(file, argv, envp) })
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: CArgv, envp: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(|| unsafe { real!(fexecve: fn(c_int, CArgv, CArgv) -> c_int)(fd, argv, envp) })
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: CPath,
    argv: CArgv,
    envp: CArgv,
    flags: c_int,
) -> c_int {
    // SAFETY: as above.
    around_exec(|| unsafe {
        real!(execveat: fn(c_int, CPath, CArgv, CArgv, c_int) -> c_int)(
            dirfd, path, argv, envp, flags,
        )
    })
}
