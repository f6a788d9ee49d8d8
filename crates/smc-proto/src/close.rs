//! The SMC connection close state machine.
//!
//! Spec: `protocol-llc-cdc.md` §5 (states §5.1, what is sent §5.2, active close
//! §5.3, passive close §5.4, active abort §5.5), matching Linux `net/smc/smc_close.c`
//! (`smc_close_active`, `smc_close_shutdown_write`, `smc_close_passive_work`,
//! `smc_close_passive_abort_received`, `smc_close_active_abort`).
//!
//! All close signalling travels in CDC messages as connection-state flags
//! (byte 25): `peer_done_writing` (shutdown of our write side), `peer_conn_closed`
//! (orderly close) and `peer_conn_abort` (abnormal close). Flags we have sent are
//! sticky: every later CDC carries them too, so the machine keeps them in
//! [`Closer::tx_flags`] and an action only says *that* a CDC must go out now.
//!
//! The machine is pure: [`Closer::handle`] takes an event and returns the
//! [`Outcome`] (new state, CDC to send, TCP action, error to report). Waiting for
//! unsent data to drain before a close CDC (§5.2, up to 2 s in Linux) is the
//! connection's job: it feeds [`CloseEvent::AppClose`] / [`CloseEvent::AppShutdownWrite`]
//! once the drain finished or timed out.
//!
//! One deliberate deviation from Linux: when a received abort moves the
//! connection straight to CLOSED although we never sent a close of our own (e.g.
//! in APPCLOSEWAIT2), we answer with an abort CDC at once. Linux sends nothing
//! there, which leaves a peer that is waiting in PEERCLOSEWAIT2 for our close
//! without an event (the two-peer property test in `tests/close_machine.rs` found
//! this). An extra abort is harmless to a Linux peer: it is ignored in CLOSED and
//! PROCESSABORT and ends PEERCLOSEWAIT*.

use core::fmt;

/// Connection states, with Linux's numeric values (`protocol-llc-cdc.md` §5.1),
/// which `smcss` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CloseState {
    /// Not yet established (handshake running). Linux `SMC_INIT` = 2.
    Init,
    /// Established, both directions open. `SMC_ACTIVE` = 1.
    Active,
    /// We closed or shut down first; waiting for the peer. `SMC_PEERCLOSEWAIT1` = 20.
    PeerCloseWait1,
    /// As PeerCloseWait1, and the peer has shut down its write side. `SMC_PEERCLOSEWAIT2` = 21.
    PeerCloseWait2,
    /// The peer closed or shut down first; waiting for our application. `SMC_APPCLOSEWAIT1` = 22.
    AppCloseWait1,
    /// As AppCloseWait1, and our application shut down its write side. `SMC_APPCLOSEWAIT2` = 23.
    AppCloseWait2,
    /// The peer closed after our shutdown; waiting for our application's close. `SMC_APPFINCLOSEWAIT` = 24.
    AppFinCloseWait,
    /// We closed after the peer's shutdown; waiting for the peer's close. `SMC_PEERFINCLOSEWAIT` = 25.
    PeerFinCloseWait,
    /// Aborting locally; transient in Linux. `SMC_PEERABORTWAIT` = 26.
    PeerAbortWait,
    /// The peer aborted; waiting for our application to close. `SMC_PROCESSABORT` = 27.
    ProcessAbort,
    /// Done. `SMC_CLOSED` = 7.
    Closed,
}

impl CloseState {
    /// Every state, in the order of §5.1.
    pub const ALL: [CloseState; 11] = [
        CloseState::Active,
        CloseState::Init,
        CloseState::Closed,
        CloseState::PeerCloseWait1,
        CloseState::PeerCloseWait2,
        CloseState::AppCloseWait1,
        CloseState::AppCloseWait2,
        CloseState::AppFinCloseWait,
        CloseState::PeerFinCloseWait,
        CloseState::PeerAbortWait,
        CloseState::ProcessAbort,
    ];

    /// Linux's numeric state value (`enum smc_state`).
    pub fn linux_value(self) -> u8 {
        match self {
            CloseState::Active => 1,
            CloseState::Init => 2,
            CloseState::Closed => 7,
            CloseState::PeerCloseWait1 => 20,
            CloseState::PeerCloseWait2 => 21,
            CloseState::AppCloseWait1 => 22,
            CloseState::AppCloseWait2 => 23,
            CloseState::AppFinCloseWait => 24,
            CloseState::PeerFinCloseWait => 25,
            CloseState::PeerAbortWait => 26,
            CloseState::ProcessAbort => 27,
        }
    }

    /// The name smc-tools prints (`smcss` "State" column).
    pub fn name(self) -> &'static str {
        match self {
            CloseState::Active => "ACTIVE",
            CloseState::Init => "INIT",
            CloseState::Closed => "CLOSED",
            CloseState::PeerCloseWait1 => "PEERCLW1",
            CloseState::PeerCloseWait2 => "PEERCLW2",
            CloseState::AppCloseWait1 => "APPLCLW1",
            CloseState::AppCloseWait2 => "APPLCLW2",
            CloseState::AppFinCloseWait => "APPLFINCLW",
            CloseState::PeerFinCloseWait => "PEERFINCLW",
            CloseState::PeerAbortWait => "PEERABORTW",
            CloseState::ProcessAbort => "PROCESSABORT",
        }
    }
}

impl fmt::Display for CloseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The three close flags of a CDC's connection-state byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CloseFlags {
    /// `peer_done_writing` (0x80): the sender shut down its write side.
    pub done_writing: bool,
    /// `peer_conn_closed` (0x40): the sender closed the connection.
    pub closed: bool,
    /// `peer_conn_abort` (0x20): abnormal close.
    pub abort: bool,
}

impl CloseFlags {
    /// No flag set.
    pub const NONE: CloseFlags = CloseFlags {
        done_writing: false,
        closed: false,
        abort: false,
    };

    /// True if `closed` or `abort` is set (Linux `smc_close_sent_any_close` /
    /// `smc_cdc_rxed_any_close`).
    pub fn any_close(self) -> bool {
        self.closed || self.abort
    }

    /// True if any flag is set.
    pub fn any(self) -> bool {
        self.done_writing || self.closed || self.abort
    }
}

impl fmt::Display for CloseFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.done_writing {
            parts.push("done_writing");
        }
        if self.closed {
            parts.push("closed");
        }
        if self.abort {
            parts.push("abort");
        }
        if parts.is_empty() {
            f.write_str("-")
        } else {
            f.write_str(&parts.join("+"))
        }
    }
}

/// What happened to the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseEvent {
    /// The handshake completed: Init becomes Active.
    Established,
    /// The application closed (released) the socket. `unread_data`: our RMB still
    /// holds received bytes the application never read — then an abort is sent
    /// instead of an orderly close, like a TCP RST on close with unread data.
    AppClose {
        /// Received data is left unread.
        unread_data: bool,
    },
    /// The application shut down its write side (`shutdown(SHUT_WR)`).
    AppShutdownWrite,
    /// A CDC from the peer carried close flags (as received; at least one set).
    Peer(CloseFlags),
    /// The connection is killed: its link group is gone (last link lost, DELETE_LINK
    /// ALL, protocol violation) or a failover validation found lost data (§5.5).
    /// `can_send`: a link is still usable, so an abort CDC may be attempted.
    Kill {
        /// An abort CDC can still be sent.
        can_send: bool,
    },
    /// This side resets the connection as a TCP socket would: data came
    /// after the application shut down both its sending and its receiving
    /// (tcp_input.c `tcp_rcv_state_process`, `LINUX_MIB_TCPABORTONDATA`:
    /// a socket in `FIN_WAIT1`/`FIN_WAIT2` with `RCV_SHUTDOWN` answers new
    /// data with a reset and takes `ECONNRESET`). An abort CDC goes out
    /// (the peer's TCP reset), the error is [`CloseError::Reset`].
    Reset,
}

impl fmt::Display for CloseEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseEvent::Established => write!(f, "established"),
            CloseEvent::AppClose { unread_data: false } => write!(f, "app close"),
            CloseEvent::AppClose { unread_data: true } => write!(f, "app close, unread data"),
            CloseEvent::AppShutdownWrite => write!(f, "app shutdown(WR)"),
            CloseEvent::Peer(fl) => write!(f, "peer CDC {fl}"),
            CloseEvent::Kill { can_send: true } => write!(f, "kill (link usable)"),
            CloseEvent::Kill { can_send: false } => write!(f, "kill (no link)"),
            CloseEvent::Reset => write!(f, "reset (ours)"),
        }
    }
}

/// The error a socket reports after an abnormal close.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseError {
    /// The peer aborted the connection (`ECONNRESET`).
    Reset,
    /// The connection was killed locally: link group lost (`ECONNABORTED`).
    Aborted,
    /// A reset after the peer's orderly end, as a TCP socket takes one in
    /// `CLOSE_WAIT`: `EPIPE` (tcp_input.c `tcp_reset`), and reads still
    /// find the end of the peer's stream (tcp.c `tcp_recvmsg_locked` looks
    /// at the FIN's `SOCK_DONE` before the error). Only for a caller that
    /// asked for TCP's errors: the reset a write to a peer that had closed
    /// draws ([`Closer::drawn_reset`]), or the peer's abort after its
    /// close ([`Closer::set_tcp_errors`]).
    ResetInCloseWait,
}

impl fmt::Display for CloseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseError::Reset => f.write_str("connection reset by peer"),
            CloseError::Aborted => f.write_str("connection aborted: SMC link group lost"),
            CloseError::ResetInCloseWait => {
                f.write_str("broken pipe: reset after the peer's close")
            }
        }
    }
}

/// What the caller must do with the TCP connection that carried the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcpAction {
    /// Nothing.
    None,
    /// `shutdown(SHUT_RDWR)`: the active closer does this right after its close CDC
    /// so that the peer's TCP does not linger (§5.2).
    Shutdown,
    /// Abort the TCP connection (send RST): the SMC connection was killed (§5.5).
    Abort,
}

/// The result of one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Outcome {
    /// State before the event.
    pub from: CloseState,
    /// State after the event.
    pub to: CloseState,
    /// Send a CDC now, carrying these (sticky) close flags.
    pub send_cdc: Option<CloseFlags>,
    /// What to do with the TCP connection.
    pub tcp: TcpAction,
    /// An error that reads/writes must report from now on.
    pub error: Option<CloseError>,
}

/// One connection's close state machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Closer {
    state: CloseState,
    tx: CloseFlags,
    rx: CloseFlags,
    released: bool,
    error: Option<CloseError>,
    /// The flags received and sent (rx, tx) when `error` came: where the
    /// connection stood, in TCP's terms, when it ended.
    at_error: Option<(CloseFlags, CloseFlags)>,
    /// [`Closer::error`] tells what a TCP socket would report.
    tcp_errors: bool,
}

impl Default for Closer {
    fn default() -> Self {
        Closer::new()
    }
}

impl Closer {
    /// A connection whose handshake is still running.
    pub fn new() -> Closer {
        Closer {
            state: CloseState::Init,
            tx: CloseFlags::NONE,
            rx: CloseFlags::NONE,
            released: false,
            error: None,
            at_error: None,
            tcp_errors: false,
        }
    }

    /// Current state.
    pub fn state(&self) -> CloseState {
        self.state
    }

    /// Close flags we have sent (sticky: every CDC we send carries them).
    pub fn tx_flags(&self) -> CloseFlags {
        self.tx
    }

    /// Close flags received from the peer so far.
    pub fn rx_flags(&self) -> CloseFlags {
        self.rx
    }

    /// The application has closed (released) the socket.
    pub fn released(&self) -> bool {
        self.released
    }

    /// Error for reads/writes after an abnormal close. With
    /// [`Closer::set_tcp_errors`], what a TCP socket would have of the same
    /// end: a reset or an abort that came after the peer had ended its
    /// stream in order (its `done_writing` or `closed` in an earlier CDC,
    /// TCP's FIN) is `EPIPE` ([`CloseError::ResetInCloseWait`]) for a
    /// peer's reset while we had sent nothing (TCP's `CLOSE_WAIT`), and no
    /// error at all once we had ended ours too (TCP's connection was over,
    /// its late reset ignored: tcp_input.c `tcp_reset` in `TCP_CLOSE`, and
    /// tcp.c `__tcp_close` sends none from a socket already closed) or when
    /// the connection was killed (its link group lost: the peer's process
    /// went away after its close, which TCP's peer kernel outlives, and
    /// only the reset a later write draws tells, [`Closer::drawn_reset`]).
    pub fn error(&self) -> Option<CloseError> {
        match (self.error, self.at_error) {
            (Some(e @ (CloseError::Reset | CloseError::Aborted)), Some((rx, tx)))
                if self.tcp_errors && ended_in_order(rx) =>
            {
                (e == CloseError::Reset && !tx.any()).then_some(CloseError::ResetInCloseWait)
            }
            (e, _) => e,
        }
    }

    /// Reports errors as a TCP socket would (see [`Closer::error`]), for a
    /// caller that stands in for one (the preload library); also for an
    /// error that came before. Linux's SMC reports `ECONNRESET` and
    /// `ECONNABORTED` there (smc_cdc.c `smc_cdc_msg_recv_action`,
    /// smc_close.c `smc_close_active_abort`), as the machine does without.
    pub fn set_tcp_errors(&mut self) {
        self.tcp_errors = true;
    }

    /// Whether errors are reported as a TCP socket's ([`Closer::set_tcp_errors`]).
    pub fn tcp_errors(&self) -> bool {
        self.tcp_errors
    }

    /// The peer ended its stream in order (`done_writing` or `closed`)
    /// before anything ended the connection otherwise: reads find the end
    /// of file once the data is read, whatever came after (TCP's FIN before
    /// its reset; Linux smc_rx.c `smc_rx_recvmsg` stops at `RCV_SHUTDOWN`
    /// before it looks at the error).
    pub fn peer_ended_in_order(&self) -> bool {
        ended_in_order(self.at_error.map_or(self.rx, |(rx, _)| rx))
    }

    /// The connection ended, and a TCP socket would not show it yet
    /// ([`Closer::error`]: the peer went away after its close, we had sent
    /// nothing): it shows [`Closer::shown_state`] `AppCloseWait1`, TCP's
    /// `CLOSE_WAIT`, until a write draws the reset.
    fn quiet_end(&self) -> bool {
        self.error == Some(CloseError::Aborted)
            && self.error().is_none()
            && self.at_error.is_some_and(|(_, tx)| !tx.any())
    }

    /// The state readiness shows: [`Closer::state`], except for an end a
    /// TCP socket would not show yet (see [`Closer::error`]), which shows
    /// the state a peer's close alone leaves (`AppCloseWait1`: readable to
    /// the end of file, writable, no hang-up).
    pub fn shown_state(&self) -> CloseState {
        if self.quiet_end() {
            CloseState::AppCloseWait1
        } else {
            self.state
        }
    }

    /// The application may still write: established, not shut down, not aborted,
    /// and the peer has not closed (a peer that only shut down its write side
    /// still reads: half-close). Linux `smc_tx_sendmsg` returns ECONNRESET once
    /// any close arrived from the peer.
    pub fn can_write(&self) -> bool {
        matches!(self.state, CloseState::Active | CloseState::AppCloseWait1)
            && !self.tx.any()
            && !self.rx.any_close()
            && self.error.is_none()
    }

    /// The peer will send no more data: reads return end-of-file once the RMB
    /// is drained (or the error, after an abort).
    pub fn peer_done(&self) -> bool {
        self.rx.any() || self.error.is_some()
    }

    /// A write after the peer closed the connection (not only its sending
    /// side), for a caller that must behave as a TCP socket: TCP accepts it,
    /// and the peer's kernel answers the data with a reset, which in
    /// `CLOSE_WAIT` sets the socket's error to `EPIPE` and ends it
    /// (tcp_input.c `tcp_reset`, `tcp_done`). The connection takes that
    /// end now: [`CloseError::ResetInCloseWait`], the state of a connection the
    /// peer ended ([`CloseState::ProcessAbort`]: the application's close
    /// sends an abort, which a closed peer ignores). Returns whether it
    /// applied: the peer closed in order, and nothing ended or shut down
    /// the connection on our side yet; or, with [`Closer::set_tcp_errors`],
    /// the connection ended in a way TCP would not show until such a write
    /// (the peer's process gone after its close or shutdown, see
    /// [`Closer::error`]). Linux's SMC fails such a write with `ECONNRESET`
    /// instead ([`Closer::can_write`]).
    pub fn drawn_reset(&mut self) -> bool {
        if self.quiet_end() {
            self.error = Some(CloseError::ResetInCloseWait);
            return true;
        }
        if self.error.is_some() || !self.rx.closed || self.rx.abort || self.tx.any() {
            return false;
        }
        self.error = Some(CloseError::ResetInCloseWait);
        self.at_error = Some((self.rx, self.tx));
        self.state = if self.released {
            CloseState::Closed
        } else {
            CloseState::ProcessAbort
        };
        true
    }

    /// Closed and released: every resource of the connection can be freed.
    pub fn is_finished(&self) -> bool {
        self.state == CloseState::Closed && self.released
    }

    /// Applies one event and says what to do.
    pub fn handle(&mut self, ev: CloseEvent) -> Outcome {
        let from = self.state;
        let mut send = false;
        let mut tcp = TcpAction::None;
        let mut error = None;
        use CloseState as S;
        match ev {
            CloseEvent::Established => {
                if self.state == S::Init {
                    self.state = S::Active;
                }
            }
            CloseEvent::AppShutdownWrite => match self.state {
                // §5.3: ACTIVE --shutdown(WR)--> send done_writing, PEERCLOSEWAIT1
                S::Active => {
                    self.tx.done_writing = true;
                    send = true;
                    self.state = S::PeerCloseWait1;
                }
                // §5.3: APPCLOSEWAIT1 --shutdown(WR)--> send done_writing, APPCLOSEWAIT2
                S::AppCloseWait1 => {
                    self.tx.done_writing = true;
                    send = true;
                    self.state = S::AppCloseWait2;
                }
                // Linux: nothing to do in every other state.
                _ => {}
            },
            CloseEvent::AppClose { unread_data } => {
                self.released = true;
                match self.state {
                    S::Init | S::PeerAbortWait | S::Closed => self.state = S::Closed,
                    S::Active => {
                        self.send_final(unread_data);
                        send = true;
                        tcp = TcpAction::Shutdown;
                        self.state = S::PeerCloseWait1;
                    }
                    S::PeerCloseWait1 | S::PeerCloseWait2 => {
                        // Only shut down so far: now send the close itself and keep
                        // waiting for the peer's close.
                        if !self.tx.any_close() {
                            self.send_final(unread_data);
                            send = true;
                        }
                    }
                    S::AppCloseWait1 | S::AppCloseWait2 => {
                        self.send_final(unread_data);
                        send = true;
                        self.state = if self.rx.any_close() {
                            S::Closed
                        } else {
                            S::PeerFinCloseWait
                        };
                    }
                    S::AppFinCloseWait => {
                        if !self.tx.any_close() {
                            self.send_final(unread_data);
                            send = true;
                        }
                        self.state = S::Closed;
                    }
                    S::PeerFinCloseWait => {}
                    S::ProcessAbort => {
                        self.tx.abort = true;
                        send = true;
                        self.state = S::Closed;
                    }
                }
            }
            CloseEvent::Peer(fl) => {
                let before = (self.rx, self.tx);
                self.rx.done_writing |= fl.done_writing;
                self.rx.closed |= fl.closed;
                if fl.abort {
                    let sent_only_shutdown = from_sent_only_shutdown(self.tx);
                    let sent_any_close = self.tx.any_close();
                    self.rx.abort = true;
                    // Receiving an abort makes every CDC we still send carry one.
                    self.tx.abort = true;
                    if self.error.is_none() {
                        self.error = Some(CloseError::Reset);
                        self.at_error = Some(before);
                        error = self.error();
                    }
                    self.state = match self.state {
                        S::Init | S::Active | S::AppCloseWait1 | S::AppFinCloseWait => {
                            S::ProcessAbort
                        }
                        S::PeerCloseWait1 | S::PeerCloseWait2 => {
                            if sent_only_shutdown {
                                S::ProcessAbort
                            } else {
                                S::Closed
                            }
                        }
                        S::AppCloseWait2 | S::PeerFinCloseWait | S::PeerAbortWait => S::Closed,
                        S::ProcessAbort => S::ProcessAbort,
                        S::Closed => S::Closed,
                    };
                    // A released socket has nobody left to close it.
                    if self.released && self.state == S::ProcessAbort {
                        self.state = S::Closed;
                    }
                    // Deviation from Linux (documented in the module docs): if this
                    // abort closes the connection before we ever sent a close, send
                    // our abort now. Otherwise a peer that closed with an abort while
                    // we were in APPCLOSEWAIT2 waits forever for our close.
                    if self.state == S::Closed && from != S::Closed && !sent_any_close {
                        send = true;
                    }
                } else if fl.any() {
                    match self.state {
                        S::Init | S::Active => self.state = S::AppCloseWait1,
                        S::PeerCloseWait1 | S::PeerCloseWait2 => {
                            if self.state == S::PeerCloseWait1 && self.rx.done_writing {
                                self.state = S::PeerCloseWait2;
                            }
                            if self.rx.any_close() {
                                self.state = if self.released && self.tx.any_close() {
                                    S::Closed
                                } else {
                                    S::AppFinCloseWait
                                };
                            }
                        }
                        S::PeerFinCloseWait if self.rx.any_close() => self.state = S::Closed,
                        _ => {}
                    }
                }
            }
            CloseEvent::Kill { .. } | CloseEvent::Reset => {
                let (can_send, why) = match ev {
                    CloseEvent::Kill { can_send } => (can_send, CloseError::Aborted),
                    _ => (true, CloseError::Reset),
                };
                let was = self.state;
                match was {
                    S::Init | S::Closed => {}
                    _ => {
                        if self.error.is_none() {
                            self.error = Some(why);
                            self.at_error = Some((self.rx, self.tx));
                            error = self.error();
                        }
                        if can_send && !self.tx.abort {
                            self.tx.abort = true;
                            send = true;
                        }
                        tcp = TcpAction::Abort;
                        // Linux passes through PEERABORTWAIT for ACTIVE/APPCLOSEWAIT*,
                        // then closes at once; every other state closes directly.
                        self.state = S::Closed;
                    }
                }
            }
        }
        Outcome {
            from,
            to: self.state,
            send_cdc: send.then_some(self.tx),
            tcp,
            error,
        }
    }

    /// The "final" close flag (§5.2): abort if unread data remains, else closed.
    fn send_final(&mut self, unread_data: bool) {
        if unread_data || self.rx.abort {
            self.tx.abort = true;
        } else {
            self.tx.closed = true;
        }
    }
}

/// The peer's flags `rx` end its stream in order (TCP's FIN), not by an
/// abort.
fn ended_in_order(rx: CloseFlags) -> bool {
    (rx.done_writing || rx.closed) && !rx.abort
}

/// Linux: `txflags->peer_done_writing && !smc_close_sent_any_close(conn)`.
fn from_sent_only_shutdown(tx: CloseFlags) -> bool {
    tx.done_writing && !tx.any_close()
}
