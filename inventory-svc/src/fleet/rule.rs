//! One installed rule and everything live about it: its validated spec, block index, endpoints,
//! hash ring, placement memory and decision counters.
//!
//! The spec never changes once installed (a changed rule is a new [`RuleRuntime`]). What does
//! change (the index, endpoint state, memory, counters) is private to the fleet layer: the
//! HTTP, ingest and replication edges read it through the methods here and change it through
//! [`super::Fleet`], which keeps the index bounded, the gauges current and the other replicas told.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvroute_core::hash::BlockKey;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::endpoint::EpRuntime;
use super::shadow::ShadowSeries;
use crate::index::{BlockIndex, BlockPage, EndpointId, IndexOp, LowerRun, MemIndex, Rank};
use crate::metrics::Metrics;
use crate::rules::RuleSpec;
use crate::score::{HashRing, PlacementMemory, SessionTable};
use crate::settings::Divergence;
use kvroute_core::rule::{EndpointRole, KvMode};

/// A rule and everything live about it.
pub struct RuleRuntime {
    pub id: u32,
    pub spec: RuleSpec,
    pub created: Instant,
    /// Hash of the rule's canonical JSON: replicas agree on it, and a changed rule gets new
    /// replication keys (its old inventory does not apply to the new endpoint list).
    pub generation: u64,
    pub(super) index: Arc<dyn BlockIndex>,
    eps: Vec<EpRuntime>,
    pub(super) ring: HashRing,
    /// Each endpoint's `ip:port`, as answers name it (formatted once).
    addrs: Vec<String>,
    /// Where each prefix family was sent, remembered past eviction.
    pub(super) memory: PlacementMemory,
    /// Which endpoint each named conversation was sent to (the session tier).
    pub(super) sessions: SessionTable,
    /// `kvroute_sessions{rule}`, looked up at the rule's first binding.
    pub(super) sessions_gauge: OnceLock<prometheus::IntGauge>,
    pub(super) hit_seq: AtomicU64,
    pub(super) rr_seq: AtomicU64,
    /// The shadow policy's series, resolved at the rule's first shadowed decision.
    pub(super) shadow_series: OnceLock<ShadowSeries>,
    cancel: CancellationToken,
    /// Why the rule's tokenizer cannot be served (reported in /healthz), if so.
    tokenizer_problem: Option<String>,
    /// Each tenant's prompt and cached tokens, from the filters' reports.
    tenants: std::sync::Mutex<kvroute_core::usage::TenantBook>,
}

/// What a new rule's runtime is built from besides its spec.
pub(super) struct Parts {
    pub id: u32,
    pub memory: PlacementMemory,
    pub sessions: SessionTable,
    pub cancel: CancellationToken,
    pub tokenizer_problem: Option<String>,
}

impl RuleRuntime {
    /// Endpoint `i`'s `ip:port` as the filter pins it (IPv6 bracketed); empty past the list.
    pub fn addr(&self, i: usize) -> &str {
        self.addrs.get(i).map_or("", String::as_str)
    }

    /// A rule's runtime; `old` is the rule it replaces, whose inventory it keeps when the new
    /// rule keys blocks the same way ([`same_keys`]).
    pub(super) fn new(spec: RuleSpec, parts: Parts, old: Option<&RuleRuntime>) -> RuleRuntime {
        let addrs: Vec<String> = spec.endpoints.iter().map(|e| e.addr()).collect();
        let eps: Vec<EpRuntime> = spec
            .endpoints
            .iter()
            .map(|_| EpRuntime::new(spec.dp_ranks as usize))
            .collect();
        let index = match old.filter(|o| same_keys(&o.spec, &spec)) {
            Some(o) => {
                let to = renumbering(&o.spec, &spec);
                // Homes are block keys: kept only where the keys mean the same.
                parts.memory.absorb(&o.memory, &to);
                keep_inventory(o, &to, &eps)
            }
            None => Arc::new(MemIndex::new()) as Arc<dyn BlockIndex>,
        };
        if let Some(o) = old {
            parts
                .sessions
                .absorb(&o.sessions, &renumbering(&o.spec, &spec));
        }
        RuleRuntime {
            id: parts.id,
            eps,
            index,
            ring: HashRing::new(&addrs),
            addrs,
            memory: parts.memory,
            sessions: parts.sessions,
            sessions_gauge: OnceLock::new(),
            created: Instant::now(),
            generation: spec.generation(),
            hit_seq: AtomicU64::new(0),
            rr_seq: AtomicU64::new(0),
            shadow_series: OnceLock::new(),
            cancel: parts.cancel,
            tokenizer_problem: parts.tokenizer_problem,
            tenants: Default::default(),
            spec,
        }
    }

    /// Every endpoint's live state, in the rule's endpoint order.
    pub fn eps(&self) -> &[EpRuntime] {
        &self.eps
    }

    /// The rule's data-parallel ranks (at least one).
    pub fn ranks(&self) -> impl Iterator<Item = Rank> {
        (0..self.spec.dp_ranks.max(1)).map(Rank)
    }

    /// Endpoint ids of the rule, in order.
    pub fn endpoint_ids(&self) -> impl Iterator<Item = EndpointId> {
        (0..self.eps.len()).map(|i| EndpointId(i as u16))
    }

    /// Endpoints whose events feed the index: prefill endpoints in mode 1, all others otherwise.
    pub fn kv_endpoints(&self) -> Vec<EndpointId> {
        self.spec
            .endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                self.spec.exact_mode != KvMode::PrefillDecode
                    || e.role == Some(EndpointRole::Prefill)
            })
            .map(|(i, _)| EndpointId(i as u16))
            .collect()
    }

    /// Endpoint `ep`'s live state (`None` past the rule's endpoints).
    pub fn ep(&self, ep: EndpointId) -> Option<&EpRuntime> {
        self.eps.get(usize::from(ep.0))
    }

    /// Blocks endpoint `ep` holds.
    pub fn block_count(&self, ep: EndpointId) -> u64 {
        self.index.block_count(ep)
    }

    /// Blocks every endpoint holds, read at once (indexed by endpoint; may be shorter).
    pub fn block_counts(&self) -> Vec<u64> {
        let mut out = Vec::new();
        self.index.block_counts(&mut out);
        out
    }

    /// One page of endpoint `ep`'s stored blocks from table position `cursor`.
    pub fn blocks(&self, ep: EndpointId, cursor: usize, limit: usize) -> BlockPage {
        self.index.blocks(ep, cursor, limit)
    }

    /// Endpoint `ep`'s blocks per rank (snapshots).
    pub fn export(&self, ep: EndpointId) -> Vec<(Rank, Vec<BlockKey>)> {
        self.index.export(ep)
    }

    /// Per endpoint, how many leading `keys` it holds (speculative credit included).
    pub fn match_prefix(&self, keys: &[BlockKey], now: Instant) -> Vec<u32> {
        let mut out = Vec::new();
        self.index.match_prefix(keys, now, &mut out);
        out
    }

    /// Each endpoint's lower-tier run past its match `from` ([`BlockIndex::match_lower`]).
    pub fn match_lower(&self, keys: &[BlockKey], from: &[u32]) -> Vec<LowerRun> {
        let mut out = Vec::new();
        self.index.match_lower(keys, from, &mut out);
        out
    }

    /// Every tenant's sums, most prompt tokens first.
    pub fn tenants(&self) -> Vec<kvroute_core::wire::TenantUsage> {
        crate::sync::lock(&self.tenants).list()
    }

    /// Adds a report's tenants (see [`kvroute_core::usage::TenantBook`]); returns how many were folded into
    /// the other tenants and how many tenants the book now holds.
    pub(super) fn account(
        &self,
        tenants: &[kvroute_core::wire::TenantUsage],
        with_model: bool,
        max: usize,
    ) -> (u64, usize) {
        let mut book = crate::sync::lock(&self.tenants);
        let folded = tenants
            .iter()
            .filter(|t| !book.add((*t).clone(), with_model, max))
            .count();
        (folded as u64, book.len())
    }

    /// Why the rule's tokenizer cannot be served, if so.
    pub fn tokenizer_problem(&self) -> Option<&str> {
        self.tokenizer_problem.as_deref()
    }

    /// A token cancelled with the rule (deleted, replaced, or the service draining).
    pub fn child_token(&self) -> CancellationToken {
        self.cancel.child_token()
    }

    /// Resolves when the rule stops.
    pub fn stopped(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Whether the rule has stopped.
    pub fn is_stopped(&self) -> bool {
        self.cancel.is_cancelled()
    }

    pub(super) fn stop(&self) {
        self.cancel.cancel();
    }

    /// Endpoint `i`'s KV cache capacity in blocks as placement sees it: the rule's
    /// `kvCapacityBlocks`, else the engine's scraped `num_gpu_blocks`, else `default`
    /// (`KVROUTE_PLACEMENT_CAPACITY_BLOCKS`); 0 = unknown.
    pub fn capacity(&self, i: usize, default: u64) -> u64 {
        if let Some(c) = self.spec.endpoints.get(i).and_then(|e| e.capacity_blocks) {
            return u64::from(c);
        }
        match self.eps.get(i).map(EpRuntime::capacity) {
            Some(0) | None => default,
            Some(c) => c,
        }
    }

    /// Refreshes the per-endpoint placement gauges (capacity and homed blocks).
    pub fn publish_placement_gauges(&self, m: &Metrics, default_capacity: u64) {
        let name = self.spec.name();
        let homed = self.memory.homed_all(self.eps.len());
        for (i, homed) in homed.into_iter().enumerate() {
            let ep = i.to_string();
            m.endpoint_capacity_blocks
                .with_label_values(&[&name, &ep])
                .set(i64::try_from(self.capacity(i, default_capacity)).unwrap_or(i64::MAX));
            m.endpoint_homed_blocks
                .with_label_values(&[&name, &ep])
                .set(i64::try_from(homed).unwrap_or(i64::MAX));
        }
    }

    /// Sets every endpoint's divergence gauge from its reports as of `now` (a verdict clears
    /// once its reports leave the window, also when no new report arrives).
    pub fn publish_divergence_gauges(&self, m: &Metrics, d: &Divergence, now: Instant) {
        let name = self.spec.name();
        for (i, rt) in self.eps.iter().enumerate() {
            let (_, divergent) = rt.outcomes(now, d);
            m.endpoint_divergent
                .with_label_values(&[&name, &i.to_string()])
                .set(i64::from(divergent));
        }
    }
}

/// True when a replacing rule keys blocks exactly as the old one (same engine, contract, block
/// size, key mode and ranks): what the old rule's index holds is still valid for it.
fn same_keys(old: &RuleSpec, new: &RuleSpec) -> bool {
    old.kv_enabled()
        && new.kv_enabled()
        && old.engine == new.engine
        && old.contract() == new.contract()
        && old.algo == new.algo
        && old.block_size == new.block_size
        && old.key_mode == new.key_mode
        && old.dp_ranks == new.dp_ranks
        && old.exact_mode == new.exact_mode
}

/// Where each of `old`'s endpoints is in `new`, by address: `to[i]` is old endpoint `i`'s new
/// index, `None` when `new` does not list it.
fn renumbering(old: &RuleSpec, new: &RuleSpec) -> Vec<Option<usize>> {
    let at: std::collections::HashMap<String, usize> = new
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| (e.addr(), i))
        .collect();
    old.endpoints
        .iter()
        .map(|e| at.get(&e.addr()).copied())
        .collect()
}

/// Carries the old rule's index over to its replacement: an endpoint the new rule still lists
/// (by address, wherever it now is in the list) keeps its GPU blocks, sequence positions, health
/// and capacity (its new subscribers resume like after a reconnect: a gap replays or clears, a
/// restart clears); one that moved in the list loses its lower-tier blocks and speculative
/// credit. Every other position is cleared.
fn keep_inventory(
    old: &RuleRuntime,
    to: &[Option<usize>],
    eps: &[EpRuntime],
) -> Arc<dyn BlockIndex> {
    let index = old.index.clone();
    let mut moved = Vec::new();
    for (i, t) in to.iter().enumerate() {
        let Some(j) = *t else { continue };
        if let (Some(o), Some(e)) = (old.eps.get(i), eps.get(j)) {
            e.inherit(o);
        }
        if i != j {
            moved.push((j, index.export(EndpointId(i as u16))));
        }
    }
    for (i, t) in to.iter().enumerate() {
        if *t != Some(i) {
            for r in old.ranks() {
                index.apply(EndpointId(i as u16), r, &[IndexOp::Clear]);
            }
        }
    }
    for (j, ranks) in moved {
        for (r, keys) in ranks {
            index.apply(EndpointId(j as u16), r, &[IndexOp::Store(keys)]);
        }
    }
    index
}
