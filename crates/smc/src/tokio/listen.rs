//! `SmcListener`: the handshakes of all arrived connections run
//! concurrently inside `accept`, each with a waker of its own.

use super::clc::server_no_device;
use super::{lock, SmcStream};
use crate::ctx;
use crate::listen::{out_of_resources, without_handshake};
use crate::stream::{Mode, SmcConn};
use ::tokio::net::{lookup_host, TcpListener, TcpStream, ToSocketAddrs};
use smc_wire::clc::CLC_WAIT_TIME;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

/// How long the listener stops taking connections after running out of a
/// resource (descriptors, memory): they wait in the kernel's backlog, and
/// `accept` does not spin on the error.
const PAUSE: Duration = Duration::from_millis(100);

/// A connection's handshake, run inside the listener.
type Handshake = Pin<Box<dyn Future<Output = io::Result<SmcStream>> + Send>>;

/// Wake-ups of a listener: the tasks waiting in `accept` (the handshakes
/// run inside the listener, polled by whichever task accepts), and which
/// handshakes were woken (each has a waker of its own, so that a wake-up
/// polls only the handshakes it concerns).
#[derive(Default)]
struct ListenWake {
    accept: Mutex<Vec<Waker>>,
    woken: Mutex<Vec<u64>>,
}

impl ListenWake {
    fn register(&self, w: &Waker) {
        let mut v = lock(&self.accept);
        if !v.iter().any(|x| x.will_wake(w)) {
            v.push(w.clone());
        }
    }
}

impl Wake for ListenWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let v = std::mem::take(&mut *lock(&self.accept));
        for w in v {
            w.wake();
        }
    }
}

/// The waker of one handshake of a listener.
struct HandshakeWaker {
    key: u64,
    listen: Arc<ListenWake>,
}

impl Wake for HandshakeWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.listen.woken).push(self.key);
        self.listen.wake_by_ref();
    }
}

/// A handshake in progress inside a listener.
struct Slot {
    fut: Handshake,
    addr: SocketAddr,
    waker: Waker,
}

#[derive(Default)]
pub(super) struct Handshakes {
    next_key: u64,
    slots: HashMap<u64, Slot>,
    /// Finished connections taken over from a blocking listener.
    ready: Vec<(SmcStream, SocketAddr)>,
    /// Taking connections is paused after running out of a resource.
    paused: Option<Pin<Box<::tokio::time::Sleep>>>,
}

/// An async listener whose connections use SMC-R when the client can
/// (`tokio::net::TcpListener`-shaped).
pub struct SmcListener {
    tcp: TcpListener,
    opted: bool,
    hs: Mutex<Handshakes>,
    wake: Arc<ListenWake>,
    /// Listed in the registry (smcss) while this lives.
    _listed: Option<crate::registry::Token>,
}

impl fmt::Debug for SmcListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmcListener")
            .field("tcp", &self.tcp)
            .field("opted", &self.opted)
            .finish()
    }
}

/// A freshly accepted connection: ready at once, or handshaking.
enum Arrival {
    Ready(SmcStream),
    Handshake(Handshake),
}

impl SmcListener {
    /// Binds like `tokio::net::TcpListener::bind` (the first address that works).
    pub async fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<SmcListener> {
        let mut last = None;
        for a in lookup_host(addr).await? {
            match crate::SmcListener::bind(a).and_then(Self::from_std) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no addresses to bind")))
    }

    /// An async listener from a blocking one. Must be called inside a tokio
    /// runtime. Connections the blocking listener had finished are kept;
    /// those still in their handshake are closed.
    pub fn from_std(l: crate::SmcListener) -> io::Result<SmcListener> {
        let (tcp, opted, ready) = l.into_parts()?;
        tcp.set_nonblocking(true)?;
        // (taken from the end: the oldest last)
        let ready = ready
            .into_iter()
            .rev()
            .map(|(s, a)| SmcStream::from_std(s).map(|s| (s, a)))
            .collect::<io::Result<Vec<_>>>()?;
        let wake = Arc::default();
        let listed = crate::registry::listener(tcp.as_fd());
        Ok(SmcListener {
            tcp: TcpListener::from_std(tcp)?,
            opted,
            hs: Mutex::new(Handshakes {
                ready,
                ..Handshakes::default()
            }),
            wake,
            _listed: listed,
        })
    }

    /// The blocking listener (in blocking mode). Connections still in their
    /// handshake, or finished but not accepted, are closed.
    pub fn into_std(self) -> io::Result<crate::SmcListener> {
        let tcp = self.tcp.into_std()?;
        tcp.set_nonblocking(false)?;
        crate::SmcListener::from_parts(tcp, self.opted)
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Accepts the next connection whose handshake has finished (SMC-R or a
    /// TCP fallback). Cancel-safe: a dropped `accept` loses no connection.
    pub async fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    /// Polls for the next connection whose handshake has finished. After the
    /// listener ran out of descriptors or memory taking a connection, the
    /// error is returned once (as `TcpListener::poll_accept` returns it) and
    /// no connection is taken for 100 ms (they wait in the kernel's backlog).
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(SmcStream, SocketAddr)>> {
        // register first: a wake-up between the polls below is not lost
        self.wake.register(cx.waker());
        let mut hs = lock(&self.hs);
        if let Some(r) = hs.ready.pop() {
            return Poll::Ready(Ok(r));
        }
        let woken = std::mem::take(&mut *lock(&self.wake.woken));
        for (i, key) in woken.iter().enumerate() {
            let Some(slot) = hs.slots.get_mut(key) else {
                continue;
            };
            let waker = slot.waker.clone();
            let Poll::Ready(r) = slot.fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
                continue;
            };
            let slot = hs.slots.remove(key).expect("polled just now");
            // (a connection that failed its handshake is closed; serve the others)
            if let Ok(s) = r {
                // the others woken are polled next time
                lock(&self.wake.woken).extend_from_slice(&woken[i + 1..]);
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok((s, slot.addr)));
            }
        }
        if let Some(p) = &mut hs.paused {
            if p.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            hs.paused = None;
        }
        let lw = Waker::from(self.wake.clone());
        let mut lcx = Context::from_waker(&lw);
        while hs.slots.len() < crate::listen::MAX_HANDSHAKES {
            let (tcp, addr) = match self.tcp.poll_accept(&mut lcx) {
                Poll::Pending => break,
                Poll::Ready(Ok(c)) => c,
                Poll::Ready(Err(e)) if out_of_resources(&e) => {
                    let mut p = Box::pin(::tokio::time::sleep(PAUSE));
                    let _ = p.as_mut().poll(cx);
                    hs.paused = Some(p);
                    return Poll::Ready(Err(e));
                }
                // that connection only (ECONNABORTED, ...)
                Poll::Ready(Err(_)) => continue,
            };
            match self.arrival(tcp) {
                Ok(Arrival::Ready(s)) => return Poll::Ready(Ok((s, addr))),
                Ok(Arrival::Handshake(mut fut)) => {
                    let key = hs.next_key;
                    hs.next_key += 1;
                    let waker = Waker::from(Arc::new(HandshakeWaker {
                        key,
                        listen: self.wake.clone(),
                    }));
                    match fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                        Poll::Pending => {
                            hs.slots.insert(key, Slot { fut, addr, waker });
                        }
                        Poll::Ready(Ok(s)) => return Poll::Ready(Ok((s, addr))),
                        Poll::Ready(Err(_)) => {}
                    }
                }
                Err(_) => {}
            }
        }
        Poll::Pending
    }

    fn arrival(&self, tcp: TcpStream) -> io::Result<Arrival> {
        if let Some(mode) = without_handshake(self.opted, tcp.as_fd()) {
            return Ok(Arrival::Ready(SmcStream::tcp_only(
                tcp,
                ctx::Role::Server,
                mode,
                Vec::new(),
            )));
        }
        let local = tcp.local_addr()?.ip();
        let peer = tcp.peer_addr()?.ip();
        Ok(Arrival::Handshake(
            match ctx::endpoint_for(local, peer, ctx::Role::Server) {
                ctx::Device::Endpoint(shared) => {
                    let id = ctx::accept_in(&mut shared.lock(), local, (None, None));
                    // the connection is released if the handshake is dropped unpolled
                    Box::pin(SmcStream::finish_handshake(
                        tcp,
                        ctx::Role::Server,
                        SmcConn::handshaking(shared, id),
                    ))
                }
                ctx::Device::IfOnHost(shared) => Box::pin(async move {
                    // nothing is sent before the client's first bytes are
                    // there; then the device serves it only if it is on this
                    // host (see `ctx::Device::IfOnHost`)
                    let mut b = [0u8; 1];
                    match ::tokio::time::timeout(CLC_WAIT_TIME, tcp.peek(&mut b)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(Ok(_)) => {
                            return Err(io::Error::new(
                                io::ErrorKind::ConnectionReset,
                                "SMC handshake failed: the peer closed the connection",
                            ))
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(_) => {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "SMC handshake failed: no CLC message within 6 s",
                            ))
                        }
                    }
                    if ctx::shm_reaches(peer) {
                        let id = ctx::accept_in(&mut shared.lock(), local, (None, None));
                        SmcStream::finish_handshake(
                            tcp,
                            ctx::Role::Server,
                            SmcConn::handshaking(shared, id),
                        )
                        .await
                    } else {
                        drop(shared);
                        let f = server_no_device(&tcp, false).await?;
                        Ok(SmcStream::tcp_only(
                            tcp,
                            ctx::Role::Server,
                            Mode::Tcp(f),
                            Vec::new(),
                        ))
                    }
                }),
                dev => {
                    let unavailable = matches!(dev, ctx::Device::Unavailable);
                    Box::pin(async move {
                        let f = server_no_device(&tcp, unavailable).await?;
                        Ok(SmcStream::tcp_only(
                            tcp,
                            ctx::Role::Server,
                            Mode::Tcp(f),
                            Vec::new(),
                        ))
                    })
                }
            },
        ))
    }
}
