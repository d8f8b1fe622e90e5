//! promtool and a real Prometheus process for tests/tests/prometheus.rs.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvroute_tests::harness::{self, ChildGuard, TempDir};
use serde_json::{json, Value};

use crate::names::deploy_dir;

fn tool(var: &str, name: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} not found on PATH (set {var} or {})",
                harness::SETUP_HINT
            )
        })
}

/// Runs promtool; returns its exit code and stdout + stderr.
pub fn promtool(args: &[&str], stdin: Option<&[u8]>, dir: &Path) -> Result<(i32, String)> {
    let mut cmd = Command::new(tool("KVROUTE_PROMTOOL", "promtool")?);
    cmd.args(args)
        .current_dir(dir)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input)?;
    }
    let out = child.wait_with_output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.code().unwrap_or(-1), text))
}

/// `promtool check metrics` on `text`: the problems, as (metric name, problem).
pub fn lint(text: &str) -> Vec<(String, String)> {
    let (code, out) = promtool(
        &["check", "metrics"],
        Some(text.as_bytes()),
        &harness::repo_root(),
    )
    .unwrap();
    // 0: clean; 3: lint problems; anything else: promtool could not parse the exposition.
    assert!(
        code == 0 || code == 3,
        "promtool check metrics failed ({code}):\n{out}"
    );
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once(' ') {
            Some((name, problem)) => (name.to_owned(), problem.trim().to_owned()),
            None => (l.to_owned(), String::new()),
        })
        .collect()
}

/// A running Prometheus scraping `targets` every second, with the shipped rules loaded.
pub struct Prometheus {
    pub base: String,
    pub child: ChildGuard,
    _dir: TempDir,
}

impl Prometheus {
    pub async fn start(targets: &[(&str, &str, SocketAddr)]) -> Result<Prometheus> {
        let dir = TempDir::new("prometheus")?;
        let rules = deploy_dir().join("prometheus");
        let scrape: Vec<Value> = targets
            .iter()
            .map(|(job, path, addr)| {
                json!({"job_name": job, "metrics_path": path, "scrape_interval": "1s",
                       "static_configs": [{"targets": [addr.to_string()]}]})
            })
            .collect();
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules.join("recording.yaml"), rules.join("alerts.yaml")],
            "scrape_configs": scrape,
        });
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let port = harness::free_port()?;
        let mut cmd = Command::new(tool("KVROUTE_PROMETHEUS", "prometheus")?);
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn");
        let mut child = ChildGuard::spawn("prometheus", cmd, &dir.path().join("prometheus.log"))?;
        let base = format!("http://127.0.0.1:{port}");
        harness::wait_for_http(
            &format!("{base}/-/ready"),
            Duration::from_secs(30),
            Some(&mut child),
        )
        .await?;
        Ok(Prometheus {
            base,
            child,
            _dir: dir,
        })
    }

    /// `GET /api/v1/<path>` with `query`; the `data` of a successful answer, else the error.
    pub async fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value> {
        let v: Value = reqwest::Client::new()
            .get(format!("{}/api/v1/{path}", self.base))
            .query(query)
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .json()
            .await?;
        if v["status"] != "success" {
            bail!("{path} {query:?}: {v}");
        }
        Ok(v["data"].clone())
    }

    /// An instant query's vector result as (labels, value).
    pub async fn query(&self, q: &str) -> Result<Vec<(BTreeMap<String, String>, f64)>> {
        let data = self.api("query", &[("query", q)]).await?;
        let mut out = Vec::new();
        for s in data["result"].as_array().context("result")? {
            let labels = s["metric"]
                .as_object()
                .context("metric")?
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            let value = s["value"][1]
                .as_str()
                .context("value")?
                .parse::<f64>()
                .context("value")?;
            out.push((labels, value));
        }
        Ok(out)
    }

    /// Polls `q` until it returns exactly one series whose value is `want`.
    pub async fn wait_for_value(&mut self, q: &str, want: f64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.child.ensure_running()?;
            let got = self.query(q).await?;
            if got.len() == 1 && got[0].1 == want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let targets = self.api("targets", &[]).await.unwrap_or(Value::Null);
                bail!("{q} = {got:?}, wanted {want} within {timeout:?}; targets: {targets}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls until every loaded rule was evaluated without error; returns how many there are.
    pub async fn wait_for_rules(&mut self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            self.child.ensure_running()?;
            let data = self.api("rules", &[]).await?;
            let rules: Vec<&Value> = data["groups"]
                .as_array()
                .context("groups")?
                .iter()
                .flat_map(|g| g["rules"].as_array().into_iter().flatten())
                .collect();
            let bad: Vec<String> = rules
                .iter()
                .filter(|r| r["health"] != "ok")
                .map(|r| format!("{} {}: {}", r["name"], r["health"], r["lastError"]))
                .collect();
            if bad.is_empty() && !rules.is_empty() {
                return Ok(rules.len());
            }
            if bad.iter().any(|b| b.contains("\"err\"")) || Instant::now() >= deadline {
                bail!("rules not healthy:\n{}", bad.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
