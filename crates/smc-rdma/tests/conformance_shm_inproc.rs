//! The conformance suite on `shm` with both sides in this process
//! (two devices bound to the two ends of a veth pair).
mod common;
smc_rdma::conformance_suite!(common::make_inproc);
