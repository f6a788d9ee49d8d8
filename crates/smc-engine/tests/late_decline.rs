//! The first link fails after the CLC exchange (issue 13, finding 1): the late
//! decline of `protocol-clc.md` §4.2 step 8 and §4.3 step 13. Both ends may see
//! the failure at once; exactly one of them (the server) declines, the other
//! reads that Decline and falls back without one of its own, and no CLC byte
//! is ever left over for the application. Two endpoints over the sim fabric,
//! the TCP connection an in-memory pipe whose every byte is logged.

mod common;

use common::*;
use smc_engine::endpoint::ConnStatus;
use smc_engine::state::HandshakePhase;
use smc_proto::clc_stream::FailReason;
use smc_wire::clc::{ClcHeader, ClcMessage, Decline, DeclineCode, SMC_V2};
use smc_wire::types::{Mac, SystemId};
use std::time::Duration;

/// A handshake whose every CLC byte is logged per side.
struct Run {
    w: World,
    t: Tcp,
    /// What (client, server) sent, and when.
    said: [Vec<(Duration, Vec<u8>)>; 2],
}

impl Run {
    fn new() -> Run {
        let mut w = World::default();
        let t = w.open();
        Run {
            w,
            t,
            said: [Vec::new(), Vec::new()],
        }
    }

    fn collect(&mut self) {
        let c = self.w.client.clc_output(self.t.c);
        if !c.is_empty() {
            self.said[0].push((self.w.now, c.clone()));
            self.t.c2s.extend(c);
        }
        let s = self.w.server.clc_output(self.t.s);
        if !s.is_empty() {
            self.said[1].push((self.w.now, s.clone()));
            self.t.s2c.extend(s);
        }
    }

    fn deliver_to_server(&mut self) {
        let n = self.w.server.clc_input(self.t.s, &self.t.c2s, self.w.now);
        self.t.c2s.drain(..n);
        self.collect();
    }

    fn deliver_to_client(&mut self) {
        let n = self.w.client.clc_input(self.t.c, &self.t.s2c, self.w.now);
        self.t.s2c.drain(..n);
        self.collect();
    }

    /// Both ends run for `d` in 1 ms steps; CLC is delivered if `deliver`.
    fn run(&mut self, d: Duration, deliver: bool) {
        let end = self.w.now + d;
        while self.w.now < end {
            self.collect();
            if deliver {
                self.deliver_to_server();
                self.deliver_to_client();
            }
            self.w.client.pump(self.w.now).unwrap();
            self.w.server.pump(self.w.now).unwrap();
            self.collect();
            self.w.fabric.advance(Duration::from_millis(1));
            self.w.now += Duration::from_millis(1);
        }
    }

    /// The Declines a side sent, with their time.
    fn declines(&self, side: usize) -> Vec<(Duration, DeclineCode)> {
        let mut v = Vec::new();
        for (at, bytes) in &self.said[side] {
            let mut b = &bytes[..];
            while let Ok(h) = ClcHeader::peek(b) {
                let n = usize::from(h.length).min(b.len());
                if let Ok(ClcMessage::Decline(d)) = ClcMessage::decode(&b[..n]) {
                    v.push((*at, d.diagnosis));
                }
                b = &b[n..];
            }
        }
        v
    }

    /// Proposal → Accept → Confirm: the client in AwaitLink, and the server
    /// too (it has read the Confirm; its CONFIRM_LINK is not yet posted).
    fn reach_await_link_both(&mut self) {
        self.collect();
        self.deliver_to_server();
        self.deliver_to_client();
        self.deliver_to_server();
        assert_eq!(
            self.w.client.handshake_phase(self.t.c),
            Some(HandshakePhase::AwaitLink)
        );
        assert_eq!(
            self.w.server.handshake_phase(self.t.s),
            Some(HandshakePhase::AwaitLink)
        );
    }

    /// Both ends' first-link QPs fail (a QP error each sees at once).
    fn fail_both_links(&mut self) {
        for ep in [&self.w.client, &self.w.server] {
            let qps: Vec<u32> = ep.link_group_ids().filter_map(|l| ep.qp_num(l)).collect();
            for q in qps {
                self.w.fabric.fail_qp(q);
            }
        }
    }
}

fn peer_decline() -> Vec<u8> {
    ClcMessage::Decline(Decline::new(
        SMC_V2,
        SystemId::new(9, Mac([2, 0, 0, 0, 0, 9])),
        DeclineCode::TimeoutCl,
    ))
    .encode()
}

#[test]
fn both_links_fail_at_once_and_only_the_server_declines() {
    let mut r = Run::new();
    r.reach_await_link_both();
    let confirm_at = r.w.now;
    r.fail_both_links();
    r.run(Duration::from_secs(8), true);
    // exactly one Decline on the wire, the server's, half a second after the
    // failure; none from the client
    let server = r.declines(1);
    assert_eq!(r.declines(0), vec![], "the client never declines");
    assert_eq!(server.len(), 1, "{server:?}");
    assert_eq!(server[0].1, DeclineCode::TimeoutCl);
    assert_eq!(server[0].0 - confirm_at, Duration::from_millis(500));
    assert_eq!(
        r.w.client.status(r.t.c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::TimeoutCl)
        })
    );
    assert_eq!(
        r.w.server.status(r.t.s),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::TimeoutCl,
            peer: None
        })
    );
    // every CLC byte was taken by the engine: nothing reaches an application
    assert!(
        r.t.c2s.is_empty(),
        "left for the server's application: {:?}",
        r.t.c2s
    );
    assert!(
        r.t.s2c.is_empty(),
        "left for the client's application: {:?}",
        r.t.s2c
    );
    // and nothing is left of the connection or its link groups
    r.w.client.release(r.t.c);
    r.w.server.release(r.t.s);
    r.run(Duration::from_millis(10), false);
    assert_eq!((r.w.client.connections(), r.w.server.connections()), (0, 0));
    assert_eq!((r.w.client.link_groups(), r.w.server.link_groups()), (0, 0));
}

#[test]
fn a_silent_server_gets_the_clients_decline_five_seconds_after_its_confirm() {
    let mut r = Run::new();
    r.collect();
    r.deliver_to_server();
    r.deliver_to_client();
    let confirm_at = r.w.now;
    // the Confirm never reaches the server's engine, nor does anything else:
    // the client's CONFIRM_LINK wait (4 s) ends, then its wait for a Decline
    r.run(Duration::from_millis(4_990), false);
    assert_eq!(
        r.w.client.handshake_phase(r.t.c),
        Some(HandshakePhase::AwaitLateDecline)
    );
    assert_eq!(r.declines(0), vec![]);
    r.run(Duration::from_millis(20), false);
    let client = r.declines(0);
    assert_eq!(client.len(), 1, "{client:?}");
    assert_eq!(
        client[0],
        (confirm_at + Duration::from_secs(5), DeclineCode::TimeoutCl)
    );
    assert_eq!(
        r.w.client.handshake_phase(r.t.c),
        Some(HandshakePhase::LateDeclined)
    );
    // a second later, with nothing from the server, the client is on TCP
    r.run(Duration::from_secs(2), false);
    assert_eq!(r.declines(0).len(), 1, "exactly one Decline");
    assert_eq!(
        r.w.client.status(r.t.c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::TimeoutCl,
            peer: None
        })
    );
    r.w.client.release(r.t.c);
    r.run(Duration::from_millis(10), false);
    assert_eq!(r.w.client.connections(), 0);
    assert_eq!(r.w.client.link_groups(), 0);
}

/// The client declined late (the server stayed silent); a Decline of the
/// server's that crossed it is taken off the stream, and the data behind it
/// is left for the application. Data alone is all the application's.
#[test]
fn a_crossed_decline_is_consumed_and_data_is_not() {
    for crossed in [true, false] {
        let mut r = Run::new();
        r.collect();
        r.deliver_to_server();
        r.deliver_to_client();
        r.run(Duration::from_millis(5_010), false);
        assert_eq!(
            r.w.client.handshake_phase(r.t.c),
            Some(HandshakePhase::LateDeclined)
        );
        let mut stream = if crossed { peer_decline() } else { Vec::new() };
        let decline_len = stream.len();
        stream.extend_from_slice(b"application data");
        let n = r.w.client.clc_input(r.t.c, &stream, r.w.now);
        assert_eq!(n, decline_len, "crossed {crossed}");
        assert_eq!(&stream[n..], b"application data");
        assert_eq!(
            r.w.client.status(r.t.c),
            Some(ConnStatus::Fallback {
                reason: DeclineCode::TimeoutCl,
                peer: crossed.then_some(DeclineCode::TimeoutCl)
            })
        );
        assert_eq!(r.declines(0).len(), 1);
    }
}

#[test]
fn a_peer_decline_during_the_wait_ends_it_without_one_of_ours() {
    for role in [0, 1] {
        let mut r = Run::new();
        r.reach_await_link_both();
        r.fail_both_links();
        r.run(Duration::from_millis(5), false);
        let (ep, id) = if role == 0 {
            (&mut r.w.client, r.t.c)
        } else {
            (&mut r.w.server, r.t.s)
        };
        assert_eq!(
            ep.handshake_phase(id),
            Some(HandshakePhase::AwaitLateDecline)
        );
        let d = peer_decline();
        assert_eq!(ep.clc_input(id, &d, r.w.now), d.len());
        assert_eq!(
            ep.status(id),
            Some(ConnStatus::Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(DeclineCode::TimeoutCl)
            })
        );
        // long past every deadline: still no Decline from this side
        r.run(Duration::from_secs(8), false);
        assert_eq!(r.declines(role), vec![], "side {role} answered a Decline");
    }
}

#[test]
fn a_tcp_end_during_the_wait_fails_the_connection_and_frees_it() {
    for role in [0, 1] {
        let mut r = Run::new();
        r.reach_await_link_both();
        r.fail_both_links();
        r.run(Duration::from_millis(5), false);
        let (ep, id) = if role == 0 {
            (&mut r.w.client, r.t.c)
        } else {
            (&mut r.w.server, r.t.s)
        };
        assert_eq!(
            ep.handshake_phase(id),
            Some(HandshakePhase::AwaitLateDecline)
        );
        ep.tcp_closed(id);
        assert_eq!(
            ep.status(id),
            Some(ConnStatus::Failed(FailReason::TcpClosed))
        );
        ep.release(id);
        r.run(Duration::from_secs(8), false);
        let ep = if role == 0 { &r.w.client } else { &r.w.server };
        assert_eq!(r.declines(role), vec![]);
        assert_eq!(ep.connections(), 0);
        assert_eq!(ep.link_groups(), 0);
    }
}

/// The server's group dies while the client's Confirm is on its way: the
/// server reads the Confirm (it must not reach the application) and declines
/// then; the client, waiting for CONFIRM_LINK, takes that Decline.
#[test]
fn a_first_contact_group_lost_before_the_confirm_declines_after_reading_it() {
    let mut r = Run::new();
    r.collect();
    r.deliver_to_server();
    // the server's QP fails before the Confirm is read
    let q =
        r.w.server
            .link_group_ids()
            .find_map(|l| r.w.server.qp_num(l));
    r.w.fabric.fail_qp(q.unwrap());
    r.run(Duration::from_millis(5), false);
    assert_eq!(
        r.w.server.handshake_phase(r.t.s),
        Some(HandshakePhase::AwaitConfirm)
    );
    assert_eq!(r.declines(1), vec![]);
    r.deliver_to_client();
    r.run(Duration::from_secs(2), true);
    assert_eq!(
        r.declines(1).iter().map(|d| d.1).collect::<Vec<_>>(),
        vec![DeclineCode::ErrRdyLnk]
    );
    assert_eq!(r.declines(0), vec![]);
    assert_eq!(
        r.w.client.status(r.t.c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::ErrRdyLnk)
        })
    );
    assert!(
        r.t.c2s.is_empty() && r.t.s2c.is_empty(),
        "no CLC byte left over"
    );
}
