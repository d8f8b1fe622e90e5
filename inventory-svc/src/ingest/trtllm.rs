//! TensorRT-LLM drain poller: exactly one per engine, `POST /kv_cache_events` on the serving port.
//!
//! The endpoint drains the engine's queue, so nobody else may call it. Event ids are tracked like
//! ZMQ sequence numbers: a jump means events were lost (cleared, no replay exists), an id back at
//! or below the last after a failed poll, or 0, means a restart (cleared); a run of ids below the last
//! one means the last was out of range (cleared, then followed).

use std::time::Duration;

use serde_json::Value;

use super::keyer::Keyer;
use super::{clear_for, next_backoff, Feed, SeqTracker};
use crate::metrics::ClearCause;
use crate::metrics::Metrics;

/// Largest drain body read: a drain of 100 ms holds a few hundred events of a few KiB; past this the
/// drain is refused (counted as a decode error) instead of buffered.
pub const MAX_DRAIN_BODY: usize = 32 << 20;

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
