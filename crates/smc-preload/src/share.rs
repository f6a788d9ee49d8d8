//! SMC-R connections shared with a forked child, as TCP sockets are.
//!
//! An SMC-R connection lives in the process that made it (its endpoint
//! state, the threads that serve it, its queue pairs: see `smc::fork`); a
//! child has a frozen copy of that memory, which it must never use. Yet a
//! TCP socket open at `fork()` works in both processes, and programs rely on
//! it: a client that connects and then hands the connection to a worker
//! child (and closes its own copy), a parent and child that both write to
//! one connection, a shell's `exec 3<>/dev/tcp/...` used by its children.
//!
//! So the process that owns the connection serves the child's calls on it:
//! * before the fork ([`prepare`]), the owner makes a channel (a
//!   `SOCK_SEQPACKET` pair) and takes a reference to each connection open
//!   then;
//! * after it, in the owner ([`serve`]), a thread of the library answers the
//!   child's requests on that channel with the connection itself: a read or
//!   write that does not wait (the owner's thread never blocks for a child),
//!   a shutdown, the child's close of its last copy, `FIONREAD`;
//! * in the child ([`Remote`]), the connection's descriptor keeps working:
//!   its calls become requests, and a call that would block waits on the
//!   connection's readiness descriptor (and its peer signal), which the
//!   child inherited: both are kernel objects the owner sets, so `poll`,
//!   `select` and `epoll` in the child see them as in the owner.
//!
//! The connection ends when no process holds it any more: the owner's
//! `close()` drops its handle, but the channel's thread keeps one for each
//! connection the child has not closed (a child that exits, or execs, closes
//! its end of the channel, and the thread lets go of them all). Bytes go
//! through the channel (a copy more than in the owner); this is for
//! correctness, not speed: the child's own connections are SMC-R of its own.
//!
//! Limits: one level (a child's child gets clear errors on connections the
//! child shares, as before an exec: `ENOTCONN`, `EPIPE`); the owner must
//! live while the child uses the connection (the connection lives in it).
//! The child's blocking calls wait by the socket's `SO_RCVTIMEO` and
//! `SO_SNDTIMEO`; the owner's by what its own `setsockopt` set (one the
//! child makes is not seen by the owner's calls).

use super::*;

/// The largest read or write of one request (a `SOCK_SEQPACKET` message
/// fits in the default socket buffer).
pub(crate) const CHUNK: usize = 64 << 10;

const RECV: u8 = 1;
const SEND: u8 = 2;
const SHUTDOWN: u8 = 3;
const CLOSE: u8 = 4;
const FIONREAD: u8 = 5;
const LOOK: u8 = 6;

/// A request: op, connection (the descriptor it had at the fork), flags,
/// argument, then the bytes of a write.
const REQ: usize = 16;
/// An answer: the result (bytes, or minus an errno), the bytes the owner
/// holds read ahead (`MSG_PEEK`, `FIONREAD`) after it, then a read's bytes.
const ANS: usize = 16;

/// What [`prepare`] made before a fork, for the parent's and the child's
/// handlers.
pub(crate) struct Prepared {
    /// The connections open at the fork, by descriptor, with what the
    /// child needs of each (read here: in the child the connection's state
    /// is the parent's, which the library does not touch there).
    conns: Vec<(RawFd, Arc<Conn>, Seen)>,
    /// The owner's end of the channel, and the child's.
    own: OwnedFd,
    child: OwnedFd,
}

thread_local! {
    /// [`prepare`]'s work, from the thread that forks to its handlers.
    pub(crate) static PREPARED: std::cell::RefCell<Option<Prepared>> =
        const { std::cell::RefCell::new(None) };
}

/// A connection's descriptors and mode, as the child inherits them.
#[derive(Clone, Copy)]
struct Seen {
    ready: RawFd,
    signal: Option<RawFd>,
    tcp: RawFd,
    nonblock: bool,
}

/// Before a fork, in the forking thread: a channel and a reference to each
/// SMC-R connection in the table, each with its readiness descriptor made
/// (the child cannot make one). Nothing when there is none, or no
/// descriptor left for the channel (the child then gets clear errors on
/// them, as before).
pub(crate) fn prepare() {
    if !USED.load(Ordering::Acquire) {
        return;
    }
    let streams: Vec<(RawFd, Arc<Conn>)> = TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(fd, e)| match e {
            Entry::Stream(c) => Some((fd, c.clone())),
            _ => None,
        })
        .collect();
    let conns: Vec<(RawFd, Arc<Conn>, Seen)> = streams
        .into_iter()
        .filter_map(|(fd, c)| {
            let seen = Seen {
                ready: c.s.readiness_fd().ok()?.as_raw_fd(),
                signal: c.s.signal_fd().map(|s| s.as_raw_fd()),
                tcp: c.s.tcp_fd().as_raw_fd(),
                nonblock: c.s.is_nonblocking(),
            };
            Some((fd, c, seen))
        })
        .collect();
    if conns.is_empty() {
        return;
    }
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    let Ok((own, child)) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    ) else {
        return;
    };
    let own = out_of_the_way(own);
    let child = out_of_the_way(child);
    // The owner answers at once (nothing it does for a child waits): a
    // child whose answer does not come finds its owner stuck or gone,
    // and fails the call rather than hang.
    let _ = rustix::net::sockopt::set_socket_timeout(
        &child,
        rustix::net::sockopt::Timeout::Recv,
        Some(std::time::Duration::from_secs(30)),
    );
    PREPARED.with(|p| *p.borrow_mut() = Some(Prepared { conns, own, child }));
}

/// A descriptor of the library's moved to the upper half of the descriptor
/// numbers, as the library's others are (`smc_rdma::sys::out_of_the_way`:
/// event loops refuse sockets numbered above the tables they size).
fn out_of_the_way(fd: OwnedFd) -> OwnedFd {
    let cur = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1024);
    let base = (cur / 2).clamp(64, 4096) as RawFd;
    match rustix::io::fcntl_dupfd_cloexec(&fd, base) {
        Ok(high) => {
            close_raw(fd);
            high
        }
        Err(_) => fd,
    }
}

/// The connections a serving thread holds for its child, by descriptor.
type Held = Mutex<BTreeMap<RawFd, Arc<Conn>>>;
type Served = Arc<Held>;

/// Every serving thread's channel descriptor and connections, for
/// [`release_all`] and [`forget_served_in_child`].
static SERVED: Mutex<Vec<(RawFd, std::sync::Weak<Held>)>> = Mutex::new(Vec::new());

/// At `exit()`: the connections children still share end with this
/// process, closed as `close()` would (their data leaves first) rather than
/// aborted with it; the children's next calls on them fail.
pub(crate) fn release_all() {
    let Ok(list) = SERVED.try_lock() else { return };
    let maps: Vec<Served> = list.iter().filter_map(|(_, w)| w.upgrade()).collect();
    drop(list);
    for m in maps {
        let all = std::mem::take(&mut *m.lock().unwrap_or_else(|e| e.into_inner()));
        drop(all);
    }
}

/// In a forked child: the channels its parent serves other children on are
/// not its own (inherited descriptors, without the threads): closed, so
/// that those children see the end of their channel when the parent is
/// gone. (A lock a parent's thread held at the fork is left alone.)
pub(crate) fn forget_served_in_child() {
    let Ok(mut list) = SERVED.try_lock() else {
        return;
    };
    for (fd, _) in list.drain(..) {
        // SAFETY: the parent's channel descriptor, inherited; nothing in
        // this process uses it (the thread that did is the parent's).
        unsafe { rustix::io::close(fd) };
    }
    // (the parent's maps: never dropped here)
    std::mem::forget(std::mem::take(&mut *list));
}

/// After the fork, in the parent: a thread serves the child's calls on the
/// connections of [`prepare`] until the child closes its end.
pub(crate) fn serve() {
    let Some(p) = PREPARED.with(|p| p.borrow_mut().take()) else {
        return;
    };
    let Prepared { conns, own, child } = p;
    close_raw(child);
    let conns: Served = Arc::new(Mutex::new(
        conns.into_iter().map(|(fd, c, _)| (fd, c)).collect(),
    ));
    {
        let mut list = SERVED.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|(_, w)| w.strong_count() > 0);
        list.push((own.as_raw_fd(), Arc::downgrade(&conns)));
    }
    let t = std::thread::Builder::new()
        .name("smc-share".into())
        .spawn(move || serve_child(own, conns));
    if let Err(e) = t {
        if debug() {
            eprintln!("libsmc-preload: no thread to serve a forked child's connections: {e}");
        }
    }
}

/// Closes a descriptor with the system call (not the C library's `close`,
/// which is ours and takes the table's lock).
fn close_raw(fd: OwnedFd) {
    let fd = std::os::fd::IntoRawFd::into_raw_fd(fd);
    // SAFETY: `fd` was owned here and nothing else closes it.
    unsafe { rustix::io::close(fd) };
}

/// The owner's side of one child's channel.
fn serve_child(chan: OwnedFd, conns: Served) {
    let mut req = vec![0u8; REQ + CHUNK];
    let mut ans = vec![0u8; ANS + CHUNK];
    loop {
        let n = match rustix::net::recv(&chan, &mut req, rustix::net::RecvFlags::empty()) {
            Ok((n, _)) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => break,
        };
        if n == 0 {
            break; // the child exited or exec'd
        }
        if n < REQ {
            continue;
        }
        let op = req[0];
        let id = i32::from_ne_bytes(req[4..8].try_into().unwrap());
        let flags = i32::from_ne_bytes(req[8..12].try_into().unwrap());
        let arg = u32::from_ne_bytes(req[12..16].try_into().unwrap()) as usize;
        // The map's lock is held across the request, the answer and a
        // close's drop: `release_all` (at the owner's `exit()`) waits for
        // them, so that a handle this thread holds is never the last one
        // when the process ends (it would die with the thread, unclosed: the
        // peer would see the connection aborted instead of its end). Nothing
        // here waits for the child.
        let mut map = conns.lock().unwrap_or_else(|e| e.into_inner());
        let c = map.get(&id).cloned();
        let (r, len) = match &c {
            None => (-(libc::EBADF as i64), 0),
            Some(c) => answer(c, op, flags, arg, &req[REQ..n], &mut ans[ANS..]),
        };
        let held = c.as_ref().map_or(0, |c| {
            c.peeked.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
        });
        ans[..8].copy_from_slice(&r.to_ne_bytes());
        ans[8..16].copy_from_slice(&held.to_ne_bytes());
        let sent = rustix::net::send(&chan, &ans[..ANS + len], rustix::net::SendFlags::NOSIGNAL);
        // (after the answer: the last handle's close may wait for its data
        // to leave)
        let gone = if op == CLOSE { map.remove(&id) } else { None };
        drop((c, gone, map));
        if sent.is_err() {
            break;
        }
    }
    // the child is gone: its copies of the connections with it (dropped
    // under the lock, for `release_all` as above)
    conns.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// One request on connection `c`: its result and the bytes it put in `out`.
fn answer(c: &Conn, op: u8, flags: i32, arg: usize, data: &[u8], out: &mut [u8]) -> (i64, usize) {
    let res = |r: io::Result<usize>| match r {
        Ok(n) => n as i64,
        Err(e) => -(errno_of(&e) as i64),
    };
    match op {
        RECV => {
            let max = arg.min(out.len());
            let r = conn_recv(c, &mut out[..max], flags | libc::MSG_DONTWAIT);
            if matches!(&r, Err(e) if e.kind() == io::ErrorKind::WouldBlock) && c.s.signal_polled()
            {
                // (a peer signal with nothing behind it is drained, so the
                // child's wait on it does not spin)
                let _ = c.s.signalled_events();
            }
            let n = *r.as_ref().unwrap_or(&0);
            (res(r), n)
        }
        SEND => (
            res(conn_send(
                c,
                data,
                flags | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )),
            0,
        ),
        SHUTDOWN => {
            let r = if c.s.mode() == Mode::SmcR {
                let h = match arg as c_int {
                    libc::SHUT_RD => std::net::Shutdown::Read,
                    libc::SHUT_WR => std::net::Shutdown::Write,
                    _ => std::net::Shutdown::Both,
                };
                c.s.shutdown(h).map(|()| 0)
            } else {
                let h = match arg as c_int {
                    libc::SHUT_RD => rustix::net::Shutdown::Read,
                    libc::SHUT_WR => rustix::net::Shutdown::Write,
                    _ => rustix::net::Shutdown::Both,
                };
                rustix::net::shutdown(c.s.tcp_fd(), h)
                    .map(|()| 0)
                    .map_err(io::Error::from)
            };
            (res(r), 0)
        }
        CLOSE => (0, 0),
        FIONREAD => (res(Ok(fionread(c))), 0),
        LOOK => {
            // what the peer signalled, taken (as the owner's own poll does)
            let mut ev = c.s.signalled_events().unwrap_or(0);
            if !c
                .peeked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                ev |= libc::EPOLLIN as u32;
            }
            (ev as i64, 0)
        }
        _ => (-(libc::EINVAL as i64), 0),
    }
}

/// `FIONREAD` of a connection: what a read would return now. On SMC-R the
/// connection counts its bytes without taking them: read ahead into the
/// bytes kept for the next read, they would be out of every descriptor an
/// epoll set watches, and a wait after `FIONREAD` would not see them (TCP's
/// shows its receive queue). A fallback connection reads ahead, without
/// waiting (its bytes behind the CLC messages are the library's).
pub(crate) fn fionread(c: &Conn) -> usize {
    let mut p = c.peeked.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = c.s.readable_bytes() {
        return p.len() + n;
    }
    let mut tmp = vec![0u8; 64 << 10];
    if let Ok(n) = c.s.read_with(&mut tmp, true) {
        p.extend_from_slice(&tmp[..n]);
    }
    p.len()
}

/// The child's end of a channel to the owner of its inherited connections.
pub(crate) struct Chan {
    fd: RawFd,
    /// One request at a time (the child's threads share the channel).
    lock: Mutex<()>,
}

impl Drop for Chan {
    fn drop(&mut self) {
        // SAFETY: the channel's descriptor is this value's own.
        unsafe { rustix::io::close(self.fd) };
    }
}

/// In a forked child: a connection the parent owns (see the module
/// documentation). Its descriptors' entries share it; the last one's drop
/// (the child's last `close()`) tells the owner.
pub(crate) struct Remote {
    /// The connection's descriptor at the fork (the owner's key).
    id: RawFd,
    /// Its readiness descriptor and peer signal (inherited).
    pub(crate) ready: RawFd,
    pub(crate) signal: Option<RawFd>,
    /// The library's own duplicate of its TCP socket (inherited; what an
    /// exec recognizes the connection's descriptors by).
    pub(crate) tcp: RawFd,
    chan: Arc<Chan>,
    /// The child's `O_NONBLOCK` on it.
    nonblock: AtomicBool,
    /// Bytes the owner holds read ahead (a read returns them at once).
    held: AtomicUsize,
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = self.call(CLOSE, 0, 0, &[], &mut []);
    }
}

/// In the forked child, for [`forget_the_parents`](crate::lifecycle): the
/// connections of [`prepare`] as [`Remote`]s, by descriptor, and the channel
/// kept; `None` if this fork had no channel.
pub(crate) fn adopt_in_child() -> Option<BTreeMap<RawFd, Remote>> {
    let p = PREPARED.with(|p| p.borrow_mut().take())?;
    let Prepared { conns, own, child } = p;
    close_raw(own);
    let chan = Arc::new(Chan {
        fd: std::os::fd::IntoRawFd::into_raw_fd(child),
        lock: Mutex::new(()),
    });
    let mut out = BTreeMap::new();
    for (fd, _, seen) in &conns {
        out.insert(
            *fd,
            Remote {
                id: *fd,
                ready: seen.ready,
                signal: seen.signal,
                tcp: seen.tcp,
                chan: chan.clone(),
                nonblock: AtomicBool::new(seen.nonblock),
                held: AtomicUsize::new(0),
            },
        );
    }
    // (the parent's handles: never dropped here, see `smc::fork`)
    std::mem::forget(conns);
    Some(out)
}

impl Remote {
    /// One request and its answer; the answer's result as `io::Result`.
    fn call(
        &self,
        op: u8,
        flags: c_int,
        arg: usize,
        data: &[u8],
        out: &mut [u8],
    ) -> io::Result<usize> {
        let mut req = Vec::with_capacity(REQ + data.len());
        req.extend_from_slice(&[op, 0, 0, 0]);
        req.extend_from_slice(&self.id.to_ne_bytes());
        req.extend_from_slice(&flags.to_ne_bytes());
        req.extend_from_slice(&(arg.min(u32::MAX as usize) as u32).to_ne_bytes());
        req.extend_from_slice(data);
        let mut ans = vec![0u8; ANS + out.len()];
        let chan = borrow(self.chan.fd);
        let _one = self.chan.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match rustix::net::send(chan, &req, rustix::net::SendFlags::NOSIGNAL) {
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => continue,
                // the owner is gone: so is the connection
                Err(_) => return Err(io::Error::from_raw_os_error(libc::ECONNRESET)),
            }
        }
        let n = loop {
            match rustix::net::recv(chan, &mut ans, rustix::net::RecvFlags::empty()) {
                Ok((n, _)) => break n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return Err(io::Error::from_raw_os_error(libc::ECONNRESET)),
            }
        };
        if n < ANS {
            return Err(io::Error::from_raw_os_error(libc::ECONNRESET));
        }
        let r = i64::from_ne_bytes(ans[..8].try_into().unwrap());
        let held = u64::from_ne_bytes(ans[8..16].try_into().unwrap());
        self.held.store(held as usize, Ordering::Relaxed);
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r as i32));
        }
        let got = (n - ANS).min(out.len());
        out[..got].copy_from_slice(&ans[ANS..ANS + got]);
        Ok(r as usize)
    }

    /// Whether a read would return at once for bytes the owner read ahead.
    pub(crate) fn has_held(&self) -> bool {
        self.held.load(Ordering::Relaxed) > 0
    }

    pub(crate) fn set_nonblocking(&self, on: bool) {
        self.nonblock.store(on, Ordering::Relaxed);
    }

    pub(crate) fn is_nonblocking(&self) -> bool {
        self.nonblock.load(Ordering::Relaxed)
    }

    /// Waits until the connection may have become readable (`POLLIN`) or
    /// writable (`POLLOUT`): its readiness descriptor, and for reading its
    /// peer signal, with the real `poll` (both are the library's own
    /// descriptors), or until `until`. A signal interrupts the wait, not the
    /// call (the library's blocking calls restart, as with `SA_RESTART`).
    fn wait(&self, events: libc::c_short, until: Option<std::time::Instant>) {
        if events & libc::POLLIN != 0 && self.has_held() {
            return;
        }
        let mut p = [
            pollfd {
                fd: self.ready,
                events,
                revents: 0,
            },
            pollfd {
                fd: self
                    .signal
                    .filter(|_| events & libc::POLLIN != 0)
                    .unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = until.map_or(1000, |u| {
            let left = u.saturating_duration_since(std::time::Instant::now());
            // (rounded up: a wait that ends early only looks once more)
            left.as_micros().div_ceil(1000).min(1000) as c_int
        });
        // SAFETY: our own pollfds; the timeout bounds a wait that a change
        // of the owner's (a signal it drained) would otherwise prolong.
        unsafe { real!(poll: fn(*mut pollfd, nfds_t, c_int) -> c_int)(p.as_mut_ptr(), 2, ms) };
    }

    /// When a call that waits from now on gives up: the TCP socket's
    /// `SO_RCVTIMEO` or `SO_SNDTIMEO` (`which`) from now, which the child
    /// shares with the owner as it would a TCP socket's.
    fn deadline(&self, which: c_int) -> Option<std::time::Instant> {
        crate::sockopt::kernel_timeout(self.tcp, which).map(|d| std::time::Instant::now() + d)
    }

    /// `recv(flags)` on the connection.
    pub(crate) fn recv(&self, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
        let dont_wait = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let pass = flags & (libc::MSG_PEEK | libc::MSG_OOB);
        let all = flags & libc::MSG_WAITALL != 0 && pass == 0 && !dont_wait;
        let mut got = 0;
        // (SO_RCVTIMEO, looked up once the call would wait)
        let mut until = None;
        loop {
            let want = (buf.len() - got).min(CHUNK);
            match self.call(RECV, pass, want, &[], &mut buf[got..got + want]) {
                Ok(0) => return Ok(got),
                Ok(n) => {
                    got += n;
                    if !all || got == buf.len() {
                        return Ok(got);
                    }
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        && !dont_wait
                        && pass & libc::MSG_OOB == 0 =>
                {
                    let until = *until.get_or_insert_with(|| self.deadline(libc::SO_RCVTIMEO));
                    if until.is_some_and(|u| std::time::Instant::now() >= u) {
                        return if got > 0 { Ok(got) } else { Err(e) };
                    }
                    self.wait(libc::POLLIN, until)
                }
                Err(_) if got > 0 => return Ok(got),
                Err(e) => return Err(e),
            }
        }
    }

    /// `send(flags)` on the connection: all of it unless non-blocking, as
    /// TCP does; `SIGPIPE` for a peer that is gone unless `MSG_NOSIGNAL`.
    pub(crate) fn send(&self, buf: &[u8], flags: c_int) -> io::Result<usize> {
        let dont_wait = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let oob = flags & libc::MSG_OOB != 0 && !buf.is_empty();
        let pipe = |e: io::Error| {
            if e.raw_os_error() == Some(libc::EPIPE) && flags & libc::MSG_NOSIGNAL == 0 {
                // SAFETY: raise has no preconditions.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            e
        };
        if buf.is_empty() {
            // nothing to write, but the connection's state to say, as the
            // owner's write of nothing says it (`rw::send_nothing`)
            return self.call(SEND, 0, 0, &[], &mut []).map_err(pipe);
        }
        let mut done = 0;
        // (SO_SNDTIMEO, looked up once the call would wait)
        let mut until = None;
        while done < buf.len() {
            let end = (done + CHUNK).min(buf.len());
            // (urgent: the last byte, in a request of its own)
            let (end, f) = if oob && end == buf.len() {
                if end - done > 1 {
                    (end - 1, 0)
                } else {
                    (end, libc::MSG_OOB)
                }
            } else {
                (end, 0)
            };
            match self.call(SEND, f, 0, &buf[done..end], &mut []) {
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !dont_wait => {
                    let until = *until.get_or_insert_with(|| self.deadline(libc::SO_SNDTIMEO));
                    if until.is_some_and(|u| std::time::Instant::now() >= u) {
                        return if done > 0 { Ok(done) } else { Err(e) };
                    }
                    self.wait(libc::POLLOUT, until)
                }
                Err(_) if done > 0 => return Ok(done),
                Err(e) => return Err(pipe(e)),
            }
            if dont_wait && done < end {
                break;
            }
        }
        Ok(done)
    }

    pub(crate) fn shutdown(&self, how: c_int) -> io::Result<()> {
        if !matches!(how, libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.call(SHUTDOWN, 0, how as usize, &[], &mut [])
            .map(|_| ())
    }

    /// After the peer signal woke a poll: what the connection shows now
    /// (`EPOLL*` bits; the owner takes what the signal announced).
    pub(crate) fn look(&self) -> u32 {
        self.call(LOOK, 0, 0, &[], &mut []).unwrap_or(0) as u32
    }

    pub(crate) fn fionread(&self) -> io::Result<usize> {
        self.call(FIONREAD, 0, 0, &[], &mut [])
    }
}

/// A shared connection's channel (a child's child closes the channels it
/// inherited: their owner is not its parent).
pub(crate) fn channel_of(r: &Remote) -> RawFd {
    r.chan.fd
}
