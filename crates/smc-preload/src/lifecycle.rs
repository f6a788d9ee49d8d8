//! Library load (`init`), `fork()` handlers, `exit()`, and listening sockets
//! inherited across exec from an image that had opted them in.

use super::*;

thread_local! {
    /// The table's lock, held by the thread that forks across `fork()`, so
    /// that the child does not inherit it held by a thread it has not.
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::RwLockWriteGuard<'static, crate::table::FdMap>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    // (counted first, so that parent and child both see the new count;
    // connections accepted before it are left to their first use, `late.rs`)
    FORKS.fetch_add(1, Ordering::AcqRel);
    crate::late::before_fork();
    crate::rescue::before_fork();
    // (the child's parent, read in the child: its `getppid` may already be
    // another's, the parent having exited at once)
    FORKER.store(std::process::id(), Ordering::Release);
    // (the child shares the epoll sets: what they have goes to the kernel)
    crate::interest::expose_all();
    crate::poll::signals_forked();
    // (first: it reads the table and makes descriptors)
    crate::share::prepare();
    let g = TABLE.write().unwrap_or_else(|e| e.into_inner());
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

extern "C" fn in_parent() {
    crate::rescue::after_fork();
    crate::late::after_fork();
    FORK_GUARD.with(|f| drop(f.borrow_mut().take()));
    crate::share::serve();
}

/// In a forked child. The parent's connections live in the parent: its
/// endpoint state, the threads that serve it (progress, listener drivers),
/// its queue pairs; a child has a frozen copy of the memory and none of the
/// threads (see `smc::after_fork_in_child`, which starts the child's own
/// library state). So the child's table keeps what has no state of the
/// library's yet and gives up the rest, without dropping anything (a drop
/// would send the SMC close of the parent's connection, or wait for one of
/// its threads):
/// * each SMC-R connection is served by the parent for the child
///   (`share.rs`): its descriptor keeps working in both, as a TCP socket's
///   does; one the parent could not prepare (no descriptor left for the
///   channel, or made while the fork began), and one the parent itself had
///   from its own parent, gets a fresh unconnected TCP socket on its
///   descriptor, as before an exec (`exec.rs`): reads fail with `ENOTCONN`,
///   writes with `EPIPE`, poll shows `POLLHUP` — a connection that is gone,
///   never a hang;
/// * a connect in progress (a thread of the parent's runs it) gets the
///   stand-in too;
/// * a connection whose handshake waits for its first use stays usable:
///   whichever process uses it first takes it (`Entry::Lazy`), unless a
///   thread of the parent was running its handshake at the fork;
/// * a listening socket whose listener runs (a thread of the parent's)
///   starts a listener of the child's at its first use, as one inherited
///   unused does (nginx's workers);
/// * the child's own new sockets are SMC-capable, with endpoints, links
///   and a system ID of its own.
///
/// Runs in the child of a possibly multi-threaded parent: system calls
/// (socket, fcntl, dup2, close) and the table's entries taken out in place;
/// the allocator calls are the table's and the shared connections' (the C
/// library's allocator is usable in a forked child).
extern "C" fn in_child() {
    BIRTH_PPID.store(FORKER.load(Ordering::Acquire), Ordering::Release);
    BIRTH_FORKS.store(forks(), Ordering::Release);
    crate::rescue::after_fork();
    crate::late::after_fork();
    smc::after_fork_in_child();
    crate::share::forget_served_in_child();
    let shared = crate::share::adopt_in_child();
    FORK_GUARD.with(|f| {
        if let Some(t) = f.borrow_mut().as_mut() {
            // (not only after USED: a parent thread may be running a
            // lazy connection's first handshake, see Entry::Lazy)
            forget_the_parents(t, shared);
        }
        drop(f.borrow_mut().take());
    });
    USED.store(false, Ordering::Release);
}

/// See [`in_child`].
fn forget_the_parents(
    t: &mut crate::table::FdMap,
    mut shared: Option<BTreeMap<RawFd, crate::share::Remote>>,
) {
    // (one Arc per connection: its duplicates share it, as in the parent)
    let mut by_conn: Vec<(*const Conn, Arc<crate::share::Remote>)> = Vec::new();
    let mut old_chans: Vec<RawFd> = Vec::new();
    for (fd, e) in t.iter_mut() {
        let keep = match e {
            Entry::Stream(c) => {
                let ptr = Arc::as_ptr(c);
                let known = by_conn
                    .iter()
                    .find(|(p, _)| *p == ptr)
                    .map(|(_, r)| r.clone());
                match known.or_else(|| {
                    let r = Arc::new(shared.as_mut()?.remove(&fd)?);
                    by_conn.push((ptr, r.clone()));
                    Some(r)
                }) {
                    Some(r) => Entry::Remote(r),
                    None => {
                        exec::stand_in(fd);
                        Entry::Failed(0)
                    }
                }
            }
            Entry::Remote(r) => {
                // (a connection of the parent's parent: its channel is the
                // parent's, not this child's)
                let ch = crate::share::channel_of(r);
                if !old_chans.contains(&ch) {
                    old_chans.push(ch);
                }
                exec::stand_in(fd);
                Entry::Failed(0)
            }
            Entry::Connecting(_) => {
                exec::stand_in(fd);
                Entry::Failed(0)
            }
            // (the listener's asks: atomics, read as the parent left them)
            Entry::Listener(l) => Entry::Passive(l.l.buffer_sizes()),
            // The parent's rescue of its queue (its thread, its tokens): the
            // parent's.
            Entry::LazyListener(b, Some(_)) => Entry::LazyListener(*b, None),
            // A connection whose handshake a thread of the parent was
            // running at the fork (that thread holds the lock, which stays
            // held in the child): the parent's.
            Entry::Lazy(l) if l.pending.try_lock().is_err() => {
                exec::stand_in(fd);
                Entry::Failed(0)
            }
            _ => continue,
        };
        std::mem::forget(std::mem::replace(e, keep));
    }
    for ch in old_chans {
        // SAFETY: the inherited channel of a connection given up above
        // (its entries are forgotten, never dropped: nothing else closes it).
        unsafe { rustix::io::close(ch) };
    }
    // (prepared for descriptors the table no longer had: not this child's)
    std::mem::forget(shared);
    t.retain(|_, e| !matches!(e, Entry::Failed(0)));
    COUNT.store(t.len(), Ordering::Release);
}

/// `vfork()` is done as `fork()`. A vforked child runs in its parent's
/// memory, with a descriptor table of its own, until it execs or exits, and
/// no `pthread_atfork` handler runs for it: every call of the library's it
/// makes there would change the parent's state to match the child's
/// descriptors — a `close` of its copy of a connection takes the connection
/// out of the parent's table (the parent's next read then waits on the bare
/// TCP socket for ever), a `dup2` puts one on a descriptor number the parent
/// uses for something else, the exec's bookkeeping leaves its allocations and
/// closes the library's descriptors in the child only. POSIX lets `vfork` be
/// `fork` (the child may only exec or `_exit`, so it cannot tell; Valgrind
/// does the same), and `fork` gives the child its own table (`in_child`). The
/// price: the page tables are copied, and the parent goes on without
/// waiting for the child's exec.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    // SAFETY: fork has no preconditions; its handlers make the child's
    // library state its own.
    unsafe { libc::fork() }
}

/// glibc's other name of `vfork` (exported too).
#[no_mangle]
pub unsafe extern "C" fn __vfork() -> libc::pid_t {
    // SAFETY: as above.
    unsafe { libc::fork() }
}

/// At `exit()`: every connection still open is closed as `close()` would,
/// so that its unsent data and its SMC close leave before the process is
/// gone. (A kernel socket's data outlives its process, a user-space
/// connection's does not; a program that exits without closing its
/// sockets, as socat does, would otherwise leave the peer with missing data
/// and an aborted connection. `_exit()` and fatal signals skip this.)
extern "C" fn at_exit() {
    // (the closes below wait for unsent data while the peers take it: the
    // data leaves with this process, see `smc::exiting`)
    smc::exiting();
    // (a lock held by another thread now is left alone)
    let all = match TABLE.try_write() {
        Ok(mut t) => {
            COUNT.store(0, Ordering::Release);
            std::mem::take(&mut *t)
        }
        Err(_) => Default::default(),
    };
    drop(all);
    // (and those a forked child shares: they end with this process)
    crate::share::release_all();
}

/// The `SMC_*` environment at load time (the device configuration, the
/// state file, debugging).
pub(crate) static SMC_ENV: OnceLock<Vec<(std::ffi::OsString, std::ffi::OsString)>> =
    OnceLock::new();

/// Puts back the `SMC_*` variables a program removed from its environment
/// since the library was loaded (nginx clears its workers' environment but
/// for `env` directives; the library reads it at its first connection).
pub(crate) fn restore_env() {
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
    // `smc_run -r/-t`: the sizes of the SMC buffers, as they are of an
    // AF_SMC socket's RMB and send buffer in Linux (the TCP socket gets
    // them too, at `socket()`)
    let size = |v| crate::report::env_size(v).and_then(|n| usize::try_from(n).ok());
    let (rcv, snd) = (size("SMC_RCVBUF"), size("SMC_SNDBUF"));
    if rcv.is_some() || snd.is_some() {
        smc::set_buffer_sizes(rcv, snd);
    }
    adopt_inherited_listeners();
    // SAFETY: registers handlers that take and release the table's lock
    // around the fork; the child's also gives up the parent's entries with
    // system calls only and frees table nodes (see `in_child` for why that
    // is safe in the child of a multi-threaded process).
    unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
    // SAFETY: registers a plain function to run at exit.
    unsafe { libc::atexit(at_exit) };
}

/// Listening TCP sockets this image inherited across exec (file ids), not
/// looked at yet (see [`adopt_inherited_listeners`]).
pub(crate) static INHERITED: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// A listening TCP socket inherited across exec (nginx's binary upgrade,
/// an exec of the process itself) may be opted in to the SMC option by the
/// image before: the kernel then offers SMC in its SYN-ACKs, and a plain
/// `accept()` would hand the program connections whose peer speaks CLC
/// first. So each one starts as a listening socket of the library's
/// (`Entry::Passive`); at its first use, one that is not opted in (socket
/// activation, a program without the library before) goes back to the
/// kernel.
pub(crate) fn adopt_inherited_listeners() {
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
            drop(insert(fd, Entry::Passive((None, None))));
        }
    }
}

/// Whether `fd` is an inherited listening socket not looked at yet (it is
/// looked at now).
pub(crate) fn was_inherited(fd: RawFd) -> bool {
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
pub(crate) static INIT: extern "C" fn() = init;

/// The program's soft descriptor limit before the library raised it, and
/// what the library raised it to (see [`room_for_smc`]).
static RAISED: Mutex<Option<(u64, u64)>> = Mutex::new(None);

/// An SMC-R connection holds three descriptors where a TCP connection holds
/// one (its socket; the library's handle of it, `dup_own`; its peer
/// signal's eventfd), so a program at its descriptor limit would hold a
/// third of the connections it holds over TCP, and find `accept` failing
/// with `EMFILE` where over TCP it does not. So at the program's first
/// socket that may become SMC-R, its soft `RLIMIT_NOFILE` is raised to three
/// times what it was, within its hard limit (as servers raise their own:
/// redis for its clients, nginx by `worker_rlimit_nofile`). The library's
/// descriptors are placed above the program's (`dup_own`), so the program's
/// own numbers stay where they were. An exec puts the limit back
/// ([`limit_for_exec`]). At a hard limit there is no room to make: a program
/// there holds fewer connections than over TCP, each one it accepts served
/// (over TCP when the library has no descriptor for it, `listen.rs`).
pub(crate) fn room_for_smc() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let l = getrlimit(Resource::Nofile);
        let (Some(soft), hard) = (l.current, l.maximum) else {
            return;
        };
        let want = soft.saturating_mul(3);
        let to = hard.map_or(want, |h| want.min(h));
        if to <= soft {
            return;
        }
        let new = Rlimit {
            current: Some(to),
            maximum: hard,
        };
        if setrlimit(Resource::Nofile, new).is_ok() {
            *RAISED.lock().unwrap_or_else(|e| e.into_inner()) = Some((soft, to));
        }
    });
}

/// Before an exec: the soft descriptor limit the program had, unless it
/// changed the limit since the library raised it; the limit the exec's
/// failure puts back (`None`: nothing changed).
pub(crate) fn limit_for_exec() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let (was, raised) = (*RAISED.lock().unwrap_or_else(|e| e.into_inner()))?;
    let l = getrlimit(Resource::Nofile);
    if l.current != Some(raised) {
        return None;
    }
    let back = Rlimit {
        current: Some(was),
        maximum: l.maximum,
    };
    setrlimit(Resource::Nofile, back).ok().map(|()| raised)
}

/// After a failed exec: the raised limit again (`limit_for_exec`'s).
pub(crate) fn limit_after_failed_exec(raised: Option<u64>) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let Some(raised) = raised else { return };
    let l = getrlimit(Resource::Nofile);
    let again = Rlimit {
        current: Some(raised),
        maximum: l.maximum,
    };
    let _ = setrlimit(Resource::Nofile, again);
}

/// `fork()`s of this process and its forked ancestors so far (counted
/// before each).
static FORKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The fork count: a value kept at an event (a `listen()`, an accept) and
/// compared later tells whether a fork came since.
pub(crate) fn forks() -> u64 {
    FORKS.load(Ordering::Acquire)
}

/// The process that forks, set before the fork (see `before_fork`).
static FORKER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// In a forked process: its parent's pid at the fork (0: not forked).
static BIRTH_PPID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// In a forked process: the fork count at its fork ([`forks`]).
static BIRTH_FORKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// This process's parent at its fork and the fork count then; `(0, 0)` if
/// it was not forked (under the library).
pub(crate) fn birth() -> (u32, u64) {
    (
        BIRTH_PPID.load(Ordering::Acquire),
        BIRTH_FORKS.load(Ordering::Acquire),
    )
}
