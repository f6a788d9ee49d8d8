//! Our endpoint against a Linux 6.12 kernel peer played from the real
//! capture of two kernels (`tests/kernel/mod.rs`): every CLC, LLC and CDC
//! message our endpoint sends must be the one the kernel sent in its place
//! (the same bytes, with our QP number, PSN, rkeys and addresses where the
//! capture has the kernel's random ones), and every message the kernel
//! sent must be taken as the kernel's peer took it.
//!
//! Deliberate differences, each asserted where it shows: our system id is
//! in a v2-only Proposal (the kernel's is zero: see `build_proposal`), our
//! first-contact extension's feature mask is 0 (the kernel's 0x0001 is an
//! SMC-D feature), our server offers max_links 1 (we cannot add a second
//! link), and a released RMB we keep known at the peer needs no
//! DELETE_RKEY / CONFIRM_RKEY (see `known_rkeys` in the endpoint).

mod common;
mod kernel;

use common::add_port_for;
use kernel::*;
use smc_engine::endpoint::{ConnId, ConnStatus, Endpoint, EndpointConfig};
use smc_proto::negotiate::IfAddr;
use smc_rdma::sim::SimFabric;
use smc_wire::clc::{AcceptConfirm, ClcMessage, Proposal};
use smc_wire::types::{Eid, Mac, SystemId};
use std::time::Duration;

const STEP: Duration = Duration::from_micros(20);

/// Our endpoint as the capture's host `10.99.0.last`: its MAC, its system
/// id instance, 64 KiB buffers, host name `smcvm`, UEID `SMC-TEST-UEID`.
fn our_cfg(dev: &str, last: u8) -> EndpointConfig {
    let inst = if last == 2 { 0x5705 } else { 0x9815 };
    EndpointConfig {
        system_id: SystemId::new(inst, Mac([0x52, 0x54, 0, 0x5c, 0, last])),
        device: dev.into(),
        ueids: vec![Eid::parse_ueid("SMC-TEST-UEID").unwrap()],
        offer_v1: true,
        offer_v2: true,
        if_addrs: vec![IfAddr {
            addr: ip(&format!("10.99.0.{last}")),
            prefix_len: 24,
        }],
        rmb_len: 65536,
        rmb_crowding: None,
        sndbuf_len: 65536,
        testlink: None,
        max_conns: 255,
        hostname: "smcvm".into(),
        lgr_idle_timeout: Duration::from_secs(600),
    }
}

/// The kernel and our endpoint over one fabric.
struct Lab {
    fabric: SimFabric,
    k: Kernel,
    ours: Endpoint<SimFabric>,
    now: Duration,
}

impl Lab {
    /// Our endpoint at 10.99.0.`ours` over an rxe-like port, the kernel at
    /// the other address. `max_inline`: the devices' inline limit, if set.
    fn new(ours: u8, max_inline: Option<u32>) -> Lab {
        Lab::with(ours, max_inline, |_| {})
    }

    /// [`Lab::new`] with our configuration changed by `tweak`.
    fn with(ours: u8, max_inline: Option<u32>, tweak: fn(&mut EndpointConfig)) -> Lab {
        let fabric = SimFabric::new(1);
        let theirs = 3 - ours;
        let k = Kernel::new(&fabric, "rxeK", ip(&format!("10.99.0.{theirs}")));
        if let Some(m) = max_inline {
            fabric.set_max_inline(m);
        }
        let mut cfg = our_cfg("rxeO", ours);
        tweak(&mut cfg);
        add_port_for(&fabric, &cfg, false);
        Lab {
            ours: Endpoint::new(&fabric, cfg).unwrap(),
            fabric,
            k,
            now: Duration::ZERO,
        }
    }

    fn tick(&mut self) {
        self.ours.pump(self.now).unwrap();
        self.k.poll();
        self.fabric.advance(STEP);
        self.now += STEP;
    }

    /// Ticks until the kernel received an LLC message (at most 6 s).
    fn llc(&mut self) -> Vec<u8> {
        for _ in 0..300_000 {
            if let Some(m) = self.k.next_llc() {
                return m;
            }
            self.tick();
        }
        panic!("no LLC message from our endpoint")
    }

    /// Ticks for `d`; no LLC message may come meanwhile.
    fn quiet(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.tick();
            assert_eq!(self.k.next_llc(), None, "an LLC message nobody asked for");
        }
    }

    /// Both applications until both are done, then a while for the last
    /// CDCs.
    fn run_apps(&mut self, id: ConnId, ours_is_client: bool) {
        let mut cli = pp::Client::new(1);
        let mut srv = pp::Server::new(1);
        for _ in 0..200_000 {
            if ours_is_client {
                cli.step(&mut EngSock {
                    ep: &mut self.ours,
                    id,
                });
                srv.step(&mut self.k);
            } else {
                cli.step(&mut self.k);
                srv.step(&mut EngSock {
                    ep: &mut self.ours,
                    id,
                });
            }
            self.tick();
            if cli.done() && srv.done() {
                break;
            }
        }
        assert!(cli.done() && srv.done(), "the applications finished");
        for _ in 0..500 {
            self.tick();
        }
        assert!(self.k.send_errors.is_empty(), "{:?}", self.k.send_errors);
    }

    /// Our CDCs the kernel received so far.
    fn our_cdcs(&self) -> Vec<Vec<u8>> {
        self.k
            .seen
            .iter()
            .filter(|b| b[0] == 0xFE)
            .cloned()
            .collect()
    }
}

fn proposal(b: &[u8]) -> Proposal {
    match ClcMessage::decode(b).unwrap() {
        ClcMessage::Proposal(p) => p,
        m => panic!("{m:?}"),
    }
}

fn accept_confirm(b: &[u8]) -> AcceptConfirm {
    match ClcMessage::decode(b).unwrap() {
        ClcMessage::Accept(a) | ClcMessage::Confirm(a) => a,
        m => panic!("{m:?}"),
    }
}

/// The capture's Proposal `frame` as our endpoint must send it: with our
/// system id and no feature bits.
fn our_proposal(frame: u64, ours: SystemId) -> Vec<u8> {
    let mut want = proposal(&clc(MAIN, frame));
    want.peer_id = ours;
    if let Some(x) = want.v2_ext.as_mut() {
        x.feature_mask = 0;
    }
    ClcMessage::Proposal(want).encode()
}

/// The capture's Accept or Confirm `frame` with the random values of `got`
/// (QP number, PSN, RMB) and no feature bits: what we must have sent.
fn as_ours(frame: u64, got: &AcceptConfirm) -> AcceptConfirm {
    let mut want = accept_confirm(&clc(MAIN, frame));
    want.qpn = got.qpn;
    want.psn = got.psn;
    want.rmb_rkey = got.rmb_rkey;
    want.rmb_vaddr = got.rmb_vaddr;
    if let Some(x) = want.fce.as_mut().and_then(|f| f.v2x.as_mut()) {
        x.feature_mask = 0;
    }
    want
}

/// The capture's Accept or Confirm `frame` as the kernel's: its QP, PSN
/// and RMB.
fn kernels(frame: u64, k: &Kernel) -> AcceptConfirm {
    let mut m = accept_confirm(&clc(MAIN, frame));
    m.qpn = k.qpn();
    m.psn = k.psn();
    m.rmb_rkey = k.rkey();
    m.rmb_vaddr = k.rmb_addr();
    m
}

fn encode(m: AcceptConfirm, accept: bool) -> Vec<u8> {
    if accept {
        ClcMessage::Accept(m).encode()
    } else {
        ClcMessage::Confirm(m).encode()
    }
}

/// The kernel server's first contact with our client, to CONFIRM_LINK,
/// ADD_LINK and its reject (captures §4, §5.1 frames 4–17).
fn kernel_server_first_contact() -> (Lab, ConnId) {
    kernel_server_first_contact_over(Lab::new(2, None))
}

fn kernel_server_first_contact_over(mut lab: Lab) -> (Lab, ConnId) {
    let ours_id = our_cfg("x", 2).system_id;
    let c = lab.ours.connect(ip("10.99.0.2"), lab.now);
    assert_eq!(
        lab.ours.clc_output(c),
        our_proposal(4, ours_id),
        "the Proposal"
    );
    let accept = kernels(7, &lab.k);
    lab.k.conn.my_token = accept.alert_token;
    lab.ours.clc_input(c, &encode(accept, true), lab.now);
    let bytes = lab.ours.clc_output(c);
    let got = accept_confirm(&bytes);
    assert_eq!(
        bytes,
        encode(as_ours(9, &got), false),
        "the Confirm: {got:?}"
    );
    lab.k.conn.peer_token = got.alert_token;
    lab.k.conn.peer_rmb = (got.rmb_rkey, got.rmb_vaddr, 65536);
    lab.k.connect(got.gid, got.qpn, got.psn);
    // CONFIRM_LINK from the kernel's QP; our response
    let mut req = send(MAIN, 11);
    put24(&mut req, 26, lab.k.qpn());
    lab.k.send(&req);
    let mut want = send(MAIN, 13);
    put24(&mut want, 26, got.qpn);
    assert_eq!(lab.llc(), want, "CONFIRM_LINK response");
    // the kernel server's ADD_LINK for an asymmetric second link on the
    // same device: rejected as a client without a second device does
    // (smc_llc.c `smc_llc_cli_add_link_reject`, captures §8.3)
    lab.k.send(&send(MAIN, 15));
    assert_eq!(lab.llc(), send(MAIN, 17), "ADD_LINK reject");
    assert_eq!(lab.ours.status(c), Some(ConnStatus::Smc));
    (lab, c)
}

#[test]
fn a_kernel_server_first_contact_goes_as_in_the_capture() {
    let (mut lab, _) = kernel_server_first_contact();
    lab.quiet(Duration::from_millis(50));
}

/// The whole main capture with our endpoint as the client: its CDCs are
/// the kernel client's byte for byte (cursors, wraps, write_blocked, the
/// close), and the kernel's CDCs are the capture's (the harness plays the
/// kernel right); then DELETE_RKEY from the kernel, and the second
/// connection's CONFIRM_RKEY before the Accept and the reused group.
#[test]
fn our_client_sends_the_kernel_clients_cdcs_and_reuses_the_group() {
    let (mut lab, c) = kernel_server_first_contact();
    lab.run_apps(c, true);
    let ours = lab.our_cdcs();
    let want = cdcs(MAIN, TO_SERVER);
    assert_eq!(ours.len(), 11, "{ours:x?}");
    for (i, (o, w)) in ours.iter().zip(&want).enumerate() {
        assert_eq!(o, w, "our CDC #{i}");
    }
    let theirs = cdcs(MAIN, TO_CLIENT);
    assert_eq!(lab.k.conn.cdcs_sent, theirs[..11], "the kernel's CDCs");
    // the kernel server frees its RMB: DELETE_RKEY, answered as the capture
    let mut del = send(MAIN, 361);
    del[8..12].copy_from_slice(&lab.k.rkey().to_be_bytes());
    lab.k.send(&del);
    assert_eq!(lab.llc(), send(MAIN, 364), "DELETE_RKEY response");
    // connection 2: the same Proposal; the kernel announces its RMB with
    // CONFIRM_RKEY before its Accept (captures §2.2 timeline 10.488)
    let c2 = lab.ours.connect(ip("10.99.0.2"), lab.now);
    assert_eq!(
        lab.ours.clc_output(c2),
        our_proposal(369, our_cfg("x", 2).system_id)
    );
    let mut crk = send(MAIN, 371);
    crk[5..9].copy_from_slice(&lab.k.rkey().to_be_bytes());
    crk[9..17].copy_from_slice(&lab.k.rmb_addr().to_be_bytes());
    lab.k.send(&crk);
    let mut want = crk.clone();
    want[3] = 0x80;
    assert_eq!(lab.llc(), want, "CONFIRM_RKEY response (frame 373)");
    lab.k.conn = Default::default();
    let accept = kernels(375, &lab.k);
    lab.k.conn.my_token = accept.alert_token;
    lab.ours.clc_input(c2, &encode(accept, true), lab.now);
    for _ in 0..100 {
        lab.tick();
    }
    let bytes = lab.ours.clc_output(c2);
    let got = accept_confirm(&bytes);
    assert_eq!(bytes, encode(as_ours(381, &got), false), "Confirm #2");
    assert_eq!(lab.ours.status(c2), Some(ConnStatus::Smc));
    assert_eq!(lab.ours.link_groups(), 1, "the group is reused");
}

#[test]
fn test_link_is_answered_and_sent_as_the_kernels() {
    let (mut lab, _) = kernel_server_first_contact();
    lab.k.send(&send(MAIN, 731));
    assert_eq!(lab.llc(), send(MAIN, 733), "TEST_LINK response");
}

/// A device whose inline limit is below the 44 bytes of a CDC or LLC
/// message (the kernel itself creates its QPs with `max_inline_data` 0 and
/// sends every message from a registered buffer, smc_ib.c
/// `smc_ib_create_queue_pair`, smc_wr.c): our messages go from a
/// registered send buffer too, and everything works as over rxe.
#[test]
fn messages_above_the_inline_limit_go_from_a_registered_buffer() {
    let (mut lab, c) = kernel_server_first_contact_over(Lab::new(2, Some(16)));
    lab.run_apps(c, true);
    assert_eq!(lab.our_cdcs(), cdcs(MAIN, TO_SERVER)[..11]);
}

/// The kernel client's first contact with our server (captures §4, §5.1
/// frames 4–13, roles of the capture): our Accept is the kernel server's
/// but for max_links 1, our CONFIRM_LINK too, and after it we send no
/// ADD_LINK (a kernel server whose group may hold one link sends none,
/// smc_llc.c `smc_llc_srv_add_link`), so a kernel client with max_links 1
/// waits for none (af_smc.c `smcr_clnt_conf_first_link`).
fn kernel_client_first_contact() -> (Lab, ConnId) {
    let mut lab = Lab::new(1, None);
    let s = lab.ours.accept(ip("10.99.0.1"), lab.now);
    lab.ours.clc_input(s, &clc(MAIN, 4), lab.now);
    let bytes = lab.ours.clc_output(s);
    let got = accept_confirm(&bytes);
    let mut want = as_ours(7, &got);
    if let Some(x) = want.fce.as_mut().and_then(|f| f.v2x.as_mut()) {
        x.max_links = 1;
    }
    assert_eq!(bytes, encode(want, true), "the Accept: {got:?}");
    // the kernel client's Confirm repeats the Accept's limits
    let mut confirm = kernels(9, &lab.k);
    if let Some(x) = confirm.fce.as_mut().and_then(|f| f.v2x.as_mut()) {
        x.max_links = 1;
    }
    lab.k.conn.my_token = confirm.alert_token;
    lab.k.conn.peer_token = got.alert_token;
    lab.k.conn.peer_rmb = (got.rmb_rkey, got.rmb_vaddr, 65536);
    lab.k.connect(got.gid, got.qpn, got.psn);
    lab.ours.clc_input(s, &encode(confirm, false), lab.now);
    let mut want = send(MAIN, 11);
    put24(&mut want, 26, got.qpn);
    want[34] = 1;
    assert_eq!(lab.llc(), want, "CONFIRM_LINK request");
    let mut resp = send(MAIN, 13);
    put24(&mut resp, 26, lab.k.qpn());
    resp[34] = 1;
    lab.k.send(&resp);
    lab.quiet(Duration::from_millis(50));
    assert_eq!(lab.ours.status(s), Some(ConnStatus::Smc));
    (lab, s)
}

#[test]
fn a_kernel_client_first_contact_goes_as_in_the_capture_with_one_link() {
    kernel_client_first_contact();
}

/// The whole main capture with our endpoint as the server; then the
/// kernel client's DELETE_RKEY, and its second connection — a Proposal
/// with a zero system id like the first — joins the group.
#[test]
fn our_server_sends_the_kernel_servers_cdcs_and_a_kernel_client_reuses_the_group() {
    let (mut lab, s) = kernel_client_first_contact();
    lab.run_apps(s, false);
    let ours = lab.our_cdcs();
    let want = cdcs(MAIN, TO_CLIENT);
    assert_eq!(ours.len(), 11, "{ours:x?}");
    for (i, (o, w)) in ours.iter().zip(&want).enumerate() {
        assert_eq!(o, w, "our CDC #{i}");
    }
    assert_eq!(
        lab.k.conn.cdcs_sent,
        cdcs(MAIN, TO_SERVER)[..11],
        "the kernel's CDCs"
    );
    let mut del = send(MAIN, 356);
    del[8..12].copy_from_slice(&lab.k.rkey().to_be_bytes());
    lab.k.send(&del);
    assert_eq!(lab.llc(), send(MAIN, 360), "DELETE_RKEY response");
    // connection 2
    let s2 = lab.ours.accept(ip("10.99.0.1"), lab.now);
    lab.ours.clc_input(s2, &clc(MAIN, 369), lab.now);
    for _ in 0..100 {
        lab.tick();
    }
    let bytes = lab.ours.clc_output(s2);
    let got = accept_confirm(&bytes);
    assert!(!got.first_contact, "a zero system id finds its group again");
    assert_eq!(bytes, encode(as_ours(375, &got), true), "Accept #2");
    lab.k.conn = Default::default();
    let mut crk = send(MAIN, 377);
    crk[5..9].copy_from_slice(&lab.k.rkey().to_be_bytes());
    crk[9..17].copy_from_slice(&lab.k.rmb_addr().to_be_bytes());
    lab.k.send(&crk);
    let mut want = crk.clone();
    want[3] = 0x80;
    assert_eq!(lab.llc(), want, "CONFIRM_RKEY response (frame 379)");
    let confirm = kernels(381, &lab.k);
    lab.ours.clc_input(s2, &encode(confirm, false), lab.now);
    lab.quiet(Duration::from_millis(5));
    assert_eq!(lab.ours.status(s2), Some(ConnStatus::Smc));
    assert_eq!(lab.ours.link_groups(), 1);
}

/// `rmmod smc` on the kernel client (teardown capture): DELETE_LINK ALL,
/// not orderly, operator initiated; our server answers with DELETE_LINK
/// ALL|ORDERLY and the client's reason, as the kernel server did (frame 3),
/// and its connections end.
#[test]
fn a_kernel_clients_delete_link_all_is_answered_as_the_kernel_server_did() {
    let (mut lab, s) = kernel_client_first_contact();
    lab.k.send(&send(TEARDOWN, 1));
    assert_eq!(lab.llc(), send(TEARDOWN, 3), "DELETE_LINK ALL|ORDERLY");
    for _ in 0..100 {
        lab.tick();
    }
    assert!(lab.ours.write(s, b"x").is_err(), "the connection ended");
    lab.ours.release(s);
    for _ in 0..100 {
        lab.tick();
    }
    assert_eq!(lab.ours.link_groups(), 0);
}

/// Our keepalive: after the TEST_LINK interval without a receive, the
/// request the kernel sends (frame 731); the kernel's answer (733) keeps
/// the link up, and the next one follows an interval later.
#[test]
fn our_test_link_is_the_kernels() {
    let lab = Lab::with(2, None, |c| c.testlink = Some(Duration::from_secs(5)));
    let (mut lab, c) = kernel_server_first_contact_over(lab);
    for round in 0..2 {
        // (at most 5 s of silence and a tick)
        let req = lab.llc();
        assert_eq!(req, send(MAIN, 731), "TEST_LINK request #{round}");
        lab.k.send(&send(MAIN, 733));
    }
    lab.quiet(Duration::from_secs(4));
    assert_eq!(lab.ours.status(c), Some(ConnStatus::Smc));
    assert_eq!(lab.ours.write(c, b"alive"), Ok(5));
}

/// Our QP is brought up with the attributes Linux uses (smc_ib.c
/// `smc_ib_modify_qp_rtr` / `_rts`): the group's GID as source (index 1
/// of an rxe port), the smaller of the two MTUs, RNR timer code 5 (60 µs),
/// ACK timeout code 15, retries 7; and a Confirm names that path MTU
/// (smc_clc.c: `min(link->path_mtu, link->peer_mtu)`), here against a
/// kernel whose port has MTU 512.
#[test]
fn our_qp_takes_the_kernels_attributes_and_the_smaller_mtu() {
    let mut lab = Lab::new(2, None);
    let c = lab.ours.connect(ip("10.99.0.2"), lab.now);
    lab.ours.clc_output(c);
    let mut accept = kernels(7, &lab.k);
    accept.qp_mtu = 2;
    lab.ours.clc_input(c, &encode(accept, true), lab.now);
    let got = accept_confirm(&lab.ours.clc_output(c));
    assert_eq!(got.qp_mtu, 2, "the Confirm names the path MTU");
    assert_eq!(
        lab.fabric.qp_attrs(got.qpn),
        Some(smc_rdma::sim::SimQpAttrs {
            sgid_index: 1,
            path_mtu: Some(smc_rdma::Mtu::Mtu512),
            min_rnr_timer: Duration::from_micros(60),
            timeout: Duration::from_nanos(4096 << 15),
            retry_cnt: 7,
            rnr_retry: 7,
        })
    );
}

/// An SMC-Rv2 LLC message of up to 8 KiB (Linux `SMC_WR_BUF_V2_SIZE`): an
/// ADD_LINK whose extension lists 255 rkeys (`SMC_LLC_RKEYS_PER_MSG_V2`),
/// 4152 bytes, is received whole and rejected with the 44-byte v2 reject.
#[test]
fn a_large_v2_add_link_is_received_and_rejected() {
    let (mut lab, c) = kernel_server_first_contact();
    let mut big = send(MAIN, 15);
    big.truncate(72);
    for i in 0..255u32 {
        big.extend_from_slice(&(0x1000 + i).to_be_bytes());
        big.extend_from_slice(&(0x2000 + i).to_be_bytes());
        big.extend_from_slice(&u64::from(i).to_be_bytes());
    }
    let len = big.len() as u16;
    big[1..3].copy_from_slice(&len.to_le_bytes());
    big[70..72].copy_from_slice(&255u16.to_le_bytes());
    assert_eq!(big.len(), 4152);
    lab.k.send(&big);
    assert_eq!(lab.llc(), send(MAIN, 17));
    assert_eq!(lab.ours.status(c), Some(ConnStatus::Smc));
}

/// A second connection while the first is open needs a new RMB: our server
/// announces it with CONFIRM_RKEY before its Accept, shaped as the kernel
/// server's (frame 371), and goes on when the kernel client answers.
#[test]
fn our_server_announces_a_new_rmb_with_confirm_rkey_before_the_accept() {
    let (mut lab, _s) = kernel_client_first_contact();
    let s2 = lab.ours.accept(ip("10.99.0.1"), lab.now);
    lab.ours.clc_input(s2, &clc(MAIN, 369), lab.now);
    assert!(
        lab.ours.clc_output(s2).is_empty(),
        "no Accept before the rkey"
    );
    let req = lab.llc();
    let mut want = send(MAIN, 371);
    want[5..17].copy_from_slice(&req[5..17]);
    assert_eq!(req, want, "CONFIRM_RKEY request");
    let mut resp = req.clone();
    resp[3] = 0x80;
    lab.k.send(&resp);
    for _ in 0..50 {
        lab.tick();
    }
    let got = accept_confirm(&lab.ours.clc_output(s2));
    assert!(!got.first_contact);
    assert_eq!(got.rmb_rkey.to_be_bytes(), req[5..9]);
    assert_eq!(got.rmb_vaddr.to_be_bytes(), req[9..17]);
    assert_eq!(got.alert_token, 2);
}

/// The kernel server's `rmmod smc` teardown as the client side saw it
/// (teardown capture frames 3 and 18): DELETE_LINK ALL|ORDERLY, then a
/// second DELETE_LINK ALL with another reason from its group cleanup. Our
/// client answers neither (a Linux client does not), takes the first as
/// the end of the group and ignores the second.
#[test]
fn a_kernel_servers_delete_link_all_ends_our_group() {
    let (mut lab, c) = kernel_server_first_contact();
    lab.k.send(&send(TEARDOWN, 3));
    lab.k.send(&send(TEARDOWN, 18));
    lab.quiet(Duration::from_millis(20));
    assert!(lab.ours.write(c, b"x").is_err(), "the connection ended");
    lab.ours.release(c);
    lab.quiet(Duration::from_millis(20));
    assert_eq!(lab.ours.link_groups(), 0);
}

/// An idle link group ends with DELETE_LINK ALL|ORDERLY, program
/// initiated, as Linux's `smc_lgr_free_work` sends it.
#[test]
fn an_idle_group_ends_with_the_kernels_delete_link() {
    let lab = Lab::with(2, None, |c| c.lgr_idle_timeout = Duration::from_secs(1));
    let (mut lab, c) = kernel_server_first_contact_over(lab);
    lab.run_apps(c, true);
    let mut want = send(TEARDOWN, 3);
    want[6] = 0x03;
    assert_eq!(
        lab.llc(),
        want,
        "DELETE_LINK ALL|ORDERLY, reason 0x00030000"
    );
    for _ in 0..100 {
        lab.tick();
    }
    assert_eq!(lab.ours.link_groups(), 0);
}

/// An abort from either side: a close with unread data sends
/// peer_conn_abort (smc_close.c `smc_close_final`), and the other side's
/// next call fails with a reset.
#[test]
fn aborts_both_ways_as_the_kernel_sends_and_takes_them() {
    use smc_engine::endpoint::ConnError;
    // the kernel closes with our data unread
    let (mut lab, c) = kernel_server_first_contact();
    lab.k.conn.peer_rmb.2 = 65536;
    assert_eq!(lab.ours.write(c, b"unread"), Ok(6));
    lab.quiet(Duration::from_millis(1));
    assert_eq!(lab.k.readable(), 6);
    lab.k.close();
    assert_eq!(
        lab.k.conn.cdcs_sent.last().map(|b| b[25]),
        Some(0x20),
        "the kernel's abort CDC"
    );
    lab.quiet(Duration::from_millis(1));
    assert_eq!(lab.ours.write(c, b"more"), Err(ConnError::Reset));
    // we close with the kernel's data unread
    let (mut lab, c) = kernel_server_first_contact();
    kernel::Sock::write(&mut lab.k, b"unread");
    lab.quiet(Duration::from_millis(1));
    assert_eq!(lab.ours.readable(c), 6);
    lab.ours.release(c);
    lab.quiet(Duration::from_millis(1));
    assert!(lab.k.conn.peer_aborted, "our abort CDC");
    assert_eq!(lab.our_cdcs().last().map(|b| b[25]), Some(0x20));
}

/// Which token a CDC carries (token-skew capture, captures §6.2): the
/// receiver's, the one it announced in CLC. The kernel server's token is 3
/// here, ours 1.
#[test]
fn cdcs_carry_the_receivers_token() {
    let mut lab = Lab::new(2, None);
    let c = lab.ours.connect(ip("10.99.0.2"), lab.now);
    lab.ours.clc_output(c);
    let mut accept = kernels(7, &lab.k);
    accept.alert_token = 3;
    lab.k.conn.my_token = 3;
    lab.ours.clc_input(c, &encode(accept, true), lab.now);
    let got = accept_confirm(&lab.ours.clc_output(c));
    assert_eq!(got.alert_token, 1);
    lab.k.conn.peer_token = got.alert_token;
    lab.k.conn.peer_rmb = (got.rmb_rkey, got.rmb_vaddr, 65536);
    lab.k.connect(got.gid, got.qpn, got.psn);
    let mut req = send(MAIN, 11);
    put24(&mut req, 26, lab.k.qpn());
    lab.k.send(&req);
    lab.llc();
    // (the kernel harness asserts the token of every CDC it takes)
    assert_eq!(lab.ours.write(c, b"to 3"), Ok(4));
    lab.quiet(Duration::from_millis(1));
    assert_eq!(lab.our_cdcs()[0][4..8], [0, 0, 0, 3]);
    assert_eq!(lab.k.read(4), b"to 3");
    kernel::Sock::write(&mut lab.k, b"to 1");
    lab.quiet(Duration::from_millis(1));
    assert_eq!(lab.k.conn.cdcs_sent[0][4..8], [0, 0, 0, 1]);
    assert_eq!(lab.ours.read(c, 8).unwrap(), b"to 1");
}

/// A failover validation (§2.4) that claims CDCs this side never got: held
/// until the group's links are polled again (they may hold what it
/// claims), then the connection is aborted as Linux's
/// `smc_cdc_msg_validate` does it, with our abort CDC and a
/// `ConnAborted` event that names the violation; also when the
/// connection's reader polls the link itself first, which leaves the
/// validation to the endpoint.
#[test]
fn a_validation_claiming_cdcs_never_received_aborts_with_an_event() {
    use smc_engine::endpoint::{AbortCause, EngineEvent};
    use smc_proto::datapath::Violation;
    for reader_polls_first in [false, true] {
        let (mut lab, c) = kernel_server_first_contact();
        lab.k.conn.peer_rmb.2 = 65536;
        kernel::Sock::write(&mut lab.k, b"seen");
        lab.quiet(Duration::from_millis(1));
        // (a read through the endpoint: the connection may poll its link alone)
        assert_eq!(lab.ours.read(c, 8).unwrap(), b"seen");
        while lab.ours.poll_event().is_some() {}
        let claimed = lab.k.conn.tx_seq.wrapping_add(3);
        let v = smc_wire::cdc::CdcMessage::failover_validation(claimed, lab.k.conn.peer_token);
        lab.k.send(&v.encode());
        if reader_polls_first {
            // A reader's own poll of the link (`cdc_recv::dispatch`) leaves
            // the validation to the endpoint, which alone can poll the
            // group's other links first.
            let h = lab.ours.fast_conn(c).unwrap();
            let mut buf = [0u8; 16];
            // (in our receive CQ, our endpoint not run)
            lab.fabric.advance(Duration::from_micros(100));
            let r = h.try_read(&mut buf);
            assert!(
                !matches!(r, smc_engine::endpoint::FastRead::Read { .. }),
                "{r:?}"
            );
            assert_eq!(lab.ours.violation(c), None, "not judged by the reader");
        }
        lab.quiet(Duration::from_millis(1));
        assert_eq!(
            lab.ours.violation(c),
            Some(Violation::OutOfSync {
                last_received: lab.k.conn.tx_seq,
                claimed
            })
        );
        assert!(lab.k.conn.peer_aborted, "our abort CDC");
        let mut aborted = Vec::new();
        while let Some(e) = lab.ours.poll_event() {
            if let EngineEvent::ConnAborted { conn, cause, .. } = e {
                aborted.push((conn, cause));
            }
        }
        assert_eq!(aborted, [(c, AbortCause::Violation)]);
    }
}
