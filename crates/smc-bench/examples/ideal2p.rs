//! `smc-bench`'s ideal request/response with a thread per connection
//! (`reference::rr_ideal_tps`: 10 connections, 16 KiB each way, the two
//! copies and one futex wake-up per message, nothing else) with its client
//! and server threads in two processes, as SMC-R's and TCP's are: the
//! mailboxes in one shared mapping, a process-shared futex per direction in
//! place of park/unpark. What the process boundary alone costs that
//! workload (an address-space switch per context switch, futexes keyed by
//! page) is the difference between the two.
//!
//! ```text
//! cargo run --release -p smc-bench --example ideal2p [-- SECONDS [CLIENT_CPU [SERVER_CPU]]]
//! ```
//!
//! SECONDS defaults to 3, both CPUs to 0 (one core; give two different
//! ones for the cross-core placement). The server half is this program
//! again, started as `ideal2p __server PATH CPU`.

use smc_rdma::sys::SharedMem;
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CONNS: usize = 10;
const SIZE: usize = 16 * 1024;
/// A mailbox: the message, its sequence number, the reader's sleep word
/// (each on a cache line of its own).
const SLOT: usize = SIZE + 128;
/// The word after the mailboxes: the client sets it when it is done.
const END: usize = CONNS * 2 * SLOT;

fn pin(cpu: usize) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

/// One direction of one connection.
struct Mailbox<'a> {
    mem: &'a SharedMem,
    base: usize,
}

impl Mailbox<'_> {
    fn of(mem: &SharedMem, conn: usize, dir: usize) -> Mailbox<'_> {
        Mailbox {
            mem,
            base: (conn * 2 + dir) * SLOT,
        }
    }
    fn seq(&self) -> std::io::Result<&AtomicU64> {
        self.mem.atomic(self.base + SIZE)
    }
    fn sleep_off(&self) -> usize {
        self.base + SIZE + 64
    }
    fn sleeping(&self) -> std::io::Result<&AtomicU64> {
        self.mem.atomic(self.sleep_off())
    }
    /// Copies `msg` in, publishes it as message `n`, wakes the reader if
    /// it sleeps.
    fn put(&self, msg: &[u8], n: u64) -> std::io::Result<()> {
        self.mem.write(self.base, msg)?;
        self.seq()?.store(n, Ordering::SeqCst);
        if self.sleeping()?.swap(0, Ordering::SeqCst) != 0 {
            self.mem.futex_wake(self.sleep_off())?;
        }
        Ok(())
    }
    /// Sleeps until message `n` is there (no spinning, as the reference),
    /// copies it out; false once `stop` is raised.
    fn take(&self, out: &mut [u8], n: u64, stop: &AtomicBool) -> std::io::Result<bool> {
        let seq = self.seq()?;
        while seq.load(Ordering::Acquire) < n {
            if stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            self.sleeping()?.store(1, Ordering::SeqCst);
            if seq.load(Ordering::SeqCst) < n {
                let t = Some(Duration::from_millis(10));
                self.mem.futex_wait(self.sleep_off(), 1, t)?;
            }
            self.sleeping()?.store(0, Ordering::SeqCst);
        }
        self.mem.read(self.base, out)?;
        Ok(true)
    }
}

fn server(path: &str, cpu: usize) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mem = SharedMem::map(f.into())?;
    pin(cpu)?;
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..CONNS)
            .map(|i| {
                let (mem, stop) = (&mem, &stop);
                s.spawn(move || -> std::io::Result<()> {
                    let (req, resp) = (Mailbox::of(mem, i, 0), Mailbox::of(mem, i, 1));
                    let mut buf = vec![0u8; SIZE];
                    let mut n = 1;
                    while req.take(&mut buf, n, stop)? {
                        resp.put(&buf, n)?;
                        n += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        let end = mem.atomic(END)?;
        while end.load(Ordering::Acquire) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("server thread panicked")))?;
        }
        Ok(())
    })
}

fn client(secs: u64, ccpu: usize, scpu: usize) -> std::io::Result<f64> {
    let mem = SharedMem::create("ideal2p", END + 64)?;
    mem.fill(0, mem.len(), 0)?;
    let fd = mem
        .fd()
        .ok_or_else(|| std::io::Error::other("the mapping has no descriptor"))?;
    // (the server opens the same memory through this process's descriptor)
    let path = format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd());
    let me = std::env::current_exe()?;
    let mut child = std::process::Command::new(me)
        .args(["__server", &path, &scpu.to_string()])
        .spawn()?;
    pin(ccpu)?;
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let t0 = Instant::now();
    let ran = std::thread::scope(|s| -> std::io::Result<()> {
        let threads: Vec<_> = (0..CONNS)
            .map(|i| {
                let (mem, stop, done) = (&mem, &stop, &done);
                s.spawn(move || -> std::io::Result<()> {
                    let (req, resp) = (Mailbox::of(mem, i, 0), Mailbox::of(mem, i, 1));
                    let msg = vec![0x5au8; SIZE];
                    let mut buf = vec![0u8; SIZE];
                    let mut n = 1;
                    loop {
                        req.put(&msg, n)?;
                        if !resp.take(&mut buf, n, stop)? {
                            break;
                        }
                        n += 1;
                    }
                    done.fetch_add(n - 1, Ordering::Relaxed);
                    Ok(())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("client thread panicked")))?;
        }
        Ok(())
    });
    let tps = done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64();
    // (the server's threads see the end within their 10 ms sleep)
    mem.atomic(END)?.store(1, Ordering::Release);
    let st = child.wait()?;
    ran?;
    if !st.success() {
        return Err(std::io::Error::other(format!("the server failed: {st}")));
    }
    Ok(tps)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("__server") {
        let (Some(path), Some(Ok(cpu))) = (args.get(1), args.get(2).map(|c| c.parse())) else {
            eprintln!("ideal2p __server: PATH CPU expected");
            return ExitCode::from(2);
        };
        return match server(path, cpu) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ideal2p server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let num = |i: usize, default: u64| -> Result<u64, String> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse().map_err(|_| format!("ideal2p: not a number: {s}"))
        })
    };
    let parsed = (|| Ok::<_, String>((num(0, 3)?, num(1, 0)?, num(2, 0)?)))();
    let (secs, ccpu, scpu) = match parsed {
        Ok((s, c, v)) if s > 0 && args.len() <= 3 => (s, c as usize, v as usize),
        Ok(_) => {
            eprintln!("usage: ideal2p [SECONDS [CLIENT_CPU [SERVER_CPU]]] (SECONDS > 0)");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match client(secs, ccpu, scpu) {
        Ok(tps) => {
            println!(
                "ideal rr, {CONNS} x {} KiB, a thread per connection, two processes, \
                 client on CPU {ccpu}, server on CPU {scpu}: {tps:.0} transactions/s",
                SIZE / 1024
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ideal2p: {e}");
            ExitCode::FAILURE
        }
    }
}
