//! RDMA provider layer for smc-rs.
//!
//! * [`verbs`] — the provider-neutral, verbs-like API (devices, ports, GIDs,
//!   protection domains, memory regions, RC queue pairs, completion queues,
//!   completion channels, asynchronous events).
//! * [`sim`] — a deterministic in-process simulated fabric with a virtual
//!   clock and fault injection.
//! * [`shm`] — a shared-memory "RNIC" connecting processes of one host (also
//!   across network namespaces) through memfd-backed memory regions.
//! * [`conformance`] — one conformance suite, written once against the trait
//!   and run against every provider.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod conformance;
pub mod copy;
pub mod prf;
pub mod shm;
pub mod sim;
pub mod sys;
pub mod verbs;

pub use verbs::*;
