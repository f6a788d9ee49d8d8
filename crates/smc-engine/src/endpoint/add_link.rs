//! Further links negotiated with the peer: the driver's part of smc-proto's
//! ADD_LINK flow (`protocol-llc-cdc.md` §1.8) — a server prepares the new
//! link's QP and starts the flow once its group has one usable link and
//! wants another; a client prepares and connects a QP for the server's offer;
//! the server connects its QP to the client's answer; a flow that ended
//! before its link existed frees the QP. The rkeys announced for the new link
//! are those of every RMB in use, on the new link's device (the group's
//! second PD when the link is on the endpoint's second device, see
//! `endpoint/devices.rs`; one PD per group and device, see
//! `endpoint/link.rs`).
//!
//! The connect of the new link's QP (INIT → RTR → RTS) may be handed to the
//! driver ([`Endpoint::set_hand_out_bringups`]) to run without the
//! endpoint: with verbs the modify to RTR resolves the peer's MAC by a
//! neighbour lookup and can wait a second or more for ARP, which inside an
//! engine call would hold up every connection of a driver that locks the
//! endpoint. Meanwhile the QP waits in its slot, unconnected (no
//! connection picks it, LLC messages for it are held), and the ADD_LINK
//! flow's deadlines run as ever; the driver's report
//! ([`Endpoint::handle_link_bringup`]) carries the flow on.
//!
//! Linux: smc_llc.c `smc_llc_srv_add_link`, `smc_llc_cli_add_link` (run
//! by its LLC worker, the QP modified there: smc_ib.c
//! `smc_ib_ready_link`); smc_core.c `smcr_link_init`.

use super::link::{LinkBringup, WrKind};
use super::{Endpoint, LgrId, Result};
use smc_proto::link::{PeerPort, Redundancy, Role};
use smc_proto::Timestamp;
use smc_rdma::{MemoryRegion, Provider};

impl<P: Provider> Endpoint<P> {
    /// Whether and how link groups add further links (§1.8): off by default
    /// (one link per group; a peer's ADD_LINK is rejected, and as a server
    /// we agree on max_links 1). On, a server agrees on two links and adds
    /// the second after the first contact, and again after one was lost; a
    /// client answers (or, without an alternate path on either side,
    /// rejects). Applies to existing groups too.
    ///
    /// `alternate` declares a second path: the endpoint's second device
    /// ([`Self::open_second_device`]), on which further links go; without
    /// one, all links of a group share the device's port, and its failure
    /// takes every link.
    pub fn set_redundancy(&mut self, r: Redundancy) {
        self.redundancy = r;
        for lg in self.lgrs.values_mut() {
            lg.group.set_redundancy(r);
        }
    }

    /// The rkey list of a new link on the second device (`second`) or the
    /// first: every RMB in use as (rkey on an existing link — the first
    /// usable one, where the flow runs —, rkey on the new link, address on
    /// the new link).
    pub(super) fn add_link_rkeys(&self, l: LgrId, second: bool) -> Vec<(u32, u32, u64)> {
        let Some(lg) = self.lgrs.get(l) else {
            return Vec::new();
        };
        let via = lg.group.active_slots().next().unwrap_or(0);
        lg.tokens
            .values()
            .filter_map(|&id| {
                let k = self.core(id)?;
                let m = k.rmb.as_ref()?;
                let (old, _) = lg.rmb_token(via, m.rkey(), m.addr());
                let (new, addr) = lg.rmb_token_on(second, m.rkey(), m.addr());
                Some((old, new, addr))
            })
            .collect()
    }

    /// Server: starts the ADD_LINK flow if group `l` wants one now. True if
    /// it started (or could not and gave up), so that outputs may follow.
    pub(super) fn maybe_add_link(&mut self, l: LgrId, now: Timestamp) -> bool {
        let ready = self.lgrs.get(l).is_some_and(|lg| {
            lg.role == Role::Server
                && lg.state.accepts_connections()
                && lg.group.can_start_add_link()
        });
        if !ready {
            return false;
        }
        let mtu = self.port_mtu;
        let mac = self.mac;
        let psn = self.psns.next_psn();
        let slot = self.lgrs.get(l).and_then(|lg| {
            lg.group
                .add_slot()
                .filter(|&s| lg.links.get(s).is_some_and(Option::is_none))
        });
        let res = slot.and_then(|_| self.new_link(l, psn).ok());
        let rkeys = res
            .as_ref()
            .map(|r| self.add_link_rkeys(l, r.on.is_some()))
            .unwrap_or_default();
        let Some(lg) = self.lgrs.get_mut(l) else {
            return false;
        };
        let (Some(slot), Some(res)) = (slot, res) else {
            // no QP for it now: wait for the next trigger
            lg.group.add_link_unavailable();
            return true;
        };
        let (gid, mtu) = res.port(lg.local, mtu);
        let local = res.local_port(gid.gid, mac, mtu);
        lg.links[slot] = Some(res);
        // the peer's table gets the new link's column from this flow; a
        // pooled RMB it still knows needs CONFIRM_RKEY again to get one
        lg.known_rkeys.clear();
        if !lg.group.start_add_link(slot, local, &rkeys, now) {
            if let Some(r) = lg.links[slot].take() {
                r.shut();
            }
            lg.group.add_link_unavailable();
        }
        true
    }

    /// Client: the server offers a link in `slot`: a QP for it, connected to
    /// the server's (RTR and RTS: the server sends CONFIRM_LINK on it only
    /// after our response), then our response
    /// ([`Self::link_bringup_done`]); a QP we cannot make or connect
    /// rejects the offer. The QP waits in its slot, not yet connected,
    /// while its connect runs (see [`Self::start_bringup`]); the flow's
    /// own deadline (`SMC_LLC_WAIT_TIME` from the request) still holds.
    pub(super) fn on_add_link_offer(
        &mut self,
        l: LgrId,
        slot: usize,
        peer: PeerPort,
        now: Timestamp,
    ) {
        let mtu = self.port_mtu;
        let psn = self.psns.next_psn();
        let free = self
            .lgrs
            .get(l)
            .is_some_and(|lg| lg.links.get(slot).is_some_and(Option::is_none));
        let res = free.then(|| self.new_link(l, psn).ok()).flatten();
        let id = self.next_bringup_id();
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        let Some(mut res) = res else {
            lg.group.refuse_add_link();
            return;
        };
        let (gid, mtu) = res.port(lg.local, mtu);
        let b = res.begin_connect(&peer, mtu, gid.index, id);
        lg.links[slot] = Some(res);
        self.start_bringup(b, now);
    }

    /// Server: the client answered; our QP in `slot` connects to its end
    /// (handed out as the client's is; the CONFIRM_LINK that the flow sends
    /// on the new link waits for it, `drain_lgr`).
    pub(super) fn on_connect_link(
        &mut self,
        l: LgrId,
        slot: usize,
        peer: PeerPort,
        now: Timestamp,
    ) {
        let mtu = self.port_mtu;
        let id = self.next_bringup_id();
        let Some(lg) = self.lgrs.get_mut(l) else {
            return;
        };
        let group = lg.local;
        let b = lg.links.get_mut(slot).and_then(Option::as_mut).map(|r| {
            let (gid, mtu) = r.port(group, mtu);
            r.begin_connect(&peer, mtu, gid.index, id)
        });
        match b {
            Some(b) => self.start_bringup(b, now),
            None => lg.group.on_link_failure(slot),
        }
    }

    fn next_bringup_id(&mut self) -> u64 {
        self.next_bringup += 1;
        self.next_bringup
    }

    /// A link's QP connect: handed to the driver
    /// ([`Self::take_link_bringup`]) when it asked for that
    /// ([`Self::set_hand_out_bringups`]), else run here and now.
    fn start_bringup(&mut self, b: LinkBringup<P>, now: Timestamp) {
        if self.hand_out_bringups {
            self.bringups.push_back(b);
        } else {
            let r = b.run();
            self.link_bringup_done(b.id(), r, now);
        }
    }

    /// Whether the connect of an added link's QP (INIT → RTR → RTS) is
    /// handed to the driver ([`Self::take_link_bringup`]) instead of run
    /// inside the engine's call that decided it. A driver that holds a lock
    /// around the endpoint wants this: with verbs the modify to RTR resolves
    /// the peer's MAC by a neighbour lookup and may wait for ARP (a second
    /// and more for an address that does not answer) — user space cannot
    /// pass the MAC; Linux runs its QP modify from its LLC worker
    /// (smc_llc.c `smc_llc_cli_add_link` → smc_ib.c
    /// `smc_ib_ready_link`), apart from its connections' data path. Off by
    /// default (the call runs it).
    pub fn set_hand_out_bringups(&mut self, on: bool) {
        self.hand_out_bringups = on;
    }

    /// The next link connect to run (see [`Self::set_hand_out_bringups`]):
    /// run it ([`LinkBringup::run`]) without the endpoint and report its
    /// result with [`Self::handle_link_bringup`]. One not reported keeps its
    /// ADD_LINK flow waiting until the flow's deadline ends it.
    pub fn take_link_bringup(&mut self) -> Option<LinkBringup<P>> {
        self.bringups.pop_front()
    }

    /// Link connects handed out and not yet taken.
    pub fn link_bringups_waiting(&self) -> usize {
        self.bringups.len()
    }

    /// The result of link connect `id` ([`LinkBringup::run`]): the link
    /// goes on (a client answers the offer, a server's CONFIRM_LINK goes
    /// out) or fails (a client rejects the offer, a server's new link goes
    /// down). A connect whose link is gone meanwhile (its flow timed out,
    /// the group ended) is ignored.
    pub fn handle_link_bringup(&mut self, id: u64, r: Result<()>, now: Timestamp) -> Result<()> {
        self.now = now;
        let Some(l) = self.link_bringup_done(id, r, now) else {
            return Ok(());
        };
        self.sweep_due = true;
        self.lgr_recheck = true;
        self.drain_lgr(l, now)
    }

    /// See [`Self::handle_link_bringup`]; the group it concerned, if any.
    fn link_bringup_done(&mut self, id: u64, r: Result<()>, now: Timestamp) -> Option<LgrId> {
        let (l, slot) = self.lgrs.iter().find_map(|(l, lg)| {
            let slot = lg.links.iter().position(|r| {
                r.as_ref()
                    .and_then(|r| r.bringup.as_ref())
                    .is_some_and(|b| b.id == id)
            })?;
            Some((l, slot))
        })?;
        let mtu = self.port_mtu;
        let mac = self.mac;
        let rkeys = if r.is_ok() && self.lgrs.get(l)?.role == Role::Client {
            let second = self.lgrs.get(l)?.links[slot].as_ref()?.on.is_some();
            self.add_link_rkeys(l, second)
        } else {
            Vec::new()
        };
        let lg = self.lgrs.get_mut(l)?;
        let client = lg.role == Role::Client;
        if r.is_err() {
            if client {
                if let Some(res) = lg.links[slot].take() {
                    res.shut();
                }
                lg.group.refuse_add_link();
            } else {
                if let Some(res) = lg.links[slot].as_mut() {
                    res.bringup = None;
                }
                lg.group.on_link_failure(slot);
            }
            return Some(l);
        }
        let res = lg.links[slot].as_mut()?;
        let held = res.finish_connect();
        if client {
            let (gid, mtu) = res.port(lg.local, mtu);
            let local = res.local_port(gid.gid, mac, mtu);
            lg.known_rkeys.clear();
            lg.group.accept_add_link(local, &rkeys, now);
        }
        for bytes in held {
            self.llc_sent += 1;
            let posted = self
                .lgrs
                .get_mut(l)
                .and_then(|lg| lg.links[slot].as_mut())
                .map(|res| res.post(WrKind::Llc, &bytes));
            if let Some(Err(e)) = posted {
                if self.link_error(l, slot, e).is_err() {
                    break;
                }
            }
        }
        Some(l)
    }

    /// An ADD_LINK flow ended before its link existed: its QP goes.
    pub(super) fn on_add_link_failed(&mut self, l: LgrId, slot: usize) {
        if let Some(lg) = self.lgrs.get_mut(l) {
            if lg.group.link(slot).is_none() {
                if let Some(r) = lg.links.get_mut(slot).and_then(Option::take) {
                    r.shut();
                }
            }
        }
    }
}

impl<P: Provider> Endpoint<P> {
    /// The redundancy type of group `l` (Linux's SINGLE, SYMMETRIC, ...).
    pub fn link_group_type(&self, l: LgrId) -> Option<smc_proto::link::LgrType> {
        Some(self.lgrs.get(l)?.group.lgr_type())
    }

    /// An ADD_LINK flow runs in group `l`.
    pub fn adding_link(&self, l: LgrId) -> bool {
        self.lgrs.get(l).is_some_and(|lg| lg.group.adding_link())
    }
}
