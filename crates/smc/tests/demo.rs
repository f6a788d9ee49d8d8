//! The demo as a user runs it: two processes, one SmcStream and one TcpStream
//! (root: BPF). The SMC connection must be SMC-R across the two processes.

use std::process::Command;

#[test]
fn demo_runs_smc_r_between_two_processes() {
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "needs root (BPF); CI runs as root"
    );
    let dir = std::env::temp_dir().join(format!("smc-demo-test-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let cfg = dir.join("shm.conf");
    std::fs::write(
        &cfg,
        format!(
            "rundir {}\ndevice shm-lo netdev lo\n",
            dir.join("run").display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_smc-demo"))
        .env("SMC_RDMA_SHM_CONFIG", &cfg)
        .env("SMC_RS_CONFIG_DIR", dir.join("conf"))
        .env("SMC_DEMO_ROUNDS", "500")
        .env("SMC_DEMO_BULK_MIB", "16")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("SmcStream   mode SMC-R"), "{stdout}");
    assert!(
        stderr.contains("accepted, mode SmcR"),
        "server side: {stderr}"
    );
    assert!(stdout.contains("16 MiB one-way stream"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}
