//! The read/write family: `read`, `write`, `readv`, `writev`, `recv`, `send`,
//! `recvfrom`, `sendto`, `recvmsg`, `sendmsg`.
//!
//! The interposed calls take the caller's arguments as the kernel does
//! before its socket reads or writes anything (the iovecs, a length of
//! zero, a NULL buffer, `MSG_TRUNC`, `MSG_ERRQUEUE`: `recv_buf`, `iovs`,
//! `recv_iov`, `send_buf`, `send_iov`), then hand the bytes to the
//! connection ([`Side`]: one of ours, or in a forked child its parent's).

use super::*;

/// The most iovecs one call takes (the kernel's `UIO_MAXIOV`, glibc's
/// `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// The most bytes one read or write moves (the kernel's `MAX_RW_COUNT`,
/// `INT_MAX` rounded down to a 4 KiB page): a longer length is cut to it,
/// as the kernel cuts it (lib/iov_iter.c `import_ubuffer`,
/// `__import_iovec`).
const MAX_RW: usize = 0x7fff_f000;

/// What a `MSG_TRUNC` read takes per round through its scratch buffer.
const DISCARD_CHUNK: usize = 64 << 10;

/// The most a peek can find on a connection that fell back to TCP (its
/// bytes are the kernel's, whose receive buffer is not asked for).
const TCP_PEEK_ROOM: usize = 16 << 20;

/// A connection the read/write family serves: one of ours ([`Conn`]), or,
/// in a forked child, its parent's ([`crate::share::Remote`]).
pub(crate) trait Side {
    /// `recv(flags)` into `buf`.
    fn rx(&self, buf: &mut [u8], flags: c_int) -> io::Result<usize>;
    /// `send(flags)` of `buf`.
    fn tx(&self, buf: &[u8], flags: c_int) -> io::Result<usize>;
    /// Whether a read with `flags` waits for bytes (blocking mode, no
    /// `MSG_DONTWAIT`).
    fn waits(&self, flags: c_int) -> bool;
    /// The most bytes a peek can find (what the receive buffer holds).
    fn peek_room(&self) -> usize;
}

impl Side for Conn {
    fn rx(&self, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
        match conn_recv(self, buf, flags) {
            // (a reset reported before: end of file, `Conn::report_once`)
            Err(e) => self.report_once(e).map_or(Ok(0), Err),
            r => r,
        }
    }

    fn tx(&self, buf: &[u8], flags: c_int) -> io::Result<usize> {
        conn_send(self, buf, flags)
    }

    fn waits(&self, flags: c_int) -> bool {
        flags & libc::MSG_DONTWAIT == 0 && !self.s.is_nonblocking()
    }

    fn peek_room(&self) -> usize {
        let ahead = self.peeked.lock().unwrap_or_else(|e| e.into_inner()).len();
        ahead + self.s.buffer_sizes().map_or(TCP_PEEK_ROOM, |(rmb, _)| rmb)
    }
}

impl Side for crate::share::Remote {
    fn rx(&self, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
        self.recv(buf, flags)
    }

    fn tx(&self, buf: &[u8], flags: c_int) -> io::Result<usize> {
        self.send(buf, flags)
    }

    fn waits(&self, flags: c_int) -> bool {
        flags & libc::MSG_DONTWAIT == 0 && !self.is_nonblocking()
    }

    fn peek_room(&self) -> usize {
        // (the owner answers a request with at most this much)
        crate::share::CHUNK
    }
}

fn err(e: c_int) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// Reads for `recv(flags)` into `buf`.
pub(crate) fn conn_recv(c: &Conn, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
    if flags & libc::MSG_OOB != 0 {
        return match c.s.recv_oob()? {
            Some(b) if !buf.is_empty() => {
                buf[0] = b;
                Ok(1)
            }
            _ => Err(err(libc::EINVAL)),
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
        if buf.is_empty() {
            // (nothing to write, but the connection's state to say: see
            // `send_nothing`)
            return c.s.write_with(buf, dont_wait);
        }
        if flags & libc::MSG_OOB != 0 {
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
    // (a reset reported before: EPIPE, `Conn::report_once`)
    let e = c
        .report_once(e)
        .unwrap_or_else(|| io::ErrorKind::BrokenPipe.into());
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

/// Writes `buf`, all of it unless `dont_wait` or the stream is
/// non-blocking. A first write after the peer closed the connection is
/// TCP's into `CLOSE_WAIT`: it succeeds, and the reset it draws ends the
/// connection with `EPIPE` (`Conn::draws_reset`), where an SMC socket
/// fails it at once.
pub(crate) fn write_all(c: &Conn, buf: &[u8], dont_wait: bool) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match c.s.write_with(&buf[done..], dont_wait) {
            Ok(n) => done += n,
            Err(e) if done > 0 && e.kind() != io::ErrorKind::Interrupted => break,
            Err(e) if c.draws_reset(&e) => return Ok(buf.len()),
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The caller's buffer (none at NULL; at most `MAX_RW` bytes, which also
/// keeps the slice within `isize::MAX`).
pub(crate) unsafe fn slice_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if buf.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller passes `n` writable bytes at `buf`.
    unsafe { std::slice::from_raw_parts_mut(buf.cast(), n.min(MAX_RW)) }
}

pub(crate) unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller passes `n` readable bytes at `buf`.
    unsafe { std::slice::from_raw_parts(buf.cast(), n.min(MAX_RW)) }
}

/// `recv(flags)` of up to `n` bytes into the caller's `buf`, as TCP takes
/// its arguments (tcp.c `tcp_recvmsg_locked`): a length of zero, a NULL
/// buffer and `MSG_TRUNC` copy nothing into it (`recv_nothing`,
/// `discard`); the common read pays a few comparisons for them.
pub(crate) unsafe fn recv_buf(
    s: &impl Side,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
) -> io::Result<usize> {
    if (n == 0 || buf.is_null() || flags & libc::MSG_TRUNC != 0) && flags & libc::MSG_OOB == 0 {
        // (the urgent byte is tcp.c `tcp_recv_urg`'s, taken as before)
        let n = n.min(MAX_RW);
        return if flags & libc::MSG_TRUNC != 0 {
            discard(s, n, flags)
        } else {
            recv_nothing(s, n, flags)
        };
    }
    // SAFETY: the caller's buffer of `n` bytes.
    s.rx(unsafe { slice_mut(buf, n) }, flags)
}

/// A read that copies nothing: of zero bytes, or into a NULL buffer. TCP
/// waits for bytes as any read does (tcp.c `tcp_recvmsg_locked`: its
/// target is at least one byte) and then copies: nothing for a length of
/// zero, which returns 0, also where a blocking read's wait ended at its
/// timeout (the kernel's loop for a length of zero runs once); a fault at
/// the first byte for NULL (`EFAULT`, nothing taken). Without bytes and
/// without waiting `EAGAIN`; at the end of the stream 0. (NULL is the one
/// bad address the library can tell without the kernel: any other is the
/// caller's to get right, as with every library call.)
fn recv_nothing(s: &impl Side, n: usize, flags: c_int) -> io::Result<usize> {
    let mut one = [0u8; 1];
    let look = (flags | libc::MSG_PEEK) & !(libc::MSG_WAITALL | libc::MSG_TRUNC);
    match s.rx(&mut one, look) {
        Ok(0) => Ok(0),
        Ok(_) if n == 0 => Ok(0),
        Ok(_) => Err(err(libc::EFAULT)),
        Err(e) if n == 0 && e.kind() == io::ErrorKind::WouldBlock && s.waits(flags) => Ok(0),
        Err(e) => Err(e),
    }
}

/// `MSG_TRUNC`: the bytes a read of `n` would return are taken without
/// being copied to the caller, and counted (tcp.c `tcp_recvmsg_locked`
/// skips the copy); with `MSG_PEEK` only counted. The caller's buffer is
/// not touched (it may be NULL); the bytes go through a scratch buffer.
fn discard(s: &impl Side, n: usize, flags: c_int) -> io::Result<usize> {
    let flags = flags & !libc::MSG_TRUNC;
    if n == 0 {
        return recv_nothing(s, 0, flags);
    }
    if flags & libc::MSG_PEEK != 0 {
        let mut tmp = vec![0u8; n.min(s.peek_room())];
        return s.rx(&mut tmp, flags);
    }
    let all = flags & libc::MSG_WAITALL != 0;
    let mut tmp = vec![0u8; n.min(DISCARD_CHUNK)];
    let mut got = 0;
    while got < n {
        let k = (n - got).min(tmp.len());
        // The first round waits as the caller's read would; then what has
        // come (the whole length with MSG_WAITALL), as one TCP read takes
        // its whole receive queue up to the length.
        let f = if got == 0 || all {
            flags
        } else {
            flags | libc::MSG_DONTWAIT
        };
        match s.rx(&mut tmp[..k], f) {
            Ok(m) => {
                got += m;
                if m < k {
                    break;
                }
            }
            Err(_) if got > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// `send(flags)` of `n` bytes at the caller's `buf`: a length of zero and
/// a NULL buffer copy nothing (`send_nothing`); the common write pays two
/// comparisons for them.
pub(crate) unsafe fn send_buf(
    s: &impl Side,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
) -> io::Result<usize> {
    if n == 0 || buf.is_null() {
        return send_nothing(s, n, flags);
    }
    // SAFETY: the caller's buffer of `n` bytes.
    s.tx(unsafe { slice(buf, n) }, flags)
}

/// A write that copies nothing: of zero bytes, or from a NULL buffer. TCP
/// looks at the connection before it copies (tcp.c `tcp_sendmsg_locked`:
/// `EPIPE`, and `SIGPIPE` unless `MSG_NOSIGNAL`, once sending is shut
/// down; the error of a failed connection), then copies nothing for a
/// length of zero (0) and faults at NULL (`EFAULT`, nothing sent). (Where
/// the send buffer is full a non-blocking TCP write says `EAGAIN` before
/// it faults; this does not look.)
fn send_nothing(s: &impl Side, n: usize, flags: c_int) -> io::Result<usize> {
    s.tx(&[], flags)?;
    match n {
        0 => Ok(0),
        _ => Err(err(libc::EFAULT)),
    }
}

pub(crate) fn ret(r: io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    // (net/socket.c `sock_read_iter`: a read of nothing returns 0 at once,
    // where `recv` of nothing waits as a read does)
    match io(fd) {
        Io::Smc(_) | Io::Remote(_) | Io::Busy if n == 0 => 0,
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(unsafe { recv_buf(&*c, buf, n, 0) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { recv_buf(&*r, buf, n, 0) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe { real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, n) },
    }
}

// `MSG_ERRQUEUE` reads the socket's error queue (tcp.c `tcp_recvmsg`:
// `inet_recv_error`), which is the kernel's TCP socket's also on SMC-R,
// never the connection's bytes: the real call.

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    let errq = flags & libc::MSG_ERRQUEUE != 0;
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) if !errq => ret(unsafe { recv_buf(&*c, buf, n, flags) }),
        // SAFETY: as above.
        Io::Remote(r) if !errq => ret(unsafe { recv_buf(&*r, buf, n, flags) }),
        Io::Busy if !errq => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe {
            real!(recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags)
        },
    }
}

/// A connected stream's `recvfrom`: no source address, whose length says
/// so where one was asked for (net/socket.c `__sys_recvfrom`: after a
/// read that succeeded, and only with an address).
unsafe fn recv_from(
    s: &impl Side,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> io::Result<usize> {
    // SAFETY: the caller's buffer of `n` bytes.
    let r = unsafe { recv_buf(s, buf, n, flags) };
    if r.is_ok() && !addr.is_null() && !alen.is_null() {
        // SAFETY: the caller's length.
        unsafe { *alen = 0 };
    }
    r
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
    let errq = flags & libc::MSG_ERRQUEUE != 0;
    match io(fd) {
        // SAFETY: the caller's arguments.
        Io::Smc(c) if !errq => ret(unsafe { recv_from(&*c, buf, n, flags, addr, alen) }),
        // SAFETY: as above.
        Io::Remote(r) if !errq => ret(unsafe { recv_from(&*r, buf, n, flags, addr, alen) }),
        Io::Busy if !errq => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe {
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
        Io::Smc(c) => ret(unsafe { send_buf(&*c, buf, n, 0) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { send_buf(&*r, buf, n, 0) }),
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
        Io::Smc(c) => ret(unsafe { send_buf(&*c, buf, n, flags) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { send_buf(&*r, buf, n, flags) }),
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
        Io::Smc(c) => ret(unsafe { send_buf(&*c, buf, n, flags) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { send_buf(&*r, buf, n, flags) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t)(
                fd, buf, n, flags, addr, alen,
            )
        },
    }
}

/// The caller's iovecs, as the kernel takes them before its socket sees
/// them.
pub(crate) struct Iovs<'a> {
    pub(crate) v: &'a [iovec],
    /// Their total length, cut to `MAX_RW`.
    pub(crate) total: usize,
    /// Whether one of them is at NULL with a length.
    pub(crate) null: bool,
}

/// The caller's `cnt` iovecs at `iov`, checked as the kernel checks them
/// before anything is read or written (lib/iov_iter.c `iovec_from_user`,
/// `__import_iovec`): more than `IOV_MAX` is `too_many` (`EINVAL` for
/// `readv`/`writev`, whose negative count is a large one here too;
/// `EMSGSIZE` for `recvmsg`/`sendmsg`, net/socket.c `__copy_msghdr`), an
/// array at NULL `EFAULT`, a length above `SSIZE_MAX` `EINVAL`; none is
/// fine. An iovec at NULL with a length is not refused here: the kernel
/// faults at it once it copies (`recv_iov`, `send_iov`).
pub(crate) unsafe fn iovs<'a>(
    iov: *const iovec,
    cnt: usize,
    too_many: c_int,
) -> io::Result<Iovs<'a>> {
    if cnt > IOV_MAX {
        return Err(err(too_many));
    }
    if cnt == 0 {
        return Ok(Iovs {
            v: &[],
            total: 0,
            null: false,
        });
    }
    if iov.is_null() {
        return Err(err(libc::EFAULT));
    }
    // SAFETY: the caller passes `cnt` iovecs at `iov`.
    let v = unsafe { std::slice::from_raw_parts(iov, cnt) };
    let (mut total, mut null) = (0usize, false);
    for x in v {
        if x.iov_len > isize::MAX as usize {
            return Err(err(libc::EINVAL));
        }
        total = total.saturating_add(x.iov_len);
        null |= x.iov_base.is_null() && x.iov_len > 0;
    }
    Ok(Iovs {
        v,
        total: total.min(MAX_RW),
        null,
    })
}

/// Reads for `readv`/`recvmsg`: one read (`recv(flags)`) into a buffer of
/// their total size, scattered over them. A total of zero, an iovec at
/// NULL and `MSG_TRUNC` copy nothing (`recv_buf`): the kernel copies what
/// it reads over the iovecs in one go, so that a fault at a NULL one takes
/// nothing (tcp.c `tcp_recvmsg_locked`; where the bytes there are end
/// before it, the kernel's read succeeds, which is not modelled).
pub(crate) unsafe fn recv_iov(s: &impl Side, iov: &Iovs, flags: c_int) -> io::Result<usize> {
    if (iov.total == 0 || iov.null || flags & libc::MSG_TRUNC != 0) && flags & libc::MSG_OOB == 0 {
        return if flags & libc::MSG_TRUNC != 0 {
            discard(s, iov.total, flags)
        } else {
            recv_nothing(s, if iov.null { iov.total } else { 0 }, flags)
        };
    }
    let mut tmp = vec![0u8; iov.total.min(4 << 20)];
    let n = s.rx(&mut tmp, flags)?;
    let mut off = 0;
    for v in iov.v {
        if off >= n {
            break;
        }
        let k = v.iov_len.min(n - off);
        // SAFETY: the caller's iovec of `iov_len` writable bytes (none at
        // NULL, where only an urgent byte's read comes).
        let to = unsafe { slice_mut(v.iov_base, k) };
        to.copy_from_slice(&tmp[off..off + to.len()]);
        off += k;
    }
    Ok(n)
}

/// Writes for `writev`/`sendmsg`: one iovec after the other
/// (`send(flags)`). An iovec at NULL with a length faults before anything
/// is sent (`send_nothing`): the kernel copies a write whole where it is
/// small, so that a fault anywhere in it sends none of it (tcp.c
/// `tcp_sendmsg_locked`; a large one goes in pieces, and those before the
/// fault go, which is not modelled). A total of zero: as `send` of
/// nothing.
pub(crate) unsafe fn send_iov(s: &impl Side, iov: &Iovs, flags: c_int) -> io::Result<usize> {
    if iov.total == 0 || iov.null {
        return send_nothing(s, iov.total, flags);
    }
    let mut done = 0;
    for v in iov.v {
        // SAFETY: the caller's iovec of `iov_len` readable bytes.
        let b = unsafe { slice(v.iov_base, v.iov_len) };
        if b.is_empty() {
            continue;
        }
        match s.tx(b, flags) {
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

/// `readv` on a connection. (fs/read_write.c `vfs_readv`: a total of zero
/// returns 0 at once, as `read` of nothing.)
unsafe fn read_v(s: &impl Side, iov: *const iovec, cnt: c_int) -> io::Result<usize> {
    // (a negative count is too many)
    let cnt = usize::try_from(cnt).unwrap_or(usize::MAX);
    // SAFETY: the caller's iovecs.
    let v = unsafe { iovs(iov, cnt, libc::EINVAL) }?;
    match v.total {
        0 => Ok(0),
        // SAFETY: as above.
        _ => unsafe { recv_iov(s, &v, 0) },
    }
}

/// `writev` on a connection. (fs/read_write.c `vfs_writev`: a total of
/// zero returns 0 at once, without the socket, where `write` of nothing
/// looks at it.)
unsafe fn write_v(s: &impl Side, iov: *const iovec, cnt: c_int) -> io::Result<usize> {
    // (a negative count is too many)
    let cnt = usize::try_from(cnt).unwrap_or(usize::MAX);
    // SAFETY: the caller's iovecs.
    let v = unsafe { iovs(iov, cnt, libc::EINVAL) }?;
    match v.total {
        0 => Ok(0),
        // SAFETY: as above.
        _ => unsafe { send_iov(s, &v, 0) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's iovecs.
        Io::Smc(c) => ret(unsafe { read_v(&*c, iov, cnt) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { read_v(&*r, iov, cnt) }),
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
        Io::Smc(c) => ret(unsafe { write_v(&*c, iov, cnt) }),
        // SAFETY: as above.
        Io::Remote(r) => ret(unsafe { write_v(&*r, iov, cnt) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(writev: fn(c_int, *const iovec, c_int) -> ssize_t)(fd, iov, cnt)
        },
    }
}

/// `recvmsg` on a connection: the bytes into the iovecs, then what the
/// header says back (net/socket.c `____sys_recvmsg`, after a read that
/// succeeded only: a failed one leaves the header as it was): an
/// address's length of 0 where an address was asked for (a connected
/// stream has none), no control messages, no flags. (`TCP_INQ`,
/// `SO_TIMESTAMP*` control messages are not given.)
unsafe fn recv_msg(s: &impl Side, msg: *mut msghdr, flags: c_int) -> io::Result<usize> {
    // SAFETY: the caller's message header.
    let (iov, len, name) = unsafe { ((*msg).msg_iov, (*msg).msg_iovlen, (*msg).msg_name) };
    // SAFETY: its iovecs.
    let v = unsafe { iovs(iov, len, libc::EMSGSIZE) }?;
    // SAFETY: as above.
    let n = unsafe { recv_iov(s, &v, flags) }?;
    // SAFETY: the caller's message header.
    unsafe {
        if !name.is_null() {
            (*msg).msg_namelen = 0;
        }
        (*msg).msg_controllen = 0;
        (*msg).msg_flags = 0;
    }
    Ok(n)
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let ours = !msg.is_null() && flags & libc::MSG_ERRQUEUE == 0;
    match io(fd) {
        // SAFETY: the caller's message header.
        Io::Smc(c) if ours => ret(unsafe { recv_msg(&*c, msg, flags) }),
        // SAFETY: as above.
        Io::Remote(r) if ours => ret(unsafe { recv_msg(&*r, msg, flags) }),
        Io::Busy if ours => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(recvmsg: fn(c_int, *mut msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}

/// `sendmsg` on a connection (a connected stream ignores an address and,
/// here, control messages).
unsafe fn send_msg(s: &impl Side, msg: *const msghdr, flags: c_int) -> io::Result<usize> {
    // SAFETY: the caller's message header.
    let (iov, len) = unsafe { ((*msg).msg_iov, (*msg).msg_iovlen) };
    // SAFETY: its iovecs.
    let v = unsafe { iovs(iov, len, libc::EMSGSIZE) }?;
    // SAFETY: as above.
    unsafe { send_iov(s, &v, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's message header.
        Io::Smc(c) if !msg.is_null() => ret(unsafe { send_msg(&*c, msg, flags) }),
        // SAFETY: as above.
        Io::Remote(r) if !msg.is_null() => ret(unsafe { send_msg(&*r, msg, flags) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(sendmsg: fn(c_int, *const msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}
