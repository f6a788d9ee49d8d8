//! The instance part of this process's SMC system ID.
//!
//! A system ID is two bytes of instance and the MAC of the RoCE port
//! (Linux's `local_systemid`, smc_ib.c: `smc_ib_init_local_systemid` draws the
//! two bytes at random, `smc_ib_define_local_systemid` copies the MAC). A
//! server takes Proposals with the same system ID and GID for the same peer
//! and offers them its link group with that peer (af_smc.c
//! `smc_listen_work` → smc_core.c `smc_conn_create`). Linux has one system
//! ID per host; here every process is an SMC host of its own, with its own
//! link groups, and they all share the GIDs of the device's interface. Two
//! live processes with one system ID would be taken for one peer: the second
//! would be offered the first's link group and have to decline it with
//! SYNCERR, which terminates that group for the first too.
//!
//! So the instance is unique among the live processes sharing a device
//! directory (every process that can reach another over the shm device
//! shares its rundir): it is a random number whose lock file,
//! `<rundir>/system-ids/<hex>`, this process holds an exclusive `flock` on
//! while it lives. A taken number is passed over; a dead process's lock is
//! gone with it. Numbers are drawn at random so that a process seldom
//! inherits the number of one that died a moment ago, whose link groups a
//! server may not yet have ended.

use rustix::fs::{FlockOperation, Mode, OFlags};
use std::os::fd::OwnedFd;
use std::path::Path;

/// Lock files kept in the directory before stale ones are removed.
const STALE_KEEP: usize = 64;

/// A random instance number (the kernel's `get_random_bytes`), never 0: with
/// the all-zero MAC of `lo` that would be the all-zero system ID, which reads
/// as "none".
fn random_u16() -> u16 {
    loop {
        let n = random_any();
        if n != 0 {
            return n;
        }
    }
}

fn random_any() -> u16 {
    let mut b = [0u8; 2];
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
        // no entropy source: the clock and the process id
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        b = ((t ^ (t >> 16) ^ (t >> 32) ^ (t >> 48)) as u16).to_be_bytes();
    }
    u16::from_be_bytes(b)
}

/// Whether `fd` (locked) is still the file at `path`: another process may
/// have removed a stale lock file between our open and our lock.
fn still_there(fd: &OwnedFd, path: &Path) -> bool {
    match (rustix::fs::fstat(fd), rustix::fs::stat(path)) {
        (Ok(a), Ok(b)) => a.st_ino == b.st_ino && a.st_dev == b.st_dev,
        _ => false,
    }
}

/// Opens and locks `path` if nobody holds it. Processes of every user share
/// the directory, so a file another user left is taken as well: it is opened
/// read-only (all `flock` needs), and without `O_CREAT` unless it is missing
/// (`fs.protected_regular` refuses `O_CREAT` on another user's file in a
/// sticky directory).
fn try_take(path: &Path) -> Option<OwnedFd> {
    let open = |flags| rustix::fs::open(path, flags, Mode::from_raw_mode(0o644));
    let ro = OFlags::RDONLY | OFlags::CLOEXEC;
    let fd = match open(ro) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => match open(ro | OFlags::CREATE | OFlags::EXCL) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::EXIST) => open(ro).ok()?,
            Err(_) => return None,
        },
        Err(_) => return None,
    };
    rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive).ok()?;
    still_there(&fd, path).then_some(fd)
}

/// Removes lock files nobody holds, once there are many (their processes
/// are gone). A file is removed only while we hold its lock and it is still
/// the one at its path, so a number in use is never freed.
fn remove_stale(dir: &Path, ours: &str) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let names: Vec<_> = rd.flatten().map(|e| e.file_name()).collect();
    if names.len() <= STALE_KEEP {
        return;
    }
    for n in names {
        if n.to_str() == Some(ours) {
            continue;
        }
        let p = dir.join(&n);
        if let Some(_held) = try_take(&p) {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// Makes `dir` (below `rundir`) a directory every user may create lock files
/// in, mode 1777 like the rundir, whose processes of all users must not share
/// a number. The rundir is created as the shm device creates it (this may
/// come first). A `dir` of ours with another mode (made by an earlier build
/// with the umask's 0755, which kept other users' processes out) is repaired.
fn shared_dir(rundir: &Path, dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    smc_rdma::shm::registry::create_rundir(rundir)?;
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::metadata(dir)?;
    if m.uid() == rustix::process::geteuid().as_raw() && m.mode() & 0o7777 != 0o1777 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))?;
    }
    Ok(())
}

/// This process's instance number and, when `rundir` is known, the lock that
/// keeps it unique (held until the process ends).
pub(crate) fn allocate(rundir: Option<&Path>) -> (u16, Option<OwnedFd>) {
    let Some(rundir) = rundir else {
        return (random_u16(), None);
    };
    let dir = rundir.join("system-ids");
    if shared_dir(rundir, &dir).is_err() {
        return (random_u16(), None);
    }
    // 65 536 numbers; a full directory is not a reason to go without one
    for _ in 0..4096 {
        let n = random_u16();
        let name = format!("{n:04x}");
        if let Some(fd) = try_take(&dir.join(&name)) {
            remove_stale(&dir, &name);
            return (n, Some(fd));
        }
    }
    (random_u16(), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_number_is_not_taken_again_and_a_released_one_is() {
        let dir = std::env::temp_dir().join(format!("smc-sysid-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("00aa");
        let held = try_take(&p).expect("free");
        // flock locks belong to the open file description: a second open,
        // even in this process, is another holder
        assert!(try_take(&p).is_none(), "taken twice");
        drop(held);
        assert!(try_take(&p).is_some(), "not released");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_directories_are_open_to_every_user() {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let base = std::env::temp_dir().join(format!("smc-sysid-unit3-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        // a missing rundir is made as the shm device makes it
        let run = base.join("run");
        let (_, fd) = allocate(Some(&run));
        assert!(fd.is_some());
        assert_eq!(mode(&run), 0o1777, "rundir");
        assert_eq!(mode(&run.join("system-ids")), 0o1777, "system-ids");
        // a directory an earlier build made with the umask's mode is repaired
        let old = base.join("old");
        std::fs::DirBuilder::new().mode(0o755).create(&old).unwrap();
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(old.join("system-ids"))
            .unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (_, fd2) = allocate(Some(&old));
        assert!(fd2.is_some());
        assert_eq!(mode(&old.join("system-ids")), 0o1777);
        assert_eq!(mode(&old), 0o755, "an existing rundir keeps its mode");
        drop((fd, fd2));
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn numbers_of_a_rundir_differ_and_stale_files_are_removed() {
        let dir = std::env::temp_dir().join(format!("smc-sysid-unit2-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let held: Vec<_> = (0..200).map(|_| allocate(Some(&dir))).collect();
        let mut nums: Vec<u16> = held.iter().map(|(n, _)| *n).collect();
        assert!(held.iter().all(|(_, fd)| fd.is_some()));
        nums.sort_unstable();
        nums.dedup();
        assert_eq!(nums.len(), 200, "two holders of one number");
        drop(held);
        let (_, _fd) = allocate(Some(&dir));
        let left = std::fs::read_dir(dir.join("system-ids")).unwrap().count();
        assert_eq!(left, 1, "stale lock files are removed");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
