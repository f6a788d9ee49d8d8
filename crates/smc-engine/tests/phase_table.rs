//! The connection handshake as a table: for each role and each [`HandshakePhase`]
//! a connection can rest in, every event, and what the *real endpoint* does — the
//! phase after, the connection's status, the CLC messages it sends, and its link
//! group's state. Every cell is a fresh, deterministic pair of endpoints over the
//! sim fabric, driven into the phase and then given the one event. Compared with
//! the reviewed golden file `tests/golden/phase_table.txt` (regenerate with
//! `UPDATE_GOLDEN=1` and review the diff). Spec: `protocol-clc.md` §4 (flows,
//! timeouts, decline codes), `protocol-llc-cdc.md` §1.7, §1.11, §6.

#[path = "../../smc-proto/tests/support/golden.rs"]
mod golden;
use smc_engine::endpoint::{ConnId, ConnStatus, Endpoint, EndpointConfig};
use smc_engine::state::HandshakePhase;
use smc_proto::clc_stream::{ClcReadError, FailReason};
use smc_proto::link::Role;
use smc_proto::Timestamp;
use smc_rdma::sim::SimFabric;
use smc_wire::clc::{ClcHeader, ClcMessage, Decline, DeclineCode, SMC_V2};
use smc_wire::types::{Mac, SystemId};
use std::net::IpAddr;
use std::time::Duration;

mod common;

/// The shared test identity with a 16 KiB send buffer.
fn config(dev: &str, inst: u16, last: u8) -> EndpointConfig {
    EndpointConfig {
        sndbuf_len: 16384,
        ..common::simple_config(dev, inst, last)
    }
}

struct Tcp {
    c: ConnId,
    s: ConnId,
    c2s: Vec<u8>,
    s2c: Vec<u8>,
}

struct World {
    fabric: SimFabric,
    client: Endpoint<SimFabric>,
    server: Endpoint<SimFabric>,
    now: Timestamp,
    /// Every CLC byte each side has sent (client, server).
    said: [Vec<u8>; 2],
    /// (connections, link groups) of (client, server) before the latest `open`.
    before: [(usize, usize); 2],
}

const STEP: Duration = Duration::from_micros(20);

impl World {
    fn new() -> World {
        let fabric = SimFabric::new(3);
        let (ccfg, scfg) = (config("simC", 0x1111, 1), config("simS", 0x2222, 2));
        common::add_device_for(&fabric, &ccfg);
        common::add_device_for(&fabric, &scfg);
        World {
            client: Endpoint::new(&fabric, ccfg).unwrap(),
            server: Endpoint::new(&fabric, scfg).unwrap(),
            fabric,
            now: Duration::ZERO,
            said: [Vec::new(), Vec::new()],
            before: [(0, 0); 2],
        }
    }

    /// Moves what the endpoints have to say onto the TCP pipe (and the logs).
    fn collect(&mut self, t: &mut Tcp) {
        let c = self.client.clc_output(t.c);
        self.said[0].extend(&c);
        t.c2s.extend(c);
        let s = self.server.clc_output(t.s);
        self.said[1].extend(&s);
        t.s2c.extend(s);
    }

    fn open(&mut self) -> Tcp {
        self.before = [
            (self.client.connections(), self.client.link_groups()),
            (self.server.connections(), self.server.link_groups()),
        ];
        let s = self.server.accept(IpAddr::from([10, 99, 0, 2]), self.now);
        let c = self.client.connect(IpAddr::from([10, 99, 0, 1]), self.now);
        let mut t = Tcp {
            c,
            s,
            c2s: Vec::new(),
            s2c: Vec::new(),
        };
        self.collect(&mut t);
        t
    }

    /// Pumps both endpoints (RDMA only: CLC output is collected, not delivered).
    fn rdma(&mut self, t: &mut Tcp, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.client.pump(self.now).unwrap();
            self.server.pump(self.now).unwrap();
            self.collect(t);
            self.fabric.advance(STEP);
            self.now += STEP;
        }
    }

    fn deliver_to_server(&mut self, t: &mut Tcp) {
        let n = self.server.clc_input(t.s, &t.c2s, self.now);
        t.c2s.drain(..n);
        self.collect(t);
    }

    fn deliver_to_client(&mut self, t: &mut Tcp) {
        let n = self.client.clc_input(t.c, &t.s2c, self.now);
        t.s2c.drain(..n);
        self.collect(t);
    }

    /// Pumps until the server has CLC output for `t`.
    fn until_server_says(&mut self, t: &mut Tcp) {
        for _ in 0..500 {
            if !t.s2c.is_empty() {
                return;
            }
            self.rdma(t, STEP);
        }
        panic!("server silent");
    }

    fn handshake(&mut self) -> Tcp {
        let mut t = self.open();
        for _ in 0..200 {
            self.deliver_to_server(&mut t);
            self.deliver_to_client(&mut t);
            self.rdma(&mut t, STEP);
        }
        assert_eq!(self.client.status(t.c), Some(ConnStatus::Smc));
        assert_eq!(self.server.status(t.s), Some(ConnStatus::Smc));
        t
    }
}

/// A connection resting in a phase: the world, its TCP pipe, and whose end is
/// under test.
struct Case {
    w: World,
    t: Tcp,
    role: Role,
}

impl Case {
    fn id(&self) -> ConnId {
        match self.role {
            Role::Client => self.t.c,
            Role::Server => self.t.s,
        }
    }
    fn ep(&mut self) -> &mut Endpoint<SimFabric> {
        match self.role {
            Role::Client => &mut self.w.client,
            Role::Server => &mut self.w.server,
        }
    }
}

/// A Decline is the next thing the connection under test reads (whatever the
/// peer had sent before is not delivered).
fn decline_to(w: &mut World, t: &mut Tcp, role: Role) {
    let d = Decline::new(
        SMC_V2,
        SystemId::new(9, Mac([2, 0, 0, 0, 0, 9])),
        DeclineCode::PeerDecl,
    );
    let bytes = ClcMessage::Decline(d).encode();
    match role {
        Role::Client => {
            t.s2c = bytes;
            w.deliver_to_client(t);
        }
        Role::Server => {
            t.c2s = bytes;
            w.deliver_to_server(t);
        }
    }
}

/// The QPs of the link group of the connection under test fail, then both
/// ends run for 10 ms.
fn lose_link(case: &mut Case) {
    let id = case.id();
    let ep = case.ep();
    let qps: Vec<u32> = ep
        .link_group_of(id)
        .map(|l| (0..3).filter_map(|s| ep.link_qp_num(l, s)).collect())
        .unwrap_or_default();
    for q in qps {
        case.w.fabric.fail_qp(q);
    }
    let (w, t) = (&mut case.w, &mut case.t);
    w.rdma(t, Duration::from_millis(10));
}

/// Time passes for the connection under test (its peer silent).
fn later(case: &mut Case, d: Duration) {
    case.w.now += d;
    let now = case.w.now;
    case.ep().pump(now).unwrap();
    // (a deadline met in a pump is acted on by the next one)
    case.ep().pump(now).unwrap();
    let (w, t) = (&mut case.w, &mut case.t);
    w.collect(t);
}

/// A first contact of `role` resting in AwaitLink.
fn await_link(role: Role) -> Case {
    let mut w = World::new();
    let mut t = w.open();
    w.deliver_to_server(&mut t);
    w.deliver_to_client(&mut t);
    if role == Role::Server {
        w.deliver_to_server(&mut t);
    }
    Case { w, t, role }
}

/// A first contact of `role` whose link failed after the CLC exchange.
fn await_late_decline(role: Role) -> Case {
    let mut c = await_link(role);
    lose_link(&mut c);
    c
}

/// ... and whose own late Decline went out.
fn late_declined(role: Role) -> Case {
    let mut c = await_late_decline(role);
    later(&mut c, Duration::from_secs(6));
    c
}

/// Every phase a connection can rest in, per role, and how to get there. CLC
/// bytes the peer has sent but we have not read stay in the pipe.
/// A named resting phase of one role and how to get there.
type State = (&'static str, Role, fn() -> Case);

fn states() -> Vec<State> {
    vec![
        ("AwaitAccept, first contact", Role::Client, || {
            let mut w = World::new();
            let t = w.open();
            Case {
                w,
                t,
                role: Role::Client,
            }
        }),
        ("AwaitAccept, group exists", Role::Client, || {
            let mut w = World::new();
            let _first = w.handshake();
            let t = w.open();
            Case {
                w,
                t,
                role: Role::Client,
            }
        }),
        ("ClientRkey", Role::Client, || {
            let mut w = World::new();
            let _first = w.handshake();
            let mut t = w.open();
            w.deliver_to_server(&mut t);
            w.until_server_says(&mut t);
            w.deliver_to_client(&mut t);
            Case {
                w,
                t,
                role: Role::Client,
            }
        }),
        ("AwaitLink", Role::Client, || await_link(Role::Client)),
        ("AwaitLateDecline", Role::Client, || {
            await_late_decline(Role::Client)
        }),
        ("LateDeclined", Role::Client, || late_declined(Role::Client)),
        ("Smc", Role::Client, || {
            let mut w = World::new();
            let t = w.handshake();
            Case {
                w,
                t,
                role: Role::Client,
            }
        }),
        ("Done (peer declined)", Role::Client, || {
            let mut w = World::new();
            let mut t = w.open();
            decline_to(&mut w, &mut t, Role::Client);
            Case {
                w,
                t,
                role: Role::Client,
            }
        }),
        ("AwaitProposal", Role::Server, || {
            let mut w = World::new();
            let t = w.open();
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("AwaitLgr", Role::Server, || {
            let mut w = World::new();
            let mut first = w.open();
            w.deliver_to_server(&mut first);
            let mut t = w.open();
            w.deliver_to_server(&mut t);
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("ServerRkey", Role::Server, || {
            let mut w = World::new();
            let _first = w.handshake();
            let mut t = w.open();
            w.deliver_to_server(&mut t);
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("AwaitConfirm, first contact", Role::Server, || {
            let mut w = World::new();
            let mut t = w.open();
            w.deliver_to_server(&mut t);
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("AwaitConfirm, reused group", Role::Server, || {
            let mut w = World::new();
            let _first = w.handshake();
            let mut t = w.open();
            w.deliver_to_server(&mut t);
            w.until_server_says(&mut t);
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("AwaitLink", Role::Server, || await_link(Role::Server)),
        ("AwaitLateDecline", Role::Server, || {
            await_late_decline(Role::Server)
        }),
        ("LateDeclined", Role::Server, || late_declined(Role::Server)),
        ("Smc", Role::Server, || {
            let mut w = World::new();
            let t = w.handshake();
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
        ("Done (peer declined)", Role::Server, || {
            let mut w = World::new();
            let mut t = w.open();
            decline_to(&mut w, &mut t, Role::Server);
            Case {
                w,
                t,
                role: Role::Server,
            }
        }),
    ]
}

/// The events, applied to the connection under test. "CLC Decline", "CLC of the
/// wrong kind" and "garbage" are the next bytes it reads on TCP.
const EVENTS: [&str; 9] = [
    "peer runs, its CLC arrives",
    "CLC Decline",
    "CLC of the wrong kind",
    "garbage on TCP",
    "RDMA progress 10 ms",
    "link lost",
    "timers +6 s, peer silent",
    "TCP closed",
    "release()",
];

fn apply(case: &mut Case, ev: &str) {
    let role = case.role;
    let id = case.id();
    match ev {
        "peer runs, its CLC arrives" => {
            // the peer reads what we sent, runs (RDMA too) until it has
            // something for us on TCP or 10 ms passed, and we read it
            let (w, t) = (&mut case.w, &mut case.t);
            match role {
                Role::Client => w.deliver_to_server(t),
                Role::Server => w.deliver_to_client(t),
            }
            for _ in 0..500 {
                let pending = match role {
                    Role::Client => !t.s2c.is_empty(),
                    Role::Server => !t.c2s.is_empty(),
                };
                if pending {
                    break;
                }
                w.rdma(t, STEP);
            }
            match role {
                Role::Client => w.deliver_to_client(t),
                Role::Server => w.deliver_to_server(t),
            }
        }
        "CLC Decline" => {
            let (w, t) = (&mut case.w, &mut case.t);
            decline_to(w, t, role);
        }
        "CLC of the wrong kind" => {
            // a client never gets a Proposal, a server never an Accept
            let (w, t) = (&mut case.w, &mut case.t);
            let mut other = World::new();
            let mut x = other.open();
            match role {
                Role::Client => {
                    t.s2c = x.c2s.clone();
                    w.deliver_to_client(t);
                }
                Role::Server => {
                    other.deliver_to_server(&mut x);
                    other.collect(&mut x);
                    t.c2s = x.s2c.clone();
                    w.deliver_to_server(t);
                }
            }
        }
        "garbage on TCP" => {
            let junk = b"GET / HTTP/1.1\r\n\r\n".to_vec();
            let (w, t) = (&mut case.w, &mut case.t);
            match role {
                Role::Client => {
                    t.s2c = junk;
                    w.deliver_to_client(t);
                }
                Role::Server => {
                    t.c2s = junk;
                    w.deliver_to_server(t);
                }
            }
        }
        "RDMA progress 10 ms" => {
            // both run, CLC stays on the wire
            let (w, t) = (&mut case.w, &mut case.t);
            w.rdma(t, Duration::from_millis(10));
        }
        "link lost" => lose_link(case),
        "timers +6 s, peer silent" => later(case, Duration::from_secs(6)),
        "TCP closed" => {
            case.ep().tcp_closed(id);
        }
        "release()" => case.ep().release(id),
        _ => unreachable!(),
    }
}

fn clc_types(mut b: &[u8]) -> String {
    let mut v = Vec::new();
    while let Ok(h) = ClcHeader::peek(b) {
        let n = usize::from(h.length).min(b.len());
        match ClcMessage::decode(&b[..n]) {
            Ok(ClcMessage::Accept(a)) | Ok(ClcMessage::Confirm(a)) => v.push(format!(
                "{:?}{}",
                h.msg_type,
                if a.first_contact { "(FC)" } else { "" }
            )),
            Ok(ClcMessage::Decline(d)) => v.push(format!("Decline({:?})", d.diagnosis)),
            _ => v.push(format!("{:?}", h.msg_type)),
        }
        b = &b[n..];
    }
    if v.is_empty() {
        "-".into()
    } else {
        v.join(" ")
    }
}

fn status(s: Option<ConnStatus>) -> String {
    match s {
        None => "freed".into(),
        Some(ConnStatus::Handshaking) => "handshaking".into(),
        Some(ConnStatus::Smc) => "SMC-R".into(),
        Some(ConnStatus::Fallback { reason, peer }) => match peer {
            Some(p) => format!("fallback {reason:?}/{p:?}"),
            None => format!("fallback {reason:?}"),
        },
        Some(ConnStatus::Failed(FailReason::Protocol(e))) => match e {
            ClcReadError::Malformed(_) => "failed: malformed CLC".into(),
            ClcReadError::Unexpected(t) => format!("failed: unexpected {t:?}"),
            ClcReadError::TooLong(_) => "failed: CLC too long".into(),
        },
        Some(ConnStatus::Failed(r)) => format!("failed: {r:?}"),
    }
}

fn table() -> String {
    let mut out = String::from(
        "# Connection handshake: every phase x every event, both roles, as the endpoint does it.\n\
         # Generated by tests/phase_table.rs driving smc_engine::endpoint over the sim fabric;\n\
         # spec protocol-clc.md §4, protocol-llc-cdc.md §1.7, §1.11, §6.\n\
         # columns: event | phase after | status | CLC we sent | our link group's state\n",
    );
    for (name, role, make) in states() {
        let probe = make();
        let start = match role {
            Role::Client => probe.w.client.handshake_phase(probe.t.c),
            Role::Server => probe.w.server.handshake_phase(probe.t.s),
        };
        let want = name.split([',', ' ']).next().unwrap();
        assert_eq!(
            format!("{start:?}"),
            format!("Some({want})"),
            "setup of {role:?} / {name}"
        );
        out.push_str(&format!("\n{role:?} / {name}\n"));
        for ev in EVENTS {
            let mut case = make();
            let id = case.id();
            case.w.collect(&mut case.t);
            let side = usize::from(case.role == Role::Server);
            let before = case.w.said[side].len();
            apply(&mut case, ev);
            case.w.collect(&mut case.t);
            let sent = clc_types(&case.w.said[side][before..]);
            let ep = case.ep();
            let phase = ep
                .handshake_phase(id)
                .map_or("-".to_string(), |p| format!("{p:?}"));
            let mut st = status(ep.status(id));
            if ep.status(id) == Some(ConnStatus::Smc) {
                st = format!("{st} {:?}", ep.close_state(id).unwrap());
            }
            let lgr = ep
                .link_group_of(id)
                .and_then(|l| ep.link_group_state(l))
                .map_or("-".to_string(), |s| s.to_string());
            out.push_str(&format!(
                "    {ev:<26} -> {phase:<16} {st:<30} {sent:<22} {lgr}\n"
            ));
        }
    }
    out
}

#[test]
fn every_phase_event_pair_matches_the_reviewed_table() {
    golden::check(
        env!("CARGO_MANIFEST_DIR"),
        "phase_table.txt",
        &table(),
        "handshake phase",
    );
}

#[test]
fn every_phase_is_covered() {
    let mut seen: Vec<HandshakePhase> = Vec::new();
    for (_, _, make) in states() {
        let c = make();
        let p = match c.role {
            Role::Client => c.w.client.handshake_phase(c.t.c),
            Role::Server => c.w.server.handshake_phase(c.t.s),
        };
        seen.extend(p);
    }
    for p in HandshakePhase::ALL {
        assert!(seen.contains(&p), "no row for {p:?}");
    }
}

/// The TCP connection closes (or ends) in every phase: the connection ends at
/// once and, once the application releases it, nothing of it is left — no
/// connection, and no link group beyond those that were there before it (a
/// first contact's group ends with the handshake that created it; an
/// established connection's group stays, idle, as Linux keeps it).
#[test]
fn a_tcp_close_in_every_phase_ends_the_connection_and_releases_it() {
    for (name, role, make) in states() {
        let mut case = make();
        let id = case.id();
        let start = case.ep().handshake_phase(id).unwrap();
        let side = usize::from(role == Role::Server);
        let (conns_before, groups_before) = case.w.before[side];
        case.ep().tcp_closed(id);
        let status = case.ep().status(id);
        assert!(
            !matches!(status, Some(ConnStatus::Handshaking)),
            "{role:?} / {name}: still handshaking after the TCP close"
        );
        case.ep().release(id);
        // both ends run for 12 s (link timers, idle checks, the peer's own end)
        for _ in 0..12_000 {
            let (w, t) = (&mut case.w, &mut case.t);
            w.client.pump(w.now).unwrap();
            w.server.pump(w.now).unwrap();
            w.collect(t);
            w.fabric.advance(Duration::from_millis(1));
            w.now += Duration::from_millis(1);
        }
        let ep = case.ep();
        assert_eq!(
            ep.connections(),
            conns_before,
            "{role:?} / {name}: connection left"
        );
        // (another connection's first contact may have timed out meanwhile)
        let kept = usize::from(start == HandshakePhase::Smc);
        assert!(
            ep.link_groups() <= groups_before + kept,
            "{role:?} / {name}: {} link groups left, {groups_before} before",
            ep.link_groups()
        );
    }
}
