//! `POST /v1/route`: the filter's routing question, and the JSON contract it is asked in (the
//! types are [`kvroute_core::wire`]'s, shared with the filter). With
//! `Content-Type: application/vnd.kvroute.route.v1` the same question arrives in
//! [`kvroute_core::wire::binary`] form (a JSON head, then the keys as 8-byte words): the form the
//! filter uses, advertised in every rule contract.
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

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::Json;
use kvroute_core::hash::BlockKey;

use super::error::{parse_json, ApiError};
use super::ApiState;
use crate::fleet::{Fleet, RouteError};
use crate::question::{self, Ask, KeyingError, Text};

use kvroute_core::wire::binary;
pub use kvroute_core::wire::{Explain, ExplainEndpoint, RouteRequest, RouteResponse, WireKey};

/// The route question in the binary form: `KVR1`, the JSON head's length (u32 LE), the JSON head
/// without keys, then the keys as u64 LE words.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)]
pub struct BinaryQuestion(Vec<u8>);

/// Handler for `POST /v1/route`.
#[utoipa::path(
    post,
    path = "/v1/route",
    tag = "routing",
    summary = "Routing decision for one request",
    description = "The filter's question: block keys (or the prompt/messages when tokenization is offloaded) in, the endpoint to pin out. A bearer token is required only when the service runs with `--route-token-file`.",
    request_body(
        description = "The question as JSON, or in the binary form (`application/vnd.kvroute.route.v1`: `KVR1`, the JSON head's length as u32 LE, the JSON head without keys, then the keys as u64 LE words; kvroute_core::wire::binary)",
        content(
            (RouteRequest = "application/json"),
            (BinaryQuestion = "application/vnd.kvroute.route.v1"),
        ),
    ),
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
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<RouteResponse>, ApiError> {
    let start = Instant::now();
    let mut req: RouteRequest = if is_binary(&headers) {
        binary::decode(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?
    } else {
        parse_json(&body)?
    };
    if req.keys.is_empty() && (req.prompt.is_some() || req.messages.is_some()) {
        offload(&state, &mut req).await;
    }
    let res = answer(&state.fleet, &req, Instant::now());
    if !req.explain {
        state
            .fleet
            .metrics
            .route_latency
            .observe(start.elapsed().as_secs_f64());
    }
    res.map(Json)
}

/// True when the body is the binary question (its content type, parameters ignored).
fn is_binary(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(binary::CONTENT_TYPE))
}

/// Fills `req.keys` and `req.token_count` from its prompt or messages; on failure leaves them
/// empty (the decision falls back with `miss_no_keys`) and logs why.
async fn offload(state: &Arc<ApiState>, req: &mut RouteRequest) {
    let fleet = &state.fleet;
    let Some(rule) = fleet.find(&req.rule) else {
        return;
    };
    let o = crate::offload::Offload {
        model: req.model.clone().or_else(|| rule.spec.model.clone()),
        prompt: req.prompt.take(),
        messages: req.messages.take(),
    };
    match question::tokenize(
        fleet,
        &state.tokenizers,
        &rule,
        Text::Offload(o),
        !req.explain,
    )
    .await
    {
        Ok(t) => {
            req.keys = t
                .keyed
                .keys
                .into_iter()
                .map(|k| WireKey::Unsigned(k.0))
                .collect();
            req.token_count = t.keyed.token_count;
            req.truncated = t.keyed.truncated;
        }
        Err(e @ KeyingError::NotConfigured) => {
            tracing::debug!(rule = %rule.spec.name(), "offloaded tokenization: {e}")
        }
        Err(e) => tracing::warn!(rule = %rule.spec.name(), "offloaded tokenization failed: {e}"),
    }
}

/// Decides one request against the current state through [`question::answer`] (also used by
/// tests and benches); with `req.explain` nothing is committed.
pub fn answer(fleet: &Fleet, req: &RouteRequest, now: Instant) -> Result<RouteResponse, ApiError> {
    let rule = fleet
        .find(&req.rule)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {:?}", req.rule)))?;
    let keys: Vec<BlockKey> = req.keys.iter().map(|k| k.key()).collect();
    let ask = Ask {
        keys: &keys,
        token_count: req.token_count,
        affinity_key: req.affinity_key.as_deref(),
        model: req.model.as_deref(),
        session: req.session.as_deref(),
        explain: req.explain,
        only: None,
        fallbacks: 0,
        truncated: req.truncated,
    };
    question::answer(fleet, &rule, &ask, now)
        .map(|a| a.response)
        .map_err(|e| match e {
            RouteError::TooManyKeys(n) => ApiError::BadRequest(format!(
                "keys: {n} given, at most {}",
                crate::fleet::MAX_KEYS
            )),
            RouteError::NoEndpoint => ApiError::NoEndpoint(rule.spec.name()),
        })
}
