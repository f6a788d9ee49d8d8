//! What is on the wire: a tcpdump capture on `lo` shows the SMC option (kind
//! 254, ExID 0xE2D4C3D9) on SYN and SYN-ACK of an smc↔smc connection, and on
//! neither for a plain client of an smc server or for plain TCP (root: BPF and
//! capture; `.ci/run` installs tcpdump).

use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A SYN or SYN-ACK seen on the wire.
#[derive(Debug, Clone, Copy)]
struct Syn {
    src: u16,
    dst: u16,
    ack: bool,
    smc: bool,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Reads a classic pcap file (Ethernet link type, IPv4 TCP frames).
fn parse_pcap(pcap: &[u8]) -> Vec<Syn> {
    assert!(pcap.len() >= 24, "short pcap file");
    let le = match pcap[..4] {
        [0xd4, 0xc3, 0xb2, 0xa1] | [0x4d, 0x3c, 0xb2, 0xa1] => true,
        [0xa1, 0xb2, 0xc3, 0xd4] | [0xa1, 0xb2, 0x3c, 0x4d] => false,
        _ => panic!("not a pcap file"),
    };
    let u32at = |at: usize| {
        let b = [pcap[at], pcap[at + 1], pcap[at + 2], pcap[at + 3]];
        if le {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        }
    };
    assert_eq!(u32at(20), 1, "link type is not Ethernet");
    let mut out = Vec::new();
    let mut at = 24;
    while at + 16 <= pcap.len() {
        let incl = u32at(at + 8) as usize;
        let frame = &pcap[at + 16..(at + 16 + incl).min(pcap.len())];
        at += 16 + incl;
        if frame.len() < 14 + 20 || be16(frame, 12) != 0x0800 {
            continue;
        }
        let ip = &frame[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        if ip[9] != 6 || ip.len() < ihl + 20 {
            continue;
        }
        let tcp = &ip[ihl..];
        let hlen = usize::from(tcp[12] >> 4) * 4;
        let flags = tcp[13];
        if flags & 0x02 == 0 || tcp.len() < hlen {
            continue;
        }
        out.push(Syn {
            src: be16(tcp, 0),
            dst: be16(tcp, 2),
            ack: flags & 0x10 != 0,
            smc: smc_wire::tcpopt::tcp_header_has_smc_option(&tcp[..hlen])
                .expect("well-formed TCP options"),
        });
    }
    out
}

fn start_tcpdump(file: &std::path::Path, ports: [u16; 2]) -> Option<Child> {
    let filter = format!(
        "tcp[tcpflags] & tcp-syn != 0 and (port {} or port {})",
        ports[0], ports[1]
    );
    let mut child = match Command::new("tcpdump")
        .args(["-i", "lo", "-n", "-U", "-c", "6", "-w"])
        .arg(file)
        .arg(filter)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var_os("SMC_RDMA_REQUIRE_ALL").is_none(),
                "tcpdump: {e} (.ci/run installs it)"
            );
            eprintln!("SKIPPED: tcpdump: {e} (set SMC_RDMA_REQUIRE_ALL=1 to make this a failure)");
            return None;
        }
    };
    // capture starts once tcpdump says it listens
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("listening on"), "tcpdump: {line}");
    Some(child)
}

#[test]
fn the_smc_option_is_on_syn_and_syn_ack_of_smc_connections_only() {
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF, capture); CI runs as root"
    );
    // no device needed: the option is exchanged before CLC (which declines)
    let dir = std::env::temp_dir().join(format!("smc-capture-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("SMC_RS_CONFIG_DIR", dir.join("conf"));
    let smc_l = SmcListener::bind("127.0.0.1:0").unwrap();
    let tcp_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let smc_port = smc_l.local_addr().unwrap().port();
    let tcp_port = tcp_l.local_addr().unwrap().port();
    let file = dir.join("syn.pcap");
    let Some(mut dump) = start_tcpdump(&file, [smc_port, tcp_port]) else {
        return;
    };

    let srv = std::thread::spawn(move || {
        let a = smc_l.accept().unwrap().0;
        let b = smc_l.accept().unwrap().0;
        (a.mode(), b.mode())
    });
    let smc_c = SmcStream::connect(("127.0.0.1", smc_port)).unwrap();
    let plain_to_smc = TcpStream::connect(("127.0.0.1", smc_port)).unwrap();
    let plain_c = TcpStream::connect(("127.0.0.1", tcp_port)).unwrap();
    let _plain_s = tcp_l.accept().unwrap();
    let (smc_side, plain_side) = srv.join().unwrap();
    // the library saw the option where the capture must show it
    let no_option = |m: Mode| matches!(m, Mode::Tcp(f) if f.code() == 0x0301_0000);
    assert!(!no_option(smc_c.mode()), "{:?}", smc_c.mode());
    assert!(!no_option(smc_side), "{smc_side:?}");
    assert!(no_option(plain_side), "{plain_side:?}");

    let end = Instant::now() + Duration::from_secs(10);
    while dump.try_wait().unwrap().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    if dump.try_wait().unwrap().is_none() {
        let _ = dump.kill();
    }
    let syns = parse_pcap(&std::fs::read(&file).unwrap());
    let conn = |client_port: u16, server_port: u16| {
        let syn = syns
            .iter()
            .find(|s| !s.ack && s.src == client_port && s.dst == server_port)
            .unwrap_or_else(|| panic!("no SYN {client_port}->{server_port} in {syns:?}"));
        let syn_ack = syns
            .iter()
            .find(|s| s.ack && s.src == server_port && s.dst == client_port)
            .unwrap_or_else(|| panic!("no SYN-ACK {server_port}->{client_port} in {syns:?}"));
        (syn.smc, syn_ack.smc)
    };
    let port = |a: std::net::SocketAddr| a.port();
    assert_eq!(
        conn(port(smc_c.local_addr().unwrap()), smc_port),
        (true, true),
        "smc↔smc carries the option both ways: {syns:?}"
    );
    assert_eq!(
        conn(port(plain_to_smc.local_addr().unwrap()), smc_port),
        (false, false),
        "a plain client gets no option from an smc server: {syns:?}"
    );
    assert_eq!(
        conn(port(plain_c.local_addr().unwrap()), tcp_port),
        (false, false),
        "plain TCP has none: {syns:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
