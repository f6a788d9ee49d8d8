//! What the test binaries share: a private directory with the shm device on
//! `lo` and the compiled echo program (`Setup`), running programs under
//! `smc_run` or plain, and the library's record of each connection's mode.
//! (Each test binary uses part of it.)
#![allow(dead_code)]

pub mod servers;

// (the binaries without redis or nginx leave these unused)
#[allow(unused_imports)]
pub use servers::*;
pub use std::path::{Path, PathBuf};
pub use std::process::{Child, Command, Output, Stdio};
pub use std::time::{Duration, Instant};

pub const SMC_RUN: &str = env!("CARGO_BIN_EXE_smc_run");

/// A private directory with the shm device on `lo` and the compiled echo program.
pub struct Setup {
    pub dir: PathBuf,
    pub echo: PathBuf,
}

pub fn setup(tag: &str) -> Setup {
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
    let echo = compile_c("echo", &dir);
    Setup { dir, echo }
}

/// tests/NAME.c compiled into `dir`/NAME (once per directory).
pub fn compile_c(name: &str, dir: &Path) -> PathBuf {
    let exe = dir.join(name);
    if exe.exists() {
        return exe;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/{name}.c"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(cc)
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(st.success(), "compiling {name}.c");
    exe
}

/// The port a test server wrote into `portfile`, waited for up to 20 s;
/// `None` if it never came.
pub fn wait_for_port(portfile: &Path) -> Option<u16> {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if let Some(p) = std::fs::read_to_string(portfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Some(p);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

impl Setup {
    pub fn cmd(&self, preload: bool) -> Command {
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

    pub fn server(&self, preload: bool, epoll: bool) -> (Child, u16) {
        let portfile = self.dir.join("port");
        let _ = std::fs::remove_file(&portfile);
        let mut c = self.cmd(preload);
        c.arg("server").arg(&portfile);
        if epoll {
            c.arg("epoll");
        }
        let mut child = c.stdout(Stdio::piped()).spawn().unwrap();
        if let Some(p) = wait_for_port(&portfile) {
            return (child, p);
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server did not start");
    }

    pub fn client(&self, preload: bool, port: u16, n: usize, fork: bool) -> Output {
        let mut c = self.cmd(preload);
        c.args(["client", &port.to_string(), &n.to_string()]);
        if fork {
            c.arg("fork");
        }
        c.output().unwrap()
    }

    /// The library's record: one line per connection, "pid role local peer mode".
    pub fn modes(&self) -> Vec<String> {
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

pub fn run(tag: &str, server_preload: bool, client_preload: bool, epoll: bool, n: usize) -> Setup {
    run_forked(tag, server_preload, client_preload, epoll, n, false)
}

pub fn run_forked(
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

pub fn assert_modes(s: &Setup, want: &[(&str, &str)]) {
    let got = s.modes();
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (role, mode) in want {
        assert!(
            got.iter().any(|l| l.starts_with(role) && l.contains(mode)),
            "no {role} connection in mode {mode}: {got:?}"
        );
    }
}

pub fn smc_run(args: &[&str]) -> Output {
    Command::new(SMC_RUN).args(args).output().unwrap()
}

/// A program from the distribution (the CI installs it), found on PATH.
pub fn program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed (.ci/run installs it)"))
}

/// `prog args` in `s`'s environment, under smc_run if `preload`.
pub fn under(s: &Setup, preload: bool, prog: &Path, args: &[&str]) -> Command {
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
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn sha256(data: &[u8]) -> String {
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

pub fn blob(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

/// A free TCP port on 127.0.0.1 (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Reads `child`'s stdout until a line contains `what` (then keeps draining
/// it in a thread, so that the program never blocks on a full pipe).
pub fn wait_for_line(child: &mut Child, what: &str) {
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
pub fn assert_all(s: &Setup, min: usize, mode: &str) -> Vec<String> {
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

pub const FALLBACK: &str = "(peer did not indicate SMC)";

/// A run's output line by line against the plain run's.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_same(plain: &str, other: &str, what: &str) {
    for (k, (a, b)) in plain.lines().zip(other.lines()).enumerate() {
        assert_eq!(a, b, "{what}: line {} differs from the plain run", k + 1);
    }
    assert_eq!(plain.lines().count(), other.lines().count(), "{what}");
}

pub fn ok_output(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// tests/conform.c, compiled into `s`'s directory.
pub fn conform_program(s: &Setup) -> PathBuf {
    compile_c("conform", &s.dir)
}

/// python3's http.server serving a file, fetched with curl; the body's hash
/// must match.
pub fn http_server_and_curl(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
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
