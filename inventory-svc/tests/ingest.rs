//! End-to-end ingestion: the built binary subscribed to real ZMQ publishers (and a TensorRT-LLM
//! drain server) run by the test, fed with the engines' golden payloads and generated ones.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use kvroute_test_support::{Poll, Probe};
use serde_json::{json, Value};
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const RULE: &str = "10.0.0.1:8080";

/// A vLLM rule on `RULE` with one endpoint (127.0.0.1:9) whose engine publishes on `zmq_port`;
/// `extra` is merged into its serviceArguments.
fn vllm_rule(zmq_port: u16, extra: Value) -> Value {
    rule(8080, "vllm", zmq_port, &[("127.0.0.1".into(), 9)], extra)
}

/// Publishes a store of the one block `key` through `p` until endpoint `ep` of `RULE` holds it.
async fn store_until_seen(svc: &Service, p: &mut Publisher, ep: usize, key: u64) {
    publish_until_seen(
        svc,
        p,
        RULE,
        ep,
        key,
        &batch(vec![stored(&[key], &[], false)]),
    )
    .await;
}

/// Returns once the service is subscribed to `p`: a probe block (0xABCD) shows in endpoint 0's
/// inventory.
async fn subscribed(svc: &Service, p: &mut Publisher) {
    store_until_seen(svc, p, 0, 0xABCD).await;
}

/// A publisher and the service `tag` with one vLLM rule over it (`extra` merged into the rule,
/// `env` set for the service), once the service is subscribed.
async fn subscribed_vllm(tag: &str, extra: Value, env: &[(&str, &str)]) -> (Publisher, Service) {
    let mut p = Publisher::bind(0).await.unwrap();
    let r = vllm_rule(p.port, extra);
    let svc = Service::start(tag, &json!([r]), env);
    subscribed(&svc, &mut p).await;
    (p, svc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_golden_and_generated_payloads_feed_the_index() {
    let (mut p, svc) = subscribed_vllm("vllm", json!({"kvHashAlgo": "sha256_cbor"}), &[]).await;
    // Before any event: a check that never ran is not reported as passed.
    let ep = &svc.get_json("/healthz").await["rules"][0]["endpoints"][0];
    assert_eq!(
        (&ep["parity_status"], &ep["parity_checks"]),
        (&json!("unchecked"), &json!(0)),
        "{ep}"
    );

    let (keys, tokens) = vllm_range64();
    p.send(&batch(vec![stored(&keys, &tokens, false)])).await;
    svc.wait_for("range64 keys", 10, || async {
        svc.inventory(RULE, 0).await.len() == 5
    })
    .await;
    let ep = &svc.get_json("/healthz").await["rules"][0]["endpoints"][0];
    assert_eq!(
        (&ep["parity_status"], &ep["parity_checks"], &ep["parity"]),
        (&json!("match"), &json!(1), &Value::Null),
        "{ep}"
    );
    assert_metrics(
        &svc.metrics().await,
        r#"kvroute_ingest_parity_checks_total{engine="vllm",result="match"} 1"#,
    );

    let req = json!({"rule": RULE, "keys": keys, "token_count": 64});
    let (s, body) = svc.post("/v1/route", &req.to_string(), None).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        body,
        json!({"rule_id": 1, "endpoint": "127.0.0.1:9", "matched_blocks": 4, "tier": "tier15", "reason": "hit", "decode_endpoint": null})
    );

    // The real payloads: map layout with int keys, with raw-bytes keys, and the pre-0.24 array layout.
    let v = vectors("vllm-0.33.0.json");
    for payload in [
        hx(&v["events"]["int_keys_default"]["batch_payload_hex"]),
        hx(&v["events"]["bytes_keys"]["batch_payload_hex"]),
        hx(&v["legacy_events_0_23"]["batch_payload_hex"]),
    ] {
        p.send(&payload).await;
    }
    svc.wait_metric(
        r#"kvroute_ingest_events_total{engine="vllm",type="all_blocks_cleared"}"#,
        3.0,
    )
    .await;
    assert!(svc.inventory(RULE, 0).await.is_empty());
    let m = svc.metrics().await;
    assert_metrics(
        &m,
        r#"
        kvroute_ingest_events_total{engine="vllm",type="block_removed"} 3
        kvroute_ingest_clears_total{cause="event",engine="vllm"} 3
        kvroute_route_decisions_total{reason="hit",tier="tier15"} 1
        kvroute_ingest_subscriber_connected{ep="0",rank="0",rule="10.0.0.1:8080/tcp"} 1
        kvroute_index_blocks{ep="0",rule="10.0.0.1:8080/tcp"} 0
        "#,
    );
    assert_absent(&m, "kvroute_ingest_parity_mismatches_total");
    assert_absent(&m, "kvroute_ingest_seq_gaps_total");
    let hz = svc.get_json("/healthz").await;
    assert_eq!(hz["status"], "ok", "{hz}");
}

/// Blocks an engine publishes on its host-memory and storage tiers continue the endpoint's GPU
/// match (the answer counts every block the engine reuses), show in their own gauges, and a
/// lower-tier removal cuts the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lower_tier_blocks_extend_the_match() {
    // No speculative credit: the second answer must come from the index alone.
    let (mut p, svc) = subscribed_vllm("lower", json!({}), &[("KVROUTE_SPEC_TTL_MS", "0")]).await;
    p.send(&batch(vec![
        stored(&[1, 2], &[], false),
        stored_on(&[1, 2, 3, 4], "CPU"),
        stored_on(&[5], "STORAGE"),
        stored_on(&[6], "EXTERNAL_THING"),
    ]))
    .await;
    let route = async || {
        let req = json!({"rule": RULE, "keys": [1, 2, 3, 4, 5, 6, 7], "token_count": 112});
        let (s, body) = svc.post("/v1/route", &req.to_string(), None).await;
        assert_eq!(s, 200, "{body}");
        body["matched_blocks"].as_u64().unwrap()
    };
    let lower = |medium: &str| {
        format!(
            r#"kvroute_index_lower_blocks{{ep="0",medium="{medium}",rule="10.0.0.1:8080/tcp"}}"#
        )
    };
    svc.wait_metric(&lower("storage"), 1.0).await;
    // 2 GPU blocks, then 3 and 4 in host memory, then 5 in storage; 6 is on a medium not indexed.
    let explain = json!({"rule": RULE, "keys": [1, 2, 3, 4, 5, 6, 7], "token_count": 112,
                         "explain": true});
    let (_, e) = svc.post("/v1/route", &explain.to_string(), None).await;
    let ep = &e["explain"]["endpoints"][0];
    assert_eq!(
        (&ep["matched_blocks"], &ep["lower_blocks"]),
        (&json!(2), &json!([2, 1])),
        "{e}"
    );
    assert_eq!(route().await, 5);
    assert_metrics(
        &svc.metrics().await,
        r#"
        kvroute_index_blocks{ep="0",rule="10.0.0.1:8080/tcp"} 3
        kvroute_index_lower_blocks{ep="0",medium="cpu",rule="10.0.0.1:8080/tcp"} 4
        kvroute_route_lower_tier_blocks_total{medium="cpu"} 2
        kvroute_route_lower_tier_blocks_total{medium="storage"} 1
        kvroute_ingest_non_gpu_blocks_total{engine="vllm",medium="other"} 1
        "#,
    );
    p.send(&batch(vec![removed_on(&[3], "CPU")])).await;
    svc.wait_metric(&lower("cpu"), 3.0).await;
    assert_eq!(route().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parity_self_check_names_the_wrong_seed() {
    let (mut p, svc) = subscribed_vllm(
        "parity",
        json!({"kvHashAlgo": "sha256_cbor"}),
        &[("LLB_KV_NONE_HASH_SEED", "1234")],
    )
    .await;
    let (keys, tokens) = vllm_range64();
    p.send(&batch(vec![stored(&keys, &tokens, false)])).await;
    svc.wait_metric(
        r#"kvroute_ingest_parity_mismatches_total{engine="vllm"}"#,
        1.0,
    )
    .await;
    let hz = svc.get_json("/healthz").await;
    assert_eq!(hz["status"], "degraded");
    let ep = &hz["rules"][0]["endpoints"][0];
    assert_eq!(
        (
            &ep["parity_status"],
            &ep["parity_checks"],
            &ep["parity_mismatches"]
        ),
        (&json!("mismatch"), &json!(1), &json!(1)),
        "{ep}"
    );
    let parity = &ep["parity"];
    assert_eq!(parity["suggested_seed"], "0", "{hz}");
    assert!(
        parity["message"]
            .as_str()
            .unwrap()
            .contains(r#"the seed should be "0""#),
        "{hz}"
    );
    assert!(svc.stderr().contains("parity self-check failed"));
}

/// Two engines on one host with their own event ports (`kvZmqEndpoint` per endpoint): each
/// publisher's blocks land on its own endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_endpoint_event_addresses_on_one_host() {
    let mut a = Publisher::bind(0).await.unwrap();
    let mut b = Publisher::bind(0).await.unwrap();
    let eps = [("127.0.0.1".into(), 9), ("127.0.0.1".into(), 10)];
    let mut r = rule(8080, "vllm", 5557, &eps, json!({}));
    r["endpoints"][0]["kvZmqEndpoint"] = json!(format!("tcp://127.0.0.1:{}", a.port));
    r["endpoints"][1]["kvZmqEndpoint"] = json!(format!("tcp://127.0.0.1:{}", b.port));
    let svc = Service::start("zmq-per-ep", &json!([r]), &[]);
    two_engines_feed_their_own_endpoints(&svc, &mut a, &mut b).await;
}

/// A vLLM rule in the engine-connects topology (`kvZmqBind`): one endpoint per port, each
/// binding `tcp://127.0.0.1:PORT` for its engine's publisher.
fn bound_rule(ports: &[u16]) -> Value {
    let eps: Vec<(String, u16)> = (0..ports.len())
        .map(|i| ("127.0.0.1".into(), 9 + i as u16))
        .collect();
    let mut r = rule(8080, "vllm", 5557, &eps, json!({"kvZmqBind": true}));
    for (i, port) in ports.iter().enumerate() {
        r["endpoints"][i]["kvZmqEndpoint"] = json!(format!("tcp://127.0.0.1:{port}"));
    }
    r
}

/// The engine-connects topology (`kvZmqBind`): the inventory binds one SUB per endpoint and each
/// engine's publisher connects to its own, as vLLM does when its endpoint names a host (llm-d's
/// deployments). `connected` turns true once an engine attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_subscribers_take_engines_that_connect() {
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let r = bound_rule(&[pa, pb]);
    let svc = Service::start("zmq-bind", &json!([r]), &[]);
    let connected = |hz: &Value, ep: usize| hz["rules"][0]["endpoints"][ep]["connected"].clone();
    let hz = svc.get_json("/healthz").await;
    assert_eq!(
        connected(&hz, 0),
        json!([false]),
        "no engine attached yet: {hz}"
    );
    let mut a = Publisher::connect(&format!("tcp://127.0.0.1:{pa}")).await;
    let mut b = Publisher::connect(&format!("tcp://127.0.0.1:{pb}")).await;
    two_engines_feed_their_own_endpoints(&svc, &mut a, &mut b).await;
    let hz = svc.get_json("/healthz").await;
    assert_eq!(
        (connected(&hz, 0), connected(&hz, 1)),
        (json!([true]), json!([true])),
        "{hz}"
    );
}

/// A bound subscriber outlives an idle engine: silence marks it not connected, and the next
/// batch from the same publisher is applied on the same bound address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_subscribers_keep_taking_events_after_an_idle_period() {
    let port = free_port().unwrap();
    let r = bound_rule(&[port]);
    let svc = Service::start(
        "zmq-bind-idle",
        &json!([r]),
        &[("KVROUTE_ZMQ_IDLE_RECONNECT_MS", "300")],
    );
    let mut p = Publisher::connect(&format!("tcp://127.0.0.1:{port}")).await;
    store_until_seen(&svc, &mut p, 0, 0xC1).await;
    let connected =
        async || svc.get_json("/healthz").await["rules"][0]["endpoints"][0]["connected"].clone();
    Poll::new(
        "the idle period to mark the endpoint not connected",
        Duration::from_secs(10),
    )
    .every(Duration::from_millis(50))
    .until(async || Ok(Probe::from(connected().await == json!([false]))))
    .await
    .unwrap();
    store_until_seen(&svc, &mut p, 0, 0xC2).await;
    assert_eq!(connected().await, json!([true]));
    assert!(
        !svc.stderr().contains("Address already in use"),
        "{}",
        svc.stderr()
    );
}

async fn two_engines_feed_their_own_endpoints(svc: &Service, a: &mut Publisher, b: &mut Publisher) {
    store_until_seen(svc, a, 0, 0xA1).await;
    store_until_seen(svc, b, 1, 0xB1).await;
    assert!(!svc.inventory(RULE, 0).await.contains(&0xB1));
    assert!(!svc.inventory(RULE, 1).await.contains(&0xA1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_is_replayed_through_a_dealer() {
    let mut p = Publisher::bind(0).await.unwrap();
    let mut router = RouterSocket::new();
    let rport = match router.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        _ => panic!(),
    };
    let r = vllm_rule(p.port, json!({"kvReplayPort": rport}));
    let svc = Service::start("replay", &json!([r]), &[]);
    subscribed(&svc, &mut p).await;

    let missing_seq = p.seq;
    let missing = batch(vec![stored(&[0x77], &[], false)]);
    let requests = Arc::new(Mutex::new(Vec::<u64>::new()));
    let seen = requests.clone();
    let served = missing.clone();
    let replayer = tokio::spawn(async move {
        let msg = router.recv().await.unwrap();
        let frames = msg.into_vec();
        // [identity, b"", start_seq]
        let start = u64::from_be_bytes(frames.last().unwrap().as_ref().try_into().unwrap());
        seen.lock().unwrap().push(start);
        let id = frames[0].clone();
        let reply = |parts: Vec<Bytes>| ZmqMessage::try_from(parts).unwrap();
        router
            .send(reply(vec![
                id.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&missing_seq.to_be_bytes()),
                Bytes::from(served),
            ]))
            .await
            .unwrap();
        router
            .send(reply(vec![
                id,
                Bytes::new(),
                Bytes::new(),
                Bytes::from(vec![0xff; 8]),
                Bytes::new(),
            ]))
            .await
            .unwrap();
        router
    });
    p.send_seq(missing_seq + 1, &batch(vec![stored(&[0x88], &[], false)]))
        .await;
    svc.wait_for("replayed and current batches", 10, || async {
        let inv = svc.inventory(RULE, 0).await;
        inv.contains(&0x77) && inv.contains(&0x88)
    })
    .await;
    let _router = replayer.await.unwrap();
    assert_eq!(*requests.lock().unwrap(), vec![missing_seq]);
    let m = svc.metrics().await;
    assert_metrics(
        &m,
        r#"
        kvroute_ingest_seq_gaps_total{engine="vllm"} 1
        kvroute_ingest_replays_total{engine="vllm",outcome="ok"} 1
        "#,
    );
    assert_absent(&m, "kvroute_ingest_clears_total");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_clears_and_restart_clears() {
    let (mut p, svc) = subscribed_vllm("gap", json!({}), &[]).await;

    // Gap: one batch lost, no replay endpoint -> the endpoint's inventory is cleared and rebuilt.
    p.seq += 1;
    p.send(&batch(vec![stored(&[0x99], &[], false)])).await;
    svc.wait_inventory("clear after gap", (RULE, 0), &[0x99])
        .await;
    svc.assert_metrics(
        r#"
        kvroute_ingest_seq_gaps_total{engine="vllm"} 1
        kvroute_ingest_clears_total{cause="gap",engine="vllm"} 1
        "#,
    )
    .await;

    // Restart: the sequence is back at 0 -> clear, then ingest.
    p.send_seq(0, &batch(vec![stored(&[0x55], &[], false)]))
        .await;
    svc.wait_inventory("clear after restart", (RULE, 0), &[0x55])
        .await;
    svc.assert_metrics(
        r#"
        kvroute_ingest_clears_total{cause="restart",engine="vllm"} 1
        kvroute_index_blocks{ep="0",rule="10.0.0.1:8080/tcp"} 1
        "#,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_sequence_does_not_stall_the_endpoint() {
    let (mut p, svc) = subscribed_vllm("seqjump", json!({}), &[]).await;

    // One frame with an out-of-range sequence (a gap: cleared), then the publisher goes on in order.
    p.send_seq(1 << 62, &batch(vec![stored(&[0x11], &[], false)]))
        .await;
    svc.wait_inventory("the jump is applied", (RULE, 0), &[0x11])
        .await;
    for k in 0..5u64 {
        p.send(&batch(vec![stored(&[0x100 + k], &[], false)])).await;
    }
    // Within REWIND_RUN frames the tracker follows the publisher again: cleared, then applied.
    svc.wait_for("in-order frames applied after the jump", 10, || async {
        let inv = svc.inventory(RULE, 0).await;
        inv.contains(&0x103) && inv.contains(&0x104) && !inv.contains(&0x11)
    })
    .await;
    let m = svc.metrics().await;
    assert_metric(
        &m,
        r#"kvroute_ingest_clears_total{cause="rewind",engine="vllm"}"#,
        1.0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_events_are_counted_and_the_key_cap_holds() {
    let (mut p, svc) = subscribed_vllm(
        "malformed",
        json!({"kvHashAlgo": "sha256_cbor"}),
        &[("KVROUTE_MAX_KEYS_PER_ENDPOINT", "20")],
    )
    .await;
    // A token id >= 2^32 rejects its event (malformed, not a parity mismatch); the rest applies.
    let mut bad = stored(&[0x77], &[], false);
    if let rmpv::Value::Map(m) = &mut bad {
        for (k, v) in m.iter_mut() {
            if k.as_str() == Some("token_ids") {
                *v = rmpv::Value::Array(vec![rmpv::Value::from(1u64 << 32); 16]);
            }
        }
    }
    p.send(&batch(vec![bad, stored(&[0x78], &[], false)])).await;
    svc.wait_for("the good event", 10, || async {
        svc.inventory(RULE, 0).await.contains(&0x78)
    })
    .await;
    assert!(!svc.inventory(RULE, 0).await.contains(&0x77));
    counted_once_in_parity(
        &svc,
        r#"kvroute_ingest_malformed_events_total{engine="vllm",reason="bad_token_ids"}"#,
    )
    .await;
    // The per-endpoint key cap: stores past it are refused and counted.
    for i in 0..10u64 {
        let keys: Vec<u64> = (0..5).map(|j| 0x1000 + i * 5 + j).collect();
        p.send(&batch(vec![stored(&keys, &[], false)])).await;
    }
    svc.wait_for("refusals at the cap", 10, || async {
        metric(
            &svc.metrics().await,
            r#"kvroute_index_key_cap_refusals_total{engine="vllm"}"#,
        )
        .is_some_and(|v| v > 0.0)
    })
    .await;
    let n = svc.inventory(RULE, 0).await.len();
    assert!((20..=25).contains(&n), "{n} blocks held with a cap of 20");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_three_ranks_union_into_one_endpoint() {
    let mut pubs = bind_consecutive(3).await;
    let r = rule(
        8080,
        "sglang",
        pubs[0].port,
        &[("127.0.0.1".into(), 9)],
        json!({"kvDpRankCount": 3}),
    );
    let svc = Service::start("sglang", &json!([r]), &[]);
    for (i, p) in pubs.iter_mut().enumerate() {
        let probe = 0x1000 + i as u64;
        publish_until_seen(
            &svc,
            p,
            RULE,
            0,
            probe,
            &batch(vec![stored(&[probe], &[], true)]),
        )
        .await;
    }
    let v = vectors("sglang-0.5.23.json");
    let keys: Vec<u64> = v["function_level"]["range64"]["block_hashes_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_u64().unwrap())
        .collect();
    // Ranks 0 and 1 hold the same blocks (sent signed, as SGLang does); rank 0 evicts them.
    pubs[0].send(&batch(vec![stored(&keys, &[], true)])).await;
    pubs[1].send(&batch(vec![stored(&keys, &[], true)])).await;
    svc.wait_for("7 blocks", 10, || async {
        svc.inventory(RULE, 0).await.len() == 7
    })
    .await;
    pubs[0].send(&batch(vec![removed(&keys)])).await;
    pubs[0].send(&batch(vec![removed(&[0x1000])])).await;
    svc.wait_for("rank 0 eviction", 10, || async {
        svc.inventory(RULE, 0).await.len() == 6
    })
    .await;
    let inv = svc.inventory(RULE, 0).await;
    assert!(
        keys.iter().all(|k| inv.contains(k)),
        "rank 1 still holds them"
    );

    // SGLang's real batches on rank 2: the startup AllBlocksCleared clears rank 2 only; the
    // unsalted first-block stores pass the parity self-check with sha256_sglang.
    for b in v["event_batches"].as_array().unwrap() {
        pubs[2].send(&hx(&b["payload_hex"])).await;
    }
    svc.wait_metric(
        r#"kvroute_ingest_events_total{engine="sglang",type="block_removed"}"#,
        3.0,
    )
    .await;
    let m = counted_once_in_parity(
        &svc,
        r#"kvroute_ingest_clears_total{cause="event",engine="sglang"}"#,
    )
    .await;
    for rank in 0..3 {
        assert_eq!(
            metric(
                &m,
                &format!(
                    r#"kvroute_ingest_subscriber_connected{{ep="0",rank="{rank}",rule="10.0.0.1:8080/tcp"}}"#
                )
            ),
            Some(1.0)
        );
    }
    let inv = svc.inventory(RULE, 0).await;
    assert!(inv.contains(&0x1001) && !inv.contains(&0x1002), "{inv:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_drain_is_rehashed_from_tokens() {
    use axum::routing::post;
    let queue: Arc<Mutex<Vec<Value>>> = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (q, c) = (queue.clone(), calls.clone());
    let app = axum::Router::new().route(
        "/kv_cache_events",
        post(move || {
            let (q, c) = (q.clone(), c.clone());
            async move {
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                axum::Json(Value::Array(std::mem::take(&mut *q.lock().unwrap())))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let toks = |r: std::ops::Range<u32>| {
        r.map(|t| json!({"token_id": t, "token_extra_id": 0}))
            .collect::<Vec<_>>()
    };
    queue.lock().unwrap().extend([
        json!({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}, "window_size": 16}),
        json!({"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [
            {"block_hash": 501, "tokens": toks(0..4), "cache_level": 0, "priority": 35},
            {"block_hash": 502, "tokens": toks(4..8), "cache_level": 0, "priority": 35},
            {"block_hash": 503, "tokens": toks(8..10), "cache_level": 0, "priority": 35}]}, "window_size": 16}),
    ]);
    let r = rule(
        8080,
        "trtllm",
        5557,
        &[("127.0.0.1".into(), port)],
        json!({"kvBlockSize": 4}),
    );
    let svc = Service::start("trtllm", &json!([r]), &[("KVROUTE_TRTLLM_DRAIN_MS", "20")]);
    let k0 = kvroute_core::hash::trtllm::block_key(0, &[0, 1, 2, 3], None, None);
    let k1 = kvroute_core::hash::trtllm::block_key(k0, &[4, 5, 6, 7], None, None);
    let mut want = vec![k0, k1];
    want.sort_unstable();
    svc.wait_for("re-hashed blocks", 10, || async {
        svc.inventory(RULE, 0).await == want
    })
    .await;
    queue.lock().unwrap().push(json!({"event_id": 2, "data": {"type": "removed", "block_hashes": [502]}, "window_size": 16}));
    svc.wait_inventory("removal mapped", (RULE, 0), &[k0]).await;
    svc.assert_metrics(
        r#"
        kvroute_ingest_events_total{engine="trtllm",type="block_stored"} 1
        kvroute_ingest_unkeyed_blocks_total{engine="trtllm"} 1
        kvroute_ingest_subscriber_connected{ep="0",rank="0",rule="10.0.0.1:8080/tcp"} 1
        "#,
    )
    .await;
    assert!(calls.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_key_mode_rehashes_event_tokens() {
    // The engine's own keys are opaque here (as with vLLM's default pickle hash): the index holds
    // kvroute's content keys of the events' token ids, and removals map engine keys to them.
    let mut p = Publisher::bind(0).await.unwrap();
    let r = vllm_rule(p.port, json!({"kvKeyMode": "tokens"}));
    let svc = Service::start("tokens", &json!([r]), &[("LLB_KV_NONE_HASH_SEED", UNSET)]);
    let bs = kvroute_core::hash::BlockSize::new(16).unwrap();
    let probe_tokens: Vec<u32> = (1000..1016).collect();
    let probe = kvroute_core::hash::content_keys(&probe_tokens, bs, None)[0].0;
    publish_until_seen(
        &svc,
        &mut p,
        RULE,
        0,
        probe,
        &batch(vec![stored(&[0xDEAD], &probe_tokens, false)]),
    )
    .await;
    let tokens: Vec<u32> = (0..48).collect();
    let content: Vec<u64> = kvroute_core::hash::content_keys(&tokens, bs, None)
        .iter()
        .map(|k| k.0)
        .collect();
    p.send(&batch(vec![
        stored(&[11, 12, 13], &tokens, false),
        removed(&[13]),
    ]))
    .await;
    svc.wait_for("content keys", 10, || async {
        svc.inventory(RULE, 0).await.len() == 3
    })
    .await;
    let inv = svc.inventory(RULE, 0).await;
    assert!(
        inv.contains(&content[0]) && inv.contains(&content[1]) && !inv.contains(&content[2]),
        "{inv:?}"
    );
    let c = svc.get_json("/v1/rules/1/contract").await;
    assert_eq!(
        (c["algo"].as_str(), c["key_mode"].as_str()),
        (Some("tokens"), Some("tokens"))
    );
    let (_, d) = svc
        .post(
            "/v1/route",
            &json!({"rule": "1", "keys": content, "token_count": 48}).to_string(),
            None,
        )
        .await;
    assert_eq!(
        (d["reason"].as_str(), d["matched_blocks"].as_u64()),
        (Some("hit"), Some(2)),
        "{d}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_reconnects_and_clears() {
    let mut p = Publisher::bind(0).await.unwrap();
    let port = p.port;
    let r = vllm_rule(port, json!({}));
    // The reconnect on silence is off: the closed connection itself must end the session.
    let svc = Service::start(
        "restart",
        &json!([r]),
        &[("KVROUTE_ZMQ_IDLE_RECONNECT_MS", "0")],
    );
    subscribed(&svc, &mut p).await;
    // Advance the old sequence well past what the restarted engine will reach before the
    // subscriber is back, so its first message is recognisably "lower than before".
    for _ in 0..100 {
        p.send(&batch(vec![stored(&[0xABCD], &[], false)])).await;
    }
    svc.wait_for("old sequence applied", 10, || async {
        metric(
            &svc.metrics().await,
            r#"kvroute_ingest_events_total{engine="vllm",type="block_stored"}"#,
        )
        .unwrap_or(0.0)
            >= 100.0
    })
    .await;
    // The engine goes away and comes back on the same port with its sequence restarted at 0.
    drop(p);
    svc.wait_metric(
        r#"kvroute_ingest_subscriber_connected{ep="0",rank="0",rule="10.0.0.1:8080/tcp"}"#,
        0.0,
    )
    .await;
    let mut p2 = None;
    for _ in 0..100 {
        if let Some(np) = Publisher::bind(port).await {
            p2 = Some(np);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut p2 = p2.expect("rebind the publisher port");
    store_until_seen(&svc, &mut p2, 0, 0xBEEF).await;
    assert!(
        !svc.inventory(RULE, 0).await.contains(&0xABCD),
        "the restarted engine's old blocks are gone"
    );
    let m = svc.metrics().await;
    assert_metric(
        &m,
        r#"kvroute_ingest_clears_total{cause="restart",engine="vllm"}"#,
        1.0,
    );
}

/// The metrics after an ingest step, asserting that `series` reads 1 and that no parity mismatch
/// was counted (the keys the service computed agree with the engine's); returned for more checks
/// on the same snapshot.
async fn counted_once_in_parity(svc: &Service, series: &str) -> String {
    let m = svc.metrics().await;
    assert_metric(&m, series, 1.0);
    assert_absent(&m, "kvroute_ingest_parity_mismatches_total");
    m
}

/// A BlockStored of `keys` (no token ids) in KV-cache group `group` of kind `kind`, as a hybrid
/// model's vLLM publishes it.
fn grouped_store(keys: &[u64], group: u64, kind: &str) -> rmpv::Value {
    let mut m = match stored(keys, &[], false) {
        rmpv::Value::Map(m) => m,
        other => panic!("{other:?}"),
    };
    m.push((rmpv::Value::from("group_idx"), rmpv::Value::from(group)));
    m.push((
        rmpv::Value::from("kv_cache_spec_kind"),
        rmpv::Value::from(kind),
    ));
    rmpv::Value::Map(m)
}

/// A BlockRemoved of `keys` in group `group` (removals name no kind).
fn grouped_remove(keys: &[u64], group: u64) -> rmpv::Value {
    let mut m = match removed(keys) {
        rmpv::Value::Map(m) => m,
        other => panic!("{other:?}"),
    };
    m.push((rmpv::Value::from("group_idx"), rmpv::Value::from(group)));
    rmpv::Value::Map(m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_group_neither_fakes_nor_erases_a_prefix() {
    let (mut p, svc) = subscribed_vllm("hybrid", json!({}), &[]).await;
    let prefix = [11u64, 12, 13, 14];
    // Full attention holds the prefix; the sliding-window group stores it too, then its window
    // moves past the first three blocks; a Mamba group stores a block of its own.
    p.send(&batch(vec![
        grouped_store(&prefix, 0, "full_attention"),
        grouped_store(&prefix, 1, "sliding_window"),
        grouped_store(&[99], 2, "mamba"),
    ]))
    .await;
    p.send(&batch(vec![grouped_remove(&prefix[..3], 1)])).await;
    svc.wait_metric(
        r#"kvroute_ingest_partial_attention_blocks_total{engine="vllm",event="block_removed",kind="sliding_window"}"#,
        3.0,
    )
    .await;
    let mut held = svc.inventory(RULE, 0).await;
    held.sort_unstable();
    assert_eq!(held, [11, 12, 13, 14, 0xABCD]);
    let req = json!({"rule": RULE, "keys": prefix, "token_count": 64});
    let (_, body) = svc.post("/v1/route", &req.to_string(), None).await;
    assert_eq!(
        (&body["reason"], &body["matched_blocks"]),
        (&json!("hit"), &json!(4)),
        "{body}"
    );
    // The full-attention group's own eviction does apply.
    p.send(&batch(vec![grouped_remove(&prefix[2..], 0)])).await;
    svc.wait_for("the full-attention eviction", 10, || async {
        svc.inventory(RULE, 0).await.len() == 3
    })
    .await;
    assert_metrics(
        &svc.metrics().await,
        r#"
        kvroute_ingest_partial_attention_blocks_total{engine="vllm",event="block_stored",kind="sliding_window"} 4
        kvroute_ingest_partial_attention_blocks_total{engine="vllm",event="block_stored",kind="mamba"} 1
        "#,
    );
}

/// A raw ZMTP 3.0 peer of socket type `ty` on `listener`: accepts the service's connection,
/// exchanges greetings and `READY`, and returns the connection with the socket type the service's
/// `READY` announced.
async fn raw_zmtp_accept(
    listener: &tokio::net::TcpListener,
    ty: &str,
) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut s, _) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
        .await
        .expect("the service connects")
        .unwrap();
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[11] = 1;
    greeting[12..16].copy_from_slice(b"NULL");
    s.write_all(&greeting).await.unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).await.unwrap();
    assert_eq!(
        (theirs[0], theirs[9], theirs[10]),
        (0xff, 0x7f, 3),
        "{theirs:?}"
    );
    let mut ready = vec![0x04, 22 + ty.len() as u8, 5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(ty.len() as u32).to_be_bytes());
    ready.extend_from_slice(ty.as_bytes());
    s.write_all(&ready).await.unwrap();
    // Their READY: a short command whose only property is the socket type.
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(head[0], 0x04, "a command");
    let mut body = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut body).await.unwrap();
    assert_eq!(&body[..18], b"\x05READY\x0bSocket-Type");
    (s, String::from_utf8_lossy(&body[22..]).into_owned())
}

/// A raw ZMTP 3.0 publisher on `listener`: accepts the service's connection, exchanges greetings
/// and `READY` (as a PUB) and reads its subscription.
async fn raw_pub_accept(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
    use tokio::io::AsyncReadExt;
    let (mut s, theirs) = raw_zmtp_accept(listener, "PUB").await;
    assert_eq!(theirs, "SUB");
    let mut sub = [0u8; 3];
    s.read_exact(&mut sub).await.unwrap();
    assert_eq!(sub, [0x00, 0x01, 0x01], "subscribed to everything");
    s
}

/// The service `tag` with one vLLM rule whose publisher is a raw ZMTP peer: the peer's
/// listener (for a later connection) and the service's first connection to it.
async fn raw_publisher(tag: &str) -> (Service, tokio::net::TcpListener, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let svc = Service::start(tag, &json!([vllm_rule(port, json!({}))]), &[]);
    let s = raw_pub_accept(&listener).await;
    (svc, listener, s)
}

/// One message of three short frames on the wire: an empty topic, `seq`, and a batch of `event`.
fn raw_message(seq: u64, event: rmpv::Value) -> Vec<u8> {
    let payload = batch(vec![event]);
    assert!(payload.len() < 256, "a short frame");
    let mut m = vec![0x01, 0, 0x01, 8];
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(&[0x00, payload.len() as u8]);
    m.extend_from_slice(&payload);
    m
}

/// A replay socket that breaks the protocol costs the replay, never the service: a ROUTER whose
/// reply announces a 1 TiB frame, then a peer that is not a ROUTER, each fail the replay (logged
/// with the fault), the gap is cleared, and the batch after it is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_replay_socket_fails_the_replay_and_the_gap_is_cleared() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut p = Publisher::bind(0).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rport = listener.local_addr().unwrap().port();
    let r = vllm_rule(p.port, json!({"kvReplayPort": rport}));
    let svc = Service::start("replay-hostile", &json!([r]), &[]);
    subscribed(&svc, &mut p).await;

    let missing = p.seq;
    let router = tokio::spawn(async move {
        let (mut s, theirs) = raw_zmtp_accept(&listener, "ROUTER").await;
        assert_eq!(theirs, "DEALER");
        // The request: [b"", start_seq].
        let mut req = [0u8; 12];
        s.read_exact(&mut req).await.unwrap();
        assert_eq!(&req[..4], &[0x01, 0, 0x00, 8], "{req:?}");
        let mut huge = vec![0x02];
        huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
        s.write_all(&huge).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut [0u8; 16]))
            .await
            .expect("the service closes the connection")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without reading on");
        let start = u64::from_be_bytes(req[4..].try_into().unwrap());
        (listener, start)
    });
    p.seq += 1;
    p.send(&batch(vec![stored(&[0xE1], &[], false)])).await;
    svc.wait_inventory(
        "the gap cleared, the next batch applied",
        (RULE, 0),
        &[0xE1],
    )
    .await;
    let (listener, start) = router.await.unwrap();
    assert_eq!(
        start, missing,
        "the replay asks from the first missing batch"
    );

    let impostor = tokio::spawn(async move {
        let (s, theirs) = raw_zmtp_accept(&listener, "PUB").await;
        assert_eq!(theirs, "DEALER");
        s
    });
    p.seq += 1;
    p.send(&batch(vec![stored(&[0xE2], &[], false)])).await;
    svc.wait_inventory("the second gap cleared", (RULE, 0), &[0xE2])
        .await;
    drop(impostor.await.unwrap());
    svc.assert_metrics(
        r#"
        kvroute_ingest_seq_gaps_total{engine="vllm"} 2
        kvroute_ingest_replays_total{engine="vllm",outcome="failed"} 2
        kvroute_ingest_clears_total{cause="gap",engine="vllm"} 2
        "#,
    )
    .await;
    let log = svc.stderr();
    for fault in [
        "a message of 1099511627776 bytes is over the 67108864-byte limit",
        "the peer is a PUB socket; a ROUTER is expected",
    ] {
        assert!(log.contains(fault), "{fault}\n{log}");
    }
}

/// A publisher that announces a frame past the message limit (1 TiB) is cut off on the frame's
/// header, with the fault in the log; the service keeps running and the next connection's events
/// are applied. Exercises the handshake against a hand-written ZMTP peer, not the crate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_drops_the_connection_and_the_next_one_is_applied() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (svc, listener, mut s) = raw_publisher("zmtp-oversize").await;
    let mut huge = vec![0x02];
    huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
    s.write_all(&huge).await.unwrap();
    let mut rest = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut rest))
        .await
        .expect("the service closes the connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without reading on");
    // The next connection: one message of three frames, sequence 0, one stored block.
    let mut s = raw_pub_accept(&listener).await;
    s.write_all(&raw_message(0, stored(&[0xF00D], &[], false)))
        .await
        .unwrap();
    svc.wait_for("the block of the second connection", 20, || async {
        svc.inventory(RULE, 0).await.contains(&0xF00D)
    })
    .await;
    let log = svc.stderr();
    assert!(
        log.contains("a message of 1099511627776 bytes is over the 67108864-byte limit"),
        "{log}"
    );
}

/// Messages read together are applied together, in order: a burst written in one piece (more
/// messages than one apply gathers) whose middle restarts the sequence keeps every message after
/// the restart and nothing from before it, and a removal gathered with its store undoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_read_at_once_is_applied_in_order_across_a_restart() {
    use tokio::io::AsyncWriteExt;
    let (svc, _listener, mut s) = raw_publisher("zmtp-burst").await;
    let mut burst = raw_message(10, stored(&[0xA1, 0xA2], &[], false));
    burst.extend(raw_message(11, removed(&[0xA1])));
    // Sequence 0 after 11: the engine restarted, so what it held before is gone.
    burst.extend(raw_message(0, stored(&[0xB1], &[], false)));
    let later: Vec<u64> = (1..=200).map(|i| 0x1000 + i).collect();
    for (i, k) in later.iter().enumerate() {
        burst.extend(raw_message(i as u64 + 1, stored(&[*k], &[], false)));
    }
    s.write_all(&burst).await.unwrap();
    let mut want = vec![0xB1];
    want.extend(&later);
    svc.wait_inventory("every block after the restart", (RULE, 0), &want)
        .await;
    let held = svc.inventory(RULE, 0).await;
    assert!(
        !held.contains(&0xA2),
        "the restart cleared what came before it: {held:x?}"
    );
    assert!(!held.contains(&0xA1), "{held:x?}");
    svc.assert_metrics(
        r#"
        kvroute_ingest_clears_total{cause="restart",engine="vllm"} 1
        "#,
    )
    .await;
}

/// Bound, a new publisher connection replaces the current one, as a restarted engine's does
/// before its old connection is seen to close: the new connection's events are applied and its
/// sequence, back at 0, clears the old engine's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_subscriber_takes_the_newest_publisher_connection() {
    let port = free_port().unwrap();
    let r = bound_rule(&[port]);
    let svc = Service::start("zmq-bind-replace", &json!([r]), &[]);
    let addr = format!("tcp://127.0.0.1:{port}");
    let mut old = Publisher::connect(&addr).await;
    // Past sequence 0, so the new engine's first message reads as a restart.
    for _ in 0..3 {
        old.send(&batch(vec![stored(&[0xD1], &[], false)])).await;
    }
    store_until_seen(&svc, &mut old, 0, 0xD1).await;
    let mut new = Publisher::connect(&addr).await;
    // Taken before it publishes, so its first batch delivered is one of its first few, below the
    // old engine's last sequence.
    svc.wait_for("the new connection taken", 20, || async {
        svc.stderr().matches("publisher connected").count() == 2
    })
    .await;
    store_until_seen(&svc, &mut new, 0, 0xD2).await;
    assert!(
        !svc.inventory(RULE, 0).await.contains(&0xD1),
        "the old engine's block is cleared by the restart"
    );
    let log = svc.stderr();
    assert_eq!(log.matches("publisher connected").count(), 2, "{log}");
    drop(old);
}
