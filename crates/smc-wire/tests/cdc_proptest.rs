//! Property tests for the CDC codec (`protocol-llc-cdc.md` §2.1) and the cursor /
//! seqno arithmetic (§2.3, §3).

use proptest::collection::vec;
use proptest::prelude::*;
use smc_wire::cdc::*;
use smc_wire::WireError;

fn cursor() -> impl Strategy<Value = Cursor> {
    (any::<u16>(), any::<u32>()).prop_map(|(w, c)| Cursor::new(w, c))
}

fn cdc() -> impl Strategy<Value = CdcMessage> {
    (
        any::<u16>(),
        any::<u32>(),
        cursor(),
        cursor(),
        any::<u8>(),
        any::<u8>(),
    )
        .prop_map(|(seqno, token, prod, cons, p, c)| CdcMessage {
            seqno,
            token,
            prod,
            cons,
            prod_flags: ProducerFlags::from_bits_truncate(p),
            conn_flags: ConnStateFlags::from_bits_truncate(c),
        })
}

/// A ring size (1 byte .. 512 MiB) and a valid cursor in it.
fn ring_and_cursor() -> impl Strategy<Value = (usize, Cursor)> {
    prop_oneof![
        (14u32..=29).prop_map(|e| 1usize << e), // real RMBE sizes 16 KiB .. 512 MiB
        1usize..100_000,
    ]
    .prop_flat_map(|r| (Just(r), any::<u16>(), 0..r as u32))
    .prop_map(|(r, w, c)| (r, Cursor::new(w, c)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn cdc_round_trips(m in cdc()) {
        let b = m.encode();
        prop_assert_eq!(b.len(), CDC_LEN);
        prop_assert_eq!((b[0], b[1]), (0xFE, 44));
        prop_assert_eq!(&b[26..], &[0u8; 18][..]);
        prop_assert_eq!(CdcMessage::decode(&b), Ok(m));
        let mut v = Vec::new();
        m.encode_into(&mut v);
        prop_assert_eq!(&v[..], &b[..]);
        smc_wire::cdc::fuzz_one(&b);
    }

    #[test]
    fn cdc_truncations_and_garbage(m in cdc(), cut in 0usize..44, data in vec(any::<u8>(), 0..64)) {
        let b = m.encode();
        let r = CdcMessage::decode(&b[..cut]);
        prop_assert!(matches!(r, Err(WireError::Truncated { .. })), "cut {}: {:?}", cut, r);
        smc_wire::cdc::fuzz_one(&data);
        let mut d = b.to_vec();
        d.extend_from_slice(&data);
        prop_assert_eq!(CdcMessage::decode(&d), Ok(m));
    }

    #[test]
    fn add_then_diff_gives_n((r, c) in ring_and_cursor(), frac in 0.0f64..=1.0) {
        let n = ((r as f64) * frac) as usize;
        let n = n.min(r);
        let d = c.add(n, r);
        prop_assert!((d.count as usize) < r);
        prop_assert_eq!(cursor_diff(r, c, d), n);
        prop_assert_eq!(cursor_comp(r, c, d), n as i64);
        prop_assert_eq!(cursor_diff_large(r, c, d), n);
        prop_assert!(!cursor_moves_backwards(c, d));
        prop_assert_eq!(accept_cursor(c, d), d);
        if n > 0 && d.wrap == c.wrap {
            prop_assert!(cursor_moves_backwards(d, c));
            prop_assert_eq!(cursor_diff(r, d, c), 0);
            prop_assert_eq!(cursor_comp(r, d, c), -(n as i64));
        }
    }

    #[test]
    fn add_composes((r, c) in ring_and_cursor(), a in 0usize..1 << 30, b in 0usize..1 << 30) {
        prop_assert_eq!(c.add(a, r).add(b, r), c.add(a + b, r));
    }

    #[test]
    fn chunks_cover_the_write((r, p) in ring_and_cursor(), frac in 0.0f64..=1.0) {
        let len = (((r as f64) * frac) as usize).min(r);
        let ch = write_chunks(r, p, len).unwrap();
        prop_assert!(ch.len() <= 2);
        prop_assert_eq!(ch.total(), len);
        prop_assert_eq!(ch.as_slice().len(), ch.len());
        let mut pos = p;
        for &(off, l) in ch.as_slice() {
            prop_assert!(l > 0);
            prop_assert!(off + l <= r);
            prop_assert_eq!(off, pos.count as usize, "chunks are contiguous in ring order");
            pos = pos.add(l, r);
        }
        prop_assert_eq!(pos, p.add(len, r));
        if let [_, second] = ch.as_slice() {
            prop_assert_eq!(second.0, 0);
        }
    }

    #[test]
    fn free_space_is_bounded(r in 0usize..1 << 30, p in cursor(), c in cursor()) {
        prop_assert!(peer_rmbe_free(r, p, c) <= r);
        // the totals never panic either
        let _ = cursor_diff(r, p, c);
        let _ = cursor_comp(r, p, c);
        let _ = cursor_diff_large(r, p, c);
        let _ = write_chunks(r, p, r);
        let _ = p.add(usize::MAX, r);
    }

    #[test]
    fn free_space_matches_bytes_in_flight((r, cons) in ring_and_cursor(), frac in 0.0f64..=1.0) {
        let k = (((r as f64) * frac) as usize).min(r);
        let prod = cons.add(k, r);
        prop_assert_eq!(peer_rmbe_free(r, prod, cons), r - k);
        let (len, blocked) = write_len(k + 1, r - k);
        prop_assert!(len <= peer_rmbe_free(r, prod, cons));
        prop_assert_eq!(blocked, k + 1 >= r - k);
    }

    #[test]
    fn seqno_serial_arithmetic(a in any::<u16>(), d in 1u16..0x8000) {
        let b = a.wrapping_add(d);
        prop_assert!(seqno_is_newer(b, a));
        prop_assert!(seqno_is_older(a, b));
        prop_assert!(!seqno_accept(a, b));
        prop_assert!(seqno_accept(b, a));
        prop_assert!(seqno_accept(a, a) && !seqno_is_newer(a, a) && !seqno_is_older(a, a));
        prop_assert!(failover_out_of_sync(a, b));
        prop_assert!(!failover_out_of_sync(b, a));
    }
}
