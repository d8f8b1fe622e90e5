//! The plugin configuration (the JSON string in the Wasm filter's `configuration`).
//!
//! Parse, don't validate: [`RawConfig`] is what serde reads (unknown fields rejected), [`Config`]
//! is the checked form the filter runs with. Every problem is reported at once, naming the field,
//! the value and what is allowed. An empty object is valid: with no `rule` the filter only counts
//! and passes requests through (the shape the smoke test and a first deployment use).

use std::time::Duration;

use serde::Deserialize;

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
        }
    }
}

/// One configuration problem.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: got {value}, allowed {allowed}")]
pub struct Problem {
    pub field: &'static str,
    pub value: String,
    pub allowed: &'static str,
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "plugin configuration is not a JSON object with fields rule, inventory_cluster, inventory_authority, \
         timeout_ms, max_body_bytes, pin_header, tokenize (filter|service), tokenizer (inventory|embedded|none), \
         model, refresh_ms, pin_mode (header|filter_state): {0}"
    )]
    Json(String),
    #[error("invalid plugin configuration: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Problem>),
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
                    problems.push(Problem {
                        field,
                        value: x.to_string(),
                        allowed,
                    });
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
        let mut text = |field: &'static str, v: Option<String>, dflt: &str, header: bool| match v {
            None => dflt.to_owned(),
            Some(s) if s.is_empty() => {
                problems.push(Problem {
                    field,
                    value: "\"\"".into(),
                    allowed: "a non-empty string",
                });
                dflt.to_owned()
            }
            Some(s) if header && !header_name_ok(&s) => {
                problems.push(Problem {
                    field,
                    value: format!("{s:?}"),
                    allowed: "a lowercase header name ([a-z0-9-]+)",
                });
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
        if let Some(r) = &raw.rule {
            if r.is_empty() {
                problems.push(Problem {
                    field: "rule",
                    value: "\"\"".into(),
                    allowed: "a rule id or VIP:port",
                });
            }
        }
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
    }

    #[test]
    fn lists_every_problem_with_field_value_and_range() {
        let err =
            Config::parse(br#"{"timeout_ms":0,"max_body_bytes":1,"pin_header":"X Pin","rule":""}"#)
                .unwrap_err()
                .to_string();
        for part in [
            "timeout_ms: got 0, allowed 1..=10000",
            "max_body_bytes: got 1",
            "pin_header: got \"X Pin\"",
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
}
