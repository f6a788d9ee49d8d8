//! Property tests for the CLC codec: round trips over arbitrary valid values of every
//! message type and layout, and robustness of the decoder on mutated input.

use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use smc_wire::clc::*;
use smc_wire::types::{Eid, Gid, Mac, RmbeSize, SystemId, U24_MAX};

fn system_id() -> impl Strategy<Value = SystemId> {
    any::<[u8; 8]>().prop_map(SystemId)
}
fn gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}
fn mac() -> impl Strategy<Value = Mac> {
    any::<[u8; 6]>().prop_map(Mac)
}
fn eid() -> impl Strategy<Value = Eid> {
    prop_oneof![
        any::<[u8; 32]>().prop_map(Eid),
        "[A-Z0-9][A-Z0-9.-]{0,31}".prop_map(|s| Eid::parse_ueid(&s).unwrap()),
    ]
}
fn path() -> impl Strategy<Value = SmcPath> {
    prop::sample::select(SmcPath::ALL.to_vec())
}
fn smcd_info() -> impl Strategy<Value = SmcdInfo> {
    (any::<u64>(), any::<u16>()).prop_map(|(ism_gid, ism_chid)| SmcdInfo { ism_gid, ism_chid })
}
fn prefixes() -> impl Strategy<Value = IpPrefixes> {
    prop_oneof![
        (any::<u32>(), 0u8..=32).prop_map(|(a, l)| IpPrefixes::ipv4(Ipv4Addr::from(a), l)),
        vec(
            (any::<u128>(), 0u8..=128).prop_map(|(a, len)| Ipv6Prefix {
                prefix: Ipv6Addr::from(a),
                len
            }),
            0..=MAX_IPV6_PREFIXES
        )
        .prop_map(|ipv6| IpPrefixes {
            ipv4_subnet: Ipv4Addr::UNSPECIFIED,
            ipv4_prefix_len: 0,
            ipv6
        }),
        // arbitrary mixtures are representable too
        (
            any::<u32>(),
            0u8..=32,
            vec(
                (any::<[u8; 16]>(), 0u8..=128).prop_map(|(a, len)| Ipv6Prefix {
                    prefix: Ipv6Addr::from(a),
                    len
                }),
                0..=MAX_IPV6_PREFIXES
            )
        )
            .prop_map(|(a, l, ipv6)| IpPrefixes {
                ipv4_subnet: Ipv4Addr::from(a),
                ipv4_prefix_len: l,
                ipv6
            }),
    ]
}
fn v2_ext() -> impl Strategy<Value = ProposalV2Ext> {
    (
        vec(eid(), 0..=MAX_EIDS),
        0u8..16,
        any::<bool>(),
        gid(),
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
    )
        .prop_map(
            |(eids, release, seid, roce_v2_gid, max_conns, max_links, feature_mask)| {
                ProposalV2Ext {
                    eids,
                    release,
                    seid,
                    roce_v2_gid,
                    max_conns,
                    max_links,
                    feature_mask,
                }
            },
        )
}
fn smcd_v2_ext() -> impl Strategy<Value = SmcdV2Ext> {
    (
        eid(),
        vec(
            (any::<u64>(), any::<u16>()).prop_map(|(gid, chid)| IsmGidChid { gid, chid }),
            0..=MAX_ISM_GIDS,
        ),
    )
        .prop_map(|(system_eid, gid_chids)| SmcdV2Ext {
            system_eid,
            gid_chids,
        })
}

/// RFC 7609 / pre-5.10 layout: version 1, with or without the SMC-D area.
fn proposal_v1() -> impl Strategy<Value = Proposal> {
    (
        prop::sample::select(vec![SmcPath::R, SmcPath::D, SmcPath::B]),
        system_id(),
        gid(),
        mac(),
        option::of(smcd_info()),
        prefixes(),
    )
        .prop_map(|(typev1, peer_id, gid, mac, smcd, p)| Proposal {
            version: 1,
            typev1,
            typev2: SmcPath::N,
            peer_id,
            gid,
            mac,
            smcd,
            prefixes: Some(p),
            v2_ext: None,
            smcd_v2_ext: None,
        })
}

/// The layout every v2-capable Linux sends (header version ≥ 2).
fn proposal_v2() -> impl Strategy<Value = Proposal> {
    (
        2u8..=15,
        path(),
        path(),
        system_id(),
        gid(),
        mac(),
        smcd_info(),
        prefixes(),
        v2_ext(),
        smcd_v2_ext(),
    )
        .prop_map(
            |(version, typev1, typev2, peer_id, gid, mac, smcd, p, e, d)| Proposal {
                version,
                typev1,
                typev2,
                peer_id,
                gid,
                mac,
                smcd: Some(smcd),
                prefixes: (typev1 != SmcPath::N).then_some(p),
                v2_ext: (typev2 != SmcPath::N).then_some(e),
                smcd_v2_ext: typev2.offers_d().then_some(d),
            },
        )
}

fn fce(short_allowed: bool) -> impl Strategy<Value = FirstContactExt> {
    (
        any::<bool>(),
        0u8..16,
        0u8..16,
        any::<[u8; 32]>(),
        any::<(u8, u8, u16, [u8; 4])>(),
        any::<bool>(),
    )
        .prop_map(
            move |(v2_direct, os_type, release, hostname, x, short)| FirstContactExt {
                v2_direct,
                os_type,
                release,
                hostname,
                v2x: (!(short && short_allowed)).then_some(FceV2x {
                    max_conns: x.0,
                    max_links: x.1,
                    feature_mask: x.2,
                    vendor_opts: x.3,
                }),
            },
        )
}

fn accept_confirm() -> impl Strategy<Value = (AcceptConfirmKind, AcceptConfirm)> {
    let base = (
        prop::sample::select(vec![AcceptConfirmKind::Accept, AcceptConfirmKind::Confirm]),
        prop_oneof![Just(1u8), 2u8..=15],
        any::<bool>(),
        (system_id(), gid(), mac()),
        (0..=U24_MAX, any::<u32>(), any::<u8>(), any::<u32>()),
        (0u8..16, 0u8..16, any::<u64>(), 0..=U24_MAX),
    );
    (
        base,
        eid(),
        fce(true),
        fce(false),
        option::of(vec(gid(), 0..20)),
    )
        .prop_map(
            |(
                (
                    kind,
                    version,
                    first_contact,
                    (peer_id, gid, mac),
                    (qpn, rkey, idx, token),
                    (size, mtu, vaddr, psn),
                ),
                eid,
                fce_accept,
                fce_confirm,
                gid_list,
            )| {
                let v2 = version >= 2;
                let confirm = kind == AcceptConfirmKind::Confirm;
                let m = AcceptConfirm {
                    version,
                    first_contact,
                    peer_id,
                    gid,
                    mac,
                    qpn,
                    rmb_rkey: rkey,
                    rmbe_idx: idx,
                    alert_token: token,
                    rmbe_size: RmbeSize::from_class(size).unwrap(),
                    qp_mtu: mtu,
                    rmb_vaddr: vaddr,
                    psn,
                    eid: if v2 { eid } else { Eid::default() },
                    fce: (v2 && first_contact).then_some(if confirm {
                        fce_confirm
                    } else {
                        fce_accept
                    }),
                    gid_list: if v2 && first_contact && confirm {
                        gid_list
                    } else {
                        None
                    },
                };
                (kind, m)
            },
        )
}

fn decline_code() -> impl Strategy<Value = DeclineCode> {
    prop_oneof![
        prop::sample::select(DeclineCode::KNOWN.to_vec()),
        any::<u32>().prop_map(DeclineCode::from_u32),
    ]
}

fn decline() -> impl Strategy<Value = Decline> {
    (
        prop_oneof![Just(1u8), 2u8..=15],
        any::<bool>(),
        system_id(),
        decline_code(),
        0u8..16,
        any::<[u32; 4]>(),
    )
        .prop_map(
            |(version, out_of_sync, peer_id, diagnosis, os_type, diag)| Decline {
                version,
                out_of_sync,
                peer_id,
                diagnosis,
                os_type,
                diag_v2: if version >= 2 { diag } else { [0; 4] },
            },
        )
}

fn message() -> impl Strategy<Value = ClcMessage> {
    prop_oneof![
        proposal_v1().prop_map(ClcMessage::Proposal),
        proposal_v2().prop_map(ClcMessage::Proposal),
        accept_confirm().prop_map(|(k, m)| match k {
            AcceptConfirmKind::Accept => ClcMessage::Accept(m),
            AcceptConfirmKind::Confirm => ClcMessage::Confirm(m),
        }),
        decline().prop_map(ClcMessage::Decline),
    ]
}

/// decode(encode(m)) == m, encode(decode(bytes)) == bytes, and the header agrees.
fn check_message(m: &ClcMessage) -> Result<(), TestCaseError> {
    prop_assert_eq!(m.validate(), Ok(()));
    let bytes = m.encode();
    prop_assert_eq!(bytes.len(), m.encoded_len());
    let hdr = ClcHeader::peek(&bytes).unwrap();
    prop_assert_eq!(usize::from(hdr.length), bytes.len());
    prop_assert_eq!(hdr.msg_type, m.msg_type());
    prop_assert_eq!(hdr.version, m.version());
    let back = ClcMessage::decode(&bytes);
    prop_assert_eq!(back.as_ref(), Ok(m));
    prop_assert_eq!(back.unwrap().encode(), bytes.clone());
    // encode_into appends
    let mut v = vec![0xAA];
    m.encode_into(&mut v);
    prop_assert_eq!(&v[1..], &bytes[..]);
    // every strict prefix is rejected with a typed error
    for k in 0..bytes.len() {
        prop_assert!(ClcMessage::decode(&bytes[..k]).is_err());
    }
    // and so is the message with a byte appended
    let mut longer = bytes.clone();
    longer.push(0);
    prop_assert!(
        matches!(
            ClcMessage::decode(&longer),
            Err(smc_wire::WireError::BadLength { .. })
        ),
        "appended byte must give BadLength"
    );
    fuzz_one(&bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn proposal_v1_round_trip(p in proposal_v1()) {
        prop_assert_eq!(p.encoded_len(), p.encode().len());
        prop_assert_eq!(Proposal::decode(&p.encode()), Ok(p.clone()));
        check_message(&ClcMessage::Proposal(p))?;
    }

    #[test]
    fn proposal_v2_round_trip(p in proposal_v2()) {
        prop_assert!(p.encoded_len() <= PROPOSAL_MAX_LEN);
        prop_assert_eq!(Proposal::decode(&p.encode()), Ok(p.clone()));
        check_message(&ClcMessage::Proposal(p))?;
    }

    #[test]
    fn accept_confirm_round_trip((kind, m) in accept_confirm()) {
        let bytes = m.encode(kind);
        prop_assert_eq!(AcceptConfirm::decode(&bytes), Ok((kind, m.clone())));
        let msg = match kind {
            AcceptConfirmKind::Accept => ClcMessage::Accept(m),
            AcceptConfirmKind::Confirm => ClcMessage::Confirm(m),
        };
        check_message(&msg)?;
    }

    #[test]
    fn decline_round_trip(d in decline()) {
        prop_assert_eq!(Decline::decode(&d.encode()), Ok(d));
        prop_assert_eq!(d.encode().len(), if d.version >= 2 { 44 } else { 28 });
        check_message(&ClcMessage::Decline(d))?;
    }

    #[test]
    fn decline_code_u32_round_trip(x in any::<u32>()) {
        prop_assert_eq!(DeclineCode::from_u32(x).to_u32(), x);
    }

    /// Mutating one or two bytes of a valid message never panics the decoder, and
    /// whatever still decodes round-trips (fuzz_one asserts it).
    #[test]
    fn mutated_messages_never_panic(
        m in message(),
        muts in vec((any::<prop::sample::Index>(), any::<u8>()), 1..3),
    ) {
        let mut b = m.encode();
        for (i, x) in muts {
            let i = i.index(b.len());
            b[i] = x;
        }
        fuzz_one(&b);
    }

    #[test]
    fn random_bytes_never_panic(b in vec(any::<u8>(), 0..700)) {
        fuzz_one(&b);
    }

    /// Random bodies behind a plausible header (so that the decoder gets past peek).
    #[test]
    fn random_bodies_behind_valid_header_never_panic(
        ty in 1u8..=4,
        b7 in any::<u8>(),
        body in vec(any::<u8>(), 4..700),
        smcr_trailer in any::<bool>(),
    ) {
        let mut b = vec![0xe2, 0xd4, 0xc3, 0xd9, ty, 0, 0, b7];
        b.extend_from_slice(&body);
        if smcr_trailer {
            let n = b.len();
            b[n - 4..].copy_from_slice(&EYECATCHER_SMCR);
        }
        let n = b.len() as u16;
        b[5..7].copy_from_slice(&n.to_be_bytes());
        fuzz_one(&b);
    }
}
