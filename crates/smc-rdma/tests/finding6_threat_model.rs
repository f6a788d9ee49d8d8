//! Issue 13, finding 6: the shm device's trust model. A local process with no
//! connection — of the same user, or of another user — gets no descriptor
//! and no byte through the device's interfaces, and the traffic of the QPs
//! it attacks stays intact; a peer of one QP gets only the regions of that
//! QP's protection domain that were registered for remote access. (The
//! crate README's "Threat model" section says what holds and what does not.)
#[macro_use]
mod common;

use common::*;
use smc_rdma::conformance::*;
use smc_rdma::shm::ShmProvider;
use smc_rdma::*;
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The tests of this file count the process's descriptors and mappings:
/// they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A rundir the device creates itself (so with the modes it gives a shared
/// rundir: 1777, sockets 0666).
fn fresh_rundir() -> std::path::PathBuf {
    let d = rundir();
    std::fs::remove_dir(&d).unwrap();
    d
}

/// One round of traffic from `a` to `b`: a WRITE of 4 KiB and a SEND, both
/// checked at `b`. Errors are returned, not panicked, so a background
/// thread can count them.
fn round(a: &Endpoint<ShmProvider>, b: &Endpoint<ShmProvider>, seed: u64) -> Result<()> {
    let data = pattern(seed, 4096);
    a.mr.write_at(0, &data)?;
    let sge = a.mr.sge(0, 4096)?;
    let r = b.info().mr;
    a.qp.post_send(&SendWr {
        wr_id: seed,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        payload: Payload::Sges(std::slice::from_ref(&sge)),
        signaled: true,
    })?;
    let rsge = b.mr.sge(RECV_AREA, 64)?;
    b.qp.post_recv(&RecvWr {
        wr_id: seed,
        sges: &[rsge],
    })?;
    a.qp.post_send(&SendWr {
        wr_id: seed + 1,
        op: SendOp::Send,
        payload: Payload::Inline(&seed.to_le_bytes()),
        signaled: true,
    })?;
    let (mut sent, mut got) = (vec![], vec![]);
    let t0 = Instant::now();
    while (sent.len() < 2 || got.is_empty()) && t0.elapsed() < Duration::from_secs(5) {
        sent.extend(a.poll_send());
        got.extend(b.poll_recv());
    }
    let bad = |w: &str| Err(Error::Connect(w.to_string()));
    if sent.len() != 2 || sent.iter().any(|w| w.status != WcStatus::Success) {
        return bad(&format!("sends {sent:?}"));
    }
    if got.len() != 1 || got[0].status != WcStatus::Success || got[0].byte_len != 8 {
        return bad(&format!("receives {got:?}"));
    }
    let mut b8 = [0u8; 8];
    b.mr.read_at(RECV_AREA, &mut b8)?;
    let mut back = vec![0u8; 4096];
    b.mr.read_at(0, &mut back)?;
    if u64::from_le_bytes(b8) != seed || back != data {
        return bad("data changed on the way");
    }
    Ok(())
}

fn report(out: &str) -> HashMap<String, u64> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("report "))
        .unwrap_or_else(|| panic!("no report from the stranger: {out:?}"));
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

/// Two connected QP pairs move data while a stranger (uid `as_uid`, or ours)
/// tries everything; a fifth QP waits in INIT (not yet connected: hellos to
/// it are held until its RTR).
fn stranger_gets_nothing(as_uid: Option<u32>) {
    let _serial = serial();
    setup!(need_lo());
    if as_uid.is_some() && !smc_rdma::sys::is_root() {
        if std::env::var_os("SMC_RDMA_REQUIRE_ALL").is_some() {
            panic!("needs root to run a process as another user");
        }
        eprintln!("SKIPPED: needs root to run a process as another user");
        return;
    }
    let dir = fresh_rundir();
    let p = ShmProvider::new(lo_config(&dir));
    let open = || Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let (a1, b1, a2, b2) = (open(), open(), open(), open());
    let idle = open();
    a1.connect(&b1.info()).unwrap();
    b1.connect(&a1.info()).unwrap();
    a2.connect(&b2.info()).unwrap();
    b2.connect(&a2.info()).unwrap();
    // Every direction once: each side maps the other's region now, so the
    // baseline below holds what the traffic itself needs.
    round(&a1, &b1, 1).unwrap();
    round(&b1, &a1, 2).unwrap();
    round(&a2, &b2, 3).unwrap();
    round(&b2, &a2, 4).unwrap();
    let me = std::process::id();
    let base = settled_proc_stats(me).unwrap();

    let stop = AtomicBool::new(false);
    let (rounds, failures) = (AtomicU64::new(0), AtomicU64::new(0));
    let out = std::thread::scope(|s| {
        for (x, y) in [(&a1, &b1), (&b2, &a2)] {
            let (stop, rounds, failures) = (&stop, &rounds, &failures);
            s.spawn(move || {
                let mut seed = 100;
                while !stop.load(Ordering::Relaxed) {
                    seed += 2;
                    match round(x, y, seed).and_then(|_| round(y, x, seed + 1000)) {
                        Ok(()) => rounds.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            eprintln!("victim traffic failed: {e}");
                            failures.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            });
        }
        let exe = match as_uid {
            // The build may sit where another user cannot reach it (CI's
            // checkout under /root): that user runs a copy in /tmp.
            Some(_) => {
                use std::os::unix::fs::PermissionsExt;
                let copy =
                    std::env::temp_dir().join(format!("smc-rdma-stranger-{}", std::process::id()));
                std::fs::copy(env!("CARGO_BIN_EXE_smc-rdma-peer"), &copy).unwrap();
                std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
                copy
            }
            None => env!("CARGO_BIN_EXE_smc-rdma-peer").into(),
        };
        let mut cmd = Command::new(&exe);
        cmd.arg("stranger").arg(&dir).arg("300");
        if let Some(uid) = as_uid {
            cmd.uid(uid).gid(uid);
        }
        let out = cmd.output().unwrap();
        if as_uid.is_some() {
            let _ = std::fs::remove_file(&exe);
        }
        stop.store(true, Ordering::Relaxed);
        out
    });
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "stranger failed: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&text);
    eprintln!("stranger (uid {as_uid:?}): {r:?}");
    // It could reach every socket and tried its luck...
    assert!(r["sockets"] >= 5, "stranger could not connect: {r:?}");
    assert!(r["requests"] >= 5 * 64 && r["hellos"] > 0, "{r:?}");
    // ...and got nothing.
    assert_eq!(r["fds"], 0, "descriptors handed to a stranger: {r:?}");
    assert_eq!(r["bytes"], 0, "bytes seen by a stranger: {r:?}");
    assert_eq!(
        r["ring_writes"], 0,
        "a QP took the stranger for its peer: {r:?}"
    );
    assert_eq!(r["signals"], 0, "a QP signalled the stranger: {r:?}");
    // The victims' traffic went on intact, nothing failed.
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    assert!(rounds.load(Ordering::Relaxed) > 0);
    for e in [&a1, &b1, &a2, &b2] {
        assert_eq!(e.qp.state(), QpState::Rts);
        assert_eq!(e.dev.poll_async_event(), None);
    }
    // Whatever the stranger made us hold is gone with it.
    let t0 = Instant::now();
    let mut now = proc_stats(me).unwrap();
    while (now.fds, now.memfd_fds, now.memfd_maps) != (base.fds, base.memfd_fds, base.memfd_maps)
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
        now = proc_stats(me).unwrap();
    }
    assert_eq!(
        (now.fds, now.memfd_fds, now.memfd_maps),
        (base.fds, base.memfd_fds, base.memfd_maps),
        "descriptors or mappings left behind: {base:?} -> {now:?}"
    );
    assert!(
        now.rss_kib < base.rss_kib + 8 * 1024,
        "memory left behind: {base:?} -> {now:?}"
    );
    round(&a1, &b1, 7).unwrap();
    round(&a2, &b2, 8).unwrap();
    // The QP still in INIT connects normally after the attack.
    let late = open();
    late.connect(&idle.info()).unwrap();
    idle.connect(&late.info()).unwrap();
    round(&late, &idle, 9).unwrap();
    round(&idle, &late, 10).unwrap();
    drop((late, idle));
    drop((a1, b1, a2, b2));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finding6_stranger_of_the_same_user_gets_nothing() {
    stranger_gets_nothing(None);
}

#[test]
fn finding6_stranger_of_another_user_gets_nothing() {
    stranger_gets_nothing(Some(65534)); // nobody
}

/// A peer connected to one QP asks (as its own code could, without the
/// writer's checks) for every region of the other side: it gets the
/// remote-access regions of its QP's PD and nothing else — not another PD's,
/// not a local-only region (send buffers), not through a QP that grants no
/// remote writes.
#[test]
fn finding6_peer_gets_only_its_pds_remote_regions() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let p = ShmProvider::new(lo_config(&dir));
    let victim = Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let peer = Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    // Another PD on the victim's device, with a remote-access region.
    let pd2 = victim.dev.alloc_pd().unwrap();
    let other_pd = pd2
        .alloc_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    // A local-only region of the QP's own PD (a send buffer).
    let local_only = victim.pd.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
    victim.connect(&peer.info()).unwrap();
    peer.connect(&victim.info()).unwrap();
    round(&peer, &victim, 1).unwrap();
    let asks = |rkey| peer.qp.peer_hands_out(rkey);
    assert!(
        asks(victim.mr.rkey()),
        "the QP's own remote region is refused"
    );
    assert!(
        !asks(other_pd.rkey()),
        "a region of another PD was handed out"
    );
    assert!(
        !asks(local_only.rkey()),
        "a local-only region was handed out"
    );
    assert!(
        !asks(victim.ro_mr.rkey()),
        "a local-only region was handed out"
    );
    assert!(!asks(victim.mr.rkey() ^ 1), "an unknown rkey was answered");

    // A QP that grants no remote writes hands out nothing, not even its PD's
    // remote regions.
    let l = &victim;
    let closed = l.pd.create_qp(&l.scq, &l.rcq, QpCap::default()).unwrap();
    closed
        .modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE,
        })
        .unwrap();
    let p2 = Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let mut info = victim.info();
    info.qp_num = closed.qp_num();
    let psn = victim.psn;
    closed
        .modify(&QpModify::Rtr {
            remote: RemoteQp {
                gid: p2.info().gid,
                qp_num: p2.qp.qp_num(),
            },
            sgid_index: 0,
            rq_psn: p2.psn,
            path_mtu: Mtu::Mtu1024,
            min_rnr_timer: Duration::from_millis(1),
        })
        .unwrap();
    closed
        .modify(&QpModify::Rts {
            sq_psn: psn,
            timeout: Duration::from_millis(50),
            retry_cnt: 3,
            rnr_retry: 7,
        })
        .unwrap();
    p2.connect(&info).unwrap();
    assert!(
        !p2.qp.peer_hands_out(victim.mr.rkey()),
        "a QP without REMOTE_WRITE handed out a region"
    );
    drop((closed, p2));
    assert_eq!(victim.qp.state(), QpState::Rts);
    drop((other_pd, pd2, local_only, victim, peer));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The remote-access regions of a PD share memfds (its arena's chunks), and
/// a peer asking for one region gets the memfd of its chunk. A hostile peer
/// that maps all of that memfd instead of the region's range reaches the
/// other remote-access regions of its QP's PD — which it may ask for anyway
/// — and nothing else: no region of another PD (registered in between, on
/// the same device), no local-only region.
#[test]
fn finding6_a_region_memfd_holds_only_its_pds_regions() {
    use smc_rdma::shm::layout::{HDR, MR_MAGIC, MR_RKEY};
    use smc_rdma::sys::{page_size, SharedMem};
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let p = ShmProvider::new(lo_config(&dir));
    let victim = Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let peer = Endpoint::open(&p, "shm0", ConnParams::default()).unwrap();
    let pd2 = victim.dev.alloc_pd().unwrap();
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    const SECRET: &[u8; 16] = b"another PD's !!!";
    const PRIVATE: &[u8; 16] = b"local-only data!";
    // Regions of both PDs registered alternately, and local-only ones.
    let (mut own, mut other, mut local) = (vec![], vec![], vec![]);
    for i in 0..40 {
        let len = 4096 * (1 + i % 5);
        own.push(victim.pd.alloc_mr(len, rw).unwrap());
        let o = pd2.alloc_mr(len, rw).unwrap();
        o.write_at(0, SECRET).unwrap();
        o.write_at(len - 16, SECRET).unwrap();
        other.push(o);
        let l = victim.pd.alloc_mr(len, Access::LOCAL_WRITE).unwrap();
        l.write_at(0, PRIVATE).unwrap();
        local.push(l);
    }
    victim.connect(&peer.info()).unwrap();
    peer.connect(&victim.info()).unwrap();
    round(&peer, &victim, 1).unwrap();
    let own_keys: std::collections::HashSet<u64> = own
        .iter()
        .chain([&victim.mr])
        .map(|m| u64::from(m.rkey()))
        .collect();
    let mut chunks = 0;
    for m in own.iter().chain([&victim.mr]) {
        let (fd, off, len) = peer
            .qp
            .peer_region_memfd(m.rkey())
            .expect("the QP's own PD's region is handed out");
        assert_eq!(len, m.len());
        assert_eq!(off % page_size() as u64, 0);
        // All of it, not just the region's range.
        let all = SharedMem::map(fd).unwrap();
        let mut bytes = vec![0u8; all.len()];
        all.read(0, &mut bytes).unwrap();
        if off == 0 {
            chunks += 1;
        }
        for secret in [&SECRET[..], &PRIVATE[..]] {
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret),
                "a region's memfd holds {:?}",
                String::from_utf8_lossy(secret)
            );
        }
        // Every region header in it is one of this PD's remote regions.
        for page in (0..all.len()).step_by(page_size()) {
            if page + HDR > all.len()
                || all.atomic(page).unwrap().load(Ordering::Acquire) != MR_MAGIC
            {
                continue;
            }
            let k = all.atomic(page + MR_RKEY).unwrap().load(Ordering::Acquire);
            assert!(
                own_keys.contains(&k),
                "a region of another PD ({k:#x}) shares a memfd with the QP's PD"
            );
        }
    }
    assert!(chunks >= 1, "no region at the start of a memfd");
    // The other PD's regions are intact and not handed out.
    for o in &other {
        assert!(!peer.qp.peer_hands_out(o.rkey()));
        let mut b = [0u8; 16];
        o.read_at(0, &mut b).unwrap();
        assert_eq!(&b, SECRET);
    }
    drop((own, other, local, pd2, victim, peer));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Keys and region addresses are not derived from anything a stranger can
/// see: two regions registered back to back share no structure an attacker
/// could extrapolate (distinct keys and addresses, and neither follows from
/// the socket name).
#[test]
fn finding6_keys_and_addresses_are_unpredictable() {
    let _serial = serial();
    setup!(need_lo());
    let dir = rundir();
    let p = ShmProvider::new(lo_config(&dir));
    let d = p.open_device("shm0").unwrap();
    let pd = d.alloc_pd().unwrap();
    let mrs: Vec<_> = (0..64)
        .map(|_| pd.alloc_mr(4096, Access::REMOTE_WRITE).unwrap())
        .collect();
    let rkeys: std::collections::HashSet<u32> = mrs.iter().map(|m| m.rkey()).collect();
    let addrs: std::collections::HashSet<u64> = mrs.iter().map(|m| m.addr()).collect();
    assert_eq!((rkeys.len(), addrs.len()), (64, 64));
    // Consecutive registrations differ in many bits (a counter would not).
    let flips: u32 = mrs
        .windows(2)
        .map(|w| (w[0].rkey() ^ w[1].rkey()).count_ones())
        .sum();
    assert!(
        flips > 63 * 10,
        "rkeys look sequential: {flips} bits flipped"
    );
    let addr_flips: u32 = mrs
        .windows(2)
        .map(|w| (w[0].addr() ^ w[1].addr()).count_ones())
        .sum();
    assert!(addr_flips > 63 * 16, "addresses look sequential");
    drop((mrs, pd, d));
    let _ = std::fs::remove_dir_all(&dir);
}
