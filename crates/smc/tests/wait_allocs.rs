//! A reader that sleeps on its doorbell for every message, and the writer
//! whose messages wake it, allocate nothing per message (issue 15: a
//! message's cost is its copies and CDC, not the allocator's): the
//! reader's registration word is kept for its next wait
//! (`ctx/bell.rs`, `spare_woken`), the writer's list of held-back wake-ups
//! keeps its capacity (`shm/qp_progress.rs`, `wake_held`). Alone in its
//! test binary: it counts each thread's allocations through a global
//! allocator of its own.

mod common;

use common::{echoed_pair, setup};
use smc::Mode;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::Duration;

/// The system allocator, counting the allocations of each thread.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to `System` unchanged; the count is a
// thread-local `Cell` of a `const` initializer, which needs no allocation
// (and `try_with` tolerates a thread whose locals are gone).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

#[test]
fn a_sleeping_reader_and_its_writer_allocate_nothing_per_message() {
    // (the tools' registry publishes on a period of its own)
    std::env::set_var("SMC_RS_REGISTRY", "0");
    setup();
    let (mut c, mut s, _l) = echoed_pair("127.0.0.1:0");
    assert_eq!(s.mode(), Mode::SmcR);
    const WARM: usize = 20;
    const MSGS: usize = 200;
    let (ack, acks) = mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let mut b = [0u8; 64];
        let mut before = 0;
        for i in 0..WARM + MSGS {
            if i == WARM {
                before = allocs();
            }
            s.read_exact(&mut b).unwrap();
            assert_eq!(b, [i as u8; 64]);
            ack.send(()).unwrap();
        }
        allocs() - before
    });
    let mut before = 0;
    for i in 0..WARM + MSGS {
        if i == WARM {
            before = allocs();
        }
        // (long enough for the reader to be asleep on its doorbell, not
        // spinning: this write's CDC rings it)
        std::thread::sleep(Duration::from_millis(2));
        c.write_all(&[i as u8; 64]).unwrap();
        acks.recv().unwrap();
    }
    let writer = allocs() - before;
    let reader = reader.join().unwrap();
    // (room for the rare allocation of the engine's own: a list that grows
    // once, a lock met busy that sends the wait through the endpoint)
    let most = MSGS as u64 / 10;
    assert!(
        reader <= most && writer <= most,
        "in {MSGS} messages the reader allocated {reader} times, the writer {writer} times"
    );
}
