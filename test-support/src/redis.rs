//! A real `redis-server` for replication tests: a free port, no persistence, killed on drop.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::{free_port, wait_until_blocking, TempDir};

/// A `redis-server` on 127.0.0.1 and a free port, persisting nothing, killed on drop.
pub struct Redis {
    child: Option<Child>,
    /// Where it listens.
    pub port: u16,
    dir: TempDir,
}

impl Redis {
    /// Starts one and waits until it answers PING.
    pub fn start() -> Result<Redis> {
        let mut r = Redis {
            child: None,
            port: free_port()?,
            dir: TempDir::new("redis")?,
        };
        r.restart()?;
        Ok(r)
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port, empty, and waits until it answers PING.
    pub fn restart(&mut self) -> Result<()> {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("redis-server (install it: apt-get install redis-server)")?;
        self.child = Some(child);
        let what = format!("redis-server on port {} to answer PING", self.port);
        wait_until_blocking(&what, Duration::from_secs(10), || {
            self.cli(&["PING"]).trim() == "PONG"
        })
    }

    /// SIGKILL (no goodbye to clients), then reaped.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One `redis-cli` command's output ("" when the server is down).
    pub fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
