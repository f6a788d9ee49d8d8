//! Copies into and out of registered memory (an RMB, a send buffer).
//!
//! Why not always one `memcpy`: for lengths between its `rep movsb`
//! threshold (2 KiB to 8 KiB, depending on the vector width; about 2 KiB
//! with FSRM) and its stop threshold, glibc's `memcpy` copies with `rep
//! movsb`, and on some cores (AMD Zen 3 and Zen 4 among them: glibc bug
//! 30994) `rep movsb` runs an order of magnitude slower when the destination
//! lies a few bytes above the source modulo 4 KiB: each store seems to alias
//! a load still in flight (4K aliasing). glibc guards against that only
//! where it sets `Avoid_Short_Distance_REP_MOVSB` (Intel CPUs with FSRM;
//! `ld.so --list-diagnostics` shows it). An RMB's cursors move by whatever
//! the application reads and writes, so the distance between the
//! application's buffer and its place in the RMB takes every value, and a
//! stream's throughput would depend on its write sizes. On such a core,
//! copies whose distance falls in that band go in pieces below every `rep
//! movsb` threshold, which glibc copies with vector loads and stores at full
//! speed whatever the distance; every other copy is one `memcpy`.
//!
//! Where `rep movsb` does not stall (AMD's family 26, for one), the pieces
//! only cost: a 2 KiB vector loop is slower than one `rep movsb` over the
//! whole length, and a stream whose reader's buffer lies a few bytes above
//! its RMB would read at that slower rate. So whether a core stalls is
//! measured, once per process, the first time a copy falls in the band
//! ([`short_distance_stalls`]); `SMC_COPY_PIECES=1` or `0` decides it
//! instead (to compare the two on one machine).
//!
//! `cargo bench -p smc-bench --bench hot -- copy` compares the two on the
//! machine it runs on.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Pieces of a copy in the aliasing band: below glibc's smallest
/// `rep movsb` threshold (2048 bytes, SSE2; larger for wider vectors).
const PIECE: usize = 2048;

/// The band of `(dst - src) mod 4096` in which `rep movsb` may stall.
const SHORT_DISTANCE: usize = 64;

/// Whether a copy of `len` bytes from `src` to `dst` falls in the
/// short-distance band: where it goes in pieces on a CPU whose `rep movsb`
/// stalls there ([`short_distance_stalls`]).
#[inline]
pub fn in_pieces(src: usize, dst: usize, len: usize) -> bool {
    len > PIECE && dst.wrapping_sub(src) % 4096 < SHORT_DISTANCE
}

/// Copies `len` bytes from `src` to `dst`, as
/// [`std::ptr::copy_nonoverlapping`] does, avoiding glibc's slow
/// short-distance `rep movsb` where this CPU has it (see the module's
/// documentation).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst`
/// for writes of `len` bytes, the two ranges not overlapping.
#[inline]
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, len: usize) {
    if !in_pieces(src as usize, dst as usize, len) || !short_distance_stalls() {
        // SAFETY: the caller's contract is copy_nonoverlapping's.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract is copy_in_pieces'.
    unsafe { copy_in_pieces(src, dst, len) }
}

/// Copies `len` bytes from `src` to `dst` in pieces of at most [`PIECE`]
/// bytes, each below every `rep movsb` threshold.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`].
#[inline(never)]
unsafe fn copy_in_pieces(src: *const u8, dst: *mut u8, len: usize) {
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

/// This process's answer to [`short_distance_stalls`], once asked.
static STALLS: OnceLock<bool> = OnceLock::new();

/// Whether copies in the short-distance band go in pieces in this process:
/// `SMC_COPY_PIECES` (`1` or `0`) if set, else whether `memcpy` measurably
/// stalls there on this CPU (a probe that times a few copies, run by the
/// first copy in the band; its answer is kept for the life of the process).
pub fn short_distance_stalls() -> bool {
    *STALLS.get_or_init(|| {
        decide(
            std::env::var("SMC_COPY_PIECES").ok().as_deref(),
            probe_stalls,
        )
    })
}

/// The setting's answer if it gives one (`1`: pieces, `0`: whole copies),
/// else the probe's.
fn decide(setting: Option<&str>, probe: impl FnOnce() -> bool) -> bool {
    match setting.map(str::trim) {
        Some("1") => true,
        Some("0") => false,
        _ => probe(),
    }
}

/// Bytes each probe copy moves: source and destination together more than
/// L1 holds, as in the 64 KiB copies the stall was seen on, and little
/// enough to cost microseconds.
const PROBE_LEN: usize = 32 << 10;

/// Distances in the band the probe tries: the stall's reports span the
/// whole band, and one that stalls anywhere in it is taken as stalling.
const PROBE_NEAR: [usize; 4] = [0, 1, 32, SHORT_DISTANCE - 1];

/// A distance well outside the band: `memcpy`'s own speed on this CPU.
const PROBE_FAR: usize = 2048;

/// How many times slower than [`PROBE_FAR`] a near copy must be to count
/// as a stall: the stall is an order of magnitude; cores without it copy
/// within tens of percent at every distance.
const STALL_FACTOR: u32 = 3;

/// Whether `memcpy` of [`PROBE_LEN`] bytes at some distance of
/// [`PROBE_NEAR`] takes more than [`STALL_FACTOR`] times as long as at
/// [`PROBE_FAR`]. Each distance is timed as its fastest of a few copies
/// after one that warms the lines, so that an interrupt or a preemption
/// during one copy does not decide.
fn probe_stalls() -> bool {
    const PAGE: usize = 4096;
    const TRIALS: usize = 5;
    // The source on a page; each destination at its distance above it,
    // modulo a page, past the source's end.
    let mut buf = vec![0x5au8; 2 * PROBE_LEN + 3 * PAGE];
    let src_at = buf.as_ptr().align_offset(PAGE).min(PAGE);
    let (head, tail) = buf.split_at_mut(src_at + PROBE_LEN);
    let src = &head[src_at..];
    let fastest = |tail: &mut [u8], distance: usize| -> Duration {
        // `tail` starts on a page (`PROBE_LEN` is a multiple of one)
        let dst = &mut tail[PAGE + distance..PAGE + distance + PROBE_LEN];
        dst.copy_from_slice(std::hint::black_box(src));
        (0..TRIALS)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(src));
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .min()
            .unwrap_or_default()
    };
    stalls_given(|distance| fastest(&mut *tail, distance))
}

/// The probe's rule, given the fastest time of a copy at each distance.
fn stalls_given(mut fastest: impl FnMut(usize) -> Duration) -> bool {
    let far = fastest(PROBE_FAR);
    PROBE_NEAR.iter().any(|&d| fastest(d) > far * STALL_FACTOR)
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
    /// the band copies exactly the source, and nothing beyond the range:
    /// through the entry point (whichever way this CPU takes) and through
    /// the pieces themselves (which a CPU without the stall never takes).
    #[test]
    fn copies_exactly_at_every_distance_and_length() {
        type Copy = unsafe fn(*const u8, *mut u8, usize);
        for (name, f) in [
            ("copy_nonoverlapping", copy_nonoverlapping as Copy),
            ("copy_in_pieces", copy_in_pieces as Copy),
        ] {
            copies_exactly(name, f);
        }
    }

    fn copies_exactly(name: &str, copy: unsafe fn(*const u8, *mut u8, usize)) {
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
                unsafe { copy(src.as_ptr(), dst.as_mut_ptr().add(off), len) };
                assert_eq!(
                    &dst[off..off + len],
                    &src[..len],
                    "{name}: len {len} shift {shift}"
                );
                assert!(dst[..off].iter().all(|&b| b == 0xAA));
                assert!(dst[off + len..].iter().all(|&b| b == 0xAA));
            }
        }
    }

    #[test]
    fn the_setting_decides_before_the_probe_runs() {
        let no_probe = || -> bool { panic!("the probe ran although the setting decides") };
        assert!(decide(Some("1"), no_probe));
        assert!(!decide(Some("0"), no_probe));
        assert!(!decide(Some(" 0\n"), no_probe));
        assert!(decide(None, || true));
        assert!(!decide(None, || false));
        assert!(
            decide(Some("yes"), || true),
            "another value leaves it to the probe"
        );
        assert!(!decide(Some(""), || false));
    }

    /// The probe answers (on any CPU), and a process keeps one answer.
    #[test]
    fn a_process_keeps_the_answer_it_got() {
        let first = short_distance_stalls();
        assert_eq!(STALLS.get(), Some(&first));
        for _ in 0..3 {
            assert_eq!(short_distance_stalls(), first);
        }
    }

    /// An order of magnitude at any near distance is a stall; tens of
    /// percent (a core without it) are not.
    #[test]
    fn the_probe_calls_a_stall_what_is_many_times_slower() {
        let ns = Duration::from_nanos;
        let far_only = |near: u64, at: usize| {
            move |d: usize| {
                if d == PROBE_FAR {
                    ns(300)
                } else if d == at {
                    ns(near)
                } else {
                    ns(310)
                }
            }
        };
        assert!(
            stalls_given(far_only(9_000, 1)),
            "Zen 4's 3.5 GB/s against 55"
        );
        assert!(
            stalls_given(far_only(1_000, SHORT_DISTANCE - 1)),
            "the band's end"
        );
        assert!(
            !stalls_given(far_only(400, 0)),
            "Zen 5's 86 GB/s against 115"
        );
        assert!(
            !stalls_given(far_only(900, 32)),
            "exactly three times is no stall"
        );
        assert!(
            !stalls_given(far_only(9_000, SHORT_DISTANCE)),
            "outside the band"
        );
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
