//! Holder sets: what the 64-bit word of a key's slot in [`KeyTable`](super::KeyTable) means.
//!
//! Two widths share the table, the match loop and every operation of the index; only the word's
//! meaning differs, behind the [`Holders`] trait:
//! * [`Narrow`] (every endpoint index below 64, the fast path): the word is the endpoint bitset.
//! * [`Wide`] (a rule with an endpoint at index 64 or above, up to [`MAX_ENDPOINTS`]): the word
//!   holds up to [`INLINE`] endpoint ids inline (10 bits each), or, for a key held by more
//!   endpoints, the index of a 1,024-bit bitset in an overflow arena.
//!
//! Wide word layout (never 0 for a held key, so 0 still marks an empty slot):
//! * bits 0-2: `n`, 1..=6 inline ids, or 7 for overflow;
//! * inline: id `i` (`i < n`) in bits `4 + 10 i .. 14 + 10 i`, in no particular order;
//! * overflow: the arena block index in bits 4-63.
//!
//! Memory per (key, endpoint) at any width: a key held by one endpoint costs its slot (16 bytes at
//! a load factor of 3/8 to 3/4: 21-43 bytes); one held by 7 or more endpoints costs the slot and a
//! 128-byte block, at most (43 + 128) / 7 = 25 bytes per endpoint.

use super::MAX_ENDPOINTS;

/// Endpoints a narrow word can name.
pub const NARROW_ENDPOINTS: usize = 64;
/// Most endpoint ids a wide word holds inline.
pub const INLINE: usize = 6;
/// 64-bit words of a wide bitset.
pub const WORDS: usize = MAX_ENDPOINTS / 64;

const ID_BITS: u32 = 10;
const ID_MASK: u64 = (1 << ID_BITS) - 1;
const N_MASK: u64 = 0b111;
const OVERFLOW: u64 = 7;
const PAYLOAD: u32 = 4;

/// The word's meaning at one width, and the set the match loop intersects.
pub(super) trait Holders {
    /// A set of endpoints as the match loop carries it.
    type Set: Default;
    /// Whether `word` names `ep`.
    fn contains(&self, word: u64, ep: u16) -> bool;
    /// Adds every endpoint of `word` to `set`.
    fn add_word(&self, set: &mut Self::Set, word: u64);
    /// Adds one endpoint to `set`.
    fn add_ep(set: &mut Self::Set, ep: u16);
    /// True when `set` names no endpoint.
    fn is_empty(set: &Self::Set) -> bool;
    /// `alive &= held`, calling `dropped` with each endpoint that leaves.
    fn retain(alive: &mut Self::Set, held: &Self::Set, dropped: impl FnMut(usize));
    /// Calls `f` with every endpoint of `set`.
    fn for_each(set: &Self::Set, f: impl FnMut(usize));
}

/// Every endpoint index below 64: the word is the bitset.
pub(super) struct Narrow;

/// The bit of `ep` in a narrow word (`ep < 64`).
#[inline]
pub(super) fn narrow_bit(ep: u16) -> u64 {
    1u64 << (u32::from(ep) % 64)
}

#[inline]
fn each_bit(mut bits: u64, base: usize, f: &mut impl FnMut(usize)) {
    while bits != 0 {
        f(base + bits.trailing_zeros() as usize);
        bits &= bits - 1;
    }
}

impl Holders for Narrow {
    type Set = u64;
    #[inline]
    fn contains(&self, word: u64, ep: u16) -> bool {
        usize::from(ep) < NARROW_ENDPOINTS && word & narrow_bit(ep) != 0
    }
    #[inline]
    fn add_word(&self, set: &mut u64, word: u64) {
        *set |= word;
    }
    #[inline]
    fn add_ep(set: &mut u64, ep: u16) {
        *set |= narrow_bit(ep);
    }
    #[inline]
    fn is_empty(set: &u64) -> bool {
        *set == 0
    }
    #[inline]
    fn retain(alive: &mut u64, held: &u64, mut dropped: impl FnMut(usize)) {
        let next = *alive & *held;
        each_bit(*alive & !next, 0, &mut dropped);
        *alive = next;
    }
    #[inline]
    fn for_each(set: &u64, mut f: impl FnMut(usize)) {
        each_bit(*set, 0, &mut f);
    }
}

/// A set of up to [`MAX_ENDPOINTS`] endpoints for the wide match loop: the bitset and which of its
/// words are non-zero, so intersecting a small set touches few words.
#[derive(Clone, Copy)]
pub(super) struct WideSet {
    words: [u64; WORDS],
    live: u32,
}

impl Default for WideSet {
    fn default() -> Self {
        WideSet {
            words: [0; WORDS],
            live: 0,
        }
    }
}

impl WideSet {
    #[inline]
    fn insert(&mut self, ep: u16) {
        let e = usize::from(ep) % MAX_ENDPOINTS;
        self.words[e / 64] |= 1u64 << (e % 64);
        self.live |= 1 << (e / 64);
    }
}

/// Rules with an endpoint index of 64 or above: inline ids or an overflow bitset.
#[derive(Default)]
pub(super) struct Wide {
    blocks: Vec<[u64; WORDS]>,
    free: Vec<usize>,
}

#[inline]
fn inline_len(word: u64) -> usize {
    (word & N_MASK) as usize
}

#[inline]
fn inline_id(word: u64, i: usize) -> u16 {
    ((word >> (PAYLOAD + ID_BITS * i as u32)) & ID_MASK) as u16
}

#[inline]
fn with_id(word: u64, i: usize, ep: u16) -> u64 {
    let shift = PAYLOAD + ID_BITS * i as u32;
    (word & !(ID_MASK << shift)) | ((u64::from(ep) & ID_MASK) << shift)
}

#[inline]
fn with_len(word: u64, n: usize) -> u64 {
    (word & !N_MASK) | n as u64
}

impl Wide {
    /// Heap bytes of the overflow arena.
    pub fn heap_bytes(&self) -> usize {
        self.blocks.capacity() * WORDS * 8 + self.free.capacity() * 8
    }

    /// Overflow blocks in use.
    #[cfg(test)]
    pub fn blocks_in_use(&self) -> usize {
        self.blocks.len() - self.free.len()
    }

    fn block(&self, word: u64) -> Option<&[u64; WORDS]> {
        self.blocks.get((word >> PAYLOAD) as usize)
    }

    fn alloc(&mut self, bits: [u64; WORDS]) -> u64 {
        let i = match self.free.pop() {
            Some(i) => {
                if let Some(b) = self.blocks.get_mut(i) {
                    *b = bits;
                }
                i
            }
            None => {
                self.blocks.push(bits);
                self.blocks.len() - 1
            }
        };
        ((i as u64) << PAYLOAD) | OVERFLOW
    }

    /// The wide word of a narrow bitset (converting an index to the wide width).
    pub fn widen_word(&mut self, bits: u64) -> u64 {
        if bits.count_ones() as usize <= INLINE {
            let mut w = 0;
            let mut n = 0;
            each_bit(bits, 0, &mut |e| {
                w = with_id(w, n, e as u16);
                n += 1;
            });
            with_len(w, n)
        } else {
            let mut b = [0u64; WORDS];
            b[0] = bits;
            self.alloc(b)
        }
    }

    /// `word` with `ep` added, and whether it was absent.
    pub fn insert(&mut self, word: u64, ep: u16) -> (u64, bool) {
        let ep = ep & ID_MASK as u16;
        let n = inline_len(word);
        if n == OVERFLOW as usize {
            let i = (word >> PAYLOAD) as usize;
            let Some(b) = self.blocks.get_mut(i) else {
                return (word, false);
            };
            let (w, bit) = (usize::from(ep) / 64, 1u64 << (ep % 64));
            let absent = b[w] & bit == 0;
            b[w] |= bit;
            return (word, absent);
        }
        if (0..n).any(|i| inline_id(word, i) == ep) {
            return (word, false);
        }
        if n < INLINE {
            return (with_len(with_id(word, n, ep), n + 1), true);
        }
        let mut b = [0u64; WORDS];
        for e in (0..n).map(|i| inline_id(word, i)).chain([ep]) {
            b[usize::from(e) / 64] |= 1u64 << (e % 64);
        }
        (self.alloc(b), true)
    }

    /// `word` without `ep` (0 when none remain), and whether it was present.
    pub fn remove(&mut self, word: u64, ep: u16) -> (u64, bool) {
        let n = inline_len(word);
        if n == OVERFLOW as usize {
            let i = (word >> PAYLOAD) as usize;
            let Some(b) = self.blocks.get_mut(i) else {
                return (word, false);
            };
            let (w, bit) = (
                usize::from(ep % MAX_ENDPOINTS as u16) / 64,
                1u64 << (ep % 64),
            );
            if b[w] & bit == 0 {
                return (word, false);
            }
            b[w] &= !bit;
            let left: u32 = b.iter().map(|x| x.count_ones()).sum();
            if left as usize > INLINE {
                return (word, true);
            }
            // Back to inline: the block goes to the free list.
            let bits = *b;
            self.free.push(i);
            let mut out = 0;
            let mut k = 0;
            for (wi, x) in bits.iter().enumerate() {
                each_bit(*x, wi * 64, &mut |e| {
                    out = with_id(out, k, e as u16);
                    k += 1;
                });
            }
            return (if k == 0 { 0 } else { with_len(out, k) }, true);
        }
        let Some(at) = (0..n).find(|&i| inline_id(word, i) == ep) else {
            return (word, false);
        };
        if n == 1 {
            return (0, true);
        }
        // The last id moves into the hole.
        let moved = with_id(word, at, inline_id(word, n - 1));
        (with_len(with_id(moved, n - 1, 0), n - 1), true)
    }

    /// Calls `f` with every endpoint of `word`.
    #[cfg(test)]
    pub fn each(&self, word: u64, mut f: impl FnMut(u16)) {
        let n = inline_len(word);
        if n == OVERFLOW as usize {
            if let Some(b) = self.block(word) {
                for (wi, x) in b.iter().enumerate() {
                    each_bit(*x, wi * 64, &mut |e| f(e as u16));
                }
            }
        } else {
            (0..n).for_each(|i| f(inline_id(word, i)));
        }
    }
}

impl Holders for Wide {
    type Set = WideSet;
    fn contains(&self, word: u64, ep: u16) -> bool {
        let n = inline_len(word);
        if n == OVERFLOW as usize {
            let e = usize::from(ep) % MAX_ENDPOINTS;
            self.block(word)
                .is_some_and(|b| b[e / 64] & (1u64 << (e % 64)) != 0)
        } else {
            (0..n).any(|i| inline_id(word, i) == ep)
        }
    }
    #[inline]
    fn add_word(&self, set: &mut WideSet, word: u64) {
        let n = inline_len(word);
        if n == OVERFLOW as usize {
            if let Some(b) = self.block(word) {
                for (wi, x) in b.iter().enumerate() {
                    if *x != 0 {
                        set.words[wi] |= *x;
                        set.live |= 1 << wi;
                    }
                }
            }
        } else {
            (0..n).for_each(|i| set.insert(inline_id(word, i)));
        }
    }
    #[inline]
    fn add_ep(set: &mut WideSet, ep: u16) {
        set.insert(ep);
    }
    #[inline]
    fn is_empty(set: &WideSet) -> bool {
        set.live == 0
    }
    #[inline]
    fn retain(alive: &mut WideSet, held: &WideSet, mut dropped: impl FnMut(usize)) {
        let mut live = alive.live;
        while live != 0 {
            let wi = live.trailing_zeros() as usize;
            live &= live - 1;
            let a = alive.words[wi];
            let next = a & held.words[wi];
            each_bit(a & !next, wi * 64, &mut dropped);
            alive.words[wi] = next;
            if next == 0 {
                alive.live &= !(1 << wi);
            }
        }
    }
    fn for_each(set: &WideSet, mut f: impl FnMut(usize)) {
        let mut live = set.live;
        while live != 0 {
            let wi = live.trailing_zeros() as usize;
            live &= live - 1;
            each_bit(set.words[wi], wi * 64, &mut f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn members(w: &Wide, word: u64) -> BTreeSet<u16> {
        let mut s = BTreeSet::new();
        w.each(word, |e| {
            s.insert(e);
        });
        s
    }

    #[test]
    fn wide_words_behave_like_sets_across_the_inline_limit() {
        let mut w = Wide::default();
        let mut word = 0;
        let mut want = BTreeSet::new();
        let mut x: u64 = 0x9E37_79B9;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct ids so that sets cross 6 <-> 7 members often.
            let ep = [0u16, 5, 63, 64, 65, 200, 511, 777, 1000, 1023][(x % 10) as usize];
            if x % 3 == 0 {
                let (nw, was) = w.remove(word, ep);
                assert_eq!(was, want.remove(&ep), "step {step}");
                word = nw;
            } else {
                let (nw, absent) = w.insert(word, ep);
                assert_eq!(absent, want.insert(ep), "step {step}");
                word = nw;
            }
            assert_eq!(word == 0, want.is_empty());
            assert_eq!(members(&w, word), want, "step {step}");
            for e in [0u16, 5, 64, 1023, 2] {
                assert_eq!(w.contains(word, e), want.contains(&e));
            }
            assert!(w.blocks_in_use() <= 1);
            assert_eq!(w.blocks_in_use() == 1, want.len() > INLINE, "step {step}");
        }
    }

    #[test]
    fn narrow_words_convert_to_the_same_members() {
        let mut w = Wide::default();
        for bits in [1u64, 0b1011, u64::MAX, 1 << 63, 0x3F, 0x7F] {
            let word = w.widen_word(bits);
            let want: BTreeSet<u16> = (0..64u16).filter(|e| bits & (1 << e) != 0).collect();
            assert_eq!(members(&w, word), want);
        }
    }
}
