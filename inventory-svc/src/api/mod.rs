//! The HTTP API (axum), all on one listener.
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/route` | filter (bearer with `--route-token-file`) | routing decision ([`route`]) |
//! | `GET /v1/rules`, `GET /v1/rules/{id}/contract` | filter | hash contract per rule |
//! | `GET /v1/tokenizers/{slug}[/tokenizer_config.json]` | filter | staged tokenizers |
//! | `POST /netlox/v1/config/loadbalancer` | operator (bearer) | add a rule |
//! | `GET /netlox/v1/config/loadbalancer/all` | operator | list rules |
//! | `DELETE /netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}` | operator (bearer) | delete |
//! | `GET /netlox/v1/config/ai/kv/inventory?service_id=&ep_idx=[&offset=&limit=]` | operator | inventory page (bounded: a cursor over the table) |
//! | `/healthz`, `/readyz`, `/metrics` | probes, Prometheus | |
//!
//! Bodies are size-capped; malformed JSON is a 400 through [`error::ApiError`], never a panic.

pub mod error;
pub mod offload;
pub mod route;
pub mod tokenizers;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::index::EndpointId;
use crate::rules::{parse_rule, RuleRejected, RuleSpec};
use crate::state::{lock, AppState, RuleRuntime};
use error::{parse_json, ApiError};

/// Cap on management bodies (a rule with 64 endpoints is a few KiB).
pub const MAX_RULE_BODY: usize = 256 * 1024;
/// Cap on route bodies (64k keys as JSON numbers).
pub const MAX_ROUTE_BODY: usize = 2 * 1024 * 1024;
/// Largest inventory page.
pub const MAX_PAGE: usize = 10_000;

/// Builds the router.
pub fn router(state: Arc<AppState>) -> Router {
    let writes = Router::new()
        .route("/netlox/v1/config/loadbalancer", post(add_rule))
        .route(
            "/netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}",
            delete(delete_rule),
        )
        .layer(DefaultBodyLimit::max(MAX_RULE_BODY))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_bearer,
        ));
    let route = Router::new()
        .route(
            "/v1/route",
            post(route::route).layer(DefaultBodyLimit::max(MAX_ROUTE_BODY)),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_route_token,
        ));
    Router::new()
        .merge(route)
        .route("/v1/rules", get(list_contracts))
        .route("/v1/rules/{id}/contract", get(contract))
        .route("/v1/tokenizers/{slug}", get(tokenizers::tokenizer_json))
        .route(
            "/v1/tokenizers/{slug}/{file}",
            get(tokenizers::tokenizer_file),
        )
        .route("/netlox/v1/config/loadbalancer/all", get(list_rules))
        .route("/netlox/v1/config/ai/kv/inventory", get(inventory))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(writes)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .with_state(state)
}

async fn require_bearer(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    match &state.auth_token {
        Some(want) if bearer_matches(&headers, want) => next.run(req).await,
        _ => ApiError::Unauthorized.into_response(),
    }
}

/// `POST /v1/route` with `--route-token-file`: the same bearer check; open without it.
async fn require_route_token(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    match &state.route_token {
        None => next.run(req).await,
        Some(want) if bearer_matches(&headers, want) => next.run(req).await,
        Some(_) => ApiError::Unauthorized.into_response(),
    }
}

/// True when `Authorization` is `Bearer <want>`; the scheme is case-insensitive (RFC 9110 11.1).
fn bearer_matches(headers: &HeaderMap, want: &str) -> bool {
    let Some((scheme, token)) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
    else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && constant_eq(want.as_bytes(), token.trim().as_bytes())
}

/// Compares without an early exit, so the token cannot be guessed byte by byte from timing.
fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Stores and starts a validated rule, replacing one with the same id, and tells the other
/// replicas (config file at start, management API).
pub fn install_and_share(
    state: &Arc<AppState>,
    spec: RuleSpec,
) -> Result<Arc<RuleRuntime>, ApiError> {
    install_shared(state, spec).map(|(rt, _)| rt)
}

/// [`install_and_share`], also saying whether the rule was already installed unchanged (then
/// nothing is restarted, replaced or shared).
fn install_shared(
    state: &Arc<AppState>,
    spec: RuleSpec,
) -> Result<(Arc<RuleRuntime>, bool), ApiError> {
    if let Some(rt) = state.unchanged(&spec) {
        return Ok((rt, true));
    }
    let (rt, replaced) = install(state, spec)?;
    if let Some(r) = state.replica.get() {
        r.rule_put(state, &rt, replaced.as_deref());
    }
    Ok((rt, false))
}

/// Stores and starts a validated rule locally (a rule another replica shared); an identical
/// installed rule is left as it is.
pub fn install_rule(state: &Arc<AppState>, spec: RuleSpec) -> Result<Arc<RuleRuntime>, ApiError> {
    if let Some(rt) = state.unchanged(&spec) {
        return Ok(rt);
    }
    install(state, spec).map(|(rt, _)| rt)
}

fn install(
    state: &Arc<AppState>,
    spec: RuleSpec,
) -> Result<(Arc<RuleRuntime>, Option<Arc<RuleRuntime>>), ApiError> {
    let (rt, replaced) = state.insert(spec).map_err(|e| {
        ApiError::InvalidRule(
            e.0.into_iter()
                .map(|f| crate::rules::FieldProblem {
                    field: f.field,
                    value: f.value,
                    allowed: f.allowed,
                })
                .collect(),
        )
    })?;
    crate::ingest::spawn_rule(state, &rt);
    crate::health::spawn_rule(state, &rt);
    tracing::info!(rule = %rt.spec.name(), id = rt.id, engine = %rt.spec.engine, replaced = replaced.is_some(), "rule installed");
    Ok((rt, replaced))
}

/// Removes a rule by name (`VIP:port/protocol`), stops its tasks and drops its metric series.
pub fn uninstall_rule(state: &AppState, name: &str) -> Option<Arc<RuleRuntime>> {
    let rt = state.remove(name)?;
    let m = &state.metrics;
    for i in 0..rt.eps.len() {
        let ep = i.to_string();
        let _ = m.inventory_blocks.remove_label_values(&[name, &ep]);
        let _ = m.endpoint_healthy.remove_label_values(&[name, &ep]);
        let _ = m.endpoint_scraped_load.remove_label_values(&[name, &ep]);
        let _ = m.endpoint_capacity_blocks.remove_label_values(&[name, &ep]);
        let _ = m.endpoint_homed_blocks.remove_label_values(&[name, &ep]);
        let _ = m.snapshot_age.remove_label_values(&[name, &ep]);
        let _ = m.snapshot_bytes.remove_label_values(&[name, &ep]);
        let _ = m.lease_owned.remove_label_values(&[name, &ep]);
        for rank in 0..rt.spec.dp_ranks.max(1) {
            let _ = m
                .subscriber_connected
                .remove_label_values(&[name, &ep, &rank.to_string()]);
        }
    }
    Some(rt)
}

/// Maps a rejected rule to its 400.
pub fn rejected(e: RuleRejected) -> ApiError {
    match e {
        RuleRejected::Malformed(m) => ApiError::BadJson(m),
        RuleRejected::Invalid(p) => ApiError::InvalidRule(p),
    }
}

async fn add_rule(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let raw: Value = parse_json(&body)?;
    let spec = parse_rule(&raw, &state.settings).map_err(rejected)?;
    let (rt, unchanged) = install_shared(&state, spec)?;
    Ok(Json(
        json!({"result": "Success", "id": rt.id, "name": rt.spec.name(), "unchanged": unchanged}),
    ))
}

async fn delete_rule(
    State(state): State<Arc<AppState>>,
    Path((ip, port, proto)): Path<(String, u16, String)>,
) -> Result<Json<Value>, ApiError> {
    let ip: std::net::IpAddr = ip.parse().map_err(|_| {
        ApiError::BadRequest(format!(
            "externalipaddress: got {ip:?}, allowed an IP address"
        ))
    })?;
    let name = format!("{}/{proto}", std::net::SocketAddr::new(ip, port));
    match uninstall_rule(&state, &name) {
        Some(rt) => {
            if let Some(r) = state.replica.get() {
                r.rule_del(&state, &rt);
            }
            Ok(Json(json!({"result": "Success", "id": rt.id})))
        }
        None => Err(ApiError::NotFound(format!("no rule {name}"))),
    }
}

fn contract_json(r: &RuleRuntime) -> Value {
    json!({
        "rule_id": r.id,
        "name": r.spec.name(),
        "vip": r.spec.vip_port(),
        "engine": r.spec.engine.as_str(),
        "algo": r.spec.algo.map(|a| a.as_str()),
        "seed": r.spec.contract().and_then(|c| c.seed),
        "block_size": r.spec.block_size,
        "key_mode": r.spec.key_mode.as_str(),
        "model": r.spec.model,
        "kv_exact_mode": r.spec.exact_mode.as_u8(),
        "kv_enabled": r.spec.kv_enabled(),
    })
}

async fn list_contracts(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"rules": state.rules().iter().map(|r| contract_json(r)).collect::<Vec<_>>()}))
}

async fn contract(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let r = state
        .find(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {id:?}")))?;
    Ok(Json(contract_json(&r)))
}

async fn list_rules(State(state): State<Arc<AppState>>) -> Json<Value> {
    let attrs: Vec<Value> = state
        .rules()
        .iter()
        .map(|r| {
            let mut v = r.spec.raw_json();
            if let Value::Object(m) = &mut v {
                m.insert("id".into(), json!(r.id));
                m.insert("contract".into(), contract_json(r));
            }
            v
        })
        .collect();
    Json(json!({"lbAttr": attrs}))
}

async fn inventory(
    State(state): State<Arc<AppState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let sid = q
        .get("service_id")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            ApiError::BadRequest("service_id is required (rule id or VIP:port)".into())
        })?;
    let ep_raw = q
        .get("ep_idx")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::BadRequest("ep_idx is required (endpoint index from 0)".into()))?;
    let ep: usize = ep_raw.parse().map_err(|_| {
        ApiError::BadRequest(format!(
            "ep_idx: got {ep_raw:?}, allowed a non-negative integer"
        ))
    })?;
    let num = |k: &str, d: usize| -> Result<usize, ApiError> {
        match q.get(k) {
            None => Ok(d),
            Some(v) => v.parse().map_err(|_| {
                ApiError::BadRequest(format!("{k}: got {v:?}, allowed a non-negative integer"))
            }),
        }
    };
    // `offset` is the table position a previous page returned as `next_offset` (`cursor` is
    // accepted as its name too).
    let offset = match q.get("cursor") {
        Some(_) => num("cursor", 0)?,
        None => num("offset", 0)?,
    };
    let limit = num("limit", 1000)?.clamp(1, MAX_PAGE);
    let r = state
        .find(sid)
        .ok_or_else(|| ApiError::NotFound(format!("unknown service_id {sid:?}")))?;
    if ep >= r.eps.len() {
        return Err(ApiError::NotFound(format!(
            "ep_idx {ep} out of range: the rule has {} endpoints",
            r.eps.len()
        )));
    }
    let total = r.index.block_count(EndpointId(ep as u8));
    let page = r.index.blocks(EndpointId(ep as u8), offset, limit);
    let mut found: Vec<(usize, u64)> = page.blocks.iter().map(|(i, k)| (*i, k.0)).collect();
    found.sort_unstable_by_key(|(_, k)| *k);
    let blocks: Vec<Value> = found
        .iter()
        .map(|(i, k)| json!({"block_idx": i, "hash_uint64": k}))
        .collect();
    let next = page.next;
    Ok(Json(json!({
        "service_id": r.id,
        "ep_idx": ep,
        "hash_algo": r.spec.algo.map(|a| a.as_str()),
        "blocks": blocks,
        "total": total,
        "offset": offset,
        "limit": limit,
        "next_offset": next,
    })))
}

/// Liveness plus the detail an operator needs for a 0% hit rate: per endpoint health, subscriber
/// state, block count and parity verdict; per rule the tokenizer problem.
async fn healthz(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut degraded = false;
    let rules: Vec<Value> = state
        .rules()
        .iter()
        .map(|r| {
            let eps: Vec<Value> = r
                .spec
                .endpoints
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let parity = lock(&r.eps[i].parity).clone();
                    degraded |= parity.is_some();
                    json!({
                        "idx": i,
                        "endpoint": e.addr(),
                        "healthy": r.eps[i].healthy.load(Ordering::Relaxed),
                        "connected": r.eps[i].connected.iter().map(|c| c.load(Ordering::Relaxed)).collect::<Vec<_>>(),
                        // Replicated: only the owner subscribes, and reports connection and parity.
                        "owned": r.eps[i].owned.load(Ordering::Relaxed),
                        "blocks": r.index.block_count(EndpointId(i as u8)),
                        "parity": parity,
                    })
                })
                .collect();
            degraded |= r.tokenizer_problem.is_some();
            json!({"id": r.id, "name": r.spec.name(), "engine": r.spec.engine.as_str(), "tokenizer": r.tokenizer_problem, "endpoints": eps})
        })
        .collect();
    let replication = state.replica.get().map(|r| {
        json!({
            "replica": r.id,
            "redis_connected": state.metrics.redis_connected.get() == 1,
        })
    });
    Json(
        json!({"status": if degraded { "degraded" } else { "ok" }, "rules": rules, "replication": replication}),
    )
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.ready.load(Ordering::Relaxed) && !state.cancel.is_cancelled() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // Placement gauges follow every decision: computed when scraped rather than per request.
    for rt in state.rules() {
        rt.publish_placement_gauges(&state.metrics, state.settings.capacity_blocks);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
