//! SMC-R connections and listening sockets across `fork()` and exec
//! (tests/echo.c's forking client, tests/exec.c): a copy closed in a child,
//! a connection inherited by a new image, a listening socket taken up by one.
//! (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;

/// A child that closes its copy of an SMC-R connection (as one does before
/// exec) leaves the parent's connection alone: the connection is the
/// parent's, the child closes a stand-in.
#[test]
fn a_forked_child_closing_its_copy_does_not_end_the_connection() {
    let s = run_forked("fork", true, true, false, 4 << 20, true);
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

fn exec_program(s: &Setup) -> PathBuf {
    compile_c("exec", &s.dir)
}

/// exec.c's server and client (`mode`: fork, self) under smc_run; returns
/// the client's and the server's output.
fn exec_run(tag: &str, mode: &str) -> (Setup, String, String) {
    exec_run_with(tag, "server", &["client", mode])
}

/// exec.c `client MODE` against `server`, both SMC-R, where the client hands
/// its connection to a child image (however MODE starts it): the child
/// reports the clear errors (`AFTER_EXEC`), the parent's two pings still
/// go through, and the server sees both and then the end.
fn the_child_gets_a_clear_error_and_the_parent_goes_on(tag: &str, mode: &str) {
    let (s, cli, srv) = exec_run(tag, mode);
    assert_eq!(cli, format!("{AFTER_EXEC}parent ok\n"));
    // the server echoed both pings and nothing else
    assert_eq!(srv, "server end eof after 10\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// exec.c `server` (a server mode) under smc_run, once it listens: the
/// setup, the program, the server and its port.
fn start_server(tag: &str, server: &str) -> (Setup, PathBuf, Server, u16) {
    start_server_with(tag, server, |_| None)
}

/// [`start_server`], with one more argument made from the setup.
fn start_server_with(
    tag: &str,
    server: &str,
    extra: impl FnOnce(&Setup) -> Option<PathBuf>,
) -> (Setup, PathBuf, Server, u16) {
    let s = setup(tag);
    let exe = exec_program(&s);
    let portfile = s.dir.join("port");
    let extra = extra(&s);
    let mut args = vec![server, portfile.to_str().unwrap()];
    if let Some(e) = extra.as_ref() {
        args.push(e.to_str().unwrap());
    }
    let srv = Server(
        under(&s, true, &exe, &args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let port = wait_for_port(&portfile).expect("the server did not start");
    (s, exe, srv, port)
}

/// The server's output once it has ended (`what` says what it waits for).
fn server_output(srv: &mut Server, what: &str) -> String {
    let end = Instant::now() + Duration::from_secs(30);
    while srv.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < end, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut text = String::new();
    use std::io::Read;
    srv.0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    text
}

fn exec_run_with(tag: &str, server: &str, client: &[&str]) -> (Setup, String, String) {
    let (s, exe, mut srv, port) = start_server(tag, server);
    let port = port.to_string();
    let args: Vec<&str> = [client[0], &port]
        .into_iter()
        .chain(client[1..].iter().copied())
        .collect();
    let mut cli = under(&s, true, &exe, &args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // (no hang: the new image's calls must not block)
    let end = Instant::now() + Duration::from_secs(30);
    while cli.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = cli.kill();
            let _ = cli.wait();
            panic!("the client hangs after the exec");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = cli.wait_with_output().unwrap();
    let cli_text = ok_output("exec client", &out);
    // the server learns that the connection ended (it does not hang either)
    let srv_text = server_output(&mut srv, "the server never saw the connection end");
    (s, cli_text, srv_text)
}

const AFTER_EXEC: &str = "after poll=1 hup=1 read=ENOTCONN write=EPIPE peer=ENOTCONN\n";

/// fork + exec with an SMC-R connection's descriptor inherited (inetd,
/// CGI): the new image's descriptor is a connection that is gone (clear
/// errors at once, no hang, nothing sent anywhere), and the parent keeps
/// using the connection.
#[test]
fn an_smc_r_connection_inherited_across_fork_and_exec_is_a_clear_error_there() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("exec-fork", "fork");
}

/// A forked child that uses the library: the parent's connection works in
/// the child too, as a TCP socket does (the parent serves it there), and
/// the parent goes on with it once the child is done; the child's own new
/// connection is SMC-R, with a library state of its own.
#[test]
fn a_forked_child_uses_the_parents_connection_and_has_smc_r_of_its_own() {
    let (s, cli, srv) = exec_run_with("fork-use", "server2", &["client", "use"]);
    assert_eq!(cli, "child ok\npings ok\nparent ok\n");
    // the child's own connection ends first (its two pings), then the
    // shared one: the parent's two pings and the child's one
    assert_eq!(srv, "server end eof after 10\nserver end eof after 16\n");
    let modes = s.modes();
    let smc_r = |role: &str| {
        modes
            .iter()
            .filter(|l| l.starts_with(role) && l.contains(" SMC-R"))
            .count()
    };
    assert_eq!(
        (modes.len(), smc_r("connect"), smc_r("accept")),
        (4, 2, 2),
        "{modes:?}"
    );
}

/// Parent and child write on one connection at the same time, 1 MiB each:
/// every byte reaches the peer once (the server echoes them all back to
/// the parent), and a child that leaves by `_exit` (no close) leaves the
/// connection to the parent.
#[test]
fn parent_and_child_write_on_one_connection_at_once_and_nothing_is_lost() {
    let (s, cli, srv) = exec_run_with("fork-both", "server", &["client", "both"]);
    assert_eq!(cli, "parent got P=1048576 C=1048576 other=0\n");
    assert_eq!(srv, format!("server end eof after {}\n", 5 + (2 << 20)));
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// A parent that connects, forks and closes its copy: the connection is
/// the child's from then on (epoll, blocking reads, `sendfile`, a half
/// close and the peer's end all work there), and it ends when the child
/// closes it.
#[test]
fn a_connection_handed_to_a_forked_child_works_there_after_the_parent_closed_it() {
    let (s, cli, srv) = exec_run_with("fork-handoff", "server", &["client", "handoff"]);
    assert_eq!(cli, "child ok\nparent ok\n");
    assert_eq!(srv, "server end eof after 23\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// An exec of the process itself: the same for the new image; the
/// connection went with the old one, and the peer sees it end.
#[test]
fn an_smc_r_connection_surviving_exec_is_a_clear_error_in_the_new_image() {
    let (s, cli, srv) = exec_run("exec-self", "self");
    assert_eq!(cli, AFTER_EXEC);
    assert!(
        srv.starts_with("server end ") && srv.ends_with(" after 5\n"),
        "{srv}"
    );
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// A listening socket that crosses an exec (nginx's binary upgrade): the
/// new image's library takes it up (the image before opted it in, so the
/// kernel offers SMC in its SYN-ACKs), and its connections are SMC-R with
/// the data intact.
#[test]
fn a_listening_socket_inherited_across_exec_accepts_smc_r() {
    let (s, cli, srv) = exec_run_with("exec-listen", "server-exec", &["pings"]);
    assert_eq!(cli, "pings ok\n");
    assert_eq!(srv, "server end eof after 10\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// exec.c's `server` (a forking one) under smc_run, and two `pings`
/// clients under smc_run one after the other; returns the server's output.
fn fork_server_run(tag: &str, server: &str) -> (Setup, String) {
    let (s, exe, mut srv, port) = start_server(tag, server);
    for _ in 0..2 {
        let out = under(&s, true, &exe, &["pings", &port.to_string()])
            .output()
            .unwrap();
        assert_eq!(ok_output("pings", &out), "pings ok\n");
    }
    let text = server_output(&mut srv, "the server did not end");
    (s, text)
}

/// Lines of the state file of `role` whose mode contains `mode`.
fn count_modes(s: &Setup, role: &str, mode: &str) -> usize {
    s.modes()
        .iter()
        .filter(|l| l.starts_with(role) && l.contains(mode))
        .count()
}

/// A server that accepts and forks a process per connection (Python's
/// `ForkingMixIn`, `socat ...,fork`): its listening socket is blocking, so
/// the library leaves each accepted connection's handshake for its first
/// use, which is in the child; every connection is SMC-R, served by the
/// child, and the parent's close of its copy takes nothing away.
#[test]
fn a_server_that_forks_per_connection_serves_smc_r_in_its_children() {
    let (s, srv) = fork_server_run("fork-server", "server-fork");
    assert_eq!(
        srv,
        "server end eof after 10\nserver end eof after 10\nserver done\n"
    );
    assert_eq!(
        (
            s.modes().len(),
            count_modes(&s, "connect", " SMC-R"),
            count_modes(&s, "accept", " SMC-R")
        ),
        (4, 2, 2),
        "{:?}",
        s.modes()
    );
}

/// inetd: each child execs a program with the connection as its stdin and
/// stdout. The program knows nothing of SMC, so the library declines SMC
/// before the exec: the client falls back to TCP, and the program serves a
/// plain TCP connection with nothing of the CLC left on it.
#[test]
fn an_inetd_style_server_hands_its_programs_plain_tcp() {
    let (s, srv) = fork_server_run("fork-inetd", "server-inetd");
    assert_eq!(srv, "server done\n");
    assert_eq!(
        (s.modes().len(), count_modes(&s, "connect", " TCP ")),
        (2, 2),
        "{:?}",
        s.modes()
    );
}

/// tests/exec.c linked statically (no `PT_INTERP`: the dynamic loader never
/// runs, so neither does the library, whatever `LD_PRELOAD` says).
fn static_exec_program(s: &Setup) -> PathBuf {
    let exe = s.dir.join("exec-static");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/exec.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(cc)
        .args(["-O1", "-Wall", "-Werror", "-static", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(
        st.success(),
        "compiling exec.c statically (glibc's libc.a: libc6-dev)"
    );
    exe
}

/// A listening socket opted in to SMC that crosses an exec into a program
/// that will not load the library, and a client under smc_run: the client
/// must get plain TCP (its Proposal would otherwise reach the program as
/// data) and its pings come back intact.
fn listener_into_a_program_without_the_library(tag: &str, server: &str, static_prog: bool) {
    let (s, exe, mut srv, port) =
        start_server_with(tag, server, |s| static_prog.then(|| static_exec_program(s)));
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    // ten bytes of pings echoed: nothing of a CLC message among them
    assert_eq!(srv_text, "server end eof after 10\n");
    let modes = s.modes();
    assert_eq!(
        (modes.len(), count_modes(&s, "connect", " TCP ")),
        (1, 1),
        "{modes:?}"
    );
}

/// execl into a static program (the loader never runs there).
#[test]
fn a_listener_execd_into_a_static_program_serves_plain_tcp() {
    listener_into_a_program_without_the_library("exec-static", "server-static", true);
}

/// execve into a program whose environment lacks LD_PRELOAD.
#[test]
fn a_listener_execd_without_ld_preload_serves_plain_tcp() {
    listener_into_a_program_without_the_library("exec-noenv", "server-noenv", false);
}

/// posix_spawnp of a static program that serves the listener.
#[test]
fn a_listener_handed_to_a_spawned_static_program_serves_plain_tcp() {
    listener_into_a_program_without_the_library("spawn-static", "server-spawn", true);
}

/// An SMC-R connection that crosses an exec (execle) into a program without
/// the library (LD_PRELOAD left out): a clear error there, as into one with
/// it, and the peer sees the connection end.
#[test]
fn an_smc_r_connection_execd_into_a_program_without_the_library_is_a_clear_error() {
    let (s, cli, srv) = exec_run("exec-plain", "plain");
    assert_eq!(cli, AFTER_EXEC);
    assert!(
        srv.starts_with("server end ") && srv.ends_with(" after 5\n"),
        "{srv}"
    );
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// posix_spawn with an SMC-R connection's descriptor inherited: a clear
/// error in the spawned program, and the parent goes on with the connection.
#[test]
fn an_smc_r_connection_inherited_by_a_spawned_program_is_a_clear_error_there() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("spawn", "spawn");
}

/// An exec (execlp) of a program that is not there fails:
/// the listener offers SMC again, and its next client is SMC-R.
#[test]
fn a_failed_exec_leaves_the_listener_offering_smc() {
    let (s, exe, mut srv, port) = start_server("exec-fail", "server-execfail");
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    assert_eq!(srv_text, "server end eof after 10\n");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// A forked child execs a program without the library (static) with the
/// listening socket left open: the socket, shared with the parent, offers
/// no SMC from then on, so the parent's next client falls back to TCP (a
/// fallback, not an error), the data intact on both sides.
#[test]
fn a_listener_leaked_into_a_static_childs_exec_falls_back_in_the_parent_too() {
    let (s, exe, mut srv, port) =
        start_server_with("exec-leak", "server-leak", |s| Some(static_exec_program(s)));
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    assert_eq!(srv_text, "server end eof after 10\n");
    assert_eq!(
        (
            s.modes().len(),
            count_modes(&s, "connect", " TCP "),
            count_modes(&s, "accept", " TCP ")
        ),
        (2, 1, 1),
        "{:?}",
        s.modes()
    );
}

/// execl into a set-user-ID copy of the (dynamic) program owned by another
/// user: the loader runs in secure-execution mode and ignores LD_PRELOAD's
/// path, so the program has no library; its clients get plain TCP.
#[test]
fn a_listener_execd_into_a_set_user_id_program_serves_plain_tcp() {
    let (s, exe, mut srv, port) = start_server_with("exec-setuid", "server-static", |s| {
        use std::os::unix::fs::PermissionsExt;
        let prog = s.dir.join("exec-setuid");
        std::fs::copy(exec_program(s), &prog).unwrap();
        // (nobody; chown clears the set-ID bits, so the mode comes after)
        std::os::unix::fs::chown(&prog, Some(65534), Some(65534)).unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o4755)).unwrap();
        // (the program, then nobody, writes the port file)
        let portfile = s.dir.join("port");
        std::fs::write(&portfile, "").unwrap();
        std::fs::set_permissions(&portfile, std::fs::Permissions::from_mode(0o666)).unwrap();
        Some(prog)
    });
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    assert_eq!(srv_text, "server end eof after 10\n");
    assert_eq!(
        (s.modes().len(), count_modes(&s, "connect", " TCP ")),
        (1, 1),
        "{:?}",
        s.modes()
    );
}

/// posix_spawn whose file actions put a close-on-exec SMC-R connection on
/// the child's stdin (Rust's `Stdio::from(stream)`, inetd-style spawners):
/// the same clear error there, and the parent's descriptor keeps its
/// close-on-exec flag and its connection.
#[test]
fn an_smc_r_connection_dup2d_onto_a_spawned_programs_stdin_is_a_clear_error_there() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("spawn-stdin", "spawn-stdin");
}

/// system() with an SMC-R connection's descriptor inherited: glibc runs the
/// shell with its own internal spawn, which no posix_spawn wrapper sees;
/// the command (a program with the library) gets the same clear error as
/// an exec'd one, and the parent goes on with the connection.
#[test]
fn an_smc_r_connection_inherited_through_system_is_a_clear_error_there() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("system", "system");
}

/// The same through system() into a program without the library
/// (`env -u LD_PRELOAD`).
#[test]
fn an_smc_r_connection_inherited_through_system_by_a_program_without_the_library_is_a_clear_error()
{
    the_child_gets_a_clear_error_and_the_parent_goes_on("system-plain", "system-plain");
}

/// The same through popen(): the command's output (read through the pipe)
/// is the clear error, and the parent goes on with the connection.
#[test]
fn an_smc_r_connection_inherited_through_popen_is_a_clear_error_there() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("popen", "popen");
}

/// vfork + exec, the child moving the descriptor first (`dup2`, `close`):
/// calls a vforked child makes run in the parent's memory, so they must not
/// change the parent's library state (the close took the connection out of
/// the parent's table, whose next read waited for ever). The exec'd program
/// sees the clear error; the parent's connection goes on.
#[test]
fn an_smc_r_connection_across_vfork_and_exec_is_a_clear_error_there_and_the_parent_keeps_it() {
    the_child_gets_a_clear_error_and_the_parent_goes_on("vfork", "vfork");
}

/// A listening socket handed by system() to a program without the library
/// (the caller unset LD_PRELOAD, so the shell has none): it must offer
/// plain TCP, its client's data intact.
#[test]
fn a_listener_handed_on_by_system_to_a_program_without_the_library_serves_plain_tcp() {
    listener_into_a_program_without_the_library("system-listen", "server-system", false);
}

/// The same by system() of `env -u LD_PRELOAD PROGRAM`: the shell loads the
/// library and takes the listener up, and `env`'s exec opts it out.
#[test]
fn a_listener_handed_on_by_system_through_env_without_ld_preload_serves_plain_tcp() {
    listener_into_a_program_without_the_library("system-env-listen", "server-system-env", false);
}

/// The same by popen().
#[test]
fn a_listener_handed_on_by_popen_to_a_program_without_the_library_serves_plain_tcp() {
    listener_into_a_program_without_the_library("popen-listen", "server-popen", false);
}

/// A program's stdout lines, read by a thread (so that a program that
/// hangs fails the test instead of holding it).
fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// A connection the library's listener had taken from the kernel and run
/// the handshake of, which the program had not accepted yet, when the
/// program exec'd itself with the listening socket (a non-blocking one: its
/// listener runs handshakes as they come): the connection lived in the old
/// image, so its client gets a clear error (no hang, nothing read as data:
/// `ECONNABORTED`, then `EPIPE` for a write); the new image's clients are
/// SMC-R.
#[test]
fn a_connection_the_listener_had_ready_at_exec_is_a_clear_error_for_its_client() {
    let (s, exe, mut srv, port) = start_server("exec-queue", "server-queue");
    let mut held = under(&s, true, &exe, &["hold", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut held);
    let first = lines.recv_timeout(Duration::from_secs(20));
    assert_eq!(first.as_deref(), Ok("connected"));
    let port2 = wait_for_port(&s.dir.join("port.2")).expect("the exec'd server did not start");
    assert_eq!(port2, port);
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the exec'd server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    assert_eq!(srv_text, "server end eof after 10\n");
    drop(held.stdin.take());
    let last = lines.recv_timeout(Duration::from_secs(30));
    let _ = held.kill();
    let _ = held.wait();
    // (the abort reported once, by the read, as TCP's sk_err; the write
    // after it: EPIPE)
    assert_eq!(last.as_deref(), Ok("held read=ECONNABORTED write=EPIPE"));
    // (the held connection's client side, and the new image's connection)
    assert_eq!(
        (
            s.modes().len(),
            count_modes(&s, "connect", " SMC-R"),
            count_modes(&s, "accept", " SMC-R")
        ),
        (3, 2, 1),
        "{:?}",
        s.modes()
    );
}

/// A connection still in the kernel's accept queue when the program
/// exec'd itself with the listening socket (a blocking one: its handshakes
/// run at each connection's first use): the new image accepts it, and it
/// is SMC-R with its data intact.
#[test]
fn a_connection_in_the_kernels_accept_queue_at_exec_is_served_by_the_new_image() {
    let (s, exe, mut srv, port) = start_server("exec-kqueue", "server-queue-blocking");
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the exec'd server did not end");
    assert_eq!(ok_output("pings", &out), "pings ok\n", "server: {srv_text}");
    assert_eq!(srv_text, "server end eof after 10\n");
    assert!(s.dir.join("port.2").exists(), "no exec");
    assert_modes(&s, &[("connect", " SMC-R"), ("accept", " SMC-R")]);
}

/// The limit the README states: a connection still in the kernel's accept
/// queue when the program exec'd itself, with the listening socket, into a
/// program without the library. Its SYN-ACK had offered SMC, so its client
/// sent a CLC Proposal, which the new program reads as data (here: echoes);
/// the client takes the reply for no CLC message and its `connect` fails
/// with `EPROTO` at once (no hang, and none of its data was sent).
#[test]
fn a_connection_in_the_kernels_accept_queue_at_an_exec_without_the_library_fails_its_connect() {
    let (s, exe, mut srv, port) = start_server("exec-kqueue-plain", "server-queue-plain");
    let out = under(&s, true, &exe, &["pings", &port.to_string()])
        .output()
        .unwrap();
    let srv_text = server_output(&mut srv, "the exec'd server did not end");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "connect: Protocol error\n"
    );
    assert!(s.dir.join("port.2").exists(), "no exec");
    // (the Proposal was the only thing the program read)
    assert!(
        srv_text.starts_with("server end ") && !srv_text.ends_with(" after 0\n"),
        "{srv_text}"
    );
}
