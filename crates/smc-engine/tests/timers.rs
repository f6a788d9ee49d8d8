//! Time as quinn-proto has it (docs/FAST-PATH.md step 2): the endpoint
//! reports when it next needs to run (`poll_timeout`) and does what is due
//! when called then (`handle_timeout`), so a driver that sleeps until that
//! deadline misses nothing and an idle endpoint is not woken.

mod common;

use common::*;
use smc_engine::endpoint::{ConnError, ConnStatus, PEER_GONE_GRACE};
use smc_proto::clc_stream::FailReason;
use std::time::Duration;

/// A handshake's deadline (CLC_WAIT_TIME, protocol-clc.md §4.6) is reported
/// and runs when called at it, not before.
#[test]
fn a_handshake_deadline_is_reported_and_runs_at_it() {
    let mut w = World::default();
    let t0 = w.now;
    let c = w.client.connect(w.client_ip, t0);
    w.client.clc_output(c);
    w.client.pump(t0).unwrap();
    let due = w
        .client
        .poll_timeout()
        .expect("the handshake waits for a time");
    assert_eq!(due, t0 + Duration::from_secs(6));
    w.client
        .handle_timeout(due - Duration::from_millis(1))
        .unwrap();
    assert_eq!(w.client.status(c), Some(ConnStatus::Handshaking));
    w.client.handle_timeout(due).unwrap();
    // (no Accept in time: the client goes on over TCP, tests/late_answer.rs)
    assert!(matches!(
        w.client.status(c),
        Some(ConnStatus::Fallback { .. })
    ));
    // the server's deadline for the Proposal runs the same way
    let s = w.server.accept(w.server_ip, t0);
    w.server.pump(t0).unwrap();
    assert_eq!(w.server.poll_timeout(), Some(t0 + Duration::from_secs(6)));
    w.server.handle_timeout(due).unwrap();
    assert_eq!(
        w.server.status(s),
        Some(ConnStatus::Failed(FailReason::Timeout))
    );
}

/// An established connection whose TCP connection ended is reset after
/// PEER_GONE_GRACE: that deadline is reported, and a driver that calls the
/// endpoint only then sees the reset.
#[test]
fn a_peer_gone_deadline_is_reported_and_resets_the_connection_at_it() {
    let mut w = World::default();
    let t = w.handshake();
    w.client.tcp_closed(t.c);
    w.client.pump(w.now).unwrap();
    let due = w.client.poll_timeout().expect("the reset waits for a time");
    assert!(
        due <= w.now + PEER_GONE_GRACE,
        "{due:?} later than the grace from {:?}",
        w.now
    );
    assert!(due > w.now, "nothing is due at once");
    w.client.handle_timeout(due).unwrap();
    assert_eq!(w.client.read(t.c, 10), Err(ConnError::Reset));
}

/// Established connections with nothing to do leave the endpoint waiting
/// for no time at all (no keepalive configured here): a driver sleeps until
/// an event. Their handshakes' deadlines, cleared, are no longer reported.
#[test]
fn idle_established_connections_report_no_deadline() {
    let mut w = World::default();
    let mut ts: Vec<Tcp> = (0..5).map(|_| w.handshake()).collect();
    for t in &ts {
        w.client.write(t.c, b"ping").unwrap();
    }
    let mut refs: Vec<&mut Tcp> = ts.iter_mut().collect();
    w.settle(&mut refs, Duration::from_millis(5));
    for t in &ts {
        assert_eq!(w.server.read(t.s, 10).unwrap(), b"ping");
    }
    let mut refs: Vec<&mut Tcp> = ts.iter_mut().collect();
    w.settle(&mut refs, Duration::from_millis(5));
    assert_eq!(w.client.poll_timeout(), None);
    assert_eq!(w.server.poll_timeout(), None);
}
