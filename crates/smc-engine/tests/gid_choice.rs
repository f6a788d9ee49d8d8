//! The GID a connection uses, per version and per connection, as Linux
//! chooses it (`smc_ib.c` `smc_ib_determine_gid`): for SMC-R v2 the RoCE v2
//! GID that is the IPv4-mapped local address of the connection, in the
//! Proposal, the Accept, the Confirm and its GID list, and as the QPs'
//! source GID; no SMC-R v1 on a port without RoCE v1 GIDs (rxe); no SMC-R
//! v2 over IPv6. Two endpoints over sim ports built like rxe's (RoCE v2
//! GIDs only: the link-local one, then `::ffff:a.b.c.d`), whose responders
//! drop packets from any other source GID than the one the peer announced.

mod common;

use common::*;
use smc_engine::endpoint::ConnStatus;
use smc_proto::negotiate::IfAddr;
use smc_wire::clc::{ClcMessage, DeclineCode, SmcPath};
use smc_wire::types::Gid;
use std::net::IpAddr;
use std::time::Duration;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Client 10.99.0.1, server 10.99.0.2, both over rxe-like ports.
fn rxe_world() -> World {
    World::with_ports(
        9,
        simple_config("simC", 0x1111, 1),
        simple_config("simS", 0x2222, 2),
        false,
    )
}

/// Delivers CLC bytes both ways once, keeping copies; pumps both.
fn exchange(w: &mut World, t: &mut Tcp, log: &mut Vec<ClcMessage>) {
    let c = w.client.clc_output(t.c);
    let s = w.server.clc_output(t.s);
    for bytes in [&c, &s] {
        let mut at = 0;
        while at < bytes.len() {
            let len = usize::from(u16::from_be_bytes([bytes[at + 5], bytes[at + 6]]));
            log.push(ClcMessage::decode(&bytes[at..at + len]).unwrap());
            at += len;
        }
    }
    t.c2s.extend(c);
    t.s2c.extend(s);
    let n = w.server.clc_input(t.s, &t.c2s, w.now);
    t.c2s.drain(..n);
    let n = w.client.clc_input(t.c, &t.s2c, w.now);
    t.s2c.drain(..n);
    w.tick();
}

fn run(w: &mut World, t: &mut Tcp, d: Duration) -> Vec<ClcMessage> {
    let mut log = Vec::new();
    let end = w.now + d;
    while w.now < end {
        exchange(w, t, &mut log);
    }
    log
}

#[test]
fn smc_r_v2_uses_the_ipv4_mapped_gid_of_the_connection_everywhere() {
    let mut w = rxe_world();
    let mut t = w.open();
    let log = run(&mut w, &mut t, Duration::from_millis(3));
    let (cgid, sgid) = (Gid::from_ip(ip("10.99.0.1")), Gid::from_ip(ip("10.99.0.2")));
    let ClcMessage::Proposal(p) = &log[0] else {
        panic!("{log:?}")
    };
    // rxe has no RoCE v1 GID: v1 is not offered (as the kernel's Proposal)
    assert_eq!((p.typev1, p.typev2), (SmcPath::N, SmcPath::R));
    assert_eq!(p.v2_ext.as_ref().unwrap().roce_v2_gid, cgid);
    let ClcMessage::Accept(a) = &log[1] else {
        panic!("{log:?}")
    };
    assert_eq!((a.version, a.gid), (2, sgid));
    let ClcMessage::Confirm(c) = &log[2] else {
        panic!("{log:?}")
    };
    assert_eq!(c.gid, cgid);
    assert_eq!(c.gid_list.as_deref(), Some(&[cgid][..]));
    // the QPs send from the GIDs announced: the link comes up
    assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
    assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc));
    assert_eq!(w.client.write(t.c, b"over ::ffff:10.99.0.1"), Ok(21));
    run(&mut w, &mut t, Duration::from_millis(1));
    assert_eq!(w.server.read(t.s, 64).unwrap(), b"over ::ffff:10.99.0.1");
}

#[test]
fn no_smc_r_v2_over_ipv6_on_either_side() {
    let mut w = rxe_world();
    // the client on an IPv6 connection has nothing to propose over rxe: no
    // v1 GID, no v2 over IPv6 (Linux 6.12 declined NOSMCDEV, RESULTS v6)
    let c = w.client.connect(ip("fd00::1"), w.now);
    let ClcMessage::Decline(d) = ClcMessage::decode(&w.client.clc_output(c)).unwrap() else {
        panic!("a Decline")
    };
    assert_eq!(d.diagnosis, DeclineCode::NoSmcDev);
    // an IPv4-mapped address is an IPv4 connection on the wire: v2
    let c = w.client.connect(ip("::ffff:10.99.0.1"), w.now);
    let ClcMessage::Proposal(p) = ClcMessage::decode(&w.client.clc_output(c)).unwrap() else {
        panic!("a Proposal")
    };
    assert_eq!(p.v2_ext.unwrap().roce_v2_gid, Gid::from_ip(ip("10.99.0.1")));
    // a server on an IPv6 connection gets an IPv4 client's v2 Proposal:
    // NOSMCRDEV, as the Linux 6.12 server in the lab (RESULTS v2)
    let proposal = {
        let c = w.client.connect(ip("10.99.0.1"), w.now);
        w.client.clc_output(c)
    };
    let s = w.server.accept(ip("fd00::2"), w.now);
    w.server.clc_input(s, &proposal, w.now);
    let ClcMessage::Decline(d) = ClcMessage::decode(&w.server.clc_output(s)).unwrap() else {
        panic!("a Decline")
    };
    assert_eq!(d.diagnosis, DeclineCode::NoSmcRDev);
    assert_eq!(w.server.link_groups(), 0);
}

#[test]
fn a_link_group_keeps_its_gid_and_connections_from_another_address_get_their_own() {
    let addr = |a: &str| IfAddr {
        addr: ip(a),
        prefix_len: 24,
    };
    let mut ccfg = simple_config("simC", 0x1111, 1);
    ccfg.if_addrs = vec![addr("10.99.0.1"), addr("10.99.0.11")];
    let mut w = World::with_ports(9, ccfg, simple_config("simS", 0x2222, 2), false);
    let server_ip = w.server_ip;
    let mut first = w.open_between(ip("10.99.0.1"), server_ip);
    run(&mut w, &mut first, Duration::from_millis(3));
    // the same address joins the group
    let mut again = w.open_between(ip("10.99.0.1"), server_ip);
    let log = run(&mut w, &mut again, Duration::from_millis(3));
    assert!(matches!(&log[1], ClcMessage::Accept(a) if !a.first_contact));
    assert_eq!(w.client.link_groups(), 1);
    // another address has another GID: a group of its own, whose link
    // sends from that GID
    let mut other = w.open_between(ip("10.99.0.11"), server_ip);
    let log = run(&mut w, &mut other, Duration::from_millis(3));
    let ClcMessage::Proposal(p) = &log[0] else {
        panic!("{log:?}")
    };
    assert_eq!(
        p.v2_ext.as_ref().unwrap().roce_v2_gid,
        Gid::from_ip(ip("10.99.0.11"))
    );
    assert!(matches!(&log[1], ClcMessage::Accept(a) if a.first_contact));
    let ClcMessage::Confirm(c) = &log[2] else {
        panic!("{log:?}")
    };
    assert_eq!(c.gid, Gid::from_ip(ip("10.99.0.11")));
    assert_eq!((w.client.link_groups(), w.server.link_groups()), (2, 2));
    for t in [&first, &again, &other] {
        assert_eq!(w.client.status(t.c), Some(ConnStatus::Smc));
        assert_eq!(w.server.status(t.s), Some(ConnStatus::Smc));
    }
    assert_ne!(
        w.client.link_group_of(first.c),
        w.client.link_group_of(other.c)
    );
    assert_eq!(w.client.write(other.c, b"x"), Ok(1));
    run(&mut w, &mut other, Duration::from_millis(1));
    assert_eq!(w.server.read(other.s, 8).unwrap(), b"x");
}
