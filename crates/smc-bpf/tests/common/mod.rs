//! Test helpers: step-by-step TCP sockets (so the opt-in can happen before connect/listen),
//! `TCP_SAVED_SYN`, and an `AF_PACKET` capture on `lo`. Plain libc; every unsafe block says why
//! it is sound.
#![allow(dead_code)]

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use smc_bpf::Rendezvous;

pub const SMC_OPTION: [u8; 6] = [0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9];

/// Fails loudly unless we run as root: CI runs as root, and a silently skipped test proves
/// nothing.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "smc-bpf integration tests must run as root (they load a BPF program); run `sudo -E cargo test -p smc-bpf`"
    );
}

pub fn rdv() -> &'static Rendezvous {
    require_root();
    match Rendezvous::shared() {
        Ok(r) => r,
        Err(e) => panic!("Rendezvous::shared() failed: {e}"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fam {
    V4,
    V6,
}

fn check(r: libc::c_int, what: &str) -> io::Result<libc::c_int> {
    if r < 0 {
        let e = io::Error::last_os_error();
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    } else {
        Ok(r)
    }
}

/// A fresh, unconnected TCP socket.
pub fn tcp_socket(fam: Fam) -> OwnedFd {
    let domain = if fam == Fam::V4 {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2) call with constant arguments.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    let fd = check(fd, "socket").unwrap();
    // SAFETY: socket(2) just returned this descriptor; we are its only owner.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// A UDP socket (for negative tests).
pub fn udp_socket() -> OwnedFd {
    // SAFETY: plain socket(2) call with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let fd = check(fd, "socket").unwrap();
    // SAFETY: socket(2) just returned this descriptor; we are its only owner.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn loopback(fam: Fam, port: u16) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    match fam {
        Fam::V4 => {
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = port.to_be();
            sin.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            (ss, size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        Fam::V6 => {
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = port.to_be();
            sin6.sin6_addr.s6_addr = std::net::Ipv6Addr::LOCALHOST.octets();
            (ss, size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

pub fn local_port(fd: BorrowedFd<'_>) -> u16 {
    // SAFETY: all-zero sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `ss` is writable for `len` bytes.
    let r = unsafe {
        libc::getsockname(
            fd.as_raw_fd(),
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    check(r, "getsockname").unwrap();
    // Both sockaddr_in and sockaddr_in6 keep the port at byte offset 2.
    // SAFETY: `ss` is initialised and at least 4 bytes long.
    let bytes = unsafe {
        std::slice::from_raw_parts((&ss as *const libc::sockaddr_storage).cast::<u8>(), 4)
    };
    u16::from_be_bytes([bytes[2], bytes[3]])
}

pub fn setsockopt_int(fd: BorrowedFd<'_>, level: i32, name: i32, v: i32) {
    // SAFETY: passes a pointer to a live i32 and its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&v as *const i32).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    check(r, "setsockopt").unwrap();
}

/// bind(loopback:0) + listen; returns the port. With `save_syn`, sets TCP_SAVE_SYN from user
/// space so the test can read what the SYN carried on a listener the program does not handle
/// (for an opted-in listener the program must do it itself).
pub fn bind_listen_opts(fd: &OwnedFd, fam: Fam, save_syn: bool) -> u16 {
    use std::os::fd::AsFd;
    if save_syn {
        setsockopt_int(fd.as_fd(), libc::IPPROTO_TCP, libc::TCP_SAVE_SYN, 1);
    }
    let (ss, len) = loopback(fam, 0);
    // SAFETY: `ss` is a valid sockaddr of `len` bytes.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&ss as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    check(r, "bind").unwrap();
    // SAFETY: listen on a socket we own.
    check(unsafe { libc::listen(fd.as_raw_fd(), 64) }, "listen").unwrap();
    local_port(fd.as_fd())
}

pub fn bind_listen(fd: &OwnedFd, fam: Fam) -> u16 {
    bind_listen_opts(fd, fam, false)
}

pub fn connect(fd: &OwnedFd, fam: Fam, port: u16) {
    let (ss, len) = loopback(fam, port);
    // SAFETY: `ss` is a valid sockaddr of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&ss as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    check(r, "connect").unwrap();
}

pub fn into_listener(fd: OwnedFd) -> TcpListener {
    TcpListener::from(fd)
}

pub fn into_stream(fd: OwnedFd) -> TcpStream {
    TcpStream::from(fd)
}

/// `getsockopt(TCP_SAVED_SYN)`: IP + TCP header of the SYN that created this accepted socket.
pub fn saved_syn(fd: BorrowedFd<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; 512];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: `buf` is writable for `len` bytes; the kernel updates `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_SAVED_SYN,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    check(r, "getsockopt(TCP_SAVED_SYN)").unwrap();
    buf.truncate(len as usize);
    buf
}

/// The TCP header inside an IPv4 or IPv6 packet (no IPv6 extension headers on loopback).
pub fn tcp_header(ip: &[u8]) -> Option<&[u8]> {
    let tcp = match ip.first()? >> 4 {
        4 => {
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            if *ip.get(9)? != 6 {
                return None;
            }
            ip.get(ihl..)?
        }
        6 => {
            if *ip.get(6)? != 6 {
                return None;
            }
            ip.get(40..)?
        }
        _ => return None,
    };
    let doff = usize::from(tcp.get(12)? >> 4) * 4;
    tcp.get(..doff)
}

/// Raw search for `fe 06 e2 d4 c3 d9` among the options of a TCP header.
pub fn options_contain_smc_bytes(tcp_hdr: &[u8]) -> bool {
    tcp_hdr
        .get(20..)
        .is_some_and(|o| o.windows(6).any(|w| w == SMC_OPTION))
}

/// The SMC option per the wire codec *and* by raw byte search (both must agree).
pub fn has_smc_option(tcp_hdr: &[u8]) -> bool {
    let codec = smc_wire::tcpopt::tcp_header_has_smc_option(tcp_hdr).unwrap_or(false);
    assert_eq!(
        codec,
        options_contain_smc_bytes(tcp_hdr),
        "codec and byte search disagree on {tcp_hdr:02x?}"
    );
    codec
}

#[derive(Debug, Clone)]
pub struct Segment {
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
    pub header: Vec<u8>,
}

impl Segment {
    pub fn is_syn(&self) -> bool {
        self.flags & 0x12 == 0x02
    }
    pub fn is_synack(&self) -> bool {
        self.flags & 0x12 == 0x12
    }
}

/// `AF_PACKET`/`SOCK_DGRAM` capture of every packet received on `lo` (IP layer, no link
/// header). Outgoing copies are skipped so each segment is seen once.
pub struct Capture {
    fd: OwnedFd,
}

impl Capture {
    pub fn on_lo() -> Capture {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        };
        let fd = check(fd, "socket(AF_PACKET)").unwrap();
        // SAFETY: socket(2) just returned this descriptor; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: NUL-terminated interface name.
        let ifindex = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        assert!(ifindex > 0, "no lo interface");
        // SAFETY: all-zero sockaddr_ll is valid.
        let mut sll: libc::sockaddr_ll = unsafe { zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a valid sockaddr_ll of the stated size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        check(r, "bind(AF_PACKET, lo)").unwrap();
        use std::os::fd::AsFd;
        setsockopt_int(fd.as_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20);
        Capture { fd }
    }

    /// Reads everything captured so far; keeps TCP segments between ports `a` and `b`.
    pub fn drain(&self, a: u16, b: u16) -> Vec<Segment> {
        // Loopback delivery is synchronous in practice; a short grace period covers softirq.
        std::thread::sleep(Duration::from_millis(50));
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65_536];
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            // SAFETY: all-zero sockaddr_ll is valid.
            let mut sll: libc::sockaddr_ll = unsafe { zeroed() };
            let mut slen = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `buf` is writable for its length and `sll` for `slen` bytes.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                    (&mut sll as *mut libc::sockaddr_ll).cast(),
                    &mut slen,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                panic!("recvfrom(AF_PACKET): {e}");
            }
            if sll.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let Some(h) = tcp_header(&buf[..n as usize]) else {
                continue;
            };
            let sport = u16::from_be_bytes([h[0], h[1]]);
            let dport = u16::from_be_bytes([h[2], h[3]]);
            if (sport, dport) == (a, b) || (sport, dport) == (b, a) {
                out.push(Segment {
                    sport,
                    dport,
                    flags: h[13],
                    header: h.to_vec(),
                });
            }
        }
        out
    }
}
