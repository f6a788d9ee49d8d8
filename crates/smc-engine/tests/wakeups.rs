//! What wakes a driver that sleeps on the endpoint's completion channel
//! (`Endpoint::arm`, then `notify_fd`): the peer's messages always; a send
//! completion only when something waits for one (a full send buffer, a
//! close), not the completion of the message a reader just sent.

mod common;

use common::*;
use smc_engine::endpoint::Endpoint;
use smc_proto::Timestamp;
use smc_rdma::sim::SimFabric;
use std::time::Duration;

/// A driver about to sleep: arm, then look once more (nothing is missed
/// between the look and the sleep).
fn arm(ep: &mut Endpoint<SimFabric>, now: Timestamp) {
    ep.take_notification();
    ep.arm().unwrap();
    ep.pump(now).unwrap();
}

/// Simulated time passes while both endpoints sleep (nobody pumps).
fn sleep(w: &mut World, d: Duration) {
    w.fabric.advance(d);
    w.now += d;
}

fn established() -> (World, Tcp) {
    let mut w = World::default();
    let mut t = w.handshake();
    w.settle(&mut [&mut t], Duration::from_millis(5));
    assert_eq!(
        w.client.close_state(t.c),
        Some(smc_proto::close::CloseState::Active)
    );
    (w, t)
}

/// Fills connection `id`'s send buffer (the peer does not read).
fn fill(ep: &mut Endpoint<SimFabric>, id: smc_engine::endpoint::ConnId) -> usize {
    let data = vec![0x5a; 64 * 1024];
    let mut n = 0;
    loop {
        let k = ep.write(id, &data).unwrap();
        ep.flush(id).unwrap();
        if k == 0 {
            return n;
        }
        n += k;
    }
}

/// The server closes connection `t` and the client has seen it.
fn server_closes_first(w: &mut World, t: &mut Tcp) {
    w.server.release(t.s);
    w.settle(&mut [t], Duration::from_millis(2));
    assert!(w.client.peer_closed(t.c));
}

/// The client closes connection `t`: its close CDC is posted.
fn client_closes(w: &mut World, t: &Tcp) {
    w.client.release(t.c);
    w.client.flush(t.c).unwrap();
    assert!(w.client.sent_close_flags(t.c).is_some_and(|f| f.any()));
}

#[test]
fn a_reader_is_not_woken_by_the_completion_of_its_own_message() {
    let (mut w, t) = established();
    assert_eq!(w.client.write(t.c, &[7; 64]).unwrap(), 64);
    w.client.flush(t.c).unwrap();
    // the client waits for the answer; its CDC arrives and completes
    arm(&mut w.client, w.now);
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        !w.client.take_notification(),
        "woken by its own CDC's send completion"
    );
    // the answer wakes it
    w.server.pump(w.now).unwrap();
    let got = w.server.read(t.s, 64).unwrap();
    assert_eq!(got, [7; 64]);
    assert_eq!(w.server.write(t.s, &got).unwrap(), 64);
    w.server.flush(t.s).unwrap();
    sleep(&mut w, Duration::from_millis(1));
    assert!(w.client.take_notification(), "the answer must wake it");
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.read(t.c, 64).unwrap(), [7; 64]);
}

#[test]
fn a_writer_with_a_full_send_buffer_is_woken_by_the_completion_that_frees_it() {
    let (mut w, t) = established();
    assert!(fill(&mut w.client, t.c) > 0);
    arm(&mut w.client, w.now);
    assert_eq!(w.client.write(t.c, &[1; 4096]).unwrap(), 0, "still full");
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        w.client.take_notification(),
        "the send completion that frees the buffer must wake the writer"
    );
    w.client.pump(w.now).unwrap();
    assert!(w.client.write(t.c, &[1; 4096]).unwrap() > 0);
}

/// The side that closes first is not woken when the peer takes its close
/// CDC: that completion cannot free the connection, which waits for the
/// peer's close; the peer's close wakes it, and the connection is freed.
#[test]
fn a_first_close_sleeps_until_the_peers_close_then_is_freed() {
    let (mut w, t) = established();
    client_closes(&mut w, &t);
    arm(&mut w.client, w.now);
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        !w.client.take_notification(),
        "woken by its close CDC's completion, which frees nothing before the peer's close"
    );
    w.server.pump(w.now).unwrap();
    w.server.release(t.s);
    w.server.flush(t.s).unwrap();
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        w.client.take_notification(),
        "the peer's close must wake it"
    );
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.status(t.c), None, "the connection must be freed");
}

/// The side that closes second waits for nothing but its close CDC's
/// completion, to free the connection: the driver is not woken for it but
/// looks by itself soon after (`REAP_AFTER`, 10 ms), for every connection
/// that closed meanwhile, and frees it then.
#[test]
fn a_second_close_is_freed_by_a_look_soon_after_not_by_a_wake_up() {
    let (mut w, mut t) = established();
    server_closes_first(&mut w, &mut t);
    client_closes(&mut w, &t);
    arm(&mut w.client, w.now);
    assert!(
        w.client.status(t.c).is_some(),
        "freed before its CDC completed"
    );
    let armed_at = w.now;
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        !w.client.take_notification(),
        "woken by the completion of a finished connection's close CDC"
    );
    assert_eq!(w.client.status(t.c).map(|_| ()), Some(()));
    let look = w
        .client
        .poll_timeout()
        .expect("a look at the send CQ is due");
    assert!(
        look <= armed_at + Duration::from_millis(10),
        "the look comes {:?} after the arm",
        look.saturating_sub(armed_at)
    );
    sleep(&mut w, Duration::from_millis(10));
    w.client.handle_timeout(w.now).unwrap();
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.status(t.c), None, "the connection must be freed");
    assert!(
        w.client
            .poll_timeout()
            .is_none_or(|t| t > w.now + Duration::from_secs(1)),
        "nothing left to look at soon"
    );
}

/// A look that finds a finished connection's close CDC still in flight (a
/// peer slow to take it) is not repeated every 10 ms: the driver arms for
/// the completion instead, and it wakes the driver when it comes.
#[test]
fn a_close_cdc_still_in_flight_at_the_look_is_armed_for_not_looked_at_again() {
    let (mut w, mut t) = established();
    server_closes_first(&mut w, &mut t);
    // (its close CDC completes 80 ms from now at the earliest)
    w.fabric
        .set_latency(Duration::from_millis(40), Duration::ZERO);
    client_closes(&mut w, &t);
    arm(&mut w.client, w.now);
    sleep(&mut w, Duration::from_millis(10));
    w.client.handle_timeout(w.now).unwrap();
    assert!(
        w.client.status(t.c).is_some(),
        "freed before its CDC completed"
    );
    arm(&mut w.client, w.now);
    assert!(
        w.client
            .poll_timeout()
            .is_none_or(|d| d > w.now + Duration::from_millis(10)),
        "another look is due in 10 ms where the completion is armed for"
    );
    assert!(!w.client.take_notification());
    sleep(&mut w, Duration::from_millis(100));
    assert!(
        w.client.take_notification(),
        "the close CDC's completion must wake the driver"
    );
    w.client.pump(w.now).unwrap();
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.status(t.c), None, "the connection must be freed");
}

/// In a group of 64 connections or more a finished connection's close CDC
/// wakes the driver again: finished connections count against the group's
/// 255 until they are freed, and a group filled with them faster than the
/// looks free them would send new connections to a new group.
#[test]
fn in_a_crowded_group_a_second_close_is_woken_by_its_completion_again() {
    let (mut w, mut t) = established();
    let mut others: Vec<Tcp> = (0..63).map(|_| w.handshake()).collect();
    let mut refs: Vec<&mut Tcp> = others.iter_mut().collect();
    w.settle(&mut refs, Duration::from_millis(5));
    assert!(others.iter().all(|o| w.client.status(o.c).is_some()));
    server_closes_first(&mut w, &mut t);
    client_closes(&mut w, &t);
    arm(&mut w.client, w.now);
    sleep(&mut w, Duration::from_millis(1));
    assert!(
        w.client.take_notification(),
        "with 64 connections in the group the close CDC's completion must wake the driver"
    );
    w.client.pump(w.now).unwrap();
    w.client.pump(w.now).unwrap();
    assert_eq!(w.client.status(t.c), None, "the connection must be freed");
}

/// A driver sleeps armed for a reader (receive only); another caller then
/// fills a send buffer: `arm_sends` arms the send CQ, whose completion
/// wakes the sleeper; with nothing new to wait for it arms nothing.
#[test]
fn what_starts_waiting_while_a_driver_sleeps_is_armed_by_arm_sends() {
    let (mut w, t) = established();
    assert_eq!(w.client.write(t.c, &[7; 64]).unwrap(), 64);
    w.client.flush(t.c).unwrap();
    arm(&mut w.client, w.now);
    assert!(
        !w.client.arm_sends().unwrap(),
        "nothing waits for a send completion"
    );
    assert!(fill(&mut w.client, t.c) > 0);
    assert!(
        w.client.arm_sends().unwrap(),
        "the full send buffer waits for one"
    );
    assert!(!w.client.arm_sends().unwrap(), "armed already");
    w.client.pump(w.now).unwrap();
    sleep(&mut w, Duration::from_millis(1));
    assert!(w.client.take_notification());
}

/// The client's side of the echo below: writes what is left, reads the
/// echo, releases the connection once all of it came back.
struct Client {
    sent: usize,
    back: Vec<u8>,
    released: bool,
}

/// The server's side: reads, writes it back, releases the connection once
/// the client closed and everything went back.
struct Server {
    pending: Vec<u8>,
    released: bool,
}

/// Echo of 100 kB on each of four connections, then close, driven as a
/// sleeping driver does it: an endpoint runs (pump, then its application's
/// calls) only when its descriptor was signalled or its next deadline came;
/// before it sleeps it arms and looks once more (a pump; what it took
/// means another round). Everything arrives and every connection is freed
/// on both sides within a second of simulated time, before any of the
/// engine's timers (a close's 2 s wait for unsent data) could have stood in
/// for a wake-up: nothing waited for a send completion that was not armed.
#[test]
fn a_sleeping_driver_is_woken_for_everything_an_echo_and_its_close_need() {
    const CONNS: usize = 4;
    const LEN: usize = 100_000;
    let mut w = World::default();
    let mut ts: Vec<Tcp> = (0..CONNS).map(|_| w.open()).collect();
    {
        let mut refs: Vec<&mut Tcp> = ts.iter_mut().collect();
        w.settle(&mut refs, Duration::from_millis(5));
    }
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let mut cs: Vec<Client> = (0..CONNS)
        .map(|_| Client {
            sent: 0,
            back: Vec::new(),
            released: false,
        })
        .collect();
    let mut ss: Vec<Server> = (0..CONNS)
        .map(|_| Server {
            pending: Vec::new(),
            released: false,
        })
        .collect();
    let client_app = |ep: &mut Endpoint<SimFabric>, cs: &mut [Client]| {
        for (t, c) in ts.iter().zip(cs.iter_mut()) {
            if c.released {
                continue;
            }
            if c.sent < LEN {
                c.sent += ep.write(t.c, &data[c.sent..]).unwrap();
            }
            ep.flush(t.c).unwrap();
            c.back.extend(ep.read(t.c, LEN).unwrap());
            ep.flush(t.c).unwrap();
            if c.back.len() == LEN {
                ep.release(t.c);
                c.released = true;
            }
        }
    };
    let server_app = |ep: &mut Endpoint<SimFabric>, ss: &mut [Server]| {
        for (t, s) in ts.iter().zip(ss.iter_mut()) {
            if s.released {
                continue;
            }
            s.pending.extend(ep.read(t.s, LEN).unwrap());
            if !s.pending.is_empty() {
                let n = ep.write(t.s, &s.pending).unwrap();
                s.pending.drain(..n);
            }
            ep.flush(t.s).unwrap();
            if s.pending.is_empty() && ep.peer_done(t.s) {
                ep.release(t.s);
                s.released = true;
            }
        }
    };
    let mut first = true;
    let end = w.now + Duration::from_secs(1);
    while w.now < end {
        let now = w.now;
        for client in [true, false] {
            let ep = if client { &mut w.client } else { &mut w.server };
            let woken = ep.take_notification() || ep.poll_timeout().is_some_and(|t| t <= now);
            if !(woken || first) {
                continue;
            }
            loop {
                ep.pump(now).unwrap();
                if client {
                    client_app(ep, &mut cs);
                } else {
                    server_app(ep, &mut ss);
                }
                let seen = ep.completions();
                ep.arm().unwrap();
                ep.pump(now).unwrap();
                if ep.completions() == seen {
                    break;
                }
            }
        }
        first = false;
        if w.client.connections() == 0 && w.server.connections() == 0 {
            break;
        }
        sleep(&mut w, Duration::from_micros(50));
    }
    for c in &cs {
        assert_eq!(c.back.len(), LEN);
        assert!(c.back == data, "the echo differs");
    }
    assert_eq!(
        (w.client.connections(), w.server.connections()),
        (0, 0),
        "every connection freed (a close waits for its CDCs' completions)"
    );
}

/// A link made while a driver sleeps (a first contact's, whose peer sends
/// CONFIRM_LINK on it next) has a receive CQ that driver's arm never saw:
/// `arm_new_links` arms it, once.
#[test]
fn a_link_made_while_the_driver_sleeps_is_armed_by_arm_new_links() {
    let mut w = World::default();
    let now = w.now;
    arm(&mut w.client, now);
    assert!(!w.client.arm_new_links().unwrap(), "no link yet");
    let mut t = w.open();
    while w.client.link_groups() == 0 {
        w.step(&mut [&mut t]);
    }
    assert!(
        w.client.arm_new_links().unwrap(),
        "the new link's receive CQ was left unarmed"
    );
    assert!(!w.client.arm_new_links().unwrap(), "armed once");
    w.settle(&mut [&mut t], Duration::from_millis(5));
    assert!(!w.client.arm_new_links().unwrap());
}
