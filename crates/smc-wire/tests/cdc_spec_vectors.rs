//! `protocol-llc-cdc.md` §8.c CDC vectors, and unit tests of the cursor and seqno
//! arithmetic of §2.3, §2.4 and §3 (each with a Linux-derived expectation).

use smc_wire::cdc::*;
use smc_wire::WireError;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn check(bytes: &[u8], want: CdcMessage) {
    assert_eq!(bytes.len(), 44);
    let m = CdcMessage::decode(bytes).unwrap();
    assert_eq!(m, want);
    assert_eq!(&m.encode()[..], bytes);
    assert_eq!(&want.encode()[..], bytes);
}

#[test]
fn c1_write_blocked() {
    let b = hex(
        "fe2c000500000101000000010000100000000000000020008000000000000000000000000000000000000000",
    );
    check(
        &b,
        CdcMessage {
            seqno: 5,
            token: 0x101,
            prod: Cursor::new(1, 0x1000),
            cons: Cursor::new(0, 0x2000),
            prod_flags: ProducerFlags::WRITE_BLOCKED,
            conn_flags: ConnStateFlags::empty(),
        },
    );
    assert!(CdcMessage::decode(&b).unwrap().prod_flags.write_blocked());
}

#[test]
fn c2_peer_conn_closed() {
    let b = hex("fe 2c 00 06 00 00 01 01 00 00 00 01 00 00 10 00
         00 00 00 00 00 00 30 00 00 40 00 00 00 00 00 00
         00 00 00 00 00 00 00 00 00 00 00 00");
    check(
        &b,
        CdcMessage {
            seqno: 6,
            token: 0x101,
            prod: Cursor::new(1, 0x1000),
            cons: Cursor::new(0, 0x3000),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::PEER_CONN_CLOSED,
        },
    );
}

#[test]
fn c3_failover_validation() {
    let b = hex("fe 2c 00 04 00 00 01 01 00 00 00 00 00 00 00 00
         00 00 00 00 00 00 00 00 08 00 00 00 00 00 00 00
         00 00 00 00 00 00 00 00 00 00 00 00");
    let v = CdcMessage::failover_validation(4, 0x101);
    check(&b, v);
    assert!(CdcMessage::decode(&b).unwrap().is_failover_validation());
    assert!(!CdcMessage::default().is_failover_validation());
}

#[test]
fn c4_urgent_data() {
    let b = hex("fe 2c 00 07 00 00 01 01 00 00 00 02 00 00 00 10
         00 00 00 00 00 00 30 00 60 00 00 00 00 00 00 00
         00 00 00 00 00 00 00 00 00 00 00 00");
    let f = ProducerFlags::URG_DATA_PENDING | ProducerFlags::URG_DATA_PRESENT;
    assert_eq!(f.bits(), 0x60);
    check(
        &b,
        CdcMessage {
            seqno: 7,
            token: 0x101,
            prod: Cursor::new(2, 0x10),
            cons: Cursor::new(0, 0x3000),
            prod_flags: f,
            conn_flags: ConnStateFlags::empty(),
        },
    );
}

#[test]
fn flag_bits_and_reserved_bits_dropped() {
    assert_eq!(ProducerFlags::WRITE_BLOCKED.bits(), 0x80);
    assert_eq!(ProducerFlags::URG_DATA_PENDING.bits(), 0x40);
    assert_eq!(ProducerFlags::URG_DATA_PRESENT.bits(), 0x20);
    assert_eq!(ProducerFlags::CONS_CURS_UPD_REQ.bits(), 0x10);
    assert_eq!(ProducerFlags::FAILOVER_VALIDATION.bits(), 0x08);
    assert_eq!(ConnStateFlags::PEER_DONE_WRITING.bits(), 0x80);
    assert_eq!(ConnStateFlags::PEER_CONN_CLOSED.bits(), 0x40);
    assert_eq!(ConnStateFlags::PEER_CONN_ABORT.bits(), 0x20);
    assert_eq!(ProducerFlags::from_bits_truncate(0xFF).bits(), 0xF8);
    assert_eq!(ConnStateFlags::from_bits_truncate(0xFF).bits(), 0xE0);
    let mut b = CdcMessage::default().encode();
    b[24] = 0x87;
    b[25] = 0x3F;
    b[8] = 0xAA; // reserved bytes of the producer cursor
    b[43] = 0x55; // reserved tail
    let m = CdcMessage::decode(&b).unwrap();
    assert_eq!(m.prod_flags, ProducerFlags::WRITE_BLOCKED);
    assert_eq!(m.conn_flags, ConnStateFlags::PEER_CONN_ABORT);
    let e = m.encode();
    assert_eq!((e[8], e[24], e[25], e[43]), (0, 0x80, 0x20, 0));
    let mut f = ProducerFlags::empty();
    f.insert(ProducerFlags::WRITE_BLOCKED);
    f.set(ProducerFlags::CONS_CURS_UPD_REQ, true);
    assert!(f.write_blocked() && f.cons_curs_upd_req() && !f.urg_data_pending());
    f.remove(ProducerFlags::WRITE_BLOCKED);
    assert_eq!(f, ProducerFlags::CONS_CURS_UPD_REQ);
    assert!(f.contains(ProducerFlags::CONS_CURS_UPD_REQ));
    assert_eq!(format!("{f:?}"), "ProducerFlags(0x10 cons_curs_upd_req)");
}

#[test]
fn longer_buffer_is_accepted_and_the_tail_ignored() {
    let mut b = CdcMessage::failover_validation(9, 3).encode().to_vec();
    b.extend_from_slice(&[0xEE; 4]); // e.g. a 48-byte slot
    assert_eq!(
        CdcMessage::decode(&b).unwrap(),
        CdcMessage::failover_validation(9, 3)
    );
}

// ---------------------------------------------------------------- cursor arithmetic

const R: usize = 65536;

#[test]
fn add_wraps_like_smc_curs_add() {
    assert_eq!(Cursor::new(0, 0x90).add(R, R), Cursor::new(1, 0x90));
    assert_eq!(Cursor::new(0, 0x90).add(0xff70, R), Cursor::new(1, 0));
    assert_eq!(Cursor::new(0, 0x90).add(0xff6f, R), Cursor::new(0, 0xffff));
    assert_eq!(
        Cursor::new(0xFFFF, 0xfff0).add(0x20, R),
        Cursor::new(0, 0x10)
    );
    assert_eq!(Cursor::new(3, 5).add(0, R), Cursor::new(3, 5));
    // precondition violations: no panic, arithmetic result
    assert_eq!(Cursor::new(0, 5).add(3 * R + 1, R), Cursor::new(3, 6));
    assert_eq!(Cursor::new(0, 5).add(10, 0), Cursor::new(0, 5));
    assert!(Cursor::new(0, u32::MAX).add(usize::MAX, R).count < R as u32);
}

#[test]
fn capture_cursor_sequence_is_reproduced() {
    // README §5.3: client producer cursor 0:0x90 + 64 KiB bulk -> 1:0x90 ... 4:0x90, +1 -> 4:0x91
    let mut p = Cursor::new(0, 0x10);
    for _ in 0..4 {
        p = p.add(0x20, R);
    }
    assert_eq!(p, Cursor::new(0, 0x90));
    for w in 1..=4 {
        let chunks = write_chunks(R, p, R).unwrap();
        assert_eq!(chunks.as_slice(), &[(0x90, 65392), (0, 144)]);
        p = p.add(R, R);
        assert_eq!(p, Cursor::new(w, 0x90));
    }
    assert_eq!(p.add(1, R), Cursor::new(4, 0x91));
}

#[test]
fn diff_is_smc_curs_diff() {
    assert_eq!(
        cursor_diff(R, Cursor::new(0, 0x80), Cursor::new(0, 0x90)),
        0x10
    );
    assert_eq!(
        cursor_diff(R, Cursor::new(0, 0x90), Cursor::new(0, 0x80)),
        0,
        "behind -> 0"
    );
    assert_eq!(
        cursor_diff(R, Cursor::new(0, 0x90), Cursor::new(1, 0x90)),
        R
    );
    assert_eq!(
        cursor_diff(R, Cursor::new(0xFFFF, 0xfff0), Cursor::new(0, 0x10)),
        0x20
    );
    // hostile: count beyond the ring saturates instead of wrapping
    assert_eq!(cursor_diff(16, Cursor::new(0, 100), Cursor::new(1, 0)), 0);
    assert_eq!(
        cursor_diff(R, Cursor::new(0, 0), Cursor::new(1, u32::MAX)),
        R + u32::MAX as usize
    );
}

#[test]
fn comp_is_smc_curs_comp() {
    assert_eq!(
        cursor_comp(R, Cursor::new(0, 0x10), Cursor::new(0, 0x30)),
        0x20
    );
    assert_eq!(
        cursor_comp(R, Cursor::new(0, 0x30), Cursor::new(0, 0x10)),
        -0x20
    );
    assert_eq!(
        cursor_comp(R, Cursor::new(1, 0x10), Cursor::new(0, 0xfff0)),
        -0x20
    );
    assert_eq!(
        cursor_comp(R, Cursor::new(0, 0xfff0), Cursor::new(1, 0x10)),
        0x20
    );
    assert_eq!(cursor_comp(R, Cursor::new(2, 7), Cursor::new(2, 7)), 0);
    assert_eq!(
        cursor_cmp(Cursor::new(1, 0), Cursor::new(0, 9)),
        std::cmp::Ordering::Greater
    );
}

#[test]
fn diff_large_is_smc_curs_diff_large() {
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0, 0x10), Cursor::new(3, 0x10)),
        R
    );
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0, 0x10), Cursor::new(0, 0x30)),
        0x20
    );
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0, 0x30), Cursor::new(0, 0x10)),
        0
    );
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0, 0xfff0), Cursor::new(1, 0x10)),
        0x20
    );
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0xFFFF, 0xfff0), Cursor::new(0, 0x10)),
        0x20
    );
    assert_eq!(
        cursor_diff_large(R, Cursor::new(0xFFFF, 0xfff0), Cursor::new(1, 0x10)),
        R
    );
}

#[test]
fn backwards_rule_of_smc_cdc_cursor_to_host() {
    let old = Cursor::new(5, 0x100);
    assert!(cursor_moves_backwards(old, Cursor::new(4, 0x900)));
    assert!(cursor_moves_backwards(old, Cursor::new(5, 0xff)));
    assert!(
        !cursor_moves_backwards(old, Cursor::new(5, 0x100)),
        "equal is accepted"
    );
    assert!(!cursor_moves_backwards(old, Cursor::new(6, 0)));
    assert!(
        !cursor_moves_backwards(old, Cursor::new(0, 0)),
        "wrap 0 accepted"
    );
    assert!(!cursor_moves_backwards(
        Cursor::new(0xFFFF, 10),
        Cursor::new(0, 5)
    ));
    assert_eq!(accept_cursor(old, Cursor::new(4, 0)), old);
    assert_eq!(
        accept_cursor(old, Cursor::new(5, 0x200)),
        Cursor::new(5, 0x200)
    );
    assert_eq!(
        Cursor::new(1, 70000).clamp_count(R as u32),
        Cursor::new(1, R as u32)
    );
}

#[test]
fn seqno_rules() {
    assert!(seqno_is_older(4, 5));
    assert!(!seqno_is_older(5, 5), "equal seqno is processed");
    assert!(seqno_accept(5, 5));
    assert!(seqno_is_newer(6, 5));
    assert!(seqno_is_newer(0, 0xFFFF), "wrap-around");
    assert!(seqno_is_older(0xFFFF, 0));
    assert!(seqno_is_older(0x8005, 5), "(int16)(0x8000) < 0");
    assert!(seqno_is_newer(0x8004, 5));
    assert!(!seqno_accept(0xFFF0, 3));
    // failover validation: peer claims seqno 7 completed, we only received 5 -> out of sync
    assert!(failover_out_of_sync(5, 7));
    assert!(!failover_out_of_sync(7, 7));
    assert!(!failover_out_of_sync(9, 7));
    assert!(failover_out_of_sync(0xFFFF, 1));
}

#[test]
fn free_space_and_write_split() {
    // empty ring: all free
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(0, 0x90), Cursor::new(0, 0x90)),
        R
    );
    // full ring
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(1, 0x90), Cursor::new(0, 0x90)),
        0
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(1, 0x10), Cursor::new(0, 0x90)),
        0x80
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(0, 0x100), Cursor::new(0, 0x80)),
        R - 0x80
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(0, 0x10), Cursor::new(0xFFFF, 0xfff0)),
        R - 0x20
    );
    // inconsistent: consumer ahead, 2 rings in flight, count out of range -> 0
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(0, 0x10), Cursor::new(0, 0x20)),
        0
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(2, 0x10), Cursor::new(0, 0x20)),
        0
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(1, 0x30), Cursor::new(0, 0x20)),
        0
    );
    assert_eq!(
        peer_rmbe_free(R, Cursor::new(0, R as u32), Cursor::new(0, 0)),
        0
    );
    assert_eq!(peer_rmbe_free(0, Cursor::new(0, 0), Cursor::new(0, 0)), 0);

    assert_eq!(write_len(100, 4096), (100, false));
    assert_eq!(write_len(4096, 4096), (4096, true));
    assert_eq!(write_len(5000, 0), (0, true));

    assert!(write_chunks(R, Cursor::new(0, 0), 0).unwrap().is_empty());
    assert_eq!(
        write_chunks(R, Cursor::new(0, 0), R).unwrap().as_slice(),
        &[(0, R)]
    );
    assert_eq!(
        write_chunks(R, Cursor::new(0, 0xfff0), 0x10)
            .unwrap()
            .as_slice(),
        &[(0xfff0, 0x10)]
    );
    let c = write_chunks(R, Cursor::new(3, 0xfff0), 0x11).unwrap();
    assert_eq!(c.as_slice(), &[(0xfff0, 0x10), (0, 1)]);
    assert_eq!((c.len(), c.total()), (2, 0x11));
    assert!(matches!(
        write_chunks(R, Cursor::new(0, R as u32), 1),
        Err(WireError::InvalidField {
            field: "cursor count",
            ..
        })
    ));
    assert!(matches!(
        write_chunks(R, Cursor::new(0, 0), R + 1),
        Err(WireError::InvalidField {
            field: "ring access length",
            ..
        })
    ));
    assert!(write_chunks(0, Cursor::new(0, 0), 0).is_err());
}
