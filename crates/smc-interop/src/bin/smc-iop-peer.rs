//! `smc-iop-peer` — the smc-rs side of the Linux-kernel interop harness
//! (`scripts/vm/run-kernel-interop.sh`), on [`smc::SmcStream`] /
//! [`smc::SmcListener`]. Speaks the protocol of [`smc_interop::stream`] with
//! the kernel's `AF_SMC` peer (`scripts/vm/interop/kpeer.c`), which has the
//! same command line:
//!
//! ```text
//! smc-iop-peer server --port P --conns N [--case C] [--timeout S] [--linger S]
//! smc-iop-peer client --connect IP:PORT --rounds COUNT[xBYTES][,...] [--bytes N]
//!                     [--close client|server|alt] [--urgent] [--case C] [--timeout S] [--retry S] [--linger S]
//! smc-iop-peer gen SEED BYTES
//! ```
//!
//! A client runs its rounds one after another, the connections of a round at
//! once. Every result is one line on stdout, `SMCI-<WHAT> key=value ...`:
//! `SMCI-CONN ... ev=up` when a connection is established (with its mode and
//! fallback reasons), `ev=end` when it is over (bytes, SHA-256 of what was
//! received, the error kind if any, how long it had made no progress), and
//! `SMCI-RSSTATE` with `smc::state()` after each round and at the end (once
//! the connections are gone, or 15 s). A watchdog ends the process after
//! `--timeout` seconds and reports every unfinished connection as a hang.
//! Exit status: 0 if every connection succeeded, 1 if one failed, 2 for bad
//! arguments, 3 on the watchdog.
#![forbid(unsafe_code)]

use clap::{Args, Parser, Subcommand, ValueEnum};
use smc::{Mode, SmcListener, SmcStream};
use smc_interop::stream::{self, Header, HEADER_LEN};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "smc-rs peer of the Linux-kernel interop harness")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Accept --conns connections and serve each in its own thread.
    Server {
        /// TCP port to listen on (all IPv4 addresses).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
        port: u16,
        /// Connections to serve before exiting.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10000))]
        conns: u32,
        #[command(flatten)]
        common: Common,
    },
    /// Connect, round after round.
    Client {
        /// The server, IPv4:PORT.
        #[arg(long)]
        connect: SocketAddr,
        /// Rounds, comma-separated, each COUNT or COUNTxBYTES (a round's connections run at once).
        #[arg(long, default_value = "1", value_parser = parse_rounds)]
        rounds: Rounds,
        /// Bytes each way per connection (K, M, G suffixes), unless a round says.
        #[arg(long, default_value = "1M", value_parser = stream::parse_size)]
        bytes: u64,
        /// Which end closes first.
        #[arg(long, value_enum, default_value_t = Closer::Client)]
        close: Closer,
        /// Before the streams, exchange one urgent (MSG_OOB) byte each way.
        #[arg(long)]
        urgent: bool,
        /// Seconds to retry a refused connect (the server may not listen yet).
        #[arg(long, default_value_t = 60)]
        retry: u64,
        #[command(flatten)]
        common: Common,
    },
    /// Write stream SEED's first BYTES bytes to stdout.
    Gen {
        /// Stream seed (2*id client to server, 2*id+1 back).
        seed: u64,
        /// Bytes (K, M, G suffixes).
        #[arg(value_parser = stream::parse_size)]
        bytes: u64,
    },
}

#[derive(Args)]
struct Common {
    /// Case name for the output lines.
    #[arg(long = "case", default_value = "-")]
    case: String,
    /// Seconds until the watchdog ends the process.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    timeout: u64,
    /// Seconds to stay alive after the last connection (link groups live on).
    #[arg(long, default_value_t = 0)]
    linger: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Closer {
    /// The client closes first.
    Client,
    /// The server closes first.
    Server,
    /// Odd connection ids: the client; even: the server.
    Alt,
}

#[derive(Clone, Debug)]
struct Rounds(Vec<(u32, Option<u64>)>);

fn parse_rounds(s: &str) -> Result<Rounds, String> {
    let mut v = Vec::new();
    for r in s.split(',') {
        let (count, bytes) = match r.split_once('x') {
            Some((c, b)) => (c, Some(stream::parse_size(b)?)),
            None => (r, None),
        };
        let count: u32 = count
            .parse()
            .ok()
            .filter(|c| (1..=1000).contains(c))
            .ok_or_else(|| format!("bad round '{r}': COUNT (1..1000), optionally xBYTES"))?;
        v.push((count, bytes));
    }
    Ok(Rounds(v))
}

fn t0() -> Instant {
    static T: OnceLock<Instant> = OnceLock::new();
    *T.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    t0().elapsed().as_nanos() as u64
}

static CASE: OnceLock<String> = OnceLock::new();

fn case() -> &'static str {
    CASE.get().map_or("-", String::as_str)
}

/// One line per call (threads share stdout; the host reads it line by line).
macro_rules! out {
    ($($a:tt)*) => {{
        let line = format!($($a)*);
        let mut o = io::stdout().lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    }};
}

/// What the watchdog and the reports need of a connection.
struct Conn {
    id: AtomicU64,
    server: bool,
    sent: AtomicU64,
    recvd: AtomicU64,
    want_in: AtomicU64,
    last_ns: AtomicU64,
    done: AtomicBool,
}

impl Conn {
    fn new(id: u32, server: bool) -> Arc<Conn> {
        Arc::new(Conn {
            id: AtomicU64::new(u64::from(id)),
            server,
            sent: AtomicU64::new(0),
            recvd: AtomicU64::new(0),
            want_in: AtomicU64::new(0),
            last_ns: AtomicU64::new(now_ns()),
            done: AtomicBool::new(false),
        })
    }

    fn side(&self) -> &'static str {
        if self.server {
            "server"
        } else {
            "client"
        }
    }

    fn progress(&self) {
        self.last_ns.store(now_ns(), Ordering::Relaxed);
    }

    fn stall_s(&self) -> f64 {
        now_ns().saturating_sub(self.last_ns.load(Ordering::Relaxed)) as f64 / 1e9
    }
}

static CONNS: Mutex<Vec<Arc<Conn>>> = Mutex::new(Vec::new());

fn register(c: &Arc<Conn>) {
    CONNS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(c.clone());
}

fn start_watchdog(timeout: u64) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(timeout));
        for c in CONNS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if !c.done.load(Ordering::Relaxed) {
                out!(
                    "SMCI-CONN case={} impl=rs side={} id={} ev=end result=hang sent={} recv={} want_recv={} stall_s={:.3}",
                    case(),
                    c.side(),
                    c.id.load(Ordering::Relaxed),
                    c.sent.load(Ordering::Relaxed),
                    c.recvd.load(Ordering::Relaxed),
                    c.want_in.load(Ordering::Relaxed),
                    c.stall_s()
                );
            }
        }
        out!(
            "SMCI-PEER case={} impl=rs ev=timeout after_s={:.1}",
            case(),
            t0().elapsed().as_secs_f64()
        );
        std::process::exit(3);
    });
}

/// `mode=SMCR fb=0x00000000 peer_fb=0x00000000`, as kpeer prints the kernel's view.
fn mode_fields(m: Mode) -> String {
    match m {
        Mode::SmcR => "mode=SMCR fb=0x00000000 peer_fb=0x00000000".into(),
        Mode::Tcp(f) => format!(
            "mode=TCP fb={:#010x} peer_fb={:#010x}",
            f.code(),
            f.peer.map_or(0, |p| p.to_u32())
        ),
    }
}

fn state_line(when: &str) -> (usize, usize) {
    let st = smc::state();
    let devs: Vec<String> = st
        .iter()
        .map(|d| format!("{}:{}:{}", d.device, d.link_groups, d.connections))
        .collect();
    let lgrs = st.iter().map(|d| d.link_groups).sum();
    let conns = st.iter().map(|d| d.connections).sum();
    // usable links of all groups, and of those the ones on an endpoint's
    // second device (SMC_REDUNDANCY)
    let links: usize = st.iter().flat_map(|d| d.links.iter()).sum();
    let second: usize = st.iter().flat_map(|d| d.second_device_links.iter()).sum();
    out!(
        "SMCI-RSSTATE case={} when={when} lgrs={lgrs} conns={conns} devices={} links={links} second={second}",
        case(),
        if devs.is_empty() {
            "-".to_string()
        } else {
            devs.join(",")
        }
    );
    (lgrs, conns)
}

/// The received bytes go to `sha256sum` (coreutils; the guest's hash tool).
struct Hasher(Child);

impl Hasher {
    fn start() -> io::Result<Hasher> {
        Command::new("sha256sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map(Hasher)
    }

    fn feed(&mut self, b: &[u8]) -> io::Result<()> {
        match self.0.stdin.as_mut() {
            Some(i) => i.write_all(b),
            None => Err(io::Error::other("sha256sum's stdin is closed")),
        }
    }

    fn finish(mut self) -> String {
        drop(self.0.stdin.take());
        match self.0.wait_with_output() {
            Ok(o) if o.stdout.len() >= 64 => String::from_utf8_lossy(&o.stdout[..64]).into_owned(),
            _ => "-".into(),
        }
    }
}

fn kind(e: &io::Error) -> String {
    format!("{:?}", e.kind())
}

/// One connection after connect/accept: header, both streams, close.
/// Returns whether everything arrived intact and closed as asked.
/// The urgent bytes of [`Header::urgent`]: the client sends its in-band
/// prefix and its byte out of band, the server waits for the byte, reads the
/// prefix and answers the same way. One `SMCI-URG` line: what was sent, what
/// arrived out of band (`-` if nothing within 30 s), whether the prefix arrived
/// intact in band (`prefix=ok|bad|-`), `ok=yes` if both. The streams run
/// afterwards either way; their checksums show whether an urgent byte slipped
/// into them.
fn urgent_exchange(s: &mut SmcStream, c: &Conn) {
    let (mine, theirs) = if c.server {
        (stream::URGENT_FROM_SERVER, stream::URGENT_FROM_CLIENT)
    } else {
        (stream::URGENT_FROM_CLIENT, stream::URGENT_FROM_SERVER)
    };
    let t = Instant::now();
    let send = |s: &mut SmcStream| -> io::Result<()> {
        s.write_all(&stream::urgent_prefix(mine))?;
        s.send_oob(mine)
    };
    // the peer's byte out of band, then its prefix in band
    let receive = |s: &mut SmcStream| -> io::Result<(Option<u8>, bool)> {
        let mut got = None;
        // recv_oob does not block: poll it until the peer's byte is there
        while t.elapsed() < Duration::from_secs(30) {
            got = s.recv_oob()?;
            if got.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if got.is_none() {
            return Ok((None, false));
        }
        let mut p = [0u8; stream::URGENT_PREFIX_LEN];
        s.read_exact(&mut p)?;
        Ok((got, p == stream::urgent_prefix(theirs)))
    };
    let r = if c.server {
        receive(s).and_then(|g| send(s).map(|()| g))
    } else {
        send(s).and_then(|()| receive(s))
    };
    c.progress();
    let (got, prefix, err) = match r {
        Ok((g, p)) => (
            g,
            if g.is_some() {
                if p {
                    "ok"
                } else {
                    "bad"
                }
            } else {
                "-"
            },
            "-".to_string(),
        ),
        Err(e) => (None, "-", kind(&e)),
    };
    out!(
        "SMCI-URG case={} impl=rs side={} id={} sent={mine:#04x} got={} want={theirs:#04x} prefix={prefix} ok={} err={err} wait_s={:.3}",
        case(),
        c.side(),
        c.id.load(Ordering::Relaxed),
        got.map_or("-".into(), |b| format!("{b:#04x}")),
        if got == Some(theirs) && prefix == "ok" { "yes" } else { "no" },
        t.elapsed().as_secs_f64()
    );
}

fn run_conn(s: SmcStream, c: &Arc<Conn>, mut hdr: Option<Header>, connect_s: f64) -> bool {
    let side = c.side();
    let mode = mode_fields(s.mode());
    let mut s = s;
    let got_hdr = match hdr {
        Some(h) => s.write_all(&h.encode()).map(|()| h),
        None => {
            let mut b = [0u8; HEADER_LEN];
            s.read_exact(&mut b).and_then(|()| {
                Header::decode(&b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
            })
        }
    };
    c.progress();
    let id = got_hdr
        .as_ref()
        .map_or(c.id.load(Ordering::Relaxed), |h| u64::from(h.id));
    c.id.store(id, Ordering::Relaxed);
    out!(
        "SMCI-CONN case={} impl=rs side={side} id={id} ev=up {mode} gid=- peer_gid=- connect_s={connect_s:.3}",
        case()
    );
    let h = match got_hdr {
        Ok(h) => h,
        Err(e) => {
            out!(
                "SMCI-CONN case={} impl=rs side={side} id={id} ev=end result=error err={} at=header {mode}",
                case(),
                kind(&e)
            );
            c.done.store(true, Ordering::Relaxed);
            return false;
        }
    };
    hdr = Some(h);
    if h.urgent {
        urgent_exchange(&mut s, c);
    }
    let (want_out, want_in) = if c.server {
        (h.to_client, h.to_server)
    } else {
        (h.to_server, h.to_client)
    };
    c.want_in.store(want_in, Ordering::Relaxed);
    let mut hasher = match Hasher::start() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("smc-iop-peer: cannot run sha256sum: {e}");
            std::process::exit(2);
        }
    };
    let start = Instant::now();
    let writer = {
        let mut w = match s.try_clone() {
            Ok(w) => w,
            Err(e) => {
                eprintln!("smc-iop-peer: try_clone: {e}");
                std::process::exit(2);
            }
        };
        let c = c.clone();
        let seed = stream::seed(h.id, c.server);
        std::thread::spawn(move || -> io::Result<()> {
            let mut buf = vec![0u8; 64 * 1024];
            let mut off = 0u64;
            while off < want_out {
                let n = ((want_out - off) as usize).min(buf.len());
                stream::fill(&mut buf[..n], seed, off);
                w.write_all(&buf[..n])?;
                off += n as u64;
                c.sent.store(off, Ordering::Relaxed);
                c.progress();
            }
            Ok(())
        })
    };
    let mut buf = vec![0u8; 256 * 1024];
    let mut recvd = 0u64;
    let mut err: Option<(String, &str)> = None;
    while recvd < want_in {
        let n = ((want_in - recvd) as usize).min(buf.len());
        match s.read(&mut buf[..n]) {
            Ok(0) => {
                // the peer's stream ended early (kpeer reports it the same way)
                err = Some(("EOF".into(), "recv"));
                break;
            }
            Ok(n) => {
                if hasher.feed(&buf[..n]).is_err() {
                    err = Some(("HasherGone".into(), "recv"));
                    break;
                }
                recvd += n as u64;
                c.recvd.store(recvd, Ordering::Relaxed);
                c.progress();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                err = Some((kind(&e), "recv"));
                break;
            }
        }
    }
    let mut stall = c.stall_s();
    if err.is_some() {
        // nothing more to send: unblock the writer
        let _ = s.shutdown(Shutdown::Both);
    }
    let werr = match writer.join() {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(kind(&e)),
        Err(_) => Some("WriterPanicked".into()),
    };
    let xfer = start.elapsed().as_secs_f64();
    if err.is_none() {
        if let Some(k) = werr {
            stall = c.stall_s();
            err = Some((k, "send"));
        }
    }
    let sha = hasher.finish();
    let (mut close, mut eof) = ("-", "-".to_string());
    if err.is_none() {
        let active = hdr.is_some_and(|h| h.server_closes == c.server);
        if active {
            close = "active";
        } else {
            // the peer closes first: its close must reach us as EOF
            close = "passive";
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            eof = match s.read(&mut buf) {
                Ok(0) => "yes".into(),
                Ok(_) => "extra-data".into(),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    "timeout".into()
                }
                Err(e) => format!("error-{}", kind(&e)),
            };
        }
    }
    drop(s);
    c.done.store(true, Ordering::Relaxed);
    let sent = c.sent.load(Ordering::Relaxed);
    let ok = err.is_none() && (close == "active" || eof == "yes");
    let (ekind, at) = err.unwrap_or(("-".into(), "-"));
    out!(
        "SMCI-CONN case={} impl=rs side={side} id={id} ev=end result={} err={ekind} at={at} {mode} \
         sent={sent} recv={recvd} want_recv={want_in} sha256={sha} close={close} eof={eof} stall_s={:.3} xfer_s={xfer:.3} mibps={:.1}",
        case(),
        if ekind == "-" { "ok" } else { "error" },
        if ekind == "-" { 0.0 } else { stall },
        if xfer > 0.0 {
            (sent + recvd) as f64 / 2.0 / 1048576.0 / xfer
        } else {
            0.0
        }
    );
    ok
}

/// After the last connection: wait (15 s at most) for our connections to be
/// gone, report, then stay alive `linger` seconds if asked.
fn finish(linger: u64, all_ok: bool) -> ExitCode {
    let give_up = Instant::now() + Duration::from_secs(15);
    let t = Instant::now();
    loop {
        let conns: usize = smc::state().iter().map(|d| d.connections).sum();
        if conns == 0 || Instant::now() >= give_up {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    state_line(&format!("end waited_s={:.1}", t.elapsed().as_secs_f64()));
    let until = Instant::now() + Duration::from_secs(linger);
    let mut next = 10;
    while Instant::now() < until {
        std::thread::sleep(Duration::from_secs(1).min(until - Instant::now()));
        if t.elapsed().as_secs() >= next {
            state_line(&format!("linger-{next}s"));
            next += 10;
        }
    }
    out!(
        "SMCI-PEER case={} impl=rs ev=exit after_s={:.1}",
        case(),
        t0().elapsed().as_secs_f64()
    );
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn server(port: u16, conns: u32, common: &Common) -> ExitCode {
    let l = match SmcListener::bind(("0.0.0.0", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smc-iop-peer: cannot listen on port {port}: {e}");
            return ExitCode::from(2);
        }
    };
    start_watchdog(common.timeout);
    state_line("start");
    out!(
        "SMCI-PEER case={} impl=rs ev=listening port={port} conns={conns}",
        case()
    );
    let mut threads = Vec::new();
    for i in 0..conns {
        let t = Instant::now();
        let c = Conn::new(i + 1, true);
        register(&c);
        match l.accept() {
            Ok((s, _)) => {
                let connect_s = t.elapsed().as_secs_f64();
                threads.push(std::thread::spawn(move || run_conn(s, &c, None, connect_s)));
            }
            Err(e) => {
                out!(
                    "SMCI-CONN case={} impl=rs side=server id=0 ev=end result=error err={} at=accept",
                    case(),
                    kind(&e)
                );
                c.done.store(true, Ordering::Relaxed);
            }
        }
    }
    drop(l);
    let mut all_ok = true;
    for t in threads {
        all_ok &= t.join().unwrap_or(false);
    }
    finish(common.linger, all_ok)
}

fn connect(addr: SocketAddr, retry: u64) -> io::Result<(SmcStream, f64)> {
    let give_up = Instant::now() + Duration::from_secs(retry);
    loop {
        let t = Instant::now();
        match SmcStream::connect(addr) {
            Ok(s) => return Ok((s, t.elapsed().as_secs_f64())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused && Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

fn client(
    addr: SocketAddr,
    rounds: &Rounds,
    bytes: u64,
    close: Closer,
    urgent: bool,
    retry: u64,
    common: &Common,
) -> ExitCode {
    start_watchdog(common.timeout);
    state_line("start");
    let mut id = 0u32;
    let mut all_ok = true;
    for (r, &(count, size)) in rounds.0.iter().enumerate() {
        let size = size.unwrap_or(bytes);
        // Connect them all, then run them all at once (as kpeer does: handshakes
        // must not compete with the round's data, see kpeer.c).
        let mut connected = Vec::new();
        for _ in 0..count {
            id += 1;
            let c = Conn::new(id, false);
            register(&c);
            let hdr = Header {
                to_server: size,
                to_client: size,
                id,
                server_closes: match close {
                    Closer::Client => false,
                    Closer::Server => true,
                    Closer::Alt => id.is_multiple_of(2),
                },
                urgent,
            };
            match connect(addr, retry) {
                Ok((s, connect_s)) => connected.push((s, c, hdr, connect_s)),
                Err(e) => {
                    out!(
                        "SMCI-CONN case={} impl=rs side=client id={id} ev=end result=error err={} at=connect",
                        case(),
                        kind(&e)
                    );
                    c.done.store(true, Ordering::Relaxed);
                    all_ok = false;
                }
            }
        }
        let started: Vec<_> = connected
            .into_iter()
            .map(|(s, c, hdr, connect_s)| {
                std::thread::spawn(move || run_conn(s, &c, Some(hdr), connect_s))
            })
            .collect();
        for t in started {
            all_ok &= t.join().unwrap_or(false);
        }
        state_line(&format!("round-{}", r + 1));
    }
    finish(common.linger, all_ok)
}

fn gen(seed: u64, bytes: u64) -> ExitCode {
    let mut out = io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0;
    while off < bytes {
        let n = ((bytes - off) as usize).min(buf.len());
        stream::fill(&mut buf[..n], seed, off);
        if out.write_all(&buf[..n]).is_err() {
            return ExitCode::from(1);
        }
        off += n as u64;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    t0();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Server {
            port,
            conns,
            common,
        } => {
            let _ = CASE.set(common.case.clone());
            server(port, conns, &common)
        }
        Cmd::Client {
            connect,
            rounds,
            bytes,
            close,
            urgent,
            retry,
            common,
        } => {
            let _ = CASE.set(common.case.clone());
            if !connect.is_ipv4() {
                eprintln!("smc-iop-peer: --connect {connect}: IPv4 only (Linux 6.12 has no SMC-R v2 over IPv6)");
                return ExitCode::from(2);
            }
            client(connect, &rounds, bytes, close, urgent, retry, &common)
        }
        Cmd::Gen { seed, bytes } => gen(seed, bytes),
    }
}
