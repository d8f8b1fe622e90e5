//! The block inventory: which endpoint of a rule holds which block key.
//!
//! Synchronous and free of I/O so that ingestion (ZMQ, HTTP drains), a future replicated store and
//! the benches all feed the same code. [`BlockIndex`] is the seam: the in-memory [`MemIndex`] is
//! the embedded default; a replicated store implements the same trait.
//!
//! Invariants:
//! * Every operation of one engine message is applied under one write lock ([`BlockIndex::apply`]),
//!   so an eviction takes effect within the message that carries it.
//! * A key's holders are one 64-bit word in its slot of [`KeyTable`] (laid out for prefetching on
//!   the match path). While every endpoint index is below 64 the word is the endpoint bitset (the
//!   fast path); the first endpoint at index 64 or above (up to [`MAX_ENDPOINTS`]) converts the
//!   index once to the wide width, where the word holds up to 6 endpoint ids inline or points at a
//!   1,024-bit bitset in an overflow arena ([`holders`]). Both widths run the same table, match
//!   loop and operations; memory stays below 48 bytes per (key, endpoint) at either width (see
//!   docs/inventory.md).
//! * Endpoints with several data-parallel ranks keep a per-key rank mask beside the holder word,
//!   so one rank evicting a block does not hide the copy another rank still holds.
//! * Speculative credits (the blind spot between a routing decision and the engine's BlockStored)
//!   live in a separate table, one entry per decision with a deadline, and never touch the
//!   per-endpoint counts. An endpoint's eviction of a key cuts its credits at that key.
//! * Blocks an engine keeps in a lower tier ([`Lower`]: host memory, storage) live in tables of
//!   their own, one per tier, with the same layout; they never count as GPU blocks. A match
//!   continues each endpoint's GPU run through them ([`BlockIndex::match_lower`]), as an engine
//!   that offloads KV looks its lower tiers up after its GPU prefix.

mod holders;
mod spec;
mod table;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

use holders::{narrow_bit, Holders, Narrow, Wide, NARROW_ENDPOINTS};
pub use spec::SpecTable;
pub use table::KeyTable;

/// Most endpoints one rule can have (the rule model's limit): endpoint ids are 10 bits in the
/// wide holder words.
pub const MAX_ENDPOINTS: usize = kvroute_core::rule::MAX_ENDPOINTS;

/// Most data-parallel ranks per endpoint: the width of the rank mask.
pub const MAX_RANKS: usize = 32;

/// An endpoint's position in its rule's endpoint list (0-based, `< MAX_ENDPOINTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u16);

impl EndpointId {
    /// The id of position `i`, `None` past [`MAX_ENDPOINTS`].
    pub fn at(i: usize) -> Option<EndpointId> {
        (i < MAX_ENDPOINTS)
            .then(|| u16::try_from(i).ok().map(EndpointId))
            .flatten()
    }

    /// The position in the rule's endpoint list.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// A data-parallel rank of one endpoint (SGLang `kvDpRankCount`, vLLM DP): `< MAX_RANKS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Rank(pub u8);

/// A KV-cache tier below GPU memory: an engine that offloads KV keeps copies of blocks there and
/// loads them back instead of recomputing them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lower {
    /// Host memory: vLLM's KV offloading and LMCache (`CPU`), SGLang's HiCache (`CPU_PINNED`).
    Cpu,
    /// Storage: `STORAGE` (vLLM), `DISK` / `EXTERNAL` (SGLang's HiCache storage backends).
    Storage,
}

impl Lower {
    /// Every lower tier, fastest first.
    pub const ALL: [Lower; 2] = [Lower::Cpu, Lower::Storage];

    /// The tier's position in [`Lower::ALL`].
    pub fn index(self) -> usize {
        match self {
            Lower::Cpu => 0,
            Lower::Storage => 1,
        }
    }

    /// Metric label and API value.
    pub fn as_str(self) -> &'static str {
        match self {
            Lower::Cpu => "cpu",
            Lower::Storage => "storage",
        }
    }
}

/// One endpoint's lower-tier run past its GPU match ([`BlockIndex::match_lower`]): consecutive
/// request blocks held in host memory, and after those not in host memory but in storage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerRun {
    /// Blocks of the run in host memory.
    pub cpu: u32,
    /// Blocks of the run in storage only.
    pub storage: u32,
}

impl LowerRun {
    /// Blocks in the run.
    pub fn blocks(self) -> u32 {
        self.cpu + self.storage
    }
}

/// One change to the inventory, as decoded from an engine message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexOp {
    /// The endpoint now holds these blocks in GPU memory (idempotent).
    Store(Vec<BlockKey>),
    /// The endpoint evicted these blocks from GPU memory.
    Remove(Vec<BlockKey>),
    /// The endpoint (this rank) dropped everything, in every tier: restart, `AllBlocksCleared`,
    /// lost sync.
    Clear,
    /// The endpoint now holds these blocks in a lower tier (idempotent).
    StoreLower(Lower, Vec<BlockKey>),
    /// The endpoint dropped these blocks from a lower tier.
    RemoveLower(Lower, Vec<BlockKey>),
}

impl IndexOp {
    /// How many keys the operation names (none for a clear).
    pub fn key_count(&self) -> usize {
        match self {
            IndexOp::Store(k)
            | IndexOp::Remove(k)
            | IndexOp::StoreLower(_, k)
            | IndexOp::RemoveLower(_, k) => k.len(),
            IndexOp::Clear => 0,
        }
    }
}

/// One page of an endpoint's blocks ([`BlockIndex::blocks`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockPage {
    /// `(table position, key)` in table order.
    pub blocks: Vec<(usize, BlockKey)>,
    /// Where the next page starts; `None` when the table was scanned to its end.
    pub next: Option<usize>,
}

/// What [`BlockIndex::apply_capped`] did to one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks the endpoint holds in GPU memory afterwards.
    pub gpu: u64,
    /// Blocks it holds afterwards in each lower tier the operations touched (by
    /// [`Lower::index`]); `None` for a tier they left alone.
    pub lower: [Option<u64>; 2],
    /// Keys of stores refused because the tier already held the cap.
    pub refused: u64,
}

/// Slots one page may scan per requested block: bounds the lock hold of a page of a sparse
/// endpoint (one of many holding few keys).
pub const PAGE_SCAN_FACTOR: usize = 16;

/// The inventory of one rule, behind a trait a replicated store can implement.
pub trait BlockIndex: Send + Sync {
    /// Applies operations from `(ep, rank)` (one or several engine messages') atomically with
    /// respect to queries.
    fn apply(&self, ep: EndpointId, rank: Rank, ops: &[IndexOp]) {
        self.apply_capped(ep, rank, ops, u64::MAX);
    }

    /// [`apply`](Self::apply), refusing each store into a tier where `ep` holds `cap` blocks or
    /// more when that store comes up (removals and clears before it make room; one store can take
    /// a tier past the cap by its own size, no further), and returns the counts afterwards: the
    /// checks and the counts are taken under the locks of the apply.
    fn apply_capped(&self, ep: EndpointId, rank: Rank, ops: &[IndexOp], cap: u64) -> Applied;

    /// For each endpoint, the number of leading `keys` it holds (really or speculatively).
    /// `out` is resized to the endpoint count.
    fn match_prefix(&self, keys: &[BlockKey], now: Instant, out: &mut Vec<u32>);

    /// Credits `ep` with `keys` until `now + ttl` (the blind spot before the engine's BlockStored).
    fn speculate(&self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration);

    /// Blocks `ep` really holds (speculative entries excluded).
    fn block_count(&self, ep: EndpointId) -> u64;

    /// [`block_count`](Self::block_count) of every endpoint, read under one lock (a decision
    /// reads them all), indexed by endpoint; `out` may be shorter than the rule's endpoint list
    /// (endpoints past its end hold nothing).
    fn block_counts(&self, out: &mut Vec<u64>);

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

    /// For each endpoint `e < from.len()`, the lower-tier run that continues its match: how
    /// many consecutive `keys` from position `from[e]` (its GPU match) it holds in a lower tier
    /// ([`LowerRun`]). `out` is resized to `from.len()`. Free when no lower tier holds anything.
    fn match_lower(&self, keys: &[BlockKey], from: &[u32], out: &mut Vec<LowerRun>);

    /// Blocks `ep` holds in tier `lower`.
    fn lower_block_count(&self, lower: Lower, ep: EndpointId) -> u64;
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
    /// key -> holder word.
    holders: KeyTable,
    /// `Some` once an endpoint index of 64 or above was seen: the words are wide.
    wide: Option<Wide>,
    /// Per endpoint: blocks held.
    counts: Vec<u64>,
    /// Per endpoint with several ranks: key -> bitset of ranks holding it.
    ranks: Vec<Option<KeyMap<u32>>>,
    spec: SpecTable,
}

impl Tables {
    fn ensure_ep(&mut self, ep: EndpointId) {
        let i = ep.index();
        if i >= NARROW_ENDPOINTS && self.wide.is_none() {
            self.widen();
        }
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
            self.ranks.resize_with(i + 1, || None);
        }
    }

    /// Converts every word to the wide width (once per index: it never narrows back).
    fn widen(&mut self) {
        let mut wide = Wide::default();
        self.holders.rebuild(|_, bits| wide.widen_word(bits));
        self.wide = Some(wide);
    }

    /// Whether `word` names `ep`, at this index's width.
    #[inline]
    fn names(&self, word: u64, ep: EndpointId) -> bool {
        match &self.wide {
            None => Narrow.contains(word, ep.0),
            Some(w) => w.contains(word, ep.0),
        }
    }

    fn set(&mut self, ep: EndpointId, key: u64) {
        let added = match self.wide.as_mut() {
            None => {
                let bit = narrow_bit(ep.0);
                self.holders.update(key, |w| w | bit) & bit == 0
            }
            Some(wide) => {
                let mut added = false;
                self.holders.update(key, |w| {
                    let (new, absent) = wide.insert(w, ep.0);
                    added = absent;
                    new
                });
                added
            }
        };
        if added {
            if let Some(c) = self.counts.get_mut(ep.index()) {
                *c += 1;
            }
        }
    }

    fn unset(&mut self, ep: EndpointId, key: u64) {
        let removed = match self.wide.as_mut() {
            None => {
                let bit = narrow_bit(ep.0);
                self.holders.update(key, |w| w & !bit) & bit != 0
            }
            Some(wide) => {
                let mut removed = false;
                self.holders.update(key, |w| {
                    if w == 0 {
                        return 0;
                    }
                    let (new, was) = wide.remove(w, ep.0);
                    removed = was;
                    new
                });
                removed
            }
        };
        if removed {
            if let Some(c) = self.counts.get_mut(ep.index()) {
                *c = c.saturating_sub(1);
            }
        }
    }

    fn store(&mut self, ep: EndpointId, rank: Rank, keys: &[BlockKey]) {
        let i = ep.index();
        let multi = rank.0 != 0 || self.ranks[i].is_some();
        if multi {
            let rbit = 1u32 << (rank.0 as u32 % 32);
            if self.ranks[i].is_none() {
                // The first rank other than 0: what the endpoint holds so far is rank 0's, so a
                // later eviction by another rank does not hide rank 0's copy.
                let seeded: KeyMap<u32> = self
                    .holders
                    .iter()
                    .filter(|(_, w)| self.names(*w, ep))
                    .map(|(k, _)| (k, 1))
                    .collect();
                self.ranks[i] = Some(seeded);
            }
            if let Some(rm) = self.ranks[i].as_mut() {
                for k in keys {
                    *rm.entry(k.0).or_insert(0) |= rbit;
                }
            }
        }
        self.prefetch(keys.iter().take(Self::AHEAD));
        for (i, k) in keys.iter().enumerate() {
            self.prefetch(keys.get(i + Self::AHEAD));
            self.set(ep, k.0);
        }
    }

    /// How many keys ahead a store or removal starts loading slots.
    const AHEAD: usize = 16;

    /// Starts loading the slots of `keys`: a store into a large table is bound by one miss per
    /// key, which overlap when the slots [`Self::AHEAD`] keys on are requested early.
    #[inline(always)]
    fn prefetch<'k>(&self, keys: impl IntoIterator<Item = &'k BlockKey>) {
        for k in keys {
            self.holders.prefetch(k.0);
        }
    }

    fn remove(&mut self, ep: EndpointId, rank: Rank, keys: &[BlockKey]) {
        let rbit = 1u32 << (rank.0 as u32 % 32);
        self.prefetch(keys.iter().take(Self::AHEAD));
        for (i, k) in keys.iter().enumerate() {
            self.prefetch(keys.get(i + Self::AHEAD));
            let still_held = match self.ranks[ep.index()].as_mut() {
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
        // The engine no longer has these blocks: neither does a prediction past them.
        self.spec.evict(ep, keys);
    }

    fn clear(&mut self, ep: EndpointId, rank: Rank) {
        let i = ep.index();
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
            let Tables { holders, wide, .. } = self;
            match wide.as_mut() {
                None => {
                    let bit = narrow_bit(ep.0);
                    holders.rebuild(|_, w| w & !bit);
                }
                Some(wide) => holders.rebuild(|_, w| wide.remove(w, ep.0).0),
            }
            self.counts[i] = 0;
        } else {
            for k in gone {
                self.unset(ep, k);
            }
        }
    }

    /// The match of [`BlockIndex::match_prefix`] at width `H`; `out` is zeroed and sized.
    #[inline(always)]
    fn match_keys<H: Holders>(&self, h: &H, keys: &[BlockKey], now: Instant, out: &mut [u32]) {
        // Two instances of one loop: without live credits (the common case) the loop carries no
        // credit code at all.
        if self.spec.is_empty() {
            self.match_loop(h, keys, out, |_, _, _| {});
        } else {
            let mut c = self.spec.cursor(now);
            self.match_loop(h, keys, out, |i, k, held: &mut H::Set| {
                c.at(i, k, |e| H::add_ep(held, e));
            });
        }
    }

    /// The match: `credit(i, key, held)` adds the endpoints credited with key `i`.
    #[inline(always)]
    fn match_loop<H: Holders>(
        &self,
        h: &H,
        keys: &[BlockKey],
        out: &mut [u32],
        mut credit: impl FnMut(usize, u64, &mut H::Set),
    ) {
        let Some(first) = keys.first() else {
            return;
        };
        // Misses dominate a cold match: start loading the next keys' slots while working on this one.
        const AHEAD: usize = 32;
        for k in keys.iter().take(AHEAD) {
            self.holders.prefetch(k.0);
        }
        // Endpoints not holding the first key stay at 0 (`out` starts zeroed).
        let mut alive = H::Set::default();
        h.add_word(&mut alive, self.holders.get(first.0));
        credit(0, first.0, &mut alive);
        for (i, k) in keys.iter().enumerate().skip(1) {
            if H::is_empty(&alive) {
                return;
            }
            if let Some(next) = keys.get(i + AHEAD) {
                self.holders.prefetch(next.0);
            }
            let mut held = H::Set::default();
            h.add_word(&mut held, self.holders.get(k.0));
            credit(i, k.0, &mut held);
            H::retain(&mut alive, &held, |e| {
                if let Some(o) = out.get_mut(e) {
                    *o = i as u32;
                }
            });
        }
        let n = keys.len() as u32;
        H::for_each(&alive, |e| {
            if let Some(o) = out.get_mut(e) {
                *o = n;
            }
        });
    }
}

/// The embedded in-memory index for one rule.
#[derive(Default)]
pub struct MemIndex {
    inner: RwLock<Tables>,
    /// One table per [`Lower`] tier (no speculative credits there). Lock order: `inner` first.
    lower: [RwLock<Tables>; 2],
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
            lower: Default::default(),
        }
    }

    /// Speculatively credited keys held (expired credits not yet swept included).
    pub fn spec_key_count(&self) -> usize {
        self.read().spec.key_count()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        // A poisoned lock only means a writer panicked mid-update; the tables are still usable
        // (worst case a stale count), and failing routing would be worse.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read_lower(&self, l: Lower) -> std::sync::RwLockReadGuard<'_, Tables> {
        self.lower[l.index()]
            .read()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn write_lower(&self, l: Lower) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.lower[l.index()]
            .write()
            .unwrap_or_else(|e| e.into_inner())
    }
}

impl BlockIndex for MemIndex {
    fn apply_capped(&self, ep: EndpointId, rank: Rank, ops: &[IndexOp], cap: u64) -> Applied {
        let mut done = Applied::default();
        if ep.index() >= MAX_ENDPOINTS {
            return done;
        }
        let i = ep.index();
        let mut t = self.write();
        t.ensure_ep(ep);
        // A store into a tier that holds `cap` keys when its event comes up is refused (its
        // removals make room for the next), so a tier passes the cap by one event at most.
        for (j, op) in ops.iter().enumerate() {
            // The next operation's slots load while this one is applied (a gathered apply holds
            // many small ones, each otherwise waiting on its first miss).
            if let Some(IndexOp::Store(next) | IndexOp::Remove(next)) = ops.get(j + 1) {
                t.prefetch(next.iter().take(Tables::AHEAD));
            }
            match op {
                IndexOp::Store(keys) => {
                    if t.counts[i] >= cap {
                        done.refused += keys.len() as u64;
                    } else {
                        t.store(ep, rank, keys);
                    }
                }
                IndexOp::Remove(keys) => t.remove(ep, rank, keys),
                IndexOp::Clear => {
                    t.clear(ep, rank);
                    for l in Lower::ALL {
                        let mut lt = self.write_lower(l);
                        if lt.counts.len() > i {
                            lt.clear(ep, rank);
                        }
                        done.lower[l.index()] = Some(lt.counts.get(i).copied().unwrap_or(0));
                    }
                }
                IndexOp::StoreLower(l, keys) => {
                    let mut lt = self.write_lower(*l);
                    lt.ensure_ep(ep);
                    if lt.counts[i] >= cap {
                        done.refused += keys.len() as u64;
                    } else {
                        lt.store(ep, rank, keys);
                    }
                    done.lower[l.index()] = Some(lt.counts[i]);
                }
                IndexOp::RemoveLower(l, keys) => {
                    let mut lt = self.write_lower(*l);
                    lt.ensure_ep(ep);
                    lt.remove(ep, rank, keys);
                    done.lower[l.index()] = Some(lt.counts[i]);
                }
            }
        }
        done.gpu = t.counts[i];
        done
    }

    fn match_prefix(&self, keys: &[BlockKey], now: Instant, out: &mut Vec<u32>) {
        let t = self.read();
        let n_eps = t.counts.len().max(t.spec.endpoint_span());
        out.clear();
        out.resize(n_eps, 0);
        match &t.wide {
            None => t.match_keys(&Narrow, keys, now, out),
            Some(w) => t.match_keys(w, keys, now, out),
        }
    }

    fn speculate(&self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration) {
        if ep.index() >= MAX_ENDPOINTS || keys.is_empty() {
            return;
        }
        let mut t = self.write();
        // The match names credited endpoints at the index's width.
        t.ensure_ep(ep);
        t.spec.insert(ep, keys, now, ttl);
    }

    fn block_count(&self, ep: EndpointId) -> u64 {
        self.read().counts.get(ep.index()).copied().unwrap_or(0)
    }

    fn block_counts(&self, out: &mut Vec<u64>) {
        out.clear();
        out.extend_from_slice(&self.read().counts);
    }

    fn export(&self, ep: EndpointId) -> Vec<(Rank, Vec<BlockKey>)> {
        let t = self.read();
        let rank_map = t.ranks.get(ep.index()).and_then(Option::as_ref);
        let mut by_rank: Vec<Vec<BlockKey>> = Vec::new();
        for (k, word) in t.holders.iter() {
            if !t.names(word, ep) {
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
        let mut blocks = Vec::with_capacity(limit.min(1024));
        let budget = limit.saturating_mul(PAGE_SCAN_FACTOR);
        let next = t.holders.scan(cursor, budget, |i, k, word| {
            if t.names(word, ep) {
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
        b += t.wide.as_ref().map_or(0, Wide::heap_bytes);
        let gpu = b + t.counts.capacity() * 8 + t.ranks.capacity() * 8 + t.spec.heap_bytes();
        drop(t);
        gpu + Lower::ALL
            .iter()
            .map(|&l| {
                let lt = self.read_lower(l);
                lt.holders.heap_bytes()
                    + lt.wide.as_ref().map_or(0, Wide::heap_bytes)
                    + lt.ranks
                        .iter()
                        .flatten()
                        .map(|rm| buckets(rm.capacity()) * 13)
                        .sum::<usize>()
                    + lt.counts.capacity() * 8
            })
            .sum::<usize>()
    }

    fn match_lower(&self, keys: &[BlockKey], from: &[u32], out: &mut Vec<LowerRun>) {
        out.clear();
        out.resize(from.len(), LowerRun::default());
        let (cpu, sto) = (self.read_lower(Lower::Cpu), self.read_lower(Lower::Storage));
        if cpu.holders.is_empty() && sto.holders.is_empty() {
            return;
        }
        // Each key's words are read once, by the first endpoint whose run reaches it.
        let mut words: Vec<Option<(u64, u64)>> = vec![None; keys.len()];
        for (e, (&f, run)) in from.iter().zip(out.iter_mut()).enumerate() {
            let Some(ep) = EndpointId::at(e) else { break };
            let (in_cpu, in_sto) = (e < cpu.counts.len(), e < sto.counts.len());
            if !in_cpu && !in_sto {
                continue;
            }
            for (k, w) in keys.iter().zip(words.iter_mut()).skip(f as usize) {
                let (wc, ws) =
                    *w.get_or_insert_with(|| (cpu.holders.get(k.0), sto.holders.get(k.0)));
                if in_cpu && cpu.names(wc, ep) {
                    run.cpu += 1;
                } else if in_sto && sto.names(ws, ep) {
                    run.storage += 1;
                } else {
                    break;
                }
            }
        }
    }

    fn lower_block_count(&self, lower: Lower, ep: EndpointId) -> u64 {
        self.read_lower(lower)
            .counts
            .get(ep.index())
            .copied()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// One behavioural suite over both widths: each test names endpoints 0, 1, 2, ...; at the
    /// narrow width they are those indexes, at the wide width test endpoint `e` is index
    /// `70 + 97 e` (all past 64, spread over the 1,024) in an index converted to wide words.
    #[derive(Clone, Copy, Debug)]
    enum Width {
        Narrow,
        Wide,
    }

    struct Fx {
        ix: MemIndex,
        width: Width,
    }

    impl Fx {
        fn new(width: Width) -> Fx {
            let ix = MemIndex::new();
            if let Width::Wide = width {
                ix.write().widen();
            }
            Fx { ix, width }
        }

        fn ep(&self, e: u16) -> EndpointId {
            match self.width {
                Width::Narrow => EndpointId(e),
                Width::Wide => EndpointId(70 + 97 * e),
            }
        }

        fn apply(&self, e: u16, rank: u8, ops: &[IndexOp]) {
            self.ix.apply(self.ep(e), Rank(rank), ops);
        }

        fn store(&self, e: u16, keys: &[u64]) {
            self.apply(e, 0, &[IndexOp::Store(k(keys))]);
        }

        /// The match of `keys` at `now`, for test endpoints `0..n`.
        fn m_at(&self, keys: &[u64], now: Instant, n: u16) -> Vec<u32> {
            let mut out = Vec::new();
            self.ix.match_prefix(&k(keys), now, &mut out);
            (0..n)
                .map(|e| out.get(self.ep(e).index()).copied().unwrap_or(0))
                .collect()
        }

        fn m(&self, keys: &[u64], n: u16) -> Vec<u32> {
            self.m_at(keys, Instant::now(), n)
        }

        fn count(&self, e: u16) -> u64 {
            self.ix.block_count(self.ep(e))
        }

        /// The lower-tier runs of test endpoints `0..gpu.len()` past their GPU matches `gpu`.
        fn lower(&self, keys: &[u64], gpu: &[u32]) -> Vec<LowerRun> {
            let n = gpu.len() as u16;
            let mut from = vec![0u32; self.ep(n).index()];
            for (e, g) in gpu.iter().enumerate() {
                from[self.ep(e as u16).index()] = *g;
            }
            let mut out = Vec::new();
            self.ix.match_lower(&k(keys), &from, &mut out);
            (0..n).map(|e| out[self.ep(e).index()]).collect()
        }

        /// Every block of `e`, sorted, by following the page cursor.
        fn all_blocks(&self, e: u16) -> Vec<BlockKey> {
            all_blocks(&self.ix, self.ep(e))
        }
    }

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

    #[rstest]
    fn leading_match_per_endpoint(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        fx.store(0, &[1, 2, 3]);
        fx.store(1, &[1, 3]);
        fx.store(2, &[2, 3]);
        assert_eq!(fx.m(&[1, 2, 3, 4], 3), vec![3, 1, 0]);
        assert_eq!(fx.m(&[], 3), vec![0, 0, 0]);
        assert_eq!(fx.count(0), 3);
        assert_eq!(fx.ix.key_count(), 3);
    }

    /// The metrics label the lower tiers with the same names.
    #[test]
    fn lower_tiers_are_the_metrics_media() {
        assert_eq!(Lower::ALL.map(Lower::as_str), crate::metrics::LOWER_MEDIA);
        assert!(Lower::ALL.iter().enumerate().all(|(i, l)| l.index() == i));
    }

    /// A lower tier continues each endpoint's GPU run, host memory before storage at each
    /// block, up to the first block held in neither; GPU counts and pages never include
    /// lower-tier blocks; a removal cuts the run; a clear empties every tier.
    #[rstest]
    fn lower_tiers_continue_the_gpu_run(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        let run = |cpu, storage| LowerRun { cpu, storage };
        fx.store(0, &[1, 2]);
        fx.apply(
            0,
            0,
            &[
                IndexOp::StoreLower(Lower::Cpu, k(&[1, 2, 3])),
                IndexOp::StoreLower(Lower::Storage, k(&[3, 4, 5])),
            ],
        );
        fx.apply(1, 0, &[IndexOp::StoreLower(Lower::Storage, k(&[1, 2]))]);
        // Without the first block there is no run.
        fx.apply(2, 0, &[IndexOp::StoreLower(Lower::Cpu, k(&[2, 3]))]);
        let keys = [1, 2, 3, 4, 5, 6];
        let gpu = fx.m(&keys, 3);
        assert_eq!(gpu, vec![2, 0, 0]);
        assert_eq!(fx.lower(&keys, &gpu), vec![run(1, 2), run(0, 2), run(0, 0)]);
        assert_eq!(run(1, 2).blocks(), 3);
        assert_eq!((fx.count(0), fx.ix.key_count()), (2, 2));
        assert_eq!(fx.all_blocks(0), k(&[1, 2]));
        assert_eq!(fx.ix.lower_block_count(Lower::Cpu, fx.ep(0)), 3);
        assert_eq!(fx.ix.lower_block_count(Lower::Storage, fx.ep(1)), 2);
        // Block 3 leaves host memory but is still in storage; then storage loses it too.
        fx.apply(0, 0, &[IndexOp::RemoveLower(Lower::Cpu, k(&[3]))]);
        assert_eq!(fx.lower(&keys, &gpu)[0], run(0, 3));
        fx.apply(0, 0, &[IndexOp::RemoveLower(Lower::Storage, k(&[3]))]);
        assert_eq!(fx.lower(&keys, &gpu)[0], run(0, 0));
        fx.apply(1, 0, &[IndexOp::Clear]);
        assert_eq!(fx.lower(&keys, &[0, 0, 0])[1], run(0, 0));
        assert_eq!(fx.ix.lower_block_count(Lower::Storage, fx.ep(1)), 0);
        // Endpoints past every table, and an empty `from`.
        let mut out = vec![run(9, 9)];
        fx.ix.match_lower(&k(&keys), &[], &mut out);
        assert!(out.is_empty());
    }

    #[rstest]
    fn keys_held_by_many_endpoints(#[values(Width::Narrow, Width::Wide)] w: Width) {
        // Past the 6 inline ids of a wide word and back.
        let fx = Fx::new(w);
        for e in 0..10 {
            fx.store(e, &[1, 2]);
        }
        fx.store(9, &[3]);
        assert_eq!(fx.m(&[1, 2, 3], 10), vec![2, 2, 2, 2, 2, 2, 2, 2, 2, 3]);
        for e in 0..8 {
            fx.apply(e, 0, &[IndexOp::Remove(k(&[2]))]);
        }
        assert_eq!(fx.m(&[1, 2, 3], 10), vec![1, 1, 1, 1, 1, 1, 1, 1, 2, 3]);
        fx.apply(9, 0, &[IndexOp::Clear]);
        assert_eq!(fx.m(&[1, 2, 3], 10), vec![1, 1, 1, 1, 1, 1, 1, 1, 2, 0]);
        assert_eq!((fx.count(8), fx.count(9), fx.ix.key_count()), (2, 0, 2));
        assert_eq!(fx.all_blocks(8), k(&[1, 2]));
    }

    #[rstest]
    fn store_is_idempotent_and_remove_counts(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        fx.apply(
            3,
            0,
            &[IndexOp::Store(k(&[7, 8])), IndexOp::Store(k(&[7, 8]))],
        );
        assert_eq!(fx.count(3), 2);
        fx.apply(3, 0, &[IndexOp::Remove(k(&[7, 99]))]);
        assert_eq!(fx.count(3), 1);
        assert_eq!(fx.all_blocks(3), k(&[8]));
    }

    #[rstest]
    fn eviction_within_the_same_message(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        fx.apply(
            0,
            0,
            &[
                IndexOp::Store(k(&[1, 2])),
                IndexOp::Remove(k(&[1])),
                IndexOp::Store(k(&[5])),
            ],
        );
        assert_eq!(fx.m(&[1, 2], 1), vec![0]);
        assert_eq!(fx.count(0), 2);
    }

    #[rstest]
    fn the_cap_refuses_a_tiers_stores_on_what_it_holds_and_counts_come_back(
        #[values(Width::Narrow, Width::Wide)] w: Width,
    ) {
        let fx = Fx::new(w);
        let cap = |ops: &[IndexOp]| fx.ix.apply_capped(fx.ep(2), Rank(0), ops, 3);
        let applied = |gpu, lower, refused| Applied {
            gpu,
            lower,
            refused,
        };
        // Under the cap when each store comes up: both land, the second past it.
        let done = cap(&[IndexOp::Store(k(&[1, 2])), IndexOp::Store(k(&[3, 4]))]);
        assert_eq!(done, applied(4, [None, None], 0));
        // At the cap: a store is refused, a lower tier judged on its own.
        let done = cap(&[
            IndexOp::Store(k(&[5, 6])),
            IndexOp::StoreLower(Lower::Cpu, k(&[1, 9])),
        ]);
        assert_eq!(done, applied(4, [Some(2), None], 2));
        assert_eq!(fx.all_blocks(2), k(&[1, 2, 3, 4]));
        // A removal before a store makes room for it.
        let done = cap(&[IndexOp::Remove(k(&[1, 2])), IndexOp::Store(k(&[5]))]);
        assert_eq!(done, applied(3, [None, None], 0));
        // A clear reports every tier and makes room for the stores after it.
        let done = cap(&[IndexOp::Clear, IndexOp::Store(k(&[7]))]);
        assert_eq!(done, applied(1, [Some(0), Some(0)], 0));
        assert_eq!(fx.ix.lower_block_count(Lower::Cpu, fx.ep(2)), 0);
        // `apply` is uncapped.
        fx.apply(2, 0, &[IndexOp::Store(k(&[10, 11, 12, 13]))]);
        assert_eq!(fx.count(2), 5);
    }

    #[rstest]
    fn clear_only_touches_one_endpoint(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        fx.store(0, &[1, 2]);
        fx.store(1, &[1, 2]);
        fx.apply(0, 0, &[IndexOp::Clear]);
        assert_eq!(fx.m(&[1, 2], 2), vec![0, 2]);
        assert_eq!(fx.count(0), 0);
        assert_eq!(fx.count(1), 2);
    }

    #[rstest]
    fn ranks_union_into_one_endpoint(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        fx.apply(0, 1, &[IndexOp::Store(k(&[1, 2]))]);
        fx.apply(0, 2, &[IndexOp::Store(k(&[2, 3]))]);
        assert_eq!(fx.count(0), 3);
        // Rank 1 evicts 2; rank 2 still holds it.
        fx.apply(0, 1, &[IndexOp::Remove(k(&[2]))]);
        assert_eq!(fx.count(0), 3);
        fx.apply(0, 2, &[IndexOp::Clear]);
        assert_eq!(fx.count(0), 1);
        assert_eq!(fx.all_blocks(0), k(&[1]));
    }

    #[rstest]
    fn speculative_entries_expire(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        let now = Instant::now();
        fx.store(1, &[1]);
        fx.ix
            .speculate(fx.ep(0), &k(&[1, 2]), now, Duration::from_secs(2));
        assert_eq!(fx.m_at(&[1, 2], now, 2), vec![2, 1]);
        assert_eq!(
            fx.m_at(&[1, 2], now + Duration::from_secs(3), 2),
            vec![0, 1]
        );
        assert_eq!(fx.count(0), 0);
    }

    #[rstest]
    fn speculation_extends_a_real_prefix(#[values(Width::Narrow, Width::Wide)] w: Width) {
        // The decision credits only the keys past what the endpoint holds.
        let fx = Fx::new(w);
        let now = Instant::now();
        let ttl = Duration::from_secs(2);
        fx.store(0, &[1, 2]);
        fx.ix.speculate(fx.ep(0), &k(&[3, 4, 5]), now, ttl);
        fx.ix.speculate(fx.ep(1), &k(&[1, 2, 3]), now, ttl);
        assert_eq!(fx.m_at(&[1, 2, 3, 4, 5, 6], now, 2), vec![5, 3]);
        // A request sharing only the first two blocks, then diverging.
        assert_eq!(fx.m_at(&[1, 2, 9, 4], now, 2), vec![2, 2]);
    }

    #[rstest]
    fn eviction_removes_speculative_credit_from_the_key_on(
        #[values(Width::Narrow, Width::Wide)] w: Width,
    ) {
        let fx = Fx::new(w);
        let now = Instant::now();
        let ttl = Duration::from_secs(60);
        let run: Vec<u64> = (10..30).collect();
        fx.ix.speculate(fx.ep(0), &k(&run), now, ttl);
        fx.ix.speculate(fx.ep(1), &k(&run), now, ttl);
        assert_eq!(fx.m_at(&run, now, 2), vec![20, 20]);
        // The engine stored the first 15, then evicted the 10th (key 19).
        fx.store(0, &run[..15]);
        fx.apply(0, 0, &[IndexOp::Remove(k(&[19]))]);
        // Nothing past the evicted block is predicted for 0, really or speculatively; 1 keeps all.
        assert_eq!(fx.m_at(&run, now, 2), vec![9, 20]);
        assert_eq!(fx.ix.spec_key_count(), 9 + 20);
        // Evicting the first credited key drops 1's credit entirely.
        fx.apply(1, 0, &[IndexOp::Remove(k(&[10]))]);
        assert_eq!(fx.m_at(&run, now, 2), vec![9, 0]);
        assert_eq!(fx.ix.spec_key_count(), 9);
    }

    #[rstest]
    fn pagination_is_bounded_and_complete(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        let keys: Vec<u64> = (0..5000u64).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
        fx.store(0, &keys);
        fx.store(1, &[7]);
        let mut want = k(&keys);
        want.sort_unstable();
        assert_eq!(fx.all_blocks(0), want);
        assert_eq!(fx.all_blocks(1), k(&[7]));
        // A page holds at most `limit` blocks; a sparse endpoint's page scans a bounded span.
        let p = fx.ix.blocks(fx.ep(0), 0, 100);
        assert_eq!(p.blocks.len(), 100);
        let p = fx.ix.blocks(fx.ep(1), 0, 1);
        let n = p.next.unwrap_or(usize::MAX);
        assert!(
            p.blocks.len() <= 1 && n <= PAGE_SCAN_FACTOR || p.blocks.len() == 1,
            "{p:?}"
        );
        assert!(fx.ix.blocks(fx.ep(0), 1 << 40, 2).blocks.is_empty());
    }

    #[rstest]
    fn export_rebuilds_the_same_endpoint(#[values(Width::Narrow, Width::Wide)] w: Width) {
        let fx = Fx::new(w);
        let ep = fx.ep(1);
        fx.apply(1, 0, &[IndexOp::Store(k(&[1, 2]))]);
        fx.apply(1, 1, &[IndexOp::Store(k(&[2, 3]))]);
        fx.store(0, &[9]);
        fx.ix
            .speculate(ep, &k(&[4]), Instant::now(), Duration::from_secs(2));
        let mut snap = fx.ix.export(ep);
        snap.iter_mut().for_each(|(_, v)| v.sort_unstable());
        assert_eq!(snap, vec![(Rank(0), k(&[1, 2])), (Rank(1), k(&[2, 3]))]);
        let copy = Fx::new(w);
        for (r, keys) in &snap {
            copy.ix.apply(ep, *r, &[IndexOp::Store(keys.clone())]);
        }
        assert_eq!(copy.ix.block_count(ep), 3);
        // Rank 1 evicting 2 must leave rank 0's copy, as in the original.
        copy.ix.apply(ep, Rank(1), &[IndexOp::Remove(k(&[2]))]);
        fx.ix.apply(ep, Rank(1), &[IndexOp::Remove(k(&[2]))]);
        assert_eq!(all_blocks(&copy.ix, ep), all_blocks(&fx.ix, ep));
        assert!(fx.ix.export(fx.ep(5)).is_empty());
    }

    #[test]
    fn the_first_endpoint_past_64_widens_the_index_in_place() {
        let ix = MemIndex::new();
        for e in 0..64u16 {
            // Keys 1..=3 held by every endpoint (overflow once wide), key 100+e by one.
            ix.apply(
                EndpointId(e),
                Rank(0),
                &[IndexOp::Store(k(&[1, 2, 3, 100 + u64::from(e)]))],
            );
        }
        assert!(ix.read().wide.is_none());
        ix.apply(EndpointId(1000), Rank(0), &[IndexOp::Store(k(&[1, 2]))]);
        assert!(ix.read().wide.is_some());
        let mut out = Vec::new();
        ix.match_prefix(&k(&[1, 2, 3]), Instant::now(), &mut out);
        assert_eq!(out.len(), 1001);
        assert!(out[..64].iter().all(|&n| n == 3));
        assert!(out[64..1000].iter().all(|&n| n == 0));
        assert_eq!(out[1000], 2);
        ix.match_prefix(&k(&[1, 2, 3, 163]), Instant::now(), &mut out);
        assert_eq!((out[62], out[63]), (3, 4));
        for e in 0..64u16 {
            assert_eq!(ix.block_count(EndpointId(e)), 4);
        }
        assert_eq!(ix.block_count(EndpointId(1000)), 2);
        let mut counts = Vec::new();
        ix.block_counts(&mut counts);
        assert_eq!(counts.len(), 1001);
        assert!(counts[..64].iter().all(|&n| n == 4));
        assert!(counts[64..1000].iter().all(|&n| n == 0));
        assert_eq!(counts[1000], 2);
        assert_eq!(all_blocks(&ix, EndpointId(1000)), k(&[1, 2]));
    }

    #[test]
    fn out_of_range_endpoint_is_ignored() {
        let ix = MemIndex::new();
        ix.apply(
            EndpointId(MAX_ENDPOINTS as u16),
            Rank(0),
            &[IndexOp::Store(k(&[1]))],
        );
        ix.speculate(
            EndpointId(MAX_ENDPOINTS as u16),
            &k(&[1]),
            Instant::now(),
            Duration::from_secs(1),
        );
        assert_eq!(ix.key_count(), 0);
        let mut out = Vec::new();
        ix.match_prefix(&k(&[1]), Instant::now(), &mut out);
        assert!(out.is_empty());
        assert_eq!(EndpointId::at(1023), Some(EndpointId(1023)));
        assert_eq!(EndpointId::at(1024), None);
    }
}
