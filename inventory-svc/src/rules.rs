//! The service's view of a load-balancer rule: what ingestion, scoring and the APIs need.
//!
//! Rules arrive in loxilb's JSON shape (`serviceArguments` + `endpoints`) on the management API or
//! from a YAML/JSON file at start. Validation is kvroute-core's ([`kvroute_core::rule::Rule`]), the
//! same code the filter uses, so a rule means one thing everywhere; [`RuleSpec`] adds the derived
//! values the service uses on its hot paths (endpoint list, the service's drain interval). The
//! rule's enums (`kvExactMode`, `sel`, `ep_role`) and its field errors are kvroute-core's own.

use std::net::IpAddr;

use kvroute_core::hash::{Engine, HashAlgo, HashContract};
pub use kvroute_core::rule::KeyMode;
use kvroute_core::rule::{
    EndpointRole, FieldError, KvMode, RawRule, Rule, RuleParseError, Sel, ZmqAddr,
};
use serde_json::Value;

use crate::settings::Settings;

/// One backend of a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub ip: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// `ep_role`: always set under kvExactMode 1, never otherwise.
    pub role: Option<EndpointRole>,
    /// The rule's `kvCapacityBlocks` (placement's capacity override), if set.
    pub capacity_blocks: Option<u32>,
    /// `kvZmqEndpoint`: the engine's KV event address (rank 0) when not `ip:kvZmqPort`.
    pub zmq_endpoint: Option<ZmqAddr>,
    /// `kvReplayEndpoint`: the engine's replay ROUTER (rank 0) when not `ip:kvReplayPort`.
    pub replay_endpoint: Option<ZmqAddr>,
}

impl EndpointSpec {
    /// `ip:port` as the filter pins it (IPv6 bracketed).
    pub fn addr(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// A validated rule plus the values derived from it.
#[derive(Clone, Debug)]
pub struct RuleSpec {
    pub rule: Rule,
    /// `sel`: the fallback algorithm on a KV miss.
    pub sel: Sel,
    /// `kvExactMode`: which endpoint topology Tier 1.5 scores.
    pub exact_mode: KvMode,
    pub engine: Engine,
    /// The algorithm of the keys the index holds (`tokens` in tokens key mode).
    pub algo: Option<HashAlgo>,
    pub block_size: u32,
    pub key_mode: KeyMode,
    pub zmq_port: u16,
    pub replay_port: Option<u16>,
    /// `kvZmqBind`: bind each endpoint's event address instead of connecting to it.
    pub zmq_bind: bool,
    pub dp_ranks: u8,
    pub model: Option<String>,
    pub slug: Option<String>,
    /// TensorRT-LLM drain period (service setting `KVROUTE_TRTLLM_DRAIN_MS`).
    pub drain_interval_ms: u32,
    pub endpoints: Vec<EndpointSpec>,
}

/// A rule's name or `VIP:port` as a request gives it, its address form parsed once (a lookup asks
/// every rule).
pub struct RuleName<'a> {
    text: &'a str,
    addr: Option<std::net::SocketAddr>,
}

impl<'a> RuleName<'a> {
    /// `text` as a name, and as an address when it parses as one.
    pub fn new(text: &'a str) -> RuleName<'a> {
        RuleName {
            text,
            addr: text.parse().ok(),
        }
    }
}

impl RuleSpec {
    /// Derives the service view of a validated rule.
    pub fn from_rule(rule: Rule, settings: &Settings) -> RuleSpec {
        let kv = rule.kv();
        let endpoints = rule
            .endpoints()
            .iter()
            .map(|e| EndpointSpec {
                ip: e.addr().ip(),
                port: e.addr().port(),
                weight: u32::from(e.weight()),
                role: e.role(),
                capacity_blocks: e.capacity_blocks(),
                zmq_endpoint: e.zmq_endpoint(),
                replay_endpoint: e.replay_endpoint(),
            })
            .collect();
        RuleSpec {
            sel: rule.sel(),
            exact_mode: rule.kv_mode(),
            engine: rule.engine(),
            algo: kv.map(|k| k.contract().algo),
            block_size: kv.map_or(16, |k| u32::from(k.block_size())),
            key_mode: kv.map_or(KeyMode::Engine, |k| k.key_mode()),
            zmq_port: kv.map_or(5557, |k| k.zmq_port()),
            replay_port: kv.and_then(|k| k.replay_port()),
            zmq_bind: kv.is_some_and(|k| k.zmq_bind()),
            dp_ranks: kv.map_or(1, |k| k.dp_rank_count()),
            model: kv.and_then(|k| k.model()).map(|m| m.name().to_owned()),
            slug: kv.and_then(|k| k.model()).map(|m| m.as_str().to_owned()),
            drain_interval_ms: settings.trtllm_drain_ms,
            endpoints,
            rule,
        }
    }

    /// The rule id, `VIP:port/protocol` (loxilb's key; also the `rule` metric label).
    pub fn name(&self) -> String {
        self.rule.id().as_str().to_owned()
    }

    /// `VIP:port`, the short form the filter may use.
    pub fn vip_port(&self) -> String {
        std::net::SocketAddr::new(self.rule.external_ip(), self.rule.port()).to_string()
    }

    /// True when `name` names this rule: its name (`VIP:port/protocol`) or its `VIP:port`, the
    /// address compared as an address (no string built: the route path asks this of every rule).
    pub fn answers_to(&self, name: &RuleName<'_>) -> bool {
        self.rule.id().as_str() == name.text
            || name
                .addr
                .is_some_and(|a| a.ip() == self.rule.external_ip() && a.port() == self.rule.port())
    }

    /// The hash contract of the keys the index holds and the filter computes, when KV is on.
    pub fn contract(&self) -> Option<HashContract> {
        self.rule.contract().cloned()
    }

    /// Whether Tier 1.5 (KV scoring) runs for this rule.
    pub fn kv_enabled(&self) -> bool {
        self.exact_mode.is_on() && self.engine != Engine::Llamacpp
    }

    /// The rule in loxilb's JSON shape with defaults explicit (`GET .../all`).
    pub fn raw_json(&self) -> Value {
        serde_json::to_value(self.rule.to_raw()).unwrap_or(Value::Null)
    }

    /// Hash of the canonical JSON: equal on every replica for the same rule, different when any
    /// field changes (the rule's replication keys carry it).
    pub fn generation(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.raw_json().to_string().as_bytes())
    }
}

/// Why a rule body was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleRejected {
    /// Not a rule document at all (malformed JSON, unknown field, wrong type).
    #[error("malformed rule: {0}")]
    Malformed(String),
    /// Every bad field.
    #[error("invalid rule: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

/// Validates a rule in loxilb's JSON shape with kvroute-core, collecting every problem.
pub fn parse_rule(raw: &Value, settings: &Settings) -> Result<RuleSpec, RuleRejected> {
    let r: RawRule =
        serde_json::from_value(raw.clone()).map_err(|e| RuleRejected::Malformed(e.to_string()))?;
    let rule = Rule::from_raw(&r, &settings.core).map_err(|e| RuleRejected::Invalid(e.0))?;
    Ok(RuleSpec::from_rule(rule, settings))
}

/// Maps kvroute-core's parse error (used by callers holding a JSON string).
pub fn from_core_error(e: RuleParseError) -> RuleRejected {
    match e {
        RuleParseError::Json(m) => RuleRejected::Malformed(m),
        RuleParseError::Invalid(errs) => RuleRejected::Invalid(errs.0),
    }
}

/// Parses a rules file (YAML or JSON): a list of rules, or `{lbAttr: [...]}` as `GET .../all` returns.
pub fn parse_rules_file(text: &str) -> Result<Vec<Value>, String> {
    let v: Value =
        serde_yaml::from_str(text).map_err(|e| format!("rules file: not YAML/JSON: {e}"))?;
    match v {
        Value::Array(a) => Ok(a),
        Value::Object(mut m) => match m.remove("lbAttr") {
            Some(Value::Array(a)) => Ok(a),
            _ => Ok(vec![Value::Object(m)]),
        },
        _ => Err("rules file: expected a list of rules or {lbAttr: [...]}".into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use serde_json::json;

    fn good() -> Value {
        json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "protocol": "tcp", "sel": 0, "mode": 4,
                "kvExactMode": 3, "kvBlockSize": 16, "kvEngineType": "vllm", "kvHashAlgo": "sha256_cbor"},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 8000, "weight": 1}]
        })
    }

    fn settings() -> Settings {
        Settings::from_env(|k| (k == "LLB_KV_NONE_HASH_SEED").then(|| "0".to_owned())).unwrap()
    }

    #[test]
    fn accepts_a_good_rule() {
        let r = parse_rule(&good(), &settings()).unwrap();
        assert_eq!(r.name(), "10.0.0.1:8080/tcp");
        assert_eq!(r.vip_port(), "10.0.0.1:8080");
        for (name, yes) in [
            ("10.0.0.1:8080/tcp", true),
            ("10.0.0.1:8080", true),
            ("10.0.0.1:8081", false),
            ("10.0.0.2:8080", false),
            ("10.0.0.1:8080/udp", false),
            ("10.0.0.1", false),
            ("", false),
        ] {
            assert_eq!(r.answers_to(&RuleName::new(name)), yes, "{name:?}");
        }
        assert_eq!(r.algo, Some(HashAlgo::Sha256Cbor));
        assert_eq!(r.endpoints[0].addr(), "127.0.0.1:8000");
        assert_eq!(r.contract().unwrap().seed.as_deref(), Some("0"));
        assert_eq!(r.raw_json()["serviceArguments"]["port"], 8080);
    }

    #[test]
    fn collects_every_problem() {
        let mut v = good();
        v["serviceArguments"]["kvBlockSize"] = json!(0);
        v["serviceArguments"]["kvEngineType"] = json!("foo");
        v["endpoints"][0]["targetPort"] = json!(70000);
        match parse_rule(&v, &settings()).unwrap_err() {
            RuleRejected::Invalid(p) => assert!(p.len() >= 3, "{p:?}"),
            other => panic!("{other:?}"),
        }
        v["serviceArguments"]["bogus"] = json!(1);
        assert!(matches!(
            parse_rule(&v, &settings()),
            Err(RuleRejected::Malformed(_))
        ));
    }
}
