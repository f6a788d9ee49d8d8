//! The link / link-group state machine as a table: for each role and each state a
//! link can rest in, every LLC message, timer and failure, and what the group does
//! (link state after, messages sent, outputs). Compared with the reviewed golden
//! file `tests/golden/link_table.txt` (regenerate with `UPDATE_GOLDEN=1` and review
//! the diff). Spec: `protocol-llc-cdc.md` §1.6–§1.11, §6.

#[path = "support/golden.rs"]
mod golden;
use smc_proto::link::*;
use smc_proto::Timestamp;
use smc_wire::llc::{self, *};
use smc_wire::types::{Gid, IbMtu, Mac};
use std::time::Duration;

const T0: Timestamp = Duration::from_secs(1000);
const IV: Duration = Duration::from_secs(30);
const V: LlcVersion = LlcVersion::V2_LE;

fn port(last: u8) -> LocalPort {
    LocalPort {
        gid: Gid::from_ipv4(std::net::Ipv4Addr::new(10, 0, 0, last)),
        mac: Mac([2, 0, 0, 0, 0, last]),
        qpn: 0x100 + u32::from(last),
        psn: 7,
        mtu: IbMtu::Mtu1024,
    }
}

fn group(role: Role) -> LinkGroup {
    let mut g = LinkGroup::new(LgrConfig {
        id: 0x100,
        role,
        version: V,
        max_links: 1,
        max_conns: 255,
        testlink_interval: Some(IV),
    });
    let (me, peer) = if role == Role::Server {
        (port(1), port(2))
    } else {
        (port(2), port(1))
    };
    g.add_first_link(
        me,
        PeerPort {
            gid: peer.gid,
            mac: peer.mac,
            qpn: peer.qpn,
            psn: peer.psn,
            mtu: 3,
        },
        T0,
    );
    while g.poll_output().is_some() {}
    g
}

fn confirm(response: bool, flags_ok: bool) -> LlcMessage {
    let mut c = ConfirmLink::new(
        V,
        response,
        Mac([2, 0, 0, 0, 0, 9]),
        Gid::ZERO,
        0x109,
        1,
        0x201,
        1,
        255,
    );
    if !flags_ok {
        c.flags &= !FLAG_NO_RMBE_EYEC;
    }
    LlcMessage::ConfirmLink(c)
}

/// The resting states, built by driving a fresh group.
fn states(role: Role) -> Vec<(&'static str, LinkGroup)> {
    let activating = group(role);
    let mut active = group(role);
    active.on_llc(0, confirm(role == Role::Server, true), T0);
    while active.poll_output().is_some() {}
    let mut probing = active.clone();
    probing.on_timeout(T0 + IV);
    while probing.poll_output().is_some() {}
    let mut rkey_flow = active.clone();
    rkey_flow.start_confirm_rkey(0, 0xabc, 0x1000, &[], 1, T0);
    while rkey_flow.poll_output().is_some() {}
    let mut terminated = active.clone();
    terminated.on_llc(
        0,
        LlcMessage::DeleteLink(DeleteLink::delete_all(V, false, llc::DEL_PROG_INIT_TERM)),
        T0,
    );
    while terminated.poll_output().is_some() {}
    vec![
        ("ACTIVATING (first contact)", activating),
        ("ACTIVE", active),
        ("ACTIVE, TEST_LINK outstanding", probing),
        ("ACTIVE, own CONFIRM_RKEY flow", rkey_flow),
        ("TERMINATED", terminated),
    ]
}

enum Ev {
    Llc(&'static str, LlcMessage),
    Timer(&'static str, Duration),
    Failure,
}

fn events() -> Vec<Ev> {
    let add = AddLink::reject_for(&AddLink {
        version: V,
        flags: 0,
        reject_reason: 0,
        sender_mac: Mac::default(),
        sender_gid: Gid::ZERO,
        sender_qpn: 5,
        link_num: 2,
        qp_mtu: 3,
        initial_psn: 1,
        ext: None,
    });
    let mut add_req = add.clone();
    add_req.flags = 0;
    let crk = ConfirmRkey::request(V, 0x55, 0x2000, &[]);
    vec![
        Ev::Llc("CONFIRM_LINK req", confirm(false, true)),
        Ev::Llc("CONFIRM_LINK req, no RMBE eyec", confirm(false, false)),
        Ev::Llc("CONFIRM_LINK resp", confirm(true, true)),
        Ev::Llc("ADD_LINK req", LlcMessage::AddLink(add_req)),
        Ev::Llc(
            "REQ_ADD_LINK req",
            LlcMessage::ReqAddLink(ReqAddLink {
                version: V,
                flags: 0,
                gids: vec![Gid::ZERO],
            }),
        ),
        Ev::Llc("TEST_LINK req", LlcMessage::TestLink(TestLink::request(V))),
        Ev::Llc(
            "TEST_LINK resp",
            LlcMessage::TestLink(TestLink::response_to(&TestLink::request(V))),
        ),
        Ev::Llc("CONFIRM_RKEY req", LlcMessage::ConfirmRkey(crk)),
        Ev::Llc(
            "CONFIRM_RKEY resp",
            LlcMessage::ConfirmRkey(ConfirmRkey::response_to(&crk, true)),
        ),
        Ev::Llc(
            "CONFIRM_RKEY resp NEG",
            LlcMessage::ConfirmRkey(ConfirmRkey::response_to(&crk, false)),
        ),
        Ev::Llc(
            "DELETE_RKEY req",
            LlcMessage::DeleteRkey(DeleteRkey::request(V, vec![0x55])),
        ),
        Ev::Llc(
            "DELETE_LINK req (link 1)",
            LlcMessage::DeleteLink(DeleteLink::request(V, 1, true, llc::DEL_LOST_PATH)),
        ),
        Ev::Llc(
            "DELETE_LINK req (link 9)",
            LlcMessage::DeleteLink(DeleteLink::request(V, 9, true, llc::DEL_LOST_PATH)),
        ),
        Ev::Llc(
            "DELETE_LINK ALL",
            LlcMessage::DeleteLink(DeleteLink::delete_all(V, false, llc::DEL_OP_INIT_TERM)),
        ),
        Ev::Timer("timer +2s", llc::WAIT_TIME),
        Ev::Timer("timer +4s", llc::CLIENT_FIRST_CONFIRM_LINK_WAIT),
        Ev::Timer("timer +32s", IV + llc::WAIT_TIME),
        Ev::Failure,
    ]
}

fn link_state(g: &LinkGroup) -> String {
    match (g.is_terminated(), g.link(0).map(|l| l.state)) {
        (true, _) => "TERMINATED".into(),
        (false, Some(s)) => format!("{s:?}").to_uppercase(),
        (false, None) => "-".into(),
    }
}

fn outputs(g: &mut LinkGroup) -> String {
    let mut v = Vec::new();
    while let Some(o) = g.poll_output() {
        v.push(match o {
            LgrOutput::SendLlc { msg, .. } => format!(
                "send {}{}",
                msg.llc_type().name(),
                if msg.is_response() { " resp" } else { "" }
            ),
            LgrOutput::LinkActive { .. } => "link active".into(),
            LgrOutput::LinkDown { reason, .. } => format!("link down ({reason:?})"),
            LgrOutput::Terminated { reason } => format!("terminated ({reason:#010x})"),
            LgrOutput::RkeyFlowDone { ok, .. } => format!("rkey flow done ok={ok}"),
            LgrOutput::AddLinkOffer { slot, .. } => format!("add link offer (slot {slot})"),
            LgrOutput::ConnectLink { slot, .. } => format!("connect link (slot {slot})"),
            LgrOutput::AddLinkFailed { slot } => format!("add link failed (slot {slot})"),
        });
    }
    if v.is_empty() {
        "-".into()
    } else {
        v.join(", ")
    }
}

fn table() -> String {
    let mut out = String::from(
        "# Link group state machine: every resting state x every event, both roles.\n\
         # Generated by tests/link_table.rs from smc_proto::link; spec protocol-llc-cdc.md §1.6-§1.11, §6.\n\
         # columns: event | link state after | what the group does\n",
    );
    for role in [Role::Server, Role::Client] {
        for (name, g) in states(role) {
            out.push_str(&format!("\n{role:?} / {name}\n"));
            for ev in events() {
                let mut g = g.clone();
                let label = match ev {
                    Ev::Llc(label, msg) => {
                        g.on_llc(0, msg, T0);
                        label.to_string()
                    }
                    Ev::Timer(label, d) => {
                        g.on_timeout(T0 + d);
                        label.to_string()
                    }
                    Ev::Failure => {
                        g.on_link_failure(0);
                        "QP failure".into()
                    }
                };
                let o = outputs(&mut g);
                out.push_str(&format!("    {label:<32} -> {:<11} {o}\n", link_state(&g)));
            }
        }
    }
    out
}

#[test]
fn every_state_event_pair_matches_the_reviewed_table() {
    golden::check(
        env!("CARGO_MANIFEST_DIR"),
        "link_table.txt",
        &table(),
        "link state",
    );
}
