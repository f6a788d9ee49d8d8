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

    /// The bytes of the message begun and not yet whole.
    pub fn held(&self) -> &[u8] {
        &self.buf
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

/// The server's answer to a Proposal the client stopped waiting for (and
/// declined: the engine's `Endpoint::give_up_on_accept` says why): one CLC
/// Accept or Decline still due on the TCP stream, ahead of the server's
/// data, to be taken off it and never handed to the application.
///
/// Only a header that reads as an Accept or a Decline within
/// [`MAX_CLC_LEN`] is taken; anything else is given back as data (a peer
/// that answers out of turn loses nothing of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwedAnswer(Stage);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// The answer's first bytes, until its header is whole.
    Head(Vec<u8>),
    /// The header was read and checked: bytes of the answer still to skip.
    Body(usize),
}

impl Default for OwedAnswer {
    fn default() -> Self {
        OwedAnswer(Stage::Head(Vec::new()))
    }
}

/// Where taking the answer off the stream stands ([`OwedAnswer::take`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owed {
    /// More of the answer is still to come.
    More,
    /// The answer is taken: what follows is the peer's data.
    Taken,
    /// The stream does not begin with an answer: these bytes (held since
    /// they came) are the peer's data, ahead of the rest.
    NotAnswer(Vec<u8>),
}

impl OwedAnswer {
    /// An answer not begun yet.
    pub fn new() -> OwedAnswer {
        OwedAnswer::default()
    }

    /// An answer whose first bytes have come already: `held`, those a
    /// [`ClcReader`] that waited for an Accept holds (a part of a message
    /// whose header, once whole, it checked by the same rules as
    /// [`Self::take`]: a part of an answer, never a whole one).
    pub fn resume(held: &[u8]) -> OwedAnswer {
        let mut a = OwedAnswer::new();
        a.take(held);
        a
    }

    /// Takes the answer's bytes off the front of `data`: how many of them
    /// were the answer's, and where it stands. After [`Owed::Taken`] the
    /// rest of `data` is the peer's; after [`Owed::NotAnswer`] so is all of
    /// `data` past the count, behind the bytes given back.
    pub fn take(&mut self, data: &[u8]) -> (usize, Owed) {
        let mut used = 0;
        loop {
            match &mut self.0 {
                Stage::Head(head) => {
                    let k = (CLC_HEADER_LEN - head.len()).min(data.len());
                    head.extend_from_slice(&data[..k]);
                    used = k;
                    if head.len() < CLC_HEADER_LEN {
                        return (used, Owed::More);
                    }
                    match ClcHeader::peek(head) {
                        Ok(h)
                            if matches!(h.msg_type, ClcType::Accept | ClcType::Decline)
                                && usize::from(h.length) <= MAX_CLC_LEN =>
                        {
                            self.0 = Stage::Body(usize::from(h.length) - CLC_HEADER_LEN);
                        }
                        _ => return (used, Owed::NotAnswer(std::mem::take(head))),
                    }
                }
                Stage::Body(skip) => {
                    let k = (*skip).min(data.len() - used);
                    *skip -= k;
                    used += k;
                    return match *skip {
                        0 => (used, Owed::Taken),
                        _ => (used, Owed::More),
                    };
                }
            }
        }
    }

    /// The stream ended before the answer was whole: the bytes held back
    /// while its header was incomplete (not an answer after all: data).
    pub fn into_held(self) -> Vec<u8> {
        match self.0 {
            Stage::Head(head) => head,
            Stage::Body(_) => Vec::new(),
        }
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

    /// An Accept of protocol-clc.md §6.1's shape: the Decline's bytes with
    /// type 2 and a length of 68 (its body is not looked at).
    fn accept_like() -> Vec<u8> {
        let mut a = hex(DECLINE);
        a[4] = 2;
        a[6] = 68;
        a.resize(68, 0);
        a
    }

    /// Feeds `stream` to an owed answer in pieces of `step` bytes, as reads
    /// would return them: what the application is given.
    fn strip(stream: &[u8], step: usize) -> Vec<u8> {
        let mut a = OwedAnswer::new();
        let mut out = Vec::new();
        let mut done = false;
        for piece in stream.chunks(step.max(1)) {
            if done {
                out.extend_from_slice(piece);
                continue;
            }
            let (n, o) = a.take(piece);
            match o {
                Owed::More => assert_eq!(n, piece.len(), "a piece not whole is all taken"),
                Owed::Taken => done = true,
                Owed::NotAnswer(back) => {
                    out.extend_from_slice(&back);
                    done = true;
                }
            }
            if done {
                out.extend_from_slice(&piece[n..]);
            }
        }
        if !done {
            out.extend_from_slice(&a.into_held());
        }
        out
    }

    #[test]
    fn an_owed_answer_is_taken_off_whole_and_the_data_behind_it_kept() {
        for answer in [hex(DECLINE), accept_like()] {
            let mut stream = answer.clone();
            stream.extend_from_slice(b"the server's data");
            for step in [1, 3, 7, 8, 9, 28, 68, 100] {
                assert_eq!(strip(&stream, step), b"the server's data", "step {step}");
            }
            // the answer alone, then nothing: nothing for the application
            assert_eq!(strip(&answer, 5), b"");
        }
        // bytes the engine's reader held when the wait ended count
        let d = hex(DECLINE);
        let mut a = OwedAnswer::resume(&d[..10]);
        assert_eq!(a.take(&d[10..]), (18, Owed::Taken));
        let mut a = OwedAnswer::resume(&d[..3]);
        assert_eq!(a.take(&d[3..]), (25, Owed::Taken));
    }

    #[test]
    fn what_is_not_an_answer_is_given_back_as_data() {
        let data = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        for step in [1, 2, 8, 50] {
            assert_eq!(strip(data, step), data, "step {step}");
        }
        // a Proposal or a Confirm is no answer to a Proposal
        for ty in [1u8, 3] {
            let mut m = hex(DECLINE);
            m[4] = ty;
            assert_eq!(strip(&m, 4), m);
        }
        // nor a header announcing more than a CLC message can hold
        let mut big = hex(DECLINE);
        big[5] = 0xea;
        assert_eq!(strip(&big, 3), big);
        // a stream that ends inside the header gives back what came
        assert_eq!(strip(&hex(DECLINE)[..5], 2), hex(DECLINE)[..5]);
    }

    proptest::proptest! {
        /// Whatever the peer sends, in whatever pieces: no panic, nothing
        /// invented, and behind a whole answer exactly the bytes that follow
        /// it.
        #[test]
        fn an_owed_answer_never_loses_or_invents_bytes(
            answer in proptest::prop_oneof![
                proptest::strategy::Just(hex(DECLINE)),
                proptest::strategy::Just(accept_like()),
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
            ],
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            step in 1usize..90,
        ) {
            let mut stream = answer.clone();
            stream.extend_from_slice(&data);
            let out = strip(&stream, step);
            let whole = ClcHeader::peek(&answer).is_ok_and(|h| {
                matches!(h.msg_type, ClcType::Accept | ClcType::Decline)
                    && usize::from(h.length) == answer.len()
            });
            if whole {
                proptest::prop_assert_eq!(&out, &data);
            }
            // what the application gets is the stream's tail
            proptest::prop_assert!(stream.ends_with(&out));
        }
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
