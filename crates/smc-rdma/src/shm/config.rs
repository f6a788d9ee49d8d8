//! The `shm` configuration: the declared devices (name → network interface),
//! the rundir every process shares, heartbeat and poll periods; the text form
//! of `$SMC_RDMA_SHM_CONFIG` ([`ShmConfig::parse`], [`ShmConfig::to_text`]).
//! The crate README ("shm configuration") documents the format.

use crate::verbs::*;
use std::path::PathBuf;
use std::time::Duration;

use super::registry;

/// One declared device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmDeviceConfig {
    /// Device name (`shm0`).
    pub name: String,
    /// The network interface it is bound to.
    pub netdev: String,
}

/// `shm` provider configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Declared devices.
    pub devices: Vec<ShmDeviceConfig>,
    /// Directory of the rendezvous sockets (shared by all netns of the host).
    pub rundir: PathBuf,
    /// A peer whose heartbeat stops this long is declared dead.
    pub peer_timeout: Duration,
    /// Period of the device thread (port state, heartbeats).
    pub poll_interval: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            devices: vec![],
            rundir: default_rundir(),
            peer_timeout: Duration::from_millis(1000),
            poll_interval: Duration::from_millis(20),
        }
    }
}

/// `$SMC_RDMA_RUNDIR`, else `/run/smc-rs` if usable (created mode 1777 if
/// missing, see the README's threat model), else `$XDG_RUNTIME_DIR/smc-rs`,
/// else `/tmp/smc-rs`.
pub fn default_rundir() -> PathBuf {
    if let Some(d) = std::env::var_os("SMC_RDMA_RUNDIR") {
        return d.into();
    }
    let run = PathBuf::from("/run/smc-rs");
    if registry::create_rundir(&run).is_ok() {
        return run;
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(x).join("smc-rs");
    }
    PathBuf::from("/tmp/smc-rs")
}

impl ShmConfig {
    /// Parses the text form:
    ///
    /// ```text
    /// # comment
    /// rundir /run/smc-rs
    /// peer_timeout_ms 1000
    /// poll_interval_ms 20
    /// device shm0 netdev eth0
    /// ```
    pub fn parse(text: &str) -> Result<ShmConfig> {
        let mut c = ShmConfig::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let w: Vec<&str> = line.split_whitespace().collect();
            let bad = || Error::Config(format!("line {}: cannot parse {line:?}", n + 1));
            let ms = |s: &str| {
                s.parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|_| bad())
            };
            match w.as_slice() {
                ["rundir", d] => c.rundir = PathBuf::from(d),
                ["peer_timeout_ms", v] => c.peer_timeout = ms(v)?,
                ["poll_interval_ms", v] => c.poll_interval = ms(v)?,
                ["device", name, "netdev", nd] => {
                    if c.devices.iter().any(|d| d.name == *name) {
                        return Err(Error::Config(format!(
                            "line {}: device {name} declared twice",
                            n + 1
                        )));
                    }
                    c.devices.push(ShmDeviceConfig {
                        name: name.to_string(),
                        netdev: nd.to_string(),
                    })
                }
                _ => return Err(bad()),
            }
        }
        if c.poll_interval.is_zero() || c.peer_timeout < c.poll_interval * 2 {
            return Err(Error::Config(
                "need poll_interval > 0 and peer_timeout >= 2 * poll_interval".into(),
            ));
        }
        Ok(c)
    }

    /// Renders the text form.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "rundir {}\npeer_timeout_ms {}\npoll_interval_ms {}\n",
            self.rundir.display(),
            self.peer_timeout.as_millis(),
            self.poll_interval.as_millis()
        );
        for d in &self.devices {
            s += &format!("device {} netdev {}\n", d.name, d.netdev);
        }
        s
    }
}
