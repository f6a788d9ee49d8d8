//! Provider-neutral, verbs-like RDMA API.
//!
//! The shapes follow libibverbs closely so that a real verbs provider can sit
//! behind the same traits: devices have ports with a state, an active MTU and
//! a GID table; memory is registered (here: allocated) in a protection domain
//! with access flags and yields an lkey/rkey; RC queue pairs walk the verbs
//! state machine (RESET → INIT → RTR → RTS, ERR); work requests carry a
//! `wr_id` and complete through completion queues that are polled without
//! blocking, optionally armed to signal a completion channel that exposes a
//! pollable file descriptor.
//!
//! All handles are `Send + Sync` and every method takes `&self`, so the
//! application's own thread can post and poll without a driver thread.
#![forbid(unsafe_code)]

use std::fmt;
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Errors returned synchronously by verbs calls (asynchronous failures are
/// reported as [`WorkCompletion`] statuses and [`AsyncEvent`]s instead).
#[derive(Debug)]
pub enum Error {
    /// The operation is not allowed in the queue pair's current state.
    InvalidState {
        /// What was attempted.
        op: &'static str,
        /// The state the QP was in.
        state: QpState,
    },
    /// The requested state transition is not in the transition table.
    InvalidTransition {
        /// Current state.
        from: QpState,
        /// Requested transition.
        to: QpTransitionKind,
    },
    /// An argument is out of range or inconsistent.
    InvalidArgument(String),
    /// The work queue is full.
    QueueFull,
    /// No device with this name.
    NoSuchDevice(String),
    /// The port number does not exist.
    NoSuchPort(u8),
    /// Establishing the connection to the peer failed.
    Connect(String),
    /// Configuration error.
    Config(String),
    /// The operation is not supported by this provider.
    Unsupported(&'static str),
    /// An operating-system call failed.
    Io(std::io::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidState { op, state } => {
                write!(f, "{op} is not allowed while the QP is in state {state:?}")
            }
            Error::InvalidTransition { from, to } => {
                write!(f, "QP transition {to:?} is not allowed from state {from:?}")
            }
            Error::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            Error::QueueFull => write!(f, "work queue is full"),
            Error::NoSuchDevice(n) => write!(f, "no RDMA device named {n:?}"),
            Error::NoSuchPort(p) => write!(f, "no port {p}"),
            Error::Connect(s) => write!(f, "connecting to the peer failed: {s}"),
            Error::Config(s) => write!(f, "configuration error: {s}"),
            Error::Unsupported(s) => write!(f, "not supported by this provider: {s}"),
            Error::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

/// GIDs are the wire codec's type, so a GID read from a CLC message goes into
/// [`RemoteQp`] unchanged.
pub use smc_wire::types::{Gid, Mac};

/// GID type as in the RoCE GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidType {
    /// RoCE v1 (layer 2, link-local GID derived from the MAC).
    RoceV1,
    /// RoCE v2 (UDP/IP, GID derived from an IP address).
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table.
    pub index: u16,
    /// The GID.
    pub gid: Gid,
    /// RoCE version.
    pub gid_type: GidType,
}

/// Port state (subset of `ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Link down.
    Down,
    /// Link coming up.
    Init,
    /// Link up and usable.
    Active,
}

/// Path MTU (`ibv_mtu`): the wire codec's IB MTU enum (1 = 256 … 5 = 4096).
pub use smc_wire::types::IbMtu as Mtu;

/// Attributes of one port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Port number (1-based, as in verbs).
    pub port_num: u8,
    /// Current state.
    pub state: PortState,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// GID table.
    pub gids: Vec<GidEntry>,
    /// The associated network interface, if any.
    pub netdev: Option<String>,
}

/// Static description of a device (from enumeration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`mlx5_0`, `shm0`, …).
    pub name: String,
    /// Ports (verbs numbering starts at 1).
    pub ports: Vec<PortAttr>,
    /// Largest message a SEND may carry.
    pub max_msg_size: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// How many SENDs a link of this device may keep in flight, where the
    /// device knows its peers (`None`: the engine's default, which leaves a
    /// Linux peer's 48 receive buffers room to spare).
    pub max_sends: Option<u32>,
}

/// Memory access flags (`ibv_access_flags`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No access beyond local read.
    pub const NONE: Access = Access(0);
    /// The local HCA may write (needed for receive buffers).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may RDMA WRITE.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may RDMA READ.
    pub const REMOTE_READ: Access = Access(4);
    /// Whether all bits of `other` are set.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// Raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }
    /// From raw bits (unknown bits dropped).
    pub fn from_bits(b: u32) -> Access {
        Access(b & 7)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = vec![];
        if self.contains(Access::LOCAL_WRITE) {
            parts.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            parts.push("REMOTE_READ");
        }
        write!(f, "Access({})", parts.join("|"))
    }
}

/// A scatter/gather element: `length` bytes at `addr` of the region `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Address in the region's address space ([`MemoryRegion::addr`] + offset).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

/// What a remote peer needs to RDMA WRITE into a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteMr {
    /// Remote address of byte 0.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length.
    pub len: u64,
}

/// Send-queue operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided SEND (consumes a receive WR at the peer).
    Send,
    /// SEND with 32-bit immediate data.
    SendWithImm(u32),
    /// One-sided RDMA WRITE.
    RdmaWrite {
        /// Target address in the peer's region.
        remote_addr: u64,
        /// The peer region's rkey.
        rkey: u32,
    },
    /// RDMA WRITE that also consumes a receive WR and delivers `imm`.
    RdmaWriteWithImm {
        /// Target address in the peer's region.
        remote_addr: u64,
        /// The peer region's rkey.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
}

/// Where a send WR's data comes from.
#[derive(Clone, Copy, Debug)]
pub enum Payload<'a> {
    /// Gather from registered memory.
    Sges(&'a [Sge]),
    /// Copied at post time (`IBV_SEND_INLINE`); at most `max_inline` bytes.
    Inline(&'a [u8]),
}

impl Payload<'_> {
    /// Total length.
    pub fn len(&self) -> u64 {
        match self {
            Payload::Sges(s) => s.iter().map(|s| s.length as u64).sum(),
            Payload::Inline(d) => d.len() as u64,
        }
    }
    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// Data.
    pub payload: Payload<'a>,
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Scatter list (may be empty for WRITE WITH IMMEDIATE only).
    pub sges: &'a [Sge],
}

/// Completion opcode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WcOpcode {
    /// SEND (or SEND WITH IMMEDIATE) completed at the requester.
    #[default]
    Send,
    /// RDMA WRITE (with or without immediate) completed at the requester.
    RdmaWrite,
    /// A SEND was received.
    Recv,
    /// An RDMA WRITE WITH IMMEDIATE was received.
    RecvRdmaWithImm,
}

/// Completion status (`ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WcStatus {
    /// Success.
    #[default]
    Success,
    /// Receive buffer too small / message too long.
    LocalLengthError,
    /// Internal QP consistency error.
    LocalQpOperationError,
    /// A local SGE referenced memory it may not access (bad lkey, bounds, PD, access).
    LocalProtectionError,
    /// Flushed because the QP is in the error state.
    WrFlushError,
    /// The responder rejected the request as invalid.
    RemoteInvalidRequest,
    /// The responder rejected the rkey, bounds or access rights.
    RemoteAccessError,
    /// The responder failed to complete the operation.
    RemoteOperationError,
    /// Transport retries exhausted (peer not answering).
    RetryExceeded,
    /// Receiver-not-ready retries exhausted.
    RnrRetryExceeded,
    /// Fatal device error.
    FatalError,
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The WR's `wr_id`.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode (meaningful also on errors in this crate).
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: bytes received).
    pub byte_len: u32,
    /// Immediate data, if any.
    pub imm: Option<u32>,
    /// QP number the WR belonged to.
    pub qp_num: u32,
}

/// Queue pair state (verbs `ibv_qp_state`, without SQD/SQE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Freshly created or reset; nothing may be posted.
    Reset,
    /// Initialised; receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Error; all WRs flush.
    Err,
}

impl QpState {
    /// All states.
    pub const ALL: [QpState; 5] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Err,
    ];

    /// The QP transition table.
    ///
    /// | from \ to | Init | Rtr | Rts | Err | Reset |
    /// |-----------|------|-----|-----|-----|-------|
    /// | Reset     |  ok  |  -  |  -  | ok  |  ok   |
    /// | Init      |  ok  | ok  |  -  | ok  |  ok   |
    /// | Rtr       |  -   |  -  | ok  | ok  |  ok   |
    /// | Rts       |  -   |  -  | ok  | ok  |  ok   |
    /// | Err       |  -   |  -  |  -  | ok  |  ok   |
    ///
    /// (INIT→INIT and RTS→RTS modify attributes, as in verbs.)
    pub fn next(self, t: QpTransitionKind) -> Result<QpState> {
        use QpState::*;
        use QpTransitionKind as K;
        let to = match (self, t) {
            (_, K::Reset) => Reset,
            (_, K::Err) => Err,
            (Reset | Init, K::Init) => Init,
            (Init, K::Rtr) => Rtr,
            (Rtr | Rts, K::Rts) => Rts,
            _ => return Result::Err(Error::InvalidTransition { from: self, to: t }),
        };
        Ok(to)
    }
    /// Receives may be posted in INIT, RTR, RTS (and ERR, where they flush).
    pub fn can_post_recv(self) -> bool {
        !matches!(self, QpState::Reset)
    }
}

/// The kind of a [`QpModify`] (for the transition table and errors).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpTransitionKind {
    /// To INIT.
    Init,
    /// To RTR.
    Rtr,
    /// To RTS.
    Rts,
    /// To ERR.
    Err,
    /// To RESET.
    Reset,
}

impl QpTransitionKind {
    /// All kinds.
    pub const ALL: [QpTransitionKind; 5] = [
        QpTransitionKind::Init,
        QpTransitionKind::Rtr,
        QpTransitionKind::Rts,
        QpTransitionKind::Err,
        QpTransitionKind::Reset,
    ];
}

/// The peer a QP connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteQp {
    /// Peer GID.
    pub gid: Gid,
    /// Peer QP number.
    pub qp_num: u32,
}

/// A QP state change with the attributes verbs requires for it.
#[derive(Clone, Copy, Debug)]
pub enum QpModify {
    /// RESET/INIT → INIT.
    Init {
        /// Port number (1-based).
        port: u8,
        /// Remote access rights granted through this QP.
        access: Access,
    },
    /// INIT → RTR: connect to the peer.
    Rtr {
        /// The peer.
        remote: RemoteQp,
        /// Index of the local GID to use.
        sgid_index: u16,
        /// Expected first PSN from the peer (the peer's `sq_psn`).
        rq_psn: u32,
        /// Path MTU.
        path_mtu: Mtu,
        /// How long a requester waits before retrying after RNR.
        min_rnr_timer: Duration,
    },
    /// RTR/RTS → RTS.
    Rts {
        /// First PSN of our sends.
        sq_psn: u32,
        /// Transport timeout per attempt.
        timeout: Duration,
        /// Transport retry count (0..=7).
        retry_cnt: u8,
        /// RNR retry count (0..=6, 7 = infinite).
        rnr_retry: u8,
    },
    /// Any → ERR.
    Err,
    /// Any → RESET.
    Reset,
}

impl QpModify {
    /// The transition kind.
    pub fn kind(&self) -> QpTransitionKind {
        match self {
            QpModify::Init { .. } => QpTransitionKind::Init,
            QpModify::Rtr { .. } => QpTransitionKind::Rtr,
            QpModify::Rts { .. } => QpTransitionKind::Rts,
            QpModify::Err => QpTransitionKind::Err,
            QpModify::Reset => QpTransitionKind::Reset,
        }
    }
}

/// Queue sizes of a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_inline_data: 64,
        }
    }
}

/// Asynchronous event (`ibv_async_event`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// The port became active.
    PortActive {
        /// Port number.
        port: u8,
    },
    /// The port went down (its QPs moved to ERR).
    PortError {
        /// Port number.
        port: u8,
    },
    /// A QP hit a fatal error and moved to ERR (e.g. peer death or hang).
    QpFatal {
        /// QP number.
        qp_num: u32,
    },
    /// The device failed.
    DeviceFatal,
}

/// A family of RDMA object types (one per provider).
pub trait Provider: Send + Sync + Sized + 'static {
    /// Opened device.
    type Device: Device<P = Self>;
    /// Protection domain.
    type Pd: ProtectionDomain<P = Self>;
    /// Memory region.
    type Mr: MemoryRegion;
    /// Completion queue.
    type Cq: CompletionQueue;
    /// Completion channel.
    type Channel: CompletionChannel;
    /// Queue pair.
    type Qp: QueuePair;

    /// Enumerates devices.
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    /// Opens a device by name.
    fn open_device(&self, name: &str) -> Result<Self::Device>;
}

/// An opened device (`ibv_context`).
pub trait Device: Send + Sync {
    /// The provider family.
    type P: Provider;
    /// Current description (ports, states, GIDs).
    fn info(&self) -> DeviceInfo;
    /// Queries one port (1-based).
    fn query_port(&self, port: u8) -> Result<PortAttr>;
    /// Allocates a protection domain.
    fn alloc_pd(&self) -> Result<<Self::P as Provider>::Pd>;
    /// Creates a completion channel.
    fn create_channel(&self) -> Result<<Self::P as Provider>::Channel>;
    /// Creates a completion queue, optionally bound to a channel.
    fn create_cq(
        &self,
        depth: u32,
        channel: Option<&<Self::P as Provider>::Channel>,
    ) -> Result<<Self::P as Provider>::Cq>;
    /// Takes the next asynchronous event without blocking.
    fn poll_async_event(&self) -> Option<AsyncEvent>;
    /// A descriptor that is readable while asynchronous events are pending.
    fn async_fd(&self) -> BorrowedFd<'_>;
}

/// A protection domain.
pub trait ProtectionDomain: Send + Sync {
    /// The provider family.
    type P: Provider;
    /// Allocates and registers `len` bytes (page aligned, zeroed).
    fn alloc_mr(&self, len: usize, access: Access) -> Result<<Self::P as Provider>::Mr>;
    /// Registers the memory of `mr` — a region of any protection domain of
    /// any device of this provider — in this protection domain too, as
    /// `ibv_reg_mr` of the same memory on a second PD does: a new region
    /// with its own lkey, rkey and address (a provider may keep the
    /// address), whose bytes are those of `mr`, with `access`. A peer
    /// reaches it only through a QP of this PD, with its rkey; `mr`'s rkey
    /// stays valid on `mr`'s PD only. Each registration is deregistered when
    /// it is dropped; the memory lives while one of them does. (A link group
    /// whose links are on two devices registers its buffers on both.)
    fn share_mr(
        &self,
        mr: &<Self::P as Provider>::Mr,
        access: Access,
    ) -> Result<<Self::P as Provider>::Mr> {
        let _ = (mr, access);
        Err(Error::Unsupported(
            "registering a region in a second protection domain",
        ))
    }
    /// Creates an RC queue pair in RESET.
    fn create_qp(
        &self,
        send_cq: &<Self::P as Provider>::Cq,
        recv_cq: &<Self::P as Provider>::Cq,
        cap: QpCap,
    ) -> Result<<Self::P as Provider>::Qp>;
}

/// A registered memory region; deregistered on drop.
pub trait MemoryRegion: Send + Sync {
    /// Local key (for SGEs).
    fn lkey(&self) -> u32;
    /// Remote key (for the peer's RDMA WRITEs).
    fn rkey(&self) -> u32;
    /// Address of byte 0 in SGEs and for remote access (the iova).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Access flags.
    fn access(&self) -> Access;
    /// Copies out of the region (bounds checked). Peers may write concurrently.
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()>;
    /// Copies into the region (bounds checked).
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()>;
    /// The whole region as a window that stays valid on its own (to copy
    /// without holding whatever owns the region), if the provider can give
    /// one; `None` otherwise.
    fn window(&self) -> Option<MemWindow> {
        None
    }
    /// An SGE covering `len` bytes at `off` (bounds checked).
    fn sge(&self, off: usize, len: u32) -> Result<Sge> {
        check_range(off, len as usize, self.len())?;
        Ok(Sge {
            addr: self.addr() + off as u64,
            length: len,
            lkey: self.lkey(),
        })
    }
    /// The region's doorbell, if the provider has one (the same-host
    /// shared-memory device): a word the region's owner sleeps on, which a
    /// peer's SEND naming this region ([`QueuePair::post_send_ringing`])
    /// rings once published. `None`: none (real RNICs; the owner then waits
    /// on its completion channel).
    fn doorbell(&self) -> Option<Doorbell> {
        None
    }
    /// What the peer needs to write here.
    fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            rkey: self.rkey(),
            len: self.len() as u64,
        }
    }
}

/// A doorbell a region's owner sleeps on ([`MemoryRegion::doorbell`]):
/// armed, then looked at (whatever the owner waits for), then waited on;
/// rung by a peer's SEND that names the region, or by a thread of the
/// owner's process that found what the owner waits for.
pub trait Bell: Send + Sync {
    /// Says the owner is about to sleep: a ring from now on wakes it (or
    /// keeps its next [`Self::wait`] from sleeping). A look at what the
    /// owner waits for follows.
    fn arm(&self);
    /// Sleeps until rung (at once if rung since [`Self::arm`]), `timeout`
    /// passes or a signal comes; spurious returns are possible.
    fn wait(&self, timeout: Option<Duration>);
    /// Rings it if armed; whether it was.
    fn ring(&self) -> bool;
    /// Arms it for a thread of the owner that is not going to sleep but
    /// will look before it returns (a writer, whose reply may come while it
    /// is still in its call), unless another thread of the owner has it
    /// armed: a peer's SEND that names the region then neither wakes
    /// anybody nor signals the owner's completion channel. Whether it did
    /// (then [`Self::release`] it).
    fn hold(&self) -> bool;
    /// Ends a [`Self::hold`], or an [`Self::arm`] and its waits: whether a
    /// ring took the bell since (the last arm), whose SEND may then wait in
    /// the owner's receive queue unannounced, for the caller to take (or
    /// to have the owner's completion channel signalled for it).
    fn release(&self) -> bool;
    /// The descriptor that a peer's SEND naming the region makes readable
    /// while the bell is armed for a poller ([`Self::arm_polled`]): for an
    /// event loop that waits in `epoll`/`poll`, not in [`Self::wait`].
    /// `None`: the device has none (the owner learns of the peer's SENDs
    /// through its completion channel only).
    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Drains [`Self::poll_fd`] and arms the bell for a poller: the peer's
    /// next SEND that names the region makes `poll_fd` readable once it is
    /// published, and does not signal the owner's completion channel (the
    /// poller takes it off the receive queue itself, as a reader's
    /// dispatch does). The caller looks for what came after this call and
    /// before it (the arm-then-look order of [`Self::arm`]). Whether it is
    /// armed so; `false`: no `poll_fd`, or a thread of the owner has the
    /// bell armed for a wait or a hold (that thread takes what comes).
    fn arm_polled(&self) -> bool {
        false
    }
    /// [`Self::arm_polled`] without draining [`Self::poll_fd`]: for an
    /// owner whose pollers all wait on it edge-triggered (`epoll` with
    /// `EPOLLET`), which a write wakes whatever the count was, and which a
    /// count left from before the arm does not wake. The drain is a system
    /// call per arm that such pollers do not need; one that waits
    /// level-triggered (`poll`, `select`, `epoll` without `EPOLLET`) would
    /// be woken by the stale count again and again, and needs
    /// [`Self::arm_polled`].
    fn arm_polled_undrained(&self) -> bool {
        self.arm_polled()
    }
    /// Whether a peer's SEND took the bell armed for a poller since the
    /// last [`Self::arm_polled`]: `poll_fd` is readable (or about to be:
    /// the peer writes it right after publishing that SEND) until the next
    /// `arm_polled` or [`Self::disarm_polled`] (an
    /// [`Self::arm_polled_undrained`] ends the "taken" and leaves the count).
    fn polled_taken(&self) -> bool {
        false
    }
    /// The bell no longer armed for a poller (the last poller is gone),
    /// `poll_fd` drained if a peer's SEND took the bell since it was armed
    /// ([`Self::polled_taken`]; a write of a SEND that took it before may
    /// still land after this).
    fn disarm_polled(&self) {}
    /// Drains [`Self::poll_fd`] whatever the bell's state: at the end of
    /// the owner's connection (the region's next connection takes the
    /// descriptor over, and a count a late write left would be readiness of
    /// nothing to its pollers), and for an owner whose descriptor another
    /// process may wait on too (a forked child), which such a count would
    /// wake again and again.
    fn drain_polled(&self) {}
    /// Says how the owner's pollers wait on `poll_fd`: `true`, all of them
    /// level-triggered (`poll`, `select`, `epoll` without `EPOLLET` or
    /// `EPOLLEXCLUSIVE`), which see `poll_fd` readable until the next
    /// [`Self::arm_polled`] drains it, so the first SEND after an arm
    /// needs to write it and the others need not; `false` (the default, and
    /// what a region's next connection starts with), some wait
    /// edge-triggered, which are woken only by a write, and every SEND
    /// writes it, as TCP wakes them for every segment. Takes effect at once,
    /// also for a bell armed already.
    fn set_poll_level(&self, level: bool) {
        let _ = level;
    }
    /// What [`Self::set_poll_level`] last said (`false` until then).
    fn poll_level(&self) -> bool {
        false
    }
}

/// A shared handle to a [`Bell`].
pub type Doorbell = std::sync::Arc<dyn Bell>;

/// Checks `off..off+len` lies in `0..total`.
pub fn check_range(off: usize, len: usize, total: usize) -> Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {off}+{len} outside region of {total} bytes"
        ))),
    }
}

/// A completion queue.
pub trait CompletionQueue: Send + Sync {
    /// Fills `out` with up to `out.len()` completions; never blocks.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize>;
    /// Arms the CQ: the next completion signals its channel once.
    fn req_notify(&self) -> Result<()>;
    /// A cheap hint for busy-polling callers: `false` only when a [`poll`]
    /// now would find no completion (it may still say `true` when there is
    /// none). Providers without a cheaper look than polling say `true`.
    ///
    /// [`poll`]: CompletionQueue::poll
    fn may_have_work(&self) -> bool {
        true
    }
}

/// A completion channel with a pollable descriptor (`ibv_comp_channel`).
pub trait CompletionChannel: Send + Sync {
    /// The descriptor; readable when an armed CQ received a completion.
    fn fd(&self) -> BorrowedFd<'_>;
    /// Consumes pending notifications without blocking; true if there were any.
    fn try_get_event(&self) -> Result<bool>;
    /// Blocks up to `timeout` for a notification; true if one was consumed.
    fn wait(&self, timeout: Duration) -> Result<bool>;
}

/// An RC queue pair.
pub trait QueuePair: Send + Sync {
    /// QP number.
    fn qp_num(&self) -> u32;
    /// Current state (may change asynchronously to ERR).
    fn state(&self) -> QpState;
    /// Applies a state transition.
    fn modify(&self, m: &QpModify) -> Result<()>;
    /// Posts a send WR (fails unless RTS).
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()>;
    /// Posts a receive WR (fails in RESET).
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()>;
    /// Posts a SEND as [`Self::post_send`] that, once it is in the peer's
    /// receive queue, rings the doorbell of the peer's region `bell_rkey`
    /// ([`MemoryRegion::doorbell`]) if its owner sleeps on it; such a SEND
    /// then does not also signal the peer's armed completion channel (the
    /// woken owner takes the SEND itself). Providers without doorbells
    /// post it as a plain SEND (default).
    fn post_send_ringing(&self, wr: &SendWr<'_>, bell_rkey: u32) -> Result<()> {
        let _ = bell_rkey;
        self.post_send(wr)
    }
    /// The peer memory that an RDMA WRITE of `len` bytes to `rkey`/`addr`
    /// would reach, when this provider has it mapped in this process (the
    /// same-host shared-memory device): the caller copies into it itself, e.g.
    /// without holding its own locks, and then posts what announces the data
    /// (a CDC), which the QP's ordering places after the copy as it would
    /// after a WRITE. The checks a WRITE would make (access, bounds, a region
    /// still registered) are made here, and the registration again at each
    /// copy. `None`: not available (real RNICs) or the WRITE would fail.
    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        let _ = (rkey, addr, len);
        None
    }
    /// Whether the peer's process is known to be stopped (`SIGSTOP`, job
    /// control, a debugger): alive, but not answering until it runs again,
    /// whereas a TCP peer's kernel answers for a stopped process. A
    /// keepalive waits for such a peer (the engine's TEST_LINK); its death
    /// still shows (its process ends, and the QP goes to ERR). Only a
    /// provider that can tell says so (the shared-memory device, for a peer
    /// in its PID namespace); an RNIC answers in hardware whatever its
    /// host's processes do (default: `false`).
    fn peer_paused(&self) -> bool {
        false
    }
    /// Readies this connected QP for RDMA WRITEs of up to `len` bytes at
    /// `rkey`/`addr` of the peer, so that the WRITEs later need nothing that
    /// may be lacking then. A provider that reaches peer memory through
    /// per-region resources of this process (the same-host shared-memory
    /// device maps the peer's region, which takes a descriptor for a moment)
    /// acquires them here, where a failure costs only the caller's new
    /// connection, instead of at the first WRITE, where it would fail the QP
    /// and every connection on it. Real RNICs need nothing (default: `Ok`).
    /// Errors: the region cannot be reached now (the QP is not connected, the
    /// peer refuses, or this process is out of resources).
    fn prepare_remote(&self, rkey: u32, addr: u64, len: usize) -> Result<()> {
        let _ = (rkey, addr, len);
        Ok(())
    }
    /// Takes the next SEND that arrived for this QP where it arrived,
    /// without a receive completion: its payload is copied into `buf`, and
    /// the receive WR it consumes (the oldest posted) is posted again at
    /// once, as the caller would post it after reading it (so the WR's own
    /// buffer is left untouched, and [`InPlace::Got`] carries that WR's id
    /// and the payload's length). For a receiver that only copies each
    /// message out of its receive buffer and posts the buffer again (a CDC
    /// or LLC receiver) this saves the copy into the buffer, the completion
    /// and the post. Providers whose receives land in the buffers anyway
    /// (real RNICs) say [`InPlace::Unsupported`] (default).
    ///
    /// Order: a completion already in the QP's receive CQ is older than
    /// anything taken here, so while one is there nothing is taken
    /// ([`InPlace::CqFirst`]); a caller polls the CQ first, then takes
    /// here. A SEND this cannot take (one with immediate data, one longer
    /// than `buf` or than the receive WR's buffer, a malformed one) goes
    /// through the receive queue as usual and into the CQ ([`InPlace::CqFirst`]).
    fn recv_in_place(&self, buf: &mut [u8]) -> InPlace {
        let _ = buf;
        InPlace::Unsupported
    }

    /// A cheap look for a caller about to take the QP's receives (by
    /// [`Self::recv_in_place`] or a poll of its receive CQ): `false` only
    /// when that would find nothing now (it may still say `true` when there
    /// is nothing). Providers without a cheaper look than taking say `true`.
    fn recv_may_have(&self) -> bool {
        true
    }
}

/// What [`QueuePair::recv_in_place`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InPlace {
    /// The provider has no receives in place: poll the receive CQ.
    Unsupported,
    /// Nothing arrived (or no receive WR is posted for it).
    Empty,
    /// The receive CQ holds completions of this QP (older, or what could
    /// not be taken here): poll it, then try again.
    CqFirst,
    /// A SEND taken.
    Got {
        /// The receive WR it consumed (posted again).
        wr_id: u64,
        /// Its payload's length, at the start of the caller's buffer.
        len: u32,
        /// Another SEND was there already (a caller may stop looking
        /// when there was none, as after a CQ poll that did not fill its
        /// array).
        more: bool,
    },
}

/// Memory mapped in this process that a [`MemWindow`] copies to and from.
pub trait MappedMem: Send + Sync {
    /// Copies out of the mapping at `off` (bounds checked).
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()>;
    /// Copies into the mapping at `off` (bounds checked; fails once the
    /// memory is no longer open to the writer, e.g. deregistered).
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()>;
    /// Reads from `fd` into the ranges `parts` (offset, length) of the
    /// mapping, in order, as one `readv` (`at`: `None`) or `preadv` at file
    /// offset `at`; bytes read. Same checks as [`Self::write_mapped`]. The
    /// default reads into a buffer and copies it in; a provider whose memory
    /// the kernel can address overrides it, so that the kernel's copy is the
    /// only one.
    fn read_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut buf = vec![0u8; total];
        let n = crate::sys::read_into(fd, &mut buf, at)?;
        let mut done = 0;
        for &(off, len) in parts {
            let k = len.min(n - done);
            if k == 0 {
                break;
            }
            self.write_mapped(off, &buf[done..done + k])
                .map_err(std::io::Error::other)?;
            done += k;
        }
        Ok(n)
    }
    /// Writes the ranges `parts` of the mapping to `fd`, in order, as one
    /// `writev` (`at`: `None`) or `pwritev` at file offset `at`; bytes
    /// written. The default copies them out into a buffer first.
    fn write_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let mut buf = Vec::new();
        for &(off, len) in parts {
            let from = buf.len();
            buf.resize(from + len, 0);
            self.read_mapped(off, &mut buf[from..])
                .map_err(std::io::Error::other)?;
        }
        crate::sys::write_from(fd, &buf, at)
    }
}

/// A bounded window onto memory mapped in this process: a local region
/// ([`MemoryRegion::window`]) or a peer's region ([`QueuePair::remote_window`]).
/// It keeps the mapping alive; offsets are relative to the window.
#[derive(Clone)]
pub struct MemWindow {
    mem: std::sync::Arc<dyn MappedMem>,
    base: usize,
    len: usize,
}

impl std::fmt::Debug for MemWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemWindow")
            .field("base", &self.base)
            .field("len", &self.len)
            .finish()
    }
}

impl MemWindow {
    /// `len` bytes of `mem` from `base`.
    pub fn new(mem: std::sync::Arc<dyn MappedMem>, base: usize, len: usize) -> MemWindow {
        MemWindow { mem, base, len }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copies out of the window at `off` (bounds checked).
    pub fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        check_range(off, buf.len(), self.len)?;
        self.mem.read_mapped(self.base + off, buf)
    }
    /// Copies into the window at `off` (bounds checked).
    pub fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.len)?;
        self.mem.write_mapped(self.base + off, data)
    }
    /// Reads from `fd` into the ranges `parts` (offset, length) of the
    /// window, in order, with one `readv`, or `preadv` at file offset `at`
    /// (bounds checked; see [`MappedMem::read_fd_mapped`]); bytes read.
    pub fn read_fd(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let parts = self.rebase(parts)?;
        self.mem.read_fd_mapped(&parts, fd, at)
    }
    /// Writes the ranges `parts` of the window to `fd`, in order, with one
    /// `writev`, or `pwritev` at file offset `at` (bounds checked); bytes
    /// written.
    pub fn write_fd(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let parts = self.rebase(parts)?;
        self.mem.write_fd_mapped(&parts, fd, at)
    }
    /// `parts` of the window as ranges of the mapping, each checked.
    fn rebase(&self, parts: &[(usize, usize)]) -> std::io::Result<Vec<(usize, usize)>> {
        parts
            .iter()
            .map(|&(off, len)| {
                check_range(off, len, self.len)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                Ok((self.base + off, len))
            })
            .collect()
    }
}

/// Validates a send WR against QP limits; shared by providers.
#[inline]
pub fn validate_send(wr: &SendWr<'_>, cap: &QpCap, max_msg: u32) -> Result<()> {
    let len = wr.payload.len();
    let over_inline =
        matches!(wr.payload, Payload::Inline(d) if d.len() > cap.max_inline_data as usize);
    let send = matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_));
    if over_inline || (send && len > max_msg as u64) || len > u32::MAX as u64 {
        return send_refused(wr, cap, max_msg);
    }
    Ok(())
}

/// Why [`validate_send`] refuses `wr` (the first of its checks it fails).
#[cold]
fn send_refused(wr: &SendWr<'_>, cap: &QpCap, max_msg: u32) -> Result<()> {
    if let Payload::Inline(d) = wr.payload {
        if d.len() > cap.max_inline_data as usize {
            return Err(Error::InvalidArgument(format!(
                "inline payload of {} bytes exceeds max_inline_data {}",
                d.len(),
                cap.max_inline_data
            )));
        }
    }
    if matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)) && wr.payload.len() > max_msg as u64 {
        return Err(Error::InvalidArgument(format!(
            "SEND of {} bytes exceeds max_msg_size {max_msg}",
            wr.payload.len()
        )));
    }
    if wr.payload.len() > u32::MAX as u64 {
        return Err(Error::InvalidArgument("message longer than 4 GiB".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_transition_pair() {
        use QpState::*;
        use QpTransitionKind as K;
        for s in QpState::ALL {
            for k in QpTransitionKind::ALL {
                let expect = match (s, k) {
                    (_, K::Reset) => Some(Reset),
                    (_, K::Err) => Some(Err),
                    (Reset, K::Init) | (Init, K::Init) => Some(Init),
                    (Init, K::Rtr) => Some(Rtr),
                    (Rtr, K::Rts) | (Rts, K::Rts) => Some(Rts),
                    _ => None,
                };
                match (s.next(k), expect) {
                    (Ok(got), Some(want)) => assert_eq!(got, want, "{s:?} --{k:?}"),
                    (Result::Err(Error::InvalidTransition { from, to }), None) => {
                        assert_eq!((from, to), (s, k))
                    }
                    (r, e) => panic!("{s:?} --{k:?}: got {r:?}, want {e:?}"),
                }
            }
        }
    }

    #[test]
    fn gid_derivation() {
        let g = Gid::roce_v1_link_local(Mac([0x02, 0xfc, 0, 0, 0, 1]));
        assert_eq!(g.to_string(), "fe80::fc:ff:fe00:1");
        let v4 = Gid::from_ip("192.0.2.1".parse().unwrap());
        assert_eq!(v4.to_string(), "::ffff:192.0.2.1");
        assert_eq!(Gid::from_hex(&v4.to_hex()), Some(v4));
        assert_eq!(Gid::from_hex("zz"), None);
    }

    #[test]
    fn send_validation() {
        let cap = QpCap {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_inline_data: 8,
        };
        let wr = |op, payload| SendWr {
            wr_id: 1,
            op,
            payload,
            signaled: true,
        };
        assert!(validate_send(&wr(SendOp::Send, Payload::Inline(&[0; 8])), &cap, 100).is_ok());
        assert!(validate_send(&wr(SendOp::Send, Payload::Inline(&[0; 9])), &cap, 100).is_err());
        let big = [Sge {
            addr: 0,
            length: 101,
            lkey: 1,
        }];
        assert!(validate_send(&wr(SendOp::Send, Payload::Sges(&big)), &cap, 100).is_err());
        // WRITEs are not limited by the SEND message size.
        let w = SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: 1,
        };
        assert!(validate_send(&wr(w, Payload::Sges(&big)), &cap, 100).is_ok());
    }

    #[test]
    fn mtu_and_access() {
        assert_eq!(Mtu::for_ethernet_mtu(1500), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::for_ethernet_mtu(9000), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_ethernet_mtu(100), None);
        for m in [Mtu::Mtu256, Mtu::Mtu4096] {
            assert_eq!(Mtu::from_code(m.code()), Some(m));
        }
        let a = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        assert!(a.contains(Access::REMOTE_WRITE));
        assert!(!Access::LOCAL_WRITE.contains(Access::REMOTE_WRITE));
        assert!(check_range(10, 5, 15).is_ok());
        assert!(check_range(10, 6, 15).is_err());
        assert!(check_range(usize::MAX, 2, 15).is_err());
    }
}
