//! The parity canary against engine simulators each configured with one mismatch: a wrong
//! tokenizer, a wrong chat template, a wrong block size, a wrong seed, a LoRA adapter, an engine
//! that ignores `cache_salt` and one that writes it in vLLM's pre-0.31 flat layout are each named
//! in `/healthz`, `/metrics` and `kvroutectl health`, and the correctly configured engines (the
//! flat one with `kvVllmExtraKeys: flat`) report healthy with the reuse they predicted. The same
//! for TensorRT-LLM simulators drained over `POST /kv_cache_events`: healthy when configured
//! correctly (the salted probe skipped, with the reason), and a wrong tokenizer, chat template
//! and block size each named.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kvroute_test_support::{free_port, Poll, Probe};
use kvroute_tests::harness::{self, ChildGuard, TempDir};
use serde_json::{json, Value};

const MODEL: &str = "Qwen/Qwen3-0.6B";
const LORA: &str = "canary-lora";
const TOKEN: &str = "canary-token";

/// One engine and the leg the canary must name for it.
struct Case {
    leg: &'static str,
    sim_args: Vec<String>,
    /// Where the simulator's tokenizer comes from (the true one when `None`).
    tokenizer: Option<&'static str>,
    model: &'static str,
    /// The rule's `kvVllmExtraKeys` (absent: tagged).
    extra_keys: Option<&'static str>,
    /// `vllm` (events over ZMQ) or `trtllm` (the `/kv_cache_events` drain).
    engine: &'static str,
}

fn case(leg: &'static str, sim_args: &[&str]) -> Case {
    Case {
        leg,
        sim_args: sim_args.iter().map(|s| s.to_string()).collect(),
        tokenizer: None,
        model: MODEL,
        extra_keys: None,
        engine: "vllm",
    }
}

fn trtllm(leg: &'static str, sim_args: &[&str]) -> Case {
    Case {
        engine: "trtllm",
        ..case(leg, sim_args)
    }
}

fn cases() -> Vec<Case> {
    let seeded = ["--seed", "0"];
    let lora = format!("{LORA}=/adapters/{LORA}");
    vec![
        case("healthy", &seeded),
        Case {
            tokenizer: Some("swapped-vocab"),
            ..case("tokenizer", &seeded)
        },
        Case {
            tokenizer: Some("other-template"),
            ..case("chat_template", &seeded)
        },
        case("block_size", &["--seed", "0", "--block-size", "32"]),
        // No --seed: vLLM's default NONE_HASH seed, while the service's is "0".
        case("seed", &[]),
        Case {
            model: LORA,
            ..case("lora", &["--seed", "0", "--lora-adapter", &lora])
        },
        case("cache_salt", &["--seed", "0", "--ignore-cache-salt"]),
        // vLLM before 0.31 writes the salt flat: named, and healthy once the rule says so.
        case("cache_salt", &["--seed", "0", "--extra-keys", "flat"]),
        Case {
            extra_keys: Some("flat"),
            ..case("healthy", &["--seed", "0", "--extra-keys", "flat"])
        },
        trtllm("healthy", &[]),
        Case {
            tokenizer: Some("swapped-vocab"),
            ..trtllm("tokenizer", &[])
        },
        Case {
            tokenizer: Some("other-template"),
            ..trtllm("chat_template", &[])
        },
        trtllm("block_size", &["--block-size", "32"]),
    ]
}

/// The Qwen3 tokenizer with the ids of two words the canary's text holds swapped: the same
/// pieces, other ids (another vocabulary).
fn swapped_vocab(dir: &Path) {
    let src = harness::tokenizer_dir().unwrap();
    let mut t: Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer.json")).unwrap()).unwrap();
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["Ġengine"].clone(), vocab["Ġrouter"].clone());
    vocab.insert("Ġengine".into(), b);
    vocab.insert("Ġrouter".into(), a);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&t).unwrap()).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
}

/// The Qwen3 tokenizer with a chat template that writes a newline after the system message.
fn other_template(dir: &Path) {
    let src = harness::tokenizer_dir().unwrap();
    let mut c: Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer_config.json")).unwrap()).unwrap();
    let tpl = c["chat_template"].as_str().unwrap();
    let from = "messages[0].content + '<|im_end|>\\n'";
    assert!(tpl.contains(from), "the Qwen3 template changed");
    c["chat_template"] = json!(tpl.replacen(from, "messages[0].content + '\\n<|im_end|>\\n'", 1));
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&c).unwrap(),
    )
    .unwrap();
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
}

struct Sim {
    http: SocketAddr,
    /// The ZMQ event port (vLLM); TensorRT-LLM is drained over HTTP.
    zmq: Option<u16>,
}

/// Starts the simulator of `case`; returns its event port (vLLM) and its process.
fn spawn_sim(i: usize, case: &Case, dir: &TempDir) -> (Option<u16>, ChildGuard) {
    let tokenizer = match case.tokenizer {
        None => harness::tokenizer_dir().unwrap(),
        Some(name) => dir.path().join(name),
    };
    let name = format!("{i}-{}-{}", case.engine, case.leg);
    let mut cmd = Command::new(harness::built_bin("kvroute-engine-sim").unwrap());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--engine",
        case.engine,
        "--kv-blocks",
        "400",
    ]);
    let zmq = (case.engine == "vllm").then(|| free_port().unwrap());
    if let Some(port) = zmq {
        cmd.args(["--zmq-port", &port.to_string()]);
    }
    cmd.args(["--model", case.model, "--name", &name])
        .arg("--tokenizer-dir")
        .arg(tokenizer)
        .args(&case.sim_args);
    let log = dir.path().join(format!("sim-{name}.log"));
    (zmq, ChildGuard::spawn(&name, cmd, &log).unwrap())
}

fn failing(metrics: &str, rule: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("kvroute_endpoint_canary_failing{")
                && l.contains(&format!("rule=\"{rule}\""))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn each_mismatch_is_named_and_the_right_configuration_is_healthy() {
    let dir = TempDir::new("canary").unwrap();
    swapped_vocab(&dir.path().join("swapped-vocab"));
    other_template(&dir.path().join("other-template"));
    let cases = cases();
    // Started together: each loads the tokenizer on its own.
    let mut children: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| spawn_sim(i, c, &dir))
        .collect();
    let mut sims = Vec::new();
    for (zmq, child) in &mut children {
        let http = harness::printed_addr(child, "listening on ").await.unwrap();
        sims.push(Sim { http, zmq: *zmq });
    }
    harness::stage_tokenizer(dir.path(), "Qwen__Qwen3-0.6B").unwrap();
    harness::stage_tokenizer(dir.path(), LORA).unwrap();
    let env = [
        ("KVROUTE_CANARY_INTERVAL_MS", "600000"),
        ("KVROUTE_CANARY_TIMEOUT_MS", "5000"),
        ("LLB_KV_NONE_HASH_SEED", "0"),
        ("KVROUTE_TRTLLM_DRAIN_MS", "20"),
    ];
    let (inv, addr) = harness::start_inventory(dir.path(), TOKEN, &env)
        .await
        .unwrap();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut names = Vec::new();
    for (i, (c, s)) in cases.iter().zip(&sims).enumerate() {
        let mut args = json!({"externalIP": "127.0.0.1", "port": 21001 + i, "protocol": "tcp",
            "sel": 0, "mode": 4, "kvExactMode": 3, "kvEngineType": c.engine, "kvBlockSize": 16,
            "kvModel": c.model});
        if let Some(zmq) = s.zmq {
            args["kvZmqPort"] = json!(zmq);
            args["kvVllmExtraKeys"] = json!(c.extra_keys);
        }
        let rule = json!({"serviceArguments": args,
            "endpoints": [{"endpointIP": s.http.ip().to_string(), "targetPort": s.http.port(), "weight": 1}]});
        harness::add_rule(addr, TOKEN, &rule)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", c.leg));
        names.push(format!("127.0.0.1:{}/tcp", 21001 + i));
    }

    // Every endpoint's first run: as soon as it is healthy and subscribed.
    let health = Poll::new(
        "a canary verdict on every endpoint",
        Duration::from_secs(90),
    )
    .every(Duration::from_millis(200))
    .until(async || {
        let h: Value = client
            .get(format!("http://{addr}/healthz"))
            .send()
            .await?
            .json()
            .await?;
        let done = h["rules"].as_array().is_some_and(|r| {
            r.len() == cases.len() && r.iter().all(|r| !r["endpoints"][0]["canary"].is_null())
        });
        Ok(if done {
            Probe::Ready(h)
        } else {
            Probe::Pending(h.to_string())
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", inv.log_tail(30)));
    assert_eq!(health["status"], "degraded");
    let metrics = client
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (c, name) in cases.iter().zip(&names) {
        let r = health["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name.as_str())
            .unwrap_or_else(|| panic!("rule {name} in {health}"));
        let canary = &r["endpoints"][0]["canary"];
        assert_eq!(canary["verdict"], c.leg, "{}: {canary:#}", c.leg);
        let want = if c.leg == "healthy" { 0.0 } else { 1.0 };
        assert_eq!(failing(&metrics, name), Some(want), "{}", c.leg);
        let flat_engine = c.sim_args.iter().any(|a| a == "flat");
        if flat_engine && c.extra_keys.is_none() {
            let m = canary["message"].as_str().unwrap();
            assert!(m.contains("kvVllmExtraKeys \"flat\""), "{m}");
        }
        match c.leg {
            "healthy" => {
                // The repeated chat reused exactly what the inventory predicted from the events.
                let repeat = &canary["probes"][2];
                assert_eq!(repeat["probe"], "chat_repeat");
                assert!(
                    repeat["predicted_tokens"].as_u64().unwrap() > 0,
                    "{canary:#}"
                );
                assert_eq!(
                    repeat["cached_tokens"], repeat["predicted_tokens"],
                    "{canary:#}"
                );
                if c.engine == "trtllm" {
                    // The simulator's block_hash is v1_block_key: keys compared too; no salted
                    // probe, and the message says why.
                    let m = canary["message"].as_str().unwrap();
                    assert!(
                        m.contains("checked: tokenizer, chat template, block size, keys, reuse;")
                            && m.contains("salted canary not sent"),
                        "{m}"
                    );
                    let probes: Vec<&str> = canary["probes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| p["probe"].as_str().unwrap())
                        .collect();
                    assert_eq!(probes, ["completion", "chat", "chat_repeat"], "{canary:#}");
                }
            }
            "tokenizer" => {
                let m = canary["message"].as_str().unwrap();
                assert!(
                    m.contains(" engine") && m.contains("completion canary"),
                    "{m}"
                );
            }
            "chat_template" => {
                let m = canary["message"].as_str().unwrap();
                assert!(
                    m.contains("chat canary") && m.contains("completion canary's tokens agree"),
                    "{m}"
                );
            }
            "block_size" => assert!(canary["message"]
                .as_str()
                .unwrap()
                .contains("kvBlockSize should be 32")),
            _ => {}
        }
    }
    assert!(
        metrics.contains("kvroute_canary_runs_total{outcome=\"healthy\"} 3"),
        "{metrics}"
    );

    let out = Command::new(harness::built_bin("kvroutectl").unwrap())
        .arg("health")
        .env("KVROUTE_SERVER", format!("http://{addr}"))
        .env("KVROUTE_TOKEN", TOKEN)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    for (c, name) in cases.iter().zip(&names) {
        let row = table
            .lines()
            .find(|l| l.contains(name.as_str()))
            .unwrap_or_else(|| panic!("{table}"));
        let last = row.split('|').map(str::trim).rfind(|c| !c.is_empty());
        assert_eq!(last, Some(c.leg), "{row}");
    }
}
