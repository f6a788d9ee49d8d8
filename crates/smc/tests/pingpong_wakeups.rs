//! A request/response ping-pong on one CPU wakes nothing but its two
//! threads (issue 15, docs/FAST-PATH.md steps 5 and 6). On one CPU the
//! reader that a write wakes takes the CPU at once and answers while the
//! writer is still in its write call, not yet asleep on its doorbell; the
//! answer's CDC used to signal the completion channel then, waking the
//! progress thread for nearly every message. A writer holds its doorbell
//! through its call (`Bell::hold`) and takes such a CDC itself. Alone in
//! its test binary: the process's threads are counted, and all of them
//! run on one CPU.

mod common;

use common::{first_cpu, pin, setup};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};

#[test]
fn a_one_cpu_ping_pong_does_not_wake_the_progress_thread() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    // before the first connection: the engine's threads inherit it
    pin(first_cpu());
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut c = SmcStream::connect(addr).unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    assert_eq!(s.mode(), Mode::SmcR);
    const WARM: usize = 200;
    const ROUNDS: usize = 3000;
    let server = std::thread::Builder::new()
        .name("pong".into())
        .spawn(move || {
            let mut b = [0u8; 64];
            for i in 0..WARM + ROUNDS {
                s.read_exact(&mut b).unwrap();
                assert_eq!(b, [i as u8; 64]);
                s.write_all(&[!(i as u8); 64]).unwrap();
            }
            s
        })
        .unwrap();
    let mut before = 0;
    let mut b = [0u8; 64];
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = common::switches_of("smc-progress");
        }
        c.write_all(&[i as u8; 64]).unwrap();
        c.read_exact(&mut b).unwrap();
        assert_eq!(b, [!(i as u8); 64]);
    }
    let woken = common::switches_of("smc-progress") - before;
    let mut s = server.join().unwrap();
    // Some room for what the engine does on its own (a timer, a lock met
    // busy, a reply that came between a write call and the next read).
    assert!(
        woken <= (2 * ROUNDS as u64) / 20,
        "the progress thread woke {woken} times for {} messages of a one-CPU ping-pong",
        2 * ROUNDS
    );
    // the connection still works both ways
    s.write_all(&[9]).unwrap();
    c.read_exact(&mut b[..1]).unwrap();
    assert_eq!(b[0], 9);
}
