//! Issue 13, finding 4 (b): a server process at its descriptor limit.
//! Another client process's existing SMC-R connections keep moving data,
//! new connections fall back or fail cleanly, and the server does not spin
//! on accept's EMFILE. The server and the holding client are this test
//! binary started again.

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

/// The server of (b): echoes on every connection, with a descriptor limit
/// it reaches once `SMC_F4_LIMIT` connections are open.
fn limited_server() {
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let limit: u64 = std::env::var("SMC_F4_LIMIT").unwrap().parse().unwrap();
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

/// The client process of (b) holding connections that must keep working.
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

#[test]
fn finding4_a_server_at_its_descriptor_limit_hurts_only_new_connections() {
    setup();
    if std::env::var_os("SMC_F4_LIMITED").is_some() {
        return limited_server();
    }
    if std::env::var_os("SMC_F4_HOLDER").is_some() {
        return holding_client();
    }
    const HOLD: usize = 100;
    // room for the held connections, not for many more
    let limit = 4 * HOLD + 40;
    let (server, _sout, port) = spawn_self(
        "finding4_a_server_at_its_descriptor_limit_hurts_only_new_connections",
        &[
            ("SMC_F4_LIMITED", "1".as_ref()),
            ("SMC_F4_LIMIT", limit.to_string().as_ref()),
        ],
    );
    let mut holder = Command::new(std::env::current_exe().unwrap())
        .args([
            "finding4_a_server_at_its_descriptor_limit_hurts_only_new_connections",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SMC_F4_HOLDER", "1")
        .env("SMC_F4_PORT", port.to_string())
        .env("SMC_F4_HOLD", HOLD.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut hin = holder.stdin.take().unwrap();
    let mut hout = BufReader::new(holder.stdout.take().unwrap());
    let (server, holder) = (Reaped(server), Reaped(holder));
    line_with(&mut hout, "held ");
    let mut round = |r: usize| {
        writeln!(hin, "{r}").unwrap();
        hin.flush().unwrap();
        let l = line_with(&mut hout, "round ");
        l.rsplit(' ').next().unwrap().parse::<usize>().unwrap()
    };
    assert_eq!(round(0), 0, "the held connections work before the limit");
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
    let cpu0 = cpu_ticks(server.0.id());
    let t0 = Instant::now();
    thread::sleep(Duration::from_secs(2));
    let cpu = cpu_ticks(server.0.id()) - cpu0;
    let secs = t0.elapsed().as_secs_f64();
    let cpu_s = cpu as f64 / rustix::param::clock_ticks_per_second() as f64;
    eprintln!(
        "server at its limit after {} plain connections: {cpu_s:.2} s of CPU in {secs:.1} s",
        plain.len()
    );
    // a spinning accept loop takes a whole core
    assert!(
        cpu_s < 0.25 * secs,
        "the server spins at its descriptor limit: {cpu_s:.2} s of CPU in {secs:.1} s"
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
    drop(hin);
    drop((holder, server));
}
