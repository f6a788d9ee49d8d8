//! The process-wide SMC state: the shared-memory provider, one endpoint per
//! device, and device selection for a connection (`tools.md` §6).

use smc_config::pnet::{base_netdev, select_port, PnetTable, PortInfo};
use smc_config::store::{ConfigDir, Table};
use smc_config::ueid::UeidTable;
use smc_engine::endpoint::{Endpoint, EndpointConfig};
use smc_proto::negotiate::IfAddr;
use smc_proto::Timestamp;
use smc_rdma::shm::ShmProvider;
use smc_rdma::{PortState, Provider};
use smc_wire::types::{Mac, SystemId};
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// What this process's SMC endpoints hold right now (the library's state API;
/// `smcss` / `smcr linkgroup` will be built on it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// The device.
    pub device: String,
    /// Live link groups (each a QP to one peer, in one role).
    pub link_groups: usize,
    /// Live SMC connections (handshaking, established or closing).
    pub connections: usize,
}

/// One entry per device this process has used for SMC.
pub fn state() -> Vec<DeviceState> {
    let eps = context()
        .endpoints
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<DeviceState> = eps
        .iter()
        .map(|(name, s)| {
            let ep = s.lock();
            DeviceState {
                device: name.clone(),
                link_groups: ep.link_groups(),
                connections: ep.connections(),
            }
        })
        .collect();
    v.sort_by(|a, b| a.device.cmp(&b.device));
    v
}

/// An endpoint on one device, shared by every connection through it.
pub(crate) struct Shared {
    ep: Mutex<Endpoint<ShmProvider>>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Endpoint<ShmProvider>> {
        self.ep.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Context {
    provider: Option<ShmProvider>,
    endpoints: Mutex<HashMap<String, Arc<Shared>>>,
}

fn origin() -> Instant {
    static O: OnceLock<Instant> = OnceLock::new();
    *O.get_or_init(Instant::now)
}

/// The engine's clock: time since the first use in this process.
pub(crate) fn now() -> Timestamp {
    origin().elapsed()
}

fn context() -> &'static Context {
    static C: OnceLock<Context> = OnceLock::new();
    C.get_or_init(|| Context {
        // Devices are declared in the file named by SMC_RDMA_SHM_CONFIG; without
        // it this process has no SMC device and its connections decline.
        provider: ShmProvider::from_env().ok(),
        endpoints: Mutex::new(HashMap::new()),
    })
}

fn random_instance() -> u16 {
    // The instance part of the system id only has to differ between processes.
    let t = origin().elapsed().as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(17);
    (t ^ (t >> 16) ^ (t >> 32)) as u16
}

/// The interface that owns `local`, or whose prefix covers it (all of
/// 127.0.0.0/8 is lo's, though only 127.0.0.1 is configured), with all of that
/// interface's addresses: what the CLC prefix rules compare.
pub(crate) fn interface_of(local: IpAddr) -> Option<(String, Vec<IfAddr>)> {
    let addrs = smc_rdma::sys::interface_addrs().ok()?;
    let local = match local {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(local, IpAddr::V4),
        v4 => v4,
    };
    let covers = |a: &smc_rdma::sys::InterfaceAddr| match (a.addr, local) {
        (IpAddr::V4(n), IpAddr::V4(l)) => {
            let m = u32::MAX
                .checked_shl(32 - u32::from(a.prefix_len.min(32)))
                .unwrap_or(0);
            u32::from(n) & m == u32::from(l) & m
        }
        (IpAddr::V6(n), IpAddr::V6(l)) => {
            let m = u128::MAX
                .checked_shl(128 - u32::from(a.prefix_len.min(128)))
                .unwrap_or(0);
            u128::from(n) & m == u128::from(l) & m
        }
        _ => false,
    };
    let ifname = addrs
        .iter()
        .find(|a| a.addr == local)
        .or_else(|| addrs.iter().find(|a| covers(a)))?
        .ifname
        .clone();
    let if_addrs = addrs
        .iter()
        .filter(|a| a.ifname == ifname)
        .map(|a| IfAddr {
            addr: a.addr,
            prefix_len: a.prefix_len,
        })
        .collect();
    Some((ifname, if_addrs))
}

/// The endpoint for a connection whose local address is `local`, or `None`
/// when no SMC device serves that address's interface (the connection then
/// declines with "no SMC device").
pub(crate) fn endpoint_for(local: IpAddr) -> Option<Arc<Shared>> {
    let ctx = context();
    let provider = ctx.provider.as_ref()?;
    let (ifname, if_addrs) = interface_of(local)?;
    let base = base_netdev(Path::new("/sys/class/net"), &ifname);
    let dir = ConfigDir::from_env();
    let pnet = PnetTable::load(&dir).unwrap_or_default();
    let ports: Vec<PortInfo> = provider
        .devices()
        .ok()?
        .into_iter()
        .flat_map(|d| {
            d.ports.into_iter().map(move |p| PortInfo {
                device: d.name.clone(),
                port: p.port_num,
                netdev: p.netdev.clone(),
                active: p.state == PortState::Active,
            })
        })
        .collect();
    let sel = select_port(&pnet, &base, &ports)?;
    let (device, _port) = sel.port();
    let mut eps = ctx.endpoints.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = eps.get(device) {
        return Some(s.clone());
    }
    let ueids = UeidTable::load(&dir)
        .map(|t| t.eids().to_vec())
        .unwrap_or_default();
    // (from our network namespace: /sys/class/net may belong to another one)
    let mac = smc_rdma::sys::link(&base)
        .ok()
        .flatten()
        .and_then(|l| l.mac)
        .map(Mac)
        .unwrap_or_default();
    let cfg = EndpointConfig {
        system_id: SystemId::new(random_instance(), mac),
        device: device.to_string(),
        offer_v2: !ueids.is_empty(),
        ueids,
        offer_v1: true,
        if_addrs,
        rmb_len: 65536,
        sndbuf_len: 65536,
        testlink: Some(Duration::from_secs(30)),
        max_conns: 255,
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        lgr_idle_timeout: Duration::from_secs(600),
    };
    let ep = Endpoint::new(provider, cfg).ok()?;
    let shared = Arc::new(Shared { ep: Mutex::new(ep) });
    // Control traffic nobody waits for (LLC requests, keepalives, the final CDCs
    // of released connections) is handled by a small progress thread; data moves
    // in the application's threads.
    let weak = Arc::downgrade(&shared);
    std::thread::Builder::new()
        .name(format!("smc-progress-{device}"))
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(1));
            let Some(s) = weak.upgrade() else { return };
            let _ = s.lock().pump(now());
        })
        .ok()?;
    eps.insert(device.to_string(), shared.clone());
    Some(shared)
}
