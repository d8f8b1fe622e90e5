//! Speculative holders: a routing decision credits the chosen endpoint with the request's keys
//! past what it already holds, for a short TTL, covering the window before the engine's
//! BlockStored arrives.
//!
//! A credit is stored once per decision, not once per key: the endpoint, its deadline and the
//! credited run of keys (a segment of one request's key chain), found by the run's first key.
//! Crediting a whole 512-key prompt (a route miss) is one copy of the keys and one map insert.
//!
//! Query ([`Cursor`]): the match walks a request's keys in order; where a key starts a live
//! credit, the credit joins the walk and names its endpoint at every following position for as
//! long as the request's keys equal the credit's. Keys are chained (a block's key depends on
//! every block before it), so a request holding a credit's key holds the credit's prefix, and a
//! credit can only be entered at its first key. Expired credits are ignored under the read lock
//! without mutating; they are swept, oldest first from a FIFO of insertions, on the next insert.
//!
//! Eviction ([`SpecTable::evict`]): an endpoint's removal of key k cuts each of its credits that
//! holds k at k (k and everything after it go), since no prefix past an evicted block can be
//! reused. A small Bloom filter per credit keeps the search off credits that do not hold k.
//!
//! Memory: at most [`MAX_SPEC_KEYS`] credited keys and [`MAX_SPEC_CREDITS`] credits; past either
//! the oldest credits are dropped early, so a burst of huge prompts cannot grow memory unbounded.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

use super::{EndpointId, KeyMap};

/// Cap on credited keys across all credits.
pub const MAX_SPEC_KEYS: usize = 1 << 20;

/// Cap on credits (and on queued insertions).
pub const MAX_SPEC_CREDITS: usize = 1 << 16;

/// Slots of the counting filter over credits' first keys (one byte each, L1-resident), which
/// spares the match a map lookup per key for keys that start no credit.
const START_FILTER: usize = 4096;

/// One decision's credit.
struct Credit {
    ep: u16,
    deadline: Instant,
    /// The first key as inserted (the `starts` entry), kept when `keys` is cut.
    start: u64,
    keys: Vec<u64>,
    /// 16 bits per inserted key, one hash: about 6% false positives.
    bloom: Box<[u64]>,
}

#[inline]
fn mix(key: u64) -> u64 {
    key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn bloom_slot(key: u64, words: usize) -> (usize, u64) {
    let b = (mix(key) >> 32) as usize & (words * 64 - 1);
    (b / 64, 1u64 << (b % 64))
}

fn start_slot(key: u64) -> usize {
    (mix(key) >> 52) as usize % START_FILTER
}

impl Credit {
    fn may_hold(&self, key: u64) -> bool {
        let (w, bit) = bloom_slot(key, self.bloom.len());
        self.bloom.get(w).is_some_and(|x| x & bit != 0)
    }
}

/// Speculative credits with deadlines, stored per request prefix.
#[derive(Default)]
pub struct SpecTable {
    credits: KeyMap<Credit>,
    /// First key -> ids of the credits starting there.
    starts: KeyMap<Vec<u64>>,
    /// Endpoint -> ids of its credits (for evictions).
    by_ep: Vec<Vec<u64>>,
    fifo: VecDeque<(Instant, u64)>,
    next_id: u64,
    keys: usize,
    max_ep: usize,
    /// Counting filter over `starts` (saturating: a full counter is never decremented).
    filter: Vec<u8>,
}

/// Walks one request's keys against the credits live at `now` (see the module docs).
pub struct Cursor<'a> {
    table: &'a SpecTable,
    now: Instant,
    active: Vec<(&'a Credit, usize)>,
}

impl<'a> Cursor<'a> {
    /// Calls `f` with every endpoint credited with the request's keys up to position `i`, whose
    /// key is `key`. Positions must be visited in order from 0.
    #[inline]
    pub fn at(&mut self, i: usize, key: u64, mut f: impl FnMut(u16)) {
        if !self.active.is_empty() {
            self.active
                .retain(|(c, base)| c.keys.get(i - base) == Some(&key));
            for (c, _) in &self.active {
                f(c.ep);
            }
        }
        let t = self.table;
        if t.filter.get(start_slot(key)).is_none_or(|&n| n == 0) {
            return;
        }
        for id in t.starts.get(&key).into_iter().flatten() {
            if let Some(c) = t.credits.get(id) {
                if c.deadline > self.now && c.keys.first() == Some(&key) {
                    f(c.ep);
                    self.active.push((c, i));
                }
            }
        }
    }
}

impl SpecTable {
    /// True when nothing is credited (the query path skips the lookup).
    pub fn is_empty(&self) -> bool {
        self.credits.is_empty()
    }

    /// One past the highest endpoint index ever credited.
    pub fn endpoint_span(&self) -> usize {
        self.max_ep
    }

    /// Credited keys held (expired credits not yet swept included).
    pub fn key_count(&self) -> usize {
        self.keys
    }

    /// Credits held (expired ones not yet swept included).
    pub fn credit_count(&self) -> usize {
        self.credits.len()
    }

    /// A walk over one request's keys at `now`.
    pub fn cursor(&self, now: Instant) -> Cursor<'_> {
        Cursor {
            table: self,
            now,
            active: Vec::new(),
        }
    }

    /// Credits `ep` with the run `keys` until `now + ttl`, sweeping expired credits first. The
    /// same run credited again to the same endpoint extends its deadline.
    pub fn insert(&mut self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration) {
        self.sweep(now);
        let Some(first) = keys.first().map(|k| k.0) else {
            return;
        };
        let deadline = now + ttl;
        let e = usize::from(ep.0);
        self.max_ep = self.max_ep.max(e + 1);
        let again = self
            .starts
            .get(&first)
            .into_iter()
            .flatten()
            .copied()
            .find(|id| {
                self.credits.get(id).is_some_and(|c| {
                    c.ep == ep.0
                        && c.keys.len() == keys.len()
                        && c.keys.iter().zip(keys).all(|(a, b)| *a == b.0)
                })
            });
        if let Some(id) = again {
            if let Some(c) = self.credits.get_mut(&id) {
                c.deadline = c.deadline.max(deadline);
            }
            self.fifo.push_back((deadline, id));
            self.enforce_caps();
            return;
        }
        let words = (keys.len().next_power_of_two() / 4).max(1);
        let mut bloom = vec![0u64; words].into_boxed_slice();
        let run: Vec<u64> = keys.iter().map(|k| k.0).collect();
        for k in &run {
            let (w, bit) = bloom_slot(*k, words);
            if let Some(x) = bloom.get_mut(w) {
                *x |= bit;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.keys += run.len();
        self.credits.insert(
            id,
            Credit {
                ep: ep.0,
                deadline,
                start: first,
                keys: run,
                bloom,
            },
        );
        self.starts.entry(first).or_default().push(id);
        if self.filter.is_empty() {
            self.filter = vec![0; START_FILTER];
        }
        if let Some(n) = self.filter.get_mut(start_slot(first)) {
            *n = n.saturating_add(1);
        }
        if self.by_ep.len() <= e {
            self.by_ep.resize_with(e + 1, Vec::new);
        }
        if let Some(v) = self.by_ep.get_mut(e) {
            v.push(id);
        }
        self.fifo.push_back((deadline, id));
        self.enforce_caps();
    }

    fn enforce_caps(&mut self) {
        while self.keys > MAX_SPEC_KEYS || self.fifo.len() > MAX_SPEC_CREDITS {
            match self.fifo.pop_front() {
                Some((_, id)) => self.drop_credit(id),
                None => break,
            }
        }
    }

    fn sweep(&mut self, now: Instant) {
        while let Some(&(d, id)) = self.fifo.front() {
            if d > now {
                break;
            }
            self.fifo.pop_front();
            // A later re-credit moved the deadline: its own FIFO entry sweeps it.
            if self.credits.get(&id).is_some_and(|c| c.deadline <= now) {
                self.drop_credit(id);
            }
        }
    }

    fn drop_credit(&mut self, id: u64) {
        let Some(c) = self.credits.remove(&id) else {
            return;
        };
        self.keys -= c.keys.len().min(self.keys);
        if let Some(ids) = self.starts.get_mut(&c.start) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.starts.remove(&c.start);
            }
        }
        if let Some(n) = self.filter.get_mut(start_slot(c.start)) {
            if *n != u8::MAX {
                *n = n.saturating_sub(1);
            }
        }
        if let Some(ids) = self.by_ep.get_mut(usize::from(c.ep)) {
            ids.retain(|x| *x != id);
        }
    }

    /// `ep` evicted `removed`: each of `ep`'s credits holding one of them is cut before the
    /// first it holds (a credit cut to nothing is dropped).
    pub fn evict(&mut self, ep: EndpointId, removed: &[BlockKey]) {
        let Some(ids) = self.by_ep.get(usize::from(ep.0)) else {
            return;
        };
        if ids.is_empty() || removed.is_empty() {
            return;
        }
        let mut cuts: Vec<(u64, usize)> = Vec::new();
        for id in ids {
            let Some(c) = self.credits.get(id) else {
                continue;
            };
            let mut at = c.keys.len();
            for k in removed {
                if c.may_hold(k.0) {
                    if let Some(p) = c.keys[..at].iter().position(|x| *x == k.0) {
                        at = p;
                    }
                }
            }
            if at < c.keys.len() {
                cuts.push((*id, at));
            }
        }
        for (id, at) in cuts {
            if at == 0 {
                self.drop_credit(id);
            } else if let Some(c) = self.credits.get_mut(&id) {
                self.keys -= (c.keys.len() - at).min(self.keys);
                c.keys.truncate(at);
            }
        }
    }

    /// Approximate heap bytes.
    pub fn heap_bytes(&self) -> usize {
        // hashbrown: one control byte per bucket plus the slot; buckets = capacity * 8/7.
        let buckets = |cap: usize| cap * 8 / 7 + 1;
        let per_credit: usize = self
            .credits
            .values()
            .map(|c| c.keys.capacity() * 8 + c.bloom.len() * 8)
            .sum();
        buckets(self.credits.capacity()) * (8 + std::mem::size_of::<Credit>() + 1)
            + per_credit
            + buckets(self.starts.capacity()) * (8 + 24 + 1)
            + self
                .starts
                .values()
                .map(|v| v.capacity() * 8)
                .sum::<usize>()
            + self
                .by_ep
                .iter()
                .map(|v| v.capacity() * 8 + 24)
                .sum::<usize>()
            + self.fifo.capacity() * 24
            + self.filter.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    /// Per position of `keys`: the endpoints credited there, as the match sees them.
    fn walk(s: &SpecTable, keys: &[u64], now: Instant) -> Vec<Vec<u16>> {
        let mut c = s.cursor(now);
        keys.iter()
            .enumerate()
            .map(|(i, key)| {
                let mut eps = Vec::new();
                c.at(i, *key, |e| eps.push(e));
                eps.sort_unstable();
                eps
            })
            .collect()
    }

    #[test]
    fn recredit_extends_the_deadline() {
        let mut s = SpecTable::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(2);
        s.insert(EndpointId(2), &k(&[9]), t0, ttl);
        s.insert(EndpointId(2), &k(&[9]), t0 + Duration::from_secs(1), ttl);
        // The first credit's FIFO entry expires at t0+2 but the credit's deadline is t0+3.
        s.insert(
            EndpointId(0),
            &k(&[1]),
            t0 + Duration::from_millis(2500),
            ttl,
        );
        assert_eq!(
            walk(&s, &[9], t0 + Duration::from_millis(2500)),
            vec![vec![2]]
        );
        assert_eq!(
            walk(&s, &[9], t0 + Duration::from_secs(4)),
            vec![Vec::<u16>::new()]
        );
        s.insert(EndpointId(0), &k(&[1]), t0 + Duration::from_secs(10), ttl);
        assert_eq!(s.credit_count(), 1);
        assert_eq!(s.key_count(), 1);
    }

    #[test]
    fn one_credit_per_decision_entered_at_its_first_key() {
        let mut s = SpecTable::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        let run: Vec<u64> = (100..612).collect();
        s.insert(EndpointId(700), &k(&run), now, ttl);
        assert_eq!((s.credit_count(), s.key_count()), (1, 512));
        // A request with two blocks before the run, then the run, then a different block.
        let mut q = vec![1, 2];
        q.extend_from_slice(&run[..10]);
        q.push(5);
        let got = walk(&s, &q, now);
        assert!(got[..2].iter().all(Vec::is_empty));
        assert!(got[2..12].iter().all(|e| e == &[700]));
        assert!(got[12].is_empty());
        // A request diverging inside the run is credited up to the divergence only.
        let mut q2 = run[..3].to_vec();
        q2.extend_from_slice(&run[4..6]);
        assert_eq!(
            walk(&s, &q2, now),
            vec![vec![700]; 3]
                .into_iter()
                .chain([vec![], vec![]])
                .collect::<Vec<_>>()
        );
        // Past the deadline: nothing, without mutating.
        assert!(walk(&s, &run, now + ttl).iter().all(Vec::is_empty));
        assert_eq!(s.credit_count(), 1);
        // The next insert sweeps it.
        s.insert(EndpointId(1), &k(&[7]), now + ttl, ttl);
        assert_eq!((s.credit_count(), s.key_count()), (1, 1));
    }

    #[test]
    fn eviction_cuts_the_endpoints_credits_at_the_evicted_key() {
        let mut s = SpecTable::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        let run: Vec<u64> = (1000..1100).collect();
        s.insert(EndpointId(3), &k(&run), now, ttl);
        s.insert(EndpointId(4), &k(&run), now, ttl);
        s.insert(EndpointId(3), &k(&[5, 6]), now, ttl);
        // Another endpoint's eviction leaves 3's credits alone.
        s.evict(EndpointId(9), &k(&[1040]));
        assert_eq!(s.key_count(), 202);
        // 3 evicts key 1040 (position 40) and a key it never had credit for.
        s.evict(EndpointId(3), &k(&[77, 1040, 1090]));
        let got = walk(&s, &run, now);
        assert!(got[..40].iter().all(|e| e == &[3, 4]));
        assert!(got[40..].iter().all(|e| e == &[4]));
        assert_eq!(s.key_count(), 40 + 100 + 2);
        // Evicting a credit's first key drops the credit.
        s.evict(EndpointId(3), &k(&[5]));
        assert!(walk(&s, &[5, 6], now).iter().all(Vec::is_empty));
        assert_eq!(s.credit_count(), 2);
    }

    #[test]
    fn caps_drop_the_oldest_credits() {
        let mut s = SpecTable::default();
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        let per = 4096u64;
        let n = (MAX_SPEC_KEYS as u64) / per + 3;
        for c in 0..n {
            let run: Vec<u64> = (c * per..(c + 1) * per).map(|x| x + 1).collect();
            s.insert(EndpointId(0), &k(&run), now, ttl);
        }
        assert!(s.key_count() <= MAX_SPEC_KEYS);
        assert_eq!(s.credit_count() as u64, MAX_SPEC_KEYS as u64 / per);
        // The oldest went first.
        assert!(walk(&s, &[1], now)[0].is_empty());
        assert_eq!(walk(&s, &[(n - 1) * per + 1], now)[0], vec![0]);
    }
}
