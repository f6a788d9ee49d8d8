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
//!   validation shows loss (§2.4). A consumer-cursor update the peer sent on
//!   the dead link is lost for good with Linux (it counts it as told when it
//!   posts it), so in a group that has had two links, or expects a second
//!   (redundancy on, two agreed), a connection keeps one byte of the peer's
//!   RMB unwritten, and after a rewind it writes it with
//!   `cons_curs_upd_req` on its CDCs until the peer's cursor moves
//!   ([`DataPath::set_failover_reserve`]).
//!
//! With no usable link left the group terminates and its connections are aborted
//! (`ECONNABORTED`, or the peer's reset), as before.
//!
//! Further links come by ADD_LINK (§1.8) once redundancy is on
//! ([`Endpoint::set_redundancy`], `endpoint/add_link.rs`); off (the default) a
//! peer's ADD_LINK is rejected and CONFIRM_LINK advertises one link. Tests may
//! still bring a link up without LLC ([`Endpoint::extra_link_offer`] /
//! [`Endpoint::extra_link_accept`]). An endpoint may have a second device
//! ([`Endpoint::open_second_device`], `endpoint/devices.rs`) on which further
//! links go, so that a port or device failure leaves the group a link; the
//! links of a group on one device share one protection domain (see
//! `endpoint/link.rs`).
//!
//!
//! # Where things are
//!
//! This file holds the module overview, [`Endpoint`] and its configuration.
//! The endpoint's methods are grouped by concern, one file each under
//! `endpoint/`:
//!
//! | file | what it holds |
//! |------|---------------|
//! | `slots.rs` | generational handles ([`ConnId`], [`LgrId`]) and the tables they index: a freed record's handle finds nothing |
//! | `conn.rs` | the connection record, its phases, status and errors; the connection table |
//! | `conn_core/` | a connection's data path (`ConnCore`, `mod.rs`): cursors, buffers, leases, close state, its link; shared as `Arc<Mutex<_>>`, found by alert token (`tokens.rs`); the connection's handle that writes and reads without the endpoint (`FastConn`, `fast.rs`) |
//! | `handshake.rs` | the CLC stream, Declines and fallback, late declines, data-path setup from Accept / Confirm |
//! | `handshake_client.rs` | the client's CLC flow: Proposal, Accept, Confirm |
//! | `handshake_server.rs` | the server's CLC flow: Proposal, group reuse or first contact, Accept, Confirm |
//! | `lgr.rs` | link groups: creation, life cycle, joining and leaving, link choice, the first link |
//! | `llc.rs` | carrying out LLC decisions (TEST_LINK, DELETE_LINK, ...), device events |
//! | `rkey.rs` | CONFIRM_RKEY / DELETE_RKEY flows |
//! | `pools.rs` | RMB and send-buffer pools |
//! | `cdc_recv.rs` | receive completions; **a received CDC is handled here** (`on_cdc`) |
//! | `cdc_send.rs` | RDMA WRITEs and their CDC posted; send completions |
//! | `write.rs` | application writes: send buffer, direct path, urgent byte |
//! | `read.rs` | application reads, end of file, urgent byte |
//! | `lease.rs` | zero-copy read and write leases |
//! | `close.rs` | shutdown, close, release, abort, peer gone |
//! | `failover.rs` | link down, failover, moving a connection between links |
//! | `add_link.rs` | the driver's part of the ADD_LINK flow (further links negotiated) |
//! | `extra_link.rs` | further links without LLC (a test bring-up) |
//! | `devices.rs` | the second device: where a new link goes, buffers registered on it |
//! | `pump.rs` | progress: `pump`, connection timers, reaping, the completion channel |
//! | `timers.rs` | when the endpoint next needs to run: `poll_timeout`, `handle_timeout` |
//! | `inspect.rs` | read-only views for tests, tools and diagnostics |
//! | `link.rs` | one link's provider objects (QP, CQs, receive buffers) |
//! | `gid.rs` | which GID a connection uses |
//! | `psn.rs` | initial PSNs of our QPs |
//!
//! [`negotiate`]: smc_proto::negotiate
//! [`LinkGroup`]: smc_proto::link::LinkGroup
//! [`DataPath`]: smc_proto::datapath::DataPath
//! [`DataPath::failover_rewind`]: smc_proto::datapath::DataPath::failover_rewind
//! [`DataPath::set_failover_reserve`]: smc_proto::datapath::DataPath::set_failover_reserve
//! [`Closer`]: smc_proto::close::Closer
//! [`LgrState`]: crate::state::LgrState
//! [`HandshakePhase`]: crate::state::HandshakePhase
//! [`HandshakePhase::AwaitLateDecline`]: crate::state::HandshakePhase::AwaitLateDecline
//! [`HandshakePhase::LateDeclined`]: crate::state::HandshakePhase::LateDeclined
//! [`QueuePair::prepare_remote`]: smc_rdma::QueuePair::prepare_remote

mod add_link;
mod arm;
mod cdc_recv;
mod cdc_send;
mod close;
mod conn;
mod conn_core;
mod devices;
mod events;
mod extra_link;
mod failover;
mod gid;
mod handshake;
mod handshake_client;
mod handshake_server;
mod inspect;
mod lease;
mod lgr;
mod link;
mod llc;
mod pools;
mod psn;
mod pump;
mod read;
mod rkey;
mod slots;
mod timers;
mod write;

pub use close::{MAX_STREAM_WAIT, PEER_GONE_GRACE};
pub use conn::{ConnError, ConnStatus};
pub use conn_core::{ConnLevel, FastConn, FastRead, FastWrite, MaySleep, Watch};
pub use events::{AbortCause, EngineEvent, EVENT_QUEUE_LEN};
pub use extra_link::LinkOffer;
pub use lease::{ReadLease, ReadPlan, WriteLease, WritePlan};
pub use link::{signal_every, LinkBringup, MAX_SENDS};
pub use slots::{ConnId, LgrId};

use conn::Conn;
use lgr::Lgr;
use psn::PsnSource;
use slots::Slots;
use smc_proto::negotiate::IfAddr;
use smc_proto::Timestamp;
use smc_rdma::{Device, GidEntry, Provider};
use smc_wire::types::{Eid, Mac, SystemId};
use std::time::Duration;

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
    /// A smaller RMB for a connection that joins while the endpoint's
    /// connections already hold many (see [`RmbCrowding`]); `None`: every
    /// connection that asks for no size gets `rmb_len`.
    pub rmb_crowding: Option<RmbCrowding>,
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

/// When a connection that asks for no RMB size gets a smaller one than
/// [`EndpointConfig::rmb_len`]: if the RMBs the endpoint's connections hold
/// already, plus `rmb_len`, would exceed `budget` bytes, it gets `len`.
/// Every RMB is a ring the peer writes through from end to end, so the
/// memory a program's connections cycle through together is the sum of
/// their RMBs: one large RMB lets a lone stream's writer run far ahead of
/// its reader, while many large ones together outgrow the caches and every
/// message's copies go to memory. (Linux picks the RMB from the socket's
/// receive buffer size alone, smc_core.c `__smc_buf_create`; a size asked
/// for, e.g. by `SO_RCVBUF`, is taken as it is here too.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmbCrowding {
    /// RMB bytes the endpoint's connections may hold before the next one
    /// gets `len`.
    pub budget: usize,
    /// The RMB of a connection beyond the budget, rounded up to a size class.
    pub len: usize,
}

/// An SMC-R endpoint on one device.
pub struct Endpoint<P: Provider> {
    cfg: EndpointConfig,
    dev: P::Device,
    /// A second device for further links (`endpoint/devices.rs`).
    dev2: Option<P::Device>,
    /// Its name (a device's `info()` may query the device: not for a name).
    dev2_name: Option<String>,
    /// The completion channel of every CQ on the first device (see
    /// [`Endpoint::arm`]).
    chan: P::Channel,
    /// The second device's channel, for the CQs there: a CQ's channel must
    /// be of its own device (verbs: an `ibv_comp_channel` belongs to one
    /// context).
    chan2: Option<P::Channel>,
    /// With a second device: an epoll set of both channels and both devices'
    /// asynchronous-event descriptors, the single descriptor to sleep on
    /// ([`Endpoint::notify_fd`]; `endpoint/devices.rs`).
    wake: Option<std::os::fd::OwnedFd>,
    /// Work completions taken from the CQs so far (progress indicator).
    completions: u64,
    /// Scratch list of connection ids (`flush_tx`), kept to not allocate per pump.
    scratch_ids: Vec<ConnId>,
    /// A spare for `tx_dirty` while `flush_tx` works through the marks.
    scratch_marked: Vec<ConnId>,
    /// Connections that may have something to send (see `flush_tx`).
    tx_dirty: Vec<ConnId>,
    /// Every connection is flushed, and its timers looked at, at the next
    /// pump (a link or handshake event, whose effect on connections is not
    /// tracked one by one).
    sweep_due: bool,
    /// Connection deadlines (see `endpoint/timers.rs`).
    timers: timers::TimerHeap,
    /// Connections the next pump looks at (timers, freeing) without a sweep.
    due: Vec<ConnId>,
    /// Scratch list of the connections a pump looks at, likewise.
    scratch_due: Vec<ConnId>,
    /// Timers fired so far ([`Endpoint::timer_events`]).
    timer_events: u64,
    /// The earliest timer of the link groups, as the last pump left them
    /// (see `endpoint/timers.rs`).
    lgr_next: Option<Timestamp>,
    /// When the driver looks at the send CQs for the last CDCs of finished
    /// connections, which it did not arm for (`endpoint/arm.rs`).
    reap_at: Option<Timestamp>,
    /// A look at `reap_at` came and no connection has been freed since: a
    /// finished connection's last CDC may be slow to complete (a peer that
    /// does not run), so the driver arms for it instead of looking again
    /// every `REAP_AFTER`.
    reap_looked: bool,
    /// An LLC message came in, or a connection's handshake or close moved
    /// (it may have joined or left a group): the next pump looks at the
    /// groups' timers and frees the groups that are done.
    lgr_recheck: bool,
    /// Failover validation CDCs (§2.4) that claimed a completed send this
    /// side had not yet processed, each with its group: judged after the
    /// group's links were polled again (`cdc_recv::settle_validations`).
    held_validations: Vec<(LgrId, smc_wire::cdc::CdcMessage)>,
    /// Proposals parked until a first contact with their peer finishes
    /// (`Phase::AwaitLgr`): decided again after any connection's event,
    /// which may be that first contact's step (see `conn_event`).
    parked: Vec<ConnId>,
    /// Connections flushed so far, one by one (`conn_flushes`).
    conn_flushes: u64,
    /// Writes that went into the peer's RMB without their CDC (`corked_writes`).
    corked_writes: u64,
    /// Scratch space for the completions one send CQ poll takes
    /// (`poll_send`; a receive CQ's poll has its link's, `LinkRx`), kept so that a poll does not initialize it each time.
    scratch_wcs: Vec<smc_rdma::WorkCompletion>,
    /// The send completions of one poll with what their work requests
    /// carried (`Endpoint::poll_send`), kept for its next call.
    scratch_sent: Vec<(smc_rdma::WorkCompletion, Option<link::WrKind>)>,
    /// LLC messages posted so far.
    llc_sent: u64,
    /// LLC messages received, CDC messages posted and received so far
    /// (`smcr stats`; a plain add under the endpoint's lock).
    llc_received: u64,
    cdc_sent: u64,
    cdc_received: u64,
    /// Of those, CDCs that a reader's dispatch without the device lock
    /// applied (`cdc_recv::dispatch`), as far as a poll of the endpoint's
    /// has counted them.
    cdc_dispatched: u64,
    /// The port's active MTU, for the CLC messages of every connection:
    /// querying the port reads the interface (netlink, ioctl) and would cost
    /// more than the rest of a handshake. Read again at each port event.
    port_mtu: smc_wire::types::IbMtu,
    /// What the device (both devices, with a second) allows a link.
    limits: link::LinkLimits,
    lgrs: Slots<LgrId, Lgr<P>>,
    conns: Slots<ConnId, Conn<P>>,
    /// The connections of every link group by alert token, with their data
    /// path (`endpoint/conn_core/`): where a received CDC goes.
    /// Shared (`Arc`) with the links' receive dispatch.
    by_token: std::sync::Arc<conn_core::TokenTable<P>>,
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
    /// Whether link groups add further links (`endpoint/add_link.rs`).
    redundancy: smc_proto::link::Redundancy,
    /// Link and connection events for the driver (`endpoint/events.rs`).
    events: events::Events,
    /// Connects of added links' QPs are handed to the driver
    /// (`endpoint/add_link.rs`), and those not taken yet.
    hand_out_bringups: bool,
    bringups: std::collections::VecDeque<LinkBringup<P>>,
    /// The last bring-up's id.
    next_bringup: u64,
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
        let limits = link::LinkLimits::of(&dev.info());
        Ok(Endpoint {
            cfg,
            dev,
            dev2: None,
            dev2_name: None,
            chan,
            chan2: None,
            wake: None,
            completions: 0,
            scratch_ids: Vec::new(),
            scratch_marked: Vec::new(),
            tx_dirty: Vec::new(),
            sweep_due: true,
            timers: timers::TimerHeap::new(),
            due: Vec::new(),
            scratch_due: Vec::new(),
            timer_events: 0,
            lgr_next: None,
            reap_at: None,
            reap_looked: false,
            lgr_recheck: false,
            held_validations: Vec::new(),
            parked: Vec::new(),
            conn_flushes: 0,
            corked_writes: 0,
            scratch_wcs: Vec::new(),
            scratch_sent: Vec::new(),
            llc_sent: 0,
            llc_received: 0,
            cdc_sent: 0,
            cdc_received: 0,
            cdc_dispatched: 0,
            port_mtu,
            limits,
            lgrs: Slots::default(),
            conns: Slots::default(),
            by_token: std::sync::Arc::default(),
            next_token: 1,
            next_lgr_id: 0x100,
            gids,
            gids_reread: None,
            mac,
            psns,
            tokens_wrapped: false,
            now: Duration::ZERO,
            redundancy: smc_proto::link::Redundancy::default(),
            events: events::Events::default(),
            hand_out_bringups: false,
            bringups: std::collections::VecDeque::new(),
            next_bringup: 0,
        })
    }
}
