//! The machine's own limits, measured in the same run: what one core can copy
//! per second (the floor of any one-copy data path), and what one cache line
//! costs to bounce between the two cores (the floor of any shared-memory
//! notification, hence of an SMC-R round trip on this host), and how fast
//! two cores can move a stream through a shared ring with one copy in and
//! one copy out (the ceiling of any data path that copies on both sides, as
//! SMC-R with a socket API does).

use crate::sys;
use std::hint::black_box;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Single-core memcpy bandwidth, GB/s: `size`-byte copies repeated until about
/// `total` bytes are copied, on a thread pinned to the first allowed CPU.
pub fn memcpy_gbps(size: usize, total: usize) -> io::Result<f64> {
    let cpu = *sys::allowed_cpus()?
        .first()
        .ok_or_else(|| io::Error::other("no CPU allowed"))?;
    std::thread::scope(|s| {
        s.spawn(move || -> io::Result<f64> {
            sys::pin_to(cpu)?;
            let src = vec![0x5au8; size];
            let mut dst = vec![0u8; size];
            let reps = (total / size.max(1)).max(2);
            // warm-up: faults the pages in, fills the caches that can hold it
            for _ in 0..reps.min(8) {
                black_box(&mut dst).copy_from_slice(black_box(&src));
            }
            let t0 = Instant::now();
            for _ in 0..reps {
                black_box(&mut dst).copy_from_slice(black_box(&src));
            }
            Ok((size * reps) as f64 / t0.elapsed().as_secs_f64() / 1e9)
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("memcpy thread panicked")))
    })
}

/// One cache line, alone on its own 128 bytes (no false sharing with anything).
#[repr(align(128))]
struct Line(AtomicU64);

/// Round-trip time of one cache line bounced between two threads pinned to
/// two different CPUs: thread A writes an odd value, B answers with the next
/// even value, `iters` times. The median over 20 batches, in nanoseconds (a
/// batch hit by a preemption does not move it).
pub fn cacheline_rtt_ns(iters: usize) -> io::Result<f64> {
    let cpus = sys::allowed_cpus()?;
    let (Some(&a), Some(&b)) = (cpus.first(), cpus.get(1)) else {
        return Err(io::Error::other(
            "the cache-line round trip needs two CPUs; this process may use one",
        ));
    };
    const BATCHES: usize = 20;
    let per = (iters / BATCHES).max(1);
    let line = Line(AtomicU64::new(0));
    let mut batches: Vec<Duration> = std::thread::scope(|s| {
        let l = &line;
        let echo = s.spawn(move || -> io::Result<()> {
            // On a pinning failure, still answer (the timer thread waits for
            // us), then report it.
            let pinned = sys::pin_to(b);
            for i in 0..(per * BATCHES) as u64 {
                let want = 2 * i + 1;
                while l.0.load(Ordering::Acquire) != want {
                    std::hint::spin_loop();
                }
                l.0.store(want + 1, Ordering::Release);
            }
            pinned
        });
        let timer = s.spawn(move || -> io::Result<Vec<Duration>> {
            let pinned = sys::pin_to(a);
            let mut v = Vec::with_capacity(BATCHES);
            let mut i = 0u64;
            for _ in 0..BATCHES {
                let t0 = Instant::now();
                for _ in 0..per {
                    l.0.store(2 * i + 1, Ordering::Release);
                    while l.0.load(Ordering::Acquire) != 2 * i + 2 {
                        std::hint::spin_loop();
                    }
                    i += 1;
                }
                v.push(t0.elapsed());
            }
            pinned.map(|_| v)
        });
        let v = timer
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("timer thread panicked")));
        let e = echo
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("echo thread panicked")));
        e.and(v)
    })?;
    batches.sort_unstable();
    Ok(batches[BATCHES / 2].as_secs_f64() * 1e9 / per as f64)
}

/// Stream bandwidth through a ring in shared memory (a memfd mapping, as the
/// shm device's RMBs are) between two threads pinned to two CPUs: the producer
/// copies `chunk`-byte pieces from its own buffer into the ring whenever there
/// is room, the consumer copies them out into its own buffer; cursors are two
/// atomics on their own cache lines. GB/s over about `total` bytes.
pub fn ring_copy_gbps(ring: usize, chunk: usize, total: u64) -> io::Result<f64> {
    use smc_rdma::sys::SharedMem;
    let cpus = sys::allowed_cpus()?;
    let (Some(&a), Some(&b)) = (cpus.first(), cpus.get(1)) else {
        return Err(io::Error::other("the ring copy needs two CPUs"));
    };
    let chunk = chunk.min(ring).max(1);
    // ring, then the producer's and the consumer's cursors 128 bytes apart
    let mem = SharedMem::create("smc-bench-ring", ring + 256)?;
    mem.fill(0, ring, 0)?;
    let (prod, cons) = (mem.atomic(ring)?, mem.atomic(ring + 128)?);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let mem = &mem;
        let consumer = s.spawn(move || -> io::Result<u64> {
            let pinned = sys::pin_to(b);
            let mut dst = vec![0u8; chunk];
            let (mut got, mut sum) = (0u64, 0u64);
            while got < total {
                let p = prod.load(Ordering::Acquire);
                if p == got {
                    std::hint::spin_loop();
                    continue;
                }
                let off = (got % ring as u64) as usize;
                let n = ((p - got) as usize).min(chunk).min(ring - off);
                mem.read(off, &mut dst[..n])?;
                sum = sum.wrapping_add(u64::from(dst[n - 1]));
                got += n as u64;
                cons.store(got, Ordering::Release);
            }
            pinned.map(|_| black_box(sum))
        });
        let producer = s.spawn(move || -> io::Result<()> {
            let pinned = sys::pin_to(a);
            let src = vec![0x5au8; chunk];
            let mut sent = 0u64;
            while sent < total {
                let free = ring - (sent - cons.load(Ordering::Acquire)) as usize;
                if free == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let off = (sent % ring as u64) as usize;
                let n = free.min(chunk).min(ring - off);
                mem.write(off, &src[..n])?;
                sent += n as u64;
                prod.store(sent, Ordering::Release);
            }
            pinned
        });
        let p = producer
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("producer thread panicked")));
        let c = consumer
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("consumer thread panicked")));
        p.and(c)
    })?;
    Ok(total as f64 / t0.elapsed().as_secs_f64() / 1e9)
}
