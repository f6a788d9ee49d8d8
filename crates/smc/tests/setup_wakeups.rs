//! Short connections do not wake the progress threads (issue 15: a message
//! wakes only the thread that waits for it). A connection that is set up,
//! moves 64 B each way and closes leaves work for the engine's next pump at
//! several steps (its handshake's, its close's, its group's look after it
//! is freed): the thread whose call left it runs it before it lets the
//! endpoint go, instead of kicking the sleeping progress thread, and each
//! connection's orderly TCP end, which follows its close CDC, wakes no
//! watcher. Before, the client's progress thread woke about three times for
//! every connection when client and server shared a CPU. Client and server
//! are two processes, as with `setup_cost`, pinned to one CPU; the client
//! process's progress thread's context switches are counted. Alone in its
//! test binary. Root: the BPF rendezvous.

mod common;

use common::{first_cpu, pin, setup, spawn_self, switches_of};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::time::Instant;

const WARM: usize = 20;
const CONNS: usize = 300;

/// The server process's CPU (set in the server process only).
const SERVER_CPU: &str = "SMC_SETUP_WAKEUPS_CPU";

const TEST: &str = "short_connections_do_not_wake_the_progress_thread";

/// The server: says its port, answers each connection's 64 B, closes it.
fn serve(cpu: usize) {
    pin(cpu);
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    for _ in 0..WARM + CONNS {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 64];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    }
}

#[test]
fn short_connections_do_not_wake_the_progress_thread() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    if let Some(cpu) = std::env::var(SERVER_CPU).ok().and_then(|v| v.parse().ok()) {
        return serve(cpu);
    }
    let cpu = first_cpu();
    pin(cpu);
    setup();
    let (mut child, _out, port) = spawn_self(TEST, &[(SERVER_CPU, cpu.to_string().as_ref())]);
    let one = || {
        let mut s = SmcStream::connect(("127.0.0.1", port)).unwrap();
        assert_eq!(s.mode(), Mode::SmcR);
        let mut b = [7u8; 64];
        s.write_all(&b).unwrap();
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, [7u8; 64]);
    };
    for _ in 0..WARM {
        one();
    }
    let before = switches_of("smc-progress");
    let start = Instant::now();
    for _ in 0..CONNS {
        one();
    }
    let took = start.elapsed();
    let woke = switches_of("smc-progress") - before;
    assert!(child.wait().unwrap().success(), "the server process failed");
    // The progress thread also looks by itself as time passes (after its
    // lazy sleeps of 1 to 16 ms; 10 ms after connections closed, to free
    // them): allowed one wake-up per millisecond of the run, on top of one
    // per ten connections.
    let allowed = CONNS as u64 / 10 + took.as_millis() as u64;
    eprintln!("the progress thread woke {woke} times for {CONNS} connections in {took:?}");
    assert!(
        woke <= allowed,
        "the progress thread woke {woke} times for {CONNS} connections in {took:?} \
         (allowed {allowed})"
    );
}
