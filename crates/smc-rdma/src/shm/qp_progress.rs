//! The data path of a QP, run in the caller's thread when it posts or polls:
//! sends (SEND and WRITE WITH IMMEDIATE as slots of the peer's receive ring,
//! published with a release store after any earlier WRITE's copy; RDMA
//! WRITEs as one copy into the peer's mapped region), acknowledgements and
//! RNR retries, and receives (published slots of our ring moved into posted
//! receive buffers). The ring words the peer can write are signals, never
//! bookkeeping: everything read from them is checked.

use super::cq::CqInner;
use super::mr::{take_bell, PeerMr, EFD_WANTED};
use super::qp::{send_opcode, wc, Core, OwnedPayload, Pending, PostedRecv, QpInner, Stage};
use super::{lock, MAX_RNR_TIMER};

use super::layout::*;
use crate::sys::SharedMem;
use crate::verbs::*;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether the sender wrote slot `seq` of `ring` (published or withdrew it).
#[inline]
pub(super) fn slot_taken(ring: &SharedMem, seq: u64) -> bool {
    let w = Ring(ring).s(seq, S_STATE).load(SeqCst);
    w >> 3 == seq && w & 7 != 0
}

/// The peer regions whose doorbells SENDs of one pass name, and what each
/// word was when taken before its SEND was published (0: not taken; the
/// first apart: a pass has one CDC as a rule, which then costs no
/// allocation), and whether a slot was published without a doorbell rung
/// for it (which signals the peer's armed channel).
#[derive(Default)]
struct Bells {
    first: Option<(Arc<PeerMr>, u64)>,
    rest: Vec<(Arc<PeerMr>, u64)>,
    published: bool,
}

/// What [`QpInner::publish_slot`] took for one SEND: the peer region whose
/// doorbell it names (if we have it mapped) and what its word was (0: not
/// taken).
type Taken = Option<(Arc<PeerMr>, u64)>;

/// Whether a slot with doorbell `t` was published without a doorbell rung
/// for it (so far: [`QpInner::ring_bell`] looks at the word again).
fn unrung(t: &Taken) -> bool {
    t.as_ref().is_none_or(|(_, was)| *was == 0)
}

impl Bells {
    fn add(&mut self, t: Taken) {
        self.published |= unrung(&t);
        if let Some(b) = t {
            match self.first {
                None => self.first = Some(b),
                Some(_) => self.rest.push(b),
            }
        }
    }
}

/// A slot's header: sequence number (its place in the ring), PSN, opcode,
/// immediate word, payload length.
#[derive(Clone, Copy)]
struct Slot {
    seq: u64,
    psn: u64,
    op: u64,
    imm: u64,
    len: u64,
}

/// A send WR's payload, as posted or as kept in the send queue.
#[derive(Clone, Copy)]
pub(super) enum PayloadView<'a> {
    Bytes(&'a [u8]),
    Sges(&'a [Sge]),
}

/// The slot opcode and immediate word of `op`, `None` for an RDMA WRITE
/// (which takes no slot).
fn slot_op(op: SendOp) -> Option<(u64, u64)> {
    let (op, imm) = match op {
        SendOp::RdmaWrite { .. } => return None,
        SendOp::Send => (OP_SEND, None),
        SendOp::SendWithImm(i) => (OP_SEND_IMM, Some(i)),
        SendOp::RdmaWriteWithImm { imm, .. } => (OP_WRITE_IMM, Some(imm)),
    };
    Some((op, imm.map(|i| i as u64 | 1 << 32).unwrap_or(0)))
}

/// A wake-up of a doorbell's owner: its sleeping thread (`false`: the
/// futex at `MR_BELL`) or its poller (`true`: the region's eventfd).
type Wake = (Arc<PeerMr>, bool);

/// Where this thread is with held-back wake-ups (see [`defer_wakes`]):
/// [`HOLD_NONE`], [`HOLD_ON`], [`HOLD_SOME`].
const HOLD_NONE: u8 = 0;
/// Inside [`defer_wakes`], nothing held back yet.
const HOLD_ON: u8 = 1;
/// Inside [`defer_wakes`], wake-ups held back in [`DEFERRED`].
const HOLD_SOME: u8 = 2;

thread_local! {
    /// Whether a post of this thread holds its wake-ups back ([`HOLD_NONE`],
    /// [`HOLD_ON`], [`HOLD_SOME`]). Apart from the list, and without a
    /// destructor: entering and leaving [`defer_wakes`] touch only this
    /// word, which stays usable while the thread's locals are destroyed.
    static HOLD: std::cell::Cell<u8> = const { std::cell::Cell::new(HOLD_NONE) };
    /// Doorbells whose owners a post of this thread is to wake once it has
    /// let go of the QP's lock (see [`defer_wakes`]); used while [`HOLD`]
    /// says so.
    static DEFERRED: std::cell::RefCell<Vec<Wake>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Makes a wake-up. The eventfd is the peer's, checked and made
/// non-blocking when it came (`qp_region::bell_fd`): a write that fails
/// (its counter full) leaves it readable, which is all a poller needs.
fn wake((m, polled): Wake) {
    if polled {
        if let Some(e) = &m.efd {
            e.signal();
        }
    } else {
        let _ = m.mem.futex_wake(MR_BELL);
    }
}

/// Wakes the owner of doorbell `m` whose word we took (`polled`: from an
/// event loop's arm), now, or when the post under way in this thread has
/// let go of its QP's lock.
fn wake_later(m: Arc<PeerMr>, polled: bool) {
    let mut w = Some((m, polled));
    if HOLD.get() != HOLD_NONE {
        // (a thread whose list is gone, a post from an exit handler, wakes
        // at once)
        let _ = DEFERRED.try_with(|d| {
            d.borrow_mut().extend(w.take());
            HOLD.set(HOLD_SOME);
        });
    }
    if let Some(w) = w {
        wake(w);
    }
}

/// Runs `f` with the wake-ups of the doorbells that posts of this thread
/// ring held back, then makes them: the woken thread, which may take this
/// one's CPU at once, does not find the locks held that `f` (a post under
/// the QP's lock, or a caller's write with its own locks) took. Nested
/// calls wake at the end of the outermost one.
#[inline]
pub fn defer_wakes<R>(f: impl FnOnce() -> R) -> R {
    /// Makes the held-back wake-ups when the outermost call ends, also by
    /// a panic (a list left behind would hold back every later one).
    struct Outermost;
    impl Drop for Outermost {
        #[inline]
        fn drop(&mut self) {
            // (none, as a rule: a post that rang nobody asleep)
            if HOLD.replace(HOLD_NONE) == HOLD_SOME {
                wake_held();
            }
        }
    }
    // (not `then_some`: it would make, and drop, a guard in a nested call)
    let _flush = if HOLD.get() == HOLD_NONE {
        HOLD.set(HOLD_ON);
        Some(Outermost)
    } else {
        None
    };
    f()
}

/// The wake-ups held back by the outermost [`defer_wakes`] that just ended
/// (which has already said that none are held any more: a wake-up asked
/// for from here on is made at once).
#[cold]
fn wake_held() {
    // (the list is taken out while its wake-ups are made, and given back
    // empty with its capacity: a thread that rings a doorbell per message
    // allocates the list once, not at every message)
    let mut v = DEFERRED
        .try_with(|d| std::mem::take(&mut *d.borrow_mut()))
        .unwrap_or_default();
    v.drain(..).for_each(wake);
    let _ = DEFERRED.try_with(|d| {
        if let Ok(mut d) = d.try_borrow_mut() {
            if d.is_empty() {
                *d = v;
            }
        }
    });
}

/// One doorbell of [`QpInner::ring_bells`]: region `m`, whose word was
/// `was` when taken before its SEND was published, is taken again and its
/// owner woken as that says; whether the word is 0 now (the slot is left
/// to the owner's completion channel).
#[inline(always)]
fn ring_bell(m: Arc<PeerMr>, was: u64) -> bool {
    let again = take_bell(&m);
    if was == BELL_ASLEEP || again == BELL_ASLEEP {
        wake_later(m.clone(), false);
    }
    let signals = |w| matches!(w, BELL_POLLED | BELL_SIGNALLED | BELL_POLLED_LEVEL);
    if signals(was) || signals(again) {
        wake_later(m, true);
    }
    again == 0
}

impl QpInner {
    /// The progress that can complete into `cq`: receives for the QP's
    /// receive CQ, sends for its send CQ (both when they are one). Polling
    /// one CQ of a QP need not also do the other direction's work, which its
    /// own poll does (a pump polls both).
    pub(super) fn progress_for(&self, cq: &Arc<CqInner>) {
        let mut c = lock(&self.core);
        if self.fail_pending.load(Relaxed) {
            let (first, event) = *lock(&self.fail_what);
            self.fail_locked(&mut c, first, event);
        }
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        self.adopt_ready(&mut c);
        if Arc::ptr_eq(&self.recv_cq, cq) {
            self.progress_recv(&mut c);
        }
        if c.state == QpState::Rts && Arc::ptr_eq(&self.send_cq, cq) {
            self.progress_send(&mut c);
        }
    }

    /// Whether a WRITE posted now may land at once instead of queueing (and
    /// having its inline payload copied twice): everything before it has been
    /// executed already — SENDs published to the peer's ring and not refused
    /// for lack of a receive (RC executes in order and stops behind an RNR'd
    /// SEND) — so landing now keeps the order. A signaled WRITE also needs an
    /// empty queue: its completion must not overtake earlier ones. (A bulk
    /// sender posts each WRITE while its previous CDC still waits for the
    /// peer's ACK; queueing those copied 256 KiB into a fresh Vec each time.)
    pub(super) fn executes_at_post(&self, c: &Core, signaled: bool) -> bool {
        if c.sq.is_empty() {
            return true;
        }
        if signaled {
            return false;
        }
        let Some(l) = c.link.as_ref() else {
            return false;
        };
        let credits = Ring(&l.peer_ring).h(R_RECV_CREDITS).load(Acquire);
        c.sq.iter().all(|p| match p.stage {
            Stage::Published { seq, .. } => credits > seq,
            Stage::Done(st) => st == WcStatus::Success,
            Stage::Queued => false,
        })
    }

    pub(super) fn progress_locked(&self, c: &mut Core) {
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        self.adopt_ready(c);
        self.progress_recv(c);
        if c.state == QpState::Rts {
            self.progress_send(c);
        }
    }

    /// Copies the WR's payload `p` to `dst` at `dst_off`.
    pub(super) fn gather(
        &self,
        p: PayloadView<'_>,
        dst: &SharedMem,
        dst_off: usize,
    ) -> std::result::Result<(), WcStatus> {
        match p {
            PayloadView::Bytes(d) => dst
                .write(dst_off, d)
                .map_err(|_| WcStatus::LocalQpOperationError),
            PayloadView::Sges(sges) => {
                let mut pos = dst_off;
                for s in sges {
                    let mr = self
                        .dev
                        .local_mr(s.lkey)
                        .ok_or(WcStatus::LocalProtectionError)?;
                    if mr.pd != self.pd {
                        return Err(WcStatus::LocalProtectionError);
                    }
                    let off = s
                        .addr
                        .checked_sub(mr.iova)
                        .ok_or(WcStatus::LocalProtectionError)?
                        as usize;
                    check_range(off, s.length as usize, mr.len)
                        .map_err(|_| WcStatus::LocalProtectionError)?;
                    dst.copy_from(pos, &mr.mem, mr.at(off), s.length as usize)
                        .map_err(|_| WcStatus::LocalQpOperationError)?;
                    pos += s.length as usize;
                }
                Ok(())
            }
        }
    }

    /// What a post does instead of a whole [`Self::progress_send`] pass:
    /// the acknowledgements the peer gave since the last look, completed in
    /// order from the front of the send queue. Anything else at the front
    /// (a SEND not consumed yet, a refusal) stops it, for the next pass.
    pub(super) fn ack_front(&self, c: &mut Core) {
        let Some(l) = c.link.as_ref() else {
            return;
        };
        let pr = Ring(&l.peer_ring);
        // (before the slot states, as in `progress_send`)
        let head = pr.h(R_HEAD).load(Acquire);
        let mut all = true;
        while let Some(p) = c.sq.front() {
            match p.stage {
                Stage::Done(WcStatus::Success) => {}
                Stage::Published { seq, .. } => {
                    let w = pr.s(seq, S_STATE).load(SeqCst);
                    if w != seq << 3 | ST_CONSUMED {
                        // (waiting for the peer: nothing of the peer's
                        // since `head` is left unlooked at)
                        all = w == seq << 3 | ST_PUBLISHED;
                        break;
                    }
                }
                _ => {
                    all = false;
                    break;
                }
            }
            let (signaled, wr_id, op, len) = (p.signaled, p.wr_id, p.op, p.len);
            // (its payload freed where it lies: the WR taken off the queue
            // has nothing left to drop, and is not moved out to be dropped)
            if let Some(p) = c.sq.front_mut() {
                drop(std::mem::replace(&mut p.payload, OwnedPayload::Sent));
            }
            let _ = c.sq.pop_front();
            if signaled {
                self.send_cq.push(wc(
                    wr_id,
                    WcStatus::Success,
                    send_opcode(op),
                    len,
                    None,
                    self.qpn,
                ));
            }
        }
        if all {
            c.seen_peer_head = head;
        }
    }

    /// Whether a SEND posted now may be published at once, without queueing
    /// (and a pass over the queue): nothing queued before it, no WR failed
    /// (the QP is about to), a link, room in the peer's ring, and no
    /// acknowledgement left to see in the slot it takes. (RC does not hold
    /// a SEND back behind an earlier one waiting for a receive: the ring
    /// keeps their order.)
    pub(super) fn publishes_at_post(&self, c: &mut Core) -> bool {
        if c.stalled || matches!(c.sq.back().map(|p| p.stage), Some(Stage::Queued)) {
            return false;
        }
        let Some(l) = c.link.as_mut() else {
            return false;
        };
        // The slot taken now is the one of the SEND `NSLOTS` before it: one
        // whose acknowledgement (its state word) no pass has seen yet would
        // never be completed once overwritten. A whole pass, which looks at
        // the acknowledgements before it publishes, takes such a post.
        let tail = l.tail;
        let published = |p: &Pending| match p.stage {
            Stage::Published { seq, .. } => Some(seq),
            _ => None,
        };
        // (the front, as a rule: the walk only when it is not published)
        let oldest = match c.sq.front() {
            None => None,
            Some(p) => published(p).or_else(|| c.sq.iter().find_map(published)),
        };
        oldest.is_none_or(|seq| tail.wrapping_sub(seq) < NSLOTS) && l.ring_room()
    }

    /// Publishes the SEND `wr` (ringing the doorbell of the peer's region
    /// `bell` as [`Self::progress_send`] does) where
    /// [`Self::publishes_at_post`] said it may; the WR to keep in the send
    /// queue for its acknowledgement, or `Err` with nothing published (its
    /// payload could not be gathered: it is to be queued, and fails in order).
    pub(super) fn publish_at_post(
        &self,
        c: &mut Core,
        wr: &SendWr<'_>,
        bell: Option<u32>,
    ) -> std::result::Result<Pending, WcStatus> {
        let l = c.link.as_ref().expect("checked by publishes_at_post");
        let tail = l.tail;
        let pr = Ring(&l.peer_ring);
        let view = match wr.payload {
            Payload::Inline(d) => PayloadView::Bytes(d),
            Payload::Sges(s) => PayloadView::Sges(s),
        };
        self.gather(view, &l.peer_ring, Ring::slot(tail) + SLOT_HDR)?;
        let (op, imm) = slot_op(wr.op).expect("a SEND takes a slot");
        let len = wr.payload.len();
        let slot = Slot {
            seq: tail,
            psn: (c.sq_psn as u64).wrapping_add(tail) & 0xff_ffff,
            op,
            imm,
            len,
        };
        // (one slot, at most one doorbell: no pass's list of them)
        let taken = self.publish_slot(&mut c.last_remote, pr, slot, bell);
        let mut published = unrung(&taken);
        if let Some((m, was)) = taken {
            published |= ring_bell(m, was);
        }
        self.slots_published(c, tail.wrapping_add(1), published);
        Ok(Pending {
            wr_id: wr.wr_id,
            op: wr.op,
            payload: OwnedPayload::Sent,
            signaled: wr.signaled,
            len: len as u32,
            stage: Stage::Published {
                seq: tail,
                rnr_since: None,
            },
            bell,
        })
    }

    /// Writes the header of slot `s` of the peer's ring `pr` (its payload is
    /// there already) and publishes it. A doorbell whose owner sleeps (or
    /// whose owner's event loop waits for its eventfd) is taken before the
    /// slot is published, and the slot says so: the woken owner polls it
    /// in, and the peer's channel is not signalled for it. It is rung once
    /// published ([`Self::ring_bells`]); what was taken is for that.
    #[inline(always)]
    fn publish_slot(
        &self,
        last_remote: &mut Option<(u64, Arc<PeerMr>)>,
        pr: Ring<'_>,
        s: Slot,
        bell: Option<u32>,
    ) -> Taken {
        let bell = bell.and_then(|k| self.cached_peer_region_in(last_remote, k));
        let was = bell.as_ref().map_or(0, |m| take_bell(m));
        let rang = was != 0;
        if bell
            .as_ref()
            .is_some_and(|m| m.efd_want.load(Relaxed) == EFD_WANTED)
        {
            self.bell_fd_wanted.store(true, Relaxed);
        }
        pr.s(s.seq, S_BELL).store(u64::from(rang), Relaxed);
        pr.s(s.seq, S_META).store(s.op | s.len << 32, Relaxed);
        pr.s(s.seq, S_IMM).store(s.imm | s.psn << 40, Relaxed);
        // Publish: everything above (including earlier WRITE copies) happens-before.
        pr.s(s.seq, S_STATE)
            .store(s.seq << 3 | ST_PUBLISHED, SeqCst);
        bell.map(|m| (m, was))
    }

    /// After a pass that published slots up to `tail` (exclusive): the
    /// doorbells, and the peer's armed channel for slots without one.
    ///
    /// An owner found asleep (or polling) by [`Self::publish_slot`] is woken
    /// now that its SEND is published; and any that its owner armed since
    /// is rung too: an owner arms, then looks at the ring, so either its
    /// look finds the slot published or this finds the word set. A word
    /// taken before that the owner let go of since (its release, after a
    /// look that may have come before the slot was published) leaves the
    /// slot to the owner's completion channel, as if no doorbell had been
    /// there. (A poller's arm we took may have been overwritten since by a
    /// thread of the owner arming to wait, which the eventfd does not wake,
    /// so that word is taken again.) A level-triggered poller's word taken
    /// again after the first SEND's (`BELL_SIGNALLED_LEVEL` both times)
    /// writes nothing: the eventfd that SEND writes stays readable until
    /// the owner's next arm, which looks at the ring after draining it. A
    /// word taken before that is 0 now (the owner's last poller left, or
    /// its waiter let go of it) leaves the slot to the channel too: the
    /// owner's look after that may have come before the slot was published.
    fn ring_bells(&self, c: &mut Core, tail: u64, bells: Bells) {
        let mut published = bells.published;
        for (m, was) in bells.first.into_iter().chain(bells.rest) {
            published |= ring_bell(m, was);
        }
        self.slots_published(c, tail, published);
    }

    /// The end of [`Self::ring_bells`] (the doorbells rung): our producer
    /// index is `tail`, and the peer's armed channel is signalled if a slot
    /// was `published` without a doorbell.
    #[inline]
    fn slots_published(&self, c: &mut Core, tail: u64, published: bool) {
        if let Some(l) = c.link.as_mut() {
            l.tail = tail;
            if published && Ring(&l.peer_ring).h(R_RX_NOTIFY).swap(0, SeqCst) == 1 {
                if let Some(e) = &l.peer_rx_efd {
                    e.signal();
                }
            }
        }
    }

    pub(super) fn progress_send(&self, c: &mut Core) {
        if let Some(l) = c.link.as_ref() {
            // before the slot states: a consume after this load shows later
            c.seen_peer_head = Ring(&l.peer_ring).h(R_HEAD).load(Acquire);
        }
        if c.sq.is_empty() {
            return;
        }
        // The clock is read only while some SEND waits for a receive (RNR).
        let mut now_cache = None;
        let mut now = || *now_cache.get_or_insert_with(Instant::now);
        let rnr_retry = c.rnr_retry;
        let (credits, head, rnr_budget) = match c.link.as_ref() {
            Some(l) => {
                let pr = Ring(&l.peer_ring);
                // the peer's timer, within what IB allows (the word is the peer's)
                let timer = Duration::from_nanos(pr.h(R_RNR_TIMER).load(Relaxed))
                    .clamp(Duration::from_micros(10), MAX_RNR_TIMER);
                (
                    pr.h(R_RECV_CREDITS).load(Acquire),
                    pr.h(R_HEAD).load(Acquire),
                    timer.saturating_mul(u32::from(rnr_retry) + 1),
                )
            }
            None => (0, 0, Duration::ZERO),
        };
        // 1. ACKs of published slots, RNR timers. The peer takes its ring's
        // slots in order (`head_slot`), so past the first slot it has a
        // receive for and has not taken, none is taken or refused yet: the
        // look stops there (a sender ahead of its peer has every SEND of
        // the ring published, and would otherwise look at all of them at
        // every poll).
        if let Some(l) = c.link.as_ref() {
            let pr = Ring(&l.peer_ring);
            for p in c.sq.iter_mut() {
                if let Stage::Published { seq, rnr_since } = &mut p.stage {
                    let w = pr.s(*seq, S_STATE).load(SeqCst);
                    let s = *seq;
                    if w == s << 3 | ST_CONSUMED {
                        p.stage = Stage::Done(WcStatus::Success);
                    } else if w == s << 3 | ST_NAK {
                        p.stage = Stage::Done(WcStatus::RemoteInvalidRequest);
                        c.stalled = true;
                        break; // later WRs flush
                    } else if credits <= s {
                        let since = *rnr_since.get_or_insert_with(&mut now);
                        if rnr_retry != 7
                            && now().duration_since(since) > rnr_budget
                            && pr
                                .s(s, S_STATE)
                                .compare_exchange(
                                    s << 3 | ST_PUBLISHED,
                                    s << 3 | ST_CANCELLED,
                                    SeqCst,
                                    SeqCst,
                                )
                                .is_ok()
                        {
                            p.stage = Stage::Done(WcStatus::RnrRetryExceeded);
                            c.stalled = true;
                            break; // later WRs flush
                        }
                    } else {
                        *rnr_since = None;
                        break;
                    }
                }
            }
        }
        // 2. Execute queued WRs in order (they are the tail of the queue).
        // Without a link yet (the peer has not dialed us) only WRITEs ahead
        // of any SEND can go: they need the peer's region, not its ring.
        let queued = matches!(c.sq.back().map(|p| p.stage), Some(Stage::Queued));
        let mut tail = c.link.as_ref().map_or(0, |l| l.tail);
        let mut bells = Bells::default();
        // RC: while an earlier SEND is refused with RNR, the responder does not
        // execute anything behind it, so a later WRITE must not land either.
        let mut rnr_blocked = false;
        for i in 0..if queued { c.sq.len() } else { 0 } {
            let p = &c.sq[i];
            match p.stage {
                Stage::Queued => {}
                Stage::Done(s) if s != WcStatus::Success => break,
                Stage::Published { seq, .. } => {
                    rnr_blocked |= credits <= seq;
                    continue;
                }
                _ => continue,
            }
            let needs_slot = !matches!(p.op, SendOp::RdmaWrite { .. });
            if rnr_blocked && !needs_slot {
                break;
            }
            let ring = c.link.as_ref().map(|l| &*l.peer_ring);
            if needs_slot && (ring.is_none() || tail.wrapping_sub(head) >= NSLOTS) {
                break; // no link yet, or ring full: stays queued
            }
            let result: std::result::Result<Option<(u64, u64)>, WcStatus> = (|| {
                match p.op {
                    // (zero bytes touch no memory: the R_Key and address
                    // are not checked, IBTA C9-88)
                    SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } if p.len == 0 => {}
                    SendOp::RdmaWrite { remote_addr, rkey }
                    | SendOp::RdmaWriteWithImm {
                        remote_addr, rkey, ..
                    } => {
                        let (m, off) = self.check_remote_in(
                            &mut c.last_remote,
                            rkey,
                            remote_addr,
                            p.len as usize,
                        )?;
                        self.gather(p.payload.view(), &m.mem, off)?;
                    }
                    _ => {
                        let r = ring.expect("checked above");
                        self.gather(p.payload.view(), r, Ring::slot(tail) + SLOT_HDR)?;
                    }
                }
                Ok(slot_op(p.op))
            })();
            let len = p.len as u64;
            let sq_psn = c.sq_psn;
            let bell = c.sq[i].bell;
            match result {
                Err(s) => {
                    c.sq[i].stage = Stage::Done(s);
                    c.stalled = true;
                    break;
                }
                Ok(None) => c.sq[i].stage = Stage::Done(WcStatus::Success),
                Ok(Some((op, imm))) => {
                    let pr = Ring(ring.expect("a slot op has a ring"));
                    let slot = Slot {
                        seq: tail,
                        psn: (sq_psn as u64).wrapping_add(tail) & 0xff_ffff,
                        op,
                        imm,
                        len,
                    };
                    bells.add(self.publish_slot(&mut c.last_remote, pr, slot, bell));
                    c.sq[i].stage = Stage::Published {
                        seq: tail,
                        rnr_since: None,
                    };
                    tail = tail.wrapping_add(1);
                }
            }
        }
        self.ring_bells(c, tail, bells);
        // 3. Complete in order.
        while let Some(Stage::Done(s)) = c.sq.front().map(|p| p.stage) {
            let p = c.sq.pop_front().expect("front exists");
            if s != WcStatus::Success {
                c.sq.push_front(p);
                self.fail_locked(c, None, false);
                return;
            }
            if p.signaled {
                self.send_cq
                    .push(wc(p.wr_id, s, send_opcode(p.op), p.len, None, self.qpn));
            }
        }
    }

    /// [`QueuePair::recv_in_place`] on this QP: the slot at our ring's head,
    /// if it is a SEND whose payload fits `buf` and the oldest posted
    /// receive, copied into `buf` and consumed as [`Self::progress_recv`]
    /// consumes it, with that receive posted again at the back of the
    /// queue (the credit the peer sees grows by one, as by `post_recv`).
    /// Anything else is left to `progress_recv`, which completes it into the
    /// receive CQ in order.
    pub(super) fn recv_in_place(&self, buf: &mut [u8]) -> InPlace {
        let mut c = lock(&self.core);
        let r = self.recv_in_place_locked(&mut c, buf);
        // (once whatever the look completed is in the CQ: see `recv_may_have`)
        self.head_seen.store(c.head, Release);
        r
    }

    /// [`Self::recv_in_place`] with the QP's lock held.
    #[inline(always)]
    fn recv_in_place_locked(&self, c: &mut Core, buf: &mut [u8]) -> InPlace {
        if self.fail_pending.load(Relaxed) {
            let (first, event) = *lock(&self.fail_what);
            self.fail_locked(c, first, event);
        }
        // (the CQ's lock under the QP's, as `progress_recv` pushes: nothing
        // can be completed into it between this look and the take below)
        if !lock(&self.recv_cq.entries).is_empty() {
            return InPlace::CqFirst;
        }
        if !matches!(c.state, QpState::Rtr | QpState::Rts) {
            return InPlace::Empty;
        }
        self.adopt_ready(c);
        let r = Ring(&c.ring);
        // (a pass looks at most at one ring's worth of slots, as `progress_recv`)
        for _ in 0..NSLOTS {
            let head = match head_slot(&c.ring, &mut c.head) {
                Head::Published(head) => head,
                Head::Skipped => continue,
                Head::Nothing => return InPlace::Empty,
            };
            let Some(&PostedRecv { wr_id, cap, .. }) = c.rq.front() else {
                return InPlace::Empty; // RNR
            };
            let meta = r.s(head, S_META).load(Relaxed);
            let immw = r.s(head, S_IMM).load(Relaxed);
            let (op, len) = (meta & 0xffff_ffff, (meta >> 32) as usize);
            let psn = (immw >> 40) as u32 & 0xff_ffff;
            let expect_psn = (c.rq_psn as u64).wrapping_add(head) as u32 & 0xff_ffff;
            if op != OP_SEND
                || immw & (1 << 32) != 0
                || psn != expect_psn
                || len > SLOT_PAYLOAD
                || len > buf.len()
                || len as u64 > cap
            {
                // completed (or refused) into the CQ, in order
                self.progress_recv(c);
                return InPlace::CqFirst;
            }
            if c.ring
                .read(Ring::slot(head) + SLOT_HDR, &mut buf[..len])
                .is_err()
            {
                self.progress_recv(c);
                return InPlace::CqFirst;
            }
            if !take_head(&c.ring, &mut c.head, ST_CONSUMED) {
                continue; // withdrawn meanwhile: the receive is kept
            }
            let again = c.rq.pop_front().expect("looked at above");
            c.rq.push_back(again);
            c.recv_posted += 1;
            r.h(R_RECV_CREDITS).store(c.recv_posted, Release);
            tell_sender(c);
            return InPlace::Got {
                wr_id,
                len: len as u32,
                more: slot_taken(&c.ring, c.head),
            };
        }
        InPlace::Empty
    }

    /// Takes published slots of our ring into posted receives. The slots are
    /// the peer's to write, so everything read from them is checked, the
    /// consumer index is ours (in `core`), and one pass looks at most at one
    /// ring's worth of slots: a peer rewriting slots under us can make us
    /// NAK and fail the QP, never loop, panic or copy out of bounds.
    pub(super) fn progress_recv(&self, c: &mut Core) {
        {
            // nothing published at the head (the usual case): no more work
            if !slot_taken(&c.ring, c.head) {
                return;
            }
        }
        let ring = c.ring.clone();
        let r = Ring(&ring);
        let mut consumed = false;
        for _ in 0..NSLOTS {
            let head = match head_slot(&ring, &mut c.head) {
                Head::Published(head) => head,
                Head::Skipped => continue,
                Head::Nothing => break,
            };
            let Some(rcv) = c.rq.front() else {
                break;
            }; // RNR
            let (wr_id, sges, cap) = (rcv.wr_id, rcv.sges.as_slice(), rcv.cap);
            let meta = r.s(head, S_META).load(Relaxed);
            let immw = r.s(head, S_IMM).load(Relaxed);
            let (op, len) = (meta & 0xffff_ffff, (meta >> 32) as usize);
            let imm = (immw & (1 << 32) != 0).then_some(immw as u32);
            let psn = (immw >> 40) as u32 & 0xff_ffff;
            let opcode = if op == OP_WRITE_IMM {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let expect_psn = (c.rq_psn as u64).wrapping_add(head) as u32 & 0xff_ffff;
            let mut status = WcStatus::Success;
            if !matches!(op, OP_SEND | OP_SEND_IMM | OP_WRITE_IMM) || psn != expect_psn {
                status = WcStatus::RemoteInvalidRequest;
            } else if op != OP_WRITE_IMM {
                if len > SLOT_PAYLOAD || len as u64 > cap {
                    status = WcStatus::LocalLengthError;
                } else {
                    let mut src = Ring::slot(head) + SLOT_HDR;
                    let mut rest = len;
                    for s in sges {
                        if rest == 0 {
                            break;
                        }
                        let n = rest.min(s.length as usize);
                        let ok = self.dev.local_mr(s.lkey).is_some_and(|mr| {
                            mr.pd == self.pd
                                && mr.access.contains(Access::LOCAL_WRITE)
                                && s.addr.checked_sub(mr.iova).is_some_and(|off| {
                                    check_range(off as usize, n, mr.len).is_ok()
                                        && mr
                                            .mem
                                            .copy_from(mr.at(off as usize), &ring, src, n)
                                            .is_ok()
                                })
                        });
                        if !ok {
                            status = WcStatus::LocalProtectionError;
                            break;
                        }
                        src += n;
                        rest -= n;
                    }
                }
            }
            let next = if status == WcStatus::Success {
                ST_CONSUMED
            } else {
                ST_NAK
            };
            if !take_head(&ring, &mut c.head, next) {
                continue; // withdrawn meanwhile: the receive is kept
            }
            c.rq.pop_front();
            consumed = true;
            // (a SEND that rang our doorbell leaves the channel's arm to
            // the next one: the thread it woke takes it)
            let rang = r.s(head, S_BELL).load(Relaxed) == 1;
            self.recv_cq.push_as(
                rang,
                wc(
                    wr_id,
                    status,
                    opcode,
                    if status == WcStatus::Success {
                        len as u32
                    } else {
                        0
                    },
                    imm,
                    self.qpn,
                ),
            );
            if status != WcStatus::Success {
                self.fail_locked(c, None, false);
                break;
            }
        }
        if consumed {
            tell_sender(c);
        }
        // (after the completions it made are in the CQ: see `recv_may_have`)
        self.head_seen.store(c.head, Release);
    }

    /// [`QueuePair::recv_may_have`] on this QP, without its lock: `false`
    /// only when [`Self::recv_in_place`] (or a poll of the receive CQ) would
    /// find nothing now. The consumer index is read from [`Self::head_seen`],
    /// which the QP's lock holders publish only once the completions of what
    /// they consumed are in the CQ; while it lags, the slot it names is
    /// marked for its own sequence number (consumed, refused, skipped), which
    /// says "maybe". So a look that overlaps one under the lock says "maybe"
    /// or sees that one's completions queued, never a false "nothing".
    #[inline]
    pub(super) fn recv_may_have(&self) -> bool {
        let h = self.head_seen.load(Acquire);
        // (a SEND there first: the look of a reader whose data came)
        slot_taken(&self.ring, h)
            || self.recv_cq.queued.load(SeqCst) > 0
            || self.fail_pending.load(Acquire)
            || self.ring_replaced.load(Acquire)
            || self.head_seen.load(Acquire) != h
    }
}

/// What the slot at our ring's head (`head`, our consumer index) holds.
enum Head {
    /// A SEND published there: this slot.
    Published(u64),
    /// One the sender withdrew (RNR retries exhausted): skipped, the index
    /// moved past it.
    Skipped,
    /// Nothing yet (or anything else a peer wrote there).
    Nothing,
}

/// Looks at the slot at our ring's head (see [`Head`]).
fn head_slot(ring: &SharedMem, head: &mut u64) -> Head {
    let r = Ring(ring);
    let h = *head;
    let w = r.s(h, S_STATE).load(SeqCst);
    if w >> 3 != h {
        return Head::Nothing;
    }
    match w & 7 {
        ST_CANCELLED => {
            *head = h.wrapping_add(1);
            r.h(R_HEAD).store(*head, Release);
            Head::Skipped
        }
        ST_PUBLISHED => Head::Published(h),
        _ => Head::Nothing,
    }
}

/// Marks the published slot at our ring's head `next` (consumed, or
/// refused) and moves the index past it; `false` if the sender withdrew it
/// meanwhile (RNR retries exhausted: skipped all the same).
fn take_head(ring: &SharedMem, head: &mut u64, next: u64) -> bool {
    let r = Ring(ring);
    let h = *head;
    *head = h.wrapping_add(1);
    let taken = r
        .s(h, S_STATE)
        .compare_exchange(h << 3 | ST_PUBLISHED, h << 3 | next, SeqCst, SeqCst)
        .is_ok();
    r.h(R_HEAD).store(*head, Release);
    taken
}

/// Signals the sender's channel if it armed it for our consumption
/// (`R_TX_NOTIFY` of our ring).
fn tell_sender(c: &Core) {
    if let Some(l) = c.link.as_ref() {
        if Ring(&c.ring).h(R_TX_NOTIFY).swap(0, SeqCst) == 1 {
            if let Some(e) = &l.peer_tx_efd {
                e.signal();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::SharedMem;

    fn region() -> Arc<PeerMr> {
        Arc::new(PeerMr {
            mem: SharedMem::create("defer-wakes-test", HDR).unwrap(),
            rkey: 1,
            iova: 0x1000,
            len: 0,
            access: Access::from_bits(0),
            slot: 0,
            efd: None,
            efd_want: std::sync::atomic::AtomicU8::new(super::super::mr::EFD_NONE),
        })
    }

    fn held() -> usize {
        DEFERRED.with(|d| d.borrow().len())
    }

    /// A wake-up asked for inside `defer_wakes`, nested or not, is held
    /// back until the outermost call ends, also by a panic; outside, it is
    /// made at once.
    #[test]
    fn wake_ups_wait_for_the_outermost_call() {
        let m = region();
        wake_later(m.clone(), false);
        assert_eq!((HOLD.get(), held()), (HOLD_NONE, 0), "made at once");
        defer_wakes(|| {
            defer_wakes(|| wake_later(m.clone(), false));
            assert_eq!(
                (HOLD.get(), held()),
                (HOLD_SOME, 1),
                "held past the nested call"
            );
            wake_later(m.clone(), false);
            assert_eq!(held(), 2);
        });
        assert_eq!((HOLD.get(), held()), (HOLD_NONE, 0), "made at the end");
        assert_eq!(Arc::strong_count(&m), 1, "nothing kept");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            defer_wakes(|| {
                wake_later(m.clone(), false);
                panic!("in the post");
            })
        }));
        assert!(r.is_err());
        assert_eq!(
            (HOLD.get(), held()),
            (HOLD_NONE, 0),
            "made by the unwinding"
        );
        defer_wakes(|| assert_eq!(HOLD.get(), HOLD_ON, "a later call holds back again"));
    }
}
