//! Service-wide tuning read from the environment (the seed's variable names), validated once.
//!
//! The variables the filter shares (`LLB_KV_MIN_MATCH_TOKENS`, `LLB_KV_NONE_HASH_SEED`,
//! `LOXILB_KV_SPILL_RELIEF`, `LOXILB_KV_COLDSTART_*`) are parsed by kvroute-core's
//! [`kvroute_core::settings::Settings`]; the service-only knobs are parsed here. Every bad value is
//! reported with the variable, the value and what is allowed; the service refuses to start rather
//! than run with a silently different policy.

use std::time::Duration;

/// How Tier 1.5 blends overlap with load (`LOXILB_KV_LB_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LbMode {
    /// Pure highest-overlap argmax.
    Off,
    /// Capacity-weighted bounded load: highest overlap among endpoints under their cap.
    Hard,
    /// Overlap minus `load_penalty` x load.
    Soft,
}

/// Tri-state spill relief: unset means on for single-role rules, off for prefill/decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpillRelief {
    Auto,
    On,
    Off,
}

/// How a new prefix family (no overlap anywhere) is placed (`KVROUTE_PLACEMENT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Most free cache (capacity minus blocks homed) among under-cap endpoints, for `sel` round
    /// robin and least loaded; hash and priority rules keep their `sel`.
    Footprint,
    /// Always the rule's `sel`.
    Sel,
}

/// Scoring and ingestion tuning.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The settings shared with the filter (rule validation needs them: the NONE_HASH seed).
    pub core: kvroute_core::settings::Settings,
    /// `KVROUTE_TRTLLM_DRAIN_MS`: TensorRT-LLM `/kv_cache_events` drain period.
    pub trtllm_drain_ms: u32,
    /// `LLB_KV_MIN_MATCH_TOKENS`: shorter prompts skip KV scoring.
    pub min_match_tokens: u32,
    /// `LOXILB_KV_MEAN_LOAD_FACTOR` in percent (175 = cap at 1.75 x fair share).
    pub mean_load_factor: u32,
    /// `LOXILB_KV_LB_MODE`: off, hard, soft.
    pub lb_mode: LbMode,
    /// `LOXILB_KV_LOAD_PENALTY`: blocks of overlap one in-flight request costs in soft mode.
    pub load_penalty: f64,
    /// `LOXILB_KV_SPILL_RELIEF`: on, off or unset.
    pub spill_relief: SpillRelief,
    /// `LOXILB_KV_COLDSTART_MIN_BLOCKS`: an endpoint below this is cold.
    pub coldstart_min_blocks: u64,
    /// `LOXILB_KV_COLDSTART_SEED_N`: every Nth hit seeds a cold endpoint; 0 disables.
    pub coldstart_seed_n: u64,
    /// `KVROUTE_SPEC_TTL_MS`: speculative credit after a decision (the blind spot).
    pub spec_ttl: Duration,
    /// `KVROUTE_INFLIGHT_WINDOW_MS`: a decision counts as in flight this long absent a metrics scrape.
    pub inflight_window: Duration,
    /// `KVROUTE_HEALTH_INTERVAL_MS`: active health check period; 0 disables checks.
    pub health_interval: Duration,
    /// `KVROUTE_HEALTH_PATH`: path probed on each endpoint's serving port.
    pub health_path: String,
    /// `KVROUTE_SCRAPE_INTERVAL_MS`: engine metrics scrape period; 0 disables.
    pub scrape_interval: Duration,
    /// `KVROUTE_REPLAY_TIMEOUT_MS`: how long a replay may take before the endpoint is cleared instead.
    pub replay_timeout: Duration,
    /// `KVROUTE_ZMQ_IDLE_RECONNECT_MS`: a subscriber silent this long reconnects (0 disables).
    /// The `zeromq` crate does not report or repair a dropped publisher, so silence is the only
    /// signal that an engine went away; an idle engine just gets a cheap reconnect.
    pub zmq_idle_reconnect: Duration,
    /// `KVROUTE_AFFINITY_SCOPE`: `tenant` (default) or `tenant_model` (the model joins the sticky key).
    pub affinity_scope_model: bool,
    /// `KVROUTE_PLACEMENT`: footprint (default) or sel.
    pub placement: Placement,
    /// `KVROUTE_PLACEMENT_MEMORY_ENTRIES`: placement memory bound per rule; 0 disables the memory.
    pub memory_entries: usize,
    /// `KVROUTE_PLACEMENT_MEMORY_TTL_MS`: a remembered family is forgotten this long after last use.
    pub memory_ttl: Duration,
    /// `KVROUTE_PLACEMENT_CAPACITY_BLOCKS`: cache capacity assumed for an endpoint whose
    /// `vllm:cache_config_info` num_gpu_blocks was not scraped; 0 = unknown.
    pub capacity_blocks: u64,
    /// `KVROUTE_MAX_PREFIX_TOKENS`: offloaded tokenization routes on at most this many prompt
    /// tokens (the filter's `max_prefix_tokens`).
    pub max_prefix_tokens: usize,
    /// Shared state across replicas (`KVROUTE_REDIS_URL`); `None` runs standalone in memory.
    pub redis: Option<RedisSettings>,
    /// Listener limits (`KVROUTE_HTTP_*`, `KVROUTE_MAX_CONNECTIONS`).
    pub http: HttpLimits,
    /// `KVROUTE_MAX_KEYS_PER_ENDPOINT`: blocks one endpoint may hold in the index; 0 = sized from
    /// the endpoint's capacity (4 x `kvCapacityBlocks` or scraped num_gpu_blocks), else
    /// [`DEFAULT_MAX_KEYS_PER_ENDPOINT`].
    pub max_keys_per_endpoint: u64,
}

/// Blocks an endpoint may hold when neither the setting nor its capacity says otherwise: far above
/// any GPU's KV cache (an 80 GB GPU holds about 500k 16-token blocks of a small model), so it only
/// stops a publisher sending keys without bound (34 bytes each: 16M keys = 544 MB).
pub const DEFAULT_MAX_KEYS_PER_ENDPOINT: u64 = 16 << 20;

/// Bounds of every HTTP listener: a client cannot hold a connection without sending a request, nor
/// hold more than its share of file descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// `KVROUTE_HTTP_HEADER_TIMEOUT_MS`: from a request's first byte to its complete headers.
    pub header_timeout: Duration,
    /// `KVROUTE_HTTP_IDLE_TIMEOUT_MS`: a connection with no request in flight and no bytes moving
    /// is closed after this long (also bounds a TLS handshake).
    pub idle_timeout: Duration,
    /// `KVROUTE_MAX_CONNECTIONS`: open connections; past it new connections wait in the kernel
    /// backlog until one closes.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_millis(10_000),
            idle_timeout: Duration::from_millis(120_000),
            max_connections: 4096,
        }
    }
}

/// Where and how replicas share state (see docs/replication.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisSettings {
    /// `KVROUTE_REDIS_URL`: `redis://host:port[/db]` or `rediss://` (TLS).
    pub url: String,
    /// `KVROUTE_REDIS_USERNAME`: ACL user (overrides one in the URL).
    pub username: Option<String>,
    /// `KVROUTE_REDIS_PASSWORD_FILE`: file holding the password (read at start; trailing newline dropped).
    pub password_file: Option<std::path::PathBuf>,
    /// `KVROUTE_REDIS_PREFIX`: prefix of every key kvroute writes.
    pub prefix: String,
    /// `KVROUTE_LEASE_MS`: endpoint ownership lease; a dead owner is replaced within it.
    pub lease: Duration,
    /// `KVROUTE_SNAPSHOT_INTERVAL_MS`: how often an owner snapshots each endpoint it owns.
    pub snapshot_interval: Duration,
    /// `KVROUTE_STREAM_MAXLEN`: approximate entries kept per rule log.
    pub stream_maxlen: u64,
    /// `KVROUTE_REPLICA_ID`: this replica's name in leases and logs (default host-pid-random).
    pub replica_id: Option<String>,
}

impl RedisSettings {
    /// Defaults for `url`.
    pub fn new(url: &str) -> RedisSettings {
        RedisSettings {
            url: url.to_owned(),
            username: None,
            password_file: None,
            prefix: "kvroute".into(),
            lease: Duration::from_millis(5000),
            snapshot_interval: Duration::from_millis(30_000),
            stream_maxlen: 200_000,
            replica_id: None,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            core: kvroute_core::settings::Settings::default(),
            trtllm_drain_ms: 100,
            min_match_tokens: 0,
            mean_load_factor: 175,
            lb_mode: LbMode::Hard,
            load_penalty: 1.0,
            spill_relief: SpillRelief::Auto,
            coldstart_min_blocks: 0,
            coldstart_seed_n: 0,
            spec_ttl: Duration::from_millis(2000),
            inflight_window: Duration::from_millis(5000),
            health_interval: Duration::from_millis(500),
            health_path: "/health".into(),
            scrape_interval: Duration::from_millis(0),
            replay_timeout: Duration::from_millis(2000),
            affinity_scope_model: false,
            zmq_idle_reconnect: Duration::from_millis(30_000),
            placement: Placement::Footprint,
            memory_entries: 65_536,
            memory_ttl: Duration::from_millis(1_800_000),
            capacity_blocks: 0,
            max_prefix_tokens: kvroute_core::bpe::MAX_PREFIX_TOKENS,
            redis: None,
            http: HttpLimits::default(),
            max_keys_per_endpoint: 0,
        }
    }
}

/// Every environment problem found.
#[derive(Debug, thiserror::Error)]
#[error("invalid environment: {}", .0.join("; "))]
pub struct SettingsError(pub Vec<String>);

/// Names of every variable read, for `--help`.
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LLB_KV_MIN_MATCH_TOKENS",
        "prompts with fewer tokens skip KV scoring",
    ),
    (
        "LLB_KV_NONE_HASH_SEED",
        "the engines' PYTHONHASHSEED (vLLM NONE_HASH seed); unset = engine default",
    ),
    (
        "LOXILB_KV_MEAN_LOAD_FACTOR",
        "load cap in percent of fair share, 100..=1000 (default 175)",
    ),
    ("LOXILB_KV_LB_MODE", "off | hard | soft (default hard)"),
    (
        "LOXILB_KV_LOAD_PENALTY",
        "soft mode: overlap blocks one in-flight request costs (default 1.0)",
    ),
    (
        "LOXILB_KV_SPILL_RELIEF",
        "on | off; unset = on for kvExactMode 3, off for 1",
    ),
    (
        "LOXILB_KV_COLDSTART_MIN_BLOCKS",
        "an endpoint with fewer blocks is cold (default 0)",
    ),
    (
        "LOXILB_KV_COLDSTART_SEED_N",
        "every Nth hit seeds the lowest-index cold endpoint; 0 disables (default 0)",
    ),
    (
        "KVROUTE_TRTLLM_DRAIN_MS",
        "TensorRT-LLM /kv_cache_events drain period (default 100)",
    ),
    (
        "KVROUTE_SPEC_TTL_MS",
        "speculative credit after a decision (default 2000)",
    ),
    (
        "KVROUTE_INFLIGHT_WINDOW_MS",
        "a decision counts as in flight this long (default 5000)",
    ),
    (
        "KVROUTE_HEALTH_INTERVAL_MS",
        "active health check period per endpoint, 0 disables (default 500)",
    ),
    ("KVROUTE_HEALTH_PATH", "health check path (default /health)"),
    (
        "KVROUTE_SCRAPE_INTERVAL_MS",
        "engine metrics scrape period, 0 disables (default 0)",
    ),
    (
        "KVROUTE_REPLAY_TIMEOUT_MS",
        "replay deadline before clearing instead (default 2000)",
    ),
    (
        "KVROUTE_ZMQ_IDLE_RECONNECT_MS",
        "a silent subscriber reconnects after this long, 0 disables (default 30000)",
    ),
    (
        "KVROUTE_AFFINITY_SCOPE",
        "tenant | tenant_model: what the sticky fallback hashes (default tenant)",
    ),
    (
        "KVROUTE_PLACEMENT",
        "footprint | sel: how a new prefix family is placed (default footprint)",
    ),
    (
        "KVROUTE_PLACEMENT_MEMORY_ENTRIES",
        "placement memory entries per rule, 0 disables (default 65536)",
    ),
    (
        "KVROUTE_PLACEMENT_MEMORY_TTL_MS",
        "a remembered prefix family is forgotten after this long unused (default 1800000)",
    ),
    (
        "KVROUTE_PLACEMENT_CAPACITY_BLOCKS",
        "cache blocks assumed per endpoint when num_gpu_blocks is not scraped, 0 = unknown (default 0)",
    ),
    (
        "KVROUTE_HTTP_HEADER_TIMEOUT_MS",
        "a request's headers must arrive within this long of its first byte, 100..=600000 (default 10000)",
    ),
    (
        "KVROUTE_HTTP_IDLE_TIMEOUT_MS",
        "a connection idle this long (no request, no bytes) is closed, 100..=86400000 (default 120000)",
    ),
    (
        "KVROUTE_MAX_CONNECTIONS",
        "open HTTP connections; more wait in the backlog, 1..=1000000 (default 4096)",
    ),
    (
        "KVROUTE_MAX_KEYS_PER_ENDPOINT",
        "blocks one endpoint may hold; 0 = 4 x its capacity if known, else 16777216 (default 0)",
    ),
    (
        "KVROUTE_MAX_PREFIX_TOKENS",
        "offloaded tokenization routes on at most this many prompt tokens, 1..=1048576 (default 16384)",
    ),
    (
        "KVROUTE_REDIS_URL",
        "redis:// or rediss:// URL: share state across replicas; unset = standalone in memory",
    ),
    ("KVROUTE_REDIS_USERNAME", "Redis ACL user"),
    (
        "KVROUTE_REDIS_PASSWORD_FILE",
        "file holding the Redis password",
    ),
    (
        "KVROUTE_REDIS_PREFIX",
        "prefix of every Redis key (default kvroute)",
    ),
    (
        "KVROUTE_LEASE_MS",
        "endpoint ownership lease, 300..=600000 (default 5000)",
    ),
    (
        "KVROUTE_SNAPSHOT_INTERVAL_MS",
        "endpoint snapshot period, 500..=86400000 (default 30000)",
    ),
    (
        "KVROUTE_STREAM_MAXLEN",
        "approximate entries kept per rule log, 1000..=100000000 (default 200000)",
    ),
    (
        "KVROUTE_REPLICA_ID",
        "this replica's name in leases (default host-pid-random)",
    ),
];

impl Settings {
    /// Reads the variables through `lookup` (tests pass a map; main passes `std::env::var`).
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsError> {
        let mut s = Settings::default();
        let mut errs = Vec::new();
        match kvroute_core::settings::Settings::from_env(&lookup) {
            Ok(core) => {
                s.min_match_tokens = core.min_match_tokens();
                s.coldstart_min_blocks = u64::from(core.coldstart_min_blocks());
                s.coldstart_seed_n = u64::from(core.coldstart_seed_n());
                s.spill_relief = match core.spill_relief() {
                    kvroute_core::settings::SpillRelief::Unset => SpillRelief::Auto,
                    kvroute_core::settings::SpillRelief::On => SpillRelief::On,
                    kvroute_core::settings::SpillRelief::Off => SpillRelief::Off,
                };
                s.core = core;
            }
            Err(e) => errs.extend(e.0.iter().map(ToString::to_string)),
        }
        let mut num = |name: &str, lo: u64, hi: u64, into: &mut dyn FnMut(u64)| {
            if let Some(v) = lookup(name).filter(|v| !v.is_empty()) {
                match v.trim().parse::<u64>() {
                    Ok(n) if (lo..=hi).contains(&n) => into(n),
                    _ => errs.push(format!("{name}: got {v:?}, allowed integer {lo}..={hi}")),
                }
            }
        };
        num("LOXILB_KV_MEAN_LOAD_FACTOR", 100, 1000, &mut |n| {
            s.mean_load_factor = n as u32
        });
        num("KVROUTE_TRTLLM_DRAIN_MS", 10, 60_000, &mut |n| {
            s.trtllm_drain_ms = n as u32
        });
        num("KVROUTE_SPEC_TTL_MS", 0, 600_000, &mut |n| {
            s.spec_ttl = Duration::from_millis(n)
        });
        num("KVROUTE_INFLIGHT_WINDOW_MS", 1, 3_600_000, &mut |n| {
            s.inflight_window = Duration::from_millis(n)
        });
        num("KVROUTE_HEALTH_INTERVAL_MS", 0, 3_600_000, &mut |n| {
            s.health_interval = Duration::from_millis(n)
        });
        num("KVROUTE_SCRAPE_INTERVAL_MS", 0, 3_600_000, &mut |n| {
            s.scrape_interval = Duration::from_millis(n)
        });
        num("KVROUTE_ZMQ_IDLE_RECONNECT_MS", 0, 3_600_000, &mut |n| {
            s.zmq_idle_reconnect = Duration::from_millis(n)
        });
        num("KVROUTE_REPLAY_TIMEOUT_MS", 10, 600_000, &mut |n| {
            s.replay_timeout = Duration::from_millis(n)
        });
        num(
            "KVROUTE_PLACEMENT_MEMORY_ENTRIES",
            0,
            16_777_216,
            &mut |n| s.memory_entries = n as usize,
        );
        num("KVROUTE_PLACEMENT_MEMORY_TTL_MS", 1, 86_400_000, &mut |n| {
            s.memory_ttl = Duration::from_millis(n)
        });
        num("KVROUTE_PLACEMENT_CAPACITY_BLOCKS", 0, 1 << 40, &mut |n| {
            s.capacity_blocks = n
        });
        num("KVROUTE_HTTP_HEADER_TIMEOUT_MS", 100, 600_000, &mut |n| {
            s.http.header_timeout = Duration::from_millis(n)
        });
        num("KVROUTE_HTTP_IDLE_TIMEOUT_MS", 100, 86_400_000, &mut |n| {
            s.http.idle_timeout = Duration::from_millis(n)
        });
        num("KVROUTE_MAX_CONNECTIONS", 1, 1_000_000, &mut |n| {
            s.http.max_connections = n as usize
        });
        num("KVROUTE_MAX_KEYS_PER_ENDPOINT", 0, 1 << 40, &mut |n| {
            s.max_keys_per_endpoint = n
        });
        num(
            "KVROUTE_MAX_PREFIX_TOKENS",
            1,
            kvroute_core::bpe::MAX_PREFIX_TOKENS_LIMIT as u64,
            &mut |n| s.max_prefix_tokens = n as usize,
        );
        if let Some(v) = lookup("LOXILB_KV_LB_MODE").filter(|v| !v.is_empty()) {
            match v.trim().to_ascii_lowercase().as_str() {
                "off" | "0" => s.lb_mode = LbMode::Off,
                "hard" | "1" | "on" => s.lb_mode = LbMode::Hard,
                "soft" => s.lb_mode = LbMode::Soft,
                _ => errs.push(format!(
                    "LOXILB_KV_LB_MODE: got {v:?}, allowed off, hard, soft"
                )),
            }
        }
        if let Some(v) = lookup("LOXILB_KV_LOAD_PENALTY").filter(|v| !v.is_empty()) {
            match v.trim().parse::<f64>() {
                Ok(f) if f.is_finite() && (0.0..=1e6).contains(&f) => s.load_penalty = f,
                _ => errs.push(format!(
                    "LOXILB_KV_LOAD_PENALTY: got {v:?}, allowed a number 0..=1e6"
                )),
            }
        }
        match lookup("KVROUTE_PLACEMENT").as_deref() {
            None | Some("") | Some("footprint") => {}
            Some("sel") => s.placement = Placement::Sel,
            Some(v) => errs.push(format!(
                "KVROUTE_PLACEMENT: got {v:?}, allowed footprint, sel"
            )),
        }
        match lookup("KVROUTE_AFFINITY_SCOPE").as_deref() {
            None | Some("") | Some("tenant") => {}
            Some("tenant_model") => s.affinity_scope_model = true,
            Some(v) => errs.push(format!(
                "KVROUTE_AFFINITY_SCOPE: got {v:?}, allowed tenant, tenant_model"
            )),
        }
        if let Some(v) = lookup("KVROUTE_HEALTH_PATH").filter(|v| !v.is_empty()) {
            if v.starts_with('/') {
                s.health_path = v;
            } else {
                errs.push(format!(
                    "KVROUTE_HEALTH_PATH: got {v:?}, allowed a path starting with /"
                ));
            }
        }
        s.redis = redis_from_env(&lookup, &mut errs);
        if errs.is_empty() {
            Ok(s)
        } else {
            Err(SettingsError(errs))
        }
    }
}

/// The Redis variables; `None` without `KVROUTE_REDIS_URL` (any other Redis variable is then an error,
/// so a half-configured replica does not silently run standalone).
fn redis_from_env(
    lookup: &impl Fn(&str) -> Option<String>,
    errs: &mut Vec<String>,
) -> Option<RedisSettings> {
    let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
    let Some(url) = get("KVROUTE_REDIS_URL") else {
        for k in [
            "KVROUTE_REDIS_USERNAME",
            "KVROUTE_REDIS_PASSWORD_FILE",
            "KVROUTE_REDIS_PREFIX",
            "KVROUTE_LEASE_MS",
            "KVROUTE_SNAPSHOT_INTERVAL_MS",
            "KVROUTE_STREAM_MAXLEN",
            "KVROUTE_REPLICA_ID",
        ] {
            if get(k).is_some() {
                errs.push(format!(
                    "{k}: set without KVROUTE_REDIS_URL, allowed only with KVROUTE_REDIS_URL"
                ));
            }
        }
        return None;
    };
    let url = url.trim().to_owned();
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        errs.push(format!(
            "KVROUTE_REDIS_URL: got {url:?}, allowed redis://host:port[/db] or rediss://host:port[/db]"
        ));
    }
    let mut r = RedisSettings::new(&url);
    r.username = get("KVROUTE_REDIS_USERNAME");
    r.password_file = get("KVROUTE_REDIS_PASSWORD_FILE").map(std::path::PathBuf::from);
    r.replica_id = get("KVROUTE_REPLICA_ID");
    if let Some(p) = get("KVROUTE_REDIS_PREFIX") {
        if p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
        {
            r.prefix = p;
        } else {
            errs.push(format!(
                "KVROUTE_REDIS_PREFIX: got {p:?}, allowed letters, digits and - _ . :"
            ));
        }
    }
    let mut ms = |name: &str, lo: u64, hi: u64| -> Option<u64> {
        let v = get(name)?;
        match v.trim().parse::<u64>() {
            Ok(n) if (lo..=hi).contains(&n) => Some(n),
            _ => {
                errs.push(format!("{name}: got {v:?}, allowed integer {lo}..={hi}"));
                None
            }
        }
    };
    if let Some(n) = ms("KVROUTE_LEASE_MS", 300, 600_000) {
        r.lease = Duration::from_millis(n);
    }
    if let Some(n) = ms("KVROUTE_SNAPSHOT_INTERVAL_MS", 500, 86_400_000) {
        r.snapshot_interval = Duration::from_millis(n);
    }
    if let Some(n) = ms("KVROUTE_STREAM_MAXLEN", 1000, 100_000_000) {
        r.stream_maxlen = n;
    }
    Some(r)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn defaults_and_errors() {
        let s = Settings::from_env(|_| None).unwrap();
        assert_eq!(s.mean_load_factor, 175);
        assert_eq!(s.spec_ttl, Duration::from_secs(2));
        assert_eq!(s.max_prefix_tokens, 16_384);
        let s = Settings::from_env(|k| (k == "KVROUTE_MAX_PREFIX_TOKENS").then(|| "512".into()));
        assert_eq!(s.unwrap().max_prefix_tokens, 512);
        let e = Settings::from_env(|k| (k == "KVROUTE_MAX_PREFIX_TOKENS").then(|| "0".into()))
            .unwrap_err();
        assert_eq!(
            e.0,
            ["KVROUTE_MAX_PREFIX_TOKENS: got \"0\", allowed integer 1..=1048576"]
        );
        let e = Settings::from_env(|k| match k {
            "LOXILB_KV_MEAN_LOAD_FACTOR" => Some("5".into()),
            "LOXILB_KV_SPILL_RELIEF" => Some("maybe".into()),
            "LOXILB_KV_LB_MODE" => Some("x".into()),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
        assert!(e.0[0].contains("LOXILB_KV_SPILL_RELIEF"));
        assert!(e.0[1].contains("LOXILB_KV_MEAN_LOAD_FACTOR"));
    }

    #[test]
    fn redis_variables() {
        let s = Settings::from_env(|_| None).unwrap();
        assert!(s.redis.is_none());
        let s = Settings::from_env(|k| match k {
            "KVROUTE_REDIS_URL" => Some("redis://127.0.0.1:6390".into()),
            "KVROUTE_LEASE_MS" => Some("1000".into()),
            _ => None,
        })
        .unwrap();
        let r = s.redis.unwrap();
        assert_eq!(r.lease, Duration::from_secs(1));
        assert_eq!(r.prefix, "kvroute");
        let e = Settings::from_env(|k| match k {
            "KVROUTE_REDIS_URL" => Some("http://x".into()),
            "KVROUTE_LEASE_MS" => Some("5".into()),
            "KVROUTE_REDIS_PREFIX" => Some("a b".into()),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
        assert!(e
            .0
            .iter()
            .any(|m| m.starts_with("KVROUTE_REDIS_URL: got \"http://x\", allowed redis://")));
        assert!(e
            .0
            .iter()
            .any(|m| m.starts_with("KVROUTE_LEASE_MS: got \"5\", allowed integer 300..=600000")));
        let e =
            Settings::from_env(|k| (k == "KVROUTE_LEASE_MS").then(|| "1000".into())).unwrap_err();
        assert!(e.0[0].contains("without KVROUTE_REDIS_URL"), "{e}");
    }
}
