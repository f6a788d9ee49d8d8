//! A close while the send buffer still holds data for a peer that reads
//! slowly: everything `write` accepted must arrive. Linux's `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) ends a
//! close's wait when the peer makes no room; a peer that keeps reading gets
//! everything.

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
