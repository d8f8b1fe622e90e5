//! Prometheus metrics: `kvroute_<subsystem>_<name>_<unit>`, counters end in `_total`.
//!
//! Labels come from enums (engine, event type, tier, reason, cause) or from configuration (rule
//! name, endpoint index, rank) — never from request data, so cardinality is bounded by the config.

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// A label enum: each variant's label value written once, and the full list for pre-registering.
macro_rules! labels {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name { $($(#[$vm])* $v),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v),+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$v => $s),+ }
            }

            /// The value's position in [`Self::ALL`].
            #[allow(dead_code)]
            pub fn index(self) -> usize {
                self as usize
            }
        }
    };
}

labels! {
    /// `direction` of `kvroute_replication_entries_total`.
    ReplEntry {
        /// Appended to the replication log by this replica.
        Sent => "sent",
        /// Another replica's entry applied here.
        Applied => "applied",
        /// Not written: the outbox was full or Redis unreachable (the endpoint goes dirty).
        Dropped => "dropped",
        /// An entry that did not decode.
        Undecodable => "undecodable",
    }
}

labels! {
    /// `op` of `kvroute_redis_errors_total`.
    RedisOp {
        Lease => "lease",
        Read => "read",
        Write => "write",
        Ping => "ping",
        Snapshot => "snapshot",
        /// The writer's check that its last appended entry of a log is still there.
        Verify => "verify",
    }
}

labels! {
    /// `event` of `kvroute_replication_lease_changes_total`.
    LeaseChange {
        Acquired => "acquired",
        Lost => "lost",
        Released => "released",
    }
}

labels! {
    /// `cause` of `kvroute_replication_resyncs_total`.
    Resync {
        TailerReconnect => "tailer_reconnect",
        WriterReconnect => "writer_reconnect",
        /// Entries Redis acknowledged are gone (a failover to a replica that had not received
        /// them, or a restart): the owned endpoints of that log are snapshotted again.
        LostWrites => "lost_writes",
    }
}

labels! {
    /// `cause` of `kvroute_replication_snapshot_loads_total`.
    SnapshotLoad {
        /// A rule's tail starting (or restarting after an outage).
        Bootstrap => "bootstrap",
        /// Another replica's snapshot marker asking for a reload.
        Marker => "marker",
    }
}

labels! {
    /// `cause` of `kvroute_ingest_clears_total`: why an endpoint's inventory (one rank) was cleared.
    ClearCause {
        /// The publisher restarted (sequence back to 0, or lower after a reconnect).
        Restart => "restart",
        /// A run of in-order sequences below the last one (the last was out of range).
        Rewind => "rewind",
        /// Messages were lost and could not be replayed.
        Gap => "gap",
        /// The subscriber task failed: its sync state is lost.
        Reconnect => "reconnect",
        /// The engine published `AllBlocksCleared`.
        Event => "event",
        /// The engine-key map of a re-deriving keyer filled up.
        KeyerFull => "keyer_full",
        /// A replica took the endpoint over and cannot continue re-derived keys.
        Takeover => "takeover",
        /// TensorRT-LLM published a larger attention window than the one indexed: what was
        /// indexed was a sliding window's, the larger one is full attention.
        Window => "window",
    }
}

labels! {
    /// `result` of `kvroute_ingest_parity_checks_total`.
    ParityCheck {
        /// The keys recomputed from the event's `token_ids` equal the engine's.
        Match => "match",
        /// They differ (or the event's block size disagrees with the contract).
        Mismatch => "mismatch",
    }
}

labels! {
    /// `outcome` of `kvroute_ingest_replays_total`.
    Replay {
        Ok => "ok",
        Failed => "failed",
    }
}

labels! {
    /// `outcome` of `kvroute_epp_requests_total`: what the endpoint picker answered a request.
    EppOutcome {
        /// An endpoint was picked: the destination header and metadata were set.
        Picked => "picked",
        /// A failure let the request through unpinned (`--epp-failure-mode FailOpen`).
        FailOpen => "fail_open",
        /// A failure rejected the request (`--epp-failure-mode FailClose`).
        FailClose => "fail_close",
        /// The proxy's candidate subset held no eligible endpoint: 503 in either failure mode,
        /// as the endpoint picker protocol requires.
        SubsetUnavailable => "subset_unavailable",
    }
}

labels! {
    /// `reason` of `kvroute_epp_failures_total`: why the endpoint picker could not pick.
    EppFailure {
        /// No rule matches `--epp-rule` (not installed yet, or removed).
        NoRule => "no_rule",
        /// The rule routes on KV blocks but no tokenizer is staged for its model (or the rule
        /// lacks `kvModel`, or the service runs without `--tokenizer-dir`).
        NoTokenizer => "no_tokenizer",
        /// The body is not an OpenAI completions or chat completions request.
        BadBody => "bad_body",
        /// The body is over `--epp-max-body-bytes`.
        BodyTooLarge => "body_too_large",
        /// The template or the tokenizer failed on the prompt.
        Tokenize => "tokenize",
        /// No endpoint of the rule is healthy.
        NoEndpoint => "no_endpoint",
        /// The decision took longer than `--epp-timeout-ms`.
        Timeout => "timeout",
    }
}

labels! {
    /// `outcome` of `kvroute_epp_served_total`: the endpoint the proxy reports as having served
    /// a request (`x-gateway-destination-endpoint-served`) against the one picked.
    EppServed {
        Picked => "picked",
        /// Another endpoint served it (a proxy retry or fallback).
        Other => "other",
    }
}

labels! {
    /// `outcome` of `kvroute_epp_pool_syncs_total`: what bringing the picker's rule in line with
    /// its InferencePool's pods did (counted when the pods or the rule changed).
    PoolSync {
        /// The rule holds the pool's ready pods (installed now, or already).
        Installed => "installed",
        /// The rule with the pool's endpoints was refused (the log says why): the rule is left
        /// as it was.
        Rejected => "rejected",
        /// No ready pod: the rule is left as it was, the picker answers `no_endpoint`.
        Empty => "empty",
        /// Neither `--config` nor the management API has given the rule yet.
        Waiting => "waiting",
    }
}

labels! {
    /// `reason` of `kvroute_epp_pool_watch_restarts_total`.
    PoolRestart {
        /// The API server ended a watch (its timeout, a restart): resumed.
        Closed => "closed",
        /// The watch's resource version was compacted (410): listed again.
        Expired => "expired",
        /// A list or watch failed: listed again after a backoff; the last known set is kept.
        Error => "error",
    }
}

labels! {
    /// `state` of `kvroute_epp_pool_pods`.
    PodState {
        /// Has a pod IP, its `Ready` condition is `True` and it is not being deleted.
        Ready => "ready",
        NotReady => "not_ready",
    }
}

labels! {
    /// `outcome` of `kvroute_shadow_decisions_total`: the shadow policy's choice against the live one.
    ShadowOutcome {
        /// The endpoint the live policy chose.
        Same => "same",
        /// Another endpoint.
        Different => "different",
        /// None: the shadow found no endpoint.
        NoEndpoint => "no_endpoint",
    }
}

labels! {
    /// `outcome` of `kvroute_session_bindings_total`: what a committed decision did to the
    /// binding of the question's session.
    SessionOutcome {
        /// The session had no live binding: bound to the chosen endpoint.
        New => "new",
        /// Routed to its bound endpoint, the binding refreshed.
        Kept => "kept",
        /// Bound to another endpoint than the one read before the decision (a concurrent
        /// decision or another replica bound it meanwhile).
        Moved => "moved",
        /// The bound endpoint was unavailable: routed elsewhere, the binding kept.
        Detour => "detour",
        /// Bindings dropped, least recently used first, for `KVROUTE_SESSIONS_MAX`.
        Evicted => "evicted",
        /// Bindings dropped unused for longer than `KVROUTE_SESSION_TTL_MS`.
        Expired => "expired",
    }
}

/// `medium` of the lower-tier series: the index's lower tiers, fastest first
/// (`crate::index::Lower::as_str`).
pub const LOWER_MEDIA: [&str; 2] = ["cpu", "storage"];

/// Every metric the service exports, registered in one private registry.
pub struct Metrics {
    pub registry: Registry,
    /// `engine`, `type` (block_stored, block_removed, all_blocks_cleared).
    pub events: IntCounterVec,
    /// Blocks stored on a medium other than GPU (cpu and storage are indexed as lower tiers):
    /// `engine`, `medium`.
    pub non_gpu_blocks: IntCounterVec,
    /// Blocks of KV-cache groups other than full attention, not indexed: `engine`, `kind`, `event`.
    pub partial_group_blocks: IntCounterVec,
    /// `engine`.
    pub seq_gaps: IntCounterVec,
    /// `engine`, `outcome` (ok, failed, unconfigured).
    pub replays: IntCounterVec,
    /// Inventory clears: `engine`, `cause` ([`ClearCause`]).
    pub clears: IntCounterVec,
    /// `engine`.
    pub decode_errors: IntCounterVec,
    /// Parity self-check mismatches in engine key mode: `engine`.
    pub parity_mismatches: IntCounterVec,
    /// Parity self-checks run in engine key mode: `engine`, `result` ([`ParityCheck`]).
    parity_checks: IntCounterVec,
    /// Events whose blocks could not be keyed (tokens mode without a known parent, partial): `engine`.
    pub unkeyed_blocks: IntCounterVec,
    /// 1 while the subscriber / poller of `(rule, ep, rank)` is connected.
    pub subscriber_connected: IntGaugeVec,
    /// Blocks per endpoint: `rule`, `ep`.
    pub inventory_blocks: IntGaugeVec,
    /// `rule`, `ep`, `medium` (cpu, storage): blocks held in each lower cache tier.
    pub lower_blocks: IntGaugeVec,
    /// `medium`: blocks of the chosen endpoints' lower-tier runs, which the engines are expected
    /// to load instead of recomputing.
    pub route_lower_blocks: IntCounterVec,
    /// `tier` (tier15, fallback), `reason`.
    pub route_decisions: IntCounterVec,
    pub tier15_spills: IntCounter,
    pub tier15_cold_seeds: IntCounter,
    /// Decisions sent to a prefix family's remembered home (placement memory).
    pub tier15_remembered: IntCounter,
    /// New prefix families placed by free cache (footprint) instead of `sel`.
    pub tier15_placements: IntCounter,
    /// Decisions that went elsewhere because the family's remembered home is unhealthy.
    pub tier15_detours: IntCounter,
    /// What committed decisions did to session bindings: `outcome` ([`SessionOutcome`]).
    session_bindings: IntCounterVec,
    /// `session_bindings`' series per [`SessionOutcome`], looked up once (decisions count them).
    session_counters: Vec<IntCounter>,
    /// `route_lower_blocks`' series per [`LOWER_MEDIA`] entry, looked up once.
    route_lower_counters: Vec<IntCounter>,
    /// `kvroute_sessions{rule}`: session bindings the rule holds.
    pub sessions: IntGaugeVec,
    /// Blocks of prefix overlap given away per decision: the best overlap of an eligible healthy
    /// endpoint minus the chosen endpoint's (the price of load, spill and seeding).
    pub locality_given_away: Histogram,
    /// Decisions that gave some overlap away: `reason`.
    pub locality_given_away_decisions: IntCounterVec,
    /// The shadow policy's decisions (`KVROUTE_SHADOW`): `rule`, `outcome` ([`ShadowOutcome`]).
    pub shadow_decisions: IntCounterVec,
    /// Matched blocks of the endpoint the shadow chose, summed: `rule`.
    pub shadow_predicted_blocks: IntCounterVec,
    /// Matched blocks of the endpoint the live policy chose, over the same decisions: `rule`.
    pub live_predicted_blocks: IntCounterVec,
    /// The shadow's decisions by `rule`, `tier`, `reason`.
    pub shadow_tiers: IntCounterVec,
    pub route_latency: Histogram,
    /// Endpoint picker answers: `outcome` ([`EppOutcome`]).
    pub epp_requests: IntCounterVec,
    /// Endpoint picker failures: `reason` ([`EppFailure`]).
    pub epp_failures: IntCounterVec,
    /// Served-endpoint reports from the proxy: `outcome` ([`EppServed`]).
    pub epp_served: IntCounterVec,
    /// `kvroute_epp_usage_total{outcome}`: picked responses read to their end, `parsed` when
    /// their `usage` was found, `missing` otherwise.
    pub epp_usage: IntCounterVec,
    /// Time the endpoint picker holds a request: from the end of its body to the answer.
    pub epp_latency: Histogram,
    /// `kvroute_epp_pool_present`: 1 while the followed InferencePool exists.
    pub epp_pool_present: IntGauge,
    /// `kvroute_epp_pool_endpoints`: the picker rule's endpoints from the pool's ready pods.
    pub epp_pool_endpoints: IntGauge,
    /// `kvroute_epp_pool_pods{state}` ([`PodState`]).
    pub epp_pool_pods: IntGaugeVec,
    /// `kvroute_epp_pool_syncs_total{outcome}` ([`PoolSync`]).
    pub epp_pool_syncs: IntCounterVec,
    /// `kvroute_epp_pool_watch_restarts_total{collection,reason}` ([`PoolRestart`]).
    pub epp_pool_restarts: IntCounterVec,
    /// Offloaded prompts routed on a prefix of their tokens: `reason` (max_tokens, long_piece,
    /// media).
    pub offload_truncated: IntCounterVec,
    /// Decisions on prompts whose keys stop before the prompt's end: `cause` (why they stop),
    /// `reason` (the decision's).
    pub route_truncated: IntCounterVec,
    /// `rule`, `ep`: 1 healthy, 0 unhealthy.
    pub endpoint_healthy: IntGaugeVec,
    /// `rule`, `ep`: running + waiting requests from the last engine metrics scrape.
    pub endpoint_scraped_load: IntGaugeVec,
    /// `rule`, `ep`: the KV cache capacity placement uses (rule override, engine, or default).
    pub endpoint_capacity_blocks: IntGaugeVec,
    /// `rule`, `ep`: distinct blocks of remembered prefix families homed on the endpoint.
    pub endpoint_homed_blocks: IntGaugeVec,
    /// Replication log entries: `direction` (sent, applied, dropped, undecodable).
    pub repl_entries: IntCounterVec,
    /// Age of a replicated entry when another replica applied it.
    pub repl_lag_seconds: Histogram,
    /// Entries the last tail read returned (1..few when caught up, the read size when behind).
    pub repl_lag_entries: IntGauge,
    /// `rule`, `ep`: 1 while this replica holds the endpoint's lease (ingests it).
    pub lease_owned: IntGaugeVec,
    /// `event` (acquired, lost, released).
    pub lease_changes: IntCounterVec,
    /// `rule`, `ep`: seconds since the endpoint's snapshot (written here, or loaded here).
    pub snapshot_age: GaugeVec,
    /// `rule`, `ep`: bytes of the last snapshot written here.
    pub snapshot_bytes: IntGaugeVec,
    pub snapshots_written: IntCounter,
    /// `cause` (bootstrap, marker).
    pub snapshot_loads: IntCounterVec,
    /// `op` (write, read, lease, snapshot, ping).
    pub redis_errors: IntCounterVec,
    /// 1 while the writer reaches Redis.
    pub redis_connected: IntGauge,
    /// `reason` (writer_reconnect, tailer_reconnect).
    pub repl_resyncs: IntCounterVec,
    /// Length of the last Redis outage a resynchronisation covered.
    pub repl_last_gap_seconds: Gauge,
    /// Open HTTP connections (every listener).
    pub http_connections: IntGauge,
    /// Connections the service closed: `reason` (header_timeout, idle_timeout, tls_handshake).
    pub http_closes: IntCounterVec,
    /// Accepts that waited because `KVROUTE_MAX_CONNECTIONS` connections were open.
    pub http_limit_waits: IntCounter,
    /// Ingest events dropped as malformed: `engine`, `reason`.
    pub malformed_events: IntCounterVec,
    /// Stored blocks refused because the endpoint reached its key cap: `engine`.
    pub key_cap_refusals: IntCounterVec,
    /// Endpoint health probes: `outcome` (ok, refused, failed).
    pub health_probes: IntCounterVec,
    /// Judged responses the filters reported: `rule`, `ep`, `verdict` (exact, under, over).
    pub endpoint_outcomes: IntCounterVec,
    /// Blocks the route answers predicted / the engines reused, of judged responses: `rule`, `ep`.
    pub endpoint_predicted_blocks: IntCounterVec,
    pub endpoint_realised_blocks: IntCounterVec,
    /// Prompt tokens of judged responses / of those the engine reported cached: `rule`, `ep`.
    pub endpoint_prompt_tokens: IntCounterVec,
    pub endpoint_cached_tokens: IntCounterVec,
    /// 1 while the endpoint diverges: `rule`, `ep`.
    pub endpoint_divergent: IntGaugeVec,
    /// `kvroute_tenants{rule}`: tenants the rule's accounting holds.
    pub tenants: IntGaugeVec,
    /// `kvroute_tenant_folded_total{rule}`: tenant sums added to `(other)`.
    pub tenant_folded: IntCounterVec,
    /// `kvroute_canary_runs_total{outcome}`: parity canary runs by verdict.
    pub canary_runs: IntCounterVec,
    /// `kvroute_endpoint_canary_failing{rule,ep}`.
    pub endpoint_canary_failing: IntGaugeVec,
    /// Outcome reports applied.
    pub outcome_reports: IntCounter,
    /// Endpoints named in outcome reports that their rule does not have.
    pub outcome_unknown_endpoints: IntCounter,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let cv =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let gv =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntGaugeVec, prometheus::Error> {
                let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(g.clone()))?;
                Ok(g)
            };
        let g = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let c = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let h =
            |name: &str, help: &str, buckets: Vec<f64>| -> Result<Histogram, prometheus::Error> {
                let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let mut m = Metrics {
            events: cv("kvroute_ingest_events_total", "KV events applied, by engine and event type.", &["engine", "type"])?,
            non_gpu_blocks: cv(
                "kvroute_ingest_non_gpu_blocks_total",
                "Blocks stored on a medium other than GPU: cpu and storage are indexed as lower tiers, other media only counted.",
                &["engine", "medium"],
            )?,
            partial_group_blocks: cv(
                "kvroute_ingest_partial_attention_blocks_total",
                "Blocks stored or removed in a KV-cache group other than full attention (sliding window, Mamba): not indexed, so they neither fake nor erase a prefix.",
                &["engine", "kind", "event"],
            )?,
            seq_gaps: cv("kvroute_ingest_seq_gaps_total", "Sequence gaps detected per publisher.", &["engine"])?,
            replays: cv("kvroute_ingest_replays_total", "Replay attempts after a gap, by outcome.", &["engine", "outcome"])?,
            clears: cv("kvroute_ingest_clears_total", "Endpoint inventory clears, by cause.", &["engine", "cause"])?,
            decode_errors: cv("kvroute_ingest_decode_errors_total", "Frames or payloads that failed to decode.", &["engine"])?,
            parity_checks: cv(
                "kvroute_ingest_parity_checks_total",
                "Engine-mode parity self-checks run on BlockStored events with token ids, by result: zero means no check ran.",
                &["engine", "result"],
            )?,
            parity_mismatches: cv(
                "kvroute_ingest_parity_mismatches_total",
                "Engine-mode parity self-check mismatches (recomputed key differs from the engine's).",
                &["engine"],
            )?,
            unkeyed_blocks: cv(
                "kvroute_ingest_unkeyed_blocks_total",
                "Stored blocks that could not be keyed (unknown parent in tokens mode, partial blocks).",
                &["engine"],
            )?,
            subscriber_connected: gv(
                "kvroute_ingest_subscriber_connected",
                "1 while the event subscriber or drain poller of an endpoint rank is connected.",
                &["rule", "ep", "rank"],
            )?,
            inventory_blocks: gv("kvroute_index_blocks", "GPU blocks held per endpoint.", &["rule", "ep"])?,
            lower_blocks: gv(
                "kvroute_index_lower_blocks",
                "Blocks held per endpoint in a lower cache tier (medium: cpu for host memory, storage).",
                &["rule", "ep", "medium"],
            )?,
            route_lower_blocks: cv(
                "kvroute_route_lower_tier_blocks_total",
                "Blocks of the chosen endpoints' lower-tier runs (past their GPU match), which the engines load instead of recomputing, by medium.",
                &["medium"],
            )?,
            route_decisions: cv("kvroute_route_decisions_total", "Routing decisions by tier and reason.", &["tier", "reason"])?,
            tier15_spills: c("kvroute_tier15_spills_total", "Tier 1.5 decisions moved off the best-overlap endpoint by load.")?,
            tier15_cold_seeds: c("kvroute_tier15_cold_seeds_total", "Tier 1.5 hits sent to a cold endpoint to seed it.")?,
            tier15_remembered: c(
                "kvroute_tier15_remembered_total",
                "Tier 1.5 decisions sent to a prefix family's remembered home past the exact match.",
            )?,
            tier15_detours: c(
                "kvroute_tier15_home_detours_total",
                "Decisions sent elsewhere because the prefix family's remembered home is unhealthy (the family keeps its home).",
            )?,
            session_counters: Vec::new(),
            route_lower_counters: Vec::new(),
            session_bindings: cv(
                "kvroute_session_bindings_total",
                "Session bindings by what a committed decision did: new, kept, moved (the session was bound to another endpoint meanwhile, by a concurrent decision or another replica), detour (the bound endpoint was unavailable; the binding stays), evicted (dropped for KVROUTE_SESSIONS_MAX), expired (dropped unused past KVROUTE_SESSION_TTL_MS).",
                &["outcome"],
            )?,
            sessions: gv(
                "kvroute_sessions",
                "Session bindings the rule holds (KVROUTE_SESSIONS_MAX bounds it; bindings past KVROUTE_SESSION_TTL_MS are dropped by the rule's next binding).",
                &["rule"],
            )?,
            tier15_placements: c(
                "kvroute_tier15_footprint_placements_total",
                "New prefix families placed on the endpoint with the most free cache instead of by sel.",
            )?,
            offload_truncated: cv(
                "kvroute_offload_prompts_truncated_total",
                "Offloaded prompts routed on their first tokens only: max_tokens (KVROUTE_MAX_PREFIX_TOKENS reached), long_piece (stopped before a pre-token piece over 8 KiB, not merged) or media (stopped before a chat's first image, audio, video or prompt-embeddings part).",
                &["reason"],
            )?,
            route_truncated: cv(
                "kvroute_route_truncated_total",
                "Decisions on prompts whose keys stop before the prompt's end, by why (cause: max_tokens, long_piece, media) and the decision's reason.",
                &["cause", "reason"],
            )?,
            epp_requests: cv(
                "kvroute_epp_requests_total",
                "Endpoint picker (ext_proc) answers by outcome: picked, fail_open, fail_close, subset_unavailable.",
                &["outcome"],
            )?,
            epp_failures: cv(
                "kvroute_epp_failures_total",
                "Requests the endpoint picker could not pick an endpoint for, by reason.",
                &["reason"],
            )?,
            epp_usage: cv(
                "kvroute_epp_usage_total",
                "Picked responses the endpoint picker read to their end (response_body_mode STREAMED): parsed when their usage was found, missing otherwise.",
                &["outcome"],
            )?,
            epp_served: cv(
                "kvroute_epp_served_total",
                "Served-endpoint reports from the proxy: the picked endpoint or another (a retry or fallback).",
                &["outcome"],
            )?,
            epp_latency: h(
                "kvroute_epp_decision_duration_seconds",
                "Time the endpoint picker holds a request: from the end of its body to the answer (tokenization included).",
                vec![0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25],
            )?,
            epp_pool_present: g("kvroute_epp_pool_present",
                    "1 while the InferencePool the endpoint picker follows (--epp-pool) exists, 0 otherwise.")?,
            epp_pool_endpoints: g("kvroute_epp_pool_endpoints",
                    "Endpoints (ready pod x target port) the endpoint picker's rule holds from its InferencePool; 0 when no pod is ready.")?,
            epp_pool_pods: gv(
                "kvroute_epp_pool_pods",
                "Pods the InferencePool's selector names, by state: ready (a pod IP, Ready True, not being deleted) or not_ready.",
                &["state"],
            )?,
            epp_pool_syncs: cv(
                "kvroute_epp_pool_syncs_total",
                "Changes of the InferencePool's pods or of the picker's rule, by what bringing the rule in line did: installed, rejected, empty (no ready pod), waiting (no rule yet).",
                &["outcome"],
            )?,
            epp_pool_restarts: cv(
                "kvroute_epp_pool_watch_restarts_total",
                "Kubernetes API watches resumed or lists repeated, by collection (pods, inferencepools) and reason: closed (the server ended the watch), expired (410), error (the last known set is kept).",
                &["collection", "reason"],
            )?,
            locality_given_away: h(
                "kvroute_route_locality_given_away_blocks",
                "Per decision: the best prefix overlap (blocks) of an eligible healthy endpoint minus the chosen endpoint's.",
                vec![0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0],
            )?,
            locality_given_away_decisions: cv(
                "kvroute_route_locality_given_away_total",
                "Decisions sent to an endpoint with less prefix overlap than the best eligible healthy one, by reason.",
                &["reason"],
            )?,
            shadow_decisions: cv(
                "kvroute_shadow_decisions_total",
                "Routing decisions the shadow policy (KVROUTE_SHADOW) also made, by outcome: the live endpoint (same), another (different) or none (no_endpoint).",
                &["rule", "outcome"],
            )?,
            shadow_predicted_blocks: cv(
                "kvroute_shadow_predicted_blocks_total",
                "Over the shadow policy's decisions: matched blocks of the endpoint the shadow chose.",
                &["rule"],
            )?,
            live_predicted_blocks: cv(
                "kvroute_live_predicted_blocks_total",
                "Over the shadow policy's decisions: matched blocks of the endpoint the live policy chose.",
                &["rule"],
            )?,
            shadow_tiers: cv(
                "kvroute_shadow_tier_total",
                "The shadow policy's decisions by tier and reason.",
                &["rule", "tier", "reason"],
            )?,
            route_latency: h(
                "kvroute_route_duration_seconds",
                "Time to answer POST /v1/route.",
                vec![0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005, 0.025, 0.1],
            )?,
            endpoint_healthy: gv("kvroute_endpoint_healthy", "1 when the endpoint's active health check passes.", &["rule", "ep"])?,
            endpoint_scraped_load: gv(
                "kvroute_endpoint_scraped_load",
                "Running plus waiting requests reported by the engine's last metrics scrape.",
                &["rule", "ep"],
            )?,
            endpoint_capacity_blocks: gv(
                "kvroute_endpoint_capacity_blocks",
                "KV cache capacity in blocks that placement uses: the rule's kvCapacityBlocks, else the engine's num_gpu_blocks, else KVROUTE_PLACEMENT_CAPACITY_BLOCKS (0 = unknown).",
                &["rule", "ep"],
            )?,
            endpoint_homed_blocks: gv(
                "kvroute_endpoint_homed_blocks",
                "Distinct blocks of the prefix families the placement memory has homed on the endpoint.",
                &["rule", "ep"],
            )?,
            repl_entries: cv(
                "kvroute_replication_entries_total",
                "Replication log entries by direction (sent, applied, dropped, undecodable).",
                &["direction"],
            )?,
            repl_lag_seconds: h(
                "kvroute_replication_lag_seconds",
                "Age of a replication log entry when this replica applied it.",
                vec![0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
            )?,
            repl_lag_entries: g("kvroute_replication_lag_entries",
                    "Entries the last replication log read returned (the read size when behind).")?,
            lease_owned: gv(
                "kvroute_replication_lease_owned",
                "1 while this replica holds the endpoint's ingestion lease.",
                &["rule", "ep"],
            )?,
            lease_changes: cv(
                "kvroute_replication_lease_changes_total",
                "Endpoint lease events on this replica (acquired, lost, released).",
                &["event"],
            )?,
            snapshot_age: {
                let g = GaugeVec::new(
                    Opts::new(
                        "kvroute_replication_snapshot_age_seconds",
                        "Seconds since the endpoint's snapshot was written (owner) or taken (loader).",
                    ),
                    &["rule", "ep"],
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            snapshot_bytes: gv(
                "kvroute_replication_snapshot_bytes",
                "Size of the last snapshot this replica wrote for the endpoint.",
                &["rule", "ep"],
            )?,
            snapshots_written: c("kvroute_replication_snapshots_written_total", "Endpoint snapshots written.")?,
            snapshot_loads: cv(
                "kvroute_replication_snapshot_loads_total",
                "Endpoint snapshots loaded, by cause (bootstrap, marker).",
                &["cause"],
            )?,
            redis_errors: cv("kvroute_redis_errors_total", "Failed Redis operations, by operation.", &["op"])?,
            redis_connected: g("kvroute_redis_connected", "1 while the replication writer reaches Redis.")?,
            repl_resyncs: cv(
                "kvroute_replication_resyncs_total",
                "Resynchronisations after Redis came back or lost acknowledged writes, by side.",
                &["reason"],
            )?,
            repl_last_gap_seconds: {
                let g = Gauge::new(
                    "kvroute_replication_last_gap_seconds",
                    "Length of the last Redis outage a resynchronisation covered.",
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            http_connections: g("kvroute_http_connections", "Open HTTP connections on the service's listener.")?,
            http_closes: cv(
                "kvroute_http_connections_closed_total",
                "Connections the service closed, by reason (header_timeout, idle_timeout, tls_handshake).",
                &["reason"],
            )?,
            http_limit_waits: c(
                "kvroute_http_connection_limit_waits_total",
                "Accepts that waited for a free slot because KVROUTE_MAX_CONNECTIONS connections were open.",
            )?,
            malformed_events: cv(
                "kvroute_ingest_malformed_events_total",
                "Events inside a decodable batch that were dropped, by reason.",
                &["engine", "reason"],
            )?,
            key_cap_refusals: cv(
                "kvroute_index_key_cap_refusals_total",
                "Stored blocks refused because the endpoint holds KVROUTE_MAX_KEYS_PER_ENDPOINT blocks.",
                &["engine"],
            )?,
            health_probes: cv(
                "kvroute_endpoint_health_probes_total",
                "Endpoint health probes by outcome (ok, refused, failed).",
                &["outcome"],
            )?,
            endpoint_outcomes: cv(
                "kvroute_endpoint_outcomes_total",
                "Responses the filters judged: the engine reused exactly (exact), more (under) or fewer (over) blocks than the route answer predicted.",
                &["rule", "ep", "verdict"],
            )?,
            endpoint_predicted_blocks: cv(
                "kvroute_endpoint_predicted_blocks_total",
                "Blocks the route answers predicted the engine reuses, over judged responses.",
                &["rule", "ep"],
            )?,
            endpoint_realised_blocks: cv(
                "kvroute_endpoint_realised_blocks_total",
                "Blocks the engine reported reusing, over judged responses.",
                &["rule", "ep"],
            )?,
            endpoint_prompt_tokens: cv(
                "kvroute_endpoint_prompt_tokens_total",
                "Prompt tokens of the responses the filters judged.",
                &["rule", "ep"],
            )?,
            endpoint_cached_tokens: cv(
                "kvroute_endpoint_cached_tokens_total",
                "Of those, the tokens the engine reported as cached (cache-hit ratio = cached / prompt).",
                &["rule", "ep"],
            )?,
            endpoint_divergent: gv(
                "kvroute_endpoint_divergent",
                "1 while the endpoint's engine reuses none of the predicted blocks for most requests (KVROUTE_DIVERGENCE_*).",
                &["rule", "ep"],
            )?,
            tenants: gv(
                "kvroute_tenants",
                "Tenants the rule's per-tenant accounting holds (KVROUTE_TENANTS_MAX bounds it).",
                &["rule"],
            )?,
            tenant_folded: cv(
                "kvroute_tenant_folded_total",
                "Tenant sums added to the (other) tenant because the rule's accounting was full.",
                &["rule"],
            )?,
            canary_runs: cv(
                "kvroute_canary_runs_total",
                "Parity canary runs by verdict: healthy, a wrong leg (tokenizer, chat_template, block_size, seed, algorithm, lora, cache_salt, hash, no_reuse, no_events) or unreachable.",
                &["outcome"],
            )?,
            endpoint_canary_failing: gv(
                "kvroute_endpoint_canary_failing",
                "1 while the endpoint's latest parity canary run found a wrong leg of the hash contract (KVROUTE_CANARY_*).",
                &["rule", "ep"],
            )?,
            outcome_reports: c("kvroute_outcome_reports_total", "Outcome reports from filters applied.")?,
            outcome_unknown_endpoints: c(
                "kvroute_outcome_unknown_endpoints_total",
                "Endpoints named in outcome reports that their rule does not have (ignored).",
            )?,
            registry,
        };
        // Every reason is exported from the start (at 0).
        for t in kvroute_core::bpe::Truncation::ALL {
            m.offload_truncated.with_label_values(&[t.as_str()]);
            for r in kvroute_core::wire::Reason::ALL {
                m.route_truncated
                    .with_label_values(&[t.as_str(), r.as_str()]);
            }
        }
        m.session_counters = SessionOutcome::ALL
            .iter()
            .map(|o| m.session_bindings.with_label_values(&[o.as_str()]))
            .collect();
        m.route_lower_counters = LOWER_MEDIA
            .iter()
            .map(|medium| m.route_lower_blocks.with_label_values(&[medium]))
            .collect();
        for o in EppOutcome::ALL {
            m.epp_requests.with_label_values(&[o.as_str()]);
        }
        for f in EppFailure::ALL {
            m.epp_failures.with_label_values(&[f.as_str()]);
        }
        for o in EppServed::ALL {
            m.epp_served.with_label_values(&[o.as_str()]);
        }
        Ok(m)
    }

    /// Pre-registers the pool-following series at 0 (only a picker that follows a pool has them).
    pub fn epp_pool_series(&self) {
        for o in PoolSync::ALL {
            self.epp_pool_sync(*o);
        }
        for c in ["pods", "inferencepools"] {
            for r in PoolRestart::ALL {
                self.epp_pool_restart(c, *r);
            }
        }
        for s in PodState::ALL {
            self.epp_pool_pods(*s);
        }
    }

    /// `kvroute_epp_pool_syncs_total{outcome}`.
    pub fn epp_pool_sync(&self, o: PoolSync) -> IntCounter {
        self.epp_pool_syncs.with_label_values(&[o.as_str()])
    }

    /// `kvroute_epp_pool_watch_restarts_total{collection,reason}`.
    pub fn epp_pool_restart(&self, collection: &str, r: PoolRestart) -> IntCounter {
        self.epp_pool_restarts
            .with_label_values(&[collection, r.as_str()])
    }

    /// `kvroute_epp_pool_pods{state}`.
    pub fn epp_pool_pods(&self, s: PodState) -> IntGauge {
        self.epp_pool_pods.with_label_values(&[s.as_str()])
    }

    /// `kvroute_epp_requests_total{outcome}`.
    pub fn epp_outcome(&self, o: EppOutcome) -> IntCounter {
        self.epp_requests.with_label_values(&[o.as_str()])
    }

    /// `kvroute_epp_failures_total{reason}`.
    pub fn epp_failure(&self, f: EppFailure) -> IntCounter {
        self.epp_failures.with_label_values(&[f.as_str()])
    }

    /// `kvroute_epp_served_total{outcome}`.
    pub fn epp_served(&self, o: EppServed) -> IntCounter {
        self.epp_served.with_label_values(&[o.as_str()])
    }

    /// `kvroute_replication_entries_total{direction}`.
    pub fn repl_entry(&self, e: ReplEntry) -> IntCounter {
        self.repl_entries.with_label_values(&[e.as_str()])
    }

    /// `kvroute_redis_errors_total{op}`.
    pub fn redis_error(&self, op: RedisOp) -> IntCounter {
        self.redis_errors.with_label_values(&[op.as_str()])
    }

    /// `kvroute_replication_lease_changes_total{event}`.
    pub fn lease_change(&self, c: LeaseChange) -> IntCounter {
        self.lease_changes.with_label_values(&[c.as_str()])
    }

    /// `kvroute_replication_resyncs_total{cause}`.
    pub fn resync(&self, r: Resync) -> IntCounter {
        self.repl_resyncs.with_label_values(&[r.as_str()])
    }

    /// `kvroute_replication_snapshot_loads_total{cause}`.
    pub fn snapshot_load(&self, l: SnapshotLoad) -> IntCounter {
        self.snapshot_loads.with_label_values(&[l.as_str()])
    }

    /// `kvroute_session_bindings_total{outcome}`.
    pub fn session(&self, o: SessionOutcome) -> &IntCounter {
        &self.session_counters[o.index()]
    }

    /// `kvroute_route_lower_tier_blocks_total{medium}` of `LOWER_MEDIA[i]`, if `i` names one.
    pub fn route_lower(&self, i: usize) -> Option<&IntCounter> {
        self.route_lower_counters.get(i)
    }

    /// `kvroute_ingest_clears_total{engine,cause}`.
    pub fn clear(&self, engine: &str, cause: ClearCause) -> IntCounter {
        self.clears.with_label_values(&[engine, cause.as_str()])
    }

    /// `kvroute_ingest_parity_checks_total{engine,result}`.
    pub fn parity_check(&self, engine: &str, r: ParityCheck) -> IntCounter {
        self.parity_checks.with_label_values(&[engine, r.as_str()])
    }

    /// `kvroute_ingest_replays_total{engine,outcome}`.
    pub fn replay(&self, engine: &str, r: Replay) -> IntCounter {
        self.replays.with_label_values(&[engine, r.as_str()])
    }

    /// Drops every per-endpoint series of a removed rule (`eps` endpoints, `ranks` ranks each),
    /// and its per-rule accounting series.
    pub fn drop_endpoint_series(&self, rule: &str, eps: usize, ranks: usize) {
        let _ = self.tenants.remove_label_values(&[rule]);
        let _ = self.sessions.remove_label_values(&[rule]);
        let _ = self.tenant_folded.remove_label_values(&[rule]);
        for i in 0..eps {
            let ep = i.to_string();
            let labels = [rule, ep.as_str()];
            for g in [
                &self.inventory_blocks,
                &self.endpoint_healthy,
                &self.endpoint_scraped_load,
                &self.endpoint_capacity_blocks,
                &self.endpoint_homed_blocks,
                &self.snapshot_bytes,
                &self.lease_owned,
                &self.endpoint_divergent,
                &self.endpoint_canary_failing,
            ] {
                let _ = g.remove_label_values(&labels);
            }
            for medium in LOWER_MEDIA {
                let _ = self
                    .lower_blocks
                    .remove_label_values(&[rule, ep.as_str(), medium]);
            }
            for c in [
                &self.endpoint_predicted_blocks,
                &self.endpoint_realised_blocks,
            ] {
                let _ = c.remove_label_values(&labels);
            }
            for verdict in ["exact", "under", "over"] {
                let _ = self
                    .endpoint_outcomes
                    .remove_label_values(&[rule, &ep, verdict]);
            }
            let _ = self.snapshot_age.remove_label_values(&labels);
            for rank in 0..ranks {
                let _ =
                    self.subscriber_connected
                        .remove_label_values(&[rule, &ep, &rank.to_string()]);
            }
        }
    }

    /// Drops the shadow policy's series of a removed rule.
    pub fn drop_shadow_series(&self, rule: &str) {
        for o in ShadowOutcome::ALL {
            let _ = self
                .shadow_decisions
                .remove_label_values(&[rule, o.as_str()]);
        }
        for c in [&self.shadow_predicted_blocks, &self.live_predicted_blocks] {
            let _ = c.remove_label_values(&[rule]);
        }
        for t in kvroute_core::wire::Tier::ALL {
            for r in kvroute_core::wire::Reason::ALL {
                let _ = self
                    .shadow_tiers
                    .remove_label_values(&[rule, t.as_str(), r.as_str()]);
            }
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        if enc.encode(&self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// The counters looked up once are the series their label names.
    #[test]
    fn counters_looked_up_once_are_their_labels_series() {
        let m = Metrics::new().unwrap();
        for (i, o) in SessionOutcome::ALL.iter().enumerate() {
            m.session(*o).inc_by(i as u64 + 1);
        }
        for (i, o) in SessionOutcome::ALL.iter().enumerate() {
            let got = m.session_bindings.with_label_values(&[o.as_str()]).get();
            assert_eq!(got, i as u64 + 1, "{}", o.as_str());
        }
        for (i, medium) in LOWER_MEDIA.iter().enumerate() {
            m.route_lower(i).unwrap().inc_by(10 + i as u64);
            assert_eq!(
                m.route_lower_blocks.with_label_values(&[medium]).get(),
                10 + i as u64
            );
        }
        assert!(m.route_lower(LOWER_MEDIA.len()).is_none());
    }
}
