//! The workload generator and driver behind `kvroute-bench`.
//!
//! For every endpoint count, workload and strategy the driver starts a fresh fleet of simulators
//! (or resets the caches of `--sims` it was given), starts the inventory service for the kvroute
//! strategies (in-memory, rule generated for the fleet), drives the sessions and summarises the
//! run. Output: a markdown table on stdout (and `--markdown`), every summary in `--json`.
//!
//! Presets: `small` runs all four workloads x five strategies on 4 endpoints in about a minute;
//! `full` is the large fleet's sizes (200 users x 5 turns over 10 system prompts of ~1000 words);
//! `constrained`: 2 endpoints of 256 blocks, 40 users x 4 turns over 10 system
//! prompts of ~600 tokens (the aggregate cache holds between 1x and 2x the shared prefixes).

pub mod driver;
pub mod fleet;
pub mod plot;
pub mod progress;
pub mod report;
pub mod sglang;
pub mod signals;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use kvroute_core::hash::{BlockSize, Engine as EngineKind, HashContract};
use serde_json::json;

use crate::prompt::Encoder;
use driver::{contract_for, Inventory, Router, Strategy};
use fleet::{Fleet, Proc, SimSpec};
use report::Summary;
use workload::{Arrival, Kind, Shape};

/// Flags of `kvroute-bench`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvroute-bench",
    about = "Drive workloads through routing strategies over simulated engines and report prefill saved"
)]
pub struct BenchArgs {
    /// small (about a minute), full (200 users x 5 turns) or constrained (2 endpoints x
    /// 256 blocks, 10 system prompts of ~600 tokens, 40 users x 4 turns).
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Comma-separated: multi-turn, doc-qa, one-shot, hot-prefix.
    #[arg(long, default_value = "multi-turn,doc-qa,one-shot,hot-prefix")]
    pub workloads: String,
    /// Comma-separated: round-robin, sticky, partition, kvroute-engine, kvroute-tokens,
    /// sglang-router, gateway, oracle. Default: all but partition, sglang-router and gateway
    /// (gateway when --gateway is given).
    #[arg(long)]
    pub strategies: Option<String>,
    /// Comma-separated endpoint counts (the scale curve), e.g. 4,8,16 (default: 2 for the
    /// constrained preset, else 4).
    #[arg(long)]
    pub endpoints: Option<String>,
    /// Engine the simulators imitate (vllm and sglang use 127.0.0.10+i, one per simulator).
    #[arg(long, default_value = "vllm")]
    pub engine: String,
    /// KV capacity per simulator in blocks (default: per preset, constrained so placement matters).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// vLLM PYTHONHASHSEED given to simulators and inventory.
    #[arg(long, default_value = "0")]
    pub seed: String,
    /// Tokenizer directory for simulators and driver (default: the word tokenizer).
    #[arg(long)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Simulated prefill cost per uncached token, us.
    #[arg(long, default_value_t = 40.0)]
    pub prefill_us: f64,
    /// Simulated decode cost per output token, us.
    #[arg(long, default_value_t = 400.0)]
    pub decode_us: f64,
    /// Simulated cost of every prefill on top of its uncached tokens, us (the simulators'
    /// `--prefill-base-us`).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_base_us: f64,
    /// When the simulators cache a prompt's blocks: prefill-end or schedule (their
    /// `--cache-prompt-at`).
    #[arg(long, default_value = "prefill-end")]
    pub cache_prompt_at: String,
    /// Running requests per simulator.
    #[arg(long, default_value_t = 4)]
    pub sim_concurrency: usize,
    /// Requests in flight across the fleet (default: 4 x endpoints).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// burst or staggered.
    #[arg(long, default_value = "staggered")]
    pub arrival: String,
    /// Staggered arrival spreads session starts over this many ms.
    #[arg(long, default_value_t = 2000)]
    pub ramp_ms: u64,
    /// Override: multi-turn users.
    #[arg(long)]
    pub users: Option<usize>,
    /// Override: turns per user.
    #[arg(long)]
    pub turns: Option<usize>,
    /// Override: shared prefixes (system prompts, documents).
    #[arg(long)]
    pub groups: Option<usize>,
    /// Override: words per shared prefix.
    #[arg(long)]
    pub prefix_words: Option<usize>,
    /// Override: tokens per shared prefix, converted to words with the run's tokenizer (so a
    /// preset keeps its cache pressure under a real tokenizer); wins over --prefix-words.
    #[arg(long)]
    pub prefix_tokens: Option<usize>,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    pub workload_seed: u64,
    /// The simulator binary (default: next to this one).
    #[arg(long)]
    pub sim_bin: Option<PathBuf>,
    /// The inventory binary (default: next to this one).
    #[arg(long)]
    pub inventory_bin: Option<PathBuf>,
    /// Use running simulators (comma-separated base URLs) instead of starting them.
    #[arg(long)]
    pub sims: Option<String>,
    /// Engine request logs, comma-separated, one per `--sims` URL in the same order: requests
    /// whose response names no simulator are attributed to the engine that logged their
    /// `x-request-id` (real vLLM with `--enable-log-requests`).
    #[arg(long)]
    pub engine_logs: Option<String>,
    /// Gateway base URLs (Envoy + filter), comma-separated; enables the gateway strategy.
    #[arg(long)]
    pub gateway: Option<String>,
    /// Python with sglang-router 0.3.2 installed (default: .cache/sglang-router-venv/bin/python
    /// in the current directory or a parent; scripts/bench.sh installs it).
    #[arg(long, env = "KVROUTE_SGLANG_ROUTER_PYTHON")]
    pub sglang_router_python: Option<PathBuf>,
    /// Model name sent in requests.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// The API requests are sent in: openai (`/v1/chat/completions`) or anthropic
    /// (`/v1/messages`, the system prompt as a block with a `cache_control` breakpoint). The
    /// sglang-router strategy needs openai.
    #[arg(long, default_value = "openai")]
    pub api: String,
    /// Write every summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the markdown table here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write every request's record (serving simulator, cached tokens, TTFT, kvroute reason, the
    /// judged prediction) here, as JSON, for analysis (`kvroute-plot ttft` draws its TTFT
    /// distributions).
    #[arg(long)]
    pub records: Option<PathBuf>,
    /// Text put before the progress line on stderr (e.g. a calling script's own runs done).
    #[arg(long)]
    pub progress_label: Option<String>,
    /// The parity canary's interval in the inventory the kvroute strategies start
    /// (`KVROUTE_CANARY_INTERVAL_MS`; 0 = off). It needs `--tokenizer-dir`. Its requests and
    /// blocks load the kvroute runs' simulators, and the report counts its verdicts.
    #[arg(long, default_value_t = 0)]
    pub canary_ms: u64,
    /// The inventory behind `--gateway`: its alarms (canary runs, divergent endpoints) are read
    /// after each gateway run, once the filters' outcome reports hold the run's predictions.
    #[arg(long)]
    pub inventory_url: Option<String>,
    /// vLLM: start every simulator with a CPU (host-memory) KV tier of N blocks
    /// (`kvroute-engine-sim --cpu-blocks N`, vLLM's KV offloading). 0: none.
    #[arg(long, default_value_t = 0)]
    pub cpu_blocks: usize,
    /// An environment variable `K=V` for the inventory the kvroute strategies start
    /// (repeatable; set after the bench's own, so it overrides them), e.g.
    /// `KVROUTE_CPU_TIER_WEIGHT=0`.
    #[arg(long = "inventory-env", value_name = "K=V")]
    pub inventory_env: Vec<String>,
}

/// `--inventory-env` values as (name, value) pairs; each needs a non-empty name and a `=`.
fn inventory_env(raw: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    raw.iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(anyhow!("--inventory-env {kv:?}: give NAME=VALUE")),
        })
        .collect()
}

fn list<T>(s: &str, what: &str, parse: impl Fn(&str) -> Option<T>) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| parse(p.trim()).ok_or_else(|| anyhow!("{what}: unknown value {p:?}")))
        .collect()
}

/// Words of the workload generator per token of `encoder` (measured on generated text), so a
/// preset can ask for a prefix length in tokens whatever the tokenizer.
fn tokens_per_word(encoder: &Encoder) -> f64 {
    let mut rng = workload::Rng::new(7);
    let text = workload::words(&mut rng, 400);
    (encoder.encode_text(&text).len() as f64 / 400.0).max(0.1)
}

fn shape_for(args: &BenchArgs, encoder: &Encoder) -> anyhow::Result<(Shape, usize)> {
    let arrival = match args.arrival.as_str() {
        "burst" => Arrival::Burst,
        "staggered" => Arrival::Staggered,
        other => bail!("--arrival {other:?}: allowed burst, staggered"),
    };
    let (mut shape, kv) = match args.preset.as_str() {
        "small" => (
            Shape {
                users: 48,
                turns: 4,
                groups: 4,
                prefix_words: 800,
                message_words: 24,
                questions: 8,
                requests: 96,
                hot_share: 0.75,
                max_tokens: 16,
                arrival,
                ramp: Duration::from_millis(args.ramp_ms),
            },
            // ~52 blocks per system prompt: one endpoint cannot hold all four, the fleet can.
            96,
        ),
        "full" => (
            Shape {
                users: 200,
                turns: 5,
                groups: 10,
                prefix_words: 1000,
                message_words: 40,
                questions: 20,
                requests: 400,
                hot_share: 0.75,
                max_tokens: 32,
                arrival,
                ramp: Duration::from_millis(args.ramp_ms),
            },
            // ~64 blocks per system prompt, 10 prompts over 4 endpoints: about 3 fit per endpoint.
            256,
        ),
        "constrained" => (
            Shape {
                users: 40,
                turns: 4,
                groups: 10,
                // ~600 tokens per system prompt (~38 blocks of 16) with the run's tokenizer.
                prefix_words: (600.0 / tokens_per_word(encoder)).round() as usize,
                message_words: 24,
                questions: 8,
                requests: 96,
                hot_share: 0.75,
                max_tokens: 16,
                arrival,
                ramp: Duration::from_millis(args.ramp_ms),
            },
            // 10 x ~38 blocks = ~375 blocks of shared prompts over 2 x 256 blocks (1.37x).
            256,
        ),
        other => bail!("--preset {other:?}: allowed small, full, constrained"),
    };
    if let Some(v) = args.users {
        shape.users = v;
    }
    if let Some(v) = args.turns {
        shape.turns = v;
    }
    if let Some(v) = args.groups {
        shape.groups = v;
    }
    if let Some(v) = args.prefix_words {
        shape.prefix_words = v;
    }
    if let Some(t) = args.prefix_tokens {
        shape.prefix_words = ((t as f64 / tokens_per_word(encoder)).round() as usize).max(1);
    }
    Ok((shape, args.kv_blocks.unwrap_or(kv)))
}

/// Waits (bounded) until the inventory holds blocks for every endpoint: proves the event path
/// works before anything is measured. Sends one warm-up request per simulator, then resets them.
async fn warm_up(
    http: &reqwest::Client,
    inv_url: &str,
    rule: &str,
    sims: &[String],
    model: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    for (i, s) in sims.iter().enumerate() {
        let mut tries = 0u32;
        loop {
            tries += 1;
            let body = json!({"model": model, "prompt": format!("warm up {i} {tries} {}", "lorem ipsum dolor ".repeat(20)), "max_tokens": 1});
            http.post(format!("{s}/v1/completions"))
                .json(&body)
                .send()
                .await?
                .error_for_status()?;
            let url = format!(
                "{inv_url}/netlox/v1/config/ai/kv/inventory?service_id={rule}&ep_idx={i}&limit=1"
            );
            let got = match http.get(&url).send().await {
                Ok(r) => r
                    .json::<serde_json::Value>()
                    .await
                    .ok()
                    .and_then(|v| v["total"].as_u64())
                    .unwrap_or(0),
                Err(_) => 0,
            };
            if got > 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "the inventory never saw blocks from {s}: is its event subscription working?"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for s in sims {
        http.post(format!("{s}/reset_prefix_cache?reset_external=true"))
            .send()
            .await?
            .error_for_status()?;
    }
    // The reset's AllBlocksCleared must reach the inventory before measuring: poll until empty.
    for (i, _) in sims.iter().enumerate() {
        loop {
            let url = format!(
                "{inv_url}/netlox/v1/config/ai/kv/inventory?service_id={rule}&ep_idx={i}&limit=1"
            );
            let total = http
                .get(&url)
                .send()
                .await?
                .json::<serde_json::Value>()
                .await?["total"]
                .as_u64()
                .unwrap_or(0);
            if total == 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the inventory did not apply AllBlocksCleared for endpoint {i}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Entry point of `kvroute-bench`.
pub async fn main(args: BenchArgs) -> anyhow::Result<Vec<Summary>> {
    let kinds = list(&args.workloads, "--workloads", Kind::parse)?;
    let strategies = match &args.strategies {
        Some(s) => list(s, "--strategies", Strategy::parse)?,
        None => Strategy::ALL
            .into_iter()
            .filter(|s| *s != Strategy::Gateway || args.gateway.is_some())
            .filter(|s| !matches!(s, Strategy::SglangRouter | Strategy::Partition))
            .collect(),
    };
    let default_endpoints = if args.preset == "constrained" {
        "2"
    } else {
        "4"
    };
    let endpoint_counts = list(
        args.endpoints.as_deref().unwrap_or(default_endpoints),
        "--endpoints",
        |s| s.parse::<usize>().ok().filter(|n| *n > 0),
    )?;
    let api = driver::Api::parse(&args.api)
        .ok_or_else(|| anyhow!("--api {:?}: allowed openai, anthropic", args.api))?;
    if api == driver::Api::Anthropic && strategies.contains(&Strategy::SglangRouter) {
        bail!("--api anthropic: sglang-router serves no /v1/messages; drop it from --strategies");
    }
    // Fail before any run when the peer router is asked for but not installed.
    let sglang_python = if strategies.contains(&Strategy::SglangRouter) {
        let py = sglang::find_python(args.sglang_router_python.as_deref())?;
        sglang::check_version(&py)?;
        Some(py)
    } else {
        None
    };
    let engine = EngineKind::parse(&args.engine).ok_or_else(|| {
        anyhow!(
            "--engine {:?}: allowed vllm, sglang, trtllm, llamacpp",
            args.engine
        )
    })?;
    let block_size =
        BlockSize::new(args.block_size).ok_or_else(|| anyhow!("--block-size must be >= 1"))?;
    if args.cpu_blocks > 0 && engine != EngineKind::Vllm {
        bail!(
            "--cpu-blocks needs --engine vllm (the simulators' CPU tier is vLLM's KV offloading); got --engine {}",
            args.engine
        );
    }
    if args.cpu_blocks > 0 && args.sims.is_some() {
        bail!("--cpu-blocks configures the simulators the bench starts; drop it with --sims");
    }
    let inv_env = inventory_env(&args.inventory_env)?;
    let algo = engine
        .default_algo()
        .unwrap_or(kvroute_core::hash::HashAlgo::Tokens);
    let mut engine_contract = HashContract::new(algo, block_size);
    if engine == EngineKind::Vllm {
        engine_contract.seed = Some(args.seed.clone());
    }
    let encoder = Arc::new(match &args.tokenizer_dir {
        Some(d) => Encoder::load(d)?,
        None => Encoder::Words,
    });
    let (shape, kv_blocks) = shape_for(&args, &encoder)?;
    let sim_bin = match &args.sim_bin {
        Some(p) => p.clone(),
        None => fleet::sibling("kvroute-engine-sim").ok_or_else(|| {
            anyhow!("kvroute-engine-sim not found next to kvroute-bench; pass --sim-bin")
        })?,
    };
    let inventory_bin = args
        .inventory_bin
        .clone()
        .or_else(|| fleet::sibling("kvroute-inventory"));
    let spec = SimSpec {
        bin: sim_bin,
        engine: args.engine.clone(),
        kv_blocks,
        block_size: args.block_size,
        seed: (engine == EngineKind::Vllm).then(|| args.seed.clone()),
        tokenizer_dir: args.tokenizer_dir.clone(),
        prefill_us: args.prefill_us,
        decode_us: args.decode_us,
        prefill_base_us: args.prefill_base_us,
        cache_prompt_at: crate::config::CacheAt::parse(&args.cache_prompt_at)?,
        max_concurrency: args.sim_concurrency,
        cpu_blocks: args.cpu_blocks,
    };
    let given_sims: Option<Vec<String>> = args.sims.as_ref().map(|s| {
        s.split(',')
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .collect()
    });
    let gateways: Vec<String> = args
        .gateway
        .as_ref()
        .map(|s| {
            s.split(',')
                .map(|u| u.trim().trim_end_matches('/').to_string())
                .collect()
        })
        .unwrap_or_default();
    let engine_logs: Vec<PathBuf> = args
        .engine_logs
        .as_ref()
        .map(|s| s.split(',').map(|p| PathBuf::from(p.trim())).collect())
        .unwrap_or_default();
    if !engine_logs.is_empty() && given_sims.as_ref().map(Vec::len) != Some(engine_logs.len()) {
        bail!("--engine-logs: give one log per --sims URL, in the same order");
    }
    let http = reqwest::Client::new();
    let tmp = std::env::temp_dir();
    let mut run_seq = 0u64;

    let mut summaries: Vec<Summary> = Vec::new();
    let mut all_records: Vec<serde_json::Value> = Vec::new();
    let mut md = String::new();
    let cpu_tier = if args.cpu_blocks > 0 {
        format!(" (+ CPU tier {} blocks)", args.cpu_blocks)
    } else {
        String::new()
    };
    let base = if args.prefill_base_us > 0.0 {
        format!("prefill base {} us, ", args.prefill_base_us)
    } else {
        String::new()
    };
    md.push_str(&format!(
        "Command: `kvroute-bench {}`\n\npreset {}, engine {}, block {}, KV {} blocks/endpoint{}, {}prefill {} us/token, decode {} us/token, {} running/endpoint, arrival {}, {} users x {} turns over {} shared prefixes of {} words, tokenizer {}\n\n",
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        args.preset, args.engine, args.block_size, kv_blocks, cpu_tier, base, args.prefill_us, args.decode_us, args.sim_concurrency, args.arrival,
        shape.users, shape.turns, shape.groups, shape.prefix_words,
        args.tokenizer_dir.as_ref().map_or("words".to_string(), |d| d.display().to_string())
    ));
    md.push_str(report::HEADER);
    print!("{md}");
    let mut progress = progress::Progress::new(
        endpoint_counts.len() * kinds.len() * strategies.len(),
        args.progress_label.as_deref(),
    );
    for &n in &endpoint_counts {
        let concurrency = args.concurrency.unwrap_or(4 * n);
        for &kind in &kinds {
            let sessions = workload::generate(kind, &shape, args.workload_seed);
            let mut rr_ratio = None;
            for &strategy in &strategies {
                let what = format!("{} / {}, {n} endpoints", kind.as_str(), strategy.as_str());
                progress.start(&what);
                if strategy.needs_inventory() && inventory_bin.is_none() {
                    progress.clear();
                    eprintln!("skipping {}: kvroute-inventory not found (build it or pass --inventory-bin)", strategy.as_str());
                    progress.finish(&format!("{what} skipped"));
                    continue;
                }
                if strategy == Strategy::Gateway && (gateways.is_empty() || given_sims.is_none()) {
                    progress.clear();
                    eprintln!("skipping gateway: pass --gateway URL and the stack's simulators as --sims URL,...");
                    progress.finish(&format!("{what} skipped"));
                    continue;
                }
                if strategy.needs_inventory() && given_sims.is_some() {
                    progress.clear();
                    eprintln!(
                        "skipping {}: it starts its own inventory and simulators (drop --sims)",
                        strategy.as_str()
                    );
                    progress.finish(&format!("{what} skipped"));
                    continue;
                }
                // A fresh fleet per run: every strategy starts from empty caches.
                let (fleet, urls) = match &given_sims {
                    Some(urls) => {
                        for u in urls {
                            http.post(format!("{u}/reset_prefix_cache?reset_external=true"))
                                .send()
                                .await
                                .with_context(|| format!("reset {u}"))?;
                        }
                        (None, urls.clone())
                    }
                    None => {
                        let f = Fleet::start(&spec, n)?;
                        let urls = f.urls();
                        if spec.cpu_blocks > 0 {
                            fleet::check_cpu_tier(&http, &urls, spec.cpu_blocks).await?;
                        }
                        (Some(f), urls)
                    }
                };
                let mut router = Router::new(strategy, urls.clone(), encoder.clone(), block_size)?;
                router.gateways = gateways.clone();
                router.api = api;
                let mut _peer: Option<sglang::SglangRouter> = None;
                if let (Strategy::SglangRouter, Some(py)) = (strategy, &sglang_python) {
                    let log = tmp.join(format!(
                        "kvroute-bench-sglang-router-{}.log",
                        std::process::id()
                    ));
                    let r = sglang::start(py, &urls, &log).await?;
                    router.proxy = Some(r.url.clone());
                    _peer = Some(r);
                }
                let mut _inventory: Option<Proc> = None;
                if strategy.needs_inventory() {
                    let (Some(bin), Some(f)) = (&inventory_bin, &fleet) else {
                        bail!(
                            "kvroute strategies need simulators started by the bench (not --sims)"
                        );
                    };
                    let key_mode = if strategy == Strategy::KvrouteTokens {
                        "tokens"
                    } else {
                        "engine"
                    };
                    let vip = fleet::free_port("127.0.0.1")?;
                    let mut rules = fleet::rule_json(&spec, f, vip, key_mode);
                    let canary = match (&args.tokenizer_dir, args.canary_ms) {
                        (_, 0) => None,
                        (Some(dir), ms) => {
                            fleet::name_model(&mut rules, &args.model);
                            Some(fleet::Canary {
                                interval_ms: ms,
                                tokenizers: fleet::stage_tokenizer(dir, &args.model, &tmp)?,
                            })
                        }
                        (None, _) => bail!("--canary-ms needs --tokenizer-dir"),
                    };
                    let opts = fleet::InventoryOptions {
                        seed: spec.seed.as_deref(),
                        canary: canary.as_ref(),
                        env: &inv_env,
                    };
                    let inv = fleet::start_inventory(bin, &rules, &opts, &tmp)?;
                    let inv_url = format!("http://{}", inv.addr);
                    let rule = format!("127.0.0.1:{vip}");
                    warm_up(&http, &inv_url, &rule, &urls, &args.model).await?;
                    router.inventory = Some(Inventory {
                        url: inv_url,
                        rule,
                        contract: contract_for(strategy, engine_contract.clone()),
                    });
                    _inventory = Some(inv);
                }
                run_seq += 1;
                let router = Arc::new(router);
                let (mut records, wall) = driver::run(
                    router.clone(),
                    sessions.clone(),
                    &shape,
                    &args.model,
                    concurrency,
                    run_seq,
                )
                .await;
                if !engine_logs.is_empty() {
                    let logs = engine_logs
                        .iter()
                        .map(|p| {
                            std::fs::read(p)
                                .map(|b| String::from_utf8_lossy(&b).into_owned())
                                .with_context(|| format!("--engine-logs: read {}", p.display()))
                        })
                        .collect::<anyhow::Result<Vec<_>>>()?;
                    let names: Vec<String> = urls
                        .iter()
                        .map(|u| u.trim_start_matches("http://").to_string())
                        .collect();
                    driver::attribute_from_logs(&mut records, &names, &logs);
                }
                let mut s =
                    report::summarize(kind.as_str(), strategy.as_str(), urls.len(), &records, wall);
                // The kvroute strategies' last report is in (the driver sent it); a gateway's
                // filters report on their own clock.
                match (&router.inventory, &args.inventory_url) {
                    (Some(inv), _) => s.signals = Some(signals::read(&http, &inv.url).await?),
                    (None, Some(url)) if strategy == Strategy::Gateway => {
                        let judged = s.predictions_judged as u64;
                        s.signals = Some(signals::settled(&http, url, judged).await?);
                    }
                    _ => {}
                }
                if strategy == Strategy::RoundRobin {
                    rr_ratio = Some(s.cached_ratio);
                }
                progress.clear();
                if s.errors > 0 {
                    if let Some(e) = records.iter().find_map(|r| r.error.as_ref()) {
                        eprintln!(
                            "{} / {}: {} errors, first: {e}",
                            kind.as_str(),
                            strategy.as_str(),
                            s.errors
                        );
                    }
                }
                if args.records.is_some() {
                    all_records.push(
                        json!({"workload": kind.as_str(), "strategy": strategy.as_str(),
                        "endpoints": urls.len(), "records": records}),
                    );
                }
                let line = report::row(&s, rr_ratio);
                print!("{line}");
                md.push_str(&line);
                summaries.push(s);
                progress.finish(&what);
                drop(_peer);
                drop(_inventory);
                drop(fleet);
            }
        }
    }
    progress.end();
    if let Some(p) = &args.json {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(
                &json!({"shape": shape, "kv_blocks": kv_blocks, "cpu_blocks": args.cpu_blocks,
                        "summaries": summaries}),
            )?,
        )?;
    }
    if let Some(p) = &args.records {
        std::fs::write(p, serde_json::to_vec(&all_records)?)?;
    }
    if let Some(p) = &args.markdown {
        std::fs::write(p, &md)?;
    }
    Ok(summaries)
}
