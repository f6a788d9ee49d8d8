//! Conversions between C `sockaddr`s and `SocketAddr`.

use super::*;

/// The address `addr` points to, if it is an IPv4 or IPv6 one.
pub(crate) unsafe fn sockaddr_of(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's address of `len` bytes; the family says which
    // structure it is, and its size is checked before reading it.
    unsafe {
        match c_int::from((*addr).sa_family) {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let a = &*(addr as *const libc::sockaddr_in);
                Some(SocketAddr::from((
                    u32::from_be(a.sin_addr.s_addr).to_be_bytes(),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let a = &*(addr as *const libc::sockaddr_in6);
                Some(SocketAddr::from((
                    a.sin6_addr.s6_addr,
                    u16::from_be(a.sin6_port),
                )))
            }
            _ => None,
        }
    }
}

/// Writes `a` to the caller's `addr`/`len` (truncated as accept(2) does).
pub(crate) unsafe fn write_sockaddr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let s = socket2_like(a);
    // SAFETY: `len` is the caller's in/out length of `addr`; at most that
    // many bytes are written.
    unsafe {
        let room = *len as usize;
        let n = room.min(s.len());
        std::ptr::copy_nonoverlapping(s.as_ptr(), addr.cast::<u8>(), n);
        *len = s.len() as socklen_t;
    }
}

/// `a` as the bytes of a `sockaddr_in` / `sockaddr_in6`.
pub(crate) fn socket2_like(a: SocketAddr) -> Vec<u8> {
    match a {
        SocketAddr::V4(v4) => {
            let mut s: libc::sockaddr_in = unsafe_zeroed_in();
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            as_bytes(&s)
        }
        SocketAddr::V6(v6) => {
            let mut s: libc::sockaddr_in6 = unsafe_zeroed_in6();
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            s.sin6_flowinfo = v6.flowinfo();
            s.sin6_scope_id = v6.scope_id();
            as_bytes(&s)
        }
    }
}

pub(crate) fn unsafe_zeroed_in() -> libc::sockaddr_in {
    // SAFETY: a plain C structure of integers, valid all zero.
    unsafe { std::mem::zeroed() }
}

pub(crate) fn unsafe_zeroed_in6() -> libc::sockaddr_in6 {
    // SAFETY: as above.
    unsafe { std::mem::zeroed() }
}

pub(crate) fn as_bytes<T>(v: &T) -> Vec<u8> {
    // SAFETY: a plain C structure (no padding read as anything but bytes
    // the kernel would copy the same way), read for its own size.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}
