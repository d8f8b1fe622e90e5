//! Two real vLLM engines (CPU, `scripts/vllm-engine.sh`: dummy-weight Qwen3 with the real
//! tokenizer, sha256_cbor, block 16) behind the shipped `envoy/envoy.yaml` with the filter, and
//! the inventory binding one ZMQ SUB per engine (`kvZmqBind`), which each engine's publisher
//! connects to.
//!
//! Asserts on the engines' own output: parity (the inventory's check of every BlockStored against
//! its own keys says `match`), the inventory filling with the engine's blocks, a conversation
//! sticking to the engine that holds it with the reuse the filter predicted (to the token), and a
//! killed engine's conversation answered by the other one; the parity canary reports both engines
//! healthy, with the reuse it predicted.
//!
//! A second test drives vLLM's own event publisher (`ZmqEventPublisher`, libzmq) through
//! `tests/tests/vllm_replay.py` until it drops batches, and checks that the inventory replays
//! every gap from vLLM's replay socket.
//!
//! Runs only with `KVROUTE_REAL_VLLM=1` (then `./scripts/test.sh` installs vLLM first, about
//! 3 GB once); otherwise it says so and passes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvroute_test_support::{Poll, Probe};
use kvroute_tests::harness::{self, ChildGuard, Envoy, TempDir};
use serde_json::{json, Value};

const MODEL: &str = "Qwen/Qwen3-0.6B";
/// Loopback addresses no other test or bench uses.
const ENGINE_IPS: [&str; 2] = ["127.0.0.44", "127.0.0.45"];
/// The port of the rule's VIP (the rule's name).
const RULE_PORT: u16 = 8000;

/// A real vLLM engine, in its own process group: its engine-core child is killed with it.
struct Engine {
    ip: &'static str,
    addr: SocketAddr,
    replay: u16,
    child: Option<ChildGuard>,
}

impl Engine {
    fn kill(&mut self) {
        if let Some(c) = self.child.take() {
            // The group id is the shell's pid (process_group(0)); it exec'd python.
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--", &format!("-{}", c.id())])
                .status();
            drop(c);
        }
    }

    fn log(&self) -> String {
        self.child.as_ref().map(ChildGuard::log).unwrap_or_default()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `KVROUTE_REAL_VLLM=1` asks for the tests against `what`; says it skips otherwise.
fn switched_on(what: &str) -> bool {
    let on = std::env::var("KVROUTE_REAL_VLLM").as_deref() == Ok("1");
    if !on {
        eprintln!("real_vllm: skipped (set KVROUTE_REAL_VLLM=1 to run it against {what})");
    }
    on
}

fn port_on(ip: &str) -> Result<u16> {
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

fn start_engine(i: usize, dir: &TempDir, events: u16) -> Result<Engine> {
    let ip = ENGINE_IPS[i];
    let addr: SocketAddr = format!("{ip}:{}", port_on(ip)?).parse()?;
    let replay = port_on(ip)?;
    let mut cmd = Command::new(harness::repo_root().join("scripts/vllm-engine.sh"));
    cmd.arg("--listen")
        .arg(addr.to_string())
        .args(["--events", &format!("tcp://127.0.0.1:{events}")])
        .args(["--replay", &format!("tcp://{ip}:{replay}")])
        .args(["--core", &(i % 2).to_string(), "--model", MODEL])
        .env("KVROUTE_CACHE", harness::cache_dir())
        .process_group(0);
    let log = dir.path().join(format!("vllm-{i}.log"));
    let child = ChildGuard::spawn(&format!("vLLM {ip}"), cmd, &log)?;
    Ok(Engine {
        ip,
        addr,
        replay,
        child: Some(child),
    })
}

/// Which engine logged `request_id` (vLLM logs `Received request chatcmpl-<X-Request-Id>`).
fn served_by(engines: &[Engine], request_id: &str) -> Option<usize> {
    let needle = format!("chatcmpl-{request_id}:");
    let found: Vec<usize> = (0..engines.len())
        .filter(|&i| engines[i].log().contains(&needle))
        .collect();
    match found[..] {
        [i] => Some(i),
        _ => None,
    }
}

struct Answer {
    engine: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    content: String,
}

async fn chat(
    client: &reqwest::Client,
    gw: u16,
    engines: &[Engine],
    messages: &[Value],
    request_id: &str,
) -> Result<Answer> {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
    let r = client
        .post(format!("http://127.0.0.1:{gw}/v1/chat/completions"))
        .header("x-request-id", request_id)
        .json(&body)
        .send()
        .await?;
    let status = r.status();
    let v: Value = r.json().await.with_context(|| format!("status {status}"))?;
    if status != 200 {
        bail!("status {status}: {v}");
    }
    let engine = served_by(engines, request_id)
        .with_context(|| format!("no single engine logged request {request_id}"))?;
    Ok(Answer {
        engine,
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        content: v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    })
}

async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value> {
    let r = client.get(url).send().await?;
    if !r.status().is_success() {
        bail!("GET {url}: {}", r.status());
    }
    Ok(r.json().await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engines_keep_parity_fill_the_inventory_stick_and_fall_back() {
    if !switched_on("real vLLM engines") {
        return;
    }
    let dir = TempDir::new("real-vllm").unwrap();
    let events: Vec<u16> = (0..2).map(|_| harness::free_port().unwrap()).collect();
    let mut engines: Vec<Engine> = (0..2)
        .map(|i| start_engine(i, &dir, events[i]).unwrap())
        .collect();

    // The rule: the inventory binds each engine's event address; replay at the engine.
    // The rule's VIP (its name); Envoy's listener port is whatever it binds.
    let rule = format!("127.0.0.1:{RULE_PORT}");
    let eps: Vec<Value> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            json!({"endpointIP": e.ip, "targetPort": e.addr.port(), "weight": 1,
                   "kvZmqEndpoint": format!("tcp://127.0.0.1:{}", events[i]),
                   "kvReplayEndpoint": format!("tcp://{}:{}", e.ip, e.replay)})
        })
        .collect();
    let rules = json!([{"serviceArguments": {"externalIP": "127.0.0.1", "port": RULE_PORT,
        "protocol": "tcp", "sel": 0, "mode": 4, "kvExactMode": 3, "kvEngineType": "vllm",
        "kvHashAlgo": "sha256_cbor", "kvBlockSize": 16, "kvZmqBind": true, "kvModel": MODEL,
        // vLLM 0.28 writes a block's extra keys flat (cache salt, LoRA name).
        "kvVllmExtraKeys": "flat"},
        "endpoints": eps}]);
    std::fs::write(dir.path().join("rules.json"), rules.to_string()).unwrap();
    harness::stage_tokenizer(dir.path(), "Qwen__Qwen3-0.6B").unwrap();
    let inv_port = harness::free_port().unwrap();
    let inv = format!("http://127.0.0.1:{inv_port}");
    let mut cmd = Command::new(harness::repo_root().join("target/debug/kvroute-inventory"));
    cmd.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{inv_port}"),
        "--config",
    ])
    .arg(dir.path().join("rules.json"))
    .arg("--tokenizer-dir")
    .arg(dir.path())
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("KVROUTE_HEALTH_INTERVAL_MS", "200")
    // One parity canary run per engine, as soon as it is subscribed.
    .env("KVROUTE_CANARY_INTERVAL_MS", "3600000")
    .env("KVROUTE_CANARY_TIMEOUT_MS", "60000");
    let mut inv_child =
        ChildGuard::spawn("kvroute-inventory", cmd, &dir.path().join("inventory.log")).unwrap();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();

    // vLLM on two shared cores starts in 30 s to a few minutes.
    Poll::new("both vLLM engines to serve", Duration::from_secs(420))
        .every(Duration::from_millis(500))
        .until(async || {
            let mut up = 0;
            for e in engines.iter_mut() {
                e.child.as_mut().unwrap().ensure_running()?;
                let ok = client
                    .get(format!("http://{}/health", e.addr))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                up += usize::from(ok);
            }
            Ok(match up {
                2 => Probe::Ready(()),
                n => Probe::Pending(format!("{n} of 2 up")),
            })
        })
        .await
        .unwrap();
    Poll::new(
        "both engines' publishers to attach to the inventory",
        Duration::from_secs(60),
    )
    .every(Duration::from_millis(200))
    .until(async || {
        inv_child.ensure_running()?;
        let hz = get_json(&client, &format!("{inv}/healthz")).await?;
        let eps = &hz["rules"][0]["endpoints"];
        Ok(match (0..2).all(|i| eps[i]["connected"] == json!([true])) {
            true => Probe::Ready(()),
            false => Probe::Pending(eps.to_string()),
        })
    })
    .await
    .unwrap();

    // The parity canary on the real engines: its tokenizer, chat template, keys, salt (flat, as
    // vLLM 0.28 writes it) and reuse all agree with the rule's contract.
    let verdicts = Poll::new("a canary verdict on both engines", Duration::from_secs(180))
        .every(Duration::from_millis(200))
        .until(async || {
            inv_child.ensure_running()?;
            let hz = get_json(&client, &format!("{inv}/healthz")).await?;
            let eps = hz["rules"][0]["endpoints"].clone();
            Ok(match (0..2).all(|i| !eps[i]["canary"].is_null()) {
                true => Probe::Ready(eps),
                false => Probe::Pending(eps.to_string()),
            })
        })
        .await
        .unwrap();
    for i in 0..2 {
        let c = &verdicts[i]["canary"];
        assert_eq!(c["verdict"], "healthy", "engine {i}: {c:#}");
        let repeat = &c["probes"][2];
        assert_eq!(repeat["probe"], "chat_repeat", "{c:#}");
        assert!(repeat["predicted_tokens"].as_u64().unwrap() > 0, "{c:#}");
        assert_eq!(repeat["cached_tokens"], repeat["predicted_tokens"], "{c:#}");
    }

    let cfg_path = dir.path().join("envoy.yaml");
    let root = harness::repo_root();
    let status = Command::new("python3")
        .arg(root.join("scripts/local_envoy.py"))
        .arg(root.join("envoy/envoy.yaml"))
        .arg(&cfg_path)
        .arg("--wasm")
        .arg(harness::wasm_module().unwrap())
        // The shipped 25 ms callout budget is for a dedicated gateway; here two engines, Envoy
        // and the inventory share two cores.
        .args(["--rule", &rule, "--timeout-ms", "500"])
        .args(["--listen", "0", "--admin", "0"])
        .args(["--inventory", &inv_port.to_string(), "--sims"])
        .arg(format!("{},{}", engines[0].addr, engines[1].addr))
        .status()
        .unwrap();
    assert!(status.success(), "scripts/local_envoy.py failed");
    let mut cfg: Value =
        serde_yaml::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let cluster = cfg["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "engines")
        .unwrap();
    cluster["health_checks"][0]["interval"] = json!("0.2s");
    cluster["health_checks"][0]["no_traffic_interval"] = json!("0.2s");
    let envoy = Envoy::start(&cfg).await.unwrap();
    let gw_port = envoy.listener("kvroute_ingress").unwrap().port();
    // Until the worker VM has its tokenizer, requests pass unpinned.
    let mut warm = 0;
    Poll::new("the filter to load its tokenizer", Duration::from_secs(120))
        .every(Duration::from_millis(200))
        .until(async || {
            if envoy.log().contains("tokenizer loaded") {
                return Ok(Probe::Ready(()));
            }
            warm += 1;
            let hi = [json!({"role": "user", "content": "warm-up"})];
            chat(&client, gw_port, &engines, &hi, &format!("rv-warm-{warm}")).await?;
            Ok(Probe::Pending(format!("{warm} warm-up requests")))
        })
        .await
        .unwrap();

    // Turn 1 lands somewhere; its blocks reach the inventory and pass the parity check.
    let system = "You are the operations assistant of a large inference fleet. ".repeat(40);
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "First question: what is prefill?"}),
    ];
    let first = chat(&client, gw_port, &engines, &messages, "rv-turn-1")
        .await
        .unwrap();
    let home = first.engine;
    let full_blocks = (first.prompt_tokens - 1) / 16;
    Poll::new(
        "the inventory to hold turn 1's blocks and check parity",
        Duration::from_secs(30),
    )
    .every(Duration::from_millis(100))
    .until(async || {
        let url = format!(
            "{inv}/netlox/v1/config/ai/kv/inventory?service_id={rule}&ep_idx={home}&limit=1"
        );
        let total = get_json(&client, &url).await?["total"]
            .as_u64()
            .unwrap_or(0);
        let hz = get_json(&client, &format!("{inv}/healthz")).await?;
        let ep = &hz["rules"][0]["endpoints"][home];
        Ok(
            match total >= full_blocks && ep["parity_status"] == "match" {
                true => Probe::Ready(()),
                false => Probe::Pending(format!("{total} of {full_blocks} blocks, {ep}")),
            },
        )
    })
    .await
    .unwrap();
    let hz = get_json(&client, &format!("{inv}/healthz")).await.unwrap();
    for ep in hz["rules"][0]["endpoints"].as_array().unwrap() {
        assert_eq!(ep["parity_mismatches"], 0, "{ep}");
    }

    // Turns 2..4 go to the engine holding the conversation and reuse all of it but the last
    // partial block; the filter's prediction matches what the engine reported, to the token.
    messages.push(json!({"role": "assistant", "content": first.content}));
    let exact = async || -> Result<u64> {
        let stats = envoy.stats("kvroute_filter_prediction").await?;
        Ok(stats
            .iter()
            .filter(|(k, _)| k.ends_with("prediction_exact_total"))
            .map(|(_, v)| v)
            .sum())
    };
    let exact_before = exact().await.unwrap();
    let mut previous = first.prompt_tokens;
    for turn in 2..=4 {
        messages.push(json!({"role": "user", "content": format!("Question {turn}: and decode?")}));
        let a = chat(
            &client,
            gw_port,
            &engines,
            &messages,
            &format!("rv-turn-{turn}"),
        )
        .await
        .unwrap();
        assert_eq!(
            a.engine, home,
            "turn {turn} left the engine holding its prefix"
        );
        assert!(
            a.cached_tokens >= (previous - 1) / 16 * 16,
            "turn {turn}: {} cached tokens, the previous turn filled {} blocks",
            a.cached_tokens,
            (previous - 1) / 16
        );
        previous = a.prompt_tokens;
        messages.push(json!({"role": "assistant", "content": a.content}));
    }
    let exact_after = exact().await.unwrap();
    assert!(
        exact_after - exact_before >= 3,
        "3 exact predictions expected: {:?}",
        envoy.stats("kvroute_filter_prediction").await.unwrap()
    );

    // Kill the home engine: once Envoy's health check notices, the conversation is answered by
    // the other engine.
    let dead = engines[home].addr.to_string();
    engines[home].kill();
    envoy
        .wait_for_failed_health_check(&dead, Duration::from_secs(30))
        .await
        .unwrap();
    messages.push(json!({"role": "user", "content": "Last question: summarise."}));
    let a = chat(&client, gw_port, &engines, &messages, "rv-after-kill")
        .await
        .unwrap();
    assert_eq!(a.engine, 1 - home, "answered by the engine still alive");
}

/// A loopback address no other test or bench uses: the replay socket of the publisher below.
const REPLAY_IP: &str = "127.0.0.46";

/// vLLM's own event publisher (`ZmqEventPublisher`: a libzmq PUB and its replay ROUTER, driven by
/// `tests/tests/vllm_replay.py`) drops batches while the inventory is stopped; every gap is
/// replayed through the inventory's DEALER from vLLM's replay socket, and the inventory ends with
/// every block, none cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_publishers_dropped_batches_are_replayed() {
    if !switched_on("vLLM's publisher") {
        return;
    }
    const BATCHES: u64 = 400;
    let dir = TempDir::new("vllm-replay").unwrap();
    let events = harness::free_port().unwrap();
    let replay = format!("tcp://{REPLAY_IP}:{}", port_on(REPLAY_IP).unwrap());
    let (inv_child, inv) = harness::start_inventory(dir.path(), "replay-token", &[])
        .await
        .unwrap();
    let rule = json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": RULE_PORT,
        "protocol": "tcp", "sel": 0, "mode": 4, "kvExactMode": 3, "kvEngineType": "vllm",
        "kvBlockSize": 16},
        "endpoints": [{"endpointIP": REPLAY_IP, "targetPort": 9, "weight": 1,
            "kvZmqEndpoint": format!("tcp://127.0.0.1:{events}"), "kvReplayEndpoint": replay}]});
    harness::add_rule(inv, "replay-token", &rule).await.unwrap();
    let mut cmd = Command::new(harness::cache_dir().join("vllm-venv/bin/python"));
    cmd.arg(harness::repo_root().join("tests/tests/vllm_replay.py"))
        .arg(events.to_string())
        .arg(&replay)
        .arg(format!("http://{inv}/metrics"))
        .arg(inv_child.id().to_string())
        .arg(BATCHES.to_string());
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let log = || format!("{stdout}\n{stderr}\n{}", inv_child.log_tail(30));
    assert!(out.status.success(), "{}", log());
    let m = reqwest::get(format!("http://{inv}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let gaps = harness::sample(&m, r#"kvroute_ingest_seq_gaps_total{engine="vllm"}"#);
    let replayed = harness::sample(
        &m,
        r#"kvroute_ingest_replays_total{engine="vllm",outcome="ok"}"#,
    );
    assert!(
        gaps >= 1.0,
        "libzmq dropped nothing: no gap to replay\n{}",
        log()
    );
    assert_eq!(replayed, gaps, "every gap replayed\n{m}\n{}", log());
    assert!(!m.contains("kvroute_ingest_clears_total{"), "{m}");
    assert_eq!(
        harness::sample(
            &m,
            &format!(r#"kvroute_index_blocks{{ep="0",rule="127.0.0.1:{RULE_PORT}/tcp"}}"#)
        ),
        (1 + BATCHES * 64) as f64,
        "every block of every batch\n{}",
        log()
    );
    eprintln!("real_vllm: {gaps} gaps in vLLM's stream, each replayed");
}
