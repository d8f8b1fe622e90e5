//! The filter's Envoy stats (proxy-wasm `define_metric`), shown by Envoy as `wasmcustom.<name>`.
//!
//! proxy-wasm metrics carry no labels, so each label value of the design ("decisions by tier",
//! "fail-open by reason") is its own counter; the values come from enums only, never from request
//! data. Histograms take integer samples, so durations are recorded in microseconds (`_us`).

use crate::host::{CounterId, Host, Level, MetricKind};

/// Why a request went upstream without a pin (each is a counter
/// `kvroute_filter_fail_open_<reason>_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailReason {
    /// The body exceeded `max_body_bytes`.
    BodyTooLarge,
    /// The body is not a routable OpenAI request (malformed JSON, non-UTF-8, missing fields).
    BadRequest,
    /// The rule's contract is not loaded yet (or the rule has KV routing off).
    NoContract,
    /// The prompt could not be rendered or tokenized.
    Tokenize,
    /// The rule's hash contract refused this request (e.g. LoRA with a contract lacking it).
    Hash,
    /// Envoy refused to start the callout (unknown cluster, ...).
    Dispatch,
    /// The callout timed out (Envoy's synthetic 504).
    Timeout,
    /// The inventory service was unreachable (503: refused, reset, no healthy host).
    Unavailable,
    /// Any other non-200 answer.
    Status,
    /// A 200 whose body is not a valid route answer.
    BadResponse,
    /// The request ended (client reset) while the filter held it.
    Aborted,
    /// A request header the filter reads (`content-type`) is not valid UTF-8.
    BadHeader,
}

impl FailReason {
    /// Every reason, in counter order.
    pub const ALL: [FailReason; 12] = [
        FailReason::BodyTooLarge,
        FailReason::BadRequest,
        FailReason::NoContract,
        FailReason::Tokenize,
        FailReason::Hash,
        FailReason::Dispatch,
        FailReason::Timeout,
        FailReason::Unavailable,
        FailReason::Status,
        FailReason::BadResponse,
        FailReason::Aborted,
        FailReason::BadHeader,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::BodyTooLarge => "body_too_large",
            FailReason::BadRequest => "bad_request",
            FailReason::NoContract => "no_contract",
            FailReason::Tokenize => "tokenize",
            FailReason::Hash => "hash",
            FailReason::Dispatch => "dispatch",
            FailReason::Timeout => "timeout",
            FailReason::Unavailable => "unavailable",
            FailReason::Status => "status",
            FailReason::BadResponse => "bad_response",
            FailReason::Aborted => "aborted",
            FailReason::BadHeader => "bad_header",
        }
    }
}

/// The counters and histograms (names are `kvroute_filter_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// Every request the filter saw.
    Requests,
    /// Requests on a routed path with a JSON body (candidates for a pin).
    Considered,
    /// Pins set (a route answer named an endpoint).
    Pinned,
    /// Pinned requests whose upstream was the pinned endpoint / another one (Envoy fell back:
    /// the pinned host unhealthy, not yet health-checked, or unknown to the cluster).
    PinHonored,
    PinOverridden,
    /// Decisions by tier.
    DecisionSession,
    DecisionTier15,
    DecisionFallback,
    DecisionOther,
    /// Client-supplied pin/routing headers removed.
    SpoofedHeaders,
    /// Requests routed without keys because no tokenizer is loaded.
    NoTokenizer,
    /// Chat prompts rendered by a native renderer / by the Jinja VM.
    RenderNative,
    RenderJinja,
    /// Tokenization segments served from the segment cache / encoded.
    SegmentHits,
    SegmentMisses,
    /// Pre-token pieces served from the fast encoder's piece cache / merged.
    PieceHits,
    PieceMisses,
    /// Blocks whose key came from the block-key cache / were hashed.
    KeyCacheHits,
    KeyCacheMisses,
    /// `usage` token counts from responses.
    CacheHitTokens,
    CacheMissTokens,
    /// Responses whose usage was parsed.
    UsageParsed,
    /// Pinned responses whose engine-reported reuse (whole blocks) equals / exceeds / falls short
    /// of the answer's matched blocks.
    PredictionExact,
    PredictionUnder,
    PredictionOver,
    /// Tokens the answers predicted the engines would reuse (pinned responses with usage).
    PredictedTokens,
    /// Of those, tokens the engines did not reuse (over-predicted responses only).
    OverPredictedTokens,
    /// Anthropic `cache_control` breakpoints placed in the routed tokens / not placed.
    Breakpoints,
    BreakpointsUnlocated,
    /// Placed breakpoints whose prefix (its whole blocks) the answer's matched blocks covered /
    /// the engine reported cached.
    BreakpointsPredicted,
    BreakpointsHit,
    /// Outcome reports the inventory accepted.
    OutcomeReports,
    /// Outcome reports that failed (added back for the next one).
    OutcomeReportFailures,
    /// Judgements (or restored sums) dropped because the outcome table was full.
    OutcomesDropped,
    /// Root-context loads (contract, tokenizer) that failed and will be retried.
    LoadFailures,
    /// Tokenizers loaded, one per worker VM (and per reload): the readiness signal per worker.
    TokenizersLoaded,
    /// Prompts routed on their first `max_prefix_tokens` ids only / on the ids before a
    /// pre-token piece over the piece bound (not merged) / on the ids before a chat's first
    /// media item.
    PrefixTruncatedMaxTokens,
    PrefixTruncatedLongPiece,
    PrefixTruncatedMedia,
    /// Histograms (microseconds).
    TokenizeUs,
    KeysUs,
    /// Complete body to callout sent: parse, render, tokenize, hash, encode the question.
    PrepareUs,
    /// Callout sent to answer received (the inventory's round trip through Envoy).
    CalloutUs,
    FilterUs,
    FailOpen(FailReason),
}

/// How many counters and histograms `FIXED` defines (the handles array has the same length).
const FIXED_LEN: usize = 44;

const FIXED: [(Stat, &str, MetricKind); FIXED_LEN] = [
    (
        Stat::Requests,
        "kvroute_filter_requests_total",
        MetricKind::Counter,
    ),
    (
        Stat::Considered,
        "kvroute_filter_considered_total",
        MetricKind::Counter,
    ),
    (
        Stat::Pinned,
        "kvroute_filter_pinned_total",
        MetricKind::Counter,
    ),
    (
        Stat::DecisionSession,
        "kvroute_filter_decisions_session_total",
        MetricKind::Counter,
    ),
    (
        Stat::DecisionTier15,
        "kvroute_filter_decisions_tier15_total",
        MetricKind::Counter,
    ),
    (
        Stat::DecisionFallback,
        "kvroute_filter_decisions_fallback_total",
        MetricKind::Counter,
    ),
    (
        Stat::DecisionOther,
        "kvroute_filter_decisions_other_total",
        MetricKind::Counter,
    ),
    (
        Stat::SpoofedHeaders,
        "kvroute_filter_spoofed_headers_total",
        MetricKind::Counter,
    ),
    (
        Stat::NoTokenizer,
        "kvroute_filter_no_tokenizer_total",
        MetricKind::Counter,
    ),
    (
        Stat::RenderNative,
        "kvroute_filter_render_native_total",
        MetricKind::Counter,
    ),
    (
        Stat::RenderJinja,
        "kvroute_filter_render_jinja_total",
        MetricKind::Counter,
    ),
    (
        Stat::SegmentHits,
        "kvroute_filter_segment_cache_hits_total",
        MetricKind::Counter,
    ),
    (
        Stat::SegmentMisses,
        "kvroute_filter_segment_cache_misses_total",
        MetricKind::Counter,
    ),
    (
        Stat::PieceHits,
        "kvroute_filter_piece_cache_hits_total",
        MetricKind::Counter,
    ),
    (
        Stat::PieceMisses,
        "kvroute_filter_piece_cache_misses_total",
        MetricKind::Counter,
    ),
    (
        Stat::KeyCacheHits,
        "kvroute_filter_key_cache_hits_total",
        MetricKind::Counter,
    ),
    (
        Stat::KeyCacheMisses,
        "kvroute_filter_key_cache_misses_total",
        MetricKind::Counter,
    ),
    (
        Stat::CacheHitTokens,
        "kvroute_filter_cache_hit_tokens_total",
        MetricKind::Counter,
    ),
    (
        Stat::CacheMissTokens,
        "kvroute_filter_cache_miss_tokens_total",
        MetricKind::Counter,
    ),
    (
        Stat::UsageParsed,
        "kvroute_filter_usage_parsed_total",
        MetricKind::Counter,
    ),
    (
        Stat::PredictionExact,
        "kvroute_filter_prediction_exact_total",
        MetricKind::Counter,
    ),
    (
        Stat::PredictionUnder,
        "kvroute_filter_prediction_under_total",
        MetricKind::Counter,
    ),
    (
        Stat::PredictionOver,
        "kvroute_filter_prediction_over_total",
        MetricKind::Counter,
    ),
    (
        Stat::PredictedTokens,
        "kvroute_filter_predicted_tokens_total",
        MetricKind::Counter,
    ),
    (
        Stat::Breakpoints,
        "kvroute_filter_cache_breakpoints_total",
        MetricKind::Counter,
    ),
    (
        Stat::BreakpointsUnlocated,
        "kvroute_filter_cache_breakpoints_unlocated_total",
        MetricKind::Counter,
    ),
    (
        Stat::BreakpointsPredicted,
        "kvroute_filter_cache_breakpoints_predicted_total",
        MetricKind::Counter,
    ),
    (
        Stat::BreakpointsHit,
        "kvroute_filter_cache_breakpoints_hit_total",
        MetricKind::Counter,
    ),
    (
        Stat::OverPredictedTokens,
        "kvroute_filter_over_predicted_tokens_total",
        MetricKind::Counter,
    ),
    (
        Stat::OutcomeReports,
        "kvroute_filter_outcome_reports_total",
        MetricKind::Counter,
    ),
    (
        Stat::OutcomeReportFailures,
        "kvroute_filter_outcome_report_failures_total",
        MetricKind::Counter,
    ),
    (
        Stat::OutcomesDropped,
        "kvroute_filter_outcomes_dropped_total",
        MetricKind::Counter,
    ),
    (
        Stat::LoadFailures,
        "kvroute_filter_load_failures_total",
        MetricKind::Counter,
    ),
    (
        Stat::TokenizersLoaded,
        "kvroute_filter_tokenizers_loaded_total",
        MetricKind::Counter,
    ),
    (
        Stat::PrefixTruncatedMaxTokens,
        "kvroute_filter_prefix_truncated_max_tokens_total",
        MetricKind::Counter,
    ),
    (
        Stat::PrefixTruncatedLongPiece,
        "kvroute_filter_prefix_truncated_long_piece_total",
        MetricKind::Counter,
    ),
    (
        Stat::PrefixTruncatedMedia,
        "kvroute_filter_prefix_truncated_media_total",
        MetricKind::Counter,
    ),
    (
        Stat::PinHonored,
        "kvroute_filter_pin_honored_total",
        MetricKind::Counter,
    ),
    (
        Stat::PinOverridden,
        "kvroute_filter_pin_overridden_total",
        MetricKind::Counter,
    ),
    (
        Stat::TokenizeUs,
        "kvroute_filter_tokenize_us",
        MetricKind::Histogram,
    ),
    (
        Stat::KeysUs,
        "kvroute_filter_keys_us",
        MetricKind::Histogram,
    ),
    (
        Stat::PrepareUs,
        "kvroute_filter_prepare_us",
        MetricKind::Histogram,
    ),
    (
        Stat::CalloutUs,
        "kvroute_filter_callout_us",
        MetricKind::Histogram,
    ),
    (
        Stat::FilterUs,
        "kvroute_filter_duration_us",
        MetricKind::Histogram,
    ),
];

impl Stat {
    /// The counter of a prompt's truncation.
    pub fn truncated(t: kvroute_core::bpe::Truncation) -> Stat {
        match t {
            kvroute_core::bpe::Truncation::MaxTokens => Stat::PrefixTruncatedMaxTokens,
            kvroute_core::bpe::Truncation::LongPiece => Stat::PrefixTruncatedLongPiece,
            kvroute_core::bpe::Truncation::Media => Stat::PrefixTruncatedMedia,
        }
    }
}

/// Metric handles; a refused definition only disables that metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    fixed: [Option<CounterId>; FIXED_LEN],
    fail: [Option<CounterId>; FailReason::ALL.len()],
}

// Arrays past 32 elements have no derived `Default`.
impl Default for Stats {
    fn default() -> Self {
        Stats {
            fixed: [None; FIXED_LEN],
            fail: [None; FailReason::ALL.len()],
        }
    }
}

impl Stats {
    /// Defines every metric; logs once if the host refused any.
    pub fn define(host: &dyn Host) -> Stats {
        let mut s = Stats::default();
        let mut refused = 0;
        for (i, (_, name, kind)) in FIXED.iter().enumerate() {
            s.fixed[i] = host.define_metric(*kind, name);
            refused += usize::from(s.fixed[i].is_none());
        }
        for (i, r) in FailReason::ALL.iter().enumerate() {
            s.fail[i] =
                host.define_counter(&format!("kvroute_filter_fail_open_{}_total", r.as_str()));
            refused += usize::from(s.fail[i].is_none());
        }
        if refused > 0 {
            host.log(Level::Warn, &format!("kvroute-filter: the host refused {refused} metric definitions; those are not counted"));
        }
        s
    }

    fn id(&self, stat: Stat) -> Option<CounterId> {
        match stat {
            Stat::FailOpen(r) => FailReason::ALL
                .iter()
                .position(|x| *x == r)
                .and_then(|i| self.fail[i]),
            other => FIXED
                .iter()
                .position(|(s, _, _)| *s == other)
                .and_then(|i| self.fixed[i]),
        }
    }

    /// Adds `n` to a counter.
    pub fn add(&self, host: &dyn Host, stat: Stat, n: u64) {
        if let Some(id) = self.id(stat) {
            if n > 0 {
                host.increment(id, n);
            }
        }
    }

    /// Adds one to a counter.
    pub fn inc(&self, host: &dyn Host, stat: Stat) {
        self.add(host, stat, 1);
    }

    /// Records a histogram sample.
    pub fn record(&self, host: &dyn Host, stat: Stat, value: u64) {
        if let Some(id) = self.id(stat) {
            host.record(id, value);
        }
    }

    /// True when the request counter is defined (the smoke test relies on it).
    pub fn counts_requests(&self) -> bool {
        self.fixed[0].is_some()
    }
}

/// The stat name of a fixed stat (for docs and tests).
pub fn name(stat: Stat) -> String {
    match stat {
        Stat::FailOpen(r) => format!("kvroute_filter_fail_open_{}_total", r.as_str()),
        other => FIXED
            .iter()
            .find(|(s, _, _)| *s == other)
            .map(|(_, n, _)| (*n).to_owned())
            .unwrap_or_default(),
    }
}
