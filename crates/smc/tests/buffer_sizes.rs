//! `smc::set_buffer_sizes` (what `smc_run -r/-t` and `SMC_RCVBUF` /
//! `SMC_SNDBUF` come to): the connections whose handshakes start after it
//! have an RMB and a send buffer of the sizes asked for, rounded up to a
//! size class as Linux rounds an AF_SMC socket's `SO_RCVBUF`/`SO_SNDBUF`;
//! the peer learns the RMB's size; data flows through them. A listener's
//! and a connection's own sizes (`SmcListener::set_buffer_sizes`,
//! `SmcStream::from_connected_sized`) override the process's. In a test
//! binary of its own: the process's sizes are the same in both tests.

mod common;

use common::setup;
use serde_json::Value;
use smc::registry::files;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// This process's registry entry once it lists both `locals` with engine
/// facts (the registry thread publishes within about 100 ms).
fn entry_with(locals: &[String]) -> Vec<Value> {
    let end = Instant::now() + Duration::from_secs(10);
    let path = files::run_dir().join(format!("{}.json", std::process::id()));
    loop {
        if let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            let ss: Vec<Value> = v["sockets"].as_array().cloned().unwrap_or_default();
            let found: Vec<Value> = locals
                .iter()
                .filter_map(|l| {
                    ss.iter()
                        .find(|s| {
                            s["local"] == l.as_str() && s["mode"] == "SMCR" && s["rmb"].is_u64()
                        })
                        .cloned()
                })
                .collect();
            if found.len() == locals.len() {
                return found;
            }
        }
        assert!(Instant::now() < end, "the registry never listed {locals:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn connections_after_set_buffer_sizes_have_the_sizes_asked_for() {
    setup();
    // (100 KiB: class 128 KiB; 40 KiB: 64 KiB)
    smc::set_buffer_sizes(Some(100 << 10), Some(40 << 10));
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 253) as u8).collect();
    let expect = data.clone();
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        assert!(got == expect, "the bytes arrived changed");
        s.write_all(b"done").unwrap();
        (s, l)
    });
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    // (several times the RMB and the send buffer)
    c.write_all(&data).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    let (s, _l) = srv.join().unwrap();
    assert_eq!(c.buffer_sizes(), Some((128 << 10, 64 << 10)));
    assert_eq!(s.buffer_sizes(), Some((128 << 10, 64 << 10)));
    let found = entry_with(&[c.local_addr().unwrap().to_string()]);
    let client = &found[0];
    assert_eq!(client["rmb"].as_u64(), Some(128 << 10), "{client}");
    assert_eq!(client["sndbuf"].as_u64(), Some(64 << 10), "{client}");
    // the server's connection in this process asked for the same
    assert_eq!(client["peer_rmb"].as_u64(), Some(128 << 10), "{client}");
}

/// Sizes asked for one connection or one listener's connections override
/// the process's, field by field.
#[test]
fn a_listener_and_a_connection_ask_for_sizes_of_their_own() {
    setup();
    smc::set_buffer_sizes(Some(100 << 10), Some(40 << 10));
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    // (20 KiB: the 32 KiB class)
    l.set_buffer_sizes(Some(20 << 10), Some(20 << 10));
    let addr = l.local_addr().unwrap();
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 100_000];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        s
    });
    let fd = common::opted_in_socket();
    rustix::net::connect(&fd, &rustix::net::SocketAddrAny::from(addr)).unwrap();
    // (300 KiB: 512 KiB; the send buffer: the process's 64 KiB)
    let mut c = SmcStream::from_connected_sized(fd.into(), true, Some(300 << 10), None).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    let out: Vec<u8> = (0..100_000u32).map(|i| (i % 241) as u8).collect();
    c.write_all(&out).unwrap();
    let mut back = vec![0u8; out.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == out, "the echo changed");
    let s = srv.join().unwrap();
    assert_eq!(c.buffer_sizes(), Some((512 << 10, 64 << 10)));
    assert_eq!(s.buffer_sizes(), Some((32 << 10, 32 << 10)));
}
