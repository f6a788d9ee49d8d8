//! Making an `SmcStream`: connecting (the TCP connection, then the CLC
//! handshake or the fallback it ends in), and taking over a connected
//! socket.

use super::ahead::Ahead;
use super::{fail_error, no_rendezvous, no_smc, Fallback, Mode, Opted, Opts, SmcConn, SmcStream};
use crate::ctx::{self, Shared};
use crate::handshake;
use crate::rendezvous::{peer_offered_smc, peer_offered_smc_by_cookie, socket_for};
use smc_engine::endpoint::{ConnId, ConnStatus};
use smc_proto::clc_stream::OwedAnswer;
use smc_wire::clc::DeclineCode;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl SmcStream {
    /// Connects like `TcpStream::connect`, trying every address in turn.
    pub fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<SmcStream> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match Self::connect_one(&a, None) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "no addresses to connect to")
        }))
    }

    /// Connects with a timeout for the TCP connection (the CLC handshake has its own).
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<SmcStream> {
        Self::connect_one(addr, Some(timeout))
    }

    fn connect_one(addr: &SocketAddr, timeout: Option<Duration>) -> io::Result<SmcStream> {
        let (fd, cookie) = socket_for(addr)?;
        let tcp = match timeout {
            None => {
                rustix::net::connect(&fd, addr)?;
                TcpStream::from(fd)
            }
            Some(t) => {
                // non-blocking connect, then wait for writability
                rustix::io::ioctl_fionbio(&fd, true)?;
                match rustix::net::connect(&fd, addr) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::INPROGRESS) => {
                        let mut pfd = [rustix::event::PollFd::new(
                            &fd,
                            rustix::event::PollFlags::OUT,
                        )];
                        let ts = rustix::event::Timespec {
                            tv_sec: t.as_secs() as i64,
                            tv_nsec: i64::from(t.subsec_nanos()),
                        };
                        if rustix::event::poll(&mut pfd, Some(&ts))? == 0 {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "connection timed out",
                            ));
                        }
                        if let Some(e) = rustix::net::sockopt::socket_error(&fd)?.err() {
                            return Err(e.into());
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
                rustix::io::ioctl_fionbio(&fd, false)?;
                TcpStream::from(fd)
            }
        };
        let opted = match cookie {
            Some(c) => Opted::Cookie(c),
            None => Opted::No,
        };
        Self::after_connect(tcp, opted, (None, None), Some(addr.ip()))
    }

    /// A stream over `tcp`, a TCP socket connected in blocking mode: runs
    /// the client's CLC handshake if `opted` (the socket was opted in to
    /// the SMC option, [`crate::opt_in`], before its connect) and the peer's
    /// SYN-ACK offered SMC; TCP otherwise. For programs that create and
    /// connect their sockets themselves (the preload library).
    pub fn from_connected(tcp: TcpStream, opted: bool) -> io::Result<SmcStream> {
        Self::after_connect(tcp, Opted::from(opted), (None, None), None)
    }

    /// [`Self::from_connected`] with an RMB of at least `rmb` and a send
    /// buffer of at least `sndbuf` bytes if the connection is SMC-R (`None`:
    /// the process's, see [`crate::set_buffer_sizes`]): what a socket's
    /// `SO_RCVBUF`/`SO_SNDBUF` ask of an AF_SMC socket in Linux.
    pub fn from_connected_sized(
        tcp: TcpStream,
        opted: bool,
        rmb: Option<usize>,
        sndbuf: Option<usize>,
    ) -> io::Result<SmcStream> {
        Self::after_connect(tcp, Opted::from(opted), (rmb, sndbuf), None)
    }

    /// `peer`: the address connected to, if the caller knows it (one
    /// system call less per connection).
    fn after_connect(
        mut tcp: TcpStream,
        opted: Opted,
        ask: ctx::Bufs,
        peer: Option<std::net::IpAddr>,
    ) -> io::Result<SmcStream> {
        let offered = match opted {
            Opted::No => {
                return Ok(SmcStream::tcp_only(
                    tcp,
                    ctx::Role::Client,
                    no_rendezvous(),
                    Vec::new(),
                ));
            }
            Opted::Yes => peer_offered_smc(tcp.as_fd()),
            Opted::Cookie(c) => peer_offered_smc_by_cookie(c),
        };
        if !offered {
            // The SYN-ACK lacked the option: no CLC at all (Linux: PEERNOSMC).
            return Ok(SmcStream::tcp_only(
                tcp,
                ctx::Role::Client,
                no_smc(DeclineCode::PeerNoSmc),
                Vec::new(),
            ));
        }
        let local = tcp.local_addr()?.ip();
        let peer = match peer {
            Some(p) => p,
            None => tcp.peer_addr()?.ip(),
        };
        match ctx::endpoint_for(local, peer, ctx::Role::Client) {
            ctx::Device::Endpoint(shared) => {
                let id = ctx::connect_in(&mut shared.lock(), local, ask);
                SmcStream::finish_handshake(tcp, shared, id)
            }
            dev => {
                let unavailable = matches!(dev, ctx::Device::Unavailable);
                let f = handshake::client(&mut tcp, unavailable).inspect_err(|_| {
                    crate::registry::handshake_error(ctx::Role::Client);
                })?;
                Ok(SmcStream::tcp_only(
                    tcp,
                    ctx::Role::Client,
                    Mode::Tcp(f),
                    Vec::new(),
                ))
            }
        }
    }

    pub(crate) fn tcp_only(
        tcp: TcpStream,
        role: ctx::Role,
        mode: Mode,
        pending: Vec<u8>,
    ) -> SmcStream {
        SmcStream::tcp_owing(tcp, role, mode, pending, None)
    }

    /// [`SmcStream::tcp_only`] for a client whose server's answer is still
    /// due on the stream (`owed`, see `ahead.rs`).
    fn tcp_owing(
        tcp: TcpStream,
        role: ctx::Role,
        mode: Mode,
        pending: Vec<u8>,
        owed: Option<OwedAnswer>,
    ) -> SmcStream {
        let tcp = Arc::new(tcp);
        crate::registry::stream(&tcp, role, mode, None);
        SmcStream {
            tcp,
            mode,
            smc: None,
            pending: Arc::new(Mutex::new(Ahead::new(pending, owed))),
            opts: Arc::new(Opts::default()),
        }
    }

    /// An SMC-R stream whose handshake `conn` finished on `tcp` (blocking).
    pub(crate) fn smc(tcp: TcpStream, role: ctx::Role, conn: SmcConn) -> SmcStream {
        let tcp = Arc::new(tcp);
        crate::registry::stream(
            &tcp,
            role,
            Mode::SmcR,
            Some((&conn.shared, conn.id, &conn.stats)),
        );
        SmcStream {
            tcp: tcp.clone(),
            mode: Mode::SmcR,
            smc: Some(Arc::new(conn.established(tcp, true))),
            pending: Arc::default(),
            opts: Arc::new(Opts::default()),
        }
    }

    fn finish_handshake(tcp: TcpStream, shared: Arc<Shared>, id: ConnId) -> io::Result<SmcStream> {
        let conn = SmcConn::handshaking(shared.clone(), id);
        let (status, leftover) = handshake::with_endpoint(&tcp, &shared, id)?;
        match status {
            ConnStatus::Smc => Ok(SmcStream::smc(tcp, ctx::Role::Client, conn)),
            ConnStatus::Fallback { reason, peer } => Ok(SmcStream::tcp_owing(
                tcp,
                ctx::Role::Client,
                Mode::Tcp(Fallback { reason, peer }),
                leftover,
                shared.lock().owed_answer(id),
            )),
            ConnStatus::Failed(r) => {
                crate::registry::handshake_error(ctx::Role::Client);
                Err(fail_error(r))
            }
            ConnStatus::Handshaking => {
                crate::registry::handshake_error(ctx::Role::Client);
                Err(io::Error::other("SMC handshake did not finish"))
            }
        }
    }
}
