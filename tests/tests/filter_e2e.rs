//! End-to-end tests of the filter's data plane: real Envoy 1.40 (V8) running the built `.wasm`,
//! the real `kvroute-inventory` binary fed through its real ingestion path (TensorRT-LLM drains
//! from the engine stand-ins), and HTTP backends started by the test.
//!
//! What must hold: the filter pins to the endpoint the service chose; a client's own pin header
//! is ignored; an unhealthy chosen endpoint falls back; inventory down / slow / 500 / garbage,
//! malformed or huge or non-UTF-8 bodies, missing fields and unknown paths are all served (200)
//! unpinned with the body byte-for-byte; response usage lands in the filter's stats, and what the
//! engines reused against what was predicted reaches the inventory, where an engine that reuses
//! nothing of its predicted prefixes shows as divergent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_test_support::{Poll, Probe};
use kvroute_tests::envoy::{
    self, base64, Bootstrap, Engine, FakeInventory, Fault, Gateway, Inventory, Variant, PIN_HEADER,
    SSE_HEADER, USAGE_HEADER,
};
use kvroute_tests::harness::{self, header, BACKEND_HEADER};
use serde_json::{json, Value};

const READY: Duration = Duration::from_secs(60);

/// A multi-turn chat body long enough for several 16-token blocks, with non-ASCII text.
fn chat_body(extra: Value) -> Vec<u8> {
    let mut v = json!({
        "model": envoy::MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Réponds en français si on te parle français. 你好 🚀"},
            {"role": "user", "content": "Explain, step by step, how a paged KV cache lets an inference engine reuse the prefix of a prompt that it has already seen, and why routing requests with the same prefix to the same engine matters."},
        ],
        "max_tokens": 1
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    serde_json::to_vec(&v).unwrap()
}

/// Starts Envoy with the filter placed as in envoy/envoy.yaml in front of `engines`.
async fn gateway(engines: &[&Engine], inventory: SocketAddr, plugin: Value) -> Gateway {
    let b = Bootstrap::new(engines, inventory, plugin, Variant::EnvoyFilter);
    Gateway::start(b).await.unwrap()
}

/// Starts the real inventory with a rule over engines a and b, b holding the prompt's blocks.
async fn fleet(body: &[u8]) -> (Inventory, Engine, Engine, usize) {
    fleet_with_route_token(body, None).await
}

/// [`fleet`], the inventory requiring `route_token` on `/v1/route` when given.
async fn fleet_with_route_token(
    body: &[u8],
    route_token: Option<&str>,
) -> (Inventory, Engine, Engine, usize) {
    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let tokens = harness::prompt_tokens(body).unwrap();
    let blocks = tokens.len() / envoy::BLOCK;
    assert!(blocks >= 3, "prompt too short: {} tokens", tokens.len());
    b.store_blocks(&tokens);
    let inv = Inventory::start_with_route_token(route_token)
        .await
        .unwrap();
    let rule = inv.add_rule(&[&a, &b]).await.unwrap();
    inv.wait_for_blocks(rule, 1, blocks).await.unwrap();
    (inv, a, b, blocks)
}

/// The routed path, shared by both filter placements.
async fn pins_to_the_chosen_endpoint(variant: Variant) {
    let body = chat_body(json!({}));
    let (inv, a, b, blocks) = fleet(&body).await;
    let engines = [&a, &b];
    let gw = Gateway::start(Bootstrap::new(&engines, inv.addr, json!({}), variant))
        .await
        .unwrap();
    gw.wait_until_routing(READY).await.unwrap();

    // A client pins itself to engine a: Envoy drops that and the service's choice (b) wins.
    let spoof = base64(a.addr.to_string().as_bytes());
    let before = b.received().len();
    let r = match gw
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[
                (PIN_HEADER, &spoof),
                ("x-prefiller-host-port", "10.9.9.9:1"),
            ],
        )
        .await
    {
        Ok(r) => r,
        Err(e) => {
            let log = gw.envoy.log();
            let tail: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("wasm") || l.contains("kvroute"))
                .collect();
            panic!("{e:#}; Envoy log:\n{}", tail.join("\n"));
        }
    };
    assert_eq!(r.status(), 200);
    if r.headers()[BACKEND_HEADER] != "engine-b" {
        let log = gw.envoy.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("kvroute")).collect();
        let clusters = reqwest::get(format!("http://{}/clusters", gw.envoy.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let health: Vec<&str> = clusters
            .lines()
            .filter(|l| l.contains("health_flags"))
            .collect();
        panic!(
            "not pinned to b ({}; a is {}): {health:?} {:?}\na got {:?}\nstats {:?}\nlog:\n{}",
            b.addr,
            a.addr,
            r.headers(),
            a.received().last().map(|x| x.headers.clone()),
            gw.envoy.stats("kvroute").await.unwrap(),
            lines.join("\n")
        );
    }
    assert!(
        r.headers().get(PIN_HEADER).is_none(),
        "session header leaked to the client"
    );
    let echoed = r.bytes().await.unwrap();
    assert!(echoed.as_ref() == body.as_slice(), "response body differs");
    let got = b.received();
    assert_eq!(got.len(), before + 1);
    let last = got.last().unwrap();
    assert!(
        last.body.as_ref() == body.as_slice(),
        "backend received a different body"
    );
    assert_eq!(
        header(last, PIN_HEADER),
        Some(base64(b.addr.to_string().as_bytes()).as_str())
    );
    assert_eq!(header(last, "x-kvroute-tier"), Some("tier15"));
    assert_eq!(
        header(last, "x-kvroute-matched-blocks"),
        Some(blocks.to_string().as_str())
    );
    assert_eq!(header(last, "x-prefiller-host-port"), None);
    // Envoy's header_mutation (first filter) removed both before the filter saw them.
    assert_stats(&gw, &[("kvroute_filter_spoofed_headers_total", 0)]).await;
    assert!(
        gw.stat("kvroute_filter_decisions_tier15_total")
            .await
            .unwrap()
            >= 1
    );
    assert!(
        gw.stat("kvroute_filter_segment_cache_hits_total")
            .await
            .unwrap()
            > 0,
        "repeated prompt should hit the segment cache"
    );
    // Qwen3's template is rendered natively (chat_template::native).
    assert!(gw.stat("kvroute_filter_render_native_total").await.unwrap() >= 1);

    // An unrouted path with a spoofed pin: Envoy strips the header before the filter and
    // stateful_session (which reads request headers as they reach it and forwards them
    // unchanged), so no engine may see it. (Which engine answers is Envoy's round robin per worker: not asserted, since a
    // worker's host set can lag the health the admin API shows.)
    let spoofed_before = gw
        .stat("kvroute_filter_spoofed_headers_total")
        .await
        .unwrap();
    let seen_before = a.received().len() + b.received().len();
    for _ in 0..6 {
        let r = gw
            .client
            .get(format!("{}/v1/models", gw.base))
            .header(PIN_HEADER, &spoof)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().contains_key(BACKEND_HEADER));
    }
    let mut gets: Vec<harness::Received> = a.received();
    gets.extend(b.received());
    let gets: Vec<&harness::Received> = gets.iter().filter(|r| r.path == "/v1/models").collect();
    assert_eq!(a.received().len() + b.received().len(), seen_before + 6);
    assert!(gets.len() >= 6);
    for g in &gets {
        assert_eq!(
            header(g, PIN_HEADER),
            None,
            "a spoofed pin reached an engine"
        );
    }
    assert_eq!(
        gw.stat("kvroute_filter_spoofed_headers_total")
            .await
            .unwrap(),
        spoofed_before,
        "Envoy strips spoofed pins before the filter"
    );

    // Usage: the echo returns the request's own `usage` (non-streaming); SSE from the stand-in.
    let with_usage = chat_body(
        json!({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}),
    );
    let r = gw
        .post("/v1/chat/completions", with_usage, &[])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    let r = gw
        .post("/v1/chat/completions", body.clone(), &[(SSE_HEADER, "1")])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    wait_stat_at_least(&gw, "kvroute_filter_cache_hit_tokens_total", 96).await;
    assert_stats(
        &gw,
        &[
            ("kvroute_filter_cache_hit_tokens_total", 64 + 32),
            ("kvroute_filter_cache_miss_tokens_total", 36 + 8),
        ],
    )
    .await;

    // Every pinned request so far reached its pinned engine, and the filter saw it.
    let honored = gw.stat("kvroute_filter_pin_honored_total").await.unwrap();
    assert!(honored > 0, "no pin checked against the upstream");
    assert_stats(&gw, &[("kvroute_filter_pin_overridden_total", 0)]).await;

    // The chosen endpoint turns unhealthy: stateful_session falls back to engine a.
    b.set_healthy(false);
    gw.wait_for_unhealthy(&b, Duration::from_secs(10))
        .await
        .unwrap();
    // /clusters shows the main thread's view; the worker learns of the health change a moment
    // later. Every request meanwhile must still succeed; within a bounded time they reach a.
    let deadline = Instant::now() + Duration::from_secs(5);
    let r = loop {
        let pinned = gw.stat("kvroute_filter_pinned_total").await.unwrap();
        let r = gw
            .post("/v1/chat/completions", body.clone(), &[])
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if r.headers()[BACKEND_HEADER] == "engine-a" {
            break (r, pinned);
        }
        assert!(
            Instant::now() < deadline,
            "the unhealthy pinned engine b kept receiving requests"
        );
        let _ = r.bytes().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (r, pinned) = r;
    if r.headers().get(PIN_HEADER).is_some() {
        let log = gw.envoy.log();
        let wasm: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("wasm") || l.contains("panic"))
            .collect();
        panic!(
            "session header leaked to the client: {:?}\nEnvoy wasm log:\n{}",
            r.headers(),
            wasm.join("\n")
        );
    }
    assert_eq!(
        gw.stat("kvroute_filter_pinned_total").await.unwrap(),
        pinned + 1,
        "the service still chose b"
    );
    let last = a.received().last().cloned().unwrap();
    assert_eq!(
        header(&last, PIN_HEADER),
        Some(base64(b.addr.to_string().as_bytes()).as_str())
    );
    // The fallback is loud: the filter counts the pin Envoy did not follow.
    assert!(
        gw.stat("kvroute_filter_pin_overridden_total")
            .await
            .unwrap()
            >= 1
    );
    gw.envoy
        .log()
        .contains("Wasm VM failed")
        .then(|| panic!("VM failure:\n{}", gw.envoy.log()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_pins_ignores_spoofing_falls_back_and_counts_usage() {
    pins_to_the_chosen_endpoint(Variant::EnvoyFilter).await;
}

/// An Istio WasmPlugin cannot set allow_on_headers_stop_iteration: with Envoy's buffer filter
/// ahead of the Wasm filter the same behaviour holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasmplugin_variant_with_buffer_filter_pins_too() {
    pins_to_the_chosen_endpoint(Variant::WasmPlugin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_served_unpinned_byte_for_byte() {
    let body = chat_body(json!({}));
    let (inv, a, b, _) = fleet(&body).await;
    let engines = [&a, &b];
    let gw = gateway(&engines, inv.addr, json!({})).await;
    gw.wait_for_log("rule contract loaded", 2, READY)
        .await
        .unwrap();
    let mut huge = br#"{"model":"m","prompt":""#.to_vec();
    huge.extend(std::iter::repeat_n(b'x', 3 << 20));
    huge.extend(br#""}"#);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("/v1/chat/completions", b"{\"messages\": [".to_vec()),
        (
            "/v1/chat/completions",
            b"\xff\xfe\x00{\"messages\":[]}\x80".to_vec(),
        ),
        ("/v1/chat/completions", br#"{"model":"m"}"#.to_vec()),
        (
            "/v1/completions",
            br#"{"model":"m","prompt":{"x":1}}"#.to_vec(),
        ),
        ("/v1/completions", huge),
        ("/v1/unknown", body.clone()),
        ("/v2/chat/completions", body.clone()),
    ];
    for (path, payload) in cases {
        let r = gw.post(path, payload.clone(), &[]).await.unwrap();
        assert_eq!(r.status(), 200, "{path} ({} bytes)", payload.len());
        assert!(r.headers().get(PIN_HEADER).is_none());
        let name = r.headers()[BACKEND_HEADER].to_str().unwrap().to_owned();
        let echoed = r.bytes().await.unwrap();
        assert!(
            echoed.as_ref() == payload.as_slice(),
            "{path}: body changed"
        );
        let engine = if name == "engine-a" { &a } else { &b };
        let last = engine.received().last().cloned().unwrap();
        assert!(
            last.body.as_ref() == payload.as_slice(),
            "{path}: upstream body changed"
        );
        assert_eq!(header(&last, PIN_HEADER), None, "{path} was pinned");
    }
    assert_stats(
        &gw,
        &[
            ("kvroute_filter_fail_open_bad_request_total", 4),
            ("kvroute_filter_fail_open_body_too_large_total", 1),
        ],
    )
    .await;
}

/// The filter reports each pinned response's reuse to the inventory every `report_ms`: an engine
/// that reports no cached token for prompts the inventory says it holds turns divergent in
/// `/healthz` and `/metrics`; every response's tokens are accounted to its tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_reuses_nothing_of_its_predicted_prefix_shows_as_divergent() {
    let body = chat_body(json!({}));
    let (inv, a, b, blocks) = fleet(&body).await;
    let engines = [&a, &b];
    let gw = gateway(&engines, inv.addr, json!({"report_ms": 200})).await;
    gw.wait_until_routing(READY).await.unwrap();
    let prompt = (blocks * envoy::BLOCK + 5).to_string();
    // The default verdict needs 20 qualifying responses within the window; every 16th hit is a
    // cold seed on engine-a (predicted 0 blocks, so it does not qualify).
    let (mut on_b, mut sent) = (0, 0);
    for _ in 0..40 {
        sent += 1;
        let usage = format!("{prompt},0");
        let r = gw
            .post(
                "/v1/chat/completions",
                body.clone(),
                &[(USAGE_HEADER, &usage)],
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        on_b += usize::from(r.headers()[BACKEND_HEADER] == "engine-b");
        if on_b == 20 {
            break;
        }
    }
    assert_eq!(on_b, 20);
    let health = format!("http://{}/healthz", inv.addr);
    let diverged = Poll::new(
        "engine-b to be divergent in /healthz",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(100))
    .until(async || {
        let h: Value = reqwest::get(&health).await?.json().await?;
        let ep = h["rules"][0]["endpoints"][1].clone();
        Ok(match ep["divergence"].is_string() {
            true => Probe::Ready(ep),
            false => Probe::Pending(ep.to_string()),
        })
    })
    .await
    .unwrap();
    assert_eq!(diverged["outcomes"]["qualifying"], 20, "{diverged}");
    assert_eq!(diverged["outcomes"]["missed"], 20, "{diverged}");
    assert!(
        gw.stat("kvroute_filter_outcome_reports_total")
            .await
            .unwrap()
            >= 1
    );
    assert_eq!(
        gw.stat("kvroute_filter_outcome_report_failures_total")
            .await
            .unwrap(),
        0
    );
    let metrics = inv.metrics().await.unwrap();
    assert!(
        metrics.contains(r#"kvroute_endpoint_divergent{ep="1",rule="10.0.0.1:8080/tcp"} 1"#),
        "{metrics}"
    );
    // No `user` and no API key: the tenant is the client's address.
    let prompt: u64 = prompt.parse().unwrap();
    let tenant = Poll::new(
        "every response accounted to its tenant",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(100))
    .until(async || {
        let v = inv.tenants("10.0.0.1:8080").await?;
        let t = v["tenants"][0].clone();
        Ok(match t["requests"] == sent {
            true => Probe::Ready(t),
            false => Probe::Pending(v.to_string()),
        })
    })
    .await
    .unwrap();
    assert_eq!(tenant["tenant"], "ip:127.0.0.1", "{tenant}");
    assert_eq!(tenant["prompt_tokens"], prompt * sent, "{tenant}");
    assert_eq!(tenant["cached_tokens"], 0, "{tenant}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_faults_fail_open() {
    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let engines = [&a, &b];
    let body = chat_body(json!({}));
    // Slow (timeout), 500 and garbage from a stand-in that serves a valid contract first.
    for (fault, stat, timeout_ms) in [
        (Fault::Slow, "kvroute_filter_fail_open_timeout_total", 25),
        (Fault::Error, "kvroute_filter_fail_open_status_total", 250),
        (
            Fault::Garbage,
            "kvroute_filter_fail_open_bad_response_total",
            250,
        ),
    ] {
        let fake = FakeInventory::start(fault).await.unwrap();
        let plugin = json!({"timeout_ms": timeout_ms});
        let gw = gateway(&engines, fake.addr, plugin).await;
        gw.wait_for_log("rule contract loaded", 2, READY)
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        let r = gw
            .post("/v1/chat/completions", body.clone(), &[])
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{fault:?}");
        assert!(r.bytes().await.unwrap().as_ref() == body.as_slice());
        if fault == Fault::Slow {
            assert!(
                t0.elapsed() < Duration::from_millis(900),
                "the callout timeout did not bound the wait: {:?}",
                t0.elapsed()
            );
        }
        gw.envoy
            .wait_for_stat(&format!("wasmcustom.{stat}"), Duration::from_secs(5), |v| {
                v == 1
            })
            .await
            .unwrap();
        // Drop the stand-in: the inventory is now down (refused); still served.
        drop(fake);
        let r = gw
            .post("/v1/chat/completions", body.clone(), &[])
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{fault:?} then down");
        wait_stat_at_least(&gw, "kvroute_filter_fail_open_unavailable_total", 1).await;
    }
    // Down from the start: no contract can load; requests are served unpinned.
    let down = envoy::closed_port().unwrap();
    let gw = gateway(&engines, down, json!({})).await;
    let r = gw
        .post("/v1/chat/completions", body.clone(), &[])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        gw.stat("kvroute_filter_fail_open_no_contract_total")
            .await
            .unwrap()
            >= 1
    );
    assert!(a
        .received()
        .iter()
        .chain(b.received().iter())
        .all(|r| header(r, PIN_HEADER).is_none()));
}

/// `tokenize: service`: the filter sends the messages instead of keys, the real service tokenizes
/// them and the request still lands on the engine holding the prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_tokenization_pins_to_the_chosen_endpoint() {
    let body = chat_body(json!({}));
    let (inv, a, b, blocks) = fleet(&body).await;
    // The service loads its tokenizer on first use; do that outside the filter's timeout.
    let msgs: Value = serde_json::from_slice::<Value>(&body).unwrap()["messages"].clone();
    let warm = reqwest::Client::new()
        .post(format!("http://{}/v1/route", inv.addr))
        .json(&json!({"rule": "10.0.0.1:8080", "model": envoy::MODEL, "messages": msgs}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    let warm: Value = warm.json().await.unwrap();
    assert_eq!(
        warm["matched_blocks"], blocks as u64,
        "the service's own tokenization: {warm}"
    );
    let engines = [&a, &b];
    let plugin = json!({"tokenize": "service", "timeout_ms": 2000});
    let gw = gateway(&engines, inv.addr, plugin).await;
    gw.wait_for_log("rule contract loaded", 2, READY)
        .await
        .unwrap();
    let r = gw
        .post("/v1/chat/completions", body.clone(), &[])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    if r.headers()[BACKEND_HEADER] != "engine-b" {
        let got = a.received().last().map(|x| x.headers.clone());
        panic!(
            "went to a: {got:?}; stats {:?}",
            gw.envoy
                .stats("kvroute_filter")
                .await
                .unwrap()
                .into_iter()
                .filter(|(_, v)| *v > 0)
                .collect::<Vec<_>>()
        );
    }
    let last = b.received().last().cloned().unwrap();
    assert_eq!(
        header(&last, "x-kvroute-matched-blocks"),
        Some(blocks.to_string().as_str())
    );
    assert!(last.body.as_ref() == body.as_slice());
    // The filter never loaded a tokenizer.
    assert!(!gw.envoy.log().contains("tokenizer loaded"));
}

/// A conversation that names itself (`x-conversation-id`) goes back to the engine its first turn
/// went to, ahead of a longer prefix another engine holds; without the id, or under another id,
/// the prefix wins. The tier reaches the engine and the filter's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_conversation_returns_to_its_engine_ahead_of_a_longer_prefix() {
    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    // a holds the first turn's prompt, b a longer, different one.
    let first = chat_body(json!({"messages": [
        {"role": "system", "content": "You answer questions about the Rhine and nothing else."},
        {"role": "user", "content": "Where does the Rhine rise, which countries does it cross, and where does it reach the sea?"},
    ]}));
    let body = chat_body(json!({}));
    let (t_first, t_body) = (
        harness::prompt_tokens(&first).unwrap(),
        harness::prompt_tokens(&body).unwrap(),
    );
    let (n_first, n_body) = (t_first.len() / envoy::BLOCK, t_body.len() / envoy::BLOCK);
    assert!(n_first >= 2 && n_body > n_first, "{n_first} {n_body}");
    a.store_blocks(&t_first);
    b.store_blocks(&t_body);
    let inv = Inventory::start().await.unwrap();
    let rule = inv.add_rule(&[&a, &b]).await.unwrap();
    inv.wait_for_blocks(rule, 0, n_first).await.unwrap();
    inv.wait_for_blocks(rule, 1, n_body).await.unwrap();
    let gw = gateway(&[&a, &b], inv.addr, json!({})).await;
    gw.wait_until_routing(READY).await.unwrap();

    let send = async |body: &[u8], conv: Option<&str>| {
        let headers: Vec<(&str, &str)> =
            conv.map(|c| ("x-conversation-id", c)).into_iter().collect();
        let r = gw
            .post("/v1/chat/completions", body.to_vec(), &headers)
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let engine = r.headers()[BACKEND_HEADER].to_str().unwrap().to_owned();
        let got = match engine.as_str() {
            "engine-a" => a.received(),
            _ => b.received(),
        };
        let last = got.last().unwrap();
        assert!(
            last.body.as_ref() == body,
            "the engine received another body"
        );
        (engine, header(last, "x-kvroute-tier").map(str::to_owned))
    };
    // Turn 1 goes to a by its prefix, and binds the conversation there.
    assert_eq!(
        send(&first, Some("conv-1")).await,
        ("engine-a".into(), Some("tier15".into()))
    );
    // b holds the second prompt's longer prefix: without an id, or under a new one, the prefix
    // decides (asked first: the turn below credits a with that prompt speculatively).
    assert_eq!(
        send(&body, None).await,
        ("engine-b".into(), Some("tier15".into()))
    );
    assert_eq!(
        send(&body, Some("conv-2")).await,
        ("engine-b".into(), Some("tier15".into()))
    );
    // The conversation's second turn sends that prompt too: it still goes to a.
    assert_eq!(
        send(&body, Some("conv-1")).await,
        ("engine-a".into(), Some("session".into()))
    );
    assert_stats(&gw, &[("kvroute_filter_decisions_session_total", 1)]).await;
    let m = inv.metrics().await.unwrap();
    for (series, want) in [
        (r#"kvroute_session_bindings_total{outcome="new"}"#, 2),
        (r#"kvroute_session_bindings_total{outcome="kept"}"#, 1),
        (
            r#"kvroute_route_decisions_total{reason="session",tier="session"}"#,
            1,
        ),
    ] {
        let line = format!("{series} {want}");
        assert!(m.lines().any(|l| l == line), "want {line}:\n{m}");
    }
}

/// The service requires a credential on `/v1/route` (`--route-token-file`): a filter with the
/// same `route_token` pins; one with a wrong token, or none, is refused (401) and fails open,
/// counted as `status`, the request still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_token_pins_and_a_wrong_one_fails_open_counted() {
    let body = chat_body(json!({}));
    let (inv, a, b, _) = fleet_with_route_token(&body, Some("route-secret-1")).await;
    let engines = [&a, &b];
    for (token, pinned) in [
        (json!("route-secret-1"), true),
        (json!("route-secret-2"), false),
        (Value::Null, false),
    ] {
        let plugin = if token.is_null() {
            json!({})
        } else {
            json!({ "route_token": token })
        };
        let gw = gateway(&engines, inv.addr, plugin).await;
        gw.wait_until_routing(READY).await.unwrap();
        for _ in 0..3 {
            let r = gw
                .post("/v1/chat/completions", body.clone(), &[])
                .await
                .unwrap();
            assert_eq!(
                r.status(),
                200,
                "token {token}: the request is served either way"
            );
            if pinned {
                assert_eq!(r.headers()[BACKEND_HEADER], "engine-b", "token {token}");
            }
        }
        let refused = gw
            .stat("kvroute_filter_fail_open_status_total")
            .await
            .unwrap();
        let tier15 = gw
            .stat("kvroute_filter_decisions_tier15_total")
            .await
            .unwrap();
        if pinned {
            assert_eq!((refused, tier15), (0, 3), "token {token}");
        } else {
            assert_eq!((refused, tier15), (3, 0), "token {token}");
        }
    }
}

/// Asserts that each named filter stat reads exactly its value.
async fn assert_stats(gw: &Gateway, want: &[(&str, u64)]) {
    for (name, value) in want {
        assert_eq!(gw.stat(name).await.unwrap(), *value, "{name}");
    }
}

/// Waits (at most 5 s) until the filter stat `name` reaches at least `min`.
async fn wait_stat_at_least(gw: &Gateway, name: &str, min: u64) {
    let stat = format!("wasmcustom.{name}");
    gw.envoy
        .wait_for_stat(&stat, Duration::from_secs(5), |v| v >= min)
        .await
        .unwrap();
}
