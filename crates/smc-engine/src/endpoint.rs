//! An SMC-R endpoint: CLC handshakes, link groups shared by many connections,
//! the data path and close of every connection, over one RDMA device.
//!
//! Spec: `protocol-clc.md` §4 (client and server flows, first contact vs reuse,
//! version negotiation, timeouts), `protocol-llc-cdc.md` §1.7 (first-contact link),
//! §1.9 (DELETE_LINK), §1.11 (CONFIRM_RKEY before the Accept / Confirm of a reused
//! group, DELETE_RKEY on release), §2.4 (failover validation CDC), §3.2 (writes
//! and their CDC on one QP), §4.4 (buffer pools), §5.2 and §5.6 (close drain, idle
//! groups), §6 (link groups and links, reuse rules, connection → link assignment,
//! at most `max_conns` connections per group), §7 (link failover), §9 (which link
//! carries what). The protocol decisions are smc-proto's ([`negotiate`],
//! [`LinkGroup`], [`DataPath`], [`Closer`]); the life cycles are the explicit
//! [`LgrState`] and [`HandshakePhase`] of [`crate::state`]; this module owns the
//! provider objects and wires them together; `endpoint/link.rs` holds one
//! link's provider objects.
//!
//! The TCP connection that carries CLC is the caller's: it feeds received bytes to
//! [`Endpoint::clc_input`] and sends what [`Endpoint::clc_output`] returns. Time is
//! passed in; nothing here blocks or spawns threads.
//!
//! # What a peer's values and failures may cost
//!
//! Every value of a peer's Accept or Confirm that we act on is checked before
//! we act on it (`negotiate::check_peer_values`); a bad one is declined with a
//! code, as a failure to ready the peer's RMB on our QP is
//! ([`QueuePair::prepare_remote`]). When the first link fails after the
//! CLC exchange, exactly one side declines — the server; the client reads
//! that Decline — and a Decline that crossed ours anyway is taken off the
//! stream ([`HandshakePhase::AwaitLateDecline`], [`HandshakePhase::LateDeclined`]):
//! no CLC byte reaches an application.
//!
//! # Links
//!
//! A link group holds up to three links (`SMC_LINKS_PER_LGR_MAX`), each with its
//! own QP, CQs, receive buffers, PSN, peer QPN/GID and send bookkeeping, indexed by
//! smc-proto's link slot. Every connection is assigned to one link: the server
//! picks the usable link with the fewest connections (Linux alternates between its
//! two links, which is the same for two), its CLC Accept names that link's QP, and
//! the client takes the link whose peer QPN and GID the Accept names (§6). A
//! connection's CDCs and RDMA WRITEs go over its link (§9) with that link's rkey
//! for the peer RMB; CDCs are accepted on any link of the group; LLC responses go
//! on the link of the request; completions are attributed to the link whose CQ
//! they came from.
//!
//! A connection changes link in two ways:
//!
//! * [`Endpoint::move_connection`] (both links healthy): the connection stops
//!   sending on the old link, waits until none of its CDCs is in flight there
//!   (their completions prove that the CDCs and the WRITEs before them arrived),
//!   then continues on the new link. Nothing is resent, and no WRITE of the old
//!   link can land after a newer one of the new link (RC orders a QP, not two).
//! * Failover (its link went down and another is usable, §7.2): what the dead
//!   link still completed or received is processed, then the sender rewinds to
//!   the last CDC whose completion it saw ([`DataPath::failover_rewind`]), sends
//!   the failover validation CDC on the new link and writes everything after that
//!   point again, to the same RMB offsets, followed by CDCs whose seqnos continue.
//!   Completions of the old link's CDCs are ignored from then on; its QP is
//!   stopped and its slot freed; the peer is told with DELETE_LINK (smc-proto).
//!   The receiving side drops stale seqnos and aborts a connection whose
//!   validation shows loss (§2.4).
//!
//! With no usable link left the group terminates and its connections are aborted
//! (`ECONNABORTED`, or the peer's reset), as before.
//!
//! Limits of this version (later issues): ADD_LINK is not negotiated — a peer's
//! ADD_LINK is rejected and CONFIRM_LINK advertises one link — so further links
//! come only from [`Endpoint::extra_link_offer`] / [`Endpoint::extra_link_accept`],
//! which tests and the simulation use between two of our endpoints; one device
//! per endpoint, so all links of a group share its port; the links of a group
//! share one protection domain (see `endpoint/link.rs`).
//!
//! [`negotiate`]: smc_proto::negotiate

mod gid;
mod link;
mod psn;

use crate::state::{HandshakePhase, LgrAction, LgrEvent, LgrState};
use gid::{ConnGids, LocalGid};
use link::{LinkRes, WrKind, MAX_SENDS, RECV_SLOT_LEN};
use psn::PsnSource;
use smc_proto::clc_stream::{self, ClcReader, FailReason, HandshakeEnd};
use smc_proto::close::{CloseEvent, CloseFlags, CloseState, Closer};
use smc_proto::datapath::{DataPath, DataPathConfig, Violation};
use smc_proto::link::{LgrConfig, LgrOutput, LinkGroup, LinkState, PeerPort, Role, LINK_SLOTS};
use smc_proto::negotiate::{
    self, ClientAgreement, IfAddr, LocalCapabilities, RoceV1Port, ServerChoice,
};
use smc_proto::Timestamp;
use smc_rdma::{
    Access, AsyncEvent, CompletionChannel, CompletionQueue, Device, GidEntry, MemWindow,
    MemoryRegion, ProtectionDomain, Provider, QueuePair, RecvWr, WcStatus, WorkCompletion,
};
use smc_wire::cdc::{CdcMessage, RingChunks};
use smc_wire::clc::{
    AcceptConfirm, AcceptConfirmKind, ClcMessage, ClcType, Decline, DeclineCode, FceV2x,
    FirstContactExt, Proposal, CLC_WAIT_TIME, CLC_WAIT_TIME_SHORT, OS_LINUX, SMC_V1, SMC_V2,
};
use smc_wire::llc::LlcVersion;
use smc_wire::types::{Eid, Gid, Mac, RmbeSize, SystemId};
use smc_wire::WrMessage;
use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

/// How long after the TCP connection ended a close CDC may still arrive before
/// the peer is taken for dead.
pub const PEER_GONE_GRACE: Duration = Duration::from_secs(1);
/// Longest wait for the send buffer to drain before a close (Linux
/// `SMC_MAX_STREAM_WAIT_TIMEOUT`).
const MAX_STREAM_WAIT: Duration = Duration::from_secs(2);
/// Longest time a server's Proposal waits for a first contact with the same peer
/// to finish ([`HandshakePhase::AwaitLgr`]) before it makes its own: half the
/// client's wait for the Accept, so that the Accept still comes in time.
const LGR_PENDING_WAIT: Duration = Duration::from_secs(3);

/// Late declines (the first link failed, or its CONFIRM_LINK did not come,
/// after the CLC exchange: `protocol-clc.md` §4.2 step 8, §4.3 step 13, §4.6).
/// Linux waits for the link (server 2 s, client 4 s), then reads for the peer's
/// Decline for up to 1 s (`CLC_WAIT_TIME_SHORT`, `smc_clc_wait_msg`) and only
/// then sends its own TIMEOUT_CL; a Decline is never answered with one. When
/// both ends see the link fail at once (a QP error), that makes both decline
/// together: the Declines cross, and each end hands the other's to its
/// application as data (issue 13, finding 1). So the two roles wait
/// differently, and the server is the one that declines:
///
/// * the server reads for the client's Decline for [`SERVER_LATE_DECLINE_WAIT`]
///   after its link wait ended — long enough for a Decline already on its way,
///   and shorter than the 1 s a Linux client reads after its own link fails, so
///   that ours reaches a Linux client first when both see the failure together;
///   it declines at most 2.5 s after the Confirm (2 s link wait);
/// * the client reads for the server's Decline until [`CLIENT_LATE_DECLINE_WAIT`]
///   after its Confirm (Linux's 4 s + 1 s) and at least `CLC_WAIT_TIME_SHORT`
///   after its link failed — well after any server, ours or Linux's (2 s + 1 s
///   after the Confirm), has declined.
const SERVER_LATE_DECLINE_WAIT: Duration = Duration::from_millis(500);
/// See [`SERVER_LATE_DECLINE_WAIT`].
const CLIENT_LATE_DECLINE_WAIT: Duration = Duration::from_secs(5);
/// After our own late Decline, how long the first bytes from the peer are
/// looked at for a Decline that crossed ours (a peer with other timers): it
/// was sent before ours arrived, so it is there within a round trip, ahead of
/// any application data.
const CROSSED_DECLINE_WAIT: Duration = CLC_WAIT_TIME_SHORT;

/// What a first contact agreed for its link group (SMC v2.1 first-contact
/// extension; v1 groups take the defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Limits {
    release: u8,
    max_conns: u8,
    max_links: u8,
}

/// Handle of a connection.
pub type ConnId = usize;
/// Handle of a link group.
pub type LgrId = usize;

/// What an endpoint is and offers.
#[derive(Clone, Debug)]
pub struct EndpointConfig {
    /// This SMC instance's system id (random instance + a RoCE MAC).
    pub system_id: SystemId,
    /// The provider device to use.
    pub device: String,
    /// UEIDs (SMC-R v2 needs one shared with the peer).
    pub ueids: Vec<Eid>,
    /// Offer / accept SMC-R v1.
    pub offer_v1: bool,
    /// Offer / accept SMC-R v2.
    pub offer_v2: bool,
    /// Addresses of the interface the connections use (prefix rules).
    pub if_addrs: Vec<IfAddr>,
    /// RMB (receive buffer) per connection, rounded up to a size class.
    pub rmb_len: usize,
    /// Send buffer per connection.
    pub sndbuf_len: usize,
    /// TEST_LINK interval (Linux default 30 s; `None` disables).
    pub testlink: Option<Duration>,
    /// Connections per link group this side allows (server side, ≤ 255).
    pub max_conns: u8,
    /// Host name sent in the first-contact extension (v2).
    pub hostname: String,
    /// A link group without connections is ended after this long (Linux: 600 s
    /// on a server, 610 s on a client so the client's never expires first).
    pub lgr_idle_timeout: Duration,
}

/// Where a connection stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnStatus {
    /// The CLC handshake or the link confirmation is running.
    Handshaking,
    /// SMC-R: data moves over RDMA.
    Smc,
    /// Plain TCP on the same connection (the caller switches its socket over).
    Fallback {
        /// Our reason (as `smcss` shows).
        reason: DeclineCode,
        /// The peer's Decline code, if the peer declined.
        peer: Option<DeclineCode>,
    },
    /// The connection failed (no fallback): timeout, TCP error or protocol error.
    Failed(FailReason),
}

/// Errors the application sees on an SMC connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnError {
    /// No such connection (or not in SMC mode).
    NotConnected,
    /// The write side is shut down or the connection closed (`EPIPE`).
    Closed,
    /// Aborted by the peer (`ECONNRESET`).
    Reset,
    /// Killed locally: link group lost or peer misbehaved (`ECONNABORTED`).
    Aborted,
}

#[derive(Clone, Debug)]
enum Phase {
    // client
    AwaitAccept {
        proposal: Box<Proposal>,
        deadline: Timestamp,
    },
    ClientRkey {
        confirm: Box<AcceptConfirm>,
    },
    // server
    AwaitProposal {
        deadline: Timestamp,
    },
    AwaitLgr {
        proposal: Box<Proposal>,
        deadline: Timestamp,
    },
    ServerRkey {
        accept: Box<AcceptConfirm>,
        version: u8,
    },
    AwaitConfirm {
        version: u8,
        first_contact: bool,
        deadline: Timestamp,
    },
    // both
    /// First contact: CLC done (`since`: our Confirm went out / theirs came
    /// in), the CONFIRM_LINK exchange runs.
    AwaitLink {
        version: u8,
        since: Timestamp,
    },
    /// The link failed after the CLC exchange: the peer's Decline is read
    /// until `deadline`, then we decline (see [`SERVER_LATE_DECLINE_WAIT`]).
    AwaitLateDecline {
        version: u8,
        deadline: Timestamp,
    },
    /// Our late Decline (`reason`) is out; until `deadline` the first bytes
    /// from the peer are looked at for a Decline that crossed it.
    LateDeclined {
        reason: DeclineCode,
        deadline: Timestamp,
    },
    Smc,
    Done(ConnStatus),
}

impl Phase {
    fn kind(&self) -> HandshakePhase {
        match self {
            Phase::AwaitAccept { .. } => HandshakePhase::AwaitAccept,
            Phase::ClientRkey { .. } => HandshakePhase::ClientRkey,
            Phase::AwaitProposal { .. } => HandshakePhase::AwaitProposal,
            Phase::AwaitLgr { .. } => HandshakePhase::AwaitLgr,
            Phase::ServerRkey { .. } => HandshakePhase::ServerRkey,
            Phase::AwaitConfirm { .. } => HandshakePhase::AwaitConfirm,
            Phase::AwaitLink { .. } => HandshakePhase::AwaitLink,
            Phase::AwaitLateDecline { .. } => HandshakePhase::AwaitLateDecline,
            Phase::LateDeclined { .. } => HandshakePhase::LateDeclined,
            Phase::Smc => HandshakePhase::Smc,
            Phase::Done(_) => HandshakePhase::Done,
        }
    }
}

/// An rkey flow waiting for the link group's LLC flow slot (§1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RkeyFlow {
    /// CONFIRM_RKEY for the RMB of this connection (its handshake waits).
    Confirm(ConnId),
    /// DELETE_RKEY for a released RMB.
    Delete(u32),
}

/// Flow tags: confirm flows carry the connection id, delete flows this bit.
const DELETE_TAG: u64 = 1 << 63;

struct Lgr<P: Provider> {
    /// One protection domain for all links of the group (see `endpoint/link.rs`).
    pd: P::Pd,
    /// Provider objects of each link, by smc-proto link slot. A slot holds
    /// objects while smc-proto's slot holds the link, and briefly before: a
    /// further link offered and not yet accepted.
    links: [Option<LinkRes<P>>; LINK_SLOTS],
    state: LgrState,
    group: LinkGroup,
    role: Role,
    version: u8,
    peer_system_id: SystemId,
    /// The peer GID of the CLC exchange that created the group (reuse and
    /// first-contact serialization match on it, §6).
    peer_gid: Gid,
    /// Our GID on the group's links (and its table index, the QPs' source
    /// GID): the one the connection that created the group chose (see
    /// `endpoint/gid.rs`); only connections with the same GID join.
    local: LocalGid,
    /// The SMC v2 release the first contact agreed (first-contact extension).
    release: u8,
    tokens: BTreeMap<u32, ConnId>,
    rkey_queue: VecDeque<RkeyFlow>,
    /// Released RMBs and send buffers kept registered for reuse (Linux keeps
    /// them in per-size pools, §4.4): a late RDMA WRITE from the peer lands in
    /// memory we still own, and the next connection skips registration.
    free_bufs: Vec<(P::Mr, P::Mr)>,
    /// rkeys of pooled RMBs that the peer still knows: with a single link a
    /// released RMB is not deleted at the peer (no DELETE_RKEY), so a
    /// connection that reuses it needs no CONFIRM_RKEY either — the peer finds
    /// the rkey already in its table (Linux's smc_rtoken_add returns the
    /// existing row). Two LLC round trips less per reusing connection, the
    /// buffer reuse the connection-setup target asks for. Cleared when a link
    /// is added (its column of the peer's table lacks these rkeys).
    known_rkeys: std::collections::HashSet<u32>,
    idle_since: Option<Timestamp>,
    rr: usize,
}

/// Where the peer's RMBE is: the row of its RMB in the link group's rtoken table
/// (one (rkey, address) per link, §1.11) and the RMBE inside the RMB.
#[derive(Clone, Copy, Debug)]
struct PeerRmb {
    row: usize,
    offset: u64,
}

/// What one side offers for a further link of a group: what the ADD_LINK and
/// ADD_LINK_CONT messages of §1.8 would carry. Test and simulation use only
/// ([`Endpoint::extra_link_offer`]), until ADD_LINK is negotiated.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkOffer {
    /// GID of the new link's port.
    pub gid: Gid,
    /// MAC of the new link's port.
    pub mac: Mac,
    /// QP number of the new link.
    pub qpn: u32,
    /// Initial PSN of the new link's QP.
    pub psn: u32,
    /// Path MTU (IB enum).
    pub mtu: u8,
    /// The link id (the server's choice; 0 from a client).
    pub link_id: u8,
    /// Every in-use RMB: (rkey on an existing link, rkey on the new link,
    /// address on the new link).
    pub rkeys: Vec<(u32, u32, u64)>,
}

struct Conn<P: Provider> {
    role: Role,
    phase: Phase,
    /// The GIDs this connection may use, from its local address.
    gids: ConnGids,
    lgr: Option<LgrId>,
    /// The link (slot) the connection is assigned to.
    link: Option<usize>,
    /// A requested move to this link, done once no CDC is in flight on the old one.
    move_to: Option<usize>,
    /// A failover validation CDC to send first on the new link (§2.4).
    validation: Option<CdcMessage>,
    token: u32,
    reader: ClcReader,
    out: VecDeque<u8>,
    rmb: Option<P::Mr>,
    sndbuf: Option<P::Mr>,
    dp: Option<DataPath>,
    closer: Closer,
    peer_rmb: Option<PeerRmb>,
    violation: Option<Violation>,
    /// When a close waiting for the send buffer to drain is sent anyway.
    close_deadline: Option<Timestamp>,
    /// The TCP connection ended; without a close CDC by then the peer is dead.
    tcp_gone_deadline: Option<Timestamp>,
    /// The peer's latest urgent (out-of-band) byte, until the application reads it.
    oob: Option<u8>,
    /// CDCs that arrived before the data path exists. A client that reuses a
    /// link group may write as soon as it has sent its CLC Confirm, and its
    /// RDMA SEND can overtake that Confirm on TCP; Linux processes such a CDC
    /// as soon as the token is known (smc_cdc_rx_handler), so we keep it and
    /// apply it once the Confirm is in. Cursors are cumulative, so when more
    /// than [`EARLY_CDC_MAX`] pile up the oldest can be dropped.
    early_cdcs: VecDeque<CdcMessage>,
    /// The send cursor (absolute) after the last direct write: data up to
    /// here never was in the send buffer and cannot be replayed.
    direct_sent: u64,
    /// Listed in `Endpoint::tx_dirty`: something may have given the
    /// connection something to send since it last had nothing.
    tx_dirty: bool,
    /// A [`ReadLease`] is out: other reads find nothing until its commit.
    read_leased: bool,
    /// A [`WriteLease`] is out: nothing else is written (or sent) until its
    /// commit, as it copies to where the next bytes go.
    write_leased: bool,
    /// Something was refused because of a lease since the last
    /// [`Endpoint::take_lease_waited`].
    lease_waited: bool,
    /// The window onto the peer's RMB that write leases lend, with the link
    /// slot and rkey it was made for (made again when they change).
    peer_window: Option<(usize, u32, MemWindow)>,
}

/// The Decline code for a failed [`QueuePair::prepare_remote`] (see
/// `Endpoint::prepare_peer_rmb`).
fn prepare_error_code(e: &smc_rdma::Error) -> DeclineCode {
    // ENOMEM, ENFILE, EMFILE: this process is short of memory or descriptors
    const OUT_OF_RESOURCES: [i32; 3] = [12, 23, 24];
    match e {
        smc_rdma::Error::Io(io)
            if io.kind() == std::io::ErrorKind::OutOfMemory
                || io
                    .raw_os_error()
                    .is_some_and(|n| OUT_OF_RESOURCES.contains(&n)) =>
        {
            DeclineCode::Mem
        }
        _ => DeclineCode::ErrRtok,
    }
}

/// Writes zeros over the first `len` bytes of `mr`.
fn zero<M: MemoryRegion>(mr: &M, len: usize) {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(ZEROS.len());
        if mr.write_at(off, &ZEROS[..n]).is_err() {
            return;
        }
        off += n;
    }
}

/// What [`Endpoint::write_direct`] did.
enum Direct {
    /// Written straight into the peer's RMB.
    Wrote(usize),
    /// It would go directly, but the peer has no room for it now.
    NoRoom,
    /// The direct path does not apply.
    No,
}

/// Where a direct write goes (see `direct_plan`).
struct DirectPlan {
    l: LgrId,
    slot: usize,
    rkey: u32,
    /// The peer's RMBE, as the link addresses it.
    rmbe_addr: u64,
    /// Bytes that go now.
    n: usize,
    /// The send cursor (total) they follow.
    at: u64,
}

/// What [`Endpoint::write_lease`] found.
#[derive(Debug)]
pub enum WritePlan {
    /// Copy this much into the peer's RMB, then commit.
    Lease(WriteLease),
    /// The direct path applies but the peer has no room now.
    NoRoom,
    /// The direct path does not apply (or the provider lends no window):
    /// use [`Endpoint::write`].
    NotDirect,
}

/// A place in the peer's RMB lent for the next bytes of a connection (see
/// [`Endpoint::write_lease`]).
#[derive(Debug)]
pub struct WriteLease {
    win: MemWindow,
    chunks: RingChunks,
    n: usize,
    /// The send cursor (total) the bytes follow.
    at: u64,
    slot: usize,
    rkey: u32,
}

impl WriteLease {
    /// Bytes lent (a prefix of the data the lease was asked for).
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies the first [`Self::len`] bytes of `data` into the peer's RMB.
    /// An error means the peer's region went away (the connection is being
    /// torn down); commit nothing then.
    pub fn copy_from(&self, data: &[u8]) -> std::result::Result<(), ConnError> {
        let mut at = 0;
        for &(off, len) in self.chunks.as_slice() {
            let src = data.get(at..at + len).ok_or(ConnError::Aborted)?;
            self.win
                .write_at(off, src)
                .map_err(|_| ConnError::Aborted)?;
            at += len;
        }
        Ok(())
    }
}

/// What [`Endpoint::read_lease`] found.
#[derive(Debug)]
pub enum ReadPlan {
    /// Copy out, then commit.
    Lease(ReadLease),
    /// Nothing to read: `Ok(0)` of [`Endpoint::read_into`] (end of file
    /// when [`Endpoint::peer_done`], else would block).
    Empty,
    /// The provider lends no window: use [`Endpoint::read_into`].
    NoWindow,
}

/// Readable bytes of a connection's RMB lent out to be copied without
/// holding the endpoint (see [`Endpoint::read_lease`]).
#[derive(Debug)]
pub struct ReadLease {
    win: MemWindow,
    chunks: RingChunks,
    n: usize,
}

impl ReadLease {
    /// Bytes lent.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies the lent bytes into the front of `buf` (which is at least
    /// [`Self::len`] long, as the lease was asked for).
    pub fn copy_to(&self, buf: &mut [u8]) -> std::result::Result<(), ConnError> {
        let mut at = 0;
        for &(off, len) in self.chunks.as_slice() {
            let dst = buf.get_mut(at..at + len).ok_or(ConnError::Aborted)?;
            self.win.read_at(off, dst).map_err(|_| ConnError::Aborted)?;
            at += len;
        }
        Ok(())
    }
}

/// Smallest part of a larger write that goes out directly (see `write_direct`).
const DIRECT_PART_MIN: usize = 16 * 1024;

/// Released RMBs a link group keeps known at the peer (see `known_rkeys`);
/// further ones are deleted at the peer with DELETE_RKEY, as Linux deletes
/// every released RMB, and announced again when reused.
const KNOWN_RKEYS_MAX: usize = 16;

/// CDCs kept per connection while its CLC Confirm is still on the way.
const EARLY_CDC_MAX: usize = 64;

/// How often a pump flushes every connection, not only those marked as
/// having something to send (see `Endpoint::flush_tx`): the safety net under
/// the marks.
const FLUSH_SWEEP_EVERY: Duration = Duration::from_millis(1);

/// An SMC-R endpoint on one device.
pub struct Endpoint<P: Provider> {
    cfg: EndpointConfig,
    dev: P::Device,
    /// One completion channel for every CQ of this endpoint: a single
    /// descriptor to sleep on (see [`Endpoint::arm`]).
    chan: P::Channel,
    /// Work completions taken from the CQs so far (progress indicator).
    completions: u64,
    /// Scratch list of connection ids (`flush_tx`), kept to not allocate per pump.
    scratch_ids: Vec<ConnId>,
    /// A spare for `tx_dirty` while `flush_tx` works through the marks.
    scratch_marked: Vec<ConnId>,
    /// Connections that may have something to send (see `flush_tx`).
    tx_dirty: Vec<ConnId>,
    /// Every connection is flushed at the next pump (a link or handshake
    /// event, whose effect on connections is not tracked one by one).
    sweep_due: bool,
    /// When the next pump flushes every connection anyway.
    next_sweep: Timestamp,
    /// Connections flushed so far, one by one (`conn_flushes`).
    conn_flushes: u64,
    /// Scratch copy of one received message (`poll_recv`), likewise.
    scratch_msg: Vec<u8>,
    /// LLC messages posted so far.
    llc_sent: u64,
    /// The port's active MTU, for the CLC messages of every connection:
    /// querying the port reads the interface (netlink, ioctl) and would cost
    /// more than the rest of a handshake. Read again at each port event.
    port_mtu: smc_wire::types::IbMtu,
    /// Largest inline payload of the device: writes up to this size go from the
    /// application's buffer straight to the peer (see [`Endpoint::write`]).
    max_inline: u32,
    lgrs: Vec<Option<Lgr<P>>>,
    conns: Vec<Option<Conn<P>>>,
    next_token: u32,
    next_lgr_id: u32,
    /// The port's GID table, read at open and again at port events and when
    /// a connection's address has no GID in it (a new address).
    gids: Vec<GidEntry>,
    /// When the GID table was last read again for a missing address.
    gids_reread: Option<Timestamp>,
    mac: Mac,
    /// Initial PSNs of our QPs: random, keyed from the OS (or a seed).
    psns: PsnSource,
    /// Token allocation has wrapped around: new tokens are checked against the
    /// live ones.
    tokens_wrapped: bool,
    /// Time of the latest input (for deadlines set from engine outputs).
    now: Timestamp,
}

/// Provider errors.
pub type Result<T> = smc_rdma::Result<T>;

impl<P: Provider> Endpoint<P> {
    /// Opens the configured device. The initial PSNs of its QPs are random,
    /// from a generator keyed by the operating system.
    pub fn new(provider: &P, cfg: EndpointConfig) -> Result<Endpoint<P>> {
        Self::with_psns(provider, cfg, PsnSource::from_os())
    }

    /// [`Self::new`] with the PSN generator keyed from `seed`: the same seed
    /// gives the same PSNs (the deterministic simulation).
    pub fn new_seeded(provider: &P, cfg: EndpointConfig, seed: u64) -> Result<Endpoint<P>> {
        Self::with_psns(provider, cfg, PsnSource::seeded(seed))
    }

    fn with_psns(provider: &P, cfg: EndpointConfig, psns: PsnSource) -> Result<Endpoint<P>> {
        let dev = provider.open_device(&cfg.device)?;
        let port = dev.query_port(1)?;
        let port_mtu = port.active_mtu;
        let gids = port.gids;
        let mac = cfg.system_id.mac();
        let chan = dev.create_channel()?;
        let max_inline = dev.info().max_inline;
        Ok(Endpoint {
            cfg,
            dev,
            chan,
            completions: 0,
            scratch_ids: Vec::new(),
            scratch_marked: Vec::new(),
            tx_dirty: Vec::new(),
            sweep_due: true,
            next_sweep: Timestamp::ZERO,
            conn_flushes: 0,
            scratch_msg: Vec::new(),
            llc_sent: 0,
            port_mtu,
            max_inline,
            lgrs: Vec::new(),
            conns: Vec::new(),
            next_token: 1,
            next_lgr_id: 0x100,
            gids,
            gids_reread: None,
            mac,
            psns,
            tokens_wrapped: false,
            now: Duration::ZERO,
        })
    }

    /// The GIDs a connection from `local` may use (see `endpoint/gid.rs`),
    /// for the versions this endpoint offers.
    fn conn_gids(&mut self, local: IpAddr) -> ConnGids {
        let pick = |gids: &[GidEntry], cfg: &EndpointConfig| ConnGids {
            v1: cfg.offer_v1.then(|| gid::v1_gid(gids)).flatten(),
            v2: cfg
                .offer_v2
                .then(|| gid::v2_gid(gids, local, &cfg.if_addrs))
                .flatten(),
        };
        let g = pick(&self.gids, &self.cfg);
        // An IPv4 address the table lacks may have been added since it was
        // read: read it again, at most once a second.
        let missing = self.cfg.offer_v2 && g.v2.is_none() && gid::ipv4_of(local).is_some();
        let due = self
            .gids_reread
            .is_none_or(|t| self.now >= t + Duration::from_secs(1));
        if missing && due {
            self.gids_reread = Some(self.now);
            if let Ok(port) = self.dev.query_port(1) {
                self.gids = port.gids;
                return pick(&self.gids, &self.cfg);
            }
        }
        g
    }

    fn caps(&self, gids: &ConnGids) -> LocalCapabilities {
        LocalCapabilities {
            system_id: self.cfg.system_id,
            v1: gids.v1.map(|g| RoceV1Port {
                gid: g.gid,
                mac: self.mac,
            }),
            v2_gid: gids.v2.map(|g| g.gid),
            ueids: self.cfg.ueids.clone(),
            if_addrs: self.cfg.if_addrs.clone(),
        }
    }

    /// The next alert token: what the peer puts into every CDC for the
    /// connection, so it routes them (§2.1). Never 0 (Linux never hands out 0,
    /// and a check of the peer's refuses it, see `negotiate::check_peer_values`),
    /// and, once the counter has wrapped, none that a live connection holds.
    fn next_alert_token(&mut self) -> u32 {
        loop {
            let token = self.next_token;
            self.next_token = self.next_token.wrapping_add(1);
            if self.next_token == 0 {
                self.next_token = 1;
                self.tokens_wrapped = true;
            }
            let taken =
                self.tokens_wrapped && self.conns.iter().flatten().any(|c| c.token == token);
            if token != 0 && !taken {
                return token;
            }
        }
    }

    fn new_conn(&mut self, role: Role, phase: Phase, gids: ConnGids) -> ConnId {
        let token = self.next_alert_token();
        let c = Conn {
            role,
            phase,
            gids,
            lgr: None,
            link: None,
            move_to: None,
            validation: None,
            token,
            reader: ClcReader::new(),
            out: VecDeque::new(),
            rmb: None,
            sndbuf: None,
            dp: None,
            closer: Closer::new(),
            peer_rmb: None,
            violation: None,
            close_deadline: None,
            tcp_gone_deadline: None,
            oob: None,
            early_cdcs: VecDeque::new(),
            direct_sent: 0,
            read_leased: false,
            write_leased: false,
            lease_waited: false,
            peer_window: None,
            tx_dirty: false,
        };
        match self.conns.iter().position(Option::is_none) {
            Some(i) => {
                self.conns[i] = Some(c);
                i
            }
            None => {
                self.conns.push(Some(c));
                self.conns.len() - 1
            }
        }
    }

    fn conn(&mut self, id: ConnId) -> Option<&mut Conn<P>> {
        self.conns.get_mut(id).and_then(Option::as_mut)
    }

    /// Client: the TCP connection to the peer is up and the peer offered SMC on its
    /// SYN-ACK. Queues the Proposal (or a Decline when we have nothing to offer).
    /// `local_ip` is the TCP connection's local address: it chooses the
    /// GIDs (see `endpoint/gid.rs`; no SMC-R v2 over IPv6).
    pub fn connect(&mut self, local_ip: IpAddr, now: Timestamp) -> ConnId {
        self.now = self.now.max(now);
        let gids = self.conn_gids(local_ip);
        match negotiate::build_proposal(local_ip, &self.caps(&gids)) {
            Ok(p) => {
                let id = self.new_conn(
                    Role::Client,
                    Phase::AwaitAccept {
                        proposal: Box::new(p.clone()),
                        deadline: now + CLC_WAIT_TIME,
                    },
                    gids,
                );
                self.send_clc(id, &ClcMessage::Proposal(p));
                id
            }
            Err(code) => {
                let id = self.new_conn(Role::Client, Phase::AwaitProposal { deadline: now }, gids);
                self.decline(id, SMC_V1, code);
                id
            }
        }
    }

    /// Server: a TCP connection whose SYN carried the SMC option was accepted
    /// at the local address `local_ip` (which chooses the GIDs, as for
    /// [`Self::connect`]); waits for the Proposal.
    pub fn accept(&mut self, local_ip: IpAddr, now: Timestamp) -> ConnId {
        self.now = self.now.max(now);
        let gids = self.conn_gids(local_ip);
        self.new_conn(
            Role::Server,
            Phase::AwaitProposal {
                deadline: now + CLC_WAIT_TIME,
            },
            gids,
        )
    }

    /// How the connection stands.
    pub fn status(&self, id: ConnId) -> Option<ConnStatus> {
        let c = self.conns.get(id)?.as_ref()?;
        Some(match &c.phase {
            Phase::Smc => ConnStatus::Smc,
            Phase::Done(s) => s.clone(),
            _ => ConnStatus::Handshaking,
        })
    }

    /// Bytes to send on the connection's TCP socket (CLC messages).
    pub fn clc_output(&mut self, id: ConnId) -> Vec<u8> {
        self.conn(id)
            .map(|c| c.out.drain(..).collect())
            .unwrap_or_default()
    }

    fn send_clc(&mut self, id: ConnId, m: &ClcMessage) {
        if let Some(c) = self.conn(id) {
            c.out.extend(m.encode());
        }
    }

    fn finish(&mut self, id: ConnId, status: ConnStatus) {
        self.drop_handshake_resources(id);
        if let Some(c) = self.conn(id) {
            c.phase = Phase::Done(status);
        }
    }

    /// A handshake that dies before SMC was reached releases what it took: its
    /// place in the link group (a first contact's group then ends, see
    /// [`LgrState::on`]), its buffers and data path.
    fn drop_handshake_resources(&mut self, id: ConnId) {
        let lgr = self.conn(id).and_then(|c| c.lgr.take());
        if let Some(l) = lgr {
            self.detach(id, l);
        }
        if let Some(c) = self.conn(id) {
            c.link = None;
            c.move_to = None;
            c.validation = None;
            c.rmb = None;
            c.sndbuf = None;
            c.dp = None;
            c.peer_rmb = None;
            c.peer_window = None;
            c.early_cdcs.clear();
        }
    }

    /// The first link of a first contact failed, or its CONFIRM_LINK did not
    /// come in time, after the CLC exchange: read for the peer's Decline until
    /// the role's deadline, then decline (see [`SERVER_LATE_DECLINE_WAIT`]).
    /// The link group is of no more use to the connection and is let go now.
    fn late_decline(&mut self, id: ConnId) {
        let now = self.now;
        let Some(c) = self.conn(id) else { return };
        let Phase::AwaitLink { version, since } = c.phase else {
            return;
        };
        let deadline = match c.role {
            Role::Server => now + SERVER_LATE_DECLINE_WAIT,
            Role::Client => (since + CLIENT_LATE_DECLINE_WAIT).max(now + CLC_WAIT_TIME_SHORT),
        };
        c.phase = Phase::AwaitLateDecline { version, deadline };
        self.sweep_due = true;
        self.drop_handshake_resources(id);
    }

    /// No Decline from the peer by the deadline: ours goes out (TIMEOUT_CL, the
    /// code Linux sends after its CONFIRM_LINK wait), and the first bytes from
    /// the peer are still looked at for one that crossed it.
    fn send_late_decline(&mut self, id: ConnId, version: u8) {
        let code = DeclineCode::TimeoutCl;
        let d = Decline::new(version, self.cfg.system_id, code);
        self.send_clc(id, &ClcMessage::Decline(d));
        let deadline = self.now + CROSSED_DECLINE_WAIT;
        if let Some(c) = self.conn(id) {
            c.phase = Phase::LateDeclined {
                reason: code,
                deadline,
            };
        }
    }

    fn decline(&mut self, id: ConnId, version: u8, code: DeclineCode) {
        match clc_stream::decline(code) {
            HandshakeEnd::Fallback {
                reason,
                peer_diagnosis,
                send_decline,
            } => {
                if send_decline {
                    let d = Decline::new(version, self.cfg.system_id, code);
                    self.send_clc(id, &ClcMessage::Decline(d));
                }
                self.finish(
                    id,
                    ConnStatus::Fallback {
                        reason,
                        peer: peer_diagnosis,
                    },
                );
            }
            HandshakeEnd::Fail(r) => self.finish(id, ConnStatus::Failed(r)),
        }
    }

    /// Bytes received on the connection's TCP socket. Returns how many were CLC;
    /// the rest (after a fallback) is application data for the TCP stream.
    pub fn clc_input(&mut self, id: ConnId, data: &[u8], now: Timestamp) -> usize {
        self.now = now;
        // a handshake step (a connection may start sending)
        self.sweep_due = true;
        let mut used = 0;
        while used < data.len() {
            let Some(c) = self.conn(id) else { return used };
            let expected = match c.phase {
                Phase::AwaitAccept { .. } => ClcType::Accept,
                Phase::AwaitProposal { .. } => ClcType::Proposal,
                Phase::AwaitConfirm { .. } => ClcType::Confirm,
                // a late Decline may still come while the link is being confirmed
                Phase::AwaitLink { .. }
                | Phase::AwaitLateDecline { .. }
                | Phase::ClientRkey { .. }
                | Phase::ServerRkey { .. }
                | Phase::AwaitLgr { .. } => ClcType::Decline,
                // the rest of a peer Decline that began to arrive before ours
                // went out
                Phase::LateDeclined { .. } if !c.reader.is_idle() => ClcType::Decline,
                Phase::LateDeclined { reason, .. } => {
                    // The first bytes after our late Decline: a Decline of the
                    // peer's that crossed ours is consumed, never handed to
                    // the application; anything else is its data.
                    let crossed = clc_stream::decline_at_head(&data[used..]);
                    let n = crossed.as_ref().map_or(0, |(n, _)| *n);
                    let peer = crossed.map(|(_, d)| d.diagnosis);
                    self.finish(id, ConnStatus::Fallback { reason, peer });
                    return used + n;
                }
                Phase::Smc | Phase::Done(_) => return used,
            };
            let (n, msg) = c.reader.feed(&data[used..], expected);
            used += n;
            match msg {
                None => {}
                Some(Err(e)) => self.finish(id, ConnStatus::Failed(FailReason::Protocol(e))),
                Some(Ok(m)) => self.on_clc(id, m, now),
            }
            if n == 0 {
                break;
            }
        }
        used
    }

    /// The TCP connection closed or failed during the handshake.
    ///
    /// On an SMC connection the TCP connection normally closes right after the
    /// peer's close CDC (the active closer shuts it down, §5.2). If no close or
    /// abort CDC has arrived within [`PEER_GONE_GRACE`] of the TCP end, the peer
    /// is taken for dead — a user-space peer whose process died cannot send a
    /// CDC, but its kernel closes the TCP socket — and the connection is reset.
    /// Its link is then probed with a TEST_LINK at once (see
    /// [`smc_proto::link::LinkGroup::probe_link`]): a peer whose device went
    /// away takes the link with it, and an unanswered probe ends the link
    /// (and a group left without one) after `SMC_LLC_WAIT_TIME`, so that a
    /// released connection does not wait for CDCs that cannot complete.
    pub fn tcp_closed(&mut self, id: ConnId) {
        self.sweep_due = true;
        let deadline = self.now + PEER_GONE_GRACE;
        if let Some(Phase::LateDeclined { reason, .. }) = self.conn(id).map(|c| c.phase.clone()) {
            // Our Decline is out and no crossed one came: the connection is on
            // TCP, and the peer's close is the application's end of file.
            return self.finish(id, ConnStatus::Fallback { reason, peer: None });
        }
        match self.status(id) {
            Some(ConnStatus::Handshaking) => {
                self.finish(id, ConnStatus::Failed(FailReason::TcpClosed))
            }
            Some(ConnStatus::Smc) => {
                if let Some(c) = self.conn(id) {
                    c.tcp_gone_deadline.get_or_insert(deadline);
                }
            }
            _ => {}
        }
    }

    fn on_clc(&mut self, id: ConnId, m: ClcMessage, now: Timestamp) {
        if let ClcMessage::Decline(d) = &m {
            if d.out_of_sync {
                if let Some(l) = self.conn(id).and_then(|c| c.lgr) {
                    if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
                        lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, false);
                    }
                }
            }
            if let Some(Phase::LateDeclined { reason, .. }) = self.conn(id).map(|c| c.phase.clone())
            {
                // it crossed ours
                let peer = Some(d.diagnosis);
                return self.finish(id, ConnStatus::Fallback { reason, peer });
            }
            let HandshakeEnd::Fallback {
                reason,
                peer_diagnosis,
                ..
            } = clc_stream::peer_declined(d.diagnosis)
            else {
                return;
            };
            self.finish(
                id,
                ConnStatus::Fallback {
                    reason,
                    peer: peer_diagnosis,
                },
            );
            return;
        }
        let phase = self.conn(id).map(|c| c.phase.clone());
        match (phase, m) {
            (Some(Phase::AwaitAccept { proposal, .. }), ClcMessage::Accept(a)) => {
                self.client_on_accept(id, &proposal, a, now)
            }
            (Some(Phase::AwaitProposal { .. }), ClcMessage::Proposal(p)) => {
                self.server_on_proposal(id, p, now, Some(now + LGR_PENDING_WAIT))
            }
            (
                Some(Phase::AwaitConfirm {
                    version,
                    first_contact,
                    ..
                }),
                ClcMessage::Confirm(c),
            ) => self.server_on_confirm(id, version, first_contact, c, now),
            (_, m) => self.finish(
                id,
                ConnStatus::Failed(FailReason::Protocol(clc_stream::ClcReadError::Unexpected(
                    m.msg_type(),
                ))),
            ),
        }
    }

    // ------------------------------------------------------------- resources

    /// A new link group whose links use our GID `local`, with the `limits`
    /// the CLC exchange agreed, which our CONFIRM_LINK and first-contact CLC
    /// repeat.
    fn new_lgr(
        &mut self,
        role: Role,
        version: u8,
        peer_system_id: SystemId,
        peer_gid: Gid,
        local: LocalGid,
        limits: Limits,
    ) -> Result<LgrId> {
        let pd = self.dev.alloc_pd()?;
        // The first link is slot 0 (§1.7); its QP goes out in CLC.
        let psn = self.psns.next_psn();
        let first = LinkRes::new(&self.dev, &pd, &self.chan, self.max_inline, psn)?;
        let id = self.next_lgr_id;
        self.next_lgr_id = self.next_lgr_id.wrapping_add(0x100);
        let group = LinkGroup::new(LgrConfig {
            id,
            role,
            version: if version >= SMC_V2 {
                LlcVersion::V2_LE
            } else {
                LlcVersion::V1
            },
            max_links: limits.max_links,
            max_conns: limits.max_conns,
            testlink_interval: self.cfg.testlink,
        });
        let l = Lgr {
            pd,
            links: [Some(first), None, None],
            state: LgrState::Creating,
            group,
            role,
            version,
            peer_system_id,
            peer_gid,
            local,
            release: limits.release,
            tokens: BTreeMap::new(),
            rkey_queue: VecDeque::new(),
            free_bufs: Vec::new(),
            known_rkeys: std::collections::HashSet::new(),
            idle_since: None,
            rr: 0,
        };
        Ok(match self.lgrs.iter().position(Option::is_none) {
            Some(i) => {
                self.lgrs[i] = Some(l);
                i
            }
            None => {
                self.lgrs.push(Some(l));
                self.lgrs.len() - 1
            }
        })
    }

    /// One step of a link group's life cycle ([`LgrState::on`]) and its action.
    /// `MoveConnections` is the caller's (it knows which link failed).
    fn lgr_step(&mut self, l: LgrId, ev: LgrEvent) -> LgrAction {
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return LgrAction::Nothing;
        };
        let (next, action) = lg.state.on(ev);
        lg.state = next;
        match action {
            LgrAction::Nothing | LgrAction::MoveConnections => {}
            LgrAction::EstablishWaiting => {
                let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                for id in ids {
                    if matches!(
                        self.conn(id).map(|c| &c.phase),
                        Some(Phase::AwaitLink { .. })
                    ) {
                        // Both ends are past CONFIRM_LINK and count the
                        // connection established: a peer RMB we cannot ready
                        // now costs it its life (an abort CDC, which needs no
                        // rkey), as on a reused group's Confirm.
                        let slot = self.conn(id).and_then(|c| c.link);
                        let prepared = slot.is_some_and(|s| self.prepare_peer_rmb(id, s).is_ok());
                        self.established(id);
                        if !prepared {
                            self.abort_now(id);
                        }
                    }
                }
            }
            // Linux: DELETE_LINK ALL|ORDERLY, program initiated (§5.6).
            LgrAction::DeleteAll => lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, true),
            // (no link is active: nothing is sent)
            LgrAction::Abandon => lg.group.terminate(smc_wire::llc::DEL_PROG_INIT_TERM, false),
            LgrAction::KillConnections => {
                let v = lg.version;
                let ids: Vec<ConnId> = lg.tokens.values().copied().collect();
                for id in ids {
                    let phase = self.conn(id).map(|c| c.phase.kind());
                    match phase {
                        // The first-contact link never came up after the CLC
                        // exchange: the late decline, without crossing the
                        // peer's (Linux: TIMEOUT_CL after the CONFIRM_LINK wait).
                        Some(HandshakePhase::AwaitLink) => self.late_decline(id),
                        // Our CONFIRM_RKEY flow died with the group; the peer
                        // waits for our Accept / Confirm and sends nothing
                        // meanwhile, so our Decline cannot cross one.
                        Some(HandshakePhase::ClientRkey | HandshakePhase::ServerRkey) => {
                            self.decline(id, v, DeclineCode::TimeoutCl)
                        }
                        // AwaitConfirm stays: the client's Confirm may already be
                        // on its way, and a Decline now would leave it to reach
                        // our application as data. It is read (Linux reads it
                        // too, `smc_listen_work`) and declined then — a first
                        // contact has no link left to run on; a client on a
                        // reused group is established once it sent its Confirm:
                        // the Confirm establishes ours and the kill follows.
                        Some(HandshakePhase::AwaitConfirm) => {}
                        Some(HandshakePhase::Smc) => {
                            if let Some(c) = self.conn(id) {
                                c.closer.handle(CloseEvent::Kill { can_send: false });
                            }
                        }
                        _ => {}
                    }
                }
            }
            LgrAction::Free => {
                if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::take) {
                    for res in lg.links.iter().flatten() {
                        res.shut();
                    }
                }
            }
        }
        action
    }

    /// Attaches connection `id` to group `l` on link `slot`: RMB and send buffer
    /// from the group's pool or its PD.
    fn attach(&mut self, id: ConnId, l: LgrId, slot: usize) -> Result<()> {
        let rmb_len = RmbeSize::for_size(self.cfg.rmb_len, RmbeSize::MAX_CLASS).bytes();
        let sndbuf_len = self.cfg.sndbuf_len;
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such link group".into()))?;
        let pooled = lg
            .free_bufs
            .iter()
            .position(|(r, s)| r.len() == rmb_len && s.len() == sndbuf_len);
        let (rmb, sndbuf) = match pooled {
            // (zeroed on release, see `reap`)
            Some(i) => lg.free_bufs.swap_remove(i),
            None => (
                lg.pd
                    .alloc_mr(rmb_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
                lg.pd.alloc_mr(sndbuf_len, Access::LOCAL_WRITE)?,
            ),
        };
        let c = self
            .conns
            .get_mut(id)
            .and_then(Option::as_mut)
            .ok_or_else(|| smc_rdma::Error::InvalidArgument("no such connection".into()))?;
        lg.tokens.insert(c.token, id);
        c.lgr = Some(l);
        c.link = Some(slot);
        c.rmb = Some(rmb);
        c.sndbuf = Some(sndbuf);
        Ok(())
    }

    fn detach(&mut self, id: ConnId, l: LgrId) {
        let token = self.conns.get(id).and_then(Option::as_ref).map(|c| c.token);
        let empty = match self.lgrs.get_mut(l).and_then(Option::as_mut) {
            Some(lg) => {
                token.is_some_and(|t| lg.tokens.remove(&t).is_some()) && lg.tokens.is_empty()
            }
            None => false,
        };
        if empty {
            self.lgr_step(l, LgrEvent::LastConnGone);
        }
    }

    /// Connections per link slot of a group.
    fn link_loads(&self, l: LgrId) -> [usize; LINK_SLOTS] {
        let mut n = [0; LINK_SLOTS];
        if let Some(lg) = self.lgrs.get(l).and_then(Option::as_ref) {
            for id in lg.tokens.values() {
                let slot = self
                    .conns
                    .get(*id)
                    .and_then(Option::as_ref)
                    .and_then(|c| c.link);
                if let Some(x) = slot.and_then(|s| n.get_mut(s)) {
                    *x += 1;
                }
            }
        }
        n
    }

    /// The usable link for a connection (§6): active and connected, other than
    /// `except`, and — for a connection that already has a peer RMB (`row`) —
    /// with the peer's rkey for it on that link; the one with the fewest
    /// connections, the lowest slot among equals.
    fn pick_link(&self, l: LgrId, row: Option<usize>, except: Option<usize>) -> Option<usize> {
        let lg = self.lgrs.get(l).and_then(Option::as_ref)?;
        let loads = self.link_loads(l);
        lg.group
            .active_slots()
            .filter(|&s| Some(s) != except)
            .filter(|&s| {
                lg.links
                    .get(s)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.connected)
            })
            .filter(|&s| {
                row.is_none_or(|r| {
                    lg.group
                        .rtoken(r)
                        .is_some_and(|t| t.get(s).is_some_and(Option::is_some))
                })
            })
            .min_by_key(|&s| (loads[s], s))
    }

    /// First contact: connects the first link's QP to the peer's and starts
    /// the CONFIRM_LINK exchange (§1.7). The peer RMB of the connection is
    /// readied once the link is active ([`LgrAction::EstablishWaiting`]): a
    /// provider may reach peer memory only over a link both ends have
    /// brought to RTS (the shm device authenticates its peer then), and the
    /// client's QP reaches RTS only with the CONFIRM_LINK request. Errors are
    /// the Decline code ERR_RDYLNK (as Linux's failed `smc_ib_ready_link`).
    fn connect_first_link(
        &mut self,
        l: LgrId,
        peer: PeerPort,
        now: Timestamp,
    ) -> std::result::Result<(), DeclineCode> {
        let mtu = self
            .dev
            .query_port(1)
            .map_err(|_| DeclineCode::ErrRdyLnk)?
            .active_mtu;
        let mac = self.mac;
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .filter(|lg| !lg.group.is_terminated())
            .ok_or(DeclineCode::ErrRdyLnk)?;
        let gid = lg.local;
        let res = lg.links[0].as_mut().ok_or(DeclineCode::ErrRdyLnk)?;
        res.connect(&peer, mtu, gid.index)
            .map_err(|_| DeclineCode::ErrRdyLnk)?;
        let local = res.local_port(gid.gid, mac, mtu);
        lg.group.add_first_link(local, peer, now);
        self.lgr_step(l, LgrEvent::FirstLinkConnected);
        Ok(())
    }

    /// Readies the QP of link `slot` for the RDMA WRITEs of connection `id`
    /// into the peer's RMB element ([`QueuePair::prepare_remote`]): called when
    /// the connection's peer RMB becomes known on a connected QP — before it
    /// counts as established — and when it moves or fails over to another
    /// link, where the peer's RMB has that link's rkey. A provider that needs
    /// resources of this process to reach peer memory takes them here, where a
    /// failure costs this connection only, not at a WRITE, where it would fail
    /// the QP and every connection on it. The Decline code of a failure: MEM
    /// when this process is out of resources (Linux's code for its own memory
    /// shortage), else ERR_RTOK — the peer's RMB cannot be reached (Linux's
    /// code when the peer's rkey / address cannot be taken into its rtoken
    /// table, `smc_rtoken_add`).
    fn prepare_peer_rmb(&self, id: ConnId, slot: usize) -> std::result::Result<(), DeclineCode> {
        let c = self
            .conns
            .get(id)
            .and_then(Option::as_ref)
            .ok_or(DeclineCode::IntErr)?;
        let (Some(l), Some(peer), Some(dp)) = (c.lgr, c.peer_rmb, c.dp.as_ref()) else {
            return Err(DeclineCode::IntErr);
        };
        let lg = self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .ok_or(DeclineCode::IntErr)?;
        let (rkey, base) = lg
            .group
            .rtoken(peer.row)
            .and_then(|t| t.get(slot).copied().flatten())
            .ok_or(DeclineCode::ErrRtok)?;
        let len = dp.config().peer_rmbe_len;
        // (an address from LLC for another link is checked here, as the one
        // from CLC was by `check_peer_values`)
        let addr = base
            .checked_add(peer.offset)
            .filter(|a| a.checked_add(len as u64).is_some())
            .ok_or(DeclineCode::ErrRtok)?;
        let res = lg
            .links
            .get(slot)
            .and_then(Option::as_ref)
            .ok_or(DeclineCode::IntErr)?;
        res.qp
            .prepare_remote(rkey, addr, len)
            .map_err(|e| prepare_error_code(&e))
    }

    fn setup_datapath(&mut self, id: ConnId, peer: &AcceptConfirm) -> bool {
        let Some((l, slot)) = self.conn(id).and_then(|c| Some((c.lgr?, c.link?))) else {
            return false;
        };
        // The peer's element is at rmbe_size × (index − 1) of its RMB (§3.3);
        // the values were checked (`negotiate::check_peer_values`).
        let Some((off, peer_len)) = negotiate::peer_rmbe_range(peer) else {
            return false;
        };
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return false;
        };
        // The rkey in CLC is the peer RMB's on the link the CLC names — the
        // connection's link (§1.11): its row may already exist from CONFIRM_RKEY.
        let Ok(row) = lg.group.add_rtoken(slot, peer.rmb_rkey, peer.rmb_vaddr) else {
            return false;
        };
        let sndbuf_len = self.cfg.sndbuf_len;
        let Some(c) = self.conn(id) else {
            return false;
        };
        let Some(rmb) = c.rmb.as_ref() else {
            return false;
        };
        c.peer_rmb = Some(PeerRmb { row, offset: off });
        c.dp = Some(DataPath::new(DataPathConfig {
            sndbuf_len,
            rmbe_len: rmb.len(),
            peer_rmbe_len: peer_len,
            peer_token: peer.alert_token,
        }));
        // CDCs that overtook the CLC Confirm (see `Conn::early_cdcs`).
        let early = std::mem::take(&mut c.early_cdcs);
        for m in &early {
            self.on_cdc(id, m);
        }
        true
    }

    fn our_accept_confirm(
        &self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        eid: Option<Eid>,
        kind: AcceptConfirmKind,
    ) -> Option<AcceptConfirm> {
        let c = self.conns.get(id)?.as_ref()?;
        let lg = self.lgrs.get(c.lgr?)?.as_ref()?;
        // the connection's link is the one this message names (§6)
        let link = lg.links.get(c.link?)?.as_ref()?;
        let rmb = c.rmb.as_ref()?;
        // Linux (smc_clc.c `smcr_clc_prep_confirm_accept`): an Accept names
        // our port's MTU, a Confirm the link's path MTU, the smaller of ours
        // and the peer's.
        let mtu = match kind {
            AcceptConfirmKind::Accept => self.port_mtu,
            AcceptConfirmKind::Confirm => link.path_mtu.unwrap_or(self.port_mtu),
        };
        let v2 = version >= SMC_V2;
        // The limits the CLC exchange agreed: a server's Accept offers them,
        // a client's Confirm repeats the Accept's, which a Linux server
        // checks (smc_clc.c `smc_clc_v2x_features_confirm_check`: another
        // max_conns or max_links is declined MAXCONNERR / MAXLINKERR).
        let limits = lg.group.config();
        Some(AcceptConfirm {
            version,
            first_contact,
            peer_id: self.cfg.system_id,
            // the group's GID: Linux sends its link's (`link->gid`)
            gid: lg.local.gid,
            mac: self.mac,
            qpn: link.qp.qp_num(),
            rmb_rkey: rmb.rkey(),
            rmbe_idx: 1,
            alert_token: c.token,
            rmbe_size: RmbeSize::for_size(rmb.len(), RmbeSize::MAX_CLASS),
            qp_mtu: mtu.code(),
            rmb_vaddr: rmb.addr(),
            psn: link.psn,
            eid: if v2 {
                eid.unwrap_or_default()
            } else {
                Eid::default()
            },
            // (Linux `smc_clc_fill_fce_v2x`: the agreed release; its SMC-R
            // extension always has the v2.1 fields, zero before release 1)
            fce: (v2 && first_contact).then(|| FirstContactExt {
                v2_direct: true,
                os_type: OS_LINUX,
                release: lg.release,
                hostname: FirstContactExt::hostname_from_str(&self.cfg.hostname),
                v2x: Some(if lg.release >= smc_wire::clc::SMC_RELEASE_1 {
                    FceV2x {
                        max_conns: limits.max_conns,
                        max_links: limits.max_links,
                        feature_mask: 0,
                        vendor_opts: [0; 4],
                    }
                } else {
                    FceV2x {
                        max_conns: 0,
                        max_links: 0,
                        feature_mask: 0,
                        vendor_opts: [0; 4],
                    }
                }),
            }),
            // (Linux lists an alternate device's GID too, `smc_fill_gid_list`;
            // we have one device per endpoint)
            gid_list: (v2 && first_contact && kind == AcceptConfirmKind::Confirm)
                .then(|| vec![lg.local.gid]),
        })
    }

    // --------------------------------------------------------------- client

    fn client_on_accept(
        &mut self,
        id: ConnId,
        proposal: &Proposal,
        a: AcceptConfirm,
        now: Timestamp,
    ) {
        let agreement: ClientAgreement = match negotiate::client_check_accept(proposal, &a)
            .and_then(|x| negotiate::check_peer_values(&a).map(|()| x))
        {
            Ok(x) => x,
            Err(code) => return self.decline(id, a.version, code),
        };
        let version = agreement.version;
        // our GID for the version the server chose (one we offered)
        let Some(local) = self.conn(id).and_then(|c| c.gids.for_version(version)) else {
            return self.decline(id, version, DeclineCode::ModeUnsupp);
        };
        let peer = PeerPort {
            gid: a.gid,
            mac: a.mac,
            qpn: a.qpn,
            psn: a.psn,
            mtu: a.qp_mtu,
        };
        if a.first_contact {
            let limits = Limits {
                release: agreement.release,
                max_conns: agreement.max_conns,
                max_links: agreement.max_links,
            };
            let l = match self.new_lgr(Role::Client, version, a.peer_id, a.gid, local, limits) {
                Ok(l) => l,
                Err(_) => return self.decline(id, version, DeclineCode::Mem),
            };
            if self.attach(id, l, 0).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
            }
            if let Err(code) = self.connect_first_link(l, peer, now) {
                return self.decline(id, version, code);
            }
            match self.our_accept_confirm(
                id,
                version,
                true,
                agreement.eid,
                AcceptConfirmKind::Confirm,
            ) {
                Some(m) => self.send_clc(id, &ClcMessage::Confirm(m)),
                None => return self.decline(id, version, DeclineCode::IntErr),
            }
            if let Some(c) = self.conn(id) {
                c.phase = Phase::AwaitLink {
                    version,
                    since: now,
                };
            }
        } else {
            // Reuse: the group the server chose must be one of ours, and the
            // connection goes on the link whose peer QP the Accept names (§4.5, §6).
            let found = self.lgrs.iter().enumerate().find_map(|(i, lg)| {
                let lg = lg.as_ref()?;
                if lg.role != Role::Client
                    || !lg.state.accepts_connections()
                    || lg.group.is_terminated()
                    || lg.peer_system_id != a.peer_id
                    || lg.local != local
                {
                    return None;
                }
                let slot = lg.group.active_slots().find(|&s| {
                    lg.links
                        .get(s)
                        .and_then(Option::as_ref)
                        .is_some_and(|r| r.connected && r.peer_qpn == a.qpn && r.peer_gid == a.gid)
                })?;
                Some((i, slot))
            });
            let Some((l, slot)) = found else {
                return self.decline(id, version, DeclineCode::SyncErr);
            };
            if self.attach(id, l, slot).is_err() {
                return self.decline(id, version, DeclineCode::Mem);
            }
            if !self.setup_datapath(id, &a) {
                return self.decline(id, version, DeclineCode::ErrRtok);
            }
            // the server waits for our Confirm: a Decline now is clean
            if let Err(code) = self.prepare_peer_rmb(id, slot) {
                return self.decline(id, version, code);
            }
            let Some(confirm) = self.our_accept_confirm(
                id,
                version,
                false,
                agreement.eid,
                AcceptConfirmKind::Confirm,
            ) else {
                return self.decline(id, version, DeclineCode::IntErr);
            };
            // Announce our RMB with CONFIRM_RKEY before the Confirm (§1.11).
            if let Some(c) = self.conn(id) {
                c.phase = Phase::ClientRkey {
                    confirm: Box::new(confirm),
                };
            }
            if !self.start_rkey_flow(id, l, now) {
                self.decline(id, version, DeclineCode::ErrRegBuf);
            }
        }
    }

    /// Announces the connection's RMB with CONFIRM_RKEY (§1.11); its phase must
    /// already say what follows ([`Self::on_rkey_done`]). An RMB the peer still
    /// knows from an earlier connection needs no flow (see `known_rkeys`).
    fn start_rkey_flow(&mut self, id: ConnId, l: LgrId, now: Timestamp) -> bool {
        let Some(rkey) = self.conn(id).and_then(|c| c.rmb.as_ref()).map(|m| m.rkey()) else {
            return false;
        };
        let known = self.lgrs.get(l).and_then(Option::as_ref).is_some_and(|lg| {
            lg.links.iter().flatten().count() == 1 && lg.known_rkeys.contains(&rkey)
        });
        if known {
            self.on_rkey_done(id, true);
            return true;
        }
        match self.lgrs.get_mut(l).and_then(Option::as_mut) {
            // One local LLC flow at a time (§1.6): a busy group queues the
            // connection and pump() starts its flow when the slot frees.
            Some(lg) => lg.rkey_queue.push_back(RkeyFlow::Confirm(id)),
            None => return false,
        }
        self.retry_rkey_flows(l, now);
        true
    }

    // --------------------------------------------------------------- server

    /// `park_until`: how long the Proposal may wait for a first contact with the
    /// same peer that is still running (`None`: no waiting).
    fn server_on_proposal(
        &mut self,
        id: ConnId,
        p: Proposal,
        now: Timestamp,
        park_until: Option<Timestamp>,
    ) {
        let dversion = negotiate::decline_version(&p);
        let gids = self.conn(id).map(|c| c.gids).unwrap_or_default();
        let choice: ServerChoice = match negotiate::server_choose(&p, &self.caps(&gids)) {
            Ok(c) => c,
            Err(code) => return self.decline(id, dversion, code),
        };
        let version = choice.version;
        let Some(local) = gids.for_version(version) else {
            return self.decline(id, dversion, DeclineCode::IntErr);
        };
        // The group is the peer's by the Proposal's system id and GID, as
        // Linux keeps them (`smc_lgr_create` takes `ini->peer_systemid`,
        // `smc_link_save_peer_info` the Proposal's GID): a v2-only Proposal
        // carries an all-zero system id, every time (captures §8.4).
        let (peer_id, peer_gid) = match &p.v2_ext {
            Some(ext) if version >= SMC_V2 => (p.peer_id, ext.roce_v2_gid),
            _ => (p.peer_id, p.gid),
        };
        let max_conns = self.cfg.max_conns.min(choice.max_conns);
        let max = usize::from(max_conns);
        let same_peer = |lg: &Lgr<P>| {
            lg.role == Role::Server
                && !lg.group.is_terminated()
                && lg.version == version
                && lg.peer_system_id == peer_id
                && lg.peer_gid == peer_gid
                && lg.local == local
        };
        // §6: a group with an active link to the peer's GID and room for one more.
        let reuse = self.lgrs.iter().position(|lg| {
            lg.as_ref().is_some_and(|lg| {
                same_peer(lg)
                    && lg.state.accepts_connections()
                    && lg.tokens.len() < max
                    && lg.group.active_slots().any(|s| {
                        lg.links
                            .get(s)
                            .and_then(Option::as_ref)
                            .is_some_and(|r| r.connected && r.peer_gid == peer_gid)
                    })
            })
        });
        // A first contact with this peer is under way: wait for it (Linux holds
        // `smc_server_lgr_pending` for a whole first contact, so the next
        // connection finds the new group and joins it).
        let pending = self.lgrs.iter().any(|lg| {
            lg.as_ref()
                .is_some_and(|lg| same_peer(lg) && lg.state.first_contact_pending())
        });
        if let (None, true, Some(deadline)) = (reuse, pending, park_until) {
            if now < deadline {
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::AwaitLgr {
                        proposal: Box::new(p),
                        deadline,
                    };
                }
                return;
            }
        }
        match reuse {
            Some(l) => {
                let Some(slot) = self.pick_link(l, None, None) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                if self.attach(id, l, slot).is_err() {
                    return self.decline(id, dversion, DeclineCode::Mem);
                }
                let Some(accept) = self.our_accept_confirm(
                    id,
                    version,
                    false,
                    choice.eid,
                    AcceptConfirmKind::Accept,
                ) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::ServerRkey {
                        accept: Box::new(accept),
                        version,
                    };
                }
                if !self.start_rkey_flow(id, l, now) {
                    self.decline(id, dversion, DeclineCode::ErrRegBuf);
                }
            }
            None => {
                // One link per group: we cannot add a second (ADD_LINK is not
                // negotiated), so we offer max_links 1, as a Linux server
                // with `smcr_max_links_per_lgr` 1 does; a Linux client then
                // waits for no ADD_LINK after CONFIRM_LINK (af_smc.c
                // `smcr_clnt_conf_first_link` waits SMC_LLC_WAIT_TIME for
                // one when max_links > 1), and a Linux server with max_links
                // 1 sends none either (smc_llc.c `smc_llc_srv_add_link`).
                let limits = Limits {
                    release: choice.release,
                    max_conns,
                    max_links: 1,
                };
                let l = match self.new_lgr(Role::Server, version, peer_id, peer_gid, local, limits)
                {
                    Ok(l) => l,
                    Err(_) => return self.decline(id, dversion, DeclineCode::Mem),
                };
                if self.attach(id, l, 0).is_err() {
                    return self.decline(id, dversion, DeclineCode::Mem);
                }
                let Some(accept) = self.our_accept_confirm(
                    id,
                    version,
                    true,
                    choice.eid,
                    AcceptConfirmKind::Accept,
                ) else {
                    return self.decline(id, dversion, DeclineCode::IntErr);
                };
                self.send_clc(id, &ClcMessage::Accept(accept));
                if let Some(c) = self.conn(id) {
                    c.phase = Phase::AwaitConfirm {
                        version,
                        first_contact: true,
                        deadline: now + CLC_WAIT_TIME,
                    };
                }
            }
        }
    }

    fn server_on_confirm(
        &mut self,
        id: ConnId,
        version: u8,
        first_contact: bool,
        c: AcceptConfirm,
        now: Timestamp,
    ) {
        if let Err(code) = negotiate::check_peer_values(&c) {
            return self.decline(id, version, code);
        }
        if first_contact {
            // what our Accept said (rebuilt from the group) against the Confirm
            let ours = self.our_accept_confirm(id, version, true, None, AcceptConfirmKind::Accept);
            if let Some(Err(code)) = ours.map(|a| negotiate::server_check_confirm(&a, &c)) {
                return self.decline(id, version, code);
            }
        }
        let lgr_alive = self.conn(id).and_then(|x| x.lgr).is_some_and(|l| {
            self.lgrs
                .get(l)
                .and_then(Option::as_ref)
                .is_some_and(|lg| !lg.group.is_terminated())
        });
        if first_contact && !lgr_alive {
            // the group died while the Confirm was on its way: no link to ready
            return self.decline(id, version, DeclineCode::ErrRdyLnk);
        }
        if !self.setup_datapath(id, &c) {
            return self.decline(id, version, DeclineCode::ErrRtok);
        }
        if first_contact {
            let Some(l) = self.conn(id).and_then(|x| x.lgr) else {
                return self.decline(id, version, DeclineCode::IntErr);
            };
            // (the group keeps the Proposal's system id: see `server_on_proposal`)
            let peer = PeerPort {
                gid: c.gid,
                mac: c.mac,
                qpn: c.qpn,
                psn: c.psn,
                mtu: c.qp_mtu,
            };
            // (the client waits for CONFIRM_LINK or our Decline)
            if let Err(code) = self.connect_first_link(l, peer, now) {
                return self.decline(id, version, code);
            }
            if let Some(x) = self.conn(id) {
                x.phase = Phase::AwaitLink {
                    version,
                    since: now,
                };
            }
        } else {
            // A reused group's client counts itself established once its
            // Confirm went out: a Decline now would leave it an SMC connection
            // whose peer is gone. A peer RMB we cannot ready costs this
            // connection its life instead: established, and aborted at once
            // (the abort CDC needs no rkey), so the client sees a reset.
            // (a group that died meanwhile kills the connection anyway)
            let slot = self.conn(id).and_then(|x| x.link);
            let prepared = !lgr_alive || slot.is_some_and(|s| self.prepare_peer_rmb(id, s).is_ok());
            self.established(id);
            if !prepared {
                self.abort_now(id);
            }
        }
    }

    /// Kills an established connection of ours with an abort CDC to the peer
    /// (which needs no rkey: it can go whatever became of the peer's RMB).
    fn abort_now(&mut self, id: ConnId) {
        self.mark_tx(id);
        if let Some(c) = self.conn(id) {
            let o = c.closer.handle(CloseEvent::Kill { can_send: true });
            if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                dp.set_close_flags(f);
            }
        }
    }

    fn established(&mut self, id: ConnId) {
        // The link group may have died between the Accept and the Confirm (a
        // reused group losing its link): the connection is born dead.
        let lgr_dead = self.conn(id).and_then(|c| c.lgr).is_none_or(|l| {
            self.lgrs
                .get(l)
                .and_then(Option::as_ref)
                .is_none_or(|lg| lg.group.is_terminated())
        });
        if let Some(c) = self.conn(id) {
            c.phase = Phase::Smc;
            c.closer.handle(CloseEvent::Established);
            if lgr_dead {
                c.closer.handle(CloseEvent::Kill { can_send: false });
            }
        }
    }

    // ------------------------------------------------------------ progress

    /// Does everything due at `now`: CLC timeouts, LLC traffic, completions,
    /// received CDCs, data and cursor updates, keepalives, link failover.
    /// Connection timers (handshake, close and peer-gone deadlines) and the
    /// freeing of finished connections are looked at by the pumps that walk
    /// every connection: at least one per millisecond of
    /// `now`, and the next one after a link, handshake or close event.
    pub fn pump(&mut self, now: Timestamp) -> Result<()> {
        self.now = now;
        while let Some(ev) = self.dev.poll_async_event() {
            self.on_async_event(ev);
        }
        // Whether this pump walks every connection: to flush it (see
        // `flush_tx`), for its timers, and to free it once finished. Every
        // FLUSH_SWEEP_EVERY, or sooner after an event that calls for it
        // (`sweep_due`); otherwise a message's cost would grow with the
        // number of idle connections. (Events of this pump that call for a
        // sweep set `sweep_due` again, for the next one.)
        let sweep = std::mem::take(&mut self.sweep_due) || now >= self.next_sweep;
        if sweep {
            self.next_sweep = now + FLUSH_SWEEP_EVERY;
        }
        for id in 0..if sweep { self.conns.len() } else { 0 } {
            let due = match self
                .conns
                .get(id)
                .and_then(Option::as_ref)
                .map(|c| &c.phase)
            {
                Some(Phase::AwaitAccept { deadline, .. })
                | Some(Phase::AwaitProposal { deadline })
                | Some(Phase::AwaitConfirm { deadline, .. }) => now >= *deadline,
                _ => false,
            };
            if due {
                self.sweep_due = true;
                self.finish(id, ConnStatus::Failed(FailReason::Timeout));
            }
            match self
                .conns
                .get(id)
                .and_then(Option::as_ref)
                .map(|c| &c.phase)
            {
                Some(&Phase::AwaitLateDecline { version, deadline }) if now >= deadline => {
                    self.sweep_due = true;
                    self.send_late_decline(id, version);
                }
                Some(&Phase::LateDeclined { reason, deadline }) if now >= deadline => {
                    self.sweep_due = true;
                    self.finish(id, ConnStatus::Fallback { reason, peer: None });
                }
                _ => {}
            }
            if matches!(
                self.conns
                    .get(id)
                    .and_then(Option::as_ref)
                    .map(|c| &c.phase),
                Some(Phase::AwaitLgr { .. })
            ) {
                self.retry_parked(id, now);
            }
            if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
                if c.tcp_gone_deadline.is_some_and(|d| now >= d) {
                    self.sweep_due = true;
                    c.tcp_gone_deadline = None;
                    if !c.closer.rx_flags().any_close() {
                        // treated like an abort from the peer: ECONNRESET
                        let o = c.closer.handle(CloseEvent::Peer(CloseFlags {
                            done_writing: false,
                            closed: false,
                            abort: true,
                        }));
                        if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                            dp.set_close_flags(f);
                        }
                        // Its link may have died with it, silently (a peer
                        // whose device went away sends no DELETE_LINK): then
                        // our CDCs on it never complete where the transport
                        // retries forever (rxe at retry count 7), and the
                        // connection, released, would wait for them until
                        // the next keepalive. Probe the link now: unanswered,
                        // it goes down after SMC_LLC_WAIT_TIME and, as the
                        // last link, ends the group (Linux `smcr_link_down`).
                        if let (Some(l), Some(slot)) = (c.lgr, c.link) {
                            if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
                                lg.group.probe_link(slot, now);
                            }
                        }
                    }
                }
                if c.close_deadline.is_some_and(|d| now >= d) {
                    self.sweep_due = true;
                    c.close_deadline = None;
                    if let Some(dp) = c.dp.as_mut() {
                        dp.discard_unsent();
                    }
                }
            }
        }
        for l in 0..self.lgrs.len() {
            if self.lgrs.get(l).and_then(Option::as_ref).is_none() {
                continue;
            }
            let idle_timeout = self.cfg.lgr_idle_timeout;
            let mut idle_expired = false;
            if let Some(lg) = self.lgrs[l].as_mut() {
                lg.group.on_timeout(now);
                if lg.tokens.is_empty() && lg.state == LgrState::Active {
                    let since = *lg.idle_since.get_or_insert(now);
                    idle_expired = now >= since + idle_timeout;
                } else {
                    lg.idle_since = None;
                }
            }
            if idle_expired {
                self.lgr_step(l, LgrEvent::IdleExpired);
            }
            self.retry_rkey_flows(l, now);
            self.pump_lgr(l, now, sweep)?;
        }
        if sweep {
            self.reap();
        }
        Ok(())
    }

    /// A device event: a QP or the port failed — link down at once (§7.1) rather
    /// than at the next send or keepalive. A port coming back changes nothing:
    /// re-adding links (§7.4) needs ADD_LINK.
    fn on_async_event(&mut self, ev: AsyncEvent) {
        if let Ok(p) = self.dev.query_port(1) {
            self.port_mtu = p.active_mtu;
        }
        for lg in self.lgrs.iter_mut().flatten() {
            for slot in 0..LINK_SLOTS {
                let Some(res) = lg.links[slot].as_ref() else {
                    continue;
                };
                let hit = match ev {
                    AsyncEvent::QpFatal { qp_num } => res.qp.qp_num() == qp_num,
                    // one device, all links on port 1
                    AsyncEvent::PortError { .. } | AsyncEvent::DeviceFatal => true,
                    AsyncEvent::PortActive { .. } => false,
                };
                if hit {
                    lg.group.on_link_failure(slot);
                }
            }
        }
    }

    /// A Proposal waiting for a first contact with the same peer
    /// ([`HandshakePhase::AwaitLgr`]) is decided again: it joins the group once
    /// that is usable, waits on while the first contact runs, and makes its own
    /// first contact when that failed or the wait is over.
    fn retry_parked(&mut self, id: ConnId, now: Timestamp) {
        let Some(Phase::AwaitLgr { proposal, deadline }) = self.conn(id).map(|c| c.phase.clone())
        else {
            return;
        };
        self.server_on_proposal(id, *proposal, now, Some(deadline));
    }

    fn pump_lgr(&mut self, l: LgrId, now: Timestamp, sweep: bool) -> Result<()> {
        self.drain_lgr(l, now)?;
        for slot in 0..LINK_SLOTS {
            // (pumps run in every waiting loop: skip empty slots cheaply)
            let present = self
                .lgrs
                .get(l)
                .and_then(Option::as_ref)
                .is_some_and(|lg| lg.links[slot].is_some());
            if !present {
                continue;
            }
            self.poll_recv(l, slot, now)?;
            self.poll_send(l, slot)?;
        }
        self.drain_lgr(l, now)?;
        self.flush_tx(l, sweep)?;
        // a link that failed while sending is dealt with now, not next time
        self.drain_lgr(l, now)
    }

    /// A provider error while posting on link `slot`: a failed QP takes the link
    /// down (§7.1: "failure to post a send"); anything else is the caller's.
    fn link_error(&mut self, l: LgrId, slot: usize, e: smc_rdma::Error) -> Result<()> {
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return Ok(());
        };
        let failed = lg
            .links
            .get(slot)
            .and_then(Option::as_ref)
            .is_none_or(LinkRes::failed);
        if !failed {
            return Err(e);
        }
        lg.group.on_link_failure(slot);
        Ok(())
    }

    fn drain_lgr(&mut self, l: LgrId, now: Timestamp) -> Result<()> {
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let Some(o) = lg.group.poll_output() else {
                return Ok(());
            };
            if !matches!(o, LgrOutput::SendLlc { .. }) {
                // links and rkeys change what connections can send
                self.sweep_due = true;
            }
            match o {
                LgrOutput::SendLlc { slot, msg } => {
                    // LLC responses on the link of the request, the rest as
                    // smc-proto chose (§9); a link already released sends nothing.
                    let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                        continue;
                    };
                    let bytes = msg.encode();
                    self.llc_sent += 1;
                    if let Err(e) = res.post(WrKind::Llc, &bytes) {
                        self.link_error(l, slot, e)?;
                    }
                }
                LgrOutput::LinkActive { .. } => {
                    self.lgr_step(l, LgrEvent::LinkActive);
                }
                LgrOutput::LinkDown { slot, .. } => self.on_link_down(l, slot, now)?,
                LgrOutput::Terminated { .. } => {
                    self.lgr_step(l, LgrEvent::Terminated);
                }
                LgrOutput::RkeyFlowDone { tag, .. } if tag & DELETE_TAG != 0 => {}
                LgrOutput::RkeyFlowDone { tag, ok } => self.on_rkey_done(tag as ConnId, ok),
            }
        }
    }

    /// Link `slot` of group `l` went down (§7). What it still completed or
    /// received counts; then its connections move to a usable link (§7.2) — or,
    /// with none left, stay to be killed when the group terminates (§7.3) — and
    /// its QP is stopped and its slot freed.
    fn on_link_down(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        self.sweep_due = true;
        let usable_left = self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .is_some_and(|lg| lg.group.usable_links() > 0);
        self.poll_send(l, slot)?;
        self.poll_recv(l, slot, now)?;
        if self.lgr_step(l, LgrEvent::LinkDown { usable_left }) == LgrAction::MoveConnections {
            let ids: Vec<ConnId> = self
                .lgrs
                .get(l)
                .and_then(Option::as_ref)
                .map(|lg| lg.tokens.values().copied().collect())
                .unwrap_or_default();
            for id in ids {
                let Some(c) = self.conn(id) else { continue };
                if c.move_to == Some(slot) {
                    c.move_to = None;
                }
                if c.link != Some(slot) {
                    continue;
                }
                let row = c.peer_rmb.map(|p| p.row);
                match self.pick_link(l, row, Some(slot)) {
                    Some(to) => self.failover(id, to),
                    // No link has the peer's rkey for this RMB: it cannot be
                    // written any more. Abort; the abort CDC needs no rkey and
                    // goes out whatever the close state (a close CDC it may have
                    // owed could not go out either).
                    None => {
                        let to = self.pick_link(l, None, Some(slot));
                        if let Some(c) = self.conn(id) {
                            c.link = to;
                            c.closer.handle(CloseEvent::Kill { can_send: true });
                            if let Some(dp) = c.dp.as_mut() {
                                dp.failover_rewind();
                                dp.set_close_flags(CloseFlags {
                                    done_writing: false,
                                    closed: false,
                                    abort: true,
                                });
                            }
                        }
                    }
                }
            }
        }
        if let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) {
            if let Some(res) = lg.links.get_mut(slot).and_then(Option::take) {
                res.shut();
            }
            lg.group.clear_link(slot);
        }
        Ok(())
    }

    /// Moves connection `id` to link `to` because its link failed (§7.2): an
    /// established connection rewinds its sender and sends the failover
    /// validation CDC first; a handshake in progress is just re-pointed.
    fn failover(&mut self, id: ConnId, to: usize) {
        // the peer's RMB has the new link's rkey there: ready it first
        let smc = matches!(self.conn(id).map(|c| &c.phase), Some(Phase::Smc));
        let prepared = !smc || self.prepare_peer_rmb(id, to).is_ok();
        let Some(c) = self.conn(id) else { return };
        c.link = Some(to);
        c.move_to = None;
        if smc {
            if let Some(dp) = c.dp.as_mut() {
                // Written directly and not confirmed: not in the send buffer,
                // so it cannot be replayed; or the new link cannot reach the
                // peer's RMB. Abort this connection (only) rather than
                // deliver garbage or fail the new link's QP.
                if dp.replay_from() < c.direct_sent || !prepared {
                    // (a direct write: a group that had one link when it was
                    // written; see `write_direct`)
                    c.closer.handle(CloseEvent::Kill { can_send: true });
                    dp.failover_rewind();
                    dp.set_close_flags(CloseFlags {
                        done_writing: false,
                        closed: false,
                        abort: true,
                    });
                    return;
                }
                c.validation = Some(dp.failover_rewind());
            }
        }
    }

    fn on_rkey_done(&mut self, id: ConnId, ok: bool) {
        let phase = self.conn(id).map(|c| c.phase.clone());
        match phase {
            Some(Phase::ClientRkey { confirm }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Confirm(*confirm));
                    self.established(id);
                } else {
                    self.decline(id, confirm.version, DeclineCode::ErrRegBuf);
                }
            }
            Some(Phase::ServerRkey { accept, version }) => {
                if ok {
                    self.send_clc(id, &ClcMessage::Accept(*accept));
                    let deadline = self.now + CLC_WAIT_TIME;
                    if let Some(c) = self.conn(id) {
                        c.phase = Phase::AwaitConfirm {
                            version,
                            first_contact: false,
                            deadline,
                        };
                    }
                } else {
                    self.decline(id, version, DeclineCode::ErrRegBuf);
                }
            }
            _ => {}
        }
    }

    /// Receive completions of link `slot`: LLC to the link group (as arrived on
    /// that link), CDCs to the connection of their token, whatever link they
    /// came on (§9).
    fn poll_recv(&mut self, l: LgrId, slot: usize, now: Timestamp) -> Result<()> {
        // one receive buffer's bytes (a CDC or LLC message), copied out before
        // the buffer is posted again
        let mut msg = std::mem::take(&mut self.scratch_msg);
        msg.resize(RECV_SLOT_LEN, 0);
        let r = self.poll_recv_with(l, slot, now, &mut msg);
        self.scratch_msg = msg;
        r
    }

    fn poll_recv_with(
        &mut self,
        l: LgrId,
        slot: usize,
        now: Timestamp,
        msg: &mut [u8],
    ) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 16];
        loop {
            let Some(res) = self
                .lgrs
                .get_mut(l)
                .and_then(Option::as_mut)
                .and_then(|lg| lg.links.get_mut(slot))
                .and_then(Option::as_mut)
            else {
                return Ok(());
            };
            let n = res.rcq.poll(&mut wcs)?;
            self.completions += n as u64;
            for wc in wcs.iter().take(n) {
                let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                    return Ok(());
                };
                let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                    return Ok(());
                };
                if wc.status != WcStatus::Success {
                    if wc.status != WcStatus::WrFlushError {
                        lg.group.on_link_failure(slot);
                    }
                    continue;
                }
                let at = wc.wr_id as usize * RECV_SLOT_LEN;
                let buf = &mut msg[..(wc.byte_len as usize).min(RECV_SLOT_LEN)];
                res.recv.read_at(at, buf)?;
                let reposted = res.recv.sge(at, RECV_SLOT_LEN as u32).and_then(|sge| {
                    res.qp.post_recv(&RecvWr {
                        wr_id: wc.wr_id,
                        sges: &[sge],
                    })
                });
                lg.group.on_rx_activity(slot, now);
                match WrMessage::decode(buf) {
                    Ok(WrMessage::Llc(m)) => lg.group.on_llc(slot, m, now),
                    Ok(WrMessage::Cdc(c)) => {
                        // The CDC carries the receiver's alert token (§2.1).
                        match lg.tokens.get(&c.token) {
                            Some(&id) => self.on_cdc(id, &c),
                            None => lg.group.dropped += 1,
                        }
                    }
                    Err(_) => lg.group.dropped += 1,
                }
                if let Err(e) = reposted {
                    self.link_error(l, slot, e)?;
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    fn on_cdc(&mut self, id: ConnId, m: &CdcMessage) {
        self.mark_tx(id);
        let Some(c) = self.conn(id) else { return };
        let Some(dp) = c.dp.as_mut() else {
            if matches!(
                c.phase,
                Phase::ServerRkey { .. } | Phase::AwaitConfirm { .. }
            ) {
                if c.early_cdcs.len() >= EARLY_CDC_MAX {
                    c.early_cdcs.pop_front();
                }
                c.early_cdcs.push_back(*m);
            }
            return;
        };
        let r = dp.on_cdc(m);
        // Keep the urgent byte apart at once: normal reads skip it and its RMB
        // space is then reused, while recv(MSG_OOB) may come later (TCP keeps it).
        if let (Some(off), Some(rmb)) = (dp.urgent_offset(), c.rmb.as_ref()) {
            let mut b = [0u8; 1];
            if rmb.read_at(off, &mut b).is_ok() {
                c.oob = Some(b[0]);
                dp.urgent_taken();
            }
        }
        match r {
            Ok(r) if r.close.any() => {
                let o = c.closer.handle(CloseEvent::Peer(r.close));
                if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                    dp.set_close_flags(f);
                }
            }
            Ok(_) => {}
            Err(v) => {
                // A broken peer, or loss shown by a failover validation (§2.4):
                // abort, with a CDC that says so.
                c.violation = Some(v);
                let o = c.closer.handle(CloseEvent::Kill { can_send: true });
                if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                    dp.set_close_flags(f);
                }
            }
        }
    }

    /// Send completions of link `slot`. A CDC's completion counts only while its
    /// connection is still on that link: after a failover the connection has
    /// rewound past everything the old link had in flight.
    fn poll_send(&mut self, l: LgrId, slot: usize) -> Result<()> {
        let mut wcs = [WorkCompletion::default(); 16];
        loop {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(());
            };
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                return Ok(());
            };
            let n = res.scq.poll(&mut wcs)?;
            self.completions += n as u64;
            // CDCs whose send completed (at most one per completion)
            let mut done = [(0 as ConnId, 0u16); 16];
            let mut ndone = 0;
            let mut failed = false;
            for wc in wcs.iter().take(n) {
                let kind = res.complete(wc.wr_id);
                if kind.is_some() {
                    res.sends_in_flight = res.sends_in_flight.saturating_sub(1);
                }
                if wc.status != WcStatus::Success {
                    failed = true;
                    continue;
                }
                if let (Some(WrKind::Cdc(id, seq)), Some(d)) = (kind, done.get_mut(ndone)) {
                    *d = (id, seq);
                    ndone += 1;
                }
            }
            if failed {
                lg.group.on_link_failure(slot);
            }
            for &(id, seq) in &done[..ndone] {
                self.mark_tx(id);
                if let Some(c) = self.conn(id) {
                    if c.link != Some(slot) {
                        continue;
                    }
                    if let Some(Err(v)) = c.dp.as_mut().map(|dp| dp.on_cdc_sent(seq)) {
                        c.violation = Some(v);
                    }
                }
            }
            if n < wcs.len() {
                return Ok(());
            }
        }
    }

    /// Posts what the group's connections have to send, each on its own link.
    fn flush_tx(&mut self, l: LgrId, sweep: bool) -> Result<()> {
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return Ok(());
        };
        if lg.group.usable_links() == 0 {
            return Ok(());
        }
        // Only the connections marked as maybe having something to send (an
        // application call, a CDC in either direction, a timer: `mark_tx`)
        // are flushed, so that a message's cost does not grow with the number
        // of idle connections; all of them after link and handshake events
        // (`sweep_due`) and every FLUSH_SWEEP_EVERY regardless. Round robin,
        // a few batches per connection per pass, so that one busy connection
        // cannot take every send slot of its link.
        let mut ids = std::mem::take(&mut self.scratch_ids);
        ids.clear();
        // The marks are taken out: flushing re-marks a connection that still
        // has something to send, into a fresh list. Marks of other groups go
        // back after.
        // (the list swapped in is a kept spare, so that marking allocates nothing)
        let spare = std::mem::take(&mut self.scratch_marked);
        let mut marked = std::mem::replace(&mut self.tx_dirty, spare);
        if sweep {
            ids.extend(lg.tokens.values().copied());
        }
        // this group's marked connections are flushed now (once each: a list
        // can hold an id twice after a flush outside this pass); the others'
        // marks go back
        marked.retain(
            |&id| match self.conns.get_mut(id).and_then(Option::as_mut) {
                Some(c) if c.tx_dirty && c.lgr == Some(l) => {
                    c.tx_dirty = false;
                    if !sweep {
                        ids.push(id);
                    }
                    false
                }
                Some(c) => c.tx_dirty,
                None => false,
            },
        );
        if !ids.is_empty() {
            lg.rr = (lg.rr + 1) % ids.len();
            ids.rotate_left(lg.rr);
        }
        let mut r = Ok(());
        for &id in &ids {
            r = self.flush_conn(l, id);
            if r.is_err() {
                break;
            }
        }
        self.scratch_ids = ids;
        self.tx_dirty.extend_from_slice(&marked);
        marked.clear();
        self.scratch_marked = marked;
        r
    }

    /// Connection `id` may have something to send: flush it at the next pump.
    fn mark_tx(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
            if !c.tx_dirty {
                c.tx_dirty = true;
                self.tx_dirty.push(id);
            }
        }
    }

    /// Posts what connection `id` of group `l` has to send: a few batches
    /// (WRITEs and their CDC), as the send slots of its link allow.
    fn flush_conn(&mut self, l: LgrId, id: ConnId) -> Result<()> {
        self.conn_flushes += 1;
        if let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) {
            c.tx_dirty = false;
        }
        // clean only when the data path said it has nothing to send
        let clean = self.flush_conn_batches(l, id);
        if !matches!(clean, Ok(true)) {
            self.mark_tx(id);
        }
        clean.map(|_| ())
    }

    /// [`Self::flush_conn`]'s batches; `Ok(true)` when nothing is left to send.
    fn flush_conn_batches(&mut self, l: LgrId, id: ConnId) -> Result<bool> {
        for _ in 0..4 {
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return Ok(true);
            };
            let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
                return Ok(true);
            };
            if !matches!(c.phase, Phase::Smc) {
                break;
            }
            // A requested move happens once nothing of the connection is in
            // flight on the old link (see the module documentation).
            if let Some(to) = c.move_to {
                let quiet = c.validation.is_none()
                    && c.dp.as_ref().is_none_or(|dp| dp.cdcs_in_flight() == 0);
                if !quiet {
                    break;
                }
                c.link = Some(to);
                c.move_to = None;
            }
            let Some(slot) = c.link else { break };
            let usable = lg
                .group
                .link(slot)
                .is_some_and(|k| k.state == LinkState::Active);
            let Some(res) = lg.links.get_mut(slot).and_then(Option::as_mut) else {
                break;
            };
            if !usable || res.sends_in_flight >= MAX_SENDS {
                break;
            }
            // After a failover the validation CDC goes first (§2.4).
            if let Some(v) = c.validation.take() {
                if let Err(e) = res.post(WrKind::Validation, &v.encode()) {
                    self.link_error(l, slot, e)?;
                    break;
                }
                continue;
            }
            let (Some(dp), Some(peer), Some(sndbuf)) =
                (c.dp.as_mut(), c.peer_rmb, c.sndbuf.as_ref())
            else {
                break;
            };
            // the peer RMB's rkey and address on this link (§3.2 step 4);
            // without one only a CDC can go (nothing left to write)
            let rtoken = lg
                .group
                .rtoken(peer.row)
                .and_then(|t| t.get(slot).copied().flatten());
            if rtoken.is_none() && dp.unsent() > 0 {
                break;
            }
            let (rkey, base) = rtoken.unwrap_or_default();
            let Some(batch) = dp.poll_tx() else {
                return Ok(true);
            };
            let mut posted = Ok(());
            for w in &batch.writes {
                // the send-buffer pieces (one, or two where it wraps)
                let sge = |&(off, len): &(usize, usize)| sndbuf.sge(off, len as u32);
                let (one, two);
                let sges: &[smc_rdma::Sge] = match w.src.as_slice() {
                    [a] => {
                        one = [sge(a)?];
                        &one
                    }
                    [a, b] => {
                        two = [sge(a)?, sge(b)?];
                        &two
                    }
                    _ => &[],
                };
                let addr = base + peer.offset + w.peer_offset as u64;
                posted = res.post_write(sges, rkey, addr);
                if posted.is_err() {
                    break;
                }
            }
            if posted.is_ok() {
                posted = res.post(WrKind::Cdc(id, batch.cdc.seqno), &batch.cdc.encode());
            }
            // A batch that did not go out stays accounted as in flight: the
            // link is down, and the failover rewind sends it again.
            if let Err(e) = posted {
                self.link_error(l, slot, e)?;
                break;
            }
        }
        Ok(false)
    }

    /// Sends what connection `id` has to send now (data written into the send
    /// buffer, a due consumer-cursor update) without a whole [`Self::pump`]:
    /// the cheap follow-up of a read or write.
    pub fn flush(&mut self, id: ConnId) -> Result<()> {
        let Some(l) = self
            .conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.lgr)
        else {
            return Ok(());
        };
        if self
            .lgrs
            .get(l)
            .and_then(Option::as_ref)
            .is_none_or(|lg| lg.group.usable_links() == 0)
        {
            return Ok(());
        }
        self.flush_conn(l, id)?;
        self.drain_lgr(l, self.now)
    }

    fn retry_rkey_flows(&mut self, l: LgrId, now: Timestamp) {
        loop {
            let Some(&flow) = self
                .lgrs
                .get(l)
                .and_then(Option::as_ref)
                .and_then(|lg| lg.rkey_queue.front())
            else {
                return;
            };
            // CONFIRM_RKEY on the connection's link, entry 0 for that link and one
            // entry per other active link (same rkey: one PD per group, see
            // `link`); DELETE_RKEY on the first usable link (§9).
            let confirm = match flow {
                RkeyFlow::Confirm(id) => Some(
                    self.conns
                        .get(id)
                        .and_then(Option::as_ref)
                        .and_then(|c| Some((c.rmb.as_ref()?, c.link?)))
                        .map(|(m, slot)| (m.rkey(), m.addr(), slot)),
                ),
                RkeyFlow::Delete(_) => None,
            };
            let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
                return;
            };
            let started = match (flow, confirm) {
                // the connection went away while waiting: drop its flow
                (RkeyFlow::Confirm(_), Some(None)) | (RkeyFlow::Confirm(_), None) => true,
                (RkeyFlow::Confirm(id), Some(Some((rkey, addr, slot)))) => {
                    let others: Vec<(usize, u32, u64)> = lg
                        .group
                        .active_slots()
                        .filter(|&s| s != slot)
                        .map(|s| (s, rkey, addr))
                        .collect();
                    lg.group
                        .start_confirm_rkey(slot, rkey, addr, &others, id as u64, now)
                }
                (RkeyFlow::Delete(rkey), _) => match lg.group.active_slots().min() {
                    Some(slot) => {
                        lg.group
                            .start_delete_rkey(slot, rkey, DELETE_TAG | u64::from(rkey), now)
                    }
                    None => false,
                },
            };
            if !started {
                return;
            }
            lg.rkey_queue.pop_front();
        }
    }

    /// Frees connections that are closed and released, and link groups that died.
    fn reap(&mut self) {
        for id in 0..self.conns.len() {
            let finished = self
                .conns
                .get(id)
                .and_then(Option::as_ref)
                .is_some_and(|c| {
                    // CDCs of a dead link group never complete; do not wait for them.
                    let lgr_dead = c.lgr.is_none_or(|l| {
                        self.lgrs
                            .get(l)
                            .and_then(Option::as_ref)
                            .is_none_or(|lg| lg.group.is_terminated())
                    });
                    // Our final CDC must have gone out and completed: the peer
                    // waits for it (PEERCLOSEWAIT) and may still write until then.
                    // After a failover it is sent again on the new link.
                    c.closer.is_finished()
                        && (lgr_dead
                            || (c.validation.is_none()
                                && c.dp.as_ref().is_none_or(|dp| {
                                    dp.cdcs_in_flight() == 0
                                        && !dp.close_pending()
                                        && !dp.cdc_wanted()
                                })))
                });
            if finished {
                if let Some(l) = self.conns[id].as_ref().and_then(|c| c.lgr) {
                    self.detach(id, l);
                    // bytes the peer put into the RMB (all of it once it wrapped)
                    let used = self.conns[id]
                        .as_ref()
                        .and_then(|c| c.dp.as_ref())
                        .map_or(usize::MAX, |dp| {
                            usize::try_from(dp.totals().0).unwrap_or(usize::MAX)
                        });
                    let bufs = self.conns[id]
                        .as_mut()
                        .and_then(|c| Some((c.rmb.take()?, c.sndbuf.take()?)));
                    if let Some((rmb, _)) = &bufs {
                        // A reused RMB starts clean, as Linux zeroes released
                        // buffers: only the part that was written, so that a
                        // short connection does not pay for a large buffer.
                        zero(rmb, used.min(rmb.len()));
                    }
                    if let (Some((rmb, sndbuf)), Some(lg)) =
                        (bufs, self.lgrs.get_mut(l).and_then(Option::as_mut))
                    {
                        if !lg.group.is_terminated() {
                            if lg.links.iter().flatten().count() == 1
                                && lg.known_rkeys.len() < KNOWN_RKEYS_MAX
                            {
                                // kept known at the peer (see `known_rkeys`)
                                lg.known_rkeys.insert(rmb.rkey());
                            } else {
                                // The peer forgets this RMB (§1.11), then it is reused.
                                lg.known_rkeys.remove(&rmb.rkey());
                                lg.rkey_queue.push_back(RkeyFlow::Delete(rmb.rkey()));
                            }
                            lg.free_bufs.push((rmb, sndbuf));
                        }
                    }
                }
                self.conns[id] = None;
            }
        }
        for l in 0..self.lgrs.len() {
            let dead = self.lgrs[l]
                .as_ref()
                .is_some_and(|lg| lg.state == LgrState::Terminating && lg.tokens.is_empty());
            if dead {
                self.lgr_step(l, LgrEvent::LastConnGone);
            }
        }
    }

    // ------------------------------------------------------------ application

    fn smc_conn(&mut self, id: ConnId) -> std::result::Result<&mut Conn<P>, ConnError> {
        match self.conns.get_mut(id).and_then(Option::as_mut) {
            Some(c) if c.dp.is_some() => Ok(c),
            _ => Err(ConnError::NotConnected),
        }
    }

    fn close_error(c: &Conn<P>) -> ConnError {
        match c.closer.error() {
            Some(smc_proto::close::CloseError::Reset) => ConnError::Reset,
            Some(smc_proto::close::CloseError::Aborted) => ConnError::Aborted,
            // writing to a peer that closed: ECONNRESET, as Linux
            None if c.closer.rx_flags().any_close() && !c.closer.tx_flags().any() => {
                ConnError::Reset
            }
            None => ConnError::Closed,
        }
    }

    /// Writes as much of `data` as the send buffer takes; 0 means "would block".
    ///
    /// When nothing written earlier is still waiting and the peer has room, the
    /// bytes go out at once as inline RDMA WRITEs from `data` itself (copied at
    /// post time, §3.2: the send buffer only has to hold data that cannot be
    /// written yet), followed by their CDC: one copy instead of two. Otherwise
    /// they are copied into the send buffer and sent by [`Self::pump`].
    pub fn write(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        self.write_impl(id, data, true)
    }

    /// [`Self::write`] for a caller that would rather wait a little than copy:
    /// when the data could go straight into the peer's RMB but the peer has no
    /// room yet, nothing is written (`Ok(0)`) instead of copying it into the
    /// send buffer. A bulk sender whose peer reads as fast as it writes then
    /// copies each byte once instead of twice — with buffered writes the sender
    /// does two copies per byte to the receiver's one and sets the pace.
    pub fn write_unbuffered(
        &mut self,
        id: ConnId,
        data: &[u8],
    ) -> std::result::Result<usize, ConnError> {
        self.write_impl(id, data, false)
    }

    fn write_impl(
        &mut self,
        id: ConnId,
        data: &[u8],
        buffer: bool,
    ) -> std::result::Result<usize, ConnError> {
        match self.write_direct(id, data)? {
            Direct::Wrote(n) => Ok(n),
            Direct::NoRoom if !buffer => Ok(0),
            Direct::NoRoom | Direct::No => self.write_buffered(id, data),
        }
    }

    /// Copies into the send buffer; [`Self::pump`] sends it.
    fn write_buffered(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        let c = self.smc_conn(id)?;
        if !c.closer.can_write() {
            return Err(Self::close_error(c));
        }
        if c.write_leased {
            // the lease copies to where these bytes would go: wait for it
            c.lease_waited = true;
            return Ok(0);
        }
        let (Some(dp), Some(sndbuf)) = (c.dp.as_mut(), c.sndbuf.as_ref()) else {
            return Err(ConnError::NotConnected);
        };
        let chunks = dp.sndbuf_free_chunks(data.len());
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            if sndbuf.write_at(off, &data[n..n + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            n += len;
        }
        dp.produced(n);
        if n > 0 {
            self.mark_tx(id);
        }
        Ok(n)
    }

    /// Whether up to `want` bytes of connection `id` can go straight into the
    /// peer's RMB now, and where: the conditions of the direct path of
    /// [`Self::write`].
    /// `lessee`: asked for the commit of the connection's write lease, which
    /// other writers wait for.
    fn direct_plan(
        &mut self,
        id: ConnId,
        want: usize,
        lessee: bool,
    ) -> std::result::Result<DirectPlan, Direct> {
        let max_inline = self.max_inline as usize;
        let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
            return Err(Direct::No);
        };
        if c.write_leased && !lessee {
            c.lease_waited = true;
            return Err(Direct::NoRoom);
        }
        let (Some(l), Some(slot), Some(dp), Some(peer)) =
            (c.lgr, c.link, c.dp.as_mut(), c.peer_rmb)
        else {
            return Err(Direct::No);
        };
        if !matches!(c.phase, Phase::Smc)
            || c.move_to.is_some()
            || c.validation.is_some()
            || !c.closer.can_write()
            || dp.unsent() > 0
            || dp.urgent_pending()
            || dp.close_pending()
        {
            return Err(Direct::No);
        }
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
            return Err(Direct::No);
        };
        // A failover replays unconfirmed data from the send buffer (§7.2), which
        // a direct write bypasses: only a group with a single link writes
        // directly (see also `failover`).
        if lg.links.iter().flatten().count() != 1
            || lg
                .group
                .link(slot)
                .is_none_or(|k| k.state != LinkState::Active)
        {
            return Err(Direct::No);
        }
        let Some((rkey, base)) = lg
            .group
            .rtoken(peer.row)
            .and_then(|t| t.get(slot).copied().flatten())
        else {
            return Err(Direct::No);
        };
        let Some(res) = lg.links.get(slot).and_then(Option::as_ref) else {
            return Err(Direct::No);
        };
        if res.sends_in_flight >= MAX_SENDS {
            return Err(Direct::No);
        }
        // What fits now, if the device takes it inline. A part of a larger
        // write only when the part is large: many small direct pieces (verbs'
        // inline limit is 64 bytes) would cost more than the copy they save.
        let room = want.min(dp.sndbuf_free());
        let n = room.min(dp.peer_space());
        if room == 0 || room.min(DIRECT_PART_MIN) > max_inline {
            return Err(Direct::No);
        }
        if n == 0 || n > max_inline || (n < want && n < DIRECT_PART_MIN) {
            // only the peer's free space is short
            return Err(if n < room.min(DIRECT_PART_MIN) {
                Direct::NoRoom
            } else {
                Direct::No
            });
        }
        Ok(DirectPlan {
            l,
            slot,
            rkey,
            rmbe_addr: base + peer.offset,
            n,
            at: dp.sent_total(),
        })
    }

    /// The direct path of [`Self::write`].
    fn write_direct(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<Direct, ConnError> {
        let p = match self.direct_plan(id, data.len(), false) {
            Ok(p) => p,
            Err(d) => return Ok(d),
        };
        Ok(match self.post_direct(id, &p, Some(data))? {
            true => Direct::Wrote(p.n),
            false => Direct::No,
        })
    }

    /// Produces the `p.n` bytes of connection `id` that [`Self::direct_plan`]
    /// placed and posts them: the inline WRITEs of `data` (`None`: a lease
    /// copied them already) and their CDC. `Ok(false)`: nothing was done.
    fn post_direct(
        &mut self,
        id: ConnId,
        p: &DirectPlan,
        data: Option<&[u8]>,
    ) -> std::result::Result<bool, ConnError> {
        let (Some(c), Some(lg)) = (
            self.conns.get_mut(id).and_then(Option::as_mut),
            self.lgrs.get_mut(p.l).and_then(Option::as_mut),
        ) else {
            return Ok(false);
        };
        let (Some(dp), Some(res)) = (
            c.dp.as_mut(),
            lg.links.get_mut(p.slot).and_then(Option::as_mut),
        ) else {
            return Ok(false);
        };
        dp.produced(p.n);
        let Some(batch) = dp.poll_tx() else {
            return Err(ConnError::Aborted);
        };
        debug_assert_eq!(
            batch.writes.iter().map(|w| w.len).sum::<usize>(),
            p.n,
            "the batch writes everything produced"
        );
        c.direct_sent = dp.sent_total();
        let mut posted = Ok(());
        if let Some(data) = data {
            let mut at = 0;
            for w in &batch.writes {
                let addr = p.rmbe_addr + w.peer_offset as u64;
                posted = res.post_write_inline(&data[at..at + w.len], p.rkey, addr);
                if posted.is_err() {
                    break;
                }
                at += w.len;
            }
        }
        if posted.is_ok() {
            posted = res.post(WrKind::Cdc(id, batch.cdc.seqno), &batch.cdc.encode());
        }
        if let Err(e) = posted {
            // The link is broken and, being the only one, takes the connection
            // with it; like TCP's, this write itself succeeded.
            if self.link_error(p.l, p.slot, e).is_err() {
                return Err(ConnError::Aborted);
            }
        }
        Ok(true)
    }

    /// The direct path of [`Self::write`] with the copy left to the caller,
    /// to be made without whatever guards this endpoint (a lock): up to
    /// `data.len()` bytes are lent a window onto the peer's RMB where they
    /// would go now. Copy them with [`WriteLease::copy_from`], then announce
    /// them with [`Self::write_commit`]; nothing is announced before. Only a
    /// provider that maps the peer's memory here
    /// ([`QueuePair::remote_window`]) lends; otherwise, and whenever the
    /// direct path does not apply, this says so and [`Self::write`] is the
    /// way. One lease per connection at a time (the caller serializes its
    /// writers).
    pub fn write_lease(
        &mut self,
        id: ConnId,
        data: &[u8],
    ) -> std::result::Result<WritePlan, ConnError> {
        self.smc_conn(id)?;
        let p = match self.direct_plan(id, data.len(), false) {
            Ok(p) => p,
            Err(Direct::NoRoom) => return Ok(WritePlan::NoRoom),
            Err(_) => return Ok(WritePlan::NotDirect),
        };
        let (Some(c), Some(lg)) = (
            self.conns.get_mut(id).and_then(Option::as_mut),
            self.lgrs.get(p.l).and_then(Option::as_ref),
        ) else {
            return Ok(WritePlan::NotDirect);
        };
        let (Some(dp), Some(res)) = (c.dp.as_ref(), lg.links.get(p.slot).and_then(Option::as_ref))
        else {
            return Ok(WritePlan::NotDirect);
        };
        let win = match &c.peer_window {
            Some((slot, rkey, w)) if *slot == p.slot && *rkey == p.rkey => w.clone(),
            _ => {
                let rmbe_len = dp.config().peer_rmbe_len;
                let Some(w) = res.qp.remote_window(p.rkey, p.rmbe_addr, rmbe_len) else {
                    return Ok(WritePlan::NotDirect);
                };
                c.peer_window = Some((p.slot, p.rkey, w.clone()));
                w
            }
        };
        c.write_leased = true;
        Ok(WritePlan::Lease(WriteLease {
            win,
            chunks: dp.peer_write_chunks(p.n),
            n: p.n,
            at: p.at,
            slot: p.slot,
            rkey: p.rkey,
        }))
    }

    /// Ends a [`WriteLease`]; `copied`: [`WriteLease::copy_from`] succeeded.
    /// `Ok(true)`: its CDC is posted, the bytes are written. `Ok(false)`:
    /// not copied, or the connection changed since the lease (a link failed,
    /// ...): nothing was announced, and the bytes are to be written again
    /// with [`Self::write`] (what the lease copied stays beyond the send
    /// cursor, unseen by the peer, and is overwritten).
    pub fn write_commit(
        &mut self,
        id: ConnId,
        lease: &WriteLease,
        copied: bool,
    ) -> std::result::Result<bool, ConnError> {
        self.smc_conn(id)?.write_leased = false;
        if !copied {
            return Ok(false);
        }
        let p = match self.direct_plan(id, lease.n, true) {
            Ok(p) => p,
            Err(_) => return Ok(false),
        };
        if p.n != lease.n || p.slot != lease.slot || p.rkey != lease.rkey || p.at != lease.at {
            return Ok(false);
        }
        self.post_direct(id, &p, None)
    }

    /// Sends one urgent byte (TCP `send(MSG_OOB)`): it goes into the stream after
    /// everything written before, flagged so that the peer can fetch it out of
    /// band. `Ok(false)` if the send buffer is full or the previous urgent byte has
    /// not gone out yet (try again later).
    pub fn write_oob(&mut self, id: ConnId, byte: u8) -> std::result::Result<bool, ConnError> {
        let c = self.smc_conn(id)?;
        if c.dp.as_ref().is_some_and(DataPath::urgent_pending) {
            return Ok(false);
        }
        // through the send buffer: the byte must still be unsent to be marked
        if self.write_buffered(id, &[byte])? == 0 {
            return Ok(false);
        }
        self.mark_tx(id);
        let c = self.smc_conn(id)?;
        Ok(c.dp.as_mut().is_some_and(DataPath::mark_urgent))
    }

    /// Fetches the peer's urgent byte (TCP `recv(MSG_OOB)`), once.
    pub fn read_oob(&mut self, id: ConnId) -> std::result::Result<Option<u8>, ConnError> {
        Ok(self.smc_conn(id)?.oob.take())
    }

    /// Reads up to `max` bytes. `Ok(empty)` with [`Self::peer_done`] true is
    /// end-of-file; `Ok(empty)` otherwise means "would block".
    pub fn read(&mut self, id: ConnId, max: usize) -> std::result::Result<Vec<u8>, ConnError> {
        let mut out = vec![0u8; max.min(self.readable(id))];
        let n = self.read_into(id, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// [`Self::read_into`] with the copy left to the caller, to be made
    /// without whatever guards this endpoint (a lock): the readable bytes, up
    /// to `max`, are lent as a window onto the RMB. Copy them with
    /// [`ReadLease::copy_to`], then free their space with
    /// [`Self::read_commit`]; until then the peer cannot overwrite them. One
    /// lease per connection at a time (the caller serializes its readers).
    pub fn read_lease(
        &mut self,
        id: ConnId,
        max: usize,
    ) -> std::result::Result<ReadPlan, ConnError> {
        let Some((chunks, n)) = self.readable_now(id, max)? else {
            return Ok(ReadPlan::Empty);
        };
        let c = self.smc_conn(id)?;
        match c.rmb.as_ref().and_then(MemoryRegion::window) {
            Some(win) => {
                c.read_leased = true;
                Ok(ReadPlan::Lease(ReadLease { win, chunks, n }))
            }
            None => Ok(ReadPlan::NoWindow),
        }
    }

    /// Where the bytes a read of up to `max` bytes of connection `id` takes
    /// now are in the RMB, and how many. `None`: nothing to take — end of
    /// file, would block (an urgent byte that is next is passed: normal
    /// reads skip it), or another reader's lease has them.
    fn readable_now(
        &mut self,
        id: ConnId,
        max: usize,
    ) -> std::result::Result<Option<(RingChunks, usize)>, ConnError> {
        let c = self.smc_conn(id)?;
        if c.closer.error().is_some() && c.dp.as_ref().is_none_or(|dp| dp.readable() == 0) {
            // A peer that closed in order and then went away (its process
            // exited, taking the link) sent everything: end of file, not an
            // error, as the kernel's socket would have finished that close.
            let rx = c.closer.rx_flags();
            if (rx.done_writing || rx.closed) && !rx.abort {
                return Ok(None);
            }
            return Err(Self::close_error(c));
        }
        let Some(dp) = c.dp.as_mut().filter(|_| c.rmb.is_some()) else {
            return Err(ConnError::NotConnected);
        };
        if c.read_leased {
            // a lease has the readable bytes (they still count as readable,
            // so this is no end of file): wait for its commit
            c.lease_waited = true;
            return Ok(None);
        }
        let chunks = dp.readable_chunks(max);
        let n: usize = chunks.as_slice().iter().map(|&(_, l)| l).sum();
        if n == 0 {
            dp.consumed(0);
            return Ok(None);
        }
        Ok(Some((chunks, n)))
    }

    /// Whether a read or write of connection `id` was turned away because of
    /// a lease since the last call: its caller may be waiting, and nothing
    /// but the lease's end tells it to look again.
    pub fn take_lease_waited(&mut self, id: ConnId) -> bool {
        self.conns
            .get_mut(id)
            .and_then(Option::as_mut)
            .is_some_and(|c| std::mem::take(&mut c.lease_waited))
    }

    /// Ends a [`ReadLease`] of which `n` bytes were copied (0 if the copy
    /// failed): their space in the RMB is free (the peer learns it with the
    /// next CDC that is due).
    pub fn read_commit(&mut self, id: ConnId, n: usize) -> std::result::Result<(), ConnError> {
        let c = self.smc_conn(id)?;
        c.read_leased = false;
        let dp = c.dp.as_mut().ok_or(ConnError::NotConnected)?;
        if dp.consumed(n) > 0 {
            // (a consumer cursor update may be due)
            self.mark_tx(id);
        }
        Ok(())
    }

    /// Reads into `buf` straight from the receive buffer (one copy). `Ok(0)`
    /// with [`Self::peer_done`] true is end-of-file; `Ok(0)` otherwise means
    /// "would block" (or `buf` is empty).
    pub fn read_into(
        &mut self,
        id: ConnId,
        buf: &mut [u8],
    ) -> std::result::Result<usize, ConnError> {
        let Some((chunks, n)) = self.readable_now(id, buf.len())? else {
            return Ok(0);
        };
        let rmb = self
            .smc_conn(id)?
            .rmb
            .as_ref()
            .ok_or(ConnError::NotConnected)?;
        let mut at = 0;
        for &(off, len) in chunks.as_slice() {
            if rmb.read_at(off, &mut buf[at..at + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            at += len;
        }
        debug_assert_eq!(at, n);
        self.read_commit(id, n)?;
        Ok(n)
    }

    /// Asks every completion queue to signal the endpoint's descriptor
    /// ([`Self::notify_fd`]) at its next completion. Arm, then [`Self::pump`] once
    /// more (a completion may have come in before arming), then sleep on the
    /// descriptor: nothing is missed, and while nobody sleeps peers post without
    /// a system call.
    pub fn arm(&mut self) -> Result<()> {
        for lg in self.lgrs.iter().flatten() {
            for res in lg.links.iter().flatten() {
                res.arm()?;
            }
        }
        Ok(())
    }

    /// A descriptor that becomes readable when an armed completion queue gets a
    /// completion (the endpoint's completion channel).
    pub fn notify_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.chan.fd()
    }

    /// Consumes the notification on [`Self::notify_fd`], if any.
    pub fn take_notification(&self) -> bool {
        self.chan.try_get_event().unwrap_or(false)
    }

    /// How many times a connection was looked at for something to send (one
    /// connection each time), so far: a diagnostic of what pumps cost, which
    /// grows with the connections that had something to do, not with the
    /// idle ones.
    pub fn conn_flushes(&self) -> u64 {
        self.conn_flushes
    }

    /// Work completions processed so far: when it moves, [`Self::pump`] did
    /// something (data, cursor updates, LLC) that a waiter may care about.
    pub fn completions(&self) -> u64 {
        self.completions
    }

    /// Bytes received and not yet read.
    pub fn readable(&self, id: ConnId) -> usize {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.dp.as_ref())
            .map_or(0, DataPath::readable)
    }

    /// The peer will send nothing more (EOF once the receive buffer is drained).
    pub fn peer_done(&self, id: ConnId) -> bool {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.closer.peer_done())
    }

    /// The application is done with the connection (`close()` on the socket). An
    /// SMC connection closes (an abort if received data is left unread) and is
    /// freed once the close completes; a fallen-back, failed or unfinished one is
    /// freed at once (its TCP socket is the caller's to close).
    pub fn release(&mut self, id: ConnId) {
        // (the next pump frees the connection once it is finished)
        self.sweep_due = true;
        self.mark_tx(id);
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return;
        };
        match &c.phase {
            Phase::Smc => {
                let unread_data = c.dp.as_ref().is_some_and(|dp| dp.unread() > 0);
                self.close(id, CloseEvent::AppClose { unread_data });
            }
            _ => {
                if matches!(self.status(id), Some(ConnStatus::Handshaking)) {
                    self.finish(id, ConnStatus::Failed(FailReason::TcpClosed));
                }
                if let Some(l) = self.conns[id].as_mut().and_then(|c| c.lgr.take()) {
                    self.detach(id, l);
                }
                self.conns[id] = None;
            }
        }
    }

    /// The peer closed (or aborted) the connection, as opposed to only shutting
    /// down its write side.
    pub fn peer_closed(&self, id: ConnId) -> bool {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.closer.rx_flags().any_close())
    }

    /// `shutdown(SHUT_WR)` or `close()`. Unsent data goes out first; after
    /// `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) without room at the peer it is dropped
    /// and the close is sent anyway, as Linux does (§5.2).
    pub fn close(&mut self, id: ConnId, ev: CloseEvent) {
        self.sweep_due = true;
        self.mark_tx(id);
        let deadline = self.now + MAX_STREAM_WAIT;
        if let Some(c) = self.conn(id) {
            let o = c.closer.handle(ev);
            if let (Some(f), Some(dp)) = (o.send_cdc, c.dp.as_mut()) {
                dp.set_close_flags(f);
                if dp.close_pending() {
                    c.close_deadline = Some(deadline);
                }
            }
        }
    }

    /// Which side of the handshake a connection is.
    pub fn role(&self, id: ConnId) -> Option<Role> {
        self.conns.get(id)?.as_ref().map(|c| c.role)
    }

    /// A connection's close state.
    pub fn close_state(&self, id: ConnId) -> Option<CloseState> {
        self.conns.get(id)?.as_ref().map(|c| c.closer.state())
    }

    /// Close flags we have sent on a connection.
    pub fn sent_close_flags(&self, id: ConnId) -> Option<CloseFlags> {
        self.conns.get(id)?.as_ref().map(|c| c.closer.tx_flags())
    }

    /// Whether a closed connection has nothing left to send: its data and its
    /// close (or abort) CDC have been handed to the device, or it is gone.
    /// Until then the process must stay for them to leave — a user-space
    /// connection has no kernel to finish the close after an exit (Linux's
    /// close() waits for pending sends the same way, up to
    /// `SMC_MAX_STREAM_WAIT_TIMEOUT`, §5.2). Posted is enough: waiting for the
    /// peer's acknowledgement as well made every close cost a wake-up round
    /// trip (connection setup rate fell to a fifth); the shm device delivers
    /// what was posted even after the sender exits.
    pub fn close_sent(&self, id: ConnId) -> bool {
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return true;
        };
        if !matches!(c.phase, Phase::Smc) || c.link.is_none() {
            return true;
        }
        let Some(dp) = c.dp.as_ref() else {
            return true;
        };
        if matches!(
            c.closer.state(),
            CloseState::Closed | CloseState::ProcessAbort | CloseState::PeerAbortWait
        ) {
            return true;
        }
        !dp.close_pending() && dp.close_flags_sent().any() && dp.unsent() == 0
    }

    /// Whether a [`Self::pump`] now could find anything new on the links (a
    /// cheap look for busy-waiting callers; may say `true` spuriously). It
    /// does not cover timers or device events: a caller that stops pumping on
    /// `false` must still pump now and then.
    pub fn may_have_work(&self) -> bool {
        self.lgrs.iter().flatten().any(|lg| {
            lg.links
                .iter()
                .flatten()
                .any(|r| r.scq.may_have_work() || r.rcq.may_have_work())
        })
    }

    /// A connection's alert token (unique among the live connections of its
    /// link group; with the id it tells a connection from a later one that
    /// reuses the id).
    pub fn alert_token(&self, id: ConnId) -> Option<u32> {
        self.conns.get(id)?.as_ref().map(|c| c.token)
    }

    /// Unsent or unconfirmed bytes of ours on a connection.
    pub fn unacked(&self, id: ConnId) -> usize {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.dp.as_ref())
            .map_or(0, DataPath::unacked)
    }

    /// Live link groups.
    pub fn link_groups(&self) -> usize {
        self.lgrs.iter().flatten().count()
    }

    /// Connections of the link group a connection uses.
    pub fn link_group_of(&self, id: ConnId) -> Option<LgrId> {
        self.conns.get(id)?.as_ref()?.lgr
    }

    /// Connections still allocated (not yet reaped).
    pub fn connections(&self) -> usize {
        self.conns.iter().flatten().count()
    }

    /// LLC messages posted so far (requests and responses, every group).
    pub fn llc_sent(&self) -> u64 {
        self.llc_sent
    }

    /// Peer RMBs a link group knows (its rtoken table) and our released buffers
    /// it keeps for reuse.
    pub fn link_group_buffers(&self, l: LgrId) -> Option<(usize, usize)> {
        self.lgrs
            .get(l)?
            .as_ref()
            .map(|lg| (lg.group.rtoken_count(), lg.free_bufs.len()))
    }

    /// QP number of a link group's first link (lowest slot; for fault injection
    /// in tests).
    pub fn qp_num(&self, l: LgrId) -> Option<u32> {
        let lg = self.lgrs.get(l)?.as_ref()?;
        lg.links.iter().flatten().map(|r| r.qp.qp_num()).next()
    }

    /// QP number of the link in `slot` of a link group.
    pub fn link_qp_num(&self, l: LgrId, slot: usize) -> Option<u32> {
        let lg = self.lgrs.get(l)?.as_ref()?;
        lg.links.get(slot)?.as_ref().map(|r| r.qp.qp_num())
    }

    /// Slots of a link group's usable (active) links.
    pub fn usable_links(&self, l: LgrId) -> Vec<usize> {
        self.lgrs
            .get(l)
            .and_then(Option::as_ref)
            .map(|lg| lg.group.active_slots().collect())
            .unwrap_or_default()
    }

    /// A link group's life-cycle state.
    pub fn link_group_state(&self, l: LgrId) -> Option<LgrState> {
        Some(self.lgrs.get(l)?.as_ref()?.state)
    }

    /// The link (slot) a connection is assigned to.
    pub fn link_of(&self, id: ConnId) -> Option<usize> {
        self.conns.get(id)?.as_ref()?.link
    }

    /// Where a connection's handshake stands.
    pub fn handshake_phase(&self, id: ConnId) -> Option<HandshakePhase> {
        Some(self.conns.get(id)?.as_ref()?.phase.kind())
    }

    /// Moves an established connection to the usable link `slot` of its group
    /// (both links healthy; a failed link's connections move by themselves).
    /// The connection stops sending on its old link and switches once none of
    /// its CDCs is in flight there, so nothing is sent twice and nothing of the
    /// old link can overtake the new one. False if the connection is not
    /// established, is already there, or the link is not usable for it (not
    /// active, the peer's rkey for its RMB is unknown on that link, or the
    /// link's QP cannot be readied for it, `QueuePair::prepare_remote`).
    pub fn move_connection(&mut self, id: ConnId, slot: usize) -> bool {
        self.sweep_due = true;
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return false;
        };
        let (Some(l), Some(row)) = (c.lgr, c.peer_rmb.map(|p| p.row)) else {
            return false;
        };
        if !matches!(c.phase, Phase::Smc) || c.link == Some(slot) {
            return false;
        }
        let usable = self.lgrs.get(l).and_then(Option::as_ref).is_some_and(|lg| {
            lg.group.active_slots().any(|s| s == slot)
                && lg
                    .links
                    .get(slot)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.connected)
                && lg
                    .group
                    .rtoken(row)
                    .is_some_and(|t| t.get(slot).is_some_and(Option::is_some))
        });
        // The peer's RMB has that link's rkey there: ready it before the
        // move; a connection that cannot be readied on the link stays where
        // it is, on its healthy link.
        let usable = usable && self.prepare_peer_rmb(id, slot).is_ok();
        if usable {
            if let Some(c) = self.conn(id) {
                c.move_to = Some(slot);
            }
        }
        usable
    }

    /// Test and simulation only, until ADD_LINK is negotiated (§1.8): prepares a
    /// further link of an active group — a QP in the lowest free slot, in INIT
    /// with its receive buffers posted — and returns what the peer needs to know
    /// (what ADD_LINK and ADD_LINK_CONT would carry). Both ends offer, then both
    /// accept the other's offer with [`Self::extra_link_accept`]; the
    /// CONFIRM_LINK exchange then runs on the new link, and once it is active new
    /// connections may be assigned to it and failed links' connections move to it.
    ///
    /// Offer only when [`Self::extra_link_ready`] holds on both ends: the rkey
    /// list is taken now, so no rkey flow may be under way (Linux's ADD_LINK
    /// flow excludes them, §1.6); CONFIRM_RKEY flows wait until the new link is
    /// confirmed and then announce their RMB for it too.
    #[doc(hidden)]
    pub fn extra_link_offer(&mut self, l: LgrId) -> Result<LinkOffer> {
        let mtu = self.dev.query_port(1)?.active_mtu;
        let bad = |m: &str| smc_rdma::Error::InvalidArgument(m.into());
        if !self.extra_link_ready(l) {
            return Err(bad("link group not ready for a further link"));
        }
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .ok_or_else(|| bad("no link group"))?;
        let slot = lg
            .group
            .free_slot()
            .ok_or_else(|| bad("no free link slot"))?;
        let psn = self.psns.next_psn();
        let mut res: LinkRes<P> =
            LinkRes::new(&self.dev, &lg.pd, &self.chan, self.max_inline, psn)?;
        lg.known_rkeys.clear();
        if lg.role == Role::Server {
            res.offered_id = lg.group.next_link_id();
        }
        let rkeys = lg
            .tokens
            .values()
            .filter_map(|&id| self.conns.get(id)?.as_ref()?.rmb.as_ref())
            .map(|m| (m.rkey(), m.rkey(), m.addr()))
            .collect();
        let offer = LinkOffer {
            gid: lg.local.gid,
            mac: self.mac,
            qpn: res.qp.qp_num(),
            psn: res.psn,
            mtu: mtu.code(),
            link_id: res.offered_id,
            rkeys,
        };
        lg.links[slot] = Some(res);
        Ok(offer)
    }

    /// Test and simulation only: a further link may be offered now — the group
    /// is active, has a free slot, no link is being added and no rkey flow is
    /// running or queued.
    #[doc(hidden)]
    pub fn extra_link_ready(&self, l: LgrId) -> bool {
        self.lgrs.get(l).and_then(Option::as_ref).is_some_and(|lg| {
            lg.state.accepts_connections()
                && !lg.group.is_terminated()
                && !lg.group.adding_link()
                && !lg.group.local_flow_busy()
                && lg.rkey_queue.is_empty()
                && lg
                    .group
                    .free_slot()
                    .is_some_and(|s| lg.links.get(s).is_some_and(Option::is_none))
        })
    }

    /// Test and simulation only: connects the link prepared by
    /// [`Self::extra_link_offer`] to the peer's offered link, records the peer's
    /// rkeys for it and starts its CONFIRM_LINK exchange. Returns its slot.
    #[doc(hidden)]
    pub fn extra_link_accept(
        &mut self,
        l: LgrId,
        peer: &LinkOffer,
        now: Timestamp,
    ) -> Result<usize> {
        let mtu = self.dev.query_port(1)?.active_mtu;
        let mac = self.mac;
        let bad = |m: &str| smc_rdma::Error::InvalidArgument(m.into());
        let lg = self
            .lgrs
            .get_mut(l)
            .and_then(Option::as_mut)
            .ok_or_else(|| bad("no link group"))?;
        let slot = (0..LINK_SLOTS)
            .find(|&s| {
                lg.group.link(s).is_none()
                    && lg
                        .links
                        .get(s)
                        .and_then(Option::as_ref)
                        .is_some_and(|r| !r.connected)
            })
            .ok_or_else(|| bad("no offered link"))?;
        let res = lg.links[slot]
            .as_mut()
            .ok_or_else(|| bad("no offered link"))?;
        let link_id = match lg.role {
            Role::Server => res.offered_id,
            Role::Client => peer.link_id,
        };
        let peer_port = PeerPort {
            gid: peer.gid,
            mac: peer.mac,
            qpn: peer.qpn,
            psn: peer.psn,
            mtu: peer.mtu,
        };
        res.connect(&peer_port, mtu, lg.local.index)?;
        let local = res.local_port(lg.local.gid, mac, mtu);
        if lg.group.add_link(link_id, local, peer_port, now) != Some(slot) {
            return Err(bad("link group refused the link"));
        }
        lg.group.add_link_rtokens(slot, &peer.rkeys);
        Ok(slot)
    }

    /// Debug dump of a connection's data path and close state.
    pub fn debug_conn(&self, id: ConnId) -> String {
        match self.conns.get(id).and_then(Option::as_ref) {
            Some(c) => {
                let lg = c.lgr.and_then(|l| self.lgrs.get(l)?.as_ref());
                let rtoken = c.peer_rmb.and_then(|p| lg?.group.rtoken(p.row).copied());
                let sends: Vec<usize> = lg
                    .map(|lg| {
                        lg.links
                            .iter()
                            .flatten()
                            .map(|r| r.sends_in_flight)
                            .collect()
                    })
                    .unwrap_or_default();
                format!(
                    "token {} lgr {:?} link {:?} move_to {:?} validation {} peer rtoken {:?} \
                     usable {:?} sends in flight {:?} {:?} {:?} {:?}",
                    c.token,
                    c.lgr,
                    c.link,
                    c.move_to,
                    c.validation.is_some(),
                    rtoken,
                    lg.map(|lg| lg.group.active_slots().collect::<Vec<_>>()),
                    sends,
                    c.phase,
                    c.closer,
                    c.dp
                )
            }
            None => "gone".into(),
        }
    }

    /// The violation that killed a connection, if any.
    pub fn violation(&self, id: ConnId) -> Option<Violation> {
        self.conns.get(id)?.as_ref()?.violation
    }
}
