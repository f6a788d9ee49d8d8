#![no_main]
// Coverage-guided fuzzing of the cdc parser; the same entry point runs under the
// bounded stable-Rust fuzz test in crates/smc-wire/tests/fuzz_bounded.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| smc_wire::fuzz::cdc(data));
