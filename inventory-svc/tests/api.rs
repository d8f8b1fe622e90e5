//! End-to-end management and routing API: rule validation rows, auth, body caps, inventory
//! pagination, tokenizers, routing tiers, exact `/metrics` lines, SIGTERM drain.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvroute_test_support::free_port;
use serde_json::{json, Value};

const LB: &str = "/netlox/v1/config/loadbalancer";

fn good_rule(port: u16) -> Value {
    rule(
        port,
        "vllm",
        5557,
        &[("127.0.0.1".into(), 1), ("127.0.0.2".into(), 1)],
        json!({}),
    )
}

fn with(mut r: Value, path: &[&str], v: Value) -> Value {
    let mut cur = &mut r;
    for p in &path[..path.len() - 1] {
        cur = match p.parse::<usize>() {
            Ok(i) => &mut cur[i],
            Err(_) => &mut cur[*p],
        };
    }
    let last = path[path.len() - 1];
    match (cur, v) {
        (Value::Object(m), Value::Null) if last.starts_with('-') => {
            m.remove(&last[1..]);
        }
        (Value::Object(m), v) => {
            m.insert(last.to_owned(), v);
        }
        _ => panic!("bad path"),
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_validation_rows_and_auth() {
    // No NONE_HASH seed: xxhash_cbor in engine key mode must be refused.
    let svc = Service::start("rules", &json!([]), &[("LLB_KV_NONE_HASH_SEED", UNSET)]);
    let sa = |k: &str, v: Value| with(good_rule(9000), &["serviceArguments", k], v);
    // (body, field the 400 must name; "" = rejected as malformed before field validation)
    let ep = |i: &str, k: &str, v: Value| with(good_rule(9000), &["endpoints", i, k], v);
    let rows: Vec<(Value, &str)> = vec![
        (sa("externalIP", json!("not-an-ip")), "externalIP"),
        (sa("-externalIP", Value::Null), "externalIP"),
        (sa("port", json!(0)), "port"),
        (sa("port", json!(70000)), "port"),
        (sa("protocol", json!("udp")), "protocol"),
        (sa("sel", json!(5)), "sel"),
        (sa("mode", json!(0)), "mode"),
        (sa("kvExactMode", json!(2)), "kvExactMode"),
        (sa("kvExactMode", json!(7)), "kvExactMode"),
        (sa("kvEngineType", json!("tgi")), "kvEngineType"),
        (sa("kvHashAlgo", json!("md5")), "kvHashAlgo"),
        (sa("kvHashAlgo", json!("sha256_sglang")), "kvHashAlgo"),
        (sa("kvHashAlgo", json!("xxhash_cbor")), "kvHashAlgo"),
        (sa("kvBlockSize", json!(0)), "kvBlockSize"),
        (sa("kvZmqPort", json!(-1)), "kvZmqPort"),
        (sa("kvDpRankCount", json!(0)), "kvDpRankCount"),
        (sa("kvDpRankCount", json!(2)), "kvDpRankCount"),
        (sa("kvKeyMode", json!("pickle")), "kvKeyMode"),
        (sa("kvReplayPort", json!(0)), "kvReplayPort"),
        (
            with(
                rule(
                    9000,
                    "llamacpp",
                    5557,
                    &[("127.0.0.1".into(), 1)],
                    json!({}),
                ),
                &["serviceArguments", "kvBlockSize"],
                json!(16),
            ),
            "kvBlockSize",
        ),
        (sa("kvWarmupSec", json!("soon")), ""),
        (sa("bogusField", json!(1)), ""),
        (
            json!({"serviceArguments": {}, "endpoints": []}),
            "externalIP",
        ),
        (
            with(good_rule(9000), &["endpoints"], json!([])),
            "endpoints",
        ),
        (ep("0", "endpointIP", json!("x")), "endpoints[0].endpointIP"),
        (ep("1", "targetPort", json!(0)), "endpoints[1].targetPort"),
        (ep("0", "weight", json!(0)), "endpoints[0].weight"),
        (ep("0", "ep_role", json!(5)), "endpoints[0].ep_role"),
        (ep("0", "ep_role", json!(1)), "endpoints[0].ep_role"),
        (sa("kvExactMode", json!(1)), "endpoints[0].ep_role"),
    ];
    for (body, field) in &rows {
        let (s, v) = svc.post(LB, &body.to_string(), Some(TOKEN)).await;
        assert_eq!(s, 400, "{field}: {v}");
        if field.is_empty() {
            assert!(
                v["error"]
                    .as_str()
                    .unwrap()
                    .starts_with("malformed JSON body"),
                "{v}"
            );
            continue;
        }
        let fields: Vec<&str> = v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["field"].as_str().unwrap())
            .collect();
        assert!(fields.contains(field), "{field} not in {fields:?}");
        for p in v["problems"].as_array().unwrap() {
            assert!(p["value"].is_string() && p["allowed"].is_string(), "{p}");
        }
    }
    // Every problem of one body is listed at once.
    let many = with(
        with(
            sa("kvBlockSize", json!(0)),
            &["endpoints", "0", "weight"],
            json!(0),
        ),
        &["serviceArguments", "port"],
        json!(0),
    );
    let (s, v) = svc.post(LB, &many.to_string(), Some(TOKEN)).await;
    assert_eq!(s, 400);
    assert_eq!(v["problems"].as_array().unwrap().len(), 3, "{v}");

    // Malformed JSON and oversized bodies.
    let (s, v) = svc.post(LB, "{not json", Some(TOKEN)).await;
    assert_eq!(s, 400);
    assert!(v["error"]
        .as_str()
        .unwrap()
        .starts_with("malformed JSON body"));
    let (s, _) = svc.post(LB, &"x".repeat(300 * 1024), Some(TOKEN)).await;
    assert_eq!(s, 413);

    // Auth: none, wrong, right.
    let body = good_rule(9000).to_string();
    assert_eq!(svc.post(LB, &body, None).await.0, 401);
    assert_eq!(svc.post(LB, &body, Some("wrong")).await.0, 401);
    let (s, v) = svc.post(LB, &body, Some(TOKEN)).await;
    assert_eq!((s, &v["result"]), (200, &json!("Success")), "{v}");
    // Posting the same rule id again replaces it (same numeric id); the engine cannot change.
    let (s, v) = svc.post(LB, &body, Some(TOKEN)).await;
    assert_eq!((s, &v["id"]), (200, &json!(1)), "{v}");
    let (s, v) = svc
        .post(
            LB,
            &sa("kvEngineType", json!("sglang")).to_string(),
            Some(TOKEN),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["problems"][0]["field"], "kvEngineType", "{v}");

    let all = svc.get_json(&format!("{LB}/all")).await;
    assert_eq!(all["lbAttr"][0]["serviceArguments"]["port"], 9000);
    assert_eq!(all["lbAttr"][0]["contract"]["algo"], "sha256_cbor");
    let c = svc.get_json("/v1/rules/10.0.0.1:9000/contract").await;
    assert_eq!(
        c,
        json!({"rule_id": 1, "name": "10.0.0.1:9000/tcp", "vip": "10.0.0.1:9000", "engine": "vllm", "algo": "sha256_cbor", "seed": "vllm-none-hash",
        "block_size": 16, "key_mode": "engine", "model": null, "kv_exact_mode": 3, "kv_enabled": true,
        "route_content_types": ["application/json", "application/vnd.kvroute.route.v1"]})
    );

    let series = r#"rule="10.0.0.1:9000/tcp""#;
    assert!(svc.metrics().await.contains(series));
    let del = format!("{LB}/externalipaddress/10.0.0.1/port/9000/protocol/tcp");
    assert_eq!(svc.delete(&del, None).await, 401);
    assert_eq!(svc.delete(&del, Some(TOKEN)).await, 200);
    assert_eq!(svc.delete(&del, Some(TOKEN)).await, 404);
    assert_eq!(
        svc.get_json(&format!("{LB}/all")).await["lbAttr"],
        json!([])
    );
    // A deleted rule leaves no metric series behind (blocks, health, subscribers).
    let m = svc.metrics().await;
    assert!(
        m.lines().all(|l| l.starts_with('#') || !l.contains(series)),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_tokenizers_and_health() {
    let r = with(
        good_rule(9000),
        &["serviceArguments", "kvModel"],
        json!("Qwen/Qwen3-0.6B"),
    );
    let svc = Service::start("inv", &json!([r]), &[]);
    assert_eq!(svc.get("/netlox/v1/config/ai/kv/inventory").await.0, 400);
    assert_eq!(
        svc.get("/netlox/v1/config/ai/kv/inventory?service_id=1")
            .await
            .0,
        400
    );
    assert_eq!(
        svc.get("/netlox/v1/config/ai/kv/inventory?ep_idx=0")
            .await
            .0,
        400
    );
    assert_eq!(
        svc.get("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx=x")
            .await
            .0,
        400
    );
    assert_eq!(
        svc.get("/netlox/v1/config/ai/kv/inventory?service_id=9&ep_idx=0")
            .await
            .0,
        404
    );
    assert_eq!(
        svc.get("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx=2")
            .await
            .0,
        404
    );
    // loxilb numbers rules from 0; kvroute from 1, and says so.
    let (s, b) = svc
        .get("/netlox/v1/config/ai/kv/inventory?service_id=0&ep_idx=0")
        .await;
    assert_eq!(s, 404);
    assert!(
        b.contains("kvroute numbers rules from 1 (loxilb from 0)"),
        "{b}"
    );
    let v = svc
        .get_json("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx=1")
        .await;
    assert_eq!(
        v,
        json!({"service_id": 1, "ep_idx": 1, "hash_algo": "sha256_cbor", "blocks": [], "total": 0, "offset": 0, "limit": 1000, "next_offset": null})
    );

    // Missing tokenizer: a clear 404 and a /healthz detail; staged: served as is.
    let (s, b) = svc.get("/v1/tokenizers/Qwen__Qwen3-0.6B").await;
    assert_eq!(s, 404);
    assert!(b.contains("not staged"), "{b}");
    let hz = svc.get_json("/healthz").await;
    assert_eq!(hz["status"], "degraded");
    assert!(
        hz["rules"][0]["tokenizer"]
            .as_str()
            .unwrap()
            .contains("Qwen__Qwen3-0.6B"),
        "{hz}"
    );
    let d = svc.dir.join("tokenizers").join("Qwen__Qwen3-0.6B");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("tokenizer.json"), "{\"model\":{}}").unwrap();
    std::fs::write(d.join("tokenizer_config.json"), "{\"chat_template\":\"x\"}").unwrap();
    assert_eq!(
        svc.get("/v1/tokenizers/Qwen__Qwen3-0.6B").await,
        (200, "{\"model\":{}}".to_owned())
    );
    assert_eq!(
        svc.get("/v1/tokenizers/Qwen__Qwen3-0.6B/tokenizer_config.json")
            .await
            .0,
        200
    );
    assert_eq!(
        svc.get("/v1/tokenizers/Qwen__Qwen3-0.6B/secret.txt")
            .await
            .0,
        404
    );
    assert_eq!(svc.get("/v1/tokenizers/..").await.0, 404);
    assert_eq!(svc.get("/readyz").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_tiers_and_exact_metrics() {
    // Sticky hashing (sel 1) on a miss; short prompts skip KV scoring.
    let r1 = with(good_rule(9000), &["serviceArguments", "sel"], json!(1));
    // llama.cpp: plain load balancing.
    let r2 = rule(
        9001,
        "llamacpp",
        5557,
        &[("127.0.0.3".into(), 80)],
        json!({}),
    );
    // Spill relief off: with one request in flight the 1.75x cap is already reached (ceil(1.75 x 1 / 2) = 1).
    let svc = Service::start(
        "route",
        &json!([r1, r2]),
        &[
            ("LLB_KV_MIN_MATCH_TOKENS", "32"),
            ("LOXILB_KV_SPILL_RELIEF", "off"),
        ],
    );
    let route = |body: Value| {
        let svc = &svc;
        async move { svc.post("/v1/route", &body.to_string(), None).await }
    };
    let (s, a) = route(json!({"rule": "10.0.0.1:9000", "keys": [1, 2, 3], "token_count": 48, "affinity_key": "tenant-a"})).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(
        (
            a["tier"].as_str(),
            a["reason"].as_str(),
            a["matched_blocks"].as_u64()
        ),
        (Some("fallback"), Some("miss_no_overlap"), Some(0))
    );
    // The decision credited the chosen endpoint speculatively: the same prefix now hits it.
    let (_, b) = route(
        json!({"rule": "1", "keys": [1, 2, 3, 4], "token_count": 64, "affinity_key": "tenant-b"}),
    )
    .await;
    assert_eq!(
        (
            b["reason"].as_str(),
            b["matched_blocks"].as_u64(),
            &b["endpoint"]
        ),
        (Some("hit"), Some(3), &a["endpoint"]),
        "{b}"
    );
    // Same tenant, new prefix: sticky.
    let (_, c) =
        route(json!({"rule": "1", "keys": [-7, 8], "token_count": 32, "affinity_key": "tenant-a"}))
            .await;
    assert_eq!(
        (c["reason"].as_str(), &c["endpoint"]),
        (Some("miss_no_overlap"), &a["endpoint"])
    );
    let (_, d) = route(json!({"rule": "1", "keys": [1], "token_count": 16})).await;
    assert_eq!(d["reason"], "miss_short_prompt");
    let (_, e) = route(json!({"rule": "10.0.0.1:9001", "keys": [1], "token_count": 64})).await;
    assert_eq!(
        (e["reason"].as_str(), e["endpoint"].as_str()),
        (Some("kv_off"), Some("127.0.0.3:80"))
    );
    assert_eq!(route(json!({"rule": "nope", "keys": []})).await.0, 404);
    assert_eq!(route(json!({"rule": "1", "keys": ["x"]})).await.0, 400);
    assert_eq!(route(json!({"keys": []})).await.0, 400);
    assert_eq!(svc.post("/v1/route", "[", None).await.0, 400);

    let m = svc.metrics().await;
    assert_metrics(
        &m,
        r#"
        # Five decisions plus the unknown-rule 404 (bodies that fail to parse are not timed).
        kvroute_route_decisions_total{reason="hit",tier="tier15"} 1
        kvroute_route_decisions_total{reason="miss_no_overlap",tier="fallback"} 2
        kvroute_route_decisions_total{reason="miss_short_prompt",tier="fallback"} 1
        kvroute_route_decisions_total{reason="kv_off",tier="fallback"} 1
        kvroute_tier15_spills_total 0
        kvroute_tier15_cold_seeds_total 0
        kvroute_route_duration_seconds_count 6
        kvroute_index_blocks{ep="1",rule="10.0.0.1:9000/tcp"} 0
        kvroute_endpoint_healthy{ep="0",rule="10.0.0.1:9000/tcp"} 1
        "#,
    );
    assert!(m.contains("# TYPE kvroute_route_duration_seconds histogram"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_question_is_answered_like_the_json_one() {
    use kvroute_core::wire::{binary, RouteRequest, WireKey};
    let svc = Service::start("route-binary", &json!([good_rule(9000)]), &[]);
    let contract = svc.get_json("/v1/rules/1/contract").await;
    assert_eq!(
        contract["route_content_types"],
        json!(["application/json", binary::CONTENT_TYPE])
    );
    let ask = |keys: &[u64], explain: bool| {
        binary::encode(RouteRequest {
            rule: "10.0.0.1:9000".into(),
            keys: keys.iter().map(|k| WireKey::Unsigned(*k)).collect(),
            token_count: 16 * keys.len() as u32,
            explain,
            ..Default::default()
        })
    };
    let (s, a) = svc
        .post_bytes("/v1/route", binary::CONTENT_TYPE, ask(&[11, 12, 13], false))
        .await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["reason"], "miss_no_overlap");
    // The decision credited the endpoint; the longer prefix now hits it, asked either way.
    let json_q = json!({"rule": "10.0.0.1:9000", "keys": [11, 12, 13, 14], "token_count": 64, "explain": true});
    let (_, by_json) = svc.post("/v1/route", &json_q.to_string(), None).await;
    let (_, by_binary) = svc
        .post_bytes(
            "/v1/route",
            binary::CONTENT_TYPE,
            ask(&[11, 12, 13, 14], true),
        )
        .await;
    assert_eq!(
        (
            &by_binary["reason"],
            &by_binary["matched_blocks"],
            &by_binary["endpoint"]
        ),
        (&json!("hit"), &json!(3), &a["endpoint"]),
        "{by_binary}"
    );
    assert_eq!(by_binary, by_json);
    // A malformed binary body is a 400 that names the part; parameters of the type are ignored.
    let (s, e) = svc
        .post_bytes(
            "/v1/route",
            binary::CONTENT_TYPE,
            json_q.to_string().into_bytes(),
        )
        .await;
    assert_eq!(s, 400);
    assert!(e["error"].as_str().unwrap().contains("KVR1"), "{e}");
    let mut ragged = ask(&[1, 2], false);
    ragged.pop();
    let (s, e) = svc
        .post_bytes(
            "/v1/route",
            &format!("{}; charset=binary", binary::CONTENT_TYPE),
            ragged,
        )
        .await;
    assert_eq!(s, 400);
    assert!(
        e["error"].as_str().unwrap().contains("15 bytes of keys"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_endpoints_are_skipped() {
    // Health checks on: endpoint 0 answers /health, endpoint 1 (nothing listening) does not.
    use axum::routing::get;
    let app = axum::Router::new().route("/health", get(|| async { "ok" }));
    let (port, server) = serve(app).await;
    let closed = free_port().unwrap();
    let r = rule(
        9000,
        "llamacpp",
        5557,
        &[("127.0.0.1".into(), closed), ("127.0.0.1".into(), port)],
        json!({}),
    );
    let svc = Service::start(
        "health",
        &json!([r]),
        &[("KVROUTE_HEALTH_INTERVAL_MS", "50")],
    );
    let series = r#"kvroute_endpoint_healthy{ep="0",rule="10.0.0.1:9000/tcp"}"#;
    keyless_routes_go_to(&svc, (series, 0.0), 4, port).await;
    server.abort();
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let mut svc = Service::start("sigterm", &json!([good_rule(9000)]), &[]);
    assert_eq!(svc.terminate(), Some(0), "{}", svc.stderr());
}

#[test]
fn help_documents_flags_and_env() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--listen",
        "--config",
        "--tokenizer-dir",
        "--auth-token-file",
        "KVROUTE_LISTEN",
        "LLB_KV_MIN_MATCH_TOKENS",
        "LOXILB_KV_SPILL_RELIEF",
        "KVROUTE_MAX_PREFIX_TOKENS",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_and_cold_seed_metrics() {
    let eps = [("127.0.0.1".to_owned(), 1), ("127.0.0.2".to_owned(), 1)];
    let keys = [0xA1u64, 0xA2, 0xA3];
    let req = json!({"rule": "1", "keys": keys, "token_count": 48}).to_string();

    // Spill relief (default on for kvExactMode 3): request k finds ep0 with k-1 in flight and a
    // cap of ceil(1.75 x k / 2) counting itself, so requests 1..=7 stay on the cache (a lone
    // conversation never spills) and the 8th, with 7 in flight against a cap of 7, moves to ep1.
    let mut p = Publisher::bind(0).await.unwrap();
    let svc = Service::start(
        "spill",
        &json!([rule(9000, "vllm", p.port, &eps, json!({}))]),
        &[],
    );
    seed_ep0(&svc, &mut p, &keys).await;
    for k in 1..=7 {
        let (_, a) = svc.post("/v1/route", &req, None).await;
        assert_eq!(
            (a["reason"].as_str(), a["endpoint"].as_str()),
            (Some("hit"), Some("127.0.0.1:1")),
            "request {k}: {a}"
        );
    }
    let (_, b) = svc.post("/v1/route", &req, None).await;
    assert_eq!(
        (b["reason"].as_str(), b["endpoint"].as_str()),
        (Some("spill"), Some("127.0.0.2:1")),
        "{b}"
    );
    assert_tier15_decisions(&svc, "spill", "kvroute_tier15_spills_total", 1).await;

    // Cold-start seeding: every 2nd hit goes to the endpoint holding fewer than 1 block.
    let mut p = Publisher::bind(0).await.unwrap();
    let svc = Service::start(
        "cold",
        &json!([rule(9000, "vllm", p.port, &eps, json!({}))]),
        &[
            ("LOXILB_KV_COLDSTART_SEED_N", "2"),
            ("LOXILB_KV_COLDSTART_MIN_BLOCKS", "1"),
            ("LOXILB_KV_SPILL_RELIEF", "off"),
        ],
    );
    seed_ep0(&svc, &mut p, &keys).await;
    let mut reasons = Vec::new();
    for _ in 0..4 {
        let (_, v) = svc.post("/v1/route", &req, None).await;
        reasons.push(format!(
            "{}@{}",
            v["reason"].as_str().unwrap(),
            v["endpoint"].as_str().unwrap()
        ));
    }
    assert_eq!(
        reasons,
        [
            "hit@127.0.0.1:1",
            "cold_seed@127.0.0.2:1",
            "hit@127.0.0.1:1",
            "cold_seed@127.0.0.2:1"
        ]
    );
    assert_tier15_decisions(&svc, "cold_seed", "kvroute_tier15_cold_seeds_total", 2).await;
}

/// The shadow policy decides every routed question a second time and only counts it. Live
/// (minimum match 16 tokens) against a shadow that needs 64: the first question is placed on
/// ep0 by live and sent there by the shadow's round robin; the second hits ep0's speculative
/// credit live while the shadow, skipping KV scoring, round-robins to ep1; the third (80 tokens)
/// is a hit for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shadow_policy_is_counted_and_not_acted_on() {
    let svc = Service::start(
        "shadow",
        &json!([good_rule(9000)]),
        &[
            ("KVROUTE_SHADOW", "LLB_KV_MIN_MATCH_TOKENS=64"),
            ("KVROUTE_SPEC_TTL_MS", "600000"),
        ],
    );
    let route = |keys: &[u64], explain: bool| {
        let body =
            json!({"rule": "1", "keys": keys, "token_count": 16 * keys.len(), "explain": explain});
        let svc = &svc;
        async move { svc.post("/v1/route", &body.to_string(), None).await.1 }
    };
    let mut answers = Vec::new();
    for keys in [&[1, 2, 3][..], &[1, 2, 3], &[1, 2, 3, 4, 5]] {
        let a = route(keys, false).await;
        answers.push(format!(
            "{}@{}",
            a["reason"].as_str().unwrap(),
            a["endpoint"].as_str().unwrap()
        ));
    }
    // Live acts on its own choices only.
    assert_eq!(
        answers,
        [
            "miss_no_overlap@127.0.0.1:1",
            "hit@127.0.0.1:1",
            "hit@127.0.0.1:1"
        ]
    );
    // An explain question is not shadowed.
    assert_eq!(route(&[1, 2, 3], true).await["reason"], "hit");
    let rule = r#"rule="10.0.0.1:9000/tcp""#;
    let m = svc.metrics().await;
    assert_metrics(
        &m,
        &format!(
            r#"
            kvroute_shadow_decisions_total{{outcome="same",{rule}}} 2
            kvroute_shadow_decisions_total{{outcome="different",{rule}}} 1
            kvroute_shadow_decisions_total{{outcome="no_endpoint",{rule}}} 0
            # Matched blocks of each choice: 0, 0, 3 (shadow) and 0, 3, 3 (live).
            kvroute_shadow_predicted_blocks_total{{{rule}}} 3
            kvroute_live_predicted_blocks_total{{{rule}}} 6
            kvroute_shadow_tier_total{{reason="miss_short_prompt",{rule},tier="fallback"}} 2
            kvroute_shadow_tier_total{{reason="hit",{rule},tier="tier15"}} 1
            kvroute_route_decisions_total{{reason="miss_no_overlap",tier="fallback"}} 1
            kvroute_route_decisions_total{{reason="hit",tier="tier15"}} 2
            "#
        ),
    );
    assert!(
        m.contains("# TYPE kvroute_shadow_decisions_total counter"),
        "{m}"
    );
    // Deleting the rule drops its shadow series.
    let del = format!("{LB}/externalipaddress/10.0.0.1/port/9000/protocol/tcp");
    assert_eq!(svc.delete(&del, Some(TOKEN)).await, 200);
    let m = svc.metrics().await;
    for name in ["kvroute_shadow_", "kvroute_live_predicted_blocks_total"] {
        assert_absent(&m, name);
    }

    // A service without a shadow exports none; a bad one refuses to start, naming it.
    let plain = Service::start("no-shadow", &json!([good_rule(9000)]), &[]);
    let (s, _) = plain
        .post(
            "/v1/route",
            &json!({"rule": "1", "keys": [1], "token_count": 16}).to_string(),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let m = plain.metrics().await;
    assert_absent(&m, "kvroute_shadow_");
    assert_absent(&m, "kvroute_live_predicted_blocks_total");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env(
            "KVROUTE_SHADOW",
            "LOXILB_KV_LB_MODE=soft,KVROUTE_HEALTH_FALL=1",
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(r#"KVROUTE_SHADOW: got "KVROUTE_HEALTH_FALL=1", allowed: comma-separated NAME=VALUE, NAME one of LLB_KV_MIN_MATCH_TOKENS,"#),
        "{err}"
    );
}

/// Asserts `n` tier-1.5 decisions for `reason`, in the decisions counter and in `counter`.
async fn assert_tier15_decisions(svc: &Service, reason: &str, counter: &str, n: u32) {
    let decisions = format!(r#"kvroute_route_decisions_total{{reason="{reason}",tier="tier15"}}"#);
    svc.assert_metrics(&format!("{counter} {n}\n{decisions} {n}"))
        .await;
}

fn qwen3_fixture() -> std::path::PathBuf {
    let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").exists(),
        "tokenizer fixture missing at {}: run ./scripts/setup.sh",
        dir.display()
    );
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_tokenization_computes_the_filters_keys() {
    let r = with(
        good_rule(9000),
        &["serviceArguments", "kvModel"],
        json!("Qwen/Qwen3-0.6B"),
    );
    let svc = Service::start("offload", &json!([r]), &[("LOXILB_KV_SPILL_RELIEF", "off")]);
    let staged = svc.dir.join("tokenizers").join("Qwen__Qwen3-0.6B");
    std::fs::create_dir_all(&staged).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(qwen3_fixture().join(f), staged.join(f)).unwrap();
    }
    let prompt = "You are a careful assistant for a company that builds routers for large language model inference clusters. ".repeat(4);
    // The keys a filter would compute: kvroute-core's tokenizer and the rule's contract (seed "0").
    let tok = kvroute_core::tokenize::Tokenizer::from_bytes(
        &std::fs::read(staged.join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    let tokens = tok.encode(&prompt, true).unwrap();
    let contract = kvroute_core::hash::HashContract::new(
        kvroute_core::hash::HashAlgo::Sha256Cbor,
        kvroute_core::hash::BlockSize::new(16).unwrap(),
    )
    .with_seed("0");
    let keys: Vec<u64> = contract
        .keys(&tokens, &Default::default())
        .unwrap()
        .iter()
        .map(|k| k.0)
        .collect();
    assert!(keys.len() >= 4);

    // Offloaded: the service tokenizes, hashes, decides and credits the chosen endpoint.
    let (s, a) = svc
        .post(
            "/v1/route",
            &json!({"rule": "1", "prompt": prompt}).to_string(),
            None,
        )
        .await;
    assert_eq!(
        (s, a["reason"].as_str()),
        (200, Some("miss_no_overlap")),
        "{a}\n{}",
        svc.stderr()
    );
    // The filter-computed keys now hit the same endpoint over every block: same keys both ways.
    let (_, b) = svc
        .post(
            "/v1/route",
            &json!({"rule": "1", "keys": keys, "token_count": tokens.len()}).to_string(),
            None,
        )
        .await;
    assert_eq!(
        (
            b["reason"].as_str(),
            b["matched_blocks"].as_u64(),
            &b["endpoint"]
        ),
        (Some("hit"), Some(keys.len() as u64), &a["endpoint"]),
        "{b}"
    );
    // Chat messages go through the staged chat template.
    let (s, c) = svc
        .post(
            "/v1/route",
            &json!({"rule": "1", "messages": [{"role": "user", "content": prompt}]}).to_string(),
            None,
        )
        .await;
    assert_eq!(s, 200, "{c}");
    assert_ne!(c["reason"], "miss_no_keys", "{c}\n{}", svc.stderr());

    // A 1M-character word is not merged: the keys stop before it; 1 MB of prose is routed on
    // its first KVROUTE_MAX_PREFIX_TOKENS (default 16384) tokens. Each cut is counted.
    let word = format!("{prompt}{}", "a".repeat(1_000_000));
    let prose = prompt.repeat((1 << 20) / prompt.len());
    for body in [
        json!({"rule": "1", "prompt": word}),
        json!({"rule": "1", "prompt": prose}),
    ] {
        let (s, r) = svc.post("/v1/route", &body.to_string(), None).await;
        assert_eq!(s, 200, "{r}");
        assert_ne!(r["reason"], "miss_no_keys", "{r}\n{}", svc.stderr());
    }
    let m = svc.metrics().await;
    for line in [
        "kvroute_offload_prompts_truncated_total{reason=\"long_piece\"} 1",
        "kvroute_offload_prompts_truncated_total{reason=\"max_tokens\"} 1",
    ] {
        assert!(m.contains(line), "{line} missing from:\n{m}");
    }
}

/// The offload path encodes with the fast BPE for Qwen3, and its keys equal HF tokenizers' keys
/// for completions and chat (multi-turn, special tokens spelled in the text too).
#[test]
fn offload_fast_encoder_equals_hf_tokenizers() {
    use kvroute_inventory::offload::{keys_for, Loaded, Offload};
    let dir = qwen3_fixture();
    let tj = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
    let load = |fast: bool| Loaded::new(&tj, Some(&config), fast).unwrap();
    let (fast, hf) = (load(true), load(false));
    assert!(fast.fast.is_some() && hf.fast.is_none() && fast.template.is_some());
    let contract = kvroute_core::hash::HashContract::new(
        kvroute_core::hash::HashAlgo::Sha256Cbor,
        kvroute_core::hash::BlockSize::new(16).unwrap(),
    )
    .with_seed("0");
    let text =
        "Routers  route. <|im_start|>user\nnaïve café, 1234 tokens?\n\n\tOK<|im_end|> ".repeat(12);
    let cases = [
        Offload {
            model: None,
            prompt: Some(text.clone()),
            messages: None,
        },
        Offload {
            model: None,
            prompt: None,
            messages: Some(json!([
                {"role": "system", "content": text},
                {"role": "user", "content": "Summarise the above in three words."},
                {"role": "assistant", "content": "Routers route well."},
                {"role": "user", "content": "Again, twice."},
            ])),
        },
    ];
    for o in &cases {
        let a = keys_for(&fast, &contract, o, 16_384).unwrap();
        let b = keys_for(&hf, &contract, o, 16_384).unwrap();
        assert!(a.keys.len() >= 8, "{}", a.keys.len());
        assert_eq!(a, b);
        // Again, now from the segment cache.
        assert_eq!(keys_for(&fast, &contract, o, 16_384).unwrap(), b);
    }
    let (segments, _) = fast.fast.as_ref().unwrap().lock().unwrap().usage();
    assert!(segments > 0, "the segment cache is in use");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_serves_https_and_drains() {
    let (ca, cert, key) = common::test_ca(&tempdir("tlscert"));
    let ca_s = ca.to_string_lossy().into_owned();
    let (c, k) = (
        cert.to_string_lossy().into_owned(),
        key.to_string_lossy().into_owned(),
    );
    let mut svc = Service::start(
        "tls",
        &json!([good_rule(9000)]),
        &[
            ("KVROUTE_TLS_CERT", &c),
            ("KVROUTE_TLS_KEY", &k),
            ("KVROUTE_TEST_CA", &ca_s),
        ],
    );
    assert!(svc.base.starts_with("https://"), "{}", svc.base);
    assert_eq!(svc.get("/readyz").await.0, 200);
    let (s, v) = svc
        .post(LB, &good_rule(9001).to_string(), Some(TOKEN))
        .await;
    assert_eq!(s, 200, "{v}");
    // Plain HTTP on the TLS port gets nothing useful.
    let plain = reqwest::Client::new()
        .get(svc.base.replace("https://", "http://") + "/readyz")
        .send()
        .await;
    assert!(plain.map(|r| !r.status().is_success()).unwrap_or(true));
    assert_eq!(svc.terminate(), Some(0), "{}", svc.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_engine_load_steers_least_loaded() {
    // Two fake engines: ep0 reports 50 requests running+waiting, ep1 none.
    use axum::routing::get;
    let mut ports = Vec::new();
    let mut servers = Vec::new();
    for load in [50, 0] {
        let body = format!("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {}.0\nvllm:num_requests_waiting{{model_name=\"m\"}} 0.0\n", load);
        let app = axum::Router::new().route(
            "/metrics",
            get(move || {
                let b = body.clone();
                async move { b }
            }),
        );
        let (port, server) = serve(app).await;
        ports.push(port);
        servers.push(server);
    }
    // sel 4: least connections on the plain-load-balancing rule.
    let r = with(
        rule(
            9000,
            "llamacpp",
            5557,
            &[
                ("127.0.0.1".into(), ports[0]),
                ("127.0.0.1".into(), ports[1]),
            ],
            json!({}),
        ),
        &["serviceArguments", "sel"],
        json!(4),
    );
    let svc = Service::start(
        "scrape",
        &json!([r]),
        &[("KVROUTE_SCRAPE_INTERVAL_MS", "50")],
    );
    let series = r#"kvroute_endpoint_scraped_load{ep="0",rule="10.0.0.1:9000/tcp"}"#;
    keyless_routes_go_to(&svc, (series, 50.0), 5, ports[1]).await;
    for s in servers {
        s.abort();
    }
}

/// Waits until the metric series reads the value (the signal the endpoint choice depends on),
/// then asserts that `n` routes without keys all go to `127.0.0.1:port`.
async fn keyless_routes_go_to(svc: &Service, (series, value): (&str, f64), n: usize, port: u16) {
    svc.wait_for(series, 10, async || {
        metric(&svc.metrics().await, series) == Some(value)
    })
    .await;
    let want = format!("127.0.0.1:{port}");
    for _ in 0..n {
        let (s, v) = svc
            .post(
                "/v1/route",
                &json!({"rule": "1", "keys": []}).to_string(),
                None,
            )
            .await;
        assert_eq!(
            (s, v["endpoint"].as_str()),
            (200, Some(want.as_str())),
            "{v}"
        );
    }
}

/// `n` endpoints on loopback addresses 127.1.x.y (clear of the stack script's 127.0.0.10-12),
/// serving port 8000.
fn wide_endpoints(n: usize) -> Vec<(String, u16)> {
    (0..n)
        .map(|i| (format!("127.1.{}.{}", i / 250, i % 250 + 1), 8000))
        .collect()
}

/// A rule of 1,024 endpoints is accepted (one more is refused naming the field and the limit),
/// and a prefix stored by endpoint 1000 over its real ZMQ feed routes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_of_1024_endpoints_routes_past_index_64() {
    // Endpoint 1000 is 127.1.4.1; its publisher's port is the rule's kvZmqPort (the other
    // endpoints' subscribers find nothing there and retry). No health probes: nothing serves.
    let mut p = Publisher::bind_on("127.1.4.1", 0).await.unwrap();
    let svc = Service::start(
        "wide",
        &json!([]),
        &[
            ("KVROUTE_HEALTH_INTERVAL_MS", "0"),
            ("KVROUTE_SPEC_TTL_MS", "0"),
        ],
    );
    let (s, v) = svc
        .post_rule(&rule(
            9100,
            "vllm",
            p.port,
            &wide_endpoints(1025),
            json!({}),
        ))
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        v["problems"],
        json!([{"field": "endpoints", "value": "1025 entries", "allowed": "at most 1024 endpoints per rule"}]),
        "{v}"
    );
    let (s, v) = svc
        .post_rule(&rule(
            9100,
            "vllm",
            p.port,
            &wide_endpoints(1024),
            json!({}),
        ))
        .await;
    assert_eq!(s, 200, "{v}");
    let id = v["id"].to_string();
    let keys = [0xF000u64, 0xF001, 0xF002, 0xF003];
    let probe = batch(vec![stored(&keys, &[], false)]);
    publish_until_seen(&svc, &mut p, &id, 1000, keys[0], &probe).await;
    let mut held = svc.inventory(&id, 1000).await;
    held.sort_unstable();
    assert_eq!(held, keys);
    assert!(svc.inventory(&id, 999).await.is_empty());
    let body = json!({"rule": id, "keys": keys, "token_count": 64});
    let (s, a) = svc.post("/v1/route", &body.to_string(), None).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(
        (
            a["reason"].as_str(),
            a["endpoint"].as_str(),
            a["matched_blocks"].as_u64()
        ),
        (Some("hit"), Some("127.1.4.1:8000"), Some(4)),
        "{a}"
    );
    // Evicted: the prefix no longer routes there.
    p.send(&batch(vec![removed(&keys[1..])])).await;
    svc.wait_for("the eviction of endpoint 1000's blocks", 10, || async {
        svc.inventory(&id, 1000).await == [0xF000]
    })
    .await;
    svc.assert_metrics(r#"kvroute_index_blocks{ep="1000",rule="10.0.0.1:9100/tcp"} 1"#)
        .await;
}
