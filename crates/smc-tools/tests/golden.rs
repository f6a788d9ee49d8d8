//! Golden output: the tools' views of a registry snapshot (two processes:
//! SMC-R connections in both roles, fallbacks with their reasons, a
//! listener, a closing IPv6 connection, an idle link group), human and
//! JSON, compared with the expected text in `tests/data/golden`.
//! `UPDATE_GOLDEN=1` rewrites the expected files (review the diff).

use serde_json::Value;
use smc_tools::view::{self, SmcrOpts, SsOpts};
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn snapshot() -> Vec<Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(data().join("registry"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

fn check(name: &str, got: &str) {
    let path = data().join("golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path:?}: {e} (UPDATE_GOLDEN=1 writes it)"));
    assert!(
        want == got,
        "{name} differs\n--- expected\n{want}\n--- got\n{got}"
    );
}

fn ss(f: impl FnOnce(&mut SsOpts)) -> SsOpts {
    let mut o = SsOpts::default();
    f(&mut o);
    o
}

#[test]
fn smcss_views() {
    let p = snapshot();
    check("smcss.txt", &view::smcss(&p, &ss(|_| {})));
    check("smcss-a.txt", &view::smcss(&p, &ss(|o| o.all = true)));
    check("smcss-l.txt", &view::smcss(&p, &ss(|o| o.listening = true)));
    check("smcss-d.txt", &view::smcss(&p, &ss(|o| o.debug = true)));
    check("smcss-R.txt", &view::smcss(&p, &ss(|o| o.smcr = true)));
    check("smcss-W.txt", &view::smcss(&p, &ss(|o| o.wide = true)));
    check("smcss-D.txt", &view::smcss(&p, &ss(|o| o.smcd = true)));
    let json = Value::Array(view::smcss_sockets(&p, &ss(|o| o.all = true)));
    check("smcss-a.json", &format!("{json:#}\n"));
}

#[test]
fn smcr_views() {
    let p = snapshot();
    let d = |details| SmcrOpts {
        details,
        absolute: false,
    };
    check("linkgroup.txt", &view::linkgroup_show(&p, &d(0), None));
    check("linkgroup-d.txt", &view::linkgroup_show(&p, &d(1), None));
    // an LG-ID with a link id in its low byte selects its link group
    let id = p[0]["link_groups"][1]["id"].as_u64().unwrap() as u32 | 1;
    check(
        "linkgroup-id.txt",
        &view::linkgroup_show(&p, &d(0), Some(id)),
    );
    check(
        "link-show-d.txt",
        &view::link_show(&p, &d(1), None, None, None),
    );
    check(
        "link-show-dd.txt",
        &view::link_show(&p, &d(2), None, Some("shm-lo"), None),
    );
    check(
        "link-show-netdev.txt",
        &view::link_show(&p, &d(0), None, None, Some("eth9")),
    );
    let sysfs = Path::new("/nonexistent");
    check(
        "device.txt",
        &view::device_show(&p, &d(0), None, None, sysfs),
    );
    check(
        "device-d.txt",
        &view::device_show(&p, &d(1), None, None, sysfs),
    );
    check("info.txt", &view::info(&p, "demo-host"));
}

#[test]
fn smcr_stats_views() {
    let p = snapshot();
    // the counters of the two processes, summed (no totals file: nothing
    // exited, no reset)
    let mut c = serde_json::json!({});
    for x in &p {
        smc::registry::files::combine(&mut c, &x["counters"], 1);
    }
    smc::registry::files::prune(&mut c);
    let g = view::gauges(&p);
    let o = |details| SmcrOpts {
        details,
        absolute: false,
    };
    check("stats.txt", &view::stats(&c, g, &o(0)));
    check("stats-d.txt", &view::stats(&c, g, &o(1)));
    check(
        "stats.json",
        &format!("{:#}\n", view::stats_json(&c, g, false)),
    );
    check("stats.prom", &view::prometheus(&c, g));
}

#[test]
fn every_reason_has_a_name() {
    use smc_wire::clc::DeclineCode;
    for d in DeclineCode::KNOWN {
        let n = view::reason_name(d.to_u32());
        assert!(!n.starts_with("0x"), "{d:?} has no name");
    }
    assert_eq!(view::reason_name(0x0301_0000), "PEER_NO_SMC");
    assert_eq!(view::reason_name(0x0303_0008), "NOUEID");
    assert_eq!(
        view::reason_name(smc::FALLBACK_NO_RENDEZVOUS),
        "NO_RENDEZVOUS"
    );
    assert_eq!(view::reason_name(0x0123_4567), "0x01234567");
}
