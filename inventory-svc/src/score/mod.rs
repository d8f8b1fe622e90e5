//! Tier 1.5 scoring: pick an endpoint from per-endpoint prefix overlap, load, health and the rule.
//!
//! Pure and synchronous: [`decide`] takes a snapshot ([`ScoreInput`]) and returns a [`Decision`];
//! the API layer gathers the snapshot (index match, loads, health) and records the outcome. This
//! keeps every branch (hit, spill, cold seed, each miss reason, prefill/decode) unit-testable.
//!
//! Policy (the seed's Tier 1.5):
//! * prompts shorter than `LLB_KV_MIN_MATCH_TOKENS`, rules in warm-up and rules without KV events
//!   skip KV scoring and fall back to the rule's `sel`;
//! * positive overlap: each endpoint's cap is `max(1, ceil(mlf/100 x total load x w_i / sum w))`;
//!   the highest overlap under its cap wins, ties by lower load then lower index;
//! * spill relief (tri-state): a winner at or over its cap spills to the least-loaded under-cap endpoint;
//! * cold-start seeding: every Nth hit goes to the lowest-index endpoint holding fewer than the
//!   cold threshold of blocks, so a new replica gets warm;
//! * miss: the rule's `sel` — round robin, consistent hash on the affinity key (150 virtual nodes
//!   per endpoint), priority (weight), least loaded; unhealthy endpoints are never chosen;
//! * kvExactMode 1: only prefill endpoints are scored; the decode endpoint is the least loaded.

mod ring;

pub use ring::HashRing;

use crate::rules::{EpRole, ExactMode, Sel};
use crate::settings::{LbMode, Settings, SpillRelief};

/// Which tier made the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// KV-overlap scoring.
    Tier15,
    /// The rule's `sel` algorithm.
    Fallback,
}

impl Tier {
    /// Metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Tier15 => "tier15",
            Tier::Fallback => "fallback",
        }
    }
}

/// Why this endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Highest overlap under its cap.
    Hit,
    /// Moved off the best-overlap endpoint by load.
    Spill,
    /// A hit sent to a cold endpoint to seed it.
    ColdSeed,
    /// No endpoint holds the first block.
    MissNoOverlap,
    /// Prompt shorter than LLB_KV_MIN_MATCH_TOKENS.
    MissShortPrompt,
    /// Fewer tokens than one block: no keys.
    MissNoKeys,
    /// The rule has no KV scoring (kvExactMode 0 or an engine without events).
    KvOff,
}

impl Reason {
    /// Metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::Spill => "spill",
            Reason::ColdSeed => "cold_seed",
            Reason::MissNoOverlap => "miss_no_overlap",
            Reason::MissShortPrompt => "miss_short_prompt",
            Reason::MissNoKeys => "miss_no_keys",
            Reason::KvOff => "kv_off",
        }
    }

    /// Every reason, for pre-registering metric series.
    pub const ALL: [Reason; 7] = [
        Reason::Hit,
        Reason::Spill,
        Reason::ColdSeed,
        Reason::MissNoOverlap,
        Reason::MissShortPrompt,
        Reason::MissNoKeys,
        Reason::KvOff,
    ];
}

/// One endpoint as the scorer sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpView {
    pub weight: u32,
    pub role: EpRole,
    pub healthy: bool,
    /// In-flight estimate.
    pub load: u64,
    /// Blocks the endpoint really holds (for cold-start seeding).
    pub blocks: u64,
    /// Leading request blocks the endpoint holds.
    pub matched: u32,
}

/// Everything one decision depends on.
pub struct ScoreInput<'a> {
    pub exact_mode: ExactMode,
    pub kv_enabled: bool,
    pub sel: Sel,
    pub eps: &'a [EpView],
    pub n_keys: usize,
    pub token_count: u32,
    /// Affinity key hash (tenant or tenant+model), for consistent hashing.
    pub affinity: Option<u64>,
    pub ring: &'a HashRing,
    /// Per-rule counter of Tier 1.5 hits so far (cold-start seeding takes every Nth).
    pub hit_seq: u64,
    /// Per-rule counter of decisions so far (round robin).
    pub rr_seq: u64,
    pub settings: &'a Settings,
}

/// The outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Index of the chosen endpoint; `None` when no endpoint is healthy and eligible.
    pub ep: Option<usize>,
    pub matched: u32,
    pub tier: Tier,
    pub reason: Reason,
    /// kvExactMode 1: the decode endpoint.
    pub decode: Option<usize>,
    /// True when this was a positive-overlap decision (counts toward `hit_seq`).
    pub counted_hit: bool,
}

fn eligible(e: &EpView, mode: ExactMode) -> bool {
    e.healthy
        && match mode {
            ExactMode::PrefillDecode => e.role == EpRole::Prefill,
            _ => e.role != EpRole::Decode || mode == ExactMode::Off,
        }
}

/// The per-endpoint cap: `max(1, ceil(mlf * total * w / (100 * sum_w)))`.
pub fn cap_for(total_load: u64, weight: u32, sum_w: u64, mlf: u32) -> u64 {
    let num = u128::from(mlf) * u128::from(total_load) * u128::from(weight);
    let den = 100u128 * u128::from(sum_w.max(1));
    (num.div_ceil(den) as u64).max(1)
}

/// Decides one request.
pub fn decide(inp: &ScoreInput<'_>) -> Decision {
    let mode = inp.exact_mode;
    let cands: Vec<usize> = (0..inp.eps.len())
        .filter(|&i| eligible(&inp.eps[i], mode))
        .collect();
    let decode = if mode == ExactMode::PrefillDecode {
        least_loaded(inp.eps, |e| e.healthy && e.role == EpRole::Decode)
    } else {
        None
    };
    let fallback = |reason: Reason| Decision {
        ep: fallback_pick(inp, &cands),
        matched: 0,
        tier: Tier::Fallback,
        reason,
        decode,
        counted_hit: false,
    };
    if !inp.kv_enabled {
        return fallback(Reason::KvOff);
    }
    if inp.token_count < inp.settings.min_match_tokens {
        return fallback(Reason::MissShortPrompt);
    }
    if inp.n_keys == 0 {
        return fallback(Reason::MissNoKeys);
    }
    let positive: Vec<usize> = cands
        .iter()
        .copied()
        .filter(|&i| inp.eps[i].matched > 0)
        .collect();
    if positive.is_empty() {
        return fallback(Reason::MissNoOverlap);
    }
    let total_load: u64 = cands.iter().map(|&i| inp.eps[i].load).sum();
    let sum_w: u64 = cands.iter().map(|&i| u64::from(inp.eps[i].weight)).sum();
    let mlf = inp.settings.mean_load_factor;
    let over = |i: usize| inp.eps[i].load >= cap_for(total_load, inp.eps[i].weight, sum_w, mlf);
    // Best overlap, ties by lower load, then lower index.
    let better = |a: usize, b: usize| {
        let (ea, eb) = (&inp.eps[a], &inp.eps[b]);
        (ea.matched, std::cmp::Reverse(ea.load), std::cmp::Reverse(a))
            > (eb.matched, std::cmp::Reverse(eb.load), std::cmp::Reverse(b))
    };
    let best_of = |set: &mut dyn Iterator<Item = usize>| {
        set.fold(None, |acc: Option<usize>, i| match acc {
            Some(a) if !better(i, a) => Some(a),
            _ => Some(i),
        })
    };
    let argmax = best_of(&mut positive.iter().copied());
    let mut chosen = match inp.settings.lb_mode {
        LbMode::Off => argmax,
        LbMode::Hard => best_of(&mut positive.iter().copied().filter(|&i| !over(i))).or(argmax),
        LbMode::Soft => {
            let p = inp.settings.load_penalty;
            positive
                .iter()
                .copied()
                .fold(None, |acc: Option<(usize, f64)>, i| {
                    let s = f64::from(inp.eps[i].matched) - p * inp.eps[i].load as f64;
                    match acc {
                        Some((_, bs)) if bs >= s => acc,
                        _ => Some((i, s)),
                    }
                })
                .map(|(i, _)| i)
        }
    };
    let relief = match inp.settings.spill_relief {
        SpillRelief::On => true,
        SpillRelief::Off => false,
        SpillRelief::Auto => mode == ExactMode::SingleRole,
    };
    if relief {
        if let Some(c) = chosen {
            if over(c) {
                if let Some(t) = least_loaded_of(
                    inp.eps,
                    cands.iter().copied().filter(|&i| i != c && !over(i)),
                ) {
                    chosen = Some(t);
                }
            }
        }
    }
    let Some(c) = chosen else {
        return fallback(Reason::MissNoOverlap);
    };
    // Cold-start seeding takes every Nth hit.
    let s = inp.settings;
    if s.coldstart_seed_n > 0
        && s.coldstart_min_blocks > 0
        && (inp.hit_seq + 1) % s.coldstart_seed_n == 0
    {
        if let Some(&cold) = cands
            .iter()
            .find(|&&i| inp.eps[i].blocks < s.coldstart_min_blocks)
        {
            return Decision {
                ep: Some(cold),
                matched: inp.eps[cold].matched,
                tier: Tier::Tier15,
                reason: Reason::ColdSeed,
                decode,
                counted_hit: true,
            };
        }
    }
    let reason = if Some(c) == argmax {
        Reason::Hit
    } else {
        Reason::Spill
    };
    Decision {
        ep: Some(c),
        matched: inp.eps[c].matched,
        tier: Tier::Tier15,
        reason,
        decode,
        counted_hit: true,
    }
}

fn least_loaded(eps: &[EpView], f: impl Fn(&EpView) -> bool) -> Option<usize> {
    least_loaded_of(eps, (0..eps.len()).filter(|&i| f(&eps[i])))
}

fn least_loaded_of(eps: &[EpView], it: impl Iterator<Item = usize>) -> Option<usize> {
    it.min_by_key(|&i| (eps[i].load, i))
}

fn fallback_pick(inp: &ScoreInput<'_>, cands: &[usize]) -> Option<usize> {
    if cands.is_empty() {
        return None;
    }
    match inp.sel {
        Sel::RoundRobin => cands
            .get((inp.rr_seq % cands.len() as u64) as usize)
            .copied(),
        Sel::Hash => match inp.affinity {
            Some(h) => inp.ring.lookup(h, |i| cands.contains(&i)),
            None => cands
                .get((inp.rr_seq % cands.len() as u64) as usize)
                .copied(),
        },
        Sel::Priority => cands
            .iter()
            .copied()
            .max_by_key(|&i| (inp.eps[i].weight, std::cmp::Reverse(i))),
        Sel::LeastLoaded => least_loaded_of(inp.eps, cands.iter().copied()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(matched: u32, load: u64) -> EpView {
        EpView {
            weight: 1,
            role: EpRole::Any,
            healthy: true,
            load,
            blocks: 100,
            matched,
        }
    }

    fn run(eps: &[EpView], s: &Settings, mode: ExactMode, hit_seq: u64) -> Decision {
        let ring = HashRing::new(
            &(0..eps.len())
                .map(|i| format!("10.0.0.{i}:80"))
                .collect::<Vec<_>>(),
        );
        decide(&ScoreInput {
            exact_mode: mode,
            kv_enabled: true,
            sel: Sel::RoundRobin,
            eps,
            n_keys: 10,
            token_count: 160,
            affinity: None,
            ring: &ring,
            hit_seq,
            rr_seq: 0,
            settings: s,
        })
    }

    #[test]
    fn cap_formula_matches_the_seed() {
        assert_eq!(cap_for(100, 4, 5, 175), 140);
        assert_eq!(cap_for(100, 1, 5, 175), 35);
        assert_eq!(cap_for(0, 1, 5, 175), 1);
    }

    #[test]
    fn highest_overlap_under_cap_wins() {
        let s = Settings::default();
        let d = run(
            &[ep(10, 0), ep(3, 0), ep(7, 0)],
            &s,
            ExactMode::SingleRole,
            0,
        );
        assert_eq!((d.ep, d.reason, d.matched), (Some(0), Reason::Hit, 10));
    }

    #[test]
    fn over_cap_spills_to_next_best() {
        let s = Settings {
            spill_relief: SpillRelief::Off,
            ..Settings::default()
        };
        let d = run(
            &[ep(10, 1000), ep(3, 0), ep(7, 0)],
            &s,
            ExactMode::SingleRole,
            0,
        );
        assert_eq!((d.ep, d.reason), (Some(2), Reason::Spill));
    }

    #[test]
    fn relief_moves_a_lone_hot_endpoint() {
        let s = Settings::default();
        // Only ep0 has overlap and it is over its cap: relief (auto = on for mode 3) moves to idle ep1.
        let d = run(
            &[ep(10, 100), ep(0, 0), ep(0, 5)],
            &s,
            ExactMode::SingleRole,
            0,
        );
        assert_eq!((d.ep, d.reason), (Some(1), Reason::Spill));
        // Auto is off for prefill/decode.
        let mut eps = [ep(10, 100), ep(0, 0), ep(0, 0)];
        eps[0].role = EpRole::Prefill;
        eps[1].role = EpRole::Prefill;
        eps[2].role = EpRole::Decode;
        let d = run(&eps, &s, ExactMode::PrefillDecode, 0);
        assert_eq!((d.ep, d.reason, d.decode), (Some(0), Reason::Hit, Some(2)));
    }

    #[test]
    fn unhealthy_is_never_chosen() {
        let s = Settings::default();
        let mut eps = [ep(10, 0), ep(5, 0)];
        eps[0].healthy = false;
        let d = run(&eps, &s, ExactMode::SingleRole, 0);
        assert_eq!(d.ep, Some(1));
        eps[1].healthy = false;
        assert_eq!(run(&eps, &s, ExactMode::SingleRole, 0).ep, None);
    }

    #[test]
    fn cold_seed_every_nth_hit() {
        let s = Settings {
            coldstart_min_blocks: 10,
            coldstart_seed_n: 3,
            ..Settings::default()
        };
        let mut eps = [ep(10, 0), ep(0, 0)];
        eps[1].blocks = 0;
        assert_eq!(run(&eps, &s, ExactMode::SingleRole, 0).reason, Reason::Hit);
        let d = run(&eps, &s, ExactMode::SingleRole, 2);
        assert_eq!((d.ep, d.reason), (Some(1), Reason::ColdSeed));
    }

    #[test]
    fn misses_fall_back() {
        let s = Settings {
            min_match_tokens: 1000,
            ..Settings::default()
        };
        assert_eq!(
            run(&[ep(10, 0)], &s, ExactMode::SingleRole, 0).reason,
            Reason::MissShortPrompt
        );
        let s = Settings::default();
        let d = run(&[ep(0, 0), ep(0, 0)], &s, ExactMode::SingleRole, 0);
        assert_eq!(
            (d.tier, d.reason, d.ep),
            (Tier::Fallback, Reason::MissNoOverlap, Some(0))
        );
    }

    #[test]
    fn prefill_decode_scores_prefill_only() {
        let s = Settings::default();
        let mut eps = [ep(0, 0), ep(10, 5), ep(3, 2), ep(0, 1)];
        eps[0].role = EpRole::Prefill;
        eps[1].role = EpRole::Decode;
        eps[2].role = EpRole::Prefill;
        eps[3].role = EpRole::Decode;
        let d = run(&eps, &s, ExactMode::PrefillDecode, 0);
        assert_eq!((d.ep, d.decode, d.reason), (Some(2), Some(3), Reason::Hit));
    }

    #[test]
    fn consistent_hash_is_sticky_and_skips_unhealthy() {
        let addrs: Vec<String> = (0..4).map(|i| format!("10.0.0.{i}:80")).collect();
        let ring = HashRing::new(&addrs);
        let mut eps = vec![ep(0, 0); 4];
        let s = Settings::default();
        let mk = |eps: &[EpView], h: u64| {
            decide(&ScoreInput {
                exact_mode: ExactMode::SingleRole,
                kv_enabled: true,
                sel: Sel::Hash,
                eps,
                n_keys: 1,
                token_count: 16,
                affinity: Some(h),
                ring: &ring,
                hit_seq: 0,
                rr_seq: 7,
                settings: &s,
            })
            .ep
        };
        let first = mk(&eps, HashRing::key_hash("tenant-a"));
        assert_eq!(first, mk(&eps, HashRing::key_hash("tenant-a")));
        let Some(f) = first else { return };
        eps[f].healthy = false;
        let second = mk(&eps, HashRing::key_hash("tenant-a"));
        assert!(second.is_some() && second != first);
    }
}
