//! An idle process costs no CPU (issue 15, docs/FAST-PATH.md step 2): with
//! SMC-R connections established over the shm device and nothing to do, no
//! thread of the process wakes up, as the engine reports when it next needs
//! to run (`Endpoint::poll_timeout`) and its drivers sleep until then or an
//! event, not on a period; nor does the registry thread that publishes the
//! process's sockets for the tools (smcss), which looks when a connection
//! event, traffic or the engine gives it something to look at. Each case
//! runs alone in a process of its own (this binary started again, see
//! [`alone`]): the whole process's context switches are counted, and
//! whether the registry runs is the process's choice.

mod common;

use common::setup;
use serde_json::Value;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Names the case a process started by [`alone`] runs.
const CASE: &str = "SMC_IDLE_WAKEUPS_CASE";

/// Whether this process is the one to run `case` (a test of this file):
/// otherwise it runs this binary again for that test only, with the
/// registry on or off, and asserts that it passed (one case at a time: the
/// other's threads would take the CPU it counts on).
fn alone(case: &str, registry: bool) -> bool {
    if std::env::var(CASE).is_ok_and(|c| c == case) {
        return true;
    }
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let status = Command::new(std::env::current_exe().unwrap())
        .args([case, "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .env("SMC_RS_REGISTRY", if registry { "1" } else { "0" })
        .status()
        .unwrap();
    assert!(status.success(), "{case} failed: {status}");
    false
}

/// Voluntary context switches of the threads of this process so far (a
/// thread that sleeps and is woken makes one): of the shm device's thread,
/// and of all the others.
fn voluntary_switches() -> (u64, u64) {
    let (mut device, mut others) = (0, 0);
    for (name, v) in common::voluntary_switches_by_thread(false) {
        if name.starts_with("shm-") {
            device += v;
        } else {
            others += v;
        }
    }
    (device, others)
}

/// Connection `i` of a test: established over SMC-R, 100 bytes each way
/// (in use, then idle).
fn pair(l: &SmcListener, addr: SocketAddr, i: usize) -> (SmcStream, SmcStream) {
    let mut c = SmcStream::connect(addr).unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    assert_eq!(s.mode(), Mode::SmcR);
    c.write_all(&[i as u8; 100]).unwrap();
    let mut b = [0u8; 100];
    s.read_exact(&mut b).unwrap();
    s.write_all(&b).unwrap();
    c.read_exact(&mut b).unwrap();
    assert_eq!(b, [i as u8; 100]);
    (c, s)
}

#[test]
fn an_idle_process_with_established_connections_is_not_woken() {
    // (the registry's thread is the other case's)
    if !alone(
        "an_idle_process_with_established_connections_is_not_woken",
        false,
    ) {
        return;
    }
    setup();
    const CONNS: usize = 4;
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut pairs: Vec<_> = (0..CONNS).map(|i| pair(&l, addr, i)).collect();
    // what the handshakes and the data left to do is over
    std::thread::sleep(Duration::from_millis(500));
    let before = voluntary_switches();
    std::thread::sleep(Duration::from_secs(2));
    let after = voluntary_switches();
    let (device, woken) = (after.0 - before.0, after.1 - before.1);
    // The engine and its drivers (the progress thread, the listener, the
    // application threads): the test thread's own sleep and little else
    // (TEST_LINK runs every 30 s).
    assert!(
        woken < 10,
        "{woken} wake-ups in 2 s of an idle process with {CONNS} SMC-R connections"
    );
    // The shm device's thread stands for the adapter: it ticks on its own
    // period (heartbeats, port state; 20 ms by default), and nothing of the
    // engine wakes it more often.
    assert!(
        device <= 2000 / 20 + 20,
        "{device} wake-ups of the shm device thread in 2 s"
    );
    // still usable
    for (i, (c, s)) in pairs.iter_mut().enumerate() {
        c.write_all(&[i as u8; 10]).unwrap();
        let mut b = [0u8; 10];
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, [i as u8; 10]);
    }
}

/// Voluntary context switches (wake-ups) of this process's thread named
/// `name` so far.
fn switches_of(name: &str) -> u64 {
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap();
        return status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map(|v| v.trim().parse::<u64>().unwrap())
            .unwrap();
    }
    panic!("no thread {name}");
}

/// This process's registry file once `ok` holds for it.
fn published(ok: impl Fn(&Value) -> bool) -> Value {
    let path = smc::registry::files::run_dir().join(format!("{}.json", std::process::id()));
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let v = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok());
        if let Some(v) = &v {
            if ok(v) {
                return v.clone();
            }
        }
        assert!(Instant::now() < end, "registry file never matched: {v:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The published SMC-R socket with local address `local`.
fn socket(v: &Value, local: SocketAddr) -> Option<Value> {
    v["sockets"]
        .as_array()?
        .iter()
        .find(|s| s["mode"] == "SMCR" && s["local"] == local.to_string().as_str())
        .cloned()
}

#[test]
fn the_registry_thread_sleeps_while_the_process_is_idle() {
    if !alone("the_registry_thread_sleeps_while_the_process_is_idle", true) {
        return;
    }
    setup();
    const CONNS: usize = 4;
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut pairs: Vec<_> = (0..CONNS).map(|i| pair(&l, addr, i)).collect();
    let clients: Vec<SocketAddr> = pairs.iter().map(|(c, _)| c.local_addr().unwrap()).collect();
    // published, with the bytes of each
    published(|v| {
        clients
            .iter()
            .all(|a| socket(v, *a).is_some_and(|s| s["tx_bytes"] == 100 && s["rx_bytes"] == 100))
    });
    // a thread waits in a read meanwhile (the leader, asleep until data
    // comes: the registry's looks at the endpoint do not wake it)
    let mut waiting = pairs[3].1.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut b = [0u8; 10];
        waiting.read_exact(&mut b).unwrap();
        b
    });
    // what the handshakes and the data left to do is over (the registry's
    // looks for the traffic's counts included: one more follows the last
    // within a second)
    std::thread::sleep(Duration::from_millis(2000));
    let (before, process) = (switches_of("smc-registry"), voluntary_switches());
    std::thread::sleep(Duration::from_secs(2));
    let registry = switches_of("smc-registry") - before;
    let woken = voluntary_switches().1 - process.1;
    // Nothing changed: the registry thread sleeps (it waits for events and
    // traffic, no period).
    assert!(
        registry <= 2,
        "{registry} wake-ups of the registry thread in 2 s of an idle process"
    );
    assert!(
        woken < 10,
        "{woken} wake-ups in 2 s of an idle process with {CONNS} SMC-R connections and the registry"
    );
    pairs[3].0.write_all(&[3u8; 10]).unwrap();
    assert_eq!(reader.join().unwrap(), [3u8; 10]);
    // a new connection is published, and so are the bytes it moves
    let (mut c, mut s) = pair(&l, addr, CONNS);
    let new = c.local_addr().unwrap();
    published(|v| socket(v, new).is_some_and(|s| s["tx_bytes"] == 100));
    c.write_all(&[7u8; 1000]).unwrap();
    let mut b = [0u8; 1000];
    s.read_exact(&mut b).unwrap();
    let v = published(|v| socket(v, new).is_some_and(|s| s["tx_bytes"] == 1100));
    assert_eq!(socket(&v, new).unwrap()["rx_bytes"], 100);
    // traffic on an idle connection is published
    pairs[1].0.write_all(&[1u8; 10]).unwrap();
    let mut b = [0u8; 10];
    pairs[1].1.read_exact(&mut b).unwrap();
    published(|v| socket(v, clients[1]).is_some_and(|s| s["tx_bytes"] == 110));
    // while data flows, the thread looks about once a second, not per
    // message (two seconds of ping-pong on one connection)
    let before = switches_of("smc-registry");
    let (pc, ps) = &mut pairs[2];
    let end = Instant::now() + Duration::from_secs(2);
    let mut n = 0u64;
    while Instant::now() < end {
        pc.write_all(&[2u8; 64]).unwrap();
        let mut b = [0u8; 64];
        ps.read_exact(&mut b).unwrap();
        n += 64;
    }
    let registry = switches_of("smc-registry") - before;
    // (two looks, one a second, each a wait, the file's write and waits
    // for locks the ping-pong holds at that moment: a look walks every
    // connection and link, and takes a few hundred microseconds to a few
    // milliseconds, so that on this 2-core machine a look meets the
    // ping-pong's locks several times; looking per message would be
    // thousands)
    assert!(
        registry <= 24,
        "{registry} wake-ups of the registry thread in 2 s of traffic"
    );
    let a = clients[2];
    published(|v| socket(v, a).is_some_and(|s| s["tx_bytes"] == 100 + n));
    // a closed connection leaves the list
    drop((c, s));
    published(|v| socket(v, new).is_none());
    // and after all that, the thread sleeps again
    std::thread::sleep(Duration::from_millis(2500));
    let before = switches_of("smc-registry");
    std::thread::sleep(Duration::from_secs(2));
    let registry = switches_of("smc-registry") - before;
    assert!(
        registry <= 2,
        "{registry} wake-ups of the registry thread in 2 s of an idle process, after traffic"
    );
}
