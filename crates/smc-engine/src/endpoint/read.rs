//! The application's reads: received bytes copied out of the RMB, end of
//! file and errors, the peer's urgent byte (`recv(MSG_OOB)`).
//!
//! Spec: `protocol-llc-cdc.md` §3.4 (receive side and consumer-cursor
//! updates), §3.5 (urgent data). Linux: smc_rx.c (`smc_rx_recvmsg`,
//! `smc_rx_recv_urg`).

use super::conn::ConnError;
use super::{ConnId, Endpoint};
use smc_proto::datapath::DataPath;
use smc_rdma::{MemoryRegion, Provider};
use smc_wire::cdc::RingChunks;

impl<P: Provider> Endpoint<P> {
    /// Fetches the peer's urgent byte (TCP `recv(MSG_OOB)`), once.
    pub fn read_oob(&mut self, id: ConnId) -> std::result::Result<Option<u8>, ConnError> {
        Ok(self.smc_conn(id)?.oob.take())
    }

    /// Reads up to `max` bytes. `Ok(empty)` with [`Self::peer_done`] true is
    /// end-of-file; `Ok(empty)` otherwise means "would block".
    pub fn read(&mut self, id: ConnId, max: usize) -> std::result::Result<Vec<u8>, ConnError> {
        let mut out = vec![0u8; max.min(self.readable(id))];
        let n = self.read_into(id, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Where the bytes a read of up to `max` bytes of connection `id` takes
    /// now are in the RMB, and how many. `None`: nothing to take — end of
    /// file, would block (an urgent byte that is next is passed: normal
    /// reads skip it), or another reader's lease has them.
    pub(super) fn readable_now(
        &mut self,
        id: ConnId,
        max: usize,
    ) -> std::result::Result<Option<(RingChunks, usize)>, ConnError> {
        let c = self.smc_conn(id)?;
        if c.closer.error().is_some() && c.dp.as_ref().is_none_or(|dp| dp.readable() == 0) {
            // A peer that closed in order and then went away (its process
            // exited, taking the link) sent everything: end of file, not an
            // error, as the kernel's socket would have finished that close.
            let rx = c.closer.rx_flags();
            if (rx.done_writing || rx.closed) && !rx.abort {
                return Ok(None);
            }
            return Err(Self::close_error(c));
        }
        let Some(dp) = c.dp.as_mut().filter(|_| c.rmb.is_some()) else {
            return Err(ConnError::NotConnected);
        };
        if c.read_leased {
            // a lease has the readable bytes (they still count as readable,
            // so this is no end of file): wait for its commit
            c.lease_waited = true;
            return Ok(None);
        }
        let chunks = dp.readable_chunks(max);
        let n: usize = chunks.as_slice().iter().map(|&(_, l)| l).sum();
        if n == 0 {
            dp.consumed(0);
            return Ok(None);
        }
        Ok(Some((chunks, n)))
    }

    /// Reads into `buf` straight from the receive buffer (one copy). `Ok(0)`
    /// with [`Self::peer_done`] true is end-of-file; `Ok(0)` otherwise means
    /// "would block" (or `buf` is empty).
    pub fn read_into(
        &mut self,
        id: ConnId,
        buf: &mut [u8],
    ) -> std::result::Result<usize, ConnError> {
        let Some((chunks, n)) = self.readable_now(id, buf.len())? else {
            return Ok(0);
        };
        let rmb = self
            .smc_conn(id)?
            .rmb
            .as_ref()
            .ok_or(ConnError::NotConnected)?;
        let mut at = 0;
        for &(off, len) in chunks.as_slice() {
            if rmb.read_at(off, &mut buf[at..at + len]).is_err() {
                return Err(ConnError::Aborted);
            }
            at += len;
        }
        debug_assert_eq!(at, n);
        self.read_commit(id, n)?;
        Ok(n)
    }

    /// Bytes received and not yet read.
    pub fn readable(&self, id: ConnId) -> usize {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|c| c.dp.as_ref())
            .map_or(0, DataPath::readable)
    }

    /// The peer will send nothing more (EOF once the receive buffer is drained).
    pub fn peer_done(&self, id: ConnId) -> bool {
        self.conns
            .get(id)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.closer.peer_done())
    }
}
