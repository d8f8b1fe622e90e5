//! Placement that survives evictions, end to end with the real binary: a new prefix
//! family is placed where it fits, and after its engine evicted it (BlockRemoved over real ZMQ)
//! the family still goes back to that engine instead of being placed anew.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};

/// ep0 = 127.0.0.2 (no events), ep1 = 127.0.0.1 (events from the test's publisher).
fn two_eps(zmq_port: u16) -> Value {
    rule(
        9000,
        "vllm",
        zmq_port,
        &[("127.0.0.2".into(), 1), ("127.0.0.1".into(), 1)],
        json!({}),
    )
}

/// Speculative credit off, so the exact inventory holds only what the engine reported; decisions
/// leave the in-flight estimate at once, so load caps do not interfere.
const ENV: &[(&str, &str)] = &[
    ("KVROUTE_SPEC_TTL_MS", "0"),
    ("KVROUTE_INFLIGHT_WINDOW_MS", "1"),
];

const FAMILY_A: [u64; 8] = [0xA0, 0xA1, 0xA2, 0xA3, 0xA4, 0xA5, 0xA6, 0xA7];
const FAMILY_B: [u64; 8] = [0xB0, 0xB1, 0xB2, 0xB3, 0xB4, 0xB5, 0xB6, 0xB7];

async fn route(svc: &Service, keys: &[u64]) -> (String, String, u64) {
    let body = json!({"rule": "1", "keys": keys, "token_count": keys.len() * 16}).to_string();
    let (s, v) = svc.post("/v1/route", &body, None).await;
    assert_eq!(s, 200, "{v}\n{}", svc.stderr());
    (
        v["reason"].as_str().unwrap().to_owned(),
        v["endpoint"].as_str().unwrap().to_owned(),
        v["matched_blocks"].as_u64().unwrap(),
    )
}

/// Places B then A (A goes to the endpoint with room: ep1), lets ep1 store then evict A, and
/// returns where the next turn of A goes.
async fn place_store_evict(svc: &Service, p: &mut Publisher) -> (String, String, u64) {
    let (r, e, _) = route(svc, &FAMILY_B).await;
    assert_eq!((r.as_str(), e.as_str()), ("miss_no_overlap", "127.0.0.2:1"));
    // ep0 now homes B's 8 blocks: A, a new family, goes where there is room.
    let (r, e, _) = route(svc, &FAMILY_A).await;
    assert_eq!((r.as_str(), e.as_str()), ("miss_no_overlap", "127.0.0.1:1"));
    // The engine reports A stored: an exact hit.
    publish_until_seen(
        svc,
        p,
        "1",
        1,
        FAMILY_A[0],
        &batch(vec![stored(&FAMILY_A, &[], false)]),
    )
    .await;
    let (r, e, m) = route(svc, &FAMILY_A).await;
    assert_eq!((r.as_str(), e.as_str(), m), ("hit", "127.0.0.1:1", 8));
    // The engine evicts A: the exact inventory knows nothing of it any more.
    p.send(&batch(vec![removed(&FAMILY_A)])).await;
    svc.wait_for("A evicted", 10, || async {
        svc.inventory("1", 1).await.is_empty()
    })
    .await;
    // The next chat turn of A: A's blocks plus new ones.
    let mut next = FAMILY_A.to_vec();
    next.extend([0xC0, 0xC1, 0xC2, 0xC3]);
    route(svc, &next).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_family_returns_to_its_engine() {
    let mut p = Publisher::bind(0).await.unwrap();
    let svc = Service::start("placement", &json!([two_eps(p.port)]), ENV);
    let (r, e, m) = place_store_evict(&svc, &mut p).await;
    assert_eq!(
        (r.as_str(), e.as_str(), m),
        ("remembered", "127.0.0.1:1", 0),
        "{}",
        svc.stderr()
    );
    let text = svc.metrics().await;
    for (series, v) in [
        ("kvroute_tier15_remembered_total", 1.0),
        ("kvroute_tier15_footprint_placements_total", 2.0),
        (
            r#"kvroute_route_decisions_total{reason="remembered",tier="tier15"}"#,
            1.0,
        ),
        (
            r#"kvroute_route_decisions_total{reason="miss_no_overlap",tier="fallback"}"#,
            2.0,
        ),
    ] {
        assert_eq!(metric(&text, series), Some(v), "{series}\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_memory_an_evicted_family_is_placed_anew() {
    // The control: memory and footprint placement off (plain exact routing).
    let mut p = Publisher::bind(0).await.unwrap();
    let mut env = ENV.to_vec();
    env.push(("KVROUTE_PLACEMENT_MEMORY_ENTRIES", "0"));
    env.push(("KVROUTE_PLACEMENT", "sel"));
    let svc = Service::start("placement-off", &json!([two_eps(p.port)]), &env);
    // With sel (round robin) B goes to ep0 and A to ep1 as well, so the story is the same...
    let (r, e, _) = place_store_evict(&svc, &mut p).await;
    // ...but after the eviction A is a stranger: round robin sends it to ep0.
    assert_eq!(
        (r.as_str(), e.as_str()),
        ("miss_no_overlap", "127.0.0.2:1"),
        "{}",
        svc.stderr()
    );
    let text = svc.metrics().await;
    assert_metric(&text, "kvroute_tier15_remembered_total", 0.0);
}

/// A hit credits speculatively only the keys past what the endpoint already holds: an eviction of
/// the held ones shows at the next decision instead of hiding behind the speculative TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_does_not_re_credit_what_the_engine_holds() {
    let mut p = Publisher::bind(0).await.unwrap();
    // A TTL far longer than the test, so any credit would still be live at the end; no memory,
    // so the last decision reads the exact inventory alone.
    let env = [
        ("KVROUTE_SPEC_TTL_MS", "600000"),
        ("KVROUTE_INFLIGHT_WINDOW_MS", "1"),
        ("KVROUTE_PLACEMENT_MEMORY_ENTRIES", "0"),
    ];
    let svc = Service::start("spec-held", &json!([two_eps(p.port)]), &env);
    publish_until_seen(
        &svc,
        &mut p,
        "1",
        1,
        FAMILY_A[0],
        &batch(vec![stored(&FAMILY_A, &[], false)]),
    )
    .await;
    let (r, e, m) = route(&svc, &FAMILY_A).await;
    assert_eq!((r.as_str(), e.as_str(), m), ("hit", "127.0.0.1:1", 8));
    p.send(&batch(vec![removed(&FAMILY_A)])).await;
    svc.wait_for("A evicted", 10, || async {
        svc.inventory("1", 1).await.is_empty()
    })
    .await;
    let (r, _, m) = route(&svc, &FAMILY_A).await;
    assert_eq!(
        (r.as_str(), m),
        ("miss_no_overlap", 0),
        "the eviction must show: {}",
        svc.stderr()
    );
}

/// `kvCapacityBlocks` in the rule is the capacity placement compares (no engine publishes one
/// here), and both it and the homed footprint are exported per endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_capacity_override_steers_placement() {
    let p = Publisher::bind(0).await.unwrap();
    let mut r = two_eps(p.port);
    r["endpoints"][0]["kvCapacityBlocks"] = json!(4);
    r["endpoints"][1]["kvCapacityBlocks"] = json!(100);
    let svc = Service::start("placement-capacity", &json!([r]), ENV);
    // Without the override both capacities are unknown and B would go to ep0 (lower index);
    // with it ep1 has 100 free blocks against 4, for both families.
    let (reason, ep, _) = route(&svc, &FAMILY_B).await;
    assert_eq!(
        (reason.as_str(), ep.as_str()),
        ("miss_no_overlap", "127.0.0.1:1")
    );
    let (reason, ep, _) = route(&svc, &FAMILY_A).await;
    assert_eq!(
        (reason.as_str(), ep.as_str()),
        ("miss_no_overlap", "127.0.0.1:1")
    );
    let text = svc.metrics().await;
    let series = |name: &str, ep: u8| format!("{name}{{ep=\"{ep}\",rule=\"10.0.0.1:9000/tcp\"}}");
    let got = |name: &str, ep: u8| metric(&text, &series(name, ep));
    assert_eq!(
        (
            got("kvroute_endpoint_capacity_blocks", 0),
            got("kvroute_endpoint_capacity_blocks", 1),
            got("kvroute_endpoint_homed_blocks", 0),
            got("kvroute_endpoint_homed_blocks", 1),
            metric(&text, "kvroute_tier15_footprint_placements_total"),
        ),
        (Some(4.0), Some(100.0), Some(0.0), Some(16.0), Some(2.0)),
        "{text}"
    );
}
