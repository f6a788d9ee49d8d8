//! `getsockopt` (`SO_ERROR` of a non-blocking connect).

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
            // SAFETY: the caller's int-sized buffer and its length.
            unsafe {
                if *len as usize >= std::mem::size_of::<c_int>() {
                    drop(remove(fd));
                    *(val as *mut c_int) = e;
                    *len = std::mem::size_of::<c_int>() as socklen_t;
                    return 0;
                }
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
