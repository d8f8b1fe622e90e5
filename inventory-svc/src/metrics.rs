//! Prometheus metrics: `kvroute_<subsystem>_<name>_<unit>`, counters end in `_total`.
//!
//! Labels come from enums (engine, event type, tier, reason, cause) or from configuration (rule
//! name, endpoint index, rank) — never from request data, so cardinality is bounded by the config.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Every metric the service exports, registered in one private registry.
pub struct Metrics {
    pub registry: Registry,
    /// `engine`, `type` (block_stored, block_removed, all_blocks_cleared).
    pub events: IntCounterVec,
    /// Blocks stored on a medium other than GPU (not routed on): `engine`, `medium`.
    pub non_gpu_blocks: IntCounterVec,
    /// `engine`.
    pub seq_gaps: IntCounterVec,
    /// `engine`, `outcome` (ok, failed, unconfigured).
    pub replays: IntCounterVec,
    /// Inventory clears: `engine`, `cause` (restart, gap, event, reconnect).
    pub clears: IntCounterVec,
    /// `engine`.
    pub decode_errors: IntCounterVec,
    /// Parity self-check mismatches in engine key mode: `engine`.
    pub parity_mismatches: IntCounterVec,
    /// Events whose blocks could not be keyed (tokens mode without a known parent, partial): `engine`.
    pub unkeyed_blocks: IntCounterVec,
    /// 1 while the subscriber / poller of `(rule, ep, rank)` is connected.
    pub subscriber_connected: IntGaugeVec,
    /// Blocks per endpoint: `rule`, `ep`.
    pub inventory_blocks: IntGaugeVec,
    /// `tier` (tier15, fallback), `reason`.
    pub route_decisions: IntCounterVec,
    pub tier15_spills: IntCounter,
    pub tier15_cold_seeds: IntCounter,
    /// Decisions sent to a prefix family's remembered home (placement memory).
    pub tier15_remembered: IntCounter,
    /// New prefix families placed by free cache (footprint) instead of `sel`.
    pub tier15_placements: IntCounter,
    pub route_latency: Histogram,
    /// `rule`, `ep`: 1 healthy, 0 unhealthy.
    pub endpoint_healthy: IntGaugeVec,
    /// `rule`, `ep`: running + waiting requests from the last engine metrics scrape.
    pub endpoint_scraped_load: IntGaugeVec,
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
        let c = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let m = Metrics {
            events: cv("kvroute_ingest_events_total", "KV events applied, by engine and event type.", &["engine", "type"])?,
            non_gpu_blocks: cv(
                "kvroute_ingest_non_gpu_blocks_total",
                "Blocks stored on a medium other than GPU (counted, not routed on).",
                &["engine", "medium"],
            )?,
            seq_gaps: cv("kvroute_ingest_seq_gaps_total", "Sequence gaps detected per publisher.", &["engine"])?,
            replays: cv("kvroute_ingest_replays_total", "Replay attempts after a gap, by outcome.", &["engine", "outcome"])?,
            clears: cv("kvroute_ingest_clears_total", "Endpoint inventory clears, by cause.", &["engine", "cause"])?,
            decode_errors: cv("kvroute_ingest_decode_errors_total", "Frames or payloads that failed to decode.", &["engine"])?,
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
            route_decisions: cv("kvroute_route_decisions_total", "Routing decisions by tier and reason.", &["tier", "reason"])?,
            tier15_spills: c("kvroute_tier15_spills_total", "Tier 1.5 decisions moved off the best-overlap endpoint by load.")?,
            tier15_cold_seeds: c("kvroute_tier15_cold_seeds_total", "Tier 1.5 hits sent to a cold endpoint to seed it.")?,
            tier15_remembered: c(
                "kvroute_tier15_remembered_total",
                "Tier 1.5 decisions sent to a prefix family's remembered home past the exact match.",
            )?,
            tier15_placements: c(
                "kvroute_tier15_footprint_placements_total",
                "New prefix families placed on the endpoint with the most free cache instead of by sel.",
            )?,
            route_latency: {
                let h = Histogram::with_opts(
                    HistogramOpts::new("kvroute_route_duration_seconds", "Time to answer POST /v1/route.").buckets(vec![
                        0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005, 0.025, 0.1,
                    ]),
                )?;
                registry.register(Box::new(h.clone()))?;
                h
            },
            endpoint_healthy: gv("kvroute_endpoint_healthy", "1 when the endpoint's active health check passes.", &["rule", "ep"])?,
            endpoint_scraped_load: gv(
                "kvroute_endpoint_scraped_load",
                "Running plus waiting requests reported by the engine's last metrics scrape.",
                &["rule", "ep"],
            )?,
            registry,
        };
        Ok(m)
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
