//! The engine pieces over the deterministic `sim` fabric: first-contact link
//! confirmation, data both ways with checksums, keepalive on virtual time, an
//! orderly close, and a QP failure that kills the connection.

use smc_engine::{peer_view, EndConfig, LinkEnd};
use smc_proto::close::{CloseEvent, CloseState};
use smc_proto::link::{DownReason, LgrConfig, LgrOutput, Role};
use smc_proto::Timestamp;
use smc_rdma::sim::SimFabric;
use smc_wire::llc::LlcVersion;
use std::time::Duration;

struct World {
    fabric: SimFabric,
    s: LinkEnd<SimFabric>,
    c: LinkEnd<SimFabric>,
    now: Timestamp,
}

fn cfg(role: Role, id: u32, testlink: Option<Duration>, rmb: usize) -> EndConfig {
    EndConfig {
        lgr: LgrConfig {
            id,
            role,
            version: LlcVersion::V2_LE,
            max_links: 2,
            max_conns: 255,
            testlink_interval: testlink,
        },
        sndbuf_len: 65536,
        rmb_len: rmb,
    }
}

impl World {
    fn new(seed: u64, testlink: Option<Duration>) -> World {
        let fabric = SimFabric::new(seed);
        fabric.add_device("simA", None).unwrap();
        fabric.add_device("simB", None).unwrap();
        fabric.set_latency(Duration::from_micros(5), Duration::from_micros(3));
        let mut s =
            LinkEnd::open(&fabric, "simA", cfg(Role::Server, 0x100, testlink, 65536)).unwrap();
        let mut c =
            LinkEnd::open(&fabric, "simB", cfg(Role::Client, 0x200, testlink, 16384)).unwrap();
        // What CLC Accept/Confirm would carry: QP, GID, PSN, MTU, RMB, alert tokens.
        let (ps, pc) = (peer_view(&s).unwrap(), peer_view(&c).unwrap());
        let (rs, rc) = (s.rmb(), c.rmb());
        c.connect(ps, rs, 1, Duration::ZERO).unwrap();
        s.connect(pc, rc, 2, Duration::ZERO).unwrap();
        let mut w = World {
            fabric,
            s,
            c,
            now: Duration::ZERO,
        };
        w.run(Duration::from_millis(5));
        assert!(
            w.s.is_active() && w.c.is_active(),
            "first-contact CONFIRM_LINK over sim"
        );
        w
    }

    fn step(&mut self, dt: Duration) {
        self.s.pump(self.now).unwrap();
        self.c.pump(self.now).unwrap();
        self.fabric.advance(dt);
        self.now += dt;
    }

    fn run(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.step(Duration::from_micros(10));
        }
    }
}

fn pattern(seed: u64, i: u64) -> u8 {
    ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

#[test]
fn data_both_ways_with_wraps_and_small_buffers() {
    let mut w = World::new(7, None);
    let total = 3 << 20; // 3 MiB each way through a 16 KiB and a 64 KiB RMB
    let (mut sent_s, mut sent_c, mut got_s, mut got_c) = (0u64, 0u64, Vec::new(), Vec::new());
    let mut rng = 12345u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut rounds = 0;
    while (got_s.len() as u64) < total || (got_c.len() as u64) < total {
        rounds += 1;
        assert!(
            rounds < 200_000,
            "transfer stalled: {} {}",
            got_s.len(),
            got_c.len()
        );
        for (end, sent, seed) in [(&mut w.s, &mut sent_s, 1u64), (&mut w.c, &mut sent_c, 2u64)] {
            let n = (next() % 70_000) as usize;
            let n = n.min((total - *sent) as usize);
            let data: Vec<u8> = (0..n as u64).map(|i| pattern(seed, *sent + i)).collect();
            *sent += end.write(&data).unwrap() as u64;
        }
        let r = (next() % 50_000) as usize;
        got_s.extend(w.s.read(r).unwrap());
        got_c.extend(w.c.read(r).unwrap());
        w.step(Duration::from_micros(10));
    }
    assert!(
        got_s
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern(2, i as u64)),
        "client->server corrupted"
    );
    assert!(
        got_c
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern(1, i as u64)),
        "server->client corrupted"
    );
    assert!(w.s.errors.is_empty() && w.c.errors.is_empty());
}

#[test]
fn keepalive_on_virtual_time_keeps_a_quiet_link_up() {
    let mut w = World::new(3, Some(Duration::from_secs(30)));
    // 95 virtual seconds of silence: TEST_LINKs go out and are answered
    for _ in 0..95 {
        w.run(Duration::from_millis(2));
        w.now += Duration::from_secs(1) - Duration::from_millis(2);
    }
    assert!(w.s.is_active() && w.c.is_active());
    assert!(!w
        .s
        .events
        .iter()
        .chain(&w.c.events)
        .any(|e| matches!(e, LgrOutput::LinkDown { .. })));
}

#[test]
fn a_peer_that_stops_answering_is_detected_by_keepalive() {
    let mut w = World::new(5, Some(Duration::from_secs(30)));
    w.fabric.set_unresponsive("simB", true).unwrap();
    for _ in 0..40 {
        w.run(Duration::from_millis(1));
        w.now += Duration::from_secs(1);
    }
    assert!(
        w.s.events.iter().any(|e| matches!(
            e,
            LgrOutput::LinkDown {
                reason: DownReason::KeepaliveTimeout | DownReason::Failure,
                ..
            }
        )),
        "{:?}",
        w.s.events
    );
    // the connection on the dead link is aborted, with an error for the application
    assert_eq!(w.s.closer.state(), CloseState::Closed);
    assert_eq!(
        w.s.closer.error(),
        Some(smc_proto::close::CloseError::Aborted)
    );
}

#[test]
fn orderly_close_reaches_closed_on_both_sides() {
    let mut w = World::new(11, None);
    assert_eq!(
        w.c.closer.state(),
        CloseState::Active,
        "established when the link is confirmed"
    );
    assert_eq!(w.c.write(b"last words").unwrap(), 10);
    w.run(Duration::from_millis(1));
    assert_eq!(w.s.read(100).unwrap(), b"last words");
    w.c.close_event(CloseEvent::AppClose { unread_data: false });
    w.run(Duration::from_millis(1));
    assert_eq!(w.s.closer.state(), CloseState::AppCloseWait1);
    w.s.close_event(CloseEvent::AppClose { unread_data: false });
    w.run(Duration::from_millis(1));
    assert_eq!(w.s.closer.state(), CloseState::Closed);
    assert_eq!(w.c.closer.state(), CloseState::Closed);
}

#[test]
fn qp_failure_kills_the_connection_with_an_error() {
    let mut w = World::new(13, None);
    w.fabric.fail_qp(w.c.qp_num());
    w.c.write(b"doomed").unwrap();
    w.run(Duration::from_millis(2));
    assert!(
        w.c.events
            .iter()
            .any(|e| matches!(e, LgrOutput::LinkDown { .. })),
        "{:?}",
        w.c.events
    );
    assert_eq!(w.c.closer.state(), CloseState::Closed);
    assert!(w.c.closer.error().is_some());
    assert!(!w.c.closer.can_write());
}

#[test]
fn same_seed_same_history() {
    let run = |seed| {
        let mut w = World::new(seed, None);
        w.c.write(&[1u8; 40_000]).unwrap();
        w.run(Duration::from_millis(3));
        (w.s.read(usize::MAX).unwrap().len(), w.fabric.trace())
    };
    assert_eq!(run(42), run(42));
}
