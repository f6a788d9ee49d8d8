//! The only module with `unsafe`: raw `bpf(2)`, a few socket options, `statfs(2)`, `mount(2)`.
//!
//! Every wrapper is safe to call: it owns the buffers it hands to the kernel and sizes them
//! from the same Rust values. Map access goes through [`CookieMap`], which can only be made
//! from a map whose key and value sizes were checked, so the kernel never writes more than
//! the buffers hold.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::asm::Insn;

// bpf(2) commands.
const BPF_MAP_CREATE: i32 = 0;
const BPF_MAP_LOOKUP_ELEM: i32 = 1;
const BPF_MAP_UPDATE_ELEM: i32 = 2;
const BPF_MAP_DELETE_ELEM: i32 = 3;
const BPF_PROG_LOAD: i32 = 5;
const BPF_OBJ_PIN: i32 = 6;
const BPF_OBJ_GET: i32 = 7;
const BPF_PROG_ATTACH: i32 = 8;
const BPF_PROG_DETACH: i32 = 9;
const BPF_PROG_GET_FD_BY_ID: i32 = 13;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: i32 = 21;
const BPF_OBJ_GET_INFO_BY_FD: i32 = 15;
const BPF_PROG_QUERY: i32 = 16;

/// `enum bpf_map_type`: `BPF_MAP_TYPE_LRU_HASH`.
pub const MAP_TYPE_LRU_HASH: u32 = 9;
/// `enum bpf_prog_type`: `BPF_PROG_TYPE_SOCK_OPS`.
pub const PROG_TYPE_SOCK_OPS: u32 = 13;
/// `enum bpf_attach_type`: `BPF_CGROUP_SOCK_OPS`.
pub const ATTACH_CGROUP_SOCK_OPS: u32 = 3;
/// `BPF_F_ALLOW_MULTI`: coexist with other sock_ops programs on the same cgroup.
pub const F_ALLOW_MULTI: u32 = 1 << 1;
/// `BPF_F_RDONLY` (`file_flags` of `BPF_OBJ_GET`): an fd that may only read the object, for
/// which read permission on the pin suffices (kernel/bpf/inode.c `bpf_obj_do_get` checks the
/// pin's mode against these flags).
pub const F_RDONLY: u32 = 1 << 3;
/// `SO_COOKIE` (asm-generic socket.h; same value on every Linux architecture we build for).
const SO_COOKIE: libc::c_int = 57;

/// `union bpf_attr`, as raw bytes (144 bytes covers every command used here). Fields are
/// written at their documented offsets; everything else stays zero as the kernel requires.
#[repr(C, align(8))]
struct Attr([u8; 144]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 144])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn ptr<T>(&mut self, off: usize, p: *const T) -> &mut Self {
        self.u64(off, p as usize as u64)
    }
    fn name(&mut self, off: usize, name: &str) -> &mut Self {
        // BPF_OBJ_NAME_LEN = 16 including the NUL; only [A-Za-z0-9_.] allowed.
        let n = name.len().min(15);
        self.0[off..off + n].copy_from_slice(&name.as_bytes()[..n]);
        self
    }
    fn get_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.0[off..off + 4]);
        u32::from_ne_bytes(b)
    }
}

/// Issues `bpf(cmd, attr, sizeof attr)`.
///
/// # Safety
///
/// Every pointer stored in `attr` must point to memory valid for the access `cmd` performs
/// with it (reads, or writes, of the length stated in `attr` or implied by the object's
/// geometry) and stay alive for the duration of the call.
unsafe fn bpf(cmd: i32, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, 8-aligned 144-byte buffer and the size passed matches it; the
    // pointers inside it are valid per this function's contract.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd_from(r: libc::c_long) -> io::Result<OwnedFd> {
    let raw = RawFd::try_from(r).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned `raw` as a new file descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// A `BPF_MAP_TYPE_LRU_HASH` with `u64` keys and `u32` values (checked at construction).
#[derive(Debug)]
pub struct CookieMap {
    fd: OwnedFd,
}

/// What `BPF_OBJ_GET_INFO_BY_FD` says about a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapInfo {
    pub map_type: u32,
    pub id: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

/// What `BPF_OBJ_GET_INFO_BY_FD` says about a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgInfo {
    pub prog_type: u32,
    pub id: u32,
    /// `name` (up to 15 bytes, NUL-padded).
    pub name: [u8; 16],
}

impl ProgInfo {
    pub fn name(&self) -> &[u8] {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.name.len());
        &self.name[..end]
    }
}

impl CookieMap {
    /// `BPF_MAP_CREATE` of the rendezvous map.
    pub fn create(max_entries: u32, name: &str) -> io::Result<CookieMap> {
        let mut a = Attr::new();
        a.u32(0, MAP_TYPE_LRU_HASH)
            .u32(4, 8)
            .u32(8, 4)
            .u32(12, max_entries)
            .name(28, name);
        // SAFETY: BPF_MAP_CREATE reads only `a` itself (the name is inline); no pointers.
        let fd = fd_from(unsafe { bpf(BPF_MAP_CREATE, &mut a) }?)?;
        Ok(CookieMap { fd })
    }

    /// Wraps a map obtained elsewhere (e.g. `BPF_OBJ_GET`) after checking its geometry.
    pub fn from_fd(fd: OwnedFd) -> Result<CookieMap, (OwnedFd, Option<MapInfo>)> {
        match map_info(fd.as_fd()) {
            Ok(i) if i.map_type == MAP_TYPE_LRU_HASH && i.key_size == 8 && i.value_size == 4 => {
                Ok(CookieMap { fd })
            }
            Ok(i) => Err((fd, Some(i))),
            Err(_) => Err((fd, None)),
        }
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn update(&self, key: u64, value: u32, flags: u64) -> io::Result<()> {
        let mut a = Attr::new();
        a.u32(0, self.fd.as_raw_fd() as u32)
            .ptr(8, &key)
            .ptr(16, &value)
            .u64(24, flags);
        // SAFETY: the kernel reads key_size (8) bytes from `key` and value_size (4) bytes from
        // `value` (geometry checked when `self` was made); both live on this frame.
        unsafe { bpf(BPF_MAP_UPDATE_ELEM, &mut a) }.map(|_| ())
    }

    /// `Ok(None)` if the key is absent.
    pub fn lookup(&self, key: u64) -> io::Result<Option<u32>> {
        self.lookup_cmd(BPF_MAP_LOOKUP_ELEM, key)
    }

    /// The key's value, removed in the same call (`Ok(None)`: absent).
    /// `BPF_MAP_LOOKUP_AND_DELETE_ELEM` takes hash maps since Linux 5.14
    /// (kernel/bpf/hashtab.c `htab_map_lookup_and_delete_elem`); before
    /// that it fails with `EINVAL` or `ENOTSUPP`, and this falls back to a
    /// lookup and a delete, which is what it then stays with.
    pub fn lookup_and_delete(&self, key: u64) -> io::Result<Option<u32>> {
        static UNSUPPORTED: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        use std::sync::atomic::Ordering::Relaxed;
        if !UNSUPPORTED.load(Relaxed) {
            match self.lookup_cmd(BPF_MAP_LOOKUP_AND_DELETE_ELEM, key) {
                // (ENOTSUPP, 524, is the kernel's own and not in libc)
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(524)) => {
                    UNSUPPORTED.store(true, Relaxed);
                }
                r => return r,
            }
        }
        let v = self.lookup(key)?;
        self.delete(key)?;
        Ok(v)
    }

    /// A lookup-like command `cmd` (the key in, the value out): `Ok(None)`
    /// if the key is absent.
    fn lookup_cmd(&self, cmd: i32, key: u64) -> io::Result<Option<u32>> {
        let mut value: u32 = 0;
        let mut a = Attr::new();
        a.u32(0, self.fd.as_raw_fd() as u32)
            .ptr(8, &key)
            .ptr(16, &mut value as *mut u32);
        // SAFETY: for both commands the kernel reads 8 bytes from `key` and writes value_size
        // (checked: 4) bytes into `value`; both live on this frame.
        match unsafe { bpf(cmd, &mut a) } {
            Ok(_) => Ok(Some(value)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `Ok(false)` if the key was absent.
    pub fn delete(&self, key: u64) -> io::Result<bool> {
        let mut a = Attr::new();
        a.u32(0, self.fd.as_raw_fd() as u32).ptr(8, &key);
        // SAFETY: the kernel reads key_size (8) bytes from `key`, which lives on this frame.
        match unsafe { bpf(BPF_MAP_DELETE_ELEM, &mut a) } {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// `BPF_PROG_LOAD`. With `log` given, the verifier log (level 1) is written into it; the
/// kernel fails the load with `ENOSPC` if the log does not fit, so pass a log only to explain
/// a failure.
pub fn prog_load(
    prog_type: u32,
    insns: &[Insn],
    license: &str,
    name: &str,
    log: Option<&mut Vec<u8>>,
) -> io::Result<OwnedFd> {
    let bytes = crate::asm::encode_all(insns);
    let license = CString::new(license).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut a = Attr::new();
    a.u32(0, prog_type)
        .u32(
            4,
            u32::try_from(insns.len()).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        )
        .ptr(8, bytes.as_ptr())
        .ptr(16, license.as_ptr())
        .name(48, name);
    if let Some(buf) = log {
        let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        a.u32(24, 1).u32(28, len).ptr(32, buf.as_mut_ptr());
        // SAFETY: `bytes` holds insn_cnt * 8 bytes; `license` is NUL-terminated; `buf` is
        // writable for `len` bytes. All three outlive the call.
        return fd_from(unsafe { bpf(BPF_PROG_LOAD, &mut a) }?);
    }
    // SAFETY: `bytes` holds insn_cnt * 8 bytes and `license` is NUL-terminated; both outlive
    // the call; no log buffer is given.
    fd_from(unsafe { bpf(BPF_PROG_LOAD, &mut a) }?)
}

/// `BPF_OBJ_PIN`: pins `fd` at `path` (on a bpffs).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let p = cpath(path)?;
    let mut a = Attr::new();
    a.ptr(0, p.as_ptr()).u32(8, fd.as_raw_fd() as u32);
    // SAFETY: `p` is a NUL-terminated path alive for the call.
    unsafe { bpf(BPF_OBJ_PIN, &mut a) }.map(|_| ())
}

/// `BPF_OBJ_GET`: opens the object pinned at `path` for reading and writing.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    obj_get_flags(path, 0)
}

/// `BPF_OBJ_GET` with `file_flags` (0 or [`F_RDONLY`]). No capability is needed: the kernel
/// checks the pin's file mode like `open(2)` would (read, or read and write).
pub fn obj_get_flags(path: &Path, file_flags: u32) -> io::Result<OwnedFd> {
    let p = cpath(path)?;
    let mut a = Attr::new();
    a.ptr(0, p.as_ptr()).u32(12, file_flags);
    // SAFETY: `p` is a NUL-terminated path alive for the call.
    fd_from(unsafe { bpf(BPF_OBJ_GET, &mut a) }?)
}

/// `BPF_PROG_ATTACH` of `prog` to the cgroup directory `cgroup`.
pub fn prog_attach(
    cgroup: BorrowedFd<'_>,
    prog: BorrowedFd<'_>,
    attach_type: u32,
    flags: u32,
) -> io::Result<()> {
    let mut a = Attr::new();
    a.u32(0, cgroup.as_raw_fd() as u32)
        .u32(4, prog.as_raw_fd() as u32)
        .u32(8, attach_type)
        .u32(12, flags);
    // SAFETY: BPF_PROG_ATTACH takes only integers (fds, type, flags); no pointers.
    unsafe { bpf(BPF_PROG_ATTACH, &mut a) }.map(|_| ())
}

/// `BPF_PROG_DETACH` of `prog` from the cgroup directory `cgroup`.
pub fn prog_detach(
    cgroup: BorrowedFd<'_>,
    prog: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    let mut a = Attr::new();
    a.u32(0, cgroup.as_raw_fd() as u32)
        .u32(4, prog.as_raw_fd() as u32)
        .u32(8, attach_type);
    // SAFETY: BPF_PROG_DETACH takes only integers (fds, type); no pointers.
    unsafe { bpf(BPF_PROG_DETACH, &mut a) }.map(|_| ())
}

/// `BPF_PROG_QUERY`: ids of the programs attached (directly, not inherited) to `cgroup`.
pub fn prog_query(cgroup: BorrowedFd<'_>, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    loop {
        let mut a = Attr::new();
        a.u32(0, cgroup.as_raw_fd() as u32)
            .u32(4, attach_type)
            .ptr(16, ids.as_mut_ptr())
            .u32(24, ids.len() as u32);
        // SAFETY: the kernel writes at most prog_cnt (= ids.len()) u32 ids into `ids`, which
        // outlives the call; prog_attach_flags stays 0 (not requested).
        match unsafe { bpf(BPF_PROG_QUERY, &mut a) } {
            Ok(_) => {
                let n = (a.get_u32(24) as usize).min(ids.len());
                ids.truncate(n);
                return Ok(ids);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && ids.len() < 65_536 => {
                let want = (a.get_u32(24) as usize).max(ids.len() * 2);
                ids = vec![0u32; want];
            }
            Err(e) => return Err(e),
        }
    }
}

/// `BPF_OBJ_GET_INFO_BY_FD` into a zeroed 256-byte buffer; returns the buffer.
fn obj_info(fd: BorrowedFd<'_>) -> io::Result<[u8; 256]> {
    #[repr(C, align(8))]
    struct Buf([u8; 256]);
    let mut buf = Buf([0; 256]);
    let mut a = Attr::new();
    a.u32(0, fd.as_raw_fd() as u32)
        .u32(4, buf.0.len() as u32)
        .ptr(8, buf.0.as_mut_ptr());
    // SAFETY: the kernel writes at most info_len (256) bytes into `buf`, which outlives the
    // call; the array-pointer fields of the info structs are zero, so it follows no other
    // pointer.
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a) }?;
    Ok(buf.0)
}

fn ne_u32(b: &[u8], off: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[off..off + 4]);
    u32::from_ne_bytes(x)
}

/// `struct bpf_map_info`: type, id, key_size, value_size, max_entries.
pub fn map_info(fd: BorrowedFd<'_>) -> io::Result<MapInfo> {
    let b = obj_info(fd)?;
    Ok(MapInfo {
        map_type: ne_u32(&b, 0),
        id: ne_u32(&b, 4),
        key_size: ne_u32(&b, 8),
        value_size: ne_u32(&b, 12),
        max_entries: ne_u32(&b, 16),
    })
}

/// `struct bpf_prog_info`: type (offset 0), id (4), name (64..80).
pub fn prog_info(fd: BorrowedFd<'_>) -> io::Result<ProgInfo> {
    let b = obj_info(fd)?;
    let mut name = [0u8; 16];
    name.copy_from_slice(&b[64..80]);
    Ok(ProgInfo {
        prog_type: ne_u32(&b, 0),
        id: ne_u32(&b, 4),
        name,
    })
}

/// `BPF_PROG_GET_FD_BY_ID`.
pub fn prog_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, id);
    // SAFETY: BPF_PROG_GET_FD_BY_ID takes only integers (id, flags); no pointers.
    fd_from(unsafe { bpf(BPF_PROG_GET_FD_BY_ID, &mut a) }?)
}

/// `getsockopt` into a buffer; returns the length the kernel filled in.
fn getsockopt_buf(fd: BorrowedFd<'_>, level: i32, name: i32, buf: &mut [u8]) -> io::Result<usize> {
    let mut len = libc::socklen_t::try_from(buf.len()).unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `buf` is writable for `len` bytes and `len` is a valid in/out length; the kernel
    // writes at most `len` bytes and updates `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok((len as usize).min(buf.len()))
    }
}

/// `getsockopt(SOL_SOCKET, SO_COOKIE)`: the value `bpf_get_socket_cookie()` sees.
pub fn socket_cookie(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut b = [0u8; 8];
    let n = getsockopt_buf(fd, libc::SOL_SOCKET, SO_COOKIE, &mut b)?;
    if n != 8 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(u64::from_ne_bytes(b))
}

/// `SO_NETNS_COOKIE` (asm-generic socket.h, Linux 5.14): the value `bpf_get_netns_cookie()`
/// sees for the socket.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// `getsockopt(SOL_SOCKET, SO_NETNS_COOKIE)`: the socket's network namespace.
pub fn netns_cookie(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut b = [0u8; 8];
    let n = getsockopt_buf(fd, libc::SOL_SOCKET, SO_NETNS_COOKIE, &mut b)?;
    if n != 8 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(u64::from_ne_bytes(b))
}

/// The socket's address family and local port (`getsockname`), for an IPv4 or IPv6 socket.
pub fn local_port(fd: BorrowedFd<'_>) -> io::Result<(u8, u16)> {
    // SAFETY: an all-zero sockaddr_storage is a valid value of this plain C struct.
    let mut a: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `a` is writable for `len` bytes, which the kernel does not exceed.
    let r = unsafe {
        libc::getsockname(
            fd.as_raw_fd(),
            (&mut a as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // (sin_port and sin6_port sit at the same offset, in network byte order)
    let port = match i32::from(a.ss_family) {
        libc::AF_INET | libc::AF_INET6 => {
            // SAFETY: the kernel filled a sockaddr_in/_in6, whose port is at the offset of
            // sockaddr_in's, and sockaddr_storage is large and aligned enough for it.
            let sin =
                unsafe { &*(&a as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            u16::from_be(sin.sin_port)
        }
        _ => return Err(io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
    };
    Ok((a.ss_family as u8, port))
}

/// An `int` socket option.
pub fn getsockopt_int(fd: BorrowedFd<'_>, level: i32, name: i32) -> io::Result<i32> {
    let mut b = [0u8; 4];
    getsockopt_buf(fd, level, name, &mut b)?;
    Ok(i32::from_ne_bytes(b))
}

/// `tcpi_state` (first byte of `struct tcp_info`).
pub fn tcp_state(fd: BorrowedFd<'_>) -> io::Result<u8> {
    let mut b = [0u8; 8];
    getsockopt_buf(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut b)?;
    Ok(b[0])
}

/// `statfs(2)` magic (`f_type`) of the filesystem holding `path`.
pub fn fs_magic(path: &Path) -> io::Result<u64> {
    let p = cpath(path)?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `p` is NUL-terminated; `st` is a properly sized, writable statfs buffer.
    let r = unsafe { libc::statfs(p.as_ptr(), st.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statfs succeeded, so the kernel initialised the struct (and it was zeroed anyway).
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as u64)
}

/// The effective uid (for messages).
pub fn euid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// `mount -t bpf bpf <path> -o mode=0700`.
pub fn mount_bpffs(path: &Path) -> io::Result<()> {
    let target = cpath(path)?;
    let src = c"bpf";
    let fstype = c"bpf";
    let data = c"mode=0700";
    // SAFETY: all four pointers are NUL-terminated strings alive for the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_offsets() {
        let mut a = Attr::new();
        a.u32(0, 1)
            .u64(8, 0x0102_0304_0506_0708)
            .name(48, "smc_rs_rendezvous_long");
        assert_eq!(a.get_u32(0), 1);
        assert_eq!(&a.0[48..64], b"smc_rs_rendezvo\0");
        assert_eq!(std::mem::align_of::<Attr>(), 8);
    }
}
