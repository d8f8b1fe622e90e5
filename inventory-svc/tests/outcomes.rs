//! `POST /v1/rules/{id}/outcomes`: the filters' predicted-against-realised reports make an
//! endpoint whose engine reuses nothing divergent in `/healthz` and `/metrics`, routing stops
//! following its locality (`KVROUTE_DIVERGENCE_POLICY=load_only`) or keeps it (`keep`), and the
//! verdict clears once its reports leave the window. Bad reports are refused naming the problem.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};

const KEYS: [u64; 3] = [0xB1, 0xB2, 0xB3];

/// A report for one endpoint: `qualifying` responses predicted 3 blocks, `missed` of them
/// reused none, the others all 3.
fn report(endpoint: &str, qualifying: u64, missed: u64) -> String {
    json!({"endpoints": [{"endpoint": endpoint, "judged": qualifying, "exact": qualifying - missed,
        "under": 0, "over": missed, "qualifying": qualifying, "missed": missed,
        "predicted_blocks": 3 * qualifying, "realised_blocks": 3 * (qualifying - missed),
        "prompt_tokens": 64 * qualifying, "cached_tokens": 48 * (qualifying - missed)}]})
    .to_string()
}

/// A service with rule 1 over two endpoints, ep0 holding [`KEYS`].
async fn seeded(tag: &str, env: &[(&str, &str)]) -> Service {
    let eps = [("127.0.0.1".to_owned(), 1), ("127.0.0.2".to_owned(), 1)];
    let mut p = Publisher::bind(0).await.unwrap();
    let mut all = vec![
        ("KVROUTE_DIVERGENCE_MIN_REQUESTS", "5"),
        ("LOXILB_KV_SPILL_RELIEF", "off"),
    ];
    all.extend_from_slice(env);
    let svc = Service::start(
        tag,
        &json!([rule(9000, "vllm", p.port, &eps, json!({}))]),
        &all,
    );
    seed_ep0(&svc, &mut p, &KEYS).await;
    svc
}

/// Rule 1 over one endpoint, 127.0.0.1:1, with no publisher.
fn one_endpoint_rule() -> Value {
    json!([rule(
        9000,
        "vllm",
        5557,
        &[("127.0.0.1".into(), 1)],
        json!({})
    )])
}

async fn route(svc: &Service) -> Value {
    let req = json!({"rule": "1", "keys": KEYS, "token_count": 48}).to_string();
    let (s, a) = svc.post("/v1/route", &req, None).await;
    assert_eq!(s, 200, "{a}");
    a
}

async fn ep0_health(svc: &Service) -> (Value, Value) {
    let h = svc.get_json("/healthz").await;
    let ep0 = h["rules"][0]["endpoints"][0].clone();
    (h, ep0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_reuses_nothing_diverges_and_routes_on_load_only() {
    let svc = seeded("outcomes", &[]).await;
    let a = route(&svc).await;
    assert_eq!(
        (a["reason"].as_str(), a["matched_blocks"].as_u64()),
        (Some("hit"), Some(3))
    );

    // Four of five with nothing reused is 80%, but one report short of the minimum: quiet.
    let (s, v) = svc
        .post("/v1/rules/1/outcomes", &report("127.0.0.1:1", 4, 4), None)
        .await;
    assert_eq!((s, &v), (200, &json!({"endpoints": 1, "unknown": 0})));
    let (h, ep0) = ep0_health(&svc).await;
    assert_eq!(
        (h["status"].as_str(), &ep0["divergence"]),
        (Some("ok"), &Value::Null)
    );
    assert_eq!(ep0["outcomes"]["qualifying"], 4);

    // The fifth: divergent, by rule id or VIP:port alike, with the cause.
    let (s, _) = svc
        .post(
            "/v1/rules/10.0.0.1:9000/outcomes",
            &report("127.0.0.1:1", 1, 1),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let (h, ep0) = ep0_health(&svc).await;
    assert_eq!(h["status"], "degraded");
    let cause = ep0["divergence"].as_str().unwrap();
    assert!(cause.contains("chat template"), "{cause}");
    assert_eq!(
        (&ep0["outcomes"]["qualifying"], &ep0["outcomes"]["missed"]),
        (&json!(5), &json!(5))
    );
    assert_eq!(h["rules"][0]["endpoints"][1]["outcomes"], Value::Null);
    svc.assert_metrics(
        r#"kvroute_endpoint_divergent{ep="0",rule="10.0.0.1:9000/tcp"} 1
kvroute_endpoint_divergent{ep="1",rule="10.0.0.1:9000/tcp"} 0
kvroute_endpoint_outcomes_total{ep="0",rule="10.0.0.1:9000/tcp",verdict="over"} 5
kvroute_endpoint_predicted_blocks_total{ep="0",rule="10.0.0.1:9000/tcp"} 15
kvroute_endpoint_realised_blocks_total{ep="0",rule="10.0.0.1:9000/tcp"} 0
kvroute_endpoint_prompt_tokens_total{ep="0",rule="10.0.0.1:9000/tcp"} 320
kvroute_endpoint_cached_tokens_total{ep="0",rule="10.0.0.1:9000/tcp"} 0
kvroute_outcome_reports_total 2"#,
    )
    .await;
    assert!(
        svc.stderr().contains("endpoint diverges"),
        "{}",
        svc.stderr()
    );

    // load_only: its blocks no longer attract the prefix.
    let b = route(&svc).await;
    assert_eq!(b["matched_blocks"], 0, "{b}");
    assert_ne!(b["reason"], "hit", "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_reports_but_routes_as_before_and_the_verdict_leaves_with_its_window() {
    let svc = seeded(
        "outcomes-keep",
        &[
            ("KVROUTE_DIVERGENCE_POLICY", "keep"),
            ("KVROUTE_DIVERGENCE_WINDOW_MS", "1000"),
        ],
    )
    .await;
    let (s, _) = svc
        .post("/v1/rules/1/outcomes", &report("127.0.0.1:1", 5, 5), None)
        .await;
    assert_eq!(s, 200);
    let (_, ep0) = ep0_health(&svc).await;
    assert!(ep0["divergence"].is_string(), "{ep0}");
    let a = route(&svc).await;
    assert_eq!(
        (a["reason"].as_str(), a["matched_blocks"].as_u64()),
        (Some("hit"), Some(3))
    );
    svc.wait_for("the verdict to leave its 1 s window", 10, async || {
        ep0_health(&svc).await.1["divergence"].is_null()
    })
    .await;
    let (h, ep0) = ep0_health(&svc).await;
    assert_eq!(
        (h["status"].as_str(), &ep0["outcomes"]),
        (Some("ok"), &Value::Null)
    );
    svc.wait_metric(
        r#"kvroute_endpoint_divergent{ep="0",rule="10.0.0.1:9000/tcp"}"#,
        0.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_reports_are_refused_and_unknown_endpoints_counted() {
    let svc = Service::start("outcomes-bad", &one_endpoint_rule(), &[]);
    let post = |path: &'static str, body: String| {
        let svc = &svc;
        async move { svc.post(path, &body, None).await }
    };
    let (s, v) = post("/v1/rules/7/outcomes", report("127.0.0.1:1", 1, 1)).await;
    assert_eq!(s, 404, "{v}");
    for (body, says) in [
        ("[".to_owned(), "malformed JSON"),
        (r#"{"endpoints":[{"endpoint":"x"}]}"#.to_owned(), "missing field"),
        (
            r#"{"endpoints":[],"extra":1}"#.to_owned(),
            "unknown field `extra`",
        ),
        (
            json!({"endpoints": vec![json!({"endpoint": "127.0.0.1:1", "judged": 1, "exact": 1, "under": 0,
                "over": 0, "qualifying": 0, "missed": 0, "predicted_blocks": 0, "realised_blocks": 0}); 1025]})
            .to_string(),
            "endpoints: 1025 entries, at most 1024",
        ),
    ] {
        let (s, v) = post("/v1/rules/1/outcomes", body).await;
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains(says), "{says}: {v}");
    }
    let (s, v) = post("/v1/rules/1/outcomes", report("10.9.9.9:1", 1, 1)).await;
    assert_eq!((s, &v), (200, &json!({"endpoints": 0, "unknown": 1})));
    svc.assert_metrics("kvroute_outcome_unknown_endpoints_total 1")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_need_the_route_token_when_one_is_set() {
    let dir = tempdir("outcomes-token");
    let token = dir.join("route-token");
    std::fs::write(&token, "rt-secret\n").unwrap();
    let svc = Service::start_with_args(
        "outcomes-token",
        &one_endpoint_rule(),
        &[],
        &["--route-token-file", token.to_str().unwrap()],
    );
    let body = report("127.0.0.1:1", 1, 0);
    assert_eq!(svc.post("/v1/rules/1/outcomes", &body, None).await.0, 401);
    assert_eq!(
        svc.post("/v1/rules/1/outcomes", &body, Some("rt-secret"))
            .await
            .0,
        200
    );
}

/// The reports' tenants are summed per tenant (and model under `tenant_model`), listed most
/// prompt tokens first with the management token, bounded by `KVROUTE_TENANTS_MAX`; malformed
/// tenant entries are refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_accounted_bounded_and_need_the_management_token() {
    let svc = Service::start(
        "outcomes-tenants",
        &one_endpoint_rule(),
        &[("KVROUTE_TENANTS_MAX", "3")],
    );
    let tenant = |t: &str, model: Option<&str>, prompt: u64, cached: u64| json!({"tenant": t, "model": model, "requests": 1, "prompt_tokens": prompt, "cached_tokens": cached});
    let reports = [
        json!({"endpoints": [], "tenants": [tenant("user:a", Some("m"), 100, 75), tenant("ip:10.0.0.7", None, 400, 0)]}),
        json!({"endpoints": [], "tenants": [tenant("user:a", Some("m2"), 100, 25), tenant("user:c", None, 8, 8)]}),
        json!({"endpoints": [], "tenants": [tenant("user:d", None, 2, 0)]}),
    ];
    for r in &reports {
        let (s, v) = svc.post("/v1/rules/1/outcomes", &r.to_string(), None).await;
        assert_eq!(s, 200, "{v}");
    }
    let path = "/v1/rules/1/tenants";
    assert_eq!(
        svc.call(reqwest::Method::GET, path, None).await.status(),
        401
    );
    let r = svc.call(reqwest::Method::GET, path, Some(TOKEN)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let rows: Vec<(String, u64, u64, u64)> = v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let n = |f: &str| t[f].as_u64().unwrap();
            (
                t["tenant"].as_str().unwrap().to_owned(),
                n("requests"),
                n("prompt_tokens"),
                n("cached_tokens"),
            )
        })
        .collect();
    // The default scope is the tenant: user:a's two models are one tenant.
    assert_eq!(
        rows,
        [
            ("ip:10.0.0.7".to_owned(), 1, 400, 0),
            ("user:a".to_owned(), 2, 200, 100),
            ("(other)".to_owned(), 2, 10, 8),
        ]
    );
    assert_eq!(v["tenants"][1]["cached_ratio"], 0.5);
    svc.assert_metrics("kvroute_tenants{rule=\"10.0.0.1:9000/tcp\"} 3")
        .await;
    svc.assert_metrics("kvroute_tenant_folded_total{rule=\"10.0.0.1:9000/tcp\"} 2")
        .await;
    let long = "x".repeat(257);
    for (body, says) in [
        (
            json!({"endpoints": [], "tenants": vec![tenant("user:a", None, 1, 1); 257]}),
            "tenants: 257 entries, at most 256",
        ),
        (
            json!({"endpoints": [], "tenants": [tenant("user:a", Some(&long), 1, 1)]}),
            "tenants[0].model: 257 bytes, at most 256",
        ),
    ] {
        let (s, v) = svc
            .post("/v1/rules/1/outcomes", &body.to_string(), None)
            .await;
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains(says), "{says}: {v}");
    }
}
