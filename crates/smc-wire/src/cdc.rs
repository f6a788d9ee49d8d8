//! CDC (Connection Data Control) messages and RMBE cursor arithmetic —
//! `protocol-llc-cdc.md` §2 and §3.
//!
//! A CDC message is a 44-byte RDMA SEND payload, type byte `0xFE`, that tells the
//! peer how far the sender has written into the peer's RMBE (producer cursor) and how
//! far it has consumed its own RMBE (consumer cursor), plus flags (§2.1, §2.2).
//! All multi-byte fields are big-endian.
//!
//! The second half of this module is the cursor arithmetic of §2.3 and §3 as free
//! functions. They are *total*: no input makes them panic. Where Linux relies on a
//! precondition (a cursor's `count` is below the ring size, a cursor is at most one
//! ring ahead of another) the function documents what it returns when a hostile peer
//! violates it.

use core::cmp::Ordering;
use core::fmt;
use core::ops::{BitOr, BitOrAssign};

use crate::buf::Reader;
use crate::{Result, WireError};

/// Type byte of a CDC message (`SMC_CDC_MSG_TYPE`, §2.1).
pub const CDC_TYPE: u8 = 0xFE;
/// Length of a CDC message, also the value of its length byte (§2.1).
pub const CDC_LEN: usize = 44;
/// Offset of the reserved tail: Linux accepts a CDC whose completion length is at
/// least this (§2.1); [`CdcMessage::decode`] is stricter and wants [`CDC_LEN`].
pub const CDC_MIN_LINUX_RX_LEN: usize = 26;

// ------------------------------------------------------------------------------------
// Flags (§2.2)
// ------------------------------------------------------------------------------------

macro_rules! flag_byte {
    ($(#[$doc:meta])* $name:ident, mask = $mask:expr, { $($(#[$fdoc:meta])* $flag:ident = $val:expr, $get:ident;)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(u8);

        impl $name {
            $(
                $(#[$fdoc])*
                pub const $flag: $name = $name($val);
            )*
            /// Every defined bit; the other bits are reserved.
            pub const ALL: $name = $name($mask);

            /// No flag set.
            pub const fn empty() -> $name {
                $name(0)
            }

            /// The raw byte.
            pub const fn bits(self) -> u8 {
                self.0
            }

            /// From a raw byte, dropping reserved bits.
            pub const fn from_bits_truncate(b: u8) -> $name {
                $name(b & $mask)
            }

            /// True if every bit of `other` is set.
            pub const fn contains(self, other: $name) -> bool {
                self.0 & other.0 == other.0
            }

            /// True if no bit is set.
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }

            /// Sets or clears the bits of `other`.
            pub fn set(&mut self, other: $name, on: bool) {
                if on {
                    self.0 |= other.0;
                } else {
                    self.0 &= !other.0;
                }
            }

            /// Sets the bits of `other`.
            pub fn insert(&mut self, other: $name) {
                self.0 |= other.0;
            }

            /// Clears the bits of `other`.
            pub fn remove(&mut self, other: $name) {
                self.0 &= !other.0;
            }

            $(
                #[doc = concat!("True if `", stringify!($flag), "` is set.")]
                pub const fn $get(self) -> bool {
                    self.0 & $val != 0
                }
            )*

            fn names(self) -> impl Iterator<Item = &'static str> {
                [$(($val, stringify!($get))),*]
                    .into_iter()
                    .filter(move |(v, _)| self.0 & v != 0)
                    .map(|(_, n)| n)
            }
        }

        impl BitOr for $name {
            type Output = $name;
            fn bitor(self, rhs: $name) -> $name {
                $name(self.0 | rhs.0)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: $name) {
                self.0 |= rhs.0;
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(0x{:02x}", stringify!($name), self.0)?;
                for n in self.names() {
                    write!(f, " {n}")?;
                }
                write!(f, ")")
            }
        }
    };
}

flag_byte!(
    /// CDC byte 24, producer flags (`smc_cdc_producer_flags`), `protocol-llc-cdc.md`
    /// §2.2. Reserved bits (0x07) are dropped on decode and never sent.
    ProducerFlags, mask = 0xF8, {
        /// 0x80: the sender has more data than fits into the receiver's free space.
        WRITE_BLOCKED = 0x80, write_blocked;
        /// 0x40: urgent (out-of-band) data is pending at the sender.
        URG_DATA_PENDING = 0x40, urg_data_pending;
        /// 0x20: the byte before the producer cursor is the urgent byte.
        URG_DATA_PRESENT = 0x20, urg_data_present;
        /// 0x10: the sender asks for an immediate consumer-cursor update.
        CONS_CURS_UPD_REQ = 0x10, cons_curs_upd_req;
        /// 0x08: failover validation message (§2.4).
        FAILOVER_VALIDATION = 0x08, failover_validation;
    }
);

flag_byte!(
    /// CDC byte 25, connection state flags (`smc_cdc_conn_state_flags`),
    /// `protocol-llc-cdc.md` §2.2. Reserved bits (0x1F) are dropped on decode.
    ConnStateFlags, mask = 0xE0, {
        /// 0x80: the sender shut down its writing side.
        PEER_DONE_WRITING = 0x80, peer_done_writing;
        /// 0x40: the sender closed the connection (orderly).
        PEER_CONN_CLOSED = 0x40, peer_conn_closed;
        /// 0x20: abnormal close (abort / reset).
        PEER_CONN_ABORT = 0x20, peer_conn_abort;
    }
);

// ------------------------------------------------------------------------------------
// Cursor and message (§2.1)
// ------------------------------------------------------------------------------------

/// A producer or consumer cursor into an RMBE ring (`smc_cdc_cursor` without its two
/// reserved bytes), `protocol-llc-cdc.md` §2.1 and §2.3: `count` is the byte offset
/// within the ring, `wrap` counts how often `count` passed the ring end (16 bits,
/// wrapping 0xFFFF → 0).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Cursor {
    /// Wrap counter.
    pub wrap: u16,
    /// Offset within the ring; valid cursors have `count < ring_size`.
    pub count: u32,
}

impl Cursor {
    /// A cursor at `wrap:count`.
    pub const fn new(wrap: u16, count: u32) -> Cursor {
        Cursor { wrap, count }
    }

    /// The cursor advanced by `n` bytes in a ring of `ring_size` bytes (Linux
    /// `smc_curs_add`), `protocol-llc-cdc.md` §2.1: each time `count` reaches the ring
    /// size it restarts at 0 and `wrap` increments (0xFFFF → 0).
    ///
    /// Precondition: `count < ring_size` and `n <= ring_size` (Linux adds at most one
    /// ring). Violations are handled arithmetically, not by panicking: the position is
    /// reduced modulo the ring and `wrap` advances by the number of ring ends passed
    /// (modulo 2^16). A `ring_size` of 0 (or above `u32::MAX`, which no RMBE reaches)
    /// returns the cursor unchanged.
    pub fn add(self, n: usize, ring_size: usize) -> Cursor {
        let (Ok(size), Ok(n)) = (u64::try_from(ring_size), u64::try_from(n)) else {
            return self;
        };
        if size == 0 || size > u64::from(u32::MAX) {
            return self;
        }
        let total = u64::from(self.count).saturating_add(n);
        let wraps = total / size;
        let count = u32::try_from(total % size).unwrap_or(0);
        Cursor {
            wrap: self.wrap.wrapping_add((wraps & 0xFFFF) as u16),
            count,
        }
    }

    /// The cursor with `count` clamped to `max` (recent Linux bounds a received
    /// producer cursor to its RMB length this way before using it).
    pub fn clamp_count(self, max: u32) -> Cursor {
        Cursor {
            wrap: self.wrap,
            count: self.count.min(max),
        }
    }
}

impl fmt::Display for Cursor {
    /// `wrap:0xcount`, as the capture decoder prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:0x{:x}", self.wrap, self.count)
    }
}

/// An SMC-R CDC message (`smc_cdc_msg`), `protocol-llc-cdc.md` §2.1.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct CdcMessage {
    /// Per-connection send sequence number (§2.3).
    pub seqno: u16,
    /// Alert token of the *receiving* connection.
    pub token: u32,
    /// Producer cursor: how far the sender has written into the receiver's RMBE.
    pub prod: Cursor,
    /// Consumer cursor: how far the sender has consumed its own RMBE.
    pub cons: Cursor,
    /// Byte 24.
    pub prod_flags: ProducerFlags,
    /// Byte 25.
    pub conn_flags: ConnStateFlags,
}

impl CdcMessage {
    /// Decodes a received SEND payload.
    ///
    /// Checks, in order: type byte `0xFE` (else [`WireError::UnknownType`]), length
    /// byte 44 (else [`WireError::BadLength`], which Linux drops), at least 44 bytes
    /// (else [`WireError::Truncated`]). Bytes after the 44th are ignored, as Linux
    /// ignores them (it only checks the completion length is >= 26). Note that Linux
    /// accepts a 26..43-byte CDC whose length byte is 44; this decoder does not (no
    /// real sender produces one). Reserved bytes and reserved flag bits are ignored.
    pub fn decode(buf: &[u8]) -> Result<CdcMessage> {
        let mut r = Reader::new(buf, "CDC message");
        let t = r.u8()?;
        if t != CDC_TYPE {
            return Err(WireError::UnknownType {
                family: "CDC",
                value: t,
            });
        }
        let len = r.u8()?;
        if usize::from(len) != CDC_LEN {
            return Err(WireError::BadLength {
                what: "CDC length byte",
                claimed: usize::from(len),
                expected: CDC_LEN,
            });
        }
        // (every CDC received comes through here: the fields are read at
        // their offsets in its 44 bytes, the layout `encode` writes)
        let Some(b) = buf.first_chunk::<CDC_LEN>() else {
            return Err(WireError::Truncated {
                what: "CDC message",
                needed: CDC_LEN,
                available: buf.len(),
            });
        };
        // type, length, seqno, token; each cursor: 2 reserved, wrap, count;
        // the flags; the rest reserved
        let [_, _, s0, s1, t0, t1, t2, t3, _, _, pw0, pw1, pc0, pc1, pc2, pc3, _, _, cw0, cw1, cc0, cc1, cc2, cc3, pf, cf, ..] =
            *b;
        Ok(CdcMessage {
            seqno: u16::from_be_bytes([s0, s1]),
            token: u32::from_be_bytes([t0, t1, t2, t3]),
            prod: Cursor::new(
                u16::from_be_bytes([pw0, pw1]),
                u32::from_be_bytes([pc0, pc1, pc2, pc3]),
            ),
            cons: Cursor::new(
                u16::from_be_bytes([cw0, cw1]),
                u32::from_be_bytes([cc0, cc1, cc2, cc3]),
            ),
            prod_flags: ProducerFlags::from_bits_truncate(pf),
            conn_flags: ConnStateFlags::from_bits_truncate(cf),
        })
    }

    /// Appends the 44 encoded bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.encode());
    }

    /// The 44 encoded bytes (every CDC sent goes through here: no allocation).
    pub fn encode(&self) -> [u8; CDC_LEN] {
        let mut out = [0u8; CDC_LEN];
        out[0] = CDC_TYPE;
        out[1] = CDC_LEN as u8;
        out[2..4].copy_from_slice(&self.seqno.to_be_bytes());
        out[4..8].copy_from_slice(&self.token.to_be_bytes());
        // the cursors at 8 and 16: 2 reserved bytes, wrap, count (§2.1)
        out[10..12].copy_from_slice(&self.prod.wrap.to_be_bytes());
        out[12..16].copy_from_slice(&self.prod.count.to_be_bytes());
        out[18..20].copy_from_slice(&self.cons.wrap.to_be_bytes());
        out[20..24].copy_from_slice(&self.cons.count.to_be_bytes());
        out[24] = self.prod_flags.bits();
        out[25] = self.conn_flags.bits();
        // 26..44 reserved, zero
        out
    }

    /// Always [`CDC_LEN`].
    pub fn encoded_len(&self) -> usize {
        CDC_LEN
    }

    /// True if this is a failover validation message (§2.4), which is never processed
    /// as data.
    pub fn is_failover_validation(&self) -> bool {
        self.prod_flags.failover_validation()
    }

    /// The failover validation CDC (`smcr_cdc_msg_send_validation`, §2.4): seqno =
    /// the seqno of the last CDC whose send *completed*, token = the peer's alert
    /// token, producer flags = failover_validation, everything else zero.
    pub fn failover_validation(seqno_fin: u16, peer_token: u32) -> CdcMessage {
        CdcMessage {
            seqno: seqno_fin,
            token: peer_token,
            prod_flags: ProducerFlags::FAILOVER_VALIDATION,
            ..CdcMessage::default()
        }
    }
}

/// Fuzz entry point: decodes arbitrary bytes; if that succeeds, re-encoding and
/// decoding again must give the same message.
#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    if let Ok(m) = CdcMessage::decode(data) {
        let bytes = m.encode();
        assert_eq!(CdcMessage::decode(&bytes), Ok(m));
        // seqno and token come back byte for byte.
        assert_eq!(bytes.get(2..8), data.get(2..8));
    }
}

// ------------------------------------------------------------------------------------
// Sequence numbers (§2.3, §2.4)
// ------------------------------------------------------------------------------------

/// True if `received` is older than `last` in 16-bit serial arithmetic:
/// `(int16)(received - last) < 0` — Linux `smc_cdc_before`, the drop rule for normal
/// CDCs (§2.3). An equal seqno is *not* older (it is processed).
pub fn seqno_is_older(received: u16, last: u16) -> bool {
    (received.wrapping_sub(last) as i16) < 0
}

/// True if `received` is newer than `last`: `(int16)(received - last) > 0` (§2.3).
pub fn seqno_is_newer(received: u16, last: u16) -> bool {
    (received.wrapping_sub(last) as i16) > 0
}

/// Linux's acceptance rule for a normal (non-validation) CDC: not older than the last
/// processed seqno (§2.3).
pub fn seqno_accept(received: u16, last: u16) -> bool {
    !seqno_is_older(received, last)
}

/// The failover validation check (`smc_cdc_msg_validate`, §2.4): true if the
/// connection is out of sync, i.e. `(int16)(last_received - validation_seqno) < 0`
/// — the peer claims a completed send we never received.
pub fn failover_out_of_sync(last_received: u16, validation_seqno: u16) -> bool {
    (last_received.wrapping_sub(validation_seqno) as i16) < 0
}

// ------------------------------------------------------------------------------------
// Cursor arithmetic (§2.3, §3)
// ------------------------------------------------------------------------------------

fn size_u64(ring_size: usize) -> u64 {
    u64::try_from(ring_size).unwrap_or(u64::MAX)
}

fn to_usize(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

/// Bytes from `old` to `new` in a ring of `ring_size` bytes — Linux `smc_curs_diff`
/// (§3.1, §3.4): with equal wraps `new.count - old.count`, or 0 if `new` is behind;
/// with different wraps `(ring_size - old.count) + new.count`.
///
/// Precondition (as in Linux): `old <= new`, at most one ring apart, counts below
/// `ring_size`. Like Linux, a differing wrap is *not* checked for direction, so a
/// `new` that is behind by a wrap gives a positive result — apply
/// [`cursor_moves_backwards`] (Linux does, when copying a received cursor) or use
/// [`cursor_comp`] first. Out-of-range counts saturate instead of wrapping around.
pub fn cursor_diff(ring_size: usize, old: Cursor, new: Cursor) -> usize {
    let size = size_u64(ring_size);
    let (o, n) = (u64::from(old.count), u64::from(new.count));
    let d = if old.wrap != new.wrap {
        size.saturating_sub(o).saturating_add(n)
    } else {
        n.saturating_sub(o)
    };
    to_usize(d)
}

/// Signed distance from `old` to `new` — Linux `smc_curs_comp` (§3): negative if
/// `old` is ahead (`old.wrap > new.wrap`, or equal wraps and `old.count > new.count`),
/// then `-cursor_diff(new, old)`; otherwise `cursor_diff(old, new)`. Like Linux, the
/// wrap comparison is plain (not serial), so it is wrong across a 0xFFFF → 0 wrap.
pub fn cursor_comp(ring_size: usize, old: Cursor, new: Cursor) -> i64 {
    if old.wrap > new.wrap || (old.wrap == new.wrap && old.count > new.count) {
        let d = i64::try_from(cursor_diff(ring_size, new, old)).unwrap_or(i64::MAX);
        -d
    } else {
        i64::try_from(cursor_diff(ring_size, old, new)).unwrap_or(i64::MAX)
    }
}

/// [`cursor_comp`] as an ordering of `a` relative to `b` (`Less` if `a` is behind `b`).
pub fn cursor_cmp(a: Cursor, b: Cursor) -> Ordering {
    a.wrap.cmp(&b.wrap).then(a.count.cmp(&b.count))
}

/// Bytes from `old` to `new` where the distance may exceed the ring, capped at
/// `ring_size` — Linux `smc_curs_diff_large`. A wrap that went 0xFFFF → 0 is
/// accounted for. Saturating for out-of-range counts.
pub fn cursor_diff_large(ring_size: usize, old: Cursor, new: Cursor) -> usize {
    let size = size_u64(ring_size);
    let (o, n) = (u64::from(old.count), u64::from(new.count));
    let d = match old.wrap.cmp(&new.wrap) {
        Ordering::Less => {
            let rings = u64::from(new.wrap - old.wrap - 1);
            size.saturating_sub(o)
                .saturating_add(n)
                .saturating_add(rings.saturating_mul(size))
                .min(size)
        }
        Ordering::Greater => {
            let rings = u64::from(new.wrap) + 0xFFFF - u64::from(old.wrap);
            size.saturating_sub(o)
                .saturating_add(n)
                .saturating_add(rings.saturating_mul(size))
                .min(size)
        }
        Ordering::Equal => n.saturating_sub(o),
    };
    to_usize(d)
}

/// Linux's "a cursor must not move backwards" rule for a received cursor
/// (`smc_cdc_cursor_to_host`, §2.3): true — ignore `new`, keep `old` — if
/// `old.wrap > new.wrap && new.wrap != 0` (wrap 0 after 0xFFFF is accepted), or the
/// wraps are equal and `old.count > new.count`.
pub fn cursor_moves_backwards(old: Cursor, new: Cursor) -> bool {
    (old.wrap > new.wrap && new.wrap != 0) || (old.wrap == new.wrap && old.count > new.count)
}

/// The cursor to keep after receiving `new` when `old` is held (§2.3): `old` if `new`
/// would move backwards, else `new`.
pub fn accept_cursor(old: Cursor, new: Cursor) -> Cursor {
    if cursor_moves_backwards(old, new) {
        old
    } else {
        new
    }
}

/// Free bytes in the peer's RMBE ring of `ring_size` bytes when we have written up to
/// `prod` and the peer has confirmed consumption up to `peer_cons` (§3.1, §3.2).
///
/// Wraps are compared in 16-bit serial arithmetic: `prod` may be in the same wrap as
/// `peer_cons` or one ahead. Never exceeds `ring_size`. Inconsistent input — a count
/// at or above the ring size, a consumer cursor ahead of the producer, or more than a
/// ring in flight — yields 0 (nothing may be written), never a panic.
pub fn peer_rmbe_free(ring_size: usize, prod: Cursor, peer_cons: Cursor) -> usize {
    let size = size_u64(ring_size);
    let (p, c) = (u64::from(prod.count), u64::from(peer_cons.count));
    if p >= size || c >= size {
        return 0;
    }
    let used = match prod.wrap.wrapping_sub(peer_cons.wrap) {
        0 if p >= c => p - c,
        1 if p <= c => size - c + p,
        _ => return 0,
    };
    to_usize(size.saturating_sub(used))
}

/// How much of `to_send` prepared bytes may be written now, and whether the CDC must
/// carry write_blocked (§3.2 step 1): `len = min(to_send, peer_rmbe_space)`,
/// `write_blocked = to_send >= peer_rmbe_space`. With no space, `(0, true)`.
pub fn write_len(to_send: usize, peer_rmbe_space: usize) -> (usize, bool) {
    (to_send.min(peer_rmbe_space), to_send >= peer_rmbe_space)
}

/// At most two contiguous `(offset, len)` pieces of a ring access (§3.2 step 2).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RingChunks {
    chunks: [(usize, usize); 2],
    n: usize,
}

impl RingChunks {
    /// The pieces in order: none (empty access), one, or two (the second at offset 0).
    pub fn as_slice(&self) -> &[(usize, usize)] {
        self.chunks.get(..self.n).unwrap_or(&[])
    }

    /// Number of pieces (0..=2).
    pub fn len(&self) -> usize {
        self.n
    }

    /// True for an empty access.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Total bytes.
    pub fn total(&self) -> usize {
        self.as_slice().iter().map(|c| c.1).sum()
    }
}

/// Splits an access of `len` bytes starting at cursor `at` in a ring of `ring_size`
/// bytes into at most two contiguous chunks `(offset, len)` (§3.2 step 2; each
/// becomes one RDMA WRITE): the first at `at.count` up to the ring end, the rest at
/// offset 0. Used by the sender with its producer cursor (the caller has already
/// limited `len` to the free space, so the free region is never overrun), and equally
/// usable for reading from a consumer cursor.
///
/// Errors ([`WireError::InvalidField`]) instead of panics: `at.count >= ring_size`
/// (field "cursor count") or `len > ring_size` (field "ring access length").
#[inline]
pub fn write_chunks(ring_size: usize, at: Cursor, len: usize) -> Result<RingChunks> {
    let off = usize::try_from(at.count).unwrap_or(usize::MAX);
    if off >= ring_size {
        return Err(WireError::InvalidField {
            field: "cursor count",
            value: u64::from(at.count),
        });
    }
    if len > ring_size {
        return Err(WireError::InvalidField {
            field: "ring access length",
            value: u64::try_from(len).unwrap_or(u64::MAX),
        });
    }
    if len == 0 {
        return Ok(RingChunks::default());
    }
    let first = len.min(ring_size - off);
    let rest = len - first;
    Ok(RingChunks {
        chunks: [(off, first), (0, rest)],
        n: if rest > 0 { 2 } else { 1 },
    })
}
