//! Device selection for a connection (`tools.md` §6): the interface of the
//! connection's local address, through the PNET table or the port's own
//! interface (or its RoCE v2 GID) to a device port, as Linux chooses
//! (smc_pnet.c `smc_pnet_find_roce_resource`), except that a shared-memory
//! device serves only peers on this host (see [`pick`] and [`shm_reaches`]).

use super::bufs::{rmb_crowding, rmb_len, sndbuf_len};
use super::{context, progress_loop, Context, Shared};
use crate::provider::Kind;
use smc_config::pnet::{base_netdev, candidates, PnetTable, PortInfo, Route};
use smc_config::store::{ConfigDir, Table};
use smc_config::ueid::UeidTable;
use smc_engine::endpoint::{Endpoint, EndpointConfig};
use smc_proto::negotiate::IfAddr;
use smc_rdma::{GidType, PortState};
use smc_wire::types::{Mac, SystemId};
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The interface that owns `local`, or whose prefix covers it (all of
/// 127.0.0.0/8 is lo's, though only 127.0.0.1 is configured), with all of that
/// interface's addresses: what the CLC prefix rules compare.
/// `Err`: the interface list could not be read (out of descriptors or
/// memory).
#[allow(clippy::type_complexity)]
pub(crate) fn interface_of(local: IpAddr) -> io::Result<Option<(String, Vec<IfAddr>)>> {
    let addrs = smc_rdma::sys::interface_addrs()?;
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
    let Some(found) = addrs
        .iter()
        .find(|a| a.addr == local)
        .or_else(|| addrs.iter().find(|a| covers(a)))
    else {
        return Ok(None);
    };
    let ifname = found.ifname.clone();
    let if_addrs = addrs
        .iter()
        .filter(|a| a.ifname == ifname)
        .map(|a| IfAddr {
            addr: a.addr,
            prefix_len: a.prefix_len,
        })
        .collect();
    Ok(Some((ifname, if_addrs)))
}

/// The device for a connection, as [`endpoint_for`] found it.
pub(crate) enum Device {
    /// The endpoint of the device serving the connection's interface.
    Endpoint(Arc<Shared>),
    /// (Server) Only a shared-memory device serves the connection, and the
    /// client's address is not one of our network namespace: the device
    /// serves it only if the client turns out to be on this host. Ask
    /// [`shm_reaches`] once the client's first CLC bytes are there (it
    /// opened its device before sending them), before the handshake starts
    /// on the endpoint; if not, decline as without a device.
    IfOnHost(Arc<Shared>),
    /// No SMC device serves it: decline "no SMC device" (or what the prefix
    /// rules say).
    None,
    /// The selection could not be made now (out of descriptors or memory,
    /// the device failed to open): decline with "insufficient resources"
    /// (Linux's SMC_CLC_DECL_MEM), and look again for the next connection.
    Unavailable,
}

/// Which end of the connection asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// The connecting side: it must decide before its Proposal.
    Client,
    /// The accepting side: it may wait for the client's first bytes.
    Server,
}

/// A device port that may serve connections from one local address
/// ([`smc_config::pnet::candidates`]), with its provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) device: String,
    pub(crate) kind: Kind,
    /// The port has a RoCE v1 GID (SMC-R v1 may be offered).
    pub(crate) roce_v1: bool,
    /// The port has a RoCE v2 GID (SMC-R v2 may be offered).
    pub(crate) roce_v2: bool,
}

/// The candidates for one local address, in the kernel's order, and what an
/// endpoint opened for one of them is configured with.
pub(super) struct Choice {
    candidates: Vec<Candidate>,
    /// (kind, candidate, alternate): the devices that may carry a v2 group's
    /// further link when the group's first is on the candidate's.
    v2_alternates: Vec<(Kind, String, String)>,
    base: String,
    if_addrs: Vec<IfAddr>,
    ueids: Vec<smc_wire::types::Eid>,
}

/// Which candidate a connection uses (see [`pick`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pick<'a> {
    /// This one.
    Use(&'a Candidate),
    /// This shared-memory device, if the peer is on this host after all
    /// (see [`shm_reaches`]).
    IfOnHost(&'a Candidate),
    /// None.
    Nothing,
}

/// Chooses among the candidates of a connection's local address. The kernel
/// takes the first (smc_pnet.c `smc_pnet_find_roce_by_pnetid`); a
/// shared-memory device, though, serves only peers on this host (it is
/// reached through the rundir, never through the wire), so when the peer's
/// address is not one of our network namespace the first device of another
/// provider is taken, and a shared-memory device only once the peer is
/// known to be on this host.
pub(crate) fn pick(candidates: &[Candidate], peer_in_namespace: bool) -> Pick<'_> {
    if peer_in_namespace {
        return candidates.first().map_or(Pick::Nothing, Pick::Use);
    }
    if let Some(c) = candidates.iter().find(|c| c.kind != Kind::Shm) {
        return Pick::Use(c);
    }
    candidates.first().map_or(Pick::Nothing, Pick::IfOnHost)
}

/// The endpoint for a connection from `local` to `peer` (see [`Device`]).
pub(crate) fn endpoint_for(local: IpAddr, peer: IpAddr, role: Role) -> Device {
    let Some(ctx) = context() else {
        return Device::None;
    };
    let Ok(choice) = choice_for(ctx, local) else {
        return Device::Unavailable;
    };
    let Some(choice) = choice else {
        return Device::None;
    };
    let Ok(peer_here) = in_namespace(ctx, peer) else {
        return Device::Unavailable;
    };
    let (cand, if_on_host) = match pick(&choice.candidates, peer_here) {
        Pick::Use(c) => (c, false),
        Pick::IfOnHost(c) => (c, true),
        Pick::Nothing => return Device::None,
    };
    // A client decides now: its Proposal would name the device. (The
    // server's endpoint is open by now if it listens on this host: a
    // listener opens its shared-memory devices when it is bound.)
    if if_on_host && role == Role::Client && !shm_reaches(peer) {
        return Device::None;
    }
    match endpoint_of(ctx, &choice, cand) {
        Ok(s) if if_on_host && role == Role::Server => Device::IfOnHost(s),
        Ok(s) => Device::Endpoint(s),
        Err(()) => Device::Unavailable,
    }
}

/// Opens the shared-memory devices that serve connections to `addr` (every
/// address of our network namespace if it is unspecified), for a listener
/// bound there: a device registers the GIDs of its interface in the rundir
/// when it is opened, and a client in another network namespace of this
/// host proposes over its own shared-memory device only once the server's
/// address is registered there (see [`shm_reaches`]), which without this
/// would wait for the listener's first connection. Failures are left for
/// the connections to meet.
pub(crate) fn open_devices_for_listener(addr: IpAddr) {
    let Some(ctx) = context() else {
        return;
    };
    let locals: Vec<IpAddr> = if addr.is_unspecified() {
        let Ok(all) = smc_rdma::sys::interface_addrs() else {
            return;
        };
        let mut seen = std::collections::HashSet::new();
        all.into_iter()
            .filter(|a| seen.insert(a.ifname.clone()))
            .map(|a| a.addr)
            .collect()
    } else {
        vec![addr]
    };
    for local in locals {
        if let Ok(Some(choice)) = choice_for(ctx, local) {
            for c in choice.candidates.iter().filter(|c| c.kind == Kind::Shm) {
                let _ = endpoint_of(ctx, &choice, c);
            }
        }
    }
}

/// How long a device choice for a local address, and the list of this
/// namespace's addresses, are reused.
const SELECTION_TTL: Duration = Duration::from_secs(1);

/// The candidates for `local`, kept for [`SELECTION_TTL`]: device selection
/// reads the pnet and UEID tables, the interface list (netlink) and the
/// ports, and a connection-per-request client would redo that for every
/// connection (a changed table or port state takes effect within that
/// second). `Ok(None)`: no device serves `local`; `Err`: it could not be
/// found out now (not kept: the next connection looks again).
fn choice_for(ctx: &Context, local: IpAddr) -> Result<Option<Arc<Choice>>, ()> {
    let mut cache = ctx.selection.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, choice)) = cache.get(&local) {
        if at.elapsed() < SELECTION_TTL {
            return Ok(choice.clone());
        }
    }
    let choice = find_candidates(ctx, local)?.map(Arc::new);
    cache.insert(local, (Instant::now(), choice.clone()));
    Ok(choice)
}

fn find_candidates(ctx: &Context, local: IpAddr) -> Result<Option<Choice>, ()> {
    let Some((ifname, if_addrs)) = interface_of(local)
        .map_err(|e| crate::registry::error("interfaces", format!("interface list: {e}")))?
    else {
        return Ok(None);
    };
    let devices = ctx
        .provider
        .devices_by_kind()
        .map_err(|e| crate::registry::error("devices", format!("device list: {e}")))?;
    if devices.is_empty() {
        return Ok(None);
    }
    let base = base_netdev(Path::new("/sys/class/net"), &ifname);
    let dir = ConfigDir::from_env();
    let pnet = PnetTable::load(&dir).unwrap_or_default();
    let ueids = UeidTable::load(&dir)
        .map(|t| t.eids().to_vec())
        .unwrap_or_default();
    let local4 = match local {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    };
    let route = Route {
        base_netdev: &base,
        // SMC-R v2 needs a UEID, and Linux 6.12 offers it over IPv4 only
        // (af_smc.c `smc_find_proposal_devices`)
        v2_gid: local4
            .filter(|_| !ueids.is_empty())
            .map(smc_wire::types::Gid::from_ipv4),
    };
    let ports: Vec<(Kind, PortInfo)> = devices
        .into_iter()
        .flat_map(|(kind, d)| {
            // The engine drives port 1 of its device (RoCE RNICs show each
            // port as a device of its own: mlx5_0, mlx5_1): other ports are
            // no candidates.
            d.ports
                .into_iter()
                .filter(|p| p.port_num == 1)
                .map(move |p| {
                    let v2 = |g: &&smc_rdma::GidEntry| g.gid_type == GidType::RoceV2;
                    (
                        kind,
                        PortInfo {
                            device: d.name.clone(),
                            port: p.port_num,
                            netdev: p.netdev.clone(),
                            active: p.state == PortState::Active,
                            roce_v1: p.gids.iter().any(|g| g.gid_type == GidType::RoceV1),
                            roce_v2: p.gids.iter().filter(v2).map(|g| g.gid).collect(),
                        },
                    )
                })
        })
        .collect();
    let infos: Vec<PortInfo> = ports.iter().map(|(_, p)| p.clone()).collect();
    let candidates: Vec<Candidate> = candidates(&pnet, &route, &infos)
        .iter()
        .filter_map(|sel| {
            let (device, port) = sel.port();
            ports
                .iter()
                .find(|(_, p)| p.device == device && p.port == port)
        })
        .map(|(kind, p)| Candidate {
            device: p.device.clone(),
            kind: *kind,
            roce_v1: p.roce_v1,
            roce_v2: !p.roce_v2.is_empty(),
        })
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    // each candidate's alternate devices for a v2 group (another device on
    // the group's subnet, see `smc_config::pnet::v2_alternates`)
    let prefix = local4.and_then(|l| {
        if_addrs
            .iter()
            .find(|a| a.addr == IpAddr::V4(l))
            .map(|a| (l, a.prefix_len))
    });
    let mut v2_alternates = Vec::new();
    for c in candidates.iter().filter(|c| c.roce_v2) {
        let Some((l, len)) = prefix.filter(|_| route.v2_gid.is_some()) else {
            break;
        };
        for (d, _) in smc_config::pnet::v2_alternates(&pnet, (&c.device, 1), l, len, &infos) {
            if let Some((k, _)) = ports.iter().find(|(k, p)| *k == c.kind && p.device == d) {
                v2_alternates.push((*k, c.device.clone(), d));
            }
        }
    }
    Ok(Some(Choice {
        candidates,
        v2_alternates,
        base,
        if_addrs,
        ueids,
    }))
}

/// Whether link groups add a second link by ADD_LINK (`SMC_REDUNDANCY=1`;
/// off by default): an endpoint then opens the next device of its
/// address's candidates (another port of the same PNET ID), or for SMC-R
/// v2 another device on the address's subnet, as its second device, on
/// which the further link goes (see `Endpoint::set_redundancy`,
/// `Endpoint::open_second_device`).
pub fn redundancy() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMC_REDUNDANCY").is_ok_and(|v| v.trim() == "1"))
}

/// The endpoint of `cand`'s device, opened now if this process has none yet.
fn endpoint_of(ctx: &Context, choice: &Choice, cand: &Candidate) -> Result<Arc<Shared>, ()> {
    let device = cand.device.as_str();
    let mut eps = ctx.endpoints.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = eps.get(device) {
        return Ok(s.clone());
    }
    // (from our network namespace: /sys/class/net may belong to another one)
    let mac = smc_rdma::sys::link(&choice.base)
        .ok()
        .flatten()
        .and_then(|l| l.mac)
        .map(Mac)
        .unwrap_or_default();
    let cfg = EndpointConfig {
        system_id: SystemId::new(ctx.instance, mac),
        device: device.to_string(),
        // SMC-R v1 needs a RoCE v1 GID, v2 a RoCE v2 GID and a UEID
        // (smc_pnet.c `smc_pnet_determine_gid`, af_smc.c
        // `smc_find_proposal_devices`)
        offer_v2: !choice.ueids.is_empty() && cand.roce_v2,
        ueids: choice.ueids.clone(),
        offer_v1: cand.roce_v1,
        if_addrs: choice.if_addrs.clone(),
        rmb_len: rmb_len(),
        rmb_crowding: rmb_crowding(),
        sndbuf_len: sndbuf_len(),
        testlink: Some(Duration::from_secs(30)),
        max_conns: 255,
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        lgr_idle_timeout: Duration::from_secs(600),
    };
    let mut ep = Endpoint::new(&ctx.provider, cfg)
        .map_err(|e| crate::registry::error("endpoint_open", format!("device {device}: {e}")))?;
    if redundancy() {
        // The alternate device: the next candidate of the same provider for
        // this address, i.e. another port in the interface's PNET ID (Linux
        // smc_llc.c `smc_llc_find_alt_link`, smc_pnet.c: an alternate
        // device of the link group's PNET ID). Without one, further links
        // share this device's port.
        // Or, for SMC-R v2 groups, a device on the group's IP subnet (Linux
        // smc_ib.c `smc_ib_determine_gid_rcu`: a v2 group's alternate GID
        // must be on the subnet of its source address).
        let alt = choice
            .candidates
            .iter()
            .find(|c| c.kind == cand.kind && c.device != cand.device)
            .map(|c| c.device.as_str())
            .or_else(|| {
                choice
                    .v2_alternates
                    .iter()
                    .find(|(k, first, _)| *k == cand.kind && *first == cand.device)
                    .map(|(_, _, alt)| alt.as_str())
            });
        let alternate = alt.is_some_and(|alt| match ep.open_second_device(&ctx.provider, alt) {
            Ok(()) => true,
            Err(e) => {
                crate::registry::error(
                    "endpoint_open",
                    format!("second device {alt} of {device}: {e}"),
                );
                false
            }
        });
        ep.set_redundancy(smc_proto::link::Redundancy {
            enabled: true,
            alternate,
        });
    }
    // QPs of added links connect on threads of their own, not under the
    // endpoint's lock (`Shared::start_bringups`)
    ep.set_hand_out_bringups(true);
    let shared =
        Arc::new(Shared::new(ep).map_err(|e| {
            crate::registry::error("endpoint_open", format!("device {device}: {e}"))
        })?);
    let _ = shared.me.set(Arc::downgrade(&shared));
    // Control traffic nobody waits for (LLC requests, keepalives, the final CDCs
    // of released connections) is handled by a small progress thread; data moves
    // in the application's threads.
    let weak = Arc::downgrade(&shared);
    std::thread::Builder::new()
        .name(format!("smc-progress-{device}"))
        .spawn(move || progress_loop(weak))
        .map_err(|e| {
            crate::registry::error("thread_start", format!("progress thread of {device}: {e}"))
        })?;
    eps.insert(device.to_string(), shared.clone());
    Ok(shared)
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn unmapped(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether `addr` is an address of our network namespace: a loopback
/// address, or one assigned to one of its interfaces (read at most every
/// [`SELECTION_TTL`]). `Err`: the interface list could not be read.
pub(super) fn in_namespace(ctx: &Context, addr: IpAddr) -> Result<bool, ()> {
    let addr = unmapped(addr);
    if addr.is_loopback() {
        return Ok(true);
    }
    let mut cache = ctx.addrs.lock().unwrap_or_else(|e| e.into_inner());
    let list = match &*cache {
        Some((at, list)) if at.elapsed() < SELECTION_TTL => list.clone(),
        _ => {
            let list: Arc<Vec<IpAddr>> = Arc::new(
                smc_rdma::sys::interface_addrs()
                    .map_err(|_| ())?
                    .into_iter()
                    .map(|a| a.addr)
                    .collect(),
            );
            *cache = Some((Instant::now(), list.clone()));
            list
        }
    };
    Ok(list.contains(&addr))
}

/// Whether this process's shared-memory devices can reach a peer at
/// `peer`, i.e. whether the peer is on this host: `peer` is an address of
/// our network namespace, or a shared-memory device whose interface has
/// that address is registered in our rundir (every shm device registers
/// the GIDs of its interface's addresses there when it is opened, see
/// `smc_rdma::shm::registry`). The second covers processes in other network
/// namespaces of this host that share the rundir (what the shm device
/// needs to reach them); a peer on another machine never has its address
/// there.
pub(crate) fn shm_reaches(peer: IpAddr) -> bool {
    let Some(ctx) = context() else {
        return false;
    };
    if in_namespace(ctx, peer).unwrap_or(false) {
        return true;
    }
    ctx.provider.shm().is_some_and(|p| {
        registered_in_rundir(
            &p.config().rundir,
            &smc_wire::types::Gid::from_ip(unmapped(peer)),
        )
    })
}

/// Whether the shm rundir `dir` has a device registered under `gid`:
/// an entry `gid-<hex>.<instance>` (or the single-owner `gid-<hex>`), the
/// names `smc_rdma::shm::registry` documents.
fn registered_in_rundir(dir: &Path, gid: &smc_wire::types::Gid) -> bool {
    let name = format!("gid-{}", gid.to_hex());
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    rd.flatten().any(|e| {
        let n = e.file_name();
        let n = n.to_string_lossy();
        n.strip_prefix(name.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(device: &str, kind: Kind) -> Candidate {
        Candidate {
            device: device.into(),
            kind,
            roce_v1: true,
            roce_v2: true,
        }
    }

    /// Which candidate a connection takes, by where its peer is: the
    /// kernel's first, except that a shared-memory device never serves a
    /// peer elsewhere.
    #[test]
    fn a_shared_memory_device_only_for_peers_of_this_host() {
        let shm = cand("shm-eth0", Kind::Shm);
        let shm2 = cand("shm-eth0b", Kind::Shm);
        let rxe = cand("rxe0", Kind::Verbs);
        let mlx = cand("mlx5_0", Kind::Verbs);
        // (candidates, peer in our namespace, expected)
        let rows: Vec<(Vec<&Candidate>, bool, Pick<'_>, &str)> = vec![
            (
                vec![&shm, &rxe],
                true,
                Pick::Use(&shm),
                "local peer: the first",
            ),
            (
                vec![&rxe, &shm],
                true,
                Pick::Use(&rxe),
                "local peer: the first",
            ),
            (
                vec![&shm, &rxe],
                false,
                Pick::Use(&rxe),
                "peer elsewhere: not shm",
            ),
            (
                vec![&shm, &rxe, &mlx],
                false,
                Pick::Use(&rxe),
                "the first that is not shm",
            ),
            (vec![&mlx], false, Pick::Use(&mlx), "verbs serves any peer"),
            (vec![&shm], true, Pick::Use(&shm), "local peer over shm"),
            (
                vec![&shm, &shm2],
                false,
                Pick::IfOnHost(&shm),
                "only shm: if on this host",
            ),
            (vec![], true, Pick::Nothing, "no candidates"),
            (vec![], false, Pick::Nothing, "no candidates"),
        ];
        for (cands, here, want, why) in rows {
            let cands: Vec<Candidate> = cands.into_iter().cloned().collect();
            let got = pick(&cands, here);
            // (compared by device: `want` borrows the rows' candidates)
            let name = |p: Pick<'_>| match p {
                Pick::Use(c) => format!("use {}", c.device),
                Pick::IfOnHost(c) => format!("if on host {}", c.device),
                Pick::Nothing => "nothing".into(),
            };
            assert_eq!(name(got), name(want), "{why}");
        }
    }

    /// A peer address is of this host for the shm device when a device of
    /// our rundir registered its GID (`gid-<hex>.<instance>`, or the
    /// single-owner `gid-<hex>`), and only then.
    #[test]
    fn the_rundir_says_which_addresses_are_of_this_host() {
        let dir = std::env::temp_dir().join(format!("smc-ctx-rundir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gid = |a: &str| smc_wire::types::Gid::from_ip(a.parse().unwrap());
        let (a, b, c) = (gid("10.0.0.1"), gid("10.0.0.2"), gid("10.0.0.3"));
        assert!(!registered_in_rundir(&dir, &a), "empty rundir");
        std::fs::write(dir.join(format!("gid-{}.dev-x-1-0-ab", a.to_hex())), "").unwrap();
        std::fs::write(dir.join(format!("gid-{}", b.to_hex())), "").unwrap();
        // a longer name that only starts like c's is not c's entry
        std::fs::write(dir.join(format!("gid-{}00.dev", c.to_hex())), "").unwrap();
        assert!(registered_in_rundir(&dir, &a));
        assert!(registered_in_rundir(&dir, &b));
        assert!(!registered_in_rundir(&dir, &c));
        assert!(!registered_in_rundir(&dir.join("missing"), &a));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
