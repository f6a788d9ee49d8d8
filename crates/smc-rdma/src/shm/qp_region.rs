//! Regions across a connected QP: serving a peer's request for one of our
//! regions (only of this QP's PD, registered for remote writes, and only on
//! the authenticated connection), and asking the peer for its region by
//! rkey, mapping only the range it hands out, and checking a WRITE against
//! it.

use super::mr::{PeerMr, EFD_ASKED, EFD_NONE, EFD_WANTED};
use super::qp::{is_local_shortage, FetchError, QpInner};
use super::{lock, KeyMap, ANSWER_WAIT, MAX_REGION};

use super::layout::*;
use super::wire::{Kind, Msg, F_MR_BELL_FD};
use crate::sys::{self, EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::time::Instant;

impl QpInner {
    /// Answers a region request on the verified, authenticated inbound
    /// connection: the memfd of the region's arena chunk (which holds
    /// remote-access regions of this PD only), with the region's offset and
    /// length in it, if the region is of this QP's PD, registered for remote
    /// writes, and the QP grants remote writes; else a refusal. With the
    /// memfd the region's doorbell eventfd, if the peer takes it (`flags`
    /// has `wire::F_MR_BELL_FD`) and a poller of ours made it. False if the
    /// peer does not take the answer (it stopped reading).
    pub(super) fn serve_region(
        &self,
        qp_access: Access,
        s: &SeqPacket,
        id: u32,
        rkey: u32,
        flags: u32,
    ) -> bool {
        let mr = lock(&self.dev.rkeys).get(&rkey).cloned().filter(|mr| {
            mr.pd == self.pd
                && mr.access.contains(Access::REMOTE_WRITE)
                && qp_access.contains(Access::REMOTE_WRITE)
        });
        let r = match mr.as_ref().and_then(|mr| Some((mr, mr.mem.fd()?))) {
            Some((mr, fd)) => {
                // (made by the owner's poller only: a region nobody polls
                // costs no descriptor, here or at the peer)
                let efd = mr
                    .bell
                    .efd
                    .get()
                    .and_then(Option::as_ref)
                    .filter(|_| flags & F_MR_BELL_FD != 0);
                let fds: &[BorrowedFd<'_>] = match efd {
                    Some(e) => &[fd, e.as_fd()],
                    None => &[fd],
                };
                s.try_send(
                    &Msg {
                        a: id,
                        b: rkey,
                        c: mr.access.bits(),
                        x: mr.iova,
                        y: mr.len as u64,
                        z: mr.base as u64,
                        ..Msg::new(Kind::MrResp)
                    }
                    .encode(),
                    fds,
                )
            }
            None => s.try_send(
                &Msg {
                    a: id,
                    b: rkey,
                    ..Msg::new(Kind::Nak)
                }
                .encode(),
                &[],
            ),
        };
        r.is_ok()
    }

    /// Asks the peer for its region `rkey` on the connection we dialed: the
    /// answer, the memfd the region lives in, and the region's doorbell
    /// eventfd if the peer sent one (a second descriptor that is not an
    /// eventfd is closed: a write into a pipe or socket of the peer's
    /// choice could block, or feed something else). `flags`: those of the
    /// request (`wire::F_MR_BELL_FD`). Holds no lock of ours but the request
    /// lock while it waits.
    pub(super) fn ask_region(
        &self,
        rkey: u32,
        flags: u32,
    ) -> std::result::Result<(Msg, OwnedFd, Option<EventFd>), FetchError> {
        let out = lock(&self.ctl).out.clone().ok_or_else(|| {
            FetchError::remote(WcStatus::RetryExceeded, "the QP is not connected")
        })?;
        let mut next = lock(&out.req);
        *next = next.wrapping_add(1);
        let id = *next;
        let gone = |e: std::io::Error| {
            FetchError::remote(
                WcStatus::RetryExceeded,
                format!("peer does not answer: {e}"),
            )
        };
        let req = Msg {
            a: id,
            b: rkey,
            c: flags,
            ..Msg::new(Kind::MrReq)
        };
        out.sock.send(&req.encode(), &[]).map_err(gone)?;
        let deadline = Instant::now() + ANSWER_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FetchError::remote(
                    WcStatus::RetryExceeded,
                    "peer did not answer the region request",
                ));
            }
            out.sock.set_read_timeout(left).map_err(gone)?;
            let mut b = [0u8; 128];
            let (m, mut fds) = match out.sock.recv(&mut b) {
                Ok((0, _)) => return Err(gone(std::io::ErrorKind::UnexpectedEof.into())),
                Ok((n, fds)) => (Msg::decode(&b[..n]), fds),
                Err(e) if is_local_shortage(&e) => {
                    return Err(FetchError {
                        status: WcStatus::LocalQpOperationError,
                        why: format!("cannot take the peer's region: {e}"),
                        local: true,
                    })
                }
                Err(e) => return Err(gone(e)),
            };
            let Some(m) = m else {
                return Err(FetchError::remote(
                    WcStatus::RemoteInvalidRequest,
                    "malformed answer",
                ));
            };
            if m.a != id || !matches!(m.kind, Kind::MrResp | Kind::Nak) {
                continue; // the late answer of a request that timed out
            }
            let refused = |why: &str| FetchError::remote(WcStatus::RemoteAccessError, why);
            if m.kind == Kind::Nak {
                return Err(refused("the peer refused the region"));
            }
            let len = m.y as usize;
            if m.b != rkey || !matches!(fds.len(), 1 | 2) || len == 0 || len > MAX_REGION {
                return Err(refused("malformed region answer"));
            }
            let efd = if fds.len() == 2 {
                fds.pop().and_then(bell_fd)
            } else {
                None
            };
            return Ok((m, fds.remove(0), efd));
        }
    }

    /// Fetches the peer's region `rkey` ([`QpInner::ask_region`]) and maps
    /// it: only its range of the memfd, which is closed then. Out of
    /// descriptors, the region alone (without its doorbell's eventfd, as
    /// before the owner polled it), and if there is no room for that
    /// either, the region alone in the number of the device's reserve
    /// descriptor ([`DevShared::with_reserve`]): the memfd is held only
    /// until it is mapped, so a process at its descriptor limit still
    /// readies the peer's RMB of a connection whose handshake it has
    /// answered (a server learns a reused link group's client RMB from its
    /// Confirm, when a Decline can no longer make the connection TCP).
    ///
    /// [`DevShared::with_reserve`]: super::device::DevShared::with_reserve
    pub(super) fn fetch_region(&self, rkey: u32) -> std::result::Result<Arc<PeerMr>, FetchError> {
        match self.fetch_mapped(rkey, F_MR_BELL_FD) {
            Err(e) if e.local => {}
            r => return r,
        }
        let e = match self.fetch_mapped(rkey, 0) {
            Err(e) if e.local => e,
            r => return r,
        };
        self.dev
            .with_reserve(|| self.fetch_mapped(rkey, 0))
            .unwrap_or(Err(e))
    }

    /// One request for the peer's region `rkey` with `flags`, mapped.
    fn fetch_mapped(&self, rkey: u32, flags: u32) -> std::result::Result<Arc<PeerMr>, FetchError> {
        let (m, fd, efd) = self.ask_region(rkey, flags)?;
        let refused = |why: &str| FetchError::remote(WcStatus::RemoteAccessError, why);
        let len = m.y as usize;
        let mem = SharedMem::map_peer_range(fd, m.z, HDR + len).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                refused("the peer's region is not a range of a sealed memfd")
            } else {
                FetchError {
                    status: WcStatus::LocalQpOperationError,
                    why: format!("cannot map the peer's region: {e}"),
                    local: true,
                }
            }
        })?;
        let v = MrView(&mem, 0);
        // which registration of the memory the rkey is (a region registered
        // in several PDs has one per PD, `ShmPd::share_mr`)
        let slot = (0..MR_REGS).find(|&i| {
            let (_, k, a) = mr_reg_words(i);
            v.h(k).load(Acquire) == u64::from(rkey) && v.h(a).load(Acquire) == m.x
        });
        let Some(slot) = slot.filter(|_| v.h(0).load(Acquire) == MR_MAGIC) else {
            return Err(refused("the peer's region header is wrong"));
        };
        Ok(Arc::new(PeerMr {
            mem,
            rkey,
            iova: m.x,
            len,
            access: Access::from_bits(m.c),
            slot,
            efd_want: AtomicU8::new(if efd.is_some() { EFD_ASKED } else { EFD_NONE }),
            efd,
        }))
    }

    /// Fetches the peer's region `rkey` again, once, if a SEND found its
    /// doorbell armed for a poller and we had no eventfd to write (we
    /// fetched it before the owner's poller made one, as a connection
    /// readies its peer's RMB before any data): the next SENDs then write
    /// the eventfd instead of signalling the owner's channel. Called by a
    /// post that names the doorbell, before it takes the QP's lock (it waits
    /// for the peer's answer, at most `ANSWER_WAIT`). If the peer does not
    /// give it, the region stays mapped as it was, and is not asked for
    /// again.
    pub(super) fn fetch_bell_fd(&self, rkey: u32) {
        // (another region that wants its eventfd sets the flag again at its
        // next SEND)
        if !self.bell_fd_wanted.load(Relaxed) || !self.bell_fd_wanted.swap(false, Relaxed) {
            return;
        }
        let Some(old) = self.cached_peer_region(rkey) else {
            return;
        };
        if old
            .efd_want
            .compare_exchange(EFD_WANTED, EFD_ASKED, Relaxed, Relaxed)
            .is_err()
        {
            return;
        }
        if let Ok(new) = self.fetch_region(rkey) {
            new.efd_want.store(EFD_ASKED, Relaxed);
            let mut m = lock(&self.remote);
            m.insert(rkey, new);
            self.remote_changed(&m);
        }
    }

    /// The peer's region `rkey` for this QP: mapped already, or fetched now.
    pub(super) fn peer_region(&self, rkey: u32) -> std::result::Result<Arc<PeerMr>, FetchError> {
        {
            let mut m = lock(&self.remote);
            match m.get(&rkey) {
                Some(r) if r.valid() => return Ok(r.clone()),
                Some(_) => {
                    m.remove(&rkey);
                    self.remote_changed(&m);
                }
                None => {}
            }
        }
        let r = self.fetch_region(rkey)?;
        debug_assert_eq!(r.rkey, rkey);
        let mut m = lock(&self.remote);
        m.insert(rkey, r.clone());
        self.remote_changed(&m);
        Ok(r)
    }

    /// The peer region `rkey` if it is mapped here already and still
    /// registered (never asks the peer: for a doorbell, which a SEND rings
    /// only where the region has been written, `QpInner::progress_send`).
    pub(super) fn cached_peer_region(&self, rkey: u32) -> Option<Arc<PeerMr>> {
        lock(&self.remote).get(&rkey).filter(|r| r.valid()).cloned()
    }

    /// Checks the peer region for a WRITE and returns (mapping, byte offset).
    pub(super) fn check_remote(
        &self,
        rkey: u32,
        addr: u64,
        len: usize,
    ) -> std::result::Result<(Arc<PeerMr>, usize), WcStatus> {
        let m = self.peer_region(rkey).map_err(|e| e.status)?;
        let off = m.check(addr, len)?;
        Ok((m, off))
    }

    /// `remote` changed (the caller holds its lock, `_m`): regions
    /// remembered before are looked up again (`Core::last_remote`).
    pub(super) fn remote_changed(&self, _m: &KeyMap<u32, Arc<PeerMr>>) {
        self.remote_gen.fetch_add(1, Release);
    }

    /// `last`'s region if it is `rkey`'s, `remote` has not changed since it
    /// was looked up, and the peer still has it registered.
    #[inline]
    fn remembered(&self, last: &Option<(u64, Arc<PeerMr>)>, rkey: u32) -> Option<Arc<PeerMr>> {
        let (gen, r) = last.as_ref()?;
        (r.rkey == rkey && *gen == self.remote_gen.load(Acquire) && r.valid()).then(|| r.clone())
    }

    /// [`Self::check_remote`] for a post, which holds the QP's core and
    /// passes its `last_remote`: the region looked up there first, and
    /// remembered there after a lookup.
    pub(super) fn check_remote_in(
        &self,
        last: &mut Option<(u64, Arc<PeerMr>)>,
        rkey: u32,
        addr: u64,
        len: usize,
    ) -> std::result::Result<(Arc<PeerMr>, usize), WcStatus> {
        let m = match self.remembered(last, rkey) {
            Some(m) => m,
            None => {
                // (read first: a change during the lookup makes it stale)
                let gen = self.remote_gen.load(Acquire);
                let m = self.peer_region(rkey).map_err(|e| e.status)?;
                *last = Some((gen, m.clone()));
                m
            }
        };
        let off = m.check(addr, len)?;
        Ok((m, off))
    }

    /// [`Self::cached_peer_region`] for a post, as [`Self::check_remote_in`].
    /// (Inlined: every CDC names the region its connection's WRITEs and
    /// earlier CDCs named, remembered as a rule.)
    #[inline]
    pub(super) fn cached_peer_region_in(
        &self,
        last: &mut Option<(u64, Arc<PeerMr>)>,
        rkey: u32,
    ) -> Option<Arc<PeerMr>> {
        if let Some(m) = self.remembered(last, rkey) {
            return Some(m);
        }
        self.cached_peer_region_lookup(last, rkey)
    }

    /// [`Self::cached_peer_region_in`] where `last` has not got it.
    fn cached_peer_region_lookup(
        &self,
        last: &mut Option<(u64, Arc<PeerMr>)>,
        rkey: u32,
    ) -> Option<Arc<PeerMr>> {
        let gen = self.remote_gen.load(Acquire);
        let m = self.cached_peer_region(rkey)?;
        *last = Some((gen, m.clone()));
        Some(m)
    }
}

/// A region's doorbell eventfd as a peer handed it to us, if it is one:
/// anything else is closed. Made non-blocking (a peer's eventfd whose counter
/// it filled would block a write): the post path writes it.
pub(super) fn bell_fd(fd: OwnedFd) -> Option<EventFd> {
    if !sys::is_eventfd(fd.as_fd()) || sys::set_nonblocking(fd.as_fd()).is_err() {
        return None;
    }
    // (one per polled region of the peer: out of the application's way)
    Some(EventFd::from_owned(sys::out_of_the_way(fd)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second descriptor of a region answer is kept only if it is an
    /// eventfd (that it is made non-blocking: the `shm_device` test
    /// `a_full_blocking_eventfd_of_the_owner_does_not_block_a_post`).
    #[test]
    fn a_bell_fd_must_be_an_eventfd() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(bell_fd(OwnedFd::from(a)).is_none(), "a socket");
        let (r, _w) = std::io::pipe().unwrap();
        assert!(bell_fd(OwnedFd::from(r)).is_none(), "a pipe");
        let mem = SharedMem::create("bell-fd-test", 4096).unwrap();
        let fd = mem.fd().unwrap().try_clone_to_owned().unwrap();
        assert!(bell_fd(fd).is_none(), "a memfd");

        let e = EventFd::new().unwrap();
        let kept = bell_fd(e.as_fd().try_clone_to_owned().unwrap()).expect("an eventfd is kept");
        kept.signal();
        assert!(e.drain(), "the same eventfd");
    }
}
