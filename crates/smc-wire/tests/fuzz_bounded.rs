//! Bounded fuzzing on stable Rust: every parser in `smc_wire::fuzz::TARGETS` gets
//! (1) every corpus file in `fuzz/corpus/<target>/` (real kernel messages and spec
//! vectors), (2) mutations of them (bit flips, byte writes, truncation, extension,
//! splices, length-field fix-ups) and (3) purely random inputs, for a bounded time.
//! A panic anywhere fails the test and prints the input as hex.
//!
//! Budget: `SMC_FUZZ_SECS` seconds per target (default 2); seed: `SMC_FUZZ_SEED`
//! (default: fixed, so a failure reproduces). cargo-fuzz in `fuzz/` goes deeper.

use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// splitmix64: small, deterministic, good enough to drive mutations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&dir) {
        let mut paths: Vec<_> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            if let Ok(b) = std::fs::read(&p) {
                out.push(b);
            }
        }
    }
    out
}

fn mutate(rng: &mut Rng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        match rng.below(9) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = [0, 0xff, 0x7f, 0x80, 1, 44, 0xfe][rng.below(7)];
            }
            2 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            3 => {
                let n = rng.below(v.len() + 1);
                v.truncate(n);
            }
            4 => {
                let n = rng.below(64);
                for _ in 0..n {
                    v.push(rng.next() as u8);
                }
            }
            5 if !pool.is_empty() => {
                // splice: head of this input, tail of another
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(v.len() + 1);
                let from = rng.below(other.len() + 1);
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            6 if v.len() >= 7 => {
                // fix up the CLC header length so decoding goes deeper
                let l = (v.len() as u16).to_be_bytes();
                v[5] = l[0];
                v[6] = l[1];
            }
            7 if v.len() >= 3 => {
                // fix up an LLC/CDC length byte (v1) or length_v2 (LE)
                if rng.below(2) == 0 {
                    v[1] = v.len().min(255) as u8;
                } else {
                    let l = (v.len() as u16).to_le_bytes();
                    v[1] = l[0];
                    v[2] = l[1];
                }
            }
            _ => {
                // duplicate a slice in place (grows counts/lists)
                if !v.is_empty() {
                    let a = rng.below(v.len());
                    let b = a + rng.below(v.len() - a);
                    let s = v[a..=b.min(v.len() - 1)].to_vec();
                    let at = rng.below(v.len() + 1);
                    v.splice(at..at, s);
                }
            }
        }
    }
    v
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn run_target(name: &str, f: smc_wire::fuzz::Target, budget: Duration, seed: u64) -> u64 {
    let pool = corpus(name);
    let mut rng = Rng(seed
        ^ name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(b)));
    let start = Instant::now();
    let mut execs = 0u64;
    let check = |data: &[u8]| {
        if panic::catch_unwind(AssertUnwindSafe(|| f(data))).is_err() {
            panic!("fuzz target {name} panicked on input {}", hex(data));
        }
    };
    // 1. the corpus as is
    for c in &pool {
        check(c);
        execs += 1;
    }
    // 2. + 3. mutations and random inputs until the budget is spent
    while start.elapsed() < budget {
        for _ in 0..256 {
            let input = if pool.is_empty() || rng.below(8) == 0 {
                let n = rng.below(300);
                (0..n).map(|_| rng.next() as u8).collect::<Vec<u8>>()
            } else {
                let base = &pool[rng.below(pool.len())];
                mutate(&mut rng, base, &pool)
            };
            check(&input);
            execs += 1;
        }
    }
    execs
}

#[test]
fn every_parser_survives_random_and_mutated_corpus_inputs() {
    let secs: f64 = std::env::var("SMC_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let seed: u64 = std::env::var("SMC_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_5A1C);
    // Silence the default hook while catching: a panic is reported with its input.
    let prev = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let mut results = Vec::new();
    for (name, f) in smc_wire::fuzz::TARGETS {
        let r = panic::catch_unwind(|| run_target(name, *f, Duration::from_secs_f64(secs), seed));
        results.push((name, r));
    }
    panic::set_hook(prev);
    for (name, r) in results {
        match r {
            Ok(n) => {
                assert!(n > 0);
                eprintln!("fuzz {name}: {n} inputs, no panic (seed {seed})");
            }
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "panic".into());
                panic!("{msg}");
            }
        }
    }
}

#[test]
fn corpus_is_present_for_every_target() {
    for (name, _) in smc_wire::fuzz::TARGETS {
        assert!(
            !corpus(name).is_empty(),
            "fuzz/corpus/{name} has no seed inputs"
        );
    }
}

#[test]
fn the_harness_reports_a_panicking_parser() {
    // Guards the harness itself: a target that panics on CLC-looking input must fail.
    fn bad(d: &[u8]) {
        if d.len() > 8 && d[..4] == [0xe2, 0xd4, 0xc3, 0xd9] {
            panic!("boom");
        }
    }
    let prev = panic::take_hook();
    panic::set_hook(Box::new(|_| {}));
    let r = panic::catch_unwind(|| run_target("clc", bad, Duration::from_millis(100), 1));
    panic::set_hook(prev);
    assert!(r.is_err(), "a panicking target went unnoticed");
}
