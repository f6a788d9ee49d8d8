//! Accepted connections that nobody uses: their handshake runs in a thread
//! of the library.
//!
//! A blocking listening socket hands out connections whose CLC handshake
//! runs at their first use ([`Entry::Lazy`]), so that a server that forks a
//! process per connection has it run in that process. Until then the client
//! is held in its `connect()`, waiting for the server's CLC Accept, and it
//! gives up after `CLC_WAIT_TIME` (6 s, `smc_clc_wait_msg`: Linux's client
//! fails its connect, ours declines and goes on over TCP): a server that
//! accepts a connection and lets it wait (a queue of accepted connections
//! for a pool of worker threads, a server that reads from another client
//! first) would have its client's connect fail or lose SMC-R, where TCP's
//! completes in the kernel and Linux's AF_SMC runs the
//! handshake in its listen worker whatever the program does
//! (`smc_tcp_listen_work`). So a connection not used within
//! [`FIRST_USE_WAIT`] of its accept has its handshake run by a thread of
//! the library in the accepting process, and its first use finds it done.
//! A fork since the accept leaves it to whichever process uses it first, as
//! before (the child that serves it, most likely).

use super::*;
use std::os::fd::AsFd;
use std::sync::{Condvar, Weak};
use std::time::{Duration, Instant};

/// How long an accepted connection's handshake waits for its first use
/// before the library's thread runs it: well within the client's 6 s wait
/// for the Accept, which the server's handshake may take up to 3 s of (a
/// first contact with the same peer in progress, `AwaitLgr`), and long
/// enough for a forking server's child to take the connection first.
pub(crate) const FIRST_USE_WAIT: Duration = Duration::from_secs(1);

/// Connections waiting for their first use: when the thread takes them,
/// the fork count at their accept, and the connection.
struct Unused {
    due: Vec<(Instant, u64, Weak<Lazy>)>,
    /// The process whose thread serves the list (a forked child has none).
    thread_of: Option<u32>,
}

static UNUSED: Mutex<Unused> = Mutex::new(Unused {
    due: Vec::new(),
    thread_of: None,
});
static WAKE: Condvar = Condvar::new();

thread_local! {
    /// The list's lock, held by the thread that forks across `fork()`, so
    /// that the child does not inherit it held by the library's thread.
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Unused>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before `fork()`: the list's lock taken.
pub(crate) fn before_fork() {
    let g = lock();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// After `fork()`, in parent and child: the lock let go.
pub(crate) fn after_fork() {
    FORK_GUARD.with(|f| drop(f.borrow_mut().take()));
}

fn lock() -> std::sync::MutexGuard<'static, Unused> {
    UNUSED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Connection `l`, just accepted, waits for its first use: its handshake
/// runs in the library's thread after [`FIRST_USE_WAIT`] if nothing used it.
pub(crate) fn watch(l: &Arc<Lazy>) {
    let due = Instant::now() + FIRST_USE_WAIT;
    let forks = crate::lifecycle::forks();
    let mut w = lock();
    w.due.push((due, forks, Arc::downgrade(l)));
    let me = std::process::id();
    if w.thread_of != Some(me) {
        let started = std::thread::Builder::new()
            .name("smc-first-use".into())
            .spawn(run);
        if started.is_ok() {
            w.thread_of = Some(me);
        }
    }
    drop(w);
    WAKE.notify_one();
}

/// The thread: runs the handshakes that came due, sleeps until the next.
fn run() {
    let mut w = lock();
    loop {
        let forks = crate::lifecycle::forks();
        // (gone: used, closed, or shared with a child since)
        w.due
            .retain(|(_, f, l)| *f == forks && l.upgrade().is_some_and(|l| !l.is_settled()));
        let now = Instant::now();
        if let Some(k) = w.due.iter().position(|(d, _, _)| *d <= now) {
            let (_, _, l) = w.due.swap_remove(k);
            drop(w);
            if let Some(l) = l.upgrade() {
                settle_unused(&l);
            }
            w = lock();
            continue;
        }
        let next = w.due.iter().map(|(d, _, _)| *d).min();
        let wait = next.map_or(Duration::from_secs(3600), |d| d - now);
        w = WAKE
            .wait_timeout(w, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Runs the handshake of `l`, which nothing used yet (a first use meanwhile
/// runs it, or waits for this one and takes its outcome).
fn settle_unused(l: &Lazy) {
    let Ok(mut p) = l.pending.try_lock() else {
        // (a first use runs it now)
        return;
    };
    // (for a failed handshake's shutdown: the descriptor number the
    // program has may be closed and reused by now; without one, the
    // handshake is left to the first use)
    let Some(Ok(shut)) = p.as_ref().map(|q| q.tcp_fd().try_clone_to_owned()) else {
        return;
    };
    let Some(pending) = p.take() else { return };
    let outcome = listen::settle(pending, shut.as_fd());
    let conn = match outcome {
        Ok(c) => c,
        Err(e) => {
            // (another process took it: not after a fork, see `run`)
            if debug() {
                eprintln!("libsmc-preload: an accepted connection: {e}");
            }
            None
        }
    };
    let _ = l.done.set(conn);
}
