//! The benchmark as a user runs it, with tiny sizes: `smc-bench --quick` as two
//! processes over SMC-R and TCP (root: BPF). Every workload must be in the JSON
//! with positive figures, in both placements (cross and same CPU) where the
//! placement matters, the SMC connections must all be SMC-R and the TCP
//! ones plain TCP. A second run without a usable SMC device must fall back,
//! say so loudly and exit 3. A run allowed one CPU measures the same-CPU
//! placement only and says so; bad CPUs and placements are refused.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WORKLOADS: [&str; 6] = ["pingpong", "rr", "bulk", "setup", "memory", "reference"];

/// Figures measured in each placement, by workload (memory has none).
const PLACED: [(&str, &[&str]); 5] = [
    ("pingpong", &["pingpong.64.median_us", "pingpong.64.p99_us"]),
    ("rr", &["rr.tps", "rr.polling_tps"]),
    (
        "bulk",
        &[
            "bulk.gbps",
            "bulk.cpu_s_per_gib",
            "bulk_in_place.gbps",
            "bulk_in_place.cpu_s_per_gib",
        ],
    ),
    ("setup", &["setup.conn_per_s"]),
    (
        "reference",
        &[
            "reference.ring_copy_gbps",
            "reference.one_copy_gbps",
            "reference.rr_ideal_threads_tps",
            "reference.rr_ideal_polling_tps",
            "reference.setup_clc_conn_per_s",
        ],
    ),
];

/// The figures of workload `w` with key `key`, as (placement, figure).
fn placements_of<'a>(doc: &'a Value, w: &str, key: &str) -> Vec<(Option<&'a str>, &'a Value)> {
    doc["workloads"][w]["figures"]
        .as_array()
        .unwrap_or_else(|| panic!("workload {w} missing: {doc:#}"))
        .iter()
        .filter(|f| f["key"] == key)
        .map(|f| (f["placement"].as_str(), f))
        .collect()
}

fn need_root() {
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF); CI runs as root"
    );
}

/// A private device directory with one `shm` device bound to `netdev`.
fn device_dir(tag: &str, netdev: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("smc-bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    std::fs::write(
        dir.join("shm.conf"),
        format!(
            "rundir {}\ndevice shm-{tag} netdev {netdev}\n",
            dir.join("run").display()
        ),
    )
    .unwrap();
    dir
}

fn bench(dir: &Path, args: &[&str]) -> Output {
    bench_with(dir, args, &[])
}

/// As [`bench`], with these environment variables set as well (and
/// `SMC_COPY_PIECES` only if among them: the copies' probe decides
/// otherwise, whatever the caller's environment says).
fn bench_with(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smc-bench"))
        .env("SMC_RDMA_SHM_CONFIG", dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", dir.join("conf"))
        .env_remove("SMC_COPY_PIECES")
        .envs(env.iter().copied())
        .args(args)
        .output()
        .unwrap()
}

fn positive(v: &Value, zero_ok: bool, what: &str) {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: not a number: {v}"));
    assert!(x.is_finite(), "{what}: {x}");
    if zero_ok {
        assert!(x >= 0.0, "{what}: {x} < 0");
    } else {
        assert!(x > 0.0, "{what}: {x} <= 0");
    }
}

#[test]
fn quick_run_measures_every_workload_over_smc_r_and_tcp() {
    need_root();
    let dir = device_dir("smoke", "lo");
    let json = dir.join("out.json");
    let out = bench(&dir, &["--quick", "--json", json.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "smc-bench failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for col in [
        "SMC-R",
        "TCP",
        "SMC/TCP",
        "target",
        "result",
        "PASS|MISS",
        "== cross: client process on CPU",
        "== same: client and server process both on CPU",
        "1 polling thread/side",
        "vs ideal shm rr (ref)",
        "vs ring copy (ref)",
    ] {
        let found = col.split('|').any(|c| stdout.contains(c));
        assert!(found, "table lacks {col:?}:\n{stdout}");
    }
    assert!(!stdout.contains("FELL BACK"), "{stdout}");

    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["rounds_done"], 2, "{doc:#}");
    assert_eq!(doc["errors"].as_array().map(Vec::len), Some(0), "{doc:#}");
    assert_eq!(doc["fallbacks"].as_object().map(|m| m.len()), Some(0));
    assert!(
        doc["server_accepted"]["SMC-R"].as_u64().unwrap_or(0) > 0,
        "server side: {}",
        doc["server_accepted"]
    );
    for w in WORKLOADS {
        let wl = &doc["workloads"][w];
        let figs = wl["figures"]
            .as_array()
            .unwrap_or_else(|| panic!("workload {w} missing: {doc:#}"));
        assert!(!figs.is_empty(), "{w}: no figures");
        for f in figs {
            let key = f["key"].as_str().unwrap();
            if w == "reference" {
                positive(&f["value"]["median"], false, key);
                continue;
            }
            for side in ["smc", "tcp"] {
                let zero_ok = f["zero_ok"][side].as_bool().unwrap();
                positive(&f[side]["median"], zero_ok, &format!("{key} {side}"));
                assert_eq!(
                    f[side]["rounds"].as_array().map(Vec::len),
                    Some(2),
                    "{key} {side}: one value per round"
                );
            }
            if !f["ratio"].is_null() {
                let zero_ok = f["zero_ok"]["smc"].as_bool().unwrap();
                positive(&f["ratio"], zero_ok, &format!("{key} ratio"));
            }
            if f.get("target").is_some() {
                assert!(f["pass"].is_boolean(), "{key}: target without verdict");
            }
        }
        if w == "reference" {
            continue;
        }
        // Both modes: every SMC-side connection SMC-R, every TCP-side one TCP.
        let conns = &wl["connections"];
        let smc = conns["smc"].as_object().unwrap();
        assert_eq!(smc.keys().collect::<Vec<_>>(), ["SMC-R"], "{w}: {conns}");
        assert!(smc["SMC-R"].as_u64().unwrap() > 0, "{w}: {conns}");
        let tcp = conns["tcp"].as_object().unwrap();
        assert_eq!(
            tcp.keys().collect::<Vec<_>>(),
            ["TCP (std socket)"],
            "{w}: {conns}"
        );
    }
    // Placements: both, on two different allowed CPUs, every placed figure
    // in each (one value per round), both processes pinned.
    let placements = doc["meta"]["placements"].as_array().unwrap();
    let names: Vec<&str> = placements
        .iter()
        .map(|p| p["placement"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["cross", "same"], "{doc:#}");
    let cpu = |i: usize, side: &str| placements[i][side].as_u64().unwrap();
    assert_ne!(cpu(0, "client_cpu"), cpu(0, "server_cpu"), "{doc:#}");
    assert_eq!(cpu(1, "client_cpu"), cpu(1, "server_cpu"), "{doc:#}");
    // the CPUs the run could use, as at its start (not the one it pinned
    // itself to last)
    let allowed: Vec<u64> = doc["meta"]["allowed_cpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    for side in ["client_cpu", "server_cpu"] {
        assert!(allowed.contains(&cpu(0, side)), "{side}: {doc:#}");
    }
    let said = format!("{} CPU(s) allowed: {allowed:?}", allowed.len());
    assert!(stdout.contains(&said), "{said}:\n{stdout}");
    for name in names {
        for side in ["client", "server"] {
            let n = &doc["meta"]["pinned_threads"][name][side];
            assert!(n.as_u64().unwrap_or(0) >= 1, "{name} {side}: {doc:#}");
        }
    }
    for (w, keys) in PLACED {
        for key in keys {
            let got = placements_of(&doc, w, key);
            let ps: Vec<Option<&str>> = got.iter().map(|(p, _)| *p).collect();
            assert_eq!(ps, [Some("cross"), Some("same")], "{key}: {doc:#}");
            for (p, f) in got {
                let i = usize::from(p == Some("same"));
                assert_eq!(f["cpus"]["client"].as_u64(), Some(cpu(i, "client_cpu")));
                assert_eq!(f["cpus"]["server"].as_u64(), Some(cpu(i, "server_cpu")));
                let side = if w == "reference" { "value" } else { "smc" };
                assert_eq!(f[side]["rounds"].as_array().map(Vec::len), Some(2), "{key}");
            }
        }
    }
    // placement-independent figures appear once, without a placement
    for (w, key) in [
        ("memory", "memory.each_rss_kib"),
        ("reference", "reference.memcpy_small_gbps"),
    ] {
        let ps: Vec<_> = placements_of(&doc, w, key)
            .iter()
            .map(|(p, _)| *p)
            .collect();
        assert_eq!(ps, [None], "{key}: {doc:#}");
    }
    // the cache-line round trip is a cross-core figure
    let ps: Vec<_> = placements_of(&doc, "reference", "reference.cacheline_rtt_ns")
        .iter()
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(ps, [Some("cross")], "{doc:#}");

    // Issue 15's targets, per placement, each with a verdict: against TCP
    // (64 B median and p99, rr in both shapes, setup) and against a
    // reference of the same placement (rr vs the ideal, bulk vs the ring).
    let target = |w: &str, key: &str, p: &str, vs_ref: bool| {
        let (_, f) = placements_of(&doc, w, key)
            .into_iter()
            .find(|(q, _)| *q == Some(p))
            .unwrap_or_else(|| panic!("{key} {p}: {doc:#}"));
        let j = if vs_ref { &f["vs_reference"] } else { f };
        assert!(j["pass"].is_boolean(), "{key} {p}: no verdict: {f}");
        let t = &j["target"];
        t["at_most"].as_f64().or(t["at_least"].as_f64()).unwrap()
    };
    assert_eq!(
        target("pingpong", "pingpong.64.median_us", "cross", false),
        0.15
    );
    assert_eq!(
        target("pingpong", "pingpong.64.median_us", "same", false),
        0.7
    );
    for p in ["cross", "same"] {
        assert_eq!(target("pingpong", "pingpong.64.p99_us", p, false), 1.0);
        assert_eq!(target("rr", "rr.tps", p, false), 1.5);
        assert_eq!(target("rr", "rr.tps", p, true), 0.6);
        assert_eq!(target("rr", "rr.polling_tps", p, false), 2.5);
        assert_eq!(target("bulk", "bulk.gbps", p, true), 0.95);
        assert_eq!(target("bulk", "bulk_in_place.gbps", p, true), 1.5);
        assert_eq!(target("bulk", "bulk_in_place.cpu_s_per_gib", p, true), 0.6);
        assert_eq!(target("setup", "setup.conn_per_s", p, false), 0.8);
        // setup beside its protocol's floor (TCP with the CLC's three
        // messages first): a ratio, no goal
        let (_, f) = placements_of(&doc, "setup", "setup.conn_per_s")
            .into_iter()
            .find(|(q, _)| *q == Some(p))
            .unwrap();
        let v = &f["vs_reference"];
        assert_eq!(v["figure"], "reference.setup_clc_conn_per_s", "{f}");
        assert!(v["ratio"].as_f64().is_some_and(|r| r > 0.0), "{f}");
        assert!(v["target"].is_null() && v["pass"].is_null(), "{f}");
        // one copy bounds the zero-copy stream against the ring copy it is
        // judged by: held against that reference, not TCP
        let (_, f) = placements_of(&doc, "reference", "reference.one_copy_gbps")
            .into_iter()
            .find(|(q, _)| *q == Some(p))
            .unwrap();
        let b = &f["bounds"];
        assert_eq!(b["figure"], "bulk_in_place.gbps", "{f}");
        assert_eq!(b["reference"], "reference.ring_copy_gbps", "{f}");
        let (one, ring) = (
            f["value"]["median"].as_f64().unwrap(),
            b["reference_median"].as_f64().unwrap(),
        );
        let r = b["ratio_to_reference"].as_f64().unwrap();
        assert!((r - one / ring).abs() < 1e-9 * r.max(1.0), "{f}");
        assert_eq!(b["target_within_reach"], r >= 1.5, "{f}");
        assert!(b["tcp_median"].is_null(), "{f}");
    }
    let verdicts = doc["workloads"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|w| w["figures"].as_array().unwrap())
        .map(|f| {
            usize::from(f["pass"].is_boolean())
                + usize::from(f["vs_reference"]["pass"].is_boolean())
        })
        .sum::<usize>();
    assert_eq!(verdicts, 18, "9 targets in each of 2 placements: {doc:#}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Pins the calling thread (so the processes it starts) to one of the CPUs
/// it may use, and returns that CPU.
fn pin_this_thread_to_one_cpu() -> usize {
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    let cpu = (0..rustix::thread::CpuSet::MAX_CPU)
        .find(|&c| set.is_set(c))
        .unwrap();
    let mut one = rustix::thread::CpuSet::new();
    one.set(cpu);
    rustix::thread::sched_setaffinity(None, &one).unwrap();
    cpu
}

#[test]
fn one_cpu_measures_the_same_placement_only_and_says_so() {
    need_root();
    let cpu = pin_this_thread_to_one_cpu();
    let dir = device_dir("onecpu", "lo");
    let json = dir.join("out.json");
    let out = bench(
        &dir,
        &[
            "--quick",
            "--rounds",
            "1",
            "--only",
            "pingpong,reference",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}:\n{stdout}\n{stderr}", out.status);
    assert!(
        stdout.contains("note: this process may use one CPU only"),
        "{stdout}"
    );
    assert!(!stdout.contains("== cross"), "{stdout}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        doc["meta"]["placements"],
        serde_json::json!([{"placement": "same", "client_cpu": cpu, "server_cpu": cpu}]),
        "{doc:#}"
    );
    assert!(doc["meta"]["placement_note"].is_string(), "{doc:#}");
    for (p, _) in placements_of(&doc, "pingpong", "pingpong.64.median_us") {
        assert_eq!(p, Some("same"), "{doc:#}");
    }
    // nothing needing two CPUs was attempted
    assert!(placements_of(&doc, "reference", "reference.cacheline_rtt_ns").is_empty());
    // and cross cannot be asked for
    let out = bench(&dir, &["--quick", "--placement", "cross"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--placement cross needs two CPUs"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_fallback_is_loud_and_fails_the_run() {
    need_root();
    // The only device is bound to an interface that does not exist: every SMC
    // connection declines and runs over TCP.
    let dir = device_dir("nodev", "smcbenchnone0");
    let json = dir.join("out.json");
    let out = bench(&dir, &["--quick", "--json", json.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("SMC FELL BACK TO TCP"), "{stdout}");
    assert!(stdout.contains("TCP fallback:"), "reason missing: {stdout}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(!doc["fallbacks"].as_object().unwrap().is_empty(), "{doc:#}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--ring-kib` sets the ring copy's ring, which the table names and the
/// JSON records; the default stays 1 MiB.
#[test]
fn the_ring_copys_ring_is_the_one_asked_for() {
    need_root();
    let dir = device_dir("ring", "lo");
    for (ask, ring, label) in [
        (None, 1 << 20, "ring copy in+out (1 MiB ring)"),
        (Some("256"), 256 << 10, "ring copy in+out (256 KiB ring)"),
    ] {
        let json = dir.join("ring.json");
        let mut args = vec!["--quick", "--only", "reference", "--placement", "same"];
        args.extend(["--json", json.to_str().unwrap()]);
        if let Some(k) = ask {
            args.extend(["--ring-kib", k]);
        }
        let out = bench(&dir, &args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {stdout}");
        assert!(stdout.contains(label), "{args:?}: {stdout}");
        let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(
            doc["meta"]["reference"]["ring_copy"]["ring"], ring,
            "{args:?}: {doc:#}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The JSON says whether copies at a short distance went in pieces
/// (`smc_rdma::copy`): what `SMC_COPY_PIECES` decided, or the probe's
/// answer without it.
#[test]
fn the_json_records_whether_copies_went_in_pieces() {
    need_root();
    let dir = device_dir("pieces", "lo");
    let json = dir.join("pieces.json");
    let args = [
        "--quick",
        "--only",
        "reference",
        "--placement",
        "same",
        "--json",
        json.to_str().unwrap(),
    ];
    for (setting, want) in [
        (Some("1"), Some(true)),
        (Some("0"), Some(false)),
        (None, None),
    ] {
        let env: Vec<(&str, &str)> = setting
            .map(|v| ("SMC_COPY_PIECES", v))
            .into_iter()
            .collect();
        let out = bench_with(&dir, &args, &env);
        assert!(
            out.status.success(),
            "{setting:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let got = doc["meta"]["copy_in_pieces"].as_bool();
        assert!(got.is_some(), "{setting:?}: {doc:#}");
        if want.is_some() {
            assert_eq!(got, want, "{setting:?}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_are_refused_clearly() {
    // a CPU this process may not use (sched_getaffinity): past the last one
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    let allowed: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect();
    let (first, last) = (allowed[0], allowed[allowed.len() - 1]);
    let bad_cpu = format!("{first},{}", last + 1);
    let twice = format!("{first},{first}");
    let not_allowed = format!("CPU {} is not one this process may use", last + 1);
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_smc-bench"))
            .args(args)
            .output()
            .unwrap()
    };
    for (args, says) in [
        (&["--rounds", "0"][..], "--rounds"),
        (
            &["--bulk-gib", "1", "--bulk-mib", "5"][..],
            "cannot be used with",
        ),
        (&["--only", "pingpong,nonsense"][..], "nonsense"),
        (&["--bulk-mib", "0"][..], "--bulk-mib"),
        (&["--ring-kib", "2"][..], "--ring-kib"),
        (&["--json", "/nonexistent-dir/x.json"][..], "--json"),
        (&["--placement", "cross,sideways"][..], "sideways"),
        (&["--cpus", "zero"][..], "--cpus"),
        (&["--cpus", "0,1,0"][..], "one or two CPUs"),
        (&["--cpus", &bad_cpu][..], &not_allowed),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // placement errors are argument errors (status 2), found before any
    // process starts
    for args in [&["--cpus", &bad_cpu][..], &["--cpus", &twice][..]] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("smc-bench: client pid"), "{stderr}");
    }
    let out = run(&["--cpus", &twice]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("must differ"));
}
