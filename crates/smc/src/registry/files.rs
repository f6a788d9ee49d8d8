//! The registry's files: where they live, which of them belong to live
//! processes, and the statistics that outlive a process (`smcr stats`).
//! Used by the library (to publish and to reap) and by the tools (to read).
//!
//! Layout of the run directory (mode 0700, one per user; see [`run_dir`]):
//! * `<pid>.json`: a live process's entry (schema in the smc-tools README),
//!   replaced whole (written to `.<pid>.json.tmp`, then renamed);
//! * `totals.json`: the counters of processes that have exited, and the
//!   baseline of the last `smcr stats reset`;
//! * `.lock`: serializes reaping and resets (`flock`).
//!
//! An entry whose process is gone (no `/proc/<pid>`, or a different process
//! under that pid: its start time differs) is merged into `totals.json` and
//! removed by whoever reads the directory next (a tool, or the registry
//! thread of any process of the user when it starts).

use serde_json::{json, Map, Value};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Schema version of the files (`"version"` key).
pub const VERSION: u64 = 1;

/// Name of the registry's directory under `/run` and `$XDG_RUNTIME_DIR`
/// (not `smc-rs`: that is the shm device's rundir, shared by all users).
const DIR_NAME: &str = "smc-rs-registry";

/// The run directory of this user: `SMC_RS_RUN_DIR` if set, else
/// `/run/smc-rs-registry` for root, `$XDG_RUNTIME_DIR/smc-rs-registry` for
/// others, else `/tmp/smc-rs-registry-<uid>`.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SMC_RS_RUN_DIR") {
        return PathBuf::from(d);
    }
    let uid = rustix::process::geteuid().as_raw();
    if uid == 0 {
        return Path::new("/run").join(DIR_NAME);
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(x) if !x.is_empty() => PathBuf::from(x).join(DIR_NAME),
        _ => std::env::temp_dir().join(format!("{DIR_NAME}-{uid}")),
    }
}

/// The directories a reader looks at: this user's; for root without
/// `SMC_RS_RUN_DIR` also every user's `/run/user/<uid>/smc-rs-registry` (root sees
/// all sockets, as with the kernel's sock_diag).
pub fn scan_dirs() -> Vec<PathBuf> {
    let mut v = vec![run_dir()];
    if std::env::var_os("SMC_RS_RUN_DIR").is_none() && rustix::process::geteuid().is_root() {
        if let Ok(rd) = std::fs::read_dir("/run/user") {
            let mut users: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path().join(DIR_NAME))
                .filter(|p| p.is_dir())
                .collect();
            users.sort();
            v.extend(users);
        }
    }
    v
}

/// Creates the run directory (0700) if needed. A directory that another
/// user owns, or that others may write to, is refused: its files would be
/// theirs to forge (`/tmp/smc-rs-<uid>` could have been made by anyone).
pub fn ensure_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() || m.uid() != rustix::process::geteuid().as_raw() || m.mode() & 0o022 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{}: not a directory of ours that only we may write to",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// A process's start time (clock ticks since boot, `/proc/<pid>/stat`
/// field 22): with the pid it names one process, not a later one that
/// reuses the pid.
pub fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command name (field 2) may hold spaces and parentheses: fields
    // after the last ')' start at field 3
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process an entry was written by still runs.
pub fn alive(pid: u32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

/// Writes `text` to `path` whole: a private temporary file renamed over it.
pub fn write_atomic(path: &Path, text: &str) -> io::Result<()> {
    write_atomic_with(path, |w| w.write_all(text.as_bytes()))
}

/// [`write_atomic`] with the content written by `f` (buffered).
pub fn write_atomic_with(
    path: &Path,
    f: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let mut w = io::BufWriter::new(file);
        f(&mut w)?;
        w.flush()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Holds the directory's `.lock` (exclusive) until dropped.
pub struct DirLock(#[allow(dead_code)] std::fs::File);

/// Takes the directory's lock (reaping, totals, reset).
pub fn lock(dir: &Path) -> io::Result<DirLock> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)?;
    Ok(DirLock(f))
}

/// Takes `n` consecutive LG-ID numbers (1 to 0xffffff; the LG-ID is the
/// number shifted left by 8, the low byte being the link id) from the
/// counter in `<dir>/lgid`, under the directory's lock: the link groups of
/// all processes of the run directory get distinct LG-IDs, as the kernel's
/// host-wide `smc_lgr_list.num` gives them (smc_core.c `smc_lgr_create`).
/// After 0xffffff the numbers start again at 1.
pub fn alloc_lg_ids(dir: &Path, n: u32) -> io::Result<u32> {
    ensure_dir(dir)?;
    let _l = lock(dir)?;
    let path = dir.join("lgid");
    let next: u32 = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .filter(|x| (1..=0xff_ffff).contains(x))
        .unwrap_or(1);
    let first = if next + n > 0x100_0000 { 1 } else { next };
    write_atomic(&path, &format!("{}\n", first + n))?;
    Ok(first)
}

/// Adds (`sign` 1) or subtracts (`sign` -1) the numbers of `b` to those of
/// `a`, key by key, through nested objects; a result below zero becomes 0.
pub fn combine(a: &mut Value, b: &Value, sign: i8) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                let slot = a.entry(k.clone()).or_insert_with(|| match v {
                    Value::Object(_) => Value::Object(Map::new()),
                    _ => json!(0),
                });
                combine(slot, v, sign);
            }
        }
        (a @ Value::Number(_), Value::Number(b)) => {
            let x = a.as_u64().unwrap_or(0);
            let y = b.as_u64().unwrap_or(0);
            *a = json!(if sign >= 0 {
                x.saturating_add(y)
            } else {
                x.saturating_sub(y)
            });
        }
        _ => {}
    }
}

/// Drops zero counters and empty objects (a reset leaves no clutter).
pub fn prune(v: &mut Value) {
    if let Value::Object(m) = v {
        for x in m.values_mut() {
            prune(x);
        }
        m.retain(|_, x| match x {
            Value::Object(o) => !o.is_empty(),
            Value::Number(n) => n.as_u64() != Some(0),
            _ => true,
        });
    }
}

/// A process entry read from the run directory.
#[derive(Clone, Debug)]
pub struct Entry {
    /// The file's JSON (see the smc-tools README for the schema).
    pub json: Value,
    /// Its process.
    pub pid: u32,
    /// Its process's start time.
    pub start: u64,
}

impl Entry {
    fn key(&self) -> String {
        format!("{}:{}", self.pid, self.start)
    }
    /// The entry's counters (an empty object if it has none).
    pub fn counters(&self) -> Value {
        self.json
            .get("counters")
            .cloned()
            .unwrap_or_else(|| json!({}))
    }
}

fn parse_entry(path: &Path) -> Option<Entry> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: Value = serde_json::from_str(&text).ok()?;
    let pid = u32::try_from(json.get("pid")?.as_u64()?).ok()?;
    let start = json.get("start_time")?.as_u64()?;
    Some(Entry { json, pid, start })
}

fn entry_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && p.file_stem()
                    .and_then(|s| s.to_str())
                    .is_some_and(|s| s.parse::<u32>().is_ok())
        })
        .collect();
    v.sort();
    v
}

fn load_totals(dir: &Path) -> Value {
    std::fs::read_to_string(dir.join("totals.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .filter(Value::is_object)
        .unwrap_or_else(
            || json!({"version": VERSION, "dead": {}, "reset": {"dead": {}, "live": {}}}),
        )
}

fn obj<'a>(v: &'a mut Value, key: &str) -> &'a mut Value {
    if !v.get(key).is_some_and(Value::is_object) {
        v[key] = json!({});
    }
    &mut v[key]
}

/// The live entries of `dir`, in pid order. With `reap`, entries of
/// processes that are gone are merged into `totals.json` and removed (only
/// in a directory of our own: `reap` is for [`run_dir`]).
pub fn read(dir: &Path, reap: bool) -> Vec<Entry> {
    let mut live = Vec::new();
    let mut dead = Vec::new();
    for p in entry_files(dir) {
        match parse_entry(&p) {
            Some(e) if alive(e.pid, e.start) => live.push(e),
            Some(e) => dead.push((p, Some(e))),
            // unreadable or half-written by a process that died (written
            // files are whole: renamed into place): gone if its pid is
            None => {
                let pid: Option<u32> = p
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .and_then(|s| s.parse().ok());
                if pid.is_some_and(|pid| start_time(pid).is_none()) {
                    dead.push((p, None));
                }
            }
        }
    }
    if reap && !dead.is_empty() {
        let _ = reap_dead(dir, dead);
    }
    if reap {
        remove_stale_temporaries(dir);
    }
    live.sort_by_key(|e| e.pid);
    live
}

/// Removes the temporary files (`.<name>.<pid>.tmp`, see [`write_atomic`])
/// of processes that died while writing.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str() else { continue };
        let pid = n
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(|n| n.rsplit('.').next())
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| start_time(p).is_none()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn reap_dead(dir: &Path, dead: Vec<(PathBuf, Option<Entry>)>) -> io::Result<()> {
    let _l = lock(dir)?;
    let mut totals = load_totals(dir);
    let mut changed = false;
    for (path, e) in dead {
        // (another reader may have merged it meanwhile: only what is still there)
        if !path.exists() {
            continue;
        }
        if let Some(e) = e {
            combine(obj(&mut totals, "dead"), &e.counters(), 1);
            let base = obj(obj(&mut totals, "reset"), "live")
                .as_object_mut()
                .and_then(|m| m.remove(&e.key()));
            if let Some(b) = base {
                combine(obj(obj(&mut totals, "reset"), "dead"), &b, 1);
            }
            changed = true;
        }
        std::fs::remove_file(&path)?;
    }
    if changed {
        write_atomic(&dir.join("totals.json"), &totals.to_string())?;
    }
    Ok(())
}

/// The statistics of `dir`: the counters of the processes that exited plus
/// those of the live ones (`live`, from [`read`]); since the last reset
/// unless `absolute`. Gauges (`*_usage`) are the live processes' only.
pub fn counters(dir: &Path, live: &[Entry], absolute: bool) -> Value {
    let totals = load_totals(dir);
    let mut sum = totals.get("dead").cloned().unwrap_or_else(|| json!({}));
    if !absolute {
        if let Some(b) = totals.pointer("/reset/dead") {
            combine(&mut sum, b, -1);
        }
    }
    for e in live {
        let mut c = e.counters();
        if !absolute {
            if let Some(b) = totals.pointer(&format!("/reset/live/{}", e.key())) {
                combine(&mut c, b, -1);
            }
        }
        combine(&mut sum, &c, 1);
    }
    prune(&mut sum);
    sum
}

/// `smcr stats reset`: from now on, counters count from zero (for every
/// process of `dir`, live or exited; `-a` still shows the absolute values).
pub fn reset(dir: &Path) -> io::Result<()> {
    ensure_dir(dir)?;
    let live = read(dir, true);
    let _l = lock(dir)?;
    let mut totals = load_totals(dir);
    let dead = totals.get("dead").cloned().unwrap_or_else(|| json!({}));
    let mut base = Map::new();
    for e in &live {
        base.insert(e.key(), e.counters());
    }
    totals["version"] = json!(VERSION);
    totals["reset"] = json!({"dead": dead, "live": Value::Object(base)});
    write_atomic(&dir.join("totals.json"), &totals.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn combine_adds_and_subtracts_nested_counters() {
        let mut a = json!({"x": 1, "f": {"client": {"0x1": 2}}});
        combine(
            &mut a,
            &json!({"x": 2, "y": 3, "f": {"client": {"0x1": 1, "0x2": 5}}}),
            1,
        );
        assert_eq!(
            a,
            json!({"x": 3, "y": 3, "f": {"client": {"0x1": 3, "0x2": 5}}})
        );
        combine(&mut a, &json!({"x": 5, "f": {"client": {"0x2": 5}}}), -1);
        prune(&mut a);
        assert_eq!(a, json!({"y": 3, "f": {"client": {"0x1": 3}}}));
    }

    #[test]
    fn a_run_directory_others_may_write_to_is_refused() {
        let d = std::env::temp_dir().join(format!("smc-files-perm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        ensure_dir(&d).unwrap();
        assert_eq!(
            std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o700
        );
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(ensure_dir(&d).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn lg_ids_are_handed_out_in_distinct_blocks() {
        let d = std::env::temp_dir().join(format!("smc-files-lgid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        assert_eq!(alloc_lg_ids(&d, 16).unwrap(), 1);
        assert_eq!(alloc_lg_ids(&d, 16).unwrap(), 17);
        // near the end the numbers start again at 1
        write_atomic(&d.join("lgid"), "16777210").unwrap();
        assert_eq!(alloc_lg_ids(&d, 16).unwrap(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn start_time_names_this_process() {
        let me = std::process::id();
        let t = start_time(me).expect("our own stat");
        assert!(alive(me, t));
        assert!(!alive(me, t + 1));
    }
}
