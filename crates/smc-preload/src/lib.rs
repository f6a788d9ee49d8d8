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
//!   connections. A listening socket in blocking mode then instead hands
//!   out connections whose handshake runs at their first use, in the
//!   process that uses them (`Entry::LazyListener`, `Entry::Lazy`: servers
//!   that fork per connection), or in a thread of the library when the
//!   program lets them wait: accepted and unused (`late.rs`), or in the
//!   accept queue (`rescue.rs`).
//! * The application's descriptor is the TCP socket and stays the
//!   connection's identity (`getsockname`, `getpeername`, `setsockopt` go to
//!   it unchanged; the timeouts `SO_RCVTIMEO`/`SO_SNDTIMEO` bound the
//!   connection's blocking calls too, `sockopt.rs`); a table maps it to the `SmcStream`, which holds a
//!   duplicate of it of its own (so that the library's own calls on its
//!   socket are never routed back into the table). A connection that fell
//!   back to TCP leaves the table: from then on every call goes straight to
//!   the kernel.
//! * Reads and writes (`read`, `write`, `readv`, `writev`, `recv`, `send`,
//!   `recvfrom`, `sendto`, `recvmsg`, `sendmsg`; `MSG_PEEK`, `MSG_DONTWAIT`,
//!   `MSG_WAITALL`, `MSG_NOSIGNAL`, `MSG_OOB`, `MSG_TRUNC`; `MSG_ERRQUEUE`
//!   reads the TCP socket's error queue), `shutdown`, `close`, `dup`,
//!   `dup2`, `dup3`, `fcntl` (`O_NONBLOCK`, `F_DUPFD*`), `ioctl` (`FIONBIO`,
//!   `FIONREAD`) of SMC-R connections go to the stream; a write after the
//!   end raises `SIGPIPE` unless `MSG_NOSIGNAL`.
//! * `poll`, `ppoll`, `select` and `epoll_ctl` see a connection's (or
//!   listener's) readiness descriptor in place of its socket
//!   (`SmcStream::readiness_fd`); `epoll_wait` needs nothing more.
//! * `fork()`: the SMC-R connections open at the fork keep working in the
//!   child, as TCP sockets do: the parent, where each connection lives,
//!   serves the child's calls on them (`share.rs`).
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

#[macro_use]
mod real;
mod addr;
mod connect;
mod exec;
mod fdctl;
mod fortify;
mod image;
mod interest;
mod late;
mod lifecycle;
mod listen;
mod poll;
mod report;
mod rescue;
mod rw;
mod sendfile;
mod share;
mod socket;
mod sockopt;
mod table;

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

use addr::*;
use connect::*;
use exec::*;
use lifecycle::*;
use listen::*;
use poll::*;
use real::*;
use report::*;
use rw::*;
use table::*;
