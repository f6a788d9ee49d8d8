//! One SMC-R bulk stream alone, to profile it: a client writes MIB MiB in
//! 256 KiB writes (as `smc-bench`'s bulk row does) to a server process (this
//! program started again) that reads them in 256 KiB reads and answers the
//! count. Prints GB/s; the CPU, system calls and context switches per GiB
//! come from the tools that count them, e.g. both processes on one CPU:
//!
//! ```text
//! cargo build --release -p smc-bench --example bulk_cost
//! perf stat -e task-clock,context-switches -- taskset -c 0 target/release/examples/bulk_cost 4096
//! perf record -g -- taskset -c 0 target/release/examples/bulk_cost 4096
//! ```
//!
//! With `BULK_IN_PLACE=1` both sides use the zero-copy API instead, as
//! `smc-bench`'s "bulk in place" row does: the client copies each piece
//! into the space `write_in_place` lends, the server looks at the first and
//! last byte of what `read_in_place` lends and takes it.
//!
//! Run as root (SMC-R needs the rendezvous BPF program); the device is a
//! shared-memory one on `lo` (`smc::use_loopback_device`).
//! `smc-bench --only bulk` measures the same stream side by side with TCP.

mod common;

use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

const CHUNK: usize = 256 * 1024;

fn serve() -> ExitCode {
    let l = match SmcListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bulk_cost: bind: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", l.local_addr().map_or(0, |a| a.port()));
    let _ = std::io::stdout().flush();
    let Ok((mut s, _)) = l.accept() else {
        return ExitCode::FAILURE;
    };
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    let in_place = in_place();
    loop {
        let r = if in_place {
            s.read_in_place(CHUNK, |r| {
                let mut b = [0u8; 1];
                r.copy_to(0, &mut b)?;
                r.copy_to(r.len() - 1, &mut b)?;
                std::hint::black_box(b);
                Ok(r.len())
            })
        } else {
            s.read(&mut buf)
        };
        match r {
            Ok(0) => break,
            Ok(n) => got += n as u64,
            Err(e) => {
                eprintln!("bulk_cost: read: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let _ = s.write_all(&got.to_le_bytes());
    ExitCode::SUCCESS
}

fn stream(port: u16, total: u64) -> std::io::Result<(Mode, f64)> {
    let mut s = SmcStream::connect(("127.0.0.1", port))?;
    let buf = vec![0x5au8; CHUNK];
    let t = Instant::now();
    let mut left = total;
    let in_place = in_place();
    while left > 0 {
        let n = CHUNK.min(usize::try_from(left).unwrap_or(CHUNK));
        if in_place {
            let k = s.write_in_place(n, |w| {
                let k = w.len().min(n);
                w.copy_from(0, &buf[..k])?;
                Ok(k)
            })?;
            if k == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            left -= k as u64;
        } else {
            s.write_all(&buf[..n])?;
            left -= n as u64;
        }
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut count = [0u8; 8];
    s.read_exact(&mut count)?;
    let secs = t.elapsed().as_secs_f64();
    if u64::from_le_bytes(count) != total {
        return Err(std::io::Error::other("the server counted another length"));
    }
    Ok((s.mode(), secs))
}

/// Whether both sides use the zero-copy API (`BULK_IN_PLACE=1`).
fn in_place() -> bool {
    std::env::var("BULK_IN_PLACE").is_ok_and(|v| v == "1")
}

fn main() -> ExitCode {
    smc::use_loopback_device("smc-bench-bulk-cost");
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        return serve();
    }
    let mib: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let (mut child, port) = match common::start_server("bulk_cost") {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let r = stream(port, mib << 20);
    let _ = child.wait();
    match r {
        Ok((mode, secs)) => {
            println!(
                "{mib} MiB ({mode:?}) {:.2} GB/s ({secs:.2} s)",
                (mib << 20) as f64 / secs / 1e9
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bulk_cost: {e}");
            ExitCode::FAILURE
        }
    }
}
