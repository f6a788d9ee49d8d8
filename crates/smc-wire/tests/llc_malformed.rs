//! Malformed LLC input yields the specific `WireError` (`protocol-llc-cdc.md` §0, §1.1,
//! §1.2; Linux `smc_llc_rx_handler`).

use smc_wire::llc::*;
use smc_wire::WireError;

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

/// The 88-byte ADD_LINK v2 request of the main capture (frame 15).
const ADD_LINK_V2: &str = "225800005254005c0001000000000000000000000000ffff0a6300010000130203e0510d0000000000000000800000000000000000000000ffff0a630001000000000000000001000000048a00000687ff2ecb12c08d0000";

fn samples() -> Vec<Vec<u8>> {
    vec![
        with_zeros("072c0000", 44),
        with_zeros("272c0080", 44),
        with_zeros("27002c00", 44),
        hex("012c000302000000000100000000000000000000ffffc0a8010a000123010000010102000000000000000000"),
        with_zeros("042c0060 00 00030000", 44),
        with_zeros("062c0000 01 00001234 00000000dead0000 02 00005678 00000000beef0000", 44),
        hex(ADD_LINK_V2),
        // v2 DELETE_RKEY with 13 rkeys: 60 bytes
        DeleteRkey::request(LlcVersion::V2_LE, (1..=13).collect()).encode(),
        // v2 REQ_ADD_LINK with 2 GIDs: 60 bytes
        ReqAddLink {
            version: LlcVersion::V2_LE,
            flags: 0,
            gids: vec![smc_wire::types::Gid([1; 16]), smc_wire::types::Gid([2; 16])],
        }
        .encode(),
    ]
}

#[test]
fn every_truncation_of_a_valid_message_is_truncated() {
    for b in samples() {
        assert!(LlcMessage::decode(&b).is_ok());
        for cut in 0..b.len() {
            let r = LlcMessage::decode(&b[..cut]);
            if cut == 44 && b[0] == 0x22 {
                // an ADD_LINK v2 without its extension is itself valid (e.g. a reject)
                let Ok(LlcMessage::AddLink(a)) = r else {
                    panic!("{r:?}")
                };
                assert_eq!(a.ext, None);
                continue;
            }
            match r {
                Err(WireError::Truncated {
                    needed, available, ..
                }) => {
                    assert_eq!(available, cut, "{:02x?} cut {cut}", &b[..4]);
                    assert!(needed > cut);
                }
                other => panic!("{:02x?} cut {cut}: {other:?}", &b[..4]),
            }
        }
    }
}

#[test]
fn v1_length_byte_other_than_44_is_bad_length() {
    for l in (0..=255u8).filter(|l| *l != 44) {
        let mut b = with_zeros("072c0000", 44);
        b[1] = l;
        assert_eq!(
            LlcMessage::decode(&b),
            Err(WireError::BadLength {
                what: "LLC v1 length byte",
                claimed: usize::from(l),
                expected: 44
            }),
            "length byte {l}"
        );
    }
}

#[test]
fn v2_length_out_of_range_in_both_byte_orders_is_bad_length() {
    // (bytes 1..2, little-endian reading, expected bound)
    for (raw, claimed, expected) in [
        ([0x2b, 0x00], 43usize, 44usize), // 43 LE, 11008 BE
        ([0x00, 0x00], 0, 44),
    ] {
        let mut b = with_zeros("27000000", 44);
        b[1] = raw[0];
        b[2] = raw[1];
        assert_eq!(
            LlcMessage::decode(&b),
            Err(WireError::BadLength {
                what: "LLC v2 length_v2",
                claimed,
                expected
            })
        );
    }
    // > 8192 in both readings: 0x2100 LE = 8448, 0x0021 BE = 33
    let mut b = with_zeros("27002100", 44);
    assert_eq!(
        LlcMessage::decode(&b),
        Err(WireError::BadLength {
            what: "LLC v2 length_v2",
            claimed: 8448,
            expected: 8192
        })
    );
    b[1] = 0xff;
    b[2] = 0xff;
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::BadLength { claimed: 65535, .. })
    ));
    // 8193 LE but 289 BE: acceptable, read as big-endian
    b[1] = 0x01;
    b[2] = 0x20;
    let h = LlcHeader::decode(&b).unwrap();
    assert_eq!((h.version, h.length), (LlcVersion::V2_BE, 0x0120));
    // the exact buffer length wins over the little-endian preference: 0x2c 0x01 is
    // 300 LE / 11265 BE; 0x01 0x2c is 300 BE / 11265 LE
    let mut big = with_zeros("27012c00", 300);
    assert_eq!(LlcHeader::decode(&big).unwrap().version, LlcVersion::V2_BE);
    big[1] = 0x2c;
    big[2] = 0x01;
    assert_eq!(LlcHeader::decode(&big).unwrap().version, LlcVersion::V2_LE);
}

#[test]
fn unknown_type_bytes() {
    for t in [
        0x0Au8, 0x2A, 0x00, 0x20, 0x0F, 0x2F, 0x11, 0x31, 0x47, 0xFE, 0xFF,
    ] {
        let mut b = with_zeros("002c0000", 44);
        b[0] = t;
        assert_eq!(
            LlcMessage::decode(&b),
            Err(WireError::UnknownType {
                family: "LLC",
                value: t
            }),
            "type byte {t:#04x}"
        );
        // the type is checked first, even on a 1-byte buffer
        assert_eq!(
            LlcMessage::decode(&b[..1]),
            Err(WireError::UnknownType {
                family: "LLC",
                value: t
            })
        );
    }
}

#[test]
fn add_link_ext_with_too_many_rkeys_is_truncated() {
    let mut b = hex(ADD_LINK_V2);
    // 2 entries claimed (LE 2 / BE 512), 1 present
    b[70] = 0x02;
    b[71] = 0x00;
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::Truncated {
            what: "ADD_LINK v2 rkey list",
            needed: 104,
            available: 88
        })
    ));
    b[70] = 0xff;
    b[71] = 0xff;
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::Truncated {
            what: "ADD_LINK v2 rkey list",
            ..
        })
    ));
    // 00 01: 256 little-endian does not fit, 1 big-endian fills the buffer exactly
    b[70] = 0x00;
    b[71] = 0x01;
    let Ok(LlcMessage::AddLink(a)) = LlcMessage::decode(&b) else {
        panic!()
    };
    let e = a.ext.as_ref().unwrap();
    assert_eq!((e.num_rkeys_order, e.rkeys.len()), (ByteOrder::Big, 1));
    assert_eq!(
        a.encode(),
        b,
        "big-endian num_rkeys is re-encoded as received"
    );
    // an extension cut inside its fixed part
    let b = hex(ADD_LINK_V2);
    assert!(matches!(
        LlcMessage::decode(&b[..60]),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn other_count_fields_that_overrun() {
    // v1 DELETE_RKEY may carry at most 8 rkeys
    let mut b = with_zeros("092c0000 09", 44);
    assert_eq!(
        LlcMessage::decode(&b),
        Err(WireError::InvalidField {
            field: "DELETE_RKEY num_rkeys",
            value: 9
        })
    );
    b[4] = 8;
    assert!(LlcMessage::decode(&b).is_ok());
    // v2 DELETE_RKEY claiming 20 rkeys in 44 bytes
    let b = with_zeros("292c0000 14", 44);
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::Truncated {
            needed: 48,
            available: 44,
            ..
        })
    ));
    // v1 REQ_ADD_LINK has room for one GID only
    let mut b = with_zeros("052c0000", 44);
    b[24] = 2;
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::Truncated {
            needed: 60,
            available: 44,
            ..
        })
    ));
    // v2 REQ_ADD_LINK claiming 3 GIDs in 60 bytes
    let mut b = with_zeros("253c0000", 60);
    b[24] = 3;
    assert!(matches!(
        LlcMessage::decode(&b),
        Err(WireError::Truncated { needed: 76, .. })
    ));
}

#[test]
fn reserved_bytes_are_ignored_and_written_zero() {
    let mut b = with_zeros("072c0000", 44);
    b[2] = 0xF0; // v1 byte 2 high nibble is reserved
    b[30] = 0xAA; // TEST_LINK reserved tail
    let m = LlcMessage::decode(&b).unwrap();
    assert_eq!(m.encode(), with_zeros("072c0000", 44));
    // a v1 message in a longer buffer: the tail after byte 44 is ignored
    let mut long = with_zeros("072c0000", 48);
    long[47] = 1;
    assert_eq!(LlcMessage::decode(&long).unwrap().encoded_len(), 44);
}
