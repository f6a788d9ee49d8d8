//! A request/response ping-pong across two CPUs, where a blocking reader
//! spins for its answer, wakes the progress thread for few of its messages
//! (issue 15, docs/FAST-PATH.md step 6). A reader that spins has not armed
//! its doorbell yet: the answer's CDC found it unarmed and signalled the
//! completion channel, waking the progress thread for nearly every message
//! only for it to find the CDC taken by the reader already. The reader holds
//! its doorbell while it spins (`Bell::hold`), as a writer does through its
//! call. Alone in its test binary: the process's threads are counted.

mod common;

use common::{answer_complements, pinned_client_of_self, setup};
use std::io::{Read, Write};

/// The first two CPUs this process may use, if it may use two.
fn two_cpus() -> Option<(usize, usize)> {
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    let mut cpus = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c));
    Some((cpus.next()?, cpus.next()?))
}

const WARM: usize = 2000;
const ROUNDS: usize = 20000;

#[test]
fn a_ping_pong_across_two_cpus_rarely_wakes_the_progress_thread() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    if let Some(cpu) = std::env::var("SMC_SPIN_CPU")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        setup();
        return answer_complements(cpu, WARM + ROUNDS);
    }
    let Some((a, b)) = two_cpus() else {
        eprintln!("one CPU only: a spinning reader is a two-CPU case, not measured here");
        return;
    };
    let (mut child, _out, mut c) = pinned_client_of_self(
        a,
        "a_ping_pong_across_two_cpus_rarely_wakes_the_progress_thread",
        &[("SMC_SPIN_CPU", b.to_string().as_ref())],
    );
    let mut before = 0;
    let mut m = [0u8; 64];
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = common::switches_of("smc-progress");
        }
        c.write_all(&[i as u8; 64]).unwrap();
        c.read_exact(&mut m).unwrap();
        assert_eq!(m, [!(i as u8); 64]);
    }
    let woken = common::switches_of("smc-progress") - before;
    eprintln!("progress thread woken {woken} times for {ROUNDS} answers");
    drop(c);
    assert!(child.wait().unwrap().success(), "the server process failed");
    // Room for what the engine does on its own and for waits that spun
    // out and slept (a host that took a CPU away meanwhile).
    assert!(
        woken <= ROUNDS as u64 / 10,
        "the progress thread woke {woken} times for {ROUNDS} answers of a two-CPU ping-pong"
    );
}
