//! Whether a wait spins before it sleeps, for how long, and how it spends
//! its turns (a pause, or a yield of a CPU it shares with its peer).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Whether spinning pays off here. It does when the peer answers within the
/// spin time, i.e. when both sides have a core; on a machine with more
/// runnable threads than cores, or with both processes on one CPU, a spinning
/// thread takes the CPU the peer needs and every wait ends in a sleep anyway,
/// only later. So after [`SPIN_MISSES_OFF`] waits in a row that had to sleep,
/// waits sleep at once, and now and then one spins again to see whether
/// things have changed: every [`SPIN_PROBE_EVERY`]th wait at first, half as
/// often after each probe that had to sleep too, down to every
/// [`SPIN_PROBE_MAX`]th, since each probe that misses costs a whole spin
/// time of a CPU the peer needed (on one CPU: a ping-pong's 99th
/// percentile). (The handshakes keep
/// one of their own: theirs wait for a peer's whole handshake step, not for
/// one message.)
#[derive(Default)]
pub(crate) struct Spin {
    misses: AtomicU32,
    off: AtomicBool,
    waits: AtomicU32,
    /// Waits between probes while off (0: [`SPIN_PROBE_EVERY`]).
    probe_every: AtomicU32,
}

const SPIN_MISSES_OFF: u32 = 8;
const SPIN_PROBE_EVERY: u32 = 32;
const SPIN_PROBE_MAX: u32 = 4096;

impl Spin {
    /// How long the next wait may spin.
    pub(crate) fn budget(&self) -> Duration {
        if !self.off.load(Ordering::Relaxed) {
            return spin_time();
        }
        if self.waits.fetch_add(1, Ordering::Relaxed) + 1 >= self.probe_every() {
            self.waits.store(0, Ordering::Relaxed);
            return spin_time();
        }
        Duration::ZERO
    }

    /// Waits between probes while spinning is off.
    fn probe_every(&self) -> u32 {
        match self.probe_every.load(Ordering::Relaxed) {
            0 => SPIN_PROBE_EVERY,
            n => n,
        }
    }

    /// A wait ended while spinning.
    pub(crate) fn hit(&self) {
        self.misses.store(0, Ordering::Relaxed);
        self.off.store(false, Ordering::Relaxed);
        self.probe_every.store(0, Ordering::Relaxed);
    }

    /// A wait spun for `budget` and then had to sleep.
    pub(crate) fn miss(&self, budget: Duration) {
        if budget.is_zero() {
            return;
        }
        if self.off.load(Ordering::Relaxed) {
            // a probe that missed: the next one comes later
            let later = (self.probe_every() * 2).min(SPIN_PROBE_MAX);
            self.probe_every.store(later, Ordering::Relaxed);
        } else if self.misses.fetch_add(1, Ordering::Relaxed) + 1 >= SPIN_MISSES_OFF {
            self.off.store(true, Ordering::Relaxed);
        }
    }
}

/// Most threads of a process that spin while waiting: half the CPUs it may
/// use (at least one).
pub(super) fn max_spinners() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get() / 2)
            .max(1)
    })
}

/// Whether the calling thread may run on more than one CPU: only then may
/// a wait spin on pause instructions (on a single CPU that holds the core
/// its peer needs; [`SpinTurns`] yields it there instead, and the listener
/// and handshake waits do not spin). Its affinity, looked at again every
/// [`AFFINITY_RECHECK`]: a program (or `taskset -p`) may pin its threads
/// after they first waited.
pub(crate) fn may_spin() -> bool {
    use std::cell::Cell;
    thread_local! {
        static SEEN: Cell<Option<(Instant, bool)>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    SEEN.with(|seen| match seen.get() {
        Some((at, many)) if now.saturating_duration_since(at) < AFFINITY_RECHECK => many,
        _ => {
            let many = rustix::thread::sched_getaffinity(None).map_or(true, |s| s.count() > 1);
            seen.set(Some((now, many)));
            many
        }
    })
}

/// How long a thread's CPU affinity, as [`may_spin`] found it, is taken as
/// still holding.
const AFFINITY_RECHECK: Duration = Duration::from_millis(100);

/// The turns of one waiting thread's spin ([`Self::pause`] between two
/// looks). A thread that may use one CPU gives it up (`sched_yield`)
/// instead of pausing: its peer, when it runs on that CPU too, answers
/// meanwhile, and the answer is found at the next look without a sleep and
/// a wake-up (a doorbell held while spinning is not rung).
///
/// - A yield that came back sooner than a switch to another thread and
///   back takes ([`YIELD_RAN_NOBODY`]) ran nobody: the peer is elsewhere
///   (or not runnable), and the rest of the wait pauses, each look sooner
///   than a system call would allow.
/// - A yield that came back only after [`YIELD_RAN_LONG`] gave the CPU to
///   a thread with work of its own: a busy process beside ours, which keeps
///   the CPU for its time slice (a millisecond or more) while the answer
///   may come from a peer on another CPU at once (or a host that took the
///   CPU away). The thread's waits then pause as they did before yielding
///   (and sleep when that runs out, as before) for [`YIELD_OFF_MIN`]; for
///   twice as long as the last time (up to [`YIELD_OFF_MAX`]) when that
///   came within ten such periods of the last yield that ran long. A busy
///   neighbour then costs a waiting thread one of its slices about once a
///   second; a peer on the same CPU that now and then takes that long to
///   answer (a wait in some thousands) costs the waits of the next
///   millisecond what they cost before yielding.
///
/// With more CPUs the peer runs elsewhere and pausing is the cheaper look
/// from the start.
pub(crate) struct SpinTurns {
    /// Whether the next turn yields (`None`: not known before the first).
    yielding: Option<bool>,
}

impl SpinTurns {
    pub(crate) fn new() -> SpinTurns {
        SpinTurns { yielding: None }
    }

    /// Between two looks of the wait; returns the time after it.
    pub(crate) fn pause(&mut self) -> Instant {
        use std::cell::Cell;
        thread_local! {
            /// The last yield of this thread that ran long, and for how
            /// long it turned yielding off.
            static OFF: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
        }
        let yielding = *self.yielding.get_or_insert_with(|| {
            !may_spin()
                && OFF
                    .with(Cell::get)
                    .is_none_or(|(at, off)| Instant::now() >= at + off)
        });
        if !yielding {
            std::hint::spin_loop();
            return Instant::now();
        }
        let before = Instant::now();
        std::thread::yield_now();
        let after = Instant::now();
        let took = after.saturating_duration_since(before);
        if took < YIELD_RAN_NOBODY {
            self.yielding = Some(false);
        } else if took > YIELD_RAN_LONG {
            OFF.with(|o| {
                let off = match o.get() {
                    Some((at, off)) if after.saturating_duration_since(at) < off * 10 => {
                        (off * 2).min(YIELD_OFF_MAX)
                    }
                    _ => YIELD_OFF_MIN,
                };
                o.set(Some((after, off)));
            });
            self.yielding = Some(false);
        }
        after
    }
}

/// Less than two context switches take: a `sched_yield` that returned
/// within this ran no other thread (the call alone is a system call's
/// entry and exit).
const YIELD_RAN_NOBODY: Duration = Duration::from_micros(1);

/// A `sched_yield` that returned only after this ran a thread that did more
/// than answer a message: far longer than a peer's answer takes (a few
/// microseconds), shorter than a time slice of the scheduler (0.75 ms and
/// more).
const YIELD_RAN_LONG: Duration = Duration::from_micros(500);

/// How long a thread whose yield ran long pauses instead of yielding: at
/// first, and at most (see [`SpinTurns`]).
const YIELD_OFF_MIN: Duration = Duration::from_millis(1);
const YIELD_OFF_MAX: Duration = Duration::from_secs(1);

/// How long a waiting thread polls before it sleeps (`SMC_SPIN_US`, default 50 µs).
pub(crate) fn spin_time() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        Duration::from_micros(
            std::env::var("SMC_SPIN_US")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(50),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{Spin, SPIN_MISSES_OFF, SPIN_PROBE_EVERY, SPIN_PROBE_MAX};

    /// The waits (1-based) among the next `n` that may spin, each of which
    /// then has to sleep.
    fn spinning_waits(s: &Spin, n: u32) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 1..=n {
            let b = s.budget();
            if b.is_zero() {
                s.miss(b);
                continue;
            }
            out.push(i);
            s.miss(b);
        }
        out
    }

    /// Spinning stops after a run of waits that had to sleep anyway; the
    /// probes that look whether it pays again come less and less often
    /// while they miss, and a hit turns it back on.
    #[test]
    fn probes_that_miss_come_less_and_less_often() {
        let s = Spin::default();
        // on at first, off after SPIN_MISSES_OFF misses
        assert_eq!(
            spinning_waits(&s, SPIN_MISSES_OFF),
            (1..=SPIN_MISSES_OFF).collect::<Vec<_>>()
        );
        // then a probe every 32nd wait, 64th, 128th ...
        let probes = spinning_waits(&s, 32 + 64 + 128 + 256);
        assert_eq!(probes, vec![32, 96, 224, 480]);
        // ... never rarer than every SPIN_PROBE_MAX-th
        spinning_waits(&s, 4 * SPIN_PROBE_MAX);
        let late = spinning_waits(&s, 2 * SPIN_PROBE_MAX);
        assert_eq!(late.len(), 2, "{late:?}");
        assert_eq!(late[1] - late[0], SPIN_PROBE_MAX);
        // a probe that hits turns spinning on again
        let waits = (1..=SPIN_PROBE_MAX)
            .find(|_| !s.budget().is_zero())
            .expect("a probe");
        assert!(waits <= SPIN_PROBE_MAX);
        s.hit();
        assert_eq!(
            spinning_waits(&s, SPIN_MISSES_OFF),
            (1..=SPIN_MISSES_OFF).collect::<Vec<_>>(),
            "on again after a hit"
        );
        // and the next run of misses starts from probes every 32nd wait
        assert_eq!(spinning_waits(&s, SPIN_PROBE_EVERY), vec![SPIN_PROBE_EVERY]);
    }
}
