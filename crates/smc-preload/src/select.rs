//! Which sockets the library converts: `SMC_RUN_PORTS` and `SMC_RUN_DESTS`
//! (`smc_run -p`, `-a`). Shared by the library and `smc_run` (which checks
//! the lists before it starts the program); no `unsafe` here.
//!
//! * `SMC_RUN_PORTS=LIST`: ports and ranges, `6379,8000-8100`. A
//!   `connect()` is converted only to a port in the list, a `listen()` only
//!   on one (its local port, as bound).
//! * `SMC_RUN_DESTS=LIST`: addresses and prefixes,
//!   `10.0.0.0/8,192.168.1.5,fd00::/8`. A `connect()` is converted only to
//!   an address in the list (an IPv4-mapped IPv6 address counts as the IPv4
//!   one); listening sockets have no destination and are not limited by it.
//!
//! Both set: a connect must match both. Unset (or empty): no limit. A
//! socket that is not converted is left to the kernel before its SYN: no
//! SMC option, plain TCP, nothing of the library on it.

use std::net::{IpAddr, SocketAddr};

/// The parsed lists (`None`: no limit of that kind).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Select {
    pub ports: Option<Vec<(u16, u16)>>,
    pub dests: Option<Vec<(IpAddr, u8)>>,
}

/// `80,443,8000-8100` (ranges inclusive, low <= high, no port 0).
pub fn parse_ports(s: &str) -> Result<Vec<(u16, u16)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let port = |x: &str| match x.trim().parse::<u16>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("invalid port '{x}' in '{s}'")),
            };
            let (lo, hi) = match p.split_once('-') {
                Some((a, b)) => (port(a)?, port(b)?),
                None => (port(p)?, port(p)?),
            };
            if lo > hi {
                return Err(format!("invalid port range '{p}' in '{s}'"));
            }
            Ok((lo, hi))
        })
        .collect()
}

/// `10.0.0.0/8,192.168.1.5,::1,fd00::/8`.
pub fn parse_dests(s: &str) -> Result<Vec<(IpAddr, u8)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            let bad = || format!("invalid address or prefix '{d}' in '{s}'");
            let (a, len) = match d.split_once('/') {
                Some((a, l)) => (a, Some(l.parse::<u8>().map_err(|_| bad())?)),
                None => (d, None),
            };
            let a: IpAddr = a.parse().map_err(|_| bad())?;
            let max = if a.is_ipv4() { 32 } else { 128 };
            let len = len.unwrap_or(max);
            if len > max {
                return Err(bad());
            }
            Ok((a, len))
        })
        .collect()
}

/// `a` with its first `len` bits kept, as one number (IPv4 in the low 32).
fn bits(a: IpAddr) -> (u128, u8) {
    match a {
        IpAddr::V4(v) => (u128::from(u32::from(v)), 32),
        IpAddr::V6(v) => match v.to_ipv4_mapped() {
            Some(v4) => (u128::from(u32::from(v4)), 32),
            None => (u128::from(v), 128),
        },
    }
}

fn in_prefix(a: IpAddr, (net, len): (IpAddr, u8)) -> bool {
    let ((a, aw), (n, nw)) = (bits(a), bits(net));
    // (a mapped prefix of IPv4 width: its length counts from bit 96)
    let len = if nw == 32 && net.is_ipv6() {
        len.saturating_sub(96)
    } else {
        len
    };
    if aw != nw {
        return false;
    }
    let shift = u32::from(aw - len.min(aw));
    shift >= 128 || (a >> shift) == (n >> shift)
}

impl Select {
    /// From `SMC_RUN_PORTS` and `SMC_RUN_DESTS` (as `getenv` gives them).
    pub fn from_env(ports: Option<&str>, dests: Option<&str>) -> Result<Select, String> {
        fn nonempty(v: Option<&str>) -> Option<&str> {
            v.filter(|v| !v.trim().is_empty())
        }
        Ok(Select {
            ports: nonempty(ports).map(parse_ports).transpose()?,
            dests: nonempty(dests).map(parse_dests).transpose()?,
        })
    }

    /// No limit at all: every TCP socket is converted (the default).
    pub fn is_all(&self) -> bool {
        self.ports.is_none() && self.dests.is_none()
    }

    fn port_ok(&self, port: u16) -> bool {
        self.ports
            .as_ref()
            .is_none_or(|l| l.iter().any(|&(lo, hi)| (lo..=hi).contains(&port)))
    }

    /// Whether a `connect()` to `to` is converted; `Err` names the list
    /// that excludes it.
    pub fn connect(&self, to: SocketAddr) -> Result<(), &'static str> {
        if !self.port_ok(to.port()) {
            return Err("SMC_RUN_PORTS");
        }
        if let Some(l) = &self.dests {
            if !l.iter().any(|&p| in_prefix(to.ip(), p)) {
                return Err("SMC_RUN_DESTS");
            }
        }
        Ok(())
    }

    /// Whether a `listen()` on local port `port` is converted.
    pub fn listen(&self, port: u16) -> Result<(), &'static str> {
        if self.port_ok(port) {
            Ok(())
        } else {
            Err("SMC_RUN_PORTS")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(p: &str, d: &str) -> Select {
        Select::from_env(Some(p), Some(d)).unwrap()
    }

    #[test]
    fn ports_and_ranges() {
        let s = sel("80, 8000-8002", "");
        assert!(s.connect("1.2.3.4:80".parse().unwrap()).is_ok());
        assert!(s.connect("1.2.3.4:8002".parse().unwrap()).is_ok());
        assert_eq!(
            s.connect("1.2.3.4:8003".parse().unwrap()),
            Err("SMC_RUN_PORTS")
        );
        assert!(s.listen(8001).is_ok());
        assert!(s.listen(81).is_err());
        assert!(s.listen(0).is_err());
        for bad in ["0", "x", "9-8", "70000", "1-"] {
            assert!(parse_ports(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn destinations_and_prefixes() {
        let s = sel(
            "",
            "10.0.0.0/8, 192.168.1.5, fd00::/8, ::ffff:172.16.0.0/108",
        );
        for ok in [
            "10.9.8.7:1",
            "192.168.1.5:1",
            "[fd12::1]:1",
            "[::ffff:10.1.1.1]:1",
            "172.16.3.4:1",
        ] {
            assert!(s.connect(ok.parse().unwrap()).is_ok(), "{ok}");
        }
        for no in ["11.0.0.1:1", "192.168.1.6:1", "[fe80::1]:1", "172.32.0.1:1"] {
            assert_eq!(s.connect(no.parse().unwrap()), Err("SMC_RUN_DESTS"), "{no}");
        }
        // listeners have no destination
        assert!(s.listen(1).is_ok());
        assert!(sel("", "0.0.0.0/0")
            .connect("8.8.8.8:53".parse().unwrap())
            .is_ok());
        for bad in ["10.0.0.0/33", "host", "::1/129", "1.2.3.4/"] {
            assert!(parse_dests(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unset_or_empty_limits_nothing() {
        assert!(Select::from_env(None, Some(" ")).unwrap().is_all());
        assert!(!sel("1", "").is_all());
    }
}
