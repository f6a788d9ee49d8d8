//! Captures of SMC-R between two hosts, as `scripts/vm/run-kernel-interop.sh`
//! records them (case `wire.*`: qemu filter-dump on one VM's NIC, both
//! directions, 300 bytes per frame), decoded with smc-rs's codec: every CLC,
//! LLC and CDC message must decode, and the flow must be SMC-R v2's as the
//! Linux kernel runs it — a first connection that creates the link group
//! (Proposal, Accept and Confirm with first contact, then CONFIRM_LINK request
//! and response on the new link), a second one that reuses it (no first
//! contact, no CONFIRM_LINK, same QPs), data announced by CDCs whose
//! producer cursor wraps a receiver's RMBE smaller than the stream (the
//! kernel's 64 KiB), and an orderly close from each end.
//!
//! Files: every `tests/data/*.pcap` (a kernel <-> kernel run of Linux 6.12 over
//! Soft-RoCE, and one run each way between that kernel and smc-rs over rxe0), plus `$SMC_INTEROP_PCAP` if set (a capture to
//! check before committing it, e.g. `/var/tmp/smc-kernel-interop/cases/wire.kr.pcap`).

use smc_interop::pcap;
use smc_interop::wire::{self, Event, What};
use smc_wire::clc::{AcceptConfirm, ClcMessage};
use smc_wire::llc::LlcMessage;
use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::path::PathBuf;

/// Bytes each way of every connection of the `wire.*` cases (128 KiB, the harness's size).
const WIRE_BYTES: u64 = 128 * 1024;

fn captures() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no capture in {}", dir.display());
    if let Some(extra) = std::env::var_os("SMC_INTEROP_PCAP") {
        v.push(PathBuf::from(extra));
    }
    v
}

/// One TCP connection's SMC handshake, as seen on the wire.
#[derive(Default, Debug)]
struct Conn {
    client: Option<SocketAddrV4>,
    server: Option<SocketAddrV4>,
    syn_option: bool,
    synack_option: bool,
    first_frame: usize,
    /// (frame, message, from the client)
    clc: Vec<(usize, ClcMessage, bool)>,
}

impl Conn {
    fn accept(&self) -> Option<&AcceptConfirm> {
        self.clc.iter().find_map(|(_, m, _)| match m {
            ClcMessage::Accept(a) => Some(a),
            _ => None,
        })
    }
    fn confirm(&self) -> Option<&AcceptConfirm> {
        self.clc.iter().find_map(|(_, m, _)| match m {
            ClcMessage::Confirm(a) => Some(a),
            _ => None,
        })
    }
    fn confirm_frame(&self) -> usize {
        self.clc
            .iter()
            .find(|(_, m, _)| matches!(m, ClcMessage::Confirm(_)))
            .map_or(usize::MAX, |c| c.0)
    }
}

fn key(a: SocketAddrV4, b: SocketAddrV4) -> (SocketAddrV4, SocketAddrV4) {
    if a < b {
        (a, b)
    } else {
        (b, a)
    }
}

/// The connections in the order they started.
fn connections(events: &[Event]) -> Vec<Conn> {
    let mut by: BTreeMap<(SocketAddrV4, SocketAddrV4), Conn> = BTreeMap::new();
    for e in events {
        match &e.what {
            What::Syn { ack, smc_option } => {
                let c = by.entry(key(e.src, e.dst)).or_default();
                if *ack {
                    c.synack_option = *smc_option;
                } else {
                    // a refused connect's SYN is followed by another on a new port
                    c.client = Some(e.src);
                    c.server = Some(e.dst);
                    c.syn_option = *smc_option;
                    c.first_frame = e.frame;
                }
            }
            What::Clc(m) => {
                let c = by.entry(key(e.src, e.dst)).or_default();
                let from_client = c.client == Some(e.src);
                c.clc.push((e.frame, m.clone(), from_client));
            }
            _ => {}
        }
    }
    let mut v: Vec<Conn> = by.into_values().filter(|c| !c.clc.is_empty()).collect();
    v.sort_by_key(|c| c.first_frame);
    v
}

#[test]
fn kernel_captures_decode_and_show_the_smc_r_v2_flow() {
    for path in captures() {
        let name = path.display().to_string();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let cap = pcap::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let d = wire::decode(&cap).unwrap_or_else(|e| panic!("{name}: {e}"));
        let errors: Vec<String> = d
            .events
            .iter()
            .filter(|e| matches!(e.what, What::Error(_)))
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{name}: undecodable: {errors:#?}");
        assert!(!d.cut_short, "{name}: file cut short");
        assert_eq!(d.tcp_streams_cut, 0, "{name}: CLC cut by the snap length");
        let ev: Vec<&Event> = d.events.iter().filter(|e| !e.is_retransmit()).collect();

        // --- CLC: each connection Proposal -> Accept -> Confirm, SMC option both ways
        let conns = connections(&d.events);
        assert!(
            conns.len() >= 2,
            "{name}: want 2+ connections, got {}",
            conns.len()
        );
        for (i, c) in conns.iter().enumerate() {
            assert!(
                c.syn_option && c.synack_option,
                "{name}: conn {i}: SMC option missing on SYN/SYN-ACK"
            );
            let kinds: Vec<(&str, bool)> = c
                .clc
                .iter()
                .map(|(_, m, fc)| {
                    let k = match m {
                        ClcMessage::Proposal(_) => "Proposal",
                        ClcMessage::Accept(_) => "Accept",
                        ClcMessage::Confirm(_) => "Confirm",
                        ClcMessage::Decline(_) => "Decline",
                    };
                    (k, *fc)
                })
                .collect();
            assert_eq!(
                kinds,
                [("Proposal", true), ("Accept", false), ("Confirm", true)],
                "{name}: conn {i}: CLC flow (message, from the client)"
            );
            let (a, f) = (c.accept().unwrap(), c.confirm().unwrap());
            assert!(
                a.version >= 2 && f.version >= 2,
                "{name}: conn {i}: SMC-R v2 expected"
            );
            assert_eq!(
                a.first_contact,
                i == 0,
                "{name}: conn {i}: Accept first contact"
            );
            assert_eq!(
                f.first_contact,
                i == 0,
                "{name}: conn {i}: Confirm first contact"
            );
            // RoCE v2 GIDs: the IPv4-mapped address of each end (kernel smc_ib_determine_gid)
            assert_eq!(
                a.gid.to_ipv4_mapped(),
                Some(*c.server.unwrap().ip()),
                "{name}: conn {i}: server GID"
            );
            assert_eq!(
                f.gid.to_ipv4_mapped(),
                Some(*c.client.unwrap().ip()),
                "{name}: conn {i}: client GID"
            );
        }
        let (c0, c1) = (&conns[0], &conns[1]);
        let (a0, f0) = (c0.accept().unwrap(), c0.confirm().unwrap());
        // reuse: the same link (QP pair) carries the second connection
        assert_eq!(c1.accept().unwrap().qpn, a0.qpn, "{name}: reuse: server QP");
        assert_eq!(
            c1.confirm().unwrap().qpn,
            f0.qpn,
            "{name}: reuse: client QP"
        );

        // --- LLC: one CONFIRM_LINK request (server) and response (client), right after
        // the first contact's Confirm and before the second connection
        let server_ip = *c0.server.unwrap().ip();
        let cl: Vec<(&Event, &LlcMessage)> = ev
            .iter()
            .filter_map(|e| e.llc().map(|m| (*e, m)))
            .filter(|(_, m)| matches!(m, LlcMessage::ConfirmLink(_)))
            .collect();
        assert_eq!(cl.len(), 2, "{name}: CONFIRM_LINK messages: {cl:#?}");
        let (req, resp) = (&cl[0], &cl[1]);
        assert!(
            !req.1.is_response() && resp.1.is_response(),
            "{name}: CONFIRM_LINK req, then resp"
        );
        assert_eq!(
            *req.0.src.ip(),
            server_ip,
            "{name}: the server sends CONFIRM_LINK"
        );
        assert!(
            req.0.frame > c0.confirm_frame(),
            "{name}: CONFIRM_LINK before the Confirm"
        );
        assert!(
            resp.0.frame < c1.first_frame,
            "{name}: CONFIRM_LINK after the second connection began"
        );
        if let (LlcMessage::ConfirmLink(q), LlcMessage::ConfirmLink(r)) = (req.1, resp.1) {
            assert_eq!(
                q.sender_qpn, a0.qpn,
                "{name}: CONFIRM_LINK req QPN = server's Accept QPN"
            );
            assert_eq!(
                r.sender_qpn, f0.qpn,
                "{name}: CONFIRM_LINK resp QPN = client's Confirm QPN"
            );
            assert_eq!(q.sender_gid, a0.gid, "{name}: CONFIRM_LINK req GID");
            assert_eq!(r.sender_gid, f0.gid, "{name}: CONFIRM_LINK resp GID");
            assert_eq!(q.link_num, r.link_num, "{name}: link number");
        }

        // --- CDC: per connection and direction, addressed by the receiver's alert
        // token; data announced (producer cursor moves, wraps the RMBE), then closed
        let rdma_writes = d.rdma_write_packets;
        assert!(
            rdma_writes > 0 && d.rdma_write_bytes > 0,
            "{name}: no RDMA WRITE"
        );
        for (i, c) in conns.iter().enumerate() {
            let (a, f) = (c.accept().unwrap(), c.confirm().unwrap());
            let client_ip = *c.client.unwrap().ip();
            // (the receiver's RMBE: the server's is in its Accept, the client's in its Confirm)
            for (dir, from_ip, token, rmbe) in [
                (
                    "client->server",
                    client_ip,
                    a.alert_token,
                    a.rmbe_size.bytes(),
                ),
                (
                    "server->client",
                    *c.server.unwrap().ip(),
                    f.alert_token,
                    f.rmbe_size.bytes(),
                ),
            ] {
                let cdcs: Vec<_> = ev
                    .iter()
                    .filter(|e| *e.src.ip() == from_ip && e.frame > c.first_frame)
                    .filter_map(|e| e.cdc())
                    .filter(|m| m.token == token)
                    .collect();
                assert!(
                    !cdcs.is_empty(),
                    "{name}: conn {i} {dir}: no CDC with token {token:#x}"
                );
                // The stream (WIRE_BYTES) outgrows a 64 KiB RMBE (the kernel's
                // default), which the cursor must wrap; it fits into smc-rs's 1 MiB one.
                let last = cdcs.last().unwrap();
                let announced =
                    u64::from(last.prod.wrap) * rmbe as u64 + u64::from(last.prod.count);
                assert!(
                    announced >= WIRE_BYTES,
                    "{name}: conn {i} {dir}: {announced} bytes announced, the stream is {WIRE_BYTES}"
                );
                assert!(
                    (last.prod.wrap > 0) == (WIRE_BYTES > rmbe as u64),
                    "{name}: conn {i} {dir}: producer cursor {:?} for a {rmbe}-byte RMBE",
                    last.prod
                );
                assert!(
                    cdcs.iter().any(|m| m.conn_flags.peer_conn_closed()),
                    "{name}: conn {i} {dir}: no CDC with peer_conn_closed"
                );
                assert!(
                    !cdcs.iter().any(|m| m.conn_flags.peer_conn_abort()),
                    "{name}: conn {i} {dir}: aborted"
                );
                // sequence numbers count up by one (retransmissions were left out)
                for w in cdcs.windows(2) {
                    assert_eq!(
                        w[1].seqno,
                        w[0].seqno.wrapping_add(1),
                        "{name}: conn {i} {dir}: CDC sequence numbers"
                    );
                }
            }
        }
    }
}

/// A capture with a broken message must not pass: the decoder reports it.
#[test]
fn a_damaged_llc_message_is_reported() {
    let path = &captures()[0];
    let mut bytes = std::fs::read(path).unwrap();
    let cap = pcap::parse(&bytes).unwrap();
    let d = wire::decode(&cap).unwrap();
    let req = d
        .events
        .iter()
        .find(|e| matches!(e.llc(), Some(LlcMessage::ConfirmLink(_))))
        .expect("a CONFIRM_LINK");
    // find the frame in the file and make its LLC type byte (Ethernet 14 + IPv4 20 +
    // UDP 8 + BTH 12 into the frame) a v2 type with no meaning (code 11)
    let mut at = 24;
    let mut frame = 0;
    while at < bytes.len() {
        frame += 1;
        let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        if frame == req.frame {
            let b = &mut bytes[at + 16 + 14 + 20 + 8 + 12];
            assert_eq!(*b, 0x21, "a v2 CONFIRM_LINK's type byte");
            *b = 0x2b;
            break;
        }
        at += 16 + incl;
    }
    let d = wire::decode(&pcap::parse(&bytes).unwrap()).unwrap();
    let errs: Vec<_> = d
        .events
        .iter()
        .filter(|e| matches!(e.what, What::Error(_)))
        .collect();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].frame, req.frame);
}
