//! The PNET table and RDMA device selection.
//!
//! Spec: `tools.md` §2.3 (`smc_pnet` rules and output) and §6 (kernel semantics of
//! `net/smc/smc_pnet.c`). A PNET ID names a physical network; giving an Ethernet
//! interface and an RDMA device port the same PNET ID says they reach the same
//! hosts, so connections leaving through that interface may use that port.
//!
//! Differences from the kernel, all deliberate:
//! * There are no hardware (firmware-defined) PNET IDs off IBM Z, so every ID here
//!   is user-defined.
//! * Uniqueness of device entries is per (device, port): the kernel's duplicate
//!   check keys on the device name only, so a second port of the same device is
//!   applied but then reported as a duplicate (`tools.md` §6, "observed quirk").
//! * The table is one file per configuration directory instead of per network
//!   namespace (see [`crate::store`]).

use crate::store::Table;
use core::fmt;
use smc_wire::types::Gid;
use std::path::Path;

/// File name of the table inside the configuration directory.
pub const FILE: &str = "pnet.conf";
/// Longest PNET ID.
pub const MAX_PNETID_LEN: usize = 16;
/// Longest Ethernet interface name (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;
/// Longest RDMA device name (IB_DEVICE_NAME_MAX - 1).
pub const MAX_IBNAME_LEN: usize = 63;

/// A validated PNET ID: 1 to 16 ASCII letters and digits, stored upper case.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PnetId(String);

impl PnetId {
    /// Validates as the kernel does: blanks around the ID are stripped, lower case
    /// is folded to upper case, interior blanks and other characters are invalid.
    pub fn parse(s: &str) -> Result<PnetId, PnetError> {
        let t = s.trim_matches(' ');
        if t.is_empty() || t.len() > MAX_PNETID_LEN || !t.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(PnetError::InvalidPnetId(s.to_string()));
        }
        Ok(PnetId(t.to_ascii_uppercase()))
    }

    /// The ID.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PnetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a table row binds to a PNET ID.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PnetTarget {
    /// An Ethernet interface, by name.
    Eth(String),
    /// A port (1 or 2) of an RDMA device, by device name.
    Ib {
        /// RDMA device name (`mlx5_0`, `rxe0`, or one of our `shm` devices).
        device: String,
        /// Port number, 1 or 2.
        port: u8,
    },
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PnetEntry {
    /// The physical network.
    pub pnetid: PnetId,
    /// What belongs to it.
    pub target: PnetTarget,
}

impl PnetEntry {
    /// The row as `smc_pnet` prints it: `<PNETID> <ethname|n/a> <ibname|n/a> <port>`,
    /// with port 255 for Ethernet rows (the kernel reports 0xff there).
    pub fn smc_pnet_line(&self) -> String {
        match &self.target {
            PnetTarget::Eth(ifname) => format!("{} {} n/a 255", self.pnetid, ifname),
            PnetTarget::Ib { device, port } => format!("{} n/a {} {}", self.pnetid, device, port),
        }
    }
}

/// Why a table operation failed. The `Display` texts are those `smc_pnet` users know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PnetError {
    /// The PNET ID is not 1-16 letters and digits.
    InvalidPnetId(String),
    /// An interface name is empty or longer than 15 characters.
    InvalidInterface(String),
    /// A device name is empty, too long or has blanks.
    InvalidDevice(String),
    /// The port is not 1 or 2.
    InvalidPort(u32),
    /// The interface or device port already belongs to a PNET (`EEXIST`).
    Exists,
    /// No row has this PNET ID (`ENOENT`).
    NotFound,
    /// A line of the table file cannot be parsed.
    BadFile {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

impl fmt::Display for PnetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PnetError::InvalidPnetId(_)
            | PnetError::InvalidInterface(_)
            | PnetError::InvalidDevice(_)
            | PnetError::InvalidPort(_) => f.write_str("Invalid input data or parameter"),
            PnetError::Exists => f.write_str("Object exists"),
            PnetError::NotFound => f.write_str("Object not found"),
            PnetError::BadFile { line, reason } => {
                write!(f, "{FILE} line {line}: {reason}")
            }
        }
    }
}

impl std::error::Error for PnetError {}

/// The PNET table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PnetTable {
    entries: Vec<PnetEntry>,
}

fn check_ifname(s: &str) -> Result<(), PnetError> {
    if s.is_empty()
        || s.len() > MAX_IFNAME_LEN
        || s.contains(|c: char| c.is_whitespace() || c == '/')
    {
        return Err(PnetError::InvalidInterface(s.to_string()));
    }
    Ok(())
}

fn check_device(s: &str) -> Result<(), PnetError> {
    if s.is_empty() || s.len() > MAX_IBNAME_LEN || s.contains(char::is_whitespace) {
        return Err(PnetError::InvalidDevice(s.to_string()));
    }
    Ok(())
}

impl PnetTable {
    /// An empty table.
    pub fn new() -> PnetTable {
        PnetTable::default()
    }

    /// All rows, in insertion order.
    pub fn entries(&self) -> &[PnetEntry] {
        &self.entries
    }

    /// Parses the table file. Lines: `<PNETID> eth <ifname>` or
    /// `<PNETID> ib <device> <port>`; `#` starts a comment. Any other line is an
    /// error naming its line number (a typo must not silently disable SMC).
    pub fn parse(text: &str) -> Result<PnetTable, PnetError> {
        let mut t = PnetTable::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| PnetError::BadFile {
                line: i + 1,
                reason,
            };
            let f: Vec<&str> = line.split_whitespace().collect();
            let entry = match f.as_slice() {
                [id, "eth", ifname] => {
                    let pnetid = PnetId::parse(id).map_err(|e| bad(e.to_string()))?;
                    check_ifname(ifname).map_err(|_| bad(format!("invalid interface {ifname:?}")))?;
                    PnetEntry {
                        pnetid,
                        target: PnetTarget::Eth(ifname.to_string()),
                    }
                }
                [id, "ib", device, port] => {
                    let pnetid = PnetId::parse(id).map_err(|e| bad(e.to_string()))?;
                    check_device(device).map_err(|_| bad(format!("invalid device {device:?}")))?;
                    let port: u8 = match port.parse() {
                        Ok(p @ 1..=2) => p,
                        _ => return Err(bad(format!("invalid port {port:?}"))),
                    };
                    PnetEntry {
                        pnetid,
                        target: PnetTarget::Ib {
                            device: device.to_string(),
                            port,
                        },
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "expected `<PNETID> eth <interface>` or `<PNETID> ib <device> <port>`, got {line:?}"
                    )))
                }
            };
            if t.conflicts(&entry) {
                return Err(bad(format!("duplicate entry for {:?}", entry.target)));
            }
            t.entries.push(entry);
        }
        Ok(t)
    }

    /// The table file text.
    pub fn to_file(&self) -> String {
        let mut s = String::from(
            "# smc-rs PNET table, maintained by smc_pnet.\n\
             # <PNETID> eth <interface>  |  <PNETID> ib <device> <port>\n",
        );
        for e in &self.entries {
            match &e.target {
                PnetTarget::Eth(i) => s.push_str(&format!("{} eth {}\n", e.pnetid, i)),
                PnetTarget::Ib { device, port } => {
                    s.push_str(&format!("{} ib {} {}\n", e.pnetid, device, port))
                }
            }
        }
        s
    }

    fn conflicts(&self, e: &PnetEntry) -> bool {
        self.entries.iter().any(|x| x.target == e.target)
    }

    /// `smc_pnet -a ID [-I IF] [-D DEV [-P PORT]]`: adds the interface and/or the
    /// device port to the PNET. With both, succeeds if at least one half was new
    /// (as the kernel does); fails with [`PnetError::Exists`] if nothing was added.
    pub fn add(
        &mut self,
        pnetid: &PnetId,
        interface: Option<&str>,
        device: Option<(&str, u8)>,
    ) -> Result<(), PnetError> {
        if let Some(i) = interface {
            check_ifname(i)?;
        }
        if let Some((d, p)) = device {
            check_device(d)?;
            if !(1..=2).contains(&p) {
                return Err(PnetError::InvalidPort(u32::from(p)));
            }
        }
        let mut new = Vec::new();
        if let Some(i) = interface {
            new.push(PnetEntry {
                pnetid: pnetid.clone(),
                target: PnetTarget::Eth(i.to_string()),
            });
        }
        if let Some((d, p)) = device {
            new.push(PnetEntry {
                pnetid: pnetid.clone(),
                target: PnetTarget::Ib {
                    device: d.to_string(),
                    port: p,
                },
            });
        }
        if new.is_empty() {
            return Err(PnetError::InvalidInterface(String::new()));
        }
        let mut added = false;
        for e in new {
            if !self.conflicts(&e) {
                self.entries.push(e);
                added = true;
            }
        }
        if added {
            Ok(())
        } else {
            Err(PnetError::Exists)
        }
    }

    /// `smc_pnet -d ID`: removes every row of the PNET.
    pub fn delete(&mut self, pnetid: &PnetId) -> Result<(), PnetError> {
        let before = self.entries.len();
        self.entries.retain(|e| &e.pnetid != pnetid);
        if self.entries.len() == before {
            Err(PnetError::NotFound)
        } else {
            Ok(())
        }
    }

    /// `smc_pnet -s ID`: the rows of one PNET.
    pub fn show(&self, pnetid: &PnetId) -> Result<Vec<&PnetEntry>, PnetError> {
        let v: Vec<_> = self
            .entries
            .iter()
            .filter(|e| &e.pnetid == pnetid)
            .collect();
        if v.is_empty() {
            Err(PnetError::NotFound)
        } else {
            Ok(v)
        }
    }

    /// `smc_pnet -f`: empties the table.
    pub fn flush(&mut self) {
        self.entries.clear();
    }

    /// The PNET ID of an Ethernet interface, if the table names it.
    pub fn pnetid_of_interface(&self, ifname: &str) -> Option<&PnetId> {
        self.entries
            .iter()
            .find(|e| matches!(&e.target, PnetTarget::Eth(i) if i == ifname))
            .map(|e| &e.pnetid)
    }

    /// The PNET ID of an RDMA device port, if the table names it.
    pub fn pnetid_of_port(&self, device: &str, port: u8) -> Option<&PnetId> {
        self.entries
            .iter()
            .find(|e| {
                matches!(&e.target, PnetTarget::Ib { device: d, port: p } if d == device && *p == port)
            })
            .map(|e| &e.pnetid)
    }
}

/// One port of an RDMA device, as device selection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Device name.
    pub device: String,
    /// Port number (1-based).
    pub port: u8,
    /// The Ethernet interface the port belongs to (RoCE), if known.
    pub netdev: Option<String>,
    /// The port is ACTIVE.
    pub active: bool,
    /// The port has a RoCE v1 GID, which SMC-R v1 needs (smc_ib.c
    /// `smc_ib_determine_gid_rcu` without `smcrv2`; VLANs are not told
    /// apart here).
    pub roce_v1: bool,
    /// The port's RoCE v2 GIDs (SMC-R v2 needs the connection's, see
    /// [`Route::v2_gid`]).
    pub roce_v2: Vec<Gid>,
}

/// A connection, as device selection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route<'a> {
    /// The base interface (see [`base_netdev`]) of the interface the
    /// connection's TCP traffic leaves through.
    pub base_netdev: &'a str,
    /// The RoCE v2 GID SMC-R v2 would use: the IPv4-mapped local address
    /// (`::ffff:a.b.c.d`). `None` where SMC-R v2 is not possible: an IPv6
    /// connection (Linux 6.12 offers SMC-R v2 over IPv4 only, af_smc.c
    /// `smc_find_proposal_devices`) or no UEID configured.
    pub v2_gid: Option<Gid>,
}

impl PortInfo {
    /// Whether the port has a GID the connection can use (smc_pnet.c
    /// `smc_pnet_determine_gid`: a RoCE v1 GID for SMC-R v1, the RoCE v2 GID
    /// of the connection's local IPv4 address for SMC-R v2).
    fn has_gid_for(&self, route: &Route<'_>) -> bool {
        self.roce_v1 || route.v2_gid.is_some_and(|g| self.roce_v2.contains(&g))
    }
}

/// How a port was chosen for a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// The interface and the port share a PNET ID.
    ByPnetId {
        /// The shared PNET ID.
        pnetid: PnetId,
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// No PNET ID for the interface: the port whose own interface is the
    /// connection's base interface (the kernel's "handshake device" rule).
    HandshakeDevice {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// No PNET ID for the interface: a port whose interface is not known
    /// as the base interface but that carries the connection's RoCE v2 GID,
    /// `::ffff:<local address>`. The kernel derives that GID from the
    /// interface that has the address, so it reaches the port through the
    /// handshake-device rule; here a port's interface name may be unknown
    /// (a verbs port without a readable `gid_attrs/ndevs`) or differ from
    /// the one in our network namespace.
    ByRoceV2Gid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
}

impl Selection {
    /// The chosen device and port.
    pub fn port(&self) -> (&str, u8) {
        match self {
            Selection::ByPnetId { device, port, .. }
            | Selection::HandshakeDevice { device, port }
            | Selection::ByRoceV2Gid { device, port } => (device, *port),
        }
    }
}

/// Every port that may serve a connection on `route`, in the order of
/// `ports`, following smc_pnet.c `smc_pnet_find_roce_by_pnetid` (see
/// `tools.md` §6): if the base interface has a PNET ID, the active ports
/// with the same PNET ID; otherwise the active ports whose own interface is
/// the base interface ("handshake device", `smc_pnet_find_rdma_dev`), or
/// that carry the connection's RoCE v2 GID ([`Selection::ByRoceV2Gid`]).
/// Either way only ports with a GID the connection can use
/// (`smc_pnet_determine_gid`); a port without one is passed over, as the
/// kernel goes on to the next. Empty: no device, the connection declines
/// with "no SMC device found". The kernel takes the first; the caller may
/// pass over ports that cannot reach the peer (a shared-memory device and
/// a peer on another host).
pub fn candidates(table: &PnetTable, route: &Route<'_>, ports: &[PortInfo]) -> Vec<Selection> {
    let usable = ports.iter().filter(|p| p.active && p.has_gid_for(route));
    match table.pnetid_of_interface(route.base_netdev) {
        Some(id) => usable
            .filter(|p| table.pnetid_of_port(&p.device, p.port) == Some(id))
            .map(|p| Selection::ByPnetId {
                pnetid: id.clone(),
                device: p.device.clone(),
                port: p.port,
            })
            .collect(),
        None => usable
            .filter_map(|p| {
                let (device, port) = (p.device.clone(), p.port);
                if p.netdev.as_deref() == Some(route.base_netdev) {
                    Some(Selection::HandshakeDevice { device, port })
                } else if route.v2_gid.is_some_and(|g| p.roce_v2.contains(&g)) {
                    Some(Selection::ByRoceV2Gid { device, port })
                } else {
                    None
                }
            })
            .collect(),
    }
}

/// The ports that may carry a further link of an SMC-R v2 link group whose
/// first link is on port `first`, with the group's source address `local` in
/// a subnet of `prefix_len` bits, in the order of `ports`. The kernel's
/// alternate for a v2 group (smc_pnet.c `smc_pnet_find_alt_roce`): another
/// device, active, whose port has the group's PNET ID — the first port's,
/// none matching none —, and (smc_ib.c `smc_ib_determine_gid_rcu` with
/// `smcrv2`) a RoCE v2 GID of an IPv4 address whose interface has an address
/// in the subnet of the group's source address. Here the GID's own address
/// stands for its interface's (a RoCE v2 GID is made from an address of its
/// interface). So a v2 group's second link needs a second device on the
/// same IP subnet, not only on the same PNET ID.
pub fn v2_alternates(
    table: &PnetTable,
    first: (&str, u8),
    local: std::net::Ipv4Addr,
    prefix_len: u8,
    ports: &[PortInfo],
) -> Vec<(String, u8)> {
    let mask = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    let net = |a: std::net::Ipv4Addr| u32::from(a) & mask;
    let pnetid = table.pnetid_of_port(first.0, first.1);
    ports
        .iter()
        .filter(|p| p.device != first.0 && p.active)
        .filter(|p| table.pnetid_of_port(&p.device, p.port) == pnetid)
        .filter(|p| {
            p.roce_v2
                .iter()
                .filter_map(|g| g.to_ipv4_mapped())
                .any(|a| net(a) == net(local))
        })
        .map(|p| (p.device.clone(), p.port))
        .collect()
}

/// The port the kernel would choose: the first of [`candidates`]. `None`
/// means no device: the connection declines with "no SMC device found".
pub fn select_port(table: &PnetTable, route: &Route<'_>, ports: &[PortInfo]) -> Option<Selection> {
    candidates(table, route, ports).into_iter().next()
}

/// Walks down stacked interfaces (VLAN, macvlan, bond, ...) to the base interface
/// the kernel uses for PNET lookups, reading `<sysfs_net>/<if>/lower_*` links
/// (`sysfs_net` is normally `/sys/class/net`). Where an interface has several
/// lower devices (a bond), the first in name order is followed. Unknown
/// interfaces are their own base.
pub fn base_netdev(sysfs_net: &Path, ifname: &str) -> String {
    let mut cur = ifname.to_string();
    for _ in 0..8 {
        let Ok(rd) = std::fs::read_dir(sysfs_net.join(&cur)) else {
            break;
        };
        let mut lowers: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|n| n.strip_prefix("lower_").map(str::to_string))
            .collect();
        lowers.sort();
        match lowers.into_iter().next() {
            Some(l) => cur = l,
            None => break,
        }
    }
    cur
}

impl Table for PnetTable {
    type Error = PnetError;
    const FILE: &'static str = FILE;
    fn parse(text: &str) -> Result<Self, PnetError> {
        PnetTable::parse(text)
    }
    fn to_file(&self) -> String {
        PnetTable::to_file(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> PnetId {
        PnetId::parse(s).unwrap()
    }

    #[test]
    fn pnetid_validation_as_kernel() {
        assert_eq!(id(" net1 ").as_str(), "NET1");
        assert_eq!(id("A234567890123456").as_str().len(), 16);
        for bad in ["", "   ", "A2345678901234567", "NET 1", "NET-1", "NÉT"] {
            assert!(PnetId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn add_show_delete_flush_and_output_format() {
        let mut t = PnetTable::new();
        t.add(&id("NET1"), Some("eth1"), None).unwrap();
        t.add(&id("NET1"), None, Some(("mlx5_0", 1))).unwrap();
        t.add(&id("net2"), Some("eth2"), Some(("0000:3b:00.1", 1)))
            .unwrap();
        let lines: Vec<_> = t.entries().iter().map(|e| e.smc_pnet_line()).collect();
        assert_eq!(
            lines,
            [
                "NET1 eth1 n/a 255",
                "NET1 n/a mlx5_0 1",
                "NET2 eth2 n/a 255",
                "NET2 n/a 0000:3b:00.1 1"
            ]
        );
        assert_eq!(t.show(&id("NET1")).unwrap().len(), 2);
        // duplicates: the interface or port already has a PNET ID
        assert_eq!(
            t.add(&id("NET3"), Some("eth1"), None),
            Err(PnetError::Exists)
        );
        assert_eq!(
            t.add(&id("NET3"), None, Some(("mlx5_0", 1))),
            Err(PnetError::Exists)
        );
        // one new half is enough
        t.add(&id("NET1"), Some("eth1"), Some(("mlx5_0", 2)))
            .unwrap();
        assert_eq!(t.pnetid_of_port("mlx5_0", 2), Some(&id("NET1")));
        assert_eq!(
            t.add(&id("NET1"), None, Some(("mlx5_0", 3))),
            Err(PnetError::InvalidPort(3))
        );
        assert!(matches!(
            t.add(&id("NET1"), Some("a-very-long-ifname"), None),
            Err(PnetError::InvalidInterface(_))
        ));
        t.delete(&id("NET2")).unwrap();
        assert_eq!(t.delete(&id("NET2")), Err(PnetError::NotFound));
        assert_eq!(t.show(&id("NET2")), Err(PnetError::NotFound));
        // file round trip
        assert_eq!(PnetTable::parse(&t.to_file()).unwrap(), t);
        t.flush();
        assert!(t.entries().is_empty());
    }

    #[test]
    fn malformed_file_names_the_line() {
        let e = PnetTable::parse("# c\nNET1 eth eth0\nNET1 ib dev 7\n").unwrap_err();
        assert!(matches!(e, PnetError::BadFile { line: 3, .. }), "{e:?}");
        let e = PnetTable::parse("NET1 eth eth0\nNET2 eth eth0\n").unwrap_err();
        assert!(matches!(e, PnetError::BadFile { line: 2, .. }), "{e:?}");
        let e = PnetTable::parse("garbage\n").unwrap_err();
        assert!(e.to_string().contains("line 1"));
    }

    /// A v2 group's alternate (smc_pnet.c `smc_pnet_find_alt_roce`, smc_ib.c
    /// `smc_ib_determine_gid_rcu`): another active device with the first
    /// port's PNET ID (none matching none) and a RoCE v2 GID in the subnet
    /// of the group's source address; a second rxe on another subnet is no
    /// alternate, nor one on a PNET ID of its own.
    #[test]
    fn v2_alternates_as_the_kernel() {
        let ports = vec![
            port("rxe0", 1, Some("eth0"), true, false, &["10.99.0.2"]),
            port("rxe1", 1, Some("eth1"), true, false, &["10.99.0.12"]),
            port("rxe2", 1, Some("eth2"), true, false, &["10.97.0.2"]),
            port("rxe3", 1, Some("eth3"), false, false, &["10.99.0.13"]),
            port("rxe4", 1, Some("eth4"), true, false, &["10.99.0.14"]),
        ];
        let local = "10.99.0.2".parse().unwrap();
        let mut t = PnetTable::new();
        t.add(&id("OTHER"), None, Some(("rxe4", 1))).unwrap();
        assert_eq!(
            v2_alternates(&t, ("rxe0", 1), local, 24, &ports),
            [("rxe1".to_string(), 1)]
        );
        // a /8 takes in rxe2's subnet too
        assert_eq!(
            v2_alternates(&t, ("rxe0", 1), local, 8, &ports),
            [("rxe1".to_string(), 1), ("rxe2".to_string(), 1)]
        );
        // the first port on a PNET ID: only ports on the same one
        t.add(&id("NET1"), None, Some(("rxe0", 1))).unwrap();
        assert!(v2_alternates(&t, ("rxe0", 1), local, 24, &ports).is_empty());
        t.add(&id("NET1"), None, Some(("rxe1", 1))).unwrap();
        assert_eq!(
            v2_alternates(&t, ("rxe0", 1), local, 24, &ports),
            [("rxe1".to_string(), 1)]
        );
    }

    /// A port with a RoCE v1 GID (`v1`) and the RoCE v2 GIDs of `v2`.
    fn port(d: &str, p: u8, nd: Option<&str>, active: bool, v1: bool, v2: &[&str]) -> PortInfo {
        PortInfo {
            device: d.into(),
            port: p,
            netdev: nd.map(Into::into),
            active,
            roce_v1: v1,
            roce_v2: v2.iter().map(|a| gid(a)).collect(),
        }
    }

    fn gid(addr: &str) -> Gid {
        Gid::from_ip(addr.parse().unwrap())
    }

    /// The ports every row of the table below chooses from.
    fn ports() -> Vec<PortInfo> {
        vec![
            // an RNIC with RoCE v1 and v2 GIDs
            port("mlx5_0", 1, Some("eth0"), true, true, &["10.0.0.1"]),
            port("mlx5_1", 1, Some("eth1"), false, true, &["10.1.0.1"]),
            port("shm0", 1, Some("veth0"), true, true, &["10.2.0.1"]),
            // Soft-RoCE: RoCE v2 GIDs only
            port("rxe0", 1, Some("enp0s2"), true, false, &["10.99.0.2"]),
            // a port whose interface name is not known
            port("rxe1", 1, None, true, false, &["10.98.0.2"]),
        ]
    }

    /// Device selection, one row per rule: the PNET table, and what decides
    /// without an entry (the port's own interface, the RoCE v2 GID).
    #[test]
    fn device_selection_rules() {
        use Selection as S;
        let hs = |d: &str| S::HandshakeDevice {
            device: d.into(),
            port: 1,
        };
        let v2 = |d: &str| S::ByRoceV2Gid {
            device: d.into(),
            port: 1,
        };
        let by_id = |id_: &str, d: &str| S::ByPnetId {
            pnetid: id(id_),
            device: d.into(),
            port: 1,
        };
        let mut pnet = PnetTable::new();
        pnet.add(&id("NETA"), Some("eth9"), Some(("shm0", 1)))
            .unwrap();
        pnet.add(&id("NETB"), Some("eth0"), None).unwrap();
        pnet.add(&id("NETC"), Some("enp0s2"), Some(("rxe1", 1)))
            .unwrap();
        let none = PnetTable::new();
        // (table, base interface, v2 GID of the connection, expected choices, why)
        type Row<'a> = (&'a PnetTable, &'a str, Option<&'a str>, Vec<S>, &'a str);
        let rows: Vec<Row<'_>> = vec![
            (
                &none,
                "eth0",
                None,
                vec![hs("mlx5_0")],
                "no PNET ID: the port of the interface",
            ),
            (
                &none,
                "eth0",
                Some("10.0.0.1"),
                vec![hs("mlx5_0")],
                "same with v2",
            ),
            (&none, "eth1", None, vec![], "its port is not active"),
            (&none, "eth9", None, vec![], "no port has that interface"),
            (
                &none,
                "enp0s2",
                None,
                vec![],
                "rxe0 has no RoCE v1 GID and v2 is off",
            ),
            (
                &none,
                "enp0s2",
                Some("10.99.0.2"),
                vec![hs("rxe0")],
                "rxe0 by its interface, v2",
            ),
            (
                &none,
                "enp0s2",
                Some("10.99.0.3"),
                vec![],
                "rxe0 lacks the connection's v2 GID",
            ),
            (
                &none,
                "veth7",
                Some("10.98.0.2"),
                vec![v2("rxe1")],
                "rxe1 by its v2 GID",
            ),
            (
                &none,
                "eth0",
                Some("10.98.0.2"),
                vec![hs("mlx5_0"), v2("rxe1")],
                "both rules, port order",
            ),
            (
                &pnet,
                "eth9",
                None,
                vec![by_id("NETA", "shm0")],
                "a PNET ID: its ports only",
            ),
            (
                &pnet,
                "veth0",
                None,
                vec![hs("shm0")],
                "the port's PNET ID does not matter without the interface's",
            ),
            (
                &pnet,
                "eth0",
                None,
                vec![],
                "a PNET ID without ports: nothing, not the handshake device",
            ),
            (
                &pnet,
                "enp0s2",
                Some("10.99.0.2"),
                vec![],
                "PNET ID wins over the interface: rxe1 lacks the GID",
            ),
            (
                &pnet,
                "enp0s2",
                Some("10.98.0.2"),
                vec![by_id("NETC", "rxe1")],
                "PNET ID wins over the interface",
            ),
        ];
        let ports = ports();
        for (table, base, v2_gid, want, why) in rows {
            let route = Route {
                base_netdev: base,
                v2_gid: v2_gid.map(gid),
            };
            assert_eq!(candidates(table, &route, &ports), want, "{why}");
            assert_eq!(
                select_port(table, &route, &ports),
                want.first().cloned(),
                "{why}"
            );
        }
    }

    #[test]
    fn base_netdev_walks_lower_links() {
        let root = std::env::temp_dir().join(format!("smc-config-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for d in ["vlan10", "bond0", "eth0", "eth1"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::create_dir_all(root.join("vlan10/lower_bond0")).unwrap();
        std::fs::create_dir_all(root.join("bond0/lower_eth1")).unwrap();
        std::fs::create_dir_all(root.join("bond0/lower_eth0")).unwrap();
        assert_eq!(base_netdev(&root, "vlan10"), "eth0");
        assert_eq!(base_netdev(&root, "eth1"), "eth1");
        assert_eq!(base_netdev(&root, "nosuch"), "nosuch");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
