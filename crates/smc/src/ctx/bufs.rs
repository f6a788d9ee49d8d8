//! The buffer sizes a connection is given: those asked for (by the
//! connection, its listener or the process), else the defaults.

use super::now;
use crate::provider::AnyProvider;
use smc_engine::endpoint::{ConnId, Endpoint, RmbCrowding};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Buffer sizes asked for (RMB, send buffer; `None`: not asked, the
/// process's or the endpoint's then, see [`crate::set_buffer_sizes`]).
pub(crate) type Bufs = (Option<usize>, Option<usize>);

/// [`Bufs`] readable without a lock (0: not asked): the process's, and a
/// listener's (a forked child reads its parent's copy).
#[derive(Default)]
pub(crate) struct Asked(AtomicUsize, AtomicUsize);

impl Asked {
    pub(crate) const fn new() -> Asked {
        Asked(AtomicUsize::new(0), AtomicUsize::new(0))
    }

    pub(crate) fn get(&self) -> Bufs {
        let some = |n: usize| (n > 0).then_some(n);
        (
            some(self.0.load(Ordering::Relaxed)),
            some(self.1.load(Ordering::Relaxed)),
        )
    }

    pub(crate) fn set(&self, (rmb, snd): Bufs) {
        self.0.store(rmb.unwrap_or(0), Ordering::Relaxed);
        self.1.store(snd.unwrap_or(0), Ordering::Relaxed);
    }
}

/// What [`crate::set_buffer_sizes`] asked for.
pub(crate) static ASKED: Asked = Asked::new();

/// A client connection's start in `ep` ([`Endpoint::connect`]) with the
/// buffer sizes asked for it (`ask`), else those this process asked for.
pub(crate) fn connect_in(ep: &mut Endpoint<AnyProvider>, local: IpAddr, ask: Bufs) -> ConnId {
    let id = ep.connect(local, now());
    sized(ep, id, ask);
    id
}

/// A server connection's start in `ep` ([`Endpoint::accept`]), likewise.
pub(crate) fn accept_in(ep: &mut Endpoint<AnyProvider>, local: IpAddr, ask: Bufs) -> ConnId {
    let id = ep.accept(local, now());
    sized(ep, id, ask);
    id
}

/// Gives connection `id` the sizes `ask` names, the process's for the rest.
fn sized(ep: &mut Endpoint<AnyProvider>, id: ConnId, ask: Bufs) {
    let (rmb, snd) = ASKED.get();
    let (rmb, snd) = (ask.0.or(rmb), ask.1.or(snd));
    if rmb.is_some() || snd.is_some() {
        ep.set_buffer_sizes(id, rmb, snd);
    }
}

/// Default size of a connection's RMB (4 MiB) while the endpoint's
/// connections hold no more than [`RMB_BUDGET`] of RMBs. A one-way stream
/// with a smaller one waits for consumer-cursor CDCs more often (at 64 KiB,
/// one round trip for every 32 KiB), and with an RMB no larger than a core's
/// L2 cache its copies cost more per byte (most likely because the lines the
/// writer stores into were just read into the reader's cache).
/// `smc-bench --only bulk` with `SMC_RMB_KIB` compares sizes. An idle
/// connection's buffers are memory mappings that take pages only where data
/// went through, and they are reused for the next connection of the link
/// group. `SMC_RMB_KIB` / `SMC_SNDBUF_KIB` set other sizes for every
/// connection (the analogue of Linux's `net.smc.rmem` / `wmem`).
const DEFAULT_RMB: usize = 4 << 20;

/// RMB bytes an endpoint's connections may hold before a new one gets a
/// [`CROWDED_RMB`]: two default RMBs, so that a program's second connection
/// (iperf3's data connection after its control connection, a stream each
/// way) still streams at full speed.
const RMB_BUDGET: usize = 2 * DEFAULT_RMB;

/// The RMB of a connection that joins others holding [`RMB_BUDGET`] or more:
/// Linux's default RMB (`net.smc.rmem`, smc_sysctl.c `net_smc_rmem_init`).
/// Request/response over many connections then copies through rings that
/// stay in a core's L2 together (ten connections' rings on each side of a
/// one-core pair: 1.25 MiB), where larger rings send every message's copies
/// to L3 or memory; `smc-bench --only rr` with `SMC_RMB_CROWDED_KIB`
/// compares sizes (`docs/FAST-PATH.md`, "Many connections: RMBs the
/// caches hold together").
const CROWDED_RMB: usize = 64 << 10;

/// Default size of each connection's send buffer (1 MiB): it holds only
/// what cannot go straight into the peer's RMB yet (`Endpoint::write`).
const DEFAULT_SNDBUF: usize = 1 << 20;

/// The RMB size of this process's connections.
pub(super) fn rmb_len() -> usize {
    buf_len("SMC_RMB_KIB", DEFAULT_RMB)
}

/// Above how many bytes of RMBs held a new connection gets the smaller RMB,
/// and that RMB (`smc_engine::endpoint::RmbCrowding`); none when
/// `SMC_RMB_KIB` fixes every connection's size.
pub(super) fn rmb_crowding() -> Option<RmbCrowding> {
    if std::env::var_os("SMC_RMB_KIB").is_some() {
        return None;
    }
    Some(RmbCrowding {
        budget: buf_len("SMC_RMB_BUDGET_KIB", RMB_BUDGET),
        len: buf_len("SMC_RMB_CROWDED_KIB", CROWDED_RMB),
    })
}

/// The send buffer size of this process's connections.
pub(super) fn sndbuf_len() -> usize {
    buf_len("SMC_SNDBUF_KIB", DEFAULT_SNDBUF)
}

/// Buffer size from `var` (KiB), else `default`.
fn buf_len(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .map_or(default, |k| k << 10)
}
