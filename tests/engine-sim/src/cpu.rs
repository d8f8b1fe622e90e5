//! The CPU (host-memory) KV tier of vLLM's KV offloading (`OffloadingConnector` with its CPU
//! LRU manager), as a synchronous, I/O-free LRU of block keys.
//!
//! Invariants (vLLM's `CPUOffloadingManager` with the `lru` policy):
//! * At most `capacity` keys are held. A key is held once its block was written; a lookup
//!   counts the leading keys held, stopping at the first miss.
//! * Order is least recently used first. A write appends the new keys in sequence order; a
//!   touch moves the given keys to the most recent end in reverse order, so the head of a
//!   prefix is used more recently than its tail and outlives it.
//! * A write of `n` new keys into a full tier evicts the `n - free` least recently used keys,
//!   never one of the keys it was asked to write (already held ones included). When not
//!   enough keys can be evicted the write stores nothing ([`CpuTier::store`] returns `None`);
//!   the caller tries the same blocks again at its next write.
//! * Copies complete at once: a written key is loadable immediately.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvroute_core::hash::BlockKey;

/// What one write did: keys newly held and keys evicted to make room, both in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Keys written (those already held are left out).
    pub stored: Vec<BlockKey>,
    /// Keys evicted for them, least recently used first.
    pub evicted: Vec<BlockKey>,
}

/// Counters for `/debug/cache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CpuStats {
    /// Blocks the tier holds at most (`--cpu-blocks`).
    pub capacity: usize,
    /// Blocks held now.
    pub cached: usize,
    /// Blocks loaded back into the GPU cache since start (CPU-tier hits).
    pub hit_blocks_total: u64,
    /// Blocks written since start.
    pub stored_total: u64,
    /// Blocks evicted since start.
    pub evicted_total: u64,
}

/// The CPU tier of one data-parallel rank.
#[derive(Debug, Clone)]
pub struct CpuTier {
    capacity: usize,
    /// Key -> its position in `order`.
    held: HashMap<BlockKey, u64>,
    /// Position -> key, least recently used first.
    order: BTreeMap<u64, BlockKey>,
    next_pos: u64,
    hit_blocks_total: u64,
    stored_total: u64,
    evicted_total: u64,
}

impl CpuTier {
    /// An empty tier of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        CpuTier {
            capacity,
            held: HashMap::new(),
            order: BTreeMap::new(),
            next_pos: 0,
            hit_blocks_total: 0,
            stored_total: 0,
            evicted_total: 0,
        }
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: BlockKey) -> bool {
        self.held.contains_key(&key)
    }

    /// Number of leading `keys` held.
    pub fn lookup(&self, keys: &[BlockKey]) -> usize {
        keys.iter().take_while(|k| self.contains(**k)).count()
    }

    /// Marks the held ones of `keys` as just used, the first key most recently.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        for &k in keys.iter().rev() {
            if let Some(pos) = self.held.get_mut(&k) {
                self.order.remove(pos);
                *pos = self.next_pos;
                self.order.insert(self.next_pos, k);
                self.next_pos += 1;
            }
        }
    }

    /// Counts `n` blocks loaded back into the GPU cache.
    pub fn record_hits(&mut self, n: usize) {
        self.hit_blocks_total += n as u64;
    }

    /// Writes the keys of `keys` not held yet, evicting the least recently used others when
    /// full. `None`: not enough of the others can be evicted; nothing was written.
    pub fn store(&mut self, keys: &[BlockKey]) -> Option<StoreOutcome> {
        let mut seen = HashSet::with_capacity(keys.len());
        let fresh: Vec<BlockKey> = keys
            .iter()
            .copied()
            .filter(|k| !self.contains(*k) && seen.insert(*k))
            .collect();
        if fresh.is_empty() {
            return Some(StoreOutcome::default());
        }
        let free = self.capacity.saturating_sub(self.held.len());
        let to_evict = fresh.len().saturating_sub(free);
        let protected: HashSet<BlockKey> = keys.iter().copied().collect();
        let victims: Vec<(u64, BlockKey)> = self
            .order
            .iter()
            .filter(|(_, k)| !protected.contains(k))
            .take(to_evict)
            .map(|(p, k)| (*p, *k))
            .collect();
        if victims.len() < to_evict {
            return None;
        }
        for (pos, k) in &victims {
            self.order.remove(pos);
            self.held.remove(k);
        }
        for &k in &fresh {
            self.held.insert(k, self.next_pos);
            self.order.insert(self.next_pos, k);
            self.next_pos += 1;
        }
        self.stored_total += fresh.len() as u64;
        self.evicted_total += victims.len() as u64;
        Some(StoreOutcome {
            stored: fresh,
            evicted: victims.into_iter().map(|(_, k)| k).collect(),
        })
    }

    /// Forgets every key (vLLM's connector reset, `reset_external`); announces nothing.
    pub fn clear(&mut self) {
        self.held.clear();
        self.order.clear();
    }

    /// Current counters.
    pub fn stats(&self) -> CpuStats {
        CpuStats {
            capacity: self.capacity,
            cached: self.held.len(),
            hit_blocks_total: self.hit_blocks_total,
            stored_total: self.stored_total,
            evicted_total: self.evicted_total,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn keys(ns: &[u64]) -> Vec<BlockKey> {
        ns.iter().map(|&n| BlockKey(n)).collect()
    }

    #[test]
    fn lookup_counts_leading_keys_held() {
        let mut t = CpuTier::new(8);
        t.store(&keys(&[1, 2, 3])).unwrap();
        assert_eq!(t.lookup(&keys(&[1, 2, 3, 4])), 3);
        assert_eq!(t.lookup(&keys(&[2, 3])), 2);
        assert_eq!(t.lookup(&keys(&[9, 1])), 0);
    }

    #[test]
    fn a_write_skips_held_keys_and_evicts_the_least_recently_used() {
        let mut t = CpuTier::new(3);
        assert_eq!(t.store(&keys(&[1, 2])).unwrap().stored, keys(&[1, 2]));
        let out = t.store(&keys(&[1, 2, 3])).unwrap();
        assert_eq!(out.stored, keys(&[3]));
        assert!(out.evicted.is_empty());
        let out = t.store(&keys(&[4, 5])).unwrap();
        assert_eq!(out.stored, keys(&[4, 5]));
        assert_eq!(out.evicted, keys(&[1, 2]));
        assert_eq!(t.stats().cached, 3);
        assert_eq!(t.stats().evicted_total, 2);
        assert_eq!(t.stats().stored_total, 5);
    }

    #[test]
    fn touch_keeps_a_prefix_head_longest() {
        let mut t = CpuTier::new(4);
        t.store(&keys(&[1, 2, 3, 4])).unwrap();
        // vLLM touches in reverse: 1 ends most recent, 3 least of the touched.
        t.touch(&keys(&[1, 2, 3]));
        let out = t.store(&keys(&[10, 11])).unwrap();
        assert_eq!(out.evicted, keys(&[4, 3]));
        assert_eq!(t.lookup(&keys(&[1, 2])), 2);
    }

    #[test]
    fn keys_being_written_are_never_evicted_and_an_impossible_write_stores_nothing() {
        let mut t = CpuTier::new(2);
        t.store(&keys(&[1, 2])).unwrap();
        // 1 is held and part of the write: only 2 may go.
        let out = t.store(&keys(&[1, 3])).unwrap();
        assert_eq!(out.evicted, keys(&[2]));
        // Three new keys never fit in two blocks.
        assert_eq!(t.store(&keys(&[7, 8, 9])), None);
        assert_eq!(t.lookup(&keys(&[1, 3])), 2);
        t.clear();
        assert_eq!(t.stats().cached, 0);
    }
}
