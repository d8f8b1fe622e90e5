//! Ports, temp dirs and child processes for tests.
//!
//! Only 127.0.0.1; ports come from the kernel (bind :0); a [`ChildGuard`] kills and reaps its
//! process when dropped, also when a test panics; a [`TempDir`] is removed when dropped.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};

/// A port on 127.0.0.1 that was free a moment ago (the kernel picks it; the socket is closed
/// before returning, so a process started next can bind it).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// `127.0.0.1:port`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A directory under the system temp dir, removed on drop (unless [`TempDir::keep`] is called).
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates a fresh, uniquely named directory `kvroute-<prefix>-<pid>-<n>-<nanos>`.
    pub fn new(prefix: &str) -> Result<TempDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let name = format!(
            "kvroute-{prefix}-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory, left in place after the test (for logs a failing test points at).
    pub fn keep(self) -> PathBuf {
        let path = self.path.clone();
        std::mem::forget(self);
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A child process that is killed and reaped when dropped. Its stdout and stderr go to a log file.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildGuard {
    /// Spawns `cmd` with stdin closed and stdout+stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<ChildGuard> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawning {name}: {cmd:?}"))?;
        Ok(ChildGuard {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
        })
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Everything the process logged so far.
    pub fn log(&self) -> String {
        std::fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// An error if the process has exited, naming it with its log tail.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.exited() {
            Some(status) => bail!(
                "{} exited early ({status}); log tail:\n{}",
                self.name,
                self.log_tail(40)
            ),
            None => Ok(()),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Already-exited children make kill() fail; wait() still reaps them.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (at most `timeout`) for the first stdout line of `child` that starts with `prefix` and
/// returns the rest of it: the address a service prints once it listens. `child` must have been
/// spawned with `Stdio::piped()` stdout; a thread keeps draining it afterwards so the child never
/// blocks on a full pipe. On failure the child is killed and reaped and the error says whether it
/// exited first or stayed silent.
pub fn ready_line(child: &mut Child, prefix: &str, timeout: Duration) -> Result<String> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("the child's stdout is not piped"))?;
    let (tx, rx) = mpsc::channel();
    let wanted = prefix.to_owned();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix(&wanted) {
                let _ = tx.send(rest.to_owned());
            }
        }
    });
    let failure = match rx.recv_timeout(timeout) {
        Ok(rest) => return Ok(rest),
        Err(RecvTimeoutError::Disconnected) => "closed its stdout (exited?) before printing",
        Err(RecvTimeoutError::Timeout) => "did not print within the timeout",
    };
    let _ = child.kill();
    let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
    bail!("the process {failure} {prefix:?} ({timeout:?}; {status})")
}

/// Waits (at most `timeout`, checking every 20 ms) for `child` to exit and returns its status;
/// past the timeout it kills and reaps the child and fails.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Result<ExitStatus> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the process did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
