//! Connections that wait in a blocking listener's queue: their handshake
//! runs in a thread of the library, and a token connection takes their
//! place in the queue.
//!
//! A blocking listening socket leaves its connections in the kernel's
//! accept queue until the program accepts them, and their handshake to
//! their first use ([`Entry::LazyListener`], `late.rs`). Meanwhile each
//! client is held in its `connect()`, waiting for the server's CLC Accept,
//! and gives up after 6 s (`smc_clc_wait_msg`: Linux's client fails its
//! connect, ours falls back to TCP): an iterative server that serves one
//! client at a time, or a program that polls its listener only between
//! other work (Python's `socketserver`), would have the next client's
//! connect fail, or go without SMC-R, where TCP's completes in the kernel.
//! Linux's AF_SMC runs every handshake in its listen worker whatever the
//! program does (`smc_tcp_listen_work`). Here, once a
//! connection has waited [`QUEUE_WAIT`] there (the program accepting none,
//! or fewer than come: the queue is first in, first out, so the program's
//! accepts since tell, [`Aging`]) and no thread of the program is in
//! `accept()`, the library's thread takes the connections that waited that
//! long from the queue and runs their handshakes; so that the program
//! still finds it where it looks, in the kernel's queue (a blocking
//! `accept()`, or poll, select and epoll, which only the kernel answers),
//! the thread puts a connection of its own there in its place, a *token*:
//! a loopback connection to the listening socket, never offered SMC. The
//! program's `accept()` that returns a token gets the connection it stands
//! for, on the descriptor the token was given (`take`).
//!
//! Only a listening socket that no other process accepts on: a forked
//! process could accept a token without knowing what it stands for (a token
//! has no meaning outside the process that made it). So a `fork()` after
//! `listen()` turns this off for the socket in the process that forked (the
//! servers that fork accept at once anyway), and a forked child has it only
//! once its parent is gone and if it has not forked itself ([`Standing`]: a
//! daemon that listens, forks and lets its parent exit). The thread's `accept` must not
//! block (another thread may take the connection first): the socket's file
//! is made non-blocking for that call, and an `accept()` of the program's
//! that fails with `EAGAIN` meanwhile is made again ([`accept_of`]).

use super::*;
use std::sync::atomic::AtomicU64;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// How long a connection waits in the queue of a blocking listener before
/// the library takes it: well within the client's
/// 6 s wait for the Accept (which the handshake may take up to 3 s of, a
/// first contact with the same peer in progress), and long enough for a
/// program that accepts at its own pace not to notice.
const QUEUE_WAIT: Duration = Duration::from_secs(1);

/// How soon the queue is looked at again when a thread of the program was
/// in `accept()` at the last look.
const AGAIN: Duration = Duration::from_millis(10);

/// A blocking listening socket whose queued connections the library takes
/// when nobody accepts them (see the module documentation).
pub(crate) struct Rescue {
    /// A duplicate of the listening socket, for the thread.
    own: OwnedFd,
    /// Where a token connects: the socket's address (its loopback address
    /// for a wildcard one).
    to: SocketAddr,
    /// The fork count at `listen()` (see `lifecycle::forks`).
    forks: u64,
    /// Connections the library took, each with its token in the queue.
    tokens: Mutex<Vec<Token>>,
    /// The program's threads in `accept()` on the socket now.
    in_accept: AtomicUsize,
    /// The program's `accept()` calls that returned a client's connection
    /// (not a token).
    accepted: AtomicU64,
    /// The queue as the thread last started to watch it (see [`Aging`]).
    aging: Mutex<Option<Aging>>,
}

/// A connection the library took from the queue, and the token in its
/// place.
struct Token {
    /// The token's client end: its address is what `accept()` reports as
    /// the token's peer.
    dummy: OwnedFd,
    local: SocketAddr,
    /// The connection: its client's address, and the stream the handshake
    /// made (over SMC-R, or TCP).
    peer: SocketAddr,
    stream: SmcStream,
}

impl Drop for Rescue {
    fn drop(&mut self) {
        // (the thread lets go of the duplicate at its next look)
        wake();
    }
}

/// Listening sockets the thread watches.
static WATCHED: Mutex<Vec<Weak<Rescue>>> = Mutex::new(Vec::new());

/// The thread's wake-up (an eventfd), and the process it belongs to.
static WAKE: Mutex<Option<(u32, OwnedFd)>> = Mutex::new(None);

/// The file status flag changes of the thread's `accept` (odd: one now).
static TOGGLES: AtomicU64 = AtomicU64::new(0);

type Guards = (
    std::sync::MutexGuard<'static, Option<(u32, OwnedFd)>>,
    std::sync::MutexGuard<'static, Vec<Weak<Rescue>>>,
);

thread_local! {
    /// The thread's locks, held by the thread that forks across `fork()`, so
    /// that the child does not inherit one held by the thread.
    static FORK_GUARD: std::cell::RefCell<Option<Guards>> = const { std::cell::RefCell::new(None) };
}

/// Before `fork()`: the thread's locks taken.
pub(crate) fn before_fork() {
    let g = (lock(&WAKE), lock(&WATCHED));
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// After `fork()`, in parent and child: the locks let go. (The rescues the
/// parent runs stay the parent's, `lifecycle::in_child`; a child starts its
/// own for a listening socket it first uses, see [`Standing`].)
pub(crate) fn after_fork() {
    FORK_GUARD.with(|f| drop(f.borrow_mut().take()));
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn wake() {
    if let Some((pid, fd)) = lock(&WAKE).as_ref() {
        if *pid == std::process::id() {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }
}

/// The rescue of listening socket `fd`, in blocking mode at its first use
/// and listening since fork count `forks`, unless it is shared with another
/// process for good ([`Standing::Shared`]).
pub(crate) fn start(fd: RawFd, forks: u64) -> Option<Arc<Rescue>> {
    if standing(forks) == Standing::Shared {
        return None;
    }
    let at = SocketAddr::try_from(rustix::net::getsockname(borrow(fd)).ok()?).ok()?;
    let to = match at.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), at.port())
        }
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => {
            SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), at.port())
        }
        _ => at,
    };
    let own = dup_own(fd).ok()?;
    let r = Arc::new(Rescue {
        own,
        to,
        forks,
        tokens: Mutex::new(Vec::new()),
        in_accept: AtomicUsize::new(0),
        accepted: AtomicU64::new(0),
        aging: Mutex::new(None),
    });
    let me = std::process::id();
    {
        let mut w = lock(&WAKE);
        if w.as_ref().is_none_or(|(pid, _)| *pid != me) {
            let efd = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .ok()?;
            let started = std::thread::Builder::new()
                .name("smc-queue".into())
                .spawn(run);
            if started.is_err() {
                return None;
            }
            // (a child's copy of its parent's eventfd is forgotten: the
            // parent's thread owns it)
            if let Some((_, old)) = w.replace((me, efd)) {
                std::mem::forget(old);
            }
        }
    }
    lock(&WATCHED).push(Arc::downgrade(&r));
    wake();
    Some(r)
}

/// Whether a listening socket is this process's alone, as far as forks
/// tell.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Standing {
    /// No fork since its `listen()`; or this process was forked from the
    /// one that listened (or its forked descendant), has not forked since,
    /// and its parent is gone (a daemon that listens, forks and lets its
    /// parent exit).
    Own,
    /// Inherited from a parent that lives, and no fork since: the parent
    /// may still accept on it; its end would make it [`Standing::Own`].
    ParentLives,
    /// Shared with a process this one forked since `listen()`: for good.
    Shared,
}

/// The standing of a listening socket that listens since fork count
/// `forks` (see [`Standing`]).
fn standing(forks: u64) -> Standing {
    let now = crate::lifecycle::forks();
    if forks == now {
        return Standing::Own;
    }
    let (ppid, born) = crate::lifecycle::birth();
    if ppid == 0 || born != now || forks >= born {
        return Standing::Shared;
    }
    let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_pid() as u32);
    if parent == ppid {
        Standing::ParentLives
    } else {
        Standing::Own
    }
}

/// The program's `accept4(fd, addr, len, flags)` on a blocking listening
/// socket with rescue `r`: the real call, made again when it failed with
/// `EAGAIN` only because the thread's `accept` had the file non-blocking
/// for a moment; a token it returns is swapped for its connection. Also
/// whether the descriptor is settled (an error, or a token's connection);
/// otherwise it is a client's, for the caller.
///
/// # Safety
/// The caller's arguments of `accept4`.
pub(crate) unsafe fn accept_of(
    r: &Rescue,
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> (c_int, bool) {
    let real_accept4 = real!(accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int);
    r.in_accept.fetch_add(1, Ordering::AcqRel);
    let nfd = loop {
        let before = TOGGLES.load(Ordering::Acquire);
        // SAFETY: the caller's arguments.
        let nfd = unsafe { real_accept4(fd, addr, len, flags) };
        if nfd < 0 && errno() == libc::EAGAIN {
            let after = TOGGLES.load(Ordering::Acquire);
            if before % 2 == 1 || after != before {
                std::thread::yield_now();
                continue;
            }
        }
        break nfd;
    };
    r.in_accept.fetch_sub(1, Ordering::AcqRel);
    if nfd < 0 {
        return (nfd, true);
    }
    let peer = rustix::net::getpeername(borrow(nfd))
        .ok()
        .flatten()
        .and_then(|a| SocketAddr::try_from(a).ok());
    let t = {
        let mut tokens = lock(&r.tokens);
        let Some(k) = peer.and_then(|p| tokens.iter().position(|t| t.local == p)) else {
            // (a connection of a client: the caller's)
            r.accepted.fetch_add(1, Ordering::AcqRel);
            return (nfd, false);
        };
        tokens.swap_remove(k)
    };
    // The token's server end, `nfd`, becomes the connection's socket (with
    // its close-on-exec flag, as accept4 set it); the token's client end
    // closes with `t`.
    if !crate::exec::put_on(t.stream.tcp_fd(), nfd) {
        // (no way to hand it over: the program gets the token, which its
        // client end's close ends; the connection is reset)
        return (nfd, true);
    }
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    let mut fl = rustix::fs::fcntl_getfl(borrow(nfd)).unwrap_or(rustix::fs::OFlags::empty());
    fl.set(rustix::fs::OFlags::NONBLOCK, nonblock);
    let _ = rustix::fs::fcntl_setfl(borrow(nfd), fl);
    // SAFETY: the caller's address buffer and its length.
    unsafe { write_sockaddr(t.peer, addr, len) };
    report("accept", &t.stream);
    adopt(nfd, t.stream, nonblock);
    (nfd, true)
}

/// The thread: waits for connections in the queues of the sockets it
/// watches, and takes those that waited [`QUEUE_WAIT`] ([`look`]).
fn run() {
    let me = std::process::id();
    loop {
        let list: Vec<Arc<Rescue>> = {
            let mut w = lock(&WATCHED);
            w.retain(|r| {
                r.upgrade()
                    .is_some_and(|r| standing(r.forks) != Standing::Shared)
            });
            w.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        // (one whose queue has only its tokens is looked at by time: it
        // polls readable until the program accepts them; so is one whose
        // parent may still accept on it, for the parent's end)
        let mut polled: Vec<(Weak<Rescue>, RawFd)> = Vec::new();
        let mut next: Option<Instant> = None;
        for r in &list {
            let aging = *lock(&r.aging);
            let at = match aging {
                _ if standing(r.forks) != Standing::Own => now + QUEUE_WAIT,
                Some(a) => a.since + QUEUE_WAIT,
                None if lock(&r.tokens).is_empty() => {
                    polled.push((Arc::downgrade(r), r.own.as_raw_fd()));
                    continue;
                }
                None => now + QUEUE_WAIT,
            };
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        // (no strong reference across the wait: a socket the program
        // closes is let go at once, its `Drop` wakes the wait)
        drop(list);
        let efd = match lock(&WAKE).as_ref() {
            Some((pid, efd)) if *pid == me => efd.as_raw_fd(),
            _ => return,
        };
        let readable = {
            // (the eventfd stays open: only a child's `start` replaces it,
            // in the child, where this thread does not run; a watched
            // socket's descriptor may close during the wait, which then
            // holds its file, and is not used after it)
            let efd = borrow(efd);
            let socks: Vec<BorrowedFd<'_>> = polled.iter().map(|&(_, fd)| borrow(fd)).collect();
            let mut fds: Vec<rustix::event::PollFd<'_>> = Vec::with_capacity(socks.len() + 1);
            fds.push(rustix::event::PollFd::new(
                &efd,
                rustix::event::PollFlags::IN,
            ));
            for s in &socks {
                fds.push(rustix::event::PollFd::new(s, rustix::event::PollFlags::IN));
            }
            let timeout = next.map(|n| {
                let d = n.saturating_duration_since(now);
                rustix::event::Timespec {
                    tv_sec: d.as_secs() as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                }
            });
            let _ = rustix::event::poll(&mut fds, timeout.as_ref());
            if !fds[0].revents().is_empty() {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(efd, &mut b);
            }
            fds[1..]
                .iter()
                .map(|f| !f.revents().is_empty())
                .collect::<Vec<_>>()
        };
        let now = Instant::now();
        for ((r, _), ready) in polled.iter().zip(readable) {
            if let (true, Some(r)) = (ready, r.upgrade()) {
                *lock(&r.aging) = Some(Aging::from(&r, now));
            }
        }
        let list: Vec<Arc<Rescue>> = lock(&WATCHED).iter().filter_map(Weak::upgrade).collect();
        for r in list {
            look(&r, now);
        }
    }
}

/// Connections waiting in `r`'s queue besides its tokens.
fn waiting(r: &Rescue) -> usize {
    // (for a listening socket, `tcpi_unacked` is its accept queue's length,
    // tcp.c `tcp_get_info`)
    // SAFETY: an all-zero `tcp_info` is a valid value (integers only).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as socklen_t;
    // SAFETY: `info` and `len` are this function's, `len` its size; the
    // socket is the rescue's own duplicate, open while `r` is.
    let rc = unsafe {
        libc::getsockopt(
            r.own.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    let n = if rc == 0 {
        info.tcpi_unacked as usize
    } else {
        0
    };
    n.saturating_sub(lock(&r.tokens).len())
}

/// The queue of a listening socket at a time the thread looked: the
/// connections there then (its tokens aside) and how many the program had
/// accepted. The queue is first in, first out, so once the program has
/// accepted that many more, every connection that was there is gone; until
/// then the first of them is still there, and has waited since.
#[derive(Clone, Copy, Debug)]
struct Aging {
    since: Instant,
    there: usize,
    accepted: u64,
}

impl Aging {
    fn from(r: &Rescue, now: Instant) -> Aging {
        Aging {
            since: now,
            there: waiting(r),
            accepted: r.accepted.load(Ordering::Acquire),
        }
    }
}

/// Takes the connections of `r`'s queue that waited [`QUEUE_WAIT`] (see
/// [`Aging`]; a program that accepts as fast as they come, however full
/// its queue, keeps its own).
fn look(r: &Rescue, now: Instant) {
    if standing(r.forks) != Standing::Own {
        *lock(&r.aging) = None;
        return;
    }
    let aging = *lock(&r.aging);
    let Some(a) = aging else {
        // (one not polled: with tokens, or just the process's own)
        if waiting(r) > 0 {
            *lock(&r.aging) = Some(Aging::from(r, now));
        }
        return;
    };
    if now < a.since + QUEUE_WAIT {
        return;
    }
    let accepted = r.accepted.load(Ordering::Acquire);
    if waiting(r) == 0 {
        *lock(&r.aging) = None;
        return;
    }
    if accepted.saturating_sub(a.accepted) >= a.there as u64 {
        // (all that were there are the program's: what is there now is
        // watched from now)
        *lock(&r.aging) = Some(Aging::from(r, now));
        return;
    }
    if r.in_accept.load(Ordering::Acquire) > 0 {
        // (a thread of the program takes one now: a look again shortly)
        *lock(&r.aging) = Some(Aging {
            since: now - QUEUE_WAIT + AGAIN,
            ..a
        });
        return;
    }
    take_one(r);
    // (the next of those that were there waited as long: at once; the one
    // taken is one fewer of them)
    *lock(&r.aging) = Some(Aging {
        since: now - QUEUE_WAIT,
        there: a.there.saturating_sub(1),
        ..a
    });
}

/// Takes the first connection of `r`'s queue, runs its handshake and puts a
/// token in its place.
fn take_one(r: &Rescue) {
    // (the token's socket first: a process out of descriptors leaves the
    // connection in the queue, and one taken is never lost for want of a
    // token)
    let Some((dummy, local)) = token_socket(r.to) else {
        return;
    };
    let Some(sock) = accept_now(r) else { return };
    let peer = rustix::net::getpeername(&sock)
        .ok()
        .flatten()
        .and_then(|a| SocketAddr::try_from(a).ok());
    let Some(peer) = peer else { return };
    let mut tokens = lock(&r.tokens);
    if let Some(k) = tokens.iter().position(|t| t.local == peer) {
        // One of the tokens came first in the queue: it goes back, as a
        // new one.
        tokens[k].dummy = dummy;
        tokens[k].local = local;
        if !connect_token(&tokens[k].dummy, r.to) {
            // (its connection cannot reach the program: closed)
            tokens.swap_remove(k);
        }
        return;
    }
    drop(tokens);
    let stream = match smc::deferred::classify(TcpStream::from(sock), true) {
        smc::deferred::Deferred::Ready(s) => s,
        smc::deferred::Deferred::Pending(p) => match p.handshake() {
            Ok(s) => s,
            Err(e) => {
                // (as the listener's driver does: a connection whose
                // handshake failed is closed before any accept)
                if debug() {
                    eprintln!("libsmc-preload: a queued connection: {e}");
                }
                return;
            }
        },
    };
    // (recorded before it connects: the program's accept may return it at
    // once, and must find it)
    let mut tokens = lock(&r.tokens);
    tokens.push(Token {
        dummy,
        local,
        peer,
        stream,
    });
    let k = tokens.len() - 1;
    if !connect_token(&tokens[k].dummy, r.to) {
        // (the loopback connection failed: the connection cannot reach the
        // program, and is closed)
        tokens.swap_remove(k);
    }
}

/// `accept` on `r`'s socket without blocking (see the module
/// documentation).
fn accept_now(r: &Rescue) -> Option<OwnedFd> {
    static ONE: Mutex<()> = Mutex::new(());
    let _one = lock(&ONE);
    let fl = rustix::fs::fcntl_getfl(&r.own).ok()?;
    if fl.contains(rustix::fs::OFlags::NONBLOCK) {
        // (the program made it non-blocking: its accepts do not wait)
        return rustix::net::accept_with(&r.own, rustix::net::SocketFlags::CLOEXEC).ok();
    }
    TOGGLES.fetch_add(1, Ordering::AcqRel);
    let _ = rustix::fs::fcntl_setfl(&r.own, fl | rustix::fs::OFlags::NONBLOCK);
    let s = rustix::net::accept_with(&r.own, rustix::net::SocketFlags::CLOEXEC);
    let _ = rustix::fs::fcntl_setfl(&r.own, fl);
    TOGGLES.fetch_add(1, Ordering::AcqRel);
    s.ok()
}

/// A socket for a token connection to `to` (the listening socket), bound to
/// a port of its own on `to`'s address, and that address (what `accept()`
/// reports as the token's peer).
fn token_socket(to: SocketAddr) -> Option<(OwnedFd, SocketAddr)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = if to.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let s = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .ok()?;
    rustix::net::bind(&s, &SocketAddr::new(to.ip(), 0)).ok()?;
    let local = SocketAddr::try_from(rustix::net::getsockname(&s).ok()?).ok()?;
    Some((s, local))
}

/// Connects token socket `s` to `to`; whether it went.
fn connect_token(s: &OwnedFd, to: SocketAddr) -> bool {
    matches!(
        rustix::net::connect(s, &to),
        Ok(()) | Err(rustix::io::Errno::INPROGRESS)
    )
}
