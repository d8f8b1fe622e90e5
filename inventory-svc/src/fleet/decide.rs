//! Routing one request: observe the rule's endpoints, score (the pure policy in
//! [`crate::score`]), and commit the decision's side effects in one step.
//!
//! Committing (skipped when the question only asks to explain) is where every effect of a
//! decision happens, in this order: the decision counters and metrics, the in-flight estimate of
//! the chosen (and decode) endpoint, speculative credit for the keys past what the endpoint
//! holds, the placement memory, and the replication message that makes the other replicas do
//! the same. With a shadow configuration (`KVROUTE_SHADOW`), a committed decision is then made
//! again from the same inputs with it and only counted ([`super::shadow`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

use super::rule::RuleRuntime;
use super::{EpRuntime, Fleet};
use crate::index::{EndpointId, Lower};
use crate::metrics::SessionOutcome;
use crate::score::{
    decide, given_away, session_hash, Bound, Decision, Dropped, EpView, HashRing, Reason, Recall,
    ScoreInput, Tier, Update,
};
use crate::settings::{DivergencePolicy, Settings};

/// Most keys one request may carry (a 2 MiB body holds fewer anyway).
pub const MAX_KEYS: usize = 1 << 16;

/// One routing question, after parsing (and offloaded tokenization).
pub struct Question<'a> {
    /// Block keys in prompt order.
    pub keys: &'a [BlockKey],
    /// Prompt length in tokens.
    pub token_count: u32,
    /// Tenant identity or client IP, for sticky fallback.
    pub affinity_key: Option<&'a str>,
    pub model: Option<&'a str>,
    /// The conversation id ([`kvroute_core::affinity::session_id`]), for the session tier.
    pub session: Option<&'a str>,
    /// Decide without committing anything.
    pub explain: bool,
    /// When set, only the endpoints whose flag is true are eligible (an endpoint picker's
    /// candidate subset), indexed like the rule's endpoints; the others are seen as unhealthy.
    pub only: Option<&'a [bool]>,
}

/// Why a question has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// More keys than [`MAX_KEYS`].
    TooManyKeys(usize),
    /// No endpoint of the rule is healthy and eligible.
    NoEndpoint,
}

/// A decision and what it was made from.
pub struct Routed {
    pub decision: Decision,
    /// The chosen endpoint (the decision's `ep`, present when routed).
    pub ep: usize,
    /// Every endpoint as the scorer saw it.
    pub views: Vec<EpView>,
    /// The placement memory's answer.
    pub recall: Option<Recall>,
    /// The endpoint the question's session was bound to before this decision.
    pub session: Option<usize>,
}

/// Whether routing ignores `ep`'s locality: it diverges and the policy is `load_only`.
fn load_only(s: &Settings, ep: Option<&EpRuntime>) -> bool {
    s.divergence.policy == DivergencePolicy::LoadOnly && ep.is_some_and(EpRuntime::divergent)
}

impl Fleet {
    /// Decides `q` for `rule` at `now`, and (unless `q.explain`) commits the decision.
    pub fn route(
        &self,
        rule: &Arc<RuleRuntime>,
        q: &Question<'_>,
        now: Instant,
    ) -> Result<Routed, RouteError> {
        if q.keys.len() > MAX_KEYS {
            return Err(RouteError::TooManyKeys(q.keys.len()));
        }
        let views = self.observe(rule, q.keys, q.only, now);
        // Explain peeks: the same recall without counting it toward the family's heat.
        let recall = match q.explain {
            true => rule.memory.peek(q.keys, now),
            false => rule.memory.recall(q.keys, now),
        };
        let s = &self.settings;
        let session = q.session.map(|id| session_hash(rule.id, id));
        let bound = session.and_then(|h| rule.sessions.get(h, now));
        // A divergent endpoint under `load_only` is not remembered either (see `observe`).
        let recall = recall.filter(|r| !load_only(s, rule.eps().get(r.ep)));
        let affinity = q
            .affinity_key
            .map(|a| match (s.affinity_scope_model, q.model) {
                (true, Some(m)) => HashRing::key_hash(&format!("{a}\u{0}{m}")),
                _ => HashRing::key_hash(a),
            });
        let inp = ScoreInput {
            exact_mode: rule.spec.exact_mode,
            kv_enabled: rule.spec.kv_enabled(),
            sel: rule.spec.sel,
            eps: &views,
            n_keys: q.keys.len(),
            token_count: q.token_count,
            affinity,
            ring: &rule.ring,
            hit_seq: rule.hit_seq.load(Ordering::Relaxed),
            rr_seq: rule.rr_seq.load(Ordering::Relaxed),
            recall,
            session: bound,
            settings: s,
        };
        let decision = decide(&inp);
        if !q.explain {
            let session = session.map(|h| (h, bound));
            self.commit(rule, &decision, &views, q.keys, session, now);
            if let Some(shadow) = s.shadow.as_deref() {
                self.shadow(rule, &inp, &decision, shadow);
            }
        }
        let ep = decision.ep.ok_or(RouteError::NoEndpoint)?;
        Ok(Routed {
            decision,
            ep,
            views,
            recall,
            session: bound,
        })
    }

    /// Every endpoint of `rule` as the scorer sees it for `keys` at `now` (outside `only`: unhealthy).
    fn observe(
        &self,
        rule: &RuleRuntime,
        keys: &[BlockKey],
        only: Option<&[bool]>,
        now: Instant,
    ) -> Vec<EpView> {
        // Per-rule state is read once for all endpoints (one lock each), not per endpoint: at
        // 1,024 endpoints the per-endpoint locks were most of a decision.
        let matched = rule.match_prefix(keys, now);
        let lower = rule.match_lower(keys, &matched);
        let blocks = rule.block_counts();
        let homed = rule.memory.homed_all(rule.spec.endpoints.len());
        let s = &self.settings;
        let fresh = if s.scrape_interval.is_zero() {
            Duration::ZERO
        } else {
            s.scrape_interval * 3
        };
        rule.spec
            .endpoints
            .iter()
            .zip(rule.eps())
            .enumerate()
            .map(|(i, (e, rt))| {
                // Its engine does not reuse what the index says it holds: route on load alone.
                let locality = !load_only(s, Some(rt));
                EpView {
                    weight: e.weight,
                    role: e.role,
                    healthy: rt.healthy()
                        && only.is_none_or(|o| o.get(i).copied().unwrap_or(false)),
                    load: rt.load(now, s.inflight_window, fresh),
                    blocks: blocks.get(i).copied().unwrap_or(0),
                    matched: matched.get(i).copied().filter(|_| locality).unwrap_or(0),
                    lower: lower
                        .get(i)
                        .copied()
                        .filter(|_| locality)
                        .unwrap_or_default(),
                    capacity: rule.capacity(i, s.capacity_blocks),
                    homed: homed.get(i).copied().filter(|_| locality).unwrap_or(0),
                }
            })
            .collect()
    }

    /// Every side effect of a decision (see the module docs). `session`: the question's
    /// session hash and the endpoint it was bound to.
    fn commit(
        &self,
        rule: &Arc<RuleRuntime>,
        d: &Decision,
        views: &[EpView],
        keys: &[BlockKey],
        session: Option<(u64, Option<usize>)>,
        now: Instant,
    ) {
        let m = &self.metrics;
        m.route_decisions
            .with_label_values(&[d.tier.as_str(), d.reason.as_str()])
            .inc();
        if d.ep.is_some() {
            let given = given_away(rule.spec.exact_mode, views, d.matched);
            m.locality_given_away.observe(f64::from(given));
            if given > 0 {
                m.locality_given_away_decisions
                    .with_label_values(&[d.reason.as_str()])
                    .inc();
            }
        }
        match d.reason {
            Reason::Spill => m.tier15_spills.inc(),
            Reason::ColdSeed => m.tier15_cold_seeds.inc(),
            Reason::Remembered => m.tier15_remembered.inc(),
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
        let Some(ep) = d.ep else { return };
        rule.eps()[ep].record_decision(now);
        if let Some(dec) = d.decode {
            rule.eps()[dec].record_decision(now);
        }
        let kv = rule.spec.kv_enabled();
        if let Some(run) = views.get(ep).map(|v| v.lower).filter(|r| r.blocks() > 0) {
            for (l, n) in Lower::ALL.iter().zip([run.cpu, run.storage]) {
                if let Some(c) = m.route_lower(l.index()) {
                    c.inc_by(u64::from(n));
                }
            }
        }
        // Speculation covers the blind spot before the engine reports the blocks it is about to
        // compute: the keys past what the chosen endpoint already holds. Re-crediting held keys
        // would only hide their eviction for the TTL (and cost a table insert per key on every
        // follow-up).
        // The chosen endpoint's GPU match: blocks it loads from a lower tier land in GPU
        // memory too.
        let gpu = views.get(ep).map_or(d.matched, |v| v.matched);
        let unheld = keys.get(gpu as usize..).unwrap_or(&[]);
        let ttl = self.settings.spec_ttl;
        if kv && !unheld.is_empty() && !ttl.is_zero() {
            rule.index
                .speculate(EndpointId(ep as u16), unheld, now, ttl);
        }
        // A miss makes the chosen endpoint the family's home; a hit refreshes it; a spill or
        // cold seed is a detour and must not be remembered, or a hot family would end up homed
        // everywhere; so is a request whose home is unhealthy, or one failed probe would re-home
        // the family for good. A session decision follows its conversation, not the prefix: one
        // conversation that switches prompts must not move a family's home either.
        if d.detour {
            m.tier15_detours.inc();
        }
        let how = match d.reason {
            _ if d.detour => None,
            Reason::MissNoOverlap => Some(Update::Place),
            Reason::Hit | Reason::Remembered => Some(Update::Keep),
            _ => None,
        };
        if let (Some(how), true) = (how, kv) {
            rule.memory.record(keys, ep, how, now);
        }
        let session = session.and_then(|(h, bound)| self.bind_session(rule, h, bound, ep, now));
        // The other replicas credit the same endpoint (speculation, memory, in-flight load,
        // the session binding).
        let shared = if kv { keys } else { &[] };
        self.replication()
            .decision(rule, EndpointId(ep as u16), how, shared, session);
    }

    /// Binds session `h` (bound to `bound` before) to `ep`, the endpoint chosen, unless that
    /// was a detour from an unavailable bound endpoint; returns `h` when it was bound.
    fn bind_session(
        &self,
        rule: &RuleRuntime,
        h: u64,
        bound: Option<usize>,
        ep: usize,
        now: Instant,
    ) -> Option<u64> {
        let m = &self.metrics;
        // The scorer takes a bound endpoint whenever it is eligible: another choice is a detour,
        // and the conversation goes home once its endpoint is back (or the binding expires).
        if bound.is_some_and(|b| b != ep) {
            m.session(SessionOutcome::Detour).inc();
            return None;
        }
        let (what, dropped) = rule.sessions.bind(h, ep, now);
        self.count_binding(rule, Some(what), dropped);
        (what != Bound::Off).then_some(h)
    }

    /// Counts a binding this replica decided (`what`) and the bindings dropped, and updates the
    /// rule's gauge.
    fn count_binding(&self, rule: &RuleRuntime, what: Option<Bound>, dropped: Dropped) {
        let m = &self.metrics;
        let outcome = match what {
            Some(Bound::Off) => return,
            Some(Bound::New) => Some(SessionOutcome::New),
            Some(Bound::Kept) => Some(SessionOutcome::Kept),
            Some(Bound::Moved) => Some(SessionOutcome::Moved),
            None => None,
        };
        if let Some(o) = outcome {
            m.session(o).inc();
        }
        for (o, n) in [
            (SessionOutcome::Evicted, dropped.evicted),
            (SessionOutcome::Expired, dropped.expired),
        ] {
            if n > 0 {
                m.session(o).inc_by(n as u64);
            }
        }
        rule.sessions_gauge
            .get_or_init(|| m.sessions.with_label_values(&[rule.spec.name()]))
            .set(i64::try_from(rule.sessions.len()).unwrap_or(i64::MAX));
    }

    /// Applies a decision another replica made `age` ago: speculative credit for what is left
    /// of its time to live (`ttl_left`), the placement memory, the session binding, and the
    /// in-flight estimate while the decision is inside the in-flight window.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_peer_decision(
        &self,
        rule: &RuleRuntime,
        ep: EndpointId,
        update: Option<Update>,
        keys: &[BlockKey],
        session: Option<u64>,
        age: Duration,
        ttl_left: Duration,
    ) {
        let Some(e) = rule.ep(ep) else { return };
        let now = Instant::now();
        if let Some(h) = session {
            // Counted where it was decided; evictions are this replica's own.
            let (_, dropped) = rule.sessions.bind(h, usize::from(ep.0), now);
            self.count_binding(rule, None, dropped);
        }
        if !ttl_left.is_zero() && !keys.is_empty() {
            // As the deciding replica does: only the keys past what the endpoint holds.
            let held = rule.match_prefix(keys, now);
            let from = held.get(usize::from(ep.0)).map_or(0, |&n| n as usize);
            if let Some(unheld) = keys.get(from..).filter(|k| !k.is_empty()) {
                rule.index.speculate(ep, unheld, now, ttl_left);
            }
        }
        if let Some(u) = update {
            rule.memory.record(keys, usize::from(ep.0), u, now);
        }
        if age < self.settings.inflight_window {
            e.record_decision(now);
        }
    }
}
