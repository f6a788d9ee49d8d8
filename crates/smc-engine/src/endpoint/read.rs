//! The application's reads: received bytes copied out of the RMB, end of
//! file and errors, the peer's urgent byte (`recv(MSG_OOB)`).
//!
//! Spec: `protocol-llc-cdc.md` §3.4 (receive side and consumer-cursor
//! updates), §3.5 (urgent data). Linux: smc_rx.c (`smc_rx_recvmsg`,
//! `smc_rx_recv_urg`).

use super::conn::ConnError;
use super::{ConnId, Endpoint};
use smc_rdma::Provider;

impl<P: Provider> Endpoint<P> {
    /// Fetches the peer's urgent byte (TCP `recv(MSG_OOB)`), once.
    pub fn read_oob(&mut self, id: ConnId) -> std::result::Result<Option<u8>, ConnError> {
        let mut k = self.core(id).ok_or(ConnError::NotConnected)?;
        k.smc()?;
        Ok(k.oob.take())
    }

    /// Reads up to `max` bytes. `Ok(empty)` with [`Self::peer_done`] true is
    /// end-of-file; `Ok(empty)` otherwise means "would block".
    pub fn read(&mut self, id: ConnId, max: usize) -> std::result::Result<Vec<u8>, ConnError> {
        let mut out = vec![0u8; max.min(self.readable(id))];
        let n = self.read_into(id, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads into `buf` straight from the receive buffer (one copy). `Ok(0)`
    /// with [`Self::peer_done`] true is end-of-file; `Ok(0)` otherwise means
    /// "would block" (or `buf` is empty).
    pub fn read_into(
        &mut self,
        id: ConnId,
        buf: &mut [u8],
    ) -> std::result::Result<usize, ConnError> {
        let (n, due) = self
            .core(id)
            .ok_or(ConnError::NotConnected)?
            .read_into(buf)?;
        if due {
            // (a consumer cursor update may be due)
            self.mark_tx(id);
        }
        Ok(n)
    }

    /// Bytes received and not yet read.
    pub fn readable(&self, id: ConnId) -> usize {
        self.core(id).map_or(0, |k| k.readable())
    }

    /// The peer will send nothing more (EOF once the receive buffer is drained).
    pub fn peer_done(&self, id: ConnId) -> bool {
        self.core(id).is_some_and(|k| k.closer.peer_done())
    }
}
