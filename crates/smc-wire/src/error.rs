use core::fmt;

/// Why a byte sequence is not a valid SMC message.
///
/// Every decoder returns one of these for malformed input; none of them panics.
/// The variants carry enough context to log a useful diagnostic about a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// The buffer ends before a field that must be there.
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed from the start of the message.
        needed: usize,
        /// Bytes available.
        available: usize,
    },
    /// The leading eyecatcher is neither `SMCR` nor `SMCD` (EBCDIC).
    BadEyecatcher([u8; 4]),
    /// The trailing eyecatcher is neither `SMCR` nor `SMCD` (EBCDIC).
    BadTrailer([u8; 4]),
    /// A length field disagrees with the buffer or with the layout it announces.
    BadLength {
        /// Which message or field.
        what: &'static str,
        /// The length the message claims (or implies).
        claimed: usize,
        /// The length that the buffer or the layout says it must be.
        expected: usize,
    },
    /// A message type byte that this protocol does not define.
    UnknownType {
        /// Which message family (CLC, LLC, ...).
        family: &'static str,
        /// The type byte found.
        value: u8,
    },
    /// A version this codec does not speak (e.g. CLC header version 0).
    BadVersion(u8),
    /// A field holds a value the protocol forbids (e.g. a prefix length of 200).
    InvalidField {
        /// The field.
        field: &'static str,
        /// The offending value.
        value: u64,
    },
    /// Well formed, but a variant this implementation does not handle
    /// (e.g. an SMC-D Accept/Confirm, which an SMC-R-only peer never asks for).
    Unsupported(&'static str),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated {
                what,
                needed,
                available,
            } => write!(f, "truncated {what}: need {needed} bytes, have {available}"),
            WireError::BadEyecatcher(e) => write!(f, "bad eyecatcher {:02x?}", e),
            WireError::BadTrailer(e) => write!(f, "bad trailer eyecatcher {:02x?}", e),
            WireError::BadLength {
                what,
                claimed,
                expected,
            } => write!(f, "bad length of {what}: {claimed}, expected {expected}"),
            WireError::UnknownType { family, value } => {
                write!(f, "unknown {family} message type 0x{value:02x}")
            }
            WireError::BadVersion(v) => write!(f, "unsupported SMC version {v}"),
            WireError::InvalidField { field, value } => {
                write!(f, "invalid value {value:#x} in field {field}")
            }
            WireError::Unsupported(what) => write!(f, "unsupported: {what}"),
        }
    }
}

impl std::error::Error for WireError {}
