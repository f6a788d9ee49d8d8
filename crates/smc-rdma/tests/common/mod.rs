//! Shared helpers of the `shm` integration tests: veth pairs, network
//! namespaces, rundirs and the two harnesses (in-process, peer process).
#![allow(dead_code)]

use smc_rdma::conformance::*;
use smc_rdma::shm::{ShmConfig, ShmDeviceConfig, ShmProvider};
use smc_rdma::*;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static N: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        return Err(Error::Config(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Needs root (veth, netns): returns Unsupported with a clear reason otherwise.
/// Whether a setup error is a skip ("needs root", ...): it is, unless
/// `SMC_RDMA_REQUIRE_ALL` makes skips failures (CI).
#[allow(dead_code)] // not every test binary uses it
pub fn skip(e: &Error) -> bool {
    if let Error::Unsupported(why) = e {
        if std::env::var_os("SMC_RDMA_REQUIRE_ALL").is_none() {
            eprintln!("SKIPPED: {why}");
            return true;
        }
    }
    false
}

/// The value of a setup step, or return from the test if it is a skip
/// (see [`skip`]); any other error fails the test.
#[allow(unused_macros)] // not every test binary uses it
macro_rules! setup {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) if common::skip(&e) => return,
            Err(e) => panic!("setup: {e}"),
        }
    };
}

pub fn need_root() -> Result<()> {
    if !smc_rdma::sys::is_root() {
        return Err(Error::Unsupported(
            "needs root to create veth pairs / network namespaces",
        ));
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Err(Error::Unsupported("needs the `ip` tool (iproute2)"));
    }
    Ok(())
}

/// A veth pair `a`/`b`; `b` optionally inside a fresh network namespace.
pub struct Veth {
    pub a: String,
    pub b: String,
    pub ns: Option<String>,
}

impl Veth {
    pub fn new(netns: bool) -> Result<Veth> {
        need_root()?;
        let n = N.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}x{n}", std::process::id() % 100_000);
        let v = Veth {
            a: format!("sa{tag}"),
            b: format!("sb{tag}"),
            ns: netns.then(|| format!("smcns{tag}")),
        };
        ip(&["link", "add", &v.a, "type", "veth", "peer", "name", &v.b])?;
        ip(&["link", "set", &v.a, "up"])?;
        if let Some(ns) = &v.ns {
            ip(&["netns", "add", ns])?;
            ip(&["link", "set", &v.b, "netns", ns])?;
            ip(&["-n", ns, "link", "set", &v.b, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            // A documentation-range address inside the private namespace only.
            ip(&["-n", ns, "addr", "add", "192.0.2.2/24", "dev", &v.b])?;
        } else {
            ip(&["link", "set", &v.b, "up"])?;
        }
        let t = Instant::now();
        while std::fs::read_to_string(format!("/sys/class/net/{}/operstate", v.a))
            .unwrap_or_default()
            .trim()
            != "up"
        {
            if t.elapsed() > Duration::from_secs(5) {
                return Err(Error::Config(format!("{} did not come up", v.a)));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(v)
    }
    pub fn set_a(&self, up: bool) -> Result<()> {
        ip(&["link", "set", &self.a, if up { "up" } else { "down" }])
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.a]);
        if let Some(ns) = &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

pub fn rundir() -> PathBuf {
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("smc-rdma-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create rundir");
    d
}

pub fn config(veth: &Veth, rundir: &std::path::Path) -> ShmConfig {
    config_with(veth, rundir, Duration::from_millis(500))
}

pub fn config_with(veth: &Veth, rundir: &std::path::Path, peer_timeout: Duration) -> ShmConfig {
    ShmConfig {
        devices: vec![
            ShmDeviceConfig {
                name: "shmA".into(),
                netdev: veth.a.clone(),
            },
            ShmDeviceConfig {
                name: "shmB".into(),
                netdev: veth.b.clone(),
            },
        ],
        rundir: rundir.to_path_buf(),
        peer_timeout,
        poll_interval: Duration::from_millis(10),
    }
}

/// Both sides in this process, on the two ends of a veth pair.
pub struct InProc {
    pub local: Endpoint<ShmProvider>,
    pub peer: LocalPeer<ShmProvider>,
    pub remote: EndpointInfo,
    pub start: Instant,
    pub veth: Veth,
    pub rundir: PathBuf,
}

pub fn make_inproc(params: &ConnParams) -> Result<InProc> {
    make_inproc_with(params, Duration::from_millis(500))
}

/// [`make_inproc`] with another heartbeat silence for a dead peer.
pub fn make_inproc_with(params: &ConnParams, peer_timeout: Duration) -> Result<InProc> {
    let veth = Veth::new(false)?;
    let rundir = rundir();
    let p = ShmProvider::new(config_with(&veth, &rundir, peer_timeout));
    let local = Endpoint::open(&p, "shmA", *params)?;
    let mut peer = LocalPeer::new(Endpoint::open(&p, "shmB", *params)?);
    let remote = peer.ep.info();
    local.connect(&remote)?;
    peer.ep.connect(&local.info())?;
    peer.on_kill = Some(Box::new(|ep| {
        ep.dev.simulate_crash();
        Ok(())
    }));
    peer.on_hang = Some(Box::new(|ep| {
        ep.dev.freeze();
        Ok(())
    }));
    Ok(InProc {
        local,
        peer,
        remote,
        start: Instant::now(),
        veth,
        rundir,
    })
}

impl Drop for InProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.rundir);
    }
}

impl Harness for InProc {
    type P = ShmProvider;
    type Peer = LocalPeer<ShmProvider>;
    fn local(&self) -> &Endpoint<ShmProvider> {
        &self.local
    }
    fn peer(&mut self) -> &mut LocalPeer<ShmProvider> {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.remote
    }
    fn settle(&mut self) {
        self.peer.pump();
        std::thread::sleep(Duration::from_micros(200));
    }
    fn clock(&self) -> Duration {
        self.start.elapsed()
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        self.veth.set_a(up)
    }
}

/// Where the passive side's process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In our network namespace.
    Here,
    /// In the veth's namespace, entered with `ip netns exec`, which also
    /// mounts a sysfs of that namespace on /sys (in a private mount namespace).
    NetnsExec,
    /// In the veth's namespace, entered with `nsenter --net` (setns only): the
    /// process keeps our mounts, so /sys/class/net shows *our* interfaces and
    /// not its own. What a program sees after a bare setns(CLONE_NEWNET).
    NetnsSetns,
}

/// The passive side in a separate process (optionally in another netns).
pub struct Proc {
    pub local: Endpoint<ShmProvider>,
    pub peer: ProcPeer,
    pub start: Instant,
    pub rundir: PathBuf,
    // Dropped last: the child must be gone before the veth/netns are removed.
    pub veth: Veth,
}

pub fn make_proc(params: &ConnParams, place: Place) -> Result<Proc> {
    if place == Place::NetnsSetns && Command::new("nsenter").arg("-V").output().is_err() {
        return Err(Error::Unsupported("needs the `nsenter` tool (util-linux)"));
    }
    let veth = Veth::new(place != Place::Here)?;
    let rundir = rundir();
    let cfg = config(&veth, &rundir);
    let cfg_path = rundir.join("shm.conf");
    std::fs::write(&cfg_path, cfg.to_text())?;
    let p = ShmProvider::new(cfg);
    let local = Endpoint::open(&p, "shmA", *params)?;
    let exe = env!("CARGO_BIN_EXE_smc-rdma-peer");
    let mut cmd = match (&veth.ns, place) {
        (Some(ns), Place::NetnsExec) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, exe]);
            c
        }
        (Some(ns), Place::NetnsSetns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{ns}")).arg(exe);
            c
        }
        _ => Command::new(exe),
    };
    cmd.arg("suite")
        .arg(&cfg_path)
        .arg("shmB")
        .args(params.to_args().split_whitespace());
    let mut peer = ProcPeer::spawn(cmd)?;
    let info = local.info();
    peer.cmd(&format!("connect {}", info.to_line()))?;
    let remote = peer.info;
    local.connect(&remote)?;
    Ok(Proc {
        local,
        peer,
        start: Instant::now(),
        rundir,
        veth,
    })
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.peer.child.kill();
        let _ = self.peer.child.wait();
        let _ = std::fs::remove_dir_all(&self.rundir);
    }
}

impl Harness for Proc {
    type P = ShmProvider;
    type Peer = ProcPeer;
    fn local(&self) -> &Endpoint<ShmProvider> {
        &self.local
    }
    fn peer(&mut self) -> &mut ProcPeer {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.peer.info
    }
    fn settle(&mut self) {
        std::thread::sleep(Duration::from_micros(200));
    }
    fn clock(&self) -> Duration {
        self.start.elapsed()
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        self.veth.set_a(up)
    }
}

// ---------------------------------------------------------------- shared interface (`lo`)

/// One device `shm0` bound to `lo`: every opening of it (in this process or
/// another) has the same GIDs, as processes sharing one RNIC port.
pub fn lo_config(rundir: &std::path::Path) -> ShmConfig {
    ShmConfig {
        devices: vec![ShmDeviceConfig {
            name: "shm0".into(),
            netdev: "lo".into(),
        }],
        rundir: rundir.to_path_buf(),
        peer_timeout: Duration::from_millis(500),
        poll_interval: Duration::from_millis(10),
    }
}

/// `lo` must be up (it is in every normal namespace); no root needed.
pub fn need_lo() -> Result<()> {
    if smc_rdma::shm::gid_table("lo").is_empty() {
        return Err(Error::Unsupported(
            "needs a loopback interface with addresses",
        ));
    }
    Ok(())
}

/// Both sides in this process: two instances of the same device on `lo`,
/// so both sides have the same GID and differ only by QP number.
pub struct LoInProc {
    pub local: Endpoint<ShmProvider>,
    pub peer: LocalPeer<ShmProvider>,
    pub remote: EndpointInfo,
    pub start: Instant,
    /// A third instance on `lo`, opened last, that must never be reached.
    pub decoy: smc_rdma::shm::ShmDevice,
    pub rundir: PathBuf,
}

pub fn make_lo_inproc(params: &ConnParams) -> Result<LoInProc> {
    need_lo()?;
    let rundir = rundir();
    let p = ShmProvider::new(lo_config(&rundir));
    let local = Endpoint::open(&p, "shm0", *params)?;
    let mut peer = LocalPeer::new(Endpoint::open(&p, "shm0", *params)?);
    let decoy = p.open_device("shm0")?;
    let remote = peer.ep.info();
    if remote.gid != local.info().gid || remote.qp_num == local.qp.qp_num() {
        return Err(Error::Config(format!(
            "expected the same GID and different QP numbers: {:?} vs {:?}",
            remote,
            local.info()
        )));
    }
    local.connect(&remote)?;
    peer.ep.connect(&local.info())?;
    peer.on_kill = Some(Box::new(|ep| {
        ep.dev.simulate_crash();
        Ok(())
    }));
    peer.on_hang = Some(Box::new(|ep| {
        ep.dev.freeze();
        Ok(())
    }));
    Ok(LoInProc {
        local,
        peer,
        remote,
        start: Instant::now(),
        decoy,
        rundir,
    })
}

impl Drop for LoInProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.rundir);
    }
}

impl Harness for LoInProc {
    type P = ShmProvider;
    type Peer = LocalPeer<ShmProvider>;
    fn local(&self) -> &Endpoint<ShmProvider> {
        &self.local
    }
    fn peer(&mut self) -> &mut LocalPeer<ShmProvider> {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.remote
    }
    fn settle(&mut self) {
        self.peer.pump();
        std::thread::sleep(Duration::from_micros(200));
    }
    fn clock(&self) -> Duration {
        self.start.elapsed()
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        // `lo` of the host must not really go down: use the device's hook.
        self.local.dev.force_port_down(!up);
        Ok(())
    }
}

/// Spawns `smc-rdma-peer ARGS...` with the config file of `rundir`.
pub fn peer_cmd(cfg_path: &std::path::Path, mode: &str, dev: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smc-rdma-peer"));
    c.arg(mode).arg(cfg_path).arg(dev);
    c
}

/// The passive side in a separate process, both processes on `lo`.
pub struct LoProc {
    pub local: Endpoint<ShmProvider>,
    pub peer: ProcPeer,
    pub start: Instant,
    pub rundir: PathBuf,
    pub cfg_path: PathBuf,
}

/// Starts a `suite` peer process on `lo` in `rundir` (config written there).
pub fn spawn_lo_peer(rundir: &std::path::Path, params: &ConnParams) -> Result<(ProcPeer, PathBuf)> {
    let cfg_path = rundir.join("shm.conf");
    std::fs::write(&cfg_path, lo_config(rundir).to_text())?;
    let mut cmd = peer_cmd(&cfg_path, "suite", "shm0");
    cmd.args(params.to_args().split_whitespace());
    Ok((ProcPeer::spawn(cmd)?, cfg_path))
}

pub fn make_lo_proc(params: &ConnParams) -> Result<LoProc> {
    need_lo()?;
    let rundir = rundir();
    let (mut peer, cfg_path) = spawn_lo_peer(&rundir, params)?;
    let p = ShmProvider::new(lo_config(&rundir));
    let local = Endpoint::open(&p, "shm0", *params)?;
    peer.cmd(&format!("connect {}", local.info().to_line()))?;
    let remote = peer.info;
    if remote.gid != local.info().gid {
        return Err(Error::Config("peer on lo has a different GID".into()));
    }
    local.connect(&remote)?;
    Ok(LoProc {
        local,
        peer,
        start: Instant::now(),
        rundir,
        cfg_path,
    })
}

impl Drop for LoProc {
    fn drop(&mut self) {
        let _ = self.peer.child.kill();
        let _ = self.peer.child.wait();
        let _ = std::fs::remove_dir_all(&self.rundir);
    }
}

impl Harness for LoProc {
    type P = ShmProvider;
    type Peer = ProcPeer;
    fn local(&self) -> &Endpoint<ShmProvider> {
        &self.local
    }
    fn peer(&mut self) -> &mut ProcPeer {
        &mut self.peer
    }
    fn remote(&self) -> EndpointInfo {
        self.peer.info
    }
    fn settle(&mut self) {
        std::thread::sleep(Duration::from_micros(200));
    }
    fn clock(&self) -> Duration {
        self.start.elapsed()
    }
    fn set_local_port(&mut self, up: bool) -> Result<()> {
        self.local.dev.force_port_down(!up);
        Ok(())
    }
}
