//! `sendfile`, `sendfile64`, `splice` to and from SMC-R connections.

use super::*;

/// `sendfile` into an SMC-R connection: a copy through the library (at most
/// 1 MiB per call; a partial write moves the file's offset as far as the
/// connection took, as `sendfile` does).
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
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendfile64: fn(c_int, c_int, *mut libc::off64_t, size_t) -> ssize_t)(
                out, inp, off, count,
            )
        },
    }
}

pub(crate) unsafe fn file_to_conn(
    c: &Conn,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> io::Result<usize> {
    let f = borrow(inp);
    let pos = if off.is_null() {
        rustix::fs::seek(f, rustix::fs::SeekFrom::Current(0))?
    } else {
        // SAFETY: the caller's offset.
        (unsafe { *off }) as u64
    };
    let mut buf = vec![0u8; count.min(1 << 20)];
    let got = rustix::io::pread(f, &mut buf, pos)?;
    if got == 0 {
        return Ok(0);
    }
    let sent = conn_send(c, &buf[..got], 0)?;
    let end = pos + sent as u64;
    if off.is_null() {
        rustix::fs::seek(f, rustix::fs::SeekFrom::Start(end))?;
    } else {
        // SAFETY: as above.
        unsafe { *off = end as libc::off_t };
    }
    Ok(sent)
}

/// `splice` to or from an SMC-R connection: a copy through the library.
/// Bytes taken from a pipe are written whole (blocking), bytes taken from
/// the connection are given to the pipe whole: a pipe cannot take back
/// what was read from it.
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
    match (i, o) {
        (Io::Busy, _) | (_, Io::Busy) => busy(),
        (Io::Kernel, Io::Smc(c)) => {
            let mut buf = vec![0u8; len.min(1 << 20)];
            let got = if off_in.is_null() {
                rustix::io::read(borrow(fd_in), &mut buf)
            } else {
                // SAFETY: the caller's offset.
                rustix::io::pread(borrow(fd_in), &mut buf, unsafe { *off_in } as u64)
            };
            let got = match got {
                Ok(n) => n,
                Err(e) => return fail(&e.into()),
            };
            if !off_in.is_null() {
                // SAFETY: as above.
                unsafe { *off_in += got as libc::loff_t };
            }
            let mut done = 0;
            while done < got {
                match conn_send(&c, &buf[done..got], 0) {
                    Ok(n) => done += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if let Ok(r) = c.s.readiness_fd() {
                            wait_writable(r.as_raw_fd());
                        }
                    }
                    Err(e) => return fail(&e),
                }
            }
            got as ssize_t
        }
        (Io::Smc(c), Io::Kernel) => {
            let mut buf = vec![0u8; len.min(64 << 10)];
            let got = match conn_recv(&c, &mut buf, if dont_wait { libc::MSG_DONTWAIT } else { 0 })
            {
                Ok(n) => n,
                Err(e) => return fail(&e),
            };
            let mut done = 0;
            while done < got {
                let w = if off_out.is_null() {
                    rustix::io::write(borrow(fd_out), &buf[done..got])
                } else {
                    // SAFETY: the caller's offset.
                    let at = unsafe { *off_out } as u64;
                    rustix::io::pwrite(borrow(fd_out), &buf[done..got], at).inspect(|n| {
                        // SAFETY: as above.
                        unsafe { *off_out += *n as libc::loff_t };
                    })
                };
                match w {
                    Ok(n) => done += n,
                    Err(rustix::io::Errno::AGAIN) => wait_writable(fd_out),
                    Err(e) => return fail(&e.into()),
                }
            }
            got as ssize_t
        }
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real_splice(fd_in, off_in, fd_out, off_out, len, flags) },
    }
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
