//! Speculative holders: a routing decision credits the chosen endpoint with the request's keys
//! for a short TTL, covering the window before the engine's BlockStored arrives.
//!
//! Each `(key, endpoint)` carries its own deadline, so queries (under a read lock) ignore expired
//! credits without mutating; expired cells are swept on the next insert (under the write lock),
//! oldest first from a FIFO of insertions.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute_core::hash::BlockKey;

use super::{EndpointId, KeyMap};

/// Cap on queued speculative keys; past it the oldest credits are dropped early, so a burst of
/// huge prompts cannot grow memory without bound.
const MAX_SPEC_KEYS: usize = 1 << 20;

/// Speculative `(key, endpoint)` credits with deadlines.
#[derive(Default)]
pub struct SpecTable {
    cells: KeyMap<Vec<(u8, Instant)>>,
    fifo: VecDeque<(Instant, u64, u8)>,
    max_ep: usize,
}

impl SpecTable {
    /// True when nothing is credited (the query path skips the lookup).
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// One past the highest endpoint index ever credited.
    pub fn endpoint_span(&self) -> usize {
        self.max_ep
    }

    /// Bitset of endpoints credited with `key` whose deadline is after `now`.
    pub fn holders(&self, key: u64, now: Instant) -> u64 {
        match self.cells.get(&key) {
            Some(v) => v
                .iter()
                .filter(|(_, d)| *d > now)
                .fold(0u64, |m, (e, _)| m | (1u64 << (*e as u32 % 64))),
            None => 0,
        }
    }

    /// Credits `ep` with `keys` until `now + ttl`, sweeping expired credits first.
    pub fn insert(&mut self, ep: EndpointId, keys: &[BlockKey], now: Instant, ttl: Duration) {
        self.sweep(now);
        let deadline = now + ttl;
        self.max_ep = self.max_ep.max(ep.0 as usize + 1);
        for k in keys {
            let cell = self.cells.entry(k.0).or_default();
            match cell.iter_mut().find(|(e, _)| *e == ep.0) {
                Some(slot) => slot.1 = deadline,
                None => cell.push((ep.0, deadline)),
            }
            self.fifo.push_back((deadline, k.0, ep.0));
        }
        while self.fifo.len() > MAX_SPEC_KEYS {
            if let Some((_, k, e)) = self.fifo.pop_front() {
                self.drop_credit(k, e, None);
            }
        }
    }

    fn sweep(&mut self, now: Instant) {
        while let Some((d, k, e)) = self.fifo.front().copied() {
            if d > now {
                break;
            }
            self.fifo.pop_front();
            self.drop_credit(k, e, Some(now));
        }
    }

    /// Removes `(key, ep)` if expired at `now` (a later re-credit keeps it), or unconditionally.
    fn drop_credit(&mut self, key: u64, ep: u8, now: Option<Instant>) {
        if let Some(cell) = self.cells.get_mut(&key) {
            cell.retain(|(e, d)| !(*e == ep && now.is_none_or(|n| *d <= n)));
            if cell.is_empty() {
                self.cells.remove(&key);
            }
        }
    }

    /// Approximate heap bytes.
    pub fn heap_bytes(&self) -> usize {
        self.cells.capacity() * (8 + 24 + 1)
            + self
                .cells
                .values()
                .map(|v| v.capacity() * 24)
                .sum::<usize>()
            + self.fifo.capacity() * 32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recredit_extends_the_deadline() {
        let mut s = SpecTable::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(2);
        s.insert(EndpointId(2), &[BlockKey(9)], t0, ttl);
        s.insert(
            EndpointId(2),
            &[BlockKey(9)],
            t0 + Duration::from_secs(1),
            ttl,
        );
        // The first credit's FIFO entry expires at t0+2 but the cell's deadline is t0+3.
        s.insert(
            EndpointId(0),
            &[BlockKey(1)],
            t0 + Duration::from_millis(2500),
            ttl,
        );
        assert_eq!(s.holders(9, t0 + Duration::from_millis(2500)), 1 << 2);
        assert_eq!(s.holders(9, t0 + Duration::from_secs(4)), 0);
        s.insert(
            EndpointId(0),
            &[BlockKey(1)],
            t0 + Duration::from_secs(10),
            ttl,
        );
        assert_eq!(s.cells.len(), 1);
    }
}
