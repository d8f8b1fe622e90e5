//! The parity canary: the service sends each endpoint a few small synthetic requests through the
//! rule's own contract and checks the whole chain on the engine itself, naming the leg that is
//! wrong (`KVROUTE_CANARY_INTERVAL_MS`; off by default).
//!
//! One run on one endpoint sends, with `max_tokens: 1`, in this order:
//! 1. a completion of a plain text (a fresh nonce first, so no cache holds it): its token ids
//!    against the `token_ids` of the engine's `BlockStored` events check the **tokenizer**;
//! 2. a chat (system + user message, another nonce): its token ids check the **chat template**;
//!    with tokens agreeing, its block keys against the engine's check the hash legs (block size,
//!    seed, algorithm, a LoRA adapter's extra keys), diagnosed as the ingest self-check does;
//! 3. the same chat again: the engine's `usage.prompt_tokens_details.cached_tokens` against what
//!    the inventory predicts from the events of the first (**reuse**);
//! 4. a chat with a `cache_salt`: its keys check the **salt** leg (an engine that ignores the
//!    salt publishes the unsalted keys; a vLLM in the other extra-keys layout, `kvVllmExtraKeys`,
//!    publishes that layout's keys). Not sent to TensorRT-LLM ([`judge::SALT_NOT_JUDGED`]).
//!
//! TensorRT-LLM's stored events carry each block's tokens, so the tokenizer, the chat template
//! and the block size (tokens per block) are judged from them whatever the engine's `block_hash`
//! is; its keys are compared when they are kvroute's `v1_block_key` of the same tokens, and the
//! verdict says which legs were checked ([`judge`]).
//!
//! While a run listens, the endpoint's ingestion hands it a copy of each `BlockStored` with token
//! ids that starts a chain or continues one of the canary's ([`Tap`]): a ZMQ subscriber its
//! decoded events, the TensorRT-LLM drain each stored event's full blocks. The verdict
//! ([`CanaryVerdict`]) is in `/healthz`, in `kvroute_canary_runs_total{outcome}` and
//! `kvroute_endpoint_canary_failing{rule,ep}`, and in `kvroutectl health`. It is the verdict of
//! the replica that ingests the endpoint (not replicated), and it does not change routing
//! (the divergence signal does that from live traffic).
//!
//! Runs on vLLM, SGLang and TensorRT-LLM rules with a KV contract, `kvModel` and
//! `--tokenizer-dir`; each endpoint's first run waits until it is healthy and its event feed
//! (subscribers, or the drain) is connected.

pub mod judge;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::hash::{Engine, ExtraKeys, HashAlgo, HashContract};
use kvroute_core::prompt::{Endpoint, Request};
use kvroute_core::rule::KeyMode;
use serde_json::{json, Value};

use crate::fleet::{CanaryVerdict, Fleet, Leg, Probe, ProbeReport, RuleRuntime};
use crate::index::EndpointId;
use crate::ingest::decode::Stored;
use crate::ingest::tap::Tap;
use crate::offload::Loaded;
use judge::{find, predicted_tokens, verdict, Answer, Expected, Finding, Reuse};

/// Bytes of an engine's answer read at most (a one-token answer is far smaller).
const MAX_ANSWER_BYTES: usize = 64 << 10;

/// How often a run looks again whether the index holds what the events stored.
const INDEX_POLL: Duration = Duration::from_millis(5);

/// How often a waiting canary looks again whether its endpoint is ready.
const READY_POLL: Duration = Duration::from_millis(250);

/// The text every probe carries after its nonce: words, digits, accents, CJK, an emoji, code and
/// JSON, so that tokenizers that differ anywhere in their pre-tokenizer or vocabulary part here.
const FILLER: &str = "Prefix caching lets an engine skip the prefill of blocks it already holds, \
so a router that knows where each block lives sends the request there: 3 engines, 96 blocks of \
16 tokens, 1,234,567 requests a day. Naive routing, café-grade: résumé, Übergröße, 東京, 🚀, \
code `fn main() { println!(\"{}\", 42); }` and JSON {\"k\": [1, 2.5, null]}.";

/// Starts one canary per endpoint of `rule` when the canary is on and the rule can be checked;
/// `taps` are the endpoints' ingestion taps ([`crate::ingest::spawn_rule`]), in endpoint order.
pub fn spawn_rule(fleet: &Arc<Fleet>, rule: &Arc<RuleRuntime>, taps: Vec<Arc<Tap>>) {
    if fleet.settings.canary.interval.is_zero() {
        return;
    }
    let spec = &rule.spec;
    let engine_ok = matches!(spec.engine, Engine::Vllm | Engine::Sglang | Engine::Trtllm);
    if !engine_ok
        || spec.contract().is_none()
        || spec.slug.is_none()
        || fleet.tokenizer_dir().is_none()
    {
        tracing::warn!(
            rule = %spec.name(),
            "parity canary not run for this rule: it needs a vllm, sglang or trtllm rule with a KV contract, kvModel and --tokenizer-dir"
        );
        return;
    }
    for (ep, tap) in rule.endpoint_ids().zip(taps) {
        tokio::spawn(endpoint_loop(fleet.clone(), rule.clone(), ep, tap));
    }
}

async fn endpoint_loop(fleet: Arc<Fleet>, rule: Arc<RuleRuntime>, ep: EndpointId, tap: Arc<Tap>) {
    let interval = fleet.settings.canary.interval;
    loop {
        // Ready: this replica ingests the endpoint, it is healthy and every rank is subscribed.
        loop {
            let Some(e) = rule.ep(ep) else { return };
            if e.owned() && e.healthy() && e.connected().iter().all(|c| *c) {
                break;
            }
            tokio::select! {
                _ = rule.stopped() => return,
                _ = tokio::time::sleep(READY_POLL) => {}
            }
        }
        let v = tokio::select! {
            _ = rule.stopped() => return,
            v = run(&fleet, &rule, ep, &tap) => v,
        };
        record(&fleet, &rule, ep, v);
        tokio::select! {
            _ = rule.stopped() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

fn record(fleet: &Fleet, rule: &RuleRuntime, ep: EndpointId, v: CanaryVerdict) {
    let Some(e) = rule.ep(ep) else { return };
    let name = rule.spec.name();
    let addr = rule.spec.endpoints.get(ep.index()).map(|e| e.addr());
    fleet
        .metrics
        .canary_runs
        .with_label_values(&[v.verdict.as_str()])
        .inc();
    fleet
        .metrics
        .endpoint_canary_failing
        .with_label_values(&[&name, &ep.index().to_string()])
        .set(i64::from(v.verdict.failing()));
    let was = e.canary().map(|c| c.verdict);
    if v.verdict.failing() {
        // Every run that fails, at most one line per interval: loud, bounded.
        tracing::error!(rule = %name, endpoint = ?addr, verdict = v.verdict.as_str(), "parity canary: {}", v.message);
    } else if was != Some(v.verdict) {
        tracing::info!(rule = %name, endpoint = ?addr, verdict = v.verdict.as_str(), "parity canary: {}", v.message);
    }
    e.set_canary(v);
}

/// A fresh nonce: a run's prompts are in no cache yet.
fn nonce(ep: EndpointId) -> String {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = RUNS.fetch_add(1, Ordering::Relaxed);
    let mut seed = [0u8; 24];
    seed[..8].copy_from_slice(&nanos.to_le_bytes());
    seed[8..16].copy_from_slice(&n.to_le_bytes());
    seed[16..].copy_from_slice(&(ep.index() as u64).to_le_bytes());
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&seed))
}

/// The bodies of one run (the repeated chat is the chat's); no salted chat for TensorRT-LLM.
fn bodies(engine: Engine, model: &str, nonce: &str) -> Vec<(Probe, Endpoint, Value)> {
    let chat = |first: &str, salt: Option<String>| {
        let mut b = json!({
            "model": model, "max_tokens": 1, "temperature": 0, "stream": false,
            "messages": [
                {"role": "system", "content": format!("{first} canary {nonce}. Answer in one word.")},
                {"role": "user", "content": FILLER},
            ],
        });
        if let (Some(s), Some(o)) = (salt, b.as_object_mut()) {
            o.insert("cache_salt".into(), json!(s));
        }
        b
    };
    let mut v = vec![
        (
            Probe::Completion,
            Endpoint::Completions,
            json!({"model": model, "max_tokens": 1, "temperature": 0, "stream": false,
                   "prompt": format!("Completion canary {nonce}. {FILLER}")}),
        ),
        (Probe::Chat, Endpoint::ChatCompletions, chat("Chat", None)),
    ];
    if engine != Engine::Trtllm {
        v.push((
            Probe::Salted,
            Endpoint::ChatCompletions,
            chat("Salted", Some(format!("kvroute-canary-{nonce}"))),
        ));
    }
    v
}

/// kvroute's tokens and keys for each body, as the data plane computes them.
fn expect(
    loaded: &Loaded,
    contract: &HashContract,
    max_tokens: usize,
    bodies: &[(Probe, Endpoint, Value)],
) -> Result<Vec<Expected>, String> {
    bodies
        .iter()
        .map(|(probe, endpoint, body)| {
            let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
            let req = Request::from_json_for(&bytes, *endpoint).map_err(|e| e.to_string())?;
            let (tokens, _) = crate::offload::prompt_tokens(loaded, &req, max_tokens)?;
            let extra = ExtraKeys {
                cache_salt: req.cache_salt.clone(),
                ..ExtraKeys::default()
            };
            let keys = contract.keys(&tokens, &extra).map_err(|e| e.to_string())?;
            let (unsalted, other_layout) = match req.cache_salt {
                Some(_) => {
                    let unsalted = contract
                        .keys(&tokens, &ExtraKeys::default())
                        .map_err(|e| e.to_string())?;
                    let other = match contract.algo {
                        HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => {
                            let layout = contract.extra_layout.other();
                            let c = HashContract {
                                extra_layout: layout,
                                ..contract.clone()
                            };
                            let keys = c.keys(&tokens, &extra).map_err(|e| e.to_string())?;
                            Some((keys, layout.as_str()))
                        }
                        _ => None,
                    };
                    (Some(unsalted), other)
                }
                None => (None, None),
            };
            Ok(Expected {
                probe: *probe,
                tokens,
                keys,
                unsalted,
                other_layout,
            })
        })
        .collect()
}

/// Posts `body` and reads the answer's `usage` (at most [`MAX_ANSWER_BYTES`]).
async fn send(fleet: &Fleet, url: &str, body: &Value, timeout: Duration) -> Result<Answer, String> {
    let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
    let mut r = fleet
        .http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(bytes)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = r.status();
    let mut buf = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| format!("POST {url}: {e}"))? {
        let room = MAX_ANSWER_BYTES - buf.len();
        buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if buf.len() == MAX_ANSWER_BYTES {
            break;
        }
    }
    if !status.is_success() {
        let text = String::from_utf8_lossy(&buf[..buf.len().min(300)]).into_owned();
        return Err(format!("POST {url}: {status}: {text}"));
    }
    let v: Value =
        serde_json::from_slice(&buf).map_err(|e| format!("POST {url}: answer is not JSON: {e}"))?;
    let usage = v.get("usage");
    Ok(Answer {
        prompt_tokens: usage
            .and_then(|u| u.get("prompt_tokens"))
            .and_then(Value::as_u64),
        cached_tokens: usage
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64),
    })
}

/// Waits until `done` holds for the tapped events, or `deadline`.
async fn wait_for(tap: &Tap, deadline: tokio::time::Instant, done: impl Fn(&[Stored]) -> bool) {
    loop {
        // Registered before looking, so an event arriving in between is not missed.
        let arrived = tap.arrived.notified();
        if done(&tap.events()) {
            return;
        }
        tokio::select! {
            _ = arrived => {}
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One run on `ep` (see the module docs).
pub async fn run(
    fleet: &Arc<Fleet>,
    rule: &Arc<RuleRuntime>,
    ep: EndpointId,
    tap: &Tap,
) -> CanaryVerdict {
    let spec = &rule.spec;
    let done = |verdict: Leg, message: String, probes: Vec<ProbeReport>| CanaryVerdict {
        verdict,
        message,
        at: unix_now(),
        probes,
    };
    let (Some(target), Some(contract), Some(slug), Some(dir)) = (
        spec.endpoints.get(ep.index()),
        spec.contract(),
        spec.slug.clone(),
        fleet.tokenizer_dir().map(|d| d.to_path_buf()),
    ) else {
        return done(
            Leg::Unreachable,
            "the rule cannot be checked: it lacks the endpoint, a KV contract, kvModel or --tokenizer-dir".into(),
            Vec::new(),
        );
    };
    let base = format!("http://{}", target.addr());
    let timeout = fleet.settings.canary.timeout;
    let bodies = bodies(
        spec.engine,
        spec.model.as_deref().unwrap_or_default(),
        &nonce(ep),
    );
    let cache = fleet.tokenizers.clone();
    let max = fleet.settings.max_prefix_tokens;
    let (c, b) = (contract.clone(), bodies.clone());
    let computed = tokio::task::spawn_blocking(move || {
        let loaded = cache.get(&dir, &slug)?;
        let exp = expect(&loaded, &c, max, &b)?;
        Ok::<_, String>((loaded, exp))
    })
    .await
    .map_err(|e| format!("canary tokenization task: {e}"))
    .and_then(|r| r);
    let (loaded, expected) = match computed {
        Ok(x) => x,
        Err(msg) => {
            return done(
                Leg::Tokenizer,
                format!("kvroute cannot tokenize the canary with the rule's tokenizer: {msg}"),
                Vec::new(),
            )
        }
    };
    let keys: HashSet<u64> = expected
        .iter()
        .flat_map(|x| x.keys.iter().chain(x.unsalted.iter().flatten()))
        .map(|k| k.0)
        .collect();
    let _armed = tap.arm(keys);
    let tokens_mode = spec.key_mode == KeyMode::Tokens;
    let decode = |ids: &[u32]| {
        loaded
            .tokenizer
            .decode(ids)
            .unwrap_or_else(|err| err.to_string())
    };
    let judge = |x: &Expected, a: &Answer, events: &[Stored]| {
        find(spec.engine, &contract, tokens_mode, x, a, events, &decode)
    };
    let url = |endpoint: Endpoint| match endpoint {
        Endpoint::Completions => format!("{base}/v1/completions"),
        _ => format!("{base}/v1/chat/completions"),
    };
    let mut answers: Vec<Option<Answer>> = vec![None; bodies.len()];
    let mut repeat: Option<Answer> = None;
    let mut predicted = None;
    let mut evicted = false;
    let deadline = || tokio::time::Instant::now() + timeout;
    let result: Result<(), String> = async {
        for (i, (_, endpoint, body)) in bodies.iter().enumerate().take(2) {
            answers[i] = Some(send(fleet, &url(*endpoint), body, timeout).await?);
        }
        let firsts = [(0, answers[0]), (1, answers[1])];
        wait_for(tap, deadline(), |ev| {
            firsts
                .iter()
                .all(|(i, a)| judge(&expected[*i], &a.unwrap_or_default(), ev) != Finding::NoEvent)
        })
        .await;
        let chat = &expected[1];
        let matched = || {
            rule.match_prefix(&chat.keys, Instant::now())
                .get(ep.index())
                .copied()
                .unwrap_or(0)
        };
        // Ingestion taps an event before it applies it to the index: when the chat's events
        // matched, give the index until the deadline to hold every block they stored.
        let found = judge(chat, &answers[1].unwrap_or_default(), &tap.events());
        if matches!(found, Finding::Match | Finding::TokensOnly) {
            let until = deadline();
            while (matched() as usize) < chat.keys.len() && tokio::time::Instant::now() < until {
                tokio::time::sleep(INDEX_POLL).await;
            }
        }
        let held = matched();
        predicted = Some(predicted_tokens(
            held,
            chat.tokens.len(),
            contract.block_size.get(),
        ));
        let again = send(
            fleet,
            &url(Endpoint::ChatCompletions),
            &bodies[1].2,
            timeout,
        )
        .await?;
        repeat = Some(again);
        // Nothing reused of a prediction: under cache pressure (or a reset) the engine can have
        // evicted the chat's blocks in between. It then computes the repeat anew and stores its
        // first block again, and the index loses it once the removal is published. The wait wakes
        // on tapped stores; an engine that truly reuses nothing waits out the deadline.
        if again.cached_tokens == Some(0) && predicted.is_some_and(|p| p > 0) {
            let bs = contract.block_size.get();
            let first = chat.tokens.get(..bs).unwrap_or(&[]);
            let stores = |ev: &[Stored]| {
                ev.iter()
                    .filter(|s| s.parent.is_none() && s.token_ids.get(..bs) == Some(first))
                    .count()
            };
            wait_for(tap, deadline(), |ev| stores(ev) >= 2 || matched() < held).await;
            evicted = stores(&tap.events()) >= 2 || matched() < held;
        }
        if let (Some((_, endpoint, body)), Some(x)) = (bodies.get(2), expected.get(2)) {
            let salted = send(fleet, &url(*endpoint), body, timeout).await?;
            answers[2] = Some(salted);
            wait_for(tap, deadline(), |ev| {
                judge(x, &salted, ev) != Finding::NoEvent
            })
            .await;
        }
        Ok(())
    }
    .await;
    let events = tap.events();
    let findings: Vec<Option<Finding>> = expected
        .iter()
        .zip(&answers)
        .map(|(x, a)| a.map(|a| judge(x, &a, &events)))
        .collect();
    let mut probes: Vec<ProbeReport> = expected
        .iter()
        .zip(&answers)
        .zip(&findings)
        .map(|((x, a), f)| ProbeReport {
            probe: x.probe,
            tokens: x.tokens.len(),
            engine_tokens: a.and_then(|a| a.prompt_tokens),
            cached_tokens: a.and_then(|a| a.cached_tokens),
            predicted_tokens: None,
            finding: finding_word(f.as_ref()).into(),
        })
        .collect();
    probes.insert(
        2,
        ProbeReport {
            probe: Probe::ChatRepeat,
            tokens: expected[1].tokens.len(),
            engine_tokens: repeat.and_then(|a| a.prompt_tokens),
            cached_tokens: repeat.and_then(|a| a.cached_tokens),
            predicted_tokens: predicted.filter(|_| repeat.is_some()),
            finding: if repeat.is_some() { "sent" } else { "not_sent" }.into(),
        },
    );
    if let Err(msg) = result {
        return done(
            Leg::Unreachable,
            format!("the engine did not answer the canary: {msg}"),
            probes,
        );
    }
    let judged: Vec<(Probe, Option<&Finding>)> = expected
        .iter()
        .zip(&findings)
        .map(|(x, f)| (x.probe, f.as_ref()))
        .collect();
    let reuse = predicted.zip(repeat).map(|(p, a)| Reuse {
        predicted: p,
        cached: a.cached_tokens,
        evicted,
    });
    let (leg, message) = verdict(spec.engine, &judged, reuse);
    done(leg, message, probes)
}

fn finding_word(f: Option<&Finding>) -> &'static str {
    match f {
        None => "not_sent",
        Some(Finding::Match) => "match",
        Some(Finding::Tokens { .. }) => "tokens",
        Some(Finding::Count { .. }) => "count",
        Some(Finding::Keys { .. }) => "keys",
        Some(Finding::TokensOnly) => "tokens_only",
        Some(Finding::NoEvent) => "no_event",
    }
}
