//! `libsmc_preload.so`: unmodified programs' TCP connections over SMC-R,
//! loaded with `LD_PRELOAD` (by `smc_run`).
//!
//! The Linux preload only rewrites `socket()` (the kernel's AF_SMC does the
//! rest); ours interposes the socket calls and routes those on SMC-R
//! connections to `smc::SmcStream`:
//! * `socket()` of a TCP socket (AF_INET/AF_INET6, SOCK_STREAM, protocol 0
//!   or TCP) opts it in to the SMC SYN option (`smc::opt_in`); other
//!   sockets are untouched. `SMC_SNDBUF`/`SMC_RCVBUF` are applied to every
//!   new socket, as smc-tools' library does.
//! * `connect()` connects and runs the CLC handshake (on a non-blocking
//!   socket: `EINPROGRESS`, and a thread of the library finishes it, see
//!   `Pend`); `listen()` marks the socket, whose `smc::SmcListener` (its
//!   driver runs the handshakes) starts at the first `accept()` or poll
//!   (see `Entry::Passive`); `accept()`/`accept4()` take its finished
//!   connections.
//! * The application's descriptor is the TCP socket and stays the
//!   connection's identity (`getsockname`, `getpeername`, `setsockopt` go to
//!   it unchanged); a table maps it to the `SmcStream`, which holds a
//!   duplicate of it of its own (so that the library's own calls on its
//!   socket are never routed back into the table). A connection that fell
//!   back to TCP leaves the table: from then on every call goes straight to
//!   the kernel.
//! * Reads and writes (`read`, `write`, `readv`, `writev`, `recv`, `send`,
//!   `recvfrom`, `sendto`, `recvmsg`, `sendmsg`; `MSG_PEEK`, `MSG_DONTWAIT`,
//!   `MSG_WAITALL`, `MSG_NOSIGNAL`, `MSG_OOB`), `shutdown`, `close`, `dup`,
//!   `dup2`, `dup3`, `fcntl` (`O_NONBLOCK`, `F_DUPFD*`), `ioctl` (`FIONBIO`,
//!   `FIONREAD`) of SMC-R connections go to the stream; a write after the
//!   end raises `SIGPIPE` unless `MSG_NOSIGNAL`.
//! * `poll`, `ppoll`, `select` and `epoll_ctl` see a connection's (or
//!   listener's) readiness descriptor in place of its socket
//!   (`SmcStream::readiness_fd`); `epoll_wait` needs nothing more.
//! * `SMC_DEBUG` (first character not `0`) prints a line per connection:
//!   SMC-R, or the fallback reason. `SMC_RUN_STATE=FILE` appends the same
//!   line to FILE (the library's record of each connection's mode, for
//!   tests and scripts).
//!
//! Every function here is an `extern "C"` replacement of a libc function,
//! so `unsafe` is allowed in this crate (and only here); each use says why
//! it is sound.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

pub mod select;

use libc::{
    c_int, c_ulong, c_void, iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t, ssize_t,
};
use smc::{Mode, SmcListener, SmcStream};
use std::collections::BTreeMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

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
fn sym(cache: &AtomicUsize, name: &str) -> usize {
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

/// A connection the library carries.
struct Conn {
    s: SmcStream,
    /// Bytes read ahead for `MSG_PEEK` and `FIONREAD`, delivered first.
    peeked: Mutex<Vec<u8>>,
}

/// A listener the library carries.
struct Lst {
    l: SmcListener,
    /// The application's `O_NONBLOCK` (the socket itself stays non-blocking
    /// for the listener's driver).
    nonblock: AtomicBool,
}

#[derive(Clone)]
enum Entry {
    /// A TCP socket not yet connected or listening, and whether it is opted
    /// in to the SMC option.
    Fresh {
        opted: bool,
    },
    /// A listening socket opted in to SMC whose listener (and its driver
    /// thread, which accepts and runs the handshakes) starts at the first
    /// `accept` or poll of it: a server that listens and then forks its
    /// workers (nginx's master) has not used the library before the fork,
    /// so each worker runs its own listener on the shared socket (see
    /// [`USED`]).
    Passive,
    Stream(Arc<Conn>),
    Listener(Arc<Lst>),
    /// A non-blocking `connect()` in progress (see [`Pend`]).
    Connecting(Arc<Pend>),
    /// A non-blocking `connect()` whose handshake failed: the socket is shut
    /// down, and `getsockopt(SO_ERROR)` returns this errno once.
    Failed(c_int),
}

/// A non-blocking `connect()` that returned `EINPROGRESS`: a thread of the
/// library waits for the TCP connection and runs the CLC handshake on it
/// (which must not wait for the application: the client speaks first, and
/// an application may wait for the server to speak), then puts the
/// connection in the table (SMC-R) or leaves the socket to the kernel (the
/// TCP connect failed, or fell back).
///
/// Meanwhile `poll`, `select` and `epoll` see `user`, an `AF_UNIX`
/// datagram socket that is neither readable nor writable (one datagram
/// from it to `ctl` fills its minimal send buffer, af_unix.c
/// `unix_writable`) until the thread is done, when it turns writable. The
/// epoll sets it was registered in move to the connection's own descriptor
/// (its readiness descriptor, or the TCP socket after a fallback or a
/// failed connect, where the kernel then shows `EPOLLERR`/`EPOLLHUP` and
/// `SO_ERROR` as for any TCP socket) before that, so an edge-triggered set
/// gets its edge from the connection's descriptor.
struct Pend {
    user: OwnedFd,
    ctl: OwnedFd,
    /// `(epoll fd, event)` of each epoll set holding `user`; `None` once
    /// the thread is done (the table has the connection's entry then).
    reg: Mutex<Option<Vec<(RawFd, libc::epoll_event)>>>,
}

/// What a read or write on `fd` goes to.
enum Io {
    Smc(Arc<Conn>),
    /// A non-blocking connect in progress: `EAGAIN`, as TCP before the
    /// connection is established.
    Busy,
    Kernel,
}

fn io(fd: RawFd) -> Io {
    match get(fd) {
        Some(Entry::Stream(c)) => Io::Smc(c),
        Some(Entry::Connecting(_)) => Io::Busy,
        _ => Io::Kernel,
    }
}

fn busy<T: From<i8>>() -> T {
    set_errno(libc::EAGAIN);
    T::from(-1)
}

static TABLE: RwLock<BTreeMap<RawFd, Entry>> = RwLock::new(BTreeMap::new());
/// Entries in the table: none, and every call passes straight through.
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Set once this process made an SMC connection or listener (its engine,
/// threads and endpoint state exist).
static USED: AtomicBool = AtomicBool::new(false);

/// Set in a child process after `fork()` of a process that had [`USED`]
/// the library: it is off there.
///
/// The parent's connections live in the parent's threads (the engine's
/// progress thread, listener drivers) and its endpoint state, none of which
/// a child has; a child that dropped its copy of a connection, as a child
/// closing the inherited descriptor before `exec` does (socat's `EXEC:`,
/// `system()`), would send the SMC close and abort the parent's connection.
/// So such a child forgets the table without dropping anything and passes
/// every call through: its own new sockets are plain TCP, and the
/// connections it inherited are not usable in it.
///
/// A child of a process that had not used the library yet keeps it: its
/// table holds only sockets without state of the library's (fresh ones,
/// listening ones whose listener has not started), which the child uses as
/// its own (nginx's workers accept on the master's listening sockets, each
/// with a listener of its own).
static FORKED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The table's lock, held by the thread that forks across `fork()`, so
    /// that the child does not inherit it held by a thread it has not.
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::RwLockWriteGuard<'static, BTreeMap<RawFd, Entry>>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    let g = TABLE.write().unwrap_or_else(|e| e.into_inner());
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

extern "C" fn in_parent() {
    FORK_GUARD.with(|f| drop(f.borrow_mut().take()));
}

extern "C" fn in_child() {
    if USED.load(Ordering::Acquire) {
        FORKED.store(true, Ordering::Release);
        COUNT.store(0, Ordering::Release);
    }
    FORK_GUARD.with(|f| drop(f.borrow_mut().take()));
}

/// At `exit()`: every connection still open is closed as `close()` would,
/// so that its unsent data and its SMC close leave before the process is
/// gone. (A kernel socket's data outlives its process, a user-space
/// connection's does not; a program that exits without closing its
/// sockets, as socat does, would otherwise leave the peer with missing data
/// and an aborted connection. `_exit()` and fatal signals skip this.)
extern "C" fn at_exit() {
    if FORKED.load(Ordering::Acquire) {
        return;
    }
    // (a lock held by another thread now is left alone)
    let all = match TABLE.try_write() {
        Ok(mut t) => {
            COUNT.store(0, Ordering::Release);
            std::mem::take(&mut *t)
        }
        Err(_) => return,
    };
    drop(all);
}

/// The `SMC_*` environment at load time (the device configuration, the
/// state file, debugging).
static SMC_ENV: OnceLock<Vec<(std::ffi::OsString, std::ffi::OsString)>> = OnceLock::new();

/// Puts back the `SMC_*` variables a program removed from its environment
/// since the library was loaded (nginx clears its workers' environment but
/// for `env` directives; the library reads it at its first connection).
fn restore_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (k, v) in SMC_ENV.get().map(|v| v.as_slice()).unwrap_or_default() {
            if std::env::var_os(k).is_none() {
                std::env::set_var(k, v);
            }
        }
    });
}

extern "C" fn init() {
    let _ = SMC_ENV.set(
        std::env::vars_os()
            .filter(|(k, _)| k.to_str().is_some_and(|k| k.starts_with("SMC_")))
            .collect(),
    );
    let _ = STATE_FILE.set(open_state_file());
    adopt_inherited_listeners();
    // SAFETY: registers handlers that take and release the table's lock
    // around the fork and store to atomics (the child's is async-signal
    // safe, as a child of a multi-threaded process needs: a futex unlock
    // and stores).
    unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
    // SAFETY: registers a plain function to run at exit.
    unsafe { libc::atexit(at_exit) };
}

/// Listening TCP sockets this image inherited across exec (file ids), not
/// looked at yet (see [`adopt_inherited_listeners`]).
static INHERITED: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// A listening TCP socket inherited across exec (nginx's binary upgrade,
/// an exec of the process itself) may be opted in to the SMC option by the
/// image before: the kernel then offers SMC in its SYN-ACKs, and a plain
/// `accept()` would hand the program connections whose peer speaks CLC
/// first. So each one starts as a listening socket of the library's
/// (`Entry::Passive`); at its first use, one that is not opted in (socket
/// activation, a program without the library before) goes back to the
/// kernel.
fn adopt_inherited_listeners() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<RawFd> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    use rustix::net::sockopt;
    for fd in fds {
        let b = borrow(fd);
        let listening_tcp = sockopt::socket_acceptconn(b).unwrap_or(false)
            && sockopt::socket_type(b).is_ok_and(|t| t == rustix::net::SocketType::STREAM)
            && sockopt::socket_domain(b).is_ok_and(|d| {
                d == rustix::net::AddressFamily::INET || d == rustix::net::AddressFamily::INET6
            })
            && sockopt::socket_protocol(b)
                .is_ok_and(|p| p.is_none_or(|p| p == rustix::net::ipproto::TCP));
        if !listening_tcp {
            continue;
        }
        if let Some(id) = file_id(b) {
            INHERITED.lock().unwrap_or_else(|e| e.into_inner()).push(id);
            drop(insert(fd, Entry::Passive));
        }
    }
}

/// Whether `fd` is an inherited listening socket not looked at yet (it is
/// looked at now).
fn was_inherited(fd: RawFd) -> bool {
    let mut l = INHERITED.lock().unwrap_or_else(|e| e.into_inner());
    if l.is_empty() {
        return false;
    }
    let Some(id) = file_id(borrow(fd)) else {
        return false;
    };
    let before = l.len();
    l.retain(|&x| x != id);
    l.len() != before
}

/// Runs [`init`] when the library is loaded.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

fn get(fd: RawFd) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&fd)
        .cloned()
}

fn stream(fd: RawFd) -> Option<Arc<Conn>> {
    match get(fd)? {
        Entry::Stream(c) => Some(c),
        _ => None,
    }
}

/// Sets `fd`'s entry; returns the one it replaces (drop it outside the lock).
fn insert(fd: RawFd, e: Entry) -> Option<Entry> {
    if FORKED.load(Ordering::Acquire) {
        // (never dropped in a child: see FORKED)
        std::mem::forget(e);
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let old = t.insert(fd, e);
    COUNT.store(t.len(), Ordering::Release);
    old
}

fn remove(fd: RawFd) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    let old = t.remove(&fd);
    COUNT.store(t.len(), Ordering::Release);
    old
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

fn errno() -> c_int {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() }
}

/// The errno a socket call would have returned for `e`.
fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::NotConnected => libc::ENOTCONN,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Interrupted => libc::EINTR,
        // (a handshake the peer broke: af_smc.c says EPROTO too)
        io::ErrorKind::InvalidData => libc::EPROTO,
        _ => libc::EIO,
    }
}

fn fail<T: From<i8>>(e: &io::Error) -> T {
    set_errno(errno_of(e));
    T::from(-1)
}

fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("SMC_DEBUG").is_ok_and(|v| !v.is_empty() && !v.starts_with('0'))
    })
}

/// Says how a connection runs (stderr with `SMC_DEBUG`, the `SMC_RUN_STATE` file).
fn report(role: &str, s: &SmcStream) {
    let how = match s.mode() {
        Mode::SmcR => "SMC-R".to_string(),
        Mode::Tcp(f) => format!("TCP {:#010x} {f}", f.code()),
    };
    let addr = |a: io::Result<SocketAddr>| a.map_or_else(|_| "?".into(), |a| a.to_string());
    report_line(&format!(
        "{} {role} {} {} {how}",
        std::process::id(),
        addr(s.local_addr()),
        addr(s.peer_addr())
    ));
}

fn report_line(line: &str) {
    if debug() {
        eprintln!("libsmc-preload: {line}");
    }
    if let Some(Some(f)) = STATE_FILE.get() {
        use std::io::Write;
        // (one write of an O_APPEND file: lines of processes sharing it stay whole)
        let _ = (&*f).write_all(format!("{line}\n").as_bytes());
    }
}

/// The `SMC_RUN_STATE` file, opened when the library is loaded: a process
/// that drops privileges later (nginx's workers, as www-data) still writes
/// to the file its root parent could open, through the inherited
/// descriptor (close-on-exec, numbered as the library's own).
static STATE_FILE: OnceLock<Option<std::fs::File>> = OnceLock::new();

fn open_state_file() -> Option<std::fs::File> {
    let path = std::env::var_os("SMC_RUN_STATE")?;
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .ok()?;
    Some(dup_own(f.as_raw_fd()).map(std::fs::File::from).unwrap_or(f))
}

/// A size from `SMC_SNDBUF` / `SMC_RCVBUF`: digits, optional k/m suffix.
fn env_size(var: &str) -> Option<c_int> {
    let v = std::env::var(var).ok()?;
    let (d, m) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], 1 << 10),
        b'm' | b'M' => (&v[..v.len() - 1], 1 << 20),
        _ => (&v[..], 1),
    };
    d.parse::<c_int>().ok()?.checked_mul(m)
}

fn borrow<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: only for descriptors the caller passed us, open for the
    // duration of the call that borrows them.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// A duplicate of `fd` (close-on-exec) for the library's own use, numbered
/// in the upper half of the descriptor limit (at most 4096 up) if there is
/// room: programs size their tables by the descriptors they open themselves
/// (wrk's event loop refuses a socket numbered above its size), so the
/// library's stay clear of the low numbers (as the readiness descriptors
/// do).
fn dup_own(fd: RawFd) -> io::Result<OwnedFd> {
    static BASE: OnceLock<RawFd> = OnceLock::new();
    let base = *BASE.get_or_init(|| {
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .map_or(512, |n| (n / 2).clamp(64, 4096)) as RawFd
    });
    rustix::io::fcntl_dupfd_cloexec(borrow(fd), base)
        .or_else(|_| rustix::io::fcntl_dupfd_cloexec(borrow(fd), 0))
        .map_err(io::Error::from)
}

fn is_tcp(domain: c_int, ty: c_int, proto: c_int) -> bool {
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
    for (var, opt) in [
        ("SMC_SNDBUF", libc::SO_SNDBUF),
        ("SMC_RCVBUF", libc::SO_RCVBUF),
    ] {
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
    if is_tcp(domain, ty, proto) && !FORKED.load(Ordering::Acquire) {
        // (with SMC_RUN_PORTS/DESTS the opt-in waits for the address: see `selected`)
        let opted = selection().is_all() && smc::opt_in(borrow(fd));
        drop(insert(fd, Entry::Fresh { opted }));
    }
    fd
}

/// `SMC_RUN_PORTS` and `SMC_RUN_DESTS` (see [`select`]), read once. Lists
/// the library cannot read convert nothing (`smc_run` refuses them before
/// the program starts).
fn selection() -> &'static select::Select {
    static S: OnceLock<select::Select> = OnceLock::new();
    S.get_or_init(|| {
        let var = |k| std::env::var(k).ok();
        let (p, d) = (var("SMC_RUN_PORTS"), var("SMC_RUN_DESTS"));
        select::Select::from_env(p.as_deref(), d.as_deref()).unwrap_or_else(|e| {
            eprintln!("libsmc-preload: {e}: no socket is converted");
            select::Select {
                ports: Some(Vec::new()),
                dests: None,
            }
        })
    })
}

/// Under `SMC_RUN_PORTS`/`SMC_RUN_DESTS`: whether `fd`, about to connect
/// or listen (`verdict`), is converted. It is opted in to the SMC option
/// now, before its SYN or SYN-ACK, if so (`Ok(opted)`); if not it leaves
/// the table and the kernel serves it (`Err(list that excluded it)`).
/// Without a limit the opt-in was made at `socket()`.
fn selected(
    fd: RawFd,
    opted: bool,
    verdict: Result<(), &'static str>,
) -> Result<bool, &'static str> {
    if selection().is_all() {
        return Ok(opted);
    }
    match verdict {
        Ok(()) => Ok(smc::opt_in(borrow(fd))),
        Err(list) => {
            drop(remove(fd));
            Err(list)
        }
    }
}

/// The report of a socket left to the kernel by `SMC_RUN_PORTS`/`DESTS`.
fn report_unselected(role: &str, fd: RawFd, peer: Option<SocketAddr>, list: &str) {
    let local = rustix::net::getsockname(borrow(fd))
        .ok()
        .and_then(|a| SocketAddr::try_from(a).ok())
        .map_or_else(|| "?".into(), |a| a.to_string());
    let peer = peer.map_or_else(|| "-".into(), |a| a.to_string());
    report_line(&format!(
        "{} {role} {local} {peer} TCP (not selected by {list})",
        std::process::id()
    ));
}

/// The address `addr` points to, if it is an IPv4 or IPv6 one.
unsafe fn sockaddr_of(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
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
unsafe fn write_sockaddr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
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
fn socket2_like(a: SocketAddr) -> Vec<u8> {
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

fn unsafe_zeroed_in() -> libc::sockaddr_in {
    // SAFETY: a plain C structure of integers, valid all zero.
    unsafe { std::mem::zeroed() }
}

fn unsafe_zeroed_in6() -> libc::sockaddr_in6 {
    // SAFETY: as above.
    unsafe { std::mem::zeroed() }
}

fn as_bytes<T>(v: &T) -> Vec<u8> {
    // SAFETY: a plain C structure (no padding read as anything but bytes
    // the kernel would copy the same way), read for its own size.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

fn real_fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: libc's fcntl with the caller's arguments.
    unsafe { real!(fcntl: fn(c_int, c_int, c_ulong) -> c_int)(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let real_connect = real!(connect: fn(c_int, *const sockaddr, socklen_t) -> c_int);
    let Some(Entry::Fresh { opted }) = get(fd) else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { real_connect(fd, addr, len) };
    };
    // SAFETY: the caller's address of `len` bytes.
    let Some(to) = (unsafe { sockaddr_of(addr, len) }) else {
        drop(remove(fd));
        // SAFETY: as above.
        return unsafe { real_connect(fd, addr, len) };
    };
    let opted = match selected(fd, opted, selection().connect(to)) {
        Ok(opted) => opted,
        Err(list) => {
            // SAFETY: as above.
            let r = unsafe { real_connect(fd, addr, len) };
            let e = errno();
            report_unselected("connect", fd, Some(to), list);
            set_errno(e);
            return r;
        }
    };
    USED.store(true, Ordering::Release);
    restore_env();
    let flags = real_fcntl(fd, libc::F_GETFL, 0);
    let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
    // SAFETY: as above.
    let r = unsafe { real_connect(fd, addr, len) };
    if r != 0 {
        let e = errno();
        if nonblock && e == libc::EINPROGRESS {
            connect_in_background(fd, opted);
        }
        set_errno(e);
        return r;
    }
    // Connected at once (a blocking socket): the handshake follows, blocking.
    if nonblock {
        real_fcntl(fd, libc::F_SETFL, (flags & !libc::O_NONBLOCK) as c_ulong);
    }
    let made = dup_own(fd).and_then(|own| SmcStream::from_connected(TcpStream::from(own), opted));
    let s = match made {
        Ok(s) => s,
        Err(e) => {
            drop(remove(fd));
            if nonblock {
                real_fcntl(fd, libc::F_SETFL, flags as c_ulong);
            }
            return fail(&e);
        }
    };
    report("connect", &s);
    if nonblock {
        real_fcntl(fd, libc::F_SETFL, flags as c_ulong);
    }
    adopt(fd, s, nonblock);
    0
}

/// After a non-blocking connect's `EINPROGRESS`: the rest runs in a thread
/// (see [`Pend`]). If that cannot start, the socket is left to the kernel
/// (plain TCP: the peer declines or times out its handshake).
fn connect_in_background(fd: RawFd, opted: bool) {
    let started = (|| -> io::Result<()> {
        let own = dup_own(fd)?;
        let (user, ctl) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            None,
        )?;
        let (user, ctl) = (dup_own(user.as_raw_fd())?, dup_own(ctl.as_raw_fd())?);
        // (the kernel raises it to its minimum; one datagram then fills it)
        rustix::net::sockopt::set_socket_send_buffer_size(&user, 1)?;
        rustix::net::send(&user, &[0u8; 1024], rustix::net::SendFlags::empty())?;
        let p = Arc::new(Pend {
            user,
            ctl,
            reg: Mutex::new(Some(Vec::new())),
        });
        drop(insert(fd, Entry::Connecting(p.clone())));
        let t = std::thread::Builder::new()
            .name("smc-connect".into())
            .spawn(move || connect_thread(fd, own, opted, p));
        if let Err(e) = t {
            drop(remove(fd));
            return Err(e);
        }
        Ok(())
    })();
    if let Err(e) = started {
        if debug() {
            eprintln!("libsmc-preload: connect on fd {fd} stays TCP: {e}");
        }
        drop(remove(fd));
    }
}

fn connect_thread(fd: RawFd, own: OwnedFd, opted: bool, p: Arc<Pend>) {
    let mut pfd = [rustix::event::PollFd::new(
        &own,
        rustix::event::PollFlags::OUT,
    )];
    while let Err(rustix::io::Errno::INTR) = rustix::event::poll(&mut pfd, None) {}
    // (getpeername rather than SO_ERROR: the error stays for the application)
    let connected = rustix::net::getpeername(&own).is_ok();
    let made = if connected {
        // the handshake runs blocking (the file's flag, the application's
        // socket's too: its calls meanwhile are answered by the library)
        let _ = rustix::io::ioctl_fionbio(&own, false);
        Some(SmcStream::from_connected(TcpStream::from(own), opted))
    } else {
        drop(own);
        None
    };
    let mut reg = p.reg.lock().unwrap_or_else(|e| e.into_inner());
    let ours = matches!(get(fd), Some(Entry::Connecting(q)) if Arc::ptr_eq(&p, &q));
    if !ours {
        // closed meanwhile: `made` goes with the thread
        *reg = None;
        drop(reg);
        let _ = rustix::net::recv(&p.ctl, &mut [0u8; 1024], rustix::net::RecvFlags::DONTWAIT);
        return;
    }
    let target = match made {
        Some(Ok(s)) => {
            report("connect", &s);
            // (the application's O_NONBLOCK, also after a fallback)
            let _ = s.set_nonblocking(true);
            adopt(fd, s, true);
            match get(fd) {
                Some(Entry::Stream(c)) => c.s.readiness_fd().map_or(fd, |r| r.as_raw_fd()),
                _ => fd,
            }
        }
        Some(Err(e)) => {
            // a failed handshake ends the connection, as a reset would,
            // and SO_ERROR says why
            if debug() {
                eprintln!("libsmc-preload: connect on fd {fd}: handshake failed: {e}");
            }
            drop(insert(fd, Entry::Failed(errno_of(&e))));
            let _ = rustix::io::ioctl_fionbio(borrow(fd), true);
            let _ = rustix::net::shutdown(borrow(fd), rustix::net::Shutdown::Both);
            fd
        }
        None => {
            drop(remove(fd));
            fd
        }
    };
    let real_ctl = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    for (ep, mut ev) in reg.take().unwrap_or_default() {
        // SAFETY: epoll_ctl on the application's epoll set with an event of
        // our own; `user` and `target` are open.
        unsafe {
            real_ctl(
                ep,
                libc::EPOLL_CTL_DEL,
                p.user.as_raw_fd(),
                std::ptr::null_mut(),
            );
            real_ctl(ep, libc::EPOLL_CTL_ADD, target, &mut ev);
        }
    }
    drop(reg);
    // pollers wake up, and look again
    let _ = rustix::net::recv(&p.ctl, &mut [0u8; 1024], rustix::net::RecvFlags::DONTWAIT);
}

/// Carries `s` on the application's `fd`, or leaves it to the kernel if it
/// is plain TCP with nothing read ahead.
fn adopt(fd: RawFd, s: SmcStream, nonblock: bool) {
    if s.mode() == Mode::SmcR || s.has_pending() {
        let _ = s.set_nonblocking(nonblock);
        let c = Arc::new(Conn {
            s,
            peeked: Mutex::new(Vec::new()),
        });
        drop(insert(fd, Entry::Stream(c)));
    } else {
        drop(remove(fd));
        // (dropping `s` closes the library's duplicate only)
    }
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let real_listen = real!(listen: fn(c_int, c_int) -> c_int);
    let Some(Entry::Fresh { opted }) = get(fd) else {
        // SAFETY: the caller's arguments, unchanged (so for every call below).
        return unsafe { real_listen(fd, backlog) };
    };
    // (before the real listen: a SYN may come at once; an unbound socket
    // has port 0 here, and gets a port no list names)
    let port = rustix::net::getsockname(borrow(fd))
        .ok()
        .and_then(|a| SocketAddr::try_from(a).ok())
        .map_or(0, |a| a.port());
    let selected = selected(fd, opted, selection().listen(port));
    // SAFETY: as above.
    let r = unsafe { real_listen(fd, backlog) };
    let opted = match selected {
        Ok(opted) => opted,
        Err(list) => {
            if r == 0 {
                report_unselected("listen", fd, None, list);
            }
            return r;
        }
    };
    if r != 0 {
        return r;
    }
    if !opted {
        drop(remove(fd));
        return r;
    }
    // (its driver starts at the first accept or poll: see Entry::Passive)
    drop(insert(fd, Entry::Passive));
    r
}

/// Starts the listener of a listening socket (Entry::Passive) on its first
/// use; the entry `fd` has then.
fn activate(fd: RawFd) -> Option<Entry> {
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(Entry::Passive) = get(fd) else {
        return get(fd);
    };
    if was_inherited(fd) && !smc::is_opted_in(borrow(fd)) {
        // (its SYN-ACKs carry no SMC option: the kernel serves it)
        drop(remove(fd));
        return None;
    }
    USED.store(true, Ordering::Release);
    restore_env();
    let flags = real_fcntl(fd, libc::F_GETFL, 0);
    let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
    match dup_own(fd).and_then(|own| SmcListener::from_listening(TcpListener::from(own), true)) {
        Ok(l) => {
            let _ = l.set_nonblocking(nonblock);
            let l = Arc::new(Lst {
                l,
                nonblock: AtomicBool::new(nonblock),
            });
            drop(insert(fd, Entry::Listener(l.clone())));
            Some(Entry::Listener(l))
        }
        Err(e) => {
            if debug() {
                eprintln!("libsmc-preload: listener on fd {fd} stays TCP: {e}");
            }
            drop(remove(fd));
            None
        }
    }
}

/// `fd`'s entry, a listener started if it is one.
fn get_active(fd: RawFd) -> Option<Entry> {
    match get(fd)? {
        Entry::Passive => activate(fd),
        e => Some(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let Some(Entry::Listener(l)) = get_active(fd) else {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe {
            real!(accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int)(
                fd, addr, len, flags,
            )
        };
    };
    let (s, peer) = match l.l.accept() {
        Ok(x) => x,
        Err(e) => return fail(&e),
    };
    let cmd = if flags & libc::SOCK_CLOEXEC != 0 {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    let nfd = real_fcntl(s.tcp_fd().as_raw_fd(), cmd, 0);
    if nfd < 0 {
        return nfd;
    }
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    // (the file's O_NONBLOCK, shared with the library's duplicate)
    let _ = s.set_nonblocking(nonblock);
    // SAFETY: the caller's address buffer and its length.
    unsafe { write_sockaddr(peer, addr, len) };
    report("accept", &s);
    adopt(nfd, s, nonblock);
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { accept4(fd, addr, len, 0) }
}

/// Reads for `recv(flags)` into `buf`.
fn conn_recv(c: &Conn, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
    if flags & libc::MSG_OOB != 0 {
        return match c.s.recv_oob()? {
            Some(b) if !buf.is_empty() => {
                buf[0] = b;
                Ok(1)
            }
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
    }
    let dont_wait = flags & libc::MSG_DONTWAIT != 0;
    let peek = flags & libc::MSG_PEEK != 0;
    {
        let mut p = c.peeked.lock().unwrap_or_else(|e| e.into_inner());
        if !p.is_empty() {
            let n = buf.len().min(p.len());
            buf[..n].copy_from_slice(&p[..n]);
            if !peek {
                p.drain(..n);
            }
            return Ok(n);
        }
    }
    if peek {
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

/// Writes for `send(flags)`: all of it unless non-blocking, as TCP does.
fn conn_send(c: &Conn, buf: &[u8], flags: c_int) -> io::Result<usize> {
    let dont_wait = flags & libc::MSG_DONTWAIT != 0;
    let r = (|| {
        if flags & libc::MSG_OOB != 0 && !buf.is_empty() {
            let n = write_all(c, &buf[..buf.len() - 1], dont_wait)?;
            if n < buf.len() - 1 {
                return Ok(n);
            }
            c.s.send_oob(buf[buf.len() - 1])?;
            return Ok(buf.len());
        }
        write_all(c, buf, dont_wait)
    })();
    let r = r.map_err(|e| tcp_write_error(c, e));
    if let Err(e) = &r {
        if e.kind() == io::ErrorKind::BrokenPipe && flags & libc::MSG_NOSIGNAL == 0 {
            // SAFETY: raise has no preconditions.
            unsafe { libc::raise(libc::SIGPIPE) };
        }
    }
    r
}

/// A write's error as TCP's: SMC (as Linux AF_SMC) says `ECONNRESET` to a
/// write after the peer closed, where TCP, whose peer answers the data with
/// a reset in `CLOSE_WAIT`, says `EPIPE` (tcp_input.c `tcp_reset`) and
/// raises `SIGPIPE`. A peer that closed shows end of file (or data before
/// it, kept for the next read); one that reset or aborted, an error.
fn tcp_write_error(c: &Conn, e: io::Error) -> io::Error {
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

fn write_all(c: &Conn, buf: &[u8], dont_wait: bool) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match c.s.write_with(&buf[done..], dont_wait) {
            Ok(n) => done += n,
            Err(e) if done > 0 && e.kind() != io::ErrorKind::Interrupted => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The caller's buffer.
unsafe fn slice_mut<'a>(buf: *mut c_void, n: size_t) -> &'a mut [u8] {
    if buf.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller passes `n` writable bytes at `buf`.
    unsafe { std::slice::from_raw_parts_mut(buf.cast(), n) }
}

unsafe fn slice<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller passes `n` readable bytes at `buf`.
    unsafe { std::slice::from_raw_parts(buf.cast(), n) }
}

fn ret(r: io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => fail(&e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, 0)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe { real!(read: fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, n) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        Io::Smc(c) => ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, flags)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags)
        },
    }
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
    match io(fd) {
        Io::Smc(c) => {
            if !alen.is_null() {
                // SAFETY: the caller's length; a connected stream has no source address
                unsafe { *alen = 0 };
            }
            // SAFETY: the caller's buffer of `n` bytes.
            ret(conn_recv(&c, unsafe { slice_mut(buf, n) }, flags))
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
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
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, 0)),
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
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, flags)),
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
        Io::Smc(c) => ret(conn_send(&c, unsafe { slice(buf, n) }, flags)),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t)(
                fd, buf, n, flags, addr, alen,
            )
        },
    }
}

/// The caller's iovecs.
unsafe fn iovs<'a>(iov: *const iovec, cnt: c_int) -> &'a [iovec] {
    if iov.is_null() || cnt <= 0 {
        return &[];
    }
    // SAFETY: the caller passes `cnt` iovecs at `iov`.
    unsafe { std::slice::from_raw_parts(iov, cnt as usize) }
}

/// Reads for `readv`/`recvmsg`: one read into a buffer of their total size,
/// scattered over them.
unsafe fn recv_iov(c: &Conn, iov: &[iovec], flags: c_int) -> io::Result<usize> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut tmp = vec![0u8; total.min(4 << 20)];
    let n = conn_recv(c, &mut tmp, flags)?;
    let mut off = 0;
    for v in iov {
        if off >= n {
            break;
        }
        let k = v.iov_len.min(n - off);
        // SAFETY: the caller's iovec of `iov_len` writable bytes.
        unsafe { slice_mut(v.iov_base, k) }.copy_from_slice(&tmp[off..off + k]);
        off += k;
    }
    Ok(n)
}

/// Writes for `writev`/`sendmsg`: one iovec after the other.
unsafe fn send_iov(c: &Conn, iov: &[iovec], flags: c_int) -> io::Result<usize> {
    let mut done = 0;
    for v in iov {
        // SAFETY: the caller's iovec of `iov_len` readable bytes.
        let b = unsafe { slice(v.iov_base, v.iov_len) };
        match conn_send(c, b, flags) {
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

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match io(fd) {
        // SAFETY: the caller's iovecs.
        Io::Smc(c) => ret(unsafe { recv_iov(&c, iovs(iov, cnt), 0) }),
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
        Io::Smc(c) => ret(unsafe { send_iov(&c, iovs(iov, cnt), 0) }),
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        Io::Kernel => unsafe {
            real!(writev: fn(c_int, *const iovec, c_int) -> ssize_t)(fd, iov, cnt)
        },
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match io(fd) {
        Io::Smc(c) if !msg.is_null() => {
            // SAFETY: the caller's message header.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: its iovecs.
            ret(unsafe { recv_iov(&c, iovs(m.msg_iov, m.msg_iovlen as c_int), flags) })
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(recvmsg: fn(c_int, *mut msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match io(fd) {
        Io::Smc(c) if !msg.is_null() => {
            // SAFETY: the caller's message header and its iovecs.
            let m = unsafe { &*msg };
            ret(unsafe { send_iov(&c, iovs(m.msg_iov, m.msg_iovlen as c_int), flags) })
        }
        Io::Busy => busy(),
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real!(sendmsg: fn(c_int, *const msghdr, c_int) -> ssize_t)(fd, msg, flags) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(c) = stream(fd) {
        if c.s.mode() == Mode::SmcR {
            let h = match how {
                libc::SHUT_RD => std::net::Shutdown::Read,
                libc::SHUT_WR => std::net::Shutdown::Write,
                libc::SHUT_RDWR => std::net::Shutdown::Both,
                _ => {
                    set_errno(libc::EINVAL);
                    return -1;
                }
            };
            return match c.s.shutdown(h) {
                Ok(()) => 0,
                Err(e) => fail(&e),
            };
        }
    }
    // SAFETY: the caller's arguments, unchanged.
    unsafe { real!(shutdown: fn(c_int, c_int) -> c_int)(fd, how) }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let old = remove(fd);
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(close: fn(c_int) -> c_int)(fd) };
    let e = errno();
    // the last handle of an SMC-R connection closes it (after its data left)
    drop(old);
    set_errno(e);
    r
}

/// After `nfd` became a duplicate of `fd`: it carries what `fd` carries.
fn duplicated(fd: c_int, nfd: c_int) {
    if nfd < 0 || nfd == fd {
        return;
    }
    let old = match get(fd) {
        Some(e) => insert(nfd, e),
        None => remove(nfd),
    };
    drop(old);
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup: fn(c_int) -> c_int)(fd) };
    duplicated(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, nfd: c_int) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup2: fn(c_int, c_int) -> c_int)(fd, nfd) };
    duplicated(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, nfd: c_int, flags: c_int) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every call below).
    let r = unsafe { real!(dup3: fn(c_int, c_int, c_int) -> c_int)(fd, nfd, flags) };
    duplicated(fd, r);
    r
}

/// `O_NONBLOCK` set on `fd` by the application.
fn nonblocking_set(fd: c_int, on: bool) {
    match get(fd) {
        Some(Entry::Stream(c)) => {
            let _ = c.s.set_nonblocking(on);
        }
        Some(Entry::Listener(l)) => {
            l.nonblock.store(on, Ordering::Relaxed);
            let _ = l.l.set_nonblocking(on);
            // the driver's socket stays non-blocking
            let _ = rustix::io::ioctl_fionbio(borrow(fd), true);
        }
        _ => {}
    }
}

/// `fcntl` (variadic in C; its one argument, if any, is passed in the
/// register the third parameter takes on the ABIs Linux runs on).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    let r = real_fcntl(fd, cmd, arg);
    fcntl_after(fd, cmd, arg, r)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: as `fcntl`.
    let r = unsafe { real!(fcntl64: fn(c_int, c_int, c_ulong) -> c_int)(fd, cmd, arg) };
    fcntl_after(fd, cmd, arg, r)
}

fn fcntl_after(fd: c_int, cmd: c_int, arg: c_ulong, r: c_int) -> c_int {
    if r < 0 || COUNT.load(Ordering::Acquire) == 0 {
        return r;
    }
    match cmd {
        libc::F_SETFL => nonblocking_set(fd, arg as c_int & libc::O_NONBLOCK != 0),
        libc::F_GETFL => match get(fd) {
            Some(Entry::Listener(l)) => {
                let nb = if l.nonblock.load(Ordering::Relaxed) {
                    libc::O_NONBLOCK
                } else {
                    0
                };
                return (r & !libc::O_NONBLOCK) | nb;
            }
            // (blocking meanwhile for the handshake)
            Some(Entry::Connecting(_)) => return r | libc::O_NONBLOCK,
            _ => {}
        },
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => duplicated(fd, r),
        _ => {}
    }
    r
}

/// `ioctl` (variadic in C, as `fcntl`).
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    if COUNT.load(Ordering::Acquire) != 0 {
        if let Some(c) = stream(fd) {
            if req == libc::FIONREAD as c_ulong && !arg.is_null() {
                // what a read would return now: read ahead without waiting
                let mut p = c.peeked.lock().unwrap_or_else(|e| e.into_inner());
                let mut tmp = vec![0u8; 64 << 10];
                if let Ok(n) = c.s.read_with(&mut tmp, true) {
                    p.extend_from_slice(&tmp[..n]);
                }
                // SAFETY: FIONREAD's argument is an int.
                unsafe { *(arg as *mut c_int) = p.len().min(c_int::MAX as usize) as c_int };
                return 0;
            }
        }
    }
    // SAFETY: the caller's arguments, unchanged.
    let r = unsafe { real!(ioctl: fn(c_int, c_ulong, *mut c_void) -> c_int)(fd, req, arg) };
    if r == 0 && req == libc::FIONBIO as c_ulong && !arg.is_null() {
        // SAFETY: FIONBIO's argument is an int.
        nonblocking_set(fd, unsafe { *(arg as *const c_int) } != 0);
    }
    r
}

/// What a poll on an SMC descriptor waits on instead: its readiness
/// descriptor, and whether a read would return at once (bytes read ahead).
fn poll_target(fd: c_int) -> Option<(RawFd, bool, Entry)> {
    match get_active(fd)? {
        Entry::Stream(c) => {
            let now = c.s.has_pending()
                || !c
                    .peeked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty();
            let r = c.s.readiness_fd().ok()?.as_raw_fd();
            Some((r, now, Entry::Stream(c)))
        }
        Entry::Listener(l) => {
            let r = l.l.readiness_fd().ok()?.as_raw_fd();
            Some((r, false, Entry::Listener(l)))
        }
        Entry::Connecting(p) => Some((p.user.as_raw_fd(), false, Entry::Connecting(p))),
        Entry::Fresh { .. } | Entry::Passive | Entry::Failed(_) => None,
    }
}

/// Runs `f` on a copy of `fds` whose SMC descriptors are replaced by their
/// readiness descriptors, and copies the results back.
unsafe fn poll_via(
    fds: *mut pollfd,
    n: nfds_t,
    f: impl FnOnce(*mut pollfd, nfds_t, bool) -> c_int,
) -> Option<c_int> {
    if COUNT.load(Ordering::Acquire) == 0 || fds.is_null() || n == 0 {
        return None;
    }
    // SAFETY: the caller's `n` pollfds.
    let user = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let mut copy: Vec<pollfd> = user.to_vec();
    // (held until the poll returns: the descriptors stay open)
    let mut keep = Vec::new();
    let mut now = vec![false; copy.len()];
    let mut pend = vec![None; copy.len()];
    for (k, p) in copy.iter_mut().enumerate() {
        if let Some((r, ready, e)) = poll_target(p.fd) {
            p.fd = r;
            now[k] = ready && p.events & libc::POLLIN != 0;
            if let Entry::Connecting(c) = &e {
                pend[k] = Some(c.clone());
            }
            keep.push(e);
        }
    }
    if keep.is_empty() {
        return None;
    }
    let any_now = now.iter().any(|x| *x);
    let r = f(copy.as_mut_ptr(), n, any_now);
    if r < 0 {
        return Some(r);
    }
    let mut count = 0;
    for (k, (u, c)) in user.iter_mut().zip(copy.iter()).enumerate() {
        u.revents = c.revents;
        if now[k] {
            u.revents |= libc::POLLIN;
        }
        if u.revents != 0
            && pend[k]
                .as_ref()
                .is_some_and(|p| p.reg.lock().unwrap_or_else(|e| e.into_inner()).is_none())
        {
            // a connect that finished during the poll: what the
            // connection's own descriptor shows now
            let mut again = [pollfd {
                fd: u.fd,
                events: u.events,
                revents: 0,
            }];
            // SAFETY: our own pollfd (through `poll`, which maps it).
            if unsafe { poll(again.as_mut_ptr(), 1, 0) } >= 0 {
                u.revents = again[0].revents;
            }
        }
        if u.revents != 0 {
            count += 1;
        }
    }
    drop(keep);
    Some(count)
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let real_poll = real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int);
    // SAFETY: the caller's pollfds; the real poll gets a copy of the same length.
    let via = unsafe {
        poll_via(fds, n, |p, n, now| {
            real_poll(p, n, if now { 0 } else { timeout })
        })
    };
    match via {
        Some(r) => r,
        // SAFETY: the caller's arguments, unchanged.
        None => unsafe { real_poll(fds, n, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real_ppoll = real!(ppoll: fn(*mut pollfd, nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int);
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as `poll`; the timeout and mask are the caller's.
    let via = unsafe {
        poll_via(fds, n, |p, n, now| {
            real_ppoll(p, n, if now { &zero } else { ts }, sigmask)
        })
    };
    match via {
        Some(r) => r,
        // SAFETY: the caller's arguments, unchanged.
        None => unsafe { real_ppoll(fds, n, ts, sigmask) },
    }
}

/// `select` on SMC descriptors: answered by `poll` on their readiness
/// descriptors (FD_SETSIZE bounds both).
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let real_select = real!(select: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int);
    let ts = (!tv.is_null()).then(|| {
        // SAFETY: the caller's timeout.
        let t = unsafe { &*tv };
        libc::timespec {
            tv_sec: t.tv_sec,
            tv_nsec: (t.tv_usec as libc::c_long).clamp(0, 999_999) * 1000,
        }
    });
    // SAFETY: the caller's sets; the real select gets the caller's arguments.
    unsafe {
        select_via(nfds, rd, wr, ex, ts, std::ptr::null(), || {
            real_select(nfds, rd, wr, ex, tv)
        })
    }
}

/// `pselect`, as `select` with `ppoll`'s signal mask.
#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real_pselect = real!(pselect: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int);
    // SAFETY: the caller's timeout.
    let t = (!ts.is_null()).then(|| unsafe { *ts });
    // SAFETY: as `select`.
    unsafe {
        select_via(nfds, rd, wr, ex, t, sigmask, || {
            real_pselect(nfds, rd, wr, ex, ts, sigmask)
        })
    }
}

/// `select`/`pselect`: `real` if no SMC descriptor is in the sets, else
/// `ppoll` (ours) on the same descriptors.
unsafe fn select_via(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: Option<libc::timespec>,
    sigmask: *const libc::sigset_t,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let isset = |s: *mut libc::fd_set, fd: c_int| {
        // SAFETY: the caller's set, for a descriptor below nfds.
        !s.is_null() && unsafe { libc::FD_ISSET(fd, s) }
    };
    let nfds_c = nfds.clamp(0, libc::FD_SETSIZE as c_int);
    let ours = COUNT.load(Ordering::Acquire) != 0
        && (0..nfds_c).any(|fd| {
            (isset(rd, fd) || isset(wr, fd) || isset(ex, fd))
                && matches!(
                    get(fd),
                    Some(
                        Entry::Stream(_)
                            | Entry::Listener(_)
                            | Entry::Connecting(_)
                            | Entry::Passive
                    )
                )
        });
    if !ours {
        return real();
    }
    let mut pfds: Vec<pollfd> = Vec::new();
    for fd in 0..nfds_c {
        let mut ev = 0;
        if isset(rd, fd) {
            ev |= libc::POLLIN;
        }
        if isset(wr, fd) {
            ev |= libc::POLLOUT;
        }
        if isset(ex, fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            pfds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: our own pollfds, the caller's timeout and mask.
    let r = unsafe { ppoll(pfds.as_mut_ptr(), pfds.len() as nfds_t, tsp, sigmask) };
    if r < 0 {
        return r;
    }
    for s in [rd, wr, ex] {
        if !s.is_null() {
            // SAFETY: the caller's set.
            unsafe { libc::FD_ZERO(s) };
        }
    }
    let mut count = 0;
    for p in &pfds {
        let mut mark = |s: *mut libc::fd_set, hit: bool| {
            if hit && !s.is_null() {
                // SAFETY: the caller's set, for a descriptor below nfds.
                unsafe { libc::FD_SET(p.fd, s) };
                count += 1;
            }
        };
        let bad = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
        mark(
            rd,
            p.events & libc::POLLIN != 0 && (p.revents & libc::POLLIN != 0 || bad),
        );
        mark(
            wr,
            p.events & libc::POLLOUT != 0 && (p.revents & libc::POLLOUT != 0 || bad),
        );
        mark(
            ex,
            p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0,
        );
    }
    count
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    let real_ctl = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    loop {
        let target = if COUNT.load(Ordering::Acquire) == 0 {
            None
        } else {
            poll_target(fd)
        };
        let p = match target {
            Some((_, _, Entry::Connecting(p))) => p,
            // SAFETY: the caller's arguments, with an SMC descriptor's
            // readiness descriptor in its place (it lives as long as the
            // connection).
            t => return unsafe { real_ctl(epfd, op, t.map_or(fd, |(r, _, _)| r), ev) },
        };
        let mut reg = p.reg.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = reg.as_mut() else {
            // done meanwhile: the connection's entry now
            continue;
        };
        // SAFETY: as above, with the connect's descriptor; the set is
        // recorded so that the thread moves it to the connection's.
        let r = unsafe { real_ctl(epfd, op, p.user.as_raw_fd(), ev) };
        if r == 0 {
            list.retain(|(e, _)| *e != epfd);
            if op != libc::EPOLL_CTL_DEL && !ev.is_null() {
                // SAFETY: the caller's event.
                list.push((epfd, unsafe { *ev }));
            }
        }
        return r;
    }
}

// glibc's fortified variants (`_FORTIFY_SOURCE`, as distributions build
// their programs): the same calls with the buffer's known size, checked
// first as glibc does (`__chk_fail` aborts).

fn chk(n: usize, room: usize) {
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

unsafe fn file_to_conn(
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
                        let fd = c.s.readiness_fd().map(|r| r.as_raw_fd());
                        if let Ok(r) = fd {
                            let mut p = [pollfd {
                                fd: r,
                                events: libc::POLLOUT,
                                revents: 0,
                            }];
                            // SAFETY: our own pollfd.
                            unsafe {
                                real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int)(
                                    p.as_mut_ptr(),
                                    1,
                                    1000,
                                )
                            };
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
                    Err(rustix::io::Errno::AGAIN) => {
                        let mut p = [pollfd {
                            fd: fd_out,
                            events: libc::POLLOUT,
                            revents: 0,
                        }];
                        // SAFETY: our own pollfd.
                        unsafe {
                            real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int)(
                                p.as_mut_ptr(),
                                1,
                                1000,
                            )
                        };
                    }
                    Err(e) => return fail(&e.into()),
                }
            }
            got as ssize_t
        }
        // SAFETY: the caller's arguments, unchanged.
        _ => unsafe { real_splice(fd_in, off_in, fd_out, off_out, len, flags) },
    }
}

// ----- exec -----
//
// An SMC-R connection lives in the process image that made it: its buffers,
// its link and the threads that serve them. Its TCP socket is only the
// connection's identity (after the CLC handshake no data flows on it,
// RFC 7609 §2.2), so a new image that inherited the bare socket would wait
// forever on reads and send its writes where the peer never reads them.
// Before an exec the library therefore puts, on every descriptor that
// survives it (no `FD_CLOEXEC`) and names a connection of the library's, a
// fresh unconnected TCP socket of the same family: in the new image reads
// fail with `ENOTCONN`, writes with `EPIPE` (and `SIGPIPE`), `poll` shows
// `POLLHUP` at once, `getpeername` says `ENOTCONN` — a connection that is
// gone, never one that hangs or loses data silently. If the exec fails, the
// descriptors are put back as they were.
//
// What becomes of the connection itself: after `fork()` + exec in the
// child (inetd, CGI), the parent still has it and keeps using it; after an
// exec of the process itself, its image is gone, and the peer sees the
// connection end as when a process exits. Covered: `execve`, `execv`,
// `execvp`, `execvpe`, `fexecve`, `execveat`. The variadic `execl*` (which
// stable Rust cannot define) and `posix_spawn` (whose exec is glibc's own,
// not interposable) are not.

/// Identity of an open file (device, inode): the same socket under any
/// descriptor number.
fn file_id(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    let st = rustix::fs::fstat(fd).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// Before an exec: the connections' descriptors that would survive it get a
/// stand-in (see above); returns the originals (close-on-exec duplicates)
/// to put back should the exec fail.
fn detach_for_exec() -> Vec<(RawFd, OwnedFd)> {
    if !USED.load(Ordering::Acquire) {
        return Vec::new();
    }
    let forked = FORKED.load(Ordering::Acquire);
    let ids: Vec<(u64, u64)> = {
        // (a forked child's table is its parent's at the fork, kept unused)
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        t.iter()
            .filter_map(|(&fd, e)| match e {
                Entry::Stream(c) => file_id(c.s.tcp_fd()),
                // (its own duplicate is the connect thread's)
                Entry::Connecting(_) if !forked => file_id(borrow(fd)),
                _ => None,
            })
            .collect()
    };
    if ids.is_empty() {
        return Vec::new();
    }
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let fds: Vec<RawFd> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut saved = Vec::new();
    for fd in fds {
        let survives = rustix::io::fcntl_getfd(borrow(fd))
            .is_ok_and(|f| !f.contains(rustix::io::FdFlags::CLOEXEC));
        if !survives || !file_id(borrow(fd)).is_some_and(|id| ids.contains(&id)) {
            continue;
        }
        let v6 = rustix::net::getsockname(borrow(fd))
            .is_ok_and(|a| a.address_family() == rustix::net::AddressFamily::INET6);
        let family = if v6 {
            rustix::net::AddressFamily::INET6
        } else {
            rustix::net::AddressFamily::INET
        };
        // (rustix's calls are system calls: none of them comes back here)
        let stand_in = match rustix::net::socket(family, rustix::net::SocketType::STREAM, None) {
            Ok(s) => s,
            Err(_) => continue,
        };
        let Ok(orig) = dup_own(fd) else { continue };
        if let Ok(fl) = rustix::fs::fcntl_getfl(borrow(fd)) {
            let _ = rustix::fs::fcntl_setfl(&stand_in, fl);
        }
        let mut target = borrow_owned(fd);
        if rustix::io::dup2(&stand_in, &mut target).is_ok() {
            saved.push((fd, orig));
        }
        std::mem::forget(target);
    }
    saved
}

/// `fd` as an `OwnedFd` for `dup2`'s target (forgotten after, never closed).
fn borrow_owned(fd: RawFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is open (just listed); the caller forgets the value, so
    // it is never closed through it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// After a failed exec: the descriptors as they were.
fn reattach_after_exec(saved: Vec<(RawFd, OwnedFd)>) {
    let e = errno();
    for (fd, orig) in saved {
        let mut target = borrow_owned(fd);
        let _ = rustix::io::dup2(&orig, &mut target);
        std::mem::forget(target);
    }
    set_errno(e);
}

type CStr = *const libc::c_char;
type CArgv = *const *const libc::c_char;

#[no_mangle]
pub unsafe extern "C" fn execve(path: CStr, argv: CArgv, envp: CArgv) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: the caller's arguments, unchanged (so for every exec below).
    let r = unsafe { real!(execve: fn(CStr, CArgv, CArgv) -> c_int)(path, argv, envp) };
    reattach_after_exec(saved);
    r
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: CStr, argv: CArgv) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: as above.
    let r = unsafe { real!(execv: fn(CStr, CArgv) -> c_int)(path, argv) };
    reattach_after_exec(saved);
    r
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: CStr, argv: CArgv) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: as above.
    let r = unsafe { real!(execvp: fn(CStr, CArgv) -> c_int)(file, argv) };
    reattach_after_exec(saved);
    r
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: CStr, argv: CArgv, envp: CArgv) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: as above.
    let r = unsafe { real!(execvpe: fn(CStr, CArgv, CArgv) -> c_int)(file, argv, envp) };
    reattach_after_exec(saved);
    r
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: CArgv, envp: CArgv) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: as above.
    let r = unsafe { real!(fexecve: fn(c_int, CArgv, CArgv) -> c_int)(fd, argv, envp) };
    reattach_after_exec(saved);
    r
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: CStr,
    argv: CArgv,
    envp: CArgv,
    flags: c_int,
) -> c_int {
    let saved = detach_for_exec();
    // SAFETY: as above.
    let r = unsafe {
        real!(execveat: fn(c_int, CStr, CArgv, CArgv, c_int) -> c_int)(
            dirfd, path, argv, envp, flags,
        )
    };
    reattach_after_exec(saved);
    r
}
