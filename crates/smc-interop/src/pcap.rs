//! Classic pcap files (the format qemu's `filter-dump` and `tcpdump -w` write):
//! a 24-byte file header, then per packet a 16-byte record header and the
//! captured bytes. Either byte order, micro- or nanosecond timestamps.

/// Link type of Ethernet frames.
pub const LINKTYPE_ETHERNET: u32 = 1;

/// One captured packet.
#[derive(Clone, Copy, Debug)]
pub struct Packet<'a> {
    /// 1-based frame number, as tcpdump and Wireshark count.
    pub frame: usize,
    /// Capture time in nanoseconds since the epoch.
    pub ts_ns: u64,
    /// Length of the packet on the wire.
    pub orig_len: usize,
    /// The captured bytes (at most the file's snap length).
    pub data: &'a [u8],
}

impl Packet<'_> {
    /// The capture holds the whole packet.
    pub fn is_whole(&self) -> bool {
        self.data.len() >= self.orig_len
    }
}

/// A parsed capture file.
#[derive(Debug)]
pub struct Capture<'a> {
    /// The file's link type.
    pub linktype: u32,
    /// The file's snap length.
    pub snaplen: u32,
    /// Every packet, in file order.
    pub packets: Vec<Packet<'a>>,
    /// The file ends inside a packet record (a capture cut short).
    pub cut_short: bool,
}

/// Parses a pcap file.
pub fn parse(file: &[u8]) -> Result<Capture<'_>, String> {
    let magic = file
        .get(..4)
        .ok_or("not a pcap file: shorter than its header")?;
    let (le, nanos) = match magic {
        [0xd4, 0xc3, 0xb2, 0xa1] => (true, false),
        [0x4d, 0x3c, 0xb2, 0xa1] => (true, true),
        [0xa1, 0xb2, 0xc3, 0xd4] => (false, false),
        [0xa1, 0xb2, 0x3c, 0x4d] => (false, true),
        _ => return Err(format!("not a pcap file: magic {magic:02x?}")),
    };
    let u32at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = file.get(at..at + 4)?.try_into().ok()?;
        Some(if le {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    };
    let (Some(snaplen), Some(linktype)) = (u32at(16), u32at(20)) else {
        return Err("not a pcap file: shorter than its header".into());
    };
    let mut packets = Vec::new();
    let mut at = 24;
    let mut cut_short = false;
    while at < file.len() {
        let (Some(sec), Some(frac), Some(incl), Some(orig)) =
            (u32at(at), u32at(at + 4), u32at(at + 8), u32at(at + 12))
        else {
            cut_short = true;
            break;
        };
        let Some(data) = file.get(at + 16..at + 16 + incl as usize) else {
            cut_short = true;
            break;
        };
        let frac_ns = if nanos {
            u64::from(frac)
        } else {
            u64::from(frac) * 1000
        };
        packets.push(Packet {
            frame: packets.len() + 1,
            ts_ns: u64::from(sec) * 1_000_000_000 + frac_ns,
            orig_len: orig as usize,
            data,
        });
        at += 16 + incl as usize;
    }
    Ok(Capture {
        linktype,
        snaplen,
        packets,
        cut_short,
    })
}

/// Writes a microsecond, little-endian pcap file of `packets`.
pub fn write(snaplen: u32, linktype: u32, packets: &[Packet<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(&snaplen.to_le_bytes());
    out.extend_from_slice(&linktype.to_le_bytes());
    for p in packets {
        let sec = (p.ts_ns / 1_000_000_000) as u32;
        let usec = ((p.ts_ns % 1_000_000_000) / 1000) as u32;
        out.extend_from_slice(&sec.to_le_bytes());
        out.extend_from_slice(&usec.to_le_bytes());
        out.extend_from_slice(&(p.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(p.orig_len as u32).to_le_bytes());
        out.extend_from_slice(p.data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_parse_back() {
        let a = [1u8, 2, 3];
        let b = [9u8; 70];
        let pk = [
            Packet {
                frame: 1,
                ts_ns: 1_700_000_000_123_456_000,
                orig_len: 3,
                data: &a,
            },
            Packet {
                frame: 2,
                ts_ns: 1_700_000_001_000_001_000,
                orig_len: 1500,
                data: &b,
            },
        ];
        let f = write(70, LINKTYPE_ETHERNET, &pk);
        let c = parse(&f).unwrap();
        assert_eq!((c.linktype, c.snaplen, c.cut_short), (1, 70, false));
        assert_eq!(c.packets.len(), 2);
        assert_eq!(c.packets[0].data, &a);
        assert_eq!(c.packets[0].ts_ns, pk[0].ts_ns);
        assert!(c.packets[0].is_whole());
        assert_eq!(c.packets[1].orig_len, 1500);
        assert!(!c.packets[1].is_whole());
        assert_eq!(c.packets[1].frame, 2);
        // a file cut inside the second record
        let c = parse(&f[..f.len() - 10]).unwrap();
        assert!(c.cut_short);
        assert_eq!(c.packets.len(), 1);
        assert!(parse(b"nope").is_err());
        assert!(parse(&f[..10]).is_err());
    }
}
