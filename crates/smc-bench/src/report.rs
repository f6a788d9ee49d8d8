//! Results: every figure's per-round values for both transports, the
//! connection modes, the printed table and the JSON document.

use crate::conn::{Transport, SMC_R};
use crate::placement::Placement;
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
    /// A second goal of a compared figure, against a reference of the same
    /// run and placement rather than TCP: (the reference's key, the row's
    /// label, the goal for SMC-R median / reference median).
    pub vs_ref: Option<(String, String, Option<Target>)>,
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
            vs_ref: None,
        }
    }
    /// With a goal for SMC-R median / the median of reference `key` (same
    /// placement), shown as a row labelled `label` under this one.
    pub fn against(mut self, key: &str, label: &str, t: Target) -> Spec {
        self.vs_ref = Some((key.to_string(), label.to_string(), Some(t)));
        self
    }
    /// Also shown against reference `key` (its ratio only, no goal).
    pub fn beside(mut self, key: &str, label: &str) -> Spec {
        self.vs_ref = Some((key.to_string(), label.to_string(), None));
        self
    }
    /// A reference figure that bounds the compared figure `key`.
    pub fn versus(mut self, key: &str) -> Spec {
        self.versus = Some(key.to_string());
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

/// One figure in one placement: per-round values per transport (reference
/// figures use `smc` only and have no transport). `placement` is None for
/// figures that do not depend on it (memory, one-core memcpy).
#[derive(Clone, Debug)]
struct Figure {
    spec: Spec,
    placement: Option<Placement>,
    smc: Vec<f64>,
    tcp: Vec<f64>,
}

/// Print order of placements: cross, same, then what has none.
fn rank(p: Option<Placement>) -> usize {
    p.map_or(2, |p| p.kind as usize)
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

/// A reference held against the figure it bounds ([`Report::bound`]).
struct Bound<'a> {
    /// The bounded figure.
    figure: &'a Figure,
    /// The reference its goal is set against, or `None` for TCP.
    against: Option<&'a str>,
    /// That reference's median or the figure's TCP median.
    denominator: f64,
    /// The bounding reference's median / `denominator`.
    ratio: f64,
    /// The goal the figure is judged by on that ratio.
    target: Option<Target>,
}

impl Report {
    fn figure(&mut self, spec: &Spec, placement: Option<Placement>) -> &mut Figure {
        let i = match self
            .figures
            .iter()
            .position(|f| f.spec.key == spec.key && f.placement == placement)
        {
            Some(i) => i,
            None => {
                self.figures.push(Figure {
                    spec: spec.clone(),
                    placement,
                    smc: Vec::new(),
                    tcp: Vec::new(),
                });
                self.figures.len() - 1
            }
        };
        &mut self.figures[i]
    }

    /// Records one round's value of a compared figure in a placement.
    pub fn add(&mut self, spec: &Spec, placement: Option<Placement>, t: Transport, v: f64) {
        let f = self.figure(spec, placement);
        match t {
            Transport::Smc => f.smc.push(v),
            Transport::Tcp => f.tcp.push(v),
        }
    }

    /// Records one round's value of a reference figure in a placement.
    pub fn add_reference(&mut self, spec: &Spec, placement: Option<Placement>, v: f64) {
        self.figure(spec, placement).smc.push(v);
    }

    /// The figure `key` of placement `p`.
    fn find(&self, key: &str, p: Option<Placement>) -> Option<&Figure> {
        self.figures
            .iter()
            .find(|g| g.spec.key == key && g.placement == p)
    }

    /// For a compared figure with a goal against a reference: the
    /// reference's median (same placement) and SMC-R median / it.
    fn against(&self, f: &Figure) -> Option<(f64, Option<f64>)> {
        let (key, _, _) = f.spec.vs_ref.as_ref()?;
        let r = median(&self.find(key, f.placement)?.smc)?;
        let ratio = median(&f.smc)
            .filter(|s| s.is_finite() && r > 0.0)
            .map(|s| s / r);
        Some((r, ratio))
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

    /// For a reference figure that bounds a compared one: what it is held
    /// against and the reference's ratio to it (the best ratio any
    /// implementation could show on this machine).
    fn bound<'a>(&'a self, f: &Figure) -> Option<Bound<'a>> {
        let key = f.spec.versus.as_deref()?;
        let figure = self.find(key, f.placement)?;
        let s = median(&f.smc)?;
        // a figure whose goal is set against another reference (and none
        // against TCP) is bounded against that reference's median; the
        // reference its goal names is held against TCP (no goal there)
        let (against, denominator, target) = match (&figure.spec.target, &figure.spec.vs_ref) {
            (None, Some((r, _, Some(t)))) if *r != f.spec.key => (
                Some(r.as_str()),
                median(&self.find(r, f.placement)?.smc)?,
                Some(*t),
            ),
            _ => (None, median(&figure.tcp)?, figure.spec.target),
        };
        (denominator > 0.0 && s.is_finite()).then(|| Bound {
            figure,
            against,
            denominator,
            ratio: s / denominator,
            target,
        })
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
        let mut order: Vec<&Figure> = self.figures.iter().collect();
        order.sort_by_key(|f| (rank(f.placement), f.spec.workload));
        let mut last = None;
        let mut last_placement = None;
        for f in order {
            if last_placement != Some(f.placement) {
                let _ = writeln!(
                    o,
                    "== {}",
                    match f.placement {
                        Some(p) => p.describe(),
                        None => "any placement (not pinned per placement)".to_string(),
                    }
                );
                last_placement = Some(f.placement);
                last = None;
            }
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
            let ratio = Self::ratio(f).or(bound.as_ref().map(|b| b.ratio));
            let (target, result) = match (f.spec.target, ratio, &bound) {
                // a bound: is the bounded figure's target within it?
                (_, _, Some(b)) => match b.target {
                    Some(t) => (
                        t.text(),
                        if t.met(b.ratio) { "reach" } else { "beyond" }.to_string(),
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
                match (reference, &bound) {
                    (true, Some(b)) => num(Some(b.denominator)),
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
            if let (Some((_, label, t)), Some((r, ratio))) = (&f.spec.vs_ref, self.against(f)) {
                let _ = writeln!(
                    o,
                    "{:<38} {:>7} {:>11} {:>11} {:>8} {:>8} {:>6} {:>7}",
                    format!("  {label} (ref)"),
                    f.spec.unit,
                    num(median(&f.smc)),
                    num(Some(r)),
                    ratio
                        .map(|r| format!("{}x", fmt_num(r)))
                        .unwrap_or_default(),
                    t.map(Target::text).unwrap_or_default(),
                    match (ratio, t) {
                        (_, None) => "",
                        (Some(x), Some(t)) if t.met(x) => "PASS",
                        (Some(_), Some(_)) => "MISS",
                        (None, Some(_)) => "-",
                    },
                    "",
                );
            }
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
                        "placement": f.placement.map(|p| p.key()),
                        "cpus": f.placement.map(|p| json!({ "client": p.client, "server": p.server })),
                        "label": f.spec.label,
                        "unit": f.spec.unit,
                        "better": match f.spec.better { Better::Lower => "lower", Better::Higher => "higher" },
                        "zero_ok": { "smc": f.spec.smc_zero_ok, "tcp": f.spec.tcp_zero_ok },
                    });
                    if w == Workload::Reference {
                        j["value"] = side(&f.smc);
                        if let Some(b) = self.bound(f) {
                            j["bounds"] = match b.against {
                                None => json!({
                                    "figure": b.figure.spec.key,
                                    "tcp_median": b.denominator,
                                    "ratio_to_tcp": b.ratio,
                                    "target_within_reach": b.target.map(|x| x.met(b.ratio)),
                                }),
                                Some(r) => json!({
                                    "figure": b.figure.spec.key,
                                    "reference": r,
                                    "reference_median": b.denominator,
                                    "ratio_to_reference": b.ratio,
                                    "target_within_reach": b.target.map(|x| x.met(b.ratio)),
                                }),
                            };
                        }
                    } else {
                        j["smc"] = side(&f.smc);
                        j["tcp"] = side(&f.tcp);
                        let r = Self::ratio(f);
                        j["ratio"] = json!(r);
                        if let Some(t) = f.spec.target {
                            j["target"] = target_json(t);
                            j["pass"] = json!(r.map(|r| t.met(r)));
                        }
                        if let Some((key, label, t)) = &f.spec.vs_ref {
                            let (rm, ratio) = self.against(f).unwrap_or((f64::NAN, None));
                            j["vs_reference"] = json!({
                                "figure": key,
                                "label": label,
                                "reference_median": rm.is_finite().then_some(rm),
                                "ratio": ratio,
                                "target": t.map(target_json),
                                "pass": t.and_then(|t| ratio.map(|r| t.met(r))),
                            });
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

fn target_json(t: Target) -> Value {
    match t {
        Target::AtMost(x) => json!({ "at_most": x }),
        Target::AtLeast(x) => json!({ "at_least": x }),
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
