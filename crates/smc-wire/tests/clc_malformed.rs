//! Malformed CLC input: every case must give a specific typed error, never a panic.

use smc_wire::clc::*;
use smc_wire::WireError;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Real kernel messages (tests/vectors/smcr-v2-kernel-6.12.json).
const PROPOSAL_V2: &str = "e2d4c3d901009c22000000000000000000000000000000000000000000000000000000000000000000000000000000000000001c00000000000000000000000000000000000000000000000000000000010000100000000000000000000000000000ffff0a630002ff020001000000000000000000000000534d432d544553542d5545494420202020202020202020202020202020202020e2d4c3d9";
const ACCEPT_FC: &str = "e2d4c3d90200a02898155254005c000100000000000000000000ffff0a6300015254005c00010000120000048a01000000012300ff2ecb12c08d000000590fd9534d432d544553542d5545494420202020202020202020202020202020202020000000000000000080210000736d63766d202020202020202020202020202020202020202020202020202020ff020001000000000000000000000000e2d4c3d9";
const CONFIRM_FC: &str = "e2d4c3d90300b42857055254005c000200000000000000000000ffff0a6300025254005c0002000012000004e501000000012300ff2cb4b684a5000000503714534d432d544553542d5545494420202020202020202020202020202020202020000000000000000080210000736d63766d202020202020202020202020202020202020202020202020202020ff0200010000000000000000000000000100000000000000000000000000ffff0a630002e2d4c3d9";
const ACCEPT_REUSE: &str = "e2d4c3d902006c2098155254005c000100000000000000000000ffff0a6300015254005c00010000120000048a01000000022300ff2ecb12c08d000000590fd9534d432d544553542d55454944202020202020202020202020202020202020200000000000000000e2d4c3d9";
const DECLINE_V2: &str =
    "e2d4c3d904002c2098155254005c0001030300002000000000000000000000000000000000000000e2d4c3d9";
/// spec §6 (c), (b1), (b3)
const ACCEPT_V1: &str = "
    e2 d4 c3 d9 02 00 44 18 56 78 02 00 00 00 00 02
    fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 02
    02 00 00 00 00 02 00 01 23 00 00 12 34 01 00 00
    a0 01 23 00 00 00 00 00 12 34 00 00 00 ab cd ef
    e2 d4 c3 d9";
const PROPOSAL_V1: &str = "
    e2 d4 c3 d9 01 00 34 10 12 34 02 00 00 00 00 01
    fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
    02 00 00 00 00 01 00 00 c0 a8 0a 00 18 00 00 00
    e2 d4 c3 d9";
const PROPOSAL_V1_V6: &str = "
    e2 d4 c3 d9 01 00 45 10 12 34 02 00 00 00 00 01
    fe 80 00 00 00 00 00 00 00 00 00 ff fe 00 00 01
    02 00 00 00 00 01 00 00 00 00 00 00 00 00 00 01
    20 01 0d b8 00 01 00 00 00 00 00 00 00 00 00 00
    40 e2 d4 c3 d9";

fn all_valid() -> Vec<Vec<u8>> {
    [
        PROPOSAL_V2,
        ACCEPT_FC,
        CONFIRM_FC,
        ACCEPT_REUSE,
        DECLINE_V2,
        ACCEPT_V1,
        PROPOSAL_V1,
        PROPOSAL_V1_V6,
    ]
    .iter()
    .map(|s| hex(s))
    .collect()
}

fn set_len(b: &mut [u8], len: usize) {
    b[5..7].copy_from_slice(&(len as u16).to_be_bytes());
}

fn err(b: &[u8]) -> WireError {
    match ClcMessage::decode(b) {
        Ok(m) => panic!("decoded malformed input: {m:?}"),
        Err(e) => e,
    }
}

#[test]
fn fixtures_are_valid() {
    for b in all_valid() {
        let m = ClcMessage::decode(&b).unwrap();
        assert_eq!(m.encode(), b);
    }
}

#[test]
fn every_truncation_point_is_rejected() {
    for b in all_valid() {
        for k in 0..b.len() {
            let e = err(&b[..k]);
            if k < CLC_HEADER_LEN {
                assert!(
                    matches!(e, WireError::Truncated { needed, available, .. } if available == k && needed > k),
                    "k={k}: {e:?}"
                );
            } else {
                // the header announces more than the buffer holds
                assert_eq!(
                    e,
                    WireError::BadLength {
                        what: "CLC message (header length vs buffer)",
                        claimed: b.len(),
                        expected: k
                    },
                    "k={k}"
                );
            }
            // ClcHeader::peek works as soon as 8 bytes are there
            if k >= CLC_HEADER_LEN {
                assert_eq!(
                    usize::from(ClcHeader::peek(&b[..k]).unwrap().length),
                    b.len()
                );
            }
        }
    }
}

#[test]
fn truncation_with_consistent_header_is_rejected() {
    // Cut the message short, fix up the header length and put a valid trailer at the
    // new end: the layout check must catch every such cut.
    for b in all_valid() {
        let is_decline = b[4] == CLC_DECLINE;
        for k in CLC_MIN_LEN..b.len() {
            let mut t = b[..k].to_vec();
            set_len(&mut t, k);
            t[k - 4..].copy_from_slice(&EYECATCHER_SMCR);
            // The two cuts that leave a well-formed message: a first-contact Accept
            // with the 36-byte fce, and a first-contact Confirm without GID list.
            let fc_v2 = b[7] == 0x28;
            if fc_v2 && ((b[4] == CLC_ACCEPT && k == 144) || (b[4] == CLC_CONFIRM && k == 160)) {
                assert_eq!(ClcMessage::decode(&t).unwrap().encode(), t);
                continue;
            }
            let e = err(&t);
            assert!(
                matches!(
                    e,
                    WireError::BadLength { .. }
                        | WireError::Truncated { .. }
                        | WireError::InvalidField { .. }
                ),
                "k={k} decline={is_decline}: {e:?}"
            );
        }
    }
}

#[test]
fn short_header() {
    assert_eq!(
        err(&[]),
        WireError::Truncated {
            what: "CLC header",
            needed: 4,
            available: 0
        }
    );
    assert!(matches!(
        ClcHeader::peek(&[0xe2, 0xd4, 0xc3, 0xd9, 1, 0, 0x9c]),
        Err(WireError::Truncated {
            needed: 8,
            available: 7,
            ..
        })
    ));
}

#[test]
fn bad_eyecatcher() {
    for b in all_valid() {
        let mut t = b.clone();
        t[0] = 0xe3;
        assert_eq!(err(&t), WireError::BadEyecatcher([0xe3, 0xd4, 0xc3, 0xd9]));
        assert_eq!(
            ClcHeader::peek(&t),
            Err(WireError::BadEyecatcher([0xe3, 0xd4, 0xc3, 0xd9]))
        );
        // ASCII "SMCR" is not an eyecatcher
        t[..4].copy_from_slice(b"SMCR");
        assert_eq!(err(&t), WireError::BadEyecatcher(*b"SMCR"));
    }
}

#[test]
fn bad_trailer_rejected_except_on_decline() {
    for b in all_valid() {
        let mut t = b.clone();
        let n = t.len();
        t[n - 1] = 0x00;
        if b[4] == CLC_DECLINE {
            // Linux does not check a Decline's trailer
            let ClcMessage::Decline(d) = ClcMessage::decode(&t).unwrap() else {
                panic!()
            };
            assert_eq!(d.diagnosis, DeclineCode::NoSmcDev);
            // but the encoder writes it
            assert_eq!(d.encode(), b);
        } else {
            assert_eq!(err(&t), WireError::BadTrailer([0xe2, 0xd4, 0xc3, 0x00]));
        }
        // an SMCD trailer is accepted (and normalised to SMCR on encode)
        let mut t = b.clone();
        t[n - 4..].copy_from_slice(&EYECATCHER_SMCD);
        let m = ClcMessage::decode(&t).unwrap();
        assert_eq!(m.encode(), b);
    }
}

#[test]
fn smcd_header_eyecatcher_accepted_for_proposal_and_decline() {
    for s in [PROPOSAL_V2, PROPOSAL_V1, DECLINE_V2] {
        let mut t = hex(s);
        t[..4].copy_from_slice(&EYECATCHER_SMCD);
        let m = ClcMessage::decode(&t).unwrap();
        assert!(ClcHeader::peek(&t).unwrap().eyecatcher_smcd);
        assert_eq!(m.encode(), hex(s));
    }
}

#[test]
fn header_length_disagreeing_with_buffer() {
    for b in all_valid() {
        let mut longer = b.clone();
        longer.extend_from_slice(&[0, 0, 0, 0]);
        assert_eq!(
            err(&longer),
            WireError::BadLength {
                what: "CLC message (header length vs buffer)",
                claimed: b.len(),
                expected: b.len() + 4
            }
        );
        let mut t = b.clone();
        set_len(&mut t, b.len() - 1);
        assert!(
            matches!(err(&t), WireError::BadLength { claimed, expected, .. } if claimed == b.len() - 1 && expected == b.len())
        );
        // a header length below header + trailer
        for l in 0..CLC_MIN_LEN {
            let mut t = b.clone();
            set_len(&mut t, l);
            assert_eq!(
                err(&t),
                WireError::BadLength {
                    what: "CLC header length",
                    claimed: l,
                    expected: 12
                }
            );
        }
    }
}

#[test]
fn unknown_type() {
    for ty in [0u8, 5, 6, 0x7f, 0xff] {
        let mut t = hex(DECLINE_V2);
        t[4] = ty;
        assert_eq!(
            err(&t),
            WireError::UnknownType {
                family: "CLC",
                value: ty
            }
        );
    }
}

#[test]
fn version_zero() {
    for b in all_valid() {
        let mut t = b.clone();
        t[7] &= 0x0f;
        assert_eq!(err(&t), WireError::BadVersion(0));
        assert_eq!(ClcHeader::peek(&t), Err(WireError::BadVersion(0)));
    }
}

#[test]
fn per_type_decoders_reject_other_types() {
    let d = hex(DECLINE_V2);
    assert!(matches!(
        Proposal::decode(&d),
        Err(WireError::InvalidField { value: 4, .. })
    ));
    assert!(matches!(
        AcceptConfirm::decode(&d),
        Err(WireError::InvalidField { value: 4, .. })
    ));
    assert!(matches!(
        Decline::decode(&hex(PROPOSAL_V2)),
        Err(WireError::InvalidField { value: 1, .. })
    ));
}

// ---------------------------------------------------------------- Proposal

#[test]
fn proposal_ipv6_count_nine() {
    // v1 proposal with 9 IPv6 prefixes: length consistent, count over Linux's limit
    let mut b = hex(PROPOSAL_V1).to_vec();
    b.truncate(48);
    b[47] = 9;
    for i in 0..9u8 {
        let mut e = [0u8; 17];
        e[0] = 0x20;
        e[1] = i;
        e[16] = 64;
        b.extend_from_slice(&e);
    }
    b.extend_from_slice(&EYECATCHER_SMCR);
    let n = b.len();
    set_len(&mut b, n);
    assert_eq!(n, 48 + 9 * 17 + 4);
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "ipv6 prefix count",
            value: 9
        }
    );
    // with 8 it is fine
    let mut b8 = b[..48].to_vec();
    b8[47] = 8;
    b8.extend_from_slice(&b[48..48 + 8 * 17]);
    b8.extend_from_slice(&EYECATCHER_SMCR);
    let n = b8.len();
    set_len(&mut b8, n);
    let ClcMessage::Proposal(p) = ClcMessage::decode(&b8).unwrap() else {
        panic!()
    };
    assert_eq!(p.prefixes.unwrap().ipv6.len(), 8);
}

#[test]
fn proposal_ipv6_count_disagreeing_with_length() {
    let mut b = hex(PROPOSAL_V1_V6);
    b[47] = 2; // claims 2 entries, carries 1
    assert!(
        matches!(err(&b), WireError::Truncated { .. }),
        "{:?}",
        err(&b)
    );
    b[47] = 0; // claims none, carries 1
    assert_eq!(
        err(&b),
        WireError::BadLength {
            what: "CLC proposal",
            claimed: 69,
            expected: 52
        }
    );
}

#[test]
fn proposal_eid_count_too_large_for_length() {
    let mut b = hex(PROPOSAL_V2);
    b[80] = 2; // eid_cnt 2, one EID present
    assert!(
        matches!(
            err(&b),
            WireError::Truncated {
                what: "CLC proposal",
                needed: 184,
                available: 152
            }
        ),
        "{:?}",
        err(&b)
    );
    b[80] = 9; // over SMC_CLC_MAX_UEID
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "eid_cnt",
            value: 9
        }
    );
    b[80] = 0; // fewer than present
    assert_eq!(
        err(&b),
        WireError::BadLength {
            what: "CLC proposal",
            claimed: 156,
            expected: 124
        }
    );
}

#[test]
fn proposal_offsets_must_be_canonical() {
    let mut b = hex(PROPOSAL_V2);
    b[51] = 0x1d; // v2_ext_offset 29
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "v2_ext_offset",
            value: 29
        }
    );
    let mut b = hex(PROPOSAL_V2);
    b[39] = 0x28; // iparea_offset 40 although typev1 = N
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "iparea_offset",
            value: 40
        }
    );
    let mut b = hex(PROPOSAL_V2);
    b[39] = 41; // above the SMC-D area size: Linux's protocol error
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "iparea_offset",
            value: 41
        }
    );
    let mut b = hex(PROPOSAL_V1);
    b[39] = 8; // v1 layout: only 0 or 40
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "iparea_offset",
            value: 8
        }
    );
    let mut b = hex(PROPOSAL_V2);
    b[87] = 0x40; // smcd_v2_ext_offset although typev2 = R
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "smcd_v2_ext_offset",
            value: 0x40
        }
    );
    let mut b = hex(PROPOSAL_V2);
    b[81] = 1; // ism_gid_cnt although no SMC-D v2 offered
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "ism_gid_cnt",
            value: 1
        }
    );
}

#[test]
fn proposal_v1_with_typev1_n_is_invalid() {
    let mut b = hex(PROPOSAL_V1);
    b[7] = 0x12; // version 1, typev1 N
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "proposal v1 typev1",
            value: 2
        }
    );
}

#[test]
fn proposal_v2_without_any_path_is_just_the_smcd_area() {
    // version 2, typev1 N, typev2 N: base + SMC-D area + trailer = 84 bytes. Linux
    // never sends it (it declines NOSMCDEV first) but its length rule accepts it.
    let p = Proposal {
        version: 2,
        typev1: SmcPath::N,
        typev2: SmcPath::N,
        peer_id: Default::default(),
        gid: Default::default(),
        mac: Default::default(),
        smcd: Some(SmcdInfo::default()),
        prefixes: None,
        v2_ext: None,
        smcd_v2_ext: None,
    };
    assert_eq!(p.encode().len(), 84);
    assert_eq!(Proposal::decode(&p.encode()), Ok(p));
}

#[test]
fn proposal_prefix_lengths_out_of_range() {
    let mut b = hex(PROPOSAL_V1);
    b[44] = 33;
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "ipv4 prefix length",
            value: 33
        }
    );
    let mut b = hex(PROPOSAL_V1_V6);
    b[64] = 129;
    assert_eq!(
        err(&b),
        WireError::InvalidField {
            field: "ipv6 prefix length",
            value: 129
        }
    );
}

#[test]
fn proposal_validate_catches_inconsistent_values() {
    let ClcMessage::Proposal(p) = ClcMessage::decode(&hex(PROPOSAL_V2)).unwrap() else {
        panic!()
    };
    p.validate().unwrap();
    let mut q = p.clone();
    q.v2_ext = None;
    assert!(matches!(q.validate(), Err(WireError::InvalidField { .. })));
    let mut q = p.clone();
    q.v2_ext.as_mut().unwrap().eids = vec![Default::default(); 9];
    assert_eq!(
        q.validate(),
        Err(WireError::InvalidField {
            field: "eid_cnt",
            value: 9
        })
    );
    let mut q = p.clone();
    q.version = 0;
    assert_eq!(q.validate(), Err(WireError::BadVersion(0)));
}

// ---------------------------------------------------------------- Accept / Confirm

#[test]
fn v1_accept_of_wrong_length() {
    for extra in [1usize, 4, 40] {
        let b = hex(ACCEPT_V1);
        let mut t = b[..64].to_vec();
        t.extend(std::iter::repeat_n(0u8, extra));
        t.extend_from_slice(&EYECATCHER_SMCR);
        let n = t.len();
        set_len(&mut t, n);
        assert_eq!(
            err(&t),
            WireError::BadLength {
                what: "SMC-R v1 accept/confirm",
                claimed: n,
                expected: 68
            }
        );
    }
    let b = hex(ACCEPT_V1);
    let mut t = b[..60].to_vec();
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 64);
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "SMC-R v1 accept/confirm",
            claimed: 64,
            expected: 68
        }
    );
}

#[test]
fn v2_accept_length_rules() {
    // shorter than 108
    let b = hex(ACCEPT_REUSE);
    let mut t = b[..100].to_vec();
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 104);
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "SMC-R v2 accept/confirm",
            claimed: 104,
            expected: 108
        }
    );
    // first contact flag but no fce
    let mut t = b.clone();
    t[7] |= 0x08;
    assert!(matches!(
        err(&t),
        WireError::BadLength {
            what: "SMC-R v2 accept/confirm with first contact",
            ..
        }
    ));
    // no first contact but an fce
    let mut t = hex(ACCEPT_FC);
    t[7] &= !0x08;
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "SMC-R v2 accept/confirm without first contact",
            claimed: 160,
            expected: 108
        }
    );
    // an Accept carrying a GID list
    let mut t = hex(ACCEPT_FC);
    t.truncate(156);
    t.extend_from_slice(&[0, 0, 0, 0]);
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 164);
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "CLC accept/confirm",
            claimed: 164,
            expected: 160
        }
    );
}

#[test]
fn accept_with_36_byte_fce_is_accepted_confirm_is_not() {
    let full = hex(ACCEPT_FC);
    let mut t = full[..140].to_vec();
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 144);
    let ClcMessage::Accept(a) = ClcMessage::decode(&t).unwrap() else {
        panic!()
    };
    let f = a.fce.unwrap();
    assert_eq!(f.v2x, None);
    assert_eq!(f.hostname_str(), "smcvm");
    assert_eq!(ClcMessage::Accept(a).encode(), t);
    // the same as a Confirm
    t[4] = CLC_CONFIRM;
    assert!(matches!(err(&t), WireError::BadLength { .. }));
}

#[test]
fn confirm_gid_list_count_disagreeing_with_length() {
    let mut b = hex(CONFIRM_FC);
    b[156] = 2;
    assert_eq!(
        err(&b),
        WireError::BadLength {
            what: "SMC-R v2 confirm GID list",
            claimed: 180,
            expected: 196
        }
    );
    b[156] = 0;
    assert_eq!(
        err(&b),
        WireError::BadLength {
            what: "SMC-R v2 confirm GID list",
            claimed: 180,
            expected: 164
        }
    );
    // a first-contact Confirm without a GID-list extension is tolerated
    let full = hex(CONFIRM_FC);
    let mut t = full[..156].to_vec();
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 160);
    let ClcMessage::Confirm(c) = ClcMessage::decode(&t).unwrap() else {
        panic!()
    };
    assert_eq!(c.gid_list, None);
    assert_eq!(ClcMessage::Confirm(c).encode(), t);
}

#[test]
fn smcd_accept_confirm_is_unsupported() {
    for s in [ACCEPT_FC, CONFIRM_FC, ACCEPT_REUSE, ACCEPT_V1] {
        // typev1 = D
        let mut t = hex(s);
        t[7] = (t[7] & !0x03) | 0x01;
        assert_eq!(err(&t), WireError::Unsupported("SMC-D accept/confirm"));
        // SMCD eyecatcher in the header
        let mut t = hex(s);
        t[..4].copy_from_slice(&EYECATCHER_SMCD);
        assert_eq!(err(&t), WireError::Unsupported("SMC-D accept/confirm"));
        // a real SMC-D v1 accept (48 bytes) as Linux would send it
        let mut d = vec![0xe2, 0xd4, 0xc3, 0xc4, 2, 0, 48, 0x11];
        d.extend_from_slice(&[0u8; 36]);
        d.extend_from_slice(&EYECATCHER_SMCD);
        assert_eq!(err(&d), WireError::Unsupported("SMC-D accept/confirm"));
    }
}

#[test]
fn accept_confirm_typev1_n_or_b_is_invalid() {
    for bits in [2u8, 3] {
        let mut t = hex(ACCEPT_FC);
        t[7] = (t[7] & !0x03) | bits;
        assert_eq!(
            err(&t),
            WireError::InvalidField {
                field: "accept/confirm typev1",
                value: u64::from(bits)
            }
        );
    }
}

#[test]
fn accept_confirm_validate() {
    let ClcMessage::Confirm(c) = ClcMessage::decode(&hex(CONFIRM_FC)).unwrap() else {
        panic!()
    };
    c.validate(AcceptConfirmKind::Confirm).unwrap();
    // a GID list has no place in an Accept
    assert!(c.validate(AcceptConfirmKind::Accept).is_err());
    let mut q = c.clone();
    q.qpn = 1 << 24;
    assert_eq!(
        q.validate(AcceptConfirmKind::Confirm),
        Err(WireError::InvalidField {
            field: "qpn",
            value: 1 << 24
        })
    );
    let mut q = c.clone();
    q.fce = None;
    assert!(q.validate(AcceptConfirmKind::Confirm).is_err());
    let mut q = c;
    q.version = 1;
    assert!(q.validate(AcceptConfirmKind::Confirm).is_err());
}

// ---------------------------------------------------------------- Decline

#[test]
fn decline_lengths_are_exact() {
    let b = hex(DECLINE_V2);
    // a v2 decline must be 44, a v1 decline 28
    let mut t = b.clone();
    t[7] = 0x10;
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "CLC decline",
            claimed: 44,
            expected: 28
        }
    );
    let mut t = b[..24].to_vec();
    t.extend_from_slice(&EYECATCHER_SMCR);
    set_len(&mut t, 28);
    assert_eq!(
        err(&t),
        WireError::BadLength {
            what: "CLC decline",
            claimed: 28,
            expected: 44
        }
    );
    // version 3 uses the v2 size
    let mut t = b.clone();
    t[7] = 0x30;
    assert_eq!(Decline::decode(&t).unwrap().version, 3);
}

#[test]
fn decline_typev1_must_be_r_or_d() {
    let b = hex(DECLINE_V2);
    let mut t = b.clone();
    t[7] |= 0x01; // D: accepted (and normalised to R)
    let d = Decline::decode(&t).unwrap();
    assert_eq!(d.encode(), b);
    for bits in [2u8, 3] {
        let mut t = b.clone();
        t[7] = (t[7] & !0x03) | bits;
        assert_eq!(
            err(&t),
            WireError::InvalidField {
                field: "decline typev1",
                value: u64::from(bits)
            }
        );
    }
}

#[test]
fn decline_unknown_code_is_kept() {
    let mut b = hex(DECLINE_V2);
    b[16..20].copy_from_slice(&0x0310_0007u32.to_be_bytes());
    let d = Decline::decode(&b).unwrap();
    assert_eq!(d.diagnosis, DeclineCode::Unknown(0x0310_0007));
    assert_eq!(d.encode(), b);
}

#[test]
fn reserved_bytes_are_ignored_and_written_as_zero() {
    // Accept byte 51 and 60 reserved, EID trailer reserved 96..104
    let mut t = hex(ACCEPT_FC);
    for i in [51usize, 60, 96, 103, 106, 107, 150] {
        t[i] = 0x5a;
    }
    t[104] |= 0x01; // fce byte 0 bits 6..0 reserved
    t[7] |= 0x04; // header bit 2 unused
    let m = ClcMessage::decode(&t).unwrap();
    assert_eq!(m.encode(), hex(ACCEPT_FC));
    // Proposal reserved areas
    let mut t = hex(PROPOSAL_V2);
    for i in [52usize, 55, 60, 79, 82, 84, 85, 108, 119] {
        t[i] = 0xa5;
    }
    t[83] |= 0x0e; // flag bits 3..1
    let m = ClcMessage::decode(&t).unwrap();
    assert_eq!(m.encode(), hex(PROPOSAL_V2));
    // Decline reserved bits and bytes
    let mut t = hex(DECLINE_V2);
    t[20] |= 0x0f;
    t[21] = 1;
    t[23] = 1;
    t[7] |= 0x04;
    let m = ClcMessage::decode(&t).unwrap();
    assert_eq!(m.encode(), hex(DECLINE_V2));
}

#[test]
fn fuzz_one_on_fixtures_and_garbage() {
    for b in all_valid() {
        fuzz_one(&b);
        for k in 0..b.len() {
            fuzz_one(&b[..k]);
        }
    }
    fuzz_one(&[]);
    fuzz_one(&[0xe2, 0xd4, 0xc3, 0xd9, 1, 0xff, 0xff, 0x2f]);
}
