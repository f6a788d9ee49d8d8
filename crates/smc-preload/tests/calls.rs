//! `smc_run` and the preload library with a plain C program (tests/echo.c,
//! which knows nothing of SMC): an echo server using non-blocking sockets
//! with poll() or edge-triggered epoll, and a client that writes with
//! writev() while it polls for the echo, half-closes and checks every byte.
//! Each connection's mode is the library's record of it (`SMC_RUN_STATE`),
//! not an assumption. (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;

#[test]
fn both_sides_under_smc_run_talk_smc_r_with_poll() {
    let s = run("poll", true, true, false, 8 << 20);
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

#[test]
fn both_sides_under_smc_run_talk_smc_r_with_edge_triggered_epoll() {
    let s = run("epoll", true, true, true, 8 << 20);
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

#[test]
fn a_plain_server_gets_tcp_from_a_client_under_smc_run() {
    let s = run("plain-srv", false, true, false, 1 << 20);
    // the server's SYN-ACK had no SMC option: Linux's PEERNOSMC
    assert_modes(&s, &[("connect", "TCP 0x03010000")]);
}

#[test]
fn a_plain_client_gets_tcp_from_a_server_under_smc_run() {
    let s = run("plain-cli", true, false, true, 1 << 20);
    assert_modes(&s, &[("accept", "TCP 0x03010000")]);
}

/// One run of the conformance program: (server's output, client's output).
fn conform_run(s: &Setup, server_preload: bool, client_preload: bool) -> (String, String) {
    let exe = conform_program(s);
    let file = s.dir.join("sendfile-data");
    if !file.exists() {
        std::fs::write(&file, blob(300_000)).unwrap();
    }
    let portfile = s.dir.join("conform-port");
    let _ = std::fs::remove_file(&portfile);
    let srv = under(s, server_preload, &exe, &["server"])
        .arg(&portfile)
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let srv = Server(srv);
    let port = wait_for_port(&portfile).expect("the conformance server did not start");
    let cli = under(s, client_preload, &exe, &["client", &port.to_string()])
        .arg(&file)
        .output()
        .unwrap();
    let mut srv = srv;
    let child = std::mem::replace(&mut srv.0, Command::new("true").spawn().unwrap());
    let so = child.wait_with_output().unwrap();
    // (the server's side of the story goes with the client's failure too)
    assert!(
        cli.status.success(),
        "client {server_preload} {client_preload}: {:?} {}\n{}\nserver: {:?} {}\n{}",
        cli.status,
        String::from_utf8_lossy(&cli.stderr),
        String::from_utf8_lossy(&cli.stdout),
        so.status,
        String::from_utf8_lossy(&so.stderr),
        String::from_utf8_lossy(&so.stdout)
    );
    assert!(
        so.status.success(),
        "server {server_preload} {client_preload}: {:?} {}",
        so.status,
        String::from_utf8_lossy(&so.stderr)
    );
    (
        String::from_utf8_lossy(&so.stdout).into_owned(),
        String::from_utf8_lossy(&cli.stdout).into_owned(),
    )
}

/// The conformance test: the same scripted calls (tests/conform.c:
/// non-blocking connect, refused and accepted, with poll and edge-triggered
/// epoll; SO_ERROR; socket options; getsockname/getpeername; MSG_PEEK;
/// FIONREAD; partial reads under EPOLLET; select/pselect; EPOLLONESHOT in
/// an epoll set inside another; a level-triggered set whose interest
/// changes between waits (the library keeps such changes from the kernel
/// until the next wait: `src/interest.rs`), with a thread asleep in it,
/// and one that waits while two messages come and reads one byte (the
/// other shows at every wait, after the connection left the set and came
/// back too, and once the set is polled, there as well: the
/// library keeps that level itself where the kernel has the peer signal
/// edge-triggered, `poll::edge_here`, until the set is watched by the
/// kernel, `interest::materialize`); an
/// epoll data given by a connection taken out of the set (DEL, or MOD
/// without events) to another, whose first one's peer then writes (the
/// library turns the first one's peer signal off there: nothing shows
/// under the data until the other's peer writes), then whose first one's
/// peer shuts its sending down (its readiness descriptor, readable for
/// good, is taken out of the set or left there with no events,
/// `interest::quiet`: nothing shows under the data) and whose first one
/// then shuts its own down (EPOLLHUP under the data of the one left with
/// no events, as the kernel reports it for any registration); an epoll
/// data two connections share in a set while one asks for nothing there
/// (MOD without events, DEL, ADD or a move to the data without events, by
/// the one that had the data first or the one that came second), whose
/// other one's peer then writes (its event under the data, until read:
/// the library once attributed the data's events to the one that asks for
/// nothing, and dropped them); a pipe given a connection's data, which
/// the connection, asking for nothing, is changed or added back under
/// (the pipe's event);
/// reads through dup(); sendfile; half close
/// with EPOLLRDHUP; EPOLLHUP; EPIPE and SIGPIPE after the peer closed) give the same results, errno values and readiness events under
/// smc_run, both sides over SMC-R, as plain.
#[test]
fn conformance_under_smc_run_as_plain_tcp() {
    let s = setup("conform");
    let (ps, pc) = conform_run(&s, false, false);
    // what the script must have exercised (on plain TCP)
    for l in [
        "client connect = -1 EINPROGRESS",
        "client SO_ERROR refused ECONNREFUSED",
        "client epoll refused: OUT ERR HUP",
        "client epoll connected: OUT",
        "client epoll after a partial read (ET): none",
        "client recv MSG_PEEK all = 3000",
        "client epoll LT after FIONREAD and MSG_PEEK: IN",
        "client epoll after MOD with data unread (ET): IN",
        "client epoll new data after a partial read (ET): IN",
        "client read rest = 2001",
        "client epoll peer closed: IN OUT HUP RDHUP",
        "client write after the peer closed: EPIPE, SIGPIPE 1",
        "server epoll half close: IN RDHUP",
        "server FIONREAD = 5",
        "client epoll outer: IN",
        "client epoll ONESHOT again: none",
        "client epoll ONESHOT re-armed: IN",
        "client pselect = 1",
        "client sendfile 300000 bytes equal 1",
        "client epoll_ctl MOD after DEL (loop) = -1 ENOENT",
        "client epoll_ctl ADD IN again (loop) = -1 EEXIST",
        "client epoll loop OUT with data waiting: OUT",
        "client epoll loop new data: IN OUT",
        "client epoll loop one at a time: socket 1 pipe 1",
        "client thread woken: OUT",
        "client epoll LT after reading one of two: IN",
        "client epoll LT after reading one of two, again: IN",
        "client epoll LT taken out, a byte unread: none",
        "client epoll LT added again, a byte unread: IN",
        "client poll of the LT set with a byte unread: 1 IN",
        "client epoll LT polled, a byte unread: IN",
        "client read the other = 1",
        "client epoll LT after reading both: none",
        "client epoll given, A's peer wrote: 0",
        "client epoll given, B's peer wrote: 1",
        "client epoll given, B's peer wrote data 55: IN",
        "client epoll given by MOD, B's peer wrote: 0",
        "client epoll given by MOD, A's peer wrote: 1",
        "client epoll given by MOD, A's peer wrote data 66: IN",
        "client read B after its peer's shutdown = 0",
        "client epoll given by MOD, B's peer shut down: 0",
        "client epoll given by DEL, B's peer shut down: 0",
        "client epoll given by MOD, B over data 66: HUP",
        "client epoll given by DEL, B over: 0",
        "client epoll given by MOD after a wait, B's peer shut down: 0",
        "client epoll given by MOD after a wait, B over data 88: HUP",
        "client epoll shared, B MOD, A's peer wrote data 99: IN",
        "client epoll shared, B MOD, A's peer wrote (again) data 99: IN",
        "client epoll shared, B DEL, A's peer wrote data 99: IN",
        "client epoll shared, B ADD, A's peer wrote data 91: IN",
        "client epoll shared, B MOD to A's data, A's peer wrote data 92: IN",
        "client epoll shared, B MOD, all read: 0",
        "client epoll shared, A DEL, B's peer wrote data 95: IN",
        "client epoll shared, A MOD, B's peer wrote data 95: IN",
        "client epoll shared, A MOD, all read: 0",
        "client epoll pipe, B MOD, written data 94: IN",
        "client epoll pipe, B DEL, written data 94: IN",
        "client epoll pipe, A ADD, written data 89: IN",
        "client epoll pipe, A ADD, all read: 0",
        "client splice socket to socket = -1 EINVAL",
    ] {
        assert!(pc.contains(l) || ps.contains(l), "plain run lacks {l:?}");
    }
    assert!(s.modes().is_empty());
    let (ss, sc) = conform_run(&s, true, true);
    assert_same(&ps, &ss, "server under smc_run");
    assert_same(&pc, &sc, "client under smc_run");
    // the script's four connections, both ends
    let modes = s.modes();
    assert_eq!(modes.len(), 8, "{modes:?}");
    assert!(modes.iter().all(|m| m.ends_with(" SMC-R")), "{modes:?}");
}

/// The same with one side plain: the other falls back, transparently.
#[test]
fn conformance_with_one_side_plain_as_plain_tcp() {
    let s = setup("conform-fallback");
    let (ps, pc) = conform_run(&s, false, false);
    for (sp, cp) in [(true, false), (false, true)] {
        let _ = std::fs::remove_file(s.dir.join("state"));
        let (ss, sc) = conform_run(&s, sp, cp);
        assert_same(&ps, &ss, &format!("server (smc_run: {sp})"));
        assert_same(&pc, &sc, &format!("client (smc_run: {cp})"));
        let modes = s.modes();
        assert_eq!(modes.len(), 4, "{modes:?}");
        assert!(
            modes
                .iter()
                .all(|m| m.ends_with("(peer did not indicate SMC)")),
            "{modes:?}"
        );
    }
}

/// A non-blocking connect whose handshake the peer breaks (its SYN-ACK
/// offers SMC, then it answers the CLC proposal with bytes that are no CLC
/// message) ends with an error in SO_ERROR, as a failed connect does.
#[test]
fn a_broken_handshake_after_a_non_blocking_connect_is_an_so_error() {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    let s = setup("broken-handshake");
    let exe = conform_program(&s);
    // a listener opted in to the SMC option, that speaks no CLC
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    assert!(smc::opt_in(sock.as_fd()), "the rendezvous (root)");
    rustix::net::bind(
        &sock,
        &"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap(),
    )
    .unwrap();
    rustix::net::listen(&sock, 4).unwrap();
    let l = std::net::TcpListener::from(sock);
    let port = l.local_addr().unwrap().port();
    let srv = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut proposal = [0u8; 8];
        let _ = c.read(&mut proposal);
        c.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n").unwrap();
    });
    let out = under(&s, true, &exe, &["connect", &port.to_string()])
        .output()
        .unwrap();
    srv.join().unwrap();
    let text = ok_output("conform connect", &out);
    assert!(text.contains("connect connect = -1 EINPROGRESS"), "{text}");
    assert!(text.contains("connect poll = 1"), "{text}");
    assert!(text.contains("connect SO_ERROR EPROTO"), "{text}");
}
