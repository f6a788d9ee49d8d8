//! Real programs from Debian's packages (.ci/run installs them), each with
//! both sides under smc_run (every connection SMC-R, by the library's
//! record) and with one side plain (every connection a transparent
//! fallback); output checked.
//! (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;

#[test]
fn python_http_server_and_curl_over_smc_r() {
    let s = http_server_and_curl("http", true, true);
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

#[test]
fn python_http_server_under_smc_run_and_plain_curl_fall_back() {
    let s = http_server_and_curl("http-plain", true, false);
    assert_modes(&s, &[("accept", "TCP 0x03010000")]);
}

/// socat in both roles (select()-driven; its server forks `cat`, whose copy
/// of the connection must not close it, and exits without closing its
/// socket, whose data must still arrive): what the client sends comes back
/// through `cat`.
/// Several rounds, one connection each (the forked `cat` closes its copy
/// of the connection at varying moments).
fn socat_echo(tag: &str, server_preload: bool, client_preload: bool, rounds: usize) -> Setup {
    let s = setup(tag);
    let body = blob(3 << 20);
    let input = s.dir.join("input");
    std::fs::write(&input, &body).unwrap();
    for _ in 0..rounds {
        socat_round(&s, &input, &body, server_preload, client_preload);
    }
    s
}

fn socat_round(s: &Setup, input: &Path, body: &[u8], server_preload: bool, client_preload: bool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let socat = program("socat");
    let listen = format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr");
    let _srv = Server(
        under(
            s,
            server_preload,
            &socat,
            &["-t", "10", &listen, "EXEC:cat"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let connect = format!("TCP:127.0.0.1:{port}");
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let out = under(s, client_preload, &socat, &["-t", "10", "-", &connect])
            .stdin(std::fs::File::open(input).unwrap())
            .stderr(Stdio::null())
            .output()
            .unwrap();
        if out.status.success() && !out.stdout.is_empty() {
            assert_eq!(out.stdout.len(), body.len());
            assert_eq!(sha256(&out.stdout), sha256(body), "what came back");
            return;
        }
        // (the server is not listening yet: connection refused)
        assert!(Instant::now() < end, "socat client: {:?}", out.status);
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn socat_both_roles_over_smc_r() {
    let s = socat_echo("socat", true, true, 3);
    let modes = s.modes();
    assert_eq!(modes.len(), 6, "{modes:?}");
    assert!(modes.iter().all(|m| m.ends_with(" SMC-R")), "{modes:?}");
}

#[test]
fn socat_client_under_smc_run_with_a_plain_socat_server_falls_back() {
    let s = socat_echo("socat-plain", false, true, 1);
    assert_modes(&s, &[("connect", "TCP 0x03010000")]);
}

#[test]
fn redis_server_and_benchmark_over_smc_r() {
    let s = redis("redis", true, true);
    // 2 x (50 clients and the benchmark's own) + 3 redis-cli, both ends
    assert_all(&s, 2 * (2 * 51 + 3), " SMC-R");
}

#[test]
fn redis_with_one_side_plain_falls_back() {
    let s = redis("redis-plain-cli", true, false);
    assert_all(&s, 2 * 51 + 3, FALLBACK);
    let s = redis("redis-plain-srv", false, true);
    assert_all(&s, 2 * 51 + 3, FALLBACK);
}

/// A number after `key` in iperf3's JSON (the first occurrence after `after`).
fn json_number(text: &str, after: &str, key: &str) -> f64 {
    let at = text
        .find(after)
        .unwrap_or_else(|| panic!("no {after} in {text}"));
    let rest = &text[at..];
    let k = rest
        .find(key)
        .unwrap_or_else(|| panic!("no {key} after {after}"));
    rest[k + key.len()..]
        .trim_start_matches([':', ' '])
        .split([',', '\n', '}'])
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no number for {key}"))
}

/// iperf3 in both directions (-R): a fixed number of bytes, all received.
fn iperf3(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    let s = setup(tag);
    let iperf = program("iperf3");
    for reverse in [false, true] {
        let port = free_port().to_string();
        let mut srv = Server(
            under(
                &s,
                server_preload,
                &iperf,
                &["-s", "-1", "--forceflush", "-B", "127.0.0.1", "-p", &port],
            )
            .stdout(Stdio::piped())
            // (kept for a failure's message: a library that aborted says why there)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        );
        wait_for_line(&mut srv.0, "Server listening");
        let mut args = vec!["-c", "127.0.0.1", "-p", &port, "-n", "256M", "-J"];
        if reverse {
            args.push("-R");
        }
        let out = under(&s, client_preload, &iperf, &args).output().unwrap();
        let text = ok_output("iperf3", &out);
        let sent = json_number(&text, "\"sum_sent\"", "\"bytes\"");
        let got = json_number(&text, "\"sum_received\"", "\"bytes\"");
        assert!(sent >= 256.0 * 1024.0 * 1024.0, "sent {sent}");
        // (the receiver's count stops when the sender's end arrives on the
        // control connection, a little before the last data: also on TCP)
        assert!(
            got > 0.95 * sent && got <= sent,
            "iperf3 -R {reverse}: received {got} of {sent}"
        );
        let st = srv.0.wait().unwrap();
        let mut err = String::new();
        if let Some(mut e) = srv.0.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        assert!(st.success(), "iperf3 -R {reverse} server: {st:?}\n{err}");
    }
    s
}

#[test]
fn iperf3_both_directions_over_smc_r() {
    let s = iperf3("iperf3", true, true);
    // control and data connection per run, both ends
    assert_all(&s, 8, " SMC-R");
}

#[test]
fn iperf3_with_one_side_plain_falls_back() {
    let s = iperf3("iperf3-plain-cli", true, false);
    assert_all(&s, 4, FALLBACK);
    let s = iperf3("iperf3-plain-srv", false, true);
    assert_all(&s, 4, FALLBACK);
}

/// sockperf ping-pong and throughput against one server.
fn sockperf(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    let s = setup(tag);
    let sp = program("sockperf");
    let port = free_port().to_string();
    let mut srv = Server(
        under(
            &s,
            server_preload,
            &sp,
            &["sr", "--tcp", "-i", "127.0.0.1", "-p", &port],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    wait_for_line(&mut srv.0, "to block on socket");
    let base = ["--tcp", "-i", "127.0.0.1", "-p", &port, "-t", "1"];
    let pp = under(&s, client_preload, &sp, &[&["pp"][..], &base].concat())
        .output()
        .unwrap();
    let text = ok_output("sockperf pp", &pp);
    assert!(text.contains("Summary: Latency is"), "{text}");
    // every message came back
    let valid = text
        .lines()
        .find(|l| l.contains("[Valid Duration]"))
        .unwrap_or_else(|| panic!("{text}"));
    let num = |k: &str| -> u64 {
        valid
            .split(k)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {valid}"))
    };
    assert!(num("SentMessages=") > 100, "{valid}");
    assert_eq!(num("SentMessages="), num("ReceivedMessages="), "{valid}");
    let tp = under(
        &s,
        client_preload,
        &sp,
        &[&["tp", "-m", "1400"][..], &base].concat(),
    )
    .output()
    .unwrap();
    let text = ok_output("sockperf tp", &tp);
    assert!(text.contains("Summary: BandWidth is"), "{text}");
    drop(srv);
    s
}

#[test]
fn sockperf_ping_pong_and_throughput_over_smc_r() {
    let s = sockperf("sockperf", true, true);
    assert_all(&s, 4, " SMC-R");
}

#[test]
fn sockperf_with_one_side_plain_falls_back() {
    let s = sockperf("sockperf-plain-cli", true, false);
    assert_all(&s, 2, FALLBACK);
    let s = sockperf("sockperf-plain-srv", false, true);
    assert_all(&s, 2, FALLBACK);
}

#[test]
fn nginx_master_and_workers_with_curl_and_wrk_over_smc_r() {
    let s = nginx("nginx", true, true);
    let modes = assert_all(&s, 2 * 21, " SMC-R");
    // accepted in the workers (the master only listens)
    let master = std::fs::read_to_string(s.dir.join("nginx.pid")).unwrap_or_default();
    let accepts: Vec<_> = std::fs::read_to_string(s.dir.join("state"))
        .unwrap()
        .lines()
        .filter(|l| l.contains(" accept "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    assert!(!accepts.is_empty(), "{modes:?}");
    assert!(accepts.iter().all(|p| *p != master.trim()), "{accepts:?}");
}

#[test]
fn nginx_with_one_side_plain_falls_back() {
    let s = nginx("nginx-plain-cli", true, false);
    assert_all(&s, 21, FALLBACK);
    let s = nginx("nginx-plain-srv", false, true);
    assert_all(&s, 21, FALLBACK);
}
