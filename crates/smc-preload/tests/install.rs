//! `install.sh`: where it puts `smc_run` and the library, and that the
//! installed `smc_run` finds the library there. (root: the SYN-option
//! rendezvous loads a BPF program.)

mod common;

use common::*;

/// `install.sh` puts smc_run in PREFIX/bin and the library in
/// PREFIX/lib/<multiarch>, and the installed smc_run finds it there (no
/// copy next to it) and gives SMC-R.
#[test]
fn install_puts_smc_run_and_the_library_where_a_distribution_does() {
    let s = setup("install");
    let root = s.dir.join("root");
    let from = Path::new(SMC_RUN).parent().unwrap();
    let out = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("install.sh"))
        .args([
            "--prefix",
            "/usr",
            "--destdir",
            root.to_str().unwrap(),
            "--from",
        ])
        .arg(from)
        .output()
        .unwrap();
    ok_output("install.sh", &out);
    let bin = root.join("usr/bin/smc_run");
    let arch = match std::env::consts::ARCH {
        "x86" => "i386",
        "powerpc64" => "powerpc64le",
        a => a,
    };
    let lib = root.join(format!("usr/lib/{arch}-linux-gnu/libsmc_preload.so"));
    assert!(bin.is_file() && lib.is_file(), "{bin:?} {lib:?}");
    let e = Command::new(&bin)
        .args(["sh", "-c", "echo $LD_PRELOAD"])
        .env_remove("LD_PRELOAD")
        .env_remove("SMC_PRELOAD_LIB")
        .output()
        .unwrap();
    let got = ok_output("installed smc_run", &e);
    assert_eq!(
        std::fs::canonicalize(got.trim_end()).unwrap(),
        std::fs::canonicalize(&lib).unwrap()
    );
    // a connection through the installed pair
    let portfile = s.dir.join("port");
    let mut srv = Server(
        Command::new(&bin)
            .arg(&s.echo)
            .args(["server", portfile.to_str().unwrap()])
            .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
            .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
            .env("SMC_RUN_STATE", s.dir.join("state"))
            .env_remove("LD_PRELOAD")
            .env_remove("SMC_PRELOAD_LIB")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let port = wait_for_port(&portfile).expect("the server did not start");
    let out = Command::new(&bin)
        .arg(&s.echo)
        .args(["client", &port.to_string(), &(1 << 20).to_string()])
        .env("SMC_RDMA_SHM_CONFIG", s.dir.join("shm.conf"))
        .env("SMC_RS_CONFIG_DIR", s.dir.join("conf"))
        .env("SMC_RUN_STATE", s.dir.join("state"))
        .env_remove("LD_PRELOAD")
        .env_remove("SMC_PRELOAD_LIB")
        .output()
        .unwrap();
    assert_eq!(
        ok_output("echo client", &out),
        format!("client ok {}\n", 1 << 20)
    );
    // (the server ends after the echo, its record written)
    assert!(srv.0.wait().unwrap().success());
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}
