//! The benchmark as a user runs it, with tiny sizes: `smc-bench --quick` as two
//! processes over SMC-R and TCP (root: BPF). Every workload must be in the JSON
//! with positive figures, the SMC connections must all be SMC-R and the TCP
//! ones plain TCP. A second run without a usable SMC device must fall back,
//! say so loudly and exit 3.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WORKLOADS: [&str; 6] = ["pingpong", "rr", "bulk", "setup", "memory", "reference"];

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
    Command::new(env!("CARGO_BIN_EXE_smc-bench"))
        .env("SMC_RDMA_SHM_CONFIG", dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", dir.join("conf"))
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
    for col in ["SMC-R", "TCP", "SMC/TCP", "target", "result", "PASS|MISS"] {
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
    // The five targets each have a verdict.
    let verdicts = doc["workloads"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|w| w["figures"].as_array().unwrap())
        .filter(|f| f["pass"].is_boolean())
        .count();
    assert_eq!(verdicts, 5, "{doc:#}");
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

#[test]
fn bad_arguments_are_refused_clearly() {
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
        (&["--json", "/nonexistent-dir/x.json"][..], "--json"),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
