//! The server process as the client sees it: started from this same binary
//! (`__serve`), driven over its stdin/stdout.

use crate::sys::CpuTime;
use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// The running server process.
pub struct ServerProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Port of its `SmcListener`.
    pub smc_port: u16,
    /// Port of its `TcpListener`.
    pub tcp_port: u16,
}

impl ServerProc {
    /// Starts `<this exe> __serve` and waits for its ports.
    pub fn start() -> io::Result<ServerProc> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("__serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(io::Error::other("server process without pipes"));
        };
        let mut s = ServerProc {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            smc_port: 0,
            tcp_port: 0,
        };
        let line = s.read_line()?;
        let ports: Vec<u16> = line
            .strip_prefix("ports ")
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        let [smc, tcp] = ports[..] else {
            return Err(io::Error::other(format!(
                "the server process did not start (said {line:?})"
            )));
        };
        s.smc_port = smc;
        s.tcp_port = tcp;
        Ok(s)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn read_line(&mut self) -> io::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server process exited",
            ));
        }
        Ok(line.trim_end().to_string())
    }

    /// Sends a command, returns the reply without its leading word.
    fn cmd(&mut self, cmd: &str) -> io::Result<String> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        let line = self.read_line()?;
        let word = cmd.split_whitespace().next().unwrap_or("");
        match line.strip_prefix(word) {
            Some(rest) => Ok(rest.trim().to_string()),
            None => Err(io::Error::other(format!(
                "server answered {line:?} to {cmd:?}"
            ))),
        }
    }

    /// The server process's CPU time now.
    pub fn cpu(&mut self) -> io::Result<CpuTime> {
        let r = self.cmd("cpu")?;
        CpuTime::from_line(&r).ok_or_else(|| io::Error::other(format!("bad cpu reply {r:?}")))
    }

    /// Waits until the server has finished with every connection (so one
    /// measurement's leftovers do not run during the next).
    pub fn quiesce(&mut self, timeout: Duration) -> io::Result<()> {
        let r = self.cmd(&format!("quiesce {}", timeout.as_millis()))?;
        match r.parse::<usize>() {
            Ok(0) => Ok(()),
            Ok(n) => Err(io::Error::other(format!(
                "{n} server connection(s) still open {} ms after the client closed them",
                timeout.as_millis()
            ))),
            Err(_) => Err(io::Error::other(format!("bad quiesce reply {r:?}"))),
        }
    }

    /// Pins every thread of the server process to `cpu`; the number of
    /// threads pinned.
    pub fn pin(&mut self, cpu: usize) -> io::Result<usize> {
        let r = self.cmd(&format!("pin {cpu}"))?;
        match r.strip_prefix("ok ").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(n),
            _ => Err(io::Error::other(format!(
                "the server could not pin itself to CPU {cpu}: {r}"
            ))),
        }
    }

    /// Modes of the connections its SMC listener accepted.
    pub fn accepted(&mut self) -> io::Result<BTreeMap<String, u64>> {
        let r = self.cmd("accepted")?;
        serde_json::from_str(&r).map_err(io::Error::other)
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
