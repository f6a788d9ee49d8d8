//! smc-rs RDMA provider on rdma-core's libibverbs, loaded at run time.
//!
//! * [`VerbsProvider`] implements [`smc_rdma::Provider`] on a real RNIC (or
//!   Soft-RoCE, `rdma_rxe`): device and GID enumeration (RoCE v1/v2 type and
//!   network interface from sysfs), PDs, MRs with access flags, RC QPs and
//!   their RESET→INIT→RTR→RTS transitions, SEND, RDMA WRITE (+ immediate),
//!   receives, CQ polling, the completion channel fd and async events.
//! * `libibverbs.so.1` is `dlopen`ed on first use ([`ffi`]): the build needs no
//!   C toolchain or rdma-core headers, and a binary on a machine without
//!   rdma-core starts and simply finds no devices
//!   ([`VerbsProvider::availability`] says why).
//! * [`remote`] runs `smc_rdma::conformance` with the passive side on another
//!   machine over TCP; [`bench`](mod@bench) measures WRITE bandwidth and SEND round trip.
//!   `scripts/vm/run-verbs-suite.sh` drives both across two qemu VMs.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod bench;
#[allow(missing_docs)]
pub mod ffi;
pub mod map;
pub mod provider;
pub mod remote;

pub use provider::{VerbsChannel, VerbsCq, VerbsDevice, VerbsMr, VerbsPd, VerbsProvider, VerbsQp};
