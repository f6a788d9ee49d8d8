//! End-to-end tests of the SYN-option rendezvous on loopback. They need root (CI runs as root)
//! and fail loudly otherwise — except `no_privilege_is_a_typed_error`, which checks exactly
//! that error path in a child process without capabilities.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use smc_bpf::{Config, Rendezvous, RendezvousError, SocketStatus};

#[derive(Debug)]
struct Outcome {
    client_peer: bool,
    server_peer: bool,
    server_status: SocketStatus,
    /// The accepted socket's TCP_SAVED_SYN carried fe 06 e2 d4 c3 d9.
    saved_syn_has_opt: bool,
    syn_on_wire: Vec<bool>,
    synack_on_wire: Vec<bool>,
    /// Non-SYN segments of the connection that carried the option (must be 0).
    later_with_opt: usize,
    later_segments: usize,
    /// Most copies of the option seen in one SYN or SYN-ACK (must never exceed 1).
    max_copies: usize,
    /// TCP header length of the (first) SYN.
    syn_hdr_len: usize,
}

/// One connection over loopback, with the client and/or the listener opted in.
fn run_case(fam: Fam, client_opt: bool, server_opt: bool) -> Outcome {
    run_case_with(rdv(), fam, client_opt, server_opt)
}

fn option_count(tcp_hdr: &[u8]) -> usize {
    tcp_hdr
        .get(20..)
        .map_or(0, |o| o.windows(6).filter(|w| *w == SMC_OPTION).count())
}

fn run_case_with(r: &Rendezvous, fam: Fam, client_opt: bool, server_opt: bool) -> Outcome {
    run_case_after_listen(r, fam, client_opt, server_opt, |_| {})
}

/// [`run_case_with`], `after_listen` called with the listening socket before the client
/// connects.
fn run_case_after_listen(
    r: &Rendezvous,
    fam: Fam,
    client_opt: bool,
    server_opt: bool,
    after_listen: impl FnOnce(std::os::fd::BorrowedFd<'_>),
) -> Outcome {
    let cap = Capture::on_lo();

    let lfd = tcp_socket(fam);
    if server_opt {
        r.opt_in(lfd.as_fd()).expect("opt in listener");
    }
    // An opted-in listener must get TCP_SAVE_SYN from the program (the test reads the saved
    // SYN below); a plain one gets it from the test.
    let port = bind_listen_opts(&lfd, fam, !server_opt);
    let listener = into_listener(lfd);
    after_listen(listener.as_fd());

    let cfd = tcp_socket(fam);
    if client_opt {
        r.opt_in(cfd.as_fd()).expect("opt in client");
        assert_eq!(r.status(cfd.as_fd()).unwrap(), SocketStatus::OptedIn);
    }
    connect(&cfd, fam, port);
    let mut client = into_stream(cfd);
    let (mut server, _) = listener.accept().expect("accept");

    let client_peer = r
        .peer_offered_smc(client.as_fd())
        .expect("client peer_offered_smc");
    let server_peer = r
        .peer_offered_smc(server.as_fd())
        .expect("server peer_offered_smc");
    let server_status = r.status(server.as_fd()).unwrap();
    let syn = saved_syn(server.as_fd());
    let syn_tcp = tcp_header(&syn).expect("TCP_SAVED_SYN holds an IP + TCP header");
    assert_eq!(syn_tcp[13] & 0x12, 0x02, "saved packet is a SYN");
    let saved_syn_has_opt = has_smc_option(syn_tcp);

    // Some data both ways, so there are later segments to check.
    client.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    server.read_exact(&mut b).unwrap();
    server.write_all(b"pong").unwrap();
    client.read_exact(&mut b).unwrap();

    let cport = local_port(client.as_fd());
    r.forget(client.as_fd());
    r.forget(server.as_fd());
    drop(client);
    drop(server);
    let segs = cap.drain(cport, port);
    let syn_on_wire: Vec<bool> = segs
        .iter()
        .filter(|s| s.is_syn() && s.sport == cport)
        .map(|s| has_smc_option(&s.header))
        .collect();
    let synack_on_wire: Vec<bool> = segs
        .iter()
        .filter(|s| s.is_synack() && s.sport == port)
        .map(|s| has_smc_option(&s.header))
        .collect();
    if std::env::var_os("SMC_BPF_TEST_DUMP").is_some() {
        for sg in segs.iter().filter(|s| s.flags & 0x02 != 0) {
            eprintln!(
                "{}->{} flags {:#04x} options {:02x?}",
                sg.sport,
                sg.dport,
                sg.flags,
                &sg.header[20..]
            );
        }
    }
    let later: Vec<_> = segs.iter().filter(|s| s.flags & 0x02 == 0).collect();
    assert!(
        !syn_on_wire.is_empty(),
        "capture saw no SYN ({} segments)",
        segs.len()
    );
    assert!(
        !synack_on_wire.is_empty(),
        "capture saw no SYN-ACK ({} segments)",
        segs.len()
    );
    Outcome {
        client_peer,
        server_peer,
        server_status,
        saved_syn_has_opt,
        syn_on_wire,
        synack_on_wire,
        later_with_opt: later.iter().filter(|s| has_smc_option(&s.header)).count(),
        later_segments: later.len(),
        syn_hdr_len: segs
            .iter()
            .find(|s| s.is_syn())
            .map_or(0, |s| s.header.len()),
        max_copies: segs
            .iter()
            .filter(|s| s.flags & 0x02 != 0)
            .map(|s| option_count(&s.header))
            .max()
            .unwrap_or(0),
    }
}

fn assert_no_option_after_handshake(o: &Outcome) {
    assert!(
        o.later_segments >= 3,
        "expected ACK/data segments in the capture: {o:?}"
    );
    assert_eq!(
        o.later_with_opt, 0,
        "only SYN and SYN-ACK may carry the option: {o:?}"
    );
}

fn both_opted_in(fam: Fam) {
    let o = run_case(fam, true, true);
    assert_eq!(o.max_copies, 1, "{o:?}");
    assert!(
        o.client_peer,
        "client must see the option on the SYN-ACK: {o:?}"
    );
    assert!(
        o.server_peer,
        "accepted socket must see the option on the SYN: {o:?}"
    );
    assert_eq!(
        o.server_status,
        SocketStatus::Established {
            peer_smc: true,
            passive: true
        }
    );
    assert!(
        o.saved_syn_has_opt,
        "TCP_SAVED_SYN lacks fe 06 e2 d4 c3 d9: {o:?}"
    );
    assert!(
        o.syn_on_wire.iter().all(|&x| x),
        "SYN on the wire lacks the option: {o:?}"
    );
    assert!(
        o.synack_on_wire.iter().all(|&x| x),
        "SYN-ACK on the wire lacks the option: {o:?}"
    );
    assert_no_option_after_handshake(&o);
}

#[test]
fn ipv4_both_opted_in_both_see_the_option() {
    both_opted_in(Fam::V4);
}

#[test]
fn ipv6_both_opted_in_both_see_the_option() {
    both_opted_in(Fam::V6);
}

fn client_only(fam: Fam) {
    let o = run_case(fam, true, false);
    assert!(
        !o.client_peer,
        "server did not opt in, so no SYN-ACK option: {o:?}"
    );
    assert!(!o.server_peer, "{o:?}");
    assert_eq!(
        o.server_status,
        SocketStatus::Untracked,
        "accepted socket of a plain listener is not tracked"
    );
    assert!(
        o.saved_syn_has_opt,
        "the client's SYN still carries the option: {o:?}"
    );
    assert!(o.syn_on_wire.iter().all(|&x| x), "{o:?}");
    assert!(
        o.synack_on_wire.iter().all(|&x| !x),
        "plain listener must not send it: {o:?}"
    );
    assert_no_option_after_handshake(&o);
}

#[test]
fn ipv4_client_opted_in_server_not() {
    client_only(Fam::V4);
}

#[test]
fn ipv6_client_opted_in_server_not() {
    client_only(Fam::V6);
}

#[test]
fn ipv4_server_opted_in_client_not_no_echo() {
    let o = run_case(Fam::V4, false, true);
    assert!(!o.client_peer, "{o:?}");
    assert!(!o.server_peer, "{o:?}");
    assert_eq!(
        o.server_status,
        SocketStatus::Established {
            peer_smc: false,
            passive: true
        }
    );
    assert!(!o.saved_syn_has_opt, "{o:?}");
    assert!(o.syn_on_wire.iter().all(|&x| !x), "{o:?}");
    assert!(
        o.synack_on_wire.iter().all(|&x| !x),
        "Linux semantics: the SYN-ACK echoes the option only if the SYN had it: {o:?}"
    );
    assert_no_option_after_handshake(&o);
}

/// A listener opted out after `listen()` (an exec into a program without the library):
/// its SYN-ACKs carry no option although the client's SYN did, neither side sees SMC, and
/// opting it in again puts the option back.
fn listener_opted_out(fam: Fam) {
    let r = rdv();
    let o = run_case_after_listen(r, fam, true, true, |l| {
        assert!(r.opt_out_listener(l).unwrap(), "the listener was opted in");
        assert_eq!(r.status(l).unwrap(), SocketStatus::Untracked);
    });
    assert!(o.syn_on_wire.iter().all(|&x| x), "{o:?}");
    assert!(
        o.synack_on_wire.iter().all(|&x| !x),
        "an opted-out listener's SYN-ACK carries the option: {o:?}"
    );
    assert!(!o.client_peer && !o.server_peer, "{o:?}");
    let o = run_case_after_listen(r, fam, true, true, |l| {
        assert!(r.opt_out_listener(l).unwrap());
        r.opt_in_listener_again(l).unwrap();
        assert_eq!(r.status(l).unwrap(), SocketStatus::OptedIn);
    });
    assert!(o.synack_on_wire.iter().all(|&x| x), "{o:?}");
    assert!(o.client_peer && o.server_peer, "{o:?}");
}

#[test]
fn ipv4_a_listener_opted_out_after_listen_offers_no_smc() {
    listener_opted_out(Fam::V4);
}

#[test]
fn ipv6_a_listener_opted_out_after_listen_offers_no_smc() {
    listener_opted_out(Fam::V6);
}

#[test]
fn ipv4_neither_opted_in_nothing_changes() {
    let o = run_case(Fam::V4, false, false);
    assert!(!o.client_peer && !o.server_peer, "{o:?}");
    assert_eq!(o.server_status, SocketStatus::Untracked);
    assert!(!o.saved_syn_has_opt, "{o:?}");
    assert!(
        o.syn_on_wire.iter().chain(&o.synack_on_wire).all(|&x| !x),
        "{o:?}"
    );
    assert_no_option_after_handshake(&o);
}

#[test]
fn opt_in_is_refused_after_listen_and_for_non_tcp() {
    let r = rdv();
    let fd = tcp_socket(Fam::V4);
    bind_listen(&fd, Fam::V4);
    match r.opt_in(fd.as_fd()) {
        Err(RendezvousError::TooLate { state }) => assert_eq!(state, 10, "TCP_LISTEN"),
        other => panic!("expected TooLate, got {other:?}"),
    }
    let udp = udp_socket();
    assert_eq!(r.opt_in(udp.as_fd()), Err(RendezvousError::NotTcpSocket));
}

#[test]
fn forget_and_close_remove_map_entries() {
    let r = rdv();
    // Opted in but never connected: only forget() (or LRU) can remove it.
    let fd = tcp_socket(Fam::V4);
    r.opt_in(fd.as_fd()).unwrap();
    let cookie = smc_bpf::socket_cookie(fd.as_fd()).unwrap();
    assert_eq!(r.status_by_cookie(cookie).unwrap(), SocketStatus::OptedIn);
    r.forget(fd.as_fd());
    assert_eq!(r.status_by_cookie(cookie).unwrap(), SocketStatus::Untracked);
    r.forget(fd.as_fd()); // idempotent

    // Connected sockets: the program deletes the entries when they reach TCP_CLOSE, even if
    // user space never calls forget() (e.g. the process crashed).
    let lfd = tcp_socket(Fam::V4);
    r.opt_in(lfd.as_fd()).unwrap();
    let port = bind_listen(&lfd, Fam::V4);
    let listener = into_listener(lfd);
    let lcookie = smc_bpf::socket_cookie(listener.as_fd()).unwrap();
    let cfd = tcp_socket(Fam::V4);
    r.opt_in(cfd.as_fd()).unwrap();
    connect(&cfd, Fam::V4, port);
    let client = into_stream(cfd);
    let (server, _) = listener.accept().unwrap();
    let ccookie = smc_bpf::socket_cookie(client.as_fd()).unwrap();
    let scookie = smc_bpf::socket_cookie(server.as_fd()).unwrap();
    assert!(matches!(
        r.status_by_cookie(ccookie).unwrap(),
        SocketStatus::Established {
            peer_smc: true,
            passive: false
        }
    ));
    assert!(matches!(
        r.status_by_cookie(scookie).unwrap(),
        SocketStatus::Established {
            peer_smc: true,
            passive: true
        }
    ));
    drop(client);
    drop(server);
    drop(listener);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<_> = [ccookie, scookie, lcookie]
            .iter()
            .map(|&c| r.status_by_cookie(c).unwrap())
            .filter(|s| *s != SocketStatus::Untracked)
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "entries not removed at TCP_CLOSE: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn take_peer_offered_smc_reads_and_removes_the_entry() {
    let r = rdv();
    let lfd = tcp_socket(Fam::V4);
    r.opt_in(lfd.as_fd()).unwrap();
    let port = bind_listen(&lfd, Fam::V4);
    let listener = into_listener(lfd);
    let cfd = tcp_socket(Fam::V4);
    r.opt_in(cfd.as_fd()).unwrap();
    connect(&cfd, Fam::V4, port);
    let client = into_stream(cfd);
    let (server, _) = listener.accept().unwrap();
    for s in [client.as_fd(), server.as_fd()] {
        let cookie = smc_bpf::socket_cookie(s).unwrap();
        assert!(r.take_peer_offered_smc(s).unwrap(), "the peer offered SMC");
        assert_eq!(
            r.status_by_cookie(cookie).unwrap(),
            SocketStatus::Untracked,
            "taken: the entry is gone"
        );
        assert!(
            !r.take_peer_offered_smc(s).unwrap(),
            "a second take finds nothing"
        );
    }
    // a socket that was not opted in has no entry
    let plain = tcp_socket(Fam::V4);
    connect(&plain, Fam::V4, port);
    let (_other, _) = listener.accept().unwrap();
    assert!(!r.take_peer_offered_smc(plain.as_fd()).unwrap());
    r.forget(listener.as_fd());
}

// ----- two processes share one pinned instance -----

const CHILD_PORT_ENV: &str = "SMC_BPF_TEST_CHILD_PORT";
const NOPRIV_ENV: &str = "SMC_BPF_TEST_NOPRIV_CHILD";

/// The child half of `two_processes_share_one_pinned_instance`.
fn child_process_connects() {
    let Ok(port) = std::env::var(CHILD_PORT_ENV) else {
        return;
    };
    let port: u16 = port.parse().unwrap();
    let r = Rendezvous::open().unwrap_or_else(|e| panic!("child open: {e}"));
    let fd = tcp_socket(Fam::V4);
    r.opt_in(fd.as_fd()).unwrap();
    connect(&fd, Fam::V4, port);
    let mut s = into_stream(fd);
    let peer = r.peer_offered_smc(s.as_fd()).unwrap();
    println!(
        "CHILD-RESULT prog_id={} map_id={} loaded={} peer={}",
        r.prog_id(),
        r.map_id(),
        r.loaded_by_this_open(),
        peer
    );
    s.write_all(b"x").unwrap();
    r.forget(s.as_fd());
}

#[test]
fn two_processes_share_one_pinned_instance() {
    // Started by this very test as its child process: do the child's part.
    if std::env::var(CHILD_PORT_ENV).is_ok() {
        child_process_connects();
        return;
    }
    let r = rdv();
    let lfd = tcp_socket(Fam::V4);
    r.opt_in(lfd.as_fd()).unwrap();
    let port = bind_listen(&lfd, Fam::V4);
    let listener = into_listener(lfd);

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "two_processes_share_one_pinned_instance",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_PORT_ENV, port.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut server = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let exited = child.try_wait().unwrap().is_some();
                if exited || Instant::now() > deadline {
                    let _ = child.kill();
                    let out = child.wait_with_output().unwrap();
                    panic!(
                        "child never connected: {}\n{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    server.set_nonblocking(false).unwrap();
    assert!(
        r.peer_offered_smc(server.as_fd()).unwrap(),
        "child's SYN must carry the option"
    );
    let mut b = [0u8; 1];
    server.read_exact(&mut b).unwrap();
    r.forget(server.as_fd());

    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.find("CHILD-RESULT").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("child printed no result (did the helper test run?): {stdout}"));
    assert!(
        line.contains(&format!("prog_id={} ", r.prog_id())),
        "child uses another program: {line}"
    );
    assert!(
        line.contains(&format!("map_id={} ", r.map_id())),
        "child uses another map: {line}"
    );
    assert!(
        line.contains("loaded=false"),
        "child must reuse the pinned instance: {line}"
    );
    assert!(
        line.contains("peer=true"),
        "child must see the SYN-ACK option: {line}"
    );
}

// ----- no privilege -----

/// The capability-less child half of `no_privilege_is_a_typed_error`.
fn child_without_capabilities() {
    if std::env::var(NOPRIV_ENV).is_err() {
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status.lines().find(|l| l.starts_with("CapEff:")).unwrap();
    assert!(
        eff.trim_start_matches("CapEff:")
            .trim()
            .chars()
            .all(|c| c == '0'),
        "still privileged: {eff}"
    );
    // A namespace nobody installed: without capabilities a process can only open an
    // installed instance (see `unprivileged_users_open_an_installed_instance_as_its_modes_allow`).
    let cfg = Config {
        namespace: format!("smc-rs-never-installed-{}", std::process::id()),
        ..Config::default()
    };
    match Rendezvous::open_with(&cfg) {
        Err(e @ RendezvousError::NoPrivilege { .. }) => {
            let RendezvousError::NoPrivilege { missing, .. } = &e else {
                unreachable!()
            };
            assert!(
                missing.contains(&"CAP_BPF") && missing.contains(&"CAP_NET_ADMIN"),
                "{e}"
            );
            assert!(e.to_string().contains("smc-rendezvous install"), "{e}");
            assert_eq!(e.fallback_reason(), "rendezvous-no-privilege");
            println!("NOPRIV-RESULT ok: {e}");
        }
        other => panic!("expected NoPrivilege, got {other:?}"),
    }
}

#[test]
fn no_privilege_is_a_typed_error() {
    // Started by this very test as its child process: do the child's part.
    if std::env::var(NOPRIV_ENV).is_ok() {
        child_without_capabilities();
        return;
    }
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "no_privilege_is_a_typed_error",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(NOPRIV_ENV, "1");
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
    // async-signal-safe; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            // Empty the bounding set: a root exec then gets no capabilities at all.
            for cap in 0..64 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("NOPRIV-RESULT ok"),
        "helper did not run: {stdout}"
    );
}

// ----- install / reuse / crash recovery / uninstall, isolated from the shared instance -----

/// A namespace and a cgroup of this test's own (`smc-rs-TAG-PID`, under the
/// shared instance's cgroup), uninstalled and removed when the guard drops,
/// even after a failed assertion.
fn private_instance(tag: &str) -> (Config, std::path::PathBuf, PrivateCleanup) {
    let root = Rendezvous::shared()
        .map(|r| r.cgroup().to_path_buf())
        .unwrap_or_else(|e| panic!("{e}"));
    let pid = std::process::id();
    let cg = root.join(format!("smc-rs-{tag}-{pid}"));
    std::fs::create_dir_all(&cg).unwrap();
    let cfg = Config {
        namespace: format!("smc-rs-{tag}-{pid}"),
        cgroup: Some(cg.clone()),
        ..Config::default()
    };
    let guard = PrivateCleanup(cfg.clone(), cg.clone());
    (cfg, cg, guard)
}

struct PrivateCleanup(Config, std::path::PathBuf);

impl Drop for PrivateCleanup {
    fn drop(&mut self) {
        let _ = smc_bpf::uninstall(&self.0);
        let _ = std::fs::remove_dir(&self.1);
    }
}

#[test]
fn install_reuse_recover_and_uninstall_in_a_private_cgroup() {
    require_root();
    let (cfg, cg, _cleanup) = private_instance("test");
    let _ = smc_bpf::uninstall(&cfg);

    let a = Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert!(a.loaded_by_this_open());
    assert!(a.pin_dir().join("prog").exists() && a.pin_dir().join("cookies").exists());
    assert_eq!(smc_bpf::attached_programs(&cg).unwrap(), vec![a.prog_id()]);

    let b = Rendezvous::open_with(&cfg).unwrap();
    assert!(!b.loaded_by_this_open(), "second open must reuse the pins");
    assert_eq!((b.prog_id(), b.map_id()), (a.prog_id(), a.map_id()));
    assert_eq!(
        smc_bpf::attached_programs(&cg).unwrap(),
        vec![a.prog_id()],
        "attach is idempotent"
    );

    // A crash between pinning the map and pinning the program leaves a map without program:
    // the next opener must replace it instead of reusing a half-installed instance.
    let old = (a.prog_id(), a.map_id());
    smc_bpf::uninstall(&cfg).unwrap();
    let c = Rendezvous::open_with(&cfg).unwrap();
    std::fs::remove_file(c.pin_dir().join("prog")).unwrap();
    let stale_map = c.map_id();
    let d = Rendezvous::open_with(&cfg).unwrap();
    assert!(
        d.loaded_by_this_open(),
        "half-installed instance must be replaced"
    );
    assert_ne!(d.map_id(), stale_map);
    assert_ne!((d.prog_id(), d.map_id()), old);
    // The half-installed `c` left its program attached but unpinned: an orphan, which the
    // fresh install of `d` detached.
    assert_eq!(
        smc_bpf::attached_programs(&cg).unwrap(),
        vec![d.prog_id()],
        "orphan of c must be detached"
    );

    // Pins lost while attached (bpffs wiped): the next install detaches the orphan.
    let e_dir = d.pin_dir().to_path_buf();
    let d_id = d.prog_id();
    drop(d);
    std::fs::remove_file(e_dir.join("prog")).unwrap();
    std::fs::remove_file(e_dir.join("cookies")).unwrap();
    std::fs::remove_dir(&e_dir).unwrap();
    let d = Rendezvous::open_with(&cfg).unwrap();
    assert!(d.loaded_by_this_open());
    assert_ne!(d.prog_id(), d_id);
    assert_eq!(
        smc_bpf::attached_programs(&cg).unwrap(),
        vec![d.prog_id()],
        "orphan {d_id} still attached"
    );
    assert_eq!(smc_bpf::detach_orphans(&cfg).unwrap(), Vec::<u32>::new());

    let report = smc_bpf::uninstall(&cfg).unwrap();
    assert_eq!(report.removed.len(), 1, "{report:?}");
    assert_eq!(report.detached, 1, "{report:?}");
    assert!(!cfg.namespace_dir().exists(), "namespace dir removed");
    assert_eq!(smc_bpf::attached_programs(&cg).unwrap(), Vec::<u32>::new());
    assert_eq!(
        smc_bpf::uninstall(&cfg).unwrap(),
        smc_bpf::UninstallReport::default(),
        "idempotent"
    );
    drop((a, b, c, d));
    // The cgroup has no processes and nothing attached any more.
    std::fs::remove_dir(&cg).unwrap();
}

/// `smc-rendezvous status` looks and changes nothing: with nothing
/// installed it says so (exit 3) and leaves nothing loaded, pinned or
/// attached; once installed it shows the instance and that it is attached.
#[test]
fn status_shows_and_changes_nothing() {
    require_root();
    let (cfg, cg, _cleanup) = private_instance("status");
    let status = || {
        let out = Command::new(env!("CARGO_BIN_EXE_smc-rendezvous"))
            .args(["--namespace", &cfg.namespace, "--cgroup"])
            .arg(&cg)
            .arg("status")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };

    let (code, said) = status();
    assert_eq!(code, Some(3), "{said}");
    assert!(said.starts_with("not installed"), "{said}");
    assert!(!cfg.namespace_dir().exists(), "status installed something");
    assert_eq!(smc_bpf::attached_programs(&cg).unwrap(), Vec::<u32>::new());

    let r = Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
    let (code, said) = status();
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains(&format!(
            "prog_id={} map_id={} loaded_now=false",
            r.prog_id(),
            r.map_id()
        )),
        "{said}"
    );
    assert!(said.contains("attached: yes"), "{said}");

    // and once uninstalled, not installed again
    drop(r);
    smc_bpf::uninstall(&cfg).unwrap();
    let (code, said) = status();
    assert_eq!(code, Some(3), "{said}");
    assert!(!cfg.namespace_dir().exists(), "status installed something");
}

// ----- two builds attached at once (upgrade) -----

#[test]
fn two_instances_attached_at_the_root_do_not_disturb_each_other() {
    let r1 = rdv();
    let pid = std::process::id();
    let cfg2 = Config {
        namespace: format!("smc-rs-coexist-{pid}"),
        ..Config::default()
    };
    struct Cleanup(Config);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = smc_bpf::uninstall(&self.0);
        }
    }
    let _cleanup = Cleanup(cfg2.clone());
    let r2 = Rendezvous::open_with(&cfg2).unwrap_or_else(|e| panic!("{e}"));
    assert!(r2.loaded_by_this_open());
    assert_ne!(r1.prog_id(), r2.prog_id());
    let attached = smc_bpf::attached_programs(r1.cgroup()).unwrap();
    assert!(
        attached.contains(&r1.prog_id()) && attached.contains(&r2.prog_id()),
        "{attached:?}"
    );

    // Sockets opted in with either instance get exactly one option and correct answers.
    for r in [r1, &r2] {
        let o = run_case_with(r, Fam::V4, true, true);
        assert!(
            o.client_peer && o.server_peer,
            "prog {}: {o:?}",
            r.prog_id()
        );
        assert!(
            o.syn_on_wire.iter().chain(&o.synack_on_wire).all(|&x| x),
            "{o:?}"
        );
        assert_eq!(o.max_copies, 1, "{o:?}");
        let plain = run_case_with(r, Fam::V4, false, true);
        assert!(!plain.client_peer && !plain.server_peer, "{plain:?}");
        assert!(
            plain.synack_on_wire.iter().all(|&x| !x),
            "no echo without an offer: {plain:?}"
        );
        // Only the owning instance reserves space on the SYN: option + 2 NOPs, nothing more.
        assert_eq!(
            o.syn_hdr_len,
            plain.syn_hdr_len + 8,
            "SYN grew by more than the option: {o:?} vs {plain:?}"
        );
    }
}

// ----- racing first opens -----

const RACE_ENV: &str = "SMC_BPF_TEST_RACE_NS";

/// The child half of `racing_first_opens_load_exactly_once`.
fn child_open_private() {
    let Ok(spec) = std::env::var(RACE_ENV) else {
        return;
    };
    let (ns, cg) = spec.split_once(':').unwrap();
    let cfg = Config {
        namespace: ns.to_string(),
        cgroup: Some(cg.into()),
        ..Config::default()
    };
    let r = Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "RACE-RESULT prog_id={} loaded={}",
        r.prog_id(),
        r.loaded_by_this_open()
    );
}

#[test]
fn racing_first_opens_load_exactly_once() {
    // Started by this very test as its child process: do the child's part.
    if std::env::var(RACE_ENV).is_ok() {
        child_open_private();
        return;
    }
    require_root();
    let (cfg, cg, _cleanup) = private_instance("race");

    let children: Vec<_> = (0..6)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "racing_first_opens_load_exactly_once",
                    "--nocapture",
                ])
                .env(RACE_ENV, format!("{}:{}", cfg.namespace, cg.display()))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut results = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "child failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.find("RACE-RESULT").map(|i| l[i..].to_string()))
            .unwrap_or_else(|| panic!("no result: {stdout}"));
        results.push(line);
    }
    let loaded = results
        .iter()
        .filter(|l| l.ends_with("loaded=true"))
        .count();
    assert_eq!(loaded, 1, "exactly one process loads: {results:?}");
    let ids: Vec<&str> = results
        .iter()
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert!(
        ids.iter().all(|i| *i == ids[0]),
        "one shared program: {results:?}"
    );
    let id: u32 = ids[0].trim_start_matches("prog_id=").parse().unwrap();
    assert_eq!(smc_bpf::attached_programs(&cg).unwrap(), vec![id]);
}

// ----- use without privileges: the pins' modes decide -----

const ACCESS_ENV: &str = "SMC_BPF_TEST_ACCESS_CHILD";
/// The tests that change access modes (and the bpffs mount point's mode, which each puts
/// back) run one at a time.
static ACCESS_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
const NOBODY: u32 = 65534;

/// The child half of `unprivileged_users_open_an_installed_instance_as_its_modes_allow`, run
/// as uid/gid `nobody`: opens the namespace named in the environment and either uses it (opt a
/// socket in, read its status back, forget it) or reports the error.
fn child_open_as_nobody(spec: &str) {
    let mut it = spec.split(',');
    let (ns, cg) = (it.next().unwrap(), it.next().unwrap());
    let cfg = Config {
        namespace: ns.to_string(),
        cgroup: Some(cg.into()),
        ..Config::default()
    };
    match Rendezvous::open_with(&cfg) {
        Ok(r) => {
            let s = tcp_socket(Fam::V4);
            r.opt_in(s.as_fd())
                .unwrap_or_else(|e| panic!("opt_in: {e}"));
            assert_eq!(r.status(s.as_fd()).unwrap(), SocketStatus::OptedIn);
            r.forget(s.as_fd());
            assert_eq!(r.status(s.as_fd()).unwrap(), SocketStatus::Untracked);
            println!("ACCESS-RESULT ok prog={} map={}", r.prog_id(), r.map_id());
        }
        Err(e) => println!("ACCESS-RESULT err {} {e}", e.fallback_reason()),
    }
}

#[test]
fn unprivileged_users_open_an_installed_instance_as_its_modes_allow() {
    if let Ok(spec) = std::env::var(ACCESS_ENV) {
        child_open_as_nobody(&spec);
        return;
    }
    require_root();
    use smc_bpf::Access;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let _serial = ACCESS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = rdv().cgroup().to_path_buf();
    let pid = std::process::id();
    let cg = root.join(format!("smc-rs-test-access-{pid}"));
    std::fs::create_dir_all(&cg).unwrap();
    let cfg = Config {
        namespace: format!("smc-rs-test-access-{pid}"),
        cgroup: Some(cg.clone()),
        ..Config::default()
    };
    // Our build may sit where `nobody` cannot reach it (CI's checkout under /root).
    let exe = std::env::temp_dir().join(format!("smc-bpf-access-test-{pid}"));
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    // `set_access` gives others the search bit on the bpffs mount point: put its mode back.
    let bpffs_mode = std::fs::metadata(&cfg.bpffs).unwrap().permissions().mode();
    struct Cleanup(Config, std::path::PathBuf, std::path::PathBuf, u32);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = smc_bpf::uninstall(&self.0);
            let _ = std::fs::remove_dir(&self.1);
            let _ = std::fs::remove_file(&self.2);
            let _ =
                std::fs::set_permissions(&self.0.bpffs, std::fs::Permissions::from_mode(self.3));
        }
    }
    let _cleanup = Cleanup(cfg.clone(), cg.clone(), exe.clone(), bpffs_mode);
    const ARGS: [&str; 4] = [
        "--exact",
        "unprivileged_users_open_an_installed_instance_as_its_modes_allow",
        "--nocapture",
        "--test-threads=1",
    ];
    let spec = format!("{},{}", cfg.namespace, cg.display());
    let run = |mut cmd: Command| -> String {
        let out = cmd.env(ACCESS_ENV, &spec).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "child failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.find("ACCESS-RESULT").map(|i| l[i..].to_string()))
            .unwrap_or_else(|| panic!("child did not run: {stdout}"))
    };
    let run_child = |gid: u32| {
        let mut cmd = Command::new(&exe);
        cmd.args(ARGS).uid(NOBODY).gid(gid);
        run(cmd)
    };
    let run_child_with_caps = || {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=+bpf,+net_admin",
            "--ambient-caps=+bpf,+net_admin",
            "--",
        ])
        .arg(&exe)
        .args(ARGS);
        run(cmd)
    };

    // Not installed: nothing to open, and no privilege to install (or, while the bpffs mount
    // point is not searchable for others, nothing reachable: the same advice).
    let line = run_child(NOBODY);
    let searchable = bpffs_mode & 0o001 != 0;
    let expected = if searchable {
        "err rendezvous-no-privilege"
    } else {
        "err rendezvous-access-denied"
    };
    assert!(line.contains(expected), "{line}");
    assert!(line.contains("smc-rendezvous install"), "{line}");

    // Installed by a privileged process on its own: root only.
    let r = Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        smc_bpf::access_of(&cfg.namespace_dir()).unwrap(),
        Access::Root
    );
    let line = run_child(NOBODY);
    assert!(line.contains("err rendezvous-access-denied"), "{line}");
    assert!(line.contains(&format!("uid {NOBODY}")), "{line}");

    // The administrator's command, for this private instance.
    let install = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_smc-rendezvous"))
            .args(["--namespace", &cfg.namespace, "--cgroup"])
            .arg(&cg)
            .arg("install")
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "smc-rendezvous install {extra:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };

    // Opened to every user: nobody uses the same map and program.
    let said = install(&[]);
    assert!(
        said.contains("usable without privileges by: every user"),
        "{said}"
    );
    assert_eq!(
        smc_bpf::access_of(&cfg.namespace_dir()).unwrap(),
        Access::Everyone
    );
    let line = run_child(NOBODY);
    assert!(
        line.contains(&format!("ok prog={} map={}", r.prog_id(), r.map_id())),
        "{line}"
    );

    // A build installed later by a root process (here this build again, its pins gone) takes
    // the access the namespace has.
    let pin_dir = cfg.pin_dir();
    for pin in ["prog", "cookies"] {
        std::fs::remove_file(pin_dir.join(pin)).unwrap();
    }
    std::fs::remove_dir(&pin_dir).unwrap();
    let r2 = Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert!(r2.loaded_by_this_open());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&pin_dir), 0o755);
    assert_eq!(mode(&pin_dir.join("cookies")), 0o666);
    assert_eq!(mode(&pin_dir.join("prog")), 0o644);
    let line = run_child(NOBODY);
    assert!(
        line.contains(&format!("ok prog={}", r2.prog_id())),
        "{line}"
    );
    drop(r);
    // A service that keeps CAP_BPF and CAP_NET_ADMIN but runs as an ordinary uid: it may not
    // install (bpffs is root's), and must still use what is installed for it.
    let line = run_child_with_caps();
    assert!(
        line.contains(&format!("ok prog={}", r2.prog_id())),
        "with capabilities: {line}"
    );

    // Opened to one group: its members only.
    let said = install(&["--group", &NOBODY.to_string()]);
    assert!(
        said.contains(&format!(
            "usable without privileges by: root and group {NOBODY}"
        )),
        "{said}"
    );
    let line = run_child(NOBODY);
    assert!(line.contains("ok prog="), "member of the group: {line}");
    let line = run_child(NOBODY - 1);
    assert!(
        line.contains("err rendezvous-access-denied"),
        "not a member: {line}"
    );

    // Back to root only; a build installed later keeps what the namespace says.
    let said = install(&["--root-only"]);
    assert!(
        said.contains("usable without privileges by: root only"),
        "{said}"
    );
    let line = run_child(NOBODY);
    assert!(line.contains("err rendezvous-access-denied"), "{line}");
}

const LATER_ENV: &str = "SMC_BPF_TEST_LATER_CHILD";

/// The child half of `a_running_program_gets_the_rendezvous_once_installed_for_it`, as
/// `nobody`: the host's instance is not open to it at first; once the parent says `go` it is.
fn child_installed_later() {
    let first = Rendezvous::shared()
        .map(|_| ())
        .map_err(|e| e.fallback_reason());
    println!("LATER first={first:?}");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let r = loop {
        match Rendezvous::shared() {
            Ok(r) => break r,
            Err(e) if Instant::now() > deadline => {
                println!("LATER still {}", e.fallback_reason());
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let s = tcp_socket(Fam::V4);
    r.opt_in(s.as_fd()).unwrap();
    r.forget(s.as_fd());
    println!("LATER then=ok");
}

#[test]
fn a_running_program_gets_the_rendezvous_once_installed_for_it() {
    if std::env::var(LATER_ENV).is_ok() {
        child_installed_later();
        return;
    }
    use smc_bpf::Access;
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    require_root();
    rdv();
    let _serial = ACCESS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = Config::default();
    let pid = std::process::id();
    let prev = smc_bpf::access_of(&cfg.namespace_dir()).unwrap();
    let bpffs_mode = std::fs::metadata(&cfg.bpffs).unwrap().permissions().mode();
    let exe = std::env::temp_dir().join(format!("smc-bpf-later-test-{pid}"));
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    struct Restore(Access, u32, std::path::PathBuf);
    impl Drop for Restore {
        fn drop(&mut self) {
            let cfg = Config::default();
            let _ = smc_bpf::set_access(&cfg, self.0);
            let _ = std::fs::set_permissions(&cfg.bpffs, std::fs::Permissions::from_mode(self.1));
            let _ = std::fs::remove_file(&self.2);
        }
    }
    let _restore = Restore(prev, bpffs_mode, exe.clone());
    smc_bpf::set_access(&cfg, Access::Root).unwrap();
    let mut child = Command::new(&exe)
        .args([
            "--exact",
            "a_running_program_gets_the_rendezvous_once_installed_for_it",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(LATER_ENV, "1")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut next = |marker: &str| loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
        if let Some(i) = line.find(marker) {
            return line[i..].trim().to_string();
        }
    };
    let first = next("LATER ");
    assert!(first.contains("first=Err("), "{first}");
    // `smc-rendezvous install` while the program runs
    smc_bpf::set_access(&cfg, Access::Everyone).unwrap();
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    let then = next("LATER ");
    assert_eq!(then, "LATER then=ok");
    assert!(child.wait().unwrap().success());
}
