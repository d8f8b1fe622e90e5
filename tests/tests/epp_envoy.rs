//! The endpoint picker behind real Envoy 1.40: Envoy's ext_proc HTTP filter pointed at the real
//! `kvroute-inventory serve --epp-listen` (fed through its real TensorRT-LLM drain ingestion),
//! and an `engines` cluster routing by the picked endpoint (`override_host`, as GIE gateways
//! program Envoy; see `envoy::epp_bootstrap` and docs/epp.md), in front of the engine stand-ins.
//!
//! What must hold: a request goes to the engine holding its prefix and a conversation's
//! follow-ups stay there; the body arrives byte for byte; a client-sent
//! `x-gateway-destination-endpoint` never reaches an engine; a killed engine falls back to the
//! listed fallback (and the proxy's served-endpoint report says so); a hung or killed picker
//! fails open within the ext_proc message timeout; with the response body streamed to it, the
//! picker reads the engines' usage into outcomes and tenant accounts; a buffered body past
//! Envoy's buffer limit is Envoy's own 413 until the listener's limit is raised.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use kvroute_test_support::{Poll, Probe};
use kvroute_tests::envoy::{
    self, epp_bootstrap, epp_gateway, Engine, EppBootstrap, Gateway, Inventory, DESTINATION,
};
use kvroute_tests::harness::{self, header, sample as metric, BACKEND_HEADER};
use serde_json::json;

fn chat(topic: &str, turns: usize) -> Vec<u8> {
    let mut m = vec![
        json!({"role": "system", "content": format!("You are a careful assistant for {topic}. Réponds en français si on te parle français. 你好 🚀")}),
    ];
    for t in 0..turns {
        m.push(json!({"role": "user", "content": format!("Question {t} on {topic}: explain, step by step, how a paged KV cache lets an engine reuse a prefix.")}));
        m.push(json!({"role": "assistant", "content": format!("Answer {t} on {topic}: blocks of sixteen tokens are hashed in a chain.")}));
    }
    m.push(json!({"role": "user", "content": format!("And why does routing the same prefix to the same engine matter for {topic}?")}));
    serde_json::to_vec(&json!({"model": envoy::MODEL, "messages": m, "max_tokens": 1})).unwrap()
}

/// [`chat`] with one turn, its last user message padded so the body is `size` bytes: it shares
/// the prefix of `chat(topic, 1)` up to that message.
fn long_chat(topic: &str, size: usize) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(&chat(topic, 1)).unwrap();
    let pad = size - serde_json::to_vec(&v).unwrap().len();
    // ASCII with nothing JSON escapes: each byte of padding is one byte of body.
    let padding = "Pages of sixteen tokens are hashed in a chain. "
        .chars()
        .cycle()
        .take(pad);
    let last = v["messages"].as_array_mut().unwrap().last_mut().unwrap();
    let content: String = last["content"]
        .as_str()
        .unwrap()
        .chars()
        .chain(padding)
        .collect();
    last["content"] = json!(content);
    let body = serde_json::to_vec(&v).unwrap();
    assert_eq!(body.len(), size);
    body
}

/// Engines a and b, b holding `body`'s blocks, the inventory with the picker, Envoy in front
/// with the request and response body modes `modes`.
async fn fleet(
    body: &[u8],
    message_timeout: Duration,
    modes: (&'static str, &'static str),
) -> (Inventory, Engine, Engine, Gateway) {
    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let tokens = harness::prompt_tokens(body).unwrap();
    let blocks = tokens.len() / envoy::BLOCK;
    assert!(blocks >= 3, "prompt too short: {} tokens", tokens.len());
    b.store_blocks(&tokens);
    // A loaded debug build must not turn a decision into a timeout (the fault test sets its own).
    let inv = Inventory::start_with_epp(&["--epp-timeout-ms", "8000"])
        .await
        .unwrap();
    let rule = inv.add_rule(&[&a, &b]).await.unwrap();
    inv.wait_for_blocks(rule, 1, blocks).await.unwrap();
    inv.wait_for_epp_ready().await.unwrap();
    let gw = epp_gateway(&[&a, &b], inv.epp.unwrap(), message_timeout, modes)
        .await
        .unwrap();
    (inv, a, b, gw)
}

async fn metrics(inv: &Inventory) -> String {
    reqwest::get(format!("http://{}/metrics", inv.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Posts `body` through Envoy (with a client-sent destination when `spoof`): 200 and the engine
/// that answered.
async fn send(gw: &Gateway, body: &[u8], spoof: Option<&str>) -> String {
    let headers: Vec<(&str, &str)> = spoof.map(|s| (DESTINATION, s)).into_iter().collect();
    let r = gw
        .post("/v1/chat/completions", body.to_vec(), &headers)
        .await
        .unwrap();
    let status = r.status();
    let engine = r
        .headers()
        .get(BACKEND_HEADER)
        .map(|v| v.to_str().unwrap().to_owned());
    let answer = r.bytes().await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(answer.as_ref(), body, "the engine echoed the body it got");
    engine.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_pins_sticks_falls_back_and_drops_client_destinations() {
    let body = chat("the held prefix", 2);
    let (inv, a, b, gw) = fleet(
        &body,
        Duration::from_secs(10),
        ("FULL_DUPLEX_STREAMED", "NONE"),
    )
    .await;
    let (a_addr, b_addr) = (a.addr.to_string(), b.addr.to_string());

    // The client names engine a itself: Envoy drops that, the picker's choice (b) wins, and
    // the header b gets is the picker's list (b, then a as the fallback), the body unchanged.
    let first = send(&gw, &body, Some(&a_addr)).await;
    if first != "engine-b" {
        let m: Vec<String> = metrics(&inv)
            .await
            .lines()
            .filter(|l| l.starts_with("kvroute_epp") || l.starts_with("kvroute_route_decisions"))
            .map(str::to_owned)
            .collect();
        panic!("served by {first}\n{m:#?}");
    }
    let got = b.received().last().cloned().unwrap();
    if header(&got, DESTINATION) != Some(format!("{b_addr},{a_addr}").as_str()) {
        let stats = gw.envoy.stats("ext_proc").await.unwrap();
        let log = gw.envoy.log();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let m: Vec<String> = metrics(&inv)
            .await
            .lines()
            .filter(|l| l.starts_with("kvroute_epp") || l.starts_with("kvroute_route_decisions"))
            .map(str::to_owned)
            .collect();
        panic!(
            "headers {:?}\nstats {stats:?}\nmetrics {m:#?}\nlog {}",
            got.headers,
            tail.join("\n")
        );
    }
    assert_eq!(got.body.as_ref(), body.as_slice(), "byte for byte");
    assert!(a.received().is_empty(), "nothing reached a");

    // New conversations: each follow-up goes where its first turn went (the credit the first
    // decision gave that engine), whichever engine that is.
    for topic in ["routers", "caches", "schedulers", "tokenizers"] {
        let first = send(&gw, &chat(topic, 0), None).await;
        for turns in 1..3 {
            assert_eq!(
                send(&gw, &chat(topic, turns), None).await,
                first,
                "{topic}: follow-up {turns} stays"
            );
        }
    }
    for e in [&a, &b] {
        for r in e.received() {
            let d = header(&r, DESTINATION).unwrap_or_default();
            assert!(
                d.starts_with(&format!("{}", e.addr)),
                "{} got a request pinned elsewhere: {d:?}",
                e.name
            );
        }
    }
    let m = metrics(&inv).await;
    assert_eq!(
        metric(&m, "kvroute_epp_served_total{outcome=\"other\"}"),
        0.0
    );
    assert!(
        metric(&m, "kvroute_epp_served_total{outcome=\"picked\"}") >= 13.0,
        "{m}"
    );

    // Engine b dies: the picker still picks it (it holds the prefix), Envoy cannot connect and
    // retries the listed fallback, a; the proxy reports that a served it.
    let b_port = b.addr;
    drop(b);
    assert_eq!(
        send(&gw, &body, Some(&b_port.to_string())).await,
        "engine-a"
    );
    let got = a.received().last().cloned().unwrap();
    assert_eq!(
        header(&got, DESTINATION),
        Some(format!("{b_addr},{a_addr}").as_str()),
        "a served as the picker's fallback"
    );
    assert_eq!(got.body.as_ref(), body.as_slice());
    let m = metrics(&inv).await;
    assert_eq!(
        metric(&m, "kvroute_epp_served_total{outcome=\"other\"}"),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "kvroute_epp_failures_total{reason=\"timeout\"}"),
        0.0
    );
}

/// Waits until every thread of `pid` is stopped (state `T` in /proc): `kill -STOP` returns once
/// the signal is sent, and on a loaded machine the process may still answer a request after it.
fn wait_stopped(pid: u32) {
    Poll::new(
        format!("every thread of process {pid} stopped"),
        Duration::from_secs(5),
    )
    .until_blocking(|| {
        let states: Vec<char> = std::fs::read_dir(format!("/proc/{pid}/task"))?
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
            .filter_map(|s| {
                s.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.chars().next())
            })
            .collect();
        Ok(if !states.is_empty() && states.iter().all(|&c| c == 'T') {
            Probe::Ready(())
        } else {
            Probe::Pending(format!("thread states {states:?}"))
        })
    })
    .unwrap();
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_or_killed_picker_fails_open_within_the_message_timeout() {
    let body = chat("fail open", 1);
    // Buffered: Envoy arms the message timeout per message there (in FULL_DUPLEX_STREAMED mode
    // it does not, so a hung picker holds requests: docs/epp.md).
    let (inv, a, b, gw) = fleet(&body, Duration::from_secs(1), ("BUFFERED", "NONE")).await;
    assert_eq!(send(&gw, &body, None).await, "engine-b");
    let before = a.received().len() + b.received().len();

    // Hung: the picker's process is stopped; Envoy gives up after its 1 s message timeout and
    // lets the request through unpinned (the client's destination was dropped before).
    signal(inv.pid(), "-STOP");
    wait_stopped(inv.pid());
    let spoof = a.addr.to_string();
    let hung = send(&gw, &body, Some(&spoof)).await;
    signal(inv.pid(), "-CONT");
    gw.envoy
        .wait_for_stat(
            "http.ingress.ext_proc.failure_mode_allowed",
            Duration::from_secs(5),
            |v| v >= 1,
        )
        .await
        .unwrap();

    // Killed: connections are refused, every request goes through unpinned at once.
    drop(inv);
    let mut served = vec![hung];
    for _ in 0..4 {
        served.push(send(&gw, &body, Some(&spoof)).await);
    }
    gw.envoy
        .wait_for_stat(
            "http.ingress.ext_proc.failure_mode_allowed",
            Duration::from_secs(5),
            |v| v >= 5,
        )
        .await
        .unwrap();
    let after: Vec<_> = a.received().into_iter().chain(b.received()).collect();
    assert_eq!(after.len(), before + 5);
    for r in &after {
        assert_ne!(
            header(r, DESTINATION),
            Some(spoof.as_str()),
            "a client-sent destination reached an engine"
        );
    }
    // Unpinned requests are balanced over both engines (round robin).
    assert!(served.iter().any(|e| e == "engine-a"), "{served:?}");
    assert!(served.iter().any(|e| e == "engine-b"), "{served:?}");
}

/// With `response_body_mode: STREAMED`, Envoy streams each response through the picker, which
/// reads its usage (JSON and SSE): the picked engine's outcomes and the tenant's tokens, while the
/// client gets every response unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_responses_report_the_engines_reuse_to_the_picker() {
    let mut body: serde_json::Value = serde_json::from_slice(&chat("usage", 1)).unwrap();
    body["user"] = json!("team-u");
    let body = serde_json::to_vec(&body).unwrap();
    let (inv, _a, _b, gw) = fleet(
        &body,
        Duration::from_secs(10),
        ("FULL_DUPLEX_STREAMED", "STREAMED"),
    )
    .await;
    let tokens = harness::prompt_tokens(&body).unwrap();
    let blocks = tokens.len() / envoy::BLOCK;
    // The fleet installs one rule: id 1.
    let rule = 1;
    let cached = blocks * envoy::BLOCK;
    let usage = format!("{},{cached}", tokens.len());
    let r = gw
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[(envoy::USAGE_HEADER, &usage)],
        )
        .await
        .unwrap();
    assert_eq!(r.headers()[BACKEND_HEADER], "engine-b");
    let answer: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        answer["usage"]["prompt_tokens"],
        tokens.len(),
        "unchanged: {answer}"
    );
    let r = gw
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[(envoy::SSE_HEADER, "1")],
        )
        .await
        .unwrap();
    assert_eq!(r.headers()[BACKEND_HEADER], "engine-b");
    let sse = r.text().await.unwrap();
    assert!(sse.ends_with("data: [DONE]\n\n"), "unchanged: {sse}");

    let m = metrics(&inv).await;
    assert_eq!(
        metric(&m, "kvroute_epp_usage_total{outcome=\"parsed\"}"),
        2.0,
        "{m}"
    );
    let h: serde_json::Value = reqwest::get(format!("http://{}/healthz", inv.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let o = &h["rules"][0]["endpoints"][1]["outcomes"];
    assert_eq!(o["judged"], 2, "{h}");
    assert_eq!(o["cached_tokens"], cached as u64 + 32, "{h}");
    let t = inv.tenants(&rule.to_string()).await.unwrap();
    let t = &t["tenants"][0];
    assert_eq!(t["tenant"], "user:team-u", "{t}");
    assert_eq!(t["requests"], 2, "{t}");
    assert_eq!(t["prompt_tokens"], tokens.len() as u64 + 40, "{t}");
    assert_eq!(t["cached_tokens"], cached as u64 + 32, "{t}");
}

/// In `BUFFERED` mode Envoy holds the whole body for the picker, but only up to its buffer limit:
/// for an HTTP/1.1 client, the listener's `per_connection_buffer_limit_bytes` (1 MiB by default).
/// Past it Envoy answers 413 itself (whatever `failure_mode_allow` says); with the limit raised,
/// the same body is picked for and arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_past_envoys_buffer_limit_is_a_413_until_the_listener_allows_it() {
    let long = long_chat("long prompts", 1536 * 1024);
    let (inv, a, b, gw) = fleet(
        &chat("long prompts", 1),
        Duration::from_secs(10),
        ("BUFFERED", "NONE"),
    )
    .await;

    // Envoy's default limit: a 413 from Envoy; the picker answered the headers (and the 413's
    // headers) but never got the body, so it decided and counted nothing; no engine was asked.
    let r = gw
        .post("/v1/chat/completions", long.clone(), &[])
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.text().await.unwrap(), "Payload Too Large");
    gw.envoy
        .wait_for_stat(
            "http.ingress.downstream_rq_too_large",
            Duration::from_secs(5),
            |v| v == 1,
        )
        .await
        .unwrap();
    assert!(a.received().is_empty() && b.received().is_empty());
    let m = metrics(&inv).await;
    let answered: f64 = ["picked", "fail_open", "fail_close", "subset_unavailable"]
        .iter()
        .map(|o| {
            metric(
                &m,
                &format!("kvroute_epp_requests_total{{outcome=\"{o}\"}}"),
            )
        })
        .sum();
    assert_eq!(answered, 0.0, "{m}");

    // The listener's limit raised to 8 MiB: the body is held whole, the picker pins it to b
    // (holding its prefix, a listed as the fallback), and b gets it byte for byte.
    let config = envoy::listener_buffer_limit(
        epp_bootstrap(&EppBootstrap {
            engines: &[&a, &b],
            epp: inv.epp.unwrap(),
            message_timeout: Duration::from_secs(10),
            body_mode: "BUFFERED",
            response_body_mode: "NONE",
        }),
        8 << 20,
    );
    let raised = Gateway::on(harness::Envoy::start(&config).await.unwrap()).unwrap();
    assert_eq!(send(&raised, &long, None).await, "engine-b");
    let got = b.received().last().cloned().unwrap();
    assert_eq!(
        header(&got, DESTINATION),
        Some(format!("{},{}", b.addr, a.addr).as_str())
    );
    assert_eq!(got.body.as_ref(), long.as_slice(), "byte for byte");
    assert!(a.received().is_empty());
    let m = metrics(&inv).await;
    assert_eq!(
        metric(&m, "kvroute_epp_requests_total{outcome=\"picked\"}"),
        1.0,
        "{m}"
    );
}
