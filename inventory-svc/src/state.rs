//! Shared service state: the rule table, each rule's runtime (index, endpoint health and load,
//! counters, ingest status) and the service-wide metrics and settings.
//!
//! Rules are immutable once validated; replacing or deleting a rule cancels its tasks through the
//! rule's child [`CancellationToken`] and drops its index with the last reference.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::index::{BlockIndex, EndpointId, MemIndex};
use crate::ingest::parity::ParityReport;
use crate::metrics::Metrics;
use crate::rules::RuleSpec;
use crate::score::{HashRing, PlacementMemory};
use crate::settings::Settings;

/// Locks a mutex, recovering from poisoning (a panicked holder leaves plain data usable).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One endpoint's live state.
pub struct EpRuntime {
    /// Health-check verdict; starts healthy so a rule routes before the first check.
    pub healthy: AtomicBool,
    /// Routing decisions not yet covered by a metrics scrape.
    decisions: Mutex<VecDeque<Instant>>,
    /// Last scrape: (when, running + waiting).
    scraped: Mutex<Option<(Instant, u64)>>,
    /// Per rank: subscriber/poller connected.
    pub connected: Vec<AtomicBool>,
    /// Parity report of the latest mismatch (any rank).
    pub parity: Mutex<Option<ParityReport>>,
    /// Cache capacity in blocks scraped from the engine (`num_gpu_blocks`); 0 = not scraped.
    pub capacity: AtomicU64,
    /// Per rank: the last publisher sequence applied ([`NO_SEQ`] = none), from ingestion or the
    /// replication log; a replica taking the endpoint over resumes from it.
    pub seqs: Vec<AtomicU64>,
    /// This replica ingests the endpoint's events (always, standalone; the lease holder, replicated).
    pub owned: AtomicBool,
    /// Replicated: the endpoint's snapshot must be rewritten (takeover, writes lost to an outage).
    pub dirty: AtomicBool,
    /// Replicated: when this replica last wrote the endpoint's snapshot.
    pub snapshot_at: Mutex<Option<Instant>>,
}

/// "No sequence seen" in [`EpRuntime::seqs`].
pub const NO_SEQ: u64 = u64::MAX;

impl EpRuntime {
    fn new(ranks: usize) -> EpRuntime {
        EpRuntime {
            healthy: AtomicBool::new(true),
            decisions: Mutex::new(VecDeque::new()),
            scraped: Mutex::new(None),
            connected: (0..ranks.max(1)).map(|_| AtomicBool::new(false)).collect(),
            parity: Mutex::new(None),
            capacity: AtomicU64::new(0),
            seqs: (0..ranks.max(1)).map(|_| AtomicU64::new(NO_SEQ)).collect(),
            owned: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            snapshot_at: Mutex::new(None),
        }
    }

    /// Records the sequence of the message about to be applied for `rank`.
    pub fn note_seq(&self, rank: u8, seq: u64) {
        if let Some(s) = self.seqs.get(rank as usize) {
            s.store(seq, Ordering::Relaxed);
        }
    }

    /// The last sequence applied for `rank`, if any.
    pub fn last_seq(&self, rank: u8) -> Option<u64> {
        self.seqs
            .get(rank as usize)
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|s| *s != NO_SEQ)
    }

    /// Records a routing decision to this endpoint.
    pub fn record_decision(&self, now: Instant) {
        let mut d = lock(&self.decisions);
        d.push_back(now);
        // Bounded: past this the estimate is "very loaded" either way.
        if d.len() > 100_000 {
            d.pop_front();
        }
    }

    /// Records a metrics scrape (running + waiting requests).
    pub fn record_scrape(&self, now: Instant, load: u64) {
        *lock(&self.scraped) = Some((now, load));
    }

    /// In-flight estimate: the last scrape plus decisions since, or decisions within `window`.
    pub fn load(&self, now: Instant, window: Duration, scrape_fresh: Duration) -> u64 {
        let scraped = *lock(&self.scraped);
        let mut d = lock(&self.decisions);
        while d
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > window)
        {
            d.pop_front();
        }
        match scraped {
            Some((t, v)) if now.saturating_duration_since(t) <= scrape_fresh => {
                v + d.iter().filter(|x| **x > t).count() as u64
            }
            _ => d.len() as u64,
        }
    }
}

/// A rule and everything live about it.
pub struct RuleRuntime {
    pub id: u32,
    pub spec: RuleSpec,
    pub index: Arc<dyn BlockIndex>,
    pub eps: Vec<EpRuntime>,
    pub ring: HashRing,
    /// Where each prefix family was sent, remembered past eviction.
    pub memory: PlacementMemory,
    pub created: Instant,
    /// Hash of the rule's canonical JSON: replicas agree on it, and a changed rule gets new
    /// replication keys (its old inventory does not apply to the new endpoint list).
    pub generation: u64,
    pub hit_seq: AtomicU64,
    pub rr_seq: AtomicU64,
    pub cancel: CancellationToken,
    /// Why the rule's tokenizer cannot be served (reported in /healthz), if so.
    pub tokenizer_problem: Option<String>,
}

impl RuleRuntime {
    /// Endpoint `i`'s KV cache capacity in blocks as placement sees it: the rule's
    /// `kvCapacityBlocks`, else the engine's scraped `num_gpu_blocks`, else `default`
    /// (`KVROUTE_PLACEMENT_CAPACITY_BLOCKS`); 0 = unknown.
    pub fn capacity(&self, i: usize, default: u64) -> u64 {
        if let Some(c) = self.spec.endpoints.get(i).and_then(|e| e.capacity_blocks) {
            return u64::from(c);
        }
        match self.eps.get(i).map(|e| e.capacity.load(Ordering::Relaxed)) {
            Some(0) | None => default,
            Some(c) => c,
        }
    }

    /// Refreshes the per-endpoint placement gauges (capacity and homed blocks).
    pub fn publish_placement_gauges(&self, m: &Metrics, default_capacity: u64) {
        let name = self.spec.name();
        for i in 0..self.eps.len() {
            let ep = i.to_string();
            m.endpoint_capacity_blocks
                .with_label_values(&[&name, &ep])
                .set(i64::try_from(self.capacity(i, default_capacity)).unwrap_or(i64::MAX));
            m.endpoint_homed_blocks
                .with_label_values(&[&name, &ep])
                .set(i64::try_from(self.memory.homed(i)).unwrap_or(i64::MAX));
        }
    }

    /// Refreshes the per-endpoint block gauges.
    pub fn publish_gauges(&self, m: &Metrics) {
        let name = self.spec.name();
        for i in 0..self.eps.len() {
            let n = self.index.block_count(EndpointId(i as u8));
            m.inventory_blocks
                .with_label_values(&[&name, &i.to_string()])
                .set(n as i64);
        }
    }
}

/// Process-wide state shared by every handler and task.
pub struct AppState {
    pub rules: RwLock<BTreeMap<u32, Arc<RuleRuntime>>>,
    next_id: AtomicU32,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    pub cancel: CancellationToken,
    pub tokenizer_dir: Option<PathBuf>,
    /// Bearer token for management writes; `None` disables writes.
    pub auth_token: Option<String>,
    /// Bearer token `POST /v1/route` requires (`--route-token-file`); `None` leaves it open.
    pub route_token: Option<String>,
    pub http: reqwest::Client,
    pub ready: AtomicBool,
    /// Tokenizers loaded for offloaded tokenization.
    pub tokenizers: crate::api::offload::TokenizerCache,
    /// Shared state across replicas, when `KVROUTE_REDIS_URL` is set (set once at start).
    pub replica: std::sync::OnceLock<Arc<crate::replica::Replica>>,
}

impl AppState {
    /// Empty state.
    pub fn new(
        metrics: Arc<Metrics>,
        settings: Settings,
        cancel: CancellationToken,
        tokenizer_dir: Option<PathBuf>,
        auth_token: Option<String>,
    ) -> AppState {
        AppState {
            rules: RwLock::new(BTreeMap::new()),
            next_id: AtomicU32::new(1),
            metrics,
            settings,
            cancel,
            tokenizer_dir,
            auth_token,
            route_token: None,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            ready: AtomicBool::new(false),
            tokenizers: Default::default(),
            replica: std::sync::OnceLock::new(),
        }
    }

    /// A snapshot of the rules.
    pub fn rules(&self) -> Vec<Arc<RuleRuntime>> {
        self.rules
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Finds a rule by id or by `VIP:port`.
    pub fn find(&self, id_or_name: &str) -> Option<Arc<RuleRuntime>> {
        let rules = self.rules.read().unwrap_or_else(|e| e.into_inner());
        if let Ok(id) = id_or_name.parse::<u32>() {
            if let Some(r) = rules.get(&id) {
                return Some(r.clone());
            }
        }
        rules
            .values()
            .find(|r| r.spec.name() == id_or_name || r.spec.vip_port() == id_or_name)
            .cloned()
    }

    /// Builds a rule's runtime (not yet started) and stores it. A rule with the same id is
    /// replaced (its tasks stop; the new runtime starts with an empty inventory) when kvroute-core
    /// accepts the update; the numeric id is kept. Returns the new runtime and the one it replaced.
    pub fn insert(
        &self,
        spec: RuleSpec,
    ) -> Result<(Arc<RuleRuntime>, Option<Arc<RuleRuntime>>), kvroute_core::rule::RuleErrors> {
        let mut rules = self.rules.write().unwrap_or_else(|e| e.into_inner());
        let old = rules
            .values()
            .find(|r| r.spec.name() == spec.name())
            .cloned();
        if let Some(old) = &old {
            spec.rule.check_update(&old.spec.rule)?;
            old.cancel.cancel();
        }
        let id = old
            .as_ref()
            .map_or_else(|| self.next_id.fetch_add(1, Ordering::Relaxed), |o| o.id);
        let addrs: Vec<String> = spec.endpoints.iter().map(|e| e.addr()).collect();
        let tokenizer_problem = self.tokenizer_problem(&spec);
        let eps: Vec<EpRuntime> = spec
            .endpoints
            .iter()
            .map(|_| EpRuntime::new(spec.dp_ranks as usize))
            .collect();
        let index = match old.as_ref().filter(|o| same_keys(&o.spec, &spec)) {
            Some(o) => keep_inventory(o, &spec, &eps),
            None => Arc::new(MemIndex::new()) as Arc<dyn BlockIndex>,
        };
        let rt = Arc::new(RuleRuntime {
            id,
            eps,
            index,
            ring: HashRing::new(&addrs),
            memory: PlacementMemory::new(self.settings.memory_entries, self.settings.memory_ttl),
            created: Instant::now(),
            generation: spec.generation(),
            hit_seq: AtomicU64::new(0),
            rr_seq: AtomicU64::new(0),
            cancel: self.cancel.child_token(),
            tokenizer_problem,
            spec,
        });
        rules.insert(id, rt.clone());
        Ok((rt, old))
    }

    /// The installed rule named like `spec` when it is identical to it (re-posting a rule is a
    /// no-op: GitOps reconcilers do it on every pass).
    pub fn unchanged(&self, spec: &RuleSpec) -> Option<Arc<RuleRuntime>> {
        let name = spec.name();
        let generation = spec.generation();
        self.rules
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .find(|r| r.spec.name() == name && r.generation == generation)
            .cloned()
    }

    /// Removes a rule by id (`VIP:port/protocol`) and stops its tasks.
    pub fn remove(&self, name: &str) -> Option<Arc<RuleRuntime>> {
        let mut rules = self.rules.write().unwrap_or_else(|e| e.into_inner());
        let id = rules
            .values()
            .find(|r| r.spec.name() == name)
            .map(|r| r.id)?;
        let rt = rules.remove(&id)?;
        rt.cancel.cancel();
        Some(rt)
    }

    fn tokenizer_problem(&self, spec: &RuleSpec) -> Option<String> {
        let model = spec.model.as_ref()?;
        let slug = spec.slug.as_ref()?;
        let Some(dir) = self.tokenizer_dir.as_ref() else {
            return Some(format!(
                "tokenizer for model {model:?} cannot be served: no --tokenizer-dir"
            ));
        };
        let p = dir.join("tokenizers").join(slug).join("tokenizer.json");
        if p.is_file() {
            None
        } else {
            Some(format!(
                "tokenizer for model {model:?} not staged: expected {}",
                p.display()
            ))
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

/// Carries the old rule's index over to its replacement: endpoints at the same position with the
/// same address keep their blocks, sequence positions, health and capacity (their new subscribers
/// resume like after a reconnect: a gap replays or clears, a restart clears); any other position
/// is cleared.
fn keep_inventory(old: &RuleRuntime, new: &RuleSpec, eps: &[EpRuntime]) -> Arc<dyn BlockIndex> {
    use crate::index::{EndpointId, IndexOp, Rank};
    let index = old.index.clone();
    let n = old.spec.endpoints.len().max(new.endpoints.len());
    for i in 0..n {
        let same = match (old.spec.endpoints.get(i), new.endpoints.get(i)) {
            (Some(a), Some(b)) => a.addr() == b.addr(),
            _ => false,
        };
        if let (true, Some(o), Some(e)) = (same, old.eps.get(i), eps.get(i)) {
            for (src, dst) in o.seqs.iter().zip(&e.seqs) {
                dst.store(src.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            e.healthy
                .store(o.healthy.load(Ordering::Relaxed), Ordering::Relaxed);
            e.capacity
                .store(o.capacity.load(Ordering::Relaxed), Ordering::Relaxed);
        } else {
            for r in 0..old.spec.dp_ranks.max(1) {
                index.apply(EndpointId(i as u8), Rank(r), &[IndexOp::Clear]);
            }
        }
    }
    index
}
