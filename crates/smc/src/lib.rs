//! # smc — SMC sockets that behave like `std::net` TCP sockets
//!
//! [`SmcListener`] and [`SmcStream`] mirror `TcpListener` and `TcpStream`. Every
//! connection starts as TCP whose SYN and SYN-ACK carry the SMC experimental
//! option (kind 254, ExID `0xE2D4C3D9`), written by the host's rendezvous BPF
//! program (`smc-bpf`) exactly as the Linux kernel's AF_SMC does. Only if both
//! SYNs carried it does the CLC handshake run on the connection; otherwise, or if
//! the handshake declines, the connection simply continues as TCP and
//! [`SmcStream::mode`] records why, with the 32-bit reason code smc-tools shows
//! (`protocol-clc.md` §2.4, §4.1).
//!
//! SMC-R runs over two kinds of device ([`provider`]), one endpoint per
//! device, both kinds at once in one process:
//! * RNICs and Soft-RoCE through libibverbs (`smc-verbs`, loaded at run
//!   time): every device libibverbs lists. Without rdma-core there are none,
//!   which is no error.
//! * Shared-memory devices (`smc-rdma`'s `shm` provider), declared in the
//!   file named by `SMC_RDMA_SHM_CONFIG` and bound to interfaces. A
//!   shared-memory device reaches only processes of this host: those that
//!   share its rundir, also in other network namespaces. So it serves a
//!   connection only if the peer's address is one of our network namespace,
//!   or a shared-memory device of our rundir has registered it (its
//!   interface has that address); a peer elsewhere gets no Proposal from us
//!   over it, and its Proposal is declined at once with "no SMC device". A
//!   listener opens its shared-memory devices when it is bound, so that
//!   clients in other namespaces find them registered from the first
//!   connection on. A shm device declared with the name of a verbs device
//!   hides that verbs device.
//!
//! A connection uses the device Linux would choose (smc_pnet.c
//! `smc_pnet_find_roce_resource`): its local address's interface (walked down
//! to its base interface) has a PNET ID in the PNET table, and the first
//! active port with that PNET ID is taken; without a PNET ID, the first active
//! port whose own interface it is (`rxe0` on `enp0s2` serves `enp0s2`, no
//! table needed), or that carries the connection's RoCE v2 GID
//! (`::ffff:a.b.c.d`, the local IPv4 address). A port qualifies only with a
//! GID the connection can use: a RoCE v1 GID for SMC-R v1, that RoCE v2 GID
//! (and a UEID) for SMC-R v2. Shared-memory devices come before verbs devices
//! in that order; for a peer elsewhere the first device that is not a
//! shared-memory device is taken. Without a device the connection declines
//! with "no SMC device" and stays on TCP. The data path is the `smc-engine`
//! endpoint; reads and writes run it in the application's thread.
//!
//! [`SmcListener`] runs the CLC handshakes of its connections in a driver
//! thread of its own, all at once and apart from `accept()`, which takes
//! finished connections (SMC-R or fallback) from a bounded queue, as Linux's
//! listen worker does: a client that stays silent delays no one else.
//!
//! An established SMC-R connection's TCP socket stays open as long as the
//! connection and is watched for its end: a peer whose TCP connection goes
//! away without an SMC close has its connection reset after the engine's 1 s
//! grace (Linux aborts an SMC connection whose TCP connection ends), so
//! readers and writers get `ConnectionReset` and nothing is left behind.
//!
//! Each process is an SMC host of its own: its system ID's instance is unique
//! among the live processes sharing the device directory (a lock file per
//! instance), so that a server never takes two processes for one peer.
//!
//! Closing (dropping the last handle of) an SMC-R `SmcStream` blocks until its
//! unsent data and the close have been handed to the device — at most about
//! 3 s (Linux's close() blocks up to its 2 s `SMC_MAX_STREAM_WAIT_TIMEOUT`).
//! After that the engine goes on sending in the background while the peer
//! takes data, and aborts the connection when the peer takes none for 30 s:
//! written data is never dropped before a clean close, its reader gets an
//! error instead. A kernel socket's data outlives its process; a user-space
//! connection's would not, so a process may exit right after closing. The
//! tokio adapter's drop does not block; `shutdown().await` completes once the
//! data and the shutdown have left.
//!
//! `fork()`: a child process calls [`after_fork_in_child`] before it uses
//! the library; it then has a library state of its own, and the streams and
//! listeners it inherited are the parent's (`ENOTCONN` in the child, and
//! dropped without effect on the parent's connection).
//!
//! Beside `Read`/`Write`, [`SmcStream::write_in_place`] and
//! [`SmcStream::read_in_place`] move bytes without the library's copy: the
//! first lends the place in the peer's RMB where the next bytes go, the
//! second the received bytes where they lie in our RMB, each committed by the
//! length the caller used ([`WriteSpace`], [`ReadSpace`]: copies, or a file,
//! pipe or socket read into or written from the RMB by the kernel). Where a
//! connection cannot lend its memory (TCP fallback, an RNIC) the same calls
//! go through a buffer. The tokio adapter has both too.
//!
//! With the cargo feature `tokio`, the `tokio` module has async
//! `SmcStream`/`SmcListener` (`AsyncRead`/`AsyncWrite`, `accept().await`) that
//! run the endpoint in the task's poll and sleep in tokio's reactor.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod ctx;
pub mod deferred;
mod fork;
mod handshake;
mod listen;
pub mod provider;
mod readiness;
pub mod registry;
mod rendezvous;
mod stream;
mod sysid;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use ctx::{redundancy, state, DeviceState};
pub use fork::after_fork_in_child;
pub use listen::SmcListener;
pub use stream::{Fallback, Mode, ReadSpace, SmcStream, WriteSpace};

/// The process is about to exit (the preload library's `atexit` handler
/// says so): from now on the close of an SMC-R connection with data not yet
/// written to the peer waits until it is, or until the peer took none of
/// it for 30 s (when the engine of a process that lived on would abort the
/// connection), not 3 s in all. The connection's data is in this process,
/// and leaves with it; over TCP the kernel delivers what a process wrote
/// after it exited, so a program that writes and exits (a client that
/// sends a file, a server's last response) loses nothing to a peer that
/// reads late or slowly.
pub fn exiting() {
    stream::EXITING.store(true, std::sync::atomic::Ordering::Release);
}

/// Opts the TCP socket `fd` in to the SMC option on its SYN (or SYN-ACK),
/// before its `connect()` or `listen()`, through the host's rendezvous
/// program. Returns whether it is opted in (`false`: no rendezvous on this
/// host, its connections will use TCP). For programs that create their
/// sockets themselves; see [`SmcStream::from_connected`] and
/// [`SmcListener::from_listening`].
pub fn opt_in(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    rendezvous::rendezvous().is_ok_and(|r| r.opt_in(fd).is_ok())
}

/// Whether `fd` (a TCP socket, e.g. a listening one a process inherited
/// across exec) is opted in to the SMC SYN option and has no connection
/// yet: a listener on it answers SYNs with the option.
pub fn is_opted_in(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    rendezvous::rendezvous()
        .is_ok_and(|r| matches!(r.status(fd), Ok(smc_bpf::SocketStatus::OptedIn)))
}

/// Takes the SMC option away from the listening socket `fd` if it is opted in (see
/// [`is_opted_in`]): from now on its SYN-ACKs carry none and its clients use plain TCP
/// (`smc_bpf::Rendezvous::opt_out_listener`). For a listening socket about to be inherited by
/// a program that will not run the CLC handshake. Returns whether it was opted in.
pub fn opt_out_listener(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    rendezvous::rendezvous().is_ok_and(|r| r.opt_out_listener(fd).unwrap_or(false))
}

/// Undoes [`opt_out_listener`].
pub fn opt_in_listener_again(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    rendezvous::rendezvous().is_ok_and(|r| r.opt_in_listener_again(fd).is_ok())
}

/// Asks for an RMB of at least `rmb` bytes and a send buffer of at least
/// `sndbuf` bytes for this process's SMC-R connections whose handshakes
/// start from now on (`None`: the default, a 4 MiB RMB, or 64 KiB for a
/// connection that joins others holding 8 MiB of RMBs already, and a 1 MiB
/// send buffer; or `SMC_RMB_KIB` / `SMC_SNDBUF_KIB` for every connection).
/// As a socket's `SO_RCVBUF` and `SO_SNDBUF` size an SMC socket's buffers in
/// Linux (smc_core.c `__smc_buf_create`), each is rounded up to a size class
/// (a power of two, 16 KiB the least); the RMB's size is what the peer
/// learns in the CLC handshake. `smc_run -r SIZE` / `-t SIZE` (`SMC_RCVBUF`
/// / `SMC_SNDBUF`) come here. A smaller RMB keeps request/response traffic
/// in the caches; a larger one lets a one-way stream run further ahead of
/// its reader (the README's Performance section has both).
pub fn set_buffer_sizes(rmb: Option<usize>, sndbuf: Option<usize>) {
    ctx::ASKED.set((rmb, sndbuf));
}

/// smc-rs's own fallback reason for "the SYN option could not be used on this
/// host" (no BPF privilege, no cgroup2, ...). Not a Linux code: the kernel
/// always has its option.
pub const FALLBACK_NO_RENDEZVOUS: u32 = 0x0301_0100;

/// For demos and benchmarks: unless `SMC_RDMA_SHM_CONFIG` already names a
/// device configuration, declares a shared-memory device bound to `lo` under
/// `$TMPDIR/<tag>` and points this process (and the processes it starts) at it
/// through `SMC_RDMA_SHM_CONFIG` and, if unset, `SMC_RS_CONFIG_DIR`. Call it
/// before the first connection (the configuration is read once per process)
/// and while no other thread reads the environment.
pub fn use_loopback_device(tag: &str) {
    if std::env::var_os("SMC_RDMA_SHM_CONFIG").is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(tag);
    // The rundir as the shm device makes it (1777): a process of another user
    // (one that dropped root, say) must be able to register there too.
    let _ = std::fs::create_dir_all(&dir);
    let run = dir.join("run");
    let _ = smc_rdma::shm::registry::create_rundir(&run);
    // One of ours that an earlier build made with the umask's mode: repaired
    // (this directory is the demo's and the tests', no administrator's choice).
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if let Ok(m) = std::fs::metadata(&run) {
            if m.uid() == rustix::process::geteuid().as_raw() && m.mode() & 0o7777 != 0o1777 {
                let _ = std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o1777));
            }
        }
    }
    let _ = std::fs::create_dir_all(dir.join("conf"));
    let cfg = dir.join("shm.conf");
    let text = format!(
        "rundir {}\ndevice shm-lo netdev lo\n",
        dir.join("run").display()
    );
    // Processes started together all get here: one that reads the file
    // while another rewrites it in place would find it empty or cut short
    // (and go without a device for its whole life). So the file is written
    // only if it differs, and then whole: a private temporary file renamed
    // over it (rename(2) replaces atomically).
    if std::fs::read_to_string(&cfg).ok().as_deref() != Some(text.as_str()) {
        let tmp = dir.join(format!(".shm.conf.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, &text).is_ok() && std::fs::rename(&tmp, &cfg).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    std::env::set_var("SMC_RDMA_SHM_CONFIG", &cfg);
    if std::env::var_os("SMC_RS_CONFIG_DIR").is_none() {
        std::env::set_var("SMC_RS_CONFIG_DIR", dir.join("conf"));
    }
}
