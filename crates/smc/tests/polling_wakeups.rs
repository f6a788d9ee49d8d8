//! A program that polls its non-blocking connections (no thread of it ever
//! sleeps in the library: it reads until `WouldBlock`, then yields) does not
//! have the progress thread woken for its messages (issue 15: one polling
//! thread per side). The poller takes each CDC off its link's receive CQ
//! itself; with that CQ armed, every CDC after an arm signalled the
//! completion channel, and the progress thread woke, found the CDC taken,
//! armed again and slept, taking the core from a poller each time. The
//! progress thread now leaves a
//! CQ that connections poll unarmed while nothing waits for a pump
//! (`Endpoint::arm_unpolled`) and looks by itself after a short sleep.
//! Both processes on one CPU (the case where each wake-up takes the core
//! from a poller); alone in its test binary: the process's threads are
//! counted.

mod common;

use common::{first_cpu, pin, pinned_client_of_self, setup};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{ErrorKind, Read, Write};

const WARM: usize = 2000;
const ROUNDS: usize = 20000;

/// Moves `m` through `s` without blocking: writes it whole, then reads a
/// whole answer into it, yielding the CPU whenever nothing moved.
fn exchange(s: &mut SmcStream, out: &[u8; 64], back: &mut [u8; 64]) {
    write_polling(s, out);
    read_polling(s, back);
}

fn write_polling(s: &mut SmcStream, m: &[u8; 64]) {
    let mut at = 0;
    while at < m.len() {
        match s.write(&m[at..]) {
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => panic!("write: {e}"),
        }
    }
}

fn read_polling(s: &mut SmcStream, m: &mut [u8; 64]) {
    let mut at = 0;
    while at < m.len() {
        match s.read(&mut m[at..]) {
            Ok(0) => panic!("end of file"),
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// The other process, on the same CPU, polling too: answers each 64 B
/// message with its complement.
fn server(cpu: usize) {
    pin(cpu);
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), Mode::SmcR);
    s.set_nonblocking(true).unwrap();
    let mut m = [0u8; 64];
    for i in 0..WARM + ROUNDS {
        read_polling(&mut s, &mut m);
        assert_eq!(m, [i as u8; 64]);
        write_polling(&mut s, &[!(i as u8); 64]);
    }
    // (until the client is done counting)
    s.set_nonblocking(false).unwrap();
    let _ = s.read(&mut m);
}

#[test]
fn a_polling_ping_pong_does_not_wake_the_progress_thread_per_message() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    if let Some(cpu) = std::env::var("SMC_POLL_CPU")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        setup();
        return server(cpu);
    }
    let cpu = first_cpu();
    let (mut child, _out, mut c) = pinned_client_of_self(
        cpu,
        "a_polling_ping_pong_does_not_wake_the_progress_thread_per_message",
        &[("SMC_POLL_CPU", cpu.to_string().as_ref())],
    );
    c.set_nonblocking(true).unwrap();
    let mut before = 0;
    let mut m = [0u8; 64];
    let mut t0 = std::time::Instant::now();
    for i in 0..WARM + ROUNDS {
        if i == WARM {
            before = common::switches_of("smc-progress");
            t0 = std::time::Instant::now();
        }
        exchange(&mut c, &[i as u8; 64], &mut m);
        assert_eq!(m, [!(i as u8); 64]);
    }
    let took = t0.elapsed();
    let woken = common::switches_of("smc-progress") - before;
    eprintln!("progress thread woken {woken} times for {ROUNDS} answers in {took:?}");
    c.set_nonblocking(false).unwrap();
    drop(c);
    assert!(child.wait().unwrap().success(), "the server process failed");
    // The progress thread still looks by itself, at most once a
    // millisecond (`LAZY_MIN`): room for that over the run's time, and
    // for what the engine does on its own.
    let looks = took.as_millis() as u64 + 1;
    assert!(
        woken <= (ROUNDS as u64 / 20).max(2 * looks),
        "the progress thread woke {woken} times for {ROUNDS} answers of a polling ping-pong \
         in {took:?}"
    );
}
