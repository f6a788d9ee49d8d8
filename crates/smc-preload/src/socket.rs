//! `socket()`: which new sockets opt in to the SMC option.

use super::*;

pub(crate) fn is_tcp(domain: c_int, ty: c_int, proto: c_int) -> bool {
    (domain == libc::AF_INET || domain == libc::AF_INET6)
        && ty & 0xf == libc::SOCK_STREAM
        && (proto == 0 || proto == libc::IPPROTO_TCP)
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let fd = unsafe { real!(socket: fn(c_int, c_int, c_int) -> c_int)(domain, ty, proto) };
    if fd < 0 {
        return fd;
    }
    // (TCP sockets only: smc-tools' library sets them on every socket, UDP
    // and Unix ones too, a side effect its users do not ask for; an SMC-R
    // connection's own buffers follow them through `smc::set_buffer_sizes`)
    let tcp = is_tcp(domain, ty, proto);
    for (var, opt) in [
        ("SMC_SNDBUF", libc::SO_SNDBUF),
        ("SMC_RCVBUF", libc::SO_RCVBUF),
    ]
    .into_iter()
    .filter(|_| tcp)
    {
        if let Some(v) = env_size(var) {
            // SAFETY: `v` lives across the call; its size is passed.
            unsafe {
                libc::setsockopt(fd, libc::SOL_SOCKET, opt, (&v as *const c_int).cast(), 4);
            }
            if debug() {
                eprintln!("sockopt {opt} set to {v}");
            }
        }
    }
    if tcp {
        // (with SMC_RUN_PORTS/DESTS the opt-in waits for the address: see `selected`)
        let opted = selection().is_all() && smc::opt_in(borrow(fd));
        drop(insert(
            fd,
            Entry::Fresh {
                opted,
                bufs: (None, None),
            },
        ));
    }
    fd
}
