//! Initial PSNs are random per link (Linux `smcr_link_init` draws 24 random
//! bits), not a function of anything the peer or a bystander can see such as
//! the QP number: the shm device is to check them at its QP rendezvous.

mod common;

use common::*;
use smc_engine::endpoint::Endpoint;
use smc_rdma::sim::SimFabric;
use smc_wire::clc::ClcMessage;

/// (QPN, PSN) of the server's first Accept in a fresh world over a fabric
/// seeded with `fabric_seed`; `psn_seed` keys the server's PSN generator
/// (`None`: the operating system).
fn accept_qpn_psn(fabric_seed: u64, psn_seed: Option<u64>) -> (u32, u32) {
    let fabric = SimFabric::new(fabric_seed);
    let ccfg = simple_config("simC", 0x1111, 1);
    let scfg = simple_config("simS", 0x2222, 2);
    add_device_for(&fabric, &ccfg);
    add_device_for(&fabric, &scfg);
    let mut client = Endpoint::new(&fabric, ccfg).unwrap();
    let mut server = match psn_seed {
        Some(s) => Endpoint::new_seeded(&fabric, scfg, s).unwrap(),
        None => Endpoint::new(&fabric, scfg).unwrap(),
    };
    let now = std::time::Duration::ZERO;
    let s = server.accept(std::net::IpAddr::from([10, 99, 0, 2]), now);
    let c = client.connect(std::net::IpAddr::from([10, 99, 0, 1]), now);
    let p = client.clc_output(c);
    server.clc_input(s, &p, now);
    match ClcMessage::decode(&server.clc_output(s)).unwrap() {
        ClcMessage::Accept(a) => (a.qpn, a.psn),
        m => panic!("{m:?}"),
    }
}

#[test]
fn the_same_qp_number_gets_unrelated_psns() {
    let runs: Vec<(u32, u32)> = (0..8).map(|_| accept_qpn_psn(11, None)).collect();
    let qpn = runs[0].0;
    assert!(
        runs.iter().all(|r| r.0 == qpn),
        "same fabric, same QP number"
    );
    let psns: std::collections::HashSet<u32> = runs.iter().map(|r| r.1).collect();
    assert!(psns.len() >= 7, "PSNs repeat for QP {qpn}: {runs:?}");
    assert!(runs.iter().all(|r| r.1 <= 0xff_ffff));
    // keyed from a seed they replay (the simulation)
    assert_eq!(accept_qpn_psn(11, Some(3)), accept_qpn_psn(11, Some(3)));
    assert_ne!(accept_qpn_psn(11, Some(3)).1, accept_qpn_psn(11, Some(4)).1);
}
