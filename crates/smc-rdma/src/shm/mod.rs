//! `shm`: a shared-memory RDMA device for processes on one host (also in
//! different network namespaces of that host).
//!
//! * Devices are declared in a [`ShmConfig`] and bound to a network
//!   interface. The GID table derives from it as RoCE does: a RoCE v1 GID
//!   (and its v2 twin) from the MAC's link-local address, and RoCE v2 GIDs
//!   from the interface's IP addresses. The port state follows the
//!   interface's operational state (polled by a per-device event thread).
//! * A device may be opened any number of times, by one process or many, as
//!   processes share the port of a real RNIC: every opening (an *instance*)
//!   sees the same GID table and has its own QPs, regions and PDs. QPs are
//!   addressed by (GID, QPN), as in SMC's CLC messages; QP numbers are unique
//!   per rundir (so host-wide for every GID), allocated from a lock-protected
//!   registry in the rundir and never reused while their QP lives.
//! * Every instance listens on its own unix `SOCK_SEQPACKET` socket in the
//!   rundir and registers its GIDs and QPs there (see [`registry`]). At RTR
//!   a QP dials the instance owning the peer's (GID, QPN) and hands it its
//!   receive ring (a sealed memfd) and its channels' eventfds, with a proof
//!   of the peer's PSN; the peer uses them only once it checked the proof
//!   (at its RTS), and hands out a region only on that connection, after a
//!   second proof over both PSNs, only for its own QP's protection domain
//!   and only if registered for remote access ([`wire`] has the protocol,
//!   the crate README the threat model).
//! * Registered memory is memfd-backed (`pd.alloc_mr`), so an RDMA WRITE is
//!   one memcpy straight into the peer's mapping. The remote-access regions
//!   of a PD are ranges of a few memfds of that PD (`arena.rs`), handed out
//!   as (memfd, offset, length); the peer maps only the range. The writer
//!   checks bounds and access against what the owner told it (and the
//!   region's validity word, so deregistration stops a correct writer at
//!   once); these checks catch bugs, the owner's protection is that it
//!   hands a region only to the QP it is meant for. A violation completes
//!   the WR with `RemoteAccessError` and moves the writer's QP to ERR;
//!   nothing outside the region is ever touched.
//! * SENDs (and WRITE WITH IMMEDIATE) are slots of the peer's receive ring,
//!   published with a release store *after* any earlier WRITE's copy, so the
//!   receiver sees written data before a later SEND (RC ordering). The
//!   receiver moves published slots into its posted receive buffers when its
//!   CQ is polled; the slot's state word is the ACK. With no receive posted
//!   the slot waits (RNR) until `rnr_retry` is exhausted (7 = forever). The
//!   receiver keeps its own consumer index (and the sender its producer
//!   index) in process memory: ring words the peer can write are signals,
//!   never bookkeeping.
//! * Descriptors: a mapping keeps no descriptor. The remote-access regions
//!   of a PD share a few memfds (kept to hand them out); a local-only
//!   region, a peer's region or ring, keep none. A connected QP holds the
//!   socket it dialed, the socket its peer dialed and the peer's channel
//!   eventfd(s).
//! * There is no data-path thread: posting copies in the caller's thread, and
//!   polling a CQ makes progress. The device thread only handles rendezvous,
//!   region requests, port state, heartbeats and peer death (socket hang-up
//!   or a heartbeat that stops for `peer_timeout`, or for eight times that
//!   while the peer's device thread only waits for a CPU, and never while
//!   the peer's process is stopped: `SIGSTOP`, a debugger), moving QPs to ERR with a
//!   `QpFatal` event. It never blocks on a peer (non-blocking sockets) nor
//!   for long on a QP lock, and keeps one descriptor in reserve so that a
//!   process out of descriptors refuses new connections instead of spinning.
//!
//! This module has no `unsafe`: mapping and raw copies live in [`crate::sys`].
//!
//! # Where things are
//!
//! | file | what it holds |
//! |------|---------------|
//! | `mod.rs` | this overview, limits and helpers every part uses |
//! | `config.rs` | [`ShmConfig`]: declared devices, rundir, periods |
//! | `netdev.rs` | the bound interface: state, MAC, GID table |
//! | `device.rs` | [`ShmProvider`], [`ShmDevice`] (an instance) |
//! | `device_thread.rs` | the instance's thread: accepts, routes, ticks |
//! | `mr.rs` | [`ShmPd`], [`ShmMr`], peer regions, receive rings |
//! | `cq.rs` | [`ShmCq`], [`ShmChannel`] |
//! | `qp.rs` | [`ShmQp`] and the QP's state |
//! | `qp_rendezvous.rs` | finding and authenticating the peer QP |
//! | `qp_region.rs` | regions handed to and fetched from the peer |
//! | `qp_fail.rs` | errors: ERR, flushes, releasing the link |
//! | `qp_progress.rs` | the data path: sends, WRITEs, receives |
//! | `arena.rs` | the memfds a PD's remote-access regions share |
//! | `layout.rs` | shared-memory layouts: region header, ring |
//! | `registry.rs` | the rundir's (GID, QPN) registry |
//! | `wire.rs` | the rendezvous protocol |
#![forbid(unsafe_code)]

mod arena;
mod config;
mod cq;
mod device;
mod device_thread;
pub mod layout;
mod mr;
mod netdev;
mod qp;
mod qp_fail;
mod qp_progress;
mod qp_region;
mod qp_rendezvous;
pub mod registry;
pub mod wire;

pub use config::{default_rundir, ShmConfig, ShmDeviceConfig};
pub use cq::{ShmChannel, ShmCq};
pub use device::{ShmDevice, ShmProvider};
pub use mr::{ShmMr, ShmPd};
pub use netdev::gid_table;
pub use qp::ShmQp;
pub use qp_progress::defer_wakes;

pub use registry::{QPN_MAX, QPN_MIN};

use crate::verbs::*;
use layout::*;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use layout::SLOT_PAYLOAD as MAX_SEND_SIZE;

/// Inline payloads are copied at post time: an inline RDMA WRITE posted on an
/// idle send queue goes straight from the caller's buffer into the peer's
/// region (one copy, like a CPU store), so any size up to the largest region
/// is allowed. Behind queued WRs it is kept in a heap copy until its turn.
const MAX_INLINE: u32 = 1 << 30;

/// Largest region (`alloc_mr`), and the largest a peer may announce.
const MAX_REGION: usize = (1 << 32) - HDR;

/// How long a dialer waits for the acceptor to take its hello, and a
/// region request for its answer.
const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// Accepted connections that have not sent their hello yet (a stranger can
/// open many; more are closed at once).
const MAX_PENDING: usize = 64;

/// How long an accepted connection may take to send its hello.
const PENDING_WAIT: Duration = Duration::from_secs(2);

/// Unverified hellos held per QP (before its RTS).
const MAX_CANDIDATES: usize = 4;

/// Hellos with a wrong proof a QP refuses before it refuses all hellos (each
/// is a 2^-24 guess of a PSN; the bound keeps the odds of a stranger's
/// guess at 2^-20).
const MAX_BAD_HELLOS: u32 = 16;

/// Region requests that may wait for the peer's authentication.
const MAX_DEFERRED: usize = 64;

/// The peer's RNR timer is clamped to this (IB's largest is 491.52 ms).
const MAX_RNR_TIMER: Duration = Duration::from_secs(1);

/// A map keyed by keys, QP numbers and GIDs, looked up for every WR: hashed
/// with a multiply-rotate (FxHash's) instead of SipHash, which cost more than
/// the rest of a 64-byte RDMA WRITE's checks. Keys are random, and only this
/// device inserts entries (its own keys and QPs, and regions the peer
/// handed us), so the hash needs no protection against chosen collisions.
type KeyMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// See [`KeyMap`].
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Locks `m` unless it stays held for longer than `limit`.
fn lock_within<T>(m: &Mutex<T>, limit: Duration) -> Option<MutexGuard<'_, T>> {
    let start = Instant::now();
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if start.elapsed() >= limit {
                    return None;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

fn random_u64() -> Result<u64> {
    Ok(wire::random_u64()?)
}

/// A random 32-bit key not yet in `map` (and never 0).
fn fresh_key<V>(map: &KeyMap<u32, V>) -> Result<u32> {
    loop {
        let k = random_u64()? as u32;
        if k != 0 && !map.contains_key(&k) {
            return Ok(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_roundtrip_and_errors() {
        let c = ShmConfig::parse(
            "# x\nrundir /tmp/r\npeer_timeout_ms 500\npoll_interval_ms 10\ndevice shm0 netdev lo\n",
        )
        .unwrap();
        assert_eq!(
            c.devices,
            vec![ShmDeviceConfig {
                name: "shm0".into(),
                netdev: "lo".into()
            }]
        );
        assert_eq!(c.peer_timeout, Duration::from_millis(500));
        assert_eq!(ShmConfig::parse(&c.to_text()).unwrap(), c);
        assert!(ShmConfig::parse("device a netdev x\ndevice a netdev y").is_err());
        assert!(ShmConfig::parse("bogus").is_err());
        assert!(ShmConfig::parse("poll_interval_ms 0").is_err());
    }

    #[test]
    fn loopback_gids_and_unknown_netdev() {
        let g = gid_table("lo");
        assert!(g
            .iter()
            .any(|e| e.gid == Gid::from_ip("127.0.0.1".parse().unwrap())
                && e.gid_type == GidType::RoceV2));
        let dir = std::env::temp_dir().join(format!("smc-unit-{}", std::process::id()));
        let cfg = ShmConfig {
            devices: vec![ShmDeviceConfig {
                name: "x".into(),
                netdev: "nonexistent0".into(),
            }],
            rundir: dir,
            ..Default::default()
        };
        assert!(matches!(
            ShmProvider::new(cfg).open_device("x"),
            Err(Error::Config(_))
        ));
    }
}
