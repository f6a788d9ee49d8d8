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
pub const TARGETS: &[(&str, Target)] = &[
    ("clc", clc),
    ("llc", llc),
    ("cdc", cdc),
    ("wr", wr),
    ("tcpopt", tcpopt),
];

/// CLC messages (Proposal, Accept, Confirm, Decline), and the header peek a
/// stream reader uses first.
pub fn clc(data: &[u8]) {
    let _ = crate::clc::ClcHeader::peek(data);
    crate::clc::fuzz_one(data);
}

/// LLC messages (v1 and SMC-Rv2).
pub fn llc(data: &[u8]) {
    crate::llc::fuzz_one(data);
}

/// CDC messages.
pub fn cdc(data: &[u8]) {
    crate::cdc::fuzz_one(data);
}

/// Any RDMA SEND payload, demultiplexed by its type byte.
pub fn wr(data: &[u8]) {
    if let Ok(m) = crate::WrMessage::decode(data) {
        let bytes = m.encode();
        let again = crate::WrMessage::decode(&bytes);
        assert!(again.is_ok(), "re-encoded {m:?} does not decode: {again:?}");
    }
}

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
