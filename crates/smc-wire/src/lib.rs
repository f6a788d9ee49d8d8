//! # smc-wire — the SMC-R wire format, byte for byte
//!
//! Encoders and decoders for every message SMC-R puts on the wire, written to be
//! byte-identical with the Linux kernel's `net/smc` (the reference implementation a
//! peer must interoperate with):
//!
//! * [`tcpopt`] — the TCP experimental option (kind 254, ExID `0xE2D4C3D9`) that
//!   announces SMC capability on SYN and SYN-ACK (spec `protocol-clc.md` §2).
//! * [`clc`] — the CLC handshake on the TCP connection: Proposal, Accept, Confirm,
//!   Decline, in the SMC v1 (RFC 7609) and SMC v2 layouts (`protocol-clc.md` §3).
//! * [`llc`] — Link Layer Control messages sent as RDMA SENDs on a link
//!   (`protocol-llc-cdc.md` §1), v1 (44 bytes) and SMC-Rv2 (type byte `0x2_`,
//!   variable length).
//! * [`cdc`] — the 44-byte Connection Data Control message and the producer/consumer
//!   cursor arithmetic over an RMBE ring (`protocol-llc-cdc.md` §2–§3).
//! * [`types`] — shared field types: GIDs, MACs, system ids, 24-bit numbers, the
//!   compressed RMBE size, the IB MTU enum, EIDs, and GID derivation.
//!
//! ## Design
//!
//! No I/O, no allocation beyond the `Vec`s that variable-length messages need, no
//! `unsafe`. Every message has a validated *representation* (a plain struct) with
//! `decode(&[u8]) -> Result<_, WireError>` and `encode()`/`encode_into()`; raw bytes
//! are read through a bounds-checked [`buf::Reader`] so that malformed input from a
//! peer yields a typed [`WireError`] — never a panic and never an out-of-bounds read.
//! Reserved fields are written as zero and ignored on read, as Linux does; for every
//! well-formed message `encode(decode(bytes)) == bytes`.
//!
//! The fuzz entry points in [`fuzz`] are shared by the cargo-fuzz targets in `fuzz/`
//! and by the bounded stable-Rust fuzz test that CI runs.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic,
        clippy::unreachable,
        clippy::todo
    )
)]

pub mod buf;
pub mod cdc;
pub mod clc;
mod error;
pub mod fuzz;
pub mod llc;
pub mod tcpopt;
pub mod types;

pub use error::WireError;

/// Result type of every decoder in this crate.
pub type Result<T> = core::result::Result<T, WireError>;

/// Any message carried by an RDMA SEND on an SMC-R link: a CDC (type byte `0xFE`)
/// or an LLC message (`protocol-llc-cdc.md` §0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WrMessage {
    /// Connection Data Control.
    Cdc(cdc::CdcMessage),
    /// Link Layer Control.
    Llc(llc::LlcMessage),
}

impl WrMessage {
    /// Demultiplexes a received SEND payload by its first byte, as Linux's
    /// `smc_wr_rx_demultiplex` does, and decodes it.
    pub fn decode(buf: &[u8]) -> Result<WrMessage> {
        match buf.first() {
            Some(&cdc::CDC_TYPE) => cdc::CdcMessage::decode(buf).map(WrMessage::Cdc),
            Some(_) => llc::LlcMessage::decode(buf).map(WrMessage::Llc),
            None => Err(WireError::Truncated {
                what: "RDMA SEND payload",
                needed: 1,
                available: 0,
            }),
        }
    }

    /// The payload to SEND.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            WrMessage::Cdc(m) => m.encode().to_vec(),
            WrMessage::Llc(m) => m.encode(),
        }
    }
}
