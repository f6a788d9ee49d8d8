//! Selective signaling of CDC SENDs (`TxBook::post`, `signal_every`): a
//! link asks for the completion of one CDC in a run, an RC send queue's
//! completions confirming every work request before theirs, so that a
//! message does not cost a completion; the CDCs after the last signaled one
//! are confirmed when someone asks (`Endpoint::send_queue`'s probe, a
//! zero-length RDMA WRITE), and the CDCs whose completion something waits
//! for go signaled (`DataPath::wants_completion`: a close, send-buffer
//! space). Spec: `protocol-llc-cdc.md` §3.2 (a CDC's completion releases
//! its data's send-buffer space).

use smc_engine::endpoint::{signal_every, ConnStatus, MAX_SENDS};
use std::time::Duration;

mod common;

use common::World;

/// One message's bytes.
const MSG: usize = 64;

#[test]
fn one_cdc_in_a_run_is_signaled_and_a_probe_confirms_the_rest_when_asked() {
    let mut w = World::default();
    let mut t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    let run = signal_every(MAX_SENDS);
    assert!(run > 1, "a run of {run}");
    // a first message, confirmed (its CDC probed): the run starts afresh
    assert_eq!(w.client.write(t.c, &[1; MSG]).unwrap(), MSG);
    w.idle(&[t.c], Duration::from_millis(1));
    assert_eq!(w.client.unacked(t.c), 0);
    // two runs and a bit, each message read by the server, the client
    // pumped after each (its send completions taken)
    let n = 2 * run + 3;
    let mut got = w.server.read(t.s, 1 << 16).unwrap().len();
    for i in 0..n {
        assert_eq!(w.client.write(t.c, &[i as u8; MSG]).unwrap(), MSG);
        for _ in 0..5 {
            w.step(&mut [&mut t]);
            got += w.server.read(t.s, 1 << 16).unwrap().len();
        }
    }
    assert_eq!(got, (n + 1) * MSG, "every byte arrived");
    // the last signaled CDC confirmed those before it; the three after it
    // wait, with nothing to complete them
    assert_eq!(w.client.unacked(t.c), 3 * MSG, "the unsignaled tail");
    for _ in 0..50 {
        w.step(&mut [&mut t]);
    }
    assert_eq!(
        w.client.unacked(t.c),
        3 * MSG,
        "no completion comes by itself"
    );
    // asked, the count is as it was, and a probe goes behind them: asked
    // again, they are confirmed
    assert_eq!(w.client.send_queue(t.c), 3 * MSG);
    for _ in 0..5 {
        w.step(&mut [&mut t]);
    }
    assert_eq!(w.client.send_queue(t.c), 0, "confirmed by the probe");
    assert_eq!(
        w.client
            .conn_diag(t.c)
            .unwrap()
            .cursors
            .unwrap()
            .tx_fin
            .count as usize,
        (n + 1) * MSG
    );
}

/// A connection whose send buffer holds the bytes of its CDCs (a write
/// through the send buffer: above the device's inline limit) asks for every
/// completion, as the kernel's sender frees its buffer at each: the count
/// falls to zero with no one asking.
#[test]
fn cdcs_of_buffered_bytes_are_all_signaled() {
    let mut w = World::default();
    let mut t = w.handshake();
    // (the simulated device's inline limit is 256 bytes: these go through
    // the send buffer)
    let data = vec![0x77u8; 4000];
    let mut got = 0;
    for _ in 0..2 * signal_every(MAX_SENDS) {
        assert_eq!(w.client.write(t.c, &data).unwrap(), data.len());
        for _ in 0..5 {
            w.step(&mut [&mut t]);
            got += w.server.read(t.s, 1 << 16).unwrap().len();
        }
    }
    for _ in 0..20 {
        w.step(&mut [&mut t]);
        got += w.server.read(t.s, 1 << 16).unwrap().len();
    }
    assert_eq!(got, 2 * signal_every(MAX_SENDS) * data.len());
    assert_eq!(w.client.unacked(t.c), 0, "every CDC completed");
}

/// A close's CDC asks for its completion: the connection is freed without
/// anyone asking, though the CDCs before it went unsignaled.
#[test]
fn a_closed_connection_is_freed_though_its_data_cdcs_went_unsignaled() {
    let mut w = World::default();
    let mut t = w.handshake();
    for i in 0..3 {
        assert_eq!(w.client.write(t.c, &[i; MSG]).unwrap(), MSG);
        w.step(&mut [&mut t]);
    }
    let mut got = 0;
    for _ in 0..20 {
        w.step(&mut [&mut t]);
        got += w.server.read(t.s, 1 << 16).unwrap().len();
    }
    assert_eq!(got, 3 * MSG);
    assert!(w.client.unacked(t.c) > 0, "unsignaled CDCs wait");
    w.client.release(t.c);
    w.server.release(t.s);
    for _ in 0..2000 {
        w.step(&mut [&mut t]);
        if w.client.status(t.c).is_none() && w.server.status(t.s).is_none() {
            return;
        }
    }
    panic!(
        "not freed: client {:?} server {:?}",
        w.client.close_state(t.c),
        w.server.close_state(t.s)
    );
}
