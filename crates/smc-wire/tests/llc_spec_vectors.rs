//! `protocol-llc-cdc.md` §8.a, §8.b, §8.d: the derived LLC test vectors decode to the
//! stated fields and re-encode byte-identically. (The CDC vectors of §8.c are in
//! `cdc_spec_vectors.rs`.) All vectors were checked against `net/smc/smc_llc.c`
//! (struct layouts, `smc_llc_send_*`, `smc_lgr_free_work` for the idle DELETE_LINK
//! ALL|ORDERLY with reason PROG_INIT_TERM); none needed a correction.

use smc_wire::llc::*;
use smc_wire::types::{Gid, Mac};
use smc_wire::WireError;
use std::net::Ipv4Addr;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn with_zeros(prefix: &str, total: usize) -> Vec<u8> {
    let mut v = hex(prefix);
    v.resize(total, 0);
    v
}

#[test]
fn a_test_link_v1_request_and_response() {
    let req_bytes = with_zeros("072c0000", 44);
    let resp_bytes = with_zeros("072c0080", 44);
    let m = LlcMessage::decode(&req_bytes).unwrap();
    let LlcMessage::TestLink(req) = m.clone() else {
        panic!("not TEST_LINK: {m:?}")
    };
    assert_eq!(req.version, LlcVersion::V1);
    assert_eq!(req.flags, 0);
    assert!(!req.is_response());
    assert_eq!(req.user_data, [0; 16]);
    assert_eq!(m.encode(), req_bytes);
    assert_eq!(req, TestLink::request(LlcVersion::V1));

    let resp = TestLink::decode(&resp_bytes).unwrap();
    assert!(resp.is_response());
    assert_eq!(resp, TestLink::response_to(&req));
    assert_eq!(TestLink::response_to(&req).encode(), resp_bytes);
}

#[test]
fn a_test_link_v2_little_endian_x86_form() {
    let b = with_zeros("272c0000", 44);
    let m = TestLink::decode(&b).unwrap();
    assert_eq!(m.version, LlcVersion::V2_LE);
    assert_eq!(m.flags, 0);
    assert_eq!(m.encode(), b);
    assert_eq!(TestLink::request(LlcVersion::V2_LE).encode(), b);
    let h = LlcHeader::decode(&b).unwrap();
    assert_eq!(h.length, 44);
    assert_eq!(h.llc_type, LlcType::TestLink);
    // the response as the capture shows it: 27 2c 00 80
    assert_eq!(
        TestLink::response_to(&m).encode(),
        with_zeros("272c0080", 44)
    );
}

#[test]
fn a_test_link_v2_big_endian_s390_form() {
    let b = with_zeros("27002c00", 44);
    let m = TestLink::decode(&b).unwrap();
    assert_eq!(m.version, LlcVersion::V2_BE);
    assert_eq!(m.encode(), b, "byte order of length_v2 must be remembered");
    assert_eq!(
        TestLink::response_to(&m).encode(),
        with_zeros("27002c80", 44)
    );
}

const CONFIRM_LINK_REQ: &str =
    "012c000302000000000100000000000000000000ffffc0a8010a000123010000010102000000000000000000";

#[test]
fn b_confirm_link_v1_request() {
    let b = hex(CONFIRM_LINK_REQ);
    assert_eq!(b.len(), 44);
    let m = ConfirmLink::decode(&b).unwrap();
    assert_eq!(m.version, LlcVersion::V1);
    assert_eq!(m.flags, 0x03);
    assert!(m.no_rmbe_eyec());
    assert!(!m.is_response());
    assert_eq!(m.sender_mac, Mac([2, 0, 0, 0, 0, 1]));
    assert_eq!(m.sender_gid, Gid::from_ipv4(Ipv4Addr::new(192, 168, 1, 10)));
    assert_eq!(m.sender_qpn, 0x000123);
    assert_eq!(m.link_num, 1);
    assert_eq!(m.link_uid, 0x0000_0101);
    assert_eq!(m.max_links, 2);
    assert_eq!(m.max_conns, 0);
    assert_eq!(m.encode(), b);
    let built = ConfirmLink::new(
        LlcVersion::V1,
        false,
        Mac([2, 0, 0, 0, 0, 1]),
        Gid::from_ipv4(Ipv4Addr::new(192, 168, 1, 10)),
        0x123,
        1,
        0x101,
        LINKS_ADD_LNK_MAX,
        0,
    );
    assert_eq!(built, m);
    assert_eq!(LlcMessage::decode(&b).unwrap(), LlcMessage::ConfirmLink(m));
}

#[test]
fn b_confirm_link_v1_response() {
    let b = hex(
        "012c0083 020000000002 00000000000000000000ffffc0a80114 000456 01 00000201 02 00
         0000000000000000",
    );
    assert_eq!(b.len(), 44);
    let m = ConfirmLink::decode(&b).unwrap();
    assert_eq!(m.flags, 0x83);
    assert!(m.is_response());
    assert_eq!(m.sender_mac, Mac([2, 0, 0, 0, 0, 2]));
    assert_eq!(m.sender_gid, Gid::from_ipv4(Ipv4Addr::new(192, 168, 1, 20)));
    assert_eq!(m.sender_qpn, 0x456);
    assert_eq!(m.link_num, 1);
    assert_eq!(m.link_uid, 0x0000_0201);
    assert_eq!(m.max_links, 2);
    assert_eq!(m.max_conns, 0);
    assert_eq!(m.encode(), b);
}

#[test]
fn d_delete_link_all_orderly_program_initiated() {
    let b = with_zeros("042c0060 00 00030000", 44);
    let m = DeleteLink::decode(&b).unwrap();
    assert_eq!(m.version, LlcVersion::V1);
    assert!(m.is_all());
    assert!(m.is_orderly());
    assert!(!m.is_response());
    assert_eq!(m.link_num, 0);
    assert_eq!(m.reason, DEL_PROG_INIT_TERM);
    assert_eq!(m.encode(), b);
    assert_eq!(
        DeleteLink::delete_all(LlcVersion::V1, true, DEL_PROG_INIT_TERM),
        m
    );
}

#[test]
fn d_confirm_rkey_with_one_extra_rtoken() {
    let b = with_zeros(
        "062c0000 01 00001234 00000000dead0000 02 00005678 00000000beef0000",
        44,
    );
    let m = ConfirmRkey::decode(&b).unwrap();
    assert_eq!(m.flags, 0);
    assert_eq!(m.num_rkeys, 1);
    assert_eq!(m.rkey, 0x1234);
    assert_eq!(m.vaddr, 0xdead_0000);
    assert_eq!(
        m.additional(),
        &[LinkRtoken {
            link_id: 2,
            rkey: 0x5678,
            vaddr: 0xbeef_0000
        }]
    );
    assert_eq!(m.others[1], LinkRtoken::default());
    assert_eq!(m.encode(), b);
    let built = ConfirmRkey::request(
        LlcVersion::V1,
        0x1234,
        0xdead_0000,
        &[LinkRtoken {
            link_id: 2,
            rkey: 0x5678,
            vaddr: 0xbeef_0000,
        }],
    );
    assert_eq!(built, m);
    // the response is the echo with RESP, and NEG|RETRY when it failed
    let ok = ConfirmRkey::response_to(&m, true).encode();
    let mut want = b.clone();
    want[3] = 0x80;
    assert_eq!(ok, want);
    let bad = ConfirmRkey::response_to(&m, false);
    assert!(bad.is_negative() && bad.is_retry() && bad.is_response());
    want[3] = 0xB0;
    assert_eq!(bad.encode(), want);
}

#[test]
fn add_link_v1_reject_has_reason_in_byte_2() {
    // v1 ADD_LINK request as a Linux server would send it, then the reject §11.3 asks for
    let req = AddLink {
        version: LlcVersion::V1,
        flags: 0,
        reject_reason: 0,
        sender_mac: Mac([2, 0, 0, 0, 0, 1]),
        sender_gid: Gid::roce_v1_link_local(Mac([2, 0, 0, 0, 0, 1])),
        sender_qpn: 0x13,
        link_num: 2,
        qp_mtu: 3,
        initial_psn: 0xe0510d,
        ext: None,
    };
    let b = req.encode();
    assert_eq!(&b[..4], &[0x02, 0x2c, 0x00, 0x00]);
    let rej = AddLink::reject_for(&AddLink::decode(&b).unwrap());
    let rb = rej.encode();
    assert_eq!(&rb[..4], &[0x02, 0x2c, 0x01, 0xc0]);
    assert_eq!(&rb[4..], &b[4..]);
    let back = AddLink::decode(&rb).unwrap();
    assert!(back.is_reject() && back.is_response());
    assert_eq!(back.reject_reason, REJ_RSN_NO_ALT_PATH);
}

#[test]
fn typed_decoder_refuses_other_type() {
    let b = with_zeros("072c0000", 44);
    assert!(matches!(
        ConfirmLink::decode(&b),
        Err(WireError::InvalidField {
            field: "LLC type",
            value: 7
        })
    ));
}

#[test]
fn constants() {
    assert_eq!(WAIT_TIME.as_secs(), 2);
    assert_eq!(WAIT_FIRST_TIME.as_secs(), 5);
    assert_eq!(TESTLINK_DEFAULT_TIME.as_secs(), 30);
    assert_eq!(FLOW_INITIATE_TIMEOUT, WAIT_TIME * 10);
    assert_eq!(CLIENT_FIRST_CONFIRM_LINK_WAIT, WAIT_TIME * 2);
    assert_eq!(LLC_V1_LEN, 44);
    assert_eq!(LLC_V2_MAX_LEN, 8192);
    assert_eq!(ADD_LINK_V2_MAX_RKEYS, 507);
    for (t, c) in LlcType::ALL.iter().zip(1u8..) {
        assert_eq!(t.code(), c);
        assert_eq!(LlcType::from_code(c), Some(*t));
    }
    assert_eq!(LlcType::from_code(0), None);
    assert_eq!(LlcType::from_code(10), None);
    assert!(is_linux_handled(0x27) && is_linux_handled(0x03) && is_linux_handled(0x08));
    assert!(!is_linux_handled(0x05) && !is_linux_handled(0x23) && !is_linux_handled(0x28));
    assert!(!is_linux_handled(0x0A) && !is_linux_handled(0xFE));
}
