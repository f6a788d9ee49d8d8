//! The rendezvous protocol of the `shm` device: the messages two device
//! instances exchange over a unix `SOCK_SEQPACKET` connection, the proofs
//! that authenticate them, and the key generator of the device.
//!
//! Public so that tests and tools can speak it (a hostile test peer, the
//! stranger of the threat-model tests); the crate README's "Threat model"
//! section explains the design, this module the bytes.
//!
//! # Connections
//!
//! Each side of a QP pair *dials* the other once, at its RTR: it resolves the
//! peer's (GID, QPN) in the registry, connects to the peer instance's socket
//! and sends [`Kind::Hello`] with its receive ring (a sealed memfd) and its
//! completion channels' eventfds. That connection is the dialer's *out*
//! socket and the acceptor's *in* socket for this QP pair; it is the only
//! channel on which the acceptor ever hands out a region, and only to the
//! dialer. So every connected QP has two sockets: the one it dialed and the
//! one its peer dialed.
//!
//! 1. `Hello` (dialer → acceptor, at the dialer's RTR) names the dialer's
//!    (GID, QPN) and the acceptor's QPN, carries a random nonce and
//!    [`hello_proof`], keyed by the *acceptor's* send PSN (which the dialer
//!    learned out of band, as `rq_psn`). The acceptor answers
//!    [`Kind::Received`] once it holds the hello (a rejected hello is
//!    answered by closing the connection). It checks the proof when it
//!    knows its own send PSN (its RTS) and only then maps the ring and sends
//!    into it; hellos that fail are dropped and never answered further.
//! 2. `Auth` (dialer → acceptor, at the dialer's RTS) carries
//!    [`auth_proof`], keyed by *both* PSNs. The acceptor checks it with its
//!    own `sq_psn` and `rq_psn`; a wrong one fails the QP.
//! 3. `MrReq` (dialer → acceptor) asks for one region by rkey. The acceptor
//!    answers `MrResp` only after step 2 succeeded, only for a region of the
//!    QP's protection domain registered with REMOTE_WRITE, on a QP whose
//!    access flags allow remote writes; else [`Kind::Nak`]. Requests that
//!    arrive before step 2 wait for it. The answer carries the memfd the
//!    region lives in — shared by the remote-access regions of that PD
//!    only — and the region's page-aligned offset and length in it: the
//!    dialer maps that range (its header page and bytes) and closes the
//!    descriptor. A dialer that sets [`F_MR_BELL_FD`] in the request may get
//!    a second descriptor: the eventfd of the region's doorbell, if its
//!    owner made one (a poller of the owner waits on it, `verbs::Bell::
//!    arm_polled`); the dialer keeps it only if it is an eventfd. A dialer
//!    that does not set the flag gets the memfd alone, and an acceptor that
//!    does not know the flag ignores it, so the two ends need not agree on
//!    anything new.
//!
//! The order fits SMC's first contact, where the client's QP stays in RTR
//! until the server's CONFIRM LINK arrived (net/smc/af_smc.c:
//! `smc_connect_rdma` readies the link with `smc_ib_ready_link`, which moves
//! only the server's QP on to RTS; the client's goes to RTS in
//! `smcr_clnt_conf_first_link`): the client dials at its RTR and the server
//! can check that hello at its RTS, right before it sends CONFIRM LINK into
//! the client's ring; the client checks the server's hello and auth at its
//! own RTS, before anything but that exchange happened.
//!
//! A connection that sends anything else first, or anything malformed, is
//! closed. The proofs are SipHash-2-4 MACs; PSNs are 24 bits each, so a
//! proof that only uses one of them (step 1) admits a 2^-24 guess, which is
//! why a hello only ever earns a ring (no region) and why the number of
//! failed hellos per QP is bounded.
#![forbid(unsafe_code)]

use crate::prf::siphash;
use crate::verbs::Gid;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// First word of every message.
pub const MAGIC: u32 = 0x534d_4332;
/// Every message is exactly this long.
pub const MSG_LEN: usize = 64;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    /// Dialer → acceptor: who I am, whom I want, proof of the acceptor's PSN;
    /// with the dialer's ring memfd and channel eventfds.
    Hello = 1,
    /// Acceptor → dialer: the hello is held (not yet verified).
    Received = 2,
    /// Dialer → acceptor: proof of both PSNs.
    Auth = 3,
    /// Dialer → acceptor: the region with this rkey, please.
    MrReq = 4,
    /// Acceptor → dialer: the region (its memfd attached).
    MrResp = 5,
    /// Acceptor → dialer: request refused.
    Nak = 6,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Received,
            3 => Kind::Auth,
            4 => Kind::MrReq,
            5 => Kind::MrResp,
            6 => Kind::Nak,
            _ => return None,
        })
    }
}

/// `Hello` flag: the dialer's receive CQ has a completion channel (an
/// eventfd follows the ring).
pub const F_RX_CHAN: u32 = 1;
/// `Hello` flag: the dialer's send CQ has a completion channel.
pub const F_TX_CHAN: u32 = 2;
/// `Hello` flag: both CQs signal the same channel (one eventfd is sent for
/// both, saving the acceptor a descriptor).
pub const F_SAME_CHAN: u32 = 4;

/// `MrReq` flag: the dialer takes the region's doorbell eventfd, if it has
/// one, as a second descriptor of the answer.
pub const F_MR_BELL_FD: u32 = 1;

/// One message. Field use by kind:
///
/// | kind | `a` | `b` | `c` | `gid` | `x` | `y` | `z` |
/// |---|---|---|---|---|---|---|---|
/// | Hello | dialer QPN | acceptor QPN | flags | dialer GID | nonce | [`hello_proof`] | – |
/// | Received | – | – | – | – | – | – | – |
/// | Auth | – | – | – | – | – | [`auth_proof`] | – |
/// | MrReq | request id | rkey | flags ([`F_MR_BELL_FD`]) | – | – | – | – |
/// | MrResp | request id | rkey | access bits | – | iova | length | offset of the region's header page in the memfd |
/// | Nak | request id | rkey | – | – | – | – | – |
///
/// Bytes: `MAGIC`, kind, `a`, `b`, `c` (u32 each) at 0..20, `gid` at 20..36,
/// `x` at 40, `y` at 48, `z` at 56 (little endian); the rest is zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    /// Kind.
    pub kind: Kind,
    /// See the table.
    pub a: u32,
    /// See the table.
    pub b: u32,
    /// See the table.
    pub c: u32,
    /// See the table.
    pub gid: Gid,
    /// See the table.
    pub x: u64,
    /// See the table.
    pub y: u64,
    /// See the table.
    pub z: u64,
}

impl Msg {
    /// A message of `kind` with every field zero.
    pub fn new(kind: Kind) -> Msg {
        Msg {
            kind,
            a: 0,
            b: 0,
            c: 0,
            gid: Gid::ZERO,
            x: 0,
            y: 0,
            z: 0,
        }
    }
    /// The bytes on the wire (little endian).
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        for (i, v) in [MAGIC, self.kind as u32, self.a, self.b, self.c]
            .iter()
            .enumerate()
        {
            b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        b[20..36].copy_from_slice(&self.gid.0);
        b[40..48].copy_from_slice(&self.x.to_le_bytes());
        b[48..56].copy_from_slice(&self.y.to_le_bytes());
        b[56..64].copy_from_slice(&self.z.to_le_bytes());
        b
    }
    /// Parses exactly [`MSG_LEN`] bytes with the right magic and a known kind.
    pub fn decode(b: &[u8]) -> Option<Msg> {
        if b.len() != MSG_LEN {
            return None;
        }
        let w = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        let q = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        if w(0) != MAGIC {
            return None;
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        Some(Msg {
            kind: Kind::from_u32(w(1))?,
            a: w(2),
            b: w(3),
            c: w(4),
            gid: Gid(gid),
            x: q(40),
            y: q(48),
            z: q(56),
        })
    }
}

// ---------------------------------------------------------------- proofs

/// Domain separation of the two proofs (second key word).
const HELLO_DOMAIN: u64 = 0x736d_632d_7368_6d31; // "smc-shm1"
const AUTH_DOMAIN: u64 = 0x736d_632d_7368_6d32; // "smc-shm2"

fn binding(dialer_gid: &Gid, dialer_qpn: u32, acceptor_qpn: u32, nonce: u64) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..16].copy_from_slice(&dialer_gid.0);
    b[16..20].copy_from_slice(&dialer_qpn.to_le_bytes());
    b[20..24].copy_from_slice(&acceptor_qpn.to_le_bytes());
    b[24..32].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// The `Hello` proof: a MAC keyed by the acceptor's send PSN (24 bits), over
/// the dialer's GID and QPN, the acceptor's QPN and the dialer's nonce.
pub fn hello_proof(
    acceptor_psn: u32,
    dialer_gid: &Gid,
    dialer_qpn: u32,
    acceptor_qpn: u32,
    nonce: u64,
) -> u64 {
    let k0 = u64::from(acceptor_psn & 0xff_ffff);
    siphash(
        k0,
        HELLO_DOMAIN,
        &binding(dialer_gid, dialer_qpn, acceptor_qpn, nonce),
    )
}

/// The `Auth` proof: a MAC keyed by both send PSNs (48 bits), over the same
/// binding as the hello's.
pub fn auth_proof(
    dialer_psn: u32,
    acceptor_psn: u32,
    dialer_gid: &Gid,
    dialer_qpn: u32,
    acceptor_qpn: u32,
    nonce: u64,
) -> u64 {
    let k0 = u64::from(dialer_psn & 0xff_ffff) << 24 | u64::from(acceptor_psn & 0xff_ffff);
    siphash(
        k0,
        AUTH_DOMAIN,
        &binding(dialer_gid, dialer_qpn, acceptor_qpn, nonce),
    )
}

// ---------------------------------------------------------------- keys

/// Unpredictable 64-bit values for keys, region addresses and nonces:
/// SipHash-2-4 in counter mode (counter and process id) under a 128-bit key read once from the
/// kernel's random source (`getrandom`, else `/dev/urandom`). Fails only if
/// neither can be read.
pub fn random_u64() -> std::io::Result<u64> {
    static KEY: OnceLock<Option<(u64, u64)>> = OnceLock::new();
    static CTR: AtomicU64 = AtomicU64::new(0);
    let key = KEY.get_or_init(|| {
        let mut b = [0u8; 16];
        crate::sys::random_bytes(&mut b).ok()?;
        Some((
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        ))
    });
    let (k0, k1) = key.ok_or_else(|| {
        std::io::Error::other("no random source (getrandom and /dev/urandom both failed)")
    })?;
    let n = CTR.fetch_add(1, Relaxed);
    // The process id goes in too: a forked child has its parent's key and
    // counter, and must not draw the values its parent draws next.
    let mut input = [0u8; 12];
    input[..8].copy_from_slice(&n.to_le_bytes());
    input[8..].copy_from_slice(&std::process::id().to_le_bytes());
    Ok(siphash(k0, k1, &input))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msg_roundtrip_and_rejects() {
        let m = Msg {
            kind: Kind::Hello,
            a: 5,
            b: 9,
            c: F_RX_CHAN | F_SAME_CHAN,
            gid: Gid([7; 16]),
            x: 0x1122_3344_5566_7788,
            y: 42,
            z: 0x8000_1000,
        };
        assert_eq!(Msg::decode(&m.encode()), Some(m));
        assert!(Msg::decode(&[0u8; MSG_LEN]).is_none());
        assert!(Msg::decode(&m.encode()[..MSG_LEN - 1]).is_none());
        let mut bad = m.encode();
        bad[4] = 99; // unknown kind
        assert!(Msg::decode(&bad).is_none());
    }

    #[test]
    fn proofs_bind_every_input() {
        let g = Gid([3; 16]);
        let p = hello_proof(0x12_3456, &g, 10, 20, 99);
        assert_eq!(p, hello_proof(0x12_3456 | 0xff00_0000, &g, 10, 20, 99));
        for q in [
            hello_proof(0x12_3457, &g, 10, 20, 99),
            hello_proof(0x12_3456, &Gid([4; 16]), 10, 20, 99),
            hello_proof(0x12_3456, &g, 11, 20, 99),
            hello_proof(0x12_3456, &g, 10, 21, 99),
            hello_proof(0x12_3456, &g, 10, 20, 98),
        ] {
            assert_ne!(p, q);
        }
        let a = auth_proof(1, 2, &g, 10, 20, 99);
        assert_ne!(a, auth_proof(2, 1, &g, 10, 20, 99));
        assert_ne!(a, auth_proof(1, 3, &g, 10, 20, 99));
        assert_ne!(a, hello_proof(2, &g, 10, 20, 99));
    }

    #[test]
    fn random_values_differ() {
        let v: std::collections::HashSet<u64> = (0..1000).map(|_| random_u64().unwrap()).collect();
        assert_eq!(v.len(), 1000);
    }
}
