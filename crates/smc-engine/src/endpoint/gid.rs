//! Which GID of the port a connection uses, per SMC-R version.
//!
//! Linux chooses the GID per connection (`smc_ib.c` `smc_ib_determine_gid`,
//! `smc_ib_determine_gid_rcu`), walking the port's GID table in index order:
//!
//! * SMC-R v1: the first RoCE v1 GID (`IB_GID_TYPE_ROCE`) — a port without
//!   one (rxe has only RoCE v2 GIDs) cannot do v1, and v1 is not offered;
//! * SMC-R v2: the first RoCE v2 GID (`IB_GID_TYPE_ROCE_UDP_ENCAP`) that is
//!   an IPv4-mapped address (`::ffff:a.b.c.d`), provided the connection's
//!   local IPv4 address lies in a subnet of the GID's interface. RoCE v2
//!   packets go to and come from the addresses the GIDs name, so the GID is
//!   in practice the connection's own address: where the port has that
//!   exact GID we take it (Linux takes the first IPv4-mapped one, which is
//!   the same GID unless the interface has several IPv4 addresses), else
//!   the kernel's choice.
//!
//! SMC-R v2 needs an IPv4 connection: Linux 6.12 proposes it only on an
//! `AF_INET` socket (`af_smc.c` `smc_find_proposal_devices`: `sk_family !=
//! AF_INET`); later kernels also on an IPv4-mapped address of an `AF_INET6`
//! socket, which is an IPv4 connection on the wire, and so do we. A server
//! finds no v2 device for an IPv6 connection (`smc_find_rdma_v2_device_serv`
//! looks the device up by the socket's IPv4 address), so neither end does
//! SMC-R v2 over IPv6.
//!
//! The choice is made once per connection (`Endpoint::connect` /
//! `Endpoint::accept` know its local address); a link group keeps the GID
//! it was created with, its QPs use that GID's table index as their source
//! GID, and only connections with the same GID join it.

use smc_proto::negotiate::IfAddr;
use smc_rdma::{GidEntry, GidType};
use smc_wire::types::Gid;
use std::net::{IpAddr, Ipv4Addr};

/// A GID of the port and its index in the port's table (the QP's
/// `sgid_index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalGid {
    /// The GID.
    pub gid: Gid,
    /// Its index in the port's GID table.
    pub index: u16,
}

impl From<&GidEntry> for LocalGid {
    fn from(e: &GidEntry) -> LocalGid {
        LocalGid {
            gid: e.gid,
            index: e.index,
        }
    }
}

/// The GIDs a connection may use, per version (`None`: that version is not
/// possible on it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnGids {
    /// SMC-R v1.
    pub v1: Option<LocalGid>,
    /// SMC-R v2.
    pub v2: Option<LocalGid>,
}

impl ConnGids {
    /// The GID of `version` (1 or 2).
    pub fn for_version(&self, version: u8) -> Option<LocalGid> {
        if version >= smc_wire::clc::SMC_V2 {
            self.v2
        } else {
            self.v1
        }
    }
}

/// The connection's IPv4 address: an IPv4 one, or an IPv4-mapped IPv6 one.
pub fn ipv4_of(local: IpAddr) -> Option<Ipv4Addr> {
    match local {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    }
}

/// The SMC-R v1 GID: the first RoCE v1 entry.
pub fn v1_gid(table: &[GidEntry]) -> Option<LocalGid> {
    table
        .iter()
        .find(|e| e.gid_type == GidType::RoceV1)
        .map(LocalGid::from)
}

/// The SMC-R v2 GID for a connection from `local` over an interface with
/// `if_addrs` (see the module documentation).
pub fn v2_gid(table: &[GidEntry], local: IpAddr, if_addrs: &[IfAddr]) -> Option<LocalGid> {
    let local = ipv4_of(local)?;
    let mapped = |e: &&GidEntry| e.gid_type == GidType::RoceV2 && e.gid.to_ipv4_mapped().is_some();
    if let Some(exact) = table
        .iter()
        .filter(mapped)
        .find(|e| e.gid.to_ipv4_mapped() == Some(local))
    {
        return Some(exact.into());
    }
    // `inet_ifa_match(saddr, ifa)` over the interface's IPv4 addresses
    let in_subnet = if_addrs.iter().any(|ia| match ia.addr {
        IpAddr::V4(a) if ia.prefix_len <= 32 => {
            let mask = u32::MAX
                .checked_shl(32 - u32::from(ia.prefix_len))
                .unwrap_or(0);
            u32::from(a) & mask == u32::from(local) & mask
        }
        _ => false,
    });
    if !in_subnet {
        return None;
    }
    table.iter().find(mapped).map(LocalGid::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u16, gid: Gid, t: GidType) -> GidEntry {
        GidEntry {
            index,
            gid,
            gid_type: t,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn v4(s: &str, len: u8) -> IfAddr {
        IfAddr {
            addr: ip(s),
            prefix_len: len,
        }
    }

    /// The rxe port of the kernel capture (captures README §2.1): GID[0]
    /// fe80::5054:ff:fe5c:1, GID[1] ::ffff:10.99.0.1, both RoCE v2.
    fn rxe() -> Vec<GidEntry> {
        let ll = Gid::roce_v1_link_local(smc_wire::types::Mac([0x52, 0x54, 0, 0x5c, 0, 1]));
        vec![
            entry(0, ll, GidType::RoceV2),
            entry(1, Gid::from_ip(ip("10.99.0.1")), GidType::RoceV2),
        ]
    }

    #[test]
    fn rxe_gives_v2_the_ipv4_mapped_gid_and_no_v1() {
        let t = rxe();
        let addrs = [v4("10.99.0.1", 24)];
        assert_eq!(v1_gid(&t), None, "rxe has no RoCE v1 GID");
        let g = v2_gid(&t, ip("10.99.0.1"), &addrs).unwrap();
        assert_eq!(g.index, 1);
        assert_eq!(g.gid.to_ipv4_mapped(), Some("10.99.0.1".parse().unwrap()));
        // the same from an IPv4-mapped socket address
        assert_eq!(v2_gid(&t, ip("::ffff:10.99.0.1"), &addrs), Some(g));
        // no SMC-R v2 over IPv6
        assert_eq!(v2_gid(&t, ip("fd00::1"), &addrs), None);
        assert_eq!(v2_gid(&t, ip("fe80::5054:ff:fe5c:1"), &addrs), None);
    }

    #[test]
    fn v1_takes_the_first_roce_v1_entry() {
        let ll = Gid::roce_v1_link_local(smc_wire::types::Mac([2, 0, 0, 0, 0, 7]));
        let a = Gid::from_ip(ip("192.0.2.7"));
        let t = vec![
            entry(0, ll, GidType::RoceV1),
            entry(1, ll, GidType::RoceV2),
            entry(2, a, GidType::RoceV1),
            entry(3, a, GidType::RoceV2),
        ];
        assert_eq!(v1_gid(&t), Some(LocalGid { gid: ll, index: 0 }));
        assert_eq!(
            v2_gid(&t, ip("192.0.2.7"), &[v4("192.0.2.7", 24)]),
            Some(LocalGid { gid: a, index: 3 }),
            "the RoCE v2 entry, not the v1 entry of the same GID"
        );
    }

    #[test]
    fn another_address_of_the_subnet_takes_the_first_mapped_gid_as_the_kernel() {
        let t = rxe();
        // the kernel's rule: the local address is in a subnet of the interface
        let g = v2_gid(
            &t,
            ip("10.99.0.9"),
            &[v4("10.99.0.1", 24), v4("10.99.0.9", 24)],
        );
        assert_eq!(g.map(|g| g.index), Some(1));
        // not in any subnet of the interface: no v2 device
        assert_eq!(v2_gid(&t, ip("10.98.0.9"), &[v4("10.99.0.1", 24)]), None);
        // with several addresses, the connection's own GID
        let mut t = rxe();
        t.push(entry(2, Gid::from_ip(ip("10.99.0.9")), GidType::RoceV2));
        let g = v2_gid(&t, ip("10.99.0.9"), &[]).unwrap();
        assert_eq!(g.index, 2);
    }
}
