//! `POST /v1/route`: the filter's routing question, and the JSON contract it is asked in (the
//! types are [`kvroute_core::wire`]'s, shared with the filter).
//!
//! Request (`RouteRequest`):
//! ```json
//! {"rule": "10.0.0.1:8080", "model": "Qwen/Qwen3-0.6B", "keys": [123, -45], "token_count": 160,
//!  "affinity_key": "tenant-a"}
//! ```
//! `rule` is the rule id or `VIP:port`; `keys` are the request's block keys in order, computed with
//! the rule's contract (`GET /v1/rules/{id}/contract`); SGLang keys may be sent signed. A filter
//! that offloads tokenization sends `prompt` or `messages` instead of `keys` (see [`super::offload`]);
//! the service then tokenizes with the rule's staged tokenizer and hashes with its contract.
//!
//! Response (`RouteResponse`):
//! ```json
//! {"rule_id": 1, "endpoint": "10.0.0.2:8000", "matched_blocks": 3, "tier": "tier15", "reason": "hit",
//!  "decode_endpoint": null}
//! ```
//! 404 for an unknown rule, 503 when no endpoint is healthy: the filter fails open on any error.
//!
//! `"explain": true` (optional, default false) asks the same question without side effects: the
//! answer is the decision a real request would get now, plus `explain` (per endpoint: matched
//! blocks, held blocks, load, health; the placement memory's recall), and nothing is committed:
//! no speculative credit, placement memory or heat, in-flight count, sequence counters, metrics or
//! replication message (`kvroutectl explain`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use kvroute_core::hash::BlockKey;

use super::error::{parse_json, ApiError};
use crate::index::EndpointId;
use crate::score::{decide, EpView, HashRing, Reason, ScoreInput, Tier, Update};
use crate::state::AppState;

pub use kvroute_core::wire::{Explain, ExplainEndpoint, RouteRequest, RouteResponse, WireKey};

/// Most keys one request may carry (a 1 MiB body holds fewer anyway).
const MAX_KEYS: usize = 1 << 16;

/// Handler for `POST /v1/route`.
#[utoipa::path(
    post,
    path = "/v1/route",
    tag = "routing",
    summary = "Routing decision for one request",
    description = "The filter's question: block keys (or the prompt/messages when tokenization is offloaded) in, the endpoint to pin out. A bearer token is required only when the service runs with `--route-token-file`.",
    request_body = RouteRequest,
    responses(
        (status = 200, description = "Decision", body = RouteResponse),
        (status = 400, description = "Malformed body", body = super::error::ErrorBody),
        (status = 401, description = "Missing or wrong route token (with `--route-token-file`)", body = super::error::ErrorBody),
        (status = 404, description = "Unknown rule", body = super::error::ErrorBody),
        (status = 413, description = "Body over the route body cap"),
        (status = 503, description = "No healthy endpoint", body = super::error::ErrorBody),
    ),
    security((), ("route_token" = [])),
)]
pub async fn route(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<RouteResponse>, ApiError> {
    let start = Instant::now();
    let mut req: RouteRequest = parse_json(&body)?;
    if req.keys.is_empty() && (req.prompt.is_some() || req.messages.is_some()) {
        offload(&state, &mut req).await;
    }
    let res = answer(&state, &req, Instant::now());
    if !req.explain {
        state
            .metrics
            .route_latency
            .observe(start.elapsed().as_secs_f64());
    }
    res.map(Json)
}

/// Fills `req.keys` and `req.token_count` from its prompt or messages; on failure leaves them
/// empty (the decision falls back with `miss_no_keys`) and logs why.
async fn offload(state: &Arc<AppState>, req: &mut RouteRequest) {
    let Some(rule) = state.find(&req.rule) else {
        return;
    };
    let (Some(contract), Some(slug), Some(dir)) = (
        rule.spec.contract(),
        rule.spec.slug.clone(),
        state.tokenizer_dir.clone(),
    ) else {
        tracing::debug!(rule = %rule.spec.name(), "offloaded tokenization needs kvModel, a KV contract and --tokenizer-dir");
        return;
    };
    let o = super::offload::Offload {
        model: req.model.clone().or_else(|| rule.spec.model.clone()),
        prompt: req.prompt.take(),
        messages: req.messages.take(),
    };
    let st = state.clone();
    let res = tokio::task::spawn_blocking(move || {
        let loaded = st.tokenizers.get(&dir, &slug)?;
        super::offload::keys_for(&loaded, &contract, &o, st.settings.max_prefix_tokens)
    })
    .await;
    match res {
        Ok(Ok(k)) => {
            if let (Some(t), false) = (k.truncated, req.explain) {
                state
                    .metrics
                    .offload_truncated
                    .with_label_values(&[t.as_str()])
                    .inc();
            }
            req.keys = k.keys.into_iter().map(|k| WireKey::Unsigned(k.0)).collect();
            req.token_count = k.token_count;
        }
        Ok(Err(e)) => {
            tracing::warn!(rule = %rule.spec.name(), "offloaded tokenization failed: {e}")
        }
        Err(e) => {
            tracing::warn!(rule = %rule.spec.name(), "offloaded tokenization task failed: {e}")
        }
    }
}

/// Decides one request against the current state (also used by tests and benches); with
/// `req.explain` nothing is committed.
pub fn answer(
    state: &AppState,
    req: &RouteRequest,
    now: Instant,
) -> Result<RouteResponse, ApiError> {
    let rule = state
        .find(&req.rule)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {:?}", req.rule)))?;
    if req.keys.len() > MAX_KEYS {
        return Err(ApiError::BadRequest(format!(
            "keys: {} given, at most {MAX_KEYS}",
            req.keys.len()
        )));
    }
    let keys: Vec<BlockKey> = req.keys.iter().map(|k| k.key()).collect();
    let mut matched = Vec::new();
    rule.index.match_prefix(&keys, now, &mut matched);
    let s = &state.settings;
    let fresh = if s.scrape_interval.is_zero() {
        Duration::ZERO
    } else {
        s.scrape_interval * 3
    };
    let eps: Vec<EpView> = rule
        .spec
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| EpView {
            weight: e.weight,
            role: e.role,
            healthy: rule.eps[i].healthy.load(Ordering::Relaxed),
            load: rule.eps[i].load(now, s.inflight_window, fresh),
            blocks: rule.index.block_count(EndpointId(i as u8)),
            matched: matched.get(i).copied().unwrap_or(0),
            capacity: rule.capacity(i, s.capacity_blocks),
            homed: rule.memory.homed(i),
        })
        .collect();
    let affinity = req.affinity_key.as_deref().map(|a| {
        match (state.settings.affinity_scope_model, &req.model) {
            (true, Some(m)) => HashRing::key_hash(&format!("{a}\u{0}{m}")),
            _ => HashRing::key_hash(a),
        }
    });
    // Explain peeks: the same recall without counting it toward the family's heat.
    let recall = match req.explain {
        true => rule.memory.peek(&keys, now),
        false => rule.memory.recall(&keys, now),
    };
    let d = decide(&ScoreInput {
        exact_mode: rule.spec.exact_mode,
        kv_enabled: rule.spec.kv_enabled(),
        sel: rule.spec.sel,
        eps: &eps,
        n_keys: keys.len(),
        token_count: req.token_count,
        affinity,
        ring: &rule.ring,
        hit_seq: rule.hit_seq.load(Ordering::Relaxed),
        rr_seq: rule.rr_seq.load(Ordering::Relaxed),
        recall,
        settings: s,
    });
    if req.explain {
        let ep = d.ep.ok_or_else(|| ApiError::NoEndpoint(rule.spec.name()))?;
        let endpoints = eps
            .iter()
            .enumerate()
            .map(|(i, e)| ExplainEndpoint {
                idx: i,
                endpoint: rule.spec.endpoints[i].addr(),
                healthy: e.healthy,
                matched_blocks: e.matched,
                blocks: e.blocks,
                load: e.load,
            })
            .collect();
        return Ok(RouteResponse {
            rule_id: rule.id,
            endpoint: rule.spec.endpoints[ep].addr(),
            matched_blocks: d.matched,
            tier: d.tier,
            reason: d.reason,
            decode_endpoint: d.decode.map(|i| rule.spec.endpoints[i].addr()),
            explain: Some(Explain {
                keys: u32::try_from(keys.len()).unwrap_or(u32::MAX),
                token_count: req.token_count,
                endpoints,
                recall: recall.map(|r| (r.ep, r.depth)),
            }),
        });
    }
    let m = &state.metrics;
    m.route_decisions
        .with_label_values(&[d.tier.as_str(), d.reason.as_str()])
        .inc();
    match d.reason {
        crate::score::Reason::Spill => m.tier15_spills.inc(),
        crate::score::Reason::ColdSeed => m.tier15_cold_seeds.inc(),
        crate::score::Reason::Remembered => m.tier15_remembered.inc(),
        _ => {}
    }
    if d.placed {
        m.tier15_placements.inc();
    }
    if d.counted_hit {
        rule.hit_seq.fetch_add(1, Ordering::Relaxed);
    }
    if d.tier == Tier::Fallback {
        rule.rr_seq.fetch_add(1, Ordering::Relaxed);
    }
    let ep = d.ep.ok_or_else(|| ApiError::NoEndpoint(rule.spec.name()))?;
    rule.eps[ep].record_decision(now);
    if let Some(dec) = d.decode {
        rule.eps[dec].record_decision(now);
    }
    // Speculation covers the blind spot before the engine reports the blocks it is about to
    // compute: the keys past what the chosen endpoint already holds. Re-crediting held keys would
    // only hide their eviction for the TTL (and cost a table insert per key on every follow-up).
    let unheld = keys.get(d.matched as usize..).unwrap_or(&[]);
    if rule.spec.kv_enabled() && !unheld.is_empty() && !s.spec_ttl.is_zero() {
        rule.index
            .speculate(EndpointId(ep as u8), unheld, now, s.spec_ttl);
    }
    // A miss makes the chosen endpoint the family's home; a hit refreshes it; a spill or cold
    // seed is a detour and must not be remembered, or a hot family would end up homed everywhere.
    let how = match d.reason {
        Reason::MissNoOverlap => Some(Update::Place),
        Reason::Hit | Reason::Remembered => Some(Update::Keep),
        _ => None,
    };
    if let (Some(how), true) = (how, rule.spec.kv_enabled()) {
        rule.memory.record(&keys, ep, how, now);
    }
    if let Some(r) = state.replica.get() {
        // The other replicas credit the same endpoint (speculation, memory, in-flight load).
        let shared = if rule.spec.kv_enabled() {
            &keys[..]
        } else {
            &[]
        };
        r.decision(state, &rule, ep, how, shared);
    }
    Ok(RouteResponse {
        rule_id: rule.id,
        endpoint: rule.spec.endpoints[ep].addr(),
        matched_blocks: d.matched,
        tier: d.tier,
        reason: d.reason,
        decode_endpoint: d.decode.map(|i| rule.spec.endpoints[i].addr()),
        explain: None,
    })
}
