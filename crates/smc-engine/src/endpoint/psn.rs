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

use smc_rdma::prf::siphash;
use std::hash::BuildHasher;

/// Where an endpoint's PSNs come from.
#[derive(Clone, Debug)]
pub(crate) struct PsnSource {
    k0: u64,
    k1: u64,
    n: u64,
}

impl PsnSource {
    /// Keyed from the operating system (`getrandom`, else `/dev/urandom`),
    /// or, where neither can be read, the keys std draws from the kernel for
    /// its hash maps.
    pub(crate) fn from_os() -> PsnSource {
        let mut key = [0u8; 16];
        let (k0, k1) = match smc_rdma::sys::random_bytes(&mut key) {
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
        let x = siphash(self.k0, self.k1, &self.n.to_le_bytes());
        self.n = self.n.wrapping_add(1);
        (x & 0x00ff_ffff) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
