//! The conformance suite on `shm` with the passive side in a separate
//! process, both processes bound to `lo` (same GIDs, distinct QP numbers):
//! the main smc-rs case of two ordinary processes talking over loopback.
mod common;
smc_rdma::conformance_suite!(common::make_lo_proc);
