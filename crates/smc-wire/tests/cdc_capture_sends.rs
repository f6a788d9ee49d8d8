//! Every CDC payload among the real kernel RDMA SENDs in `tests/vectors/*.json`
//! (retransmissions included) decodes, reproduces the capture decoder's summary
//! (`lab/captures/decode.py` `cdc_summary`) and re-encodes to the exact bytes; and the
//! captured seqno / cursor sequences obey the acceptance rules of §2.3.

use smc_wire::cdc::*;
use std::path::PathBuf;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn all_sends() -> Vec<(String, u64, String, String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for s in v["sends"].as_array().unwrap() {
            out.push((
                f.file_name().unwrap().to_string_lossy().into_owned(),
                s["frame"].as_u64().unwrap(),
                s["dir"].as_str().unwrap().to_string(),
                s["hex"].as_str().unwrap().to_string(),
                s["summary"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

fn flag_str(bits: u8, names: &[(u8, &str)]) -> String {
    let n: Vec<&str> = names
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| *n)
        .collect();
    format!(
        "0x{:02x} {}",
        bits,
        if n.is_empty() {
            "-".to_string()
        } else {
            n.join("+")
        }
    )
}

/// `decode.py` `cdc_summary` from the decoded message.
fn cdc_summary(m: &CdcMessage) -> String {
    format!(
        "CDC seq={} token=0x{:x} prod={} cons={} pflags={} cflags={}",
        m.seqno,
        m.token,
        m.prod,
        m.cons,
        flag_str(
            m.prod_flags.bits(),
            &[
                (0x80, "write_blocked"),
                (0x40, "urg_data_pending"),
                (0x20, "urg_data_present"),
                (0x10, "cons_curs_upd_req"),
                (0x08, "failover_validation"),
            ]
        ),
        flag_str(
            m.conn_flags.bits(),
            &[
                (0x80, "peer_done_writing"),
                (0x40, "peer_conn_closed"),
                (0x20, "peer_conn_abort")
            ]
        ),
    )
}

#[test]
fn every_captured_cdc_decodes_summarises_and_reencodes() {
    let mut n = 0;
    for (file, frame, _, h, summary) in all_sends() {
        let b = hex(&h);
        if b[0] != 0xFE {
            continue;
        }
        let m = CdcMessage::decode(&b).unwrap_or_else(|e| panic!("{file} frame {frame}: {e}"));
        assert_eq!(cdc_summary(&m), summary, "{file} frame {frame}");
        assert_eq!(&m.encode()[..], &b[..], "{file} frame {frame}");
        n += 1;
    }
    assert_eq!(n, 66, "number of captured CDCs changed");
}

#[test]
fn captured_streams_pass_seqno_and_cursor_rules() {
    use std::collections::HashMap;
    // per (file, direction, token): seqnos strictly increase by one, cursors never
    // move backwards, and each producer advance is what cursor_diff computes
    let mut last: HashMap<(String, String, u32), CdcMessage> = HashMap::new();
    let r = 65536; // RMBE size of both peers in every capture (README §9)
    let mut advanced = 0usize;
    for (file, frame, dir, h, _) in all_sends() {
        let b = hex(&h);
        if b[0] != 0xFE {
            continue;
        }
        let m = CdcMessage::decode(&b).unwrap();
        let key = (file.clone(), dir, m.token);
        if let Some(prev) = last.get(&key) {
            assert!(seqno_is_newer(m.seqno, prev.seqno), "{file} {frame}");
            assert_eq!(m.seqno, prev.seqno.wrapping_add(1), "{file} {frame}");
            assert!(!cursor_moves_backwards(prev.prod, m.prod), "{file} {frame}");
            assert!(!cursor_moves_backwards(prev.cons, m.cons), "{file} {frame}");
            let d = cursor_diff(r, prev.prod, m.prod);
            assert_eq!(d as i64, cursor_comp(r, prev.prod, m.prod));
            assert_eq!(prev.prod.add(d, r), m.prod, "{file} {frame}");
            advanced += d;
        } else {
            assert_eq!(m.seqno, 1, "first CDC of a connection carries seqno 1");
        }
        last.insert(key, m);
    }
    assert!(advanced > 4 * r);
}
