//! Two connection ends exchanging data through in-memory "RDMA": RDMA WRITEs land
//! in the peer's RMBE at once, CDCs travel in order on a queue and arrive later,
//! send completions arrive later still. Random application writes and reads of
//! every size (0, small, larger than any buffer) in both directions, random
//! interleavings. Invariants: every byte arrives once, in order, unchanged; no
//! cursor passes its limit (the data path would panic on underflow or report a
//! violation); when both sides stop writing, everything drains. Links fail now
//! and then: a prefix of the CDCs in flight arrives, the rest is lost with every
//! outstanding completion, and both ends move the connection to another link
//! (failover rewind and validation CDC, §7.2 / §2.4) — still every byte arrives
//! once, in order, also with a failover reserve kept at the peer's RMBE.

use proptest::prelude::*;
use smc_proto::datapath::{DataPath, DataPathConfig, TxBatch};
use std::collections::VecDeque;

struct End {
    dp: DataPath,
    sndbuf: Vec<u8>,
    rmbe: Vec<u8>,
    to_send: VecDeque<u8>,
    sent_total: u64,
    received: Vec<u8>,
}

fn pattern(side: usize, i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 7) as u8 ^ (side as u8 * 0x5a)
}

impl End {
    fn new(side_cfg: DataPathConfig) -> End {
        End {
            sndbuf: vec![0; side_cfg.sndbuf_len],
            rmbe: vec![0; side_cfg.rmbe_len],
            dp: DataPath::new(side_cfg),
            to_send: VecDeque::new(),
            sent_total: 0,
            received: Vec::new(),
        }
    }
    /// The application writes as much of its pending stream as fits.
    fn app_write(&mut self) {
        let chunks = self.dp.sndbuf_free_chunks(self.to_send.len());
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            for b in &mut self.sndbuf[off..off + len] {
                *b = self.to_send.pop_front().unwrap();
            }
            n += len;
        }
        assert_eq!(self.dp.produced(n), n);
    }
    fn app_read(&mut self, max: usize) {
        let chunks = self.dp.readable_chunks(max);
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            self.received.extend_from_slice(&self.rmbe[off..off + len]);
            n += len;
        }
        assert_eq!(self.dp.consumed(n), n);
    }
}

/// One message on the wire: the RDMA WRITEs (peer offset, bytes) and the CDC
/// after them. They arrive together (RC order) or, when the link fails, not at all.
type Msg = (Vec<(usize, Vec<u8>)>, smc_wire::cdc::CdcMessage);

/// Carries out a batch: the written bytes and the CDC onto the wire.
fn post(batch: TxBatch, from: &End, wire: &mut VecDeque<Msg>) {
    let mut writes = Vec::new();
    for w in &batch.writes {
        let mut data = Vec::new();
        for &(off, len) in w.src.as_slice() {
            data.extend_from_slice(&from.sndbuf[off..off + len]);
        }
        assert_eq!(data.len(), w.len);
        writes.push((w.peer_offset, data));
    }
    // The CDC goes through the codec, as on a real link.
    let bytes = batch.cdc.encode();
    let decoded = smc_wire::cdc::CdcMessage::decode(&bytes).unwrap();
    assert_eq!(decoded, batch.cdc);
    wire.push_back((writes, decoded));
}

#[derive(Clone, Debug)]
enum Op {
    Queue(usize, usize),
    Write(usize),
    Tx(usize),
    Deliver(usize),
    Complete(usize),
    Read(usize, usize),
    /// The link fails: this many of each side's CDCs in flight still arrive.
    Failover(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let side = 0..2usize;
    prop_oneof![
        (
            side.clone(),
            prop_oneof![
                Just(0usize),
                1..64usize,
                1..20_000usize,
                30_000..100_000usize
            ]
        )
            .prop_map(|(s, n)| Op::Queue(s, n)),
        side.clone().prop_map(Op::Write),
        side.clone().prop_map(Op::Tx),
        side.clone().prop_map(Op::Tx),
        side.clone().prop_map(Op::Deliver),
        side.clone().prop_map(Op::Deliver),
        side.clone().prop_map(Op::Complete),
        (side, prop_oneof![Just(0usize), 1..100usize, 1..70_000usize])
            .prop_map(|(s, n)| Op::Read(s, n)),
        (0..4usize).prop_map(Op::Failover),
    ]
}

fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![Just(16384usize), Just(32768), Just(65536)]
}

struct Pair {
    ends: [End; 2],
    wire: [VecDeque<Msg>; 2],
    completions: [VecDeque<u16>; 2],
}

impl Pair {
    fn step(&mut self, op: &Op) {
        match *op {
            Op::Queue(s, n) => {
                let e = &mut self.ends[s];
                for _ in 0..n {
                    e.to_send.push_back(pattern(s, e.sent_total));
                    e.sent_total += 1;
                }
            }
            Op::Write(s) => self.ends[s].app_write(),
            Op::Tx(s) => {
                let me = &mut self.ends[s];
                if let Some(batch) = me.dp.poll_tx() {
                    let seq = batch.cdc.seqno;
                    post(batch, me, &mut self.wire[s]);
                    self.completions[s].push_back(seq);
                }
            }
            Op::Deliver(s) => {
                if let Some((writes, m)) = self.wire[s].pop_front() {
                    let peer = &mut self.ends[1 - s];
                    for (at, data) in writes {
                        peer.rmbe[at..at + data.len()].copy_from_slice(&data);
                    }
                    let r = self.ends[1 - s]
                        .dp
                        .on_cdc(&m)
                        .expect("honest peer flagged as violation");
                    assert!(!r.stale, "CDCs of one link arrive in order");
                }
            }
            Op::Complete(s) => {
                // a send completes only after its CDC reached the peer's queue
                let delivered =
                    self.completions[s].len() - self.wire[s].len().min(self.completions[s].len());
                if delivered > 0 {
                    let seq = self.completions[s].pop_front().unwrap();
                    self.ends[s].dp.on_cdc_sent(seq).unwrap();
                }
            }
            Op::Read(s, n) => self.ends[s].app_read(n),
            Op::Failover(k) => {
                for s in 0..2 {
                    for _ in 0..k {
                        self.step(&Op::Deliver(s));
                    }
                    // the rest never arrives; no completion is reported any more
                    self.wire[s].clear();
                    self.completions[s].clear();
                }
                for s in 0..2 {
                    // the validation CDC is the first message on the new link
                    let v = self.ends[s].dp.failover_rewind();
                    assert!(v.is_failover_validation());
                    let r = self.ends[1 - s]
                        .dp
                        .on_cdc(&v)
                        .expect("validation must find the connection in sync");
                    assert!(r.stale, "a validation CDC is not data");
                }
            }
        }
    }

    fn drain(&mut self) {
        for _round in 0..10_000 {
            let mut progress = false;
            for s in 0..2 {
                let before = (
                    self.ends[s].to_send.len(),
                    self.ends[s].dp.unacked(),
                    self.ends[s].received.len(),
                );
                self.step(&Op::Write(s));
                self.step(&Op::Tx(s));
                while !self.wire[s].is_empty() {
                    self.step(&Op::Deliver(s));
                }
                while !self.completions[s].is_empty() {
                    self.step(&Op::Complete(s));
                }
                self.step(&Op::Read(1 - s, usize::MAX));
                let after = (
                    self.ends[s].to_send.len(),
                    self.ends[s].dp.unacked(),
                    self.ends[s].received.len(),
                );
                progress |= before != after;
            }
            let idle = (0..2).all(|s| {
                self.ends[s].to_send.is_empty()
                    && self.ends[s].dp.unacked() == 0
                    && self.wire[s].is_empty()
            });
            if idle && !progress {
                return;
            }
        }
        panic!(
            "data path did not drain: {:?}",
            (0..2)
                .map(|s| (
                    self.ends[s].to_send.len(),
                    self.ends[s].dp.unacked(),
                    self.ends[s].dp.peer_space()
                ))
                .collect::<Vec<_>>()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn every_byte_arrives_once_in_order(
        snd in [sizes(), sizes()],
        rmb in [sizes(), sizes()],
        ops in proptest::collection::vec(op(), 0..200),
        reserve in [0usize..3, 0usize..3],
    ) {
        let cfg = |s: usize| DataPathConfig {
            sndbuf_len: snd[s],
            rmbe_len: rmb[s],
            peer_rmbe_len: rmb[1 - s],
            peer_token: 100 + s as u32,
        };
        let mut p = Pair {
            ends: [End::new(cfg(0)), End::new(cfg(1))],
            wire: [VecDeque::new(), VecDeque::new()],
            completions: [VecDeque::new(), VecDeque::new()],
        };
        // the failover reserve of a group with redundancy (0: none)
        for (end, &r) in p.ends.iter_mut().zip(&reserve) {
            end.dp.set_failover_reserve(r);
        }
        for o in &ops {
            p.step(o);
            for s in 0..2 {
                let dp = &p.ends[s].dp;
                prop_assert!(dp.peer_space() <= rmb[1 - s]);
                prop_assert!(dp.readable() <= rmb[s]);
                prop_assert!(dp.sndbuf_free() <= snd[s]);
            }
        }
        p.drain();
        for s in 0..2 {
            let want: Vec<u8> = (0..p.ends[s].sent_total).map(|i| pattern(s, i)).collect();
            prop_assert_eq!(p.ends[1 - s].received.len(), want.len());
            prop_assert!(p.ends[1 - s].received == want, "stream {} corrupted", s);
        }
    }
}

#[test]
fn one_gibibyte_through_64k_buffers() {
    // Bulk one way with small buffers: exercises wraps (16-bit wrap counter too:
    // 1 GiB / 16 KiB = 65536 ring passes, so the wrap counter rolls over).
    let cfg = |s: usize| DataPathConfig {
        sndbuf_len: 65536,
        rmbe_len: 16384,
        peer_rmbe_len: 16384,
        peer_token: s as u32,
    };
    let mut p = Pair {
        ends: [End::new(cfg(0)), End::new(cfg(1))],
        wire: [VecDeque::new(), VecDeque::new()],
        completions: [VecDeque::new(), VecDeque::new()],
    };
    let total: u64 = 1 << 30;
    let mut produced = 0u64;
    let mut checked = 0u64;
    let mut hash_sent = 0u64;
    let mut hash_recv = 0u64;
    let mut buf = Vec::new();
    while checked < total {
        // app writes straight into the send buffer (no to_send queue, to save memory)
        let e = &mut p.ends[0];
        let want = (total - produced).min(1 << 20) as usize;
        let chunks = e.dp.sndbuf_free_chunks(want);
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            for b in &mut e.sndbuf[off..off + len] {
                *b = pattern(0, produced + n as u64);
                hash_sent = hash_sent.wrapping_mul(31).wrapping_add(*b as u64);
                n += 1;
            }
        }
        e.dp.produced(n);
        produced += n as u64;
        p.step(&Op::Tx(0));
        while !p.wire[0].is_empty() {
            p.step(&Op::Deliver(0));
        }
        while !p.completions[0].is_empty() {
            p.step(&Op::Complete(0));
        }
        // reader takes everything and verifies
        let r = &mut p.ends[1];
        let chunks = r.dp.readable_chunks(usize::MAX);
        let mut n = 0;
        buf.clear();
        for &(off, len) in chunks.as_slice() {
            buf.extend_from_slice(&r.rmbe[off..off + len]);
            n += len;
        }
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(
                *b,
                pattern(0, checked + i as u64),
                "byte {}",
                checked + i as u64
            );
            hash_recv = hash_recv.wrapping_mul(31).wrapping_add(*b as u64);
        }
        r.dp.consumed(n);
        checked += n as u64;
        p.step(&Op::Tx(1)); // consumer updates
        while !p.wire[1].is_empty() {
            p.step(&Op::Deliver(1));
        }
        while !p.completions[1].is_empty() {
            p.step(&Op::Complete(1));
        }
    }
    assert_eq!(hash_sent, hash_recv);
    assert_eq!(p.ends[1].dp.totals().0, total);
}
