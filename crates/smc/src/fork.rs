//! `fork()`: what a child process may do with the library.
//!
//! An SMC-R connection lives in the process that made it: its endpoint
//! state (cursors, sequence numbers, the link group), the threads that
//! serve it (progress, listener drivers) and the queue pairs whose rings it
//! shares with the peer. A forked child has a copy of that memory, frozen at
//! the fork, and none of the threads; the rings and buffers are the same
//! shared memory as the parent's. A child that used the copy would consume
//! the parent's completions, send CDCs with sequence numbers the parent also
//! uses, and close the parent's connections on drop; a lock some parent
//! thread held at the fork would stay held forever in the child.
//!
//! So the library counts process generations: [`after_fork_in_child`]
//! (called in the child: by the preload library's `pthread_atfork` handler,
//! or by a program that forks) starts a new one. Every piece of global state
//! (the devices and endpoints of `ctx`, the registry) exists once per
//! generation, and a child starts from none: its own connections and
//! listeners open their own endpoints, with a system ID of their own (a
//! child sharing its parent's ID would have the peer reuse the parent's link
//! group). Streams and listeners made before the fork are the parent's: in
//! the child they fail with `ENOTCONN` and are released without touching
//! anything (the parent's connection goes on). Linux's AF_SMC keeps all of
//! this in the kernel, where parent and child share the socket; a user-space
//! connection cannot be in two processes at once.
//!
//! The state of earlier generations is left allocated in the child, never
//! used and never dropped (dropping it would tear down the parent's queue
//! pairs, or wait on the parent's locks).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Generations with state of their own; deeper descendants (a child's child
/// ... [`MAX_GENERATIONS`] forks deep) have no SMC devices and use TCP.
pub(crate) const MAX_GENERATIONS: usize = 8;

static GENERATION: AtomicUsize = AtomicUsize::new(0);

/// Tells the library that this process is the child of a `fork()`: the
/// parent's connections, listeners and endpoints are not this process's
/// (see the module documentation). Call it in the child before it uses the
/// library again; it only bumps a counter, so it is async-signal-safe (a
/// `pthread_atfork` child handler may call it).
pub fn after_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// This process's generation (forks since the program started, counted by
/// [`after_fork_in_child`]).
pub(crate) fn generation() -> usize {
    GENERATION.load(Ordering::Acquire)
}

/// Whether a stream, listener or endpoint made in generation `born` is not
/// this process's (it was made before a fork, by the parent).
pub(crate) fn parents(born: usize) -> bool {
    born != generation()
}

/// The error of a call on a stream or listener that is the parent's:
/// `ENOTCONN`, as a socket whose connection is gone.
pub(crate) fn parents_error() -> std::io::Error {
    rustix::io::Errno::NOTCONN.into()
}

/// A value made once per process generation ([`PerFork::get_or_init`]),
/// as `OnceLock` is once per program.
pub(crate) struct PerFork<T>([OnceLock<T>; MAX_GENERATIONS]);

impl<T> PerFork<T> {
    pub(crate) const fn new() -> PerFork<T> {
        PerFork([const { OnceLock::new() }; MAX_GENERATIONS])
    }

    /// This generation's value, made by `init` on first use; `None` beyond
    /// [`MAX_GENERATIONS`].
    pub(crate) fn get_or_init(&self, init: impl FnOnce() -> T) -> Option<&T> {
        Some(self.slot(generation())?.get_or_init(init))
    }

    /// This generation's value, if made.
    pub(crate) fn get(&self) -> Option<&T> {
        self.slot(generation())?.get()
    }

    fn slot(&self, generation: usize) -> Option<&OnceLock<T>> {
        self.0.get(generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_generation_has_a_value_of_its_own() {
        let v: PerFork<usize> = PerFork::new();
        assert_eq!(v.slot(0).unwrap().get_or_init(|| 1), &1);
        assert_eq!(v.slot(0).unwrap().get_or_init(|| 2), &1);
        assert_eq!(v.slot(1).unwrap().get(), None);
        assert_eq!(v.slot(1).unwrap().get_or_init(|| 3), &3);
        assert_eq!(v.slot(0).unwrap().get(), Some(&1));
        assert!(v.slot(MAX_GENERATIONS).is_none());
    }
}
