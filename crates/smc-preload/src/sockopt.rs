//! `getsockopt` (`SO_ERROR` of a non-blocking connect) and `setsockopt`
//! (the timeouts `SO_RCVTIMEO`/`SO_SNDTIMEO`, which an SMC-R connection's
//! calls apply themselves, and `SO_LINGER`, whose zero timeout makes its
//! close a reset).

use super::*;

/// `getsockopt`: the kernel's answer, except `SO_ERROR` after a failed
/// handshake (see `Entry::Failed`).
#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET && opt == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        if let Some(Entry::Failed(e)) = get(fd) {
            // SAFETY: the caller's buffer and its length, not null.
            if unsafe { put_int(val, len, e) } {
                drop(remove(fd));
                return 0;
            }
        }
    }
    if level == libc::SOL_SOCKET && opt == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        match get(fd) {
            Some(Entry::Stream(c)) if c.s.mode() == Mode::SmcR => {
                // An SMC-R connection's own error, its reset or abort,
                // reported once as TCP's `sk_err` (net/core/sock.c
                // `sock_error`; `Conn::report_once`); never its TCP
                // socket's, whose end (a reset the peer's close drew, say)
                // is the connection's, reported so.
                // (the stream's own look: a write of nothing says the
                // connection's failure, whether or not a poll made its
                // readiness descriptor)
                let taken = c.err_taken.load(Ordering::Acquire);
                let e = match (!taken).then(|| c.s.write_with(&[], true)) {
                    Some(Err(e)) if c.is_failure(&e) => {
                        c.report_once(e).map_or(0, |e| errno_of(&e))
                    }
                    _ => 0,
                };
                // SAFETY: the caller's buffer and its length, not null.
                if unsafe { put_int(val, len, e) } {
                    return 0;
                }
            }
            _ => {}
        }
    }
    if level == libc::SOL_SOCKET
        && (opt == libc::SO_RCVBUF || opt == libc::SO_SNDBUF)
        && !val.is_null()
        && !len.is_null()
        && COUNT.load(Ordering::Acquire) != 0
    {
        // An SMC-R connection's buffers are its RMB and send buffer: Linux
        // reports them doubled, as it does a socket's (smc_core.c
        // `__smc_buf_create` sets `sk_rcvbuf` / `sk_sndbuf` to twice the
        // size taken).
        let sizes = match get(fd) {
            Some(Entry::Stream(c)) => c.s.buffer_sizes(),
            _ => None,
        };
        if let Some((rmb, snd)) = sizes {
            let v = if opt == libc::SO_RCVBUF { rmb } else { snd };
            let v = c_int::try_from(v.saturating_mul(2)).unwrap_or(c_int::MAX);
            // SAFETY: as above.
            if unsafe { put_int(val, len, v) } {
                return 0;
            }
        }
    }
    // SAFETY: the caller's arguments, unchanged.
    unsafe {
        real!(getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int)(
            fd, level, opt, val, len,
        )
    }
}

/// Answers an int-valued option: `v` into the caller's buffer `val` of
/// `*len` bytes if an int fits there (false, nothing written, if not).
///
/// # Safety
/// `val` and `len` are the caller's `getsockopt` arguments, not null.
unsafe fn put_int(val: *mut c_void, len: *mut socklen_t, v: c_int) -> bool {
    // SAFETY: the caller's buffer of `*len` bytes, an int's size checked.
    unsafe {
        if (*len as usize) < std::mem::size_of::<c_int>() {
            return false;
        }
        *(val as *mut c_int) = v;
        *len = std::mem::size_of::<c_int>() as socklen_t;
    }
    true
}

/// `setsockopt`: the kernel's, and for an SMC-R connection its read and
/// write timeouts too, which the library's calls wait by (the TCP socket's
/// never see those calls).
#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: the caller's arguments, unchanged.
    let r = unsafe {
        real!(setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int)(
            fd, level, opt, val, len,
        )
    };
    if r == 0 && level == libc::SOL_SOCKET && is_timeout(opt) && COUNT.load(Ordering::Acquire) != 0
    {
        if let Some(Entry::Stream(c)) = get(fd) {
            // (read back from the kernel, which has parsed whichever form
            // of timeval the program passed)
            take_timeouts(&c.s, false);
        }
    }
    if r == 0 && level == libc::SOL_SOCKET && opt == libc::SO_LINGER {
        // (on any socket: a listener's accepted sockets and a socket's own
        // connection take it, see `take_linger`)
        LINGER_SET.store(true, Ordering::Release);
        if let Some(Entry::Stream(c)) = get(fd) {
            let _ = c.s.take_socket_linger();
        }
    }
    if r == 0 && level == libc::SOL_SOCKET && opt == libc::SO_OOBINLINE {
        // (as SO_LINGER: accepted sockets inherit it, `take_oob_inline`)
        OOBINLINE_SET.store(true, Ordering::Release);
        if let Some(Entry::Stream(c)) = get(fd) {
            let _ = c.s.take_socket_oob_inline();
        }
    }
    if r == 0
        && level == libc::SOL_SOCKET
        && (opt == libc::SO_RCVBUF || opt == libc::SO_SNDBUF)
        && COUNT.load(Ordering::Acquire) != 0
    {
        ask_buffer(fd, opt == libc::SO_RCVBUF);
    }
    r
}

/// After a program's `setsockopt(SO_RCVBUF or SO_SNDBUF)` on `fd`: a socket
/// not yet connected or listening, or a listening one, asks for SMC buffers
/// of that size for its connection or the connections it accepts from now
/// on, as an AF_SMC socket's do in Linux (smc_core.c `__smc_buf_create`
/// starts from half the socket's doubled size, the size asked for). The
/// size is read back from the kernel: capped by `net.core.rmem_max` /
/// `wmem_max` as it is for the TCP socket.
fn ask_buffer(fd: RawFd, rcv: bool) {
    use rustix::net::sockopt::{socket_recv_buffer_size, socket_send_buffer_size};
    let b = borrow(fd);
    let n = if rcv {
        socket_recv_buffer_size(b)
    } else {
        socket_send_buffer_size(b)
    };
    let Ok(n) = n else { return };
    let n = Some((n / 2).max(1));
    let set = |b: Bufs| if rcv { (n, b.1) } else { (b.0, n) };
    let e = match get(fd) {
        Some(Entry::Fresh { opted, bufs }) => Entry::Fresh {
            opted,
            bufs: set(bufs),
        },
        Some(Entry::Passive(bufs)) => Entry::Passive(set(bufs)),
        Some(Entry::LazyListener(bufs, r)) => Entry::LazyListener(set(bufs), r),
        Some(Entry::Listener(l)) => {
            let (rmb, snd) = set(l.l.buffer_sizes());
            l.l.set_buffer_sizes(rmb, snd);
            return;
        }
        _ => return,
    };
    // (a race with the program's own calls on the socket is its own, as
    // with a kernel socket's options)
    drop(insert(fd, e));
}

/// The program set `SO_LINGER` on some socket: connections made from now on
/// look whether theirs has it ([`take_linger`]).
static LINGER_SET: AtomicBool = AtomicBool::new(false);

/// Stream `s` takes `SO_LINGER` of its TCP socket, set before the
/// connection was made (on a listener, whose accepted sockets inherit it,
/// as in Linux's `sk_clone_lock`): with a zero timeout its close resets the
/// peer, as TCP's (`SmcStream::set_linger`). A look only in a process that
/// set the option somewhere (nginx sets it on connections it gives up on).
pub(crate) fn take_linger(s: &SmcStream) {
    if LINGER_SET.load(Ordering::Acquire) {
        let _ = s.take_socket_linger();
    }
}

/// The program set `SO_OOBINLINE` on some socket: connections made from
/// now on look whether theirs has it ([`take_oob_inline`]).
static OOBINLINE_SET: AtomicBool = AtomicBool::new(false);

/// Stream `s` takes `SO_OOBINLINE` of its TCP socket, set before the
/// connection was made (a listener's accepted sockets inherit it): the
/// peer's urgent byte stays in the stream (`SmcStream::set_oob_inline`). A
/// look only in a process that set the option somewhere.
pub(crate) fn take_oob_inline(s: &SmcStream) {
    if OOBINLINE_SET.load(Ordering::Acquire) {
        let _ = s.take_socket_oob_inline();
    }
}

/// `SO_RCVTIMEO`/`SO_SNDTIMEO`, in the old (`timeval` of `long`s) and new
/// (64-bit) forms (asm-generic/socket.h).
fn is_timeout(opt: c_int) -> bool {
    const RCVTIMEO_NEW: c_int = 66;
    const SNDTIMEO_NEW: c_int = 67;
    matches!(
        opt,
        libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | RCVTIMEO_NEW | SNDTIMEO_NEW
    )
}

/// Stream `s` takes the read and write timeouts of its TCP socket: those set
/// before the connection was made (on a listener, whose accepted sockets
/// inherit them, as in Linux's `sk_clone_lock`), or by `setsockopt` since.
/// (The kernel's timeout 0 is "none".) A `fresh` stream has none yet, and
/// is left so where the socket has none.
pub(crate) fn take_timeouts(s: &SmcStream, fresh: bool) {
    use rustix::net::sockopt::{socket_timeout, Timeout};
    let fd = s.tcp_fd();
    if let Ok(t) = socket_timeout(fd, Timeout::Recv) {
        let t = t.filter(|d| !d.is_zero());
        if t.is_some() || !fresh {
            let _ = s.set_read_timeout(t);
        }
    }
    if let Ok(t) = socket_timeout(fd, Timeout::Send) {
        let t = t.filter(|d| !d.is_zero());
        if t.is_some() || !fresh {
            let _ = s.set_write_timeout(t);
        }
    }
}

/// The timeout of kind `which` (`SO_RCVTIMEO`/`SO_SNDTIMEO`) on the TCP
/// socket `tcp` (a forked child's calls on a connection of its parent's
/// wait by it: the socket and its options are shared, as TCP's are).
pub(crate) fn kernel_timeout(tcp: RawFd, which: c_int) -> Option<std::time::Duration> {
    use rustix::net::sockopt::{socket_timeout, Timeout};
    let t = if which == libc::SO_RCVTIMEO {
        Timeout::Recv
    } else {
        Timeout::Send
    };
    socket_timeout(borrow(tcp), t)
        .ok()
        .flatten()
        .filter(|d| !d.is_zero())
}
