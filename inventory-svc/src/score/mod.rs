//! Tier 1.5 scoring: pick an endpoint from per-endpoint prefix overlap, load, health and the rule.
//!
//! Pure and synchronous: [`decide`] takes a snapshot ([`ScoreInput`]) and returns a [`Decision`];
//! the API layer gathers the snapshot (index match, loads, health) and records the outcome. This
//! keeps every branch (hit, spill, cold seed, each miss reason, prefill/decode) unit-testable.
//!
//! Policy (the seed's Tier 1.5):
//! * prompts shorter than `LLB_KV_MIN_MATCH_TOKENS`, rules in warm-up and rules without KV events
//!   skip KV scoring and fall back to the rule's `sel`;
//! * positive overlap: each endpoint's cap is `max(1, ceil(mlf/100 x total load x w_i / sum w))`,
//!   the total including the request being routed;
//!   the highest overlap under its cap wins, ties by lower load then lower index;
//! * spill relief (tri-state): a winner at or over its cap spills to the under-cap endpoint with
//!   the most overlap, ties least loaded;
//! * hot families (a hot prefix): a family whose share of the rule's recent requests
//!   ([`Recall::heat_permille`]) exceeds twice its home's share of the fleet's weight (or 60%)
//!   is replicated:
//!   equal copies are chosen by load instead of by home, and the endpoint it would go to spills
//!   (tri-state relief permitting) as soon as it carries its fair share of the load (mean load
//!   factor 100%, at least [`HOT_MIN_INFLIGHT`]) rather than at the mean load cap, so it queues
//!   on no engine while another has room;
//! * cold-start seeding: every Nth hit goes to the lowest-index endpoint holding fewer than the
//!   cold threshold of blocks, so a new replica gets warm;
//! * miss: the rule's `sel` — round robin, consistent hash on the affinity key (150 virtual nodes
//!   per endpoint), priority (weight), least loaded; unhealthy endpoints are never chosen;
//! * kvExactMode 1: only prefill endpoints are scored; the decode endpoint is the least loaded.
//!
//! Placement that survives evictions (see `docs/placement.md`):
//! * the [`PlacementMemory`] remembers which endpoint served each prefix family; its home counts
//!   as holding the remembered depth, so it wins when the exact inventory has no or a shorter
//!   match (an exact longer match still wins), and ties between equal overlaps go to the home;
//! * a new family (no overlap anywhere) under `sel` round robin or least loaded is placed on the
//!   under-cap endpoint with the most free cache (capacity minus blocks homed there), so the
//!   fleet's aggregate cache holds distinct prefixes instead of duplicates.

mod capacity;
mod memory;
mod ring;

pub use capacity::parse_num_gpu_blocks;
pub use memory::{PlacementMemory, Recall, Update};
pub use ring::HashRing;

use crate::rules::{EpRole, ExactMode, Sel};
use crate::settings::{LbMode, Placement, Settings, SpillRelief};

/// A hot family spills at its fair share only once its endpoint has at least this many requests
/// in flight: fewer run in one engine batch without queueing, and spilling them would copy the
/// family to every endpoint of a lightly loaded fleet (the small preset's doc-qa workload lost 15
/// points of cached tokens that way). A stand-in for the engine's batch size, which the scrape
/// does not read yet (the simulator runs 4 at a time; vLLM's `max_num_seqs` is larger).
pub const HOT_MIN_INFLIGHT: u64 = 4;

/// A family with more than this share of the rule's recent requests is hot whatever the fleet size.
pub const HOT_MAX_SHARE_PERMILLE: u64 = 600;

pub use kvroute_core::wire::{Reason, Tier};

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
    /// Cache capacity in blocks (scraped `num_gpu_blocks` or configured); 0 = unknown.
    pub capacity: u64,
    /// Distinct blocks of remembered families homed here (the placement memory's footprint).
    pub homed: u64,
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
    /// The placement memory's answer for this request.
    pub recall: Option<Recall>,
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
    /// True when a miss was placed by free cache (footprint) rather than by `sel`.
    pub placed: bool,
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
        placed: false,
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
    let home = inp.recall.map(|r| r.ep);
    let total_load: u64 = cands.iter().map(|&i| inp.eps[i].load).sum();
    let sum_w: u64 = cands.iter().map(|&i| u64::from(inp.eps[i].weight)).sum();
    let relief = match inp.settings.spill_relief {
        SpillRelief::On => true,
        SpillRelief::Off => false,
        SpillRelief::Auto => mode == ExactMode::SingleRole,
    };
    // A hot family: more of the rule's recent requests arrive at this prefix than the home's
    // share of the fleet serves. One engine cannot carry it without queueing, so (with spill
    // relief on) it is replicated: its copies are chosen by load, not by home, and it spills
    // at the home's fair share instead of at the mean load cap.
    // "More" means twice the home's share, or 60% of all requests when that is lower: families
    // that merely split the traffic evenly (3 over 3 endpoints) must stay one copy each, and
    // noise around an even split must not copy them.
    let hot = relief
        && inp.recall.is_some_and(|r| {
            let share = 2000 * u64::from(inp.eps[r.ep].weight) / sum_w.max(1);
            cands.contains(&r.ep) && u64::from(r.heat_permille) > share.min(HOT_MAX_SHARE_PERMILLE)
        });
    // Overlap as scored: the exact match, or the remembered depth on the family's home.
    let overlap = |i: usize| match inp.recall {
        Some(r) if r.ep == i => inp.eps[i].matched.max(r.depth),
        _ => inp.eps[i].matched,
    };
    let positive: Vec<usize> = cands.iter().copied().filter(|&i| overlap(i) > 0).collect();
    let mlf = inp.settings.mean_load_factor;
    // The cap counts the request being routed: with it, the fleet carries `total_load + 1`, and an
    // endpoint is over its cap when taking this request too would exceed it. Without the +1 a
    // lone conversation (one request recently sent to its home, the rest of the fleet idle) would
    // spill every follow-up turn away from the cache that holds it.
    let over = |i: usize| inp.eps[i].load >= cap_for(total_load + 1, inp.eps[i].weight, sum_w, mlf);
    if positive.is_empty() {
        return match place(inp, &cands, &over) {
            Some(ep) => Decision {
                ep: Some(ep),
                placed: true,
                ..fallback(Reason::MissNoOverlap)
            },
            None => fallback(Reason::MissNoOverlap),
        };
    }
    // Best overlap, ties to the family's home (so equal copies do not split a family; a hot
    // family's copies share its load instead), then lower load, then lower index.
    let better = |a: usize, b: usize| {
        let (ea, eb) = (&inp.eps[a], &inp.eps[b]);
        (
            overlap(a),
            !hot && home == Some(a),
            std::cmp::Reverse(ea.load),
            std::cmp::Reverse(a),
        ) > (
            overlap(b),
            !hot && home == Some(b),
            std::cmp::Reverse(eb.load),
            std::cmp::Reverse(b),
        )
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
                    let s = f64::from(overlap(i)) - p * inp.eps[i].load as f64;
                    match acc {
                        Some((_, bs)) if bs >= s => acc,
                        _ => Some((i, s)),
                    }
                })
                .map(|(i, _)| i)
        }
    };
    // A hot family spills once its endpoint carries its fair share (mean load factor 100%) and at
    // least an engine batch: past that the engine queues while another has room.
    let over_fair = |i: usize| {
        inp.eps[i].load
            >= cap_for(total_load + 1, inp.eps[i].weight, sum_w, 100).max(HOT_MIN_INFLIGHT)
    };
    let full = |i: usize| over(i) || (hot && over_fair(i));
    if relief {
        if let Some(c) = chosen {
            if full(c) {
                // The under-cap endpoint already holding most of the request (so a hot family
                // spills onto one copy rather than onto every endpoint), ties least loaded.
                if let Some(t) = cands
                    .iter()
                    .copied()
                    .filter(|&i| i != c && !full(i))
                    .min_by_key(|&i| (std::cmp::Reverse(overlap(i)), inp.eps[i].load, i))
                {
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
                placed: false,
            };
        }
    }
    let reason = if Some(c) != argmax {
        Reason::Spill
    } else if overlap(c) > inp.eps[c].matched {
        Reason::Remembered
    } else {
        Reason::Hit
    };
    Decision {
        ep: Some(c),
        matched: inp.eps[c].matched,
        tier: Tier::Tier15,
        reason,
        decode,
        counted_hit: true,
        placed: false,
    }
}

/// Footprint-aware placement of a new prefix family: among under-cap candidates, the one with the
/// most free cache (capacity minus homed blocks), ties by lower load then lower index. Only for
/// `sel` round robin and least loaded (hash and priority express an operator's intent), and only
/// when placement is on. Capacity unknown everywhere compares homed blocks alone.
fn place(inp: &ScoreInput<'_>, cands: &[usize], over: &dyn Fn(usize) -> bool) -> Option<usize> {
    if inp.settings.placement != Placement::Footprint
        || !matches!(inp.sel, Sel::RoundRobin | Sel::LeastLoaded)
    {
        return None;
    }
    // An endpoint of unknown capacity is assumed as large as the largest known one.
    let known = cands
        .iter()
        .map(|&i| inp.eps[i].capacity)
        .max()
        .unwrap_or(0);
    let free = |i: usize| {
        let e = &inp.eps[i];
        let cap = if e.capacity == 0 { known } else { e.capacity };
        cap as i128 - e.homed as i128
    };
    let pick = |it: &mut dyn Iterator<Item = usize>| {
        it.max_by_key(|&i| {
            (
                free(i),
                std::cmp::Reverse(inp.eps[i].load),
                std::cmp::Reverse(i),
            )
        })
    };
    pick(&mut cands.iter().copied().filter(|&i| !over(i)))
        .or_else(|| least_loaded_of(inp.eps, cands.iter().copied()))
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
            capacity: 0,
            homed: 0,
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
            recall: None,
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

    fn run_recall(eps: &[EpView], s: &Settings, recall: Option<Recall>) -> Decision {
        let ring = HashRing::new(&["a:1".to_owned(), "b:1".to_owned(), "c:1".to_owned()]);
        decide(&ScoreInput {
            exact_mode: ExactMode::SingleRole,
            kv_enabled: true,
            sel: Sel::RoundRobin,
            eps,
            n_keys: 40,
            token_count: 640,
            affinity: None,
            ring: &ring,
            hit_seq: 0,
            rr_seq: 1,
            recall,
            settings: s,
        })
    }

    #[test]
    fn remembered_home_wins_until_an_exact_match_is_longer() {
        let s = Settings::default();
        let home = Some(Recall {
            ep: 2,
            depth: 32,
            heat_permille: 0,
        });
        // Evicted everywhere: the family goes home, not by round robin.
        let d = run_recall(&[ep(0, 0), ep(0, 0), ep(0, 0)], &s, home);
        assert_eq!(
            (d.ep, d.tier, d.reason, d.matched),
            (Some(2), Tier::Tier15, Reason::Remembered, 0)
        );
        // A short exact match elsewhere loses to the remembered depth.
        let d = run_recall(&[ep(4, 0), ep(0, 0), ep(1, 0)], &s, home);
        assert_eq!(
            (d.ep, d.reason, d.matched),
            (Some(2), Reason::Remembered, 1)
        );
        // A longer exact match wins.
        let d = run_recall(&[ep(33, 0), ep(0, 0), ep(0, 0)], &s, home);
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // Equal exact copies: the home takes the tie even when busier.
        let d = run_recall(&[ep(40, 0), ep(0, 2), ep(40, 1)], &s, home);
        assert_eq!((d.ep, d.reason), (Some(2), Reason::Hit));
        // A home over its cap still spills (load caps bound hot spots).
        let d = run_recall(&[ep(0, 0), ep(0, 1), ep(0, 9)], &s, home);
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Spill));
    }

    #[test]
    fn hot_families_are_replicated_at_their_fair_share() {
        let s = Settings::default();
        let recall = |heat_permille| {
            Some(Recall {
                ep: 0,
                depth: 32,
                heat_permille,
            })
        };
        // Two endpoints, 7 in flight: the home carries 4, its fair share of 8 (the mean load cap
        // 1.75x is 7, so a family that is not hot stays home and queues).
        let eps = [ep(37, 4), ep(0, 3)];
        let d = run_recall(&eps, &s, recall(400));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // Hot (more than half the recent requests on two equal endpoints): spills to the other.
        let d = run_recall(&eps, &s, recall(800));
        assert_eq!((d.ep, d.reason), (Some(1), Reason::Spill));
        // A lightly loaded fleet (fewer in flight than an engine batch) keeps it home.
        let d = run_recall(&[ep(37, 1), ep(0, 0)], &s, recall(800));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        let d = run_recall(&[ep(37, 3), ep(0, 0)], &s, recall(800));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // Under its fair share the hot family stays home.
        let d = run_recall(&[ep(37, 3), ep(0, 4)], &s, recall(800));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // With a copy on both, the hot family goes to the less loaded copy (a hit, not a spill);
        // a family that is not hot goes home even when it is busier.
        let d = run_recall(&[ep(37, 3), ep(37, 2)], &s, recall(800));
        assert_eq!((d.ep, d.reason), (Some(1), Reason::Hit));
        let d = run_recall(&[ep(37, 3), ep(37, 2)], &s, recall(400));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // Weight 3 of 4: 70% of the requests is hot (over 60%), but 4 in flight is under the
        // home's fair share of the load (6 of 8), so it stays home.
        let mut heavy = [ep(37, 4), ep(0, 3)];
        heavy[0].weight = 3;
        let d = run_recall(&heavy, &s, recall(700));
        assert_eq!(d.ep, Some(0));
        // Three families over three endpoints (a third each, a little noise): not hot, so the
        // home keeps it up to the mean load cap instead of copying it at its fair share.
        let d = run_recall(&[ep(37, 4), ep(0, 1), ep(0, 1)], &s, recall(360));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
        // Spill relief off: no replication.
        let off = Settings {
            spill_relief: SpillRelief::Off,
            ..Settings::default()
        };
        let d = run_recall(&eps, &off, recall(800));
        assert_eq!((d.ep, d.reason), (Some(0), Reason::Hit));
    }

    #[test]
    fn new_families_go_where_they_fit() {
        let s = Settings::default();
        let mut eps = [ep(0, 0), ep(0, 0), ep(0, 0)];
        for (e, (cap, homed)) in eps.iter_mut().zip([(100, 90), (100, 20), (200, 150)]) {
            e.capacity = cap;
            e.homed = homed;
        }
        let d = run_recall(&eps, &s, None);
        assert_eq!(
            (d.ep, d.tier, d.reason, d.placed),
            (Some(1), Tier::Fallback, Reason::MissNoOverlap, true)
        );
        // Unknown capacity is taken as the largest known one.
        eps[1].capacity = 0;
        eps[1].homed = 190;
        assert_eq!(run_recall(&eps, &s, None).ep, Some(2));
        // The most free endpoint at its load cap is passed over.
        eps[2].load = 5;
        assert_eq!(run_recall(&eps, &s, None).ep, Some(0));
        // Placement off: round robin (rr_seq 1).
        let off = Settings {
            placement: Placement::Sel,
            ..Settings::default()
        };
        let d = run_recall(&eps, &off, None);
        assert_eq!((d.ep, d.placed), (Some(1), false));
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
                recall: None,
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
