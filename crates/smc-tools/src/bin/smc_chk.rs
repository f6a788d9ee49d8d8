//! `smc_chk` — would SMC-R be used to this host and port? smc-tools' checks
//! and messages (spec `tools.md` §2.4), built in rather than a script around
//! `smc_run` and `smcss`, and not only on s390: `-C` connects with the smc
//! library itself and reports the connection's mode and reasons; `-S` starts
//! a server to connect to; `-i` prints an interface's PNET ID. Before the
//! live test it reports what the decision depends on: the SYN option path
//! (the BPF rendezvous), the UEIDs (SMC-R v2) and the PNET ID of the route's
//! interface.

use smc::{Mode, SmcListener, SmcStream};
use smc_config::pnet::PnetTable;
use smc_config::store::{ConfigDir, Table};
use smc_config::ueid::UeidTable;
use smc_tools::getopt::{self, Opt};
use smc_tools::view::reason_text;
use std::io::Read;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

const PROG: &str = "smc_chk";

const USAGE: &str = "Usage: smc_chk [OPTIONS] -C <IP>
       smc_chk [OPTIONS] -S
       smc_chk -i <iface>

Check SMC setup

   -C, --connect <IP>           connect to specified IP
   -d, --debug                  show debug messages
   -h, --help                   display this message
   -i, --pnetid <IFACE>         print PNET ID and exit
   -p, --port <PORT>            use the next free port starting
                                with PORT (default: 37373)
   -S, --server                 start server only
   -v, --version                display version info
   -6, --ipv6                   IP address is IPv6
";

const DEFAULT_PORT: u16 = 37373;

// `-l`/`--live-test` and `-s`/`--static-analysis` are smc-tools'
// undocumented modes: accepted, not in the usage text (as there).

const OPTS: &[Opt] = &[
    Opt {
        short: Some('C'),
        long: "connect",
        has_arg: true,
    },
    Opt {
        short: Some('d'),
        long: "debug",
        has_arg: false,
    },
    Opt {
        short: Some('h'),
        long: "help",
        has_arg: false,
    },
    Opt {
        short: Some('i'),
        long: "pnetid",
        has_arg: true,
    },
    Opt {
        short: Some('p'),
        long: "port",
        has_arg: true,
    },
    Opt {
        short: Some('l'),
        long: "live-test",
        has_arg: false,
    },
    Opt {
        short: Some('s'),
        long: "static-analysis",
        has_arg: false,
    },
    Opt {
        short: Some('S'),
        long: "server",
        has_arg: false,
    },
    Opt {
        short: Some('v'),
        long: "version",
        has_arg: false,
    },
    Opt {
        short: Some('6'),
        long: "ipv6",
        has_arg: false,
    },
];

fn main() -> ExitCode {
    let p = match getopt::parse_args_or_exit(PROG, USAGE, OPTS) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let modes: Vec<&str> = [
        "connect",
        "server",
        "pnetid",
        "live-test",
        "static-analysis",
    ]
    .into_iter()
    .filter(|m| p.has(m))
    .collect();
    // (-l and -s together give both, as smc-tools' script)
    if let [a, b, ..] = modes.as_slice() {
        if modes != ["live-test", "static-analysis"] {
            eprintln!("Error: Cannot combine options '--{a}' and '--{b}'");
            return ExitCode::FAILURE;
        }
    }
    let port = match p.value("port").map(str::parse::<u16>) {
        None => DEFAULT_PORT,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!(
                "Error: Invalid port specified: '{}'",
                p.value("port").unwrap_or("")
            );
            return ExitCode::FAILURE;
        }
    };
    let v6 = p.has("ipv6");
    let debug = p.has("debug");
    match modes.first() {
        Some(&"pnetid") => pnetid(p.value("pnetid").unwrap_or_default()),
        Some(&"server") => server(port, v6),
        Some(&"connect") => connect(p.value("connect").unwrap_or_default(), port, v6, debug),
        Some(&"live-test" | &"static-analysis") => {
            let ifaces = match interfaces(&p.positional) {
                Ok(i) => i,
                Err(e) => {
                    eprintln!("Error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let mut ok = true;
            if p.has("static-analysis") {
                static_analysis(&ifaces);
            }
            if p.has("live-test") {
                ok = live_test(&ifaces, debug);
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        _ => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
    }
}

/// The PNET ID of an interface: from the PNET table (`*`: set by the user;
/// off IBM Z there are no hardware PNET IDs).
fn pnetid(ifname: &str) -> ExitCode {
    let table = PnetTable::load(&ConfigDir::from_env()).unwrap_or_default();
    if let Some(id) = table.pnetid_of_interface(ifname) {
        println!("{}*", id.as_str());
    }
    ExitCode::SUCCESS
}

/// A server to run `-C` against: the first free port from `port` on.
fn server(port: u16, v6: bool) -> ExitCode {
    let any: IpAddr = if v6 {
        "::".parse().unwrap()
    } else {
        "0.0.0.0".parse().unwrap()
    };
    let mut listener = None;
    for p in port..=u16::MAX {
        if let Ok(l) = SmcListener::bind(SocketAddr::new(any, p)) {
            listener = Some((l, p));
            break;
        }
    }
    let Some((l, p)) = listener else {
        eprintln!("Error: No free port found");
        return ExitCode::FAILURE;
    };
    println!("Server started on port {p}");
    loop {
        match l.accept() {
            Ok((mut s, _)) => {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                });
            }
            Err(e) => {
                eprintln!("Error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
}

/// Interfaces, each with its addresses and their prefix lengths.
type Ifaces = Vec<(String, Vec<(IpAddr, u8)>)>;

/// The interfaces with addresses (or those named).
fn interfaces(named: &[String]) -> Result<Ifaces, String> {
    let all = smc_rdma::sys::interface_addrs().map_err(|e| format!("interface list: {e}"))?;
    let mut v: Ifaces = Vec::new();
    for a in all {
        if !named.is_empty() && !named.contains(&a.ifname) {
            continue;
        }
        match v.iter_mut().find(|(n, _)| *n == a.ifname) {
            Some((_, l)) => l.push((a.addr, a.prefix_len)),
            None => v.push((a.ifname, vec![(a.addr, a.prefix_len)])),
        }
    }
    if let Some(n) = named.iter().find(|n| !v.iter().any(|(x, _)| x == *n)) {
        return Err(format!("Interface '{n}' has no address or does not exist"));
    }
    Ok(v)
}

/// The network of an address (its first `prefix` bits).
fn subnet(a: IpAddr, prefix: u8) -> String {
    match a {
        IpAddr::V4(x) => {
            let m = u32::MAX
                .checked_shl(32 - u32::from(prefix.min(32)))
                .unwrap_or(0);
            format!("{}/{prefix}", std::net::Ipv4Addr::from(u32::from(x) & m))
        }
        IpAddr::V6(x) => {
            let m = u128::MAX
                .checked_shl(128 - u32::from(prefix.min(128)))
                .unwrap_or(0);
            format!("{}/{prefix}", std::net::Ipv6Addr::from(u128::from(x) & m))
        }
    }
}

/// `-s`: what SMC-R over each interface depends on, without a connection
/// (smc-tools' static analysis is for SMC-D; this is its SMC-R
/// counterpart): the SYN option, the interface's PNET ID, the RDMA ports
/// that could serve it, the UEIDs and what is reachable.
fn static_analysis(ifaces: &Ifaces) {
    let dir = ConfigDir::from_env();
    let pnet = PnetTable::load(&dir).unwrap_or_default();
    let ueids = UeidTable::load(&dir)
        .map(|t| t.eids().iter().map(ToString::to_string).collect::<Vec<_>>())
        .unwrap_or_default();
    let devices = smc::provider::AnyProvider::from_env().devices_by_kind();
    println!("Static analysis (SMC-R)");
    match smc_bpf::Rendezvous::shared() {
        Ok(_) => println!("  SYN option:     ok"),
        Err(e) => println!(
            "  SYN option:     not available ({e}): every connection falls back with {:#010x}",
            smc::FALLBACK_NO_RENDEZVOUS
        ),
    }
    if let Err(e) = &devices {
        println!("  RDMA devices:   none ({e})");
    }
    for (name, addrs) in ifaces {
        println!("  Interface {name}");
        let id = pnet.pnetid_of_interface(name);
        println!(
            "     PNET ID:      {}",
            id.map_or("n/a".to_string(), |i| format!("{}*", i.as_str()))
        );
        // the ports Linux's rules would consider: same PNET ID, else the
        // port whose own interface this is; shared-memory devices serve
        // peers on this host only
        let mut ports = Vec::new();
        for (kind, d) in devices.as_deref().unwrap_or_default() {
            for p in &d.ports {
                let pid = pnet.pnetid_of_port(&d.name, p.port_num).or_else(|| {
                    p.netdev
                        .as_deref()
                        .and_then(|n| pnet.pnetid_of_interface(n))
                });
                let by_pnet = id.is_some() && pid == id;
                let own = id.is_none() && p.netdev.as_deref() == Some(name.as_str());
                if by_pnet || own {
                    ports.push(format!(
                        "{} port {} ({}, {:?}, {})",
                        d.name,
                        p.port_num,
                        kind.as_str(),
                        p.state,
                        if by_pnet { "PNET ID" } else { "its interface" }
                    ));
                }
            }
        }
        if ports.is_empty() {
            println!("     RDMA ports:   none (connections decline with NOSMCRDEV)");
        } else {
            println!("     RDMA ports:   {}", ports.join(", "));
        }
        let nets: Vec<String> = addrs.iter().map(|(a, p)| subnet(*a, *p)).collect();
        println!("     Reachable:    SMC-R v1: {}", nets.join(" "));
        if ueids.is_empty() {
            println!("                   SMC-R v2: none (no UEID)");
        } else {
            println!(
                "                   SMC-R v2: Any (UEID {})",
                ueids.join(", ")
            );
        }
    }
}

/// `-l`: over each interface (its first address), a connection to a
/// server of ours on that address, and its verdict.
fn live_test(ifaces: &Ifaces, debug: bool) -> bool {
    let mut ok = true;
    for (name, addrs) in ifaces {
        let Some(&(addr, _)) = addrs.first() else {
            continue;
        };
        println!("  Live test on interface {name} ({addr})");
        let l = match SmcListener::bind(SocketAddr::new(addr, 0)) {
            Ok(l) => l,
            Err(e) => {
                println!("     Failed, no server ({e})");
                ok = false;
                continue;
            }
        };
        let Ok(target) = l.local_addr() else {
            ok = false;
            continue;
        };
        let srv = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        match SmcStream::connect_timeout(&target, Duration::from_secs(10)) {
            Ok(s) => ok &= verdict(&s),
            Err(e) => {
                if debug {
                    println!("     ({e})");
                }
                println!("     Failed, no connection");
                ok = false;
            }
        }
        let _ = srv.join();
    }
    ok
}

/// smc-tools' verdict lines for a connection: `true` for SMC-R.
fn verdict(s: &SmcStream) -> bool {
    let ok = match s.mode() {
        Mode::SmcR => {
            let devs: Vec<String> = smc::state()
                .into_iter()
                .filter(|d| d.connections > 0)
                .map(|d| d.device)
                .collect();
            if !devs.is_empty() {
                println!("     Device:       {}", devs.join(", "));
            }
            println!("     Success, using SMC-R");
            true
        }
        Mode::Tcp(f) => {
            println!("     Failed  (TCP fallback), reasons:");
            let code = f.code();
            println!(
                "          Client:        {code:#010x}   {}",
                reason_text(code)
            );
            if let Some(peer) = f.peer {
                let c = peer.to_u32();
                println!("          Server:        {c:#010x}   {}", reason_text(c));
            }
            false
        }
    };
    // failures the library recorded that explain a fallback (a device
    // that did not open, a broken configuration, a thread that did not
    // start): none is swallowed
    for (kind, n, last) in smc::registry::errors() {
        println!("     Error:        {kind} ({n}x): {last}");
    }
    ok
}

fn connect(host: &str, port: u16, v6: bool, debug: bool) -> ExitCode {
    let target = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| a.is_ipv6() == v6));
    let Some(target) = target else {
        eprintln!("Error: Cannot resolve '{host}'");
        return ExitCode::FAILURE;
    };
    println!("Test with target IP {} and port {port}", target.ip());
    // what the decision depends on
    println!("  Configuration");
    match smc_bpf::Rendezvous::shared() {
        Ok(r) => println!(
            "     SYN option:   ok (rendezvous program {} on {})",
            r.prog_id(),
            r.cgroup().display()
        ),
        Err(e) => println!(
            "     SYN option:   not available ({e}): every connection falls back with {:#010x}",
            smc::FALLBACK_NO_RENDEZVOUS
        ),
    }
    let dir = ConfigDir::from_env();
    match UeidTable::load(&dir).map(|t| t.eids().to_vec()) {
        Ok(e) if !e.is_empty() => println!(
            "     UEID:         {} (SMC-R v2 possible)",
            e.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Ok(_) => println!("     UEID:         none (SMC-R v1 only: same subnet needed)"),
        Err(e) => println!("     UEID:         table unreadable: {e}"),
    }
    println!("  Live test (SMC-R)");
    let s = match SmcStream::connect_timeout(&target, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => {
            if debug {
                println!("     ({e})");
            }
            println!("     Failed, no connection");
            return ExitCode::FAILURE;
        }
    };
    if let Ok(local) = s.local_addr() {
        let table = PnetTable::load(&dir).unwrap_or_default();
        let iface = smc_rdma::sys::interface_addrs().ok().and_then(|a| {
            a.into_iter()
                .find(|x| x.addr == local.ip())
                .map(|x| x.ifname)
        });
        if let Some(i) = iface {
            let id = table.pnetid_of_interface(&i).map_or(
                "none (the port of the interface itself is used)".to_string(),
                |p| format!("{}*", p.as_str()),
            );
            println!("     Interface:    {i}, PNET ID {id}");
        }
    }
    if verdict(&s) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
