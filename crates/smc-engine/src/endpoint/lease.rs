//! Leases: the zero-copy side of reads and writes. A write lease lends a
//! window onto the peer's RMB where the next bytes go (the direct path of
//! `write.rs`, with the copy left to the caller); a read lease lends the
//! readable bytes of our RMB. Either is ended by its commit, which announces
//! the bytes (a CDC) or frees their space; until then other readers or
//! writers of the connection wait.
//!
//! No Linux counterpart (the kernel copies from and to user memory); the
//! rules are those of `protocol-llc-cdc.md` §3.2 and §3.4.

use super::conn::ConnError;
use super::conn_core::lock;
use super::write::Direct;
use super::{ConnId, Endpoint};
use smc_rdma::{MemWindow, Provider, QueuePair};
use smc_wire::cdc::RingChunks;

/// What [`Endpoint::write_lease`] found.
#[derive(Debug)]
pub enum WritePlan {
    /// Copy this much into the peer's RMB, then commit.
    Lease(WriteLease),
    /// The direct path applies but the peer has no room now.
    NoRoom,
    /// The direct path does not apply (or the provider lends no window):
    /// use [`Endpoint::write`].
    NotDirect,
}

/// A place in the peer's RMB lent for the next bytes of a connection (see
/// [`Endpoint::write_lease`]).
#[derive(Debug)]
pub struct WriteLease {
    win: MemWindow,
    chunks: RingChunks,
    n: usize,
    /// The send cursor (total) the bytes follow.
    at: u64,
    slot: usize,
    rkey: u32,
    /// The connection's link epoch (see `ConnCore::set_link`).
    epoch: u64,
}

impl WriteLease {
    /// Bytes lent (a prefix of the data the lease was asked for).
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies the first [`Self::len`] bytes of `data` into the peer's RMB.
    /// An error means the peer's region went away (the connection is being
    /// torn down); commit nothing then.
    pub fn copy_from(&self, data: &[u8]) -> std::result::Result<(), ConnError> {
        let mut at = 0;
        for &(off, len) in self.chunks.as_slice() {
            let src = data.get(at..at + len).ok_or(ConnError::Aborted)?;
            self.win
                .write_at(off, src)
                .map_err(|_| ConnError::Aborted)?;
            at += len;
        }
        Ok(())
    }
}

/// What [`Endpoint::read_lease`] found.
#[derive(Debug)]
pub enum ReadPlan {
    /// Copy out, then commit.
    Lease(ReadLease),
    /// Nothing to read: `Ok(0)` of [`Endpoint::read_into`] (end of file
    /// when [`Endpoint::peer_done`], else would block).
    Empty,
    /// The provider lends no window: use [`Endpoint::read_into`].
    NoWindow,
}

/// Readable bytes of a connection's RMB lent out to be copied without
/// holding the endpoint (see [`Endpoint::read_lease`]).
#[derive(Debug)]
pub struct ReadLease {
    win: MemWindow,
    chunks: RingChunks,
    n: usize,
}

impl ReadLease {
    pub(super) fn new(win: MemWindow, chunks: RingChunks, n: usize) -> ReadLease {
        ReadLease { win, chunks, n }
    }

    /// Bytes lent.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies the lent bytes into the front of `buf` (which is at least
    /// [`Self::len`] long, as the lease was asked for).
    pub fn copy_to(&self, buf: &mut [u8]) -> std::result::Result<(), ConnError> {
        let mut at = 0;
        for &(off, len) in self.chunks.as_slice() {
            let dst = buf.get_mut(at..at + len).ok_or(ConnError::Aborted)?;
            self.win.read_at(off, dst).map_err(|_| ConnError::Aborted)?;
            at += len;
        }
        Ok(())
    }
}

impl<P: Provider> Endpoint<P> {
    /// The direct path of [`Self::write`] with the copy left to the caller,
    /// to be made without whatever guards this endpoint (a lock): up to
    /// `data.len()` bytes are lent a window onto the peer's RMB where they
    /// would go now. Copy them with [`WriteLease::copy_from`], then announce
    /// them with [`Self::write_commit`]; nothing is announced before. Only a
    /// provider that maps the peer's memory here
    /// ([`QueuePair::remote_window`]) lends; otherwise, and whenever the
    /// direct path does not apply, this says so and [`Self::write`] is the
    /// way. One lease per connection at a time (the caller serializes its
    /// writers).
    pub fn write_lease(
        &mut self,
        id: ConnId,
        data: &[u8],
    ) -> std::result::Result<WritePlan, ConnError> {
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return Err(ConnError::NotConnected);
        };
        let mut k = lock(&c.core);
        k.smc()?;
        let max_inline = self.max_inline as usize;
        let p = match Self::direct_plan(&mut k, c.lgr, &self.lgrs, max_inline, data.len(), false) {
            Ok(p) => p,
            Err(Direct::NoRoom) => return Ok(WritePlan::NoRoom),
            Err(_) => return Ok(WritePlan::NotDirect),
        };
        let Some(res) = self
            .lgrs
            .get(p.l)
            .and_then(Option::as_ref)
            .and_then(|lg| lg.links.get(p.slot))
            .and_then(Option::as_ref)
        else {
            return Ok(WritePlan::NotDirect);
        };
        let k = &mut *k;
        let Some(dp) = k.dp.as_ref() else {
            return Ok(WritePlan::NotDirect);
        };
        let win = match &k.peer_window {
            Some((slot, rkey, w)) if *slot == p.slot && *rkey == p.rkey => w.clone(),
            _ => {
                let rmbe_len = dp.config().peer_rmbe_len;
                let Some(w) = res.qp.remote_window(p.rkey, p.rmbe_addr, rmbe_len) else {
                    return Ok(WritePlan::NotDirect);
                };
                k.peer_window = Some((p.slot, p.rkey, w.clone()));
                w
            }
        };
        k.write_leased = true;
        Ok(WritePlan::Lease(WriteLease {
            win,
            chunks: dp.peer_write_chunks(p.n),
            n: p.n,
            at: p.at,
            slot: p.slot,
            rkey: p.rkey,
            epoch: p.epoch,
        }))
    }

    /// Ends a [`WriteLease`]; `copied`: [`WriteLease::copy_from`] succeeded.
    /// `Ok(true)`: its CDC is posted, the bytes are written. `Ok(false)`:
    /// not copied, or the connection changed since the lease (a link failed,
    /// ...): nothing was announced, and the bytes are to be written again
    /// with [`Self::write`] (what the lease copied stays beyond the send
    /// cursor, unseen by the peer, and is overwritten).
    pub fn write_commit(
        &mut self,
        id: ConnId,
        lease: &WriteLease,
        copied: bool,
    ) -> std::result::Result<bool, ConnError> {
        let Some(c) = self.conns.get(id).and_then(Option::as_ref) else {
            return Err(ConnError::NotConnected);
        };
        let mut k = lock(&c.core);
        k.smc()?;
        k.write_leased = false;
        if !copied {
            return Ok(false);
        }
        let max_inline = self.max_inline as usize;
        let p = match Self::direct_plan(&mut k, c.lgr, &self.lgrs, max_inline, lease.n, true) {
            Ok(p) => p,
            Err(_) => return Ok(false),
        };
        if p.n != lease.n
            || p.slot != lease.slot
            || p.rkey != lease.rkey
            || p.at != lease.at
            || p.epoch != lease.epoch
        {
            return Ok(false);
        }
        let posted = Self::post_direct(&mut self.lgrs, &mut self.cdc_sent, id, &mut k, &p, None)?;
        if matches!(posted, super::write::Posted::Done) {
            Self::grant_fast(&mut self.lgrs, max_inline, id, &mut k, &p);
        }
        drop(k);
        self.direct_posted(&p, posted)
    }

    /// [`Self::read_into`] with the copy left to the caller, to be made
    /// without whatever guards this endpoint (a lock): the readable bytes, up
    /// to `max`, are lent as a window onto the RMB. Copy them with
    /// [`ReadLease::copy_to`], then free their space with
    /// [`Self::read_commit`]; until then the peer cannot overwrite them. One
    /// lease per connection at a time (the caller serializes its readers).
    pub fn read_lease(
        &mut self,
        id: ConnId,
        max: usize,
    ) -> std::result::Result<ReadPlan, ConnError> {
        let plan = self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .read_lease(max);
        if matches!(plan, Ok(ReadPlan::Empty)) {
            self.grant_rx(id);
        }
        plan
    }

    /// Whether a read or write of connection `id` was turned away because of
    /// a lease since the last call: its caller may be waiting, and nothing
    /// but the lease's end tells it to look again.
    pub fn take_lease_waited(&mut self, id: ConnId) -> bool {
        self.core(id)
            .is_some_and(|mut k| std::mem::take(&mut k.lease_waited))
    }

    /// Ends a [`ReadLease`] of which `n` bytes were copied (0 if the copy
    /// failed): their space in the RMB is free (the peer learns it with the
    /// next CDC that is due).
    pub fn read_commit(&mut self, id: ConnId, n: usize) -> std::result::Result<(), ConnError> {
        let due = self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .read_commit(n)?;
        if due {
            // (a consumer cursor update may be due)
            self.mark_tx(id);
        }
        Ok(())
    }
}
