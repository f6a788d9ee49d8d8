//! glibc's `_FORTIFY_SOURCE` variants: `__read_chk`, `__recv_chk`,
//! `__recvfrom_chk`, `__poll_chk`, `__ppoll_chk`.

use super::*;

// glibc's fortified variants (`_FORTIFY_SOURCE`, as distributions build
// their programs): the same calls with the buffer's known size, checked
// first as glibc does (`__chk_fail` aborts).

pub(crate) fn chk(n: usize, room: usize) {
    if n > room {
        std::process::abort();
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    room: size_t,
) -> ssize_t {
    chk(n, room);
    // SAFETY: the caller's arguments, checked as glibc checks them.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    room: size_t,
    flags: c_int,
) -> ssize_t {
    chk(n, room);
    // SAFETY: as above.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    room: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    chk(n, room);
    // SAFETY: as above.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    room: size_t,
) -> c_int {
    chk(
        (n as usize).saturating_mul(std::mem::size_of::<pollfd>()),
        room,
    );
    // SAFETY: as above.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
    room: size_t,
) -> c_int {
    chk(
        (n as usize).saturating_mul(std::mem::size_of::<pollfd>()),
        room,
    );
    // SAFETY: as above.
    unsafe { ppoll(fds, n, ts, sigmask) }
}
