//! The application's writes: into the send buffer (sent by the next pump or
//! flush), or — when nothing is waiting and the peer has room — straight into
//! the peer's RMB as inline RDMA WRITEs with their CDC (the direct path), or,
//! while the link's SENDs are all in flight, through the connection's window
//! onto the peer's RMB with their CDC owed to the next batch (corked); and
//! the urgent byte (`send(MSG_OOB)`).
//!
//! Spec: `protocol-llc-cdc.md` §3.2 (how much may be written, and where),
//! §3.5 (urgent data), §7.2 (why only a single-link group writes directly).
//! Linux: smc_tx.c (`smc_tx_sendmsg`, `smc_tx_rdma_write`, `smc_tx_should_cork`).

use super::conn::ConnError;
use super::conn_core::{lock, ConnCore, FastConn, FastTx};
use super::lgr::Lgr;
use super::{ConnId, Endpoint, LgrId};
use crate::state::LgrState;
use smc_proto::link::LinkState;
use smc_rdma::Provider;
use smc_rdma::QueuePair;

/// What [`Endpoint::write_direct`] did.
pub(super) enum Direct {
    /// Written straight into the peer's RMB.
    Wrote(usize),
    /// It would go directly, but the peer has no room for it now.
    NoRoom,
    /// The direct path does not apply.
    No,
}

/// Where a direct write goes (see `direct_plan`).
pub(super) struct DirectPlan {
    pub(super) l: LgrId,
    pub(super) slot: usize,
    pub(super) rkey: u32,
    /// The peer's RMBE, as the link addresses it.
    pub(super) rmbe_addr: u64,
    /// Bytes that go now.
    pub(super) n: usize,
    /// The send cursor (total) they follow.
    pub(super) at: u64,
    /// The connection's link epoch (see `ConnCore::set_link`).
    pub(super) epoch: u64,
    /// The link's SENDs are all in flight: the bytes go into the peer's
    /// RMB through its window now and their CDC later
    /// (`DataPath::write_corked`).
    pub(super) corked: bool,
}

/// What [`Endpoint::post_direct`] did.
pub(super) enum Posted {
    /// Nothing: the link is gone.
    Not,
    /// The bytes and their CDC are posted.
    Done,
    /// The bytes are produced, but posting failed: the link is broken.
    LinkBroke(smc_rdma::Error),
}

/// Smallest part of a larger write that goes out directly (see `write_direct`).
const DIRECT_PART_MIN: usize = 16 * 1024;

/// Whether group `lg` is one link, active, in an active group: the only
/// shape in which a connection's own writes and receive dispatch may run
/// beside the endpoint (with two links a failover's replay and CDC order,
/// §7.2, are the endpoint's).
fn one_active_link<P: Provider>(lg: &Lgr<P>) -> bool {
    let mut links = lg.links.iter().enumerate().filter(|(_, r)| r.is_some());
    match (links.next(), links.next()) {
        (Some((slot, _)), None) => {
            lg.state == LgrState::Active
                && lg
                    .group
                    .link(slot)
                    .is_some_and(|k| k.state == LinkState::Active)
        }
        _ => false,
    }
}

impl<P: Provider> Endpoint<P> {
    /// Writes as much of `data` as the send buffer takes; 0 means "would block".
    ///
    /// When nothing written earlier is still waiting and the peer has room, the
    /// bytes go out at once as inline RDMA WRITEs from `data` itself (copied at
    /// post time, §3.2: the send buffer only has to hold data that cannot be
    /// written yet), followed by their CDC: one copy instead of two; with every
    /// SEND of the link in flight, where the peer's RMB is mapped here, they
    /// are copied into it and their CDC goes with the next batch
    /// (`DataPath::write_corked`). Otherwise they are copied into the send
    /// buffer and sent by [`Self::pump`].
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

    /// What a write of nothing on connection `id` says, as a TCP socket's
    /// `send` of zero bytes (tcp.c `tcp_sendmsg_locked`, which looks at the
    /// socket's error and its shutdown of sending before it copies
    /// anything): the reset or abort of a failed connection,
    /// [`ConnError::Closed`] once we shut down writing ourselves; `Ok` while
    /// it can be written, and after a close of the peer's alone (TCP's
    /// `CLOSE_WAIT`, where only the reset that data would draw fails it).
    pub fn write_refused(&self, id: ConnId) -> std::result::Result<(), ConnError> {
        let k = self.core(id).ok_or(ConnError::NotConnected)?;
        match k.closer.error() {
            Some(smc_proto::close::CloseError::Reset) => Err(ConnError::Reset),
            Some(smc_proto::close::CloseError::Aborted) => Err(ConnError::Aborted),
            Some(smc_proto::close::CloseError::ResetInCloseWait) => Err(ConnError::Closed),
            None if k.closer.tx_flags().any() => Err(ConnError::Closed),
            None => Ok(()),
        }
    }

    /// Bytes a [`Self::write`] of connection `id` could take now: the send
    /// buffer's free space (0 when the connection cannot be written).
    pub fn sndbuf_free(&self, id: ConnId) -> usize {
        self.core(id)
            .and_then(|k| k.dp.as_ref().map(|dp| dp.sndbuf_free()))
            .unwrap_or(0)
    }

    /// Copies into the send buffer; [`Self::pump`] sends it.
    fn write_buffered(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        let w = self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .write_buffered(data)?;
        let b = &mut self.events.bufs;
        if w.n > 0 {
            b.tx_too_small += u64::from(w.too_small);
            b.tx_peer_too_small += u64::from(w.peer_too_small);
            self.mark_tx(id);
        } else if w.full {
            b.tx_full += 1;
        }
        Ok(w.n)
    }

    /// Whether up to `want` bytes of connection `k` (in `lgrs`) can go
    /// straight into the peer's RMB now, and where: the conditions of the
    /// direct path of [`Self::write`].
    /// `lessee`: asked for the commit of the connection's write lease, which
    /// other writers wait for. `cork`: the caller can write without a CDC
    /// while the link's SENDs are all in flight (a plan with `corked`), where
    /// the connection has a window onto the peer's RMB.
    pub(super) fn direct_plan(
        k: &mut ConnCore<P>,
        lgr: Option<LgrId>,
        lgrs: &super::Slots<LgrId, Lgr<P>>,
        max_inline: usize,
        want: usize,
        lessee: bool,
        cork: bool,
    ) -> std::result::Result<DirectPlan, Direct> {
        let (slot, peer) = k.direct_ready(lessee)?;
        let Some(l) = lgr else {
            return Err(Direct::No);
        };
        let Some(lg) = lgrs.get(l) else {
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
        // A link whose SENDs are all in flight is ahead of its peer's reader:
        // a caller that may cork writes on into the window (a copy as the
        // fast path's), and the CDC goes with the next batch a completion
        // lets out, instead of a copy into the send buffer now and another
        // into the peer's RMB then.
        let corked = res.sends_full();
        let window = k
            .peer_window
            .as_ref()
            .is_some_and(|(s, r, _)| *s == slot && *r == rkey);
        if corked && !(cork && window) {
            return Err(Direct::No);
        }
        let Some(dp) = k.dp.as_ref() else {
            return Err(Direct::No);
        };
        // What fits now, if the device takes it inline. A part of a larger
        // write only when the part is large: many small direct pieces (verbs'
        // inline limit is 64 bytes) would cost more than the copy they save.
        if want == 0 || want.min(DIRECT_PART_MIN) > max_inline {
            return Err(Direct::No);
        }
        // Bytes written directly count in the send buffer while a buffered
        // byte before them waits for its CDC's completion
        // (`DataPath::sndbuf_free`), so room is the smaller of its free
        // space and the peer's. Too little of either: wait for more (a CDC
        // completing, or the peer's consumer cursor), the write stays
        // direct.
        let room = want.min(dp.sndbuf_free());
        let n = room.min(dp.peer_space());
        if n == 0 || (n < want && n < DIRECT_PART_MIN) {
            return Err(Direct::NoRoom);
        }
        if n > max_inline {
            return Err(Direct::No);
        }
        Ok(DirectPlan {
            l,
            slot,
            rkey,
            rmbe_addr: base + peer.offset,
            n,
            at: dp.sent_total(),
            epoch: k.epoch,
            corked,
        })
    }

    /// The direct path of [`Self::write`]: plans and posts under one lock of
    /// the connection's core.
    fn write_direct(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<Direct, ConnError> {
        let Some(c) = self.conns.get(id) else {
            return Ok(Direct::No);
        };
        let mut k = lock(&c.core);
        let max_inline = self.limits.max_inline as usize;
        let p = match Self::direct_plan(
            &mut k,
            c.lgr,
            &self.lgrs,
            max_inline,
            data.len(),
            false,
            true,
        ) {
            Ok(p) => p,
            Err(d) => return Ok(d),
        };
        if p.corked {
            let n = k.write_corked(p.n, data);
            drop(k);
            if n == 0 {
                return Ok(Direct::No);
            }
            // (the flush that a send completion lets out sends their CDC)
            self.mark_tx(id);
            self.corked_writes += 1;
            return Ok(Direct::Wrote(n));
        }
        let posted = Self::post_direct(
            &mut self.lgrs,
            &mut self.cdc_sent,
            id,
            &mut k,
            &p,
            Some(data),
        )?;
        if matches!(posted, Posted::Done) {
            Self::grant_fast(&mut self.lgrs, max_inline, id, &mut k, &p);
        }
        drop(k);
        Ok(match self.direct_posted(&p, posted)? {
            true => Direct::Wrote(p.n),
            false => Direct::No,
        })
    }

    /// After a direct write of connection `id` (its core `k`) as planned by
    /// [`Self::direct_plan`], whose conditions held: the connection may
    /// write the same way on its own ([`FastConn`]) until its link changes
    /// (a new epoch) or the link's conditions stop holding
    /// ([`Self::close_fast`]).
    pub(super) fn grant_fast(
        lgrs: &mut super::Slots<LgrId, Lgr<P>>,
        max_inline: usize,
        id: ConnId,
        k: &mut ConnCore<P>,
        p: &DirectPlan,
    ) {
        let Some(res) = lgrs
            .get_mut(p.l)
            .and_then(|lg| lg.links.get_mut(p.slot))
            .and_then(Option::as_mut)
        else {
            return;
        };
        if k.fast.as_ref().is_some_and(|f| {
            f.epoch == k.epoch && f.slot == p.slot && f.rkey == p.rkey && f.rmbe_addr == p.rmbe_addr
        }) {
            // (still granted; the link's side may have been closed since)
            if !res.fast_granted {
                res.fast_granted = true;
                res.book().open = true;
            }
            return;
        }
        res.fast_granted = true;
        res.book().open = true;
        // (the window onto the peer's RMBE that the fast path copies into,
        // where the provider has one: `ConnCore::fast_write`)
        let mapped = k
            .peer_window
            .as_ref()
            .is_some_and(|(slot, rkey, _)| *slot == p.slot && *rkey == p.rkey);
        if !mapped {
            if let Some(dp) = k.dp.as_ref() {
                let len = dp.config().peer_rmbe_len;
                if let Some(w) = res.qp.remote_window(p.rkey, p.rmbe_addr, len) {
                    k.peer_window = Some((p.slot, p.rkey, w));
                }
            }
        }
        k.fast = Some(FastTx {
            tx: res.tx.clone(),
            id,
            slot: p.slot,
            epoch: p.epoch,
            rkey: p.rkey,
            rmbe_addr: p.rmbe_addr,
            max_inline,
        });
    }

    /// Stops the fast path's direct writes on the links of group `l` once
    /// the conditions of [`Self::direct_plan`] that are the group's no
    /// longer hold: a single link, active, in an active group (run by
    /// every pump; a connection's own conditions and its link epoch the
    /// fast path checks itself).
    pub(super) fn close_fast(&mut self, l: LgrId) {
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        if !lg.links.iter().flatten().any(|r| r.fast_granted) {
            return;
        }
        let single = one_active_link(lg);
        if single {
            return;
        }
        for res in lg.links.iter_mut().flatten() {
            if res.fast_granted {
                res.fast_granted = false;
                res.book().open = false;
            }
        }
    }

    /// Opens the receive side of group `l`'s link to the connections' own
    /// receive dispatch ([`FastConn::try_read`]) while the group is one
    /// active link, and closes it otherwise: with two links a connection's
    /// CDCs may come on either, and a failover's (§7.2) are the endpoint's
    /// to order. Looked at by every pump of the group.
    pub(super) fn open_rx(&mut self, l: LgrId) {
        let Some(lg) = self.lgrs.get(l) else {
            return;
        };
        let single = one_active_link(lg);
        for res in lg.links.iter().flatten() {
            res.rx.set_open(single && res.connected);
        }
    }

    /// Connection `id`'s handle for the fast path ([`FastConn`]): what it
    /// can do without the endpoint. `None` for an unknown connection.
    pub fn fast_conn(&self, id: ConnId) -> Option<FastConn<P>> {
        let c = self.conns.get(id)?;
        Some(FastConn::new(c.core.clone()))
    }

    /// Produces the `p.n` bytes of connection `id` (its core `k`) that
    /// [`Self::direct_plan`] placed and posts them on its link in `lgrs`:
    /// the inline WRITEs of `data` (`None`: a lease copied them already)
    /// and their CDC (counted in `cdc_sent`). What came of it goes to
    /// [`Self::direct_posted`] once `k` is unlocked.
    pub(super) fn post_direct(
        lgrs: &mut super::Slots<LgrId, Lgr<P>>,
        cdc_sent: &mut u64,
        id: ConnId,
        k: &mut ConnCore<P>,
        p: &DirectPlan,
        data: Option<&[u8]>,
    ) -> std::result::Result<Posted, ConnError> {
        let Some(res) = lgrs
            .get_mut(p.l)
            .and_then(|lg| lg.links.get_mut(p.slot))
            .and_then(Option::as_mut)
        else {
            return Ok(Posted::Not);
        };
        let posted = k.post_direct(id, res, p.n, p.rkey, p.rmbe_addr, data)?;
        *cdc_sent += u64::from(posted.is_ok());
        Ok(match posted {
            Ok(()) => Posted::Done,
            Err(e) => Posted::LinkBroke(e),
        })
    }

    /// After [`Self::post_direct`]: `Ok(false)`: nothing was done.
    pub(super) fn direct_posted(
        &mut self,
        p: &DirectPlan,
        posted: Posted,
    ) -> std::result::Result<bool, ConnError> {
        match posted {
            Posted::Not => Ok(false),
            Posted::Done => Ok(true),
            // The link is broken and, being the only one, takes the connection
            // with it; like TCP's, this write itself succeeded.
            Posted::LinkBroke(e) => match self.link_error(p.l, p.slot, e) {
                Ok(()) => Ok(true),
                Err(_) => Err(ConnError::Aborted),
            },
        }
    }

    /// Sends one urgent byte (TCP `send(MSG_OOB)`): it goes into the stream after
    /// everything written before, flagged so that the peer can fetch it out of
    /// band. `Ok(false)` if the send buffer is full or the previous urgent byte has
    /// not gone out yet (try again later).
    pub fn write_oob(&mut self, id: ConnId, byte: u8) -> std::result::Result<bool, ConnError> {
        if self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .smc()?
            .urgent_pending()
        {
            return Ok(false);
        }
        // through the send buffer: the byte must still be unsent to be marked
        if self.write_buffered(id, &[byte])? == 0 {
            return Ok(false);
        }
        self.mark_tx(id);
        let mut k = self.core(id).ok_or(ConnError::NotConnected)?;
        Ok(k.smc()?.mark_urgent())
    }
}
