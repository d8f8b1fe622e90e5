//! Tier 1.5 scoring: pick an endpoint from per-endpoint prefix overlap, load, health and the rule.
//!
//! Pure and synchronous: [`decide`] takes a snapshot ([`ScoreInput`]) and returns a [`Decision`];
//! the API layer gathers the snapshot (index match, loads, health) and records the outcome. This
//! keeps every branch (hit, spill, cold seed, each miss reason, prefill/decode) unit-testable.
//!
//! [`decide`] runs named steps, each a function with its own table test: eligible endpoints
//! (`Pool`), the session tier (the question's bound endpoint), the KV gate (`kv_gate`), spill
//! relief (`spill_relief_on`), overlap and load as scored with the placement memory and hot
//! families (`Scored`), footprint placement of a new family (`place`), the load blend (`blend`),
//! the spill (`spill`), cold seeding (`cold_seed`) and the sticky fallback on a miss
//! (`sel_fallback`).
//!
//! The cascade, first answer wins: the session tier (a conversation id bound to a healthy,
//! eligible endpoint: tier `session`), then prefix scoring (tier `tier15`; the placement memory is
//! its approximate leg: a remembered home counts as holding the remembered depth, so an exact
//! longer match elsewhere still wins, and a decision it made says `remembered`), then the rule's
//! `sel` (tier `fallback`; kvExactMode 1 picks the decode endpoint by load beside whichever
//! tier chose the prefill one).
//!
//! Policy (the seed's Tier 1.5):
//! * prompts shorter than `LLB_KV_MIN_MATCH_TOKENS`, rules in warm-up and rules without KV events
//!   skip KV scoring and fall back to the rule's `sel`;
//! * positive overlap: each endpoint's cap is `max(1, ceil(mlf/100 x total load x w_i / sum w))`,
//!   the total including the request being routed, and never below `KVROUTE_SPILL_MIN_INFLIGHT`
//!   (default 4; 1 is the seed's cap alone);
//!   the highest overlap under its cap wins, ties by lower load then lower index;
//! * spill relief (tri-state): a winner at or over its cap spills to the under-cap endpoint with
//!   the most overlap, ties least loaded;
//! * hot families (a hot prefix): a family whose share of the rule's recent requests
//!   ([`Recall::heat_permille`]) exceeds twice its home's share of the fleet's weight (or 60%)
//!   is replicated:
//!   equal copies are chosen by load instead of by home, and the endpoint it would go to spills
//!   (tri-state relief permitting) as soon as it carries its fair share of the load (mean load
//!   factor 100%, at least `KVROUTE_SPILL_MIN_INFLIGHT`) rather than at the mean load cap, so it
//!   queues on no engine while another has room;
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
mod renumber;
mod ring;
mod session;

pub use capacity::parse_num_gpu_blocks;
pub use memory::{PlacementMemory, Recall, Update};
pub use ring::HashRing;
pub use session::{session_hash, Bound, Dropped, SessionTable};

use crate::index::LowerRun;
use crate::settings::{LoadBlend, Placement, Settings};
use kvroute_core::rule::{EndpointRole, KvMode, Sel};

/// A family with more than this share of the rule's recent requests is hot whatever the fleet size.
pub const HOT_MAX_SHARE_PERMILLE: u64 = 600;

pub use kvroute_core::wire::{Reason, Tier};

/// One endpoint as the scorer sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpView {
    pub weight: u32,
    pub role: Option<EndpointRole>,
    pub healthy: bool,
    /// In-flight estimate.
    pub load: u64,
    /// Blocks the endpoint really holds (for cold-start seeding).
    pub blocks: u64,
    /// Leading request blocks the endpoint holds.
    pub matched: u32,
    /// The blocks after `matched` it holds in a lower cache tier (host memory, then storage),
    /// which its engine loads instead of recomputing.
    pub lower: LowerRun,
    /// Cache capacity in blocks (scraped `num_gpu_blocks` or configured); 0 = unknown.
    pub capacity: u64,
    /// Distinct blocks of remembered families homed here (the placement memory's footprint).
    pub homed: u64,
}

impl EpView {
    /// Leading request blocks the engine reuses rather than recomputes: held (or credited) in
    /// GPU memory, then loaded from a lower tier.
    pub fn reusable(&self) -> u32 {
        self.matched.saturating_add(self.lower.blocks())
    }

    /// The overlap as scored, in hundredths of a GPU block: each GPU block 100, each block of
    /// the lower-tier run its tier's weight (`KVROUTE_CPU_TIER_WEIGHT`,
    /// `KVROUTE_STORAGE_TIER_WEIGHT`).
    fn credit(&self, weights: [u32; 2]) -> u32 {
        self.matched
            .saturating_mul(100)
            .saturating_add(self.lower.cpu.saturating_mul(weights[0]))
            .saturating_add(self.lower.storage.saturating_mul(weights[1]))
    }
}

/// Everything one decision depends on.
pub struct ScoreInput<'a> {
    pub exact_mode: KvMode,
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
    /// The endpoint the question's session is bound to ([`SessionTable`]).
    pub session: Option<usize>,
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
    /// True when the family's remembered home is unhealthy and the request went elsewhere: a
    /// detour, which must not re-home the family (so it goes home once its engine is back; a home
    /// that stays down is forgotten with the memory's TTL, since a detour does not refresh it).
    pub detour: bool,
}

/// Blocks of overlap a decision gave away: the best exact overlap among the endpoints the scorer
/// could pick (healthy; prefill ones in P/D mode) minus the chosen endpoint's credited depth
/// (`matched`, which includes a remembered home's depth).
pub fn given_away(mode: KvMode, views: &[EpView], matched: u32) -> u32 {
    views
        .iter()
        .filter(|v| v.healthy)
        .filter(|v| mode != KvMode::PrefillDecode || v.role == Some(EndpointRole::Prefill))
        .map(EpView::reusable)
        .max()
        .unwrap_or(0)
        .saturating_sub(matched)
}

/// The per-endpoint cap: `max(1, ceil(mlf * total * w / (100 * sum_w)))`.
pub fn cap_for(total_load: u64, weight: u32, sum_w: u64, mlf: u32) -> u64 {
    let num = u128::from(mlf) * u128::from(total_load) * u128::from(weight);
    let den = 100u128 * u128::from(sum_w.max(1));
    (num.div_ceil(den) as u64).max(1)
}

/// Decides one request: the steps below, in order.
pub fn decide(inp: &ScoreInput<'_>) -> Decision {
    let mut d = steps(inp);
    d.detour = inp.recall.is_some_and(|r| {
        d.ep.is_some_and(|c| c != r.ep) && !inp.eps.get(r.ep).is_some_and(|e| e.healthy)
    });
    d
}

fn steps(inp: &ScoreInput<'_>) -> Decision {
    let pool = Pool::of(inp);
    let fallback = |reason: Reason| Decision {
        ep: miss_fallback(inp, &pool.cands),
        matched: 0,
        tier: Tier::Fallback,
        reason,
        decode: pool.decode,
        counted_hit: false,
        placed: false,
        detour: false,
    };
    // A chosen endpoint with the overlap it holds; only Tier 1.5 counts toward `hit_seq`.
    let at = |ep: usize, tier: Tier, reason: Reason| Decision {
        ep: Some(ep),
        matched: inp.eps[ep].reusable(),
        tier,
        reason,
        decode: pool.decode,
        counted_hit: tier == Tier::Tier15,
        placed: false,
        detour: false,
    };
    if let Some(ep) = inp.session.filter(|s| pool.cands.contains(s)) {
        return at(ep, Tier::Session, Reason::Session);
    }
    if let Some(reason) = kv_gate(inp) {
        return fallback(reason);
    }
    let relief = spill_relief_on(inp);
    let scored = Scored::of(inp, &pool, relief);
    let positive: Vec<usize> = pool
        .cands
        .iter()
        .copied()
        .filter(|&i| scored.overlap[i] > 0)
        .collect();
    if positive.is_empty() {
        return match place(inp, &pool, &scored) {
            Some(ep) => Decision {
                ep: Some(ep),
                placed: true,
                ..fallback(Reason::MissNoOverlap)
            },
            None => fallback(Reason::MissNoOverlap),
        };
    }
    let argmax = scored.best(positive.iter().copied());
    let mut chosen = blend(inp, &scored, &positive, argmax);
    if relief {
        chosen = chosen.map(|c| spill(&pool, &scored, c));
    }
    let Some(c) = chosen else {
        return fallback(Reason::MissNoOverlap);
    };
    if let Some(cold) = cold_seed(inp, &pool) {
        return at(cold, Tier::Tier15, Reason::ColdSeed);
    }
    let reason = if Some(c) != argmax {
        Reason::Spill
    } else if scored.overlap[c] > scored.credit[c] {
        Reason::Remembered
    } else {
        Reason::Hit
    };
    at(c, Tier::Tier15, reason)
}

/// Step 1, eligible endpoints: the candidates Tier 1.5 and `sel` choose from (healthy; prefill
/// only under kvExactMode 1; decode never, except with KV off), the decode endpoint of a
/// prefill/decode rule (least loaded healthy decode), and the candidates' total load and weight.
struct Pool {
    cands: Vec<usize>,
    decode: Option<usize>,
    total_load: u64,
    sum_w: u64,
}

impl Pool {
    fn of(inp: &ScoreInput<'_>) -> Pool {
        let mode = inp.exact_mode;
        let cands: Vec<usize> = (0..inp.eps.len())
            .filter(|&i| eligible(&inp.eps[i], mode))
            .collect();
        let decode = if mode == KvMode::PrefillDecode {
            least_loaded(inp.eps, |e| {
                e.healthy && e.role == Some(EndpointRole::Decode)
            })
        } else {
            None
        };
        let total_load = cands.iter().map(|&i| inp.eps[i].load).sum();
        let sum_w = cands.iter().map(|&i| u64::from(inp.eps[i].weight)).sum();
        Pool {
            cands,
            decode,
            total_load,
            sum_w,
        }
    }
}

fn eligible(e: &EpView, mode: KvMode) -> bool {
    e.healthy
        && match mode {
            KvMode::PrefillDecode => e.role == Some(EndpointRole::Prefill),
            _ => e.role != Some(EndpointRole::Decode) || mode == KvMode::Off,
        }
}

/// Step 2, the KV gate: why KV scoring does not run for this request (the rule has no KV, the
/// prompt is shorter than `LLB_KV_MIN_MATCH_TOKENS`, or it has no full block), if it does not.
fn kv_gate(inp: &ScoreInput<'_>) -> Option<Reason> {
    if !inp.kv_enabled {
        Some(Reason::KvOff)
    } else if inp.token_count < inp.settings.core.min_match_tokens() {
        Some(Reason::MissShortPrompt)
    } else if inp.n_keys == 0 {
        Some(Reason::MissNoKeys)
    } else {
        None
    }
}

/// Step 3, spill relief: `LOXILB_KV_SPILL_RELIEF`, unset meaning on for one pool (kvExactMode 3)
/// and off for prefill/decode.
fn spill_relief_on(inp: &ScoreInput<'_>) -> bool {
    inp.settings
        .core
        .spill_relief()
        .applies(inp.exact_mode == KvMode::SinglePool)
}

/// Step 4, overlap and load as scored: each endpoint's overlap (its exact match, or on the
/// family's remembered home the remembered depth when longer: the placement memory), whether
/// the family is hot, and which endpoints are over their load cap (or, for a hot family, over
/// its fair share).
struct Scored<'a> {
    eps: &'a [EpView],
    /// Each endpoint's [`EpView::credit`]: what it holds, in hundredths of a GPU block.
    credit: Vec<u32>,
    /// The credit, or on the family's remembered home the remembered depth when larger.
    overlap: Vec<u32>,
    /// The family's remembered home; it takes ties unless the family is hot.
    home: Option<usize>,
    hot: bool,
    /// At or over the mean load cap, counting the request being routed.
    over: Vec<bool>,
    /// Over the cap, or (hot family) at its fair share and at least an engine batch.
    full: Vec<bool>,
}

impl<'a> Scored<'a> {
    fn of(inp: &ScoreInput<'a>, pool: &Pool, relief: bool) -> Scored<'a> {
        let eps = inp.eps;
        let credit: Vec<u32> = eps
            .iter()
            .map(|e| e.credit(inp.settings.lower_weights))
            .collect();
        let overlap = (0..eps.len())
            .map(|i| match inp.recall {
                Some(r) if r.ep == i => credit[i].max(r.depth.saturating_mul(100)),
                _ => credit[i],
            })
            .collect();
        let hot = relief && is_hot(inp.recall, eps, pool);
        // The cap counts the request being routed: with it, the fleet carries `total_load + 1`,
        // and an endpoint is over its cap when taking this request too would exceed it. Without
        // the +1 a lone conversation (one request recently sent to its home, the rest of the
        // fleet idle) would spill every follow-up turn away from the cache that holds it.
        let total = pool.total_load + 1;
        let mlf = inp.settings.mean_load_factor;
        // Below `KVROUTE_SPILL_MIN_INFLIGHT` an endpoint runs its requests in one engine batch
        // without queueing: on a lightly loaded fleet the cap alone is 1 request, so every second
        // concurrent request of a family would spill and copy it onto another endpoint.
        let floor = inp.settings.spill_min_inflight;
        let over: Vec<bool> = eps
            .iter()
            .map(|e| e.load >= cap_for(total, e.weight, pool.sum_w, mlf).max(floor))
            .collect();
        // A hot family spills once its endpoint carries its fair share (mean load factor 100%)
        // and at least an engine batch: past that the engine queues while another has room.
        let full = eps
            .iter()
            .zip(&over)
            .map(|(e, &over)| {
                over || (hot && e.load >= cap_for(total, e.weight, pool.sum_w, 100).max(floor))
            })
            .collect();
        Scored {
            eps,
            credit,
            overlap,
            home: inp.recall.map(|r| r.ep),
            hot,
            over,
            full,
        }
    }

    /// Best overlap, ties to the family's home (so equal copies do not split a family; a hot
    /// family's copies share its load instead), then lower load, then lower index.
    fn rank(&self, i: usize) -> (u32, bool, std::cmp::Reverse<u64>, std::cmp::Reverse<usize>) {
        (
            self.overlap[i],
            !self.hot && self.home == Some(i),
            std::cmp::Reverse(self.eps[i].load),
            std::cmp::Reverse(i),
        )
    }

    /// The best of `set` by [`Scored::rank`] (the first of equals).
    fn best(&self, set: impl Iterator<Item = usize>) -> Option<usize> {
        set.fold(None, |acc, i| match acc {
            Some(a) if self.rank(i) <= self.rank(a) => Some(a),
            _ => Some(i),
        })
    }
}

/// A hot family: more of the rule's recent requests arrive at this prefix than the home's
/// share of the fleet serves. One engine cannot carry it without queueing, so (with spill
/// relief on) it is replicated: its copies are chosen by load, not by home, and it spills at
/// the home's fair share instead of at the mean load cap. "More" means twice the home's share,
/// or 60% of all requests when that is lower: families that merely split the traffic evenly
/// (3 over 3 endpoints) must stay one copy each, and noise around an even split must not copy
/// them.
fn is_hot(recall: Option<Recall>, eps: &[EpView], pool: &Pool) -> bool {
    recall.is_some_and(|r| {
        let share = 2000 * u64::from(eps[r.ep].weight) / pool.sum_w.max(1);
        pool.cands.contains(&r.ep) && u64::from(r.heat_permille) > share.min(HOT_MAX_SHARE_PERMILLE)
    })
}

/// Step 5, the load blend (`LOXILB_KV_LB_MODE`) among endpoints with overlap: the best overlap
/// (`off`), the best under its cap, else the best (`hard`), or overlap minus penalty x load
/// (`soft`, the first of equal scores).
fn blend(
    inp: &ScoreInput<'_>,
    scored: &Scored<'_>,
    positive: &[usize],
    argmax: Option<usize>,
) -> Option<usize> {
    match inp.settings.load_blend {
        LoadBlend::Off => argmax,
        LoadBlend::Hard => scored
            .best(positive.iter().copied().filter(|&i| !scored.over[i]))
            .or(argmax),
        LoadBlend::Soft => {
            let p = inp.settings.load_penalty;
            positive
                .iter()
                .copied()
                .fold(None, |acc: Option<(usize, f64)>, i| {
                    // Overlap in blocks, as the penalty is calibrated.
                    let s = f64::from(scored.overlap[i]) / 100.0 - p * inp.eps[i].load as f64;
                    match acc {
                        Some((_, bs)) if bs >= s => acc,
                        _ => Some((i, s)),
                    }
                })
                .map(|(i, _)| i)
        }
    }
}

/// Step 6, spill relief (when on): a chosen endpoint that is full moves to the candidate that is
/// not, holding most of the request (so a hot family spills onto one copy rather than onto
/// every endpoint), ties least loaded then lower index; it stays when every candidate is full.
fn spill(pool: &Pool, scored: &Scored<'_>, chosen: usize) -> usize {
    if !scored.full[chosen] {
        return chosen;
    }
    pool.cands
        .iter()
        .copied()
        .filter(|&i| i != chosen && !scored.full[i])
        .min_by_key(|&i| (std::cmp::Reverse(scored.overlap[i]), scored.eps[i].load, i))
        .unwrap_or(chosen)
}

/// Step 7, cold seeding: every `LOXILB_KV_COLDSTART_SEED_N`th hit goes to the lowest-index
/// candidate holding fewer than `LOXILB_KV_COLDSTART_MIN_BLOCKS` blocks, so a new replica gets
/// warm (either at 0 disables it).
fn cold_seed(inp: &ScoreInput<'_>, pool: &Pool) -> Option<usize> {
    let n = u64::from(inp.settings.core.coldstart_seed_n());
    let min_blocks = u64::from(inp.settings.core.coldstart_min_blocks());
    if n == 0 || min_blocks == 0 || (inp.hit_seq + 1) % n != 0 {
        return None;
    }
    pool.cands
        .iter()
        .copied()
        .find(|&i| inp.eps[i].blocks < min_blocks)
}

/// Footprint-aware placement of a new prefix family (no overlap anywhere): among under-cap
/// candidates, the one with the most free cache (capacity minus homed blocks), ties by lower
/// load then lower index; the least loaded when every candidate is at its cap. Only for `sel`
/// round robin and least connections (hash and priority express an operator's intent), and only
/// when placement is on. Capacity unknown everywhere compares homed blocks alone.
fn place(inp: &ScoreInput<'_>, pool: &Pool, scored: &Scored<'_>) -> Option<usize> {
    if inp.settings.placement != Placement::Footprint
        || !matches!(inp.sel, Sel::RoundRobin | Sel::LeastConnections)
    {
        return None;
    }
    let cands = &pool.cands;
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
    cands
        .iter()
        .copied()
        .filter(|&i| !scored.over[i])
        .max_by_key(|&i| {
            (
                free(i),
                std::cmp::Reverse(inp.eps[i].load),
                std::cmp::Reverse(i),
            )
        })
        .or_else(|| least_loaded_of(inp.eps, cands.iter().copied()))
}

fn least_loaded(eps: &[EpView], f: impl Fn(&EpView) -> bool) -> Option<usize> {
    least_loaded_of(eps, (0..eps.len()).filter(|&i| f(&eps[i])))
}

fn least_loaded_of(eps: &[EpView], it: impl Iterator<Item = usize>) -> Option<usize> {
    it.min_by_key(|&i| (eps[i].load, i))
}

/// Where a request goes when no tier above chose (and footprint placement did not place it):
/// a prefill/decode rule (kvExactMode 1) sends it to the least loaded prefill candidate, round
/// robin breaking ties, as loxilb's P/D ladder does; any other rule applies its `sel`.
fn miss_fallback(inp: &ScoreInput<'_>, cands: &[usize]) -> Option<usize> {
    if inp.exact_mode != KvMode::PrefillDecode {
        return sel_fallback(inp, cands);
    }
    let min = cands.iter().map(|&i| inp.eps[i].load).min()?;
    let least: Vec<usize> = cands
        .iter()
        .copied()
        .filter(|&i| inp.eps[i].load == min)
        .collect();
    least
        .get((inp.rr_seq % least.len() as u64) as usize)
        .copied()
}

/// The sticky fallback, the rule's `sel` over the candidates: round robin on the rule's
/// decision counter; consistent hash (`sel` 1 hash and 3 persist) on the affinity key, round
/// robin without one; priority (highest weight, then lower index); least connections (least
/// loaded, then lower index). `None` without candidates.
fn sel_fallback(inp: &ScoreInput<'_>, cands: &[usize]) -> Option<usize> {
    if cands.is_empty() {
        return None;
    }
    let round_robin = || {
        cands
            .get((inp.rr_seq % cands.len() as u64) as usize)
            .copied()
    };
    match inp.sel {
        Sel::RoundRobin => round_robin(),
        Sel::Hash | Sel::Persist => match inp.affinity {
            Some(h) => inp.ring.lookup(h, |i| cands.contains(&i)),
            None => round_robin(),
        },
        Sel::Priority => cands
            .iter()
            .copied()
            .max_by_key(|&i| (inp.eps[i].weight, std::cmp::Reverse(i))),
        Sel::LeastConnections => least_loaded_of(inp.eps, cands.iter().copied()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::settings::{Settings as Shared, SpillRelief};

    /// Production defaults with the shared settings `f` changes (what a test is about).
    fn shared(f: impl FnOnce(Shared) -> Shared) -> Settings {
        let s = Settings::default();
        Settings {
            core: f(s.core.clone()),
            ..s
        }
    }

    fn ep(matched: u32, load: u64) -> EpView {
        EpView {
            weight: 1,
            role: None,
            healthy: true,
            load,
            blocks: 100,
            matched,
            lower: LowerRun::default(),
            capacity: 0,
            homed: 0,
        }
    }

    #[test]
    fn given_away_is_best_eligible_overlap_minus_chosen() {
        let down = EpView {
            healthy: false,
            ..ep(9, 0)
        };
        let prefill = EpView {
            role: Some(EndpointRole::Prefill),
            ..ep(3, 0)
        };
        let decode = EpView {
            role: Some(EndpointRole::Decode),
            ..ep(8, 0)
        };
        let single = KvMode::SinglePool;
        let pd = KvMode::PrefillDecode;
        for (mode, eps, chosen, want) in [
            (single, vec![ep(5, 0), ep(2, 0)], 5, 0),
            (single, vec![ep(5, 0), ep(2, 0)], 2, 3),
            // An unhealthy endpoint's overlap was never available.
            (single, vec![down, ep(2, 0)], 2, 0),
            // A remembered home credited past its exact match gives nothing away.
            (single, vec![ep(4, 0), ep(0, 0)], 6, 0),
            // P/D: only prefill endpoints are scored for overlap.
            (pd, vec![prefill, decode], 1, 2),
            (single, vec![], 0, 0),
        ] {
            assert_eq!(
                given_away(mode, &eps, chosen),
                want,
                "{mode:?} {eps:?} {chosen}"
            );
        }
    }

    /// A single-pool request over `eps` with 10 keys and 160 tokens (each test changes what it
    /// is about).
    fn input<'a>(eps: &'a [EpView], ring: &'a HashRing, s: &'a Settings) -> ScoreInput<'a> {
        ScoreInput {
            exact_mode: KvMode::SinglePool,
            kv_enabled: true,
            sel: Sel::RoundRobin,
            eps,
            n_keys: 10,
            token_count: 160,
            affinity: None,
            ring,
            hit_seq: 0,
            rr_seq: 0,
            recall: None,
            session: None,
            settings: s,
        }
    }

    fn ring(n: usize) -> HashRing {
        HashRing::new(&(0..n).map(|i| format!("10.0.0.{i}:80")).collect::<Vec<_>>())
    }

    fn run(eps: &[EpView], s: &Settings, mode: KvMode, hit_seq: u64) -> Decision {
        let r = ring(eps.len());
        decide(&ScoreInput {
            exact_mode: mode,
            hit_seq,
            ..input(eps, &r, s)
        })
    }

    #[test]
    fn a_bound_session_comes_first_while_its_endpoint_is_eligible() {
        let s = Settings::default();
        let r = ring(3);
        let with = |eps: &[EpView], mode: KvMode, session: Option<usize>, token_count| {
            decide(&ScoreInput {
                exact_mode: mode,
                session,
                token_count,
                ..input(eps, &r, &s)
            })
        };
        // Ahead of a longer exact match elsewhere, and of the KV gate (a short prompt).
        let eps = [ep(10, 0), ep(3, 0), ep(0, 0)];
        for tokens in [160, 1] {
            let d = with(&eps, KvMode::SinglePool, Some(1), tokens);
            assert_eq!(
                (d.ep, d.tier, d.reason),
                (Some(1), Tier::Session, Reason::Session)
            );
            assert_eq!((d.matched, d.counted_hit), (3, false));
        }
        // An unhealthy endpoint, or one outside the rule: the cascade goes on.
        let mut down = eps;
        down[1].healthy = false;
        for (eps, session) in [(&down, Some(1)), (&eps, Some(7)), (&eps, None)] {
            let d = with(eps, KvMode::SinglePool, session, 160);
            assert_eq!(
                (d.ep, d.tier, d.reason),
                (Some(0), Tier::Tier15, Reason::Hit)
            );
        }
        // Prefill/decode: only a prefill endpoint holds a session; the decode one is by load.
        let mut pd = [ep(10, 0), ep(3, 0), ep(0, 1), ep(0, 0)];
        pd[0].role = Some(EndpointRole::Prefill);
        pd[1].role = Some(EndpointRole::Prefill);
        pd[2].role = Some(EndpointRole::Decode);
        pd[3].role = Some(EndpointRole::Decode);
        let d = with(&pd, KvMode::PrefillDecode, Some(1), 160);
        assert_eq!((d.ep, d.tier, d.decode), (Some(1), Tier::Session, Some(3)));
        let d = with(&pd, KvMode::PrefillDecode, Some(2), 160);
        assert_eq!((d.ep, d.tier), (Some(0), Tier::Tier15));
        // Without KV the session still holds.
        let d = with(&eps, KvMode::Off, Some(2), 160);
        assert_eq!((d.ep, d.tier), (Some(2), Tier::Session));
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
        let d = run(&[ep(10, 0), ep(3, 0), ep(7, 0)], &s, KvMode::SinglePool, 0);
        assert_eq!((d.ep, d.reason, d.matched), (Some(0), Reason::Hit, 10));
    }

    #[test]
    fn over_cap_spills_to_next_best() {
        let s = shared(|c| c.with_spill_relief(SpillRelief::Off));
        let d = run(
            &[ep(10, 1000), ep(3, 0), ep(7, 0)],
            &s,
            KvMode::SinglePool,
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
            KvMode::SinglePool,
            0,
        );
        assert_eq!((d.ep, d.reason), (Some(1), Reason::Spill));
        // Auto is off for prefill/decode.
        let mut eps = [ep(10, 100), ep(0, 0), ep(0, 0)];
        eps[0].role = Some(EndpointRole::Prefill);
        eps[1].role = Some(EndpointRole::Prefill);
        eps[2].role = Some(EndpointRole::Decode);
        let d = run(&eps, &s, KvMode::PrefillDecode, 0);
        assert_eq!((d.ep, d.reason, d.decode), (Some(0), Reason::Hit, Some(2)));
    }

    #[test]
    fn unhealthy_is_never_chosen() {
        let s = Settings::default();
        let mut eps = [ep(10, 0), ep(5, 0)];
        eps[0].healthy = false;
        let d = run(&eps, &s, KvMode::SinglePool, 0);
        assert_eq!(d.ep, Some(1));
        eps[1].healthy = false;
        assert_eq!(run(&eps, &s, KvMode::SinglePool, 0).ep, None);
    }

    #[test]
    fn cold_seed_every_nth_hit() {
        let s = shared(|c| c.with_coldstart(3, 10));
        let mut eps = [ep(10, 0), ep(0, 0)];
        eps[1].blocks = 0;
        assert_eq!(run(&eps, &s, KvMode::SinglePool, 0).reason, Reason::Hit);
        let d = run(&eps, &s, KvMode::SinglePool, 2);
        assert_eq!((d.ep, d.reason), (Some(1), Reason::ColdSeed));
    }

    #[test]
    fn misses_fall_back() {
        let s = shared(|c| c.with_min_match_tokens(1000));
        assert_eq!(
            run(&[ep(10, 0)], &s, KvMode::SinglePool, 0).reason,
            Reason::MissShortPrompt
        );
        let s = Settings::default();
        let d = run(&[ep(0, 0), ep(0, 0)], &s, KvMode::SinglePool, 0);
        assert_eq!(
            (d.tier, d.reason, d.ep),
            (Tier::Fallback, Reason::MissNoOverlap, Some(0))
        );
    }

    #[test]
    fn prefill_decode_scores_prefill_only() {
        let s = Settings::default();
        let mut eps = [ep(0, 0), ep(10, 5), ep(3, 2), ep(0, 1)];
        eps[0].role = Some(EndpointRole::Prefill);
        eps[1].role = Some(EndpointRole::Decode);
        eps[2].role = Some(EndpointRole::Prefill);
        eps[3].role = Some(EndpointRole::Decode);
        let d = run(&eps, &s, KvMode::PrefillDecode, 0);
        assert_eq!((d.ep, d.decode, d.reason), (Some(2), Some(3), Reason::Hit));
    }

    /// A lower-tier run extends an endpoint's overlap at its tier's weight: a longer run in host
    /// memory beats a shorter GPU match, a GPU block beats a host-memory one, a tier at weight
    /// 0 earns nothing; the answer's matched blocks count every block the engine reuses.
    #[test]
    fn lower_tiers_are_credited_at_their_weights() {
        let s = Settings::default();
        assert_eq!(s.lower_weights, [75, 25]);
        let r = ring(3);
        let with_lower = |matched, cpu, storage| EpView {
            lower: LowerRun { cpu, storage },
            blocks: 100,
            ..ep(matched, 0)
        };
        let go = |eps: &[EpView], s: &Settings| decide(&input(eps, &r, s));
        // 2 GPU + 4 host-memory blocks (5 blocks of credit) beat 4 GPU blocks.
        let eps = [with_lower(4, 0, 0), with_lower(2, 4, 0)];
        let d = go(&eps, &s);
        assert_eq!((d.ep, d.reason, d.matched), (Some(1), Reason::Hit, 6));
        // 2 GPU + 2 host-memory (3.5) lose to 4 GPU; storage counts a quarter.
        let eps = [
            with_lower(4, 0, 0),
            with_lower(2, 2, 0),
            with_lower(0, 0, 15),
        ];
        assert_eq!(go(&eps, &s).ep, Some(0));
        let eps = [with_lower(3, 0, 0), with_lower(0, 0, 13)];
        assert_eq!(go(&eps, &s).ep, Some(1));
        // A lower run alone is overlap; at weight 0 it is not, and the request is a miss.
        let eps = [with_lower(0, 0, 0), with_lower(0, 3, 0)];
        let d = go(&eps, &s);
        assert_eq!((d.ep, d.tier, d.matched), (Some(1), Tier::Tier15, 3));
        let gpu_only = Settings {
            lower_weights: [0, 0],
            ..Settings::default()
        };
        let d = go(&eps, &gpu_only);
        assert_eq!((d.tier, d.reason), (Tier::Fallback, Reason::MissNoOverlap));
        // Given away counts reusable blocks.
        assert_eq!(given_away(KvMode::SinglePool, &eps, 0), 3);
    }

    /// A prefill/decode miss goes to the least loaded prefill endpoint (round robin among the
    /// least loaded), whatever the rule's `sel`; a single pool's miss applies `sel`.
    #[test]
    fn a_prefill_decode_miss_falls_back_to_the_least_loaded_prefill() {
        let s = shared(|c| c.with_min_match_tokens(1000));
        let r = ring(4);
        let mut eps = [ep(0, 3), ep(0, 1), ep(0, 9), ep(0, 1)];
        eps[0].role = Some(EndpointRole::Prefill);
        eps[1].role = Some(EndpointRole::Prefill);
        eps[2].role = Some(EndpointRole::Decode);
        eps[3].role = Some(EndpointRole::Prefill);
        for (sel, rr_seq, want) in [
            (Sel::RoundRobin, 0, 1),
            (Sel::RoundRobin, 1, 3),
            (Sel::RoundRobin, 2, 1),
            (Sel::Priority, 0, 1),
            (Sel::Hash, 1, 3),
        ] {
            let d = decide(&ScoreInput {
                exact_mode: KvMode::PrefillDecode,
                sel,
                rr_seq,
                ..input(&eps, &r, &s)
            });
            assert_eq!(
                (d.ep, d.tier, d.reason, d.decode),
                (Some(want), Tier::Fallback, Reason::MissShortPrompt, Some(2)),
                "{sel:?} {rr_seq}"
            );
        }
        // One pool: the rule's sel (round robin's first candidate, loaded or not).
        let one = [ep(0, 3), ep(0, 1)];
        let d = decide(&ScoreInput {
            exact_mode: KvMode::SinglePool,
            ..input(&one, &r, &s)
        });
        assert_eq!((d.ep, d.tier), (Some(0), Tier::Fallback));
    }

    fn run_recall(eps: &[EpView], s: &Settings, recall: Option<Recall>) -> Decision {
        let ring = HashRing::new(&["a:1".to_owned(), "b:1".to_owned(), "c:1".to_owned()]);
        decide(&ScoreInput {
            n_keys: 40,
            token_count: 640,
            rr_seq: 1,
            recall,
            ..input(eps, &ring, s)
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
        let off = shared(|c| c.with_spill_relief(SpillRelief::Off));
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
        let r = ring(4);
        let mut eps = vec![ep(0, 0); 4];
        let s = Settings::default();
        let mk = |eps: &[EpView], h: u64| {
            decide(&ScoreInput {
                sel: Sel::Hash,
                n_keys: 1,
                token_count: 16,
                affinity: Some(h),
                rr_seq: 7,
                ..input(eps, &r, &s)
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

    // ---- one table per step ----

    fn roled(role: Option<EndpointRole>, healthy: bool, load: u64) -> EpView {
        EpView {
            role,
            healthy,
            ..ep(0, load)
        }
    }

    #[test]
    fn step_eligible_endpoints() {
        use EndpointRole::{Decode, Prefill};
        let s = Settings::default();
        let r = ring(4);
        // (mode, endpoints) -> (candidates, decode endpoint, total load of the candidates)
        type Row = (KvMode, Vec<EpView>, Vec<usize>, Option<usize>, u64);
        let table: [Row; 5] = [
            (
                KvMode::SinglePool,
                vec![
                    roled(None, true, 1),
                    roled(None, false, 2),
                    roled(None, true, 3),
                ],
                vec![0, 2],
                None,
                4,
            ),
            (
                KvMode::PrefillDecode,
                vec![
                    roled(Some(Prefill), true, 1),
                    roled(Some(Decode), true, 5),
                    roled(Some(Prefill), false, 2),
                    roled(Some(Decode), true, 4),
                ],
                vec![0],
                Some(3),
                1,
            ),
            (
                KvMode::PrefillDecode,
                vec![roled(Some(Prefill), true, 0), roled(Some(Decode), false, 0)],
                vec![0],
                None,
                0,
            ),
            // A decode endpoint is never a candidate of a KV pool, but is under plain load balancing.
            (
                KvMode::SinglePool,
                vec![roled(Some(Decode), true, 1), roled(None, true, 1)],
                vec![1],
                None,
                1,
            ),
            (
                KvMode::Off,
                vec![roled(Some(Decode), true, 1), roled(None, true, 1)],
                vec![0, 1],
                None,
                2,
            ),
        ];
        for (mode, eps, cands, decode, total) in table {
            let inp = ScoreInput {
                exact_mode: mode,
                ..input(&eps, &r, &s)
            };
            let p = Pool::of(&inp);
            assert_eq!(
                (p.cands, p.decode, p.total_load),
                (cands, decode, total),
                "{mode:?} {eps:?}"
            );
        }
    }

    #[test]
    fn step_kv_gate() {
        let s = Settings::default();
        let short = shared(|c| c.with_min_match_tokens(1000));
        let (eps, r) = ([ep(1, 0)], ring(1));
        // (kv enabled, tokens, keys, settings) -> reason to skip KV scoring
        let table = [
            (true, 160, 10, &s, None),
            (false, 160, 10, &s, Some(Reason::KvOff)),
            (true, 15, 10, &s, Some(Reason::MissShortPrompt)),
            (true, 16, 10, &s, None),
            (true, 160, 10, &short, Some(Reason::MissShortPrompt)),
            (true, 160, 0, &s, Some(Reason::MissNoKeys)),
            (false, 0, 0, &s, Some(Reason::KvOff)),
        ];
        for (kv_enabled, token_count, n_keys, settings, want) in table {
            let inp = ScoreInput {
                kv_enabled,
                token_count,
                n_keys,
                ..input(&eps, &r, settings)
            };
            assert_eq!(kv_gate(&inp), want, "{kv_enabled} {token_count} {n_keys}");
        }
    }

    #[test]
    fn step_spill_relief() {
        let (eps, r) = ([ep(1, 0)], ring(1));
        let table = [
            (SpillRelief::Unset, KvMode::SinglePool, true),
            (SpillRelief::Unset, KvMode::PrefillDecode, false),
            (SpillRelief::On, KvMode::PrefillDecode, true),
            (SpillRelief::Off, KvMode::SinglePool, false),
        ];
        for (relief, mode, want) in table {
            let s = shared(|c| c.with_spill_relief(relief));
            let inp = ScoreInput {
                exact_mode: mode,
                ..input(&eps, &r, &s)
            };
            assert_eq!(spill_relief_on(&inp), want, "{relief:?} {mode:?}");
        }
    }

    #[test]
    fn step_overlap_memory_and_caps() {
        let s = Settings::default();
        let r = ring(3);
        // (overlap in blocks, hot, over the cap, full) of `eps` with `recall` remembered
        let scored = |eps: &[EpView], recall: Option<Recall>, relief: bool| {
            let inp = ScoreInput {
                recall,
                ..input(eps, &r, &s)
            };
            let pool = Pool::of(&inp);
            let sc = Scored::of(&inp, &pool, relief);
            let blocks: Vec<u32> = sc.overlap.iter().map(|o| o / 100).collect();
            (blocks, sc.hot, sc.over, sc.full)
        };
        let home = |depth, heat_permille| {
            Some(Recall {
                ep: 0,
                depth,
                heat_permille,
            })
        };
        let none = || vec![false; 3];

        // No memory: the exact match. Caps of 1.75 x (7+1)/3 = 5: ep0 at 5 is over.
        let ep0 = vec![true, false, false];
        assert_eq!(
            scored(&[ep(4, 5), ep(2, 1), ep(0, 1)], None, true),
            (vec![4, 2, 0], false, ep0.clone(), ep0)
        );
        // The home counts the remembered depth when longer, never shorter.
        for (exact, want) in [(4, 32), (40, 40)] {
            let eps = [ep(exact, 0), ep(2, 0), ep(0, 0)];
            assert_eq!(
                scored(&eps, home(32, 0), true),
                (vec![want, 2, 0], false, none(), none()),
                "{exact}"
            );
        }
        // Hot (80% of the requests on a third of the weight): full at its fair share and an
        // engine batch (4 of 7+1 over 3: fair share 3, batch 4). Not hot without spill relief,
        // nor at 60% (not more than the 60% bound).
        let eps = [ep(4, 4), ep(0, 2), ep(0, 1)];
        for (heat, relief, hot) in [(800, true, true), (800, false, false), (600, true, false)] {
            assert_eq!(
                scored(&eps, home(32, heat), relief),
                (vec![32, 0, 0], hot, none(), vec![hot, false, false]),
                "{heat} {relief}"
            );
        }
    }

    #[test]
    fn step_load_blend() {
        let r = ring(3);
        // The load cap alone (no in-flight floor): this step is about the cap.
        let with = |load_blend, load_penalty| Settings {
            load_blend,
            load_penalty,
            spill_min_inflight: 1,
            ..Settings::default()
        };
        // ep0: most overlap but over its cap (1.75 x (9+1)/3 = 6); ep1 under it; ep2 no overlap.
        let eps = [ep(10, 8), ep(6, 1), ep(0, 0)];
        let table = [
            (with(LoadBlend::Off, 1.0), Some(0)),
            (with(LoadBlend::Hard, 1.0), Some(1)),
            // soft: 10 - 8p against 6 - p
            (with(LoadBlend::Soft, 1.0), Some(1)),
            (with(LoadBlend::Soft, 0.5), Some(0)),
            (with(LoadBlend::Soft, 0.0), Some(0)),
        ];
        for (s, want) in table {
            let inp = input(&eps, &r, &s);
            let pool = Pool::of(&inp);
            let sc = Scored::of(&inp, &pool, false);
            let positive = [0, 1];
            let argmax = sc.best(positive.iter().copied());
            assert_eq!(argmax, Some(0));
            assert_eq!(
                blend(&inp, &sc, &positive, argmax),
                want,
                "{:?}",
                s.load_blend
            );
        }
        // hard with every endpoint holding overlap over its cap keeps the best overlap (caps
        // 1.75 x 7 x 1/12 = 2 next to an idle endpoint of weight 10)
        let s = with(LoadBlend::Hard, 1.0);
        let mut busy = [ep(10, 3), ep(6, 3), ep(0, 0)];
        busy[2].weight = 10;
        let inp = input(&busy, &r, &s);
        let pool = Pool::of(&inp);
        let sc = Scored::of(&inp, &pool, false);
        assert_eq!(sc.over, [true, true, false]);
        assert_eq!(blend(&inp, &sc, &[0, 1], Some(0)), Some(0));
    }

    #[test]
    fn step_spill() {
        let s = Settings::default();
        let r = ring(3);
        // (endpoints, chosen) -> where it goes (caps: 1.75 x (total+1)/3)
        let table = [
            // under its cap: stays
            (vec![ep(10, 1), ep(5, 0), ep(0, 0)], 0, 0),
            // over: the under-cap endpoint with the most overlap
            (vec![ep(10, 9), ep(5, 1), ep(7, 2)], 0, 2),
            // equal overlap: the less loaded, then the lower index
            (vec![ep(10, 9), ep(0, 2), ep(0, 1)], 0, 2),
            (vec![ep(10, 9), ep(0, 1), ep(0, 1)], 0, 1),
        ];
        for (eps, chosen, want) in table {
            let inp = input(&eps, &r, &s);
            let pool = Pool::of(&inp);
            let sc = Scored::of(&inp, &pool, true);
            assert_eq!(spill(&pool, &sc, chosen), want, "{eps:?}");
        }
    }

    #[test]
    fn no_endpoint_below_the_in_flight_floor_is_over_its_cap() {
        // 16 endpoints, 3 requests in flight (4 when the home holds 4): the cap alone is
        // ceil(1.75 x 4 / 16) = 1 (1 again with 5), so the family's home (ep0) would spill every
        // concurrent request of the family.
        let r = ring(16);
        let eps_with = |home: u64| {
            let mut eps = vec![ep(0, 0); 16];
            eps[0] = ep(10, home);
            eps[1] = ep(0, 3u64.saturating_sub(home));
            eps
        };
        // (floor, home's load) -> home over its cap (and so full)
        let table = [
            (4, 0, false),
            (4, 1, false),
            (4, 3, false),
            (4, 4, true),
            (1, 0, false),
            (1, 1, true),
            (2, 1, false),
            (2, 2, true),
        ];
        for (floor, home, over) in table {
            let s = Settings {
                spill_min_inflight: floor,
                ..Settings::default()
            };
            let eps = eps_with(home);
            let inp = input(&eps, &r, &s);
            let pool = Pool::of(&inp);
            let sc = Scored::of(&inp, &pool, true);
            assert_eq!(
                (sc.over[0], sc.full[0]),
                (over, over),
                "floor {floor}, load {home}"
            );
        }
        // Through `decide` with the defaults: below the floor the home keeps the family (a hit),
        // at it the request spills.
        for (home, want) in [(1, Reason::Hit), (3, Reason::Hit), (4, Reason::Spill)] {
            let d = run(&eps_with(home), &Settings::default(), KvMode::SinglePool, 0);
            assert_eq!(d.reason, want, "home load {home}");
        }
    }

    #[test]
    fn step_cold_seed() {
        let r = ring(3);
        let mut eps = [ep(10, 0), ep(0, 0), ep(0, 0)];
        eps[1].blocks = 15;
        eps[2].blocks = 0;
        // (seed every n, cold below, hit_seq) -> the seeded endpoint
        let table = [
            // production defaults: every 16th hit, below 16 blocks
            (16, 16, 14, None),
            (16, 16, 15, Some(1)),
            (16, 16, 31, Some(1)),
            (16, 10, 15, Some(2)),
            (16, 0, 15, None),
            (0, 16, 15, None),
            (3, 200, 2, Some(0)),
        ];
        for (n, min_blocks, hit_seq, want) in table {
            let s = shared(|c| c.with_coldstart(n, min_blocks));
            let inp = ScoreInput {
                hit_seq,
                ..input(&eps, &r, &s)
            };
            assert_eq!(
                cold_seed(&inp, &Pool::of(&inp)),
                want,
                "{n} {min_blocks} {hit_seq}"
            );
        }
    }

    #[test]
    fn step_place() {
        let r = ring(3);
        let s = Settings::default();
        let by_sel = Settings {
            placement: Placement::Sel,
            ..Settings::default()
        };
        let mut eps = [ep(0, 0), ep(0, 0), ep(0, 0)];
        for (e, (cap, homed)) in eps.iter_mut().zip([(100, 90), (100, 20), (200, 150)]) {
            e.capacity = cap;
            e.homed = homed;
        }
        // (sel, settings) -> placed endpoint (the most free is ep1)
        let table = [
            (Sel::RoundRobin, &s, Some(1)),
            (Sel::LeastConnections, &s, Some(1)),
            (Sel::Hash, &s, None),
            (Sel::Persist, &s, None),
            (Sel::Priority, &s, None),
            (Sel::RoundRobin, &by_sel, None),
        ];
        for (sel, settings, want) in table {
            let inp = ScoreInput {
                sel,
                ..input(&eps, &r, settings)
            };
            let pool = Pool::of(&inp);
            let sc = Scored::of(&inp, &pool, true);
            assert_eq!(place(&inp, &pool, &sc), want, "{sel:?}");
        }
        // The most free endpoint at its load cap (1.75 x 6/3 = 4) is passed over.
        eps[1].load = 5;
        let inp = input(&eps, &r, &s);
        let pool = Pool::of(&inp);
        let sc = Scored::of(&inp, &pool, true);
        assert_eq!(sc.over, [false, true, false]);
        assert_eq!(place(&inp, &pool, &sc), Some(2));
    }

    #[test]
    fn step_sel_fallback() {
        let r = ring(3);
        let s = Settings::default();
        let mut eps = [ep(0, 3), ep(0, 1), ep(0, 1)];
        eps[0].weight = 2;
        eps[2].weight = 2;
        let key = HashRing::key_hash("tenant-a");
        let sticky = r.lookup(key, |_| true);
        // (sel, rr_seq, affinity, candidates) -> endpoint
        let table = [
            (Sel::RoundRobin, 0, None, vec![0, 1, 2], Some(0)),
            (Sel::RoundRobin, 4, None, vec![0, 1, 2], Some(1)),
            (Sel::RoundRobin, 4, None, vec![0, 2], Some(0)),
            (Sel::Hash, 4, None, vec![0, 1, 2], Some(1)),
            (Sel::Hash, 4, Some(key), vec![0, 1, 2], sticky),
            (Sel::Persist, 0, Some(key), vec![0, 1, 2], sticky),
            (Sel::Priority, 0, None, vec![0, 1, 2], Some(0)),
            (Sel::Priority, 0, None, vec![1, 2], Some(2)),
            (Sel::LeastConnections, 0, None, vec![0, 1, 2], Some(1)),
            (Sel::LeastConnections, 0, None, vec![], None),
        ];
        for (sel, rr_seq, affinity, cands, want) in table {
            let inp = ScoreInput {
                sel,
                rr_seq,
                affinity,
                ..input(&eps, &r, &s)
            };
            assert_eq!(
                sel_fallback(&inp, &cands),
                want,
                "{sel:?} {rr_seq} {cands:?}"
            );
        }
    }
}
