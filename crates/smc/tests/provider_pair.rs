//! The provider conformance suite through `smc::provider::Pair`, the
//! dispatching provider the socket library runs on: the simulated fabric in
//! the shared-memory provider's place, and again in the verbs provider's
//! place, so that every call of every object is checked to reach the right
//! provider, with its outcome unchanged.

use smc::provider::Pair;
use smc_rdma::conformance::*;
use smc_rdma::sim::SimFabric;
use smc_rdma::*;
use std::time::Duration;

/// A decoy fabric with a device of the same name as the real one in the
/// other place: calls that went to the wrong provider would meet it.
fn decoy() -> SimFabric {
    let f = SimFabric::new(99);
    f.add_device("decoy", None).unwrap();
    f
}

struct PairHarness<const SHM: bool> {
    fabric: SimFabric,
    local: Endpoint<Pair<SimFabric, SimFabric>>,
    peer: LocalPeer<Pair<SimFabric, SimFabric>>,
    remote: EndpointInfo,
}

fn make<const SHM: bool>(params: &ConnParams) -> Result<PairHarness<SHM>> {
    let fabric = SimFabric::new(42);
    fabric.set_latency(Duration::from_micros(3), Duration::from_micros(2));
    fabric.add_device("sim0", Some("veth-a"))?;
    fabric.add_device("sim1", Some("veth-b"))?;
    let p = if SHM {
        Pair::new(Some(fabric.clone()), Some(decoy()))
    } else {
        Pair::new(Some(decoy()), Some(fabric.clone()))
    };
    let local = Endpoint::open(&p, "sim0", *params)?;
    let mut peer = LocalPeer::new(Endpoint::open(&p, "sim1", *params)?);
    let remote = peer.ep.info();
    local.connect(&remote)?;
    peer.ep.connect(&local.info())?;
    let f = fabric.clone();
    peer.on_kill = Some(Box::new(move |_| f.set_unresponsive("sim1", true)));
    let f = fabric.clone();
    peer.on_hang = Some(Box::new(move |_| f.set_unresponsive("sim1", true)));
    Ok(PairHarness {
        fabric,
        local,
        peer,
        remote,
    })
}

impl<const SHM: bool> Harness for PairHarness<SHM> {
    type P = Pair<SimFabric, SimFabric>;
    type Peer = LocalPeer<Pair<SimFabric, SimFabric>>;
    fn local(&self) -> &Endpoint<Self::P> {
        &self.local
    }
    fn peer(&mut self) -> &mut Self::Peer {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.remote
    }
    fn settle(&mut self) {
        self.fabric.advance(Duration::from_micros(100));
        self.peer.pump();
    }
    fn clock(&self) -> Duration {
        Duration::from_nanos(self.fabric.now().0)
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        self.fabric.set_port("sim0", up)
    }
}

mod in_the_shm_place {
    use super::*;
    fn make_shm(p: &ConnParams) -> Result<PairHarness<true>> {
        make::<true>(p)
    }
    smc_rdma::conformance_suite!(make_shm);

    #[test]
    fn memory_windows() {
        let mut h = make_shm(&ConnParams::default()).unwrap();
        smc_rdma::conformance::memory_windows(&mut h).unwrap();
    }

    #[test]
    fn prepare_remote() {
        let mut h = make_shm(&ConnParams::default()).unwrap();
        prepare_remote_checks(&mut h).unwrap();
    }
}

mod in_the_verbs_place {
    use super::*;
    fn make_verbs(p: &ConnParams) -> Result<PairHarness<false>> {
        make::<false>(p)
    }
    smc_rdma::conformance_suite!(make_verbs);

    #[test]
    fn memory_windows() {
        let mut h = make_verbs(&ConnParams::default()).unwrap();
        smc_rdma::conformance::memory_windows(&mut h).unwrap();
    }
}
