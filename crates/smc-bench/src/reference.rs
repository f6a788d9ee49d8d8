//! The machine's own limits, measured in the same run: what one core can copy
//! per second (the floor of any one-copy data path), what one cache line
//! costs to bounce between two cores (the floor of any shared-memory
//! notification, hence of an SMC-R round trip across cores on this host), how
//! fast a stream moves through a shared ring with one copy in and one copy
//! out (the ceiling of any data path that copies on both sides, as SMC-R with
//! a socket API does), and request/response over nothing but such copies.
//! Everything but the memcpy runs on the CPUs of a placement: the client
//! side's threads on the client's CPU, the server side's on the server's.

use crate::sys;
use std::hint::black_box;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Single-core memcpy bandwidth, GB/s: `size`-byte copies repeated until about
/// `total` bytes are copied, on a thread pinned to `cpu`.
pub fn memcpy_gbps(size: usize, total: usize, cpu: usize) -> io::Result<f64> {
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
/// the two different CPUs `a` and `b`: thread A writes an odd value, B
/// answers with the next even value, `iters` times. The median over 20
/// batches, in nanoseconds (a batch hit by a preemption does not move it).
pub fn cacheline_rtt_ns(iters: usize, a: usize, b: usize) -> io::Result<f64> {
    if a == b {
        return Err(io::Error::other(
            "the cache-line round trip needs two different CPUs",
        ));
    }
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
/// shm device's RMBs are) between a producer thread pinned to CPU `a` and a
/// consumer thread pinned to CPU `b`: the producer copies `chunk`-byte
/// pieces from its own buffer into the ring whenever there is room, the
/// consumer copies them out into its own buffer; cursors are two atomics on
/// their own cache lines. A thread that finds nothing to do spins on two
/// CPUs and yields the CPU on one (where spinning would only hold the core
/// its peer needs). GB/s over about `total` bytes.
pub fn ring_copy_gbps(
    ring: usize,
    chunk: usize,
    total: u64,
    a: usize,
    b: usize,
) -> io::Result<f64> {
    use smc_rdma::sys::SharedMem;
    let wait = move || {
        if a == b {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
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
                    wait();
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
                    wait();
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

/// One direction of one ideal connection: a message-sized buffer in shared
/// memory, the number of messages published into it, and whether its reader
/// has gone to sleep waiting for the next one.
struct Mailbox {
    mem: smc_rdma::sys::SharedMem,
    seq_off: usize,
    sleeping: std::sync::atomic::AtomicBool,
    reader: std::sync::OnceLock<std::thread::Thread>,
}

impl Mailbox {
    fn new(size: usize) -> io::Result<Mailbox> {
        let mem = smc_rdma::sys::SharedMem::create("smc-bench-rr", size + 128)?;
        mem.fill(0, size + 128, 0)?;
        Ok(Mailbox {
            mem,
            seq_off: size,
            sleeping: std::sync::atomic::AtomicBool::new(false),
            reader: std::sync::OnceLock::new(),
        })
    }

    fn seq(&self) -> io::Result<&AtomicU64> {
        self.mem.atomic(self.seq_off)
    }

    /// Copies `msg` in, publishes it as message `n`, wakes the reader if it sleeps.
    fn put(&self, msg: &[u8], n: u64) -> io::Result<()> {
        self.mem.write(0, msg)?;
        self.seq()?.store(n, Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            if let Some(t) = self.reader.get() {
                t.unpark();
            }
        }
        Ok(())
    }

    /// Waits until message `n` is published (sleeping: with 20 threads on 2
    /// cores, spinning only takes the core the peer needs — measured 18-44k
    /// transactions/s spinning 50 us, 160-190k not), and copies it out.
    /// Returns false when `stop` was raised.
    fn take(
        &self,
        out: &mut [u8],
        n: u64,
        stop: &std::sync::atomic::AtomicBool,
    ) -> io::Result<bool> {
        let seq = self.seq()?;
        while seq.load(Ordering::Acquire) < n {
            if stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            self.reader.get_or_init(std::thread::current);
            self.sleeping.store(true, Ordering::SeqCst);
            if seq.load(Ordering::SeqCst) < n {
                std::thread::park_timeout(Duration::from_millis(10));
            }
            self.sleeping.store(false, Ordering::SeqCst);
        }
        self.mem.read(0, out)?;
        Ok(true)
    }
}

/// Request/response over the leanest shared-memory transport there can be,
/// in the bench's shape: `conns` client threads (pinned to `cpus.0`) and
/// `conns` server threads (pinned to `cpus.1`), each pair owning two
/// mailboxes in memfd mappings; a request of `size` bytes is copied into the
/// server's mailbox, the server copies it out, copies a response of `size`
/// bytes into the client's mailbox, and the client copies it out. A waiting
/// thread sleeps (park/unpark, i.e. one futex each way). No protocol, no
/// lock, no cursor exchange beyond one counter: the ceiling of any SMC-like
/// data path with one copy on each side and a thread per connection. With
/// `polling`, one client thread and one server thread walk all the pairs
/// without sleeping instead, yielding the CPU after a pass that found
/// nothing (as the polling workload does, `poll.rs`). Transactions per
/// second over `dur`.
pub fn rr_ideal_tps(
    conns: usize,
    size: usize,
    dur: Duration,
    polling: bool,
    cpus: (usize, usize),
) -> io::Result<f64> {
    let (client_cpu, server_cpu) = cpus;
    use std::sync::atomic::AtomicBool;
    let pairs: Vec<(Mailbox, Mailbox)> = (0..conns)
        .map(|_| Ok((Mailbox::new(size)?, Mailbox::new(size)?)))
        .collect::<io::Result<_>>()?;
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| -> io::Result<()> {
        let (stop, done) = (&stop, &done);
        let mut hs = Vec::new();
        if polling {
            let pairs = &pairs;
            hs.push(s.spawn(move || -> io::Result<()> {
                let pinned = sys::pin_to(server_cpu);
                let mut buf = vec![0u8; size];
                let mut seen = vec![0u64; pairs.len()];
                while !stop.load(Ordering::Relaxed) {
                    let mut idle = true;
                    for (i, (req, resp)) in pairs.iter().enumerate() {
                        let n = req.seq()?.load(Ordering::Acquire);
                        if n > seen[i] {
                            req.mem.read(0, &mut buf)?;
                            seen[i] = n;
                            resp.put(&buf, n)?;
                            idle = false;
                        }
                    }
                    if idle {
                        std::thread::yield_now();
                    }
                }
                pinned
            }));
            hs.push(s.spawn(move || -> io::Result<()> {
                let pinned = sys::pin_to(client_cpu);
                let msg = vec![0x5au8; size];
                let mut buf = vec![0u8; size];
                let mut sent = vec![0u64; pairs.len()];
                for (i, (req, _)) in pairs.iter().enumerate() {
                    sent[i] = 1;
                    req.put(&msg, 1)?;
                }
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut idle = true;
                    for (i, (req, resp)) in pairs.iter().enumerate() {
                        if resp.seq()?.load(Ordering::Acquire) >= sent[i] {
                            resp.mem.read(0, &mut buf)?;
                            n += 1;
                            sent[i] += 1;
                            req.put(&msg, sent[i])?;
                            idle = false;
                        }
                    }
                    if idle {
                        std::thread::yield_now();
                    }
                }
                done.fetch_add(n, Ordering::Relaxed);
                pinned
            }));
        } else {
            for (req, resp) in &pairs {
                hs.push(s.spawn(move || -> io::Result<()> {
                    let pinned = sys::pin_to(server_cpu);
                    let mut buf = vec![0u8; size];
                    let mut n = 1;
                    while req.take(&mut buf, n, stop)? {
                        resp.put(&buf, n)?;
                        n += 1;
                    }
                    pinned
                }));
                hs.push(s.spawn(move || -> io::Result<()> {
                    let pinned = sys::pin_to(client_cpu);
                    let msg = vec![0x5au8; size];
                    let mut buf = vec![0u8; size];
                    let mut n = 1;
                    loop {
                        req.put(&msg, n)?;
                        if !resp.take(&mut buf, n, stop)? {
                            break;
                        }
                        n += 1;
                    }
                    done.fetch_add(n - 1, Ordering::Relaxed);
                    pinned
                }));
            }
        }
        std::thread::sleep(dur);
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join()
                .unwrap_or_else(|_| Err(io::Error::other("rr thread panicked")))?;
        }
        Ok(())
    })?;
    Ok(done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64())
}
