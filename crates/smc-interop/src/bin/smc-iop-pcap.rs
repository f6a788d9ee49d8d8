//! `smc-iop-pcap` — what a capture of the wire between two SMC-R hosts holds,
//! decoded with smc-rs's codec (the host side of
//! `scripts/vm/run-kernel-interop.sh`).
//!
//! ```text
//! smc-iop-pcap [--list] [--tag CASE] FILE.pcap
//! ```
//!
//! Prints one `SMCI-WIRE` line of counts (the harness's checks read it); with
//! `--list`, first every decoded event. Undecodable messages are always listed.
//! Exit status 0 if the file could be read (whatever it holds), 2 otherwise.
#![forbid(unsafe_code)]

use clap::Parser;
use smc_interop::{pcap, wire};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "Decode the SMC messages (CLC, LLC, CDC) of a pcap capture")]
struct Args {
    /// Print every decoded event.
    #[arg(long)]
    list: bool,
    /// Case name to put on the summary line.
    #[arg(long, default_value = "-")]
    tag: String,
    /// The capture (classic pcap, Ethernet).
    file: PathBuf,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let bytes = match std::fs::read(&a.file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("smc-iop-pcap: {}: {e}", a.file.display());
            return ExitCode::from(2);
        }
    };
    let decoded = match pcap::parse(&bytes).and_then(|c| wire::decode(&c)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("smc-iop-pcap: {}: {e}", a.file.display());
            return ExitCode::from(2);
        }
    };
    let t0 = decoded.events.first().map_or(0, |e| e.ts_ns);
    let mut out = std::io::stdout().lock();
    for e in &decoded.events {
        if a.list || matches!(e.what, wire::What::Error(_)) {
            let t = e.ts_ns.saturating_sub(t0) as f64 / 1e9;
            if writeln!(out, "+{t:.6}s {e}").is_err() {
                return ExitCode::SUCCESS; // the reader went away (| head)
            }
        }
    }
    let c = wire::count(&decoded);
    let llc: Vec<String> = c
        .llc
        .iter()
        .map(|(n, (q, r))| format!("{}={q}/{r}", n.to_lowercase()))
        .collect();
    let declines: Vec<String> = c.declines.iter().map(|d| format!("{d:#010x}")).collect();
    let _ = writeln!(
        out,
        "SMCI-WIRE case={} frames={} syn_smc={} synack_smc={} syn_plain={} proposals={} accepts={} accepts_fc={} \
         confirms={} confirms_fc={} declines={} llc={} cdc={} cdc_data={} cdc_urg={} cdc_closed={} cdc_abort={} \
         rdma_writes={} write_bytes={} acks={} retransmits={} errors={} tcp_cut={} file_cut={}",
        a.tag,
        decoded.frames,
        c.syn_smc,
        c.synack_smc,
        c.syn_plain,
        c.proposals,
        c.accepts,
        c.accepts_fc,
        c.confirms,
        c.confirms_fc,
        if declines.is_empty() {
            "-".to_string()
        } else {
            declines.join(",")
        },
        if llc.is_empty() {
            "-".to_string()
        } else {
            llc.join(",")
        },
        c.cdc,
        c.cdc_data,
        c.cdc_urg,
        c.cdc_closed,
        c.cdc_abort,
        decoded.rdma_write_packets,
        decoded.rdma_write_bytes,
        decoded.roce_acks,
        c.retransmits,
        c.errors,
        decoded.tcp_streams_cut,
        u8::from(decoded.cut_short),
    );
    ExitCode::SUCCESS
}
