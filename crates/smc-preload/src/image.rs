//! Whether the program an exec starts will load this library: it decides
//! whether the listening sockets the program inherits may go on offering SMC
//! (see `exec.rs`).
//!
//! The dynamic loader preloads what `LD_PRELOAD` (in the new environment) and
//! `/etc/ld.so.preload` name (ld.so(8)). It does not run for a static
//! program (an ELF file without a `PT_INTERP` program header: the kernel
//! starts it directly, fs/binfmt_elf.c `load_elf_binary`), and in secure-
//! execution mode (`AT_SECURE`: a set-user-ID or set-group-ID program that
//! changes the IDs, or one with file capabilities, security/commoncap.c
//! `cap_bprm_creds_from_file`) it ignores preload paths that contain a
//! slash and loads only set-user-ID libraries from the standard directories,
//! which ours is not. A script (`#!`) runs its interpreter, which is looked
//! at in its place (as fs/binfmt_script.c does, at most 4 deep as
//! `BINPRM_MAX_RECURSION`). What cannot be read or recognised counts as not
//! loading it: the listener then falls back to TCP, which is slower but
//! always correct.

use super::*;
use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// What an exec runs.
pub(crate) enum Target<'a> {
    /// A path, as `execve` takes it.
    Path(&'a CStr),
    /// A file name looked up in `PATH` if it has no slash (`execvp`).
    Search(&'a CStr),
    /// An open file (`fexecve`).
    Fd(c_int),
    /// `execveat`'s directory, path and flags.
    At(c_int, &'a CStr, c_int),
}

/// Whether the image an exec of `target` with the environment `envp` (a
/// NULL-terminated array; NULL for none) starts loads this library.
pub(crate) fn loads_library(target: &Target<'_>, envp: CArgv) -> bool {
    if !preload_names_us(envp) {
        return false;
    }
    let file = match target {
        Target::Path(p) => open(p.to_bytes()),
        Target::Search(f) => search(f.to_bytes()).and_then(|p| open(p.as_os_str().as_bytes())),
        Target::Fd(fd) => rustix::io::fcntl_dupfd_cloexec(borrow(*fd), 0).ok(),
        Target::At(dir, p, flags) => {
            if p.to_bytes().is_empty() && flags & libc::AT_EMPTY_PATH != 0 {
                rustix::io::fcntl_dupfd_cloexec(borrow(*dir), 0).ok()
            } else {
                let mut o = rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC;
                if flags & libc::AT_SYMLINK_NOFOLLOW != 0 {
                    o |= rustix::fs::OFlags::NOFOLLOW;
                }
                rustix::fs::openat(borrow(*dir), *p, o, rustix::fs::Mode::empty()).ok()
            }
        }
    };
    file.is_some_and(|f| runs_loader(&f, 0))
}

/// Whether `LD_PRELOAD` in `envp`, or `/etc/ld.so.preload`, names this
/// library (the same file, or its file name for a name without a slash,
/// which the loader looks up in the standard directories).
fn preload_names_us(envp: CArgv) -> bool {
    let Some(us) = our_file() else {
        return false;
    };
    let names_us = |list: &[u8]| {
        list.split(|&b| b == b':' || b == b' ' || b == b'\n' || b == b'\t')
            .filter(|e| !e.is_empty())
            .any(|e| {
                if e.contains(&b'/') {
                    std::fs::metadata(OsStr::from_bytes(e))
                        .is_ok_and(|m| (m.dev(), m.ino()) == (us.1, us.2))
                } else {
                    us.0.file_name().is_some_and(|n| n.as_bytes() == e)
                }
            })
    };
    let mut i = 0;
    while !envp.is_null() {
        // SAFETY: `envp` is the caller's NULL-terminated array of C strings,
        // read up to its terminator.
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: an element of that array, a C string.
        let kv = unsafe { CStr::from_ptr(p) }.to_bytes();
        if let Some(v) = kv.strip_prefix(b"LD_PRELOAD=") {
            if names_us(v) {
                return true;
            }
        }
        i += 1;
    }
    std::fs::read("/etc/ld.so.preload").is_ok_and(|l| names_us(&l))
}

use std::os::unix::fs::MetadataExt;

/// This library's file: its path, device and inode.
fn our_file() -> Option<&'static (PathBuf, u64, u64)> {
    static US: OnceLock<Option<(PathBuf, u64, u64)>> = OnceLock::new();
    US.get_or_init(|| {
        let mut info: libc::Dl_info = empty_dl_info();
        let here = our_file as *const ();
        // SAFETY: `here` is an address in this library; `info` is written by dladdr.
        if unsafe { libc::dladdr(here.cast(), &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dladdr's file name, a C string owned by the loader.
        let path = PathBuf::from(OsStr::from_bytes(
            unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes(),
        ));
        let m = std::fs::metadata(&path).ok()?;
        Some((path, m.dev(), m.ino()))
    })
    .as_ref()
}

fn empty_dl_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

fn open(path: &[u8]) -> Option<OwnedFd> {
    rustix::fs::open(
        OsStr::from_bytes(path),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()
}

/// `execvp`'s lookup: a name with a slash is a path; else the first
/// executable regular file of that name in `PATH` (the caller's, as glibc's
/// `execvp` and `posix_spawnp` take it; `/bin:/usr/bin` without one).
fn search(file: &[u8]) -> Option<PathBuf> {
    if file.contains(&b'/') {
        return Some(PathBuf::from(OsStr::from_bytes(file)));
    }
    if file.is_empty() {
        return None;
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    path.as_bytes()
        .split(|&b| b == b':')
        .map(|d| {
            let d = if d.is_empty() { b"." as &[u8] } else { d };
            Path::new(OsStr::from_bytes(d)).join(OsStr::from_bytes(file))
        })
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file())
                && rustix::fs::access(p, rustix::fs::Access::EXEC_OK).is_ok()
        })
}

const PT_INTERP: u32 = 3;

/// Whether executing the open file `f` runs the dynamic loader outside
/// secure-execution mode (see the module's comment).
fn runs_loader(f: &OwnedFd, depth: u32) -> bool {
    let Ok(st) = rustix::fs::fstat(f) else {
        return false;
    };
    if secure_exec(&st, f) {
        return false;
    }
    let mut head = [0u8; 256];
    let n = read_at(f, &mut head, 0);
    let head = &head[..n];
    if let Some(line) = head.strip_prefix(b"#!") {
        if depth >= 4 {
            return false;
        }
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let interp = line
            .split(|&b| b == b' ' || b == b'\t')
            .find(|w| !w.is_empty());
        return interp
            .and_then(open)
            .is_some_and(|i| runs_loader(&i, depth + 1));
    }
    if head.len() < 52 || &head[..4] != b"\x7fELF" {
        return false;
    }
    let le = head[5] == 1;
    let u16_at = |b: &[u8], o: usize| {
        let x = [b[o], b[o + 1]];
        if le {
            u16::from_le_bytes(x)
        } else {
            u16::from_be_bytes(x)
        }
    };
    let u32_at = |b: &[u8], o: usize| {
        let x = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if le {
            u32::from_le_bytes(x)
        } else {
            u32::from_be_bytes(x)
        }
    };
    // (ELF header: e_phoff, e_phentsize, e_phnum, for ELFCLASS32 and 64)
    let (phoff, phentsize, phnum) = match head[4] {
        1 => (
            u64::from(u32_at(head, 28)),
            u16_at(head, 42),
            u16_at(head, 44),
        ),
        2 if head.len() >= 64 => {
            let lo = u64::from(u32_at(head, 32));
            let hi = u64::from(u32_at(head, 36));
            let off = if le { lo | hi << 32 } else { hi | lo << 32 };
            (off, u16_at(head, 54), u16_at(head, 56))
        }
        _ => return false,
    };
    let (phentsize, phnum) = (usize::from(phentsize), usize::from(phnum));
    if phentsize < 4 || phnum == 0 || phnum > 512 {
        return false;
    }
    let mut ph = vec![0u8; phentsize * phnum];
    if read_at(f, &mut ph, phoff) != ph.len() {
        return false;
    }
    ph.chunks(phentsize).any(|h| u32_at(h, 0) == PT_INTERP)
}

/// Whether the kernel will start the file in secure-execution mode for
/// this process: set-user-ID to another user, set-group-ID to another
/// group, or file capabilities for a process that is not root.
fn secure_exec(st: &rustix::fs::Stat, f: &OwnedFd) -> bool {
    let mode = st.st_mode;
    let uid = rustix::process::getuid().as_raw();
    let gid = rustix::process::getgid().as_raw();
    if mode & libc::S_ISUID != 0 && st.st_uid != uid {
        return true;
    }
    if mode & libc::S_ISGID != 0 && st.st_gid != gid {
        return true;
    }
    uid != 0 && rustix::fs::fgetxattr(f, "security.capability", &mut [0u8; 64][..]).is_ok()
}

/// Reads up to `buf.len()` bytes at `off`; how many it read.
fn read_at(f: &OwnedFd, buf: &mut [u8], off: u64) -> usize {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(f, &mut buf[done..], off + done as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => done += n,
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::fs::PermissionsExt;

    /// A NULL-terminated environment of `vars` (kept alive by the first value).
    fn env(vars: &[String]) -> (Vec<CString>, Vec<*const libc::c_char>) {
        let owned: Vec<CString> = vars
            .iter()
            .map(|v| CString::new(v.as_str()).unwrap())
            .collect();
        let mut ptrs: Vec<*const libc::c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        (owned, ptrs)
    }

    fn loads(path: &Path, vars: &[String]) -> bool {
        let (_keep, envp) = env(vars);
        let p = CString::new(path.as_os_str().as_bytes()).unwrap();
        loads_library(&Target::Path(&p), envp.as_ptr())
    }

    fn preload_us() -> String {
        let us = our_file().expect("this binary's own file (dladdr)");
        format!("LD_PRELOAD=/nonexistent/other.so:{}", us.0.display())
    }

    fn dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("smc-preload-image-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_dynamic_program_loads_the_library_only_if_ld_preload_names_it() {
        let sh = Path::new("/bin/sh");
        assert!(loads(sh, &[preload_us(), "PATH=/bin".into()]));
        assert!(!loads(sh, &["PATH=/bin".into()]));
        assert!(!loads(sh, &["LD_PRELOAD=/nonexistent/other.so".into()]));
        // a program that is not there loads nothing
        assert!(!loads(Path::new("/nonexistent/prog"), &[preload_us()]));
    }

    #[test]
    fn a_static_program_does_not_load_the_library() {
        // (Debian's ldconfig is static-pie: no PT_INTERP)
        assert!(!loads(Path::new("/sbin/ldconfig"), &[preload_us()]));
    }

    #[test]
    fn a_script_is_judged_by_its_interpreter() {
        let d = dir("script");
        let dynamic = d.join("dynamic.sh");
        std::fs::write(&dynamic, "#!/bin/sh -e\nexit 0\n").unwrap();
        let stat = d.join("static.sh");
        std::fs::write(&stat, "#! /sbin/ldconfig -p\n").unwrap();
        let unknown = d.join("data");
        std::fs::write(&unknown, "no program at all\n").unwrap();
        assert!(loads(&dynamic, &[preload_us()]));
        assert!(!loads(&stat, &[preload_us()]));
        assert!(!loads(&unknown, &[preload_us()]));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A set-user-ID program of another user runs in secure-execution mode
    /// (the loader ignores a preload path); one of the caller's own does not.
    #[test]
    fn a_set_user_id_program_of_another_user_does_not_load_the_library() {
        let d = dir("setuid");
        let prog = d.join("sh");
        std::fs::copy("/bin/sh", &prog).unwrap();
        let me = rustix::process::getuid().as_raw();
        let other = if me == 65534 { 0 } else { 65534 };
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o4755)).unwrap();
        assert!(loads(&prog, &[preload_us()]), "owned by the caller");
        if std::os::unix::fs::chown(&prog, Some(other), None).is_ok() {
            // (chown clears the set-ID bits)
            std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o4755)).unwrap();
            assert!(!loads(&prog, &[preload_us()]), "set-user-ID to uid {other}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn execvp_looks_the_name_up_in_path() {
        let (_keep, envp) = env(&[preload_us()]);
        let sh = CString::new("sh").unwrap();
        let found = search(b"sh").expect("sh on PATH");
        assert!(found.is_absolute() || found.starts_with("."), "{found:?}");
        assert!(loads_library(&Target::Search(&sh), envp.as_ptr()));
        let nothing = CString::new("no-such-program-here").unwrap();
        assert!(!loads_library(&Target::Search(&nothing), envp.as_ptr()));
    }
}
