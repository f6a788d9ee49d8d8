//! `SmcListener` and `SmcStream`.

use crate::rendezvous::{rendezvous, socket_for};
use crate::{handshake, FALLBACK_NO_RENDEZVOUS};
use smc_wire::clc::DeclineCode;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Duration;

/// Why a connection runs over TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fallback {
    /// Our reason, as `smcss` shows it (e.g. `0x03010000`: the peer did not offer SMC).
    pub reason: DeclineCode,
    /// The peer's Decline code, when the peer declined.
    pub peer: Option<DeclineCode>,
}

impl Fallback {
    /// The reason as smc-tools' 32-bit code.
    pub fn code(&self) -> u32 {
        self.reason.to_u32()
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TCP fallback: {}", self.reason)?;
        if let Some(p) = self.peer {
            write!(f, " (peer: {p})")?;
        }
        Ok(())
    }
}

/// How a connection moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// SMC-R.
    SmcR,
    /// Plain TCP, and why.
    Tcp(Fallback),
}

/// A connection: SMC-R when both ends could, TCP otherwise.
#[derive(Debug)]
pub struct SmcStream {
    tcp: TcpStream,
    mode: Mode,
}

fn no_smc(reason: DeclineCode) -> Mode {
    Mode::Tcp(Fallback { reason, peer: None })
}

fn no_rendezvous() -> Mode {
    no_smc(DeclineCode::from_u32(FALLBACK_NO_RENDEZVOUS))
}

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
        let (fd, opted) = socket_for(addr)?;
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
        Self::after_connect(tcp, opted)
    }

    fn after_connect(mut tcp: TcpStream, opted: bool) -> io::Result<SmcStream> {
        let mode = if !opted {
            no_rendezvous()
        } else {
            let r = rendezvous().ok();
            let offered = r.is_some_and(|r| r.peer_offered_smc(tcp.as_fd()).unwrap_or(false));
            if let Some(r) = r {
                r.forget(tcp.as_fd());
            }
            if offered {
                Mode::Tcp(handshake::client(&mut tcp)?)
            } else {
                // The SYN-ACK lacked the option: no CLC at all (Linux: PEERNOSMC).
                no_smc(DeclineCode::PeerNoSmc)
            }
        };
        Ok(SmcStream { tcp, mode })
    }

    /// SMC-R, or TCP with the reason.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Shuts down the read, write or both halves.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.tcp.shutdown(how)
    }

    /// `TCP_NODELAY`.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nodelay(on)
    }

    /// Non-blocking mode.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nonblocking(on)
    }

    /// Read timeout.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(t)
    }

    /// Write timeout.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)
    }

    /// Another handle to the same connection.
    pub fn try_clone(&self) -> io::Result<SmcStream> {
        Ok(SmcStream {
            tcp: self.tcp.try_clone()?,
            mode: self.mode,
        })
    }
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tcp.read(buf)
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

impl Read for &SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.tcp).read(buf)
    }
}

impl Write for &SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&self.tcp).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&self.tcp).flush()
    }
}

/// A listener whose connections use SMC-R when the client can.
#[derive(Debug)]
pub struct SmcListener {
    tcp: TcpListener,
    opted: bool,
}

impl SmcListener {
    /// Binds like `TcpListener::bind` (the first address that works).
    pub fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<SmcListener> {
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match Self::bind_one(&a) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no addresses to bind")))
    }

    fn bind_one(addr: &SocketAddr) -> io::Result<SmcListener> {
        let (fd, opted) = socket_for(addr)?;
        rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
        rustix::net::bind(&fd, addr)?;
        rustix::net::listen(&fd, 128)?;
        Ok(SmcListener {
            tcp: TcpListener::from(fd),
            opted,
        })
    }

    /// Accepts the next connection. A connection whose SMC handshake fails (a
    /// peer sending garbage, vanishing or staying silent for 6 s) is closed and
    /// the listener goes on to the next one, as Linux's listen worker does.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        loop {
            let (mut tcp, addr) = self.tcp.accept()?;
            if !self.opted {
                return Ok((
                    SmcStream {
                        tcp,
                        mode: no_rendezvous(),
                    },
                    addr,
                ));
            }
            let r = rendezvous().ok();
            let offered = r.is_some_and(|r| r.peer_offered_smc(tcp.as_fd()).unwrap_or(false));
            if let Some(r) = r {
                r.forget(tcp.as_fd());
            }
            if !offered {
                return Ok((
                    SmcStream {
                        tcp,
                        mode: no_smc(DeclineCode::PeerNoSmc),
                    },
                    addr,
                ));
            }
            match handshake::server(&mut tcp) {
                Ok(f) => {
                    return Ok((
                        SmcStream {
                            tcp,
                            mode: Mode::Tcp(f),
                        },
                        addr,
                    ))
                }
                Err(_) => continue,
            }
        }
    }

    /// An iterator over incoming connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SmcStream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Non-blocking accept.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp.set_nonblocking(on)
    }
}
