//! Shared setup of the tests that run SMC-R over the shm device on `lo`.

use std::sync::Once;

/// Points this process (and the processes it starts) at a private shm device
/// bound to `lo` (root: BPF).
#[allow(dead_code)] // not every test binary uses it
pub fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        assert_eq!(
            rustix::process::geteuid().as_raw(),
            0,
            "needs root (BPF); CI runs as root"
        );
        if std::env::var_os("SMC_RDMA_SHM_CONFIG").is_some() {
            // a child process of a test: share its parent's device directory
            return;
        }
        // Directories of test processes that are gone are removed here (a
        // process cannot clean up after itself: statics are never dropped).
        if let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("smc-shm-test-") {
                    if pid.parse::<u32>().is_ok()
                        && !std::path::Path::new("/proc").join(pid).exists()
                    {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
            }
        }
        // a device directory of our own, and tables (PNET, UEID) of our own
        std::env::remove_var("SMC_RS_CONFIG_DIR");
        smc::use_loopback_device(&format!("smc-shm-test-{}", std::process::id()));
        // the registry (smcss, smcr) of the test's processes in the test's
        // own directory, not the host's
        if std::env::var_os("SMC_RS_RUN_DIR").is_none() {
            std::env::set_var(
                "SMC_RS_RUN_DIR",
                std::env::temp_dir()
                    .join(format!("smc-shm-test-{}", std::process::id()))
                    .join("registry"),
            );
        }
    });
}

/// A socket that carries the SMC option on its SYN (or SYN-ACK) like ours.
#[allow(dead_code)] // not every test binary uses it
pub fn opted_in_socket() -> std::os::fd::OwnedFd {
    use std::os::fd::AsFd;
    let rdv = smc_bpf::Rendezvous::shared().unwrap();
    let fd = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    rdv.opt_in(fd.as_fd()).unwrap();
    fd
}

/// A listening socket on 127.0.0.1 whose SYN-ACKs carry the SMC option (as
/// a server's), for a test that speaks CLC itself.
#[allow(dead_code)] // not every test binary uses it
pub fn opted_in_listener() -> std::net::TcpListener {
    let fd = opted_in_socket();
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    rustix::net::bind(&fd, &addr).unwrap();
    rustix::net::listen(&fd, 8).unwrap();
    std::net::TcpListener::from(fd)
}

/// Byte `off` of a test stream in direction `dir`.
#[allow(dead_code)] // not every test binary uses it
pub fn pattern(dir: u8, off: u64) -> u8 {
    ((off.wrapping_mul(0x9E37_79B1) >> 13) as u8) ^ ((off >> 20) as u8) ^ dir
}

/// FNV-1a over a stream, fed in pieces.
#[allow(dead_code)] // not every test binary uses it
pub struct Fnv(pub u64);

#[allow(dead_code)] // not every test binary uses it
impl Fnv {
    pub fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub fn feed(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The client half of a pinned two-process test: this thread pinned to
/// `cpu` before the first connection (the engine's threads inherit it),
/// then an SMC-R connection to this test binary run again as `test` with
/// `env` ([`spawn_self`]), checked to be SMC-R. Returns the child, its
/// stdout, and the stream.
#[allow(dead_code)]
pub fn pinned_client_of_self(
    cpu: usize,
    test: &str,
    env: &[(&str, &std::ffi::OsStr)],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    smc::SmcStream,
) {
    pin(cpu);
    setup();
    let (child, out, port) = spawn_self(test, env);
    let c = smc::SmcStream::connect(("127.0.0.1", port)).unwrap();
    assert_eq!(c.mode(), smc::Mode::SmcR);
    (child, out, c)
}

/// The other half of a two-process test: this test binary again, running
/// only `test` with the environment `env`, its stdout piped. Returns the
/// child, its stdout, and the port it announced with a `port N` line.
#[allow(dead_code)]
pub fn spawn_self(
    test: &str,
    env: &[(&str, &std::ffi::OsStr)],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    u16,
) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let port = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "{test}: exited early"
        );
        // (libtest may print "test NAME ... " on the same line first)
        if let Some((_, p)) = line.trim().split_once("port ") {
            break p.parse::<u16>().unwrap();
        }
    };
    (child, out, port)
}

/// Descriptors of this process.
#[allow(dead_code)]
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("listing needs a descriptor")
        .count()
}

/// What this process's descriptors are, by kind (for reports).
#[allow(dead_code)]
pub fn fd_kinds() -> String {
    let mut k = std::collections::BTreeMap::<String, usize>::new();
    let rd = match std::fs::read_dir("/proc/self/fd") {
        Ok(rd) => rd,
        Err(e) => return format!("(cannot list them: {e})"),
    };
    for e in rd.flatten() {
        let l = std::fs::read_link(e.path())
            .map_or_else(|_| "?".into(), |l| l.to_string_lossy().into_owned());
        let kind = l.split([':', '[']).next().unwrap_or("?").to_string();
        *k.entry(kind).or_default() += 1;
    }
    format!("{k:?}")
}

/// Sets the soft descriptor limit (at most the hard one).
#[allow(dead_code)]
pub fn set_nofile(n: u64) {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(lim.maximum.map_or(n, |m| m.min(n))),
            maximum: lim.maximum,
        },
    )
    .unwrap();
}

/// A child process that is killed if the test fails.
#[allow(dead_code)]
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The next line of a child's output containing `marker`, from it on.
#[allow(dead_code)]
pub fn line_with(out: &mut std::io::BufReader<std::process::ChildStdout>, marker: &str) -> String {
    use std::io::BufRead;
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
        if let Some(i) = line.find(marker) {
            return line[i..].trim().to_string();
        }
    }
}

/// What this process holds: SMC connections and link groups (`smc::state()`),
/// threads, descriptors, memfds among them, resident memory in KiB once the
/// allocator has given back the free memory it keeps (`malloc_trim`): what
/// is leaked shows, what glibc's heap keeps of freed connections (which
/// depends on where their last blocks happened to lie) does not.
#[allow(dead_code)] // not every test binary uses it
pub fn held() -> [u64; 6] {
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it
    // takes the allocator's locks as malloc does.
    unsafe { libc::malloc_trim(0) };
    let st = smc::state();
    let conns = st.iter().map(|d| d.connections as u64).sum();
    let groups = st.iter().map(|d| d.link_groups as u64).sum();
    let threads = std::fs::read_dir("/proc/self/task").unwrap().count() as u64;
    let (mut fds, mut memfds) = (0, 0);
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        fds += 1;
        if std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:")) {
            memfds += 1;
        }
    }
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let rss_kib = statm
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 4;
    [conns, groups, threads, fds, memfds, rss_kib]
}

/// Voluntary context switches so far (a thread that sleeps and is woken
/// makes one) of each thread of this process: `(name, switches)`, the
/// calling thread left out when `but_me`.
#[allow(dead_code)] // not every test binary uses it
pub fn voluntary_switches_by_thread(but_me: bool) -> Vec<(String, u64)> {
    let me = std::fs::read_link("/proc/thread-self").unwrap();
    let me = me.file_name().unwrap().to_owned();
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if but_me && t.file_name() == me {
            continue;
        }
        let (Ok(status), Ok(comm)) = (
            std::fs::read_to_string(t.path().join("status")),
            std::fs::read_to_string(t.path().join("comm")),
        ) else {
            continue; // a thread that just ended
        };
        for line in status.lines() {
            if let Some(v) = line.strip_prefix("voluntary_ctxt_switches:") {
                out.push((comm.trim().to_owned(), v.trim().parse::<u64>().unwrap()));
            }
        }
    }
    out
}

/// Voluntary context switches of this process's threads whose name starts
/// with `prefix`.
#[allow(dead_code)] // not every test binary uses it
pub fn switches_of(prefix: &str) -> u64 {
    voluntary_switches_by_thread(false)
        .into_iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// The first CPU this process may use.
#[allow(dead_code)] // not every test binary uses it
pub fn first_cpu() -> usize {
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    (0..rustix::thread::CpuSet::MAX_CPU)
        .find(|&c| set.is_set(c))
        .unwrap()
}

/// The server half of a two-process ping-pong test, pinned to `cpu`: says
/// its port (`port N`, see [`spawn_self`]), accepts one SMC-R connection,
/// answers each of `n` 64 B messages (message `i` filled with `i as u8`)
/// with its complement in blocking calls, then waits for the client's end.
#[allow(dead_code)] // not every test binary uses it
pub fn answer_complements(cpu: usize, n: usize) {
    use std::io::{Read, Write};
    pin(cpu);
    let l = smc::SmcListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!(s.mode(), smc::Mode::SmcR);
    let mut m = [0u8; 64];
    for i in 0..n {
        s.read_exact(&mut m).unwrap();
        assert_eq!(m, [i as u8; 64]);
        s.write_all(&[!(i as u8); 64]).unwrap();
    }
    // (until the client is done counting)
    let _ = s.read(&mut m);
}

/// Pins the calling thread (and the threads it starts after) to `cpu`.
#[allow(dead_code)] // not every test binary uses it
pub fn pin(cpu: usize) {
    let mut one = rustix::thread::CpuSet::new();
    one.set(cpu);
    rustix::thread::sched_setaffinity(None, &one).unwrap();
}

/// An SMC-R connection through a listener bound to `bind` (an address with
/// port 0) that has carried "ping" from the client and back: (client,
/// server, listener).
#[allow(dead_code)] // not every test binary uses it
pub fn echoed_pair(bind: &str) -> (smc::SmcStream, smc::SmcStream, smc::SmcListener) {
    use std::io::{Read, Write};
    let l = smc::SmcListener::bind(bind).unwrap();
    let addr = l.local_addr().unwrap();
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        (s, l)
    });
    let mut c = smc::SmcStream::connect(addr).unwrap();
    assert_eq!(c.mode(), smc::Mode::SmcR);
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    let (s, l) = srv.join().unwrap();
    (c, s, l)
}
