//! Issue 13, finding 5: half-open connections. A peer whose TCP connection
//! goes away (FIN, or RST through SO_LINGER 0) in any phase — before its
//! Proposal, after it, after the server's Accept, after a bogus Confirm on
//! the link-group reuse path, or on an established connection — leaves
//! nothing behind in the server: no SMC connection (`smc::state()`), no
//! thread, no descriptor, no memfd, no resident memory beyond its baseline,
//! within a few seconds. In Linux an SMC connection and its TCP connection
//! end together (smc_close.c `smc_close_active_abort`, af_smc.c
//! `__smc_release`).
//!
//! The server is this test binary started again (`SMC_F5_SERVER`): a
//! thread accepting, a thread per connection reading until end-of-file or
//! an error (a server as it is commonly written), and on stdin a request for
//! its counts. The hostile clients speak CLC through `smc_wire` from the
//! parent.

mod common;

use common::{opted_in_socket, setup};
use smc::{Mode, SmcListener, SmcStream};
use smc_wire::clc::{AcceptConfirm, ClcMessage};
use smc_wire::types::{Mac, SystemId};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const TEST: &str = "finding5_a_tcp_end_in_every_phase_leaves_nothing_behind";

/// How long the server may take to get back to its baseline: the engine's
/// 1 s grace for a close CDC after the TCP end, and margin.
const SETTLE: Duration = Duration::from_secs(8);

/// Counts of this process.
fn counts() -> String {
    let [conns, groups, threads, fds, memfds, rss_kib] = common::held();
    format!("conns={conns} groups={groups} threads={threads} fds={fds} memfds={memfds} rss_kib={rss_kib}")
}

fn server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    thread::spawn(move || {
        while let Ok((mut s, _)) = l.accept() {
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        if line.trim() == "counts" {
            println!("counts {}", counts());
            std::io::stdout().flush().unwrap();
        }
    }
}

struct Server {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    addr: SocketAddr,
}

/// Parsed counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Counts {
    conns: u64,
    groups: u64,
    threads: u64,
    fds: u64,
    memfds: u64,
    rss_kib: u64,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_F5_SERVER", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let port = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "server exited");
            if let Some((_, p)) = line.trim().split_once("port ") {
                break p.parse::<u16>().unwrap();
            }
        };
        Server {
            child,
            stdin,
            out,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    fn counts(&mut self) -> Counts {
        writeln!(self.stdin, "counts").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "server exited");
            let Some(i) = line.find("counts ") else {
                continue;
            };
            let v: Vec<u64> = line[i + 7..]
                .split_whitespace()
                .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap())
                .collect();
            return Counts {
                conns: v[0],
                groups: v[1],
                threads: v[2],
                fds: v[3],
                memfds: v[4],
                rss_kib: v[5],
            };
        }
    }

    /// Waits until the server is back at `base` (RSS within `rss_slack_kib`).
    fn settles_to(&mut self, base: Counts, what: &str) {
        let end = Instant::now() + SETTLE;
        loop {
            let c = self.counts();
            let ok = c.conns == base.conns
                && c.threads <= base.threads
                && c.fds <= base.fds
                && c.memfds <= base.memfds
                && c.rss_kib <= base.rss_kib + RSS_SLACK_KIB;
            if ok {
                return;
            }
            assert!(
                Instant::now() < end,
                "{what}: the server did not get back to its baseline within {SETTLE:?}\n  \
                 baseline {base:?}\n  now      {c:?}"
            );
            thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Resident memory the server may gain for good (allocator caches).
const RSS_SLACK_KIB: u64 = 8 << 10;

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a hostile client ends its TCP connection.
#[derive(Clone, Copy, Debug)]
enum End {
    Fin,
    Rst,
}

fn end(s: TcpStream, how: End) {
    if let End::Rst = how {
        rustix::net::sockopt::set_socket_linger(&s, Some(Duration::ZERO)).unwrap();
    }
    drop(s);
}

/// An opted-in TCP connection to the server.
fn raw(addr: SocketAddr) -> TcpStream {
    let fd: OwnedFd = opted_in_socket();
    rustix::net::connect(&fd, &addr).unwrap();
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads one whole CLC message.
fn read_clc(s: &mut TcpStream) -> ClcMessage {
    let mut head = [0u8; 8];
    s.read_exact(&mut head).unwrap();
    let mut m = head.to_vec();
    m.resize(usize::from(u16::from_be_bytes([head[5], head[6]])), 0);
    s.read_exact(&mut m[8..]).unwrap();
    ClcMessage::decode(&m).unwrap()
}

/// A real Proposal of this process (captured from our own client by an
/// opted-in listener): the server has a link group with this process, so
/// the Proposal takes the reuse path.
fn our_proposal() -> smc_wire::clc::Proposal {
    let fd = opted_in_socket();
    rustix::net::bind(&fd, &"127.0.0.1:0".parse::<SocketAddr>().unwrap()).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    let l = TcpListener::from(fd);
    let addr = l.local_addr().unwrap();
    let srv = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        match read_clc(&mut s) {
            ClcMessage::Proposal(p) => p,
            m => panic!("not a Proposal: {m:?}"),
        }
    });
    let _ = SmcStream::connect(addr);
    srv.join().unwrap()
}

/// The hostile phases, each ended with `how`.
fn before_proposal(addr: SocketAddr, how: End) {
    end(raw(addr), how);
}

fn after_proposal(addr: SocketAddr, p: &[u8], how: End) {
    let mut s = raw(addr);
    s.write_all(p).unwrap();
    end(s, how);
}

fn after_accept(addr: SocketAddr, p: &[u8], how: End) -> AcceptConfirm {
    let mut s = raw(addr);
    s.write_all(p).unwrap();
    let a = match read_clc(&mut s) {
        ClcMessage::Accept(a) => a,
        m => panic!("not an Accept: {m:?}"),
    };
    end(s, how);
    a
}

/// On the reuse path (no first contact): a Confirm naming an RMB that does
/// not exist (wrong rkey and token), then the TCP end.
fn bogus_confirm(addr: SocketAddr, p: &smc_wire::clc::Proposal, how: End) {
    let mut s = raw(addr);
    s.write_all(&ClcMessage::Proposal(p.clone()).encode())
        .unwrap();
    let a = match read_clc(&mut s) {
        ClcMessage::Accept(a) => a,
        m => panic!("not an Accept: {m:?}"),
    };
    assert!(!a.first_contact, "the reuse path");
    let mut c = a.clone();
    c.peer_id = p.peer_id;
    c.gid = p.gid;
    c.mac = p.mac;
    c.rmb_rkey = a.rmb_rkey ^ 0x5a5a_5a5a;
    c.alert_token = a.alert_token.wrapping_add(0x1000);
    c.rmb_vaddr = 0x7700_0000;
    s.write_all(&ClcMessage::Confirm(c).encode()).unwrap();
    thread::sleep(Duration::from_millis(20));
    end(s, how);
}

/// An established SMC-R connection whose TCP connection is shut down under
/// it (the SMC connection itself is not closed).
fn established_fin(addr: SocketAddr) -> SmcStream {
    let mut c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    rustix::net::shutdown(c.tcp_fd(), rustix::net::Shutdown::Both).unwrap();
    c
}

/// An established SMC-R connection of a client process that dies with
/// SO_LINGER 0 on its TCP socket (RST), without closing anything.
fn established_rst_client() {
    let port: u16 = std::env::var("SMC_F5_PORT").unwrap().parse().unwrap();
    let mut c = SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    rustix::net::sockopt::set_socket_linger(c.tcp_fd(), Some(Duration::ZERO)).unwrap();
    println!("connected");
    std::io::stdout().flush().unwrap();
    thread::sleep(Duration::from_secs(60));
}

fn established_rst(port: u16) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_F5_CLIENT", "1")
        .env("SMC_F5_PORT", port.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "client exited");
        if line.contains("connected") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn finding5_a_tcp_end_in_every_phase_leaves_nothing_behind() {
    setup();
    if std::env::var_os("SMC_F5_SERVER").is_some() {
        return server();
    }
    if std::env::var_os("SMC_F5_CLIENT").is_some() {
        return established_rst_client();
    }
    let mut srv = Server::start();
    let addr = srv.addr;
    // Warm-up: the link group with this process, and a few buffers in the
    // server's pool, as the connections of the phases will need them.
    let warm: Vec<SmcStream> = (0..4)
        .map(|_| {
            let mut c = SmcStream::connect(addr).unwrap();
            assert_eq!(c.mode(), Mode::SmcR);
            c.write_all(b"warm").unwrap();
            let mut b = [0u8; 4];
            c.read_exact(&mut b).unwrap();
            c
        })
        .collect();
    drop(warm);
    let mut base = srv.counts();
    let end = Instant::now() + SETTLE;
    while base.conns != 0 {
        assert!(Instant::now() < end, "warm-up connections stay: {base:?}");
        thread::sleep(Duration::from_millis(100));
        base = srv.counts();
    }
    thread::sleep(Duration::from_millis(300));
    let base = srv.counts();
    eprintln!("baseline {base:?}");

    let p = our_proposal();
    let p_bytes = ClcMessage::Proposal(p.clone()).encode();
    // the same Proposal from a system the server has no link group with:
    // a first contact
    let mut stranger = p.clone();
    stranger.peer_id = SystemId::new(0xf00d, Mac([2, 0, 0, 0, 0xf5, 1]));
    let stranger = ClcMessage::Proposal(stranger).encode();

    for how in [End::Fin, End::Rst] {
        for _ in 0..3 {
            before_proposal(addr, how);
        }
        srv.settles_to(base, &format!("{how:?} before the Proposal"));
        for _ in 0..3 {
            after_proposal(addr, &p_bytes, how);
        }
        srv.settles_to(base, &format!("{how:?} after the Proposal"));
        for _ in 0..3 {
            after_accept(addr, &p_bytes, how);
        }
        srv.settles_to(base, &format!("{how:?} after the Accept"));
        for _ in 0..3 {
            let a = after_accept(addr, &stranger, how);
            assert!(a.first_contact, "a stranger's first contact");
        }
        srv.settles_to(base, &format!("{how:?} after a first contact's Accept"));
        for _ in 0..3 {
            bogus_confirm(addr, &p, how);
        }
        srv.settles_to(
            base,
            &format!("{how:?} after a bogus Confirm on the reuse path"),
        );
    }
    // established: the TCP connection shut down under a live connection
    let held: Vec<SmcStream> = (0..3).map(|_| established_fin(addr)).collect();
    srv.settles_to(base, "FIN on established connections");
    drop(held);
    // established: a client process dying with SO_LINGER 0 (RST)
    for _ in 0..2 {
        established_rst(addr.port());
    }
    srv.settles_to(base, "RST on established connections of a dead process");
}

/// The tokio adapter: a task waiting in `read().await` on a connection whose
/// peer's TCP connection went away is woken with an error (the engine resets
/// the connection after its 1 s grace, with no completion to wake anyone).
#[cfg(feature = "tokio")]
#[test]
fn finding5_a_tcp_end_wakes_a_waiting_tokio_reader_with_an_error() {
    use tokio::io::AsyncReadExt;
    setup();
    if std::env::var_os("SMC_F5_SERVER").is_some() || std::env::var_os("SMC_F5_CLIENT").is_some() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let l = rt
        .block_on(smc::tokio::SmcListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = l.local_addr().unwrap();
    let reader = rt.spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        assert_eq!(s.mode(), Mode::SmcR);
        let mut b = [0u8; 16];
        let t = Instant::now();
        let r = tokio::time::timeout(SETTLE, s.read(&mut b)).await;
        (r.map(|r| r.map_err(|e| e.kind())), t.elapsed())
    });
    let c = SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), Mode::SmcR);
    thread::sleep(Duration::from_millis(100));
    rustix::net::shutdown(c.tcp_fd(), rustix::net::Shutdown::Both).unwrap();
    let (r, took) = rt.block_on(reader).unwrap();
    match r {
        Ok(Err(kind)) => eprintln!("reader: {kind:?} after {took:?}"),
        Ok(Ok(n)) => panic!("reader got {n} bytes instead of an error"),
        Err(_) => panic!("the reader was not woken within {SETTLE:?}"),
    }
    drop(c);
}
