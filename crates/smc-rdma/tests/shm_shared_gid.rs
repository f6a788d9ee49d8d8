//! `shm` with many users of one interface: QP numbers are unique host-wide,
//! (GID, QPN) reaches the right instance, stale registry entries of dead
//! processes are survived. All on `lo`, no root needed.
#[macro_use]
mod common;

use common::*;
use smc_rdma::conformance::*;
use smc_rdma::shm::{ShmProvider, QPN_MAX, QPN_MIN};
use smc_rdma::sys::SeqPacket;
use smc_rdma::*;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// One WRITE and one SEND from `a` to `b`; checks both arrived.
fn exchange(a: &Endpoint<ShmProvider>, b: &Endpoint<ShmProvider>, seed: u64) {
    let data = pattern(seed, 4096);
    a.mr.write_at(0, &data).unwrap();
    let sge = a.mr.sge(0, 4096).unwrap();
    let r = b.info().mr;
    a.qp.post_send(&SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        payload: Payload::Sges(std::slice::from_ref(&sge)),
        signaled: true,
    })
    .unwrap();
    let rsge = b.mr.sge(RECV_AREA, 64).unwrap();
    b.qp.post_recv(&RecvWr {
        wr_id: 7,
        sges: &[rsge],
    })
    .unwrap();
    a.qp.post_send(&SendWr {
        wr_id: 2,
        op: SendOp::Send,
        payload: Payload::Inline(&seed.to_le_bytes()),
        signaled: true,
    })
    .unwrap();
    let (mut sent, mut got) = (vec![], vec![]);
    let t0 = Instant::now();
    while (sent.len() < 2 || got.is_empty()) && t0.elapsed() < Duration::from_secs(5) {
        sent.extend(a.poll_send());
        got.extend(b.poll_recv());
    }
    assert!(
        sent.len() == 2 && sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].status, got[0].byte_len), (WcStatus::Success, 8));
    let mut b8 = [0u8; 8];
    b.mr.read_at(RECV_AREA, &mut b8).unwrap();
    assert_eq!(u64::from_le_bytes(b8), seed);
    let mut back = vec![0u8; 4096];
    b.mr.read_at(0, &mut back).unwrap();
    assert_eq!(back, data);
}

/// Three instances of one device on `lo` share the GID; QPs of the first
/// connect to the second and the third by (GID, QPN), in both directions,
/// and each byte lands at the QP it was meant for.
#[test]
fn three_instances_on_lo_are_told_apart_by_qp_number() {
    setup!(need_lo());
    let rundir = rundir();
    let p = ShmProvider::new(lo_config(&rundir));
    let open = || Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let (a1, a2, b, c) = (open(), open(), open(), open());
    let gid = a1.info().gid;
    for e in [&a2, &b, &c] {
        assert_eq!(e.info().gid, gid);
    }
    let qpns: HashSet<u32> = [&a1, &a2, &b, &c].iter().map(|e| e.qp.qp_num()).collect();
    assert_eq!(qpns.len(), 4, "QP numbers collide: {qpns:?}");
    // a1 <-> b (b opened before c: the last opener is not the target).
    a1.connect(&b.info()).unwrap();
    b.connect(&a1.info()).unwrap();
    // c <-> a2, c actively connecting.
    c.connect(&a2.info()).unwrap();
    a2.connect(&c.info()).unwrap();
    exchange(&a1, &b, 1);
    exchange(&b, &a1, 2); // b fetches a1's region through a1's instance
    exchange(&c, &a2, 3);
    exchange(&a2, &c, 4);
    // Nothing went to the QPs not addressed.
    let mut z = vec![0u8; 4096];
    c.mr.read_at(0, &mut z).unwrap();
    assert_eq!(z, pattern(4, 4096));
    drop((a1, a2, b, c));
    let _ = std::fs::remove_dir_all(&rundir);
}

/// Several processes and several in-process instances create many QPs at
/// the same moment on one interface: no two live QPs share a number, and
/// every number is a valid 24-bit QPN.
#[test]
fn qp_numbers_are_unique_across_processes_and_instances() {
    setup!(need_lo());
    const PROCS: usize = 3;
    const N: usize = 150;
    // Many small instances too: per-instance numbering schemes (a counter,
    // a random salt) collide between instances long before 24 bits run out.
    const THREADS: usize = 4;
    const INST: usize = 16;
    const NT: usize = 10;
    const TOTAL: usize = PROCS * N + THREADS * INST * NT;
    let rundir = rundir();
    let cfg = lo_config(&rundir);
    let cfg_path = rundir.join("shm.conf");
    std::fs::write(&cfg_path, cfg.to_text()).unwrap();
    let mut children = vec![];
    for _ in 0..PROCS {
        let mut cmd = peer_cmd(&cfg_path, "qpns", "shm0");
        cmd.arg(N.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut ch = cmd.spawn().unwrap();
        let stdin = ch.stdin.take().unwrap();
        let mut out = BufReader::new(ch.stdout.take().unwrap());
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        assert_eq!(l.trim(), "ready");
        children.push((ch, stdin, out));
    }
    let p = ShmProvider::new(cfg);
    let devs: Vec<Vec<_>> = (0..THREADS)
        .map(|_| (0..INST).map(|_| p.open_device("shm0").unwrap()).collect())
        .collect();
    let mut all: Vec<u32> = vec![];
    let barrier = std::sync::Barrier::new(THREADS + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .map(|ds| {
                let barrier = &barrier;
                s.spawn(move || {
                    let res: Vec<_> = ds
                        .iter()
                        .map(|d| (d.alloc_pd().unwrap(), d.create_cq(16, None).unwrap()))
                        .collect();
                    barrier.wait();
                    let mut qps = vec![];
                    for _ in 0..NT {
                        for (pd, cq) in &res {
                            qps.push(pd.create_qp(cq, cq, QpCap::default()).unwrap());
                        }
                    }
                    let nums: Vec<u32> = qps.iter().map(|q| q.qp_num()).collect();
                    (nums, qps, res)
                })
            })
            .collect();
        // Go: children and threads start creating at once.
        for (_, stdin, _) in children.iter_mut() {
            writeln!(stdin, "go").unwrap();
            stdin.flush().unwrap();
        }
        barrier.wait();
        let mut kept = vec![];
        for h in handles {
            let (nums, qps, res) = h.join().unwrap();
            all.extend(nums);
            kept.push((qps, res));
        }
        for (_, _, out) in children.iter_mut() {
            let mut l = String::new();
            out.read_line(&mut l).unwrap();
            let rest = l
                .trim()
                .strip_prefix("qpns ")
                .unwrap_or_else(|| panic!("{l:?}"));
            all.extend(rest.split_whitespace().map(|w| w.parse::<u32>().unwrap()));
        }
        // Everything is still alive here: the registry holds one entry per QP.
        let entries = std::fs::read_dir(&rundir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("qpn-"))
            .count();
        assert_eq!(entries, TOTAL);
        drop(kept);
    });
    assert_eq!(all.len(), TOTAL);
    let set: HashSet<u32> = all.iter().copied().collect();
    assert_eq!(set.len(), all.len(), "duplicate QP numbers handed out");
    assert!(all.iter().all(|&n| (QPN_MIN..=QPN_MAX).contains(&n)));
    for (mut ch, stdin, _) in children {
        drop(stdin);
        assert!(ch.wait().unwrap().success());
    }
    // Released QPs leave no registry entries behind.
    let left = std::fs::read_dir(&rundir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("qpn-"))
        .count();
    assert_eq!(left, 0);
    drop(devs);
    let _ = std::fs::remove_dir_all(&rundir);
}

/// A peer process is SIGKILLed: its socket and registry entries stay
/// behind. A connection to its (GID, QPN) fails at once (no hang), and a
/// new process that is handed the very same QP number (the allocation
/// cursor is set back to it) is reachable by (GID, QPN) and passes data.
#[test]
fn stale_registry_entry_of_a_killed_process_does_not_break_a_later_connection() {
    setup!(need_lo());
    let rundir = rundir();
    let params = ConnParams::default();
    let (mut dead, cfg_path) = setup!(spawn_lo_peer(&rundir, &params));
    let dead_info = dead.info;
    // Opened before the kill, so no open-time sweep sees the dead entries.
    let p = ShmProvider::new(lo_config(&rundir));
    let local = Endpoint::open(&p, "shm0", params).unwrap();
    dead.kill().unwrap(); // SIGKILL: nothing is cleaned up
    let stale = rundir.join(format!("qpn-{:06x}", dead_info.qp_num));
    let target = std::fs::read_link(&stale).expect("stale entry is left behind");
    assert!(
        !SeqPacket::probe(&target),
        "dead process's socket still accepts"
    );

    // 1. The dead (GID, QPN) is refused promptly and its entry cleaned.
    let t0 = Instant::now();
    let r = local.connect(&dead_info);
    assert!(matches!(r, Err(Error::Connect(_))), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert!(
        std::fs::symlink_metadata(&stale).is_err(),
        "stale entry kept"
    );
    drop(local);

    // 2. Kill another one, leave its entry, and make the allocator run into
    // it: the next QP number handed out is the dead one.
    let (mut dead2, _) = spawn_lo_peer(&rundir, &params).unwrap();
    let q = dead2.info.qp_num;
    dead2.kill().unwrap();
    assert!(std::fs::symlink_metadata(rundir.join(format!("qpn-{q:06x}"))).is_ok());
    std::fs::write(rundir.join("qpn.next"), format!("{q}\n")).unwrap();
    let mut cmd = peer_cmd(&cfg_path, "suite", "shm0");
    cmd.args(params.to_args().split_whitespace());
    let mut peer = ProcPeer::spawn(cmd).unwrap();
    assert_eq!(peer.info.qp_num, q, "dead QP number not reused");
    let local = Endpoint::open(&p, "shm0", params).unwrap();
    peer.cmd(&format!("connect {}", local.info().to_line()))
        .unwrap();
    local.connect(&peer.info).unwrap();
    let data = pattern(9, 1024);
    local.mr.write_at(0, &data).unwrap();
    let sge = local.mr.sge(0, 1024).unwrap();
    local
        .qp
        .post_send(&SendWr {
            wr_id: 1,
            op: SendOp::RdmaWrite {
                remote_addr: peer.info.mr.addr,
                rkey: peer.info.mr.rkey,
            },
            payload: Payload::Sges(std::slice::from_ref(&sge)),
            signaled: true,
        })
        .unwrap();
    let t0 = Instant::now();
    let mut w = vec![];
    while w.is_empty() && t0.elapsed() < Duration::from_secs(5) {
        w = local.poll_send();
    }
    assert_eq!(w[0].status, WcStatus::Success, "{w:?}");
    assert_eq!(peer.read(0, 1024).unwrap(), data);
    let _ = peer.child.kill();
    let _ = peer.child.wait();
    drop(local);
    let _ = std::fs::remove_dir_all(&rundir);
}

/// The allocator itself (no sweep in between) reclaims a number whose
/// owner's socket refuses connections, and skips one whose owner is alive.
#[test]
fn allocator_reclaims_dead_numbers_and_skips_live_ones() {
    setup!(need_lo());
    let rundir = rundir();
    let p = ShmProvider::new(lo_config(&rundir));
    let d = p.open_device("shm0").unwrap();
    let pd = d.alloc_pd().unwrap();
    let cq = d.create_cq(16, None).unwrap();
    let live = pd.create_qp(&cq, &cq, QpCap::default()).unwrap();
    // A dead owner: a socket file nobody listens on any more.
    let dead_sock = rundir.join("dev-ghost-1-0-00000000.sock");
    drop(SeqPacket::listen(&dead_sock).unwrap());
    // (a process another test of this binary spawns at that moment holds a
    // copy of the listening socket until its exec closes it, and the owner
    // looks alive till then)
    let t0 = Instant::now();
    while SeqPacket::probe(&dead_sock) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let q = live.qp_num() + 1;
    std::os::unix::fs::symlink(&dead_sock, rundir.join(format!("qpn-{q:06x}"))).unwrap();
    // Cursor at the live QP: it is skipped, the dead one reclaimed.
    std::fs::write(rundir.join("qpn.next"), format!("{}\n", live.qp_num())).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCap::default()).unwrap();
    assert_eq!(qp.qp_num(), q);
    // Wrap: the cursor at the top of the space continues at QPN_MIN.
    std::fs::write(rundir.join("qpn.next"), format!("{QPN_MAX}\n")).unwrap();
    let top = pd.create_qp(&cq, &cq, QpCap::default()).unwrap();
    assert_eq!(top.qp_num(), QPN_MAX);
    let wrapped = pd.create_qp(&cq, &cq, QpCap::default()).unwrap();
    assert!(wrapped.qp_num() >= QPN_MIN && wrapped.qp_num() != live.qp_num());
    drop((wrapped, top, qp, live, cq, pd, d));
    let _ = std::fs::remove_dir_all(&rundir);
}
