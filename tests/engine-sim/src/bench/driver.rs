//! Routing strategies and the request loop: every request is a streamed chat completion whose
//! TTFT, usage (`cached_tokens`) and serving simulator (`x-kvroute-sim`) are recorded.
//!
//! Strategies:
//! * `round-robin`: the driver rotates over the simulators.
//! * `sticky`: jump consistent hash of the tenant (what a tenant-affinity load balancer does).
//! * `partition`: shared prefix g on endpoint g mod n, a static partition of the prompts that
//!   needs to know the workload (the bar a cache-aware router should reach without knowing it).
//! * `oracle`: asks every simulator how many leading blocks of this request it holds
//!   (`POST /debug/cache/match`: GPU blocks, plus the CPU tier's continuation under
//!   `--cpu-blocks`) and picks the longest match, least loaded on ties.
//! * `kvroute-engine`, `kvroute-tokens`: the driver tokenizes and hashes like the filter (engine
//!   contract or kvroute's content key) and asks the inventory service (`POST /v1/route`).
//! * `gateway`: sends to Envoy with the kvroute filter (round robin over gateway URLs); the
//!   filter chooses.
//! * `sglang-router`: sends to SGLang's router (`cache_aware` policy, see [`super::sglang`]),
//!   which proxies to the simulator it chooses.
//!
//! Predictions: the strategies that know how much of a request the chosen engine holds say so,
//! and the driver judges it against the engine's `cached_tokens` ([`judge`], the filter's
//! `kvroute_filter_prediction_*` rule): `kvroute-engine` and `kvroute-tokens` take the route
//! answer's `matched_blocks`, `oracle` the chosen simulator's `matched_blocks` plus
//! `cpu_matched_blocks`. The others make
//! none: round robin, sticky and partition do not look at the caches, and sglang-router keeps
//! its tree to itself. `gateway` takes the filter's `x-kvroute-matched-blocks`, which the filter
//! writes on the upstream request and the simulator echoes in its response (a real engine does
//! not: there the filter's own `kvroute_filter_prediction_*` stats hold the judgement).
//!
//! Outcome reports: under the kvroute strategies the driver plays the filter's part and sends
//! each endpoint's judged predictions to the inventory (`POST /v1/rules/{rule}/outcomes`, every
//! [`REPORT_EVERY`] and once at the end), so the inventory's divergence signal runs over the
//! benchmark's traffic as it does behind a gateway.
//!
//! The serving simulator is read from the `x-kvroute-sim` header, or from the chunks'
//! `system_fingerprint` (the simulator's name) when a proxy drops the header. Real engines send
//! neither: every request carries an `x-request-id` ([`Record::request_id`]), which vLLM logs
//! with `--enable-log-requests`, and [`attribute_from_logs`] reads the engines' logs afterwards.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_core::prompt::Endpoint;
use kvroute_core::wire::{EndpointOutcomes, OutcomeReport};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::workload::{Session, Shape};
use crate::prompt::Encoder;
use crate::server::{MATCHED_HEADER, SIM_HEADER};

/// How often the kvroute strategies send the inventory their outcome reports (the filter's
/// default `report_ms`).
pub const REPORT_EVERY: Duration = Duration::from_millis(1000);

/// A routing strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Rotate.
    RoundRobin,
    /// Consistent hash of the tenant.
    Sticky,
    /// Shared prefix g on endpoint g mod n.
    Partition,
    /// Longest cached prefix, from the simulators themselves.
    Oracle,
    /// kvroute inventory, engine keys.
    KvrouteEngine,
    /// kvroute inventory, content keys.
    KvrouteTokens,
    /// Through Envoy and the filter.
    Gateway,
    /// Through SGLang's router, `cache_aware` policy.
    SglangRouter,
}

impl Strategy {
    /// Every strategy, in report order.
    pub const ALL: [Strategy; 8] = [
        Strategy::RoundRobin,
        Strategy::Sticky,
        Strategy::Partition,
        Strategy::KvrouteEngine,
        Strategy::KvrouteTokens,
        Strategy::SglangRouter,
        Strategy::Gateway,
        Strategy::Oracle,
    ];

    /// Command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::Sticky => "sticky",
            Strategy::Partition => "partition",
            Strategy::Oracle => "oracle",
            Strategy::KvrouteEngine => "kvroute-engine",
            Strategy::KvrouteTokens => "kvroute-tokens",
            Strategy::Gateway => "gateway",
            Strategy::SglangRouter => "sglang-router",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Whether the strategy needs the inventory service.
    pub fn needs_inventory(self) -> bool {
        matches!(self, Strategy::KvrouteEngine | Strategy::KvrouteTokens)
    }
}

/// One request's outcome.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Record {
    /// Session index.
    pub session: usize,
    /// Shared-prefix group.
    pub group: usize,
    /// Turn within the session.
    pub turn: usize,
    /// The `x-request-id` sent with the request (unique per run and request).
    pub request_id: String,
    /// Simulator that served (`x-kvroute-sim`).
    pub served_by: Option<String>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Time to first content token, ms.
    pub ttft_ms: f64,
    /// Whole request, ms.
    pub latency_ms: f64,
    /// Time spent choosing the endpoint (tokenize + hash + route call, or the oracle's queries), ms.
    pub route_ms: Option<f64>,
    /// The inventory's `reason` (kvroute strategies).
    pub reason: Option<String>,
    /// The strategy's prediction for the chosen engine, judged against `cached_tokens`
    /// (strategies that predict, requests that completed with a usage).
    pub prediction: Option<Judged>,
    /// Failure, if any.
    pub error: Option<String>,
}

pub use kvroute_core::usage::Verdict;

/// One judged prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Judged {
    /// Leading blocks the strategy credited the chosen engine with.
    pub matched_blocks: u64,
    /// What of it the engine could reuse: `min(matched_blocks, (prompt_tokens - 1) / block_size)`
    /// blocks, in tokens.
    pub predicted_tokens: u64,
    /// Against the engine's `cached_tokens` in whole blocks.
    pub verdict: Verdict,
}

/// Judges a prediction of `matched_blocks` against the engine's usage. Engines reuse whole
/// blocks and always compute the prompt's last token, so the prediction is capped at the full
/// blocks before it, and `cached_tokens` is counted in whole blocks. `None` without a usage
/// (`prompt_tokens` 0).
pub fn judge(
    matched_blocks: u64,
    block_size: BlockSize,
    prompt_tokens: u64,
    cached_tokens: u64,
) -> Option<Judged> {
    judge_with_outcome(matched_blocks, block_size, prompt_tokens, cached_tokens).map(|(j, _)| j)
}

/// [`judge`], with the judgement an outcome report is made of.
fn judge_with_outcome(
    matched_blocks: u64,
    block_size: BlockSize,
    prompt_tokens: u64,
    cached_tokens: u64,
) -> Option<(Judged, kvroute_core::usage::Judged)> {
    if prompt_tokens == 0 {
        return None;
    }
    let usage = kvroute_core::usage::Usage {
        hit_tokens: cached_tokens,
        miss_tokens: prompt_tokens.saturating_sub(cached_tokens),
    };
    let bs = u32::try_from(block_size.get()).unwrap_or(u32::MAX);
    let j = kvroute_core::usage::judge_blocks(matched_blocks, bs, &usage)?;
    let mine = Judged {
        matched_blocks,
        predicted_tokens: j.predicted_tokens,
        verdict: j.verdict,
    };
    Some((mine, j))
}

/// The inventory endpoint the kvroute strategies ask.
#[derive(Clone, Debug)]
pub struct Inventory {
    /// Base URL.
    pub url: String,
    /// Rule id or `VIP:port`.
    pub rule: String,
    /// Contract the keys are computed with.
    pub contract: HashContract,
}

/// Everything a strategy needs to choose.
pub struct Router {
    /// The strategy.
    pub strategy: Strategy,
    /// Simulator base URLs (index = endpoint).
    pub sims: Vec<String>,
    by_addr: HashMap<String, usize>,
    rr: AtomicUsize,
    /// For the kvroute strategies.
    pub inventory: Option<Inventory>,
    /// Gateway base URLs.
    pub gateways: Vec<String>,
    /// The sglang-router base URL.
    pub proxy: Option<String>,
    /// Tokenizer shared with the simulators.
    pub encoder: Arc<Encoder>,
    /// The API the requests are sent in.
    pub api: Api,
    /// The simulators' block size, which the predictions are judged in.
    pub block_size: BlockSize,
    /// Judged predictions per endpoint (`ip:port`) since the last outcome report (kvroute
    /// strategies).
    outcomes: Mutex<BTreeMap<String, EndpointOutcomes>>,
    http: reqwest::Client,
}

/// The API a workload's requests are sent in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    OpenAi,
    /// `POST /v1/messages`: the system prompt as a block with a `cache_control` breakpoint,
    /// turns as text blocks, usage from Anthropic's `message_delta` event.
    Anthropic,
}

impl Api {
    /// The flag value.
    pub fn parse(s: &str) -> Option<Api> {
        match s {
            "openai" => Some(Api::OpenAi),
            "anthropic" => Some(Api::Anthropic),
            _ => None,
        }
    }

    /// The flag value and report label.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::OpenAi => "openai",
            Api::Anthropic => "anthropic",
        }
    }

    fn endpoint(self) -> Endpoint {
        match self {
            Api::OpenAi => Endpoint::ChatCompletions,
            Api::Anthropic => Endpoint::Messages,
        }
    }

    /// A turn's request body: the system prompt, the conversation so far (`(role, text)`,
    /// the last one the user's).
    fn body(
        self,
        model: &str,
        system: &str,
        turns: &[(&str, String)],
        max_tokens: usize,
        tenant: &str,
    ) -> Value {
        match self {
            Api::OpenAi => {
                let mut messages = vec![json!({"role": "system", "content": system})];
                messages.extend(turns.iter().map(|(r, t)| json!({"role": r, "content": t})));
                json!({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": true,
                       "stream_options": {"include_usage": true}, "user": tenant})
            }
            Api::Anthropic => {
                let messages: Vec<Value> = turns
                    .iter()
                    .map(|(r, t)| json!({"role": r, "content": [{"type": "text", "text": t}]}))
                    .collect();
                json!({"model": model, "max_tokens": max_tokens, "stream": true, "metadata": {"user_id": tenant},
                       "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                       "messages": messages})
            }
        }
    }
}

/// A choice.
struct Pick {
    url: String,
    route: Option<Duration>,
    reason: Option<String>,
    /// Leading blocks of the request the strategy expects the chosen engine to hold.
    matched_blocks: Option<u64>,
}

/// Jump consistent hash (Lamping and Veach, 2014): bucket of `key` among `n`.
pub fn jump_hash(mut key: u64, n: usize) -> usize {
    let (mut b, mut j) = (-1i64, 0i64);
    while j < n as i64 {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = (((b + 1) as f64) * ((1u64 << 31) as f64 / (((key >> 33) + 1) as f64))) as i64;
    }
    b.max(0) as usize
}

impl Router {
    /// A router over `sims`.
    pub fn new(
        strategy: Strategy,
        sims: Vec<String>,
        encoder: Arc<Encoder>,
        block_size: BlockSize,
    ) -> anyhow::Result<Self> {
        if sims.is_empty() && strategy != Strategy::Gateway {
            bail!(
                "strategy {} needs at least one simulator",
                strategy.as_str()
            );
        }
        let by_addr = sims
            .iter()
            .enumerate()
            .map(|(i, u)| (u.trim_start_matches("http://").to_string(), i))
            .collect();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .tcp_nodelay(true)
            .build()?;
        Ok(Router {
            strategy,
            sims,
            by_addr,
            rr: AtomicUsize::new(0),
            inventory: None,
            gateways: Vec::new(),
            proxy: None,
            encoder,
            api: Api::OpenAi,
            block_size,
            outcomes: Mutex::default(),
            http,
        })
    }

    /// Adds one judged response of the simulator at `url` to the next outcome report.
    fn note_outcome(&self, url: &str, j: &kvroute_core::usage::Judged) {
        if self.inventory.is_none() {
            return;
        }
        let ep = url.trim_start_matches("http://");
        let o = kvroute_core::usage::outcome_of(ep, j);
        if let Ok(mut m) = self.outcomes.lock() {
            m.entry(o.endpoint.clone())
                .and_modify(|sum| sum.add(&o))
                .or_insert(o);
        }
    }

    /// Sends the outcomes judged since the last report to the inventory, as the filter does
    /// every `report_ms`; a report that fails is added back for the next one.
    async fn report_outcomes(&self) {
        let Some(inv) = &self.inventory else { return };
        let taken = match self.outcomes.lock() {
            Ok(mut m) if !m.is_empty() => std::mem::take(&mut *m),
            _ => return,
        };
        let report = OutcomeReport {
            endpoints: taken.values().cloned().collect(),
            tenants: Vec::new(),
        };
        let sent = self
            .http
            .post(format!("{}/v1/rules/{}/outcomes", inv.url, inv.rule))
            .json(&report)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status);
        if let Err(e) = sent {
            eprintln!("outcome report to the inventory failed (kept for the next): {e}");
            if let Ok(mut m) = self.outcomes.lock() {
                for (k, o) in taken {
                    m.entry(k).and_modify(|sum| sum.add(&o)).or_insert(o);
                }
            }
        }
    }

    fn next_rr(&self, n: usize) -> usize {
        self.rr.fetch_add(1, Ordering::Relaxed) % n.max(1)
    }

    async fn pick(&self, body: &Value, tenant: &str, group: usize) -> anyhow::Result<Pick> {
        let n = self.sims.len();
        let simple = |i: usize| Pick {
            url: self.sims[i].clone(),
            route: None,
            reason: None,
            matched_blocks: None,
        };
        match self.strategy {
            Strategy::RoundRobin => Ok(simple(self.next_rr(n))),
            Strategy::Sticky => Ok(simple(jump_hash(
                xxhash_rust::xxh3::xxh3_64(tenant.as_bytes()),
                n,
            ))),
            Strategy::Partition => Ok(simple(group % n)),
            Strategy::Gateway => {
                if self.gateways.is_empty() {
                    bail!("strategy gateway needs --gateway URL");
                }
                Ok(Pick {
                    url: self.gateways[self.next_rr(self.gateways.len())].clone(),
                    route: None,
                    reason: None,
                    matched_blocks: None,
                })
            }
            Strategy::SglangRouter => Ok(Pick {
                url: self
                    .proxy
                    .clone()
                    .ok_or_else(|| anyhow!("strategy sglang-router needs a running router"))?,
                route: None,
                reason: None,
                matched_blocks: None,
            }),
            Strategy::Oracle => {
                let t = Instant::now();
                let asks = self.sims.iter().map(|u| {
                    let req = self
                        .http
                        .post(format!("{u}/debug/cache/match?api={}", self.api.as_str()))
                        .json(body)
                        .send();
                    async move { req.await.ok()?.json::<Value>().await.ok() }
                });
                let answers = futures::future::join_all(asks).await;
                let start = self.next_rr(n);
                let mut best: Option<(u64, u64, usize)> = None;
                for k in 0..n {
                    let i = (start + k) % n;
                    let Some(a) = &answers[i] else { continue };
                    // The prefix held in either tier (the CPU tier's is loaded on admission).
                    let m = a["matched_blocks"].as_u64().unwrap_or(0)
                        + a["cpu_matched_blocks"].as_u64().unwrap_or(0);
                    let load =
                        a["running"].as_u64().unwrap_or(0) + a["waiting"].as_u64().unwrap_or(0);
                    if best.is_none_or(|(bm, bl, _)| m > bm || (m == bm && load < bl)) {
                        best = Some((m, load, i));
                    }
                }
                let i = best.map(|b| b.2).unwrap_or(start);
                Ok(Pick {
                    url: self.sims[i].clone(),
                    route: Some(t.elapsed()),
                    reason: None,
                    // No simulator answered (e.g. real engines): no prediction.
                    matched_blocks: best.map(|b| b.0),
                })
            }
            Strategy::KvrouteEngine | Strategy::KvrouteTokens => {
                let inv = self
                    .inventory
                    .as_ref()
                    .ok_or_else(|| anyhow!("kvroute strategies need the inventory"))?;
                let t = Instant::now();
                let bytes = serde_json::to_vec(body)?;
                let enc = self.encoder.clone();
                let contract = inv.contract.clone();
                let endpoint = self.api.endpoint();
                let (keys, count) =
                    tokio::task::spawn_blocking(move || -> anyhow::Result<(Vec<u64>, usize)> {
                        let e = enc.encode(&bytes, endpoint)?;
                        let extra = ExtraKeys {
                            cache_salt: e.cache_salt.clone(),
                            ..Default::default()
                        };
                        Ok((
                            contract
                                .keys(&e.tokens, &extra)?
                                .into_iter()
                                .map(|k| k.0)
                                .collect(),
                            e.tokens.len(),
                        ))
                    })
                    .await??;
                let req = json!({"rule": inv.rule, "model": body.get("model"), "keys": keys, "token_count": count, "affinity_key": tenant});
                let ans = self
                    .http
                    .post(format!("{}/v1/route", inv.url))
                    .json(&req)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                let route = t.elapsed();
                let parsed = match ans {
                    Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
                    _ => None,
                };
                // Fail open as the filter does: no answer means plain round robin, and an
                // endpoint that is not a simulator of the fleet has nothing to predict.
                let (i, reason, matched_blocks) = match parsed {
                    Some(v) => {
                        let ep = v["endpoint"].as_str().unwrap_or("");
                        let reason = v["reason"].as_str().unwrap_or("").to_string();
                        match self.by_addr.get(ep) {
                            Some(&i) => (i, reason, v["matched_blocks"].as_u64()),
                            None => (self.next_rr(n), reason, None),
                        }
                    }
                    None => (self.next_rr(n), "fail_open".to_string(), None),
                };
                Ok(Pick {
                    url: self.sims[i].clone(),
                    route: Some(route),
                    reason: Some(reason),
                    matched_blocks,
                })
            }
        }
    }
}

/// What one streamed response reported.
struct Outcome {
    served_by: Option<String>,
    /// The filter's matched blocks, echoed by the simulator ([`MATCHED_HEADER`]).
    matched_blocks: Option<u64>,
    content: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft: Duration,
}

async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    request_id: &str,
    api: Api,
) -> anyhow::Result<Outcome> {
    let t = Instant::now();
    let mut resp = http
        .post(format!("{url}{}", api.endpoint().path()))
        .header("x-request-id", request_id)
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await?;
    let status = resp.status();
    let served_by = resp
        .headers()
        .get(SIM_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!(
            "{url}: HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        );
    }
    let mut buf = String::new();
    let matched_blocks = resp
        .headers()
        .get(MATCHED_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut out = Outcome {
        served_by,
        matched_blocks,
        content: String::new(),
        prompt_tokens: 0,
        cached_tokens: 0,
        ttft: Duration::ZERO,
    };
    let mut first = None;
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            // Anthropic's events put an `event:` line before their data.
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            if out.served_by.is_none() {
                out.served_by = v["system_fingerprint"].as_str().map(str::to_string);
            }
            let text = v["choices"][0]["delta"]["content"]
                .as_str()
                .or_else(|| v["delta"]["text"].as_str());
            if let Some(c) = text {
                if !c.is_empty() && first.is_none() {
                    first = Some(t.elapsed());
                }
                out.content.push_str(c);
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                if let Some(uncached) = u["input_tokens"].as_u64() {
                    // Anthropic: input_tokens are the uncached ones.
                    out.cached_tokens = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
                    out.prompt_tokens = uncached + out.cached_tokens;
                } else {
                    out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                }
            }
        }
    }
    out.ttft = first.unwrap_or_else(|| t.elapsed());
    Ok(out)
}

/// The prefix of every request id the driver sends; [`attribute_from_logs`] looks for it.
const REQUEST_ID_PREFIX: &str = "kvb-";

/// A request id unique to this process, run and request: `kvb-<pid>x<run>x<session>x<turn>`.
/// Digits and `x` only, so it ends where an engine appends its own suffix or punctuation.
pub fn request_id(run: u64, session: usize, turn: usize) -> String {
    format!(
        "{REQUEST_ID_PREFIX}{}x{run}x{session}x{turn}",
        std::process::id()
    )
}

/// Request ids found in `log` (every `kvb-<digits and x>` token), each once.
pub fn request_ids_in(log: &str) -> std::collections::HashSet<&str> {
    let mut out = std::collections::HashSet::new();
    let mut rest = log;
    while let Some(at) = rest.find(REQUEST_ID_PREFIX) {
        let tail = &rest[at..];
        let len = REQUEST_ID_PREFIX.len()
            + tail[REQUEST_ID_PREFIX.len()..]
                .bytes()
                .take_while(|b| b.is_ascii_digit() || *b == b'x')
                .count();
        if len > REQUEST_ID_PREFIX.len() {
            out.insert(&tail[..len]);
        }
        rest = &tail[len..];
    }
    out
}

/// Sets every record's `served_by` from the engines' request logs: `logs[i]` is the text of the
/// log of the engine named `names[i]` (vLLM's `--enable-log-requests` logs every request id it
/// receives). The logs decide, over any name the response carried (vLLM's `system_fingerprint`
/// names its version, the same on every engine); a request id found in no log or in two is
/// left unattributed.
pub fn attribute_from_logs(records: &mut [Record], names: &[String], logs: &[String]) {
    let mut owner: HashMap<&str, Option<usize>> = HashMap::new();
    for (i, log) in logs.iter().enumerate() {
        // Each log yields an id once, so an id already present came from another log.
        for id in request_ids_in(log) {
            owner.entry(id).and_modify(|o| *o = None).or_insert(Some(i));
        }
    }
    for r in records.iter_mut() {
        r.served_by = match owner.get(r.request_id.as_str()) {
            Some(Some(i)) => names.get(*i).cloned(),
            _ => None,
        };
    }
}

/// Runs every session through `router`, at most `concurrency` requests in flight. `run_seq`
/// makes the request ids of this run differ from every other run of the process.
pub async fn run(
    router: Arc<Router>,
    sessions: Vec<Session>,
    shape: &Shape,
    model: &str,
    concurrency: usize,
    run_seq: u64,
) -> (Vec<Record>, Duration) {
    let sem = Arc::new(Semaphore::new(concurrency.max(1)));
    let records = Arc::new(Mutex::new(Vec::new()));
    let t0 = tokio::time::Instant::now();
    let started = Instant::now();
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let reporter = router.inventory.is_some().then(|| {
        let router = router.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(REPORT_EVERY) => {}
                }
                router.report_outcomes().await;
            }
        })
    });
    let mut tasks = Vec::with_capacity(sessions.len());
    for (idx, s) in sessions.into_iter().enumerate() {
        let (router, sem, records) = (router.clone(), sem.clone(), records.clone());
        let (model, max_tokens) = (model.to_string(), shape.max_tokens);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(t0 + s.start).await;
            let mut history: Vec<(&str, String)> = Vec::new();
            for (turn, text) in s.turns.iter().enumerate() {
                history.push(("user", text.clone()));
                let body = router
                    .api
                    .body(&model, &s.system, &history, max_tokens, &s.tenant);
                let Ok(permit) = sem.acquire().await else {
                    return;
                };
                let t = Instant::now();
                let mut rec = Record {
                    session: idx,
                    group: s.group,
                    turn,
                    request_id: request_id(run_seq, idx, turn),
                    served_by: None,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    ttft_ms: 0.0,
                    latency_ms: 0.0,
                    route_ms: None,
                    reason: None,
                    prediction: None,
                    error: None,
                };
                let mut matched_blocks = None;
                let mut url = String::new();
                let result = match router.pick(&body, &s.tenant, s.group).await {
                    Ok(p) => {
                        rec.route_ms = p.route.map(|d| d.as_secs_f64() * 1e3);
                        rec.reason = p.reason;
                        matched_blocks = p.matched_blocks;
                        url = p.url;
                        send(&router.http, &url, &body, &rec.request_id, router.api).await
                    }
                    Err(e) => Err(e),
                };
                drop(permit);
                rec.latency_ms = t.elapsed().as_secs_f64() * 1e3;
                match result {
                    Ok(o) => {
                        rec.served_by = o.served_by;
                        rec.prompt_tokens = o.prompt_tokens;
                        rec.cached_tokens = o.cached_tokens;
                        if router.strategy == Strategy::Gateway {
                            matched_blocks = o.matched_blocks;
                        }
                        let judged = matched_blocks.and_then(|m| {
                            judge_with_outcome(
                                m,
                                router.block_size,
                                o.prompt_tokens,
                                o.cached_tokens,
                            )
                        });
                        if let Some((mine, j)) = judged {
                            rec.prediction = Some(mine);
                            router.note_outcome(&url, &j);
                        }
                        rec.ttft_ms = (o.ttft.as_secs_f64() * 1e3) + rec.route_ms.unwrap_or(0.0);
                        history.push(("assistant", o.content));
                    }
                    Err(e) => {
                        rec.error = Some(e.to_string());
                        history.push(("assistant", String::new()));
                    }
                }
                if let Ok(mut r) = records.lock() {
                    r.push(rec);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed();
    let _ = stop.send(());
    if let Some(r) = reporter {
        let _ = r.await;
    }
    router.report_outcomes().await;
    let recs = records.lock().map(|r| r.clone()).unwrap_or_default();
    (recs, elapsed)
}

/// The contract the kvroute strategy hashes with.
pub fn contract_for(strategy: Strategy, engine: HashContract) -> HashContract {
    match strategy {
        Strategy::KvrouteTokens => HashContract::new(HashAlgo::Tokens, engine.block_size),
        _ => engine,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn request_ids_are_found_in_engine_logs_and_attribute_records() {
        let a = request_id(3, 1, 0);
        let b = request_id(3, 2, 1);
        let c = request_id(3, 4, 2);
        assert_ne!(a, request_id(4, 1, 0), "runs differ");
        // vLLM's line, an id followed by an engine suffix, and an id logged by both engines.
        let log0 =
            format!("INFO Received request chatcmpl-{a}: params: ...\nrequest {c}-9f3e done\n");
        let log1 = format!("INFO Received request chatcmpl-{b}: params\n{c}\nkvb- kvb-x");
        assert_eq!(request_ids_in(&log0).len(), 2);
        assert!(request_ids_in(&log1).contains(b.as_str()));
        let rec = |id: &str, by: Option<&str>| Record {
            session: 0,
            group: 0,
            turn: 0,
            request_id: id.into(),
            served_by: by.map(str::to_string),
            prompt_tokens: 0,
            cached_tokens: 0,
            ttft_ms: 0.0,
            latency_ms: 0.0,
            route_ms: None,
            reason: None,
            prediction: None,
            error: None,
        };
        let mut records = vec![
            rec(&a, None),
            rec(&b, Some("vllm-0.28.0-e74e3128")),
            rec(&c, Some("vllm-0.28.0-e74e3128")),
            rec(&a, Some("vllm-0.28.0-e74e3128")),
        ];
        let names = vec!["e0".to_string(), "e1".to_string()];
        attribute_from_logs(&mut records, &names, &[log0, log1]);
        let by: Vec<_> = records.iter().map(|r| r.served_by.as_deref()).collect();
        assert_eq!(by, [Some("e0"), Some("e1"), None, Some("e0")]);
    }

    #[test]
    fn predictions_are_judged_in_whole_blocks_before_the_last_token() {
        let bs = BlockSize::new(16).unwrap();
        let verdict = |m, p, c| judge(m, bs, p, c).map(|j| (j.predicted_tokens, j.verdict));
        // 4 blocks predicted, a 100-token prompt (6 full blocks before the last token).
        assert_eq!(verdict(4, 100, 64), Some((64, Verdict::Exact)));
        assert_eq!(verdict(4, 100, 48), Some((64, Verdict::Over)));
        assert_eq!(verdict(4, 100, 80), Some((64, Verdict::Under)));
        // A partial block the engine reports is not a block reused.
        assert_eq!(verdict(4, 100, 79), Some((64, Verdict::Exact)));
        // A prompt of exactly 4 blocks: the last token is computed, so 3 blocks at most.
        assert_eq!(verdict(4, 64, 48), Some((48, Verdict::Exact)));
        assert_eq!(verdict(4, 65, 64), Some((64, Verdict::Exact)));
        assert_eq!(verdict(9, 1, 0), Some((0, Verdict::Exact)));
        assert_eq!(verdict(0, 100, 16), Some((0, Verdict::Under)));
        // No usage, nothing to judge.
        assert_eq!(verdict(4, 0, 0), None);
        assert_eq!(judge(5, bs, 100, 64).map(|j| j.matched_blocks), Some(5));
    }

    #[test]
    fn jump_hash_is_stable_and_spread() {
        assert_eq!(jump_hash(42, 1), 0);
        let mut counts = [0usize; 4];
        for k in 0..4000u64 {
            counts[jump_hash(xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes()), 4)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
        // Growing the pool moves only the keys that go to the new bucket.
        let moved = (0..1000u64).filter(|k| {
            let h = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            let (a, b) = (jump_hash(h, 4), jump_hash(h, 5));
            a != b && b != 4
        });
        assert_eq!(moved.count(), 0);
    }
}
