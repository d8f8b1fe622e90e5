//! `POST /v1/route` has two sides written separately: the filter serializes a borrowed question
//! and parses the answer leniently (filter/src/wire.rs), the service parses the question strictly
//! (`deny_unknown_fields`) and writes the answer (inventory-svc/src/api/route.rs). This checks
//! that each side reads exactly what the other writes, field by field, so a renamed or added field
//! fails here rather than as a silent fail-open in production.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::hash::BlockKey;
use kvroute_filter::wire::{RouteAnswer, RouteRequest as FilterQuestion};
use kvroute_inventory::api::route::{RouteRequest, RouteResponse, WireKey};
use serde_json::json;

fn service_reads(q: &FilterQuestion<'_>) -> RouteRequest {
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
    let q = FilterQuestion {
        rule: "10.0.0.1:8080",
        model: Some("Qwen/Qwen3-0.6B"),
        keys: keys.clone(),
        token_count: 64,
        affinity_key: Some("tenant-a"),
        prompt: None,
        messages: None,
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
    let want: Vec<WireKey> = keys.iter().map(|k| WireKey::Unsigned(k.0)).collect();
    assert_eq!(r.keys, want);
    assert_eq!((r.prompt, r.messages), (None, None));

    // Offloaded tokenization: text or messages instead of keys.
    let msgs = json!([{"role": "user", "content": "héllo"}]);
    let q = FilterQuestion {
        rule: "3",
        prompt: Some("a \"quoted\" prompt\n"),
        messages: Some(&msgs),
        ..Default::default()
    };
    let r = service_reads(&q);
    assert_eq!(r.prompt.as_deref(), Some("a \"quoted\" prompt\n"));
    assert_eq!(r.messages.as_ref(), Some(&msgs));
    assert!(r.keys.is_empty());
}

#[test]
fn the_filter_reads_every_answer_the_service_writes() {
    let hit = RouteResponse {
        rule_id: 1,
        endpoint: "10.0.0.2:8000".into(),
        matched_blocks: 12,
        tier: "tier15".into(),
        reason: "hit".into(),
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
        tier: "fallback".into(),
        reason: "miss_no_overlap".into(),
        matched_blocks: 0,
        ..hit
    };
    let a = RouteAnswer::parse(&serde_json::to_vec(&pd).unwrap()).expect("a P/D answer");
    assert_eq!(
        (a.tier.as_str(), a.decode_endpoint.map(|d| d.to_string())),
        ("fallback", Some("10.0.0.9:8000".into()))
    );
}
