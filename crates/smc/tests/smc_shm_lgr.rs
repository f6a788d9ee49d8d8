//! Link-group sharing, alone in its own process: the link-group count is per
//! process, and other tests running in parallel would add their own groups.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Write};
use std::thread;

#[test]
fn a_hundred_connections_share_one_link_group_per_role() {
    setup();
    let l = SmcListener::bind("127.0.0.2:0").unwrap();
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let mut v = Vec::new();
        for _ in 0..100 {
            let (s, _) = l.accept().unwrap();
            assert_eq!(s.mode(), Mode::SmcR);
            v.push(s);
        }
        v
    });
    let clients: Vec<SmcStream> = (0..100)
        .map(|_| SmcStream::connect(addr).unwrap())
        .collect();
    assert!(clients.iter().all(|c| c.mode() == Mode::SmcR));
    let servers = srv.join().unwrap();
    // this process is both client and server: one link group per role, each
    // carrying all 100 connections (link groups are per peer and role, §6)
    let st = smc::state();
    let lo = st
        .iter()
        .find(|d| d.device == "shm-lo")
        .expect("shm-lo in use");
    assert!(lo.connections >= 200, "{st:?}");
    assert_eq!(lo.link_groups, 2, "{st:?}");
    // accepted in the order of the connects, each made after the one before
    // had finished on the client's side (a server whose handshake takes a
    // connection's answer later than the next one's would pair them wrongly
    // here, and each read below would wait for the other's data)
    for (i, (c, s)) in clients.iter().zip(&servers).enumerate() {
        assert_eq!(
            s.peer_addr().unwrap(),
            c.local_addr().unwrap(),
            "connection {i} accepted out of the order of the connects"
        );
    }
    // every connection still moves its own data
    for (i, (mut c, mut s)) in clients.into_iter().zip(servers).enumerate() {
        let b = [i as u8; 3];
        c.write_all(&b).unwrap();
        let mut got = [0u8; 3];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, b);
    }
}
