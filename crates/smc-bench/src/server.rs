//! The server process (`smc-bench __serve`): one `SmcListener` and one
//! `TcpListener` on 127.0.0.1, a handler per connection doing what the
//! connection's [`Header`] asks, and a line-based control channel on
//! stdin/stdout for the client process:
//!
//! ```text
//! (server prints)  ports <smc-port> <tcp-port>
//! cpu            -> cpu <total_ns> <user_ticks> <sys_ticks>   this process's CPU time
//! quiesce <ms>   -> quiesce <n>     waits up to <ms> until no handler runs; n = still running
//! accepted       -> accepted <json> modes of the connections the SMC listener accepted
//! pin <cpu>      -> pin ok <n> | pin error <why>   pins all n threads of this process to <cpu>
//! quit / EOF     -> exits
//! ```

use crate::conn::{mode_label, Conn};
use crate::poll::{gone, Step};
use crate::sys::{self, CpuTime};
use crate::wire::{Header, Job, CLC_ACCEPT, CLC_CONFIRM, CLC_PROPOSAL};
use smc::SmcListener;
use std::collections::BTreeMap;
use std::io::{self, BufRead, Read, Write};
use std::net::TcpListener;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Read size of the bulk sink.
const SINK_CHUNK: usize = 256 * 1024;

#[derive(Default)]
struct State {
    /// Handler threads running now.
    active: AtomicUsize,
    /// Modes of the connections accepted on the SMC listener.
    accepted: Mutex<BTreeMap<String, u64>>,
    /// Polling groups still being connected: id -> connections so far (the
    /// group counts in `active` from its first connection on).
    groups: Mutex<BTreeMap<u32, (Vec<Conn>, Active)>>,
}

/// Counts in `active` from its creation until a handler ends, however it ends.
struct Active(Arc<State>);
impl Active {
    fn new(state: &Arc<State>) -> Active {
        state.active.fetch_add(1, Ordering::SeqCst);
        Active(state.clone())
    }
}
impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("smc-bench server: {e}");
    ExitCode::FAILURE
}

/// Runs the server until stdin closes.
pub fn serve() -> ExitCode {
    let smc = match SmcListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => return fail(format!("SMC listener: {e}")),
    };
    let tcp = match TcpListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => return fail(format!("TCP listener: {e}")),
    };
    let (Ok(sa), Ok(ta)) = (smc.local_addr(), tcp.local_addr()) else {
        return fail("no local address");
    };
    let state = Arc::new(State::default());
    {
        let state = state.clone();
        std::thread::spawn(move || loop {
            match smc.accept() {
                Ok((s, _)) => {
                    *state
                        .accepted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(mode_label(s.mode()))
                        .or_default() += 1;
                    let _ = s.set_nodelay(true);
                    dispatch(Conn::Smc(s), &state);
                }
                Err(e) => {
                    eprintln!("smc-bench server: SMC accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
    }
    {
        let state = state.clone();
        std::thread::spawn(move || loop {
            match tcp.accept() {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    dispatch(Conn::Tcp(s), &state);
                }
                Err(e) => {
                    eprintln!("smc-bench server: TCP accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
    }
    let mut out = io::stdout().lock();
    if writeln!(out, "ports {} {}", sa.port(), ta.port())
        .and_then(|_| out.flush())
        .is_err()
    {
        return fail("stdout closed");
    }
    for line in io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let reply = match words.next() {
            Some("cpu") => format!("cpu {}", CpuTime::now().to_line()),
            Some("quiesce") => {
                let ms = words.next().and_then(|w| w.parse().ok()).unwrap_or(5000);
                let deadline = Instant::now() + Duration::from_millis(ms);
                while state.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                format!("quiesce {}", state.active.load(Ordering::SeqCst))
            }
            Some("accepted") => {
                let m = state
                    .accepted
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                format!(
                    "accepted {}",
                    serde_json::to_string(&m).unwrap_or_else(|_| "{}".into())
                )
            }
            Some("pin") => match words.next().map(str::parse::<usize>) {
                Some(Ok(cpu)) => match sys::pin_process(cpu) {
                    Ok(n) => format!("pin ok {n}"),
                    Err(e) => format!("pin error {e}"),
                },
                _ => "pin error no CPU number".to_string(),
            },
            Some("quit") => break,
            _ => format!("error unknown command {line:?}"),
        };
        if writeln!(out, "{reply}").and_then(|_| out.flush()).is_err() {
            break;
        }
    }
    // Handler and accept threads are blocked in I/O: leave without joining them.
    std::process::exit(0)
}

/// Reads the job header on the accepting thread; a one-shot job is served
/// there too (no thread start in the connection-setup loop), the others get a
/// thread of their own.
fn dispatch(mut c: Conn, state: &Arc<State>) {
    // A client that connects and never sends its header must not stall accept.
    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
    let h = match Header::read_from(&mut c) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("smc-bench server: job header: {e}");
            return;
        }
    };
    if let Job::Once { req, resp } = h.0 {
        // still under the 5 s timeout: a vanished client cannot stall accept
        let _ = once(&mut c, req as usize, resp as usize);
        return;
    }
    if let Job::OnceAfterClc { req, resp } = h.0 {
        let _ = clc_like(&mut c).and_then(|_| once(&mut c, req as usize, resp as usize));
        return;
    }
    let _ = c.set_read_timeout(None);
    if let Job::PollEcho { size, group, count } = h.0 {
        join_group(c, size as usize, group, count as usize, state);
        return;
    }
    let guard = Active::new(state);
    let spawned = std::thread::Builder::new()
        .name("smc-bench-conn".into())
        .spawn(move || {
            let _guard = guard;
            if let Err(e) = run(c, h.0) {
                if !matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                        | io::ErrorKind::NotConnected
                ) {
                    eprintln!("smc-bench server: {:?}: {e}", h.0);
                }
            }
        });
    if let Err(e) = spawned {
        eprintln!("smc-bench server: cannot start a handler thread: {e}");
    }
}

/// Adds a connection to its polling group; the last one to arrive starts the
/// group's one polling thread.
fn join_group(c: Conn, size: usize, group: u32, count: usize, state: &Arc<State>) {
    let mut groups = state.groups.lock().unwrap_or_else(|e| e.into_inner());
    let entry = groups
        .entry(group)
        .or_insert_with(|| (Vec::new(), Active::new(state)));
    entry.0.push(c);
    if entry.0.len() < count {
        return;
    }
    let Some((conns, guard)) = groups.remove(&group) else {
        return;
    };
    drop(groups);
    let spawned = std::thread::Builder::new()
        .name("smc-bench-poll".into())
        .spawn(move || {
            let _guard = guard;
            if let Err(e) = poll_echo(conns, size) {
                eprintln!("smc-bench server: polling group {group}: {e}");
            }
        });
    if let Err(e) = spawned {
        eprintln!("smc-bench server: cannot start a polling thread: {e}");
    }
}

/// Serves a polling group: each connection reads a `size`-byte request and
/// writes a `size`-byte response, over and over, all from this one thread,
/// until every client has closed its end. A group that moves nothing for
/// this long is abandoned (its client has gone without closing).
fn poll_echo(mut conns: Vec<Conn>, size: usize) -> io::Result<()> {
    const STALL: Duration = Duration::from_secs(60);
    for c in &conns {
        c.set_nonblocking(true)?;
    }
    let mut steps: Vec<Option<Step>> = conns.iter().map(|_| Some(Step::new(size, false))).collect();
    let mut last = Instant::now();
    while steps.iter().any(Option::is_some) {
        let mut moved = false;
        for (c, slot) in conns.iter_mut().zip(&mut steps) {
            let Some(step) = slot else { continue };
            match step.advance(c) {
                Ok(m) => moved |= m.bytes,
                Err(e) if gone(&e) => *slot = None,
                Err(e) => return Err(e),
            }
        }
        if moved {
            last = Instant::now();
        } else if last.elapsed() > STALL {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "nothing moved for 60 s",
            ));
        } else {
            std::thread::yield_now();
        }
    }
    Ok(())
}

fn once(c: &mut Conn, req: usize, resp: usize) -> io::Result<()> {
    let mut buf = vec![0u8; req.max(resp)];
    c.read_exact(&mut buf[..req])?;
    c.write_all(&buf[..resp])
}

/// The server's side of three CLC-sized messages (`Job::OnceAfterClc`):
/// the Proposal in, the Accept out, the Confirm in.
fn clc_like(c: &mut Conn) -> io::Result<()> {
    let mut buf = [0u8; CLC_PROPOSAL];
    c.read_exact(&mut buf[..CLC_PROPOSAL])?;
    c.write_all(&[0xa2; CLC_ACCEPT])?;
    c.read_exact(&mut buf[..CLC_CONFIRM])
}

/// Reads until end-of-file (or an error: the peer went away).
fn drain(c: &mut Conn) -> io::Result<()> {
    let mut b = [0u8; 4096];
    while c.read(&mut b)? > 0 {}
    Ok(())
}

fn run(mut c: Conn, job: Job) -> io::Result<()> {
    match job {
        Job::Echo { req, resp } => {
            let mut rbuf = vec![0u8; req as usize];
            let wbuf = vec![0x5au8; resp as usize];
            loop {
                match c.read_exact(&mut rbuf) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(e),
                }
                c.write_all(&wbuf)?;
            }
        }
        Job::Sink { total } => {
            let mut buf = vec![0u8; SINK_CHUNK];
            let mut got = 0u64;
            while got < total {
                let want = buf
                    .len()
                    .min((total - got).try_into().unwrap_or(usize::MAX));
                let n = c.read(&mut buf[..want])?;
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            c.write_all(&got.to_le_bytes())?;
            drain(&mut c)
        }
        Job::SinkInPlace { total } => {
            let mut scratch = vec![0u8; SINK_CHUNK];
            let mut got = 0u64;
            while got < total {
                let want = SINK_CHUNK.min((total - got).try_into().unwrap_or(usize::MAX));
                let n = c.take_in_place(want, &mut scratch)?;
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            c.write_all(&got.to_le_bytes())?;
            drain(&mut c)
        }
        Job::Idle => {
            c.write_all(&[1])?;
            drain(&mut c)
        }
        Job::Once { req, resp } => once(&mut c, req as usize, resp as usize),
        Job::OnceAfterClc { req, resp } => {
            clc_like(&mut c)?;
            once(&mut c, req as usize, resp as usize)
        }
        Job::PollEcho { size, .. } => poll_echo(vec![c], size as usize),
    }
}
