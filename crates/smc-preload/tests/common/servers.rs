//! redis and nginx run as a distribution runs them (optionally as their
//! ordinary users, with the rendezvous opened to users as its install does),
//! for the real-program and the privilege tests.

use super::*;

/// redis-server, redis-benchmark (SET and GET, 50 clients, pipelined and
/// not) and redis-cli reading back what the benchmark wrote; a background
/// save (a forked child) while the server keeps serving.
pub fn redis(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    redis_as(tag, server_preload, client_preload, None)
}

/// `cmd` run as `user` instead (its own uid, gid and groups: `setpriv`, as
/// an init system starts a service), from a directory it can reach.
pub fn as_user(cmd: Command, user: Option<&str>) -> Command {
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
pub fn redis_as(
    tag: &str,
    server_preload: bool,
    client_preload: bool,
    user: Option<&str>,
) -> Setup {
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
        let uid = uid_of(user);
        let line = st.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert_eq!(line.split_whitespace().nth(1), Some(uid.as_str()), "{line}");
    }
    let got = under(&s, client_preload, &cli, &["-p", &port, "get", "smc"])
        .output()
        .unwrap();
    assert_eq!(ok_output("redis-cli get", &got).trim_end(), "over SMC-R");
    drop(srv);
    s
}

/// nginx (master and two workers, which accept on the master's listening
/// socket: it crosses fork()) serving a file with sendfile, fetched by curl
/// (hash) and wrk.
pub fn nginx(tag: &str, server_preload: bool, client_preload: bool) -> Setup {
    nginx_as(tag, server_preload, client_preload, None)
}

/// The tests that open the rendezvous to every user change the host's
/// access: one at a time (as crates/smc/tests/unprivileged.rs does; cargo
/// runs test binaries one after the other).
static ADMIN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What `smc-rendezvous install` does (the rendezvous open to every user),
/// with the run's shm rundir and registry made as for every user; undone on
/// drop.
pub struct OpenToUsers {
    _serial: std::sync::MutexGuard<'static, ()>,
    prev_access: smc_bpf::Access,
    prev_bpffs_mode: u32,
}

impl OpenToUsers {
    pub fn new(s: &Setup) -> OpenToUsers {
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
pub fn nginx_as(
    tag: &str,
    server_preload: bool,
    client_preload: bool,
    user: Option<&str>,
) -> Setup {
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
        let uid = uid_of(user);
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
            if workers.len() == 2 && workers.iter().all(|u| *u == uid) {
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
pub struct Nginx(pub Child);

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
pub fn program_sbin(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin", "/usr/local/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| program(name))
}

/// `user`'s numeric uid, as `id -u` prints it.
fn uid_of(user: &str) -> String {
    let out = Command::new("id").args(["-u", user]).output().unwrap();
    assert!(out.status.success(), "no user {user}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
