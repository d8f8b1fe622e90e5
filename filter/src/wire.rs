//! The inventory service's JSON contracts as the filter speaks them: the types are
//! [`kvroute_core::wire`]'s (one definition for the filter and the service); this module adds the
//! filter's reading of the route answer.
//!
//! * `GET /v1/rules/{rule}/contract` → [`RuleContract`]: how to hash (set in one place, the service).
//! * `POST /v1/route` ← [`RouteRequest`] ([`binary`] when the contract advertises it and there are
//!   keys, else JSON), → [`RouteResponse`], read as a [`RouteAnswer`] (see docs/inventory.md).
//!
//! Answers are parsed leniently (unknown fields ignored, missing ones defaulted, any tier token
//! accepted, so the service may grow) but checked strictly where the filter acts on them: an
//! endpoint must be an `ip:port` socket address, and the tier becomes a header-safe token.

use std::net::SocketAddr;

pub use kvroute_core::wire::{
    binary, ContractError, RouteRequest, RouteResponse, RuleContract, Tier,
};
use serde::Deserialize;

/// The fields of a [`RouteResponse`] the filter acts on, as the lenient parse reads them.
#[derive(Deserialize)]
struct Lenient {
    endpoint: String,
    #[serde(default)]
    matched_blocks: u32,
    #[serde(default)]
    tier: String,
    #[serde(default)]
    decode_endpoint: Option<String>,
}

/// A checked route answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteAnswer {
    /// Where the KV blocks are (the prefill endpoint in P/D mode).
    pub endpoint: SocketAddr,
    pub matched_blocks: u32,
    /// The answer's tier as a header-safe token (`unknown` when it is not one).
    pub tier: String,
    /// P/D mode: the decode endpoint the request must go to.
    pub decode_endpoint: Option<SocketAddr>,
}

impl RouteAnswer {
    /// Parses and checks an answer; `None` for anything unusable.
    pub fn parse(body: &[u8]) -> Option<RouteAnswer> {
        let raw: Lenient = serde_json::from_slice(body).ok()?;
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

    /// The tier, if this build knows it (a newer service may answer with another).
    pub fn known_tier(&self) -> Option<Tier> {
        Tier::parse(&self.tier)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_checked() {
        let a = RouteAnswer::parse(br#"{"rule_id":1,"endpoint":"127.0.0.1:9","matched_blocks":3,"tier":"tier15","reason":"hit","decode_endpoint":null}"#).unwrap();
        assert_eq!(
            (a.endpoint.to_string(), a.matched_blocks, a.tier.as_str()),
            ("127.0.0.1:9".into(), 3, "tier15")
        );
        assert_eq!(a.known_tier(), Some(Tier::Tier15));
        let pd = RouteAnswer::parse(
            br#"{"endpoint":"127.0.0.1:9","tier":"x y","decode_endpoint":"127.0.0.1:10"}"#,
        )
        .unwrap();
        assert_eq!(
            (pd.decode_endpoint.map(|d| d.port()), pd.tier.as_str()),
            (Some(10), "unknown")
        );
        assert_eq!(pd.known_tier(), None);
        for bad in [
            &b"garbage"[..],
            br#"{"endpoint":"nohost"}"#,
            br#"{"endpoint":"1.2.3.4:5","decode_endpoint":"x"}"#,
            b"{}",
        ] {
            assert_eq!(RouteAnswer::parse(bad), None);
        }
    }
}
