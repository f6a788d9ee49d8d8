//! Reading and writing an `SmcStream`: the connection's fast path first,
//! then through the endpoint (a lease copied outside its lock, or the send
//! buffer), and the out-of-band byte.

use super::{conn_error, noted, SmcConn, SmcStream, DIRECT_WAIT, LEASE_MIN};
use crate::ctx::Want;
use crate::provider::AnyProvider;
use smc_engine::endpoint::{Endpoint, MaySleep, ReadLease, ReadPlan, WriteLease, WritePlan};
use std::io::{self, Read};
use std::time::Instant;

impl SmcStream {
    /// Reads with the copy out of the RMB made after the endpoint's lock is
    /// released (a [`ReadLease`]): other threads' messages are not held up
    /// behind it, and the lock is held for bookkeeping only.
    fn smc_read(&self, c: &SmcConn, buf: &mut [u8], nonblocking: bool) -> io::Result<usize> {
        enum Got {
            Done(usize),
            Lease(ReadLease),
        }
        if let Some(n) = (!buf.is_empty()).then(|| c.try_fast_read(buf)).flatten() {
            c.rearm_if_emptied();
            return Ok(n);
        }
        // (after the fast path, which never waits: the option's lock is
        // taken by reads that may)
        let deadline = Self::timeout(&self.opts.read_timeout);
        if !buf.is_empty() {
            // a non-blocking reader that finds nothing, with nothing for the
            // endpoint to do (the link's receive CQ taken, nothing of the
            // connection waiting for it): no lock, no pump (an event loop
            // reads until it would block, every time)
            if let (true, Some(f)) = (nonblocking, c.fast_conn()) {
                // An event loop that waits on the peer's signal: armed again
                // before the look below (and drained where a poller waits
                // on it level-triggered: a signal whose bytes a read took
                // may still be there, `PeerSignal::arm`), so that the
                // peer's next CDC signals it unless the look finds that CDC.
                // (also when a read before armed it, `rearm_if_emptied`: a
                // peer's write for a SEND that took the bell before that arm
                // may have landed after its drain, and a level-triggered
                // loop that reads to WouldBlock would be woken by it again
                // and again)
                if let Some(s) = c.signal().filter(|s| s.polled()) {
                    s.arm();
                }
                match f.may_sleep() {
                    MaySleep::Sleep => return Err(io::ErrorKind::WouldBlock.into()),
                    MaySleep::Again => {
                        if let Some(n) = c.try_fast_read(buf) {
                            return Ok(n);
                        }
                    }
                    MaySleep::Busy | MaySleep::No => {}
                }
            }
            // a blocking reader waits on its connection's doorbell where it can
            if let (false, Some(f)) = (nonblocking, c.fast_conn()) {
                if let Some(n) = c
                    .shared
                    .read_on_bell(c.id, f, deadline, || c.try_fast_read(buf))
                {
                    return Ok(n);
                }
            }
        }
        let _busy = c.shared.busy();
        let got = c
            .shared
            .run(Want::Read(c.id), deadline, nonblocking, |ep| {
                noted(c, ep, |ep| {
                    match if ep.readable(c.id).min(buf.len()) < LEASE_MIN {
                        // a small copy costs less under the lock than a lease does
                        Ok(ReadPlan::NoWindow)
                    } else {
                        ep.read_lease(c.id, buf.len())
                    } {
                        Ok(ReadPlan::Lease(l)) => Some(Ok(Got::Lease(l))),
                        Ok(ReadPlan::Empty) if buf.is_empty() || ep.peer_done(c.id) => {
                            Some(Ok(Got::Done(0)))
                        }
                        Ok(ReadPlan::Empty) => None,
                        Ok(ReadPlan::NoWindow) => match ep.read_into(c.id, buf) {
                            Ok(0) if buf.is_empty() || ep.peer_done(c.id) => Some(Ok(Got::Done(0))),
                            Ok(0) => None,
                            Ok(n) => Some(Ok(Got::Done(n))),
                            Err(e) => Some(Err(conn_error(e))),
                        },
                        Err(e) => Some(Err(conn_error(e))),
                    }
                })
            })?;
        let l = match got {
            Got::Done(n) => return Ok(n),
            Got::Lease(l) => l,
        };
        let copied = l.copy_to(buf);
        let n = if copied.is_ok() { l.len() } else { 0 };
        let committed = super::in_place::commit_read(c, n);
        // bytes copied are delivered (a failed commit shows at the next read)
        copied.map_err(conn_error)?;
        if n == 0 {
            committed.map_err(conn_error)?;
        }
        Ok(n)
    }

    /// Writes straight into the peer's RMB when it has room, with the copy
    /// made after the endpoint's lock is released (a [`WriteLease`]), else
    /// through the send buffer.
    pub(super) fn smc_write(
        &self,
        c: &SmcConn,
        buf: &[u8],
        nonblocking: bool,
    ) -> io::Result<usize> {
        enum Wrote {
            Done(usize),
            Lease(WriteLease),
        }
        if buf.is_empty() {
            // (tcp.c `tcp_sendmsg_locked`: a write of nothing still fails
            // once the sending side is shut down or the connection failed)
            return c
                .shared
                .lock()
                .write_refused(c.id)
                .map(|()| 0)
                .map_err(conn_error);
        }
        if let Some(n) = c.try_fast_write(buf) {
            return Ok(n);
        }
        let deadline = Self::timeout(&self.opts.write_timeout);
        let op = |ep: &mut Endpoint<AnyProvider>, buffer: bool| {
            let r = if buffer {
                ep.write(c.id, buf)
            } else {
                ep.write_unbuffered(c.id, buf)
            };
            c.note();
            match r {
                Ok(0) => None,
                Ok(n) => Some(Ok(n)),
                Err(e) => Some(Err(conn_error(e))),
            }
        };
        // A blocking write whose data could go straight into the peer's RMB
        // waits up to DIRECT_WAIT for room there before copying into the send
        // buffer (see `Endpoint::write_unbuffered`); that wait, sleeps
        // included, ends at DIRECT_WAIT. A non-blocking one looks once.
        // (the wait's end is read off the clock only if the first try fails)
        let first = || {
            let until = Instant::now() + DIRECT_WAIT;
            Some(deadline.map_or(until, |d| d.min(until)))
        };
        let _busy = c.shared.busy();
        let direct = c
            .shared
            .run_until(Want::Write(c.id), first, nonblocking, |ep| {
                let plan = if buf.len() < LEASE_MIN {
                    // a small copy costs less under the lock than a lease does
                    Ok(WritePlan::NotDirect)
                } else {
                    ep.write_lease(c.id, buf)
                };
                match plan {
                    Ok(WritePlan::Lease(l)) => Some(Ok(Wrote::Lease(l))),
                    Ok(WritePlan::NoRoom) => None,
                    Ok(WritePlan::NotDirect) => op(ep, false).map(|r| r.map(Wrote::Done)),
                    Err(e) => Some(Err(conn_error(e))),
                }
            });
        match direct {
            Ok(Wrote::Done(n)) => return Ok(n),
            Ok(Wrote::Lease(l)) => {
                let copied = l.copy_from(buf).is_ok();
                let mut ep = c.shared.lock();
                let r = ep.write_commit(c.id, &l, copied);
                c.shared.after_lease(&mut ep, c.id);
                c.note();
                drop(ep);
                match r {
                    Ok(true) => return Ok(l.len()),
                    // not announced: written again below
                    Ok(false) => {}
                    Err(e) => return Err(conn_error(e)),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
        c.shared
            .run(Want::Write(c.id), deadline, nonblocking, |ep| op(ep, true))
    }

    pub(super) fn do_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_with(buf, false)
    }

    /// Reads as `read`, without blocking if `dont_wait` (`MSG_DONTWAIT`)
    /// even in blocking mode.
    pub fn read_with(&self, buf: &mut [u8], dont_wait: bool) -> io::Result<usize> {
        let nonblocking = dont_wait || self.nonblocking();
        if let Some(c) = self.smc_conn()? {
            let r = self.smc_read(c, buf, nonblocking);
            if let Ok(n) = r {
                c.stats.rx(n);
            }
            return r;
        }
        self.take_answer_off(nonblocking)?;
        {
            let p = &mut self.pending.lock().unwrap_or_else(|e| e.into_inner()).bytes;
            if !p.is_empty() {
                let n = buf.len().min(p.len());
                buf[..n].copy_from_slice(&p[..n]);
                p.drain(..n);
                return Ok(n);
            }
        }
        if dont_wait {
            let (n, _) = rustix::net::recv(&*self.tcp, buf, rustix::net::RecvFlags::DONTWAIT)?;
            return Ok(n);
        }
        (&*self.tcp).read(buf)
    }

    /// A fallback whose server's answer is still due (see `ahead.rs`):
    /// reads the socket until the answer is off the stream, keeping what
    /// follows it for the application. `WouldBlock` while the answer is not
    /// whole if `nonblocking` (or when the read timeout passes), as a read
    /// that finds no data. Only the look at the socket holds the lock: a
    /// thread that waits here does not hold up the stream's other calls.
    pub(super) fn take_answer_off(&self, nonblocking: bool) -> io::Result<()> {
        use rustix::event::{poll, PollFd, PollFlags};
        use rustix::net::{recv, RecvFlags};
        // (set when the first wait begins: the read timeout's end, `None`
        // without one)
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            {
                let mut a = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                if !a.owes() {
                    return Ok(());
                }
                // (an answer is at most `MAX_CLC_LEN` bytes; more read here
                // is the peer's data, kept)
                let mut buf = [0u8; 1024];
                match recv(&*self.tcp, &mut buf, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => a.ended(),
                    Ok((n, _)) => a.came(&buf[..n]),
                    Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
                if !a.owes() {
                    return Ok(());
                }
            }
            if nonblocking {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let deadline = *deadline.get_or_insert_with(|| {
                let t = *self
                    .opts
                    .read_timeout
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                t.map(|t| Instant::now() + t)
            });
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Err(io::ErrorKind::WouldBlock.into()),
                },
                None => None,
            };
            let ts = left.map(|l| rustix::event::Timespec {
                tv_sec: l.as_secs() as i64,
                tv_nsec: i64::from(l.subsec_nanos()),
            });
            match poll(&mut [PollFd::new(&*self.tcp, PollFlags::IN)], ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Copies into `buf` what a read would return, without taking it, as
    /// `recv(MSG_PEEK)`: waits for bytes as a read does (unless non-blocking
    /// or `dont_wait`), `Ok(0)` at the end of the stream. On SMC-R the bytes
    /// stay in the receive buffer, where the connection's readiness shows
    /// them. `None`: not an SMC-R connection.
    pub fn peek_with(&self, buf: &mut [u8], dont_wait: bool) -> Option<io::Result<usize>> {
        self.peek_until(buf, 1, dont_wait)
    }

    /// [`SmcStream::peek_with`] as `recv(MSG_PEEK | MSG_WAITALL)`: waits
    /// until the whole of `buf` can be copied, as Linux's TCP does
    /// (tcp.c `tcp_recvmsg_locked`: its target is the whole length, and a
    /// peek waits for it as a read does), and returns less only at the end
    /// of the stream, at the read timeout, or without waiting (`dont_wait`,
    /// non-blocking): what is there then (`WouldBlock` if nothing is).
    pub fn peek_all_with(&self, buf: &mut [u8], dont_wait: bool) -> Option<io::Result<usize>> {
        match self.peek_until(buf, buf.len(), dont_wait) {
            Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock && buf.len() > 1 => {
                // what there is after all
                self.peek_until(buf, 1, true)
            }
            r => r,
        }
    }

    /// A peek that waits until `want` bytes (at least one) can be copied
    /// into `buf`, or the end of the stream; `None`: not SMC-R.
    fn peek_until(
        &self,
        buf: &mut [u8],
        want: usize,
        dont_wait: bool,
    ) -> Option<io::Result<usize>> {
        let c = match self.smc_conn() {
            Ok(Some(c)) => c,
            Ok(None) => return None,
            Err(e) => return Some(Err(e)),
        };
        if buf.is_empty() {
            return Some(Ok(0));
        }
        let want = want.clamp(1, buf.len());
        let nonblocking = dont_wait || self.nonblocking();
        let deadline = Self::timeout(&self.opts.read_timeout);
        let _busy = c.shared.busy();
        Some(c.shared.run(Want::Read(c.id), deadline, nonblocking, |ep| {
            noted(c, ep, |ep| match ep.read_peek(c.id, buf) {
                Ok(0) if ep.peer_done(c.id) => Some(Ok(0)),
                Ok(0) => None,
                // (the peek holds the bytes as a lease does: given
                // back, none taken)
                Ok(n) => match ep.read_commit(c.id, 0) {
                    // (fewer than wanted: wait for more, unless no more come)
                    Ok(()) if n < want && !ep.peer_done(c.id) => None,
                    r => Some(r.map(|()| n).map_err(conn_error)),
                },
                Err(e) => Some(Err(conn_error(e))),
            })
        }))
    }

    pub(super) fn do_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.write_with(buf, false)
    }

    /// Writes as `write`, without blocking if `dont_wait` (`MSG_DONTWAIT`)
    /// even in blocking mode. (Writing after the end of the connection is
    /// `BrokenPipe` without a signal, as `send(MSG_NOSIGNAL)`.) An empty
    /// `buf` writes nothing and says the error a write would meet, as a
    /// TCP socket's `send` of nothing does: `BrokenPipe` after our own
    /// shutdown of writing, the reset or abort of a failed connection;
    /// `Ok(0)` otherwise (a peer that closed too).
    pub fn write_with(&self, buf: &[u8], dont_wait: bool) -> io::Result<usize> {
        let nonblocking = dont_wait || self.nonblocking();
        match self.smc_conn()? {
            Some(c) => {
                let r = self.smc_write(c, buf, nonblocking);
                if let Ok(n) = r {
                    c.stats.tx(n);
                }
                r
            }
            None => {
                let mut f = rustix::net::SendFlags::NOSIGNAL;
                if dont_wait {
                    f |= rustix::net::SendFlags::DONTWAIT;
                }
                Ok(rustix::net::send(&*self.tcp, buf, f)?)
            }
        }
    }

    /// Sends one byte of urgent (out-of-band) data, as `send(MSG_OOB)`.
    pub fn send_oob(&self, byte: u8) -> io::Result<()> {
        match self.smc_conn()? {
            Some(c) => {
                let deadline = Self::timeout(&self.opts.write_timeout);
                c.shared
                    .run(Want::Write(c.id), deadline, self.nonblocking(), |ep| {
                        noted(c, ep, |ep| match ep.write_oob(c.id, byte) {
                            Ok(true) => Some(Ok(())),
                            Ok(false) => None,
                            Err(e) => Some(Err(conn_error(e))),
                        })
                    })
            }
            None => {
                rustix::net::send(&*self.tcp, &[byte], rustix::net::SendFlags::OOB)?;
                Ok(())
            }
        }
    }

    /// Receives the peer's urgent byte, if one arrived (`recv(MSG_OOB)`); on TCP
    /// this is the kernel's out-of-band byte.
    pub fn recv_oob(&self) -> io::Result<Option<u8>> {
        match self.smc_conn()? {
            Some(c) => {
                let mut ep = c.shared.lock();
                c.shared.pump(&mut ep);
                let r = ep.read_oob(c.id).map_err(conn_error);
                c.note();
                r
            }
            None => {
                let mut b = [0u8; 1];
                match rustix::net::recv(&*self.tcp, &mut b, rustix::net::RecvFlags::OOB) {
                    Ok((1, _)) => Ok(Some(b[0])),
                    Ok(_) => Ok(None),
                    Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::AGAIN) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// `SO_OOBINLINE`: the peer's urgent byte stays in the stream (`true`:
    /// reads stop before it and the next read returns it in its place,
    /// [`SmcStream::recv_oob`] finds nothing) or is taken out of it
    /// (`false`, the default), as for a TCP socket; set on the TCP socket
    /// too, so that a fallback connection behaves the same.
    pub fn set_oob_inline(&self, on: bool) -> io::Result<()> {
        rustix::net::sockopt::set_socket_oobinline(&*self.tcp, on)?;
        self.note_oob_inline(on)
    }

    /// `SO_OOBINLINE` of the TCP socket.
    pub fn oob_inline(&self) -> io::Result<bool> {
        Ok(rustix::net::sockopt::socket_oobinline(&*self.tcp)?)
    }

    /// Takes `SO_OOBINLINE` from the TCP socket, where it was set directly
    /// (an interposed `setsockopt`) or before the connection was made (a
    /// listener's accepted sockets inherit it, as in Linux's
    /// `sk_clone_lock`): see [`Self::set_oob_inline`].
    pub fn take_socket_oob_inline(&self) -> io::Result<()> {
        let on = self.oob_inline()?;
        self.note_oob_inline(on)
    }

    fn note_oob_inline(&self, on: bool) -> io::Result<()> {
        match self.smc_conn()? {
            Some(c) => {
                let r = c.shared.lock().set_oob_inline(c.id, on);
                c.note();
                r.map_err(conn_error)
            }
            None => Ok(()),
        }
    }

    /// Whether the next read stands at the peer's urgent byte's mark (TCP's
    /// `SIOCATMARK`; Linux AF_SMC answers it too, af_smc.c `smc_ioctl`).
    /// `None` for a connection that is not SMC-R: its TCP socket answers.
    pub fn at_urgent_mark(&self) -> io::Result<Option<bool>> {
        let Some(c) = self.smc_conn()? else {
            return Ok(None);
        };
        let mut ep = c.shared.lock();
        c.shared.pump(&mut ep);
        ep.at_urgent_mark(c.id).map(Some).map_err(conn_error)
    }
}
