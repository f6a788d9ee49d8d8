//! The provider conformance suite, written once against the [`crate::verbs`]
//! traits and run against every provider.
//!
//! A case drives the *active* side (an [`Endpoint`] owned by the test) and
//! controls the *passive* side through [`PeerCtl`]: either a [`LocalPeer`] in
//! the same process or a peer process speaking the line protocol of
//! [`serve`]. Time passes through [`Harness::settle`] (virtual time for `sim`,
//! real time for `shm`), so the same case works for both.
//!
//! Use [`conformance_suite!`](crate::conformance_suite) to expand one
//! `#[test]` per case for a harness constructor.
#![forbid(unsafe_code)]

use crate::verbs::*;
use std::io::{BufRead, Write};
use std::time::Duration;

/// Outcome of one case.
pub type CaseResult = std::result::Result<(), String>;

macro_rules! ensure {
    ($c:expr, $($t:tt)*) => {
        if !$c {
            return Err(format!("{}:{}: {}", file!(), line!(), format!($($t)*)));
        }
    };
}

fn e<T, E: std::fmt::Display>(
    r: std::result::Result<T, E>,
    what: &str,
) -> std::result::Result<T, String> {
    r.map_err(|err| format!("{what}: {err}"))
}

/// Connection parameters of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnParams {
    /// RNR retry count (7 = infinite).
    pub rnr_retry: u8,
    /// Responder's RNR timer.
    pub min_rnr_timer: Duration,
    /// Transport timeout.
    pub timeout: Duration,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// Size of the data memory region on each side.
    pub mr_len: usize,
}

impl Default for ConnParams {
    fn default() -> Self {
        ConnParams {
            rnr_retry: 7,
            min_rnr_timer: Duration::from_millis(1),
            timeout: Duration::from_millis(50),
            retry_cnt: 3,
            mr_len: MR_LEN,
        }
    }
}

impl ConnParams {
    /// Renders as `k=v` words.
    pub fn to_args(&self) -> String {
        format!(
            "rnr_retry={} min_rnr_us={} timeout_us={} retry_cnt={} mr_len={}",
            self.rnr_retry,
            self.min_rnr_timer.as_micros(),
            self.timeout.as_micros(),
            self.retry_cnt,
            self.mr_len
        )
    }
    /// Parses [`ConnParams::to_args`] words (unknown keys are errors).
    pub fn from_args<'a>(words: impl IntoIterator<Item = &'a str>) -> Result<ConnParams> {
        let mut p = ConnParams::default();
        for w in words {
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| Error::Config(format!("bad parameter {w:?}")))?;
            let n: u64 = v
                .parse()
                .map_err(|_| Error::Config(format!("bad number in {w:?}")))?;
            match k {
                "rnr_retry" => p.rnr_retry = n as u8,
                "min_rnr_us" => p.min_rnr_timer = Duration::from_micros(n),
                "timeout_us" => p.timeout = Duration::from_micros(n),
                "retry_cnt" => p.retry_cnt = n as u8,
                "mr_len" => p.mr_len = n as usize,
                _ => return Err(Error::Config(format!("unknown parameter {k}"))),
            }
        }
        Ok(p)
    }
}

/// Data region size used by the suite.
pub const MR_LEN: usize = 256 * 1024;
/// Offset of the receive-buffer area inside the data region.
pub const RECV_AREA: usize = 192 * 1024;

/// What one side tells the other to connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    /// GID (index 0).
    pub gid: Gid,
    /// QP number.
    pub qp_num: u32,
    /// First send PSN.
    pub psn: u32,
    /// Writable data region.
    pub mr: RemoteMr,
    /// Region registered without remote write access.
    pub ro_mr: RemoteMr,
}

impl EndpointInfo {
    /// One-line text form.
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {} {} {} {} {}",
            self.gid.to_hex(),
            self.qp_num,
            self.psn,
            self.mr.addr,
            self.mr.rkey,
            self.mr.len,
            self.ro_mr.addr,
            self.ro_mr.rkey,
            self.ro_mr.len
        )
    }
    /// Parses [`EndpointInfo::to_line`].
    pub fn from_line(s: &str) -> Result<EndpointInfo> {
        let w: Vec<&str> = s.split_whitespace().collect();
        let bad = || Error::Config(format!("bad endpoint info {s:?}"));
        if w.len() != 9 {
            return Err(bad());
        }
        let n = |i: usize| w[i].parse::<u64>().map_err(|_| bad());
        Ok(EndpointInfo {
            gid: Gid::from_hex(w[0]).ok_or_else(bad)?,
            qp_num: n(1)? as u32,
            psn: n(2)? as u32,
            mr: RemoteMr {
                addr: n(3)?,
                rkey: n(4)? as u32,
                len: n(5)?,
            },
            ro_mr: RemoteMr {
                addr: n(6)?,
                rkey: n(7)? as u32,
                len: n(8)?,
            },
        })
    }
}

/// One side of a connection: device, PD, CQs, channel, QP and two regions.
pub struct Endpoint<P: Provider> {
    /// The queue pair.
    pub qp: P::Qp,
    /// Data region (LOCAL_WRITE | REMOTE_WRITE).
    pub mr: P::Mr,
    /// Region without remote write access.
    pub ro_mr: P::Mr,
    /// Send CQ.
    pub scq: P::Cq,
    /// Receive CQ.
    pub rcq: P::Cq,
    /// Channel both CQs signal.
    pub chan: P::Channel,
    /// Protection domain.
    pub pd: P::Pd,
    /// Device.
    pub dev: P::Device,
    /// First send PSN.
    pub psn: u32,
    /// Parameters.
    pub params: ConnParams,
}

impl<P: Provider> Endpoint<P> {
    /// Opens `dev_name` and creates everything, with the QP in INIT.
    pub fn open(provider: &P, dev_name: &str, params: ConnParams) -> Result<Self> {
        let dev = provider.open_device(dev_name)?;
        let pd = dev.alloc_pd()?;
        let chan = dev.create_channel()?;
        let scq = dev.create_cq(256, Some(&chan))?;
        let rcq = dev.create_cq(256, Some(&chan))?;
        let mr = pd.alloc_mr(params.mr_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let ro_mr = pd.alloc_mr(4096, Access::LOCAL_WRITE)?;
        let qp = pd.create_qp(
            &scq,
            &rcq,
            QpCap {
                max_send_wr: 128,
                max_recv_wr: 128,
                max_inline_data: 64,
            },
        )?;
        qp.modify(&QpModify::Init {
            port: 1,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        })?;
        // Random, as a real engine's must be: the shm device authenticates
        // its rendezvous with the PSNs (see the crate README).
        let mut r = [0u8; 4];
        crate::sys::random_bytes(&mut r)?;
        let psn = u32::from_le_bytes(r) & 0x00ff_ffff;
        Ok(Endpoint {
            qp,
            mr,
            ro_mr,
            scq,
            rcq,
            chan,
            pd,
            dev,
            psn,
            params,
        })
    }

    /// What the peer needs.
    pub fn info(&self) -> EndpointInfo {
        let port = self.dev.query_port(1).ok();
        let gid = port
            .and_then(|p| p.gids.first().map(|g| g.gid))
            .unwrap_or_default();
        EndpointInfo {
            gid,
            qp_num: self.qp.qp_num(),
            psn: self.psn,
            mr: self.mr.remote(),
            ro_mr: self.ro_mr.remote(),
        }
    }

    /// INIT → RTR → RTS towards `remote`.
    pub fn connect(&self, remote: &EndpointInfo) -> Result<()> {
        let mtu = self.dev.query_port(1)?.active_mtu;
        self.qp.modify(&QpModify::Rtr {
            remote: RemoteQp {
                gid: remote.gid,
                qp_num: remote.qp_num,
            },
            sgid_index: 0,
            rq_psn: remote.psn,
            path_mtu: mtu,
            min_rnr_timer: self.params.min_rnr_timer,
        })?;
        self.qp.modify(&QpModify::Rts {
            sq_psn: self.psn,
            timeout: self.params.timeout,
            retry_cnt: self.params.retry_cnt,
            rnr_retry: self.params.rnr_retry,
        })
    }

    /// Polls the send CQ.
    pub fn poll_send(&self) -> Vec<WorkCompletion> {
        poll_all(&self.scq)
    }
    /// Polls the receive CQ.
    pub fn poll_recv(&self) -> Vec<WorkCompletion> {
        poll_all(&self.rcq)
    }
}

/// Drains a CQ.
pub fn poll_all<C: CompletionQueue>(cq: &C) -> Vec<WorkCompletion> {
    let mut out = vec![];
    let mut buf = [WorkCompletion::default(); 16];
    loop {
        let n = cq.poll(&mut buf).unwrap_or(0);
        out.extend_from_slice(&buf[..n]);
        if n < buf.len() {
            return out;
        }
    }
}

/// A completion observed by the passive side, with an optional snapshot hash
/// of the watched range taken when the completion was polled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerWc {
    /// The completion.
    pub wc: WorkCompletion,
    /// FNV-1a hash of the watched range at poll time (receive completions only).
    pub snapshot: Option<u64>,
}

/// Control of the passive side.
pub trait PeerCtl {
    /// Posts a receive of `len` bytes at `off` of the peer's data region.
    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> Result<()>;
    /// Completions seen so far (drained).
    fn completions(&mut self) -> Result<Vec<PeerWc>>;
    /// Reads the peer's data region.
    fn read(&mut self, off: usize, len: usize) -> Result<Vec<u8>>;
    /// Sets the range hashed at each receive completion.
    fn watch(&mut self, off: usize, len: usize) -> Result<()>;
    /// The peer QP's state.
    fn qp_state(&mut self) -> Result<QpState>;
    /// Kills the peer abruptly (process death).
    fn kill(&mut self) -> Result<()>;
    /// Freezes the peer (it stops answering but keeps its resources).
    fn hang(&mut self) -> Result<()>;
}

/// How a provider runs the suite.
pub trait Harness {
    /// Provider.
    type P: Provider;
    /// Passive-side control.
    type Peer: PeerCtl;
    /// The active endpoint.
    fn local(&self) -> &Endpoint<Self::P>;
    /// The passive side.
    fn peer(&mut self) -> &mut Self::Peer;
    /// The passive side's connection info.
    fn remote(&self) -> EndpointInfo;
    /// Lets a little time pass and makes progress (pumps in-process peers).
    fn settle(&mut self);
    /// Monotonic clock of the harness (virtual for sim).
    fn clock(&self) -> Duration;
    /// Takes the active side's port down or up (`Unsupported` if impossible).
    fn set_local_port(&mut self, up: bool) -> Result<()>;
}

/// FNV-1a 64.
pub fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Deterministic test pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A fault hook run against the passive endpoint.
pub type PeerHook<P> = Box<dyn FnMut(&Endpoint<P>) -> Result<()> + Send>;

/// The passive side living in this process (also used by the peer process).
pub struct LocalPeer<P: Provider> {
    /// The passive endpoint.
    pub ep: Endpoint<P>,
    watch: Option<(usize, usize)>,
    wcs: Vec<PeerWc>,
    /// Set once killed or frozen: no more pumping.
    pub stopped: bool,
    /// Called by [`PeerCtl::kill`].
    pub on_kill: Option<PeerHook<P>>,
    /// Called by [`PeerCtl::hang`].
    pub on_hang: Option<PeerHook<P>>,
}

impl<P: Provider> LocalPeer<P> {
    /// Wraps an endpoint.
    pub fn new(ep: Endpoint<P>) -> Self {
        LocalPeer {
            ep,
            watch: None,
            wcs: vec![],
            stopped: false,
            on_kill: None,
            on_hang: None,
        }
    }
    /// Polls both CQs (taking snapshots for receive completions).
    pub fn pump(&mut self) {
        if self.stopped {
            return;
        }
        for wc in self.ep.poll_recv() {
            let snapshot = match (self.watch, wc.status) {
                (Some((off, len)), WcStatus::Success) => {
                    let mut b = vec![0; len];
                    self.ep.mr.read_at(off, &mut b).ok().map(|_| fnv(&b))
                }
                _ => None,
            };
            self.wcs.push(PeerWc { wc, snapshot });
        }
        for wc in self.ep.poll_send() {
            self.wcs.push(PeerWc { wc, snapshot: None });
        }
    }
}

impl<P: Provider> PeerCtl for LocalPeer<P> {
    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> Result<()> {
        let sge = self.ep.mr.sge(off, len)?;
        self.ep.qp.post_recv(&RecvWr {
            wr_id,
            sges: &[sge],
        })
    }
    fn completions(&mut self) -> Result<Vec<PeerWc>> {
        self.pump();
        Ok(std::mem::take(&mut self.wcs))
    }
    fn read(&mut self, off: usize, len: usize) -> Result<Vec<u8>> {
        let mut b = vec![0; len];
        self.ep.mr.read_at(off, &mut b)?;
        Ok(b)
    }
    fn watch(&mut self, off: usize, len: usize) -> Result<()> {
        check_range(off, len, self.ep.mr.len())?;
        self.watch = Some((off, len));
        Ok(())
    }
    fn qp_state(&mut self) -> Result<QpState> {
        Ok(self.ep.qp.state())
    }
    fn kill(&mut self) -> Result<()> {
        self.stopped = true;
        match self.on_kill.as_mut() {
            Some(f) => f(&self.ep),
            None => Err(Error::Unsupported("kill")),
        }
    }
    fn hang(&mut self) -> Result<()> {
        self.stopped = true;
        match self.on_hang.as_mut() {
            Some(f) => f(&self.ep),
            None => Err(Error::Unsupported("hang")),
        }
    }
}

fn status_code(s: WcStatus) -> String {
    format!("{s:?}")
}

fn parse_status(s: &str) -> Option<WcStatus> {
    use WcStatus::*;
    [
        Success,
        LocalLengthError,
        LocalQpOperationError,
        LocalProtectionError,
        WrFlushError,
        RemoteInvalidRequest,
        RemoteAccessError,
        RemoteOperationError,
        RetryExceeded,
        RnrRetryExceeded,
        FatalError,
    ]
    .into_iter()
    .find(|x| format!("{x:?}") == s)
}

fn parse_opcode(s: &str) -> Option<WcOpcode> {
    use WcOpcode::*;
    [Send, RdmaWrite, Recv, RecvRdmaWithImm]
        .into_iter()
        .find(|x| format!("{x:?}") == s)
}

fn parse_state(s: &str) -> Option<QpState> {
    QpState::ALL.into_iter().find(|x| format!("{x:?}") == s)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// Encodes a completion for the line protocol.
pub fn encode_wc(p: &PeerWc) -> String {
    let w = &p.wc;
    format!(
        "{},{},{:?},{},{},{},{}",
        w.wr_id,
        status_code(w.status),
        w.opcode,
        w.byte_len,
        w.imm.map(|i| i.to_string()).unwrap_or("-".into()),
        p.snapshot.map(|i| i.to_string()).unwrap_or("-".into()),
        w.qp_num
    )
}

/// Decodes [`encode_wc`].
pub fn decode_wc(s: &str) -> Option<PeerWc> {
    let f: Vec<&str> = s.split(',').collect();
    if f.len() != 7 {
        return None;
    }
    let opt = |x: &str| {
        if x == "-" {
            Ok(None)
        } else {
            x.parse::<u64>().map(Some)
        }
    };
    Some(PeerWc {
        wc: WorkCompletion {
            wr_id: f[0].parse().ok()?,
            status: parse_status(f[1])?,
            opcode: parse_opcode(f[2])?,
            byte_len: f[3].parse().ok()?,
            imm: opt(f[4]).ok()?.map(|v| v as u32),
            qp_num: f[6].parse().ok()?,
        },
        snapshot: opt(f[5]).ok()?,
    })
}

/// Runs the passive side's command loop: prints `info <EndpointInfo>`, waits
/// for `connect <EndpointInfo>`, then answers commands (`recv`, `wcs`, `read`,
/// `watch`, `state`, `quit`, and those of [`serve_with`]) one line each,
/// pumping the CQs between commands.
pub fn serve<P: Provider>(
    peer: &mut LocalPeer<P>,
    lines: std::sync::mpsc::Receiver<String>,
    out: &mut dyn Write,
) -> Result<()> {
    serve_with(peer, lines, out, &mut |_, _| None)
}

/// Extra commands of a [`serve`] loop (e.g. process-level ones of the peer
/// binary), with the peer they act on: `Some(reply)` if the words were one
/// of them.
pub type ExtraCommands<'a, P> =
    dyn FnMut(&[&str], &mut LocalPeer<P>) -> Option<Result<String>> + 'a;

/// [`serve`], with `extra` asked first for every command line; also answers
/// the commands that the threat-model and resource tests use:
///
/// * `write RKEY ADDR LEN SEED` — an RDMA WRITE of `pattern(SEED, LEN)` from
///   the data region to the peer's (RKEY, ADDR); answers its completion
///   status.
/// * `prepare RKEY ADDR LEN` — [`QueuePair::prepare_remote`].
/// * `newqp` — creates one more QP on the endpoint's PD and CQs, in INIT
///   (kept); answers its number.
/// * `newmr LEN` — registers one more REMOTE_WRITE region (kept); answers
///   `ADDR RKEY LEN`.
pub fn serve_with<P: Provider>(
    peer: &mut LocalPeer<P>,
    lines: std::sync::mpsc::Receiver<String>,
    out: &mut dyn Write,
    extra: &mut ExtraCommands<'_, P>,
) -> Result<()> {
    let mut kept_qps: Vec<P::Qp> = vec![];
    let mut kept_mrs: Vec<P::Mr> = vec![];
    writeln!(out, "info {}", peer.ep.info().to_line())?;
    out.flush()?;
    loop {
        peer.pump();
        let line = match lines.recv_timeout(Duration::from_micros(200)) {
            Ok(l) => l,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(_) => return Ok(()),
        };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<u64> {
            w.get(i)
                .and_then(|x| x.parse().ok())
                .ok_or_else(|| Error::InvalidArgument(format!("bad command {line:?}")))
        };
        if let Some(r) = extra(&w, peer) {
            match r {
                Ok(r) => writeln!(out, "ok {r}")?,
                Err(err) => writeln!(out, "err {err}")?,
            }
            out.flush()?;
            continue;
        }
        let reply: Result<String> = (|| match w.first().copied() {
            Some("write") => {
                let (rkey, addr, len, seed) = (num(1)? as u32, num(2)?, num(3)? as usize, num(4)?);
                peer.ep.mr.write_at(0, &pattern(seed, len))?;
                let sge = peer.ep.mr.sge(0, len as u32)?;
                peer.ep.qp.post_send(&SendWr {
                    wr_id: 0x5717_e000 + seed,
                    op: SendOp::RdmaWrite {
                        remote_addr: addr,
                        rkey,
                    },
                    payload: Payload::Sges(&[sge]),
                    signaled: true,
                })?;
                let t0 = std::time::Instant::now();
                while t0.elapsed() < WAIT {
                    for wc in peer.ep.poll_send() {
                        if wc.wr_id == 0x5717_e000 + seed {
                            return Ok(format!("{:?}", wc.status));
                        }
                        peer.wcs.push(PeerWc { wc, snapshot: None });
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
                Err(Error::Connect("the WRITE did not complete".into()))
            }
            Some("prepare") => peer
                .ep
                .qp
                .prepare_remote(num(1)? as u32, num(2)?, num(3)? as usize)
                .map(|_| String::new()),
            Some("newqp") => {
                let qp = peer
                    .ep
                    .pd
                    .create_qp(&peer.ep.scq, &peer.ep.rcq, QpCap::default())?;
                qp.modify(&QpModify::Init {
                    port: 1,
                    access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                })?;
                let n = qp.qp_num();
                kept_qps.push(qp);
                Ok(n.to_string())
            }
            Some("newmr") => {
                let mr = peer
                    .ep
                    .pd
                    .alloc_mr(num(1)? as usize, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
                let r = mr.remote();
                kept_mrs.push(mr);
                Ok(format!("{} {} {}", r.addr, r.rkey, r.len))
            }
            Some("connect") => {
                let info = EndpointInfo::from_line(&w[1..].join(" "))?;
                peer.ep.connect(&info)?;
                Ok(String::new())
            }
            Some("recv") => peer
                .post_recv(num(1)?, num(2)? as usize, num(3)? as u32)
                .map(|_| String::new()),
            Some("wcs") => Ok(peer
                .completions()?
                .iter()
                .map(encode_wc)
                .collect::<Vec<_>>()
                .join(" ")),
            Some("read") => Ok(hex(&peer.read(num(1)? as usize, num(2)? as usize)?)),
            Some("watch") => peer
                .watch(num(1)? as usize, num(2)? as usize)
                .map(|_| String::new()),
            Some("state") => Ok(format!("{:?}", peer.qp_state()?)),
            Some("quit") => Ok("bye".into()),
            _ => Err(Error::InvalidArgument(format!("unknown command {line:?}"))),
        })();
        match reply {
            Ok(r) => writeln!(out, "ok {r}")?,
            Err(err) => writeln!(out, "err {err}")?,
        }
        out.flush()?;
        if w.first() == Some(&"quit") {
            return Ok(());
        }
    }
}

/// [`PeerCtl`] for a peer process running [`serve`] (stdin/stdout pipes).
pub struct ProcPeer {
    /// The child process.
    pub child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    dead: bool,
    /// Its endpoint info.
    pub info: EndpointInfo,
}

impl ProcPeer {
    /// Spawns `cmd` (stdin/stdout piped) and reads its `info` line.
    pub fn spawn(mut cmd: std::process::Command) -> Result<ProcPeer> {
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut l = String::new();
        stdout.read_line(&mut l)?;
        let info = match l.trim().strip_prefix("info ") {
            Some(rest) => EndpointInfo::from_line(rest)?,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Connect(format!("peer process did not start: {l:?}")));
            }
        };
        Ok(ProcPeer {
            child,
            stdin,
            stdout,
            dead: false,
            info,
        })
    }

    /// Sends one command and returns the text after `ok `.
    pub fn cmd(&mut self, c: &str) -> Result<String> {
        if self.dead {
            return Err(Error::Connect("peer process is gone".into()));
        }
        writeln!(self.stdin, "{c}")?;
        self.stdin.flush()?;
        let mut l = String::new();
        if self.stdout.read_line(&mut l)? == 0 {
            self.dead = true;
            return Err(Error::Connect("peer process closed its output".into()));
        }
        let l = l.trim_end();
        if let Some(r) = l.strip_prefix("ok") {
            Ok(r.trim_start().to_string())
        } else {
            Err(Error::Connect(format!("peer: {l}")))
        }
    }
}

impl Drop for ProcPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PeerCtl for ProcPeer {
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
        self.dead = true;
        self.child.kill()?;
        let _ = self.child.wait();
        Ok(())
    }
    /// The peer's device thread stops answering (`hang`: a hung process;
    /// a stopped one is paused, not dead, see `QueuePair::peer_paused`).
    fn hang(&mut self) -> Result<()> {
        self.cmd("hang")?;
        self.dead = true;
        Ok(())
    }
}

// ---------------------------------------------------------------- process statistics

/// What a process holds, from `/proc/PID` (for "back to baseline" checks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcStats {
    /// Open descriptors.
    pub fds: usize,
    /// Open descriptors that are memfds.
    pub memfd_fds: usize,
    /// Mappings of memfds.
    pub memfd_maps: usize,
    /// Resident set size in KiB.
    pub rss_kib: u64,
    /// User + system CPU time in clock ticks.
    pub cpu_ticks: u64,
    /// Threads.
    pub threads: usize,
}

/// [`ProcStats`] of process `pid` (`std::process::id()` for this one).
pub fn proc_stats(pid: u32) -> std::io::Result<ProcStats> {
    let base = std::path::PathBuf::from(format!("/proc/{pid}"));
    let mut st = ProcStats::default();
    for e in std::fs::read_dir(base.join("fd"))?.flatten() {
        st.fds += 1;
        if std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:")) {
            st.memfd_fds += 1;
        }
    }
    st.memfd_maps = std::fs::read_to_string(base.join("maps"))?
        .lines()
        .filter(|l| l.contains("/memfd:"))
        .count();
    for l in std::fs::read_to_string(base.join("status"))?.lines() {
        let num = || {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        if l.starts_with("VmRSS:") {
            st.rss_kib = num();
        } else if l.starts_with("Threads:") {
            st.threads = num() as usize;
        }
    }
    let stat = std::fs::read_to_string(base.join("stat"))?;
    let f: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15: indexes 11 and 12 after the name.
    st.cpu_ticks = f.get(11).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    Ok(st)
}

/// [`proc_stats`] once descriptors, mappings and threads hold still (two
/// looks 50 ms apart agree; at most 2 s): what was just dropped may be held
/// a moment longer, e.g. for the rest of a device thread's poll round.
pub fn settled_proc_stats(pid: u32) -> std::io::Result<ProcStats> {
    let key = |s: &ProcStats| (s.fds, s.memfd_fds, s.memfd_maps, s.threads);
    let t0 = std::time::Instant::now();
    let mut a = proc_stats(pid)?;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let b = proc_stats(pid)?;
        if key(&a) == key(&b) || t0.elapsed() > Duration::from_secs(2) {
            return Ok(b);
        }
        a = b;
    }
}

// ---------------------------------------------------------------- helpers

/// Default wait bound for cases (virtual time for sim).
pub const WAIT: Duration = Duration::from_secs(5);

/// Settles until `f` holds or `timeout` passes on the harness clock.
pub fn wait_until<H: Harness>(
    h: &mut H,
    timeout: Duration,
    mut f: impl FnMut(&mut H) -> bool,
) -> bool {
    let start = h.clock();
    loop {
        if f(h) {
            return true;
        }
        if h.clock().saturating_sub(start) > timeout {
            return false;
        }
        h.settle();
    }
}

fn local_send_wcs<H: Harness>(
    h: &mut H,
    n: usize,
) -> std::result::Result<Vec<WorkCompletion>, String> {
    let mut got = vec![];
    wait_until(h, WAIT, |h| {
        got.extend(h.local().poll_send());
        got.len() >= n
    });
    ensure!(got.len() >= n, "expected {n} send completions, got {got:?}");
    Ok(got)
}

fn peer_wcs<H: Harness>(h: &mut H, n: usize) -> std::result::Result<Vec<PeerWc>, String> {
    let mut got = vec![];
    let mut err = None;
    wait_until(h, WAIT, |h| {
        match h.peer().completions() {
            Ok(v) => got.extend(v),
            Err(x) => err = Some(x.to_string()),
        }
        got.len() >= n || err.is_some()
    });
    if let Some(x) = err {
        return Err(x);
    }
    ensure!(got.len() >= n, "expected {n} peer completions, got {got:?}");
    Ok(got)
}

fn write_wr(wr_id: u64, sges: &[Sge], remote_addr: u64, rkey: u32, signaled: bool) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: SendOp::RdmaWrite { remote_addr, rkey },
        payload: Payload::Sges(sges),
        signaled,
    }
}

fn sleep_for<H: Harness>(h: &mut H, d: Duration) {
    wait_until(h, d, |_| false);
}

// ---------------------------------------------------------------- cases

/// QP state machine: allowed and rejected transitions, posting rules, flush.
pub fn qp_state_transitions<H: Harness>(h: &mut H) -> CaseResult {
    ensure!(h.local().qp.state() == QpState::Rts, "local QP not RTS");
    ensure!(
        e(h.peer().qp_state(), "peer state")? == QpState::Rts,
        "peer QP not RTS"
    );
    let l = h.local();
    let qp = e(
        l.pd.create_qp(&l.scq, &l.rcq, QpCap::default()),
        "create_qp",
    )?;
    ensure!(qp.state() == QpState::Reset, "new QP not RESET");
    let sge = e(l.mr.sge(RECV_AREA, 64), "sge")?;
    ensure!(
        matches!(
            qp.post_recv(&RecvWr {
                wr_id: 1,
                sges: &[sge]
            }),
            Err(Error::InvalidState { .. })
        ),
        "post_recv in RESET accepted"
    );
    let send = SendWr {
        wr_id: 2,
        op: SendOp::Send,
        payload: Payload::Inline(b"x"),
        signaled: true,
    };
    ensure!(
        matches!(qp.post_send(&send), Err(Error::InvalidState { .. })),
        "post_send in RESET accepted"
    );
    let rtr = QpModify::Rtr {
        remote: RemoteQp {
            gid: Gid::default(),
            qp_num: 1,
        },
        sgid_index: 0,
        rq_psn: 0,
        path_mtu: Mtu::Mtu1024,
        min_rnr_timer: Duration::from_millis(1),
    };
    let rts = QpModify::Rts {
        sq_psn: 0,
        timeout: Duration::from_millis(10),
        retry_cnt: 1,
        rnr_retry: 1,
    };
    ensure!(
        matches!(qp.modify(&rtr), Err(Error::InvalidTransition { .. })),
        "RESET->RTR accepted"
    );
    ensure!(
        matches!(qp.modify(&rts), Err(Error::InvalidTransition { .. })),
        "RESET->RTS accepted"
    );
    let init = QpModify::Init {
        port: 1,
        access: Access::REMOTE_WRITE,
    };
    e(qp.modify(&init), "RESET->INIT")?;
    ensure!(qp.state() == QpState::Init, "not INIT");
    e(qp.modify(&init), "INIT->INIT")?;
    ensure!(
        matches!(qp.post_send(&send), Err(Error::InvalidState { .. })),
        "post_send in INIT accepted"
    );
    e(
        qp.post_recv(&RecvWr {
            wr_id: 0xabc,
            sges: &[sge],
        }),
        "post_recv in INIT",
    )?;
    ensure!(
        matches!(qp.modify(&rts), Err(Error::InvalidTransition { .. })),
        "INIT->RTS accepted"
    );
    e(qp.modify(&QpModify::Err), "INIT->ERR")?;
    ensure!(qp.state() == QpState::Err, "not ERR");
    ensure!(
        matches!(qp.modify(&rtr), Err(Error::InvalidTransition { .. })),
        "ERR->RTR accepted"
    );
    ensure!(
        matches!(qp.modify(&init), Err(Error::InvalidTransition { .. })),
        "ERR->INIT accepted"
    );
    let mut flushed = vec![];
    wait_until(h, WAIT, |h| {
        flushed.extend(h.local().poll_recv());
        !flushed.is_empty()
    });
    ensure!(
        flushed
            .iter()
            .any(|w| w.wr_id == 0xabc && w.status == WcStatus::WrFlushError),
        "receive not flushed: {flushed:?}"
    );
    let l = h.local();
    e(qp.modify(&QpModify::Reset), "ERR->RESET")?;
    ensure!(qp.state() == QpState::Reset, "not RESET");
    e(qp.modify(&init), "RESET->INIT again")?;
    e(qp.modify(&QpModify::Reset), "INIT->RESET")?;
    // RTS -> RTS on the live QP.
    let p = l.params;
    e(
        l.qp.modify(&QpModify::Rts {
            sq_psn: l.psn,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: p.rnr_retry,
        }),
        "RTS->RTS",
    )?;
    ensure!(l.qp.state() == QpState::Rts, "not RTS after RTS->RTS");
    ensure!(
        matches!(l.qp.modify(&init), Err(Error::InvalidTransition { .. })),
        "RTS->INIT accepted"
    );
    Ok(())
}

/// RDMA WRITE data is visible at the peer once the write completed;
/// unsignaled WRs produce no completion; multi-SGE gathers work.
pub fn write_visibility<H: Harness>(h: &mut H) -> CaseResult {
    let r = h.remote().mr;
    let data = pattern(1, 4096);
    let l = h.local();
    e(l.mr.write_at(0, &data), "write_at")?;
    let sge = e(l.mr.sge(0, 4096), "sge")?;
    e(
        l.qp.post_send(&write_wr(10, &[sge], r.addr + 1000, r.rkey, true)),
        "post write",
    )?;
    let wcs = local_send_wcs(h, 1)?;
    ensure!(wcs.len() == 1, "completions {wcs:?}");
    let w = wcs[0];
    ensure!(
        w.wr_id == 10 && w.status == WcStatus::Success && w.opcode == WcOpcode::RdmaWrite,
        "bad completion {w:?}"
    );
    ensure!(w.byte_len == 4096, "byte_len {}", w.byte_len);
    let got = e(h.peer().read(1000, 4096), "peer read")?;
    ensure!(got == data, "written data not visible");

    // Unsignaled then signaled, two SGEs.
    let a = pattern(2, 100);
    let b = pattern(3, 64 * 1024);
    let l = h.local();
    e(l.mr.write_at(8192, &a), "write_at")?;
    e(l.mr.write_at(16384, &b[..32768]), "write_at")?;
    e(l.mr.write_at(100_000, &b[32768..]), "write_at")?;
    let s1 = e(l.mr.sge(8192, 100), "sge")?;
    let s2 = [
        e(l.mr.sge(16384, 32768), "sge")?,
        e(l.mr.sge(100_000, 32768), "sge")?,
    ];
    e(
        l.qp.post_send(&write_wr(11, &[s1], r.addr + 50_000, r.rkey, false)),
        "post unsignaled",
    )?;
    e(
        l.qp.post_send(&write_wr(12, &s2, r.addr + 60_000, r.rkey, true)),
        "post signaled",
    )?;
    let wcs = local_send_wcs(h, 1)?;
    sleep_for(h, Duration::from_millis(20));
    let mut wcs2 = wcs.clone();
    wcs2.extend(h.local().poll_send());
    ensure!(
        wcs2.len() == 1 && wcs2[0].wr_id == 12 && wcs2[0].status == WcStatus::Success,
        "completions {wcs2:?}"
    );
    ensure!(
        e(h.peer().read(50_000, 100), "read")? == a,
        "unsignaled write not visible"
    );
    ensure!(
        e(h.peer().read(60_000, 65536), "read")? == b,
        "gathered write not visible"
    );
    Ok(())
}

/// Selective signaling: unsignaled SENDs produce no completion of their
/// own, and a signaled zero-length RDMA WRITE posted after them (the probe
/// smc-engine posts behind unsignaled CDCs) completes once they have: one
/// completion, the WRITE's, while the peer receives every SEND, in order,
/// and sees nothing of the WRITE; nor does it check the R_Key and address
/// of zero bytes (IBTA C9-88).
pub fn unsignaled_sends_then_a_zero_length_write<H: Harness>(h: &mut H) -> CaseResult {
    const N: u64 = 6;
    for i in 0..N {
        e(
            h.peer().post_recv(500 + i, RECV_AREA + 64 * i as usize, 64),
            "post_recv",
        )?;
    }
    let r = h.remote().mr;
    let before = e(h.peer().read(4096, 64), "peer read")?;
    for i in 0..N {
        let msg = (0x1000 + i).to_le_bytes();
        let send = SendWr {
            wr_id: 600 + i,
            op: SendOp::Send,
            payload: Payload::Inline(&msg),
            signaled: false,
        };
        e(h.local().qp.post_send(&send), "post unsignaled send")?;
    }
    let probe = SendWr {
        wr_id: 700,
        op: SendOp::RdmaWrite {
            remote_addr: r.addr + 4096,
            rkey: r.rkey,
        },
        payload: Payload::Sges(&[]),
        signaled: true,
    };
    e(h.local().qp.post_send(&probe), "post zero-length write")?;
    let p = peer_wcs(h, N as usize)?;
    for (i, w) in p.iter().enumerate() {
        ensure!(
            w.wc.wr_id == 500 + i as u64
                && w.wc.status == WcStatus::Success
                && w.wc.opcode == WcOpcode::Recv,
            "receive {i}: {w:?}"
        );
        let m = e(h.peer().read(RECV_AREA + 64 * i, 8), "read")?;
        ensure!(
            m == (0x1000 + i as u64).to_le_bytes(),
            "SEND payload {i} wrong"
        );
    }
    let wcs = local_send_wcs(h, 1)?;
    sleep_for(h, Duration::from_millis(20));
    let mut all = wcs.clone();
    all.extend(h.local().poll_send());
    ensure!(
        all.len() == 1
            && all[0].wr_id == 700
            && all[0].status == WcStatus::Success
            && all[0].opcode == WcOpcode::RdmaWrite
            && all[0].byte_len == 0,
        "completions {all:?}"
    );
    ensure!(
        e(h.peer().read(4096, 64), "peer read")? == before,
        "a zero-length write changed the peer's memory"
    );
    ensure!(
        h.peer().completions().is_ok_and(|v| v.is_empty()),
        "the peer saw the zero-length write"
    );
    // (zero bytes need no access: an R_Key and address of nothing succeed)
    let bogus = SendWr {
        wr_id: 701,
        op: SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: r.rkey ^ 0x00ff_ff00,
        },
        payload: Payload::Sges(&[]),
        signaled: true,
    };
    e(
        h.local().qp.post_send(&bogus),
        "post zero-length write, no key",
    )?;
    let wcs = local_send_wcs(h, 1)?;
    ensure!(
        wcs.len() == 1 && wcs[0].wr_id == 701 && wcs[0].status == WcStatus::Success,
        "a zero-length write with no valid key: {wcs:?}"
    );
    Ok(())
}

/// A region registered on a second device (`ProtectionDomain::share_mr`),
/// as a link group whose links are on two devices registers its RMBs: the
/// owner has a QP on device `owner_a` (PD A, which allocated the region) and
/// one on `owner_b` (PD B, the second registration); the peer has a QP on
/// `peer_dev` connected to each. A WRITE through B's QP with B's rkey shows
/// in A's view and one through A's QP with A's rkey in B's; B's QP cannot use
/// A's rkey (a peer reaches only its own QP's PD's regions, crate README);
/// and the memory stays registered on A when B's registration goes.
/// `settle` lets time pass (the simulation's clock, the shm device's
/// threads).
pub fn shared_mr_two_devices<P: Provider>(
    p: &P,
    owner_a: &str,
    owner_b: &str,
    peer_dev: &str,
    settle: &mut dyn FnMut(),
) -> CaseResult {
    let params = ConnParams::default();
    let oa = e(Endpoint::open(p, owner_a, params), "open owner A")?;
    let ob = e(Endpoint::open(p, owner_b, params), "open owner B")?;
    let pa = e(Endpoint::open(p, peer_dev, params), "open peer of A")?;
    let pb = e(Endpoint::open(p, peer_dev, params), "open peer of B")?;
    let shared = e(
        ob.pd
            .share_mr(&oa.mr, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        "share_mr",
    )?;
    ensure!(
        shared.rkey() != oa.mr.rkey() && shared.len() == oa.mr.len(),
        "the second registration has its own rkey and the same length: {:?} vs {:?}",
        shared.remote(),
        oa.mr.remote()
    );
    e(oa.connect(&pa.info()), "connect owner A")?;
    e(pa.connect(&oa.info()), "connect peer of A")?;
    e(ob.connect(&pb.info()), "connect owner B")?;
    e(pb.connect(&ob.info()), "connect peer of B")?;
    let mut wait = |ep: &Endpoint<P>, wr_id: u64| -> std::result::Result<WorkCompletion, String> {
        let start = std::time::Instant::now();
        for _ in 0..100_000 {
            if let Some(w) = ep.poll_send().into_iter().find(|w| w.wr_id == wr_id) {
                return Ok(w);
            }
            if start.elapsed() > Duration::from_secs(10) {
                break;
            }
            settle();
        }
        Err(format!("no completion of WR {wr_id}"))
    };

    // the peer of B writes through B's rkey: the bytes show through A's view
    let data = pattern(21, 8192);
    e(pb.mr.write_at(0, &data), "write_at")?;
    let sge = e(pb.mr.sge(0, 8192), "sge")?;
    let b = shared.remote();
    e(
        pb.qp
            .post_send(&write_wr(1, &[sge], b.addr + 4096, b.rkey, true)),
        "post write on B",
    )?;
    let w = wait(&pb, 1)?;
    ensure!(
        w.status == WcStatus::Success,
        "write through B's rkey: {w:?}"
    );
    let mut got = vec![0; 8192];
    e(oa.mr.read_at(4096, &mut got), "read A")?;
    ensure!(
        got == data,
        "B's write not visible through A's registration"
    );

    // the peer of A writes through A's rkey: the bytes show through B's view
    let data2 = pattern(22, 4096);
    e(pa.mr.write_at(0, &data2), "write_at")?;
    let sge = e(pa.mr.sge(0, 4096), "sge")?;
    let a = oa.mr.remote();
    e(
        pa.qp.post_send(&write_wr(2, &[sge], a.addr, a.rkey, true)),
        "post write on A",
    )?;
    let w = wait(&pa, 2)?;
    ensure!(
        w.status == WcStatus::Success,
        "write through A's rkey: {w:?}"
    );
    let mut got = vec![0; 4096];
    e(shared.read_at(0, &mut got), "read B")?;
    ensure!(
        got == data2,
        "A's write not visible through B's registration"
    );

    // B's registration goes: A's stays, and so does the memory
    drop(shared);
    e(
        pa.qp
            .post_send(&write_wr(3, &[sge], a.addr + 8192, a.rkey, true)),
        "post write on A",
    )?;
    let w = wait(&pa, 3)?;
    ensure!(
        w.status == WcStatus::Success,
        "A's registration outlives B's: {w:?}"
    );
    let mut got = vec![0; 4096];
    e(oa.mr.read_at(8192, &mut got), "read A")?;
    ensure!(got == data2, "write after B's deregistration not visible");

    // B's QP cannot use A's rkey (its address, in bounds)
    let sge = e(pb.mr.sge(0, 64), "sge")?;
    e(
        pb.qp.post_send(&write_wr(4, &[sge], a.addr, a.rkey, true)),
        "post write",
    )?;
    let w = wait(&pb, 4)?;
    ensure!(
        w.status == WcStatus::RemoteAccessError,
        "B's QP wrote with A's rkey: {w:?}"
    );
    let mut got = vec![0; 64];
    e(oa.mr.read_at(0, &mut got), "read A")?;
    ensure!(got == data2[..64], "a refused write changed the region");
    Ok(())
}

/// RC ordering: a SEND posted after a WRITE is received only after the
/// written data is visible (checked by the receiver at completion time).
pub fn send_write_ordering<H: Harness>(h: &mut H) -> CaseResult {
    const N: u64 = 16;
    const LEN: usize = 32 * 1024;
    e(h.peer().watch(0, LEN), "watch")?;
    for i in 0..N {
        e(
            h.peer().post_recv(100 + i, RECV_AREA + 64 * i as usize, 64),
            "post_recv",
        )?;
    }
    let r = h.remote().mr;
    let mut expect = vec![];
    for i in 0..N {
        let d = pattern(1000 + i, LEN);
        expect.push(fnv(&d));
        let l = h.local();
        let off = (i as usize % 2) * LEN + 64 * 1024;
        e(l.mr.write_at(off, &d), "write_at")?;
        let sge = e(l.mr.sge(off, LEN as u32), "sge")?;
        // Unsignaled WRITE followed by a signaled inline SEND.
        let mut posted = false;
        wait_until(h, WAIT, |h| {
            let l = h.local();
            l.poll_send();
            posted =
                l.qp.post_send(&write_wr(200 + i, &[sge], r.addr, r.rkey, false))
                    .is_ok();
            posted
        });
        ensure!(posted, "post write {i}");
        let msg = i.to_le_bytes();
        let l = h.local();
        let send = SendWr {
            wr_id: 300 + i,
            op: SendOp::Send,
            payload: Payload::Inline(&msg),
            signaled: true,
        };
        e(l.qp.post_send(&send), "post send")?;
        // The next WRITE overwrites the watched range, so wait until the
        // receiver has reported (and snapshotted at) this SEND's completion.
        let p = peer_wcs(h, 1)?;
        ensure!(p.len() == 1, "recv {i}: {p:?}");
        let p = p[0];
        ensure!(
            p.wc.status == WcStatus::Success && p.wc.opcode == WcOpcode::Recv,
            "recv {i}: {p:?}"
        );
        ensure!(
            p.wc.wr_id == 100 + i,
            "receive completions out of order: {p:?}"
        );
        ensure!(
            p.snapshot == Some(expect[i as usize]),
            "SEND {i} seen before its WRITE's data was visible"
        );
        let m = e(h.peer().read(RECV_AREA + 64 * i as usize, 8), "read")?;
        ensure!(m == i.to_le_bytes(), "SEND payload {i} wrong");
        let mut got = 0;
        wait_until(h, WAIT, |h| {
            got += h.local().poll_send().len();
            got >= 1
        });
        ensure!(got == 1, "send {i} did not complete");
    }
    Ok(())
}

/// WRITE WITH IMMEDIATE and SEND WITH IMMEDIATE deliver the immediate data.
pub fn immediate_data<H: Harness>(h: &mut H) -> CaseResult {
    e(h.peer().watch(4096, 512), "watch")?;
    e(h.peer().post_recv(1, RECV_AREA, 64), "post_recv")?;
    e(h.peer().post_recv(2, RECV_AREA + 64, 64), "post_recv")?;
    let r = h.remote().mr;
    let d = pattern(7, 512);
    let l = h.local();
    e(l.mr.write_at(0, &d), "write_at")?;
    let sge = e(l.mr.sge(0, 512), "sge")?;
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::RdmaWriteWithImm {
            remote_addr: r.addr + 4096,
            rkey: r.rkey,
            imm: 0xdead_beef,
        },
        payload: Payload::Sges(&[sge]),
        signaled: true,
    };
    e(l.qp.post_send(&wr), "post write-imm")?;
    let s = SendWr {
        wr_id: 6,
        op: SendOp::SendWithImm(42),
        payload: Payload::Inline(b"hello!!!"),
        signaled: true,
    };
    e(l.qp.post_send(&s), "post send-imm")?;
    let wcs = local_send_wcs(h, 2)?;
    ensure!(
        wcs.iter().all(|w| w.status == WcStatus::Success),
        "send side: {wcs:?}"
    );
    ensure!(
        wcs[0].opcode == WcOpcode::RdmaWrite && wcs[1].opcode == WcOpcode::Send,
        "opcodes {wcs:?}"
    );
    let p = peer_wcs(h, 2)?;
    let a = p[0];
    ensure!(
        a.wc.opcode == WcOpcode::RecvRdmaWithImm && a.wc.imm == Some(0xdead_beef),
        "write-imm: {a:?}"
    );
    ensure!(
        a.wc.byte_len == 512 && a.wc.wr_id == 1 && a.snapshot == Some(fnv(&d)),
        "write-imm: {a:?}"
    );
    let b = p[1];
    ensure!(
        b.wc.opcode == WcOpcode::Recv && b.wc.imm == Some(42) && b.wc.byte_len == 8,
        "send-imm: {b:?}"
    );
    ensure!(
        e(h.peer().read(RECV_AREA + 64, 8), "read")? == b"hello!!!",
        "send-imm payload"
    );
    Ok(())
}

/// SEND from registered memory and inline SEND land in posted buffers in order.
pub fn send_inline_and_sge<H: Harness>(h: &mut H) -> CaseResult {
    e(h.peer().post_recv(1, RECV_AREA, 4096), "post_recv")?;
    e(h.peer().post_recv(2, RECV_AREA + 4096, 4096), "post_recv")?;
    let d = pattern(9, 2000);
    let l = h.local();
    e(l.mr.write_at(0, &d), "write_at")?;
    let sge = e(l.mr.sge(0, 2000), "sge")?;
    e(
        l.qp.post_send(&SendWr {
            wr_id: 1,
            op: SendOp::Send,
            payload: Payload::Sges(&[sge]),
            signaled: true,
        }),
        "send",
    )?;
    e(
        l.qp.post_send(&SendWr {
            wr_id: 2,
            op: SendOp::Send,
            payload: Payload::Inline(&[7u8; 44]),
            signaled: true,
        }),
        "inline",
    )?;
    let too_big = [0u8; 65];
    ensure!(
        l.qp.post_send(&SendWr {
            wr_id: 3,
            op: SendOp::Send,
            payload: Payload::Inline(&too_big),
            signaled: true
        })
        .is_err(),
        "oversized inline accepted"
    );
    let wcs = local_send_wcs(h, 2)?;
    ensure!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status))
            .eq([(1, WcStatus::Success), (2, WcStatus::Success)]),
        "{wcs:?}"
    );
    let p = peer_wcs(h, 2)?;
    ensure!(
        p[0].wc.wr_id == 1 && p[0].wc.byte_len == 2000 && p[0].wc.imm.is_none(),
        "{p:?}"
    );
    ensure!(p[1].wc.wr_id == 2 && p[1].wc.byte_len == 44, "{p:?}");
    ensure!(
        e(h.peer().read(RECV_AREA, 2000), "read")? == d,
        "sge payload"
    );
    ensure!(
        e(h.peer().read(RECV_AREA + 4096, 44), "read")? == [7u8; 44],
        "inline payload"
    );
    Ok(())
}

/// Receive-queue exhaustion with infinite RNR retry: the SEND waits until a
/// receive is posted, then completes.
pub fn rnr_infinite_retry<H: Harness>(h: &mut H) -> CaseResult {
    ensure!(h.local().params.rnr_retry == 7, "case needs rnr_retry=7");
    let l = h.local();
    e(
        l.qp.post_send(&SendWr {
            wr_id: 9,
            op: SendOp::Send,
            payload: Payload::Inline(b"late"),
            signaled: true,
        }),
        "send",
    )?;
    let mut early = vec![];
    wait_until(h, Duration::from_millis(200), |h| {
        early.extend(h.local().poll_send());
        !early.is_empty()
    });
    ensure!(
        early.is_empty(),
        "SEND completed without a receive: {early:?}"
    );
    ensure!(
        h.local().qp.state() == QpState::Rts,
        "QP left RTS during RNR"
    );
    // A WRITE behind the refused SEND must not be executed before it.
    let r = h.remote().mr;
    let d = pattern(77, 512);
    let l = h.local();
    e(l.mr.write_at(0, &d), "write_at")?;
    let sge = e(l.mr.sge(0, 512), "sge")?;
    e(
        l.qp.post_send(&write_wr(10, &[sge], r.addr + 8192, r.rkey, true)),
        "post write",
    )?;
    // nor an unsignaled inline one (64 bytes: within every provider's limit)
    let di = pattern(78, 64);
    e(
        h.local().qp.post_send(&SendWr {
            wr_id: 11,
            op: SendOp::RdmaWrite {
                remote_addr: r.addr + 12288,
                rkey: r.rkey,
            },
            payload: Payload::Inline(&di),
            signaled: false,
        }),
        "post inline write",
    )?;
    sleep_for(h, Duration::from_millis(50));
    ensure!(
        e(h.peer().read(8192, 512), "read")? != d,
        "WRITE behind an RNR-refused SEND landed before the SEND"
    );
    ensure!(
        e(h.peer().read(12288, 64), "read")? != di,
        "inline WRITE behind an RNR-refused SEND landed before the SEND"
    );
    ensure!(
        h.local().poll_send().is_empty(),
        "completion while the SEND is refused"
    );
    e(h.peer().post_recv(77, RECV_AREA, 64), "post_recv")?;
    let wcs = local_send_wcs(h, 2)?;
    ensure!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status))
            .eq([(9, WcStatus::Success), (10, WcStatus::Success)]),
        "{wcs:?}"
    );
    ensure!(
        e(h.peer().read(8192, 512), "read")? == d,
        "WRITE not visible after the SEND went through"
    );
    ensure!(
        e(h.peer().read(12288, 64), "read")? == di,
        "inline WRITE not visible after the SEND went through"
    );
    let p = peer_wcs(h, 1)?;
    ensure!(p[0].wc.wr_id == 77 && p[0].wc.byte_len == 4, "{p:?}");
    ensure!(
        e(h.peer().read(RECV_AREA, 4), "read")? == b"late",
        "payload"
    );
    Ok(())
}

/// Receive-queue exhaustion with finite RNR retry: RnrRetryExceeded, QP in
/// ERR, and the message is never delivered.
pub fn rnr_retry_exceeded<H: Harness>(h: &mut H) -> CaseResult {
    ensure!(
        h.local().params.rnr_retry < 7,
        "case needs finite rnr_retry"
    );
    let l = h.local();
    e(
        l.qp.post_send(&SendWr {
            wr_id: 9,
            op: SendOp::Send,
            payload: Payload::Inline(b"lost"),
            signaled: true,
        }),
        "send",
    )?;
    e(
        l.qp.post_send(&SendWr {
            wr_id: 10,
            op: SendOp::Send,
            payload: Payload::Inline(b"lost"),
            signaled: false,
        }),
        "send",
    )?;
    let wcs = local_send_wcs(h, 2)?;
    ensure!(
        wcs[0].wr_id == 9 && wcs[0].status == WcStatus::RnrRetryExceeded,
        "{wcs:?}"
    );
    ensure!(
        wcs[1].wr_id == 10 && wcs[1].status == WcStatus::WrFlushError,
        "{wcs:?}"
    );
    ensure!(h.local().qp.state() == QpState::Err, "QP not in ERR");
    let l = h.local();
    ensure!(
        matches!(
            l.qp.post_send(&SendWr {
                wr_id: 1,
                op: SendOp::Send,
                payload: Payload::Inline(b"x"),
                signaled: true
            }),
            Err(Error::InvalidState { .. })
        ),
        "post_send in ERR accepted"
    );
    e(h.peer().post_recv(1, RECV_AREA, 64), "post_recv")?;
    sleep_for(h, Duration::from_millis(50));
    let p = e(h.peer().completions(), "completions")?;
    ensure!(
        p.iter().all(|p| p.wc.status != WcStatus::Success),
        "abandoned SEND was delivered: {p:?}"
    );
    Ok(())
}

fn expect_remote_access_error<H: Harness>(
    h: &mut H,
    remote_addr: u64,
    rkey: u32,
    check: (usize, usize),
) -> CaseResult {
    let before = e(h.peer().read(check.0, check.1), "read")?;
    let l = h.local();
    e(l.mr.write_at(0, &[0x55; 256]), "write_at")?;
    let sge = e(l.mr.sge(0, 256), "sge")?;
    let posted =
        l.qp.post_send(&write_wr(1, &[sge], remote_addr, rkey, true));
    ensure!(posted.is_ok(), "post failed synchronously: {posted:?}");
    // A good write behind the bad one must not execute either.
    let sge = e(l.mr.sge(0, 16), "sge")?;
    let r = h.remote().mr;
    let _ = h
        .local()
        .qp
        .post_send(&write_wr(99, &[sge], r.addr + check.0 as u64, r.rkey, true));
    let mut wcs = vec![];
    wait_until(h, WAIT, |h| {
        wcs.extend(h.local().poll_send());
        wcs.iter().any(|w| w.wr_id == 1)
    });
    let w = wcs
        .iter()
        .find(|w| w.wr_id == 1)
        .ok_or(format!("no completion: {wcs:?}"))?;
    ensure!(w.status == WcStatus::RemoteAccessError, "status {w:?}");
    ensure!(
        wcs.iter()
            .all(|w| w.wr_id != 99 || w.status == WcStatus::WrFlushError),
        "{wcs:?}"
    );
    ensure!(h.local().qp.state() == QpState::Err, "writer QP not in ERR");
    sleep_for(h, Duration::from_millis(20));
    ensure!(
        e(h.peer().read(check.0, check.1), "read")? == before,
        "peer memory modified by a rejected write"
    );
    Ok(())
}

/// A WRITE with an invalid rkey fails the writer's QP with RemoteAccessError.
pub fn invalid_rkey_rejected<H: Harness>(h: &mut H) -> CaseResult {
    let r = h.remote().mr;
    expect_remote_access_error(h, r.addr, r.rkey ^ 0x00a5_5a00, (0, 4096))
}

/// A WRITE straddling the end of the region is rejected without touching memory.
pub fn out_of_bounds_rejected<H: Harness>(h: &mut H) -> CaseResult {
    let r = h.remote().mr;
    let len = r.len as usize;
    expect_remote_access_error(h, r.addr + r.len - 100, r.rkey, (len - 4096, 4096))
}

/// A WRITE into a region registered without REMOTE_WRITE is rejected.
pub fn no_remote_write_access_rejected<H: Harness>(h: &mut H) -> CaseResult {
    let ro = h.remote().ro_mr;
    expect_remote_access_error(h, ro.addr, ro.rkey, (0, 256))
}

/// Moving a QP to ERR flushes posted receives; posting sends then fails.
pub fn flush_on_error<H: Harness>(h: &mut H) -> CaseResult {
    let l = h.local();
    for i in 0..3u64 {
        let sge = e(l.mr.sge(RECV_AREA + 64 * i as usize, 64), "sge")?;
        e(
            l.qp.post_recv(&RecvWr {
                wr_id: 500 + i,
                sges: &[sge],
            }),
            "post_recv",
        )?;
    }
    e(l.qp.modify(&QpModify::Err), "to ERR")?;
    let mut wcs = vec![];
    wait_until(h, WAIT, |h| {
        wcs.extend(h.local().poll_recv());
        wcs.len() >= 3
    });
    ensure!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status))
            .eq((0..3).map(|i| (500 + i, WcStatus::WrFlushError))),
        "flushes {wcs:?}"
    );
    let l = h.local();
    ensure!(
        matches!(
            l.qp.post_send(&SendWr {
                wr_id: 1,
                op: SendOp::Send,
                payload: Payload::Inline(b"x"),
                signaled: true
            }),
            Err(Error::InvalidState { .. })
        ),
        "post_send in ERR accepted"
    );
    Ok(())
}

fn wait_event<H: Harness>(h: &mut H, want: AsyncEvent) -> CaseResult {
    let mut seen = vec![];
    let ok = wait_until(h, WAIT, |h| {
        while let Some(ev) = h.local().dev.poll_async_event() {
            seen.push(ev);
        }
        seen.contains(&want)
    });
    ensure!(ok, "no {want:?} event; saw {seen:?}");
    Ok(())
}

/// Port down mid-transfer: PortError event, QP to ERR, every posted WR
/// completes; port up: PortActive event.
pub fn port_down_mid_transfer<H: Harness>(h: &mut H) -> CaseResult {
    let r = h.remote().mr;
    let sge = e(h.local().mr.sge(0, 16384), "sge")?;
    let (mut posted, mut done, mut errors) = (0u64, 0u64, 0u64);
    let mut down = false;
    let start = h.clock();
    while h.clock() - start < WAIT * 2 {
        for w in h.local().poll_send() {
            done += 1;
            if w.status != WcStatus::Success {
                errors += 1;
            }
        }
        if !down && done >= 8 {
            e(h.set_local_port(false), "port down")?;
            down = true;
        }
        if h.local()
            .qp
            .post_send(&write_wr(posted, &[sge], r.addr, r.rkey, true))
            .is_ok()
        {
            posted += 1;
        } else if down && done == posted {
            break;
        }
        h.settle();
    }
    ensure!(down, "transfer never got going (done={done})");
    ensure!(done == posted, "{posted} posted but {done} completed");
    ensure!(
        errors > 0 || h.local().qp.state() == QpState::Err,
        "no error after port down"
    );
    wait_event(h, AsyncEvent::PortError { port: 1 })?;
    ensure!(
        h.local().qp.state() == QpState::Err,
        "QP not in ERR after port down"
    );
    ensure!(
        e(h.local().dev.query_port(1), "query_port")?.state == PortState::Down,
        "port not Down"
    );
    e(h.set_local_port(true), "port up")?;
    wait_event(h, AsyncEvent::PortActive { port: 1 })?;
    ensure!(
        e(h.local().dev.query_port(1), "query_port")?.state == PortState::Active,
        "port not Active"
    );
    Ok(())
}

fn survivor_fails<H: Harness>(h: &mut H) -> CaseResult {
    let mut errs = vec![];
    let mut i = 0;
    let ok = wait_until(h, WAIT, |h| {
        let l = h.local();
        errs.extend(
            l.poll_send()
                .into_iter()
                .filter(|w| w.status != WcStatus::Success),
        );
        if i % 64 == 0 {
            let _ = l.qp.post_send(&SendWr {
                wr_id: i,
                op: SendOp::Send,
                payload: Payload::Inline(b"ping"),
                signaled: true,
            });
        }
        i += 1;
        l.qp.state() == QpState::Err
    });
    ensure!(ok, "survivor QP never reached ERR");
    Ok(())
}

/// A peer that dies is detected: the survivor's QP goes to ERR in bounded time.
pub fn peer_death_detected<H: Harness>(h: &mut H) -> CaseResult {
    e(h.peer().kill(), "kill peer")?;
    survivor_fails(h)
}

/// A peer that stops answering is detected likewise.
pub fn peer_hang_detected<H: Harness>(h: &mut H) -> CaseResult {
    e(h.peer().hang(), "hang peer")?;
    survivor_fails(h)
}

/// For a provider that reaches peer memory through per-region resources of
/// its own (`sim` and `shm`; not one of [`cases`]: a real RNIC readies
/// nothing and accepts every [`QueuePair::prepare_remote`]): readying a
/// region a WRITE could reach succeeds, and WRITEs to it then succeed;
/// readying what a WRITE could not reach (an unknown rkey, a region without
/// remote access, a range past its end) fails, and costs nothing else: the
/// QP stays usable.
pub fn prepare_remote_checks<H: Harness>(h: &mut H) -> CaseResult {
    let r = h.remote();
    let l = h.local();
    e(
        l.qp.prepare_remote(r.mr.rkey, r.mr.addr, r.mr.len as usize),
        "ready the region",
    )?;
    ensure!(
        l.qp.prepare_remote(r.mr.rkey ^ 0x00a5_5a00, r.mr.addr, 64)
            .is_err(),
        "an unknown rkey was readied"
    );
    ensure!(
        l.qp.prepare_remote(r.ro_mr.rkey, r.ro_mr.addr, 64).is_err(),
        "a region without remote write access was readied"
    );
    ensure!(
        l.qp.prepare_remote(r.mr.rkey, r.mr.addr + r.mr.len - 32, 64)
            .is_err(),
        "a range past the region's end was readied"
    );
    ensure!(
        l.qp.state() == QpState::Rts,
        "a refused preparation failed the QP"
    );
    let data = pattern(77, 4096);
    e(l.mr.write_at(0, &data), "write_at")?;
    let sge = e(l.mr.sge(0, 4096), "sge")?;
    e(
        l.qp.post_send(&write_wr(5, &[sge], r.mr.addr + 4096, r.mr.rkey, true)),
        "post write",
    )?;
    let wcs = local_send_wcs(h, 1)?;
    ensure!(wcs[0].status == WcStatus::Success, "write {wcs:?}");
    ensure!(
        e(h.peer().read(4096, 4096), "peer read")? == data,
        "written data not visible"
    );
    Ok(())
}

/// A case of the suite.
pub struct Case<H> {
    /// Name (also the generated test's name).
    pub name: &'static str,
    /// Connection parameters.
    pub params: ConnParams,
    /// The body.
    pub run: fn(&mut H) -> CaseResult,
}

/// For a provider that lends memory windows ([`QueuePair::remote_window`],
/// [`MemoryRegion::window`]; `sim` and `shm` do, real RNICs do not, so this
/// is not one of [`cases`]) with an in-process peer: a remote window reaches
/// what a WRITE to the same rkey and address reaches, at once, and nothing a
/// WRITE could not; a region's own window reads what it holds; a window
/// whose region the peer deregistered refuses copies, as a WRITE would; a QP
/// that cannot send lends none.
pub fn memory_windows<H: Harness<Peer = LocalPeer<<H as Harness>::P>>>(h: &mut H) -> CaseResult {
    let r = h.remote().mr;
    let data = pattern(7, 300);
    let win = h.local().qp.remote_window(r.rkey, r.addr + 4096, 4096);
    let win = win.ok_or("no window onto the peer's registered region")?;
    e(win.write_at(100, &data), "window write")?;
    ensure!(
        e(h.peer().read(4096 + 100, 300), "peer read")? == data,
        "the window's copy is not in the peer's region"
    );
    ensure!(
        win.write_at(4000, &data).is_err(),
        "a copy past the window's end"
    );
    let own = h
        .peer()
        .ep
        .mr
        .window()
        .ok_or("the peer's region lends no window")?;
    let mut back = vec![0u8; 300];
    e(own.read_at(4196, &mut back), "own window read")?;
    ensure!(back == data, "the region's own window reads other bytes");
    let l = h.local();
    ensure!(
        l.qp.remote_window(r.rkey ^ 0x5555, r.addr, 64).is_none(),
        "bad rkey lent"
    );
    ensure!(
        l.qp.remote_window(r.rkey, r.addr + r.len - 10, 64)
            .is_none(),
        "a window past the region lent"
    );
    let extra = e(
        h.peer()
            .ep
            .pd
            .alloc_mr(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        "alloc_mr",
    )?;
    let x = extra.remote();
    let late = h.local().qp.remote_window(x.rkey, x.addr, 8192);
    let late = late.ok_or("no window onto a further region")?;
    e(late.write_at(0, &data), "window write")?;
    drop(extra);
    ensure!(
        late.write_at(0, &data).is_err(),
        "a copy into a deregistered region"
    );
    e(h.local().qp.modify(&QpModify::Err), "modify to ERR")?;
    ensure!(
        h.local().qp.remote_window(r.rkey, r.addr, 64).is_none(),
        "a QP in ERR lent a window"
    );
    Ok(())
}

/// All cases.
pub fn cases<H: Harness>() -> Vec<Case<H>> {
    let d = ConnParams::default();
    let finite = ConnParams {
        rnr_retry: 2,
        min_rnr_timer: Duration::from_millis(5),
        ..d
    };
    vec![
        Case {
            name: "qp_state_transitions",
            params: d,
            run: qp_state_transitions::<H>,
        },
        Case {
            name: "write_visibility",
            params: d,
            run: write_visibility::<H>,
        },
        Case {
            name: "send_write_ordering",
            params: d,
            run: send_write_ordering::<H>,
        },
        Case {
            name: "unsignaled_sends_then_a_zero_length_write",
            params: d,
            run: unsignaled_sends_then_a_zero_length_write::<H>,
        },
        Case {
            name: "immediate_data",
            params: d,
            run: immediate_data::<H>,
        },
        Case {
            name: "send_inline_and_sge",
            params: d,
            run: send_inline_and_sge::<H>,
        },
        Case {
            name: "rnr_infinite_retry",
            params: d,
            run: rnr_infinite_retry::<H>,
        },
        Case {
            name: "rnr_retry_exceeded",
            params: finite,
            run: rnr_retry_exceeded::<H>,
        },
        Case {
            name: "invalid_rkey_rejected",
            params: d,
            run: invalid_rkey_rejected::<H>,
        },
        Case {
            name: "out_of_bounds_rejected",
            params: d,
            run: out_of_bounds_rejected::<H>,
        },
        Case {
            name: "no_remote_write_access_rejected",
            params: d,
            run: no_remote_write_access_rejected::<H>,
        },
        Case {
            name: "flush_on_error",
            params: d,
            run: flush_on_error::<H>,
        },
        Case {
            name: "port_down_mid_transfer",
            params: d,
            run: port_down_mid_transfer::<H>,
        },
        Case {
            name: "peer_death_detected",
            params: d,
            run: peer_death_detected::<H>,
        },
        Case {
            name: "peer_hang_detected",
            params: d,
            run: peer_hang_detected::<H>,
        },
    ]
}

/// Runs one named case with a fresh harness from `make`; panics with the
/// failure message so it can back a `#[test]`.
pub fn run_case<H: Harness>(make: impl FnOnce(&ConnParams) -> Result<H>, name: &str) {
    let case = cases::<H>()
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no case {name}"));
    let mut h = match make(&case.params) {
        Ok(h) => h,
        Err(Error::Unsupported(why)) if std::env::var_os("SMC_RDMA_REQUIRE_ALL").is_none() => {
            eprintln!("SKIPPED {name}: {why} (set SMC_RDMA_REQUIRE_ALL=1 to make this a failure)");
            return;
        }
        Err(err) => panic!("{name}: harness setup failed: {err}"),
    };
    if let Err(msg) = (case.run)(&mut h) {
        panic!("{name} failed: {msg}");
    }
}

/// Expands to one `#[test]` per conformance case using the harness
/// constructor `$make: fn(&ConnParams) -> Result<H>`.
#[macro_export]
macro_rules! conformance_suite {
    ($make:path) => {
        $crate::conformance_suite!(@cases $make;
            qp_state_transitions write_visibility send_write_ordering
            unsignaled_sends_then_a_zero_length_write immediate_data send_inline_and_sge rnr_infinite_retry rnr_retry_exceeded invalid_rkey_rejected
            out_of_bounds_rejected no_remote_write_access_rejected flush_on_error
            port_down_mid_transfer peer_death_detected peer_hang_detected);
    };
    (@cases $make:path; $($name:ident)*) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::run_case($make, stringify!($name));
            }
        )*
    };
}
