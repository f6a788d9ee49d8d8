//! Where the two processes run while a figure is measured. Pinned, because
//! on a small machine the scheduler's choice moves a ratio by a factor: TCP
//! loopback's round trip is a few microseconds when both ends share a core
//! (the wake-up hands the core over) and several times that across cores
//! (an inter-processor interrupt, a wake-up from idle), and an unpinned run
//! flips between the two. So every figure whose value depends on it is
//! measured in named placements, each process pinned to one CPU.

/// A placement's kind, as `--placement` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Kind {
    /// Client and server process on two different CPUs.
    Cross,
    /// Client and server process on one CPU.
    Same,
}

impl Kind {
    /// The name on the command line and in the JSON.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Cross => "cross",
            Kind::Same => "same",
        }
    }
}

/// One placement: the CPU of each process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Placement {
    /// Cross or same.
    pub kind: Kind,
    /// The CPU every thread of the client process runs on.
    pub client: usize,
    /// The CPU every thread of the server process runs on.
    pub server: usize,
}

impl Placement {
    /// `"cross"` / `"same"`.
    pub fn key(&self) -> &'static str {
        self.kind.key()
    }

    /// One line for the table.
    pub fn describe(&self) -> String {
        match self.kind {
            Kind::Cross => format!(
                "cross: client process on CPU {}, server process on CPU {}",
                self.client, self.server
            ),
            Kind::Same => format!(
                "same: client and server process both on CPU {}",
                self.client
            ),
        }
    }
}

/// The placements to measure, from `--placement` (`asked`, empty: both
/// where possible), `--cpus` (`cpus`, empty: the first two CPUs this process
/// may use) and the CPUs this process may use (`allowed`, from
/// `sched_getaffinity`). Also a note when a placement was left out. An
/// error says which value is wrong.
pub fn choose(
    asked: &[Kind],
    cpus: &[usize],
    allowed: &[usize],
) -> Result<(Vec<Placement>, Option<String>), String> {
    let Some(&first) = allowed.first() else {
        return Err("this process may use no CPU at all (sched_getaffinity)".into());
    };
    for c in cpus {
        if !allowed.contains(c) {
            return Err(format!(
                "--cpus: CPU {c} is not one this process may use (sched_getaffinity allows {allowed:?})"
            ));
        }
    }
    let (client, server) = match cpus {
        [] => (first, allowed.get(1).copied()),
        [a] => (*a, None),
        [a, b] if a == b => {
            return Err(format!(
                "--cpus {a},{b}: the two CPUs must differ (the cross placement runs client and server on different CPUs; the same placement uses the first)"
            ))
        }
        [a, b] => (*a, Some(*b)),
        _ => return Err("--cpus takes one or two CPUs: CLIENT[,SERVER]".into()),
    };
    let mut kinds = asked.to_vec();
    kinds.sort();
    kinds.dedup();
    let mut note = None;
    if server.is_none() {
        let why = if cpus.is_empty() {
            format!("this process may use one CPU only (CPU {first}, sched_getaffinity)")
        } else {
            format!("--cpus names one CPU ({client})")
        };
        if kinds.contains(&Kind::Cross) {
            return Err(format!("--placement cross needs two CPUs, and {why}"));
        }
        if kinds.is_empty() {
            note = Some(format!(
                "{why}: only the \"same\" placement is measured, \"cross\" is left out"
            ));
        }
        kinds = vec![Kind::Same];
    } else if kinds.is_empty() {
        kinds = vec![Kind::Cross, Kind::Same];
    }
    let placements = kinds
        .into_iter()
        .map(|kind| Placement {
            kind,
            client,
            server: match kind {
                Kind::Cross => server.unwrap_or(client),
                Kind::Same => client,
            },
        })
        .collect();
    Ok((placements, note))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kind: Kind, client: usize, server: usize) -> Placement {
        Placement {
            kind,
            client,
            server,
        }
    }

    #[test]
    fn both_placements_by_default_on_the_first_two_allowed_cpus() {
        let (v, note) = choose(&[], &[], &[2, 5, 7]).unwrap();
        assert_eq!(v, [p(Kind::Cross, 2, 5), p(Kind::Same, 2, 2)]);
        assert_eq!(note, None);
    }

    #[test]
    fn explicit_cpus_and_placements() {
        let (v, _) = choose(&[Kind::Same, Kind::Cross, Kind::Same], &[1, 0], &[0, 1]).unwrap();
        assert_eq!(v, [p(Kind::Cross, 1, 0), p(Kind::Same, 1, 1)]);
        let (v, _) = choose(&[Kind::Same], &[1], &[0, 1]).unwrap();
        assert_eq!(v, [p(Kind::Same, 1, 1)]);
    }

    #[test]
    fn one_cpu_measures_same_only_and_says_so() {
        let (v, note) = choose(&[], &[], &[3]).unwrap();
        assert_eq!(v, [p(Kind::Same, 3, 3)]);
        assert!(note.unwrap().contains("one CPU only"));
        let (v, note) = choose(&[], &[1], &[0, 1]).unwrap();
        assert_eq!(v, [p(Kind::Same, 1, 1)]);
        assert!(note.unwrap().contains("--cpus names one CPU"));
        // asked for explicitly: no note
        let (_, note) = choose(&[Kind::Same], &[], &[3]).unwrap();
        assert_eq!(note, None);
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        let e = choose(&[], &[0, 9], &[0, 1]).unwrap_err();
        assert!(e.contains("CPU 9 is not one this process may use"), "{e}");
        let e = choose(&[], &[1, 1], &[0, 1]).unwrap_err();
        assert!(e.contains("must differ"), "{e}");
        let e = choose(&[], &[0, 1, 0], &[0, 1]).unwrap_err();
        assert!(e.contains("one or two CPUs"), "{e}");
        let e = choose(&[Kind::Cross], &[], &[0]).unwrap_err();
        assert!(e.contains("needs two CPUs"), "{e}");
        let e = choose(&[Kind::Cross], &[0], &[0, 1]).unwrap_err();
        assert!(e.contains("needs two CPUs"), "{e}");
        assert!(choose(&[], &[], &[]).is_err());
    }
}
