//! The first bytes a benchmark client sends on every data connection: what the
//! server should do with it. The same header goes over SMC-R and over TCP.

use std::io::{self, Read};

/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = 24;
const MAGIC: u32 = 0x534d_4342; // "SMCB"

/// What the server does with a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Job {
    /// Until end-of-file: read `req` bytes, answer `resp` bytes.
    Echo {
        /// Request size.
        req: u64,
        /// Response size.
        resp: u64,
    },
    /// Read `total` bytes, answer the count received as 8 bytes (LE), then wait
    /// for end-of-file.
    Sink {
        /// Bytes the client will send.
        total: u64,
    },
    /// As `Sink`, with the bytes taken in place (`SmcStream::read_in_place`:
    /// each lent piece is committed after its first and last byte are looked
    /// at; the body is not read). Over TCP, as `Sink`.
    SinkInPlace {
        /// Bytes the client will send.
        total: u64,
    },
    /// One request of `req` bytes, one response of `resp` bytes, then close.
    Once {
        /// Request size.
        req: u64,
        /// Response size.
        resp: u64,
    },
    /// As `Once`, after three messages of an SMC-R CLC handshake's sizes
    /// (`CLC_PROPOSAL` from the client, `CLC_ACCEPT` from the server,
    /// `CLC_CONFIRM` from the client), over TCP only: what connection setup
    /// costs any transport whose data path is TCP's that runs the CLC over
    /// the TCP connection before its data (a floor for SMC-R's setup).
    OnceAfterClc {
        /// Request size.
        req: u64,
        /// Response size.
        resp: u64,
    },
    /// Send one byte (so the client knows the server holds it), then hold the
    /// connection, idle, until end-of-file.
    Idle,
    /// As `Echo` with `size` both ways, but the connection is one of `count`
    /// of group `group`, and one server thread serves the whole group,
    /// polling its connections without blocking (see `poll.rs`).
    PollEcho {
        /// Request and response size.
        size: u64,
        /// The group's id, unique within the client process.
        group: u32,
        /// Connections in the group.
        count: u32,
    },
}

/// The sizes of the CLC messages of [`Job::OnceAfterClc`], as smc-rs sends
/// them to another smc-rs (SMC-R v1 with one IPv4 prefix; an SMC-R v1
/// Accept and Confirm are 68 bytes, RFC 7609 §3.7.2-3.7.3).
pub const CLC_PROPOSAL: usize = 92;
/// See [`CLC_PROPOSAL`].
pub const CLC_ACCEPT: usize = 68;
/// See [`CLC_PROPOSAL`].
pub const CLC_CONFIRM: usize = 68;

/// Most connections of one polling group.
pub const MAX_GROUP: u32 = 1024;

/// A job header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header(pub Job);

impl Header {
    /// The 24 bytes: magic, kind, two arguments (all little-endian).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let (kind, a, b) = match self.0 {
            Job::Echo { req, resp } => (1u32, req, resp),
            Job::Sink { total } => (2, total, 0),
            Job::SinkInPlace { total } => (6, total, 0),
            Job::Once { req, resp } => (3, req, resp),
            Job::OnceAfterClc { req, resp } => (7, req, resp),
            Job::Idle => (4, 0, 0),
            Job::PollEcho { size, group, count } => {
                (5, size, (u64::from(group) << 32) | u64::from(count))
            }
        };
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&kind.to_le_bytes());
        out[8..16].copy_from_slice(&a.to_le_bytes());
        out[16..24].copy_from_slice(&b.to_le_bytes());
        out
    }

    /// Parses 24 bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> io::Result<Header> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if u32_at(0) != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a smc-bench job header",
            ));
        }
        let (a, bb) = (u64_at(8), u64_at(16));
        let job = match u32_at(4) {
            1 => Job::Echo { req: a, resp: bb },
            2 => Job::Sink { total: a },
            6 => Job::SinkInPlace { total: a },
            3 => Job::Once { req: a, resp: bb },
            7 => Job::OnceAfterClc { req: a, resp: bb },
            4 => Job::Idle,
            5 => Job::PollEcho {
                size: a,
                group: (bb >> 32) as u32,
                count: bb as u32,
            },
            k => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown job kind {k}"),
                ))
            }
        };
        // Message sizes are held in memory: refuse absurd ones.
        if let Job::PollEcho { size, count, .. } = job {
            if size > 1 << 30 || count == 0 || count > MAX_GROUP {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "polling group: message above 1 GiB or group size not 1..=1024",
                ));
            }
        }
        if let Job::Echo { req, resp } | Job::Once { req, resp } | Job::OnceAfterClc { req, resp } =
            job
        {
            if req > 1 << 30 || resp > 1 << 30 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "message size above 1 GiB",
                ));
            }
        }
        Ok(Header(job))
    }

    /// Reads one header.
    pub fn read_from(r: &mut impl Read) -> io::Result<Header> {
        let mut b = [0u8; HEADER_LEN];
        r.read_exact(&mut b)?;
        Header::decode(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for j in [
            Job::Echo {
                req: 1,
                resp: 65536,
            },
            Job::Sink { total: 4 << 30 },
            Job::SinkInPlace { total: 1 << 30 },
            Job::Once { req: 64, resp: 64 },
            Job::Idle,
            Job::PollEcho {
                size: 16384,
                group: u32::MAX,
                count: 10,
            },
        ] {
            assert_eq!(Header::decode(&Header(j).encode()).unwrap(), Header(j));
        }
        for count in [0, MAX_GROUP + 1] {
            let h = Header(Job::PollEcho {
                size: 1,
                group: 1,
                count,
            });
            assert!(Header::decode(&h.encode()).is_err(), "count {count}");
        }
        let mut bad = Header(Job::Idle).encode();
        bad[0] ^= 1;
        assert!(Header::decode(&bad).is_err());
    }
}
