//! Fuzz entry points, one per parser.
//!
//! Each function feeds arbitrary bytes to a decoder and, when decoding succeeds,
//! checks that re-encoding and decoding again yields the same message. A panic in
//! any of them is a bug. They are called by the cargo-fuzz targets in `fuzz/`
//! (coverage-guided, nightly) and by `tests/fuzz_bounded.rs` (random and mutated
//! corpus inputs for a bounded time on stable Rust, run by CI).

/// Signature shared by all entry points.
pub type Target = fn(&[u8]);

/// All entry points with the corpus directory name (`fuzz/corpus/<name>`).
pub const TARGETS: &[(&str, Target)] = &[("tcpopt", tcpopt)];

/// The TCP option-list and TCP-header recognisers.
pub fn tcpopt(data: &[u8]) {
    let found = crate::tcpopt::find_smc_option(data);
    // Appending a well-formed SMC option to a list that parsed cleanly and did not
    // end with End-of-List must make it found.
    if let Ok(false) = found {
        if !data.contains(&0) {
            let mut v = data.to_vec();
            crate::tcpopt::write_aligned(&mut v);
            assert_eq!(crate::tcpopt::find_smc_option(&v), Ok(true));
        }
    }
    let _ = crate::tcpopt::tcp_header_has_smc_option(data);
}
