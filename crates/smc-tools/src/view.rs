//! Rendering of the live registry (`smc::registry`, one JSON document per
//! process, schema in the crate README) as smc-tools prints the kernel's
//! state: `smcss` (`tools.md` §2.2), `smcr linkgroup`, `device`, `info` and
//! `stats` (§2.5). Pure functions of the documents, so that the golden tests
//! can feed a snapshot.

use serde_json::{json, Value};
use std::fmt::Write as _;
use std::net::SocketAddr;

/// The processes' documents, in pid order.
pub type Procs = [Value];

fn arr(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

/// `pid/comm`, the column smc-tools lacks (like `ss -p`).
fn process(p: &Value) -> String {
    format!("{}/{}", u(&p["pid"]), s(&p["comm"]))
}

// ---------------------------------------------------------------- reasons

/// The short name of a fallback or decline reason: smc-tools' `smcr stats`
/// label where it has one, else the kernel's macro name without its
/// `SMC_CLC_DECL_` prefix (codes smc-tools 1.8.5 shows as `[unknown]`),
/// and names for smc-rs's own reasons.
pub fn reason_name(code: u32) -> String {
    let label = match code {
        0x0101_0000 => "MEMORY",
        0x0201_0000 => "TIMEOUT_CL",
        0x0202_0000 => "TIMEOUT_AL",
        0x0300_0000 => "CNF_ERR",
        0x0301_0000 => "PEER_NO_SMC",
        0x0302_0000 => "IPSEC",
        0x0303_0000 => "NOSMCDEV",
        0x0303_0001 => "NOSMCDDEV",
        0x0303_0002 => "NOSMCRDEV",
        0x0303_0003 => "NOISM2SUPP",
        0x0303_0004 => "NOV2EXT",
        0x0303_0005 => "NOV2DEXT",
        0x0303_0006 => "NOSEID",
        0x0303_0007 => "NOSMCD2DEV",
        0x0304_0000 => "MODEUNSUPP",
        0x0305_0000 => "RMBE_EC",
        0x0306_0000 => "OPTUNSUPP",
        0x0307_0000 => "DIFFPREFIX",
        0x0308_0000 => "GETVLANERR",
        0x0309_0000 => "ISMVLANERR",
        0x030a_0000 => "NOACTLINK",
        0x030b_0000 => "NOSRVLINK",
        0x030c_0000 => "VERSMISMAT",
        0x030d_0000 => "MAX_DMB",
        0x0400_0000 => "SYNCERR",
        0x0500_0000 => "PEERDECL",
        c if c == smc::FALLBACK_NO_RENDEZVOUS => "NO_RENDEZVOUS",
        c => {
            let d = smc_wire::clc::DeclineCode::from_u32(c);
            return d.name().map_or_else(
                || format!("{c:#010x}"),
                |n| n.trim_start_matches("SMC_CLC_DECL_").to_string(),
            );
        }
    };
    label.to_string()
}

/// What a reason means (the kernel's `smc_clc.h` wording; smc-rs's own).
pub fn reason_text(code: u32) -> String {
    if code == smc::FALLBACK_NO_RENDEZVOUS {
        return "SYN option not available on this host (no BPF rendezvous: privilege, cgroup2 or bpffs missing)".into();
    }
    match smc_wire::clc::DeclineCode::from_u32(code) {
        smc_wire::clc::DeclineCode::Unknown(_) => "Unknown error code or non-Linux OS".into(),
        d => d.description().to_string(),
    }
}

// ---------------------------------------------------------------- smcss

/// `smcss` options.
#[derive(Clone, Copy, Debug, Default)]
pub struct SsOpts {
    /// `-a`: every state.
    pub all: bool,
    /// `-l`: listeners only.
    pub listening: bool,
    /// `-d`: connection details.
    pub debug: bool,
    /// `-R`: SMC-R only, link columns.
    pub smcr: bool,
    /// `-D`: SMC-D only (smc-rs has no SMC-D: no lines).
    pub smcd: bool,
    /// `-W`: addresses not cut.
    pub wide: bool,
}

const ADDR_LEN_SHORT: usize = 23;

/// `addr:port` as smcss prints it: the address as `inet_ntop` writes it (no
/// brackets), cut with `..` before the port when longer than 23 (without `-W`).
fn addr_col(a: &Value, wide: bool) -> String {
    let Some(sa) = a.as_str().and_then(|t| t.parse::<SocketAddr>().ok()) else {
        return String::new();
    };
    let ip = sa.ip().to_string();
    let port = sa.port().to_string();
    if !wide && ip.len() + 1 + port.len() > ADDR_LEN_SHORT {
        let keep = ADDR_LEN_SHORT - 1 - port.len() - 2;
        format!("{}..:{port}", &ip[..keep.min(ip.len())])
    } else {
        format!("{ip}:{port}")
    }
}

fn ss_selected(sock: &Value, o: &SsOpts) -> bool {
    let state = s(&sock["state"]);
    if o.listening {
        if state != "LISTEN" {
            return false;
        }
    } else if !o.all && (state == "LISTEN" || state == "INIT") {
        return false;
    }
    if o.smcr && sock["mode"] != "SMCR" {
        return false;
    }
    if o.smcd && sock["mode"] != "SMCD" {
        return false;
    }
    true
}

/// The sockets `smcss` shows, each with `pid` and `comm` of its process.
pub fn smcss_sockets(procs: &Procs, o: &SsOpts) -> Vec<Value> {
    let mut v = Vec::new();
    for p in procs {
        for sock in arr(&p["sockets"]) {
            if ss_selected(sock, o) {
                let mut x = sock.clone();
                if let Some(r) = sock["fallback"]["reason"].as_u64() {
                    x["fallback"]["reason_name"] = json!(reason_name(r as u32));
                }
                if let Some(r) = sock["fallback"]["peer"].as_u64() {
                    x["fallback"]["peer_name"] = json!(reason_name(r as u32));
                }
                x["pid"] = p["pid"].clone();
                x["comm"] = p["comm"].clone();
                v.push(x);
            }
        }
    }
    v
}

/// `smcss` output.
pub fn smcss(procs: &Procs, o: &SsOpts) -> String {
    let mut out = String::new();
    out.push_str(
        "State          UID   Inode   Local Address           Peer Address            Intf Mode ",
    );
    if o.debug {
        out.push_str(
            "Shutd Token    Sndbuf   Rcvbuf   Peerbuf  rxprod-Cursor rxcons-Cursor rxFlags \
             txprod-Cursor txcons-Cursor txFlags txprep-Cursor txsent-Cursor txfin-Cursor  ",
        );
    }
    if o.smcr {
        let _ = write!(
            out,
            "Role IB-device       Port Linkid {:<40} {:<40} ",
            "GID", "Peer-GID"
        );
    }
    if o.smcd {
        out.push_str("GID              Token            Peer-GID         Peer-Token       Linkid ");
    }
    out.push_str("PID/Program\n");
    for sock in smcss_sockets(procs, o) {
        let state = s(&sock["state"]);
        let mut line = format!(
            "{:<14} {:05} {:07} ",
            state,
            u(&sock["uid"]),
            u(&sock["inode"])
        );
        let pad = |line: &mut String, cols: usize| {
            for _ in 0..cols {
                line.push_str(&" ".repeat(ADDR_LEN_SHORT + 1));
            }
        };
        if state == "INIT" {
            pad(&mut line, 2);
            line.push_str("          ");
        } else {
            let local = addr_col(&sock["local"], o.wide);
            let _ = write!(line, "{local:<ADDR_LEN_SHORT$} ");
            if state == "LISTEN" {
                pad(&mut line, 1);
                line.push_str("          ");
            } else {
                let peer = addr_col(&sock["peer"], o.wide);
                let _ = write!(line, "{peer:<ADDR_LEN_SHORT$} {:04x} ", u(&sock["intf"]));
                if state == "CLOSED" && sock["mode"] != "TCP" {
                    line.push_str("     ");
                } else if sock["mode"] == "TCP" {
                    let f = &sock["fallback"];
                    let _ = write!(line, "TCP {:#010x}", u(&f["reason"]));
                    if let Some(p) = f["peer"].as_u64() {
                        let _ = write!(line, "/{p:#010x}");
                    }
                    line.push(' ');
                } else {
                    line.push_str("SMCR ");
                    if o.debug {
                        let m = u(&sock["shutdown"]);
                        let _ = write!(
                            line,
                            " {}-{}  {:08x} {:08x} {:08x} {:08x} ",
                            if m & 1 != 0 { 'R' } else { '<' },
                            if m & 2 != 0 { 'W' } else { '>' },
                            u(&sock["token"]),
                            u(&sock["sndbuf"]),
                            u(&sock["rmb"]),
                            u(&sock["peer_rmb"]),
                        );
                        let c = &sock["cursors"];
                        let cur = |k: &str| {
                            format!("{:04x}:{:08x} ", u(&c[k]["wrap"]), u(&c[k]["count"]))
                        };
                        let flags = |k: &str| {
                            let f = &sock[k];
                            format!("{:02x}:{:02x}   ", u(&f[0]), u(&f[1]))
                        };
                        line.push_str(&cur("rx_prod"));
                        line.push_str(&cur("rx_cons"));
                        line.push_str(&flags("rx_flags"));
                        line.push_str(&cur("tx_prod"));
                        line.push_str(&cur("tx_cons"));
                        line.push_str(&flags("tx_flags"));
                        line.push_str(&cur("tx_prep"));
                        line.push_str(&cur("tx_sent"));
                        line.push_str(&cur("tx_fin"));
                        line.push(' ');
                    }
                    if o.smcr {
                        let _ = write!(
                            line,
                            "{:>4} {:<15} {:02x}   {:02x}     {:<40} {:<40} ",
                            s(&sock["role"]),
                            s(&sock["device"]),
                            1,
                            u(&sock["link_id"]),
                            s(&sock["gid"]),
                            s(&sock["peer_gid"]),
                        );
                    }
                }
            }
        }
        line.push_str(&process(&sock));
        out.push_str(&line);
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------- smcr

/// smcr's `-d`/`-dd`, `-a`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SmcrOpts {
    /// `-d` 1, `-dd` 2.
    pub details: u8,
    /// `-a`.
    pub absolute: bool,
}

fn vlan(v: u64) -> String {
    if v == 0 {
        "   0".into()
    } else {
        format!("{:>4}", format!("{v:#x}"))
    }
}

fn net_dev_of(p: &Value, dev: &str) -> String {
    arr(&p["devices"])
        .iter()
        .find(|d| d["ib_dev"] == dev)
        .and_then(|d| arr(&d["ports"]).first())
        .and_then(|port| port["net_dev"].as_str())
        .unwrap_or("n/a")
        .to_string()
}

fn pnet_of(p: &Value, dev: &str) -> String {
    arr(&p["devices"])
        .iter()
        .find(|d| d["ib_dev"] == dev)
        .and_then(|d| arr(&d["ports"]).first())
        .and_then(|port| port["pnet_id"].as_str())
        .unwrap_or("")
        .to_string()
}

/// Which link groups `all` or an LG-ID (hex; its low byte, a link id, is
/// ignored as smcr does) selects.
fn lg_selected(lg: &Value, id: Option<u32>) -> bool {
    id.is_none_or(|id| (u(&lg["id"]) as u32) == id & !0xff)
}

/// `smcr linkgroup [show]`.
pub fn linkgroup_show(procs: &Procs, o: &SmcrOpts, id: Option<u32>) -> String {
    let mut out = String::new();
    if o.details == 0 {
        out.push_str("LG-ID    LG-Role  LG-Type  VLAN  #Conns  PNET-ID          PID/Program\n");
    }
    for p in procs {
        for lg in arr(&p["link_groups"]).iter().filter(|l| lg_selected(l, id)) {
            let dev = s(&lg["device"]);
            let role = lg["role"].as_str().unwrap_or("n/a");
            if o.details == 0 {
                let _ = writeln!(
                    out,
                    "{:08x} {:<8} {:<8} {}  {:>6}  {:<16} {}",
                    u(&lg["id"]),
                    role,
                    s(&lg["type"]),
                    vlan(u(&lg["vlan"])),
                    u(&lg["conns"]),
                    pnet_of(p, dev),
                    process(p),
                );
            } else {
                let _ = writeln!(out, "LG-ID    : {:08x}", u(&lg["id"]));
                let _ = writeln!(out, "LG-Role  : {role}");
                let _ = writeln!(out, "LG-Type  : {}", s(&lg["type"]));
                let _ = writeln!(out, "VLAN     : {}", u(&lg["vlan"]));
                let _ = writeln!(out, "PNET-ID  : {}", pnet_of(p, dev));
                let _ = writeln!(out, "Version  : {}", u(&lg["version"]));
                if u(&lg["version"]) >= 2 {
                    let _ = writeln!(out, "Peer-Rel : {}", u(&lg["release"]));
                    // (registries before these fields have none of them)
                    if let Some(host) = lg["peer_host"].as_str() {
                        let _ = writeln!(out, "Peer-Host: {host}");
                        let _ = writeln!(out, "Peer-OS  : {}", os_name(u(&lg["peer_os"])));
                        let direct = lg["direct"].as_bool().unwrap_or(false);
                        let _ = writeln!(out, "Direct   : {}", if direct { "Yes" } else { "No" });
                    }
                    if let Some(eid) = lg["eid"].as_str() {
                        // (smc-tools prints the 32 blank-padded characters)
                        let _ = writeln!(out, "EID      : {eid:<32}");
                    }
                }
                let _ = writeln!(out, "Peer-SID : {}", s(&lg["peer_system_id"]));
                let _ = writeln!(out, "#Conns   : {}", u(&lg["conns"]));
                let _ = writeln!(out, "IB-Dev   : {dev}");
                let _ = writeln!(out, "State    : {}", s(&lg["state"]));
                let _ = writeln!(out, "Process  : {}", process(p));
                out.push('\n');
            }
        }
    }
    out
}

/// The peer's OS type as smc-tools names it (CLC first-contact extension:
/// 1 z/OS, 2 Linux, 3 AIX).
fn os_name(os: u64) -> String {
    match os {
        1 => "ZOS".into(),
        2 => "LINUX".into(),
        3 => "AIX".into(),
        n => format!("Unknown (0x{n:02x})"),
    }
}

/// `smcr linkgroup link-show`, with `ibdev`/`netdev` filters.
pub fn link_show(
    procs: &Procs,
    o: &SmcrOpts,
    id: Option<u32>,
    ibdev: Option<&str>,
    netdev: Option<&str>,
) -> String {
    let mut out =
        String::from("LG-ID    LG-Role  LG-Type  Net-Dev         Link-State      #Conns  ");
    if o.details >= 1 {
        out.push_str("Link-UID  Peer-UID  IB-Dev    IB-P  ");
    }
    if o.details >= 2 {
        let _ = write!(out, "{:<42}{:<40}  ", "Local-GID", "Peer-GID");
    }
    out.push_str("PID/Program\n");
    for p in procs {
        for lg in arr(&p["link_groups"]).iter().filter(|l| lg_selected(l, id)) {
            for link in arr(&lg["links"]) {
                let dev = s(&link["ib_dev"]);
                let nd = net_dev_of(p, dev);
                if ibdev.is_some_and(|d| d != dev) || netdev.is_some_and(|n| n != nd) {
                    continue;
                }
                let _ = write!(
                    out,
                    "{:08x} {:<8} {:<8} {:<15} {:<15} {:>6}  ",
                    u(&lg["id"]),
                    lg["role"].as_str().unwrap_or("n/a"),
                    s(&lg["type"]),
                    nd,
                    s(&link["state"]),
                    u(&link["conns"]),
                );
                if o.details >= 1 {
                    let _ = write!(
                        out,
                        "{:08x}  {:08x}  {:<8}  {:>4}  ",
                        u(&link["uid"]),
                        u(&link["peer_uid"]),
                        &dev[..dev.len().min(8)],
                        u(&link["ib_port"]),
                    );
                }
                if o.details >= 2 {
                    let _ = write!(out, "{:<42}{:<40}  ", s(&link["gid"]), s(&link["peer_gid"]));
                }
                out.push_str(&process(p));
                out.push('\n');
            }
        }
    }
    out
}

/// The device type column: `SHM` for smc-rs's shared-memory device, else
/// the PCI device id from sysfs as smc-tools prints it off IBM Z (`0x1017`,
/// `0` without a PCI parent, as with Soft-RoCE).
fn device_type(d: &Value, sysfs: &std::path::Path) -> String {
    if d["kind"] == "shm" {
        return "SHM".into();
    }
    let p = sysfs.join(s(&d["ib_dev"])).join("device/device");
    std::fs::read_to_string(p)
        .ok()
        .map_or_else(|| "0".into(), |t| t.trim().to_string())
}

/// The devices of all processes, one per name (the first process's view;
/// links and criticality summed over processes).
fn devices(procs: &Procs) -> Vec<Value> {
    let mut v: Vec<Value> = Vec::new();
    for p in procs {
        for d in arr(&p["devices"]) {
            match v.iter_mut().find(|x| x["ib_dev"] == d["ib_dev"]) {
                Some(x) => {
                    x["links"] = json!(u(&x["links"]) + u(&d["links"]));
                    x["crit"] = json!(x["crit"] == true || d["crit"] == true);
                }
                None => v.push(d.clone()),
            }
        }
    }
    v
}

/// `smcr device [show]`, with `ibdev`/`netdev` filters.
pub fn device_show(
    procs: &Procs,
    o: &SmcrOpts,
    ibdev: Option<&str>,
    netdev: Option<&str>,
    sysfs: &std::path::Path,
) -> String {
    let mut out = String::from("Net-Dev         IB-Dev   IB-P  IB-State  Type          Crit  ");
    // (FID, PCI-ID, PCHID: s390 facts, not known here)
    let s390 = |a: &str, b: &str, c: &str| format!(" {a:<5} {b:<13} {c:<6} ");
    if o.details >= 1 {
        out.push_str(&s390("FID", "PCI-ID", "PCHID"));
    }
    out.push_str("#Links  PNET-ID  \n");
    for d in devices(procs) {
        let dev = s(&d["ib_dev"]);
        if ibdev.is_some_and(|x| x != dev) {
            continue;
        }
        for port in arr(&d["ports"]) {
            let nd = port["net_dev"].as_str().unwrap_or("n/a");
            if netdev.is_some_and(|x| x != nd) {
                continue;
            }
            let _ = write!(
                out,
                "{:<15} {:<8} {:>4}  {:>8}  {:<12}  {:>4}  ",
                nd,
                &dev[..dev.len().min(8)],
                u(&port["port"]),
                s(&port["state"]),
                device_type(&d, sysfs),
                if d["crit"] == true { "Yes" } else { "No" },
            );
            if o.details >= 1 {
                out.push_str(&s390("n/a", "n/a", "n/a"));
            }
            let pnet = match port["pnet_id"].as_str() {
                Some(id) if port["pnet_user"] == true => format!("*{id}"),
                Some(id) => id.to_string(),
                None => String::new(),
            };
            let _ = writeln!(out, "{:>6}  {:<16} ", u(&d["links"]), pnet);
        }
    }
    out
}

/// `smcr info`: smc-rs speaks SMC v2.1 (SMC-R v1 and v2); no SMC-D, no
/// ISM, no SEID; RoCE lists the device kinds the processes have.
pub fn info(procs: &Procs, hostname: &str) -> String {
    let devs = devices(procs);
    let roce = if devs.is_empty() {
        "n/a".to_string()
    } else {
        let mut kinds: Vec<&str> = devs.iter().map(|d| s(&d["kind"])).collect();
        kinds.sort_unstable();
        kinds.dedup();
        format!("v1 v2 ({})", kinds.join(", "))
    };
    let host: String = hostname.chars().take(32).collect();
    format!(
        "Kernel Capabilities\n\
         SMC Version:      2.1\n\
         SMC Hostname:     {host}\n\
         SMC-D Features:   n/a\n\
         SMC-R Features:   v1 v2\n\
         \n\
         Hardware Capabilities\n\
         SEID:             n/a\n\
         ISM:              n/a\n\
         RoCE:             {roce}\n"
    )
}

/// A count abbreviated as smc-tools does: 4 significant digits with K, M,
/// G, T, P (powers of 1000).
pub fn abbrev(v: u64) -> String {
    const UNITS: [&str; 6] = ["", "K", "M", "G", "T", "P"];
    let mut x = v as f64;
    let mut i = 0;
    while x >= 1000.0 && i < UNITS.len() - 1 {
        x /= 1000.0;
        i += 1;
    }
    if i == 0 {
        return v.to_string();
    }
    let digits = if x < 10.0 {
        3
    } else if x < 100.0 {
        2
    } else {
        1
    };
    format!("{x:.digits$}{}", UNITS[i])
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<30}{value:>11}");
}

fn reasons(c: &Value, key: &str, side: &str) -> Vec<(u32, u64)> {
    let mut v: Vec<(u32, u64)> = c[key][side]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, n)| {
                    let code = u32::from_str_radix(k.trim_start_matches("0x"), 16).ok()?;
                    Some((code, n.as_u64()?))
                })
                .collect()
        })
        .unwrap_or_default();
    // most frequent first, as smc-tools sorts its top reasons
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

/// `smcr stats` text for the counters `c` (see `smc::registry::files::counters`).
pub fn stats(c: &Value, gauges: (u64, u64), o: &SmcrOpts) -> String {
    let side = |k: &str, s: &str| u(&c[k][s]);
    let smc = side("smc", "client") + side("smc", "server");
    let hs = side("handshake_errors", "client") + side("handshake_errors", "server");
    let fb = side("fallback", "client") + side("fallback", "server");
    let mut out = String::from("SMC-R Connections Summary\n");
    row(&mut out, "  Total connections handled", smc + hs + fb);
    let pair = |k: &str| {
        format!(
            "(client {}, server {})",
            side(k, "client"),
            side(k, "server")
        )
    };
    let _ = writeln!(
        out,
        "{:<30}{:>11} {}",
        "  SMC connections",
        smc,
        pair("smc")
    );
    let _ = writeln!(
        out,
        "{:<30}{:>11} {}",
        "  Handshake errors",
        hs,
        pair("handshake_errors")
    );
    let reqs = u(&c["rx_cnt"]) + u(&c["tx_cnt"]);
    let avg = if smc == 0 {
        0.0
    } else {
        reqs as f64 / smc as f64
    };
    let _ = writeln!(out, "{:<30}{:>13.1}", "  Avg requests per SMC conn", avg);
    let _ = writeln!(
        out,
        "{:<30}{:>11} {}",
        "  TCP fallback",
        fb,
        pair("fallback")
    );
    if o.details >= 1 {
        for (key, title) in [
            ("fallback_reasons", ""),
            ("peer_decline_reasons", "Peer decline, "),
        ] {
            for sd in ["client", "server"] {
                let list = reasons(c, key, sd);
                if list.is_empty() {
                    continue;
                }
                let name = if sd == "client" { "Client" } else { "Server" };
                let _ = writeln!(out, "    {title}{name}");
                for (code, n) in list {
                    let _ = writeln!(out, "     {:<25}{:>11}  {code:#010x}", reason_name(code), n);
                }
            }
        }
    }
    if o.details >= 1 {
        if let Some(errs) = c["errors"].as_object().filter(|m| !m.is_empty()) {
            out.push_str("  Errors (smc-rs)\n");
            for (kind, n) in errs {
                let _ = writeln!(out, "     {:<25}{:>11}", kind, u(n));
            }
        }
    }
    for (title, dir, usage) in [("RX", "rx", gauges.0), ("TX", "tx", gauges.1)] {
        let _ = writeln!(out, "\n{title} Stats");
        let bytes = u(&c[format!("{dir}_bytes").as_str()]);
        let _ = writeln!(
            out,
            "{:<30}{:>11} ({})",
            "  Data transmitted (Bytes)",
            bytes,
            abbrev(bytes)
        );
        row(
            &mut out,
            "  Total requests",
            u(&c[format!("{dir}_cnt").as_str()]),
        );
        let _ = writeln!(
            out,
            "{:<30}{:>11} ({})",
            "  Buffer usage (Bytes)",
            usage,
            abbrev(usage)
        );
        // (smc-rs counts no RX buffer full / too small and no TX buffer
        // full at the peer: see the README)
        let reqs = u(&c[format!("{dir}_cnt").as_str()]);
        let pct = |out: &mut String, label: &str, n: u64| {
            let p = if reqs == 0 {
                0.0
            } else {
                n as f64 * 100.0 / reqs as f64
            };
            let _ = writeln!(out, "{label:<30}{n:>11} ({p:.2}%)");
        };
        if dir == "tx" {
            pct(&mut out, "  Buffer full", u(&c["tx_full"]));
            pct(&mut out, "  Buffer too small", u(&c["tx_too_small"]));
            pct(
                &mut out,
                "  Buffer too small (remote)",
                u(&c["tx_peer_too_small"]),
            );
        }
        if o.details >= 1 {
            let (down, reuse) = if dir == "rx" {
                (u(&c["rmb_downgrade"]), u(&c["rmb_reuse"]))
            } else {
                // (send buffers are never downgraded)
                (0, u(&c["sndbuf_reuse"]))
            };
            row(&mut out, "  Buffer downgrades", down);
            row(&mut out, "  Buffer reuses", reuse);
        }
        let bufs = if dir == "rx" {
            "rmb_hist"
        } else {
            "sndbuf_hist"
        };
        histogram(&mut out, &c[bufs], &c[format!("{dir}_hist").as_str()]);
    }
    // (no kernel counts these; smc-rs's own section)
    out.push_str("\nMessages and links (smc-rs)\n");
    row(&mut out, "  CDC messages sent", u(&c["cdc_sent"]));
    row(&mut out, "  CDC messages received", u(&c["cdc_received"]));
    row(&mut out, "  LLC messages sent", u(&c["llc_sent"]));
    row(&mut out, "  LLC messages received", u(&c["llc_received"]));
    if o.details >= 1 {
        row(&mut out, "  Links up", u(&c["link_up"]));
        row(&mut out, "  Links down", u(&c["link_down"]));
        row(&mut out, "  Connections moved", u(&c["conn_moves"]));
        row(&mut out, "  Connections aborted", u(&c["aborts"]));
    }
    let _ = o.absolute;
    out
}

/// The `Bufs` and `Reqs` lines of `smcr stats` (buffer sizes allocated,
/// request sizes): the kernel's nine buckets, the last two folded into
/// `>512KB` as smc-tools shows them.
fn histogram(out: &mut String, bufs: &Value, reqs: &Value) {
    let names = smc::registry::BUCKET_NAMES;
    let cols = |h: &Value| -> [u64; 8] {
        let mut v = [0u64; 8];
        for (i, n) in names.iter().enumerate() {
            v[i.min(7)] += u(&h[*n]);
        }
        v
    };
    out.push_str("      ");
    for (i, l) in [
        "8KB", "16KB", "32KB", "64KB", "128KB", "256KB", "512KB", ">512KB",
    ]
    .iter()
    .enumerate()
    {
        let w = if i == 0 { 9 } else { 8 };
        let _ = write!(out, "{l:>w$}");
    }
    out.push('\n');
    for (label, h) in [("Bufs", bufs), ("Reqs", reqs)] {
        let _ = write!(out, "  {label}");
        for (i, n) in cols(h).iter().enumerate() {
            let w = if i == 0 { 9 } else { 8 };
            let _ = write!(out, "{:>w$}", abbrev(*n));
        }
        out.push('\n');
    }
}

/// `smcr stats --json`: the counters with every reason's name.
pub fn stats_json(c: &Value, gauges: (u64, u64), absolute: bool) -> Value {
    let mut v = c.clone();
    for key in ["fallback_reasons", "peer_decline_reasons"] {
        for sd in ["client", "server"] {
            let named: serde_json::Map<String, Value> = reasons(c, key, sd)
                .into_iter()
                .map(|(code, n)| {
                    (
                        format!("{code:#010x}"),
                        json!({"name": reason_name(code), "count": n}),
                    )
                })
                .collect();
            v[key][sd] = Value::Object(named);
        }
    }
    v["rmb_usage"] = json!(gauges.0);
    v["sndbuf_usage"] = json!(gauges.1);
    v["absolute"] = json!(absolute);
    json!({"SMCR": v})
}

/// Prometheus text exposition of the counters (since start: counters must
/// not go backwards, so a reset does not apply).
pub fn prometheus(c: &Value, gauges: (u64, u64)) -> String {
    let mut out = String::new();
    let mut counter = |name: &str, help: &str, rows: Vec<(String, u64)>| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let sides = |k: &str| -> Vec<(String, u64)> {
        ["client", "server"]
            .iter()
            .map(|sd| (format!("{{side=\"{sd}\"}}"), u(&c[k][*sd])))
            .collect()
    };
    counter(
        "smc_connections_total",
        "SMC-R connections established.",
        sides("smc"),
    );
    counter(
        "smc_fallbacks_total",
        "Connections that fell back to TCP.",
        sides("fallback"),
    );
    counter(
        "smc_handshake_errors_total",
        "Connections whose handshake failed (closed).",
        sides("handshake_errors"),
    );
    let mut rows = Vec::new();
    for sd in ["client", "server"] {
        for (code, n) in reasons(c, "fallback_reasons", sd) {
            rows.push((
                format!(
                    "{{side=\"{sd}\",code=\"{code:#010x}\",reason=\"{}\"}}",
                    reason_name(code)
                ),
                n,
            ));
        }
    }
    counter(
        "smc_fallback_reasons_total",
        "Fallbacks by reason code.",
        rows,
    );
    for (dir, what) in [("rx", "received"), ("tx", "sent")] {
        counter(
            &format!("smc_{dir}_bytes_total"),
            &format!("Bytes {what} over SMC-R."),
            vec![(String::new(), u(&c[format!("{dir}_bytes").as_str()]))],
        );
        counter(
            &format!("smc_{dir}_requests_total"),
            &format!(
                "Successful {} calls on SMC-R connections.",
                if dir == "rx" { "read" } else { "write" }
            ),
            vec![(String::new(), u(&c[format!("{dir}_cnt").as_str()]))],
        );
    }
    for (name, key, help) in [
        ("smc_cdc_sent_total", "cdc_sent", "CDC messages posted."),
        (
            "smc_cdc_received_total",
            "cdc_received",
            "CDC messages received.",
        ),
        ("smc_llc_sent_total", "llc_sent", "LLC messages posted."),
        (
            "smc_llc_received_total",
            "llc_received",
            "LLC messages received.",
        ),
        ("smc_link_up_total", "link_up", "Links that came up."),
        ("smc_link_down_total", "link_down", "Links that went down."),
        (
            "smc_conn_moves_total",
            "conn_moves",
            "Connections moved to another link.",
        ),
        ("smc_aborts_total", "aborts", "Connections aborted."),
        (
            "smc_rmb_alloc_total",
            "rmb_alloc",
            "RMBs registered for connections.",
        ),
        (
            "smc_sndbuf_alloc_total",
            "sndbuf_alloc",
            "Send buffers registered for connections.",
        ),
        (
            "smc_rmb_reuse_total",
            "rmb_reuse",
            "RMBs reused from a link group's pool.",
        ),
        (
            "smc_sndbuf_reuse_total",
            "sndbuf_reuse",
            "Send buffers reused from a link group's pool.",
        ),
        (
            "smc_rmb_downgrade_total",
            "rmb_downgrade",
            "RMBs registered smaller than configured.",
        ),
        (
            "smc_tx_full_total",
            "tx_full",
            "Writes that found the send buffer full (once per wait).",
        ),
        (
            "smc_tx_too_small_total",
            "tx_too_small",
            "Writes larger than the send buffer.",
        ),
        (
            "smc_tx_peer_too_small_total",
            "tx_peer_too_small",
            "Writes larger than the peer's RMB.",
        ),
    ] {
        counter(name, help, vec![(String::new(), u(&c[key]))]);
    }
    let mut rows = Vec::new();
    for (kind, key) in [
        ("rx_request", "rx_hist"),
        ("tx_request", "tx_hist"),
        ("rmb", "rmb_hist"),
        ("sndbuf", "sndbuf_hist"),
    ] {
        for b in smc::registry::BUCKET_NAMES {
            rows.push((format!("{{kind=\"{kind}\",bucket=\"{b}\"}}"), u(&c[key][b])));
        }
    }
    counter(
        "smc_size_bucket_total",
        "Requests by payload size and buffers by size (the kernel's buckets).",
        rows,
    );
    if let Some(errs) = c["errors"].as_object() {
        let rows = errs
            .iter()
            .map(|(k, n)| (format!("{{kind=\"{k}\"}}"), u(n)))
            .collect();
        counter("smc_errors_total", "smc-rs failures by kind.", rows);
    }
    for (name, v) in [
        ("smc_rmb_usage_bytes", gauges.0),
        ("smc_sndbuf_usage_bytes", gauges.1),
    ] {
        let _ = writeln!(out, "# HELP {name} Buffer bytes of live SMC-R connections.");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name} {v}");
    }
    out
}

/// The buffer gauges of the live processes (RMB, send buffer).
pub fn gauges(procs: &Procs) -> (u64, u64) {
    procs.iter().fold((0, 0), |(a, b), p| {
        (
            a + u(&p["gauges"]["rmb_usage"]),
            b + u(&p["gauges"]["sndbuf_usage"]),
        )
    })
}
