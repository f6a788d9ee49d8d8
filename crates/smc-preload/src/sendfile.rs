//! `sendfile`, `sendfile64`, `splice` to and from SMC-R connections.

use super::*;

/// `sendfile` into an SMC-R connection: the file is read straight into the
/// peer's RMB (`SmcStream::write_in_place`: `pread` into the lent space, the
/// kernel's copy the only one; through a buffer where the connection lends
/// none). A blocking socket takes all `count` bytes (or up to the end of the
/// file), a non-blocking one what fits now, as `sendfile` does; the file's
/// offset moves as far as the connection took.
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    match io(out) {
        // SAFETY: the caller's offset, if any.
        Io::Smc(c) => ret(unsafe { file_to_conn(&c, inp, off, count) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { file_to_remote(&r, inp, off, count) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendfile: fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t)(
                out, inp, off, count,
            )
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    match io(out) {
        // SAFETY: the caller's offset, if any (off64_t is off_t on 64-bit Linux).
        Io::Smc(c) => ret(unsafe { file_to_conn(&c, inp, off.cast(), count) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { file_to_remote(&r, inp, off.cast(), count) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendfile64: fn(c_int, c_int, *mut libc::off64_t, size_t) -> ssize_t)(
                out, inp, off, count,
            )
        },
    }
}

/// Where a `sendfile` from `f` starts: at `*off`, or (`off` null) at the
/// file's own offset.
///
/// # Safety
/// `off` is null or points to the caller's offset.
unsafe fn start_of(f: BorrowedFd<'_>, off: *const libc::off_t) -> io::Result<u64> {
    if off.is_null() {
        Ok(rustix::fs::seek(f, rustix::fs::SeekFrom::Current(0))?)
    } else {
        // SAFETY: the caller's offset (see above).
        Ok((unsafe { *off }) as u64)
    }
}

pub(crate) unsafe fn file_to_conn(
    c: &Conn,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> io::Result<usize> {
    let f = borrow(inp);
    // SAFETY: the caller's offset.
    let pos = unsafe { start_of(f, off) }?;
    let mut sent = 0usize;
    if count <= SMALL_FILE {
        // A small file (a web server's page) through a buffer and the
        // connection's own write: a copy more, but no lease of the peer's
        // buffer under the library's lock, which costs more than copying
        // this much.
        thread_local! {
            // (reused: zeroing a fresh one per call would cost more than
            // the copy)
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        sent = BUF.with(|b| -> io::Result<usize> {
            let mut buf = b.borrow_mut();
            if buf.len() < SMALL_FILE {
                buf.resize(SMALL_FILE, 0);
            }
            let n = rustix::io::pread(f, &mut buf[..count], pos)?;
            if n == 0 {
                return Ok(0);
            }
            crate::rw::write_all(c, &buf[..n], false).map_err(|e| write_failed(c, e, true))
        })?;
        // SAFETY: the caller's offset.
        unsafe { count_sent(f, off, pos, sent) }?;
        return Ok(sent);
    }
    while sent < count {
        let at = pos + sent as u64;
        match c
            .s
            .write_in_place(count - sent, |w| w.read_from(0, f, Some(at)))
        {
            // end of the file
            Ok(0) => break,
            Ok(n) => {
                sent += n;
                if c.s.is_nonblocking() {
                    break;
                }
            }
            Err(_) if sent > 0 => break,
            Err(e) if c.draws_reset(&e) => {
                // TCP's first write after the peer's close: it succeeds
                // (`rw::write_all`), as much as the file has
                let size = rustix::fs::fstat(f)?.st_size as u64;
                sent = usize::try_from(size.saturating_sub(pos)).map_or(count, |n| n.min(count));
                break;
            }
            Err(e) => return Err(write_failed(c, e, true)),
        }
    }
    // SAFETY: the caller's offset.
    unsafe { count_sent(f, off, pos, sent) }?;
    Ok(sent)
}

/// Up to this many bytes, `sendfile` copies through a buffer of its own.
const SMALL_FILE: usize = 16 << 10;

/// `sent` bytes of file `f` from `pos` went: its offset (`*off`, or the
/// file's own if `off` is null) moves past them.
///
/// # Safety
/// `off` is null or points to the caller's offset.
unsafe fn count_sent(
    f: BorrowedFd<'_>,
    off: *mut libc::off_t,
    pos: u64,
    sent: usize,
) -> io::Result<()> {
    if sent == 0 {
        return Ok(());
    }
    let end = pos + sent as u64;
    if off.is_null() {
        rustix::fs::seek(f, rustix::fs::SeekFrom::Start(end))?;
    } else {
        // SAFETY: the caller's offset (see above).
        unsafe { *off = end as libc::off_t };
    }
    Ok(())
}

/// [`file_to_conn`] for a connection a parent serves (`share.rs`): through
/// a buffer, the file's offset moved as far as the connection took.
unsafe fn file_to_remote(
    r: &crate::share::Remote,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> io::Result<usize> {
    let f = borrow(inp);
    // SAFETY: the caller's offset.
    let pos = unsafe { start_of(f, off) }?;
    let mut buf = vec![0u8; count.min(64 << 10)];
    let mut sent = 0usize;
    while sent < count {
        let want = (count - sent).min(buf.len());
        let n = rustix::io::pread(f, &mut buf[..want], pos + sent as u64)?;
        if n == 0 {
            break;
        }
        match r.send(&buf[..n], 0) {
            Ok(w) => {
                sent += w;
                if w < n {
                    break;
                }
            }
            Err(_) if sent > 0 => break,
            Err(e) => return Err(e),
        }
    }
    let end = pos + sent as u64;
    if off.is_null() {
        rustix::fs::seek(f, rustix::fs::SeekFrom::Start(end))?;
    } else {
        // SAFETY: as above.
        unsafe { *off = end as libc::off_t };
    }
    Ok(sent)
}

/// Whether `fd` is a pipe (or FIFO).
fn is_pipe(fd: c_int) -> bool {
    rustix::fs::fstat(borrow(fd)).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Fifo
    })
}

/// The bytes a pipe `fd` takes now without blocking (`usize::MAX` for a
/// descriptor that is not a pipe), waiting for room unless `dont_wait`
/// (`EAGAIN` then). A pipe holds whole pages, a write fills them from a
/// page of its own on (a partly filled one is not counted), so the room is
/// its free pages (fs/pipe.c `pipe_write`).
fn pipe_room(fd: c_int, dont_wait: bool) -> io::Result<usize> {
    let b = borrow(fd);
    if !is_pipe(fd) {
        return Ok(usize::MAX);
    }
    let page = rustix::param::page_size();
    loop {
        let size = rustix::pipe::fcntl_getpipe_size(b)?;
        let queued = rustix::io::ioctl_fionread(b)? as usize;
        let room = (size / page).saturating_sub(queued.div_ceil(page)) * page;
        if room > 0 {
            return Ok(room);
        }
        if dont_wait {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut p = [rustix::event::PollFd::new(
            &b,
            rustix::event::PollFlags::OUT,
        )];
        match rustix::event::poll(&mut p, None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// `splice` to or from an SMC-R connection, in place
/// (`SmcStream::write_in_place` / `read_in_place`): the kernel reads
/// `fd_in` straight into the peer's RMB, or writes our RMB straight to
/// `fd_out`, and only what went through is committed, so nothing is taken
/// from a pipe that the connection did not take, nor from the connection
/// that `fd_out` did not take. `SPLICE_F_NONBLOCK`: `EAGAIN` where the side
/// that is not the connection (or the connection for reading, as before)
/// has nothing now.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    let real_splice = real!(splice: fn(c_int, *mut libc::loff_t, c_int, *mut libc::loff_t, size_t, libc::c_uint) -> ssize_t);
    let dont_wait = flags & libc::SPLICE_F_NONBLOCK != 0;
    let (i, o) = if COUNT.load(Ordering::Acquire) == 0 {
        (Io::Kernel, Io::Kernel)
    } else {
        (io(fd_in), io(fd_out))
    };
    // (fs/splice.c `do_splice`: one end a pipe, and no offset for a socket:
    // EINVAL; the connection's side is a socket)
    let refused = match (&i, &o) {
        (Io::Smc(_), Io::Kernel) => !off_in.is_null() || !is_pipe(fd_out),
        (Io::Kernel, Io::Smc(_)) => !off_out.is_null() || !is_pipe(fd_in),
        _ => false,
    };
    if refused {
        set_errno(libc::EINVAL);
        return -1;
    }
    match (i, o) {
        (Io::Busy, _) | (_, Io::Busy) => busy(),
        (Io::Kernel, Io::Remote(r)) => {
            // (a connection a parent serves, share.rs: through a buffer,
            // sent whole before the next read)
            if dont_wait && !ready(fd_in, libc::POLLIN) {
                return fail(&io::ErrorKind::WouldBlock.into());
            }
            let mut buf = vec![0u8; len.min(64 << 10)];
            let n = if off_in.is_null() {
                rustix::io::read(borrow(fd_in), &mut buf)
            } else {
                // SAFETY: the caller's offset.
                let at = unsafe { *off_in } as u64;
                rustix::io::pread(borrow(fd_in), &mut buf, at).inspect(|n| {
                    // SAFETY: as above.
                    unsafe { *off_in += *n as libc::loff_t };
                })
            };
            let n = match n {
                Ok(n) => n,
                Err(e) => return fail(&e.into()),
            };
            let mut done = 0;
            while done < n {
                match r.send(&buf[done..n], 0) {
                    Ok(w) => done += w,
                    Err(e) => return fail(&e),
                }
            }
            n as ssize_t
        }
        (Io::Remote(r), Io::Kernel) => {
            let mut buf = vec![0u8; len.min(64 << 10)];
            let got = match r.recv(&mut buf, if dont_wait { libc::MSG_DONTWAIT } else { 0 }) {
                Ok(n) => n,
                Err(e) => return fail(&e),
            };
            // SAFETY: the caller's offset, if any.
            match unsafe { write_out(fd_out, off_out, &buf[..got]) } {
                Ok(()) => got as ssize_t,
                Err(e) => fail(&e),
            }
        }
        (Io::Kernel, Io::Smc(c)) => {
            // Straight from `fd_in` into the peer's RMB: what is read is
            // what is sent, nothing is taken from a pipe that the connection
            // did not take.
            if dont_wait && !ready(fd_in, libc::POLLIN) {
                return fail(&io::ErrorKind::WouldBlock.into());
            }
            // SAFETY: the caller's offset, if any.
            let at = (!off_in.is_null()).then(|| unsafe { *off_in } as u64);
            match c
                .s
                .write_in_place(len, |w| w.read_from(0, borrow(fd_in), at))
            {
                Ok(n) => {
                    if !off_in.is_null() {
                        // SAFETY: as above.
                        unsafe { *off_in += n as libc::loff_t };
                    }
                    n as ssize_t
                }
                Err(e) if c.draws_reset(&e) => {
                    // TCP's first write after the peer's close succeeds
                    // (`rw::write_all`): it takes what the pipe gives, up
                    // to `len`, as its splice would move it to the socket
                    // (`fd_in` is the pipe: the socket is the other end;
                    // the refused write took nothing from it)
                    let mut buf = vec![0u8; len.min(64 << 10)];
                    match rustix::io::read(borrow(fd_in), &mut buf) {
                        Ok(n) => n as ssize_t,
                        Err(e) => fail(&e.into()),
                    }
                }
                Err(e) => fail(&write_failed(&c, e, true)),
            }
        }
        (Io::Smc(c), Io::Kernel) if c.peeked.lock().is_ok_and(|p| p.is_empty()) => {
            // Straight from our RMB into `fd_out`: only what it took is
            // consumed, the rest stays for the next read.
            if dont_wait
                && !c
                    .s
                    .readiness_fd()
                    .is_ok_and(|r| ready(r.as_raw_fd(), libc::POLLIN))
            {
                return fail(&io::ErrorKind::WouldBlock.into());
            }
            // (into a pipe: what it has room for, as TCP's splice moves
            // (tcp.c `tcp_splice_read`); one write of more into a blocking
            // pipe would wait for a reader that may be this thread)
            let len = match pipe_room(fd_out, dont_wait) {
                Ok(room) => len.min(room),
                Err(e) => return fail(&e),
            };
            // SAFETY: the caller's offset, if any.
            let at = (!off_out.is_null()).then(|| unsafe { *off_out } as u64);
            match c
                .s
                .read_in_place(len, |r| r.write_to(0, r.len(), borrow(fd_out), at))
            {
                Ok(n) => {
                    if !off_out.is_null() {
                        // SAFETY: as above.
                        unsafe { *off_out += n as libc::loff_t };
                    }
                    n as ssize_t
                }
                Err(e) => fail(&e),
            }
        }
        (Io::Smc(c), Io::Kernel) => {
            // (bytes a MSG_PEEK kept first: through a buffer)
            let mut buf = vec![0u8; len.min(64 << 10)];
            let got = match conn_recv(&c, &mut buf, if dont_wait { libc::MSG_DONTWAIT } else { 0 })
            {
                Ok(n) => n,
                Err(e) => return fail(&e),
            };
            // SAFETY: the caller's offset, if any.
            match unsafe { write_out(fd_out, off_out, &buf[..got]) } {
                Ok(()) => got as ssize_t,
                Err(e) => fail(&e),
            }
        }
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real_splice(fd_in, off_in, fd_out, off_out, len, flags) },
    }
}

/// All of `buf` to `fd_out` (at `*off_out`, moved on, if not null), for
/// bytes already taken from a connection: waits while `fd_out` is full.
unsafe fn write_out(fd_out: c_int, off_out: *mut libc::loff_t, buf: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let w = if off_out.is_null() {
            rustix::io::write(borrow(fd_out), &buf[done..])
        } else {
            // SAFETY: the caller's offset.
            let at = unsafe { *off_out } as u64;
            rustix::io::pwrite(borrow(fd_out), &buf[done..], at).inspect(|n| {
                // SAFETY: as above.
                unsafe { *off_out += *n as libc::loff_t };
            })
        };
        match w {
            Ok(n) => done += n,
            Err(rustix::io::Errno::AGAIN) => wait_writable(fd_out),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Whether `fd` polls `events` now (the real `poll`, not waiting).
fn ready(fd: RawFd, events: libc::c_short) -> bool {
    let mut p = [pollfd {
        fd,
        events,
        revents: 0,
    }];
    // SAFETY: our own pollfd.
    let n = unsafe { real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int)(p.as_mut_ptr(), 1, 0) };
    n > 0 && p[0].revents & (events | libc::POLLHUP | libc::POLLERR) != 0
}

/// Waits (at most 1 s, then the caller retries) until `fd` can take more
/// bytes, with the real `poll`: `fd` is a descriptor of the library's own or
/// one the library does not carry, never one to route back into the table.
fn wait_writable(fd: RawFd) {
    let mut p = [pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    }];
    // SAFETY: our own pollfd.
    unsafe { real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int)(p.as_mut_ptr(), 1, 1000) };
}
