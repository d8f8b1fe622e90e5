//! TensorRT-LLM drain poller: exactly one per engine, `POST /kv_cache_events` on the serving port.
//!
//! The endpoint drains the engine's queue, so nobody else may call it. Event ids are tracked like
//! ZMQ sequence numbers: a jump means events were lost (cleared, no replay exists), an id back at
//! or below the last after a failed poll, or 0, means a restart (cleared); a run of ids below the last
//! one means the last was out of range (cleared, then followed).
//!
//! Also here: reading a stored block's tokens, and the [`Stored`] a stored event makes for the
//! parity canary's tap ([`tapped`]).

use std::time::Duration;

use serde_json::Value;

use super::decode::{Medium, Stored};
use super::keyer::Keyer;
use super::{clear_for, next_backoff, Feed, SeqTracker};
use crate::metrics::ClearCause;
use crate::metrics::Metrics;

/// Largest drain body read: a drain of 100 ms holds a few hundred events of a few KiB; past this the
/// drain is refused (counted as a decode error) instead of buffered.
pub const MAX_DRAIN_BODY: usize = 32 << 20;

/// A stored block's token ids (`tokens: [{token_id, ...}]`, or bare ids); no `tokens` is no
/// tokens. `None` when a token is not an id below 2^32: such a block is unkeyable, never
/// truncated into a different key.
pub(super) fn block_tokens(block: &Value) -> Option<Vec<u32>> {
    let Some(tokens) = block.get("tokens").and_then(Value::as_array) else {
        return Some(Vec::new());
    };
    tokens
        .iter()
        .map(|x| {
            x.get("token_id")
                .and_then(Value::as_u64)
                .or_else(|| x.as_u64())
                .and_then(|v| u32::try_from(v).ok())
        })
        .collect()
}

/// The `BlockStored` a stored event's `data` makes for the parity canary: the engine's
/// `block_hash` and the concatenated tokens of its full blocks, its `parent_hash`, the tokens
/// per block, and whether a block names a LoRA adapter (`lora_id`), media (`mm_keys`) or a
/// `cache_salt`. The event's first block sets the block size; the blocks holding that many tokens
/// from the start are full, and the chain of full blocks ends at the first other one (a partial
/// tail, a block without hash or with a bad token). A lone block holding fewer tokens than the
/// rule's `block_size` is a partial block (its full predecessors came in an earlier event), not
/// another block size.
pub(super) fn tapped(data: &Value, block_size: u32) -> Stored {
    let blocks = data
        .get("blocks")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let named = |b: &Value, field: &str| b.get(field).is_some_and(|v| !v.is_null());
    let media = |b: &Value| {
        b.get("mm_keys")
            .and_then(Value::as_array)
            .is_some_and(|m| !m.is_empty())
    };
    let cache_salt = blocks.iter().find_map(|b| match b.get("cache_salt") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Null) | None => None,
        Some(other) => Some(other.to_string()),
    });
    let mut s = Stored {
        block_hashes: Vec::new(),
        parent: data.get("parent_hash").and_then(Value::as_u64),
        token_ids: Vec::new(),
        block_size: None,
        medium: match blocks
            .first()
            .and_then(|b| b.get("cache_level"))
            .and_then(Value::as_u64)
        {
            Some(0) | None => Medium::Gpu,
            Some(_) => Medium::Cpu,
        },
        has_lora: blocks.iter().any(|b| named(b, "lora_id")),
        has_extra_keys: cache_salt.is_some() || blocks.iter().any(media),
        cache_salt,
        group: None,
        kind: None,
    };
    let mut size = None;
    for b in blocks {
        let (Some(hash), Some(tokens)) =
            (b.get("block_hash").and_then(Value::as_u64), block_tokens(b))
        else {
            break;
        };
        let n = *size.get_or_insert(tokens.len());
        let lone_partial = blocks.len() == 1 && n < block_size as usize;
        if n == 0 || tokens.len() != n || lone_partial {
            break;
        }
        s.block_hashes.push(hash);
        s.token_ids.extend_from_slice(&tokens);
    }
    if !s.block_hashes.is_empty() {
        s.block_size = size.and_then(|n| u32::try_from(n).ok());
    }
    s
}

/// Reads a drain body of at most [`MAX_DRAIN_BODY`] bytes and parses it.
async fn read_bounded(
    mut r: reqwest::Response,
    metrics: &Metrics,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Value, String> {
    let too_big = || {
        metrics.decode_errors.with_label_values(&["trtllm"]).inc();
        format!("drain body over {MAX_DRAIN_BODY} bytes")
    };
    if r.content_length()
        .is_some_and(|n| n > MAX_DRAIN_BODY as u64)
    {
        return Err(too_big());
    }
    let mut body = Vec::new();
    loop {
        let chunk = tokio::select! {
            _ = cancel.cancelled() => return Err("cancelled".into()),
            c = r.chunk() => c.map_err(|e| e.to_string())?,
        };
        let Some(c) = chunk else { break };
        if body.len() + c.len() > MAX_DRAIN_BODY {
            return Err(too_big());
        }
        body.extend_from_slice(&c);
    }
    serde_json::from_slice(&body).map_err(|e| format!("drain body: {e}"))
}

/// Applies one drain's events: tracked by their event ids like a ZMQ sequence (no replay exists,
/// so a gap clears like a restart or a rewind), then keyed and applied.
pub(super) fn apply_drain(feed: &Feed, keyer: &mut Keyer, seq: &mut SeqTracker, events: &[Value]) {
    let event_id = |e: Option<&Value>| e.and_then(|e| e.get("event_id")).and_then(Value::as_u64);
    if let Some(first) = event_id(events.first()) {
        let last = event_id(events.last()).unwrap_or(first);
        if let Some(cause) = clear_for(seq.observe_span(first, last)) {
            if cause == ClearCause::Gap {
                let m = &feed.fleet.metrics;
                m.seq_gaps
                    .with_label_values(&[feed.engine().as_str()])
                    .inc();
            }
            keyer.reset();
            feed.clear(cause);
        }
        feed.note_seq(last);
    }
    let ops = keyer.trtllm_ops(events);
    feed.apply(&ops);
}

/// Polls one TensorRT-LLM endpoint until `cancel` (the rule's token, or the endpoint's lease),
/// resuming after the last event id already applied (replicated takeover).
pub async fn run(feed: Feed, cancel: tokio_util::sync::CancellationToken) {
    let (state, rule) = (&feed.fleet, &feed.rule);
    let Some(addr) = rule
        .spec
        .endpoints
        .get(usize::from(feed.ep.0))
        .map(|e| e.addr())
    else {
        return;
    };
    let url = format!("http://{addr}/kv_cache_events");
    let interval = Duration::from_millis(u64::from(rule.spec.drain_interval_ms));
    let mut keyer = feed.keyer();
    let mut seq = SeqTracker::resume(feed.last_seq());
    let mut backoff = interval;
    let engine = rule.spec.engine.as_str();
    loop {
        let res = tokio::select! {
            _ = cancel.cancelled() => break,
            r = state.http.post(&url).header("content-type", "application/json").body("{}").send() => r,
        };
        let events = match res {
            Ok(r) if r.status().is_success() => read_bounded(r, &state.metrics, &cancel).await,
            Ok(r) => Err(format!("status {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        let wait = match events {
            Ok(Value::Array(events)) => {
                feed.set_connected(true);
                backoff = interval;
                apply_drain(&feed, &mut keyer, &mut seq, &events);
                interval
            }
            Ok(_) => {
                state
                    .metrics
                    .decode_errors
                    .with_label_values(&[engine])
                    .inc();
                interval
            }
            Err(e) => {
                feed.set_connected(false);
                seq.reconnected();
                tracing::debug!(rule = %rule.spec.name(), ep = feed.ep.0, "drain failed: {e}");
                backoff = next_backoff(backoff);
                backoff
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    feed.set_connected(false);
}
