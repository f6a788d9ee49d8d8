//! LLC (Link Layer Control) messages — `protocol-llc-cdc.md` §1.
//!
//! LLC messages travel as the payload of RDMA SENDs on a link (§0). Byte 0 is split
//! into two nibbles: the high nibble is the LLC version (0 on an SMC-R v1 link group,
//! 2 on an SMC-Rv2 link group), the low nibble the LLC type (§1.2). A v1 message is
//! always 44 bytes and byte 1 holds that length; byte 2's low nibble carries the
//! ADD_LINK reject reason. On a v2 link group bytes 1..2 are one 16-bit `length_v2`
//! (44..=8192) that Linux stores in *host* byte order — little-endian from an x86
//! peer (`lab/captures/README.md` §9), big-endian from s390. [`LlcVersion::V2`]
//! records which order a received message used, so that re-encoding it is
//! byte-identical; new messages default to little-endian ([`LlcVersion::V2_LE`]).
//!
//! Every message is a plain struct with public fields, `decode`/`encode`/
//! `encode_into`/`encoded_len`, and [`LlcMessage`] dispatches on the type byte.
//! The header flag byte (byte 3) is kept raw in each struct (`flags`), so that bits a
//! peer sets are echoed back exactly as Linux echoes them; accessors such as
//! `is_response()` interpret it. Reserved bytes are written as zero and ignored on
//! read.
//!
//! Receive rules (Linux `smc_llc_rx_handler`, checked in `net/smc/smc_llc.c`): a v1
//! message whose length byte is not 44 is dropped ([`WireError::BadLength`]); a v2
//! message needs `length_v2 >= 44` (we also require `<= 8192`, the size of Linux's
//! large receive buffer); a message shorter than 44 bytes is dropped
//! ([`WireError::Truncated`]). A type this protocol does not define yields
//! [`WireError::UnknownType`] so that the engine can decide; note that Linux itself
//! only registers handlers for the type bytes in [`is_linux_handled`] and silently
//! drops every other byte (including `0x05`, `0x23`, `0x28`) at the work-request
//! demultiplexer, so its "protocol violation" branch is unreachable from the wire.

use core::time::Duration;

use crate::buf::{Reader, Writer};
use crate::types::{Gid, Mac, U24_MAX};
use crate::{Result, WireError};

// ------------------------------------------------------------------------------------
// Constants (§1.2, §1.3, §1.4, §1.5)
// ------------------------------------------------------------------------------------

/// Length of every v1 LLC message and the minimum of a v2 one (`SMC_WR_TX_SIZE`, §0).
pub const LLC_V1_LEN: usize = 44;
/// Minimum `length_v2` of an SMC-Rv2 LLC message (§1.1).
pub const LLC_V2_MIN_LEN: usize = 44;
/// Maximum `length_v2` of an SMC-Rv2 LLC message (`SMC_WR_BUF_V2_SIZE`, §1.1).
pub const LLC_V2_MAX_LEN: usize = 8192;

/// Header flag (byte 3) on every type: the message is a response (`SMC_LLC_FLAG_RESP`, §1.3).
pub const FLAG_RESP: u8 = 0x80;
/// ADD_LINK response flag: the request is rejected (`SMC_LLC_FLAG_ADD_LNK_REJ`, §1.3).
pub const FLAG_ADD_LNK_REJ: u8 = 0x40;
/// DELETE_LINK flag: delete all links, i.e. terminate the link group (§1.3).
pub const FLAG_DEL_LINK_ALL: u8 = 0x40;
/// DELETE_LINK flag: orderly deletion (§1.3).
pub const FLAG_DEL_LINK_ORDERLY: u8 = 0x20;
/// CONFIRM_RKEY / DELETE_RKEY response flag: negative (failed) (§1.3).
pub const FLAG_RKEY_NEG: u8 = 0x20;
/// CONFIRM_RKEY negative response flag: retry allowed (§1.3).
pub const FLAG_RKEY_RETRY: u8 = 0x10;
/// CONFIRM_LINK flags "no RMBE eye catcher": Linux always sets both bits (§1.3).
pub const FLAG_NO_RMBE_EYEC: u8 = 0x03;

/// ADD_LINK reject reason "no alternate path" (`SMC_LLC_REJ_RSN_NO_ALT_PATH`, §1.3) —
/// the only reason Linux sends, and only on a v1 link group.
pub const REJ_RSN_NO_ALT_PATH: u8 = 1;
/// ADD_LINK reject reason "invalid MTU" (RFC 7609; Linux never sends it, §10).
pub const REJ_RSN_INVALID_MTU: u8 = 2;

/// DELETE_LINK request reason: lost path (§1.4.4).
pub const DEL_LOST_PATH: u32 = 0x0001_0000;
/// DELETE_LINK request reason: operator initiated termination (§1.4.4).
pub const DEL_OP_INIT_TERM: u32 = 0x0002_0000;
/// DELETE_LINK request reason: program initiated termination (§1.4.4).
pub const DEL_PROG_INIT_TERM: u32 = 0x0003_0000;
/// DELETE_LINK request reason: LLC protocol violation (§1.4.4).
pub const DEL_PROT_VIOL: u32 = 0x0004_0000;
/// DELETE_LINK request reason: asymmetric link no longer needed (§1.4.4).
pub const DEL_NO_ASYM_NEEDED: u32 = 0x0005_0000;
/// DELETE_LINK response reason: unknown link id (§1.4.4).
pub const DEL_NOLNK: u32 = 0x0010_0000;
/// DELETE_LINK response reason: unknown link group (§1.4.4).
pub const DEL_NOLGR: u32 = 0x0020_0000;

/// Generic wait for an LLC response or the next message of a flow; also the
/// TEST_LINK response timeout (`SMC_LLC_WAIT_TIME`, §1.5).
pub const WAIT_TIME: Duration = Duration::from_secs(2);
/// Wait for CONFIRM_LINK on a newly added (non-first) link (`SMC_LLC_WAIT_FIRST_TIME`, §1.5).
pub const WAIT_FIRST_TIME: Duration = Duration::from_secs(5);
/// Client's first-contact CONFIRM_LINK wait: 2 × [`WAIT_TIME`] (§1.5).
pub const CLIENT_FIRST_CONFIRM_LINK_WAIT: Duration = Duration::from_secs(4);
/// Server's first-contact CONFIRM_LINK response wait (§1.5).
pub const SERVER_FIRST_CONFIRM_LINK_WAIT: Duration = Duration::from_secs(2);
/// Maximum wait to acquire the LLC flow slot: 10 × [`WAIT_TIME`] (§1.5).
pub const FLOW_INITIATE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default TEST_LINK keepalive interval (`SMC_LLC_TESTLINK_DEFAULT_TIME`, §1.5).
pub const TESTLINK_DEFAULT_TIME: Duration = Duration::from_secs(30);
/// Wait for a free send work-request slot before the link is brought down (§1.5).
pub const WR_TX_WAIT_FREE_SLOT_TIME: Duration = Duration::from_secs(10);
/// Wait for an `IB_WR_REG_MR` completion before the link is brought down (§1.5).
pub const WR_REG_MR_WAIT_TIME: Duration = Duration::from_secs(5);

/// Link slots per link group (`SMC_LINKS_PER_LGR_MAX`, §1.5).
pub const LINKS_PER_LGR_MAX: usize = 3;
/// Max links advertised in CONFIRM_LINK on v1 / v2.0 (`SMC_LINKS_ADD_LNK_MAX`, §1.5).
pub const LINKS_ADD_LNK_MAX: u8 = 2;
/// RMBs (rtoken slots) per link group (`SMC_RMBS_PER_LGR_MAX`, §1.5).
pub const RMBS_PER_LGR_MAX: usize = 255;
/// Rtokens in one CONFIRM_RKEY message (`SMC_LLC_RKEYS_PER_MSG`, §1.4.5).
pub const RKEYS_PER_MSG: usize = 3;
/// Rkey triples in one ADD_LINK_CONT message (`SMC_LLC_RKEYS_PER_CONT_MSG`, §1.4.3).
pub const RKEYS_PER_CONT_MSG: usize = 2;
/// Rkeys in one v1 DELETE_RKEY message (`SMC_LLC_DEL_RKEY_MAX`, §1.4.7).
pub const DEL_RKEY_MAX: usize = 8;
/// Most rkeys Linux processes from a v2 message (`SMC_LLC_RKEYS_PER_MSG_V2`, §1.4.2).
pub const RKEYS_PER_MSG_V2: usize = 255;
/// Most ADD_LINK v2 extension entries that fit into [`LLC_V2_MAX_LEN`] bytes.
pub const ADD_LINK_V2_MAX_RKEYS: usize = (LLC_V2_MAX_LEN - ADD_LINK_EXT_RKEYS_OFF) / 16;

const ADD_LINK_EXT_RKEYS_OFF: usize = 72;
const REQ_ADD_LINK_GIDS_OFF: usize = 28;
const DELETE_RKEY_KEYS_OFF: usize = 8;

/// True for the type bytes Linux registers a receive handler for
/// (`smc_llc_rx_handlers` in `net/smc/smc_llc.c`): `0x01..=0x04`, `0x06..=0x09`,
/// `0x21`, `0x22`, `0x24..=0x27`, `0x29`. Linux silently drops every other byte.
pub const fn is_linux_handled(type_byte: u8) -> bool {
    matches!(
        type_byte,
        0x01..=0x04 | 0x06..=0x09 | 0x21 | 0x22 | 0x24..=0x27 | 0x29
    )
}

// ------------------------------------------------------------------------------------
// Type codes and header (§1.1, §1.2)
// ------------------------------------------------------------------------------------

/// The LLC type (low nibble of byte 0), `protocol-llc-cdc.md` §1.2.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
#[repr(u8)]
pub enum LlcType {
    /// CONFIRM_LINK (1).
    ConfirmLink = 1,
    /// ADD_LINK (2).
    AddLink = 2,
    /// ADD_LINK_CONT (3), v1 only in Linux.
    AddLinkCont = 3,
    /// DELETE_LINK (4).
    DeleteLink = 4,
    /// REQ_ADD_LINK (5), v2 only in Linux.
    ReqAddLink = 5,
    /// CONFIRM_RKEY (6).
    ConfirmRkey = 6,
    /// TEST_LINK (7).
    TestLink = 7,
    /// CONFIRM_RKEY_CONT (8), never sent by Linux.
    ConfirmRkeyCont = 8,
    /// DELETE_RKEY (9).
    DeleteRkey = 9,
}

impl LlcType {
    /// All types in code order.
    pub const ALL: [LlcType; 9] = [
        LlcType::ConfirmLink,
        LlcType::AddLink,
        LlcType::AddLinkCont,
        LlcType::DeleteLink,
        LlcType::ReqAddLink,
        LlcType::ConfirmRkey,
        LlcType::TestLink,
        LlcType::ConfirmRkeyCont,
        LlcType::DeleteRkey,
    ];

    /// The type for a 4-bit code; `None` for 0 and 10..=15.
    pub fn from_code(code: u8) -> Option<LlcType> {
        LlcType::ALL.into_iter().find(|t| *t as u8 == code)
    }

    /// The 4-bit code.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The name used by the capture decoder (`decode.py`), e.g. `CONFIRM_LINK`.
    pub fn name(self) -> &'static str {
        match self {
            LlcType::ConfirmLink => "CONFIRM_LINK",
            LlcType::AddLink => "ADD_LINK",
            LlcType::AddLinkCont => "ADD_LINK_CONT",
            LlcType::DeleteLink => "DELETE_LINK",
            LlcType::ReqAddLink => "REQ_ADD_LINK",
            LlcType::ConfirmRkey => "CONFIRM_RKEY",
            LlcType::TestLink => "TEST_LINK",
            LlcType::ConfirmRkeyCont => "CONFIRM_RKEY_CONT",
            LlcType::DeleteRkey => "DELETE_RKEY",
        }
    }
}

/// Byte order of a host-order `u16` that Linux puts on the wire in SMC-Rv2 LLC
/// messages (`length_v2`, ADD_LINK extension `num_rkeys`), `protocol-llc-cdc.md` §1.1.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum ByteOrder {
    /// Little-endian: what x86/arm64 Linux sends (the default for sending).
    #[default]
    Little,
    /// Big-endian: what s390 Linux sends (and, presumably, the IBM document intends).
    Big,
}

impl ByteOrder {
    /// Reads a u16 from two wire bytes in this order.
    pub fn read(self, b: [u8; 2]) -> u16 {
        match self {
            ByteOrder::Little => u16::from_le_bytes(b),
            ByteOrder::Big => u16::from_be_bytes(b),
        }
    }

    /// The two wire bytes of `x` in this order.
    pub fn bytes(self, x: u16) -> [u8; 2] {
        match self {
            ByteOrder::Little => x.to_le_bytes(),
            ByteOrder::Big => x.to_be_bytes(),
        }
    }
}

/// True if `x` reads the same in both byte orders, so its order cannot be detected.
fn order_invisible(x: u16) -> bool {
    x.swap_bytes() == x
}

/// LLC header version (high nibble of byte 0), `protocol-llc-cdc.md` §1.1.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum LlcVersion {
    /// SMC-R v1 link group: type byte `0x0N`, length byte 44, byte 2 = reject reason.
    V1,
    /// SMC-Rv2 link group: type byte `0x2N`, bytes 1..2 = `length_v2` in `length_order`.
    V2 {
        /// Byte order of `length_v2` as received, or to use when sending.
        length_order: ByteOrder,
    },
}

impl LlcVersion {
    /// SMC-Rv2 with little-endian `length_v2`, what an x86 Linux peer sends.
    pub const V2_LE: LlcVersion = LlcVersion::V2 {
        length_order: ByteOrder::Little,
    };
    /// SMC-Rv2 with big-endian `length_v2`, what an s390 Linux peer sends.
    pub const V2_BE: LlcVersion = LlcVersion::V2 {
        length_order: ByteOrder::Big,
    };

    /// True on an SMC-Rv2 link group.
    pub fn is_v2(self) -> bool {
        matches!(self, LlcVersion::V2 { .. })
    }

    /// The version nibble (0 or 2).
    pub fn nibble(self) -> u8 {
        match self {
            LlcVersion::V1 => 0,
            LlcVersion::V2 { .. } => 2,
        }
    }
}

/// The decoded 4-byte LLC header (`protocol-llc-cdc.md` §1.1), after the Linux
/// receive checks (§0) have passed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LlcHeader {
    /// The message type.
    pub llc_type: LlcType,
    /// v1 or v2 (with the detected `length_v2` byte order).
    pub version: LlcVersion,
    /// The length the header declares: 44 for v1, `length_v2` for v2. Decoders do not
    /// rely on it (neither does Linux); they parse the buffer they are given.
    pub length: usize,
    /// v1: the low nibble of byte 2 (ADD_LINK reject reason); 0 for v2.
    pub v1_reject_reason: u8,
    /// The raw flag byte (byte 3).
    pub flags: u8,
}

impl LlcHeader {
    /// Decodes and validates the header of a received SEND payload `buf` (its exact
    /// length). Checks, in order: type byte (→ [`WireError::UnknownType`]), 4 header
    /// bytes, v1 length byte == 44 / v2 `length_v2` in 44..=8192 in some byte order
    /// (→ [`WireError::BadLength`]), and that `buf` holds at least 44 bytes
    /// (→ [`WireError::Truncated`]).
    ///
    /// `length_v2` byte order: the reading equal to `buf.len()` wins; otherwise the
    /// one within 44..=8192; little-endian is preferred on a tie.
    pub fn decode(buf: &[u8]) -> Result<LlcHeader> {
        let mut r = Reader::new(buf, "LLC header");
        let t = r.u8()?;
        let llc_type = match (t >> 4, LlcType::from_code(t & 0x0F)) {
            (0 | 2, Some(ty)) => ty,
            _ => {
                return Err(WireError::UnknownType {
                    family: "LLC",
                    value: t,
                })
            }
        };
        let b = r.array::<3>()?;
        let [b1, b2, flags] = b;
        let (version, length, v1_reject_reason) = if t >> 4 == 0 {
            if usize::from(b1) != LLC_V1_LEN {
                return Err(WireError::BadLength {
                    what: "LLC v1 length byte",
                    claimed: usize::from(b1),
                    expected: LLC_V1_LEN,
                });
            }
            (LlcVersion::V1, LLC_V1_LEN, b2 & 0x0F)
        } else {
            let raw = [b1, b2];
            let le = usize::from(ByteOrder::Little.read(raw));
            let be = usize::from(ByteOrder::Big.read(raw));
            let ok = |x: usize| (LLC_V2_MIN_LEN..=LLC_V2_MAX_LEN).contains(&x);
            let order = if le == buf.len() && ok(le) {
                ByteOrder::Little
            } else if be == buf.len() && ok(be) {
                ByteOrder::Big
            } else if ok(le) {
                ByteOrder::Little
            } else if ok(be) {
                ByteOrder::Big
            } else {
                return Err(WireError::BadLength {
                    what: "LLC v2 length_v2",
                    claimed: le,
                    expected: if le < LLC_V2_MIN_LEN {
                        LLC_V2_MIN_LEN
                    } else {
                        LLC_V2_MAX_LEN
                    },
                });
            };
            let length = usize::from(order.read(raw));
            (
                LlcVersion::V2 {
                    length_order: order,
                },
                length,
                0,
            )
        };
        if buf.len() < LLC_V1_LEN {
            return Err(WireError::Truncated {
                what: "LLC message",
                needed: LLC_V1_LEN,
                available: buf.len(),
            });
        }
        Ok(LlcHeader {
            llc_type,
            version,
            length,
            v1_reject_reason,
            flags,
        })
    }

    /// True if the RESP flag is set.
    pub fn is_response(&self) -> bool {
        self.flags & FLAG_RESP != 0
    }
}

fn write_header(
    out: &mut Vec<u8>,
    ty: LlcType,
    version: LlcVersion,
    len: usize,
    v1_byte2: u8,
    flags: u8,
) {
    let mut w = Writer::new(out);
    match version {
        LlcVersion::V1 => {
            w.u8(ty.code())
                .u8(LLC_V1_LEN as u8)
                .u8(v1_byte2 & 0x0F)
                .u8(flags);
        }
        LlcVersion::V2 { length_order } => {
            let l = u16::try_from(len).unwrap_or(u16::MAX);
            w.u8(0x20 | ty.code())
                .bytes(&length_order.bytes(l))
                .u8(flags);
        }
    }
}

/// Per-message codec plumbing shared by all LLC structs.
trait LlcBody: Sized {
    const TYPE: LlcType;
    fn version(&self) -> LlcVersion;
    fn flags(&self) -> u8;
    /// Byte 2 low nibble on v1 (only ADD_LINK uses it).
    fn v1_byte2(&self) -> u8 {
        0
    }
    /// Total encoded length of a v2 message (>= 44; v1 is always 44).
    fn v2_len(&self) -> usize {
        LLC_V1_LEN
    }
    /// Decodes bytes 4.. of `body` (`body` is the whole message: 44 bytes for v1, the
    /// full buffer for v2), the reader positioned at 4.
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self>;
    /// Writes bytes 4..; the caller pads/truncates to the encoded length.
    fn write_body(&self, w: &mut Writer<'_>);

    fn total_len(&self) -> usize {
        match self.version() {
            LlcVersion::V1 => LLC_V1_LEN,
            LlcVersion::V2 { .. } => self.v2_len().clamp(LLC_V2_MIN_LEN, LLC_V2_MAX_LEN),
        }
    }

    fn decode_typed(buf: &[u8]) -> Result<Self> {
        let h = LlcHeader::decode(buf)?;
        if h.llc_type != Self::TYPE {
            return Err(WireError::InvalidField {
                field: "LLC type",
                value: u64::from(h.llc_type.code()),
            });
        }
        Self::decode_with_header(&h, buf)
    }

    fn decode_with_header(h: &LlcHeader, buf: &[u8]) -> Result<Self> {
        let body = match h.version {
            LlcVersion::V1 => buf.get(..LLC_V1_LEN).unwrap_or(buf),
            LlcVersion::V2 { .. } => buf,
        };
        let mut r = Reader::new(body, Self::TYPE.name());
        r.skip(4)?;
        Self::decode_body(h, &mut r)
    }

    fn encode_to(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let len = self.total_len();
        write_header(
            out,
            Self::TYPE,
            self.version(),
            len,
            self.v1_byte2(),
            self.flags(),
        );
        self.write_body(&mut Writer::new(out));
        out.resize(start.saturating_add(len), 0);
    }
}

macro_rules! llc_codec {
    ($t:ty, $name:literal) => {
        impl $t {
            #[doc = concat!("Decodes a ", $name, " message from a received SEND payload (its exact length).")]
            pub fn decode(buf: &[u8]) -> Result<Self> {
                <Self as LlcBody>::decode_typed(buf)
            }

            #[doc = concat!("Appends the encoded ", $name, " message to `out`.")]
            pub fn encode_into(&self, out: &mut Vec<u8>) {
                self.encode_to(out)
            }

            #[doc = concat!("The encoded ", $name, " message.")]
            pub fn encode(&self) -> Vec<u8> {
                let mut v = Vec::with_capacity(self.encoded_len());
                self.encode_to(&mut v);
                v
            }

            /// Bytes [`Self::encode`] produces: 44 on v1, the real length on v2.
            pub fn encoded_len(&self) -> usize {
                self.total_len()
            }

            /// True if the RESP flag (0x80) is set.
            pub fn is_response(&self) -> bool {
                self.flags & FLAG_RESP != 0
            }

            /// Sets or clears the RESP flag.
            pub fn set_response(&mut self, on: bool) {
                set_bit(&mut self.flags, FLAG_RESP, on);
            }
        }
    };
}

fn set_bit(flags: &mut u8, bit: u8, on: bool) {
    if on {
        *flags |= bit;
    } else {
        *flags &= !bit;
    }
}

fn read_gid(r: &mut Reader<'_>) -> Result<Gid> {
    Ok(Gid(r.array()?))
}

fn read_mac(r: &mut Reader<'_>) -> Result<Mac> {
    Ok(Mac(r.array()?))
}

// ------------------------------------------------------------------------------------
// CONFIRM_LINK (§1.4.1)
// ------------------------------------------------------------------------------------

/// CONFIRM_LINK (type 1), `protocol-llc-cdc.md` §1.4.1.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ConfirmLink {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: Linux sends 0x03 (request) / 0x83 (response).
    pub flags: u8,
    /// MAC of the sending RoCE port.
    pub sender_mac: Mac,
    /// GID of the sending port.
    pub sender_gid: Gid,
    /// Sender's QP number (24 bits; higher bits are not sent).
    pub sender_qpn: u32,
    /// Link id assigned by the server.
    pub link_num: u8,
    /// Sender's link user id (big-endian on the wire; informational).
    pub link_uid: u32,
    /// Maximum links (Linux: 2, or the negotiated value on v2.1).
    pub max_links: u8,
    /// Maximum connections (v2.1; 0 on v1).
    pub max_conns: u8,
}

impl ConfirmLink {
    /// A CONFIRM_LINK with the flags Linux uses: NO_RMBE_EYEC (0x03), plus RESP for a
    /// response.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        version: LlcVersion,
        response: bool,
        sender_mac: Mac,
        sender_gid: Gid,
        sender_qpn: u32,
        link_num: u8,
        link_uid: u32,
        max_links: u8,
        max_conns: u8,
    ) -> ConfirmLink {
        ConfirmLink {
            version,
            flags: FLAG_NO_RMBE_EYEC | if response { FLAG_RESP } else { 0 },
            sender_mac,
            sender_gid,
            sender_qpn: sender_qpn & U24_MAX,
            link_num,
            link_uid,
            max_links,
            max_conns,
        }
    }

    /// True if either NO_RMBE_EYEC bit is set (Linux rejects a first-contact
    /// CONFIRM_LINK without them, §1.3).
    pub fn no_rmbe_eyec(&self) -> bool {
        self.flags & FLAG_NO_RMBE_EYEC != 0
    }
}

impl LlcBody for ConfirmLink {
    const TYPE: LlcType = LlcType::ConfirmLink;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        Ok(ConfirmLink {
            version: h.version,
            flags: h.flags,
            sender_mac: read_mac(r)?,
            sender_gid: read_gid(r)?,
            sender_qpn: r.be24()?,
            link_num: r.u8()?,
            link_uid: r.be32()?,
            max_links: r.u8()?,
            max_conns: r.u8()?,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.bytes(&self.sender_mac.0)
            .bytes(&self.sender_gid.0)
            .be24(self.sender_qpn)
            .u8(self.link_num)
            .be32(self.link_uid)
            .u8(self.max_links)
            .u8(self.max_conns);
    }
}
llc_codec!(ConfirmLink, "CONFIRM_LINK");

// ------------------------------------------------------------------------------------
// ADD_LINK (§1.4.2) and ADD_LINK_CONT (§1.4.3)
// ------------------------------------------------------------------------------------

/// One rkey triple of ADD_LINK_CONT and of the ADD_LINK v2 extension
/// (`smc_llc_msg_add_link_cont_rt`), `protocol-llc-cdc.md` §1.4.3.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct AddLinkRkey {
    /// The RMB's rkey on the existing link (identifies the RMB).
    pub rmb_key: u32,
    /// The same RMB's rkey for the new link.
    pub rmb_key_new: u32,
    /// The RMB's address for the new link.
    pub rmb_vaddr_new: u64,
}

impl AddLinkRkey {
    fn read(r: &mut Reader<'_>) -> Result<AddLinkRkey> {
        Ok(AddLinkRkey {
            rmb_key: r.be32()?,
            rmb_key_new: r.be32()?,
            rmb_vaddr_new: r.be64()?,
        })
    }
    fn write(&self, w: &mut Writer<'_>) {
        w.be32(self.rmb_key)
            .be32(self.rmb_key_new)
            .be64(self.rmb_vaddr_new);
    }
}

/// The SMC-Rv2 ADD_LINK extension appended after byte 44
/// (`smc_llc_msg_add_link_v2_ext`), `protocol-llc-cdc.md` §1.4.2.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct AddLinkV2Ext {
    /// Bit 0x80 of byte 44: peers on the same subnet, no gateway.
    pub v2_direct: bool,
    /// GID of the sender's new-link port.
    pub client_target_gid: Gid,
    /// Byte order of `num_rkeys` (host order in Linux; little-endian from x86).
    pub num_rkeys_order: ByteOrder,
    /// The rkey triples, one per in-use RMB of the link group. At most
    /// [`ADD_LINK_V2_MAX_RKEYS`] are encoded.
    pub rkeys: Vec<AddLinkRkey>,
}

/// ADD_LINK (type 2), `protocol-llc-cdc.md` §1.4.2, with the v2 extension and the
/// reject shapes of `lab/captures/README.md` §8.3.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AddLink {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: RESP 0x80, REJ 0x40.
    pub flags: u8,
    /// v1 only: reject reason (low nibble of byte 2). Not encodable on v2 (byte 2 is
    /// part of `length_v2`); ignored when encoding a v2 message.
    pub reject_reason: u8,
    /// MAC of the new link's local port.
    pub sender_mac: Mac,
    /// GID of the new link's local port.
    pub sender_gid: Gid,
    /// QP number of the new link's QP (24 bits).
    pub sender_qpn: u32,
    /// Link id of the new link (chosen by the server).
    pub link_num: u8,
    /// Raw 4-bit IB MTU code (1 = 256 … 5 = 4096; 0 makes a Linux client reject).
    pub qp_mtu: u8,
    /// Sender's initial PSN for the new QP (24 bits).
    pub initial_psn: u32,
    /// The v2 extension, present iff a v2 message is longer than 44 bytes. Ignored
    /// when encoding a v1 message.
    pub ext: Option<AddLinkV2Ext>,
}

impl AddLink {
    /// True if the REJ flag is set.
    pub fn is_reject(&self) -> bool {
        self.flags & FLAG_ADD_LNK_REJ != 0
    }

    /// The reject Linux sends for `req` (`smc_llc_cli_add_link_reject`): on v1 the
    /// request echoed with RESP|REJ and reason [`REJ_RSN_NO_ALT_PATH`] in byte 2; on
    /// v2 only bytes 4..43 echoed, `length_v2` = 44, RESP|REJ, no reason and no
    /// extension (`lab/captures/README.md` §8.3).
    pub fn reject_for(req: &AddLink) -> AddLink {
        let mut m = req.clone();
        m.flags |= FLAG_RESP | FLAG_ADD_LNK_REJ;
        m.ext = None;
        m.reject_reason = if req.version.is_v2() {
            0
        } else {
            REJ_RSN_NO_ALT_PATH
        };
        m
    }
}

impl LlcBody for AddLink {
    const TYPE: LlcType = LlcType::AddLink;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn v1_byte2(&self) -> u8 {
        self.reject_reason
    }
    fn v2_len(&self) -> usize {
        match &self.ext {
            None => LLC_V1_LEN,
            Some(e) => ADD_LINK_EXT_RKEYS_OFF + 16 * e.rkeys.len().min(ADD_LINK_V2_MAX_RKEYS),
        }
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        let sender_mac = read_mac(r)?;
        r.skip(2)?;
        let sender_gid = read_gid(r)?;
        let sender_qpn = r.be24()?;
        let link_num = r.u8()?;
        let qp_mtu = r.u8()? & 0x0F;
        let initial_psn = r.be24()?;
        r.skip(8)?;
        let ext = if h.version.is_v2() && r.remaining() > 0 {
            Some(decode_add_link_ext(r)?)
        } else {
            None
        };
        Ok(AddLink {
            version: h.version,
            flags: h.flags,
            reject_reason: h.v1_reject_reason,
            sender_mac,
            sender_gid,
            sender_qpn,
            link_num,
            qp_mtu,
            initial_psn,
            ext,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.bytes(&self.sender_mac.0)
            .zeros(2)
            .bytes(&self.sender_gid.0)
            .be24(self.sender_qpn)
            .u8(self.link_num)
            .u8(self.qp_mtu & 0x0F)
            .be24(self.initial_psn)
            .zeros(8);
        if let (true, Some(e)) = (self.version.is_v2(), &self.ext) {
            let n = e.rkeys.len().min(ADD_LINK_V2_MAX_RKEYS);
            w.u8(if e.v2_direct { 0x80 } else { 0 })
                .zeros(1)
                .bytes(&e.client_target_gid.0)
                .zeros(8)
                .bytes(&e.num_rkeys_order.bytes(n as u16));
            for k in e.rkeys.iter().take(n) {
                k.write(w);
            }
        }
    }
}
llc_codec!(AddLink, "ADD_LINK");

/// Decodes the v2 extension; the reader is at byte 44 of the whole buffer.
fn decode_add_link_ext(r: &mut Reader<'_>) -> Result<AddLinkV2Ext> {
    let total = r.pos().saturating_add(r.remaining());
    let v2_direct = r.u8()? & 0x80 != 0;
    r.skip(1)?;
    let client_target_gid = read_gid(r)?;
    r.skip(8)?;
    let raw = r.array::<2>()?;
    // Byte order of num_rkeys: the reading that exactly fills the buffer wins, else
    // the one whose entries fit, little-endian first.
    let avail = total.saturating_sub(ADD_LINK_EXT_RKEYS_OFF);
    let le = usize::from(ByteOrder::Little.read(raw));
    let be = usize::from(ByteOrder::Big.read(raw));
    let order = if le * 16 == avail {
        ByteOrder::Little
    } else if be * 16 == avail {
        ByteOrder::Big
    } else if le * 16 <= avail {
        ByteOrder::Little
    } else if be * 16 <= avail {
        ByteOrder::Big
    } else {
        return Err(WireError::Truncated {
            what: "ADD_LINK v2 rkey list",
            needed: ADD_LINK_EXT_RKEYS_OFF + 16 * le.min(be),
            available: total,
        });
    };
    let n = usize::from(order.read(raw));
    let mut rkeys = Vec::with_capacity(n);
    for _ in 0..n {
        rkeys.push(AddLinkRkey::read(r)?);
    }
    Ok(AddLinkV2Ext {
        v2_direct,
        client_target_gid,
        num_rkeys_order: order,
        rkeys,
    })
}

/// ADD_LINK_CONT (type 3, v1 only in Linux), `protocol-llc-cdc.md` §1.4.3.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AddLinkCont {
    /// Header version (Linux: always v1).
    pub version: LlcVersion,
    /// Raw flag byte: Linux sets RESP when the sender is the client.
    pub flags: u8,
    /// Link id of the new link.
    pub link_num: u8,
    /// Rkeys the sender still has to transfer, including those in this message.
    pub num_rkeys: u8,
    /// The triples carried: `min(num_rkeys, 2)` on decode; at most 2 are encoded,
    /// unused slots are zero.
    pub rkeys: Vec<AddLinkRkey>,
}

impl LlcBody for AddLinkCont {
    const TYPE: LlcType = LlcType::AddLinkCont;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        let link_num = r.u8()?;
        let num_rkeys = r.u8()?;
        r.skip(2)?;
        let mut rkeys = Vec::new();
        for _ in 0..usize::from(num_rkeys).min(RKEYS_PER_CONT_MSG) {
            rkeys.push(AddLinkRkey::read(r)?);
        }
        Ok(AddLinkCont {
            version: h.version,
            flags: h.flags,
            link_num,
            num_rkeys,
            rkeys,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.u8(self.link_num).u8(self.num_rkeys).zeros(2);
        for k in self.rkeys.iter().take(RKEYS_PER_CONT_MSG) {
            k.write(w);
        }
    }
}
llc_codec!(AddLinkCont, "ADD_LINK_CONT");

// ------------------------------------------------------------------------------------
// DELETE_LINK (§1.4.4)
// ------------------------------------------------------------------------------------

/// DELETE_LINK (type 4), `protocol-llc-cdc.md` §1.4.4.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DeleteLink {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: RESP 0x80, ALL 0x40, ORDERLY 0x20.
    pub flags: u8,
    /// Link to delete (0 when ALL is set).
    pub link_num: u8,
    /// Reason code (`DEL_*`); 0 in a positive response.
    pub reason: u32,
}

impl DeleteLink {
    /// A request to delete one link (`smc_llc_send_delete_link`).
    pub fn request(version: LlcVersion, link_num: u8, orderly: bool, reason: u32) -> DeleteLink {
        let mut flags = if orderly { FLAG_DEL_LINK_ORDERLY } else { 0 };
        if link_num == 0 {
            flags |= FLAG_DEL_LINK_ALL;
        }
        DeleteLink {
            version,
            flags,
            link_num,
            reason,
        }
    }

    /// A DELETE_LINK(ALL) request terminating the link group
    /// (`smc_llc_send_link_delete_all`).
    pub fn delete_all(version: LlcVersion, orderly: bool, reason: u32) -> DeleteLink {
        DeleteLink::request(version, 0, orderly, reason)
    }

    /// The client's response Linux sends for a single-link request: the request
    /// echoed with RESP and `reason` (0 = deleted, [`DEL_NOLNK`] = unknown link).
    pub fn response_to(req: &DeleteLink, reason: u32) -> DeleteLink {
        DeleteLink {
            flags: req.flags | FLAG_RESP,
            reason,
            ..*req
        }
    }

    /// True if the ALL flag is set.
    pub fn is_all(&self) -> bool {
        self.flags & FLAG_DEL_LINK_ALL != 0
    }

    /// True if the ORDERLY flag is set.
    pub fn is_orderly(&self) -> bool {
        self.flags & FLAG_DEL_LINK_ORDERLY != 0
    }
}

impl LlcBody for DeleteLink {
    const TYPE: LlcType = LlcType::DeleteLink;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        Ok(DeleteLink {
            version: h.version,
            flags: h.flags,
            link_num: r.u8()?,
            reason: r.be32()?,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.u8(self.link_num).be32(self.reason);
    }
}
llc_codec!(DeleteLink, "DELETE_LINK");

// ------------------------------------------------------------------------------------
// REQ_ADD_LINK (§1.4.9)
// ------------------------------------------------------------------------------------

/// REQ_ADD_LINK (type 5, SMC-Rv2 only in Linux), `protocol-llc-cdc.md` §1.4.9.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ReqAddLink {
    /// Header version (Linux: v2 only; a v1 message has room for one GID).
    pub version: LlcVersion,
    /// Raw flag byte.
    pub flags: u8,
    /// The client's candidate GIDs (Linux sends 2). At most 255 are encoded (1 on v1).
    pub gids: Vec<Gid>,
}

impl ReqAddLink {
    /// The server's 44-byte response (`smc_llc_send_req_add_link_response`): RESP
    /// set, all data bytes zero, length 44.
    pub fn response_to(req: &ReqAddLink) -> ReqAddLink {
        ReqAddLink {
            version: req.version,
            flags: req.flags | FLAG_RESP,
            gids: Vec::new(),
        }
    }

    fn max_gids(&self) -> usize {
        match self.version {
            LlcVersion::V1 => (LLC_V1_LEN - REQ_ADD_LINK_GIDS_OFF) / 16,
            LlcVersion::V2 { .. } => usize::from(u8::MAX),
        }
    }
}

impl LlcBody for ReqAddLink {
    const TYPE: LlcType = LlcType::ReqAddLink;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn v2_len(&self) -> usize {
        REQ_ADD_LINK_GIDS_OFF + 16 * self.gids.len().min(self.max_gids())
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        r.skip(20)?;
        let n = r.u8()?;
        r.skip(3)?;
        let mut gids = Vec::new();
        for _ in 0..n {
            gids.push(read_gid(r)?);
        }
        Ok(ReqAddLink {
            version: h.version,
            flags: h.flags,
            gids,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        let n = self.gids.len().min(self.max_gids());
        w.zeros(20).u8(n as u8).zeros(3);
        for g in self.gids.iter().take(n) {
            w.bytes(&g.0);
        }
    }
}
llc_codec!(ReqAddLink, "REQ_ADD_LINK");

// ------------------------------------------------------------------------------------
// CONFIRM_RKEY (§1.4.5) and CONFIRM_RKEY_CONT (§1.4.6)
// ------------------------------------------------------------------------------------

/// A 13-byte rtoken for another link (`smc_rmb_rtoken` with `link_id`),
/// `protocol-llc-cdc.md` §1.4.5.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct LinkRtoken {
    /// Link id the rkey belongs to.
    pub link_id: u8,
    /// The RMB's rkey on that link.
    pub rkey: u32,
    /// The RMB's address on that link.
    pub vaddr: u64,
}

impl LinkRtoken {
    fn read(r: &mut Reader<'_>) -> Result<LinkRtoken> {
        Ok(LinkRtoken {
            link_id: r.u8()?,
            rkey: r.be32()?,
            vaddr: r.be64()?,
        })
    }
    fn write(&self, w: &mut Writer<'_>) {
        w.u8(self.link_id).be32(self.rkey).be64(self.vaddr);
    }
}

/// CONFIRM_RKEY (type 6), `protocol-llc-cdc.md` §1.4.5. All three rtoken slots are
/// kept as received so that a response is an exact echo, as Linux sends it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ConfirmRkey {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: RESP 0x80, NEG 0x20, RETRY 0x10.
    pub flags: u8,
    /// Byte 4: number of *additional* rtokens in `others` (Linux: 0..=2; > 3 gets a
    /// negative response).
    pub num_rkeys: u8,
    /// Entry 0: the RMB's rkey for the link this message is sent on.
    pub rkey: u32,
    /// Entry 0: the RMB's address for that link.
    pub vaddr: u64,
    /// Entries 1 and 2 (zero when unused).
    pub others: [LinkRtoken; 2],
}

impl ConfirmRkey {
    /// A request for a new RMB: entry 0 for the sending link plus up to two rtokens
    /// for other links (extra ones are ignored).
    pub fn request(
        version: LlcVersion,
        rkey: u32,
        vaddr: u64,
        others: &[LinkRtoken],
    ) -> ConfirmRkey {
        let mut o = [LinkRtoken::default(); 2];
        for (d, s) in o.iter_mut().zip(others) {
            *d = *s;
        }
        ConfirmRkey {
            version,
            flags: 0,
            num_rkeys: others.len().min(2) as u8,
            rkey,
            vaddr,
            others: o,
        }
    }

    /// Linux's response (`smc_llc_rmt_conf_rkey`): the request echoed with RESP, plus
    /// NEG|RETRY if it could not be processed (`ok == false`).
    pub fn response_to(req: &ConfirmRkey, ok: bool) -> ConfirmRkey {
        let mut m = *req;
        m.flags |= FLAG_RESP;
        if !ok {
            m.flags |= FLAG_RKEY_NEG | FLAG_RKEY_RETRY;
        }
        m
    }

    /// The additional rtokens in use: `others[..min(num_rkeys, 2)]`.
    pub fn additional(&self) -> &[LinkRtoken] {
        let n = usize::from(self.num_rkeys).min(2);
        self.others.get(..n).unwrap_or(&[])
    }

    /// True if the NEG flag is set.
    pub fn is_negative(&self) -> bool {
        self.flags & FLAG_RKEY_NEG != 0
    }

    /// True if the RETRY flag is set.
    pub fn is_retry(&self) -> bool {
        self.flags & FLAG_RKEY_RETRY != 0
    }
}

impl LlcBody for ConfirmRkey {
    const TYPE: LlcType = LlcType::ConfirmRkey;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        Ok(ConfirmRkey {
            version: h.version,
            flags: h.flags,
            num_rkeys: r.u8()?,
            rkey: r.be32()?,
            vaddr: r.be64()?,
            others: [LinkRtoken::read(r)?, LinkRtoken::read(r)?],
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.u8(self.num_rkeys).be32(self.rkey).be64(self.vaddr);
        for t in &self.others {
            t.write(w);
        }
    }
}
llc_codec!(ConfirmRkey, "CONFIRM_RKEY");

/// CONFIRM_RKEY_CONT (type 8), `protocol-llc-cdc.md` §1.4.6, in the layout of the
/// RFC-based parser `hwipl/smc-go` (**UNCERTAIN**: Linux never sends it and ignores
/// it on receive, so no kernel source pins it down).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ConfirmRkeyCont {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: RESP 0x80, NEG 0x20.
    pub flags: u8,
    /// Byte 4: rkeys still to come, including this message.
    pub num_rkeys: u8,
    /// The three 13-byte rtokens at 5, 18 and 31 (may be all zero).
    pub rtokens: [LinkRtoken; 3],
}

impl ConfirmRkeyCont {
    /// True if the NEG flag is set.
    pub fn is_negative(&self) -> bool {
        self.flags & FLAG_RKEY_NEG != 0
    }
}

impl LlcBody for ConfirmRkeyCont {
    const TYPE: LlcType = LlcType::ConfirmRkeyCont;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        Ok(ConfirmRkeyCont {
            version: h.version,
            flags: h.flags,
            num_rkeys: r.u8()?,
            rtokens: [
                LinkRtoken::read(r)?,
                LinkRtoken::read(r)?,
                LinkRtoken::read(r)?,
            ],
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.u8(self.num_rkeys);
        for t in &self.rtokens {
            t.write(w);
        }
    }
}
llc_codec!(ConfirmRkeyCont, "CONFIRM_RKEY_CONT");

// ------------------------------------------------------------------------------------
// DELETE_RKEY (§1.4.7)
// ------------------------------------------------------------------------------------

/// DELETE_RKEY (type 9), `protocol-llc-cdc.md` §1.4.7.
///
/// v1: `num_rkeys` (byte 4) = `rkeys.len()`, 1..=8 (more is [`WireError::InvalidField`]
/// on decode), eight rkey slots at 8..40, byte 5 = error **mask** (bit `7 - i` set if
/// `rkeys[i]` was unknown). v2 (`smc_llc_msg_delete_rkey_v2`): the rkey list starts at
/// byte 8 and may continue past byte 44 (up to 255), byte 5 = **count** of invalid
/// rkeys; Linux's v2 response keeps `num_rkeys` but zeroes the list.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DeleteRkey {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: RESP 0x80, NEG 0x20.
    pub flags: u8,
    /// Byte 5: v1 error mask / v2 count of invalid rkeys (responses only).
    pub err_mask: u8,
    /// The rkeys (`num_rkeys` = their number). At most 8 (v1) / 255 (v2) are encoded.
    pub rkeys: Vec<u32>,
}

impl DeleteRkey {
    /// A request to delete `rkeys` (Linux sends exactly one).
    pub fn request(version: LlcVersion, rkeys: Vec<u32>) -> DeleteRkey {
        DeleteRkey {
            version,
            flags: 0,
            err_mask: 0,
            rkeys,
        }
    }

    /// Linux's response (`smc_llc_rmt_delete_rkey`): `unknown(rkey)` says whether an
    /// rkey was not known. v1: echo with the error mask; v2: echo with the invalid
    /// count and the rkey list zeroed (count kept). NEG is set if any was unknown.
    pub fn response_to(req: &DeleteRkey, mut unknown: impl FnMut(u32) -> bool) -> DeleteRkey {
        let mut m = req.clone();
        m.flags |= FLAG_RESP;
        let n = m.rkeys.len().min(m.max_rkeys());
        let mut bad = 0u8;
        for (i, k) in m.rkeys.iter().take(n).enumerate() {
            if unknown(*k) {
                bad = match m.version {
                    LlcVersion::V1 => bad | (0x80u8 >> i),
                    LlcVersion::V2 { .. } => bad.saturating_add(1),
                };
            }
        }
        if m.version.is_v2() {
            for k in m.rkeys.iter_mut() {
                *k = 0;
            }
        }
        if bad != 0 {
            m.flags |= FLAG_RKEY_NEG;
            m.err_mask = bad;
        }
        m
    }

    /// True if the NEG flag is set.
    pub fn is_negative(&self) -> bool {
        self.flags & FLAG_RKEY_NEG != 0
    }

    fn max_rkeys(&self) -> usize {
        match self.version {
            LlcVersion::V1 => DEL_RKEY_MAX,
            LlcVersion::V2 { .. } => RKEYS_PER_MSG_V2,
        }
    }
}

impl LlcBody for DeleteRkey {
    const TYPE: LlcType = LlcType::DeleteRkey;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn v2_len(&self) -> usize {
        DELETE_RKEY_KEYS_OFF + 4 * self.rkeys.len().min(self.max_rkeys())
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        let n = r.u8()?;
        if !h.version.is_v2() && usize::from(n) > DEL_RKEY_MAX {
            return Err(WireError::InvalidField {
                field: "DELETE_RKEY num_rkeys",
                value: u64::from(n),
            });
        }
        let err_mask = r.u8()?;
        r.skip(2)?;
        let mut rkeys = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            rkeys.push(r.be32()?);
        }
        Ok(DeleteRkey {
            version: h.version,
            flags: h.flags,
            err_mask,
            rkeys,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        let n = self.rkeys.len().min(self.max_rkeys());
        w.u8(n as u8).u8(self.err_mask).zeros(2);
        for k in self.rkeys.iter().take(n) {
            w.be32(*k);
        }
    }
}
llc_codec!(DeleteRkey, "DELETE_RKEY");

// ------------------------------------------------------------------------------------
// TEST_LINK (§1.4.8)
// ------------------------------------------------------------------------------------

/// TEST_LINK (type 7), `protocol-llc-cdc.md` §1.4.8.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TestLink {
    /// v1 or v2 header.
    pub version: LlcVersion,
    /// Raw flag byte: 0 (request) / RESP.
    pub flags: u8,
    /// Opaque data echoed by the responder (Linux sends zeros).
    pub user_data: [u8; 16],
}

impl TestLink {
    /// A request as Linux sends it: flags 0, user data zero.
    pub fn request(version: LlcVersion) -> TestLink {
        TestLink {
            version,
            flags: 0,
            user_data: [0; 16],
        }
    }

    /// The response Linux expects: the request echoed with RESP set.
    pub fn response_to(req: &TestLink) -> TestLink {
        TestLink {
            flags: req.flags | FLAG_RESP,
            ..*req
        }
    }
}

impl LlcBody for TestLink {
    const TYPE: LlcType = LlcType::TestLink;
    fn version(&self) -> LlcVersion {
        self.version
    }
    fn flags(&self) -> u8 {
        self.flags
    }
    fn decode_body(h: &LlcHeader, r: &mut Reader<'_>) -> Result<Self> {
        Ok(TestLink {
            version: h.version,
            flags: h.flags,
            user_data: r.array()?,
        })
    }
    fn write_body(&self, w: &mut Writer<'_>) {
        w.bytes(&self.user_data);
    }
}
llc_codec!(TestLink, "TEST_LINK");

// ------------------------------------------------------------------------------------
// Any LLC message
// ------------------------------------------------------------------------------------

/// Any LLC message, `protocol-llc-cdc.md` §1.4.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum LlcMessage {
    /// CONFIRM_LINK (§1.4.1).
    ConfirmLink(ConfirmLink),
    /// ADD_LINK (§1.4.2).
    AddLink(AddLink),
    /// ADD_LINK_CONT (§1.4.3).
    AddLinkCont(AddLinkCont),
    /// DELETE_LINK (§1.4.4).
    DeleteLink(DeleteLink),
    /// REQ_ADD_LINK (§1.4.9).
    ReqAddLink(ReqAddLink),
    /// CONFIRM_RKEY (§1.4.5).
    ConfirmRkey(ConfirmRkey),
    /// TEST_LINK (§1.4.8).
    TestLink(TestLink),
    /// CONFIRM_RKEY_CONT (§1.4.6).
    ConfirmRkeyCont(ConfirmRkeyCont),
    /// DELETE_RKEY (§1.4.7).
    DeleteRkey(DeleteRkey),
}

macro_rules! each {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            LlcMessage::ConfirmLink($m) => $e,
            LlcMessage::AddLink($m) => $e,
            LlcMessage::AddLinkCont($m) => $e,
            LlcMessage::DeleteLink($m) => $e,
            LlcMessage::ReqAddLink($m) => $e,
            LlcMessage::ConfirmRkey($m) => $e,
            LlcMessage::TestLink($m) => $e,
            LlcMessage::ConfirmRkeyCont($m) => $e,
            LlcMessage::DeleteRkey($m) => $e,
        }
    };
}

impl LlcMessage {
    /// Decodes a received SEND payload (its exact length) whose first byte is an LLC
    /// type byte. See [`LlcHeader::decode`] for the header checks.
    pub fn decode(buf: &[u8]) -> Result<LlcMessage> {
        let h = LlcHeader::decode(buf)?;
        Ok(match h.llc_type {
            LlcType::ConfirmLink => {
                LlcMessage::ConfirmLink(ConfirmLink::decode_with_header(&h, buf)?)
            }
            LlcType::AddLink => LlcMessage::AddLink(AddLink::decode_with_header(&h, buf)?),
            LlcType::AddLinkCont => {
                LlcMessage::AddLinkCont(AddLinkCont::decode_with_header(&h, buf)?)
            }
            LlcType::DeleteLink => LlcMessage::DeleteLink(DeleteLink::decode_with_header(&h, buf)?),
            LlcType::ReqAddLink => LlcMessage::ReqAddLink(ReqAddLink::decode_with_header(&h, buf)?),
            LlcType::ConfirmRkey => {
                LlcMessage::ConfirmRkey(ConfirmRkey::decode_with_header(&h, buf)?)
            }
            LlcType::TestLink => LlcMessage::TestLink(TestLink::decode_with_header(&h, buf)?),
            LlcType::ConfirmRkeyCont => {
                LlcMessage::ConfirmRkeyCont(ConfirmRkeyCont::decode_with_header(&h, buf)?)
            }
            LlcType::DeleteRkey => LlcMessage::DeleteRkey(DeleteRkey::decode_with_header(&h, buf)?),
        })
    }

    /// Appends the encoded message to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        each!(self, m => m.encode_to(out))
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }

    /// Bytes [`Self::encode`] produces.
    pub fn encoded_len(&self) -> usize {
        each!(self, m => m.total_len())
    }

    /// The message type.
    pub fn llc_type(&self) -> LlcType {
        match self {
            LlcMessage::ConfirmLink(_) => LlcType::ConfirmLink,
            LlcMessage::AddLink(_) => LlcType::AddLink,
            LlcMessage::AddLinkCont(_) => LlcType::AddLinkCont,
            LlcMessage::DeleteLink(_) => LlcType::DeleteLink,
            LlcMessage::ReqAddLink(_) => LlcType::ReqAddLink,
            LlcMessage::ConfirmRkey(_) => LlcType::ConfirmRkey,
            LlcMessage::TestLink(_) => LlcType::TestLink,
            LlcMessage::ConfirmRkeyCont(_) => LlcType::ConfirmRkeyCont,
            LlcMessage::DeleteRkey(_) => LlcType::DeleteRkey,
        }
    }

    /// The header version.
    pub fn version(&self) -> LlcVersion {
        each!(self, m => m.version)
    }

    /// The raw flag byte (byte 3).
    pub fn flags(&self) -> u8 {
        each!(self, m => m.flags)
    }

    /// True if the RESP flag is set.
    pub fn is_response(&self) -> bool {
        self.flags() & FLAG_RESP != 0
    }

    /// Sets every recorded byte order that the encoding cannot show to little-endian,
    /// which is what [`Self::decode`] reports for such bytes: a `length_v2` or
    /// `num_rkeys` that reads the same both ways (`0x0101 · k`, e.g. a 1028-byte
    /// DELETE_RKEY or an extension with 0 rkeys). Afterwards
    /// `decode(encode(m)) == m`.
    pub fn normalize_byte_orders(&mut self) {
        let len = self.encoded_len();
        let normalize_version = |v: &mut LlcVersion| {
            if let LlcVersion::V2 { length_order } = v {
                if order_invisible(u16::try_from(len).unwrap_or(0)) {
                    *length_order = ByteOrder::Little;
                }
            }
        };
        each!(self, m => normalize_version(&mut m.version));
        if let LlcMessage::AddLink(AddLink {
            version: LlcVersion::V2 { .. },
            ext: Some(e),
            ..
        }) = self
        {
            let n = e.rkeys.len().min(ADD_LINK_V2_MAX_RKEYS);
            if order_invisible(n as u16) {
                e.num_rkeys_order = ByteOrder::Little;
            }
        }
    }
}

impl From<ConfirmLink> for LlcMessage {
    fn from(m: ConfirmLink) -> Self {
        LlcMessage::ConfirmLink(m)
    }
}
impl From<AddLink> for LlcMessage {
    fn from(m: AddLink) -> Self {
        LlcMessage::AddLink(m)
    }
}
impl From<AddLinkCont> for LlcMessage {
    fn from(m: AddLinkCont) -> Self {
        LlcMessage::AddLinkCont(m)
    }
}
impl From<DeleteLink> for LlcMessage {
    fn from(m: DeleteLink) -> Self {
        LlcMessage::DeleteLink(m)
    }
}
impl From<ReqAddLink> for LlcMessage {
    fn from(m: ReqAddLink) -> Self {
        LlcMessage::ReqAddLink(m)
    }
}
impl From<ConfirmRkey> for LlcMessage {
    fn from(m: ConfirmRkey) -> Self {
        LlcMessage::ConfirmRkey(m)
    }
}
impl From<TestLink> for LlcMessage {
    fn from(m: TestLink) -> Self {
        LlcMessage::TestLink(m)
    }
}
impl From<ConfirmRkeyCont> for LlcMessage {
    fn from(m: ConfirmRkeyCont) -> Self {
        LlcMessage::ConfirmRkeyCont(m)
    }
}
impl From<DeleteRkey> for LlcMessage {
    fn from(m: DeleteRkey) -> Self {
        LlcMessage::DeleteRkey(m)
    }
}

/// Fuzz entry point: decodes arbitrary bytes; if that succeeds, re-encoding and
/// decoding again must give the same message (after [`LlcMessage::normalize_byte_orders`]),
/// and re-encoding that must give the same bytes.
#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    if let Ok(m) = LlcMessage::decode(data) {
        let bytes = m.encode();
        assert_eq!(bytes.len(), m.encoded_len());
        let mut want = m.clone();
        want.normalize_byte_orders();
        let again = LlcMessage::decode(&bytes);
        assert_eq!(again.as_ref(), Ok(&want));
        assert_eq!(want.encode(), bytes);
    }
}
