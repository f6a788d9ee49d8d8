//! The client's and server's CLC steps over the tokio TCP socket, and the
//! waits of a handshake step that runs over the device.

use super::wait::{Chan, Dir};
use crate::ctx::Shared;
use crate::handshake::{self, client_reply, client_start, server_reply};
use crate::stream::{Fallback, SmcConn};
use ::tokio::net::TcpStream;
use smc_engine::endpoint::ConnStatus;
use smc_engine::state::HandshakePhase;
use smc_proto::clc_stream::ClcReader;
use smc_wire::clc::{ClcMessage, ClcType, CLC_WAIT_TIME};
use std::future::Future;
use std::io;
use std::task::Poll;

pub(super) async fn write_all(tcp: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        tcp.writable().await?;
        match tcp.try_write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one CLC message, never a byte beyond it (the peer's TCP data may
/// follow a Decline); 6 s at most, as Linux waits.
async fn read_clc(tcp: &TcpStream, expected: ClcType) -> io::Result<ClcMessage> {
    let read = async {
        let mut reader = ClcReader::new();
        loop {
            let mut buf = vec![0u8; reader.wanted().max(1)];
            tcp.readable().await?;
            let n = match tcp.try_read(&mut buf) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "SMC handshake failed: the peer closed the connection",
                    ))
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            match reader.feed(&buf[..n], expected).1 {
                None => {}
                Some(Ok(m)) => return Ok(m),
                Some(Err(e)) => return Err(handshake::protocol_error(e)),
            }
        }
    };
    ::tokio::time::timeout(CLC_WAIT_TIME, read)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "SMC handshake failed: no CLC message within 6 s",
            ))
        })
}

/// Client without a device: Proposal (or Decline), then the server's answer.
pub(super) async fn client_no_device(tcp: &TcpStream, unavailable: bool) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let (first, done) = client_start(local, unavailable);
    write_all(tcp, &first).await?;
    if let Some(f) = done {
        return Ok(f);
    }
    let (answer, f) = client_reply(local, read_clc(tcp, ClcType::Accept).await?)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Server without a device: the client's Proposal, declined.
pub(super) async fn server_no_device(tcp: &TcpStream, unavailable: bool) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let m = read_clc(tcp, ClcType::Proposal).await?;
    let (answer, f) = server_reply(local, unavailable, m)?;
    write_all(tcp, &answer).await?;
    Ok(f)
}

/// Whether the handshake waits for the peer's next CLC message (rather than
/// for a step over the device).
fn awaits_clc(phase: Option<HandshakePhase>) -> bool {
    matches!(
        phase,
        Some(HandshakePhase::AwaitAccept)
            | Some(HandshakePhase::AwaitProposal)
            | Some(HandshakePhase::AwaitConfirm)
    )
}

/// Waits until the TCP socket is readable or the engine's next deadline
/// (`until`: the handshake's own is one) has come; while a step runs over
/// the device (`rdma`), also until the endpoint takes completions (`seen`:
/// its count when the caller last looked). A handshake waiting for the
/// peer's CLC message does not wake for the device's traffic.
async fn handshake_wait(
    tcp: &TcpStream,
    shared: &Shared,
    chan: &mut Chan,
    seen: u64,
    rdma: bool,
    until: Option<std::time::Instant>,
) -> io::Result<()> {
    let mut armed = false;
    // (no deadline: the handshake has none left, the events end the wait)
    let mut tick = until.map(|u| Box::pin(::tokio::time::sleep_until(u.into())));
    std::future::poll_fn(|cx| {
        if rdma {
            let mut ep = shared.lock();
            if !armed {
                // arm, then look once more: a completion before arming signals nobody
                ep.arm().map_err(io::Error::other)?;
                armed = true;
            }
            // (any progress: the handshake's step is not one connection's data)
            shared.wake_on_progress(&mut ep, None, cx.waker());
            if shared.pump(&mut ep) != seen {
                return Poll::Ready(Ok(()));
            }
        }
        if tcp.poll_read_ready(cx).is_ready() {
            return Poll::Ready(Ok(()));
        }
        if rdma {
            if let Poll::Ready(r) = chan.poll_signal(Dir::Read, shared, cx) {
                return Poll::Ready(r);
            }
        }
        match tick.as_mut() {
            Some(t) => t.as_mut().poll(cx).map(Ok),
            None => Poll::Pending,
        }
    })
    .await
}

/// The CLC handshake driven by the endpoint (a device serves this
/// connection). Returns the connection's status and the TCP bytes that
/// followed the CLC messages (the peer's first data after a Decline).
pub(super) async fn with_endpoint(
    tcp: &TcpStream,
    conn: &SmcConn,
    chan: &mut Chan,
) -> io::Result<(ConnStatus, Vec<u8>)> {
    let (shared, id) = (&*conn.shared, conn.id);
    let mut leftover = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let (out, status, seen, rdma, until) = {
            let mut ep = shared.lock();
            let rdma = !awaits_clc(ep.handshake_phase(id));
            // (pumped only when the device has a part in the next step, or
            // a deadline is due)
            let seen = if rdma {
                shared.pump(&mut ep)
            } else {
                ep.completions()
            };
            let until = shared.next_wake(&mut ep);
            (ep.clc_output(id), ep.status(id), seen, rdma, until)
        };
        if !out.is_empty() {
            write_all(tcp, &out).await?;
        }
        if let Some(r) = handshake::ended(status) {
            return r.map(|s| (s, leftover));
        }
        match tcp.try_read(&mut buf) {
            Ok(n) => handshake::take_input(shared, id, &buf[..n], &mut leftover),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                handshake_wait(tcp, shared, chan, seen, rdma, until).await?
            }
            Err(e) => {
                shared.lock().tcp_closed(id);
                return Err(e);
            }
        }
    }
}
