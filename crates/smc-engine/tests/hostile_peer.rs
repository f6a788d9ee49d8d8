//! A peer's CLC values that we act on (issue 13, finding 7), and a provider
//! that cannot ready a peer's RMB (`QueuePair::prepare_remote`): each costs
//! the one connection — a clean Decline with a code while the handshake runs,
//! an abort of that connection once the peer is established — never a hang, a
//! panic, or another connection. Two endpoints over the sim fabric.

mod common;

use common::*;
use smc_engine::endpoint::{ConnStatus, Endpoint};
use smc_engine::simulate::Faulty;
use smc_proto::close::CloseEvent;
use smc_rdma::sim::SimFabric;
use smc_wire::clc::{AcceptConfirm, ClcMessage, DeclineCode};
use smc_wire::types::{Gid, RmbeSize};
use std::time::Duration;

type Tweak = fn(&mut AcceptConfirm);

/// Each bad value, and the code it is declined with (both roles).
fn bad_values() -> Vec<(&'static str, Tweak, DeclineCode)> {
    vec![
        ("QP MTU 0", |m| m.qp_mtu = 0, DeclineCode::ErrRdyLnk),
        ("QP MTU 6", |m| m.qp_mtu = 6, DeclineCode::ErrRdyLnk),
        ("QP MTU 15", |m| m.qp_mtu = 15, DeclineCode::ErrRdyLnk),
        ("QP number 0", |m| m.qpn = 0, DeclineCode::ErrRdyLnk),
        ("QP number 1", |m| m.qpn = 1, DeclineCode::ErrRdyLnk),
        ("GID zero", |m| m.gid = Gid::ZERO, DeclineCode::ErrRdyLnk),
        ("alert token 0", |m| m.alert_token = 0, DeclineCode::ErrRtok),
        ("RMBE index 0", |m| m.rmbe_idx = 0, DeclineCode::ErrRtok),
        (
            "RMB at the end of the address space",
            |m| m.rmb_vaddr = u64::MAX - 100,
            DeclineCode::ErrRtok,
        ),
        (
            "RMBE past the end of the address space",
            |m| {
                m.rmbe_size = RmbeSize::from_class(15).unwrap();
                m.rmbe_idx = 200;
                m.rmb_vaddr = u64::MAX - (64 << 30);
            },
            DeclineCode::ErrRtok,
        ),
    ]
}

fn tweak(bytes: &[u8], f: Tweak) -> Vec<u8> {
    match ClcMessage::decode(bytes).unwrap() {
        ClcMessage::Accept(mut a) => {
            f(&mut a);
            ClcMessage::Accept(a).encode()
        }
        ClcMessage::Confirm(mut c) => {
            f(&mut c);
            ClcMessage::Confirm(c).encode()
        }
        m => panic!("not an Accept or Confirm: {m:?}"),
    }
}

fn declined(bytes: &[u8]) -> Option<DeclineCode> {
    match ClcMessage::decode(bytes) {
        Ok(ClcMessage::Decline(d)) => Some(d.diagnosis),
        _ => None,
    }
}

/// Both ends release the connection and run a while; nothing may be left.
fn released_and_clean(w: &mut World, t: &mut Tcp, what: &str) {
    w.client.release(t.c);
    w.server.release(t.s);
    for _ in 0..100 {
        w.tick();
    }
    assert_eq!(
        (w.client.connections(), w.server.connections()),
        (0, 0),
        "{what}: connections left"
    );
    assert_eq!(
        (w.client.link_groups(), w.server.link_groups()),
        (0, 0),
        "{what}: link groups left"
    );
}

#[test]
fn a_bad_value_in_the_accept_is_declined_by_the_client() {
    for (what, f, code) in bad_values() {
        let mut w = World::default();
        let mut t = w.open();
        let proposal = w.client.clc_output(t.c);
        assert_eq!(w.server.clc_input(t.s, &proposal, w.now), proposal.len());
        let accept = tweak(&w.server.clc_output(t.s), f);
        assert_eq!(
            w.client.clc_input(t.c, &accept, w.now),
            accept.len(),
            "{what}"
        );
        assert_eq!(
            w.client.status(t.c),
            Some(ConnStatus::Fallback {
                reason: code,
                peer: None
            }),
            "{what}"
        );
        let answer = w.client.clc_output(t.c);
        assert_eq!(declined(&answer), Some(code), "{what}: the client's answer");
        assert_eq!(
            w.client.link_groups(),
            0,
            "{what}: no group for a bad Accept"
        );
        // the server falls back with the client's code
        w.server.clc_input(t.s, &answer, w.now);
        assert_eq!(
            w.server.status(t.s),
            Some(ConnStatus::Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(code)
            }),
            "{what}"
        );
        released_and_clean(&mut w, &mut t, what);
        // the endpoints serve the next connection over SMC-R
        let t2 = w.handshake();
        assert_eq!(w.client.status(t2.c), Some(ConnStatus::Smc), "{what}");
    }
}

#[test]
fn a_bad_value_in_the_confirm_is_declined_by_the_server() {
    for (what, f, code) in bad_values() {
        let mut w = World::default();
        let mut t = w.open();
        let proposal = w.client.clc_output(t.c);
        w.server.clc_input(t.s, &proposal, w.now);
        let accept = w.server.clc_output(t.s);
        w.client.clc_input(t.c, &accept, w.now);
        let confirm = tweak(&w.client.clc_output(t.c), f);
        assert_eq!(
            w.server.clc_input(t.s, &confirm, w.now),
            confirm.len(),
            "{what}"
        );
        assert_eq!(
            w.server.status(t.s),
            Some(ConnStatus::Fallback {
                reason: code,
                peer: None
            }),
            "{what}"
        );
        let answer = w.server.clc_output(t.s);
        assert_eq!(declined(&answer), Some(code), "{what}: the server's answer");
        // the client, waiting for CONFIRM_LINK, takes the Decline
        w.tick();
        w.client.clc_input(t.c, &answer, w.now);
        assert_eq!(
            w.client.status(t.c),
            Some(ConnStatus::Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(code)
            }),
            "{what}"
        );
        released_and_clean(&mut w, &mut t, what);
        let t2 = w.handshake();
        assert_eq!(w.server.status(t2.s), Some(ConnStatus::Smc), "{what}");
    }
}

/// Endpoints over a fabric whose `prepare_remote` fails on demand.
struct FaultyWorld {
    p: Faulty,
    fabric: SimFabric,
    client: Endpoint<Faulty>,
    server: Endpoint<Faulty>,
    now: Duration,
}

impl FaultyWorld {
    fn new() -> FaultyWorld {
        let fabric = SimFabric::new(5);
        let (ccfg, scfg) = (
            simple_config("simC", 0x1111, 1),
            simple_config("simS", 0x2222, 2),
        );
        add_device_for(&fabric, &ccfg);
        add_device_for(&fabric, &scfg);
        let p = Faulty::new(fabric.clone(), 5, 0);
        FaultyWorld {
            client: Endpoint::new_seeded(&p, ccfg, 1).unwrap(),
            server: Endpoint::new_seeded(&p, scfg, 2).unwrap(),
            p,
            fabric,
            now: Duration::ZERO,
        }
    }

    fn open(&mut self) -> Tcp {
        let s = self
            .server
            .accept(std::net::IpAddr::from([10, 99, 0, 2]), self.now);
        let c = self
            .client
            .connect(std::net::IpAddr::from([10, 99, 0, 1]), self.now);
        Tcp {
            c,
            s,
            c2s: Vec::new(),
            s2c: Vec::new(),
        }
    }

    fn step(&mut self, tcps: &mut [&mut Tcp]) {
        for t in tcps.iter_mut() {
            t.c2s.extend(self.client.clc_output(t.c));
            t.s2c.extend(self.server.clc_output(t.s));
            let n = self.server.clc_input(t.s, &t.c2s, self.now);
            t.c2s.drain(..n);
            let n = self.client.clc_input(t.c, &t.s2c, self.now);
            t.s2c.drain(..n);
        }
        self.client.pump(self.now).unwrap();
        self.server.pump(self.now).unwrap();
        self.fabric.advance(Duration::from_micros(20));
        self.now += Duration::from_micros(20);
    }

    fn settle(&mut self, tcps: &mut [&mut Tcp], d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.step(tcps);
        }
    }

    /// Client → server bytes of `t` arrive at the server.
    fn echo_check(&mut self, t: &mut Tcp, others: &mut [&mut Tcp]) {
        let msg = b"still fine";
        self.client.write(t.c, msg).unwrap();
        let mut all: Vec<&mut Tcp> = vec![t];
        all.extend(others.iter_mut().map(|x| &mut **x));
        self.settle(&mut all, Duration::from_millis(1));
        assert_eq!(self.server.read(all[0].s, 100).unwrap(), msg);
    }
}

#[test]
fn a_first_contact_whose_peer_rmb_cannot_be_readied_is_aborted_alone() {
    // A first contact readies the peer RMB once the link is active (both
    // QPs in RTS), when both ends already count the connection established:
    // the side whose prepare fails aborts it, the other sees the abort, and
    // the group goes on serving the next connection.
    for (first, side) in [(0, "client"), (1, "server")] {
        let mut w = FaultyWorld::new();
        let mut t = w.open();
        // the client's prepare comes first (CONFIRM_LINK request), the
        // server's with the response
        w.p.fail_prepares_after(first, 1);
        w.settle(&mut [&mut t], Duration::from_millis(2));
        assert_eq!(w.p.failed_prepares(), 1, "{side}");
        assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc), "{side}");
        assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc), "{side}");
        let (failed, other) = if first == 0 {
            (&mut w.client, t.s)
        } else {
            (&mut w.server, t.c)
        };
        let failed_id = if first == 0 { t.c } else { t.s };
        assert!(
            failed.sent_close_flags(failed_id).unwrap().abort,
            "{side}: aborted"
        );
        let (oc, os) = if first == 0 {
            (&mut w.server, other)
        } else {
            (&mut w.client, other)
        };
        assert!(
            oc.read(os, 10).is_err() || oc.peer_closed(os),
            "{side}: the peer sees the abort"
        );
        assert!(
            t.c2s.is_empty() && t.s2c.is_empty(),
            "{side}: CLC left over"
        );
        w.client.release(t.c);
        w.server.release(t.s);
        w.settle(&mut [], Duration::from_millis(1));
        // and the next connection runs over SMC-R
        let mut t2 = w.open();
        w.settle(&mut [&mut t2], Duration::from_millis(2));
        assert_eq!(w.client.status(t2.c), Some(ConnStatus::Smc), "{side}");
        assert_eq!(w.server.status(t2.s), Some(ConnStatus::Smc), "{side}");
        w.echo_check(&mut t2, &mut []);
    }
}

#[test]
fn a_reused_group_loses_only_the_connection_whose_peer_rmb_cannot_be_readied() {
    // client side (at the Accept): a Decline, the group and its other
    // connection carry on
    let mut w = FaultyWorld::new();
    let mut a = w.open();
    w.settle(&mut [&mut a], Duration::from_millis(2));
    assert_eq!(w.client.status(a.c), Some(ConnStatus::Smc));
    let mut b = w.open();
    w.step(&mut [&mut a, &mut b]); // Proposal
    w.p.fail_next_prepares(1);
    w.settle(&mut [&mut a, &mut b], Duration::from_millis(2));
    assert_eq!(w.p.failed_prepares(), 1);
    assert!(matches!(
        w.client.status(b.c),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::ErrRtok | DeclineCode::Mem,
            peer: None
        })
    ));
    assert!(matches!(
        w.server.status(b.s),
        Some(ConnStatus::Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::ErrRtok | DeclineCode::Mem)
        })
    ));
    w.echo_check(&mut a, &mut []);
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (1, 1));

    // server side (at the Confirm): the client counts itself established, so
    // the connection is aborted; the others are untouched
    let mut c = w.open();
    w.step(&mut [&mut a, &mut c]); // Proposal
    w.step(&mut [&mut a, &mut c]); // CONFIRM_RKEY starts
                                   // the client's prepare (at the Accept) passes, the server's fails
    let before = w.p.failed_prepares();
    for _ in 0..200 {
        if w.client.status(c.c) == Some(ConnStatus::Smc) {
            break;
        }
        w.step(&mut [&mut a, &mut c]);
    }
    assert_eq!(w.client.status(c.c), Some(ConnStatus::Smc));
    w.p.fail_next_prepares(1);
    w.settle(&mut [&mut a, &mut c], Duration::from_millis(2));
    assert_eq!(w.p.failed_prepares(), before + 1);
    assert_eq!(w.server.status(c.s), Some(ConnStatus::Smc));
    assert!(w.server.sent_close_flags(c.s).unwrap().abort, "aborted");
    assert!(
        w.client.read(c.c, 10).is_err() || w.client.peer_closed(c.c),
        "the client sees the abort"
    );
    w.echo_check(&mut a, &mut [&mut c]);
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (1, 1));
    for t in [&a, &c] {
        w.client
            .close(t.c, CloseEvent::AppClose { unread_data: false });
        w.server
            .close(t.s, CloseEvent::AppClose { unread_data: false });
        w.client.release(t.c);
        w.server.release(t.s);
    }
    w.client.release(b.c);
    w.server.release(b.s);
    w.settle(&mut [&mut a, &mut c], Duration::from_secs(2));
    assert_eq!((w.client.connections(), w.server.connections()), (0, 0));
}
