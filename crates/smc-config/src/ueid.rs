//! The SMC v2 User Enterprise ID (UEID) table.
//!
//! Spec: `tools.md` §2.5 (`smcr ueid`) and `protocol-clc.md` §4.4. A Linux peer
//! proposes and accepts SMC-R v2 only if at least one UEID is configured, and both
//! peers must share one: the server picks the first UEID of the client's Proposal
//! that is also in its own table and returns it in the Accept.

use crate::store::Table;
use core::fmt;
use smc_wire::types::{Eid, EidError};

/// File name of the table inside the configuration directory.
pub const FILE: &str = "ueid.conf";
/// Most UEIDs a table holds (the kernel's `SMC_MAX_UEID`).
pub const MAX_UEIDS: usize = 4;

/// Why a UEID operation failed; `Display` gives the text `smcr ueid` users know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UeidError {
    /// Not a valid UEID.
    Invalid(String),
    /// Already in the table (`EEXIST`).
    Exists,
    /// The table already holds [`MAX_UEIDS`] (`ERANGE`).
    Full,
    /// Not in the table (`ENOENT`).
    NotFound,
    /// A line of the table file is not a valid UEID.
    BadFile {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

impl fmt::Display for UeidError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UeidError::Invalid(why) => write!(f, "Invalid User EID specified: {why}"),
            UeidError::Exists => f.write_str("specified User EID is already defined"),
            UeidError::Full => f.write_str("maximum number of User EIDs is reached"),
            UeidError::NotFound => f.write_str("specified User EID is not defined"),
            UeidError::BadFile { line, reason } => write!(f, "{FILE} line {line}: {reason}"),
        }
    }
}

impl std::error::Error for UeidError {}

/// Validates a UEID with the rules `smcr ueid add` applies before the kernel's:
/// the kernel's (up to 32 characters, first one a letter or digit, only `A-Z 0-9
/// . -`, no lower case) plus smc-tools' extra rule against consecutive dots.
pub fn parse_ueid(s: &str) -> Result<Eid, UeidError> {
    if s.contains("..") {
        return Err(UeidError::Invalid(
            "consecutive dots are not allowed".into(),
        ));
    }
    Eid::parse_ueid(s).map_err(|e| {
        UeidError::Invalid(match e {
            EidError::Empty => "the User EID is empty".into(),
            EidError::TooLong(n) => format!("{n} characters, at most 32 allowed"),
            EidError::BadFirstChar(c) => format!("first character {c:?} must be A-Z or 0-9"),
            EidError::BadChar(c) => format!("unsupported character {c:?} (allowed: A-Z 0-9 . -)"),
        })
    })
}

/// The UEID table, in the order the EIDs were added (the order Proposals list them).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UeidTable {
    eids: Vec<Eid>,
}

impl UeidTable {
    /// An empty table.
    pub fn new() -> UeidTable {
        UeidTable::default()
    }

    /// The UEIDs.
    pub fn eids(&self) -> &[Eid] {
        &self.eids
    }

    /// `smcr ueid add`.
    pub fn add(&mut self, eid: Eid) -> Result<(), UeidError> {
        if self.eids.contains(&eid) {
            return Err(UeidError::Exists);
        }
        if self.eids.len() >= MAX_UEIDS {
            return Err(UeidError::Full);
        }
        self.eids.push(eid);
        Ok(())
    }

    /// `smcr ueid del`.
    pub fn del(&mut self, eid: &Eid) -> Result<(), UeidError> {
        let n = self.eids.len();
        self.eids.retain(|e| e != eid);
        if self.eids.len() == n {
            Err(UeidError::NotFound)
        } else {
            Ok(())
        }
    }

    /// `smcr ueid flush`.
    pub fn flush(&mut self) {
        self.eids.clear();
    }

    /// The EID two peers negotiate: the first of the peer's EIDs that is also in
    /// this table (server side of the CLC handshake).
    pub fn first_match<'a>(&self, peer: impl IntoIterator<Item = &'a Eid>) -> Option<Eid> {
        peer.into_iter().find(|e| self.eids.contains(e)).copied()
    }

    /// Parses the table file: one UEID per line, `#` comments.
    pub fn parse(text: &str) -> Result<UeidTable, UeidError> {
        let mut t = UeidTable::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| UeidError::BadFile {
                line: i + 1,
                reason,
            };
            let eid = parse_ueid(line).map_err(|e| bad(e.to_string()))?;
            t.add(eid).map_err(|e| bad(e.to_string()))?;
        }
        Ok(t)
    }

    /// The table file text.
    pub fn to_file(&self) -> String {
        let mut s = String::from("# smc-rs SMC v2 User EIDs, maintained by `smcr ueid`.\n");
        for e in &self.eids {
            s.push_str(&e.to_string());
            s.push('\n');
        }
        s
    }
}

impl Table for UeidTable {
    type Error = UeidError;
    const FILE: &'static str = FILE;
    fn parse(text: &str) -> Result<Self, UeidError> {
        UeidTable::parse(text)
    }
    fn to_file(&self) -> String {
        UeidTable::to_file(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_rules_of_smcr_ueid() {
        assert!(parse_ueid("SMC-TEST-UEID").is_ok());
        assert!(parse_ueid("A.B-C").is_ok());
        for (bad, why) in [
            ("", "empty"),
            ("smc", "first character"),
            ("SMC..X", "consecutive dots"),
            ("SMC_X", "unsupported character"),
            ("SMCx", "unsupported character"),
            ("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "33 characters"),
        ] {
            let e = parse_ueid(bad).unwrap_err().to_string();
            assert!(e.starts_with("Invalid User EID specified: "), "{e}");
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn table_limits_and_matching() {
        let mut t = UeidTable::new();
        let e = |s: &str| parse_ueid(s).unwrap();
        for s in ["A1", "A2", "A3", "A4"] {
            t.add(e(s)).unwrap();
        }
        assert_eq!(t.add(e("A1")), Err(UeidError::Exists));
        assert_eq!(t.add(e("A5")), Err(UeidError::Full));
        assert_eq!(t.first_match(&[e("X"), e("A3"), e("A1")]), Some(e("A3")));
        assert_eq!(t.first_match(&[e("X")]), None);
        t.del(&e("A2")).unwrap();
        assert_eq!(t.del(&e("A2")), Err(UeidError::NotFound));
        assert_eq!(UeidTable::parse(&t.to_file()).unwrap(), t);
        t.flush();
        assert!(t.eids().is_empty());
        assert!(matches!(
            UeidTable::parse("OK\nbad one\n"),
            Err(UeidError::BadFile { line: 2, .. })
        ));
    }
}
