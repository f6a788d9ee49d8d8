//! A Linux 6.12 kernel peer played over the sim fabric, for tests that hold
//! our endpoint to what the kernel sent and expects in the real capture of
//! two kernels talking SMC-R v2 over rxe (`smc-wire/tests/vectors`,
//! `lab/captures/README.md`).
//!
//! The kernel side is a raw RC QP on an rxe-like port (RoCE v2 GIDs only:
//! the link-local one, then `::ffff:10.99.0.x` at index 1), sending the
//! capture's CLC and LLC messages (with its own QP number, PSN and RMB
//! patched in) and running the kernel's data path rules for CDCs
//! (`smc_tx.c` `smc_tx_rdma_writes`: write_blocked when the data to send
//! fills the peer's RMB; `smc_tx_consumer_update`: a consumer update once
//! more than max(RMB/10, 2304) bytes were consumed and the sender has at
//! most half the RMB free or is write-blocked). Its SENDs come from a
//! registered buffer (the kernel creates its QPs with `max_inline_data` 0).
//! Both ends run the capture's application (`smc_pp -g`, captures §2.3):
//! 16 bytes of parameters, four 32-byte ping-pongs, 256 KiB in 64 KiB
//! writes, "A", "B", "B", close by the client.
#![allow(dead_code)]

use smc_engine::endpoint::{ConnId, Endpoint};
use smc_rdma::conformance::{ConnParams, Endpoint as RawEp};
use smc_rdma::sim::SimFabric;
use smc_rdma::*;
use smc_wire::cdc::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::Duration;

/// The kernel's RMB (`net.smc.rmem` 65536: RMBE size code 2), at offset 0
/// of its region.
pub const K_RMB: usize = 64 * 1024;
const RECV_AT: usize = K_RMB;
const RECV_SLOTS: usize = 48;
const SLOT: usize = 8192;
const SEND_AT: usize = RECV_AT + RECV_SLOTS * SLOT;
const SEND_SLOTS: usize = 16;
const WDATA_AT: usize = SEND_AT + SEND_SLOTS * SLOT;
const MR_LEN: usize = WDATA_AT + 64 * 1024;

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn vectors(file: &str) -> serde_json::Value {
    let p = format!(
        "{}/../smc-wire/tests/vectors/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The CLC message of `frame` in capture `file` (`smcr-v2-kernel-6.12*.json`).
pub fn clc(file: &str, frame: u64) -> Vec<u8> {
    let v = vectors(file);
    let m = v["clc"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["frame"].as_u64() == Some(frame))
        .unwrap_or_else(|| panic!("no CLC frame {frame} in {file}"));
    hex(m["hex"].as_str().unwrap())
}

/// The SEND payload (LLC or CDC) of `frame` in capture `file`.
pub fn send(file: &str, frame: u64) -> Vec<u8> {
    let v = vectors(file);
    let m = v["sends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["frame"].as_u64() == Some(frame))
        .unwrap_or_else(|| panic!("no SEND frame {frame} in {file}"));
    hex(m["hex"].as_str().unwrap())
}

/// The CDCs one direction of capture `file` carried, in order.
pub fn cdcs(file: &str, dir: &str) -> Vec<Vec<u8>> {
    let v = vectors(file);
    v["sends"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["dir"].as_str() == Some(dir) && m["retx"].as_bool() != Some(true))
        .map(|m| hex(m["hex"].as_str().unwrap()))
        .filter(|b| b[0] == 0xFE)
        .collect()
}

pub const MAIN: &str = "smcr-v2-kernel-6.12.json";
pub const TEARDOWN: &str = "smcr-v2-kernel-6.12-teardown.json";
/// Capture directions.
pub const TO_SERVER: &str = "10.99.0.2->10.99.0.1";
pub const TO_CLIENT: &str = "10.99.0.1->10.99.0.2";

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn put24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// One connection's data path as the kernel runs it.
#[derive(Debug, Default)]
pub struct KConn {
    /// Our alert token (in our Accept or Confirm): the peer's CDCs carry it.
    pub my_token: u32,
    /// The peer's (our endpoint's) alert token: every CDC of ours carries it.
    pub peer_token: u32,
    /// The peer's RMB element: (rkey, address, length).
    pub peer_rmb: (u32, u64, usize),
    pub tx_seq: u16,
    /// Bytes written into the peer's RMB, and the peer's consumer cursor.
    pub tx_prod: u64,
    pub tx_peer_cons: u64,
    /// The peer's producer cursor in our RMB, what we consumed, and what we
    /// last told the peer.
    pub rx_prod: u64,
    pub rx_cons: u64,
    pub rx_cons_confirmed: u64,
    pub rx_seq: u16,
    pub peer_write_blocked: bool,
    pub peer_closed: bool,
    pub peer_aborted: bool,
    pub closed: bool,
    /// Written by the application, not yet into the peer's RMB (the send
    /// buffer, 64 KiB as `net.smc.wmem`).
    pub pending: Vec<u8>,
    /// write_blocked as last set on a data CDC (`local_tx_ctrl.prod_flags`).
    pub write_blocked: bool,
    /// Every CDC sent, as bytes.
    pub cdcs_sent: Vec<Vec<u8>>,
}

fn absolute(c: Cursor, ring: usize, near: u64) -> u64 {
    let ring = ring as u64;
    let mut v = u64::from(c.wrap) * ring + u64::from(c.count);
    // (16-bit wraps: stay next to the last known position)
    let period = ring << 16;
    while v + period / 2 < near {
        v += period;
    }
    v
}

fn cursor(abs: u64, ring: usize) -> Cursor {
    Cursor {
        wrap: ((abs / ring as u64) & 0xffff) as u16,
        count: (abs % ring as u64) as u32,
    }
}

/// The kernel peer: one rxe-like device, one QP, one connection at a time.
pub struct Kernel {
    pub fabric: SimFabric,
    pub ep: RawEp<SimFabric>,
    /// Our GID (`::ffff:10.99.0.x`, index 1 of the port's table).
    pub gid: smc_wire::types::Gid,
    next_wr: u64,
    /// SEND payloads received from the peer, in order.
    pub rx: VecDeque<Vec<u8>>,
    /// Every SEND payload received so far (LLC and CDC).
    pub seen: Vec<Vec<u8>>,
    /// Send completions that were not successful.
    pub send_errors: Vec<WcStatus>,
    pub conn: KConn,
}

impl Kernel {
    /// A kernel at `addr` over a new rxe-like device `name`.
    pub fn new(fabric: &SimFabric, name: &str, addr: IpAddr) -> Kernel {
        fabric
            .add_device_with_addrs(name, None, &[addr], false)
            .unwrap();
        let params = ConnParams {
            mr_len: MR_LEN,
            // smc_ib.c: SMC_QP_TIMEOUT 15, SMC_QP_RETRY_CNT 7, SMC_QP_RNR_RETRY
            // 7, SMC_QP_MIN_RNR_TIMER 5
            timeout: Duration::from_nanos(4096 << 15),
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: Duration::from_micros(60),
        };
        let ep = RawEp::open(fabric, name, params).unwrap();
        for i in 0..RECV_SLOTS {
            let sge = ep.mr.sge(RECV_AT + i * SLOT, SLOT as u32).unwrap();
            ep.qp
                .post_recv(&RecvWr {
                    wr_id: i as u64,
                    sges: &[sge],
                })
                .unwrap();
        }
        Kernel {
            fabric: fabric.clone(),
            ep,
            gid: smc_wire::types::Gid::from_ip(addr),
            next_wr: 1,
            rx: VecDeque::new(),
            seen: Vec::new(),
            send_errors: Vec::new(),
            conn: KConn::default(),
        }
    }

    pub fn qpn(&self) -> u32 {
        self.ep.qp.qp_num()
    }

    pub fn psn(&self) -> u32 {
        self.ep.psn
    }

    pub fn rkey(&self) -> u32 {
        self.ep.mr.rkey()
    }

    pub fn rmb_addr(&self) -> u64 {
        self.ep.mr.addr()
    }

    /// INIT → RTR → RTS towards the peer's QP, from GID index 1.
    pub fn connect(&self, gid: smc_wire::types::Gid, qpn: u32, psn: u32) {
        self.ep
            .qp
            .modify(&QpModify::Rtr {
                remote: RemoteQp { gid, qp_num: qpn },
                sgid_index: 1,
                rq_psn: psn,
                path_mtu: Mtu::Mtu1024,
                min_rnr_timer: self.ep.params.min_rnr_timer,
            })
            .unwrap();
        self.ep
            .qp
            .modify(&QpModify::Rts {
                sq_psn: self.ep.psn,
                timeout: self.ep.params.timeout,
                retry_cnt: 7,
                rnr_retry: 7,
            })
            .unwrap();
    }

    /// A SEND from the registered send buffer, as the kernel posts them.
    pub fn send(&mut self, bytes: &[u8]) {
        let slot = (self.next_wr as usize) % SEND_SLOTS;
        let at = SEND_AT + slot * SLOT;
        self.ep.mr.write_at(at, bytes).unwrap();
        let sge = self.ep.mr.sge(at, bytes.len() as u32).unwrap();
        self.next_wr += 1;
        self.ep
            .qp
            .post_send(&SendWr {
                wr_id: self.next_wr,
                op: SendOp::Send,
                payload: Payload::Sges(&[sge]),
                signaled: true,
            })
            .unwrap();
    }

    /// An RDMA WRITE of `data` to `(rkey, addr)`.
    pub fn write(&mut self, rkey: u32, addr: u64, data: &[u8]) {
        self.ep.mr.write_at(WDATA_AT, data).unwrap();
        let sge = self.ep.mr.sge(WDATA_AT, data.len() as u32).unwrap();
        self.next_wr += 1;
        self.ep
            .qp
            .post_send(&SendWr {
                wr_id: self.next_wr,
                op: SendOp::RdmaWrite {
                    remote_addr: addr,
                    rkey,
                },
                payload: Payload::Sges(&[sge]),
                signaled: false,
            })
            .unwrap();
    }

    /// Takes what completed: received SENDs (CDCs are applied to the
    /// connection, everything is kept in `rx` and `seen`), send errors.
    pub fn poll(&mut self) {
        for wc in self.ep.poll_recv() {
            assert_eq!(wc.status, WcStatus::Success, "kernel receive: {wc:?}");
            let slot = wc.wr_id as usize;
            let mut b = vec![0u8; wc.byte_len as usize];
            self.ep.mr.read_at(RECV_AT + slot * SLOT, &mut b).unwrap();
            let sge = self.ep.mr.sge(RECV_AT + slot * SLOT, SLOT as u32).unwrap();
            self.ep
                .qp
                .post_recv(&RecvWr {
                    wr_id: wc.wr_id,
                    sges: &[sge],
                })
                .unwrap();
            if b.first() == Some(&0xFE) {
                self.on_cdc(&CdcMessage::decode(&b).unwrap());
                self.try_tx();
            }
            self.seen.push(b.clone());
            self.rx.push_back(b);
        }
        for wc in self.ep.poll_send() {
            if wc.status != WcStatus::Success {
                self.send_errors.push(wc.status);
            }
        }
    }

    /// The next received LLC message (CDCs are skipped: `seen` has them).
    pub fn next_llc(&mut self) -> Option<Vec<u8>> {
        while let Some(b) = self.rx.pop_front() {
            if b[0] != 0xFE {
                return Some(b);
            }
        }
        None
    }

    fn on_cdc(&mut self, m: &CdcMessage) {
        let c = &mut self.conn;
        // the token is the receiver's, ours (captures §6.2)
        assert_eq!(m.token, c.my_token, "a CDC carries the receiver's token");
        if m.is_failover_validation() {
            return;
        }
        c.rx_seq = m.seqno;
        c.rx_prod = absolute(m.prod, K_RMB, c.rx_prod);
        assert!(
            c.rx_prod - c.rx_cons <= K_RMB as u64,
            "the peer overran our RMB"
        );
        let plen = c.peer_rmb.2.max(1);
        c.tx_peer_cons = absolute(m.cons, plen, c.tx_peer_cons);
        c.peer_write_blocked = m.prod_flags.write_blocked();
        if m.conn_flags.peer_conn_closed() || m.conn_flags.peer_done_writing() {
            c.peer_closed = true;
        }
        if m.conn_flags.peer_conn_abort() {
            c.peer_aborted = true;
        }
    }

    // ------------------------------------------------------------ data path

    /// Bytes of the peer's data readable in our RMB.
    pub fn readable(&self) -> usize {
        (self.conn.rx_prod - self.conn.rx_cons) as usize
    }

    /// Consumes up to `max` bytes (`smc_rx_recvmsg`), then the consumer
    /// update rule (`smc_rx_update_consumer` → `smc_tx_consumer_update`).
    pub fn read(&mut self, max: usize) -> Vec<u8> {
        let n = max.min(self.readable());
        let mut out = vec![0u8; n];
        for (i, b) in out.iter_mut().enumerate() {
            let at = ((self.conn.rx_cons + i as u64) % K_RMB as u64) as usize;
            let mut one = [0u8];
            self.ep.mr.read_at(at, &mut one).unwrap();
            *b = one[0];
        }
        self.conn.rx_cons += n as u64;
        let c = &self.conn;
        let to_confirm = c.rx_cons - c.rx_cons_confirmed;
        let limit = (K_RMB as u64 / 10).max(2304);
        let sender_free = K_RMB as u64 - (c.rx_prod - c.rx_cons_confirmed);
        if to_confirm > limit && (sender_free <= K_RMB as u64 / 2 || c.peer_write_blocked) {
            self.cdc(ProducerFlags::empty(), ConnStateFlags::empty());
        }
        if self.conn.peer_write_blocked && self.readable() == 0 {
            self.conn.peer_write_blocked = false;
        }
        out
    }

    /// The application's `send()`: what fits in the send buffer; it goes
    /// out at once as far as the peer's RMB has room.
    pub fn write_data(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(64 * 1024 - self.conn.pending.len());
        self.conn.pending.extend_from_slice(&data[..n]);
        self.try_tx();
        n
    }

    /// `smc_tx_rdma_writes`: as much of the send buffer as the peer's RMB
    /// takes (nothing when it is full), write_blocked when that is all of
    /// its room, and the CDC.
    fn try_tx(&mut self) {
        let (rkey, addr, len) = self.conn.peer_rmb;
        let space = (len as u64 - (self.conn.tx_prod - self.conn.tx_peer_cons)) as usize;
        let to_send = self.conn.pending.len();
        if to_send == 0 || space == 0 || self.conn.closed {
            return;
        }
        self.conn.write_blocked = to_send >= space;
        let data: Vec<u8> = self.conn.pending.drain(..to_send.min(space)).collect();
        let mut at = 0;
        while at < data.len() {
            let off = ((self.conn.tx_prod + at as u64) % len as u64) as usize;
            let n = (len - off).min(data.len() - at);
            self.write(rkey, addr + off as u64, &data[at..at + n]);
            at += n;
        }
        self.conn.tx_prod += data.len() as u64;
        self.cdc(ProducerFlags::empty(), ConnStateFlags::empty());
    }

    /// `close()`: peer_conn_closed, or peer_conn_abort with unread data
    /// (smc_close.c `smc_close_final`).
    pub fn close(&mut self) {
        let f = if self.readable() > 0 {
            ConnStateFlags::PEER_CONN_ABORT
        } else {
            ConnStateFlags::PEER_CONN_CLOSED
        };
        self.conn.closed = true;
        self.cdc(ProducerFlags::empty(), f);
    }

    pub fn cdc(&mut self, mut prod_flags: ProducerFlags, conn_flags: ConnStateFlags) {
        let (_, _, len) = self.conn.peer_rmb;
        if self.conn.write_blocked {
            prod_flags.insert(ProducerFlags::WRITE_BLOCKED);
        }
        self.conn.tx_seq = self.conn.tx_seq.wrapping_add(1);
        let m = CdcMessage {
            seqno: self.conn.tx_seq,
            token: self.conn.peer_token,
            prod: cursor(self.conn.tx_prod, len),
            cons: cursor(self.conn.rx_cons, K_RMB),
            prod_flags,
            conn_flags,
        };
        self.conn.rx_cons_confirmed = self.conn.rx_cons;
        let b = m.encode().to_vec();
        self.conn.cdcs_sent.push(b.clone());
        self.send(&b);
    }
}

/// A socket as the test applications see it.
pub trait Sock {
    /// Writes what fits now; the count taken.
    fn write(&mut self, data: &[u8]) -> usize;
    /// Reads what is there, up to `max`.
    fn read(&mut self, max: usize) -> Vec<u8>;
    /// The peer closed and everything is read.
    fn eof(&self) -> bool;
    /// `close()`.
    fn close(&mut self);
}

impl Sock for Kernel {
    fn write(&mut self, data: &[u8]) -> usize {
        self.write_data(data)
    }
    fn read(&mut self, max: usize) -> Vec<u8> {
        Kernel::read(self, max)
    }
    fn eof(&self) -> bool {
        self.conn.peer_closed && self.readable() == 0
    }
    fn close(&mut self) {
        Kernel::close(self)
    }
}

/// Our endpoint's connection `id` as a socket.
pub struct EngSock<'a> {
    pub ep: &'a mut Endpoint<SimFabric>,
    pub id: ConnId,
}

impl Sock for EngSock<'_> {
    fn write(&mut self, data: &[u8]) -> usize {
        self.ep.write(self.id, data).unwrap()
    }
    fn read(&mut self, max: usize) -> Vec<u8> {
        self.ep.read(self.id, max).unwrap()
    }
    fn eof(&self) -> bool {
        self.ep.peer_done(self.id) && self.ep.readable(self.id) == 0
    }
    fn close(&mut self) {
        self.ep.release(self.id)
    }
}

/// `smc_pp -g` (captures §2.3): both ends' applications.
pub mod pp {
    use super::Sock;

    /// `{iters=4, msg=32, mib=64, kib=256}` as little-endian int32.
    pub const PARAMS: [u8; 16] = [4, 0, 0, 0, 32, 0, 0, 0, 64, 0, 0, 0, 0, 1, 0, 0];
    pub const BULK: usize = 256 * 1024;
    pub const CHUNK: usize = 64 * 1024;

    pub fn ping(i: usize, conn: usize) -> Vec<u8> {
        let mut s = format!("PING {i:04} conn {conn}").into_bytes();
        s.resize(32, b'.');
        s
    }

    pub fn pong(i: usize, conn: usize) -> Vec<u8> {
        let mut p = ping(i, conn);
        p[..4].copy_from_slice(b"PONG");
        p
    }

    /// The bulk data: the big-endian u32 of its stream offset every 4 bytes.
    pub fn bulk(from: usize, len: usize) -> Vec<u8> {
        (from..from + len)
            .map(|o| ((o & !3) as u32).to_be_bytes()[o % 4])
            .collect()
    }

    #[derive(Debug, PartialEq, Eq)]
    enum C {
        Params,
        Ping(usize),
        Pong(usize),
        Bulk(usize),
        ReadA,
        WriteB,
        ReadB,
        Close,
        Done,
    }

    /// The client: parameters, 4 ping-pongs, 256 KiB, then "A" / "B" / "B",
    /// then close.
    pub struct Client {
        st: C,
        buf: Vec<u8>,
        conn: usize,
    }

    impl Client {
        pub fn new(conn: usize) -> Client {
            Client {
                st: C::Params,
                buf: Vec::new(),
                conn,
            }
        }
        pub fn done(&self) -> bool {
            self.st == C::Done
        }
        /// One action (or none, waiting).
        pub fn step(&mut self, s: &mut dyn Sock) {
            self.st = match std::mem::replace(&mut self.st, C::Done) {
                C::Params => {
                    assert_eq!(s.write(&PARAMS), 16);
                    C::Ping(0)
                }
                C::Ping(i) => {
                    assert_eq!(s.write(&ping(i, self.conn)), 32);
                    C::Pong(i)
                }
                C::Pong(i) => {
                    let want = 32 - self.buf.len();
                    self.buf.extend(s.read(want));
                    if self.buf.len() < 32 {
                        C::Pong(i)
                    } else {
                        assert_eq!(std::mem::take(&mut self.buf), pong(i, self.conn));
                        if i == 3 {
                            C::Bulk(0)
                        } else {
                            C::Ping(i + 1)
                        }
                    }
                }
                C::Bulk(w) => {
                    // 64 KiB writes (a short write goes on with the rest)
                    let end = (w / CHUNK + 1) * CHUNK;
                    let n = s.write(&bulk(w, end - w));
                    if w + n == BULK {
                        C::ReadA
                    } else {
                        C::Bulk(w + n)
                    }
                }
                C::ReadA => match s.read(1).as_slice() {
                    b"A" => C::WriteB,
                    [] => C::ReadA,
                    x => panic!("client read {x:?}"),
                },
                C::WriteB => {
                    assert_eq!(s.write(b"B"), 1);
                    C::ReadB
                }
                C::ReadB => match s.read(1).as_slice() {
                    b"B" => C::Close,
                    [] => C::ReadB,
                    x => panic!("client read {x:?}"),
                },
                C::Close => {
                    s.close();
                    C::Done
                }
                C::Done => C::Done,
            };
        }
    }

    #[derive(Debug, PartialEq, Eq)]
    enum S {
        Params,
        Ping(usize),
        Bulk(usize),
        WriteA,
        ReadB,
        WriteB,
        WaitEof,
        Done,
    }

    /// The server: the client's counterpart; closes on end of file.
    pub struct Server {
        st: S,
        buf: Vec<u8>,
        conn: usize,
    }

    impl Server {
        pub fn new(conn: usize) -> Server {
            Server {
                st: S::Params,
                buf: Vec::new(),
                conn,
            }
        }
        pub fn done(&self) -> bool {
            self.st == S::Done
        }
        pub fn step(&mut self, s: &mut dyn Sock) {
            self.st = match std::mem::replace(&mut self.st, S::Done) {
                S::Params => {
                    let want = 16 - self.buf.len();
                    self.buf.extend(s.read(want));
                    if self.buf.len() < 16 {
                        S::Params
                    } else {
                        assert_eq!(std::mem::take(&mut self.buf), PARAMS);
                        S::Ping(0)
                    }
                }
                S::Ping(i) => {
                    let want = 32 - self.buf.len();
                    self.buf.extend(s.read(want));
                    if self.buf.len() < 32 {
                        S::Ping(i)
                    } else {
                        assert_eq!(std::mem::take(&mut self.buf), ping(i, self.conn));
                        assert_eq!(s.write(&pong(i, self.conn)), 32);
                        if i == 3 {
                            S::Bulk(0)
                        } else {
                            S::Ping(i + 1)
                        }
                    }
                }
                S::Bulk(r) => {
                    let got = s.read(CHUNK.min(BULK - r));
                    assert_eq!(got, bulk(r, got.len()), "bulk data at {r}");
                    if r + got.len() == BULK {
                        S::WriteA
                    } else {
                        S::Bulk(r + got.len())
                    }
                }
                S::WriteA => {
                    assert_eq!(s.write(b"A"), 1);
                    S::ReadB
                }
                S::ReadB => match s.read(1).as_slice() {
                    b"B" => S::WriteB,
                    [] => S::ReadB,
                    x => panic!("server read {x:?}"),
                },
                S::WriteB => {
                    assert_eq!(s.write(b"B"), 1);
                    S::WaitEof
                }
                S::WaitEof => {
                    if s.eof() {
                        s.close();
                        S::Done
                    } else {
                        S::WaitEof
                    }
                }
                S::Done => S::Done,
            };
        }
    }
}
