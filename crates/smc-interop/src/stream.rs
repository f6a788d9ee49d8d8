//! The interop connection protocol, byte for byte what `kpeer.c` speaks.
//!
//! The client sends a [`Header`]; then both ends send their stream at once and
//! read the other's. Stream bytes come from [`fill`]: seed `2*id` from client
//! to server, `2*id + 1` back ([`seed`]). Once an end has sent and received
//! everything, the end named by [`Header::server_closes`] closes; the other
//! waits for EOF and closes after it.

/// First 8 bytes of every header.
pub const MAGIC: [u8; 8] = *b"SMCIOP1\0";
/// Header length on the wire.
pub const HEADER_LEN: usize = 32;

/// What the client asks of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Bytes the client sends.
    pub to_server: u64,
    /// Bytes the server sends.
    pub to_client: u64,
    /// Connection id (seeds the streams).
    pub id: u32,
    /// The server closes first (else the client does).
    pub server_closes: bool,
    /// Before the streams, each end sends [`URGENT_PREFIX_LEN`] in-band bytes
    /// ([`urgent_prefix`]) and then one urgent byte (`MSG_OOB`): the client
    /// [`URGENT_FROM_CLIENT`] right after the header, the server
    /// [`URGENT_FROM_SERVER`] once it has received the client's. A receiver
    /// fetches the urgent byte out of band first, then reads the prefix in band:
    /// the urgent byte must not be among those bytes, nor in the stream after.
    pub urgent: bool,
}

/// The client's urgent byte (see [`Header::urgent`]).
pub const URGENT_FROM_CLIENT: u8 = 0xC1;
/// The server's urgent byte.
pub const URGENT_FROM_SERVER: u8 = 0x5E;
/// In-band bytes before each urgent byte. Not zero on purpose: Linux 6.12
/// (`net/smc/smc_rx.c`, `smc_rx_recv_urg`) leaves an urgent byte in band when
/// `recv(MSG_OOB)` fetches it while it is the very next unread byte (it marks
/// the skip only when the byte lies further ahead), and a reader then gets the
/// urgent byte in band and waits forever for the stream's last byte.
pub const URGENT_PREFIX_LEN: usize = 64;

/// The in-band bytes an end sends before its urgent byte `urgent`: byte `i`
/// is `i ^ urgent`.
pub fn urgent_prefix(urgent: u8) -> [u8; URGENT_PREFIX_LEN] {
    std::array::from_fn(|i| (i as u8) ^ urgent)
}

impl Header {
    /// `MAGIC`, two big-endian u64 sizes, the big-endian id, the closer byte, the
    /// urgent byte, 2 zeros.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(&MAGIC);
        h[8..16].copy_from_slice(&self.to_server.to_be_bytes());
        h[16..24].copy_from_slice(&self.to_client.to_be_bytes());
        h[24..28].copy_from_slice(&self.id.to_be_bytes());
        h[28] = u8::from(self.server_closes);
        h[29] = u8::from(self.urgent);
        h
    }

    /// The header, or why these bytes are not one.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if h[..8] != MAGIC {
            return Err(format!("bad magic {:02x?}", &h[..8]));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_be_bytes(b)
        };
        Ok(Header {
            to_server: u64_at(8),
            to_client: u64_at(16),
            id: u32::from_be_bytes([h[24], h[25], h[26], h[27]]),
            server_closes: h[28] != 0,
            urgent: h[29] != 0,
        })
    }
}

/// SplitMix64's output function (Steele, Lea, Flood 2014).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of connection `id`'s stream from the client (`false`) or the server.
pub fn seed(id: u32, from_server: bool) -> u64 {
    2 * u64::from(id) + u64::from(from_server)
}

/// Fills `buf` with bytes `[off, off + buf.len())` of stream `seed`: byte `i`
/// is byte `i % 8` (little-endian) of `splitmix64((seed << 40) + i / 8)`.
pub fn fill(buf: &mut [u8], seed: u64, off: u64) {
    let base = seed << 40;
    let mut i = off;
    let mut k = 0;
    while k < buf.len() {
        let w = splitmix64(base.wrapping_add(i / 8)).to_le_bytes();
        let from = (i % 8) as usize;
        let n = (8 - from).min(buf.len() - k);
        buf[k..k + n].copy_from_slice(&w[from..from + n]);
        k += n;
        i += n as u64;
    }
}

/// Parses a byte count: a number, optionally followed by `K`, `M` or `G` (binary).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (num, shift) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let v: u64 = num
        .parse()
        .map_err(|_| format!("bad size '{s}' (a number, optionally followed by K, M or G)"))?;
    v.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_other_bytes() {
        let h = Header {
            to_server: 64 << 20,
            to_client: 3,
            id: 0x0102_0304,
            server_closes: true,
            urgent: true,
        };
        let b = h.encode();
        assert_eq!(&b[..8], b"SMCIOP1\0");
        assert_eq!(&b[24..30], &[1, 2, 3, 4, 1, 1]);
        assert_eq!(Header::decode(&b), Ok(h));
        let mut bad = b;
        bad[0] = b'X';
        assert!(Header::decode(&bad).is_err());
    }

    /// The first bytes of `kpeer gen 3 32` (the C generator in
    /// scripts/vm/interop/kpeer.c): both peers and the host's expected hashes
    /// must produce the same stream.
    #[test]
    fn generator_matches_the_kernel_peer() {
        let mut b = [0u8; 32];
        fill(&mut b, 3, 0);
        assert_eq!(
            b,
            [
                0xfe, 0x6f, 0xe7, 0x21, 0x8e, 0x20, 0xeb, 0xe2, 0x75, 0x90, 0xa1, 0x13, 0xe1, 0x92,
                0x48, 0x3d, 0xfa, 0xd6, 0x5e, 0xfa, 0x88, 0x38, 0x78, 0xf6, 0x09, 0x6e, 0x35, 0xd5,
                0x7b, 0xae, 0x12, 0xf6
            ]
        );
    }

    #[test]
    fn fill_at_any_offset_is_a_slice_of_the_whole_stream() {
        let mut whole = vec![0u8; 1000];
        fill(&mut whole, 7, 0);
        for (off, len) in [(0, 1), (1, 7), (5, 16), (8, 8), (13, 500), (999, 1)] {
            let mut part = vec![0u8; len];
            fill(&mut part, 7, off as u64);
            assert_eq!(part, whole[off..off + len], "off {off} len {len}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("3k"), Ok(3072));
        assert_eq!(parse_size("12"), Ok(12));
        assert!(parse_size("M").is_err());
        assert!(parse_size("1T").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
