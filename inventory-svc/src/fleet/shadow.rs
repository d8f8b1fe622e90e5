//! The shadow policy (`KVROUTE_SHADOW`): every committed decision is made a second time by the
//! pure scorer with the shadow configuration ([`crate::settings::Settings::shadow`]) and only
//! counted, so a change of the scoring variables can be judged on live traffic before it is made.
//!
//! The second decision gets the first one's inputs: the endpoints as observed, the placement
//! memory's recall, the question, and the rule's round-robin and hit counters as they were. It
//! answers "where would this request go under the shadow configuration, in the fleet as it is",
//! one decision at a time; it is not a run of the fleet under that configuration (the in-flight
//! loads, speculative credit and memory it sees are the ones the live decisions produced).
//!
//! Invariants:
//! * the shadow changes nothing: no in-flight count, speculative credit, placement memory or
//!   heat, sequence counter, decision metric or replication message; the live decision and the
//!   state after it are what they are without a shadow;
//! * explain questions are not shadowed (they commit nothing, so they count nothing);
//! * a rule's series are resolved once per rule runtime (no label lookup per request), never
//!   created for a removed rule, and dropped with it.

use std::sync::OnceLock;

use prometheus::IntCounter;

use super::rule::RuleRuntime;
use super::Fleet;
use crate::metrics::{Metrics, ShadowOutcome};
use crate::score::{decide, Decision, EpView, Reason, ScoreInput};
use crate::settings::Settings;

/// What one shadow decision counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Verdict {
    pub outcome: ShadowOutcome,
    /// Matched blocks of the endpoint the shadow chose (0 without one).
    pub shadow_blocks: u32,
    /// Matched blocks of the endpoint the live policy chose (0 without one).
    pub live_blocks: u32,
}

/// The shadow's decision against the live one, both made from `views`. An endpoint's matched
/// blocks are its exact prefix overlap as observed, whichever tier chose it (a fallback to an
/// endpoint holding the prefix still reuses it).
pub(super) fn verdict(live: &Decision, shadow: &Decision, views: &[EpView]) -> Verdict {
    let blocks = |d: &Decision| d.ep.and_then(|i| views.get(i)).map_or(0, |v| v.matched);
    let outcome = match shadow.ep {
        None => ShadowOutcome::NoEndpoint,
        ep if ep == live.ep => ShadowOutcome::Same,
        Some(_) => ShadowOutcome::Different,
    };
    Verdict {
        outcome,
        shadow_blocks: blocks(shadow),
        live_blocks: blocks(live),
    }
}

/// One rule's shadow series.
pub(super) struct ShadowSeries {
    rule: String,
    same: IntCounter,
    different: IntCounter,
    no_endpoint: IntCounter,
    shadow_blocks: IntCounter,
    live_blocks: IntCounter,
    /// `kvroute_shadow_tier_total` indexed by reason (its discriminant), each resolved at its
    /// first decision with that decision's tier (a reason has one tier), so only pairs that
    /// occur are exported.
    reasons: [OnceLock<IntCounter>; Reason::ALL.len()],
}

impl ShadowSeries {
    /// Resolves (registers at 0) the outcome and block series of `rule`.
    fn new(m: &Metrics, rule: String) -> ShadowSeries {
        let outcome = |o: ShadowOutcome| m.shadow_decisions.with_label_values(&[&rule, o.as_str()]);
        ShadowSeries {
            same: outcome(ShadowOutcome::Same),
            different: outcome(ShadowOutcome::Different),
            no_endpoint: outcome(ShadowOutcome::NoEndpoint),
            shadow_blocks: m.shadow_predicted_blocks.with_label_values(&[&rule]),
            live_blocks: m.live_predicted_blocks.with_label_values(&[&rule]),
            reasons: std::array::from_fn(|_| OnceLock::new()),
            rule,
        }
    }

    fn outcome(&self, o: ShadowOutcome) -> &IntCounter {
        match o {
            ShadowOutcome::Same => &self.same,
            ShadowOutcome::Different => &self.different,
            ShadowOutcome::NoEndpoint => &self.no_endpoint,
        }
    }

    /// Counts decision `d` and its verdict `v` (a reason's series is not created once `rule`
    /// is removed).
    fn count(&self, m: &Metrics, rule: &RuleRuntime, d: &Decision, v: Verdict) {
        self.outcome(v.outcome).inc();
        self.shadow_blocks.inc_by(u64::from(v.shadow_blocks));
        self.live_blocks.inc_by(u64::from(v.live_blocks));
        let Some(cell) = self.reasons.get(d.reason as usize) else {
            return;
        };
        let c = match cell.get() {
            Some(c) => c,
            None if rule.is_stopped() => return,
            None => cell.get_or_init(|| {
                m.shadow_tiers
                    .with_label_values(&[&self.rule, d.tier.as_str(), d.reason.as_str()])
            }),
        };
        c.inc();
    }
}

impl Fleet {
    /// Decides `inp` again with the `shadow` configuration and counts how it compares with
    /// `live`, the decision committed for `inp`. Nothing else changes.
    pub(super) fn shadow(
        &self,
        rule: &RuleRuntime,
        inp: &ScoreInput<'_>,
        live: &Decision,
        shadow: &Settings,
    ) {
        let series = match rule.shadow_series.get() {
            Some(s) => s,
            // Removed (its series dropped): do not bring them back.
            None if rule.is_stopped() => return,
            None => rule
                .shadow_series
                .get_or_init(|| ShadowSeries::new(&self.metrics, rule.spec.name())),
        };
        let d = decide(&ScoreInput {
            settings: shadow,
            ..*inp
        });
        series.count(&self.metrics, rule, &d, verdict(live, &d, inp.eps));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvroute_core::hash::BlockKey;

    use super::*;
    use crate::fleet::tests::{fleet, keys, spec};
    use crate::fleet::{Origin, Question, Routed};
    use crate::index::{EndpointId, IndexOp, Rank};
    use crate::score::Tier;

    const RULE: &str = "10.0.0.1:80/tcp";

    fn decision(ep: Option<usize>) -> Decision {
        Decision {
            ep,
            matched: 0,
            tier: Tier::Tier15,
            reason: Reason::Hit,
            decode: None,
            counted_hit: true,
            placed: false,
            detour: false,
        }
    }

    #[test]
    fn verdict_compares_the_chosen_endpoints() {
        let view = |matched| EpView {
            weight: 1,
            role: None,
            healthy: true,
            load: 0,
            blocks: 0,
            matched,
            lower: Default::default(),
            capacity: 0,
            homed: 0,
        };
        let views = [view(4), view(1)];
        use ShadowOutcome::{Different, NoEndpoint, Same};
        // (live, shadow) -> (outcome, shadow blocks, live blocks)
        let table = [
            (Some(0), Some(0), (Same, 4, 4)),
            (Some(0), Some(1), (Different, 1, 4)),
            (Some(1), Some(0), (Different, 4, 1)),
            (Some(0), None, (NoEndpoint, 0, 4)),
            (None, None, (NoEndpoint, 0, 0)),
            (None, Some(1), (Different, 1, 0)),
        ];
        for (live, shadow, (outcome, shadow_blocks, live_blocks)) in table {
            let v = verdict(&decision(live), &decision(shadow), &views);
            assert_eq!(
                v,
                Verdict {
                    outcome,
                    shadow_blocks,
                    live_blocks
                },
                "{live:?} {shadow:?}"
            );
        }
    }

    /// The environment `live` with `KVROUTE_SHADOW=shadow`.
    fn settings(shadow: &str, live: &[(&str, &str)]) -> Settings {
        Settings::from_env(|k| match k {
            "KVROUTE_SHADOW" => Some(shadow.to_owned()),
            _ => live
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned()),
        })
        .unwrap()
    }

    fn question(k: &[BlockKey], explain: bool) -> Question<'_> {
        Question {
            keys: k,
            token_count: 16 * k.len() as u32,
            affinity_key: None,
            model: None,
            session: None,
            explain,
            only: None,
        }
    }

    /// `kvroute_shadow_decisions_total` of [`RULE`]: same, different, no_endpoint.
    fn counts(f: &Fleet) -> Vec<u64> {
        ShadowOutcome::ALL
            .iter()
            .map(|o| {
                f.metrics
                    .shadow_decisions
                    .with_label_values(&[RULE, o.as_str()])
                    .get()
            })
            .collect()
    }

    fn blocks(f: &Fleet) -> (u64, u64) {
        let m = &f.metrics;
        (
            m.shadow_predicted_blocks.with_label_values(&[RULE]).get(),
            m.live_predicted_blocks.with_label_values(&[RULE]).get(),
        )
    }

    fn tier(f: &Fleet, tier: &str, reason: &str) -> u64 {
        f.metrics
            .shadow_tiers
            .with_label_values(&[RULE, tier, reason])
            .get()
    }

    #[test]
    fn a_shadow_identical_to_live_always_agrees() {
        let s = settings("LOXILB_KV_LB_MODE=hard,LOXILB_KV_MEAN_LOAD_FACTOR=175", &[]);
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(1), Rank(0), &[IndexOp::Store(keys(4))]);
        let now = Instant::now();
        let mut live = 0;
        for n in [6, 6, 2, 9, 6, 1, 6, 6, 6, 6] {
            let k = keys(n);
            let routed = f.route(&r, &question(&k, false), now).unwrap();
            live += u64::from(routed.views[routed.ep].matched);
        }
        assert_eq!(counts(&f), [10, 0, 0]);
        assert_eq!(blocks(&f), (live, live));
        assert!(live > 0);
        let decided: u64 = Reason::ALL
            .iter()
            .flat_map(|r| Tier::ALL.map(|t| (t, *r)))
            .map(|(t, r)| tier(&f, t.as_str(), r.as_str()))
            .sum();
        assert_eq!(decided, 10);
    }

    /// ep1 holds the prefix. Live (hard, spill relief on) keeps it there up to the mean load cap:
    /// request k finds k-1 in flight against a cap of ceil(1.75 x k / 2), so the 8th spills to
    /// ep0. The shadow (pure overlap, no relief) sends all eight to ep1. (No speculative credit,
    /// and no placement memory, whose hot-family rule would spill earlier.)
    #[test]
    fn a_shadow_that_ignores_load_disagrees_at_the_spill() {
        let s = settings(
            "LOXILB_KV_LB_MODE=off, LOXILB_KV_SPILL_RELIEF=off",
            &[
                ("KVROUTE_SPEC_TTL_MS", "0"),
                ("KVROUTE_PLACEMENT_MEMORY_ENTRIES", "0"),
            ],
        );
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(1), Rank(0), &[IndexOp::Store(keys(4))]);
        let k = keys(6);
        let now = Instant::now();
        let eps: Vec<usize> = (0..8)
            .map(|_| f.route(&r, &question(&k, false), now).unwrap().ep)
            .collect();
        assert_eq!(eps, [1, 1, 1, 1, 1, 1, 1, 0]);
        assert_eq!(counts(&f), [7, 1, 0]);
        // The shadow's eight choices hold 4 blocks each; live's spill holds none.
        assert_eq!(blocks(&f), (8 * 4, 7 * 4));
        assert_eq!(tier(&f, "tier15", "hit"), 8);
        assert_eq!(tier(&f, "tier15", "spill"), 0);
        let live = |reason| {
            f.metrics
                .route_decisions
                .with_label_values(&["tier15", reason])
                .get()
        };
        assert_eq!((live("hit"), live("spill")), (7, 1));
        // Explain questions are not shadowed.
        f.route(&r, &question(&k, true), now).unwrap();
        assert_eq!(counts(&f), [7, 1, 0]);
    }

    /// Every decision and every piece of state after it, on `f`, for the same questions.
    fn run(f: &Arc<Fleet>, shadowed: bool) -> (Vec<Decision>, String) {
        let s = &f.settings;
        let r = f.install(spec(80, 2, s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(1), Rank(0), &[IndexOp::Store(keys(4))]);
        let now = Instant::now();
        let mut out = Vec::new();
        for (i, n) in [6u64, 6, 3, 12, 6, 6, 1, 0, 6, 6, 12, 6]
            .into_iter()
            .enumerate()
        {
            let k: Vec<BlockKey> = (1..=n)
                .map(|j| BlockKey(j + 100 * (i as u64 % 3)))
                .collect();
            let Routed { decision, .. } = f.route(&r, &question(&k, false), now).unwrap();
            out.push(decision);
        }
        let state = format!(
            "loads {:?} match {:?} {:?} memory {:?} {:?} seq {} {} decisions {:?}",
            r.eps()
                .iter()
                .map(|e| e.load(now, s.inflight_window, Duration::ZERO))
                .collect::<Vec<_>>(),
            r.match_prefix(&keys(12), now),
            r.match_prefix(&(101..=112).map(BlockKey).collect::<Vec<_>>(), now),
            r.memory.peek(&keys(6), now),
            r.memory
                .peek(&(201..=206).map(BlockKey).collect::<Vec<_>>(), now),
            r.hit_seq.load(Ordering::Relaxed),
            r.rr_seq.load(Ordering::Relaxed),
            Reason::ALL.map(|reason| {
                Tier::ALL.map(|t| {
                    f.metrics
                        .route_decisions
                        .with_label_values(&[t.as_str(), reason.as_str()])
                        .get()
                })
            }),
        );
        assert_eq!(counts(f).iter().sum::<u64>() > 0, shadowed);
        (out, state)
    }

    #[test]
    fn the_shadow_changes_neither_the_decisions_nor_the_state() {
        let plain = settings("", &[]);
        let shadowed = settings(
            "LOXILB_KV_LB_MODE=soft,LOXILB_KV_LOAD_PENALTY=3,LOXILB_KV_SPILL_RELIEF=off,\
             LOXILB_KV_COLDSTART_SEED_N=2,LOXILB_KV_COLDSTART_MIN_BLOCKS=1000,\
             LLB_KV_MIN_MATCH_TOKENS=64,KVROUTE_PLACEMENT=sel",
            &[],
        );
        assert!(plain.shadow.is_none() && shadowed.shadow.is_some());
        let (a, b) = (fleet(plain), fleet(shadowed));
        let (with, state_with) = run(&b, true);
        let (without, state_without) = run(&a, false);
        assert_eq!(with, without);
        assert_eq!(state_with, state_without);
        // The shadow did disagree: the comparison is not vacuous.
        assert!(counts(&b)[1] > 0, "{:?}", counts(&b));
    }

    #[test]
    fn a_removed_rule_loses_its_shadow_series() {
        let s = settings("LOXILB_KV_LB_MODE=off", &[]);
        let f: Arc<Fleet> = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        let k = keys(3);
        f.route(&r, &question(&k, false), Instant::now()).unwrap();
        assert!(f
            .metrics
            .render()
            .contains("kvroute_shadow_decisions_total"));
        f.uninstall(RULE, Origin::Local).unwrap();
        // Requests still holding the removed rule do not bring them back, whatever their reason
        // (a miss, then a short prompt).
        f.route(&r, &question(&k, false), Instant::now()).unwrap();
        f.route(&r, &question(&[], false), Instant::now()).unwrap();
        let text = f.metrics.render();
        for name in [
            "kvroute_shadow_decisions_total",
            "kvroute_shadow_predicted_blocks_total",
            "kvroute_live_predicted_blocks_total",
            "kvroute_shadow_tier_total",
        ] {
            assert!(!text.contains(name), "{name} left after removal:\n{text}");
        }
    }
}
