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
}

impl Selection {
    /// The chosen device and port.
    pub fn port(&self) -> (&str, u8) {
        match self {
            Selection::ByPnetId { device, port, .. }
            | Selection::HandshakeDevice { device, port } => (device, *port),
        }
    }
}

/// Chooses the RDMA port for a connection whose TCP traffic leaves through
/// `base_netdev` (after walking down VLAN/bond devices, see [`base_netdev`]),
/// following `tools.md` §6: if the interface has a PNET ID, the first active port
/// with the same PNET ID; otherwise the first active port whose own interface is
/// `base_netdev`. `None` means no device: the connection declines with
/// "no SMC device found". Callers check GIDs (VLAN, RoCE v2 route) afterwards.
pub fn select_port(table: &PnetTable, base_netdev: &str, ports: &[PortInfo]) -> Option<Selection> {
    match table.pnetid_of_interface(base_netdev) {
        Some(id) => ports
            .iter()
            .filter(|p| p.active)
            .find(|p| table.pnetid_of_port(&p.device, p.port) == Some(id))
            .map(|p| Selection::ByPnetId {
                pnetid: id.clone(),
                device: p.device.clone(),
                port: p.port,
            }),
        None => ports
            .iter()
            .filter(|p| p.active)
            .find(|p| p.netdev.as_deref() == Some(base_netdev))
            .map(|p| Selection::HandshakeDevice {
                device: p.device.clone(),
                port: p.port,
            }),
    }
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

    fn port(d: &str, p: u8, nd: Option<&str>, active: bool) -> PortInfo {
        PortInfo {
            device: d.into(),
            port: p,
            netdev: nd.map(Into::into),
            active,
        }
    }

    #[test]
    fn device_selection_rules() {
        let ports = [
            port("mlx5_0", 1, Some("eth0"), true),
            port("mlx5_1", 1, Some("eth1"), false),
            port("shm0", 1, Some("veth0"), true),
        ];
        let mut t = PnetTable::new();
        // no PNET ID: the handshake device whose netdev is the interface
        assert_eq!(
            select_port(&t, "eth0", &ports),
            Some(Selection::HandshakeDevice {
                device: "mlx5_0".into(),
                port: 1
            })
        );
        assert_eq!(select_port(&t, "eth1", &ports), None, "inactive port");
        assert_eq!(select_port(&t, "eth9", &ports), None);
        // a PNET ID for the interface: only ports of that PNET qualify
        t.add(&id("NETA"), Some("eth9"), Some(("shm0", 1))).unwrap();
        assert_eq!(
            select_port(&t, "eth9", &ports),
            Some(Selection::ByPnetId {
                pnetid: id("NETA"),
                device: "shm0".into(),
                port: 1
            })
        );
        t.add(&id("NETB"), Some("eth0"), None).unwrap();
        assert_eq!(
            select_port(&t, "eth0", &ports),
            None,
            "PNET without a device port"
        );
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
