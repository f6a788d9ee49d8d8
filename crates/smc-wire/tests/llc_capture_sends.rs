//! Every LLC payload among the real kernel RDMA SENDs in `tests/vectors/*.json`
//! (key "sends", retransmissions included) decodes, the decoded struct reproduces the
//! capture decoder's summary string (`lab/captures/decode.py` `llc_summary`), and
//! re-encoding gives back the exact bytes. CDC payloads are covered by
//! `cdc_capture_sends.rs`.

use smc_wire::llc::*;
use smc_wire::types::Gid;
use std::path::PathBuf;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// (file, frame, hex, summary) of every SEND in every vector file.
pub fn all_sends() -> Vec<(String, u64, String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "vector files missing in {dir:?}");
    let mut out = Vec::new();
    for f in files {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for s in v["sends"].as_array().unwrap() {
            out.push((
                f.file_name().unwrap().to_string_lossy().into_owned(),
                s["frame"].as_u64().unwrap(),
                s["hex"].as_str().unwrap().to_string(),
                s["summary"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

/// `decode.py` `gid_str(...).split(" ")[0]`.
fn gid_str(g: Gid) -> String {
    match g.to_ipv4_mapped() {
        Some(v4) => v4.to_string(),
        None => g.to_ipv6().to_string(),
    }
}

fn del_rsn(r: u32) -> &'static str {
    match r {
        0x0001_0000 => "lost path",
        0x0002_0000 => "operator initiated termination",
        0x0003_0000 => "program initiated termination",
        0x0004_0000 => "LLC protocol violation",
        0x0005_0000 => "asymmetric link no longer needed",
        0x0010_0000 => "unknown link id",
        0x0020_0000 => "unknown link group",
        _ => "?",
    }
}

/// `decode.py` `llc_flags`.
fn llc_flags(t: LlcType, fl: u8) -> String {
    let mut n: Vec<String> = Vec::new();
    if fl & 0x80 != 0 {
        n.push("RESP".into());
    }
    let names: &[(u8, &str)] = match t {
        LlcType::ConfirmLink => &[(0x03, "NO_RMBE_EYEC(0x03)")],
        LlcType::AddLink => &[(0x40, "REJ")],
        LlcType::DeleteLink => &[(0x40, "ALL"), (0x20, "ORDERLY")],
        LlcType::ConfirmRkey => &[(0x20, "NEG"), (0x10, "RETRY")],
        LlcType::DeleteRkey => &[(0x20, "NEG")],
        _ => &[],
    };
    let mut used = 0x80u8;
    for (bit, nm) in names {
        if fl & bit == *bit {
            n.push((*nm).into());
            used |= bit;
        }
    }
    if fl & !used != 0 {
        n.push(format!("other bits 0x{:02x}", fl & !used));
    }
    format!(
        "0x{:02x} {}",
        fl,
        if n.is_empty() {
            "request".to_string()
        } else {
            n.join("+")
        }
    )
}

/// `decode.py` `llc_summary`, computed from the decoded message only.
pub fn llc_summary(m: &LlcMessage) -> String {
    let t = m.llc_type();
    let fl = m.flags();
    let (ver, len) = match m.version() {
        LlcVersion::V1 => ("v0", 44usize),
        // decode.py prints the little-endian reading of bytes 1..2
        LlcVersion::V2 { length_order } => (
            "v2",
            usize::from(u16::from_le_bytes(
                length_order.bytes(m.encoded_len() as u16),
            )),
        ),
    };
    let mut s = format!(
        "LLC{} {} {} len={}",
        ver,
        t.name(),
        if fl & 0x80 != 0 { "resp" } else { "req" },
        len
    );
    s += &format!(" flags={}", llc_flags(t, fl));
    match m {
        LlcMessage::ConfirmLink(c) => {
            s += &format!(
                " mac={} gid={} qpn=0x{:06x} link_num={} link_uid=0x{:08x} max_links={} max_conns={}",
                c.sender_mac,
                gid_str(c.sender_gid),
                c.sender_qpn,
                c.link_num,
                c.link_uid,
                c.max_links,
                c.max_conns
            );
        }
        LlcMessage::AddLink(a) => {
            s += &format!(
                " mac={} gid={} qpn=0x{:06x} link_num={} mtu={} psn=0x{:06x}",
                a.sender_mac,
                gid_str(a.sender_gid),
                a.sender_qpn,
                a.link_num,
                a.qp_mtu,
                a.initial_psn
            );
            if let Some(e) = &a.ext {
                let n = u16::from_le_bytes(e.num_rkeys_order.bytes(e.rkeys.len() as u16));
                s += &format!(
                    " ext: direct={} target_gid={} num_rkeys(LE)={}",
                    u8::from(e.v2_direct),
                    gid_str(e.client_target_gid),
                    n
                );
            }
        }
        LlcMessage::DeleteLink(d) => {
            s += &format!(
                " link_num={} reason=0x{:08x} ({})",
                d.link_num,
                d.reason,
                del_rsn(d.reason)
            );
        }
        LlcMessage::ConfirmRkey(c) => {
            s += &format!(
                " num_rkeys={} rkey=0x{:08x} vaddr=0x{:016x}",
                c.num_rkeys, c.rkey, c.vaddr
            );
        }
        LlcMessage::DeleteRkey(d) => {
            s += &format!(
                " num_rkeys={} err_mask=0x{:02x} rkey0=0x{:08x}",
                d.rkeys.len(),
                d.err_mask,
                d.rkeys.first().copied().unwrap_or(0)
            );
        }
        _ => {}
    }
    s
}

#[test]
fn every_captured_llc_send_decodes_summarises_and_reencodes() {
    let mut n = 0;
    let mut types = std::collections::BTreeSet::new();
    for (file, frame, h, summary) in all_sends() {
        let b = hex(&h);
        if b[0] == 0xFE {
            continue;
        }
        let m =
            LlcMessage::decode(&b).unwrap_or_else(|e| panic!("{file} frame {frame}: {e} ({h})"));
        assert_eq!(llc_summary(&m), summary, "{file} frame {frame}");
        assert_eq!(m.encode(), b, "{file} frame {frame}: re-encoding differs");
        assert_eq!(m.encoded_len(), b.len());
        // every captured LLC message is SMC-Rv2 with a little-endian length_v2
        assert_eq!(m.version(), LlcVersion::V2_LE, "{file} frame {frame}");
        types.insert(m.llc_type());
        n += 1;
    }
    assert_eq!(n, 90, "number of captured LLC sends changed");
    assert_eq!(types.len(), 6);
}

#[test]
fn captured_add_link_exchange_matches_captures_readme_8_3() {
    // main capture frame 15 (request) and frame 17 (the client's reject)
    let sends = all_sends();
    let find =
        |f: &str, frame: u64| hex(&sends.iter().find(|s| s.0 == f && s.1 == frame).unwrap().2);
    let req_b = find("smcr-v2-kernel-6.12.json", 15);
    let rej_b = find("smcr-v2-kernel-6.12.json", 17);
    let req = AddLink::decode(&req_b).unwrap();
    assert_eq!(req_b.len(), 88);
    let e = req.ext.as_ref().unwrap();
    assert!(e.v2_direct);
    assert_eq!(e.num_rkeys_order, ByteOrder::Little);
    assert_eq!(
        e.rkeys,
        vec![AddLinkRkey {
            rmb_key: 0x48a,
            rmb_key_new: 0x687,
            rmb_vaddr_new: 0xff2e_cb12_c08d_0000
        }]
    );
    assert_eq!(req.qp_mtu, 3);
    assert_eq!(req.initial_psn, 0xe0510d);
    // our reject for that request is byte-identical to the Linux client's
    let rej = AddLink::reject_for(&req);
    assert_eq!(rej.encode(), rej_b);
    let got = AddLink::decode(&rej_b).unwrap();
    assert!(got.is_reject() && got.is_response());
    assert_eq!(got.reject_reason, 0);
    assert_eq!(got.ext, None);
}

#[test]
fn captured_responses_are_what_our_constructors_build() {
    let sends = all_sends();
    let get = |frame: u64| {
        let s = sends
            .iter()
            .find(|s| s.0 == "smcr-v2-kernel-6.12.json" && s.1 == frame)
            .unwrap();
        LlcMessage::decode(&hex(&s.2)).unwrap()
    };
    // TEST_LINK 731 -> 733
    let (LlcMessage::TestLink(req), LlcMessage::TestLink(resp)) = (get(731), get(733)) else {
        panic!()
    };
    assert_eq!(TestLink::response_to(&req), resp);
    // CONFIRM_RKEY 371 -> 373
    let (LlcMessage::ConfirmRkey(req), LlcMessage::ConfirmRkey(resp)) = (get(371), get(373)) else {
        panic!()
    };
    assert_eq!(ConfirmRkey::response_to(&req, true), resp);
    // DELETE_RKEY v2 356 -> 360: rkeys zeroed, count kept, err count 0
    let (LlcMessage::DeleteRkey(req), LlcMessage::DeleteRkey(resp)) = (get(356), get(360)) else {
        panic!()
    };
    assert_eq!(req.rkeys, vec![0x4e5]);
    assert_eq!(DeleteRkey::response_to(&req, |_| false), resp);
    let neg = DeleteRkey::response_to(&req, |_| true);
    assert!(neg.is_negative());
    assert_eq!(neg.err_mask, 1, "v2: byte 5 is a count");
    assert_eq!(neg.rkeys, vec![0]);
}
