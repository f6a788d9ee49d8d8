//! The tokio adapter wakes a task for its own connection only (issue 15):
//! tasks that wait on idle SMC-R connections are not polled while another
//! connection of the same device carries a stream of messages, and still
//! wake for their own data. Alone in its test binary, so that no other
//! test's connections (their aborts, their timers) wake the idle tasks.
#![cfg(feature = "tokio")]

mod common;

use common::setup;
use smc::tokio::{SmcListener, SmcStream};
use smc::Mode;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Nothing here takes longer than this unless it hangs.
const HANG: Duration = Duration::from_secs(120);

/// A future that counts its polls: a spawned task is polled once, then once
/// per wake-up.
struct Counted<F> {
    polls: Arc<AtomicU64>,
    fut: Pin<Box<F>>,
}

impl<F: Future> Future for Counted<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.fut.as_mut().poll(cx)
    }
}

/// `idle` connections whose both ends wait in `read`, and one connection
/// that carries `rounds` 64-byte request/response exchanges. Returns the
/// idle tasks' wake-ups during the exchanges.
async fn idle_while_one_is_busy(idle: usize, rounds: usize) -> u64 {
    setup();
    let l = SmcListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let mut pairs = Vec::new();
    for _ in 0..=idle {
        let (c, s) = tokio::join!(SmcStream::connect(addr), l.accept());
        let (c, (s, _)) = (c.unwrap(), s.unwrap());
        assert_eq!(c.mode(), Mode::SmcR);
        assert_eq!(s.mode(), Mode::SmcR);
        pairs.push((c, s));
    }
    let (mut bc, mut bs) = pairs.pop().unwrap();
    // each end of each idle connection: a task waiting for one byte, and
    // the write half to send it with at the end
    let polls = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    let mut writers = Vec::new();
    for (c, s) in pairs {
        for st in [c, s] {
            let (mut rd, wr) = tokio::io::split(st);
            writers.push(wr);
            readers.push(tokio::spawn(Counted {
                polls: polls.clone(),
                fut: Box::pin(async move {
                    let mut b = [0u8; 1];
                    rd.read_exact(&mut b).await.unwrap();
                    b[0]
                }),
            }));
        }
    }
    let waiting = 2 * idle as u64;
    while polls.load(Ordering::Relaxed) < waiting {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = polls.load(Ordering::Relaxed);

    let server = tokio::spawn(async move {
        let mut m = [0u8; 64];
        for _ in 0..rounds {
            bs.read_exact(&mut m).await.unwrap();
            m[0] = m[0].wrapping_add(1);
            bs.write_all(&m).await.unwrap();
        }
        bs
    });
    let mut m = [0u8; 64];
    for i in 0..rounds {
        m[0] = i as u8;
        bc.write_all(&m).await.unwrap();
        bc.read_exact(&mut m).await.unwrap();
        assert_eq!(m[0], (i as u8).wrapping_add(1), "round {i}");
    }
    let _bs = server.await.unwrap();
    let woken = polls.load(Ordering::Relaxed) - before;

    // the idle tasks still wake for their own data
    for (i, w) in writers.iter_mut().enumerate() {
        w.write_all(&[i as u8]).await.unwrap();
    }
    for (i, r) in readers.into_iter().enumerate() {
        // (reader i reads what its peer, writer i ^ 1, sent)
        assert_eq!(r.await.unwrap(), (i ^ 1) as u8);
    }
    woken
}

/// About none per message: each idle task may be woken once or twice in
/// all (it watched the completion channel for everyone when the stream
/// began), never per message (every message woke every one of them).
fn check(idle: usize, rounds: usize, woken: u64) {
    eprintln!("{rounds} round trips, {idle} idle connections: idle tasks woken {woken} times");
    assert!(
        woken <= 4 * idle as u64,
        "{woken} wake-ups of {} tasks waiting on idle connections during {rounds} \
         round trips on another connection",
        2 * idle
    );
}

/// Both runtime flavours, one after the other (at the same time, one's
/// connections ending, their close timers firing, would wake the other's
/// tasks: a timer wakes every waiting task).
#[test]
fn idle_tasks_sleep_through_another_connections_messages() {
    let (idle, rounds) = (10, 500);
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (name, rt) in [("multi_thread", multi), ("current_thread", current)] {
        let woken = rt.block_on(async {
            tokio::time::timeout(HANG, idle_while_one_is_busy(idle, rounds))
                .await
                .expect("hangs")
        });
        eprint!("{name}: ");
        check(idle, rounds, woken);
    }
}
