//! The simulator binary behaves like the engine it imitates: events with the engine's keys,
//! cache hits, eviction, replay, SSE usage, the TensorRT-LLM drain, SGLang ranks and metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_engine_sim::prompt::{fake_output, word_id};
use kvroute_test_support::poll::{Poll, Probe};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn contract(algo: HashAlgo, seed: Option<&str>) -> HashContract {
    let mut c = HashContract::new(algo, BlockSize::new(16).unwrap());
    c.seed = seed.map(str::to_string);
    c
}

fn core_keys(c: &HashContract, tokens: &[u32]) -> Vec<u64> {
    keys_with(c, tokens, &ExtraKeys::default())
}

fn keys_with(c: &HashContract, tokens: &[u32], extra: &ExtraKeys) -> Vec<u64> {
    c.keys(tokens, extra)
        .unwrap()
        .into_iter()
        .map(|k| k.0)
        .collect()
}

/// The first `BlockStored` whose keys are `want`, within 10 s.
async fn stored_with(sub: &mut Sub, want: &[u64]) -> Option<rmpv::Value> {
    let mut got = None;
    sub.until(Duration::from_secs(10), |f| {
        got = f
            .events()
            .into_iter()
            .find(|ev| ev_type(ev) == "BlockStored" && hashes(ev) == want);
        got.is_some()
    })
    .await;
    got
}

/// What the simulator generates for `prompt` with the word tokenizer.
fn output_ids(prompt: &[u32], n: usize) -> Vec<u32> {
    fake_output(prompt, n).split(' ').map(word_id).collect()
}

#[tokio::test]
async fn vllm_publishes_core_keys_and_replays_them() {
    let rp = free_port();
    let (sim, mut sub, mut all) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--replay-port",
        &rp.to_string(),
        "--decode-us-per-token",
        "10",
        "--name",
        "sim-a",
    ])
    .await;

    // 40 prompt tokens + 8 output tokens: 2 prompt blocks, then a third completed by the output.
    let prompt: Vec<u32> = (0..40).map(|t| 1000 + t).collect();
    let (headers, resp) = post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 8}),
    )
    .await;
    assert_eq!(headers.get("x-kvroute-sim").unwrap(), "sim-a");
    assert_eq!(resp["usage"]["prompt_tokens"], 40);
    assert_eq!(resp["usage"]["completion_tokens"], 8);

    let c = contract(HashAlgo::Sha256Cbor, Some("0"));
    let mut seq_tokens = prompt.clone();
    seq_tokens.extend(output_ids(&prompt, 8));
    let want = core_keys(&c, &seq_tokens);
    assert_eq!(want.len(), 3);
    let mut stored: Vec<(Vec<u64>, Option<u64>, Vec<u32>)> = Vec::new();
    let frames = sub
        .until(Duration::from_secs(10), |f| {
            for ev in f.events() {
                if ev_type(&ev) == "BlockStored" {
                    let parent = field(&ev, "parent_block_hash").and_then(|p| p.as_u64());
                    stored.push((hashes(&ev), parent, u32s(field(&ev, "token_ids").unwrap())));
                }
            }
            stored.iter().any(|s| s.0.contains(&want[2]))
        })
        .await;
    all.extend(frames);
    let prompt_ev = stored
        .iter()
        .find(|s| s.0.first() == Some(&want[0]))
        .expect("prompt BlockStored");
    assert_eq!(
        prompt_ev.0,
        want[..2].to_vec(),
        "prompt blocks carry kvroute-core's sha256_cbor keys"
    );
    assert_eq!(prompt_ev.1, None);
    assert_eq!(prompt_ev.2, prompt[..32].to_vec());
    let out_ev = stored
        .iter()
        .find(|s| s.0 == vec![want[2]])
        .expect("output BlockStored");
    assert_eq!(
        out_ev.1,
        Some(want[1]),
        "the output block chains to the prompt's last full block"
    );
    assert_eq!(out_ev.2, seq_tokens[32..48].to_vec());

    // Frames: empty topic, consecutive seqs (the first probes may predate the subscription), dp_rank 0.
    let first_seq = all[0].seq;
    for (i, f) in all.iter().enumerate() {
        assert_eq!(f.seq, first_seq + i as u64);
        assert!(f.topic.is_empty());
        assert_eq!(f.dp_rank(), Some(0));
    }

    // Replay from seq 0 returns every batch since start, the ones seen with the same bytes, then the end marker.
    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{}", sim.replay_port.unwrap()))
        .await
        .unwrap();
    let req = ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut replayed = Vec::new();
    for _ in 0..1000 {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert!(m[0].is_empty(), "reply starts with the empty delimiter");
        if m[2].as_ref() == [0xff; 8] {
            assert_eq!(m.len(), 4);
            assert!(m[1].is_empty() && m[3].is_empty());
            break;
        }
        assert_eq!(m.len(), 4);
        replayed.push((
            u64::from_be_bytes(m[2].as_ref().try_into().unwrap()),
            m[3].clone(),
        ));
    }
    let last = all.last().unwrap().seq;
    assert_eq!(
        replayed.iter().map(|r| r.0).collect::<Vec<_>>(),
        (0..=last).collect::<Vec<_>>()
    );
    for f in &all {
        assert_eq!(
            replayed[f.seq as usize].1, f.payload,
            "replayed batch {} differs from the published one",
            f.seq
        );
    }
}

#[tokio::test]
async fn the_filters_matched_blocks_come_back_in_the_response() {
    let sim = Sim::start(&["--engine", "vllm", "--decode-us-per-token", "10"]);
    let body = json!({"model": "sim-model", "prompt": "a b c", "max_tokens": 1});
    let r = reqwest::Client::new()
        .post(sim.url("/v1/completions"))
        .header("x-kvroute-matched-blocks", "7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers().get("x-kvroute-matched-blocks").unwrap(), "7");
    let (h, _) = post(&sim.url("/v1/completions"), &body).await;
    assert!(h.get("x-kvroute-matched-blocks").is_none());
}

#[tokio::test]
async fn repeated_prompt_reports_cached_tokens() {
    let sim = Sim::start(&["--engine", "vllm", "--decode-us-per-token", "10"]);
    let words: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
    let body = json!({"model": "sim-model", "prompt": words.join(" "), "max_tokens": 4});
    let (h, first) = post(&sim.url("/v1/completions"), &body).await;
    assert_eq!(h.get("x-kvroute-sim").unwrap().to_str().unwrap(), sim.addr);
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post(&sim.url("/v1/completions"), &body).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert_eq!(
        second["choices"][0]["text"], first["choices"][0]["text"],
        "output is deterministic"
    );

    // Chat: the second turn extends the first, so its cached prefix covers turn one.
    let mut messages = vec![
        json!({"role": "system", "content": words.join(" ")}),
        json!({"role": "user", "content": "hello there"}),
    ];
    let (_, t1) = post(
        &sim.url("/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 8}),
    )
    .await;
    assert_eq!(t1["object"], "chat.completion");
    messages.push(json!({"role": "assistant", "content": t1["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "and again"}));
    let (_, t2) = post(
        &sim.url("/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 8}),
    )
    .await;
    let p1 = t1["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached2 = t2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached2 >= p1 / 16 * 16,
        "turn two reuses turn one's blocks: {cached2} cached, turn one had {p1} tokens"
    );

    // The oracle's view agrees.
    let m: Value = sim.cache_match(&body).await;
    assert_eq!(m["matched_blocks"], 6);
    assert_eq!(m["cached_tokens"], 96);
}

#[tokio::test]
async fn small_capacity_evicts_tail_first_and_publishes_block_removed() {
    // Probes (2 blocks each) fill and recycle the 4-block cache; start from a clean state after.
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--kv-blocks",
        "4",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    sim.reset_prefix_cache().await;
    sub.until(Duration::from_secs(10), |f| {
        f.events().iter().any(|e| ev_type(e) == "AllBlocksCleared")
    })
    .await;

    let c = contract(HashAlgo::Sha256Cbor, None);
    let a: Vec<u32> = (0..48).map(|t| 5000 + t).collect();
    let b: Vec<u32> = (0..48).map(|t| 7000 + t).collect();
    let ka = core_keys(&c, &a);
    post(
        &sim.url("/v1/completions"),
        &json!({"prompt": a, "max_tokens": 0}),
    )
    .await;
    post(
        &sim.url("/v1/completions"),
        &json!({"prompt": b, "max_tokens": 0}),
    )
    .await;
    let mut removed = Vec::new();
    sub.until(Duration::from_secs(10), |f| {
        for ev in f.events() {
            if ev_type(&ev) == "BlockRemoved" {
                removed.extend(hashes(&ev));
            }
        }
        removed.len() >= 2
    })
    .await;
    // A's blocks were freed tail first, so its end goes before its beginning.
    assert_eq!(removed, vec![ka[2], ka[1]]);
    let keys = ka.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let m: Value =
        serde_json::from_str(&get_text(&sim.url(&format!("/debug/cache/match?keys={keys}"))).await)
            .unwrap();
    assert_eq!(m["matched_blocks"], 1);

    // A request that can never fit is refused, not queued forever.
    let r = reqwest::Client::new()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert_eq!(
        err["error"]["message"],
        "the request needs 7 KV blocks (prompt + max_tokens); --kv-blocks is 4"
    );
}

#[tokio::test]
async fn sse_stream_ends_with_a_usage_chunk() {
    let sim = Sim::start(&["--decode-us-per-token", "100"]);
    let body = json!({"messages": [{"role": "user", "content": "tell me a story about caches"}], "max_tokens": 6, "stream": true,
                      "stream_options": {"include_usage": true}});
    let mut texts = Vec::new();
    for _ in 0..2 {
        let r = reqwest::Client::new()
            .post(sim.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.headers().get("content-type").unwrap(),
            "text/event-stream"
        );
        assert!(r.headers().get("x-kvroute-sim").is_some());
        let text = r.text().await.unwrap();
        texts.push(text);
    }
    let text = &texts[1];
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|l| !l.is_empty())
        .map(|l| l.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(*data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content.split(' ').count(), 6);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    let p = usage["usage"]["prompt_tokens"].as_u64().unwrap();
    // Second identical request: its full blocks were cached by the first.
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        (p - 1) / 16 * 16
    );
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test]
async fn trtllm_drain_returns_events_once() {
    let sim = Sim::start(&["--engine", "trtllm", "--decode-us-per-token", "10"]);
    let client = reqwest::Client::new();
    let drain = || async {
        client
            .post(sim.url("/kv_cache_events"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    let first = drain().await;
    assert_eq!(first[0]["data"]["type"], "created");
    assert_eq!(first[0]["event_id"], 0);
    let prompt: Vec<u32> = (0..32).collect();
    post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    let events = drain().await;
    let stored = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["data"]["type"] == "stored")
        .unwrap();
    let got: Vec<u64> = stored["data"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["block_hash"].as_u64().unwrap())
        .collect();
    assert_eq!(
        got,
        core_keys(&contract(HashAlgo::BlockhashTrtllm, None), &prompt)
    );
    assert_eq!(stored["data"]["parent_hash"], Value::Null);
    assert_eq!(
        stored["data"]["blocks"][1]["tokens"][0],
        json!({"type": "unique_token", "token_id": 16, "token_extra_id": 0})
    );
    assert_eq!(stored["event_id"], 1);
    assert_eq!(drain().await, json!([]), "the drain emptied the queue");
    // Other engines do not serve it.
    let vllm = Sim::start(&[]);
    assert_eq!(
        client
            .post(vllm.url("/kv_cache_events"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
}

#[tokio::test]
async fn sglang_ranks_publish_signed_keys_on_port_plus_rank() {
    let zp = free_port_pair();
    let sim = Sim::start(&[
        "--engine",
        "sglang",
        "--dp-ranks",
        "2",
        "--zmq-port",
        &zp.to_string(),
        "--decode-us-per-token",
        "10",
    ]);
    let mut subs = [Sub::connect(zp).await, Sub::connect(zp + 1).await];
    let c = contract(HashAlgo::Sha256Sglang, None);
    // Requests alternate between ranks; send until both SUBs have joined and seen a store.
    let mut seen = [None::<common::Frame>, None];
    for i in 0..60u32 {
        let prompt: Vec<u32> = (0..32).map(|t| 10_000 * (i + 1) + t).collect();
        post(
            &sim.url("/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": 0}),
        )
        .await;
        for (r, sub) in subs.iter_mut().enumerate() {
            while let Some(f) = sub.recv(Duration::from_millis(50)).await {
                if let Some(ev) = f.events().iter().find(|e| ev_type(e) == "BlockStored") {
                    let toks = u32s(field(ev, "token_ids").unwrap());
                    assert_eq!(
                        hashes(ev),
                        core_keys(&c, &toks),
                        "SGLang keys are kvroute-core's sha256_sglang keys"
                    );
                    assert_eq!(
                        ev.as_map().unwrap().len(),
                        7,
                        "SGLang's seven BlockStored fields"
                    );
                    seen[r] = Some(f.clone());
                }
            }
        }
        if seen.iter().all(Option::is_some) {
            break;
        }
    }
    assert_eq!(
        seen[0].as_ref().expect("rank 0 published").dp_rank(),
        Some(0)
    );
    assert_eq!(
        seen[1].as_ref().expect("rank 1 published").dp_rank(),
        Some(1)
    );
    let info: Value = serde_json::from_str(&get_text(&sim.url("/get_server_info")).await).unwrap();
    assert_eq!(info["page_size"], 16);
    assert_eq!(info["dp_size"], 2);
}

#[tokio::test]
async fn metrics_use_the_engines_names() {
    let vllm = Sim::start(&["--kv-blocks", "123", "--model", "m1"]);
    post(
        &vllm.url("/v1/completions"),
        &json!({"prompt": "a b c", "max_tokens": 2}),
    )
    .await;
    let text = get_text(&vllm.url("/metrics")).await;
    for line in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"m1\"} 0.0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"m1\"} 0.0",
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m1\"} 0.0",
        "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m1\"} 3.0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(text.contains("num_gpu_blocks=\"123\""));
    let sg = Sim::start(&["--engine", "sglang"]);
    let text = get_text(&sg.url("/metrics")).await;
    assert!(text.contains("sglang:num_running_reqs{model_name=\"sim-model\"} 0.0"));
    assert!(text.contains("sglang:num_queue_reqs{model_name=\"sim-model\"} 0.0"));
    let models: Value = serde_json::from_str(&get_text(&vllm.url("/v1/models")).await).unwrap();
    assert_eq!(models["data"][0]["id"], "m1");
    let health = reqwest::get(vllm.url("/health")).await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn queue_and_simulated_time_shape_ttft() {
    // One slot, 2 ms per uncached prompt token: a 100-token prompt prefills in ~200 ms cold and
    // ~8 ms warm (96 cached), and a second concurrent request waits for the first.
    let sim = Sim::start(&[
        "--max-concurrency",
        "1",
        "--prefill-us-per-token",
        "2000",
        "--decode-us-per-token",
        "10",
    ]);
    let body = json!({"prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 1});
    let t = std::time::Instant::now();
    post(&sim.url("/v1/completions"), &body).await;
    let cold = t.elapsed();
    let t = std::time::Instant::now();
    post(&sim.url("/v1/completions"), &body).await;
    let warm = t.elapsed();
    assert!(cold >= Duration::from_millis(200), "cold {cold:?}");
    assert!(warm < cold / 3, "warm {warm:?} vs cold {cold:?}");
    let other = |base: u32| json!({"prompt": (0..100).map(|t| base + t).collect::<Vec<u32>>(), "max_tokens": 1});
    let t = std::time::Instant::now();
    let (url, b1, b2) = (sim.url("/v1/completions"), other(1000), other(2000));
    let (a, b) = tokio::join!(post(&url, &b1), post(&url, &b2));
    let both = t.elapsed();
    assert!(
        both >= Duration::from_millis(400),
        "two cold prompts through one slot take two prefills: {both:?}"
    );
    assert_eq!(a.1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(b.1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn decode_and_prefill_base_take_their_simulated_time() {
    // 20 ms per output token and 50 ms for every prefill: the first token comes after 50 ms, the
    // 16th after ~370 ms (the words share the decode time of every token, not each word all of
    // it).
    let sim = Sim::start(&[
        "--prefill-us-per-token",
        "0",
        "--prefill-base-us",
        "50000",
        "--decode-us-per-token",
        "20000",
    ]);
    let timed = |n: u32| {
        let url = sim.url("/v1/completions");
        async move {
            let body = json!({"prompt": (0..40).map(|t| 500 * n + t).collect::<Vec<u32>>(), "max_tokens": n});
            let t = std::time::Instant::now();
            let (_, resp) = post(&url, &body).await;
            assert_eq!(resp["usage"]["completion_tokens"], n);
            t.elapsed()
        }
    };
    let one = timed(1).await;
    let sixteen = timed(16).await;
    assert!(
        one >= Duration::from_millis(50),
        "base, first token: {one:?}"
    );
    assert!(
        sixteen >= Duration::from_millis(370),
        "base + 16 tokens: {sixteen:?}"
    );
    // Far below 16 words x the whole decode time (5.2 s), with room for a loaded machine.
    assert!(
        sixteen < Duration::from_millis(1500),
        "16 tokens take 16 x 20 ms, not more: {sixteen:?}"
    );
}

#[tokio::test]
async fn a_prompt_is_cached_at_admission_or_after_its_prefill() {
    // A 100-token prompt prefills for 2 s. Cached at admission (vLLM's scheduler), a second
    // request with the same prompt hits its 6 full blocks while the first still prefills; cached
    // at the prefill's end, it hits nothing until then.
    for (mode, hit) in [("schedule", 96), ("prefill-end", 0)] {
        let sim = Sim::start(&[
            "--prefill-us-per-token",
            "20000",
            "--decode-us-per-token",
            "10",
            "--cache-prompt-at",
            mode,
        ]);
        let body = json!({"prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 1});
        let url = sim.url("/v1/completions");
        let first = tokio::spawn({
            let (url, body) = (url.clone(), body.clone());
            async move { post(&url, &body).await.1 }
        });
        Poll::new(
            format!("{mode}: the first request running with {hit} tokens cached"),
            Duration::from_secs(10),
        )
        .every(Duration::from_millis(10))
        .until(async || {
            let c: Value = serde_json::from_str(&get_text(&sim.url("/debug/cache")).await)?;
            let planned = post(&sim.url("/debug/cache/match"), &body).await.1;
            Ok(match c["running"] == 1 && planned["cached_tokens"] == hit {
                true => Probe::Ready(()),
                false => Probe::Pending(format!("{c} {planned}")),
            })
        })
        .await
        .unwrap();
        let second = post(&url, &body).await.1;
        assert_eq!(
            second["usage"]["prompt_tokens_details"]["cached_tokens"], hit,
            "{mode}: the second request's hit while the first prefills"
        );
        let first = first.await.unwrap();
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }
}

#[tokio::test]
async fn cache_salt_enters_keys_and_events() {
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    let prompt: Vec<u32> = (0..33).map(|t| 3000 + t).collect();
    let salted = json!({"prompt": prompt, "max_tokens": 0, "cache_salt": "tenant-a"});
    post(&sim.url("/v1/completions"), &salted).await;
    let c = contract(HashAlgo::Sha256Cbor, Some("0"));
    let extra = ExtraKeys {
        cache_salt: Some("tenant-a".into()),
        ..Default::default()
    };
    let want = keys_with(&c, &prompt, &extra);
    assert_ne!(want, core_keys(&c, &prompt), "the salt changes the keys");
    let ev = stored_with(&mut sub, &want).await.unwrap();
    let extra_keys = field(&ev, "extra_keys")
        .unwrap()
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        extra_keys[0],
        rmpv::Value::Array(vec![rmpv::Value::from("tenant-a")])
    );
    assert_eq!(extra_keys[1], rmpv::Value::Nil);
    // Unsalted, the same prompt does not hit the salted blocks.
    let (_, r) = post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, r) = post(&sim.url("/v1/completions"), &salted).await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
}

/// `--ignore-cache-salt` hashes a salted request as an unsalted one (an engine without salt
/// support); `--lora-adapter` mixes the adapter into every key and names it in the events.
#[tokio::test]
async fn a_salt_can_be_ignored_and_a_lora_adapter_named() {
    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--ignore-cache-salt",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    let prompt: Vec<u32> = (0..33).map(|t| 4000 + t).collect();
    let salted = json!({"prompt": prompt, "max_tokens": 0, "cache_salt": "tenant-a"});
    post(&sim.url("/v1/completions"), &salted).await;
    let c = contract(HashAlgo::Sha256Cbor, Some("0"));
    let want = core_keys(&c, &prompt);
    assert!(
        stored_with(&mut sub, &want).await.is_some(),
        "the salted request is stored under the unsalted keys"
    );
    let (_, r) = post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    drop(sim);

    let (sim, mut sub, _) = Sim::start_subscribed(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--lora-adapter",
        "sql-lora=/adapters/sql",
        "--decode-us-per-token",
        "10",
    ])
    .await;
    post(
        &sim.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    let extra = ExtraKeys {
        lora: Some(("sql-lora".into(), "/adapters/sql".into())),
        ..Default::default()
    };
    let want = keys_with(&c, &prompt, &extra);
    assert_ne!(want, core_keys(&c, &prompt), "the adapter changes the keys");
    let ev = stored_with(&mut sub, &want)
        .await
        .expect("a BlockStored with the adapter's keys");
    assert_eq!(
        field(&ev, "lora_name"),
        Some(&rmpv::Value::from("sql-lora"))
    );
    assert_eq!(field(&ev, "lora_id"), Some(&rmpv::Value::from(1)));
}
