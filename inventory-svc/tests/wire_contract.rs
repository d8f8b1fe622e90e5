//! `POST /v1/route` is defined once (`kvroute_core::wire`), but the two sides read it differently:
//! the service parses the question strictly (`deny_unknown_fields`), and the filter writes it with
//! absent options left out and reads the answer through its own lenient, checked parse
//! (filter/src/wire.rs). This checks that each side reads exactly what the other writes, field by
//! field, so a renamed field or a skipped-but-required one fails here rather than as a silent
//! fail-open in production.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::hash::BlockKey;
use kvroute_core::wire::{Reason, RouteRequest, RouteResponse, Tier, WireKey};
use kvroute_filter::wire::RouteAnswer;
use serde_json::json;

fn service_reads(q: &RouteRequest) -> RouteRequest {
    let bytes = serde_json::to_vec(q).unwrap();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "the service refuses {}: {e}",
            String::from_utf8_lossy(&bytes)
        )
    })
}

#[test]
fn the_service_reads_every_field_the_filter_writes() {
    // Keys above i64::MAX travel unsigned, as the filter writes them.
    let keys = vec![
        BlockKey(0),
        BlockKey(7),
        BlockKey(u64::MAX),
        BlockKey(1 << 63),
    ];
    let q = RouteRequest {
        rule: "10.0.0.1:8080".into(),
        model: Some("Qwen/Qwen3-0.6B".into()),
        keys: keys.iter().copied().map(WireKey::from).collect(),
        token_count: 64,
        affinity_key: Some("tenant-a".into()),
        ..Default::default()
    };
    let r = service_reads(&q);
    assert_eq!(
        (
            r.rule.as_str(),
            r.model.as_deref(),
            r.token_count,
            r.affinity_key.as_deref()
        ),
        (
            "10.0.0.1:8080",
            Some("Qwen/Qwen3-0.6B"),
            64,
            Some("tenant-a")
        )
    );
    let read: Vec<BlockKey> = r.keys.iter().map(|k| k.key()).collect();
    assert_eq!(read, keys);
    assert_eq!((&r.prompt, &r.messages, r.explain), (&None, &None, false));
    assert_eq!(r, q);

    // Offloaded tokenization: text or messages instead of keys.
    let msgs = json!([{"role": "user", "content": "héllo"}]);
    let q = RouteRequest {
        rule: "3".into(),
        prompt: Some("a \"quoted\" prompt\n".into()),
        messages: Some(msgs.clone()),
        ..Default::default()
    };
    let r = service_reads(&q);
    assert_eq!(r.prompt.as_deref(), Some("a \"quoted\" prompt\n"));
    assert_eq!(r.messages.as_ref(), Some(&msgs));
    assert!(r.keys.is_empty());
}

/// Every tier and reason the service can answer with, with and without a decode endpoint and an
/// explanation, pins through the filter's parse with the same endpoint, blocks and tier.
#[test]
fn the_filter_reads_every_answer_the_service_writes() {
    let hit = RouteResponse {
        rule_id: 1,
        endpoint: "10.0.0.2:8000".into(),
        matched_blocks: 12,
        tier: Tier::Tier15,
        reason: Reason::Hit,
        decode_endpoint: None,
        explain: None,
    };
    let a = RouteAnswer::parse(&serde_json::to_vec(&hit).unwrap()).expect("a hit");
    assert_eq!(
        (
            a.endpoint.to_string(),
            a.matched_blocks,
            a.tier.as_str(),
            a.decode_endpoint
        ),
        ("10.0.0.2:8000".into(), 12, "tier15", None)
    );
    // Prefill/decode: the decode endpoint is where the request goes.
    let pd = RouteResponse {
        decode_endpoint: Some("10.0.0.9:8000".into()),
        tier: Tier::Fallback,
        reason: Reason::MissNoOverlap,
        matched_blocks: 0,
        ..hit.clone()
    };
    let a = RouteAnswer::parse(&serde_json::to_vec(&pd).unwrap()).expect("a P/D answer");
    assert_eq!(
        (a.tier.as_str(), a.decode_endpoint.map(|d| d.to_string())),
        ("fallback", Some("10.0.0.9:8000".into()))
    );
    let explained = serde_json::from_value::<RouteResponse>(json!({
        "rule_id": 1, "endpoint": "10.0.0.2:8000", "matched_blocks": 1, "tier": "tier15",
        "reason": "hit", "decode_endpoint": null,
        "explain": {"keys": 2, "token_count": 32, "recall": [0, 1], "endpoints": [
            {"idx": 0, "endpoint": "10.0.0.2:8000", "healthy": true, "matched_blocks": 1,
             "blocks": 5, "load": 0}]}
    }))
    .unwrap();
    for tier in Tier::ALL {
        for reason in Reason::ALL {
            for base in [&hit, &pd, &explained] {
                let answer = RouteResponse {
                    tier,
                    reason,
                    ..base.clone()
                };
                let bytes = serde_json::to_vec(&answer).unwrap();
                let a = RouteAnswer::parse(&bytes).unwrap_or_else(|| {
                    panic!("the filter refuses {}", String::from_utf8_lossy(&bytes))
                });
                assert_eq!(
                    (
                        a.endpoint.to_string(),
                        a.matched_blocks,
                        a.known_tier(),
                        a.tier.as_str(),
                        a.decode_endpoint.map(|d| d.to_string()),
                    ),
                    (
                        answer.endpoint.clone(),
                        answer.matched_blocks,
                        Some(tier),
                        tier.as_str(),
                        answer.decode_endpoint.clone(),
                    )
                );
            }
        }
    }
}
