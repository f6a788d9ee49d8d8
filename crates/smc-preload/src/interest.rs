//! The application's epoll interest in SMC-R connections, kept where the
//! kernel need not see it.
//!
//! Event loops such as redis' and wrk's (`ae`) change a socket's interest
//! around every request: take it out of the set, put it back for
//! readable, then for writable (five `epoll_ctl` per request in
//! redis-benchmark, two in wrk). Over TCP each is a system call, and the
//! kernel must know them all, because only the kernel knows when the
//! socket is readable or writable. An SMC-R connection's state is in this
//! process: whether it can be written is known without asking. So a
//! level-triggered registration of a connection is recorded here as the
//! application asks for it (`Rdy::want`), and the kernel's registration of
//! the connection's readiness descriptor (`Rdy::kern`) only has to be
//! enough to wake the set's waiter:
//! * what the application waits for besides writable (`EPOLLIN`,
//!   `EPOLLPRI`, `EPOLLRDHUP`, with the peer signal beside it, `poll.rs`);
//! * writable only while the connection is not: while it is, the wait
//!   reports it from here (`before_wait`), after a wait of the kernel's
//!   that does not sleep, as an event of the kernel's would be reported;
//! * bits the application stopped waiting for are left registered (a
//!   system call saved per change) until they fire for nobody, and then
//!   taken off (`shown_mask`, from `poll::fix_events`), or until the
//!   application gives their data to another descriptor in the set
//!   (`quiet`); a registration the application deleted stays too, until it
//!   fires, the connection closes, or the application gives its data to
//!   another descriptor in the set.
//!
//! The same holds for readable where the connection's peer signal says it
//! (`poll::signal_ctl`): the kernel has the signal edge-triggered though the
//! application's registration is level-triggered (`poll::edge_here`), so
//! that the signal need not be drained whenever it is armed again (a
//! system call per message), and a connection the wait reported readable
//! that way is reported again by each wait while it stays readable (`ins`,
//! `mark_in`), as the kernel reports a level-triggered registration after
//! each event, until the set is direct (below), where the kernel gets the
//! signal level-triggered again (`materialize`).
//!
//! The kernel's registration is brought up to date by the next wait on the
//! set (`before_wait`), so the changes between two waits cost at most one
//! system call per connection, and none when they cancel out (redis'
//! five per request become none; wrk's two, none). What the application
//! sees stays what the kernel would show: the same results and errors of
//! `epoll_ctl` (`EEXIST`, `ENOENT` from the record), and from the next
//! `epoll_wait` the same events, computed from the connection's state as
//! `poll::fix_events` does for every event of a connection.
//!
//! Where the kernel itself must see the application's registration, it gets
//! it whole, as the application made it (a set is "direct"):
//! * edge-triggered, one-shot, exclusive and wake-up registrations, whose
//!   meaning is in the kernel's bookkeeping of edges and arms;
//! * while another thread waits on the set (`SetState::waiters`): it is
//!   asleep in the kernel, and a change must wake it as over TCP;
//! * for good, once the set is watched by something other than this
//!   library's `epoll_wait`: added to another epoll set, polled or
//!   selected, duplicated (the duplicate's number is another set here), or
//!   shared with a child by `fork()` (`expose`, `expose_all`);
//! * connections without a peer signal (the device cannot), and the first
//!   registration in a set (the kernel answers `EBADF`, `EINVAL` for a
//!   descriptor that is not an epoll set).

use super::*;

/// A connection's registration in one of the application's epoll sets.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rdy {
    pub(crate) epfd: c_int,
    /// What the application asked for (events and data), `None` after its
    /// `EPOLL_CTL_DEL`.
    pub(crate) want: Option<(u32, u64)>,
    /// What the readiness descriptor is registered with in the kernel.
    pub(crate) kern: Option<(u32, u64)>,
    /// In its set's `dirty` list: `kern` to be brought up to date before
    /// the next wait.
    dirty: bool,
    /// In its set's `outs` list: the application waits for writable.
    out: bool,
    /// In its set's `ins` list: reported readable through a peer signal
    /// that the kernel has edge-triggered (`mark_in`).
    inn: bool,
    /// A one-shot registration (`EPOLLONESHOT`) that reported its event
    /// since the application last armed it ([`fire_once`]).
    fired: bool,
}

/// An epoll set of the application's that has a connection registered.
#[derive(Default)]
struct SetState {
    /// Threads in `epoll_wait` on it now.
    waiters: u32,
    /// Watched by something other than our `epoll_wait`: every change goes
    /// to the kernel as made.
    direct: bool,
    /// Connections whose registration changed since the last wait.
    dirty: Vec<std::sync::Weak<Conn>>,
    /// Connections waited on for writable, level-triggered.
    outs: Vec<std::sync::Weak<Conn>>,
    /// Connections reported readable, level-triggered, through a peer
    /// signal registered edge-triggered (`mark_in`): reported again by each
    /// wait while they stay readable.
    ins: Vec<std::sync::Weak<Conn>>,
    /// Alternates which of the kernel's events and ours come first when
    /// there is room for one only.
    ours_first: bool,
}

static SETS: Mutex<BTreeMap<c_int, SetState>> = Mutex::new(BTreeMap::new());

/// Entries in [`SETS`] (a look without the lock).
static SETS_N: AtomicUsize = AtomicUsize::new(0);

const OUT: u32 = libc::EPOLLOUT as u32;
/// What a readiness registration can ask for.
pub(crate) const ASKABLE: u32 =
    (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLPRI | libc::EPOLLRDHUP) as u32;
/// What the kernel reports whether asked for or not.
const ALWAYS: u32 = (libc::EPOLLERR | libc::EPOLLHUP) as u32;
/// Registration flags whose meaning lives in the kernel's bookkeeping.
const KERNEL_FLAGS: u32 =
    (libc::EPOLLET | libc::EPOLLONESHOT | libc::EPOLLEXCLUSIVE | libc::EPOLLWAKEUP) as u32;

pub(crate) fn plain(events: u32) -> bool {
    events & KERNEL_FLAGS == 0
}

/// What the kernel must have registered for a plain registration asking for
/// `want` on a connection that is (`writable`) or is not writable now.
fn need(want: u32, writable: bool) -> u32 {
    want & ASKABLE & !OUT | if want & OUT != 0 && !writable { OUT } else { 0 }
}

/// The connection's events now, as `epoll` would report them
/// (`SmcStream::ready_events`: a look that leaves the peer signal as it
/// is, which `poll::fix_events` drains when it fired).
fn now(c: &Conn) -> u32 {
    c.s.ready_events().unwrap_or(0)
}

/// The mask of what an event of `c`'s may show: no `EPOLLERR` once its
/// error was reported (`Conn::err_taken`), as `poll::fix_events` shows it.
fn shown_err(c: &Conn) -> u32 {
    if c.err_taken.load(Ordering::Acquire) {
        !(libc::EPOLLERR as u32)
    } else {
        u32::MAX
    }
}

fn readiness(c: &Conn) -> Option<c_int> {
    c.s.readiness_fd().ok().map(|r| r.as_raw_fd())
}

/// The application's `epoll_ctl(epfd, op, fd, ev)` on connection `c`,
/// whose readiness descriptor is `r`, with the connection's peer signal
/// following (`poll::signal_ctl`), all under the connection's lock of its
/// registrations. Without that lock a stale operation could land after a
/// newer one of the application's (the connect thread moves a connect's
/// registrations while the application, woken by the first of them,
/// already changes them: a wake-up was lost).
///
/// # Safety
/// `ev` as `epoll_ctl` takes it.
pub(crate) unsafe fn conn_ctl(
    c: &Arc<Conn>,
    epfd: c_int,
    op: c_int,
    r: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: the caller's event, if the operation has one.
    let app = (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { *ev });
    let known = matches!(
        op,
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD | libc::EPOLL_CTL_DEL
    ) && (op == libc::EPOLL_CTL_DEL || app.is_some());
    // (before the locks: the library's own)
    let signalled = c.s.signal_fd().is_some();
    // (the connection's lock, then the sets': the sets' lock is taken last
    // everywhere and held over nothing of the library's, whose threads poll
    // through this library while they hold its own locks)
    let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
    let at = regs.rdy.iter().position(|x| x.epfd == epfd);
    if let (true, Some(k)) = (known, at) {
        // The application's view decides its errors, as the kernel's
        // would (the kernel's registration may be one left in place).
        let exists = regs.rdy[k].want.is_some();
        let err = match op {
            libc::EPOLL_CTL_ADD if exists => libc::EEXIST,
            libc::EPOLL_CTL_MOD | libc::EPOLL_CTL_DEL if !exists => libc::ENOENT,
            libc::EPOLL_CTL_MOD
                if app.is_some_and(|e| e.events & libc::EPOLLEXCLUSIVE as u32 != 0) =>
            {
                libc::EINVAL
            }
            _ => 0,
        };
        if err != 0 {
            set_errno(err);
            return -1;
        }
    }
    let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    let here = sets.get(&epfd).is_some_and(|s| !s.direct && s.waiters == 0);
    let virtual_ok = known
        && here
        && signalled
        && at.is_some_and(|k| {
            let x = &regs.rdy[k];
            x.kern.is_some_and(|(e, _)| plain(e)) && x.want.is_none_or(|(e, _)| plain(e))
        })
        && app.is_none_or(|e| plain(e.events));
    if let (true, Some(k), Some(st)) = (virtual_ok, at, sets.get_mut(&epfd)) {
        let x = &mut regs.rdy[k];
        x.want = app.map(|e| (e.events, e.u64));
        x.fired = false;
        if !x.dirty {
            x.dirty = true;
            st.dirty.push(Arc::downgrade(c));
        }
        if x.want.is_some_and(|(e, _)| e & OUT != 0) && !x.out {
            x.out = true;
            st.outs.push(Arc::downgrade(c));
        }
        drop(sets);
        crate::poll::signal_ctl(c, &mut regs, epfd, op, ev);
        return 0;
    }
    drop(sets);
    // Direct: the kernel gets the application's registration as made
    // (from the state ours is in: one left in place is deleted or changed).
    // (under the connection's lock: a wait does not bring this
    // registration up meanwhile)
    let kern = at.and_then(|k| regs.rdy[k].kern);
    let f = real!(epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int);
    let n = match (known, op, kern) {
        (true, libc::EPOLL_CTL_ADD, Some(_)) => {
            // (a registration left in place: replaced, so that the
            // kernel's own ADD decides what this one may be)
            ctl_own(epfd, libc::EPOLL_CTL_DEL, r, 0, 0);
            if let Some(k) = at {
                regs.rdy[k].kern = None;
            }
            // SAFETY: the caller's event.
            unsafe { f(epfd, libc::EPOLL_CTL_ADD, r, ev) }
        }
        // (taken out of the kernel's set already, see `quiet`)
        (true, libc::EPOLL_CTL_MOD, None) if at.is_some() => {
            // SAFETY: as below.
            unsafe { f(epfd, libc::EPOLL_CTL_ADD, r, ev) }
        }
        (true, libc::EPOLL_CTL_DEL, None) if at.is_some() => 0,
        // SAFETY: the caller's arguments, with the connection's readiness
        // descriptor (open while `c` is) for its descriptor.
        _ => unsafe { f(epfd, op, r, ev) },
    };
    if n != 0 {
        return n;
    }
    let now = app.map(|e| (e.events, e.u64));
    match at {
        Some(k) => {
            let x = &mut regs.rdy[k];
            x.want = now;
            x.kern = now;
            x.fired = false;
            if now.is_none() && !x.dirty && !x.out {
                regs.rdy.swap_remove(k);
            }
        }
        None if now.is_some() => {
            regs.rdy.push(Rdy {
                epfd,
                want: now,
                kern: now,
                dirty: false,
                out: false,
                inn: false,
                fired: false,
            });
            let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
            sets.entry(epfd).or_default();
            SETS_N.store(sets.len(), Ordering::Release);
        }
        None => {}
    }
    crate::poll::signal_ctl(c, &mut regs, epfd, op, ev);
    // A thread asleep in the set (why this went to the kernel) is woken by
    // the kernel's level, which cannot show bytes a signal edge-triggered
    // there announced already (`poll::edge_here`; a wait of ours shows
    // them, `before_wait`): the signal's registration there goes
    // level-triggered, as the application's is.
    if app.is_some_and(|e| e.events & libc::EPOLLIN as u32 != 0) && c.s.signal_taken() {
        crate::poll::signal_level_in(c, &mut regs.sig, epfd);
    }
    n
}

/// A wait on an epoll set, from [`before_wait`] until it returns.
pub(crate) struct Waiting {
    epfd: c_int,
    /// Events known here to be ready now (writable connections waited on
    /// for writable), in the application's terms.
    pub(crate) ours: Vec<libc::epoll_event>,
    /// Whether ours come before the kernel's when there is room for one.
    pub(crate) ours_first: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = sets.get_mut(&self.epfd) {
            st.waiters = st.waiters.saturating_sub(1);
        }
    }
}

/// Before a wait on `epfd`: the kernel's registrations brought up to date
/// with what the application asked for since the last wait, and the events
/// ready here. `None`: nothing of ours in the set.
pub(crate) fn before_wait(epfd: c_int) -> Option<Waiting> {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return None;
    }
    let (dirty, outs, ins, ours_first) = {
        let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
        let st = sets.get_mut(&epfd)?;
        // (from here on, a change another thread makes goes to the kernel
        // itself: this wait may be asleep there)
        st.waiters += 1;
        if st.direct {
            (Vec::new(), Vec::new(), Vec::new(), false)
        } else {
            if st.outs.len() > 1 {
                // (so that a wait with room for fewer events than are
                // ready reports the others next)
                st.outs.rotate_left(1);
            }
            st.ours_first = !st.ours_first;
            (
                std::mem::take(&mut st.dirty),
                st.outs.clone(),
                st.ins.clone(),
                st.ours_first,
            )
        }
    };
    let mut w = Waiting {
        epfd,
        ours: Vec::new(),
        ours_first,
    };
    // (without the sets' lock: the connections' state is the library's,
    // whose threads poll through this library too)
    for c in dirty {
        let Some(c) = c.upgrade() else { continue };
        let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(x) = regs.rdy.iter_mut().find(|x| x.epfd == epfd) else {
            continue;
        };
        x.dirty = false;
        let Some((want, data)) = x.want else {
            // (deleted: left registered until it fires, see shown_mask)
            continue;
        };
        // (one waited on for writable is looked at below, in `outs`, which
        // registers it for writable if it is not: not looked at twice)
        let writable = want & OUT != 0 && (x.out || now(&c) & OUT != 0);
        bring_up(&c, x, need(want, writable), data);
    }
    let mut gone = Vec::new();
    for (i, c) in outs.iter().enumerate() {
        let Some(c) = c.upgrade() else {
            gone.push(i);
            continue;
        };
        let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(x) = regs.rdy.iter_mut().find(|x| x.epfd == epfd) else {
            gone.push(i);
            continue;
        };
        let Some((want, data)) = x.want.filter(|(e, _)| e & OUT != 0 && plain(*e)) else {
            x.out = false;
            gone.push(i);
            continue;
        };
        let n = now(&c) & shown_err(&c);
        if n & OUT != 0 {
            w.ours.push(libc::epoll_event {
                events: n & (want & ASKABLE | ALWAYS),
                u64: data,
            });
        } else {
            // not writable (a write of another thread's since the look
            // above): the kernel wakes the wait when it is
            bring_up(&c, x, need(want, false), data);
        }
    }
    let mut gone_in = Vec::new();
    for (i, c) in ins.iter().enumerate() {
        let Some(c) = c.upgrade() else {
            gone_in.push(i);
            continue;
        };
        let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
        // (still registered edge-triggered here, otherwise the kernel keeps
        // the level; and its signal taken: one armed again since, by the
        // read that emptied the connection as a rule, leaves what comes
        // after to the readiness descriptor and the signal's next edge)
        let edge =
            regs.sig.iter().any(|&(ep, _, _, here)| ep == epfd && here) && c.s.signal_taken();
        let Some(x) = regs.rdy.iter_mut().find(|x| x.epfd == epfd) else {
            gone_in.push(i);
            continue;
        };
        // What it has now, a CDC that came taken; one whose signal is spent
        // (its bytes read by a call that did not arm it again) is armed
        // again here, as the kernel's level-triggered registration had it
        // drained and armed by the wait that it woke for nothing.
        let n = if edge {
            c.s.signalled_events().unwrap_or(0) & shown_err(&c)
        } else {
            0
        };
        if n & libc::EPOLLIN as u32 == 0 {
            x.inn = false;
            gone_in.push(i);
            continue;
        }
        // (readable and not asked for, the application's interest out of
        // the set for now: kept, to show when it is back)
        if let Some((e, data)) = x
            .want
            .filter(|(e, _)| e & libc::EPOLLIN as u32 != 0 && plain(*e))
        {
            let ev = n & (e & ASKABLE | ALWAYS);
            match w.ours.iter_mut().find(|o| o.u64 == data) {
                Some(o) => o.events |= ev,
                None => w.ours.push(libc::epoll_event {
                    events: ev,
                    u64: data,
                }),
            }
        }
    }
    if !gone.is_empty() || !gone_in.is_empty() {
        let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = sets.get_mut(&epfd) {
            st.outs
                .retain(|c| !gone.iter().any(|&i| std::sync::Weak::ptr_eq(c, &outs[i])));
            st.ins
                .retain(|c| !gone_in.iter().any(|&i| std::sync::Weak::ptr_eq(c, &ins[i])));
        }
    }
    Some(w)
}

/// Whether `epfd` is a set of ours whose waits are all this library's (not
/// direct): what a wait reports can come from here (`before_wait`).
pub(crate) fn virtual_set(epfd: c_int) -> bool {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return false;
    }
    let sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    sets.get(&epfd).is_some_and(|s| !s.direct)
}

/// A wait on `epfd` reports connection `c` readable (`regs` its records,
/// locked), and the kernel has its peer signal there edge-triggered though
/// the application's registration is level-triggered (`poll::edge_here`):
/// the signal will not report the bytes left after the application's read
/// again, so the connection is to go in the set's `ins` ([`note_ins`]),
/// which each wait looks at until it is no longer readable
/// (`before_wait`), as the kernel looks at a level-triggered registration
/// after each event it reported. `None`: not such a connection, or listed
/// already.
pub(crate) fn mark_in(
    c: &Arc<Conn>,
    regs: &mut Regs,
    epfd: c_int,
) -> Option<std::sync::Weak<Conn>> {
    // (a signal armed again since, or never taken: the readiness
    // descriptor shows what there is, the kernel's level)
    if !c.s.signal_taken() || !regs.sig.iter().any(|&(ep, _, _, here)| ep == epfd && here) {
        return None;
    }
    let x = regs.rdy.iter_mut().find(|x| x.epfd == epfd && !x.inn)?;
    x.inn = true;
    Some(Arc::downgrade(c))
}

/// The connections a wait on `epfd` marked ([`mark_in`]) go in its `ins`
/// (one lock of the sets for a wait's events). A set that became direct
/// meanwhile has none (`materialize` unmarked them).
pub(crate) fn note_ins(epfd: c_int, ins: Vec<std::sync::Weak<Conn>>) {
    if ins.is_empty() {
        return;
    }
    let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(st) = sets.get_mut(&epfd).filter(|s| !s.direct) {
        st.ins.extend(ins);
    }
}

/// What the application asks for (its events) in set `epfd` under `data`,
/// by a connection's records `rdy`: nothing if it deleted its registration
/// there or gave it other data.
pub(crate) fn asked(rdy: &[Rdy], epfd: c_int, data: u64) -> u32 {
    match rdy.iter().find(|x| x.epfd == epfd).and_then(|x| x.want) {
        Some((e, d)) if d == data => e,
        _ => 0,
    }
}

/// An event of connection `c` under `data` in set `epfd` is about to be
/// reported: if the application's registration there is one-shot, whether
/// this is its one event since the application armed it (`ADD` or `MOD`).
/// The kernel disarms a one-shot registration when it reports it, but the
/// application's is two of the kernel's here, the readiness descriptor and
/// the peer signal, and the one that did not fire would report the next
/// change as a second event (a thread pool that waits on one set, each
/// connection one-shot so that one thread at a time serves it, would have
/// two threads read the connection at once). So the first event takes
/// both out (the readiness descriptor leaves the set, to come back with
/// the application's next `MOD`, as one `quiet` took out; the signal asks
/// for nothing), and an event that another thread's wait took from the
/// kernel meanwhile is dropped. `None`: not a one-shot registration.
/// (`regs`: the connection's records, locked by the caller.)
pub(crate) fn fire_once(c: &Conn, regs: &mut Regs, epfd: c_int, data: u64) -> Option<bool> {
    let x = regs.rdy.iter_mut().find(|x| x.epfd == epfd)?;
    let (e, d) = x.want?;
    if e & libc::EPOLLONESHOT as u32 == 0 || d != data {
        return None;
    }
    if x.fired {
        return Some(false);
    }
    x.fired = true;
    if x.kern.is_some() {
        if let Some(r) = readiness(c) {
            if ctl_own(epfd, libc::EPOLL_CTL_DEL, r, 0, 0) == 0 {
                x.kern = None;
            }
        }
    }
    crate::poll::turn_off(c, &mut regs.sig, epfd, Some(data));
    Some(true)
}

/// Registers the readiness descriptor of `c` in `x`'s set with at least
/// `need` under `data`, unless it is.
fn bring_up(c: &Conn, x: &mut Rdy, need: u32, data: u64) {
    if x.kern
        .is_some_and(|(e, d)| d == data && e & need == need && plain(e))
    {
        return;
    }
    let Some(r) = readiness(c) else { return };
    let op = if x.kern.is_some() {
        libc::EPOLL_CTL_MOD
    } else {
        libc::EPOLL_CTL_ADD
    };
    if ctl_own(x.epfd, op, r, need, data) == 0 {
        x.kern = Some((need, data));
    }
}

/// What an event the kernel reported under `data` for `c` in `epfd` may
/// show: the application's registration's events (with `EPOLLERR` and
/// `EPOLLHUP`), nothing if it has none there (deleted, or under other
/// data). Bits `orig` has outside that which the connection shows `now`
/// and the kernel's registration asks for are taken off it (or it goes, if
/// the application has none): they were left in place and, level-
/// triggered, would fire for nobody at every wait. (A bit the connection
/// does not show was the peer signal's, spent: `poll::fix_events`.)
pub(crate) fn shown_mask(c: &Conn, epfd: c_int, data: u64, orig: u32, now: u32) -> Option<u32> {
    let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
    let x = regs.rdy.iter_mut().find(|x| x.epfd == epfd)?;
    let mask = match x.want {
        Some((e, d)) if d == data => e & ASKABLE | ALWAYS,
        _ => 0,
    };
    let extra = orig & !mask & now;
    if let Some((k, kd)) = x.kern {
        if extra != 0 && (kd != data || k & extra != 0 || mask == 0) && plain(k) {
            if let Some(r) = readiness(c) {
                match x.want {
                    Some((e, d)) if d == data => {
                        let writable = e & OUT != 0 && now & OUT != 0;
                        let n = need(e, writable);
                        if ctl_own(epfd, libc::EPOLL_CTL_MOD, r, n, d) == 0 {
                            x.kern = Some((n, d));
                        }
                    }
                    _ => {
                        if ctl_own(epfd, libc::EPOLL_CTL_DEL, r, 0, 0) == 0 {
                            x.kern = None;
                        }
                    }
                }
            }
        }
    }
    Some(mask)
}

/// The application gives `data` in `epfd` to another descriptor: a
/// registration of `c`'s readiness descriptor left in place there under
/// that data goes first (deleted or moved to other data by the
/// application), or is cut down to no events (still there under that data,
/// asking for none: an `EPOLL_CTL_MOD` without events), so that it never
/// reports under the other's data.
pub(crate) fn quiet(c: &Conn, rdy: &mut [Rdy], epfd: c_int, data: u64) {
    let Some(x) = rdy.iter_mut().find(|x| x.epfd == epfd) else {
        return;
    };
    let Some((k, _)) = x.kern.filter(|&(_, d)| d == data) else {
        return;
    };
    let events = match x.want {
        // (an application's own registration under other data is changed
        // virtually, so it waits for the next wait, which adds it again)
        Some((_, d)) if d != data => None,
        None => None,
        // Left in the set under the data with no events: the bits the
        // application stopped asking for stay registered until they fire
        // for nobody (`shown_mask`), but an event under the data is the
        // other's now (`poll::fix_events` finds its connection by set and
        // data), so this one's readable (its end of file, say) showed as
        // the other's, and was never taken off. Registered as the
        // application's own is, with no events (the kernel reports
        // `EPOLLERR` and `EPOLLHUP` still, as it does for its socket).
        Some((e, _)) if e & ASKABLE == 0 && k & ASKABLE != 0 && plain(k) => Some(0),
        Some(_) => return,
    };
    if let Some(r) = readiness(c) {
        match events {
            None => {
                if ctl_own(epfd, libc::EPOLL_CTL_DEL, r, 0, 0) == 0 {
                    x.kern = None;
                }
            }
            Some(e) => {
                if ctl_own(epfd, libc::EPOLL_CTL_MOD, r, e, data) == 0 {
                    x.kern = Some((e, data));
                }
            }
        }
    }
}

/// Connection `c` is going: registrations the application deleted and that
/// were left in place leave the kernel's sets now (the readiness
/// descriptor may be open in a child too, which would keep them).
pub(crate) fn forget(c: &Conn, rdy: &[Rdy]) {
    let Some(r) = readiness(c) else { return };
    for x in rdy {
        if x.kern.is_some() && x.want.is_none() {
            ctl_own(x.epfd, libc::EPOLL_CTL_DEL, r, 0, 0);
        }
    }
}

/// Descriptor `fd` is about to be closed: if it is a set of ours, its
/// records go (the kernel drops the registrations with it).
pub(crate) fn set_closing(fd: c_int) -> bool {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return false;
    }
    let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    let had = sets.remove(&fd).is_some();
    SETS_N.store(sets.len(), Ordering::Release);
    had
}

/// Set `fd` is watched by something other than our `epoll_wait` (see the
/// module's comment): every registration in it goes to the kernel as the
/// application made it, now and from now on.
pub(crate) fn expose(fd: c_int) {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    match sets.get_mut(&fd) {
        Some(st) if !st.direct => {
            st.direct = true;
            st.dirty.clear();
            st.outs.clear();
            st.ins.clear();
        }
        _ => return,
    }
    drop(sets);
    materialize(&[fd]);
}

/// Before `fork()`: the child shares every set with this process, and
/// waits on it where this process's records are not seen.
pub(crate) fn expose_all() {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
    let mut fds = Vec::new();
    for (fd, st) in sets.iter_mut() {
        if !st.direct {
            st.direct = true;
            st.dirty.clear();
            st.outs.clear();
            st.ins.clear();
            fds.push(*fd);
        }
    }
    drop(sets);
    if !fds.is_empty() {
        materialize(&fds);
    }
}

/// Every connection's registration in `fds` (sets made direct) as the
/// application made it. (Without the sets' lock, as `before_wait`: a wait
/// on a direct set brings nothing up, and changes go to the kernel.)
fn materialize(fds: &[c_int]) {
    // (rare: once per set; a scan of the table then)
    for c in streams() {
        let mut regs = c.regs.lock().unwrap_or_else(|e| e.into_inner());
        // The peer signal's registrations that the kernel had
        // edge-triggered for a level-triggered one of the application's
        // (`poll::edge_here`): level-triggered now, as asked.
        for &fd in fds {
            crate::poll::signal_level_in(&c, &mut regs.sig, fd);
        }
        let r = readiness(&c);
        regs.rdy.retain_mut(|x| {
            if !fds.contains(&x.epfd) {
                return true;
            }
            x.dirty = false;
            x.out = false;
            x.inn = false;
            if x.kern == x.want {
                return x.want.is_some();
            }
            let Some(r) = r else { return true };
            let n = match (x.want, x.kern) {
                (None, _) => ctl_own(x.epfd, libc::EPOLL_CTL_DEL, r, 0, 0),
                (Some((e, d)), Some(_)) => ctl_own(x.epfd, libc::EPOLL_CTL_MOD, r, e, d),
                (Some((e, d)), None) => ctl_own(x.epfd, libc::EPOLL_CTL_ADD, r, e, d),
            };
            if n == 0 {
                x.kern = x.want;
            }
            x.want.is_some() || x.kern.is_some()
        });
    }
}

/// Descriptors about to be polled or selected: those that are sets of
/// ours are exposed ([`expose`]).
pub(crate) fn expose_polled(fds: impl Iterator<Item = c_int>) {
    if SETS_N.load(Ordering::Acquire) == 0 {
        return;
    }
    let found: Vec<c_int> = {
        let sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
        fds.filter(|fd| sets.get(fd).is_some_and(|s| !s.direct))
            .collect()
    };
    for fd in found {
        expose(fd);
    }
}
