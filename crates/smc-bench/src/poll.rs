//! The request/response workload's polling shape: one thread per side walks
//! all of its non-blocking connections, moving each along its current
//! message, and never sleeps on one of them. When a whole pass over the
//! connections moved no byte, the thread yields the CPU (`sched_yield`):
//! across cores that is one cheap system call, and on one core it hands the
//! core to the peer, which otherwise would wait out a full time slice of
//! polling. The same rule holds for both transports and for the ideal
//! reference.

use crate::conn::Conn;
use std::io::{self, ErrorKind, Read, Write};

/// What one call of [`Step::advance`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// At least one byte moved.
    pub bytes: bool,
    /// A message was completed (then the step turned around).
    pub message: bool,
}

/// One connection's place in its current message: bytes done, and whether it
/// is sending (else receiving). After each complete message it turns around.
pub struct Step {
    buf: Vec<u8>,
    at: usize,
    /// Sending now (else receiving).
    pub sending: bool,
}

impl Step {
    /// A step for `size`-byte messages, starting with a send or a receive.
    pub fn new(size: usize, sending: bool) -> Step {
        Step {
            buf: vec![0x5a; size.max(1)],
            at: 0,
            sending,
        }
    }

    /// Moves `c` (non-blocking) along as far as it goes now.
    pub fn advance(&mut self, c: &mut Conn) -> io::Result<Moved> {
        let r = if self.sending {
            c.write(&self.buf[self.at..])
        } else {
            c.read(&mut self.buf[self.at..])
        };
        match r {
            Ok(0) if !self.sending => Err(io::Error::new(ErrorKind::UnexpectedEof, "peer closed")),
            Ok(0) => Ok(Moved::default()),
            Ok(n) => {
                self.at += n;
                if self.at < self.buf.len() {
                    return Ok(Moved {
                        bytes: true,
                        message: false,
                    });
                }
                self.at = 0;
                self.sending = !self.sending;
                Ok(Moved {
                    bytes: true,
                    message: true,
                })
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(Moved::default())
            }
            Err(e) => Err(e),
        }
    }
}

/// The error says the peer has gone (closed or reset).
pub fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted
            | ErrorKind::NotConnected
    )
}
