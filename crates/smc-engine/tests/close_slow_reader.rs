//! A close or a shutdown while the send buffer still holds data for a peer
//! that reads slowly: everything `write` accepted must arrive. Linux's
//! `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) ends a close's wait when the peer
//! makes no room; a peer that keeps reading gets everything, and a shutdown
//! never gives up on it.

mod common;

use common::*;
use smc_proto::close::CloseEvent;
use std::time::Duration;

#[test]
fn a_close_waits_for_a_slow_reader_as_long_as_it_reads() {
    let mut w = World::new(
        simple_config("simC", 0x1111, 1),
        simple_config("simS", 0x2222, 2),
    );
    let mut t = w.handshake();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut sent = 0;
    for _ in 0..200 {
        sent += w.client.write(t.c, &data[sent..]).unwrap();
        w.step(&mut [&mut t]);
    }
    // the peer's RMB and our send buffer are full
    assert!(sent > 0 && sent < data.len(), "{sent}");
    w.client
        .close(t.c, CloseEvent::AppClose { unread_data: false });
    let start = w.now;
    let mut got = Vec::new();
    // 512 bytes every 50 ms: far slower than the 2 s wait allows for `sent`
    while w.now < start + Duration::from_secs(60) {
        got.extend(w.server.read(t.s, 512).unwrap());
        if got.len() >= sent && w.server.peer_done(t.s) {
            break;
        }
        w.client.pump(w.now).unwrap();
        w.server.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(50));
        w.now += Duration::from_millis(50);
    }
    assert!(
        w.now - start > Duration::from_secs(3),
        "the reader took longer than the 2 s wait"
    );
    assert_eq!(got.len(), sent, "every byte write() accepted arrives");
    assert_eq!(&got[..], &data[..sent]);
    assert!(w.server.peer_done(t.s), "then the close");
}

/// `shutdown(SHUT_WR)` with data still in the send buffer, and a reader that
/// takes a pause longer than the 2 s close wait (a process not scheduled
/// for a while on a loaded machine, or a failover that takes its time)
/// before it reads on: the connection lives on (the application may still
/// read), so, as with TCP, every byte `write` accepted arrives before the
/// end of file. Only a `close()` gives up on unsent data.
#[test]
fn a_shutdown_keeps_unsent_data_for_a_reader_that_pauses() {
    let mut w = World::new(
        simple_config("simC", 0x1111, 1),
        simple_config("simS", 0x2222, 2),
    );
    let mut t = w.handshake();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut sent = 0;
    for _ in 0..200 {
        sent += w.client.write(t.c, &data[sent..]).unwrap();
        w.step(&mut [&mut t]);
    }
    // the peer's RMB and our send buffer are full
    assert!(sent > 0 && sent < data.len(), "{sent}");
    w.client.close(t.c, CloseEvent::AppShutdownWrite);
    // the reader pauses for 5 s
    let start = w.now;
    while w.now < start + Duration::from_secs(5) {
        w.client.pump(w.now).unwrap();
        w.server.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(100));
        w.now += Duration::from_millis(100);
    }
    let mut got = Vec::new();
    while w.now < start + Duration::from_secs(60) {
        got.extend(w.server.read(t.s, 64 << 10).unwrap());
        if w.server.peer_done(t.s) && w.server.readable(t.s) == 0 {
            break;
        }
        w.client.pump(w.now).unwrap();
        w.server.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(1));
        w.now += Duration::from_millis(1);
    }
    assert!(w.server.peer_done(t.s), "the shutdown arrives");
    assert_eq!(got.len(), sent, "every byte write() accepted arrives");
    assert_eq!(&got[..], &data[..sent]);
}
