//! CLC negotiation decisions: what a client proposes, what a server accepts or
//! declines and why, and what a client checks in the Accept.
//!
//! Spec: `protocol-clc.md` §3.2.3 (client prefixes), §3.2.4 (server prefix
//! match), §4.2 (client flow, steps 4–8), §4.3 (server flow, steps 4–8 and 12),
//! §4.4 (version negotiation) — Linux `smc_clc_prfx_set`, `smc_clc_prfx_match`,
//! `smc_listen_v2_check`, `smc_listen_find_device`, `smc_clc_srv_v2x_features_validate`,
//! `smc_connect_check_aclc`, `smc_clc_clnt_v2x_features_validate`.
//!
//! Pure functions: the caller (the connection driver) gathers the local facts —
//! which RoCE v1/v2 GIDs the connection's interface can use (after the PNET
//! lookup), the interface's addresses, the UEID table — and acts on the result
//! (send the message, or send a Decline with the code and fall back to TCP).

use smc_wire::clc::{
    AcceptConfirm, DeclineCode, FirstContactExt, IpPrefixes, Ipv6Prefix, Proposal, ProposalV2Ext,
    SmcPath, SmcdInfo, SMC_RELEASE_1, SMC_V1, SMC_V2,
};
use smc_wire::types::{Eid, Gid, Mac, SystemId};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The release of SMC v2 we implement (v2.1: max_conns / max_links negotiation).
pub const OUR_RELEASE: u8 = SMC_RELEASE_1;
/// Preferred / maximum connections per link group (`SMC_CONN_PER_LGR_PREFER`).
pub const MAX_CONNS: u8 = 255;
/// Fewest connections per link group a v2.1 peer may ask for (`SMC_CONN_PER_LGR_MIN`).
pub const MIN_CONNS: u8 = 16;
/// Links per link group we negotiate (`SMC_LINKS_ADD_LNK_MAX`).
pub const MAX_LINKS: u8 = 2;

/// An address configured on an interface, with its prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// The address.
    pub addr: IpAddr,
    /// Its prefix length.
    pub prefix_len: u8,
}

/// A RoCE v1 port usable for a connection: its GID (for the connection's VLAN) and MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoceV1Port {
    /// The RoCE v1 GID.
    pub gid: Gid,
    /// The port's MAC.
    pub mac: Mac,
}

/// What this host can do on the interface a connection uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalCapabilities {
    /// This SMC instance's system id.
    pub system_id: SystemId,
    /// SMC-R v1: a RoCE v1 port reachable through the connection's interface.
    pub v1: Option<RoceV1Port>,
    /// SMC-R v2: a RoCE v2 GID for the connection's local address.
    pub v2_gid: Option<Gid>,
    /// The UEID table (SMC-R v2 needs one shared with the peer).
    pub ueids: Vec<Eid>,
    /// Addresses of the connection's interface (for the prefix rules).
    pub if_addrs: Vec<IfAddr>,
}

impl LocalCapabilities {
    fn v2_possible(&self) -> bool {
        self.v2_gid.is_some() && !self.ueids.is_empty()
    }
}

fn mask4(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len.min(32)))
    }
}

fn mask6(len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len.min(128)))
    }
}

fn is_link_local6(a: Ipv6Addr) -> bool {
    (a.segments()[0] & 0xffc0) == 0xfe80
}

/// The prefix block a client proposes for its local address (§3.2.3): for IPv4
/// (also IPv4-mapped) the subnet of the first interface address containing it; for
/// IPv6 up to 8 non-link-local prefixes of the interface. `None`: no prefix.
pub fn client_prefixes(local: IpAddr, if_addrs: &[IfAddr]) -> Option<IpPrefixes> {
    let v4 = match local {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    };
    match v4 {
        Some(l) => if_addrs.iter().find_map(|ia| match ia.addr {
            IpAddr::V4(a) if ia.prefix_len <= 32 => {
                let m = mask4(ia.prefix_len);
                (u32::from(a) & m == u32::from(l) & m)
                    .then(|| IpPrefixes::ipv4(Ipv4Addr::from(u32::from(a) & m), ia.prefix_len))
            }
            _ => None,
        }),
        None => {
            let ipv6: Vec<Ipv6Prefix> = if_addrs
                .iter()
                .filter_map(|ia| match ia.addr {
                    IpAddr::V6(a) if !is_link_local6(a) && ia.prefix_len <= 128 => {
                        Some(Ipv6Prefix {
                            prefix: Ipv6Addr::from(u128::from(a) & mask6(ia.prefix_len)),
                            len: ia.prefix_len,
                        })
                    }
                    _ => None,
                })
                .take(smc_wire::clc::MAX_IPV6_PREFIXES)
                .collect();
            (!ipv6.is_empty()).then_some(IpPrefixes {
                ipv4_subnet: Ipv4Addr::UNSPECIFIED,
                ipv4_prefix_len: 0,
                ipv6,
            })
        }
    }
}

/// The server's prefix check (§3.2.4): an IPv4 proposal matches an interface
/// address with the same prefix length inside the proposed subnet; an IPv6
/// proposal matches a non-link-local address whose prefix equals one of the first
/// eight proposed prefixes.
pub fn prefixes_match(p: &IpPrefixes, if_addrs: &[IfAddr]) -> bool {
    if p.ipv6.is_empty() {
        let m = mask4(p.ipv4_prefix_len);
        let subnet = u32::from(p.ipv4_subnet) & m;
        if_addrs.iter().any(|ia| {
            matches!(ia.addr, IpAddr::V4(a)
                if ia.prefix_len == p.ipv4_prefix_len && u32::from(a) & m == subnet)
        })
    } else {
        if_addrs.iter().any(|ia| match ia.addr {
            IpAddr::V6(a) if !is_link_local6(a) => p.ipv6.iter().take(8).any(|e| {
                e.len == ia.prefix_len
                    && u128::from(a) & mask6(e.len) == u128::from(e.prefix) & mask6(e.len)
            }),
            _ => false,
        })
    }
}

/// Builds the client's Proposal (§4.2 step 5, §3.2.2): always the version-2 layout
/// as current Linux sends it, offering SMC-R v1 if a RoCE v1 port and a prefix
/// exist and SMC-R v2 if a RoCE v2 GID and a UEID exist. With neither, the
/// connection declines with NOSMCDEV (or CNFERR when only the prefix is missing).
///
/// The system id goes in even when only v2 is offered, where Linux leaves
/// the v1 fields zero: a server takes the Proposal's id to tell its peers
/// apart (`smc_lgr_create`, `smcr_lgr_match`), and every process of ours is
/// an SMC instance of its own. With a zero id a Linux server would put a
/// second process's first connection on the first process's link group
/// (same zero id, same GID), that process would decline the reuse it cannot
/// follow with SYNCERR, and the server would end the group of both.
pub fn build_proposal(local: IpAddr, caps: &LocalCapabilities) -> Result<Proposal, DeclineCode> {
    let prefixes = caps.v1.and_then(|_| client_prefixes(local, &caps.if_addrs));
    let v1 = caps.v1.filter(|_| prefixes.is_some());
    let v2 = caps.v2_possible();
    if v1.is_none() && !v2 {
        return Err(if caps.v1.is_some() {
            DeclineCode::CnfErr
        } else {
            DeclineCode::NoSmcDev
        });
    }
    Ok(Proposal {
        version: SMC_V2,
        typev1: if v1.is_some() { SmcPath::R } else { SmcPath::N },
        typev2: if v2 { SmcPath::R } else { SmcPath::N },
        peer_id: caps.system_id,
        gid: v1.map_or(Gid::ZERO, |p| p.gid),
        mac: v1.map_or(Mac::default(), |p| p.mac),
        smcd: Some(SmcdInfo::default()),
        prefixes: if v1.is_some() { prefixes } else { None },
        v2_ext: v2.then(|| ProposalV2Ext {
            eids: caps.ueids.clone(),
            release: OUR_RELEASE,
            seid: false,
            roce_v2_gid: caps.v2_gid.unwrap_or(Gid::ZERO),
            max_conns: MAX_CONNS,
            max_links: MAX_LINKS,
            feature_mask: 0,
        }),
        smcd_v2_ext: None,
    })
}

/// What the server agreed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerChoice {
    /// CLC version of the Accept/Confirm (1 or 2).
    pub version: u8,
    /// v2: negotiated EID.
    pub eid: Option<Eid>,
    /// v2: negotiated release (0 or 1).
    pub release: u8,
    /// Connections per link group.
    pub max_conns: u8,
    /// Links per link group.
    pub max_links: u8,
}

/// The version a server's Declines carry for this Proposal (§4.1).
pub fn decline_version(p: &Proposal) -> u8 {
    if p.version > SMC_V1 {
        SMC_V2
    } else {
        SMC_V1
    }
}

/// The server's decision (§4.3 steps 6–8): SMC-R v2 if offered, configured and a
/// UEID is shared (with the v2.1 limits checked), else SMC-R v1 if offered and
/// the prefixes match, else the Decline code Linux would send — the first failure
/// recorded, NOSMCDEV if none was (the kernel capture's EID-mismatch case).
pub fn server_choose(p: &Proposal, caps: &LocalCapabilities) -> Result<ServerChoice, DeclineCode> {
    let mut first_failure: Option<DeclineCode> = None;
    fn note(c: DeclineCode, f: &mut Option<DeclineCode>) {
        f.get_or_insert(c);
    }
    // v1: the prefix check runs first in Linux (before any device lookup).
    let v1_offered = p.typev1.offers_r();
    let prefix_ok = match (&p.prefixes, v1_offered) {
        (Some(pr), true) => {
            let ok = prefixes_match(pr, &caps.if_addrs);
            if !ok {
                note(DeclineCode::DiffPrefix, &mut first_failure);
            }
            ok
        }
        _ => false,
    };
    let v2_offered = p.version > SMC_V1 && p.typev2.offers_r();
    if !v1_offered && !v2_offered {
        // SMC-D only: we have no ISM device.
        return Err(first_failure.unwrap_or(DeclineCode::NoSmcDDev));
    }
    // v2 path
    if v2_offered {
        match &p.v2_ext {
            None => note(DeclineCode::NoV2Ext, &mut first_failure),
            Some(ext) if ext.eids.is_empty() => note(DeclineCode::NoUeid, &mut first_failure),
            // The GID names the client's port (its link group is found by
            // it, §4.5): an unusable one rules the path out, as the link to it
            // could never be readied (finding 7).
            Some(ext) if !gid_usable(&ext.roce_v2_gid) => {
                note(DeclineCode::ErrRdyLnk, &mut first_failure)
            }
            Some(ext) => {
                let eid = ext.eids.iter().find(|e| caps.ueids.contains(e)).copied();
                // Linux (af_smc.c `smc_find_rdma_v2_device_serv`): no shared
                // EID rules v2 out without a code; then a device with a RoCE
                // v2 GID for the connection's IPv4 address must exist, else
                // NOSMCRDEV — which is what an IPv6 connection gets (no
                // SMC-R v2 over IPv6, RESULTS case v2: 0x03030002).
                if eid.is_some() && caps.v2_gid.is_none() {
                    note(DeclineCode::NoSmcRDev, &mut first_failure);
                }
                if let (Some(eid), Some(_)) = (eid, caps.v2_gid) {
                    let release = ext.release.min(OUR_RELEASE);
                    let (max_conns, max_links) = if release >= SMC_RELEASE_1 {
                        // min(peer, SMC_CONN_PER_LGR_PREFER = 255): the u8 already is
                        let c = ext.max_conns;
                        if c < MIN_CONNS {
                            return Err(DeclineCode::MaxConnErr);
                        }
                        let l = ext.max_links.min(MAX_LINKS);
                        if l < 1 {
                            return Err(DeclineCode::MaxLinkErr);
                        }
                        (c, l)
                    } else {
                        (MAX_CONNS, MAX_LINKS)
                    };
                    return Ok(ServerChoice {
                        version: SMC_V2,
                        eid: Some(eid),
                        release,
                        max_conns,
                        max_links,
                    });
                }
            }
        }
    }
    // v1 path
    if v1_offered && prefix_ok && caps.v1.is_some() {
        if !gid_usable(&p.gid) {
            return Err(first_failure.unwrap_or(DeclineCode::ErrRdyLnk));
        }
        return Ok(ServerChoice {
            version: SMC_V1,
            eid: None,
            release: 0,
            max_conns: MAX_CONNS,
            max_links: MAX_LINKS,
        });
    }
    Err(first_failure.unwrap_or(DeclineCode::NoSmcDev))
}

/// What the client agreed to after checking the Accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAgreement {
    /// CLC version for the Confirm (= the Accept's).
    pub version: u8,
    /// v2: the negotiated EID (echoed in the Confirm).
    pub eid: Option<Eid>,
    /// v2: release taken from the first-contact extension.
    pub release: u8,
    /// Connections per link group.
    pub max_conns: u8,
    /// Links per link group.
    pub max_links: u8,
}

/// The client's checks of an Accept against its own Proposal (§4.2 steps 7–8):
/// the version must be one we offered (MODEUNSUPP), a v2 EID must be one of ours
/// (NOUEID), and a v2.1 first contact must carry sane limits (MAXCONNERR /
/// MAXLINKERR).
pub fn client_check_accept(
    proposal: &Proposal,
    accept: &AcceptConfirm,
) -> Result<ClientAgreement, DeclineCode> {
    if accept.version >= SMC_V2 {
        let Some(ext) = proposal
            .v2_ext
            .as_ref()
            .filter(|_| proposal.typev2.offers_r())
        else {
            return Err(DeclineCode::ModeUnsupp);
        };
        if !ext.eids.contains(&accept.eid) {
            return Err(DeclineCode::NoUeid);
        }
        let (release, max_conns, max_links) = match (&accept.fce, accept.first_contact) {
            (Some(fce), true) => {
                if fce.release > OUR_RELEASE {
                    return Err(DeclineCode::ReleaseErr);
                }
                match (&fce.v2x, fce.release >= SMC_RELEASE_1) {
                    (Some(x), true) => {
                        if x.max_conns < MIN_CONNS {
                            return Err(DeclineCode::MaxConnErr);
                        }
                        if x.max_links == 0 || x.max_links > MAX_LINKS {
                            return Err(DeclineCode::MaxLinkErr);
                        }
                        (fce.release, x.max_conns, x.max_links)
                    }
                    _ => (fce.release, MAX_CONNS, MAX_LINKS),
                }
            }
            (None, true) => return Err(DeclineCode::NoV2Ext),
            // Reuse: the link group's values were agreed at its first contact.
            (_, false) => (OUR_RELEASE, MAX_CONNS, MAX_LINKS),
        };
        Ok(ClientAgreement {
            version: SMC_V2,
            eid: Some(accept.eid),
            release,
            max_conns,
            max_links,
        })
    } else {
        if !proposal.typev1.offers_r() {
            return Err(DeclineCode::ModeUnsupp);
        }
        Ok(ClientAgreement {
            version: SMC_V1,
            eid: None,
            release: 0,
            max_conns: MAX_CONNS,
            max_links: MAX_LINKS,
        })
    }
}

/// The server's checks of a client's first-contact v2 Confirm against its
/// own Accept (Linux smc_clc.c `smc_clc_v2x_features_confirm_check`): the
/// release must be the Accept's (RELEASEERR), and from release 1 on the
/// client must repeat the Accept's max_conns (MAXCONNERR) and max_links
/// (MAXLINKERR). Anything else passes.
pub fn server_check_confirm(
    accept: &AcceptConfirm,
    confirm: &AcceptConfirm,
) -> Result<(), DeclineCode> {
    if confirm.version < SMC_V2 || !confirm.first_contact {
        return Ok(());
    }
    let (Some(ours), Some(theirs)) = (&accept.fce, &confirm.fce) else {
        return Ok(());
    };
    if theirs.release != ours.release {
        return Err(DeclineCode::ReleaseErr);
    }
    if theirs.release < SMC_RELEASE_1 {
        return Ok(());
    }
    let limits = |f: &FirstContactExt| f.v2x.map(|x| (x.max_conns, x.max_links));
    match (limits(ours), limits(theirs)) {
        (Some((c, _)), Some((tc, _))) if c != tc => Err(DeclineCode::MaxConnErr),
        (Some((_, l)), Some((_, tl))) if l != tl => Err(DeclineCode::MaxLinkErr),
        _ => Ok(()),
    }
}

/// Whether `gid` can name a peer's RoCE port: not all zero (an unset field)
/// and not multicast (`ff00::/8`, which an RC QP cannot be connected to).
pub fn gid_usable(gid: &smc_wire::types::Gid) -> bool {
    *gid != smc_wire::types::Gid::ZERO && gid.0[0] != 0xff
}

/// The checks of the values in a peer's Accept (client) or Confirm (server)
/// that this side acts on, before it acts on any of them (issue 13, finding 7).
/// Linux takes them as they come (`smc_link_save_peer_info`,
/// `smcr_conn_save_peer_info`) and fails later, or not at all, and then
/// harms more than the one connection; we refuse the values here, with the
/// code Linux sends where it would fail, or the closest:
///
/// * the link: QP MTU (IB enum 1..=5), QP number (not 0 or 1, the IB special
///   QPs), GID (`gid_usable`) — ERR_RDYLNK, the code of a failed
///   `smc_ib_ready_link`: an MTU of 0 makes Linux's RTR transition fail
///   (`smc_ib_modify_qp_rtr` takes the smaller of its own and the peer's MTU),
///   6..=15 Linux silently replaces by its own, and no RC QP can be connected
///   to QP 0 or 1 or to an unset or multicast GID;
/// * the RMB element: the alert token, which routes every CDC to the
///   connection (Linux never hands out 0, `smc_lgr_register_conn`; a CDC
///   carrying 0 finds no connection and is dropped, so both ends would wait
///   for each other for ever), the RMBE index (1-based: 0 would put the
///   element before the RMB), and the element's address range, which must not
///   overflow — ERR_RTOK, Linux's code for an unusable peer RMB ("rtoken
///   handling failed"). Every size class of the 4-bit field is usable by our
///   data path (cursors are 32-bit offsets; the largest class is 512 MiB);
///   whether the peer's region really has that size only the provider can
///   tell (`QueuePair::prepare_remote`).
///
/// The PSN (any 24-bit value) and the MAC (unused on RoCE v2, and by our
/// providers) need no check; the system id only names the peer.
pub fn check_peer_values(m: &AcceptConfirm) -> Result<(), DeclineCode> {
    if m.mtu().is_none() || m.qpn <= 1 || !gid_usable(&m.gid) {
        return Err(DeclineCode::ErrRdyLnk);
    }
    if m.alert_token == 0 || peer_rmbe_range(m).is_none() {
        return Err(DeclineCode::ErrRtok);
    }
    Ok(())
}

/// Where the peer's RMB element lies in its RMB: `(offset in the RMB, length)`
/// — `rmbe_size × (index − 1)`, `protocol-clc.md` §3.3 — or `None` when the
/// index is 0 or the element's end does not fit in a 64-bit address from the
/// RMB's virtual address.
pub fn peer_rmbe_range(m: &AcceptConfirm) -> Option<(u64, usize)> {
    let len = m.rmbe_size.bytes();
    let idx = u64::from(m.rmbe_idx.checked_sub(1)?);
    let off = (len as u64).checked_mul(idx)?;
    m.rmb_vaddr.checked_add(off)?.checked_add(len as u64)?;
    Some((off, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_wire::clc::{ClcMessage, FceV2x, FirstContactExt};
    use smc_wire::types::RmbeSize;

    fn v4(a: [u8; 4], len: u8) -> IfAddr {
        IfAddr {
            addr: IpAddr::V4(Ipv4Addr::from(a)),
            prefix_len: len,
        }
    }
    fn v6(s: &str, len: u8) -> IfAddr {
        IfAddr {
            addr: IpAddr::V6(s.parse().unwrap()),
            prefix_len: len,
        }
    }
    fn eid(s: &str) -> Eid {
        Eid::parse_ueid(s).unwrap()
    }

    fn caps(v1: bool, v2: bool, ueids: &[&str], addrs: Vec<IfAddr>) -> LocalCapabilities {
        let mac = Mac([2, 0, 0, 0, 0, 1]);
        LocalCapabilities {
            system_id: SystemId::new(0x1234, mac),
            v1: v1.then(|| RoceV1Port {
                gid: Gid::roce_v1_link_local(mac),
                mac,
            }),
            v2_gid: v2.then(|| Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2))),
            ueids: ueids.iter().map(|s| eid(s)).collect(),
            if_addrs: addrs,
        }
    }

    #[test]
    fn client_prefix_rules() {
        let addrs = vec![
            v4([192, 168, 10, 1], 24),
            v6("fe80::1", 64),
            v6("2001:db8:1::5", 64),
        ];
        let p = client_prefixes("192.168.10.1".parse().unwrap(), &addrs).unwrap();
        assert_eq!(
            (p.ipv4_subnet, p.ipv4_prefix_len),
            (Ipv4Addr::new(192, 168, 10, 0), 24)
        );
        assert!(client_prefixes("10.0.0.1".parse().unwrap(), &addrs).is_none());
        let p = client_prefixes("::ffff:192.168.10.1".parse().unwrap(), &addrs).unwrap();
        assert_eq!(p.ipv4_prefix_len, 24);
        let p = client_prefixes("2001:db8:1::5".parse().unwrap(), &addrs).unwrap();
        assert_eq!(p.ipv6.len(), 1, "link-local skipped");
        assert_eq!(
            p.ipv6[0].prefix,
            "2001:db8:1::".parse::<Ipv6Addr>().unwrap()
        );
    }

    #[test]
    fn server_prefix_rules() {
        let p4 = IpPrefixes::ipv4(Ipv4Addr::new(192, 168, 10, 0), 24);
        assert!(prefixes_match(&p4, &[v4([192, 168, 10, 9], 24)]));
        assert!(
            !prefixes_match(&p4, &[v4([192, 168, 10, 9], 16)]),
            "mask length must equal"
        );
        assert!(!prefixes_match(&p4, &[v4([192, 168, 11, 9], 24)]));
        let p6 =
            client_prefixes("2001:db8:1::5".parse().unwrap(), &[v6("2001:db8:1::5", 64)]).unwrap();
        assert!(prefixes_match(&p6, &[v6("2001:db8:1::77", 64)]));
        assert!(!prefixes_match(&p6, &[v6("2001:db8:2::77", 64)]));
        assert!(!prefixes_match(&p6, &[v4([192, 168, 10, 9], 24)]));
    }

    #[test]
    fn proposals_as_linux_builds_them() {
        let addrs = vec![v4([192, 168, 10, 1], 24)];
        let local: IpAddr = "192.168.10.1".parse().unwrap();
        // both paths
        let p =
            build_proposal(local, &caps(true, true, &["SMC-TEST-UEID"], addrs.clone())).unwrap();
        assert_eq!((p.version, p.typev1, p.typev2), (2, SmcPath::R, SmcPath::R));
        let bytes = ClcMessage::Proposal(p.clone()).encode();
        assert_eq!(bytes[7], 0x20, "version 2, typev2 R, typev1 R");
        // v2 only: zero v1 GID and MAC, no prefixes (as in the kernel
        // capture), but our system id (see `build_proposal`)
        let p = build_proposal(local, &caps(false, true, &["SMC-TEST-UEID"], vec![])).unwrap();
        assert_eq!((p.typev1, p.typev2), (SmcPath::N, SmcPath::R));
        assert_eq!((p.gid, p.mac), (Gid::ZERO, Mac::default()));
        assert_eq!(p.peer_id, caps(false, true, &[], vec![]).system_id);
        assert_eq!(
            ClcMessage::Proposal(p).encode().len(),
            156,
            "same size as the kernel's"
        );
        // v1 only: 0x28 as modern Linux sends it
        let p = build_proposal(local, &caps(true, false, &[], addrs.clone())).unwrap();
        assert_eq!(ClcMessage::Proposal(p).encode()[7], 0x28);
        // nothing
        assert_eq!(
            build_proposal(local, &caps(false, false, &[], vec![])),
            Err(DeclineCode::NoSmcDev)
        );
        assert_eq!(
            build_proposal(local, &caps(false, true, &[], vec![])),
            Err(DeclineCode::NoSmcDev),
            "v2 needs a UEID"
        );
        assert_eq!(
            build_proposal(local, &caps(true, false, &[], vec![])),
            Err(DeclineCode::CnfErr),
            "no prefix"
        );
    }

    #[test]
    fn server_decisions_and_decline_codes() {
        let cl_addrs = vec![v4([192, 168, 10, 1], 24)];
        let local: IpAddr = "192.168.10.1".parse().unwrap();
        let both = build_proposal(local, &caps(true, true, &["B", "A"], cl_addrs.clone())).unwrap();
        let v1only = build_proposal(local, &caps(true, false, &[], cl_addrs.clone())).unwrap();
        let v2only = build_proposal(local, &caps(false, true, &["A"], vec![])).unwrap();
        let same_net = vec![v4([192, 168, 10, 2], 24)];
        let other_net = vec![v4([10, 1, 0, 2], 24)];

        // v2 preferred, first shared UEID of the client's list
        let c = server_choose(&both, &caps(true, true, &["A", "B"], same_net.clone())).unwrap();
        assert_eq!(
            (c.version, c.eid, c.release, c.max_conns, c.max_links),
            (2, Some(eid("B")), 1, 255, 2)
        );
        // no shared UEID: v1 if prefixes match
        assert_eq!(
            server_choose(&both, &caps(true, true, &["Z"], same_net.clone()))
                .unwrap()
                .version,
            1
        );
        // v2-only proposal, no shared UEID: NOSMCDEV (kernel capture, decline pcap)
        assert_eq!(
            server_choose(&v2only, &caps(true, true, &[], same_net.clone())),
            Err(DeclineCode::NoSmcDev)
        );
        // different subnet: DIFFPREFIX
        assert_eq!(
            server_choose(&v1only, &caps(true, true, &[], other_net)),
            Err(DeclineCode::DiffPrefix)
        );
        // no device at all
        assert_eq!(
            server_choose(&v1only, &caps(false, false, &[], same_net.clone())),
            Err(DeclineCode::NoSmcDev)
        );
        // v2.1 limits
        let mut small = both.clone();
        small.v2_ext.as_mut().unwrap().max_conns = 8;
        assert_eq!(
            server_choose(&small, &caps(true, true, &["A"], same_net.clone())),
            Err(DeclineCode::MaxConnErr)
        );
        let mut nolinks = both.clone();
        nolinks.v2_ext.as_mut().unwrap().max_links = 0;
        assert_eq!(
            server_choose(&nolinks, &caps(true, true, &["A"], same_net.clone())),
            Err(DeclineCode::MaxLinkErr)
        );
        // release 0 peer: no v2.1 negotiation
        let mut r0 = both.clone();
        r0.v2_ext.as_mut().unwrap().release = 0;
        r0.v2_ext.as_mut().unwrap().max_conns = 0;
        assert_eq!(
            server_choose(&r0, &caps(true, true, &["A"], same_net.clone()))
                .unwrap()
                .release,
            0
        );
        // v2 requested without an EID
        let mut noeid = v2only.clone();
        noeid.v2_ext.as_mut().unwrap().eids.clear();
        assert_eq!(
            server_choose(&noeid, &caps(true, true, &["A"], same_net.clone())),
            Err(DeclineCode::NoUeid)
        );
        // SMC-D only
        let mut d = v1only.clone();
        d.typev1 = SmcPath::D;
        assert_eq!(
            server_choose(&d, &caps(true, true, &["A"], same_net)),
            Err(DeclineCode::NoSmcDDev)
        );
        assert_eq!(decline_version(&both), 2);
    }

    /// A server whose connection has no RoCE v2 GID — an IPv6 connection
    /// (no SMC-R v2 over IPv6), or no such GID on the port — declines a
    /// v2 Proposal whose EID it shares with NOSMCRDEV, as Linux 6.12 did in
    /// the lab (RESULTS case v2: `rs Prop v2 ... / Decline 0x03030002`);
    /// without a shared EID v2 leaves no code and NOSMCDEV follows.
    #[test]
    fn a_server_without_a_v2_gid_for_the_connection_declines_nosmcrdev() {
        let local: IpAddr = "192.168.10.1".parse().unwrap();
        let v2only = build_proposal(local, &caps(false, true, &["A"], vec![])).unwrap();
        let v6_addrs = vec![v6("2001:db8:1::2", 64)];
        // the server's capabilities on an IPv6 connection over rxe: no v1 GID,
        // and no v2 GID for the connection
        let srv = |ueids: &[&str]| LocalCapabilities {
            v1: None,
            v2_gid: None,
            ..caps(false, false, ueids, v6_addrs.clone())
        };
        assert_eq!(
            server_choose(&v2only, &srv(&["A"])),
            Err(DeclineCode::NoSmcRDev)
        );
        assert_eq!(
            server_choose(&v2only, &srv(&["Z"])),
            Err(DeclineCode::NoSmcDev)
        );
        // v1 offered as well, prefixes matching, no v1 device either: the v2
        // path's code comes first (as in the lab, where our Proposal had both)
        let p6: IpAddr = "2001:db8:1::5".parse().unwrap();
        let both =
            build_proposal(p6, &caps(true, true, &["A"], vec![v6("2001:db8:1::5", 64)])).unwrap();
        assert!(both.typev1.offers_r());
        assert_eq!(
            server_choose(&both, &srv(&["A"])),
            Err(DeclineCode::NoSmcRDev)
        );
    }

    fn accept(version: u8, e: &str, fce: Option<FirstContactExt>) -> AcceptConfirm {
        AcceptConfirm {
            version,
            first_contact: fce.is_some(),
            peer_id: SystemId::default(),
            gid: Gid::ZERO,
            mac: Mac::default(),
            qpn: 0x12,
            rmb_rkey: 1,
            rmbe_idx: 1,
            alert_token: 1,
            rmbe_size: RmbeSize::from_class(2).unwrap(),
            qp_mtu: 3,
            rmb_vaddr: 0,
            psn: 1,
            eid: if version >= 2 { eid(e) } else { Eid::default() },
            fce,
            gid_list: None,
        }
    }

    fn fce(release: u8, conns: u8, links: u8) -> FirstContactExt {
        FirstContactExt {
            v2_direct: true,
            os_type: 2,
            release,
            hostname: FirstContactExt::hostname_from_str("srv"),
            v2x: Some(FceV2x {
                max_conns: conns,
                max_links: links,
                feature_mask: 0,
                vendor_opts: [0; 4],
            }),
        }
    }

    /// A Linux server declines a first-contact Confirm that does not repeat
    /// its Accept's release, max_conns and max_links.
    #[test]
    fn server_confirm_checks_as_linux() {
        let a = accept(2, "A", Some(fce(1, 255, 1)));
        assert_eq!(
            server_check_confirm(&a, &accept(2, "A", Some(fce(1, 255, 1)))),
            Ok(())
        );
        assert_eq!(
            server_check_confirm(&a, &accept(2, "A", Some(fce(1, 255, 2)))),
            Err(DeclineCode::MaxLinkErr)
        );
        assert_eq!(
            server_check_confirm(&a, &accept(2, "A", Some(fce(1, 16, 1)))),
            Err(DeclineCode::MaxConnErr)
        );
        assert_eq!(
            server_check_confirm(&a, &accept(2, "A", Some(fce(0, 0, 0)))),
            Err(DeclineCode::ReleaseErr)
        );
        // release 0 on both: nothing more to compare; reuse: no extension
        let a0 = accept(2, "A", Some(fce(0, 255, 1)));
        assert_eq!(
            server_check_confirm(&a0, &accept(2, "A", Some(fce(0, 9, 9)))),
            Ok(())
        );
        assert_eq!(server_check_confirm(&a, &accept(2, "A", None)), Ok(()));
    }

    #[test]
    fn client_accept_checks() {
        let local: IpAddr = "192.168.10.1".parse().unwrap();
        let addrs = vec![v4([192, 168, 10, 1], 24)];
        let both = build_proposal(local, &caps(true, true, &["A"], addrs.clone())).unwrap();
        let v1only = build_proposal(local, &caps(true, false, &[], addrs)).unwrap();
        let a = client_check_accept(&both, &accept(2, "A", Some(fce(1, 255, 2)))).unwrap();
        assert_eq!(
            (a.version, a.release, a.max_conns, a.max_links),
            (2, 1, 255, 2)
        );
        assert_eq!(
            client_check_accept(&both, &accept(1, "", None))
                .unwrap()
                .version,
            1
        );
        assert_eq!(
            client_check_accept(&v1only, &accept(2, "A", Some(fce(1, 255, 2)))),
            Err(DeclineCode::ModeUnsupp)
        );
        assert_eq!(
            client_check_accept(&both, &accept(2, "X", Some(fce(1, 255, 2)))),
            Err(DeclineCode::NoUeid)
        );
        assert_eq!(
            client_check_accept(&both, &accept(2, "A", Some(fce(1, 15, 2)))),
            Err(DeclineCode::MaxConnErr)
        );
        assert_eq!(
            client_check_accept(&both, &accept(2, "A", Some(fce(1, 255, 3)))),
            Err(DeclineCode::MaxLinkErr)
        );
        assert_eq!(
            client_check_accept(&both, &accept(2, "A", Some(fce(2, 255, 2)))),
            Err(DeclineCode::ReleaseErr)
        );
        // release 0: the v2.1 bytes are reserved and ignored
        assert_eq!(
            client_check_accept(&both, &accept(2, "A", Some(fce(0, 0, 0))))
                .unwrap()
                .release,
            0
        );
    }

    /// Finding 7: every value of an Accept / Confirm we act on, one bad value
    /// at a time, with the code we decline it with (both roles use this check).
    #[test]
    fn peer_values_we_act_on_are_checked() {
        let mut good = accept(1, "", None);
        good.gid = Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 2));
        good.rmb_vaddr = 0x7f00_0000_0000;
        assert_eq!(check_peer_values(&good), Ok(()));
        type Tweak = fn(&mut AcceptConfirm);
        let bad: Vec<(&str, Tweak, DeclineCode)> = vec![
            ("MTU 0", |m| m.qp_mtu = 0, DeclineCode::ErrRdyLnk),
            ("MTU 6", |m| m.qp_mtu = 6, DeclineCode::ErrRdyLnk),
            ("MTU 15", |m| m.qp_mtu = 15, DeclineCode::ErrRdyLnk),
            ("QP 0", |m| m.qpn = 0, DeclineCode::ErrRdyLnk),
            ("QP 1", |m| m.qpn = 1, DeclineCode::ErrRdyLnk),
            ("GID zero", |m| m.gid = Gid::ZERO, DeclineCode::ErrRdyLnk),
            (
                "GID multicast",
                |m| m.gid = Gid([0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
                DeclineCode::ErrRdyLnk,
            ),
            ("alert token 0", |m| m.alert_token = 0, DeclineCode::ErrRtok),
            ("RMBE index 0", |m| m.rmbe_idx = 0, DeclineCode::ErrRtok),
            (
                "RMBE beyond the address space",
                |m| m.rmb_vaddr = u64::MAX - 4096,
                DeclineCode::ErrRtok,
            ),
            (
                "RMBE index beyond the address space",
                |m| {
                    m.rmb_vaddr = u64::MAX - (100 << 30);
                    m.rmbe_size = RmbeSize::from_class(15).unwrap();
                    m.rmbe_idx = 255;
                },
                DeclineCode::ErrRtok,
            ),
        ];
        for (what, f, code) in bad {
            let mut m = good.clone();
            f(&mut m);
            assert_eq!(check_peer_values(&m), Err(code), "{what}");
        }
        // what stays acceptable: every MTU and size class, any PSN, an RMBE
        // further into a large RMB, rkey 0 (only the provider can judge keys)
        for mtu in 1..=5 {
            let mut m = good.clone();
            m.qp_mtu = mtu;
            assert_eq!(check_peer_values(&m), Ok(()));
        }
        for class in 0..=15 {
            let mut m = good.clone();
            m.rmbe_size = RmbeSize::from_class(class).unwrap();
            m.rmbe_idx = 3;
            m.psn = 0xff_ffff;
            m.rmb_rkey = 0;
            assert_eq!(check_peer_values(&m), Ok(()));
            let (off, len) = peer_rmbe_range(&m).unwrap();
            assert_eq!((off, len), (2 * len as u64, 16384 << class));
        }
    }

    #[test]
    fn a_proposal_with_an_unusable_gid_for_its_path_is_declined() {
        let local: IpAddr = "192.168.10.1".parse().unwrap();
        let addrs = vec![v4([192, 168, 10, 1], 24)];
        let srv = caps(true, true, &["A"], vec![v4([192, 168, 10, 2], 24)]);
        let mut v2only = build_proposal(local, &caps(false, true, &["A"], vec![])).unwrap();
        v2only.v2_ext.as_mut().unwrap().roce_v2_gid = Gid::ZERO;
        assert_eq!(server_choose(&v2only, &srv), Err(DeclineCode::ErrRdyLnk));
        let mut v1only = build_proposal(local, &caps(true, false, &[], addrs.clone())).unwrap();
        v1only.gid = Gid::ZERO;
        assert_eq!(server_choose(&v1only, &srv), Err(DeclineCode::ErrRdyLnk));
        // both offered, v2's GID unusable: v1 still works
        let mut both = build_proposal(local, &caps(true, true, &["A"], addrs)).unwrap();
        both.v2_ext.as_mut().unwrap().roce_v2_gid = Gid::ZERO;
        assert_eq!(server_choose(&both, &srv).map(|c| c.version), Ok(1));
    }
}
