//! Structured logs of connection events through `tracing` (target
//! `smc`): a connection established over SMC-R or fallen back to TCP (role,
//! addresses, reason code and name), a handshake that failed, a link up or
//! down, a connection moved to another link (failover), a connection
//! aborted, a device or thread that failed (the registry's error kinds).
//!
//! Off by default: without a subscriber `tracing`'s macros cost a load and
//! a branch. A program with a subscriber of its own gets the events as any
//! others (filter on target `smc`). `SMC_LOG=LEVEL` (`error`, `warn`,
//! `info`, `debug`, `trace`; `1` means `info`) installs, when the program
//! has no global subscriber, a minimal one that writes each event as one
//! line on stderr: `smc-rs LEVEL TARGET: message key=value ...`.

use std::fmt::{Debug, Write as _};
use std::sync::Once;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Installs the stderr subscriber if `SMC_LOG` asks for it (once).
pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Some(max) = std::env::var("SMC_LOG").ok().and_then(|v| level(&v)) else {
            return;
        };
        // (a program that installed its own subscriber keeps it)
        let _ = tracing::subscriber::set_global_default(Stderr { max });
    });
}

/// The level `SMC_LOG` names; `None`: off.
fn level(v: &str) -> Option<Level> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "off" => None,
        "error" => Some(Level::ERROR),
        "warn" => Some(Level::WARN),
        "debug" => Some(Level::DEBUG),
        "trace" => Some(Level::TRACE),
        _ => Some(Level::INFO),
    }
}

struct Stderr {
    max: Level,
}

/// One event's fields as `message key=value ...`.
#[derive(Default)]
struct Line(String);

impl Visit for Line {
    fn record_str(&mut self, f: &Field, v: &str) {
        if f.name() == "message" {
            let _ = write!(self.0, " {v}");
        } else {
            let _ = write!(self.0, " {}={v:?}", f.name());
        }
    }
    fn record_debug(&mut self, f: &Field, v: &dyn Debug) {
        if f.name() == "message" {
            let _ = write!(self.0, " {v:?}");
        } else {
            let _ = write!(self.0, " {}={v:?}", f.name());
        }
    }
}

/// An event as the line `SMC_LOG` prints.
fn format(e: &Event<'_>) -> String {
    let mut l = Line::default();
    e.record(&mut l);
    let m = e.metadata();
    format!("smc-rs {} {}:{}", m.level(), m.target(), l.0)
}

impl Subscriber for Stderr {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        // (more verbose levels compare greater)
        *m.level() <= self.max
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::from_level(self.max))
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        eprintln!("{}", format(e));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn smc_log_levels() {
        assert_eq!(level("0"), None);
        assert_eq!(level(""), None);
        assert_eq!(level("1"), Some(Level::INFO));
        assert_eq!(level("Debug"), Some(Level::DEBUG));
        assert_eq!(level("warn"), Some(Level::WARN));
    }

    /// Collects formatted events (the stderr subscriber's format).
    struct Collect(Arc<Mutex<Vec<String>>>, Level);

    impl Subscriber for Collect {
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            *m.level() <= self.1
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, e: &Event<'_>) {
            self.0.lock().unwrap().push(format(e));
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn events_are_one_line_with_their_fields() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sub = Collect(got.clone(), Level::INFO);
        tracing::subscriber::with_default(sub, || {
            tracing::info!(target: "smc", role = "client", reason = "0x03010000", "fallback");
            tracing::debug!(target: "smc", "not at info");
        });
        let got = got.lock().unwrap();
        assert_eq!(
            got.as_slice(),
            ["smc-rs INFO smc: fallback role=\"client\" reason=\"0x03010000\""]
        );
    }

    /// The engine's link events as `SMC_LOG` prints them: with the LG-ID,
    /// the link id, the device of the link (the endpoint's second device
    /// for a link there) and the reason or cause.
    #[test]
    fn engine_events_are_logged_with_lg_id_and_reason() {
        use smc_engine::endpoint::{AbortCause, ConnId, EngineEvent, LgrId};
        use smc_proto::link::DownReason;
        let got = Arc::new(Mutex::new(Vec::new()));
        let sub = Collect(got.clone(), Level::INFO);
        let devs = super::super::Devices {
            first: "rxe0".into(),
            second: Some("rxe1".into()),
        };
        tracing::subscriber::with_default(sub, || {
            let up = EngineEvent::LinkUp {
                lgr: LgrId::from_bits(0),
                lgr_id: 0x100,
                slot: 1,
                second: true,
            };
            super::super::log_event(&devs, Some(0x7300), &up);
            let down = EngineEvent::LinkDown {
                lgr: LgrId::from_bits(0),
                lgr_id: 0x100,
                slot: 1,
                second: true,
                reason: DownReason::Failure,
            };
            super::super::log_event(&devs, Some(0x7300), &down);
            let moved = EngineEvent::ConnMoved {
                lgr: LgrId::from_bits(0),
                lgr_id: 0x100,
                conn: ConnId::from_bits(3),
                token: 9,
                from: 1,
                to: 0,
                from_second: true,
                to_second: false,
            };
            super::super::log_event(&devs, Some(0x7300), &moved);
            let aborted = EngineEvent::ConnAborted {
                lgr_id: None,
                conn: ConnId::from_bits(3),
                token: 9,
                cause: AbortCause::NoLink,
            };
            super::super::log_event(&devs, None, &aborted);
            // an endpoint without a second device: its own
            let one = super::super::Devices {
                first: "shm-lo".into(),
                second: None,
            };
            super::super::log_event(&one, Some(0x7300), &up);
        });
        let got = got.lock().unwrap();
        assert_eq!(
            got.as_slice(),
            [
                "smc-rs INFO smc: link up lg_id=\"00007300\" engine_lgr=256 link_id=2 device=\"rxe1\"",
                "smc-rs WARN smc: link down lg_id=\"00007300\" engine_lgr=256 link_id=2 device=\"rxe1\" reason=\"Failure\"",
                "smc-rs INFO smc: connection moved to another link (failover) lg_id=\"00007300\" engine_lgr=256 token=9 from_link=2 to_link=1 device=\"rxe0\" from_device=\"rxe1\"",
                "smc-rs WARN smc: connection aborted lg_id=\"\" token=9 device=\"rxe0\" cause=\"no_link\"",
                "smc-rs INFO smc: link up lg_id=\"00007300\" engine_lgr=256 link_id=2 device=\"shm-lo\"",
            ]
        );
    }
}
