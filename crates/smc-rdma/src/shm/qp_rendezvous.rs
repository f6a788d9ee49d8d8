//! The QP rendezvous: at RTR a QP dials the instance owning the peer's (GID,
//! QPN) and hands it its receive ring (a sealed memfd) and its channels'
//! eventfds with a proof of the peer's PSN; the peer uses them only once it
//! checked the proof (at its RTS), and opens its regions only after a second
//! proof over both PSNs. Hellos a QP holds before then are bounded
//! (`MAX_CANDIDATES`, `MAX_BAD_HELLOS`). The messages are in `wire.rs`, the
//! threat model in the crate README.

use super::qp::{Core, Heartbeat, Inbound, Link, OutLink, QpInner};
use super::{
    lock, lock_within, random_u64, ANSWER_WAIT, MAX_BAD_HELLOS, MAX_CANDIDATES, MAX_DEFERRED,
};

use super::layout::*;
use super::wire::{Kind, Msg};
use crate::sys::{self, EventFd, SeqPacket, SharedMem};
use crate::verbs::*;
use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wire;

impl QpInner {
    /// Active side (INIT → RTR): hands our ring and channels to the instance
    /// owning the peer's (GID, QPN), with the proof of the peer's PSN, and
    /// waits until it holds them. Holds no lock while it waits.
    pub(super) fn dial(&self, remote: RemoteQp, sgid: Gid, rq_psn: u32) -> Result<()> {
        {
            let mut ctl = lock(&self.ctl);
            ctl.remote = Some(remote);
            ctl.sgid = sgid;
            ctl.rq_psn = Some(rq_psn);
            ctl.rtr_at = Some(Instant::now());
            // Hellos held in INIT from anybody but the peer named now go.
            ctl.cands
                .retain(|c| c.hello.a == remote.qp_num && c.hello.gid == remote.gid);
        }
        let ring_fd = lock(&self.core).ring_fd.take();
        let put_back = |fd: Option<OwnedFd>| {
            if let Some(fd) = fd {
                lock(&self.core).ring_fd.get_or_insert(fd);
            }
        };
        let Some(ring_fd) = ring_fd else {
            return Err(Error::InvalidState {
                op: "connect (the ring was handed out already; RESET first)",
                state: QpState::Init,
            });
        };
        let r = (|| {
            let (s, _) = self
                .dev
                .reg
                .connect(&remote.gid, remote.qp_num)
                .map_err(Error::Connect)?;
            s.set_read_timeout(ANSWER_WAIT)?;
            s.set_write_timeout(ANSWER_WAIT)?;
            let nonce = random_u64()?;
            let flags = self.efd_flags();
            let hello = Msg {
                kind: Kind::Hello,
                a: self.qpn,
                b: remote.qp_num,
                c: flags,
                gid: sgid,
                x: nonce,
                y: wire::hello_proof(rq_psn, &sgid, self.qpn, remote.qp_num, nonce),
                z: 0,
            };
            let mut fds = vec![ring_fd.as_fd()];
            if let Some(c) = &self.recv_cq.chan {
                fds.push(c.as_fd());
            }
            if let Some(c) = &self.send_cq.chan {
                if flags & wire::F_SAME_CHAN == 0 {
                    fds.push(c.as_fd());
                }
            }
            // A peer that closes instead of answering (e.g. out of descriptors)
            // may do so before our hello is sent: a refusal as well, not an
            // I/O error of ours.
            s.send(&hello.encode(), &fds).map_err(|e| {
                Error::Connect(format!(
                    "peer QP {} closed the connection: {e}",
                    remote.qp_num
                ))
            })?;
            let mut b = [0u8; 128];
            let answer = match s.recv(&mut b) {
                Ok((n, _)) => Msg::decode(&b[..n]),
                Err(e) => {
                    return Err(Error::Connect(format!(
                        "no answer from peer QP {}: {e}",
                        remote.qp_num
                    )))
                }
            };
            if answer.map(|m| m.kind) != Some(Kind::Received) {
                return Err(Error::Connect(format!(
                    "peer QP {} refused the connection",
                    remote.qp_num
                )));
            }
            Ok(Arc::new(OutLink {
                sock: Arc::new(s),
                nonce,
                req: Mutex::new(0),
            }))
        })();
        match r {
            Ok(out) => {
                drop(ring_fd); // handed to the peer: we keep only the mapping
                lock(&self.ctl).out = Some(out);
                self.dev.wake.signal();
                Ok(())
            }
            Err(e) => {
                put_back(Some(ring_fd));
                Err(e)
            }
        }
    }

    /// RTS: we know our own PSN now. Prove both PSNs on the connection we
    /// dialed, and check the hellos and auth we were holding.
    pub(super) fn on_rts(&self, sq_psn: u32) {
        let auth = {
            let mut ctl = lock(&self.ctl);
            if ctl.sq_psn.is_some() {
                None // RTS → RTS: attributes only
            } else {
                ctl.sq_psn = Some(sq_psn);
                match (&ctl.out, ctl.remote, ctl.rq_psn) {
                    (Some(o), Some(r), Some(rq)) => Some((
                        o.clone(),
                        Msg {
                            y: wire::auth_proof(sq_psn, rq, &ctl.sgid, self.qpn, r.qp_num, o.nonce),
                            ..Msg::new(Kind::Auth)
                        },
                    )),
                    _ => None,
                }
            }
        };
        if let Some((o, m)) = auth {
            if o.sock.send(&m.encode(), &[]).is_err() {
                self.fail_async(Some(WcStatus::RetryExceeded), true);
                return;
            }
        }
        self.try_verify();
        self.dev.wake.signal();
    }

    /// A hello for this QP (device thread). It is held if it can be: the QP
    /// takes hellos, is not connected yet, the hello names the peer set at
    /// RTR (if any) and carries exactly the descriptors its flags announce.
    pub(super) fn on_hello(&self, sock: Arc<SeqPacket>, m: Msg, fds: Vec<OwnedFd>) {
        let id = {
            let mut ctl = lock(&self.ctl);
            let want = 1
                + usize::from(m.c & wire::F_RX_CHAN != 0)
                + usize::from(m.c & wire::F_TX_CHAN != 0 && m.c & wire::F_SAME_CHAN == 0);
            let same_ok = m.c & wire::F_SAME_CHAN == 0
                || m.c & (wire::F_RX_CHAN | wire::F_TX_CHAN) == wire::F_RX_CHAN | wire::F_TX_CHAN;
            let named = ctl.remote.is_none_or(|r| r.qp_num == m.a && r.gid == m.gid);
            if !ctl.accepting
                || ctl.inb.is_some()
                || ctl.bad_hellos >= MAX_BAD_HELLOS
                || ctl.cands.len() >= MAX_CANDIDATES
                || !named
                || fds.len() != want
                || !same_ok
                || m.c & !(wire::F_RX_CHAN | wire::F_TX_CHAN | wire::F_SAME_CHAN) != 0
            {
                return; // dropping the socket closes it: the dialer's RTR fails
            }
            ctl.next_id += 1;
            let id = ctl.next_id;
            ctl.cands.push(Inbound {
                id,
                sock,
                hello: m,
                fds,
                auth: None,
                authed: false,
                deferred: VecDeque::new(),
            });
            id
        };
        // Verify at once if we can (in RTS), so that a dialer whose RTR
        // returned finds us connected.
        self.try_verify();
        let ctl = lock(&self.ctl);
        let held = ctl.inb.iter().chain(ctl.cands.iter()).find(|b| b.id == id);
        if let Some(b) = held {
            if b.sock
                .try_send(&Msg::new(Kind::Received).encode(), &[])
                .is_err()
            {
                let s = b.sock.clone();
                drop(ctl);
                self.drop_inbound(&s);
            }
        }
    }

    /// Forgets an inbound connection (a candidate; the verified one fails
    /// the QP). It leaves the device thread's poll set at once, also when
    /// the failure itself has to wait for a busy `core`.
    fn drop_inbound(&self, s: &Arc<SeqPacket>) {
        let mut ctl = lock(&self.ctl);
        if ctl.inb.as_ref().is_some_and(|b| Arc::ptr_eq(&b.sock, s)) {
            ctl.inb = None;
            drop(ctl);
            self.fail_async(Some(WcStatus::RetryExceeded), true);
        } else {
            ctl.cands.retain(|c| !Arc::ptr_eq(&c.sock, s));
        }
    }

    /// Checks held hellos and auth against the PSNs, once both are known:
    /// the first hello with a right proof becomes the link (its ring mapped,
    /// its eventfds kept), the others are dropped; a right auth on the
    /// linked connection opens the regions to it, a wrong one fails the QP.
    fn try_verify(&self) {
        let mut link = None;
        let mut bad = false;
        {
            let mut ctl = lock(&self.ctl);
            let (Some(remote), Some(rq), Some(sq)) = (ctl.remote, ctl.rq_psn, ctl.sq_psn) else {
                return;
            };
            if ctl.inb.is_none() && !ctl.cands.is_empty() {
                let cands = std::mem::take(&mut ctl.cands);
                for mut c in cands {
                    let h = c.hello;
                    let right = h.a == remote.qp_num
                        && h.gid == remote.gid
                        && h.y == wire::hello_proof(sq, &h.gid, h.a, self.qpn, h.x);
                    if ctl.inb.is_some() {
                        continue; // linked already: the others close
                    }
                    if !right {
                        ctl.bad_hellos += 1;
                        continue;
                    }
                    match self.make_link(&mut c) {
                        Ok(l) => {
                            link = Some(l);
                            ctl.inb = Some(c);
                        }
                        Err(_) => bad = true,
                    }
                }
            }
            let qpn = self.qpn;
            if let Some(b) = ctl.inb.as_mut() {
                if let (false, Some(p)) = (b.authed, b.auth) {
                    let h = b.hello;
                    if p == wire::auth_proof(rq, sq, &h.gid, h.a, qpn, h.x) {
                        b.authed = true;
                    } else {
                        bad = true;
                    }
                }
            }
            if !bad {
                let access = ctl.access;
                if let Some(b) = ctl.inb.as_mut().filter(|b| b.authed) {
                    while let Some((id, rkey, flags)) = b.deferred.pop_front() {
                        if !self.serve_region(access, &b.sock, id, rkey, flags) {
                            bad = true;
                            break;
                        }
                    }
                }
            }
        }
        if let Some(l) = link {
            self.install_link(l);
        }
        if bad {
            self.fail_async(Some(WcStatus::RemoteInvalidRequest), true);
        }
    }

    /// Maps a verified hello's ring and takes its eventfds.
    fn make_link(&self, c: &mut Inbound) -> Result<Link> {
        let m = c.hello;
        let mut it = std::mem::take(&mut c.fds).into_iter();
        let missing = || Error::Connect("the hello's descriptors are missing".into());
        let ring = SharedMem::map_peer(it.next().ok_or_else(missing)?, RING_LEN)?;
        if Ring::check(&ring).is_none() {
            return Err(Error::Connect("peer ring is malformed".into()));
        }
        let mut efd = |present: bool| -> Result<Option<Arc<EventFd>>> {
            if !present {
                return Ok(None);
            }
            let fd = it.next().ok_or_else(missing)?;
            // Anything else (a pipe, a socket) could block our signal.
            if !sys::is_eventfd(fd.as_fd()) {
                return Err(Error::Connect("peer channel is not an eventfd".into()));
            }
            sys::set_nonblocking(fd.as_fd())?;
            Ok(Some(Arc::new(EventFd::from_owned(fd))))
        };
        let rx = efd(m.c & wire::F_RX_CHAN != 0)?;
        let tx = if m.c & wire::F_SAME_CHAN != 0 {
            rx.clone()
        } else {
            efd(m.c & wire::F_TX_CHAN != 0)?
        };
        Ok(Link {
            peer_ring: Arc::new(ring),
            peer_rx_efd: rx,
            peer_tx_efd: tx,
            tail: 0,
            peer_head: 0,
        })
    }

    /// Hands a verified link to the data path (now, or at its next look if
    /// `core` is busy; the device thread's tick retries too).
    pub(super) fn install_link(&self, l: Link) {
        match lock_within(&self.core, Duration::from_millis(5)) {
            Some(mut c) => self.adopt(&mut c, l),
            None => {
                lock(&self.ctl).ready = Some(l);
                self.dev.wake.signal();
            }
        }
    }

    /// The data path takes a verified link, and the heartbeat starts.
    fn adopt(&self, c: &mut Core, l: Link) {
        if !matches!(c.state, QpState::Rtr | QpState::Rts) || c.link.is_some() {
            return;
        }
        // We may be armed already: ask the peer to signal our consumption.
        let peer = Ring(&l.peer_ring);
        peer.h(R_TX_NOTIFY).store(1, SeqCst);
        // Who beats our heart, for a peer that finds it silent
        // (`device_thread::peer_starved`); before the first heartbeat, which
        // the device thread may be too starved to give.
        peer.h(R_PROD_TID)
            .store(self.dev.thread_id.load(Acquire).into(), Relaxed);
        peer.h(R_PROD_PIDNS).store(self.dev.pidns, Relaxed);
        *lock(&self.hb) = Some(Heartbeat {
            own_ring: c.ring.clone(),
            peer_ring: l.peer_ring.clone(),
            last_hb: 0,
            last_hb_change: Instant::now(),
            seen_stopped: false,
        });
        c.link = Some(l);
        // Sends queued meanwhile can go now: wake whoever waits to poll.
        if let Some(ch) = &self.send_cq.chan {
            ch.signal();
        }
    }

    /// A link the device thread verified while `core` was busy. (Inlined:
    /// every post and poll of a connected QP asks, and has its link.)
    #[inline]
    pub(super) fn adopt_ready(&self, c: &mut Core) {
        if c.link.is_none() {
            self.adopt_ready_unlinked(c);
        }
    }

    /// [`Self::adopt_ready`] where there is no link yet.
    #[cold]
    fn adopt_ready_unlinked(&self, c: &mut Core) {
        if let Ok(mut ctl) = self.ctl.try_lock() {
            if let Some(l) = ctl.ready.take() {
                drop(ctl);
                self.adopt(c, l);
            }
        }
    }

    /// Messages on an inbound connection (device thread): auth, region
    /// requests. Anything else, or a hang-up, ends it.
    pub(super) fn on_inbound(&self, id: u64) {
        let mut verify = false;
        let mut end = None;
        {
            let mut guard = lock(&self.ctl);
            let ctl = &mut *guard;
            let access = ctl.access;
            let Some(b) = ctl
                .inb
                .iter_mut()
                .chain(ctl.cands.iter_mut())
                .find(|b| b.id == id)
            else {
                return;
            };
            for _ in 0..16 {
                let mut buf = [0u8; 128];
                let m = match b.sock.try_recv(&mut buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) | Ok((0, _)) => None,
                    Ok((n, fds)) if fds.is_empty() => Msg::decode(&buf[..n]),
                    Ok(_) => None,
                };
                match m {
                    Some(m) if m.kind == Kind::Auth && b.auth.is_none() => {
                        b.auth = Some(m.y);
                        verify = true;
                    }
                    Some(m) if m.kind == Kind::MrReq && b.authed => {
                        if !self.serve_region(access, &b.sock, m.a, m.b, m.c) {
                            end = Some(b.sock.clone());
                            break;
                        }
                    }
                    Some(m) if m.kind == Kind::MrReq && b.deferred.len() < MAX_DEFERRED => {
                        b.deferred.push_back((m.a, m.b, m.c));
                    }
                    _ => {
                        end = Some(b.sock.clone());
                        break;
                    }
                }
            }
        }
        if let Some(s) = end {
            self.drop_inbound(&s);
        } else if verify {
            self.try_verify();
        }
    }

    /// The connection we dialed hung up (device thread): the peer's QP or
    /// process is gone, or it refused our hello.
    pub(super) fn on_out_hangup(&self, s: &Arc<SeqPacket>) {
        let mut ctl = lock(&self.ctl);
        let current = ctl.out.as_ref().is_some_and(|o| Arc::ptr_eq(&o.sock, s));
        if current && sys::poll_one(s.as_fd(), 0, Some(Duration::ZERO)).is_ok_and(|r| r != 0) {
            // out of the poll set at once (a request in flight keeps its own
            // reference and sees the hang-up itself)
            ctl.out = None;
            drop(ctl);
            self.fail_async(Some(WcStatus::RetryExceeded), true);
        }
    }
}
