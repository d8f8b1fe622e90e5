//! The CPU (host-memory) KV tier of `--cpu-blocks`, as vLLM's KV offloading runs it: computed
//! blocks are written to it and published with medium CPU, a prompt the GPU lost is loaded back
//! from it (counted as cached, cached on the GPU again), its evictions are published, and other
//! engines refuse it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use serde_json::{json, Value};

fn keys_of(tokens: &[u32]) -> Vec<u64> {
    let mut c = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap());
    c.seed = Some("0".into());
    c.keys(tokens, &ExtraKeys::default())
        .unwrap()
        .into_iter()
        .map(|k| k.0)
        .collect()
}

fn medium(ev: &rmpv::Value) -> Option<&str> {
    field(ev, "medium").and_then(|m| m.as_str())
}

/// Every event (with its batch's sequence number) until `done` holds, within 10 s.
async fn events_until(
    sub: &mut Sub,
    mut done: impl FnMut(&[(u64, rmpv::Value)]) -> bool,
) -> Vec<(u64, rmpv::Value)> {
    let mut seen = Vec::new();
    sub.until(Duration::from_secs(10), |f| {
        seen.extend(f.events().into_iter().map(|e| (f.seq, e)));
        done(&seen)
    })
    .await;
    seen
}

/// The CPU `BlockStored` keys among `events`, in order.
fn cpu_stored(events: &[(u64, rmpv::Value)]) -> Vec<u64> {
    events
        .iter()
        .filter(|(_, e)| ev_type(e) == "BlockStored" && medium(e) == Some("CPU"))
        .flat_map(|(_, e)| hashes(e))
        .collect()
}

async fn debug_cache(sim: &Sim) -> Value {
    serde_json::from_str(&get_text(&sim.url("/debug/cache")).await).unwrap()
}

/// Resets both tiers and waits (bounded) for the reset's `AllBlocksCleared`.
async fn reset(sim: &Sim, sub: &mut Sub) {
    reqwest::Client::new()
        .post(sim.url("/reset_prefix_cache?reset_external=true"))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap();
    sub.until(Duration::from_secs(10), |f| {
        f.events().iter().any(|e| ev_type(e) == "AllBlocksCleared")
    })
    .await;
    assert_eq!(debug_cache(sim).await["ranks"][0]["cpu"]["cached"], 0);
}

#[tokio::test]
async fn computed_blocks_are_stored_in_the_cpu_tier_and_published_with_medium_cpu() {
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--seed",
        "0",
        "--cpu-blocks",
        "64",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    reset(&sim, &mut sub).await;
    let prompt: Vec<u32> = (0..48).map(|t| 2000 + t).collect();
    post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    let want = keys_of(&prompt);
    let seen = events_until(&mut sub, |s| cpu_stored(s).len() >= 3).await;
    assert_eq!(cpu_stored(&seen), want, "one CPU store per computed block");
    // The GPU store comes first, in the same batch as the CPU stores.
    let gpu = seen
        .iter()
        .position(|(_, e)| ev_type(e) == "BlockStored" && medium(e) == Some("GPU"))
        .expect("the GPU BlockStored");
    let cpu: Vec<usize> = seen
        .iter()
        .enumerate()
        .filter(|(_, (_, e))| ev_type(e) == "BlockStored" && medium(e) == Some("CPU"))
        .map(|(i, _)| i)
        .collect();
    assert!(cpu.iter().all(|&i| i > gpu && seen[i].0 == seen[gpu].0));
    assert_eq!(hashes(&seen[gpu].1), want);
    // vLLM's offloading connector's payload: the key and the medium, no request metadata.
    let ev = &seen[cpu[0]].1;
    let names: Vec<&str> = ev
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "group_idx"
        ]
    );
    assert_eq!(field(ev, "parent_block_hash"), Some(&rmpv::Value::Nil));
    assert_eq!(u32s(field(ev, "token_ids").unwrap()), Vec::<u32>::new());
    assert_eq!(field(ev, "block_size"), Some(&rmpv::Value::from(0)));
    assert_eq!(field(ev, "group_idx"), Some(&rmpv::Value::from(0)));
    let cpu = &debug_cache(&sim).await["ranks"][0]["cpu"];
    assert_eq!(cpu["capacity"], 64);
    assert_eq!(cpu["cached"], 3);
    assert!(cpu["stored_total"].as_u64().unwrap() >= 3, "{cpu}");
}

#[tokio::test]
async fn a_prompt_evicted_from_the_gpu_is_loaded_back_from_the_cpu_tier() {
    // 4 GPU blocks: a 49-token prompt (3 full blocks + 1 token) takes all of them, so B
    // evicts every block of A from the GPU; the CPU tier keeps both.
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--seed",
        "0",
        "--kv-blocks",
        "4",
        "--cpu-blocks",
        "64",
        "--prefill-us-per-token",
        "4000",
        "--cpu-load-us-per-token",
        "1000",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    reset(&sim, &mut sub).await;
    let a: Vec<u32> = (0..49).map(|t| 3000 + t).collect();
    let b: Vec<u32> = (0..49).map(|t| 4000 + t).collect();
    let ka = keys_of(&a);
    let url = sim.url("/v1/completions");
    let body_a = json!({"prompt": a, "max_tokens": 0});
    let t = Instant::now();
    let (_, first) = post(&url, &body_a).await;
    let cold = t.elapsed();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    post(&url, &json!({"prompt": b, "max_tokens": 0})).await;
    // B's admission evicted A's blocks from the GPU.
    let mut removed = Vec::new();
    events_until(&mut sub, |s| {
        removed = s
            .iter()
            .filter(|(_, e)| ev_type(e) == "BlockRemoved" && medium(e) == Some("GPU"))
            .flat_map(|(_, e)| hashes(e))
            .collect();
        ka.iter().all(|k| removed.contains(k))
    })
    .await;
    // The oracle's view: nothing on the GPU, three blocks in the CPU tier.
    let m = sim.cache_match(&body_a).await;
    assert_eq!(m["matched_blocks"], 0, "{m}");
    assert_eq!(m["cpu_matched_blocks"], 3, "{m}");
    assert_eq!(m["cached_tokens"], 48, "{m}");

    let t = Instant::now();
    let (_, again) = post(&url, &body_a).await;
    let from_cpu = t.elapsed();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 48,
        "the CPU tier's blocks count as cached"
    );
    // Loading 48 tokens costs 48 ms and saves 192 ms of prefill.
    assert!(from_cpu >= Duration::from_millis(48), "{from_cpu:?}");
    assert!(from_cpu < cold, "{from_cpu:?} vs cold {cold:?}");
    // Reloaded into the GPU: a GPU store of A's blocks with their tokens, no new CPU store.
    let seen = events_until(&mut sub, |s| {
        s.iter().any(|(_, e)| {
            ev_type(e) == "BlockStored" && medium(e) == Some("GPU") && hashes(e) == ka
        })
    })
    .await;
    let (_, reload) = seen
        .iter()
        .find(|(_, e)| ev_type(e) == "BlockStored" && medium(e) == Some("GPU") && hashes(e) == ka)
        .unwrap();
    assert_eq!(field(reload, "parent_block_hash"), Some(&rmpv::Value::Nil));
    assert_eq!(u32s(field(reload, "token_ids").unwrap()), a[..48].to_vec());
    assert!(
        cpu_stored(&seen).iter().all(|k| !ka.contains(k)),
        "blocks loaded from the CPU tier are not written to it again"
    );
    let keys = ka.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let m: Value =
        serde_json::from_str(&get_text(&sim.url(&format!("/debug/cache/match?keys={keys}"))).await)
            .unwrap();
    assert_eq!(m["matched_blocks"], 3, "A is cached on the GPU again: {m}");
    assert_eq!(
        debug_cache(&sim).await["ranks"][0]["cpu"]["hit_blocks_total"],
        3
    );
    let metrics = get_text(&sim.url("/metrics")).await;
    let line = "vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"sim-model\"} 48.0";
    assert!(
        metrics.lines().any(|l| l == line),
        "missing {line:?} in\n{metrics}"
    );
}

#[tokio::test]
async fn a_cpu_eviction_publishes_block_removed_with_medium_cpu() {
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--seed",
        "0",
        "--cpu-blocks",
        "4",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    reset(&sim, &mut sub).await;
    let a: Vec<u32> = (0..64).map(|t| 5000 + t).collect();
    let b: Vec<u32> = (0..32).map(|t| 6000 + t).collect();
    let (ka, kb) = (keys_of(&a), keys_of(&b));
    let url = sim.url("/v1/completions");
    post(&url, &json!({"prompt": a, "max_tokens": 0})).await;
    events_until(&mut sub, |s| cpu_stored(s) == ka).await;
    // The tier is full: B's two blocks evict A's two least recently used, its tail.
    post(&url, &json!({"prompt": b, "max_tokens": 0})).await;
    let seen = events_until(&mut sub, |s| cpu_stored(s) == kb).await;
    let removed: Vec<&rmpv::Value> = seen
        .iter()
        .filter(|(_, e)| ev_type(e) == "BlockRemoved" && medium(e) == Some("CPU"))
        .map(|(_, e)| e)
        .collect();
    assert_eq!(removed.len(), 1, "one BlockRemoved per eviction batch");
    assert_eq!(hashes(removed[0]), vec![ka[3], ka[2]]);
    assert_eq!(removed[0].as_map().unwrap().len(), 4);
    assert_eq!(field(removed[0], "group_idx"), Some(&rmpv::Value::from(0)));
    // ... published before the stores that caused it.
    let at = |pred: &dyn Fn(&rmpv::Value) -> bool| seen.iter().position(|(_, e)| pred(e)).unwrap();
    assert!(
        at(&|e| ev_type(e) == "BlockRemoved" && medium(e) == Some("CPU"))
            < at(&|e| ev_type(e) == "BlockStored" && medium(e) == Some("CPU"))
    );
    let cpu = &debug_cache(&sim).await["ranks"][0]["cpu"];
    assert_eq!(cpu["cached"], 4, "{cpu}");
    assert!(cpu["evicted_total"].as_u64().unwrap() >= 2, "{cpu}");
}

/// Runs the simulator binary with `args` (bounded: 30 s) and returns its exit success and stderr.
fn run_to_exit(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-engine-sim"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = kvroute_test_support::wait_exit(&mut child, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("kvroute-engine-sim {args:?}: {e}"));
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.success(), err)
}

#[test]
fn other_engines_refuse_the_cpu_tier_naming_the_flag() {
    for engine in ["sglang", "trtllm", "llamacpp"] {
        let (ok, err) = run_to_exit(&["--engine", engine, "--cpu-blocks", "8"]);
        assert!(!ok, "{engine} started with --cpu-blocks");
        assert!(
            err.contains(&format!(
                "--cpu-blocks 8 needs --engine vllm (vLLM's KV offloading); allowed engines: vllm; got --engine {engine}"
            )),
            "{engine}: {err}"
        );
    }
}
