//! What an SMC-R connection has not delivered yet, under smc_run
//! (tests/unsent.c): a writer that exits right after its last write, its
//! data still in its send buffer because the reader starts reading 7 s
//! later, delivers all of it, as over TCP where the kernel sends on after
//! the writer exited (a close at exit that gives up before the reader
//! comes leaves it `ECONNABORTED` after what its RMB held); and `SIOCOUTQ`
//! and `SIOCOUTQNSD` count the connection's unsent data, not its TCP
//! socket's. (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;
use std::io::Read;
use std::process::Stdio;

/// More than the reader's RMB (4 MiB) holds, within what the writer's send
/// buffer (1 MiB) takes on top: every write returns at once.
const BYTES: &str = "4718592";

#[test]
fn a_writer_that_exits_at_once_delivers_everything_to_a_late_reader() {
    let s = setup("unsent");
    let exe = compile_c("unsent", &s.dir);
    let portfile = s.dir.join("port");
    let mut reader = Server(
        under(
            &s,
            true,
            &exe,
            &["reader", portfile.to_str().unwrap(), "7000"],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let port = wait_for_port(&portfile)
        .expect("the reader's port")
        .to_string();
    let out = under(&s, true, &exe, &["writer", &port, BYTES])
        .output()
        .unwrap();
    let writer = ok_output("unsent writer", &out);
    let mut stdout = reader.0.stdout.take().unwrap();
    let status = reader.0.wait().unwrap();
    let mut got = String::new();
    stdout.read_to_string(&mut got).unwrap();
    assert!(status.success(), "reader: {status}\n{got}");
    let hash = writer
        .lines()
        .find_map(|l| l.strip_prefix(&format!("writer wrote {BYTES} bytes hash ")))
        .unwrap_or_else(|| panic!("{writer}"));
    assert!(
        got.contains(&format!("reader got {BYTES} bytes hash {hash}")),
        "writer: {writer}reader: {got}"
    );
    // (the reader had not read: the send buffer held the rest)
    assert!(
        writer.contains("writer SIOCOUTQ some, SIOCOUTQNSD at most that"),
        "{writer}"
    );
    // (every connection, both ends, over SMC-R)
    assert_eq!(assert_all(&s, 2, " SMC-R").len(), 2);
}
