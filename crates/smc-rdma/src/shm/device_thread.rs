//! The device thread of an instance: accepts the connections peers dial to
//! our QPs and routes their hellos, auth and region requests to the QP
//! (`qp_rendezvous.rs`, `qp_region.rs`); learns of the port state from the
//! kernel's link notifications (`sys::LinkWatch`) when they come, as an RDMA
//! device raises IB_EVENT_PORT_ERR when its netdev goes down (Linux
//! drivers/infiniband/core/roce_gid_mgmt.c, `smc_ib_global_event_handler`
//! in net/smc/smc_ib.c acts on it at once). A peer process that dies hangs
//! up its sockets, which the poll sees at once too. What is left for a
//! periodic tick: heartbeats (a peer that hangs without dying), rendezvous
//! timeouts, QPs whose failure waited for a busy data path. The tick runs
//! every `poll_interval` while any of that but heartbeats is under way,
//! every [`heartbeat_interval`] while the device only has QPs to keep
//! alive, and not at all with no QP (the thread sleeps until something
//! happens). It never blocks on a peer (non-blocking sockets)
//! nor for long on a QP lock, and gives the device's reserve descriptor up
//! so that a process out of descriptors refuses new connections instead of
//! spinning.

use super::device::DevShared;
use super::qp::QpInner;
use super::{lock, lock_within, MAX_PENDING, PENDING_WAIT};

use super::layout::*;
use super::wire::{Kind, Msg};
use crate::sys::{self, SeqPacket};
use crate::verbs::*;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// What a polled socket is to the device thread.
pub(super) enum Role {
    /// Accepted, no hello yet (index into the pending list).
    Pending(usize),
    /// A QP's inbound connection: the verified one or a candidate (by id).
    Inbound(Arc<QpInner>, u64),
    /// The connection a QP dialed (watched for hang-up only).
    Out(Arc<QpInner>),
}

/// How often a device with QPs but nothing else under way ticks: its
/// heartbeats then tell a hung peer apart within `peer_timeout`, which
/// allows four heartbeats missed in a row before a peer is taken for dead
/// (a peer whose device thread a loaded machine delays a little is not).
pub(super) fn heartbeat_interval(sh: &DevShared) -> Duration {
    (sh.peer_timeout / 4).max(sh.poll_interval)
}

/// `watch`: the kernel's link notifications; without them (a socket
/// refused) the port state is looked at every tick instead, and ticks never
/// stop.
pub(super) fn device_thread(
    sh: Arc<DevShared>,
    listener: SeqPacket,
    watch: Option<sys::LinkWatch>,
) {
    let mut pending: Vec<(Arc<SeqPacket>, Instant)> = vec![];
    let mut accept_paused_until: Option<Instant> = None;
    let mut last_tick = Instant::now();
    let mut ticks: u64 = 0;
    sh.thread_id.store(sys::thread_id(), Release);
    while !sh.stop.load(Acquire) {
        if sh.frozen.load(Acquire) {
            // Hung on purpose (test hook): no answers, no heartbeats.
            let _ = sh.wake.wait(sh.poll_interval);
            continue;
        }
        if sh.starving.load(Acquire) {
            // Waiting for a CPU on purpose (test hook): runnable, no ticks.
            std::hint::spin_loop();
            continue;
        }
        let qps = sh.qp_list();
        // The sockets to watch, with the Arcs held across the poll so no
        // descriptor number is closed (and reused) under it.
        let mut socks: Vec<(Arc<SeqPacket>, Role, i16)> = vec![];
        // Work a short tick must watch: connections not yet routed, QPs
        // meeting their peer, failing or with a link to install.
        let mut busy = !pending.is_empty() || accept_paused_until.is_some();
        for (i, (s, _)) in pending.iter().enumerate() {
            socks.push((s.clone(), Role::Pending(i), libc::POLLIN));
        }
        for qp in &qps {
            // bounded: nobody holds `ctl` for long, but the device thread
            // must never wait on a QP
            let Some(ctl) = lock_within(&qp.ctl, Duration::from_millis(5)) else {
                continue;
            };
            busy |= ctl.ready.is_some()
                || ctl.rtr_at.is_some() && !ctl.inb.as_ref().is_some_and(|b| b.authed)
                || qp.fail_pending.load(Acquire);
            if let Some(o) = &ctl.out {
                // Hang-up only (an unread answer must not make us spin).
                socks.push((o.sock.clone(), Role::Out(qp.clone()), 0));
            }
            for b in ctl.inb.iter().chain(ctl.cands.iter()) {
                socks.push((
                    b.sock.clone(),
                    Role::Inbound(qp.clone(), b.id),
                    libc::POLLIN,
                ));
            }
        }
        let listen = accept_paused_until.is_none_or(|t| Instant::now() >= t);
        let mut fds = vec![
            (
                listener.as_fd().as_raw_fd(),
                if listen { libc::POLLIN } else { 0 },
                0i16,
            ),
            (sh.wake.as_fd().as_raw_fd(), libc::POLLIN, 0),
            (
                watch.as_ref().map_or(-1, |w| w.as_fd().as_raw_fd()),
                libc::POLLIN,
                0,
            ),
        ];
        fds.extend(
            socks
                .iter()
                .map(|(s, _, ev)| (s.as_fd().as_raw_fd(), *ev, 0)),
        );
        let period = if busy || watch.is_none() {
            Some(sh.poll_interval)
        } else if !qps.is_empty() {
            Some(heartbeat_interval(&sh))
        } else {
            None
        };
        let timeout = period.map(|p| p.saturating_sub(last_tick.elapsed()));
        let polled_at = Instant::now();
        let _ = sys::poll_raw(&mut fds, timeout);
        if sh.stop.load(Acquire) {
            break;
        }
        let mut look = false;
        if fds[1].2 != 0 {
            sh.wake.drain();
            // (a test's `force_port_down` wakes the thread to be seen)
            look = true;
        }
        if fds[2].2 != 0 && watch.as_ref().is_some_and(sys::LinkWatch::drain) {
            look = true;
            if !sh.frozen.load(Acquire) {
                // (an address that came or went changes the GIDs too)
                sh.publish_gids();
            }
        }
        if look && watch.is_some() && !sh.frozen.load(Acquire) {
            port_check(&sh, &qps);
        }
        if fds[0].2 & libc::POLLIN != 0 && !sh.frozen.load(Acquire) {
            accept_paused_until = None;
            accept_all(&sh, &listener, &mut pending, &mut accept_paused_until);
        }
        let mut done_pending = vec![];
        for (i, (s, role, _)) in socks.iter().enumerate() {
            let rev = fds[i + 3].2;
            if rev == 0 || sh.frozen.load(Acquire) {
                continue;
            }
            match role {
                Role::Pending(p) => {
                    if !on_pending(&sh, s) {
                        done_pending.push(*p);
                    }
                }
                Role::Inbound(qp, id) => qp.on_inbound(*id),
                Role::Out(qp) => qp.on_out_hangup(s),
            }
        }
        // Routed or dropped connections leave the pending list (the QP holds
        // a routed one now).
        let now = Instant::now();
        let mut i = 0;
        pending.retain(|(_, since)| {
            let keep = !done_pending.contains(&i) && now.duration_since(*since) < PENDING_WAIT;
            i += 1;
            keep
        });
        if period.is_some_and(|p| last_tick.elapsed() >= p) {
            last_tick = Instant::now();
            ticks += 1;
            if !sh.frozen.load(Acquire) {
                if watch.is_none() {
                    port_check(&sh, &qps);
                }
                tick(&sh, &qps, ticks, polled_at);
            }
            sh.keep_reserve();
        }
    }
    // Dropping the listener and the pending connections closes them.
}

/// Accepts what is queued on the listener. Out of descriptors (EMFILE,
/// ENFILE), the connection cannot even be accepted and the listener stays
/// readable: the reserve descriptor is given up to accept and close it (the
/// dialer sees its connection refused), and accepting pauses for a tick
/// instead of spinning.
fn accept_all(
    sh: &DevShared,
    listener: &SeqPacket,
    pending: &mut Vec<(Arc<SeqPacket>, Instant)>,
    paused_until: &mut Option<Instant>,
) {
    for _ in 0..MAX_PENDING {
        match listener.accept_nonblocking() {
            Ok(s) => {
                if pending.len() >= MAX_PENDING {
                    continue; // closed at once: a flood costs only its senders
                }
                pending.push((Arc::new(s), Instant::now()));
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                sh.with_reserve(|| drop(listener.accept_nonblocking()));
                *paused_until = Some(Instant::now() + sh.poll_interval);
                return;
            }
            Err(_) => return, // WouldBlock: all taken
        }
    }
}

/// The first message of an accepted connection: a hello for one of our QPs,
/// which then holds the connection, or the connection is closed. Returns
/// whether the connection stays pending.
fn on_pending(sh: &DevShared, s: &Arc<SeqPacket>) -> bool {
    let mut b = [0u8; 128];
    let (m, fds) = match s.try_recv(&mut b) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
        Err(_) | Ok((0, _)) => return false,
        Ok((n, fds)) => (Msg::decode(&b[..n]), fds),
    };
    let Some(m) = m.filter(|m| m.kind == Kind::Hello) else {
        return false;
    };
    let Some(qp) = lock(&sh.qps).get(&m.b).and_then(Weak::upgrade) else {
        return false;
    };
    qp.on_hello(s.clone(), m, fds);
    false
}

/// Reads the port state; a change raises its event, and a port gone down
/// fails every QP of the device (Linux: the HCA moves them to the error
/// state, `smc_ib_global_event_handler` takes the links down).
pub(super) fn port_check(sh: &DevShared, qps: &[Arc<QpInner>]) {
    // A look that fails (not a "down" answer) changes nothing.
    let up = match sh.probe.link(&sh.netdev) {
        Ok(l) => l.is_some_and(|l| l.up),
        Err(_) => sh.port_up.load(Acquire),
    } && !sh.forced_down.load(Acquire);
    if up != sh.port_up.swap(up, AcqRel) {
        if up {
            sh.raise(AsyncEvent::PortActive { port: 1 });
        } else {
            sh.raise(AsyncEvent::PortError { port: 1 });
            for qp in qps {
                qp.fail_async(None, false);
            }
        }
    }
}

/// How long a peer whose device thread waits for a CPU keeps its QPs
/// without a heartbeat: bounded, so that a peer that never runs again is
/// still taken for dead.
fn starved_limit(sh: &DevShared) -> Duration {
    sh.peer_timeout * 8
}

/// The state of the peer's device thread (`/proc/TID/stat`), whose
/// heartbeats come on `own`: only a peer in our pid namespace names its
/// thread as we do (`None` for any other, judged by its heartbeats alone).
pub(super) fn peer_thread_state(pidns_here: u64, own: &Ring<'_>) -> Option<u8> {
    let pidns = own.h(R_PROD_PIDNS).load(Relaxed);
    if pidns == 0 || pidns != pidns_here {
        return None;
    }
    let tid = u32::try_from(own.h(R_PROD_TID).load(Relaxed)).unwrap_or(0);
    sys::thread_state(tid)
}

/// Whether the peer whose heartbeats stopped is starved rather than hung:
/// its device thread is runnable (`R`) or in the kernel (`D`, say a page
/// fault on a machine short of memory), as a loaded machine leaves a thread,
/// where a hung one (`S` past its tick) is dead to us. An RNIC acknowledges
/// in hardware however busy its host's CPUs are; here a thread
/// acknowledges, and a loaded machine's scheduling delay must not end links
/// that a RoCE peer would keep.
fn peer_starved(state: Option<u8>) -> bool {
    matches!(state, Some(b'R' | b'D'))
}

/// Whether the peer's process is stopped (`T`: `SIGSTOP`, job control;
/// `t`: a debugger's stop): alive, and dead only once its process ends
/// (its sockets hang up). A TCP connection outlives a stopped peer
/// however long it stays stopped, its kernel answering for it; so do these
/// links (`QueuePair::peer_paused` tells the engine, whose keepalive waits
/// too).
pub(super) fn peer_stopped(state: Option<u8>) -> bool {
    matches!(state, Some(b'T' | b't'))
}

/// `polled_at`: when the poll whose events were just handled began. A
/// deadline for a peer's message is judged at that time, not now: a
/// message that came before it has been read by then only if its socket
/// was polled, and a process stopped (`SIGSTOP`) or starved between a
/// socket's arrival in the poll set and its first poll would otherwise
/// find the time it did not run counted against its peer (a peer's auth
/// waiting unread in a socket the poll did not watch yet).
pub(super) fn tick(sh: &DevShared, qps: &[Arc<QpInner>], ticks: u64, polled_at: Instant) {
    if ticks.is_multiple_of(25) {
        sh.publish_gids();
    }
    let now = Instant::now();
    for qp in qps {
        if qp.fail_pending.load(Acquire) {
            let (first, event) = *lock(&qp.fail_what);
            qp.fail_async(first, event);
            continue;
        }
        let mut dead = false;
        {
            // Only the heartbeat lock: `core` may be taken by the QP's owner
            // (posting, polling, or fetching a peer region), and the
            // heartbeat must go on regardless.
            let mut hb = lock(&qp.hb);
            if let Some(h) = hb.as_mut() {
                let live = qp.live.load(SeqCst);
                Ring(&h.peer_ring).h(R_PROD_HB).fetch_add(1, Release);
                let own = Ring(&h.own_ring);
                let v = own.h(R_PROD_HB).load(Acquire);
                if v != h.last_hb {
                    h.last_hb = v;
                    h.last_hb_change = now;
                }
                let silent = now.duration_since(h.last_hb_change);
                if live && silent > sh.peer_timeout {
                    let state = peer_thread_state(sh.pidns, &own);
                    if peer_stopped(state) {
                        h.seen_stopped = true;
                    } else if std::mem::take(&mut h.seen_stopped) {
                        // Continued since the last look, and not beaten
                        // yet (its thread may not have run): its silence
                        // starts now, the time it was stopped no sign of
                        // a hang.
                        h.last_hb_change = now;
                    } else if silent > starved_limit(sh) || !peer_starved(state) {
                        dead = true;
                    }
                }
                if live && Ring(&h.peer_ring).h(R_CONS_CLOSED).load(Acquire) != 0
                    || own.h(R_PROD_CLOSED).load(Acquire) != 0
                {
                    dead = true;
                }
            }
        }
        // A QP that never met its verified, authenticated peer fails too.
        if let Some(ctl) = lock_within(&qp.ctl, Duration::from_millis(5)) {
            let waiting = ctl.rtr_at.is_some_and(|t| {
                polled_at.saturating_duration_since(t) > sh.rendezvous_timeout
                    && !ctl.inb.as_ref().is_some_and(|b| b.authed)
            });
            dead |= waiting && qp.live.load(SeqCst);
        }
        if dead {
            qp.fail_async(Some(WcStatus::RetryExceeded), true);
        }
        // A verified link `core` was too busy to take.
        let ready = lock_within(&qp.ctl, Duration::from_millis(5)).and_then(|mut c| c.ready.take());
        if let Some(l) = ready {
            qp.install_link(l);
        }
        // Peer regions deregistered since: unmap (windows lent keep theirs).
        if let Ok(mut m) = qp.remote.try_lock() {
            let n = m.len();
            m.retain(|_, r| r.valid());
            if m.len() != n {
                qp.remote_changed(&m);
                drop(m);
                // (and the one the data path remembers, if it is one of them)
                if let Ok(mut c) = qp.core.try_lock() {
                    if c.last_remote.as_ref().is_some_and(|(_, r)| !r.valid()) {
                        c.last_remote = None;
                    }
                }
            }
        }
    }
}
