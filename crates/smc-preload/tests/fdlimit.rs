//! A server under smc_run at its descriptor limit (tests/fdlimit.c): an
//! SMC-R connection holds three descriptors where a TCP one holds one, so
//! the library raises a soft limit within the hard one (the server holds
//! as many connections as over TCP), and at a hard limit every connection
//! the server accepts is served, over TCP when the library has no
//! descriptor for it (the server never reads the client's CLC Proposal as
//! data); an exec gets the limit the program had. (root: the SYN-option rendezvous loads a BPF program.)

mod common;

use common::*;
use std::process::{Command, Stdio};

/// `cmd` run by a shell that sets its descriptor limit first (`ulimit
/// LIMIT`), with `cmd`'s environment.
fn with_limit(cmd: &Command, limit: &str) -> Command {
    let argv: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_str().unwrap().to_string())
        .collect();
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg(format!("ulimit {limit} && exec \"$@\""))
        .arg("sh")
        .args(&argv);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => sh.env(k, v),
            None => sh.env_remove(k),
        };
    }
    sh
}

/// `fdlimit server` with `limit` set by the shell, under smc_run if
/// `preload`; its client (under smc_run too) opens `n` connections. The
/// server's and the client's lines.
fn run(s: &Setup, limit: &str, n: usize, preload: bool) -> (String, String) {
    let exe = compile_c("fdlimit", &s.dir);
    let _ = std::fs::remove_file(s.dir.join("state"));
    let portfile = s.dir.join("port");
    let _ = std::fs::remove_file(&portfile);
    let n = n.to_string();
    let cmd = under(
        s,
        preload,
        &exe,
        &["server", portfile.to_str().unwrap(), &n],
    );
    let mut sh = with_limit(&cmd, limit);
    let mut server = Server(sh.stdout(Stdio::piped()).spawn().unwrap());
    let port = wait_for_port(&portfile)
        .expect("the server's port")
        .to_string();
    let out = under(s, preload, &exe, &["client", &port, &n])
        .output()
        .unwrap();
    let client = ok_output("fdlimit client", &out);
    let child = std::mem::replace(&mut server.0, Command::new("true").spawn().unwrap());
    let out = child.wait_with_output().unwrap();
    let server = ok_output(&format!("fdlimit server ({limit})"), &out);
    (server, client)
}

#[test]
fn a_server_at_its_soft_descriptor_limit_holds_as_many_smc_r_connections_as_tcp_ones() {
    let s = setup("fdlimit-soft");
    // (48 descriptors hold 30 TCP connections and the program's own)
    let (server, client) = run(&s, "-S -n 48", 30, false);
    assert!(
        server.contains("server answered 30 bad 0 emfile no"),
        "plain: {server}"
    );
    assert!(client.contains("client answered 30"), "plain: {client}");
    let (server, client) = run(&s, "-S -n 48", 30, true);
    assert!(
        server.contains("server answered 30 bad 0 emfile no"),
        "{server}"
    );
    assert!(client.contains("client answered 30"), "{client}");
    // (every connection, both ends, over SMC-R)
    assert_eq!(assert_all(&s, 60, " SMC-R").len(), 60);
}

#[test]
fn a_server_at_its_hard_descriptor_limit_serves_every_connection_it_accepts() {
    let s = setup("fdlimit-hard");
    let (server, client) = run(&s, "-n 48", 40, true);
    // (fewer than over TCP: the library's descriptors count against the
    // hard limit, and the server sees EMFILE sooner)
    let answered = server
        .split_whitespace()
        .skip_while(|w| *w != "answered")
        .nth(1)
        .and_then(|w| w.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{server}"));
    assert!(answered > 0, "{server}");
    assert!(
        server.contains(" bad 0 "),
        "a connection the server accepted was not served (its client's CLC read as data, or \
         the connection failed): {server}"
    );
    assert!(
        client.contains(&format!("client answered {answered}")),
        "server: {server}client: {client}"
    );
}

#[test]
fn the_raised_soft_limit_is_the_library_s_and_an_exec_gets_the_program_s() {
    let s = setup("fdlimit-exec");
    let exe = compile_c("fdlimit", &s.dir);
    let mut sh = with_limit(&under(&s, true, &exe, &["limits"]), "-S -n 48");
    let out = ok_output("fdlimit limits", &sh.output().unwrap());
    let value = |what: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix(what)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {what:?}: {out}"))
    };
    assert_eq!(value("limit before "), 48, "{out}");
    assert!(value("limit after listen ") > 48, "{out}");
    assert_eq!(value("limit after exec "), 48, "{out}");
}
