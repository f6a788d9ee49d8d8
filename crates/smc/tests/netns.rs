//! Two processes in two network namespaces, joined by a veth pair, connect
//! over SMC-R on the shared-memory device and move 16 MiB each way at once,
//! every byte checked (root: BPF, namespaces).
//!
//! The test process only builds the network and referees. The server and the
//! client are this test binary started again (`SMC_NETNS_ROLE`), each inside
//! its own fresh namespace through `nsenter --net` — not `ip netns exec`,
//! which remounts /sys and so hides the cgroup2 and bpf file systems the SYN
//! rendezvous needs (the library would fall back to TCP). Both namespaces
//! are private to this run, so the addresses cannot clash with the host's or
//! with another run's.
//!
//! A second test gives each end a shm rundir of its own, as two machines
//! have, and checks that neither offers nor accepts the shared-memory device
//! for a peer that is not on its host (finding 3 of issue 14).
//!
//! The children talk to the referee over their stdin/stdout: the server says
//! its port, each side reports its mode, the device it used and the hashes of
//! what it sent and received, then waits for "exit" so that neither side goes
//! away while the other still reads.

mod common;
use common::{pattern, Fnv};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const TOTAL: u64 = 16 << 20;
const CHUNK: usize = 200_000; // not a divisor of the 64 KiB buffers
const TEST: &str = "smc_r_between_two_network_namespaces";
/// Benchmarking range (RFC 2544), on the veth pair only.
const SERVER_IP: &str = "198.18.213.1";
const CLIENT_IP: &str = "198.18.213.2";
/// A stuck transfer fails the test instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends TOTAL bytes of direction `dir`, then shuts the write side; returns
/// their hash.
fn send(s: SmcStream, dir: u8) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < TOTAL {
        let n = (TOTAL - off).min(CHUNK as u64) as usize;
        for (k, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(dir, off + k as u64);
        }
        (&s).write_all(&buf[..n])
            .unwrap_or_else(|e| panic!("write at {off} of direction {dir}: {e}"));
        h.feed(&buf[..n]);
        off += n as u64;
    }
    s.shutdown(Shutdown::Write).expect("shutdown(Write)");
    h.0
}

/// Receives TOTAL bytes of direction `dir`, checking each, then the end of
/// the stream; returns their hash.
fn receive(s: &SmcStream, dir: u8) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < TOTAL {
        let n = (&*s)
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("read at {off} of direction {dir}: {e}"));
        assert!(n > 0, "end of stream after {off} of {TOTAL} bytes");
        for (k, &b) in buf[..n].iter().enumerate() {
            let o = off + k as u64;
            assert_eq!(b, pattern(dir, o), "byte {o} of direction {dir} is wrong");
        }
        h.feed(&buf[..n]);
        off += n as u64;
    }
    let n = (&*s).read(&mut buf).expect("read after the last byte");
    assert_eq!(n, 0, "{n} bytes beyond the {TOTAL} sent, no end of stream");
    h.0
}

/// One side's transfer: sends direction `tx` while receiving `1 - tx`, then
/// reports on stdout and waits for the referee's "exit" on stdin.
fn transfer(role: &str, s: SmcStream, tx: u8) {
    assert_eq!(s.mode(), Mode::SmcR, "{role} side mode");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    let w = s.try_clone().unwrap();
    let sender = thread::spawn(move || send(w, tx));
    let got = receive(&s, 1 - tx);
    let sent = sender.join().expect("sender thread");
    let devices: Vec<String> = smc::state().into_iter().map(|d| d.device).collect();
    println!(
        "{role} done mode {:?} devices {} sent {sent:016x} received {got:016x}",
        s.mode(),
        devices.join(",")
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "exit",
        "{role}: unexpected word from the referee"
    );
}

fn server() {
    let l = SmcListener::bind((SERVER_IP, 0)).unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (s, peer) = l.accept().unwrap();
    assert_eq!(peer.ip().to_string(), CLIENT_IP);
    transfer("server", s, 1);
}

fn client(port: u16) {
    let s = SmcStream::connect((SERVER_IP, port)).unwrap();
    transfer("client", s, 0);
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Waits (bounded) until `ifname` in `ns` is operationally up: until then
/// the shm device's port is down and the library would choose TCP.
fn wait_up(ns: &str, ifname: &str) {
    let t0 = Instant::now();
    loop {
        let out = Command::new("ip")
            .args(["-n", ns, "-o", "link", "show", "dev", ifname])
            .output()
            .expect("run ip");
        if String::from_utf8_lossy(&out.stdout).contains(" state UP ") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{ifname} in {ns} did not come up: {}",
            String::from_utf8_lossy(&out.stdout).trim()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Everything this run created, removed when dropped (also when the test
/// fails): the children first, then the namespaces (which takes the veth
/// pair with them), then the config directory.
#[derive(Default)]
struct Lab {
    children: Vec<Child>,
    namespaces: Vec<String>,
    dir: Option<PathBuf>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl Lab {
    /// Two fresh network namespaces joined by a veth pair, the server's end
    /// with [`SERVER_IP`], the client's with [`CLIENT_IP`], both up. Names
    /// are unique to this process and `tag` (a single character: interface
    /// names have at most 15 bytes, pids at most 7 digits).
    fn network(&mut self, tag: &str) -> (String, String, String, String) {
        let pid = std::process::id();
        let (ns_s, ns_c) = (
            format!("smc-lib-s{tag}{pid}"),
            format!("smc-lib-c{tag}{pid}"),
        );
        let (if_s, if_c) = (format!("smcls{tag}{pid}"), format!("smclc{tag}{pid}"));
        for ns in [&ns_s, &ns_c] {
            run("ip", &["netns", "add", ns]);
            self.namespaces.push(ns.clone());
        }
        // Created inside the server's namespace, so that deleting the namespaces
        // always deletes the pair; then one end moves to the client's.
        run(
            "ip",
            &[
                "-n", &ns_s, "link", "add", &if_s, "type", "veth", "peer", "name", &if_c,
            ],
        );
        run("ip", &["-n", &ns_s, "link", "set", &if_c, "netns", &ns_c]);
        for (ns, ifname, ip) in [(&ns_s, &if_s, SERVER_IP), (&ns_c, &if_c, CLIENT_IP)] {
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{ip}/30"), "dev", ifname],
            );
            run("ip", &["-n", ns, "link", "set", ifname, "up"]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        wait_up(&ns_s, &if_s);
        wait_up(&ns_c, &if_c);
        (ns_s, ns_c, if_s, if_c)
    }
    /// Starts this test binary in namespace `ns` as `role`.
    fn spawn(&mut self, ns: &str, role: &str, port: &str) -> (ChildStdin, BufReader<ChildStdout>) {
        self.spawn_test(TEST, ns, role, port, &[])
    }

    /// Starts the test `test` of this binary in namespace `ns` as `role`,
    /// with the environment `env` on top of ours.
    fn spawn_test(
        &mut self,
        test: &str,
        ns: &str,
        role: &str,
        port: &str,
        env: &[(&str, &std::ffi::OsStr)],
    ) -> (ChildStdin, BufReader<ChildStdout>) {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{ns}"))
            .arg(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_NETNS_ROLE", role)
            .env("SMC_NETNS_PORT", port);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run nsenter (util-linux)");
        let io = (
            child.stdin.take().unwrap(),
            BufReader::new(child.stdout.take().unwrap()),
        );
        self.children.push(child);
        io
    }
}

/// The rest of the first line of `out` that contains `marker` (libtest may
/// print "test NAME ... " on the same line first), or a panic with what the
/// child said instead.
fn expect_line(out: &mut BufReader<ChildStdout>, who: &str, marker: &str) -> String {
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("{who} exited before saying {marker:?}; its output:\n{seen}");
        }
        if let Some(i) = line.find(marker) {
            return line[i + marker.len()..].trim().to_string();
        }
        seen += &line;
    }
}

/// Parses "mode M devices D sent S received R".
fn report(line: &str) -> (String, String, String, String) {
    let w: Vec<&str> = line.split_whitespace().collect();
    match w.as_slice() {
        ["mode", m, "devices", d, "sent", s, "received", r] => {
            (m.to_string(), d.to_string(), s.to_string(), r.to_string())
        }
        _ => panic!("malformed report {line:?}"),
    }
}

#[test]
fn smc_r_between_two_network_namespaces() {
    match std::env::var("SMC_NETNS_ROLE").as_deref() {
        Ok("server") => return server(),
        Ok("client") => {
            let port = std::env::var("SMC_NETNS_PORT").unwrap().parse().unwrap();
            return client(port);
        }
        _ => {}
    }
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF, network namespaces); CI runs as root"
    );
    let pid = std::process::id();
    let mut lab = Lab::default();
    let (ns_s, ns_c, if_s, if_c) = lab.network("");
    // One shm config for both processes: a device per veth end. Each process
    // sees only its own end, so each must pick its own device.
    let dir = std::env::temp_dir().join(format!("smc-netns-test-{pid}"));
    lab.dir = Some(dir.clone());
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    let cfg = dir.join("shm.conf");
    std::fs::write(
        &cfg,
        format!(
            "rundir {}\ndevice shm-srv netdev {if_s}\ndevice shm-cli netdev {if_c}\n",
            dir.join("run").display()
        ),
    )
    .unwrap();
    std::env::set_var("SMC_RDMA_SHM_CONFIG", &cfg);
    std::env::set_var("SMC_RS_CONFIG_DIR", dir.join("conf"));

    let (mut srv_in, mut srv_out) = lab.spawn(&ns_s, "server", "");
    let port = expect_line(&mut srv_out, "server", "port ");
    let (mut cli_in, mut cli_out) = lab.spawn(&ns_c, "client", &port);

    let (c_mode, c_dev, c_sent, c_got) =
        report(&expect_line(&mut cli_out, "client", "client done "));
    let (s_mode, s_dev, s_sent, s_got) =
        report(&expect_line(&mut srv_out, "server", "server done "));
    assert_eq!((c_mode.as_str(), s_mode.as_str()), ("SmcR", "SmcR"));
    assert_eq!(
        (c_dev.as_str(), s_dev.as_str()),
        ("shm-cli", "shm-srv"),
        "each side uses the device of its own veth end"
    );
    assert_eq!(
        c_sent, s_got,
        "client to server: the two processes saw different streams"
    );
    assert_eq!(
        s_sent, c_got,
        "server to client: the two processes saw different streams"
    );

    for stdin in [&mut srv_in, &mut cli_in] {
        writeln!(stdin, "exit").unwrap();
    }
    for (who, out) in [("server", &mut srv_out), ("client", &mut cli_out)] {
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        assert!(
            rest.contains("test result: ok"),
            "{who} did not finish cleanly:\n{rest}"
        );
    }
    for (who, c) in ["server", "client"].iter().zip(&mut lab.children) {
        let st = c.wait().unwrap();
        assert!(st.success(), "{who} process failed: {st}");
    }
}

const OFF_HOST_TEST: &str = "a_shared_memory_device_serves_no_peer_on_another_host";

/// One side of an off-host connection: reports its mode, then checks that
/// the connection carries data over TCP both ways.
fn off_host_side(role: &str, s: SmcStream) {
    let mode = match s.mode() {
        Mode::SmcR => "SmcR".to_string(),
        Mode::Tcp(f) => format!("{:08x}/{:08x}", f.code(), f.peer.map_or(0, |p| p.to_u32())),
    };
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut buf = [0u8; 5];
    if role == "server" {
        (&s).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        (&s).write_all(b"world").unwrap();
    } else {
        (&s).write_all(b"hello").unwrap();
        (&s).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"world");
    }
    println!("{role} done mode {mode}");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
}

/// Finding 3: a shared-memory device reaches only processes of this host
/// (through its rundir), so neither end may offer or accept it for a peer
/// elsewhere. "Elsewhere" is made here by giving each end a rundir of its
/// own (as two machines have): the client's address is not one of the
/// server's namespace and no shm device of the server's rundir has it, and
/// the other way round.
///
/// * The client sees the server is elsewhere and declines at once (no
///   device): both ends run over TCP.
/// * A client that takes the server for one of its host (its rundir has
///   the server's GID, as a kernel client proposes whatever its RNIC has)
///   proposes; the server must decline at once with "no SMC device" —
///   never Accept and Decline later, which costs a kernel client 4 s
///   (`SMC_LLC_WAIT_TIME` twice) and shows up here as a late reason
///   (0x0999xxxx) instead.
#[test]
fn a_shared_memory_device_serves_no_peer_on_another_host() {
    match std::env::var("SMC_NETNS_ROLE").as_deref() {
        Ok("server") => {
            let l = SmcListener::bind((SERVER_IP, 0)).unwrap();
            println!("port {}", l.local_addr().unwrap().port());
            std::io::stdout().flush().unwrap();
            let (s, _) = l.accept().unwrap();
            return off_host_side("server", s);
        }
        #[cfg(feature = "tokio")]
        Ok("server-tokio") => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let s = rt.block_on(async {
                let l = smc::tokio::SmcListener::bind((SERVER_IP, 0)).await.unwrap();
                println!("port {}", l.local_addr().unwrap().port());
                std::io::stdout().flush().unwrap();
                let (s, _) = l.accept().await.unwrap();
                s.into_std().unwrap()
            });
            return off_host_side("server", s);
        }
        Ok("client") => {
            let port: u16 = std::env::var("SMC_NETNS_PORT").unwrap().parse().unwrap();
            let s = SmcStream::connect((SERVER_IP, port)).unwrap();
            return off_host_side("client", s);
        }
        _ => {}
    }
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF, network namespaces); CI runs as root"
    );
    let pid = std::process::id();
    let mut lab = Lab::default();
    let (ns_s, ns_c, if_s, if_c) = lab.network("o");
    let dir = std::env::temp_dir().join(format!("smc-offhost-test-{pid}"));
    lab.dir = Some(dir.clone());
    // a rundir and a device configuration per end, as on two machines
    let conf = |who: &str, dev: &str, ifname: &str| {
        let run = dir.join(format!("run-{who}"));
        std::fs::create_dir_all(&run).unwrap();
        let cfg = dir.join(format!("{who}.conf"));
        std::fs::write(
            &cfg,
            format!("rundir {}\ndevice {dev} netdev {ifname}\n", run.display()),
        )
        .unwrap();
        (cfg, run)
    };
    let (cfg_s, _) = conf("server", "shm-srv", &if_s);
    let (cfg_c, run_c) = conf("client", "shm-cli", &if_c);
    let tables = dir.join("conf");
    std::fs::create_dir_all(&tables).unwrap();

    // (reason, peer's reason) of each end, as `off_host_side` prints them
    let no_dev = smc_wire::clc::DeclineCode::NoSmcDev.to_u32();
    let peer_decl = smc_wire::clc::DeclineCode::PeerDecl.to_u32();
    let declined_by_client = (
        format!("{no_dev:08x}/00000000"),
        format!("{peer_decl:08x}/{no_dev:08x}"),
    );
    let declined_by_server = (
        format!("{peer_decl:08x}/{no_dev:08x}"),
        format!("{no_dev:08x}/00000000"),
    );
    // (what, the client takes the server for one of its host, server role,
    // (client's, server's) reason/peer's reason)
    #[allow(unused_mut)]
    let mut cases = vec![
        ("the client declines", false, "server", declined_by_client),
        (
            "the server declines at once",
            true,
            "server",
            declined_by_server.clone(),
        ),
    ];
    #[cfg(feature = "tokio")]
    cases.push((
        "the tokio server declines at once",
        true,
        "server-tokio",
        declined_by_server,
    ));
    for (what, client_believes, server_role, (want_client, want_server)) in cases {
        if client_believes {
            // the server's GID in the client's rundir, as if a device of
            // the client's host had the server's address
            let gid = smc_wire::types::Gid::from_ip(SERVER_IP.parse().unwrap());
            std::fs::write(run_c.join(format!("gid-{}.elsewhere", gid.to_hex())), "").unwrap();
        }
        let (t, s_cfg, c_cfg) = (tables.as_os_str(), cfg_s.as_os_str(), cfg_c.as_os_str());
        let env_s = [("SMC_RDMA_SHM_CONFIG", s_cfg), ("SMC_RS_CONFIG_DIR", t)];
        let env_c = [("SMC_RDMA_SHM_CONFIG", c_cfg), ("SMC_RS_CONFIG_DIR", t)];
        let (mut srv_in, mut srv_out) =
            lab.spawn_test(OFF_HOST_TEST, &ns_s, server_role, "", &env_s);
        let port = expect_line(&mut srv_out, "server", "port ");
        let (mut cli_in, mut cli_out) =
            lab.spawn_test(OFF_HOST_TEST, &ns_c, "client", &port, &env_c);
        let c_mode = expect_line(&mut cli_out, "client", "client done mode ");
        let s_mode = expect_line(&mut srv_out, "server", "server done mode ");
        assert_eq!(
            (c_mode.as_str(), s_mode.as_str()),
            (want_client.as_str(), want_server.as_str()),
            "{what}: (client, server) reason/peer's reason"
        );
        for stdin in [&mut srv_in, &mut cli_in] {
            writeln!(stdin, "exit").unwrap();
        }
        for (who, out) in [("server", &mut srv_out), ("client", &mut cli_out)] {
            let mut rest = String::new();
            out.read_to_string(&mut rest).unwrap();
            assert!(
                rest.contains("test result: ok"),
                "{what}: {who} did not finish cleanly:\n{rest}"
            );
        }
        for c in lab.children.iter_mut() {
            let st = c.wait().unwrap();
            assert!(st.success(), "{what}: a process failed: {st}");
        }
        lab.children.clear();
    }
}
