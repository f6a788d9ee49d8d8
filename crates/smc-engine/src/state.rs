//! The explicit states of a link group and of a connection's handshake, as the
//! endpoint runs them.
//!
//! Spec: `protocol-llc-cdc.md` §1.7 (first contact: the group exists before its
//! first link is confirmed), §1.9 and §7.3 (DELETE_LINK ALL, the last link lost:
//! the group terminates and its connections die), §5.6 (an idle group is ended
//! after 600 s / 610 s), §6 (which groups new connections may join), §7.2 (a link
//! fails while another is usable: connections move, the group lives on);
//! `protocol-clc.md` §4 (the CLC flows whose steps [`HandshakePhase`] names).
//!
//! Linux keeps no single state variable for a link group: it has the
//! `lgr_pending` mutexes held during a first contact, the `terminating` and
//! `freeing` flags, and the redundancy type (SINGLE, SYMMETRIC, ...). Our
//! [`LgrState`] makes the same life cycle explicit, and [`LgrState::on`] is the
//! one place where it changes: a pure function from (state, event) to (next
//! state, what the endpoint must do), whose every pair is a reviewed golden table
//! (`tests/golden/lgr_table.txt`). The link states themselves are smc-proto's
//! [`smc_proto::link::LinkState`]; the close states of a connection are
//! [`smc_proto::close::CloseState`].

use core::fmt;

/// Life cycle of a link group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LgrState {
    /// First contact in progress, peer's end unknown: our first QP exists and went
    /// out in CLC (server: Accept sent, Confirm awaited). Not offered to other
    /// connections: a second connection to the same peer waits until the group is
    /// `Active` and then joins it (Linux's `lgr_pending` serialization).
    Creating,
    /// The first link's QP is connected to the peer's and CONFIRM_LINK is being
    /// exchanged (the link is ACTIVATING, §1.7). Still not offered to others.
    Confirming,
    /// At least one usable link: connections run and new ones may join (§6).
    /// Further links may come and go; with no connection left the idle timer runs.
    Active,
    /// Ended: the last link was lost, DELETE_LINK ALL was sent or received, the
    /// first link never got confirmed, or the idle time expired. Connections are
    /// killed (or their handshakes fall back); the group is freed once the last
    /// one is gone.
    Terminating,
    /// Removed from the endpoint; its provider objects are released.
    Freed,
}

impl LgrState {
    /// Every state, in life-cycle order.
    pub const ALL: [LgrState; 5] = [
        LgrState::Creating,
        LgrState::Confirming,
        LgrState::Active,
        LgrState::Terminating,
        LgrState::Freed,
    ];

    /// New connections may join the group (reuse, §6).
    pub fn accepts_connections(self) -> bool {
        self == LgrState::Active
    }

    /// A first contact with the peer is still in progress: other connections to
    /// the same peer wait for its outcome.
    pub fn first_contact_pending(self) -> bool {
        matches!(self, LgrState::Creating | LgrState::Confirming)
    }

    /// The transition for `ev`: the next state and what the endpoint must do.
    pub fn on(self, ev: LgrEvent) -> (LgrState, LgrAction) {
        use LgrAction as A;
        use LgrEvent as E;
        use LgrState as S;
        match (self, ev) {
            // Gone is gone.
            (S::Freed, _) => (S::Freed, A::Nothing),
            // A group terminates once, whatever the trigger (§1.9, §7.3).
            (S::Terminating, E::LastConnGone) => (S::Freed, A::Free),
            (S::Terminating, _) => (S::Terminating, A::Nothing),
            (_, E::Terminated) => (S::Terminating, A::KillConnections),

            (S::Creating, E::FirstLinkConnected) => (S::Confirming, A::Nothing),
            // The handshake that created the group died before the peer's end was
            // known: nothing was confirmed, nothing to tell the peer.
            (S::Creating, E::LastConnGone) => (S::Freed, A::Free),
            (S::Creating, _) => (S::Creating, A::Nothing),

            (S::Confirming, E::LinkActive) => (S::Active, A::EstablishWaiting),
            // The handshake that created the group failed (declined, TCP
            // closed, its link lost) while the link was being confirmed: the
            // group ends with it (Linux `smc_conn_abort` →
            // `smc_lgr_cleanup_early` for a local first contact) rather than
            // idling for ten minutes once the peer's CONFIRM_LINK completes it.
            (S::Confirming, E::LastConnGone) => (S::Terminating, A::Abandon),
            // CONFIRM_LINK still decides.
            (S::Confirming, _) => (S::Confirming, A::Nothing),

            // A further link joined: new connections may be assigned to it.
            (S::Active, E::LinkActive) => (S::Active, A::Nothing),
            // §7.2: another link is usable, the failed link's connections move.
            (S::Active, E::LinkDown { usable_left: true }) => (S::Active, A::MoveConnections),
            // The last link: `Terminated` follows from the link group (§7.3).
            (S::Active, E::LinkDown { usable_left: false }) => (S::Active, A::Nothing),
            // No connection for the idle time: DELETE_LINK ALL, orderly (§5.6).
            (S::Active, E::IdleExpired) => (S::Terminating, A::DeleteAll),
            (S::Active, _) => (S::Active, A::Nothing),
        }
    }
}

impl fmt::Display for LgrState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            LgrState::Creating => "CREATING",
            LgrState::Confirming => "CONFIRMING",
            LgrState::Active => "ACTIVE",
            LgrState::Terminating => "TERMINATING",
            LgrState::Freed => "FREED",
        };
        f.write_str(s)
    }
}

/// What happens to a link group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LgrEvent {
    /// The first link's QP was connected to the peer's (client: Accept received;
    /// server: Confirm received).
    FirstLinkConnected,
    /// A link finished its CONFIRM_LINK exchange.
    LinkActive,
    /// A link went down (QP error, keepalive, DELETE_LINK from the peer);
    /// `usable_left` says whether another link is still usable.
    LinkDown {
        /// Another link is usable.
        usable_left: bool,
    },
    /// The link group ended (smc-proto's `Terminated`: no usable link left,
    /// DELETE_LINK ALL either way, first CONFIRM_LINK missing, out of sync).
    Terminated,
    /// The group has had no connection for the idle timeout.
    IdleExpired,
    /// The last connection left the group.
    LastConnGone,
}

impl LgrEvent {
    /// Every event, for tables.
    pub const ALL: [LgrEvent; 7] = [
        LgrEvent::FirstLinkConnected,
        LgrEvent::LinkActive,
        LgrEvent::LinkDown { usable_left: true },
        LgrEvent::LinkDown { usable_left: false },
        LgrEvent::Terminated,
        LgrEvent::IdleExpired,
        LgrEvent::LastConnGone,
    ];
}

/// What the endpoint does on a transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LgrAction {
    /// Nothing beyond the state change.
    Nothing,
    /// Connections waiting for the first link (handshake phase `AwaitLink`) are
    /// established.
    EstablishWaiting,
    /// The failed link's connections move to a usable link (§7.2), its QP is
    /// released and its slot freed.
    MoveConnections,
    /// End the group on our initiative: DELETE_LINK ALL, orderly, "program
    /// initiated" (§5.6), then the group terminates.
    DeleteAll,
    /// Kill every connection (§5.5): handshakes in progress decline and fall
    /// back (TIMEOUT_CL; a first contact after its CLC exchange through
    /// [`HandshakePhase::AwaitLateDecline`]), established ones are aborted
    /// without a CDC.
    KillConnections,
    /// End a group whose first contact failed before its link was confirmed:
    /// no link is active, so nothing goes to the peer; the group terminates.
    Abandon,
    /// Release the provider objects and forget the group.
    Free,
}

/// Where a connection's CLC handshake stands (`protocol-clc.md` §4). After
/// `Smc`, the connection's state is its close state
/// ([`smc_proto::close::CloseState`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandshakePhase {
    /// Client: Proposal sent, waiting for Accept or Decline (6 s).
    AwaitAccept,
    /// Client, reused group: our CONFIRM_RKEY is out; the CLC Confirm follows its
    /// positive response (§1.11).
    ClientRkey,
    /// Server: waiting for the Proposal (6 s).
    AwaitProposal,
    /// Server: a first contact with the same peer is in progress; the Proposal
    /// waits for its outcome, then joins that group or makes its own first
    /// contact (Linux `lgr_pending`).
    AwaitLgr,
    /// Server, reused group: our CONFIRM_RKEY is out; the Accept follows.
    ServerRkey,
    /// Server: Accept sent, waiting for the Confirm (6 s).
    AwaitConfirm,
    /// First contact: CLC done, waiting for the CONFIRM_LINK exchange (§1.7).
    AwaitLink,
    /// First contact: the link failed (or CONFIRM_LINK did not come) after the
    /// CLC exchange. The peer's Decline is read until a deadline — a server
    /// 0.5 s, a client until 5 s after its Confirm, so that the server is the
    /// one that declines — and ends the handshake (PEERDECL) without one of
    /// ours; without it, ours (TIMEOUT_CL) goes out (`protocol-clc.md` §4.2,
    /// §4.3, §4.6; Linux `smcr_serv_conf_first_link`,
    /// `smcr_clnt_conf_first_link`).
    AwaitLateDecline,
    /// Our late Decline is out. A Decline of the peer's that crossed it would
    /// be the first thing on TCP: it is consumed, never handed to the
    /// application as data; any other first bytes are data. Ends (fallback)
    /// with those first bytes, the TCP end, or after 1 s.
    LateDeclined,
    /// Established: data moves over RDMA.
    Smc,
    /// Ended without SMC-R or failed (fallback to TCP, or an error).
    Done,
}

impl HandshakePhase {
    /// Every phase.
    pub const ALL: [HandshakePhase; 11] = [
        HandshakePhase::AwaitAccept,
        HandshakePhase::ClientRkey,
        HandshakePhase::AwaitProposal,
        HandshakePhase::AwaitLgr,
        HandshakePhase::ServerRkey,
        HandshakePhase::AwaitConfirm,
        HandshakePhase::AwaitLink,
        HandshakePhase::AwaitLateDecline,
        HandshakePhase::LateDeclined,
        HandshakePhase::Smc,
        HandshakePhase::Done,
    ];
}

/// What `smcss -d` and `-R` show of one connection (Linux's
/// `smc_diag_conninfo` and `smc_diag_lgrinfo`, smc_diag.c `__smc_diag_dump`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnDiag {
    /// Our alert token.
    pub token: u32,
    /// Our send buffer, our RMBE and the peer's RMBE (bytes).
    pub sndbuf_len: usize,
    /// Our RMBE (bytes).
    pub rmbe_len: usize,
    /// The peer's RMBE (bytes).
    pub peer_rmbe_len: usize,
    /// Cursors and flags of the last CDCs (absent before the data path exists).
    pub cursors: Option<smc_proto::datapath::DiagCursors>,
    /// The link group and link (slot) the connection uses.
    pub lgr: Option<crate::endpoint::LgrId>,
    /// Its link's slot.
    pub link: Option<usize>,
}

/// One link of a link group, as `smcr linkgroup link-show -dd` shows it
/// (Linux's `SMC_NLA_LINK_*`, smc_core.c `smc_nl_fill_lgr_link`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkDiag {
    /// smc-proto's slot.
    pub slot: usize,
    /// The link id (`link_num`; 0 until a client learns it).
    pub link_id: u8,
    /// Its state.
    pub state: smc_proto::link::LinkState,
    /// Our GID and QP number.
    pub gid: smc_wire::types::Gid,
    /// Our QP number.
    pub qpn: u32,
    /// The peer's GID.
    pub peer_gid: smc_wire::types::Gid,
    /// The peer's QP number.
    pub peer_qpn: u32,
    /// The peer's link user id (from its CONFIRM_LINK / ADD_LINK).
    pub peer_link_uid: u32,
}

/// A link group as `smcr -d linkgroup` shows it (Linux's `SMC_NLA_LGR_R_*`,
/// smc_core.c `smc_nl_fill_lgr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LgrDiag {
    /// Life-cycle state.
    pub state: LgrState,
    /// Whether we were client or server when the group was created.
    pub role: smc_proto::link::Role,
    /// The engine's link group id (sent in link user ids).
    pub id: u32,
    /// SMC version of the group (1 or 2) and the v2 release agreed.
    pub version: u8,
    /// The v2 release agreed (first-contact extension).
    pub release: u8,
    /// The peer's system id (instance and RoCE MAC).
    pub peer_system_id: smc_wire::types::SystemId,
    /// Our GID on the group's links.
    pub gid: smc_wire::types::Gid,
    /// Its links, by slot.
    pub links: Vec<LinkDiag>,
    /// The peer's first-contact extension (v2 groups; Linux's
    /// `SMC_NLA_LGR_V2_*`, kept by smc_clc.c `smc_conn_save_peer_info_fce`):
    /// its host name, OS type (1 z/OS, 2 Linux, 3 AIX) and whether it
    /// reaches us directly (no gateway, its `v2_direct` bit).
    pub peer_v2: Option<PeerV2>,
    /// The EID the v2 first contact agreed on.
    pub eid: Option<smc_wire::types::Eid>,
}

/// What a v2 peer's first-contact extension (CLC Accept or Confirm) says
/// about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerV2 {
    /// Host name (blanks trimmed).
    pub host: String,
    /// OS type.
    pub os: u8,
    /// No gateway between the peers.
    pub direct: bool,
}

/// Buffer events of an endpoint over its life, as Linux counts them for
/// `smcr stats` (smc_stats.h `SMC_STAT_RMB_*`): buffers registered anew
/// and taken from a link group's pool, RMBs smaller than configured
/// because the wanted size could not be registered, writes that found the
/// send buffer full (once per wait, smc_tx.c `smc_tx_sendmsg`), and writes
/// larger than the whole send buffer or the peer's RMB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufCounts {
    /// RMBs and send buffers registered (`SMC_STAT_RMB_ALLOC`).
    pub alloc: u64,
    /// RMBs and send buffers reused from a pool (`SMC_STAT_RMB_REUSE`).
    pub reuse: u64,
    /// RMBs registered smaller than wanted (`SMC_STAT_RMB_DOWNGRADE`).
    pub rmb_downgrade: u64,
    /// Writes that found the send buffer full (`SMC_STAT_RMB_TX_FULL`).
    pub tx_full: u64,
    /// Writes larger than the send buffer (`SMC_STAT_RMB_TX_SIZE_SMALL`).
    pub tx_too_small: u64,
    /// Writes larger than the peer's RMB (`SMC_STAT_RMB_TX_PEER_SIZE_SMALL`).
    pub tx_peer_too_small: u64,
}

/// Messages an endpoint has sent and received on its links, over its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsgCounts {
    /// CDC messages posted (data and cursor updates, failover validations).
    pub cdc_sent: u64,
    /// CDC messages received (for a connection of ours or not).
    pub cdc_received: u64,
    /// LLC messages posted (requests and responses).
    pub llc_sent: u64,
    /// LLC messages received.
    pub llc_received: u64,
}
