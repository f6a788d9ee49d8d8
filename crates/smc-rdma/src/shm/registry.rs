//! The rundir registry of the `shm` provider: which device instance owns
//! which GID and which QP number.
//!
//! Several device instances (in one process or in many, in one network
//! namespace or in several, of one user or of several) may be bound to the
//! same interface and so share its GIDs, as processes share the port of a
//! real RNIC. A QP is therefore addressed by (GID, QPN), and QP numbers are
//! unique per rundir (hence host-wide for every GID). The rundir holds:
//!
//! ```text
//! registry.lock                   flock(2)-ed around every change below
//! qpn.next                        allocation cursor (decimal, 24-bit QPN space)
//! <tag>.sock                      one listening socket per device instance,
//!                                 tag = dev-<name>-<pid>-<seq>-<random>
//! gid-<hex>.<tag> -> <tag>.sock   one entry per instance owning the GID
//! qpn-<hex6>      -> <tag>.sock   one entry per live QP number
//! ```
//!
//! * Every entry sits in the rundir itself, which the device creates mode
//!   1777 (world-writable and sticky, like /tmp): any user may add entries,
//!   nobody but its owner (and root) may remove or replace one. The sockets
//!   are mode 0666 and `registry.lock`/`qpn.next` 0666, so processes of
//!   other users can use the device; what they may *get* through it is
//!   decided by the rendezvous secrets (see [`super::wire`]), not by modes.
//!   Nothing here is secret.
//! * Allocation walks the cursor and claims the first free number with an
//!   atomic `symlink`; an existing entry is skipped while its instance is
//!   alive, so a number is never reused while its QP lives, also after the
//!   24-bit space wrapped. The numbers 0 and 1 (special in verbs) and the
//!   top 16 (`0xfffff0..`) are never handed out.
//! * Lookup of (GID, QPN): `qpn-<hex6>` names the owner's socket, and the
//!   owner must have the entry `gid-<hex>.<tag>`. A `gid-<hex>` that is a
//!   link to a socket (a hand-made test peer) is used as is.
//! * Liveness is a non-blocking connect: the socket of a dead process
//!   refuses. Stale entries are removed (under the lock) when a lookup or an
//!   allocation runs into them, and at every device open a sweep removes the
//!   sockets of dead instances and every entry that points at a missing
//!   socket (entries of another user's dead process stay: the sticky bit
//!   protects them; they are skipped). A listener is bound and starts
//!   listening under the lock, so a sweep never mistakes a half-created
//!   socket for a dead one.
//! * The lock is only advisory: whoever can open `registry.lock` can hold
//!   it, so it is waited for a bounded time and then ignored (the atomic
//!   `symlink` keeps numbers unique without it; only reclaiming stale
//!   entries is racy then).
#![forbid(unsafe_code)]

use crate::sys::SeqPacket;
use crate::verbs::Gid;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Lowest QP number handed out.
pub const QPN_MIN: u32 = 2;
/// Highest QP number handed out (the top 16 numbers of the 24-bit space are
/// left unused, so tests and tools can name a QP number that never exists).
pub const QPN_MAX: u32 = 0x00ff_ffef;

/// How long a connect waits for room in a full backlog.
pub const CONNECT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How long `Registry::lock` waits for a lock somebody else holds.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Makes a registry file usable by every user (mode 0666). Only its owner
/// can change the mode; for anybody else's file this fails, harmlessly.
fn share(f: &File) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if f.metadata().is_ok_and(|m| m.mode() & 0o777 != 0o666) {
        let _ = f.set_permissions(std::fs::Permissions::from_mode(0o666));
    }
}

/// Creates `dir` as a rundir if it is missing: mode 1777, so that every
/// user's processes can register in it and none can remove another's
/// entries (see the README's threat model). An existing directory keeps its
/// mode: that is the administrator's choice of who may use the device.
pub fn create_rundir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))
}

/// The registry in one rundir.
#[derive(Debug, Clone)]
pub(crate) struct Registry {
    dir: PathBuf,
}

/// Held while the registry lock is taken.
pub(crate) struct Guard(#[allow(dead_code)] Option<File>);

fn is_stale(link: &Path) -> bool {
    match std::fs::read_link(link) {
        Ok(t) => !SeqPacket::probe(&t),
        Err(_) => false,
    }
}

impl Registry {
    pub(crate) fn new(dir: &Path) -> Registry {
        Registry {
            dir: dir.to_path_buf(),
        }
    }

    /// Takes the registry lock, waiting at most [`LOCK_WAIT`]: anybody who
    /// can use the rundir can also hold the lock, and must not stop the
    /// others for longer. Without it (held too long, or a read-only rundir)
    /// we proceed unlocked: the atomic `symlink` still keeps numbers
    /// unique, only stale-entry reclaiming is racy then.
    pub(crate) fn lock(&self) -> Guard {
        let path = self.dir.join("registry.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path);
        let Ok(f) = f else { return Guard(None) };
        share(&f);
        let start = std::time::Instant::now();
        loop {
            match f.try_lock() {
                Ok(()) => return Guard(Some(f)),
                Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(_) => return Guard(None),
            }
        }
    }

    pub(crate) fn sock_path(&self, tag: &str) -> PathBuf {
        self.dir.join(format!("{tag}.sock"))
    }

    /// The single-owner form `gid-<hex>` (a link to a socket).
    pub(crate) fn gid_link(&self, gid: &Gid) -> PathBuf {
        self.dir.join(format!("gid-{}", gid.to_hex()))
    }

    /// `gid-<hex>.<tag>`: the instance `tag` owns `gid`.
    pub(crate) fn gid_entry(&self, gid: &Gid, tag: &str) -> PathBuf {
        self.dir.join(format!("gid-{}.{tag}", gid.to_hex()))
    }

    pub(crate) fn qpn_path(&self, qpn: u32) -> PathBuf {
        self.dir.join(format!("qpn-{qpn:06x}"))
    }

    /// Makes sure `gid-<hex>.<tag>` links to `sock` for every GID in `gids`.
    /// Returns the entries this call created.
    pub(crate) fn publish(&self, gids: &[Gid], tag: &str, sock: &Path) -> Vec<PathBuf> {
        let missing: Vec<PathBuf> = gids
            .iter()
            .map(|g| self.gid_entry(g, tag))
            .filter(|e| std::fs::symlink_metadata(e).is_err())
            .collect();
        if missing.is_empty() {
            return vec![];
        }
        let _g = self.lock();
        let mut out = vec![];
        for e in missing {
            if std::os::unix::fs::symlink(sock, &e).is_ok() {
                out.push(e);
            }
        }
        out
    }

    /// Removes this instance's GID entries and its socket file.
    pub(crate) fn unpublish(&self, entries: &[PathBuf], sock: &Path) {
        let _g = self.lock();
        for e in entries {
            if std::fs::read_link(e).ok().as_deref() == Some(sock) {
                let _ = std::fs::remove_file(e);
            }
        }
        let _ = std::fs::remove_file(sock);
    }

    /// Allocates a QP number owned by the instance listening at `sock`.
    pub(crate) fn alloc_qpn(&self, sock: &Path) -> io::Result<u32> {
        let _g = self.lock();
        let cursor = self.dir.join("qpn.next");
        let mut n = std::fs::read_to_string(&cursor)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|n| (QPN_MIN..=QPN_MAX).contains(n))
            .unwrap_or(QPN_MIN);
        for _ in QPN_MIN..=QPN_MAX {
            let p = self.qpn_path(n);
            let next = if n >= QPN_MAX { QPN_MIN } else { n + 1 };
            let claimed = match std::os::unix::fs::symlink(sock, &p) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // Reuse a number only if its owner is dead (we hold the
                    // lock, so nobody else reclaims it meanwhile).
                    is_stale(&p)
                        && std::fs::remove_file(&p).is_ok()
                        && std::os::unix::fs::symlink(sock, &p).is_ok()
                }
                Err(e) => return Err(e),
            };
            if claimed {
                if std::fs::write(&cursor, format!("{next}\n")).is_ok() {
                    if let Ok(f) = File::open(&cursor) {
                        share(&f);
                    }
                }
                return Ok(n);
            }
            n = next;
        }
        Err(io::Error::other("the 24-bit QP number space is exhausted"))
    }

    /// Releases `qpn` if it is still registered to `sock`.
    pub(crate) fn release_qpn(&self, qpn: u32, sock: &Path) {
        let _g = self.lock();
        let p = self.qpn_path(qpn);
        if std::fs::read_link(&p).ok().as_deref() == Some(sock) {
            let _ = std::fs::remove_file(&p);
        }
    }

    /// The socket of the instance owning (GID, QPN).
    pub(crate) fn resolve(&self, gid: &Gid, qpn: u32) -> Result<PathBuf, String> {
        let single = self.gid_link(gid);
        if std::fs::symlink_metadata(&single).is_ok_and(|m| m.file_type().is_symlink()) {
            return Ok(single); // single-owner link to a socket
        }
        let sock = std::fs::read_link(self.qpn_path(qpn))
            .map_err(|_| format!("no QP {qpn} is registered in {}", self.dir.display()))?;
        let tag = sock
            .file_stem()
            .and_then(|t| t.to_str())
            .ok_or_else(|| format!("bad registry entry for QP {qpn}"))?;
        if std::fs::symlink_metadata(self.gid_entry(gid, tag)).is_err() {
            return Err(format!(
                "QP {qpn} is not on a device with GID {gid:?} (in {})",
                self.dir.display()
            ));
        }
        Ok(sock)
    }

    /// Connects to the instance owning (GID, QPN). A stale QPN entry (its
    /// owner died) is removed and reported as "no such QP".
    pub(crate) fn connect(&self, gid: &Gid, qpn: u32) -> Result<(SeqPacket, PathBuf), String> {
        let sock = self.resolve(gid, qpn)?;
        match SeqPacket::connect_timeout(&sock, CONNECT_WAIT) {
            Ok(s) => Ok((s, sock)),
            Err(e) => {
                let p = self.qpn_path(qpn);
                if std::fs::read_link(&p).ok().as_deref() == Some(sock.as_path()) {
                    let _g = self.lock();
                    if std::fs::read_link(&p).ok().as_deref() == Some(sock.as_path())
                        && !SeqPacket::probe(&sock)
                    {
                        let _ = std::fs::remove_file(&p);
                    }
                }
                Err(format!(
                    "QP {qpn} of GID {gid:?} is gone ({}: {e})",
                    sock.display()
                ))
            }
        }
    }

    /// Removes the sockets of dead instances and every entry pointing at a
    /// missing socket (as far as we may: another user's entries are
    /// protected by the sticky bit and stay). Call with the lock held.
    pub(crate) fn sweep(&self, _held: &Guard) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut links = vec![];
        let mut old_dirs = vec![];
        for e in rd.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let p = e.path();
            if name.starts_with("dev-") && name.ends_with(".sock") {
                if !SeqPacket::probe(&p) {
                    let _ = std::fs::remove_file(&p);
                }
            } else if name.starts_with("gid-") && e.file_type().is_ok_and(|t| t.is_dir()) {
                // the per-GID directories of earlier versions
                old_dirs.push(p);
            } else if name.starts_with("gid-") || name.starts_with("qpn-") {
                links.push(p);
            }
        }
        for d in &old_dirs {
            if let Ok(rd) = std::fs::read_dir(d) {
                links.extend(rd.flatten().map(|e| e.path()));
            }
        }
        for l in links {
            // A link whose target is gone (`metadata` follows the link).
            if std::fs::symlink_metadata(&l).is_ok_and(|m| m.file_type().is_symlink())
                && std::fs::metadata(&l).is_err()
            {
                let _ = std::fs::remove_file(&l);
            }
        }
        for d in old_dirs {
            let _ = std::fs::remove_dir(d); // only if empty
        }
    }
}
