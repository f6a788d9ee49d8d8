//! The tokio adapter (`--features tokio`): async SmcStream / SmcListener over
//! loopback with the real SYN-option rendezvous and the shared-memory device
//! bound to `lo` (root: BPF). Async ↔ async on both runtime flavours, async ↔
//! blocking, fallbacks, end-of-file and wake-ups.
#![cfg(feature = "tokio")]

mod common;
use common::{pattern, Fnv};

use common::setup;
use smc::tokio::{SmcListener, SmcStream};
use smc::{Fallback, Mode};
use smc_wire::clc::{ClcMessage, Decline, DeclineCode, SMC_V1};
use smc_wire::types::SystemId;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Nothing here takes longer than this unless it hangs.
const HANG: Duration = Duration::from_secs(120);

const CHUNK: usize = 64 * 1024;

/// Sends `total` bytes of direction `dir`, then shuts the write side down;
/// returns their hash.
async fn send(mut w: impl AsyncWrite + Unpin, dir: u8, total: u64) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < total {
        let n = (total - off).min(CHUNK as u64) as usize;
        for (k, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(dir, off + k as u64);
        }
        w.write_all(&buf[..n]).await.expect("write");
        h.feed(&buf[..n]);
        off += n as u64;
    }
    w.flush().await.expect("flush");
    w.shutdown().await.expect("shutdown");
    h.0
}

/// Receives `total` bytes of direction `dir`, checking each, then end-of-file;
/// returns their hash.
async fn receive(mut r: impl AsyncRead + Unpin, dir: u8, total: u64) -> u64 {
    let mut h = Fnv::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < total {
        let n = r.read(&mut buf).await.expect("read");
        assert!(n > 0, "end of stream after {off} of {total} bytes");
        for (k, &b) in buf[..n].iter().enumerate() {
            let o = off + k as u64;
            assert_eq!(b, pattern(dir, o), "byte {o} of direction {dir} is wrong");
        }
        h.feed(&buf[..n]);
        off += n as u64;
    }
    assert_eq!(
        r.read(&mut buf).await.expect("read at the end"),
        0,
        "end-of-file after the peer's shutdown"
    );
    h.0
}

/// Both directions of one stream at once (writer in a task of its own).
/// Returns (hash sent, hash received).
async fn both_ways(s: SmcStream, out_dir: u8, total: u64) -> (u64, u64) {
    let (r, w) = tokio::io::split(s);
    let writer = tokio::spawn(send(w, out_dir, total));
    let got = receive(r, out_dir ^ 1, total).await;
    (writer.await.unwrap(), got)
}

/// `conns` async clients against one async server, `total` bytes each way on
/// every connection at once, all over SMC-R.
async fn exchange(conns: usize, total: u64) {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..conns {
            let (s, peer) = l.accept().await.unwrap();
            assert_eq!(s.mode(), Mode::SmcR, "server side of {peer}");
            tasks.push(tokio::spawn(both_ways(s, 1, total)));
        }
        let mut hashes = Vec::new();
        for t in tasks {
            hashes.push(t.await.unwrap());
        }
        hashes
    });
    let mut clients = Vec::new();
    for _ in 0..conns {
        clients.push(tokio::spawn(async move {
            let s = SmcStream::connect(addr).await.unwrap();
            assert_eq!(s.mode(), Mode::SmcR, "client side");
            assert_eq!(s.peer_addr().unwrap(), addr);
            both_ways(s, 0, total).await
        }));
    }
    let mut client_hashes = Vec::new();
    for c in clients {
        client_hashes.push(c.await.unwrap());
    }
    let server_hashes = server.await.unwrap();
    // what every client sent, some server connection received, and back
    let mut sent_up: Vec<u64> = client_hashes.iter().map(|h| h.0).collect();
    let mut got_up: Vec<u64> = server_hashes.iter().map(|h| h.1).collect();
    let mut sent_down: Vec<u64> = server_hashes.iter().map(|h| h.0).collect();
    let mut got_down: Vec<u64> = client_hashes.iter().map(|h| h.1).collect();
    for v in [&mut sent_up, &mut got_up, &mut sent_down, &mut got_down] {
        v.sort_unstable();
    }
    assert_eq!(sent_up, got_up);
    assert_eq!(sent_down, got_down);
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, f).await.expect("hangs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_mib_each_way_async_to_async() {
    bounded(exchange(1, 64 << 20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_connections_at_once_multi_thread() {
    bounded(exchange(20, 2 << 20)).await;
}

/// One thread for client and server: every wait is in the reactor.
#[tokio::test(flavor = "current_thread")]
async fn twenty_connections_and_64_mib_on_a_current_thread_runtime() {
    bounded(async {
        let big = tokio::spawn(exchange(1, 64 << 20));
        exchange(20, 1 << 20).await;
        big.await.unwrap();
    })
    .await;
}

/// `rounds` exchanges of a 64-byte message; the reader waits in `read().await`
/// every time and must be woken by the peer's data.
async fn ping_pong(rounds: usize) -> Duration {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        assert_eq!(s.mode(), Mode::SmcR);
        let mut m = [0u8; 64];
        for _ in 0..rounds {
            s.read_exact(&mut m).await.unwrap();
            m[0] = m[0].wrapping_add(1);
            s.write_all(&m).await.unwrap();
        }
    });
    let mut c = SmcStream::connect(addr).await.unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.set_nodelay(true).unwrap();
    let mut m = [0u8; 64];
    let start = Instant::now();
    for i in 0..rounds {
        m[0] = i as u8;
        m[63] = (i >> 8) as u8;
        c.write_all(&m).await.unwrap();
        c.read_exact(&mut m).await.unwrap();
        assert_eq!(m[0], (i as u8).wrapping_add(1), "round {i}");
        assert_eq!(m[63], (i >> 8) as u8, "round {i}");
    }
    let t = start.elapsed();
    server.await.unwrap();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_reader_wakes_for_each_message_multi_thread() {
    let t = bounded(ping_pong(1000)).await;
    eprintln!("1000 round trips (multi_thread): {t:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_waiting_reader_wakes_for_each_message_current_thread() {
    let t = bounded(ping_pong(1000)).await;
    eprintln!("1000 round trips (current_thread): {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_client_to_blocking_server() {
    setup();
    let l = smc::SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    const N: u64 = 8 << 20;
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mode = s.mode();
        // echo until end-of-file, then shut down our side
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
        s.shutdown(std::net::Shutdown::Write).unwrap();
        mode
    });
    let c = SmcStream::connect(addr).await.unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    let (r, w) = tokio::io::split(c);
    let writer = tokio::spawn(send(w, 7, N));
    let got = bounded(receive(r, 7, N)).await;
    assert_eq!(writer.await.unwrap(), got);
    assert_eq!(
        tokio::task::spawn_blocking(move || server.join().unwrap())
            .await
            .unwrap(),
        Mode::SmcR
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_to_async_server_and_conversions_both_ways() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let client = std::thread::spawn(move || {
        let mut c = smc::SmcStream::connect(addr).unwrap();
        assert_eq!(c.mode(), Mode::SmcR);
        for round in 0u8..4 {
            c.write_all(&[round; 1000]).unwrap();
            let mut b = [0u8; 1000];
            c.read_exact(&mut b).unwrap();
            assert!(b.iter().all(|&x| x == round + 100), "round {round}");
        }
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        rest
    });
    let (s, _) = bounded(l.accept()).await.unwrap();
    assert_eq!(s.mode(), Mode::SmcR);
    // async, blocking, async again: the connection goes on in each
    let answer = |s: &mut [u8; 1000]| {
        let r = s[0];
        s.fill(r + 100);
    };
    let mut s = s;
    let mut b = [0u8; 1000];
    s.read_exact(&mut b).await.unwrap();
    answer(&mut b);
    s.write_all(&b).await.unwrap();
    let mut blocking = s.into_std().unwrap();
    let blocking = tokio::task::spawn_blocking(move || {
        let mut b = [0u8; 1000];
        blocking.read_exact(&mut b).unwrap();
        answer(&mut b);
        blocking.write_all(&b).unwrap();
        blocking
    })
    .await
    .unwrap();
    let mut s = SmcStream::from_std(blocking).unwrap();
    assert_eq!(s.mode(), Mode::SmcR);
    for _ in 2..4 {
        s.read_exact(&mut b).await.unwrap();
        answer(&mut b);
        s.write_all(&b).await.unwrap();
    }
    assert_eq!(s.read(&mut b).await.unwrap(), 0, "client's shutdown");
    s.write_all(b"bye").await.unwrap();
    drop(s);
    let rest = tokio::task::spawn_blocking(move || client.join().unwrap())
        .await
        .unwrap();
    assert_eq!(rest, b"bye");
    // the listener converts too
    let l = SmcListener::from_std(l.into_std().unwrap()).unwrap();
    assert_eq!(l.local_addr().unwrap(), addr);
}

fn peer_no_smc() -> Mode {
    Mode::Tcp(Fallback {
        reason: DeclineCode::PeerNoSmc,
        peer: None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_client_to_plain_tcp_server_falls_back() {
    setup();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut first = [0u8; 5];
        s.read_exact(&mut first).await.unwrap();
        s.write_all(&first).await.unwrap();
        s.shutdown().await.unwrap();
        first
    });
    let mut c = SmcStream::connect(addr).await.unwrap();
    assert_eq!(c.mode(), peer_no_smc());
    let Mode::Tcp(f) = c.mode() else {
        unreachable!()
    };
    assert_eq!(f.code(), 0x0301_0000);
    c.write_all(b"hello").await.unwrap();
    let mut back = Vec::new();
    bounded(c.read_to_end(&mut back)).await.unwrap();
    assert_eq!(back, b"hello", "echo, then end-of-file");
    assert_eq!(
        &server.await.unwrap(),
        b"hello",
        "no CLC bytes reach a plain peer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tcp_client_to_async_server_falls_back() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut s, peer) = bounded(l.accept()).await.unwrap();
    assert_eq!(peer, c.local_addr().unwrap());
    assert_eq!(s.mode(), peer_no_smc());
    c.write_all(b"howdy").await.unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).await.unwrap();
    s.write_all(&b).await.unwrap();
    s.shutdown().await.unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"howdy");
}

/// A server that offers SMC on its SYN-ACK, then declines the Proposal and
/// sends its first data in the same segment: the async client falls back and
/// reads that data first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_right_behind_a_decline_is_not_lost() {
    setup();
    let fd = common::opted_in_socket();
    rustix::net::bind(&fd, &"127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = std::net::TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; 8];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head[4], 1, "a Proposal");
        let mut rest = vec![0u8; usize::from(u16::from_be_bytes([head[5], head[6]])) - 8];
        s.read_exact(&mut rest).unwrap();
        let d = Decline::new(SMC_V1, SystemId::default(), DeclineCode::NoSmcDev);
        let mut out = ClcMessage::Decline(d).encode();
        out.extend_from_slice(b"first data");
        s.write_all(&out).unwrap();
        let mut more = [0u8; 4];
        s.read_exact(&mut more).unwrap();
        more
    });
    let mut c = SmcStream::connect(addr).await.unwrap();
    assert_eq!(
        c.mode(),
        Mode::Tcp(Fallback {
            reason: DeclineCode::PeerDecl,
            peer: Some(DeclineCode::NoSmcDev),
        })
    );
    let mut b = [0u8; 10];
    bounded(c.read_exact(&mut b)).await.unwrap();
    assert_eq!(&b, b"first data");
    c.write_all(b"more").await.unwrap();
    let more = tokio::task::spawn_blocking(move || server.join().unwrap())
        .await
        .unwrap();
    assert_eq!(&more, b"more");
}

/// Handshakes run side by side inside the listener: a client that offers SMC
/// on its SYN and then says nothing does not hold up the next one (its own
/// handshake would only fail after 6 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_does_not_hold_up_accept() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let silent = common::opted_in_socket();
    rustix::net::connect(&silent, &addr).unwrap();
    let start = Instant::now();
    let (accepted, c) = tokio::join!(
        async {
            // the silent one arrives first; its handshake waits in the listener
            let (s, peer) = bounded(l.accept()).await.unwrap();
            (s.mode(), peer, start.elapsed())
        },
        SmcStream::connect(addr)
    );
    let c = c.unwrap();
    let (mode, peer, took) = accepted;
    assert_eq!(mode, Mode::SmcR);
    assert_eq!(
        peer,
        c.local_addr().unwrap(),
        "the talking client came first"
    );
    assert!(
        took < Duration::from_secs(5),
        "accept waited {took:?}, as if for the silent client's CLC timeout"
    );
    drop(silent);
}

/// Echoes one 5-byte message on an accepted stream; returns its mode.
async fn echo_five(l: &SmcListener) -> Mode {
    let (mut s, _) = l.accept().await.unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).await.unwrap();
    s.write_all(&b).await.unwrap();
    s.mode()
}

/// Connects, sends 5 bytes and checks the echo; returns the mode.
async fn hello(port: u16) -> Mode {
    let mut c = SmcStream::connect(("127.0.0.1", port)).await.unwrap();
    c.write_all(b"hello").await.unwrap();
    let mut b = [0u8; 5];
    c.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"hello");
    c.mode()
}

/// The child process of the test below: no SMC device at all.
async fn no_device_peer() {
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let port: u16 = line.trim().strip_prefix("port ").unwrap().parse().unwrap();
    let (server, client) = tokio::join!(echo_five(&l), hello(port));
    println!("child server {server:?}");
    println!("child client {client:?}");
}

/// A peer process without an SMC device (its SYNs still carry the option):
/// its async server declines our Proposal, its async client declines instead
/// of proposing, and both connections go on over TCP with the reasons Linux
/// gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_a_device_declines_both_ways() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    if std::env::var_os("SMC_TOKIO_NO_DEVICE").is_some() {
        return no_device_peer().await;
    }
    setup();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_peer_without_a_device_declines_both_ways",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SMC_TOKIO_NO_DEVICE", "1")
        .env_remove("SMC_RDMA_SHM_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    let port = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
        // (libtest may print "test NAME ... " on the same line first)
        if let Some((_, p)) = line.trim().split_once("port ") {
            break p.parse::<u16>().unwrap();
        }
    };
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "port {}", l.local_addr().unwrap().port()).unwrap();
    let (server, client) = bounded(async { tokio::join!(echo_five(&l), hello(port)) }).await;
    let rest = tokio::task::spawn_blocking(move || {
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        (rest, child.wait().unwrap())
    })
    .await
    .unwrap();
    assert!(rest.1.success(), "child failed: {}", rest.0);
    lines.extend(rest.0.lines().map(str::to_string));
    let child_mode = |who: &str| {
        lines
            .iter()
            .find_map(|l| l.find(who).map(|i| l[i + who.len()..].trim().to_string()))
            .unwrap_or_else(|| panic!("no {who:?} in the child's output: {lines:?}"))
    };
    // we proposed, the child's server declined with its reason
    let Mode::Tcp(Fallback {
        reason: DeclineCode::PeerDecl,
        peer: Some(theirs),
    }) = client
    else {
        panic!("client: {client:?}")
    };
    let their_server = Mode::Tcp(Fallback {
        reason: theirs,
        peer: None,
    });
    assert_eq!(child_mode("child server "), format!("{their_server:?}"));
    // the child's client declined instead of proposing
    let Mode::Tcp(Fallback {
        reason: DeclineCode::PeerDecl,
        peer: Some(theirs),
    }) = server
    else {
        panic!("server: {server:?}")
    };
    let their_client = Mode::Tcp(Fallback {
        reason: theirs,
        peer: None,
    });
    assert_eq!(child_mode("child client "), format!("{their_client:?}"));
    eprintln!("child server: {their_server:?}, child client: {their_client:?}");
}

/// This process's registry entry once `ok` holds for it.
fn wait_entry(dir: &std::path::Path, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let end = Instant::now() + Duration::from_secs(10);
    let path = dir.join(format!("{}.json", std::process::id()));
    loop {
        let v = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        if let Some(v) = &v {
            if ok(v) {
                return v.clone();
            }
        }
        assert!(Instant::now() < end, "registry entry never matched: {v:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sockets(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["sockets"].as_array().cloned().unwrap_or_default()
}

/// The tokio adapter's connections and listener are listed too: SMC-R with
/// its bytes, a fallback with its reason, the listener; and leave the list
/// when they are closed.
#[test]
fn the_tokio_adapter_publishes_its_sockets() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    setup();
    let dir = smc::registry::files::run_dir();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = smc::tokio::SmcListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let srv = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 5];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(&b).await.unwrap();
            (s, l)
        });
        let mut c = smc::tokio::SmcStream::connect(addr).await.unwrap();
        assert_eq!(c.mode(), Mode::SmcR);
        c.write_all(b"tokio").await.unwrap();
        let mut b = [0u8; 5];
        c.read_exact(&mut b).await.unwrap();
        let (s, l) = srv.await.unwrap();
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let f = smc::tokio::SmcStream::connect(plain.local_addr().unwrap())
            .await
            .unwrap();
        let caddr = c.local_addr().unwrap().to_string();
        let faddr = f.local_addr().unwrap().to_string();
        let a = addr.to_string();
        let gone = (dir.clone(), caddr.clone(), faddr.clone(), a.clone());
        let v = tokio::task::spawn_blocking(move || {
            wait_entry(&dir, |v| {
                let ss = sockets(v);
                ss.iter()
                    .any(|s| s["local"] == caddr.as_str() && s["tx_bytes"].as_u64() == Some(5))
                    && ss.iter().any(|s| {
                        s["local"] == faddr.as_str()
                            && s["fallback"]["reason"].as_u64() == Some(0x0301_0000)
                    })
                    && ss
                        .iter()
                        .any(|s| s["state"] == "LISTEN" && s["local"] == a.as_str())
            })
        })
        .await
        .unwrap();
        assert!(v["counters"]["smc"]["server"].as_u64() >= Some(1), "{v:#}");
        drop((c, f, s, l));
        let (dir, caddr, faddr, a) = gone;
        tokio::task::spawn_blocking(move || {
            wait_entry(&dir, |v| {
                !sockets(v).iter().any(|s| {
                    s["local"] == caddr.as_str()
                        || s["local"] == faddr.as_str()
                        || (s["state"] == "LISTEN" && s["local"] == a.as_str())
                })
            })
        })
        .await
        .unwrap();
    });
}

/// In place on both sides (`write_in_place` / `read_in_place`): 8 MiB from
/// a file straight into the peer's RMB and out of ours into a file, in odd
/// pieces that cross the RMB's end, with partial commits on the reading
/// side; the files match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_on_both_sides_moves_a_file() {
    use std::io::{Seek, SeekFrom};
    setup();
    const N: u64 = 8 << 20;
    let dir = std::env::temp_dir();
    let src_path = dir.join(format!("smc-tokio-in-place-src-{}", std::process::id()));
    let dst_path = dir.join(format!("smc-tokio-in-place-dst-{}", std::process::id()));
    let want: Vec<u8> = (0..N).map(|o| pattern(0, o)).collect();
    std::fs::write(&src_path, &want).unwrap();
    let src = std::fs::File::open(&src_path).unwrap();
    let mut dst = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&dst_path)
        .unwrap();
    std::fs::remove_file(&src_path).unwrap();
    std::fs::remove_file(&dst_path).unwrap();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let sender = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        assert_eq!(s.mode(), Mode::SmcR);
        let mut off = 0u64;
        // (where the peer has no room the send buffer takes the bytes, as
        // `poll_write` would: not every piece is lent in the RMB)
        let mut in_rmb = false;
        while off < N {
            let want = 700_001usize.min((N - off) as usize);
            let n = s
                .write_in_place(want, |w| {
                    in_rmb |= w.in_rmb();
                    w.read_from(0, &src, Some(off))
                })
                .await
                .unwrap();
            assert!(n > 0);
            off += n as u64;
        }
        s.shutdown().await.unwrap();
        in_rmb
    });
    let mut c = SmcStream::connect(addr).await.unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    let mut got = 0u64;
    let mut in_rmb = true;
    loop {
        let n = bounded(c.read_in_place(1 << 20, |r| {
            in_rmb &= r.in_rmb();
            // (takes a little less than it was lent, when it can)
            let take = if r.len() > 3 { r.len() - 3 } else { r.len() };
            r.write_to(0, take, &dst, Some(got))
        }))
        .await
        .unwrap();
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    assert_eq!(got, N);
    assert!(
        bounded(sender).await.unwrap(),
        "the writer was lent the peer's RMB"
    );
    assert!(in_rmb, "the reader was lent its RMB");
    let mut back = Vec::new();
    dst.seek(SeekFrom::Start(0)).unwrap();
    dst.read_to_end(&mut back).unwrap();
    assert!(back == want, "the file arrives unchanged");
}

/// Over a TCP fallback the async in-place calls go through a buffer: what
/// was written arrives, a partial read leaves the rest for the next read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_over_tcp_goes_through_a_buffer() {
    setup();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut first = [0u8; 5];
        s.read_exact(&mut first).await.unwrap();
        s.write_all(b"hello world").await.unwrap();
        s.shutdown().await.unwrap();
        first
    });
    let mut c = SmcStream::connect(addr).await.unwrap();
    assert!(matches!(c.mode(), Mode::Tcp(_)));
    let n = c
        .write_in_place(100, |w| {
            assert!(!w.in_rmb());
            w.copy_from(0, b"abcdefg")?;
            Ok(5)
        })
        .await
        .unwrap();
    assert_eq!(n, 5);
    assert_eq!(&bounded(server).await.unwrap(), b"abcde");
    let mut first = [0u8; 5];
    let took = bounded(c.read_in_place(64, |r| {
        if r.len() < 5 {
            return Ok(0);
        }
        r.copy_to(0, &mut first)?;
        Ok(5)
    }))
    .await
    .unwrap();
    if took == 5 {
        assert_eq!(&first, b"hello");
    }
    let mut rest = Vec::new();
    bounded(c.read_to_end(&mut rest)).await.unwrap();
    let whole: Vec<u8> = first[..took].iter().chain(rest.iter()).copied().collect();
    assert_eq!(whole, b"hello world", "nothing lost, nothing twice");
}
