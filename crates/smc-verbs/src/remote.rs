//! Running `smc_rdma::conformance` with the passive side on another machine
//! (the second VM): the same line protocol as `smc-rdma-peer`, over TCP.
//!
//! * [`serve_passive`] — the passive machine's supervisor: accepts one TCP
//!   connection at a time and runs each session in a fresh child process
//!   (`verbs-conformance session|pong ...`) whose stdin/stdout is the socket,
//!   so `kill` can end it abruptly; after each session it brings the data
//!   link back up and waits for the RDMA port to be ACTIVE.
//! * [`TcpPeer`] — [`PeerCtl`] for such a session; [`VmHarness`] — the
//!   active side's [`Harness`].
#![forbid(unsafe_code)]

use crate::provider::VerbsProvider;
use smc_rdma::conformance::*;
use smc_rdma::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Reply timeout for one control command.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(60);

/// `ip link set DEV up|down`.
pub fn set_link(netdev: &str, up: bool) -> Result<()> {
    let out = Command::new("ip")
        .args(["link", "set", netdev, if up { "up" } else { "down" }])
        .output()?;
    if !out.status.success() {
        return Err(Error::Config(format!(
            "ip link set {netdev}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Waits until port 1 of `dev` reads ACTIVE in sysfs.
pub fn wait_port_active(dev: &str, timeout: Duration) -> Result<()> {
    let path = format!("{}/{dev}/ports/1/state", crate::provider::SYSFS_INFINIBAND);
    let t = Instant::now();
    loop {
        let s = std::fs::read_to_string(&path).unwrap_or_default();
        if s.contains("ACTIVE") {
            return Ok(());
        }
        if t.elapsed() > timeout {
            return Err(Error::Config(format!(
                "{dev} port 1 not ACTIVE ({})",
                s.trim()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until `netdev` is up with a usable (non-tentative) IPv6 link-local
/// address: rxe's GID 0 is the link-local RoCE v2 GID, and connecting a QP
/// to it resolves the peer's MAC through IPv6 neighbour discovery.
pub fn wait_link_ready(netdev: &str, timeout: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        let oper = std::fs::read_to_string(format!("/sys/class/net/{netdev}/operstate"))
            .unwrap_or_default();
        let out = Command::new("ip")
            .args(["-6", "-o", "addr", "show", "dev", netdev, "scope", "link"])
            .output()?;
        let addrs = String::from_utf8_lossy(&out.stdout);
        if oper.trim() == "up"
            && addrs
                .lines()
                .any(|l| l.contains("fe80") && !l.contains("tentative"))
        {
            return Ok(());
        }
        if t.elapsed() > timeout {
            return Err(Error::Config(format!(
                "{netdev} not ready (operstate {}, {})",
                oper.trim(),
                addrs.trim()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn read_line_unbuffered(s: &mut TcpStream) -> Result<String> {
    let mut out = vec![];
    let mut b = [0u8; 1];
    loop {
        if s.read(&mut b)? == 0 {
            break;
        }
        if b[0] == b'\n' {
            break;
        }
        out.push(b[0]);
        if out.len() > 4096 {
            return Err(Error::Connect("hello line too long".into()));
        }
    }
    Ok(String::from_utf8_lossy(&out).trim().to_string())
}

/// The passive machine's supervisor loop (returns on `shutdown`).
pub fn serve_passive(listen: &str, exe: &Path, dev: &str, netdev: &str) -> Result<()> {
    let l = TcpListener::bind(listen)?;
    eprintln!("verbs-conformance: passive side listening on {listen} ({dev} on {netdev})");
    loop {
        let (mut s, from) = l.accept()?;
        s.set_nodelay(true)?;
        let hello = read_line_unbuffered(&mut s)?;
        let w: Vec<&str> = hello.split_whitespace().collect();
        let mut cmd = Command::new(exe);
        match w.first().copied() {
            Some("suite") => {
                cmd.arg("session").arg(dev).arg(netdev).args(&w[1..]);
            }
            Some("bench") => {
                cmd.arg("pong").arg(dev);
            }
            Some("shutdown") => {
                let _ = writeln!(s, "ok bye");
                return Ok(());
            }
            _ => {
                let _ = writeln!(s, "error unknown hello {hello:?}");
                continue;
            }
        }
        let t = Instant::now();
        cmd.stdin(Stdio::from(std::os::fd::OwnedFd::from(s.try_clone()?)))
            .stdout(Stdio::from(std::os::fd::OwnedFd::from(s.try_clone()?)));
        drop(s);
        let st = cmd.spawn()?.wait()?;
        eprintln!(
            "verbs-conformance: session {:?} from {from} ended ({st}) after {:.1}s",
            w.first().copied().unwrap_or(""),
            t.elapsed().as_secs_f64()
        );
        // A `hang` takes the data link down: restore it for the next session.
        set_link(netdev, true)?;
        wait_port_active(dev, Duration::from_secs(30))?;
        wait_link_ready(netdev, Duration::from_secs(30))?;
    }
}

/// One passive session on stdin/stdout (run by [`serve_passive`] in a child).
/// Besides [`serve`]'s commands: `kill` exits at once without cleanup (the
/// kernel destroys the QP: the peer stops answering), `hang` takes the data
/// link down (the node stops answering, resources stay).
pub fn session(dev: &str, netdev: &str, params: ConnParams) -> Result<()> {
    let provider = VerbsProvider::new();
    let mut peer = LocalPeer::new(Endpoint::open(&provider, dev, params)?);
    let (tx, rx) = std::sync::mpsc::channel();
    let nd = netdev.to_string();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            match l.trim() {
                "kill" => std::process::exit(137),
                "hang" => {
                    let r = set_link(&nd, false);
                    let mut o = std::io::stdout();
                    let _ = match r {
                        Ok(()) => writeln!(o, "ok hung"),
                        Err(e) => writeln!(o, "err {e}"),
                    };
                    let _ = o.flush();
                }
                _ => {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let mut out = std::io::stdout();
    serve(&mut peer, rx, &mut out)
}

/// [`PeerCtl`] for a passive session across TCP.
pub struct TcpPeer {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    dead: bool,
    /// The passive endpoint's connection info.
    pub info: EndpointInfo,
}

impl TcpPeer {
    /// Connects to a supervisor, sends `hello`, reads the `info` line.
    pub fn connect(addr: &str, hello: &str) -> Result<TcpPeer> {
        let t = Instant::now();
        let s = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if t.elapsed() < Duration::from_secs(120) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => return Err(Error::Connect(format!("{addr}: {e}"))),
            }
        };
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(CMD_TIMEOUT))?;
        let mut writer = s.try_clone()?;
        writeln!(writer, "{hello}")?;
        writer.flush()?;
        let mut reader = BufReader::new(s);
        let mut l = String::new();
        reader.read_line(&mut l)?;
        let info = match l.trim().strip_prefix("info ") {
            Some(rest) => EndpointInfo::from_line(rest)?,
            None => {
                return Err(Error::Connect(format!(
                    "peer did not start: {:?}",
                    l.trim()
                )))
            }
        };
        Ok(TcpPeer {
            reader,
            writer,
            dead: false,
            info,
        })
    }

    /// Sends one command and returns the text after `ok `.
    pub fn cmd(&mut self, c: &str) -> Result<String> {
        if self.dead {
            return Err(Error::Connect("peer session is gone".into()));
        }
        writeln!(self.writer, "{c}")?;
        self.writer.flush()?;
        let mut l = String::new();
        if self.reader.read_line(&mut l)? == 0 {
            self.dead = true;
            return Err(Error::Connect("peer closed the connection".into()));
        }
        let l = l.trim_end();
        match l.strip_prefix("ok") {
            Some(r) => Ok(r.trim_start().to_string()),
            None => Err(Error::Connect(format!("peer: {l}"))),
        }
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

fn parse_state(s: &str) -> Option<QpState> {
    QpState::ALL.into_iter().find(|x| format!("{x:?}") == s)
}

impl PeerCtl for TcpPeer {
    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> Result<()> {
        self.cmd(&format!("recv {wr_id} {off} {len}")).map(|_| ())
    }
    fn completions(&mut self) -> Result<Vec<PeerWc>> {
        let r = self.cmd("wcs")?;
        r.split_whitespace()
            .map(|w| decode_wc(w).ok_or_else(|| Error::Connect(format!("bad completion {w:?}"))))
            .collect()
    }
    fn read(&mut self, off: usize, len: usize) -> Result<Vec<u8>> {
        let r = self.cmd(&format!("read {off} {len}"))?;
        unhex(&r).ok_or_else(|| Error::Connect("bad hex from peer".into()))
    }
    fn watch(&mut self, off: usize, len: usize) -> Result<()> {
        self.cmd(&format!("watch {off} {len}")).map(|_| ())
    }
    fn qp_state(&mut self) -> Result<QpState> {
        let r = self.cmd("state")?;
        parse_state(&r).ok_or_else(|| Error::Connect(format!("bad state {r:?}")))
    }
    fn kill(&mut self) -> Result<()> {
        writeln!(self.writer, "kill")?;
        self.writer.flush()?;
        self.dead = true;
        // The session process is gone once its end of the socket closes.
        let mut l = String::new();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            match self.reader.read_line(&mut l) {
                Ok(0) => return Ok(()),
                Ok(_) => l.clear(),
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Connect("peer did not exit".into()))
    }
    fn hang(&mut self) -> Result<()> {
        let r = self.cmd("hang");
        self.dead = true;
        r.map(|_| ())
    }
}

/// The pause of [`Harness::settle`]. Longer than the `shm` harness's 200 µs
/// on purpose: rxe restarts a QP's local ACK (retransmit) timer whenever its
/// completer runs without a timeout pending, and every new post runs it. The
/// suite's dead/hung-peer cases post one SEND per 64 `settle()` calls; at
/// 200 µs that is every ~30 ms, under the 67 ms timeout, so rxe would not
/// time out until the send queue is full. With 2 ms the posts are ≥128 ms
/// apart and rxe detects the silent peer after its retries, as an HCA does
/// (which times the oldest unacknowledged request).
pub const SETTLE: Duration = Duration::from_millis(2);

/// The active side of a case: a local endpoint on the verbs device and the
/// passive side in the other machine.
pub struct VmHarness {
    /// Local endpoint.
    pub local: Endpoint<VerbsProvider>,
    /// The remote passive side.
    pub peer: TcpPeer,
    start: Instant,
    netdev: String,
}

/// Connects a fresh pair for one case.
pub fn make_harness(dev: &str, netdev: &str, peer: &str, params: &ConnParams) -> Result<VmHarness> {
    wait_port_active(dev, Duration::from_secs(30))?;
    wait_link_ready(netdev, Duration::from_secs(30))?;
    let provider = VerbsProvider::new();
    let local = Endpoint::open(&provider, dev, *params)?;
    let mut tp = TcpPeer::connect(peer, &format!("suite {}", params.to_args()))?;
    tp.cmd(&format!("connect {}", local.info().to_line()))?;
    local.connect(&tp.info)?;
    Ok(VmHarness {
        local,
        peer: tp,
        start: Instant::now(),
        netdev: netdev.to_string(),
    })
}

impl Harness for VmHarness {
    type P = VerbsProvider;
    type Peer = TcpPeer;
    fn local(&self) -> &Endpoint<VerbsProvider> {
        &self.local
    }
    fn peer(&mut self) -> &mut TcpPeer {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.peer.info
    }
    fn settle(&mut self) {
        std::thread::sleep(SETTLE);
    }
    fn clock(&self) -> Duration {
        self.start.elapsed()
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        set_link(&self.netdev, up)
    }
}

/// Outcome of one case in [`run_suite`].
#[derive(Debug)]
pub struct CaseOutcome {
    /// Case name.
    pub name: &'static str,
    /// `Ok` or the failure message.
    pub result: std::result::Result<(), String>,
    /// Wall time.
    pub secs: f64,
}

/// Runs the conformance cases (all, or those named in `only`) against the
/// peer, printing one `SMCV-CASE` line per case.
pub fn run_suite(dev: &str, netdev: &str, peer: &str, only: &[String]) -> Vec<CaseOutcome> {
    let mut out = vec![];
    for case in cases::<VmHarness>() {
        if !only.is_empty() && !only.iter().any(|n| n == case.name) {
            continue;
        }
        let t = Instant::now();
        let params = case.params;
        let run = case.run;
        let r = std::panic::catch_unwind(move || -> std::result::Result<(), String> {
            let mut h = make_harness(dev, netdev, peer, &params)
                .map_err(|e| format!("harness setup failed: {e}"))?;
            run(&mut h)
        })
        .unwrap_or_else(|p| {
            Err(format!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))
        });
        let secs = t.elapsed().as_secs_f64();
        match &r {
            Ok(()) => println!("SMCV-CASE {} PASS {secs:.1}s", case.name),
            Err(m) => println!("SMCV-CASE {} FAIL {secs:.1}s: {m}", case.name),
        }
        out.push(CaseOutcome {
            name: case.name,
            result: r,
            secs,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_state_parsing() {
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(parse_state("Rts"), Some(QpState::Rts));
        assert_eq!(parse_state("x"), None);
    }

    /// The TCP control protocol against a scripted passive side (no RDMA).
    #[test]
    fn tcp_peer_speaks_the_line_protocol() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let info = EndpointInfo {
            gid: Gid::from_ip("10.99.0.1".parse().unwrap()),
            qp_num: 17,
            psn: 5,
            mr: RemoteMr {
                addr: 4096,
                rkey: 9,
                len: 8192,
            },
            ro_mr: RemoteMr {
                addr: 65536,
                rkey: 10,
                len: 4096,
            },
        };
        let line = info.to_line();
        let srv = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            assert_eq!(read_line_unbuffered(&mut s).unwrap(), "suite rnr_retry=7");
            writeln!(s, "info {line}").unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            for reply in ["ok ", "ok Rts", "ok 0a0b", "err nope"] {
                let mut c = String::new();
                r.read_line(&mut c).unwrap();
                writeln!(s, "{reply}").unwrap();
            }
        });
        let mut p = TcpPeer::connect(&addr, "suite rnr_retry=7").unwrap();
        assert_eq!(p.info, info);
        p.post_recv(1, 0, 64).unwrap();
        assert_eq!(p.qp_state().unwrap(), QpState::Rts);
        assert_eq!(p.read(0, 2).unwrap(), vec![10, 11]);
        assert!(p.watch(0, 1).is_err());
        srv.join().unwrap();
    }
}
