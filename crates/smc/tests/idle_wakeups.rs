//! An idle process costs no CPU (issue 15, docs/FAST-PATH.md step 2): with
//! SMC-R connections established over the shm device and nothing to do, no
//! thread of the process wakes up, as the engine reports when it next needs
//! to run (`Endpoint::poll_timeout`) and its drivers sleep until then or an
//! event, not on a period. Alone in its test binary: the whole process's
//! context switches are counted.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::time::Duration;

/// Voluntary context switches of the threads of this process so far (a
/// thread that sleeps and is woken makes one): of the shm device's thread,
/// and of all the others.
fn voluntary_switches() -> (u64, u64) {
    let (mut device, mut others) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let (Ok(status), Ok(comm)) = (
            std::fs::read_to_string(t.path().join("status")),
            std::fs::read_to_string(t.path().join("comm")),
        ) else {
            continue; // a thread that just ended
        };
        for line in status.lines() {
            if let Some(v) = line.strip_prefix("voluntary_ctxt_switches:") {
                let v = v.trim().parse::<u64>().unwrap();
                if comm.starts_with("shm-") {
                    device += v;
                } else {
                    others += v;
                }
            }
        }
    }
    (device, others)
}

#[test]
fn an_idle_process_with_established_connections_is_not_woken() {
    // The registry of the tools (smcss) publishes this process's sockets
    // on a period of its own; it is not the data path's to count.
    std::env::set_var("SMC_RS_REGISTRY", "0");
    setup();
    const CONNS: usize = 4;
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut pairs = Vec::new();
    for i in 0..CONNS {
        let mut c = SmcStream::connect(addr).unwrap();
        let (mut s, _) = l.accept().unwrap();
        assert_eq!(c.mode(), Mode::SmcR);
        assert_eq!(s.mode(), Mode::SmcR);
        // data both ways: the connections are in use, then idle
        c.write_all(&[i as u8; 100]).unwrap();
        let mut b = [0u8; 100];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        c.read_exact(&mut b).unwrap();
        assert_eq!(b, [i as u8; 100]);
        pairs.push((c, s));
    }
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
