//! Issue 13, finding 4 (b): a server process at its descriptor limit does
//! not spin on accept's EMFILE (blocking and tokio listeners), its new
//! connections fall back or fail cleanly, and another client process's
//! existing SMC-R connections keep moving data. The servers and the holding
//! client are this test binary started again.

mod common;

use common::{fds, line_with, set_nofile, setup, spawn_self, Reaped};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Process CPU time (user + system) of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // after the command name in parentheses: fields 14 and 15 are utime, stime
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// CPU seconds process `pid` spends over `d`, and the seconds that took.
fn cpu_over(pid: u32, d: Duration) -> (f64, f64) {
    let cpu0 = cpu_ticks(pid);
    let t0 = Instant::now();
    thread::sleep(d);
    let cpu = cpu_ticks(pid) - cpu0;
    (
        cpu as f64 / rustix::param::clock_ticks_per_second() as f64,
        t0.elapsed().as_secs_f64(),
    )
}

/// The server: echoes on every connection, with a descriptor limit it
/// reaches once about `SMC_F4_LIMIT` descriptors are open
/// (`SMC_F4_TOKIO`: with the tokio listener).
fn limited_server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let limit: u64 = std::env::var("SMC_F4_LIMIT").unwrap().parse().unwrap();
    #[cfg(feature = "tokio")]
    if std::env::var_os("SMC_F4_TOKIO").is_some() {
        return limited_tokio_server(l, limit);
    }
    // the limit counts from the descriptors this process has now
    set_nofile(fds() as u64 + limit);
    let mut errors = 0u64;
    loop {
        match l.accept() {
            Ok((mut s, _)) => {
                thread::spawn(move || {
                    let mut buf = [0u8; 64];
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
            // as with a TcpListener: the error is reported, the server goes on
            Err(_) => {
                errors += 1;
                if errors % 16 == 1 {
                    eprintln!("accept error #{errors}");
                }
            }
        }
    }
}

#[cfg(feature = "tokio")]
fn limited_tokio_server(l: SmcListener, limit: u64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let l = smc::tokio::SmcListener::from_std(l).unwrap();
        set_nofile(fds() as u64 + limit);
        loop {
            // (an error is reported as by a TcpListener; the server goes on)
            if let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n @ 1..) = s.read(&mut buf).await {
                        if s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
}

/// The client process holding connections that must keep working.
fn holding_client() {
    let port: u16 = std::env::var("SMC_F4_PORT").unwrap().parse().unwrap();
    let n: usize = std::env::var("SMC_F4_HOLD").unwrap().parse().unwrap();
    let mut conns: Vec<SmcStream> = (0..n)
        .map(|_| SmcStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    assert!(conns.iter().all(|c| c.mode() == Mode::SmcR));
    println!("held {n}");
    std::io::stdout().flush().unwrap();
    // rounds of traffic on every connection, on request
    for line in std::io::stdin().lines() {
        let round = line.unwrap();
        let mut bad = 0;
        let mut first = None;
        for (i, c) in conns.iter_mut().enumerate() {
            let msg = format!("{round}/{i:06}");
            let mut back = vec![0u8; msg.len()];
            let r = c
                .write_all(msg.as_bytes())
                .and_then(|()| c.read_exact(&mut back));
            if r.is_err() || back != msg.as_bytes() {
                bad += 1;
                first.get_or_insert(format!("{r:?}"));
            }
        }
        if let Some(e) = first {
            eprintln!("holder: round {round}: {bad} bad, first: {e}");
        }
        println!("round {round} bad {bad}");
        std::io::stdout().flush().unwrap();
    }
}

/// The held connections of another process: `round(r)` moves a message on
/// each and returns how many failed.
struct Holder {
    _child: Reaped,
    tx: std::process::ChildStdin,
    rx: BufReader<std::process::ChildStdout>,
}

impl Holder {
    fn start(test: &str, port: u16, n: usize) -> Holder {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_F4_HOLDER", "1")
            .env("SMC_F4_PORT", port.to_string())
            .env("SMC_F4_HOLD", n.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let tx = c.stdin.take().unwrap();
        let mut rx = BufReader::new(c.stdout.take().unwrap());
        line_with(&mut rx, "held ");
        Holder {
            _child: Reaped(c),
            tx,
            rx,
        }
    }

    fn round(&mut self, r: usize) -> usize {
        writeln!(self.tx, "{r}").unwrap();
        self.tx.flush().unwrap();
        let l = line_with(&mut self.rx, "round ");
        l.rsplit(' ').next().unwrap().parse::<usize>().unwrap()
    }
}

/// Connections another process holds while the server reaches its limit.
const HOLD: usize = 100;

/// The scenario of `test`: a server (`tokio`: with the tokio listener) with
/// room for about HOLD SMC-R connections; with `hold`, another process holds
/// HOLD of them, which must keep working throughout.
fn at_the_limit(test: &str, tokio: bool, hold: bool) {
    if std::env::var_os("SMC_F4_LIMITED").is_some() {
        return limited_server();
    }
    if std::env::var_os("SMC_F4_HOLDER").is_some() {
        return holding_client();
    }
    let limit = 4 * HOLD + 40;
    let mut env: Vec<(&str, std::ffi::OsString)> = vec![
        ("SMC_F4_LIMITED", "1".into()),
        ("SMC_F4_LIMIT", limit.to_string().into()),
    ];
    if tokio {
        env.push(("SMC_F4_TOKIO", "1".into()));
    }
    let env: Vec<(&str, &std::ffi::OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    let (server, _sout, port) = spawn_self(test, &env);
    let server = Reaped(server);
    let mut holder = hold.then(|| Holder::start(test, port, HOLD));
    let mut round = |r: usize| holder.as_mut().map_or(0, |h| h.round(r));
    assert_eq!(round(0), 0, "the held connections work before the limit");
    // What the server spends below its limit: its held connections' idle
    // readers wake now and then (their timers), which is not what is looked
    // for at the limit.
    let idle = cpu_over(server.0.id(), Duration::from_secs(2));
    // Plain TCP connections from this process until the server has no
    // descriptor left: the last one is not served (it waits in the
    // server's backlog). They are kept open.
    let mut plain = Vec::new();
    loop {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut b = *b"tc";
        let served = c.write_all(&b).is_ok() && c.read_exact(&mut b).is_ok();
        plain.push(c);
        if !served {
            break;
        }
        assert!(
            plain.len() < 10 * HOLD,
            "the server has no descriptor limit"
        );
    }
    assert_eq!(round(1), 0, "held connections broke at the limit");
    // At the limit, with a connection in its backlog that it has no
    // descriptor for: the server must not spin on accept's EMFILE.
    let (cpu_s, secs) = cpu_over(server.0.id(), Duration::from_secs(2));
    eprintln!(
        "server at its limit after {} plain connections: {cpu_s:.2} s of CPU in {secs:.1} s \
         ({:.2} s in {:.1} s below it)",
        plain.len(),
        idle.0,
        idle.1
    );
    // a spinning accept loop takes a whole core
    assert!(
        cpu_s < idle.0 / idle.1 * secs + 0.25 * secs,
        "the server spins at its descriptor limit: {cpu_s:.2} s of CPU in {secs:.1} s \
         ({:.2} s in {:.1} s below it)",
        idle.0,
        idle.1
    );
    assert_eq!(round(2), 0, "held connections broke at the limit");
    // New SMC connections while the server is at (or next to) its limit:
    // each gets SMC-R, falls back to TCP or fails cleanly (an error within
    // the CLC handshake's own 6 s bound). One plain connection is closed
    // before each, so that the server has a descriptor for the TCP socket
    // but hardly any for the connection's buffers.
    let mut outcome = [0usize; 3];
    let mut extra = Vec::new();
    for i in 0..3 {
        drop(plain.remove(0));
        thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        match SmcStream::connect(("127.0.0.1", port)) {
            Ok(mut c) => {
                let mut b = *b"xy";
                let echoed = c.set_read_timeout(Some(Duration::from_secs(10))).is_ok()
                    && c.write_all(&b).is_ok()
                    && c.read_exact(&mut b).is_ok();
                let k = match (echoed, c.mode()) {
                    (true, Mode::SmcR) => 0,
                    (true, _) => 1,
                    (false, _) => 2,
                };
                outcome[k] += 1;
                eprintln!("new connection {i}: {:?}, echoed: {echoed}", c.mode());
                extra.push(c);
            }
            Err(e) => {
                outcome[2] += 1;
                eprintln!("new connection {i}: {e} after {:?}", start.elapsed());
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "connection {i} failed after {:?}: {e}",
                    start.elapsed()
                );
            }
        }
        assert_eq!(round(3 + i), 0, "held connections broke at the limit");
    }
    eprintln!(
        "new connections: {} SMC-R, {} TCP, {} failed",
        outcome[0], outcome[1], outcome[2]
    );
    drop(plain);
    drop(extra);
    drop(server);
}

#[test]
fn finding4_a_blocking_listener_at_its_descriptor_limit_does_not_spin() {
    setup();
    at_the_limit(
        "finding4_a_blocking_listener_at_its_descriptor_limit_does_not_spin",
        false,
        false,
    );
}

#[cfg(feature = "tokio")]
#[test]
fn finding4_a_tokio_listener_at_its_descriptor_limit_does_not_spin() {
    setup();
    at_the_limit(
        "finding4_a_tokio_listener_at_its_descriptor_limit_does_not_spin",
        true,
        false,
    );
}

#[test]
fn finding4_a_server_at_its_descriptor_limit_hurts_only_new_connections() {
    setup();
    at_the_limit(
        "finding4_a_server_at_its_descriptor_limit_hurts_only_new_connections",
        false,
        true,
    );
}
