//! The session tier: which endpoint each conversation was sent to, by its explicit id.
//!
//! A question that names its conversation (`session`: the `x-conversation-id` header, or the
//! OpenAI `user` field where the gateway is configured so) goes to the endpoint the conversation's
//! earlier requests went to, ahead of prefix scoring, while that endpoint is healthy and eligible.
//! Every committed decision binds the id to the endpoint it chose, except a detour (the bound
//! endpoint was unavailable), so the conversation goes home once its engine is back; a binding
//! not used for the TTL is forgotten.
//!
//! Ids are hashed with the rule's id into 64 bits, so the table holds no client strings. Bounds:
//! at most `max_entries` bindings per rule (least recently used go first), each forgotten `ttl`
//! after its last use. Other replicas learn a binding with the decision that made it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::renumber::{renumbered, Stamped};
use crate::sync::lock;

/// A session id as the table keys it.
pub fn session_hash(rule_id: u32, id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), u64::from(rule_id))
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    ep: u16,
    last: Instant,
    /// Matches the LRU queue's stamp while this is the binding's latest position.
    stamp: u64,
}

impl Stamped for Binding {
    fn ep(&self) -> u16 {
        self.ep
    }
    fn with_ep(self, ep: u16) -> Binding {
        Binding { ep, ..self }
    }
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

#[derive(Default)]
struct Inner {
    map: HashMap<u64, Binding>,
    /// (session, stamp) in use order; stale pairs (stamp differs) are skipped lazily.
    lru: VecDeque<(u64, u64)>,
    next_stamp: u64,
}

/// Bindings one [`SessionTable::bind`] dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Least recently used ones, for `KVROUTE_SESSIONS_MAX`.
    pub evicted: usize,
    /// Ones unused for longer than `KVROUTE_SESSION_TTL_MS`.
    pub expired: usize,
}

/// What binding a session did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// The session had no live binding: it is bound now.
    New,
    /// The binding was refreshed (same endpoint).
    Kept,
    /// The binding moved to another endpoint.
    Moved,
    /// The table is disabled (`max_entries` 0 or a zero TTL).
    Off,
}

/// The per-rule session table (see the module docs).
pub struct SessionTable {
    inner: Mutex<Inner>,
    /// `inner.map.len()`, published by [`SessionTable::bind`] for the gauge (no second lock).
    held: AtomicUsize,
    max_entries: usize,
    ttl: Duration,
}

impl SessionTable {
    pub fn new(max_entries: usize, ttl: Duration) -> SessionTable {
        SessionTable {
            inner: Mutex::new(Inner::default()),
            held: AtomicUsize::new(0),
            max_entries,
            ttl,
        }
    }

    fn off(&self) -> bool {
        self.max_entries == 0 || self.ttl.is_zero()
    }

    /// The endpoint `session` is bound to at `now`, if the binding is live.
    pub fn get(&self, session: u64, now: Instant) -> Option<usize> {
        if self.off() {
            return None;
        }
        let inner = lock(&self.inner);
        let b = inner.map.get(&session)?;
        (now.saturating_duration_since(b.last) <= self.ttl).then_some(usize::from(b.ep))
    }

    /// Binds `session` to `ep` at `now`.
    /// Returns what changed and the bindings dropped to make room or because they expired.
    pub fn bind(&self, session: u64, ep: usize, now: Instant) -> (Bound, Dropped) {
        let Ok(ep16) = u16::try_from(ep) else {
            return (Bound::Off, Dropped::default());
        };
        if self.off() {
            return (Bound::Off, Dropped::default());
        }
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        inner.next_stamp += 1;
        let stamp = inner.next_stamp;
        let ttl = self.ttl;
        let bound = match inner.map.get_mut(&session) {
            Some(b) if now.saturating_duration_since(b.last) <= ttl => {
                let moved = b.ep != ep16;
                *b = Binding {
                    ep: ep16,
                    last: now,
                    stamp,
                };
                match moved {
                    true => Bound::Moved,
                    false => Bound::Kept,
                }
            }
            _ => {
                inner.map.insert(
                    session,
                    Binding {
                        ep: ep16,
                        last: now,
                        stamp,
                    },
                );
                Bound::New
            }
        };
        inner.lru.push_back((session, stamp));
        let mut dropped = Dropped::default();
        // The queue is in use order: expired bindings are at its front, then the cap's victims.
        while let Some(&(k, st)) = inner.lru.front() {
            let live = inner.map.get(&k).filter(|b| b.stamp == st);
            let drop = match live {
                None => {
                    inner.lru.pop_front();
                    continue;
                }
                Some(b) if now.saturating_duration_since(b.last) > ttl => &mut dropped.expired,
                Some(_) if inner.map.len() > self.max_entries => &mut dropped.evicted,
                Some(_) => break,
            };
            *drop += 1;
            inner.lru.pop_front();
            inner.map.remove(&k);
        }
        // Refreshing a binding leaves its older queue pair stale: compact once they dominate.
        if inner.lru.len() > 2 * self.max_entries + 16 {
            let map = &inner.map;
            inner
                .lru
                .retain(|(k, st)| map.get(k).is_some_and(|b| b.stamp == *st));
        }
        self.held.store(inner.map.len(), Ordering::Relaxed);
        (bound, dropped)
    }

    /// Takes `old`'s bindings into this new table, each renumbered by `to` (`to[i]`: endpoint
    /// `i`'s index in the new rule, `None` when it is gone, its bindings dropped): a rule update
    /// keeps the conversations of the endpoints that stay.
    pub fn absorb(&self, old: &SessionTable, to: &[Option<usize>]) {
        if self.off() {
            return;
        }
        let src = lock(&old.inner);
        let mut inner = lock(&self.inner);
        (inner.map, inner.lru) = renumbered(&src.map, &src.lru, to);
        inner.next_stamp = src.next_stamp;
        self.held.store(inner.map.len(), Ordering::Relaxed);
    }

    /// Live and expired bindings held, as of the last bind.
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Whether no binding is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    const NONE: Dropped = Dropped {
        evicted: 0,
        expired: 0,
    };

    #[test]
    fn a_binding_is_kept_moved_and_forgotten_after_its_ttl() {
        let t = SessionTable::new(8, Duration::from_secs(10));
        let now = Instant::now();
        assert_eq!(t.get(1, now), None);
        assert_eq!(t.bind(1, 2, now), (Bound::New, NONE));
        assert_eq!(t.get(1, now + Duration::from_secs(10)), Some(2));
        assert_eq!(
            t.bind(1, 2, now + Duration::from_secs(5)),
            (Bound::Kept, NONE)
        );
        assert_eq!(
            t.bind(1, 3, now + Duration::from_secs(6)),
            (Bound::Moved, NONE)
        );
        assert_eq!(t.get(1, now + Duration::from_secs(16)), Some(3));
        assert_eq!(t.get(1, now + Duration::from_secs(17)), None);
        // An expired binding counts as new.
        assert_eq!(
            t.bind(1, 0, now + Duration::from_secs(30)),
            (Bound::New, NONE)
        );
    }

    /// Bindings unused past the TTL are dropped by the next bind (oldest first) and counted, so
    /// the gauge holds live bindings only.
    #[test]
    fn expired_bindings_are_dropped_by_the_next_bind() {
        let t = SessionTable::new(100, Duration::from_secs(10));
        let now = Instant::now();
        for s in 0..3 {
            t.bind(s, 0, now + Duration::from_secs(s));
        }
        assert_eq!(t.len(), 3);
        // At 12 s session 0 (bound at 0 s) and 1 (at 1 s) are past 10 s; 2 (at 2 s) is not.
        let (_, d) = t.bind(7, 1, now + Duration::from_millis(12_000));
        assert_eq!(
            d,
            Dropped {
                evicted: 0,
                expired: 2
            }
        );
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(2, now + Duration::from_secs(12)), Some(0));
        // A refreshed binding is not dropped for its stale queue position.
        t.bind(2, 0, now + Duration::from_secs(11));
        let (_, d) = t.bind(8, 1, now + Duration::from_millis(12_500));
        assert_eq!(d, NONE);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn the_least_recently_used_go_first_at_the_bound() {
        let t = SessionTable::new(3, Duration::from_secs(60));
        let now = Instant::now();
        for s in 0..3 {
            t.bind(s, 0, now);
        }
        // Using 0 again makes 1 the oldest.
        t.bind(0, 0, now);
        assert_eq!(
            t.bind(9, 1, now),
            (
                Bound::New,
                Dropped {
                    evicted: 1,
                    expired: 0
                }
            )
        );
        assert_eq!(t.len(), 3);
        assert_eq!(t.get(1, now), None);
        assert_eq!(t.get(0, now), Some(0));
        assert_eq!(t.get(9, now), Some(1));
        // The queue stays bounded however often one session is refreshed.
        for _ in 0..1000 {
            t.bind(0, 0, now);
        }
        assert!(lock(&t.inner).lru.len() <= 2 * 3 + 16);
        assert_eq!(t.get(2, now), Some(0));
    }

    #[test]
    fn disabled_tables_bind_nothing() {
        let now = Instant::now();
        for t in [
            SessionTable::new(0, Duration::from_secs(1)),
            SessionTable::new(4, Duration::ZERO),
        ] {
            assert_eq!(t.bind(1, 0, now), (Bound::Off, NONE));
            assert_eq!(t.get(1, now), None);
        }
    }

    #[test]
    fn ids_are_hashed_per_rule() {
        assert_eq!(session_hash(1, "a"), session_hash(1, "a"));
        assert_ne!(session_hash(1, "a"), session_hash(2, "a"));
        assert_ne!(session_hash(1, "a"), session_hash(1, "b"));
    }
}
