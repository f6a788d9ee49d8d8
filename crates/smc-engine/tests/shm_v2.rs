//! SMC-R v2 over the shm device with the GIDs chosen as Linux chooses them:
//! the device reports a RoCE v2 GID per address of its interface (here `lo`:
//! `::ffff:127.0.0.1`), a v2 connection from 127.0.0.1 announces that GID
//! and its QPs send from its table index, and the device — which checks at
//! its QP rendezvous that the peer's source GID is the one the CLC exchange
//! announced — brings the link up. Two endpoints of this process on one
//! device, in real time.

use smc_engine::endpoint::{ConnStatus, Endpoint, EndpointConfig};
use smc_proto::negotiate::IfAddr;
use smc_rdma::shm::{ShmConfig, ShmDeviceConfig, ShmProvider};
use smc_wire::clc::{ClcMessage, SmcPath};
use smc_wire::types::{Eid, Gid, Mac, SystemId};
use std::net::IpAddr;
use std::time::{Duration, Instant};

fn cfg(inst: u16) -> EndpointConfig {
    EndpointConfig {
        system_id: SystemId::new(inst, Mac([2, 0, 0, 0, 0, 1])),
        device: "shm0".into(),
        ueids: vec![Eid::parse_ueid("SMC-TEST-UEID").unwrap()],
        offer_v1: false,
        offer_v2: true,
        if_addrs: vec![IfAddr {
            addr: IpAddr::from([127, 0, 0, 1]),
            prefix_len: 8,
        }],
        rmb_len: 65536,
        rmb_crowding: None,
        sndbuf_len: 65536,
        testlink: None,
        max_conns: 255,
        hostname: "shm".into(),
        lgr_idle_timeout: Duration::from_secs(600),
    }
}

#[test]
fn smc_r_v2_over_shm_uses_the_ipv4_mapped_gid() {
    let rundir = std::env::temp_dir().join(format!("smc-engine-shm-v2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rundir);
    std::fs::create_dir_all(&rundir).unwrap();
    let p = ShmProvider::new(ShmConfig {
        devices: vec![ShmDeviceConfig {
            name: "shm0".into(),
            netdev: "lo".into(),
        }],
        rundir: rundir.clone(),
        ..ShmConfig::default()
    });
    let mut client = Endpoint::new(&p, cfg(0x1111)).unwrap();
    let mut server = Endpoint::new(&p, cfg(0x2222)).unwrap();
    let lo = IpAddr::from([127, 0, 0, 1]);
    let start = Instant::now();
    let s = server.accept(lo, start.elapsed());
    let c = client.connect(lo, start.elapsed());
    let proposal = client.clc_output(c);
    let Ok(ClcMessage::Proposal(p0)) = ClcMessage::decode(&proposal) else {
        panic!("a Proposal")
    };
    assert_eq!((p0.typev1, p0.typev2), (SmcPath::N, SmcPath::R));
    assert_eq!(p0.v2_ext.unwrap().roce_v2_gid, Gid::from_ip(lo));
    let (mut c2s, mut s2c) = (proposal, Vec::new());
    while start.elapsed() < Duration::from_secs(10) {
        let now = start.elapsed();
        let n = server.clc_input(s, &c2s, now);
        c2s.drain(..n);
        let n = client.clc_input(c, &s2c, now);
        s2c.drain(..n);
        client.pump(now).unwrap();
        server.pump(now).unwrap();
        c2s.extend(client.clc_output(c));
        s2c.extend(server.clc_output(s));
        if client.status(c) == Some(ConnStatus::Smc) && server.status(s) == Some(ConnStatus::Smc) {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(client.status(c), Some(ConnStatus::Smc));
    assert_eq!(server.status(s), Some(ConnStatus::Smc));
    assert_eq!(client.write(c, b"over ::ffff:127.0.0.1"), Ok(21));
    let mut got = Vec::new();
    while got.len() < 21 && start.elapsed() < Duration::from_secs(10) {
        let now = start.elapsed();
        client.pump(now).unwrap();
        server.pump(now).unwrap();
        got.extend(server.read(s, 64).unwrap());
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(got, b"over ::ffff:127.0.0.1");
    drop((client, server));
    let _ = std::fs::remove_dir_all(&rundir);
}
