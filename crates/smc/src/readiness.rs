//! Readiness descriptors: a file descriptor per SMC-R stream or listener
//! that `poll()`, `select()` and `epoll` (level- or edge-triggered) see
//! readable exactly when a read (or `accept()`) would not block and
//! writable exactly when a write would not block.
//!
//! An SMC-R connection's data never passes through a kernel object of its
//! own: it lands in the RMB by RDMA WRITE and is announced by a CDC that the
//! engine takes off a completion queue shared by every connection of the
//! device. So the kernel cannot tell a reactor when *this* connection has
//! data; the library has to say it, on a descriptor whose poll state it
//! sets whenever the connection's state changes (a pump that took
//! completions, a read or write of the application, a timer that reset the
//! connection).
//!
//! Why a datagram socket pair. The descriptor must be able to show all four
//! combinations of readable and writable, and the ends of a connection:
//! * one eventfd polls readable while its counter is above 0 and writable
//!   while it is below `u64::MAX - 1`, so it cannot be neither;
//! * a pipe end polls only its own direction, and a pipe opened read-write
//!   (through /proc) is readable while non-empty and writable while not
//!   full, again never neither;
//! * an epoll descriptor (over two eventfds, say) only ever polls readable;
//! * a connected `AF_UNIX` `SOCK_DGRAM` pair `(user, ctl)` does it: `user`
//!   is readable while a datagram waits in its receive queue (`ctl` sends a
//!   one-byte token; draining `user` clears it) and writable while its
//!   unconsumed sent datagrams take at most a quarter of its send buffer
//!   (af_unix.c `unix_writable`): with the send buffer at its minimum, one
//!   [`BLOCKER`]-byte datagram from `user` to `ctl` makes it unwritable
//!   until `ctl` drains it. (For a socket pair `unix_dgram_poll` skips the
//!   peer-queue test, so the send buffer alone decides.) `shutdown(user,
//!   SHUT_RD)` makes it readable for good with `EPOLLRDHUP`, as a TCP
//!   socket that received a FIN; `SHUT_RDWR` adds `EPOLLHUP`, as a TCP
//!   socket that was reset or closed both ways. Each change wakes pollers
//!   and epoll sets (edge-triggered ones get their edge).
//!
//! Cost: two descriptors and no thread, created only for a stream whose
//! readiness is asked for; a state change is one system call, and a look
//! that changes nothing costs a load (the state is cached). A blocked
//! reader can sleep on the same descriptor, woken by whoever takes the
//! CDC that made it readable (the per-connection wake-up of a faster data
//! path): the socket library sets it from the thread that changes the
//! connection, under the connection's own lock (`FastConn::watch`).

use rustix::net::{
    recv, send, shutdown, socketpair, sockopt, AddressFamily, RecvFlags, SendFlags, Shutdown,
    SocketFlags, SocketType,
};
use smc_rdma::sys::out_of_the_way;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// Size of the datagram that makes `user` unwritable: its truesize is more
/// than a quarter of the smallest send buffer (4608 bytes on Linux 6.x,
/// `SOCK_MIN_SNDBUF`), and it is below the largest datagram that buffer
/// lets through.
const BLOCKER: usize = 1024;

/// What a descriptor shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Level {
    /// A read (or accept) would not block: data, end of file or an error.
    pub readable: bool,
    /// A write would not block: room, or an error it would return.
    pub writable: bool,
    /// The peer sends nothing more (`EPOLLRDHUP`; readable from now on).
    pub eof: bool,
    /// The connection is over (`EPOLLHUP`; readable and writable from now on).
    pub hup: bool,
    /// The connection failed: reset by the peer or aborted (`EPOLLERR`, as
    /// a TCP socket with `sk_err` set shows it). The descriptor itself
    /// cannot show it (no kernel object of these shows an error on
    /// demand; it shows `hup`): [`Self::epoll_events`] reports it, as the
    /// stream's own `ready_events` do.
    pub err: bool,
}

const R: u8 = 1;
const W: u8 = 2;
const EOF: u8 = 4;
const HUP: u8 = 8;

impl Level {
    fn bits(self) -> u8 {
        let mut b = 0;
        if self.readable || self.eof || self.hup {
            b |= R;
        }
        if self.writable || self.hup {
            b |= W;
        }
        if self.eof || self.hup {
            b |= EOF;
        }
        if self.hup {
            b |= HUP;
        }
        b
    }

    /// What `epoll` reports for it, as for a TCP socket in that state
    /// (`EPOLLIN`, `EPOLLOUT`, `EPOLLRDHUP`, `EPOLLHUP`: tcp.c `tcp_poll`).
    pub fn epoll_events(self) -> u32 {
        const IN: u32 = 0x001;
        const OUT: u32 = 0x004;
        const HUP_EV: u32 = 0x010;
        const RDHUP: u32 = 0x2000;
        const ERR: u32 = 0x008;
        let b = self.bits();
        let ev = [(R, IN), (W, OUT), (EOF, RDHUP), (HUP, HUP_EV)]
            .into_iter()
            .filter(|&(bit, _)| b & bit != 0)
            .fold(0, |ev, (_, e)| ev | e);
        if self.err {
            ev | ERR
        } else {
            ev
        }
    }
}

/// A readiness descriptor (see the module documentation).
pub struct Readiness {
    /// The descriptor pollers see.
    user: OwnedFd,
    /// Its peer, through which the state is set.
    ctl: OwnedFd,
    /// The state shown (bits R, W, EOF, HUP).
    state: AtomicU8,
    /// Serializes changes (the socket library's callers hold the
    /// connection's lock anyway, which orders them: `ctx::ConnReadiness`).
    change: Mutex<()>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("user", &self.user)
            .field("state", &self.state.load(Ordering::Relaxed))
            .finish()
    }
}

impl Readiness {
    /// A descriptor showing `level`.
    pub fn new(level: Level) -> io::Result<Readiness> {
        let (user, ctl) = socketpair(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        // (numbered out of the way of the application's own descriptors)
        let (user, ctl) = (out_of_the_way(user), out_of_the_way(ctl));
        // the kernel raises it to its minimum
        sockopt::set_socket_send_buffer_size(&user, 1)?;
        let r = Readiness {
            user,
            ctl,
            state: AtomicU8::new(W),
            change: Mutex::new(()),
        };
        r.set(level);
        Ok(r)
    }

    /// Whether it shows readable now.
    pub fn shows_readable(&self) -> bool {
        self.state.load(Ordering::Acquire) & R != 0
    }

    /// Shows `level` from now on (a system call only for what changes).
    pub fn set(&self, level: Level) {
        let want = level.bits();
        // (a look that changes nothing, once the end shows too)
        let seen = self.state.load(Ordering::Acquire);
        if shown(want, seen) == seen {
            return;
        }
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.state.load(Ordering::Acquire);
        let new = shown(want, old);
        if new == old {
            return;
        }
        let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
        // writable first: a HUP shuts `user`'s sending down
        if new & W != old & W {
            if new & W != 0 {
                drain(&self.ctl);
            } else {
                let _ = send(&self.user, &[0u8; BLOCKER], flags);
            }
        }
        if new & HUP != old & HUP {
            let _ = shutdown(&self.user, Shutdown::Both);
        } else if new & EOF != old & EOF {
            let _ = shutdown(&self.user, Shutdown::Read);
        } else if new & EOF == 0 && new & R != old & R {
            if new & R != 0 {
                let _ = send(&self.ctl, &[1u8], flags);
            } else {
                drain(&self.user);
            }
        }
        self.state.store(new, Ordering::Release);
    }
}

/// What a connection shows its waiters: a readiness descriptor (`poll`,
/// `select`, `epoll`, reactors through `AsFd`) and the tasks of an async
/// stream (the tokio adapter), each made when first asked for; both are
/// set to the connection's level by whichever thread changes it
/// (`ctx::ConnReadiness`).
#[derive(Default)]
pub(crate) struct Shown {
    fd: std::sync::OnceLock<std::sync::Arc<Readiness>>,
    tasks: std::sync::OnceLock<std::sync::Arc<TaskReady>>,
}

impl Shown {
    /// Shows `level`; `held`: the readable part stays as the descriptor
    /// shows it (the peer signal shows those bytes to its pollers, see
    /// `ctx::PeerSignal`). Tasks see the level itself: they always wait on
    /// the signal too, and a readable that a read just emptied would have
    /// them look again at once, for nothing, in a loop.
    pub(crate) fn set(&self, level: Level, held: bool) {
        if let Some(f) = self.fd.get() {
            let mut l = level;
            if held {
                l.readable = f.shows_readable();
            }
            f.set(l);
        }
        if let Some(t) = self.tasks.get() {
            t.set(level);
        }
    }

    /// The descriptor, if made.
    pub(crate) fn fd(&self) -> Option<&std::sync::Arc<Readiness>> {
        self.fd.get()
    }

    /// The descriptor, made now showing `level` if it was not (two callers
    /// at once may both make one: the first set stays; the caller sets the
    /// level again after it, as a change meanwhile went to the others).
    pub(crate) fn fd_or_make(&self, level: Level) -> io::Result<&std::sync::Arc<Readiness>> {
        if self.fd.get().is_none() {
            let _ = self.fd.set(std::sync::Arc::new(Readiness::new(level)?));
        }
        Ok(self.fd.get().expect("set above"))
    }

    /// The tasks' side, made now showing `level` if it was not (as
    /// [`Self::fd_or_make`]).
    #[cfg(feature = "tokio")]
    pub(crate) fn tasks_or_make(&self, level: Level) -> &std::sync::Arc<TaskReady> {
        self.tasks
            .get_or_init(|| std::sync::Arc::new(TaskReady::new(level)))
    }
}

/// An async stream's tasks waiting on their connection, in place of a
/// descriptor: the waker of the task that waits to read and of the one
/// that waits to write, each woken once the level shows what it waits for
/// (readable, writable; the ends show both). No descriptor, no system
/// call: what wakes a reactor for the peer's CDCs is the peer signal.
pub(crate) struct TaskReady {
    tasks: Mutex<Tasks>,
}

struct Tasks {
    /// The level shown (bits R, W, EOF, HUP).
    level: u8,
    read: Option<std::task::Waker>,
    write: Option<std::task::Waker>,
}

impl TaskReady {
    #[cfg(feature = "tokio")]
    fn new(level: Level) -> TaskReady {
        TaskReady {
            tasks: Mutex::new(Tasks {
                level: shown(level.bits(), 0),
                read: None,
                write: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shows `level` from now on, waking a task that waits for it.
    pub(crate) fn set(&self, level: Level) {
        let (r, w) = {
            let mut t = self.lock();
            t.level = shown(level.bits(), t.level);
            let r = (t.level & R != 0).then(|| t.read.take()).flatten();
            let w = (t.level & W != 0).then(|| t.write.take()).flatten();
            (r, w)
        };
        // (woken outside the lock: a waker may run the task here)
        for x in [r, w].into_iter().flatten() {
            x.wake();
        }
    }

    /// Forgets the waker of direction `write` (its task is woken by
    /// something else, and looks anyway: a change now would wake it again
    /// for nothing).
    #[cfg(feature = "tokio")]
    pub(crate) fn forget(&self, write: bool) {
        let mut t = self.lock();
        let slot = if write { &mut t.write } else { &mut t.read };
        *slot = None;
    }

    /// Ready if the level shows readable (`write`: writable); otherwise
    /// `waker` is woken once it does (the last waker given per direction).
    #[cfg(feature = "tokio")]
    pub(crate) fn poll(&self, write: bool, waker: &std::task::Waker) -> std::task::Poll<()> {
        let mut t = self.lock();
        if t.level & if write { W } else { R } != 0 {
            return std::task::Poll::Ready(());
        }
        let slot = if write { &mut t.write } else { &mut t.read };
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
        std::task::Poll::Pending
    }
}

/// What a descriptor showing `old` shows once set to `want`: the ends of a
/// connection stay.
fn shown(want: u8, old: u8) -> u8 {
    let new = want | (old & (EOF | HUP));
    if new & HUP != 0 {
        new | R | W | EOF
    } else {
        new
    }
}

/// Takes the datagram queued on `fd`, if any: one system call. There is at
/// most one: each end gets one only when the state turns (a token when
/// `user` turns readable, the blocker when it turns unwritable), changes
/// are serialized, and the turn back takes it. (A loop until `EAGAIN` cost
/// a second call every time: an event loop's descriptors turn readable
/// and back once per message.)
fn drain(fd: &OwnedFd) {
    let mut buf = [0u8; BLOCKER];
    let _ = recv(fd, &mut buf, RecvFlags::DONTWAIT);
}

impl AsFd for Readiness {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.user.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::{epoll, PollFd, PollFlags};

    fn polled(r: &Readiness) -> PollFlags {
        let mut p = [PollFd::new(
            r,
            PollFlags::IN | PollFlags::OUT | PollFlags::RDHUP,
        )];
        rustix::event::poll(&mut p, Some(&rustix::event::Timespec::default())).unwrap();
        p[0].revents()
    }

    fn level(readable: bool, writable: bool) -> Level {
        Level {
            readable,
            writable,
            ..Level::default()
        }
    }

    /// Every combination, in every order, polls as set.
    #[test]
    fn poll_shows_each_state() {
        let states = [(false, false), (true, false), (false, true), (true, true)];
        for from in states {
            for to in states {
                let r = Readiness::new(level(from.0, from.1)).unwrap();
                r.set(level(to.0, to.1));
                let p = polled(&r);
                assert_eq!(p.contains(PollFlags::IN), to.0, "{from:?} -> {to:?}: {p:?}");
                assert_eq!(
                    p.contains(PollFlags::OUT),
                    to.1,
                    "{from:?} -> {to:?}: {p:?}"
                );
                assert!(!p.intersects(PollFlags::RDHUP | PollFlags::HUP));
            }
        }
    }

    /// End of file: readable with RDHUP from then on; the end: HUP, readable
    /// and writable.
    #[test]
    fn ends_are_shown_and_stay() {
        let r = Readiness::new(level(false, false)).unwrap();
        r.set(Level {
            eof: true,
            ..Level::default()
        });
        let p = polled(&r);
        assert!(p.contains(PollFlags::IN | PollFlags::RDHUP), "{p:?}");
        assert!(!p.contains(PollFlags::OUT) && !p.contains(PollFlags::HUP));
        r.set(level(false, true));
        let p = polled(&r);
        assert!(
            p.contains(PollFlags::IN | PollFlags::RDHUP | PollFlags::OUT),
            "{p:?}"
        );
        r.set(Level {
            hup: true,
            ..Level::default()
        });
        let p = polled(&r);
        assert!(
            p.contains(PollFlags::IN | PollFlags::OUT | PollFlags::HUP | PollFlags::RDHUP),
            "{p:?}"
        );
        r.set(level(false, false));
        assert!(polled(&r).contains(PollFlags::IN | PollFlags::OUT | PollFlags::HUP));
    }

    fn wait(ep: &OwnedFd) -> Vec<epoll::EventFlags> {
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 4];
        let (got, _) =
            epoll::wait(ep, &mut buf, Some(&rustix::event::Timespec::default())).unwrap();
        got.iter().map(|e| e.flags).collect()
    }

    /// Level-triggered epoll reports the state every time; edge-triggered
    /// once per change to ready.
    #[test]
    fn epoll_level_and_edge() {
        use epoll::EventFlags as E;
        let r = Readiness::new(level(false, false)).unwrap();
        let lt = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        let et = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        let d = epoll::EventData::new_u64(7);
        epoll::add(&lt, &r, d, E::IN | E::OUT | E::RDHUP).unwrap();
        epoll::add(&et, &r, d, E::IN | E::OUT | E::RDHUP | E::ET).unwrap();
        assert!(wait(&lt).is_empty());
        assert!(wait(&et).is_empty());
        r.set(level(true, false));
        assert_eq!(wait(&lt), vec![E::IN]);
        assert_eq!(wait(&lt), vec![E::IN], "level: again");
        assert_eq!(wait(&et), vec![E::IN]);
        assert!(wait(&et).is_empty(), "edge: once");
        r.set(level(true, true));
        assert_eq!(wait(&lt), vec![E::IN | E::OUT]);
        assert_eq!(wait(&et).len(), 1, "edge: writable is a new edge");
        assert!(wait(&et).is_empty());
        r.set(level(false, true));
        assert_eq!(wait(&lt), vec![E::OUT]);
        r.set(level(false, false));
        assert!(wait(&lt).is_empty());
        assert!(wait(&et).is_empty());
        r.set(level(true, false));
        assert_eq!(wait(&et), vec![E::IN], "edge: readable again");
        r.set(Level {
            eof: true,
            ..Level::default()
        });
        assert_eq!(wait(&lt), vec![E::IN | E::RDHUP]);
        assert_eq!(wait(&et), vec![E::IN | E::RDHUP]);
    }

    /// A waker that counts its wakes.
    #[cfg(feature = "tokio")]
    struct Count(std::sync::atomic::AtomicUsize);

    #[cfg(feature = "tokio")]
    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[cfg(feature = "tokio")]
    fn counting() -> (std::sync::Arc<Count>, std::task::Waker) {
        let c = std::sync::Arc::new(Count(Default::default()));
        (c.clone(), std::task::Waker::from(c))
    }

    /// A task waiting to read is woken once the level shows readable, not
    /// by a change that leaves it unreadable; one waiting to write once it
    /// shows writable; the end wakes both and stays; a forgotten waker is
    /// not woken.
    #[test]
    #[cfg(feature = "tokio")]
    fn tasks_are_woken_for_what_they_wait_for() {
        use std::task::Poll;
        let t = TaskReady::new(level(false, false));
        let (rc, rw) = counting();
        let (wc, ww) = counting();
        assert_eq!(t.poll(false, &rw), Poll::Pending);
        assert_eq!(t.poll(true, &ww), Poll::Pending);
        t.set(level(false, false));
        assert_eq!(rc.0.load(Ordering::SeqCst), 0, "nothing changed");
        t.set(level(false, true));
        assert_eq!(wc.0.load(Ordering::SeqCst), 1, "writable wakes the writer");
        assert_eq!(rc.0.load(Ordering::SeqCst), 0, "and not the reader");
        t.set(level(true, true));
        assert_eq!(rc.0.load(Ordering::SeqCst), 1, "readable wakes the reader");
        t.set(level(true, true));
        assert_eq!(rc.0.load(Ordering::SeqCst), 1, "once per wait");
        assert_eq!(t.poll(false, &rw), Poll::Ready(()), "readable shows");
        t.set(level(false, false));
        assert_eq!(t.poll(false, &rw), Poll::Pending);
        t.forget(false);
        t.set(level(true, false));
        assert_eq!(
            rc.0.load(Ordering::SeqCst),
            1,
            "a forgotten waker sleeps on"
        );
        t.set(level(false, false));
        assert_eq!(t.poll(false, &rw), Poll::Pending);
        assert_eq!(t.poll(true, &ww), Poll::Pending);
        t.set(Level {
            hup: true,
            ..Level::default()
        });
        assert_eq!(rc.0.load(Ordering::SeqCst), 2, "the end wakes the reader");
        assert_eq!(wc.0.load(Ordering::SeqCst), 2, "and the writer");
        t.set(level(false, false));
        assert_eq!(t.poll(false, &rw), Poll::Ready(()), "the end stays");
        assert_eq!(t.poll(true, &ww), Poll::Ready(()));
    }
}
