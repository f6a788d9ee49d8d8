//! # smc-proto — the SMC-R protocol engine, sans I/O
//!
//! Plain data and state machines: no threads, no syscalls, no `unsafe`, time passed
//! in by the caller. The driver (the `smc` socket library, or the deterministic
//! simulation in tests) feeds inputs through `handle_*` methods and carries out the
//! outputs it drains with `poll_*` methods.
//!
//! Modules and the spec sections they implement:
//! * [`clc_stream`] — CLC messages out of the TCP byte stream, and whether a failed
//!   handshake falls back or fails (`protocol-clc.md` §3.1, §4.1).
//! * [`close`] — the connection close state machine (`protocol-llc-cdc.md` §5).
//! * [`datapath`] — CDC cursors, RDMA WRITE planning and consumer updates of one
//!   connection (`protocol-llc-cdc.md` §2–§3).
//! * [`link`] — links and link groups: CONFIRM_LINK, LLC requests and responses,
//!   rkey flows, TEST_LINK keepalive, DELETE_LINK (`protocol-llc-cdc.md` §1, §6).
//! * [`negotiate`] — CLC decisions: the client's Proposal, the server's choice or
//!   Decline code, the client's Accept checks (`protocol-clc.md` §3.2, §4.2–§4.4).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Time as the engine sees it: a monotonic duration since an origin the driver
/// chooses (process start for the socket library, zero for the simulation).
pub type Timestamp = std::time::Duration;

pub mod clc_stream;
pub mod close;
pub mod datapath;
pub mod link;
pub mod negotiate;
