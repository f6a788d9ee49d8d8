//! Results: every figure's per-round values for both transports, the
//! connection modes, the printed table and the JSON document.

use crate::conn::{Transport, SMC_R};
use crate::workloads::Tally;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The workloads, in the order they run and print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Workload {
    /// Ping-pong latency, 1 B .. 64 KiB.
    Pingpong,
    /// Request/response, 10 connections, 16 KiB each way.
    Rr,
    /// One-way bulk stream: throughput and CPU per GiB.
    Bulk,
    /// Connect, one 64 B request/response, close.
    Setup,
    /// Idle cost of a connection.
    Memory,
    /// memcpy bandwidth and cache-line round trip of this machine.
    Reference,
}

impl Workload {
    /// Every workload.
    pub const ALL: [Workload; 6] = [
        Workload::Pingpong,
        Workload::Rr,
        Workload::Bulk,
        Workload::Setup,
        Workload::Memory,
        Workload::Reference,
    ];

    /// The name on the command line and in the JSON.
    pub fn key(self) -> &'static str {
        match self {
            Workload::Pingpong => "pingpong",
            Workload::Rr => "rr",
            Workload::Bulk => "bulk",
            Workload::Setup => "setup",
            Workload::Memory => "memory",
            Workload::Reference => "reference",
        }
    }
}

/// Which direction is good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    /// Smaller is better (latency, CPU, memory).
    Lower,
    /// Larger is better (rates).
    Higher,
}

/// The goal for a ratio SMC/TCP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// Ratio at most this.
    AtMost(f64),
    /// Ratio at least this.
    AtLeast(f64),
}

impl Target {
    fn met(self, ratio: f64) -> bool {
        match self {
            Target::AtMost(x) => ratio <= x,
            Target::AtLeast(x) => ratio >= x,
        }
    }
    fn text(self) -> String {
        match self {
            Target::AtMost(x) => format!("<={x}x"),
            Target::AtLeast(x) => format!(">={x}x"),
        }
    }
}

/// How a figure is described.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Stable key (JSON).
    pub key: String,
    /// Its workload.
    pub workload: Workload,
    /// Row label.
    pub label: String,
    /// Unit.
    pub unit: &'static str,
    /// Good direction.
    pub better: Better,
    /// The target for SMC/TCP, if it sets one.
    pub target: Option<Target>,
    /// SMC/TCP is meaningful (not for memory, where TCP's cost is in the kernel).
    pub ratio: bool,
    /// Zero is a legitimate value on the SMC side (coarse clocks).
    pub smc_zero_ok: bool,
    /// Zero is a legitimate value on the TCP side (coarse clocks, costs that
    /// live in the kernel).
    pub tcp_zero_ok: bool,
    /// For a reference figure that bounds a compared one (the key of that
    /// one): the table holds it against that figure's TCP median, which
    /// says whether that figure's target is physically within reach here.
    pub versus: Option<String>,
    /// With `versus`: whether the bounded figure's target is judged against
    /// this reference (not when it measures another program shape).
    pub verdict: bool,
}

impl Spec {
    /// A compared figure without target.
    pub fn new(
        key: String,
        workload: Workload,
        label: String,
        unit: &'static str,
        better: Better,
    ) -> Spec {
        Spec {
            key,
            workload,
            label,
            unit,
            better,
            target: None,
            ratio: true,
            smc_zero_ok: false,
            tcp_zero_ok: false,
            versus: None,
            verdict: true,
        }
    }
    /// A reference figure that bounds the compared figure `key`.
    pub fn versus(mut self, key: &str) -> Spec {
        self.versus = Some(key.to_string());
        self
    }
    /// With `versus`: the ratio only, no verdict on the bounded target.
    pub fn no_verdict(mut self) -> Spec {
        self.verdict = false;
        self
    }
    /// With a target.
    pub fn target(mut self, t: Target) -> Spec {
        self.target = Some(t);
        self
    }
    /// Without an SMC/TCP ratio.
    pub fn no_ratio(mut self) -> Spec {
        self.ratio = false;
        self
    }
    /// Zero allowed on both sides.
    pub fn may_be_zero(mut self) -> Spec {
        self.smc_zero_ok = true;
        self.tcp_zero_ok = true;
        self
    }
    /// Zero allowed on the TCP side.
    pub fn tcp_may_be_zero(mut self) -> Spec {
        self.tcp_zero_ok = true;
        self
    }
}

/// One figure: per-round values per transport (reference figures use `smc`
/// only and have no transport).
#[derive(Clone, Debug)]
struct Figure {
    spec: Spec,
    smc: Vec<f64>,
    tcp: Vec<f64>,
}

/// Median (mean of the two middle values for an even count).
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// (max - min) / median, or None for fewer than two values.
fn spread(v: &[f64]) -> Option<f64> {
    let m = median(v)?;
    if v.len() < 2 || m == 0.0 {
        return None;
    }
    let (lo, hi) = v
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| {
            (l.min(x), h.max(x))
        });
    Some((hi - lo) / m.abs())
}

/// Everything measured in one invocation.
#[derive(Default)]
pub struct Report {
    figures: Vec<Figure>,
    modes: BTreeMap<Workload, (Tally, Tally)>,
    /// Modes of the check connections made before measuring (SMC, TCP).
    pub preflight: (Tally, Tally),
    /// Modes of the connections the server's SMC listener accepted.
    pub server_accepted: Tally,
    /// Facts about the run (settings, host), for the header and the JSON.
    pub meta: BTreeMap<String, Value>,
    /// Rounds completed.
    pub rounds_done: usize,
    /// Errors that cut the run short.
    pub errors: Vec<String>,
}

impl Report {
    fn figure(&mut self, spec: &Spec) -> &mut Figure {
        let i = match self.figures.iter().position(|f| f.spec.key == spec.key) {
            Some(i) => i,
            None => {
                self.figures.push(Figure {
                    spec: spec.clone(),
                    smc: Vec::new(),
                    tcp: Vec::new(),
                });
                self.figures.len() - 1
            }
        };
        &mut self.figures[i]
    }

    /// Records one round's value of a compared figure.
    pub fn add(&mut self, spec: &Spec, t: Transport, v: f64) {
        let f = self.figure(spec);
        match t {
            Transport::Smc => f.smc.push(v),
            Transport::Tcp => f.tcp.push(v),
        }
    }

    /// Records one round's value of a reference figure.
    pub fn add_reference(&mut self, spec: &Spec, v: f64) {
        self.figure(spec).smc.push(v);
    }

    /// Counts connection modes of one workload.
    pub fn modes(&mut self, w: Workload, t: Transport, tally: &Tally) {
        let e = self.modes.entry(w).or_default();
        let side = match t {
            Transport::Smc => &mut e.0,
            Transport::Tcp => &mut e.1,
        };
        for (k, v) in tally {
            *side.entry(k.clone()).or_default() += v;
        }
    }

    /// SMC-side connections that did not run SMC-R (and the server's view).
    pub fn fallbacks(&self) -> Tally {
        let mut t = Tally::new();
        for (smc, _) in self.modes.values().chain([&self.preflight]) {
            for (k, v) in smc {
                if k != SMC_R {
                    *t.entry(k.clone()).or_default() += v;
                }
            }
        }
        for (k, v) in &self.server_accepted {
            if k != SMC_R {
                *t.entry(format!("server side: {k}")).or_default() += v;
            }
        }
        t
    }

    fn ratio(f: &Figure) -> Option<f64> {
        if !f.spec.ratio || f.spec.workload == Workload::Reference {
            return None;
        }
        let (s, t) = (median(&f.smc)?, median(&f.tcp)?);
        (t > 0.0 && s.is_finite()).then(|| s / t)
    }

    /// For a reference figure that bounds a compared one: the bounded
    /// figure, its TCP median and the reference's ratio to it (the best
    /// ratio any implementation could show on this machine).
    fn bound<'a>(&'a self, f: &Figure) -> Option<(&'a Figure, f64, f64)> {
        let key = f.spec.versus.as_deref()?;
        let g = self.figures.iter().find(|g| g.spec.key == key)?;
        let (s, t) = (median(&f.smc)?, median(&g.tcp)?);
        (t > 0.0 && s.is_finite()).then(|| (g, t, s / t))
    }

    /// The printed table.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "connections (mode each client socket reports; counts over all rounds)"
        );
        let _ = writeln!(o, "  {:<10} {:<38} TCP socket", "workload", "SMC socket");
        let show = |t: &Tally| {
            if t.is_empty() {
                return "-".to_string();
            }
            t.iter()
                .map(|(k, v)| format!("{v} x {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            o,
            "  {:<10} {:<38} {}",
            "preflight",
            show(&self.preflight.0),
            show(&self.preflight.1)
        );
        for (w, (s, t)) in &self.modes {
            let _ = writeln!(o, "  {:<10} {:<38} {}", w.key(), show(s), show(t));
        }
        if !self.server_accepted.is_empty() {
            let _ = writeln!(
                o,
                "  server: its SmcListener accepted {}",
                show(&self.server_accepted)
            );
        }
        let _ = writeln!(o);
        if self.figures.is_empty() {
            let _ = writeln!(o, "(nothing measured)");
            return o;
        }
        let _ = writeln!(
            o,
            "{:<38} {:>7} {:>11} {:>11} {:>8} {:>8} {:>6} {:>7}",
            "figure (median over rounds)",
            "unit",
            "SMC-R",
            "TCP",
            "SMC/TCP",
            "target",
            "result",
            "spread"
        );
        let mut last = None;
        for f in &self.figures {
            if last != Some(f.spec.workload) {
                let _ = writeln!(o, "{}", match f.spec.workload {
                    Workload::Pingpong => "-- ping-pong latency (one connection per size, per-message RTT)",
                    Workload::Rr => "-- request/response",
                    Workload::Bulk => "-- one-way bulk stream",
                    Workload::Setup => "-- connection setup",
                    Workload::Memory => "-- memory of an idle connection (client process, fresh; TCP's lives in the kernel)",
                    Workload::Reference => "-- physical reference (this machine, same run)",
                });
                last = Some(f.spec.workload);
            }
            let num = |v: Option<f64>| v.map(fmt_num).unwrap_or_else(|| "-".into());
            let reference = f.spec.workload == Workload::Reference;
            let bound = self.bound(f);
            let ratio = Self::ratio(f).or(bound.map(|b| b.2));
            let (target, result) = match (f.spec.target, ratio, bound) {
                // a bound: is the bounded figure's target within it?
                (_, _, Some((g, _, r))) => match g.spec.target.filter(|_| f.spec.verdict) {
                    Some(t) => (
                        t.text(),
                        if t.met(r) { "reach" } else { "beyond" }.to_string(),
                    ),
                    None => (String::new(), String::new()),
                },
                (Some(t), Some(r), None) => {
                    (t.text(), if t.met(r) { "PASS" } else { "MISS" }.to_string())
                }
                (Some(t), None, None) => (t.text(), "-".into()),
                _ => (String::new(), String::new()),
            };
            let sp = [spread(&f.smc), spread(&f.tcp)]
                .into_iter()
                .flatten()
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))));
            let _ = writeln!(
                o,
                "{:<38} {:>7} {:>11} {:>11} {:>8} {:>8} {:>6} {:>7}",
                f.spec.label,
                f.spec.unit,
                num(median(&f.smc)),
                match (reference, bound) {
                    (true, Some((_, t, _))) => num(Some(t)),
                    (true, None) => String::new(),
                    (false, _) => num(median(&f.tcp)),
                },
                ratio
                    .map(|r| format!("{}x", fmt_num(r)))
                    .unwrap_or_default(),
                target,
                result,
                sp.map(|s| format!("{:.0}%", s * 100.0)).unwrap_or_default(),
            );
        }
        o
    }

    /// The JSON document.
    pub fn json(&self) -> Value {
        let mut workloads = serde_json::Map::new();
        for w in Workload::ALL {
            let figs: Vec<Value> = self
                .figures
                .iter()
                .filter(|f| f.spec.workload == w)
                .map(|f| {
                    let side = |v: &[f64]| json!({ "median": median(v), "rounds": v });
                    let mut j = json!({
                        "key": f.spec.key,
                        "label": f.spec.label,
                        "unit": f.spec.unit,
                        "better": match f.spec.better { Better::Lower => "lower", Better::Higher => "higher" },
                        "zero_ok": { "smc": f.spec.smc_zero_ok, "tcp": f.spec.tcp_zero_ok },
                    });
                    if w == Workload::Reference {
                        j["value"] = side(&f.smc);
                        if let Some((g, t, r)) = self.bound(f) {
                            j["bounds"] = json!({
                                "figure": g.spec.key,
                                "tcp_median": t,
                                "ratio_to_tcp": r,
                                "target_within_reach": g.spec.target.filter(|_| f.spec.verdict).map(|x| x.met(r)),
                            });
                        }
                    } else {
                        j["smc"] = side(&f.smc);
                        j["tcp"] = side(&f.tcp);
                        let r = Self::ratio(f);
                        j["ratio"] = json!(r);
                        if let Some(t) = f.spec.target {
                            j["target"] = match t {
                                Target::AtMost(x) => json!({ "at_most": x }),
                                Target::AtLeast(x) => json!({ "at_least": x }),
                            };
                            j["pass"] = json!(r.map(|r| t.met(r)));
                        }
                    }
                    j
                })
                .collect();
            if figs.is_empty() {
                continue;
            }
            let mut wj = json!({ "figures": figs });
            if let Some((s, t)) = self.modes.get(&w) {
                wj["connections"] = json!({ "smc": s, "tcp": t });
            }
            workloads.insert(w.key().to_string(), wj);
        }
        json!({
            "tool": "smc-bench",
            "version": env!("CARGO_PKG_VERSION"),
            "meta": self.meta,
            "rounds_done": self.rounds_done,
            "workloads": workloads,
            "preflight": { "smc": self.preflight.0, "tcp": self.preflight.1 },
            "server_accepted": self.server_accepted,
            "fallbacks": self.fallbacks(),
            "errors": self.errors,
        })
    }
}

/// A number with 3-4 significant digits.
pub fn fmt_num(x: f64) -> String {
    let a = x.abs();
    if a >= 1000.0 {
        format!("{x:.0}")
    } else if a >= 100.0 {
        format!("{x:.1}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else if a >= 0.01 {
        format!("{x:.3}")
    } else if a == 0.0 {
        "0".into()
    } else {
        format!("{x:.2e}")
    }
}
