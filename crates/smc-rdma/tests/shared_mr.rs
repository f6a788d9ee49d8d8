//! One memory region registered on two devices (`ProtectionDomain::share_mr`,
//! what a link group with links on two devices needs for its RMBs), on the
//! simulation and on the shared-memory device (two devices bound to `lo`, no
//! root needed).
#[macro_use]
mod common;

use smc_rdma::conformance::shared_mr_two_devices;
use smc_rdma::shm::{ShmConfig, ShmDeviceConfig, ShmProvider};
use smc_rdma::sim::SimFabric;
use std::time::Duration;

#[test]
fn shared_mr_sim() {
    let f = SimFabric::new(7);
    for d in ["a0", "a1", "b0"] {
        f.add_device(d, None).unwrap();
    }
    let g = f.clone();
    let mut settle = move || {
        g.advance(Duration::from_micros(50));
    };
    shared_mr_two_devices(&f, "a0", "a1", "b0", &mut settle).unwrap();
}

#[test]
fn shared_mr_shm() {
    setup!(common::need_lo());
    let rundir = common::rundir();
    let cfg = ShmConfig {
        devices: ["shm0", "shm1"]
            .iter()
            .map(|n| ShmDeviceConfig {
                name: (*n).into(),
                netdev: "lo".into(),
            })
            .collect(),
        ..common::lo_config(&rundir)
    };
    let p = ShmProvider::new(cfg);
    let mut settle = || std::thread::sleep(Duration::from_micros(200));
    let r = shared_mr_two_devices(&p, "shm0", "shm1", "shm0", &mut settle);
    let _ = std::fs::remove_dir_all(&rundir);
    r.unwrap();
}
