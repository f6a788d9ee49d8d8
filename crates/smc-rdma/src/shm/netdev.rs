//! The network interface a device is bound to: whether it is up, its MAC,
//! and the GID table derived from it as RoCE derives one (a RoCE v1 GID and
//! its v2 twin from the MAC's link-local address, RoCE v2 GIDs from the
//! interface's IP addresses; Linux: drivers/infiniband/core/roce_gid_mgmt.c).
//!
//! Interface facts come from the caller's network namespace (socket ioctls,
//! getifaddrs), never from /sys/class/net: a process that entered a namespace
//! with setns alone (`nsenter --net`) still sees the sysfs of the namespace that
//! mounted it, which lacks our interfaces or has others under the same names.

use crate::sys::{self};
use crate::verbs::*;

pub(super) fn netdev_up(netdev: &str) -> bool {
    sys::link(netdev).ok().flatten().is_some_and(|l| l.up)
}

fn netdev_mac(netdev: &str) -> Option<[u8; 6]> {
    sys::link(netdev).ok().flatten()?.mac
}

/// The RoCE-style GID table of `netdev`.
pub fn gid_table(netdev: &str) -> Vec<GidEntry> {
    let mut out = vec![];
    let mut push = |gid: Gid, t: GidType| {
        let index = out.len() as u16;
        out.push(GidEntry {
            index,
            gid,
            gid_type: t,
        });
    };
    if let Some(mac) = netdev_mac(netdev) {
        let g = Gid::roce_v1_link_local(smc_wire::types::Mac(mac));
        push(g, GidType::RoceV1);
        push(g, GidType::RoceV2);
    }
    let ll = netdev_mac(netdev).map(|m| Gid::roce_v1_link_local(smc_wire::types::Mac(m)));
    for ip in sys::if_addrs(netdev).unwrap_or_default() {
        let g = Gid::from_ip(ip);
        if Some(g) == ll {
            continue;
        }
        push(g, GidType::RoceV1);
        push(g, GidType::RoceV2);
    }
    out
}
