//! The only module with `unsafe`: a thin run-time binding of rdma-core's
//! `libibverbs.so.1` (x86_64 Linux, rdma-core 44 ABI as shipped by Debian 12).
//!
//! The library is opened with `dlopen` on first use; when it is missing every
//! entry point reports [`LoadError`] and the provider sees "no devices". No
//! header, C compiler or bindgen is needed at build time.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are
//! `static inline` in `<infiniband/verbs.h>`: they call through
//! `ibv_context::ops`, so the structs below mirror the C layouts exactly (the
//! unit tests assert sizes and offsets measured from rdma-core 44's header).
//!
//! Above the raw structs, this module offers small owning handle types
//! ([`Context`], [`Pd`], [`Mr`], [`Channel`], [`Cq`], [`Qp`]) whose methods are
//! safe: they keep what they point into alive (`Arc`) and free it on drop.
#![allow(non_camel_case_types)]
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

// ------------------------------------------------------------ C layouts

/// `union ibv_gid` (16 bytes, 8-byte aligned through its `__be64` view).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid(pub [u8; 16]);

/// `struct ibv_context_ops` (32 function pointers; only the ones the inline
/// data-path functions use are typed).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_context_ops {
    _compat0: [*const c_void; 11],
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    _compat1: [*const c_void; 12],
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    _compat2: [*const c_void; 5],
}

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut c_void,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: [u64; 5],
    pub abi_compat: *mut c_void,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: [u64; 5],
    pub cond: [u64; 6],
    pub events_completed: u32,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: [u64; 5],
    pub cond: [u64; 6],
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (big endian) / `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `rdma` member of `ibv_send_wr::wr` (the union is 32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
    _pad: [u32; 5],
}

/// `struct ibv_send_wr`.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (big endian) / `invalidate_rkey`.
    pub imm_data: u32,
    pub rdma: ibv_send_wr_rdma,
    pub qp_type: u32,
    _pad: u32,
    /// `bind_mw` / `tso` union (48 bytes).
    pub bind_mw: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `struct ibv_async_event`.
#[repr(C)]
pub struct ibv_async_event {
    /// `element` union: cq / qp / srq / wq pointer, or `port_num` (int).
    pub element: *mut c_void,
    pub event_type: c_int,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

impl Default for ibv_device_attr {
    fn default() -> Self {
        // SAFETY: the struct is plain integers and arrays of integers, for
        // which all-zero bytes is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

// Constants (enum values of verbs.h).
pub const IBV_QPT_RC: c_int = 2;
pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_SQD: c_int = 4;
pub const IBV_QPS_SQE: c_int = 5;
pub const IBV_QPS_ERR: c_int = 6;
pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_SEND_SOLICITED: c_uint = 1 << 2;
pub const IBV_SEND_INLINE: c_uint = 1 << 3;
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

// ------------------------------------------------------------ the library

/// Why libibverbs could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rdma-core is not usable: {}", self.0)
    }
}

type Dev = *mut c_void;
type Ctx = *mut ibv_context;

/// Entry points resolved from `libibverbs.so.1`.
pub struct Lib {
    _handle: *mut c_void,
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut Dev,
    free_device_list: unsafe extern "C" fn(*mut Dev),
    get_device_name: unsafe extern "C" fn(Dev) -> *const c_char,
    open_device: unsafe extern "C" fn(Dev) -> Ctx,
    close_device: unsafe extern "C" fn(Ctx) -> c_int,
    query_device: unsafe extern "C" fn(Ctx, *mut ibv_device_attr) -> c_int,
    query_port: unsafe extern "C" fn(Ctx, u8, *mut ibv_port_attr) -> c_int,
    query_gid: unsafe extern "C" fn(Ctx, u8, c_int, *mut ibv_gid) -> c_int,
    alloc_pd: unsafe extern "C" fn(Ctx) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut ibv_mr,
    dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    create_comp_channel: unsafe extern "C" fn(Ctx) -> *mut ibv_comp_channel,
    destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    create_cq:
        unsafe extern "C" fn(Ctx, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq,
    destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    create_qp: unsafe extern "C" fn(*mut c_void, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    query_qp:
        unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
    get_async_event: unsafe extern "C" fn(Ctx, *mut ibv_async_event) -> c_int,
    ack_async_event: unsafe extern "C" fn(*mut ibv_async_event),
}

// SAFETY: `Lib` holds a dlopen handle that is never closed and plain function
// pointers; libibverbs' entry points are thread safe.
unsafe impl Send for Lib {}
// SAFETY: as above; `Lib` has no interior mutability.
unsafe impl Sync for Lib {}

/// The default library name (the soname of rdma-core's libibverbs).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

impl Lib {
    /// Opens `path` and resolves every entry point. The handle is leaked
    /// (libibverbs is never unloaded).
    pub fn open(path: &str) -> Result<Lib, LoadError> {
        let c = CString::new(path).map_err(|_| LoadError(format!("bad path {path:?}")))?;
        // SAFETY: `c` is a valid NUL-terminated string; dlopen has no other
        // preconditions. RTLD_NOW makes missing symbols fail here, not later.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns NULL or a valid C string owned by libc.
            let msg = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    "dlopen failed".to_string()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(LoadError(format!("{path} not loadable ({msg})")));
        }
        macro_rules! sym {
            ($name:literal) => {{
                let n = concat!($name, "\0");
                // SAFETY: `h` is a live handle and `n` is NUL-terminated. The
                // default-version symbol is returned, which is the rdma-core
                // 1.1 ABI the structs above mirror.
                let p = unsafe { libc::dlsym(h, n.as_ptr() as *const c_char) };
                if p.is_null() {
                    return Err(LoadError(format!("{path} lacks {}", $name)));
                }
                // SAFETY: the symbol is the C function of that name in
                // libibverbs whose prototype (verbs.h, rdma-core 44) matches
                // the field type it is assigned to.
                #[allow(clippy::missing_transmute_annotations)]
                unsafe {
                    std::mem::transmute::<*mut c_void, _>(p)
                }
            }};
        }
        Ok(Lib {
            _handle: h,
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_comp_channel: sym!("ibv_create_comp_channel"),
            destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            get_cq_event: sym!("ibv_get_cq_event"),
            ack_cq_events: sym!("ibv_ack_cq_events"),
            create_qp: sym!("ibv_create_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            query_qp: sym!("ibv_query_qp"),
            get_async_event: sym!("ibv_get_async_event"),
            ack_async_event: sym!("ibv_ack_async_event"),
        })
    }
}

static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();

/// The process-wide library: `$SMC_VERBS_LIBIBVERBS` or `libibverbs.so.1`,
/// opened once.
pub fn lib() -> Result<&'static Lib, LoadError> {
    LIB.get_or_init(|| {
        let path = std::env::var("SMC_VERBS_LIBIBVERBS").unwrap_or_else(|_| LIBIBVERBS.into());
        Lib::open(&path)
    })
    .as_ref()
    .map_err(|e| e.clone())
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn rc(r: c_int) -> std::io::Result<()> {
    match r {
        0 => Ok(()),
        // Most verbs return a positive errno; some return -1 and set errno.
        r if r > 0 => Err(std::io::Error::from_raw_os_error(r)),
        _ => Err(errno()),
    }
}

// ------------------------------------------------------------ handles

/// Names of the devices libibverbs sees.
pub fn device_names(lib: &'static Lib) -> std::io::Result<Vec<String>> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        // ENOSYS: rdma-core is installed but the kernel has no RDMA support
        // (no uverbs): that is "no devices", not a failure.
        let e = errno();
        return match e.raw_os_error() {
            Some(libc::ENOMEM) => Err(e),
            _ => Ok(vec![]),
        };
    }
    let mut names = vec![];
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers; the name is a
        // NUL-terminated string owned by the device.
        let name = unsafe {
            let d = *list.add(i);
            CStr::from_ptr((lib.get_device_name)(d))
                .to_string_lossy()
                .into_owned()
        };
        names.push(name);
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (lib.free_device_list)(list) };
    Ok(names)
}

/// An open device (`ibv_context`).
pub struct Context {
    lib: &'static Lib,
    ctx: Ctx,
}

// SAFETY: libibverbs contexts may be used from any thread concurrently.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `name`.
    pub fn open(lib: &'static Lib, name: &str) -> std::io::Result<Option<Arc<Context>>> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer; the list is freed before returning.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            let e = errno();
            return match e.raw_os_error() {
                Some(libc::ENOMEM) => Err(e),
                _ => Ok(None),
            };
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let d = unsafe { *list.add(i) };
            // SAFETY: the name is a NUL-terminated string owned by the device.
            let dn = unsafe { CStr::from_ptr((lib.get_device_name)(d)) };
            if dn.to_bytes() == name.as_bytes() {
                found = Some(d);
                break;
            }
        }
        let result = match found {
            None => Ok(None),
            Some(d) => {
                // SAFETY: `d` is a device of the still-allocated list; the
                // context stays valid after the list is freed.
                let ctx = unsafe { (lib.open_device)(d) };
                if ctx.is_null() {
                    Err(errno())
                } else {
                    // SAFETY: `ctx` is a live context; async_fd is its event fd.
                    let fd = unsafe { (*ctx).async_fd };
                    set_nonblocking(fd)?;
                    Ok(Some(Arc::new(Context { lib, ctx })))
                }
            }
        };
        // SAFETY: freed once; opened contexts do not depend on the list.
        unsafe { (lib.free_device_list)(list) };
        result
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> std::io::Result<ibv_device_attr> {
        let mut a = ibv_device_attr::default();
        // SAFETY: live context, valid out-pointer of the right layout.
        rc(unsafe { (self.lib.query_device)(self.ctx, &mut a) })?;
        Ok(a)
    }

    /// `ibv_query_port` (the exported function fills the `_compat` prefix of
    /// `ibv_port_attr`, which holds every field used here).
    pub fn query_port(&self, port: u8) -> std::io::Result<ibv_port_attr> {
        let mut a = ibv_port_attr::default();
        // SAFETY: live context; `a` is at least as large as the compat struct.
        rc(unsafe { (self.lib.query_port)(self.ctx, port, &mut a) })?;
        Ok(a)
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: i32) -> std::io::Result<[u8; 16]> {
        let mut g = ibv_gid::default();
        // SAFETY: live context, valid 16-byte out buffer.
        rc(unsafe { (self.lib.query_gid)(self.ctx, port, index, &mut g) })?;
        Ok(g.0)
    }

    /// The async event descriptor (non-blocking).
    pub fn async_fd(&self) -> c_int {
        // SAFETY: live context.
        unsafe { (*self.ctx).async_fd }
    }

    /// Takes one async event without blocking: `(event_type, element)` where
    /// element is the port number for port events and the QP number for QP
    /// events, 0 otherwise.
    pub fn get_async_event(&self) -> Option<(c_int, u32)> {
        let mut ev = ibv_async_event {
            element: std::ptr::null_mut(),
            event_type: 0,
        };
        // SAFETY: live context whose async fd is non-blocking; valid out-pointer.
        if unsafe { (self.lib.get_async_event)(self.ctx, &mut ev) } != 0 {
            return None;
        }
        let t = ev.event_type;
        let elem = match t {
            // QP events: element.qp is a live QP until the event is acked.
            1..=7 | 16 => {
                let qp = ev.element as *mut ibv_qp;
                // SAFETY: the QP is kept alive until the ack below.
                if qp.is_null() {
                    0
                } else {
                    unsafe { (*qp).qp_num }
                }
            }
            // Port events: element.port_num (an int in the union's low bytes).
            9..=13 | 17 | 18 => (ev.element as usize as u64 & 0xffff_ffff) as u32,
            _ => 0,
        };
        // SAFETY: acks the event just obtained, exactly once.
        unsafe { (self.lib.ack_async_event)(&mut ev) };
        Some((t, elem))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc of this context, so none is
        // left; closed exactly once.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

fn set_nonblocking(fd: c_int) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own (or that libibverbs owns and
    // expects callers to make non-blocking, as its man pages describe).
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(errno());
        }
    }
    Ok(())
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pd: *mut c_void,
}
// SAFETY: verbs objects are thread safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn alloc(ctx: &Arc<Context>) -> std::io::Result<Arc<Pd>> {
        // SAFETY: live context.
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(errno());
        }
        Ok(Arc::new(Pd {
            ctx: ctx.clone(),
            pd,
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of the PD, so none is left.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}

/// Page-aligned anonymous memory, unmapped when its last registration goes.
struct Mapping {
    base: *mut u8,
    map_len: usize,
}
// SAFETY: the mapping is owned by this value and only unmapped in Drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; nothing is accessed through it here.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping `Mr::alloc` created; every registration
        // of it (each holds this Arc) was deregistered before.
        unsafe { libc::munmap(self.base as *mut c_void, self.map_len) };
    }
}

/// Page-aligned anonymous memory registered as a memory region.
pub struct Mr {
    pd: Arc<Pd>,
    mr: *mut ibv_mr,
    base: *mut u8,
    len: usize,
    map: Arc<Mapping>,
}
// SAFETY: the mapping is owned by this value; concurrent access from the
// NIC is the point of RDMA and is handled by copying through raw pointers.
unsafe impl Send for Mr {}
// SAFETY: as above; read_at/write_at do not create references into the buffer.
unsafe impl Sync for Mr {}

impl Mr {
    /// mmaps `len` zeroed bytes (rounded up to pages) and registers them.
    pub fn alloc(pd: &Arc<Pd>, len: usize, access: c_int) -> std::io::Result<Mr> {
        let page = 4096usize;
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: anonymous private mapping; no file, fresh address.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(errno());
        }
        // SAFETY: live PD; `base..base+len` is mapped for the MR's lifetime
        // (unmapped in Drop after deregistration).
        let mr = unsafe { (pd.ctx.lib.reg_mr)(pd.pd, base, len, access) };
        if mr.is_null() {
            let e = errno();
            // SAFETY: unmapping the mapping created above.
            unsafe { libc::munmap(base, map_len) };
            return Err(e);
        }
        Ok(Mr {
            pd: pd.clone(),
            mr,
            base: base as *mut u8,
            len,
            map: Arc::new(Mapping {
                base: base as *mut u8,
                map_len,
            }),
        })
    }

    /// Registers the memory of `other` (of any PD, any device) in `pd` too:
    /// `ibv_reg_mr` of the same addresses, which yields its own keys.
    pub fn register_again(pd: &Arc<Pd>, other: &Mr, access: c_int) -> std::io::Result<Mr> {
        // SAFETY: live PD; `other.base..+len` stays mapped while this
        // registration lives (it holds the mapping's Arc).
        let mr =
            unsafe { (pd.ctx.lib.reg_mr)(pd.pd, other.base as *mut c_void, other.len, access) };
        if mr.is_null() {
            return Err(errno());
        }
        Ok(Mr {
            pd: pd.clone(),
            mr,
            base: other.base,
            len: other.len,
            map: other.map.clone(),
        })
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }
    /// Virtual address of byte 0 (the iova).
    pub fn addr(&self) -> u64 {
        self.base as u64
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the length is 0 (never: `alloc` maps at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copies out; the caller checked `off + buf.len() <= len`.
    pub fn read_at(&self, off: usize, buf: &mut [u8]) {
        assert!(off.checked_add(buf.len()).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (asserted); `buf` is a distinct Rust buffer. The
        // NIC may write concurrently; bytes are copied, never referenced.
        unsafe {
            smc_rdma::copy::copy_nonoverlapping(self.base.add(off), buf.as_mut_ptr(), buf.len())
        };
    }
    /// Copies in; the caller checked the range.
    pub fn write_at(&self, off: usize, data: &[u8]) {
        assert!(off.checked_add(data.len()).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (asserted); `data` does not alias the mapping.
        unsafe {
            smc_rdma::copy::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len())
        };
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: deregister once; the memory is unmapped when its last
        // registration drops the mapping (`Mapping`'s Drop, after this).
        unsafe {
            (self.pd.ctx.lib.dereg_mr)(self.mr);
        }
    }
}

/// A completion channel.
pub struct Channel {
    ctx: Arc<Context>,
    ch: *mut ibv_comp_channel,
}
// SAFETY: verbs objects are thread safe.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    /// `ibv_create_comp_channel`; the fd is made non-blocking.
    pub fn create(ctx: &Arc<Context>) -> std::io::Result<Arc<Channel>> {
        // SAFETY: live context.
        let ch = unsafe { (ctx.lib.create_comp_channel)(ctx.ctx) };
        if ch.is_null() {
            return Err(errno());
        }
        let c = Arc::new(Channel {
            ctx: ctx.clone(),
            ch,
        });
        set_nonblocking(c.fd())?;
        Ok(c)
    }
    /// The channel's descriptor.
    pub fn fd(&self) -> c_int {
        // SAFETY: live channel.
        unsafe { (*self.ch).fd }
    }
    /// Takes one CQ event without blocking and acks it; true if there was one.
    pub fn get_event(&self) -> std::io::Result<bool> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: live channel with a non-blocking fd; valid out-pointers.
        let r = unsafe { (self.ctx.lib.get_cq_event)(self.ch, &mut cq, &mut cq_ctx) };
        if r != 0 {
            let e = errno();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock => Ok(false),
                _ => Err(e),
            };
        }
        // SAFETY: `cq` is the live CQ the event belongs to (a CQ cannot be
        // destroyed before its events are acked); ack exactly this one.
        unsafe { (self.ctx.lib.ack_cq_events)(cq, 1) };
        Ok(true)
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: CQs bound to the channel hold an Arc of it, so none is left.
        unsafe { (self.ctx.lib.destroy_comp_channel)(self.ch) };
    }
}

/// A completion queue.
pub struct Cq {
    ctx: Arc<Context>,
    _ch: Option<Arc<Channel>>,
    cq: *mut ibv_cq,
}
// SAFETY: verbs objects are thread safe.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// `ibv_create_cq`.
    pub fn create(
        ctx: &Arc<Context>,
        depth: u32,
        ch: Option<&Arc<Channel>>,
    ) -> std::io::Result<Arc<Cq>> {
        let chp = ch.map(|c| c.ch).unwrap_or(std::ptr::null_mut());
        // SAFETY: live context; the channel (if any) outlives the CQ (Arc).
        let cq =
            unsafe { (ctx.lib.create_cq)(ctx.ctx, depth as c_int, std::ptr::null_mut(), chp, 0) };
        if cq.is_null() {
            return Err(errno());
        }
        Ok(Arc::new(Cq {
            ctx: ctx.clone(),
            _ch: ch.cloned(),
            cq,
        }))
    }
    /// `ibv_poll_cq` (inline in verbs.h: through `context->ops.poll_cq`).
    pub fn poll(&self, out: &mut [ibv_wc]) -> std::io::Result<usize> {
        // SAFETY: live CQ; its context's ops table is filled by the provider.
        let f = unsafe { (*(*self.cq).context).ops.poll_cq };
        let f = f.ok_or_else(|| std::io::Error::other("provider has no poll_cq"))?;
        // SAFETY: `out` has room for `out.len()` ibv_wc of the C layout.
        let n = unsafe {
            f(
                self.cq,
                out.len().min(i32::MAX as usize) as c_int,
                out.as_mut_ptr(),
            )
        };
        if n < 0 {
            return Err(std::io::Error::other(format!("poll_cq returned {n}")));
        }
        Ok(n as usize)
    }
    /// `ibv_req_notify_cq(cq, 0)`.
    pub fn req_notify(&self) -> std::io::Result<()> {
        // SAFETY: live CQ; see `poll`.
        let f = unsafe { (*(*self.cq).context).ops.req_notify_cq };
        let f = f.ok_or_else(|| std::io::Error::other("provider has no req_notify_cq"))?;
        // SAFETY: live CQ.
        rc(unsafe { f(self.cq, 0) })
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs using the CQ hold an Arc of it; events are acked as
        // they are read, so destroy does not wait forever.
        unsafe { (self.ctx.lib.destroy_cq)(self.cq) };
    }
}

/// One element of a send work request, in provider-neutral terms.
#[derive(Clone, Copy, Debug)]
pub struct SendSpec {
    pub wr_id: u64,
    pub opcode: c_int,
    pub flags: c_uint,
    /// Host-order immediate (converted to big endian here).
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// An RC queue pair.
pub struct Qp {
    _pd: Arc<Pd>,
    _cqs: [Arc<Cq>; 2],
    lib: &'static Lib,
    qp: *mut ibv_qp,
}
// SAFETY: verbs objects are thread safe.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// `ibv_create_qp` (RC); returns the QP and the capabilities granted.
    pub fn create(
        pd: &Arc<Pd>,
        scq: &Arc<Cq>,
        rcq: &Arc<Cq>,
        cap: ibv_qp_cap,
    ) -> std::io::Result<(Qp, ibv_qp_cap)> {
        let mut ia = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq.cq,
            recv_cq: rcq.cq,
            srq: std::ptr::null_mut(),
            cap,
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: live PD and CQs (kept alive by the Arcs stored below).
        let qp = unsafe { (pd.ctx.lib.create_qp)(pd.pd, &mut ia) };
        if qp.is_null() {
            return Err(errno());
        }
        Ok((
            Qp {
                _pd: pd.clone(),
                _cqs: [scq.clone(), rcq.clone()],
                lib: pd.ctx.lib,
                qp,
            },
            ia.cap,
        ))
    }
    /// QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }
    /// `ibv_modify_qp`.
    pub fn modify(&self, attr: &ibv_qp_attr, mask: c_int) -> std::io::Result<()> {
        let mut a = *attr;
        // SAFETY: live QP; `a` is a full ibv_qp_attr.
        rc(unsafe { (self.lib.modify_qp)(self.qp, &mut a, mask) })
    }
    /// `ibv_query_qp(IBV_QP_STATE)`: the kernel's view of the state.
    pub fn query_state(&self) -> std::io::Result<c_int> {
        let mut a = ibv_qp_attr::default();
        let mut ia = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: std::ptr::null_mut(),
            recv_cq: std::ptr::null_mut(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap::default(),
            qp_type: 0,
            sq_sig_all: 0,
        };
        // SAFETY: live QP; valid out-pointers.
        rc(unsafe { (self.lib.query_qp)(self.qp, &mut a, IBV_QP_STATE, &mut ia) })?;
        Ok(a.qp_state)
    }
    /// `ibv_post_send` of one WR (inline in verbs.h: `context->ops.post_send`).
    /// With `IBV_SEND_INLINE`, the SGEs point at caller memory that is copied
    /// during the call.
    pub fn post_send(&self, s: &SendSpec, sges: &[ibv_sge]) -> std::io::Result<()> {
        let mut sg: Vec<ibv_sge> = sges.to_vec();
        let mut wr = ibv_send_wr {
            wr_id: s.wr_id,
            next: std::ptr::null_mut(),
            sg_list: if sg.is_empty() {
                std::ptr::null_mut()
            } else {
                sg.as_mut_ptr()
            },
            num_sge: sg.len() as c_int,
            opcode: s.opcode,
            send_flags: s.flags,
            imm_data: s.imm.to_be(),
            rdma: ibv_send_wr_rdma {
                remote_addr: s.remote_addr,
                rkey: s.rkey,
                _pad: [0; 5],
            },
            qp_type: 0,
            _pad: 0,
            bind_mw: [0; 6],
        };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; its context's ops table is the provider's.
        let f = unsafe { (*(*self.qp).context).ops.post_send };
        let f = f.ok_or_else(|| std::io::Error::other("provider has no post_send"))?;
        // SAFETY: `wr` and `sg` live across the call; inline data and SGE
        // addresses are consumed (copied or registered) by the provider.
        rc(unsafe { f(self.qp, &mut wr, &mut bad) })
    }
    /// `ibv_post_recv` of one WR.
    pub fn post_recv(&self, wr_id: u64, sges: &[ibv_sge]) -> std::io::Result<()> {
        let mut sg: Vec<ibv_sge> = sges.to_vec();
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: if sg.is_empty() {
                std::ptr::null_mut()
            } else {
                sg.as_mut_ptr()
            },
            num_sge: sg.len() as c_int,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; see post_send.
        let f = unsafe { (*(*self.qp).context).ops.post_recv };
        let f = f.ok_or_else(|| std::io::Error::other("provider has no post_recv"))?;
        // SAFETY: `wr` and `sg` live across the call.
        rc(unsafe { f(self.qp, &mut wr, &mut bad) })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let d = QpDestroy {
            lib: self.lib,
            qp: self.qp,
            _pd: self._pd.clone(),
            _cqs: self._cqs.clone(),
        };
        // Not on the caller's path: the engine drops a failed link's QP
        // under its device lock, and Soft-RoCE's destroy can wait for the
        // QP's last references, e.g. packets still queued on a netdev that
        // went down (rxe_verbs.c `rxe_destroy_qp`, rxe_pool.c
        // `__rxe_cleanup`, with a timeout of its own), and with it every
        // connection of the device would wait. Linux takes a link down
        // from a worker too (smc_core.c `smcr_link_down_cond_sched`).
        match reaper() {
            Some(tx) => {
                let tx = tx.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(std::sync::mpsc::SendError(d)) = tx.send(d) {
                    d.run();
                }
            }
            None => d.run(),
        }
    }
}

/// A QP to destroy, with the PD and CQs it needs alive until then.
struct QpDestroy {
    lib: &'static Lib,
    qp: *mut ibv_qp,
    _pd: Arc<Pd>,
    _cqs: [Arc<Cq>; 2],
}
// SAFETY: verbs objects are thread safe; the QP is no longer used by
// anyone but this value's owner.
unsafe impl Send for QpDestroy {}

impl QpDestroy {
    fn run(self) {
        // SAFETY: destroyed once (its `Qp` is gone); the PD and CQs outlive
        // it (the Arcs, dropped after this call).
        unsafe { (self.lib.destroy_qp)(self.qp) };
    }
}

/// The thread that destroys QPs (started at the first destroy; `None` if
/// it cannot start: then the caller destroys).
fn reaper() -> Option<&'static std::sync::Mutex<std::sync::mpsc::Sender<QpDestroy>>> {
    static REAPER: OnceLock<Option<std::sync::Mutex<std::sync::mpsc::Sender<QpDestroy>>>> =
        OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<QpDestroy>();
            std::thread::Builder::new()
                .name("smc-verbs-reap".into())
                .spawn(move || {
                    for d in rx {
                        d.run();
                    }
                })
                .ok()
                .map(|_| std::sync::Mutex::new(tx))
        })
        .as_ref()
}

/// Waits up to `timeout_ms` for `fd` to become readable.
pub fn poll_readable(fd: c_int, timeout_ms: i32) -> std::io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r < 0 {
        let e = errno();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(r > 0)
}

/// A borrowed descriptor for the trait's `BorrowedFd` accessors.
pub fn borrow_fd<'a>(fd: c_int) -> std::os::fd::BorrowedFd<'a> {
    // SAFETY: callers pass descriptors owned by libibverbs objects that live
    // at least as long as the borrow ('a is tied to &self by the caller).
    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets measured with gcc from rdma-core 44's verbs.h (x86_64).
    #[test]
    fn layouts_match_rdma_core_44() {
        assert_eq!(size_of::<ibv_context_ops>(), 256);
        assert_eq!(offset_of!(ibv_context_ops, poll_cq), 88);
        assert_eq!(offset_of!(ibv_context_ops, req_notify_cq), 96);
        assert_eq!(offset_of!(ibv_context_ops, post_send), 200);
        assert_eq!(offset_of!(ibv_context_ops, post_recv), 208);
        assert_eq!(size_of::<ibv_context>(), 328);
        assert_eq!(offset_of!(ibv_context, ops), 8);
        assert_eq!(offset_of!(ibv_context, cmd_fd), 264);
        assert_eq!(offset_of!(ibv_context, async_fd), 268);
        assert_eq!(offset_of!(ibv_context, mutex), 280);
        assert_eq!(offset_of!(ibv_context, abi_compat), 320);
        assert_eq!(size_of::<ibv_qp>(), 160);
        assert_eq!(offset_of!(ibv_qp, qp_num), 52);
        assert_eq!(offset_of!(ibv_qp, state), 56);
        assert_eq!(offset_of!(ibv_qp, mutex), 64);
        assert_eq!(offset_of!(ibv_qp, cond), 104);
        assert_eq!(offset_of!(ibv_qp, events_completed), 152);
        assert_eq!(size_of::<ibv_cq>(), 128);
        assert_eq!(offset_of!(ibv_cq, channel), 8);
        assert_eq!(offset_of!(ibv_cq, cqe), 28);
        assert_eq!(offset_of!(ibv_cq, comp_events_completed), 120);
        assert_eq!(size_of::<ibv_comp_channel>(), 16);
        assert_eq!(offset_of!(ibv_comp_channel, fd), 8);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(offset_of!(ibv_wc, byte_len), 20);
        assert_eq!(offset_of!(ibv_wc, imm_data), 24);
        assert_eq!(offset_of!(ibv_wc, qp_num), 28);
        assert_eq!(offset_of!(ibv_wc, wc_flags), 36);
        assert_eq!(offset_of!(ibv_wc, sl), 44);
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(offset_of!(ibv_send_wr, opcode), 28);
        assert_eq!(offset_of!(ibv_send_wr, send_flags), 32);
        assert_eq!(offset_of!(ibv_send_wr, imm_data), 36);
        assert_eq!(offset_of!(ibv_send_wr, rdma), 40);
        assert_eq!(offset_of!(ibv_send_wr, qp_type), 72);
        assert_eq!(offset_of!(ibv_send_wr, bind_mw), 80);
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ibv_qp_cap>(), 20);
        assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!(offset_of!(ibv_qp_init_attr, cap), 32);
        assert_eq!(offset_of!(ibv_qp_init_attr, qp_type), 52);
        assert_eq!(offset_of!(ibv_qp_init_attr, sq_sig_all), 56);
        assert_eq!(size_of::<ibv_global_route>(), 24);
        assert_eq!(size_of::<ibv_ah_attr>(), 32);
        assert_eq!(offset_of!(ibv_ah_attr, is_global), 29);
        assert_eq!(offset_of!(ibv_ah_attr, port_num), 30);
        assert_eq!(size_of::<ibv_qp_attr>(), 144);
        assert_eq!(offset_of!(ibv_qp_attr, cap), 36);
        assert_eq!(offset_of!(ibv_qp_attr, ah_attr), 56);
        assert_eq!(offset_of!(ibv_qp_attr, alt_ah_attr), 88);
        assert_eq!(offset_of!(ibv_qp_attr, pkey_index), 120);
        assert_eq!(offset_of!(ibv_qp_attr, max_dest_rd_atomic), 127);
        assert_eq!(offset_of!(ibv_qp_attr, min_rnr_timer), 128);
        assert_eq!(offset_of!(ibv_qp_attr, timeout), 130);
        assert_eq!(offset_of!(ibv_qp_attr, rnr_retry), 132);
        assert_eq!(offset_of!(ibv_qp_attr, rate_limit), 136);
        assert_eq!(size_of::<ibv_port_attr>(), 52);
        assert_eq!(offset_of!(ibv_port_attr, gid_tbl_len), 12);
        assert_eq!(offset_of!(ibv_port_attr, max_msg_sz), 20);
        assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
        assert_eq!(offset_of!(ibv_port_attr, port_cap_flags2), 48);
        assert_eq!(size_of::<ibv_async_event>(), 16);
        assert_eq!(offset_of!(ibv_async_event, event_type), 8);
        assert_eq!(size_of::<ibv_device_attr>(), 232);
        assert_eq!(offset_of!(ibv_device_attr, max_qp_wr), 112);
        assert_eq!(offset_of!(ibv_device_attr, max_sge), 120);
        assert_eq!(offset_of!(ibv_device_attr, max_cqe), 132);
        assert_eq!(offset_of!(ibv_device_attr, phys_port_cnt), 227);
        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!(offset_of!(ibv_mr, lkey), 36);
        assert_eq!(offset_of!(ibv_mr, rkey), 40);
    }

    #[test]
    fn missing_library_is_a_load_error() {
        let e = Lib::open("/nonexistent/libibverbs.so.1")
            .err()
            .expect("must fail");
        assert!(e.0.contains("not loadable"), "{e}");
        // A library without the verbs symbols is rejected too.
        match Lib::open("libc.so.6") {
            Err(e) => assert!(e.0.contains("lacks ibv_get_device_list"), "{e}"),
            Ok(_) => panic!("libc accepted as libibverbs"),
        }
    }
}
