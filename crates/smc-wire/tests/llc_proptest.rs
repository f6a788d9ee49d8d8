//! Property tests: `decode(encode(m)) == m` for every LLC message type over arbitrary
//! valid values, v1 and v2 with both `length_v2` byte orders (and both ADD_LINK
//! extension `num_rkeys` orders), `protocol-llc-cdc.md` §1. Where the byte order is
//! invisible on the wire (a palindromic u16) the comparison is after
//! `normalize_byte_orders`, which is exactly what decode reports.

use proptest::collection::vec;
use proptest::prelude::*;
use smc_wire::llc::*;
use smc_wire::types::{Gid, Mac, U24_MAX};
use smc_wire::WireError;

fn order() -> impl Strategy<Value = ByteOrder> {
    prop_oneof![Just(ByteOrder::Little), Just(ByteOrder::Big)]
}

fn v2() -> impl Strategy<Value = LlcVersion> {
    order().prop_map(|length_order| LlcVersion::V2 { length_order })
}

fn version() -> impl Strategy<Value = LlcVersion> {
    prop_oneof![Just(LlcVersion::V1), v2()]
}

fn mac() -> impl Strategy<Value = Mac> {
    any::<[u8; 6]>().prop_map(Mac)
}

fn gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn u24() -> impl Strategy<Value = u32> {
    0..=U24_MAX
}

fn rkey_triple() -> impl Strategy<Value = AddLinkRkey> {
    (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(a, b, c)| AddLinkRkey {
        rmb_key: a,
        rmb_key_new: b,
        rmb_vaddr_new: c,
    })
}

fn rtoken() -> impl Strategy<Value = LinkRtoken> {
    (any::<u8>(), any::<u32>(), any::<u64>()).prop_map(|(link_id, rkey, vaddr)| LinkRtoken {
        link_id,
        rkey,
        vaddr,
    })
}

fn confirm_link() -> impl Strategy<Value = LlcMessage> {
    (
        version(),
        any::<u8>(),
        mac(),
        gid(),
        u24(),
        any::<u8>(),
        any::<u32>(),
        any::<[u8; 2]>(),
    )
        .prop_map(
            |(
                version,
                flags,
                sender_mac,
                sender_gid,
                sender_qpn,
                link_num,
                link_uid,
                [max_links, max_conns],
            )| {
                ConfirmLink {
                    version,
                    flags,
                    sender_mac,
                    sender_gid,
                    sender_qpn,
                    link_num,
                    link_uid,
                    max_links,
                    max_conns,
                }
                .into()
            },
        )
}

fn ext() -> impl Strategy<Value = AddLinkV2Ext> {
    (any::<bool>(), gid(), order(), vec(rkey_triple(), 0..40)).prop_map(
        |(v2_direct, client_target_gid, num_rkeys_order, rkeys)| AddLinkV2Ext {
            v2_direct,
            client_target_gid,
            num_rkeys_order,
            rkeys,
        },
    )
}

fn add_link() -> impl Strategy<Value = LlcMessage> {
    let common = || {
        (
            any::<u8>(),
            mac(),
            gid(),
            u24(),
            any::<u8>(),
            0u8..16,
            u24(),
        )
    };
    let v1 = (common(), 0u8..16).prop_map(|((flags, m, g, q, l, mtu, psn), rsn)| AddLink {
        version: LlcVersion::V1,
        flags,
        reject_reason: rsn,
        sender_mac: m,
        sender_gid: g,
        sender_qpn: q,
        link_num: l,
        qp_mtu: mtu,
        initial_psn: psn,
        ext: None,
    });
    let v2 = (common(), v2(), proptest::option::of(ext())).prop_map(
        |((flags, m, g, q, l, mtu, psn), version, ext)| AddLink {
            version,
            flags,
            reject_reason: 0,
            sender_mac: m,
            sender_gid: g,
            sender_qpn: q,
            link_num: l,
            qp_mtu: mtu,
            initial_psn: psn,
            ext,
        },
    );
    prop_oneof![v1, v2].prop_map(LlcMessage::from)
}

fn add_link_cont() -> impl Strategy<Value = LlcMessage> {
    (
        version(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        rkey_triple(),
        rkey_triple(),
    )
        .prop_map(|(version, flags, link_num, num_rkeys, a, b)| {
            let rkeys = [a, b]
                .into_iter()
                .take(usize::from(num_rkeys).min(2))
                .collect();
            AddLinkCont {
                version,
                flags,
                link_num,
                num_rkeys,
                rkeys,
            }
            .into()
        })
}

fn delete_link() -> impl Strategy<Value = LlcMessage> {
    (version(), any::<u8>(), any::<u8>(), any::<u32>()).prop_map(
        |(version, flags, link_num, reason)| {
            DeleteLink {
                version,
                flags,
                link_num,
                reason,
            }
            .into()
        },
    )
}

fn req_add_link() -> impl Strategy<Value = LlcMessage> {
    let v1 = (any::<u8>(), vec(gid(), 0..=1)).prop_map(|(flags, gids)| ReqAddLink {
        version: LlcVersion::V1,
        flags,
        gids,
    });
    let v2 = (v2(), any::<u8>(), vec(gid(), 0..40)).prop_map(|(version, flags, gids)| ReqAddLink {
        version,
        flags,
        gids,
    });
    prop_oneof![v1, v2].prop_map(LlcMessage::from)
}

fn confirm_rkey() -> impl Strategy<Value = LlcMessage> {
    (
        version(),
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        any::<u64>(),
        rtoken(),
        rtoken(),
    )
        .prop_map(|(version, flags, num_rkeys, rkey, vaddr, a, b)| {
            ConfirmRkey {
                version,
                flags,
                num_rkeys,
                rkey,
                vaddr,
                others: [a, b],
            }
            .into()
        })
}

fn confirm_rkey_cont() -> impl Strategy<Value = LlcMessage> {
    (
        version(),
        any::<u8>(),
        any::<u8>(),
        rtoken(),
        rtoken(),
        rtoken(),
    )
        .prop_map(|(version, flags, num_rkeys, a, b, c)| {
            ConfirmRkeyCont {
                version,
                flags,
                num_rkeys,
                rtokens: [a, b, c],
            }
            .into()
        })
}

fn delete_rkey() -> impl Strategy<Value = LlcMessage> {
    let v1 = (any::<u8>(), any::<u8>(), vec(any::<u32>(), 0..=8)).prop_map(
        |(flags, err_mask, rkeys)| DeleteRkey {
            version: LlcVersion::V1,
            flags,
            err_mask,
            rkeys,
        },
    );
    let v2 = (v2(), any::<u8>(), any::<u8>(), vec(any::<u32>(), 0..=255)).prop_map(
        |(version, flags, err_mask, rkeys)| DeleteRkey {
            version,
            flags,
            err_mask,
            rkeys,
        },
    );
    prop_oneof![v1, v2].prop_map(LlcMessage::from)
}

fn test_link() -> impl Strategy<Value = LlcMessage> {
    (version(), any::<u8>(), any::<[u8; 16]>()).prop_map(|(version, flags, user_data)| {
        TestLink {
            version,
            flags,
            user_data,
        }
        .into()
    })
}

fn any_llc() -> impl Strategy<Value = LlcMessage> {
    prop_oneof![
        confirm_link(),
        add_link(),
        add_link_cont(),
        delete_link(),
        req_add_link(),
        confirm_rkey(),
        confirm_rkey_cont(),
        delete_rkey(),
        test_link(),
    ]
}

fn check_round_trip(m: &LlcMessage) -> Result<(), TestCaseError> {
    let b = m.encode();
    prop_assert_eq!(b.len(), m.encoded_len());
    prop_assert!(b.len() >= 44 && b.len() <= LLC_V2_MAX_LEN);
    // header bytes as specified for the version and byte order
    match m.version() {
        LlcVersion::V1 => {
            prop_assert_eq!(b[0], m.llc_type().code());
            prop_assert_eq!(b[1], 44);
            prop_assert_eq!(b.len(), 44);
        }
        LlcVersion::V2 { length_order } => {
            prop_assert_eq!(b[0], 0x20 | m.llc_type().code());
            prop_assert_eq!(length_order.read([b[1], b[2]]) as usize, b.len());
        }
    }
    prop_assert_eq!(b[3], m.flags());
    let mut want = m.clone();
    want.normalize_byte_orders();
    let got = LlcMessage::decode(&b);
    prop_assert_eq!(got.as_ref(), Ok(&want));
    prop_assert_eq!(got.unwrap().encode(), b.clone());
    // also through the typed decoder
    let typed: Result<LlcMessage, WireError> = match m {
        LlcMessage::ConfirmLink(_) => ConfirmLink::decode(&b).map(Into::into),
        LlcMessage::AddLink(_) => AddLink::decode(&b).map(Into::into),
        LlcMessage::AddLinkCont(_) => AddLinkCont::decode(&b).map(Into::into),
        LlcMessage::DeleteLink(_) => DeleteLink::decode(&b).map(Into::into),
        LlcMessage::ReqAddLink(_) => ReqAddLink::decode(&b).map(Into::into),
        LlcMessage::ConfirmRkey(_) => ConfirmRkey::decode(&b).map(Into::into),
        LlcMessage::TestLink(_) => TestLink::decode(&b).map(Into::into),
        LlcMessage::ConfirmRkeyCont(_) => ConfirmRkeyCont::decode(&b).map(Into::into),
        LlcMessage::DeleteRkey(_) => DeleteRkey::decode(&b).map(Into::into),
    };
    prop_assert_eq!(typed, Ok(want));
    smc_wire::llc::fuzz_one(&b);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test] fn confirm_link_round_trips(m in confirm_link()) { check_round_trip(&m)?; }
    #[test] fn add_link_round_trips(m in add_link()) { check_round_trip(&m)?; }
    #[test] fn add_link_cont_round_trips(m in add_link_cont()) { check_round_trip(&m)?; }
    #[test] fn delete_link_round_trips(m in delete_link()) { check_round_trip(&m)?; }
    #[test] fn req_add_link_round_trips(m in req_add_link()) { check_round_trip(&m)?; }
    #[test] fn confirm_rkey_round_trips(m in confirm_rkey()) { check_round_trip(&m)?; }
    #[test] fn confirm_rkey_cont_round_trips(m in confirm_rkey_cont()) { check_round_trip(&m)?; }
    #[test] fn delete_rkey_round_trips(m in delete_rkey()) { check_round_trip(&m)?; }
    #[test] fn test_link_round_trips(m in test_link()) { check_round_trip(&m)?; }

    /// Without normalization the round trip is exact whenever the byte orders are
    /// visible (every 44-byte v2 message, every extension with 1..=256 rkeys).
    #[test]
    fn byte_orders_are_remembered(m in any_llc()) {
        let b = m.encode();
        let len = b.len() as u16;
        let ext_n = match &m { LlcMessage::AddLink(AddLink { version: LlcVersion::V2 { .. }, ext: Some(e), .. }) => Some(e.rkeys.len() as u16), _ => None };
        prop_assume!(len.swap_bytes() != len);
        prop_assume!(ext_n.is_none_or(|n| n.swap_bytes() != n));
        prop_assert_eq!(LlcMessage::decode(&b), Ok(m));
    }

    /// Every cut of a valid message is Truncated (an ADD_LINK v2 cut to exactly 44
    /// bytes is a valid ADD_LINK without extension).
    #[test]
    fn every_truncation_is_truncated(m in any_llc(), frac in 0.0f64..1.0) {
        let b = m.encode();
        let cut = ((b.len() as f64) * frac) as usize;
        let r = LlcMessage::decode(&b[..cut]);
        if cut == 44 && matches!(m, LlcMessage::AddLink(_)) {
            let LlcMessage::AddLink(a) = r.unwrap() else { panic!() };
            prop_assert_eq!(a.ext, None);
        } else {
            prop_assert!(matches!(r, Err(WireError::Truncated { .. })), "cut {} of {}: {:?}", cut, b.len(), r);
        }
    }

    /// Garbage and mutated messages never panic, and whatever decodes round-trips.
    #[test]
    fn fuzz_random_bytes(data in vec(any::<u8>(), 0..200)) {
        smc_wire::llc::fuzz_one(&data);
    }

    #[test]
    fn fuzz_mutated_messages(m in any_llc(), at in any::<usize>(), x in any::<u8>(), extra in vec(any::<u8>(), 0..40)) {
        let mut b = m.encode();
        let i = at % b.len();
        b[i] ^= x;
        smc_wire::llc::fuzz_one(&b);
        b.extend_from_slice(&extra);
        smc_wire::llc::fuzz_one(&b);
    }
}

#[test]
fn palindromic_lengths_and_counts_normalize_to_little_endian() {
    // DELETE_RKEY v2 with 255 rkeys is 1028 = 0x0404 bytes
    let m: LlcMessage = DeleteRkey::request(LlcVersion::V2_BE, (0..255).collect()).into();
    let b = m.encode();
    assert_eq!((b.len(), b[1], b[2]), (1028, 4, 4));
    let got = LlcMessage::decode(&b).unwrap();
    assert_eq!(got.version(), LlcVersion::V2_LE);
    let mut want = m.clone();
    want.normalize_byte_orders();
    assert_eq!(got, want);
    assert_eq!(got.encode(), b);
    // ADD_LINK with 124 rkeys is 2056 = 0x0808 bytes; 0 rkeys hides num_rkeys' order
    for n in [0usize, 124] {
        let a = AddLink {
            version: LlcVersion::V2_BE,
            flags: 0,
            reject_reason: 0,
            sender_mac: Mac::default(),
            sender_gid: Gid::ZERO,
            sender_qpn: 1,
            link_num: 2,
            qp_mtu: 3,
            initial_psn: 4,
            ext: Some(AddLinkV2Ext {
                v2_direct: true,
                client_target_gid: Gid::ZERO,
                num_rkeys_order: ByteOrder::Big,
                rkeys: vec![AddLinkRkey::default(); n],
            }),
        };
        let m: LlcMessage = a.into();
        let b = m.encode();
        let mut want = m.clone();
        want.normalize_byte_orders();
        assert_eq!(LlcMessage::decode(&b).unwrap(), want, "n = {n}");
        assert_ne!(want, m);
    }
}

#[test]
fn oversized_add_link_extension_is_capped() {
    let a = AddLink {
        version: LlcVersion::V2_LE,
        flags: 0,
        reject_reason: 0,
        sender_mac: Mac::default(),
        sender_gid: Gid::ZERO,
        sender_qpn: 1,
        link_num: 2,
        qp_mtu: 3,
        initial_psn: 4,
        ext: Some(AddLinkV2Ext {
            v2_direct: false,
            client_target_gid: Gid::ZERO,
            num_rkeys_order: ByteOrder::Little,
            rkeys: vec![AddLinkRkey::default(); 600],
        }),
    };
    let b = a.encode();
    assert!(b.len() <= LLC_V2_MAX_LEN);
    let back = AddLink::decode(&b).unwrap();
    assert_eq!(back.ext.unwrap().rkeys.len(), ADD_LINK_V2_MAX_RKEYS);
}
