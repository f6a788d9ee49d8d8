//! Sockets that opt in to the SMC SYN option before `connect()` / `listen()`.

use rustix::net::{AddressFamily, SocketType};
use smc_bpf::{Rendezvous, RendezvousError};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Once;

/// The host's rendezvous, or why there is none (said once on stderr, as the
/// issue asks: a clear message, then TCP). An administrator may install it
/// (or open it to this user) while the process runs: `Rendezvous::shared`
/// tries again then, and the first socket that gets it says so once.
pub(crate) fn rendezvous() -> Result<&'static Rendezvous, RendezvousError> {
    static WARN: Once = Once::new();
    static LATER: Once = Once::new();
    match Rendezvous::shared() {
        Ok(r) => {
            if WARN.is_completed() {
                LATER.call_once(|| {
                    eprintln!(
                        "smc-rs: the SMC TCP option can be used now; new connections may use SMC-R"
                    );
                });
            }
            Ok(r)
        }
        Err(e) => {
            WARN.call_once(|| {
                eprintln!("smc-rs: the SMC TCP option cannot be used on this host, connections use plain TCP: {e}");
            });
            Err(e)
        }
    }
}

/// A new TCP socket for `addr`'s family, opted in to the SMC option if the
/// rendezvous is available. Returns its cookie if it is opted in (for
/// [`peer_offered_smc_by_cookie`] after its `connect()`).
pub(crate) fn socket_for(addr: &SocketAddr) -> io::Result<(OwnedFd, Option<u64>)> {
    let fam = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket(fam, SocketType::STREAM, None)?;
    crate::registry::start();
    let cookie = match rendezvous() {
        // (a TCP socket of ours, fresh: no checks of type and state)
        Ok(r) => r.opt_in_new_cookie(fd.as_fd()).ok(),
        Err(_) => None,
    };
    Ok((fd, cookie))
}

/// Whether the peer's SYN (or SYN-ACK) on the connected socket `fd` carried
/// the SMC option; the rendezvous forgets the connection either way.
pub(crate) fn peer_offered_smc(fd: BorrowedFd<'_>) -> bool {
    rendezvous().is_ok_and(|r| r.take_peer_offered_smc(fd).unwrap_or(false))
}

/// [`peer_offered_smc`] for the socket whose cookie is `cookie` (one system
/// call less).
pub(crate) fn peer_offered_smc_by_cookie(cookie: u64) -> bool {
    rendezvous().is_ok_and(|r| r.take_peer_offered_smc_by_cookie(cookie).unwrap_or(false))
}

/// After `accept()`: whether the client offered SMC, leaving the socket's
/// entry for [`claim`] (a connection whose handshake runs at its first use,
/// `crate::deferred`).
pub(crate) fn peer_offered_smc_unclaimed(fd: BorrowedFd<'_>) -> bool {
    rendezvous().is_ok_and(|r| r.peer_offered_smc(fd).unwrap_or(false))
}

/// Takes the socket for this process's handshake: `false` if another
/// process sharing it took it first (or it closed).
pub(crate) fn claim(fd: BorrowedFd<'_>) -> bool {
    rendezvous().is_ok_and(|r| r.claim(fd).unwrap_or(false))
}
