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

    fn client(&self, preload: bool, port: u16, n: usize) -> Output {
        self.cmd(preload)
            .args(["client", &port.to_string(), &n.to_string()])
            .output()
            .unwrap()
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
    let s = setup(tag);
    let (srv, port) = s.server(server_preload, epoll);
    let out = s.client(client_preload, port, n);
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
