//! Process and network plumbing for end-to-end tests.
//!
//! Rules every helper keeps (STYLE.md, Tests): only 127.0.0.1; ports come from the kernel (bind :0);
//! every child process is killed and reaped when its guard drops, also when a test panics; readiness
//! is polled against a deadline, never assumed after a fixed sleep; a failure message carries the
//! tail of the process's log.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use kvroute_core::chat::ChatTemplate;
use kvroute_core::prompt::{PromptTokens, Request};
use kvroute_core::tokenize::Tokenizer;
use kvroute_test_support::{Poll, Probe};

/// Hint appended to every "not installed" error.
pub const SETUP_HINT: &str = "run ./scripts/test.sh (it runs scripts/setup.sh)";

// ---------------------------------------------------------------------------------------------
// Locating the cached tools
// ---------------------------------------------------------------------------------------------

/// The repository root (the workspace directory).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// `$KVROUTE_CACHE`, or `<repo>/.cache` (setup.sh's default).
pub fn cache_dir() -> PathBuf {
    env_path("KVROUTE_CACHE").unwrap_or_else(|| repo_root().join(".cache"))
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn located(var: &str, default: PathBuf, what: &str, must_contain: Option<&str>) -> Result<PathBuf> {
    let path = env_path(var).unwrap_or(default);
    let probe = match must_contain {
        Some(file) => path.join(file),
        None => path.clone(),
    };
    if !probe.is_file() {
        bail!(
            "{what} not found at {} (set {var} or {SETUP_HINT})",
            probe.display()
        );
    }
    Ok(path)
}

/// The Envoy binary: `$KVROUTE_ENVOY` or `<cache>/envoy/envoy`.
pub fn envoy_bin() -> Result<PathBuf> {
    located(
        "KVROUTE_ENVOY",
        cache_dir().join("envoy/envoy"),
        "Envoy binary",
        None,
    )
}

/// Stages the Qwen3 tokenizer fixture as `slug`'s in a service's `--tokenizer-dir` `dir`
/// (`<dir>/tokenizers/<slug>/`).
pub fn stage_tokenizer(dir: &Path, slug: &str) -> Result<()> {
    let staged = dir.join("tokenizers").join(slug);
    std::fs::create_dir_all(&staged)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir()?.join(f), staged.join(f))?;
    }
    Ok(())
}

/// The built `kvroute-inventory serve` on a free loopback port with `dir` as its
/// `--tokenizer-dir` and `token` as its management token (written to `<dir>/token`), health
/// probes every 200 ms; `env` adds variables. Started, and its address read from its log.
pub async fn start_inventory(
    dir: &Path,
    token: &str,
    env: &[(&str, &str)],
) -> Result<(ChildGuard, SocketAddr)> {
    std::fs::write(dir.join("token"), token)?;
    let mut cmd = Command::new(built_bin("kvroute-inventory")?);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--tokenizer-dir"])
        .arg(dir)
        .arg("--auth-token-file")
        .arg(dir.join("token"))
        .env("KVROUTE_HEALTH_INTERVAL_MS", "200")
        .envs(env.iter().copied());
    let mut child = ChildGuard::spawn("kvroute-inventory", cmd, &dir.join("inventory.log"))?;
    let addr = printed_addr(&mut child, "kvroute-inventory listening on ").await?;
    Ok((child, addr))
}

/// Installs `rule` (a loxilb-shaped rule) through the management API of the inventory at `addr`
/// with `token`; its answer, or an error with the refusal.
pub async fn add_rule(
    addr: SocketAddr,
    token: &str,
    rule: &serde_json::Value,
) -> Result<serde_json::Value> {
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/netlox/v1/config/loadbalancer"))
        .bearer_auth(token)
        .json(rule)
        .timeout(Duration::from_secs(30))
        .send()
        .await?;
    let status = r.status();
    let text = r.text().await?;
    if !status.is_success() {
        bail!("rule refused: {status} {text}");
    }
    Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
}

/// A binary of this workspace built by `cargo build` (`<repo>/target/debug/<name>`).
pub fn built_bin(name: &str) -> Result<PathBuf> {
    let p = repo_root().join("target/debug").join(name);
    if !p.exists() {
        bail!("{} is not built: {SETUP_HINT}", p.display());
    }
    Ok(p)
}

/// Polls `child`'s log for a line starting with `prefix` and returns the address after it
/// (30 s at most).
pub async fn printed_addr(child: &mut ChildGuard, prefix: &str) -> Result<SocketAddr> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        child.ensure_running()?;
        let log = child.log();
        if let Some(rest) = log.lines().find_map(|l| l.strip_prefix(prefix)) {
            let addr = rest.split_whitespace().next().unwrap_or_default();
            return addr.parse().with_context(|| format!("address {addr:?}"));
        }
        if std::time::Instant::now() > deadline {
            bail!("never printed {prefix:?}:\n{}", child.log_tail(20));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The built filter module: `$KVROUTE_WASM` or `<cache>/wasm/kvroute_filter.wasm`
/// (written by scripts/build-wasm.sh, which scripts/test.sh runs).
pub fn wasm_module() -> Result<PathBuf> {
    let path = located(
        "KVROUTE_WASM",
        cache_dir().join("wasm/kvroute_filter.wasm"),
        "filter .wasm (scripts/build-wasm.sh)",
        None,
    )?;
    warn_if_stale(&path);
    Ok(path)
}

/// `cargo test` does not rebuild the `.wasm`: say so (on stderr, shown with a failing test's
/// output) when filter or core sources are newer than the module.
fn warn_if_stale(module: &Path) {
    let Ok(built) = std::fs::metadata(module).and_then(|m| m.modified()) else {
        return;
    };
    let root = repo_root();
    let newer = [root.join("filter/src"), root.join("shared/src")]
        .iter()
        .filter_map(|dir| newest_mtime(dir, 8))
        .any(|t| t > built);
    if newer {
        eprintln!(
            "warning: {} is older than filter/ or shared/ sources; rebuild it with ./scripts/build-wasm.sh",
            module.display()
        );
    }
}

fn newest_mtime(dir: &Path, depth: usize) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        let t = if meta.is_dir() && depth > 0 {
            newest_mtime(&entry.path(), depth - 1)
        } else {
            meta.modified().ok()
        };
        newest = newest.max(t);
    }
    newest
}

/// The prompt token ids vLLM/TensorRT-LLM would compute for an OpenAI request `body` (HF
/// tokenizers with the fixture's chat template: the reference the filter is checked against).
pub fn prompt_tokens(body: &[u8]) -> Result<Vec<u32>> {
    let dir = tokenizer_dir()?;
    let tok = Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json"))?)?;
    let tpl = ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json"))?)?;
    Ok(PromptTokens::from_request(
        &Request::from_json(body)?,
        &tok,
        Some(&tpl),
    )?)
}

/// The Qwen3 tokenizer fixture directory: `$KVROUTE_TOKENIZER_DIR` or `<cache>/fixtures/qwen3`.
pub fn tokenizer_dir() -> Result<PathBuf> {
    located(
        "KVROUTE_TOKENIZER_DIR",
        cache_dir().join("fixtures/qwen3"),
        "Qwen3 tokenizer fixture",
        Some("tokenizer.json"),
    )
}

// ---------------------------------------------------------------------------------------------
// Ports, temp dirs, child processes (shared with every suite: kvroute-test-support)
// ---------------------------------------------------------------------------------------------

pub use kvroute_test_support::{free_port, local, ChildGuard, TempDir};

// ---------------------------------------------------------------------------------------------
// Readiness
// ---------------------------------------------------------------------------------------------

/// Polls until a TCP connect to `addr` succeeds; fails after `timeout` or when `child` exits.
pub async fn wait_for_tcp(
    addr: SocketAddr,
    timeout: Duration,
    mut child: Option<&mut ChildGuard>,
) -> Result<()> {
    Poll::new(format!("{addr} to accept connections"), timeout)
        .until(async || {
            if let Some(c) = child.as_deref_mut() {
                c.ensure_running()?;
            }
            Ok(match tokio::net::TcpStream::connect(addr).await {
                Ok(_) => Probe::Ready(()),
                Err(e) => Probe::Pending(e.to_string()),
            })
        })
        .await
}

/// Polls `GET url` until it answers 200; fails after `timeout` or when `child` exits.
pub async fn wait_for_http(
    url: &str,
    timeout: Duration,
    mut child: Option<&mut ChildGuard>,
) -> Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let ready = Poll::new(format!("{url} to answer 200"), timeout)
        .until(async || {
            if let Some(c) = child.as_deref_mut() {
                c.ensure_running()?;
            }
            Ok(match client.get(url).send().await {
                Ok(r) if r.status() == reqwest::StatusCode::OK => Probe::Ready(()),
                Ok(r) => Probe::Pending(format!("status {}", r.status())),
                Err(e) => Probe::Pending(e.to_string()),
            })
        })
        .await;
    let tail = match (&ready, child) {
        (Err(_), Some(c)) => c.log_tail(40),
        _ => String::new(),
    };
    match tail.is_empty() {
        true => ready,
        false => ready.with_context(|| format!("log tail:\n{tail}")),
    }
}

/// The value of `series` (a metric name with its whole label set, as Prometheus text writes it)
/// in a `/metrics` page, 0 when the page has no such line.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Sends `req` and returns its body as text, whatever the status.
pub async fn body_text(req: reqwest::RequestBuilder) -> Result<String> {
    Ok(req.send().await?.text().await?)
}

// ---------------------------------------------------------------------------------------------
// Envoy
// ---------------------------------------------------------------------------------------------

/// A running Envoy, stopped on drop.
#[derive(Debug)]
pub struct Envoy {
    /// Admin interface address (`/ready`, `/stats`).
    pub admin: SocketAddr,
    /// Where each static listener was bound, by listener name.
    listeners: HashMap<String, SocketAddr>,
    child: ChildGuard,
    _dir: TempDir,
}

impl Envoy {
    /// How long Envoy may take to become ready: V8 compiles the module on start.
    pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

    /// Starts Envoy with `config` (a bootstrap as JSON, which is valid YAML) and waits for
    /// `/ready` and for every listener to accept connections.
    ///
    /// The admin and listener ports in `config` should be 0: Envoy binds them itself, the admin
    /// address is read back from `--admin-address-path` and the listeners' from `/listeners`
    /// ([`Envoy::listener`]). A port chosen beforehand can be taken by another test before Envoy
    /// binds it, and since Envoy listeners set `SO_REUSEPORT`, two Envoys then share it silently.
    ///
    /// Hot restart is disabled so parallel tests need no distinct `--base-id`; one worker thread
    /// keeps stats and logs deterministic.
    pub async fn start(config: &serde_json::Value) -> Result<Envoy> {
        let bin = envoy_bin()?;
        let dir = TempDir::new("envoy")?;
        let config_path = dir.path().join("envoy.yaml");
        let admin_path = dir.path().join("admin-address");
        std::fs::write(&config_path, serde_json::to_vec_pretty(config)?)?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config-path")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "info",
            ])
            .args(["--component-log-level", "wasm:debug"]);
        let mut child = ChildGuard::spawn("envoy", cmd, &dir.path().join("envoy.log"))?;
        let written = Poll::new("Envoy to write its admin address", Self::READY_TIMEOUT)
            .until(async || {
                child.ensure_running()?;
                let text = std::fs::read_to_string(&admin_path).unwrap_or_default();
                Ok(match text.trim().parse::<SocketAddr>() {
                    Ok(addr) => Probe::Ready(addr),
                    Err(_) => Probe::Pending(format!("{} holds {text:?}", admin_path.display())),
                })
            })
            .await;
        let admin = written.with_context(|| format!("log tail:\n{}", child.log_tail(40)))?;
        wait_for_http(
            &format!("http://{admin}/ready"),
            Self::READY_TIMEOUT,
            Some(&mut child),
        )
        .await?;
        let listeners = bound_listeners(admin).await?;
        for addr in listeners.values() {
            wait_for_tcp(*addr, Duration::from_secs(10), Some(&mut child)).await?;
        }
        Ok(Envoy {
            admin,
            listeners,
            child,
            _dir: dir,
        })
    }

    /// The address static listener `name` was bound to.
    pub fn listener(&self, name: &str) -> Result<SocketAddr> {
        self.listeners.get(name).copied().with_context(|| {
            format!(
                "Envoy has no listener {name:?} (it has {:?})",
                self.listeners.keys().collect::<Vec<_>>()
            )
        })
    }

    /// Everything Envoy logged so far.
    pub fn log(&self) -> String {
        self.child.log()
    }

    /// An error if Envoy has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.child.ensure_running()
    }

    /// Polls `/clusters` until Envoy's active health check has failed `host` (`IP:PORT`).
    pub async fn wait_for_failed_health_check(&self, host: &str, timeout: Duration) -> Result<()> {
        let url = format!("http://{}/clusters", self.admin);
        let client = reqwest::Client::new();
        Poll::new(format!("Envoy to mark {host} unhealthy"), timeout)
            .every(Duration::from_millis(100))
            .until(async || {
                let text = body_text(client.get(&url)).await?;
                Ok(Probe::from(text.lines().any(|l| {
                    l.contains(host) && l.contains("health_flags") && l.contains("failed_active_hc")
                })))
            })
            .await
    }

    /// Admin `/stats` lines containing `filter` (a regex, as Envoy's `filter` parameter takes it),
    /// as a name -> value map. Only integer stats (counters and gauges) are returned.
    pub async fn stats(&self, filter: &str) -> Result<HashMap<String, u64>> {
        let url = format!("http://{}/stats", self.admin);
        let text = reqwest::Client::new()
            .get(url)
            .query(&[("filter", filter)])
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(k, v)| v.trim().parse().ok().map(|v| (k.to_string(), v)))
            .collect())
    }

    /// Polls stat `name` until `pred` holds for it (missing counts as 0); returns its value.
    pub async fn wait_for_stat(
        &self,
        name: &str,
        timeout: Duration,
        pred: impl Fn(u64) -> bool,
    ) -> Result<u64> {
        let series = format!("^{}$", regex_escape(name));
        Poll::new(format!("stat {name} to reach the expected value"), timeout)
            .until(async || {
                let value = self.stats(&series).await?.get(name).copied().unwrap_or(0);
                Ok(match pred(value) {
                    true => Probe::Ready(value),
                    false => Probe::Pending(format!("{name} = {value}")),
                })
            })
            .await
    }
}

/// Admin `/listeners?format=json`: each listener's name and the address it is bound to.
async fn bound_listeners(admin: SocketAddr) -> Result<HashMap<String, SocketAddr>> {
    let v: serde_json::Value = reqwest::Client::new()
        .get(format!("http://{admin}/listeners?format=json"))
        .timeout(Duration::from_secs(5))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let statuses = v["listener_statuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    statuses
        .iter()
        .map(|l| {
            let name = l["name"].as_str().context("a listener without a name")?;
            let sock = &l["local_address"]["socket_address"];
            let ip = sock["address"]
                .as_str()
                .context("a listener without an address")?;
            let port = sock["port_value"]
                .as_u64()
                .context("a listener without a port")?;
            let addr: SocketAddr = format!("{ip}:{port}")
                .parse()
                .with_context(|| format!("listener {name} at {ip}:{port}"))?;
            Ok((name.to_owned(), addr))
        })
        .collect()
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c.is_ascii_alphanumeric() || c == '_' {
            true => vec![c],
            false => vec!['\\', c],
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Echo backend
// ---------------------------------------------------------------------------------------------

/// Response header naming the backend that answered.
pub const BACKEND_HEADER: &str = "x-kvroute-test-backend";

/// One request a [`Backend`] received.
#[derive(Clone, Debug)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

/// The value of header `name` of a received request, if it was sent.
pub fn header<'a>(r: &'a Received, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[derive(Clone)]
struct BackendState {
    name: String,
    received: Arc<Mutex<Vec<Received>>>,
}

/// A tiny in-test HTTP server: answers every request with status 200, the request body echoed
/// byte-for-byte, and [`BACKEND_HEADER`] set to its name; records what it received.
pub struct Backend {
    /// The name it answers with.
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    /// Binds 127.0.0.1:0 and serves on the current tokio runtime until dropped.
    pub async fn start(name: &str) -> Result<Backend> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Mutex::new(Vec::new()));
        let state = BackendState {
            name: name.to_string(),
            received: received.clone(),
        };
        // No body limit: tests send bodies up to Envoy's buffer limit.
        let app = Router::new()
            .fallback(echo)
            .layer(DefaultBodyLimit::disable())
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Backend {
            name: name.to_string(),
            addr,
            received,
            task,
        })
    }

    /// Every request received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo(
    State(state): State<BackendState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let headers_vec = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    if let Ok(mut r) = state.received.lock() {
        r.push(Received {
            method: method.to_string(),
            path: uri.to_string(),
            headers: headers_vec,
            body: body.clone(),
        });
    }
    let mut resp = (StatusCode::OK, body).into_response();
    if let Ok(v) = HeaderValue::from_str(&state.name) {
        resp.headers_mut().insert(BACKEND_HEADER, v);
    }
    resp
}

/// A port free on every address of `ips`, for a rule's one `kvZmqPort` that several simulators
/// on different loopback addresses publish on. It is below the kernel's ephemeral range: a port
/// picked by binding port 0 comes from that range, so a simulator's own HTTP listener (also port
/// 0) could take it before its ZMQ publisher binds. `salt` spreads tests that run at once.
pub fn shared_port(ips: &[&str], salt: u16) -> u16 {
    let start = (std::process::id() % 600) as u16 * 20 + salt;
    (0..500u16)
        .map(|i| 20_000 + (start + i * 7) % 12_000)
        .find(|p| {
            let held: Vec<_> = ips
                .iter()
                .filter_map(|ip| std::net::TcpListener::bind((*ip, *p)).ok())
                .collect();
            held.len() == ips.len()
        })
        .unwrap_or(0)
}
