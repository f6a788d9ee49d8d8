//! SMC-R for processes without privileges (issue 16, "Unprivileged programs"),
//! and what a process of another user can do to their connections (root: it
//! installs the rendezvous and starts the others as `nobody`).
//!
//! The test process is the administrator: it opens the installed SYN-option
//! rendezvous to every user (`smc-rendezvous install`, here
//! `smc_bpf::set_access`), gives the run a shm rundir made as the device makes
//! it (1777) and a config naming it, and starts this test binary again
//! (`SMC_UNPRIV_ROLE`), as a copy in that directory (the build may sit where
//! `nobody` cannot reach it), in the roles below. Each test puts the
//! rendezvous's access and the bpffs mount point's mode back as they were.
//!
//! * `server`: binds `127.0.0.1:0`, says its port, accepts one connection,
//!   says its mode, echoes `TOTAL` bytes, then waits for `exit` on stdin.
//!   With `SMC_UNPRIV_DROP` it binds as root and then drops to `nobody`
//!   (groups, gid, uid of every thread), as nginx's or redis' setup does.
//! * `client`: connects, says its mode, sends `TOTAL` bytes and checks the
//!   echo, then waits for `exit`.
//! * `stranger`: a process of another uid tries to reach the buffers of the
//!   two processes named in its environment: their memfds through `/proc`,
//!   and every device socket of the rundir with region requests.
//! * `acceptor` and `late-client`: a client that was running before the
//!   rendezvous was opened to users connects again afterwards.

mod common;
use common::{line_with, pattern, Reaped};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

const ROLE_ENV: &str = "SMC_UNPRIV_ROLE";
const NOBODY: u32 = 65534;
/// Another unprivileged user (no passwd entry needed).
const OTHER: u32 = 65533;
const TOTAL: u64 = 4 << 20;
const CHUNK: usize = 100_000;

/// The tests change the host's rendezvous access: one at a time.
static ADMIN: Mutex<()> = Mutex::new(());

/// What one test set up, undone on drop.
struct Admin {
    _serial: std::sync::MutexGuard<'static, ()>,
    prev_access: smc_bpf::Access,
    prev_bpffs_mode: u32,
    base: PathBuf,
    exe: PathBuf,
    conf: PathBuf,
}

impl Admin {
    fn new(tag: &str) -> Admin {
        let serial = ADMIN.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(
            rustix::process::geteuid().as_raw(),
            0,
            "needs root (it installs the rendezvous and starts processes as nobody); CI runs as root"
        );
        let cfg = smc_bpf::Config::default();
        // Installed as any smc-rs process leaves it (if no test did yet).
        smc_bpf::Rendezvous::open_with(&cfg).unwrap_or_else(|e| panic!("{e}"));
        let prev_access = smc_bpf::access_of(&cfg.namespace_dir()).unwrap();
        let prev_bpffs_mode = std::fs::metadata(&cfg.bpffs).unwrap().permissions().mode();
        // `smc-rendezvous install`
        smc_bpf::set_access(&cfg, smc_bpf::Access::Everyone).unwrap_or_else(|e| panic!("{e}"));
        let base = std::env::temp_dir().join(format!("smc-unpriv-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        let run = base.join("run");
        smc_rdma::shm::registry::create_rundir(&run).unwrap();
        let reg = base.join("registry");
        std::fs::create_dir(&reg).unwrap();
        std::fs::set_permissions(&reg, std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::fs::create_dir(base.join("conf")).unwrap();
        let conf = base.join("shm.conf");
        std::fs::write(
            &conf,
            format!("rundir {}\ndevice shm-lo netdev lo\n", run.display()),
        )
        .unwrap();
        let exe = base.join("test-exe");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        Admin {
            _serial: serial,
            prev_access,
            prev_bpffs_mode,
            base,
            exe,
            conf,
        }
    }

    fn rundir(&self) -> PathBuf {
        self.base.join("run")
    }

    /// This test binary again in `role`, as `uid` (root if `None`).
    fn spawn(&self, test: &str, role: &str, uid: Option<u32>, env: &[(&str, String)]) -> Child {
        let mut cmd = Command::new(&self.exe);
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .env("SMC_RDMA_SHM_CONFIG", &self.conf)
            .env("SMC_RS_RUN_DIR", self.base.join("registry"))
            // PNET and UEID tables of the run's own (none), not the host's
            .env("SMC_RS_CONFIG_DIR", self.base.join("conf"))
            .env_remove("XDG_RUNTIME_DIR")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(uid) = uid {
            // std clears the supplementary groups when root starts a child
            // with another uid.
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take().unwrap();
        Child {
            out,
            stdin,
            proc: Reaped(child),
        }
    }
}

impl Drop for Admin {
    fn drop(&mut self) {
        let cfg = smc_bpf::Config::default();
        let _ = smc_bpf::set_access(&cfg, self.prev_access);
        let _ = std::fs::set_permissions(
            &cfg.bpffs,
            std::fs::Permissions::from_mode(self.prev_bpffs_mode),
        );
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

struct Child {
    out: BufReader<ChildStdout>,
    stdin: ChildStdin,
    proc: Reaped,
}

impl Child {
    fn line(&mut self, marker: &str) -> String {
        line_with(&mut self.out, marker)
    }
    fn pid(&self) -> u32 {
        self.proc.0.id()
    }
    /// Says `exit` and waits for a clean end.
    fn finish(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let st = self.proc.0.wait().unwrap();
        assert!(st.success(), "child failed: {st}");
    }
}

// ----- the roles -----

fn wait_for_exit() {
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

fn uid_line() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let get = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or("?")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!("uid={} cap_eff={}", get("Uid:"), get("CapEff:"))
}

/// Drops root for good: no supplementary groups, then gid and uid of every
/// thread of the process (the library has started threads by now).
fn drop_to_nobody() {
    // SAFETY: setgroups/setgid/setuid take only integers (and a null list of
    // length 0); glibc applies them to every thread of the process. Each
    // result is checked.
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
        assert_eq!(libc::setgid(NOBODY), 0, "setgid");
        assert_eq!(libc::setuid(NOBODY), 0, "setuid");
    }
}

fn role_server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    if std::env::var_os("SMC_UNPRIV_DROP").is_some() {
        drop_to_nobody();
    }
    println!("who {}", uid_line());
    println!("port {}", l.local_addr().unwrap().port());
    let (s, _) = l.accept().unwrap();
    println!("server-mode {:?}", s.mode());
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    while got < TOTAL {
        let n = (&s).read(&mut buf).unwrap();
        assert!(n > 0, "end of stream after {got} bytes");
        for (k, &b) in buf[..n].iter().enumerate() {
            assert_eq!(
                b,
                pattern(1, got + k as u64),
                "byte {} is wrong",
                got + k as u64
            );
        }
        (&s).write_all(&buf[..n]).unwrap();
        got += n as u64;
    }
    println!("server-done {got}");
    wait_for_exit();
}

fn role_client() {
    let port: u16 = std::env::var("SMC_UNPRIV_PORT").unwrap().parse().unwrap();
    println!("who {}", uid_line());
    let s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    println!("client-mode {:?}", s.mode());
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let reader = s.try_clone().unwrap();
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; CHUNK];
        let mut got = 0u64;
        while got < TOTAL {
            let n = (&reader).read(&mut buf).unwrap();
            assert!(n > 0, "echo ended after {got} bytes");
            for (k, &b) in buf[..n].iter().enumerate() {
                assert_eq!(
                    b,
                    pattern(1, got + k as u64),
                    "echoed byte {} is wrong",
                    got + k as u64
                );
            }
            got += n as u64;
        }
        got
    });
    let mut off = 0u64;
    let mut buf = vec![0u8; CHUNK];
    while off < TOTAL {
        let n = (TOTAL - off).min(CHUNK as u64) as usize;
        for (k, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(1, off + k as u64);
        }
        (&s).write_all(&buf[..n]).unwrap();
        off += n as u64;
    }
    let got = echo.join().unwrap();
    println!("client-done {got}");
    wait_for_exit();
}

/// What a process of another user gets when it goes for the buffers of the
/// processes in `SMC_UNPRIV_VICTIMS`: one `stranger` line with what it could
/// open and the errors it got.
fn role_stranger() {
    use smc_rdma::shm::wire::{Kind, Msg};
    use smc_rdma::sys::SeqPacket;
    println!("who {}", uid_line());
    let victims: Vec<u32> = std::env::var("SMC_UNPRIV_VICTIMS")
        .unwrap()
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    let rundir = PathBuf::from(std::env::var("SMC_UNPRIV_RUNDIR").unwrap());
    let (mut memfds_seen, mut memfds_opened, mut proc_errors) = (0usize, 0usize, Vec::new());
    for pid in &victims {
        // the memfds holding the connection's buffers, through /proc
        match std::fs::read_dir(format!("/proc/{pid}/fd")) {
            Ok(rd) => {
                for e in rd.flatten() {
                    let is_memfd = std::fs::read_link(e.path())
                        .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"));
                    if is_memfd {
                        memfds_seen += 1;
                        if std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(e.path())
                            .is_ok()
                        {
                            memfds_opened += 1;
                        }
                    }
                }
            }
            Err(e) => proc_errors.push(format!("fd:{:?}", e.kind())),
        }
        for f in ["mem", "map_files"] {
            let p = format!("/proc/{pid}/{f}");
            let r = if f == "mem" {
                std::fs::File::open(&p).map(|_| ())
            } else {
                std::fs::read_dir(&p).map(|_| ())
            };
            if let Err(e) = r {
                proc_errors.push(format!("{f}:{:?}", e.kind()));
            }
        }
    }
    // every device socket of the rundir: ask for regions with keys of our
    // own; descriptors that came back would be someone's memory
    let (mut sockets, mut fds_received) = (0usize, 0usize);
    for e in std::fs::read_dir(&rundir).unwrap().flatten() {
        if !e.file_name().to_string_lossy().ends_with(".sock") {
            continue;
        }
        for rkey in 0..16u32 {
            let Ok(c) = SeqPacket::connect(&e.path()) else {
                continue;
            };
            if rkey == 0 {
                sockets += 1;
            }
            let req = Msg {
                a: 1,
                b: rkey.wrapping_mul(0x9e37_79b9) ^ 0x5bd1_e995,
                ..Msg::new(Kind::MrReq)
            };
            let _ = c.send(&req.encode(), &[]);
            let _ = c.set_read_timeout(Duration::from_millis(50));
            let mut b = [0u8; 128];
            while let Ok((n, fds)) = c.recv(&mut b) {
                fds_received += fds.len();
                if n == 0 {
                    break;
                }
            }
        }
    }
    println!(
        "stranger memfds_seen={memfds_seen} memfds_opened={memfds_opened} proc_errors={} sockets={sockets} fds_received={fds_received}",
        proc_errors.join(",")
    );
}

/// A few bytes there and back.
fn ping(mut s: &SmcStream) {
    s.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
}

/// Accepts two connections, says each one's mode and echoes four bytes.
fn role_acceptor() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    for i in 0..2 {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        println!("acceptor-mode{i} {:?}", s.mode());
    }
    wait_for_exit();
}

/// Connects once, waits for `go` on stdin, lets the rendezvous's retry
/// interval pass and connects again: a program that was running when the
/// administrator installed the rendezvous for it.
fn role_late_client() {
    let port: u16 = std::env::var("SMC_UNPRIV_PORT").unwrap().parse().unwrap();
    let s = SmcStream::connect(("127.0.0.1", port)).unwrap();
    ping(&s);
    println!("late-mode0 {:?}", s.mode());
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    std::thread::sleep(smc_bpf::RETRY_AFTER + Duration::from_millis(500));
    let s2 = SmcStream::connect(("127.0.0.1", port)).unwrap();
    ping(&s2);
    println!("late-mode1 {:?}", s2.mode());
    wait_for_exit();
}

/// Runs the role of a child started by a test, if this is one.
fn child_role() -> bool {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("server") => role_server(),
        Ok("client") => role_client(),
        Ok("acceptor") => role_acceptor(),
        Ok("late-client") => role_late_client(),
        Ok("stranger") => role_stranger(),
        Ok(r) => panic!("unknown role {r}"),
        Err(_) => return false,
    }
    true
}

// ----- the tests -----

/// Starts a server (`server_env`) and a client as nobody; returns both once
/// the echo is done, with their mode lines.
fn connect_pair(
    a: &Admin,
    test: &str,
    server_uid: Option<u32>,
    server_env: &[(&str, String)],
) -> (Child, Child, String, String) {
    let mut server = a.spawn(test, "server", server_uid, server_env);
    let who = server.line("who ");
    assert!(
        who.contains(&format!("uid={NOBODY} {NOBODY}")),
        "server: {who}"
    );
    assert!(who.contains("cap_eff=0000000000000000"), "server: {who}");
    let port = server.line("port ").trim_start_matches("port ").to_string();
    let mut client = a.spawn(test, "client", Some(NOBODY), &[("SMC_UNPRIV_PORT", port)]);
    let who = client.line("who ");
    assert!(
        who.contains(&format!("uid={NOBODY} {NOBODY}")),
        "client: {who}"
    );
    let cmode = client.line("client-mode ");
    let smode = server.line("server-mode ");
    assert_eq!(client.line("client-done "), format!("client-done {TOTAL}"));
    assert_eq!(server.line("server-done "), format!("server-done {TOTAL}"));
    (server, client, smode, cmode)
}

#[test]
fn ordinary_users_get_smc_r_once_the_rendezvous_is_installed() {
    const TEST: &str = "ordinary_users_get_smc_r_once_the_rendezvous_is_installed";
    if child_role() {
        return;
    }
    let a = Admin::new("users");
    let (server, client, smode, cmode) = connect_pair(&a, TEST, Some(NOBODY), &[]);
    assert_eq!(cmode, format!("client-mode {:?}", Mode::SmcR));
    assert_eq!(smode, format!("server-mode {:?}", Mode::SmcR));
    client.finish();
    server.finish();
}

#[test]
fn a_server_that_drops_root_after_bind_accepts_smc_r() {
    const TEST: &str = "a_server_that_drops_root_after_bind_accepts_smc_r";
    if child_role() {
        return;
    }
    let a = Admin::new("drop");
    let (server, client, smode, cmode) =
        connect_pair(&a, TEST, None, &[("SMC_UNPRIV_DROP", "1".into())]);
    assert_eq!(smode, format!("server-mode {:?}", Mode::SmcR));
    assert_eq!(cmode, format!("client-mode {:?}", Mode::SmcR));
    // Having changed its credentials, the server is not dumpable: not even
    // the other processes of its new uid reach its buffers through /proc.
    if std::fs::read_to_string("/proc/sys/fs/suid_dumpable").is_ok_and(|v| v.trim() == "0") {
        let env = [
            ("SMC_UNPRIV_VICTIMS", server.pid().to_string()),
            ("SMC_UNPRIV_RUNDIR", a.rundir().display().to_string()),
        ];
        let mut s = a.spawn(TEST, "stranger", Some(NOBODY), &env);
        let line = s.line("stranger ");
        assert!(s.proc.0.wait().unwrap().success());
        assert!(line.contains("memfds_opened=0"), "{line}");
        assert!(line.contains("fd:PermissionDenied"), "{line}");
    }
    client.finish();
    server.finish();
}

#[test]
fn another_user_cannot_reach_the_buffers_of_a_connection() {
    const TEST: &str = "another_user_cannot_reach_the_buffers_of_a_connection";
    if child_role() {
        return;
    }
    let a = Admin::new("stranger");
    let (server, client, smode, cmode) = connect_pair(&a, TEST, Some(NOBODY), &[]);
    assert_eq!(smode, format!("server-mode {:?}", Mode::SmcR));
    assert_eq!(cmode, format!("client-mode {:?}", Mode::SmcR));
    let env = [
        (
            "SMC_UNPRIV_VICTIMS",
            format!("{},{}", server.pid(), client.pid()),
        ),
        ("SMC_UNPRIV_RUNDIR", a.rundir().display().to_string()),
    ];
    let stranger = |uid| {
        let mut s = a.spawn(TEST, "stranger", Some(uid), &env);
        let line = s.line("stranger ");
        let st = s.proc.0.wait().unwrap();
        assert!(st.success(), "stranger failed: {st}");
        eprintln!("uid {uid}: {line}");
        line
    };
    // Another user: /proc refuses it (permission denied), and the device
    // sockets, which every user may connect to, hand it no descriptor.
    let line = stranger(OTHER);
    assert!(line.contains("memfds_seen=0 memfds_opened=0"), "{line}");
    assert!(
        line.contains("fd:PermissionDenied")
            && line.contains("mem:PermissionDenied")
            && line.contains("map_files:PermissionDenied"),
        "{line}"
    );
    assert!(
        !line.contains("sockets=0"),
        "no device socket tried: {line}"
    );
    assert!(line.contains("fds_received=0"), "{line}");
    // The same probe as the connection's own user does reach the memfds
    // (the kernel's rule for one user's processes, see smc-rdma's threat
    // model): the probe is real, and users are what separates connections.
    let line = stranger(NOBODY);
    assert!(!line.contains("memfds_seen=0"), "{line}");
    assert!(!line.contains("memfds_opened=0"), "{line}");
    assert!(line.contains("fds_received=0"), "{line}");
    client.finish();
    server.finish();
}

#[test]
fn a_program_running_before_the_install_gets_smc_r_for_its_later_connections() {
    const TEST: &str = "a_program_running_before_the_install_gets_smc_r_for_its_later_connections";
    if child_role() {
        return;
    }
    let a = Admin::new("later");
    let cfg = smc_bpf::Config::default();
    let mut acceptor = a.spawn(TEST, "acceptor", None, &[]);
    let port = acceptor
        .line("port ")
        .trim_start_matches("port ")
        .to_string();
    // not (yet) open to users
    smc_bpf::set_access(&cfg, smc_bpf::Access::Root).unwrap();
    let mut client = a.spawn(
        TEST,
        "late-client",
        Some(NOBODY),
        &[("SMC_UNPRIV_PORT", port)],
    );
    let first = client.line("late-mode0 ");
    assert!(first.starts_with("late-mode0 Tcp("), "{first}");
    assert!(acceptor
        .line("acceptor-mode0 ")
        .starts_with("acceptor-mode0 Tcp("));
    // `smc-rendezvous install` while the client runs
    smc_bpf::set_access(&cfg, smc_bpf::Access::Everyone).unwrap();
    writeln!(client.stdin, "go").unwrap();
    assert_eq!(
        client.line("late-mode1 "),
        format!("late-mode1 {:?}", Mode::SmcR)
    );
    assert_eq!(
        acceptor.line("acceptor-mode1 "),
        format!("acceptor-mode1 {:?}", Mode::SmcR)
    );
    client.finish();
    acceptor.finish();
}
