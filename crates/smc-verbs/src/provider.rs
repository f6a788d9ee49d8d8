//! The `verbs` provider: [`smc_rdma::Provider`] on rdma-core's libibverbs.
#![forbid(unsafe_code)]

use crate::ffi::{self, ibv_qp_attr, ibv_sge, ibv_wc, Context, LoadError};
use crate::map;
use smc_rdma::*;
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Where the kernel publishes RDMA devices (GID types and netdevs are read here).
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// Inline data limit reported in [`DeviceInfo::max_inline`] (verbs has no
/// device-wide query for it; a QP's granted capability is authoritative).
pub const DEFAULT_MAX_INLINE: u32 = 64;

/// The provider. Creating it never fails: without rdma-core it has no devices.
#[derive(Clone, Debug)]
pub struct VerbsProvider {
    sysfs: PathBuf,
}

impl Default for VerbsProvider {
    fn default() -> Self {
        Self::new()
    }
}

impl VerbsProvider {
    /// A provider reading GID attributes from [`SYSFS_INFINIBAND`].
    pub fn new() -> Self {
        VerbsProvider {
            sysfs: PathBuf::from(SYSFS_INFINIBAND),
        }
    }

    /// Whether libibverbs could be loaded (`Err` says why not, e.g. rdma-core
    /// is not installed). [`Provider::devices`] returns an empty list then.
    pub fn availability() -> std::result::Result<(), LoadError> {
        ffi::lib().map(|_| ())
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Reads the GID attributes the kernel exports in sysfs for one GID index:
/// its RoCE type and its network interface.
pub fn sysfs_gid_attrs(
    sysfs: &Path,
    dev: &str,
    port: u8,
    index: u16,
) -> (Option<GidType>, Option<String>) {
    let base = sysfs
        .join(dev)
        .join("ports")
        .join(port.to_string())
        .join("gid_attrs");
    let ty = std::fs::read_to_string(base.join("types").join(index.to_string()))
        .ok()
        .and_then(|s| map::gid_type(&s));
    let nd = std::fs::read_to_string(base.join("ndevs").join(index.to_string()))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    (ty, nd)
}

fn describe_port(ctx: &Context, sysfs: &Path, dev: &str, port: u8) -> Result<PortAttr> {
    let pa = ctx.query_port(port).map_err(|e| match e.raw_os_error() {
        Some(libc::EINVAL) => Error::NoSuchPort(port),
        _ => io("ibv_query_port", e),
    })?;
    let mut gids = vec![];
    let mut netdev = None;
    for i in 0..pa.gid_tbl_len.clamp(0, 4096) {
        let Ok(raw) = ctx.query_gid(port, i) else {
            continue;
        };
        if raw == [0u8; 16] {
            continue;
        }
        let (ty, nd) = sysfs_gid_attrs(sysfs, dev, port, i as u16);
        // A GID without a readable type is an InfiniBand GID (not RoCE) or
        // an entry being torn down; treat it as v1, the layer-2 flavour.
        let gid_type = ty.unwrap_or(GidType::RoceV1);
        if netdev.is_none() {
            netdev = nd;
        }
        gids.push(GidEntry {
            index: i as u16,
            gid: Gid(raw),
            gid_type,
        });
    }
    Ok(PortAttr {
        port_num: port,
        state: map::port_state(pa.state),
        active_mtu: map::mtu(pa.active_mtu),
        gids,
        netdev,
    })
}

fn describe(ctx: &Context, sysfs: &Path, name: &str) -> Result<DeviceInfo> {
    let da = ctx.query_device().map_err(|e| io("ibv_query_device", e))?;
    let mut ports = vec![];
    let mut max_msg = u32::MAX;
    for p in 1..=da.phys_port_cnt {
        ports.push(describe_port(ctx, sysfs, name, p)?);
        if let Ok(pa) = ctx.query_port(p) {
            max_msg = max_msg.min(pa.max_msg_sz);
        }
    }
    Ok(DeviceInfo {
        name: name.to_string(),
        ports,
        max_msg_size: if max_msg == u32::MAX {
            1 << 30
        } else {
            max_msg
        },
        max_inline: DEFAULT_MAX_INLINE,
        max_sends: None,
    })
}

impl VerbsProvider {
    /// [`Provider::devices`] with an explicit library (or why there is none).
    pub fn devices_with(
        &self,
        lib: std::result::Result<&'static ffi::Lib, LoadError>,
    ) -> Result<Vec<DeviceInfo>> {
        let Ok(lib) = lib else {
            return Ok(vec![]);
        };
        let mut out = vec![];
        for name in ffi::device_names(lib).map_err(|e| io("ibv_get_device_list", e))? {
            if let Some(ctx) = Context::open(lib, &name).map_err(|e| io("ibv_open_device", e))? {
                out.push(describe(&ctx, &self.sysfs, &name)?);
            }
        }
        Ok(out)
    }
}

impl Provider for VerbsProvider {
    type Device = VerbsDevice;
    type Pd = VerbsPd;
    type Mr = VerbsMr;
    type Cq = VerbsCq;
    type Channel = VerbsChannel;
    type Qp = VerbsQp;

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        self.devices_with(ffi::lib())
    }

    fn open_device(&self, name: &str) -> Result<VerbsDevice> {
        let lib = ffi::lib().map_err(|_| Error::NoSuchDevice(name.to_string()))?;
        let ctx = Context::open(lib, name)
            .map_err(|e| io("ibv_open_device", e))?
            .ok_or_else(|| Error::NoSuchDevice(name.to_string()))?;
        let info = describe(&ctx, &self.sysfs, name)?;
        Ok(VerbsDevice {
            ctx,
            name: name.to_string(),
            sysfs: self.sysfs.clone(),
            max_msg: info.max_msg_size,
        })
    }
}

/// An opened device.
pub struct VerbsDevice {
    ctx: Arc<Context>,
    name: String,
    sysfs: PathBuf,
    max_msg: u32,
}

impl VerbsDevice {
    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Device for VerbsDevice {
    type P = VerbsProvider;

    fn info(&self) -> DeviceInfo {
        describe(&self.ctx, &self.sysfs, &self.name).unwrap_or(DeviceInfo {
            name: self.name.clone(),
            ports: vec![],
            max_msg_size: self.max_msg,
            max_inline: DEFAULT_MAX_INLINE,
            max_sends: None,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        describe_port(&self.ctx, &self.sysfs, &self.name, port)
    }

    fn alloc_pd(&self) -> Result<VerbsPd> {
        Ok(VerbsPd {
            pd: ffi::Pd::alloc(&self.ctx).map_err(|e| io("ibv_alloc_pd", e))?,
            max_msg: self.max_msg,
        })
    }

    fn create_channel(&self) -> Result<VerbsChannel> {
        Ok(VerbsChannel {
            ch: ffi::Channel::create(&self.ctx).map_err(|e| io("ibv_create_comp_channel", e))?,
        })
    }

    fn create_cq(&self, depth: u32, channel: Option<&VerbsChannel>) -> Result<VerbsCq> {
        if depth == 0 {
            return Err(Error::InvalidArgument("CQ depth 0".into()));
        }
        Ok(VerbsCq {
            cq: ffi::Cq::create(&self.ctx, depth, channel.map(|c| &c.ch))
                .map_err(|e| io("ibv_create_cq", e))?,
            qps: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    fn poll_async_event(&self) -> Option<AsyncEvent> {
        loop {
            let (t, el) = self.ctx.get_async_event()?;
            if let Some(ev) = map::async_event(t, el) {
                return Some(ev);
            }
        }
    }

    fn async_fd(&self) -> BorrowedFd<'_> {
        ffi::borrow_fd(self.ctx.async_fd())
    }
}

/// A protection domain.
pub struct VerbsPd {
    pd: Arc<ffi::Pd>,
    max_msg: u32,
}

impl ProtectionDomain for VerbsPd {
    type P = VerbsProvider;

    fn alloc_mr(&self, len: usize, access: Access) -> Result<VerbsMr> {
        if len == 0 {
            return Err(Error::InvalidArgument("empty memory region".into()));
        }
        // Access bits are verbs' IBV_ACCESS_{LOCAL_WRITE,REMOTE_WRITE,REMOTE_READ}.
        let mr =
            ffi::Mr::alloc(&self.pd, len, access.bits() as i32).map_err(|e| io("ibv_reg_mr", e))?;
        Ok(VerbsMr { mr, access })
    }

    /// `ibv_reg_mr` of `mr`'s memory on this PD: its own keys, the same
    /// address (verbs addresses are virtual addresses).
    fn share_mr(&self, mr: &VerbsMr, access: Access) -> Result<VerbsMr> {
        let shared = ffi::Mr::register_again(&self.pd, &mr.mr, access.bits() as i32)
            .map_err(|e| io("ibv_reg_mr", e))?;
        Ok(VerbsMr { mr: shared, access })
    }

    fn create_qp(&self, send_cq: &VerbsCq, recv_cq: &VerbsCq, cap: QpCap) -> Result<VerbsQp> {
        let want = ffi::ibv_qp_cap {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: cap.max_recv_wr,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: cap.max_inline_data,
        };
        let (qp, got) = ffi::Qp::create(&self.pd, &send_cq.cq, &recv_cq.cq, want)
            .map_err(|e| io("ibv_create_qp", e))?;
        let shared = Arc::new(QpShared {
            state: AtomicU8::new(QpState::Reset as u8),
            port: AtomicU8::new(1),
        });
        let qp_num = qp.qp_num();
        let cqs = [send_cq.qps.clone(), recv_cq.qps.clone()];
        for m in &cqs {
            m.lock()
                .expect("cq registry")
                .insert(qp_num, Arc::downgrade(&shared));
        }
        Ok(VerbsQp {
            qp,
            shared,
            // The limits the caller asked for (the provider may grant more).
            cap: QpCap {
                max_send_wr: got.max_send_wr.min(cap.max_send_wr).max(1),
                max_recv_wr: got.max_recv_wr.min(cap.max_recv_wr).max(1),
                max_inline_data: got.max_inline_data.min(cap.max_inline_data),
            },
            max_msg: self.max_msg,
            cqs,
        })
    }
}

/// A registered memory region (page-aligned anonymous memory).
pub struct VerbsMr {
    mr: ffi::Mr,
    access: Access,
}

impl MemoryRegion for VerbsMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    fn addr(&self) -> u64 {
        self.mr.addr()
    }
    fn len(&self) -> usize {
        self.mr.len()
    }
    fn access(&self) -> Access {
        self.access
    }
    fn read_at(&self, off: usize, buf: &mut [u8]) -> Result<()> {
        check_range(off, buf.len(), self.len())?;
        self.mr.read_at(off, buf);
        Ok(())
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<()> {
        check_range(off, data.len(), self.len())?;
        self.mr.write_at(off, data);
        Ok(())
    }
}

/// A completion channel.
pub struct VerbsChannel {
    ch: Arc<ffi::Channel>,
}

impl CompletionChannel for VerbsChannel {
    fn fd(&self) -> BorrowedFd<'_> {
        ffi::borrow_fd(self.ch.fd())
    }
    fn try_get_event(&self) -> Result<bool> {
        let mut any = false;
        while self.ch.get_event().map_err(|e| io("ibv_get_cq_event", e))? {
            any = true;
        }
        Ok(any)
    }
    fn wait(&self, timeout: Duration) -> Result<bool> {
        if self.try_get_event()? {
            return Ok(true);
        }
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        if ffi::poll_readable(self.ch.fd(), ms)? {
            return self.try_get_event();
        }
        Ok(false)
    }
}

type QpRegistry = Arc<Mutex<HashMap<u32, Weak<QpShared>>>>;

/// A completion queue.
pub struct VerbsCq {
    cq: Arc<ffi::Cq>,
    /// QPs using this CQ, so an error completion marks its QP as ERR at once.
    qps: QpRegistry,
}

fn convert_wc(w: &ibv_wc) -> WorkCompletion {
    let status = map::wc_status(w.status);
    // On errors verbs leaves the opcode undefined; rxe and mlx5 fill it for
    // send completions. Receives of unknown opcode are reported as Recv.
    let opcode = map::wc_opcode(w.opcode).unwrap_or(WcOpcode::Recv);
    WorkCompletion {
        wr_id: w.wr_id,
        status,
        opcode,
        byte_len: w.byte_len,
        imm: (status == WcStatus::Success && w.wc_flags & ffi::IBV_WC_WITH_IMM != 0)
            .then(|| u32::from_be(w.imm_data)),
        qp_num: w.qp_num,
    }
}

impl CompletionQueue for VerbsCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut raw = [ibv_wc::default(); 32];
        let want = out.len().min(raw.len());
        let n = self
            .cq
            .poll(&mut raw[..want])
            .map_err(|e| io("ibv_poll_cq", e))?;
        for (o, w) in out.iter_mut().zip(&raw[..n]) {
            *o = convert_wc(w);
            if o.status != WcStatus::Success {
                if let Some(q) = self
                    .qps
                    .lock()
                    .expect("cq registry")
                    .get(&o.qp_num)
                    .and_then(Weak::upgrade)
                {
                    q.state.store(QpState::Err as u8, Ordering::Release);
                }
            }
        }
        Ok(n)
    }
    fn req_notify(&self) -> Result<()> {
        self.cq.req_notify().map_err(|e| io("ibv_req_notify_cq", e))
    }
}

struct QpShared {
    state: AtomicU8,
    port: AtomicU8,
}

fn state_from_u8(v: u8) -> QpState {
    QpState::ALL
        .into_iter()
        .find(|s| *s as u8 == v)
        .unwrap_or(QpState::Err)
}

/// An RC queue pair.
pub struct VerbsQp {
    qp: ffi::Qp,
    shared: Arc<QpShared>,
    cap: QpCap,
    max_msg: u32,
    cqs: [QpRegistry; 2],
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        let n = self.qp.qp_num();
        for m in &self.cqs {
            if let Ok(mut m) = m.lock() {
                m.remove(&n);
            }
        }
    }
}

/// The `ibv_qp_attr` and attribute mask for one transition (pure; tested).
pub fn qp_attr(m: &QpModify, from: QpState, port: u8) -> (ibv_qp_attr, i32) {
    use ffi::*;
    let mut a = ibv_qp_attr::default();
    let mask;
    match *m {
        QpModify::Init { port, access } => {
            a.qp_state = IBV_QPS_INIT;
            a.pkey_index = 0;
            a.port_num = port;
            a.qp_access_flags = access.bits();
            mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        }
        QpModify::Rtr {
            remote,
            sgid_index,
            rq_psn,
            path_mtu,
            min_rnr_timer,
        } => {
            a.qp_state = IBV_QPS_RTR;
            a.path_mtu = path_mtu.code() as i32;
            a.dest_qp_num = remote.qp_num & 0x00ff_ffff;
            a.rq_psn = rq_psn & 0x00ff_ffff;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = map::rnr_timer_code(min_rnr_timer);
            // RoCE: a global route to the peer's GID; one hop (rxe and mlx5
            // resolve the destination MAC themselves).
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid(remote.gid.0);
            a.ah_attr.grh.sgid_index = sgid_index.min(255) as u8;
            a.ah_attr.grh.hop_limit = 1;
            a.ah_attr.port_num = port;
            mask = IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER;
        }
        QpModify::Rts {
            sq_psn,
            timeout,
            retry_cnt,
            rnr_retry,
        } => {
            a.qp_state = IBV_QPS_RTS;
            if from == QpState::Rts {
                // RTS→RTS: verbs accepts none of the RTR→RTS attributes here.
                mask = IBV_QP_STATE;
            } else {
                a.sq_psn = sq_psn & 0x00ff_ffff;
                a.timeout = map::timeout_code(timeout);
                a.retry_cnt = retry_cnt.min(7);
                a.rnr_retry = rnr_retry.min(7);
                a.max_rd_atomic = 1;
                mask = IBV_QP_STATE
                    | IBV_QP_SQ_PSN
                    | IBV_QP_TIMEOUT
                    | IBV_QP_RETRY_CNT
                    | IBV_QP_RNR_RETRY
                    | IBV_QP_MAX_QP_RD_ATOMIC;
            }
        }
        QpModify::Err => {
            a.qp_state = IBV_QPS_ERR;
            mask = IBV_QP_STATE;
        }
        QpModify::Reset => {
            a.qp_state = IBV_QPS_RESET;
            mask = IBV_QP_STATE;
        }
    }
    (a, mask)
}

/// The `ibv_send_flags` of a work request (`IBV_SEND_INLINE` is added for
/// inline payloads). Every SEND is solicited, as Linux posts its CDC and
/// LLC messages (smc_wr.c `smc_wr_init_sge`: `IB_SEND_SIGNALED |
/// IB_SEND_SOLICITED`; the capture shows SE=1 on every SEND): a kernel peer
/// arms its receive CQ for solicited completions only (smc_wr.c
/// `smc_wr_rx_tasklet_fn`, smc_ib.c `smc_ib_ready_link`:
/// `IB_CQ_SOLICITED_MASK`), so an unsolicited SEND would wait unnoticed in
/// its CQ until something else woke it.
pub fn send_flags(op: &SendOp, signaled: bool) -> u32 {
    let signaled = if signaled { ffi::IBV_SEND_SIGNALED } else { 0 };
    match op {
        SendOp::Send | SendOp::SendWithImm(_) => signaled | ffi::IBV_SEND_SOLICITED,
        SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => signaled,
    }
}

fn post_error(what: &str, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EAGAIN) => Error::QueueFull,
        _ => io(what, e),
    }
}

impl VerbsQp {
    fn cached(&self) -> QpState {
        state_from_u8(self.shared.state.load(Ordering::Acquire))
    }
    /// The capabilities enforced on posts.
    pub fn cap(&self) -> QpCap {
        self.cap
    }
}

impl QueuePair for VerbsQp {
    fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    fn state(&self) -> QpState {
        match self.qp.query_state() {
            Ok(s) => {
                let s = map::qp_state(s);
                self.shared.state.store(s as u8, Ordering::Release);
                s
            }
            Err(_) => self.cached(),
        }
    }

    fn modify(&self, m: &QpModify) -> Result<()> {
        let from = self.state();
        let to = from.next(m.kind())?;
        let port = match m {
            QpModify::Init { port, .. } => *port,
            _ => self.shared.port.load(Ordering::Acquire),
        };
        let (attr, mask) = qp_attr(m, from, port);
        self.qp
            .modify(&attr, mask)
            .map_err(|e| io(&format!("ibv_modify_qp({from:?}->{to:?})"), e))?;
        if let QpModify::Init { port, .. } = m {
            self.shared.port.store(*port, Ordering::Release);
        }
        self.shared.state.store(to as u8, Ordering::Release);
        Ok(())
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let state = self.cached();
        if state != QpState::Rts {
            return Err(Error::InvalidState {
                op: "post_send",
                state,
            });
        }
        validate_send(wr, &self.cap, self.max_msg)?;
        let (opcode, imm, remote_addr, rkey) = match wr.op {
            SendOp::Send => (ffi::IBV_WR_SEND, 0, 0, 0),
            SendOp::SendWithImm(i) => (ffi::IBV_WR_SEND_WITH_IMM, i, 0, 0),
            SendOp::RdmaWrite { remote_addr, rkey } => {
                (ffi::IBV_WR_RDMA_WRITE, 0, remote_addr, rkey)
            }
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => (ffi::IBV_WR_RDMA_WRITE_WITH_IMM, imm, remote_addr, rkey),
        };
        let mut flags = send_flags(&wr.op, wr.signaled);
        let sges: Vec<ibv_sge> = match wr.payload {
            Payload::Sges(s) => s
                .iter()
                .map(|s| ibv_sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                })
                .collect(),
            Payload::Inline(d) => {
                flags |= ffi::IBV_SEND_INLINE;
                if d.is_empty() {
                    vec![]
                } else {
                    // Inline data is copied by the provider during the call.
                    vec![ibv_sge {
                        addr: d.as_ptr() as u64,
                        length: d.len() as u32,
                        lkey: 0,
                    }]
                }
            }
        };
        let spec = ffi::SendSpec {
            wr_id: wr.wr_id,
            opcode,
            flags,
            imm,
            remote_addr,
            rkey,
        };
        self.qp
            .post_send(&spec, &sges)
            .map_err(|e| post_error("ibv_post_send", e))
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let state = self.cached();
        if !state.can_post_recv() {
            return Err(Error::InvalidState {
                op: "post_recv",
                state,
            });
        }
        let sges: Vec<ibv_sge> = wr
            .sges
            .iter()
            .map(|s| ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        self.qp
            .post_recv(wr.wr_id, &sges)
            .map_err(|e| post_error("ibv_post_recv", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::*;

    #[test]
    fn without_rdma_core_there_are_no_devices() {
        let p = VerbsProvider::new();
        // rdma-core not installed: no devices, no error.
        let missing = ffi::Lib::open("/nonexistent/libibverbs.so.1").map(|_| unreachable!());
        assert_eq!(p.devices_with(missing).unwrap(), vec![]);
        // Whatever this machine has (no rdma-core, or rdma-core without
        // kernel RDMA support as here once qemu pulled in libibverbs1, or a
        // real device), devices() succeeds.
        let devs = p.devices().expect("devices() must not fail without RDMA");
        if VerbsProvider::availability().is_err()
            || !std::path::Path::new(SYSFS_INFINIBAND).exists()
        {
            assert!(devs.is_empty(), "{devs:?}");
            assert!(matches!(
                p.open_device("rxe0"),
                Err(Error::NoSuchDevice(n)) if n == "rxe0"
            ));
        }
        for d in &devs {
            assert!(!d.name.is_empty());
        }
    }

    fn gid() -> Gid {
        Gid::from_ip("10.99.0.2".parse().unwrap())
    }

    #[test]
    fn init_attributes() {
        let (a, mask) = qp_attr(
            &QpModify::Init {
                port: 1,
                access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            },
            QpState::Reset,
            1,
        );
        assert_eq!(a.qp_state, IBV_QPS_INIT);
        assert_eq!(a.port_num, 1);
        assert_eq!(a.qp_access_flags, 3);
        assert_eq!(
            mask,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        );
    }

    /// Every SEND is solicited (a kernel peer's receive CQ wakes for
    /// solicited completions only); RDMA WRITEs are not.
    #[test]
    fn sends_are_solicited_as_linux_posts_them() {
        let write = SendOp::RdmaWrite {
            remote_addr: 0,
            rkey: 1,
        };
        assert_eq!(
            send_flags(&SendOp::Send, true),
            IBV_SEND_SIGNALED | IBV_SEND_SOLICITED
        );
        assert_eq!(
            send_flags(&SendOp::SendWithImm(7), false),
            IBV_SEND_SOLICITED
        );
        assert_eq!(send_flags(&write, false), 0);
        assert_eq!(send_flags(&write, true), IBV_SEND_SIGNALED);
    }

    /// The engine's QP timers (`smc-engine` endpoint/link.rs) map to the
    /// codes Linux sets (smc_ib.c: `SMC_QP_MIN_RNR_TIMER` 5,
    /// `SMC_QP_TIMEOUT` 15).
    #[test]
    fn linux_smc_qp_timer_codes() {
        assert_eq!(map::rnr_timer_code(Duration::from_micros(60)), 5);
        assert_eq!(map::timeout_code(Duration::from_nanos(4096 << 15)), 15);
    }

    #[test]
    fn rtr_attributes_roce_global_route() {
        let (a, mask) = qp_attr(
            &QpModify::Rtr {
                remote: RemoteQp {
                    gid: gid(),
                    qp_num: 0x1_000_017,
                },
                sgid_index: 1,
                rq_psn: 0xff_123456,
                path_mtu: Mtu::Mtu1024,
                min_rnr_timer: Duration::from_millis(1),
            },
            QpState::Init,
            2,
        );
        assert_eq!(a.qp_state, IBV_QPS_RTR);
        assert_eq!(a.path_mtu, 3);
        assert_eq!(a.dest_qp_num, 0x17);
        assert_eq!(a.rq_psn, 0x123456);
        assert_eq!(a.min_rnr_timer, 14);
        assert_eq!(a.max_dest_rd_atomic, 1);
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.dgid.0, gid().0);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert_eq!(a.ah_attr.grh.hop_limit, 1);
        assert_eq!(a.ah_attr.port_num, 2);
        for bit in [
            IBV_QP_STATE,
            IBV_QP_AV,
            IBV_QP_PATH_MTU,
            IBV_QP_DEST_QPN,
            IBV_QP_RQ_PSN,
            IBV_QP_MAX_DEST_RD_ATOMIC,
            IBV_QP_MIN_RNR_TIMER,
        ] {
            assert_ne!(mask & bit, 0, "bit {bit:#x}");
        }
        assert_eq!(mask & IBV_QP_SQ_PSN, 0);
    }

    #[test]
    fn rts_attributes_and_rts_to_rts() {
        let m = QpModify::Rts {
            sq_psn: 0x1abcdef,
            timeout: Duration::from_millis(50),
            retry_cnt: 9,
            rnr_retry: 7,
        };
        let (a, mask) = qp_attr(&m, QpState::Rtr, 1);
        assert_eq!(a.qp_state, IBV_QPS_RTS);
        assert_eq!(a.sq_psn, 0xabcdef);
        assert_eq!(a.timeout, 14);
        assert_eq!(a.retry_cnt, 7);
        assert_eq!(a.rnr_retry, 7);
        assert_eq!(a.max_rd_atomic, 1);
        assert_eq!(
            mask,
            IBV_QP_STATE
                | IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC
        );
        let (_, mask) = qp_attr(&m, QpState::Rts, 1);
        assert_eq!(mask, IBV_QP_STATE);
        let (a, mask) = qp_attr(&QpModify::Err, QpState::Rts, 1);
        assert_eq!((a.qp_state, mask), (IBV_QPS_ERR, IBV_QP_STATE));
        let (a, mask) = qp_attr(&QpModify::Reset, QpState::Err, 1);
        assert_eq!((a.qp_state, mask), (IBV_QPS_RESET, IBV_QP_STATE));
    }

    #[test]
    fn completion_conversion() {
        let w = ibv_wc {
            wr_id: 7,
            status: 0,
            opcode: 129,
            byte_len: 0,
            imm_data: 0xdead_beefu32.to_be(),
            qp_num: 17,
            wc_flags: IBV_WC_WITH_IMM,
            ..Default::default()
        };
        let c = convert_wc(&w);
        assert_eq!(c.opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(c.imm, Some(0xdead_beef));
        assert_eq!(c.qp_num, 17);
        let c = convert_wc(&ibv_wc {
            status: 10,
            opcode: 1,
            ..w
        });
        assert_eq!(c.status, WcStatus::RemoteAccessError);
        assert_eq!(c.imm, None);
        assert_eq!(c.opcode, WcOpcode::RdmaWrite);
        let c = convert_wc(&ibv_wc {
            wc_flags: 0,
            opcode: 128,
            ..w
        });
        assert_eq!((c.opcode, c.imm), (WcOpcode::Recv, None));
    }

    #[test]
    fn post_errors() {
        assert!(matches!(
            post_error("x", std::io::Error::from_raw_os_error(libc::ENOMEM)),
            Error::QueueFull
        ));
        assert!(matches!(
            post_error("x", std::io::Error::from_raw_os_error(libc::EINVAL)),
            Error::Io(_)
        ));
    }

    #[test]
    fn sysfs_gid_attributes() {
        let d = std::env::temp_dir().join(format!("smc-verbs-sysfs-{}", std::process::id()));
        let base = d.join("rxe0/ports/1/gid_attrs");
        std::fs::create_dir_all(base.join("types")).unwrap();
        std::fs::create_dir_all(base.join("ndevs")).unwrap();
        std::fs::write(base.join("types/1"), "RoCE v2\n").unwrap();
        std::fs::write(base.join("ndevs/1"), "enp0s2\n").unwrap();
        assert_eq!(
            sysfs_gid_attrs(&d, "rxe0", 1, 1),
            (Some(GidType::RoceV2), Some("enp0s2".into()))
        );
        assert_eq!(sysfs_gid_attrs(&d, "rxe0", 1, 2), (None, None));
        let _ = std::fs::remove_dir_all(&d);
    }
}
