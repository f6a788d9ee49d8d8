//! In-place (zero-copy) reads and writes: [`SmcStream::write_in_place`] lends
//! the place in the peer's RMB where the next bytes go, and
//! [`SmcStream::read_in_place`] lends the received bytes where they lie in
//! our RMB; each is committed by the length the caller used. The bytes are
//! reached through [`WriteSpace`] and [`ReadSpace`]: copies, or a file, pipe
//! or socket read into or written from them by the kernel (`readv`/`writev`),
//! so that e.g. a file goes to the peer with the kernel's copy as the only
//! one (the preload's `sendfile` does that).
//!
//! Why no `&mut [u8]`: the lent memory is shared with the peer's process,
//! which may (if it misbehaves) change it at any time; a Rust reference to
//! memory that changes under it is undefined behaviour, a raw copy or the
//! kernel's is not. The rules are the engine's leases'
//! (`smc_engine::endpoint::lease`): one lent space per direction of a
//! connection at a time, other readers or writers of it wait meanwhile.
//!
//! Where the connection cannot lend (a TCP fallback, a device whose memory
//! is not mapped here such as an RNIC, data still waiting in the send
//! buffer, a group of two links) the same calls work through a buffer of the
//! library's: the caller's code does not change, only the copy is back.

use super::{conn_error, noted, SmcConn, SmcStream};
use crate::ctx::Want;
use crate::provider::AnyProvider;
use smc_engine::endpoint::{ConnId, Endpoint, ReadLease, ReadPlan, WriteLease, WritePlan};
use std::io;
use std::os::fd::AsFd;

/// Largest buffer the library lends where the connection cannot lend its
/// own memory.
pub(crate) const BOUNCE_MAX: usize = 256 << 10;

/// Space lent for the next bytes of a connection ([`SmcStream::write_in_place`]):
/// `len()` bytes, filled from the front; the caller says how many it filled.
pub struct WriteSpace<'a> {
    inner: WSpace<'a>,
}

enum WSpace<'a> {
    Rmb(&'a WriteLease),
    Buf(&'a mut [u8]),
}

impl<'a> WriteSpace<'a> {
    /// The peer's RMB, as a write lease lends it.
    pub(crate) fn rmb(l: &'a WriteLease) -> WriteSpace<'a> {
        WriteSpace {
            inner: WSpace::Rmb(l),
        }
    }

    /// A buffer of the library's.
    pub(crate) fn buf(b: &'a mut [u8]) -> WriteSpace<'a> {
        WriteSpace {
            inner: WSpace::Buf(b),
        }
    }

    /// Bytes lent.
    pub fn len(&self) -> usize {
        match &self.inner {
            WSpace::Rmb(l) => l.len(),
            WSpace::Buf(b) => b.len(),
        }
    }

    /// Whether nothing is lent (never, from [`SmcStream::write_in_place`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the space is the peer's RMB itself (zero-copy), not a buffer
    /// of the library's that is copied after.
    pub fn in_rmb(&self) -> bool {
        matches!(self.inner, WSpace::Rmb(_))
    }

    /// Copies `data` in at byte `at` of the space (`at + data.len()` at most
    /// [`Self::len`], else `InvalidInput`).
    pub fn copy_from(&mut self, at: usize, data: &[u8]) -> io::Result<()> {
        match &mut self.inner {
            WSpace::Rmb(l) => l.copy_from_at(at, data),
            WSpace::Buf(b) => {
                let dst = at
                    .checked_add(data.len())
                    .and_then(|e| b.get_mut(at..e))
                    .ok_or_else(outside)?;
                dst.copy_from_slice(data);
                Ok(())
            }
        }
    }

    /// Reads from `fd` (one `read`, or `pread` at file offset `offset`) into
    /// the space from byte `at` to its end: with the RMB lent, straight into
    /// the peer's memory. Bytes read, as `read` returns them (0 at end of
    /// file; `WouldBlock` from a non-blocking descriptor with nothing).
    pub fn read_from(
        &mut self,
        at: usize,
        fd: impl AsFd,
        offset: Option<u64>,
    ) -> io::Result<usize> {
        match &mut self.inner {
            WSpace::Rmb(l) => l.read_fd(at, fd.as_fd(), offset),
            WSpace::Buf(b) => {
                let dst = b.get_mut(at..).ok_or_else(outside)?;
                Ok(match offset {
                    None => rustix::io::read(fd, dst)?,
                    Some(o) => rustix::io::pread(fd, dst, o)?,
                })
            }
        }
    }
}

/// Received bytes lent where they are ([`SmcStream::read_in_place`]):
/// `len()` bytes; the caller says how many it took from the front.
pub struct ReadSpace<'a> {
    inner: RSpace<'a>,
}

enum RSpace<'a> {
    Rmb(&'a ReadLease),
    Buf(&'a [u8]),
}

impl<'a> ReadSpace<'a> {
    /// Our RMB, as a read lease lends it.
    pub(crate) fn rmb(l: &'a ReadLease) -> ReadSpace<'a> {
        ReadSpace {
            inner: RSpace::Rmb(l),
        }
    }

    /// A buffer of the library's.
    pub(crate) fn buf(b: &'a [u8]) -> ReadSpace<'a> {
        ReadSpace {
            inner: RSpace::Buf(b),
        }
    }

    /// Bytes lent.
    pub fn len(&self) -> usize {
        match &self.inner {
            RSpace::Rmb(l) => l.len(),
            RSpace::Buf(b) => b.len(),
        }
    }

    /// Whether nothing is lent (never, from [`SmcStream::read_in_place`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the bytes are lent in our RMB itself (zero-copy), not copied
    /// into a buffer of the library's first.
    pub fn in_rmb(&self) -> bool {
        matches!(self.inner, RSpace::Rmb(_))
    }

    /// Copies bytes from byte `at` of the space into `buf` (`at +
    /// buf.len()` at most [`Self::len`], else `InvalidInput`).
    pub fn copy_to(&self, at: usize, buf: &mut [u8]) -> io::Result<()> {
        match &self.inner {
            RSpace::Rmb(l) => l.copy_to_at(at, buf),
            RSpace::Buf(b) => {
                let src = at
                    .checked_add(buf.len())
                    .and_then(|e| b.get(at..e))
                    .ok_or_else(outside)?;
                buf.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Writes `len` bytes from byte `at` of the space to `fd` (one `write`,
    /// or `pwrite` at file offset `offset`): with the RMB lent, straight from
    /// it. Bytes written, as `write` returns them.
    pub fn write_to(
        &self,
        at: usize,
        len: usize,
        fd: impl AsFd,
        offset: Option<u64>,
    ) -> io::Result<usize> {
        match &self.inner {
            RSpace::Rmb(l) => l.write_fd(at, len, fd.as_fd(), offset),
            RSpace::Buf(b) => {
                let src = at
                    .checked_add(len)
                    .and_then(|e| b.get(at..e))
                    .ok_or_else(outside)?;
                Ok(match offset {
                    None => rustix::io::write(fd, src)?,
                    Some(o) => rustix::io::pwrite(fd, src, o)?,
                })
            }
        }
    }
}

fn outside() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "range outside the lent space")
}

pub(crate) fn too_many(n: usize, len: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{n} bytes committed of {len} lent"),
    )
}

impl SmcStream {
    /// Writes in place: lends up to `max` bytes of space where the next
    /// bytes of the stream go — with SMC-R on the shared-memory device the
    /// peer's RMB itself — and calls `f` with it; `f` fills the space from
    /// the front (e.g. [`WriteSpace::read_from`] a file) and returns how many
    /// bytes it filled, which are then sent. Returns that count.
    ///
    /// Waits for room as [`std::io::Write::write`] does (a non-blocking
    /// stream: `WouldBlock`, and `f` is not called). `f`'s error is
    /// returned and nothing is sent; a count above the lent length is
    /// `InvalidInput`, nothing sent. Where the connection cannot lend its
    /// memory (see the module's documentation), and on a non-blocking
    /// stream whose peer has no room, the space is a buffer of the library's
    /// of what the send buffer takes now, and what `f`
    /// filled is written as `write_all` does (on a TCP fallback, which has no
    /// such measure, waiting for room even on a non-blocking stream, since
    /// `f` produced those bytes already); should that fail part way, the
    /// count written is returned.
    pub fn write_in_place<F>(&self, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&mut WriteSpace<'_>) -> io::Result<usize>,
    {
        if max == 0 {
            return Ok(0);
        }
        let nonblocking = self.nonblocking();
        let Some(c) = self.smc_conn()? else {
            return self.bounce_write(None, max, f);
        };
        let deadline = Self::timeout(&self.opts.write_timeout);
        let got = {
            let _busy = c.shared.busy();
            c.shared
                .run(Want::Write(c.id), deadline, nonblocking, |ep| {
                    noted(c, ep, |ep| write_plan(ep, c.id, max, nonblocking))
                })?
        };
        let l = match got {
            WriteGot::Lease(l) => l,
            WriteGot::Bounce(n) => return self.bounce_write(Some(c), n, f),
        };
        let r = f(&mut WriteSpace::rmb(&l));
        match finish_write(c, &l, r)? {
            Finished::Sent(n) => Ok(n),
            Finished::Again(b) => self.write_whole(Some(c), &b),
        }
    }

    /// [`Self::write_in_place`] through a buffer of the library's.
    fn bounce_write<F>(&self, c: Option<&SmcConn>, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&mut WriteSpace<'_>) -> io::Result<usize>,
    {
        let (buf, n) = fill_bounce(max, f)?;
        self.write_whole(c, &buf[..n])
    }

    /// Writes all of `buf`, blocking whatever the stream's mode (the bytes
    /// are produced and cannot be taken back); the count written (less
    /// only after an error part way).
    fn write_whole(&self, c: Option<&SmcConn>, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len();
        let mut done = 0;
        while done < n {
            let r = match c {
                Some(c) => self
                    .smc_write(c, &buf[done..n], false)
                    .inspect(|k| c.stats.tx(*k)),
                None => self.write_with(&buf[done..n], false),
            };
            match r {
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && c.is_none() => {
                    self.wait_writable()?
                }
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Waits until the TCP socket of a fallback stream takes more (a
    /// non-blocking one's, or a blocking one's that timed out).
    fn wait_writable(&self) -> io::Result<()> {
        use rustix::event::{poll, PollFd, PollFlags};
        let until = Self::timeout(&self.opts.write_timeout);
        let mut p = [PollFd::new(&*self.tcp, PollFlags::OUT)];
        let ts = crate::ctx::timespec_until(until);
        poll(&mut p, ts.as_ref())?;
        Ok(())
    }

    /// Reads in place: waits for received bytes as [`std::io::Read::read`]
    /// does, lends up to `max` of them where they are — with SMC-R on the
    /// shared-memory device, in our RMB — and calls `f` with them; `f`
    /// returns how many it took from the front (e.g. after
    /// [`ReadSpace::write_to`] a file), which are then consumed: the rest is
    /// read again by the next read. Returns that count; 0 at end of file,
    /// without calling `f`.
    ///
    /// A non-blocking stream with nothing to read: `WouldBlock`, `f` not
    /// called. `f`'s error is returned and nothing is consumed; a count
    /// above the lent length is `InvalidInput`, nothing consumed. Where
    /// the connection cannot lend its memory the bytes are copied into a
    /// buffer of the library's first (TCP: peeked, then as many consumed as
    /// `f` took).
    pub fn read_in_place<F>(&self, max: usize, f: F) -> io::Result<usize>
    where
        F: FnOnce(&ReadSpace<'_>) -> io::Result<usize>,
    {
        if max == 0 {
            return Ok(0);
        }
        let nonblocking = self.nonblocking();
        let Some(c) = self.smc_conn()? else {
            return self.tcp_read_in_place(max, nonblocking, f);
        };
        let deadline = Self::timeout(&self.opts.read_timeout);
        let mut bounce = Vec::new();
        let got = {
            let _busy = c.shared.busy();
            c.shared
                .run(Want::Read(c.id), deadline, nonblocking, |ep| {
                    noted(c, ep, |ep| read_plan(ep, c.id, max, &mut bounce))
                })?
        };
        match got {
            ReadGot::Eof => Ok(0),
            ReadGot::Lease(l) => {
                let r = f(&ReadSpace::rmb(&l));
                finish_read(c, l.len(), r)
            }
            ReadGot::Peeked(n) => {
                let r = f(&ReadSpace::buf(&bounce[..n]));
                finish_read(c, n, r)
            }
        }
    }

    /// [`Self::read_in_place`] over TCP: the bytes that came behind the CLC
    /// messages first, else the socket's, peeked and then consumed.
    fn tcp_read_in_place<F>(&self, max: usize, nonblocking: bool, f: F) -> io::Result<usize>
    where
        F: FnOnce(&ReadSpace<'_>) -> io::Result<usize>,
    {
        self.take_answer_off(nonblocking)?;
        {
            let p = &mut self.pending.lock().unwrap_or_else(|e| e.into_inner()).bytes;
            if !p.is_empty() {
                let len = p.len().min(max);
                let k = f(&ReadSpace::buf(&p[..len]))?;
                if k > len {
                    return Err(too_many(k, len));
                }
                p.drain(..k);
                return Ok(k);
            }
        }
        use rustix::net::{recv, RecvFlags};
        let mut buf = vec![0u8; max.min(BOUNCE_MAX)];
        let flags = if nonblocking {
            RecvFlags::PEEK | RecvFlags::DONTWAIT
        } else {
            RecvFlags::PEEK
        };
        let (n, _) = recv(&*self.tcp, &mut buf, flags)?;
        if n == 0 {
            return Ok(0);
        }
        let k = f(&ReadSpace::buf(&buf[..n]))?;
        if k > n {
            return Err(too_many(k, n));
        }
        // (the peeked bytes are queued: taking them does not wait)
        let mut done = 0;
        while done < k {
            let (m, _) = recv(&*self.tcp, &mut buf[done..k], RecvFlags::DONTWAIT)?;
            if m == 0 {
                break;
            }
            done += m;
        }
        Ok(k)
    }
}

/// What an in-place write of connection `id` gets now ([`write_plan`]).
pub(crate) enum WriteGot {
    /// The peer's RMB.
    Lease(WriteLease),
    /// A buffer of this many bytes, written through the send buffer.
    Bounce(usize),
}

/// The plan of an in-place write of up to `max` bytes, run under the
/// endpoint (`None`: wait). Through the send buffer where the RMB cannot be
/// lent, and, for a `nonblocking` caller, where the peer has no room but the
/// send buffer has: as `write` would take the bytes (its readiness says
/// writable then, and an edge-triggered loop waits for no other edge). As
/// much as the send buffer takes now, so that writing what `f` fills does
/// not wait; a blocking caller whose send buffer is full gets `max` and
/// waits while writing.
pub(crate) fn write_plan(
    ep: &mut Endpoint<AnyProvider>,
    id: ConnId,
    max: usize,
    nonblocking: bool,
) -> Option<io::Result<WriteGot>> {
    let room = |ep: &mut Endpoint<AnyProvider>, wait: bool| match ep.sndbuf_free(id).min(max) {
        0 if wait => None,
        0 => Some(Ok(WriteGot::Bounce(max))),
        n => Some(Ok(WriteGot::Bounce(n))),
    };
    match ep.write_lease_up_to(id, max) {
        Ok(WritePlan::Lease(l)) => Some(Ok(WriteGot::Lease(l))),
        Ok(WritePlan::NoRoom) if nonblocking => room(ep, true),
        Ok(WritePlan::NoRoom) => None,
        Ok(WritePlan::NotDirect) => room(ep, nonblocking),
        Err(e) => Some(Err(conn_error(e))),
    }
}

/// What an in-place read of connection `id` gets now ([`read_plan`]).
pub(crate) enum ReadGot {
    /// End of file.
    Eof,
    /// The bytes in our RMB.
    Lease(ReadLease),
    /// This many bytes copied into the bounce buffer, not consumed yet.
    Peeked(usize),
}

/// The plan of an in-place read of up to `max` bytes, run under the
/// endpoint (`None`: wait). Where no window is lent, the bytes are peeked
/// into `bounce` (sized here).
pub(crate) fn read_plan(
    ep: &mut Endpoint<AnyProvider>,
    id: ConnId,
    max: usize,
    bounce: &mut Vec<u8>,
) -> Option<io::Result<ReadGot>> {
    let plan = match ep.read_lease(id, max) {
        Ok(p) => p,
        Err(e) => return Some(Err(conn_error(e))),
    };
    match plan {
        ReadPlan::Lease(l) => Some(Ok(ReadGot::Lease(l))),
        ReadPlan::Empty if ep.peer_done(id) => Some(Ok(ReadGot::Eof)),
        ReadPlan::Empty => None,
        ReadPlan::NoWindow => {
            bounce.resize(max.min(BOUNCE_MAX), 0);
            match ep.read_peek(id, bounce) {
                Ok(0) if ep.peer_done(id) => Some(Ok(ReadGot::Eof)),
                Ok(0) => None,
                Ok(n) => Some(Ok(ReadGot::Peeked(n))),
                Err(e) => Some(Err(conn_error(e))),
            }
        }
    }
}

/// A buffer of up to `max` bytes (at most [`BOUNCE_MAX`]) lent to `f`, and
/// the count `f` says it filled (checked against the buffer's length).
pub(crate) fn fill_bounce<F>(max: usize, f: F) -> io::Result<(Vec<u8>, usize)>
where
    F: FnOnce(&mut WriteSpace<'_>) -> io::Result<usize>,
{
    let mut buf = vec![0u8; max.min(BOUNCE_MAX)];
    let len = buf.len();
    let n = f(&mut WriteSpace::buf(&mut buf))?;
    if n > len {
        return Err(too_many(n, len));
    }
    Ok((buf, n))
}

/// How [`finish_write`] ended a write lease.
pub(crate) enum Finished {
    /// These bytes were sent.
    Sent(usize),
    /// The connection changed since the lease (its link moved): these bytes,
    /// copied back out of the lent space, were not announced and are to be
    /// written again, as `smc_write` writes a lease's bytes again.
    Again(Vec<u8>),
}

/// Ends write lease `l` of connection `c` after the caller's `f` returned
/// `r`: commits what it says it filled (nothing on an error or a count
/// beyond the lease), and says what became of it, or the error.
pub(crate) fn finish_write(
    c: &SmcConn,
    l: &WriteLease,
    r: io::Result<usize>,
) -> io::Result<Finished> {
    let n = match &r {
        Ok(n) if *n <= l.len() => *n,
        _ => 0,
    };
    // (the bytes, should the commit not announce them)
    let mut again = Vec::new();
    let mut ep = c.shared.lock();
    let committed = ep.write_commit_len(c.id, l, n);
    if matches!(committed, Ok(false)) && n > 0 {
        again.resize(n, 0);
        if let Err(e) = l.copy_to_at(0, &mut again) {
            again.clear();
            c.shared.after_lease(&mut ep, c.id);
            c.note();
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, e));
        }
    }
    c.shared.after_lease(&mut ep, c.id);
    c.note();
    drop(ep);
    let k = r?;
    if k > l.len() {
        return Err(too_many(k, l.len()));
    }
    match committed {
        Ok(true) => {
            c.stats.tx(n);
            Ok(Finished::Sent(n))
        }
        // (nothing was put in place)
        Ok(false) if n == 0 => Ok(Finished::Sent(0)),
        Ok(false) => Ok(Finished::Again(again)),
        Err(e) => Err(conn_error(e)),
    }
}

/// Consumes `n` bytes of connection `c`'s read lease under the endpoint's
/// lock, posts the consumer-cursor update if one is due now, and ends the
/// lease: what the commit said.
pub(crate) fn commit_read(
    c: &SmcConn,
    n: usize,
) -> std::result::Result<(), smc_engine::endpoint::ConnError> {
    let mut ep = c.shared.lock();
    let committed = ep.read_commit(c.id, n);
    let _ = ep.flush(c.id);
    c.shared.after_lease(&mut ep, c.id);
    c.note();
    committed
}

/// Ends a read lease (or a peek) of `len` bytes of connection `c` after the
/// caller's `f` returned `r`: consumes what it says it took (nothing on an
/// error or a count beyond `len`), and returns that count or the error.
pub(crate) fn finish_read(c: &SmcConn, len: usize, r: io::Result<usize>) -> io::Result<usize> {
    let n = match &r {
        Ok(n) if *n <= len => *n,
        _ => 0,
    };
    let committed = commit_read(c, n);
    let k = r?;
    if k > len {
        return Err(too_many(k, len));
    }
    committed.map_err(conn_error)?;
    c.stats.rx(n);
    Ok(n)
}
