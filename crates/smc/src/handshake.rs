//! The CLC handshake on a connected TCP socket, blocking, with Linux's timeouts
//! (`protocol-clc.md` §4.1–§4.3; 6 s per expected message).

use crate::stream::Fallback;
use smc_proto::clc_stream::{ClcReadError, ClcReader};
use smc_proto::negotiate::{self, LocalCapabilities};
use smc_wire::clc::{ClcMessage, ClcType, Decline, DeclineCode, CLC_WAIT_TIME, SMC_V1};
use smc_wire::types::{Mac, SystemId};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};

pub(crate) fn protocol_error(e: ClcReadError) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("SMC handshake failed: {e}"),
    )
}

/// Reads one CLC message, never a byte beyond it (the peer's TCP data may
/// follow a Decline).
fn read_clc(tcp: &mut TcpStream, expected: ClcType) -> io::Result<ClcMessage> {
    let old = tcp.read_timeout()?;
    tcp.set_read_timeout(Some(CLC_WAIT_TIME))?;
    let mut reader = ClcReader::new();
    let result = loop {
        let want = reader.wanted().max(1);
        let mut buf = vec![0u8; want];
        let n = match tcp.read(&mut buf) {
            Ok(0) => {
                break Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "SMC handshake failed: the peer closed the connection",
                ))
            }
            Ok(n) => n,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut =>
            {
                break Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "SMC handshake failed: no CLC message within 6 s",
                ))
            }
            Err(e) => break Err(e),
        };
        let (_, msg) = reader.feed(&buf[..n], expected);
        match msg {
            None => continue,
            Some(Ok(m)) => break Ok(m),
            Some(Err(e)) => break Err(protocol_error(e)),
        }
    };
    tcp.set_read_timeout(old)?;
    result
}

/// What this host offers on a connection no SMC device serves: no device, but
/// the addresses of the connection's interface, so that a server runs the
/// prefix check first as Linux does and declines "no SMC device" rather than
/// "different prefix" when the prefixes agree.
fn capabilities(local: IpAddr) -> LocalCapabilities {
    let (system_id, if_addrs) = match crate::ctx::interface_of(local) {
        Some((ifname, a)) => (local_system_id(&ifname), a),
        None => (crate::ctx::system_id(Mac::default()), Vec::new()),
    };
    LocalCapabilities {
        system_id,
        v1: None,
        v2_gid: None,
        ueids: Vec::new(),
        if_addrs,
    }
}

/// This process's system ID as an endpoint on `ifname` would send it: a
/// Decline carries the sender's system ID (Linux fills in its
/// `local_systemid` even without a device, smc_clc.c `smc_clc_send_decline`).
fn local_system_id(ifname: &str) -> SystemId {
    let base = smc_config::pnet::base_netdev(std::path::Path::new("/sys/class/net"), ifname);
    let mac = smc_rdma::sys::link(&base)
        .ok()
        .flatten()
        .and_then(|l| l.mac)
        .map(Mac)
        .unwrap_or_default();
    crate::ctx::system_id(mac)
}

fn decline(version: u8, system_id: SystemId, code: DeclineCode) -> Vec<u8> {
    ClcMessage::Decline(Decline::new(version, system_id, code)).encode()
}

/// Client without a device, after the SYN-ACK carried the option: the first CLC
/// message to send, and the outcome if that ends the handshake.
pub(crate) fn client_start(local: IpAddr) -> (Vec<u8>, Option<Fallback>) {
    let caps = capabilities(local);
    match negotiate::build_proposal(local, &caps) {
        Ok(p) => (ClcMessage::Proposal(p).encode(), None),
        // Linux: a client with nothing to offer declines instead of proposing.
        Err(code) => (
            decline(SMC_V1, caps.system_id, code),
            Some(Fallback {
                reason: code,
                peer: None,
            }),
        ),
    }
}

/// Client without a device: the server's answer to our Proposal. Returns what
/// to send back (possibly nothing) and the outcome.
pub(crate) fn client_reply(local: IpAddr, m: ClcMessage) -> io::Result<(Vec<u8>, Fallback)> {
    match m {
        ClcMessage::Decline(d) => Ok((
            Vec::new(),
            Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(d.diagnosis),
            },
        )),
        // An Accept we cannot honour without a device: decline it.
        ClcMessage::Accept(a) => Ok((
            decline(
                a.version,
                capabilities(local).system_id,
                DeclineCode::NoSmcRDev,
            ),
            Fallback {
                reason: DeclineCode::NoSmcRDev,
                peer: None,
            },
        )),
        m => Err(protocol_error(ClcReadError::Unexpected(m.msg_type()))),
    }
}

/// Server without a device: the client's first CLC message. Returns what to
/// send back (possibly nothing) and the outcome.
pub(crate) fn server_reply(local: IpAddr, m: ClcMessage) -> io::Result<(Vec<u8>, Fallback)> {
    match m {
        ClcMessage::Decline(d) => Ok((
            Vec::new(),
            Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(d.diagnosis),
            },
        )),
        ClcMessage::Proposal(p) => {
            let caps = capabilities(local);
            let code = match negotiate::server_choose(&p, &caps) {
                Err(code) => code,
                // not reachable without capabilities; decline all the same
                Ok(_) => DeclineCode::NoSmcDev,
            };
            Ok((
                decline(negotiate::decline_version(&p), caps.system_id, code),
                Fallback {
                    reason: code,
                    peer: None,
                },
            ))
        }
        m => Err(protocol_error(ClcReadError::Unexpected(m.msg_type()))),
    }
}

/// Client side, after the SYN-ACK carried the option.
pub(crate) fn client(tcp: &mut TcpStream) -> io::Result<Fallback> {
    let (first, done) = client_start(tcp.local_addr()?.ip());
    tcp.write_all(&first)?;
    if let Some(f) = done {
        return Ok(f);
    }
    let local = tcp.local_addr()?.ip();
    let (answer, f) = client_reply(local, read_clc(tcp, ClcType::Accept)?)?;
    tcp.write_all(&answer)?;
    Ok(f)
}

/// Server side, after the SYN carried the option.
pub(crate) fn server(tcp: &mut TcpStream) -> io::Result<Fallback> {
    let local = tcp.local_addr()?.ip();
    let (answer, f) = server_reply(local, read_clc(tcp, ClcType::Proposal)?)?;
    tcp.write_all(&answer)?;
    Ok(f)
}

/// Whether a handshake driven by an endpoint is over, from the connection's
/// status: its outcome, or an error if the connection is gone.
pub(crate) fn ended(
    status: Option<smc_engine::endpoint::ConnStatus>,
) -> Option<io::Result<smc_engine::endpoint::ConnStatus>> {
    use smc_engine::endpoint::ConnStatus;
    match status {
        Some(ConnStatus::Handshaking) => None,
        Some(s) => Some(Ok(s)),
        None => Some(Err(io::Error::other(
            "SMC connection vanished during the handshake",
        ))),
    }
}

/// Feeds what the TCP connection gave during the handshake to the endpoint
/// (nothing: the peer closed it); bytes behind the CLC messages go to
/// `leftover`.
pub(crate) fn take_input(
    shared: &crate::ctx::Shared,
    id: smc_engine::endpoint::ConnId,
    data: &[u8],
    leftover: &mut Vec<u8>,
) {
    if data.is_empty() {
        shared.lock().tcp_closed(id);
        return;
    }
    let used = shared.lock().clc_input(id, data, crate::ctx::now());
    leftover.extend_from_slice(&data[used..]);
}

/// The CLC handshake driven by an endpoint (a device serves this connection).
/// Returns the connection's status and any TCP bytes that followed the CLC
/// messages (the peer's first application data after a Decline).
pub(crate) fn with_endpoint(
    tcp: &mut TcpStream,
    shared: &crate::ctx::Shared,
    id: smc_engine::endpoint::ConnId,
) -> io::Result<(smc_engine::endpoint::ConnStatus, Vec<u8>)> {
    tcp.set_nonblocking(true)?;
    let mut leftover = Vec::new();
    let mut buf = [0u8; 1024];
    let mut spin_until = None;
    let result = loop {
        let (out, status) = {
            let mut ep = shared.lock();
            // through Shared: a completion taken here may be a parked reader's
            shared.try_pump(&mut ep).map_err(io::Error::other)?;
            (ep.clc_output(id), ep.status(id))
        };
        if !out.is_empty() {
            tcp.set_nonblocking(false)?;
            let w = tcp.write_all(&out);
            tcp.set_nonblocking(true)?;
            w?;
        }
        if let Some(r) = ended(status) {
            break r;
        }
        match tcp.read(&mut buf) {
            Ok(n) => take_input(shared, id, &buf[..n], &mut leftover),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Spin a little (an LLC answer or the next CLC message is
                // usually microseconds away), then wait for TCP data; LLC
                // completions are looked at again every 100 us.
                let now = std::time::Instant::now();
                if now >= *spin_until.get_or_insert(now + crate::ctx::spin_time()) {
                    use rustix::event::{poll, PollFd, PollFlags, Timespec};
                    let mut pfd = [PollFd::new(&*tcp, PollFlags::IN)];
                    let ts = Timespec {
                        tv_sec: 0,
                        tv_nsec: 100_000,
                    };
                    let _ = poll(&mut pfd, Some(&ts));
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) => {
                shared.lock().tcp_closed(id);
                break Err(e);
            }
        }
    };
    tcp.set_nonblocking(false)?;
    result.map(|s| (s, leftover))
}
