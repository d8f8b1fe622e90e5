//! The `sglang-router` peer strategy: SGLang's own router (the `sglang-router` PyPI package,
//! version [`SGLANG_ROUTER_VERSION`], policy `cache_aware`) started in front of the same
//! simulators. The driver sends every request to the router, which proxies it to the worker it
//! chooses; the simulator's usage (`cached_tokens`) and name come back through the proxy.
//!
//! The router is a Python entry point around a Rust extension. `scripts/bench.sh` installs it into
//! `.cache/sglang-router-venv`; the bench looks there (or at `--sglang-router-python`) and says how
//! to install it when it is missing. Readiness is the router's own `GET /workers` listing every
//! simulator, polled with a deadline; the process is killed when its [`Proc`] handle drops.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

use super::fleet::{free_port, Proc};

/// The router version the benchmark pins.
pub const SGLANG_ROUTER_VERSION: &str = "0.3.2";

/// Where `scripts/bench.sh` installs the router's virtualenv, relative to the repository root.
pub const VENV_DIR: &str = ".cache/sglang-router-venv";

/// The Python interpreter that has `sglang_router` installed: `explicit` when given, else the
/// bench venv under the current directory or any parent (the repository root), else an error
/// that says how to install it.
pub fn find_python(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("--sglang-router-python {}: no such file", p.display());
    }
    let cwd = std::env::current_dir()?;
    for dir in cwd.ancestors() {
        let py = dir.join(VENV_DIR).join("bin/python");
        if py.is_file() {
            return Ok(py);
        }
    }
    bail!(
        "sglang-router is not installed: run scripts/bench.sh (it installs sglang-router=={SGLANG_ROUTER_VERSION} \
         into {VENV_DIR}) or pass --sglang-router-python PATH (a python with sglang-router=={SGLANG_ROUTER_VERSION})"
    )
}

/// Checks that `python` imports `sglang_router` at the pinned version.
pub fn check_version(python: &Path) -> anyhow::Result<()> {
    let out = Command::new(python)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('sglang-router'))",
        ])
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("run {}", python.display()))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || version.is_empty() {
        bail!(
            "{} has no sglang-router: run scripts/bench.sh or `{} -m pip install sglang-router=={SGLANG_ROUTER_VERSION}`",
            python.display(),
            python.display()
        );
    }
    if version != SGLANG_ROUTER_VERSION {
        bail!(
            "{} has sglang-router {version}, the benchmark pins {SGLANG_ROUTER_VERSION}",
            python.display()
        );
    }
    Ok(())
}

/// A running sglang-router.
#[derive(Debug)]
pub struct SglangRouter {
    /// The router process (killed on drop).
    pub proc: Proc,
    /// Its base URL.
    pub url: String,
}

/// Starts `python -m sglang_router.launch_router` on 127.0.0.1 over `workers` with the
/// `cache_aware` policy and waits (bounded) until `GET /workers` lists all of them.
/// `log` receives the router's stdout and stderr.
pub async fn start(python: &Path, workers: &[String], log: &Path) -> anyhow::Result<SglangRouter> {
    let port = free_port("127.0.0.1")?;
    let prom = free_port("127.0.0.1")?;
    let log_file =
        std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let mut cmd = Command::new(python);
    cmd.args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--prometheus-host", "127.0.0.1"])
        .args(["--prometheus-port", &prom.to_string()])
        .args(["--policy", "cache_aware", "--log-level", "warn"])
        // A worker that is up answers the first check: no need to wait the default 30 s between checks.
        .args(["--worker-startup-check-interval", "1"])
        .args(["--worker-startup-timeout-secs", "60"])
        .arg("--worker-urls")
        .args(workers)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let proc = Proc::spawn_unready(cmd, ([127, 0, 0, 1], port).into())?;
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut router = SglangRouter { proc, url };
    loop {
        if let Some(status) = router.proc.exited() {
            bail!(
                "sglang-router exited ({status}) before it was ready; log: {}",
                log.display()
            );
        }
        let last = match http
            .get(format!("{}/workers", router.url))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                let listed = count_workers(&v);
                if listed >= workers.len() {
                    return Ok(router);
                }
                format!("GET /workers lists {listed} of {} workers", workers.len())
            }
            Ok(r) => format!("GET /workers: HTTP {}", r.status()),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            // Returning drops the handle, which kills the router.
            bail!(
                "sglang-router was not ready within 90 s ({last}); log: {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Workers in a `GET /workers` answer (`{"workers": [...]}` or a bare list; `total` when given).
fn count_workers(v: &Value) -> usize {
    if let Some(n) = v.get("total").and_then(Value::as_u64) {
        return n as usize;
    }
    v.get("workers")
        .or(Some(v))
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn workers_are_counted_in_every_shape() {
        assert_eq!(count_workers(&json!({"workers": [{}, {}], "total": 2})), 2);
        assert_eq!(count_workers(&json!({"workers": [{}, {}, {}]})), 3);
        assert_eq!(count_workers(&json!([{}])), 1);
        assert_eq!(count_workers(&json!({"error": "x"})), 0);
    }
}
