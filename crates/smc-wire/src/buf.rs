//! Bounds-checked big-endian reading and writing.
//!
//! [`Reader`] is the only way the decoders touch peer bytes: every accessor checks
//! the remaining length first and returns [`WireError::Truncated`] instead of
//! panicking. [`Writer`] appends to a `Vec<u8>`; writes cannot fail.

use crate::{Result, WireError};

/// A cursor over a byte slice that never reads out of bounds.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Starts reading `buf`; `what` names the message in truncation errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    /// Current offset from the start of the buffer.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left to read.
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// Takes the next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated {
            what: self.what,
            needed: usize::MAX,
            available: self.buf.len(),
        })?;
        match self.buf.get(self.pos..end) {
            Some(s) => {
                self.pos = end;
                Ok(s)
            }
            None => Err(WireError::Truncated {
                what: self.what,
                needed: end,
                available: self.buf.len(),
            }),
        }
    }

    /// Takes the next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.bytes(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    /// Skips `n` bytes (reserved fields: their content is ignored, as Linux does).
    pub fn skip(&mut self, n: usize) -> Result<()> {
        self.bytes(n).map(|_| ())
    }

    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(u8::from_be_bytes(self.array::<1>()?))
    }

    /// Reads a big-endian u16.
    pub fn be16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// Reads a little-endian u16 (SMC-Rv2 fields Linux writes in x86 host order).
    pub fn le16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// Reads a big-endian 24-bit number.
    pub fn be24(&mut self) -> Result<u32> {
        let [a, b, c] = self.array::<3>()?;
        Ok(u32::from_be_bytes([0, a, b, c]))
    }

    /// Reads a big-endian u32.
    pub fn be32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    /// Reads a big-endian u64.
    pub fn be64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = self.buf.get(self.pos..).unwrap_or(&[]);
        self.pos = self.buf.len();
        s
    }

    /// Fails unless exactly `n` bytes remain.
    pub fn expect_remaining(&self, n: usize) -> Result<()> {
        if self.remaining() == n {
            Ok(())
        } else {
            Err(WireError::BadLength {
                what: self.what,
                claimed: self.buf.len(),
                expected: self.pos.saturating_add(n),
            })
        }
    }
}

/// Appends big-endian fields to a byte vector. Writes cannot fail.
#[derive(Debug)]
pub struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    /// Appends to `out`.
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        Writer { out }
    }

    fn v(&mut self) -> &mut Vec<u8> {
        self.out
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.v().extend_from_slice(b);
        self
    }

    /// Appends `n` zero bytes (reserved fields).
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        let v = self.v();
        v.resize(v.len().saturating_add(n), 0);
        self
    }

    /// Appends one byte.
    pub fn u8(&mut self, x: u8) -> &mut Self {
        self.bytes(&[x])
    }

    /// Appends a big-endian u16.
    pub fn be16(&mut self, x: u16) -> &mut Self {
        self.bytes(&x.to_be_bytes())
    }

    /// Appends a little-endian u16.
    pub fn le16(&mut self, x: u16) -> &mut Self {
        self.bytes(&x.to_le_bytes())
    }

    /// Appends the low 24 bits of `x`, big-endian.
    pub fn be24(&mut self, x: u32) -> &mut Self {
        let [_, a, b, c] = x.to_be_bytes();
        self.bytes(&[a, b, c])
    }

    /// Appends a big-endian u32.
    pub fn be32(&mut self, x: u32) -> &mut Self {
        self.bytes(&x.to_be_bytes())
    }

    /// Appends a big-endian u64.
    pub fn be64(&mut self, x: u64) -> &mut Self {
        self.bytes(&x.to_be_bytes())
    }

    /// Length of the underlying vector (including what it held before).
    pub fn len(&self) -> usize {
        self.out.len()
    }

    /// True if the underlying vector is empty.
    pub fn is_empty(&self) -> bool {
        self.out.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_never_reads_past_the_end() {
        let b = [1u8, 2, 3];
        let mut r = Reader::new(&b, "t");
        assert_eq!(r.be16().unwrap(), 0x0102);
        assert!(matches!(
            r.be16(),
            Err(WireError::Truncated {
                needed: 4,
                available: 3,
                ..
            })
        ));
        // a failed read consumes nothing
        assert_eq!(r.u8().unwrap(), 3);
        assert!(r.u8().is_err());
        assert!(r.bytes(usize::MAX).is_err());
        assert_eq!(r.rest(), &[] as &[u8]);
    }

    #[test]
    fn be24_round_trip() {
        let mut v = Vec::new();
        Writer::new(&mut v).be24(0xABCDEF).be24(0xFF_123456);
        assert_eq!(v, [0xab, 0xcd, 0xef, 0x12, 0x34, 0x56]);
        let mut r = Reader::new(&v, "t");
        assert_eq!(r.be24().unwrap(), 0xABCDEF);
        assert_eq!(r.be24().unwrap(), 0x123456);
    }
}
