//! Protection domains and memory regions: [`ShmPd`] registers memfd-backed
//! regions (the remote-access ones as ranges of the PD's arena, `arena.rs`;
//! the header page of each in `layout.rs`), [`ShmMr`] reads, writes and lends
//! windows onto them; a peer's region is mapped (`PeerMr`) only in the range
//! its owner handed out, and WRITEs into it check bounds, access and its
//! validity word. The receive rings of QPs are made here too (`new_ring`).

use super::arena::Arena;
use super::cq::ShmCq;
use super::device::{BellLocal, DevShared, LocalMr, ShmProvider};
use super::qp::{Core, Ctl, QpInner, ShmQp};
use super::{fresh_key, lock, random_u64, KeyMap, MAX_INLINE, MAX_REGION};

use super::layout::*;
use crate::sys::{EventFd, SharedMem};
use crate::verbs::*;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex};

/// A protection domain of an `shm` device.
pub struct ShmPd {
    pub(super) dev: Arc<DevShared>,
    pub(super) pd: u32,
    /// Where its remote-access regions live (this PD's only).
    pub(super) arena: Arc<Arena>,
}

impl ProtectionDomain for ShmPd {
    type P = ShmProvider;

    /// Keys and the address are random (a peer learns them only when the
    /// owner's application tells it, as over a CLC exchange). A region with
    /// REMOTE_WRITE is a range of this PD's arena, whose memfd is handed to
    /// a peer that asks for the region on an authenticated link of a QP of
    /// this PD; any other region has a memfd of its own, closed at once: it
    /// never leaves the process.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<ShmMr> {
        if len == 0 || len > MAX_REGION {
            return Err(Error::InvalidArgument(format!(
                "memory region length {len} out of range"
            )));
        }
        let (mem, base, slice) = if access.contains(Access::REMOTE_WRITE) {
            let s = self.arena.alloc(HDR + len)?;
            (s.mem().clone(), s.offset(), Some(s))
        } else {
            let mut mem = SharedMem::create("smc-mr", HDR + len)?;
            mem.close_fd();
            (Arc::new(mem), 0, None)
        };
        // Page aligned, below 2^63, so iova + len never overflows.
        let iova = (random_u64()? >> 1 & !0xfff).max(0x1000);
        let mut lkeys = lock(&self.dev.lkeys);
        let mut rkeys = lock(&self.dev.rkeys);
        let lkey = fresh_key(&lkeys)?;
        let rkey = fresh_key(&rkeys)?;
        // The header is what a correct writer checks (it catches bugs, and
        // tells a writer still holding a region that went from the one
        // that took its range since); the owner itself never reads it back.
        let v = MrView(&mem, base);
        v.h(MR_RKEY).store(rkey as u64, Relaxed);
        v.h(MR_LEN).store(len as u64, Relaxed);
        v.h(MR_ACCESS).store(access.bits() as u64, Relaxed);
        v.h(MR_IOVA).store(iova, Relaxed);
        v.h(MR_PD).store(self.pd as u64, Relaxed);
        v.h(MR_VALID).store(1, Release);
        v.h(0).store(MR_MAGIC, Release);
        let mr = Arc::new(LocalMr {
            lkey,
            rkey,
            pd: self.pd,
            mem,
            base,
            len,
            iova,
            access,
            _slice: slice,
            slot: 0,
            regs: Arc::new(Mutex::new(1)),
            _first: None,
            bell: Arc::default(),
        });
        lkeys.insert(lkey, mr.clone());
        rkeys.insert(rkey, mr.clone());
        Ok(ShmMr {
            dev: self.dev.clone(),
            mr,
        })
    }

    /// The memory of `mr` (of any PD of any `shm` device of this process)
    /// registered in this PD too: new random keys and address, a further
    /// registration slot of its header (`layout::mr_reg_words`), which a
    /// writer checks as it checks the first one. Handed out as `mr` is
    /// (the memfd of its arena chunk, its offset and length), but only on a
    /// QP of this PD, by this registration's rkey: `mr`'s own rkey stays a
    /// key of `mr`'s device and PD. So a peer of this PD that maps all of
    /// the memfd reaches the other regions of `mr`'s chunk (of `mr`'s PD):
    /// share the regions of a PD only with a PD whose peers may reach them
    /// all, as the two PDs of a link group's links are (see the README).
    /// A region that was not registered for remote writes has no memfd to
    /// hand out: it can be registered again for local access only.
    fn share_mr(&self, mr: &ShmMr, access: Access) -> Result<ShmMr> {
        let first = mr.mr._first.clone().unwrap_or_else(|| mr.mr.clone());
        if access.contains(Access::REMOTE_WRITE) && first.mem.fd().is_none() {
            return Err(Error::InvalidArgument(
                "a region registered without REMOTE_WRITE cannot be shared for remote writes"
                    .into(),
            ));
        }
        let slot = {
            let mut regs = lock(&first.regs);
            let slot = (1..MR_REGS)
                .find(|&i| *regs & (1 << i) == 0)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "a region's memory has at most {MR_REGS} registrations"
                    ))
                })?;
            *regs |= 1 << slot;
            slot
        };
        let iova = match random_u64() {
            Ok(r) => (r >> 1 & !0xfff).max(0x1000),
            Err(e) => {
                *lock(&first.regs) &= !(1 << slot);
                return Err(e);
            }
        };
        let mut lkeys = lock(&self.dev.lkeys);
        let mut rkeys = lock(&self.dev.rkeys);
        let keys = fresh_key(&lkeys).and_then(|l| Ok((l, fresh_key(&rkeys)?)));
        let (lkey, rkey) = match keys {
            Ok(k) => k,
            Err(e) => {
                *lock(&first.regs) &= !(1 << slot);
                return Err(e);
            }
        };
        let (valid, rk, io) = mr_reg_words(slot);
        let v = MrView(&first.mem, first.base);
        v.h(rk).store(rkey as u64, Relaxed);
        v.h(io).store(iova, Relaxed);
        v.h(valid).store(1, Release);
        let shared = Arc::new(LocalMr {
            lkey,
            rkey,
            pd: self.pd,
            mem: first.mem.clone(),
            base: first.base,
            len: first.len,
            iova,
            access,
            _slice: None,
            slot,
            regs: first.regs.clone(),
            bell: first.bell.clone(),
            _first: Some(first),
        });
        lkeys.insert(lkey, shared.clone());
        rkeys.insert(rkey, shared.clone());
        Ok(ShmMr {
            dev: self.dev.clone(),
            mr: shared,
        })
    }

    fn create_qp(&self, send_cq: &ShmCq, recv_cq: &ShmCq, cap: QpCap) -> Result<ShmQp> {
        if cap.max_inline_data > MAX_INLINE {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data > {MAX_INLINE}"
            )));
        }
        let (ring, ring_fd) = new_ring()?;
        let qpn = self.dev.reg.alloc_qpn(&self.dev.sock_path)?;
        let inner = Arc::new(QpInner {
            dev: self.dev.clone(),
            qpn,
            pd: self.pd,
            cap,
            send_cq: send_cq.inner.clone(),
            recv_cq: recv_cq.inner.clone(),
            core: Mutex::new(Core::new(ring.clone(), ring_fd)),
            hb: Mutex::new(None),
            live: AtomicBool::new(false),
            ctl: Mutex::new(Ctl::default()),
            remote: Mutex::new(KeyMap::default()),
            remote_gen: AtomicU64::new(0),
            fail_pending: AtomicBool::new(false),
            fail_what: Mutex::new((None, false)),
            bell_fd_wanted: AtomicBool::new(false),
            ring,
            ring_replaced: AtomicBool::new(false),
            head_seen: AtomicU64::new(0),
        });
        lock(&self.dev.qps).insert(qpn, Arc::downgrade(&inner));
        lock(&send_cq.inner.qps).push(Arc::downgrade(&inner));
        if !Arc::ptr_eq(&send_cq.inner, &recv_cq.inner) {
            lock(&recv_cq.inner.qps).push(Arc::downgrade(&inner));
        }
        Ok(ShmQp { inner })
    }
}

/// A new receive ring: the mapping, and its memfd until it is handed to the
/// peer at RTR.
pub(super) fn new_ring() -> Result<(Arc<SharedMem>, Option<OwnedFd>)> {
    let mut m = SharedMem::create("smc-ring", RING_LEN)?;
    Ring(&m).h(0).store(RING_MAGIC, Release);
    let fd = m.fd().map(|f| f.try_clone_to_owned()).transpose()?;
    m.close_fd();
    Ok((Arc::new(m), fd))
}

/// A memory region of an `shm` device (shared memory: a slice of its PD's
/// arena if registered for remote access, else a mapping of its own).
pub struct ShmMr {
    pub(super) dev: Arc<DevShared>,
    pub(super) mr: Arc<LocalMr>,
}

/// A region's doorbell (`layout::MR_BELL`), in the region's header page,
/// which a peer maps with the region: a peer that may write the region may
/// ring it, and no other.
struct ShmBell {
    mem: Arc<SharedMem>,
    off: usize,
    /// Its eventfd for a poller, its sleepers, its pollers' mode
    /// (`LocalMr::bell`).
    local: Arc<BellLocal>,
}

impl ShmBell {
    fn word(&self) -> &std::sync::atomic::AtomicU64 {
        MrView(&self.mem, 0).h(self.off)
    }
    fn efd(&self) -> Option<&EventFd> {
        // (one per polled connection: out of the application's way)
        self.local
            .efd
            .get_or_init(|| EventFd::new_high().ok())
            .as_ref()
    }
    /// [`Bell::arm_polled`], its poll descriptor drained first (`drain`)
    /// or not ([`Bell::arm_polled_undrained`]).
    fn arm_polled_draining(&self, drain: bool) -> bool {
        let Some(e) = self.efd() else {
            return false;
        };
        // Drained every time a level-triggered poller may look: a peer
        // writes the eventfd after it took the word, so its write may land
        // after an earlier drain, even after the arm that followed it. (One
        // read resets an eventfd that is not a semaphore.)
        if drain {
            e.drain();
        }
        let w = self.word();
        let mut was = w.load(SeqCst);
        loop {
            if was == BELL_ARMED || was == BELL_ASLEEP || was == BELL_HELD {
                // a thread of ours waits or holds: it takes what comes
                return false;
            }
            // (0, a poller's arm or signal, or what a peer wrote: ours to set)
            let to = if self.local.level.load(SeqCst) {
                BELL_POLLED_LEVEL
            } else {
                BELL_POLLED
            };
            match w.compare_exchange(was, to, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => was = now,
            }
        }
    }
}

// Several threads of the owner may wait on one word (readers of one
// connection). The word says only whether someone waits, so arming leaves a
// word that is armed or asleep as it is (storing "armed" over "asleep" let a
// ring skip the futex wake of a thread already asleep), a release clears
// only "armed" and "held" (a sleeper's mark is not the releasing thread's to
// clear), and the last sleeper to leave without a ring takes "asleep" back
// to "armed", so that a word left asleep with nobody on it does not keep a
// peer's SEND from signalling the owner's channel.
//
// A ring leaves the word "held" rather than 0, until the owner's arm (which
// precedes a look) or release: the SENDs that come before the woken owner
// has looked (a close CDC behind the data it was woken for, on a core the
// owner shares with the sender) take it again silently instead of
// signalling the completion channel, whose leader would wake only to find
// them taken by the owner's look.
impl Bell for ShmBell {
    fn arm(&self) {
        let w = self.word();
        let mut was = w.load(SeqCst);
        while was != BELL_ARMED && was != BELL_ASLEEP {
            // (0, held — the look that follows takes what rang it — a
            // poller's arm, or what a peer wrote: a waiting thread's arm
            // takes over, as it always has)
            match w.compare_exchange(was, BELL_ARMED, SeqCst, SeqCst) {
                Ok(_) => return,
                Err(now) => was = now,
            }
        }
    }
    fn wait(&self, timeout: Option<std::time::Duration>) {
        let w = self.word();
        // (counted before the word is looked at: a leaving sleeper that
        // changes the word after this looks at the count, and wakes us)
        self.local.sleepers.fetch_add(1, SeqCst);
        // asleep only from here on: a ring before this (the word 0) needs
        // no wake-up
        let asleep = match w.compare_exchange(BELL_ARMED, BELL_ASLEEP, SeqCst, SeqCst) {
            Ok(_) => true,
            Err(now) => now == BELL_ASLEEP,
        };
        if asleep {
            let _ = self.mem.futex_wait(self.off, BELL_ASLEEP as u32, timeout);
        }
        if self.local.sleepers.fetch_sub(1, SeqCst) == 1
            && w.compare_exchange(BELL_ASLEEP, BELL_ARMED, SeqCst, SeqCst)
                .is_ok()
            && self.local.sleepers.load(SeqCst) > 0
        {
            // a thread came to sleep on "asleep" meanwhile: it looks again
            let _ = self.mem.futex_wake(self.off);
        }
    }
    fn ring(&self) -> bool {
        // Only a thread of ours is rung here: a poller's arm is the peer's
        // to take (its SEND writes the eventfd; a local applier has nothing
        // to add, the poller looks at what it finds anyway).
        let w = self.word();
        let mut was = w.load(SeqCst);
        while was == BELL_ARMED || was == BELL_ASLEEP {
            match w.compare_exchange(was, BELL_HELD, SeqCst, SeqCst) {
                Ok(_) => {
                    if was == BELL_ASLEEP {
                        let _ = self.mem.futex_wake(self.off);
                    }
                    return true;
                }
                Err(now) => was = now,
            }
        }
        false
    }
    fn hold(&self) -> bool {
        self.word()
            .compare_exchange(0, BELL_ARMED, SeqCst, SeqCst)
            .is_ok()
    }
    fn release(&self) -> bool {
        let w = self.word();
        let mut was = w.load(SeqCst);
        loop {
            let taken = match was {
                // nothing came
                BELL_ARMED => false,
                // rung since this thread's last arm, perhaps by a SEND
                // published after its last look
                BELL_HELD => true,
                // (taken by a peer that clears the word: looked at too)
                0 => return true,
                // a sleeper's mark, a poller's, or what a peer wrote: not
                // this thread's to clear
                _ => return false,
            };
            match w.compare_exchange(was, 0, SeqCst, SeqCst) {
                Ok(_) => return taken,
                Err(now) => was = now,
            }
        }
    }
    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        self.efd().map(|e| e.as_fd())
    }
    fn arm_polled(&self) -> bool {
        self.arm_polled_draining(true)
    }
    fn arm_polled_undrained(&self) -> bool {
        self.arm_polled_draining(false)
    }
    fn polled_taken(&self) -> bool {
        matches!(
            self.word().load(SeqCst),
            BELL_SIGNALLED | BELL_SIGNALLED_LEVEL
        )
    }
    fn disarm_polled(&self) {
        let w = self.word();
        let mut taken = false;
        for was in [
            BELL_POLLED,
            BELL_SIGNALLED,
            BELL_POLLED_LEVEL,
            BELL_SIGNALLED_LEVEL,
        ] {
            if w.compare_exchange(was, 0, SeqCst, SeqCst).is_ok() {
                taken = was == BELL_SIGNALLED || was == BELL_SIGNALLED_LEVEL;
                break;
            }
        }
        // Drained only when a peer took the word since it was armed (its
        // write is in the eventfd, or on its way): a poll or select arms
        // and disarms at every call, and a drain that finds nothing is a
        // system call for nothing. A write that lands after this (its SEND
        // took the word before the disarm) stays until the next arm after
        // a wake-up drains it: at worst one wake-up for nothing, which a
        // poller's look at the connection tells (`arm_polled` after it).
        if taken {
            self.drain_polled();
        }
    }
    fn drain_polled(&self) {
        if let Some(e) = self.local.efd.get().and_then(Option::as_ref) {
            e.drain();
        }
    }
    fn poll_level(&self) -> bool {
        self.local.level.load(SeqCst)
    }
    fn set_poll_level(&self, level: bool) {
        if self.local.level.swap(level, SeqCst) == level {
            return;
        }
        // An arm made in the other mode changes with it: to level, a word
        // signalled stays readable until the next arm drains it (its
        // SEND writes the eventfd); to edge, the next SEND writes it again
        // (one that took the word level before this wrote it when it took
        // it from an arm, or takes it again once published and finds it
        // changed, see `QpInner::progress_send`).
        let pairs = [
            (BELL_POLLED, BELL_POLLED_LEVEL),
            (BELL_SIGNALLED, BELL_SIGNALLED_LEVEL),
        ];
        let w = self.word();
        for (edge, lvl) in pairs {
            let (from, to) = if level { (edge, lvl) } else { (lvl, edge) };
            let _ = w.compare_exchange(from, to, SeqCst, SeqCst);
        }
    }
}

/// Takes a peer region's doorbell if its owner waits on it: what the word
/// was (0: not taken; [`BELL_ASLEEP`]: the owner sleeps, to be woken,
/// `SharedMem::futex_wake` at `MR_BELL`, once what it waits for is there;
/// [`BELL_ARMED`]: it is about to sleep, and finds the word taken;
/// [`BELL_HELD`]: rung already, the owner's look still to come; these
/// three leave it [`BELL_HELD`];
/// [`BELL_POLLED`]: an event loop of the owner waits for the region's
/// eventfd, to be written once what it waits for is there, and the word is
/// [`BELL_SIGNALLED`] now; [`BELL_POLLED_LEVEL`] the same for an event
/// loop that waits level-triggered, [`BELL_SIGNALLED_LEVEL`] now). Taken by
/// compare-and-swap, so that an owner changing the word meanwhile (a poller
/// re-arming) is not overwritten.
/// Not taken: a word armed for a poller when we have no eventfd (the region
/// is marked to be fetched again with it, `QpInner::fetch_bell_fd`), or
/// anything else the owner's peer wrote. A word signalled already and not
/// armed again since ([`BELL_SIGNALLED`], [`BELL_SIGNALLED_LEVEL`]) is taken
/// again, left as it is: the owner's event loop has not looked since the
/// last signal (it may read part of what came and wait again). An
/// edge-triggered one needs this SEND to signal it too; a level-triggered
/// one sees the eventfd readable still (the caller writes it only for a
/// word it took from an arm). An owner re-arming meanwhile drains the
/// eventfd and then looks at the ring, which has this slot once its signal
/// can have been drained.
#[inline]
pub(super) fn take_bell(m: &PeerMr) -> u64 {
    let w = MrView(&m.mem, 0).h(MR_BELL);
    let was = w.load(SeqCst);
    // (0, as a rule: nobody waits, and the look is all a SEND does; a word
    // no owner writes is left as it is too, below)
    if !(BELL_ARMED..=BELL_SIGNALLED_LEVEL).contains(&was) {
        return 0;
    }
    take_bell_from(m, w, was)
}

/// [`take_bell`] where the word `w` of region `m` was found `was`, one of
/// the doorbell's states.
fn take_bell_from(m: &PeerMr, w: &std::sync::atomic::AtomicU64, mut was: u64) -> u64 {
    // (a bounded number of tries: the word is shared with the owner, which
    // could change it forever; not taken, the SEND signals its channel)
    for _ in 0..4 {
        let to = match was {
            BELL_ARMED | BELL_ASLEEP | BELL_HELD => BELL_HELD,
            BELL_POLLED | BELL_SIGNALLED if m.efd.is_some() => BELL_SIGNALLED,
            BELL_POLLED_LEVEL | BELL_SIGNALLED_LEVEL if m.efd.is_some() => BELL_SIGNALLED_LEVEL,
            BELL_POLLED | BELL_POLLED_LEVEL => {
                let _ = m
                    .efd_want
                    .compare_exchange(EFD_NONE, EFD_WANTED, Relaxed, Relaxed);
                return 0;
            }
            _ => return 0,
        };
        match w.compare_exchange(was, to, SeqCst, SeqCst) {
            Ok(_) => return was,
            Err(now) => was = now,
        }
    }
    0
}

impl MemoryRegion for ShmMr {
    fn doorbell(&self) -> Option<Doorbell> {
        // (only a region a peer may write has a header it maps)
        if !self.mr.access.contains(Access::REMOTE_WRITE) {
            return None;
        }
        Some(Arc::new(ShmBell {
            mem: self.mr.mem.clone(),
            off: self.mr.base + MR_BELL,
            local: self.mr.bell.clone(),
        }))
    }
    fn lkey(&self) -> u32 {
        self.mr.lkey
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey
    }
    fn addr(&self) -> u64 {
        self.mr.iova
    }
    fn len(&self) -> usize {
        self.mr.len
    }
    fn access(&self) -> Access {
        self.mr.access
    }
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        check_range(off, buf.len(), self.mr.len)?;
        Ok(self.mr.mem.read(self.mr.at(off), buf)?)
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.mr.len)?;
        Ok(self.mr.mem.write(self.mr.at(off), data)?)
    }
    fn window(&self) -> Option<MemWindow> {
        Some(MemWindow::new(self.mr.clone(), self.mr.at(0), self.mr.len))
    }
}

impl MappedMem for LocalMr {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        Ok(self.mem.read(off, buf)?)
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        Ok(self.mem.write(off, data)?)
    }
    fn read_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        self.mem.read_fd(parts, fd, at)
    }
    fn write_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        self.mem.write_fd(parts, fd, at)
    }
}

/// A peer's region mapped here for one QP: what its owner told us about it
/// (in process memory), and the mapping (no descriptor kept).
pub(super) struct PeerMr {
    pub(super) mem: SharedMem,
    pub(super) rkey: u32,
    pub(super) iova: u64,
    pub(super) len: usize,
    pub(super) access: Access,
    /// The registration of the memory this rkey is (`layout::mr_reg_words`).
    pub(super) slot: usize,
    /// The eventfd its owner handed out with it, which a SEND writes when it
    /// takes the doorbell armed for a poller ([`take_bell`]); checked to be
    /// an eventfd and made non-blocking when it came.
    pub(super) efd: Option<EventFd>,
    /// Whether to fetch the region again for its eventfd: [`EFD_NONE`],
    /// [`EFD_WANTED`] (a SEND found the doorbell armed for a poller and we
    /// have no eventfd: fetched before the owner made one), [`EFD_ASKED`]
    /// (fetched again already, or fetched with it: never again).
    pub(super) efd_want: AtomicU8,
}

/// [`PeerMr::efd_want`]: nothing to fetch.
pub(super) const EFD_NONE: u8 = 0;
/// [`PeerMr::efd_want`]: to be fetched again for its eventfd.
pub(super) const EFD_WANTED: u8 = 1;
/// [`PeerMr::efd_want`]: not to be fetched again for it.
pub(super) const EFD_ASKED: u8 = 2;

impl PeerMr {
    /// Still registered by its owner (a correct writer stops at once when
    /// the owner deregisters it). The owner may give the region's range to
    /// another region of its PD afterwards, or the registration slot to
    /// another registration of the memory: those have other keys.
    #[inline]
    pub(super) fn valid(&self) -> bool {
        // (one bounds check for the three words: the first registration's
        // lie in 5 words of the header, the others' one after the other)
        let (valid, ..) = mr_reg_words(self.slot);
        let words = if self.slot == 0 {
            self.mem
                .atomics::<5>(valid)
                .map(|[v, r, _, _, i]| [v, r, i])
        } else {
            self.mem.atomics::<3>(valid)
        };
        let Ok([valid, rkey, iova]) = words else {
            return false;
        };
        valid.load(Acquire) == 1
            && rkey.load(Relaxed) == u64::from(self.rkey)
            && iova.load(Relaxed) == self.iova
    }
    /// The byte offset in the mapping of a WRITE of `len` bytes at `addr`.
    pub(super) fn check(&self, addr: u64, len: usize) -> std::result::Result<usize, WcStatus> {
        let off = addr
            .checked_sub(self.iova)
            .ok_or(WcStatus::RemoteAccessError)?;
        if !self.access.contains(Access::REMOTE_WRITE)
            || !self.valid()
            || check_range(off as usize, len, self.len).is_err()
        {
            return Err(WcStatus::RemoteAccessError);
        }
        Ok(HDR + off as usize)
    }
}

/// A peer's region mapped here, as a [`QueuePair::remote_window`] gives it:
/// each copy into it first checks that the peer still has it registered,
/// as each executed WRITE does.
pub(super) struct RemoteMem(pub(super) Arc<PeerMr>);

impl MappedMem for RemoteMem {
    fn read_mapped(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        Ok(self.0.mem.read(off, buf)?)
    }
    fn write_mapped(&self, off: usize, data: &[u8]) -> Result<()> {
        if !self.0.valid() {
            return Err(Error::InvalidArgument(
                "the peer's memory region is no longer registered".into(),
            ));
        }
        Ok(self.0.mem.write(off, data)?)
    }
    fn read_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        // (as `write_mapped`: the kernel writes into the peer's region only
        // while it is registered)
        if !self.0.valid() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the peer's memory region is no longer registered",
            ));
        }
        self.0.mem.read_fd(parts, fd, at)
    }
    fn write_fd_mapped(
        &self,
        parts: &[(usize, usize)],
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        self.0.mem.write_fd(parts, fd, at)
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        // Revoke remote access first: peers check this word before each write.
        MrView(&self.mr.mem, self.mr.base)
            .h(mr_reg_words(self.mr.slot).0)
            .store(0, SeqCst);
        lock(&self.dev.lkeys).remove(&self.mr.lkey);
        lock(&self.dev.rkeys).remove(&self.mr.rkey);
        *lock(&self.mr.regs) &= !(1 << self.mr.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer_mr(efd: Option<EventFd>) -> PeerMr {
        PeerMr {
            mem: SharedMem::create("take-bell-test", HDR).unwrap(),
            rkey: 1,
            iova: 0x1000,
            len: 0,
            access: Access::from_bits(0),
            slot: 0,
            efd,
            efd_want: AtomicU8::new(EFD_NONE),
        }
    }

    fn bell() -> ShmBell {
        ShmBell {
            mem: Arc::new(SharedMem::create("bell-test", HDR).unwrap()),
            off: MR_BELL,
            local: Arc::default(),
        }
    }

    /// `f` on a thread of its own; a receiver of its return.
    fn spawn_signalled(f: impl FnOnce() + Send + 'static) -> std::sync::mpsc::Receiver<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        rx
    }

    fn until(what: impl Fn() -> bool) {
        let t0 = std::time::Instant::now();
        while !what() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "never happened"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A second reader of the same connection that arms and then finds its
    /// data (and lets go) leaves the first one's sleep marked: the next
    /// ring wakes it. (Storing "armed" over "asleep", then 0, lost it.)
    #[test]
    fn a_second_readers_arm_and_release_keep_the_sleepers_wake_up() {
        let b = Arc::new(bell());
        let first = spawn_signalled({
            let b = b.clone();
            move || {
                b.arm();
                b.wait(None);
            }
        });
        until(|| b.local.sleepers.load(SeqCst) == 1 && b.word().load(SeqCst) == BELL_ASLEEP);
        // (the second reader comes, finds its data, goes)
        b.arm();
        assert!(!b.release(), "nothing rang");
        assert_eq!(b.word().load(SeqCst), BELL_ASLEEP);
        assert!(b.ring(), "the sleeper's mark was gone");
        assert!(
            first
                .recv_timeout(std::time::Duration::from_secs(10))
                .is_ok(),
            "the ring did not wake the sleeper"
        );
    }

    /// Two sleepers: one leaves by its timeout, the other still sleeps on
    /// the mark and a ring wakes it; the last one to leave without a ring
    /// takes the mark back, so that nobody's sleep is announced to a peer.
    #[test]
    fn sleepers_leave_one_by_one_and_the_last_takes_the_mark_back() {
        let b = Arc::new(bell());
        let long = {
            let b = b.clone();
            std::thread::spawn(move || {
                b.arm();
                b.wait(Some(std::time::Duration::from_secs(20)));
            })
        };
        until(|| b.local.sleepers.load(SeqCst) == 1 && b.word().load(SeqCst) == BELL_ASLEEP);
        b.arm();
        b.wait(Some(std::time::Duration::from_millis(20)));
        // (the long sleeper still on it)
        assert_eq!(b.word().load(SeqCst), BELL_ASLEEP);
        assert!(!b.release());
        assert_eq!(b.word().load(SeqCst), BELL_ASLEEP);
        assert!(b.ring());
        long.join().unwrap();
        assert_eq!(b.local.sleepers.load(SeqCst), 0);

        // alone, out by its timeout: armed again (the thread looks next),
        // then its release clears the word
        b.arm();
        b.wait(Some(std::time::Duration::from_millis(5)));
        assert_eq!(b.word().load(SeqCst), BELL_ARMED);
        assert!(!b.release());
        assert_eq!(b.word().load(SeqCst), 0);
        assert!(!b.ring());
    }

    /// A ring leaves the word held, so that what comes before the woken
    /// owner looked does not announce itself again; the owner's arm takes
    /// it back (a look follows), and its release says it was rung.
    #[test]
    fn a_ring_holds_the_word_until_the_owner_looks_or_lets_go() {
        let b = bell();
        b.arm();
        assert!(b.ring());
        assert_eq!(b.word().load(SeqCst), BELL_HELD);
        assert!(!b.ring(), "held: nobody to ring again");
        assert!(!b.hold(), "a writer's hold leaves it to the owner's look");
        // rung: no sleep
        let t0 = std::time::Instant::now();
        b.wait(Some(std::time::Duration::from_secs(5)));
        assert!(t0.elapsed() < std::time::Duration::from_secs(2));
        // the look the arm precedes takes it
        b.arm();
        assert_eq!(b.word().load(SeqCst), BELL_ARMED);
        assert!(!b.release(), "nothing rang since the arm");
        // rung, then let go of: the release says so, and clears it
        b.arm();
        assert!(b.ring());
        assert!(b.release());
        assert_eq!(b.word().load(SeqCst), 0);
        // a writer's hold rung the same way
        assert!(b.hold());
        assert!(b.ring());
        assert!(b.release());
        assert_eq!(b.word().load(SeqCst), 0);
        // (a peer that cleared the word: looked at too)
        assert!(b.release());
        // a poller's arm and what a peer wrote are not the releaser's
        for w in [BELL_POLLED, BELL_SIGNALLED, 77] {
            b.word().store(w, SeqCst);
            assert!(!b.release());
            assert_eq!(b.word().load(SeqCst), w);
        }
        // held: the event loop's arm leaves it to the thread's look
        b.word().store(BELL_HELD, SeqCst);
        assert!(!b.arm_polled());
    }

    /// What a peer's SEND takes from each doorbell word, and what it leaves.
    #[test]
    fn take_bell_takes_sleepers_and_a_pollers_arm() {
        let m = peer_mr(Some(EventFd::new().unwrap()));
        let w = MrView(&m.mem, 0).h(MR_BELL);
        for (word, took, left) in [
            (0, 0, 0),
            (BELL_ARMED, BELL_ARMED, BELL_HELD),
            (BELL_ASLEEP, BELL_ASLEEP, BELL_HELD),
            // (rung, the owner's look to come: taken again, silently)
            (BELL_HELD, BELL_HELD, BELL_HELD),
            (BELL_POLLED, BELL_POLLED, BELL_SIGNALLED),
            // (signalled, not armed again since: signalled again)
            (BELL_SIGNALLED, BELL_SIGNALLED, BELL_SIGNALLED),
            (BELL_POLLED_LEVEL, BELL_POLLED_LEVEL, BELL_SIGNALLED_LEVEL),
            // (the same for a level-triggered poller; the caller writes
            // nothing for it, see `progress_send`)
            (
                BELL_SIGNALLED_LEVEL,
                BELL_SIGNALLED_LEVEL,
                BELL_SIGNALLED_LEVEL,
            ),
            (77, 0, 77),
        ] {
            w.store(word, SeqCst);
            assert_eq!((take_bell(&m), w.load(SeqCst)), (took, left), "word {word}");
        }
        assert_eq!(m.efd_want.load(Relaxed), EFD_NONE);

        // no eventfd: a poller's arm is left, and the region is to be
        // fetched again for its eventfd
        let m = peer_mr(None);
        let w = MrView(&m.mem, 0).h(MR_BELL);
        for word in [BELL_POLLED, BELL_POLLED_LEVEL] {
            w.store(word, SeqCst);
            assert_eq!(take_bell(&m), 0);
            assert_eq!(w.load(SeqCst), word);
        }
        assert_eq!(m.efd_want.load(Relaxed), EFD_WANTED);
    }

    /// The owner's arm for a poller follows the mode it was told, a mode
    /// change carries an arm (or a signal) already made with it, and the
    /// owner's look and disarm take either mode's words.
    #[test]
    fn a_pollers_arm_follows_its_mode() {
        let b = bell();
        assert!(b.arm_polled());
        assert_eq!(b.word().load(SeqCst), BELL_POLLED);
        b.set_poll_level(true);
        assert_eq!(b.word().load(SeqCst), BELL_POLLED_LEVEL);
        assert!(b.arm_polled());
        assert_eq!(b.word().load(SeqCst), BELL_POLLED_LEVEL);
        b.word().store(BELL_SIGNALLED_LEVEL, SeqCst);
        assert!(b.polled_taken());
        b.set_poll_level(false);
        assert_eq!(b.word().load(SeqCst), BELL_SIGNALLED);
        assert!(b.polled_taken());
        b.set_poll_level(true);
        assert_eq!(b.word().load(SeqCst), BELL_SIGNALLED_LEVEL);
        // (a thread's wait is not a mode's to change)
        b.word().store(BELL_HELD, SeqCst);
        b.set_poll_level(false);
        assert_eq!(b.word().load(SeqCst), BELL_HELD);
        b.set_poll_level(true);
        b.word().store(BELL_SIGNALLED_LEVEL, SeqCst);
        b.disarm_polled();
        assert_eq!(b.word().load(SeqCst), 0);
        assert!(!b.polled_taken());
    }

    /// The last poller's disarm drains the eventfd only when a peer's SEND
    /// took the word since the arm (its write is there, or comes); a word
    /// still armed had no SEND, and a poll or select that arms and disarms
    /// at every call makes no system call for it.
    #[test]
    fn a_disarm_drains_only_what_a_peer_signalled() {
        let b = bell();
        assert!(b.local.efd.set(Some(EventFd::new().unwrap())).is_ok());
        let efd = || b.local.efd.get().unwrap().as_ref().unwrap();
        for (word, drained) in [
            (BELL_POLLED, false),
            (BELL_POLLED_LEVEL, false),
            (BELL_SIGNALLED, true),
            (BELL_SIGNALLED_LEVEL, true),
            // (a thread's wait took the bell over: not the poller's)
            (BELL_HELD, false),
        ] {
            b.word().store(word, SeqCst);
            // (a count there: a write that landed late, or the SEND's own)
            efd().signal();
            b.disarm_polled();
            assert_eq!(
                efd().drain(),
                !drained,
                "word {word}: drained by the disarm: {drained}"
            );
        }
        // an arm without the drain leaves a late write's count; the arm
        // that follows the poller's look drains it
        b.word().store(0, SeqCst);
        efd().signal();
        assert!(b.arm_polled_undrained());
        assert!(b.arm_polled());
        assert!(!efd().drain());
    }
}
