//! `fork()` with SMC-R connections open (`smc::after_fork_in_child`): the
//! child's calls on the parent's connection fail with `ENOTCONN` and its drop
//! leaves the connection alone, the child makes SMC-R connections of its own
//! (a library state of its own: endpoints, links, system ID), and the parent
//! goes on with its connection as if nothing happened. Alone in its test
//! binary: it forks.

mod common;

use common::setup;
use smc::{Mode, SmcListener, SmcStream};
use std::io::{self, Read, Write};
use std::time::Duration;

fn ping(from: &mut SmcStream, to: &mut SmcStream, msg: &[u8]) {
    from.write_all(msg).unwrap();
    let mut b = vec![0u8; msg.len()];
    to.read_exact(&mut b).unwrap();
    assert_eq!(b, msg);
}

/// The child's part; its exit status says what went wrong.
fn child(mut parents: SmcStream, addr: std::net::SocketAddr, random: libc::c_int) -> i32 {
    smc::after_fork_in_child();
    // the next key the shm device would draw, for the parent to compare
    // with its own (a child drawing its parent's keys could register
    // regions under keys the parent also hands out)
    let k = smc_rdma::shm::wire::random_u64().unwrap().to_le_bytes();
    // SAFETY: writes 8 bytes from `k` to the pipe made for it.
    if unsafe { libc::write(random, k.as_ptr().cast(), 8) } != 8 {
        return 9;
    }
    let not_conn = |r: io::Result<usize>| {
        r.is_err_and(|e| e.raw_os_error() == Some(rustix::io::Errno::NOTCONN.raw_os_error()))
    };
    let mut b = [0u8; 8];
    if !not_conn(parents.read(&mut b)) {
        return 10;
    }
    if !not_conn(parents.write(b"x")) {
        return 11;
    }
    // (dropped in the child: nothing may reach the peer)
    drop(parents);
    let Ok(mut own) = SmcStream::connect(addr) else {
        return 12;
    };
    if own.mode() != Mode::SmcR {
        return 13;
    }
    let _ = own.set_read_timeout(Some(Duration::from_secs(10)));
    if own.write_all(b"child").is_err()
        || own.read_exact(&mut b[..5]).is_err()
        || &b[..5] != b"child"
    {
        return 14;
    }
    drop(own);
    0
}

#[test]
fn a_forked_child_leaves_the_parents_connection_alone_and_has_its_own() {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut c = SmcStream::connect(addr).unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert_eq!((c.mode(), s.mode()), (Mode::SmcR, Mode::SmcR));
    for x in [&c, &s] {
        x.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    }
    ping(&mut c, &mut s, b"before");
    // The child's own connection: accepted and echoed here.
    let echo = std::thread::spawn(move || {
        let (mut t, _) = l.accept().unwrap();
        t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 5];
        t.read_exact(&mut b).unwrap();
        t.write_all(&b).unwrap();
        // the child's close, then end of file
        assert_eq!(t.read(&mut b).unwrap(), 0);
        t.mode()
    });
    let parents = c.try_clone().unwrap();
    let mut random = [0 as libc::c_int; 2];
    // SAFETY: a pipe into `random`.
    assert_eq!(unsafe { libc::pipe(random.as_mut_ptr()) }, 0);
    // SAFETY: the child runs `child` (the library, no lock a parent thread
    // may hold: its state is the child's own) and ends with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
    if pid == 0 {
        let code = child(parents, addr, random[1]);
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    drop(parents);
    let ours = smc_rdma::shm::wire::random_u64().unwrap().to_le_bytes();
    let mut theirs = [0u8; 8];
    // SAFETY: reads 8 bytes into `theirs` from the pipe made above.
    assert_eq!(
        unsafe { libc::read(random[0], theirs.as_mut_ptr().cast(), 8) },
        8
    );
    assert_ne!(ours, theirs, "the child draws the parent's keys");
    let mut status = 0;
    // SAFETY: waits for the child made above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child failed: status {status:#x} (exit {})",
        libc::WEXITSTATUS(status)
    );
    assert_eq!(echo.join().unwrap(), Mode::SmcR);
    // the parent's connection, both ways, intact: the child's "x" went nowhere
    ping(&mut c, &mut s, b"after");
    ping(&mut s, &mut c, b"and back");
    drop(c);
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0);
}
