//! One provider for every device this process can use: the shared-memory
//! devices of `smc-rdma`'s `shm` provider and the RNICs (or Soft-RoCE) that
//! libibverbs finds, through `smc-verbs`.
//!
//! [`AnyProvider`] is an `smc_rdma::Provider` whose objects are enums of the
//! two providers' objects, so one `Endpoint<AnyProvider>` type serves every
//! device and one process uses shm and verbs devices at once (an endpoint per
//! device). Every call is a `match` on the variant, marked `#[inline]`: on
//! the data path (posting, polling, windows) the shm device costs one
//! predictable branch more than before.
//!
//! Objects of different providers never mix: a PD of one and a CQ of the
//! other, say, is [`Error::InvalidArgument`], never a panic.
//!
//! Devices:
//! * shm devices are those declared in the file named by `SMC_RDMA_SHM_CONFIG`
//!   (none without it);
//! * verbs devices are every device libibverbs lists. Without rdma-core (or
//!   with a libibverbs that cannot be loaded, see `smc_verbs::VerbsProvider::availability`)
//!   there are none, which is no error; a verbs device that cannot be listed
//!   (e.g. no permission on its `/dev/infiniband/uverbs*`) is left out, and
//!   so is every verbs device if the list itself fails, so that a broken
//!   RNIC never costs the shm devices.
//! * Names are one namespace: a shm device declared with the name of a verbs
//!   device hides that verbs device from this process (the declaration is
//!   the operator's explicit choice; verbs names are the kernel's, e.g.
//!   `rxe0`, `mlx5_0`, and shm devices are usually called `shm-*`).
#![forbid(unsafe_code)]

use smc_rdma::shm::ShmProvider;
use smc_rdma::{
    Access, AsyncEvent, CompletionChannel, CompletionQueue, Device, DeviceInfo, Doorbell, Error,
    InPlace, MemWindow, MemoryRegion, PortAttr, ProtectionDomain, Provider, QpCap, QpModify,
    QpState, QueuePair, RecvWr, RemoteMr, Result, SendWr, Sge, WorkCompletion,
};
use smc_verbs::VerbsProvider;
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// Which provider a device belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The shared-memory device: peers on this host only (see the crate
    /// docs for what "this host" means).
    Shm,
    /// A libibverbs device (RoCE RNIC, Soft-RoCE).
    Verbs,
}

impl Kind {
    /// `"shm"` or `"verbs"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Shm => "shm",
            Kind::Verbs => "verbs",
        }
    }
}

/// Two providers as one: `S` in the place of the shared-memory provider,
/// `V` in that of libibverbs ([`AnyProvider`]; the tests put the simulated
/// fabric in either place). Either may be absent.
#[derive(Clone, Debug)]
pub struct Pair<S, V> {
    shm: Option<S>,
    verbs: Option<V>,
}

/// The shm devices of `SMC_RDMA_SHM_CONFIG` and the libibverbs devices.
pub type AnyProvider = Pair<ShmProvider, VerbsProvider>;
/// An opened device of [`AnyProvider`].
pub type AnyDevice = PairDevice<ShmProvider, VerbsProvider>;
/// A protection domain of [`AnyProvider`].
pub type AnyPd = PairPd<ShmProvider, VerbsProvider>;
/// A memory region of [`AnyProvider`].
pub type AnyMr = PairMr<ShmProvider, VerbsProvider>;
/// A completion queue of [`AnyProvider`].
pub type AnyCq = PairCq<ShmProvider, VerbsProvider>;
/// A completion channel of [`AnyProvider`].
pub type AnyChannel = PairChannel<ShmProvider, VerbsProvider>;
/// A queue pair of [`AnyProvider`].
pub type AnyQp = PairQp<ShmProvider, VerbsProvider>;

impl AnyProvider {
    /// What this process uses: the shm devices declared in the file named by
    /// `SMC_RDMA_SHM_CONFIG` (none if it is unset or unreadable) and every
    /// libibverbs device (none if libibverbs cannot be loaded).
    pub fn from_env() -> AnyProvider {
        let shm = match ShmProvider::from_env() {
            Ok(p) => Some(p),
            Err(e) => {
                // a broken configuration is reported (registry, smc_dbg),
                // not left to look like "no SMC device"
                if let Some(f) = std::env::var_os("SMC_RDMA_SHM_CONFIG") {
                    crate::registry::error(
                        "device_config",
                        format!("{}: {e}", std::path::Path::new(&f).display()),
                    );
                }
                None
            }
        };
        Pair::new(shm, Some(VerbsProvider::new()))
    }
}

impl<S: Provider, V: Provider> Pair<S, V> {
    /// A provider over the given providers.
    pub fn new(shm: Option<S>, verbs: Option<V>) -> Pair<S, V> {
        Pair { shm, verbs }
    }

    /// The provider in the shm place, if any.
    pub fn shm(&self) -> Option<&S> {
        self.shm.as_ref()
    }

    /// Every device with its provider, shm devices first (in the order of
    /// their declaration), then the verbs devices libibverbs lists that no
    /// shm device's name hides. Errors: the shm devices could not be
    /// described (verbs errors only leave verbs devices out, see the module
    /// docs).
    pub fn devices_by_kind(&self) -> Result<Vec<(Kind, DeviceInfo)>> {
        let mut out: Vec<(Kind, DeviceInfo)> = match &self.shm {
            Some(p) => p.devices()?.into_iter().map(|d| (Kind::Shm, d)).collect(),
            None => Vec::new(),
        };
        if let Some(p) = &self.verbs {
            for d in p.devices().unwrap_or_default() {
                if !out.iter().any(|(_, s)| s.name == d.name) {
                    out.push((Kind::Verbs, d));
                }
            }
        }
        Ok(out)
    }
}

impl<S: Provider, V: Provider> Provider for Pair<S, V> {
    type Device = PairDevice<S, V>;
    type Pd = PairPd<S, V>;
    type Mr = PairMr<S, V>;
    type Cq = PairCq<S, V>;
    type Channel = PairChannel<S, V>;
    type Qp = PairQp<S, V>;

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(self
            .devices_by_kind()?
            .into_iter()
            .map(|(_, d)| d)
            .collect())
    }

    /// Opens `name` from the shm provider if it has a device of that name,
    /// else from the verbs provider (see the module docs on names).
    fn open_device(&self, name: &str) -> Result<PairDevice<S, V>> {
        if let Some(p) = &self.shm {
            if p.devices()?.iter().any(|d| d.name == name) {
                return p.open_device(name).map(PairDevice::Shm);
            }
        }
        match &self.verbs {
            Some(p) => p.open_device(name).map(PairDevice::Verbs),
            None => Err(Error::NoSuchDevice(name.to_string())),
        }
    }
}

/// Objects of two providers where one provider's are needed.
fn mismatch(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "{what}: objects of the shm and the verbs provider do not mix"
    ))
}

/// Runs `$body` on the object inside `$self`, whichever provider's it is.
macro_rules! each {
    ($self:expr, $x:ident => $body:expr) => {
        match $self {
            Self::Shm($x) => $body,
            Self::Verbs($x) => $body,
        }
    };
}

/// An opened device.
pub enum PairDevice<S: Provider, V: Provider> {
    /// A device of the shm provider.
    Shm(S::Device),
    /// A device of the verbs provider.
    Verbs(V::Device),
}

impl<S: Provider, V: Provider> PairDevice<S, V> {
    /// Its provider.
    pub fn kind(&self) -> Kind {
        match self {
            PairDevice::Shm(_) => Kind::Shm,
            PairDevice::Verbs(_) => Kind::Verbs,
        }
    }
}

impl<S: Provider, V: Provider> Device for PairDevice<S, V> {
    type P = Pair<S, V>;

    fn info(&self) -> DeviceInfo {
        each!(self, d => d.info())
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        each!(self, d => d.query_port(port))
    }

    fn alloc_pd(&self) -> Result<PairPd<S, V>> {
        match self {
            PairDevice::Shm(d) => d.alloc_pd().map(PairPd::Shm),
            PairDevice::Verbs(d) => d.alloc_pd().map(PairPd::Verbs),
        }
    }

    fn create_channel(&self) -> Result<PairChannel<S, V>> {
        match self {
            PairDevice::Shm(d) => d.create_channel().map(PairChannel::Shm),
            PairDevice::Verbs(d) => d.create_channel().map(PairChannel::Verbs),
        }
    }

    fn create_cq(&self, depth: u32, channel: Option<&PairChannel<S, V>>) -> Result<PairCq<S, V>> {
        match (self, channel) {
            (PairDevice::Shm(d), None) => d.create_cq(depth, None).map(PairCq::Shm),
            (PairDevice::Shm(d), Some(PairChannel::Shm(c))) => {
                d.create_cq(depth, Some(c)).map(PairCq::Shm)
            }
            (PairDevice::Verbs(d), None) => d.create_cq(depth, None).map(PairCq::Verbs),
            (PairDevice::Verbs(d), Some(PairChannel::Verbs(c))) => {
                d.create_cq(depth, Some(c)).map(PairCq::Verbs)
            }
            _ => Err(mismatch("create_cq")),
        }
    }

    fn poll_async_event(&self) -> Option<AsyncEvent> {
        each!(self, d => d.poll_async_event())
    }

    fn async_fd(&self) -> BorrowedFd<'_> {
        each!(self, d => d.async_fd())
    }
}

/// A protection domain.
pub enum PairPd<S: Provider, V: Provider> {
    /// Of a shm device.
    Shm(S::Pd),
    /// Of a verbs device.
    Verbs(V::Pd),
}

impl<S: Provider, V: Provider> ProtectionDomain for PairPd<S, V> {
    type P = Pair<S, V>;

    fn alloc_mr(&self, len: usize, access: Access) -> Result<PairMr<S, V>> {
        match self {
            PairPd::Shm(p) => p.alloc_mr(len, access).map(PairMr::Shm),
            PairPd::Verbs(p) => p.alloc_mr(len, access).map(PairMr::Verbs),
        }
    }

    fn share_mr(&self, mr: &PairMr<S, V>, access: Access) -> Result<PairMr<S, V>> {
        match (self, mr) {
            (PairPd::Shm(p), PairMr::Shm(m)) => p.share_mr(m, access).map(PairMr::Shm),
            (PairPd::Verbs(p), PairMr::Verbs(m)) => p.share_mr(m, access).map(PairMr::Verbs),
            _ => Err(mismatch("share_mr")),
        }
    }

    fn create_qp(
        &self,
        send_cq: &PairCq<S, V>,
        recv_cq: &PairCq<S, V>,
        cap: QpCap,
    ) -> Result<PairQp<S, V>> {
        match (self, send_cq, recv_cq) {
            (PairPd::Shm(p), PairCq::Shm(s), PairCq::Shm(r)) => {
                p.create_qp(s, r, cap).map(PairQp::Shm)
            }
            (PairPd::Verbs(p), PairCq::Verbs(s), PairCq::Verbs(r)) => {
                p.create_qp(s, r, cap).map(PairQp::Verbs)
            }
            _ => Err(mismatch("create_qp")),
        }
    }
}

/// A memory region.
pub enum PairMr<S: Provider, V: Provider> {
    /// Of a shm device.
    Shm(S::Mr),
    /// Of a verbs device.
    Verbs(V::Mr),
}

impl<S: Provider, V: Provider> MemoryRegion for PairMr<S, V> {
    #[inline]
    fn lkey(&self) -> u32 {
        each!(self, m => m.lkey())
    }
    #[inline]
    fn rkey(&self) -> u32 {
        each!(self, m => m.rkey())
    }
    #[inline]
    fn addr(&self) -> u64 {
        each!(self, m => m.addr())
    }
    #[inline]
    fn len(&self) -> usize {
        each!(self, m => m.len())
    }
    #[inline]
    fn access(&self) -> Access {
        each!(self, m => m.access())
    }
    #[inline]
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        each!(self, m => m.read_at(off, buf))
    }
    #[inline]
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        each!(self, m => m.write_at(off, data))
    }
    #[inline]
    fn window(&self) -> Option<MemWindow> {
        each!(self, m => m.window())
    }
    #[inline]
    fn doorbell(&self) -> Option<Doorbell> {
        each!(self, m => m.doorbell())
    }
    #[inline]
    fn sge(&self, off: usize, len: u32) -> Result<Sge> {
        each!(self, m => m.sge(off, len))
    }
    #[inline]
    fn remote(&self) -> RemoteMr {
        each!(self, m => m.remote())
    }
}

/// A completion queue.
pub enum PairCq<S: Provider, V: Provider> {
    /// Of a shm device.
    Shm(S::Cq),
    /// Of a verbs device.
    Verbs(V::Cq),
}

impl<S: Provider, V: Provider> CompletionQueue for PairCq<S, V> {
    #[inline]
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        each!(self, c => c.poll(out))
    }
    #[inline]
    fn req_notify(&self) -> Result<()> {
        each!(self, c => c.req_notify())
    }
    #[inline]
    fn may_have_work(&self) -> bool {
        each!(self, c => c.may_have_work())
    }
}

/// A completion channel.
pub enum PairChannel<S: Provider, V: Provider> {
    /// Of a shm device.
    Shm(S::Channel),
    /// Of a verbs device.
    Verbs(V::Channel),
}

impl<S: Provider, V: Provider> CompletionChannel for PairChannel<S, V> {
    #[inline]
    fn fd(&self) -> BorrowedFd<'_> {
        each!(self, c => c.fd())
    }
    #[inline]
    fn try_get_event(&self) -> Result<bool> {
        each!(self, c => c.try_get_event())
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        each!(self, c => c.wait(timeout))
    }
}

/// A queue pair.
pub enum PairQp<S: Provider, V: Provider> {
    /// Of a shm device.
    Shm(S::Qp),
    /// Of a verbs device.
    Verbs(V::Qp),
}

impl<S: Provider, V: Provider> QueuePair for PairQp<S, V> {
    #[inline]
    fn qp_num(&self) -> u32 {
        each!(self, q => q.qp_num())
    }
    #[inline]
    fn state(&self) -> QpState {
        each!(self, q => q.state())
    }
    fn modify(&self, m: &QpModify) -> Result<()> {
        each!(self, q => q.modify(m))
    }
    #[inline]
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        each!(self, q => q.post_send(wr))
    }
    #[inline]
    fn post_send_ringing(&self, wr: &SendWr<'_>, bell_rkey: u32) -> Result<()> {
        each!(self, q => q.post_send_ringing(wr, bell_rkey))
    }
    #[inline]
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        each!(self, q => q.post_recv(wr))
    }
    #[inline]
    fn recv_in_place(&self, buf: &mut [u8]) -> InPlace {
        each!(self, q => q.recv_in_place(buf))
    }
    #[inline]
    fn recv_may_have(&self) -> bool {
        each!(self, q => q.recv_may_have())
    }
    #[inline]
    fn remote_window(&self, rkey: u32, addr: u64, len: usize) -> Option<MemWindow> {
        each!(self, q => q.remote_window(rkey, addr, len))
    }
    fn prepare_remote(&self, rkey: u32, addr: u64, len: usize) -> Result<()> {
        each!(self, q => q.prepare_remote(rkey, addr, len))
    }
    fn peer_paused(&self) -> bool {
        each!(self, q => q.peer_paused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_rdma::sim::SimFabric;

    type SimPair = Pair<SimFabric, SimFabric>;

    /// A pair of two simulated fabrics, `a0` in the shm place and `b0` in
    /// the verbs place, plus `both`, which each has (the shm one wins).
    fn pair() -> SimPair {
        let a = SimFabric::new(1);
        let b = SimFabric::new(2);
        a.add_device("a0", Some("eth0")).unwrap();
        a.add_device("both", Some("eth1")).unwrap();
        b.add_device("b0", Some("eth2")).unwrap();
        b.add_device("both", Some("eth3")).unwrap();
        Pair::new(Some(a), Some(b))
    }

    fn err_is_invalid_argument<T>(r: Result<T>) -> bool {
        matches!(r, Err(Error::InvalidArgument(_)))
    }

    #[test]
    fn objects_of_the_two_providers_do_not_mix() {
        let p = pair();
        let a = p.open_device("a0").unwrap();
        let b = p.open_device("b0").unwrap();
        assert_eq!((a.kind(), b.kind()), (Kind::Shm, Kind::Verbs));
        let (ca, cb) = (a.create_channel().unwrap(), b.create_channel().unwrap());
        // a CQ bound to the other provider's channel
        assert!(err_is_invalid_argument(a.create_cq(8, Some(&cb))));
        assert!(err_is_invalid_argument(b.create_cq(8, Some(&ca))));
        let qa = a.create_cq(8, Some(&ca)).unwrap();
        let qb = b.create_cq(8, Some(&cb)).unwrap();
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        // a QP whose PD and CQs are not all of one provider
        for (pd, s, r) in [
            (&pa, &qb, &qb),
            (&pa, &qa, &qb),
            (&pa, &qb, &qa),
            (&pb, &qa, &qa),
            (&pb, &qb, &qa),
            (&pb, &qa, &qb),
        ] {
            assert!(err_is_invalid_argument(pd.create_qp(
                s,
                r,
                QpCap::default()
            )));
        }
        // and the matching ones work
        let qp = pa.create_qp(&qa, &qa, QpCap::default()).unwrap();
        assert!(matches!(qp, PairQp::Shm(_)));
        assert_eq!(qp.state(), QpState::Reset);
        let qp = pb.create_qp(&qb, &qb, QpCap::default()).unwrap();
        assert!(matches!(qp, PairQp::Verbs(_)));
        let mr = pb.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        assert!(matches!(mr, PairMr::Verbs(_)));
        assert_eq!(mr.len(), 4096);
    }

    #[test]
    fn devices_of_both_providers_in_one_list_and_shm_names_win() {
        let p = pair();
        let list: Vec<(Kind, String, Option<String>)> = p
            .devices_by_kind()
            .unwrap()
            .into_iter()
            .map(|(k, d)| (k, d.name, d.ports[0].netdev.clone()))
            .collect();
        let s = |x: &str| x.to_string();
        assert_eq!(
            list,
            [
                (Kind::Shm, s("a0"), Some(s("eth0"))),
                (Kind::Shm, s("both"), Some(s("eth1"))),
                (Kind::Verbs, s("b0"), Some(s("eth2"))),
            ]
        );
        // `both` opens the shm place's device
        let d = p.open_device("both").unwrap();
        assert_eq!(d.kind(), Kind::Shm);
        assert_eq!(d.info().ports[0].netdev.as_deref(), Some("eth1"));
        assert!(matches!(p.open_device("nope"), Err(Error::NoSuchDevice(_))));
    }

    #[test]
    fn either_provider_may_be_absent() {
        let only_verbs: SimPair = Pair::new(None, pair().verbs);
        assert_eq!(only_verbs.devices().unwrap().len(), 2);
        assert_eq!(only_verbs.open_device("both").unwrap().kind(), Kind::Verbs);
        assert!(only_verbs.open_device("a0").is_err());
        let none: SimPair = Pair::new(None, None);
        assert!(none.devices().unwrap().is_empty());
        assert!(matches!(
            none.open_device("a0"),
            Err(Error::NoSuchDevice(_))
        ));
    }
}
