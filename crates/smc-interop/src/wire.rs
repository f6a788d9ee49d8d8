//! Every SMC message in a capture of the wire between two SMC-R hosts, decoded
//! with `smc-wire`:
//!
//! * TCP: the SMC option on SYN and SYN-ACK, then the CLC messages at the start
//!   of each direction's byte stream (`protocol-clc.md` §3; reassembled from
//!   the segments, up to the first byte that is not CLC).
//! * RoCE v2 (UDP 4791, IBTA Annex A17): SENDs are LLC or CDC messages
//!   (`protocol-llc-cdc.md` §0, demultiplexed as Linux's
//!   `smc_wr_rx_demultiplex` does); multi-packet SENDs are joined; a packet
//!   whose PSN was already seen on its QP is a retransmission. RDMA WRITEs (the
//!   data) and ACKs are counted.
//!
//! Only IPv4 on Ethernet: Linux 6.12 speaks SMC-R v2 over IPv4 only.

use crate::pcap::{Capture, LINKTYPE_ETHERNET};
use smc_wire::cdc::{CdcMessage, Cursor};
use smc_wire::clc::{ClcHeader, ClcMessage, ClcType, CLC_HEADER_LEN};
use smc_wire::llc::LlcMessage;
use smc_wire::WrMessage;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4};

/// The RoCE v2 UDP destination port.
pub const ROCE_V2_PORT: u16 = 4791;

/// What a frame carried.
#[derive(Clone, Debug)]
pub enum What {
    /// A SYN (`ack`: SYN-ACK), with or without the SMC experimental option.
    Syn {
        /// SYN-ACK.
        ack: bool,
        /// The option (kind 254, ExID 0xE2D4C3D9) is present.
        smc_option: bool,
    },
    /// A TCP FIN or RST.
    TcpEnd {
        /// RST (else FIN).
        rst: bool,
    },
    /// A whole CLC message (the frame that completed it).
    Clc(ClcMessage),
    /// A whole RDMA SEND (the frame that completed it).
    Send {
        /// Destination QP number.
        dest_qp: u32,
        /// PSN of the SEND's last packet.
        psn: u32,
        /// A packet with this PSN was already seen on this QP.
        retransmit: bool,
        /// The LLC or CDC message.
        msg: WrMessage,
    },
    /// Bytes that should have been an SMC message and are not.
    Error(String),
}

/// One decoded event.
#[derive(Clone, Debug)]
pub struct Event {
    /// Frame number (1-based).
    pub frame: usize,
    /// Capture time, nanoseconds since the epoch.
    pub ts_ns: u64,
    /// Sender (TCP or UDP port).
    pub src: SocketAddrV4,
    /// Receiver.
    pub dst: SocketAddrV4,
    /// What it was.
    pub what: What,
}

impl Event {
    /// The LLC message, if this is one.
    pub fn llc(&self) -> Option<&LlcMessage> {
        match &self.what {
            What::Send {
                msg: WrMessage::Llc(m),
                ..
            } => Some(m),
            _ => None,
        }
    }

    /// The CDC message, if this is one.
    pub fn cdc(&self) -> Option<&CdcMessage> {
        match &self.what {
            What::Send {
                msg: WrMessage::Cdc(m),
                ..
            } => Some(m),
            _ => None,
        }
    }

    /// The CLC message, if this is one.
    pub fn clc(&self) -> Option<&ClcMessage> {
        match &self.what {
            What::Clc(m) => Some(m),
            _ => None,
        }
    }

    /// A retransmitted SEND.
    pub fn is_retransmit(&self) -> bool {
        matches!(
            self.what,
            What::Send {
                retransmit: true,
                ..
            }
        )
    }
}

/// A capture, decoded.
#[derive(Debug, Default)]
pub struct Decoded {
    /// The events in frame order.
    pub events: Vec<Event>,
    /// Frames in the file.
    pub frames: usize,
    /// RDMA WRITE packets (first/middle/last/only).
    pub rdma_write_packets: usize,
    /// Bytes announced by the RDMA WRITEs' RETH (the data moved).
    pub rdma_write_bytes: u64,
    /// RoCE ACK packets.
    pub roce_acks: usize,
    /// Other RoCE packets (reads, atomics, NAKs with other opcodes).
    pub roce_other: usize,
    /// TCP directions whose CLC phase could not be read to its end (a segment
    /// cut by the snap length, or missing).
    pub tcp_streams_cut: usize,
    /// The file ends inside a packet.
    pub cut_short: bool,
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be24(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 3)?;
    Some(u32::from(s[0]) << 16 | u32::from(s[1]) << 8 | u32::from(s[2]))
}

/// One direction of a TCP connection, read up to the end of its CLC messages.
struct TcpDir {
    isn: u32,
    buf: Vec<u8>,
    /// Bytes of `buf` consumed as CLC messages.
    pos: usize,
    /// The CLC phase ended (application data, a cut, or a bad message).
    done: bool,
    /// It ended because CLC bytes were cut off or missing.
    cut: bool,
}

/// SMC-R eyecatchers ("SMCR" / "SMCD" in EBCDIC), `protocol-clc.md` §3.1.
const EYECATCHERS: [[u8; 4]; 2] = [[0xE2, 0xD4, 0xC3, 0xD9], [0xE2, 0xD4, 0xC3, 0xC4]];
/// A CLC phase longer than this is not one.
const CLC_PHASE_MAX: usize = 64 * 1024;

#[derive(Default)]
struct SendAsm {
    /// Bytes of the SEND being received (FIRST .. LAST).
    partial: Option<Vec<u8>>,
    /// PSNs seen on this QP.
    seen: HashSet<u32>,
}

/// Decodes every SMC message of an Ethernet capture.
pub fn decode(cap: &Capture<'_>) -> Result<Decoded, String> {
    if cap.linktype != LINKTYPE_ETHERNET {
        return Err(format!("link type {} is not Ethernet", cap.linktype));
    }
    let mut d = Decoded {
        frames: cap.packets.len(),
        cut_short: cap.cut_short,
        ..Decoded::default()
    };
    let mut tcp: HashMap<(SocketAddrV4, SocketAddrV4), TcpDir> = HashMap::new();
    let mut sends: HashMap<(Ipv4Addr, Ipv4Addr, u32), SendAsm> = HashMap::new();
    for p in &cap.packets {
        let f = p.data;
        if be16(f, 12) != Some(0x0800) {
            continue; // ARP, IPv6 neighbour discovery, ...
        }
        let Some(ip) = f.get(14..) else { continue };
        let Some(&vihl) = ip.first() else { continue };
        let ihl = usize::from(vihl & 0x0f) * 4;
        let (Some(total), Some(proto)) = (be16(ip, 2), ip.get(9).copied()) else {
            continue;
        };
        let (Some(s), Some(t)) = (be32(ip, 12), be32(ip, 16)) else {
            continue;
        };
        let (src_ip, dst_ip) = (Ipv4Addr::from(s), Ipv4Addr::from(t));
        let l4_len = usize::from(total).saturating_sub(ihl);
        let Some(l4) = ip.get(ihl..) else { continue };
        let ev = |src: u16, dst: u16, what: What| Event {
            frame: p.frame,
            ts_ns: p.ts_ns,
            src: SocketAddrV4::new(src_ip, src),
            dst: SocketAddrV4::new(dst_ip, dst),
            what,
        };
        match proto {
            6 => {
                let (Some(sp), Some(dp), Some(seq), Some(&off), Some(&flags)) = (
                    be16(l4, 0),
                    be16(l4, 2),
                    be32(l4, 4),
                    l4.get(12),
                    l4.get(13),
                ) else {
                    continue;
                };
                let hlen = usize::from(off >> 4) * 4;
                let key = (SocketAddrV4::new(src_ip, sp), SocketAddrV4::new(dst_ip, dp));
                if flags & 0x02 != 0 {
                    let smc_option = l4.get(..hlen).is_some_and(|h| {
                        smc_wire::tcpopt::tcp_header_has_smc_option(h) == Ok(true)
                    });
                    d.events.push(ev(
                        sp,
                        dp,
                        What::Syn {
                            ack: flags & 0x10 != 0,
                            smc_option,
                        },
                    ));
                    tcp.insert(
                        key,
                        TcpDir {
                            isn: seq,
                            buf: Vec::new(),
                            pos: 0,
                            done: false,
                            cut: false,
                        },
                    );
                    continue;
                }
                let plen = l4_len.saturating_sub(hlen);
                if plen > 0 {
                    if let Some(dir) = tcp.get_mut(&key).filter(|d| !d.done) {
                        let seg = l4.get(hlen..).unwrap_or_default();
                        let whole = seg.len() >= plen;
                        let seg = &seg[..seg.len().min(plen)];
                        let rel = seq.wrapping_sub(dir.isn).wrapping_sub(1) as usize;
                        tcp_data(dir, rel, seg, whole, &mut d, |w| ev(sp, dp, w));
                    }
                }
                if flags & 0x05 != 0 {
                    d.events.push(ev(
                        sp,
                        dp,
                        What::TcpEnd {
                            rst: flags & 0x04 != 0,
                        },
                    ));
                }
            }
            17 => {
                let (Some(sp), Some(dp), Some(ulen)) = (be16(l4, 0), be16(l4, 2), be16(l4, 4))
                else {
                    continue;
                };
                if dp != ROCE_V2_PORT {
                    continue;
                }
                // RDMA WRITEs are usually cut by the snap length: only SENDs must be whole
                let udp_end = usize::from(ulen).min(l4_len);
                let whole = l4.len() >= udp_end;
                roce(
                    l4.get(8..udp_end.min(l4.len())),
                    whole,
                    (src_ip, dst_ip),
                    &mut sends,
                    &mut d,
                    |w| ev(sp, dp, w),
                );
            }
            _ => {}
        }
    }
    d.tcp_streams_cut = tcp.values().filter(|t| t.cut).count();
    Ok(d)
}

fn is_clc_start(b: &[u8]) -> bool {
    b.get(..4)
        .is_some_and(|e| EYECATCHERS.iter().any(|x| x == e))
}

/// Adds a TCP segment (`seg`: its captured bytes, `whole`: all of them) at
/// stream offset `rel` and emits the CLC messages it completes.
fn tcp_data(
    dir: &mut TcpDir,
    rel: usize,
    seg: &[u8],
    whole: bool,
    d: &mut Decoded,
    ev: impl Fn(What) -> Event,
) {
    let have = dir.buf.len();
    if whole && rel + seg.len() <= have {
        return; // a retransmission of what we have
    }
    if !whole || rel > have {
        // cut by the snap length, or a hole: the stream cannot be read on. That
        // matters only if CLC bytes are pending or this segment starts a message.
        let pending = dir.pos < have;
        let starts_clc = rel == have && seg.len() >= 4 && is_clc_start(seg);
        dir.cut = pending || starts_clc;
        dir.done = true;
        return;
    }
    dir.buf.extend_from_slice(&seg[have - rel..]);
    while !dir.done {
        let rest = &dir.buf[dir.pos..];
        if rest.is_empty() {
            break;
        }
        // not (the start of) an eyecatcher: the application's data begins
        let n = rest.len().min(4);
        if !EYECATCHERS.iter().any(|e| e[..n] == rest[..n]) {
            dir.done = true;
            break;
        }
        if rest.len() < CLC_HEADER_LEN {
            break;
        }
        let hdr = match ClcHeader::peek(rest) {
            Ok(h) => h,
            Err(e) => {
                d.events.push(ev(What::Error(format!("CLC header: {e}"))));
                dir.done = true;
                break;
            }
        };
        let len = usize::from(hdr.length);
        if rest.len() < len {
            if dir.buf.len() > CLC_PHASE_MAX {
                d.events.push(ev(What::Error(format!(
                    "CLC {} claims {len} bytes",
                    hdr.msg_type.name()
                ))));
                dir.done = true;
            }
            break;
        }
        match ClcMessage::decode(&rest[..len]) {
            Ok(m) => d.events.push(ev(What::Clc(m))),
            Err(e) => {
                d.events
                    .push(ev(What::Error(format!("CLC {}: {e}", hdr.msg_type.name()))));
                dir.done = true;
            }
        }
        dir.pos += len;
    }
    if dir.done {
        dir.buf = Vec::new(); // keep nothing of the application's data
    }
}

/// One RoCE v2 packet: the BTH, then by opcode (RC only, IBTA 9.2 and Table 38).
fn roce(
    udp: Option<&[u8]>,
    whole: bool,
    ips: (Ipv4Addr, Ipv4Addr),
    sends: &mut HashMap<(Ipv4Addr, Ipv4Addr, u32), SendAsm>,
    d: &mut Decoded,
    ev: impl Fn(What) -> Event,
) {
    let Some(b) = udp else {
        d.events.push(ev(What::Error(
            "RoCE packet shorter than its UDP header".into(),
        )));
        return;
    };
    let (Some(&opcode), Some(&b1), Some(dest_qp), Some(psn)) =
        (b.first(), b.get(1), be24(b, 5), be24(b, 9))
    else {
        d.events
            .push(ev(What::Error("RoCE packet shorter than its BTH".into())));
        return;
    };
    let pad = usize::from((b1 >> 4) & 0x3);
    const BTH: usize = 12;
    const ICRC: usize = 4;
    match opcode {
        0x00..=0x05 => {
            // SEND FIRST, MIDDLE, LAST, LAST with immediate, ONLY, ONLY with immediate
            let imm = if matches!(opcode, 0x03 | 0x05) { 4 } else { 0 };
            let end = b.len().saturating_sub(ICRC + pad);
            let Some(payload) = b.get(BTH + imm..end).filter(|_| whole) else {
                d.events.push(ev(What::Error(format!(
                    "RDMA SEND (opcode {opcode:#04x}) cut by the snap length"
                ))));
                return;
            };
            let asm = sends.entry((ips.0, ips.1, dest_qp)).or_default();
            let retransmit = !asm.seen.insert(psn);
            let whole = match opcode {
                0x04 | 0x05 => Some(payload.to_vec()),
                0x00 => {
                    asm.partial = Some(payload.to_vec());
                    None
                }
                0x01 => {
                    if let Some(p) = asm.partial.as_mut() {
                        p.extend_from_slice(payload);
                    }
                    None
                }
                _ => asm.partial.take().map(|mut p| {
                    p.extend_from_slice(payload);
                    p
                }),
            };
            if let Some(msg) = whole {
                match WrMessage::decode(&msg) {
                    Ok(msg) => d.events.push(ev(What::Send {
                        dest_qp,
                        psn,
                        retransmit,
                        msg,
                    })),
                    Err(e) => d.events.push(ev(What::Error(format!(
                        "SEND of {} bytes to QP {dest_qp:#x}: {e}",
                        msg.len()
                    )))),
                }
            }
        }
        0x06..=0x0b => {
            d.rdma_write_packets += 1;
            if matches!(opcode, 0x06 | 0x0a | 0x0b) {
                // RETH: virtual address (8), rkey (4), DMA length (4)
                d.rdma_write_bytes += u64::from(be32(b, BTH + 12).unwrap_or(0));
            }
        }
        0x11 => d.roce_acks += 1,
        _ => d.roce_other += 1,
    }
}

/// Message counts of a decoded capture (what the harness checks per case).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    /// SYNs carrying the SMC option (a refused connect's too).
    pub syn_smc: usize,
    /// SYN-ACKs carrying it: connections on which both ends offered SMC.
    pub synack_smc: usize,
    /// SYNs and SYN-ACKs without it.
    pub syn_plain: usize,
    /// CLC Proposals.
    pub proposals: usize,
    /// CLC Accepts, and those with the first-contact flag.
    pub accepts: usize,
    /// Accepts with first contact.
    pub accepts_fc: usize,
    /// CLC Confirms.
    pub confirms: usize,
    /// Confirms with first contact.
    pub confirms_fc: usize,
    /// Decline codes, in order.
    pub declines: Vec<u32>,
    /// LLC messages by type name: (requests, responses), retransmissions not counted.
    pub llc: BTreeMap<&'static str, (usize, usize)>,
    /// CDC messages (retransmissions not counted).
    pub cdc: usize,
    /// CDCs whose producer cursor moved (data announced).
    pub cdc_data: usize,
    /// CDCs with urg_data_present (an urgent byte announced, RFC 7609 §4.5).
    pub cdc_urg: usize,
    /// CDCs with peer_conn_closed.
    pub cdc_closed: usize,
    /// CDCs with peer_conn_abort.
    pub cdc_abort: usize,
    /// Retransmitted SENDs.
    pub retransmits: usize,
    /// Undecodable messages.
    pub errors: usize,
}

impl Counts {
    /// Requests and responses of an LLC type (`LlcType::name`, e.g. `CONFIRM_LINK`).
    pub fn llc(&self, name: &str) -> (usize, usize) {
        self.llc.get(name).copied().unwrap_or((0, 0))
    }
}

/// Counts the messages of `d`.
pub fn count(d: &Decoded) -> Counts {
    let mut c = Counts::default();
    let mut last_prod: HashMap<(SocketAddrV4, SocketAddrV4, u32), Cursor> = HashMap::new();
    for e in &d.events {
        if e.is_retransmit() {
            c.retransmits += 1;
            continue;
        }
        match &e.what {
            What::Syn { ack, smc_option } => match (smc_option, ack) {
                (true, false) => c.syn_smc += 1,
                (true, true) => c.synack_smc += 1,
                (false, _) => c.syn_plain += 1,
            },
            What::TcpEnd { .. } => {}
            What::Clc(m) => match m {
                ClcMessage::Proposal(_) => c.proposals += 1,
                ClcMessage::Accept(a) => {
                    c.accepts += 1;
                    c.accepts_fc += usize::from(a.first_contact);
                }
                ClcMessage::Confirm(a) => {
                    c.confirms += 1;
                    c.confirms_fc += usize::from(a.first_contact);
                }
                ClcMessage::Decline(x) => c.declines.push(x.diagnosis.to_u32()),
            },
            What::Send { msg, .. } => match msg {
                WrMessage::Llc(m) => {
                    let n = c.llc.entry(m.llc_type().name()).or_default();
                    if m.is_response() {
                        n.1 += 1
                    } else {
                        n.0 += 1
                    }
                }
                WrMessage::Cdc(m) => {
                    c.cdc += 1;
                    let key = (
                        SocketAddrV4::new(*e.src.ip(), 0),
                        SocketAddrV4::new(*e.dst.ip(), 0),
                        m.token,
                    );
                    let before = last_prod.insert(key, m.prod).unwrap_or_default();
                    c.cdc_data += usize::from(before != m.prod);
                    c.cdc_urg += usize::from(m.prod_flags.urg_data_present());
                    c.cdc_closed += usize::from(m.conn_flags.peer_conn_closed());
                    c.cdc_abort += usize::from(m.conn_flags.peer_conn_abort());
                }
            },
            What::Error(_) => c.errors += 1,
        }
    }
    c
}

impl fmt::Display for Event {
    /// `frame 12 +0.001234s 10.99.0.2:40000 > 10.99.0.1:6001 CLC Proposal ...`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "frame {} {} > {} ", self.frame, self.src, self.dst)?;
        match &self.what {
            What::Syn { ack, smc_option } => write!(
                f,
                "{}{}",
                if *ack { "SYN-ACK" } else { "SYN" },
                if *smc_option { " +SMC option" } else { "" }
            ),
            What::TcpEnd { rst } => write!(f, "{}", if *rst { "RST" } else { "FIN" }),
            What::Clc(m) => match m {
                ClcMessage::Proposal(p) => write!(f, "CLC Proposal v{}", p.version),
                ClcMessage::Accept(a) | ClcMessage::Confirm(a) => write!(
                    f,
                    "CLC {} v{}{} gid={} qpn={:#x} token={:#x}",
                    if matches!(m, ClcMessage::Accept(_)) {
                        ClcType::Accept.name()
                    } else {
                        ClcType::Confirm.name()
                    },
                    a.version,
                    if a.first_contact {
                        " first-contact"
                    } else {
                        ""
                    },
                    a.gid.to_ipv6(),
                    a.qpn,
                    a.alert_token
                ),
                ClcMessage::Decline(x) => {
                    write!(f, "CLC Decline v{} {}", x.version, x.diagnosis)
                }
            },
            What::Send {
                dest_qp,
                psn,
                retransmit,
                msg,
            } => {
                write!(
                    f,
                    "SEND qp={dest_qp:#x} psn={psn:#x}{} ",
                    if *retransmit { " (retransmission)" } else { "" }
                )?;
                match msg {
                    WrMessage::Llc(m) => write!(
                        f,
                        "LLC{} {} {}",
                        if m.version().is_v2() { "v2" } else { "v1" },
                        m.llc_type().name(),
                        if m.is_response() { "resp" } else { "req" }
                    ),
                    WrMessage::Cdc(m) => write!(
                        f,
                        "CDC seq={} token={:#x} prod={}:{:#x} cons={}:{:#x} {:?} {:?}",
                        m.seqno,
                        m.token,
                        m.prod.wrap,
                        m.prod.count,
                        m.cons.wrap,
                        m.cons.count,
                        m.prod_flags,
                        m.conn_flags
                    ),
                }
            }
            What::Error(e) => write!(f, "ERROR {e}"),
        }
    }
}
