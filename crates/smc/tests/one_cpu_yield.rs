//! A ping-pong between two processes that share one CPU: a blocking reader
//! whose answer has not come gives the CPU to the peer (`sched_yield`)
//! while it may spin, instead of sleeping on its doorbell, so that the
//! answer, made meanwhile, is found without a sleep and a wake-up. Before,
//! a thread pinned to one CPU spun with pause instructions, which held the
//! CPU its peer needed; every such spin ran out, spinning turned itself
//! off, and each message cost a futex sleep and wake-up on each side.
//! Alone in its test binary: the reading thread's context switches are
//! counted.

mod common;

use common::{answer_complements, first_cpu, pinned_client_of_self, setup};
use std::io::{Read, Write};

const WARM: usize = 2000;
const ROUNDS: usize = 20000;

/// Voluntary context switches of the calling thread so far (a sleep that
/// is woken makes one; a `sched_yield` that runs another thread does not).
fn my_sleeps() -> u64 {
    std::fs::read_to_string("/proc/thread-self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_reader_on_its_peers_cpu_yields_to_it_instead_of_sleeping() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    if let Some(cpu) = std::env::var("SMC_YIELD_CPU")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        setup();
        return answer_complements(cpu, WARM + ROUNDS);
    }
    let cpu = first_cpu();
    let (mut child, _out, mut c) = pinned_client_of_self(
        cpu,
        "a_reader_on_its_peers_cpu_yields_to_it_instead_of_sleeping",
        &[("SMC_YIELD_CPU", cpu.to_string().as_ref())],
    );
    let mut before = 0;
    let mut m = [0u8; 64];
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = my_sleeps();
        }
        c.write_all(&[i as u8; 64]).unwrap();
        c.read_exact(&mut m).unwrap();
        assert_eq!(m, [!(i as u8); 64], "answer {i}");
    }
    let slept = my_sleeps() - before;
    eprintln!("the reader slept {slept} times for {ROUNDS} answers");
    drop(c);
    assert!(child.wait().unwrap().success(), "the server process failed");
    // Room for waits that ran out of their spin (the host took the CPU
    // away, a probe while spinning was off).
    assert!(
        slept <= ROUNDS as u64 / 10,
        "the reader slept {slept} times for {ROUNDS} answers from a peer on its CPU"
    );
}
