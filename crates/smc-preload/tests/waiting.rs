//! Connections a server lets wait, under smc_run as on plain TCP
//! (tests/waiting.c): an iterative server (blocking accepts, or poll then
//! accept as Python's `socketserver`) that serves its first client for 7 s
//! while two more connect, one that serves nine clients that come at once
//! for a second each, the first kind in a daemon's child (it listens, forks
//! and exits), and a server that accepts three connections and uses them
//! 7 s later. Over TCP the clients' connects complete in the kernel; an
//! SMC client waits for the server's CLC Accept and gives up after 6 s (as
//! Linux's), so the library runs the handshakes of the connections the
//! program lets wait (src/rescue.rs for those in the accept queue,
//! src/late.rs for those accepted and not used): every client gets its
//! answer, every server read its client's address, every connection over
//! SMC-R. (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;
use std::io::Read;
use std::process::Stdio;
use std::time::Duration;

/// Holds the first client (or, `late`, all three) past the clients' 6 s.
const HOLD: &str = "7";

fn serve_three(mode: &str) {
    serve(mode, HOLD, 3);
}

/// `waiting server` (`mode`, `hold` seconds) and `n` clients, 300 ms apart:
/// every connection over SMC-R.
fn serve(mode: &str, hold: &str, n: usize) {
    let s = serve_only(mode, hold, n);
    // (every connection, both ends, over SMC-R)
    assert_eq!(assert_all(&s, 2 * n, " SMC-R").len(), 2 * n);
}

/// `waiting server` and its clients as [`serve`]; every client answered,
/// every server read its client's address. Returns the run for its modes.
fn serve_only(mode: &str, hold: &str, n: usize) -> Setup {
    let s = setup(&format!("waiting-{mode}"));
    let exe = compile_c("waiting", &s.dir);
    let portfile = s.dir.join("port");
    let pf = portfile.to_str().unwrap();
    let count = n.to_string();
    let server = under(&s, true, &exe, &["server", pf, mode, hold, &count])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(server);
    let port = wait_for_port(&portfile)
        .expect("the server's port")
        .to_string();
    let ids: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
    let mut clients = Vec::new();
    for id in &ids {
        let c = under(&s, true, &exe, &["client", &port, id])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        clients.push((id, c));
        std::thread::sleep(Duration::from_millis(300));
    }
    for (id, c) in clients {
        let out = c.wait_with_output().unwrap();
        let text = ok_output(&format!("client {id} ({mode})"), &out);
        assert!(
            text.contains(&format!("client {id} got hello {id} from ")),
            "client {id} ({mode}): {text}"
        );
    }
    let mut stdout = server.0.stdout.take().unwrap();
    let status = server.0.wait().unwrap();
    let mut text = String::new();
    stdout.read_to_string(&mut text).unwrap();
    assert!(status.success(), "server ({mode}): {status}\n{text}");
    for id in &ids {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("server read hello {id} from "))
                    && l.ends_with("(the peer's port matches)")),
            "server ({mode}): {text}"
        );
    }
    s
}

#[test]
fn an_iterative_server_s_waiting_clients_connect_over_smc_r() {
    serve_three("accept");
}

#[test]
fn a_server_that_polls_then_accepts_has_its_waiting_clients_over_smc_r() {
    serve_three("poll");
}

#[test]
fn connections_accepted_and_used_later_connect_over_smc_r() {
    serve_three("late");
}

#[test]
fn a_server_that_accepts_fewer_than_come_has_its_waiting_clients_over_smc_r() {
    // (one a second: the ninth waits about 8 s to be accepted)
    serve("steady", "1", 9);
}

#[test]
fn a_daemon_s_waiting_clients_connect_over_smc_r() {
    // (it listens, forks and exits: the child serves)
    serve("daemon", HOLD, 3);
}

/// A prefork server (its processes share the listener; here one accepts and
/// serves, the other lives on without accepting) whose processes are all
/// busy: the library takes no connection out of a queue other processes
/// accept from (`rescue.rs`), so the clients that wait there have no
/// Accept within their CLC wait. Each declines and goes on over TCP (the
/// server's answer, when it comes, taken off its stream): every client is
/// served late, as over TCP, where Linux's SMC client would fail its
/// connect. The first client, accepted at once, has its handshake run
/// while its server holds it (`late.rs`): SMC-R.
#[test]
fn a_busy_prefork_server_s_waiting_clients_fall_back_and_are_served() {
    let s = serve_only("prefork", HOLD, 3);
    let modes = s.modes();
    assert_eq!(modes.len(), 6, "{modes:?}");
    let smc = modes.iter().filter(|m| m.ends_with(" SMC-R")).count();
    assert_eq!(
        smc, 2,
        "the first client's connection, both ends: {modes:?}"
    );
    let gave_up = modes
        .iter()
        .filter(|m| m.contains("TCP 0x02000000"))
        .count();
    assert_eq!(gave_up, 2, "the waiting clients: {modes:?}");
    let declined = modes
        .iter()
        .filter(|m| m.contains("TCP 0x05000000") && m.contains("0x02000000"))
        .count();
    assert_eq!(
        declined, 2,
        "their server's ends, declined by them: {modes:?}"
    );
}
