//! Shared-memory layouts of the `shm` provider (all little-endian u64 words
//! accessed atomically through [`SharedMem::atomic`]).
//!
//! Memory region: one 4 KiB header page, then the region's bytes. A
//! region registered for remote access is a range of a memfd it shares with
//! the other remote-access regions of its protection domain (an arena
//! chunk), at a page-aligned offset; a local-only region has a memfd of its
//! own.
//! Receive ring memfd (one per QP, owned by the receiver, written by the
//! peer's sender): one 4 KiB header page, then `NSLOTS` slots of
//! `SLOT_SIZE` bytes, each a 64-byte slot header followed by the payload.
//!
//! Everything here is shared with the peer, which can write all of it: the
//! owner of a region never reads its header back (its bookkeeping lives in
//! process memory), and the owner of a ring treats the words the peer
//! writes as signals to check, never as its own state (see the README's
//! threat model).
#![forbid(unsafe_code)]

use crate::sys::SharedMem;
use std::sync::atomic::AtomicU64;

/// Header page size (MR and ring).
pub const HDR: usize = 4096;

// ---- memory region header
/// Magic value at offset 0 of an MR header.
pub const MR_MAGIC: u64 = 0x534d_4352_4d52_0001;
/// MR header: 1 while registered, 0 once deregistered (revocation).
pub const MR_VALID: usize = 8;
/// MR header: rkey.
pub const MR_RKEY: usize = 16;
/// MR header: length in bytes.
pub const MR_LEN: usize = 24;
/// MR header: access bits.
pub const MR_ACCESS: usize = 32;
/// MR header: iova of byte 0.
pub const MR_IOVA: usize = 40;
/// MR header: protection domain id (informational).
pub const MR_PD: usize = 48;
/// MR header: the registrations of the same memory in further protection
/// domains (`ProtectionDomain::share_mr`), each three words (validity, rkey,
/// iova, as `MR_VALID`, `MR_RKEY`, `MR_IOVA` are for the first one), from
/// this offset.
pub const MR_SHARED: usize = 256;
/// MR header: the region's doorbell (`verbs::Bell`): nonzero while its
/// owner waits on it (a futex word, its low 32 bits), [`BELL_HELD`] once
/// rung, until the owner looked. A peer can write it: at worst it wakes the
/// owner for nothing or lets it sleep on until its own timeout or another
/// wake-up, which it could do by sending nothing.
pub const MR_BELL: usize = 1024;
/// `MR_BELL`: the owner armed it and looks before it sleeps.
pub const BELL_ARMED: u64 = 1;
/// `MR_BELL`: the owner sleeps on it (a ring wakes it with a system call).
pub const BELL_ASLEEP: u64 = 2;
/// `MR_BELL`: rung (by a peer's SEND, which takes the word before it
/// publishes its slot, or by a thread of the owner): the owner was woken,
/// or was about to look anyway, and looks before it lets go of the word
/// (`verbs::Bell::release`). A further SEND takes it again silently: it
/// neither wakes anyone nor signals the owner's completion channel, as
/// the owner's look is still to come. A SEND that took it and finds it
/// let go of once its slot is published (the owner's last look may have
/// come before) signals the channel after all.
pub const BELL_HELD: u64 = 5;
/// `MR_BELL`: an event loop of the owner armed it (`verbs::Bell::arm_polled`)
/// and waits for the region's eventfd, which the owner handed to the peer
/// with the region: the peer's next SEND naming the region sets
/// [`BELL_SIGNALLED`] before it publishes the slot (the slot then does not
/// signal the owner's channel) and writes the eventfd after. A peer can
/// write this word, as any other of `MR_BELL`: at worst a wake-up for
/// nothing, or a SEND of its own connection left unannounced until the
/// owner looks for another reason.
pub const BELL_POLLED: u64 = 3;
/// `MR_BELL`: a peer's SEND took the word [`BELL_POLLED`] and writes (or has
/// written) the region's eventfd, until the owner arms it again (it drains
/// the eventfd, then looks at its ring). A peer that finds it so takes it
/// again (it stays) and writes the eventfd again after publishing: every
/// SEND between two arms is announced by the eventfd, none by the channel,
/// so the owner's readiness descriptor need not show what they bring.
pub const BELL_SIGNALLED: u64 = 4;
/// `MR_BELL`: as [`BELL_POLLED`], for an event loop that waits
/// level-triggered (`verbs::Bell::set_poll_level`): the region's eventfd,
/// once written, stays readable until the owner arms the bell again (it
/// drains it only then, and looks at its ring after), so one write
/// announces every SEND until that arm. The peer's next SEND naming the
/// region sets [`BELL_SIGNALLED_LEVEL`] and writes the eventfd, as for
/// [`BELL_POLLED`].
pub const BELL_POLLED_LEVEL: u64 = 6;
/// `MR_BELL`: a peer's SEND took the word [`BELL_POLLED_LEVEL`] and writes
/// (or has written) the region's eventfd. A further SEND takes it again
/// silently (it stays): it writes nothing, as the eventfd is readable
/// until the owner's next arm, whose look comes after its drain, and it
/// does not signal the owner's channel. (An edge-triggered poller needs a
/// write per SEND, as TCP wakes one for every segment: [`BELL_SIGNALLED`].)
pub const BELL_SIGNALLED_LEVEL: u64 = 7;
/// Registrations a region's memory may have at once: the first one and
/// `MR_REGS - 1` further ones (SMC-R has at most three links per group).
pub const MR_REGS: usize = 8;

// `PeerMr::valid` reads a registration's words as one span from its
// validity word: the first registration's as five words (rkey one after,
// iova four after), a shared one's as three.
const _: () = assert!(MR_RKEY == MR_VALID + 8 && MR_IOVA == MR_VALID + 32);

/// The header offsets of (validity, rkey, iova) of registration `slot`
/// (0: the region's first registration) of a region's memory.
pub fn mr_reg_words(slot: usize) -> (usize, usize, usize) {
    if slot == 0 {
        (MR_VALID, MR_RKEY, MR_IOVA)
    } else {
        let at = MR_SHARED + (slot - 1) * 24;
        (at, at + 8, at + 16)
    }
}

// ---- ring header
/// Magic value at offset 0 of a ring header.
pub const RING_MAGIC: u64 = 0x534d_4352_5249_0001;
/// Consumer index (written by the receiver).
pub const R_HEAD: usize = 8;
// (16: unused. A producer index here was written with every SEND and read
// by nobody: the slots' own state words say what is published, and the
// word shared a cache line with the receiver's, which it pulled across.)
/// Receiver armed: the sender signals the receiver's channel after publishing.
pub const R_RX_NOTIFY: usize = 24;
/// Sender armed: the receiver signals the sender's channel after consuming.
pub const R_TX_NOTIFY: usize = 32;
/// Receiver's QP is in ERR / gone.
pub const R_CONS_CLOSED: usize = 40;
/// Sender's QP is in ERR / gone.
pub const R_PROD_CLOSED: usize = 48;
/// Sender's device heartbeat counter.
pub const R_PROD_HB: usize = 56;
/// Total receive WRs ever posted by the receiver (RNR detection).
pub const R_RECV_CREDITS: usize = 64;
/// Receiver's min RNR timer in ns.
pub const R_RNR_TIMER: usize = 72;
/// Receiver QP's access flags (informational: the receiver enforces them
/// when it hands out a region).
pub const R_ACCESS: usize = 80;
/// Unused (earlier versions: the receiver QP's PD id, which the writer
/// compared; the owner now hands out only its QP's PD's regions).
pub const R_PD: usize = 88;
/// Sender's device thread id (`gettid`, in the sender's pid namespace), and
/// with it the inode of that namespace (`R_PROD_PIDNS`): a receiver in the
/// same namespace can tell a sender whose heartbeats stopped because it waits
/// for a CPU from one that is stopped or hung (`device_thread::peer_starved`).
pub const R_PROD_TID: usize = 96;
/// See [`R_PROD_TID`].
pub const R_PROD_PIDNS: usize = 104;

/// Slots per ring.
pub const NSLOTS: u64 = 64;
/// Largest SEND payload.
pub const SLOT_PAYLOAD: usize = 8192;
/// Slot header size.
pub const SLOT_HDR: usize = 64;
/// Slot size.
pub const SLOT_SIZE: usize = SLOT_HDR + SLOT_PAYLOAD;
/// Total ring memfd size.
pub const RING_LEN: usize = HDR + NSLOTS as usize * SLOT_SIZE;

/// Slot state word: `seq << 3 | state`.
pub const S_STATE: usize = 0;
/// Slot: `op | len << 32`.
pub const S_META: usize = 8;
/// Slot: `imm | has_imm << 32 | psn << 40`.
pub const S_IMM: usize = 16;

/// Slot: 1 if the sender rang the receiver's doorbell for this SEND
/// (`verbs::QueuePair::post_send_ringing`) instead of signalling its armed
/// channel: the receiver's poll then leaves its arm in place.
pub const S_BELL: usize = 24;

/// Slot states.
pub const ST_PUBLISHED: u64 = 1;
/// Consumed into a receive WR (the RC ACK).
pub const ST_CONSUMED: u64 = 2;
/// Withdrawn by the sender (RNR retries exhausted).
pub const ST_CANCELLED: u64 = 3;
/// Rejected by the receiver (NAK).
pub const ST_NAK: u64 = 4;

/// Ring ops.
pub const OP_SEND: u64 = 1;
/// SEND WITH IMMEDIATE.
pub const OP_SEND_IMM: u64 = 2;
/// RDMA WRITE WITH IMMEDIATE.
pub const OP_WRITE_IMM: u64 = 3;

/// Typed view of a ring mapping (its length is validated at creation).
pub struct Ring<'a>(pub &'a SharedMem);

impl<'a> Ring<'a> {
    /// Validates a ring mapping received from a peer.
    pub fn check(m: &'a SharedMem) -> Option<Ring<'a>> {
        use std::sync::atomic::Ordering::Acquire;
        if m.len() < RING_LEN || m.atomic(0).ok()?.load(Acquire) != RING_MAGIC {
            return None;
        }
        Some(Ring(m))
    }
    /// Header word.
    #[inline(always)]
    pub fn h(&self, off: usize) -> &'a AtomicU64 {
        match self.0.atomic(off) {
            Ok(w) => w,
            Err(e) => out_of_bounds("ring header words are in bounds", e),
        }
    }
    /// Byte offset of slot `seq`.
    #[inline]
    pub fn slot(seq: u64) -> usize {
        HDR + (seq % NSLOTS) as usize * SLOT_SIZE
    }
    /// Slot word.
    #[inline(always)]
    pub fn s(&self, seq: u64, off: usize) -> &'a AtomicU64 {
        match self.0.atomic(Self::slot(seq) + off) {
            Ok(w) => w,
            Err(e) => out_of_bounds("slot words are in bounds", e),
        }
    }
}

/// Typed view of an MR header: the header page at byte `.1` of a mapping.
pub struct MrView<'a>(pub &'a SharedMem, pub usize);

impl<'a> MrView<'a> {
    /// Header word (a region's mapping holds its whole header page).
    #[inline(always)]
    pub fn h(&self, off: usize) -> &'a AtomicU64 {
        match self.0.atomic(self.1 + off) {
            Ok(w) => w,
            Err(e) => out_of_bounds("mr header words are in bounds", e),
        }
    }
}

/// The panic of a header or slot word out of its mapping's bounds (which
/// the mapping's length, checked when it was made or came, rules out), as
/// `expect` words it; out of line, so that the accessors stay small.
#[cold]
#[inline(never)]
fn out_of_bounds(what: &str, e: std::io::Error) -> ! {
    panic!("{what}: {e:?}")
}
