//! Helpers for the filter's end-to-end tests: Envoy bootstraps running the kvroute filter with
//! stateful_session pinning, the real `kvroute-inventory` binary, engine stand-ins that publish
//! TensorRT-LLM KV events, and a misbehaving inventory for the fault cases.
//!
//! Why TensorRT-LLM events: the stand-ins serve the drain (`POST /kv_cache_events`) on their own
//! serving port, which keeps the inventories apart on one IP and still goes through the service's
//! real ingestion path (events re-hashed from token ids). The benchmark's vLLM and SGLang rules
//! give each endpoint its own unused `kvZmqEndpoint`, so they stay empty (a cold fleet).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use crate::harness::{self, ChildGuard, Received, TempDir, BACKEND_HEADER};
use kvroute_test_support::{Poll, Probe};

/// The pin header the test configurations use (Envoy's header-based stateful session).
pub const PIN_HEADER: &str = "x-kvroute-pin";
/// The model whose tokenizer the fixture holds.
pub const MODEL: &str = "Qwen/Qwen3-0.6B";
/// Block size of the test rule.
pub const BLOCK: usize = 16;
/// An engine stand-in answers SSE (with a final usage chunk) when the request carries this header.
pub const SSE_HEADER: &str = "x-test-sse";
/// Request header making the engine stand-in answer a JSON body whose `usage` reports
/// `PROMPT,CACHED` tokens (instead of echoing the request).
pub const USAGE_HEADER: &str = "x-test-usage";

/// Standard base64 (the stateful-session header value is base64 of `ip:port`).
pub fn base64(input: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(A[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Engine stand-in
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct EngineState {
    name: String,
    received: Arc<Mutex<Vec<Received>>>,
    events: Arc<Mutex<VecDeque<Value>>>,
    healthy: Arc<AtomicBool>,
}

/// An engine stand-in: echoes every request (status 200, body byte-for-byte, [`BACKEND_HEADER`];
/// an SSE stream with [`SSE_HEADER`], a usage body with [`USAGE_HEADER`]),
/// answers `/health` (200, or 503 once made unhealthy) and drains queued TensorRT-LLM KV events
/// on `POST /kv_cache_events`. Probes and drains are not recorded as received requests.
pub struct Engine {
    pub name: String,
    pub addr: SocketAddr,
    state: EngineState,
    task: tokio::task::JoinHandle<()>,
}

impl Engine {
    /// Binds 127.0.0.1:0 and serves on the current runtime until dropped.
    pub async fn start(name: &str) -> Result<Engine> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = EngineState {
            name: name.to_owned(),
            received: Arc::default(),
            events: Arc::default(),
            healthy: Arc::new(AtomicBool::new(true)),
        };
        let app = Router::new()
            .fallback(engine)
            .layer(DefaultBodyLimit::disable())
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Engine {
            name: name.to_owned(),
            addr,
            state,
            task,
        })
    }

    /// Requests received so far (probes and drains excluded).
    pub fn received(&self) -> Vec<Received> {
        self.state
            .received
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// Makes `/health` answer 503 (false) or 200 (true).
    pub fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::Relaxed);
    }

    /// Queues TensorRT-LLM events for the next drain: `created`, then one `stored` event holding
    /// every full block of `tokens` (engine hashes are arbitrary; the service re-hashes tokens).
    pub fn store_blocks(&self, tokens: &[u32]) {
        let blocks: Vec<Value> = tokens
            .chunks_exact(BLOCK)
            .enumerate()
            .map(|(i, b)| {
                json!({"block_hash": 7000 + i, "cache_level": 0, "priority": 35,
                       "tokens": b.iter().map(|t| json!({"token_id": t, "token_extra_id": 0})).collect::<Vec<_>>()})
            })
            .collect();
        if let Ok(mut q) = self.state.events.lock() {
            q.push_back(json!({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [1000, 0]}, "window_size": 4096}));
            q.push_back(json!({"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": blocks}, "window_size": 4096}));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn engine(
    State(s): State<EngineState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match uri.path() {
        "/health" => {
            let code = if s.healthy.load(Ordering::Relaxed) {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            return code.into_response();
        }
        "/kv_cache_events" => {
            let drained: Vec<Value> = s
                .events
                .lock()
                .map(|mut q| q.drain(..).collect())
                .unwrap_or_default();
            return axum::Json(Value::Array(drained)).into_response();
        }
        _ => {}
    }
    let headers_vec = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    if let Ok(mut r) = s.received.lock() {
        r.push(Received {
            method: method.to_string(),
            path: uri.to_string(),
            headers: headers_vec,
            body: body.clone(),
        });
    }
    let mut resp = if headers.contains_key(SSE_HEADER) {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n\
                   data: [DONE]\n\n";
        let mut r = (StatusCode::OK, sse).into_response();
        r.headers_mut().insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        r
    } else if let Some((prompt, cached)) = headers
        .get(USAGE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(','))
    {
        let usage = json!({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": prompt.parse::<u64>().unwrap_or(0),
            "prompt_tokens_details": {"cached_tokens": cached.parse::<u64>().unwrap_or(0)}}});
        axum::Json(usage).into_response()
    } else {
        (StatusCode::OK, body).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&s.name) {
        resp.headers_mut().insert(BACKEND_HEADER, v);
    }
    resp
}

// ---------------------------------------------------------------------------------------------
// The real inventory service
// ---------------------------------------------------------------------------------------------

/// The `kvroute-inventory` binary: `$KVROUTE_INVENTORY_BIN` or `<repo>/target/debug/kvroute-inventory`.
pub fn inventory_bin() -> Result<PathBuf> {
    let p = std::env::var_os("KVROUTE_INVENTORY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| harness::repo_root().join("target/debug/kvroute-inventory"));
    if !p.is_file() {
        bail!(
            "{} not found: run `cargo build -p kvroute-inventory` (or set KVROUTE_INVENTORY_BIN)",
            p.display()
        );
    }
    Ok(p)
}

/// Bearer token the test inventory accepts for rule writes.
const TOKEN: &str = "kvroute-filter-e2e";

/// The engine contracts the filter benchmark measures (the rule's engine and hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contract {
    /// vLLM's default `sha256_cbor` (the contract most users run).
    VllmSha256Cbor,
    /// SGLang's `sha256_sglang`.
    Sglang,
    /// TensorRT-LLM's `blockhash_trtllm`.
    Trtllm,
}

impl Contract {
    pub const ALL: [Contract; 3] = [Contract::VllmSha256Cbor, Contract::Sglang, Contract::Trtllm];

    /// `kvEngineType`.
    pub fn engine(self) -> &'static str {
        match self {
            Contract::VllmSha256Cbor => "vllm",
            Contract::Sglang => "sglang",
            Contract::Trtllm => "trtllm",
        }
    }

    /// `kvHashAlgo` (the engine's default otherwise).
    pub fn algo(self) -> Option<&'static str> {
        match self {
            Contract::VllmSha256Cbor => Some("sha256_cbor"),
            _ => None,
        }
    }

    /// How the docs name it.
    pub fn label(self) -> &'static str {
        match self {
            Contract::VllmSha256Cbor => "vllm sha256_cbor",
            Contract::Sglang => "sglang sha256_sglang",
            Contract::Trtllm => "trtllm blockhash_trtllm",
        }
    }
}

/// A running `kvroute-inventory serve` with the Qwen3 tokenizer staged, stopped on drop.
pub struct Inventory {
    pub addr: SocketAddr,
    /// The endpoint picker's gRPC address, when started with [`Inventory::start_with_epp`].
    pub epp: Option<SocketAddr>,
    child: ChildGuard,
    _dir: TempDir,
}

impl Inventory {
    /// Starts the service on 127.0.0.1:0 (health probes off, fast TensorRT-LLM drains, no load caps).
    pub async fn start() -> Result<Inventory> {
        Inventory::start_with_route_token(None).await
    }

    /// [`Inventory::start`], with `/v1/route` requiring `route_token` when given
    /// (`--route-token-file`).
    pub async fn start_with_route_token(route_token: Option<&str>) -> Result<Inventory> {
        Inventory::start_with_args(route_token, &[]).await
    }

    /// [`Inventory::start`] with the endpoint picker on 127.0.0.1:0 for the rule
    /// [`add_rule`](Inventory::add_rule) installs, and `args` (more `--epp-*` flags).
    pub async fn start_with_epp(args: &[&str]) -> Result<Inventory> {
        let mut all = vec!["--epp-listen", "127.0.0.1:0", "--epp-rule", "10.0.0.1:8080"];
        all.extend_from_slice(args);
        Inventory::start_with_args(None, &all).await
    }

    /// Waits until the endpoint picker reports ready (its rule's tokenizer loaded).
    pub async fn wait_for_epp_ready(&self) -> Result<()> {
        Poll::new("the endpoint picker to be ready", Duration::from_secs(60))
            .every(Duration::from_millis(50))
            .until(async || {
                let log = self.child.log();
                Ok(
                    match log.lines().any(|l| {
                        l.contains("endpoint picker readiness") && l.trim_end().ends_with("true")
                    }) {
                        true => Probe::Ready(()),
                        false => Probe::Pending(self.child.log_tail(5)),
                    },
                )
            })
            .await
    }

    /// Its `/metrics` text.
    pub async fn metrics(&self) -> Result<String> {
        Ok(reqwest::get(format!("http://{}/metrics", self.addr))
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// The process id (to stop or continue it in a fault test).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn start_with_args(route_token: Option<&str>, args: &[&str]) -> Result<Inventory> {
        let dir = TempDir::new("inventory")?;
        let staged = dir.path().join("tokenizers").join("Qwen__Qwen3-0.6B");
        std::fs::create_dir_all(&staged)?;
        let fixture = harness::tokenizer_dir()?;
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture.join(f), staged.join(f))
                .with_context(|| format!("staging {f}"))?;
        }
        let token = dir.path().join("token");
        std::fs::write(&token, TOKEN)?;
        let log = dir.path().join("inventory.log");
        let mut cmd = Command::new(inventory_bin()?);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--tokenizer-dir"])
            .arg(dir.path())
            .arg("--auth-token-file")
            .arg(&token)
            .args(args)
            .env("KVROUTE_HEALTH_INTERVAL_MS", "0")
            .env("KVROUTE_TRTLLM_DRAIN_MS", "20")
            // Pure overlap argmax: the tests send bursts to one prefix, which load-capped
            // scoring would (rightly) spill to the idle endpoint.
            .env("LOXILB_KV_LB_MODE", "off")
            .env("LOXILB_KV_SPILL_RELIEF", "off")
            .env("RUST_LOG", "info");
        if let Some(t) = route_token {
            let path = dir.path().join("route-token");
            std::fs::write(&path, t)?;
            cmd.arg("--route-token-file").arg(path);
        }
        let mut child = ChildGuard::spawn("kvroute-inventory", cmd, &log)?;
        // The service prints its bound address (port 0 picks one): poll its log for it.
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            child.ensure_running()?;
            if let Some(a) = child.log().lines().find_map(|l| {
                l.strip_prefix("kvroute-inventory listening on ")
                    .map(|a| a.trim().to_owned())
            }) {
                break a;
            }
            if Instant::now() >= deadline {
                bail!(
                    "inventory did not print its address; log:\n{}",
                    child.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        let addr: SocketAddr = addr
            .parse()
            .with_context(|| format!("inventory address {addr:?}"))?;
        // Printed before the HTTP line, so it is in the log by now.
        let epp = child
            .log()
            .lines()
            .find_map(|l| l.strip_prefix("kvroute-inventory epp listening on "))
            .map(|a| a.trim().parse())
            .transpose()
            .context("endpoint picker address")?;
        Ok(Inventory {
            addr,
            epp,
            child,
            _dir: dir,
        })
    }

    /// Adds a TensorRT-LLM rule (VIP 10.0.0.1:8080, block 16, kvModel Qwen3) over `engines`; returns its id.
    pub async fn add_rule(&self, engines: &[&Engine]) -> Result<u64> {
        self.add_rule_for(engines, Contract::Trtllm, 8080).await
    }

    /// Adds a rule with `contract`'s engine and hash (VIP 10.0.0.1:`port`, block 16, kvModel
    /// Qwen3) over `engines`; returns its id. vLLM and SGLang rules subscribe to ZMQ events the
    /// echo engines never publish: their inventories stay empty, as in a cold fleet.
    pub async fn add_rule_for(
        &self,
        engines: &[&Engine],
        contract: Contract,
        port: u16,
    ) -> Result<u64> {
        let mut eps = Vec::new();
        for e in engines {
            let mut ep =
                json!({"endpointIP": "127.0.0.1", "targetPort": e.addr.port(), "weight": 1});
            if contract != Contract::Trtllm {
                // A port nothing publishes on: never another test's publisher.
                let port = kvroute_test_support::free_port()?;
                ep["kvZmqEndpoint"] = json!(format!("tcp://127.0.0.1:{port}"));
            }
            eps.push(ep);
        }
        let mut args = json!({"externalIP": "10.0.0.1", "port": port, "protocol": "tcp", "sel": 0, "mode": 4,
            "kvExactMode": 3, "kvBlockSize": BLOCK, "kvEngineType": contract.engine(), "kvModel": MODEL});
        if let Some(algo) = contract.algo() {
            args["kvHashAlgo"] = json!(algo);
        }
        let rule = json!({"serviceArguments": args, "endpoints": eps});
        let resp = reqwest::Client::new()
            .post(format!(
                "http://{}/netlox/v1/config/loadbalancer",
                self.addr
            ))
            .bearer_auth(TOKEN)
            .json(&rule)
            .send()
            .await?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "adding the rule failed: {status} {body}; log:\n{}",
                self.child.log_tail(30)
            );
        }
        body["id"].as_u64().context("rule id")
    }

    /// `GET /v1/rules/{rule}/tenants` with the management token.
    pub async fn tenants(&self, rule: &str) -> Result<Value> {
        let r = reqwest::Client::new()
            .get(format!("http://{}/v1/rules/{rule}/tenants", self.addr))
            .bearer_auth(TOKEN)
            .send()
            .await?;
        let status = r.status();
        let v: Value = r.json().await?;
        if !status.is_success() {
            bail!("tenants: {status} {v}");
        }
        Ok(v)
    }

    /// Polls until endpoint `ep` of rule `rule` holds at least `n` blocks.
    pub async fn wait_for_blocks(&self, rule: u64, ep: usize, n: usize) -> Result<()> {
        let url = format!(
            "http://{}/netlox/v1/config/ai/kv/inventory?service_id={rule}&ep_idx={ep}&limit=10000",
            self.addr
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v: Value = reqwest::get(&url)
                .await?
                .json()
                .await
                .unwrap_or(Value::Null);
            let have = v["blocks"].as_array().map_or(0, Vec::len);
            if have >= n {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "endpoint {ep} holds {have} blocks, wanted {n}; log:\n{}",
                    self.child.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A misbehaving inventory
// ---------------------------------------------------------------------------------------------

/// How [`FakeInventory`] answers `POST /v1/route`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Sleeps 1 s (beyond the filter's timeout).
    Slow,
    /// 500.
    Error,
    /// 200 with a body that is not a route answer.
    Garbage,
}

#[derive(Clone)]
struct FakeState {
    fault: Fault,
    contract: Value,
}

/// An inventory stand-in: serves a valid contract (the filter needs it before asking) and no
/// tokenizer (404), and answers `/v1/route` with a [`Fault`].
pub struct FakeInventory {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl FakeInventory {
    /// Binds 127.0.0.1:0.
    pub async fn start(fault: Fault) -> Result<FakeInventory> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let contract = json!({"rule_id": 1, "name": "10.0.0.1:8080/tcp", "vip": "10.0.0.1:8080", "engine": "trtllm",
            "algo": "blockhash_trtllm", "seed": null, "block_size": BLOCK, "key_mode": "engine", "model": MODEL,
            "kv_exact_mode": 3, "kv_enabled": true});
        let app = Router::new()
            .fallback(fake)
            .with_state(FakeState { fault, contract });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeInventory { addr, task })
    }
}

impl Drop for FakeInventory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn fake(State(s): State<FakeState>, uri: Uri) -> Response {
    let mut resp = fake_answer(s, uri).await;
    // No pooled connections: once the stand-in is dropped, Envoy's next callout is refused.
    resp.headers_mut()
        .insert("connection", HeaderValue::from_static("close"));
    resp
}

async fn fake_answer(s: FakeState, uri: Uri) -> Response {
    let path = uri.path();
    if path.ends_with("/contract") {
        return axum::Json(s.contract).into_response();
    }
    if path != "/v1/route" {
        return (StatusCode::NOT_FOUND, "no such thing").into_response();
    }
    match s.fault {
        Fault::Slow => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            (
                StatusCode::OK,
                r#"{"endpoint":"127.0.0.1:1","matched_blocks":0,"tier":"fallback"}"#,
            )
                .into_response()
        }
        Fault::Error => (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        Fault::Garbage => (StatusCode::OK, "\u{1}not json at all").into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy bootstraps
// ---------------------------------------------------------------------------------------------

/// How the filter sits in the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// The shipped envoy.yaml shape: `allow_on_headers_stop_iteration: true`.
    EnvoyFilter,
    /// What an Istio WasmPlugin produces: no `allow_on_headers_stop_iteration`. The filter runs
    /// with `pin_mode: filter_state`, followed by Envoy's buffer filter (holds the headers from
    /// the router until the body is complete) and a header_mutation filter that writes the pin
    /// and observability headers from the filter state before stateful_session reads them.
    WasmPlugin,
}

/// Inputs of a test bootstrap.
pub struct Bootstrap<'a> {
    pub engines: &'a [&'a Engine],
    /// Where the inventory cluster points (a closed port for "inventory down").
    pub inventory: SocketAddr,
    /// The plugin configuration (JSON); `rule`/`inventory_cluster` are filled in when absent.
    pub plugin: Value,
    pub variant: Variant,
    /// Leave the Wasm filter out (the latency baseline).
    pub without_filter: bool,
    /// Another build of the filter module (benches compare builds); `None`: the shipped one.
    pub wasm: Option<std::path::PathBuf>,
}

impl<'a> Bootstrap<'a> {
    /// The filter in front of `engines` with the inventory at `inventory`.
    pub fn new(
        engines: &'a [&'a Engine],
        inventory: SocketAddr,
        plugin: Value,
        variant: Variant,
    ) -> Bootstrap<'a> {
        Bootstrap {
            engines,
            inventory,
            plugin,
            variant,
            without_filter: false,
            wasm: None,
        }
    }
}

fn sock(addr: &str, port: u16) -> Value {
    json!({"socket_address": {"address": addr, "port_value": port}})
}

/// The Wasm filter's `failure_policy`, as in envoy/envoy.yaml (tests/tests/filter_manifests.rs
/// checks they match).
pub const FAILURE_POLICY: &str = "FAIL_RELOAD";

/// The Wasm filter's `reload_config`, as in envoy/envoy.yaml.
pub fn reload_config() -> Value {
    json!({"backoff": {"base_interval": "1s"}})
}

/// The first filter, as in envoy/envoy.yaml: Envoy itself drops every routing header a client
/// sends (all of `x-kvroute-*`, `x-prefiller-host-port`), so a dead VM cannot let one through,
/// and the pin Envoy echoes never reaches the client.
pub fn strip_filter() -> Value {
    json!({"name": "envoy.filters.http.header_mutation", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
    "mutations": {
        "request_mutations": [
            {"remove_on_match": {"key_matcher": {"prefix": "x-kvroute-"}}},
            {"remove": "x-prefiller-host-port"}
        ],
        "response_mutations": [{"remove": PIN_HEADER}]
    }}})
}

/// The bootstrap: strip → [buffer] → kvroute Wasm → stateful_session → router; clusters
/// `engines` (health-checked, outlier detection) and `kvroute_inventory`.
pub fn bootstrap(b: &Bootstrap<'_>) -> Result<Value> {
    let wasm = match &b.wasm {
        Some(w) => w.clone(),
        None => harness::wasm_module()?,
    };
    let mut plugin = b.plugin.clone();
    if let Value::Object(m) = &mut plugin {
        m.entry("rule").or_insert(json!("10.0.0.1:8080"));
        m.entry("inventory_cluster")
            .or_insert(json!("kvroute_inventory"));
        m.entry("pin_header").or_insert(json!(PIN_HEADER));
        m.entry("max_body_bytes").or_insert(json!(1 << 20));
        // Envoy on a loaded 2-core test machine: the default 25 ms is the production value,
        // 250 ms keeps the happy-path tests deterministic; the timeout test sets its own.
        m.entry("timeout_ms").or_insert(json!(250));
        if b.variant == Variant::WasmPlugin {
            m.entry("pin_mode").or_insert(json!("filter_state"));
        }
    }
    let mut wasm_config = json!({
        "name": "kvroute",
        "failure_policy": FAILURE_POLICY,
        "reload_config": reload_config(),
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": plugin.to_string()},
        "vm_config": {"vm_id": "kvroute", "runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm}}}
    });
    if b.variant == Variant::EnvoyFilter {
        wasm_config["allow_on_headers_stop_iteration"] = json!(true);
    }
    let mut filters = vec![strip_filter()];
    if !b.without_filter {
        filters.push(json!({"name": "envoy.filters.http.wasm", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": wasm_config}}));
    }
    if b.variant == Variant::WasmPlugin {
        filters.extend(wasmplugin_companions());
    }
    filters.push(json!({"name": "envoy.filters.http.stateful_session", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
        "session_state": {"name": "envoy.http.stateful_session.header", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
            "name": PIN_HEADER}},
        "strict": false}}));
    filters.push(
        json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    );
    let endpoints: Vec<Value> = b
        .engines
        .iter()
        .map(|e| json!({"endpoint": {"address": sock("127.0.0.1", e.addr.port())}}))
        .collect();
    let route = json!({"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "0s"},
                       "request_body_buffer_limit": 16777216});
    Ok(json!({
        "admin": {"address": sock("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [ingress_listener(0, route, json!(filters))],
            "clusters": [
                {
                    "name": "engines", "type": "STATIC", "connect_timeout": "1s", "lb_policy": "ROUND_ROBIN",
                    "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": endpoints}]},
                    // Two failures in a row: one slow probe on a loaded test machine must not
                    // unpin a healthy engine. Envoy's main thread (which runs health checks) is
                    // busy compiling the 4 MB module in V8 for seconds at start, so probes time
                    // out then; without traffic Envoy would re-probe only every 60 s
                    // (no_traffic_interval), hence the short one.
                    "health_checks": [{"timeout": "1s", "interval": "0.2s", "no_traffic_interval": "0.2s",
                                       "unhealthy_threshold": 2, "healthy_threshold": 1,
                                       "http_health_check": {"path": "/health"}}],
                    "outlier_detection": {"consecutive_5xx": 5, "successful_active_health_check_uneject_host": false}
                },
                {
                    "name": "kvroute_inventory", "type": "STATIC", "connect_timeout": "0.25s",
                    "load_assignment": {"cluster_name": "kvroute_inventory", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": sock(&b.inventory.ip().to_string(), b.inventory.port())}}]}]}
                }
            ]
        }
    }))
}

/// The `ingress` listener on 127.0.0.1:`port`: an HTTP connection manager that runs
/// `http_filters` (a JSON array) and has one route, `route`, for every host.
pub fn ingress_listener(port: u16, route: Value, http_filters: Value) -> Value {
    json!({
        "name": "ingress",
        "address": sock("127.0.0.1", port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "ingress",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
                "http_filters": http_filters
            }
        }]}]
    })
}

/// The filters an Istio WasmPlugin deployment adds after the kvroute Wasm filter (shipped as
/// envoy/istio/wasmplugin-companions.yaml): buffer, then header_mutation from filter state.
pub fn wasmplugin_companions() -> Vec<Value> {
    let from_state = |header: &str, key: &str| {
        json!({"append": {"header": {"key": header, "value": format!("%FILTER_STATE(wasm.{key}:PLAIN)%")},
                          "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}})
    };
    vec![
        json!({"name": "envoy.filters.http.buffer", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 16777216}}),
        json!({"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [
            from_state(PIN_HEADER, "kvroute_pin"),
            from_state("x-kvroute-tier", "kvroute_tier"),
            from_state("x-kvroute-matched-blocks", "kvroute_matched_blocks"),
            from_state("x-prefiller-host-port", "kvroute_prefiller"),
        ]}}}),
    ]
}

/// Envoy plus the client that talks to its listener.
pub struct Gateway {
    pub envoy: harness::Envoy,
    pub base: String,
    pub client: reqwest::Client,
}

impl Gateway {
    /// Starts Envoy with [`bootstrap`] (its ports bound by Envoy) and waits until it probed every
    /// engine healthy.
    pub async fn start(b: Bootstrap<'_>) -> Result<Gateway> {
        Gateway::start_with(b, |_| {}).await
    }

    /// [`Gateway::start`] with the bootstrap JSON changed by `edit` first (a test's own module,
    /// a filter left out).
    pub async fn start_with(b: Bootstrap<'_>, edit: impl FnOnce(&mut Value)) -> Result<Gateway> {
        let mut config = bootstrap(&b)?;
        edit(&mut config);
        let gw = Gateway::on(harness::Envoy::start(&config).await?)?;
        for e in b.engines {
            gw.wait_for_health(e, "healthy", Duration::from_secs(20))
                .await?;
        }
        Ok(gw)
    }

    /// The gateway of a started Envoy: its client talks to the `ingress` listener.
    pub fn on(envoy: harness::Envoy) -> Result<Gateway> {
        Ok(Gateway {
            base: format!("http://{}", envoy.listener("ingress")?),
            envoy,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()?,
        })
    }

    /// Waits until Envoy's `/clusters` shows `engine` with health flag `flag` (`healthy`, or
    /// `/failed_active_hc` for unhealthy).
    pub async fn wait_for_health(
        &self,
        engine: &Engine,
        flag: &str,
        timeout: Duration,
    ) -> Result<()> {
        let url = format!("http://{}/clusters", self.envoy.admin);
        let needle = format!("engines::{}::health_flags::{flag}", engine.addr);
        let deadline = Instant::now() + timeout;
        loop {
            let text = reqwest::get(&url).await?.text().await?;
            if text.lines().any(|l| l.starts_with(&needle)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} never reached health {flag:?} in /clusters:\n{text}",
                    engine.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the worker's filter has its contract and tokenizer: one request makes the
    /// worker VM start loading its tokenizer (VMs without traffic never load one).
    pub async fn wait_until_routing(&self, timeout: Duration) -> Result<()> {
        self.wait_for_log("rule contract loaded", 2, timeout)
            .await?;
        let r = self
            .client
            .get(format!("{}/kvroute-warmup", self.base))
            .send()
            .await?;
        if r.status() != 200 {
            bail!("warm-up request answered {}", r.status());
        }
        self.wait_for_log("tokenizer loaded", 1, timeout).await
    }

    /// Waits until `needle` was logged `count` times: the contract loads in every Wasm VM (the
    /// main thread's and the one worker's, so 2), the tokenizer only in the worker (1).
    pub async fn wait_for_log(&self, needle: &str, count: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.envoy.log().matches(needle).count() >= count {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let log = self.envoy.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                bail!(
                    "Envoy never logged {needle:?}; tail:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until Envoy's health checker sees `engine` as unhealthy (`failed_active_hc`).
    pub async fn wait_for_unhealthy(&self, engine: &Engine, timeout: Duration) -> Result<()> {
        self.wait_for_health(engine, "/failed_active_hc", timeout)
            .await
    }

    /// POSTs `body` to `path` with JSON content type and extra headers.
    pub async fn post(
        &self,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<reqwest::Response> {
        let mut r = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        Ok(r.send().await?)
    }

    /// A `wasmcustom.<name>` stat (0 when absent).
    pub async fn stat(&self, name: &str) -> Result<u64> {
        let full = format!("wasmcustom.{name}");
        Ok(self
            .envoy
            .stats(&full)
            .await?
            .get(&full)
            .copied()
            .unwrap_or(0))
    }
}

/// The filter built with its `test-crash-hook` feature (a request carrying `x-test-crash-vm`
/// traps the VM), at `<cache>/wasm/kvroute_filter_crash_hook.wasm`; built with
/// scripts/build-wasm.sh when missing or older than the shipped module. Test use only.
pub fn crash_hook_module() -> Result<PathBuf> {
    let shipped = harness::wasm_module()?;
    let out = shipped.with_file_name("kvroute_filter_crash_hook.wasm");
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&out).is_some() && modified(&out) >= modified(&shipped) {
        return Ok(out);
    }
    let script = harness::repo_root().join("scripts/build-wasm.sh");
    let status = Command::new(&script)
        .env("KVROUTE_WASM_FEATURES", "test-crash-hook")
        .env("KVROUTE_WASM_OUT", &out)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} with test-crash-hook failed: {status}", script.display());
    }
    Ok(out)
}

/// A 127.0.0.1 address nothing listens on (the kernel just handed the port out and it was
/// closed again), for "inventory down".
pub fn closed_port() -> Result<SocketAddr> {
    Ok(harness::local(harness::free_port()?))
}

// ---------------------------------------------------------------------------------------------
// The endpoint picker behind Envoy's ext_proc filter
// ---------------------------------------------------------------------------------------------

/// The destination header of the endpoint picker protocol.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

/// Inputs of an endpoint picker bootstrap.
pub struct EppBootstrap<'a> {
    pub engines: &'a [&'a Engine],
    pub epp: SocketAddr,
    /// ext_proc `message_timeout`: how long Envoy waits for one answer. In `BUFFERED` mode it
    /// covers every message and fails open; with a `FULL_DUPLEX_STREAMED` request body it covers
    /// only the response's messages and fails closed (docs/epp.md, Failure modes).
    pub message_timeout: Duration,
    /// `request_body_mode`: `FULL_DUPLEX_STREAMED` (as GIE gateways) or `BUFFERED` (held up to
    /// the listener's buffer limit: [`listener_buffer_limit`]).
    pub body_mode: &'static str,
    /// `response_body_mode`: `NONE`, or `STREAMED` for the picker to read the engines' usage.
    pub response_body_mode: &'static str,
}

/// The shape GIE gateways program (docs/epp.md shows it as YAML): the client's
/// destination dropped first, the ext_proc filter (full-duplex streamed request body, response
/// headers for the served-endpoint report, `envoy.lb` metadata both ways, `failure_mode_allow`,
/// which Envoy honours in `BUFFERED` mode only), and an `engines` cluster whose `override_host`
/// policy sends each request to the picked endpoint (the header's list in order on retries) and
/// round-robins requests the picker left unpinned.
pub fn epp_bootstrap(b: &EppBootstrap<'_>) -> Value {
    let strip = json!({"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": DESTINATION}]}}});
    let ext_proc = json!({"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute_epp"}},
        "failure_mode_allow": true,
        "message_timeout": format!("{}s", b.message_timeout.as_secs_f64()),
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": b.body_mode, "request_trailer_mode": "SEND",
            "response_body_mode": b.response_body_mode, "response_trailer_mode": "SKIP"},
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]}}}});
    let router = json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}});
    let route = json!({"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "0s",
        "retry_policy": {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 1}}});
    let endpoints: Vec<Value> = b
        .engines
        .iter()
        .map(|e| json!({"endpoint": {"address": sock("127.0.0.1", e.addr.port())}}))
        .collect();
    let lb_key = |k: &str| json!({"key": "envoy.lb", "path": [{"key": k}]});
    json!({
        "admin": {"address": sock("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [ingress_listener(0, route, json!([strip, ext_proc, router]))],
            "clusters": [
                {
                    "name": "engines", "type": "STATIC", "connect_timeout": "1s",
                    "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": endpoints}]},
                    "load_balancing_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [{"header": DESTINATION}, {"metadata": lb_key(DESTINATION)}],
                            "selected_host_key": lb_key("x-gateway-destination-endpoint-served"),
                            "fallback_policy": {"policies": [{"typed_extension_config": {
                                "name": "envoy.load_balancing_policies.round_robin",
                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]}}}}]}
                },
                {
                    "name": "kvroute_epp", "type": "STATIC", "connect_timeout": "0.25s",
                    "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                    "load_assignment": {"cluster_name": "kvroute_epp", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": sock(&b.epp.ip().to_string(), b.epp.port())}}]}]}
                }
            ]
        }
    })
}

/// `config` (an [`epp_bootstrap`]) with the ingress listener's `per_connection_buffer_limit_bytes`
/// set to `bytes`: how much of an HTTP/1.1 request body Envoy holds for a `BUFFERED` ext_proc
/// filter. Without it Envoy's default applies (1 MiB), and a longer body is Envoy's own 413
/// (docs/epp.md, Failure modes). A bootstrap edit rather than an [`EppBootstrap`] field, so the
/// struct's literals elsewhere stay as they are.
pub fn listener_buffer_limit(mut config: Value, bytes: u32) -> Value {
    if let Some(listeners) = config["static_resources"]["listeners"].as_array_mut() {
        for l in listeners {
            l["per_connection_buffer_limit_bytes"] = json!(bytes);
        }
    }
    config
}

/// Envoy with [`epp_bootstrap`], and its client.
pub async fn epp_gateway(
    engines: &[&Engine],
    epp: SocketAddr,
    message_timeout: Duration,
    (body_mode, response_body_mode): (&'static str, &'static str),
) -> Result<Gateway> {
    let b = EppBootstrap {
        engines,
        epp,
        message_timeout,
        body_mode,
        response_body_mode,
    };
    Gateway::on(harness::Envoy::start(&epp_bootstrap(&b)).await?)
}
