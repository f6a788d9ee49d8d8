//! The application's writes: into the send buffer (sent by the next pump or
//! flush), or — when nothing is waiting and the peer has room — straight into
//! the peer's RMB as inline RDMA WRITEs with their CDC (the direct path); and
//! the urgent byte (`send(MSG_OOB)`).
//!
//! Spec: `protocol-llc-cdc.md` §3.2 (how much may be written, and where),
//! §3.5 (urgent data), §7.2 (why only a single-link group writes directly).
//! Linux: smc_tx.c (`smc_tx_sendmsg`, `smc_tx_rdma_write`).

use super::conn::{ConnError, Phase};
use super::link::{WrKind, MAX_SENDS};
use super::{ConnId, Endpoint, LgrId};
use smc_proto::datapath::DataPath;
use smc_proto::link::LinkState;
use smc_rdma::{MemoryRegion, Provider};

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
}

/// Smallest part of a larger write that goes out directly (see `write_direct`).
const DIRECT_PART_MIN: usize = 16 * 1024;

impl<P: Provider> Endpoint<P> {
    /// Writes as much of `data` as the send buffer takes; 0 means "would block".
    ///
    /// When nothing written earlier is still waiting and the peer has room, the
    /// bytes go out at once as inline RDMA WRITEs from `data` itself (copied at
    /// post time, §3.2: the send buffer only has to hold data that cannot be
    /// written yet), followed by their CDC: one copy instead of two. Otherwise
    /// they are copied into the send buffer and sent by [`Self::pump`].
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

    /// Copies into the send buffer; [`Self::pump`] sends it.
    fn write_buffered(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<usize, ConnError> {
        let c = self.smc_conn(id)?;
        if !c.closer.can_write() {
            return Err(Self::close_error(c));
        }
        if c.write_leased {
            // the lease copies to where these bytes would go: wait for it
            c.lease_waited = true;
            return Ok(0);
        }
        let (Some(dp), Some(sndbuf)) = (c.dp.as_mut(), c.sndbuf.as_ref()) else {
            return Err(ConnError::NotConnected);
        };
        let chunks = dp.sndbuf_free_chunks(data.len());
        let mut n = 0;
        for &(off, len) in chunks.as_slice() {
            if sndbuf.write_at(off, &data[n..n + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            n += len;
        }
        dp.produced(n);
        // (smc_tx.c `smc_tx_sendmsg`: a send larger than the send buffer or
        // the peer's RMB, and a send that must wait for room)
        let (whole, peer) = (sndbuf.len(), dp.config().peer_rmbe_len);
        let noted = std::mem::replace(&mut c.tx_full_noted, n == 0 && !data.is_empty());
        let b = &mut self.events.bufs;
        if n > 0 {
            b.tx_too_small += u64::from(data.len() > whole);
            b.tx_peer_too_small += u64::from(data.len() > peer);
            self.mark_tx(id);
        } else if !data.is_empty() && !noted {
            b.tx_full += 1;
        }
        Ok(n)
    }

    /// Whether up to `want` bytes of connection `id` can go straight into the
    /// peer's RMB now, and where: the conditions of the direct path of
    /// [`Self::write`].
    /// `lessee`: asked for the commit of the connection's write lease, which
    /// other writers wait for.
    pub(super) fn direct_plan(
        &mut self,
        id: ConnId,
        want: usize,
        lessee: bool,
    ) -> std::result::Result<DirectPlan, Direct> {
        let max_inline = self.max_inline as usize;
        let Some(c) = self.conns.get_mut(id).and_then(Option::as_mut) else {
            return Err(Direct::No);
        };
        if c.write_leased && !lessee {
            c.lease_waited = true;
            return Err(Direct::NoRoom);
        }
        let (Some(l), Some(slot), Some(dp), Some(peer)) =
            (c.lgr, c.link, c.dp.as_mut(), c.peer_rmb)
        else {
            return Err(Direct::No);
        };
        if !matches!(c.phase, Phase::Smc { .. })
            || c.move_to.is_some()
            || c.validation.is_some()
            || !c.closer.can_write()
            || dp.unsent() > 0
            || dp.urgent_pending()
            || dp.close_pending()
        {
            return Err(Direct::No);
        }
        let Some(lg) = self.lgrs.get_mut(l).and_then(Option::as_mut) else {
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
        if res.sends_in_flight >= MAX_SENDS {
            return Err(Direct::No);
        }
        // What fits now, if the device takes it inline. A part of a larger
        // write only when the part is large: many small direct pieces (verbs'
        // inline limit is 64 bytes) would cost more than the copy they save.
        let room = want.min(dp.sndbuf_free());
        let n = room.min(dp.peer_space());
        if room == 0 || room.min(DIRECT_PART_MIN) > max_inline {
            return Err(Direct::No);
        }
        if n == 0 || n > max_inline || (n < want && n < DIRECT_PART_MIN) {
            // only the peer's free space is short
            return Err(if n < room.min(DIRECT_PART_MIN) {
                Direct::NoRoom
            } else {
                Direct::No
            });
        }
        Ok(DirectPlan {
            l,
            slot,
            rkey,
            rmbe_addr: base + peer.offset,
            n,
            at: dp.sent_total(),
        })
    }

    /// The direct path of [`Self::write`].
    fn write_direct(&mut self, id: ConnId, data: &[u8]) -> std::result::Result<Direct, ConnError> {
        let p = match self.direct_plan(id, data.len(), false) {
            Ok(p) => p,
            Err(d) => return Ok(d),
        };
        Ok(match self.post_direct(id, &p, Some(data))? {
            true => Direct::Wrote(p.n),
            false => Direct::No,
        })
    }

    /// Produces the `p.n` bytes of connection `id` that [`Self::direct_plan`]
    /// placed and posts them: the inline WRITEs of `data` (`None`: a lease
    /// copied them already) and their CDC. `Ok(false)`: nothing was done.
    pub(super) fn post_direct(
        &mut self,
        id: ConnId,
        p: &DirectPlan,
        data: Option<&[u8]>,
    ) -> std::result::Result<bool, ConnError> {
        let (Some(c), Some(lg)) = (
            self.conns.get_mut(id).and_then(Option::as_mut),
            self.lgrs.get_mut(p.l).and_then(Option::as_mut),
        ) else {
            return Ok(false);
        };
        let (Some(dp), Some(res)) = (
            c.dp.as_mut(),
            lg.links.get_mut(p.slot).and_then(Option::as_mut),
        ) else {
            return Ok(false);
        };
        dp.produced(p.n);
        let Some(batch) = dp.poll_tx() else {
            return Err(ConnError::Aborted);
        };
        debug_assert_eq!(
            batch.writes.iter().map(|w| w.len).sum::<usize>(),
            p.n,
            "the batch writes everything produced"
        );
        c.direct_sent = dp.sent_total();
        let mut posted = Ok(());
        if let Some(data) = data {
            let mut at = 0;
            for w in &batch.writes {
                let addr = p.rmbe_addr + w.peer_offset as u64;
                posted = res.post_write_inline(&data[at..at + w.len], p.rkey, addr);
                if posted.is_err() {
                    break;
                }
                at += w.len;
            }
        }
        if posted.is_ok() {
            posted = res.post(WrKind::Cdc(id, batch.cdc.seqno), &batch.cdc.encode());
            self.cdc_sent += u64::from(posted.is_ok());
        }
        if let Err(e) = posted {
            // The link is broken and, being the only one, takes the connection
            // with it; like TCP's, this write itself succeeded.
            if self.link_error(p.l, p.slot, e).is_err() {
                return Err(ConnError::Aborted);
            }
        }
        Ok(true)
    }

    /// Sends one urgent byte (TCP `send(MSG_OOB)`): it goes into the stream after
    /// everything written before, flagged so that the peer can fetch it out of
    /// band. `Ok(false)` if the send buffer is full or the previous urgent byte has
    /// not gone out yet (try again later).
    pub fn write_oob(&mut self, id: ConnId, byte: u8) -> std::result::Result<bool, ConnError> {
        let c = self.smc_conn(id)?;
        if c.dp.as_ref().is_some_and(DataPath::urgent_pending) {
            return Ok(false);
        }
        // through the send buffer: the byte must still be unsent to be marked
        if self.write_buffered(id, &[byte])? == 0 {
            return Ok(false);
        }
        self.mark_tx(id);
        let c = self.smc_conn(id)?;
        Ok(c.dp.as_mut().is_some_and(DataPath::mark_urgent))
    }
}
