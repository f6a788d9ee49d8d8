//! A second device: further links of a link group over another RDMA device
//! (another port, another interface), so that one device's failure leaves
//! the group a link (`protocol-llc-cdc.md` §1.8 adds the link, §7 moves the
//! connections).
//!
//! Linux registers every RMB once per link (`smcr_link_reg_buf`: one MR per
//! buffer and link, each in its link's PD), so an RMB has one rkey and
//! address per link, announced in ADD_LINK_CONT (or the v2 ADD_LINK's
//! extension) and CONFIRM_RKEY. Here the links on the endpoint's first
//! device share the group's PD (one rkey for all of them); the first link on
//! the second device gives the group a second PD there, in which every
//! buffer of the group — RMBs for the peer's WRITEs, send buffers for ours —
//! is registered again (`ProtectionDomain::share_mr`: the same memory, its
//! own keys and address), and so is every buffer a connection takes later.
//! A link on the second device carries its source GID and port MTU there and
//! translates the send buffers' lkeys for its WRITEs (`link::OtherDevice`).
//!
//! Which device a new link takes (Linux `smc_llc_find_alt_link`,
//! `smc_ib_find_route`: an alternate device when there is one): one whose
//! port is active, the one fewer links of the group use, the first device
//! among equals.
//!
//! Each device has its own completion channel, for the CQs of its links
//! (verbs: a CQ's `ibv_comp_channel` must be of the CQ's own context). The
//! driver still sleeps on one descriptor ([`Endpoint::notify_fd`]): with a
//! second device that is an epoll set of both channels and of both devices'
//! asynchronous-event descriptors, so that a port going down on either
//! device wakes the driver at once (the next pump takes the event,
//! `poll_device_events`), not at whatever wakes it next: a port-down does
//! not always fail the QPs on it (rxe keeps them), and until the pump sees
//! it the group goes on sending on the dead link.

use super::conn_core::lock;
use super::gid::LocalGid;
use super::lgr::Lgr;
use super::link::{LinkLimits, LinkRes, OtherDevice};
use super::{Endpoint, LgrId, Result};
use smc_rdma::{
    Access, AsyncEvent, CompletionChannel, Device, GidType, MemoryRegion, PortState,
    ProtectionDomain, Provider,
};
use smc_wire::types::IbMtu;
use std::collections::HashMap;
use std::os::fd::BorrowedFd;

/// A buffer's registration on the second device: (lkey, address) there, and
/// its address on the first device.
pub(super) type OnSecond = (u32, u64, u64);

/// A link group's protection domain on the second device and its buffers
/// registered again there.
pub(super) struct SecondPd<P: Provider> {
    pub(super) pd: P::Pd,
    /// The registrations here, by the buffer's lkey on the first device.
    mrs: HashMap<u32, P::Mr>,
    /// RMBs: rkey on the first device → (rkey, address) here.
    rkeys: HashMap<u32, (u32, u64)>,
    /// Send buffers (and RMBs): lkey on the first device → (lkey, address)
    /// here, and the address on the first device.
    lkeys: HashMap<u32, OnSecond>,
}

impl<P: Provider> SecondPd<P> {
    /// Registers `mr` (of the group's first PD) here unless it is already;
    /// `remote`: an RMB, written by the peer.
    fn share(&mut self, mr: &P::Mr, remote: bool) -> Result<Option<(u32, OnSecond)>> {
        if self.mrs.contains_key(&mr.lkey()) {
            return Ok(None);
        }
        let access = if remote {
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        } else {
            Access::LOCAL_WRITE
        };
        let m = self.pd.share_mr(mr, access)?;
        if remote {
            self.rkeys.insert(mr.rkey(), (m.rkey(), m.addr()));
        }
        let entry = (m.lkey(), m.addr(), mr.addr());
        self.lkeys.insert(mr.lkey(), entry);
        self.mrs.insert(mr.lkey(), m);
        Ok(Some((mr.lkey(), entry)))
    }
}

impl<P: Provider> Lgr<P> {
    /// Our RMB's (rkey, address) on the link in `slot`, given its rkey and
    /// address on the first device.
    pub(super) fn rmb_token(&self, slot: usize, rkey: u32, addr: u64) -> (u32, u64) {
        let second = self
            .links
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|r| r.on.is_some());
        self.rmb_token_on(second, rkey, addr)
    }

    /// Likewise, on the second device (`second`) or the first.
    pub(super) fn rmb_token_on(&self, second: bool, rkey: u32, addr: u64) -> (u32, u64) {
        match self.second.as_ref().filter(|_| second) {
            Some(sp) => sp.rkeys.get(&rkey).copied().unwrap_or((rkey, addr)),
            None => (rkey, addr),
        }
    }

    /// Records the peer RMB a CLC Accept / Confirm announces for a
    /// connection now on link `slot`; returns its rtoken row. The rkey is
    /// the peer's on the link the message names (its QP and GID, §1.11),
    /// which is `slot` unless that link failed meanwhile and the connection
    /// moved: on two devices the rkeys differ per link, so the rkey goes
    /// into the named link's column, or — that link gone — finds the row
    /// the peer's CONFIRM_RKEY flow made (which has every link's rkey): by
    /// the rkey the row had on the gone link
    /// (`LinkGroup::find_former_rtoken`), else by one equal to it on a
    /// link still up (both links on one device share its rkeys).
    pub(super) fn add_clc_rtoken(
        &mut self,
        slot: usize,
        peer: &smc_wire::clc::AcceptConfirm,
    ) -> std::result::Result<usize, smc_proto::link::RtokenTableFull> {
        let named = (0..self.links.len()).find(|&s| {
            self.links[s]
                .as_ref()
                .is_some_and(|r| r.connected && r.peer_qpn == peer.qpn && r.peer_gid == peer.gid)
        });
        if let Some(s) = named {
            return self.group.add_rtoken(s, peer.rmb_rkey, peer.rmb_vaddr);
        }
        let known = self
            .group
            .find_former_rtoken(peer.gid, peer.qpn, peer.rmb_rkey)
            .or_else(|| {
                (0..self.links.len()).find_map(|s| self.group.find_rtoken(s, peer.rmb_rkey))
            });
        match known {
            Some(row) => Ok(row),
            None => self.group.add_rtoken(slot, peer.rmb_rkey, peer.rmb_vaddr),
        }
    }

    /// A connection's buffers, registered on the group's second PD too if
    /// it has one (and known to its links there).
    pub(super) fn share_bufs(&mut self, rmb: &P::Mr, sndbuf: &P::Mr) -> Result<()> {
        let Some(sp) = self.second.as_mut() else {
            return Ok(());
        };
        let new = [sp.share(rmb, true)?, sp.share(sndbuf, false)?];
        for (lkey, e) in new.into_iter().flatten() {
            for r in self.links.iter_mut().flatten() {
                if let Some(on) = r.on.as_mut() {
                    on.lkeys.insert(lkey, e);
                }
            }
        }
        Ok(())
    }
}

impl<P: Provider> LinkRes<P> {
    /// The link's source GID and port MTU: those of the second device, or
    /// the group's GID (`group`) and the first device's MTU (`first_mtu`).
    pub(super) fn port(&self, group: LocalGid, first_mtu: IbMtu) -> (LocalGid, IbMtu) {
        match &self.on {
            Some(on) => (on.gid, on.mtu),
            None => (group, first_mtu),
        }
    }
}

impl<P: Provider> Endpoint<P> {
    /// Opens `name` as the endpoint's second device: link groups may add
    /// their further links on it (with redundancy on, see
    /// [`Self::set_redundancy`], whose `alternate` it makes true in
    /// substance). The first link of a group stays on the first device (the
    /// CLC handshake names its GID).
    /// Call it before the driver takes [`Self::notify_fd`]: the descriptor
    /// changes (to the epoll set of both devices, see the module
    /// documentation).
    pub fn open_second_device(&mut self, provider: &P, name: &str) -> Result<()> {
        use rustix::event::epoll;
        let dev = provider.open_device(name)?;
        let chan2 = dev.create_channel()?;
        let io = |e: rustix::io::Errno| smc_rdma::Error::Io(e.into());
        let wake = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(io)?;
        // (level-triggered: readable while a channel has a notification or
        // a device an event not yet taken)
        for fd in [
            self.chan.fd(),
            chan2.fd(),
            self.dev.async_fd(),
            dev.async_fd(),
        ] {
            epoll::add(
                &wake,
                fd,
                epoll::EventData::new_u64(0),
                epoll::EventFlags::IN,
            )
            .map_err(io)?;
        }
        self.limits = self.limits.both(LinkLimits::of(&dev.info()));
        self.dev2 = Some(dev);
        self.dev2_name = Some(name.to_string());
        self.chan2 = Some(chan2);
        self.wake = Some(wake);
        Ok(())
    }

    /// The second device's asynchronous-event descriptor (readable while
    /// events are pending). [`Self::notify_fd`] covers it already.
    pub fn second_device_async_fd(&self) -> Option<BorrowedFd<'_>> {
        self.dev2.as_ref().map(Device::async_fd)
    }

    /// Whether link `slot` of group `l` is on the second device.
    pub fn link_on_second_device(&self, l: LgrId, slot: usize) -> Option<bool> {
        let lg = self.lgrs.get(l)?;
        Some(lg.links.get(slot)?.as_ref()?.on.is_some())
    }

    /// Takes the asynchronous events of both devices.
    pub(super) fn poll_device_events(&mut self) {
        while let Some(ev) = self.dev.poll_async_event() {
            self.on_async_event(false, ev);
        }
        while let Some(ev) = self.dev2.as_ref().and_then(Device::poll_async_event) {
            self.on_async_event(true, ev);
        }
    }

    /// Whether a new link of group `l` goes on the second device (see the
    /// module documentation).
    fn new_link_on_second(&self, l: LgrId) -> bool {
        let (Some(d2), Some(lg)) = (&self.dev2, self.lgrs.get(l)) else {
            return false;
        };
        let mut n = [0usize; 2];
        for r in lg.links.iter().flatten() {
            n[usize::from(r.on.is_some())] += 1;
        }
        match (port_up(&self.dev), port_up(d2)) {
            (true, false) => false,
            (false, true) => true,
            _ => n[1] < n[0],
        }
    }

    /// The QP and buffers of a new link of group `l` (not yet in a slot),
    /// on the device [`Self::new_link_on_second`] picks, with initial PSN
    /// `psn`.
    pub(super) fn new_link(&mut self, l: LgrId, psn: u32) -> Result<LinkRes<P>> {
        let bad = |m: &str| smc_rdma::Error::InvalidArgument(m.into());
        let second = self.new_link_on_second(l);
        let lg = self.lgrs.get_mut(l).ok_or_else(|| bad("no link group"))?;
        if !second {
            return LinkRes::new(&self.dev, &lg.pd, &self.chan, self.limits, psn);
        }
        let d2 = self.dev2.as_ref().ok_or_else(|| bad("no second device"))?;
        // the group's GID type (RoCE v1 or v2, IPv4-mapped or not) on the
        // second device's port
        let want = self
            .gids
            .iter()
            .find(|g| g.index == lg.local.index)
            .map(|g| (g.gid_type, g.gid.to_ipv4_mapped().is_some()))
            .unwrap_or((GidType::RoceV2, true));
        let port = d2.query_port(1)?;
        let gid = port
            .gids
            .iter()
            .find(|g| (g.gid_type, g.gid.to_ipv4_mapped().is_some()) == want)
            .map(LocalGid::from)
            .ok_or_else(|| bad("the second device has no GID of the group's type"))?;
        if lg.second.is_none() {
            let mut sp = SecondPd {
                pd: d2.alloc_pd()?,
                mrs: HashMap::new(),
                rkeys: HashMap::new(),
                lkeys: HashMap::new(),
            };
            // every buffer of the group: in use, and pooled
            for &id in lg.tokens.values() {
                let Some(c) = self.conns.get(id) else {
                    continue;
                };
                let k = lock(&c.core);
                if let (Some(rmb), Some(sndbuf)) = (k.rmb.as_ref(), k.sndbuf.as_ref()) {
                    sp.share(rmb, true)?;
                    sp.share(sndbuf, false)?;
                }
            }
            for (rmb, sndbuf) in lg.free_bufs.iter() {
                sp.share(rmb, true)?;
                sp.share(sndbuf, false)?;
            }
            lg.second = Some(sp);
        }
        let sp = lg.second.as_ref().ok_or_else(|| bad("no second PD"))?;
        let chan = self.chan2.as_ref().unwrap_or(&self.chan);
        let mut res = LinkRes::new(d2, &sp.pd, chan, self.limits, psn)?;
        res.on = Some(OtherDevice {
            gid,
            mtu: port.active_mtu,
            lkeys: sp.lkeys.clone(),
        });
        Ok(res)
    }

    /// Whether an asynchronous event of the second device (`second`) or the
    /// first hits link `res`: its QP failed, or its device's port or the
    /// device itself.
    pub(super) fn event_hits(second: bool, ev: AsyncEvent, res: &LinkRes<P>) -> bool {
        use smc_rdma::QueuePair;
        if res.on.is_some() != second {
            return false;
        }
        match ev {
            AsyncEvent::QpFatal { qp_num } => res.qp.qp_num() == qp_num,
            AsyncEvent::PortError { .. } | AsyncEvent::DeviceFatal => true,
            AsyncEvent::PortActive { .. } => false,
        }
    }
}

/// Whether `d`'s port is active (a device has one port here, port 1).
pub(super) fn port_up<D: Device>(d: &D) -> bool {
    d.query_port(1).is_ok_and(|p| p.state == PortState::Active)
}
