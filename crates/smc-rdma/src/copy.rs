//! Copies into and out of registered memory (an RMB, a send buffer).
//!
//! Why not one `memcpy`: for lengths between its `rep movsb` threshold (2 KiB
//! to 8 KiB, depending on the vector width; about 2 KiB with FSRM) and its
//! stop threshold, glibc's `memcpy` copies with `rep movsb`, and on some cores
//! (AMD Zen among them) `rep movsb` runs an order of magnitude slower when the
//! destination lies a few bytes above the source modulo 4 KiB: each store
//! seems to alias a load still in flight (4K aliasing). glibc guards against
//! that only where it sets `Avoid_Short_Distance_REP_MOVSB` (Intel CPUs with
//! FSRM; `ld.so --list-diagnostics` shows it). An RMB's cursors move by
//! whatever the application reads and writes, so the distance between the
//! application's buffer and its place in the RMB takes every value, and a
//! stream's throughput would depend on its write sizes. Copies whose distance
//! falls in that band go in pieces below every `rep movsb` threshold, which
//! glibc copies with vector loads and stores at full speed whatever the
//! distance; every other copy is one `memcpy`.
//!
//! `cargo bench -p smc-bench --bench hot -- copy` compares the two on the
//! machine it runs on.

/// Pieces of a copy in the aliasing band: below glibc's smallest
/// `rep movsb` threshold (2048 bytes, SSE2; larger for wider vectors).
const PIECE: usize = 2048;

/// The band of `(dst - src) mod 4096` in which `rep movsb` may stall.
const SHORT_DISTANCE: usize = 64;

/// Whether a copy of `len` bytes from `src` to `dst` would run into the
/// short-distance `rep movsb` stall and goes in pieces instead.
#[inline]
pub fn in_pieces(src: usize, dst: usize, len: usize) -> bool {
    len > PIECE && dst.wrapping_sub(src) % 4096 < SHORT_DISTANCE
}

/// Copies `len` bytes from `src` to `dst`, as
/// [`std::ptr::copy_nonoverlapping`] does, avoiding glibc's slow
/// short-distance `rep movsb` (see the module's documentation).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst`
/// for writes of `len` bytes, the two ranges not overlapping.
#[inline]
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, len: usize) {
    if !in_pieces(src as usize, dst as usize, len) {
        // SAFETY: the caller's contract is copy_nonoverlapping's.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut done = 0;
    while done < len {
        // `black_box` keeps the compiler from fusing the pieces back into
        // one `memcpy` call (loop idiom recognition would).
        let n = std::hint::black_box(PIECE.min(len - done));
        // SAFETY: `done + n <= len`, so both pieces lie inside the ranges
        // the caller vouched for, which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n) };
        done += n;
    }
}

/// Copies `len` bytes from `src` to `dst`, as [`std::ptr::copy`] does (the
/// ranges may overlap), avoiding glibc's slow short-distance `rep movsb`
/// where they do not.
///
/// # Safety
/// As [`std::ptr::copy`]: `src` valid for reads and `dst` for writes of
/// `len` bytes.
#[inline]
pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    let (s, d) = (src as usize, dst as usize);
    let disjoint = s.abs_diff(d) >= len;
    if disjoint {
        // SAFETY: the caller's contract, and the ranges do not overlap.
        unsafe { copy_nonoverlapping(src, dst, len) };
    } else {
        // SAFETY: the caller's contract is copy's.
        unsafe { std::ptr::copy(src, dst, len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_band_is_the_short_forward_distance_modulo_a_page() {
        assert!(in_pieces(4096, 4096 + 1, 4096));
        assert!(in_pieces(4096, 8192 + 63, 4096));
        assert!(in_pieces(4096, 4096, 4096));
        assert!(!in_pieces(4096, 4096 + 64, 4096));
        assert!(
            !in_pieces(4096 + 3, 4096 + 1, 4096),
            "destination below the source"
        );
        assert!(
            !in_pieces(4096, 4097, PIECE),
            "short copies are never split"
        );
        assert!(in_pieces(usize::MAX - 10, 5, 1 << 20), "the distance wraps");
    }

    /// Every length around the piece size and every distance in and near
    /// the band copies exactly the source, and nothing beyond the range.
    #[test]
    fn copies_exactly_at_every_distance_and_length() {
        let src: Vec<u8> = (0..3 * PIECE + 700).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 4 * 4096 + src.len() + 256];
        for len in [
            0,
            1,
            PIECE - 1,
            PIECE,
            PIECE + 1,
            2 * PIECE,
            3 * PIECE + 17,
            src.len(),
        ] {
            for shift in [0usize, 1, 5, 31, 63, 64, 65, 4095] {
                dst.fill(0xAA);
                // place the copy so that (dst - src) mod 4096 == shift
                let (s, base) = (src.as_ptr() as usize, dst.as_ptr() as usize);
                let off = s.wrapping_add(shift).wrapping_sub(base) % 4096;
                assert_eq!((base + off).wrapping_sub(s) % 4096, shift);
                // SAFETY: `off + len <= dst.len()` and the two vectors are distinct.
                unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().add(off), len) };
                assert_eq!(&dst[off..off + len], &src[..len], "len {len} shift {shift}");
                assert!(dst[..off].iter().all(|&b| b == 0xAA));
                assert!(dst[off + len..].iter().all(|&b| b == 0xAA));
            }
        }
    }

    #[test]
    fn overlapping_ranges_copy_as_memmove() {
        for (from, to, len) in [(0, 5, 9000), (5, 0, 9000), (0, 9000, 9000), (100, 70, 300)] {
            let mut v: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
            let mut want = v.clone();
            want.copy_within(from..from + len, to);
            let p = v.as_mut_ptr();
            // SAFETY: both ranges lie inside `v`.
            unsafe { copy(p.add(from), p.add(to), len) };
            assert_eq!(v, want, "{from} -> {to}, {len}");
        }
    }
}
