//! The buffer events an endpoint counts for `smcr stats` (Linux's
//! smc_stats.h `SMC_STAT_RMB_*`): buffers registered and reused from a
//! link group's pool, an RMB downgraded to a smaller size class when the
//! wanted one cannot be registered, a write that found the send buffer full
//! (once per wait), writes larger than the send buffer or the peer's RMB.

use smc_engine::endpoint::{ConnStatus, EndpointConfig, RmbCrowding};
use smc_engine::state::BufCounts;
use std::time::Duration;

mod common;

use common::{simple_config, Tcp, World};

#[test]
fn buffers_registered_then_reused_from_the_pool() {
    let mut w = World::default();
    let mut ts: Vec<Tcp> = (0..2).map(|_| w.handshake()).collect();
    assert_eq!(
        w.client.buf_counts(),
        BufCounts {
            alloc: 4,
            ..BufCounts::default()
        }
    );
    for t in &ts {
        w.client.release(t.c);
        w.server.release(t.s);
    }
    let mut refs: Vec<&mut Tcp> = ts.iter_mut().collect();
    w.settle(&mut refs, Duration::from_millis(2));
    let t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    let b = w.client.buf_counts();
    assert_eq!((b.alloc, b.reuse, b.rmb_downgrade), (4, 2, 0), "{b:?}");
    assert_eq!(w.server.buf_counts().reuse, 2);
}

#[test]
fn connections_beyond_the_rmb_budget_get_the_crowded_rmb_until_others_go() {
    const BIG: usize = 64 * 1024;
    const SMALL: usize = 16 * 1024;
    let cfg = |dev: &str, inst: u16, last: u8| EndpointConfig {
        rmb_len: BIG,
        rmb_crowding: Some(RmbCrowding {
            budget: 2 * BIG,
            len: SMALL,
        }),
        ..simple_config(dev, inst, last)
    };
    let mut w = World::with_seed(5, cfg("simC", 0x1111, 1), cfg("simS", 0x2222, 2));
    let rmbs = |w: &World, t: &Tcp| {
        (
            w.client.conn_diag(t.c).map(|d| d.rmbe_len),
            w.server.conn_diag(t.s).map(|d| d.rmbe_len),
        )
    };
    // two large RMBs fill the budget on each side; the third gets the small one
    let mut ts: Vec<Tcp> = (0..3).map(|_| w.handshake()).collect();
    for t in &ts {
        assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    }
    assert_eq!(rmbs(&w, &ts[0]), (Some(BIG), Some(BIG)));
    assert_eq!(rmbs(&w, &ts[1]), (Some(BIG), Some(BIG)));
    assert_eq!(rmbs(&w, &ts[2]), (Some(SMALL), Some(SMALL)));
    // a size asked for is taken whatever the budget says
    let mut asked = w.open();
    w.client.set_buffer_sizes(asked.c, Some(BIG), None);
    w.settle(&mut [&mut asked], Duration::from_millis(2));
    assert_eq!(rmbs(&w, &asked).0, Some(BIG));
    // once the two first are gone their bytes no longer count
    let mut gone: Vec<Tcp> = ts.drain(..2).chain(std::iter::once(asked)).collect();
    for t in &gone {
        w.client.release(t.c);
        w.server.release(t.s);
    }
    let mut refs: Vec<&mut Tcp> = gone.iter_mut().chain(ts.iter_mut()).collect();
    w.settle(&mut refs, Duration::from_millis(2));
    let t = w.handshake();
    assert_eq!(rmbs(&w, &t), (Some(BIG), Some(BIG)));
}

#[test]
fn an_rmb_that_cannot_be_registered_is_downgraded_and_counted() {
    let cfg = |dev: &str, inst: u16, last: u8| EndpointConfig {
        rmb_len: 1024 * 1024,
        rmb_crowding: None,
        sndbuf_len: 16 * 1024,
        ..simple_config(dev, inst, last)
    };
    let mut w = World::with_seed(3, cfg("simC", 0x1111, 1), cfg("simS", 0x2222, 2));
    // (a link's receive ring is 384 KiB: it stays below this)
    w.fabric.set_max_mr_len(512 * 1024);
    let mut t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    assert_eq!(w.client.buf_counts().rmb_downgrade, 1);
    assert_eq!(w.server.buf_counts().rmb_downgrade, 1);
    assert_eq!(
        w.client.conn_diag(t.c).map(|d| d.rmbe_len),
        Some(512 * 1024)
    );
    // the smaller RMB is what the peer writes into: data flows
    let data = vec![7u8; 100_000];
    let mut sent = 0;
    let mut got = 0;
    let mut steps = 0;
    while got < data.len() {
        // (a stall fails here instead of hanging)
        assert!(steps < 100_000, "stalled at {got} of {} bytes", data.len());
        steps += 1;
        sent += w.client.write(t.c, &data[sent..]).unwrap();
        got += w.server.read(t.s, 70_000).unwrap().len();
        w.step(&mut [&mut t]);
    }
}

#[test]
fn a_full_send_buffer_is_counted_once_per_wait() {
    let mut w = World::default();
    let t = w.handshake();
    let sndbuf = 32 * 1024;
    // larger than the send buffer and the peer's RMB (16 KiB)
    let big = vec![1u8; sndbuf + 1];
    let n = w.client.write(t.c, &big).unwrap();
    assert!(n > 0);
    // without a pump nothing leaves the send buffer: the next writes wait
    let mut waits = 0;
    loop {
        let m = w.client.write(t.c, &big).unwrap();
        if m == 0 {
            waits += 1;
            if waits == 3 {
                break;
            }
        }
    }
    let b = w.client.buf_counts();
    assert_eq!(b.tx_full, 1, "one wait, however often retried: {b:?}");
    assert!(b.tx_too_small >= 1 && b.tx_peer_too_small >= 1, "{b:?}");
}

/// Sizes asked for one connection (a socket's `SO_RCVBUF`/`SO_SNDBUF`, as
/// Linux sizes an SMC socket's RMB and send buffer by them) are its own:
/// rounded up to a size class, announced to the peer, used by the data
/// path, pooled by size; the next connection without a request gets the
/// endpoint's sizes.
#[test]
fn buffer_sizes_asked_for_one_connection_are_its_own() {
    let mut w = World::default();
    let mut t = w.open();
    // (client: 100 KiB and 40 KiB; server: only an RMB of 20 KiB)
    w.client
        .set_buffer_sizes(t.c, Some(100 * 1024), Some(40 * 1024));
    w.server.set_buffer_sizes(t.s, Some(20 * 1024), None);
    w.settle(&mut [&mut t], Duration::from_millis(2));
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    let c = w.client.conn_diag(t.c).unwrap();
    let s = w.server.conn_diag(t.s).unwrap();
    assert_eq!(
        (c.rmbe_len, c.sndbuf_len, c.peer_rmbe_len),
        (128 * 1024, 64 * 1024, 32 * 1024)
    );
    let default = simple_config("x", 1, 1);
    assert_eq!(
        (s.rmbe_len, s.sndbuf_len, s.peer_rmbe_len),
        (32 * 1024, default.sndbuf_len, 128 * 1024)
    );
    // data flows through the sizes taken, beyond each of them
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (mut sent, mut got) = (0, Vec::new());
    let mut steps = 0;
    while got.len() < data.len() {
        assert!(
            steps < 100_000,
            "stalled at {} of {} bytes",
            got.len(),
            data.len()
        );
        steps += 1;
        if sent < data.len() {
            sent += w.client.write(t.c, &data[sent..]).unwrap();
        }
        got.extend(w.server.read(t.s, 50_000).unwrap());
        w.step(&mut [&mut t]);
    }
    assert!(got == data, "the bytes arrived changed");
    // a connection without a request: the endpoint's sizes
    let u = w.handshake();
    let d = w.client.conn_diag(u.c).unwrap();
    assert_eq!(
        (d.rmbe_len, d.sndbuf_len),
        (default.rmb_len, default.sndbuf_len)
    );
}
