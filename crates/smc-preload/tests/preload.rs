//! `smc_run` and the preload library with a plain C program (tests/echo.c,
//! which knows nothing of SMC): an echo server using non-blocking sockets
//! with poll() or edge-triggered epoll, and a client that writes with
//! writev() while it polls for the echo, half-closes and checks every byte.
//! Each connection's mode is the library's record of it (`SMC_RUN_STATE`),
//! not an assumption. (root: the SYN-option rendezvous loads a BPF program.)

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SMC_RUN: &str = env!("CARGO_BIN_EXE_smc_run");

/// A private directory with the shm device on `lo` and the compiled echo program.
struct Setup {
    dir: PathBuf,
    echo: PathBuf,
}

fn setup(tag: &str) -> Setup {
    let dir = std::env::temp_dir().join(format!("smc-preload-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    std::fs::write(
        dir.join("shm.conf"),
        format!(
            "rundir {}\ndevice shm-lo netdev lo\n",
            dir.join("run").display()
        ),
    )
    .unwrap();
    let echo = dir.join("echo");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/echo.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(cc)
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&echo)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(st.success(), "compiling echo.c");
    Setup { dir, echo }
}

impl Setup {
    fn cmd(&self, preload: bool) -> Command {
        let mut c = if preload {
            let mut c = Command::new(SMC_RUN);
            c.arg(&self.echo);
            c
        } else {
            Command::new(&self.echo)
        };
        c.env("SMC_RDMA_SHM_CONFIG", self.dir.join("shm.conf"))
            .env("SMC_RS_CONFIG_DIR", self.dir.join("conf"))
            .env("SMC_RUN_STATE", self.dir.join("state"))
            .env_remove("LD_PRELOAD");
        c
    }

    fn server(&self, preload: bool, epoll: bool) -> (Child, u16) {
        let portfile = self.dir.join("port");
        let _ = std::fs::remove_file(&portfile);
        let mut c = self.cmd(preload);
        c.arg("server").arg(&portfile);
        if epoll {
            c.arg("epoll");
        }
        let mut child = c.stdout(Stdio::piped()).spawn().unwrap();
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if let Some(p) = std::fs::read_to_string(&portfile)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                return (child, p);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server did not start");
    }

    fn client(&self, preload: bool, port: u16, n: usize, fork: bool) -> Output {
        let mut c = self.cmd(preload);
        c.args(["client", &port.to_string(), &n.to_string()]);
        if fork {
            c.arg("fork");
        }
        c.output().unwrap()
    }

    /// The library's record: one line per connection, "pid role local peer mode".
    fn modes(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("state"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').skip(1).collect::<Vec<_>>().join(" "))
            .collect()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(tag: &str, server_preload: bool, client_preload: bool, epoll: bool, n: usize) -> Setup {
    run_forked(tag, server_preload, client_preload, epoll, n, false)
}

fn run_forked(
    tag: &str,
    server_preload: bool,
    client_preload: bool,
    epoll: bool,
    n: usize,
    fork: bool,
) -> Setup {
    let s = setup(tag);
    let (srv, port) = s.server(server_preload, epoll);
    let out = s.client(client_preload, port, n, fork);
    let srv = srv.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "client: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("client ok {n}\n")
    );
    assert!(srv.status.success(), "server: {:?}", srv.status);
    assert_eq!(
        String::from_utf8_lossy(&srv.stdout),
        format!("server echoed {n}\n")
    );
    s
}

fn assert_modes(s: &Setup, want: &[(&str, &str)]) {
    let got = s.modes();
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (role, mode) in want {
        assert!(
            got.iter().any(|l| l.starts_with(role) && l.contains(mode)),
            "no {role} connection in mode {mode}: {got:?}"
        );
    }
}

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

/// A child that closes its copy of an SMC-R connection (as one does before
/// exec) leaves the parent's connection alone: the library is off in a
/// forked child.
#[test]
fn a_forked_child_closing_its_copy_does_not_end_the_connection() {
    let s = run_forked("fork", true, true, false, 4 << 20, true);
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

fn smc_run(args: &[&str]) -> Output {
    Command::new(SMC_RUN).args(args).output().unwrap()
}

/// smc-tools' options, messages and exit codes (tools.md §2.1).
#[test]
fn smc_run_options_as_smc_tools() {
    let h = smc_run(&["-h"]);
    assert!(h.status.success());
    let text = String::from_utf8_lossy(&h.stdout);
    assert!(text.starts_with(
        "Usage: smc_run [ OPTIONS ] COMMAND\n\nRun COMMAND using SMC for TCP sockets\n"
    ));
    assert!(text.contains("   -r <SIZE>  request receive buffer size in Bytes\n"));
    let v = smc_run(&["-v"]);
    assert!(String::from_utf8_lossy(&v.stdout).starts_with("smc_run utility, smc-tools-1.8.5"));
    let x = smc_run(&["-x", "true"]);
    assert_eq!(x.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&x.stderr),
        "smc_run: Error: Invalid option: -x\n"
    );
    let m = smc_run(&["-d"]);
    assert_eq!(m.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&m.stderr),
        "smc_run: Error: Missing command parameter\n"
    );
    let b = smc_run(&["-r", "12q", "true"]);
    assert_eq!(b.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&b.stderr),
        "Error: Invalid buffer size specified: '12q'\n"
    );
    // the environment the command gets
    let e = Command::new(SMC_RUN)
        .args([
            "-d",
            "-t",
            "64k",
            "sh",
            "-c",
            "echo $SMC_DEBUG $SMC_SNDBUF $LD_PRELOAD",
        ])
        .env("LD_PRELOAD", "")
        .output()
        .unwrap();
    assert!(e.status.success());
    let out = String::from_utf8_lossy(&e.stdout);
    assert!(out.starts_with("1 65536 /"), "{out}");
    assert!(out.trim_end().ends_with("libsmc_preload.so"), "{out}");
}

/// A program from the distribution (the CI installs it), found on PATH.
fn program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed (.ci/run installs it)"))
}

/// `prog args` in `s`'s environment, under smc_run if `preload`.
fn under(s: &Setup, preload: bool, prog: &Path, args: &[&str]) -> Command {
    let mut c = if preload {
        let mut c = Command::new(SMC_RUN);
        c.arg(prog);
        c
    } else {
        Command::new(prog)
    };
    c.args(args)
        .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
        .env("SMC_RUN_STATE", s.dir.join("state"))
        .env_remove("LD_PRELOAD");
    c
}

/// Kills the server when the test ends, whatever happened.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sha256(data: &[u8]) -> String {
    let mut c = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    c.stdin.take().unwrap().write_all(data).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split(' ')
        .next()
        .unwrap()
        .to_string()
}

fn blob(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

/// python3's http.server serving a file, fetched with curl; the body's hash
/// must match.
fn http_server_and_curl(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    let s = setup(tag);
    let www = s.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let body = blob(3 << 20);
    std::fs::write(www.join("blob"), &body).unwrap();
    let py = program("python3");
    let mut srv = under(
        &s,
        server_preload,
        &py,
        &[
            "-u",
            "-m",
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
            "--directory",
        ],
    );
    srv.arg(&www).stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = Server(srv.spawn().unwrap());
    // "Serving HTTP on 127.0.0.1 port N (http://...) ..."
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .split_whitespace()
        .skip_while(|w| *w != "port")
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    let url = format!("http://127.0.0.1:{port}/blob");
    let out = under(&s, client_preload, &program("curl"), &["-sf", &url])
        .output()
        .unwrap();
    assert!(out.status.success(), "curl: {:?}", out.status);
    assert_eq!(out.stdout.len(), body.len());
    assert_eq!(sha256(&out.stdout), sha256(&body), "the body curl got");
    drop(child);
    s
}

/// python3's http.server on a port of ours and curl, both under smc_run
/// with `srv_env` and `cli_env`; returns the run and curl's stderr (where
/// `-d` says how each connection runs).
fn http_selected(
    tag: &str,
    srv_env: &[(&str, String)],
    cli_env: &[(&str, String)],
) -> (Setup, u16, String) {
    let s = setup(tag);
    let www = s.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let body = blob(1 << 20);
    std::fs::write(www.join("blob"), &body).unwrap();
    let port = free_port();
    let mut srv = under(
        &s,
        true,
        &program("python3"),
        &[
            "-u",
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--directory",
        ],
    );
    srv.arg(&www)
        .envs(srv_env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Server(srv.spawn().unwrap());
    wait_for_line(&mut child.0, "Serving HTTP");
    let url = format!("http://127.0.0.1:{port}/blob");
    let out = Command::new(SMC_RUN)
        .args(["-d", program("curl").to_str().unwrap(), "-sf", &url])
        .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
        .env("SMC_RUN_STATE", s.dir.join("state"))
        .env_remove("LD_PRELOAD")
        .envs(cli_env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    assert!(out.status.success(), "curl: {:?}", out.status);
    assert_eq!(sha256(&out.stdout), sha256(&body), "the body curl got");
    drop(child);
    (s, port, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `SMC_RUN_PORTS` / `SMC_RUN_DESTS` (`smc_run -p` / `-a`): connections and
/// listeners outside the lists stay plain TCP (no SMC option in their SYN
/// or SYN-ACK, so the peer falls back too), those inside get SMC-R; `-d`
/// says which and why for each connection.
#[test]
fn ports_and_destinations_limit_what_is_converted() {
    let v = |s: &str| s.to_string();
    // a client whose destination port is not listed
    let (s, _, err) = http_selected("sel-port", &[], &[("SMC_RUN_PORTS", v("1-1000"))]);
    let m = s.modes();
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m.iter().any(|l| l.starts_with("connect") && l.ends_with("TCP (not selected by SMC_RUN_PORTS)")), "{m:?}");
    assert!(
        m.iter()
            .any(|l| l.starts_with("accept") && l.ends_with(FALLBACK)),
        "{m:?}"
    );
    assert!(err.contains("TCP (not selected by SMC_RUN_PORTS)"), "{err}");
    // a client whose destination address is not listed
    let (s, _, _) = http_selected("sel-dest", &[], &[("SMC_RUN_DESTS", v("10.0.0.0/8,::1"))]);
    let m = s.modes();
    assert!(m.iter().any(|l| l.starts_with("connect") && l.ends_with("TCP (not selected by SMC_RUN_DESTS)")), "{m:?}");
    assert!(
        m.iter()
            .any(|l| l.starts_with("accept") && l.ends_with(FALLBACK)),
        "{m:?}"
    );
    // a server whose port is not listed: its listener stays TCP
    let (s, port, _) = http_selected("sel-listen", &[("SMC_RUN_PORTS", v("1"))], &[]);
    let m = s.modes();
    assert!(
        m.iter()
            .any(|l| l.starts_with(&format!("listen 127.0.0.1:{port} - TCP (not selected"))),
        "{m:?}"
    );
    assert!(
        m.iter()
            .any(|l| l.starts_with("connect") && l.ends_with(FALLBACK)),
        "{m:?}"
    );
    assert!(!m.iter().any(|l| l.starts_with("accept")), "{m:?}");
    // both lists naming the connection: SMC-R both ends
    let (s, _, err) = http_selected(
        "sel-both",
        &[("SMC_RUN_PORTS", v("1024-65535"))],
        &[
            ("SMC_RUN_PORTS", v("1024-65535")),
            ("SMC_RUN_DESTS", v("127.0.0.0/8")),
        ],
    );
    let m = s.modes();
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m.iter().all(|l| l.ends_with(" SMC-R")), "{m:?}");
    assert!(err.contains(" SMC-R"), "{err}");
}

/// `smc_run -p` / `-a` set the lists; lists it cannot read are refused
/// before the command runs.
#[test]
fn smc_run_checks_and_passes_the_lists() {
    let e = smc_run(&[
        "-p",
        "80,8000-8100",
        "-a",
        "10.0.0.0/8",
        "sh",
        "-c",
        "echo $SMC_RUN_PORTS $SMC_RUN_DESTS",
    ]);
    assert!(e.status.success());
    assert_eq!(
        String::from_utf8_lossy(&e.stdout),
        "80,8000-8100 10.0.0.0/8\n"
    );
    let b = smc_run(&["-p", "80-70", "true"]);
    assert_eq!(b.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&b.stderr).starts_with("smc_run: Error: invalid port range"));
    let b = Command::new(SMC_RUN)
        .args(["true"])
        .env("SMC_RUN_DESTS", "10.0.0.0/40")
        .output()
        .unwrap();
    assert_eq!(b.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&b.stderr).contains("invalid address or prefix"));
    let h = smc_run(&["-h"]);
    assert!(String::from_utf8_lossy(&h.stdout).contains("-p <PORTS>"));
}

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

/// tests/conform.c, compiled into `s`'s directory.
fn conform_program(s: &Setup) -> PathBuf {
    let exe = s.dir.join("conform");
    if !exe.exists() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conform.c");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let st = Command::new(cc)
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .status()
            .expect("a C compiler (cc)");
        assert!(st.success(), "compiling conform.c");
    }
    exe
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
    let end = Instant::now() + Duration::from_secs(20);
    let port = loop {
        if let Some(p) = std::fs::read_to_string(&portfile)
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok())
        {
            break p;
        }
        assert!(Instant::now() < end, "the conformance server did not start");
        std::thread::sleep(Duration::from_millis(10));
    };
    let cli = under(s, client_preload, &exe, &["client", &port.to_string()])
        .arg(&file)
        .output()
        .unwrap();
    let mut srv = srv;
    let child = std::mem::replace(&mut srv.0, Command::new("true").spawn().unwrap());
    let so = child.wait_with_output().unwrap();
    assert!(
        cli.status.success(),
        "client {server_preload} {client_preload}: {:?} {}",
        cli.status,
        String::from_utf8_lossy(&cli.stderr)
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

fn assert_same(plain: &str, other: &str, what: &str) {
    for (k, (a, b)) in plain.lines().zip(other.lines()).enumerate() {
        assert_eq!(a, b, "{what}: line {} differs from the plain run", k + 1);
    }
    assert_eq!(plain.lines().count(), other.lines().count(), "{what}");
}

/// The conformance test: the same scripted calls (tests/conform.c:
/// non-blocking connect, refused and accepted, with poll and edge-triggered
/// epoll; SO_ERROR; socket options; getsockname/getpeername; MSG_PEEK;
/// FIONREAD; partial reads under EPOLLET; select/pselect; EPOLLONESHOT in
/// an epoll set inside another; reads through dup(); sendfile; half close
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
        "client epoll peer closed: IN OUT HUP RDHUP",
        "client write after the peer closed: EPIPE, SIGPIPE 1",
        "server epoll half close: IN RDHUP",
        "server FIONREAD = 5",
        "client epoll outer: IN",
        "client epoll ONESHOT again: none",
        "client epoll ONESHOT re-armed: IN",
        "client pselect = 1",
        "client sendfile 300000 bytes equal 1",
    ] {
        assert!(pc.contains(l) || ps.contains(l), "plain run lacks {l:?}");
    }
    assert!(s.modes().is_empty());
    let (ss, sc) = conform_run(&s, true, true);
    assert_same(&ps, &ss, "server under smc_run");
    assert_same(&pc, &sc, "client under smc_run");
    // the script's three connections, both ends
    let modes = s.modes();
    assert_eq!(modes.len(), 6, "{modes:?}");
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
        assert_eq!(modes.len(), 3, "{modes:?}");
        assert!(
            modes
                .iter()
                .all(|m| m.ends_with("(peer did not indicate SMC)")),
            "{modes:?}"
        );
    }
}

// Real programs from Debian's packages (.ci/run installs them), each with
// both sides under smc_run (every connection SMC-R, by the library's
// record) and with one side plain (every connection a transparent
// fallback); output checked.

/// A free TCP port on 127.0.0.1 (bound and released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Reads `child`'s stdout until a line contains `what` (then keeps draining
/// it in a thread, so that the program never blocks on a full pipe).
fn wait_for_line(child: &mut Child, what: &str) {
    use std::io::BufRead;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let want = what.to_string();
    std::thread::spawn(move || {
        let mut seen = false;
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if !seen && line.contains(&want) {
                seen = true;
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("the server never said {what:?}"));
}

/// Every connection the library recorded is in mode `mode` (suffix), and
/// there are at least `min` of them.
fn assert_all(s: &Setup, min: usize, mode: &str) -> Vec<String> {
    let modes = s.modes();
    assert!(modes.len() >= min, "{} connections: {modes:?}", modes.len());
    assert!(
        modes.iter().all(|m| m.ends_with(mode)),
        "not all {mode}: {:?}",
        modes
            .iter()
            .filter(|m| !m.ends_with(mode))
            .collect::<Vec<_>>()
    );
    modes
}

const FALLBACK: &str = "(peer did not indicate SMC)";

fn ok_output(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// redis-server, redis-benchmark (SET and GET, 50 clients, pipelined and
/// not) and redis-cli reading back what the benchmark wrote; a background
/// save (a forked child) while the server keeps serving.
fn redis(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    redis_as(tag, server_preload, client_preload, None)
}

/// `cmd` run as `user` instead (its own uid, gid and groups: `setpriv`, as
/// an init system starts a service), from a directory it can reach.
fn as_user(cmd: Command, user: Option<&str>) -> Command {
    let Some(user) = user else { return cmd };
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={user}"),
        &format!("--regid={user}"),
        "--init-groups",
        "--",
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args())
    .current_dir("/");
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c.env_remove("XDG_RUNTIME_DIR");
    c
}

/// redis as above; with `user`, redis-server runs as that user (as Debian's
/// service does) and keeps its data in a directory of that user's.
fn redis_as(tag: &str, server_preload: bool, client_preload: bool, user: Option<&str>) -> Setup {
    let s = setup(tag);
    let _open = user.map(|_| OpenToUsers::new(&s));
    let data = match user {
        None => s.dir.clone(),
        Some(user) => {
            let data = s.dir.join("data");
            std::fs::create_dir(&data).unwrap();
            let st = Command::new("chown")
                .args([&format!("{user}:"), data.to_str().unwrap()])
                .status()
                .unwrap();
            assert!(st.success());
            // the record every process of the run appends to
            std::fs::write(s.dir.join("state"), "").unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(s.dir.join("state"), std::fs::Permissions::from_mode(0o666))
                .unwrap();
            data
        }
    };
    let port = free_port().to_string();
    let mut srv = Server(
        as_user(
            under(
                &s,
                server_preload,
                &program("redis-server"),
                &[
                    "--port",
                    &port,
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--dir",
                    &data.display().to_string(),
                ],
            ),
            user,
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    wait_for_line(&mut srv.0, "Ready to accept connections");
    let bench = program("redis-benchmark");
    for pipeline in ["1", "16"] {
        let out = under(
            &s,
            client_preload,
            &bench,
            &[
                "-p", &port, "-t", "set,get", "-n", "5000", "-c", "50", "-d", "100", "-P",
                pipeline, "-q",
            ],
        )
        .output()
        .unwrap();
        let text = ok_output("redis-benchmark", &out);
        for t in ["SET: ", "GET: "] {
            assert!(
                text.split('\r')
                    .any(|l| l.trim_start().starts_with(t) && l.contains("requests per second")),
                "no {t} result: {text}"
            );
        }
    }
    let cli = program("redis-cli");
    // (the benchmark's 100-byte value, as it wrote it)
    let got = under(
        &s,
        client_preload,
        &cli,
        &["-p", &port, "--no-raw", "strlen", "key:__rand_int__"],
    )
    .output()
    .unwrap();
    assert_eq!(
        ok_output("redis-cli", &got).trim_end(),
        "(integer) 100",
        "the benchmark's value"
    );
    let set = under(
        &s,
        client_preload,
        &cli,
        &["-p", &port, "set", "smc", "over SMC-R"],
    )
    .output()
    .unwrap();
    assert_eq!(ok_output("redis-cli set", &set).trim_end(), "OK");
    let got = under(&s, client_preload, &cli, &["-p", &port, "get", "smc"])
        .output()
        .unwrap();
    assert_eq!(ok_output("redis-cli get", &got).trim_end(), "over SMC-R");
    // a background save: a child of the server, which keeps serving
    let save = under(&s, client_preload, &cli, &["-p", &port, "bgsave"])
        .output()
        .unwrap();
    assert!(ok_output("redis-cli bgsave", &save).contains("Background saving started"));
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let info = under(
            &s,
            client_preload,
            &cli,
            &["-p", &port, "info", "persistence"],
        )
        .output()
        .unwrap();
        let info = ok_output("redis-cli info", &info);
        if info.contains("rdb_bgsave_in_progress:0") && info.contains("rdb_saves:1") {
            assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
            break;
        }
        assert!(Instant::now() < end, "{info}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(data.join("dump.rdb").exists());
    if let Some(user) = user {
        // (the server, not setpriv, is the child: setpriv execs it)
        let st = std::fs::read_to_string(format!("/proc/{}/status", srv.0.id())).unwrap();
        let uid = String::from_utf8(
            Command::new("id")
                .args(["-u", user])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        let line = st.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert_eq!(line.split_whitespace().nth(1), Some(uid.trim()), "{line}");
    }
    let got = under(&s, client_preload, &cli, &["-p", &port, "get", "smc"])
        .output()
        .unwrap();
    assert_eq!(ok_output("redis-cli get", &got).trim_end(), "over SMC-R");
    drop(srv);
    s
}

#[test]
fn redis_server_and_benchmark_over_smc_r() {
    let s = redis("redis", true, true);
    // 2 x (50 clients and the benchmark's own) + 3 redis-cli, both ends
    assert_all(&s, 2 * (2 * 51 + 3), " SMC-R");
}

/// redis-server as the `redis` user (Debian's service), the rendezvous
/// opened to users by its install: every connection SMC-R.
#[test]
fn redis_server_as_an_ordinary_user_over_smc_r() {
    let s = redis_as("redis-user", true, true, Some("redis"));
    assert_all(&s, 2 * (2 * 51 + 3), " SMC-R");
    // the server's own record (its accepts) is there
    assert!(s.modes().iter().filter(|m| m.starts_with("accept")).count() >= 2 * 51 + 3);
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
            .stderr(Stdio::null())
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
        assert!(st.success(), "iperf3 server: {st:?}");
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

/// nginx (master and two workers, which accept on the master's listening
/// socket: it crosses fork()) serving a file with sendfile, fetched by curl
/// (hash) and wrk.
fn nginx(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    nginx_as(tag, server_preload, client_preload, None)
}

/// The tests that open the rendezvous to every user change the host's
/// access: one at a time (as crates/smc/tests/unprivileged.rs does; cargo
/// runs test binaries one after the other).
static ADMIN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What `smc-rendezvous install` does (the rendezvous open to every user),
/// with the run's shm rundir and registry made as for every user; undone on
/// drop.
struct OpenToUsers {
    _serial: std::sync::MutexGuard<'static, ()>,
    prev_access: smc_bpf::Access,
    prev_bpffs_mode: u32,
}

impl OpenToUsers {
    fn new(s: &Setup) -> OpenToUsers {
        use std::os::unix::fs::PermissionsExt;
        let serial = ADMIN.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = smc_bpf::Config::default();
        smc_bpf::Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
        let prev_access = smc_bpf::access_of(&cfg.namespace_dir()).unwrap();
        let prev_bpffs_mode = std::fs::metadata(&cfg.bpffs).unwrap().permissions().mode();
        smc_bpf::set_access(&cfg, smc_bpf::Access::Everyone).unwrap_or_else(|e| panic!("{e}"));
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        mode(&s.dir, 0o755);
        // (as the shm device makes its rundir)
        let _ = std::fs::remove_dir_all(s.dir.join("run"));
        smc_rdma::shm::registry::create_rundir(&s.dir.join("run")).unwrap();
        OpenToUsers {
            _serial: serial,
            prev_access,
            prev_bpffs_mode,
        }
    }
}

impl Drop for OpenToUsers {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let cfg = smc_bpf::Config::default();
        let _ = smc_bpf::set_access(&cfg, self.prev_access);
        let _ = std::fs::set_permissions(
            &cfg.bpffs,
            std::fs::Permissions::from_mode(self.prev_bpffs_mode),
        );
    }
}

/// nginx as above; with `user`, its workers run as that user (Debian's
/// default: `user www-data;`, the master stays root).
fn nginx_as(tag: &str, server_preload: bool, client_preload: bool, user: Option<&str>) -> Setup {
    let s = setup(tag);
    let _open = user.map(|_| OpenToUsers::new(&s));
    let www = s.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let body = blob(2 << 20);
    std::fs::write(www.join("blob"), &body).unwrap();
    std::fs::write(www.join("index.html"), "hello over SMC-R\n").unwrap();
    let port = free_port();
    let d = s.dir.display();
    let conf = s.dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nmaster_process on;\nworker_processes 2;\nuser {user};\n\
             pid {d}/nginx.pid;\nerror_log {d}/error.log notice;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n access_log off;\n sendfile on;\n\
             client_body_temp_path {d}/tmp;\n proxy_temp_path {d}/tmp;\n\
             fastcgi_temp_path {d}/tmp;\n uwsgi_temp_path {d}/tmp;\n scgi_temp_path {d}/tmp;\n\
             server {{\n  listen 127.0.0.1:{port};\n  root {d}/www;\n }}\n}}\n",
            user = user.unwrap_or("root")
        ),
    )
    .unwrap();
    std::fs::create_dir_all(s.dir.join("tmp")).unwrap();
    let srv = Nginx(
        under(
            &s,
            server_preload,
            &program_sbin("nginx"),
            &["-c", &conf.display().to_string(), "-p", &d.to_string()],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let end = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(s.dir.join("error.log"))
        .unwrap_or_default()
        .matches("start worker process")
        .count()
        < 2
    {
        assert!(Instant::now() < end, "nginx did not start its workers");
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(user) = user {
        // the workers (children of the master) run as `user`
        let uid = String::from_utf8(
            Command::new("id")
                .args(["-u", user])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        let master = srv.0.id().to_string();
        let field = |st: &str, k: &str| {
            st.lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .unwrap_or("")
                .to_string()
        };
        // (a worker drops root shortly after the master logs its start)
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let workers: Vec<String> = std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
                .filter(|st| field(st, "PPid:") == master)
                .map(|st| field(&st, "Uid:"))
                .collect();
            if workers.len() == 2 && workers.iter().all(|u| *u == uid.trim()) {
                break;
            }
            assert!(Instant::now() < end, "workers' uids: {workers:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let url = format!("http://127.0.0.1:{port}/blob");
    let out = under(
        &s,
        client_preload,
        &program("curl"),
        &["-sf", "-m", "20", &url],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "curl: {:?}", out.status);
    assert_eq!(out.stdout.len(), body.len());
    assert_eq!(sha256(&out.stdout), sha256(&body), "the body curl got");
    let url = format!("http://127.0.0.1:{port}/index.html");
    let out = under(
        &s,
        client_preload,
        &program("wrk"),
        &["-t", "2", "-c", "20", "-d", "1", "--timeout", "5s", &url],
    )
    .output()
    .unwrap();
    let text = ok_output("wrk", &out);
    assert!(!text.contains("Socket errors"), "{text}");
    assert!(!text.contains("Non-2xx"), "{text}");
    let n: u64 = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(n > 100, "{text}");
    drop(srv);
    s
}

/// Stops nginx when the test ends, whatever happened: SIGTERM to the
/// master, which stops its workers (SIGKILL would leave them running).
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A program in an sbin directory (nginx), or on PATH.
fn program_sbin(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin", "/usr/local/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| program(name))
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

/// Debian's default: the master as root, the two workers as www-data (the
/// rendezvous opened to users by its install); every connection SMC-R, and
/// the workers' own record of each says so.
#[test]
fn nginx_with_workers_as_www_data_over_smc_r() {
    let s = nginx_as("nginx-www-data", true, true, Some("www-data"));
    assert_all(&s, 2 * 21, " SMC-R");
    let master = std::fs::read_to_string(s.dir.join("nginx.pid")).unwrap_or_default();
    let accepts: Vec<String> = std::fs::read_to_string(s.dir.join("state"))
        .unwrap()
        .lines()
        .filter(|l| l.contains(" accept "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    assert!(!accepts.is_empty());
    assert!(accepts.iter().all(|p| *p != master.trim()), "{accepts:?}");
}

#[test]
fn nginx_with_one_side_plain_falls_back() {
    let s = nginx("nginx-plain-cli", true, false);
    assert_all(&s, 21, FALLBACK);
    let s = nginx("nginx-plain-srv", false, true);
    assert_all(&s, 21, FALLBACK);
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

fn exec_program(s: &Setup) -> PathBuf {
    let exe = s.dir.join("exec");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/exec.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(cc)
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(st.success(), "compiling exec.c");
    exe
}

/// exec.c's server and client (`mode`: fork, self) under smc_run; returns
/// the client's and the server's output.
fn exec_run(tag: &str, mode: &str) -> (Setup, String, String) {
    exec_run_with(tag, "server", &["client", mode])
}

fn exec_run_with(tag: &str, server: &str, client: &[&str]) -> (Setup, String, String) {
    let s = setup(tag);
    let exe = exec_program(&s);
    let portfile = s.dir.join("port");
    let mut srv = Server(
        under(&s, true, &exe, &[server, portfile.to_str().unwrap()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let end = Instant::now() + Duration::from_secs(20);
    let port = loop {
        if let Some(p) = std::fs::read_to_string(&portfile)
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok())
        {
            break p;
        }
        assert!(Instant::now() < end, "the server did not start");
        std::thread::sleep(Duration::from_millis(10));
    };
    let port = port.to_string();
    let args: Vec<&str> = [client[0], &port]
        .into_iter()
        .chain(client[1..].iter().copied())
        .collect();
    let mut cli = under(&s, true, &exe, &args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // (no hang: the new image's calls must not block)
    let end = Instant::now() + Duration::from_secs(30);
    while cli.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = cli.kill();
            let _ = cli.wait();
            panic!("the client hangs after the exec");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = cli.wait_with_output().unwrap();
    let cli_text = ok_output("exec client", &out);
    // the server learns that the connection ended (it does not hang either)
    let end = Instant::now() + Duration::from_secs(30);
    while srv.0.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < end,
            "the server never saw the connection end"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut srv_text = String::new();
    use std::io::Read;
    srv.0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut srv_text)
        .unwrap();
    (s, cli_text, srv_text)
}

const AFTER_EXEC: &str = "after poll=1 hup=1 read=ENOTCONN write=EPIPE peer=ENOTCONN\n";

/// fork + exec with an SMC-R connection's descriptor inherited (inetd,
/// CGI): the new image's descriptor is a connection that is gone (clear
/// errors at once, no hang, nothing sent anywhere), and the parent keeps
/// using the connection.
#[test]
fn an_smc_r_connection_inherited_across_fork_and_exec_is_a_clear_error_there() {
    let (s, cli, srv) = exec_run("exec-fork", "fork");
    assert_eq!(cli, format!("{AFTER_EXEC}parent ok\n"));
    // the server echoed both pings and nothing else
    assert_eq!(srv, "server end eof after 10\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// An exec of the process itself: the same for the new image; the
/// connection went with the old one, and the peer sees it end.
#[test]
fn an_smc_r_connection_surviving_exec_is_a_clear_error_in_the_new_image() {
    let (s, cli, srv) = exec_run("exec-self", "self");
    assert_eq!(cli, AFTER_EXEC);
    assert!(
        srv.starts_with("server end ") && srv.ends_with(" after 5\n"),
        "{srv}"
    );
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// A listening socket that crosses an exec (nginx's binary upgrade): the
/// new image's library takes it up (the image before opted it in, so the
/// kernel offers SMC in its SYN-ACKs), and its connections are SMC-R with
/// the data intact.
#[test]
fn a_listening_socket_inherited_across_exec_accepts_smc_r() {
    let (s, cli, srv) = exec_run_with("exec-listen", "server-exec", &["pings"]);
    assert_eq!(cli, "pings ok\n");
    assert_eq!(srv, "server end eof after 10\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// `install.sh` puts smc_run in PREFIX/bin and the library in
/// PREFIX/lib/<multiarch>, and the installed smc_run finds it there (no
/// copy next to it) and gives SMC-R.
#[test]
fn install_puts_smc_run_and_the_library_where_a_distribution_does() {
    let s = setup("install");
    let root = s.dir.join("root");
    let from = Path::new(SMC_RUN).parent().unwrap();
    let out = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("install.sh"))
        .args([
            "--prefix",
            "/usr",
            "--destdir",
            root.to_str().unwrap(),
            "--from",
        ])
        .arg(from)
        .output()
        .unwrap();
    ok_output("install.sh", &out);
    let bin = root.join("usr/bin/smc_run");
    let arch = match std::env::consts::ARCH {
        "x86" => "i386",
        "powerpc64" => "powerpc64le",
        a => a,
    };
    let lib = root.join(format!("usr/lib/{arch}-linux-gnu/libsmc_preload.so"));
    assert!(bin.is_file() && lib.is_file(), "{bin:?} {lib:?}");
    let e = Command::new(&bin)
        .args(["sh", "-c", "echo $LD_PRELOAD"])
        .env_remove("LD_PRELOAD")
        .env_remove("SMC_PRELOAD_LIB")
        .output()
        .unwrap();
    let got = ok_output("installed smc_run", &e);
    assert_eq!(
        std::fs::canonicalize(got.trim_end()).unwrap(),
        std::fs::canonicalize(&lib).unwrap()
    );
    // a connection through the installed pair
    let portfile = s.dir.join("port");
    let mut srv = Server(
        Command::new(&bin)
            .arg(&s.echo)
            .args(["server", portfile.to_str().unwrap()])
            .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
            .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
            .env("SMC_RUN_STATE", s.dir.join("state"))
            .env_remove("LD_PRELOAD")
            .env_remove("SMC_PRELOAD_LIB")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let end = Instant::now() + Duration::from_secs(20);
    let port = loop {
        if let Some(p) = std::fs::read_to_string(&portfile)
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok())
        {
            break p;
        }
        assert!(Instant::now() < end, "the server did not start");
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = Command::new(&bin)
        .arg(&s.echo)
        .args(["client", &port.to_string(), &(1 << 20).to_string()])
        .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
        .env("SMC_RUN_STATE", s.dir.join("state"))
        .env_remove("LD_PRELOAD")
        .env_remove("SMC_PRELOAD_LIB")
        .output()
        .unwrap();
    assert_eq!(
        ok_output("echo client", &out),
        format!("client ok {}\n", 1 << 20)
    );
    // (the server ends after the echo, its record written)
    assert!(srv.0.wait().unwrap().success());
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}
