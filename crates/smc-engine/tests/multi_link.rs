//! Link groups with more than one link, between two endpoints over the sim
//! fabric: a second link brought up with the test-only bring-up (ADD_LINK is not
//! negotiated yet), connections spread over the links, moved between them with
//! their data intact, and moved off a link that fails — without losing a byte.
//! Also the link-group life cycle and the serialization of first contacts.
//! Spec: `protocol-llc-cdc.md` §6, §7, §9; `protocol-clc.md` §4.

use smc_engine::endpoint::{ConnError, ConnStatus, EndpointConfig, LgrId};
use smc_engine::state::{HandshakePhase, LgrState};
use smc_proto::close::{CloseEvent, CloseState};
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

impl World {
    fn two() -> World {
        World::with_seed(7, config("simC", 0x1111, 1), config("simS", 0x2222, 2))
    }

    /// A handshake that must end in SMC-R on both sides.
    fn smc_handshake(&mut self) -> Tcp {
        let t = self.handshake();
        assert_eq!(self.client.status(t.c), Some(ConnStatus::Smc));
        assert_eq!(self.server.status(t.s), Some(ConnStatus::Smc));
        t
    }

    /// Brings up a further link between the groups of connection `t`: both
    /// sides offer, both accept the other's offer, CONFIRM_LINK runs on it.
    fn add_link(&mut self, t: &mut Tcp) -> (LgrId, LgrId, usize) {
        let lc = self.client.link_group_of(t.c).unwrap();
        let ls = self.server.link_group_of(t.s).unwrap();
        let so = self.server.extra_link_offer(ls).unwrap();
        let co = self.client.extra_link_offer(lc).unwrap();
        assert_ne!(so.link_id, 0, "the server names the link");
        let slot_c = self.client.extra_link_accept(lc, &so, self.now).unwrap();
        let slot_s = self.server.extra_link_accept(ls, &co, self.now).unwrap();
        assert_eq!(slot_c, slot_s);
        self.settle(&mut [t], Duration::from_millis(1));
        assert_eq!(self.client.usable_links(lc), [0, 1]);
        assert_eq!(self.server.usable_links(ls), [0, 1]);
        (lc, ls, slot_c)
    }
}

/// Bulk data both ways on every connection, every byte checked.
struct Streams {
    len: usize,
    sent: Vec<[usize; 2]>,
    got: Vec<[Vec<u8>; 2]>,
}

fn byte(conn: usize, dir: usize, i: usize) -> u8 {
    ((i.wrapping_mul(2654435761) >> 11) as u8) ^ (conn as u8 * 31) ^ (dir as u8 * 0x5a)
}

impl Streams {
    fn new(n: usize, len: usize) -> Streams {
        Streams {
            len,
            sent: vec![[0, 0]; n],
            got: vec![[Vec::new(), Vec::new()]; n],
        }
    }

    /// One round of writes and reads; false once everything arrived.
    fn pump(&mut self, w: &mut World, ts: &[&Tcp]) -> bool {
        let mut busy = false;
        for (i, t) in ts.iter().enumerate() {
            for dir in 0..2 {
                let (tx, rx, tid, rid) = if dir == 0 {
                    (&mut w.client, &mut w.server, t.c, t.s)
                } else {
                    (&mut w.server, &mut w.client, t.s, t.c)
                };
                let at = self.sent[i][dir];
                if at < self.len {
                    let chunk: Vec<u8> = (at..self.len.min(at + 5000))
                        .map(|k| byte(i, dir, k))
                        .collect();
                    self.sent[i][dir] += tx.write(tid, &chunk).unwrap();
                }
                let data = rx.read(rid, 7000).unwrap();
                for (k, b) in data.iter().enumerate() {
                    let off = self.got[i][dir].len() + k;
                    assert_eq!(*b, byte(i, dir, off), "conn {i} dir {dir}: byte {off}");
                }
                self.got[i][dir].extend(data);
                busy |= self.got[i][dir].len() < self.len;
            }
        }
        busy
    }
}

#[test]
fn a_second_link_comes_up_and_new_connections_spread_over_both() {
    let mut w = World::two();
    let mut t0 = w.smc_handshake();
    let (lc, ls, slot) = w.add_link(&mut t0);
    assert_eq!(slot, 1);
    assert_ne!(w.client.link_qp_num(lc, 0), w.client.link_qp_num(lc, 1));
    let ts: Vec<Tcp> = (0..4).map(|_| w.smc_handshake()).collect();
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (1, 1));
    // the server assigns the least loaded link; the client follows the Accept
    let links: Vec<usize> = ts.iter().map(|t| w.server.link_of(t.s).unwrap()).collect();
    assert_eq!(links, [1, 0, 1, 0]);
    for t in &ts {
        assert_eq!(w.client.link_of(t.c), w.server.link_of(t.s));
    }
    assert_eq!(w.server.link_of(t0.s), Some(0));
    // data flows on every connection, on its own link
    let mut all: Vec<&Tcp> = ts.iter().collect();
    all.push(&t0);
    let mut st = Streams::new(all.len(), 100_000);
    let mut steps = 0;
    while st.pump(&mut w, &all) {
        w.tick();
        steps += 1;
        assert!(steps < 200_000, "stalled");
    }
    assert_eq!(
        w.link_group_states(lc, ls),
        (LgrState::Active, LgrState::Active)
    );
}

impl World {
    fn link_group_states(&self, lc: LgrId, ls: LgrId) -> (LgrState, LgrState) {
        (
            self.client.link_group_state(lc).unwrap(),
            self.server.link_group_state(ls).unwrap(),
        )
    }

    fn run(&mut self, st: &mut Streams, ts: &[&Tcp], mut at_step: impl FnMut(&mut World, u64)) {
        let mut steps = 0u64;
        while st.pump(self, ts) {
            at_step(self, steps);
            self.tick();
            steps += 1;
            assert!(steps < 400_000, "stalled");
        }
        assert!(steps > 100, "too short to test anything: {steps} steps");
    }
}

#[test]
fn a_connection_moves_between_links_with_its_data_intact() {
    let mut w = World::two();
    let mut t = w.smc_handshake();
    let (_, _, slot) = w.add_link(&mut t);
    let mut st = Streams::new(1, 2_000_000);
    let mut moves = 0;
    w.run(&mut st, &[&t], |w, step| {
        if step % 7 == 3 {
            // each side moves its end on its own: one direction at a time
            let (ep, id) = if step % 2 == 0 {
                (&mut w.client, t.c)
            } else {
                (&mut w.server, t.s)
            };
            let to = if ep.link_of(id) == Some(0) { slot } else { 0 };
            if ep.move_connection(id, to) {
                moves += 1;
            }
        }
    });
    assert!(moves > 20, "only {moves} moves");
    // once quiet, the connection sits on the link it was last moved to
    w.settle(&mut [&mut t], Duration::from_millis(1));
    assert!(w.client.link_of(t.c).is_some() && w.server.link_of(t.s).is_some());
    assert!(!w
        .client
        .move_connection(t.c, w.client.link_of(t.c).unwrap()));
    assert!(!w.client.move_connection(t.c, 2), "no link in slot 2");
    assert!(w.client.violation(t.c).is_none() && w.server.violation(t.s).is_none());
}

#[test]
fn killing_one_link_moves_its_connections_without_data_loss() {
    for (kill_client, kill_slot) in [(true, 1), (false, 1), (true, 0), (false, 0)] {
        let mut w = World::two();
        let mut t0 = w.smc_handshake();
        let (lc, ls, _) = w.add_link(&mut t0);
        let ts: Vec<Tcp> = (0..3).map(|_| w.smc_handshake()).collect();
        let first = Tcp {
            c: t0.c,
            s: t0.s,
            c2s: Vec::new(),
            s2c: Vec::new(),
        };
        let mut all: Vec<&Tcp> = ts.iter().collect();
        all.push(&first);
        let on_killed = all
            .iter()
            .filter(|t| w.server.link_of(t.s) == Some(kill_slot))
            .count();
        assert_eq!(on_killed, 2);
        let mut st = Streams::new(all.len(), 1_000_000);
        let qpn = if kill_client {
            w.client.link_qp_num(lc, kill_slot).unwrap()
        } else {
            w.server.link_qp_num(ls, kill_slot).unwrap()
        };
        let fabric = w.fabric.clone();
        w.run(&mut st, &all, |_, step| {
            if step == 40 {
                fabric.fail_qp(qpn);
            }
        });
        let survivor = 1 - kill_slot;
        for t in &all {
            assert_eq!(w.client.link_of(t.c), Some(survivor));
            assert_eq!(w.server.link_of(t.s), Some(survivor));
            assert!(w.client.violation(t.c).is_none() && w.server.violation(t.s).is_none());
        }
        assert_eq!(w.client.usable_links(lc), [survivor]);
        assert_eq!(w.server.usable_links(ls), [survivor], "told by DELETE_LINK");
        assert_eq!(
            w.link_group_states(lc, ls),
            (LgrState::Active, LgrState::Active)
        );
        // new connections take the surviving link
        let t = w.smc_handshake();
        assert_eq!(w.server.link_of(t.s), Some(survivor));
        // the freed slot takes a new link again
        let (_, _, slot) = w.add_link(&mut t0);
        assert_eq!(slot, kill_slot);
        // losing the last link ends the group: connections are aborted (§7.3)
        let mut t = t;
        for s in [0, 1] {
            w.fabric.fail_qp(w.client.link_qp_num(lc, s).unwrap());
        }
        w.client.write(t.c, b"x").unwrap();
        w.settle(&mut [&mut t], Duration::from_millis(2));
        assert_eq!(w.client.close_state(t.c), Some(CloseState::Closed));
        assert_eq!(w.client.read(t.c, 1), Err(ConnError::Aborted));
        assert_eq!(w.client.link_group_state(lc), Some(LgrState::Terminating));
    }
}

#[test]
fn the_link_group_life_cycle() {
    let mut w = World::two();
    let mut t = w.open();
    // server: Accept sent, Confirm not yet in
    for _ in 0..200 {
        t.s2c.extend(w.server.clc_output(t.s));
        let n = w.server.clc_input(t.s, &t.c2s, w.now);
        t.c2s.drain(..n);
        t.c2s.extend(w.client.clc_output(t.c));
        w.server.pump(w.now).unwrap();
        if w.server.link_group_of(t.s).is_some() {
            break;
        }
    }
    let ls = w.server.link_group_of(t.s).unwrap();
    assert_eq!(w.server.link_group_state(ls), Some(LgrState::Creating));
    assert_eq!(
        w.server.handshake_phase(t.s),
        Some(HandshakePhase::AwaitConfirm)
    );
    // client: the Accept connects its first link at once
    t.s2c.extend(w.server.clc_output(t.s));
    let n = w.client.clc_input(t.c, &t.s2c, w.now);
    t.s2c.drain(..n);
    let lc = w.client.link_group_of(t.c).unwrap();
    assert_eq!(w.client.link_group_state(lc), Some(LgrState::Confirming));
    assert_eq!(
        w.client.handshake_phase(t.c),
        Some(HandshakePhase::AwaitLink)
    );
    w.settle(&mut [&mut t], Duration::from_millis(2));
    assert_eq!(
        w.link_group_states(lc, ls),
        (LgrState::Active, LgrState::Active)
    );
    // no connection for the idle time: the server ends the group (§5.6), the
    // client follows on DELETE_LINK ALL
    w.client.release(t.c);
    w.server.release(t.s);
    w.settle(&mut [&mut t], Duration::from_millis(2));
    assert_eq!(
        w.link_group_states(lc, ls),
        (LgrState::Active, LgrState::Active)
    );
    w.now += Duration::from_secs(601);
    w.settle(&mut [&mut t], Duration::from_millis(1));
    assert_eq!(w.server.link_group_state(ls), None, "freed");
    assert_eq!(w.client.link_group_state(lc), None, "freed");
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (0, 0));
}

#[test]
fn a_second_connection_waits_for_the_first_contact_and_joins_its_group() {
    let mut w = World::two();
    let mut a = w.open();
    let mut b = w.open();
    let mut saw_wait = false;
    for _ in 0..200 {
        w.step(&mut [&mut a, &mut b]);
        saw_wait |= w.server.handshake_phase(b.s) == Some(HandshakePhase::AwaitLgr);
    }
    assert!(saw_wait, "the second Proposal waited for the first contact");
    for t in [&a, &b] {
        assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
        assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc));
    }
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (1, 1));
    assert_eq!(w.server.link_group_of(a.s), w.server.link_group_of(b.s));
    w.client.write(b.c, b"joined").unwrap();
    w.settle(&mut [&mut a, &mut b], Duration::from_millis(1));
    assert_eq!(w.server.read(b.s, 10).unwrap(), b"joined");
}

#[test]
fn a_waiting_connection_makes_its_own_first_contact_when_the_first_one_fails() {
    let mut w = World::two();
    let mut a = w.open();
    let mut b = w.open();
    // the first Accept reaches the client, whose device then stops answering:
    // CONFIRM_LINK never completes and the server's group dies
    for _ in 0..2 {
        w.step(&mut [&mut a, &mut b]);
    }
    assert_eq!(
        w.server.handshake_phase(b.s),
        Some(HandshakePhase::AwaitLgr)
    );
    w.fabric.set_unresponsive("simC", true).unwrap();
    // (2 s for CONFIRM_LINK, 0.5 s for a late Decline of the client's, then
    // the server's own, and 1 s for one that crossed it)
    for _ in 0..400 {
        w.step(&mut [&mut a]);
        w.now += Duration::from_millis(10);
    }
    w.fabric.set_unresponsive("simC", false).unwrap();
    assert!(matches!(
        w.server.status(a.s),
        Some(ConnStatus::Fallback { .. }) | Some(ConnStatus::Failed(_))
    ));
    // b goes on with its own first contact (before the client's 6 s run out)
    w.settle(&mut [&mut b], Duration::from_millis(3));
    assert_eq!(w.server.status(b.s), Some(ConnStatus::Smc));
    assert_eq!(w.client.status(b.c), Some(ConnStatus::Smc));
    w.client
        .close(b.c, CloseEvent::AppClose { unread_data: false });
    w.settle(&mut [&mut b], Duration::from_millis(1));
    assert!(w.server.peer_done(b.s));
}
