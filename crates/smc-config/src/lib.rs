//! # smc-config — the administrator's tables
//!
//! * [`pnet`] — the PNET table that groups Ethernet interfaces with RDMA device
//!   ports into physical networks (`smc_pnet`, spec `tools.md` §2.3 and §6), and
//!   the device-selection rule built on it.
//! * [`ueid`] — the SMC v2 User Enterprise ID table (`smcr ueid`, `tools.md` §2.5):
//!   SMC-R v2 is offered and accepted only with a UEID shared by both peers.
//! * [`store`] — where the tables live on disk, and safe concurrent updates.
//!
//! The Linux kernel keeps these tables in the kernel, per network namespace. A
//! user-space SMC keeps them in files, one directory per host by default
//! (`/etc/smc-rs`), or per process tree with `SMC_RS_CONFIG_DIR` — which is how
//! two containers or network namespaces get different tables.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod pnet;
pub mod store;
pub mod ueid;
