//! Field types shared by CLC, LLC and CDC messages.
//!
//! Spec: `protocol-clc.md` §3.6 (system id), §3.7 (RMBE size), §3.8 (QP MTU),
//! §3.10 (GIDs); `protocol-llc-cdc.md` §4.4.

use core::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// A 16-byte RoCE GID, exactly as it appears in the device's GID table and on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID (an unset field).
    pub const ZERO: Gid = Gid([0; 16]);

    /// The RoCE v1 default GID of a port: the IPv6 link-local address formed from
    /// its MAC by modified EUI-64 (flip the universal/local bit, insert `ff:fe`).
    /// `52:54:00:5c:00:01` gives `fe80::5054:ff:fe5c:1`.
    pub fn roce_v1_link_local(mac: Mac) -> Gid {
        let m = mac.0;
        Gid([
            0xfe,
            0x80,
            0,
            0,
            0,
            0,
            0,
            0,
            m[0] ^ 0x02,
            m[1],
            m[2],
            0xff,
            0xfe,
            m[3],
            m[4],
            m[5],
        ])
    }

    /// The RoCE v2 GID of an IPv4 address: the IPv4-mapped IPv6 address `::ffff:a.b.c.d`.
    pub fn from_ipv4(ip: Ipv4Addr) -> Gid {
        Gid(ip.to_ipv6_mapped().octets())
    }

    /// The RoCE v2 GID of an IPv6 address: the address itself.
    pub fn from_ipv6(ip: Ipv6Addr) -> Gid {
        Gid(ip.octets())
    }

    /// The RoCE v2 GID of an IP address (IPv4 becomes `::ffff:a.b.c.d`).
    pub fn from_ip(ip: std::net::IpAddr) -> Gid {
        match ip {
            std::net::IpAddr::V4(v4) => Gid::from_ipv4(v4),
            std::net::IpAddr::V6(v6) => Gid::from_ipv6(v6),
        }
    }

    /// Lower-case hex, 32 digits, no separators (file names, line protocols).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses the [`Gid::to_hex`] form.
    pub fn from_hex(s: &str) -> Option<Gid> {
        if s.len() != 32 {
            return None;
        }
        let mut g = [0u8; 16];
        for (i, b) in g.iter_mut().enumerate() {
            *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Gid(g))
    }

    /// The GID read as an IPv6 address.
    pub fn to_ipv6(self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The IPv4 address if this is an IPv4-mapped (RoCE v2 over IPv4) GID.
    pub fn to_ipv4_mapped(self) -> Option<Ipv4Addr> {
        self.to_ipv6().to_ipv4_mapped()
    }

    /// True for the all-zero GID.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_ipv4_mapped() {
            Some(v4) => write!(f, "::ffff:{v4}"),
            None => write!(f, "{}", self.to_ipv6()),
        }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// A 6-byte Ethernet MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    /// True for `00:00:00:00:00:00` (Linux: "no valid MAC").
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 6]
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mac({self})")
    }
}

/// The 8-byte SMC system identifier ("peer id"): a 2-byte instance number chosen at
/// random once per SMC instance, then the MAC of a RoCE port (`protocol-clc.md` §3.6).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct SystemId(pub [u8; 8]);

impl SystemId {
    /// Builds a system id from an instance number and a MAC.
    pub fn new(instance: u16, mac: Mac) -> SystemId {
        let i = instance.to_be_bytes();
        let m = mac.0;
        SystemId([i[0], i[1], m[0], m[1], m[2], m[3], m[4], m[5]])
    }

    /// The random instance number (bytes 0..2).
    pub fn instance(&self) -> u16 {
        u16::from_be_bytes([self.0[0], self.0[1]])
    }

    /// The MAC part (bytes 2..8).
    pub fn mac(&self) -> Mac {
        let s = self.0;
        Mac([s[2], s[3], s[4], s[5], s[6], s[7]])
    }

    /// Linux treats an id whose MAC part is zero as "not valid" (not sent in Declines).
    pub fn is_valid(&self) -> bool {
        !self.mac().is_zero()
    }
}

impl fmt::Debug for SystemId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SystemId({:04x}/{})", self.instance(), self.mac())
    }
}

/// Largest value a 24-bit wire field (QP number, PSN) can hold.
pub const U24_MAX: u32 = 0x00FF_FFFF;

/// The compressed RMBE size: a 4-bit class `c` meaning `16 KiB << c`
/// (`protocol-clc.md` §3.7). Receivers must accept every class 0..=15.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord, Default)]
pub struct RmbeSize(u8);

impl RmbeSize {
    /// Smallest RMB element: 16 KiB (`SMC_BUF_MIN_SIZE`).
    pub const MIN_BYTES: usize = 16 * 1024;
    /// Largest class the 4-bit field can carry (512 MiB).
    pub const MAX_CLASS: u8 = 15;

    /// The class from its 4-bit wire value; `None` above 15.
    pub fn from_class(c: u8) -> Option<RmbeSize> {
        (c <= Self::MAX_CLASS).then_some(RmbeSize(c))
    }

    /// The 4-bit wire value.
    pub fn class(self) -> u8 {
        self.0
    }

    /// Size in bytes: `2^(class + 14)`.
    pub fn bytes(self) -> usize {
        Self::MIN_BYTES << self.0
    }

    /// The smallest class whose size is at least `size` bytes (Linux
    /// `smc_compress_bufsize`: rounds up to a power of two, minimum 16 KiB), capped at
    /// `max_class`.
    pub fn for_size(size: usize, max_class: u8) -> RmbeSize {
        let max_class = max_class.min(Self::MAX_CLASS);
        let mut c = 0u8;
        while c < max_class && (Self::MIN_BYTES << c) < size {
            c += 1;
        }
        RmbeSize(c)
    }
}

/// The InfiniBand MTU enumeration carried in 4-bit QP MTU fields
/// (`protocol-clc.md` §3.8): 1 = 256 … 5 = 4096 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
#[repr(u8)]
pub enum IbMtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes (RoCE on a 1500-byte Ethernet MTU).
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl IbMtu {
    /// All values, smallest first.
    pub const ALL: [IbMtu; 5] = [
        IbMtu::Mtu256,
        IbMtu::Mtu512,
        IbMtu::Mtu1024,
        IbMtu::Mtu2048,
        IbMtu::Mtu4096,
    ];

    /// Decodes the enum value; `None` for 0 and 6..=15 (invalid on the wire).
    pub fn from_code(code: u8) -> Option<IbMtu> {
        IbMtu::ALL.into_iter().find(|m| *m as u8 == code)
    }

    /// The wire value.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// Payload bytes per packet.
    pub fn bytes(self) -> usize {
        128 << (self as u8)
    }

    /// The largest IB MTU not above `bytes` (`None` below 256).
    pub fn from_bytes_floor(bytes: usize) -> Option<IbMtu> {
        IbMtu::ALL.into_iter().rev().find(|m| m.bytes() <= bytes)
    }

    /// The IB MTU RoCE uses on an Ethernet link of `netdev_mtu` bytes, as the kernel's
    /// `iboe_get_mtu` derives it: subtract the worst-case RoCE headers (GRH 40, UDP 8,
    /// BTH 12, XRC 4, AtomicETH 28, ICRC 4 = 96 bytes) and floor to an IB MTU.
    /// 1500 gives 1024; 4200 and up give 4096.
    pub fn for_ethernet_mtu(netdev_mtu: usize) -> Option<IbMtu> {
        IbMtu::from_bytes_floor(netdev_mtu.saturating_sub(96))
    }
}

/// A 32-byte SMC v2 Enterprise ID (user EID or system EID): uppercase letters,
/// digits, `.` and `-`, padded with blanks (`protocol-clc.md` §3.2.2).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Eid(pub [u8; 32]);

/// Why a string is not a valid user EID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EidError {
    /// Empty or only blanks.
    Empty,
    /// Longer than 32 bytes.
    TooLong(usize),
    /// The first character is not an uppercase letter or digit.
    BadFirstChar(char),
    /// A character other than `A-Z 0-9 . -`.
    BadChar(char),
}

impl fmt::Display for EidError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EidError::Empty => write!(f, "EID is empty"),
            EidError::TooLong(n) => write!(f, "EID is {n} characters long, at most 32 allowed"),
            EidError::BadFirstChar(c) => {
                write!(f, "EID must start with A-Z or 0-9, not {c:?}")
            }
            EidError::BadChar(c) => {
                write!(f, "EID may contain only A-Z, 0-9, '.' and '-', not {c:?}")
            }
        }
    }
}

impl std::error::Error for EidError {}

impl Eid {
    /// Validates a user EID as Linux does (`smc_clc_ueid_valid`) and pads it with blanks.
    pub fn parse_ueid(s: &str) -> Result<Eid, EidError> {
        let t = s.trim_end_matches(' ');
        if t.is_empty() {
            return Err(EidError::Empty);
        }
        if t.len() > 32 {
            return Err(EidError::TooLong(t.len()));
        }
        let mut chars = t.chars();
        if let Some(c) = chars.next() {
            if !(c.is_ascii_uppercase() || c.is_ascii_digit()) {
                return Err(EidError::BadFirstChar(c));
            }
        }
        if let Some(c) = t
            .chars()
            .find(|c| !(c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '.' || *c == '-'))
        {
            return Err(EidError::BadChar(c));
        }
        let mut e = [b' '; 32];
        for (d, s) in e.iter_mut().zip(t.bytes()) {
            *d = s;
        }
        Ok(Eid(e))
    }

    /// The EID without its blank (or NUL) padding, lossily as text.
    pub fn as_str_lossy(&self) -> String {
        String::from_utf8_lossy(&self.0)
            .trim_end_matches([' ', '\0'])
            .to_string()
    }

    /// True if all bytes are zero (no EID).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 32]
    }
}

impl fmt::Debug for Eid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Eid({:?})", self.as_str_lossy())
    }
}

impl fmt::Display for Eid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str_lossy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roce_v1_gid_from_mac_matches_spec_and_capture() {
        // protocol-clc.md §6: MAC 02:00:00:00:00:01 -> fe80::ff:fe00:1
        let g = Gid::roce_v1_link_local(Mac([2, 0, 0, 0, 0, 1]));
        assert_eq!(g.to_ipv6(), "fe80::ff:fe00:1".parse::<Ipv6Addr>().unwrap());
        // capture README §2.1: 52:54:00:5c:00:01 -> GID[0] fe80::5054:ff:fe5c:1
        let g = Gid::roce_v1_link_local(Mac([0x52, 0x54, 0, 0x5c, 0, 1]));
        assert_eq!(g.to_string(), "fe80::5054:ff:fe5c:1");
    }

    #[test]
    fn roce_v2_gids() {
        let g = Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 1));
        assert_eq!(
            g.0,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 1]
        );
        assert_eq!(g.to_ipv4_mapped(), Some(Ipv4Addr::new(10, 99, 0, 1)));
        assert_eq!(g.to_string(), "::ffff:10.99.0.1");
        let v6: Ipv6Addr = "2001:db8::7".parse().unwrap();
        assert_eq!(Gid::from_ipv6(v6).to_ipv6(), v6);
        assert_eq!(Gid::from_ipv6(v6).to_ipv4_mapped(), None);
    }

    #[test]
    fn rmbe_size_both_ways() {
        assert_eq!(RmbeSize::from_class(0).unwrap().bytes(), 16384);
        assert_eq!(RmbeSize::from_class(2).unwrap().bytes(), 65536);
        assert_eq!(RmbeSize::from_class(15).unwrap().bytes(), 512 << 20);
        assert_eq!(RmbeSize::from_class(16), None);
        // Linux smc_compress_bufsize: <= 16K -> 0, rounds up, caps.
        assert_eq!(RmbeSize::for_size(0, 15).class(), 0);
        assert_eq!(RmbeSize::for_size(16384, 15).class(), 0);
        assert_eq!(RmbeSize::for_size(16385, 15).class(), 1);
        assert_eq!(RmbeSize::for_size(65536, 15).class(), 2);
        assert_eq!(RmbeSize::for_size(65537, 15).class(), 3);
        assert_eq!(RmbeSize::for_size(usize::MAX, 5).class(), 5);
        assert_eq!(RmbeSize::for_size(usize::MAX, 99).class(), 15);
        for c in 0..=15 {
            let s = RmbeSize::from_class(c).unwrap();
            assert_eq!(RmbeSize::for_size(s.bytes(), 15), s);
            assert_eq!(RmbeSize::for_size(s.bytes() - 1, 15), s);
        }
    }

    #[test]
    fn ib_mtu_enum() {
        assert_eq!(IbMtu::from_code(3), Some(IbMtu::Mtu1024));
        assert_eq!(IbMtu::Mtu1024.bytes(), 1024);
        assert_eq!(IbMtu::Mtu4096.bytes(), 4096);
        assert_eq!(IbMtu::Mtu256.bytes(), 256);
        assert_eq!(IbMtu::from_code(0), None);
        assert_eq!(IbMtu::from_code(6), None);
        assert_eq!(IbMtu::for_ethernet_mtu(1500), Some(IbMtu::Mtu1024));
        assert_eq!(IbMtu::for_ethernet_mtu(9000), Some(IbMtu::Mtu4096));
        assert_eq!(IbMtu::for_ethernet_mtu(4200), Some(IbMtu::Mtu4096));
        assert_eq!(IbMtu::for_ethernet_mtu(4191), Some(IbMtu::Mtu2048));
        assert_eq!(IbMtu::for_ethernet_mtu(200), None);
        for m in IbMtu::ALL {
            assert_eq!(IbMtu::from_code(m.code()), Some(m));
            assert_eq!(IbMtu::from_bytes_floor(m.bytes()), Some(m));
        }
    }

    #[test]
    fn system_id_parts() {
        let id = SystemId([0x98, 0x15, 0x52, 0x54, 0, 0x5c, 0, 1]);
        assert_eq!(id.instance(), 0x9815);
        assert_eq!(id.mac().to_string(), "52:54:00:5c:00:01");
        assert_eq!(SystemId::new(0x9815, id.mac()), id);
        assert!(id.is_valid());
        assert!(!SystemId([1, 2, 0, 0, 0, 0, 0, 0]).is_valid());
    }

    #[test]
    fn ueid_validation_as_linux() {
        let e = Eid::parse_ueid("SMC-TEST-UEID").unwrap();
        assert_eq!(&e.0[..13], b"SMC-TEST-UEID");
        assert!(e.0[13..].iter().all(|b| *b == b' '));
        assert_eq!(e.to_string(), "SMC-TEST-UEID");
        assert_eq!(Eid::parse_ueid(""), Err(EidError::Empty));
        assert_eq!(Eid::parse_ueid("   "), Err(EidError::Empty));
        assert_eq!(Eid::parse_ueid("smc"), Err(EidError::BadFirstChar('s')));
        assert_eq!(Eid::parse_ueid("-SMC"), Err(EidError::BadFirstChar('-')));
        assert_eq!(Eid::parse_ueid("SMC_X"), Err(EidError::BadChar('_')));
        assert_eq!(Eid::parse_ueid("A B"), Err(EidError::BadChar(' ')));
        assert!(Eid::parse_ueid(&"A".repeat(32)).is_ok());
        assert_eq!(Eid::parse_ueid(&"A".repeat(33)), Err(EidError::TooLong(33)));
    }
}
