//! Issue 13, finding 4 (the provider's part): descriptors. What a connected
//! QP, a region and a connection cost is counted exactly (a connection — an
//! RMB, a send buffer and the peer's RMB readied with `prepare_remote` —
//! costs nothing of its own: the remote-access regions of a PD share a few
//! memfds, its arena's chunks, kept to hand them to the peer, so 255 RMBs of
//! one link group cost a handful of descriptors); and a process at its
//! descriptor limit keeps its existing QPs working (traffic, heartbeats),
//! refuses new work cleanly, and its device thread does not spin.
#[macro_use]
mod common;

use common::*;
use smc_rdma::conformance::*;
use smc_rdma::shm::ShmProvider;
use smc_rdma::sys::SeqPacket;
use smc_rdma::*;
use std::time::{Duration, Instant};

/// The tests of this file count descriptors: they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn fds() -> usize {
    settled_proc_stats(std::process::id()).unwrap().fds
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write_wr(sge: &Sge, r: RemoteMr, wr_id: u64) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        payload: Payload::Sges(std::slice::from_ref(sge)),
        signaled: true,
    }
}

fn complete(ep: &Endpoint<ShmProvider>) -> WorkCompletion {
    let mut w = vec![];
    wait_for("a send completion", || {
        w.extend(ep.poll_send());
        !w.is_empty()
    });
    w[0]
}

fn parse_mr(s: &str) -> RemoteMr {
    let v: Vec<u64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    RemoteMr {
        addr: v[0],
        rkey: v[1] as u32,
        len: v[2],
    }
}

/// Exact descriptor costs, in the process that owns them (the peer is
/// another process): a device instance 5, a channel 1, CQs and PDs 0, the
/// first remote-access region of a PD 1 (its arena's first chunk), more
/// regions of that PD 0 while they fit (chunks grow geometrically, so 266
/// regions of 64 KiB take 2), a local-only region 0, a connected QP 3 (the
/// socket it dialed, the socket its peer dialed, the peer's completion
/// channel), a readied or written peer region 0 — so a connection (RMB +
/// send buffer + the peer's RMB readied) costs nothing of its own. Every
/// region is a slice of its chunk: what the peer writes into one lands
/// there and nowhere else.
#[test]
fn finding4_descriptor_budget_per_qp_region_and_connection() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let (mut peer, _cfg) = spawn_lo_peer(&dir, &ConnParams::default()).unwrap();
    let p = ShmProvider::new(lo_config(&dir));
    let before_dev = fds();
    let dev = p.open_device("shm0").unwrap();
    assert_eq!(
        fds(),
        before_dev + 6,
        "a device instance: listener, wake-up, async events, interface probe, link notifications, reserve"
    );
    let chan = dev.create_channel().unwrap();
    assert_eq!(fds(), before_dev + 7, "a completion channel");
    let scq = dev.create_cq(64, Some(&chan)).unwrap();
    let rcq = dev.create_cq(64, Some(&chan)).unwrap();
    let pd = dev.alloc_pd().unwrap();
    assert_eq!(fds(), before_dev + 7, "CQs and PDs keep no descriptor");

    let n0 = fds();
    let rmb = pd
        .alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    assert_eq!(fds(), n0 + 1, "a PD's first remote-access region");
    let sndbuf = pd.alloc_mr(65536, Access::LOCAL_WRITE).unwrap();
    assert_eq!(fds(), n0 + 1, "a local-only region keeps no descriptor");

    let n1 = fds();
    let qp = pd.create_qp(&scq, &rcq, QpCap::default()).unwrap();
    qp.modify(&QpModify::Init {
        port: 1,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    })
    .unwrap();
    assert_eq!(fds(), n1 + 1, "a QP before it connects: its ring's memfd");
    let mut r = [0u8; 4];
    smc_rdma::sys::random_bytes(&mut r).unwrap();
    let psn = u32::from_le_bytes(r) & 0xff_ffff;
    let me = EndpointInfo {
        gid: dev.query_port(1).unwrap().gids[0].gid,
        qp_num: qp.qp_num(),
        psn,
        mr: rmb.remote(),
        ro_mr: sndbuf.remote(),
    };
    peer.cmd(&format!("connect {}", me.to_line())).unwrap();
    let pi = peer.info;
    qp.modify(&QpModify::Rtr {
        remote: RemoteQp {
            gid: pi.gid,
            qp_num: pi.qp_num,
        },
        sgid_index: 0,
        rq_psn: pi.psn,
        path_mtu: Mtu::Mtu1024,
        min_rnr_timer: Duration::from_millis(1),
    })
    .unwrap();
    qp.modify(&QpModify::Rts {
        sq_psn: psn,
        timeout: Duration::from_millis(50),
        retry_cnt: 3,
        rnr_retry: 7,
    })
    .unwrap();
    assert_eq!(
        fds(),
        n1 + 3,
        "a connected QP: two sockets and the peer's channel"
    );

    // The peer's RMB readied and written, ours written by the peer: nothing more.
    qp.prepare_remote(pi.mr.rkey, pi.mr.addr, 4096).unwrap();
    assert_eq!(fds(), n1 + 3, "a readied peer region keeps no descriptor");
    sndbuf.write_at(0, &pattern(1, 4096)).unwrap();
    let sge = sndbuf.sge(0, 4096).unwrap();
    qp.post_send(&write_wr(&sge, pi.mr, 1)).unwrap();
    let mut w = vec![];
    wait_for("write", || {
        w.extend(poll_all(&scq));
        !w.is_empty()
    });
    assert_eq!(w[0].status, WcStatus::Success);
    let st = peer
        .cmd(&format!("write {} {} 4096 2", me.mr.rkey, me.mr.addr))
        .unwrap();
    assert_eq!(st, "Success");
    // A region written without being readied first is mapped on demand, and
    // keeps no descriptor either.
    let other = parse_mr(&peer.cmd("newmr 8192").unwrap());
    qp.post_send(&write_wr(&sge, RemoteMr { len: 4096, ..other }, 2))
        .unwrap();
    let mut w = vec![];
    wait_for("write", || {
        w.extend(poll_all(&scq));
        !w.is_empty()
    });
    assert_eq!(w[0].status, WcStatus::Success);
    assert_eq!(fds(), n1 + 3);

    // Ten more connections on this QP: nothing more.
    let n2 = fds();
    let mut conns = vec![];
    for i in 0..10 {
        let rmb = pd
            .alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let snd = pd.alloc_mr(65536, Access::LOCAL_WRITE).unwrap();
        let theirs = parse_mr(&peer.cmd("newmr 65536").unwrap());
        qp.prepare_remote(theirs.rkey, theirs.addr, 65536).unwrap();
        let r = rmb.remote();
        let st = peer
            .cmd(&format!("write {} {} 4096 {}", r.rkey, r.addr, 10 + i))
            .unwrap();
        assert_eq!(st, "Success");
        conns.push((rmb, snd, theirs));
    }
    assert_eq!(
        fds(),
        n2,
        "connections of one PD share its arena's descriptor"
    );
    for (i, (rmb, _, _)) in conns.iter().enumerate() {
        let mut b = vec![0u8; 4096];
        rmb.read_at(0, &mut b).unwrap();
        assert_eq!(b, pattern(10 + i as u64, 4096), "connection {i}'s RMB");
    }

    // A link group's worth of RMBs (255, with the 11 above: 266 × 68 KiB
    // in chunks of 8 and 16 MiB) costs one more descriptor. The peer writes
    // the last 4 KiB of each: it lands in that region, and its neighbours
    // keep their bytes.
    let many: Vec<_> = (0..255)
        .map(|_| {
            pd.alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap()
        })
        .collect();
    let n3 = fds();
    assert_eq!(n3, n2 + 1, "255 regions of one PD: a second chunk");
    for (i, m) in many.iter().enumerate().step_by(17) {
        let r = m.remote();
        let st = peer
            .cmd(&format!(
                "write {} {} 4096 {}",
                r.rkey,
                r.addr + 65536 - 4096,
                100 + i
            ))
            .unwrap();
        assert_eq!(st, "Success", "region {i}");
    }
    for (i, m) in many.iter().enumerate() {
        let mut b = vec![0u8; 65536];
        m.read_at(0, &mut b).unwrap();
        let written = i % 17 == 0;
        assert!(
            b[..65536 - 4096].iter().all(|x| *x == 0),
            "region {i} was written outside what its peer wrote"
        );
        if written {
            assert_eq!(
                b[65536 - 4096..],
                pattern(100 + i as u64, 4096)[..],
                "region {i}"
            );
        } else {
            assert!(b[65536 - 4096..].iter().all(|x| *x == 0), "region {i}");
        }
    }
    assert_eq!(fds(), n3, "the peer's writes cost nothing here");
    // Another PD never shares a chunk: its first remote region costs one.
    let pd2 = dev.alloc_pd().unwrap();
    let other = pd2
        .alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    assert_eq!(fds(), n3 + 1, "another PD's region: a chunk of its own");
    drop((other, pd2));
    assert_eq!(fds(), n3, "a chunk closes with its last region");
    // Regions that go give their chunk back once it is empty.
    drop(many);
    drop(conns);
    assert_eq!(fds(), n2, "the second chunk closes with its last region");
    assert_eq!(qp.state(), QpState::Rts);
    drop((qp, rmb, sndbuf, scq, rcq, chan, pd, dev, peer));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer process S runs out of descriptors while its QP is connected to
/// ours and busy. Existing work goes on: data both ways (also into a region
/// of S we never wrote before, and from S into one of ours S readied
/// before), heartbeats (no failure for several peer timeouts); new work
/// that needs a descriptor fails cleanly: S cannot create a QP, a region
/// its PD's arena has no room for, and a QP dialing S is refused at once (a
/// region that fits its PD's arena needs no descriptor, and is registered;
/// so is a new connection's peer region readied, see below). S's device thread does not spin
/// on the connection it cannot accept.
#[test]
fn finding4_at_the_descriptor_limit_only_new_work_fails() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let params = ConnParams::default();
    let (mut s, cfg) = spawn_lo_peer(&dir, &params).unwrap();
    let p = ShmProvider::new(lo_config(&dir));
    let c = Endpoint::open(&p, "shm0", params).unwrap();
    s.cmd(&format!("connect {}", c.info().to_line())).unwrap();
    c.connect(&s.info).unwrap();
    let si = s.info;
    // Before the limit: S registers a region C has not used yet, and a spare
    // QP; C registers a second RMB for a connection S will try to set up at
    // its limit; S readies C's first RMB (the connection that exists).
    let s_r2 = parse_mr(&s.cmd("newmr 65536").unwrap());
    let spare_qpn: u32 = s.cmd("newqp").unwrap().parse().unwrap();
    let c_r2 =
        c.pd.alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let cm = c.mr.remote();
    s.cmd(&format!("prepare {} {} 4096", cm.rkey, cm.addr))
        .unwrap();
    let s_pid = s.child.id();

    let traffic = |s: &mut ProcPeer, seed: u64| {
        // C → S: a WRITE and a SEND
        s.post_recv(seed, RECV_AREA, 64).unwrap();
        c.mr.write_at(0, &pattern(seed, 4096)).unwrap();
        let sge = c.mr.sge(0, 4096).unwrap();
        c.qp.post_send(&write_wr(&sge, si.mr, seed)).unwrap();
        assert_eq!(complete(&c).status, WcStatus::Success, "C's WRITE");
        c.qp.post_send(&SendWr {
            wr_id: seed + 1,
            op: SendOp::Send,
            payload: Payload::Inline(&seed.to_le_bytes()),
            signaled: true,
        })
        .unwrap();
        assert_eq!(complete(&c).status, WcStatus::Success, "C's SEND");
        let mut got = vec![];
        wait_for("S's receive", || {
            got.extend(s.completions().unwrap());
            !got.is_empty()
        });
        assert_eq!(got[0].wc.status, WcStatus::Success);
        assert_eq!(s.read(0, 4096).unwrap(), pattern(seed, 4096));
        // S → C into the readied RMB
        let st = s
            .cmd(&format!("write {} {} 4096 {}", cm.rkey, cm.addr, seed + 2))
            .unwrap();
        assert_eq!(st, "Success", "S's WRITE");
        let mut back = vec![0u8; 4096];
        c.mr.read_at(0, &mut back).unwrap();
        assert_eq!(back, pattern(seed + 2, 4096));
    };
    traffic(&mut s, 100);
    // S's CPU while idle and connected, as the reference.
    let cpu = || proc_stats(s_pid).unwrap().cpu_ticks;
    let t0 = cpu();
    std::thread::sleep(Duration::from_millis(1500));
    let idle = cpu() - t0;

    let taken: usize = s.cmd("exhaust").unwrap().parse().unwrap();
    assert!(taken > 0);
    // Connections S cannot accept wait in its listener's backlog (a few: if
    // a descriptor was free after all, the first ones take it).
    let s_sock = std::fs::read_link(dir.join(format!("qpn-{:06x}", si.qp_num))).unwrap();
    let _stuck: Vec<SeqPacket> = (0..4)
        .map(|_| SeqPacket::connect(&s_sock).unwrap())
        .collect();
    let t0 = cpu();
    std::thread::sleep(Duration::from_millis(1500));
    let at_limit = cpu() - t0;
    assert!(
        at_limit <= 2 * idle + 30,
        "S spins at its descriptor limit: {at_limit} ticks in 1.5 s (idle: {idle})"
    );

    // New work fails cleanly.
    let r = s.cmd("newqp");
    assert!(r.is_err(), "a QP was created without descriptors: {r:?}");
    let r = s.cmd("newmr 4096");
    assert!(r.is_ok(), "a region that fits its PD's arena: {r:?}");
    let r = s.cmd(&format!("newmr {}", 64 << 20));
    assert!(
        r.is_err(),
        "a region that needs a new chunk was registered without descriptors: {r:?}"
    );
    // A new connection's region is readied all the same, in the number of
    // S's reserve descriptor (the memfd is held only until it is mapped, and
    // the reserve is made again after): a server learns a client's RMB only
    // from its Confirm, when the connection can no longer fall back. And so
    // is the next one.
    let c2 = c_r2.remote();
    let r = s.cmd(&format!("prepare {} {} 4096", c2.rkey, c2.addr));
    assert!(r.is_ok(), "a new connection's region at the limit: {r:?}");
    let c_r3 =
        c.pd.alloc_mr(65536, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let c3 = c_r3.remote();
    let r = s.cmd(&format!("prepare {} {} 4096", c3.rkey, c3.addr));
    assert!(r.is_ok(), "the next one, at the limit: {r:?}");
    let st = s
        .cmd(&format!("write {} {} 4096 77", c3.rkey, c3.addr))
        .unwrap();
    assert_eq!(
        st, "Success",
        "S's WRITE into the region readied at its limit"
    );
    let mut back = vec![0u8; 4096];
    c_r3.read_at(0, &mut back).unwrap();
    assert_eq!(back, pattern(77, 4096));
    // A QP of ours dialing S's spare QP is refused, and soon.
    let dialer = c.pd.create_qp(&c.scq, &c.rcq, QpCap::default()).unwrap();
    dialer
        .modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        })
        .unwrap();
    let t = Instant::now();
    let r = dialer.modify(&QpModify::Rtr {
        remote: RemoteQp {
            gid: si.gid,
            qp_num: spare_qpn,
        },
        sgid_index: 0,
        rq_psn: 1,
        path_mtu: Mtu::Mtu1024,
        min_rnr_timer: Duration::from_millis(1),
    });
    assert!(matches!(r, Err(Error::Connect(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // Existing work goes on, for several peer timeouts (heartbeats).
    let w = {
        let sge = c.mr.sge(0, 4096).unwrap();
        c.mr.write_at(0, &pattern(7, 4096)).unwrap();
        c.qp.post_send(&write_wr(&sge, RemoteMr { len: 4096, ..s_r2 }, 7))
            .unwrap();
        complete(&c)
    };
    assert_eq!(
        w.status,
        WcStatus::Success,
        "a region of S not written before"
    );
    let until = Instant::now() + Duration::from_millis(1600); // > 3 peer timeouts
    let mut seed = 200;
    while Instant::now() < until {
        traffic(&mut s, seed);
        seed += 10;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.qp.state(), QpState::Rts);
    assert_eq!(s.qp_state().unwrap(), QpState::Rts);
    assert_eq!(c.dev.poll_async_event(), None, "C saw an error");

    // With descriptors again, S takes new work again.
    s.cmd("release").unwrap();
    s.cmd("newqp").unwrap();
    s.cmd(&format!("prepare {} {} 4096", c2.rkey, c2.addr))
        .unwrap();
    traffic(&mut s, 1000);
    drop((dialer, c_r2, c_r3, c, s, cfg));
    let _ = std::fs::remove_dir_all(&dir);
}
