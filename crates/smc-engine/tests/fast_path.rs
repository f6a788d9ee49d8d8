//! The connections' fast path (`FastConn`, docs/FAST-PATH.md step 4): a
//! writer thread writes through its connection's handle, without the
//! endpoint, falling back to the endpoint's write whenever the fast path
//! declines, while another thread drives the endpoints: a second link comes
//! up (direct writes stop: a failover could not replay them, §7.2), the
//! connection's link fails and it fails over to the other one (a new link
//! epoch), and the fast path starts again on the new link. Every byte
//! arrives once, in order. Reads through the handle race the same way,
//! with the consumer-cursor updates they post themselves. Spec:
//! `protocol-llc-cdc.md` §3.2, §3.4, §7.

use smc_engine::endpoint::{ConnStatus, EndpointConfig, EngineEvent, FastRead, FastWrite, LgrId};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod common;

use common::{simple_config, Tcp, World};

/// The shared test identity, with TEST_LINK keepalives on.
fn config(dev: &str, inst: u16, last: u8) -> EndpointConfig {
    EndpointConfig {
        testlink: Some(Duration::from_secs(30)),
        ..simple_config(dev, inst, last)
    }
}

fn byte(i: usize) -> u8 {
    ((i.wrapping_mul(2654435761) >> 11) as u8) ^ 0x3c
}

/// Brings up a further link between the groups of connection `t` (as
/// `multi_link.rs` does).
fn add_link(w: &mut World, t: &mut Tcp) -> (LgrId, LgrId) {
    let lc = w.client.link_group_of(t.c).unwrap();
    let ls = w.server.link_group_of(t.s).unwrap();
    let so = w.server.extra_link_offer(ls).unwrap();
    let co = w.client.extra_link_offer(lc).unwrap();
    w.client.extra_link_accept(lc, &so, w.now).unwrap();
    w.server.extra_link_accept(ls, &co, w.now).unwrap();
    w.settle(&mut [t], Duration::from_millis(1));
    assert_eq!(w.client.usable_links(lc), [0, 1]);
    assert_eq!(w.server.usable_links(ls), [0, 1]);
    (lc, ls)
}

fn locked(w: &Mutex<World>) -> MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// Phases of the run, as the driving thread sets them.
const ONE_LINK: usize = 0;
const TWO_LINKS: usize = 1;
const FAILED_OVER: usize = 2;

#[test]
fn fast_writes_racing_a_failover_are_replanned_never_lost_or_duplicated() {
    const TOTAL: usize = 600_000;
    let mut w = World::with_seed(7, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let mut t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    assert_eq!(w.client.link_of(t.c), Some(0));
    let h = w.client.fast_conn(t.c).unwrap();
    let (c, s) = (t.c, t.s);
    let w = Arc::new(Mutex::new(w));
    let phase = Arc::new(AtomicUsize::new(ONE_LINK));
    let fast = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    // bytes the reader got: the writer keeps a few messages ahead of it at
    // most, as request/response would
    let read = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (w, phase, fast, stop) = (w.clone(), phase.clone(), fast.clone(), stop.clone());
        let read = read.clone();
        std::thread::spawn(move || {
            let mut sent = 0;
            let mut chunk = Vec::new();
            while sent < TOTAL && !stop.load(Ordering::Acquire) {
                if sent > read.load(Ordering::Acquire) + 1024 {
                    std::thread::yield_now();
                    continue;
                }
                // small writes of varying length, as request/response makes them
                let len = (37 + sent % 211).min(TOTAL - sent);
                chunk.clear();
                chunk.extend((sent..sent + len).map(byte));
                let before = phase.load(Ordering::Acquire);
                match h
                    .try_write(&chunk)
                    .expect("a fast write fails only as the endpoint's")
                {
                    FastWrite::Wrote(n) => {
                        assert_eq!(n, len, "the fast path writes all or nothing");
                        fast[before].fetch_add(1, Ordering::AcqRel);
                        sent += n;
                    }
                    FastWrite::WroteLinkBroke(n) => {
                        sent += n;
                        let mut w = locked(&w);
                        let now = w.now;
                        w.client.pump(now).unwrap();
                    }
                    FastWrite::Declined => {
                        let n = locked(&w).client.write(c, &chunk).unwrap();
                        sent += n;
                        if n == 0 {
                            std::thread::yield_now();
                        }
                    }
                }
            }
            sent
        })
    };
    // The driving thread: pumps, reads and checks every byte, and changes
    // the links as the stream passes a third and a half of its length.
    let mut got = 0usize;
    let mut steps = 0;
    let mut lgrs = None;
    while got < TOTAL {
        let mut g = locked(&w);
        g.tick();
        let data = g.server.read(s, 1 << 16).unwrap();
        for (k, b) in data.iter().enumerate() {
            assert_eq!(*b, byte(got + k), "byte {} of the stream", got + k);
        }
        got += data.len();
        read.store(got, Ordering::Release);
        if got >= TOTAL / 3 && lgrs.is_none() {
            lgrs = Some(add_link(&mut g, &mut t));
            // (every pump since the second link came has run: no direct
            // write from here on until the group has one link again)
            phase.store(TWO_LINKS, Ordering::Release);
        }
        if let (Some((lc, _)), TWO_LINKS) = (lgrs, phase.load(Ordering::Acquire)) {
            if got >= TOTAL / 2 && g.client.link_of(c) == Some(0) {
                let qpn = g.client.link_qp_num(lc, 0).unwrap();
                g.fabric.fail_qp(qpn);
            }
            if g.client.link_of(c) == Some(1) && g.client.usable_links(lc) == [1] {
                phase.store(FAILED_OVER, Ordering::Release);
            }
        }
        drop(g);
        steps += 1;
        if steps > 2_000_000 {
            stop.store(true, Ordering::Release);
            panic!("stalled at {got} of {TOTAL} bytes");
        }
        std::thread::yield_now();
    }
    let sent = writer.join().unwrap();
    assert_eq!(sent, TOTAL);
    let mut g = locked(&w);
    for _ in 0..50 {
        g.tick();
    }
    assert!(
        g.server.read(s, 1 << 16).unwrap().is_empty(),
        "nothing beyond the stream"
    );
    assert!(g.client.violation(c).is_none() && g.server.violation(s).is_none());
    assert_eq!(g.client.link_of(c), Some(1), "failed over");
    let fast: Vec<usize> = fast.iter().map(|f| f.load(Ordering::Acquire)).collect();
    eprintln!("fast writes by phase: {fast:?}");
    assert!(
        fast[ONE_LINK] > 0,
        "fast writes on the first link: {fast:?}"
    );
    assert_eq!(
        fast[TWO_LINKS], 0,
        "no direct write while two links: {fast:?}"
    );
    assert!(
        fast[FAILED_OVER] > 0,
        "fast writes again on the new link: {fast:?}"
    );
}

/// The fast path never takes a link's last SEND: a driver asleep with the
/// send CQ unarmed would have to arm it for that completion
/// (`endpoint/arm.rs`), which only the endpoint does. It declines instead,
/// the endpoint's write takes over, and once completions come in the fast
/// path goes on; every byte arrives once, in order.
#[test]
fn the_fast_path_leaves_the_last_send_to_the_endpoint() {
    let mut w = World::with_seed(11, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    fast_writes_leave_the_last_send(&mut w, smc_engine::endpoint::MAX_SENDS);
}

/// A device that says its links may keep more SENDs in flight
/// (`DeviceInfo::max_sends`: the shm device, whose peers post receives for
/// them) gives the fast path that many, the last one still the endpoint's.
#[test]
fn a_device_that_allows_more_sends_in_flight_gives_the_fast_path_more() {
    let fabric = smc_rdma::sim::SimFabric::new(11);
    fabric.set_max_sends(Some(48));
    let mut w = World::with_fabric(
        fabric,
        config("simC", 0x1111, 1),
        config("simS", 0x2222, 2),
        true,
    );
    fast_writes_leave_the_last_send(&mut w, 48);
}

/// A write that finds every SEND of its link in flight (a writer ahead of
/// its peer) goes on into the peer's RMB through the connection's window,
/// not into the send buffer, and owes its CDC, which the next batch that a
/// completion lets out carries (`DataPath::write_corked`, Linux's
/// autocorking): the fast path's own (listed for the endpoint's flush,
/// `LinkTx::cork`, with no further write to carry it) and the endpoint's;
/// every byte arrives once, in order.
#[test]
fn writes_with_every_send_in_flight_go_into_the_peers_rmb_their_cdc_owed() {
    let mut w = World::with_seed(13, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    let (c, s) = (t.c, t.s);
    let mut sent = 0usize;
    let msg = |sent: &mut usize| -> Vec<u8> {
        let m: Vec<u8> = (*sent..*sent + 64).map(byte).collect();
        *sent += 64;
        m
    };
    // a direct write grants the fast path (and maps the peer's RMB)
    assert_eq!(w.client.write(c, &msg(&mut sent)), Ok(64));
    for _ in 0..20 {
        w.tick();
    }
    let h = w.client.fast_conn(c).unwrap();
    // Without a pump no send completes: the fast path takes all SENDs but
    // the last, the endpoint's write that one.
    let fill = |w: &mut World, sent: &mut usize| loop {
        let m = msg(sent);
        match h.try_write(&m).unwrap() {
            FastWrite::Wrote(64) => {}
            FastWrite::Declined => {
                assert_eq!(w.client.write(c, &m), Ok(64));
                break;
            }
            other => panic!("{other:?}"),
        }
    };
    let mut got = [Vec::new()];
    // the fast path's writes, then nothing more from the writer
    fill(&mut w, &mut sent);
    for _ in 0..5 {
        assert_eq!(h.try_write(&msg(&mut sent)), Ok(FastWrite::Wrote(64)));
    }
    assert_eq!(w.client.unsent(c), 0, "nothing waits in the send buffer");
    tick_read(&mut w, &[s], &mut got, 50);
    assert_stream(&got[0], sent, 0);
    // the endpoint's writes
    fill(&mut w, &mut sent);
    let before = w.client.corked_writes();
    for _ in 0..5 {
        assert_eq!(w.client.write(c, &msg(&mut sent)), Ok(64));
    }
    assert_eq!(
        w.client.corked_writes(),
        before + 5,
        "each went without its CDC"
    );
    assert_eq!(w.client.unsent(c), 0, "nothing waits in the send buffer");
    tick_read(&mut w, &[s], &mut got, 50);
    assert_stream(&got[0], sent, 0);
}

/// The body of the two tests above, on a link with `max_sends` SENDs.
fn fast_writes_leave_the_last_send(w: &mut World, max_sends: usize) {
    let t = w.handshake();
    let (c, s) = (t.c, t.s);
    let mut sent = 0usize;
    let msg = |sent: &mut usize| -> Vec<u8> {
        let m: Vec<u8> = (*sent..*sent + 64).map(byte).collect();
        *sent += 64;
        m
    };
    // the endpoint's own direct write grants the fast path (its CDC,
    // unsignaled, completed by the probe a count asks for)
    let m = msg(&mut sent);
    assert_eq!(w.client.write(c, &m), Ok(64));
    w.idle(&[c], Duration::from_micros(400));
    let h = w.client.fast_conn(c).unwrap();
    // without a pump no send completes: the fast path takes SENDs until one
    // is left
    let mut fast = 0;
    loop {
        let m = msg(&mut sent);
        match h.try_write(&m).unwrap() {
            FastWrite::Wrote(64) => fast += 1,
            FastWrite::Declined => {
                assert_eq!(w.client.write(c, &m), Ok(64), "the endpoint writes it");
                break;
            }
            other => panic!("{other:?}"),
        }
        assert!(fast < 2 * max_sends, "the fast path never stops");
    }
    // (the first message's SEND completed: all of the link's SENDs but
    // one go fast)
    assert_eq!(fast, max_sends - 1, "all SENDs but the last");
    let mut got = [Vec::new()];
    tick_read(w, &[s], &mut got, 50);
    // completions came in: the fast path goes on
    let m = msg(&mut sent);
    assert_eq!(h.try_write(&m), Ok(FastWrite::Wrote(64)));
    tick_read(w, &[s], &mut got, 50);
    assert_stream(&got[0], sent, 0);
}

/// The server takes what came (the client's endpoint is not pumped): its
/// CDCs' SENDs complete on the client's send CQ.
fn serve(w: &mut World, s: &[smc_engine::endpoint::ConnId], got: &mut [Vec<u8>]) {
    for _ in 0..50 {
        w.fabric.advance(Duration::from_micros(20));
        w.now += Duration::from_micros(20);
        let now = w.now;
        w.server.pump(now).unwrap();
        for (s, g) in s.iter().zip(got.iter_mut()) {
            g.extend(w.server.read(*s, 1 << 16).unwrap());
        }
    }
}

/// `n` ticks of both endpoints, the server reading what came after each.
fn tick_read(w: &mut World, s: &[smc_engine::endpoint::ConnId], got: &mut [Vec<u8>], n: usize) {
    for _ in 0..n {
        w.tick();
        for (s, g) in s.iter().zip(got.iter_mut()) {
            g.extend(w.server.read(*s, 1 << 16).unwrap());
        }
    }
}

/// 64 bytes of stream `k`, from byte `sent[k]` on.
fn next_msg(sent: &mut [usize], k: usize) -> Vec<u8> {
    let m: Vec<u8> = (sent[k]..sent[k] + 64).map(|i| byte(i + k * 7)).collect();
    sent[k] += 64;
    m
}

fn assert_stream(got: &[u8], sent: usize, k: usize) {
    assert_eq!(got.len(), sent, "stream {k}: every byte, once");
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, byte(i + k * 7), "stream {k}, byte {i}");
    }
}

/// A fast write that finds every SEND in flight takes the send completions
/// that have come in itself (`LinkTx::reap`), without a pump of the
/// endpoint's, applies its own connection's CDCs among them at once (the
/// bytes they carried no longer unacknowledged) and goes on; every byte
/// arrives once, in order.
#[test]
fn a_fast_write_takes_the_send_completions_that_came_when_every_send_is_in_flight() {
    let mut w = World::with_seed(12, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    let (c, s) = (t.c, t.s);
    let (mut sent, mut got) = (vec![0], vec![Vec::new()]);
    let m = next_msg(&mut sent, 0);
    assert_eq!(w.client.write(c, &m), Ok(64));
    for _ in 0..20 {
        w.tick();
        got[0].extend(w.server.read(s, 1 << 16).unwrap());
    }
    // (the first CDC, unsignaled, completed by the probe a count asks for)
    w.idle(&[c], Duration::from_micros(400));
    let h = w.client.fast_conn(c).unwrap();
    let max = smc_engine::endpoint::MAX_SENDS;
    // one CDC in this many has a completion of its own (selective signaling)
    let run = smc_engine::endpoint::signal_every(max);
    let mut fast = 0;
    let mut rounds = 0;
    // SENDs still in flight when a round began: the unsignaled CDCs after
    // the last signaled one, which no completion brought in
    let mut left = 0;
    // each round fills the link's SENDs, then the server takes them: the
    // next fast write reaps
    while rounds < 3 {
        let m = next_msg(&mut sent, 0);
        match h.try_write(&m).unwrap() {
            FastWrite::Wrote(64) => fast += 1,
            FastWrite::Declined => {
                assert_eq!(
                    fast + left,
                    max - 1,
                    "round {rounds}: declined after {fast} fast writes"
                );
                let unacked = w.client.unacked(c);
                assert_eq!(unacked, (fast + left) * 64, "round {rounds}");
                serve(&mut w, &[s], &mut got);
                assert_eq!(
                    h.try_write(&m),
                    Ok(FastWrite::Wrote(64)),
                    "round {rounds}: the completions that came were not taken"
                );
                // (the connection's own completions applied by the write:
                // only its unsignaled CDCs after the last signaled one wait,
                // and the new one)
                let unacked = w.client.unacked(c) / 64;
                assert!(
                    (1..=run).contains(&unacked),
                    "round {rounds}: {unacked} CDCs unconfirmed"
                );
                left = unacked - 1;
                fast = 1;
                rounds += 1;
            }
            other => panic!("{other:?}"),
        }
        assert!(fast < 3 * max, "never declines");
    }
    for _ in 0..50 {
        w.tick();
        got[0].extend(w.server.read(s, 1 << 16).unwrap());
    }
    // (what no completion confirmed yet, once a probe asked)
    w.idle(&[c], Duration::from_micros(400));
    assert_eq!(w.client.unacked(c), 0);
    assert_stream(&got[0], sent[0], 0);
}

/// Two connections of the client on one link, each granted its fast path
/// by a first direct write that the server read.
struct Two {
    c: [smc_engine::endpoint::ConnId; 2],
    s: [smc_engine::endpoint::ConnId; 2],
    sent: Vec<usize>,
    got: Vec<Vec<u8>>,
    h: [smc_engine::endpoint::FastConn<smc_rdma::sim::SimFabric>; 2],
}

fn two_granted(w: &mut World) -> Two {
    let a = w.handshake();
    let b = w.handshake();
    assert_eq!(w.client.link_group_of(a.c), w.client.link_group_of(b.c));
    assert_eq!(w.client.link_of(a.c), w.client.link_of(b.c));
    let (c, s) = ([a.c, b.c], [a.s, b.s]);
    let (mut sent, mut got) = (vec![0, 0], vec![Vec::new(), Vec::new()]);
    for (k, &ck) in c.iter().enumerate() {
        let m = next_msg(&mut sent, k);
        assert_eq!(w.client.write(ck, &m), Ok(64));
    }
    tick_read(w, &s, &mut got, 20);
    // (their CDCs, unsignaled, completed by the probe a count asks for)
    w.idle(&c, Duration::from_micros(400));
    let h = [
        w.client.fast_conn(c[0]).unwrap(),
        w.client.fast_conn(c[1]).unwrap(),
    ];
    Two { c, s, sent, got, h }
}

/// Two connections on one link, every SEND in flight holding A's CDCs: B's
/// fast path writes on without a CDC, and with none of B's own CDCs to
/// complete and no further write of B's, the completions of A's let B's
/// CDC out all the same (the endpoint's poll of the send CQ takes B from
/// the link's list, `LinkTx::cork`, and flushes it). Both streams arrive
/// whole.
#[test]
fn a_corked_fast_write_is_flushed_when_other_connections_sends_complete() {
    let mut w = World::with_seed(14, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let Two {
        c,
        s,
        mut sent,
        mut got,
        h,
    } = two_granted(&mut w);
    // A takes every SEND (the last one by the endpoint's write)
    loop {
        let m = next_msg(&mut sent, 0);
        match h[0].try_write(&m).unwrap() {
            FastWrite::Wrote(64) => {}
            FastWrite::Declined => {
                assert_eq!(w.client.write(c[0], &m), Ok(64));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    for _ in 0..5 {
        let m = next_msg(&mut sent, 1);
        assert_eq!(h[1].try_write(&m), Ok(FastWrite::Wrote(64)), "B corks");
    }
    assert_eq!(w.client.unsent(c[1]), 0);
    tick_read(&mut w, &s, &mut got, 50);
    assert_stream(&got[0], sent[0], 0);
    assert_stream(&got[1], sent[1], 1);
}

/// Two connections on one link: a fast write's reap leaves the other
/// connection's completions to the endpoint, and when that one's own fast
/// write reaps later, before the endpoint took them, it leaves its own too
/// (applying a later CDC's completion before an earlier one would confirm
/// the earlier twice): the endpoint's pump applies them all, in order. Both
/// streams arrive whole, neither connection is hurt.
#[test]
fn a_reap_leaves_other_connections_completions_to_the_endpoint_in_order() {
    let mut w = World::with_seed(13, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let Two {
        c,
        s,
        mut sent,
        mut got,
        h,
    } = two_granted(&mut w);
    // a fast write of stream `k`: whether it went (a declined one is not sent)
    let write = |sent: &mut Vec<usize>, k: usize| {
        let m = next_msg(sent, k);
        match h[k].try_write(&m).unwrap() {
            FastWrite::Wrote(64) => true,
            FastWrite::Declined => {
                sent[k] -= 64;
                false
            }
            other => panic!("{other:?}"),
        }
    };
    // B's writes, then A's until every SEND is in flight
    for _ in 0..10 {
        assert!(write(&mut sent, 1));
    }
    while write(&mut sent, 0) {}
    serve(&mut w, &s, &mut got);
    // A's write reaps: its own completions applied, B's left
    let b_unacked = w.client.unacked(c[1]);
    assert_eq!(b_unacked, 10 * 64);
    let a_unacked = w.client.unacked(c[0]);
    assert!(write(&mut sent, 0), "A's reap");
    // (A's CDCs up to the link's last signaled one; those after it wait)
    let run = smc_engine::endpoint::signal_every(smc_engine::endpoint::MAX_SENDS);
    assert!(
        (64..=run * 64).contains(&w.client.unacked(c[0])) && w.client.unacked(c[0]) < a_unacked,
        "A: {} unacked of {a_unacked}",
        w.client.unacked(c[0])
    );
    assert_eq!(
        w.client.unacked(c[1]),
        b_unacked,
        "B's completions are the endpoint's"
    );
    // B fills the SENDs, the server takes everything, B's write reaps: B's
    // earlier completions still wait for the endpoint, so its own new ones
    // wait too
    while write(&mut sent, 1) {}
    serve(&mut w, &s, &mut got);
    assert!(write(&mut sent, 1), "B's reap");
    assert!(
        w.client.unacked(c[1]) > b_unacked,
        "B's completions were applied before its older ones: {}",
        w.client.unacked(c[1])
    );
    // the endpoint applies them in order; nothing is violated
    let now = w.now;
    w.client.pump(now).unwrap();
    assert!(
        (64..=run * 64).contains(&w.client.unacked(c[1])),
        "B: only its last writes, after the last signaled CDC, unconfirmed: {}",
        w.client.unacked(c[1])
    );
    tick_read(&mut w, &s, &mut got, 50);
    w.idle(&c, Duration::from_micros(400));
    for (k, &ck) in c.iter().enumerate() {
        assert_eq!(w.client.status(ck), Some(ConnStatus::Smc), "stream {k}");
        assert_eq!(w.client.unacked(ck), 0, "stream {k}");
        assert_stream(&got[k], sent[k], k);
        let m = next_msg(&mut sent, k);
        assert_eq!(w.client.write(ck, &m), Ok(64), "stream {k} goes on");
    }
    tick_read(&mut w, &s, &mut got, 50);
    for k in 0..2 {
        assert_stream(&got[k], sent[k], k);
    }
}

/// The fast path's reads, racing the same way: a reader thread reads the
/// server's end through its handle (the endpoint's read, under the lock,
/// when the handle declines) while the driving thread writes the client's
/// end through the endpoint as fast as the server's RMB frees, pumps, and
/// changes the links. The stream needs the server's consumer-cursor
/// updates to go on (§3.4), and while the server holds a grant its reads
/// post them themselves; with two links none does (its link's send side
/// is closed to the fast path, §7.2), and a failover takes the grant away
/// until the server's next direct write on the new link. Every byte
/// arrives once, in order.
#[test]
fn fast_reads_racing_a_failover_post_their_cursor_updates_and_lose_nothing() {
    const TOTAL: usize = 3_000_000;
    let mut w = World::with_seed(13, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let mut t = w.handshake();
    assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc));
    let (c, s) = (t.c, t.s);
    let h = w.server.fast_conn(s).unwrap();
    // nothing to read: declined
    assert_eq!(h.try_read(&mut [0u8; 64]), FastRead::Declined);
    let w = Arc::new(Mutex::new(w));
    let phase = Arc::new(AtomicUsize::new(ONE_LINK));
    // per phase: reads of the fast path, and those that posted a CDC
    let reads = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let cdcs = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    let got = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (w, phase, stop, got) = (w.clone(), phase.clone(), stop.clone(), got.clone());
        let (reads, cdcs) = (reads.clone(), cdcs.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 14];
            let mut at = 0usize;
            let mut round = 0usize;
            while at < TOTAL && !stop.load(Ordering::Acquire) {
                // reads of varying size: small ones leave the update to
                // a later read, large ones make it due
                let max = [64, 700, 3000, 9000, 1 << 14][round % 5];
                round += 1;
                let before = phase.load(Ordering::Acquire);
                let n = match h.try_read(&mut buf[..max]) {
                    FastRead::Read { n, cdc } => {
                        reads[before].fetch_add(1, Ordering::AcqRel);
                        cdcs[before].fetch_add(usize::from(cdc), Ordering::AcqRel);
                        n
                    }
                    FastRead::ReadLinkBroke(n) => {
                        let mut w = locked(&w);
                        let now = w.now;
                        w.server.pump(now).unwrap();
                        n
                    }
                    FastRead::Declined => locked(&w).server.read_into(s, &mut buf[..max]).unwrap(),
                };
                for (k, b) in buf[..n].iter().enumerate() {
                    assert_eq!(*b, byte(at + k), "byte {} of the stream", at + k);
                }
                at += n;
                got.store(at, Ordering::Release);
                if n == 0 {
                    std::thread::yield_now();
                }
            }
            at
        })
    };
    // The driving thread: writes, pumps, and changes the links as the
    // stream passes a third and a half of its length; the server writes a
    // byte now and then (directly, which grants the fast path where the
    // group has one link), never while the group has two links.
    let mut sent = 0usize;
    let (mut back, mut back_got) = (0usize, 0usize);
    let mut steps = 0;
    let mut lgrs = None;
    let mut chunk = Vec::new();
    // CDCs the reader's own receive dispatch applied, as the server's pumps
    // counted them, when the second link came and when the first was gone
    let (mut dispatched_two, mut dispatched_failed_over) = (None, None);
    while got.load(Ordering::Acquire) < TOTAL {
        let mut g = locked(&w);
        g.tick();
        if sent < TOTAL {
            let len = (TOTAL - sent).min(1 << 14);
            chunk.clear();
            chunk.extend((sent..sent + len).map(byte));
            sent += g.client.write(c, &chunk).unwrap();
        }
        let ph = phase.load(Ordering::Acquire);
        if ph != TWO_LINKS && steps % 64 == 0 {
            back += g.server.write(s, &[byte(back)]).unwrap();
        }
        for b in g.client.read(c, 1 << 16).unwrap() {
            assert_eq!(b, byte(back_got), "reply byte {back_got}");
            back_got += 1;
        }
        let now_got = got.load(Ordering::Acquire);
        if now_got >= TOTAL / 3 && lgrs.is_none() {
            lgrs = Some(add_link(&mut g, &mut t));
            dispatched_two = Some(g.server.cdc_dispatched());
            phase.store(TWO_LINKS, Ordering::Release);
        }
        if let (Some((lc, ls)), TWO_LINKS) = (lgrs, ph) {
            if now_got >= TOTAL / 2 && g.server.link_of(s) == Some(0) {
                let qpn = g.server.link_qp_num(ls, 0).unwrap();
                g.fabric.fail_qp(qpn);
            }
            if g.server.link_of(s) == Some(1)
                && g.server.usable_links(ls) == [1]
                && g.client.usable_links(lc) == [1]
            {
                if dispatched_failed_over.is_none() {
                    dispatched_failed_over = Some(g.server.cdc_dispatched());
                }
                phase.store(FAILED_OVER, Ordering::Release);
            }
        }
        drop(g);
        steps += 1;
        if steps > 4_000_000 {
            stop.store(true, Ordering::Release);
            panic!(
                "stalled at {} of {TOTAL} bytes",
                got.load(Ordering::Acquire)
            );
        }
        std::thread::yield_now();
    }
    assert_eq!(reader.join().unwrap(), TOTAL);
    assert_eq!(sent, TOTAL);
    let mut g = locked(&w);
    for _ in 0..50 {
        g.tick();
    }
    assert!(
        g.server.read(s, 1 << 16).unwrap().is_empty(),
        "nothing beyond the stream"
    );
    assert!(g.client.violation(c).is_none() && g.server.violation(s).is_none());
    assert_eq!(g.server.link_of(s), Some(1), "failed over");
    assert_eq!(
        g.client.read(c, 1 << 16).unwrap().len() + back_got,
        back,
        "every reply byte"
    );
    let reads: Vec<usize> = reads.iter().map(|f| f.load(Ordering::Acquire)).collect();
    let cdcs: Vec<usize> = cdcs.iter().map(|f| f.load(Ordering::Acquire)).collect();
    eprintln!("fast reads by phase: {reads:?}, of which posted a CDC: {cdcs:?}");
    // (with two links most reads make an update due, which they leave to
    // the endpoint: few or none go fast then)
    assert!(
        reads[ONE_LINK] > 0 && reads[FAILED_OVER] > 0,
        "fast reads on either link alone: {reads:?}"
    );
    assert!(
        cdcs[ONE_LINK] > 0,
        "fast cursor updates on the first link: {cdcs:?}"
    );
    assert_eq!(cdcs[TWO_LINKS], 0, "no fast CDC while two links: {cdcs:?}");
    assert!(
        cdcs[FAILED_OVER] > 0,
        "fast cursor updates again on the new link: {cdcs:?}"
    );
    // a reader that found nothing took CDCs from the receive CQ itself,
    // racing the driving thread's pumps
    // (and none while the group had two links: a connection's CDCs may
    // come on either, §7.2)
    let dispatched = [
        dispatched_two.unwrap(),
        dispatched_failed_over.unwrap(),
        g.server.cdc_dispatched(),
    ];
    eprintln!("CDCs the reader's dispatch applied, by phase end: {dispatched:?}");
    assert!(dispatched[0] > 0, "receive dispatch on the first link");
    assert_eq!(
        dispatched[1], dispatched[0],
        "no receive dispatch while two links"
    );
    assert!(
        dispatched[2] > dispatched[1],
        "receive dispatch again on the new link"
    );
}

/// Delivers what the client posted into the server's receive CQ, without a
/// pump of the server's.
fn deliver_to_server(w: &mut World) {
    let now = w.now;
    w.client.pump(now).unwrap();
    w.fabric.advance(Duration::from_micros(20));
    w.now += Duration::from_micros(20);
}

/// A server connection whose reads may poll its link themselves: a read
/// through the endpoint gives it that grant (`FastRx`), a connection that
/// never writes as well.
fn granted(w: &mut World, t: &Tcp) {
    for _ in 0..5 {
        w.tick();
    }
    assert!(w.server.read(t.s, 16).unwrap().is_empty());
}

/// A reader that finds nothing takes its CDC from its link's receive CQ
/// itself, without the endpoint (`cdc_recv::dispatch`), and reads at once;
/// the endpoint's statistics count it at once, its next pump takes what it
/// applied and finds nothing more.
#[test]
fn a_reader_that_finds_nothing_takes_its_cdc_from_the_receive_cq_itself() {
    let mut w = World::with_seed(17, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    granted(&mut w, &t);
    let h = w.server.fast_conn(t.s).unwrap();
    let mut buf = [0u8; 256];
    assert_eq!(h.try_read(&mut buf), FastRead::Declined, "nothing sent yet");
    let received = w.server.msg_counts().cdc_received;
    for round in 0..3u8 {
        let msg = [round; 64];
        assert_eq!(w.client.write(t.c, &msg).unwrap(), 64);
        deliver_to_server(&mut w);
        match h.try_read(&mut buf) {
            FastRead::Read { n, .. } => assert_eq!(&buf[..n], &msg[..], "round {round}"),
            other => panic!("round {round}: the CDC in the receive CQ was not taken: {other:?}"),
        }
        // (the statistics count it before the endpoint's next poll of the
        // link: a driver may sleep for seconds before that)
        assert_eq!(
            w.server.msg_counts().cdc_received,
            received + u64::from(round) + 1,
            "round {round}"
        );
    }
    // (taken into the endpoint's own count by its next poll of the link)
    let now = w.now;
    w.server.pump(now).unwrap();
    assert_eq!(w.server.cdc_dispatched(), 3);
    assert_eq!(w.server.msg_counts().cdc_received, received + 3);
    assert!(w.server.read(t.s, 1 << 10).unwrap().is_empty());
    assert!(w.server.violation(t.s).is_none());
}

/// A writer whose held doorbell a CDC took (`FastConn::take_held_cdc`)
/// takes that CDC off the receive CQ itself even when its connection has
/// bytes to read already (applied by an earlier dispatch): the CDC that
/// took the doorbell may be behind them, and nobody was signalled for it.
#[test]
fn a_held_cdc_is_taken_even_when_the_connection_has_bytes_to_read() {
    let mut w = World::with_seed(23, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    granted(&mut w, &t);
    let h = w.server.fast_conn(t.s).unwrap();
    assert_eq!(w.client.write(t.c, &[1u8; 64]).unwrap(), 64);
    deliver_to_server(&mut w);
    assert!(h.take_held_cdc(), "nothing to read yet: dispatched");
    assert_eq!(h.level().readable, 64);
    // a second CDC comes while the first one's bytes are unread
    assert_eq!(w.client.write(t.c, &[2u8; 64]).unwrap(), 64);
    deliver_to_server(&mut w);
    assert!(
        h.take_held_cdc(),
        "the CDC behind unread bytes was not taken"
    );
    assert_eq!(h.level().readable, 128, "applied without a pump");
    let got = w.server.read(t.s, 1 << 10).unwrap();
    assert_eq!(got.len(), 128);
    assert!(got[..64].iter().all(|&b| b == 1) && got[64..].iter().all(|&b| b == 2));
    assert!(w.server.violation(t.s).is_none());
}

/// An established connection may take its CDCs itself from its first read
/// (granted when the handshake ends, not after a read through the
/// endpoint): the one read of a short connection, a request, needs no
/// endpoint, and a blocking reader may sleep on its doorbell for it.
#[test]
fn a_fresh_connection_reads_its_first_cdc_itself() {
    let mut w = World::with_seed(19, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    let h = w.server.fast_conn(t.s).unwrap();
    assert_eq!(
        h.may_sleep(),
        smc_engine::endpoint::MaySleep::Sleep,
        "no grant before a read through the endpoint"
    );
    let mut buf = [0u8; 256];
    assert_eq!(w.client.write(t.c, b"request").unwrap(), 7);
    deliver_to_server(&mut w);
    match h.try_read(&mut buf) {
        FastRead::Read { n, .. } => assert_eq!(&buf[..n], b"request"),
        other => panic!("the first CDC was left to the endpoint: {other:?}"),
    }
}

/// Data that came with (or just before) the peer's close is read by the
/// fast path too; the end of file after it is the endpoint's to tell.
#[test]
fn data_before_the_peers_close_is_read_without_the_endpoint() {
    let mut w = World::with_seed(23, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let mut t = w.handshake();
    let h = w.client.fast_conn(t.c).unwrap();
    assert_eq!(w.server.write(t.s, b"response").unwrap(), 8);
    w.server.release(t.s);
    w.settle(&mut [&mut t], Duration::from_millis(20));
    assert!(w.client.peer_closed(t.c), "the close CDC came");
    let mut buf = [0u8; 256];
    match h.try_read(&mut buf) {
        FastRead::Read { n, .. } => assert_eq!(&buf[..n], b"response"),
        other => panic!("data before the close was left to the endpoint: {other:?}"),
    }
    assert_eq!(
        h.try_read(&mut buf),
        FastRead::Declined,
        "EOF: the endpoint's"
    );
    assert!(w.client.peer_done(t.c));
    assert_eq!(w.client.read(t.c, 16).unwrap(), Vec::<u8>::new());
}

/// A connection's watch (`FastConn::watch`) is told of a CDC for it that
/// another connection's reader takes from the link's receive CQ (no pump
/// of the endpoint between), and of its own fast read that empties it: a
/// readiness descriptor set by it shows the data as soon as any thread
/// finds it.
#[test]
fn a_watch_is_told_by_whichever_reader_applies_the_cdc() {
    use smc_engine::endpoint::ConnLevel;
    let mut w = World::with_seed(23, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    let mut t2 = w.open();
    w.settle(&mut [&mut t2], Duration::from_millis(2));
    assert_eq!(w.server.link_group_of(t.s), w.server.link_group_of(t2.s));
    granted(&mut w, &t);
    let told: Arc<Mutex<Vec<ConnLevel>>> = Arc::default();
    let h2 = w.server.fast_conn(t2.s).unwrap();
    let log = told.clone();
    h2.watch(Some(Arc::new(move |l: &ConnLevel| {
        log.lock().unwrap().push(*l)
    })));
    assert_eq!(told.lock().unwrap().len(), 1, "told the level at once");
    assert_eq!(told.lock().unwrap()[0].readable, 0);
    assert_eq!(w.client.write(t2.c, &[9; 64]).unwrap(), 64);
    deliver_to_server(&mut w);
    let h = w.server.fast_conn(t.s).unwrap();
    let mut buf = [0u8; 256];
    assert_eq!(
        h.try_read(&mut buf),
        FastRead::Declined,
        "nothing for the first"
    );
    assert_eq!(
        told.lock().unwrap().last().map(|l| l.readable),
        Some(64),
        "the second's watch told by the first's dispatch"
    );
    assert!(matches!(
        h2.try_read(&mut buf),
        FastRead::Read { n: 64, .. }
    ));
    assert_eq!(told.lock().unwrap().last().map(|l| l.readable), Some(0));
    h2.watch(None);
    let n = told.lock().unwrap().len();
    assert_eq!(w.client.write(t2.c, &[8; 64]).unwrap(), 64);
    deliver_to_server(&mut w);
    let _ = h.try_read(&mut buf);
    assert_eq!(told.lock().unwrap().len(), n, "no watch, nobody told");
}

/// What a dispatch without the endpoint leaves for the endpoint (here: a
/// peer's abort of another connection, which the endpoint must report)
/// keeps the link's order: a CDC behind it waits for the endpoint's poll
/// too, which then takes both in the order they came.
#[test]
fn a_cdc_behind_what_the_dispatch_left_waits_for_the_endpoint() {
    let mut w = World::with_seed(19, config("simC", 0x1111, 1), config("simS", 0x2222, 2));
    let t = w.handshake();
    let mut t2 = w.open();
    w.settle(&mut [&mut t2], Duration::from_millis(2));
    assert_eq!(w.server.status(t2.s), Some(ConnStatus::Smc));
    assert_eq!(w.server.link_group_of(t.s), w.server.link_group_of(t2.s));
    granted(&mut w, &t);
    let h = w.server.fast_conn(t.s).unwrap();
    // the client aborts the second connection (unread data), then writes
    // on the first: two CDCs in the server's receive CQ, in that order
    assert_eq!(w.server.write(t2.s, &[1]).unwrap(), 1);
    for _ in 0..5 {
        w.tick();
    }
    w.client.close(
        t2.c,
        smc_proto::close::CloseEvent::AppClose { unread_data: true },
    );
    // (the abort CDC goes out at the client's pump, before the write's)
    let now = w.now;
    w.client.pump(now).unwrap();
    assert_eq!(w.client.write(t.c, &[7; 64]).unwrap(), 64);
    deliver_to_server(&mut w);
    let mut buf = [0u8; 256];
    assert_eq!(
        h.try_read(&mut buf),
        FastRead::Declined,
        "the CDC behind the abort is the endpoint's to apply"
    );
    let now = w.now;
    w.server.pump(now).unwrap();
    assert_eq!(w.server.cdc_dispatched(), 1, "the abort's CDC");
    let s2 = t2.s;
    let aborted = std::iter::from_fn(|| w.server.poll_event())
        .any(|e| matches!(e, EngineEvent::ConnAborted { conn, .. } if conn == s2));
    assert!(
        aborted,
        "the endpoint reports the abort the dispatch applied"
    );
    assert_eq!(w.server.read(t.s, 1 << 10).unwrap(), [7; 64]);
}
