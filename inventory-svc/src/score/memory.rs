//! Placement memory: where each prefix family was sent, remembered past the engine's eviction.
//!
//! The exact inventory forgets a prefix the moment the engine evicts it; a router that then sees no
//! match places the next request of that family by load, and the family ends up cached on several
//! engines that crowd each other out. This memory keeps a bounded map from a request's
//! leading block keys to the endpoint that served them, so the family goes back to its home.
//!
//! Shape: an approximate prefix tree sampled at block indices `3, 7, 15, 31, ...` (`2^k - 1`,
//! k >= 2) plus the request's last full block. Block keys are chained hashes, so the key at index
//! `i` names the whole prefix `0..=i`; the deepest remembered key of a request is its family.
//! Shallower than 4 blocks is not remembered: a shared chat-template header is not a family.
//!
//! Footprint: each entry owns the blocks between the previous sampled index of the request that
//! created it and its own index, credited to its endpoint, so the sum per endpoint estimates the
//! distinct blocks homed there (shared prefixes are counted once, since their entries are shared).
//! Only family prefixes are credited: an entry that a `Keep` decision adds below an entry already
//! remembered (a user's own next turn, another user's message after the shared system prompt)
//! credits nothing. Those tails are private and short-lived (the engine's LRU drops them when the
//! user goes idle), and counting them made placement follow which families happened to be busy
//! early instead of how much shared cache each endpoint must keep (the constrained workload
//! placed 6 of 10 equal system prompts on one of two endpoints).
//!
//! Heat: every recall also counts, with exponential decay (half-life [`HEAT_HALF_LIFE`]), how
//! often the recalled entry answered and how many recalls the rule had; [`Recall::heat_permille`]
//! is the entry's share of the rule's recent recalls. A shared prefix that most requests arrive at
//! (the hot-prefix workload) has a high share; a chat family's later turns each recall the
//! user's own previous turn, so their shares stay small. The scorer replicates a family whose share
//! exceeds one endpoint's share of the fleet (see `score::decide`).
//!
//! Bounds: at most `max_entries` entries (least recently used go first) and a TTL since last use.
//! Invariants: `homed[ep]` equals the sum of `blocks` over live entries of `ep`.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

use super::renumber::{renumbered, Stamped};
use crate::sync::lock;

/// Shallowest block index remembered (4 blocks).
const FIRST_LEVEL: usize = 3;

/// Half-life of the recall counts behind [`Recall::heat_permille`], in seconds: long enough to
/// average over tens of requests at a few dozen requests per second, short enough that a family
/// that cools down stops being replicated within seconds.
pub const HEAT_HALF_LIFE: f32 = 1.0;

/// The rule's recall count is taken as at least this when computing a share, so the first few
/// requests after start (or after a quiet spell) do not look hot.
const HEAT_MIN_RECALLS: f32 = 8.0;

/// A recall count with exponential decay.
#[derive(Clone, Copy, Debug)]
struct Heat {
    value: f32,
    at: Instant,
}

impl Heat {
    fn new(now: Instant) -> Heat {
        Heat {
            value: 0.0,
            at: now,
        }
    }

    /// The count at `now`, decayed since the last update.
    fn at(self, now: Instant) -> f32 {
        let dt = now.saturating_duration_since(self.at).as_secs_f32();
        self.value * 0.5f32.powf(dt / HEAT_HALF_LIFE)
    }

    /// Counts one recall at `now`.
    fn bump(&mut self, now: Instant) {
        self.value = self.at(now) + 1.0;
        self.at = now;
    }
}

/// One remembered prefix.
#[derive(Clone, Copy, Debug)]
struct Entry {
    ep: u16,
    /// Blocks this entry credits to `ep`'s footprint.
    blocks: u32,
    last: Instant,
    /// Matches the LRU queue's stamp while this is the entry's latest position.
    stamp: u64,
    /// Recalls this entry answered (decayed).
    heat: Heat,
}

impl Stamped for Entry {
    fn ep(&self) -> u16 {
        self.ep
    }
    fn with_ep(self, ep: u16) -> Entry {
        Entry { ep, ..self }
    }
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

#[derive(Default)]
struct Inner {
    map: HashMap<u64, Entry>,
    /// (key, stamp) in use order; stale pairs (stamp differs) are skipped lazily.
    lru: VecDeque<(u64, u64)>,
    next_stamp: u64,
    homed: Vec<u64>,
    /// Recalls of the rule (decayed); `None` before the first.
    recalls: Option<Heat>,
}

/// What the memory knows about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recall {
    /// Endpoint index that served the family.
    pub ep: usize,
    /// Leading blocks the remembered family covers.
    pub depth: u32,
    /// This entry's share of the rule's recent recalls, in thousandths (see the module docs).
    pub heat_permille: u32,
}

/// How a decision may change the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// A placement (no usable home): the chosen endpoint becomes the home, replacing any other.
    Place,
    /// Any other decision: refresh entries, add missing ones, keep existing homes.
    Keep,
}

/// The per-rule memory (see the module docs).
pub struct PlacementMemory {
    inner: Mutex<Inner>,
    max_entries: usize,
    ttl: Duration,
}

/// The sampled indices for a request of `n` keys, ascending: `3, 7, 15, ... < n` and `n - 1`.
fn points(n: usize) -> impl Iterator<Item = usize> {
    let levels = std::iter::successors(Some(FIRST_LEVEL), |l| l.checked_mul(2)?.checked_add(1))
        .take_while(move |&l| l < n);
    let last = (n > FIRST_LEVEL).then(|| n - 1);
    levels
        .chain(last)
        .scan(None, |prev: &mut Option<usize>, i| {
            // The last block may coincide with a level: yield each index once.
            let dup = *prev == Some(i);
            *prev = Some(i);
            Some((!dup).then_some(i))
        })
        .flatten()
}

impl PlacementMemory {
    /// An empty memory; `max_entries == 0` disables it (recall finds nothing, record stores nothing).
    pub fn new(max_entries: usize, ttl: Duration) -> PlacementMemory {
        PlacementMemory {
            inner: Mutex::new(Inner::default()),
            max_entries,
            ttl,
        }
    }

    /// The deepest remembered prefix of `keys`, if any is live. Counts the recall toward the
    /// rule's and the entry's heat.
    pub fn recall(&self, keys: &[BlockKey], now: Instant) -> Option<Recall> {
        self.lookup(keys, now, true)
    }

    /// What [`PlacementMemory::recall`] would answer at `now`, counting nothing (the route API's
    /// `explain`).
    pub fn peek(&self, keys: &[BlockKey], now: Instant) -> Option<Recall> {
        self.lookup(keys, now, false)
    }

    fn lookup(&self, keys: &[BlockKey], now: Instant, count: bool) -> Option<Recall> {
        if self.max_entries == 0 {
            return None;
        }
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        let mut total = inner.recalls.unwrap_or_else(|| Heat::new(now));
        total.bump(now);
        if count {
            inner.recalls = Some(total);
        }
        let total = total.value;
        // Deepest first: every index, so a previous turn's last block (not a sampled level of
        // this longer request) is found too. Bounded by the request's key count.
        (FIRST_LEVEL..keys.len()).rev().find_map(|i| {
            let e = inner.map.get_mut(&keys[i].0)?;
            if now.saturating_duration_since(e.last) > self.ttl {
                return None;
            }
            let mut heat = e.heat;
            heat.bump(now);
            if count {
                e.heat = heat;
            }
            let share = (heat.value / total.max(HEAT_MIN_RECALLS)).clamp(0.0, 1.0);
            Some(Recall {
                ep: usize::from(e.ep),
                depth: (i + 1) as u32,
                heat_permille: (share * 1000.0).round() as u32,
            })
        })
    }

    /// Records that `keys` were sent to `ep`.
    pub fn record(&self, keys: &[BlockKey], ep: usize, how: Update, now: Instant) {
        let Ok(ep16) = u16::try_from(ep) else { return };
        if self.max_entries == 0 {
            return;
        }
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        if inner.homed.len() <= ep {
            inner.homed.resize(ep + 1, 0);
        }
        let mut prev: isize = -1;
        // Set once a sampled key is already remembered: deeper new entries are private tails.
        let mut extends = false;
        for i in points(keys.len()) {
            let k = keys[i].0;
            let seg = (i as isize - prev) as u32;
            prev = i as isize;
            inner.next_stamp += 1;
            let stamp = inner.next_stamp;
            match inner.map.get_mut(&k) {
                Some(e) => {
                    extends = true;
                    let expired = now.saturating_duration_since(e.last) > self.ttl;
                    if e.ep != ep16 && (how == Update::Place || expired) {
                        let old = usize::from(e.ep);
                        if let Some(h) = inner.homed.get_mut(old) {
                            *h = h.saturating_sub(u64::from(e.blocks));
                        }
                        inner.homed[ep] += u64::from(e.blocks);
                        e.ep = ep16;
                    }
                    e.last = now;
                    e.stamp = stamp;
                }
                None => {
                    let blocks = if how == Update::Keep && extends {
                        0
                    } else {
                        seg
                    };
                    inner.map.insert(
                        k,
                        Entry {
                            ep: ep16,
                            blocks,
                            last: now,
                            stamp,
                            heat: Heat::new(now),
                        },
                    );
                    inner.homed[ep] += u64::from(blocks);
                }
            }
            inner.lru.push_back((k, stamp));
        }
        self.evict(inner, now);
    }

    /// Drops expired and least recently used entries past the bound; compacts the queue.
    fn evict(&self, inner: &mut Inner, now: Instant) {
        while let Some(&(k, stamp)) = inner.lru.front() {
            let drop = match inner.map.get(&k) {
                Some(e) if e.stamp == stamp => {
                    inner.map.len() > self.max_entries
                        || now.saturating_duration_since(e.last) > self.ttl
                }
                // Stale queue position (the entry was used again later) or already gone.
                _ => {
                    inner.lru.pop_front();
                    continue;
                }
            };
            if !drop {
                break;
            }
            inner.lru.pop_front();
            if let Some(e) = inner.map.remove(&k) {
                if let Some(h) = inner.homed.get_mut(usize::from(e.ep)) {
                    *h = h.saturating_sub(u64::from(e.blocks));
                }
            }
        }
        // Stale pairs accumulate when hot entries are touched; rebuild once they dominate.
        if inner.lru.len() > 4 * inner.map.len() + 1024 {
            let map = &inner.map;
            inner
                .lru
                .retain(|(k, s)| map.get(k).is_some_and(|e| e.stamp == *s));
        }
    }

    /// Distinct blocks homed on endpoint `ep` (the footprint estimate).
    pub fn homed(&self, ep: usize) -> u64 {
        lock(&self.inner).homed.get(ep).copied().unwrap_or(0)
    }

    /// [`homed`](Self::homed) of endpoints `0..n`, under one lock.
    pub fn homed_all(&self, n: usize) -> Vec<u64> {
        let inner = lock(&self.inner);
        (0..n)
            .map(|ep| inner.homed.get(ep).copied().unwrap_or(0))
            .collect()
    }

    /// Takes `old`'s entries into this new memory, each renumbered by `to` (`to[i]`: endpoint
    /// `i`'s index in the new rule, `None` when it is gone, its entries dropped): a rule update
    /// keeps the homes of the endpoints that stay, wherever they now are in the list.
    pub fn absorb(&self, old: &PlacementMemory, to: &[Option<usize>]) {
        if self.max_entries == 0 {
            return;
        }
        let src = lock(&old.inner);
        let mut inner = lock(&self.inner);
        (inner.map, inner.lru) = renumbered(&src.map, &src.lru, to);
        let mut homed = Vec::new();
        for e in inner.map.values() {
            let ep = usize::from(e.ep);
            if homed.len() <= ep {
                homed.resize(ep + 1, 0);
            }
            homed[ep] += u64::from(e.blocks);
        }
        inner.homed = homed;
        inner.next_stamp = src.next_stamp;
        inner.recalls = src.recalls;
    }

    /// Live entries (for tests and gauges).
    pub fn len(&self) -> usize {
        lock(&self.inner).map.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(family: u64, n: usize) -> Vec<BlockKey> {
        (0..n as u64).map(|i| BlockKey(family * 1000 + i)).collect()
    }

    fn at(r: Option<Recall>) -> Option<(usize, u32)> {
        r.map(|r| (r.ep, r.depth))
    }

    /// `peek` answers what `recall` would and counts nothing: recalls after any number of peeks
    /// see the heat of recalls alone.
    #[test]
    fn peek_is_recall_without_counting() {
        let t0 = Instant::now();
        let hot = keys(1, 40);
        let (peeked, plain) = (
            PlacementMemory::new(100, Duration::from_secs(60)),
            PlacementMemory::new(100, Duration::from_secs(60)),
        );
        for m in [&peeked, &plain] {
            m.record(&hot, 1, Update::Place, t0);
        }
        for n in 1..20u64 {
            let t = t0 + Duration::from_millis(10 * n);
            let p = peeked.peek(&hot, t);
            for _ in 0..3 {
                assert_eq!(peeked.peek(&hot, t), p);
            }
            let r = peeked.recall(&hot, t);
            assert_eq!(r, p, "peek differs from the recall it announces");
            assert_eq!(r, plain.recall(&hot, t));
        }
    }

    #[test]
    fn heat_is_the_entry_share_of_recent_recalls() {
        let m = PlacementMemory::new(100, Duration::from_secs(60));
        let t0 = Instant::now();
        let hot = keys(1, 40);
        m.record(&hot, 0, Update::Place, t0);
        let heat = |r: Option<Recall>| r.map_or(0, |r| r.heat_permille);
        // A hot prefix: 4 of every 5 requests share it (each with its own tail), 1 is unknown.
        let mut last = 0;
        for n in 0..50u64 {
            let t = t0 + Duration::from_millis(20 * n);
            if n % 5 == 4 {
                assert_eq!(m.recall(&keys(100 + n, 10), t), None);
            } else {
                let mut req = hot[..37].to_vec();
                req.extend(keys(200 + n, 3));
                last = heat(m.recall(&req, t));
            }
        }
        assert!((700..=900).contains(&last), "hot share {last}");
        // Chat turns recall the user's own previous turn: each entry's share stays small.
        let m = PlacementMemory::new(1000, Duration::from_secs(60));
        let users: Vec<Vec<BlockKey>> = (0..10)
            .map(|u| {
                let mut k = hot[..37].to_vec();
                k.extend(keys(300 + u, 5));
                k
            })
            .collect();
        for u in &users {
            m.record(u, 0, Update::Place, t0);
        }
        let mut max = 0;
        for (n, u) in users.iter().cycle().take(50).enumerate() {
            let mut next = u.clone();
            next.extend(keys(400 + n as u64, 2));
            let h = heat(m.recall(&next, t0 + Duration::from_millis(20 * n as u64)));
            // The first recalls of a rule are not a sample yet ([`HEAT_MIN_RECALLS`]).
            max = max.max(h);
        }
        assert!(max <= 250, "per-user share {max}");
        // Heat decays: after ten half-lives without requests of the family, one recall is a
        // fresh share, not the old count.
        let quiet = t0 + Duration::from_secs(20);
        let mut req = hot[..37].to_vec();
        req.extend(keys(999, 3));
        let m2 = PlacementMemory::new(100, Duration::from_secs(60));
        m2.record(&hot, 0, Update::Place, t0);
        for n in 0..20u64 {
            m2.recall(&req, t0 + Duration::from_millis(n));
        }
        for n in 0..20u64 {
            m2.recall(&keys(500 + n, 8), quiet + Duration::from_millis(n));
        }
        assert!(heat(m2.recall(&req, quiet + Duration::from_millis(30))) < 100);
    }

    #[test]
    fn sampled_points_are_levels_and_the_last_block() {
        assert_eq!(points(3).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(points(4).collect::<Vec<_>>(), vec![3]);
        assert_eq!(points(8).collect::<Vec<_>>(), vec![3, 7]);
        assert_eq!(points(20).collect::<Vec<_>>(), vec![3, 7, 15, 19]);
    }

    #[test]
    fn recall_finds_the_deepest_family() {
        let m = PlacementMemory::new(100, Duration::from_secs(60));
        let now = Instant::now();
        let a = keys(1, 20);
        m.record(&a, 2, Update::Place, now);
        // A longer request of the same family (next chat turn) finds the previous last block.
        let mut longer = a.clone();
        longer.extend(keys(9, 10));
        assert_eq!(at(m.recall(&longer, now)), Some((2, 20)));
        // Sharing only 3 blocks is not a family.
        let mut other = a[..3].to_vec();
        other.extend(keys(5, 10));
        assert_eq!(m.recall(&other, now), None);
        // The footprint counts each block once.
        assert_eq!(m.homed(2), 20);
        m.record(&a, 2, Update::Keep, now);
        assert_eq!(m.homed(2), 20);
    }

    #[test]
    fn only_family_prefixes_count_toward_the_footprint() {
        let m = PlacementMemory::new(100, Duration::from_secs(60));
        let now = Instant::now();
        let a = keys(1, 20);
        m.record(&a, 0, Update::Place, now);
        assert_eq!(m.homed(0), 20);
        // Another user of family A (its system prompt, then 12 blocks of its own): a hit at A's
        // home adds entries for the private tail but no footprint.
        let mut user = a[..16].to_vec();
        user.extend(keys(7, 12));
        m.record(&user, 0, Update::Keep, now);
        assert_eq!(at(m.recall(&user, now)), Some((0, 28)));
        assert_eq!(m.homed(0), 20);
        // The same user's next turn neither.
        let mut next = user.clone();
        next.extend(keys(8, 6));
        m.record(&next, 0, Update::Keep, now);
        assert_eq!(m.homed(0), 20);
        // A family first seen through an exact hit (nothing remembered yet) is a family.
        m.record(&keys(2, 10), 1, Update::Keep, now);
        assert_eq!(m.homed(1), 10);
    }

    #[test]
    fn keep_does_not_move_a_home_but_place_does() {
        let m = PlacementMemory::new(100, Duration::from_secs(60));
        let now = Instant::now();
        let a = keys(1, 8);
        m.record(&a, 0, Update::Place, now);
        m.record(&a, 1, Update::Keep, now);
        assert_eq!(m.recall(&a, now).map(|r| r.ep), Some(0));
        m.record(&a, 1, Update::Place, now);
        assert_eq!(m.recall(&a, now).map(|r| r.ep), Some(1));
        assert_eq!((m.homed(0), m.homed(1)), (0, 8));
    }

    #[test]
    fn bounded_by_entries_and_ttl() {
        let m = PlacementMemory::new(4, Duration::from_secs(10));
        let t0 = Instant::now();
        for f in 0..10 {
            m.record(&keys(f, 8), (f % 3) as usize, Update::Place, t0);
        }
        assert!(m.len() <= 4, "{}", m.len());
        let total: u64 = (0..3).map(|e| m.homed(e)).sum();
        assert_eq!(total, 4 * 4, "each live entry credits 4 blocks");
        // The newest family survives, the oldest went.
        assert!(m.recall(&keys(9, 8), t0).is_some());
        assert!(m.recall(&keys(0, 8), t0).is_none());
        // Past the TTL nothing is recalled, and the next record sweeps the footprint.
        let late = t0 + Duration::from_secs(11);
        assert!(m.recall(&keys(9, 8), late).is_none());
        m.record(&keys(20, 4), 0, Update::Place, late);
        assert_eq!((m.len(), m.homed(0) + m.homed(1) + m.homed(2)), (1, 4));
    }

    #[test]
    fn homes_past_index_255_are_kept() {
        let m = PlacementMemory::new(100, Duration::from_secs(60));
        let now = Instant::now();
        let a = keys(1, 8);
        m.record(&a, 1000, Update::Place, now);
        assert_eq!(at(m.recall(&a, now)), Some((1000, 8)));
        assert_eq!(m.homed(1000), 8);
        m.record(&a, 300, Update::Place, now);
        assert_eq!((m.homed(1000), m.homed(300)), (0, 8));
    }

    #[test]
    fn disabled_memory_is_inert() {
        let m = PlacementMemory::new(0, Duration::from_secs(10));
        let now = Instant::now();
        m.record(&keys(1, 8), 0, Update::Place, now);
        assert!(m.recall(&keys(1, 8), now).is_none() && m.is_empty());
    }
}
