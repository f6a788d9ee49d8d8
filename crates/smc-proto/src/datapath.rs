//! Data transfer of one connection: send buffer, peer RMBE, local RMBE, CDC cursors.
//!
//! Spec: `protocol-llc-cdc.md` §2 (CDC fields, seqno rules, cursor monotonicity,
//! §2.4 failover validation), §3 (sender state §3.1, what and where to write
//! §3.2, when to stop §3.3, receive side and consumer-cursor updates §3.4, urgent
//! data §3.5) and §7.2 (the sender's rewind when its connection changes link),
//! matching Linux `smc_tx.c`, `smc_rx.c` and `smc_cdc.c`.
//!
//! Internally every position is an absolute byte count (`u64`, never wraps in
//! practice); wire cursors (`wrap:count` in a ring) are derived from them when a
//! CDC is built and turned back into absolute positions when one arrives. That
//! keeps the arithmetic simple and lets every peer-supplied cursor be checked
//! against what is physically possible before it is believed:
//!
//! * a producer cursor may not claim more unread bytes than our RMBE holds,
//! * a consumer cursor may not claim the peer consumed bytes we never wrote,
//! * counts must lie inside the ring.
//!
//! A violation is a [`Violation`]: the connection must be aborted — the peer is
//! broken or hostile — never a panic, never a read outside the ring.
//!
//! The machine is sans-I/O. The driver copies application bytes into the send
//! buffer at [`DataPath::sndbuf_free_chunks`] and reports them with
//! [`DataPath::produced`]; [`DataPath::poll_tx`] then says which RDMA WRITEs to post
//! (at most two, sndbuf ranges to peer-RMBE offsets) followed by which CDC; the
//! driver reports the CDC's send completion with [`DataPath::on_cdc_sent`]. On the
//! receive side [`DataPath::on_cdc`] digests a peer CDC, [`DataPath::readable_chunks`]
//! says where unread bytes are in the local RMBE, and [`DataPath::consumed`]
//! records what the application took.
//!
//! Moving a connection to another link (§7.2) is [`DataPath::failover_rewind`]
//! on the sender (what the lost link may not have delivered is written again)
//! and the failover validation check in [`DataPath::on_cdc`] on the receiver (§2.4).

use crate::close::CloseFlags;
use core::fmt;
use smc_wire::cdc::{
    seqno_accept, write_chunks, CdcMessage, ConnStateFlags, Cursor, ProducerFlags, RingChunks,
};
use std::collections::VecDeque;

/// Linux's `SOCK_MIN_SNDBUF / 2` on 64-bit (§3.4): the floor of the consumer
/// update threshold for small RMBs.
pub const MIN_UPDATE_LIMIT: usize = 2304;

/// The failover reserve a connection keeps in a group that can fail over
/// ([`DataPath::set_failover_reserve`]): one byte is enough, the kernel's
/// reader answers `cons_curs_upd_req` whatever it reads.
pub const FAILOVER_RESERVE: usize = 1;

/// Sizes and tokens of one connection, from the CLC handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataPathConfig {
    /// Our send buffer (local only).
    pub sndbuf_len: usize,
    /// Our RMBE, which the peer writes into.
    pub rmbe_len: usize,
    /// The peer's RMBE, which we write into.
    pub peer_rmbe_len: usize,
    /// The peer's alert token: every CDC we send carries it.
    pub peer_token: u32,
}

/// One RDMA WRITE: `src` ranges of the send buffer (one or two, if the data wraps
/// there) to the contiguous range at `peer_offset` of the peer's RMBE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RdmaWrite {
    /// Offset in the peer's RMBE.
    pub peer_offset: usize,
    /// Length in bytes.
    pub len: usize,
    /// Send-buffer pieces `(offset, len)` that make up the data, in order.
    pub src: RingChunks,
}

/// What to post, in order: the writes, then the CDC, on the same QP so that the
/// peer sees the data before the CDC (RC ordering, §3.2 step 5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxBatch {
    /// Zero, one or two RDMA WRITEs.
    pub writes: Writes,
    /// The CDC announcing them (or only cursors/flags).
    pub cdc: CdcMessage,
    /// The CDC announces data the peer has not been told of: these WRITEs'
    /// or bytes written before without a CDC ([`DataPath::write_corked`]).
    pub brings_data: bool,
}

/// Zero, one or two RDMA WRITEs (the destination wraps at most once), kept
/// inline: a batch is made for every CDC sent, so it does not allocate. Use
/// it as a slice.
#[derive(Clone, Copy, Debug, Default)]
pub struct Writes {
    w: [RdmaWrite; 2],
    n: usize,
}

impl Writes {
    fn push(&mut self, w: RdmaWrite) {
        // (write_chunks never yields more than two pieces)
        if let Some(slot) = self.w.get_mut(self.n) {
            *slot = w;
            self.n += 1;
        }
    }
}

impl std::ops::Deref for Writes {
    type Target = [RdmaWrite];
    fn deref(&self) -> &[RdmaWrite] {
        self.w.get(..self.n).unwrap_or(&[])
    }
}

impl<'a> IntoIterator for &'a Writes {
    type Item = &'a RdmaWrite;
    type IntoIter = std::slice::Iter<'a, RdmaWrite>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Writes {
    fn eq(&self, other: &Writes) -> bool {
        **self == **other
    }
}

impl Eq for Writes {}

/// A peer CDC that cannot be true: abort the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A cursor count at or beyond its ring.
    CursorOutOfRing {
        /// Which cursor.
        which: &'static str,
        /// Its count.
        count: u32,
        /// The ring size.
        ring: usize,
    },
    /// The producer cursor claims more unread data than our RMBE holds.
    ProducerOverrun {
        /// Unread bytes the cursor implies.
        unread: u64,
        /// Our RMBE size.
        rmbe_len: usize,
    },
    /// The consumer cursor claims the peer consumed bytes we never wrote.
    ConsumerOverrun {
        /// Bytes the peer would have consumed.
        consumed: u64,
        /// Bytes we have written.
        written: u64,
    },
    /// A send completion for a CDC that was never posted.
    UnknownCompletion(u16),
    /// A failover validation CDC claims a completed send we never received
    /// (§2.4): data was lost on the failed link and the connection is out of sync.
    OutOfSync {
        /// The last seqno we processed.
        last_received: u16,
        /// The seqno the peer says completed.
        claimed: u16,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::CursorOutOfRing { which, count, ring } => {
                write!(
                    f,
                    "peer {which} cursor count {count} outside its {ring}-byte ring"
                )
            }
            Violation::ProducerOverrun { unread, rmbe_len } => write!(
                f,
                "peer claims {unread} unread bytes in our {rmbe_len}-byte receive buffer"
            ),
            Violation::ConsumerOverrun { consumed, written } => write!(
                f,
                "peer claims to have consumed {consumed} bytes of the {written} we wrote"
            ),
            Violation::UnknownCompletion(s) => {
                write!(f, "completion for CDC seqno {s} that is not in flight")
            }
            Violation::OutOfSync {
                last_received,
                claimed,
            } => write!(
                f,
                "failover validation: peer completed seqno {claimed}, we processed only up to {last_received}"
            ),
        }
    }
}

impl std::error::Error for Violation {}

/// What a received CDC changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RxOutcome {
    /// The CDC was older than one already processed and was dropped (§2.3).
    pub stale: bool,
    /// New bytes are readable.
    pub new_data: usize,
    /// Bytes of our data the peer newly consumed (send space freed).
    pub freed: usize,
    /// Close flags the CDC carried (to feed the close machine).
    pub close: CloseFlags,
}

/// The absolute position `abs` as a wire cursor in a ring of `ring` bytes.
#[inline]
pub fn cursor_at(abs: u64, ring: usize) -> Cursor {
    let ring = ring.max(1) as u64;
    Cursor {
        wrap: ((abs / ring) & 0xFFFF) as u16,
        count: (abs % ring) as u32,
    }
}

/// The absolute position of wire cursor `c`, taken as the position at or after
/// `base - ring` closest to `base` that has `c`'s wrap and count — i.e. the unique
/// position within one wrap period of the reference. Callers then bound it.
fn absolute_near(base: u64, c: Cursor, ring: usize) -> u64 {
    let ring = ring.max(1) as u64;
    let period = ring * 0x1_0000;
    // (the position modulo the period)
    let target = u64::from(c.wrap) * ring + u64::from(c.count);
    // In base's period; then of it and the same position one period below
    // and above, the nearest to base (the lower on a tie, never below 0).
    let cur = base - base % period + target;
    if cur >= base {
        let above = cur - base;
        match cur.checked_sub(period) {
            Some(prev) if period - above <= above => prev,
            _ => cur,
        }
    } else {
        let below = base - cur;
        if period - below < below {
            cur + period
        } else {
            cur
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Inflight {
    seqno: u16,
    /// `tx_sent` after the writes this CDC announced.
    sent: u64,
    /// The urgent byte this CDC announced as present, if it did.
    urgent: Option<u64>,
}

/// The data-path state of one connection.
#[derive(Clone, Debug)]
pub struct DataPath {
    cfg: DataPathConfig,
    // --- sending (§3.1) ---
    tx_prep: u64,
    tx_sent: u64,
    tx_fin: u64,
    /// Just past the last byte put into the send buffer ([`Self::produced`]).
    buffered_end: u64,
    /// No byte below this that is in the send buffer waits for its CDC's
    /// completion: the bytes from `tx_fin` up to here went straight into the
    /// peer's RMBE ([`Self::produced_direct`]), so they hold no send-buffer
    /// space (see [`Self::sndbuf_free`]).
    direct_floor: u64,
    /// The highest `tx_sent` ever reached: a failover rewinds `tx_sent`, but the
    /// peer may already have consumed up to here.
    tx_sent_max: u64,
    peer_cons: u64,
    tx_seqno: u16,
    inflight: VecDeque<Inflight>,
    last_fin_seqno: u16,
    write_blocked_sent: bool,
    close_flags: CloseFlags,
    close_requested: CloseFlags,
    /// Absolute offset of our urgent byte not yet announced as present.
    tx_urgent: Option<u64>,
    /// A CDC has told the peer that urgent data is pending (urg_data_pending):
    /// while the byte cannot be written, no further CDC is needed for it.
    tx_urgent_announced: bool,
    cdc_wanted: bool,
    /// Bytes went into the peer's RMBE without a CDC of their own
    /// ([`Self::write_corked`]): the next CDC announces them (and rings the
    /// peer's reader, [`TxBatch::brings_data`]); `Some(blocked)`, whether they
    /// filled the peer's free space (that CDC's write_blocked).
    tx_corked: Option<bool>,
    // --- receiving (§3.4) ---
    rx_prod: u64,
    rx_cons: u64,
    rx_cons_confirmed: u64,
    rx_last_seqno: Option<u16>,
    peer_write_blocked: bool,
    peer_update_request: bool,
    /// Absolute offset of the peer's urgent byte, until the reader passes it
    /// (reads bytes after it; the read that reaches it skips it at once and
    /// stands at the mark, TCP's `SIOCATMARK`).
    rx_urgent: Option<u64>,
    /// The urgent byte was fetched out of band.
    rx_urgent_taken: bool,
    /// The peer announced urgent data that has not arrived yet.
    rx_urgent_pending: bool,
    /// The urgent byte stays in the stream (TCP's `SO_OOBINLINE`): reads
    /// stop before it and the read that starts at it returns it.
    oob_inline: bool,
    /// Flag bytes (producer, connection state) of the last CDC received
    /// and of the last one sent, for [`DataPath::diag`].
    rx_flags: [u8; 2],
    tx_flags: [u8; 2],
    // --- failover (§7.2) ---
    /// Bytes of the peer's RMBE left unwritten while the connection is not
    /// failing over (0: none, see [`DataPath::set_failover_reserve`]).
    failover_reserve: usize,
    /// A rewind released the reserve: it may be written until the peer's
    /// consumer cursor moves again.
    reserve_released: bool,
    /// Since a rewind, every CDC asks for the peer's consumer cursor
    /// (`cons_curs_upd_req`) until the peer's consumer cursor moves.
    cons_request: bool,
}

/// A connection's cursors and CDC flags as Linux's `smc_diag` reports them
/// (`struct smc_diag_conninfo`, filled in smc_diag.c `__smc_diag_dump`):
/// `rx_*` the last CDC received (its producer cursor in our RMBE, its
/// consumer cursor in the peer's), `tx_*` the last CDC sent, and the send
/// buffer's prepared, sent and confirmed positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiagCursors {
    /// Producer cursor received (ring: our RMBE).
    pub rx_prod: Cursor,
    /// Consumer cursor received (ring: the peer's RMBE).
    pub rx_cons: Cursor,
    /// Producer cursor sent (ring: the peer's RMBE).
    pub tx_prod: Cursor,
    /// Consumer cursor sent (ring: our RMBE).
    pub tx_cons: Cursor,
    /// Send buffer: written by the application.
    pub tx_prep: Cursor,
    /// Send buffer: written to the peer.
    pub tx_sent: Cursor,
    /// Send buffer: confirmed by the send completion.
    pub tx_fin: Cursor,
    /// Producer and connection-state flag bytes received.
    pub rx_flags: [u8; 2],
    /// Producer and connection-state flag bytes sent.
    pub tx_flags: [u8; 2],
}

/// What consuming bytes changes on the receive side (see
/// `DataPath::consume_step`).
#[derive(Clone, Copy, Debug)]
struct ConsumeStep {
    n: usize,
    rx_cons: u64,
    /// The read takes bytes after the urgent byte: the mark is behind it.
    urgent_gone: bool,
    cdc_wanted: bool,
    peer_write_blocked: bool,
}

/// A read of the receive side worked out before its bytes are copied
/// ([`DataPath::plan_consume`]), applied once they are
/// ([`DataPath::consume_planned`]): the fast path decides from it whether
/// it can send the CDC the read makes owed, and the step is worked out
/// once for both.
#[derive(Clone, Copy, Debug)]
pub struct ConsumePlan {
    step: ConsumeStep,
    /// `rx_cons` the plan was made at.
    from: u64,
    cdc_owed: bool,
}

impl ConsumePlan {
    /// Whether the receive side owes the peer a CDC after the read
    /// ([`DataPath::cdc_owed_after`]).
    pub fn cdc_owed(&self) -> bool {
        self.cdc_owed
    }
}

impl DataPath {
    /// A fresh connection.
    pub fn new(cfg: DataPathConfig) -> DataPath {
        DataPath {
            cfg,
            tx_prep: 0,
            tx_sent: 0,
            tx_fin: 0,
            buffered_end: 0,
            direct_floor: 0,
            tx_sent_max: 0,
            peer_cons: 0,
            tx_seqno: 0,
            inflight: VecDeque::new(),
            last_fin_seqno: 0,
            write_blocked_sent: false,
            close_flags: CloseFlags::NONE,
            close_requested: CloseFlags::NONE,
            tx_urgent: None,
            tx_urgent_announced: false,
            cdc_wanted: false,
            tx_corked: None,
            rx_prod: 0,
            rx_cons: 0,
            rx_cons_confirmed: 0,
            rx_last_seqno: None,
            peer_write_blocked: false,
            peer_update_request: false,
            rx_urgent: None,
            rx_urgent_taken: false,
            rx_urgent_pending: false,
            oob_inline: false,
            rx_flags: [0; 2],
            tx_flags: [0; 2],
            failover_reserve: 0,
            reserve_released: false,
            cons_request: false,
        }
    }

    /// Keeps `bytes` of the peer's RMBE unwritten in normal operation, for a
    /// connection that may fail over to another link (a group that has, had
    /// or expects two links; it may be set at any time, it only lowers what
    /// may be written from then on). Why: Linux marks its consumer cursor as told
    /// the moment it posts the CDC (smc_cdc.c `smc_cdc_msg_send`: `rx_curs_confirmed`),
    /// so a consumer update lost with a failed link is never sent again; its
    /// `smc_switch_cursor` (smc_core.c) rewinds only its own sending; and a
    /// CDC that asks for the cursor (`cons_curs_upd_req`) only makes it call
    /// `smc_tx_pending` (smc_cdc.c `smc_cdc_msg_recv_action`), which sends
    /// nothing when the kernel has no data of its own to send (smc_tx.c
    /// `__smc_tx_sndbuf_nonempty`). A sender whose peer's RMBE was
    /// full by its count when the link failed would then wait forever for a
    /// consumer cursor the peer believes it already sent. With the reserve, the
    /// first batch after a rewind always brings the peer bytes it has never
    /// seen, and its `cons_curs_upd_req` makes the kernel's reader send its
    /// consumer cursor as soon as it reads them (smc_tx.c
    /// `smc_tx_consumer_update`). RFC 7609's "Consumer Cursor Update
    /// Requested" flag asks the receiver for its consumer cursor outright;
    /// Linux answers it only as above, and where the two differ the kernel
    /// wins.
    pub fn set_failover_reserve(&mut self, bytes: usize) {
        self.failover_reserve = bytes.min(self.cfg.peer_rmbe_len.saturating_sub(1));
    }

    /// The cursors and flags `smcss -d` shows (see [`DiagCursors`]).
    pub fn diag(&self) -> DiagCursors {
        let (snd, rmbe, peer) = (
            self.cfg.sndbuf_len,
            self.cfg.rmbe_len,
            self.cfg.peer_rmbe_len,
        );
        DiagCursors {
            rx_prod: cursor_at(self.rx_prod, rmbe),
            rx_cons: cursor_at(self.peer_cons, peer),
            tx_prod: cursor_at(self.tx_sent, peer),
            tx_cons: cursor_at(self.rx_cons_confirmed, rmbe),
            tx_prep: cursor_at(self.tx_prep, snd),
            tx_sent: cursor_at(self.tx_sent, snd),
            tx_fin: cursor_at(self.tx_fin, snd),
            rx_flags: self.rx_flags,
            tx_flags: self.tx_flags,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DataPathConfig {
        &self.cfg
    }

    // ------------------------------------------------------------------ sending

    /// Free bytes in the send buffer: `S - (prep - fin)` (§3.1), where bytes
    /// written straight into the peer's RMBE, never in the send buffer, are
    /// not counted while no buffered byte before them waits for its
    /// completion. The send buffer is a ring indexed by stream offset: the
    /// next byte goes at `prep mod S`, and every byte that must stay (written
    /// to the peer, not completed: what a failover sends again) lies at or
    /// above `max(fin, direct_floor)`, so the `S` positions from there on
    /// hold nothing else. Without that, a stream of direct writes whose
    /// CDCs the peer has not taken yet (a reader that shares this CPU) would
    /// stop at one send buffer's worth, however large the peer's RMB.
    #[inline]
    pub fn sndbuf_free(&self) -> usize {
        let held = self
            .tx_prep
            .saturating_sub(self.tx_fin.max(self.direct_floor));
        self.cfg.sndbuf_len.saturating_sub(held as usize)
    }

    /// Where the next `min(n, free)` application bytes go in the send buffer.
    pub fn sndbuf_free_chunks(&self, n: usize) -> RingChunks {
        let len = n.min(self.sndbuf_free());
        write_chunks(
            self.cfg.sndbuf_len,
            cursor_at(self.tx_prep, self.cfg.sndbuf_len),
            len,
        )
        .unwrap_or_default()
    }

    /// The application put `n` more bytes into the send buffer (at the chunks
    /// [`Self::sndbuf_free_chunks`] gave). `n` is capped at the free space.
    pub fn produced(&mut self, n: usize) -> usize {
        let n = n.min(self.sndbuf_free());
        self.tx_prep += n as u64;
        self.buffered_end = self.tx_prep;
        n
    }

    /// As [`Self::produced`] for `n` bytes the caller writes straight into
    /// the peer's RMBE, not into the send buffer; sent at once (nothing may
    /// be unsent before them), they hold no send-buffer space once no
    /// buffered byte before them waits for its completion. Capped as
    /// `produced` is.
    pub fn produced_direct(&mut self, n: usize) -> usize {
        let n = n.min(self.sndbuf_free());
        self.tx_prep += n as u64;
        self.note_direct();
        n
    }

    /// The bytes up to `tx_prep` went straight into the peer's RMBE: if
    /// every buffered byte has completed, none below `tx_prep` holds space.
    fn note_direct(&mut self) {
        if self.buffered_end <= self.tx_fin {
            self.direct_floor = self.tx_prep;
        }
    }

    /// Marks the last byte produced as urgent (TCP `MSG_OOB`, §3.5): the CDC that
    /// carries it has urg_data_pending and urg_data_present, the byte being the
    /// one just before the producer cursor. One urgent byte at a time: false if
    /// the previous one has not gone out yet, or nothing was produced.
    pub fn mark_urgent(&mut self) -> bool {
        if self.tx_urgent.is_some() || self.tx_prep == self.tx_sent {
            return false;
        }
        self.tx_urgent = Some(self.tx_prep - 1);
        self.tx_urgent_announced = false;
        true
    }

    /// An urgent byte of ours waits to be written.
    pub fn urgent_pending(&self) -> bool {
        self.tx_urgent.is_some()
    }

    /// Bytes in the send buffer not yet written to the peer.
    #[inline]
    pub fn unsent(&self) -> usize {
        (self.tx_prep - self.tx_sent) as usize
    }

    /// Bytes written to the peer whose CDC has not completed yet, plus unsent ones:
    /// zero means everything the application wrote has left.
    pub fn unacked(&self) -> usize {
        (self.tx_prep - self.tx_fin) as usize
    }

    /// Free space in the peer's RMBE as we know it (§3.1 `peer_rmbe_space`)
    /// that may be written now: without the failover reserve, unless a
    /// rewind released it ([`Self::set_failover_reserve`]).
    #[inline]
    pub fn peer_space(&self) -> usize {
        let free = self.cfg.peer_rmbe_len - (self.tx_sent - self.peer_cons) as usize;
        if self.reserve_released {
            free
        } else {
            free.saturating_sub(self.failover_reserve)
        }
    }

    /// CDCs posted whose send completion has not arrived.
    pub fn cdcs_in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Requests the (sticky) close flags from the close machine. An orderly close
    /// or shutdown reaches the peer only after every byte written before it (the
    /// flags ride on the CDC that announces the last data, §5.2 "wait for tx
    /// drain"); an abort goes out at once and unsent data is discarded — after an
    /// abort nothing may be written into the peer's RMB, which the peer may free.
    pub fn set_close_flags(&mut self, f: CloseFlags) {
        self.close_requested = f;
        if f.abort {
            self.tx_prep = self.tx_sent;
            self.drop_unsent_urgent();
        }
    }

    /// An urgent byte that will never be written (discarded with the unsent
    /// data) is no longer pending: it must not keep asking for CDCs.
    fn drop_unsent_urgent(&mut self) {
        if self.tx_urgent.is_some_and(|u| u >= self.tx_prep) {
            self.tx_urgent = None;
        }
    }

    /// Gives up on unsent data so that a requested close can go out: Linux waits at
    /// most `SMC_MAX_STREAM_WAIT_TIMEOUT` (2 s) for the send buffer to drain
    /// before it sends the close anyway (§5.2, §5.6). Returns the bytes dropped.
    pub fn discard_unsent(&mut self) -> usize {
        let n = self.unsent();
        self.tx_prep = self.tx_sent;
        self.drop_unsent_urgent();
        n
    }

    /// A requested close is still waiting for unsent data to leave.
    #[inline]
    pub fn close_pending(&self) -> bool {
        self.close_flags != self.close_requested
    }

    /// Whether the CDC made last ([`Self::poll_tx`], [`Self::poll_tx_direct`])
    /// should report its send's completion rather than leave it to a later
    /// one's (selective signaling, as verbs allows: an RC send queue
    /// completes in order). It should where something waits for it: the CDC
    /// carries close flags (the close finishes with its completion), or
    /// bytes of the send buffer wait for it, whose space its completion
    /// gives back (§3.2 step 6; the kernel's smc_cdc.c `smc_cdc_tx_handler`,
    /// which releases the space at every CDC's completion, so that a writer
    /// goes on as it would against Linux). Bytes written straight into the
    /// peer's RMBE and cursor updates hold nothing.
    #[inline]
    pub fn wants_completion(&self) -> bool {
        self.close_flags.any() || self.tx_prep > self.tx_fin.max(self.direct_floor)
    }

    /// The close flags that have gone out (on a posted CDC).
    pub fn close_flags_sent(&self) -> CloseFlags {
        self.close_flags
    }

    /// Whether data may still be sent: no abort requested.
    fn may_send_data(&self) -> bool {
        !self.close_requested.abort
    }

    /// Asks for a CDC even without data (e.g. a forced consumer update).
    pub fn request_cdc(&mut self) {
        self.cdc_wanted = true;
    }

    /// A CDC is owed even without data to write (requested, a forced
    /// consumer update, the re-announcement after a failover rewind, or
    /// bytes written without their CDC, [`Self::write_corked`]).
    pub fn cdc_wanted(&self) -> bool {
        self.cdc_wanted || self.tx_corked.is_some()
    }

    /// The next batch to post, if any: the RDMA WRITEs for as much unsent data as
    /// the peer's RMBE has room for, and the CDC announcing them; or a CDC alone
    /// when cursors or flags must reach the peer. The batch is accounted as posted.
    pub fn poll_tx(&mut self) -> Option<TxBatch> {
        let to_send = if self.may_send_data() {
            self.unsent()
        } else {
            0
        };
        let space = self.peer_space();
        let (mut len, blocked) = smc_wire::cdc::write_len(to_send, space);
        // The urgent byte must end a write: it is "the byte before the producer
        // cursor" of the CDC that says urg_data_present (§3.5).
        if let Some(u) = self.tx_urgent {
            len = len.min((u + 1 - self.tx_sent) as usize);
        }
        // write_blocked as Linux sets it (smc_tx.c `smc_tx_rdma_writes`): on
        // a CDC that carries data, when the data to send fills the peer's
        // free space; it stays as it was on CDCs without data (the kernel
        // keeps it in `local_tx_ctrl.prod_flags`) and never calls for a CDC
        // of its own: the peer forgets it once it has read everything, and
        // with its RMB full it sends the consumer update anyway (§3.4).
        // (corked bytes, written before, are announced by this CDC too: as
        // a batch of theirs would have said)
        let blocked = match (len, self.tx_corked) {
            (0, Some(corked)) => corked,
            (0, None) => self.write_blocked_sent,
            _ => blocked,
        };
        let brings_data = len > 0 || self.tx_corked.is_some();
        let consumer_update = self.consumer_update_due();
        let urgent_news = self.tx_urgent.is_some() && !self.tx_urgent_announced;
        // A requested close can go out once nothing written before it is unsent.
        let close_due = self.close_flags != self.close_requested
            && (self.close_requested.abort || to_send == len);
        if !brings_data && !self.cdc_wanted && !consumer_update && !close_due && !urgent_news {
            return None;
        }
        let mut writes = Writes::default();
        if len > 0 {
            let dst = write_chunks(
                self.cfg.peer_rmbe_len,
                cursor_at(self.tx_sent, self.cfg.peer_rmbe_len),
                len,
            )
            .ok()?;
            let mut src_pos = self.tx_sent;
            for &(peer_offset, l) in dst.as_slice() {
                let src = write_chunks(
                    self.cfg.sndbuf_len,
                    cursor_at(src_pos, self.cfg.sndbuf_len),
                    l,
                )
                .ok()?;
                writes.push(RdmaWrite {
                    peer_offset,
                    len: l,
                    src,
                });
                src_pos += l as u64;
            }
            self.tx_sent += len as u64;
            self.tx_sent_max = self.tx_sent_max.max(self.tx_sent);
        }
        let cdc = self.seal_cdc(blocked);
        Some(TxBatch {
            writes,
            cdc,
            brings_data,
        })
    }

    /// [`Self::produced_direct`] and [`Self::poll_tx`] at once for `n` bytes
    /// that the caller copies into the peer's RMBE itself, from its own
    /// buffer (the fast path): where they go there, and the CDC that
    /// announces them. The same batch `poll_tx` would make, without the
    /// send-buffer pieces it would name as their source, for the one case
    /// the fast path takes — nothing unsent, urgent or closing before them,
    /// room for all `n` in the peer's RMBE and in the send buffer as
    /// [`Self::sndbuf_free`] counts it — and `None`, nothing changed, in
    /// every other.
    #[inline]
    pub fn poll_tx_direct(&mut self, n: usize) -> Option<(RingChunks, CdcMessage)> {
        let space = self.peer_space();
        if n == 0
            || n > space
            || n >= self.sndbuf_free()
            || self.unsent() > 0
            || self.tx_urgent.is_some()
            || self.close_pending()
            || self.close_requested.abort
        {
            return None;
        }
        let dst = write_chunks(
            self.cfg.peer_rmbe_len,
            cursor_at(self.tx_sent, self.cfg.peer_rmbe_len),
            n,
        )
        .ok()?;
        // (`produced_direct` without its cap: the room was checked above)
        self.tx_prep += n as u64;
        self.note_direct();
        self.tx_sent += n as u64;
        self.tx_sent_max = self.tx_sent_max.max(self.tx_sent);
        // (`write_len`'s write_blocked: the data fills the peer's free space)
        let cdc = self.seal_cdc(n >= space);
        Some((dst, cdc))
    }

    /// How many of `n` bytes [`Self::write_corked`] would take now (0: none,
    /// something unsent, urgent or closing comes before them), for a caller
    /// that copies them before it accounts them.
    pub fn corkable(&self, n: usize) -> usize {
        if self.unsent() > 0
            || self.tx_urgent.is_some()
            || self.close_pending()
            || self.close_requested.abort
        {
            return 0;
        }
        n.min(self.peer_space()).min(self.sndbuf_free())
    }

    /// Up to `n` bytes that go straight into the peer's RMBE without a CDC
    /// of their own, while the link has no send slot for one: where they
    /// go (empty: none), accounted as written; the next CDC, owed from now
    /// on ([`Self::cdc_wanted`]), announces them with whatever follows.
    /// Linux corks its sends the same way while a CDC is in flight (smc_tx.c
    /// `smc_tx_sendmsg`, `smc_tx_should_cork`), so that a sender ahead of
    /// its link writes on instead of waiting for a slot. The same
    /// conditions as [`Self::poll_tx_direct`] (nothing unsent, urgent or
    /// closing before them), and as many bytes as the peer's RMBE and the
    /// send buffer take ([`Self::produced_direct`]'s count).
    pub fn write_corked(&mut self, n: usize) -> RingChunks {
        let space = self.peer_space();
        let n = self.corkable(n);
        if n == 0 {
            return RingChunks::default();
        }
        let Ok(dst) = write_chunks(
            self.cfg.peer_rmbe_len,
            cursor_at(self.tx_sent, self.cfg.peer_rmbe_len),
            n,
        ) else {
            return RingChunks::default();
        };
        self.tx_prep += n as u64;
        self.note_direct();
        self.tx_sent += n as u64;
        self.tx_sent_max = self.tx_sent_max.max(self.tx_sent);
        // (write_blocked as a batch of their own would have said it: the
        // peer's free space is used up; the latest corked part tells)
        self.tx_corked = Some(n >= space);
        dst
    }

    /// The CDC of a batch whose writes are accounted (`tx_sent`), with
    /// write_blocked as given, and what sending it changes.
    #[inline]
    fn seal_cdc(&mut self, blocked: bool) -> CdcMessage {
        self.tx_seqno = self.tx_seqno.wrapping_add(1);
        self.write_blocked_sent = blocked;
        // Close flags go out once no data written before them is left unsent.
        if self.close_requested.abort || self.unsent() == 0 {
            self.close_flags = self.close_requested;
        }
        self.cdc_wanted = false;
        self.tx_corked = None;
        self.rx_cons_confirmed = self.rx_cons;
        self.peer_update_request = false;
        let mut prod_flags = ProducerFlags::empty();
        prod_flags.set(ProducerFlags::WRITE_BLOCKED, blocked);
        prod_flags.set(ProducerFlags::CONS_CURS_UPD_REQ, self.cons_request);
        let mut urgent_announced = None;
        if let Some(u) = self.tx_urgent {
            prod_flags.insert(ProducerFlags::URG_DATA_PENDING);
            self.tx_urgent_announced = true;
            if self.tx_sent == u + 1 {
                prod_flags.insert(ProducerFlags::URG_DATA_PRESENT);
                self.tx_urgent = None;
                urgent_announced = Some(u);
            }
        }
        let mut conn_flags = ConnStateFlags::empty();
        conn_flags.set(
            ConnStateFlags::PEER_DONE_WRITING,
            self.close_flags.done_writing,
        );
        conn_flags.set(ConnStateFlags::PEER_CONN_CLOSED, self.close_flags.closed);
        conn_flags.set(ConnStateFlags::PEER_CONN_ABORT, self.close_flags.abort);
        let cdc = CdcMessage {
            seqno: self.tx_seqno,
            token: self.cfg.peer_token,
            prod: cursor_at(self.tx_sent, self.cfg.peer_rmbe_len),
            cons: cursor_at(self.rx_cons, self.cfg.rmbe_len),
            prod_flags,
            conn_flags,
        };
        self.tx_flags = [prod_flags.bits(), conn_flags.bits()];
        self.inflight.push_back(Inflight {
            seqno: self.tx_seqno,
            sent: self.tx_sent,
            urgent: urgent_announced,
        });
        cdc
    }

    /// The CDC with `seqno` completed its send: its data's send-buffer space is
    /// released (`fin`, §3.2 step 6). Completions arrive in posting order.
    #[inline]
    pub fn on_cdc_sent(&mut self, seqno: u16) -> Result<(), Violation> {
        // (the oldest in flight, as a send queue completes in order: taken
        // without the search below, which it would end at once)
        if let Some(&i) = self.inflight.front().filter(|i| i.seqno == seqno) {
            self.inflight.pop_front();
            self.tx_fin = self.tx_fin.max(i.sent);
            self.last_fin_seqno = i.seqno;
            return Ok(());
        }
        if !self.inflight.iter().any(|i| i.seqno == seqno) {
            return Err(Violation::UnknownCompletion(seqno));
        }
        while let Some(i) = self.inflight.pop_front() {
            self.tx_fin = self.tx_fin.max(i.sent);
            self.last_fin_seqno = i.seqno;
            if i.seqno == seqno {
                break;
            }
        }
        Ok(())
    }

    /// The sends of `n` CDCs completed, the first `first` and the rest the
    /// seqnos after it, in order: the same as [`Self::on_cdc_sent`] for
    /// each in turn where they are the `n` oldest in flight, which they are
    /// as a send queue completes in order; anything else changes nothing
    /// and is `Err`, for the caller to take them one by one.
    #[inline]
    pub fn on_cdcs_sent(&mut self, first: u16, n: usize) -> Result<(), Violation> {
        let mut fin = self.tx_fin;
        let mut seq = first;
        for k in 0..n {
            match self.inflight.get(k) {
                Some(i) if i.seqno == seq => fin = fin.max(i.sent),
                _ => return Err(Violation::UnknownCompletion(seq)),
            }
            seq = seq.wrapping_add(1);
        }
        if n > 0 {
            self.inflight.drain(..n);
            self.tx_fin = fin;
            self.last_fin_seqno = seq.wrapping_sub(1);
        }
        Ok(())
    }

    /// Seqno of the last CDC whose send completed (for the failover validation CDC).
    pub fn last_completed_seqno(&self) -> u16 {
        self.last_fin_seqno
    }

    /// Where a [`Self::failover_rewind`] now would restart sending (absolute).
    pub fn replay_from(&self) -> u64 {
        self.tx_fin.max(self.peer_cons)
    }

    /// Bytes posted to the peer so far (absolute send cursor).
    pub fn sent_total(&self) -> u64 {
        self.tx_sent
    }

    /// The connection moves to another link because its link failed (§7.2 step
    /// 2). CDCs whose send completion has not been seen may or may not have
    /// reached the peer, so the sender goes back to what is confirmed: *sent* :=
    /// *fin*, and the producer cursor with it. If the peer's consumer cursor is
    /// already beyond that (it read data whose CDC completion we never saw), both
    /// move forward to it — that data arrived. Everything after is written again
    /// to the same RMBE offsets on the new link (identical bytes, harmless to the
    /// peer, whose cursors never move backwards) and announced by CDCs whose
    /// seqnos continue the connection's sequence; completions of the old CDCs
    /// must no longer be reported. An urgent byte announced by a lost CDC is
    /// announced again. One CDC is requested even without data, so that our
    /// consumer cursor and sticky close flags reach the peer over the new link.
    ///
    /// Returns the failover validation CDC to send first on the new link (§2.4):
    /// seqno of the last completed CDC, flag 0x08, nothing else.
    pub fn failover_rewind(&mut self) -> CdcMessage {
        let base = self.tx_fin.max(self.peer_cons);
        let lost_urgent = self
            .inflight
            .iter()
            .filter_map(|i| i.urgent)
            .find(|&u| u >= base);
        self.inflight.clear();
        self.tx_fin = base;
        self.tx_sent = base;
        if let Some(u) = lost_urgent {
            if self.tx_urgent.is_none() {
                self.tx_urgent = Some(u);
            }
        }
        self.tx_urgent_announced = false;
        // An abort discards unsent data; it must not come back through the rewind.
        if self.close_requested.abort {
            self.tx_prep = self.tx_sent;
            self.drop_unsent_urgent();
        }
        self.tx_prep = self.tx_prep.max(self.tx_sent);
        self.write_blocked_sent = false;
        self.cdc_wanted = true;
        // The peer's consumer updates sent over the failed link may be lost,
        // and Linux does not send them again: ask for one on every CDC, and
        // let the reserve bring it bytes it has not seen so that its reader
        // answers (see `set_failover_reserve`). Not needed when the peer has
        // told us it read everything we ever wrote.
        self.cons_request = self.peer_cons < self.tx_sent_max;
        self.reserve_released = self.cons_request;
        CdcMessage::failover_validation(self.last_fin_seqno, self.cfg.peer_token)
    }

    // ---------------------------------------------------------------- receiving

    /// Whether `msg` is a failover validation CDC (§2.4) that claims a
    /// completed send this side has not processed: what [`Self::on_cdc`]
    /// would take as [`Violation::OutOfSync`].
    pub fn validation_shows_loss(&self, msg: &CdcMessage) -> bool {
        msg.is_failover_validation()
            && smc_wire::cdc::failover_out_of_sync(self.rx_last_seqno.unwrap_or(0), msg.seqno)
    }

    /// Digests a CDC from the peer (§2.3, §3.4). A failover validation CDC is
    /// never processed as data (§2.4): it is ignored unless it shows that data was
    /// lost ([`Violation::OutOfSync`], the connection must be aborted).
    pub fn on_cdc(&mut self, msg: &CdcMessage) -> Result<RxOutcome, Violation> {
        if msg.is_failover_validation() {
            if self.validation_shows_loss(msg) {
                return Err(Violation::OutOfSync {
                    last_received: self.rx_last_seqno.unwrap_or(0),
                    claimed: msg.seqno,
                });
            }
            return Ok(RxOutcome {
                stale: true,
                ..RxOutcome::default()
            });
        }
        if let Some(last) = self.rx_last_seqno {
            if !seqno_accept(msg.seqno, last) {
                return Ok(RxOutcome {
                    stale: true,
                    ..RxOutcome::default()
                });
            }
        }
        let rl = self.cfg.rmbe_len;
        let pl = self.cfg.peer_rmbe_len;
        if msg.prod.count as usize >= rl {
            return Err(Violation::CursorOutOfRing {
                which: "producer",
                count: msg.prod.count,
                ring: rl,
            });
        }
        if msg.cons.count as usize >= pl {
            return Err(Violation::CursorOutOfRing {
                which: "consumer",
                count: msg.cons.count,
                ring: pl,
            });
        }
        // Producer: the peer's write position in our RMBE.
        let prod = absolute_near(self.rx_prod, msg.prod, rl);
        if prod.saturating_sub(self.rx_cons) > rl as u64 {
            return Err(Violation::ProducerOverrun {
                unread: prod - self.rx_cons,
                rmbe_len: rl,
            });
        }
        // Consumer: how much of our data the peer has read. After a failover
        // rewind the peer may have read beyond our (rewound) *sent*, never beyond
        // what we ever wrote.
        let cons = absolute_near(self.peer_cons, msg.cons, pl);
        if cons > self.tx_sent_max {
            return Err(Violation::ConsumerOverrun {
                consumed: cons,
                written: self.tx_sent_max,
            });
        }
        self.rx_last_seqno = Some(msg.seqno);
        self.rx_flags = [msg.prod_flags.bits(), msg.conn_flags.bits()];
        // Cursors never move backwards (§2.3).
        let new_data = prod.saturating_sub(self.rx_prod) as usize;
        self.rx_prod = self.rx_prod.max(prod);
        let freed = cons.saturating_sub(self.peer_cons) as usize;
        self.peer_cons = self.peer_cons.max(cons);
        if freed > 0 || self.peer_cons == self.tx_sent_max {
            // the peer's consumer cursor reaches us again: back to normal
            self.cons_request = false;
            self.reserve_released = false;
        }
        if self.peer_cons > self.tx_sent {
            // Data we are about to write again has arrived after all (§7.2: move
            // the cursors forward by the difference).
            self.tx_sent = self.peer_cons;
            self.tx_fin = self.tx_fin.max(self.peer_cons);
            self.tx_prep = self.tx_prep.max(self.tx_sent);
            if self.tx_urgent.is_some_and(|u| u < self.tx_sent) {
                self.tx_urgent = None;
            }
        }
        self.peer_write_blocked = msg.prod_flags.write_blocked();
        if msg.prod_flags.urg_data_present() && new_data > 0 {
            // the byte just before the new producer cursor is urgent (§3.5)
            self.rx_urgent = Some(self.rx_prod - 1);
            self.rx_urgent_taken = false;
            self.rx_urgent_pending = false;
            self.pass_urgent_byte();
        } else if msg.prod_flags.urg_data_pending() {
            self.rx_urgent_pending = true;
        }
        if msg.prod_flags.cons_curs_upd_req() {
            self.peer_update_request = true;
        }
        Ok(RxOutcome {
            stale: false,
            new_data,
            freed,
            close: CloseFlags {
                done_writing: msg.conn_flags.peer_done_writing(),
                closed: msg.conn_flags.peer_conn_closed(),
                abort: msg.conn_flags.peer_conn_abort(),
            },
        })
    }

    /// Unread bytes in our RMBE that a normal read may return: reads stop at the
    /// urgent byte (the "mark"), which is not part of the normal stream (in
    /// line, [`Self::set_oob_inline`], it is: the read that starts at it
    /// returns it).
    #[inline]
    pub fn readable(&self) -> usize {
        let end = match self.rx_urgent {
            // (in line, a read that starts at the urgent byte returns it
            // and what follows: tcp.c `tcp_recvmsg_locked`, whose stop at
            // `urg_seq` is only for a read that copied something)
            Some(u) if u > self.rx_cons || (u == self.rx_cons && !self.oob_inline) => u,
            _ => self.rx_prod,
        };
        (end - self.rx_cons) as usize
    }

    /// What TCP's `FIONREAD` (`SIOCINQ`) counts: the bytes a read returns
    /// before the urgent byte's mark, none while the reader stands at it
    /// (include/net/tcp.h `tcp_inq`: `urg_seq - copied_seq`), else
    /// [`Self::readable`].
    pub fn inq(&self) -> usize {
        if self.oob_inline {
            return self.unread();
        }
        match self.rx_urgent {
            // (skipped, and nothing read after it)
            Some(u) if self.rx_cons == u + 1 => 0,
            _ => self.readable(),
        }
    }

    /// Unread bytes in our RMBE including an urgent byte not yet passed.
    pub fn unread(&self) -> usize {
        (self.rx_prod - self.rx_cons) as usize
    }

    /// Urgent data was announced by the peer (urg_data_pending) or is present.
    #[inline]
    pub fn urgent_signalled(&self) -> bool {
        self.rx_urgent_pending || (self.rx_urgent.is_some() && !self.rx_urgent_taken)
    }

    /// Where the peer's urgent byte is in our RMBE, if it is there and has not been
    /// fetched yet (TCP `recv(MSG_OOB)`): the caller reads that one byte and calls
    /// [`Self::urgent_taken`].
    #[inline]
    pub fn urgent_offset(&self) -> Option<usize> {
        match self.rx_urgent {
            Some(u) if !self.rx_urgent_taken => {
                Some((u % self.cfg.rmbe_len.max(1) as u64) as usize)
            }
            _ => None,
        }
    }

    /// The urgent byte was fetched out of band.
    pub fn urgent_taken(&mut self) {
        self.rx_urgent_taken = true;
    }

    /// True when the reader stands at the urgent byte's mark (TCP's
    /// `SIOCATMARK`): the next normal read starts at it, or right after it
    /// (normal reads skip it, as soon as they reach it). Linux's SMC says so
    /// the same way: its consumer cursor at `urg_curs`, one past the byte
    /// (af_smc.c `smc_ioctl`, smc_rx.c `smc_rx_update_consumer`).
    pub fn at_urgent_mark(&self) -> bool {
        self.rx_urgent
            .is_some_and(|u| self.rx_cons == u || (self.rx_cons == u + 1 && !self.oob_inline))
    }

    /// Keeps the peer's urgent byte in the stream (`true`, TCP's
    /// `SO_OOBINLINE`: `recv(MSG_OOB)` finds nothing, the byte is read in
    /// its place, and once read the mark is gone, tcp.c
    /// `tcp_recvmsg_locked`) or takes it out (`false`, the default). Linux's
    /// SMC follows the same socket flag (smc_rx.c `smc_rx_update_consumer`,
    /// `smc_rx_recv_urg`). A byte already skipped stays skipped.
    pub fn set_oob_inline(&mut self, on: bool) {
        self.oob_inline = on;
        self.pass_urgent_byte();
    }

    /// Whether the urgent byte stays in the stream ([`Self::set_oob_inline`]).
    pub fn oob_inline(&self) -> bool {
        self.oob_inline
    }

    /// The peer's urgent byte is still the stream's: the reader has not read
    /// past its mark (TCP clears it then, tcp.c `tcp_recvmsg_locked`, and
    /// `recv(MSG_OOB)` finds nothing; Linux's SMC moves to `SMC_URG_READ`).
    pub fn urgent_valid(&self) -> bool {
        self.rx_urgent.is_some()
    }

    /// Where up to `n` normally readable bytes are in our RMBE (one or two pieces).
    #[inline]
    pub fn readable_chunks(&self, n: usize) -> RingChunks {
        let len = n.min(self.readable());
        write_chunks(
            self.cfg.rmbe_len,
            cursor_at(self.rx_cons, self.cfg.rmbe_len),
            len,
        )
        .unwrap_or_default()
    }

    /// Where in the peer's RMBE the next `n` bytes of ours would go (at the
    /// send cursor; meaningful when nothing is unsent): what [`Self::poll_tx`]
    /// would make of them after [`Self::produced`]`(n)`.
    pub fn peer_write_chunks(&self, n: usize) -> RingChunks {
        write_chunks(
            self.cfg.peer_rmbe_len,
            cursor_at(self.tx_sent, self.cfg.peer_rmbe_len),
            n,
        )
        .unwrap_or_default()
    }

    /// The application consumed `n` bytes (capped at what is readable). Returns
    /// the bytes consumed.
    pub fn consumed(&mut self, n: usize) -> usize {
        let c = self.consume_step(n);
        self.apply_consume(c)
    }

    /// What [`Self::consumed`]`(n)` would do, and whether it leaves a CDC
    /// owed ([`Self::cdc_owed_after`]), for [`Self::consume_planned`] to
    /// apply after the bytes are copied.
    #[inline]
    pub fn plan_consume(&self, n: usize) -> ConsumePlan {
        let step = self.consume_step(n);
        ConsumePlan {
            step,
            from: self.rx_cons,
            cdc_owed: step.cdc_wanted || self.update_due_at(step.rx_cons, step.peer_write_blocked),
        }
    }

    /// Applies plan `p`, made by [`Self::plan_consume`] with nothing
    /// changed since: the same as [`Self::consumed`] with its length (which
    /// it falls back to if the consumer cursor moved meanwhile). The bytes
    /// consumed.
    #[inline]
    pub fn consume_planned(&mut self, p: ConsumePlan) -> usize {
        if p.from != self.rx_cons {
            return self.consumed(p.step.n);
        }
        self.apply_consume(p.step)
    }

    #[inline]
    fn apply_consume(&mut self, c: ConsumeStep) -> usize {
        self.rx_cons = c.rx_cons;
        if c.urgent_gone {
            self.rx_urgent = None;
        }
        self.cdc_wanted = c.cdc_wanted;
        self.peer_write_blocked = c.peer_write_blocked;
        // (a plan made before the urgent byte came ends at it)
        self.pass_urgent_byte();
        c.n
    }

    /// Out of line, a reader never stands at the urgent byte itself: once
    /// the byte is there and the reader has reached it, it is passed (its
    /// space freed, the reader at the mark, [`Self::at_urgent_mark`]), so
    /// that what follows it is readable, as TCP's read at the mark returns
    /// the bytes after it (tcp.c `tcp_recvmsg_locked`, `urg_hole`) and its
    /// poll shows them (`tcp_poll`: `target++` at the mark). Whichever
    /// comes last, the byte or the reader, does it.
    #[inline]
    fn pass_urgent_byte(&mut self) {
        if !self.oob_inline && self.rx_urgent == Some(self.rx_cons) && self.rx_prod > self.rx_cons {
            // (a read of nothing, which passes it; the reader then stands
            // past the byte, so the `apply_consume` this calls again finds
            // nothing to pass)
            let c = self.consume_step(0);
            self.apply_consume(c);
        }
    }

    /// What [`Self::consumed`]`(n)` would change, worked out without changing
    /// anything (so that [`Self::cdc_owed_after`] cannot disagree with it).
    #[inline]
    fn consume_step(&self, n: usize) -> ConsumeStep {
        let n = n.min(self.readable());
        let mut c = ConsumeStep {
            n,
            rx_cons: self.rx_cons + n as u64,
            // (in line: gone once read, tcp.c clears `urg_data` when the
            // copy passed `urg_seq`)
            urgent_gone: n > 0
                && self.rx_urgent.is_some_and(|u| {
                    self.rx_cons > u || (self.oob_inline && self.rx_cons + n as u64 > u)
                }),
            cdc_wanted: self.cdc_wanted,
            peer_write_blocked: self.peer_write_blocked,
        };
        if !self.oob_inline && self.rx_urgent == Some(c.rx_cons) && self.rx_prod > c.rx_cons {
            // Out-of-band semantics: the urgent byte is skipped by normal reads;
            // its space is released, which the peer learns at once (Linux forces
            // a consumer update here).
            c.rx_cons += 1;
            c.cdc_wanted = true;
        }
        if c.rx_cons == self.rx_prod {
            // Linux forgets the peer's write_blocked once everything is read.
            // Remember that an update is owed before forgetting.
            if c.peer_write_blocked && c.rx_cons > self.rx_cons_confirmed {
                c.cdc_wanted = true;
            }
            c.peer_write_blocked = false;
        }
        c
    }

    /// Whether, after [`Self::consumed`]`(n)`, the receive side would owe the
    /// peer a CDC (a consumer-cursor update, §3.4, or one already wanted):
    /// what a reader that sends its own updates checks before it reads.
    pub fn cdc_owed_after(&self, n: usize) -> bool {
        self.plan_consume(n).cdc_owed()
    }

    /// Linux's rule for a CDC that only updates the consumer cursor (§3.4): the
    /// peer asked for it, or more than `max(RMBE/10, 2304)` bytes were consumed
    /// since the last confirmed cursor and either the peer believes it has at most
    /// half the RMBE free or it is write-blocked.
    pub fn consumer_update_due(&self) -> bool {
        self.update_due_at(self.rx_cons, self.peer_write_blocked)
    }

    /// [`Self::consumer_update_due`] with the consumer cursor at `rx_cons`
    /// and the peer's write_blocked as given.
    #[inline]
    fn update_due_at(&self, rx_cons: u64, peer_write_blocked: bool) -> bool {
        let to_confirm = rx_cons - self.rx_cons_confirmed;
        if to_confirm == 0 {
            return false;
        }
        if self.peer_update_request {
            return true;
        }
        let rl = self.cfg.rmbe_len as u64;
        let limit = (rl / 10).max(MIN_UPDATE_LIMIT as u64);
        let sender_free = rl.saturating_sub(self.rx_prod - self.rx_cons_confirmed);
        to_confirm > limit && (sender_free <= rl / 2 || peer_write_blocked)
    }

    /// The peer's last CDC said it is write-blocked.
    pub fn peer_write_blocked(&self) -> bool {
        self.peer_write_blocked
    }

    /// Total bytes the peer has sent us, and we have sent, so far.
    pub fn totals(&self) -> (u64, u64) {
        (self.rx_prod, self.tx_sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(s: usize, r: usize, p: usize) -> DataPathConfig {
        DataPathConfig {
            sndbuf_len: s,
            rmbe_len: r,
            peer_rmbe_len: p,
            peer_token: 7,
        }
    }

    /// The former search over the three candidates, as the oracle of the
    /// direct computation.
    fn absolute_near_by_search(base: u64, c: Cursor, ring: usize) -> u64 {
        let ring = ring.max(1) as u64;
        let period = ring * 0x1_0000;
        let target = u64::from(c.wrap) * ring + u64::from(c.count);
        let start = base - base % period;
        let cands = [
            start.wrapping_sub(period).wrapping_add(target),
            start + target,
            start + period + target,
        ];
        let (mut best, mut best_d) = (start + target, u64::MAX);
        for x in cands {
            if x > u64::MAX / 2 {
                continue;
            }
            let d = x.abs_diff(base);
            if d < best_d {
                best_d = d;
                best = x;
            }
        }
        best
    }

    proptest::proptest! {
        #[test]
        fn absolute_near_is_the_nearest_candidate(
            base in 0u64..(1 << 50),
            ring_log in 0u32..24,
            wrap: u16,
            count_frac in 0.0f64..1.0,
        ) {
            let ring = 1usize << ring_log;
            let count = ((ring as f64 * count_frac) as u32).min(ring as u32 - 1);
            let c = Cursor::new(wrap, count);
            proptest::prop_assert_eq!(
                absolute_near(base, c, ring),
                absolute_near_by_search(base, c, ring)
            );
            // half a period away either way (a tie, the lower wins), and
            // near the period's edges
            let period = (ring as u64) << 16;
            for d in [period / 2, period / 2 + 1, period - period / 2 - 1] {
                for b in [base, base + period, base + 2 * period] {
                    for t in [cursor_at(b + d, ring), cursor_at(b.saturating_sub(d), ring)] {
                        proptest::prop_assert_eq!(
                            absolute_near(b, t, ring),
                            absolute_near_by_search(b, t, ring)
                        );
                    }
                }
            }
            for b in [period / 2, period / 2 + 1, period, period + period / 2, 3 * period / 2 + 1] {
                proptest::prop_assert_eq!(
                    absolute_near(b, c, ring),
                    absolute_near_by_search(b, c, ring)
                );
            }
        }
    }

    #[test]
    fn absolute_near_inverts_cursor_at() {
        for ring in [1usize, 7, 16384, 65536] {
            for base in [
                0u64,
                5,
                ring as u64 * 3 + 1,
                ring as u64 * 0x1_0000 - 1,
                ring as u64 * 0x1_0001 + 3,
            ] {
                for delta in [0u64, 1, ring as u64 / 2, ring as u64] {
                    let abs = base + delta;
                    assert_eq!(
                        absolute_near(base, cursor_at(abs, ring), ring),
                        abs,
                        "ring {ring} base {base} +{delta}"
                    );
                }
            }
        }
    }

    /// A run of completions taken at once (`on_cdcs_sent`) leaves what the
    /// same completions one by one leave, and a run that is not the oldest
    /// in flight in order changes nothing.
    #[test]
    fn completions_at_once_are_completions_one_by_one() {
        let mut a = DataPath::new(cfg(65536, 16384, 16384));
        let mut seqs = Vec::new();
        for n in [100, 200, 300, 400, 500] {
            a.produced(n);
            seqs.push(a.poll_tx().unwrap().cdc.seqno);
        }
        let state = |d: &DataPath| format!("{d:?}");
        for (from, len) in [(0, 1), (0, 3), (1, 2), (0, 5), (2, 3)] {
            let mut one = a.clone();
            let mut run = a.clone();
            // (the ones before the run completed first)
            for &s in &seqs[..from] {
                one.on_cdc_sent(s).unwrap();
                run.on_cdc_sent(s).unwrap();
            }
            for &s in &seqs[from..from + len] {
                one.on_cdc_sent(s).unwrap();
            }
            run.on_cdcs_sent(seqs[from], len).unwrap();
            assert_eq!(state(&run), state(&one), "run {from}+{len}");
            assert_eq!(run.last_completed_seqno(), seqs[from + len - 1]);
        }
        // not the oldest, a seqno never sent, longer than what is in flight
        for (first, len) in [(seqs[1], 1), (seqs[4].wrapping_add(1), 1), (seqs[0], 6)] {
            let mut run = a.clone();
            assert!(run.on_cdcs_sent(first, len).is_err());
            assert_eq!(state(&run), state(&a));
        }
    }

    #[test]
    fn write_wraps_into_two_rdma_writes_then_blocks() {
        let mut a = DataPath::new(cfg(65536, 16384, 16384));
        // fill 10000, send, peer consumes all, then 10000 more: wraps at 16384
        assert_eq!(a.produced(10000), 10000);
        let b = a.poll_tx().unwrap();
        assert_eq!(b.writes.len(), 1);
        assert_eq!(b.cdc.seqno, 1);
        assert_eq!(b.cdc.prod, Cursor::new(0, 10000));
        a.on_cdc_sent(1).unwrap();
        let peer = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 0),
            cons: Cursor::new(0, 10000),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        };
        assert_eq!(a.on_cdc(&peer).unwrap().freed, 10000);
        a.produced(10000);
        let b = a.poll_tx().unwrap();
        assert_eq!(
            b.writes
                .iter()
                .map(|w| (w.peer_offset, w.len))
                .collect::<Vec<_>>(),
            [(10000, 6384), (0, 3616)]
        );
        assert_eq!(b.cdc.prod, Cursor::new(1, 3616));
        // more than fits: write_blocked, and nothing more until the peer consumes
        a.produced(20000);
        let b = a.poll_tx().unwrap();
        assert_eq!(b.writes.iter().map(|w| w.len).sum::<usize>(), 6384);
        assert!(b.cdc.prod_flags.write_blocked());
        assert_eq!(a.peer_space(), 0);
        assert!(a.poll_tx().is_none());
    }

    /// Bytes written straight into the peer's RMBE take no send-buffer space
    /// while no buffered byte before them waits for its completion; behind
    /// one that does, they count until it completes, so that a buffered
    /// write never lands on a byte a failover may have to send again.
    #[test]
    fn direct_bytes_hold_send_buffer_space_only_behind_waiting_buffered_ones() {
        let mut a = DataPath::new(cfg(65536, 16384, 1 << 20));
        // 256 KiB direct, none completed: the send buffer is all free
        for _ in 0..8 {
            assert!(a.poll_tx_direct(32768).is_some());
        }
        assert_eq!(a.unacked(), 262144);
        assert_eq!(a.sndbuf_free(), 65536);
        // a buffered write has all of it; sent, it waits for its completion
        assert_eq!(a.produced(65536), 65536);
        let b = a.poll_tx().unwrap();
        assert_eq!(b.cdc.seqno, 9);
        assert_eq!(a.sndbuf_free(), 0);
        assert!(a.poll_tx_direct(100).is_none());
        a.on_cdc_sent(9).unwrap();
        assert_eq!(a.sndbuf_free(), 65536);
        // direct bytes behind a buffered byte in flight count, until both
        // are completed
        assert_eq!(a.produced(1000), 1000);
        assert_eq!(a.poll_tx().unwrap().cdc.seqno, 10);
        assert!(a.poll_tx_direct(2000).is_some());
        assert_eq!(a.sndbuf_free(), 65536 - 3000);
        a.on_cdc_sent(10).unwrap();
        assert_eq!(a.sndbuf_free(), 65536 - 2000);
        a.on_cdc_sent(11).unwrap();
        assert_eq!(a.sndbuf_free(), 65536);
        // and with nothing buffered waiting, direct bytes take none again
        assert!(a.poll_tx_direct(40000).is_some());
        assert_eq!(a.sndbuf_free(), 65536);
    }

    /// The fast path's batch is the one `produced_direct` + `poll_tx` make, source
    /// pieces aside, with the same state after it, wrapping or filling the
    /// peer's RMBE; and where `poll_tx` would do anything else, none, and
    /// nothing changed.
    #[test]
    fn poll_tx_direct_is_poll_tx_for_the_fast_paths_case() {
        let mut a = DataPath::new(cfg(65536, 16384, 16384));
        // 10000 at 0; then 6384 + 3616 around the end; then exactly the space left
        for (n, peer_cons) in [(10000, None), (10000, Some((0, 10000))), (6384, None)] {
            if let Some((w, c)) = peer_cons {
                a.on_cdc(&peer_read(w, c)).unwrap();
            }
            let mut b = a.clone();
            b.produced_direct(n);
            let want = b.poll_tx().unwrap();
            let (dst, cdc) = a.poll_tx_direct(n).unwrap();
            assert_eq!(cdc, want.cdc);
            assert_eq!(
                dst.as_slice().to_vec(),
                want.writes
                    .iter()
                    .map(|w| (w.peer_offset, w.len))
                    .collect::<Vec<_>>()
            );
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
        }
        assert!(a.poll_tx_direct(1).is_none(), "the peer's RMBE is full");
        let declined = |a: &mut DataPath, n: usize| {
            let before = format!("{a:?}");
            assert!(a.poll_tx_direct(n).is_none());
            assert_eq!(format!("{a:?}"), before);
        };
        let mut a = DataPath::new(cfg(8192, 16384, 16384));
        declined(&mut a, 0);
        declined(&mut a, 8192);
        for mut b in not_direct(&a) {
            declined(&mut b, 10);
        }
        assert!(a.poll_tx_direct(8191).is_some());
    }

    /// The peer's CDC that says it has read up to (`wrap`, `count`) of our
    /// writes, and nothing else.
    fn peer_read(wrap: u16, count: u32) -> CdcMessage {
        CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 0),
            cons: Cursor::new(wrap, count),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        }
    }

    /// `a` with something before any further byte that keeps a write from
    /// going straight into the peer's RMBE: a byte unsent, an urgent byte,
    /// a close.
    fn not_direct(a: &DataPath) -> [DataPath; 3] {
        let mut unsent = a.clone();
        unsent.produced(10);
        let mut urgent = unsent.clone();
        assert!(urgent.mark_urgent());
        let mut closing = a.clone();
        closing.set_close_flags(CloseFlags {
            done_writing: true,
            ..CloseFlags::default()
        });
        [unsent, urgent, closing]
    }

    /// Bytes written without their CDC (`write_corked`) are announced by
    /// the next CDC exactly as a batch of their own would have announced
    /// them (same CDC, same state after it), that CDC rings the peer's
    /// reader (`brings_data`), and a corked write takes what a direct one
    /// could take and nothing else.
    #[test]
    fn corked_bytes_go_out_with_the_next_cdc_as_their_own_batch_would() {
        let mut a = DataPath::new(cfg(65536, 16384, 16384));
        // 3000 + 2000 corked, twice; then, after the peer read 10000, 9000
        // around the ring's end and the rest of the peer's free space (asked
        // for more: a CDC with write_blocked)
        for (parts, peer_cons) in [
            (&[3000usize, 2000][..], None),
            (&[3000, 2000][..], None),
            (&[9000, 20000][..], Some((0, 10000))),
        ] {
            if let Some((w, c)) = peer_cons {
                a.on_cdc(&peer_read(w, c)).unwrap();
            }
            let mut b = a.clone();
            let mut n = 0;
            for &p in parts {
                let before = a.sent_total();
                let dst = a.write_corked(p);
                let len: usize = dst.as_slice().iter().map(|c| c.1).sum();
                assert_eq!(a.sent_total(), before + len as u64);
                assert!(a.cdc_wanted(), "their CDC is owed");
                n += len;
            }
            b.produced_direct(n);
            let want = b.poll_tx().unwrap();
            let got = a.poll_tx().unwrap();
            assert!(got.writes.is_empty(), "the bytes are there already");
            assert!(got.brings_data && want.brings_data);
            assert_eq!(got.cdc, want.cdc);
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
            assert!(!a.cdc_wanted());
            assert!(a.poll_tx().is_none(), "nothing owed any more");
        }
        assert_eq!(a.peer_space(), 0);
        assert!(a.write_corked(1).is_empty(), "the peer's RMBE is full");
        // corked bytes, then a direct write: one CDC for both
        let mut a = DataPath::new(cfg(65536, 16384, 16384));
        a.write_corked(100);
        let (dst, cdc) = a.poll_tx_direct(50).unwrap();
        assert_eq!(dst.as_slice(), &[(100, 50)]);
        assert_eq!(cdc.prod, Cursor::new(0, 150));
        assert!(!a.cdc_wanted());
        // nothing corked where a direct write would not go either
        let declined = |a: &mut DataPath, n: usize| {
            let before = format!("{a:?}");
            assert!(a.write_corked(n).is_empty());
            assert_eq!(format!("{a:?}"), before);
        };
        let a = DataPath::new(cfg(8192, 16384, 16384));
        declined(&mut a.clone(), 0);
        for mut b in not_direct(&a) {
            declined(&mut b, 10);
        }
        // as much as the send buffer counts free (direct bytes hold none)
        let mut f = a.clone();
        let len: usize = f.write_corked(9000).as_slice().iter().map(|c| c.1).sum();
        assert_eq!(len, 8192);
    }

    #[test]
    fn diag_shows_the_cursors_and_flags_smc_diag_reports() {
        // send buffer 8 KiB, our RMBE 16 KiB, the peer's 4 KiB
        let mut a = DataPath::new(cfg(8192, 16384, 4096));
        a.produced(5000);
        let b = a.poll_tx().unwrap();
        // (the peer has room for 4096 only: write-blocked)
        assert!(b.cdc.prod_flags.write_blocked());
        a.on_cdc_sent(1).unwrap();
        let peer = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 300),
            cons: Cursor::new(1, 0),
            prod_flags: ProducerFlags::WRITE_BLOCKED,
            conn_flags: ConnStateFlags::PEER_DONE_WRITING,
        };
        a.on_cdc(&peer).unwrap();
        let d = a.diag();
        assert_eq!(d.rx_prod, Cursor::new(0, 300));
        assert_eq!(d.rx_cons, Cursor::new(1, 0));
        assert_eq!(d.tx_prod, Cursor::new(1, 0));
        assert_eq!(d.tx_cons, Cursor::new(0, 0));
        assert_eq!(d.tx_prep, Cursor::new(0, 5000));
        assert_eq!(d.tx_sent, Cursor::new(0, 4096));
        assert_eq!(d.tx_fin, Cursor::new(0, 4096));
        assert_eq!(d.rx_flags, [0x80, 0x80]);
        assert_eq!(d.tx_flags, [0x80, 0]);
    }

    #[test]
    fn hostile_cursors_are_violations() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut m = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 16384),
            cons: Cursor::new(0, 0),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        };
        assert!(matches!(
            a.on_cdc(&m),
            Err(Violation::CursorOutOfRing {
                which: "producer",
                ..
            })
        ));
        // a full ring plus one byte unread
        m.prod = Cursor::new(1, 1);
        assert!(matches!(
            a.on_cdc(&m),
            Err(Violation::ProducerOverrun { .. })
        ));
        // consuming what we never wrote
        m.prod = Cursor::new(0, 0);
        m.cons = Cursor::new(0, 5);
        assert!(matches!(
            a.on_cdc(&m),
            Err(Violation::ConsumerOverrun { .. })
        ));
        assert!(matches!(
            a.on_cdc_sent(9),
            Err(Violation::UnknownCompletion(9))
        ));
        // a full ring is fine
        m.cons = Cursor::new(0, 0);
        m.prod = Cursor::new(1, 0);
        assert_eq!(a.on_cdc(&m).unwrap().new_data, 16384);
        // stale seqno dropped
        m.seqno = 0;
        assert!(a.on_cdc(&m).unwrap().stale);
    }

    #[test]
    fn consumer_update_rules() {
        let mut a = DataPath::new(cfg(16384, 65536, 16384));
        let mut m = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 40000),
            cons: Cursor::new(0, 0),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        };
        a.on_cdc(&m).unwrap();
        a.consumed(6000); // below the 10 % limit (6553)
        assert!(!a.consumer_update_due());
        a.consumed(1000); // above the limit, and the peer sees only 25536 free (< half)
        assert!(a.consumer_update_due());
        let b = a.poll_tx().unwrap();
        assert!(b.writes.is_empty());
        assert_eq!(b.cdc.cons, Cursor::new(0, 7000));
        assert!(!a.consumer_update_due());
        // peer requested an update: any consumption triggers one
        m.seqno = 2;
        m.prod_flags = ProducerFlags::CONS_CURS_UPD_REQ;
        a.on_cdc(&m).unwrap();
        a.consumed(1);
        assert!(a.consumer_update_due());
    }

    #[test]
    fn urgent_byte_travels_out_of_band() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        // "abc" + urgent "!" + "def" in one go from the application's view
        a.produced(4);
        assert!(a.mark_urgent());
        assert!(!a.mark_urgent(), "one urgent byte at a time");
        a.produced(3);
        // the first CDC ends exactly at the urgent byte and says so
        let first = a.poll_tx().unwrap();
        assert_eq!(first.writes.iter().map(|w| w.len).sum::<usize>(), 4);
        assert!(first.cdc.prod_flags.urg_data_pending() && first.cdc.prod_flags.urg_data_present());
        assert!(!a.urgent_pending());
        let second = a.poll_tx().unwrap();
        assert_eq!(second.writes.iter().map(|w| w.len).sum::<usize>(), 3);
        assert!(!second.cdc.prod_flags.urg_data_present());
        // the receiver: normal reads stop at the mark, the byte is fetched apart
        b.on_cdc(&first.cdc).unwrap();
        assert!(b.urgent_signalled());
        assert_eq!(b.readable(), 3, "abc, not the urgent byte");
        assert_eq!(b.urgent_offset(), Some(3));
        b.on_cdc(&second.cdc).unwrap();
        assert_eq!(b.readable(), 3, "still stops at the mark");
        assert!(!b.at_urgent_mark());
        assert_eq!(b.consumed(3), 3);
        assert!(b.readable() == 3, "the urgent byte is skipped");
        assert!(
            b.at_urgent_mark() && b.urgent_valid(),
            "the reader stands at the mark (SIOCATMARK) until it reads on"
        );
        assert_eq!(b.readable_chunks(10).as_slice(), &[(4, 3)], "def follows");
        b.urgent_taken();
        assert_eq!(b.urgent_offset(), None);
        assert!(b.urgent_valid(), "fetched: still the mark's");
        b.consumed(3);
        assert_eq!(b.unread(), 0);
        assert!(
            !b.at_urgent_mark() && !b.urgent_valid(),
            "read past the mark: the urgent byte is gone (MSG_OOB finds nothing)"
        );
    }

    /// An urgent byte with nothing before it: the reader is at its mark at
    /// once, a read of nothing skips it and leaves it there, and the first
    /// byte read after it ends it.
    #[test]
    fn an_urgent_byte_alone_is_at_the_mark_until_a_read_passes_it() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        a.produced(1);
        assert!(a.mark_urgent());
        let only = a.poll_tx().unwrap();
        b.on_cdc(&only.cdc).unwrap();
        assert_eq!(b.readable(), 0);
        assert!(b.at_urgent_mark() && b.urgent_valid());
        assert_eq!(b.consumed(0), 0);
        assert!(b.at_urgent_mark() && b.urgent_valid(), "{b:?}");
        assert_eq!(b.consumed(0), 0);
        assert!(b.urgent_valid(), "reads of nothing do not pass it");
        a.produced(2);
        let more = a.poll_tx().unwrap();
        b.on_cdc(&more.cdc).unwrap();
        assert_eq!(b.readable(), 2);
        assert!(b.at_urgent_mark());
        assert_eq!(b.inq(), 0, "at the mark: TCP's FIONREAD");
        assert_eq!(b.consumed(1), 1);
        assert!(!b.at_urgent_mark() && !b.urgent_valid());
        assert_eq!(b.inq(), 1);
    }

    /// A read planned before the urgent byte came, ending where it lands:
    /// applied after, it passes the byte, so that what follows is readable
    /// (a reader never stands at the byte itself, out of line).
    #[test]
    fn a_read_planned_before_the_urgent_byte_passes_it_when_applied() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        a.produced(2);
        b.on_cdc(&a.poll_tx().unwrap().cdc).unwrap();
        let plan = b.plan_consume(2);
        a.produced(1);
        assert!(a.mark_urgent());
        a.produced(2);
        for _ in 0..2 {
            b.on_cdc(&a.poll_tx().unwrap().cdc).unwrap();
        }
        assert_eq!(b.readable(), 2, "up to the mark");
        assert_eq!(b.consume_planned(plan), 2);
        assert!(b.at_urgent_mark() && b.urgent_valid());
        assert_eq!(b.readable(), 2, "the bytes after the urgent byte");
        assert_eq!(b.readable_chunks(16).as_slice(), &[(3, 2)]);
        assert_eq!(b.inq(), 0, "at the mark: TCP's FIONREAD");
    }

    /// `SO_OOBINLINE`: reads stop before the urgent byte, the next read
    /// returns it in the stream, and the mark is gone once it is read; as
    /// TCP measured in line: `recv` "ij", `SIOCATMARK` 1, `recv` "k...",
    /// `FIONREAD` every unread byte.
    #[test]
    fn an_urgent_byte_in_line_is_read_in_its_place() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        b.set_oob_inline(true);
        a.produced(3);
        assert!(a.mark_urgent());
        a.produced(2);
        for _ in 0..2 {
            let t = a.poll_tx().unwrap();
            b.on_cdc(&t.cdc).unwrap();
        }
        assert_eq!(b.unread(), 5);
        assert_eq!(b.readable(), 2, "the read stops before the mark");
        assert_eq!(b.inq(), 5, "in line FIONREAD counts every byte");
        assert!(!b.at_urgent_mark());
        assert_eq!(b.consumed(10), 2);
        assert!(b.at_urgent_mark() && b.urgent_valid());
        assert_eq!(b.readable(), 3, "the urgent byte and what follows");
        assert_eq!(b.readable_chunks(10).as_slice(), &[(2, 3)]);
        assert_eq!(b.consumed(1), 1, "the urgent byte itself, in band");
        assert!(!b.at_urgent_mark() && !b.urgent_valid(), "read: gone");
        assert_eq!(b.consumed(10), 2);
        assert_eq!(b.unread(), 0);
        // alone, with the reader at it: readable at once (out of band a
        // lone urgent byte is not, see above)
        a.produced(1);
        assert!(a.mark_urgent());
        b.on_cdc(&a.poll_tx().unwrap().cdc).unwrap();
        assert!(b.at_urgent_mark());
        assert_eq!((b.readable(), b.inq()), (1, 1));
        assert_eq!(b.consumed(0), 0, "a read of nothing does not skip it");
        assert_eq!(b.unread(), 1);
        assert_eq!(b.consumed(5), 1);
        assert!(!b.urgent_valid());
    }

    #[test]
    fn failover_rewind_resends_what_is_unconfirmed_with_its_urgent_byte() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        a.produced(10);
        let first = a.poll_tx().unwrap();
        a.on_cdc_sent(first.cdc.seqno).unwrap();
        b.on_cdc(&first.cdc).unwrap();
        // "abc" + urgent "!" + "def": both CDCs are lost with the link
        a.produced(4);
        assert!(a.mark_urgent());
        a.produced(3);
        let lost1 = a.poll_tx().unwrap();
        assert!(lost1.cdc.prod_flags.urg_data_present());
        let lost2 = a.poll_tx().unwrap();
        assert_eq!(a.cdcs_in_flight(), 2);
        let v = a.failover_rewind();
        assert!(v.is_failover_validation());
        assert_eq!(
            (v.seqno, v.token),
            (1, 7),
            "last completed seqno, peer token"
        );
        assert_eq!(a.cdcs_in_flight(), 0);
        assert!(b.on_cdc(&v).unwrap().stale, "in sync: ignored");
        // everything after byte 10 again, to the same offsets, urgent byte announced
        let again = a.poll_tx().unwrap();
        assert_eq!(
            again
                .writes
                .iter()
                .map(|w| (w.peer_offset, w.len))
                .collect::<Vec<_>>(),
            [(10, 4)]
        );
        assert!(again.cdc.prod_flags.urg_data_present());
        assert!(again.cdc.seqno > lost2.cdc.seqno, "seqnos continue");
        let rest = a.poll_tx().unwrap();
        assert_eq!(rest.writes[0].peer_offset, 14);
        b.on_cdc(&again.cdc).unwrap();
        assert_eq!(b.urgent_offset(), Some(13));
        b.on_cdc(&rest.cdc).unwrap();
        assert_eq!(b.unread(), 17);
    }

    #[test]
    fn failover_with_data_the_peer_already_read() {
        let mut a = DataPath::new(cfg(16384, 16384, 16384));
        a.produced(100);
        let lost = a.poll_tx().unwrap();
        a.failover_rewind();
        // the CDC had arrived after all: the peer read the data and says so
        let peer = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 0),
            cons: Cursor::new(0, 100),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        };
        assert_eq!(a.on_cdc(&peer).unwrap().freed, 100, "not a violation");
        assert_eq!((a.unacked(), a.peer_space()), (0, 16384));
        let b = a.poll_tx().unwrap();
        assert!(b.writes.is_empty(), "nothing to write again");
        assert_eq!(b.cdc.prod, lost.cdc.prod);
        // beyond what we ever wrote it still is one
        let mut bad = peer;
        bad.seqno = 2;
        bad.cons = Cursor::new(0, 101);
        assert!(matches!(
            a.on_cdc(&bad),
            Err(Violation::ConsumerOverrun { .. })
        ));
        // a rewind after an abort writes nothing again
        let mut c = DataPath::new(cfg(16384, 16384, 16384));
        c.produced(50);
        c.poll_tx().unwrap();
        c.set_close_flags(CloseFlags {
            done_writing: false,
            closed: false,
            abort: true,
        });
        c.failover_rewind();
        let x = c.poll_tx().unwrap();
        assert!(x.writes.is_empty() && x.cdc.conn_flags.peer_conn_abort());
    }

    #[test]
    fn a_validation_showing_loss_is_out_of_sync() {
        let mut b = DataPath::new(cfg(16384, 16384, 16384));
        let mut m = CdcMessage {
            seqno: 1,
            token: 0,
            prod: Cursor::new(0, 5),
            cons: Cursor::new(0, 0),
            prod_flags: ProducerFlags::empty(),
            conn_flags: ConnStateFlags::empty(),
        };
        b.on_cdc(&m).unwrap();
        // the peer saw seqno 3 complete, we processed only 1: data was lost
        m = CdcMessage::failover_validation(3, 0);
        assert!(b.validation_shows_loss(&m));
        assert!(!b.validation_shows_loss(&CdcMessage::failover_validation(1, 0)));
        assert_eq!(
            b.on_cdc(&m),
            Err(Violation::OutOfSync {
                last_received: 1,
                claimed: 3
            })
        );
        assert_eq!(b.unread(), 5, "a validation is never data");
        assert!(b.on_cdc(&CdcMessage::failover_validation(1, 0)).is_ok());
    }

    #[test]
    fn a_pending_urgent_byte_is_announced_once_and_dropped_by_an_abort() {
        let mut a = DataPath::new(cfg(32768, 16384, 16384));
        // the peer's window is full: the urgent byte cannot be written yet
        a.produced(16384);
        a.poll_tx().unwrap();
        a.produced(1);
        assert!(a.mark_urgent());
        let b = a.poll_tx().unwrap();
        assert!(b.writes.is_empty() && b.cdc.prod_flags.urg_data_pending());
        assert!(a.poll_tx().is_none(), "announced once, not on every poll");
        // an abort discards it: no CDC storm for a byte that will never go
        a.set_close_flags(CloseFlags {
            done_writing: false,
            closed: false,
            abort: true,
        });
        assert!(!a.urgent_pending());
        assert!(a.poll_tx().unwrap().cdc.conn_flags.peer_conn_abort());
        assert!(a.poll_tx().is_none());
    }

    /// A close whose CDC was lost with its link goes out again only with the
    /// last byte replayed after the failover. The close flags are sticky: a
    /// replayed CDC that carried done_writing with only part of the data
    /// (the peer's RMB, or the failover reserve, let less through on the new
    /// link) would be the reader's end of file before the rest arrived.
    #[test]
    fn a_close_lost_with_its_link_goes_out_again_only_after_the_data() {
        const LEN: usize = 16384;
        for reserve in [0, FAILOVER_RESERVE] {
            let mut a = DataPath::new(cfg(4 * LEN, LEN, LEN));
            a.set_failover_reserve(reserve);
            // half the peer's RMB, then the rest with the close: both CDCs
            // are lost with the link
            a.produced(LEN / 2);
            a.poll_tx().unwrap();
            let total = (LEN / 2 + LEN / 2 - reserve) as u64;
            a.produced(LEN / 2 - reserve);
            a.set_close_flags(CloseFlags {
                done_writing: true,
                closed: false,
                abort: false,
            });
            let last = a.poll_tx().unwrap();
            assert!(last.cdc.conn_flags.peer_done_writing(), "reserve {reserve}");
            a.failover_rewind();
            // the new link: the peer reads whatever arrives and says so
            let mut peer_cons = 0u64;
            let mut done_at = None;
            for seqno in 101..200 {
                let Some(b) = a.poll_tx() else { break };
                a.on_cdc_sent(b.cdc.seqno).unwrap();
                let prod = peer_cons + b.writes.iter().map(|w| w.len as u64).sum::<u64>();
                if b.cdc.conn_flags.peer_done_writing() && done_at.is_none() {
                    done_at = Some(prod);
                }
                peer_cons = prod;
                let update = CdcMessage {
                    seqno,
                    token: 0,
                    prod: Cursor::new(0, 0),
                    cons: cursor_at(peer_cons, LEN),
                    prod_flags: ProducerFlags::empty(),
                    conn_flags: ConnStateFlags::empty(),
                };
                a.on_cdc(&update).unwrap();
            }
            assert_eq!(peer_cons, total, "reserve {reserve}: every byte again");
            assert_eq!(
                done_at,
                Some(total),
                "reserve {reserve}: the close comes with the last byte, not before"
            );
        }
    }

    /// Linux 6.12's receive side as far as a failover needs it, for a kernel
    /// with no data of its own to send: smc_cdc.c `smc_cdc_rx_handler` (the
    /// seqno rule `smc_cdc_before`, `smc_cdc_msg_validate`),
    /// `smc_cdc_cursor_to_host` (cursors never move back),
    /// `smc_cdc_msg_recv_action` (`cons_curs_upd_req` calls `smc_tx_pending`,
    /// which sends nothing without data of its own), smc_rx.c
    /// `smc_rx_update_consumer` and smc_tx.c `smc_tx_consumer_update` (the
    /// consumer cursor counts as told once its CDC is posted).
    struct KernelRx {
        len: u64,
        prod: u64,
        cons: u64,
        confirmed: u64,
        last_seq: Option<u16>,
        flags: ProducerFlags,
        tx_seq: u16,
    }

    impl KernelRx {
        fn new(len: usize) -> KernelRx {
            KernelRx {
                len: len as u64,
                prod: 0,
                cons: 0,
                confirmed: 0,
                last_seq: None,
                flags: ProducerFlags::empty(),
                tx_seq: 0,
            }
        }

        fn on_cdc(&mut self, m: &CdcMessage) {
            let before = |a: u16, b: u16| (a.wrapping_sub(b) as i16) < 0;
            if m.is_failover_validation() {
                let last = self.last_seq.unwrap_or(0);
                assert!(
                    !before(last, m.seqno),
                    "the kernel would abort: out of sync"
                );
                return;
            }
            if self.last_seq.is_some_and(|l| before(m.seqno, l)) {
                return;
            }
            self.last_seq = Some(m.seqno);
            self.flags = m.prod_flags;
            let p = u64::from(m.prod.wrap) * self.len + u64::from(m.prod.count);
            self.prod = self.prod.max(p);
        }

        /// The application reads all there is; the consumer update the kernel
        /// posts for it, if any.
        fn read_all(&mut self) -> Option<CdcMessage> {
            if self.prod == self.cons {
                return None;
            }
            self.cons = self.prod;
            let to_confirm = self.cons - self.confirmed;
            let limit = (self.len / 10).min(MIN_UPDATE_LIMIT as u64);
            let sender_free = self.len - (self.prod - self.confirmed);
            if !(self.flags.cons_curs_upd_req()
                || (to_confirm > limit
                    && (sender_free <= self.len / 2 || self.flags.write_blocked())))
            {
                return None;
            }
            self.confirmed = self.cons;
            self.tx_seq = self.tx_seq.wrapping_add(1);
            Some(CdcMessage {
                seqno: self.tx_seq,
                token: 0,
                prod: Cursor::new(0, 0),
                cons: cursor_at(self.cons, self.len as usize),
                prod_flags: ProducerFlags::empty(),
                conn_flags: ConnStateFlags::empty(),
            })
        }
    }

    #[test]
    fn failover_against_a_kernel_whose_consumer_update_was_lost() {
        // The sender filled the kernel's RMBE as far as it may; the kernel read
        // it all and posted its consumer update on the link that then failed
        // (redund.rk run 7: the kernel's CDCs 244/245 of a moved connection
        // never arrived). Linux never sends that update again.
        const LEN: usize = 16384;
        let mut a = DataPath::new(cfg(4 * LEN, 16384, LEN));
        a.set_failover_reserve(FAILOVER_RESERVE);
        let mut k = KernelRx::new(LEN);
        a.produced(3 * LEN);
        let first = a.poll_tx().unwrap();
        a.on_cdc_sent(first.cdc.seqno).unwrap();
        k.on_cdc(&first.cdc);
        assert!(
            a.poll_tx().is_none(),
            "the kernel's RMBE is full by our count"
        );
        assert!(k.read_all().is_some(), "the update that is lost");
        // both ends switch links: the kernel says where it is, we rewind
        let kv = CdcMessage::failover_validation(0, 0);
        assert!(a.on_cdc(&kv).unwrap().stale);
        let v = a.failover_rewind();
        k.on_cdc(&v);
        for _ in 0..1000 {
            let mut moved = false;
            if let Some(b) = a.poll_tx() {
                a.on_cdc_sent(b.cdc.seqno).unwrap();
                k.on_cdc(&b.cdc);
                moved = true;
            }
            if let Some(u) = k.read_all() {
                a.on_cdc(&u).unwrap();
                moved = true;
            }
            if !moved {
                break;
            }
        }
        assert_eq!(
            k.cons,
            3 * LEN as u64,
            "every byte reaches the kernel's reader"
        );
        assert_eq!(a.unacked(), 0);
        // back to normal: the reserve is kept again, no more requests
        a.produced(10);
        let b = a.poll_tx().unwrap();
        assert!(!b.cdc.prod_flags.cons_curs_upd_req());
        assert!(!a.reserve_released && !a.cons_request);
        assert_eq!(
            a.peer_space(),
            LEN - (a.tx_sent - a.peer_cons) as usize - FAILOVER_RESERVE
        );
    }
}

#[cfg(test)]
mod owed_tests {
    use super::*;

    /// `cdc_owed_after(n)` says beforehand what `consumed(n)` leaves owed
    /// (a consumer update due, or a CDC wanted), in every state a small
    /// walk reaches: peer CDCs with and without write_blocked, update
    /// requests and urgent data, read sizes around the update limit.
    #[test]
    fn cdc_owed_after_agrees_with_consumed() {
        let rmbe = 16384usize;
        let mut checked = 0;
        let mut owed = 0;
        for flags in 0..8u8 {
            let mut dp = DataPath::new(DataPathConfig {
                sndbuf_len: 16384,
                rmbe_len: rmbe,
                peer_rmbe_len: 16384,
                peer_token: 7,
            });
            let mut prod = 0u64;
            let mut seq = 0u16;
            for step in 0..40u64 {
                // the peer writes up to what our RMB frees
                let free = rmbe as u64 - (prod - (dp.totals().0 - dp.unread() as u64));
                let add = (step * 2917 % 9000).min(free);
                prod += add;
                seq = seq.wrapping_add(1);
                let mut pf = ProducerFlags::empty();
                pf.set(
                    ProducerFlags::WRITE_BLOCKED,
                    flags & 1 != 0 && step % 3 == 0,
                );
                pf.set(
                    ProducerFlags::CONS_CURS_UPD_REQ,
                    flags & 2 != 0 && step % 5 == 0,
                );
                if flags & 4 != 0 && step % 7 == 3 && add > 0 {
                    pf.insert(ProducerFlags::URG_DATA_PENDING);
                    pf.insert(ProducerFlags::URG_DATA_PRESENT);
                }
                let m = CdcMessage {
                    seqno: seq,
                    token: 7,
                    prod: cursor_at(prod, rmbe),
                    cons: Cursor::new(0, 0),
                    prod_flags: pf,
                    conn_flags: ConnStateFlags::empty(),
                };
                if dp.on_cdc(&m).is_err() {
                    break;
                }
                for n in [0usize, 1, 100, 1700, 2304, 2305, 5000, 16384] {
                    let want = dp.cdc_owed_after(n);
                    let mut after = dp.clone();
                    let took = after.consumed(n);
                    // (a planned read does what `consumed` does)
                    let mut planned = dp.clone();
                    let plan = planned.plan_consume(n);
                    assert_eq!(plan.cdc_owed(), want);
                    assert_eq!(planned.consume_planned(plan), took);
                    assert_eq!(format!("{planned:?}"), format!("{after:?}"));
                    assert_eq!(
                        want,
                        after.cdc_wanted() || after.consumer_update_due(),
                        "flags {flags} step {step} read {n}"
                    );
                    checked += 1;
                    owed += usize::from(want);
                }
                // read some, and sometimes send what is owed
                let n = (step as usize * 1733) % 7000;
                dp.consumed(n);
                if step % 4 == 0 {
                    let _ = dp.poll_tx();
                }
            }
        }
        assert!(checked > 1000 && owed > 50 && owed < checked - 50);
    }
}
