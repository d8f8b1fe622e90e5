//! What the placement memory and the session table share when a rule update moves endpoints:
//! both are a map of entries naming an endpoint, plus a use queue of `(key, stamp)` pairs in
//! which only the pair matching its entry's stamp is live.

use std::collections::{HashMap, VecDeque};

/// An entry of such a table: the endpoint it names and its queue stamp.
pub(super) trait Stamped: Copy {
    fn ep(&self) -> u16;
    fn with_ep(self, ep: u16) -> Self;
    fn stamp(&self) -> u64;
}

/// `map` and its use queue `lru` with every entry's endpoint renumbered by `to` (`to[i]`: old
/// endpoint `i`'s index in the new rule; `None`, or an index past `u16`, drops its entries); the
/// queue keeps only live pairs, in order.
pub(super) fn renumbered<V: Stamped>(
    map: &HashMap<u64, V>,
    lru: &VecDeque<(u64, u64)>,
    to: &[Option<usize>],
) -> (HashMap<u64, V>, VecDeque<(u64, u64)>) {
    let map: HashMap<u64, V> = map
        .iter()
        .filter_map(|(k, v)| {
            let ep = to.get(usize::from(v.ep())).copied().flatten()?;
            Some((*k, v.with_ep(u16::try_from(ep).ok()?)))
        })
        .collect();
    let lru = lru
        .iter()
        .filter(|(k, st)| map.get(k).is_some_and(|v| v.stamp() == *st))
        .copied()
        .collect();
    (map, lru)
}
