//! The rendezvous `sock_ops` program, built with [`crate::asm`]. Pure code: no I/O, no unsafe.
//!
//! # What the program does (per `skops->op`)
//!
//! The program sees every TCP socket of the cgroup subtree it is attached to. It only acts on
//! sockets that user space *opted in* by writing [`VAL_WANT`] into the map under the socket's
//! cookie (`SO_COOKIE` == `bpf_get_socket_cookie(skops)`), before `connect()`/`listen()`.
//!
//! | op | action |
//! |---|---|
//! | `TCP_CONNECT_CB` (3) | cookie has `WANT` → set `WRITE_HDR_OPT` + `STATE` callback flags |
//! | `TCP_LISTEN_CB` (11) | same, plus `bpf_setsockopt(SOL_TCP, TCP_SAVE_SYN, 1)` so the SYN of each child can be searched later, plus `WANT` under the listener's [port key](listen_key). Children and request socks inherit the listener's flags. |
//! | `HDR_OPT_LEN_CB` (14) | only segments with SYN: reserve 6 bytes — on a SYN if the cookie has `WANT` in *this* map, on a SYN-ACK only if the received SYN carried the SMC option (`bpf_load_hdr_opt(.., BPF_LOAD_HDR_OPT_TCP_SYN)`) — Linux's rule: echo only when offered — and the listener's port key is in the map, and never on a SYN-ACK with a SYN cookie (`args[0]` is `BPF_WRITE_HDR_TCP_SYNACK_COOKIE`: the connection its ACK makes has no saved SYN to find the option in; Linux offers none then either) |
//! | `WRITE_HDR_OPT_CB` (15) | same gate, then `bpf_store_hdr_opt(fe 06 e2 d4 c3 d9)` |
//! | `ACTIVE_ESTABLISHED_CB` (4) | if the cookie has `WANT` in this map: search the SYN-ACK (`skb_data`), record `WANT|ESTABLISHED[|PEER_SMC]` under the cookie, clear `WRITE_HDR_OPT` |
//! | `PASSIVE_ESTABLISHED_CB` (5) | if `STATE_CB` is set (inherited from an opted-in listener; never cleared): search the saved SYN, record `WANT|PASSIVE|ESTABLISHED[|PEER_SMC]` under the child's cookie (`PEER_SMC` only while the listener's port key is in the map: what its SYN-ACK carried), clear `WRITE_HDR_OPT` |
//! | `STATE_CB` (10) | new state `TCP_CLOSE` → delete the cookie's entry (no leak when a process forgets, crashes, or the peer resets); from `TCP_LISTEN` also the port key |
//!
//! **Opting a listener out.** The callback flags a listener got at `listen()` cannot be
//! cleared from user space (only `bpf_sock_ops_cb_flags_set`, from a sock_ops program, writes
//! them), and the SYN-ACK is written for the request sock, whose cookie is not the
//! listener's (net/ipv4/tcp_output.c `bpf_skops_hdr_opt_len` passes the request sock;
//! inet_connection_sock.c `inet_reqsk_alloc` gives it a cookie of its own). What the request
//! sock does carry is the listener's port (`local_port`, from `skc_num`), family (`family`,
//! `skc_family`, the listener's also for an IPv4 SYN to a dual-stack one: inet_reqsk_alloc)
//! and network namespace (`bpf_get_netns_cookie`). So an opted-in listener also puts `WANT`
//! under [`listen_key`]`(netns, family, port)`, the SYN-ACK and the child's `PEER_SMC`
//! require it, and user space takes a listener out by writing [`VAL_OPTED_OUT`] there
//! ([`crate::Rendezvous::opt_out_listener`]): an exec into a program that will not load the
//! library, which must not be offered SMC. Its SYN-ACKs then get no option space at all (see
//! `emit_syn_gate`), whatever other programs are attached. The key covers every listener
//! of that port and family in that namespace (`SO_REUSEPORT` groups): all of them fall back to TCP,
//! which is correct, only slower; an evicted `WANT` key (LRU) does the same. An evicted
//! opt-out key leaves the listener without the option from this program, but an older build
//! attached beside it would echo it again.
//!
//! Clearing `WRITE_HDR_OPT` at establishment means the final ACK and data segments never run
//! the option callbacks at all; the SYN-flag test in the two option callbacks is a second guard.
//! A retransmitted SYN or SYN-ACK carries the option again, as with the kernel's AF_SMC.
//!
//! **Coexistence.** Callback flags live in the socket and are shared by every sock_ops program
//! attached to its cgroups, e.g. two builds of this crate during an upgrade. So ownership is
//! never decided by `WRITE_HDR_OPT` alone: SYN and active establishment look the cookie up in
//! this instance's own map, and passive establishment keys on `STATE_CB`, which no instance
//! clears (the first instance to run clears `WRITE_HDR_OPT`). The one thing that cannot be
//! told apart is the SYN-ACK (the request socket has no cookie of the listener): with two
//! instances attached both reserve space, the second store fails with `EEXIST`, and the kernel
//! pads the unused 6 bytes with NOPs — valid on the wire, only 8 bytes longer.
//!
//! The map value is a `u32` bit set ([`VAL_WANT`], [`VAL_ESTABLISHED`], [`VAL_PEER_SMC`],
//! [`VAL_PASSIVE`]); the key is the `u64` socket cookie.

#![forbid(unsafe_code)]

use crate::asm::{Alu, Asm, AsmError, Cond, Insn, Reg, Size};

/// The SMC experimental TCP option: kind 254, length 6, ExID 0xE2D4C3D9 (RFC 6994 / RFC 7609).
pub const SMC_OPTION: [u8; 6] = [0xfe, 0x06, 0xe2, 0xd4, 0xc3, 0xd9];

/// User space: this socket wants the option (set before `connect()`/`listen()`).
pub const VAL_WANT: u32 = 1 << 0;
/// Program: the three-way handshake completed and the peer's option was searched.
pub const VAL_ESTABLISHED: u32 = 1 << 1;
/// Program: the peer's SYN (passive side) or SYN-ACK (active side) carried the option.
pub const VAL_PEER_SMC: u32 = 1 << 2;
/// Program: the entry belongs to an accepted (child) socket of an opted-in listener.
pub const VAL_PASSIVE: u32 = 1 << 3;

/// User space: the listener's [`listen_key`] is opted out (its SYN-ACKs carry no option).
pub const VAL_OPTED_OUT: u32 = 1 << 4;

/// Program: the entry is a listener's [`listen_key`] (its SYN-ACKs may carry the option).
const LISTEN_KEY_TAG: u64 = 1 << 63;

/// The map key of the listeners of address family `family` (`AF_INET`, `AF_INET6`) on `port`
/// in the network namespace whose cookie (`SO_NETNS_COOKIE`, `bpf_get_netns_cookie`) is
/// `netns`. Socket cookies and namespace cookies are counters from 1, far below 2^39: the top
/// bit keeps these keys apart from socket cookies.
pub const fn listen_key(netns: u64, family: u8, port: u16) -> u64 {
    LISTEN_KEY_TAG | (netns << 24) | ((family as u64) << 16) | port as u64
}

/// Map geometry. Entries live from opt-in (or passive establishment) until the socket reaches
/// `TCP_CLOSE` or user space forgets it; LRU eviction is only a backstop for sockets that were
/// opted in but never connected or listened and whose process died.
pub const MAP_KEY_SIZE: u32 = 8;
pub const MAP_VALUE_SIZE: u32 = 4;
pub const MAP_MAX_ENTRIES: u32 = 65_536;

/// Kernel ABI numbers used by the program (from `include/uapi/linux/bpf.h`, `linux/tcp.h`).
pub mod abi {
    // enum bpf_sock_ops ops
    pub const OP_TCP_CONNECT_CB: i32 = 3;
    pub const OP_ACTIVE_ESTABLISHED_CB: i32 = 4;
    pub const OP_PASSIVE_ESTABLISHED_CB: i32 = 5;
    pub const OP_STATE_CB: i32 = 10;
    pub const TCP_STATE_LISTEN: i32 = 10;
    pub const OP_TCP_LISTEN_CB: i32 = 11;
    pub const OP_HDR_OPT_LEN_CB: i32 = 14;
    pub const OP_WRITE_HDR_OPT_CB: i32 = 15;
    // bpf_sock_ops_cb_flags
    pub const CB_FLAG_STATE: i32 = 1 << 2;
    pub const CB_FLAG_WRITE_HDR_OPT: i32 = 1 << 6;
    // struct bpf_sock_ops field offsets
    pub const CTX_OP: i16 = 0;
    pub const CTX_ARGS0: i16 = 4; // args[0]: old state for STATE_CB; what a SYN-ACK is for HDR_OPT
    pub const CTX_ARGS1: i16 = 8; // args[1]: new state for STATE_CB
    pub const CTX_FAMILY: i16 = 20;
    pub const CTX_LOCAL_PORT: i16 = 68; // host byte order
    pub const CTX_CB_FLAGS: i16 = 84;
    pub const CTX_SKB_TCP_FLAGS: i16 = 212;
    // helper ids (enum bpf_func_id)
    pub const FN_MAP_LOOKUP_ELEM: i32 = 1;
    pub const FN_MAP_UPDATE_ELEM: i32 = 2;
    pub const FN_MAP_DELETE_ELEM: i32 = 3;
    pub const FN_GET_SOCKET_COOKIE: i32 = 46;
    pub const FN_SETSOCKOPT: i32 = 49;
    pub const FN_SOCK_OPS_CB_FLAGS_SET: i32 = 59;
    pub const FN_GET_NETNS_COOKIE: i32 = 122;
    pub const FN_LOAD_HDR_OPT: i32 = 142;
    pub const FN_STORE_HDR_OPT: i32 = 143;
    pub const FN_RESERVE_HDR_OPT: i32 = 144;
    // misc
    pub const LOAD_HDR_OPT_TCP_SYN: i32 = 1;
    /// `args[0]` of the option callbacks for a SYN-ACK that carries a SYN cookie.
    pub const WRITE_HDR_TCP_SYNACK_COOKIE: i32 = 2;
    pub const BPF_ANY: i32 = 0;
    pub const BPF_NOEXIST: i32 = 1;
    pub const TCP_STATE_CLOSE: i32 = 7;
    pub const SOL_TCP: i32 = 6;
    pub const TCP_SAVE_SYN: i32 = 27;
    pub const TCPHDR_SYN: i32 = 0x02;
    pub const TCPHDR_ACK: i32 = 0x10;
}

use abi::*;

// Stack layout (offsets from R10).
const FP_KEY: i16 = -8; // u64 cookie
const FP_VAL: i16 = -16; // u32 value / setsockopt int
const FP_OPT: i16 = -24; // 6-byte option buffer (search key / option to store)

/// Upper bound the kernel accepts for unprivileged-size programs; ours must stay far below.
pub const MAX_INSNS: usize = 4096;

/// The program's license string. The header-option helpers used here are available to any
/// license, but the lab's proven program declared GPL; we do the same.
pub const LICENSE: &str = "GPL";

/// Builds the program for a map whose file descriptor is `map_fd`.
pub fn build(map_fd: i32) -> Result<Vec<Insn>, AsmError> {
    let mut a = Asm::new();
    let out = a.new_label();
    let l_connect = a.new_label();
    let l_listen = a.new_label();
    let l_hdrlen = a.new_label();
    let l_write = a.new_label();
    let l_active = a.new_label();
    let l_passive = a.new_label();
    let l_state = a.new_label();

    // R6 = ctx for the whole program (callee-saved across helper calls).
    a.mov64_reg(Reg::R6, Reg::R1);
    a.ldx(Size::W, Reg::R2, Reg::R6, CTX_OP);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_TCP_CONNECT_CB, l_connect);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_TCP_LISTEN_CB, l_listen);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_HDR_OPT_LEN_CB, l_hdrlen);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_WRITE_HDR_OPT_CB, l_write);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_ACTIVE_ESTABLISHED_CB, l_active);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_PASSIVE_ESTABLISHED_CB, l_passive);
    a.jmp_imm(Cond::Eq, Reg::R2, OP_STATE_CB, l_state);
    a.bind(out);
    a.mov64_imm(Reg::R0, 1);
    a.exit();

    // TCP_CONNECT_CB
    a.bind(l_connect);
    emit_require_want(&mut a, map_fd, out);
    emit_set_cb_flags(&mut a, CB_FLAG_WRITE_HDR_OPT | CB_FLAG_STATE, 0);
    a.ja(out);

    // TCP_LISTEN_CB
    a.bind(l_listen);
    emit_require_want(&mut a, map_fd, out);
    a.st_imm(Size::W, Reg::R10, FP_VAL, 1);
    a.mov64_reg(Reg::R1, Reg::R6);
    a.mov64_imm(Reg::R2, SOL_TCP);
    a.mov64_imm(Reg::R3, TCP_SAVE_SYN);
    a.mov64_reg(Reg::R4, Reg::R10);
    a.alu64_imm(Alu::Add, Reg::R4, i32::from(FP_VAL));
    a.mov64_imm(Reg::R5, 4);
    a.call(FN_SETSOCKOPT);
    emit_set_cb_flags(&mut a, CB_FLAG_WRITE_HDR_OPT | CB_FLAG_STATE, 0);
    // (BPF_NOEXIST: a listener of the port that was opted out, e.g. held by a program without
    // the library, stays so when another one listens beside it in an SO_REUSEPORT group)
    emit_listen_key_to_stack(&mut a);
    a.st_imm(Size::W, Reg::R10, FP_VAL, VAL_WANT as i32);
    emit_map_update(&mut a, map_fd, BPF_NOEXIST);
    a.ja(out);

    // HDR_OPT_LEN_CB
    a.bind(l_hdrlen);
    emit_syn_gate(&mut a, map_fd, out);
    a.mov64_reg(Reg::R1, Reg::R6);
    a.mov64_imm(Reg::R2, SMC_OPTION.len() as i32);
    a.mov64_imm(Reg::R3, 0);
    a.call(FN_RESERVE_HDR_OPT);
    a.ja(out);

    // WRITE_HDR_OPT_CB
    a.bind(l_write);
    emit_syn_gate(&mut a, map_fd, out);
    emit_option_on_stack(&mut a);
    a.mov64_reg(Reg::R1, Reg::R6);
    a.mov64_reg(Reg::R2, Reg::R10);
    a.alu64_imm(Alu::Add, Reg::R2, i32::from(FP_OPT));
    a.mov64_imm(Reg::R3, SMC_OPTION.len() as i32);
    a.mov64_imm(Reg::R4, 0);
    a.call(FN_STORE_HDR_OPT);
    a.ja(out);

    // ACTIVE_ESTABLISHED_CB: skb_data is the SYN-ACK.
    a.bind(l_active);
    emit_established(
        &mut a,
        map_fd,
        out,
        Owner::OwnMapWant,
        0,
        (VAL_WANT | VAL_ESTABLISHED) as i32,
    );

    // PASSIVE_ESTABLISHED_CB: the SYN is the saved one.
    a.bind(l_passive);
    emit_established(
        &mut a,
        map_fd,
        out,
        Owner::InheritedStateFlag,
        LOAD_HDR_OPT_TCP_SYN,
        (VAL_WANT | VAL_PASSIVE | VAL_ESTABLISHED) as i32,
    );

    // STATE_CB: forget the socket when it reaches TCP_CLOSE.
    a.bind(l_state);
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_ARGS1);
    a.jmp_imm(Cond::Ne, Reg::R1, TCP_STATE_CLOSE, out);
    emit_cookie_to_stack(&mut a);
    emit_map_key_args(&mut a, map_fd);
    a.call(FN_MAP_DELETE_ELEM);
    // (a listener closing: its port key goes too)
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_ARGS0);
    a.jmp_imm(Cond::Ne, Reg::R1, TCP_STATE_LISTEN, out);
    emit_listen_key_to_stack(&mut a);
    emit_map_key_args(&mut a, map_fd);
    a.call(FN_MAP_DELETE_ELEM);
    a.ja(out);

    a.finish()
}

/// `*(u64 *)(fp + FP_KEY) = bpf_get_socket_cookie(ctx)`
fn emit_cookie_to_stack(a: &mut Asm) {
    a.mov64_reg(Reg::R1, Reg::R6);
    a.call(FN_GET_SOCKET_COOKIE);
    a.stx(Size::DW, Reg::R10, FP_KEY, Reg::R0);
}

/// `*(u64 *)(fp + FP_KEY) = listen_key(bpf_get_netns_cookie(ctx), ctx->family,
/// ctx->local_port)`: for a listener, its request socks and its children alike (they share
/// its port, family and namespace).
fn emit_listen_key_to_stack(a: &mut Asm) {
    a.mov64_reg(Reg::R1, Reg::R6);
    a.call(FN_GET_NETNS_COOKIE);
    a.alu64_imm(Alu::Lsh, Reg::R0, 8);
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_FAMILY);
    a.alu64_imm(Alu::And, Reg::R1, 0xff);
    a.alu64_reg(Alu::Or, Reg::R0, Reg::R1);
    a.alu64_imm(Alu::Lsh, Reg::R0, 16);
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_LOCAL_PORT);
    a.alu64_reg(Alu::Or, Reg::R0, Reg::R1);
    a.mov64_imm(Reg::R1, 1);
    a.alu64_imm(Alu::Lsh, Reg::R1, LISTEN_KEY_TAG.trailing_zeros() as i32);
    a.alu64_reg(Alu::Or, Reg::R0, Reg::R1);
    a.stx(Size::DW, Reg::R10, FP_KEY, Reg::R0);
}

/// Falls through only if the map holds `WANT` under the listener's port key (see
/// [`listen_key`]); jumps to `opted_out` if it holds [`VAL_OPTED_OUT`], else to `out`.
fn emit_require_listen_key(
    a: &mut Asm,
    map_fd: i32,
    out: crate::asm::Label,
    opted_out: crate::asm::Label,
) {
    emit_listen_key_to_stack(a);
    emit_map_key_args(a, map_fd);
    a.call(FN_MAP_LOOKUP_ELEM);
    a.jmp_imm(Cond::Eq, Reg::R0, 0, out);
    a.ldx(Size::W, Reg::R1, Reg::R0, 0);
    a.mov64_reg(Reg::R2, Reg::R1);
    a.alu64_imm(Alu::And, Reg::R2, VAL_OPTED_OUT as i32);
    a.jmp_imm(Cond::Ne, Reg::R2, 0, opted_out);
    a.alu64_imm(Alu::And, Reg::R1, VAL_WANT as i32);
    a.jmp_imm(Cond::Eq, Reg::R1, 0, out);
}

/// The map and the key for a map helper: R1 the map, R2 the key at `FP_KEY`.
fn emit_map_key_args(a: &mut Asm, map_fd: i32) {
    a.ld_map_fd(Reg::R1, map_fd);
    a.mov64_reg(Reg::R2, Reg::R10);
    a.alu64_imm(Alu::Add, Reg::R2, i32::from(FP_KEY));
}

/// `bpf_map_update_elem(map, key at FP_KEY, value at FP_VAL, flags)`.
fn emit_map_update(a: &mut Asm, map_fd: i32, flags: i32) {
    emit_map_key_args(a, map_fd);
    a.mov64_reg(Reg::R3, Reg::R10);
    a.alu64_imm(Alu::Add, Reg::R3, i32::from(FP_VAL));
    a.mov64_imm(Reg::R4, flags);
    a.call(FN_MAP_UPDATE_ELEM);
}

/// Falls through only if the map holds `WANT` for this socket's cookie; else jumps to `out`.
fn emit_require_want(a: &mut Asm, map_fd: i32, out: crate::asm::Label) {
    emit_cookie_to_stack(a);
    emit_map_key_args(a, map_fd);
    a.call(FN_MAP_LOOKUP_ELEM);
    a.jmp_imm(Cond::Eq, Reg::R0, 0, out);
    a.ldx(Size::W, Reg::R1, Reg::R0, 0);
    a.alu64_imm(Alu::And, Reg::R1, VAL_WANT as i32);
    a.jmp_imm(Cond::Eq, Reg::R1, 0, out);
}

/// `bpf_sock_ops_cb_flags_set(ctx, (ctx->bpf_sock_ops_cb_flags | on) & !off)`
fn emit_set_cb_flags(a: &mut Asm, on: i32, off: i32) {
    a.ldx(Size::W, Reg::R2, Reg::R6, CTX_CB_FLAGS);
    if on != 0 {
        a.alu64_imm(Alu::Or, Reg::R2, on);
    }
    if off != 0 {
        a.alu64_imm(Alu::And, Reg::R2, !off);
    }
    a.mov64_reg(Reg::R1, Reg::R6);
    a.call(FN_SOCK_OPS_CB_FLAGS_SET);
}

/// Writes the 6 option bytes at `fp + FP_OPT` (used both as search key and as the option).
fn emit_option_on_stack(a: &mut Asm) {
    let [b0, b1, b2, b3, b4, b5] = SMC_OPTION;
    // Native byte order: the program runs on this host, so from_ne_bytes is exact.
    a.st_imm(
        Size::W,
        Reg::R10,
        FP_OPT,
        i32::from_ne_bytes([b0, b1, b2, b3]),
    );
    a.st_imm(
        Size::H,
        Reg::R10,
        FP_OPT + 4,
        i32::from(u16::from_ne_bytes([b4, b5])),
    );
}

/// `R0 = bpf_load_hdr_opt(ctx, fp + FP_OPT, 6, flags)`; R0 == 6 means "found".
fn emit_search_option(a: &mut Asm, flags: i32) {
    emit_option_on_stack(a);
    a.mov64_reg(Reg::R1, Reg::R6);
    a.mov64_reg(Reg::R2, Reg::R10);
    a.alu64_imm(Alu::Add, Reg::R2, i32::from(FP_OPT));
    a.mov64_imm(Reg::R3, SMC_OPTION.len() as i32);
    a.mov64_imm(Reg::R4, flags);
    a.call(FN_LOAD_HDR_OPT);
}

/// Falls through for a SYN of a socket opted in *in this instance's map*, and for a SYN-ACK
/// (of an opted-in listener: the callback only runs when its flag is set) only if the received
/// SYN carried the option and the listener's port key holds `WANT`. A SYN-ACK of a listener
/// opted out ([`VAL_OPTED_OUT`]) ends the program with 0, which makes the kernel drop every
/// program's option space for that SYN-ACK (net/ipv4/tcp_output.c `bpf_skops_hdr_opt_len`
/// returns on an error from the programs; `bpf_prog_run_array_cg` turns a 0 from any of them
/// into -EPERM), so another build's program attached beside this one, which echoes the option
/// on any flagged listener, cannot put it there either. Everything else (final ACK, data,
/// FIN) jumps to `out`.
fn emit_syn_gate(a: &mut Asm, map_fd: i32, out: crate::asm::Label) {
    let go = a.new_label();
    let synack = a.new_label();
    let veto = a.new_label();
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_SKB_TCP_FLAGS);
    a.mov64_reg(Reg::R2, Reg::R1);
    a.alu64_imm(Alu::And, Reg::R2, TCPHDR_SYN);
    a.jmp_imm(Cond::Eq, Reg::R2, 0, out);
    a.alu64_imm(Alu::And, Reg::R1, TCPHDR_ACK);
    a.jmp_imm(Cond::Ne, Reg::R1, 0, synack);
    // SYN: the socket is a full socket; check ownership by cookie so that a second attached
    // instance (another build) does not add the option a second time.
    emit_require_want(a, map_fd, out);
    a.ja(go);
    a.bind(synack);
    // A SYN-ACK with a SYN cookie: no option. Its request sock is not kept,
    // so the connection the cookie's ACK makes has no saved SYN and is not
    // taken for SMC (PEER_SMC unset, `PASSIVE_ESTABLISHED_CB`); a client
    // that saw the option would start the CLC handshake on a server that
    // falls back, whose application would read the Proposal as data. Linux
    // offers nothing either (tcp_input.c `tcp_conn_request` clears
    // `smc_ok` when it wants a cookie).
    a.ldx(Size::W, Reg::R1, Reg::R6, CTX_ARGS0);
    a.jmp_imm(Cond::Eq, Reg::R1, WRITE_HDR_TCP_SYNACK_COOKIE, out);
    emit_search_option(a, LOAD_HDR_OPT_TCP_SYN);
    a.jmp_imm(Cond::Ne, Reg::R0, SMC_OPTION.len() as i32, out);
    // (a listener user space opted out keeps its flags: the port key decides)
    emit_require_listen_key(a, map_fd, out, veto);
    a.ja(go);
    a.bind(veto);
    a.mov64_imm(Reg::R0, 0);
    a.exit();
    a.bind(go);
}

/// How an ESTABLISHED callback decides that the socket is one of ours.
#[derive(Clone, Copy)]
enum Owner {
    /// Active side: the cookie has `WANT` in this instance's map.
    OwnMapWant,
    /// Passive side: the child inherited `STATE_CB_FLAG` from an opted-in listener. (Not the
    /// `WRITE_HDR_OPT` flag: another attached instance may already have cleared that one.)
    InheritedStateFlag,
}

/// Shared tail of the two ESTABLISHED callbacks; ends with a jump to `out`.
fn emit_established(
    a: &mut Asm,
    map_fd: i32,
    out: crate::asm::Label,
    owner: Owner,
    search_flags: i32,
    base: i32,
) {
    let record = a.new_label();
    match owner {
        Owner::OwnMapWant => emit_require_want(a, map_fd, out),
        Owner::InheritedStateFlag => {
            a.ldx(Size::W, Reg::R1, Reg::R6, CTX_CB_FLAGS);
            a.alu64_imm(Alu::And, Reg::R1, CB_FLAG_STATE);
            a.jmp_imm(Cond::Eq, Reg::R1, 0, out);
        }
    }
    emit_search_option(a, search_flags);
    a.mov64_imm(Reg::R7, base);
    a.jmp_imm(Cond::Ne, Reg::R0, SMC_OPTION.len() as i32, record);
    if let Owner::InheritedStateFlag = owner {
        // (the SYN-ACK carried the option only while the port key was there)
        emit_require_listen_key(a, map_fd, record, record);
    }
    a.alu64_imm(Alu::Or, Reg::R7, VAL_PEER_SMC as i32);
    a.bind(record);
    emit_cookie_to_stack(a);
    a.stx(Size::W, Reg::R10, FP_VAL, Reg::R7);
    emit_map_update(a, map_fd, BPF_ANY);
    emit_set_cb_flags(a, 0, CB_FLAG_WRITE_HDR_OPT);
    a.ja(out);
}

/// A stable fingerprint of the program logic and map geometry (FNV-1a 64 over the instruction
/// bytes built with a placeholder fd, the map parameters and the license). It names the pin
/// directory, so a process never reuses a pinned program of a different build.
pub fn fingerprint() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    // The placeholder fd makes the bytes independent of the runtime fd number.
    match build(0) {
        Ok(insns) => eat(&crate::asm::encode_all(&insns)),
        Err(e) => eat(e.to_string().as_bytes()),
    }
    eat(&MAP_KEY_SIZE.to_le_bytes());
    eat(&MAP_VALUE_SIZE.to_le_bytes());
    eat(&MAP_MAX_ENTRIES.to_le_bytes());
    eat(LICENSE.as_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::asm::encode_all;

    #[test]
    fn program_builds_and_is_small() {
        let insns = build(3).expect("program assembles");
        assert!(insns.len() < MAX_INSNS, "{} insns", insns.len());
        assert!(insns.len() > 50, "suspiciously short: {}", insns.len());
        // Starts by saving ctx, ends with a jump back to the common exit.
        assert_eq!(insns[0].code, 0xbf);
        assert_eq!((insns[0].dst, insns[0].src), (6, 1));
    }

    #[test]
    fn every_jump_lands_inside_the_program_and_not_mid_ld_imm64() {
        let insns = build(3).unwrap();
        let second_halves: Vec<usize> = insns
            .iter()
            .enumerate()
            .filter(|(_, i)| i.code == 0x18)
            .map(|(n, _)| n + 1)
            .collect();
        for (n, i) in insns.iter().enumerate() {
            let class = i.code & 0x07;
            let op = i.code & 0xf0;
            if class == 0x05 && op != 0x80 && op != 0x90 {
                let target = n as i64 + 1 + i64::from(i.off);
                assert!(
                    target >= 0 && (target as usize) < insns.len(),
                    "jump at {n} to {target}"
                );
                assert!(
                    !second_halves.contains(&(target as usize)),
                    "jump at {n} into ld_imm64"
                );
            }
        }
        // The last instruction must not fall off the end.
        let last = insns.last().unwrap();
        assert!(last.code == 0x05 || last.code == 0x95);
    }

    #[test]
    fn map_fd_is_patched_into_every_map_load() {
        let insns = build(0x55).unwrap();
        let loads: Vec<_> = insns.iter().filter(|i| i.code == 0x18).collect();
        // lookups: connect, listen, SYN in hdr-len, SYN in write, active, port key in
        // hdr-len, write and passive; updates: listen (port key), active, passive;
        // deletes: state (cookie, port key)
        assert_eq!(loads.len(), 13);
        for l in loads {
            assert_eq!(l.src, crate::asm::PSEUDO_MAP_FD);
            assert_eq!(l.imm, 0x55);
        }
    }

    #[test]
    fn helper_calls_are_the_expected_set() {
        let insns = build(3).unwrap();
        let mut calls: Vec<i32> = insns
            .iter()
            .filter(|i| i.code == 0x85)
            .map(|i| i.imm)
            .collect();
        calls.sort_unstable();
        calls.dedup();
        assert_eq!(
            calls,
            vec![
                FN_MAP_LOOKUP_ELEM,
                FN_MAP_UPDATE_ELEM,
                FN_MAP_DELETE_ELEM,
                FN_GET_SOCKET_COOKIE,
                FN_SETSOCKOPT,
                FN_SOCK_OPS_CB_FLAGS_SET,
                FN_GET_NETNS_COOKIE,
                FN_LOAD_HDR_OPT,
                FN_STORE_HDR_OPT,
                FN_RESERVE_HDR_OPT
            ]
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn option_bytes_are_stored_in_wire_order() {
        let mut a = Asm::new();
        emit_option_on_stack(&mut a);
        let bytes = encode_all(&a.finish().unwrap());
        // *(u32 *)(r10 - 24) = fe 06 e2 d4 ; *(u16 *)(r10 - 20) = c3 d9
        assert_eq!(
            &bytes[..8],
            &[0x62, 0x0a, 0xe8, 0xff, 0xfe, 0x06, 0xe2, 0xd4]
        );
        assert_eq!(
            &bytes[8..],
            &[0x6a, 0x0a, 0xec, 0xff, 0xc3, 0xd9, 0x00, 0x00]
        );
    }

    #[test]
    fn option_matches_the_wire_codec() {
        assert_eq!(SMC_OPTION, smc_wire::tcpopt::option_bytes());
    }

    #[test]
    fn fingerprint_is_stable_and_fd_independent() {
        assert_eq!(fingerprint(), fingerprint());
        let a = encode_all(&build(3).unwrap());
        let b = encode_all(&build(9).unwrap());
        assert_ne!(a, b, "fd must be in the stream");
    }
}
