//! Encoding rendered prompts segment by segment, with the segments' ids cached: what the filter
//! and the inventory service's offloaded tokenization both run on the fast path.
//!
//! A rendered prompt is cut at the tokenizer's added (special) tokens by [`FastBpe::segments`],
//! exactly where the encoder itself cuts it, and each text segment's ids are cached keyed by the
//! segment's full text (an added token is its id, no lookup needed). Reuse is exact: the encoder never merges across an added token, so a segment's ids
//! depend on its text alone, and the key is the text itself (not a hash), so a hit is provably
//! the same text. A multi-turn follow-up or a shared system prompt re-encodes only its new
//! segments. Both caches (segments here, pre-token pieces inside `FastBpe`) are bounded.
//!
//! [`SegmentEncoder::encode_prefix`] bounds one encode by a [`PrefixCap`] (see `FastBpe::encode_prefix`):
//! segments are taken in order while fewer ids than the cap are held, a segment cut short is not
//! cached (its cached ids would be incomplete), and a cached segment is copied whole and the
//! result cut to the cap. The ids returned are always the first ids of the full encode.
//!
//! Invariants of [`Generational`]: bounded in entries and in bytes (the caller states each
//! entry's size); a limit of zero disables it, and an entry larger than half the byte limit is
//! not kept.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::ops::ControlFlow;

use crate::bpe::{
    cut_to, FastBpe, PrefixCap, Segment, Truncation, PIECE_CACHE_BYTES, PIECE_CACHE_ENTRIES,
};

/// A map with a fast (non-SipHash) hasher; keys are request text and token ids.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Bytes charged per segment-cache entry besides its text and ids.
const SEGMENT_ENTRY_OVERHEAD: usize = 64;

/// Bounds of one cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most entries kept.
    pub entries: usize,
    /// Most bytes kept (as the caller accounts them).
    pub bytes: usize,
}

/// Bounds of a [`SegmentEncoder`]'s two caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    /// Segment text -> ids.
    pub segments: Limits,
    /// Pre-token piece -> ids (inside the fast encoder).
    pub pieces: Limits,
}

impl CacheLimits {
    /// The defaults: 65536 segments in 16 MiB, and `FastBpe`'s own piece-cache bounds.
    pub const DEFAULT: CacheLimits = CacheLimits {
        segments: Limits {
            entries: 65_536,
            bytes: 16 << 20,
        },
        pieces: Limits {
            entries: PIECE_CACHE_ENTRIES,
            bytes: PIECE_CACHE_BYTES,
        },
    };
}

/// A bounded map with two generations: new and promoted entries go to the young one; when it
/// holds half the limits, the old generation is dropped and the young one becomes old. An entry
/// used at least once per generation survives, so the cache behaves like an LRU at O(1) per
/// operation, and never holds more than the limits.
#[derive(Debug)]
pub struct Generational<K, V> {
    young: FastMap<K, (V, usize)>,
    old: FastMap<K, (V, usize)>,
    young_bytes: usize,
    old_bytes: usize,
    limits: Limits,
}

impl<K: Hash + Eq, V> Generational<K, V> {
    /// An empty cache with these limits.
    pub fn new(limits: Limits) -> Self {
        Generational {
            young: FastMap::default(),
            old: FastMap::default(),
            young_bytes: 0,
            old_bytes: 0,
            limits,
        }
    }

    /// `f` of the value of `key`, promoting it to the young generation. A young entry costs one
    /// lookup (the key hashed and compared once), an old one a removal and an insertion.
    pub fn get_with<Q, R>(&mut self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some((v, _)) = self.young.get(key) {
            return Some(f(v));
        }
        let (k, (v, size)) = self.old.remove_entry(key)?;
        self.old_bytes -= size;
        let r = f(&v);
        self.insert(k, v, size);
        Some(r)
    }

    /// Adds an entry of `size` bytes; false when it is not kept (cache off or entry too large).
    pub fn insert(&mut self, key: K, value: V, size: usize) -> bool {
        let (max_entries, max_bytes) = (self.limits.entries / 2, self.limits.bytes / 2);
        if max_entries == 0 || size > max_bytes {
            return false;
        }
        if self.young.len() >= max_entries || self.young_bytes + size > max_bytes {
            self.old = std::mem::take(&mut self.young);
            self.old_bytes = std::mem::replace(&mut self.young_bytes, 0);
        }
        self.young_bytes += size;
        if let Some((_, replaced)) = self.young.insert(key, (value, size)) {
            self.young_bytes -= replaced;
        }
        true
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        (
            self.young.len() + self.old.len(),
            self.young_bytes + self.old_bytes,
        )
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.young.clear();
        self.old.clear();
        self.young_bytes = 0;
        self.old_bytes = 0;
    }
}

/// Cache outcome of one encode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Segments served from / added to the segment cache.
    pub hits: u64,
    pub misses: u64,
    /// Pre-token pieces served from / merged into the encoder's piece cache.
    pub piece_hits: u64,
    pub piece_misses: u64,
    /// Why the ids stop before the text's end under a [`PrefixCap`] (`None`: they do not).
    pub truncated: Option<Truncation>,
}

/// [`FastBpe`] with the segment cache in front of it.
pub struct SegmentEncoder {
    bpe: FastBpe,
    cache: Generational<Box<str>, Box<[u32]>>,
}

impl std::fmt::Debug for SegmentEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentEncoder")
            .field("segments", &self.cache.usage())
            .finish_non_exhaustive()
    }
}

impl SegmentEncoder {
    /// Wraps `bpe`, with both caches bounded by `limits`.
    pub fn new(bpe: FastBpe, limits: CacheLimits) -> SegmentEncoder {
        bpe.set_piece_cache_limits(limits.pieces.entries, limits.pieces.bytes);
        SegmentEncoder {
            bpe,
            cache: Generational::new(limits.segments),
        }
    }

    /// Bounds (and empties) the segment and piece caches.
    pub fn set_limits(&mut self, limits: CacheLimits) {
        self.cache = Generational::new(limits.segments);
        self.bpe
            .set_piece_cache_limits(limits.pieces.entries, limits.pieces.bytes);
    }

    /// The ids of `text` (what `FastBpe::encode` returns), and how the caches did.
    pub fn encode(&mut self, text: &str) -> (Vec<u32>, SegmentStats) {
        self.encode_prefix(text, PrefixCap::NONE)
    }

    /// The first ids of `text` under `cap` (what `FastBpe::encode_prefix` returns), and how the
    /// caches did; `stats.truncated` says why ids are missing.
    pub fn encode_prefix(&mut self, text: &str, cap: PrefixCap) -> (Vec<u32>, SegmentStats) {
        let SegmentEncoder { bpe, cache } = self;
        let mut out = Vec::with_capacity(text.len().min(cap.max_tokens.saturating_mul(4)) / 3 + 8);
        let mut stats = SegmentStats::default();
        let (piece_hits, piece_misses) = bpe.piece_cache_stats();
        let mut stop = None;
        let _ = bpe.segments(text, |seg| {
            if out.len() >= cap.max_tokens {
                stop = Some(Truncation::MaxTokens);
                return ControlFlow::Break(());
            }
            match seg {
                Segment::Text(t) => {
                    stop = segment(bpe, cache, t, cap, &mut out, &mut stats);
                    if stop.is_some() {
                        return ControlFlow::Break(());
                    }
                }
                Segment::Added(id) => out.push(id),
            }
            ControlFlow::Continue(())
        });
        stats.truncated = cut_to(&mut out, cap.max_tokens, stop);
        let (h, m) = bpe.piece_cache_stats();
        stats.piece_hits = h.saturating_sub(piece_hits);
        stats.piece_misses = m.saturating_sub(piece_misses);
        (out, stats)
    }

    /// Entries and bytes held by the segment cache.
    pub fn usage(&self) -> (usize, usize) {
        self.cache.usage()
    }

    /// Empties the segment cache and the encoder's piece cache.
    pub fn clear(&mut self) {
        self.cache.clear();
        self.bpe.clear_cache();
    }
}

/// Appends the ids of one text segment (no added token inside), from the cache when the same
/// text was encoded before; under `cap` (counting the ids already in `out`) it may stop early,
/// and says so (then nothing is cached).
fn segment(
    bpe: &FastBpe,
    cache: &mut Generational<Box<str>, Box<[u32]>>,
    seg: &str,
    cap: PrefixCap,
    out: &mut Vec<u32>,
    stats: &mut SegmentStats,
) -> Option<Truncation> {
    if cache
        .get_with(seg, |ids| out.extend_from_slice(ids))
        .is_some()
    {
        stats.hits += 1;
        return None;
    }
    stats.misses += 1;
    let start = out.len();
    let stop = bpe.encode_text_segment_prefix_into(seg, cap, out);
    if stop.is_none() {
        let ids = out.get(start..).unwrap_or(&[]);
        let size = seg.len() + 4 * ids.len() + SEGMENT_ENTRY_OVERHEAD;
        cache.insert(seg.into(), ids.into(), size);
    }
    stop
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn generational_cache_stays_within_limits_and_keeps_used_entries() {
        let mut c = Generational::new(Limits {
            entries: 8,
            bytes: 1000,
        });
        for i in 0..100u32 {
            assert!(c.insert(i, i, 10));
            // Entry 0 is used all along: it survives every rotation.
            assert_eq!(c.get_with(&0, |v| *v), Some(0));
            let (n, b) = c.usage();
            assert!(n <= 8 && b <= 1000, "{n} {b}");
        }
        assert_eq!(c.get_with(&1, |v| *v), None);
        assert!(!c.insert(1000, 0, 501), "larger than a generation");
        let (_, b) = c.usage();
        assert!(b <= 1000);
        let mut off = Generational::new(Limits {
            entries: 0,
            bytes: 0,
        });
        assert!(!off.insert(1, 1, 1));
        assert_eq!(off.get_with(&1, |v| *v), None);
    }
}
