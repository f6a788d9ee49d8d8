//! A server that answers the Proposal after the client stopped waiting
//! (`CLC_WAIT_TIME`, 6 s): a server in user space runs a handshake only
//! when its process gets to it. The client declines with
//! SMC_CLC_DECL_TIMEOUT and goes on over TCP instead of failing; the server,
//! which reads the Proposal and then that Decline where it waits for the
//! Confirm, falls back too (as Linux's `smc_listen_work` does), and its
//! answer, still due on the stream, is taken off it by the client's
//! caller (`Endpoint::owed_answer`), never given to the application.

mod common;

use common::*;
use smc_engine::endpoint::ConnStatus;
use smc_proto::clc_stream::Owed;
use smc_wire::clc::{ClcMessage, DeclineCode, SMC_V2};
use std::time::Duration;

/// The client's bytes after its wait ended: one Decline, of the timeout class.
fn assert_timeout_decline(bytes: &[u8]) {
    match ClcMessage::decode(bytes) {
        Ok(ClcMessage::Decline(d)) => {
            assert_eq!(d.diagnosis, DeclineCode::Timeout);
            assert_eq!(d.version, SMC_V2, "the class of the Proposal's versions");
        }
        m => panic!("not a Decline: {m:?}"),
    }
}

#[test]
fn a_client_without_an_answer_in_time_declines_and_goes_on_over_tcp() {
    let mut w = World::default();
    let t0 = w.now;
    let c = w.client.connect(w.client_ip, t0);
    let proposal = w.client.clc_output(c);
    assert!(!proposal.is_empty());
    w.client
        .handle_timeout(t0 + Duration::from_secs(6))
        .unwrap();
    assert_eq!(
        w.client.status(c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::Timeout,
            peer: None
        })
    );
    let decline = w.client.clc_output(c);
    assert_timeout_decline(&decline);
    // (what the timeout's sweep leaves, then nothing more to wait for)
    w.client
        .handle_timeout(t0 + Duration::from_secs(6))
        .unwrap();
    assert_eq!(w.client.poll_timeout(), None);
    let mut answer = w
        .client
        .owed_answer(c)
        .expect("the server's answer is owed");

    // The server gets to the connection later: the Proposal and the Decline
    // behind it are there at once.
    w.now += Duration::from_secs(6);
    let s = w.server.accept(w.server_ip, w.now);
    let mut c2s = proposal;
    c2s.extend_from_slice(&decline);
    let n = w.server.clc_input(s, &c2s, w.now);
    assert_eq!(n, c2s.len(), "both are CLC");
    assert_eq!(
        w.server.status(s),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::Timeout)
        })
    );
    let mut s2c = w.server.clc_output(s);
    assert!(
        matches!(ClcMessage::decode(&s2c), Ok(ClcMessage::Accept(_))),
        "the server answered the Proposal it read first"
    );
    // the first contact it began ends with the handshake
    for _ in 0..10 {
        w.tick();
    }
    assert_eq!(w.server.link_groups(), 0);
    assert_eq!(w.client.link_groups(), 0);

    // The client's stream: the answer, then the server's data.
    s2c.extend_from_slice(b"the server's data");
    assert_eq!(w.client.clc_input(c, &s2c, w.now), 0, "not the engine's");
    let (n, o) = answer.take(&s2c);
    assert_eq!(o, Owed::Taken);
    assert_eq!(&s2c[n..], b"the server's data");
}

#[test]
fn an_answer_begun_when_the_wait_ends_is_taken_off_from_where_it_stands() {
    let mut w = World::default();
    let mut t = w.open();
    t.c2s.extend(w.client.clc_output(t.c));
    let n = w.server.clc_input(t.s, &t.c2s, w.now);
    t.c2s.drain(..n);
    t.s2c.extend(w.server.clc_output(t.s));
    assert!(t.s2c.len() > 10, "the server answered");
    // ten bytes of the answer come before the client's deadline, the rest after
    assert_eq!(w.client.clc_input(t.c, &t.s2c[..10], w.now), 10);
    w.client
        .handle_timeout(w.now + Duration::from_secs(6))
        .unwrap();
    assert!(matches!(
        w.client.status(t.c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::Timeout,
            ..
        })
    ));
    assert_timeout_decline(&w.client.clc_output(t.c));
    let mut answer = w.client.owed_answer(t.c).unwrap();
    let mut rest = t.s2c[10..].to_vec();
    rest.extend_from_slice(b"data");
    let (n, o) = answer.take(&rest);
    assert_eq!((o, &rest[n..]), (Owed::Taken, &b"data"[..]));
}

#[test]
fn only_a_client_that_gave_up_owes_an_answer_to_take_off() {
    let mut w = World::default();
    let t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    assert!(w.client.owed_answer(t.c).is_none());
    assert!(w.server.owed_answer(t.s).is_none());
    // a server that had no Proposal in time fails, as Linux's closes it
    let s = w.server.accept(w.server_ip, w.now);
    w.server
        .handle_timeout(w.now + Duration::from_secs(6))
        .unwrap();
    assert!(matches!(w.server.status(s), Some(ConnStatus::Failed(_))));
    assert!(w.server.owed_answer(s).is_none());
}
