//! Issue 13, finding 1: the RDMA link fails after the CLC Confirm. A TCP proxy
//! between an `SmcStream` and an `SmcListener` (both on the shm device on `lo`)
//! changes the PSN in the server's CLC Accept, so the client's QP expects
//! other sequence numbers than the server's sends carry and the first link
//! fails once the CLC exchange is done. Both ends must end on TCP with exactly
//! one Decline between them (the late decline of `protocol-clc.md` §4.2 step 8
//! and §4.3 step 13: the server declines, the client reads that Decline and
//! sends none), no CLC byte may reach either application, and nothing of the
//! connection may be left. Root: the BPF rendezvous.

mod common;

use common::{opted_in_listener, opted_in_socket, setup};
use smc::{Fallback, Mode, SmcListener, SmcStream};
use smc_wire::clc::{ClcHeader, ClcMessage, DeclineCode, CLC_HEADER_LEN};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// A connection whose SYN carries the SMC option (as the client's).
fn opted_in_connect(to: SocketAddr) -> TcpStream {
    let fd = opted_in_socket();
    rustix::net::connect(&fd, &to).unwrap();
    TcpStream::from(fd)
}

fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16384];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Proxies one connection to `server`, changing the PSN of the server's CLC
/// Accept; `rewrote` tells that it did.
fn psn_changing_proxy(l: TcpListener, server: SocketAddr, rewrote: Arc<AtomicBool>) {
    thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let upstream = opted_in_connect(server);
        let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
        thread::spawn(move || copy(c2, u2));
        let (mut from, mut to) = (upstream, client);
        // the server's first CLC message: its Accept
        let mut msg = vec![0u8; CLC_HEADER_LEN];
        from.read_exact(&mut msg).unwrap();
        let len = usize::from(ClcHeader::peek(&msg).unwrap().length);
        msg.resize(len, 0);
        from.read_exact(&mut msg[CLC_HEADER_LEN..]).unwrap();
        if let Ok(ClcMessage::Accept(mut a)) = ClcMessage::decode(&msg) {
            a.psn = (a.psn ^ 0x5a_5a5a) & 0xff_ffff;
            msg = ClcMessage::Accept(a).encode();
            rewrote.store(true, Ordering::SeqCst);
        }
        to.write_all(&msg).unwrap();
        copy(from, to);
    });
}

fn pattern(dir: u8, i: usize) -> u8 {
    common::pattern(dir, i as u64)
}

/// No connection of this process is left on any device (and, once its idle
/// link groups are gone, no link group either), within `limit`.
fn wait_for_nothing_left(limit: Duration) -> Vec<smc::DeviceState> {
    let end = Instant::now() + limit;
    loop {
        let st = smc::state();
        if st.iter().all(|d| d.connections == 0 && d.link_groups == 0) || Instant::now() > end {
            return st;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_link_that_fails_after_the_confirm_ends_on_tcp_with_the_data_intact() {
    setup();
    const GREETING: usize = 3000;
    const ECHO: usize = 5000;
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let server_addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mode = s.mode();
        // the server speaks first, then echoes what the client sends
        let greeting: Vec<u8> = (0..GREETING).map(|i| pattern(1, i)).collect();
        s.write_all(&greeting).unwrap();
        let mut got = vec![0u8; ECHO];
        s.read_exact(&mut got).unwrap();
        s.write_all(&got).unwrap();
        // the client's end of file, and nothing else, follows
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        (mode, got, rest)
    });
    let pl = opted_in_listener();
    let proxy_addr = pl.local_addr().unwrap();
    let rewrote = Arc::new(AtomicBool::new(false));
    psn_changing_proxy(pl, server_addr, rewrote.clone());

    let mut c = SmcStream::connect(proxy_addr).unwrap();
    assert!(rewrote.load(Ordering::SeqCst), "the proxy changed the PSN");
    let mut greeting = vec![0u8; GREETING];
    c.read_exact(&mut greeting).unwrap();
    let want: Vec<u8> = (0..GREETING).map(|i| pattern(1, i)).collect();
    assert!(
        greeting == want,
        "the client read something else than the server's data: {:02x?}",
        &greeting[..32]
    );
    let data: Vec<u8> = (0..ECHO).map(|i| pattern(0, i)).collect();
    c.write_all(&data).unwrap();
    let mut back = vec![0u8; ECHO];
    c.read_exact(&mut back).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let client_mode = c.mode();
    let (server_mode, got, rest) = srv.join().unwrap();
    assert!(
        got == data,
        "the server read something else than the client's data: {:02x?}",
        &got[..32]
    );
    assert!(back == data, "the echo differs: {:02x?}", &back[..32]);
    assert!(rest.is_empty(), "bytes after the data: {rest:02x?}");

    // Both on TCP, with one Decline between them: one side declines, the
    // other reads it (PEERDECL with the decliner's code) and sends none.
    // Over the sim fabric (engine tests) the link fails after the Confirm and
    // the server's TIMEOUT_CL is the one Decline; the shm device checks the
    // PSNs at its QP rendezvous, so here whichever end's QP meets the wrong
    // PSN first declines ERR_RDYLNK — the client before its Confirm, or the
    // server after it (then the client is in the late phase, as in the
    // finding). Either way no CLC byte may reach the application (checked
    // above) and the two modes must agree.
    let one_decline = |decliner: Mode, reader: Mode| match (decliner, reader) {
        (
            Mode::Tcp(Fallback {
                reason: code,
                peer: None,
            }),
            Mode::Tcp(Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(read),
            }),
        ) => code == read && matches!(code, DeclineCode::TimeoutCl | DeclineCode::ErrRdyLnk),
        _ => false,
    };
    assert!(
        one_decline(client_mode, server_mode) || one_decline(server_mode, client_mode),
        "(client, server) modes: {:?}",
        (client_mode, server_mode)
    );
    drop(c);
    // nothing of the connection is left, nor of the link groups its first
    // contact created on either side
    let st = wait_for_nothing_left(Duration::from_secs(10));
    assert!(
        st.iter().all(|d| d.connections == 0 && d.link_groups == 0),
        "left over: {st:?}"
    );
}
