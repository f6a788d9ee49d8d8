//! The read/write family: `read`, `write`, `readv`, `writev`, `recv`, `send`,
//! `recvfrom`, `sendto`, `recvmsg`, `sendmsg`.

use super::*;

/// Reads for `recv(flags)` into `buf`.
pub(crate) fn conn_recv(c: &Conn, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
    if flags & libc::MSG_OOB != 0 {
        return match c.s.recv_oob()? {
            Some(b) if !buf.is_empty() => {
                buf[0] = b;
                Ok(1)
            }
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
    }
    let dont_wait = flags & libc::MSG_DONTWAIT != 0;
    let all = libc::MSG_PEEK | libc::MSG_WAITALL;
    if flags & all == all && buf.len() > 1 {
        return peek_all(c, buf, dont_wait);
    }
    let peek = flags & libc::MSG_PEEK != 0;
    {
        let mut p = c.peeked.lock().unwrap_or_else(|e| e.into_inner());
        if !p.is_empty() {
            // Bytes read ahead first, and what has come behind them, as a
            // TCP read returns its whole receive queue up to the length
            // (without waiting: what was read ahead is enough to return).
            if p.len() < buf.len() {
                let mut tmp = vec![0u8; buf.len() - p.len()];
                if let Ok(m) = c.s.read_with(&mut tmp, true) {
                    p.extend_from_slice(&tmp[..m]);
                }
            }
            let n = buf.len().min(p.len());
            buf[..n].copy_from_slice(&p[..n]);
            if !peek {
                p.drain(..n);
            }
            return Ok(n);
        }
    }
    if peek {
        // (on SMC-R the bytes stay where the connection's readiness shows
        // them; a fallback's are read ahead)
        if let Some(r) = c.s.peek_with(buf, dont_wait) {
            return r;
        }
        let mut tmp = vec![0u8; buf.len()];
        let n = c.s.read_with(&mut tmp, dont_wait)?;
        buf[..n].copy_from_slice(&tmp[..n]);
        c.peeked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(&tmp[..n]);
        return Ok(n);
    }
    if flags & libc::MSG_WAITALL != 0 && !dont_wait {
        let mut got = 0;
        while got < buf.len() {
            match c.s.read_with(&mut buf[got..], false) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if got > 0 && e.kind() != io::ErrorKind::Interrupted => break,
                Err(e) => return Err(e),
            }
        }
        return Ok(got);
    }
    c.s.read_with(buf, dont_wait)
}

/// `recv(MSG_PEEK | MSG_WAITALL)`: waits until the whole length can be
/// copied, as TCP's peek does (tcp.c `tcp_recvmsg_locked`: `MSG_WAITALL`
/// makes the whole length its target, for a peek too), and returns less
/// only at the end of the stream, at the timeout, or without waiting: what
/// is there then.
fn peek_all(c: &Conn, buf: &mut [u8], dont_wait: bool) -> io::Result<usize> {
    if c.peeked
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_empty()
    {
        if let Some(r) = c.s.peek_all_with(buf, dont_wait) {
            return r;
        }
    }
    // Bytes read ahead (a fallback's, or those a failed write took in,
    // `tcp_write_error`): read ahead more until the whole length is there.
    let peek = libc::MSG_PEEK | if dont_wait { libc::MSG_DONTWAIT } else { 0 };
    loop {
        let n = conn_recv(c, buf, peek)?;
        if n == 0 || n == buf.len() || dont_wait || c.s.is_nonblocking() {
            return Ok(n);
        }
        let mut tmp = vec![0u8; buf.len() - n];
        match c.s.read_with(&mut tmp, false) {
            Ok(m) if m > 0 => c
                .peeked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&tmp[..m]),
            // the end of the stream, the timeout, an error: what is there
            _ => return Ok(n),
        }
    }
}

/// Writes for `send(flags)`: all of it unless non-blocking, as TCP does.
pub(crate) fn conn_send(c: &Conn, buf: &[u8], flags: c_int) -> io::Result<usize> {
    let dont_wait = flags & libc::MSG_DONTWAIT != 0;
    let r = (|| {
        if flags & libc::MSG_OOB != 0 && !buf.is_empty() {
            let n = write_all(c, &buf[..buf.len() - 1], dont_wait)?;
            if n < buf.len() - 1 {
                return Ok(n);
            }
            c.s.send_oob(buf[buf.len() - 1])?;
            return Ok(buf.len());
        }
        write_all(c, buf, dont_wait)
    })();
    r.map_err(|e| write_failed(c, e, flags & libc::MSG_NOSIGNAL == 0))
}

/// A failed write's error as TCP's ([`tcp_write_error`]), with `SIGPIPE`
/// raised, as the kernel does, for a peer that is gone, if `signal`.
pub(crate) fn write_failed(c: &Conn, e: io::Error, signal: bool) -> io::Error {
    let e = tcp_write_error(c, e);
    if e.kind() == io::ErrorKind::BrokenPipe && signal {
        // SAFETY: raise has no preconditions.
        unsafe { libc::raise(libc::SIGPIPE) };
    }
    e
}

/// A write's error as TCP's: SMC (as Linux AF_SMC) says `ECONNRESET` to a
/// write after the peer closed, where TCP, whose peer answers the data with
/// a reset in `CLOSE_WAIT`, says `EPIPE` (tcp_input.c `tcp_reset`) and
/// raises `SIGPIPE`. A peer that closed shows end of file (or data before
/// it, kept for the next read); one that reset or aborted, an error.
pub(crate) fn tcp_write_error(c: &Conn, e: io::Error) -> io::Error {
    if e.kind() != io::ErrorKind::ConnectionReset {
        return e;
    }
    let mut p = c.peeked.lock().unwrap_or_else(|e| e.into_inner());
    let mut tmp = vec![0u8; 64 << 10];
    loop {
        match c.s.read_with(&mut tmp, true) {
            Ok(0) => return io::Error::from(io::ErrorKind::BrokenPipe),
            Ok(n) => p.extend_from_slice(&tmp[..n]),
            Err(_) => return e,
        }
    }
}

pub(crate) fn write_all(c: &Conn, buf: &[u8], dont_wait: bool) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match c.s.write_with(&buf[done..], dont_wait) {
            Ok(n) => done += n,
            Err(e) if done > 0 && e.kind() != io::ErrorKind::Interrupted => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The caller's buffer.
pub(crate) unsafe fn slice_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if buf.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller passes `n` writable bytes at `buf`.
    unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }
}

pub(crate) unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller passes `n` readable bytes at `buf`.
    unsafe { std::slice::from_raw_parts(buf.cast(), n) }
}

pub(crate) fn ret(r: io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, 0)),
        // SAFETY: as above.
        Io::Remote(r) => ret(r.recv(unsafe { slice_mut(buf, n) }, 0)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe { real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, flags)),
        // SAFETY: as above.
        Io::Remote(r) => ret(r.recv(unsafe { slice_mut(buf, n) }, flags)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    match io(fd) {
        Io::Smc(c) => {
            if !alen.is_null() {
                // SAFETY: the caller's length; a connected stream has no source address
                unsafe { *alen = 0 };
            }
            // SAFETY: the caller's buffer of `n` bytes.
            ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, flags))
        }
        Io::Remote(r) => {
            if !alen.is_null() {
                // SAFETY: as above.
                unsafe { *alen = 0 };
            }
            // SAFETY: as above.
            ret(r.recv(unsafe { slice_mut(buf, n) }, flags))
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t)(
                fd, buf, n, flags, addr, alen,
            )
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, 0)),
        // SAFETY: as above.
        Io::Remote(r) => ret(r.send(unsafe { slice(buf, n) }, 0)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(write: fn(c_int, *const c_void, size_t) -> ssize_t)(fd, buf, n)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, flags)),
        // SAFETY: as above.
        Io::Remote(r) => ret(r.send(unsafe { slice(buf, n) }, flags)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(send: fn(c_int, *const c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes (a connected stream ignores the address).
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, flags)),
        // SAFETY: as above.
        Io::Remote(r) => ret(r.send(unsafe { slice(buf, n) }, flags)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t)(
                fd, buf, n, flags, addr, alen,
            )
        },
    }
}

/// The caller's iovecs.
pub(crate) unsafe fn iovs<'a>(iov: *const iovec, cnt: c_int) -> &'a [iovec] {
    if iov.is_null() || cnt <= 0 {
        return &[];
    }
    // SAFETY: the caller passes `cnt` iovecs at `iov`.
    unsafe { std::slice::from_raw_parts(iov, cnt as usize) }
}

/// Reads for `readv`/`recvmsg`: one read (`recv`, of a connection) into a
/// buffer of their total size, scattered over them.
pub(crate) unsafe fn recv_iov(
    recv: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    iov: &[iovec],
) -> io::Result<usize> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut tmp = vec![0u8; total.min(4 << 20)];
    let n = recv(&mut tmp)?;
    let mut off = 0;
    for v in iov {
        if off >= n {
            break;
        }
        let k = v.iov_len.min(n - off);
        // SAFETY: the caller's iovec of `iov_len` writable bytes.
        unsafe { slice_mut(v.iov_base, k) }.copy_from_slice(&tmp[off..off + k]);
        off += k;
    }
    Ok(n)
}

/// Writes for `writev`/`sendmsg`: one iovec after the other (`send`, of a
/// connection).
pub(crate) unsafe fn send_iov(
    mut send: impl FnMut(&[u8]) -> io::Result<usize>,
    iov: &[iovec],
) -> io::Result<usize> {
    let mut done = 0;
    for v in iov {
        // SAFETY: the caller's iovec of `iov_len` readable bytes.
        let b = unsafe { slice(v.iov_base, v.iov_len) };
        match send(b) {
            Ok(n) => {
                done += n;
                if n < b.len() {
                    break;
                }
            }
            Err(e) if done > 0 && e.kind() != io::ErrorKind::BrokenPipe => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's iovecs.
        Io::Smc(c) => ret(unsafe { recv_iov(|b| conn_recv(&c, b, 0), iovs(iov, cnt)) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { recv_iov(|b| r.recv(b, 0), iovs(iov, cnt)) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(readv: fn(c_int, *const iovec, c_int) -> ssize_t)(fd, iov, cnt)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's iovecs.
        Io::Smc(c) => ret(unsafe { send_iov(|b| conn_send(&c, b, 0), iovs(iov, cnt)) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { send_iov(|b| r.send(b, 0), iovs(iov, cnt)) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(writev: fn(c_int, *const iovec, c_int) -> ssize_t)(fd, iov, cnt)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match io(fd) {
        Io::Smc(c) if !msg.is_null() => {
            // SAFETY: the caller's message header.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: its iovecs.
            ret(unsafe {
                recv_iov(
                    |b| conn_recv(&c, b, flags),
                    iovs(m.msg_iov, m.msg_iovlen as c_int),
                )
            })
        }
        Io::Remote(r) if !msg.is_null() => {
            // SAFETY: the caller's message header.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: its iovecs.
            ret(unsafe { recv_iov(|b| r.recv(b, flags), iovs(m.msg_iov, m.msg_iovlen as c_int)) })
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(recvmsg: fn(c_int, *mut msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match io(fd) {
        Io::Smc(c) if !msg.is_null() => {
            // SAFETY: the caller's message header and its iovecs.
            let m = unsafe { &*msg };
            ret(unsafe {
                send_iov(
                    |b| conn_send(&c, b, flags),
                    iovs(m.msg_iov, m.msg_iovlen as c_int),
                )
            })
        }
        Io::Remote(r) if !msg.is_null() => {
            // SAFETY: the caller's message header and its iovecs.
            let m = unsafe { &*msg };
            ret(unsafe { send_iov(|b| r.send(b, flags), iovs(m.msg_iov, m.msg_iovlen as c_int)) })
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(sendmsg: fn(c_int, *const msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}
