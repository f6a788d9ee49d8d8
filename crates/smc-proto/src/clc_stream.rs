//! Reading CLC messages out of the TCP byte stream, and what a failed handshake means.
//!
//! Spec: `protocol-clc.md` §3.1 (receive-side header checks: peek 8 bytes, read
//! exactly `length`, expected type or Decline, else a protocol error), §4.1
//! (outcomes: a Decline or a positive code means fallback to TCP on the same
//! connection; a TCP error, timeout or malformed message means the connection
//! fails), §4.6 (timeouts) — Linux `smc_clc_wait_msg`.
//!
//! [`ClcReader`] is fed whatever bytes the TCP socket returned and yields whole
//! messages. It never consumes a byte beyond the message it completes, so after a
//! Decline the bytes that follow (the peer's first TCP application data, sent right
//! after its Decline) stay with the caller for the fallback stream.

use smc_wire::clc::{ClcHeader, ClcMessage, ClcType, DeclineCode, CLC_HEADER_LEN};
use smc_wire::WireError;

/// Longest CLC message we accept. Linux drains anything longer than its buffer;
/// a well-formed v2 Proposal is at most 652 bytes, so a larger length is hostile.
pub const MAX_CLC_LEN: usize = 1024;

/// Why reading a CLC message failed — each one fails the connection (no fallback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClcReadError {
    /// The bytes are not a valid CLC message.
    Malformed(WireError),
    /// A valid message of a type that is not expected now (nor a Decline).
    Unexpected(ClcType),
    /// The header announces more than [`MAX_CLC_LEN`] bytes.
    TooLong(usize),
}

impl core::fmt::Display for ClcReadError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ClcReadError::Malformed(e) => write!(f, "malformed CLC message: {e}"),
            ClcReadError::Unexpected(t) => write!(f, "unexpected CLC {}", t.name()),
            ClcReadError::TooLong(n) => write!(f, "CLC message of {n} bytes is too long"),
        }
    }
}

impl std::error::Error for ClcReadError {}

/// Reassembles one CLC message at a time from TCP bytes.
#[derive(Debug, Default, Clone)]
pub struct ClcReader {
    buf: Vec<u8>,
}

impl ClcReader {
    /// An empty reader.
    pub fn new() -> ClcReader {
        ClcReader::default()
    }

    /// No part of a message is held (nothing fed since the last whole one).
    pub fn is_idle(&self) -> bool {
        self.buf.is_empty()
    }

    /// How many more bytes the current message needs (so the caller can read
    /// exactly that many and never swallow data that follows the message).
    pub fn wanted(&self) -> usize {
        if self.buf.len() < CLC_HEADER_LEN {
            return CLC_HEADER_LEN - self.buf.len();
        }
        match ClcHeader::peek(&self.buf) {
            Ok(h) => usize::from(h.length).saturating_sub(self.buf.len()),
            Err(_) => 0,
        }
    }

    /// Feeds bytes; consumes at most [`Self::wanted`] of them and returns how many it
    /// took plus the completed message, if any. `expected` is the type the
    /// handshake waits for; a Decline is always acceptable.
    pub fn feed(
        &mut self,
        data: &[u8],
        expected: ClcType,
    ) -> (usize, Option<Result<ClcMessage, ClcReadError>>) {
        let mut used = 0;
        loop {
            let want = self.wanted();
            if want == 0 {
                break;
            }
            let Some(chunk) = data.get(used..used + want.min(data.len() - used)) else {
                break;
            };
            if chunk.is_empty() {
                return (used, None);
            }
            self.buf.extend_from_slice(chunk);
            used += chunk.len();
            if self.buf.len() == CLC_HEADER_LEN {
                match ClcHeader::peek(&self.buf) {
                    Err(e) => return (used, Some(Err(self.fail(ClcReadError::Malformed(e))))),
                    Ok(h) if usize::from(h.length) > MAX_CLC_LEN => {
                        let n = usize::from(h.length);
                        return (used, Some(Err(self.fail(ClcReadError::TooLong(n)))));
                    }
                    Ok(h) if h.msg_type != expected && h.msg_type != ClcType::Decline => {
                        return (
                            used,
                            Some(Err(self.fail(ClcReadError::Unexpected(h.msg_type)))),
                        );
                    }
                    Ok(_) => {}
                }
            }
        }
        if self.buf.len() < CLC_HEADER_LEN || self.wanted() > 0 {
            return (used, None);
        }
        let msg = ClcMessage::decode(&self.buf).map_err(ClcReadError::Malformed);
        self.buf.clear();
        (used, Some(msg))
    }

    fn fail(&mut self, e: ClcReadError) -> ClcReadError {
        self.buf.clear();
        e
    }
}

/// How a handshake that did not reach SMC ends (`protocol-clc.md` §4.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeEnd {
    /// Continue as plain TCP on the same connection. `send_decline`: tell the peer
    /// with a Decline carrying `reason` first (never in answer to a Decline, and not
    /// for the local-only reasons PEERNOSMC / OPTUNSUPP / PEERDECL).
    Fallback {
        /// Our fallback reason (`smcss` shows it).
        reason: DeclineCode,
        /// The peer's Decline code, if the peer declined.
        peer_diagnosis: Option<DeclineCode>,
        /// A Decline must be sent before falling back.
        send_decline: bool,
    },
    /// The connection fails (client: `connect()` returns the error; server: the
    /// connection is closed before `accept()` sees it).
    Fail(FailReason),
}

/// Why a handshake failed outright.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailReason {
    /// No CLC message within `CLC_WAIT_TIME` (6 s): `ETIMEDOUT`.
    Timeout,
    /// The TCP connection broke or closed: `ECONNRESET`.
    TcpClosed,
    /// The peer sent something that is not the expected CLC message: `EPROTO`.
    Protocol(ClcReadError),
}

/// The end of a handshake for a local decision to decline with `code`.
pub fn decline(code: DeclineCode) -> HandshakeEnd {
    HandshakeEnd::Fallback {
        reason: code,
        peer_diagnosis: None,
        send_decline: !code.is_local_only(),
    }
}

/// The end of a handshake after the peer's Decline with `code`.
pub fn peer_declined(code: DeclineCode) -> HandshakeEnd {
    HandshakeEnd::Fallback {
        reason: DeclineCode::PeerDecl,
        peer_diagnosis: Some(code),
        send_decline: false,
    }
}

/// A peer's Decline that crossed ours: after a side sent a late Decline (the
/// link failed after the CLC exchange, `protocol-clc.md` §4.2, §4.3), the peer
/// may have sent its own before ours reached it — then that Decline is the
/// first thing on the TCP stream, ahead of the peer's application data
/// (Linux `smc_clc_wait_msg` reads such a pending Decline on the same path).
/// Returns its length and the message when `data` (the first bytes that
/// arrived) begins with a whole, valid Decline; `None` when it does not, and
/// then every byte is the peer's application data. A Decline is written at
/// once and arrives in one piece, so a fragment is taken for data rather
/// than held back: holding back bytes that may be data could stall an
/// application that waits for an answer. Stricter than a Decline the
/// handshake expects (whose trailer Linux does not check): here the trailer
/// must be there too, as these bytes might be data.
pub fn decline_at_head(data: &[u8]) -> Option<(usize, smc_wire::clc::Decline)> {
    let h = ClcHeader::peek(data).ok()?;
    let len = usize::from(h.length);
    if h.msg_type != ClcType::Decline
        || data.len() < len
        || data.get(len.saturating_sub(4)..len) != Some(&smc_wire::clc::EYECATCHER_SMCR[..])
    {
        return None;
    }
    match ClcMessage::decode(&data[..len]) {
        Ok(ClcMessage::Decline(d)) => Some((len, d)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_wire::clc::Decline;
    use smc_wire::types::SystemId;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // protocol-clc.md §6.1 (a1): a v1 Decline, DIFFPREFIX
    const DECLINE: &str = "e2d4c3d904001c1056780200000000020307000000000000e2d4c3d9";

    #[test]
    fn byte_by_byte_and_never_past_the_message() {
        let mut stream = hex(DECLINE);
        stream.extend_from_slice(b"tcp data after the decline");
        let mut r = ClcReader::new();
        let mut pos = 0;
        let mut got = None;
        while got.is_none() {
            let (used, m) = r.feed(&stream[pos..pos + 1], ClcType::Accept);
            pos += used;
            got = m;
        }
        assert_eq!(pos, 28, "consumed exactly the Decline");
        match got.unwrap().unwrap() {
            ClcMessage::Decline(d) => assert_eq!(d.diagnosis, DeclineCode::DiffPrefix),
            m => panic!("{m:?}"),
        }
        assert_eq!(&stream[pos..], b"tcp data after the decline");
        // in one piece too
        let mut r = ClcReader::new();
        let (used, m) = r.feed(&stream, ClcType::Accept);
        assert_eq!(used, 28);
        assert!(matches!(m, Some(Ok(ClcMessage::Decline(_)))));
    }

    #[test]
    fn garbage_unexpected_and_oversized_fail() {
        let mut r = ClcReader::new();
        let (_, m) = r.feed(b"GET / HTTP/1.1\r\n", ClcType::Proposal);
        assert!(matches!(
            m,
            Some(Err(ClcReadError::Malformed(WireError::BadEyecatcher(_))))
        ));
        // an Accept when a Proposal is expected
        let mut acc = hex(DECLINE);
        acc[4] = 2;
        let mut r = ClcReader::new();
        let (_, m) = r.feed(&acc, ClcType::Proposal);
        assert_eq!(m, Some(Err(ClcReadError::Unexpected(ClcType::Accept))));
        // a header announcing 60000 bytes
        let mut big = hex(DECLINE);
        big[5] = 0xea;
        big[6] = 0x60;
        let mut r = ClcReader::new();
        let (used, m) = r.feed(&big, ClcType::Proposal);
        assert_eq!(used, 8);
        assert_eq!(m, Some(Err(ClcReadError::TooLong(60000))));
        // a truncated stream just waits
        let mut r = ClcReader::new();
        let (used, m) = r.feed(&hex(DECLINE)[..20], ClcType::Accept);
        assert_eq!((used, m), (20, None));
        assert_eq!(r.wanted(), 8);
    }

    #[test]
    fn a_crossed_decline_is_recognized_only_whole_and_at_the_head() {
        let d = hex(DECLINE);
        let mut stream = d.clone();
        stream.extend_from_slice(b"data");
        let (n, m) = decline_at_head(&stream).unwrap();
        assert_eq!((n, m.diagnosis), (28, DeclineCode::DiffPrefix));
        assert_eq!(decline_at_head(&d[..27]), None, "a fragment is data");
        assert_eq!(decline_at_head(b"hello, world, this is data"), None);
        assert_eq!(decline_at_head(b""), None);
        let mut late = b"x".to_vec();
        late.extend_from_slice(&d);
        assert_eq!(decline_at_head(&late), None, "only at the head");
        // an Accept-shaped head is not a Decline
        let mut acc = d.clone();
        acc[4] = 2;
        assert_eq!(decline_at_head(&acc), None);
        // a bad trailer is not a Decline either
        let mut bad = d.clone();
        bad[27] ^= 1;
        assert_eq!(decline_at_head(&bad), None);
    }

    #[test]
    fn outcomes_follow_linux() {
        assert_eq!(
            decline(DeclineCode::NoSmcDev),
            HandshakeEnd::Fallback {
                reason: DeclineCode::NoSmcDev,
                peer_diagnosis: None,
                send_decline: true
            }
        );
        assert!(matches!(
            decline(DeclineCode::PeerNoSmc),
            HandshakeEnd::Fallback {
                send_decline: false,
                ..
            }
        ));
        assert_eq!(
            peer_declined(DeclineCode::DiffPrefix),
            HandshakeEnd::Fallback {
                reason: DeclineCode::PeerDecl,
                peer_diagnosis: Some(DeclineCode::DiffPrefix),
                send_decline: false
            }
        );
        let _ = Decline::new(1, SystemId::default(), DeclineCode::SyncErr);
    }
}
