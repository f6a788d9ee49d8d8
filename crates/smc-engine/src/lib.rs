//! # smc-engine — the SMC-R engine driven over an RDMA provider
//!
//! * [`endpoint`] — an SMC-R endpoint on one device: CLC handshakes (client and
//!   server, first contact and link-group reuse), link groups shared by up to
//!   255 connections, each connection's data path and close, keepalive, buffer
//!   pools. It owns the provider objects and carries out the decisions of the
//!   sans-I/O state machines in `smc-proto`. Generic over
//!   [`smc_rdma::Provider`]: the same code runs over the deterministic `sim`
//!   fabric and the cross-process `shm` device.
//!   A link group holds up to three links; connections are assigned to links,
//!   move between them, and survive the loss of one.
//! * [`state`] — the explicit life cycles: [`state::LgrState`] of a link group
//!   (a pure transition function with a reviewed golden table) and
//!   [`state::HandshakePhase`] of a connection's CLC handshake.
//! * [`simulate`] — the seeded deterministic simulation with fault injection
//!   (`smc-sim run` / `smc-sim replay`).
//!
//! Nothing here spawns threads or reads a clock: time and TCP bytes are passed in.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod endpoint;
pub mod simulate;
pub mod state;
