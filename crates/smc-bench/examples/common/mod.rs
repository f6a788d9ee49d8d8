//! What the examples with a server half share: the server is the same
//! program started again with `serve`, and its first line is its port.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

/// Starts this program again as `PROGRAM serve` and reads the port it
/// prints; `name` (the example's) heads the error.
pub fn start_server(name: &str) -> Result<(Child, u16), String> {
    let me = std::env::current_exe().map_err(|e| format!("{name}: this program: {e}"))?;
    let mut child = Command::new(me)
        .arg("serve")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{name}: start the server: {e}"))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    match line.trim().parse() {
        Ok(port) => Ok((child, port)),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("{name}: the server did not start"))
        }
    }
}
