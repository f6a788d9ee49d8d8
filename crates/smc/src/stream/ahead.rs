//! What a fallback connection's TCP stream holds for the application ahead
//! of what its socket will still return: bytes that came behind the CLC
//! messages (the peer's first data after a Decline), and, for a client that
//! stopped waiting for the server's Accept, the server's answer still due,
//! to be taken off the stream before any of its data is handed out
//! (`smc_proto::clc_stream::OwedAnswer`; the engine's
//! `Endpoint::give_up_on_accept` says why a client does that).

use smc_proto::clc_stream::{Owed, OwedAnswer};

/// See the module documentation. While `owed` is set, `bytes` is empty: the
/// answer is the first thing on the stream.
#[derive(Debug, Default)]
pub(crate) struct Ahead {
    /// The peer's bytes, read and not yet handed out.
    pub(crate) bytes: Vec<u8>,
    owed: Option<OwedAnswer>,
}

impl Ahead {
    /// `bytes` read behind the handshake's CLC messages; `owed`: the answer
    /// the engine says is still due, which they may begin with.
    pub(crate) fn new(bytes: Vec<u8>, owed: Option<OwedAnswer>) -> Ahead {
        let mut a = Ahead {
            bytes: Vec::new(),
            owed,
        };
        a.came(&bytes);
        a
    }

    /// Whether the server's answer is still to be taken off the stream:
    /// the socket's next bytes go through [`Ahead::came`] before the
    /// application sees any.
    pub(crate) fn owes(&self) -> bool {
        self.owed.is_some()
    }

    /// The bytes and the owed answer, to move the stream to the other
    /// adapter's handle type.
    #[cfg(feature = "tokio")]
    pub(crate) fn into_parts(self) -> (Vec<u8>, Option<OwedAnswer>) {
        (self.bytes, self.owed)
    }

    /// Bytes read from the socket: the answer's part taken off while it is
    /// owed, the rest kept for the application.
    pub(crate) fn came(&mut self, got: &[u8]) {
        let Some(o) = self.owed.as_mut() else {
            self.bytes.extend_from_slice(got);
            return;
        };
        match o.take(got) {
            (_, Owed::More) => {}
            (k, Owed::Taken) => {
                self.owed = None;
                self.bytes.extend_from_slice(&got[k..]);
            }
            (k, Owed::NotAnswer(back)) => {
                self.owed = None;
                self.bytes.extend_from_slice(&back);
                self.bytes.extend_from_slice(&got[k..]);
            }
        }
    }

    /// The stream ended: an answer not whole by then was none, and what of
    /// it came is the peer's.
    pub(crate) fn ended(&mut self) {
        if let Some(o) = self.owed.take() {
            self.bytes.extend_from_slice(&o.into_held());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v1 Decline (protocol-clc.md §6.1 (a1)).
    const DECLINE: [u8; 28] = [
        0xe2, 0xd4, 0xc3, 0xd9, 0x04, 0x00, 0x1c, 0x10, 0x56, 0x78, 0x02, 0x00, 0x00, 0x00, 0x00,
        0x02, 0x03, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe2, 0xd4, 0xc3, 0xd9,
    ];

    #[test]
    fn the_owed_answer_is_taken_off_before_any_byte_is_kept() {
        // part of it already read behind the handshake
        let mut a = Ahead::new(DECLINE[..5].to_vec(), Some(OwedAnswer::new()));
        assert!(a.owes() && a.bytes.is_empty());
        let mut rest = DECLINE[5..].to_vec();
        rest.extend_from_slice(b"data");
        a.came(&rest[..10]);
        assert!(a.owes());
        a.came(&rest[10..]);
        assert!(!a.owes());
        assert_eq!(a.bytes, b"data");
        a.came(b" more");
        assert_eq!(a.bytes, b"data more");
    }

    #[test]
    fn without_an_owed_answer_every_byte_is_kept() {
        let a = Ahead::new(DECLINE.to_vec(), None);
        assert_eq!(a.bytes, DECLINE);
        let mut b = Ahead::new(b"not an answer".to_vec(), Some(OwedAnswer::new()));
        assert_eq!((b.owes(), &b.bytes[..]), (false, &b"not an answer"[..]));
        // a stream that ends inside the answer's header
        b = Ahead::new(DECLINE[..3].to_vec(), Some(OwedAnswer::new()));
        b.ended();
        assert_eq!((b.owes(), &b.bytes[..]), (false, &DECLINE[..3]));
    }
}
