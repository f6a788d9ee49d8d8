//! Micro-benchmarks of the SMC-R hot path, below the socket library:
//!
//! * `cdc`      — encoding and decoding the 44-byte CDC message (smc-wire);
//! * `cursor`   — cursor arithmetic (smc-wire helpers, smc-proto `cursor_at`)
//!   and one full `DataPath` exchange: produce, poll_tx, peer on_cdc, consume,
//!   consumer update, send completion (smc-proto, no I/O);
//! * `copy`     — 64 KiB into shared memory at distances where `rep movsb`
//!   stalls on some cores and where it does not: `memcpy` against
//!   `smc_rdma::copy` (`SMC_COPY_PIECES=1` shows its pieces on a core whose
//!   probe found no stall);
//! * `shm`      — the shared-memory device (smc-rdma `shm`) with two QPs in
//!   this process on `lo`: an RDMA WRITE of 64 B / 4 KiB / 64 KiB posted and
//!   its completion polled, and a 44-byte SEND (a CDC) from post to the
//!   peer's receive completion.
//!
//! `cargo bench -p smc-bench --bench hot` (no root needed).
#![forbid(unsafe_code)]

use divan::counter::BytesCount;
use divan::{black_box, Bencher};

fn main() {
    divan::main();
}

mod cdc {
    use super::*;
    use smc_wire::cdc::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags, CDC_LEN};

    fn msg() -> CdcMessage {
        CdcMessage {
            seqno: 0x1234,
            token: 0xdead_beef,
            prod: Cursor::new(7, 40_000),
            cons: Cursor::new(6, 12_345),
            prod_flags: ProducerFlags::WRITE_BLOCKED,
            conn_flags: ConnStateFlags::empty(),
        }
    }

    /// `CdcMessage::encode` (returns the 44 bytes).
    #[divan::bench]
    fn encode() -> [u8; CDC_LEN] {
        black_box(msg()).encode()
    }

    /// `CdcMessage::encode_into` a reused buffer.
    #[divan::bench]
    fn encode_into(b: Bencher) {
        let mut out = Vec::with_capacity(CDC_LEN);
        let m = msg();
        b.bench_local(|| {
            out.clear();
            black_box(&m).encode_into(&mut out);
            black_box(&out);
        });
    }

    /// `CdcMessage::decode` of 44 bytes.
    #[divan::bench]
    fn decode(b: Bencher) {
        let bytes = msg().encode();
        b.bench_local(|| CdcMessage::decode(black_box(&bytes)));
    }
}

mod cursor {
    use super::*;
    use smc_proto::datapath::{cursor_at, DataPath, DataPathConfig};
    use smc_wire::cdc::{cursor_diff, peer_rmbe_free, write_chunks, Cursor};

    const RING: usize = 65536;

    /// `Cursor::add`, crossing the ring end.
    #[divan::bench]
    fn add() -> Cursor {
        black_box(Cursor::new(3, 60_000)).add(black_box(10_000), black_box(RING))
    }

    /// `cursor_diff` across a wrap.
    #[divan::bench]
    fn diff() -> usize {
        cursor_diff(
            black_box(RING),
            black_box(Cursor::new(3, 60_000)),
            black_box(Cursor::new(4, 4_464)),
        )
    }

    /// `peer_rmbe_free`.
    #[divan::bench]
    fn rmbe_free() -> usize {
        peer_rmbe_free(
            black_box(RING),
            black_box(Cursor::new(4, 4_464)),
            black_box(Cursor::new(3, 50_000)),
        )
    }

    /// `write_chunks` of a range that wraps (two pieces).
    #[divan::bench]
    fn chunks_wrapping() -> usize {
        write_chunks(
            black_box(RING),
            black_box(Cursor::new(3, 60_000)),
            black_box(10_000),
        )
        .map(|c| c.len())
        .unwrap_or(0)
    }

    /// smc-proto's absolute position to wire cursor.
    #[divan::bench]
    fn abs_to_cursor() -> Cursor {
        cursor_at(black_box(123_456_789), black_box(RING))
    }

    fn cfg(token: u32) -> DataPathConfig {
        DataPathConfig {
            sndbuf_len: RING,
            rmbe_len: RING,
            peer_rmbe_len: RING,
            peer_token: token,
        }
    }

    /// One message of `n` bytes through two `DataPath`s: produce, poll_tx,
    /// peer on_cdc, readable_chunks, consumed, the consumer update when the
    /// rule says so, and the send completion.
    #[divan::bench(args = [64, 4096, 16384])]
    fn datapath_exchange(b: Bencher, n: usize) {
        let mut tx = DataPath::new(cfg(1));
        let mut rx = DataPath::new(cfg(2));
        b.counter(BytesCount::new(n)).bench_local(|| {
            let free = tx.sndbuf_free_chunks(n);
            tx.produced(free.total());
            if let Some(batch) = tx.poll_tx() {
                let seq = batch.cdc.seqno;
                let got = rx.on_cdc(&batch.cdc).expect("valid CDC");
                let chunks = rx.readable_chunks(got.new_data);
                rx.consumed(chunks.total());
                if let Some(upd) = rx.poll_tx() {
                    tx.on_cdc(&upd.cdc).expect("valid update");
                    rx.on_cdc_sent(upd.cdc.seqno).expect("in flight");
                }
                tx.on_cdc_sent(seq).expect("in flight");
            }
        });
    }
}

mod shm {
    use super::*;
    use smc_rdma::conformance::{ConnParams, Endpoint};
    use smc_rdma::shm::{ShmConfig, ShmDeviceConfig, ShmProvider};
    use smc_rdma::{
        CompletionQueue, MemoryRegion, Payload, QueuePair, RecvWr, SendOp, SendWr, WcStatus,
        WorkCompletion,
    };
    use std::path::PathBuf;

    /// Operations run before the samples (first-use mappings, cold caches):
    /// each bench builds its fixture, and divan takes few iterations per
    /// sample at these speeds, so a cold start would show in the median.
    const WARMUP: usize = 1000;

    /// Two QPs of one shm device on `lo`, in this process, connected.
    struct Pair {
        a: Endpoint<ShmProvider>,
        b: Endpoint<ShmProvider>,
        rundir: PathBuf,
        _provider: ShmProvider,
    }

    impl Pair {
        fn new() -> Pair {
            let rundir = std::env::temp_dir().join(format!("smc-bench-hot-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&rundir);
            std::fs::create_dir_all(&rundir).expect("rundir");
            let provider = ShmProvider::new(ShmConfig {
                devices: vec![ShmDeviceConfig {
                    name: "shm0".into(),
                    netdev: "lo".into(),
                }],
                rundir: rundir.clone(),
                ..Default::default()
            });
            let params = ConnParams {
                mr_len: 1 << 20,
                ..Default::default()
            };
            let a = Endpoint::open(&provider, "shm0", params).expect("open shm0 on lo");
            let b = Endpoint::open(&provider, "shm0", params).expect("open shm0 on lo");
            a.connect(&b.info()).expect("connect a");
            b.connect(&a.info()).expect("connect b");
            Pair {
                a,
                b,
                rundir,
                _provider: provider,
            }
        }
    }

    impl Drop for Pair {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.rundir);
        }
    }

    /// RDMA WRITE of `n` bytes into the peer's region: post (signaled) and
    /// poll the send CQ until its completion.
    #[divan::bench(args = [64, 4096, 65536], sample_count = 1000)]
    fn rdma_write(b: Bencher, n: usize) {
        let p = Pair::new();
        let remote = p.b.info().mr;
        let sge = p.a.mr.sge(0, n as u32).expect("sge");
        let mut wcs = [WorkCompletion::default(); 4];
        let mut id = 0u64;
        let mut one = || {
            id += 1;
            p.a.qp
                .post_send(&SendWr {
                    wr_id: id,
                    op: SendOp::RdmaWrite {
                        remote_addr: remote.addr,
                        rkey: remote.rkey,
                    },
                    payload: Payload::Sges(std::slice::from_ref(&sge)),
                    signaled: true,
                })
                .expect("post");
            loop {
                let k = p.a.scq.poll(&mut wcs).expect("poll");
                if k > 0 {
                    assert_eq!(wcs[0].status, WcStatus::Success);
                    break;
                }
            }
        };
        // Warm-up: the first WRITE maps the peer's region; keep it out of the samples.
        for _ in 0..WARMUP {
            one();
        }
        b.counter(BytesCount::new(n)).bench_local(one);
    }

    /// A 44-byte inline SEND (a CDC's size) from post to the peer's receive
    /// completion, receive re-posted (one sender completion every 16).
    #[divan::bench(sample_count = 1000)]
    fn send_cdc_44(b: Bencher) {
        let p = Pair::new();
        let msg = [0x11u8; 44];
        let mut wcs = [WorkCompletion::default(); 4];
        for i in 0..16u64 {
            let sge = p.b.mr.sge(64 * i as usize, 64).expect("sge");
            p.b.qp
                .post_recv(&RecvWr {
                    wr_id: i,
                    sges: &[sge],
                })
                .expect("post_recv");
        }
        let mut id = 0u64;
        let mut one = || {
            id += 1;
            p.a.qp
                .post_send(&SendWr {
                    wr_id: id,
                    op: SendOp::Send,
                    payload: Payload::Inline(&msg),
                    signaled: id.is_multiple_of(16),
                })
                .expect("post");
            let got = loop {
                if p.b.rcq.poll(&mut wcs[..1]).expect("poll") == 1 {
                    break wcs[0];
                }
            };
            assert_eq!(got.status, WcStatus::Success);
            let sge = p.b.mr.sge(64 * got.wr_id as usize, 64).expect("sge");
            p.b.qp
                .post_recv(&RecvWr {
                    wr_id: got.wr_id,
                    sges: &[sge],
                })
                .expect("post_recv");
            if id.is_multiple_of(16) {
                while p.a.scq.poll(&mut wcs).expect("poll") == 0 {}
            }
        };
        for _ in 0..WARMUP {
            one();
        }
        b.bench_local(one);
    }
}

mod copy {
    //! 64 KiB copied from a buffer into shared memory (an RMB's mapping) at
    //! a chosen `(destination - source) mod 4096`: through `memcpy`
    //! (`copy_from_slice`, what a plain copy does) and through
    //! `SharedMem::write` (`smc_rdma::copy`, which goes in pieces where
    //! `rep movsb` would stall, on a core where it does). Distances 1 and 8
    //! are in the band `smc_rdma::copy` splits there; 0 is too; 64 and 2048
    //! are not.
    use super::*;
    use smc_rdma::sys::SharedMem;

    const LEN: usize = 64 * 1024;

    /// The offset in a buffer at `base` at which a copy from `src` has
    /// `(destination - source) mod 4096 == distance`.
    fn offset(src: &[u8], base: usize, distance: usize) -> usize {
        (src.as_ptr() as usize + distance + 4096 - base % 4096) % 4096
    }

    /// `copy_from_slice` between two heap buffers at that distance.
    #[divan::bench(args = [0, 1, 8, 64, 2048])]
    fn memcpy(b: Bencher, distance: usize) {
        let src = vec![7u8; LEN];
        let mut dst = vec![0u8; LEN + 2 * 4096];
        let off = offset(&src, dst.as_ptr() as usize, distance);
        b.counter(BytesCount::new(LEN))
            .bench_local(|| dst[off..off + LEN].copy_from_slice(black_box(&src)));
    }

    /// `SharedMem::write` into a memfd mapping at that distance.
    #[divan::bench(args = [0, 1, 8, 64, 2048])]
    fn shared_mem_write(b: Bencher, distance: usize) {
        let src = vec![7u8; LEN];
        let mem = SharedMem::create("smc-bench-copy", LEN + 2 * 4096).expect("memfd");
        // (a mapping starts on a page)
        let off = offset(&src, 0, distance);
        b.counter(BytesCount::new(LEN))
            .bench_local(|| mem.write(off, black_box(&src)).expect("in bounds"));
    }
}
