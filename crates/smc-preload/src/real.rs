//! The next definition of a replaced libc function (`dlsym(RTLD_NEXT)`), for
//! the calls that pass through to the kernel.

use super::*;

/// The next definition of a libc function (the one we replace).
macro_rules! real {
    ($name:ident : fn($($t:ty),*) -> $r:ty) => {{
        static P: AtomicUsize = AtomicUsize::new(0);
        let p = sym(&P, concat!(stringify!($name), "\0"));
        // SAFETY: `p` is libc's definition of this very function, whose C
        // signature the type spells out.
        #[allow(unused_unsafe)]
        let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> $r>(p) };
        f
    }};
}

/// The address of the next definition of `name` (NUL-terminated), cached in `cache`.
pub(crate) fn sym(cache: &AtomicUsize, name: &str) -> usize {
    let mut p = cache.load(Ordering::Relaxed);
    if p == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name has no
        // preconditions.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
        if p == 0 {
            // a dynamically linked program has libc behind us; without it
            // there is nothing sensible to call
            std::process::abort();
        }
        cache.store(p, Ordering::Relaxed);
    }
    p
}

pub(crate) fn real_fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: libc's fcntl with the caller's arguments.
    unsafe { real!(fcntl: fn(c_int, c_int, c_ulong) -> c_int)(fd, cmd, arg) }
}

/// The kernel's `epoll_ctl` with an event of the library's own (`events`
/// under `data`; none for `EPOLL_CTL_DEL`): for the descriptors the library
/// registers in the application's sets itself (a connection's readiness
/// descriptor, its peer signal).
pub(crate) fn ctl_own(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> c_int {
    let f = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    let mut e = libc::epoll_event { events, u64: data };
    // SAFETY: an event on this frame; the descriptors are the caller's to
    // name (a closed one fails with EBADF, harmlessly).
    unsafe { f(epfd, op, fd, &mut e) }
}
