//! Buffer pools: the RMBs and send buffers a link group keeps registered
//! after their connections are gone, so that a late RDMA WRITE from the peer
//! lands in memory we still own and the next connection skips registration;
//! released RMBs are zeroed before reuse.
//!
//! Spec: `protocol-llc-cdc.md` §4.4 (RMB / send buffer sizes and pools).
//! Linux: smc_core.c (`smc_buf_create`, `smc_buf_get_slot`,
//! `smcr_buf_unuse`).

use super::lgr::Lgr;
use super::rkey::RkeyFlow;
use super::{ConnId, Endpoint, LgrId, Result};
use crate::state::BufCounts;
use smc_rdma::{Access, MemoryRegion, ProtectionDomain, Provider};

/// Writes zeros over the first `len` bytes of `mr`.
fn zero<M: MemoryRegion>(mr: &M, len: usize) {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(ZEROS.len());
        if mr.write_at(off, &ZEROS[..n]).is_err() {
            return;
        }
        off += n;
    }
}

/// Released RMBs a link group keeps known at the peer (see `known_rkeys`);
/// further ones are deleted at the peer with DELETE_RKEY, as Linux deletes
/// every released RMB, and announced again when reused.
const KNOWN_RKEYS_MAX: usize = 16;

/// The smallest RMB (the smallest RMBE size class).
const RMB_MIN: usize = 16 * 1024;

impl<P: Provider> Lgr<P> {
    /// An RMB of `rmb_len` and a send buffer of `sndbuf_len` bytes for a
    /// connection joining the group: from its pool, or registered in its
    /// protection domain — an RMB of a smaller size class if the wanted one
    /// cannot be registered (Linux smc_core.c `__smc_buf_create` goes down
    /// the size classes the same way; the CLC message announces the size
    /// taken). Counted in `n` (`smcr stats`).
    pub(super) fn take_bufs(
        &mut self,
        rmb_len: usize,
        sndbuf_len: usize,
        n: &mut BufCounts,
    ) -> Result<(P::Mr, P::Mr)> {
        let pooled = self
            .free_bufs
            .iter()
            .position(|(r, s)| r.len() == rmb_len && s.len() == sndbuf_len);
        if let Some(i) = pooled {
            // (zeroed on release, see `pool_bufs`)
            n.reuse += 2;
            return Ok(self.free_bufs.swap_remove(i));
        }
        let mut len = rmb_len;
        let rmb = loop {
            match self
                .pd
                .alloc_mr(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            {
                Ok(mr) => break mr,
                // (16 KiB: the smallest RMBE size class, RFC 7609 §4.4)
                Err(_) if len > RMB_MIN => len /= 2,
                Err(e) => return Err(e),
            }
        };
        let sndbuf = self.pd.alloc_mr(sndbuf_len, Access::LOCAL_WRITE)?;
        n.alloc += 2;
        if len < rmb_len {
            n.rmb_downgrade += 1;
        }
        Ok((rmb, sndbuf))
    }
}

impl<P: Provider> Endpoint<P> {
    /// Connection `id`, finished and detached from group `l`, gives its
    /// buffers back to the group's pool (unless the group is terminated).
    pub(super) fn pool_bufs(&mut self, id: ConnId, l: LgrId) {
        // bytes the peer put into the RMB (all of it once it wrapped)
        let used = self
            .core(id)
            .and_then(|k| k.dp.as_ref().map(|dp| dp.totals().0))
            .map_or(usize::MAX, |t| usize::try_from(t).unwrap_or(usize::MAX));
        let bufs = self
            .core(id)
            .and_then(|mut k| Some((k.rmb.take()?, k.sndbuf.take()?)));
        if let Some((rmb, _)) = &bufs {
            // A reused RMB starts clean, as Linux zeroes released buffers:
            // only the part that was written, so that a short connection
            // does not pay for a large buffer.
            zero(rmb, used.min(rmb.len()));
        }
        if let (Some((rmb, sndbuf)), Some(lg)) = (bufs, self.lgrs.get_mut(l)) {
            if !lg.group.is_terminated() {
                if lg.links.iter().flatten().count() == 1 && lg.known_rkeys.len() < KNOWN_RKEYS_MAX
                {
                    // kept known at the peer (see `known_rkeys`)
                    lg.known_rkeys.insert(rmb.rkey());
                } else {
                    // The peer forgets this RMB (§1.11), then it is reused.
                    lg.known_rkeys.remove(&rmb.rkey());
                    lg.rkey_queue.push_back(RkeyFlow::Delete(rmb.rkey()));
                }
                lg.free_bufs.push((rmb, sndbuf));
            }
        }
    }
}
