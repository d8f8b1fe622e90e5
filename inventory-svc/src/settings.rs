//! Service-wide tuning read from the environment (the seed's variable names), validated once.
//!
//! Every variable is written once, as a [`Setting`] descriptor: its name, the values it takes,
//! its default and its help. The variables the filter shares (`LLB_KV_*`, `LOXILB_KV_SPILL_RELIEF`,
//! `LOXILB_KV_COLDSTART_*`) are kvroute-core's ([`kvroute_core::settings::VARS`], parsed by
//! [`kvroute_core::settings::Settings`]); the service's own are [`SERVICE_VARS`] and
//! [`REDIS_VARS`]. Parsing, [`Settings::default`], `serve --help` ([`env_help`]) and the settings
//! tables of `docs/inventory.md` and `docs/replication.md` ([`docs_table`]) derive from them.
//! Every bad value is reported with the variable, the value and what is allowed; the service
//! refuses to start rather than run with a silently different policy.
//!
//! The service's own variables are read leniently: surrounding spaces are dropped and an empty
//! value means unset. The shared ones are read as the filter reads them (see kvroute-core).
//!
//! [`SHADOW`] (`KVROUTE_SHADOW`) holds overrides of the scoring variables ([`SHADOW_VARS`]) for
//! the shadow policy ([`Settings::shadow`]): the environment is read a second time with them in
//! place of the live values, so each is validated by its own variable's parser.

use std::time::Duration;

use kvroute_core::rule::FieldError;
use kvroute_core::settings::{Kind, Setting, SettingsErrors};

/// How Tier 1.5 blends prefix overlap with endpoint load (`LOXILB_KV_LB_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadBlend {
    /// Pure highest-overlap argmax.
    Off,
    /// Capacity-weighted bounded load: highest overlap among endpoints under their cap.
    Hard,
    /// Overlap minus `load_penalty` x load.
    Soft,
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

pub const MEAN_LOAD_FACTOR: Setting = Setting::int(
    "LOXILB_KV_MEAN_LOAD_FACTOR",
    (100, 1000),
    175,
    "load cap in percent of the fair share: cap = ceil(factor/100 × total load × wᵢ / Σw)",
);
pub const SPILL_MIN_INFLIGHT: Setting = Setting::int(
    "KVROUTE_SPILL_MIN_INFLIGHT",
    (1, 100_000),
    4,
    "an endpoint with fewer requests in flight is never over its load cap (the mean load cap, or a \
     hot family's fair share): the requests an engine runs at once without queueing; 1 = the load \
     cap alone",
);
pub const LB_MODE: Setting = Setting::word(
    "LOXILB_KV_LB_MODE",
    &["off", "hard", "soft"],
    Some("hard"),
    "`off` (pure overlap argmax), `hard` (highest overlap under its load cap), `soft` (overlap − penalty × load)",
);
pub const LOAD_PENALTY: Setting = Setting {
    name: "LOXILB_KV_LOAD_PENALTY",
    kind: Kind::Number {
        min: 0.0,
        max: 1e6,
        default: 1.0,
    },
    help: "soft mode only: blocks of overlap one in-flight request costs",
};
pub const SHADOW: Setting = Setting::text(
    "KVROUTE_SHADOW",
    "comma-separated NAME=VALUE, NAME one of LLB_KV_MIN_MATCH_TOKENS, LOXILB_KV_SPILL_RELIEF, \
     LOXILB_KV_COLDSTART_SEED_N, LOXILB_KV_COLDSTART_MIN_BLOCKS, LOXILB_KV_MEAN_LOAD_FACTOR, \
     KVROUTE_SPILL_MIN_INFLIGHT, LOXILB_KV_LB_MODE, LOXILB_KV_LOAD_PENALTY, KVROUTE_PLACEMENT",
    "unset (off)",
    "the shadow policy: these scoring variables overridden on top of the live ones, each value read \
     as the variable itself reads it; every routed request is decided a second time with them, \
     only counted (`kvroute_shadow_*`), never acted on",
);
pub const SPEC_TTL_MS: Setting = Setting::int(
    "KVROUTE_SPEC_TTL_MS",
    (0, 600_000),
    2000,
    "speculative credit after a decision (the blind spot before BlockStored)",
);
pub const INFLIGHT_WINDOW_MS: Setting = Setting::int(
    "KVROUTE_INFLIGHT_WINDOW_MS",
    (1, 3_600_000),
    5000,
    "a decision counts as in flight this long (without scrapes)",
);
pub const SCRAPE_INTERVAL_MS: Setting = Setting::int(
    "KVROUTE_SCRAPE_INTERVAL_MS",
    (0, 3_600_000),
    0,
    "scrape each engine's `/metrics` this often, 0 disables (`vllm:num_requests_running`+`waiting`, \
     `sglang:num_running_reqs`+`num_queue_reqs`, `vllm:cache_config_info`)",
);
pub const HEALTH_INTERVAL_MS: Setting = Setting::int(
    "KVROUTE_HEALTH_INTERVAL_MS",
    (0, 3_600_000),
    500,
    "active health check period per endpoint, 0 disables; an unhealthy endpoint is never chosen",
);
pub const HEALTH_FALL: Setting = Setting::int(
    "KVROUTE_HEALTH_FALL",
    (1, 100),
    3,
    "consecutive failed probes (timeout, non-2xx) that mark an endpoint unhealthy; a refused \
     connection marks it at once",
);
pub const HEALTH_RISE: Setting = Setting::int(
    "KVROUTE_HEALTH_RISE",
    (1, 100),
    2,
    "consecutive 2xx probes that mark an unhealthy endpoint healthy again",
);
pub const HEALTH_TIMEOUT_MS: Setting = Setting::int(
    "KVROUTE_HEALTH_TIMEOUT_MS",
    (10, 60_000),
    1000,
    "how long one health probe may take before it counts as failed",
);
pub const HEALTH_PATH: Setting = Setting::text(
    "KVROUTE_HEALTH_PATH",
    "a path starting with /",
    "/health",
    "path probed on each endpoint's serving port",
);
pub const TRTLLM_DRAIN_MS: Setting = Setting::int(
    "KVROUTE_TRTLLM_DRAIN_MS",
    (10, 60_000),
    100,
    "TensorRT-LLM `/kv_cache_events` drain period",
);
pub const REPLAY_TIMEOUT_MS: Setting = Setting::int(
    "KVROUTE_REPLAY_TIMEOUT_MS",
    (10, 600_000),
    2000,
    "a replay not finished by then clears the endpoint instead",
);
pub const AFFINITY_SCOPE: Setting = Setting::word(
    "KVROUTE_AFFINITY_SCOPE",
    &["tenant", "tenant_model"],
    Some("tenant"),
    "what the sticky fallback hashes: the tenant, or the tenant and the model",
);
pub const PLACEMENT: Setting = Setting::word(
    "KVROUTE_PLACEMENT",
    &["footprint", "sel"],
    Some("footprint"),
    "how a new prefix family is placed: on the under-cap endpoint with the most free cache \
     (`sel` round robin and least loaded rules), or always by the rule's `sel`",
);
pub const PLACEMENT_MEMORY_ENTRIES: Setting = Setting::int(
    "KVROUTE_PLACEMENT_MEMORY_ENTRIES",
    (0, 16_777_216),
    65_536,
    "placement memory entries per rule (least recently used go first), 0 disables the memory",
);
pub const PLACEMENT_MEMORY_TTL_MS: Setting = Setting::int(
    "KVROUTE_PLACEMENT_MEMORY_TTL_MS",
    (1, 86_400_000),
    1_800_000,
    "a remembered prefix family is forgotten this long after its last use",
);
pub const SESSIONS_MAX: Setting = Setting::int(
    "KVROUTE_SESSIONS_MAX",
    (0, 16_777_216),
    100_000,
    "session bindings (conversation id to endpoint) per rule, least recently used go first; \
     0 disables the session tier",
);
pub const SESSION_TTL_MS: Setting = Setting::int(
    "KVROUTE_SESSION_TTL_MS",
    (0, 86_400_000),
    1_800_000,
    "a conversation's binding to its endpoint is forgotten this long after its last request; \
     0 disables the session tier",
);
pub const CPU_TIER_WEIGHT: Setting = Setting::int(
    "KVROUTE_CPU_TIER_WEIGHT",
    (0, 100),
    75,
    "percent of a GPU block's credit a block in an endpoint's host-memory tier earns past its \
     GPU match; 0 credits none",
);
pub const STORAGE_TIER_WEIGHT: Setting = Setting::int(
    "KVROUTE_STORAGE_TIER_WEIGHT",
    (0, 100),
    25,
    "percent of a GPU block's credit a block in an endpoint's storage tier earns past its GPU \
     and host-memory match; 0 credits none",
);
pub const PLACEMENT_CAPACITY_BLOCKS: Setting = Setting::int(
    "KVROUTE_PLACEMENT_CAPACITY_BLOCKS",
    (0, 1 << 40),
    0,
    "cache blocks assumed for an endpoint whose `num_gpu_blocks` was not scraped and whose rule \
     sets no `kvCapacityBlocks`, 0 = unknown",
);
pub const HTTP_HEADER_TIMEOUT_MS: Setting = Setting::int(
    "KVROUTE_HTTP_HEADER_TIMEOUT_MS",
    (100, 600_000),
    10_000,
    "a request's headers must be complete this long after its first byte, else the connection is closed",
);
pub const HTTP_IDLE_TIMEOUT_MS: Setting = Setting::int(
    "KVROUTE_HTTP_IDLE_TIMEOUT_MS",
    (100, 86_400_000),
    120_000,
    "a connection with no request in flight and no byte moving (or a TLS handshake) is closed after this long",
);
pub const MAX_CONNECTIONS: Setting = Setting::int(
    "KVROUTE_MAX_CONNECTIONS",
    (1, 1_000_000),
    4096,
    "open connections on the listener; past it new connections wait in the kernel backlog until \
     one closes. Keep it below the process's descriptor limit (`ulimit -n`) minus the engines' sockets",
);
pub const MAX_KEYS_PER_ENDPOINT: Setting = Setting::int(
    "KVROUTE_MAX_KEYS_PER_ENDPOINT",
    (0, 1 << 40),
    0,
    "blocks one endpoint may hold in the index (34 B each); 0 = 4 × the endpoint's capacity when \
     known (`kvCapacityBlocks` or the scraped `num_gpu_blocks`, at least 65536), else 16777216; \
     each tier (GPU, CPU, storage) apart. An engine event storing into a tier that already \
     holds it is refused and counted (`kvroute_index_key_cap_refusals_total`), so a tier exceeds \
     it by one event at most",
);
pub const MAX_PREFIX_TOKENS: Setting = Setting::int(
    "KVROUTE_MAX_PREFIX_TOKENS",
    (1, kvroute_core::bpe::MAX_PREFIX_TOKENS_LIMIT as u64),
    kvroute_core::bpe::MAX_PREFIX_TOKENS as u64,
    "offloaded tokenization routes on at most this many prompt tokens, each exactly the engine's; \
     a pre-token piece over 8 KiB is not merged and the keys stop before it (the filter's `max_prefix_tokens`)",
);
pub const ZMQ_IDLE_RECONNECT_MS: Setting = Setting::int(
    "KVROUTE_ZMQ_IDLE_RECONNECT_MS",
    (0, 3_600_000),
    30_000,
    "a connecting subscriber silent this long reconnects (a bound one stays bound and only shows \
     not connected), 0 disables; a publisher that closes its connection is noticed at once, \
     silence covers one whose host went away without closing it",
);

pub const REDIS_URL: Setting = Setting::text(
    "KVROUTE_REDIS_URL",
    "redis://host:port[/db] or rediss://host:port[/db]; in cluster mode several, comma-separated",
    "unset (standalone)",
    "share state across replicas through Redis; `rediss://` is TLS (rustls with the system roots); \
     with `KVROUTE_REDIS_MODE=cluster` the URLs are seed nodes of a Redis (or Valkey) Cluster",
);
pub const REDIS_MODE: Setting = Setting::word(
    "KVROUTE_REDIS_MODE",
    &["single", "cluster"],
    Some("single"),
    "`single` (one Redis, or a primary behind a stable address) or `cluster` (Redis Cluster: \
     the topology is discovered from the seed URLs, keys of one rule share a slot)",
);
pub const REDIS_USERNAME: Setting = Setting::text(
    "KVROUTE_REDIS_USERNAME",
    "an ACL user name",
    "from the URL",
    "ACL user (overrides one in the URL)",
);
pub const REDIS_PASSWORD_FILE: Setting = Setting::text(
    "KVROUTE_REDIS_PASSWORD_FILE",
    "a file path",
    "from the URL",
    "file holding the password, read at start (trailing newline dropped; empty or unreadable refuses to start)",
);
pub const REDIS_PREFIX: Setting = Setting::text(
    "KVROUTE_REDIS_PREFIX",
    "letters, digits and - _ . :",
    "kvroute",
    "prefix of every key kvroute writes",
);
pub const LEASE_MS: Setting = Setting::int(
    "KVROUTE_LEASE_MS",
    (300, 600_000),
    5000,
    "endpoint ownership lease, renewed every third; a dead owner is replaced within it",
);
pub const SNAPSHOT_INTERVAL_MS: Setting = Setting::int(
    "KVROUTE_SNAPSHOT_INTERVAL_MS",
    (500, 86_400_000),
    30_000,
    "how often an owner snapshots each endpoint it owns",
);
pub const STREAM_MAXLEN: Setting = Setting::int(
    "KVROUTE_STREAM_MAXLEN",
    (1000, 100_000_000),
    200_000,
    "approximate entries kept per rule log (must cover a snapshot interval of traffic)",
);
pub const REPLICA_ID: Setting = Setting::text(
    "KVROUTE_REPLICA_ID",
    "any name",
    "host-pid-random",
    "this replica's name in lease values and logs",
);
pub const DIVERGENCE_WINDOW_MS: Setting = Setting::int(
    "KVROUTE_DIVERGENCE_WINDOW_MS",
    (1000, 86_400_000),
    60_000,
    "how much of the filters' predicted-against-realised reports each endpoint's divergence \
     verdict looks at",
);
pub const DIVERGENCE_MIN_REQUESTS: Setting = Setting::int(
    "KVROUTE_DIVERGENCE_MIN_REQUESTS",
    (1, 1_000_000),
    20,
    "responses predicted to reuse at least 2 blocks, within the window, before an endpoint can be \
     judged divergent (it is when the engine reused no block for 80% of them)",
);
pub const DIVERGENCE_POLICY: Setting = Setting::word(
    "KVROUTE_DIVERGENCE_POLICY",
    &["load_only", "keep"],
    Some("load_only"),
    "routing for a divergent endpoint: `load_only` (its prefix overlap and placement memory are \
     ignored, so a wrong affinity cannot pile traffic on it) or `keep`",
);
pub const TENANTS_MAX: Setting = Setting::int(
    "KVROUTE_TENANTS_MAX",
    (0, 1_000_000),
    1000,
    "tenants each rule's accounting holds (`GET /v1/rules/{rule}/tenants`); past it new tenants \
     are summed as `(other)`; 0 turns the accounting off",
);
pub const CANARY_INTERVAL_MS: Setting = Setting::int(
    "KVROUTE_CANARY_INTERVAL_MS",
    (0, 86_400_000),
    0,
    "how often the parity canary sends each endpoint its synthetic requests and checks the \
     engine's tokens, keys and reuse against the rule's contract (0: off; see docs/operations.md)",
);
pub const CANARY_TIMEOUT_MS: Setting = Setting::int(
    "KVROUTE_CANARY_TIMEOUT_MS",
    (100, 600_000),
    10_000,
    "how long one canary run waits for each engine answer, and then for the engine's KV events",
);

/// What routing does with an endpoint whose engine does not reuse what was predicted
/// ([`DIVERGENCE_POLICY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DivergencePolicy {
    /// Route to it on load only.
    LoadOnly,
    /// Route as before (the signal is only reported).
    Keep,
}

/// Health check hysteresis ([`HEALTH_FALL`], [`HEALTH_RISE`], [`HEALTH_TIMEOUT_MS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthThresholds {
    /// Consecutive failed probes that mark an endpoint unhealthy (>= 1).
    pub fall: u32,
    /// Consecutive 2xx probes that mark it healthy again (>= 1).
    pub rise: u32,
    /// How long one probe may take.
    pub timeout: Duration,
}

/// The service's own tuning variables, in the order errors are reported (after the shared ones).
pub const SERVICE_VARS: [Setting; 36] = [
    MEAN_LOAD_FACTOR,
    SPILL_MIN_INFLIGHT,
    LB_MODE,
    LOAD_PENALTY,
    SHADOW,
    SPEC_TTL_MS,
    INFLIGHT_WINDOW_MS,
    SCRAPE_INTERVAL_MS,
    HEALTH_INTERVAL_MS,
    HEALTH_FALL,
    HEALTH_RISE,
    HEALTH_TIMEOUT_MS,
    HEALTH_PATH,
    TRTLLM_DRAIN_MS,
    REPLAY_TIMEOUT_MS,
    AFFINITY_SCOPE,
    PLACEMENT,
    PLACEMENT_MEMORY_ENTRIES,
    PLACEMENT_MEMORY_TTL_MS,
    SESSIONS_MAX,
    SESSION_TTL_MS,
    CPU_TIER_WEIGHT,
    STORAGE_TIER_WEIGHT,
    PLACEMENT_CAPACITY_BLOCKS,
    HTTP_HEADER_TIMEOUT_MS,
    HTTP_IDLE_TIMEOUT_MS,
    MAX_CONNECTIONS,
    MAX_KEYS_PER_ENDPOINT,
    MAX_PREFIX_TOKENS,
    ZMQ_IDLE_RECONNECT_MS,
    DIVERGENCE_WINDOW_MS,
    DIVERGENCE_MIN_REQUESTS,
    DIVERGENCE_POLICY,
    TENANTS_MAX,
    CANARY_INTERVAL_MS,
    CANARY_TIMEOUT_MS,
];

/// The variables [`SHADOW`] may override: every setting the pure scorer
/// ([`crate::score::decide`]) reads. The others shape what it is given (the endpoints' loads,
/// capacities and divergence, the affinity key, the placement memory) or what a decision does
/// afterwards, so the shadow, which sees the live decision's inputs and changes nothing, has no
/// use for them.
pub const SHADOW_VARS: [Setting; 9] = [
    kvroute_core::settings::MIN_MATCH_TOKENS,
    kvroute_core::settings::SPILL_RELIEF,
    kvroute_core::settings::COLDSTART_SEED_N,
    kvroute_core::settings::COLDSTART_MIN_BLOCKS,
    MEAN_LOAD_FACTOR,
    SPILL_MIN_INFLIGHT,
    LB_MODE,
    LOAD_PENALTY,
    PLACEMENT,
];

/// The replication variables (docs/replication.md); all but the URL need the URL.
pub const REDIS_VARS: [Setting; 9] = [
    REDIS_URL,
    REDIS_MODE,
    REDIS_USERNAME,
    REDIS_PASSWORD_FILE,
    REDIS_PREFIX,
    LEASE_MS,
    SNAPSHOT_INTERVAL_MS,
    STREAM_MAXLEN,
    REPLICA_ID,
];

/// Every variable the service reads: the shared ones, its own, then the replication ones.
pub fn env_vars() -> impl Iterator<Item = &'static Setting> {
    kvroute_core::settings::VARS
        .iter()
        .chain(SERVICE_VARS.iter())
        .chain(REDIS_VARS.iter())
}

/// The tuning variables for `serve --help`, one per line with what is allowed and the default.
pub fn env_help() -> String {
    let mut s = String::from("Tuning environment variables (read at start):\n");
    for v in env_vars() {
        s.push_str(&format!(
            "  {:<34} {} [{}; default {}]\n",
            v.name,
            v.help.replace('`', ""),
            v.allowed(),
            v.default_text()
        ));
    }
    s.push_str(&format!("  {:<34} log filter [default info]\n", "RUST_LOG"));
    s
}

/// The line before a generated settings table in the docs.
pub const DOCS_BEGIN: &str =
    "<!-- settings table: generated from inventory-svc/src/settings.rs (KVROUTE_WRITE_DOCS=1 cargo test -p kvroute-inventory --lib settings) -->";
/// The line after it.
pub const DOCS_END: &str = "<!-- end of settings table -->";

/// A Markdown table of `vars` (the docs' settings tables are this, checked by a test).
pub fn docs_table<'a>(vars: impl IntoIterator<Item = &'a Setting>) -> String {
    let mut s = String::from("| variable | default | allowed | meaning |\n|---|---|---|---|\n");
    for v in vars {
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            v.name,
            v.default_text(),
            v.allowed(),
            v.help
        ));
    }
    s
}

/// Scoring and ingestion tuning.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The settings shared with the filter: `LLB_KV_MIN_MATCH_TOKENS`, the NONE_HASH seed (rule
    /// validation needs it), `LOXILB_KV_SPILL_RELIEF`, `LOXILB_KV_COLDSTART_*`.
    pub core: kvroute_core::settings::Settings,
    /// [`TRTLLM_DRAIN_MS`].
    pub trtllm_drain_ms: u32,
    /// [`MEAN_LOAD_FACTOR`], in percent (175 = cap at 1.75 x fair share).
    pub mean_load_factor: u32,
    /// [`SPILL_MIN_INFLIGHT`]: no endpoint with fewer requests in flight is over its cap.
    pub spill_min_inflight: u64,
    /// [`LB_MODE`].
    pub load_blend: LoadBlend,
    /// [`LOAD_PENALTY`].
    pub load_penalty: f64,
    /// [`SPEC_TTL_MS`].
    pub spec_ttl: Duration,
    /// [`INFLIGHT_WINDOW_MS`].
    pub inflight_window: Duration,
    /// [`HEALTH_INTERVAL_MS`]; zero disables checks.
    pub health_interval: Duration,
    /// [`HEALTH_PATH`].
    pub health_path: String,
    /// [`HEALTH_FALL`], [`HEALTH_RISE`], [`HEALTH_TIMEOUT_MS`].
    pub health_thresholds: HealthThresholds,
    /// [`SCRAPE_INTERVAL_MS`]; zero disables.
    pub scrape_interval: Duration,
    /// [`REPLAY_TIMEOUT_MS`].
    pub replay_timeout: Duration,
    /// [`ZMQ_IDLE_RECONNECT_MS`]; zero disables.
    /// A closed connection ends a session at once; silence is the only sign of a publisher whose
    /// host went away without closing it, and an idle engine just gets a cheap reconnect.
    pub zmq_idle_reconnect: Duration,
    /// [`AFFINITY_SCOPE`] is `tenant_model` (the model joins the sticky key).
    pub affinity_scope_model: bool,
    /// [`PLACEMENT`].
    pub placement: Placement,
    /// [`PLACEMENT_MEMORY_ENTRIES`]: placement memory bound per rule; 0 disables the memory.
    pub memory_entries: usize,
    /// [`PLACEMENT_MEMORY_TTL_MS`].
    pub memory_ttl: Duration,
    /// [`SESSIONS_MAX`]: session bindings per rule; 0 disables the session tier.
    pub sessions_max: usize,
    /// [`SESSION_TTL_MS`]; zero disables the session tier.
    pub session_ttl: Duration,
    /// [`CPU_TIER_WEIGHT`] and [`STORAGE_TIER_WEIGHT`], in percent, by
    /// [`crate::index::Lower::index`].
    pub lower_weights: [u32; 2],
    /// [`PLACEMENT_CAPACITY_BLOCKS`]; 0 = unknown.
    pub capacity_blocks: u64,
    /// [`MAX_PREFIX_TOKENS`] (the filter's `max_prefix_tokens`).
    pub max_prefix_tokens: usize,
    /// Shared state across replicas ([`REDIS_URL`]); `None` runs standalone in memory.
    pub redis: Option<RedisSettings>,
    /// Listener limits.
    pub http: HttpLimits,
    /// [`MAX_KEYS_PER_ENDPOINT`]: 0 = sized from the endpoint's capacity (4 x `kvCapacityBlocks`
    /// or scraped num_gpu_blocks), else [`DEFAULT_MAX_KEYS_PER_ENDPOINT`].
    pub max_keys_per_endpoint: u64,
    /// [`DIVERGENCE_WINDOW_MS`], [`DIVERGENCE_MIN_REQUESTS`], [`DIVERGENCE_POLICY`].
    pub divergence: Divergence,
    /// [`TENANTS_MAX`]; 0 turns the per-tenant accounting off.
    pub tenants_max: usize,
    /// [`CANARY_INTERVAL_MS`] (zero: off) and [`CANARY_TIMEOUT_MS`].
    pub canary: Canary,
    /// [`SHADOW`]: these settings with its overrides applied (its own `shadow` is `None`);
    /// `None` when unset.
    pub shadow: Option<Box<Settings>>,
}

/// The parity canary's schedule ([`crate::canary`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Canary {
    /// Between two runs on one endpoint; zero disables the canary.
    pub interval: Duration,
    /// Each engine answer, then the events, may take this long.
    pub timeout: Duration,
}

/// When an endpoint counts as divergent, and what routing does then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divergence {
    pub window: Duration,
    /// Qualifying responses (predicted >= 2 blocks) needed in the window.
    pub min_requests: u64,
    pub policy: DivergencePolicy,
}

/// Blocks an endpoint may hold when neither the setting nor its capacity says otherwise: far above
/// any GPU's KV cache (an 80 GB GPU holds about 500k 16-token blocks of a small model), so it only
/// stops a publisher sending keys without bound (34 bytes each: 16M keys = 544 MB).
pub const DEFAULT_MAX_KEYS_PER_ENDPOINT: u64 = 16 << 20;

/// Bounds of every HTTP listener: a client cannot hold a connection without sending a request, nor
/// hold more than its share of file descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// [`HTTP_HEADER_TIMEOUT_MS`]: from a request's first byte to its complete headers.
    pub header_timeout: Duration,
    /// [`HTTP_IDLE_TIMEOUT_MS`]: a connection with no request in flight and no bytes moving
    /// is closed after this long (also bounds a TLS handshake).
    pub idle_timeout: Duration,
    /// [`MAX_CONNECTIONS`]: open connections; past it new connections wait in the kernel
    /// backlog until one closes.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Settings::default().http
    }
}

/// How the Redis URLs are used ([`REDIS_MODE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisMode {
    /// One server (or a primary behind one address): one URL.
    Single,
    /// A Redis Cluster: the URLs are seed nodes, the slots are discovered from them.
    Cluster,
}

/// Where and how replicas share state (see docs/replication.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisSettings {
    /// [`REDIS_URL`]: one URL, or in cluster mode comma-separated seed URLs ([`Self::urls`]).
    pub url: String,
    /// [`REDIS_MODE`].
    pub mode: RedisMode,
    /// [`REDIS_USERNAME`] (overrides one in the URL).
    pub username: Option<String>,
    /// [`REDIS_PASSWORD_FILE`] (read at start; trailing newline dropped).
    pub password_file: Option<std::path::PathBuf>,
    /// [`REDIS_PREFIX`].
    pub prefix: String,
    /// [`LEASE_MS`].
    pub lease: Duration,
    /// [`SNAPSHOT_INTERVAL_MS`].
    pub snapshot_interval: Duration,
    /// [`STREAM_MAXLEN`].
    pub stream_maxlen: u64,
    /// [`REPLICA_ID`] (default host-pid-random).
    pub replica_id: Option<String>,
}

impl RedisSettings {
    /// Defaults for `url`.
    pub fn new(url: &str) -> RedisSettings {
        Env::new(&unset).redis(url.to_owned())
    }

    /// The URLs of [`REDIS_URL`] (one in single mode, the seed nodes in cluster mode).
    pub fn urls(&self) -> Vec<&str> {
        split_urls(&self.url)
    }
}

/// Comma-separated URLs, blanks dropped.
fn split_urls(raw: &str) -> Vec<&str> {
    raw.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

impl Default for Settings {
    /// The all-unset environment: what production runs with no variable set.
    fn default() -> Self {
        Env::new(&unset).settings()
    }
}

impl Settings {
    /// Reads the variables through `lookup` (tests pass a map; main passes `std::env::var`).
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsErrors> {
        let mut env = Env::new(&lookup);
        let s = env.settings();
        if env.errs.is_empty() {
            Ok(s)
        } else {
            Err(SettingsErrors(env.errs))
        }
    }
}

/// The empty environment.
fn unset(_: &str) -> Option<String> {
    None
}

/// One reading of the environment: every variable, each rejected one recorded and left at its
/// default (so the defaults and the parsed values come from the same code).
struct Env<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
    errs: Vec<FieldError>,
}

impl<'a> Env<'a> {
    fn new(lookup: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Env {
            lookup,
            errs: Vec::new(),
        }
    }

    /// A service variable's value: trimmed, empty = unset.
    fn get(&self, v: &Setting) -> Option<String> {
        (self.lookup)(v.name)
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    }

    fn int(&mut self, v: &Setting) -> u64 {
        let raw = self.get(v);
        v.parse_int(raw.as_deref(), &mut self.errs)
    }

    fn ms(&mut self, v: &Setting) -> Duration {
        Duration::from_millis(self.int(v))
    }

    /// A word variable: `values` in the order of its words (its default word is always one of
    /// them, which a test checks, so the first value is never taken).
    fn word<T: Copy, const N: usize>(
        &mut self,
        v: &Setting,
        raw: Option<String>,
        values: [T; N],
    ) -> T {
        v.parse_word(raw.as_deref(), &values, &mut self.errs)
            .unwrap_or(values[0])
    }

    /// A text variable `check` accepts (its default text when unset or rejected).
    fn text(&mut self, v: &Setting, check: impl Fn(&str) -> bool) -> String {
        let default = match v.kind {
            Kind::Text { default, .. } => default,
            _ => "",
        };
        match self.get(v) {
            Some(s) if check(&s) => s,
            Some(s) => {
                v.reject(&s, &mut self.errs);
                default.to_owned()
            }
            None => default.to_owned(),
        }
    }

    fn settings(&mut self) -> Settings {
        let core = match kvroute_core::settings::Settings::from_env(self.lookup) {
            Ok(core) => core,
            Err(e) => {
                self.errs.extend(e.0);
                kvroute_core::settings::Settings::default()
            }
        };
        let mean_load_factor = self.int(&MEAN_LOAD_FACTOR);
        let spill_min_inflight = self.int(&SPILL_MIN_INFLIGHT);
        // Spellings the seed accepted besides the documented words.
        let blend = self
            .get(&LB_MODE)
            .map(|v| match v.to_ascii_lowercase().as_str() {
                "0" => "off".to_owned(),
                "1" | "on" => "hard".to_owned(),
                other => other.to_owned(),
            });
        let load_blend = self.word(
            &LB_MODE,
            blend,
            [LoadBlend::Off, LoadBlend::Hard, LoadBlend::Soft],
        );
        let raw = self.get(&LOAD_PENALTY);
        let load_penalty = LOAD_PENALTY.parse_number(raw.as_deref(), &mut self.errs);
        let spec_ttl = self.ms(&SPEC_TTL_MS);
        let inflight_window = self.ms(&INFLIGHT_WINDOW_MS);
        let scrape_interval = self.ms(&SCRAPE_INTERVAL_MS);
        let health_interval = self.ms(&HEALTH_INTERVAL_MS);
        let health_path = self.text(&HEALTH_PATH, |p| p.starts_with('/'));
        let health_thresholds = HealthThresholds {
            fall: u32::try_from(self.int(&HEALTH_FALL)).unwrap_or(u32::MAX),
            rise: u32::try_from(self.int(&HEALTH_RISE)).unwrap_or(u32::MAX),
            timeout: self.ms(&HEALTH_TIMEOUT_MS),
        };
        let trtllm_drain_ms = u32::try_from(self.int(&TRTLLM_DRAIN_MS)).unwrap_or(u32::MAX);
        let replay_timeout = self.ms(&REPLAY_TIMEOUT_MS);
        let affinity_scope_model =
            self.word(&AFFINITY_SCOPE, self.get(&AFFINITY_SCOPE), [false, true]);
        let placement = self.word(
            &PLACEMENT,
            self.get(&PLACEMENT),
            [Placement::Footprint, Placement::Sel],
        );
        let memory_entries = self.int(&PLACEMENT_MEMORY_ENTRIES);
        let memory_ttl = self.ms(&PLACEMENT_MEMORY_TTL_MS);
        let capacity_blocks = self.int(&PLACEMENT_CAPACITY_BLOCKS);
        let sessions_max = self.int(&SESSIONS_MAX);
        let session_ttl = self.ms(&SESSION_TTL_MS);
        let lower_weights = [CPU_TIER_WEIGHT, STORAGE_TIER_WEIGHT]
            .map(|w| u32::try_from(self.int(&w)).unwrap_or(100));
        let http = HttpLimits {
            header_timeout: self.ms(&HTTP_HEADER_TIMEOUT_MS),
            idle_timeout: self.ms(&HTTP_IDLE_TIMEOUT_MS),
            max_connections: usize::try_from(self.int(&MAX_CONNECTIONS)).unwrap_or(usize::MAX),
        };
        let max_keys_per_endpoint = self.int(&MAX_KEYS_PER_ENDPOINT);
        let max_prefix_tokens = self.int(&MAX_PREFIX_TOKENS);
        let zmq_idle_reconnect = self.ms(&ZMQ_IDLE_RECONNECT_MS);
        let divergence = Divergence {
            window: self.ms(&DIVERGENCE_WINDOW_MS),
            min_requests: self.int(&DIVERGENCE_MIN_REQUESTS),
            policy: self.word(
                &DIVERGENCE_POLICY,
                self.get(&DIVERGENCE_POLICY),
                [DivergencePolicy::LoadOnly, DivergencePolicy::Keep],
            ),
        };
        let tenants_max = usize::try_from(self.int(&TENANTS_MAX)).unwrap_or(usize::MAX);
        let canary = Canary {
            interval: self.ms(&CANARY_INTERVAL_MS),
            timeout: self.ms(&CANARY_TIMEOUT_MS),
        };
        let redis = self.redis_from_env();
        let shadow = self.shadow_from_env();
        Settings {
            core,
            trtllm_drain_ms,
            mean_load_factor: u32::try_from(mean_load_factor).unwrap_or(u32::MAX),
            spill_min_inflight,
            load_blend,
            load_penalty,
            spec_ttl,
            inflight_window,
            health_interval,
            health_path,
            health_thresholds,
            scrape_interval,
            replay_timeout,
            zmq_idle_reconnect,
            affinity_scope_model,
            placement,
            memory_entries: usize::try_from(memory_entries).unwrap_or(usize::MAX),
            memory_ttl,
            sessions_max: usize::try_from(sessions_max).unwrap_or(usize::MAX),
            session_ttl,
            lower_weights,
            capacity_blocks,
            max_prefix_tokens: usize::try_from(max_prefix_tokens).unwrap_or(usize::MAX),
            redis,
            http,
            max_keys_per_endpoint,
            divergence,
            tenants_max,
            canary,
            shadow,
        }
    }

    /// The shadow configuration ([`SHADOW`]): the environment read again with its overrides in
    /// place of the live values, so each value goes through its variable's own parser. Every
    /// problem names `KVROUTE_SHADOW` and the pair; a problem of a variable the shadow does not
    /// override is the live one, already reported.
    fn shadow_from_env(&mut self) -> Option<Box<Settings>> {
        let raw = self.get(&SHADOW)?;
        // (variable, value, the pair as written)
        let mut overrides: Vec<(&'static str, &str, &str)> = Vec::new();
        for pair in raw.split(',').map(str::trim) {
            let var = pair.split_once('=').and_then(|(name, value)| {
                let v = SHADOW_VARS.iter().find(|v| v.name == name.trim())?;
                Some((v.name, value))
            });
            match var {
                None => SHADOW.reject(pair, &mut self.errs),
                Some((name, _)) if overrides.iter().any(|o| o.0 == name) => {
                    self.errs.push(FieldError::new(
                        SHADOW.name,
                        kvroute_core::rule::quoted(pair),
                        "one pair per variable",
                    ));
                }
                Some((name, value)) => overrides.push((name, value, pair)),
            }
        }
        let live = self.lookup;
        let lookup = |name: &str| match overrides.iter().find(|o| o.0 == name) {
            Some(o) => Some(o.1.to_owned()),
            None if name == SHADOW.name => None,
            None => live(name),
        };
        let mut env = Env::new(&lookup);
        let shadow = env.settings();
        for e in env.errs {
            if let Some((name, _, pair)) = overrides.iter().find(|o| o.0 == e.field) {
                self.errs.push(FieldError::new(
                    SHADOW.name,
                    kvroute_core::rule::quoted(pair),
                    format!("{name}={}", e.allowed),
                ));
            }
        }
        Some(Box::new(shadow))
    }

    /// The Redis variables; `None` without `KVROUTE_REDIS_URL` (any other Redis variable is then
    /// an error, so a half-configured replica does not silently run standalone).
    fn redis_from_env(&mut self) -> Option<RedisSettings> {
        let Some(url) = self.get(&REDIS_URL) else {
            for v in &REDIS_VARS[1..] {
                if let Some(value) = self.get(v) {
                    self.errs.push(FieldError::new(
                        v.name,
                        kvroute_core::rule::quoted(&value),
                        format!("only with {} set", REDIS_URL.name),
                    ));
                }
            }
            return None;
        };
        let mode = self.word(
            &REDIS_MODE,
            self.get(&REDIS_MODE),
            [RedisMode::Single, RedisMode::Cluster],
        );
        let urls = split_urls(&url);
        if urls.is_empty()
            || !urls
                .iter()
                .all(|u| u.starts_with("redis://") || u.starts_with("rediss://"))
        {
            REDIS_URL.reject(&url, &mut self.errs);
        } else if urls.len() > 1 && mode == RedisMode::Single {
            self.errs.push(FieldError::new(
                REDIS_URL.name,
                kvroute_core::rule::quoted(&url),
                format!(
                    "one URL (several seed nodes need {}=cluster)",
                    REDIS_MODE.name
                ),
            ));
        }
        let mut r = self.redis(url);
        r.mode = mode;
        Some(r)
    }

    /// The replication settings of `url` from the other Redis variables.
    fn redis(&mut self, url: String) -> RedisSettings {
        RedisSettings {
            url,
            mode: RedisMode::Single,
            username: self.get(&REDIS_USERNAME),
            password_file: self.get(&REDIS_PASSWORD_FILE).map(std::path::PathBuf::from),
            prefix: self.text(&REDIS_PREFIX, |p| {
                p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
            }),
            lease: self.ms(&LEASE_MS),
            snapshot_interval: self.ms(&SNAPSHOT_INTERVAL_MS),
            stream_maxlen: self.int(&STREAM_MAXLEN),
            replica_id: self.get(&REPLICA_ID),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
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
            e.0.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["KVROUTE_MAX_PREFIX_TOKENS: got \"0\", allowed: 1-1048576"]
        );
        let e = Settings::from_env(|k| match k {
            "LOXILB_KV_MEAN_LOAD_FACTOR" => Some("5".into()),
            "LOXILB_KV_SPILL_RELIEF" => Some("maybe".into()),
            "LOXILB_KV_LB_MODE" => Some("x".into()),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
        assert_eq!(e.0[0].field, "LOXILB_KV_SPILL_RELIEF");
        assert_eq!(e.0[1].field, "LOXILB_KV_MEAN_LOAD_FACTOR");
        assert_eq!(
            e.0[2].to_string(),
            "LOXILB_KV_LB_MODE: got \"x\", allowed: off, hard, soft"
        );
    }

    #[test]
    fn default_is_the_unset_environment() {
        let (d, e) = (Settings::default(), Settings::from_env(|_| None).unwrap());
        assert_eq!(format!("{d:?}"), format!("{e:?}"));
        // The shared defaults are production's, not zero (cold-start seeding is on).
        assert_eq!(
            (
                d.core.min_match_tokens(),
                d.core.coldstart_seed_n(),
                d.core.coldstart_min_blocks()
            ),
            (16, 16, 16)
        );
        assert_eq!(d.http, HttpLimits::default());
        assert_eq!(
            RedisSettings::new("redis://r:1").lease,
            Duration::from_millis(5000)
        );
    }

    #[test]
    fn lenient_service_values() {
        let s = Settings::from_env(|k| match k {
            "LOXILB_KV_LB_MODE" => Some(" ON ".into()),
            "KVROUTE_SPEC_TTL_MS" => Some(" 700 ".into()),
            "KVROUTE_PLACEMENT" => Some("".into()),
            "KVROUTE_AFFINITY_SCOPE" => Some("tenant_model".into()),
            "LOXILB_KV_LOAD_PENALTY" => Some("2.5".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(s.load_blend, LoadBlend::Hard);
        assert_eq!(s.spec_ttl, Duration::from_millis(700));
        assert_eq!(s.placement, Placement::Footprint);
        assert!(s.affinity_scope_model);
        assert_eq!(s.load_penalty, 2.5);
        for (v, want) in [
            ("0", LoadBlend::Off),
            ("1", LoadBlend::Hard),
            ("Soft", LoadBlend::Soft),
        ] {
            let s = Settings::from_env(|k| (k == "LOXILB_KV_LB_MODE").then(|| v.into())).unwrap();
            assert_eq!(s.load_blend, want, "{v}");
        }
        let e = Settings::from_env(|k| (k == "KVROUTE_HEALTH_PATH").then(|| "health".into()))
            .unwrap_err();
        assert_eq!(
            e.0[0].to_string(),
            "KVROUTE_HEALTH_PATH: got \"health\", allowed: a path starting with /"
        );
    }

    #[test]
    fn descriptors_are_coherent() {
        let names: Vec<&str> = env_vars().map(|v| v.name).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "a variable is listed twice");
        for v in env_vars() {
            if let Kind::Word {
                words,
                default: Some(d),
            } = v.kind
            {
                assert!(
                    words.contains(&d),
                    "{}: default {d} is not one of {words:?}",
                    v.name
                );
            }
            assert!(!v.help.is_empty(), "{}", v.name);
        }
        assert!(MAX_KEYS_PER_ENDPOINT
            .help
            .contains(&DEFAULT_MAX_KEYS_PER_ENDPOINT.to_string()));
        // The drift this table replaced: the help said the cold-start variables default to 0.
        let help = env_help();
        assert!(help.contains("LOXILB_KV_COLDSTART_SEED_N"), "{help}");
        for line in help
            .lines()
            .filter(|l| l.trim_start().starts_with("LOXILB_KV_COLDSTART"))
        {
            assert!(line.ends_with("default 16]"), "{line}");
        }
    }

    /// The settings tables of the docs are generated from the descriptors; regenerate with
    /// `KVROUTE_WRITE_DOCS=1 cargo test -p kvroute-inventory --lib settings::tests::docs_tables`.
    #[test]
    fn docs_tables_match_the_descriptors() {
        let tuning = docs_table(
            kvroute_core::settings::VARS
                .iter()
                .chain(SERVICE_VARS.iter()),
        );
        let redis = docs_table(REDIS_VARS.iter());
        for (file, table) in [("inventory.md", tuning), ("replication.md", redis)] {
            crate::docgen::check(
                file,
                DOCS_BEGIN,
                DOCS_END,
                &table,
                "KVROUTE_WRITE_DOCS=1 cargo test -p kvroute-inventory --lib settings",
            );
        }
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
        let msgs: Vec<String> = e.0.iter().map(ToString::to_string).collect();
        assert!(msgs
            .iter()
            .any(|m| m.starts_with("KVROUTE_REDIS_URL: got \"http://x\", allowed: redis://")));
        assert!(msgs
            .iter()
            .any(|m| m.starts_with("KVROUTE_LEASE_MS: got \"5\", allowed: 300-600000")));
        assert_eq!(r.mode, RedisMode::Single);
        let s = Settings::from_env(|k| match k {
            "KVROUTE_REDIS_URL" => Some("redis://10.0.0.1:6379, redis://10.0.0.2:6379".into()),
            "KVROUTE_REDIS_MODE" => Some("cluster".into()),
            _ => None,
        })
        .unwrap();
        let r = s.redis.unwrap();
        assert_eq!(r.mode, RedisMode::Cluster);
        assert_eq!(r.urls(), ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]);
        let e = Settings::from_env(|k| match k {
            "KVROUTE_REDIS_URL" => Some("redis://a:1,redis://b:1".into()),
            "KVROUTE_REDIS_MODE" => Some("sentinel".into()),
            _ => None,
        })
        .unwrap_err();
        let msgs: Vec<String> = e.0.iter().map(ToString::to_string).collect();
        assert_eq!(
            msgs,
            [
                "KVROUTE_REDIS_MODE: got \"sentinel\", allowed: single, cluster",
                "KVROUTE_REDIS_URL: got \"redis://a:1,redis://b:1\", allowed: one URL (several seed nodes need KVROUTE_REDIS_MODE=cluster)"
            ]
        );
        let e =
            Settings::from_env(|k| (k == "KVROUTE_LEASE_MS").then(|| "1000".into())).unwrap_err();
        assert_eq!(
            e.0[0].to_string(),
            "KVROUTE_LEASE_MS: got \"1000\", allowed: only with KVROUTE_REDIS_URL set"
        );
    }

    /// The environment `live` plus `KVROUTE_SHADOW=shadow`.
    fn with_shadow(
        live: &'static [(&'static str, &'static str)],
        shadow: &'static str,
    ) -> Result<Settings, SettingsErrors> {
        Settings::from_env(move |k| match k {
            "KVROUTE_SHADOW" => Some(shadow.to_owned()),
            _ => live
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned()),
        })
    }

    fn messages(e: &SettingsErrors) -> Vec<String> {
        e.0.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn shadow_is_the_live_settings_with_its_overrides() {
        let s = Settings::from_env(|_| None).unwrap();
        assert!(s.shadow.is_none());
        for blank in ["", "  "] {
            assert!(
                with_shadow(&[], blank).unwrap().shadow.is_none(),
                "{blank:?}"
            );
        }
        let live = &[
            ("LOXILB_KV_LB_MODE", "soft"),
            ("KVROUTE_SPEC_TTL_MS", "700"),
            ("LOXILB_KV_COLDSTART_SEED_N", "4"),
        ];
        let s = with_shadow(
            live,
            " LOXILB_KV_LOAD_PENALTY=2.5, LOXILB_KV_SPILL_RELIEF=off,LLB_KV_MIN_MATCH_TOKENS=64 ",
        )
        .unwrap();
        let sh = s.shadow.as_deref().unwrap();
        assert!(sh.shadow.is_none());
        // Overridden ...
        assert_eq!(sh.load_penalty, 2.5);
        assert_eq!(
            sh.core.spill_relief(),
            kvroute_core::settings::SpillRelief::Off
        );
        assert_eq!(sh.core.min_match_tokens(), 64);
        // ... and everything else as live.
        assert_eq!(
            (sh.load_blend, sh.spec_ttl, sh.core.coldstart_seed_n()),
            (LoadBlend::Soft, Duration::from_millis(700), 4)
        );
        assert_eq!(
            (
                s.load_penalty,
                s.core.spill_relief(),
                s.core.min_match_tokens()
            ),
            (1.0, kvroute_core::settings::SpillRelief::Unset, 16)
        );
        // A value is read as its variable reads it: the seed's spellings of the mode, a service
        // variable's empty value is its default.
        let s = with_shadow(live, "LOXILB_KV_LB_MODE=1,LOXILB_KV_MEAN_LOAD_FACTOR=").unwrap();
        let sh = s.shadow.unwrap();
        assert_eq!((sh.load_blend, sh.mean_load_factor), (LoadBlend::Hard, 175));
        // Overriding a variable with its live value gives the live settings.
        let s = with_shadow(live, "LOXILB_KV_LB_MODE=soft").unwrap();
        let mut sh = s.shadow.clone().unwrap();
        assert!(sh.shadow.is_none());
        sh.shadow = s.shadow.clone();
        assert_eq!(format!("{:?}", *sh), format!("{s:?}"));
    }

    /// Every variable the shadow takes changes it (a name listed but not applied would be a
    /// shadow identical to live), and the descriptor's allowed text lists exactly those.
    #[test]
    fn every_shadow_variable_is_applied_and_listed() {
        let base = format!("{:?}", Settings::default());
        let other = |v: &Setting| match v.kind {
            Kind::Int { default, .. } => (default + 1).to_string(),
            Kind::Number { default, .. } => (default + 1.0).to_string(),
            Kind::Word { words, default } => words
                .iter()
                .find(|w| Some(**w) != default)
                .map(|w| (*w).to_owned())
                .unwrap(),
            Kind::Text { .. } => unreachable!("{}", v.name),
        };
        for v in &SHADOW_VARS {
            let pair = format!("{}={}", v.name, other(v));
            let s = Settings::from_env(|k| (k == "KVROUTE_SHADOW").then(|| pair.clone())).unwrap();
            let sh = s.shadow.unwrap();
            assert_ne!(
                format!(
                    "{:?}",
                    Settings {
                        shadow: None,
                        ..*sh
                    }
                ),
                base,
                "{pair}"
            );
        }
        let Kind::Text { allowed, .. } = SHADOW.kind else {
            panic!("KVROUTE_SHADOW is text")
        };
        let names = SHADOW_VARS.map(|v| v.name).join(", ");
        assert_eq!(
            allowed,
            format!("comma-separated NAME=VALUE, NAME one of {names}")
        );
    }

    #[test]
    fn shadow_errors_name_the_variable_the_pair_and_what_is_allowed() {
        let names = SHADOW_VARS.map(|v| v.name).join(", ");
        let any = format!("allowed: comma-separated NAME=VALUE, NAME one of {names}");
        // (KVROUTE_SHADOW, every message)
        let rows: Vec<(&'static str, Vec<String>)> = vec![
            // unknown names, and variables that are not scoring ones
            ("FOO=1", vec![format!("got \"FOO=1\", {any}")]),
            ("loxilb_kv_lb_mode=soft", vec![format!("got \"loxilb_kv_lb_mode=soft\", {any}")]),
            ("KVROUTE_HEALTH_FALL=3", vec![format!("got \"KVROUTE_HEALTH_FALL=3\", {any}")]),
            ("KVROUTE_REDIS_URL=redis://r:1", vec![format!("got \"KVROUTE_REDIS_URL=redis://r:1\", {any}")]),
            ("LLB_KV_NONE_HASH_SEED=0", vec![format!("got \"LLB_KV_NONE_HASH_SEED=0\", {any}")]),
            ("KVROUTE_SHADOW=x", vec![format!("got \"KVROUTE_SHADOW=x\", {any}")]),
            // malformed pairs
            ("LOXILB_KV_LB_MODE", vec![format!("got \"LOXILB_KV_LB_MODE\", {any}")]),
            ("=soft", vec![format!("got \"=soft\", {any}")]),
            ("LOXILB_KV_LB_MODE=soft,,", vec![format!("got \"\", {any}"), format!("got \"\", {any}")]),
            // bad values, as each variable's own parser rejects them
            ("LOXILB_KV_LB_MODE=x", vec!["got \"LOXILB_KV_LB_MODE=x\", allowed: LOXILB_KV_LB_MODE=off, hard, soft".into()]),
            ("LOXILB_KV_LOAD_PENALTY=nan", vec!["got \"LOXILB_KV_LOAD_PENALTY=nan\", allowed: LOXILB_KV_LOAD_PENALTY=a number 0-1000000".into()]),
            ("LOXILB_KV_MEAN_LOAD_FACTOR=5", vec!["got \"LOXILB_KV_MEAN_LOAD_FACTOR=5\", allowed: LOXILB_KV_MEAN_LOAD_FACTOR=100-1000".into()]),
            ("KVROUTE_PLACEMENT=random", vec!["got \"KVROUTE_PLACEMENT=random\", allowed: KVROUTE_PLACEMENT=footprint, sel".into()]),
            // the shared variables are read as the filter reads them: digits only, no empty value
            ("LLB_KV_MIN_MATCH_TOKENS=-1", vec!["got \"LLB_KV_MIN_MATCH_TOKENS=-1\", allowed: LLB_KV_MIN_MATCH_TOKENS=0-4096".into()]),
            ("LOXILB_KV_COLDSTART_SEED_N= 3", vec!["got \"LOXILB_KV_COLDSTART_SEED_N= 3\", allowed: LOXILB_KV_COLDSTART_SEED_N=0-4294967295".into()]),
            ("LOXILB_KV_SPILL_RELIEF=", vec!["got \"LOXILB_KV_SPILL_RELIEF=\", allowed: LOXILB_KV_SPILL_RELIEF=on, off (or unset)".into()]),
            // a variable twice
            ("LOXILB_KV_LB_MODE=soft,LOXILB_KV_LB_MODE=off", vec!["got \"LOXILB_KV_LB_MODE=off\", allowed: one pair per variable".into()]),
            // every problem at once
            (
                "FOO=1, LOXILB_KV_LB_MODE=x, LOXILB_KV_COLDSTART_MIN_BLOCKS=many",
                vec![
                    format!("got \"FOO=1\", {any}"),
                    "got \"LOXILB_KV_COLDSTART_MIN_BLOCKS=many\", allowed: LOXILB_KV_COLDSTART_MIN_BLOCKS=0-4294967295".into(),
                    "got \"LOXILB_KV_LB_MODE=x\", allowed: LOXILB_KV_LB_MODE=off, hard, soft".into(),
                ],
            ),
        ];
        for (shadow, want) in rows {
            let e = with_shadow(&[], shadow).unwrap_err();
            let want: Vec<String> = want
                .iter()
                .map(|m| format!("KVROUTE_SHADOW: {m}"))
                .collect();
            assert_eq!(messages(&e), want, "{shadow}");
        }
        // A live problem is reported once, as the live variable's, not again as the shadow's.
        let e = with_shadow(
            &[("LOXILB_KV_MEAN_LOAD_FACTOR", "5")],
            "LOXILB_KV_LB_MODE=soft",
        )
        .unwrap_err();
        assert_eq!(
            messages(&e),
            ["LOXILB_KV_MEAN_LOAD_FACTOR: got \"5\", allowed: 100-1000"]
        );
        // A bad live value the shadow overrides is still the live one's problem.
        let e = with_shadow(&[("LOXILB_KV_LB_MODE", "x")], "LOXILB_KV_LB_MODE=soft").unwrap_err();
        assert_eq!(
            messages(&e),
            ["LOXILB_KV_LB_MODE: got \"x\", allowed: off, hard, soft"]
        );
    }
}
