//! Issue 13, finding 3: mapped peer buffers must not outlive the QP, the
//! link and the peer. Many short-lived peer processes connect, write both
//! ways and exit: the server's descriptors, memfds, mappings and resident
//! memory return to their baseline. A QP whose peer died lets go of what it
//! held of that peer at once, and a QP destroyed normally as well.
#[macro_use]
mod common;

use common::*;
use smc_rdma::conformance::*;
use smc_rdma::shm::{ShmChannel, ShmCq, ShmMr, ShmProvider, ShmQp};
use smc_rdma::*;
use std::time::{Duration, Instant};

/// The tests of this file count the process's descriptors and mappings:
/// they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const REGION: usize = 1 << 20;

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Our side of one client: a QP and a 1 MiB region in the server's PD.
struct ServerSide {
    qp: ShmQp,
    mr: ShmMr,
    scq: ShmCq,
    rcq: ShmCq,
    psn: u32,
}

fn server_side(
    dev: &smc_rdma::shm::ShmDevice,
    pd: &smc_rdma::shm::ShmPd,
    chan: &ShmChannel,
) -> ServerSide {
    let scq = dev.create_cq(64, Some(chan)).unwrap();
    let rcq = dev.create_cq(64, Some(chan)).unwrap();
    let mr = pd
        .alloc_mr(REGION, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let qp = pd.create_qp(&scq, &rcq, QpCap::default()).unwrap();
    qp.modify(&QpModify::Init {
        port: 1,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    })
    .unwrap();
    let mut r = [0u8; 4];
    smc_rdma::sys::random_bytes(&mut r).unwrap();
    ServerSide {
        qp,
        mr,
        scq,
        rcq,
        psn: u32::from_le_bytes(r) & 0xff_ffff,
    }
}

impl ServerSide {
    fn info(&self, gid: Gid) -> EndpointInfo {
        EndpointInfo {
            gid,
            qp_num: self.qp.qp_num(),
            psn: self.psn,
            mr: self.mr.remote(),
            ro_mr: self.mr.remote(),
        }
    }
    fn connect(&self, peer: &EndpointInfo) {
        self.qp
            .modify(&QpModify::Rtr {
                remote: RemoteQp {
                    gid: peer.gid,
                    qp_num: peer.qp_num,
                },
                sgid_index: 0,
                rq_psn: peer.psn,
                path_mtu: Mtu::Mtu1024,
                min_rnr_timer: Duration::from_millis(1),
            })
            .unwrap();
        self.qp
            .modify(&QpModify::Rts {
                sq_psn: self.psn,
                timeout: Duration::from_millis(50),
                retry_cnt: 3,
                rnr_retry: 7,
            })
            .unwrap();
    }
    /// A 1 MiB WRITE into the peer's region (which maps it here).
    fn write_to(&self, peer: &EndpointInfo, seed: u64) {
        self.mr.write_at(0, &pattern(seed, REGION)).unwrap();
        let sge = self.mr.sge(0, REGION as u32).unwrap();
        self.qp
            .post_send(&SendWr {
                wr_id: seed,
                op: SendOp::RdmaWrite {
                    remote_addr: peer.mr.addr,
                    rkey: peer.mr.rkey,
                },
                payload: Payload::Sges(&[sge]),
                signaled: true,
            })
            .unwrap();
        let mut w = vec![];
        wait_for("write completion", || {
            w.extend(poll_all(&self.scq));
            !w.is_empty()
        });
        assert_eq!(w[0].status, WcStatus::Success, "{w:?}");
    }
}

fn spawn_peer(cfg: &std::path::Path) -> ProcPeer {
    let mut cmd = peer_cmd(cfg, "suite", "shm0");
    let params = ConnParams {
        mr_len: REGION,
        ..ConnParams::default()
    };
    cmd.args(params.to_args().split_whitespace());
    ProcPeer::spawn(cmd).unwrap()
}

/// One short-lived client: connects, both sides write 1 MiB into the other's
/// region, the client exits; our QP notices and everything of ours goes.
fn one_client(
    dev: &smc_rdma::shm::ShmDevice,
    pd: &smc_rdma::shm::ShmPd,
    chan: &ShmChannel,
    cfg: &std::path::Path,
    gid: Gid,
    seed: u64,
) {
    let s = server_side(dev, pd, chan);
    let mut peer = spawn_peer(cfg);
    peer.cmd(&format!("connect {}", s.info(gid).to_line()))
        .unwrap();
    s.connect(&peer.info);
    s.write_to(&peer.info, seed);
    assert_eq!(peer.read(0, 64).unwrap(), pattern(seed, 64));
    let r = s.mr.remote();
    let st = peer
        .cmd(&format!(
            "write {} {} {} {}",
            r.rkey,
            r.addr,
            REGION,
            seed + 1
        ))
        .unwrap();
    assert_eq!(st, "Success");
    let mut b = vec![0u8; 64];
    s.mr.read_at(0, &mut b).unwrap();
    assert_eq!(b, pattern(seed + 1, 64));
    let _ = peer.cmd("quit");
    let _ = peer.child.wait();
    wait_for("the server QP notices the exit", || {
        s.qp.state() == QpState::Err
    });
    let _ = poll_all(&s.scq);
    let _ = poll_all(&s.rcq);
    drop(s);
}

#[test]
fn finding3_short_lived_peer_processes_leave_nothing_behind() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let cfg = dir.join("shm.conf");
    std::fs::write(&cfg, lo_config(&dir).to_text()).unwrap();
    let p = ShmProvider::new(lo_config(&dir));
    let dev = p.open_device("shm0").unwrap();
    let pd = dev.alloc_pd().unwrap();
    let chan = dev.create_channel().unwrap();
    let gid = dev.query_port(1).unwrap().gids[0].gid;
    // One client first: whatever is allocated once (thread stacks, caches)
    // is in the baseline.
    one_client(&dev, &pd, &chan, &cfg, gid, 1);
    let me = std::process::id();
    let base = settled_proc_stats(me).unwrap();
    for i in 0..40u64 {
        one_client(&dev, &pd, &chan, &cfg, gid, 10 + 2 * i);
    }
    let mut now = proc_stats(me).unwrap();
    let t0 = Instant::now();
    while (now.fds, now.memfd_fds, now.memfd_maps) != (base.fds, base.memfd_fds, base.memfd_maps)
        && t0.elapsed() < Duration::from_secs(3)
    {
        std::thread::sleep(Duration::from_millis(20));
        now = proc_stats(me).unwrap();
    }
    eprintln!("baseline {base:?}\nafter 40 clients {now:?}");
    assert_eq!(
        (now.fds, now.memfd_fds, now.memfd_maps, now.threads),
        (base.fds, base.memfd_fds, base.memfd_maps, base.threads),
        "descriptors, memfds, mappings or threads left behind"
    );
    // 40 clients wrote 40 MiB here and we wrote 40 MiB there: none of it stays.
    assert!(
        now.rss_kib < base.rss_kib + 4 * 1024,
        "resident memory grew from {} KiB to {} KiB",
        base.rss_kib,
        now.rss_kib
    );
    drop((chan, pd, dev));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A connected endpoint whose peer process wrote into our region and we into
/// its region.
fn connected_pair(dir: &std::path::Path) -> (Endpoint<ShmProvider>, ProcPeer, ProcStats) {
    let cfg = dir.join("shm.conf");
    std::fs::write(&cfg, lo_config(dir).to_text()).unwrap();
    let p = ShmProvider::new(lo_config(dir));
    let mut peer = spawn_peer(&cfg);
    let params = ConnParams {
        mr_len: REGION,
        ..ConnParams::default()
    };
    let local = Endpoint::open(&p, "shm0", params).unwrap();
    let before = settled_proc_stats(std::process::id()).unwrap();
    peer.cmd(&format!("connect {}", local.info().to_line()))
        .unwrap();
    local.connect(&peer.info).unwrap();
    let data = pattern(3, REGION);
    local.mr.write_at(0, &data).unwrap();
    let sge = local.mr.sge(0, REGION as u32).unwrap();
    local
        .qp
        .post_send(&SendWr {
            wr_id: 1,
            op: SendOp::RdmaWrite {
                remote_addr: peer.info.mr.addr,
                rkey: peer.info.mr.rkey,
            },
            payload: Payload::Sges(&[sge]),
            signaled: true,
        })
        .unwrap();
    let mut w = vec![];
    wait_for("write completion", || {
        w.extend(local.poll_send());
        !w.is_empty()
    });
    assert_eq!(w[0].status, WcStatus::Success);
    let r = local.mr.remote();
    let st = peer
        .cmd(&format!("write {} {} {} 4", r.rkey, r.addr, REGION))
        .unwrap();
    assert_eq!(st, "Success");
    (local, peer, before)
}

/// The peer process dies: our QP (still existing, in ERR) holds nothing of
/// it any more — no socket, no eventfd, no mapping of its ring or region.
/// What is left is exactly what the endpoint had before it connected, less
/// its ring's memfd, which was handed over at the connect.
#[test]
fn finding3_a_qp_whose_peer_died_lets_go_of_it() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let (local, mut peer, before) = connected_pair(&dir);
    let during = proc_stats(std::process::id()).unwrap();
    assert!(during.memfd_maps > before.memfd_maps, "nothing was mapped");
    peer.kill().unwrap();
    wait_for("the QP notices the death", || {
        local.qp.state() == QpState::Err
    });
    let mut now = proc_stats(std::process::id()).unwrap();
    let want = (before.fds - 1, before.memfd_fds - 1, before.memfd_maps);
    let t0 = Instant::now();
    while (now.fds, now.memfd_fds, now.memfd_maps) != want && t0.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
        now = proc_stats(std::process::id()).unwrap();
    }
    assert_eq!(
        (now.fds, now.memfd_fds, now.memfd_maps),
        want,
        "the failed QP still holds its dead peer's resources: {before:?} -> {now:?}"
    );
    drop(local);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A QP destroyed normally (its peer alive) lets go of the peer's region
/// mapping and everything else of the link.
#[test]
fn finding3_a_destroyed_qp_lets_go_of_its_peer() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let (local, peer, before) = connected_pair(&dir);
    let Endpoint {
        qp,
        mr,
        ro_mr,
        scq,
        rcq,
        chan,
        pd,
        dev,
        ..
    } = local;
    drop(qp);
    // Without its QP the endpoint has its ring neither mapped nor open.
    let want = (before.fds - 1, before.memfd_fds - 1, before.memfd_maps - 1);
    let mut now = proc_stats(std::process::id()).unwrap();
    let t0 = Instant::now();
    while (now.fds, now.memfd_fds, now.memfd_maps) != want && t0.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(10));
        now = proc_stats(std::process::id()).unwrap();
    }
    assert_eq!(
        (now.fds, now.memfd_fds, now.memfd_maps),
        want,
        "a destroyed QP left peer resources behind: {before:?} -> {now:?}"
    );
    drop((mr, ro_mr, scq, rcq, chan, pd, dev, peer));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bytes of memory the PD arenas of this process hold (pages of their
/// memfds, whether or not anybody maps them).
fn arena_bytes() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:smc-pd-arena"))
        })
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// A long-lived PD (a link group's) does not keep its peak: regions come
/// and go while one stays (so its arena's first memfd stays open); the peer
/// process writes each of them whole. What went gives its memory back —
/// a hole is punched where it was — also the pages the peer wrote through
/// its own mapping.
#[test]
fn finding3_a_long_lived_pd_does_not_keep_its_peak() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let cfg = dir.join("shm.conf");
    std::fs::write(&cfg, lo_config(&dir).to_text()).unwrap();
    let p = ShmProvider::new(lo_config(&dir));
    let dev = p.open_device("shm0").unwrap();
    let pd = dev.alloc_pd().unwrap();
    let chan = dev.create_channel().unwrap();
    let gid = dev.query_port(1).unwrap().gids[0].gid;
    let s = server_side(&dev, &pd, &chan);
    let mut peer = spawn_peer(&cfg);
    peer.cmd(&format!("connect {}", s.info(gid).to_line()))
        .unwrap();
    s.connect(&peer.info);
    let base = arena_bytes();
    for round in 0..3u64 {
        let mrs: Vec<_> = (0..8)
            .map(|_| {
                pd.alloc_mr(REGION, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                    .unwrap()
            })
            .collect();
        for (i, m) in mrs.iter().enumerate() {
            let r = m.remote();
            let seed = 100 * round + i as u64;
            let st = peer
                .cmd(&format!("write {} {} {REGION} {seed}", r.rkey, r.addr))
                .unwrap();
            assert_eq!(st, "Success");
            let mut b = vec![0u8; 64];
            m.read_at(REGION - 64, &mut b).unwrap();
            assert_eq!(b, pattern(seed, REGION)[REGION - 64..]);
        }
        let peak = arena_bytes();
        assert!(
            peak >= base + 8 * REGION as u64,
            "the peer's writes are not in the arena: {base} -> {peak}"
        );
        let mrs_len = mrs.len();
        drop(mrs);
        // (a region a device thread still looks at goes when it lets go)
        let until = Instant::now() + Duration::from_secs(2);
        let mut now = arena_bytes();
        while now > base && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
            now = arena_bytes();
        }
        // A freed region's pages are punched out, but the peer's device
        // thread still checks the header page of each region it had cached
        // (`PeerMr::valid`, to drop it): a read of a punched page of a shared
        // memfd mapping allocates a zeroed page again. So each region may
        // leave its header page until its range is reused or the chunk
        // closes; never its bytes, never the peak.
        let header_pages = mrs_len as u64 * 4096;
        assert!(
            now <= base + header_pages,
            "round {round}: the arena keeps {now} bytes, {base} before the regions came \
             (at most {header_pages} for the {mrs_len} revoked headers allowed)"
        );
    }
    assert_eq!(s.qp.state(), QpState::Rts);
    let _ = peer.cmd("quit");
    let _ = peer.child.wait();
    drop((s, chan, pd, dev));
    let _ = std::fs::remove_dir_all(&dir);
}
