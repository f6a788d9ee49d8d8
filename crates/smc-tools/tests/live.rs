//! The tools against live processes: this test process holds SMC-R
//! connections (shared-memory device on `lo`, root for the BPF
//! rendezvous), a fallback and a listener; a child process holds another
//! connection. `smcss`, `smcr linkgroup`, `smcr stats` see them with the
//! right mode, state, reason and PID; a killed process disappears; a reset
//! starts the counts again.

use serde_json::Value;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn setup() -> PathBuf {
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root (BPF); CI runs as root"
    );
    let base = std::env::temp_dir().join(format!("smc-tools-live-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::env::set_var("SMC_RS_RUN_DIR", base.join("registry"));
    smc::use_loopback_device(&format!("smc-tools-live-{}", std::process::id()));
    base.join("registry")
}

fn tool(bin: &str, args: &[&str], dir: &Path) -> Output {
    Command::new(bin)
        .args(args)
        .env("SMC_RS_RUN_DIR", dir)
        .output()
        .unwrap()
}

fn smcss(args: &[&str], dir: &Path) -> String {
    let o = tool(env!("CARGO_BIN_EXE_smcss"), args, dir);
    assert!(o.status.success(), "{o:?}");
    String::from_utf8(o.stdout).unwrap()
}

fn smcr(args: &[&str], dir: &Path) -> String {
    let o = tool(env!("CARGO_BIN_EXE_smcr"), args, dir);
    assert!(o.status.success(), "{o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// Waits until `f` holds for `smcss --json -a` (registry files are
/// rewritten within about 100 ms of an event).
fn until(dir: &Path, what: &str, f: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let out = smcss(&["-a", "--json"], dir);
        let v: Vec<Value> = serde_json::from_str(&out).unwrap();
        if f(&v) {
            return v;
        }
        assert!(Instant::now() < end, "{what}: never seen in {out}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_tools_show_live_connections_of_two_processes() {
    let dir = setup();
    let me = u64::from(std::process::id());
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = std::thread::spawn(move || {
        let mut v = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            v.push(s);
        }
        (v, l)
    });
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    // a fallback: a plain TCP server never offers SMC (PEERNOSMC)
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let f = SmcStream::connect(plain.local_addr().unwrap()).unwrap();
    let (_p, _) = plain.accept().unwrap();
    // a second process: a client that connects and waits
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_client", "--exact", "--nocapture"])
        .env("CHILD_CONNECT", addr.to_string())
        .env("SMC_RS_RUN_DIR", &dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let child_pid = u64::from(child.id());
    let faddr = f.local_addr().unwrap().to_string();
    let v = until(&dir, "both processes' sockets", |v| {
        v.iter()
            .any(|s| s["pid"] == child_pid && s["mode"] == "SMCR")
            && v.iter().any(|s| s["local"] == faddr.as_str())
            && v.iter()
                .filter(|s| s["pid"] == me && s["mode"] == "SMCR")
                .count()
                >= 3
    });
    let fb = v.iter().find(|s| s["local"] == faddr.as_str()).unwrap();
    assert_eq!(fb["mode"], "TCP");
    assert_eq!(fb["fallback"]["reason"].as_u64(), Some(0x0301_0000));
    assert_eq!(fb["pid"].as_u64(), Some(me));

    // the human view: one line per connection, the mode, the reason, the pid
    let text = smcss(&[], &dir);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("State          UID   Inode   Local Address"));
    let mine = format!("{me}/");
    let caddr = c.local_addr().unwrap().to_string();
    // (the server's end of the same connection has this address as its peer)
    let cl = lines
        .iter()
        .find(|l| l.split_whitespace().nth(3) == Some(caddr.as_str()))
        .expect("client line");
    let fields: Vec<&str> = cl.split_whitespace().collect();
    assert_eq!(fields[0], "ACTIVE");
    assert_eq!(
        fields[4],
        addr.to_string(),
        "peer is field 5, as smc_chk reads it"
    );
    assert_eq!(fields[6], "SMCR", "mode is field 7");
    assert!(fields[7].starts_with(&mine), "{cl}");
    let fl = lines
        .iter()
        .find(|l| l.split_whitespace().nth(3) == Some(faddr.as_str()))
        .expect("fallback line");
    let fields: Vec<&str> = fl.split_whitespace().collect();
    assert_eq!(&fields[6..8], &["TCP", "0x03010000"], "{fl}");
    assert!(lines.iter().any(|l| l.contains(&format!("{child_pid}/"))));
    assert!(!text.contains("LISTEN"), "no listeners without -a/-l");
    let listening = smcss(&["-l"], &dir);
    assert!(listening
        .lines()
        .any(|l| l.starts_with("LISTEN") && l.contains(&addr.to_string())));
    let smcr_only = smcss(&["-R"], &dir);
    assert!(!smcr_only.contains(&faddr), "-R: SMC-R sockets only");
    assert!(smcr_only
        .lines()
        .any(|l| l.contains(&caddr) && l.contains("CLNT")));

    // link groups of both processes
    let lg = smcr(&["linkgroup"], &dir);
    assert!(
        lg.lines()
            .any(|l| l.contains("CLNT") && l.contains("SINGLE") && l.contains(&mine)),
        "{lg}"
    );
    assert!(
        lg.lines().any(|l| l.contains(&format!("{child_pid}/"))),
        "{lg}"
    );
    let ls = smcr(&["-d", "linkgroup", "link-show"], &dir);
    assert!(ls.contains("LINK_ACTIVE"), "{ls}");
    let dev = smcr(&["device"], &dir);
    assert!(
        dev.lines()
            .any(|l| l.starts_with("lo ") && l.contains("SHM")),
        "{dev}"
    );

    // stats: what this test did. SMC-R: `c` and the child's connection
    // (client), their two server ends here; one fallback (PEER_NO_SMC);
    // 4 bytes each way on each of the two connections; one CDC per write
    // (4 bytes each, no consumer update due), each received once.
    // (each process publishes within a second; a snapshot may read the
    // engine's message counts just before a byte count: wait for all)
    let want = |s: &Value| {
        s["smc"]["client"].as_u64() == Some(2)
            && s["rx_bytes"].as_u64() == Some(16)
            && s["tx_bytes"].as_u64() == Some(16)
            && s["cdc_received"].as_u64() == Some(4)
    };
    let end = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st: Value = serde_json::from_str(&smcr(&["stats", "--json"], &dir)).unwrap();
        if want(&st["SMCR"]) || Instant::now() > end {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let s = &st["SMCR"];
    assert_eq!(s["smc"]["client"].as_u64(), Some(2), "{st}");
    assert_eq!(s["smc"]["server"].as_u64(), Some(2), "{st}");
    assert_eq!(s["fallback"]["client"].as_u64(), Some(1), "{st}");
    assert_eq!(s["fallback"]["server"].as_u64(), None, "{st}");
    assert_eq!(s["handshake_errors"]["client"].as_u64(), None, "{st}");
    assert_eq!(
        s["fallback_reasons"]["client"]["0x03010000"],
        serde_json::json!({"name": "PEER_NO_SMC", "count": 1}),
        "{st}"
    );
    assert_eq!(s["rx_bytes"].as_u64(), Some(16), "{st}");
    assert_eq!(s["tx_bytes"].as_u64(), Some(16), "{st}");
    assert_eq!(s["rx_hist"]["8K"], s["rx_cnt"], "{st}");
    assert_eq!(s["tx_hist"]["8K"].as_u64(), Some(4), "{st}");
    assert_eq!(s["cdc_sent"].as_u64(), Some(4), "{st}");
    assert_eq!(s["cdc_received"].as_u64(), Some(4), "{st}");
    // the first contacts' CONFIRM_LINK exchanges (request and response
    // each way: two link groups, one per process pair direction)
    assert!(s["llc_sent"].as_u64() >= Some(2), "{st}");
    assert_eq!(s["llc_sent"], s["llc_received"], "{st}");
    let text = smcr(&["-d", "stats"], &dir);
    assert!(text.contains("PEER_NO_SMC"), "{text}");
    assert!(
        text.contains("  CDC messages sent                     4"),
        "{text}"
    );

    // the engine's columns: cursors (4 bytes each way, their CDCs' sends
    // completed by a later look's, `Endpoint::settle_sends`), GIDs
    let v = until(&dir, "cursors", |v| {
        v.iter().any(|s| {
            s["local"] == caddr.as_str()
                && s["cursors"]["rx_prod"]["count"].as_u64() == Some(4)
                && s["cursors"]["tx_fin"]["count"].as_u64() == Some(4)
        })
    });
    let cs = v.iter().find(|s| s["local"] == caddr.as_str()).unwrap();
    assert_eq!(cs["cursors"]["tx_prod"]["count"].as_u64(), Some(4), "{cs}");
    assert_eq!(cs["cursors"]["tx_fin"]["count"].as_u64(), Some(4), "{cs}");
    let dbg = smcss(&["-d"], &dir);
    let dl = dbg.lines().find(|l| l.contains(&caddr)).unwrap();
    assert!(dl.contains("0000:00000004 "), "{dl}");
    let r = smcss(&["-R"], &dir);
    let rl = r.lines().find(|l| l.contains(&caddr)).unwrap();
    let gid = cs["gid"].as_str().unwrap_or_default();
    assert_eq!(gid.len(), 39, "eight groups of four hex digits: {cs}");
    assert!(
        rl.contains(gid) && rl.contains(cs["peer_gid"].as_str().unwrap()),
        "{rl}"
    );
    let dd = smcr(&["-dd", "linkgroup", "link-show"], &dir);
    assert!(dd.contains("Local-GID") && dd.contains(gid), "{dd}");

    // smc_dbg: all of it in one report
    let o = tool(env!("CARGO_BIN_EXE_smc_dbg"), &[], &dir);
    assert!(o.status.success(), "{o:?}");
    let report = String::from_utf8(o.stdout).unwrap();
    for section in [
        "===== version =====",
        "===== smcss --all --debug =====",
        "===== smcr -d linkgroup link-show =====",
        "===== smcr -d stats =====",
        "===== rendezvous =====",
    ] {
        assert!(report.contains(section), "{section} missing:\n{report}");
    }
    assert!(
        report.contains(&caddr) && report.contains(&format!("{child_pid}/")),
        "{report}"
    );

    // the child is killed: its entries go within a second
    child.kill().unwrap();
    child.wait().unwrap();
    let t = Instant::now();
    until(&dir, "the killed child's entries gone", |v| {
        !v.iter().any(|s| s["pid"] == child_pid)
    });
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
    // its counts stay in the totals
    let st: Value = serde_json::from_str(&smcr(&["stats", "--json"], &dir)).unwrap();
    assert!(st["SMCR"]["smc"]["client"].as_u64() >= Some(2), "{st}");
    // reset: counting from zero
    smcr(&["stats", "reset"], &dir);
    let st: Value = serde_json::from_str(&smcr(&["stats", "--json"], &dir)).unwrap();
    assert_eq!(st["SMCR"]["smc"]["client"].as_u64(), None, "{st}");
    let abs: Value = serde_json::from_str(&smcr(&["-a", "stats", "--json"], &dir)).unwrap();
    assert!(abs["SMCR"]["smc"]["client"].as_u64() >= Some(2), "{abs}");
    drop((c, f));
    drop(srv.join().unwrap());
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// The child process of the test above (run by it with `CHILD_CONNECT`;
/// without it, nothing to do).
#[test]
fn child_client() {
    let Ok(addr) = std::env::var("CHILD_CONNECT") else {
        return;
    };
    let mut c = SmcStream::connect(addr.as_str()).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.write_all(b"chld").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    // until killed (or its parent closes our stdin)
    let _ = std::io::stdin().read(&mut [0u8; 1]);
}

/// `SMC_LOG=info`: a process's connection events on stderr, one line each
/// (here a fallback, with its reason); nothing without it.
#[test]
fn smc_log_prints_connection_events() {
    // (not `setup`: the test above runs at the same time in this process
    // and owns that directory)
    let reg = std::env::temp_dir().join(format!("smc-tools-log-{}", std::process::id()));
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = plain.local_addr().unwrap().to_string();
    let run = |log: Option<&str>| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args(["log_child", "--exact", "--nocapture"])
            .env("CHILD_LOG_CONNECT", &addr)
            .env("SMC_RS_RUN_DIR", &reg)
            .env_remove("SMC_LOG");
        if let Some(l) = log {
            c.env("SMC_LOG", l);
        }
        let child = c.stderr(std::process::Stdio::piped()).spawn().unwrap();
        let (_s, _) = plain.accept().unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stderr).unwrap()
    };
    let on = run(Some("info"));
    let line = on
        .lines()
        .find(|l| l.starts_with("smc-rs INFO smc: connection fell back to TCP"))
        .unwrap_or_else(|| panic!("no fallback event in {on:?}"));
    assert!(line.contains("role=\"CLNT\""), "{line}");
    assert!(line.contains(&format!("peer=\"{addr}\"")), "{line}");
    assert!(line.contains("reason=\"0x0301"), "{line}");
    let off = run(None);
    assert!(!off.contains("smc-rs INFO"), "{off}");
    let _ = std::fs::remove_dir_all(reg);
}

/// The child of the test above: one connection to a plain TCP server.
#[test]
fn log_child() {
    let Ok(addr) = std::env::var("CHILD_LOG_CONNECT") else {
        return;
    };
    let c = SmcStream::connect(addr.as_str()).unwrap();
    assert!(matches!(c.mode(), Mode::Tcp(_)));
}
