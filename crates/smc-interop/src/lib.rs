//! # smc-interop — smc-rs against the Linux kernel's AF_SMC
//!
//! The Rust half of `scripts/vm/run-kernel-interop.sh`, which boots two qemu
//! VMs (Linux 6.12, Soft-RoCE) and runs smc-rs in one against the kernel's
//! `AF_SMC` in the other:
//!
//! * [`stream`] — the connection protocol both peer programs speak (the kernel
//!   side is `scripts/vm/interop/kpeer.c`): a 32-byte header, then a
//!   deterministic byte stream each way, so the host can compute the SHA-256
//!   each end must have received.
//! * [`pcap`] — classic pcap files, read and written.
//! * [`wire`] — every SMC message in a capture of the virtual wire (CLC on TCP,
//!   LLC and CDC in RoCE v2 SENDs), decoded with `smc-wire`.
//!
//! Binaries: `smc-iop-peer` (the smc-rs peer, run inside the VM) and
//! `smc-iop-pcap` (the host's view of a case's capture).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod pcap;
pub mod stream;
pub mod wire;
