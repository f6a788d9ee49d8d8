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
        let data = data.get(..self.n).ok_or(ConnError::Aborted)?;
        self.copy_from_at(0, data).map_err(|_| ConnError::Aborted)
    }

    /// Copies `data` into the lent bytes from byte `skip` of the lease on
    /// (`skip + data.len()` at most [`Self::len`]).
    pub fn copy_from_at(&self, skip: usize, data: &[u8]) -> std::io::Result<()> {
        let mut at = 0;
        for (off, len) in parts(self.chunks.as_slice(), self.n, skip, data.len())? {
            self.win
                .write_at(off, &data[at..at + len])
                .map_err(std::io::Error::other)?;
            at += len;
        }
        Ok(())
    }

    /// Copies lent bytes from byte `skip` of the lease on into `buf` (what
    /// was put there, to be written again when the commit found the
    /// connection changed: [`Endpoint::write_commit_len`] `Ok(false)`).
    pub fn copy_to_at(&self, skip: usize, buf: &mut [u8]) -> std::io::Result<()> {
        let mut at = 0;
        for (off, len) in parts(self.chunks.as_slice(), self.n, skip, buf.len())? {
            self.win
                .read_at(off, &mut buf[at..at + len])
                .map_err(std::io::Error::other)?;
            at += len;
        }
        Ok(())
    }

    /// Reads from `fd` (one `readv`, or `preadv` at file offset `at`)
    /// straight into the lent bytes from byte `skip` of the lease on, up to
    /// its end: the kernel's copy is the only one. Bytes read.
    pub fn read_fd(
        &self,
        skip: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let want = self.n.checked_sub(skip).ok_or_else(out_of_lease)?;
        let p = parts(self.chunks.as_slice(), self.n, skip, want)?;
        self.win.read_fd(&p, fd, at)
    }
}

fn out_of_lease() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        "range outside the lent bytes",
    )
}

/// The ranges of the RMB that bytes `skip..skip + len` of a lease over
/// `chunks` (`n` bytes in all) occupy, in order.
fn parts(
    chunks: &[(usize, usize)],
    n: usize,
    skip: usize,
    len: usize,
) -> std::io::Result<Vec<(usize, usize)>> {
    if skip.checked_add(len).is_none_or(|e| e > n) {
        return Err(out_of_lease());
    }
    let mut v = Vec::with_capacity(2);
    let (mut skip, mut len) = (skip, len);
    for &(off, clen) in chunks {
        if len == 0 {
            break;
        }
        if skip >= clen {
            skip -= clen;
            continue;
        }
        let k = (clen - skip).min(len);
        v.push((off + skip, k));
        len -= k;
        skip = 0;
    }
    Ok(v)
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
        let buf = buf.get_mut(..self.n).ok_or(ConnError::Aborted)?;
        self.copy_to_at(0, buf).map_err(|_| ConnError::Aborted)
    }

    /// Copies lent bytes from byte `skip` of the lease on into `buf`
    /// (`skip + buf.len()` at most [`Self::len`]).
    pub fn copy_to_at(&self, skip: usize, buf: &mut [u8]) -> std::io::Result<()> {
        let mut at = 0;
        for (off, len) in parts(self.chunks.as_slice(), self.n, skip, buf.len())? {
            self.win
                .read_at(off, &mut buf[at..at + len])
                .map_err(std::io::Error::other)?;
            at += len;
        }
        Ok(())
    }

    /// Writes `len` lent bytes from byte `skip` of the lease on to `fd`
    /// (one `writev`, or `pwritev` at file offset `at`) straight from the
    /// RMB. Bytes written.
    pub fn write_fd(
        &self,
        skip: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        at: Option<u64>,
    ) -> std::io::Result<usize> {
        let p = parts(self.chunks.as_slice(), self.n, skip, len)?;
        self.win.write_fd(&p, fd, at)
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
        self.write_lease_up_to(id, data.len())
    }

    /// [`Self::write_lease`] for up to `max` bytes the caller will put in
    /// place itself (the zero-copy write: e.g. read from a file straight into
    /// the peer's RMB), committed with [`Self::write_commit_len`].
    pub fn write_lease_up_to(
        &mut self,
        id: ConnId,
        max: usize,
    ) -> std::result::Result<WritePlan, ConnError> {
        let Some(c) = self.conns.get(id) else {
            return Err(ConnError::NotConnected);
        };
        let mut k = lock(&c.core);
        k.smc()?;
        if !k.closer.can_write() {
            // The error a write gets, before the caller produces bytes for
            // a space it cannot have (a splice would take them from its
            // pipe and lose them).
            return Err(k.close_error());
        }
        let max_inline = self.limits.max_inline as usize;
        let p = match Self::direct_plan(&mut k, c.lgr, &self.lgrs, max_inline, max, false, false) {
            Ok(p) => p,
            Err(Direct::NoRoom) => return Ok(WritePlan::NoRoom),
            Err(_) => return Ok(WritePlan::NotDirect),
        };
        let Some(res) = self
            .lgrs
            .get(p.l)
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
        self.write_commit_len(id, lease, if copied { lease.n } else { 0 })
    }

    /// Ends a [`WriteLease`] of which the first `n` bytes (at most
    /// [`WriteLease::len`]) were put in place: they are announced (a CDC),
    /// the rest of the lent space stays unseen by the peer. `Ok(true)`: `n`
    /// bytes are written. `Ok(false)`: `n` 0 (the lease is ended, nothing
    /// written), or as [`Self::write_commit`].
    pub fn write_commit_len(
        &mut self,
        id: ConnId,
        lease: &WriteLease,
        n: usize,
    ) -> std::result::Result<bool, ConnError> {
        let Some(c) = self.conns.get(id) else {
            return Err(ConnError::NotConnected);
        };
        let mut k = lock(&c.core);
        k.smc()?;
        k.write_leased = false;
        if n == 0 || n > lease.n {
            return Ok(false);
        }
        let max_inline = self.limits.max_inline as usize;
        // (the peer's free space only grows while a lease is out: all `n`
        // bytes fit where the lease put them)
        let p = match Self::direct_plan(&mut k, c.lgr, &self.lgrs, max_inline, n, true, false) {
            Ok(p) => p,
            Err(_) => return Ok(false),
        };
        if p.n != n
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

    /// What a caller that wants to look at the readable bytes before saying
    /// how many it takes does where [`Self::read_lease`] lends no window
    /// ([`ReadPlan::NoWindow`]): copies up to `buf.len()` of them into `buf`
    /// without consuming them, and holds them as a lease does (other readers
    /// wait) until [`Self::read_commit`] says how many were taken. `Ok(0)`:
    /// as [`ReadPlan::Empty`], no lease.
    pub fn read_peek(
        &mut self,
        id: ConnId,
        buf: &mut [u8],
    ) -> std::result::Result<usize, ConnError> {
        let n = self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .read_peek(buf)?;
        if n == 0 {
            self.grant_rx(id);
        }
        Ok(n)
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
