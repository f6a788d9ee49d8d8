//! A server that answers the client's Proposal only after the client's CLC
//! wait (6 s) ended: a server in user space runs a handshake when its
//! process gets to it (every process of a prefork server busy, a stopped
//! one). Over TCP the client would be served late; Linux's SMC client fails
//! its connect. Ours declines (SMC_CLC_DECL_TIMEOUT) and goes on over TCP:
//! its connect returns after the wait, its data reaches the server, and the
//! server's answer to the Proposal, which comes ahead of the server's data,
//! is taken off the stream — the application reads the server's data and
//! nothing else, blocking, non-blocking or async. The server here is a
//! plain TCP socket opted in to the SMC option that speaks CLC with
//! `smc_wire`. Root: the BPF rendezvous.

mod common;

use common::{opted_in_listener, setup};
use smc::{Fallback, Mode, SmcStream};
use smc_wire::clc::{ClcHeader, ClcMessage, ClcType, DeclineCode, CLC_HEADER_LEN, CLC_WAIT_TIME};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

/// The tests share this process's SMC state: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A v1 first-contact Accept (`protocol-clc.md` §6.1 (c)): the answer the
/// server gives the Proposal it reads after the client gave up.
const ACCEPT: [u8; 68] = [
    0xe2, 0xd4, 0xc3, 0xd9, 0x02, 0x00, 0x44, 0x18, 0x56, 0x78, 0x02, 0x00, 0x00, 0x00, 0x00, 0x02,
    0xfe, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xfe, 0x00, 0x00, 0x02,
    0x02, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x01, 0x23, 0x00, 0x00, 0x12, 0x34, 0x01, 0x00, 0x00,
    0xa0, 0x01, 0x23, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12, 0x34, 0x00, 0x00, 0x00, 0xab, 0xcd, 0xef,
    0xe2, 0xd4, 0xc3, 0xd9,
];

const FROM_CLIENT: &[u8] = b"the client's request";
const FROM_SERVER: &[u8] = b"the server's answer";

fn read_clc(s: &mut TcpStream) -> ClcMessage {
    let mut m = vec![0u8; CLC_HEADER_LEN];
    s.read_exact(&mut m).unwrap();
    let len = usize::from(ClcHeader::peek(&m).unwrap().length);
    m.resize(len, 0);
    s.read_exact(&mut m[CLC_HEADER_LEN..]).unwrap();
    ClcMessage::decode(&m).unwrap()
}

/// A server that gets to its connection 1 s after the client's CLC wait
/// ended: it reads the Proposal and the client's Decline, answers the
/// Proposal in two pieces `gap` apart, then after `gap` again sends its
/// data, and reads the client's.
fn late_server(gap: Duration) -> (SocketAddr, thread::JoinHandle<Vec<u8>>) {
    let l = opted_in_listener();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        thread::sleep(CLC_WAIT_TIME + Duration::from_secs(1));
        assert_eq!(read_clc(&mut s).msg_type(), ClcType::Proposal);
        match read_clc(&mut s) {
            ClcMessage::Decline(d) => assert_eq!(d.diagnosis, DeclineCode::Timeout),
            m => panic!("the client's Decline expected, got {m:?}"),
        }
        s.write_all(&ACCEPT[..30]).unwrap();
        thread::sleep(gap);
        s.write_all(&ACCEPT[30..]).unwrap();
        thread::sleep(gap);
        s.write_all(FROM_SERVER).unwrap();
        let mut got = vec![0u8; FROM_CLIENT.len()];
        s.read_exact(&mut got).unwrap();
        got
    });
    (addr, t)
}

/// Connects to `addr`, which answers late: the connect returns after the
/// CLC wait, on TCP, with the reason.
fn connect_late(addr: SocketAddr) -> SmcStream {
    let t0 = Instant::now();
    let c = SmcStream::connect(addr).expect("a connect that falls back, not one that fails");
    let waited = t0.elapsed();
    assert!(
        waited >= CLC_WAIT_TIME && waited < CLC_WAIT_TIME + Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(
        c.mode(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::Timeout,
            peer: None
        })
    );
    c
}

#[test]
fn a_late_answer_is_taken_off_the_stream_of_a_blocking_reader() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let (addr, server) = late_server(Duration::from_millis(200));
    let mut c = connect_late(addr);
    assert!(c.answer_owed());
    c.write_all(FROM_CLIENT).unwrap();
    let mut got = vec![0u8; FROM_SERVER.len()];
    c.read_exact(&mut got).unwrap();
    assert_eq!(got, FROM_SERVER);
    assert!(!c.answer_owed());
    assert_eq!(server.join().unwrap(), FROM_CLIENT);
}

#[test]
fn a_non_blocking_reader_never_sees_the_late_answer() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let (addr, server) = late_server(Duration::from_millis(300));
    let mut c = connect_late(addr);
    c.set_nonblocking(true).unwrap();
    c.write_all(FROM_CLIENT).unwrap();
    // Nothing of the answer, in whatever pieces it comes; WouldBlock until
    // the server's data.
    let mut got = Vec::new();
    let mut would_block = 0;
    let end = Instant::now() + Duration::from_secs(30);
    while got.len() < FROM_SERVER.len() && Instant::now() < end {
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                would_block += 1;
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got, FROM_SERVER);
    assert!(would_block > 0, "the reads before the data found none");
    assert_eq!(server.join().unwrap(), FROM_CLIENT);
}

#[test]
fn a_blocking_reader_s_timeout_holds_while_the_answer_is_owed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let (addr, server) = late_server(Duration::from_millis(1500));
    let mut c = connect_late(addr);
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    c.write_all(FROM_CLIENT).unwrap();
    let t0 = Instant::now();
    let e = c.read(&mut [0u8; 64]).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(1200),
        "{:?}",
        t0.elapsed()
    );
    c.set_read_timeout(None).unwrap();
    let mut got = vec![0u8; FROM_SERVER.len()];
    c.read_exact(&mut got).unwrap();
    assert_eq!(got, FROM_SERVER);
    assert_eq!(server.join().unwrap(), FROM_CLIENT);
}

#[cfg(feature = "tokio")]
#[test]
fn an_async_reader_never_sees_the_late_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let (addr, server) = late_server(Duration::from_millis(200));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t0 = Instant::now();
        let mut c = smc::tokio::SmcStream::connect(addr).await.unwrap();
        assert!(t0.elapsed() >= CLC_WAIT_TIME);
        assert_eq!(
            c.mode(),
            Mode::Tcp(Fallback {
                reason: DeclineCode::Timeout,
                peer: None
            })
        );
        c.write_all(FROM_CLIENT).await.unwrap();
        let mut got = vec![0u8; FROM_SERVER.len()];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, FROM_SERVER);
    });
    assert_eq!(server.join().unwrap(), FROM_CLIENT);
}
