//! A close or a shutdown while the send buffer still holds data for a peer
//! that reads slowly or pauses: everything `write` accepted must arrive.
//! Only a peer that takes nothing for 30 s after a close ends the wait, with
//! an abort (never an end of file after a shortened stream); a shutdown
//! never gives up.

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

/// `close()` with data still in the send buffer, and a reader that pauses
/// for 5 s (longer than Linux's 2 s close wait) before it reads on: every
/// byte `write` accepted arrives, then the close.
#[test]
fn a_close_keeps_unsent_data_for_a_reader_that_pauses() {
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
    assert!(sent > 0 && sent < data.len(), "{sent}");
    w.client.release(t.c);
    let got = pause_then_read(&mut w, &t, Duration::from_secs(5));
    assert!(w.server.peer_closed(t.s), "the close arrives");
    assert_eq!(got.len(), sent, "every byte write() accepted arrives");
    assert_eq!(&got[..], &data[..sent]);
}

/// `close()` with data still in the send buffer and a peer that takes none
/// of it for longer than the engine waits: the peer's reader gets an error
/// (the connection is aborted), never an end of file after a shortened
/// stream.
#[test]
fn a_close_whose_data_cannot_go_ends_in_an_abort() {
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
    assert!(sent > 0 && sent < data.len(), "{sent}");
    w.client.release(t.c);
    // (what the peer's RMB holds: the rest never comes)
    let start = w.now;
    while w.now < start + Duration::from_secs(40) {
        w.client.pump(w.now).unwrap();
        w.server.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(100));
        w.now += Duration::from_millis(100);
    }
    let mut got = 0;
    let end = loop {
        match w.server.read(t.s, 64 << 10) {
            Ok(b) if b.is_empty() => break Ok(()),
            Ok(b) => got += b.len(),
            Err(e) => break Err(e),
        }
        w.tick();
    };
    assert!(got < sent, "{got} of {sent}: not everything could go");
    assert!(
        end.is_err(),
        "an error, not an end of file after {got} of {sent} bytes"
    );
}

/// The server's reader of `t` pauses for `d`, then reads until the end
/// of file (or 60 s).
fn pause_then_read(w: &mut World, t: &Tcp, d: Duration) -> Vec<u8> {
    let start = w.now;
    while w.now < start + d {
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
    got
}
