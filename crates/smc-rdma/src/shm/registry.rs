//! The rundir registry of the `shm` provider: which device instance owns
//! which GID and which QP number.
//!
//! Several device instances (in one process or in many, in one network
//! namespace or in several) may be bound to the same interface and so share
//! its GIDs, as processes share the port of a real RNIC. A QP is therefore
//! addressed by (GID, QPN), and QP numbers are unique per rundir (hence
//! host-wide for every GID). The rundir holds:
//!
//! ```text
//! registry.lock                 flock(2)-ed around every change below
//! qpn.next                      allocation cursor (decimal, 24-bit QPN space)
//! <tag>.sock                    one listening socket per device instance,
//!                               tag = dev-<name>-<pid>-<seq>-<random>
//! gid-<hex>/<tag>  -> <tag>.sock   one entry per instance owning the GID
//! qpn-<hex6>       -> <tag>.sock   one entry per live QP number
//! ```
//!
//! * Allocation walks the cursor and claims the first free number with an
//!   atomic `symlink`; an existing entry is skipped while its instance is
//!   alive, so a number is never reused while its QP lives, also after the
//!   24-bit space wrapped. The numbers 0 and 1 (special in verbs) and the
//!   top 16 (`0xfffff0..`) are never handed out.
//! * Lookup of (GID, QPN): `qpn-<hex6>` names the owner's socket, and the
//!   owner must have an entry in `gid-<hex>/`. A `gid-<hex>` that is a link
//!   to a socket instead of a directory (the single-owner form of earlier
//!   versions, or a hand-made test peer) is used as is.
//! * Liveness is a non-blocking connect: the socket of a dead process
//!   refuses. Stale entries are removed (under the lock) when a lookup or an
//!   allocation runs into them, and at every device open a sweep removes the
//!   sockets of dead instances and every entry that points at a missing
//!   socket. A listener is bound and starts listening under the lock, so a
//!   sweep never mistakes a half-created socket for a dead one.
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

    /// Takes the registry lock (blocking). If the lock file cannot be
    /// opened (read-only rundir), proceeds unlocked: the atomic `symlink`
    /// still keeps numbers unique, only stale-entry reclaiming is racy then.
    pub(crate) fn lock(&self) -> Guard {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("registry.lock"));
        match f {
            Ok(f) => match f.lock() {
                Ok(()) => Guard(Some(f)),
                Err(_) => Guard(None),
            },
            Err(_) => Guard(None),
        }
    }

    pub(crate) fn sock_path(&self, tag: &str) -> PathBuf {
        self.dir.join(format!("{tag}.sock"))
    }

    pub(crate) fn gid_dir(&self, gid: &Gid) -> PathBuf {
        self.dir.join(format!("gid-{}", gid.to_hex()))
    }

    pub(crate) fn qpn_path(&self, qpn: u32) -> PathBuf {
        self.dir.join(format!("qpn-{qpn:06x}"))
    }

    /// Makes sure `gid-<hex>/<tag>` links to `sock` for every GID in `gids`.
    /// Returns the entries this call created.
    pub(crate) fn publish(&self, gids: &[Gid], tag: &str, sock: &Path) -> Vec<PathBuf> {
        let missing: Vec<&Gid> = gids
            .iter()
            .filter(|g| std::fs::symlink_metadata(self.gid_dir(g).join(tag)).is_err())
            .collect();
        if missing.is_empty() {
            return vec![];
        }
        let _g = self.lock();
        let mut out = vec![];
        for g in missing {
            let d = self.gid_dir(g);
            if let Ok(m) = std::fs::symlink_metadata(&d) {
                if !m.is_dir() {
                    // The single-owner form of earlier versions: replaced, as
                    // the last opener replaced it then.
                    let _ = std::fs::remove_file(&d);
                }
            }
            let _ = std::fs::create_dir(&d);
            let e = d.join(tag);
            let _ = std::fs::remove_file(&e);
            if std::os::unix::fs::symlink(sock, &e).is_ok() {
                out.push(e);
            }
        }
        out
    }

    /// Removes this instance's GID entries (and GID directories left empty)
    /// and its socket file.
    pub(crate) fn unpublish(&self, entries: &[PathBuf], sock: &Path) {
        let _g = self.lock();
        for e in entries {
            if std::fs::read_link(e).ok().as_deref() == Some(sock) {
                let _ = std::fs::remove_file(e);
                if let Some(d) = e.parent() {
                    let _ = std::fs::remove_dir(d); // only if empty
                }
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
                let _ = std::fs::write(&cursor, format!("{next}\n"));
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
        let d = self.gid_dir(gid);
        match std::fs::symlink_metadata(&d) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Ok(d), // single-owner link to a socket
            Err(e) => {
                return Err(format!(
                    "no device with GID {gid:?} at {}: {e}",
                    d.display()
                ))
            }
        }
        let sock = std::fs::read_link(self.qpn_path(qpn))
            .map_err(|_| format!("no QP {qpn} is registered in {}", self.dir.display()))?;
        let tag = sock
            .file_stem()
            .ok_or_else(|| format!("bad registry entry for QP {qpn}"))?;
        if std::fs::symlink_metadata(d.join(tag)).is_err() {
            return Err(format!("QP {qpn} is not on a device with GID {gid:?}"));
        }
        Ok(sock)
    }

    /// Connects to the instance owning (GID, QPN). A stale QPN entry (its
    /// owner died) is removed and reported as "no such QP".
    pub(crate) fn connect(&self, gid: &Gid, qpn: u32) -> Result<(SeqPacket, PathBuf), String> {
        let sock = self.resolve(gid, qpn)?;
        match SeqPacket::connect(&sock) {
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
    /// missing socket. Call with the lock held.
    pub(crate) fn sweep(&self, _held: &Guard) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut gid_dirs = vec![];
        let mut links = vec![];
        for e in rd.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let p = e.path();
            if name.starts_with("dev-") && name.ends_with(".sock") {
                if !SeqPacket::probe(&p) {
                    let _ = std::fs::remove_file(&p);
                }
            } else if name.starts_with("gid-") {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    gid_dirs.push(p);
                }
            } else if name.starts_with("qpn-") {
                links.push(p);
            }
        }
        for d in &gid_dirs {
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
        for d in gid_dirs {
            let _ = std::fs::remove_dir(d); // only if empty
        }
    }
}
