//! The two transports behind one `Read + Write` type, and the connection mode
//! labels the report counts.

use smc::{Mode, SmcStream};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Which socket type a measurement uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    /// `smc::SmcStream` / `smc::SmcListener` (SMC-R over the shm device).
    Smc,
    /// `std::net::TcpStream` over loopback.
    Tcp,
}

impl Transport {
    /// `"smc"` / `"tcp"`.
    pub fn key(self) -> &'static str {
        match self {
            Transport::Smc => "smc",
            Transport::Tcp => "tcp",
        }
    }
}

/// Label of an SMC-R connection.
pub const SMC_R: &str = "SMC-R";
/// Label of a plain `std::net::TcpStream`.
pub const PLAIN_TCP: &str = "TCP (std socket)";

/// The label of an `SmcStream`'s mode: `SMC-R`, or the fallback and its reason.
pub fn mode_label(m: Mode) -> String {
    match m {
        Mode::SmcR => SMC_R.to_string(),
        // smc-rs's own code, which smc-wire's table of Linux codes does not name
        Mode::Tcp(f) if f.code() == smc::FALLBACK_NO_RENDEZVOUS => format!(
            "TCP fallback: 0x{:08X} (no SYN-option rendezvous on this host: not root, or no BPF)",
            f.code()
        ),
        // "TCP fallback: <reason> (peer: <code>)"
        Mode::Tcp(f) => f.to_string(),
    }
}

/// One benchmark connection.
pub enum Conn {
    /// SMC socket (SMC-R, or TCP fallback — see [`Conn::label`]).
    Smc(SmcStream),
    /// Plain TCP.
    Tcp(TcpStream),
}

impl Conn {
    /// Connects to 127.0.0.1:`port` (TCP_NODELAY on both kinds).
    pub fn connect(t: Transport, port: u16) -> io::Result<Conn> {
        Ok(match t {
            Transport::Smc => {
                let s = SmcStream::connect(("127.0.0.1", port))?;
                s.set_nodelay(true)?;
                Conn::Smc(s)
            }
            Transport::Tcp => {
                let s = TcpStream::connect(("127.0.0.1", port))?;
                s.set_nodelay(true)?;
                Conn::Tcp(s)
            }
        })
    }

    /// How this connection moves data.
    pub fn label(&self) -> String {
        match self {
            Conn::Smc(s) => mode_label(s.mode()),
            Conn::Tcp(_) => PLAIN_TCP.to_string(),
        }
    }

    /// Read timeout, as `TcpStream::set_read_timeout`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Smc(s) => s.set_read_timeout(t),
            Conn::Tcp(s) => s.set_read_timeout(t),
        }
    }

    /// Shuts down the write half: the peer reads end-of-file.
    pub fn shutdown_write(&self) -> io::Result<()> {
        match self {
            Conn::Smc(s) => s.shutdown(std::net::Shutdown::Write),
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        }
    }

    /// Non-blocking mode, as `TcpStream::set_nonblocking`.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Conn::Smc(s) => s.set_nonblocking(on),
            Conn::Tcp(s) => s.set_nonblocking(on),
        }
    }

    /// Write timeout, as `TcpStream::set_write_timeout`.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Smc(s) => s.set_write_timeout(t),
            Conn::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

impl Conn {
    /// Writes a prefix of `data` in place (`SmcStream::write_in_place`: the
    /// bytes copied straight into the space lent, the peer's RMB); over
    /// plain TCP, a write.
    pub fn write_in_place(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.write_in_place(data.len(), |w| {
                let n = w.len().min(data.len());
                w.copy_from(0, &data[..n])?;
                Ok(n)
            }),
            Conn::Tcp(s) => s.write(data),
        }
    }

    /// Takes up to `max` received bytes in place (`SmcStream::read_in_place`),
    /// looking at the first and the last byte of what is lent only; over
    /// plain TCP, a read into `scratch`. Bytes taken (0: end of file).
    pub fn take_in_place(&mut self, max: usize, scratch: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.read_in_place(max, |r| {
                let mut b = [0u8; 1];
                r.copy_to(0, &mut b)?;
                r.copy_to(r.len() - 1, &mut b)?;
                std::hint::black_box(b);
                Ok(r.len())
            }),
            Conn::Tcp(s) => {
                let n = max.min(scratch.len());
                s.read(&mut scratch[..n])
            }
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.read(buf),
            Conn::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.write(buf),
            Conn::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
