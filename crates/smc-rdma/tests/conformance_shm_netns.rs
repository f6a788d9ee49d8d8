//! The conformance suite on `shm` with the passive side in a separate
//! process inside its own network namespace, joined to ours by a veth pair.
mod common;
fn make(p: &smc_rdma::conformance::ConnParams) -> smc_rdma::Result<common::Proc> {
    common::make_proc(p, common::Place::NetnsExec)
}
smc_rdma::conformance_suite!(make);
