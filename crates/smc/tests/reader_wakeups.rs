//! A blocking reader that sleeps is woken once per message, by the message
//! (issue 15, docs/FAST-PATH.md steps 5 and 6): on the shm device the
//! peer's CDC rings the reader's own doorbell, and no other thread of the
//! process wakes for it. Without that, a thread that waits for another
//! connection sleeps as the leader on the endpoint's completion channel,
//! is woken by every message, and wakes the reader: two wake-ups per
//! message (`SMC_BELL=0` shows it). Alone in its test binary: the
//! process's threads are counted.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::Duration;

/// Voluntary context switches (a thread that sleeps and is woken makes
/// one) of this process's threads but the calling one and the shm
/// device's (which ticks on a period of its own).
fn others_switches() -> u64 {
    others_by_thread().iter().map(|x| x.1).sum()
}

/// [`others_switches`] by thread name.
fn others_by_thread() -> Vec<(String, u64)> {
    common::voluntary_switches_by_thread(true)
        .into_iter()
        .filter(|(name, _)| !name.starts_with("shm-"))
        .collect()
}

#[test]
fn a_sleeping_reader_is_woken_once_per_message() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut idle_c = SmcStream::connect(addr).unwrap();
    let (mut idle_s, _) = l.accept().unwrap();
    let mut busy_c = SmcStream::connect(addr).unwrap();
    let (mut busy_s, _) = l.accept().unwrap();
    for s in [&idle_c, &idle_s, &busy_c, &busy_s] {
        assert_eq!(s.mode(), Mode::SmcR);
    }
    // A thread waits for a connection that stays quiet (it sleeps first:
    // through the endpoint it would be the one that leads the sleepers)...
    let idle = std::thread::Builder::new()
        .name("idle-reader".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            idle_s.read_exact(&mut b).unwrap();
            b[0]
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // ... and one reads the messages of the other, each of which comes
    // once it sleeps again.
    const WARM: usize = 20;
    const MSGS: usize = 300;
    let (ack, acks) = mpsc::channel::<()>();
    // (the reader stays until its wake-ups are counted: a thread that has
    // ended is not in the count, which would then shrink)
    let (counted, wait_counted) = mpsc::channel::<()>();
    let reader = std::thread::Builder::new()
        .name("busy-reader".into())
        .spawn(move || {
            let mut b = [0u8; 64];
            for i in 0..WARM + MSGS {
                busy_s.read_exact(&mut b).unwrap();
                assert_eq!(b, [i as u8; 64]);
                ack.send(()).unwrap();
            }
            let _ = wait_counted.recv();
            busy_s
        })
        .unwrap();
    let mut before = 0;
    for i in 0..WARM + MSGS {
        if i == WARM {
            before = others_switches();
        }
        // (long enough for the reader to be asleep, not spinning)
        std::thread::sleep(Duration::from_millis(2));
        busy_c.write_all(&[i as u8; 64]).unwrap();
        acks.recv().unwrap();
    }
    let woken = others_switches().saturating_sub(before);
    counted.send(()).unwrap();
    let mut busy_s = reader.join().unwrap();
    // One wake-up per message (the reader's), and a little room for the
    // rare ones of the engine (its progress thread, a lock met busy).
    assert!(
        woken <= (MSGS as u64) * 13 / 10,
        "{woken} wake-ups of the process's other threads for {MSGS} messages to a sleeping reader \
         (so far, by thread: {:?})",
        others_by_thread()
    );
    // both connections still work
    idle_c.write_all(&[7]).unwrap();
    assert_eq!(idle.join().unwrap(), 7);
    busy_c.write_all(&[1]).unwrap();
    let mut b = [0u8; 1];
    busy_s.read_exact(&mut b).unwrap();
    assert_eq!(b, [1]);
}
