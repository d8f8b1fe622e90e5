//! Turns decoded engine events into index operations for one `(endpoint, rank)` publisher.
//!
//! * `engine` key mode: vLLM/SGLang keys are stored as published; a parity self-check recomputes
//!   the key of every event that starts a chain (no parent) from its token ids with the rule's
//!   contract, and on a mismatch says which leg is probably wrong ([`super::parity`]).
//! * `tokens` key mode: token ids are re-hashed into kvroute's content key, continuing from the
//!   parent's content key; an engine-key -> content-key map serves later removals and parents.
//! * TensorRT-LLM: stored blocks are re-hashed from their tokens with `blockhash_trtllm` (or the
//!   content key in tokens mode); partial blocks are skipped; the engine hash -> key map serves
//!   removals. While the endpoint's canary listens, each stored event is also offered to its
//!   tap as a [`Stored`] of the engine's own hashes and tokens ([`super::trtllm::tapped`]).
//! * Only GPU blocks enter the index; other media are counted.
//! * Only full-attention KV-cache groups enter the index. A hybrid model publishes its
//!   sliding-window or Mamba group's blocks under the same hashes as the full-attention group's;
//!   a sliding-window eviction of a block the full-attention group still holds must not erase
//!   the prefix, nor a store fake one. A group's kind comes with its stores
//!   (`kv_cache_spec_kind`) and is remembered for its removals, which carry only `group_idx`.

use std::sync::Arc;

use kvroute_core::hash::{
    content_keys, trtllm, BlockKey, BlockSize, Engine, ExtraKeys, HashContract,
};

use super::decode::{EventBatch, GroupKind, KvEvent, Medium, Spare, Stored};
use super::parity::diagnose;
use super::trtllm::{block_tokens, tapped};
use crate::fleet::ParityReport;
use crate::index::{IndexOp, KeyMap};
use crate::metrics::{ClearCause, Metrics, ParityCheck};
use crate::rules::KeyMode;
use prometheus::IntCounter;

/// Per-publisher keying state.
pub struct Keyer {
    engine: Engine,
    key_mode: KeyMode,
    block_size: u32,
    contract: Option<HashContract>,
    /// Engine key -> stored key (tokens mode, TensorRT-LLM).
    map: KeyMap<u64>,
    metrics: Arc<Metrics>,
    /// Set on the latest parity mismatch (for /healthz); cleared by a later match.
    pub parity: Option<ParityReport>,
    /// Parity checks (matched, mismatched) not yet handed to the endpoint ([`Keyer::take_parity`]).
    pending: (u64, u64),
    mismatches: u64,
    /// KV-cache groups seen with a kind other than full attention, and that kind (a handful).
    partial_groups: Vec<(u32, GroupKind)>,
    events: EventCounters,
    /// The endpoint's parity canary tap ([`Keyer::with_tap`]).
    tap: Option<Arc<super::tap::Tap>>,
    /// TensorRT-LLM: the largest `window_size` seen, the one indexed ([`Keyer::trtllm_ops`]).
    trtllm_window: Option<u64>,
}

/// `kvroute_ingest_events_total` of the keyer's engine for the vLLM / SGLang event types,
/// looked up once: a label lookup (hashing both labels under the vector's lock) per event cost
/// more than keying the event.
struct EventCounters {
    stored: IntCounter,
    removed: IntCounter,
    cleared: IntCounter,
}

/// Entries the engine-key map (tokens mode, TensorRT-LLM) may hold; past it the map is dropped and
/// the endpoint cleared ([`Keyer::overflow`]), so memory stays bounded whatever a publisher sends.
const MAX_MAP: usize = 4 << 20;

impl Keyer {
    /// A keyer for one publisher of a rule.
    pub fn new(
        engine: Engine,
        key_mode: KeyMode,
        block_size: u32,
        contract: Option<HashContract>,
        metrics: Arc<Metrics>,
    ) -> Keyer {
        let counter = |ty: &str| metrics.events.with_label_values(&[engine.as_str(), ty]);
        let events = EventCounters {
            stored: counter("block_stored"),
            removed: counter("block_removed"),
            cleared: counter("all_blocks_cleared"),
        };
        Keyer {
            engine,
            key_mode,
            block_size,
            contract,
            map: KeyMap::default(),
            metrics,
            parity: None,
            pending: (0, 0),
            mismatches: 0,
            partial_groups: Vec::new(),
            events,
            tap: None,
            trtllm_window: None,
        }
    }

    /// Offers every `BlockStored` to `tap` (the endpoint's parity canary) before keying it.
    pub fn with_tap(mut self, tap: Arc<super::tap::Tap>) -> Keyer {
        self.tap = Some(tap);
        self
    }

    /// Forgets engine-key mappings (the endpoint's inventory was cleared).
    pub fn reset(&mut self) {
        self.map.clear();
    }

    fn count(&self, ty: &str) {
        match ty {
            "block_stored" => self.events.stored.inc(),
            "block_removed" => self.events.removed.inc(),
            "all_blocks_cleared" => self.events.cleared.inc(),
            other => self
                .metrics
                .events
                .with_label_values(&[self.engine.as_str(), other])
                .inc(),
        }
    }

    /// Operations for one vLLM / SGLang batch ([`Keyer::take_ops`] of a copy).
    pub fn batch_ops(&mut self, batch: &EventBatch) -> Vec<IndexOp> {
        let mut ops = Vec::with_capacity(batch.events.len());
        self.take_ops(&mut batch.clone(), &mut ops, &mut Spare::default());
        ops
    }

    /// Appends the operations for one vLLM / SGLang batch to `ops`, taking its events (the
    /// batch's vector is left empty for the next): in `engine` mode their key vectors become
    /// the operations' (no copy, no allocation); their token vectors go to `spare`.
    pub fn take_ops(&mut self, batch: &mut EventBatch, ops: &mut Vec<IndexOp>, spare: &mut Spare) {
        ops.reserve(batch.events.len());
        for ev in batch.events.drain(..) {
            match ev {
                KvEvent::Stored(mut s) => {
                    if let Some(op) = self.stored_event(&mut s, ops) {
                        ops.push(op);
                    }
                    spare.give_tokens(std::mem::take(&mut s.token_ids));
                }
                KvEvent::Removed {
                    block_hashes,
                    medium,
                    group,
                } => {
                    self.count("block_removed");
                    let lower = medium.lower();
                    if medium != Medium::Gpu && lower.is_none() {
                        continue;
                    }
                    if let Some(kind) = self.partial_group(group, None) {
                        self.skip_partial(kind, "block_removed", block_hashes.len());
                        continue;
                    }
                    if let Some(l) = lower {
                        // Tokens mode: the GPU copy may still be mapped, so the mapping stays.
                        let keys = match self.key_mode {
                            KeyMode::Engine => block_hashes.into_iter().map(BlockKey).collect(),
                            KeyMode::Tokens => block_hashes
                                .iter()
                                .filter_map(|h| self.map.get(h).copied())
                                .map(BlockKey)
                                .collect(),
                        };
                        ops.push(IndexOp::RemoveLower(l, keys));
                        continue;
                    }
                    let keys = match self.key_mode {
                        // Collected in place: the same allocation, the same bits.
                        KeyMode::Engine => block_hashes.into_iter().map(BlockKey).collect(),
                        KeyMode::Tokens => block_hashes
                            .iter()
                            .filter_map(|h| self.map.remove(h))
                            .map(BlockKey)
                            .collect(),
                    };
                    ops.push(IndexOp::Remove(keys));
                }
                KvEvent::AllCleared => {
                    self.count("all_blocks_cleared");
                    self.metrics
                        .clear(self.engine.as_str(), ClearCause::Event)
                        .inc();
                    self.map.clear();
                    ops.push(IndexOp::Clear);
                }
            }
        }
    }

    /// The operation for one `BlockStored` (its key vector taken when it becomes the operation's).
    fn stored_event(&mut self, s: &mut Stored, ops: &mut Vec<IndexOp>) -> Option<IndexOp> {
        self.count("block_stored");
        if s.medium != Medium::Gpu {
            self.metrics
                .non_gpu_blocks
                .with_label_values(&[self.engine.as_str(), s.medium.as_str()])
                .inc_by(s.block_hashes.len() as u64);
        }
        let lower = s.medium.lower();
        if s.medium != Medium::Gpu && lower.is_none() {
            return None;
        }
        if let Some(kind) = self.partial_group(s.group, s.kind) {
            self.skip_partial(kind, "block_stored", s.block_hashes.len());
            return None;
        }
        match lower {
            None => {
                if let Some(t) = &self.tap {
                    t.offer(s);
                }
                self.stored(s, ops)
            }
            Some(l) => self.stored_lower(s, ops).map(|k| IndexOp::StoreLower(l, k)),
        }
    }

    /// The kind of a group that is not full attention (`None`: index the event). A store's own
    /// kind wins and is remembered per group; an event naming no kind takes its group's
    /// remembered kind; an event naming neither is a single-group engine's (full attention).
    fn partial_group(&mut self, group: Option<u32>, kind: Option<GroupKind>) -> Option<GroupKind> {
        let known = group.and_then(|g| {
            self.partial_groups
                .iter()
                .find(|(idx, _)| *idx == g)
                .map(|(_, k)| *k)
        });
        let kind = match (kind, group) {
            (Some(k), Some(g)) => {
                self.partial_groups.retain(|(idx, _)| *idx != g);
                // Bounded: an engine has a few groups; a publisher naming thousands is ignored.
                if k != GroupKind::Full && self.partial_groups.len() < 64 {
                    self.partial_groups.push((g, k));
                }
                k
            }
            (Some(k), None) => k,
            (None, _) => known.unwrap_or(GroupKind::Full),
        };
        (kind != GroupKind::Full).then_some(kind)
    }

    fn skip_partial(&self, kind: GroupKind, event: &str, blocks: usize) {
        self.metrics
            .partial_group_blocks
            .with_label_values(&[self.engine.as_str(), kind.as_str(), event])
            .inc_by(blocks as u64);
    }

    /// The engine-key map is full: forget it and clear the endpoint (counted), since removals of
    /// what it held could no longer be applied; the inventory is rebuilt from new events.
    fn overflow(&mut self, ops: &mut Vec<IndexOp>) {
        self.map.clear();
        self.metrics
            .clear(self.engine.as_str(), ClearCause::KeyerFull)
            .inc();
        ops.push(IndexOp::Clear);
    }

    /// The keys of a lower-tier store: as a GPU store's when the event carries its tokens (or
    /// the engine's keys are the index's); in tokens mode without tokens, the keys the GPU
    /// stores of the same engine hashes mapped (blocks never seen on GPU are counted unkeyed).
    fn stored_lower(&mut self, s: &mut Stored, ops: &mut Vec<IndexOp>) -> Option<Vec<BlockKey>> {
        if self.key_mode == KeyMode::Tokens && s.token_ids.is_empty() {
            let keys: Vec<BlockKey> = s
                .block_hashes
                .iter()
                .filter_map(|h| self.map.get(h).copied())
                .map(BlockKey)
                .collect();
            let unknown = s.block_hashes.len() - keys.len();
            if unknown > 0 {
                self.metrics
                    .unkeyed_blocks
                    .with_label_values(&[self.engine.as_str()])
                    .inc_by(unknown as u64);
            }
            return Some(keys);
        }
        match self.stored(s, ops)? {
            IndexOp::Store(keys) => Some(keys),
            _ => None,
        }
    }

    fn stored(&mut self, s: &mut Stored, ops: &mut Vec<IndexOp>) -> Option<IndexOp> {
        match self.key_mode {
            KeyMode::Engine => {
                if s.parent.is_none()
                    && !s.token_ids.is_empty()
                    && !s.has_lora
                    && !s.has_extra_keys
                    && s.cache_salt.is_none()
                {
                    self.check_parity(s);
                }
                // Collected in place: the same allocation, the same bits.
                Some(IndexOp::Store(
                    std::mem::take(&mut s.block_hashes)
                        .into_iter()
                        .map(BlockKey)
                        .collect(),
                ))
            }
            KeyMode::Tokens => {
                let n = s.block_hashes.len();
                let bs = self.block_size as usize;
                if n == 0 || s.token_ids.len() != n * bs {
                    self.metrics
                        .unkeyed_blocks
                        .with_label_values(&[self.engine.as_str()])
                        .inc_by(n as u64);
                    return None;
                }
                let parent = match s.parent {
                    None => None,
                    Some(p) => match self.map.get(&p) {
                        Some(c) => Some(BlockKey(*c)),
                        None => {
                            // The parent's tokens are unknown (stored before we subscribed): these
                            // blocks cannot be keyed by content until the prefix is stored again.
                            self.metrics
                                .unkeyed_blocks
                                .with_label_values(&[self.engine.as_str()])
                                .inc_by(n as u64);
                            return None;
                        }
                    },
                };
                let bsz = BlockSize::new(self.block_size)?;
                let keys = content_keys(&s.token_ids, bsz, parent);
                if self.map.len() + keys.len() > MAX_MAP {
                    self.overflow(ops);
                }
                for (h, k) in s.block_hashes.iter().zip(&keys) {
                    self.map.insert(*h, k.0);
                }
                Some(IndexOp::Store(keys))
            }
        }
    }

    fn check_parity(&mut self, s: &Stored) {
        let Some(c) = &self.contract else { return };
        let n = s.block_hashes.len();
        if n == 0 || s.token_ids.len() != n * c.block_size.get() {
            // Block size disagrees with the event: that alone is a mismatch worth reporting.
            self.mismatch(s);
            return;
        }
        let ok = match c.keys(&s.token_ids, &ExtraKeys::default()) {
            Ok(keys) => keys.iter().map(|k| k.0).eq(s.block_hashes.iter().copied()),
            Err(_) => false,
        };
        if ok {
            self.pending.0 += 1;
            self.metrics
                .parity_check(self.engine.as_str(), ParityCheck::Match)
                .inc();
            self.parity = None;
        } else {
            self.mismatch(s);
        }
    }

    fn mismatch(&mut self, s: &Stored) {
        self.pending.1 += 1;
        self.metrics
            .parity_check(self.engine.as_str(), ParityCheck::Mismatch)
            .inc();
        self.metrics
            .parity_mismatches
            .with_label_values(&[self.engine.as_str()])
            .inc();
        self.mismatches += 1;
        let Some(c) = &self.contract else { return };
        let report = diagnose(self.engine, c, s);
        // One line per publisher on the first mismatch, then every 1000th: loud but bounded.
        if self.mismatches == 1 || self.mismatches % 1000 == 0 {
            tracing::error!(engine = %self.engine, mismatches = self.mismatches, "parity self-check failed: {}", report.message);
        }
        self.parity = Some(report);
    }

    /// Parity checks since the last call, as `(matched, mismatched)`.
    pub fn take_parity(&mut self) -> (u64, u64) {
        std::mem::take(&mut self.pending)
    }

    /// Whether a TensorRT-LLM envelope's window is the one indexed. A model with variable
    /// sliding-window attention keeps one block pool per attention window and publishes each
    /// pool's events with its `window_size`; only the largest window holds a whole prefix (full
    /// attention), so only its events are indexed and the others are counted as sliding-window
    /// blocks. A larger window seen after a smaller one clears what was indexed (`window`).
    fn trtllm_window(&mut self, env: &serde_json::Value, ops: &mut Vec<IndexOp>) -> bool {
        let Some(w) = env.get("window_size").and_then(serde_json::Value::as_u64) else {
            return true;
        };
        match self.trtllm_window {
            Some(max) if w < max => false,
            Some(max) if w == max => true,
            had => {
                if had.is_some() {
                    self.map.clear();
                    self.metrics
                        .clear(self.engine.as_str(), ClearCause::Window)
                        .inc();
                    ops.push(IndexOp::Clear);
                }
                self.trtllm_window = Some(w);
                true
            }
        }
    }

    /// Operations for one TensorRT-LLM `/kv_cache_events` drain.
    pub fn trtllm_ops(&mut self, events: &[serde_json::Value]) -> Vec<IndexOp> {
        use serde_json::Value;
        let mut ops = Vec::new();
        let bs = self.block_size as usize;
        for env in events {
            let data = env.get("data").unwrap_or(env);
            let kind = data.get("type").and_then(Value::as_str);
            if matches!(kind, Some("stored" | "removed")) && !self.trtllm_window(env, &mut ops) {
                let (event, n) = match kind {
                    Some("stored") => (
                        "block_stored",
                        data.get("blocks")
                            .and_then(Value::as_array)
                            .map_or(0, Vec::len),
                    ),
                    _ => (
                        "block_removed",
                        data.get("block_hashes")
                            .and_then(Value::as_array)
                            .map_or(0, Vec::len),
                    ),
                };
                self.count(event);
                self.skip_partial(GroupKind::SlidingWindow, event, n);
                continue;
            }
            match kind {
                Some("stored") => {
                    self.count("block_stored");
                    // Built only while a canary run listens: otherwise one relaxed load.
                    if let Some(t) = self.tap.as_deref().filter(|t| t.armed()) {
                        t.offer(&tapped(data, self.block_size));
                    }
                    let mut parent_engine = data.get("parent_hash").and_then(Value::as_u64);
                    let mut parent_key: Option<u64> = match parent_engine {
                        None => Some(0),
                        Some(p) => self.map.get(&p).copied(),
                    };
                    let mut keys = Vec::new();
                    for b in data
                        .get("blocks")
                        .and_then(Value::as_array)
                        .map(Vec::as_slice)
                        .unwrap_or(&[])
                    {
                        let engine_hash = b.get("block_hash").and_then(Value::as_u64);
                        let Some(tokens) = block_tokens(b) else {
                            self.metrics
                                .malformed_events
                                .with_label_values(&[self.engine.as_str(), "bad_token_ids"])
                                .inc();
                            parent_key = None;
                            continue;
                        };
                        let level_gpu =
                            b.get("cache_level").and_then(Value::as_u64).unwrap_or(0) == 0;
                        // No engine hash, an unknown parent, or a partial block (never routed
                        // on): unkeyable, and it ends the chain in this event.
                        let (Some(eh), Some(pk), true) =
                            (engine_hash, parent_key, tokens.len() == bs)
                        else {
                            self.metrics
                                .unkeyed_blocks
                                .with_label_values(&[self.engine.as_str()])
                                .inc();
                            parent_key = None;
                            continue;
                        };
                        let key = match self.key_mode {
                            KeyMode::Engine => trtllm::block_key(
                                pk,
                                &tokens,
                                None,
                                b.get("lora_id").and_then(Value::as_u64),
                            ),
                            KeyMode::Tokens => {
                                let parent = if parent_engine.is_none() && pk == 0 {
                                    None
                                } else {
                                    Some(BlockKey(pk))
                                };
                                match BlockSize::new(self.block_size) {
                                    Some(bsz) => content_keys(&tokens, bsz, parent)
                                        .first()
                                        .map_or(0, |k| k.0),
                                    None => 0,
                                }
                            }
                        };
                        if self.map.len() >= MAX_MAP {
                            // Removals could no longer be mapped: rebuild from new events.
                            self.overflow(&mut ops);
                            keys.clear();
                        }
                        self.map.insert(eh, key);
                        parent_engine = Some(eh);
                        parent_key = Some(key);
                        if level_gpu {
                            keys.push(BlockKey(key));
                        } else {
                            self.metrics
                                .non_gpu_blocks
                                .with_label_values(&[self.engine.as_str(), "cpu"])
                                .inc();
                        }
                    }
                    ops.push(IndexOp::Store(keys));
                }
                Some("removed") => {
                    self.count("block_removed");
                    let keys = data
                        .get("block_hashes")
                        .and_then(Value::as_array)
                        .map(|a| {
                            a.iter()
                                .filter_map(Value::as_u64)
                                .filter_map(|h| self.map.remove(&h))
                                .map(BlockKey)
                                .collect()
                        })
                        .unwrap_or_default();
                    ops.push(IndexOp::Remove(keys));
                }
                Some("created") | Some("updated") => {
                    self.count(data.get("type").and_then(Value::as_str).unwrap_or("other"))
                }
                _ => {}
            }
        }
        ops
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::ingest::decode::{decode_batch, BytesKey};
    use kvroute_core::hash::HashAlgo;

    fn metrics() -> Arc<Metrics> {
        Arc::new(Metrics::new().unwrap())
    }

    fn vllm_batch() -> EventBatch {
        let p = format!(
            "{}/../shared/tests/vectors/vllm-0.33.0.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        let hexs = v["events"]["int_keys_default"]["batch_payload_hex"]
            .as_str()
            .unwrap();
        decode_batch(&hex::decode(hexs).unwrap(), BytesKey::Last8).unwrap()
    }

    fn bs16() -> BlockSize {
        BlockSize::new(16).unwrap()
    }

    #[test]
    fn engine_mode_parity_passes_with_the_right_seed() {
        let c = HashContract::new(HashAlgo::Sha256Cbor, bs16()).with_seed("0");
        let mut k = Keyer::new(Engine::Vllm, KeyMode::Engine, 16, Some(c), metrics());
        let ops = k.batch_ops(&vllm_batch());
        assert_eq!(ops.len(), 3);
        assert_eq!(k.take_parity(), (1, 0));
        assert_eq!(k.take_parity(), (0, 0), "taken once");
        assert!(k.parity.is_none());
    }

    #[test]
    fn engine_mode_parity_names_the_seed_when_wrong() {
        let c = HashContract::new(HashAlgo::Sha256Cbor, bs16()).with_seed("1234");
        let m = metrics();
        let mut k = Keyer::new(Engine::Vllm, KeyMode::Engine, 16, Some(c), m.clone());
        k.batch_ops(&vllm_batch());
        let r = k.parity.clone().unwrap();
        assert!(r.message.contains("seed"), "{}", r.message);
        assert_eq!(r.suggested_seed.as_deref(), Some("0"));
        assert_eq!(m.parity_mismatches.with_label_values(&["vllm"]).get(), 1);
    }

    /// One batch of `events`.
    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
            skipped: 0,
            skips: Vec::new(),
        }
    }

    fn keys(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    fn store(hashes: &[u64], group: Option<u32>, kind: Option<GroupKind>) -> KvEvent {
        KvEvent::Stored(Stored {
            block_hashes: hashes.to_vec(),
            parent: None,
            token_ids: Vec::new(),
            block_size: Some(16),
            medium: Medium::Gpu,
            has_lora: false,
            has_extra_keys: false,
            cache_salt: None,
            group,
            kind,
        })
    }

    fn remove(hashes: &[u64], group: Option<u32>) -> KvEvent {
        KvEvent::Removed {
            block_hashes: hashes.to_vec(),
            medium: Medium::Gpu,
            group,
        }
    }

    #[test]
    fn only_full_attention_groups_enter_the_index() {
        let m = metrics();
        let mut k = Keyer::new(Engine::Vllm, KeyMode::Engine, 16, None, m.clone());
        // A hybrid model stores the same blocks in its full-attention and sliding-window groups.
        let ops = k.batch_ops(&batch(vec![
            store(&[1, 2, 3], Some(0), Some(GroupKind::Full)),
            store(&[1, 2, 3], Some(1), Some(GroupKind::SlidingWindow)),
            store(&[4], Some(2), Some(GroupKind::Mamba)),
        ]));
        assert_eq!(ops, vec![IndexOp::Store(keys(&[1, 2, 3]))]);
        // The window slides: group 1 drops blocks 1 and 2 (its removals name only the group),
        // which the full-attention group still holds: nothing leaves the index.
        let ops = k.batch_ops(&batch(vec![
            remove(&[1, 2], Some(1)),
            remove(&[4], Some(2)),
        ]));
        assert!(ops.is_empty(), "{ops:?}");
        // The full-attention group's own eviction, and an engine that names no group, apply.
        let ops = k.batch_ops(&batch(vec![
            remove(&[3], Some(0)),
            remove(&[2], None),
            store(&[9], None, None),
        ]));
        assert_eq!(
            ops,
            vec![
                IndexOp::Remove(keys(&[3])),
                IndexOp::Remove(keys(&[2])),
                IndexOp::Store(keys(&[9]))
            ]
        );
        let skipped = |kind: &str, event: &str| {
            m.partial_group_blocks
                .with_label_values(&["vllm", kind, event])
                .get()
        };
        assert_eq!(skipped("sliding_window", "block_stored"), 3);
        assert_eq!(skipped("sliding_window", "block_removed"), 2);
        assert_eq!(skipped("mamba", "block_stored"), 1);
        assert_eq!(skipped("mamba", "block_removed"), 1);
    }

    /// Host-memory and storage blocks go to the index's lower tiers (tokens mode through the
    /// keys their GPU stores mapped, the mapping kept past a lower-tier removal); another medium
    /// is counted only; none of them reaches the canary's tap.
    #[test]
    fn lower_tier_blocks_are_indexed_per_tier() {
        use crate::index::Lower;
        let m = metrics();
        let on = |e: KvEvent, medium: Medium| match e {
            KvEvent::Stored(s) => KvEvent::Stored(Stored { medium, ..s }),
            KvEvent::Removed {
                block_hashes,
                group,
                ..
            } => KvEvent::Removed {
                block_hashes,
                medium,
                group,
            },
            other => other,
        };
        let tap = Arc::new(crate::ingest::tap::Tap::default());
        let mut k =
            Keyer::new(Engine::Vllm, KeyMode::Engine, 16, None, m.clone()).with_tap(tap.clone());
        let _armed = tap.arm(std::collections::HashSet::new());
        let with_tokens_of = |hashes: &[u64]| match store(hashes, None, None) {
            KvEvent::Stored(s) => KvEvent::Stored(Stored {
                token_ids: (0..32).collect(),
                ..s
            }),
            e => e,
        };
        let ops = k.batch_ops(&batch(vec![
            on(with_tokens_of(&[1, 2]), Medium::Cpu),
            on(store(&[3], None, None), Medium::Storage),
            on(store(&[4], None, None), Medium::Other),
            on(remove(&[1], None), Medium::Cpu),
            on(remove(&[4], None), Medium::Other),
        ]));
        assert_eq!(
            ops,
            vec![
                IndexOp::StoreLower(Lower::Cpu, keys(&[1, 2])),
                IndexOp::StoreLower(Lower::Storage, keys(&[3])),
                IndexOp::RemoveLower(Lower::Cpu, keys(&[1])),
            ]
        );
        assert!(
            tap.events().is_empty(),
            "lower tiers are not offered to the canary"
        );
        let non_gpu = |medium| m.non_gpu_blocks.with_label_values(&["vllm", medium]).get();
        assert_eq!(
            (non_gpu("cpu"), non_gpu("storage"), non_gpu("other")),
            (2, 1, 1)
        );

        // Tokens mode: a lower-tier store without tokens takes the GPU store's keys.
        let mut k = Keyer::new(Engine::Vllm, KeyMode::Tokens, 16, None, m.clone());
        let stored_hashes = [11, 12];
        let gpu = k.batch_ops(&batch(vec![with_tokens_of(&stored_hashes)]));
        let content = content_keys(&(0..32).collect::<Vec<u32>>(), bs16(), None);
        assert_eq!(gpu, vec![IndexOp::Store(content.clone())]);
        let ops = k.batch_ops(&batch(vec![
            on(store(&stored_hashes, None, None), Medium::Cpu),
            on(remove(&stored_hashes[1..], None), Medium::Cpu),
            on(store(&[77], None, None), Medium::Cpu),
        ]));
        assert_eq!(
            ops,
            vec![
                IndexOp::StoreLower(Lower::Cpu, content.clone()),
                IndexOp::RemoveLower(Lower::Cpu, content[1..].to_vec()),
                IndexOp::StoreLower(Lower::Cpu, Vec::new()),
            ]
        );
        assert_eq!(m.unkeyed_blocks.with_label_values(&["vllm"]).get(), 1);
    }

    #[test]
    fn tokens_mode_maps_removals() {
        let mut k = Keyer::new(Engine::Vllm, KeyMode::Tokens, 16, None, metrics());
        let ops = k.batch_ops(&vllm_batch());
        let want = content_keys(&(0..32).collect::<Vec<u32>>(), bs16(), None);
        assert_eq!(ops[0], IndexOp::Store(want.clone()));
        assert_eq!(ops[1], IndexOp::Remove(vec![want[0]]));
        assert_eq!(ops[2], IndexOp::Clear);
    }

    /// Variable sliding-window attention: only the largest window's events are indexed, and a
    /// larger window appearing after a smaller one clears what the smaller one stored.
    #[test]
    fn trtllm_indexes_only_the_largest_attention_window() {
        let m = metrics();
        let mut k = Keyer::new(Engine::Trtllm, KeyMode::Engine, 2, None, m.clone());
        let stored = |id: u64, hash: u64, window: u64| {
            serde_json::json!({"event_id": id, "window_size": window, "data": {"type": "stored",
                "parent_hash": null, "blocks": [{"block_hash": hash,
                "tokens": [{"token_id": 1, "token_extra_id": 0}, {"token_id": 2, "token_extra_id": 0}],
                "cache_level": 0, "priority": 35}]}})
        };
        let removed = |id: u64, hash: u64, window: u64| {
            serde_json::json!({"event_id": id, "window_size": window,
                "data": {"type": "removed", "block_hashes": [hash]}})
        };
        let key = trtllm::block_key(0, &[1, 2], None, None);
        // Window 4096 first, then the full-attention 32768: the 4096 store is dropped.
        let ops = k.trtllm_ops(&[stored(1, 11, 4096), stored(2, 22, 32768)]);
        assert_eq!(
            ops,
            vec![
                IndexOp::Store(vec![BlockKey(key)]),
                IndexOp::Clear,
                IndexOp::Store(vec![BlockKey(key)])
            ]
        );
        assert_eq!(
            m.clear("trtllm", ClearCause::Window).get(),
            1,
            "the smaller window's blocks were cleared"
        );
        // From now on the smaller window's stores and removals are skipped and counted: its
        // eviction does not erase the full-attention prefix.
        let ops = k.trtllm_ops(&[
            stored(3, 33, 4096),
            removed(4, 33, 4096),
            removed(5, 11, 4096),
        ]);
        assert!(ops.is_empty(), "{ops:?}");
        let skipped = |event: &str| {
            m.partial_group_blocks
                .with_label_values(&["trtllm", "sliding_window", event])
                .get()
        };
        assert_eq!((skipped("block_stored"), skipped("block_removed")), (1, 2));
        assert_eq!(
            k.trtllm_ops(&[removed(6, 22, 32768)]),
            vec![IndexOp::Remove(vec![BlockKey(key)])]
        );
        // An engine without window sizes is indexed as before.
        let mut plain = Keyer::new(Engine::Trtllm, KeyMode::Engine, 2, None, metrics());
        let mut e = stored(1, 11, 0);
        e.as_object_mut().unwrap().remove("window_size");
        assert_eq!(
            plain.trtllm_ops(&[e]),
            vec![IndexOp::Store(vec![BlockKey(key)])]
        );
    }

    /// While a canary run listens, each indexed stored event reaches the tap as the engine's
    /// full blocks; otherwise nothing is built or kept.
    #[test]
    fn trtllm_stored_events_feed_an_armed_tap() {
        let tap = Arc::new(crate::ingest::tap::Tap::default());
        let mut k =
            Keyer::new(Engine::Trtllm, KeyMode::Engine, 4, None, metrics()).with_tap(tap.clone());
        let toks = |r: std::ops::Range<u32>| {
            r.map(|t| serde_json::json!({"token_id": t, "token_extra_id": 0}))
                .collect::<Vec<_>>()
        };
        let block = |hash: u64, r: std::ops::Range<u32>| {
            serde_json::json!({"type": "stored_block", "block_hash": hash, "tokens": toks(r),
                "cache_level": 0, "priority": 35})
        };
        let stored = |id: u64, parent: Option<u64>, blocks: Vec<serde_json::Value>| {
            serde_json::json!({"event_id": id, "window_size": 64,
                "data": {"type": "stored", "parent_hash": parent, "blocks": blocks}})
        };
        let first = stored(
            1,
            None,
            vec![block(111, 0..4), block(222, 4..8), block(333, 8..10)],
        );
        // Not armed: the drain is keyed, nothing is kept.
        assert!(!tap.armed());
        assert_eq!(k.trtllm_ops(std::slice::from_ref(&first)).len(), 1);
        assert!(tap.events().is_empty());

        let _armed = tap.arm([111, 222].into_iter().collect());
        let mut lora = block(444, 8..12);
        lora["lora_id"] = serde_json::json!(7);
        let mut media = block(666, 0..4);
        media["mm_keys"] = serde_json::json!([{"hash": "ab", "start_offset": 0}]);
        media["cache_salt"] = serde_json::json!("tenant");
        k.trtllm_ops(&[
            first,
            // A continuation of one of the run's keys, naming an adapter: kept.
            stored(2, Some(222), vec![lora]),
            // A continuation of other traffic: not the run's.
            stored(3, Some(999), vec![block(555, 0..4)]),
            // A lone partial block (its full predecessors came before): no full block.
            stored(4, Some(222), vec![block(777, 8..10)]),
            // A chain start with media and a salt: kept, flagged.
            stored(5, None, vec![media]),
            // The smaller attention window: not indexed, not offered.
            serde_json::json!({"event_id": 6, "window_size": 8, "data": {"type": "stored",
                "parent_hash": null, "blocks": [block(888, 0..4)]}}),
            serde_json::json!({"event_id": 7, "window_size": 64,
                "data": {"type": "removed", "block_hashes": [111]}}),
        ]);
        let got = tap.events();
        assert_eq!(got.len(), 3, "{got:?}");
        let s = &got[0];
        assert_eq!(
            s.block_hashes,
            vec![111, 222],
            "the partial tail is dropped"
        );
        assert_eq!(s.parent, None);
        assert_eq!(s.token_ids, (0..8).collect::<Vec<u32>>());
        assert_eq!(s.block_size, Some(4));
        assert_eq!(s.medium, Medium::Gpu);
        assert!(!s.has_lora && !s.has_extra_keys && s.cache_salt.is_none());
        assert_eq!(
            (got[1].parent, got[1].block_hashes.clone()),
            (Some(222), vec![444])
        );
        assert!(got[1].has_lora && !got[1].has_extra_keys);
        assert_eq!(got[2].block_hashes, vec![666]);
        assert!(got[2].has_extra_keys && !got[2].has_lora);
        assert_eq!(got[2].cache_salt.as_deref(), Some("tenant"));
    }

    /// Blocks of another size than the rule's are tapped with their own size, keyed or not.
    #[test]
    fn trtllm_tap_reports_the_engines_tokens_per_block() {
        let tap = Arc::new(crate::ingest::tap::Tap::default());
        let mut k =
            Keyer::new(Engine::Trtllm, KeyMode::Engine, 4, None, metrics()).with_tap(tap.clone());
        let _armed = tap.arm(Default::default());
        let tokens = |r: std::ops::Range<u32>| r.collect::<Vec<u32>>();
        let ev = serde_json::json!([{"event_id": 1, "data": {"type": "stored", "parent_hash": null,
            "blocks": [{"block_hash": 1, "tokens": tokens(0..8), "cache_level": 0},
                       {"block_hash": 2, "tokens": tokens(8..16), "cache_level": 0}]}}]);
        let ops = k.trtllm_ops(ev.as_array().unwrap());
        assert_eq!(ops, vec![IndexOp::Store(Vec::new())], "unkeyable at size 4");
        let got = tap.events();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].block_size, Some(8));
        assert_eq!(got[0].block_hashes, vec![1, 2]);
        assert_eq!(got[0].token_ids, tokens(0..16));
    }

    #[test]
    fn trtllm_rehash_skips_partial_blocks_and_maps_removals() {
        let mut k = Keyer::new(Engine::Trtllm, KeyMode::Engine, 4, None, metrics());
        let toks = |r: std::ops::Range<u32>| {
            r.map(|t| serde_json::json!({"token_id": t, "token_extra_id": 0}))
                .collect::<Vec<_>>()
        };
        let ev = serde_json::json!([
            {"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [
                {"block_hash": 111, "tokens": toks(0..4), "cache_level": 0, "priority": 35},
                {"block_hash": 222, "tokens": toks(4..8), "cache_level": 0, "priority": 35},
                {"block_hash": 333, "tokens": toks(8..10), "cache_level": 0, "priority": 35}]}, "window_size": 32},
            {"event_id": 2, "data": {"type": "removed", "block_hashes": [222]}, "window_size": 32}
        ]);
        let ops = k.trtllm_ops(ev.as_array().unwrap());
        let k0 = trtllm::block_key(0, &[0, 1, 2, 3], None, None);
        let k1 = trtllm::block_key(k0, &[4, 5, 6, 7], None, None);
        assert_eq!(
            ops,
            vec![
                IndexOp::Store(vec![BlockKey(k0), BlockKey(k1)]),
                IndexOp::Remove(vec![BlockKey(k1)])
            ]
        );
    }
}
