//! The tools run as a user runs them: real processes, a private configuration
//! directory, checked output and exit status.

use std::path::PathBuf;
use std::process::{Command, Output};

struct Env {
    dir: PathBuf,
}

impl Env {
    fn new(name: &str) -> Env {
        let dir = std::env::temp_dir().join(format!("smc-tools-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Env { dir }
    }
    fn run(&self, bin: &str, args: &[&str]) -> Output {
        Command::new(bin)
            .args(args)
            .env("SMC_RS_CONFIG_DIR", &self.dir)
            .output()
            .unwrap()
    }
    fn pnet(&self, args: &[&str]) -> Output {
        self.run(env!("CARGO_BIN_EXE_smc_pnet"), args)
    }
    fn smcr(&self, args: &[&str]) -> Output {
        self.run(env!("CARGO_BIN_EXE_smcr"), args)
    }
    fn smcss(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_smcss"))
            .args(args)
            .env("SMC_RS_CONFIG_DIR", &self.dir)
            .env("SMC_RS_RUN_DIR", self.dir.join("run"))
            .output()
            .unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn smc_pnet_session_as_in_the_man_page() {
    let e = Env::new("pnet");
    assert!(e.pnet(&["-a", "NET1", "-I", "eth1"]).status.success());
    assert!(e
        .pnet(&["-a", "NET1", "-D", "mlx5_0", "-P", "1"])
        .status
        .success());
    // permuted arguments, lower case folded, PCI name as device
    assert!(e
        .pnet(&["-I", "eth2", "-D", "0000:3b:00.1", "-a", "net2"])
        .status
        .success());
    let o = e.pnet(&[]);
    assert!(o.status.success());
    assert_eq!(
        out(&o),
        "NET1 eth1 n/a 255\nNET1 n/a mlx5_0 1\nNET2 eth2 n/a 255\nNET2 n/a 0000:3b:00.1 1\n"
    );
    assert_eq!(
        out(&e.pnet(&["-s", "NET1"])),
        "NET1 eth1 n/a 255\nNET1 n/a mlx5_0 1\n"
    );
    let j: serde_json::Value =
        serde_json::from_str(&out(&e.pnet(&["-s", "NET1", "--json"]))).unwrap();
    assert_eq!(j[1]["ibdevice"], "mlx5_0");
    assert_eq!(j[1]["ibport"], 1);
    assert_eq!(j[0]["interface"], "eth1");
    assert!(e.pnet(&["-d", "NET2"]).status.success());
    assert_eq!(out(&e.pnet(&[])), "NET1 eth1 n/a 255\nNET1 n/a mlx5_0 1\n");
    assert!(e.pnet(&["-f"]).status.success());
    assert_eq!(out(&e.pnet(&[])), "");
}

#[test]
fn smc_pnet_errors_say_what_smc_tools_says() {
    let e = Env::new("pnet-err");
    assert!(e.pnet(&["-a", "NET1", "-I", "eth1"]).status.success());
    let cases: &[(&[&str], &str)] = &[
        (&["-a", "NET9", "-I", "eth1"], "smc_pnet: Object exists"),
        (&["-a", "NET1"], "smc_pnet: interface or device missing"),
        (&["-s", "NOPE"], "smc_pnet: Object not found"),
        (&["-d", "NOPE"], "smc_pnet: Object not found"),
        (
            &["-a", "BAD-ID", "-I", "eth3"],
            "smc_pnet: Invalid input data or parameter",
        ),
        (
            &["-a", "NET1", "-D", "dev", "-P", "3"],
            "smc_pnet: invalid ib port:3",
        ),
        (&["-f", "NET1"], "smc_pnet: -f takes no parameters"),
        (&["-s", "A", "B"], "smc_pnet: too many parameters"),
        (&["-x"], "smc_pnet: invalid option -- 'x'"),
    ];
    for (args, msg) in cases {
        let o = e.pnet(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err(&o).starts_with(msg), "{args:?}: {}", err(&o));
    }
    // -P accepts strtoul base-0 numbers; 0 means the default port 1
    assert!(e
        .pnet(&["-a", "NET2", "-D", "rxe0", "-P", "0x2"])
        .status
        .success());
    assert!(e
        .pnet(&["-a", "NET3", "-D", "rxe1", "-P", "0"])
        .status
        .success());
    assert!(out(&e.pnet(&[])).contains("NET2 n/a rxe0 2\nNET3 n/a rxe1 1\n"));
    // -s warns about ignored options
    let o = e.pnet(&["-s", "NET1", "-I", "ethX"]);
    assert!(o.status.success());
    assert!(err(&o).contains("interface ethX ignored"));
    // a malformed table file is reported with its line, not silently ignored
    std::fs::write(e.dir.join("pnet.conf"), "NET1 eth eth1\nnonsense\n").unwrap();
    let o = e.pnet(&[]);
    assert!(!o.status.success());
    assert!(err(&o).contains("line 2"), "{}", err(&o));
}

#[test]
fn smcr_ueid_add_show_del_flush() {
    let e = Env::new("ueid");
    assert_eq!(out(&e.smcr(&["ueid"])), "");
    assert!(e.smcr(&["ueid", "add", "SMC-TEST-UEID"]).status.success());
    assert!(
        e.smcr(&["u", "a", "SECOND.EID"]).status.success(),
        "prefixes"
    );
    assert_eq!(
        out(&e.smcr(&["ueid", "show"])),
        "SMC-TEST-UEID\nSECOND.EID\n"
    );
    let j: serde_json::Value = serde_json::from_str(&out(&e.smcr(&["--json", "ueid"]))).unwrap();
    assert_eq!(j, serde_json::json!(["SMC-TEST-UEID", "SECOND.EID"]));
    let o = e.smcr(&["ueid", "add", "SMC-TEST-UEID"]);
    assert!(!o.status.success());
    assert!(err(&o).contains("already defined"));
    for x in ["A3", "A4"] {
        assert!(e.smcr(&["ueid", "add", x]).status.success());
    }
    let o = e.smcr(&["ueid", "add", "A5"]);
    assert!(
        err(&o).contains("maximum number of User EIDs is reached"),
        "{}",
        err(&o)
    );
    assert!(e.smcr(&["ueid", "del", "A3"]).status.success());
    let o = e.smcr(&["ueid", "del", "A3"]);
    assert!(err(&o).contains("not defined"));
    assert!(e.smcr(&["ueid", "flush"]).status.success());
    assert_eq!(out(&e.smcr(&["ueid"])), "");
}

#[test]
fn smcr_validation_and_usage_errors() {
    let e = Env::new("smcr-err");
    for bad in ["smc", "SMC..X", "SMC_X", &"A".repeat(33)] {
        let o = e.smcr(&["ueid", "add", bad]);
        assert!(!o.status.success());
        assert!(
            err(&o).starts_with("Error: Invalid User EID specified"),
            "{bad}: {}",
            err(&o)
        );
    }
    let o = e.smcr(&["-x", "ueid"]);
    assert_eq!(o.status.code(), Some(255));
    assert!(err(&o).contains("Option \"-x\" is unknown"));
    let o = e.smcr(&["bogus"]);
    assert_eq!(o.status.code(), Some(255));
    assert!(err(&o).contains("Object \"bogus\" is unknown"));
    let o = e.smcr(&["seid"]);
    assert!(err(&o).contains("valid for SMC-D only"));
    let o = e.smcr(&["ueid", "add"]);
    assert_eq!(o.status.code(), Some(255));
    assert!(err(&o).contains("Usage: smcr ueid"));
}

#[test]
fn smcss_rejects_what_smcss_rejects() {
    let e = Env::new("smcss");
    for (args, msg) in [
        (
            &["-D", "-R"][..],
            "--smcd together with --smcr is not supported",
        ),
        (
            &["-l", "-d"][..],
            "--listening together with --debug is not supported",
        ),
        (
            &["-la"][..],
            "--listening together with --all is not supported",
        ),
        (
            &["-l", "-R"][..],
            "--listening together with --smcr is not supported",
        ),
        (
            &["--listening", "--smcd"][..],
            "--listening together with --smcd is not supported",
        ),
        (&["-x"][..], "smcss: invalid option -- 'x'"),
        (&["--bogus"][..], "smcss: unrecognized option '--bogus'"),
    ] {
        let o = e.smcss(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let text = err(&o);
        assert!(
            text.starts_with(&format!("{msg}\nUsage: smcss [ OPTIONS ]\n")),
            "{args:?}: {text}"
        );
        assert_eq!(out(&o), "");
    }
    let o = e.smcss(&["-h"]);
    assert!(o.status.success());
    assert!(out(&o).starts_with("Usage: smcss [ OPTIONS ]\n"));
    let o = e.smcss(&["-v"]);
    assert!(out(&o).starts_with("smcss utility, smc-rs-"));
    // no process publishes anything: the header alone
    let o = e.smcss(&[]);
    assert!(o.status.success());
    assert_eq!(
        out(&o),
        "State          UID   Inode   Local Address           Peer Address            Intf Mode PID/Program\n"
    );
    assert_eq!(out(&e.smcss(&["--json"])), "[]\n");
}

#[test]
fn smcr_objects_parse_as_smc_tools_does() {
    let e = Env::new("smcr-objects");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_smcr"))
            .args(args)
            .env("SMC_RS_CONFIG_DIR", &e.dir)
            .env("SMC_RS_RUN_DIR", e.dir.join("run"))
            .output()
            .unwrap()
    };
    // prefixes: l = linkgroup, l = link-show, d = device, s = stats, i = info
    let o = run(&["l", "l"]);
    assert!(o.status.success(), "{o:?}");
    assert!(out(&o).starts_with("LG-ID    LG-Role  LG-Type  Net-Dev"));
    assert!(out(&run(&["d"])).starts_with("Net-Dev         IB-Dev"));
    assert!(out(&run(&["i"])).starts_with("Kernel Capabilities\n"));
    assert!(out(&run(&["s"])).starts_with("SMC-R Connections Summary\n"));
    for (args, usage) in [
        (&["linkgroup", "bogus"][..], "Usage: smcr linkgroup"),
        (
            &["linkgroup", "show", "1", "2", "3", "4", "5"][..],
            "Usage: smcr linkgroup",
        ),
        (&["device", "ibdev"][..], "Usage: smcr device"),
        (&["stats", "bogus"][..], "Usage: smcr stats"),
        (&["info", "x"][..], "Usage: smcr info"),
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(255), "{args:?}");
        assert!(err(&o).starts_with(usage), "{args:?}: {}", err(&o));
    }
    // options before the object only (ours, --json, also after it)
    let o = run(&["stats", "-d"]);
    assert_eq!(o.status.code(), Some(255));
    let j: serde_json::Value = serde_json::from_str(&out(&run(&["stats", "--json"]))).unwrap();
    assert!(j["SMCR"].is_object());
    // a reset with nothing running works and leaves zeros
    assert!(run(&["stats", "reset"]).status.success());
    assert!(out(&run(&["stats"])).contains("  Total connections handled             0\n"));
}
