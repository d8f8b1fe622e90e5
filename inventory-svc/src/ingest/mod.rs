//! Engine event ingestion: one task per `(endpoint, rank)` publisher, each reconnecting on its own.
//!
//! * [`zmq`]: vLLM and SGLang ZMQ PUB subscribers with sequence tracking, replay and restart detection.
//! * [`trtllm`]: the single `/kv_cache_events` drain poller per TensorRT-LLM engine.
//! * [`decode`]: frame and msgpack decoding; [`keyer`]: events -> index operations per key mode;
//!   [`parity`]: the engine-mode self-check's diagnosis.
//!
//! A task never takes the service down: errors (and panics inside the ZMQ library) end one
//! session, which is restarted after a capped exponential backoff; the rule's cancellation token
//! stops everything when the rule is deleted or the service drains.

pub mod decode;
pub mod keyer;
pub mod parity;
pub mod trtllm;
pub mod zmq;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::Engine;

use crate::index::{EndpointId, IndexOp, Rank};
use crate::rules::{EpRole, ExactMode};
use crate::state::{AppState, RuleRuntime};

/// What one sequence number means relative to the last one seen from the same publisher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first message of this subscriber.
    First,
    InOrder,
    /// Already applied (a replay overlap): skip.
    Duplicate,
    /// The publisher restarted (sequence back to 0, or lower after a reconnect): clear, then apply.
    Restart,
    /// Messages `from..seq` were lost.
    Gap {
        from: u64,
    },
}

/// Per-publisher sequence tracking.
#[derive(Clone, Debug, Default)]
pub struct SeqTracker {
    last: Option<u64>,
    /// Set after a reconnect: a lower sequence then means a restart, not a duplicate.
    fresh: bool,
}

impl SeqTracker {
    /// A tracker resuming after `last` (a replica taking an endpoint over from the replicated
    /// state): the next sequence is checked like one after a reconnect, so a gap is replayed or
    /// cleared and a restarted engine is recognised.
    pub fn resume(last: Option<u64>) -> SeqTracker {
        SeqTracker {
            last,
            fresh: last.is_some(),
        }
    }

    /// Marks a new connection.
    pub fn reconnected(&mut self) {
        self.fresh = true;
    }

    /// Classifies `seq` and advances the tracker.
    pub fn observe(&mut self, seq: u64) -> SeqVerdict {
        let fresh = std::mem::take(&mut self.fresh);
        let v = match self.last {
            None => SeqVerdict::First,
            Some(l) if seq == l.wrapping_add(1) => SeqVerdict::InOrder,
            Some(_) if seq == 0 => SeqVerdict::Restart,
            Some(l) if seq <= l && fresh => SeqVerdict::Restart,
            Some(l) if seq <= l => SeqVerdict::Duplicate,
            Some(l) => SeqVerdict::Gap { from: l + 1 },
        };
        if v != SeqVerdict::Duplicate {
            self.last = Some(seq);
        }
        v
    }
}

/// Capped exponential backoff for reconnects.
pub fn next_backoff(cur: Duration) -> Duration {
    (cur * 2).min(Duration::from_secs(5))
}

/// Applies operations this replica ingested to a rule's index, refreshes the endpoint's gauge and
/// hands them to replication (when configured) for the other replicas.
pub fn apply_ops(state: &AppState, rule: &Arc<RuleRuntime>, ep: usize, rank: u8, ops: &[IndexOp]) {
    if ops.is_empty() {
        return;
    }
    apply_local(state, rule, ep, rank, ops);
    if let Some(r) = state.replica.get() {
        r.ops(state, rule, ep, rank, ops);
    }
}

/// Applies operations to a rule's index and refreshes the endpoint's gauge (no replication: used
/// for what the replication log itself delivers).
pub fn apply_local(state: &AppState, rule: &RuleRuntime, ep: usize, rank: u8, ops: &[IndexOp]) {
    if ops.is_empty() {
        return;
    }
    rule.index.apply(EndpointId(ep as u8), Rank(rank), ops);
    if rule.cancel.is_cancelled() {
        return;
    }
    let n = rule.index.block_count(EndpointId(ep as u8));
    state
        .metrics
        .inventory_blocks
        .with_label_values(&[&rule.spec.name(), &ep.to_string()])
        .set(n as i64);
}

/// Sets the connected flag and gauge of one publisher.
pub fn set_connected(state: &AppState, rule: &RuleRuntime, ep: usize, rank: u8, up: bool) {
    if let Some(c) = rule
        .eps
        .get(ep)
        .and_then(|e| e.connected.get(rank as usize))
    {
        c.store(up, std::sync::atomic::Ordering::Relaxed);
    }
    if rule.cancel.is_cancelled() {
        // The rule is gone (or replaced): do not bring its series back after they were dropped.
        return;
    }
    state
        .metrics
        .subscriber_connected
        .with_label_values(&[&rule.spec.name(), &ep.to_string(), &rank.to_string()])
        .set(i64::from(up));
}

/// Endpoints whose events feed the index: prefill endpoints in mode 1, all others otherwise.
pub fn kv_endpoints(rule: &RuleRuntime) -> Vec<usize> {
    rule.spec
        .endpoints
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            rule.spec.exact_mode != ExactMode::PrefillDecode || e.role == EpRole::Prefill
        })
        .map(|(i, _)| i)
        .collect()
}

/// Starts every ingestion task of a rule (none for llama.cpp or kvExactMode 0): directly when
/// standalone, under an ownership lease per endpoint when replicated.
pub fn spawn_rule(state: &Arc<AppState>, rule: &Arc<RuleRuntime>) {
    if !rule.spec.kv_enabled() {
        return;
    }
    for ep in kv_endpoints(rule) {
        for rank in 0..rule.spec.dp_ranks.max(1) {
            set_connected(state, rule, ep, rank, false);
        }
        match state.replica.get() {
            Some(r) => r.spawn_lease(state, rule, ep),
            None => {
                rule.eps[ep]
                    .owned
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                spawn_endpoint(state, rule, ep, &rule.cancel);
            }
        }
    }
    for ep in 0..rule.eps.len() {
        state
            .metrics
            .inventory_blocks
            .with_label_values(&[&rule.spec.name(), &ep.to_string()])
            .set(0);
    }
}

/// Starts the ingestion tasks of one endpoint (every rank), stopped by `cancel`. Sequence
/// tracking resumes from the endpoint's last applied sequences (replicated takeover).
pub fn spawn_endpoint(
    state: &Arc<AppState>,
    rule: &Arc<RuleRuntime>,
    ep: usize,
    cancel: &tokio_util::sync::CancellationToken,
) {
    match rule.spec.engine {
        Engine::Vllm | Engine::Sglang => {
            for rank in 0..rule.spec.dp_ranks {
                let resume = rule.eps[ep].last_seq(rank);
                tokio::spawn(zmq::run(
                    state.clone(),
                    rule.clone(),
                    ep,
                    rank,
                    cancel.clone(),
                    resume,
                ));
            }
        }
        Engine::Trtllm => {
            let resume = rule.eps[ep].last_seq(0);
            tokio::spawn(trtllm::run(
                state.clone(),
                rule.clone(),
                ep,
                cancel.clone(),
                resume,
            ));
        }
        Engine::Llamacpp => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_verdicts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(5), SeqVerdict::First);
        assert_eq!(t.observe(6), SeqVerdict::InOrder);
        assert_eq!(t.observe(6), SeqVerdict::Duplicate);
        assert_eq!(t.observe(9), SeqVerdict::Gap { from: 7 });
        assert_eq!(t.observe(0), SeqVerdict::Restart);
        assert_eq!(t.observe(1), SeqVerdict::InOrder);
        t.reconnected();
        assert_eq!(t.observe(1), SeqVerdict::Restart);
        // Resuming a taken-over endpoint: in order continues, a jump is a gap, lower is a restart.
        assert_eq!(SeqTracker::resume(Some(4)).observe(5), SeqVerdict::InOrder);
        assert_eq!(
            SeqTracker::resume(Some(4)).observe(9),
            SeqVerdict::Gap { from: 5 }
        );
        assert_eq!(SeqTracker::resume(Some(4)).observe(2), SeqVerdict::Restart);
        assert_eq!(SeqTracker::resume(None).observe(2), SeqVerdict::First);
    }
}
