//! Malformed CDC input yields the specific `WireError` (`protocol-llc-cdc.md` §0, §2.1).

use smc_wire::cdc::*;
use smc_wire::WireError;

fn valid() -> [u8; 44] {
    CdcMessage {
        seqno: 11,
        token: 1,
        prod: Cursor::new(4, 0x91),
        cons: Cursor::new(0, 0x82),
        prod_flags: ProducerFlags::empty(),
        conn_flags: ConnStateFlags::PEER_CONN_CLOSED,
    }
    .encode()
}

#[test]
fn every_truncation_is_truncated() {
    let b = valid();
    for cut in 0..44 {
        match CdcMessage::decode(&b[..cut]) {
            Err(WireError::Truncated {
                needed, available, ..
            }) => {
                assert_eq!(available, cut);
                assert!(needed > cut);
            }
            other => panic!("cut {cut}: {other:?}"),
        }
    }
}

#[test]
fn length_byte_other_than_44_is_bad_length() {
    for l in (0..=255u8).filter(|l| *l != 44) {
        let mut b = valid();
        b[1] = l;
        assert_eq!(
            CdcMessage::decode(&b),
            Err(WireError::BadLength {
                what: "CDC length byte",
                claimed: usize::from(l),
                expected: 44
            })
        );
    }
}

#[test]
fn other_type_byte_is_unknown_type() {
    for t in [0x00u8, 0x07, 0x27, 0xFF, 0xFD] {
        let mut b = valid();
        b[0] = t;
        assert_eq!(
            CdcMessage::decode(&b),
            Err(WireError::UnknownType {
                family: "CDC",
                value: t
            })
        );
    }
}
