//! `smc_run` itself: its options, messages and exit codes as smc-tools'
//! (tools.md §2.1), and the port and destination lists (`-p`, `-a`) that
//! limit which connections are converted. (root: the SYN-option rendezvous
//! loads a BPF program.)

mod common;

use common::*;

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

/// One process under `smc_run` `args` that connects to its own listener,
/// moves a byte each way and prints `getsockopt(SO_RCVBUF, SO_SNDBUF)` of
/// the client's and the server's socket; returns that line and the modes.
fn buffers_seen(tag: &str, args: &[&str], env: &[(&str, &str)]) -> (String, Vec<String>) {
    const PY: &str = r#"
import os, socket, threading
l = socket.socket(); l.bind(("127.0.0.1", 0))
if "LRCV" in os.environ: l.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(os.environ["LRCV"]))
l.listen(1)
got = {}
def serve():
    s, _ = l.accept(); s.sendall(s.recv(1)); got["s"] = s
t = threading.Thread(target=serve); t.start()
c = socket.socket()
if "CSND" in os.environ: c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(os.environ["CSND"]))
c.connect(l.getsockname())
c.sendall(b"x"); assert c.recv(1) == b"x"; t.join()
o = lambda s: "%d/%d" % (s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dflt = int(open("/proc/sys/net/core/rmem_default").read())
print(o(c), o(got["s"]), "udp-default" if u.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == dflt else "udp-changed")
"#;
    let s = setup(tag);
    let py = program("python3");
    let mut all: Vec<&str> = args.to_vec();
    all.extend([py.to_str().unwrap(), "-c", PY]);
    let out = Command::new(SMC_RUN)
        .args(&all)
        .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
        .env("SMC_RUN_STATE", s.dir.join("state"))
        .env_remove("LD_PRELOAD")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (line, s.modes())
}

/// `smc_run -r SIZE` / `-t SIZE` size the SMC-R connections' RMB and send
/// buffer as they size an AF_SMC socket's in Linux (rounded up to a size
/// class), and `getsockopt(SO_RCVBUF/SO_SNDBUF)` on such a connection
/// reports them doubled, as Linux reports a socket's; without them the
/// library's defaults (4 MiB, 1 MiB); a program's `setsockopt` of them on
/// a socket before its connect or listen sizes that socket's connections,
/// as in Linux. Other sockets than TCP keep their
/// sizes (tools.md §8: smc-tools' library sets them on every socket).
#[test]
fn smc_run_r_and_t_size_the_smc_buffers() {
    let (line, m) = buffers_seen("bufs-asked", &["-r", "200k", "-t", "64k"], &[]);
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m.iter().all(|l| l.ends_with(" SMC-R")), "{m:?}");
    // (200 KiB: the 256 KiB class)
    // (a UDP socket keeps its own sizes: smc-tools' library would set them)
    assert_eq!(line, "524288/131072 524288/131072 udp-default");
    let (line, m) = buffers_seen("bufs-default", &[], &[]);
    assert!(m.iter().all(|l| l.ends_with(" SMC-R")), "{m:?}");
    assert_eq!(line, "8388608/2097152 8388608/2097152 udp-default");
    // The program's own setsockopt before listen / connect: the listener's
    // SO_RCVBUF sizes the RMBs of the connections it accepts (60,000: the
    // 64 KiB class), the client's SO_SNDBUF its send buffer (100,000: 128
    // KiB), over the sizes smc_run asked for.
    let (line, m) = buffers_seen(
        "bufs-program",
        &["-r", "200k"],
        &[("LRCV", "60000"), ("CSND", "100000")],
    );
    assert!(m.iter().all(|l| l.ends_with(" SMC-R")), "{m:?}");
    assert_eq!(line, "524288/262144 131072/2097152 udp-default");
}
