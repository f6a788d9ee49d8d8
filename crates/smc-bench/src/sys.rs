//! What the benchmark reads from the operating system: CPU time, memory,
//! CPU affinity. All through rustix or `/proc`; no unsafe.

use std::io;

/// CPU time this process has used so far (all threads, user + system).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTime {
    /// `CLOCK_PROCESS_CPUTIME_ID`, nanoseconds (user + system, precise).
    pub total_ns: u64,
    /// User time from `/proc/self/stat`, in clock ticks (coarse; for the split).
    pub user_ticks: u64,
    /// System time from `/proc/self/stat`, in clock ticks.
    pub sys_ticks: u64,
}

impl CpuTime {
    /// Now, for this process.
    pub fn now() -> CpuTime {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        let total_ns = (t.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec as u64);
        let (user_ticks, sys_ticks) = stat_times().unwrap_or((0, 0));
        CpuTime {
            total_ns,
            user_ticks,
            sys_ticks,
        }
    }

    /// `self - earlier`, saturating.
    pub fn since(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            total_ns: self.total_ns.saturating_sub(earlier.total_ns),
            user_ticks: self.user_ticks.saturating_sub(earlier.user_ticks),
            sys_ticks: self.sys_ticks.saturating_sub(earlier.sys_ticks),
        }
    }

    /// Seconds of CPU (user + system).
    pub fn secs(&self) -> f64 {
        self.total_ns as f64 / 1e9
    }

    /// One line for the control channel.
    pub fn to_line(self) -> String {
        format!("{} {} {}", self.total_ns, self.user_ticks, self.sys_ticks)
    }

    /// Parses [`CpuTime::to_line`].
    pub fn from_line(s: &str) -> Option<CpuTime> {
        let v: Vec<u64> = s
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        match v[..] {
            [total_ns, user_ticks, sys_ticks] => Some(CpuTime {
                total_ns,
                user_ticks,
                sys_ticks,
            }),
            _ => None,
        }
    }
}

/// Seconds per clock tick of `/proc/*/stat` times.
pub fn tick_secs() -> f64 {
    1.0 / rustix::param::clock_ticks_per_second().max(1) as f64
}

/// (utime, stime) of this process, fields 14 and 15 of `/proc/self/stat`.
fn stat_times() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may contain spaces; fields restart after ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state), so field n is f[n - 3].
    Some((f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?))
}

/// Memory of this process: (resident bytes, mapped bytes), from `/proc/self/statm`.
pub fn memory() -> io::Result<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/statm")?;
    let mut it = s.split_whitespace().map(|x| x.parse::<u64>().ok());
    let page = rustix::param::page_size() as u64;
    match (it.next().flatten(), it.next().flatten()) {
        (Some(size), Some(resident)) => Ok((resident * page, size * page)),
        _ => Err(io::Error::other("unreadable /proc/self/statm")),
    }
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    let set = rustix::thread::sched_getaffinity(None)?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect())
}

/// Pins the calling thread to `cpu`.
pub fn pin_to(cpu: usize) -> io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

/// Pins every thread of this process to `cpu`, the ones the socket library
/// started on its own included; threads started later inherit the mask of
/// the thread that starts them. Returns how many threads were pinned.
///
/// `sched_setaffinity` acts on one thread, so each entry of
/// `/proc/self/task` is pinned by its id; the listing is repeated until it
/// shows no thread not pinned yet (one started by a not-yet-pinned thread
/// during the walk), a few times at most.
pub fn pin_process(cpu: usize) -> io::Result<usize> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    let mut pinned = std::collections::BTreeSet::new();
    for _ in 0..8 {
        let mut fresh = 0;
        for entry in std::fs::read_dir("/proc/self/task")? {
            let Some(tid) = entry?
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            if pinned.contains(&tid) {
                continue;
            }
            let Some(pid) = rustix::process::Pid::from_raw(tid) else {
                continue;
            };
            match rustix::thread::sched_setaffinity(Some(pid), &set) {
                // ESRCH: the thread ended since the listing
                Ok(()) | Err(rustix::io::Errno::SRCH) => {}
                Err(e) => {
                    return Err(io::Error::other(format!(
                        "pinning thread {tid} to CPU {cpu}: {e}"
                    )))
                }
            }
            pinned.insert(tid);
            fresh += 1;
        }
        if fresh == 0 {
            break;
        }
    }
    Ok(pinned.len())
}
