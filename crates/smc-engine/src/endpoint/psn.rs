//! Initial packet sequence numbers of our QPs.
//!
//! Linux draws a random 24-bit PSN for every link (`smcr_link_init`:
//! `get_random_bytes(rndvec, 3)`), and it goes to the peer in the CLC Accept /
//! Confirm or ADD_LINK (`protocol-clc.md` §3.3). Providers may use it to tell
//! the peer's QP from an impostor's (the same-host shared-memory device checks
//! it at its QP rendezvous), so it must not be guessable from what else is
//! visible, such as the QP number: each endpoint owns a [`PsnSource`], a keyed
//! pseudo-random function (SipHash-2-4 of a counter) whose 128-bit key comes
//! from the operating system for real use, and from the seed in the
//! deterministic simulation (the same seed gives the same PSNs).

use std::hash::BuildHasher;
use std::io::Read;

/// Where an endpoint's PSNs come from.
#[derive(Clone, Debug)]
pub(crate) struct PsnSource {
    k0: u64,
    k1: u64,
    n: u64,
}

impl PsnSource {
    /// Keyed from the operating system: `/dev/urandom`, or, where that cannot
    /// be read (a chroot without /dev), the keys std draws from the kernel
    /// for its hash maps.
    pub(crate) fn from_os() -> PsnSource {
        let mut key = [0u8; 16];
        let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key));
        let (k0, k1) = match read {
            Ok(()) => (
                u64::from_le_bytes(key[..8].try_into().unwrap_or_default()),
                u64::from_le_bytes(key[8..].try_into().unwrap_or_default()),
            ),
            Err(_) => {
                let s = std::collections::hash_map::RandomState::new();
                (s.hash_one(1u64), s.hash_one(2u64))
            }
        };
        PsnSource { k0, k1, n: 0 }
    }

    /// Keyed from `seed` (simulation and tests: reproducible).
    pub(crate) fn seeded(seed: u64) -> PsnSource {
        let mut x = seed ^ 0x9053_0E4D_5EED_0F5C;
        let mut next = || {
            // splitmix64, to spread a small seed over both keys
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        PsnSource {
            k0: next(),
            k1: next(),
            n: 0,
        }
    }

    /// The next initial PSN (24 bits).
    pub(crate) fn next_psn(&mut self) -> u32 {
        let x = siphash24(self.k0, self.k1, self.n);
        self.n = self.n.wrapping_add(1);
        (x & 0x00ff_ffff) as u32
    }
}

/// SipHash-2-4 (Aumasson and Bernstein, "SipHash: a fast short-input PRF",
/// 2012) of one 8-byte message, `m` in little-endian byte order.
fn siphash24(k0: u64, k1: u64, m: u64) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
    // the message block, then the final block: the length (8) in the top byte
    for b in [m, 8u64 << 56] {
        v[3] ^= b;
        round(&mut v);
        round(&mut v);
        v[0] ^= b;
    }
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// std's SipHash-2-4, to check ours against.
#[cfg(test)]
fn std_siphash24(k0: u64, k1: u64, m: u64) -> u64 {
    use std::hash::Hasher;
    #[allow(deprecated)] // the reference implementation std still carries
    let mut h = std::hash::SipHasher::new_with_keys(k0, k1);
    h.write(&m.to_le_bytes());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_matches_the_reference() {
        for (k0, k1, m) in [
            (0, 0, 0),
            (
                0x0706_0504_0302_0100,
                0x0f0e_0d0c_0b0a_0908,
                0x0706_0504_0302_0100,
            ),
            (u64::MAX, 1, 42),
        ] {
            assert_eq!(siphash24(k0, k1, m), std_siphash24(k0, k1, m));
        }
        // the paper's test vector: key 00..0f, message 00..07
        assert_eq!(
            siphash24(
                0x0706_0504_0302_0100,
                0x0f0e_0d0c_0b0a_0908,
                0x0706_0504_0302_0100
            ),
            0x93f5_f579_9a93_2462
        );
    }

    #[test]
    fn psns_are_24_bit_reproducible_per_seed_and_differ_from_the_os() {
        let a: Vec<u32> = {
            let mut s = PsnSource::seeded(7);
            (0..64).map(|_| s.next_psn()).collect()
        };
        let b: Vec<u32> = {
            let mut s = PsnSource::seeded(7);
            (0..64).map(|_| s.next_psn()).collect()
        };
        assert_eq!(a, b, "same seed, same PSNs");
        assert!(a.iter().all(|&p| p <= 0xff_ffff));
        let distinct: std::collections::HashSet<u32> = a.iter().copied().collect();
        assert!(distinct.len() > 60, "no short cycle");
        let mut c = PsnSource::seeded(8);
        assert_ne!(a[0..4], (0..4).map(|_| c.next_psn()).collect::<Vec<_>>());
        let (mut x, mut y) = (PsnSource::from_os(), PsnSource::from_os());
        let xs: Vec<u32> = (0..4).map(|_| x.next_psn()).collect();
        let ys: Vec<u32> = (0..4).map(|_| y.next_psn()).collect();
        assert_ne!(xs, ys, "two endpoints draw different PSNs");
    }
}
