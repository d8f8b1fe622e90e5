//! Engine event ingestion: one task per `(endpoint, rank)` publisher, each reconnecting on its own.
//!
//! * [`zmq`]: vLLM and SGLang ZMQ PUB subscribers with sequence tracking, replay and restart detection.
//! * [`trtllm`]: the single `/kv_cache_events` drain poller per TensorRT-LLM engine.
//! * [`decode`]: frame and msgpack decoding (one pass over the payload with the bounded cursor
//!   of `msgpack`); [`reference`]: the tree decoder it is checked against; [`keyer`]: events ->
//!   index operations per key mode; [`parity`]: the engine-mode self-check's diagnosis.
//!
//! A task never takes the service down: errors (and panics inside the ZMQ library) end one
//! session, which is restarted after a capped exponential backoff; the rule's cancellation token
//! stops everything when the rule is deleted or the service drains.

pub mod decode;
#[cfg(test)]
mod engine_suite;
pub mod keyer;
mod msgpack;
pub mod parity;
pub mod reference;
pub mod tap;
pub mod trtllm;
pub mod zmq;
pub mod zmtp;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::Engine;
use kvroute_core::rule::ZmqAddr;

use crate::fleet::{EpRuntime, Fleet, RuleRuntime};
use crate::index::{EndpointId, IndexOp, Rank};
use crate::metrics::ClearCause;

/// What one sequence number means relative to the last one seen from the same publisher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first message of this subscriber.
    First,
    InOrder,
    /// Already applied (a replay overlap), or below the last one without yet forming a run of
    /// [`REWIND_RUN`] in-order frames: skip.
    Duplicate,
    /// The publisher restarted (sequence back to 0, or lower after a reconnect): clear, then apply.
    Restart,
    /// Messages `from..seq` were lost.
    Gap {
        from: u64,
    },
    /// [`REWIND_RUN`] consecutive in-order sequences arrived below the last one: the last one was
    /// out of range (a corrupt or hostile jump ahead) or the publisher restarted unnoticed. The
    /// tracker follows the new run: clear, then apply.
    Rewind,
}

/// In-order frames below the last sequence that make the tracker follow them ([`SeqVerdict::Rewind`]).
/// A replay overlap or a stray old frame is shorter; a publisher that really moved back sends
/// this many frames in a few milliseconds.
pub const REWIND_RUN: u32 = 3;

/// Per-publisher sequence tracking: a small state machine over `last` (the highest applied),
/// `fresh` (a reconnect happened) and `behind` (a run of in-order frames below `last`).
///
/// Invariants (checked by the property test below over arbitrary inputs):
/// * after any input, a run of in-order frames has one applied within its first
///   [`REWIND_RUN`] + 1 frames (+ 1: a run that reaches the last applied frame skips it, and the
///   next is in order), and every later frame of the run is [`SeqVerdict::InOrder`];
/// * a frame equal to the last applied one is never applied again without a reconnect;
/// * applied sequences increase by one ([`SeqVerdict::InOrder`], wrapping at `u64::MAX`) or jump
///   ahead ([`SeqVerdict::Gap`]) except at a verdict that clears the inventory
///   ([`SeqVerdict::Restart`], [`SeqVerdict::Rewind`]) or the first frame;
/// * [`SeqVerdict::Duplicate`] is only given to a sequence at or below the last applied one.
#[derive(Clone, Debug, Default)]
pub struct SeqTracker {
    last: Option<u64>,
    /// Set after a reconnect: a lower sequence then means a restart, not a duplicate.
    fresh: bool,
    /// Frames below `last` forming an in-order run: `(next expected, run length)`.
    behind: Option<(u64, u32)>,
}

impl SeqTracker {
    /// A tracker resuming after `last` (a replica taking an endpoint over from the replicated
    /// state): the next sequence is checked like one after a reconnect, so a gap is replayed or
    /// cleared and a restarted engine is recognised.
    pub fn resume(last: Option<u64>) -> SeqTracker {
        SeqTracker {
            last,
            fresh: last.is_some(),
            behind: None,
        }
    }

    /// Marks a new connection.
    pub fn reconnected(&mut self) {
        self.fresh = true;
    }

    /// Classifies `seq` and advances the tracker.
    pub fn observe(&mut self, seq: u64) -> SeqVerdict {
        self.observe_span(seq, seq)
    }

    /// Classifies a batch of consecutive sequences `first..=last` (a TensorRT-LLM drain) by its
    /// first one and advances the tracker past the whole batch; `last < first` counts as `first`.
    pub fn observe_span(&mut self, first: u64, last: u64) -> SeqVerdict {
        let fresh = std::mem::take(&mut self.fresh);
        let span = last.saturating_sub(first);
        let end = first.max(last);
        let v = match self.last {
            None => SeqVerdict::First,
            Some(l) if first == l.wrapping_add(1) => SeqVerdict::InOrder,
            Some(l) if first <= l && fresh => SeqVerdict::Restart,
            Some(l) if first == l => {
                self.behind = None;
                return SeqVerdict::Duplicate;
            }
            Some(_) if first == 0 => SeqVerdict::Restart,
            Some(l) if first < l => {
                let run = match self.behind {
                    Some((next, n)) if next == first => n,
                    _ => 0,
                };
                // A drain counts each of its events; a span past the run length is capped.
                let run = run
                    .saturating_add(1)
                    .saturating_add(span.min(u64::from(REWIND_RUN)) as u32);
                if run < REWIND_RUN {
                    self.behind = Some((end.wrapping_add(1), run));
                    return SeqVerdict::Duplicate;
                }
                SeqVerdict::Rewind
            }
            Some(l) => SeqVerdict::Gap { from: l + 1 },
        };
        self.behind = None;
        self.last = Some(end);
        v
    }
}

/// Capped exponential backoff for reconnects.
pub fn next_backoff(cur: Duration) -> Duration {
    (cur * 2).min(Duration::from_secs(5))
}

/// The clear a sequence verdict calls for, if any.
pub fn clear_for(v: SeqVerdict) -> Option<ClearCause> {
    match v {
        SeqVerdict::Restart => Some(ClearCause::Restart),
        SeqVerdict::Rewind => Some(ClearCause::Rewind),
        SeqVerdict::Gap { .. } => Some(ClearCause::Gap),
        SeqVerdict::First | SeqVerdict::InOrder | SeqVerdict::Duplicate => None,
    }
}

/// One event feed, the publisher of one `(endpoint, rank)`: what every ingest step works with.
#[derive(Clone)]
pub struct Feed {
    pub fleet: Arc<Fleet>,
    pub rule: Arc<RuleRuntime>,
    pub ep: EndpointId,
    pub rank: Rank,
    /// The endpoint's parity canary tap.
    pub tap: Arc<tap::Tap>,
}

impl Feed {
    /// The endpoint's live state.
    pub fn endpoint(&self) -> Option<&EpRuntime> {
        self.rule.ep(self.ep)
    }

    /// The engine this feed speaks for.
    pub fn engine(&self) -> Engine {
        self.rule.spec.engine
    }

    /// This rank's KV event address: the endpoint's `kvZmqEndpoint`, else
    /// `endpointIP:kvZmqPort`, plus the rank (validated to fit when the rule was accepted).
    pub fn event_addr(&self) -> Option<ZmqAddr> {
        let spec = &self.rule.spec;
        let e = spec.endpoints.get(usize::from(self.ep.0))?;
        let base = e.zmq_endpoint.unwrap_or_else(|| {
            ZmqAddr::from_socket(std::net::SocketAddr::new(e.ip, spec.zmq_port))
        });
        base.for_rank(self.rank.0)
    }

    /// This rank's replay ROUTER: the endpoint's `kvReplayEndpoint`, else `endpointIP:kvReplayPort`
    /// when the rule has one, plus the rank.
    pub fn replay_addr(&self) -> Option<ZmqAddr> {
        let spec = &self.rule.spec;
        let e = spec.endpoints.get(usize::from(self.ep.0))?;
        let base = match (e.replay_endpoint, spec.replay_port) {
            (Some(a), _) => a,
            (None, Some(p)) => ZmqAddr::from_socket(std::net::SocketAddr::new(e.ip, p)),
            (None, None) => return None,
        };
        base.for_rank(self.rank.0)
    }

    /// Applies what the publisher sent (through the fleet: key cap, gauge, replication).
    pub fn apply(&self, ops: &[IndexOp]) {
        self.fleet.apply_ops(&self.rule, self.ep, self.rank, ops);
    }

    /// Clears this rank's inventory and counts why.
    pub fn clear(&self, cause: ClearCause) {
        self.fleet
            .metrics
            .clear(self.engine().as_str(), cause)
            .inc();
        self.apply(&[IndexOp::Clear]);
    }

    /// Sets the connected flag and gauge of this publisher.
    pub fn set_connected(&self, up: bool) {
        self.fleet.set_connected(&self.rule, self.ep, self.rank, up);
    }

    /// Records the sequence of the message about to be applied.
    pub fn note_seq(&self, seq: u64) {
        if let Some(e) = self.endpoint() {
            e.note_seq(self.rank, seq);
        }
    }

    /// The last sequence applied (a replica taking the endpoint over resumes from it).
    pub fn last_seq(&self) -> Option<u64> {
        self.endpoint().and_then(|e| e.last_seq(self.rank))
    }

    /// A keyer for this feed's rule.
    pub fn keyer(&self) -> keyer::Keyer {
        let s = &self.rule.spec;
        keyer::Keyer::new(
            s.engine,
            s.key_mode,
            s.block_size,
            s.contract(),
            self.fleet.metrics.clone(),
        )
        .with_tap(self.tap.clone())
    }
}

/// Starts every ingestion task of a rule (none for llama.cpp or kvExactMode 0), each endpoint
/// while this replica owns it (always, standalone). Returns each endpoint's parity canary tap,
/// which its feeds offer every `BlockStored` to.
pub fn spawn_rule(fleet: &Arc<Fleet>, rule: &Arc<RuleRuntime>) -> Vec<Arc<tap::Tap>> {
    let taps: Vec<Arc<tap::Tap>> = rule.endpoint_ids().map(|_| Arc::default()).collect();
    let (f, r, t) = (fleet.clone(), rule.clone(), taps.clone());
    fleet.run_feeds(rule, move |ep, cancel| {
        let tap = t.get(ep.index()).cloned().unwrap_or_default();
        spawn_endpoint(&f, &r, ep, tap, cancel)
    });
    taps
}

/// Starts the ingestion tasks of one endpoint (every rank), stopped by `cancel`. Sequence
/// tracking resumes from the endpoint's last applied sequences (replicated takeover).
fn spawn_endpoint(
    fleet: &Arc<Fleet>,
    rule: &Arc<RuleRuntime>,
    ep: EndpointId,
    tap: Arc<tap::Tap>,
    cancel: &tokio_util::sync::CancellationToken,
) {
    let feed = |rank| Feed {
        fleet: fleet.clone(),
        rule: rule.clone(),
        ep,
        rank,
        tap: tap.clone(),
    };
    match rule.spec.engine {
        Engine::Vllm | Engine::Sglang => {
            for rank in 0..rule.spec.dp_ranks {
                tokio::spawn(zmq::run(feed(Rank(rank)), cancel.clone()));
            }
        }
        Engine::Trtllm => {
            tokio::spawn(trtllm::run(feed(Rank(0)), cancel.clone()));
        }
        Engine::Llamacpp => {}
    }
}

/// A seeded xorshift generator for the ingest property tests: no extra dependency, and a run
/// replays exactly from its seed.
#[cfg(test)]
pub(crate) mod test_rng {
    pub(crate) struct Rng(pub u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        pub(crate) fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
            &xs[self.below(xs.len() as u64) as usize]
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::panic)]
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

    #[test]
    fn out_of_range_jump_recovers() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(100), SeqVerdict::First);
        assert_eq!(t.observe(1 << 62), SeqVerdict::Gap { from: 101 });
        assert_eq!(t.observe(101), SeqVerdict::Duplicate);
        assert_eq!(t.observe(102), SeqVerdict::Duplicate);
        assert_eq!(t.observe(103), SeqVerdict::Rewind);
        assert_eq!(t.observe(104), SeqVerdict::InOrder);
        // A stray old frame (not a run) stays a duplicate; the last one is never applied twice.
        assert_eq!(t.observe(50), SeqVerdict::Duplicate);
        assert_eq!(t.observe(104), SeqVerdict::Duplicate);
        assert_eq!(t.observe(105), SeqVerdict::InOrder);
        // A replayed tail ending at the last applied one is skipped.
        assert_eq!(t.observe(103), SeqVerdict::Duplicate);
        assert_eq!(t.observe(104), SeqVerdict::Duplicate);
        assert_eq!(t.observe(105), SeqVerdict::Duplicate);
        assert_eq!(t.observe(106), SeqVerdict::InOrder);
        // Wrap.
        let mut t = SeqTracker::resume(Some(u64::MAX - 1));
        assert_eq!(t.observe(u64::MAX), SeqVerdict::InOrder);
        assert_eq!(t.observe(0), SeqVerdict::InOrder);
        // A TensorRT-LLM drain of ids below the last one: one drain of three events rewinds.
        let mut t = SeqTracker::default();
        assert_eq!(t.observe_span(1 << 62, 1 << 62), SeqVerdict::First);
        assert_eq!(t.observe_span(7, 7), SeqVerdict::Duplicate);
        assert_eq!(t.observe_span(8, 9), SeqVerdict::Rewind);
        assert_eq!(t.observe_span(10, 20), SeqVerdict::InOrder);
        assert_eq!(t.observe_span(21, 21), SeqVerdict::InOrder);
    }

    use super::test_rng::Rng;

    /// One arbitrary input step: a frame (near the last, a reset, a jump, a duplicate, an
    /// arbitrary value, around the wrap) or a reconnect.
    fn arbitrary_step(r: &mut Rng, prev: u64) -> Option<u64> {
        Some(match r.below(12) {
            0 => return None,
            1 => 0,
            2 => prev,
            3 => prev.wrapping_sub(r.below(5)),
            4 => prev.wrapping_add(2 + r.below(10)),
            5 => r.next(),
            6 => u64::MAX - r.below(3),
            7 => 1 << (r.below(64)),
            _ => prev.wrapping_add(1),
        })
    }

    fn applied(v: SeqVerdict) -> bool {
        v != SeqVerdict::Duplicate
    }

    #[test]
    fn seq_tracker_properties() {
        for seed in 1..=2000u64 {
            let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut t = SeqTracker::default();
            let mut last_applied: Option<u64> = None;
            let mut reconnected = false;
            let mut prev = r.next() % 1000;
            let steps = 1 + r.below(60);
            for _ in 0..steps {
                let Some(seq) = arbitrary_step(&mut r, prev) else {
                    t.reconnected();
                    reconnected = true;
                    continue;
                };
                prev = seq;
                let v = t.observe(seq);
                let ctx = format!("seed {seed}: seq {seq} after {last_applied:?} -> {v:?}");
                match (v, last_applied) {
                    (SeqVerdict::First, l) => assert!(l.is_none(), "{ctx}"),
                    (_, None) => panic!("{ctx}: only First without history"),
                    (SeqVerdict::InOrder, Some(l)) => assert_eq!(seq, l.wrapping_add(1), "{ctx}"),
                    (SeqVerdict::Gap { from }, Some(l)) => {
                        assert_eq!(from, l + 1, "{ctx}");
                        assert!(seq > from, "{ctx}");
                    }
                    (SeqVerdict::Duplicate, Some(l)) => assert!(seq <= l, "{ctx}"),
                    (SeqVerdict::Restart, Some(l)) => {
                        assert!(seq == 0 || (reconnected && seq <= l), "{ctx}")
                    }
                    (SeqVerdict::Rewind, Some(l)) => assert!(seq < l, "{ctx}"),
                }
                if !reconnected && Some(seq) == last_applied {
                    assert!(!applied(v), "{ctx}: the last applied frame applied twice");
                }
                reconnected = false;
                if applied(v) {
                    last_applied = Some(seq);
                }
            }
            // After any history, a run of in-order frames from anywhere is followed within
            // REWIND_RUN + 1 frames and stays followed.
            let start = match r.below(3) {
                0 => r.next(),
                1 => r.below(100),
                _ => prev.wrapping_add(1),
            };
            let mut followed_at = None;
            for i in 0..(u64::from(REWIND_RUN) + 20) {
                let seq = start.wrapping_add(i);
                let v = t.observe(seq);
                if followed_at.is_some() {
                    assert_eq!(v, SeqVerdict::InOrder, "seed {seed}: frame {i} of the run");
                } else if applied(v) {
                    followed_at = Some(i);
                }
            }
            let at = followed_at.unwrap_or(u64::MAX);
            assert!(
                at <= u64::from(REWIND_RUN),
                "seed {seed}: run from {start} followed at frame {at}"
            );
        }
    }
}
