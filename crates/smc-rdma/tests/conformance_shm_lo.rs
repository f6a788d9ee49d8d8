//! The conformance suite on `shm` with both sides in this process as two
//! instances of one device bound to `lo`: same GIDs, told apart only by QP
//! number (two users of one RNIC port). No root needed.
mod common;
smc_rdma::conformance_suite!(common::make_lo_inproc);
