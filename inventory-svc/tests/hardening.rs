//! The service under hostile or broken peers: connection floods, unauthenticated route writes,
//! re-posted rules, dead engines. Real binary on 127.0.0.1, bounded waits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULE: &str = "10.0.0.1:8080";

fn route_body() -> String {
    json!({"rule": RULE, "keys": [1, 2], "token_count": 32}).to_string()
}

fn two_endpoint_rule() -> Value {
    rule(
        8080,
        "vllm",
        5557,
        &[("127.0.0.1".into(), 1), ("127.0.0.2".into(), 1)],
        json!({}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_flood_beyond_the_cap_does_not_stop_routing() {
    let svc = Service::start(
        "flood",
        &json!([two_endpoint_rule()]),
        &[
            ("KVROUTE_MAX_CONNECTIONS", "64"),
            ("KVROUTE_HTTP_HEADER_TIMEOUT_MS", "400"),
        ],
    );
    let addr = svc.base.strip_prefix("http://").unwrap().to_owned();
    // 200 clients that send half a request and then nothing.
    let mut flood = Vec::new();
    for _ in 0..200 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /v1/route HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n")
            .await
            .unwrap();
        flood.push(s);
    }
    // A new client is answered once the header timeout frees slots (bounded: 200/64 rounds).
    let t0 = Instant::now();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let r = http
        .post(format!("{}/v1/route", svc.base))
        .header("content-type", "application/json")
        .body(route_body())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "route answered after {waited:?}"
    );
    // Every half-sent connection is closed by the service (EOF or reset), within a bounded time.
    let end = Instant::now() + Duration::from_secs(10);
    for s in &mut flood {
        let mut buf = [0u8; 256];
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(_)) | Ok(Err(_)) => {}
            Err(_) => panic!("a half-sent connection is still open after 10 s"),
        }
    }
    let m = svc.metrics().await;
    let closed = metric(
        &m,
        r#"kvroute_http_connections_closed_total{reason="header_timeout"}"#,
    )
    .unwrap_or(0.0);
    assert!(closed >= 200.0, "{m}");
    assert!(
        metric(&m, "kvroute_http_connection_limit_waits_total").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connection_is_closed_after_the_idle_timeout() {
    let svc = Service::start(
        "idle",
        &json!([]),
        &[("KVROUTE_HTTP_IDLE_TIMEOUT_MS", "300")],
    );
    let addr = svc.base.strip_prefix("http://").unwrap().to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
    let m = svc.metrics().await;
    assert_metric(
        &m,
        r#"kvroute_http_connections_closed_total{reason="idle_timeout"}"#,
        1.0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_token_is_required_when_configured() {
    let dir = tempdir("routetok");
    let tok = dir.join("route-token");
    std::fs::write(&tok, "r0ute-secret\n").unwrap();
    let svc = Service::start(
        "routetok",
        &json!([two_endpoint_rule()]),
        &[("KVROUTE_ROUTE_TOKEN_FILE", tok.to_str().unwrap())],
    );
    let (s, _) = svc.post("/v1/route", &route_body(), None).await;
    assert_eq!(s, 401);
    let (s, _) = svc.post("/v1/route", &route_body(), Some("wrong")).await;
    assert_eq!(s, 401);
    let (s, b) = svc
        .post("/v1/route", &route_body(), Some("r0ute-secret"))
        .await;
    assert_eq!(s, 200, "{b}");
    // The scheme is case-insensitive (RFC 9110), for /v1/route and the management writes.
    for (path, token) in [
        ("/v1/route", "r0ute-secret"),
        ("/netlox/v1/config/loadbalancer", TOKEN),
    ] {
        let body = if path == "/v1/route" {
            route_body()
        } else {
            two_endpoint_rule().to_string()
        };
        let r = svc
            .http
            .post(format!("{}{path}", svc.base))
            .header("content-type", "application/json")
            .header("authorization", format!("bearer {token}"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status().as_u16(),
            200,
            "{path}: {}",
            r.text().await.unwrap()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_is_open_without_a_route_token() {
    let svc = Service::start("routeopen", &json!([two_endpoint_rule()]), &[]);
    let (s, b) = svc.post("/v1/route", &route_body(), None).await;
    assert_eq!(s, 200, "{b}");
}

/// Posts `rule`; expects 200 and the answer's `unchanged` to be `unchanged`.
async fn post_rule(svc: &Service, rule: &Value, unchanged: bool) {
    let (s, b) = svc.post_rule(rule).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["unchanged"], unchanged, "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reposting_a_rule_keeps_its_inventory() {
    let mut p = Publisher::bind(0).await.unwrap();
    let r = rule(8080, "vllm", p.port, &[("127.0.0.1".into(), 9)], json!({}));
    let svc = Service::start("repost", &json!([]), &[]);
    post_rule(&svc, &r, false).await;
    let probe = batch(vec![stored(&[0xABCD], &[], false)]);
    publish_until_seen(&svc, &mut p, RULE, 0, 0xABCD, &probe).await;
    let keys: Vec<u64> = (1..=100).collect();
    p.send(&batch(vec![stored(&keys, &[], false)])).await;
    svc.wait_for("100 blocks", 10, || async {
        svc.inventory(RULE, 0).await.len() == 101
    })
    .await;

    // The identical rule again (a GitOps reconciler's pass): a no-op.
    post_rule(&svc, &r, true).await;
    assert_eq!(svc.inventory(RULE, 0).await.len(), 101);

    // A change that keeps the endpoints and the hash contract keeps the blocks, and the new
    // subscriber goes on ingesting from the same publisher.
    let changed = rule(
        8080,
        "vllm",
        p.port,
        &[("127.0.0.1".into(), 9)],
        json!({"sel": 1}),
    );
    post_rule(&svc, &changed, false).await;
    assert_eq!(svc.inventory(RULE, 0).await.len(), 101);
    let m = svc.metrics().await;
    assert_metric(
        &m,
        r#"kvroute_index_blocks{ep="0",rule="10.0.0.1:8080/tcp"}"#,
        101.0,
    );
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        p.send(&batch(vec![stored(&[0x5000], &[], false)])).await;
        let inv = svc.inventory(RULE, 0).await;
        if inv.contains(&0x5000) {
            assert!(inv.len() >= 101, "{}", inv.len());
            break;
        }
        assert!(Instant::now() < end, "the replaced rule never ingested");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fake engine's serving port: answers every request 200 and closes. Aborting the task closes
/// the listener (a killed engine: connection refused).
async fn fake_engine() -> (u16, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let h = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    (port, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_engine_is_unroutable_within_a_second_or_two() {
    let (pa, _a) = fake_engine().await;
    let (pb, b) = fake_engine().await;
    // Round robin over both (sel 0), no KV so every answer is the fallback's choice.
    let r = rule(
        8080,
        "vllm",
        5557,
        &[("127.0.0.1".into(), pa), ("127.0.0.1".into(), pb)],
        json!({"kvExactMode": 0}),
    );
    // The default health interval (the harness disables checks unless told otherwise).
    let svc = Service::start(
        "dead",
        &json!([r]),
        &[("KVROUTE_HEALTH_INTERVAL_MS", UNSET)],
    );
    let dead = format!("127.0.0.1:{pb}");
    let chosen = || async {
        let (s, b) = svc.post("/v1/route", &route_body(), None).await;
        assert_eq!(s, 200, "{b}");
        b["endpoint"].as_str().unwrap().to_owned()
    };
    // Both are chosen while alive.
    let mut seen_b = false;
    for _ in 0..20 {
        seen_b |= chosen().await == dead;
    }
    assert!(seen_b, "round robin never chose the second endpoint");
    // Kill it under route load; measure until 20 answers in a row avoid it.
    b.abort();
    let _ = b.await;
    let t0 = Instant::now();
    let mut clean = 0;
    while clean < 20 {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "the dead endpoint is still chosen after {:?}",
            t0.elapsed()
        );
        if chosen().await == dead {
            clean = 0;
        } else {
            clean += 1;
        }
    }
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(2), "unroutable after {took:?}");
    let m = svc.metrics().await;
    assert_metric(
        &m,
        r#"kvroute_endpoint_healthy{ep="1",rule="10.0.0.1:8080/tcp"}"#,
        0.0,
    );
    assert!(
        metric(
            &m,
            r#"kvroute_endpoint_health_probes_total{outcome="refused"}"#
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{m}"
    );
    eprintln!("dead engine unroutable after {took:?}");
}
