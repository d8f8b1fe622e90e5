//! The inventory service's JSON contracts with the filter, defined once for both sides.
//!
//! * `GET /v1/rules/{rule}/contract` → [`RuleContract`] (`GET /v1/rules` → [`RuleContracts`]):
//!   how to hash a rule's block keys ([`RuleContract::hash_contract`]).
//! * `POST /v1/route` ← [`RouteRequest`] (JSON, or [`binary`] with the keys as 8-byte words), →
//!   [`RouteResponse`] with its [`Tier`] and [`Reason`].
//! * `POST /v1/rules/{rule}/outcomes` ← [`OutcomeReport`]: what the engines reused of what the
//!   route answers predicted, per endpoint, summed by the filter since its last report.
//!   With `"explain": true` the service answers the same question without side effects and adds
//!   [`Explain`] (per endpoint: matched blocks, held blocks, load, health; the placement memory's
//!   recall). Absent options of the question are left out of its JSON.
//!
//! The service writes these types and parses the question strictly (`deny_unknown_fields`). A
//! contract parses leniently (fields the filter does not use may be missing) and unknown fields
//! are ignored in every answer, so the service may grow. The filter reads route answers through
//! its own lenient, checked parse of [`RouteResponse`]'s JSON (a newer service's tier still pins).

pub mod binary;

use serde::{Deserialize, Serialize};

use crate::hash::{BlockKey, BlockSize, ExtraKeysLayout, HashAlgo, HashContract};

/// A rule's hash contract: what the filter needs to compute the rule's block keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RuleContract {
    pub rule_id: u32,
    /// `VIP:port/protocol`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub name: String,
    /// `VIP:port`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub vip: String,
    /// `vllm`, `sglang`, ...
    pub engine: String,
    /// Block hash algorithm; null when KV routing is off.
    #[serde(default)]
    pub algo: Option<String>,
    /// vLLM PYTHONHASHSEED; null when unset.
    #[serde(default)]
    pub seed: Option<String>,
    pub block_size: u32,
    /// `engine` or `tokens`.
    #[serde(default = "engine_key_mode")]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub key_mode: String,
    #[serde(default)]
    pub model: Option<String>,
    /// vLLM's extra-keys layout (`kvVllmExtraKeys`): `flat`; absent for `tagged` (and from
    /// services that predate the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_keys: Option<String>,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub kv_exact_mode: u8,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub kv_enabled: bool,
    /// Content types `POST /v1/route` accepts: `application/json` and, from services that read
    /// it, `application/vnd.kvroute.route.v1` (the binary form; absent from older services,
    /// which read JSON only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub route_content_types: Vec<String>,
}

fn engine_key_mode() -> String {
    "engine".to_owned()
}

/// `GET /v1/rules` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RuleContracts {
    pub rules: Vec<RuleContract>,
}

/// Why a contract answer cannot be used for hashing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("contract is not JSON {{rule_id, engine, algo, seed, block_size, key_mode, model, kv_enabled}}: {0}")]
    Json(String),
    #[error("contract block_size: got {0}, allowed >= 1")]
    BlockSize(u32),
    #[error("contract algo: got {0:?}, allowed sha256_cbor|xxhash_cbor|sha256_sglang|blockhash_trtllm|tokens")]
    Algo(Option<String>),
    #[error("contract key_mode: got {0:?}, allowed engine|tokens")]
    KeyMode(String),
    #[error("contract extra_keys: got {0:?}, allowed tagged|flat")]
    ExtraKeys(String),
}

impl RuleContract {
    /// True when the service reads the binary question ([`binary`]).
    pub fn accepts_binary_route(&self) -> bool {
        self.route_content_types
            .iter()
            .any(|t| t == binary::CONTENT_TYPE)
    }

    /// Parses the service's answer.
    pub fn parse(body: &[u8]) -> Result<RuleContract, ContractError> {
        serde_json::from_slice(body).map_err(|e| ContractError::Json(e.to_string()))
    }

    /// The hash contract keys are computed with: the engine's, or kvroute's content key in
    /// `tokens` key mode. `Ok(None)` when the rule does not use KV routing.
    pub fn hash_contract(&self) -> Result<Option<HashContract>, ContractError> {
        if !self.kv_enabled {
            return Ok(None);
        }
        let block_size =
            BlockSize::new(self.block_size).ok_or(ContractError::BlockSize(self.block_size))?;
        let algo = match self.key_mode.as_str() {
            "tokens" => HashAlgo::Tokens,
            "engine" => self
                .algo
                .as_deref()
                .and_then(HashAlgo::parse)
                .ok_or_else(|| ContractError::Algo(self.algo.clone()))?,
            other => return Err(ContractError::KeyMode(other.to_owned())),
        };
        let extra_layout = match self.extra_keys.as_deref() {
            None => ExtraKeysLayout::Tagged,
            Some(s) => {
                ExtraKeysLayout::parse(s).ok_or_else(|| ContractError::ExtraKeys(s.to_owned()))?
            }
        };
        Ok(Some(HashContract {
            algo,
            block_size,
            seed: self.seed.clone(),
            extra_layout,
        }))
    }
}

/// A block key on the wire: unsigned, or signed as SGLang publishes it.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum WireKey {
    Unsigned(u64),
    Signed(i64),
}

impl WireKey {
    /// The key's 64 bits.
    pub fn key(self) -> BlockKey {
        match self {
            WireKey::Unsigned(u) => BlockKey(u),
            WireKey::Signed(s) => BlockKey::from_i64(s),
        }
    }
}

impl From<BlockKey> for WireKey {
    /// Keys travel unsigned, as the filter writes them.
    fn from(k: BlockKey) -> Self {
        WireKey::Unsigned(k.0)
    }
}

/// A block key is one JSON integer from -2^63 to 2^64 - 1 (unsigned, or signed as SGLang publishes
/// it); the derive would make the two overlapping forms a `oneOf` that a non-negative key fails.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for WireKey {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(i64::MIN))
            .maximum(Some(u64::MAX))
            .description(Some(
                "A block key: unsigned 64-bit, or signed 64-bit as SGLang publishes it.",
            ))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for WireKey {}

/// The filter's question.
#[derive(Clone, Debug, Deserialize, Serialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    /// Rule id (`"3"`) or `VIP:port`.
    pub rule: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Block keys in prompt order.
    #[serde(default)]
    pub keys: Vec<WireKey>,
    /// Prompt length in tokens (for `LLB_KV_MIN_MATCH_TOKENS`).
    #[serde(default)]
    pub token_count: u32,
    /// Who the sticky fallback keeps together ([`crate::affinity`]): `<tenant>|<service type>`,
    /// the tenant being the `user` field, the API key's hash or the client IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_key: Option<String>,
    /// The conversation this request belongs to ([`crate::affinity::session_id`]): routed to the
    /// endpoint its earlier requests went to while that one is healthy (the session tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Raw prompt when the filter offloads tokenization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Chat messages when the filter offloads tokenization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<serde_json::Value>,
    /// Why `keys` stop before the prompt's end (`max_tokens`, `long_piece`, `media`), when they
    /// do: counted per decision reason in `kvroute_route_truncated_total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<crate::bpe::Truncation>,
    /// Decide without committing anything, and say why (see the module docs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub explain: bool,
}

/// Which tier made the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The conversation's bound endpoint (the question's `session`).
    Session,
    /// KV-overlap scoring, with the placement memory's remembered homes.
    Tier15,
    /// The rule's `sel` algorithm.
    Fallback,
}

impl Tier {
    /// Every tier.
    pub const ALL: [Tier; 3] = [Tier::Session, Tier::Tier15, Tier::Fallback];

    /// Metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Session => "session",
            Tier::Tier15 => "tier15",
            Tier::Fallback => "fallback",
        }
    }

    /// The tier with this API value.
    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// Why this endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Highest overlap under its cap.
    Hit,
    /// Moved off the best-overlap endpoint by load.
    Spill,
    /// A hit sent to a cold endpoint to seed it.
    ColdSeed,
    /// No endpoint holds the first block.
    MissNoOverlap,
    /// Prompt shorter than LLB_KV_MIN_MATCH_TOKENS.
    MissShortPrompt,
    /// Fewer tokens than one block: no keys.
    MissNoKeys,
    /// The rule has no KV scoring (kvExactMode 0 or an engine without events).
    KvOff,
    /// Sent to the family's remembered home, which the exact inventory no longer (or only
    /// partly) shows holding it.
    Remembered,
    /// The endpoint the question's session is bound to.
    Session,
}

impl Reason {
    /// Metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::Spill => "spill",
            Reason::ColdSeed => "cold_seed",
            Reason::MissNoOverlap => "miss_no_overlap",
            Reason::MissShortPrompt => "miss_short_prompt",
            Reason::MissNoKeys => "miss_no_keys",
            Reason::KvOff => "kv_off",
            Reason::Remembered => "remembered",
            Reason::Session => "session",
        }
    }

    /// Every reason, for pre-registering metric series.
    pub const ALL: [Reason; 9] = [
        Reason::Hit,
        Reason::Spill,
        Reason::ColdSeed,
        Reason::MissNoOverlap,
        Reason::MissShortPrompt,
        Reason::MissNoKeys,
        Reason::KvOff,
        Reason::Remembered,
        Reason::Session,
    ];
}

/// Why a decision went where it did (`"explain": true` only).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Explain {
    /// Keys the request carried (after offloaded tokenization).
    pub keys: u32,
    pub token_count: u32,
    pub endpoints: Vec<ExplainEndpoint>,
    /// The placement memory's home for this prefix family: endpoint index and depth in blocks.
    #[cfg_attr(
        feature = "openapi",
        schema(value_type = Option<Vec<u64>>, min_items = 2, max_items = 2)
    )]
    pub recall: Option<(usize, u32)>,
    /// The endpoint index the question's session is bound to (the session tier), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<usize>,
}

/// One endpoint as the scorer saw it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExplainEndpoint {
    pub idx: usize,
    pub endpoint: String,
    pub healthy: bool,
    /// Leading request blocks this endpoint holds (speculative credit included).
    pub matched_blocks: u32,
    /// The blocks after `matched_blocks` it holds in its host-memory tier, then in storage
    /// only (its engine loads them instead of recomputing); absent when both are 0.
    #[serde(default, skip_serializing_if = "is_zero_pair")]
    #[cfg_attr(
        feature = "openapi",
        schema(value_type = Option<Vec<u32>>, min_items = 2, max_items = 2)
    )]
    pub lower_blocks: (u32, u32),
    /// Blocks the endpoint really holds.
    pub blocks: u64,
    /// In-flight estimate.
    pub load: u64,
}

fn is_zero_pair(p: &(u32, u32)) -> bool {
    *p == (0, 0)
}

/// The answer.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RouteResponse {
    pub rule_id: u32,
    /// `ip:port` to pin the upstream to.
    pub endpoint: String,
    pub matched_blocks: u32,
    pub tier: Tier,
    pub reason: Reason,
    /// kvExactMode 1: the decode endpoint.
    pub decode_endpoint: Option<String>,
    /// Present only when the request set `"explain": true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<Explain>,
}

/// Most endpoints one [`OutcomeReport`] carries (the most a rule holds).
pub const MAX_OUTCOME_ENDPOINTS: usize = 1024;

/// Predicted against realised reuse for one endpoint, summed over the pinned responses whose
/// `usage` the filter read. Blocks are whole blocks of the rule's size; a prediction is capped at
/// the full blocks before the prompt's last token (engines always compute that one).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EndpointOutcomes {
    /// `ip:port` the requests were pinned to (the prefill endpoint in P/D mode).
    pub endpoint: String,
    /// Responses judged.
    pub judged: u64,
    /// The engine reused exactly the predicted blocks.
    pub exact: u64,
    /// It reused more.
    pub under: u64,
    /// It reused fewer.
    pub over: u64,
    /// Responses predicted to reuse at least 2 blocks.
    pub qualifying: u64,
    /// Qualifying responses whose engine reused no block at all.
    pub missed: u64,
    pub predicted_blocks: u64,
    pub realised_blocks: u64,
    /// Prompt tokens of the judged responses and, of those, the tokens the engine reported as
    /// cached (`usage`), so a cumulative cache-hit ratio per endpoint is `cached / prompt`.
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
}

impl EndpointOutcomes {
    /// Adds `o`'s counts (saturating).
    pub fn add(&mut self, o: &EndpointOutcomes) {
        for (a, b) in [
            (&mut self.judged, o.judged),
            (&mut self.exact, o.exact),
            (&mut self.under, o.under),
            (&mut self.over, o.over),
            (&mut self.qualifying, o.qualifying),
            (&mut self.missed, o.missed),
            (&mut self.predicted_blocks, o.predicted_blocks),
            (&mut self.realised_blocks, o.realised_blocks),
            (&mut self.prompt_tokens, o.prompt_tokens),
            (&mut self.cached_tokens, o.cached_tokens),
        ] {
            *a = a.saturating_add(b);
        }
    }
}

/// Most tenants one [`OutcomeReport`] carries; a filter folds the rest into [`OTHER_TENANT`].
pub const MAX_OUTCOME_TENANTS: usize = 256;

/// Bytes a tenant or model name in a report may have.
pub const MAX_TENANT_NAME: usize = 256;

/// The tenant name the sums of tenants past a bound are added to.
pub const OTHER_TENANT: &str = "(other)";

/// Prompt tokens one tenant's responses carried and, of those, the tokens the engines reported
/// as cached, summed over the responses whose `usage` the filter read (pinned or not).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TenantUsage {
    /// The tenant part of the request's affinity key ([`crate::affinity`]): `user:<user>`,
    /// `user#<hash>`, `key:<hash>` or `ip:<client>`; at most [`MAX_TENANT_NAME`] bytes.
    pub tenant: String,
    /// The request's `model`, when it named one (at most [`MAX_TENANT_NAME`] bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl TenantUsage {
    /// Adds `o`'s counts (saturating).
    pub fn add(&mut self, o: &TenantUsage) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prompt_tokens = self.prompt_tokens.saturating_add(o.prompt_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(o.cached_tokens);
    }
}

/// The filter's report of predicted against realised reuse since its previous one.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct OutcomeReport {
    /// At most [`MAX_OUTCOME_ENDPOINTS`].
    pub endpoints: Vec<EndpointOutcomes>,
    /// Per tenant and model, at most [`MAX_OUTCOME_TENANTS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantUsage>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn tiers_and_reasons_serialize_as_their_api_values() {
        for t in Tier::ALL {
            assert_eq!(serde_json::to_value(t).unwrap(), t.as_str());
            assert_eq!(Tier::parse(t.as_str()), Some(t));
        }
        for r in Reason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
            let back: Reason = serde_json::from_value(r.as_str().into()).unwrap();
            assert_eq!(back, r);
        }
        assert_eq!(Tier::parse("gpu"), None);
    }

    #[test]
    fn contract_maps_key_modes() {
        let c = RuleContract::parse(br#"{"rule_id":1,"name":"x","vip":"v","engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":16,"key_mode":"engine","model":"m","kv_exact_mode":3,"kv_enabled":true}"#).unwrap();
        let h = c.hash_contract().unwrap().unwrap();
        assert_eq!(
            (h.algo, h.block_size.get(), h.seed.as_deref()),
            (HashAlgo::Sha256Cbor, 16, Some("0"))
        );
        let t = RuleContract {
            key_mode: "tokens".into(),
            ..c.clone()
        };
        assert_eq!(t.hash_contract().unwrap().unwrap().algo, HashAlgo::Tokens);
        let off = RuleContract {
            kv_enabled: false,
            ..c.clone()
        };
        assert_eq!(off.hash_contract().unwrap(), None);
        let bad = RuleContract {
            algo: Some("md5".into()),
            ..c.clone()
        };
        assert!(bad.hash_contract().unwrap_err().to_string().contains("md5"));
        let mode = RuleContract {
            key_mode: "x".into(),
            ..c.clone()
        };
        assert_eq!(
            mode.hash_contract(),
            Err(ContractError::KeyMode("x".into()))
        );
        assert!(RuleContract { block_size: 0, ..c }.hash_contract().is_err());
    }

    /// The fields the filter does not use may be missing; a missing key mode is `engine`.
    #[test]
    fn contracts_parse_leniently() {
        let c = RuleContract::parse(
            br#"{"rule_id":1,"engine":"vllm","algo":"xxhash_cbor","block_size":4,"kv_enabled":true,"new":1}"#,
        )
        .unwrap();
        assert_eq!(
            c.hash_contract().unwrap().map(|h| h.algo),
            Some(HashAlgo::XxhashCbor)
        );
        assert_eq!(
            (c.key_mode.as_str(), c.seed, c.model),
            ("engine", None, None)
        );
        assert!(matches!(
            RuleContract::parse(b"garbage"),
            Err(ContractError::Json(_))
        ));
    }

    #[test]
    fn route_request_omits_absent_fields() {
        let r = RouteRequest {
            rule: "1".into(),
            keys: vec![BlockKey(7).into()],
            token_count: 16,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"rule":"1","keys":[7],"token_count":16}"#
        );
        let back: RouteRequest =
            serde_json::from_str(r#"{"rule":"1","keys":[7,-1],"token_count":16}"#).unwrap();
        let keys: Vec<BlockKey> = back.keys.iter().map(|k| k.key()).collect();
        assert_eq!(keys, [BlockKey(7), BlockKey(u64::MAX)]);
    }
}
