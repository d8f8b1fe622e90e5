//! The block inventory: which endpoint of a rule holds which block key.
//!
//! Synchronous and free of I/O so that ingestion (ZMQ, HTTP drains), a future replicated store and
//! the benches all feed the same code. [`BlockIndex`] is the seam: the in-memory [`MemIndex`] is
//! the embedded default; a replicated store implements the same trait.
//!
//! Invariants:
//! * Every operation of one engine message is applied under one write lock ([`BlockIndex::apply`]),
//!   so an eviction takes effect within the message that carries it.
//! * A key's holders are a 64-bit endpoint bitset: one `u64` per key, whatever the endpoint count,
//!   which is what keeps an entry far below the 48-byte budget (see docs/inventory.md). The
//!   key -> bitset table is [`KeyTable`], laid out for prefetching on the match path.
//! * Endpoints with several data-parallel ranks keep a per-key rank mask beside the bitset, so one
//!   rank evicting a block does not hide the copy another rank still holds.
//! * Speculative entries (the blind spot between a routing decision and the engine's BlockStored)
//!   live in a separate table with a deadline and never touch the per-endpoint counts.

mod spec;
mod table;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

pub use spec::SpecTable;
pub use table::KeyTable;

/// Most endpoints one rule can have: the width of the holder bitset.
pub const MAX_ENDPOINTS: usize = 64;

/// Most data-parallel ranks per endpoint: the width of the rank mask.
pub const MAX_RANKS: usize = 32;

/// An endpoint's position in its rule's endpoint list (0-based, `< MAX_ENDPOINTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u8);

impl EndpointId {
    fn bit(self) -> u64 {
        1u64 << (self.0 as u32 % 64)
    }
}

/// A data-parallel rank of one endpoint (SGLang `kvDpRankCount`, vLLM DP): `< MAX_RANKS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Rank(pub u8);

/// One change to the inventory, as decoded from an engine message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexOp {
    /// The endpoint now holds these blocks (idempotent).
    Store(Vec<BlockKey>),
    /// The endpoint evicted these blocks.
    Remove(Vec<BlockKey>),
    /// The endpoint (this rank) dropped everything: restart, `AllBlocksCleared`, lost sync.
    Clear,
}

/// One page of an endpoint's blocks ([`BlockIndex::blocks`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockPage {
    /// `(table position, key)` in table order.
    pub blocks: Vec<(usize, BlockKey)>,
    /// Where the next page starts; `None` when the table was scanned to its end.
    pub next: Option<usize>,
}

/// Slots one page may scan per requested block: bounds the lock hold of a page of a sparse
/// endpoint (one of many holding few keys).
pub const PAGE_SCAN_FACTOR: usize = 16;

/// The inventory of one rule, behind a trait a replicated store can implement.
pub trait BlockIndex: Send + Sync {
    /// Applies one message's operations from `(ep, rank)` atomically with respect to queries.
    fn apply(&self, ep: EndpointId, rank: Rank, ops: &[IndexOp]);

    /// For each endpoint, the number of leading `keys` it holds (really or speculatively).
    /// `out` is resized to the endpoint count.
    fn match_prefix(&self, keys: &[BlockKey], now: Instant, out: &mut Vec<u32>);

    /// Credits `ep` with `keys` until `now + ttl` (the blind spot before the engine's BlockStored).
    fn speculate(&self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration);

    /// Blocks `ep` really holds (speculative entries excluded).
    fn block_count(&self, ep: EndpointId) -> u64;

    /// A page of `ep`'s blocks in table order from position `cursor`, for the inventory API: at
    /// most `limit` blocks, found within a bounded scan (a page may hold fewer, even none, when the
    /// endpoint holds few of the keys). Returns `(position, key)` pairs and the cursor of the next
    /// page (`None` at the end). The work and lock hold per page are O(`limit`), whatever the size.
    fn blocks(&self, ep: EndpointId, cursor: usize, limit: usize) -> BlockPage;

    /// Distinct keys held by any endpoint.
    fn key_count(&self) -> usize;

    /// Everything `ep` really holds, by rank (speculative entries excluded): what a replication
    /// snapshot carries. Keys stored before the endpoint had a rank map count as rank 0.
    fn export(&self, ep: EndpointId) -> Vec<(Rank, Vec<BlockKey>)>;

    /// Approximate heap bytes used by the index tables (for docs and the memory test).
    fn heap_bytes(&self) -> usize;
}

/// Hasher for keys that are already uniformly distributed hashes: one multiply instead of SipHash,
/// because the index is on the route path and keys come from engines, not from clients.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Fold the high half in so that keys differing only in high bits still spread.
        self.0 = (n ^ (n >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// `HashMap` keyed by block keys with [`KeyHasher`].
pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

#[derive(Default)]
struct Tables {
    /// key -> bitset of endpoints holding it.
    holders: KeyTable,
    /// Per endpoint: blocks held.
    counts: Vec<u64>,
    /// Per endpoint with several ranks: key -> bitset of ranks holding it.
    ranks: Vec<Option<KeyMap<u32>>>,
    spec: SpecTable,
}

impl Tables {
    fn ensure_ep(&mut self, ep: EndpointId) {
        let i = ep.0 as usize;
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
            self.ranks.resize_with(i + 1, || None);
        }
    }

    fn set(&mut self, ep: EndpointId, key: u64) {
        let bit = ep.bit();
        if self.holders.or_bits(key, bit) & bit == 0 {
            self.counts[ep.0 as usize] += 1;
        }
    }

    fn unset(&mut self, ep: EndpointId, key: u64) {
        let bit = ep.bit();
        if self.holders.clear_bits(key, bit) & bit != 0 {
            let c = &mut self.counts[ep.0 as usize];
            *c = c.saturating_sub(1);
        }
    }

    fn store(&mut self, ep: EndpointId, rank: Rank, keys: &[BlockKey]) {
        let multi = rank.0 != 0 || self.ranks[ep.0 as usize].is_some();
        if multi {
            let rbit = 1u32 << (rank.0 as u32 % 32);
            if self.ranks[ep.0 as usize].is_none() {
                // The first rank other than 0: what the endpoint holds so far is rank 0's, so a
                // later eviction by another rank does not hide rank 0's copy.
                let bit = ep.bit();
                let seeded: KeyMap<u32> = self
                    .holders
                    .iter()
                    .filter(|(_, h)| h & bit != 0)
                    .map(|(k, _)| (k, 1))
                    .collect();
                self.ranks[ep.0 as usize] = Some(seeded);
            }
            if let Some(rm) = self.ranks[ep.0 as usize].as_mut() {
                for k in keys {
                    *rm.entry(k.0).or_insert(0) |= rbit;
                }
            }
        }
        for k in keys {
            self.set(ep, k.0);
        }
    }

    fn remove(&mut self, ep: EndpointId, rank: Rank, keys: &[BlockKey]) {
        let rbit = 1u32 << (rank.0 as u32 % 32);
        for k in keys {
            let still_held = match self.ranks[ep.0 as usize].as_mut() {
                Some(rm) => match rm.get_mut(&k.0) {
                    Some(mask) => {
                        *mask &= !rbit;
                        let left = *mask != 0;
                        if !left {
                            rm.remove(&k.0);
                        }
                        left
                    }
                    None => false,
                },
                None => false,
            };
            if !still_held {
                self.unset(ep, k.0);
            }
        }
    }

    fn clear(&mut self, ep: EndpointId, rank: Rank) {
        let i = ep.0 as usize;
        let mut gone: Vec<u64> = Vec::new();
        let whole = match self.ranks[i].as_mut() {
            Some(rm) => {
                let rbit = 1u32 << (rank.0 as u32 % 32);
                rm.retain(|k, mask| {
                    *mask &= !rbit;
                    if *mask == 0 {
                        gone.push(*k);
                        false
                    } else {
                        true
                    }
                });
                // Keys absent from the rank map were stored before it existed (rank 0 only).
                rank.0 == 0 && rm.is_empty()
            }
            None => true,
        };
        if whole {
            self.holders.clear_bits_everywhere(ep.bit());
            self.counts[i] = 0;
        } else {
            for k in gone {
                self.unset(ep, k);
            }
        }
    }
}

/// The embedded in-memory index for one rule.
#[derive(Default)]
pub struct MemIndex {
    inner: RwLock<Tables>,
}

impl MemIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index with room for `keys` distinct keys (benches, known fleet sizes).
    pub fn with_capacity(keys: usize) -> Self {
        let t = Tables {
            holders: KeyTable::with_capacity(keys),
            ..Default::default()
        };
        MemIndex {
            inner: RwLock::new(t),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        // A poisoned lock only means a writer panicked mid-update; the tables are still usable
        // (worst case a stale count), and failing routing would be worse.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl BlockIndex for MemIndex {
    fn apply(&self, ep: EndpointId, rank: Rank, ops: &[IndexOp]) {
        if ep.0 as usize >= MAX_ENDPOINTS {
            return;
        }
        let mut t = self.write();
        t.ensure_ep(ep);
        for op in ops {
            match op {
                IndexOp::Store(keys) => t.store(ep, rank, keys),
                IndexOp::Remove(keys) => t.remove(ep, rank, keys),
                IndexOp::Clear => t.clear(ep, rank),
            }
        }
    }

    fn match_prefix(&self, keys: &[BlockKey], now: Instant, out: &mut Vec<u32>) {
        let t = self.read();
        let n_eps = t.counts.len().max(t.spec.endpoint_span());
        out.clear();
        out.resize(n_eps, 0);
        let all: u64 = if n_eps >= 64 {
            u64::MAX
        } else {
            (1u64 << n_eps) - 1
        };
        let mut alive = all;
        let spec_live = !t.spec.is_empty();
        // Misses dominate a cold match: start loading the next keys' slots while working on this one.
        const AHEAD: usize = 32;
        for k in keys.iter().take(AHEAD) {
            t.holders.prefetch(k.0);
        }
        for (i, k) in keys.iter().enumerate() {
            if let Some(next) = keys.get(i + AHEAD) {
                t.holders.prefetch(next.0);
            }
            let mut held = t.holders.get(k.0);
            if spec_live {
                held |= t.spec.holders(k.0, now);
            }
            let next = alive & held;
            let mut dropped = alive & !next;
            while dropped != 0 {
                let e = dropped.trailing_zeros() as usize;
                out[e] = i as u32;
                dropped &= dropped - 1;
            }
            alive = next;
            if alive == 0 {
                return;
            }
        }
        while alive != 0 {
            let e = alive.trailing_zeros() as usize;
            out[e] = keys.len() as u32;
            alive &= alive - 1;
        }
    }

    fn speculate(&self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration) {
        if ep.0 as usize >= MAX_ENDPOINTS || keys.is_empty() {
            return;
        }
        let mut t = self.write();
        t.spec.insert(ep, keys, now, ttl);
    }

    fn block_count(&self, ep: EndpointId) -> u64 {
        self.read().counts.get(ep.0 as usize).copied().unwrap_or(0)
    }

    fn export(&self, ep: EndpointId) -> Vec<(Rank, Vec<BlockKey>)> {
        let t = self.read();
        let bit = ep.bit();
        let rank_map = t.ranks.get(ep.0 as usize).and_then(Option::as_ref);
        let mut by_rank: Vec<Vec<BlockKey>> = Vec::new();
        for (k, holders) in t.holders.iter() {
            if holders & bit == 0 {
                continue;
            }
            let mask = rank_map.and_then(|m| m.get(&k).copied()).unwrap_or(1);
            let mut m = mask;
            while m != 0 {
                let r = m.trailing_zeros() as usize;
                if by_rank.len() <= r {
                    by_rank.resize_with(r + 1, Vec::new);
                }
                by_rank[r].push(BlockKey(k));
                m &= m - 1;
            }
        }
        by_rank
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(r, v)| (Rank(r as u8), v))
            .collect()
    }

    fn blocks(&self, ep: EndpointId, cursor: usize, limit: usize) -> BlockPage {
        let limit = limit.max(1);
        let t = self.read();
        let bit = ep.bit();
        let mut blocks = Vec::with_capacity(limit.min(1024));
        let budget = limit.saturating_mul(PAGE_SCAN_FACTOR);
        let next = t.holders.scan(cursor, budget, |i, k, bits| {
            if bits & bit != 0 {
                blocks.push((i, BlockKey(k)));
            }
            blocks.len() < limit
        });
        BlockPage { blocks, next }
    }

    fn key_count(&self) -> usize {
        self.read().holders.len()
    }

    fn heap_bytes(&self) -> usize {
        let t = self.read();
        // hashbrown (rank maps): one control byte per bucket plus the slot; buckets = capacity * 8/7.
        let buckets = |cap: usize| cap * 8 / 7 + 1;
        let mut b = t.holders.heap_bytes();
        for rm in t.ranks.iter().flatten() {
            b += buckets(rm.capacity()) * (12 + 1);
        }
        b + t.counts.capacity() * 8 + t.spec.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block of `ep`, sorted, by following the page cursor.
    fn all_blocks(ix: &MemIndex, ep: EndpointId) -> Vec<BlockKey> {
        let mut out = Vec::new();
        let mut cursor = Some(0);
        while let Some(c) = cursor {
            let p = ix.blocks(ep, c, 2);
            out.extend(p.blocks.iter().map(|(_, k)| *k));
            cursor = p.next;
        }
        out.sort_unstable();
        out
    }

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    fn m(ix: &MemIndex, keys: &[u64]) -> Vec<u32> {
        let mut out = Vec::new();
        ix.match_prefix(&k(keys), Instant::now(), &mut out);
        out
    }

    #[test]
    fn leading_match_per_endpoint() {
        let ix = MemIndex::new();
        ix.apply(EndpointId(0), Rank(0), &[IndexOp::Store(k(&[1, 2, 3]))]);
        ix.apply(EndpointId(1), Rank(0), &[IndexOp::Store(k(&[1, 3]))]);
        ix.apply(EndpointId(2), Rank(0), &[IndexOp::Store(k(&[2, 3]))]);
        assert_eq!(m(&ix, &[1, 2, 3, 4]), vec![3, 1, 0]);
        assert_eq!(m(&ix, &[]), vec![0, 0, 0]);
        assert_eq!(ix.block_count(EndpointId(0)), 3);
        assert_eq!(ix.key_count(), 3);
    }

    #[test]
    fn store_is_idempotent_and_remove_counts() {
        let ix = MemIndex::new();
        let ep = EndpointId(3);
        ix.apply(
            ep,
            Rank(0),
            &[IndexOp::Store(k(&[7, 8])), IndexOp::Store(k(&[7, 8]))],
        );
        assert_eq!(ix.block_count(ep), 2);
        ix.apply(ep, Rank(0), &[IndexOp::Remove(k(&[7, 99]))]);
        assert_eq!(ix.block_count(ep), 1);
        assert_eq!(all_blocks(&ix, ep), k(&[8]));
    }

    #[test]
    fn eviction_within_the_same_message() {
        let ix = MemIndex::new();
        let ep = EndpointId(0);
        ix.apply(
            ep,
            Rank(0),
            &[
                IndexOp::Store(k(&[1, 2])),
                IndexOp::Remove(k(&[1])),
                IndexOp::Store(k(&[5])),
            ],
        );
        assert_eq!(m(&ix, &[1, 2]), vec![0]);
        assert_eq!(ix.block_count(ep), 2);
    }

    #[test]
    fn clear_only_touches_one_endpoint() {
        let ix = MemIndex::new();
        ix.apply(EndpointId(0), Rank(0), &[IndexOp::Store(k(&[1, 2]))]);
        ix.apply(EndpointId(1), Rank(0), &[IndexOp::Store(k(&[1, 2]))]);
        ix.apply(EndpointId(0), Rank(0), &[IndexOp::Clear]);
        assert_eq!(m(&ix, &[1, 2]), vec![0, 2]);
        assert_eq!(ix.block_count(EndpointId(0)), 0);
        assert_eq!(ix.block_count(EndpointId(1)), 2);
    }

    #[test]
    fn ranks_union_into_one_endpoint() {
        let ix = MemIndex::new();
        let ep = EndpointId(0);
        ix.apply(ep, Rank(1), &[IndexOp::Store(k(&[1, 2]))]);
        ix.apply(ep, Rank(2), &[IndexOp::Store(k(&[2, 3]))]);
        assert_eq!(ix.block_count(ep), 3);
        // Rank 1 evicts 2; rank 2 still holds it.
        ix.apply(ep, Rank(1), &[IndexOp::Remove(k(&[2]))]);
        assert_eq!(ix.block_count(ep), 3);
        ix.apply(ep, Rank(2), &[IndexOp::Clear]);
        assert_eq!(ix.block_count(ep), 1);
        assert_eq!(all_blocks(&ix, ep), k(&[1]));
    }

    #[test]
    fn speculative_entries_expire() {
        let ix = MemIndex::new();
        let now = Instant::now();
        ix.apply(EndpointId(1), Rank(0), &[IndexOp::Store(k(&[1]))]);
        ix.speculate(EndpointId(0), &k(&[1, 2]), now, Duration::from_secs(2));
        let mut out = Vec::new();
        ix.match_prefix(&k(&[1, 2]), now, &mut out);
        assert_eq!(out, vec![2, 1]);
        ix.match_prefix(&k(&[1, 2]), now + Duration::from_secs(3), &mut out);
        assert_eq!(out, vec![0, 1]);
        assert_eq!(ix.block_count(EndpointId(0)), 0);
    }

    #[test]
    fn pagination_is_bounded_and_complete() {
        let ix = MemIndex::new();
        let keys: Vec<u64> = (0..5000u64).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
        ix.apply(EndpointId(0), Rank(0), &[IndexOp::Store(k(&keys))]);
        ix.apply(EndpointId(1), Rank(0), &[IndexOp::Store(k(&[7]))]);
        let mut want = k(&keys);
        want.sort_unstable();
        assert_eq!(all_blocks(&ix, EndpointId(0)), want);
        assert_eq!(all_blocks(&ix, EndpointId(1)), k(&[7]));
        // A page holds at most `limit` blocks; a sparse endpoint's page scans a bounded span.
        let p = ix.blocks(EndpointId(0), 0, 100);
        assert_eq!(p.blocks.len(), 100);
        let p = ix.blocks(EndpointId(1), 0, 1);
        let n = p.next.unwrap_or(usize::MAX);
        assert!(
            p.blocks.len() <= 1 && n <= PAGE_SCAN_FACTOR || p.blocks.len() == 1,
            "{p:?}"
        );
        assert!(ix.blocks(EndpointId(0), 1 << 40, 2).blocks.is_empty());
    }

    #[test]
    fn export_rebuilds_the_same_endpoint() {
        let ix = MemIndex::new();
        let ep = EndpointId(1);
        ix.apply(ep, Rank(0), &[IndexOp::Store(k(&[1, 2]))]);
        ix.apply(ep, Rank(1), &[IndexOp::Store(k(&[2, 3]))]);
        ix.apply(EndpointId(0), Rank(0), &[IndexOp::Store(k(&[9]))]);
        ix.speculate(ep, &k(&[4]), Instant::now(), Duration::from_secs(2));
        let mut snap = ix.export(ep);
        snap.iter_mut().for_each(|(_, v)| v.sort_unstable());
        assert_eq!(snap, vec![(Rank(0), k(&[1, 2])), (Rank(1), k(&[2, 3]))]);
        let copy = MemIndex::new();
        for (r, keys) in &snap {
            copy.apply(ep, *r, &[IndexOp::Store(keys.clone())]);
        }
        assert_eq!(copy.block_count(ep), 3);
        // Rank 1 evicting 2 must leave rank 0's copy, as in the original.
        copy.apply(ep, Rank(1), &[IndexOp::Remove(k(&[2]))]);
        ix.apply(ep, Rank(1), &[IndexOp::Remove(k(&[2]))]);
        assert_eq!(all_blocks(&copy, ep), all_blocks(&ix, ep));
        assert!(ix.export(EndpointId(5)).is_empty());
    }

    #[test]
    fn out_of_range_endpoint_is_ignored() {
        let ix = MemIndex::new();
        ix.apply(EndpointId(200), Rank(0), &[IndexOp::Store(k(&[1]))]);
        assert_eq!(ix.key_count(), 0);
    }
}
