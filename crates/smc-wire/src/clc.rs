//! CLC messages: the SMC handshake on the TCP connection (`protocol-clc.md` §3).
//!
//! Four messages, all framed by the same 8-byte header ([`ClcHeader`], §3.1) and
//! (except for a received Decline) a 4-byte trailing eyecatcher:
//!
//! * [`Proposal`] (type 1, client → server, §3.2) — both the RFC 7609 v1 layout and
//!   the layout every SMC-v2-capable Linux sends (header version 2, 40-byte SMC-D
//!   area, optional prefix block, v2 extension, SMC-D v2 extension);
//! * [`AcceptConfirm`] (type 2 Accept, server → client; type 3 Confirm, client →
//!   server, §3.3) — SMC-R only; SMC-D Accept/Confirm decode to
//!   [`WireError::Unsupported`];
//! * [`Decline`] (type 4, either direction, §3.5) with its [`DeclineCode`] (§3.9).
//!
//! [`ClcMessage`] decodes any one of them from a buffer holding exactly one message.
//!
//! ## Reading from a TCP stream
//!
//! Peek the first [`CLC_HEADER_LEN`] bytes, call [`ClcHeader::peek`], then read
//! exactly [`ClcHeader::length`] bytes in total (the 8 peeked bytes included) and
//! hand them to [`ClcMessage::decode`]. Never read more: whatever follows a Decline
//! in the stream is TCP application data (§4.1).
//!
//! ```
//! use smc_wire::clc::{ClcHeader, ClcMessage, DeclineCode};
//! // protocol-clc.md §6 (a1): a v1 Decline, reason DIFFPREFIX
//! let stream = [
//!     0xe2, 0xd4, 0xc3, 0xd9, 0x04, 0x00, 0x1c, 0x10, 0x56, 0x78, 0x02, 0x00, 0x00, 0x00,
//!     0x00, 0x02, 0x03, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe2, 0xd4, 0xc3, 0xd9,
//!     b'T', b'C', b'P', // application data follows a Decline
//! ];
//! let hdr = ClcHeader::peek(&stream[..8]).unwrap();
//! let msg = &stream[..usize::from(hdr.length)];
//! match ClcMessage::decode(msg).unwrap() {
//!     ClcMessage::Decline(d) => assert_eq!(d.diagnosis, DeclineCode::DiffPrefix),
//!     other => panic!("unexpected {other:?}"),
//! }
//! ```
//!
//! ## Canonical form
//!
//! Offsets, counts and lengths are not stored in the representations: the encoder
//! derives them from the layout Linux produces, and the decoder rejects a message
//! whose offsets or counts disagree with that layout (typed error, never a panic).
//! Reserved bytes are written as zero and ignored on read; both eyecatchers
//! (`SMCR`, `SMCD`) are accepted on read, the encoder always writes `SMCR`. So for
//! every message Linux sends, `encode(decode(bytes)) == bytes`.

use core::fmt;
use core::time::Duration;
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::buf::{Reader, Writer};
use crate::types::{Eid, Gid, IbMtu, Mac, RmbeSize, SystemId, U24_MAX};
use crate::{Result, WireError};

// ------------------------------------------------------------------------------------
// Constants (§3.0)
// ------------------------------------------------------------------------------------

/// EBCDIC "SMCR": header and trailer eyecatcher of every CLC message Linux sends for
/// SMC-R (and of every Proposal and Decline) (§3.0).
pub const EYECATCHER_SMCR: [u8; 4] = [0xe2, 0xd4, 0xc3, 0xd9];
/// EBCDIC "SMCD": eyecatcher of SMC-D Accept/Confirm messages (§3.0).
pub const EYECATCHER_SMCD: [u8; 4] = [0xe2, 0xd4, 0xc3, 0xc4];

/// Message type byte of a Proposal (`SMC_CLC_PROPOSAL`).
pub const CLC_PROPOSAL: u8 = 0x01;
/// Message type byte of an Accept (`SMC_CLC_ACCEPT`).
pub const CLC_ACCEPT: u8 = 0x02;
/// Message type byte of a Confirm (`SMC_CLC_CONFIRM`).
pub const CLC_CONFIRM: u8 = 0x03;
/// Message type byte of a Decline (`SMC_CLC_DECLINE`).
pub const CLC_DECLINE: u8 = 0x04;

/// SMC version 1 (value of the 4-bit header version field).
pub const SMC_V1: u8 = 1;
/// SMC version 2.
pub const SMC_V2: u8 = 2;
/// SMC v2 release 0 ("v2.0").
pub const SMC_RELEASE_0: u8 = 0;
/// SMC v2 release 1 ("v2.1", what current Linux sends).
pub const SMC_RELEASE_1: u8 = 1;

/// OS type z/OS (first-contact extension, Decline byte 20).
pub const OS_ZOS: u8 = 1;
/// OS type Linux.
pub const OS_LINUX: u8 = 2;
/// OS type AIX.
pub const OS_AIX: u8 = 3;

/// Bit 0 of the v2.1 feature mask: `SMC_SPF_EMULATED_ISM_DEV` (Linux sends 0x0001).
pub const FEATURE_EMULATED_ISM_DEV: u16 = 0x0001;

/// Receive timeout for each expected CLC message (`CLC_WAIT_TIME`, 6 s, §4.6).
pub const CLC_WAIT_TIME: Duration = Duration::from_secs(6);
/// Short wait used when polling for a late Decline (`CLC_WAIT_TIME_SHORT`, 1 s).
pub const CLC_WAIT_TIME_SHORT: Duration = Duration::from_secs(1);

/// Length of the common CLC header (§3.1).
pub const CLC_HEADER_LEN: usize = 8;
/// Length of the trailing eyecatcher.
pub const CLC_TRAILER_LEN: usize = 4;
/// Smallest length a CLC header may announce: header plus trailer.
pub const CLC_MIN_LEN: usize = CLC_HEADER_LEN + CLC_TRAILER_LEN;

/// Fixed part of every Proposal: header, peer id, GID, MAC, `iparea_offset` (§3.2.2).
pub const PROPOSAL_BASE_LEN: usize = 40;
/// The SMC-D info area of a Proposal (always present in version ≥ 2).
pub const PROPOSAL_SMCD_AREA_LEN: usize = 40;
/// The IPv4 prefix block (subnet, prefix length, reserved, IPv6 count).
pub const PROPOSAL_PREFIX_LEN: usize = 8;
/// One IPv6 prefix entry (16-byte prefix, 1-byte length).
pub const PROPOSAL_IPV6_PREFIX_LEN: usize = 17;
/// Fixed part of the v2 extension.
pub const PROPOSAL_V2_EXT_LEN: usize = 40;
/// Fixed part of the SMC-D v2 extension (system EID + reserved).
pub const PROPOSAL_SMCD_V2_EXT_LEN: usize = 48;
/// One SMC-D GID/CHID entry.
pub const PROPOSAL_GID_CHID_LEN: usize = 10;
/// Most IPv6 prefixes a Linux sender includes and a receiver examines
/// (`SMC_CLC_MAX_V6_PREFIX`); this codec rejects more.
pub const MAX_IPV6_PREFIXES: usize = 8;
/// Most user EIDs in a Proposal (`SMC_CLC_MAX_UEID`); this codec rejects more.
pub const MAX_EIDS: usize = 8;
/// Most SMC-D GID/CHID entries (`SMCD_CLC_MAX_V2_GID_ENTRIES`); this codec rejects more.
pub const MAX_ISM_GIDS: usize = 8;
/// Largest Proposal Linux receives whole (`sizeof(struct smc_clc_msg_proposal_area)`,
/// 652 bytes): every piece at its maximum count. Longer proposals are drained by
/// Linux without a trailer check; this codec rejects them through the count limits.
pub const PROPOSAL_MAX_LEN: usize = PROPOSAL_BASE_LEN
    + PROPOSAL_SMCD_AREA_LEN
    + PROPOSAL_PREFIX_LEN
    + MAX_IPV6_PREFIXES * PROPOSAL_IPV6_PREFIX_LEN
    + PROPOSAL_V2_EXT_LEN
    + MAX_EIDS * 32
    + PROPOSAL_SMCD_V2_EXT_LEN
    + MAX_ISM_GIDS * PROPOSAL_GID_CHID_LEN
    + CLC_TRAILER_LEN;

/// Total length of an SMC-R v1 Accept/Confirm (`SMCR_CLC_ACCEPT_CONFIRM_LEN`, §3.3).
pub const ACCEPT_CONFIRM_V1_LEN: usize = 68;
/// Length of an SMC-R v2 Accept/Confirm without first-contact extension
/// (`SMCR_CLC_ACCEPT_CONFIRM_LEN_V2`); also the minimum Linux accepts for version ≥ 2.
pub const ACCEPT_CONFIRM_V2_LEN: usize = 108;
/// Length of the first-contact extension as Linux sends it for SMC-R (52 bytes).
pub const FCE_LEN: usize = 52;
/// Length of the short (SMC-D release 0) first-contact extension.
pub const FCE_SHORT_LEN: usize = 36;
/// Length of the fixed part of the GID-list extension of a first-contact Confirm.
pub const GID_LIST_HDR_LEN: usize = 4;
/// Length of a v1 Decline.
pub const DECLINE_V1_LEN: usize = 28;
/// Length of a v2 Decline.
pub const DECLINE_V2_LEN: usize = 44;
/// Number of additional diagnosis words in a v2 Decline (`SMC_DECL_DIAG_COUNT_V2`).
pub const DECL_DIAG_COUNT_V2: usize = 4;

/// Bit of the 2-bit `typev2` field that carries "first contact" (Accept/Confirm) and
/// "out of sync" (Decline) (`SMC_FIRST_CONTACT_MASK`).
const FIRST_CONTACT_MASK: u8 = 0b10;

// ------------------------------------------------------------------------------------
// Small enums
// ------------------------------------------------------------------------------------

/// The CLC message type (header byte 4, §3.0).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ClcType {
    /// Proposal (client → server).
    Proposal = 1,
    /// Accept (server → client).
    Accept = 2,
    /// Confirm (client → server).
    Confirm = 3,
    /// Decline (either direction).
    Decline = 4,
}

impl ClcType {
    /// The type for a header type byte; `None` for anything but 1..=4.
    pub fn from_u8(b: u8) -> Option<ClcType> {
        match b {
            CLC_PROPOSAL => Some(ClcType::Proposal),
            CLC_ACCEPT => Some(ClcType::Accept),
            CLC_CONFIRM => Some(ClcType::Confirm),
            CLC_DECLINE => Some(ClcType::Decline),
            _ => None,
        }
    }

    /// The header type byte.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// Upper-case name as the capture decoder prints it (`PROPOSAL`, `ACCEPT`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ClcType::Proposal => "PROPOSAL",
            ClcType::Accept => "ACCEPT",
            ClcType::Confirm => "CONFIRM",
            ClcType::Decline => "DECLINE",
        }
    }
}

/// An SMC path type, the 2-bit `typev1`/`typev2` code points of the header (§3.0,
/// `SMC_TYPE_R/D/N/B`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum SmcPath {
    /// SMC-R only (0).
    R = 0,
    /// SMC-D only (1).
    D = 1,
    /// Neither (2).
    N = 2,
    /// Both SMC-R and SMC-D (3).
    B = 3,
}

impl SmcPath {
    /// All four values.
    pub const ALL: [SmcPath; 4] = [SmcPath::R, SmcPath::D, SmcPath::N, SmcPath::B];

    /// The path for the low two bits of `bits` (every 2-bit value is defined).
    pub fn from_bits(bits: u8) -> SmcPath {
        match bits & 0b11 {
            0 => SmcPath::R,
            1 => SmcPath::D,
            2 => SmcPath::N,
            _ => SmcPath::B,
        }
    }

    /// The 2-bit wire value.
    pub fn bits(self) -> u8 {
        self as u8
    }

    /// True for R and B (`smcr_indicated`).
    pub fn offers_r(self) -> bool {
        matches!(self, SmcPath::R | SmcPath::B)
    }

    /// True for D and B (`smcd_indicated`).
    pub fn offers_d(self) -> bool {
        matches!(self, SmcPath::D | SmcPath::B)
    }
}

// ------------------------------------------------------------------------------------
// Header
// ------------------------------------------------------------------------------------

/// The 8-byte header common to every CLC message (`protocol-clc.md` §3.1).
///
/// Byte 7 is `version << 4 | typev2 << 2 | typev1`. For Accept/Confirm the high bit of
/// `typev2` is the first-contact flag, for a Decline the out-of-sync flag.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ClcHeader {
    /// Message type (byte 4).
    pub msg_type: ClcType,
    /// Total message length including header and trailer (bytes 5..7, big-endian).
    pub length: u16,
    /// SMC version, bits 7..4 of byte 7 (≥ 1).
    pub version: u8,
    /// Bits 3..2 of byte 7.
    pub typev2: u8,
    /// Bits 1..0 of byte 7.
    pub typev1: u8,
    /// The leading eyecatcher is `SMCD` (else `SMCR`).
    pub eyecatcher_smcd: bool,
}

impl ClcHeader {
    /// Validates the first [`CLC_HEADER_LEN`] bytes of `buf` (more may follow and are
    /// not looked at): eyecatcher `SMCR`/`SMCD`, a known message type, version ≥ 1 and
    /// a length of at least header + trailer.
    ///
    /// A stream reader peeks 8 bytes, calls this, and must then read exactly
    /// [`length`](Self::length) bytes in total (these 8 included) — no more, since
    /// what follows may be the next CLC message or TCP application data — and pass
    /// them to [`ClcMessage::decode`].
    pub fn peek(buf: &[u8]) -> Result<ClcHeader> {
        let mut r = Reader::new(buf, "CLC header");
        let eye = r.array::<4>()?;
        let ty = r.u8()?;
        let length = r.be16()?;
        let b7 = r.u8()?;
        let eyecatcher_smcd = if eye == EYECATCHER_SMCR {
            false
        } else if eye == EYECATCHER_SMCD {
            true
        } else {
            return Err(WireError::BadEyecatcher(eye));
        };
        let msg_type = ClcType::from_u8(ty).ok_or(WireError::UnknownType {
            family: "CLC",
            value: ty,
        })?;
        let version = b7 >> 4;
        if version < SMC_V1 {
            return Err(WireError::BadVersion(version));
        }
        if usize::from(length) < CLC_MIN_LEN {
            return Err(WireError::BadLength {
                what: "CLC header length",
                claimed: usize::from(length),
                expected: CLC_MIN_LEN,
            });
        }
        Ok(ClcHeader {
            msg_type,
            length,
            version,
            typev2: (b7 >> 2) & 0b11,
            typev1: b7 & 0b11,
            eyecatcher_smcd,
        })
    }

    /// Byte 7 as it goes on the wire.
    pub fn byte7(&self) -> u8 {
        (self.version << 4) | ((self.typev2 & 0b11) << 2) | (self.typev1 & 0b11)
    }

    /// `typev1` as a path.
    pub fn path_v1(&self) -> SmcPath {
        SmcPath::from_bits(self.typev1)
    }

    /// `typev2` as a path (meaningful for a Proposal of version ≥ 2).
    pub fn path_v2(&self) -> SmcPath {
        SmcPath::from_bits(self.typev2)
    }

    fn write(&self, w: &mut Writer<'_>) {
        w.bytes(if self.eyecatcher_smcd {
            &EYECATCHER_SMCD
        } else {
            &EYECATCHER_SMCR
        })
        .u8(self.msg_type.code())
        .be16(self.length)
        .u8(self.byte7());
    }
}

/// Checks the header against the buffer and the expected type, the trailer if asked,
/// and returns the header plus a reader over the body (trailer excluded) positioned
/// after the header.
fn open<'a>(
    buf: &'a [u8],
    expected: &[ClcType],
    check_trailer: bool,
    what: &'static str,
) -> Result<(ClcHeader, Reader<'a>)> {
    let hdr = ClcHeader::peek(buf)?;
    let len = usize::from(hdr.length);
    if len != buf.len() {
        return Err(WireError::BadLength {
            what: "CLC message (header length vs buffer)",
            claimed: len,
            expected: buf.len(),
        });
    }
    if !expected.contains(&hdr.msg_type) {
        return Err(WireError::InvalidField {
            field: "CLC message type (not the one expected)",
            value: u64::from(hdr.msg_type.code()),
        });
    }
    let body_len = len.saturating_sub(CLC_TRAILER_LEN);
    let body = buf.get(..body_len).unwrap_or(&[]);
    if check_trailer {
        let mut t = Reader::new(buf.get(body_len..).unwrap_or(&[]), "CLC trailer");
        let trl = t.array::<4>()?;
        if trl != EYECATCHER_SMCR && trl != EYECATCHER_SMCD {
            return Err(WireError::BadTrailer(trl));
        }
    }
    let mut r = Reader::new(body, what);
    r.skip(CLC_HEADER_LEN)?;
    Ok((hdr, r))
}

/// Fails unless the body reader consumed everything before the trailer.
fn finish(r: &Reader<'_>, what: &'static str, len: usize) -> Result<()> {
    if r.remaining() == 0 {
        Ok(())
    } else {
        Err(WireError::BadLength {
            what,
            claimed: len,
            expected: r.pos().saturating_add(CLC_TRAILER_LEN),
        })
    }
}

fn write_trailer(w: &mut Writer<'_>) {
    w.bytes(&EYECATCHER_SMCR);
}

fn len_u16(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

// ------------------------------------------------------------------------------------
// Proposal
// ------------------------------------------------------------------------------------

/// The SMC-D info area of a Proposal (`smc_clc_msg_smcd`, §3.2.2): the native ISM
/// device of the client. All zero when SMC-D v1 is not offered.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct SmcdInfo {
    /// ISM GID (bytes 40..48).
    pub ism_gid: u64,
    /// ISM CHID (bytes 48..50).
    pub ism_chid: u16,
}

/// One IPv6 prefix entry of a Proposal (§3.2.1).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Ipv6Prefix {
    /// The prefix (host bits zero, as Linux sends it).
    pub prefix: Ipv6Addr,
    /// Prefix length, 0..=128.
    pub len: u8,
}

/// The IP prefix block of a Proposal (§3.2.1, §3.2.3): present iff `typev1 != N`.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct IpPrefixes {
    /// IPv4 network address (0.0.0.0 when IPv6 prefixes are used).
    pub ipv4_subnet: Ipv4Addr,
    /// IPv4 prefix length, 0..=32 (0 with IPv6).
    pub ipv4_prefix_len: u8,
    /// IPv6 prefixes (at most [`MAX_IPV6_PREFIXES`]); empty for IPv4.
    pub ipv6: Vec<Ipv6Prefix>,
}

impl IpPrefixes {
    /// An IPv4 prefix block.
    pub fn ipv4(subnet: Ipv4Addr, prefix_len: u8) -> IpPrefixes {
        IpPrefixes {
            ipv4_subnet: subnet,
            ipv4_prefix_len: prefix_len,
            ipv6: Vec::new(),
        }
    }

    fn wire_len(&self) -> usize {
        PROPOSAL_PREFIX_LEN + self.ipv6.len().min(MAX_IPV6_PREFIXES) * PROPOSAL_IPV6_PREFIX_LEN
    }
}

/// The v2 extension of a Proposal (`smc_clc_v2_extension`, §3.2.2): present iff
/// `typev2 != N`. Its `ism_gid_cnt` is the length of
/// [`SmcdV2Ext::gid_chids`] and is derived on encode.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct ProposalV2Ext {
    /// User EIDs (at most [`MAX_EIDS`]).
    pub eids: Vec<Eid>,
    /// SMC v2 release (4 bits; Linux sends 1).
    pub release: u8,
    /// "System EID is used" flag (bit 0 of the flag byte).
    pub seid: bool,
    /// The client's RoCE v2 GID (zero unless SMC-R v2 is offered).
    pub roce_v2_gid: Gid,
    /// v2.1: preferred max connections per link group (Linux 255).
    pub max_conns: u8,
    /// v2.1: preferred max links per link group (Linux 2).
    pub max_links: u8,
    /// v2.1 feature mask (Linux sends [`FEATURE_EMULATED_ISM_DEV`]).
    pub feature_mask: u16,
}

/// One SMC-D v2 GID/CHID entry (`smc_clc_smcd_gid_chid`, §3.2.2).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct IsmGidChid {
    /// ISM GID.
    pub gid: u64,
    /// ISM CHID.
    pub chid: u16,
}

/// The SMC-D v2 extension of a Proposal (`smc_clc_smcd_v2_extension`, §3.2.2):
/// present iff `typev2` is D or B.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct SmcdV2Ext {
    /// System EID.
    pub system_eid: Eid,
    /// GID/CHID entries (at most [`MAX_ISM_GIDS`]).
    pub gid_chids: Vec<IsmGidChid>,
}

/// A CLC Proposal (type 1), `protocol-clc.md` §3.2.
///
/// Two layouts:
/// * **version 1** (RFC 7609, §3.2.1): base, optionally the 40-byte SMC-D area
///   (`smcd = Some`, `iparea_offset` 40) or not (`smcd = None`, offset 0), then the
///   prefix block. `typev1` must not be N; `typev2` is N (bits 3..2 of byte 7 are
///   written as 0 and ignored on read).
/// * **version ≥ 2** (§3.2.2, what Linux ≥ 5.10 always sends): base, the SMC-D area
///   (always; `smcd` must be `Some`), the prefix block iff `typev1 != N`, the v2
///   extension iff `typev2 != N`, the SMC-D v2 extension iff `typev2` is D or B.
///
/// `iparea_offset`, `v2_ext_offset`, `smcd_v2_ext_offset`, the counts and the
/// length are derived on encode and checked on decode. [`validate`](Self::validate)
/// tells whether the optional parts agree with the path types.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Proposal {
    /// Header version: 1, or ≥ 2 for the v2 layout (Linux sends 2).
    pub version: u8,
    /// SMC v1 paths offered (`typev1`).
    pub typev1: SmcPath,
    /// SMC v2 paths offered (`typev2`); N for version 1.
    pub typev2: SmcPath,
    /// Client system id (zero unless SMC-R v1 is offered).
    pub peer_id: SystemId,
    /// RoCE v1 GID for SMC-R v1 (zero otherwise).
    pub gid: Gid,
    /// MAC of that RoCE port (zero otherwise).
    pub mac: Mac,
    /// The SMC-D info area; `None` only in the version-1 RFC layout.
    pub smcd: Option<SmcdInfo>,
    /// IP prefix block; `Some` iff `typev1 != N`.
    pub prefixes: Option<IpPrefixes>,
    /// v2 extension; `Some` iff `typev2 != N` (version ≥ 2).
    pub v2_ext: Option<ProposalV2Ext>,
    /// SMC-D v2 extension; `Some` iff `typev2` is D or B (version ≥ 2).
    pub smcd_v2_ext: Option<SmcdV2Ext>,
}

impl Proposal {
    fn is_v2(&self) -> bool {
        self.version >= SMC_V2
    }

    fn has_smcd_area(&self) -> bool {
        self.is_v2() || self.smcd.is_some()
    }

    fn eff_typev2(&self) -> SmcPath {
        if self.is_v2() {
            self.typev2
        } else {
            SmcPath::N
        }
    }

    fn eids_len(&self) -> usize {
        self.v2_ext
            .as_ref()
            .map_or(0, |e| e.eids.len().min(MAX_EIDS))
    }

    fn gids_len(&self) -> usize {
        self.smcd_v2_ext
            .as_ref()
            .map_or(0, |e| e.gid_chids.len().min(MAX_ISM_GIDS))
    }

    fn prefix_block_len(&self) -> usize {
        if self.typev1 == SmcPath::N {
            0
        } else {
            self.prefixes
                .as_ref()
                .map_or(PROPOSAL_PREFIX_LEN, IpPrefixes::wire_len)
        }
    }

    /// Length of the encoded message.
    pub fn encoded_len(&self) -> usize {
        let t2 = self.eff_typev2();
        let mut n = PROPOSAL_BASE_LEN;
        if self.has_smcd_area() {
            n += PROPOSAL_SMCD_AREA_LEN;
        }
        n += self.prefix_block_len();
        if t2 != SmcPath::N {
            n += PROPOSAL_V2_EXT_LEN + 32 * self.eids_len();
        }
        if t2.offers_d() {
            n += PROPOSAL_SMCD_V2_EXT_LEN + PROPOSAL_GID_CHID_LEN * self.gids_len();
        }
        n + CLC_TRAILER_LEN
    }

    /// Checks that the value encodes to a message [`decode`](Self::decode) accepts
    /// and gives back unchanged: version 1..=15, optional parts present exactly when
    /// the path types say so, counts and prefix lengths within the limits, release
    /// within 4 bits.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: u64| Err(WireError::InvalidField { field, value });
        if self.version == 0 || self.version > 15 {
            return Err(WireError::BadVersion(self.version));
        }
        if !self.is_v2() {
            if self.typev1 == SmcPath::N {
                return bad("proposal v1 typev1", u64::from(self.typev1.bits()));
            }
            if self.typev2 != SmcPath::N {
                return bad("proposal v1 typev2", u64::from(self.typev2.bits()));
            }
        } else if self.smcd.is_none() {
            return bad("proposal v2 without SMC-D area", 0);
        }
        if self.prefixes.is_some() != (self.typev1 != SmcPath::N) {
            return bad("proposal prefixes vs typev1", u64::from(self.typev1.bits()));
        }
        if let Some(p) = &self.prefixes {
            if p.ipv4_prefix_len > 32 {
                return bad("ipv4 prefix length", u64::from(p.ipv4_prefix_len));
            }
            if p.ipv6.len() > MAX_IPV6_PREFIXES {
                return bad("ipv6 prefix count", p.ipv6.len() as u64);
            }
            if let Some(e) = p.ipv6.iter().find(|e| e.len > 128) {
                return bad("ipv6 prefix length", u64::from(e.len));
            }
        }
        let t2 = self.eff_typev2();
        if self.v2_ext.is_some() != (t2 != SmcPath::N) {
            return bad("proposal v2 extension vs typev2", u64::from(t2.bits()));
        }
        if self.smcd_v2_ext.is_some() != t2.offers_d() {
            return bad(
                "proposal SMC-D v2 extension vs typev2",
                u64::from(t2.bits()),
            );
        }
        if let Some(e) = &self.v2_ext {
            if e.eids.len() > MAX_EIDS {
                return bad("eid_cnt", e.eids.len() as u64);
            }
            if e.release > 15 {
                return bad("v2 release", u64::from(e.release));
            }
        }
        if let Some(e) = &self.smcd_v2_ext {
            if e.gid_chids.len() > MAX_ISM_GIDS {
                return bad("ism_gid_cnt", e.gid_chids.len() as u64);
            }
        }
        Ok(())
    }

    /// Decodes a buffer holding exactly one Proposal.
    pub fn decode(buf: &[u8]) -> Result<Proposal> {
        const WHAT: &str = "CLC proposal";
        let (hdr, mut r) = open(buf, &[ClcType::Proposal], true, WHAT)?;
        let len = usize::from(hdr.length);
        let version = hdr.version;
        let is_v2 = version >= SMC_V2;
        let typev1 = hdr.path_v1();
        let typev2 = if is_v2 { hdr.path_v2() } else { SmcPath::N };
        if !is_v2 && typev1 == SmcPath::N {
            return Err(WireError::InvalidField {
                field: "proposal v1 typev1",
                value: u64::from(typev1.bits()),
            });
        }
        let peer_id = SystemId(r.array()?);
        let gid = Gid(r.array()?);
        let mac = Mac(r.array()?);
        let iparea_offset = r.be16()?;
        if usize::from(iparea_offset) > PROPOSAL_SMCD_AREA_LEN {
            return Err(WireError::InvalidField {
                field: "iparea_offset",
                value: u64::from(iparea_offset),
            });
        }
        // The SMC-D area and where the prefix block starts.
        let canonical_ipoff = if is_v2 {
            if typev1 == SmcPath::N {
                0
            } else {
                PROPOSAL_SMCD_AREA_LEN
            }
        } else {
            usize::from(iparea_offset)
        };
        if usize::from(iparea_offset) != canonical_ipoff
            || (canonical_ipoff != 0 && canonical_ipoff != PROPOSAL_SMCD_AREA_LEN)
        {
            return Err(WireError::InvalidField {
                field: "iparea_offset",
                value: u64::from(iparea_offset),
            });
        }
        let mut v2_ext_offset = 0u16;
        let smcd = if is_v2 || iparea_offset != 0 {
            let ism_gid = r.be64()?;
            let ism_chid = r.be16()?;
            let off = r.be16()?;
            if is_v2 {
                v2_ext_offset = off;
            }
            // vendor OUI (3), vendor options (5), reserved (20)
            r.skip(28)?;
            Some(SmcdInfo { ism_gid, ism_chid })
        } else {
            None
        };
        let prefixes = if typev1 != SmcPath::N {
            let ipv4_subnet = Ipv4Addr::from(r.be32()?);
            let ipv4_prefix_len = r.u8()?;
            r.skip(2)?;
            let n = r.u8()?;
            if ipv4_prefix_len > 32 {
                return Err(WireError::InvalidField {
                    field: "ipv4 prefix length",
                    value: u64::from(ipv4_prefix_len),
                });
            }
            if usize::from(n) > MAX_IPV6_PREFIXES {
                return Err(WireError::InvalidField {
                    field: "ipv6 prefix count",
                    value: u64::from(n),
                });
            }
            let mut ipv6 = Vec::with_capacity(usize::from(n));
            for _ in 0..n {
                let prefix = Ipv6Addr::from(r.array::<16>()?);
                let plen = r.u8()?;
                if plen > 128 {
                    return Err(WireError::InvalidField {
                        field: "ipv6 prefix length",
                        value: u64::from(plen),
                    });
                }
                ipv6.push(Ipv6Prefix { prefix, len: plen });
            }
            Some(IpPrefixes {
                ipv4_subnet,
                ipv4_prefix_len,
                ipv6,
            })
        } else {
            None
        };
        let mut v2_ext = None;
        let mut smcd_v2_ext = None;
        if is_v2 {
            let prefix_len = prefixes.as_ref().map_or(0, IpPrefixes::wire_len);
            // distance from the end of the v2_ext_offset field (byte 52) to the v2
            // extension: the rest of the SMC-D area (28) plus the prefix block
            let expected = if typev2 == SmcPath::N {
                0
            } else {
                28 + prefix_len
            };
            if usize::from(v2_ext_offset) != expected {
                return Err(WireError::InvalidField {
                    field: "v2_ext_offset",
                    value: u64::from(v2_ext_offset),
                });
            }
        }
        if typev2 != SmcPath::N {
            let eid_cnt = r.u8()?;
            let ism_gid_cnt = r.u8()?;
            r.skip(1)?;
            let flag = r.u8()?;
            r.skip(2)?;
            let smcd_off = r.be16()?;
            let roce_v2_gid = Gid(r.array()?);
            let max_conns = r.u8()?;
            let max_links = r.u8()?;
            let feature_mask = r.be16()?;
            r.skip(12)?;
            if usize::from(eid_cnt) > MAX_EIDS {
                return Err(WireError::InvalidField {
                    field: "eid_cnt",
                    value: u64::from(eid_cnt),
                });
            }
            if usize::from(ism_gid_cnt) > MAX_ISM_GIDS || (!typev2.offers_d() && ism_gid_cnt != 0) {
                return Err(WireError::InvalidField {
                    field: "ism_gid_cnt",
                    value: u64::from(ism_gid_cnt),
                });
            }
            // distance from the end of smcd_v2_ext_offset (ext byte 8) to the SMC-D
            // v2 extension: the rest of the fixed part (32) plus the EIDs
            let expected = if typev2.offers_d() {
                32 + 32 * usize::from(eid_cnt)
            } else {
                0
            };
            if usize::from(smcd_off) != expected {
                return Err(WireError::InvalidField {
                    field: "smcd_v2_ext_offset",
                    value: u64::from(smcd_off),
                });
            }
            let mut eids = Vec::with_capacity(usize::from(eid_cnt));
            for _ in 0..eid_cnt {
                eids.push(Eid(r.array()?));
            }
            v2_ext = Some(ProposalV2Ext {
                eids,
                release: flag >> 4,
                seid: flag & 1 != 0,
                roce_v2_gid,
                max_conns,
                max_links,
                feature_mask,
            });
            if typev2.offers_d() {
                let system_eid = Eid(r.array()?);
                r.skip(16)?;
                let mut gid_chids = Vec::with_capacity(usize::from(ism_gid_cnt));
                for _ in 0..ism_gid_cnt {
                    let gid = r.be64()?;
                    let chid = r.be16()?;
                    gid_chids.push(IsmGidChid { gid, chid });
                }
                smcd_v2_ext = Some(SmcdV2Ext {
                    system_eid,
                    gid_chids,
                });
            }
        }
        finish(&r, WHAT, len)?;
        Ok(Proposal {
            version,
            typev1,
            typev2,
            peer_id,
            gid,
            mac,
            smcd,
            prefixes,
            v2_ext,
            smcd_v2_ext,
        })
    }

    /// Appends the encoded message to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let t2 = self.eff_typev2();
        let mut w = Writer::new(out);
        ClcHeader {
            msg_type: ClcType::Proposal,
            length: len_u16(self.encoded_len()),
            version: self.version & 0x0f,
            typev2: if self.is_v2() { t2.bits() } else { 0 },
            typev1: self.typev1.bits(),
            eyecatcher_smcd: false,
        }
        .write(&mut w);
        w.bytes(&self.peer_id.0)
            .bytes(&self.gid.0)
            .bytes(&self.mac.0);
        let prefix_len = self.prefix_block_len();
        let iparea_offset = if self.has_smcd_area() && (!self.is_v2() || prefix_len != 0) {
            PROPOSAL_SMCD_AREA_LEN as u16
        } else {
            0
        };
        w.be16(iparea_offset);
        if self.has_smcd_area() {
            let s = self.smcd.unwrap_or_default();
            let v2_ext_offset = if self.is_v2() && t2 != SmcPath::N {
                len_u16(28 + prefix_len)
            } else {
                0
            };
            w.be64(s.ism_gid)
                .be16(s.ism_chid)
                .be16(v2_ext_offset)
                .zeros(28);
        }
        if self.typev1 != SmcPath::N {
            let empty = IpPrefixes::ipv4(Ipv4Addr::UNSPECIFIED, 0);
            let p = self.prefixes.as_ref().unwrap_or(&empty);
            let v6 = p
                .ipv6
                .get(..p.ipv6.len().min(MAX_IPV6_PREFIXES))
                .unwrap_or(&[]);
            w.bytes(&p.ipv4_subnet.octets())
                .u8(p.ipv4_prefix_len)
                .zeros(2)
                .u8(v6.len() as u8);
            for e in v6 {
                w.bytes(&e.prefix.octets()).u8(e.len);
            }
        }
        if t2 != SmcPath::N {
            let eids_n = self.eids_len();
            let gids_n = if t2.offers_d() { self.gids_len() } else { 0 };
            let smcd_off = if t2.offers_d() { 32 + 32 * eids_n } else { 0 };
            match &self.v2_ext {
                Some(e) => {
                    w.u8(eids_n as u8)
                        .u8(gids_n as u8)
                        .zeros(1)
                        .u8(((e.release & 0x0f) << 4) | u8::from(e.seid))
                        .zeros(2)
                        .be16(len_u16(smcd_off))
                        .bytes(&e.roce_v2_gid.0)
                        .u8(e.max_conns)
                        .u8(e.max_links)
                        .be16(e.feature_mask)
                        .zeros(12);
                    for eid in e.eids.iter().take(MAX_EIDS) {
                        w.bytes(&eid.0);
                    }
                }
                None => {
                    w.zeros(1)
                        .u8(gids_n as u8)
                        .zeros(4)
                        .be16(len_u16(smcd_off))
                        .zeros(32);
                }
            }
            if t2.offers_d() {
                match &self.smcd_v2_ext {
                    Some(e) => {
                        w.bytes(&e.system_eid.0).zeros(16);
                        for g in e.gid_chids.iter().take(MAX_ISM_GIDS) {
                            w.be64(g.gid).be16(g.chid);
                        }
                    }
                    None => {
                        w.zeros(PROPOSAL_SMCD_V2_EXT_LEN);
                    }
                }
            }
        }
        write_trailer(&mut w);
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }
}

// ------------------------------------------------------------------------------------
// Accept / Confirm (SMC-R)
// ------------------------------------------------------------------------------------

/// Which of the two messages sharing the [`AcceptConfirm`] layout (§3.3).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum AcceptConfirmKind {
    /// Accept (type 2).
    Accept,
    /// Confirm (type 3).
    Confirm,
}

impl AcceptConfirmKind {
    /// The CLC message type.
    pub fn msg_type(self) -> ClcType {
        match self {
            AcceptConfirmKind::Accept => ClcType::Accept,
            AcceptConfirmKind::Confirm => ClcType::Confirm,
        }
    }
}

/// The v2.1 tail of the first-contact extension (`smc_clc_first_contact_ext_v2x`,
/// §3.3), present in the 52-byte form.
///
/// A release-0 Linux peer (5.17–6.4) sends these 16 bytes as zeros (they were the
/// reserved head of its GID-list extension), so they decode as all-zero values.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct FceV2x {
    /// Max connections per link group (SMC-R).
    pub max_conns: u8,
    /// Max links per link group (SMC-R).
    pub max_links: u8,
    /// Feature mask.
    pub feature_mask: u16,
    /// Vendor experimental options (4 opaque bytes).
    pub vendor_opts: [u8; 4],
}

/// The first-contact extension of a v2 Accept/Confirm (§3.3), present iff the
/// first-contact flag is set.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct FirstContactExt {
    /// Peers are on the same IP subnet (no gateway).
    pub v2_direct: bool,
    /// OS type (4 bits): [`OS_ZOS`], [`OS_LINUX`], [`OS_AIX`].
    pub os_type: u8,
    /// SMC v2 release (4 bits).
    pub release: u8,
    /// Host name, ASCII, blank padded.
    pub hostname: [u8; 32],
    /// The 16-byte v2.1 tail: `Some` for the 52-byte form (what Linux always sends
    /// for SMC-R), `None` for the 36-byte form (only accepted in an Accept).
    pub v2x: Option<FceV2x>,
}

impl FirstContactExt {
    /// The host name without its blank/NUL padding, lossily as text.
    pub fn hostname_str(&self) -> String {
        String::from_utf8_lossy(&self.hostname)
            .trim_end_matches([' ', '\0'])
            .to_string()
    }

    /// A host name field from text: truncated to 32 bytes, blank padded (as Linux
    /// builds it from the node name).
    pub fn hostname_from_str(s: &str) -> [u8; 32] {
        let mut h = [b' '; 32];
        for (d, b) in h.iter_mut().zip(s.bytes()) {
            *d = b;
        }
        h
    }

    fn wire_len(&self) -> usize {
        if self.v2x.is_some() {
            FCE_LEN
        } else {
            FCE_SHORT_LEN
        }
    }
}

/// An SMC-R Accept (type 2) or Confirm (type 3), `protocol-clc.md` §3.3.
///
/// v1: exactly 68 bytes. v2 (header version ≥ 2): the v1 fields, the negotiated EID,
/// 8 reserved bytes (108 in all), then — only with first contact — the first-contact
/// extension and, in a Confirm, the GID-list extension, then the trailer.
/// Byte 7 is `version << 4 | first_contact << 3 | typev1 (R = 0)`.
///
/// The v2 fields (`eid`, `fce`, `gid_list`) must be empty for version 1; `fce` must
/// be `Some` exactly when version ≥ 2 and `first_contact`; `gid_list` only in a
/// first-contact v2 Confirm. See [`validate`](Self::validate).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct AcceptConfirm {
    /// Header version (1, or ≥ 2 for the v2 layout).
    pub version: u8,
    /// The sender created a new link group (header bit 0x08).
    pub first_contact: bool,
    /// Sender's system id.
    pub peer_id: SystemId,
    /// Sender's RoCE GID for this link.
    pub gid: Gid,
    /// Sender's RNIC port MAC.
    pub mac: Mac,
    /// Sender's QP number (24 bits).
    pub qpn: u32,
    /// rkey of the sender's RMB.
    pub rmb_rkey: u32,
    /// RMBE index within the RMB (1-based; Linux sends 1).
    pub rmbe_idx: u8,
    /// Sender's connection alert token.
    pub alert_token: u32,
    /// Sender's RMBE size (high nibble of byte 50).
    pub rmbe_size: RmbeSize,
    /// QP MTU, raw 4-bit IB MTU enum (low nibble of byte 50); see [`Self::mtu`].
    pub qp_mtu: u8,
    /// Virtual/DMA address of the sender's RMB.
    pub rmb_vaddr: u64,
    /// Initial packet sequence number of the sender's QP (24 bits).
    pub psn: u32,
    /// v2: negotiated EID.
    pub eid: Eid,
    /// v2: first-contact extension.
    pub fce: Option<FirstContactExt>,
    /// v2 Confirm with first contact: the sender's usable RoCE v2 GIDs.
    pub gid_list: Option<Vec<Gid>>,
}

impl AcceptConfirm {
    /// The QP MTU as an [`IbMtu`]; `None` for an invalid code.
    pub fn mtu(&self) -> Option<IbMtu> {
        IbMtu::from_code(self.qp_mtu)
    }

    fn is_v2(&self) -> bool {
        self.version >= SMC_V2
    }

    fn writes_gle(&self, kind: AcceptConfirmKind) -> bool {
        self.is_v2()
            && self.first_contact
            && kind == AcceptConfirmKind::Confirm
            && self.gid_list.is_some()
    }

    /// Length of the encoded message.
    pub fn encoded_len(&self, kind: AcceptConfirmKind) -> usize {
        if !self.is_v2() {
            return ACCEPT_CONFIRM_V1_LEN;
        }
        let mut n = ACCEPT_CONFIRM_V2_LEN;
        if self.first_contact {
            n += self.fce.as_ref().map_or(FCE_LEN, FirstContactExt::wire_len);
        }
        if self.writes_gle(kind) {
            let k = self.gid_list.as_ref().map_or(0, |g| g.len().min(255));
            n += GID_LIST_HDR_LEN + 16 * k;
        }
        n
    }

    /// Checks that the value encodes (as `kind`) to a message
    /// [`decode`](Self::decode) accepts and gives back unchanged.
    pub fn validate(&self, kind: AcceptConfirmKind) -> Result<()> {
        let bad = |field: &'static str, value: u64| Err(WireError::InvalidField { field, value });
        if self.version == 0 || self.version > 15 {
            return Err(WireError::BadVersion(self.version));
        }
        if self.qpn > U24_MAX {
            return bad("qpn", u64::from(self.qpn));
        }
        if self.psn > U24_MAX {
            return bad("psn", u64::from(self.psn));
        }
        if self.qp_mtu > 15 {
            return bad("qp_mtu", u64::from(self.qp_mtu));
        }
        if !self.is_v2() {
            if !self.eid.is_zero() || self.fce.is_some() || self.gid_list.is_some() {
                return bad("v2 fields in a v1 accept/confirm", 0);
            }
            return Ok(());
        }
        if self.fce.is_some() != self.first_contact {
            return bad("fce vs first_contact", u64::from(self.first_contact));
        }
        if let Some(f) = &self.fce {
            if f.os_type > 15 || f.release > 15 {
                return bad("fce os_type/release", u64::from(f.os_type.max(f.release)));
            }
            if f.v2x.is_none() && (kind == AcceptConfirmKind::Confirm || self.gid_list.is_some()) {
                return bad("36-byte fce outside an accept", 36);
            }
        }
        if let Some(g) = &self.gid_list {
            if kind != AcceptConfirmKind::Confirm || !self.first_contact {
                return bad("gid_list outside a first-contact confirm", g.len() as u64);
            }
            if g.len() > 255 {
                return bad("gid_cnt", g.len() as u64);
            }
        }
        Ok(())
    }

    /// Decodes a buffer holding exactly one SMC-R Accept or Confirm (whichever the
    /// header says).
    ///
    /// SMC-D messages (typev1 = D or an `SMCD` eyecatcher) give
    /// [`WireError::Unsupported`]; typev1 N or B is invalid (Linux rejects it).
    pub fn decode(buf: &[u8]) -> Result<(AcceptConfirmKind, AcceptConfirm)> {
        const WHAT: &str = "CLC accept/confirm";
        let (hdr, mut r) = open(buf, &[ClcType::Accept, ClcType::Confirm], true, WHAT)?;
        let kind = if hdr.msg_type == ClcType::Accept {
            AcceptConfirmKind::Accept
        } else {
            AcceptConfirmKind::Confirm
        };
        let len = usize::from(hdr.length);
        match hdr.path_v1() {
            SmcPath::R if !hdr.eyecatcher_smcd => {}
            SmcPath::R | SmcPath::D => {
                return Err(WireError::Unsupported("SMC-D accept/confirm"));
            }
            p => {
                return Err(WireError::InvalidField {
                    field: "accept/confirm typev1",
                    value: u64::from(p.bits()),
                })
            }
        }
        let version = hdr.version;
        let is_v2 = version >= SMC_V2;
        if !is_v2 && len != ACCEPT_CONFIRM_V1_LEN {
            return Err(WireError::BadLength {
                what: "SMC-R v1 accept/confirm",
                claimed: len,
                expected: ACCEPT_CONFIRM_V1_LEN,
            });
        }
        if is_v2 && len < ACCEPT_CONFIRM_V2_LEN {
            return Err(WireError::BadLength {
                what: "SMC-R v2 accept/confirm",
                claimed: len,
                expected: ACCEPT_CONFIRM_V2_LEN,
            });
        }
        let first_contact = hdr.typev2 & FIRST_CONTACT_MASK != 0;
        let peer_id = SystemId(r.array()?);
        let gid = Gid(r.array()?);
        let mac = Mac(r.array()?);
        let qpn = r.be24()?;
        let rmb_rkey = r.be32()?;
        let rmbe_idx = r.u8()?;
        let alert_token = r.be32()?;
        let size_mtu = r.u8()?;
        r.skip(1)?;
        let rmb_vaddr = r.be64()?;
        r.skip(1)?;
        let psn = r.be24()?;
        let rmbe_size = RmbeSize::from_class(size_mtu >> 4).unwrap_or_default();
        let qp_mtu = size_mtu & 0x0f;
        let mut eid = Eid::default();
        let mut fce = None;
        let mut gid_list = None;
        if is_v2 {
            eid = Eid(r.array()?);
            r.skip(8)?;
            let rem = r.remaining();
            if !first_contact {
                if rem != 0 {
                    return Err(WireError::BadLength {
                        what: "SMC-R v2 accept/confirm without first contact",
                        claimed: len,
                        expected: ACCEPT_CONFIRM_V2_LEN,
                    });
                }
            } else {
                let short_ok = kind == AcceptConfirmKind::Accept && rem == FCE_SHORT_LEN;
                if rem < FCE_LEN && !short_ok {
                    return Err(WireError::BadLength {
                        what: "SMC-R v2 accept/confirm with first contact",
                        claimed: len,
                        expected: ACCEPT_CONFIRM_V2_LEN + FCE_LEN + CLC_TRAILER_LEN,
                    });
                }
                let b0 = r.u8()?;
                let b1 = r.u8()?;
                r.skip(2)?;
                let hostname = r.array::<32>()?;
                let v2x = if short_ok {
                    None
                } else {
                    let max_conns = r.u8()?;
                    let max_links = r.u8()?;
                    let feature_mask = r.be16()?;
                    let vendor_opts = r.array::<4>()?;
                    r.skip(8)?;
                    Some(FceV2x {
                        max_conns,
                        max_links,
                        feature_mask,
                        vendor_opts,
                    })
                };
                fce = Some(FirstContactExt {
                    v2_direct: b0 & 0x80 != 0,
                    os_type: b1 >> 4,
                    release: b1 & 0x0f,
                    hostname,
                    v2x,
                });
                if kind == AcceptConfirmKind::Confirm && r.remaining() != 0 {
                    let cnt = r.u8()?;
                    r.skip(3)?;
                    let need = 16 * usize::from(cnt);
                    if r.remaining() != need {
                        return Err(WireError::BadLength {
                            what: "SMC-R v2 confirm GID list",
                            claimed: len,
                            expected: r.pos() + need + CLC_TRAILER_LEN,
                        });
                    }
                    let mut gids = Vec::with_capacity(usize::from(cnt));
                    for _ in 0..cnt {
                        gids.push(Gid(r.array()?));
                    }
                    gid_list = Some(gids);
                }
            }
        }
        finish(&r, WHAT, len)?;
        Ok((
            kind,
            AcceptConfirm {
                version,
                first_contact,
                peer_id,
                gid,
                mac,
                qpn,
                rmb_rkey,
                rmbe_idx,
                alert_token,
                rmbe_size,
                qp_mtu,
                rmb_vaddr,
                psn,
                eid,
                fce,
                gid_list,
            },
        ))
    }

    /// Appends the message, encoded as `kind`, to `out`.
    pub fn encode_into(&self, kind: AcceptConfirmKind, out: &mut Vec<u8>) {
        let mut w = Writer::new(out);
        ClcHeader {
            msg_type: kind.msg_type(),
            length: len_u16(self.encoded_len(kind)),
            version: self.version & 0x0f,
            typev2: if self.first_contact {
                FIRST_CONTACT_MASK
            } else {
                0
            },
            typev1: SmcPath::R.bits(),
            eyecatcher_smcd: false,
        }
        .write(&mut w);
        w.bytes(&self.peer_id.0)
            .bytes(&self.gid.0)
            .bytes(&self.mac.0)
            .be24(self.qpn)
            .be32(self.rmb_rkey)
            .u8(self.rmbe_idx)
            .be32(self.alert_token)
            .u8((self.rmbe_size.class() << 4) | (self.qp_mtu & 0x0f))
            .zeros(1)
            .be64(self.rmb_vaddr)
            .zeros(1)
            .be24(self.psn);
        if self.is_v2() {
            w.bytes(&self.eid.0).zeros(8);
            if self.first_contact {
                match &self.fce {
                    Some(f) => {
                        w.u8(if f.v2_direct { 0x80 } else { 0 })
                            .u8(((f.os_type & 0x0f) << 4) | (f.release & 0x0f))
                            .zeros(2)
                            .bytes(&f.hostname);
                        if let Some(x) = &f.v2x {
                            w.u8(x.max_conns)
                                .u8(x.max_links)
                                .be16(x.feature_mask)
                                .bytes(&x.vendor_opts)
                                .zeros(8);
                        }
                    }
                    None => {
                        w.zeros(FCE_LEN);
                    }
                }
            }
            if self.writes_gle(kind) {
                let gids = self.gid_list.as_deref().unwrap_or(&[]);
                let gids = gids.get(..gids.len().min(255)).unwrap_or(&[]);
                w.u8(gids.len() as u8).zeros(3);
                for g in gids {
                    w.bytes(&g.0);
                }
            }
        }
        write_trailer(&mut w);
    }

    /// The message encoded as `kind`.
    pub fn encode(&self, kind: AcceptConfirmKind) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len(kind));
        self.encode_into(kind, &mut v);
        v
    }
}

// ------------------------------------------------------------------------------------
// Decline
// ------------------------------------------------------------------------------------

/// A CLC Decline (type 4), `protocol-clc.md` §3.5.
///
/// Version 1 is exactly 28 bytes, version ≥ 2 exactly 44 (four extra diagnosis
/// words). On receipt `typev1` must be R or D (Linux sends R; D is accepted and not
/// kept), and the trailer is not checked (Linux does not); it is always written on
/// send.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Decline {
    /// Header version (1 → 28 bytes, ≥ 2 → 44 bytes).
    pub version: u8,
    /// "Out of sync" (header bit 0x08): Linux sets it exactly for
    /// [`DeclineCode::SyncErr`]; the receiver terminates the link group.
    pub out_of_sync: bool,
    /// Sender's system id (zero if it has none).
    pub peer_id: SystemId,
    /// Reason code.
    pub diagnosis: DeclineCode,
    /// OS type (high nibble of byte 20; Linux: 0 in v1, 2 in v2).
    pub os_type: u8,
    /// v2: additional diagnosis words (Linux sends zeros); ignored for version 1.
    pub diag_v2: [u32; DECL_DIAG_COUNT_V2],
}

impl Decline {
    /// A Decline as Linux builds it: out-of-sync iff the code is SYNCERR, OS type
    /// Linux for v2 and 0 for v1, no extra diagnosis words.
    pub fn new(version: u8, peer_id: SystemId, diagnosis: DeclineCode) -> Decline {
        Decline {
            version,
            out_of_sync: diagnosis == DeclineCode::SyncErr,
            peer_id,
            diagnosis,
            os_type: if version >= SMC_V2 { OS_LINUX } else { 0 },
            diag_v2: [0; DECL_DIAG_COUNT_V2],
        }
    }

    /// Length of the encoded message (28 or 44).
    pub fn encoded_len(&self) -> usize {
        if self.version >= SMC_V2 {
            DECLINE_V2_LEN
        } else {
            DECLINE_V1_LEN
        }
    }

    /// Checks that the value encodes to a message [`decode`](Self::decode) accepts
    /// and gives back unchanged.
    pub fn validate(&self) -> Result<()> {
        if self.version == 0 || self.version > 15 {
            return Err(WireError::BadVersion(self.version));
        }
        if self.os_type > 15 {
            return Err(WireError::InvalidField {
                field: "decline os_type",
                value: u64::from(self.os_type),
            });
        }
        if self.version < SMC_V2 && self.diag_v2 != [0; DECL_DIAG_COUNT_V2] {
            return Err(WireError::InvalidField {
                field: "v2 diagnosis words in a v1 decline",
                value: 0,
            });
        }
        if let DeclineCode::Unknown(c) = self.diagnosis {
            if !matches!(DeclineCode::from_u32(c), DeclineCode::Unknown(_)) {
                return Err(WireError::InvalidField {
                    field: "DeclineCode::Unknown holding a known code",
                    value: u64::from(c),
                });
            }
        }
        Ok(())
    }

    /// Decodes a buffer holding exactly one Decline.
    pub fn decode(buf: &[u8]) -> Result<Decline> {
        const WHAT: &str = "CLC decline";
        let (hdr, mut r) = open(buf, &[ClcType::Decline], false, WHAT)?;
        let len = usize::from(hdr.length);
        if !matches!(hdr.path_v1(), SmcPath::R | SmcPath::D) {
            return Err(WireError::InvalidField {
                field: "decline typev1",
                value: u64::from(hdr.typev1),
            });
        }
        let version = hdr.version;
        let expected = if version >= SMC_V2 {
            DECLINE_V2_LEN
        } else {
            DECLINE_V1_LEN
        };
        if len != expected {
            return Err(WireError::BadLength {
                what: WHAT,
                claimed: len,
                expected,
            });
        }
        let peer_id = SystemId(r.array()?);
        let diagnosis = DeclineCode::from_u32(r.be32()?);
        let os_type = r.u8()? >> 4;
        r.skip(3)?;
        let mut diag_v2 = [0u32; DECL_DIAG_COUNT_V2];
        if version >= SMC_V2 {
            for d in diag_v2.iter_mut() {
                *d = r.be32()?;
            }
        }
        finish(&r, WHAT, len)?;
        Ok(Decline {
            version,
            out_of_sync: hdr.typev2 & FIRST_CONTACT_MASK != 0,
            peer_id,
            diagnosis,
            os_type,
            diag_v2,
        })
    }

    /// Appends the encoded message to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let mut w = Writer::new(out);
        ClcHeader {
            msg_type: ClcType::Decline,
            length: len_u16(self.encoded_len()),
            version: self.version & 0x0f,
            typev2: if self.out_of_sync {
                FIRST_CONTACT_MASK
            } else {
                0
            },
            typev1: SmcPath::R.bits(),
            eyecatcher_smcd: false,
        }
        .write(&mut w);
        w.bytes(&self.peer_id.0)
            .be32(self.diagnosis.to_u32())
            .u8((self.os_type & 0x0f) << 4)
            .zeros(3);
        if self.version >= SMC_V2 {
            for d in self.diag_v2 {
                w.be32(d);
            }
        }
        write_trailer(&mut w);
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }
}

// ------------------------------------------------------------------------------------
// Decline codes (§3.9)
// ------------------------------------------------------------------------------------

macro_rules! decline_codes {
    ($( $var:ident = $code:literal, $name:literal, $desc:literal; )*) => {
        /// A peer diagnosis code (`SMC_CLC_DECL_*`, `protocol-clc.md` §3.9): every
        /// code current Linux defines, the 2017 v1 ones that have since changed or
        /// disappeared (`Legacy*`), and [`Unknown`](DeclineCode::Unknown) for any
        /// other value (receivers must accept unknown codes).
        ///
        /// `to_u32(from_u32(x)) == x` for every `x`. Build `Unknown` only through
        /// [`from_u32`](DeclineCode::from_u32), so that it never holds a known code.
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
        pub enum DeclineCode {
            $(
                #[doc = concat!("`", $name, "` (", stringify!($code), "): ", $desc, ".")]
                $var,
            )*
            /// Any code not listed above, kept as received.
            Unknown(u32),
        }

        impl DeclineCode {
            /// Every named code.
            pub const KNOWN: &'static [DeclineCode] = &[$(DeclineCode::$var,)*];

            /// The code for a wire value (unknown values are kept in `Unknown`).
            pub fn from_u32(code: u32) -> DeclineCode {
                match code {
                    $($code => DeclineCode::$var,)*
                    other => DeclineCode::Unknown(other),
                }
            }

            /// The wire value.
            pub fn to_u32(self) -> u32 {
                match self {
                    $(DeclineCode::$var => $code,)*
                    DeclineCode::Unknown(c) => c,
                }
            }

            /// The kernel's macro name (`SMC_CLC_DECL_PEERNOSMC`, ...); `None` for
            /// unknown codes.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $(DeclineCode::$var => Some($name),)*
                    DeclineCode::Unknown(_) => None,
                }
            }

            /// Human-readable meaning, in the wording of the kernel's `smc_clc.h`
            /// comments (which smc-tools reports; `smcss(8)` paraphrases some).
            pub fn description(self) -> &'static str {
                match self {
                    $(DeclineCode::$var => $desc,)*
                    DeclineCode::Unknown(_) => "unknown reason code",
                }
            }

            /// True for the reasons Linux records locally but never puts into a
            /// Decline (`protocol-clc.md` §4.1): PEERNOSMC and OPTUNSUPP (fallback
            /// before any CLC traffic) and PEERDECL (a Decline was received — never
            /// answer a Decline with a Decline).
            pub fn is_local_only(self) -> bool {
                matches!(
                    self,
                    DeclineCode::PeerNoSmc | DeclineCode::OptUnsupp | DeclineCode::PeerDecl
                )
            }
        }
    };
}

decline_codes! {
    Mem = 0x0101_0000, "SMC_CLC_DECL_MEM", "insufficient memory resources";
    Timeout = 0x0200_0000, "SMC_CLC_DECL_TIMEOUT", "timeout waiting for the peer's CLC answer";
    TimeoutCl = 0x0201_0000, "SMC_CLC_DECL_TIMEOUT_CL", "timeout waiting for QP confirm link";
    TimeoutAl = 0x0202_0000, "SMC_CLC_DECL_TIMEOUT_AL", "timeout waiting for QP add link";
    LegacyTcl = 0x0204_0000, "SMC_CLC_DECL_TCL", "timeout waiting for QP confirm (2017 v1 code)";
    CnfErr = 0x0300_0000, "SMC_CLC_DECL_CNFERR", "configuration error";
    PeerNoSmc = 0x0301_0000, "SMC_CLC_DECL_PEERNOSMC", "peer did not indicate SMC";
    IpSec = 0x0302_0000, "SMC_CLC_DECL_IPSEC", "IPsec usage";
    NoSmcDev = 0x0303_0000, "SMC_CLC_DECL_NOSMCDEV", "no SMC device found (R or D)";
    NoSmcDDev = 0x0303_0001, "SMC_CLC_DECL_NOSMCDDEV", "no SMC-D device found";
    NoSmcRDev = 0x0303_0002, "SMC_CLC_DECL_NOSMCRDEV", "no SMC-R device found";
    NoIsm2Supp = 0x0303_0003, "SMC_CLC_DECL_NOISM2SUPP", "hardware has no ISMv2 support";
    NoV2Ext = 0x0303_0004, "SMC_CLC_DECL_NOV2EXT", "peer sent no CLC v2 extension";
    NoV2DExt = 0x0303_0005, "SMC_CLC_DECL_NOV2DEXT", "peer sent no CLC SMC-Dv2 extension";
    NoSeid = 0x0303_0006, "SMC_CLC_DECL_NOSEID", "peer sent no SEID";
    NoSmcD2Dev = 0x0303_0007, "SMC_CLC_DECL_NOSMCD2DEV", "no SMC-Dv2 device found";
    NoUeid = 0x0303_0008, "SMC_CLC_DECL_NOUEID", "peer sent no UEID";
    ReleaseErr = 0x0303_0009, "SMC_CLC_DECL_RELEASEERR", "release version negotiation failed";
    MaxConnErr = 0x0303_000a, "SMC_CLC_DECL_MAXCONNERR", "max connections negotiation failed";
    MaxLinkErr = 0x0303_000b, "SMC_CLC_DECL_MAXLINKERR", "max links negotiation failed";
    ModeUnsupp = 0x0304_0000, "SMC_CLC_DECL_MODEUNSUPP", "SMC modes do not match (R or D)";
    RmbeEc = 0x0305_0000, "SMC_CLC_DECL_RMBE_EC", "peer has eyecatcher in RMBE";
    OptUnsupp = 0x0306_0000, "SMC_CLC_DECL_OPTUNSUPP", "fastopen sockopt not supported";
    DiffPrefix = 0x0307_0000, "SMC_CLC_DECL_DIFFPREFIX", "IP prefix / subnet mismatch";
    GetVlanErr = 0x0308_0000, "SMC_CLC_DECL_GETVLANERR", "error getting VLAN id of IP device";
    IsmVlanErr = 0x0309_0000, "SMC_CLC_DECL_ISMVLANERR", "error registering VLAN id on ISM device";
    NoActLink = 0x030a_0000, "SMC_CLC_DECL_NOACTLINK", "no active SMC-R link in link group";
    NoSrvLink = 0x030b_0000, "SMC_CLC_DECL_NOSRVLINK", "SMC-R link from server not found";
    VersMismat = 0x030c_0000, "SMC_CLC_DECL_VERSMISMAT", "SMC version mismatch";
    MaxDmb = 0x030d_0000, "SMC_CLC_DECL_MAX_DMB", "SMC-D DMB limit exceeded";
    NoRoute = 0x030e_0000, "SMC_CLC_DECL_NOROUTE", "SMC-Rv2 connection: no route to peer";
    NoIndirect = 0x030f_0000, "SMC_CLC_DECL_NOINDIRECT", "SMC-Rv2 connection: indirect mismatch";
    SyncErr = 0x0400_0000, "SMC_CLC_DECL_SYNCERR", "synchronization error";
    PeerDecl = 0x0500_0000, "SMC_CLC_DECL_PEERDECL", "peer declined during handshake";
    LegacyReply = 0x0600_0000, "SMC_CLC_DECL_REPLY", "reply to a received decline (2017 v1 code)";
    LegacySend = 0x0700_0000, "SMC_CLC_DECL_SEND", "sending problem (2017 v1 code)";
    IntErr = 0x0999_0000, "SMC_CLC_DECL_INTERR", "internal error";
    ErrRtok = 0x0999_0001, "SMC_CLC_DECL_ERR_RTOK", "rtoken handling failed";
    ErrRdyLnk = 0x0999_0002, "SMC_CLC_DECL_ERR_RDYLNK", "ib ready link failed";
    ErrRegBuf = 0x0999_0003, "SMC_CLC_DECL_ERR_REGBUF", "registering RDMA buffers failed";
    LegacyIntErr = 0x9999_0000, "SMC_CLC_DECL_INTERR", "internal error (2017 v1 code)";
}

impl fmt::Display for DeclineCode {
    /// `0x03010000 (peer did not indicate SMC)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x} ({})", self.to_u32(), self.description())
    }
}

// ------------------------------------------------------------------------------------
// Any message
// ------------------------------------------------------------------------------------

/// Any CLC message (`protocol-clc.md` §3).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum ClcMessage {
    /// Proposal (§3.2).
    Proposal(Proposal),
    /// Accept (§3.3).
    Accept(AcceptConfirm),
    /// Confirm (§3.3).
    Confirm(AcceptConfirm),
    /// Decline (§3.5).
    Decline(Decline),
}

impl ClcMessage {
    /// Decodes a buffer holding exactly one whole CLC message: the header length
    /// must equal `buf.len()` (else [`WireError::BadLength`]). The trailer is
    /// checked for every type but Decline.
    pub fn decode(buf: &[u8]) -> Result<ClcMessage> {
        let hdr = ClcHeader::peek(buf)?;
        match hdr.msg_type {
            ClcType::Proposal => Proposal::decode(buf).map(ClcMessage::Proposal),
            ClcType::Accept | ClcType::Confirm => {
                AcceptConfirm::decode(buf).map(|(kind, m)| match kind {
                    AcceptConfirmKind::Accept => ClcMessage::Accept(m),
                    AcceptConfirmKind::Confirm => ClcMessage::Confirm(m),
                })
            }
            ClcType::Decline => Decline::decode(buf).map(ClcMessage::Decline),
        }
    }

    /// The message type.
    pub fn msg_type(&self) -> ClcType {
        match self {
            ClcMessage::Proposal(_) => ClcType::Proposal,
            ClcMessage::Accept(_) => ClcType::Accept,
            ClcMessage::Confirm(_) => ClcType::Confirm,
            ClcMessage::Decline(_) => ClcType::Decline,
        }
    }

    /// The header version the message carries.
    pub fn version(&self) -> u8 {
        match self {
            ClcMessage::Proposal(p) => p.version,
            ClcMessage::Accept(m) | ClcMessage::Confirm(m) => m.version,
            ClcMessage::Decline(d) => d.version,
        }
    }

    /// Length of the encoded message.
    pub fn encoded_len(&self) -> usize {
        match self {
            ClcMessage::Proposal(p) => p.encoded_len(),
            ClcMessage::Accept(m) => m.encoded_len(AcceptConfirmKind::Accept),
            ClcMessage::Confirm(m) => m.encoded_len(AcceptConfirmKind::Confirm),
            ClcMessage::Decline(d) => d.encoded_len(),
        }
    }

    /// Checks the value encodes to a message that decodes back to it.
    pub fn validate(&self) -> Result<()> {
        match self {
            ClcMessage::Proposal(p) => p.validate(),
            ClcMessage::Accept(m) => m.validate(AcceptConfirmKind::Accept),
            ClcMessage::Confirm(m) => m.validate(AcceptConfirmKind::Confirm),
            ClcMessage::Decline(d) => d.validate(),
        }
    }

    /// Appends the encoded message to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            ClcMessage::Proposal(p) => p.encode_into(out),
            ClcMessage::Accept(m) => m.encode_into(AcceptConfirmKind::Accept, out),
            ClcMessage::Confirm(m) => m.encode_into(AcceptConfirmKind::Confirm, out),
            ClcMessage::Decline(d) => d.encode_into(out),
        }
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }
}

/// Fuzz entry point: decodes arbitrary bytes; if that succeeds, re-encodes and
/// panics unless `decode(encode(m)) == m`, the encoded length matches
/// [`ClcMessage::encoded_len`], the value validates, and encoding is idempotent.
#[doc(hidden)]
#[allow(clippy::panic)]
pub fn fuzz_one(data: &[u8]) {
    let _ = ClcHeader::peek(data);
    let Ok(m) = ClcMessage::decode(data) else {
        return;
    };
    if let Err(e) = m.validate() {
        panic!("decoded CLC message does not validate: {e}: {m:?}");
    }
    let bytes = m.encode();
    if bytes.len() != m.encoded_len() {
        panic!("encoded_len {} != {}", m.encoded_len(), bytes.len());
    }
    match ClcMessage::decode(&bytes) {
        Ok(m2) if m2 == m => {
            if m2.encode() != bytes {
                panic!("CLC encoding not idempotent: {m:?}");
            }
        }
        Ok(m2) => panic!("CLC round trip changed the message: {m:?} -> {m2:?}"),
        Err(e) => panic!("re-encoded CLC message does not decode: {e}: {m:?}"),
    }
}
