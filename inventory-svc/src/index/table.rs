//! Open-addressing table from block key to a non-zero 64-bit holder word (the endpoint bitset, or
//! at the wide width an inline list or overflow index: see [`holders`](super::holders)), built for
//! the match path.
//!
//! Why not `HashMap`: a 512-key match against a million keys is bound by cache misses, one or two
//! per lookup. Here a key and its holder word share one 16-byte slot (one miss), and the slot of a key
//! is known before it is needed, so [`KeyTable::prefetch`] lets the match loop overlap the misses
//! of the next keys with the work on the current one.
//!
//! Layout: linear probing over a power-of-two array of `(key, bits)` slots; `bits == 0` marks an
//! empty slot (an entry whose word becomes 0 is removed), so any key value, 0 included, can be
//! stored. Deletion shifts later entries back (no tombstones). The load factor stays at or below
//! 3/4, which bounds memory at 16 / (3/8) ≈ 43 bytes per key right after a growth, 21 at best.

/// One slot: a key and the holder word of endpoints holding it (0 = empty).
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
struct Slot {
    key: u64,
    bits: u64,
}

/// Key -> non-zero holder word.
pub struct KeyTable {
    slots: Vec<Slot>,
    len: usize,
    shift: u32,
}

impl Default for KeyTable {
    fn default() -> Self {
        KeyTable::with_capacity(0)
    }
}

const MIN_SLOTS: usize = 16;

impl KeyTable {
    /// A table holding `n` keys without growing.
    pub fn with_capacity(n: usize) -> KeyTable {
        let want = (n.saturating_mul(4) / 3 + 1)
            .max(MIN_SLOTS)
            .next_power_of_two();
        KeyTable {
            slots: vec![Slot::default(); want],
            len: 0,
            shift: 64 - want.trailing_zeros(),
        }
    }

    /// Keys stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes of the slot array.
    pub fn heap_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Ideal slot: the high bits of a multiplicative hash (keys are hashes already; the multiply
    /// guards against structured ones).
    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Hints the CPU to load `key`'s home slot; a no-op where unsupported.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        let p = &self.slots[self.home(key)] as *const Slot;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint: it never faults and reads nothing observable; `p` points
        // into `self.slots`, and SSE (which provides it) is part of the x86_64 baseline.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// The holder word of `key`, 0 when absent.
    #[inline]
    pub fn get(&self, key: u64) -> u64 {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.bits == 0 {
                return 0;
            }
            if s.key == key {
                return s.bits;
            }
            i = (i + 1) & mask;
        }
    }

    fn find(&self, key: u64) -> Result<usize, usize> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.bits == 0 {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    fn grow(&mut self) {
        let old = std::mem::take(&mut self.slots);
        let n = (old.len() * 2).max(MIN_SLOTS);
        self.slots = vec![Slot::default(); n];
        self.shift = 64 - n.trailing_zeros();
        for s in old.into_iter().filter(|s| s.bits != 0) {
            if let Err(i) = self.find(s.key) {
                self.slots[i] = s;
            }
        }
    }

    /// Replaces `key`'s word by `f(old)` (`old` is 0 when absent): a non-zero result inserts or
    /// updates the key, 0 removes it. Returns the old word.
    #[inline]
    pub fn update(&mut self, key: u64, f: impl FnOnce(u64) -> u64) -> u64 {
        match self.find(key) {
            Ok(i) => {
                let old = self.slots[i].bits;
                let new = f(old);
                if new != 0 {
                    self.slots[i].bits = new;
                } else {
                    self.remove_at(i);
                }
                old
            }
            Err(mut i) => {
                let new = f(0);
                if new == 0 {
                    return 0;
                }
                if (self.len + 1) * 4 > self.slots.len() * 3 {
                    self.grow();
                    i = match self.find(key) {
                        Ok(i) | Err(i) => i,
                    };
                }
                self.slots[i] = Slot { key, bits: new };
                self.len += 1;
                0
            }
        }
    }

    /// Backward-shift deletion: later entries of the probe run move into the hole.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        self.slots[hole] = Slot::default();
        self.len -= 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.bits == 0 {
                return;
            }
            let home = self.home(s.key);
            // `s` may move to the hole only if its home is not cyclically within (hole, j].
            let between = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !between {
                self.slots[hole] = s;
                self.slots[j] = Slot::default();
                hole = j;
            }
        }
    }

    /// Replaces every word by `f(key, word)`, dropping the keys whose result is 0, and rebuilds
    /// the table at the size the kept keys need (an endpoint dropped everything, a width change).
    pub fn rebuild(&mut self, mut f: impl FnMut(u64, u64) -> u64) {
        let old = std::mem::take(&mut self.slots);
        let kept: Vec<Slot> = old
            .iter()
            .filter(|s| s.bits != 0)
            .filter_map(|s| {
                let bits = f(s.key, s.bits);
                (bits != 0).then_some(Slot { key: s.key, bits })
            })
            .collect();
        drop(old);
        *self = KeyTable::with_capacity(kept.len());
        for s in kept {
            if let Err(i) = self.find(s.key) {
                self.slots[i] = s;
                self.len += 1;
            }
        }
    }

    /// Visits the entries of slots `from..` in table order until `f` returns false or `max_slots`
    /// slots were looked at; returns the slot to continue from, `None` at the end of the table.
    /// Bounded work for a paged listing.
    pub fn scan(
        &self,
        from: usize,
        max_slots: usize,
        mut f: impl FnMut(usize, u64, u64) -> bool,
    ) -> Option<usize> {
        let end = from.saturating_add(max_slots).min(self.slots.len());
        for (i, s) in self.slots.iter().enumerate().take(end).skip(from) {
            if s.bits != 0 && !f(i, s.key, s.bits) {
                return (i + 1 < self.slots.len()).then_some(i + 1);
            }
        }
        (end < self.slots.len()).then_some(end)
    }

    /// Every `(key, bits)`.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.bits != 0)
            .map(|s| (s.key, s.bits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_map_under_churn() {
        let mut t = KeyTable::default();
        let mut m: HashMap<u64, u64> = HashMap::new();
        // Deterministic pseudo-random churn, including key 0 and colliding homes.
        let mut x: u64 = 0x1234_5678;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = if step % 97 == 0 { 0 } else { x % 5000 };
            let bit = 1u64 << (x % 7);
            if x % 3 == 0 {
                let old = t.update(key, |w| w & !bit);
                let e = m.get(&key).copied().unwrap_or(0);
                assert_eq!(old, e);
                let n = e & !bit;
                if n == 0 {
                    m.remove(&key);
                } else {
                    m.insert(key, n);
                }
            } else {
                let old = t.update(key, |w| w | bit);
                assert_eq!(old, m.get(&key).copied().unwrap_or(0));
                *m.entry(key).or_insert(0) |= bit;
            }
        }
        assert_eq!(t.len(), m.len());
        for (k, v) in &m {
            assert_eq!(t.get(*k), *v);
        }
        assert_eq!(t.iter().count(), m.len());
        t.rebuild(|_, w| w & !1);
        for (k, v) in &m {
            assert_eq!(t.get(*k), v & !1);
        }
    }
}
