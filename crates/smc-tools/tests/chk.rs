//! `smc_chk` against live servers (shared-memory device on `lo`, root for
//! the BPF rendezvous): smc-tools' verdicts and reasons.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};

fn setup() -> (std::path::PathBuf, MutexGuard<'static, ()>) {
    setup_as("chk")
}

/// The tests of this file one at a time (they set the process's
/// environment), each with its own directories.
fn setup_as(tag: &str) -> (std::path::PathBuf, MutexGuard<'static, ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    std::env::remove_var("SMC_RDMA_SHM_CONFIG");
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root (BPF); CI runs as root"
    );
    let base = std::env::temp_dir().join(format!("smc-tools-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::env::set_var("SMC_RS_RUN_DIR", base.join("registry"));
    std::env::set_var("SMC_RS_CONFIG_DIR", base.join("conf"));
    smc::use_loopback_device(&format!("smc-tools-{tag}-{}", std::process::id()));
    (base, guard)
}

fn chk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smc_chk"))
        .args(args)
        .output()
        .unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

struct Killed(std::process::Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn smc_chk_says_whether_smc_r_is_used() {
    let (base, _serial) = setup();
    // -S: a server on the first free port from the one asked for
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let from = taken.local_addr().unwrap().port();
    let mut srv = Killed(
        Command::new(env!("CARGO_BIN_EXE_smc_chk"))
            .args(["-S", "-p", &from.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(srv.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .trim()
        .strip_prefix("Server started on port ")
        .unwrap_or_else(|| panic!("{line:?}"))
        .parse()
        .unwrap();
    assert!(port > from, "{from} is taken: the next free port");

    let o = chk(&["-C", "127.0.0.1", "-p", &port.to_string()]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.starts_with(&format!("Test with target IP 127.0.0.1 and port {port}\n")),
        "{text}"
    );
    assert!(text.contains("     SYN option:   ok"), "{text}");
    assert!(
        text.contains("     UEID:         none (SMC-R v1 only"),
        "{text}"
    );
    assert!(text.contains("     Device:       shm-lo\n"), "{text}");
    assert!(text.ends_with("     Success, using SMC-R\n"), "{text}");

    // a plain TCP server: fallback, and why
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = plain.local_addr().unwrap().port().to_string();
    let o = chk(&["-C", "127.0.0.1", "-p", &p]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        out(&o).ends_with(
            "     Failed  (TCP fallback), reasons:\n          Client:        0x03010000   peer did not indicate SMC\n"
        ),
        "{}",
        out(&o)
    );
    drop(plain);
    // nobody listening
    let o = chk(&["-C", "127.0.0.1", "-p", &p]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        out(&o).ends_with("     Failed, no connection\n"),
        "{}",
        out(&o)
    );

    // modes do not mix; no mode: the usage
    let o = chk(&["-S", "-C", "127.0.0.1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr)
        .starts_with("Error: Cannot combine options '--connect' and '--server'"));
    let o = chk(&[]);
    assert!(o.status.success());
    assert!(out(&o).starts_with("Usage: smc_chk [OPTIONS] -C <IP>\n"));
    drop(srv);
    let _ = std::fs::remove_dir_all(base);
}

/// `-s` and `-l` (smc-tools' undocumented static and live modes), for
/// SMC-R: what the interface depends on, then a live connection over it;
/// a broken device configuration shows as an error, not only as "no SMC
/// device".
#[test]
fn smc_chk_static_and_live_tests_per_interface() {
    let (base, _serial) = setup_as("chk-l");
    let o = chk(&["-s", "-l", "lo"]);
    let text = out(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.starts_with("Static analysis (SMC-R)\n"), "{text}");
    assert!(text.contains("  Interface lo\n"), "{text}");
    assert!(
        text.contains("     RDMA ports:   shm-lo port 1 (shm, Active, its interface)"),
        "{text}"
    );
    assert!(
        text.contains("     Reachable:    SMC-R v1: 127.0.0.0/8"),
        "{text}"
    );
    assert!(
        text.contains("  Live test on interface lo (127.0.0.1)\n     Device:       shm-lo\n     Success, using SMC-R\n"),
        "{text}"
    );
    // an interface that does not exist
    let o = chk(&["-l", "nosuchif0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("Interface 'nosuchif0'"));
    // a broken shm device configuration: the fallback and its cause
    let bad = base.join("broken.conf");
    std::fs::write(&bad, "this is not a device line\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_smc_chk"))
        .args(["-l", "lo"])
        .env("SMC_RDMA_SHM_CONFIG", &bad)
        .output()
        .unwrap();
    let text = out(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("Failed  (TCP fallback)"), "{text}");
    assert!(text.contains("     Error:        device_config"), "{text}");
    let _ = std::fs::remove_dir_all(base);
}
