//! Accepting a connection now and running its CLC handshake later, in the
//! process and thread that first uses it.
//!
//! A listener ([`crate::SmcListener`]) runs every handshake at once on a
//! thread of its own, as Linux's listen worker does (af_smc.c
//! `smc_listen_work`): `accept()` returns connections that are SMC-R
//! already. That connection then lives in the listening process (see
//! `crate::fork`), which is wrong for a server that accepts and then forks a
//! process per connection (Python's `ForkingMixIn`, `socat ...,fork`, inetd):
//! the child would inherit a connection it cannot use. Here the accepting
//! thread takes the TCP connection from the kernel ([`accept`]) and the
//! handshake runs when the connection is first used ([`PendingSmc::handshake`]),
//! in whichever process that is; or, for a connection handed to a program
//! that has no SMC library (an exec), the Proposal is declined
//! ([`PendingSmc::decline`]) and the connection goes on as plain TCP, as
//! Linux falls back when the server declines (RFC 7609 §3.4.2). Until then
//! the client waits for our Accept or Decline, Linux for `CLC_WAIT_TIME`
//! (6 s, af_smc.c `smc_connect_clc`), after which its `connect()` fails
//! (ours declines and goes on over TCP instead, the engine's
//! `give_up_on_accept`): the first use must come within that for the
//! connection to be SMC-R.

use crate::handshake::{Accepting, Progress};
use crate::stream::{no_rendezvous, no_smc, SmcStream};
use rustix::event::{poll, PollFd, PollFlags};
use smc_wire::clc::DeclineCode;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

/// What [`accept`] took.
#[derive(Debug)]
pub enum Deferred {
    /// A connection without SMC (its client did not offer it, or the
    /// listening socket is not opted in): plain TCP already.
    Ready(SmcStream),
    /// A connection whose client offered SMC: its handshake is still to run.
    Pending(PendingSmc),
}

/// An accepted connection whose client offered SMC and whose CLC handshake
/// has not run yet (see [`accept`]). Dropping it closes the library's
/// handle of the socket only.
#[derive(Debug)]
pub struct PendingSmc {
    tcp: TcpStream,
    ask: crate::ctx::Bufs,
}

/// How often a handshake waiting for the client or the device looks at its
/// deadlines (the engine's 6 s per CLC message) without an event.
const TICK: Duration = Duration::from_millis(100);

/// Accepts one connection of `listener` (blocking or not, as the socket is)
/// without running its handshake. `opted`: whether the listening socket is
/// opted in to the SMC option ([`crate::opt_in`]), so that clients may
/// have offered SMC.
pub fn accept(listener: &TcpListener, opted: bool) -> io::Result<(Deferred, SocketAddr)> {
    let (tcp, addr) = listener.accept()?;
    Ok((classify(tcp, opted), addr))
}

/// `tcp`, just accepted from a listening socket opted in or not: whether
/// its client offered SMC (the rendezvous says it once per socket).
pub fn classify(tcp: TcpStream, opted: bool) -> Deferred {
    let role = crate::ctx::Role::Server;
    if !opted {
        return Deferred::Ready(SmcStream::tcp_only(tcp, role, no_rendezvous(), Vec::new()));
    }
    if !crate::rendezvous::peer_offered_smc_unclaimed(tcp.as_fd()) {
        // (the socket's entry, if any, is not needed any more)
        let _ = crate::rendezvous::claim(tcp.as_fd());
        // The SYN lacked the option: no CLC at all (Linux: PEERNOSMC).
        let mode = no_smc(DeclineCode::PeerNoSmc);
        return Deferred::Ready(SmcStream::tcp_only(tcp, role, mode, Vec::new()));
    }
    Deferred::Pending(PendingSmc {
        tcp,
        ask: (None, None),
    })
}

impl PendingSmc {
    /// The connection's TCP socket (nothing to read on it before the
    /// handshake: the client's CLC Proposal is the handshake's).
    pub fn tcp_fd(&self) -> BorrowedFd<'_> {
        self.tcp.as_fd()
    }

    /// Asks for an RMB of at least `rmb` and a send buffer of at least
    /// `sndbuf` bytes should the handshake make the connection SMC-R
    /// (`None`: the process's sizes; see [`crate::set_buffer_sizes`]), as
    /// the listening socket's `SO_RCVBUF`/`SO_SNDBUF` size an accepted
    /// AF_SMC socket's buffers in Linux.
    pub fn set_buffer_sizes(&mut self, rmb: Option<usize>, sndbuf: Option<usize>) {
        self.ask = (rmb, sndbuf);
    }

    /// Runs the server side of the CLC handshake in the calling thread,
    /// waiting for the client and the device as needed (at most the CLC
    /// timeouts): the connection over SMC-R, or over TCP after a fallback.
    /// An error: the handshake failed and the connection is unusable (the
    /// listener's driver drops such connections before `accept()`).
    ///
    /// The socket may be shared with other processes (a fork after
    /// `accept()`): the first to call this, or [`Self::decline`], runs the
    /// handshake; the others get `NotConnected`, the connection being
    /// another process's.
    pub fn handshake(self) -> io::Result<SmcStream> {
        self.claim()?;
        let a = run(Accepting::start(self.tcp, self.ask)?)?;
        a.into_stream().ok_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionAborted, "the SMC handshake failed")
        })
    }

    /// Declines SMC whatever the client proposes: the client falls back to
    /// TCP, and the connection is a plain TCP socket from here on with
    /// nothing of the CLC left on it, for a program without the library
    /// (an exec).
    /// (Shared sockets as with [`Self::handshake`].)
    pub fn decline(self) -> io::Result<TcpStream> {
        self.claim()?;
        let a = run(Accepting::start_declining(self.tcp)?)?;
        a.into_tcp().ok_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionAborted, "the SMC decline failed")
        })
    }
}

impl PendingSmc {
    fn claim(&self) -> io::Result<()> {
        if crate::rendezvous::claim(self.tcp.as_fd()) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::NotConnected,
            "the connection's handshake is another process's",
        ))
    }
}

/// Steps `a` until it is done, sleeping on its socket, and on its endpoint's
/// progress while a step runs over the device.
fn run(mut a: Accepting) -> io::Result<Accepting> {
    let mut progress = None;
    loop {
        let (write, rdma) = match a.step() {
            Progress::Done => return Ok(a),
            Progress::Wait { write, rdma } => (write, rdma),
        };
        if !rdma {
            // (registered only while a step runs over the device: every
            // pump of the endpoint would ring it)
            progress = None;
        } else if progress.is_none() {
            // (registered now: its first poll below looks at once, as a
            // pump between the step and the registration rang nobody)
            progress = a.endpoint().and_then(|e| e.progress_fd().ok());
            if progress.is_some() {
                continue;
            }
        }
        let ts = crate::ctx::timespec_until(Some(std::time::Instant::now() + TICK));
        let flags = if write { PollFlags::OUT } else { PollFlags::IN };
        match progress.as_ref() {
            Some(p) => {
                let pf = p.fd();
                let mut pfd = [PollFd::new(a.tcp(), flags), PollFd::new(&pf, PollFlags::IN)];
                poll(&mut pfd, ts.as_ref())?;
                if pfd[1].revents().contains(PollFlags::IN) {
                    p.clear();
                }
            }
            None => {
                let t = if rdma {
                    // (no progress descriptor to be had: look soon)
                    crate::ctx::timespec_until(Some(
                        std::time::Instant::now() + Duration::from_millis(1),
                    ))
                } else {
                    ts
                };
                poll(&mut [PollFd::new(a.tcp(), flags)], t.as_ref())?;
            }
        }
    }
}
