//! A peer whose RDMA device vanishes mid-transfer (found live: a Linux 6.12
//! peer over Soft-RoCE ran `rdma link delete rxe0`): it tears its link group
//! down without a CDC or LLC message reaching us and closes the TCP
//! connections. Our endpoint runs over Soft-RoCE too, whose requester retries
//! forever at the transport retry count 7 that SMC-R uses
//! ([`smc_rdma::sim::SimFabric::set_rxe_retry`]): a CDC sent to the vanished
//! QP never completes, not even in error.

mod common;

use common::*;
use smc_engine::endpoint::{ConnError, PEER_GONE_GRACE};
use smc_wire::llc;
use std::time::Duration;

#[test]
fn a_released_connection_whose_peer_vanished_is_freed_with_its_group() {
    let mut cc = simple_config("simC", 0x1111, 1);
    let mut sc = simple_config("simS", 0x2222, 2);
    // the live configuration's keepalive (Linux's default)
    cc.testlink = Some(Duration::from_secs(30));
    sc.testlink = Some(Duration::from_secs(30));
    let mut w = World::new(cc, sc);
    w.fabric.set_rxe_retry("simC", true).unwrap();
    let mut t = w.handshake();
    // a second connection of the same link group, still open on our side
    let mut t2 = w.handshake();
    assert_eq!(w.client.link_group_of(t.c), w.client.link_group_of(t2.c));
    assert_eq!(w.client.link_groups(), 1);

    // the peer streams to us; we write a little back
    let msg = vec![0x5a; 1_000_000];
    let (mut sent, mut got) = (0, 0);
    for _ in 0..100 {
        sent += w.server.write(t.s, &msg[sent..]).unwrap();
        got += w.client.read(t.c, 3_000).unwrap().len();
        w.step(&mut [&mut t, &mut t2]);
    }
    assert!(got > 0 && sent < msg.len(), "mid-transfer: {got} of {sent}");
    w.client.write(t.c, b"still talking").unwrap();

    // The peer's device goes: its QPs no longer answer and its process
    // pumps no more; its kernel closes the TCP connection.
    w.fabric.set_unresponsive("simS", true).unwrap();
    let gone = w.now;
    w.client.tcp_closed(t.c);
    let mut released = None;
    let mut freed = None;
    while w.now < gone + Duration::from_secs(40) {
        w.client.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(10));
        w.now += Duration::from_millis(10);
        if released.is_none() {
            match w.client.read(t.c, 100_000) {
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e, ConnError::Reset, "the peer is taken for dead");
                    // the application drops the stream
                    w.client.release(t.c);
                    released = Some(w.now);
                }
            }
        }
        if released.is_some() && w.client.alert_token(t.c).is_none() {
            freed = Some(w.now);
            break;
        }
    }
    let released = released.expect("the read saw the reset");
    assert!(released - gone <= PEER_GONE_GRACE + Duration::from_millis(20));
    // Linux finds a dead link with one unanswered TEST_LINK (2 s,
    // smc_llc_testlink_work) and then terminates a group left without a
    // link (smcr_link_down); the connection must not wait for a CDC that
    // cannot complete, nor for the next keepalive interval.
    let bound = PEER_GONE_GRACE + llc::WAIT_TIME + Duration::from_millis(100);
    let freed = freed.unwrap_or_else(|| {
        panic!(
            "not freed within 40 s; {} connection(s), {} group(s): {}",
            w.client.connections(),
            w.client.link_groups(),
            w.client.debug_conn(t.c)
        )
    });
    assert!(
        freed - gone <= bound,
        "freed {:?} after the peer vanished, bound {bound:?}",
        freed - gone
    );
    // the group's only link failed: the group is terminated, and its other
    // connection is aborted
    assert_eq!(w.client.read(t2.c, 10), Err(ConnError::Aborted));
    w.client.release(t2.c);
    for _ in 0..3 {
        w.client.pump(w.now).unwrap();
        w.now += Duration::from_millis(1);
    }
    assert_eq!(w.client.connections(), 0);
    assert_eq!(w.client.link_groups(), 0, "the group is gone");
}

/// A peer whose process is stopped (`SIGSTOP`, a debugger: the provider
/// says so, `QueuePair::peer_paused`) answers no TEST_LINK meanwhile: its
/// link waits for it, as a TCP connection outlives a stopped peer, whose
/// kernel answers for it; once it is no longer paused and still silent,
/// the keepalive ends the link as before.
#[test]
fn a_link_outlives_a_stopped_peer_process() {
    let mut cc = simple_config("simC", 0x1111, 1);
    let mut sc = simple_config("simS", 0x2222, 2);
    let iv = Duration::from_secs(5);
    cc.testlink = Some(iv);
    sc.testlink = Some(iv);
    let mut w = World::new(cc, sc);
    let mut t = w.handshake();
    w.server.write(t.s, b"before").unwrap();
    w.settle(&mut [&mut t], Duration::from_millis(2));
    assert_eq!(w.client.read(t.c, 100).unwrap(), b"before");

    // stopped: its endpoint runs no more (never pumped from here on; its
    // device still takes what comes, as a stopped process's receive ring
    // does), and the provider knows why
    w.fabric.set_paused("simS", true).unwrap();
    let stopped = w.now;
    while w.now < stopped + iv * 12 {
        w.client.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(10));
        w.now += Duration::from_millis(10);
    }
    assert_eq!(
        w.client.link_groups(),
        1,
        "the link waits for the stopped peer"
    );
    assert_eq!(
        w.client.read(t.c, 100),
        Ok(vec![]),
        "the connection is fine"
    );

    // the process is no longer stopped but stays silent (it hangs): down
    // as before
    w.fabric.set_paused("simS", false).unwrap();
    let resumed = w.now;
    let mut down = None;
    while w.now < resumed + iv * 3 {
        w.client.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_millis(10));
        w.now += Duration::from_millis(10);
        if w.client.read(t.c, 100).is_err() {
            down = Some(w.now);
            break;
        }
    }
    let down = down.expect("a silent peer that is not paused ends its link");
    assert!(
        down - resumed <= llc::WAIT_TIME + Duration::from_millis(50),
        "{:?}",
        down - resumed
    );
}

/// A write after the peer closed, for a caller that behaves as a TCP
/// socket (`Endpoint::reset_by_write`): the connection takes the reset
/// TCP's peer answers it with — writes EPIPE (`ConnError::Closed`), reads
/// the end of file after what came before the close — and only there.
#[test]
fn a_write_after_the_peers_close_draws_the_reset_tcp_would() {
    use smc_proto::close::CloseEvent;
    let mut w = World::default();
    let mut t = w.handshake();
    assert!(!w.client.reset_by_write(t.c), "an open connection");
    w.server.write(t.s, b"last").unwrap();
    w.server
        .close(t.s, CloseEvent::AppClose { unread_data: false });
    w.settle(&mut [&mut t], Duration::from_millis(2));
    assert!(w.client.peer_closed(t.c));
    assert_eq!(
        w.client.write(t.c, b"late"),
        Err(ConnError::Reset),
        "as Linux's SMC"
    );
    assert!(w.client.reset_by_write(t.c));
    assert!(!w.client.reset_by_write(t.c), "once");
    assert_eq!(w.client.write(t.c, b"later"), Err(ConnError::Closed));
    assert_eq!(w.client.read(t.c, 100).unwrap(), b"last");
    assert_eq!(w.client.read(t.c, 100), Ok(vec![]), "end of file");
}
