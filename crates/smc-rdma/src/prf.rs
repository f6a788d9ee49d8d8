//! SipHash-2-4 (Aumasson and Bernstein, "SipHash: a fast short-input PRF",
//! 2012): the keyed pseudo-random function behind unguessable values — the
//! shm device's keys, addresses and rendezvous proofs, and the engine's
//! initial PSNs (SipHash of a counter under a key from the kernel's random
//! source, or from a seed where a run must replay).
#![forbid(unsafe_code)]

/// SipHash-2-4 of `data` under the key `(k0, k1)` (Aumasson and Bernstein's
/// reference definition).
pub fn siphash(k0: u64, k1: u64, data: &[u8]) -> u64 {
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
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let m = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        v[3] ^= m;
        round(&mut v);
        round(&mut v);
        v[0] ^= m;
    }
    let rest = chunks.remainder();
    let mut last = [0u8; 8];
    last[..rest.len()].copy_from_slice(rest);
    let m = u64::from_le_bytes(last) | (data.len() as u64) << 56;
    v[3] ^= m;
    round(&mut v);
    round(&mut v);
    v[0] ^= m;
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_reference_vectors() {
        // The reference implementation's vectors: key 00..0f, message 00..len-1.
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let msg: Vec<u8> = (0..64u8).collect();
        assert_eq!(siphash(k0, k1, &msg[..0]), 0x726f_db47_dd0e_0e31);
        assert_eq!(siphash(k0, k1, &msg[..1]), 0x74f8_39c5_93dc_67fd);
        assert_eq!(siphash(k0, k1, &msg[..8]), 0x93f5_f579_9a93_2462);
        assert_eq!(siphash(k0, k1, &msg[..15]), 0xa129_ca61_49be_45e5);
        assert_eq!(siphash(k0, k1, &msg[..63]), 0x958a_324c_eb06_4572);
    }
}
