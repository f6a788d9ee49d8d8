//! The TCP end of an SMC-R connection is watched (an epoll set of its
//! endpoint, `Shared::watch_tcp`) once the connection has lived 20 ms
//! (`WATCH_SLACK` in `ctx/tcp_watch.rs`) or before a sleep that watches TCP ends, so
//! that a short connection costs no `epoll_ctl` calls; this checks that a
//! connection that lives on is watched even when nobody calls into the
//! library (the leader's timer, the progress thread): else a peer that dies
//! would go unnoticed. Seen from outside through `/proc/self/fdinfo`, which
//! lists every descriptor an epoll set holds.

mod common;

use common::setup;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// Whether any epoll set of this process holds descriptor `fd`.
fn watched(fd: RawFd) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    for e in dir.flatten() {
        let is_epoll =
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("eventpoll"));
        if !is_epoll {
            continue;
        }
        let info = format!("/proc/self/fdinfo/{}", e.file_name().to_string_lossy());
        let Ok(text) = std::fs::read_to_string(info) else {
            continue;
        };
        // "tfd:       12 events: ..."
        let held = text.lines().any(|l| {
            l.strip_prefix("tfd:")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse::<RawFd>().ok())
                == Some(fd)
        });
        if held {
            return true;
        }
    }
    false
}

#[test]
fn a_connections_tcp_end_is_watched_once_it_lived_a_while() {
    setup();
    let (mut c, mut s, _l) = common::echoed_pair("127.0.0.3:0");
    let (cfd, sfd) = (c.tcp_fd().as_raw_fd(), s.tcp_fd().as_raw_fd());
    // (whether they are in the set yet depends on who slept meanwhile: a
    // sleep that watches TCP ends takes every waiting socket in first)
    // Nobody calls into the library from here on: the endpoint's own timer
    // or progress thread brings the sockets into the set.
    let end = Instant::now() + Duration::from_secs(5);
    while !(watched(cfd) && watched(sfd)) {
        assert!(
            Instant::now() < end,
            "TCP ends not watched 5 s after the connection: client {}, server {}",
            watched(cfd),
            watched(sfd)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // and they still carry data
    c.write_all(b"pong").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"pong");
}
