//! In-place (zero-copy) reads and writes (`SmcStream::write_in_place`,
//! `read_in_place`): over SMC-R on the shared-memory device the space lent is
//! the RMB itself, a file goes in and out through the kernel's copy alone,
//! and a partial commit leaves the rest for the next call; over a TCP
//! fallback the same calls give the same bytes (root: BPF).

mod common;

use common::{pattern, setup};
use smc::{Mode, SmcListener, SmcStream};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::TcpListener;
use std::os::fd::AsFd;
use std::thread;

fn smc_pair() -> (SmcStream, SmcStream) {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acc = thread::spawn(move || l.accept().unwrap().0);
    let c = SmcStream::connect(addr).unwrap();
    let s = acc.join().unwrap();
    assert_eq!(c.mode(), Mode::SmcR, "both ends on the shm device");
    (c, s)
}

/// A client over TCP (its peer is a plain TCP listener) and the accepted
/// plain socket.
fn tcp_pair() -> (SmcStream, std::net::TcpStream) {
    setup();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acc = thread::spawn(move || l.accept().unwrap().0);
    let c = SmcStream::connect(addr).unwrap();
    let s = acc.join().unwrap();
    assert!(matches!(c.mode(), Mode::Tcp(_)), "a plain peer: fallback");
    (c, s)
}

fn temp_file(bytes: &[u8]) -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "smc-in-place-{}-{}",
        std::process::id(),
        bytes.len()
    ));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    f.write_all(bytes).unwrap();
    f
}

fn data(n: usize) -> Vec<u8> {
    (0..n as u64).map(|i| pattern(1, i)).collect()
}

/// A file sent with `read_from` (pread into the peer's RMB) and received
/// with `write_to` (write from our RMB into a file), in pieces that cross
/// the RMB's end, arrives whole; the space lent is the RMB on both sides.
#[test]
fn a_file_goes_through_the_rmbs_without_a_copy_of_the_library() {
    let (c, s) = smc_pair();
    // 3.5 RMBs of 1 MiB: the cursors wrap, a lent space comes in two parts
    const N: usize = (7 << 20) / 2 + 12345;
    let src = data(N);
    let file = temp_file(&src);
    let sender = thread::spawn(move || {
        let mut off = 0u64;
        let mut all_in_rmb = true;
        while (off as usize) < N {
            // odd sizes: the pieces do not line up with the RMB
            let want = (300_001usize).min(N - off as usize);
            let n = c
                .write_in_place(want, |w| {
                    all_in_rmb &= w.in_rmb();
                    w.read_from(0, &file, Some(off))
                })
                .unwrap();
            assert!(n > 0 && n <= want);
            off += n as u64;
        }
        c.shutdown(std::net::Shutdown::Write).unwrap();
        (all_in_rmb, c)
    });
    let out = temp_file(&[]);
    let mut got = 0u64;
    let mut all_in_rmb = true;
    loop {
        let n = s
            .read_in_place(1 << 20, |r| {
                all_in_rmb &= r.in_rmb();
                r.write_to(0, r.len(), &out, Some(got))
            })
            .unwrap();
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let (sent_in_rmb, _c) = sender.join().unwrap();
    assert_eq!(got as usize, N);
    assert!(sent_in_rmb, "the sender was lent the peer's RMB");
    assert!(all_in_rmb, "the receiver was lent its RMB");
    let mut back = Vec::new();
    let mut out = out;
    out.seek(SeekFrom::Start(0)).unwrap();
    out.read_to_end(&mut back).unwrap();
    assert!(back == src, "the file arrives unchanged");
}

/// A commit of fewer bytes than lent sends (or consumes) those only: the
/// next write continues after them, the next read sees the rest.
#[test]
fn a_partial_commit_takes_only_what_it_says() {
    let (c, mut s) = smc_pair();
    let n = c
        .write_in_place(1000, |w| {
            assert!(w.len() >= 10);
            w.copy_from(0, b"0123456789")?;
            Ok(4)
        })
        .unwrap();
    assert_eq!(n, 4, "four of the ten bytes put in place are sent");
    (&c).write_all(b"abc").unwrap();
    let mut b = [0u8; 7];
    s.read_exact(&mut b).unwrap();
    assert_eq!(
        &b, b"0123abc",
        "the write continues after the committed bytes"
    );

    (&c).write_all(b"hello world").unwrap();
    let mut first = [0u8; 5];
    let took = s
        .read_in_place(64, |r| {
            r.copy_to(0, &mut first)?;
            Ok(5)
        })
        .unwrap();
    assert_eq!((took, &first), (5, b"hello"));
    let mut rest = [0u8; 6];
    s.read_exact(&mut rest).unwrap();
    assert_eq!(&rest, b" world", "the next read sees what was not taken");
}

/// `f`'s error sends and consumes nothing, and a count beyond the lent
/// length is refused; the stream goes on afterwards.
#[test]
fn an_error_or_an_overlong_count_commits_nothing() {
    let (c, mut s) = smc_pair();
    let e = c
        .write_in_place(100, |w| {
            w.copy_from(0, b"lost")?;
            Err(std::io::Error::other("no"))
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "no");
    let e = c.write_in_place(100, |w| Ok(w.len() + 1)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let e = c
        .write_in_place(100, |w| w.copy_from(w.len() - 1, b"xy").map(|_| 0))
        .unwrap_err();
    assert_eq!(
        e.kind(),
        std::io::ErrorKind::InvalidInput,
        "outside the space"
    );
    (&c).write_all(b"kept").unwrap();
    let e = s
        .read_in_place(100, |_| Err::<usize, _>(std::io::Error::other("no")))
        .unwrap_err();
    assert_eq!(e.to_string(), "no");
    let e = s.read_in_place(100, |r| Ok(r.len() + 1)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(
        &b, b"kept",
        "nothing of the failed calls was sent or consumed"
    );
}

/// A non-blocking stream with nothing to read says `WouldBlock` and does not
/// call `f`; at end of file the call returns 0 without calling it.
#[test]
fn would_block_and_end_of_file_do_not_call_f() {
    let (c, s) = smc_pair();
    s.set_nonblocking(true).unwrap();
    let e = s
        .read_in_place(10, |_| -> std::io::Result<usize> { panic!("called") })
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    drop(c);
    let n = s
        .read_in_place(10, |_| -> std::io::Result<usize> { panic!("called") })
        .unwrap();
    assert_eq!(n, 0, "end of file");
}

/// Over a TCP fallback the same calls work through a buffer of the
/// library's: the bytes arrive, a partial read commit leaves the rest.
#[test]
fn over_tcp_the_same_calls_give_the_same_bytes() {
    let (c, mut s) = tcp_pair();
    let src = data(200_000);
    let file = temp_file(&src);
    let mut off = 0u64;
    while (off as usize) < src.len() {
        let n = c
            .write_in_place(src.len() - off as usize, |w| {
                assert!(!w.in_rmb(), "no RMB over TCP");
                w.read_from(0, file.as_fd(), Some(off))
            })
            .unwrap();
        off += n as u64;
    }
    let mut got = vec![0u8; src.len()];
    s.read_exact(&mut got).unwrap();
    assert!(got == src);

    s.write_all(b"hello world").unwrap();
    let mut first = [0u8; 5];
    let mut tries = 0;
    let took = loop {
        // (a peek may see the first segment only)
        let mut seen = 0;
        let took = c
            .read_in_place(64, |r| {
                seen = r.len();
                if seen < 5 {
                    return Ok(0);
                }
                r.copy_to(0, &mut first)?;
                Ok(5)
            })
            .unwrap();
        if took > 0 || tries > 100 {
            break took;
        }
        tries += 1;
        thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!((took, &first), (5, b"hello"));
    let mut rest = [0u8; 6];
    (&c).read_exact(&mut rest).unwrap();
    assert_eq!(&rest, b" world");
}

/// A non-blocking in-place write says `WouldBlock` only when `write` would:
/// once the peer's RMB is full it goes through the send buffer while that
/// has room, so that the stream's descriptor never polls writable while the
/// call would block (an edge-triggered loop, nginx's, would wait forever).
#[test]
fn a_nonblocking_in_place_write_blocks_only_when_write_would() {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let (c, s) = smc_pair();
    c.set_nonblocking(true).unwrap();
    let chunk = vec![7u8; 256 << 10];
    let put = |c: &SmcStream| {
        c.write_in_place(chunk.len(), |w| {
            let n = w.len().min(chunk.len());
            w.copy_from(0, &chunk[..n])?;
            Ok(n)
        })
    };
    let mut total = 0usize;
    let mut blocked = false;
    for _ in 0..200 {
        match put(&c) {
            Ok(n) => total += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                blocked = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        blocked,
        "the peer reads nothing: the stream fills ({total} bytes)"
    );
    // the peer's RMB and the send buffer both hold bytes (the RMB's size
    // depends on the other connections of this test process: `RmbCrowding`)
    let (rmb, _) = s.buffer_sizes().unwrap();
    assert!(
        total > rmb,
        "only {total} bytes before WouldBlock (RMB {rmb})"
    );
    let fd = c.readiness_fd().unwrap();
    for _ in 0..20 {
        let mut p = [PollFd::new(&fd, PollFlags::OUT)];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        poll(&mut p, Some(&zero)).unwrap();
        if !p[0].revents().contains(PollFlags::OUT) {
            return;
        }
        match put(&c) {
            Ok(n) => assert!(n > 0),
            Err(e) => panic!("writable, and the in-place write says {e}"),
        }
    }
}
