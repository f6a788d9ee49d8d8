//! Pure conversions between the provider trait's types and verbs' numeric
//! encodings (no device needed; unit tested here).
#![forbid(unsafe_code)]

use smc_rdma::{AsyncEvent, Gid, GidType, Mtu, PortState, QpState, WcOpcode, WcStatus};
use std::time::Duration;

/// `ibv_wc_status` → [`WcStatus`].
pub fn wc_status(s: i32) -> WcStatus {
    use WcStatus::*;
    match s {
        0 => Success,
        1 => LocalLengthError,
        2 | 3 => LocalQpOperationError, // LOC_QP_OP_ERR, LOC_EEC_OP_ERR
        4 | 8 | 14 => LocalProtectionError, // LOC_PROT_ERR, LOC_ACCESS_ERR, LOC_RDD_VIOL_ERR
        5 => WrFlushError,
        6 | 7 => LocalQpOperationError, // MW_BIND_ERR, BAD_RESP_ERR
        9 | 15 => RemoteInvalidRequest, // REM_INV_REQ_ERR, REM_INV_RD_REQ_ERR
        10 => RemoteAccessError,
        11 | 16 => RemoteOperationError, // REM_OP_ERR, REM_ABORT_ERR
        12 => RetryExceeded,
        13 => RnrRetryExceeded,
        20 => RetryExceeded, // RESP_TIMEOUT_ERR
        _ => FatalError,     // INV_EECN, INV_EEC_STATE, FATAL, GENERAL, TM_*
    }
}

/// `ibv_wc_opcode` → [`WcOpcode`] (`None` for opcodes this provider never posts).
pub fn wc_opcode(op: i32) -> Option<WcOpcode> {
    match op {
        0 => Some(WcOpcode::Send),
        1 => Some(WcOpcode::RdmaWrite),
        128 => Some(WcOpcode::Recv),
        129 => Some(WcOpcode::RecvRdmaWithImm),
        _ => None,
    }
}

/// `ibv_qp_state` → [`QpState`]. SQD counts as RTS (still sending), SQE and
/// unknown states as ERR.
pub fn qp_state(s: i32) -> QpState {
    match s {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 | 4 => QpState::Rts,
        _ => QpState::Err,
    }
}

/// [`QpState`] → `ibv_qp_state`.
pub fn ibv_qp_state(s: QpState) -> i32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Err => 6,
    }
}

/// `ibv_port_state` → [`PortState`] (ARMED counts as INIT, ACTIVE_DEFER as ACTIVE).
pub fn port_state(s: i32) -> PortState {
    match s {
        2 | 3 => PortState::Init,
        4 | 5 => PortState::Active,
        _ => PortState::Down,
    }
}

/// `ibv_mtu` → [`Mtu`] (unknown codes fall back to 1024, the Ethernet-1500 MTU).
pub fn mtu(code: i32) -> Mtu {
    Mtu::from_code(code as u8).unwrap_or(Mtu::Mtu1024)
}

/// The IB RNR NAK timer table (code → microseconds; code 0 is 655.36 ms).
pub const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// The smallest RNR timer code whose delay is at least `d` (code 0, the
/// longest, above 491.52 ms).
pub fn rnr_timer_code(d: Duration) -> u8 {
    let us = d.as_micros();
    (1..32u8)
        .find(|&c| RNR_TIMER_US[c as usize] as u128 >= us)
        .unwrap_or(0)
}

/// The smallest local ACK timeout code (4.096 µs · 2^code) that is at least
/// `d`, in 1..=31 (0, "infinite", is never chosen).
pub fn timeout_code(d: Duration) -> u8 {
    let ns = d.as_nanos();
    (1..=31u8).find(|&c| 4096u128 << c >= ns).unwrap_or(31)
}

/// Parses a sysfs GID type (`gid_attrs/types/<i>`): "IB/RoCE v1" or "RoCE v2".
pub fn gid_type(s: &str) -> Option<GidType> {
    match s.trim() {
        "RoCE v2" => Some(GidType::RoceV2),
        "IB/RoCE v1" | "RoCE v1" | "IB" => Some(GidType::RoceV1),
        _ => None,
    }
}

/// Parses a sysfs GID (`ports/<p>/gids/<i>`: eight colon-separated groups).
pub fn parse_sysfs_gid(s: &str) -> Option<Gid> {
    let groups: Vec<&str> = s.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut b = [0u8; 16];
    for (i, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        b[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(Gid(b))
}

/// `ibv_event_type` plus its element (port number or QP number) → [`AsyncEvent`].
pub fn async_event(event_type: i32, element: u32) -> Option<AsyncEvent> {
    match event_type {
        1..=3 => Some(AsyncEvent::QpFatal { qp_num: element }), // QP_FATAL, REQ_ERR, ACCESS_ERR
        8 => Some(AsyncEvent::DeviceFatal),
        9 => Some(AsyncEvent::PortActive {
            port: element as u8,
        }),
        10 => Some(AsyncEvent::PortError {
            port: element as u8,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_status_mapping() {
        let want = [
            (0, WcStatus::Success),
            (1, WcStatus::LocalLengthError),
            (2, WcStatus::LocalQpOperationError),
            (4, WcStatus::LocalProtectionError),
            (5, WcStatus::WrFlushError),
            (8, WcStatus::LocalProtectionError),
            (9, WcStatus::RemoteInvalidRequest),
            (10, WcStatus::RemoteAccessError),
            (11, WcStatus::RemoteOperationError),
            (12, WcStatus::RetryExceeded),
            (13, WcStatus::RnrRetryExceeded),
            (19, WcStatus::FatalError),
            (21, WcStatus::FatalError),
            (1000, WcStatus::FatalError),
        ];
        for (code, s) in want {
            assert_eq!(wc_status(code), s, "status {code}");
        }
    }

    #[test]
    fn opcode_and_state_mapping() {
        assert_eq!(wc_opcode(0), Some(WcOpcode::Send));
        assert_eq!(wc_opcode(1), Some(WcOpcode::RdmaWrite));
        assert_eq!(wc_opcode(128), Some(WcOpcode::Recv));
        assert_eq!(wc_opcode(129), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(wc_opcode(2), None);
        for s in QpState::ALL {
            assert_eq!(qp_state(ibv_qp_state(s)), s);
        }
        assert_eq!(qp_state(4), QpState::Rts); // SQD
        assert_eq!(qp_state(5), QpState::Err); // SQE
        assert_eq!(qp_state(7), QpState::Err); // UNKNOWN
        assert_eq!(port_state(1), PortState::Down);
        assert_eq!(port_state(2), PortState::Init);
        assert_eq!(port_state(4), PortState::Active);
        assert_eq!(port_state(5), PortState::Active);
        assert_eq!(mtu(3), Mtu::Mtu1024);
        assert_eq!(mtu(5), Mtu::Mtu4096);
        assert_eq!(mtu(0), Mtu::Mtu1024);
    }

    #[test]
    fn timer_codes() {
        assert_eq!(rnr_timer_code(Duration::from_micros(10)), 1);
        assert_eq!(rnr_timer_code(Duration::from_millis(1)), 14); // 1.28 ms
        assert_eq!(rnr_timer_code(Duration::from_millis(5)), 18); // 5.12 ms
        assert_eq!(rnr_timer_code(Duration::ZERO), 1);
        assert_eq!(rnr_timer_code(Duration::from_millis(491)), 31);
        assert_eq!(rnr_timer_code(Duration::from_millis(600)), 0); // 655.36 ms
        for c in 1..32 {
            let d = Duration::from_micros(RNR_TIMER_US[c as usize] as u64);
            assert_eq!(rnr_timer_code(d), c);
        }
        assert_eq!(timeout_code(Duration::from_millis(50)), 14); // 67.1 ms
        assert_eq!(timeout_code(Duration::from_micros(8)), 1); // 8.19 us
        assert_eq!(timeout_code(Duration::ZERO), 1);
        assert_eq!(timeout_code(Duration::from_secs(100_000)), 31);
        assert!(4096u128 << timeout_code(Duration::from_millis(10)) >= 10_000_000);
    }

    #[test]
    fn sysfs_parsing() {
        assert_eq!(gid_type("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(gid_type("IB/RoCE v1\n"), Some(GidType::RoceV1));
        assert_eq!(gid_type(""), None);
        let g = parse_sysfs_gid("0000:0000:0000:0000:0000:ffff:0a63:0001\n").unwrap();
        assert_eq!(g.to_string(), "::ffff:10.99.0.1");
        let g = parse_sysfs_gid("fe80:0000:0000:0000:5054:00ff:fe5c:0101").unwrap();
        assert_eq!(g.to_string(), "fe80::5054:ff:fe5c:101");
        assert_eq!(parse_sysfs_gid("fe80::1"), None);
    }

    #[test]
    fn async_events() {
        assert_eq!(async_event(9, 1), Some(AsyncEvent::PortActive { port: 1 }));
        assert_eq!(async_event(10, 1), Some(AsyncEvent::PortError { port: 1 }));
        assert_eq!(async_event(1, 17), Some(AsyncEvent::QpFatal { qp_num: 17 }));
        assert_eq!(async_event(8, 0), Some(AsyncEvent::DeviceFatal));
        assert_eq!(async_event(18, 1), None); // GID_CHANGE
        assert_eq!(async_event(4, 17), None); // COMM_EST
    }
}
