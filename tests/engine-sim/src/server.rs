//! The HTTP surface: the OpenAI API, health, metrics, engine-specific endpoints and debug views.
//!
//! | route | engine | what |
//! |---|---|---|
//! | `POST /v1/completions`, `POST /v1/chat/completions` | all | OpenAI, JSON or SSE (`stream: true`) |
//! | `POST /v1/messages` | all | Anthropic Messages, JSON or its SSE events; usage with `cache_read_input_tokens` |
//! | `GET /v1/models`, `GET /health` | all | as vLLM |
//! | `GET /metrics` | all | the engine's own metric names ([`crate::metrics`]) |
//! | `GET /server_info`, `GET /get_server_info`, `GET /model_info`, `GET /get_model_info` | all | SGLang's (page size, model path) |
//! | `POST /kv_cache_events` | trtllm | drains the event queue (JSON envelopes) |
//! | `POST /reset_prefix_cache` | all | forgets every cached block (`AllBlocksCleared`); `?reset_external=true` the CPU tier's too |
//! | `GET /debug/cache` | all | per-rank block counters (and the CPU tier's) |
//! | `GET /debug/cache/match?keys=K1,K2` | all | leading blocks cached, per rank, and the CPU tier's continuation |
//! | `POST /debug/cache/match` | all | same for an OpenAI body (the simulator tokenizes it) |
//!
//! Every response carries `x-kvroute-sim: <name>` so tests and the benchmark see who served.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_core::hash::{BlockKey, Engine as EngineKind};
use kvroute_core::prompt::Endpoint;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{lock, Engine, SimError, Usage};
use crate::events::{trtllm_created, trtllm_envelope, KvEvent};
use crate::prompt::{hash_view, Encoded};

/// The response header naming the simulator.
pub const SIM_HEADER: &str = "x-kvroute-sim";

/// The request header the kvroute filter writes with the matched blocks it routed on; the
/// simulator echoes it in its response so a benchmark client behind a gateway can judge the
/// gateway's prediction against the response's `cached_tokens`.
pub const MATCHED_HEADER: &str = "x-kvroute-matched-blocks";

/// The router over a running engine.
pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/get_model_info", get(model_info))
        .route("/model_info", get(model_info))
        .route("/kv_cache_events", post(kv_cache_events))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/debug/cache", get(debug_cache))
        .route("/debug/cache/match", get(match_keys).post(match_body))
        .layer(axum::middleware::from_fn_with_state(
            engine.clone(),
            name_header,
        ))
        .with_state(engine)
}

async fn name_header(State(engine): State<Arc<Engine>>, req: Request, next: Next) -> Response {
    let matched = req.headers().get(MATCHED_HEADER).cloned();
    let mut res = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&engine.name) {
        res.headers_mut().insert(SIM_HEADER, v);
    }
    if let Some(m) = matched {
        res.headers_mut().insert(MATCHED_HEADER, m);
    }
    res
}

/// An OpenAI-shaped error.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.0.is_client_error() {
            "BadRequestError"
        } else {
            "InternalServerError"
        };
        (self.0, Json(json!({"error": {"message": self.1, "type": kind, "param": null, "code": self.0.as_u16()}}))).into_response()
    }
}

impl From<SimError> for ApiError {
    fn from(e: SimError) -> Self {
        let status = match e {
            SimError::Shutdown => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError(status, e.to_string())
    }
}

async fn encode(
    engine: &Arc<Engine>,
    body: Bytes,
    endpoint: Endpoint,
) -> Result<Encoded, ApiError> {
    let e = engine.clone();
    // Tokenizing is CPU work: keep it off the reactor.
    let ignore_salt = engine.cfg.ignore_cache_salt;
    tokio::task::spawn_blocking(move || {
        e.encoder.encode(&body, endpoint).map(|mut enc| {
            if ignore_salt {
                enc.cache_salt = None;
            }
            enc
        })
    })
    .await
    .map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("tokenizer task failed: {e}"),
        )
    })?
    .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))
}

async fn completions(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    serve(engine, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    serve(engine, body, Endpoint::ChatCompletions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Anthropic Messages, as vLLM serves them: the body converted to a chat request
/// (kvroute-core's conversion, vLLM's rules), the answer and its usage in Anthropic's shape
/// (`input_tokens` = prompt tokens not read from the cache), streamed as Anthropic's events.
async fn messages(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    serve_messages(engine, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn anthropic_usage(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens})
}

async fn serve_messages(engine: Arc<Engine>, body: Bytes) -> Result<Response, ApiError> {
    let enc = encode(&engine, body, Endpoint::Messages).await?;
    let model = enc
        .model
        .clone()
        .unwrap_or_else(|| engine.cfg.model.clone());
    let stream = enc.stream;
    let mut rx = spawn_request(engine.clone(), enc);
    admitted(&mut rx).await?;
    let id = format!("msg_sim{}", engine.next_id());
    let mut text = String::new();
    let mut usage = None;
    let mut events = String::new();
    let event = |out: &mut String, name: &str, v: Value| {
        out.push_str(&format!("event: {name}\ndata: {v}\n\n"));
    };
    event(
        &mut events,
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
               "model": model, "content": [], "stop_reason": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
    );
    event(
        &mut events,
        "content_block_start",
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    );
    while let Some(p) = rx.recv().await {
        match p {
            Piece::Word(w) => {
                event(
                    &mut events,
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}),
                );
                text.push_str(&w);
            }
            Piece::Done(u) => usage = Some(u),
            Piece::Admitted | Piece::Failed(_) => {}
        }
    }
    let usage = usage.ok_or_else(ended_early)?;
    if !stream {
        return Ok(Json(json!({"id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens", "stop_sequence": null,
            "usage": anthropic_usage(&usage)}))
        .into_response());
    }
    // The whole answer in one body: the simulator's timing is in when the body starts, and a
    // client reads the same events.
    event(
        &mut events,
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    );
    event(
        &mut events,
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
               "usage": anthropic_usage(&usage)}),
    );
    event(&mut events, "message_stop", json!({"type": "message_stop"}));
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from(events))
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// Waits until the request holds a slot and its KV blocks (or could not be admitted).
async fn admitted(rx: &mut mpsc::Receiver<Piece>) -> Result<(), ApiError> {
    match rx.recv().await {
        Some(Piece::Admitted) => Ok(()),
        Some(Piece::Failed(e)) => Err(e.into()),
        _ => Err(ended_early()),
    }
}

fn ended_early() -> ApiError {
    ApiError(
        StatusCode::INTERNAL_SERVER_ERROR,
        "request task ended early".into(),
    )
}

/// What the request task reports, in order.
enum Piece {
    /// Holding a slot and KV blocks.
    Admitted,
    /// One decoded word.
    Word(String),
    /// Finished.
    Done(Usage),
    /// Could not be admitted.
    Failed(SimError),
}

/// Runs the request in its own task (a client that goes away does not cancel the step midway)
/// and reports its progress.
fn spawn_request(engine: Arc<Engine>, enc: Encoded) -> mpsc::Receiver<Piece> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut a = match engine.admit(enc).await {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(Piece::Failed(e)).await;
                return;
            }
        };
        if tx.send(Piece::Admitted).await.is_err() {
            return;
        }
        a.prefill().await;
        let words = a.take_words(tokio::time::Instant::now());
        for (i, (w, deadline)) in words.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep_until(deadline).await;
            }
            let piece = if i == 0 { w } else { format!(" {w}") };
            if tx.send(Piece::Word(piece)).await.is_err() {
                // The client left: abort like an engine does (blocks released on drop).
                return;
            }
        }
        let usage = a.finish();
        let _ = tx.send(Piece::Done(usage)).await;
    });
    rx
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
           "completion_tokens": u.completion_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

async fn serve(engine: Arc<Engine>, body: Bytes, endpoint: Endpoint) -> Result<Response, ApiError> {
    let enc = encode(&engine, body, endpoint).await?;
    let model = enc
        .model
        .clone()
        .unwrap_or_else(|| engine.cfg.model.clone());
    let stream = enc.stream;
    let include_usage = enc.include_usage.unwrap_or(true);
    let mut rx = spawn_request(engine.clone(), enc);
    admitted(&mut rx).await?;
    let chat = endpoint == Endpoint::ChatCompletions;
    let id = format!(
        "{}-sim-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        engine.next_id()
    );
    let created = Engine::unix_now() as u64;
    if !stream {
        let mut text = String::new();
        let mut usage = None;
        while let Some(p) = rx.recv().await {
            match p {
                Piece::Word(w) => text.push_str(&w),
                Piece::Done(u) => usage = Some(u),
                Piece::Admitted | Piece::Failed(_) => {}
            }
        }
        let usage = usage.ok_or_else(ended_early)?;
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []}, "logprobs": null,
                   "finish_reason": "length", "stop_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
        };
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        return Ok(Json(
            json!({"id": id, "object": object, "created": created, "model": model,
                               "choices": [choice], "usage": usage_json(&usage)}),
        )
        .into_response());
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let sse = move |v: Value| {
        Ok::<Bytes, std::convert::Infallible>(Bytes::from(format!("data: {v}\n\n")))
    };
    let stream = futures::stream::unfold((rx, true, false), move |(mut rx, first, done)| {
        let id = id.clone();
        let model = model.clone();
        async move {
            if done {
                return None;
            }
            let choice = |delta: Value, finish: Value| {
                if chat {
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null,
                           "finish_reason": finish, "stop_reason": null})
                }
            };
            let chunk = |choices: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
            match rx.recv().await {
                Some(Piece::Word(w)) => {
                    let delta = if first && chat {
                        json!({"role": "assistant", "content": w})
                    } else {
                        json!({"content": w})
                    };
                    Some((
                        sse(chunk(json!([choice(delta, Value::Null)]))),
                        (rx, false, false),
                    ))
                }
                Some(Piece::Done(u)) => {
                    let mut out = format!(
                        "data: {}\n\n",
                        chunk(json!([choice(json!({"content": ""}), json!("length"))]))
                    );
                    if include_usage {
                        let mut c = chunk(json!([]));
                        if let Value::Object(m) = &mut c {
                            m.insert("usage".into(), usage_json(&u));
                        }
                        out.push_str(&format!("data: {c}\n\n"));
                    }
                    out.push_str("data: [DONE]\n\n");
                    Some((Ok(Bytes::from(out)), (rx, false, true)))
                }
                Some(Piece::Admitted | Piece::Failed(_)) => {
                    Some((Ok(Bytes::new()), (rx, first, false)))
                }
                None => None,
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn models(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let m = &engine.cfg.model;
    Json(
        json!({"object": "list", "data": [{"id": m, "object": "model", "created": Engine::unix_now() as u64,
        "owned_by": engine.cfg.engine.as_str(), "root": m, "parent": null,
        "max_model_len": engine.cfg.kv_blocks * engine.cfg.contract.block_size.get()}]}),
    )
}

async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    let (ct, body) = crate::metrics::render(&engine);
    ([("content-type", ct)], body).into_response()
}

async fn server_info(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let path = model_path(&engine);
    Json(
        json!({"model_path": path, "tokenizer_path": path, "served_model_name": engine.cfg.model,
        "page_size": engine.cfg.contract.block_size.get(), "dp_size": engine.cfg.dp_ranks,
        "max_running_requests": engine.cfg.max_concurrency, "max_total_num_tokens": engine.cfg.kv_blocks * engine.cfg.contract.block_size.get(),
        "kv_events_config": engine.cfg.zmq_port.map(|p| json!({"publisher": "zmq", "endpoint": format!("tcp://*:{p}"), "topic": engine.cfg.topic})),
        "engine": engine.cfg.engine.as_str(), "hash_algo": engine.cfg.contract.algo.as_str(), "sim_name": engine.name}),
    )
}

async fn model_info(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let path = model_path(&engine);
    Json(json!({"model_path": path, "tokenizer_path": path, "is_generation": true}))
}

fn model_path(engine: &Engine) -> String {
    engine
        .cfg
        .tokenizer_dir
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| engine.cfg.model.clone())
}

/// TensorRT-LLM's drain: every pending event of every rank, then the queue is empty.
async fn kv_cache_events(State(engine): State<Arc<Engine>>) -> Result<Json<Value>, ApiError> {
    if engine.cfg.engine != EngineKind::Trtllm {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "/kv_cache_events is served in --engine trtllm only".into(),
        ));
    }
    let bs = engine.cfg.contract.block_size.get();
    let window = (engine.cfg.kv_blocks * bs) as u32;
    let multi = engine.ranks.len() > 1;
    let mut out = Vec::new();
    for r in &engine.ranks {
        let rank = multi.then_some(r.idx);
        for (id, e) in lock(&r.kv).take_events() {
            let Some(sliding) = engine.cfg.sliding_window else {
                match e {
                    KvEvent::Cleared => {
                        out.push(trtllm_created(id, engine.cfg.kv_blocks, window, rank))
                    }
                    other => out.extend(trtllm_envelope(id, &other, window, rank)),
                }
                continue;
            };
            // Variable sliding-window attention: the full window's event, then the sliding
            // window's copy of a store and its removal of the blocks before the window.
            let next = || r.trtllm_next_id.fetch_add(1, Ordering::Relaxed);
            let sliding_window = (sliding * bs) as u32;
            match &e {
                KvEvent::Cleared => {
                    out.push(trtllm_created(next(), engine.cfg.kv_blocks, window, rank))
                }
                KvEvent::Stored { keys, .. } => {
                    out.extend(trtllm_envelope(next(), &e, window, rank));
                    out.extend(trtllm_envelope(next(), &e, sliding_window, rank));
                    let outside = keys.len().saturating_sub(sliding);
                    if outside > 0 {
                        let gone = KvEvent::Removed {
                            keys: keys[..outside].to_vec(),
                        };
                        out.extend(trtllm_envelope(next(), &gone, sliding_window, rank));
                    }
                }
                KvEvent::Removed { .. } => {
                    out.extend(trtllm_envelope(next(), &e, window, rank));
                    out.extend(trtllm_envelope(next(), &e, sliding_window, rank));
                }
                // The CPU tier is vLLM's: never recorded here.
                KvEvent::CpuStored { .. } | KvEvent::CpuRemoved { .. } => {}
            }
        }
    }
    Ok(Json(Value::Array(out)))
}

/// `?reset_external=true` (vLLM's query parameter) also forgets the CPU tier.
async fn reset_prefix_cache(
    State(engine): State<Arc<Engine>>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> StatusCode {
    let external = q.get("reset_external").is_some_and(|v| {
        ["true", "1", "yes", "on"]
            .iter()
            .any(|t| v.eq_ignore_ascii_case(t))
    });
    engine.reset_prefix_cache(external);
    StatusCode::OK
}

async fn debug_cache(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let ranks: Vec<Value> = engine
        .ranks
        .iter()
        .map(|r| json!(lock(&r.kv).stats()))
        .collect();
    Json(
        json!({"name": engine.name, "engine": engine.cfg.engine.as_str(), "block_size": engine.cfg.contract.block_size.get(),
        "hash_algo": engine.cfg.contract.algo.as_str(), "running": engine.running.load(Ordering::Relaxed),
        "waiting": engine.waiting.load(Ordering::Relaxed), "ranks": ranks}),
    )
}

#[derive(serde::Deserialize)]
struct KeysQuery {
    keys: String,
}

async fn match_keys(
    State(engine): State<Arc<Engine>>,
    Query(q): Query<KeysQuery>,
) -> Result<Json<Value>, ApiError> {
    let keys = q
        .keys
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u64>()
                .map(BlockKey)
                .or_else(|_| s.parse::<i64>().map(BlockKey::from_i64))
                .map_err(|_| {
                    ApiError(
                        StatusCode::BAD_REQUEST,
                        format!("keys: {s:?} is not a u64 or i64 block key"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = tier_match(&engine.match_keys(&keys));
    if let Value::Object(m) = &mut out {
        add_queue(m, &engine);
    }
    Ok(Json(out))
}

/// `matched_blocks` (the longest GPU match over ranks) and `per_rank`; `cpu_matched_blocks`
/// (the blocks the CPU tier holds right after the GPU match, on the first rank with the
/// longest GPU match: `matched_blocks + cpu_matched_blocks` is one rank's two-tier prefix) and
/// `cpu_per_rank`.
fn tier_match(tiers: &[(usize, usize)]) -> Value {
    let per_rank: Vec<usize> = tiers.iter().map(|t| t.0).collect();
    let cpu_per_rank: Vec<usize> = tiers.iter().map(|t| t.1).collect();
    let (best, cpu) = tiers
        .iter()
        .rev()
        .max_by_key(|t| t.0)
        .copied()
        .unwrap_or_default();
    json!({"matched_blocks": best, "per_rank": per_rank, "cpu_matched_blocks": cpu, "cpu_per_rank": cpu_per_rank})
}

/// Adds the engine's running and waiting request counts to a `/debug/cache/match` answer.
fn add_queue(m: &mut serde_json::Map<String, Value>, engine: &Engine) {
    m.insert(
        "running".into(),
        engine.running.load(Ordering::Relaxed).into(),
    );
    m.insert(
        "waiting".into(),
        engine.waiting.load(Ordering::Relaxed).into(),
    );
}

/// The oracle's question: how much of this request would hit here, and how busy is the engine.
/// `?api=anthropic` reads an Anthropic Messages body; otherwise `messages` means chat.
async fn match_body(
    State(engine): State<Arc<Engine>>,
    Query(q): Query<std::collections::HashMap<String, String>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let endpoint = match serde_json::from_slice::<Value>(&body) {
        _ if q.get("api").is_some_and(|a| a == "anthropic") => Endpoint::Messages,
        Ok(v) if v.get("messages").is_some() => Endpoint::ChatCompletions,
        _ => Endpoint::Completions,
    };
    let enc = encode(&engine, body, endpoint).await?;
    let keys = engine.keys_for(
        &hash_view(&enc.tokens, 0, &enc.media),
        enc.cache_salt.as_deref(),
    )?;
    let bs = engine.cfg.contract.block_size.get();
    let prompt_len = enc.tokens.len();
    // What admission would report now, on the rank that would report the most.
    let cached = engine
        .plan(&keys, prompt_len)
        .iter()
        .map(|h| h.cached_tokens(bs, prompt_len))
        .max()
        .unwrap_or(0);
    let mut out = tier_match(&engine.match_keys(&keys));
    if let Value::Object(m) = &mut out {
        m.insert("prompt_tokens".into(), prompt_len.into());
        m.insert("cached_tokens".into(), cached.into());
        add_queue(m, &engine);
        m.insert("kv_usage".into(), engine.kv_usage().into());
    }
    Ok(Json(out))
}
