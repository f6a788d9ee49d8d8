//! Shared pieces of the smc-rs command-line tools (`smc_pnet`, `smcr`), which keep
//! smc-tools' names, options, messages and output columns (spec `tools.md`) and add
//! `--json`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod getopt;
pub mod view;

/// The live processes' registry documents (all directories a reader looks
/// at: `smc::registry::files::scan_dirs`), dead entries of our own
/// directory reaped on the way.
pub fn live_processes() -> Vec<serde_json::Value> {
    let own = smc::registry::files::run_dir();
    let mut v: Vec<serde_json::Value> = Vec::new();
    for d in smc::registry::files::scan_dirs() {
        let reap = d == own;
        v.extend(
            smc::registry::files::read(&d, reap)
                .into_iter()
                .map(|e| e.json),
        );
    }
    v.sort_by_key(|p| p["pid"].as_u64());
    v
}

/// Version string the tools print.
pub fn version() -> String {
    format!("smc-rs-{}", env!("CARGO_PKG_VERSION"))
}

/// Parses a number as C's `strtoul(s, NULL, 0)` does for whole strings: `0x` hex,
/// leading `0` octal, else decimal. `None` if anything is left over.
pub fn strtoul0(s: &str) -> Option<u64> {
    let t = s.trim_start();
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (h, 16)
    } else if t.len() > 1 && t.starts_with('0') {
        (&t[1..], 8)
    } else {
        (t, 10)
    };
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn strtoul_base0() {
        use super::strtoul0;
        assert_eq!(strtoul0("1"), Some(1));
        assert_eq!(strtoul0("0x2"), Some(2));
        assert_eq!(strtoul0("010"), Some(8));
        assert_eq!(strtoul0("0"), Some(0));
        assert_eq!(strtoul0("x"), None);
        assert_eq!(strtoul0("1a"), None);
        assert_eq!(strtoul0(""), None);
    }
}
