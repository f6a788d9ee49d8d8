//! The SMC rendezvous TCP option (`protocol-clc.md` §2).
//!
//! An RFC 6994 shared experimental option: kind 254, length 6, ExID `0xE2D4C3D9`
//! (EBCDIC "SMCR"). Linux writes it NOP-NOP aligned (`01 01 fe 06 e2 d4 c3 d9`) on
//! SYN and SYN-ACK only. On receive Linux accepts kind 254 with an even length of at
//! least 6 whose first four value bytes are the ExID, at any position.

/// TCP option kind of RFC 6994 experimental options.
pub const KIND_EXP: u8 = 254;
/// Length of the SMC option: kind + length + 4-byte ExID.
pub const LEN: u8 = 6;
/// The SMC ExID, big-endian on the wire.
pub const EXID: u32 = 0xE2D4_C3D9;
/// The option as Linux emits it, preceded by two NOPs for 4-byte alignment.
pub const ALIGNED: [u8; 8] = [0x01, 0x01, 0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9];

/// The 6 option bytes without padding.
pub fn option_bytes() -> [u8; 6] {
    let x = EXID.to_be_bytes();
    [KIND_EXP, LEN, x[0], x[1], x[2], x[3]]
}

/// Appends the NOP-NOP-aligned option to a TCP option list being built.
pub fn write_aligned(out: &mut Vec<u8>) {
    out.extend_from_slice(&ALIGNED);
}

/// Why an option list could not be walked to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionListError {
    /// An option's length byte is missing.
    MissingLength {
        /// Offset of the option's kind byte.
        at: usize,
    },
    /// An option's length is below 2 or runs past the end of the list.
    BadLength {
        /// Offset of the option's kind byte.
        at: usize,
        /// The length byte found.
        len: u8,
    },
}

impl core::fmt::Display for OptionListError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            OptionListError::MissingLength { at } => {
                write!(f, "TCP option at offset {at} has no length byte")
            }
            OptionListError::BadLength { at, len } => {
                write!(f, "TCP option at offset {at} has impossible length {len}")
            }
        }
    }
}

impl std::error::Error for OptionListError {}

/// True if one option (kind byte first, full option bytes) is the SMC option by
/// Linux's receive rule: kind 254, even length ≥ 6, ExID match (extra bytes ignored).
pub fn is_smc_option(opt: &[u8]) -> bool {
    match opt {
        [KIND_EXP, len, a, b, c, d, ..] => {
            let len = usize::from(*len);
            len >= usize::from(LEN)
                && len % 2 == 0
                && len <= opt.len()
                && u32::from_be_bytes([*a, *b, *c, *d]) == EXID
        }
        _ => false,
    }
}

/// Walks a TCP option list (the bytes after the 20-byte TCP header) and reports
/// whether it carries the SMC option. Stops at End-of-List; a malformed list is an
/// error (a peer that sends one gets no SMC, just as Linux's parser gives up).
pub fn find_smc_option(options: &[u8]) -> Result<bool, OptionListError> {
    let mut i = 0usize;
    while let Some(&kind) = options.get(i) {
        match kind {
            0 => return Ok(false), // End of option list
            1 => i += 1,           // NOP
            _ => {
                let len = *options
                    .get(i + 1)
                    .ok_or(OptionListError::MissingLength { at: i })?;
                let end = i + usize::from(len);
                if len < 2 || end > options.len() {
                    return Err(OptionListError::BadLength { at: i, len });
                }
                if is_smc_option(options.get(i..end).unwrap_or(&[])) {
                    return Ok(true);
                }
                i = end;
            }
        }
    }
    Ok(false)
}

/// Finds the SMC option in a whole TCP header (as returned e.g. by `TCP_SAVED_SYN`
/// after the IP header). Returns `Ok(false)` for a header too short to have options.
pub fn tcp_header_has_smc_option(tcp_header: &[u8]) -> Result<bool, OptionListError> {
    let Some(&off_byte) = tcp_header.get(12) else {
        return Ok(false);
    };
    let hdr_len = usize::from(off_byte >> 4) * 4;
    match tcp_header.get(20..hdr_len.min(tcp_header.len())) {
        Some(opts) => find_smc_option(opts),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn builder_matches_linux_bytes() {
        // protocol-clc.md §6.0
        assert_eq!(ALIGNED, [0x01, 0x01, 0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9]);
        assert_eq!(option_bytes(), [0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9]);
        let mut v = vec![2, 4, 5, 0xb4];
        write_aligned(&mut v);
        assert_eq!(find_smc_option(&v), Ok(true));
    }

    #[test]
    fn recognises_kernel_syn_options_from_capture() {
        // captures README §4.1: frame 1 (SYN) and frame 2 (SYN-ACK)
        for o in [
            "020405b40402080a3ab1b12400000000010303070101fe06e2d4c3d9",
            "020405b40402080abe3155a33ab1b124010303070101fe06e2d4c3d9",
        ] {
            assert_eq!(find_smc_option(&hex(o)), Ok(true));
        }
        // the same list without the option
        assert_eq!(
            find_smc_option(&hex("020405b40402080a3ab1b1240000000001030307")),
            Ok(false)
        );
    }

    #[test]
    fn bpf_layout_and_unaligned_positions() {
        // lab/REPORT.md: the BPF program puts the option last, then padding
        assert_eq!(find_smc_option(&hex("fe06e2d4c3d90101")), Ok(true));
        // any position, no NOPs
        assert_eq!(find_smc_option(&hex("01fe06e2d4c3d9")), Ok(true));
        // longer even length tolerated
        assert_eq!(find_smc_option(&hex("fe08e2d4c3d9aaaa")), Ok(true));
    }

    #[test]
    fn rejects_lookalikes() {
        // TCP Fast Open experimental option (ExID 0xF989)
        assert_eq!(find_smc_option(&hex("fe04f989")), Ok(false));
        // odd length
        assert_eq!(find_smc_option(&hex("fe07e2d4c3d900")), Ok(false));
        // wrong ExID
        assert_eq!(find_smc_option(&hex("fe06e2d4c3c4")), Ok(false));
        // after End-of-List nothing counts
        assert_eq!(find_smc_option(&hex("00fe06e2d4c3d9")), Ok(false));
        // malformed lists
        assert_eq!(
            find_smc_option(&hex("0201")),
            Err(OptionListError::BadLength { at: 0, len: 1 })
        );
        assert_eq!(
            find_smc_option(&hex("02")),
            Err(OptionListError::MissingLength { at: 0 })
        );
        assert_eq!(
            find_smc_option(&hex("fe06e2d4")),
            Err(OptionListError::BadLength { at: 0, len: 6 })
        );
    }

    #[test]
    fn whole_tcp_header() {
        let mut h = vec![0u8; 20];
        h[12] = (28 / 4) << 4; // data offset 7 words
        h.extend_from_slice(&ALIGNED);
        assert_eq!(tcp_header_has_smc_option(&h), Ok(true));
        h[12] = 5 << 4;
        assert_eq!(tcp_header_has_smc_option(&h), Ok(false));
        assert_eq!(tcp_header_has_smc_option(&[0; 5]), Ok(false));
    }
}
