//! `kvroutectl`: loxicmd's verbs and flags for kvroute-inventory's management API, plus the
//! kvroute-only verbs (`get kv-inventory`, `health`, `hash`, `explain`). Reference: docs/kvroutectl.md.
//!
//! Exit codes: 0 ok, 1 the server refused or did not find it, 2 usage (bad flag or value, checked
//! locally against kvroute-core's rule model before anything is sent), 3 connection failed.
//! Every error is one line on stderr.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvroute_core::hash::{BlockSize, HashAlgo, HashContract};
use kvroute_core::rule::{RawEndpoint, RawRule, RawServiceArguments, Rule};
use kvroute_core::settings::{Settings, NONE_HASH_SEED_VAR};
use kvroute_core::wire::{RouteRequest, RuleContract, WireKey};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(
    name = "kvroutectl",
    version,
    about = "loxicmd-style CLI for kvroute-inventory"
)]
struct Cli {
    /// Base URL of kvroute-inventory.
    #[arg(
        long,
        env = "KVROUTE_SERVER",
        default_value = "http://127.0.0.1:8090",
        global = true
    )]
    server: String,
    /// File holding the bearer token for writes (else env KVROUTE_TOKEN).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table", global = true)]
    output: Output,
    /// Request timeout in seconds.
    #[arg(long, default_value_t = 10, global = true)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a rule.
    Create {
        #[command(subcommand)]
        what: Create,
    },
    /// Show rules or an endpoint's inventory.
    Get {
        #[command(subcommand)]
        what: Get,
    },
    /// Delete a rule.
    Delete {
        #[command(subcommand)]
        what: Delete,
    },
    /// Per-endpoint health: subscriber connected, blocks held, parity verdict.
    Health,
    /// The parity preflight: the flags of `kvroute-inventory hash`, run by the same code.
    Hash {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Why a prompt would route where it would (no state is changed on the server).
    Explain(ExplainArgs),
}

#[derive(Subcommand)]
enum Create {
    /// loxicmd `create lb IP --tcp=PORT:TARGETPORT --endpoints=IP:WEIGHT,...`.
    Lb(Box<CreateLb>),
}

#[derive(Subcommand)]
enum Get {
    /// All rules.
    Lb,
    /// One endpoint's blocks, every page.
    KvInventory {
        /// Rule id or VIP:port.
        #[arg(long)]
        service_id: String,
        /// Endpoint index from 0.
        #[arg(long)]
        ep_idx: String,
        /// Blocks per page.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
}

#[derive(Subcommand)]
enum Delete {
    /// loxicmd `delete lb IP --tcp=PORT[,PORT...]`.
    Lb {
        vip: String,
        /// Ports (`PORT` or `PORT:TARGETPORT`), comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        tcp: Vec<String>,
    },
}

#[derive(Args)]
struct CreateLb {
    /// The VIP (loxilb externalIP).
    vip: String,
    /// PORT:TARGETPORT, comma-separated (one rule per pair, as loxicmd does).
    #[arg(long, value_delimiter = ',', required = true)]
    tcp: Vec<String>,
    /// IP:WEIGHT, comma-separated (IPv6: the weight follows the last colon).
    #[arg(long, value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    /// onearm | fullnat | dsr | fullproxy | hostonearm | default (fullproxy when --kv-exact-mode is not 0).
    #[arg(long)]
    mode: Option<String>,
    /// rr | hash | priority | persist | lc.
    #[arg(long)]
    select: Option<String>,
    /// Service name.
    #[arg(long)]
    name: Option<String>,
    /// Secondary IPs, comma-separated.
    #[arg(long, value_delimiter = ',')]
    secips: Vec<String>,
    /// Allowed source prefixes (CIDR), comma-separated.
    #[arg(long, value_delimiter = ',')]
    allowedsources: Vec<String>,
    /// Per endpoint, in --endpoints order: none | prefill | decode.
    #[arg(long, value_delimiter = ',')]
    ep_roles: Vec<String>,
    /// Per endpoint, in --endpoints order: KV capacity in blocks (empty: the engine's).
    #[arg(long, value_delimiter = ',')]
    kv_capacity_blocks: Vec<String>,
    /// Per endpoint, in --endpoints order: the KV event address tcp://IP:PORT (empty: the
    /// endpoint's IP at --kv-zmq-port).
    #[arg(long, value_delimiter = ',')]
    kv_zmq_endpoints: Vec<String>,
    /// kvExactMode: 0 | 1 | 3.
    #[arg(long)]
    kv_exact_mode: Option<String>,
    /// kvEngineType: vllm | sglang | trtllm | llamacpp.
    #[arg(long)]
    kv_engine_type: Option<String>,
    /// kvBlockSize.
    #[arg(long)]
    kv_block_size: Option<String>,
    /// kvHashAlgo.
    #[arg(long)]
    kv_hash_algo: Option<String>,
    /// kvZmqPort.
    #[arg(long)]
    kv_zmq_port: Option<String>,
    /// kvWarmupSec.
    #[arg(long)]
    kv_warmup_sec: Option<String>,
    /// kvDpRankCount.
    #[arg(long)]
    kv_dp_ranks: Option<String>,
    /// kvKeyMode: engine | tokens.
    #[arg(long)]
    kv_key_mode: Option<String>,
    /// kvModel.
    #[arg(long)]
    kv_model: Option<String>,
    /// kvVllmExtraKeys: tagged (vLLM 0.31 and later) | flat (before 0.31).
    #[arg(long)]
    kv_vllm_extra_keys: Option<String>,
    /// kvReplayPort.
    #[arg(long)]
    kv_replay_port: Option<String>,
    /// kvZmqBind: the inventory binds each endpoint's kvZmqEndpoint and the engines connect.
    #[arg(long)]
    kv_zmq_bind: bool,
}

#[derive(Args)]
struct ExplainArgs {
    /// Rule id or VIP:port.
    #[arg(long)]
    rule: String,
    /// The prompt (completions `prompt`).
    #[arg(long, conflicts_with = "messages")]
    prompt: Option<String>,
    /// A JSON file holding chat `messages`.
    #[arg(long)]
    messages: Option<PathBuf>,
    /// Directory with tokenizer.json and tokenizer_config.json.
    #[arg(long, env = "KVROUTE_TOKENIZER_DIR")]
    tokenizer: PathBuf,
    /// Model name sent with the request (default: the rule's kvModel).
    #[arg(long)]
    model: Option<String>,
    /// Affinity key (tenant) for sticky fallback.
    #[arg(long)]
    affinity_key: Option<String>,
    /// Conversation id, as a client sends it in `x-conversation-id` (the session tier).
    #[arg(long)]
    session: Option<String>,
    /// Tokens routed on at most (the filter's max_prefix_tokens).
    #[arg(long, default_value_t = kvroute_core::bpe::MAX_PREFIX_TOKENS)]
    max_prefix_tokens: usize,
}

/// A failure and its exit code.
enum Fail {
    /// 1: the server refused or did not find it.
    Refused(String),
    /// 2: bad usage, found before sending.
    Usage(String),
    /// 3: the server could not be reached.
    Connect(String),
}

impl Fail {
    fn code(&self) -> u8 {
        match self {
            Fail::Refused(_) => 1,
            Fail::Usage(_) => 2,
            Fail::Connect(_) => 3,
        }
    }
    fn message(&self) -> &str {
        match self {
            Fail::Refused(m) | Fail::Usage(m) | Fail::Connect(m) => m,
        }
    }
}

type Res<T> = Result<T, Fail>;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    // `hash` takes exactly `kvroute-inventory hash`'s flags, parsed by its own code.
    if let Some(i) = argv.iter().position(|a| a == "hash") {
        if argv[1..i].iter().all(|a| a.starts_with('-')) {
            let code = kvroute_inventory::preflight::run(argv[i + 1..].to_vec());
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                print!("{e}");
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                eprint!("{e}");
                return ExitCode::from(2);
            }
            eprintln!("kvroutectl: {}", one_line(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    if let Cmd::Hash { args } = cli.cmd {
        let code = kvroute_inventory::preflight::run(args);
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("kvroutectl: {}", f.message());
            ExitCode::from(f.code())
        }
    }
}

/// clap's multi-line error as one line (without the usage and help hints).
fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join(" ")
}

fn run(cli: Cli) -> Res<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Fail::Connect(format!("runtime: {e}")))?;
    let api = Api::new(&cli)?;
    match cli.cmd {
        Cmd::Create {
            what: Create::Lb(lb),
        } => {
            let rules = build_rules(&lb)?;
            let token = api.token()?;
            for r in rules {
                let body =
                    serde_json::to_value(&r).map_err(|e| Fail::Usage(format!("rule JSON: {e}")))?;
                let v = rt.block_on(api.send(
                    reqwest::Method::POST,
                    "/netlox/v1/config/loadbalancer",
                    Some(body),
                    Some(&token),
                ))?;
                print_result(cli.output, &v);
            }
            Ok(())
        }
        Cmd::Get { what: Get::Lb } => {
            let v = rt.block_on(api.send(
                reqwest::Method::GET,
                "/netlox/v1/config/loadbalancer/all",
                None,
                None,
            ))?;
            match cli.output {
                Output::Json => println!("{}", pretty(&v)),
                Output::Table => print!("{}", lb_table(&v)),
            }
            Ok(())
        }
        Cmd::Get {
            what:
                Get::KvInventory {
                    service_id,
                    ep_idx,
                    limit,
                },
        } => rt.block_on(kv_inventory(&api, cli.output, &service_id, &ep_idx, limit)),
        Cmd::Delete {
            what: Delete::Lb { vip, tcp },
        } => {
            let ip: std::net::IpAddr = vip
                .parse()
                .map_err(|_| Fail::Usage(format!("VIP: got {vip:?}, allowed an IP address")))?;
            let token = api.token()?;
            for p in &tcp {
                let port = p.split(':').next().unwrap_or(p);
                let port: u16 = port.parse().map_err(|_| {
                    Fail::Usage(format!("--tcp: got {p:?}, allowed PORT (1-65535)"))
                })?;
                let path = format!(
                    "/netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/tcp"
                );
                let v =
                    rt.block_on(api.send(reqwest::Method::DELETE, &path, None, Some(&token)))?;
                print_result(cli.output, &v);
            }
            Ok(())
        }
        Cmd::Health => {
            let v = rt.block_on(api.send(reqwest::Method::GET, "/healthz", None, None))?;
            match cli.output {
                Output::Json => println!("{}", pretty(&v)),
                Output::Table => print!("{}", health_table(&v)),
            }
            Ok(())
        }
        Cmd::Hash { .. } => Ok(()),
        Cmd::Explain(a) => rt.block_on(explain(&api, cli.output, &a)),
    }
}

/// The HTTP side.
struct Api {
    base: String,
    http: reqwest::Client,
    token_file: Option<PathBuf>,
}

impl Api {
    fn new(cli: &Cli) -> Res<Api> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(cli.timeout.max(1)))
            .build()
            .map_err(|e| Fail::Connect(format!("HTTP client: {e}")))?;
        let base = cli.server.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Fail::Usage(format!(
                "--server: got {base:?}, allowed an http:// or https:// URL"
            )));
        }
        Ok(Api {
            base,
            http,
            token_file: cli.token_file.clone(),
        })
    }

    /// The bearer for writes: `--token-file`, else `KVROUTE_TOKEN`; none sends no header (the
    /// server then answers 401).
    fn token(&self) -> Res<Option<String>> {
        if let Some(f) = &self.token_file {
            let t = std::fs::read_to_string(f)
                .map_err(|e| Fail::Usage(format!("--token-file: {}: {e}", f.display())))?;
            return Ok(Some(t.trim().to_owned()));
        }
        Ok(std::env::var("KVROUTE_TOKEN")
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty()))
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        token: Option<&Option<String>>,
    ) -> Res<Value> {
        let url = format!("{}{path}", self.base);
        let mut r = self.http.request(method, &url);
        if let Some(Some(t)) = token {
            r = r.bearer_auth(t);
        }
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r
            .send()
            .await
            .map_err(|e| Fail::Connect(format!("cannot reach {url}: {}", root_cause(&e))))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| Fail::Connect(format!("reading {url}: {}", root_cause(&e))))?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        if !status.is_success() {
            let msg = v
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| text.trim().to_owned());
            return Err(Fail::Refused(format!(
                "server answered {}: {}",
                status.as_u16(),
                one_line(&msg)
            )));
        }
        Ok(v)
    }
}

/// The innermost cause (`Connection refused (os error 111)`, `operation timed out`).
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut last = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        last = c.to_string();
        src = c.source();
    }
    last
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}

fn print_result(out: Output, v: &Value) {
    match out {
        Output::Json => println!("{}", pretty(v)),
        Output::Table => {
            let name = v.get("name").and_then(Value::as_str).unwrap_or("");
            let id = v.get("id").map(Value::to_string).unwrap_or_default();
            println!("Success {name} (id {id})");
        }
    }
}

// ---- create lb: flags to RawRule ----

const MODES: [(&str, i64); 6] = [
    ("default", 0),
    ("onearm", 1),
    ("fullnat", 2),
    ("dsr", 3),
    ("fullproxy", 4),
    ("hostonearm", 5),
];
const SELECTS: [(&str, i64); 5] = [
    ("rr", 0),
    ("hash", 1),
    ("priority", 2),
    ("persist", 3),
    ("lc", 4),
];
const ROLES: [(&str, i64); 3] = [("none", 0), ("prefill", 1), ("decode", 2)];

fn named(flag: &str, v: &str, table: &[(&str, i64)]) -> Res<i64> {
    table
        .iter()
        .find(|(n, _)| *n == v)
        .map(|(_, c)| *c)
        .ok_or_else(|| {
            let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
            Fail::Usage(format!("{flag}: got {v:?}, allowed: {}", names.join(", ")))
        })
}

fn int(flag: &str, v: &Option<String>) -> Res<Option<i64>> {
    v.as_deref()
        .map(|s| {
            s.parse::<i64>()
                .map_err(|_| Fail::Usage(format!("{flag}: got {s:?}, allowed an integer")))
        })
        .transpose()
}

/// `IP:WEIGHT`; the weight follows the last colon (IPv6).
fn endpoint(s: &str) -> Res<(String, i64)> {
    let bad = || {
        Fail::Usage(format!(
            "--endpoints: got {s:?}, allowed IP:WEIGHT (e.g. 10.0.0.2:1)"
        ))
    };
    let (ip, w) = s.rsplit_once(':').ok_or_else(bad)?;
    let w = w.parse::<i64>().map_err(|_| bad())?;
    Ok((ip.trim_matches(['[', ']']).to_owned(), w))
}

/// The rules `create lb` posts: one per `--tcp` pair, validated locally.
fn build_rules(a: &CreateLb) -> Res<Vec<RawRule>> {
    let kv_exact_mode = int("--kv-exact-mode", &a.kv_exact_mode)?;
    let mode = match (&a.mode, kv_exact_mode) {
        (Some(m), _) => Some(named("--mode", m, &MODES)?),
        (None, Some(k)) if k != 0 => Some(4),
        (None, _) => None,
    };
    let sel = a
        .select
        .as_deref()
        .map(|s| named("--select", s, &SELECTS))
        .transpose()?;
    let eps: Vec<(String, i64)> = a
        .endpoints
        .iter()
        .map(|s| endpoint(s))
        .collect::<Res<_>>()?;
    for (flag, list) in [
        ("--ep-roles", &a.ep_roles),
        ("--kv-capacity-blocks", &a.kv_capacity_blocks),
        ("--kv-zmq-endpoints", &a.kv_zmq_endpoints),
    ] {
        if !list.is_empty() && list.len() != eps.len() {
            return Err(Fail::Usage(format!(
                "{flag}: got {} values, allowed one per endpoint ({})",
                list.len(),
                eps.len()
            )));
        }
    }
    let roles: Vec<Option<i64>> = match a.ep_roles.is_empty() {
        true => vec![None; eps.len()],
        false => a
            .ep_roles
            .iter()
            .map(|r| named("--ep-roles", r, &ROLES).map(Some))
            .collect::<Res<_>>()?,
    };
    let caps: Vec<Option<i64>> = match a.kv_capacity_blocks.is_empty() {
        true => vec![None; eps.len()],
        false => a
            .kv_capacity_blocks
            .iter()
            .map(|c| match c.as_str() {
                "" => Ok(None),
                c => int("--kv-capacity-blocks", &Some(c.to_owned())),
            })
            .collect::<Res<_>>()?,
    };
    let settings = Settings::from_env(|k| std::env::var(k).ok()).unwrap_or_default();
    let mut out = Vec::new();
    for pair in &a.tcp {
        let bad = || {
            Fail::Usage(format!(
                "--tcp: got {pair:?}, allowed PORT:TARGETPORT (e.g. 8080:8000)"
            ))
        };
        let (p, tp) = pair.split_once(':').ok_or_else(bad)?;
        let (p, tp) = (
            p.parse::<i64>().map_err(|_| bad())?,
            tp.parse::<i64>().map_err(|_| bad())?,
        );
        let raw = RawRule {
            service_arguments: RawServiceArguments {
                external_ip: Some(a.vip.clone()),
                port: Some(p),
                protocol: Some("tcp".into()),
                sel,
                mode,
                name: a.name.clone(),
                kv_exact_mode,
                kv_block_size: int("--kv-block-size", &a.kv_block_size)?,
                kv_hash_algo: a.kv_hash_algo.clone(),
                kv_zmq_port: int("--kv-zmq-port", &a.kv_zmq_port)?,
                kv_warmup_sec: int("--kv-warmup-sec", &a.kv_warmup_sec)?,
                kv_engine_type: a.kv_engine_type.clone(),
                kv_dp_rank_count: int("--kv-dp-ranks", &a.kv_dp_ranks)?,
                kv_key_mode: a.kv_key_mode.clone(),
                kv_model: a.kv_model.clone(),
                kv_vllm_extra_keys: a.kv_vllm_extra_keys.clone(),
                kv_replay_port: int("--kv-replay-port", &a.kv_replay_port)?,
                kv_zmq_bind: a.kv_zmq_bind.then_some(true),
            },
            endpoints: Some(
                eps.iter()
                    .enumerate()
                    .map(|(i, (ip, w))| RawEndpoint {
                        endpoint_ip: Some(ip.clone()),
                        target_port: Some(tp),
                        weight: Some(*w),
                        ep_role: roles[i],
                        kv_capacity_blocks: caps[i],
                        kv_zmq_endpoint: a
                            .kv_zmq_endpoints
                            .get(i)
                            .filter(|z| !z.is_empty())
                            .cloned(),
                        ..RawEndpoint::default()
                    })
                    .collect(),
            ),
            secondary_ips: (!a.secips.is_empty()).then(|| {
                a.secips
                    .iter()
                    .map(|s| kvroute_core::rule::RawSecondaryIp {
                        secondary_ip: Some(s.clone()),
                    })
                    .collect()
            }),
            allowed_sources: (!a.allowedsources.is_empty()).then(|| {
                a.allowedsources
                    .iter()
                    .map(|s| kvroute_core::rule::RawAllowedSource {
                        prefix: Some(s.clone()),
                    })
                    .collect()
            }),
        };
        if let Err(errs) = Rule::from_raw(&raw, &settings) {
            // The vLLM seed is the server's environment: only the server can judge it.
            let shown: Vec<String> = errs
                .0
                .iter()
                .filter(|e| !e.allowed.contains(NONE_HASH_SEED_VAR))
                .map(|e| {
                    format!(
                        "{}: got {}, allowed: {}",
                        flag_of(&e.field),
                        e.value,
                        e.allowed
                    )
                })
                .collect();
            if !shown.is_empty() {
                return Err(Fail::Usage(shown.join("; ")));
            }
        }
        out.push(raw);
    }
    Ok(out)
}

/// The flag that sets a rule JSON field (`endpoints[1].targetPort` -> `--tcp`).
fn flag_of(field: &str) -> String {
    let leaf = field.rsplit('.').next().unwrap_or(field);
    let f = match leaf {
        "externalIP" => "VIP",
        "port" | "targetPort" => "--tcp",
        "protocol" => "--tcp",
        "sel" => "--select (numeric in the rule: rr=0 hash=1 priority=2 persist=3 lc=4)",
        "mode" => "--mode (numeric in the rule: default=0 onearm=1 fullnat=2 dsr=3 fullproxy=4 hostonearm=5)",
        "name" => "--name",
        "kvExactMode" => "--kv-exact-mode",
        "kvBlockSize" => "--kv-block-size",
        "kvHashAlgo" => "--kv-hash-algo",
        "kvZmqPort" => "--kv-zmq-port",
        "kvWarmupSec" => "--kv-warmup-sec",
        "kvEngineType" => "--kv-engine-type",
        "kvDpRankCount" => "--kv-dp-ranks",
        "kvKeyMode" => "--kv-key-mode",
        "kvModel" => "--kv-model",
        "kvReplayPort" => "--kv-replay-port",
        "weight" => "--endpoints (weight)",
        "endpointIP" => "--endpoints (IP)",
        "ep_role" => "--ep-roles (none=0 prefill=1 decode=2)",
        "kvCapacityBlocks" => "--kv-capacity-blocks",
        "kvZmqEndpoint" => "--kv-zmq-endpoints",
        "kvZmqBind" => "--kv-zmq-bind",
        _ if field.starts_with("endpoints") => "--endpoints",
        _ if field.starts_with("secondaryIPs") => "--secips",
        _ if field.starts_with("allowedSources") => "--allowedsources",
        _ => return field.to_owned(),
    };
    match field.split_once('[') {
        Some((_, rest)) if f.starts_with("--endpoints") || f.starts_with("--ep-roles") => {
            let i = rest.split(']').next().unwrap_or("");
            format!("{f} #{i}")
        }
        _ => f.to_owned(),
    }
}

// ---- tables ----

fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.len());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::from("|");
        for (i, c) in cells.iter().enumerate() {
            let _ = write!(s, " {c:<width$} |", width = w[i]);
        }
        s.push('\n');
        s
    };
    let mut out = line(head.to_vec());
    out.push('|');
    for x in &w {
        out.push_str(&"-".repeat(x + 2));
        out.push('|');
    }
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn s(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(x)) => x.clone(),
        Some(x) => x.to_string(),
    }
}

fn name_of(code: Option<i64>, table: &[(&str, i64)], default: &str) -> String {
    match code {
        None => default.into(),
        Some(c) => table
            .iter()
            .find(|(_, n)| *n == c)
            .map(|(n, _)| (*n).to_owned())
            .unwrap_or_else(|| c.to_string()),
    }
}

fn lb_table(v: &Value) -> String {
    let empty = Vec::new();
    let rows: Vec<Vec<String>> = v
        .get("lbAttr")
        .and_then(Value::as_array)
        .unwrap_or(&empty)
        .iter()
        .map(|r| {
            let a = r.get("serviceArguments").cloned().unwrap_or(Value::Null);
            let eps = r
                .get("endpoints")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
                .iter()
                .map(|e| {
                    format!(
                        "{}:{}({})",
                        s(e.get("endpointIP")),
                        s(e.get("targetPort")),
                        s(e.get("weight"))
                    )
                })
                .collect::<Vec<_>>()
                .join(",");
            let c = r.get("contract").cloned().unwrap_or(Value::Null);
            vec![
                s(r.get("id")),
                s(a.get("externalIP")),
                s(a.get("port")),
                s(a.get("protocol")),
                name_of(a.get("mode").and_then(Value::as_i64), &MODES, "default"),
                name_of(a.get("sel").and_then(Value::as_i64), &SELECTS, "rr"),
                eps,
                s(c.get("kv_exact_mode")),
                s(c.get("engine")),
                s(c.get("block_size")),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "VIP",
            "PORT",
            "PROTOCOL",
            "MODE",
            "SEL",
            "ENDPOINTS",
            "KV MODE",
            "KV ENGINE",
            "KV BLOCK",
        ],
        &rows,
    )
}

/// The PARITY cell: the mismatch's message, `ok (N checks)`, or `unchecked` (no event with token
/// ids checked yet: a passed check and one that never ran must not look alike).
fn parity_cell(e: &Value) -> String {
    if let Some(p) = e.get("parity").filter(|p| !p.is_null()) {
        return match p.get("message").and_then(Value::as_str) {
            Some(m) => format!("mismatch: {m}"),
            None => s(Some(p)),
        };
    }
    let checks = e.get("parity_checks").and_then(Value::as_u64).unwrap_or(0);
    match e.get("parity_status").and_then(Value::as_str) {
        Some("unchecked") => "unchecked".into(),
        Some(_) => format!("ok ({checks} checks)"),
        // A service without the status field: only a mismatch was reported.
        None => "ok".into(),
    }
}

/// The CANARY cell: the parity canary's latest verdict (`healthy` or the wrong leg), `-` when
/// it is off or has not run on the endpoint yet.
fn canary_cell(e: &Value) -> String {
    match e.get("canary").and_then(|c| c.get("verdict")) {
        Some(v) => s(Some(v)),
        None => "-".into(),
    }
}

fn health_table(v: &Value) -> String {
    let empty = Vec::new();
    let mut rows = Vec::new();
    for r in v.get("rules").and_then(Value::as_array).unwrap_or(&empty) {
        for e in r
            .get("endpoints")
            .and_then(Value::as_array)
            .unwrap_or(&empty)
        {
            rows.push(vec![
                s(r.get("name")),
                s(e.get("idx")),
                s(e.get("endpoint")),
                s(e.get("healthy")),
                s(e.get("connected")),
                s(e.get("blocks")),
                parity_cell(e),
                canary_cell(e),
            ]);
        }
    }
    let mut out = format!("status: {}\n", s(v.get("status")));
    out.push_str(&table(
        &[
            "RULE",
            "EP",
            "ENDPOINT",
            "HEALTHY",
            "CONNECTED",
            "BLOCKS",
            "PARITY",
            "CANARY",
        ],
        &rows,
    ));
    out
}

// ---- get kv-inventory ----

/// Bound on pages (a page holds up to `limit` blocks; the table is scanned in bounded steps).
const MAX_PAGES: usize = 100_000;

async fn kv_inventory(api: &Api, out: Output, sid: &str, ep: &str, limit: usize) -> Res<()> {
    let mut offset = 0u64;
    let mut blocks = Vec::new();
    let mut first: Option<Value> = None;
    for _ in 0..MAX_PAGES {
        let path = format!(
            "/netlox/v1/config/ai/kv/inventory?service_id={}&ep_idx={}&offset={offset}&limit={limit}",
            enc(sid),
            enc(ep)
        );
        let v = api.send(reqwest::Method::GET, &path, None, None).await?;
        if let Some(b) = v.get("blocks").and_then(Value::as_array) {
            blocks.extend(b.iter().cloned());
        }
        let next = v.get("next_offset").and_then(Value::as_u64);
        first.get_or_insert(v);
        match next {
            Some(n) if n > offset => offset = n,
            _ => break,
        }
    }
    let head = first.unwrap_or(Value::Null);
    match out {
        Output::Json => println!(
            "{}",
            pretty(&json!({
                "service_id": head.get("service_id"),
                "ep_idx": head.get("ep_idx"),
                "hash_algo": head.get("hash_algo"),
                "total": head.get("total"),
                "blocks": blocks,
            }))
        ),
        Output::Table => {
            println!(
                "service {} endpoint {} hash {}: {} blocks",
                s(head.get("service_id")),
                s(head.get("ep_idx")),
                s(head.get("hash_algo")),
                s(head.get("total"))
            );
            let rows: Vec<Vec<String>> = blocks
                .iter()
                .map(|b| vec![s(b.get("block_idx")), s(b.get("hash_uint64"))])
                .collect();
            print!("{}", table(&["POSITION", "HASH (u64)"], &rows));
        }
    }
    Ok(())
}

/// Percent-encodes a query value.
fn enc(v: &str) -> String {
    let mut o = String::new();
    for b in v.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                o.push(b as char)
            }
            _ => {
                let _ = write!(o, "%{b:02X}");
            }
        }
    }
    o
}

// ---- explain ----

async fn explain(api: &Api, out: Output, a: &ExplainArgs) -> Res<()> {
    let messages =
        match &a.messages {
            Some(f) => {
                let t = std::fs::read_to_string(f)
                    .map_err(|e| Fail::Usage(format!("--messages: {}: {e}", f.display())))?;
                Some(serde_json::from_str::<Value>(&t).map_err(|e| {
                    Fail::Usage(format!("--messages: {}: not JSON: {e}", f.display()))
                })?)
            }
            None => None,
        };
    if a.prompt.is_none() && messages.is_none() {
        return Err(Fail::Usage(
            "explain: give --prompt TEXT or --messages FILE".into(),
        ));
    }
    let c = api
        .send(
            reqwest::Method::GET,
            &format!("/v1/rules/{}/contract", enc(&a.rule)),
            None,
            None,
        )
        .await?;
    let c: RuleContract =
        serde_json::from_value(c).map_err(|e| Fail::Refused(format!("contract: {e}")))?;
    let model = a.model.clone().or_else(|| c.model.clone());
    let (keys, token_count) = match &c.algo {
        Some(algo) => {
            let algo = HashAlgo::parse(algo)
                .ok_or_else(|| Fail::Refused(format!("contract: unknown algo {algo:?}")))?;
            let block = BlockSize::new(c.block_size).ok_or_else(|| {
                Fail::Refused(format!("contract: bad block_size {}", c.block_size))
            })?;
            let mut contract = HashContract::new(algo, block);
            if let Some(seed) = &c.seed {
                contract = contract.with_seed(seed);
            }
            let dir = &a.tokenizer;
            let tj = std::fs::read(dir.join("tokenizer.json")).map_err(|e| {
                Fail::Usage(format!(
                    "--tokenizer: {}: {e}",
                    dir.join("tokenizer.json").display()
                ))
            })?;
            let cfg = std::fs::read(dir.join("tokenizer_config.json")).ok();
            let loaded = kvroute_inventory::offload::Loaded::new(&tj, cfg.as_deref(), true)
                .map_err(|e| Fail::Usage(format!("--tokenizer: {}: {e}", dir.display())))?;
            let o = kvroute_inventory::offload::Offload {
                model: model.clone(),
                prompt: a.prompt.clone(),
                messages: messages.clone(),
            };
            let k =
                kvroute_inventory::offload::keys_for(&loaded, &contract, &o, a.max_prefix_tokens)
                    .map_err(|e| Fail::Usage(format!("explain: {e}")))?;
            (
                k.keys.iter().map(|k| k.0).collect::<Vec<u64>>(),
                k.token_count,
            )
        }
        // No KV contract (kvExactMode 0): no keys, the decision is plain load balancing.
        None => (Vec::new(), 0),
    };
    let question = RouteRequest {
        rule: a.rule.clone(),
        model,
        keys: keys.iter().map(|&k| WireKey::Unsigned(k)).collect(),
        token_count,
        affinity_key: a.affinity_key.clone(),
        session: a
            .session
            .as_deref()
            .and_then(|id| kvroute_core::affinity::session_id(id.as_bytes())),
        explain: true,
        ..Default::default()
    };
    let body = serde_json::to_value(&question)
        .map_err(|e| Fail::Usage(format!("explain: the question: {e}")))?;
    // A service started with --route-token-file wants its bearer on /v1/route too.
    let token = api.token()?;
    let mut v = api
        .send(reqwest::Method::POST, "/v1/route", Some(body), Some(&token))
        .await?;
    match out {
        Output::Json => {
            // The keys computed here, for comparison with `hash` and the engine's events.
            if let Value::Object(m) = &mut v {
                m.insert(
                    "request".into(),
                    json!({"keys": keys, "token_count": token_count}),
                );
            }
            println!("{}", pretty(&v))
        }
        Output::Table => {
            let x = v.get("explain").cloned().unwrap_or(Value::Null);
            println!(
                "endpoint {} ({} {}, {} matched blocks of {}, {} tokens){}",
                s(v.get("endpoint")),
                s(v.get("tier")),
                s(v.get("reason")),
                s(v.get("matched_blocks")),
                s(x.get("keys")),
                s(x.get("token_count")),
                match v.get("decode_endpoint") {
                    Some(Value::String(d)) => format!(", decode {d}"),
                    _ => String::new(),
                }
            );
            if let Some(Value::Array(r)) = x.get("recall") {
                println!(
                    "placement memory: family homed on endpoint {}, {} blocks deep",
                    s(r.first()),
                    s(r.get(1))
                );
            }
            if let Some(ep) = x.get("session") {
                println!("session: bound to endpoint {}", s(Some(ep)));
            }
            let empty = Vec::new();
            let rows: Vec<Vec<String>> = x
                .get("endpoints")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
                .iter()
                .map(|e| {
                    vec![
                        s(e.get("idx")),
                        s(e.get("endpoint")),
                        s(e.get("healthy")),
                        s(e.get("matched_blocks")),
                        match e.get("lower_blocks") {
                            Some(Value::Array(l)) => format!("{}/{}", s(l.first()), s(l.get(1))),
                            _ => "-".into(),
                        },
                        s(e.get("blocks")),
                        s(e.get("load")),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &[
                        "EP",
                        "ENDPOINT",
                        "HEALTHY",
                        "MATCHED",
                        "CPU/STORAGE",
                        "BLOCKS",
                        "LOAD"
                    ],
                    &rows
                )
            );
        }
    }
    Ok(())
}
