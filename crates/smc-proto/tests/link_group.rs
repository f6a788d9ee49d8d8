//! Link-group LLC behaviour, checked byte for byte against what the Linux 6.12
//! kernels sent each other in the capture (`../shared/lab/captures`), and in a
//! pair of our own link groups talking to each other.

use smc_proto::link::*;
use smc_proto::Timestamp;
use smc_wire::llc::{self, LlcMessage, LlcVersion};
use smc_wire::types::{Gid, IbMtu, Mac};
use std::net::Ipv4Addr;
use std::time::Duration;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// SEND payloads of the main capture by frame number.
fn frame(n: u64) -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../smc-wire/tests/vectors/smcr-v2-kernel-6.12.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let m = v["sends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["frame"] == n)
        .unwrap();
    hex(m["hex"].as_str().unwrap())
}

fn port(last: u8) -> LocalPort {
    LocalPort {
        gid: Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, last)),
        mac: Mac([0x52, 0x54, 0, 0x5c, 0, last]),
        qpn: 0x12,
        psn: 0,
        mtu: IbMtu::Mtu1024,
    }
}

fn peer_of(p: LocalPort) -> PeerPort {
    PeerPort {
        gid: p.gid,
        mac: p.mac,
        qpn: p.qpn,
        psn: p.psn,
        mtu: p.mtu.code(),
    }
}

fn lgr(role: Role, testlink: Option<Duration>) -> LinkGroup {
    LinkGroup::new(LgrConfig {
        id: 0x100, // the capture's lgr id 00010000 read as a little-endian u32
        role,
        version: LlcVersion::V2_LE,
        max_links: 2,
        max_conns: 255,
        testlink_interval: testlink,
    })
}

fn drain(g: &mut LinkGroup) -> Vec<LgrOutput> {
    std::iter::from_fn(|| g.poll_output()).collect()
}

fn sent(outs: &[LgrOutput]) -> Vec<Vec<u8>> {
    outs.iter()
        .filter_map(|o| match o {
            LgrOutput::SendLlc { msg, .. } => Some(msg.encode()),
            _ => None,
        })
        .collect()
}

const T0: Timestamp = Duration::from_secs(100);

#[test]
fn server_first_contact_sends_the_kernels_confirm_link() {
    let mut s = lgr(Role::Server, None);
    s.add_first_link(port(1), peer_of(port(2)), T0);
    let out = drain(&mut s);
    assert_eq!(
        sent(&out),
        vec![frame(11)],
        "CONFIRM_LINK request differs from the kernel's"
    );
    s.on_llc(
        0,
        LlcMessage::decode(&frame(13)).unwrap(),
        T0 + Duration::from_millis(4),
    );
    assert_eq!(drain(&mut s), vec![LgrOutput::LinkActive { slot: 0 }]);
    assert_eq!(s.link(0).unwrap().peer_link_uid, 0x101);
}

#[test]
fn client_answers_like_the_linux_client() {
    let mut c = lgr(Role::Client, None);
    c.add_first_link(port(2), peer_of(port(1)), T0);
    assert!(
        drain(&mut c).is_empty(),
        "a client waits for the server's CONFIRM_LINK"
    );
    c.on_llc(0, LlcMessage::decode(&frame(11)).unwrap(), T0);
    let out = drain(&mut c);
    assert_eq!(
        sent(&out),
        vec![frame(13)],
        "CONFIRM_LINK response differs from the kernel's"
    );
    assert!(out.contains(&LgrOutput::LinkActive { slot: 0 }));
    assert_eq!(
        c.link(0).unwrap().link_id,
        1,
        "link id adopted from the server"
    );
    // the server's asymmetric ADD_LINK is rejected at once, exactly as Linux does (frame 17)
    c.on_llc(0, LlcMessage::decode(&frame(15)).unwrap(), T0);
    assert_eq!(sent(&drain(&mut c)), vec![frame(17)]);
    // CONFIRM_RKEY for the server's RMB on connection 2: echoed with RESP (frame 373)
    c.on_llc(0, LlcMessage::decode(&frame(371)).unwrap(), T0);
    assert_eq!(sent(&drain(&mut c)), vec![frame(373)]);
    assert_eq!(
        c.rtoken(c.find_rtoken(0, 0x48a).unwrap()).unwrap()[0],
        Some((0x48a, 0xff2e_cb12_c08d_0000))
    );
    // DELETE_RKEY of that RMB: answered as in frame 364, row gone
    c.on_llc(0, LlcMessage::decode(&frame(361)).unwrap(), T0);
    assert_eq!(sent(&drain(&mut c)), vec![frame(364)]);
    assert_eq!(c.find_rtoken(0, 0x48a), None);
    // deleting an unknown rkey: negative response with the error count
    c.on_llc(0, LlcMessage::decode(&frame(361)).unwrap(), T0);
    match LlcMessage::decode(&sent(&drain(&mut c))[0]).unwrap() {
        LlcMessage::DeleteRkey(d) => assert!(d.is_negative() && d.err_mask == 1, "{d:?}"),
        m => panic!("{m:?}"),
    }
}

#[test]
fn first_contact_failures() {
    // no CONFIRM_LINK within 4 s: link down, group gone
    let mut c = lgr(Role::Client, None);
    c.add_first_link(port(2), peer_of(port(1)), T0);
    assert_eq!(
        c.poll_timeout(),
        Some(T0 + llc::CLIENT_FIRST_CONFIRM_LINK_WAIT)
    );
    c.on_timeout(T0 + Duration::from_secs(3));
    assert!(drain(&mut c).is_empty());
    c.on_timeout(T0 + Duration::from_secs(4));
    let out = drain(&mut c);
    assert!(out.contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::ConfirmLinkTimeout
    }));
    assert!(c.is_terminated());
    // a CONFIRM_LINK without the "no RMBE eyecatcher" bits is refused
    let mut c = lgr(Role::Client, None);
    c.add_first_link(port(2), peer_of(port(1)), T0);
    let mut f = frame(11);
    f[3] = 0;
    c.on_llc(0, LlcMessage::decode(&f).unwrap(), T0);
    assert!(drain(&mut c).contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::RmbeEyecatcher
    }));
}

fn pair(testlink: Option<Duration>) -> (LinkGroup, LinkGroup) {
    let mut s = lgr(Role::Server, testlink);
    let mut c = lgr(Role::Client, testlink);
    c.add_first_link(port(2), peer_of(port(1)), T0);
    s.add_first_link(port(1), peer_of(port(2)), T0);
    exchange(&mut s, &mut c, T0);
    assert_eq!(s.active_slots().collect::<Vec<_>>(), [0]);
    assert_eq!(c.active_slots().collect::<Vec<_>>(), [0]);
    (s, c)
}

/// Delivers LLC messages both ways until quiet; returns the non-send outputs.
fn exchange(
    a: &mut LinkGroup,
    b: &mut LinkGroup,
    now: Timestamp,
) -> (Vec<LgrOutput>, Vec<LgrOutput>) {
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    loop {
        let oa = drain(a);
        let ob = drain(b);
        if oa.is_empty() && ob.is_empty() {
            return (ea, eb);
        }
        for o in oa {
            match o {
                LgrOutput::SendLlc { slot, msg } => {
                    b.on_llc(slot, LlcMessage::decode(&msg.encode()).unwrap(), now)
                }
                e => ea.push(e),
            }
        }
        for o in ob {
            match o {
                LgrOutput::SendLlc { slot, msg } => {
                    a.on_llc(slot, LlcMessage::decode(&msg.encode()).unwrap(), now)
                }
                e => eb.push(e),
            }
        }
    }
}

#[test]
fn keepalive_probes_idle_links_and_kills_silent_ones() {
    let iv = Duration::from_secs(30);
    let (mut s, mut c) = pair(Some(iv));
    // after 30 s without receives, a TEST_LINK goes out; an answer keeps the link up
    assert_eq!(s.poll_timeout(), Some(T0 + iv));
    s.on_timeout(T0 + iv);
    let out = drain(&mut s);
    assert!(
        matches!(&out[..], [LgrOutput::SendLlc { msg: LlcMessage::TestLink(t), .. }] if !t.is_response())
    );
    for o in out {
        if let LgrOutput::SendLlc { slot, msg } = o {
            c.on_llc(slot, msg, T0 + iv);
        }
    }
    let (es, _) = exchange(&mut s, &mut c, T0 + iv);
    assert!(es.is_empty());
    s.on_timeout(T0 + iv + llc::WAIT_TIME);
    assert!(
        s.active_slots().next().is_some(),
        "answered keepalive must not kill the link"
    );
    // later the peer goes silent: 2 s after the probe the link is down, the group gone
    let t1 = T0 + iv * 3;
    s.on_timeout(t1);
    assert!(!drain(&mut s).is_empty());
    s.on_timeout(t1 + Duration::from_millis(1999));
    assert!(drain(&mut s).is_empty());
    s.on_timeout(t1 + llc::WAIT_TIME);
    let out = drain(&mut s);
    assert!(out.contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::KeepaliveTimeout
    }));
    assert!(out
        .iter()
        .any(|o| matches!(o, LgrOutput::Terminated { .. })));
}

/// A peer whose process is stopped (the provider says so) leaves its
/// TEST_LINK unanswered: the wait goes on from each look instead of taking
/// the link down, and once the peer is no longer paused the next unanswered
/// wait ends the link as before.
#[test]
fn a_keepalive_waits_for_a_paused_peer() {
    let iv = Duration::from_secs(30);
    let (mut s, _c) = pair(Some(iv));
    s.on_timeout(T0 + iv);
    assert!(!drain(&mut s).is_empty(), "the probe goes out");
    let due = T0 + iv + llc::WAIT_TIME;
    assert!(!s.keepalive_overdue(0, due - Duration::from_millis(1)));
    assert!(s.keepalive_overdue(0, due));
    assert!(
        !s.peer_paused(0, due - Duration::from_millis(1)),
        "not overdue yet"
    );
    // paused for a minute: looked at every wait, never down
    let mut t = due;
    while t < due + Duration::from_secs(60) {
        assert!(s.keepalive_overdue(0, t));
        assert!(s.peer_paused(0, t));
        s.on_timeout(t);
        assert!(
            !drain(&mut s)
                .iter()
                .any(|o| matches!(o, LgrOutput::LinkDown { .. })),
            "a paused peer's link stays up"
        );
        assert_eq!(s.poll_timeout(), Some(t + llc::WAIT_TIME));
        t += llc::WAIT_TIME;
    }
    // no longer paused, still silent: down at the end of the wait
    assert!(s.keepalive_overdue(0, t));
    s.on_timeout(t);
    assert!(drain(&mut s).contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::KeepaliveTimeout
    }));
    assert!(!s.peer_paused(0, t), "no link to wait for");
}

#[test]
fn rkey_flows_between_two_of_ours() {
    let (mut s, mut c) = pair(None);
    assert!(s.start_confirm_rkey(0, 0xabc, 0x1000, &[], 7, T0));
    assert!(
        !s.start_confirm_rkey(0, 0xabd, 0x2000, &[], 8, T0),
        "one local flow at a time"
    );
    let (es, _) = exchange(&mut s, &mut c, T0);
    assert_eq!(es, vec![LgrOutput::RkeyFlowDone { tag: 7, ok: true }]);
    assert!(c.find_rtoken(0, 0xabc).is_some());
    assert!(s.start_delete_rkey(0, 0xabc, 9, T0));
    let (es, _) = exchange(&mut s, &mut c, T0);
    assert_eq!(es, vec![LgrOutput::RkeyFlowDone { tag: 9, ok: true }]);
    assert!(c.find_rtoken(0, 0xabc).is_none());
    // an unanswered flow fails after 2 s
    assert!(c.start_confirm_rkey(0, 0x55, 0, &[], 10, T0));
    drain(&mut c);
    c.on_timeout(T0 + llc::WAIT_TIME);
    assert_eq!(
        drain(&mut c),
        vec![LgrOutput::RkeyFlowDone { tag: 10, ok: false }]
    );
}

#[test]
fn delete_link_all_from_the_peer() {
    let (mut s, mut c) = pair(None);
    c.terminate(llc::DEL_OP_INIT_TERM, false);
    let out = drain(&mut c);
    // the kernel's client sends exactly this on rmmod (teardown capture frame 1)
    assert_eq!(sent(&out)[0], hex("242c004000000200000000000000000000000000000000000000000000000000000000000000000000000000"));
    for o in out {
        if let LgrOutput::SendLlc { slot, msg } = o {
            s.on_llc(slot, msg, T0);
        }
    }
    let out = drain(&mut s);
    // the server echoes ALL|ORDERLY with the peer's reason (teardown capture frame 3)
    assert_eq!(sent(&out)[0], hex("242c006000000200000000000000000000000000000000000000000000000000000000000000000000000000"));
    assert!(out.contains(&LgrOutput::Terminated {
        reason: llc::DEL_OP_INIT_TERM
    }));
    assert!(s.is_terminated() && c.is_terminated());
}

#[test]
fn delete_of_an_unknown_link_is_answered_unknown() {
    let (_s, mut c) = pair(None);
    let req = smc_wire::llc::DeleteLink::request(LlcVersion::V2_LE, 9, true, llc::DEL_LOST_PATH);
    c.on_llc(0, LlcMessage::DeleteLink(req), T0);
    match LlcMessage::decode(&sent(&drain(&mut c))[0]).unwrap() {
        LlcMessage::DeleteLink(d) => assert!(d.is_response() && d.reason == llc::DEL_NOLNK),
        m => panic!("{m:?}"),
    }
    assert_eq!(c.active_slots().count(), 1);
    // deleting the only link ends the group
    let req = smc_wire::llc::DeleteLink::request(LlcVersion::V2_LE, 1, true, llc::DEL_LOST_PATH);
    c.on_llc(0, LlcMessage::DeleteLink(req), T0);
    let out = drain(&mut c);
    assert!(out.contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::DeletedByPeer(llc::DEL_LOST_PATH)
    }));
    assert!(c.is_terminated());
}

/// Brings up a second link in slot 1 of both groups, as the engine's test-only
/// bring-up does: the server picks the link id, both add the link, the
/// CONFIRM_LINK exchange runs on the new link.
fn add_second_link(s: &mut LinkGroup, c: &mut LinkGroup, now: Timestamp) -> u8 {
    let id = s.next_link_id();
    assert_eq!(id, 2, "link 1 is taken by the first link");
    let mut p3 = port(3);
    p3.qpn = 0x13;
    let mut p4 = port(4);
    p4.qpn = 0x14;
    assert_eq!(c.add_link(id, p4, peer_of(p3), now), Some(1));
    assert_eq!(s.add_link(id, p3, peer_of(p4), now), Some(1));
    let out = drain(s);
    match &out[..] {
        [LgrOutput::SendLlc {
            slot: 1,
            msg: LlcMessage::ConfirmLink(m),
        }] => {
            assert!(!m.is_response());
            assert_eq!(m.link_num, id);
            assert_eq!(m.sender_qpn, 0x13);
        }
        o => panic!("{o:?}"),
    }
    for o in out {
        if let LgrOutput::SendLlc { slot, msg } = o {
            c.on_llc(slot, msg, now);
        }
    }
    let (es, ec) = exchange(s, c, now);
    assert_eq!(es, vec![LgrOutput::LinkActive { slot: 1 }]);
    assert_eq!(ec, vec![LgrOutput::LinkActive { slot: 1 }]);
    id
}

#[test]
fn a_second_link_confirms_and_outlives_the_first() {
    let (mut s, mut c) = pair(None);
    // the peer's RMB known on link 0 gets its rkey for the new link
    let row = c.add_rtoken(0, 0xaaa, 0x1000).unwrap();
    add_second_link(&mut s, &mut c, T0);
    assert_eq!(c.usable_links(), 2);
    assert_eq!(
        c.add_link_rtokens(1, &[(0xaaa, 0xbbb, 0x2000), (0x999, 1, 2)]),
        1
    );
    assert_eq!(c.rtoken(row).unwrap()[1], Some((0xbbb, 0x2000)));
    // the client's first link fails: it tells the server on the survivor
    c.on_link_failure(0);
    let out = drain(&mut c);
    assert_eq!(
        out[0],
        LgrOutput::LinkDown {
            slot: 0,
            reason: DownReason::Failure
        }
    );
    match &out[1] {
        LgrOutput::SendLlc {
            slot: 1,
            msg: LlcMessage::DeleteLink(d),
        } => {
            assert!(!d.is_response() && !d.is_all() && d.is_orderly());
            assert_eq!((d.link_num, d.reason), (1, llc::DEL_LOST_PATH));
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(out.len(), 2, "the group lives on");
    assert!(!c.is_terminated());
    for o in out {
        if let LgrOutput::SendLlc { slot, msg } = o {
            s.on_llc(slot, msg, T0);
        }
    }
    let out = drain(&mut s);
    assert!(out.contains(&LgrOutput::LinkDown {
        slot: 0,
        reason: DownReason::DeletedByPeer(llc::DEL_LOST_PATH)
    }));
    assert!(!out
        .iter()
        .any(|o| matches!(o, LgrOutput::Terminated { .. })));
    assert_eq!(s.active_slots().collect::<Vec<_>>(), [1]);
    // the freed slot forgets its rkeys and takes the next link
    assert!(c.clear_link(0));
    assert!(!c.clear_link(1), "an active link is not cleared");
    assert_eq!(c.rtoken(row).unwrap()[0], None);
    assert_eq!(c.rtoken(row).unwrap()[1], Some((0xbbb, 0x2000)));
    assert_eq!(c.free_slot(), Some(0));
    // traffic on the cleared link is stale
    let before = c.dropped;
    c.on_llc(
        0,
        LlcMessage::TestLink(smc_wire::llc::TestLink::request(LlcVersion::V2_LE)),
        T0,
    );
    assert!(drain(&mut c).is_empty());
    assert_eq!(c.dropped, before + 1);
    // losing the last link ends the group (§7.3)
    c.on_link_failure(1);
    let out = drain(&mut c);
    assert!(out
        .iter()
        .any(|o| matches!(o, LgrOutput::Terminated { .. })));
    assert!(sent(&out).is_empty(), "no link left to tell the peer on");
}

/// A CLC Confirm names the peer's RMB by its rkey on the link its
/// connection was on (§1.11); when that link is cleared before the Confirm
/// arrives, the rkey still finds the RMB's row (with its rkey on the other
/// link) by the gone link's peer port, until the peer deletes the RMB.
#[test]
fn a_cleared_links_rkeys_find_their_row_until_the_rmb_is_deleted() {
    let (mut s, mut c) = pair(None);
    let row = c.add_rtoken(0, 0xaaa, 0x1000).unwrap();
    add_second_link(&mut s, &mut c, T0);
    c.add_link_rtokens(1, &[(0xaaa, 0xbbb, 0x2000)]);
    let gone = peer_of(port(1));
    assert_eq!(
        c.find_former_rtoken(gone.gid, gone.qpn, 0xaaa),
        None,
        "link 0 is up"
    );
    c.on_link_failure(0);
    drain(&mut c);
    assert!(c.clear_link(0));
    assert_eq!(c.find_rtoken(0, 0xaaa), None);
    assert_eq!(c.find_former_rtoken(gone.gid, gone.qpn, 0xaaa), Some(row));
    // (another link's port, another rkey: nothing)
    assert_eq!(c.find_former_rtoken(gone.gid, 0x13, 0xaaa), None);
    assert_eq!(c.find_former_rtoken(gone.gid, gone.qpn, 0xbbb), None);
    // the peer withdraws the RMB (DELETE_RKEY by its rkey on link 1): the
    // row is gone, and so is the way to it
    s.on_link_failure(0);
    drain(&mut s);
    assert!(s.clear_link(0));
    assert!(s.start_delete_rkey(1, 0xbbb, 9, T0));
    let (es, _) = exchange(&mut s, &mut c, T0);
    assert_eq!(es, vec![LgrOutput::RkeyFlowDone { tag: 9, ok: true }]);
    assert!(c.rtoken(row).is_none());
    assert_eq!(c.find_former_rtoken(gone.gid, gone.qpn, 0xaaa), None);
    // a new RMB in the freed row is not found by the old rkey either
    assert_eq!(c.add_rtoken(1, 0xccc, 0x3000), Ok(row));
    assert_eq!(c.find_former_rtoken(gone.gid, gone.qpn, 0xaaa), None);
}

#[test]
fn an_added_link_that_is_never_confirmed_is_deleted_not_orderly() {
    let (mut s, c) = pair(None);
    let id = s.next_link_id();
    let mut p3 = port(3);
    p3.qpn = 0x13;
    assert_eq!(s.add_link(id, p3, peer_of(port(4)), T0), Some(1));
    drain(&mut s);
    assert_eq!(c.next_link_id(), 2);
    // no CONFIRM_LINK response within 5 s (SMC_LLC_WAIT_FIRST_TIME)
    s.on_timeout(T0 + llc::WAIT_FIRST_TIME - Duration::from_millis(1));
    assert!(drain(&mut s).is_empty());
    s.on_timeout(T0 + llc::WAIT_FIRST_TIME);
    let out = drain(&mut s);
    assert_eq!(
        out[0],
        LgrOutput::LinkDown {
            slot: 1,
            reason: DownReason::ConfirmLinkTimeout
        }
    );
    match &out[1] {
        LgrOutput::SendLlc {
            slot: 0,
            msg: LlcMessage::DeleteLink(d),
        } => assert!(!d.is_orderly() && d.link_num == id),
        o => panic!("{o:?}"),
    }
    assert!(!s.is_terminated());
    // a link id still in use is refused
    assert_eq!(s.add_link(1, port(5), peer_of(port(6)), T0), None);
}
