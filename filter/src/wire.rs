//! The inventory service's JSON contracts as the filter speaks them.
//!
//! * `GET /v1/rules/{rule}/contract` → [`RuleContract`]: how to hash (set in one place, the service).
//! * `POST /v1/route` ← [`RouteRequest`], → [`RouteAnswer`] (see docs/inventory.md).
//!
//! Answers are parsed leniently (unknown fields ignored, so the service may grow) but checked
//! strictly where the filter acts on them: an endpoint must be an `ip:port` socket address.

use std::net::SocketAddr;

use kvroute_core::hash::{BlockKey, BlockSize, HashAlgo, HashContract};
use serde::{Deserialize, Serialize};

/// `GET /v1/rules/{rule}/contract`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct RuleContract {
    pub rule_id: u32,
    pub engine: String,
    /// `None` when the rule has no engine hash (llama.cpp, KV off).
    #[serde(default)]
    pub algo: Option<String>,
    #[serde(default)]
    pub seed: Option<String>,
    pub block_size: u32,
    /// `engine` or `tokens`.
    #[serde(default)]
    pub key_mode: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub kv_enabled: bool,
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
}

impl RuleContract {
    /// Parses the service's answer.
    pub fn parse(body: &[u8]) -> Result<RuleContract, ContractError> {
        serde_json::from_slice(body).map_err(|e| ContractError::Json(e.to_string()))
    }

    /// The hash contract the filter computes keys with: the engine's, or kvroute's content key
    /// in `tokens` key mode. `Ok(None)` when the rule does not use KV routing.
    pub fn hash_contract(&self) -> Result<Option<HashContract>, ContractError> {
        if !self.kv_enabled {
            return Ok(None);
        }
        let block_size =
            BlockSize::new(self.block_size).ok_or(ContractError::BlockSize(self.block_size))?;
        let algo = match self.key_mode.as_deref().unwrap_or("engine") {
            "tokens" => HashAlgo::Tokens,
            "engine" => self
                .algo
                .as_deref()
                .and_then(HashAlgo::parse)
                .ok_or_else(|| ContractError::Algo(self.algo.clone()))?,
            other => return Err(ContractError::KeyMode(other.to_owned())),
        };
        Ok(Some(HashContract {
            algo,
            block_size,
            seed: self.seed.clone(),
        }))
    }
}

/// `POST /v1/route` body.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RouteRequest<'a> {
    pub rule: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    pub keys: Vec<BlockKey>,
    pub token_count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_key: Option<&'a str>,
    /// Offload: the completion prompt text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<&'a str>,
    /// Offload: the chat messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<&'a serde_json::Value>,
}

/// `POST /v1/route` answer (the fields the filter uses).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct RawAnswer {
    pub endpoint: String,
    #[serde(default)]
    pub matched_blocks: u32,
    #[serde(default)]
    pub tier: String,
    #[serde(default)]
    pub decode_endpoint: Option<String>,
}

/// A checked route answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteAnswer {
    /// Where the KV blocks are (the prefill endpoint in P/D mode).
    pub endpoint: SocketAddr,
    pub matched_blocks: u32,
    pub tier: String,
    /// P/D mode: the decode endpoint the request must go to.
    pub decode_endpoint: Option<SocketAddr>,
}

impl RouteAnswer {
    /// Parses and checks an answer; `None` for anything unusable.
    pub fn parse(body: &[u8]) -> Option<RouteAnswer> {
        let raw: RawAnswer = serde_json::from_slice(body).ok()?;
        let endpoint = raw.endpoint.parse().ok()?;
        let decode_endpoint = match raw.decode_endpoint {
            None => None,
            Some(d) => Some(d.parse().ok()?),
        };
        // The tier becomes a header value: keep it to a short token.
        let tier = if !raw.tier.is_empty()
            && raw.tier.len() <= 32
            && raw
                .tier
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            raw.tier
        } else {
            "unknown".to_owned()
        };
        Some(RouteAnswer {
            endpoint,
            matched_blocks: raw.matched_blocks,
            tier,
            decode_endpoint,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn contract_maps_key_modes() {
        let c = RuleContract::parse(br#"{"rule_id":1,"name":"x","vip":"v","engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":16,"key_mode":"engine","model":"m","kv_exact_mode":3,"kv_enabled":true}"#).unwrap();
        let h = c.hash_contract().unwrap().unwrap();
        assert_eq!(
            (h.algo, h.block_size.get(), h.seed.as_deref()),
            (HashAlgo::Sha256Cbor, 16, Some("0"))
        );
        let t = RuleContract {
            key_mode: Some("tokens".into()),
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
        assert!(RuleContract { block_size: 0, ..c }.hash_contract().is_err());
    }

    #[test]
    fn answers_are_checked() {
        let a = RouteAnswer::parse(br#"{"rule_id":1,"endpoint":"127.0.0.1:9","matched_blocks":3,"tier":"tier15","reason":"hit","decode_endpoint":null}"#).unwrap();
        assert_eq!(
            (a.endpoint.to_string(), a.matched_blocks, a.tier.as_str()),
            ("127.0.0.1:9".into(), 3, "tier15")
        );
        let pd = RouteAnswer::parse(
            br#"{"endpoint":"127.0.0.1:9","tier":"x y","decode_endpoint":"127.0.0.1:10"}"#,
        )
        .unwrap();
        assert_eq!(
            (pd.decode_endpoint.map(|d| d.port()), pd.tier.as_str()),
            (Some(10), "unknown")
        );
        for bad in [
            &b"garbage"[..],
            br#"{"endpoint":"nohost"}"#,
            br#"{"endpoint":"1.2.3.4:5","decode_endpoint":"x"}"#,
            b"{}",
        ] {
            assert_eq!(RouteAnswer::parse(bad), None);
        }
    }

    #[test]
    fn route_request_omits_absent_fields() {
        let r = RouteRequest {
            rule: "1",
            keys: vec![BlockKey(7)],
            token_count: 16,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"rule":"1","keys":[7],"token_count":16}"#
        );
    }
}
