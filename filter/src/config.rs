//! The plugin configuration (the JSON string in the Wasm filter's `configuration`).
//!
//! Parse, don't validate: [`RawConfig`] is what serde reads (unknown fields rejected), [`Config`]
//! is the checked form the filter runs with. Every problem is reported at once, naming the field,
//! the value and what is allowed (kvroute-core's [`FieldError`], as rules and process settings
//! report theirs). An empty object is valid: with no `rule` the filter only counts
//! and passes requests through (the shape the smoke test and a first deployment use).

use std::time::Duration;

use kvroute_core::rule::FieldError;
use serde::Deserialize;

use crate::cache::Limits;
use crate::tokens::{CacheLimits, MAX_PREFIX_TOKENS, MAX_PREFIX_TOKENS_LIMIT};

/// Most bytes any one cache may be given (1 GiB).
const MAX_CACHE_BYTES: u64 = 1 << 30;
/// Most entries any one cache may be given.
const MAX_CACHE_ENTRIES: u64 = 1 << 24;

/// Where the filter gets the prompt's token ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizeMode {
    /// Tokenize in the filter (default): the route request carries block keys.
    #[default]
    Filter,
    /// Offload: the route request carries the prompt text / messages; the inventory service tokenizes.
    Service,
}

/// Where the filter's tokenizer comes from (only with `tokenize: filter`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerSource {
    /// `GET /v1/tokenizers/<slug>` (+ `/tokenizer_config.json`) from the inventory cluster,
    /// fetched by each VM's root context at start (default). The service reads it from its
    /// `--tokenizer-dir`: the file-based source, since Envoy's V8 VM has no filesystem.
    #[default]
    Inventory,
    /// Compiled into the module (cargo feature `embedded-tokenizer`).
    Embedded,
    /// No tokenizer: KV scoring is skipped, the service still applies sticky/load fallback.
    None,
}

/// How the pin reaches Envoy's stateful_session filter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinMode {
    /// Hold the request at its headers and write the pin header (needs
    /// `allow_on_headers_stop_iteration: true`, i.e. envoy.yaml or an Istio EnvoyFilter).
    #[default]
    Header,
    /// For an Istio WasmPlugin (which cannot set `allow_on_headers_stop_iteration`): release the
    /// headers, hold the body, and publish the pin as filter state `wasm.kvroute_pin` (plus
    /// `wasm.kvroute_tier`, `wasm.kvroute_matched_blocks`, `wasm.kvroute_prefiller`); a buffer
    /// filter after this one holds the headers from the router until the body is complete, and a
    /// header_mutation filter turns the filter state into headers before stateful_session.
    FilterState,
}

/// The configuration as written (JSON).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Rule id or `VIP:port` in the inventory service; absent = pass-through.
    #[serde(default)]
    pub rule: Option<String>,
    /// Envoy cluster of the inventory service.
    #[serde(default)]
    pub inventory_cluster: Option<String>,
    /// `:authority` of callouts to the inventory service.
    #[serde(default)]
    pub inventory_authority: Option<String>,
    /// Route callout timeout in milliseconds (1..=10000, default 25).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Largest body considered, in bytes (1 KiB..=64 MiB, default 4 MiB); larger pass unpinned.
    #[serde(default)]
    pub max_body_bytes: Option<u64>,
    /// Header of Envoy's header-based stateful_session (default `x-kvroute-pin`).
    #[serde(default)]
    pub pin_header: Option<String>,
    #[serde(default)]
    pub tokenize: Option<TokenizeMode>,
    #[serde(default)]
    pub tokenizer: Option<TokenizerSource>,
    /// Model whose tokenizer to load; default: the rule's `kvModel` from its contract.
    #[serde(default)]
    pub model: Option<String>,
    /// How often the rule's contract is re-read, in milliseconds (1000..=3600000, default 30000).
    #[serde(default)]
    pub refresh_ms: Option<u64>,
    #[serde(default)]
    pub pin_mode: Option<PinMode>,
    /// Segment cache (segment text -> token ids) bounds: bytes (default 16 MiB) and entries
    /// (default 65536); 0 turns it off.
    #[serde(default)]
    pub segment_cache_bytes: Option<u64>,
    #[serde(default)]
    pub segment_cache_entries: Option<u64>,
    /// The fast encoder's piece cache (pre-token -> ids): bytes (default 16 MiB) and entries
    /// (default 200000); 0 turns it off.
    #[serde(default)]
    pub piece_cache_bytes: Option<u64>,
    #[serde(default)]
    pub piece_cache_entries: Option<u64>,
    /// Block-key cache (token prefix -> keys and hasher state): bytes (default 16 MiB) and
    /// entries, one per block (default 131072); 0 turns it off.
    #[serde(default)]
    pub key_cache_bytes: Option<u64>,
    #[serde(default)]
    pub key_cache_entries: Option<u64>,
    /// Credential for the inventory's `/v1/route` (its `--route-token-file`): sent as
    /// `authorization: Bearer <token>` on every callout; absent = no header.
    #[serde(default)]
    pub route_token: Option<String>,
    /// Most prompt tokens routed on (1..=1048576, default 16384): tokenizing stops there.
    #[serde(default)]
    pub max_prefix_tokens: Option<u64>,
    /// How often predicted-against-realised reuse is reported to the inventory, in milliseconds
    /// (0 = never, else 200..=3600000; default 5000).
    #[serde(default)]
    pub report_ms: Option<u64>,
    /// Header carrying the conversation id the session tier routes on (default
    /// `x-conversation-id`; `""` reads none).
    #[serde(default)]
    pub session_header: Option<String>,
    /// Take the OpenAI `user` field as the conversation id when the header is absent (default
    /// false: `user` names a person, who may hold several conversations).
    #[serde(default)]
    pub session_from_user: Option<bool>,
}

/// The checked configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub rule: Option<String>,
    pub inventory_cluster: String,
    pub inventory_authority: String,
    pub timeout: Duration,
    pub max_body_bytes: usize,
    pub pin_header: String,
    pub tokenize: TokenizeMode,
    pub tokenizer: TokenizerSource,
    pub model: Option<String>,
    pub refresh: Duration,
    pub pin_mode: PinMode,
    /// Bounds of the tokenizer's segment and piece caches.
    pub caches: CacheLimits,
    /// Bounds of the block-key cache.
    pub key_cache: Limits,
    /// Bearer credential sent on callouts (`route_token`).
    pub route_token: Option<RouteToken>,
    /// Most prompt tokens routed on.
    pub max_prefix_tokens: usize,
    /// Outcome report period (`report_ms`); `None` = never.
    pub report: Option<Duration>,
    /// Conversation-id header (`session_header`); `None` = none is read.
    pub session_header: Option<String>,
    /// `session_from_user`.
    pub session_from_user: bool,
}

/// A validated `route_token`: non-empty, printable ASCII (a header value). Its `Debug` hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct RouteToken(String);

impl RouteToken {
    /// The token text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for RouteToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouteToken(<redacted>)")
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            rule: None,
            inventory_cluster: "kvroute_inventory".into(),
            inventory_authority: "kvroute-inventory".into(),
            timeout: Duration::from_millis(25),
            max_body_bytes: 4 << 20,
            pin_header: "x-kvroute-pin".into(),
            tokenize: TokenizeMode::Filter,
            tokenizer: TokenizerSource::Inventory,
            model: None,
            refresh: Duration::from_secs(30),
            pin_mode: PinMode::Header,
            caches: CacheLimits::DEFAULT,
            key_cache: Limits {
                entries: 131_072,
                bytes: 16 << 20,
            },
            route_token: None,
            max_prefix_tokens: MAX_PREFIX_TOKENS,
            report: Some(Duration::from_secs(5)),
            session_header: Some(kvroute_core::affinity::SESSION_HEADER.into()),
            session_from_user: false,
        }
    }
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "plugin configuration is not a JSON object with fields rule, inventory_cluster, inventory_authority, \
         timeout_ms, max_body_bytes, pin_header, tokenize (filter|service), tokenizer (inventory|embedded|none), \
         model, refresh_ms, pin_mode (header|filter_state), segment_cache_bytes, segment_cache_entries, \
         piece_cache_bytes, piece_cache_entries, key_cache_bytes, key_cache_entries, route_token, max_prefix_tokens, \
         report_ms, session_header, session_from_user: {0}"
    )]
    Json(String),
    #[error("invalid plugin configuration: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

fn header_name_ok(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl Config {
    /// Parses the plugin configuration bytes; empty bytes mean the defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let raw: RawConfig =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        Config::try_from(raw)
    }
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Config, ConfigError> {
        let d = Config::default();
        let mut problems = Vec::new();
        let mut range = |field: &'static str,
                         v: Option<u64>,
                         lo: u64,
                         hi: u64,
                         allowed: &'static str,
                         dflt: u64| {
            match v {
                None => dflt,
                Some(x) if (lo..=hi).contains(&x) => x,
                Some(x) => {
                    problems.push(FieldError::new(field, x.to_string(), allowed));
                    dflt
                }
            }
        };
        let timeout = range("timeout_ms", raw.timeout_ms, 1, 10_000, "1..=10000", 25);
        let max_body = range(
            "max_body_bytes",
            raw.max_body_bytes,
            1024,
            64 << 20,
            "1024..=67108864",
            4 << 20,
        );
        let refresh = range(
            "refresh_ms",
            raw.refresh_ms,
            1000,
            3_600_000,
            "1000..=3600000",
            30_000,
        );
        let report = match raw.report_ms {
            Some(0) => 0,
            r => range("report_ms", r, 200, 3_600_000, "0 or 200..=3600000", 5000),
        };
        let mut limits = |bytes_field: &'static str,
                          bytes: Option<u64>,
                          entries_field: &'static str,
                          entries: Option<u64>,
                          dflt: Limits| {
            let b = range(
                bytes_field,
                bytes,
                0,
                MAX_CACHE_BYTES,
                "0..=1073741824",
                dflt.bytes as u64,
            );
            let e = range(
                entries_field,
                entries,
                0,
                MAX_CACHE_ENTRIES,
                "0..=16777216",
                dflt.entries as u64,
            );
            Limits {
                entries: usize::try_from(e).unwrap_or(dflt.entries),
                bytes: usize::try_from(b).unwrap_or(dflt.bytes),
            }
        };
        let caches = CacheLimits {
            segments: limits(
                "segment_cache_bytes",
                raw.segment_cache_bytes,
                "segment_cache_entries",
                raw.segment_cache_entries,
                d.caches.segments,
            ),
            pieces: limits(
                "piece_cache_bytes",
                raw.piece_cache_bytes,
                "piece_cache_entries",
                raw.piece_cache_entries,
                d.caches.pieces,
            ),
        };
        let key_cache = limits(
            "key_cache_bytes",
            raw.key_cache_bytes,
            "key_cache_entries",
            raw.key_cache_entries,
            d.key_cache,
        );
        let max_prefix_tokens = range(
            "max_prefix_tokens",
            raw.max_prefix_tokens,
            1,
            MAX_PREFIX_TOKENS_LIMIT as u64,
            "1..=1048576",
            d.max_prefix_tokens as u64,
        );
        let mut text = |field: &'static str, v: Option<String>, dflt: &str, header: bool| match v {
            None => dflt.to_owned(),
            Some(s) if s.is_empty() => {
                problems.push(FieldError::new(field, "\"\"", "a non-empty string"));
                dflt.to_owned()
            }
            Some(s) if header && !header_name_ok(&s) => {
                problems.push(FieldError::new(
                    field,
                    format!("{s:?}"),
                    "a lowercase header name ([a-z0-9-]+)",
                ));
                dflt.to_owned()
            }
            Some(s) => s,
        };
        let inventory_cluster = text(
            "inventory_cluster",
            raw.inventory_cluster,
            &d.inventory_cluster,
            false,
        );
        let inventory_authority = text(
            "inventory_authority",
            raw.inventory_authority,
            &d.inventory_authority,
            false,
        );
        let pin_header = text("pin_header", raw.pin_header, &d.pin_header, true);
        let session_header = match raw.session_header {
            None => d.session_header.clone(),
            Some(h) if h.is_empty() => None,
            Some(h) if header_name_ok(&h) => Some(h),
            Some(h) => {
                problems.push(FieldError::new(
                    "session_header",
                    format!("{h:?}"),
                    "a lowercase header name ([a-z0-9-]+), or \"\" for none",
                ));
                None
            }
        };
        if let Some(r) = &raw.rule {
            if r.is_empty() {
                problems.push(FieldError::new("rule", "\"\"", "a rule id or VIP:port"));
            }
        }
        let route_token = match raw.route_token {
            None => None,
            Some(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => {
                Some(RouteToken(t))
            }
            Some(t) => {
                problems.push(FieldError::new(
                    "route_token",
                    // Never echo a credential: its length is enough to find the mistake.
                    format!("a string of {} bytes", t.len()),
                    "a non-empty string of printable ASCII (no spaces or control characters)",
                ));
                None
            }
        };
        if !problems.is_empty() {
            return Err(ConfigError::Invalid(problems));
        }
        Ok(Config {
            rule: raw.rule,
            inventory_cluster,
            inventory_authority,
            timeout: Duration::from_millis(timeout),
            max_body_bytes: usize::try_from(max_body).unwrap_or(usize::MAX),
            pin_header,
            tokenize: raw.tokenize.unwrap_or_default(),
            tokenizer: raw.tokenizer.unwrap_or_default(),
            model: raw.model,
            refresh: Duration::from_millis(refresh),
            pin_mode: raw.pin_mode.unwrap_or_default(),
            caches,
            key_cache,
            route_token,
            max_prefix_tokens: usize::try_from(max_prefix_tokens).unwrap_or(d.max_prefix_tokens),
            report: (report > 0).then(|| Duration::from_millis(report)),
            session_header,
            session_from_user: raw.session_from_user.unwrap_or(d.session_from_user),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn empty_means_defaults() {
        assert_eq!(Config::parse(b"").unwrap(), Config::default());
        assert_eq!(Config::parse(b"{}").unwrap(), Config::default());
    }

    #[test]
    fn reads_every_field() {
        let c = Config::parse(
            br#"{"rule":"10.0.0.1:8080","inventory_cluster":"inv","inventory_authority":"inv.local",
                "timeout_ms":40,"max_body_bytes":2048,"pin_header":"x-pin","tokenize":"service",
                "tokenizer":"none","model":"m","refresh_ms":5000}"#,
        )
        .unwrap();
        assert_eq!(c.rule.as_deref(), Some("10.0.0.1:8080"));
        assert_eq!(c.timeout, Duration::from_millis(40));
        assert_eq!((c.max_body_bytes, c.pin_header.as_str()), (2048, "x-pin"));
        assert_eq!(
            (c.tokenize, c.tokenizer),
            (TokenizeMode::Service, TokenizerSource::None)
        );
        let c = Config::parse(
            br#"{"segment_cache_bytes":0,"segment_cache_entries":10,"piece_cache_bytes":2048,
                "piece_cache_entries":0,"key_cache_bytes":1048576,"key_cache_entries":4096}"#,
        )
        .unwrap();
        assert_eq!(
            (c.caches.segments, c.caches.pieces, c.key_cache),
            (
                Limits {
                    entries: 10,
                    bytes: 0
                },
                Limits {
                    entries: 0,
                    bytes: 2048
                },
                Limits {
                    entries: 4096,
                    bytes: 1 << 20
                }
            )
        );
        assert_eq!(Config::default().max_prefix_tokens, 16_384);
        let c = Config::parse(br#"{"max_prefix_tokens":4096}"#).unwrap();
        assert_eq!(c.max_prefix_tokens, 4096);
        for bad in ["0", "1048577"] {
            let err = Config::parse(format!(r#"{{"max_prefix_tokens":{bad}}}"#).as_bytes())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!(
                    "max_prefix_tokens: got {bad}, allowed: 1..=1048576"
                )),
                "{err}"
            );
        }
        assert_eq!(Config::default().report, Some(Duration::from_secs(5)));
        for (raw, want) in [("0", None), ("200", Some(Duration::from_millis(200)))] {
            let c = Config::parse(format!(r#"{{"report_ms":{raw}}}"#).as_bytes()).unwrap();
            assert_eq!(c.report, want);
        }
        let err = Config::parse(br#"{"report_ms":199}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("report_ms: got 199, allowed: 0 or 200..=3600000"),
            "{err}"
        );
        let err = Config::parse(br#"{"key_cache_bytes":1099511627776}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("key_cache_bytes: got 1099511627776, allowed: 0..=1073741824"),
            "{err}"
        );
    }

    #[test]
    fn lists_every_problem_with_field_value_and_range() {
        let err =
            Config::parse(br#"{"timeout_ms":0,"max_body_bytes":1,"pin_header":"X Pin","rule":"","session_header":"X Conv"}"#)
                .unwrap_err()
                .to_string();
        for part in [
            "timeout_ms: got 0, allowed: 1..=10000",
            "max_body_bytes: got 1",
            "pin_header: got \"X Pin\"",
            "session_header: got \"X Conv\", allowed: a lowercase header name",
            "rule",
        ] {
            assert!(err.contains(part), "{err}");
        }
        let err = Config::parse(br#"{"tokenize":"gpu"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokenize (filter|service)"), "{err}");
        assert!(Config::parse(br#"{"nope":1}"#).is_err());
    }

    #[test]
    fn route_token_is_checked_and_never_printed() {
        let c = Config::parse(br#"{"route_token":"s3cr3t-Token_1"}"#).unwrap();
        assert_eq!(
            c.route_token.as_ref().map(RouteToken::as_str),
            Some("s3cr3t-Token_1")
        );
        assert!(!format!("{c:?}").contains("s3cr3t"));
        for bad in [
            r#""""#,
            r#""a\nb""#,
            r#""a b""#,
            r#""tok\u0000""#,
            r#""caf\u00e9""#,
        ] {
            let json = format!(r#"{{"route_token":{bad}}}"#);
            let err = Config::parse(json.as_bytes()).unwrap_err().to_string();
            assert!(err.contains("route_token: got a string of"), "{bad}: {err}");
            assert!(err.contains("printable ASCII"), "{err}");
        }
    }
}
