//! A paged KV cache with prefix sharing and LRU eviction, modelled on vLLM's `BlockPool`.
//!
//! Invariants (the ones a router's view of the engine depends on):
//! * The cache has a fixed number of blocks. A block is *in use* (referenced by running requests)
//!   or *free*; free blocks sit in one queue in LRU order and may still hold a cached prefix.
//! * A block becomes *cached* when it is full and its key is registered; a lookup hits the
//!   leading blocks of a request whose keys are registered, stopping at the first miss.
//! * Allocation takes the free queue's head. If that block is cached it is evicted then
//!   (a `Removed` event), never earlier: a cached block costs nothing until space is needed.
//! * A finished request frees its blocks tail first, so the end of a prompt is evicted before
//!   its shared beginning.
//! * As in vLLM the last prompt token is always recomputed: a prompt that is entirely cached
//!   reports one block fewer as cached.
//! * With a CPU tier ([`crate::cpu`], vLLM's KV offloading): every full block a request
//!   computes is written to the tier (write-through), from its first block, or from the end of
//!   its hits when the tier supplied some. A lookup takes the GPU hits first, then the blocks
//!   the tier holds right after them, up to the prompt's last full block; those are loaded into
//!   fresh GPU blocks and cached there once loaded, and the request reports
//!   `min(hit tokens, prompt - 1)` as cached.
//!
//! Events are recorded here, in order, and taken by the publisher once per scheduler step: a
//! step's GPU events, then its CPU-tier removals, then its CPU-tier stores.

use std::collections::{BTreeMap, HashMap, VecDeque};

use kvroute_core::hash::BlockKey;

use crate::cpu::{CpuStats, CpuTier};
use crate::events::KvEvent;
use crate::prompt::MediaItem;

/// Why a request cannot be admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The request can never fit, however much is evicted.
    #[error(
        "the request needs {needed} KV blocks (prompt + max_tokens); --kv-blocks is {capacity}"
    )]
    TooLarge {
        /// Blocks the request needs.
        needed: usize,
        /// The cache's capacity.
        capacity: usize,
    },
}

#[derive(Clone, Debug, Default)]
struct Block {
    /// The registered key while the block is cached.
    key: Option<BlockKey>,
    /// Running requests using the block.
    refs: u32,
    /// Position in the free queue while free.
    free_pos: Option<u64>,
}

/// Where a prompt hits: its leading blocks cached on the GPU, then the blocks the CPU tier
/// holds right after them (loaded into GPU blocks on admission).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hit {
    /// Leading blocks cached on the GPU (at most `(prompt - 1) / block size`).
    pub gpu: usize,
    /// Blocks after those that the CPU tier holds (up to the prompt's last full block).
    pub cpu: usize,
}

impl Hit {
    /// Prompt tokens a request with this hit reports as cached (vLLM's `num_cached_tokens`):
    /// the hit blocks' tokens, but never the whole prompt: after a load that reaches the
    /// prompt's end vLLM recomputes its last token.
    pub fn cached_tokens(&self, block_size: usize, prompt_len: usize) -> usize {
        ((self.gpu + self.cpu) * block_size).min(prompt_len.saturating_sub(1))
    }
}

/// Blocks held by one running request, in sequence order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    blocks: Vec<usize>,
    /// Leading blocks that were GPU cache hits.
    pub hit_blocks: usize,
    /// Blocks after those loaded from the CPU tier (cached on the GPU by the first commit
    /// that reaches them).
    pub cpu_hit_blocks: usize,
    /// Leading blocks already cached (hits plus blocks committed since).
    committed: usize,
    /// The first block not yet written to the CPU tier (vLLM's next block to offload).
    cpu_next: usize,
}

impl Allocation {
    /// The hit this allocation was admitted with.
    pub fn hit(&self) -> Hit {
        Hit {
            gpu: self.hit_blocks,
            cpu: self.cpu_hit_blocks,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Counters for `/debug/cache` and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Total blocks.
    pub capacity: usize,
    /// Blocks referenced by running requests.
    pub used: usize,
    /// Blocks holding a registered key (in use or free).
    pub cached: usize,
    /// Blocks in the free queue.
    pub free: usize,
    /// Blocks evicted since start.
    pub evicted_total: u64,
    /// The CPU tier's counters, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
}

/// The paged cache of one engine (one data-parallel rank).
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    blocks: Vec<Block>,
    cached: HashMap<BlockKey, usize>,
    free: BTreeMap<u64, usize>,
    next_pos: u64,
    events: VecDeque<(u64, KvEvent)>,
    next_event_id: u64,
    max_pending_events: usize,
    evicted_total: u64,
    cpu: Option<CpuTier>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens; at most `max_pending_events`
    /// untaken events are kept (the oldest are dropped, as an engine's bounded queue does);
    /// 0 records none (llama.cpp publishes nothing).
    pub fn new(capacity: usize, block_size: usize, max_pending_events: usize) -> Self {
        let mut free = BTreeMap::new();
        let mut blocks = vec![Block::default(); capacity];
        for (i, b) in blocks.iter_mut().enumerate() {
            b.free_pos = Some(i as u64);
            free.insert(i as u64, i);
        }
        KvCache {
            block_size: block_size.max(1),
            blocks,
            cached: HashMap::new(),
            free,
            next_pos: capacity as u64,
            events: VecDeque::new(),
            next_event_id: 0,
            max_pending_events,
            evicted_total: 0,
            cpu: None,
        }
    }

    /// Adds a CPU tier of `blocks` blocks (vLLM's KV offloading); 0 leaves the cache without.
    pub fn with_cpu_tier(mut self, blocks: usize) -> Self {
        self.cpu = (blocks > 0).then(|| CpuTier::new(blocks));
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of leading `keys` that are cached.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.cached.contains_key(k))
            .count()
    }

    /// Leading blocks of `keys[from..]` the CPU tier holds (0 without a tier).
    pub fn cpu_match(&self, keys: &[BlockKey], from: usize) -> usize {
        match (&self.cpu, keys.get(from..)) {
            (Some(t), Some(rest)) => t.lookup(rest),
            _ => 0,
        }
    }

    /// Where a prompt of `prompt_len` tokens with block keys `keys` would hit now (vLLM's
    /// `get_computed_blocks`, then the offloading connector's `get_num_new_matched_tokens`).
    pub fn plan(&self, keys: &[BlockKey], prompt_len: usize) -> Hit {
        // vLLM recomputes at least the last prompt token, so a full GPU hit gives back one block.
        let max_hit = prompt_len.saturating_sub(1) / self.block_size;
        let gpu = self.match_prefix(keys).min(max_hit);
        // The connector looks further, up to the prompt's last full block.
        let full = (prompt_len / self.block_size).min(keys.len());
        let cpu = if full > gpu {
            self.cpu_match(&keys[..full], gpu)
        } else {
            0
        };
        Hit { gpu, cpu }
    }

    /// Blocks a request of `prompt_len + max_output` tokens holds at its end.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Admits a request: takes its cache hits and allocates the rest of the `total_tokens`
    /// (prompt + output) it will hold. `Ok(None)` means not now (too few free blocks: wait for
    /// a release); an error means never.
    pub fn try_admit(
        &mut self,
        keys: &[BlockKey],
        prompt_len: usize,
        total_tokens: usize,
    ) -> Result<Option<Allocation>, KvError> {
        let needed = self.blocks_for(total_tokens).max(1);
        if needed > self.blocks.len() {
            return Err(KvError::TooLarge {
                needed,
                capacity: self.blocks.len(),
            });
        }
        let hit = self.plan(keys, prompt_len);
        if let Some(t) = self.cpu.as_mut() {
            // The connector marks every block of the request it holds as just used.
            let full = (prompt_len / self.block_size).min(keys.len());
            t.touch(&keys[..full]);
        }
        let hits = hit.gpu;
        let hit_ids: Vec<usize> = keys[..hits]
            .iter()
            .filter_map(|k| self.cached.get(k).copied())
            .collect();
        let hits_in_free = hit_ids
            .iter()
            .filter(|&&b| self.blocks[b].free_pos.is_some())
            .count();
        let fresh = needed - hits;
        if fresh > self.free.len() - hits_in_free {
            return Ok(None);
        }
        let mut blocks = Vec::with_capacity(needed);
        for b in hit_ids {
            self.take_ref(b);
            blocks.push(b);
        }
        let mut evicted = Vec::new();
        for _ in 0..fresh {
            let Some((_, b)) = self.free.pop_first() else {
                break;
            };
            let block = &mut self.blocks[b];
            block.free_pos = None;
            block.refs = 1;
            if let Some(k) = block.key.take() {
                self.cached.remove(&k);
                evicted.push(k);
            }
            blocks.push(b);
        }
        // vLLM emits one BlockRemoved per evicted block.
        self.evicted_total += evicted.len() as u64;
        for k in evicted {
            self.push_event(KvEvent::Removed { keys: vec![k] });
        }
        if let Some(t) = self.cpu.as_mut() {
            t.record_hits(hit.cpu);
        }
        Ok(Some(Allocation {
            blocks,
            hit_blocks: hits,
            cpu_hit_blocks: hit.cpu,
            committed: hits,
            // A request the tier served offloads from the end of its hits; any other from its
            // first block (blocks the tier still holds are skipped).
            cpu_next: if hit.cpu > 0 { hits + hit.cpu } else { 0 },
        }))
    }

    fn take_ref(&mut self, b: usize) {
        let block = &mut self.blocks[b];
        if let Some(pos) = block.free_pos.take() {
            self.free.remove(&pos);
        }
        block.refs += 1;
    }

    /// Registers the allocation's full blocks `committed..keys.len()` (keys of the request's
    /// token sequence so far, `tokens` that sequence) and records one `Stored` event per run.
    /// A key already cached by another request leaves this copy unregistered. `salt` is the
    /// request's `cache_salt`, carried by the events.
    pub fn commit(
        &mut self,
        alloc: &mut Allocation,
        keys: &[BlockKey],
        tokens: &[u32],
        salt: Option<&str>,
    ) {
        self.commit_with_media(alloc, keys, tokens, salt, &[]);
    }

    /// [`commit`](Self::commit) for a sequence holding media items: the events list the items
    /// each block overlaps in its extra keys.
    pub fn commit_with_media(
        &mut self,
        alloc: &mut Allocation,
        keys: &[BlockKey],
        tokens: &[u32],
        salt: Option<&str>,
        media: &[MediaItem],
    ) {
        let upto = keys.len().min(alloc.blocks.len());
        let mut run: Vec<BlockKey> = Vec::new();
        let mut run_start = alloc.committed;
        for i in alloc.committed..upto {
            let k = keys[i];
            let b = alloc.blocks[i];
            let fresh = !self.cached.contains_key(&k) && self.blocks[b].key.is_none();
            if fresh {
                self.blocks[b].key = Some(k);
                self.cached.insert(k, b);
                if run.is_empty() {
                    run_start = i;
                }
                run.push(k);
            } else if !run.is_empty() {
                self.flush_run(&mut run, run_start, keys, tokens, (salt, media));
            }
        }
        if !run.is_empty() {
            self.flush_run(&mut run, run_start, keys, tokens, (salt, media));
        }
        alloc.committed = alloc.committed.max(upto);
        self.write_through(alloc, &keys[..upto]);
    }

    /// Writes the allocation's computed blocks `keys[cpu_next..]` to the CPU tier (those it
    /// holds are skipped) and records the tier's removals and stores. A write that cannot make
    /// room stores nothing and is tried again by the next commit, as vLLM's `prepare_store`.
    fn write_through(&mut self, alloc: &mut Allocation, keys: &[BlockKey]) {
        let Some(tier) = self.cpu.as_mut() else {
            return;
        };
        let Some(new) = keys.get(alloc.cpu_next..).filter(|k| !k.is_empty()) else {
            return;
        };
        let Some(out) = tier.store(new) else {
            tracing::debug!("CPU tier: cannot make room for {} blocks", new.len());
            return;
        };
        alloc.cpu_next = keys.len();
        if !out.stored.is_empty() {
            tier.touch(keys);
        }
        if !out.evicted.is_empty() {
            self.push_event(KvEvent::CpuRemoved { keys: out.evicted });
        }
        if !out.stored.is_empty() {
            self.push_event(KvEvent::CpuStored { keys: out.stored });
        }
    }

    fn flush_run(
        &mut self,
        run: &mut Vec<BlockKey>,
        start: usize,
        keys: &[BlockKey],
        tokens: &[u32],
        (salt, media): (Option<&str>, &[MediaItem]),
    ) {
        let bs = self.block_size;
        let items = if media.is_empty() {
            Vec::new()
        } else {
            (start..start + run.len())
                .map(|b| crate::prompt::overlapping(media, b * bs, bs))
                .collect()
        };
        let end = (start + run.len()) * bs;
        let token_ids = tokens
            .get(start * bs..end.min(tokens.len()))
            .unwrap_or(&[])
            .to_vec();
        let parent = if start == 0 {
            None
        } else {
            keys.get(start - 1).copied()
        };
        self.push_event(KvEvent::Stored {
            keys: std::mem::take(run),
            parent,
            token_ids,
            block_size: bs as u32,
            salt: salt.map(str::to_string),
            media: items,
        });
    }

    /// Releases a finished request's blocks, tail first.
    pub fn release(&mut self, alloc: Allocation) {
        for &b in alloc.blocks.iter().rev() {
            let block = &mut self.blocks[b];
            block.refs = block.refs.saturating_sub(1);
            if block.refs == 0 && block.free_pos.is_none() {
                let pos = self.next_pos;
                self.next_pos += 1;
                block.free_pos = Some(pos);
                self.free.insert(pos, b);
            }
        }
    }

    /// Forgets every cached key (vLLM `reset_prefix_cache`); in-use blocks stay allocated.
    /// `as_removals`: announce it as one `Removed` of every cached key instead of `Cleared`
    /// (TensorRT-LLM has no clear event).
    pub fn clear(&mut self, as_removals: bool) {
        for b in &mut self.blocks {
            b.key = None;
        }
        let keys: Vec<BlockKey> = self.cached.drain().map(|(k, _)| k).collect();
        if !as_removals {
            self.push_event(KvEvent::Cleared);
        } else if !keys.is_empty() {
            self.push_event(KvEvent::Removed { keys });
        }
    }

    /// Forgets every block of the CPU tier (vLLM's `reset_prefix_cache` with `reset_external`);
    /// announces nothing: the GPU reset's `AllBlocksCleared` goes out with it.
    pub fn clear_cpu(&mut self) {
        if let Some(t) = self.cpu.as_mut() {
            t.clear();
        }
    }

    /// Records an event for the publisher.
    pub fn push_event(&mut self, e: KvEvent) {
        if self.max_pending_events == 0 {
            return;
        }
        if self.events.len() >= self.max_pending_events {
            self.events.pop_front();
        }
        self.events.push_back((self.next_event_id, e));
        self.next_event_id += 1;
    }

    /// Takes every pending event with its id (ids count every event ever recorded, so a
    /// dropped one shows as a gap).
    pub fn take_events(&mut self) -> Vec<(u64, KvEvent)> {
        self.events.drain(..).collect()
    }

    /// Current counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            capacity: self.blocks.len(),
            used: self.blocks.len() - self.free.len(),
            cached: self.cached.len(),
            free: self.free.len(),
            evicted_total: self.evicted_total,
            cpu: self.cpu.as_ref().map(CpuTier::stats),
        }
    }

    /// Fraction of blocks in use (vLLM `kv_cache_usage_perc`: free-but-cached blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        (self.blocks.len() - self.free.len()) as f64 / self.blocks.len() as f64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn keys(ns: &[u64]) -> Vec<BlockKey> {
        ns.iter().map(|&n| BlockKey(n)).collect()
    }

    fn toks(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    #[test]
    fn hit_after_release_and_last_token_recomputed() {
        let mut c = KvCache::new(8, 4, 100);
        let k = keys(&[1, 2, 3]);
        let mut a = c.try_admit(&k, 12, 12).unwrap().unwrap();
        assert_eq!(a.hit_blocks, 0);
        c.commit(&mut a, &k, &toks(12), None);
        c.release(a);
        let ev = c.take_events();
        assert_eq!(ev.len(), 1);
        assert!(
            matches!(&ev[0].1, KvEvent::Stored { keys, parent: None, token_ids, .. } if keys.len() == 3 && token_ids.len() == 12)
        );
        // Same 12-token prompt: 3 blocks cached, but the last token is recomputed.
        let b = c.try_admit(&k, 12, 16).unwrap().unwrap();
        assert_eq!(b.hit_blocks, 2);
        // 13 tokens: all three blocks hit.
        c.release(b);
        let b = c.try_admit(&k, 13, 16).unwrap().unwrap();
        assert_eq!(b.hit_blocks, 3);
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut c = KvCache::new(4, 1, 100);
        let a_keys = keys(&[10, 11]);
        let mut a = c.try_admit(&a_keys, 2, 2).unwrap().unwrap();
        c.commit(&mut a, &a_keys, &toks(2), None);
        c.release(a);
        let b_keys = keys(&[20, 21]);
        let mut b = c.try_admit(&b_keys, 2, 2).unwrap().unwrap();
        c.commit(&mut b, &b_keys, &toks(2), None);
        c.release(b);
        c.take_events();
        // One fresh block: evicts the LRU free block: the tail of the first request (11).
        let x = c.try_admit(&keys(&[30]), 1, 1).unwrap().unwrap();
        let ev = c.take_events();
        assert_eq!(ev[0].1, KvEvent::Removed { keys: keys(&[11]) });
        assert_eq!(c.match_prefix(&a_keys), 1);
        c.release(x);
        assert_eq!(c.stats().evicted_total, 1);
    }

    /// vLLM's order: a finished request's blocks join the free queue tail first, and blocks
    /// shared with a still-running request join only when that one finishes. So eviction takes
    /// the private tails (oldest request first, each from its end) before the shared prefix,
    /// and the shared prefix from its end too.
    #[test]
    fn free_queue_order_matches_vllm() {
        let mut c = KvCache::new(6, 1, 100);
        let a_keys = keys(&[1, 2, 31, 32]);
        let b_keys = keys(&[1, 2, 41, 42]);
        let mut a = c.try_admit(&a_keys, 4, 4).unwrap().unwrap();
        c.commit(&mut a, &a_keys, &toks(4), None);
        // B shares A's first two blocks (A still running) and takes two fresh ones.
        let mut b = c.try_admit(&b_keys, 5, 4).unwrap().unwrap();
        assert_eq!(b.hit_blocks, 2);
        c.commit(&mut b, &b_keys, &toks(4), None);
        assert_eq!(c.stats().free, 0);
        c.release(a);
        c.release(b);
        c.take_events();
        // Six fresh blocks, one at a time: the eviction order is the free queue's order.
        let mut order = Vec::new();
        let mut held = Vec::new();
        for n in 0..6u64 {
            held.push(c.try_admit(&keys(&[100 + n]), 1, 1).unwrap().unwrap());
            for (_, e) in c.take_events() {
                if let KvEvent::Removed { keys } = e {
                    order.extend(keys.into_iter().map(|k| k.0));
                }
            }
            // The shared prefix outlives every private tail.
            if n < 4 {
                assert_eq!(c.match_prefix(&keys(&[1, 2])), 2, "after {n} evictions");
            }
        }
        assert_eq!(order, vec![32, 31, 42, 41, 2, 1]);
        for h in held {
            c.release(h);
        }
    }

    #[test]
    fn waits_when_full_and_rejects_the_impossible() {
        let mut c = KvCache::new(2, 4, 100);
        let a = c.try_admit(&[], 8, 8).unwrap().unwrap();
        assert_eq!(c.try_admit(&[], 1, 1).unwrap(), None);
        assert!(matches!(
            c.try_admit(&[], 9, 12),
            Err(KvError::TooLarge {
                needed: 3,
                capacity: 2
            })
        ));
        c.release(a);
        assert!(c.try_admit(&[], 1, 1).unwrap().is_some());
    }

    #[test]
    fn duplicate_commit_is_not_announced_twice() {
        let mut c = KvCache::new(8, 2, 100);
        let k = keys(&[1, 2]);
        let mut a = c.try_admit(&k, 4, 4).unwrap().unwrap();
        let mut b = c.try_admit(&k, 4, 4).unwrap().unwrap();
        c.commit(&mut a, &k, &toks(4), None);
        c.commit(&mut b, &k, &toks(4), None);
        assert_eq!(c.take_events().len(), 1);
        c.release(a);
        c.release(b);
        assert_eq!(c.stats().cached, 2);
        c.clear(false);
        assert_eq!(c.take_events()[0].1, KvEvent::Cleared);
        assert_eq!(c.match_prefix(&k), 0);
        let mut a = c.try_admit(&k, 4, 4).unwrap().unwrap();
        c.commit(&mut a, &k, &toks(4), None);
        c.release(a);
        c.take_events();
        c.clear(true);
        let KvEvent::Removed { keys: mut removed } = c.take_events().remove(0).1 else {
            panic!("removal expected")
        };
        removed.sort();
        assert_eq!(removed, k);
    }

    fn events(c: &mut KvCache) -> Vec<KvEvent> {
        c.take_events().into_iter().map(|(_, e)| e).collect()
    }

    #[test]
    fn computed_blocks_are_written_through_to_the_cpu_tier() {
        let mut c = KvCache::new(8, 4, 100).with_cpu_tier(16);
        let k = keys(&[1, 2, 3]);
        let mut a = c.try_admit(&k, 13, 13).unwrap().unwrap();
        c.commit(&mut a, &k, &toks(13), None);
        let ev = events(&mut c);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(matches!(&ev[0], KvEvent::Stored { keys, .. } if *keys == k));
        assert_eq!(ev[1], KvEvent::CpuStored { keys: k.clone() });
        // A block held already is not written (nor announced) again.
        c.release(a);
        let k2 = keys(&[1, 2, 3, 4]);
        let mut b = c.try_admit(&k2, 17, 17).unwrap().unwrap();
        assert_eq!(b.hit(), Hit { gpu: 3, cpu: 0 });
        c.commit(&mut b, &k2, &toks(17), None);
        let ev = events(&mut c);
        assert_eq!(ev[1], KvEvent::CpuStored { keys: keys(&[4]) });
        let st = c.stats().cpu.unwrap();
        assert_eq!((st.capacity, st.cached, st.stored_total), (16, 4, 4));
        c.release(b);
    }

    #[test]
    fn a_prompt_gone_from_the_gpu_is_loaded_back_from_the_cpu_tier() {
        // 4 GPU blocks of 4 tokens: B's 4 blocks evict all of A's.
        let mut c = KvCache::new(4, 4, 100).with_cpu_tier(16);
        let ka = keys(&[1, 2, 3]);
        let kb = keys(&[7, 8, 9]);
        for k in [&ka, &kb] {
            let mut a = c.try_admit(k, 13, 13).unwrap().unwrap();
            c.commit(&mut a, k, &toks(13), None);
            c.release(a);
        }
        events(&mut c);
        assert_eq!(c.match_prefix(&ka), 0);
        assert_eq!(c.plan(&ka, 13), Hit { gpu: 0, cpu: 3 });
        let mut a = c.try_admit(&ka, 13, 13).unwrap().unwrap();
        assert_eq!(a.hit(), Hit { gpu: 0, cpu: 3 });
        assert_eq!(a.hit().cached_tokens(4, 13), 12);
        // The load ends: the blocks are cached on the GPU again, and not written to the CPU again.
        c.commit(&mut a, &ka, &toks(12), None);
        let ev = events(&mut c);
        assert!(
            ev.iter().all(|e| !matches!(e, KvEvent::CpuStored { .. })),
            "{ev:?}"
        );
        assert!(
            ev.iter()
                .any(|e| matches!(e, KvEvent::Stored { keys, parent: None, .. } if *keys == ka)),
            "{ev:?}"
        );
        assert_eq!(c.match_prefix(&ka), 3);
        assert_eq!(c.stats().cpu.unwrap().hit_blocks_total, 3);
        c.release(a);
    }

    #[test]
    fn the_cpu_tier_continues_after_the_gpu_hits_to_the_prompts_last_full_block() {
        let mut c = KvCache::new(16, 4, 100).with_cpu_tier(16);
        let k = keys(&[1, 2, 3]);
        let mut a = c.try_admit(&k, 12, 12).unwrap().unwrap();
        c.commit(&mut a, &k, &toks(12), None);
        c.release(a);
        // A fully cached 12-token prompt: the GPU gives 2 blocks (the last token is
        // recomputed), the CPU tier the third; vLLM then reports all but the last token.
        let hit = c.plan(&k, 12);
        assert_eq!(hit, Hit { gpu: 2, cpu: 1 });
        assert_eq!(hit.cached_tokens(4, 12), 11);
        // Without a CPU tier the same prompt reports two blocks.
        let mut g = KvCache::new(16, 4, 100);
        let mut a = g.try_admit(&k, 12, 12).unwrap().unwrap();
        g.commit(&mut a, &k, &toks(12), None);
        g.release(a);
        assert_eq!(g.plan(&k, 12).cached_tokens(4, 12), 8);
        // A miss in the CPU tier ends the continuation.
        assert_eq!(c.plan(&keys(&[1, 9, 3]), 13), Hit { gpu: 1, cpu: 0 });
    }

    #[test]
    fn a_cpu_eviction_is_recorded_before_the_store_that_caused_it() {
        let mut c = KvCache::new(16, 4, 100).with_cpu_tier(4);
        let ka = keys(&[1, 2, 3, 4]);
        let mut a = c.try_admit(&ka, 17, 17).unwrap().unwrap();
        c.commit(&mut a, &ka, &toks(17), None);
        c.release(a);
        events(&mut c);
        let kb = keys(&[5, 6]);
        let mut b = c.try_admit(&kb, 9, 9).unwrap().unwrap();
        c.commit(&mut b, &kb, &toks(9), None);
        let ev = events(&mut c);
        // A's tail goes first: the head of a prefix was touched last.
        assert_eq!(
            ev[1..],
            [
                KvEvent::CpuRemoved {
                    keys: keys(&[4, 3])
                },
                KvEvent::CpuStored { keys: kb.clone() },
            ]
        );
        assert_eq!(c.stats().cpu.unwrap().evicted_total, 2);
        c.release(b);
        c.clear_cpu();
        assert_eq!(c.stats().cpu.unwrap().cached, 0);
        assert!(c.take_events().is_empty(), "a CPU reset announces nothing");
    }

    #[test]
    fn pending_events_are_bounded_and_ids_show_the_gap() {
        let mut c = KvCache::new(1, 1, 2);
        for _ in 0..3 {
            c.push_event(KvEvent::Cleared);
        }
        let ev = c.take_events();
        assert_eq!(ev.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 2]);
    }
}
