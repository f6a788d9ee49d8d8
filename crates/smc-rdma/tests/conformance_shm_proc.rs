//! The conformance suite on `shm` with the passive side in a separate
//! process (the `smc-rdma-peer` binary), both in the root network namespace.
mod common;
fn make(p: &smc_rdma::conformance::ConnParams) -> smc_rdma::Result<common::Proc> {
    common::make_proc(p, common::Place::Here)
}
smc_rdma::conformance_suite!(make);
