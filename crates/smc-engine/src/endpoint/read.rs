//! The application's reads: received bytes copied out of the RMB, end of
//! file and errors, the peer's urgent byte (`recv(MSG_OOB)`).
//!
//! Spec: `protocol-llc-cdc.md` §3.4 (receive side and consumer-cursor
//! updates), §3.5 (urgent data). Linux: smc_rx.c (`smc_rx_recvmsg`,
//! `smc_rx_recv_urg`).

use super::conn::ConnError;
use super::conn_core::{lock, FastRx};
use super::{ConnId, Endpoint};
use smc_rdma::Provider;

impl<P: Provider> Endpoint<P> {
    /// Fetches the peer's urgent byte (TCP `recv(MSG_OOB)`), once, and only
    /// while the reader has not read past its mark (then it is gone, as
    /// TCP's: `None`).
    /// In line ([`Self::set_oob_inline`]) it is the stream's: `None`, and
    /// it stays to be read in its place.
    pub fn read_oob(&mut self, id: ConnId) -> std::result::Result<Option<u8>, ConnError> {
        let mut k = self.core(id).ok_or(ConnError::NotConnected)?;
        let dp = k.smc()?;
        if dp.oob_inline() {
            return Ok(None);
        }
        let valid = dp.urgent_valid();
        Ok(k.oob.take().filter(|_| valid))
    }

    /// Keeps the peer's urgent byte in the stream of connection `id` or
    /// takes it out of it (TCP's `SO_OOBINLINE`, `DataPath::set_oob_inline`).
    /// What a read may return changes with it: the connection's readiness
    /// shows it.
    pub fn set_oob_inline(&mut self, id: ConnId, on: bool) -> std::result::Result<(), ConnError> {
        let mut k = self.core(id).ok_or(ConnError::NotConnected)?;
        let dp = k.smc()?;
        if dp.oob_inline() == on {
            return Ok(());
        }
        dp.set_oob_inline(on);
        k.watched();
        drop(k);
        self.conn_event(id);
        Ok(())
    }

    /// Whether the reader of connection `id` stands at the peer's urgent
    /// byte's mark (TCP's `SIOCATMARK`, `DataPath::at_urgent_mark`).
    pub fn at_urgent_mark(&self, id: ConnId) -> std::result::Result<bool, ConnError> {
        let mut k = self.core(id).ok_or(ConnError::NotConnected)?;
        Ok(k.smc()?.at_urgent_mark())
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
        self.grant_rx(id);
        if due {
            // (a consumer cursor update may be due)
            self.mark_tx(id);
        }
        Ok(n)
    }

    /// After a read of connection `id` through the endpoint: its next reads
    /// may poll its link's receive CQ themselves (`FastRx`), unless they may
    /// already.
    pub(super) fn grant_rx(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        let Some(l) = c.lgr else { return };
        let mut k = lock(&c.core);
        let Some(slot) = k.link else { return };
        if k.fast_rx
            .as_ref()
            .is_some_and(|f| f.epoch == k.epoch && f.slot == slot)
        {
            return;
        }
        let Some(res) = self
            .lgrs
            .get(l)
            .and_then(|lg| lg.links.get(slot))
            .and_then(Option::as_ref)
        else {
            return;
        };
        let epoch = k.epoch;
        k.fast_rx = Some(FastRx {
            rx: res.rx.clone(),
            tokens: self.by_token.clone(),
            lgr: l,
            slot,
            epoch,
        });
    }

    /// Bytes received and not yet read.
    pub fn readable(&self, id: ConnId) -> usize {
        self.core(id).map_or(0, |k| k.readable())
    }

    /// Nothing more comes to read (EOF once the receive buffer is drained):
    /// the peer sends nothing more, or the application shut down its read
    /// side ([`Self::shutdown_read`]).
    pub fn peer_done(&self, id: ConnId) -> bool {
        self.core(id).is_some_and(|k| k.read_done())
    }

    /// `shutdown(SHUT_RD)`: from now on a read that finds nothing finds
    /// end of file instead of waiting (see `ConnCore::read_shut`). Nothing
    /// is sent: the peer may go on writing, and what it writes is read.
    pub fn shutdown_read(&mut self, id: ConnId) {
        self.conn_event(id);
        if let Some(mut k) = self.core(id) {
            if !k.read_shut {
                k.read_shut = true;
                k.watched();
            }
        }
    }
}
