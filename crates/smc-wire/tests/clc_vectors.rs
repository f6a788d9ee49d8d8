//! CLC codec against fixed vectors:
//! * `protocol-clc.md` §6 (a1–a3, b1–b3, c, d, e), derived from the layout;
//! * every CLC message of the real Linux 6.12 captures in `tests/vectors/*.json`.

use std::net::{Ipv4Addr, Ipv6Addr};

use smc_wire::clc::*;
use smc_wire::types::{Eid, Gid, IbMtu, Mac, RmbeSize, SystemId};

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    assert_eq!(s.len() % 2, 0, "odd hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Parses a hexdump as printed in the spec (`0000: e2 d4 ...` lines).
fn dump(s: &str) -> Vec<u8> {
    let body: String = s
        .lines()
        .filter_map(|l| l.split_once(':').map(|(_, r)| r.to_string()))
        .collect::<Vec<_>>()
        .join(" ");
    hex(&body)
}

fn round_trip(bytes: &[u8]) -> ClcMessage {
    let m = ClcMessage::decode(bytes).unwrap_or_else(|e| panic!("decode failed: {e}"));
    assert_eq!(m.encode(), bytes, "re-encode differs");
    assert_eq!(m.encoded_len(), bytes.len());
    m.validate().unwrap();
    let hdr = ClcHeader::peek(bytes).unwrap();
    assert_eq!(usize::from(hdr.length), bytes.len());
    assert_eq!(hdr.msg_type, m.msg_type());
    m
}

// ---------------------------------------------------------------- spec §6 identities

const CLIENT_ID: SystemId = SystemId([0x12, 0x34, 2, 0, 0, 0, 0, 1]);
const SERVER_ID: SystemId = SystemId([0x56, 0x78, 2, 0, 0, 0, 0, 2]);
const CLIENT_MAC: Mac = Mac([2, 0, 0, 0, 0, 1]);
const SERVER_MAC: Mac = Mac([2, 0, 0, 0, 0, 2]);

fn client_gid() -> Gid {
    Gid::roce_v1_link_local(CLIENT_MAC)
}
fn server_gid() -> Gid {
    Gid::roce_v1_link_local(SERVER_MAC)
}

#[test]
fn spec_a1_decline_v1_diffprefix() {
    let b = dump(
        "0000: e2 d4 c3 d9 04 00 1c 10 56 78 02 00 00 00 00 02
         0010: 03 07 00 00 00 00 00 00 e2 d4 c3 d9",
    );
    let ClcMessage::Decline(d) = round_trip(&b) else {
        panic!("not a decline")
    };
    assert_eq!(d.version, 1);
    assert!(!d.out_of_sync);
    assert_eq!(d.peer_id, SERVER_ID);
    assert_eq!(d.diagnosis, DeclineCode::DiffPrefix);
    assert_eq!(d.os_type, 0);
    assert_eq!(d, Decline::new(1, SERVER_ID, DeclineCode::DiffPrefix));
    assert_eq!(
        Decline::new(1, SERVER_ID, DeclineCode::DiffPrefix).encode(),
        b
    );
}

#[test]
fn spec_a2_decline_v1_syncerr_out_of_sync() {
    let b = dump(
        "0000: e2 d4 c3 d9 04 00 1c 18 12 34 02 00 00 00 00 01
         0010: 04 00 00 00 00 00 00 00 e2 d4 c3 d9",
    );
    let ClcMessage::Decline(d) = round_trip(&b) else {
        panic!("not a decline")
    };
    assert!(d.out_of_sync);
    assert_eq!(d.diagnosis, DeclineCode::SyncErr);
    assert_eq!(d.peer_id, CLIENT_ID);
    assert_eq!(Decline::new(1, CLIENT_ID, DeclineCode::SyncErr).encode(), b);
}

#[test]
fn spec_a3_decline_v2() {
    let b = dump(
        "0000: e2 d4 c3 d9 04 00 2c 20 12 34 02 00 00 00 00 01
         0010: 03 03 00 02 20 00 00 00 00 00 00 00 00 00 00 00
         0020: 00 00 00 00 00 00 00 00 e2 d4 c3 d9",
    );
    let ClcMessage::Decline(d) = round_trip(&b) else {
        panic!("not a decline")
    };
    assert_eq!(d.version, 2);
    assert_eq!(d.diagnosis, DeclineCode::NoSmcRDev);
    assert_eq!(d.os_type, OS_LINUX);
    assert_eq!(d.diag_v2, [0; 4]);
    assert_eq!(
        Decline::new(2, CLIENT_ID, DeclineCode::NoSmcRDev).encode(),
        b
    );
}

fn b_offer() -> (SmcPath, SystemId, Gid, Mac, IpPrefixes) {
    (
        SmcPath::R,
        CLIENT_ID,
        client_gid(),
        CLIENT_MAC,
        IpPrefixes::ipv4(Ipv4Addr::new(192, 168, 10, 0), 24),
    )
}

#[test]
fn spec_b1_b2_proposal_v1_both_layouts_same_offer() {
    let b1 = dump(
        "0000: e2 d4 c3 d9 01 00 34 10 12 34 02 00 00 00 00 01
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
         0020: 02 00 00 00 00 01 00 00 c0 a8 0a 00 18 00 00 00
         0030: e2 d4 c3 d9",
    );
    let b2 = dump(
        "0000: e2 d4 c3 d9 01 00 5c 28 12 34 02 00 00 00 00 01
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
         0020: 02 00 00 00 00 01 00 28 00 00 00 00 00 00 00 00
         0030: 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
         0040: 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
         0050: c0 a8 0a 00 18 00 00 00 e2 d4 c3 d9",
    );
    let ClcMessage::Proposal(p1) = round_trip(&b1) else {
        panic!()
    };
    let ClcMessage::Proposal(p2) = round_trip(&b2) else {
        panic!()
    };
    let (t1, id, gid, mac, prefixes) = b_offer();
    for p in [&p1, &p2] {
        // the same offer: SMC-R v1 with prefix 192.168.10.0/24, nothing v2
        assert_eq!(p.typev1, t1);
        assert_eq!(p.typev2, SmcPath::N);
        assert_eq!(p.peer_id, id);
        assert_eq!(p.gid, gid);
        assert_eq!(p.gid.to_string(), "fe80::ff:fe00:1");
        assert_eq!(p.mac, mac);
        assert_eq!(p.prefixes.as_ref(), Some(&prefixes));
        assert_eq!(p.v2_ext, None);
        assert_eq!(p.smcd_v2_ext, None);
    }
    assert_eq!(p1.version, 1);
    assert_eq!(p1.smcd, None);
    assert_eq!(p2.version, 2);
    assert_eq!(p2.smcd, Some(SmcdInfo::default()));
    // building both from values gives the vectors
    let mk = |version, smcd| Proposal {
        version,
        typev1: SmcPath::R,
        typev2: SmcPath::N,
        peer_id: id,
        gid,
        mac,
        smcd,
        prefixes: Some(prefixes.clone()),
        v2_ext: None,
        smcd_v2_ext: None,
    };
    assert_eq!(mk(1, None).encode(), b1);
    assert_eq!(mk(2, Some(SmcdInfo::default())).encode(), b2);
}

#[test]
fn spec_b3_proposal_v1_ipv6() {
    let b = dump(
        "0000: e2 d4 c3 d9 01 00 45 10 12 34 02 00 00 00 00 01
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
         0020: 02 00 00 00 00 01 00 00 00 00 00 00 00 00 00 01
         0030: 20 01 0d b8 00 01 00 00 00 00 00 00 00 00 00 00
         0040: 40 e2 d4 c3 d9",
    );
    let ClcMessage::Proposal(p) = round_trip(&b) else {
        panic!()
    };
    let pf = p.prefixes.unwrap();
    assert_eq!(pf.ipv4_subnet, Ipv4Addr::UNSPECIFIED);
    assert_eq!(pf.ipv4_prefix_len, 0);
    assert_eq!(
        pf.ipv6,
        vec![Ipv6Prefix {
            prefix: "2001:db8:1::".parse::<Ipv6Addr>().unwrap(),
            len: 64
        }]
    );
}

#[allow(clippy::too_many_arguments)]
fn v1_accept_confirm(
    id: SystemId,
    gid: Gid,
    mac: Mac,
    first_contact: bool,
    qpn: u32,
    rkey: u32,
    token: u32,
    rmbe_class: u8,
    mtu: u8,
    vaddr: u64,
    psn: u32,
) -> AcceptConfirm {
    AcceptConfirm {
        version: 1,
        first_contact,
        peer_id: id,
        gid,
        mac,
        qpn,
        rmb_rkey: rkey,
        rmbe_idx: 1,
        alert_token: token,
        rmbe_size: RmbeSize::from_class(rmbe_class).unwrap(),
        qp_mtu: mtu,
        rmb_vaddr: vaddr,
        psn,
        eid: Eid::default(),
        fce: None,
        gid_list: None,
    }
}

#[test]
fn spec_c_accept_v1_first_contact() {
    let b = dump(
        "0000: e2 d4 c3 d9 02 00 44 18 56 78 02 00 00 00 00 02
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 02
         0020: 02 00 00 00 00 02 00 01 23 00 00 12 34 01 00 00
         0030: a0 01 23 00 00 00 00 00 12 34 00 00 00 ab cd ef
         0040: e2 d4 c3 d9",
    );
    let ClcMessage::Accept(a) = round_trip(&b) else {
        panic!()
    };
    let want = v1_accept_confirm(
        SERVER_ID,
        server_gid(),
        SERVER_MAC,
        true,
        0x000123,
        0x1234,
        0xa001,
        2,
        3,
        0x1234_0000,
        0xabcdef,
    );
    assert_eq!(a, want);
    assert_eq!(a.rmbe_size.bytes(), 64 * 1024);
    assert_eq!(a.mtu(), Some(IbMtu::Mtu1024));
    assert_eq!(want.encode(AcceptConfirmKind::Accept), b);
}

#[test]
fn spec_d_confirm_v1_first_contact() {
    let b = dump(
        "0000: e2 d4 c3 d9 03 00 44 18 12 34 02 00 00 00 00 01
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
         0020: 02 00 00 00 00 01 00 04 56 00 00 56 78 01 00 00
         0030: b0 02 03 00 00 00 00 00 ab cd 00 00 00 12 34 56
         0040: e2 d4 c3 d9",
    );
    let ClcMessage::Confirm(c) = round_trip(&b) else {
        panic!()
    };
    let want = v1_accept_confirm(
        CLIENT_ID,
        client_gid(),
        CLIENT_MAC,
        true,
        0x000456,
        0x5678,
        0xb002,
        0,
        3,
        0xabcd_0000,
        0x123456,
    );
    assert_eq!(c, want);
    assert_eq!(c.rmbe_size.bytes(), 16 * 1024);
    assert_eq!(want.encode(AcceptConfirmKind::Confirm), b);
}

#[test]
fn spec_e_accept_v1_reused_link_group() {
    let b = dump(
        "0000: e2 d4 c3 d9 02 00 44 10 56 78 02 00 00 00 00 02
         0010: fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 02
         0020: 02 00 00 00 00 02 00 01 23 00 00 9a bc 01 00 00
         0030: a0 02 13 00 00 00 00 00 12 38 00 00 00 ab cd ef
         0040: e2 d4 c3 d9",
    );
    let ClcMessage::Accept(a) = round_trip(&b) else {
        panic!()
    };
    let want = v1_accept_confirm(
        SERVER_ID,
        server_gid(),
        SERVER_MAC,
        false,
        0x000123,
        0x9abc,
        0xa002,
        1,
        3,
        0x1238_0000,
        0xabcdef,
    );
    assert_eq!(a, want);
    assert_eq!(a.rmbe_size.bytes(), 32 * 1024);
    assert_eq!(want.encode(AcceptConfirmKind::Accept), b);
}

// ---------------------------------------------------------------- real captures

/// Formats a decoded message exactly as `lab/captures/decode.py` `clc_summary` does,
/// from the decoded fields (not from the bytes).
fn clc_summary(m: &ClcMessage, len: usize) -> String {
    let mut s = format!("CLC {} v{} len {}", m.msg_type().name(), m.version(), len);
    match m {
        ClcMessage::Accept(a) | ClcMessage::Confirm(a) => {
            let mtu = a.mtu().map_or(0, |m| m.bytes());
            s += &format!(
                " first_contact={} qpn=0x{:06x} rkey=0x{:08x} token=0x{:08x} rmbe={}K mtu={} vaddr=0x{:016x} psn=0x{:06x}",
                u8::from(a.first_contact),
                a.qpn,
                a.rmb_rkey,
                a.alert_token,
                a.rmbe_size.bytes() >> 10,
                mtu,
                a.rmb_vaddr,
                a.psn
            );
        }
        ClcMessage::Decline(d) => s += &format!(" diag=0x{:08x}", d.diagnosis.to_u32()),
        ClcMessage::Proposal(_) => {}
    }
    s
}

struct Capture {
    file: String,
    frame: u64,
    bytes: Vec<u8>,
    summary: String,
}

fn captures() -> Vec<Capture> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    let mut out = Vec::new();
    for f in files {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for m in v["clc"].as_array().unwrap() {
            out.push(Capture {
                file: f.file_name().unwrap().to_string_lossy().into_owned(),
                frame: m["frame"].as_u64().unwrap(),
                bytes: hex(m["hex"].as_str().unwrap()),
                summary: m["summary"].as_str().unwrap().to_string(),
            });
        }
    }
    out
}

fn find(file: &str, frame: u64) -> Vec<u8> {
    captures()
        .into_iter()
        .find(|c| c.file == file && c.frame == frame)
        .unwrap_or_else(|| panic!("{file} frame {frame} missing"))
        .bytes
}

#[test]
fn every_captured_clc_message_decodes_matches_summary_and_reencodes() {
    let caps = captures();
    // 2 + 3 + 0 + 0 + 3 + 6 messages in the six capture files
    assert_eq!(caps.len(), 14);
    let mut seen = std::collections::HashSet::new();
    for c in &caps {
        let m = ClcMessage::decode(&c.bytes)
            .unwrap_or_else(|e| panic!("{} frame {}: {e}", c.file, c.frame));
        assert_eq!(
            clc_summary(&m, c.bytes.len()),
            c.summary,
            "{} frame {}",
            c.file,
            c.frame
        );
        assert_eq!(
            m.encode(),
            c.bytes,
            "{} frame {} re-encode",
            c.file,
            c.frame
        );
        m.validate().unwrap();
        // the per-type decoders agree with ClcMessage::decode
        match &m {
            ClcMessage::Proposal(p) => assert_eq!(&Proposal::decode(&c.bytes).unwrap(), p),
            ClcMessage::Accept(a) => assert_eq!(
                AcceptConfirm::decode(&c.bytes).unwrap(),
                (AcceptConfirmKind::Accept, a.clone())
            ),
            ClcMessage::Confirm(a) => assert_eq!(
                AcceptConfirm::decode(&c.bytes).unwrap(),
                (AcceptConfirmKind::Confirm, a.clone())
            ),
            ClcMessage::Decline(d) => assert_eq!(&Decline::decode(&c.bytes).unwrap(), d),
        }
        seen.insert(m.msg_type());
    }
    assert_eq!(seen.len(), 4, "all four CLC types are covered");
}

#[test]
fn captured_v2_proposal_fields() {
    let b = find("smcr-v2-kernel-6.12.json", 4);
    let ClcMessage::Proposal(p) = ClcMessage::decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!(p.version, 2);
    assert_eq!(p.typev1, SmcPath::N);
    assert_eq!(p.typev2, SmcPath::R);
    assert!(p.typev2.offers_r() && !p.typev2.offers_d());
    // v1 fields are zero when v1 is not offered
    assert_eq!(p.peer_id, SystemId::default());
    assert!(p.gid.is_zero());
    assert!(p.mac.is_zero());
    assert_eq!(p.smcd, Some(SmcdInfo::default()));
    assert_eq!(p.prefixes, None);
    assert_eq!(p.smcd_v2_ext, None);
    let e = p.v2_ext.as_ref().unwrap();
    assert_eq!(e.eids, vec![Eid::parse_ueid("SMC-TEST-UEID").unwrap()]);
    assert_eq!(e.eids[0].to_string(), "SMC-TEST-UEID");
    assert_eq!(e.release, SMC_RELEASE_1);
    assert!(!e.seid);
    assert_eq!(e.roce_v2_gid, Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2)));
    assert_eq!(e.roce_v2_gid.to_string(), "::ffff:10.99.0.2");
    assert_eq!(e.max_conns, 255);
    assert_eq!(e.max_links, 2);
    assert_eq!(e.feature_mask, FEATURE_EMULATED_ISM_DEV);
    assert_eq!(p.encoded_len(), 156);

    // build the same proposal from values
    let built = Proposal {
        version: SMC_V2,
        typev1: SmcPath::N,
        typev2: SmcPath::R,
        peer_id: SystemId::default(),
        gid: Gid::ZERO,
        mac: Mac::default(),
        smcd: Some(SmcdInfo::default()),
        prefixes: None,
        v2_ext: Some(ProposalV2Ext {
            eids: vec![Eid::parse_ueid("SMC-TEST-UEID").unwrap()],
            release: 1,
            seid: false,
            roce_v2_gid: Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2)),
            max_conns: 255,
            max_links: 2,
            feature_mask: 1,
        }),
        smcd_v2_ext: None,
    };
    assert_eq!(built.encode(), b);
}

fn check_captured_accept_confirm(a: &AcceptConfirm, id: SystemId, ip_last: u8, mac_last: u8) {
    assert_eq!(a.version, 2);
    assert!(a.first_contact);
    assert_eq!(a.peer_id, id);
    assert_eq!(a.gid, Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, ip_last)));
    assert_eq!(a.mac, Mac([0x52, 0x54, 0, 0x5c, 0, mac_last]));
    assert_eq!(a.qpn, 0x12);
    assert_eq!(a.rmbe_idx, 1);
    assert_eq!(a.alert_token, 1);
    assert_eq!(a.rmbe_size.class(), 2);
    assert_eq!(a.mtu(), Some(IbMtu::Mtu1024));
    assert_eq!(a.eid.to_string(), "SMC-TEST-UEID");
    assert_eq!(a.eid, Eid::parse_ueid("SMC-TEST-UEID").unwrap());
    let f = a.fce.as_ref().unwrap();
    assert!(f.v2_direct);
    assert_eq!(f.os_type, OS_LINUX);
    assert_eq!(f.release, SMC_RELEASE_1);
    assert_eq!(f.hostname_str(), "smcvm");
    assert_eq!(f.hostname, FirstContactExt::hostname_from_str("smcvm"));
    assert_eq!(
        f.v2x,
        Some(FceV2x {
            max_conns: 255,
            max_links: 2,
            feature_mask: 1,
            vendor_opts: [0; 4]
        })
    );
}

#[test]
fn captured_first_contact_accept_and_confirm_fields() {
    let acc = find("smcr-v2-kernel-6.12.json", 7);
    let (kind, a) = AcceptConfirm::decode(&acc).unwrap();
    assert_eq!(kind, AcceptConfirmKind::Accept);
    check_captured_accept_confirm(&a, SystemId([0x98, 0x15, 0x52, 0x54, 0, 0x5c, 0, 1]), 1, 1);
    assert_eq!(a.rmb_rkey, 0x48a);
    assert_eq!(a.rmb_vaddr, 0xff2e_cb12_c08d_0000);
    assert_eq!(a.psn, 0x590fd9);
    assert_eq!(a.gid_list, None);
    assert_eq!(acc.len(), 160);

    let conf = find("smcr-v2-kernel-6.12.json", 9);
    let (kind, c) = AcceptConfirm::decode(&conf).unwrap();
    assert_eq!(kind, AcceptConfirmKind::Confirm);
    check_captured_accept_confirm(&c, SystemId([0x57, 0x05, 0x52, 0x54, 0, 0x5c, 0, 2]), 2, 2);
    assert_eq!(c.rmb_rkey, 0x4e5);
    assert_eq!(c.rmb_vaddr, 0xff2c_b4b6_84a5_0000);
    assert_eq!(c.psn, 0x503714);
    assert_eq!(
        c.gid_list,
        Some(vec![Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2))])
    );
    assert_eq!(conf.len(), 180);
    assert_eq!(c.encode(AcceptConfirmKind::Confirm), conf);
}

#[test]
fn captured_reuse_accept_confirm_and_decline() {
    let (_, a) = AcceptConfirm::decode(&find("smcr-v2-kernel-6.12.json", 375)).unwrap();
    assert!(!a.first_contact);
    assert_eq!(a.fce, None);
    assert_eq!(a.gid_list, None);
    assert_eq!(a.alert_token, 2);
    assert_eq!(a.encoded_len(AcceptConfirmKind::Accept), 108);

    let d = Decline::decode(&find("smcr-v2-kernel-6.12-decline.json", 6)).unwrap();
    assert_eq!(d.diagnosis, DeclineCode::NoSmcDev);
    assert_eq!(d.version, 2);
    assert_eq!(d.os_type, OS_LINUX);
    assert_eq!(d.peer_id, SystemId([0x98, 0x15, 0x52, 0x54, 0, 0x5c, 0, 1]));
    assert_eq!(
        d,
        Decline::new(2, d.peer_id, DeclineCode::NoSmcDev),
        "Linux builds declines as Decline::new does"
    );
}

#[test]
fn captured_loopback_mtu_4096_and_zero_mac() {
    let (_, a) = AcceptConfirm::decode(&find("smcr-v2-kernel-6.12-loopback-clc.json", 6)).unwrap();
    assert_eq!(a.mtu(), Some(IbMtu::Mtu4096));
    assert!(a.mac.is_zero());
    assert!(!a.peer_id.is_valid());
    assert_eq!(a.qpn, 0x13);
    assert_eq!(a.gid.to_string(), "::ffff:127.0.0.1");
}

// ---------------------------------------------------------------- decline codes

#[test]
fn decline_codes_table() {
    use DeclineCode::*;
    let table: &[(DeclineCode, u32)] = &[
        (Mem, 0x01010000),
        (TimeoutCl, 0x02010000),
        (TimeoutAl, 0x02020000),
        (CnfErr, 0x03000000),
        (PeerNoSmc, 0x03010000),
        (IpSec, 0x03020000),
        (NoSmcDev, 0x03030000),
        (NoSmcDDev, 0x03030001),
        (NoSmcRDev, 0x03030002),
        (NoIsm2Supp, 0x03030003),
        (NoV2Ext, 0x03030004),
        (NoV2DExt, 0x03030005),
        (NoSeid, 0x03030006),
        (NoSmcD2Dev, 0x03030007),
        (NoUeid, 0x03030008),
        (ReleaseErr, 0x03030009),
        (MaxConnErr, 0x0303000a),
        (MaxLinkErr, 0x0303000b),
        (ModeUnsupp, 0x03040000),
        (RmbeEc, 0x03050000),
        (OptUnsupp, 0x03060000),
        (DiffPrefix, 0x03070000),
        (GetVlanErr, 0x03080000),
        (IsmVlanErr, 0x03090000),
        (NoActLink, 0x030a0000),
        (NoSrvLink, 0x030b0000),
        (VersMismat, 0x030c0000),
        (MaxDmb, 0x030d0000),
        (NoRoute, 0x030e0000),
        (NoIndirect, 0x030f0000),
        (SyncErr, 0x04000000),
        (PeerDecl, 0x05000000),
        (IntErr, 0x09990000),
        (ErrRtok, 0x09990001),
        (ErrRdyLnk, 0x09990002),
        (ErrRegBuf, 0x09990003),
        // 2017 v1 codes
        (Timeout, 0x02000000),
        (LegacyTcl, 0x02040000),
        (LegacyReply, 0x06000000),
        (LegacySend, 0x07000000),
        (LegacyIntErr, 0x99990000),
    ];
    assert_eq!(table.len(), DeclineCode::KNOWN.len());
    for (c, v) in table {
        assert_eq!(c.to_u32(), *v, "{c:?}");
        assert_eq!(DeclineCode::from_u32(*v), *c);
        assert!(DeclineCode::KNOWN.contains(c));
        assert!(c.name().unwrap().starts_with("SMC_CLC_DECL_"));
        assert!(!c.description().is_empty());
    }
    assert_eq!(PeerNoSmc.description(), "peer did not indicate SMC");
    // §4.1: these three are recorded locally and never sent in a Decline
    let local: Vec<_> = DeclineCode::KNOWN
        .iter()
        .filter(|c| c.is_local_only())
        .collect();
    assert_eq!(local, [&PeerNoSmc, &OptUnsupp, &PeerDecl]);
    assert_eq!(
        PeerNoSmc.to_string(),
        "0x03010000 (peer did not indicate SMC)"
    );
    assert_eq!(
        DeclineCode::from_u32(0x0303_0000).to_string(),
        "0x03030000 (no SMC device found (R or D))"
    );
    let u = DeclineCode::from_u32(0x0310_0000);
    assert_eq!(u, Unknown(0x0310_0000));
    assert_eq!(u.to_u32(), 0x0310_0000);
    assert_eq!(u.name(), None);
    assert_eq!(u.to_string(), "0x03100000 (unknown reason code)");
    // to_u32(from_u32(x)) == x over a spread of values
    for x in (0..=u32::MAX)
        .step_by(65_521)
        .chain([0, 1, u32::MAX, 0x0999_0003])
    {
        assert_eq!(DeclineCode::from_u32(x).to_u32(), x);
    }
}

#[test]
fn constants() {
    assert_eq!(CLC_WAIT_TIME, std::time::Duration::from_secs(6));
    assert_eq!(CLC_WAIT_TIME_SHORT, std::time::Duration::from_secs(1));
    assert_eq!(PROPOSAL_MAX_LEN, 652);
    assert_eq!(CLC_HEADER_LEN, 8);
    assert_eq!(EYECATCHER_SMCR, [0xe2, 0xd4, 0xc3, 0xd9]);
    assert_eq!(EYECATCHER_SMCD, [0xe2, 0xd4, 0xc3, 0xc4]);
    for p in SmcPath::ALL {
        assert_eq!(SmcPath::from_bits(p.bits()), p);
    }
    assert!(SmcPath::B.offers_r() && SmcPath::B.offers_d());
    assert!(!SmcPath::N.offers_r() && !SmcPath::N.offers_d());
    assert!(SmcPath::R.offers_r() && !SmcPath::R.offers_d());
    assert!(!SmcPath::D.offers_r() && SmcPath::D.offers_d());
}
