//! The HTTP API (axum), all on one listener.
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/route` | filter (bearer with `--route-token-file`) | routing decision ([`route`]) |
//! | `GET /v1/rules`, `GET /v1/rules/{id}/contract` | filter | hash contract per rule |
//! | `POST /v1/rules/{id}/outcomes` | filter (bearer with `--route-token-file`) | predicted against realised reuse ([`outcomes`]) |
//! | `GET /v1/tokenizers/{slug}[/tokenizer_config.json]` | filter | staged tokenizers |
//! | `POST /netlox/v1/config/loadbalancer` | operator (bearer) | add a rule |
//! | `GET /netlox/v1/config/loadbalancer/all` | operator | list rules |
//! | `DELETE /netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}` | operator (bearer) | delete |
//! | `GET /netlox/v1/config/ai/kv/inventory?service_id=&ep_idx=[&offset=&limit=]` | operator | inventory page (bounded: a cursor over the table) |
//! | `/healthz`, `/readyz`, `/metrics` | probes, Prometheus | |
//! | `GET /openapi.json` | anyone | this table as an OpenAPI 3.1 document ([`openapi`]) |
//!
//! Bodies are size-capped; malformed JSON is a 400 through [`error::ApiError`], never a panic.

pub mod error;
pub mod openapi;
pub mod route;
pub mod tokenizers;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use kvroute_core::rule::{
    RawAllowedSource, RawEndpoint, RawRule, RawSecondaryIp, RawServiceArguments,
};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::fleet::{Fleet, Origin, RuleRuntime};
use crate::index::EndpointId;
use crate::offload::TokenizerCache;
use crate::rules::{parse_rule, RuleRejected};
use error::{parse_json, ApiError, ErrorBody};

/// Cap on management bodies (a rule with 1,024 endpoints, the most a rule holds, is 60-110 KiB).
pub const MAX_RULE_BODY: usize = 256 * 1024;
/// Cap on outcome reports (1,024 endpoints at about 200 bytes each).
pub const MAX_OUTCOME_BODY: usize = 512 * 1024;
/// Cap on route bodies (64k keys as JSON numbers).
pub const MAX_ROUTE_BODY: usize = 2 * 1024 * 1024;
/// Largest inventory page.
pub const MAX_PAGE: usize = 10_000;

/// What the handlers share: the fleet, the bearer tokens, the offload tokenizers, readiness.
pub struct ApiState {
    pub fleet: Arc<Fleet>,
    /// Bearer token for management writes; `None` disables writes.
    pub auth_token: Option<String>,
    /// Bearer token `POST /v1/route` requires (`--route-token-file`); `None` leaves it open.
    pub route_token: Option<String>,
    /// Tokenizers loaded for offloaded tokenization (shared with the endpoint picker).
    pub tokenizers: Arc<TokenizerCache>,
    /// Set once the listener is bound; cleared when draining.
    pub ready: AtomicBool,
}

impl ApiState {
    /// Handlers over `fleet`, not yet ready.
    pub fn new(
        fleet: Arc<Fleet>,
        auth_token: Option<String>,
        route_token: Option<String>,
    ) -> ApiState {
        ApiState {
            tokenizers: fleet.tokenizers.clone(),
            fleet,
            auth_token,
            route_token,
            ready: AtomicBool::new(false),
        }
    }
}

/// Builds the router.
pub fn router(state: Arc<ApiState>) -> Router {
    let writes = Router::new()
        .route("/netlox/v1/config/loadbalancer", post(add_rule))
        .route("/v1/rules/{id}/tenants", get(tenants))
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
        .route(
            "/v1/rules/{id}/outcomes",
            post(outcomes).layer(DefaultBodyLimit::max(MAX_OUTCOME_BODY)),
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
        .route("/openapi.json", get(openapi::openapi_json))
        .merge(writes)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .with_state(state)
}

async fn require_bearer(
    State(state): State<Arc<ApiState>>,
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
    State(state): State<Arc<ApiState>>,
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

/// Maps the rule errors of an install (an update kvroute-core refuses) to their 400.
pub fn invalid(e: kvroute_core::rule::RuleErrors) -> ApiError {
    ApiError::InvalidRule(e.0)
}

/// Maps a rejected rule to its 400.
pub fn rejected(e: RuleRejected) -> ApiError {
    match e {
        RuleRejected::Malformed(m) => ApiError::BadJson(m),
        RuleRejected::Invalid(p) => ApiError::InvalidRule(p),
    }
}

/// `POST /netlox/v1/config/loadbalancer` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct RuleAdded {
    /// Always `Success`.
    pub result: String,
    pub id: u32,
    /// `VIP:port/protocol`.
    pub name: String,
    /// The same rule was already installed: nothing was restarted or shared.
    pub unchanged: bool,
}

/// `DELETE .../externalipaddress/{ip}/port/{port}/protocol/{proto}` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct RuleDeleted {
    /// Always `Success`.
    pub result: String,
    pub id: u32,
}

#[utoipa::path(
    post,
    path = "/netlox/v1/config/loadbalancer",
    tag = "management",
    summary = "Add or replace a rule (loxilb LoadbalanceEntry shape)",
    request_body = RawRule,
    responses(
        (status = 200, description = "Installed (or already installed unchanged)", body = RuleAdded),
        (status = 400, description = "Malformed JSON or invalid rule (every rejected field in `problems`)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 413, description = "Body over the management body cap"),
    ),
    security(("management_token" = [])),
)]
async fn add_rule(
    State(state): State<Arc<ApiState>>,
    body: Bytes,
) -> Result<Json<RuleAdded>, ApiError> {
    let raw: Value = parse_json(&body)?;
    let spec = parse_rule(&raw, &state.fleet.settings).map_err(rejected)?;
    let done = state.fleet.install(spec, Origin::Local).map_err(invalid)?;
    Ok(Json(RuleAdded {
        result: "Success".into(),
        id: done.rule.id,
        name: done.rule.spec.name(),
        unchanged: done.unchanged,
    }))
}

#[utoipa::path(
    delete,
    path = "/netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}",
    tag = "management",
    summary = "Delete a rule",
    params(
        ("ip" = String, Path, description = "The rule's VIP"),
        ("port" = u16, Path, description = "The rule's port"),
        ("proto" = String, Path, description = "The rule's protocol (`tcp`)"),
    ),
    responses(
        (status = 200, description = "Deleted", body = RuleDeleted),
        (status = 400, description = "`ip` is not an IP address or `port` not a port", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such rule", body = ErrorBody),
    ),
    security(("management_token" = [])),
)]
async fn delete_rule(
    State(state): State<Arc<ApiState>>,
    Path((ip, port, proto)): Path<(String, u16, String)>,
) -> Result<Json<RuleDeleted>, ApiError> {
    let ip: std::net::IpAddr = ip.parse().map_err(|_| {
        ApiError::BadRequest(format!(
            "externalipaddress: got {ip:?}, allowed an IP address"
        ))
    })?;
    let name = format!("{}/{proto}", std::net::SocketAddr::new(ip, port));
    match state.fleet.uninstall(&name, Origin::Local) {
        Some(rt) => Ok(Json(RuleDeleted {
            result: "Success".into(),
            id: rt.id,
        })),
        None => Err(ApiError::NotFound(format!("no rule {name}"))),
    }
}

pub use kvroute_core::wire::{RuleContract, RuleContracts};

/// One installed rule as `GET /netlox/v1/config/loadbalancer/all` lists it: the rule in its
/// canonical loxilb shape (the `RawRule` fields), its id and its contract.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListedRule {
    pub service_arguments: RawServiceArguments,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<RawEndpoint>>,
    #[serde(rename = "secondaryIPs", skip_serializing_if = "Option::is_none")]
    pub secondary_ips: Option<Vec<RawSecondaryIp>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_sources: Option<Vec<RawAllowedSource>>,
    pub id: u32,
    pub contract: RuleContract,
}

/// `GET /netlox/v1/config/loadbalancer/all` answer (loxilb's `lbAttr` list).
#[derive(Debug, Serialize, ToSchema)]
pub struct RuleList {
    #[serde(rename = "lbAttr")]
    pub lb_attr: Vec<ListedRule>,
}

fn contract_json(r: &RuleRuntime) -> RuleContract {
    RuleContract {
        rule_id: r.id,
        name: r.spec.name(),
        vip: r.spec.vip_port(),
        engine: r.spec.engine.as_str().into(),
        algo: r.spec.algo.map(|a| a.as_str().into()),
        seed: r.spec.contract().and_then(|c| c.seed),
        block_size: r.spec.block_size,
        key_mode: r.spec.key_mode.as_str().into(),
        model: r.spec.model.clone(),
        extra_keys: r
            .spec
            .contract()
            .map(|c| c.extra_layout)
            .filter(|l| *l != kvroute_core::hash::ExtraKeysLayout::Tagged)
            .map(|l| l.as_str().to_owned()),
        kv_exact_mode: r.spec.exact_mode.code(),
        kv_enabled: r.spec.kv_enabled(),
        route_content_types: vec![
            "application/json".into(),
            kvroute_core::wire::binary::CONTENT_TYPE.into(),
        ],
    }
}

#[utoipa::path(
    get,
    path = "/v1/rules",
    tag = "routing",
    summary = "Hash contract of every installed rule",
    responses((status = 200, description = "Contracts", body = RuleContracts)),
)]
async fn list_contracts(State(state): State<Arc<ApiState>>) -> Json<RuleContracts> {
    Json(RuleContracts {
        rules: state
            .fleet
            .rules()
            .iter()
            .map(|r| contract_json(r))
            .collect(),
    })
}

#[utoipa::path(
    get,
    path = "/v1/rules/{id}/contract",
    tag = "routing",
    summary = "Hash contract of one rule",
    params(("id" = String, Path, description = "Rule id or `VIP:port`")),
    responses(
        (status = 200, description = "Contract", body = RuleContract),
        (status = 404, description = "Unknown rule", body = ErrorBody),
    ),
)]
async fn contract(
    State(state): State<Arc<ApiState>>,
    Path(id): Path<String>,
) -> Result<Json<RuleContract>, ApiError> {
    let r = state
        .fleet
        .find(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {id:?}")))?;
    Ok(Json(contract_json(&r)))
}

#[utoipa::path(
    get,
    path = "/netlox/v1/config/loadbalancer/all",
    tag = "management",
    summary = "Every installed rule",
    responses((status = 200, description = "Rules", body = RuleList)),
)]
async fn list_rules(State(state): State<Arc<ApiState>>) -> Json<RuleList> {
    let lb_attr = state
        .fleet
        .rules()
        .iter()
        .map(|r| {
            let raw = r.spec.rule.to_raw();
            ListedRule {
                service_arguments: raw.service_arguments,
                endpoints: raw.endpoints,
                secondary_ips: raw.secondary_ips,
                allowed_sources: raw.allowed_sources,
                id: r.id,
                contract: contract_json(r),
            }
        })
        .collect();
    Json(RuleList { lb_attr })
}

/// One stored block of an inventory page.
#[derive(Debug, Serialize, ToSchema)]
pub struct InventoryBlock {
    /// Position in the endpoint's table.
    pub block_idx: usize,
    pub hash_uint64: u64,
}

/// `GET /netlox/v1/config/ai/kv/inventory` answer: one page of an endpoint's stored blocks.
#[derive(Debug, Serialize, ToSchema)]
pub struct InventoryPage {
    pub service_id: u32,
    pub ep_idx: usize,
    pub hash_algo: Option<String>,
    /// Sorted by `hash_uint64`.
    pub blocks: Vec<InventoryBlock>,
    /// Blocks the endpoint stores.
    pub total: u64,
    pub offset: usize,
    pub limit: usize,
    /// `offset` of the next page; null on the last page.
    pub next_offset: Option<usize>,
}

#[utoipa::path(
    get,
    path = "/netlox/v1/config/ai/kv/inventory",
    tag = "management",
    summary = "One page of an endpoint's stored blocks",
    params(
        ("service_id" = String, Query, description = "Rule id or `VIP:port`"),
        ("ep_idx" = usize, Query, description = "Endpoint index from 0"),
        ("offset" = Option<usize>, Query, description = "Table position a previous page returned as `next_offset` (default 0)"),
        ("cursor" = Option<usize>, Query, description = "Another name of `offset`"),
        ("limit" = Option<usize>, Query, description = "Page size, 1 to 10000 (default 1000)"),
    ),
    responses(
        (status = 200, description = "Page", body = InventoryPage),
        (status = 400, description = "Missing or non-numeric parameter", body = ErrorBody),
        (status = 404, description = "Unknown service_id or ep_idx out of range", body = ErrorBody),
    ),
)]
async fn inventory(
    State(state): State<Arc<ApiState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<InventoryPage>, ApiError> {
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
    let r = state.fleet.find(sid).ok_or_else(|| match sid.as_str() {
        // loxilb's docs query the first rule as service_id=0.
        "0" => ApiError::NotFound(
            "unknown service_id \"0\": kvroute numbers rules from 1 (loxilb from 0); use the \
                 id the rule was created with (GET /netlox/v1/config/loadbalancer/all) or VIP:port"
                .into(),
        ),
        _ => ApiError::NotFound(format!("unknown service_id {sid:?}")),
    })?;
    if ep >= r.eps().len() {
        return Err(ApiError::NotFound(format!(
            "ep_idx {ep} out of range: the rule has {} endpoints",
            r.eps().len()
        )));
    }
    let total = r.block_count(EndpointId(ep as u16));
    let page = r.blocks(EndpointId(ep as u16), offset, limit);
    let mut found: Vec<(usize, u64)> = page.blocks.iter().map(|(i, k)| (*i, k.0)).collect();
    found.sort_unstable_by_key(|(_, k)| *k);
    let blocks = found
        .iter()
        .map(|&(block_idx, hash_uint64)| InventoryBlock {
            block_idx,
            hash_uint64,
        })
        .collect();
    Ok(Json(InventoryPage {
        service_id: r.id,
        ep_idx: ep,
        hash_algo: r.spec.algo.map(|a| a.as_str().into()),
        blocks,
        total,
        offset,
        limit,
        next_offset: page.next,
    }))
}

/// `GET /healthz` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or `degraded` when a parity check or the parity canary failed, an endpoint diverges
    /// or a tokenizer is missing.
    pub status: String,
    pub rules: Vec<RuleHealth>,
    /// Null without `--redis-url`.
    pub replication: Option<ReplicationHealth>,
}

/// One rule in `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct RuleHealth {
    pub id: u32,
    pub name: String,
    pub engine: String,
    /// Why the rule's tokenizer is unusable; null when it is fine or not needed.
    pub tokenizer: Option<String>,
    pub endpoints: Vec<EndpointHealth>,
}

/// One endpoint in `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointHealth {
    pub idx: usize,
    /// `ip:port`.
    pub endpoint: String,
    pub healthy: bool,
    /// Per DP rank: the KV event subscriber is connected.
    pub connected: Vec<bool>,
    /// Replicated: this replica owns (subscribes to) the endpoint.
    pub owned: bool,
    pub blocks: u64,
    /// The hash parity self-check's verdict when the engine's keys do not match the contract.
    pub parity: Option<crate::fleet::ParityReport>,
    /// `unchecked` until a BlockStored with token ids was checked, then `match` or `mismatch`
    /// (the latest check).
    pub parity_status: crate::fleet::ParityStatus,
    /// Parity self-checks run on this endpoint's events (matched + mismatched).
    pub parity_checks: u64,
    /// Of which mismatched.
    pub parity_mismatches: u64,
    /// The filters' predicted-against-realised reports within `KVROUTE_DIVERGENCE_WINDOW_MS`
    /// (absent before the first report).
    pub outcomes: Option<kvroute_core::wire::EndpointOutcomes>,
    /// Present while the endpoint diverges: its engine reused no block for most responses
    /// predicted to reuse 2 or more; the probable cause.
    pub divergence: Option<String>,
    /// The parity canary's latest run on the endpoint (absent with `KVROUTE_CANARY_INTERVAL_MS`
    /// 0, before its first run, or on a replica that does not ingest the endpoint).
    pub canary: Option<crate::fleet::CanaryVerdict>,
}

/// `POST /v1/rules/{id}/outcomes` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct OutcomesApplied {
    /// Endpoints of the rule the report named.
    pub endpoints: usize,
    /// Endpoints it named that the rule does not have (ignored).
    pub unknown: usize,
}

/// A filter's report of what the engines reused of what the route answers predicted.
#[utoipa::path(
    post,
    path = "/v1/rules/{id}/outcomes",
    tag = "routing",
    summary = "Predicted against realised reuse, per endpoint",
    description = "Sent by the filter every `report_ms` with the sums since its last report. The service keeps each endpoint's reports for `KVROUTE_DIVERGENCE_WINDOW_MS` and judges it divergent when its engine reused no block for 80% of at least `KVROUTE_DIVERGENCE_MIN_REQUESTS` responses predicted to reuse 2 or more; `/healthz` says so and names the probable cause. A bearer token is required only with `--route-token-file`.",
    params(("id" = String, Path, description = "Rule id or `VIP:port`")),
    request_body = kvroute_core::wire::OutcomeReport,
    responses(
        (status = 200, description = "Applied", body = OutcomesApplied),
        (status = 400, description = "Malformed body, or more endpoints than a rule holds", body = ErrorBody),
        (status = 401, description = "Missing or wrong route token (with `--route-token-file`)", body = ErrorBody),
        (status = 404, description = "Unknown rule", body = ErrorBody),
        (status = 413, description = "Body over the cap"),
    ),
    security((), ("route_token" = [])),
)]
async fn outcomes(
    State(state): State<Arc<ApiState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<OutcomesApplied>, ApiError> {
    let r = state
        .fleet
        .find(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {id:?}")))?;
    let report: kvroute_core::wire::OutcomeReport = parse_json(&body)?;
    let max = kvroute_core::wire::MAX_OUTCOME_ENDPOINTS;
    if report.endpoints.len() > max {
        return Err(ApiError::BadRequest(format!(
            "endpoints: {} entries, at most {max}",
            report.endpoints.len()
        )));
    }
    let max = kvroute_core::wire::MAX_OUTCOME_TENANTS;
    if report.tenants.len() > max {
        return Err(ApiError::BadRequest(format!(
            "tenants: {} entries, at most {max}",
            report.tenants.len()
        )));
    }
    let long = kvroute_core::wire::MAX_TENANT_NAME;
    for (i, t) in report.tenants.iter().enumerate() {
        let model = t.model.as_deref().unwrap_or_default();
        for (field, v) in [("tenant", t.tenant.as_str()), ("model", model)] {
            if v.len() > long {
                return Err(ApiError::BadRequest(format!(
                    "tenants[{i}].{field}: {} bytes, at most {long}",
                    v.len()
                )));
            }
        }
    }
    let a = state
        .fleet
        .record_outcomes(&r, &report, std::time::Instant::now());
    Ok(Json(OutcomesApplied {
        endpoints: a.endpoints,
        unknown: a.unknown,
    }))
}

/// `GET /v1/rules/{id}/tenants` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Tenants {
    /// The rule's name.
    pub rule: String,
    /// Most prompt tokens first; `(other)` sums the tenants past `KVROUTE_TENANTS_MAX`.
    pub tenants: Vec<TenantRow>,
}

/// One tenant in `GET /v1/rules/{id}/tenants`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantRow {
    #[serde(flatten)]
    pub usage: kvroute_core::wire::TenantUsage,
    /// `cached_tokens / prompt_tokens` (0 without prompt tokens).
    pub cached_ratio: f64,
}

/// Each tenant's prompt tokens and the tokens its engines served from cache, as the filters
/// report them.
#[utoipa::path(
    get,
    path = "/v1/rules/{id}/tenants",
    tag = "management",
    summary = "Cached and uncached prompt tokens per tenant",
    description = "Summed on this replica since the rule was installed, from the filters' outcome reports (each replica sums the reports its own gateways send: add the replicas' answers). The tenant is the tenant part of the request's affinity key (`user:<user>`, `user#<hash>`, `key:<hash>` or `ip:<client>`), with the model under `KVROUTE_AFFINITY_SCOPE=tenant_model`. At most `KVROUTE_TENANTS_MAX` tenants; tenants past it are summed as `(other)`. Needs the management token: tenants are named.",
    params(("id" = String, Path, description = "Rule id or `VIP:port`")),
    responses(
        (status = 200, description = "Tenants", body = Tenants),
        (status = 401, description = "Missing or wrong management token", body = ErrorBody),
        (status = 404, description = "Unknown rule", body = ErrorBody),
    ),
    security(("management_token" = [])),
)]
async fn tenants(
    State(state): State<Arc<ApiState>>,
    Path(id): Path<String>,
) -> Result<Json<Tenants>, ApiError> {
    let r = state
        .fleet
        .find(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown rule {id:?}")))?;
    let tenants = r
        .tenants()
        .into_iter()
        .map(|usage| TenantRow {
            cached_ratio: match usage.prompt_tokens {
                0 => 0.0,
                p => usage.cached_tokens as f64 / p as f64,
            },
            usage,
        })
        .collect();
    Ok(Json(Tenants {
        rule: r.spec.name(),
        tenants,
    }))
}

/// Replication state in `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplicationHealth {
    pub replica: String,
    pub redis_connected: bool,
}

/// Liveness plus the detail an operator needs for a 0% hit rate: per endpoint health, subscriber
/// state, block count, parity verdict and predicted-against-realised reuse; per rule the
/// tokenizer problem.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "probes",
    summary = "Liveness with per rule and per endpoint detail",
    responses((status = 200, description = "Alive (see `status`)", body = Health)),
)]
async fn healthz(State(state): State<Arc<ApiState>>) -> Json<Health> {
    let mut degraded = false;
    let now = std::time::Instant::now();
    let fleet = &state.fleet;
    let rules = fleet
        .rules()
        .iter()
        .map(|r| {
            let endpoints = r
                .spec
                .endpoints
                .iter()
                .zip(r.eps())
                .enumerate()
                .map(|(i, (e, rt))| {
                    let parity = rt.parity();
                    let (parity_status, matched, mismatched) = rt.parity_status();
                    degraded |= parity.is_some();
                    let (sum, divergent) = rt.outcomes(now, &fleet.settings.divergence);
                    degraded |= divergent;
                    let canary = rt.canary();
                    degraded |= canary.as_ref().is_some_and(|c| c.verdict.failing());
                    EndpointHealth {
                        idx: i,
                        endpoint: e.addr(),
                        healthy: rt.healthy(),
                        connected: rt.connected(),
                        // Replicated: only the owner subscribes, and reports connection and parity.
                        owned: rt.owned(),
                        blocks: r.block_count(EndpointId(i as u16)),
                        parity,
                        parity_status,
                        parity_checks: matched + mismatched,
                        parity_mismatches: mismatched,
                        outcomes: (sum.judged > 0).then(|| kvroute_core::wire::EndpointOutcomes {
                            endpoint: e.addr(),
                            ..sum
                        }),
                        divergence: divergent.then(|| crate::fleet::divergence_cause(rt)),
                        canary,
                    }
                })
                .collect();
            degraded |= r.tokenizer_problem().is_some();
            RuleHealth {
                id: r.id,
                name: r.spec.name(),
                engine: r.spec.engine.as_str().into(),
                tokenizer: r.tokenizer_problem().map(str::to_owned),
                endpoints,
            }
        })
        .collect();
    let replication = fleet.replica_id().map(|id| ReplicationHealth {
        replica: id.to_owned(),
        redis_connected: fleet.metrics.redis_connected.get() == 1,
    });
    Json(Health {
        status: if degraded { "degraded" } else { "ok" }.into(),
        rules,
        replication,
    })
}

#[utoipa::path(
    get,
    path = "/readyz",
    tag = "probes",
    summary = "Readiness",
    responses(
        (status = 200, description = "Ready", content_type = "text/plain", body = String),
        (status = 503, description = "Starting or shutting down", content_type = "text/plain", body = String),
    ),
)]
async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    if state.ready.load(Ordering::Relaxed) && !state.fleet.cancel.is_cancelled() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "probes",
    summary = "Prometheus metrics",
    responses((status = 200, description = "Prometheus text exposition 0.0.4", content_type = "text/plain", body = String)),
)]
async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    // Placement gauges follow every decision: computed when scraped rather than per request.
    let fleet = &state.fleet;
    let now = std::time::Instant::now();
    for rt in fleet.rules() {
        rt.publish_placement_gauges(&fleet.metrics, fleet.settings.capacity_blocks);
        rt.publish_divergence_gauges(&fleet.metrics, &fleet.settings.divergence, now);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        fleet.metrics.render(),
    )
        .into_response()
}
