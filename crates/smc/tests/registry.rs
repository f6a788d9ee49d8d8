//! The live registry: a process's SMC-R and fallback connections and its
//! listener appear in its file in the run directory with the mode, state
//! and reason smcss shows; counters count them; entries of dead processes
//! are merged into the totals and removed; a reset starts the counts again.

mod common;

use common::setup;
use serde_json::Value;
use smc::registry::files;
use smc::{Mode, SmcListener, SmcStream};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

/// This process's entry once `ok` holds for it (the registry thread
/// publishes within about 100 ms of an event).
fn wait_entry(dir: &Path, ok: impl Fn(&Value) -> bool) -> Value {
    let end = Instant::now() + Duration::from_secs(10);
    let path = dir.join(format!("{}.json", std::process::id()));
    loop {
        if let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            if ok(&v) {
                return v;
            }
            assert!(Instant::now() < end, "registry entry never matched: {v:#}");
        }
        assert!(Instant::now() < end, "no registry entry at {path:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sockets(v: &Value) -> Vec<Value> {
    v["sockets"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_process_publishes_its_sockets_link_groups_and_counters() {
    setup();
    let dir = files::run_dir();
    let (c, s, l) = common::echoed_pair("127.0.0.1:0");
    let addr = l.local_addr().unwrap();
    // a fallback: a plain TCP server never offers SMC (PEERNOSMC)
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let f = SmcStream::connect(plain.local_addr().unwrap()).unwrap();
    let (_p, _) = plain.accept().unwrap();
    assert!(matches!(f.mode(), Mode::Tcp(_)));
    let caddr = c.local_addr().unwrap().to_string();
    let faddr = f.local_addr().unwrap().to_string();

    let v = wait_entry(&dir, |v| {
        let ss = sockets(v);
        ss.iter().any(|s| s["local"] == caddr.as_str())
            && ss.iter().any(|s| s["local"] == faddr.as_str())
            && v["link_groups"].as_array().is_some_and(|a| !a.is_empty())
            && v["counters"]["tx_bytes"].as_u64() >= Some(8)
    });
    assert_eq!(v["pid"].as_u64(), Some(u64::from(std::process::id())));
    let ss = sockets(&v);
    let find = |local: &str| {
        ss.iter()
            .find(|s| s["local"] == local)
            .unwrap_or_else(|| panic!("{local} not listed: {v:#}"))
            .clone()
    };
    let client = find(&caddr);
    assert_eq!(client["mode"], "SMCR", "{client}");
    assert_eq!(client["state"], "ACTIVE");
    assert_eq!(client["role"], "CLNT");
    assert_eq!(client["peer"], addr.to_string().as_str());
    assert_eq!(client["tx_bytes"].as_u64(), Some(4));
    assert_eq!(client["rx_bytes"].as_u64(), Some(4));
    assert!(client["token"].as_u64().is_some());
    assert!(client["inode"].as_u64().unwrap() > 0);
    let server = find(&addr.to_string()).clone();
    // (the listener and the server's connection share the local address)
    let server_conn = ss
        .iter()
        .find(|s| s["local"] == addr.to_string().as_str() && s["mode"] == "SMCR")
        .expect("server connection listed");
    assert_eq!(server_conn["role"], "SERV");
    assert!(
        ss.iter()
            .any(|s| s["state"] == "LISTEN" && s["local"] == addr.to_string().as_str()),
        "listener listed: {server}"
    );
    let fb = find(&faddr);
    assert_eq!(fb["mode"], "TCP");
    assert_eq!(fb["fallback"]["reason"].as_u64(), Some(0x0301_0000));
    // the connections' link group, with its link
    // (client and server each have a link group of their own)
    let lg = v["link_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == client["lgr_id"])
        .unwrap_or_else(|| panic!("the client's link group is listed: {v:#}"));
    assert_eq!(lg["type"], "SINGLE", "{lg}");
    assert_eq!(lg["role"], "CLNT");
    assert_eq!(lg["conns"].as_u64(), Some(1));
    assert_eq!(lg["links"][0]["state"], "LINK_ACTIVE");
    assert_eq!(lg["links"][0]["conns"].as_u64(), Some(1));
    // v1 here, no UEID: no peer extension, no EID (a v2 group keeps both,
    // see smc-engine's tests/add_link.rs)
    assert_eq!(lg["version"], 1, "{lg}");
    assert!(lg["peer_host"].is_null() && lg["eid"].is_null(), "{lg}");
    let c = &v["counters"];
    assert_eq!(c["smc"]["client"].as_u64(), Some(1), "{c}");
    assert_eq!(c["smc"]["server"].as_u64(), Some(1));
    assert_eq!(c["fallback"]["client"].as_u64(), Some(1));
    // the engine's events: each side's link came up once, nothing went down
    assert_eq!(c["link_up"].as_u64(), Some(2), "{c}");
    assert_eq!(c["link_down"].as_u64(), Some(0), "{c}");
    assert_eq!(c["aborts"].as_u64(), Some(0), "{c}");
    // each side registered an RMB and a send buffer, none from a pool
    assert_eq!(c["rmb_alloc"].as_u64(), Some(2), "{c}");
    assert_eq!(c["sndbuf_alloc"].as_u64(), Some(2), "{c}");
    assert_eq!(c["rmb_reuse"].as_u64(), Some(0), "{c}");
    assert_eq!(
        c["fallback_reasons"]["client"]["0x03010000"].as_u64(),
        Some(1)
    );

    // a closed connection disappears from the list, its bytes stay counted
    drop(s);
    drop(l);
    drop(f);
    let v = wait_entry(&dir, |v| {
        !sockets(v).iter().any(|s| s["local"] == faddr.as_str())
            && !sockets(v).iter().any(|s| s["state"] == "LISTEN")
    });
    assert!(v["counters"]["tx_bytes"].as_u64() >= Some(8));
    // the reader sees this process as live
    let live = files::read(&dir, true);
    assert!(live.iter().any(|e| e.pid == std::process::id()));
}

#[test]
fn entries_of_dead_processes_are_reaped_into_the_totals_and_reset_works() {
    let dir = std::env::temp_dir().join(format!("smc-registry-reap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    files::ensure_dir(&dir).unwrap();
    // a process that has exited
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let entry = |pid: u32, start: u64, n: u64| {
        serde_json::json!({
            "version": 1, "pid": pid, "start_time": start, "sockets": [],
            "counters": {"smc": {"client": n}, "fallback_reasons": {"server": {"0x03030002": n}}}
        })
        .to_string()
    };
    std::fs::write(dir.join(format!("{dead}.json")), entry(dead, 1, 5)).unwrap();
    // this process, live
    let me = std::process::id();
    let start = files::start_time(me).unwrap();
    std::fs::write(dir.join(format!("{me}.json")), entry(me, start, 2)).unwrap();
    // our pid with another start time: a dead process whose pid was reused
    let live = files::read(&dir, true);
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].pid, me);
    assert!(
        !dir.join(format!("{dead}.json")).exists(),
        "dead entry reaped"
    );
    let c = files::counters(&dir, &live, false);
    assert_eq!(c["smc"]["client"].as_u64(), Some(7), "{c}");
    assert_eq!(
        c["fallback_reasons"]["server"]["0x03030002"].as_u64(),
        Some(7)
    );
    // reset: zero since now, absolute unchanged
    files::reset(&dir).unwrap();
    let live = files::read(&dir, true);
    let c = files::counters(&dir, &live, false);
    assert!(c.get("smc").is_none(), "after reset: {c}");
    let a = files::counters(&dir, &live, true);
    assert_eq!(a["smc"]["client"].as_u64(), Some(7));
    // the live process counts on, then exits: only what came after the reset
    std::fs::write(dir.join(format!("{me}.json")), entry(me, start, 3)).unwrap();
    let live = files::read(&dir, true);
    assert_eq!(
        files::counters(&dir, &live, false)["smc"]["client"].as_u64(),
        Some(1)
    );
    let fake = serde_json::from_str::<Value>(&entry(me, start, 3)).unwrap();
    std::fs::write(dir.join(format!("{me}.json")), {
        let mut f = fake.clone();
        f["start_time"] = (start + 1).into();
        f.to_string()
    })
    .unwrap();
    // (same pid, other start time: a process that is gone, baseline unknown)
    let live = files::read(&dir, true);
    assert!(live.is_empty());
    let c = files::counters(&dir, &live, false);
    assert_eq!(c["smc"]["client"].as_u64(), Some(3), "{c}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A broken device configuration is reported in the registry (count and
/// message), not only seen as connections that find no SMC device. Runs
/// in a child process: the configuration is read once per process.
#[test]
fn a_broken_device_configuration_is_reported() {
    if std::env::var_os("SMC_TEST_BROKEN_CONFIG_CHILD").is_some() {
        let dir = files::run_dir();
        let l = SmcListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let c = SmcStream::connect(addr).unwrap();
        assert!(
            matches!(c.mode(), Mode::Tcp(_)),
            "no device: {:?}",
            c.mode()
        );
        let _s = t.join().unwrap().unwrap();
        let v = wait_entry(&dir, |v| v["errors"]["device_config"].is_string());
        let msg = v["errors"]["device_config"].as_str().unwrap();
        assert!(msg.contains("no-such-shm.conf"), "{msg}");
        assert!(v["counters"]["errors"]["device_config"].as_u64() >= Some(1));
        return;
    }
    setup();
    let dir = std::env::temp_dir().join(format!("smc-registry-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let st = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_broken_device_configuration_is_reported",
            "--exact",
            "--nocapture",
        ])
        .env("SMC_TEST_BROKEN_CONFIG_CHILD", "1")
        .env("SMC_RDMA_SHM_CONFIG", dir.join("no-such-shm.conf"))
        .env("SMC_RS_RUN_DIR", dir.join("registry"))
        .status()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(st.success(), "the child's checks failed");
}
