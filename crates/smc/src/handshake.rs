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
/// `Err`: the interface list could not be read now (out of descriptors or
/// memory), so the prefix rules cannot be applied: decline with "insufficient
/// resources" (Linux's SMC_CLC_DECL_MEM) rather than a wrong reason.
fn capabilities(local: IpAddr) -> Result<LocalCapabilities, SystemId> {
    let (system_id, if_addrs) = match crate::ctx::interface_of(local) {
        Ok(Some((ifname, a))) => (local_system_id(&ifname), a),
        Ok(None) => (crate::ctx::system_id(Mac::default()), Vec::new()),
        Err(_) => return Err(crate::ctx::system_id(Mac::default())),
    };
    Ok(LocalCapabilities {
        system_id,
        v1: None,
        v2_gid: None,
        ueids: Vec::new(),
        if_addrs,
    })
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
/// `unavailable`: the device could not be had now (see
/// [`crate::ctx::Device::Unavailable`]).
pub(crate) fn client_start(local: IpAddr, unavailable: bool) -> (Vec<u8>, Option<Fallback>) {
    let (system_id, r) = match capabilities(local) {
        Ok(_) if unavailable => (crate::ctx::system_id(Mac::default()), Err(DeclineCode::Mem)),
        Ok(caps) => (caps.system_id, negotiate::build_proposal(local, &caps)),
        Err(id) => (id, Err(DeclineCode::Mem)),
    };
    match r {
        Ok(p) => (ClcMessage::Proposal(p).encode(), None),
        // Linux: a client with nothing to offer declines instead of proposing.
        Err(code) => (
            decline(SMC_V1, system_id, code),
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
                capabilities(local).map_or_else(|id| id, |c| c.system_id),
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
/// send back (possibly nothing) and the outcome. `unavailable`: the device
/// could not be had now.
pub(crate) fn server_reply(
    local: IpAddr,
    unavailable: bool,
    m: ClcMessage,
) -> io::Result<(Vec<u8>, Fallback)> {
    match m {
        ClcMessage::Decline(d) => Ok((
            Vec::new(),
            Fallback {
                reason: DeclineCode::PeerDecl,
                peer: Some(d.diagnosis),
            },
        )),
        ClcMessage::Proposal(p) => {
            let (system_id, code) = match capabilities(local) {
                Ok(caps) if unavailable => (caps.system_id, DeclineCode::Mem),
                Ok(caps) => match negotiate::server_choose(&p, &caps) {
                    Err(code) => (caps.system_id, code),
                    // not reachable without capabilities; decline all the same
                    Ok(_) => (caps.system_id, DeclineCode::NoSmcDev),
                },
                Err(id) => (id, DeclineCode::Mem),
            };
            Ok((
                decline(negotiate::decline_version(&p), system_id, code),
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
pub(crate) fn client(tcp: &mut TcpStream, unavailable: bool) -> io::Result<Fallback> {
    let (first, done) = client_start(tcp.local_addr()?.ip(), unavailable);
    tcp.write_all(&first)?;
    if let Some(f) = done {
        return Ok(f);
    }
    let local = tcp.local_addr()?.ip();
    let (answer, f) = client_reply(local, read_clc(tcp, ClcType::Accept)?)?;
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

/// Whether the client handshakes of this process spin before they sleep
/// (see [`crate::ctx::Spin`]): a handshake's wait is the server's whole step
/// (its listener wakes, reads the Proposal, answers), which on a core shared
/// with the server never ends while we spin, only once we sleep.
fn client_spin() -> &'static crate::ctx::Spin {
    static S: std::sync::OnceLock<crate::ctx::Spin> = std::sync::OnceLock::new();
    S.get_or_init(crate::ctx::Spin::default)
}

/// The CLC handshake driven by an endpoint (a device serves this connection).
/// Returns the connection's status and any TCP bytes that followed the CLC
/// messages (the peer's first application data after a Decline).
/// `tcp` stays in blocking mode: reads do not wait (`MSG_DONTWAIT`), writes
/// may.
pub(crate) fn with_endpoint(
    tcp: &TcpStream,
    shared: &std::sync::Arc<crate::ctx::Shared>,
    id: smc_engine::endpoint::ConnId,
) -> io::Result<(smc_engine::endpoint::ConnStatus, Vec<u8>)> {
    use rustix::net::RecvFlags;
    let mut leftover = Vec::new();
    let mut buf = [0u8; 1024];
    // (until, budget) of the one spin, once the first wait began
    let mut spin: Option<(std::time::Instant, std::time::Duration)> = None;
    let mut slept = false;
    // Woken by the endpoint's progress (a completion, a timer) while this
    // thread waits for TCP data too: registered only when it sleeps while a
    // step of the handshake runs over the device (CONFIRM_RKEY, the first
    // link's CONFIRM_LINK). Waiting for the Accept it needs none (TCP data
    // or its deadline end that wait), and one would ring at every pump of
    // the endpoint's other connections.
    let mut progress = None;
    let result = loop {
        let (out, status, next, device_step) = {
            let mut ep = shared.lock();
            // through Shared: a completion taken here may be a parked reader's
            shared.try_pump(&mut ep).map_err(io::Error::other)?;
            let device_step = !matches!(
                ep.handshake_phase(id),
                Some(smc_engine::state::HandshakePhase::AwaitAccept)
            );
            (
                ep.clc_output(id),
                ep.status(id),
                shared.next_wake(&mut ep),
                device_step,
            )
        };
        if !device_step {
            progress = None;
        }
        if !out.is_empty() {
            (&*tcp).write_all(&out)?;
        }
        if let Some(r) = ended(status) {
            break r;
        }
        match rustix::net::recv(tcp, &mut buf, RecvFlags::DONTWAIT) {
            Ok((n, _)) => take_input(shared, id, &buf[..n], &mut leftover),
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {
                // Spin a little (an LLC answer or the next CLC message is
                // usually microseconds away, when the server has a core of
                // its own), then wait for TCP data, the endpoint's progress
                // (whoever pumps: the progress thread sleeps on the
                // completion channel) or its next deadline (the handshake's
                // own is one).
                let now = std::time::Instant::now();
                let (until, budget) = *spin.get_or_insert_with(|| {
                    let b = if crate::ctx::may_spin() {
                        client_spin().budget()
                    } else {
                        std::time::Duration::ZERO
                    };
                    (now + b, b)
                });
                if now < until {
                    std::hint::spin_loop();
                    continue;
                }
                if !slept {
                    client_spin().miss(budget);
                    slept = true;
                }
                if device_step && progress.is_none() {
                    progress = Some(shared.progress_fd()?);
                    // (a pump between the look above and the registration
                    // rang nobody: look again before sleeping)
                    continue;
                }
                use rustix::event::{poll, PollFd, PollFlags};
                let ts = crate::ctx::timespec_until(next);
                match &progress {
                    Some(progress) => {
                        let pfd_progress = progress.fd();
                        let mut pfd = [
                            PollFd::new(tcp, PollFlags::IN),
                            PollFd::new(&pfd_progress, PollFlags::IN),
                        ];
                        let _ = poll(&mut pfd, ts.as_ref());
                        // Drained only when it was rung, and before the pump
                        // that follows: a ring after this read still wakes
                        // the next poll.
                        if pfd[1].revents().contains(PollFlags::IN) {
                            progress.clear();
                        }
                    }
                    None => {
                        let _ = poll(&mut [PollFd::new(tcp, PollFlags::IN)], ts.as_ref());
                    }
                }
            }
            Err(e) => {
                shared.lock().tcp_closed(id);
                break Err(e.into());
            }
        }
    };
    if spin.is_some_and(|(_, b)| !b.is_zero()) && !slept {
        client_spin().hit();
    }
    result.map(|s| (s, leftover))
}

/// What a server-side handshake waits for next (see [`Accepting::step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// The TCP socket: readable, or writable with `write`. `rdma`: a step of
    /// the handshake runs over the device meanwhile (link confirmation, rkey
    /// exchange, a first contact it waits for): look again when the
    /// endpoint makes progress (its
    /// [`Shared::progress_fd`](crate::ctx::Shared::progress_fd)), or soon
    /// if there is no such descriptor.
    Wait { write: bool, rdma: bool },
    /// Over: [`Accepting::into_stream`].
    Done,
}

/// How a server-side handshake runs.
enum How {
    /// An endpoint serves the connection.
    Engine(crate::stream::SmcConn),
    /// Only a shared-memory device serves the connection and the client's
    /// address is not of our network namespace (see
    /// [`crate::ctx::Device::IfOnHost`]): nothing is sent until the
    /// client's first bytes are there, then the endpoint runs the handshake
    /// if the client is on this host, else it is declined as without a
    /// device (finding 3: an Accept followed by a Decline would cost a
    /// kernel client 4 s).
    IfOnHost {
        shared: std::sync::Arc<crate::ctx::Shared>,
        local: IpAddr,
        peer: IpAddr,
        deadline: std::time::Instant,
    },
    /// No device: the client's Proposal is declined (or its Decline taken).
    NoDevice {
        local: IpAddr,
        unavailable: bool,
        reader: ClcReader,
        deadline: std::time::Instant,
        outcome: Option<Fallback>,
        failed: bool,
    },
}

impl How {
    fn engine(
        shared: std::sync::Arc<crate::ctx::Shared>,
        local: IpAddr,
        ask: crate::ctx::Bufs,
    ) -> How {
        let id = crate::ctx::accept_in(&mut shared.lock(), local, ask);
        How::Engine(crate::stream::SmcConn::handshaking(shared, id))
    }

    fn no_device(local: IpAddr, unavailable: bool) -> How {
        How::NoDevice {
            local,
            unavailable,
            reader: ClcReader::new(),
            deadline: std::time::Instant::now() + CLC_WAIT_TIME,
            outcome: None,
            failed: false,
        }
    }
}

/// A server-side CLC handshake stepped without ever blocking, by the
/// listener's driver thread, which runs every pending handshake this way
/// (Linux runs each on a work item of its own, af_smc.c `smc_listen_work`).
/// Each has its own deadlines: the engine's (6 s per expected CLC message),
/// or [`CLC_WAIT_TIME`] for the Proposal without a device. The socket stays
/// in blocking mode (as `accept()` hands it over): reads and writes here do
/// not wait (`MSG_DONTWAIT`).
pub(crate) struct Accepting {
    tcp: TcpStream,
    /// CLC bytes not yet written.
    out: Vec<u8>,
    /// TCP bytes behind the CLC messages (the client's first data after a
    /// Decline).
    leftover: Vec<u8>,
    how: How,
    /// The buffer sizes asked for the connection.
    ask: crate::ctx::Bufs,
}

impl Accepting {
    /// Starts the handshake on `tcp` (whose SYN carried the SMC option), over
    /// the endpoint serving its local address if there is one.
    /// (`ask`: the buffer sizes asked for the connection, its listener's)
    pub(crate) fn start(tcp: TcpStream, ask: crate::ctx::Bufs) -> io::Result<Accepting> {
        let peer = tcp.peer_addr()?.ip();
        Self::start_from(tcp, ask, peer, None)
    }

    /// [`Self::start`] for a connection whose peer address `accept()` gave.
    pub(crate) fn start_from(
        tcp: TcpStream,
        ask: crate::ctx::Bufs,
        peer: std::net::IpAddr,
        local: Option<std::net::IpAddr>,
    ) -> io::Result<Accepting> {
        use crate::ctx::Device;
        let local = match local {
            Some(l) => l,
            None => tcp.local_addr()?.ip(),
        };
        let dev = crate::ctx::endpoint_for(local, peer, crate::ctx::Role::Server);
        let how = match dev {
            Device::Endpoint(shared) => How::engine(shared, local, ask),
            Device::IfOnHost(shared) => How::IfOnHost {
                shared,
                local,
                peer,
                deadline: std::time::Instant::now() + CLC_WAIT_TIME,
            },
            Device::None | Device::Unavailable => {
                How::no_device(local, matches!(dev, Device::Unavailable))
            }
        };
        Ok(Accepting {
            tcp,
            out: Vec::new(),
            leftover: Vec::new(),
            how,
            ask,
        })
    }

    /// A handshake on `tcp` that declines SMC whatever the client proposes
    /// (as without a device): the client falls back to TCP, and so does
    /// the connection ([`Self::into_tcp`]).
    pub(crate) fn start_declining(tcp: TcpStream) -> io::Result<Accepting> {
        let local = tcp.local_addr()?.ip();
        Ok(Accepting {
            tcp,
            out: Vec::new(),
            leftover: Vec::new(),
            how: How::no_device(local, false),
            ask: (None, None),
        })
    }

    /// The TCP socket of a handshake started with [`Self::start_declining`]
    /// once [`Progress::Done`], with nothing of the CLC left on it; `None` if
    /// it failed, or if bytes behind the CLC messages were read (which a
    /// socket cannot take back).
    pub(crate) fn into_tcp(self) -> Option<TcpStream> {
        match self.how {
            How::NoDevice {
                outcome: Some(_),
                failed: false,
                ..
            } if self.leftover.is_empty() && self.out.is_empty() => Some(self.tcp),
            _ => None,
        }
    }

    /// The TCP socket, to poll.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The endpoint that runs this handshake, if one does: while a step
    /// runs over the device ([`Progress::Wait`] `rdma`) the driver sleeps
    /// until that endpoint makes progress ([`crate::ctx::Shared::progress_fd`]).
    pub(crate) fn endpoint(&self) -> Option<&std::sync::Arc<crate::ctx::Shared>> {
        match &self.how {
            How::Engine(c) => Some(&c.shared),
            _ => None,
        }
    }

    fn tcp_gone(&mut self) {
        match &mut self.how {
            How::Engine(c) => {
                c.shared.lock().tcp_closed(c.id);
            }
            How::NoDevice { failed, .. } => *failed = true,
            How::IfOnHost { local, .. } => {
                let mut how = How::no_device(*local, false);
                if let How::NoDevice { failed, .. } = &mut how {
                    *failed = true;
                }
                self.how = how;
            }
        }
    }

    /// Does what can be done now: writes pending CLC bytes, feeds what the
    /// socket has to the handshake, takes its output. Never blocks.
    pub(crate) fn step(&mut self) -> Progress {
        use rustix::io::Errno;
        use rustix::net::{RecvFlags, SendFlags};
        use smc_engine::state::HandshakePhase as P;
        let mut buf = [0u8; 2048];
        loop {
            if !self.out.is_empty() {
                match rustix::net::send(
                    &self.tcp,
                    &self.out,
                    SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
                ) {
                    Ok(n) => {
                        self.out.drain(..n);
                        continue;
                    }
                    Err(Errno::AGAIN) => {
                        return Progress::Wait {
                            write: true,
                            rdma: false,
                        }
                    }
                    Err(Errno::INTR) => continue,
                    Err(_) => {
                        self.out.clear();
                        self.tcp_gone();
                        return Progress::Done;
                    }
                }
            }
            let rdma = match &mut self.how {
                How::Engine(c) => {
                    let (out, status, rdma) = {
                        let mut ep = c.shared.lock();
                        let rdma = !matches!(
                            ep.handshake_phase(c.id),
                            Some(P::AwaitProposal) | Some(P::AwaitConfirm) | Some(P::AwaitAccept)
                        );
                        if rdma {
                            // the step over the device goes on without waiting
                            // for the progress thread
                            c.shared.pump(&mut ep);
                        }
                        (ep.clc_output(c.id), ep.status(c.id), rdma)
                    };
                    if !out.is_empty() {
                        self.out = out;
                        continue;
                    }
                    if ended(status).is_some() {
                        return Progress::Done;
                    }
                    rdma
                }
                How::NoDevice {
                    outcome,
                    failed,
                    deadline,
                    ..
                } => {
                    if outcome.is_some() || *failed {
                        return Progress::Done;
                    }
                    if std::time::Instant::now() >= *deadline {
                        *failed = true;
                        return Progress::Done;
                    }
                    false
                }
                How::IfOnHost {
                    shared,
                    local,
                    peer,
                    deadline,
                } => {
                    let (shared, local, peer, deadline) =
                        (shared.clone(), *local, *peer, *deadline);
                    // Only look whether the client sent something: its
                    // bytes are for whichever way the handshake goes.
                    match rustix::net::recv(
                        &self.tcp,
                        &mut buf[..1],
                        RecvFlags::PEEK | RecvFlags::DONTWAIT,
                    ) {
                        Ok((0, _)) => self.tcp_gone(),
                        Ok(_) => {
                            self.how = if crate::ctx::shm_reaches(peer) {
                                How::engine(shared, local, self.ask)
                            } else {
                                How::no_device(local, false)
                            };
                        }
                        Err(Errno::AGAIN) => {
                            if std::time::Instant::now() >= deadline {
                                self.tcp_gone();
                                return Progress::Done;
                            }
                            return Progress::Wait {
                                write: false,
                                rdma: false,
                            };
                        }
                        Err(Errno::INTR) => {}
                        Err(_) => self.tcp_gone(),
                    }
                    continue;
                }
            };
            let n = match rustix::net::recv(&self.tcp, &mut buf, RecvFlags::DONTWAIT) {
                Ok((0, _)) => {
                    self.tcp_gone();
                    continue;
                }
                Ok((n, _)) => n,
                Err(Errno::AGAIN) => return Progress::Wait { write: false, rdma },
                Err(Errno::INTR) => continue,
                Err(_) => {
                    self.tcp_gone();
                    continue;
                }
            };
            match &mut self.how {
                How::Engine(c) => {
                    let used = c
                        .shared
                        .lock()
                        .clc_input(c.id, &buf[..n], crate::ctx::now());
                    self.leftover.extend_from_slice(&buf[used..n]);
                }
                // (never: its arm above decides before anything is read)
                How::IfOnHost { .. } => {}
                How::NoDevice {
                    local,
                    unavailable,
                    reader,
                    outcome,
                    failed,
                    ..
                } => {
                    let (used, msg) = reader.feed(&buf[..n], ClcType::Proposal);
                    match msg {
                        None => {}
                        Some(Ok(m)) => match server_reply(*local, *unavailable, m) {
                            Ok((answer, f)) => {
                                self.out = answer;
                                *outcome = Some(f);
                                self.leftover.extend_from_slice(&buf[used..n]);
                            }
                            Err(_) => *failed = true,
                        },
                        Some(Err(_)) => *failed = true,
                    }
                }
            }
        }
    }

    /// The connection once [`Progress::Done`]: SMC-R or a TCP fallback, in
    /// blocking mode; `None` if the handshake failed (the connection is
    /// closed, as Linux's listen worker drops it).
    pub(crate) fn into_stream(self) -> Option<crate::SmcStream> {
        use smc_engine::endpoint::ConnStatus;
        let Accepting {
            tcp, leftover, how, ..
        } = self;
        let mode = match how {
            How::Engine(c) => {
                let status = c.shared.lock().status(c.id);
                match status {
                    Some(ConnStatus::Smc) => {
                        return Some(crate::SmcStream::smc(tcp, crate::ctx::Role::Server, c));
                    }
                    Some(ConnStatus::Fallback { reason, peer }) => {
                        crate::Mode::Tcp(Fallback { reason, peer })
                    }
                    _ => {
                        crate::registry::handshake_error(crate::ctx::Role::Server);
                        return None;
                    }
                }
            }
            How::NoDevice {
                outcome: Some(f),
                failed: false,
                ..
            } => crate::Mode::Tcp(f),
            How::NoDevice { .. } | How::IfOnHost { .. } => {
                crate::registry::handshake_error(crate::ctx::Role::Server);
                return None;
            }
        };
        Some(crate::SmcStream::tcp_only(
            tcp,
            crate::ctx::Role::Server,
            mode,
            leftover,
        ))
    }
}
