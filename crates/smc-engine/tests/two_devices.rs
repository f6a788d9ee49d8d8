//! Link redundancy over two devices per endpoint (`endpoint/devices.rs`) on
//! the sim fabric: with a second device on each side, the server's ADD_LINK
//! puts the group's second link on the second devices (its RMBs registered
//! there too, their rkeys and addresses there carried by ADD_LINK /
//! ADD_LINK_CONT and CONFIRM_RKEY), connections spread over both links, and
//! when one device's port goes down under load its connections fail over to
//! the link on the other device without losing a byte.

use smc_engine::endpoint::{ConnStatus, Endpoint, EndpointConfig};
use smc_engine::state::LgrState;
use smc_proto::link::{LgrType, Redundancy};
use smc_proto::negotiate::IfAddr;
use smc_rdma::sim::SimFabric;
use std::net::IpAddr;
use std::time::Duration;

mod common;

use common::{add_port_for, simple_config, Tcp, World};

fn config(dev: &str, inst: u16, last: u8, v2: bool) -> EndpointConfig {
    EndpointConfig {
        testlink: Some(Duration::from_secs(30)),
        offer_v2: v2,
        ..simple_config(dev, inst, last)
    }
}

/// The second device of an endpoint: another port, on 10.98.0.`last`.
fn second(dev: &str, last: u8) -> EndpointConfig {
    EndpointConfig {
        if_addrs: vec![IfAddr {
            addr: IpAddr::from([10, 98, 0, last]),
            prefix_len: 24,
        }],
        ..simple_config(dev, 0, last)
    }
}

fn world(v2: bool) -> World {
    let fabric = SimFabric::new(17);
    let cc = config("simC", 0x1111, 1, v2);
    let sc = config("simS", 0x2222, 2, v2);
    for c in [&cc, &sc, &second("simC2", 1), &second("simS2", 2)] {
        add_port_for(&fabric, c, true);
    }
    let client_ip = cc.if_addrs[0].addr;
    let server_ip = sc.if_addrs[0].addr;
    let mut client = Endpoint::new(&fabric, cc).unwrap();
    let mut server = Endpoint::new(&fabric, sc).unwrap();
    client.open_second_device(&fabric, "simC2").unwrap();
    server.open_second_device(&fabric, "simS2").unwrap();
    for ep in [&mut client, &mut server] {
        ep.set_redundancy(Redundancy {
            enabled: true,
            alternate: true,
        });
    }
    World {
        fabric,
        client,
        server,
        now: Duration::ZERO,
        client_ip,
        server_ip,
    }
}

fn smc(w: &mut World) -> Tcp {
    let t = w.handshake();
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc));
    t
}

fn byte(conn: usize, dir: usize, i: usize) -> u8 {
    ((i.wrapping_mul(2654435761) >> 11) as u8) ^ (conn as u8 * 31) ^ (dir as u8 * 0x5a)
}

/// Bulk data both ways on every connection, every byte checked; `at_step`
/// runs between rounds.
fn streams(w: &mut World, ts: &[&Tcp], len: usize, mut at_step: impl FnMut(&mut World, u64)) {
    let mut sent = vec![[0usize; 2]; ts.len()];
    let mut got = vec![[0usize; 2]; ts.len()];
    let mut steps = 0u64;
    loop {
        let mut busy = false;
        for (i, t) in ts.iter().enumerate() {
            for dir in 0..2 {
                let (tx, rx, tid, rid) = if dir == 0 {
                    (&mut w.client, &mut w.server, t.c, t.s)
                } else {
                    (&mut w.server, &mut w.client, t.s, t.c)
                };
                let at = sent[i][dir];
                if at < len {
                    let chunk: Vec<u8> =
                        (at..len.min(at + 5000)).map(|k| byte(i, dir, k)).collect();
                    sent[i][dir] += tx.write(tid, &chunk).unwrap();
                }
                let data = rx.read(rid, 7000).unwrap();
                for (k, b) in data.iter().enumerate() {
                    let off = got[i][dir] + k;
                    assert_eq!(*b, byte(i, dir, off), "conn {i} dir {dir}: byte {off}");
                }
                got[i][dir] += data.len();
                busy |= got[i][dir] < len;
            }
        }
        if !busy {
            return;
        }
        at_step(w, steps);
        w.tick();
        steps += 1;
        assert!(steps < 400_000, "stalled");
    }
}

#[test]
fn a_second_link_forms_on_the_second_devices_and_survives_a_port_failure() {
    // (v2 and v1; the client's second device fails, or the server's first)
    for (v2, fail) in [
        (true, "simC2"),
        (false, "simC2"),
        (true, "simS"),
        (false, "simS"),
    ] {
        let mut w = world(v2);
        let mut t0 = smc(&mut w);
        w.settle(&mut [&mut t0], Duration::from_millis(2));
        let lc = w.client.link_group_of(t0.c).unwrap();
        let ls = w.server.link_group_of(t0.s).unwrap();
        assert_eq!(w.client.usable_links(lc).len(), 2, "v2 {v2}");
        assert_eq!(w.server.usable_links(ls).len(), 2, "v2 {v2}");
        assert_eq!(w.server.link_group_type(ls), Some(LgrType::Symmetric));
        // one link on each device, on both sides
        for (ep, l) in [(&w.client, lc), (&w.server, ls)] {
            let mut on: Vec<bool> = ep
                .usable_links(l)
                .iter()
                .map(|&s| ep.link_on_second_device(l, s).unwrap())
                .collect();
            on.sort_unstable();
            assert_eq!(on, [false, true], "v2 {v2}");
        }
        // connections on both links (those on the second one announced by
        // CONFIRM_RKEY with their rkeys there, and accepted with them)
        let ts: Vec<Tcp> = (0..7).map(|_| smc(&mut w)).collect();
        let mut all: Vec<&Tcp> = ts.iter().collect();
        all.push(&t0);
        let on_second = |w: &World| {
            all.iter()
                .filter(|t| {
                    let s = w.server.link_of(t.s).unwrap();
                    w.server.link_on_second_device(ls, s) == Some(true)
                })
                .count()
        };
        let n2 = on_second(&w);
        assert!(n2 > 0 && n2 < all.len(), "spread: {n2} of {}", all.len());
        let fabric = w.fabric.clone();
        streams(&mut w, &all, 300_000, |_, step| {
            if step == 60 {
                fabric.set_port(fail, false).unwrap();
            }
        });
        for t in &all {
            assert!(w.client.violation(t.c).is_none() && w.server.violation(t.s).is_none());
            assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
        }
        assert_eq!(w.client.link_group_state(lc), Some(LgrState::Active));
        assert_eq!(w.server.link_group_state(ls), Some(LgrState::Active));
        // every connection left the failed device
        let failed_second = fail.ends_with('2');
        for t in &all {
            let (ep, l, id) = if fail.starts_with("simC") {
                (&w.client, lc, t.c)
            } else {
                (&w.server, ls, t.s)
            };
            let s = ep.link_of(id).unwrap();
            assert_ne!(
                ep.link_on_second_device(l, s),
                Some(failed_second),
                "{fail}"
            );
        }
        // three connections close: each side withdraws their RMBs with
        // DELETE_RKEY, by their rkeys on the link it runs on (which may be
        // on the second device now), and the peer forgets them
        assert_eq!(w.client.link_group_buffers(lc).unwrap().0, 8);
        assert_eq!(w.server.link_group_buffers(ls).unwrap().0, 8);
        for t in &ts[..3] {
            w.client.release(t.c);
            w.server.release(t.s);
        }
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        assert_eq!(w.client.link_group_buffers(lc).unwrap().0, 5, "{v2} {fail}");
        assert_eq!(w.server.link_group_buffers(ls).unwrap().0, 5, "{v2} {fail}");
        // the port comes back; new connections (on pooled buffers, announced
        // again) still carry data
        w.fabric.set_port(fail, true).unwrap();
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        let t = smc(&mut w);
        let t2 = smc(&mut w);
        streams(&mut w, &[&t, &t2, &t0, &ts[5]], 100_000, |_, _| {});
        // a link over the returned port again (replacing the asymmetric one
        // added after the loss), and the connections that were there before
        // spread back over both links, on both sides (issue 17)
        let old: Vec<&Tcp> = ts[3..].iter().chain([&t0]).collect();
        for (ep, l, client) in [(&w.client, lc, true), (&w.server, ls, false)] {
            let mut on: Vec<bool> = ep
                .usable_links(l)
                .iter()
                .map(|&s| ep.link_on_second_device(l, s).unwrap())
                .collect();
            on.sort_unstable();
            assert_eq!(on, [false, true], "v2 {v2} {fail}");
            let n2 = old
                .iter()
                .filter(|t| {
                    let id = if client { t.c } else { t.s };
                    let s = ep.link_of(id).unwrap();
                    ep.link_on_second_device(l, s) == Some(true)
                })
                .count();
            assert!(
                n2 > 0 && n2 < old.len(),
                "v2 {v2} {fail}: {n2} of {} on the second device",
                old.len()
            );
        }
    }
}

/// A client whose port comes up invites the server to add a link (Linux
/// smc_core.c `smcr_port_add` for either role; smc_llc.c
/// `smc_llc_cli_add_link_invite`: v2 REQ_ADD_LINK, v1 an ADD_LINK request),
/// and the server runs its ADD_LINK flow. Here the group is left with one
/// link because the client rejected the server's ADD_LINK after the first
/// contact (its redundancy was off then), so nothing else would make the
/// server try again; the client turns redundancy on, and its second
/// device's port goes down and comes back.
#[test]
fn a_client_port_coming_up_invites_the_server_to_add_a_link() {
    for v2 in [true, false] {
        let mut w = world(v2);
        w.client.set_redundancy(Redundancy::default());
        let mut t0 = smc(&mut w);
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        let lc = w.client.link_group_of(t0.c).unwrap();
        let ls = w.server.link_group_of(t0.s).unwrap();
        assert_eq!(w.server.usable_links(ls).len(), 1, "v2 {v2}: rejected");
        w.client.set_redundancy(Redundancy {
            enabled: true,
            alternate: true,
        });
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        assert_eq!(
            w.server.usable_links(ls).len(),
            1,
            "v2 {v2}: no trigger yet"
        );
        w.fabric.set_port("simC2", false).unwrap();
        w.settle(&mut [&mut t0], Duration::from_millis(2));
        w.fabric.set_port("simC2", true).unwrap();
        w.settle(&mut [&mut t0], Duration::from_millis(10));
        assert_eq!(w.client.usable_links(lc).len(), 2, "v2 {v2}");
        assert_eq!(w.server.usable_links(ls).len(), 2, "v2 {v2}");
        assert_eq!(
            w.server.link_group_type(ls),
            Some(LgrType::Symmetric),
            "v2 {v2}"
        );
        let t = smc(&mut w);
        streams(&mut w, &[&t, &t0], 50_000, |_, _| {});
    }
}

/// A simulation seed that found a two-device bug, 8018: a reused group's
/// Confirm named the client's link on its first device, whose port went
/// down before the server read the Confirm; the server put that device's
/// rkey into the column of the link the connection had moved to (on the
/// second device, where the rkey is another), and the client's RMB could
/// not be reached (the urgent byte, and the rest, never arrived). The CLC
/// rkey now goes into the column of the link the message names, or finds
/// the row of the peer's CONFIRM_RKEY (`Lgr::add_clc_rtoken`).
#[test]
fn two_device_simulation_seed_8018() {
    let seed = 8018;
    let r = smc_engine::simulate::run(seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    assert!(r.second_device && r.survivable_fault, "seed {seed}");
    assert_eq!(r.handshake_resets, 0, "seed {seed}: a connection was reset");
}

/// Whether the endpoint's wake-up descriptor is readable now.
fn readable(ep: &Endpoint<SimFabric>) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let fd = ep.notify_fd();
    let mut p = [PollFd::new(&fd, PollFlags::IN)];
    poll(&mut p, Some(&Timespec::default())).unwrap() > 0
}

/// The driver sleeps on one descriptor ([`Endpoint::notify_fd`]): with a
/// second device it must wake for the second device's completions (its CQs
/// are on that device's own channel, as verbs requires: the sim fabric, like
/// `ibv_create_cq`, refuses another device's channel) and for either
/// device's port events, which need no completion to happen (a port coming
/// back, or an rxe port going down, which leaves the QPs as they are). Once
/// the pump took them, the descriptor is quiet again (no busy loop).
#[test]
fn the_wake_descriptor_covers_both_devices_channels_and_port_events() {
    let mut w = world(true);
    let mut t0 = smc(&mut w);
    w.settle(&mut [&mut t0], Duration::from_millis(2));
    let lc = w.client.link_group_of(t0.c).unwrap();
    assert_eq!(w.client.usable_links(lc).len(), 2);
    // a connection on the link over the second devices
    let ts: Vec<Tcp> = (0..4).map(|_| smc(&mut w)).collect();
    let t2 = ts
        .iter()
        .find(|t| {
            let s = w.client.link_of(t.c).unwrap();
            w.client.link_on_second_device(lc, s) == Some(true)
        })
        .expect("a connection on the second device");
    // quiet, armed: nothing to wake for
    w.settle(&mut [&mut t0], Duration::from_millis(2));
    w.client.arm().unwrap();
    w.client.take_notification();
    assert!(
        !readable(&w.client),
        "an idle endpoint's descriptor is not readable"
    );
    // the server writes on the connection over the second devices: the
    // client's receive CQ there completes on the second device's channel
    assert!(w.server.write(t2.s, b"over the second device").unwrap() > 0);
    for _ in 0..50 {
        w.server.pump(w.now).unwrap();
        w.fabric.advance(Duration::from_micros(20));
        w.now += Duration::from_micros(20);
    }
    assert!(
        readable(&w.client),
        "a completion on the second device wakes"
    );
    assert!(w.client.take_notification());
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.read(t2.c, 100).unwrap(), b"over the second device");
    // a port event of the second device, then of the first: no completion,
    // still a wake-up; the pump takes the event and the descriptor is quiet
    // again
    for dev in ["simC2", "simC"] {
        w.fabric.set_port(dev, false).unwrap();
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        w.client.arm().unwrap();
        w.client.take_notification();
        assert!(!readable(&w.client), "{dev}: quiet after the failover");
        w.fabric.set_port(dev, true).unwrap();
        assert!(readable(&w.client), "{dev}: the port coming back wakes");
        w.client.pump(w.now).unwrap();
        // (what the pump posted may have completed on an armed CQ: a
        // notification, taken here; the device event is the pump's alone)
        w.client.take_notification();
        assert!(!readable(&w.client), "{dev}: the pump took the event");
        w.settle(&mut [&mut t0], Duration::from_millis(5));
    }
}

/// The kernel interop case redund.rk: the client's second device fails under
/// load, the connections on its link move to the first; then the client
/// closes every connection first (active close). The server must see each
/// close, also of the connections that moved.
#[test]
fn closes_after_a_failover_reach_the_peer() {
    for rxe in [false, true] {
        closes_after_a_failover(rxe);
    }
}

/// (`rxe`: the port goes down as on Soft-RoCE, its QPs neither flushed nor
/// failing, every device retrying unanswered requests forever)
fn closes_after_a_failover(rxe: bool) {
    let mut w = world(true);
    if rxe {
        for d in ["simC", "simC2", "simS", "simS2"] {
            w.fabric.set_rxe_retry(d, true).unwrap();
        }
    }
    let mut t0 = smc(&mut w);
    w.settle(&mut [&mut t0], Duration::from_millis(2));
    let lc = w.client.link_group_of(t0.c).unwrap();
    let ts: Vec<Tcp> = (0..4).map(|_| smc(&mut w)).collect();
    let all: Vec<&Tcp> = ts.iter().collect();
    let moved: Vec<bool> = all
        .iter()
        .map(|t| {
            let s = w.client.link_of(t.c).unwrap();
            w.client.link_on_second_device(lc, s) == Some(true)
        })
        .collect();
    assert!(
        moved.iter().any(|&m| m),
        "a connection on the second device"
    );
    let fabric = w.fabric.clone();
    streams(&mut w, &all, 1_000_000, |_, step| {
        if step == 60 && rxe {
            fabric.set_port_keep_qps("simC2", false).unwrap();
        } else if step == 60 {
            fabric.set_port("simC2", false).unwrap();
        }
    });
    // (the connections did leave the failed device)
    for t in &all {
        let s = w.client.link_of(t.c).unwrap();
        assert_eq!(
            w.client.link_on_second_device(lc, s),
            Some(false),
            "rxe {rxe}"
        );
    }
    for t in &all {
        w.client.close(
            t.c,
            smc_proto::close::CloseEvent::AppClose { unread_data: false },
        );
    }
    w.settle(&mut [&mut t0], Duration::from_millis(50));
    for (i, t) in all.iter().enumerate() {
        assert!(
            w.server.peer_done(t.s) || w.server.peer_closed(t.s),
            "rxe {rxe}: connection {i} (moved: {}): the server never saw the client's close",
            moved[i]
        );
    }
}

/// Links per device of group `l` of `ep`: (on the first, on the second).
fn per_device(ep: &Endpoint<SimFabric>, l: smc_engine::endpoint::LgrId) -> (usize, usize) {
    let on: Vec<bool> = ep
        .usable_links(l)
        .iter()
        .map(|&s| ep.link_on_second_device(l, s).unwrap())
        .collect();
    let second = on.iter().filter(|&&b| b).count();
    (on.len() - second, second)
}

/// A port that comes back while its link group is idle (no data, no LLC
/// message on its links, no timer due for long: the keepalive is 30 s
/// away) gets its link back at once. A pump skips a group whose links have
/// nothing to poll (`Endpoint::pump`); the port event changes the group
/// (the asymmetric link to replace, the client's invitation, the server's
/// wish for a link), and what that produces must go out in the same pump,
/// not wait for the group's next timer. Cases: one side's second port, or
/// both (a cable between them, as a veth pair taken down).
#[test]
fn a_port_coming_back_to_an_idle_group_gets_its_link_back_at_once() {
    for (v2, devs) in [
        (true, &["simC2"][..]),
        (false, &["simC2"][..]),
        (true, &["simS2"][..]),
        (true, &["simC2", "simS2"][..]),
    ] {
        let mut w = world(v2);
        let mut t0 = smc(&mut w);
        w.settle(&mut [&mut t0], Duration::from_millis(5));
        let lc = w.client.link_group_of(t0.c).unwrap();
        let ls = w.server.link_group_of(t0.s).unwrap();
        let both = |w: &World| (per_device(&w.client, lc), per_device(&w.server, ls));
        assert_eq!(both(&w), ((1, 1), (1, 1)), "v2 {v2} {devs:?}");
        for d in devs {
            w.fabric.set_port(d, false).unwrap();
        }
        // the failover and a second link over the ports left, then a
        // second of nothing
        for _ in 0..50_000 {
            w.tick();
        }
        let (c, s) = both(&w);
        assert_eq!(c.0 + c.1, 2, "v2 {v2} {devs:?}: client {c:?}");
        assert_eq!(s.0 + s.1, 2, "v2 {v2} {devs:?}: server {s:?}");
        assert_ne!((c, s), ((1, 1), (1, 1)), "v2 {v2} {devs:?}");
        for d in devs {
            w.fabric.set_port(d, true).unwrap();
        }
        let up = w.now;
        while w.now < up + Duration::from_secs(1) && both(&w) != ((1, 1), (1, 1)) {
            w.tick();
        }
        assert_eq!(
            both(&w),
            ((1, 1), (1, 1)),
            "v2 {v2} {devs:?}: a link on each device again within 1 s of the port"
        );
        // and the connection still carries data
        streams(&mut w, &[&t0], 20_000, |_, _| {});
    }
}

/// Link events say which device their link is on (the socket library's log
/// names that device, not the endpoint's first): the second link's up,
/// its down when the second device's port goes, and the connections moved
/// from it to the first device's link.
#[test]
fn link_events_name_the_device_of_their_link() {
    use smc_engine::endpoint::EngineEvent;
    let mut w = world(true);
    assert_eq!(w.client.second_device_name(), Some("simC2"));
    let mut t0 = smc(&mut w);
    w.settle(&mut [&mut t0], Duration::from_millis(2));
    let lc = w.client.link_group_of(t0.c).unwrap();
    let ts: Vec<Tcp> = (0..5).map(|_| smc(&mut w)).collect();
    let mut ups = Vec::new();
    while let Some(e) = w.client.poll_event() {
        if let EngineEvent::LinkUp {
            lgr, slot, second, ..
        } = e
        {
            assert_eq!(w.client.link_on_second_device(lgr, slot), Some(second));
            ups.push(second);
        }
    }
    ups.sort_unstable();
    assert_eq!(ups, [false, true]);
    let mut all: Vec<&Tcp> = ts.iter().collect();
    all.push(&t0);
    let fabric = w.fabric.clone();
    streams(&mut w, &all, 300_000, |_, step| {
        if step == 60 {
            fabric.set_port("simC2", false).unwrap();
        }
    });
    let (mut down, mut moved) = (Vec::new(), Vec::new());
    while let Some(e) = w.client.poll_event() {
        match e {
            EngineEvent::LinkDown { lgr, second, .. } if lgr == lc => down.push(second),
            EngineEvent::ConnMoved {
                from_second,
                to_second,
                ..
            } => moved.push((from_second, to_second)),
            _ => {}
        }
    }
    assert_eq!(down, [true], "the second device's link went down");
    assert!(!moved.is_empty());
    assert!(moved.iter().all(|&m| m == (true, false)), "{moved:?}");
}

/// A new connection of a group with a link on each device is on its way
/// through CLC: the client sent its Confirm (it counts itself established,
/// its RMB announced by CONFIRM_RKEY on both links) when the link the
/// connection is on fails, the client's QP (it deletes the link, DELETE_LINK)
/// or the server's, before the Confirm reaches the server. The Confirm names
/// the client's RMB by its rkey on that link (§1.11), which the server no
/// longer has a column for; the server must still find the RMB's row, whose
/// rkey on the surviving link CONFIRM_RKEY gave, move the connection there
/// (as Linux's `smc_switch_conns` does, smc_core.c) and carry data. It used
/// to put the rkey of the gone link into the surviving link's column, fail
/// to ready the client's RMB there and abort the connection, which the
/// client, established, saw as a reset (simulation seeds 115214, 125409).
#[test]
fn a_link_lost_while_the_clients_confirm_is_on_its_way_takes_the_connection_along() {
    for (v2, client_qp) in [(true, true), (true, false), (false, true), (false, false)] {
        let case = format!(
            "v2 {v2}, the {} QP",
            if client_qp { "client's" } else { "server's" }
        );
        let mut w = world(v2);
        let mut t0 = smc(&mut w);
        w.settle(&mut [&mut t0], Duration::from_millis(2));
        let lc = w.client.link_group_of(t0.c).unwrap();
        let ls = w.server.link_group_of(t0.s).unwrap();
        assert_eq!(w.server.usable_links(ls).len(), 2, "{case}");
        // the handshake runs until the client's Confirm is out; the server
        // does not get it yet
        let mut t = w.open();
        let held = w.hold_confirm(&mut t);
        assert_eq!(
            w.server.handshake_phase(t.s),
            Some(smc_engine::state::HandshakePhase::AwaitConfirm),
            "{case}"
        );
        // its link fails (no CLC byte moves meanwhile)
        let slot_c = w.client.link_of(t.c).unwrap();
        let slot_s = w.server.link_of(t.s).unwrap();
        let server_qp = w.server.link_qp_num(ls, slot_s);
        let qp = if client_qp {
            w.client.link_qp_num(lc, slot_c)
        } else {
            server_qp
        };
        w.fabric.fail_qp(qp.unwrap());
        // (until the server took the link down: a new link could come up
        // on the same device, which knows the rkeys of the old one)
        for _ in 0..100 {
            if w.server.link_qp_num(ls, slot_s) != server_qp {
                break;
            }
            w.tick();
        }
        assert_ne!(
            w.server.link_qp_num(ls, slot_s),
            server_qp,
            "{case}: the link is gone on the server"
        );
        // now the Confirm arrives
        t.c2s.extend(held);
        w.settle(&mut [&mut t, &mut t0], Duration::from_millis(2));
        assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc), "{case}");
        assert_ne!(w.server.link_of(t.s), Some(slot_s), "{case}: moved");
        streams(&mut w, &[&t, &t0], 200_000, |_, _| {});
        for x in [&t, &t0] {
            assert!(w.client.violation(x.c).is_none(), "{case}");
            assert!(w.server.violation(x.s).is_none(), "{case}");
            assert_eq!(w.client.status(x.c), Some(ConnStatus::Smc), "{case}");
            assert_eq!(w.server.status(x.s), Some(ConnStatus::Smc), "{case}");
        }
    }
}

/// As above, but the server takes the client's Confirm before it knows
/// that the client's QP of the connection's link failed and is gone (its
/// own QP there is fine until the client's DELETE_LINK or its next send
/// says otherwise): the Confirm names the client's RMB by its rkey on that
/// link, which the server has, but the fabric cannot ready the RMB over a
/// QP whose peer is gone. The connection, established, must send on the group's other link,
/// where the client's CONFIRM_RKEY gave the rkey, rather than be aborted
/// (the client would see a reset; simulation seed 254407).
#[test]
fn a_confirm_taken_before_the_server_knows_its_peers_qp_failed_sends_on_the_other_link() {
    for v2 in [true, false] {
        let case = format!("v2 {v2}");
        let mut w = world(v2);
        let mut t0 = smc(&mut w);
        w.settle(&mut [&mut t0], Duration::from_millis(2));
        let lc = w.client.link_group_of(t0.c).unwrap();
        let ls = w.server.link_group_of(t0.s).unwrap();
        assert_eq!(w.server.usable_links(ls).len(), 2, "{case}");
        let mut t = w.open();
        let held = w.hold_confirm(&mut t);
        let slot_c = w.client.link_of(t.c).unwrap();
        let slot_s = w.server.link_of(t.s).unwrap();
        let client_qp = w.client.link_qp_num(lc, slot_c);
        w.fabric.fail_qp(client_qp.unwrap());
        // the client takes its link down (its QP destroyed, DELETE_LINK on
        // its way over the other link); the server does not run meanwhile
        for _ in 0..100 {
            if w.client.link_qp_num(lc, slot_c) != client_qp {
                break;
            }
            w.client.pump(w.now).unwrap();
            w.fabric.advance(Duration::from_micros(20));
            w.now += Duration::from_micros(20);
        }
        assert_ne!(
            w.client.link_qp_num(lc, slot_c),
            client_qp,
            "{case}: the link is gone on the client"
        );
        // then the Confirm, before anything else of the client's
        let n = w.server.clc_input(t.s, &held, w.now);
        assert_eq!(n, held.len(), "{case}: the whole Confirm taken");
        assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc), "{case}");
        assert_ne!(
            w.server.link_of(t.s),
            Some(slot_s),
            "{case}: it sends on the other link"
        );
        w.settle(&mut [&mut t, &mut t0], Duration::from_millis(2));
        streams(&mut w, &[&t, &t0], 200_000, |_, _| {});
        for x in [&t, &t0] {
            assert!(w.client.violation(x.c).is_none(), "{case}");
            assert!(w.server.violation(x.s).is_none(), "{case}");
            assert_eq!(w.client.status(x.c), Some(ConnStatus::Smc), "{case}");
            assert_eq!(w.server.status(x.s), Some(ConnStatus::Smc), "{case}");
        }
    }
}
