//! The conformance suite on `shm` with the passive side in a separate
//! process that entered the veth's network namespace with `nsenter --net`
//! only: it keeps our mount namespace, so its /sys/class/net lists our
//! interfaces, not its own, and the provider must ask its own namespace.
mod common;
fn make(p: &smc_rdma::conformance::ConnParams) -> smc_rdma::Result<common::Proc> {
    common::make_proc(p, common::Place::NetnsSetns)
}
smc_rdma::conformance_suite!(make);
