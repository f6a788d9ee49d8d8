//! The conformance suite on the simulated fabric, plus sim-only tests
//! (determinism, fault injection).
use smc_rdma::conformance::*;
use smc_rdma::sim::SimFabric;
use smc_rdma::*;
use std::time::Duration;

struct SimHarness {
    fabric: SimFabric,
    local: Endpoint<SimFabric>,
    peer: LocalPeer<SimFabric>,
    remote: EndpointInfo,
}

fn make(params: &ConnParams) -> Result<SimHarness> {
    make_seeded(params, 42)
}

fn make_seeded(params: &ConnParams, seed: u64) -> Result<SimHarness> {
    let fabric = SimFabric::new(seed);
    fabric.set_latency(Duration::from_micros(3), Duration::from_micros(2));
    fabric.add_device("sim0", Some("veth-a"))?;
    fabric.add_device("sim1", Some("veth-b"))?;
    let local = Endpoint::open(&fabric, "sim0", *params)?;
    let mut peer = LocalPeer::new(Endpoint::open(&fabric, "sim1", *params)?);
    let remote = peer.ep.info();
    local.connect(&remote)?;
    peer.ep.connect(&local.info())?;
    let f = fabric.clone();
    peer.on_kill = Some(Box::new(move |_| f.set_unresponsive("sim1", true)));
    let f = fabric.clone();
    peer.on_hang = Some(Box::new(move |_| f.set_unresponsive("sim1", true)));
    Ok(SimHarness {
        fabric,
        local,
        peer,
        remote,
    })
}

impl Harness for SimHarness {
    type P = SimFabric;
    type Peer = LocalPeer<SimFabric>;
    fn local(&self) -> &Endpoint<SimFabric> {
        &self.local
    }
    fn peer(&mut self) -> &mut LocalPeer<SimFabric> {
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

smc_rdma::conformance_suite!(make);

fn scenario(seed: u64) -> Vec<String> {
    let mut h = make_seeded(&ConnParams::default(), seed).unwrap();
    for i in 0..4 {
        h.peer
            .post_recv(i, RECV_AREA + 64 * i as usize, 64)
            .unwrap();
    }
    let r = h.remote.mr;
    let sge = h.local.mr.sge(0, 1000).unwrap();
    for i in 0..4u64 {
        let wr = SendWr {
            wr_id: i,
            op: SendOp::RdmaWrite {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            payload: Payload::Sges(&[sge]),
            signaled: true,
        };
        h.local.qp.post_send(&wr).unwrap();
        let s = SendWr {
            wr_id: 10 + i,
            op: SendOp::SendWithImm(i as u32),
            payload: Payload::Inline(b"abc"),
            signaled: true,
        };
        h.local.qp.post_send(&s).unwrap();
    }
    assert!(h.fabric.run_until_idle(Duration::from_secs(1)));
    h.fabric.trace()
}

#[test]
fn sim_is_deterministic_for_a_seed() {
    let a = scenario(7);
    let b = scenario(7);
    let c = scenario(8);
    assert_eq!(a.len(), 12, "{a:#?}");
    assert_eq!(a, b);
    assert_ne!(a, c, "jitter should depend on the seed");
}

#[test]
fn sim_nothing_happens_without_time() {
    let h = make(&ConnParams::default()).unwrap();
    let s = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Inline(b"x"),
        signaled: true,
    };
    h.local.qp.post_send(&s).unwrap();
    assert!(h.local.poll_send().is_empty());
    h.fabric.advance(Duration::from_nanos(1));
    assert!(h.local.poll_send().is_empty());
}

#[test]
fn sim_injected_delay_postpones_completion() {
    let h = make(&ConnParams::default()).unwrap();
    h.fabric
        .set_latency(Duration::from_micros(10), Duration::ZERO);
    h.fabric
        .inject_delay("sim1", Duration::from_millis(5))
        .unwrap();
    let r = h.remote.mr;
    let sge = h.local.mr.sge(0, 8).unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        payload: Payload::Sges(&[sge]),
        signaled: true,
    };
    let t0 = h.fabric.now();
    h.local.qp.post_send(&wr).unwrap();
    h.fabric.advance(Duration::from_millis(4));
    assert!(
        h.local.poll_send().is_empty(),
        "completed despite injected delay"
    );
    h.fabric.advance(Duration::from_millis(20));
    let w = h.local.poll_send();
    assert_eq!(w.len(), 1);
    assert!(h.fabric.now().since(t0) >= Duration::from_millis(5));
}

#[test]
fn sim_fail_qp_raises_fatal_event_and_flushes() {
    let h = make(&ConnParams::default()).unwrap();
    let sge = h.local.mr.sge(RECV_AREA, 64).unwrap();
    h.local
        .qp
        .post_recv(&RecvWr {
            wr_id: 5,
            sges: &[sge],
        })
        .unwrap();
    h.fabric.fail_qp(h.local.qp.qp_num());
    assert_eq!(h.local.qp.state(), QpState::Err);
    assert_eq!(
        h.local.dev.poll_async_event(),
        Some(AsyncEvent::QpFatal {
            qp_num: h.local.qp.qp_num()
        })
    );
    let w = h.local.poll_recv();
    assert_eq!(w[0].status, WcStatus::WrFlushError);
}

#[test]
fn sim_unresponsive_peer_resumes_before_retries_run_out() {
    let h = make(&ConnParams::default()).unwrap();
    h.fabric.set_unresponsive("sim1", true).unwrap();
    let r = h.remote.mr;
    let sge = h.local.mr.sge(0, 8).unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        payload: Payload::Sges(&[sge]),
        signaled: true,
    };
    h.local.qp.post_send(&wr).unwrap();
    h.fabric.advance(Duration::from_millis(60)); // one timeout (50 ms) elapsed, retry_cnt 3
    h.fabric.set_unresponsive("sim1", false).unwrap();
    h.fabric.advance(Duration::from_millis(100));
    let w = h.local.poll_send();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].status, WcStatus::Success);
}

#[test]
fn sim_completion_channel_signals_armed_cq() {
    let h = make(&ConnParams::default()).unwrap();
    h.local.scq.req_notify().unwrap();
    let s = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: h.remote.mr.addr,
            rkey: h.remote.mr.rkey,
        },
        payload: Payload::Inline(b"x"),
        signaled: true,
    };
    h.local.qp.post_send(&s).unwrap();
    assert!(!h.local.chan.try_get_event().unwrap());
    h.fabric.advance(Duration::from_millis(1));
    assert!(h.local.chan.wait(Duration::from_millis(100)).unwrap());
    assert_eq!(h.local.poll_send().len(), 1);
}

#[test]
fn sim_device_enumeration() {
    let f = SimFabric::new(1);
    f.add_device("simA", Some("eth9")).unwrap();
    let d = f.devices().unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].name, "simA");
    let p = &d[0].ports[0];
    assert_eq!(p.state, PortState::Active);
    assert_eq!(p.netdev.as_deref(), Some("eth9"));
    assert_eq!(p.gids[0].gid_type, GidType::RoceV1);
    assert!(f.open_device("nope").is_err());
}

/// Memory windows reach what WRITEs reach and no further (the conformance
/// module's `memory_windows`, not one of the suite's cases: real RNICs lend
/// no windows).
#[test]
fn memory_windows_reach_what_writes_reach_and_no_further() {
    let mut h = make(&ConnParams::default()).unwrap();
    memory_windows(&mut h).unwrap();
}

/// `prepare_remote` readies what a WRITE reaches and refuses the rest (the
/// conformance module's `prepare_remote_checks`, not one of the suite's
/// cases: a real RNIC readies nothing).
#[test]
fn prepare_remote_readies_what_writes_reach_and_refuses_the_rest() {
    let mut h = make(&ConnParams::default()).unwrap();
    prepare_remote_checks(&mut h).unwrap();
}

/// Brings `ep`'s QP to RTS towards `(gid, qpn, psn)` with the source GID at
/// `sgid_index` of its port's table.
fn connect_via(ep: &Endpoint<SimFabric>, gid: Gid, qpn: u32, psn: u32, sgid_index: u16) {
    ep.qp
        .modify(&QpModify::Rtr {
            remote: RemoteQp { gid, qp_num: qpn },
            sgid_index,
            rq_psn: psn,
            path_mtu: Mtu::Mtu1024,
            min_rnr_timer: ep.params.min_rnr_timer,
        })
        .unwrap();
    ep.qp
        .modify(&QpModify::Rts {
            sq_psn: ep.psn,
            timeout: ep.params.timeout,
            retry_cnt: ep.params.retry_cnt,
            rnr_retry: ep.params.rnr_retry,
        })
        .unwrap();
}

/// A device built from its interface's addresses has the GID table a
/// kernel RoCE port has (rxe: link-local, then `::ffff:a.b.c.d`, RoCE v2
/// only), and its responders take a packet only from the GID they were
/// connected to, sent to the GID they connected with — as rxe's
/// `check_addr` drops the rest, so an end that announces one GID and sends
/// from another is never answered.
#[test]
fn sim_gid_tables_from_addresses_and_responders_check_addresses() {
    let f = SimFabric::new(3);
    let (ip_a, ip_b): (std::net::IpAddr, std::net::IpAddr) =
        ("10.99.0.1".parse().unwrap(), "10.99.0.2".parse().unwrap());
    f.add_device_with_addrs("rxeA", Some("ethA"), &[ip_a], false)
        .unwrap();
    f.add_device_with_addrs("rxeB", Some("ethB"), &[ip_b], false)
        .unwrap();
    f.add_device_with_addrs("mlxC", Some("ethC"), &[ip_a], true)
        .unwrap();
    let ports = |name: &str| f.open_device(name).unwrap().query_port(1).unwrap();
    let a = ports("rxeA");
    assert_eq!(a.gids.len(), 2);
    assert!(a.gids.iter().all(|g| g.gid_type == GidType::RoceV2));
    assert_eq!(a.gids[1].gid, Gid::from_ip(ip_a));
    assert_eq!(a.gids[1].index, 1);
    let c = ports("mlxC");
    let types: Vec<GidType> = c.gids.iter().map(|g| g.gid_type).collect();
    assert_eq!(
        types,
        [
            GidType::RoceV1,
            GidType::RoceV2,
            GidType::RoceV1,
            GidType::RoceV2
        ]
    );
    assert_eq!(c.gids[3].gid, Gid::from_ip(ip_a));

    let params = ConnParams {
        timeout: Duration::from_millis(1),
        retry_cnt: 1,
        ..ConnParams::default()
    };
    let (gid_a, gid_b) = (Gid::from_ip(ip_a), Gid::from_ip(ip_b));
    for (sgid_index_a, delivered) in [(1u16, true), (0u16, false)] {
        let x = Endpoint::open(&f, "rxeA", params).unwrap();
        let y = Endpoint::open(&f, "rxeB", params).unwrap();
        // y expects x at its IPv4 GID; x sends from index `sgid_index_a`
        connect_via(&y, gid_a, x.qp.qp_num(), x.psn, 1);
        connect_via(&x, gid_b, y.qp.qp_num(), y.psn, sgid_index_a);
        let sge = y.mr.sge(0, 64).unwrap();
        y.qp.post_recv(&RecvWr {
            wr_id: 1,
            sges: &[sge],
        })
        .unwrap();
        x.qp.post_send(&SendWr {
            wr_id: 2,
            op: SendOp::Send,
            payload: Payload::Inline(b"hello"),
            signaled: true,
        })
        .unwrap();
        f.advance(Duration::from_millis(20));
        let sent = x.poll_send();
        let got = y.poll_recv();
        assert_eq!(sent.len(), 1, "sgid index {sgid_index_a}");
        if delivered {
            assert_eq!(sent[0].status, WcStatus::Success);
            assert_eq!(got.len(), 1);
        } else {
            assert_eq!(sent[0].status, WcStatus::RetryExceeded);
            assert!(got.is_empty());
        }
    }
}
