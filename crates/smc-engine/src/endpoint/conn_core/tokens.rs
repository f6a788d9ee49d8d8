//! The endpoint's table of connections by alert token, through which a
//! received CDC finds its connection's core.

use super::CoreRef;
use crate::endpoint::ConnId;
use smc_rdma::Provider;
use std::sync::PoisonError;

/// An entry of the endpoint's table of connections by alert token (see
/// `Endpoint::by_token`): written when a connection joins a link group and
/// removed when it leaves, so that a received CDC finds its connection's
/// core with one lookup.
pub(in crate::endpoint) struct TokenEntry<P: Provider> {
    pub(in crate::endpoint) id: ConnId,
    /// The group the connection is in: a CDC counts only on that group's links.
    pub(in crate::endpoint) lgr: crate::endpoint::LgrId,
    pub(in crate::endpoint) core: CoreRef<P>,
}

/// Hashes alert tokens: ours, handed out in sequence (`next_alert_token`),
/// so a multiplication spreads them; a peer's CDC only looks one up.
#[derive(Clone, Copy, Default)]
pub(in crate::endpoint) struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The endpoint's connections by alert token.
pub(in crate::endpoint) type TokenMap<P> =
    std::collections::HashMap<u32, TokenEntry<P>, std::hash::BuildHasherDefault<TokenHasher>>;

/// The token table as the endpoint and its links' receive dispatch share it
/// (docs/FAST-PATH.md, step 4): written by the endpoint only, when a
/// connection joins or leaves a link group (`Endpoint::attach`,
/// `Endpoint::detach`), read by whoever applies a received CDC, with or
/// without the device lock.
pub(in crate::endpoint) struct TokenTable<P: Provider>(std::sync::RwLock<TokenMap<P>>);

impl<P: Provider> Default for TokenTable<P> {
    fn default() -> Self {
        TokenTable(std::sync::RwLock::new(TokenMap::default()))
    }
}

impl<P: Provider> TokenTable<P> {
    /// The table for lookups. A panic while it was written cannot have left
    /// a half-inserted entry (a `HashMap` insert or remove either happened
    /// or did not): it is used as it is.
    #[inline]
    pub(in crate::endpoint) fn read(&self) -> std::sync::RwLockReadGuard<'_, TokenMap<P>> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table for the endpoint's changes.
    pub(in crate::endpoint) fn write(&self) -> std::sync::RwLockWriteGuard<'_, TokenMap<P>> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}
