//! The exec family: the library's connections and listening sockets across
//! `execve` and its kin, and `posix_spawn`.

use super::*;
use image::Target;
use std::ffi::CStr;
use std::os::fd::AsFd;

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
// descriptors are put back as they were. This holds whether or not the new
// image loads the library (the stand-in is a kernel socket).
//
// What becomes of the connection itself: after `fork()` + exec in the
// child (inetd, CGI), the parent still has it and keeps using it; after an
// exec of the process itself, its image is gone, and the peer sees the
// connection end as when a process exits.
//
// A listening socket opted in to SMC answers SYNs that offer SMC with the
// option (the rendezvous program's doing, in the kernel), and its clients
// then send a CLC Proposal first. A new image that loads the library takes
// the listener up (`adopt_inherited_listeners`); one that does not (a
// static program, `LD_PRELOAD` gone from its environment, a set-ID program:
// `image::loads_library`) would read the Proposal as data. So before such an
// exec every listening socket that survives it is opted out
// (`smc::opt_out_listener`): new SYNs get plain TCP, and its clients fall
// back. The listening socket is one socket for every process that holds
// it: a forked parent that goes on accepting on it gets TCP from then on
// too (a fallback, correct but slower). Connections whose SYN-ACK left
// before (the accept queue at the exec) were offered SMC; the library
// cannot take them out of the queue without taking them from the program,
// so a new program that accepts one reads its client's Proposal (a limit,
// see the README). A failed exec opts the listeners in again.
//
// Covered: `execve`, `execv`, `execvp`, `execvpe`, `fexecve`, `execveat`,
// `execl`, `execlp`, `execle` (glibc's call `__execve` inside, which no
// preload can replace, so they are replaced whole: `variadic`), and
// `posix_spawn`, `posix_spawnp` (whose child runs glibc's own exec: the
// stand-ins are put in the parent for the spawn's duration, see
// `around_spawn`), `system` and `popen` (whose shell glibc starts with its
// internal spawn, see below). `vfork` is `fork` (lifecycle.rs).

/// Identity of an open file (device, inode): the same socket under any
/// descriptor number.
pub(crate) fn file_id(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    let st = rustix::fs::fstat(fd).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// Before an exec: the connections' descriptors that would survive it get a
/// stand-in (see above); returns the originals (close-on-exec duplicates)
/// to put back should the exec fail.
pub(crate) fn detach_for_exec() -> Vec<(RawFd, OwnedFd)> {
    decline_lazy_for_exec();
    detach_connections(false)
}

/// [`detach_for_exec`] but for the connections whose handshake waits;
/// `all`: the close-on-exec descriptors too (a spawn's file actions may
/// `dup2` one onto a descriptor the child keeps).
fn detach_connections(all: bool) -> Vec<(RawFd, OwnedFd)> {
    // (a forked child has connections its parent serves, and USED unset)
    if COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let ids: Vec<(u64, u64)> = {
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        t.iter()
            .filter_map(|(fd, e)| match e {
                Entry::Stream(c) => file_id(c.s.tcp_fd()),
                Entry::Remote(r) => file_id(borrow(r.tcp)),
                // (its own duplicate is the connect thread's)
                Entry::Connecting(_) => file_id(borrow(fd)),
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
        if !(all || survives) || !file_id(borrow(fd)).is_some_and(|id| ids.contains(&id)) {
            continue;
        }
        let Ok(orig) = dup_own(fd) else { continue };
        // (kept even if the stand-in failed, putting it back is harmless:
        // no descriptor of the library's is closed here, see `around_spawn`)
        stand_in(fd);
        saved.push((fd, orig));
    }
    saved
}

/// Before an exec: an accepted connection whose handshake was left for its
/// first use (`Entry::Lazy`) and whose descriptor survives the exec is
/// declined (the client falls back to TCP), so the new image finds a plain
/// TCP connection on it — what inetd and CGI-style servers hand their
/// programs — with nothing of the CLC left to read. (One another process
/// took first is that process's: a stand-in, as above.) Not undone if the
/// exec fails: the connection is TCP then, and works as such.
fn decline_lazy_for_exec() {
    if COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let lazy: Vec<(RawFd, Arc<Lazy>)> = TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(fd, e)| match e {
            Entry::Lazy(l) => Some((fd, l.clone())),
            _ => None,
        })
        .collect();
    for (fd, l) in lazy {
        let survives = rustix::io::fcntl_getfd(borrow(fd))
            .is_ok_and(|f| !f.contains(rustix::io::FdFlags::CLOEXEC));
        if !survives {
            continue;
        }
        let pending = l.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = pending {
            match p.decline() {
                // (dropping the library's duplicate; `fd` goes on as TCP)
                Ok(tcp) => drop(tcp),
                Err(e) if e.kind() == io::ErrorKind::NotConnected => {
                    stand_in(fd);
                }
                Err(_) => {
                    let _ = rustix::net::shutdown(borrow(fd), rustix::net::Shutdown::Both);
                }
            }
            let _ = l.done.set(None);
        }
        // (one whose handshake another descriptor ran to SMC-R stays: it
        // gets its stand-in below, and back if the exec fails)
        if l.done.get().is_some_and(Option::is_none) {
            drop(remove(fd));
        }
    }
}

/// Puts a fresh unconnected TCP socket of `fd`'s family, with its file
/// status flags and `fd`'s close-on-exec flag, on descriptor `fd` (see
/// above); whether it did. System
/// calls only (rustix's; none comes back here), so a forked child's
/// `pthread_atfork` handler may call it too.
pub(crate) fn stand_in(fd: RawFd) -> bool {
    use rustix::net::{AddressFamily, SocketType};
    let v6 = rustix::net::getsockname(borrow(fd))
        .is_ok_and(|a| a.address_family() == AddressFamily::INET6);
    let family = if v6 {
        AddressFamily::INET6
    } else {
        AddressFamily::INET
    };
    let Ok(s) = rustix::net::socket(family, SocketType::STREAM, None) else {
        return false;
    };
    if let Ok(fl) = rustix::fs::fcntl_getfl(borrow(fd)) {
        let _ = rustix::fs::fcntl_setfl(&s, fl);
    }
    let done = put_on(&s, fd);
    // (not `drop(s)`: std closes through the C library's `close`, which is
    // ours and takes the table's lock, held here in a forked child)
    let s = std::os::fd::IntoRawFd::into_raw_fd(s);
    // SAFETY: `s` was just made here and is owned by nothing else; it is
    // closed once, by a system call.
    unsafe { rustix::io::close(s) };
    done
}

/// `from` duplicated onto `fd`, which keeps its close-on-exec flag (`dup2`
/// would clear it); whether it did.
pub(crate) fn put_on(from: impl AsFd, fd: RawFd) -> bool {
    let cloexec =
        rustix::io::fcntl_getfd(borrow(fd)).is_ok_and(|f| f.contains(rustix::io::FdFlags::CLOEXEC));
    let mut target = borrow_owned(fd);
    let done = if cloexec {
        rustix::io::dup3(from, &mut target, rustix::io::DupFlags::CLOEXEC).is_ok()
    } else {
        rustix::io::dup2(from, &mut target).is_ok()
    };
    std::mem::forget(target);
    done
}

/// `fd` as an `OwnedFd` for `dup2`'s target (forgotten after, never closed).
pub(crate) fn borrow_owned(fd: RawFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is open (just listed); the caller forgets the value, so
    // it is never closed through it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// After a failed exec: the descriptors as they were (the originals are
/// the caller's to drop).
pub(crate) fn reattach_after_exec(saved: &[(RawFd, OwnedFd)]) {
    let e = errno();
    for (fd, orig) in saved {
        put_on(orig, *fd);
    }
    set_errno(e);
}

/// Whether the listening TCP socket `fd` survives an exec.
fn surviving_listener(fd: RawFd) -> bool {
    use rustix::net::sockopt;
    let b = borrow(fd);
    rustix::io::fcntl_getfd(b).is_ok_and(|f| !f.contains(rustix::io::FdFlags::CLOEXEC))
        && sockopt::socket_acceptconn(b).unwrap_or(false)
        && sockopt::socket_type(b).is_ok_and(|t| t == rustix::net::SocketType::STREAM)
        && sockopt::socket_domain(b).is_ok_and(|d| {
            d == rustix::net::AddressFamily::INET || d == rustix::net::AddressFamily::INET6
        })
}

/// The listening sockets that would survive an exec and that the library
/// opted in (a listener it never opted in, or took up and found not opted
/// in, is left alone, and no rendezvous is opened for nothing).
fn surviving_listeners() -> Vec<RawFd> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let ours = |fd: RawFd| {
        matches!(
            get_raw(fd),
            Some(Entry::Passive(_) | Entry::Listener(_) | Entry::LazyListener(..))
        )
    };
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| ours(fd) && surviving_listener(fd))
        .collect()
}

/// Before an exec into a program that will not load the library: the
/// listening sockets `fds` are opted out of SMC (see above). Returns those
/// it opted out (duplicates), to opt in again if the exec fails.
fn opt_out_listeners(fds: &[RawFd]) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    for &fd in fds {
        // (a socket under two descriptors: the second finds it opted out)
        if !smc::opt_out_listener(borrow(fd)) {
            continue;
        }
        if debug() {
            eprintln!(
                "libsmc-preload: exec of a program without the library: \
                 listening fd {fd} offers TCP only from now on"
            );
        }
        if let Ok(d) = dup_own(fd) {
            out.push(d);
        }
    }
    out
}

/// After a failed exec (or spawn): the listeners [`opt_out_listeners`] took
/// out offer SMC again.
fn opt_in_again(listeners: &[OwnedFd]) {
    let e = errno();
    for l in listeners {
        smc::opt_in_listener_again(l.as_fd());
    }
    set_errno(e);
}

/// What an exec of `target` with the environment `envp` must do first: the
/// listeners it opts out, if the new image will not load the library.
fn prepare(target: &Target<'_>, envp: CArgv) -> Vec<OwnedFd> {
    let fds = surviving_listeners();
    if fds.is_empty() || image::loads_library(target, envp) {
        return Vec::new();
    }
    opt_out_listeners(&fds)
}

/// An exec with the library's connections detached first (see above) and
/// put back if it fails, and the listeners opted out if the new image will
/// not load the library (and in again if it fails).
fn around_exec(target: Target<'_>, envp: CArgv, exec: impl FnOnce() -> c_int) -> c_int {
    let listeners = prepare(&target, envp);
    let saved = detach_for_exec();
    let limit = crate::lifecycle::limit_for_exec();
    let r = exec();
    crate::lifecycle::limit_after_failed_exec(limit);
    reattach_after_exec(&saved);
    opt_in_again(&listeners);
    let e = errno();
    drop(saved);
    drop(listeners);
    set_errno(e);
    r
}

/// The process's environment (`environ`), for the execs that take none.
pub(crate) fn environ() -> CArgv {
    extern "C" {
        static environ: CArgv;
    }
    // SAFETY: reads the C library's pointer (a racing `setenv` in another
    // thread is the caller's race, as in glibc's own `execv`).
    unsafe { environ }
}

/// `s` as a C string, if not NULL.
fn cstr<'a>(s: CPath) -> Option<&'a CStr> {
    // SAFETY: the caller's C string argument, which the exec reads as well.
    (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) })
}

pub(crate) type CPath = *const libc::c_char;

pub(crate) type CArgv = *const *const libc::c_char;

/// `path` as an exec target (NULL: no file, which the exec refuses).
fn path_target<'a>(path: CPath) -> Target<'a> {
    Target::Path(cstr(path).unwrap_or_default())
}

#[no_mangle]
pub unsafe extern "C" fn execve(path: CPath, argv: CArgv, envp: CArgv) -> c_int {
    // SAFETY: the caller's arguments, unchanged (so for every exec below).
    around_exec(path_target(path), envp, || unsafe {
        real!(execve: fn(CPath, CArgv, CArgv) -> c_int)(path, argv, envp)
    })
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: CPath, argv: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(path_target(path), environ(), || unsafe {
        real!(execv: fn(CPath, CArgv) -> c_int)(path, argv)
    })
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: CPath, argv: CArgv) -> c_int {
    let t = Target::Search(cstr(file).unwrap_or_default());
    // SAFETY: as above.
    around_exec(t, environ(), || unsafe {
        real!(execvp: fn(CPath, CArgv) -> c_int)(file, argv)
    })
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: CPath, argv: CArgv, envp: CArgv) -> c_int {
    let t = Target::Search(cstr(file).unwrap_or_default());
    // SAFETY: as above.
    around_exec(t, envp, || unsafe {
        real!(execvpe: fn(CPath, CArgv, CArgv) -> c_int)(file, argv, envp)
    })
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: CArgv, envp: CArgv) -> c_int {
    // SAFETY: as above.
    around_exec(Target::Fd(fd), envp, || unsafe {
        real!(fexecve: fn(c_int, CArgv, CArgv) -> c_int)(fd, argv, envp)
    })
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: CPath,
    argv: CArgv,
    envp: CArgv,
    flags: c_int,
) -> c_int {
    let t = Target::At(dirfd, cstr(path).unwrap_or_default(), flags);
    // SAFETY: as above.
    around_exec(t, envp, || unsafe {
        real!(execveat: fn(c_int, CPath, CArgv, CArgv, c_int) -> c_int)(
            dirfd, path, argv, envp, flags,
        )
    })
}

// ----- execl, execlp, execle -----
//
// glibc's execl* build an argument vector and call `__execve`/`__execvpe`,
// internal names no preload reaches (posix/execl.c), and stable Rust cannot
// define a C variadic function. So each is a naked function that stores the
// variadic arguments passed in registers next to those passed on the stack
// and hands both to `execl_common`, which walks them as the C code would
// (`va_arg` up to the NULL, then `envp` for `execle`) and calls the
// interposed `execve`/`execvp`. The psABIs pass variadic pointer arguments
// exactly as named ones: x86-64 in rsi, rdx, rcx, r8, r9 after `path` (rdi),
// then on the stack above the return address; AArch64 (Linux) in x1-x7,
// then on the stack.

#[cfg(target_arch = "x86_64")]
const VA_REGS: usize = 5;
#[cfg(target_arch = "aarch64")]
const VA_REGS: usize = 7;

/// Which of the three.
const EXECL: c_int = 0;
const EXECLP: c_int = 1;
const EXECLE: c_int = 2;

/// The variadic arguments after `path`: the first `VA_REGS` at `regs`, the
/// rest at `stack`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe extern "C" fn execl_common(
    path: CPath,
    regs: *const CPath,
    stack: *const CPath,
    which: c_int,
) -> c_int {
    // SAFETY: the caller passed a NULL-terminated list of pointers (and,
    // for execle, one more): slot `i` is read only while no NULL came
    // before it, as `va_arg` would.
    let arg = |i: usize| unsafe {
        if i < VA_REGS {
            *regs.add(i)
        } else {
            *stack.add(i - VA_REGS)
        }
    };
    let mut argv = Vec::new();
    loop {
        let a = arg(argv.len());
        argv.push(a);
        if a.is_null() {
            break;
        }
    }
    let argv_p = argv.as_ptr();
    // SAFETY: `argv` is a NULL-terminated vector living across the call.
    unsafe {
        match which {
            EXECLE => execve(path, argv_p, arg(argv.len()).cast()),
            EXECLP => execvp(path, argv_p),
            _ => execve(path, argv_p, environ()),
        }
    }
}

macro_rules! execl_variant {
    ($name:ident, $which:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name() {
            // rsp is 8 off 16-byte alignment at entry; 5 pushes make it
            // aligned for the call. [rsp] .. [rsp+32]: rsi, rdx, rcx, r8, r9;
            // [rsp+40]: the return address; [rsp+48]: the stack arguments.
            core::arch::naked_asm!(
                "push r9",
                "push r8",
                "push rcx",
                "push rdx",
                "push rsi",
                "mov rsi, rsp",
                "lea rdx, [rsp + 48]",
                "mov ecx, {which}",
                "call {common}",
                "add rsp, 40",
                "ret",
                which = const $which,
                common = sym execl_common,
            )
        }

        #[cfg(target_arch = "aarch64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name() {
            // A frame of 80 bytes: x29, x30, then x1-x7; the caller's stack
            // arguments start at the entry sp (the frame's top).
            core::arch::naked_asm!(
                "stp x29, x30, [sp, #-80]!",
                "mov x29, sp",
                "stp x1, x2, [sp, #16]",
                "stp x3, x4, [sp, #32]",
                "stp x5, x6, [sp, #48]",
                "str x7, [sp, #64]",
                "add x1, sp, #16",
                "add x2, sp, #80",
                "mov w3, #{which}",
                "bl {common}",
                "ldp x29, x30, [sp], #80",
                "ret",
                which = const $which,
                common = sym execl_common,
            )
        }
    };
}

execl_variant!(execl, EXECL);
execl_variant!(execlp, EXECLP);
execl_variant!(execle, EXECLE);

// ----- posix_spawn, posix_spawnp -----
//
// glibc's posix_spawn clones a child that shares the parent's memory
// (CLONE_VM | CLONE_VFORK, sysdeps/unix/sysv/linux/spawni.c) and runs the
// file actions and the exec there with internal calls, so nothing of the
// library runs in the child. The parent is held until the child has exec'd
// (or failed), so the stand-ins are put on the parent's own descriptors for
// that time (the close-on-exec ones too, keeping the flag: the file actions
// may `dup2` one onto the child's stdin), and taken off after: the child
// inherits the stand-ins, the parent goes on with its connections. The
// library's reads and writes of those connections go through its own
// duplicates meanwhile; a `close` of one by another thread waits for the
// spawn (`SPAWN`), so that putting the descriptor back never revives a
// closed one (a `dup2` onto one meanwhile is not guarded). The listeners
// are opted out as for an exec when the spawned program will not load the
// library, and stay so (the parent shares them: a fallback) unless the
// spawn fails.

/// Held (written) while a spawn has stand-ins on the parent's descriptors;
/// `close` of a descriptor the library carries reads it.
pub(crate) static SPAWN: RwLock<()> = RwLock::new(());

/// A spawn (see above) with the stand-ins on the parent's descriptors for
/// its duration; `started`: whether its result says a child was started
/// (else the listeners are opted in again).
fn around_spawn<T>(
    target: Target<'_>,
    envp: CArgv,
    spawn: impl FnOnce() -> T,
    started: impl FnOnce(&T) -> bool,
) -> T {
    let listeners = prepare(&target, envp);
    decline_lazy_for_exec();
    let g = SPAWN.write().unwrap_or_else(|e| e.into_inner());
    let saved = detach_connections(true);
    let r = spawn();
    let e = errno();
    reattach_after_exec(&saved);
    drop(g);
    // (their drop closes through the library's `close`: after the guard)
    drop(saved);
    if !started(&r) {
        opt_in_again(&listeners);
    }
    drop(listeners);
    set_errno(e);
    r
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: CPath,
    actions: *const c_void,
    attr: *const c_void,
    argv: CArgv,
    envp: CArgv,
) -> c_int {
    // SAFETY: the caller's arguments, unchanged.
    around_spawn(
        path_target(path),
        envp,
        || unsafe {
            real!(posix_spawn: fn(*mut libc::pid_t, CPath, *const c_void, *const c_void, CArgv, CArgv) -> c_int)(
                pid, path, actions, attr, argv, envp,
            )
        },
        |&r| r == 0,
    )
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: CPath,
    actions: *const c_void,
    attr: *const c_void,
    argv: CArgv,
    envp: CArgv,
) -> c_int {
    let t = Target::Search(cstr(file).unwrap_or_default());
    // SAFETY: the caller's arguments, unchanged.
    around_spawn(
        t,
        envp,
        || unsafe {
            real!(posix_spawnp: fn(*mut libc::pid_t, CPath, *const c_void, *const c_void, CArgv, CArgv) -> c_int)(
                pid, file, actions, attr, argv, envp,
            )
        },
        |&r| r == 0,
    )
}

// ----- system, popen -----
//
// glibc's `system` and `popen` start `/bin/sh -c COMMAND` with the C
// library's internal spawn (stdlib/system.c `do_system`, libio/iopopen.c
// `spawn_process`), which no preload reaches: without more, the shell
// would inherit the connections' bare TCP sockets (a new image that reads
// one waits forever, and its writes go where the peer never reads) and, in
// a shell without the library (a caller that unset `LD_PRELOAD`), listeners
// still opted in. `popen` returns once the shell is started, so it runs
// inside `around_spawn` whole. `system` waits for the command: inside
// `around_spawn` whole it would leave the stand-ins on the caller's
// descriptors, and hold every other thread's `close`, for as long as the
// command runs. So while the library has connections or listeners,
// `system` is done here as POSIX specifies it (XSH `system`), with the
// interposed `posix_spawn`: the shell spawned with `sh -c -- COMMAND` and
// the process's environment; in the caller, SIGINT and SIGQUIT ignored
// (counted across concurrent calls) and SIGCHLD blocked until the shell
// has ended; in the shell, those the caller did not ignore at their
// defaults and the caller's signal mask; the shell's wait status, exit
// status 127 if it could not be started, -1 if waiting failed; not a
// cancellation point (a cancellation waits for the next one). Otherwise,
// and for `system(NULL)`, it is glibc's own.

/// How many `system` calls of the library's run, and the SIGINT and
/// SIGQUIT actions the first one found (put back by the last).
static SYSTEM: Mutex<(usize, Option<(libc::sigaction, libc::sigaction)>)> = Mutex::new((0, None));

/// Whether the library has descriptors a spawned shell would inherit.
fn has_descriptors() -> bool {
    USED.load(Ordering::Acquire) || COUNT.load(Ordering::Acquire) > 0
}

extern "C" {
    fn pthread_setcancelstate(state: c_int, old: *mut c_int) -> c_int;
}

/// glibc's `PTHREAD_CANCEL_DISABLE` (pthread.h).
const PTHREAD_CANCEL_DISABLE: c_int = 1;

#[no_mangle]
pub unsafe extern "C" fn system(command: CPath) -> c_int {
    if command.is_null() || !has_descriptors() {
        // SAFETY: the caller's argument, unchanged.
        return unsafe { real!(system: fn(CPath) -> c_int)(command) };
    }
    // (a cancellation's unwinding must not cross these Rust frames: it
    // stays pending until the caller's next cancellation point)
    let mut cancel = 0;
    // SAFETY: sets this thread's cancelability; `cancel` receives the old one.
    unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut cancel) };
    // SAFETY: `command` is the caller's C string (not NULL), read by the shell.
    let r = unsafe { run_shell(command) };
    let e = errno();
    // SAFETY: as above, the state as it was.
    unsafe { pthread_setcancelstate(cancel, std::ptr::null_mut()) };
    set_errno(e);
    r
}

/// `system(command)` through the interposed `posix_spawn` (see above).
unsafe fn run_shell(command: CPath) -> c_int {
    // SAFETY (this function): `sigaction`, `pthread_sigmask` and the
    // `posix_spawnattr_*` calls get initialised structures owned here (a
    // zeroed `sigaction`/`sigset_t` is a valid value, filled by the calls);
    // `argv` is NULL-terminated and lives across the spawn.
    let (intr, quit) = {
        let mut s = SYSTEM.lock().unwrap_or_else(|e| e.into_inner());
        if s.0 == 0 {
            let mut ign: libc::sigaction = unsafe { std::mem::zeroed() };
            ign.sa_sigaction = libc::SIG_IGN;
            unsafe { libc::sigemptyset(&mut ign.sa_mask) };
            let mut intr: libc::sigaction = unsafe { std::mem::zeroed() };
            let mut quit: libc::sigaction = unsafe { std::mem::zeroed() };
            unsafe {
                libc::sigaction(libc::SIGINT, &ign, &mut intr);
                libc::sigaction(libc::SIGQUIT, &ign, &mut quit);
            }
            s.1 = Some((intr, quit));
        }
        s.0 += 1;
        s.1.expect("saved by the first call")
    };
    let mut chld: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut omask: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigemptyset(&mut chld);
        libc::sigaddset(&mut chld, libc::SIGCHLD);
        libc::pthread_sigmask(libc::SIG_BLOCK, &chld, &mut omask);
    }
    let mut def: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe { libc::sigemptyset(&mut def) };
    for (sig, old) in [(libc::SIGINT, &intr), (libc::SIGQUIT, &quit)] {
        if old.sa_sigaction != libc::SIG_IGN {
            unsafe { libc::sigaddset(&mut def, sig) };
        }
    }
    let mut attr: libc::posix_spawnattr_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::posix_spawnattr_init(&mut attr);
        libc::posix_spawnattr_setsigdefault(&mut attr, &def);
        libc::posix_spawnattr_setsigmask(&mut attr, &omask);
        libc::posix_spawnattr_setflags(
            &mut attr,
            (libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK) as libc::c_short,
        );
    }
    let argv: [CPath; 5] = [
        c"sh".as_ptr(),
        c"-c".as_ptr(),
        c"--".as_ptr(),
        command,
        std::ptr::null(),
    ];
    let mut pid: libc::pid_t = 0;
    let e = unsafe {
        posix_spawn(
            &mut pid,
            c"/bin/sh".as_ptr(),
            std::ptr::null(),
            (&attr as *const libc::posix_spawnattr_t).cast(),
            argv.as_ptr(),
            environ(),
        )
    };
    unsafe { libc::posix_spawnattr_destroy(&mut attr) };
    let mut status = 0;
    let err = if e == 0 {
        loop {
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            if r == pid {
                break 0;
            }
            if r < 0 && errno() == libc::EINTR {
                continue;
            }
            status = -1;
            break errno();
        }
    } else {
        status = 127 << 8;
        e
    };
    {
        let mut s = SYSTEM.lock().unwrap_or_else(|e| e.into_inner());
        s.0 -= 1;
        if s.0 == 0 {
            unsafe {
                libc::sigaction(libc::SIGINT, &intr, std::ptr::null_mut());
                libc::sigaction(libc::SIGQUIT, &quit, std::ptr::null_mut());
            }
            s.1 = None;
        }
    }
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &omask, std::ptr::null_mut()) };
    if err != 0 {
        set_errno(err);
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn popen(command: CPath, mode: CPath) -> *mut libc::FILE {
    if !has_descriptors() {
        // SAFETY: the caller's arguments, unchanged.
        return unsafe { real!(popen: fn(CPath, CPath) -> *mut libc::FILE)(command, mode) };
    }
    around_spawn(
        Target::Path(c"/bin/sh"),
        environ(),
        // SAFETY: as above.
        || unsafe { real!(popen: fn(CPath, CPath) -> *mut libc::FILE)(command, mode) },
        |f| !f.is_null(),
    )
}
