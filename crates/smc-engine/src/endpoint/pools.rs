//! Buffer pools: the RMBs and send buffers a link group keeps registered
//! after their connections are gone, so that a late RDMA WRITE from the peer
//! lands in memory we still own and the next connection skips registration;
//! released RMBs are zeroed before reuse.
//!
//! Spec: `protocol-llc-cdc.md` §4.4 (RMB / send buffer sizes and pools).
//! Linux: smc_core.c (`smc_buf_create`, `smc_buf_get_slot`,
//! `smcr_buf_unuse`).

use smc_rdma::MemoryRegion;

/// Writes zeros over the first `len` bytes of `mr`.
pub(super) fn zero<M: MemoryRegion>(mr: &M, len: usize) {
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
pub(super) const KNOWN_RKEYS_MAX: usize = 16;
