//! The fleet: the rule table and each rule's lifecycle, the one layer that changes live state.
//!
//! ```text
//!   api/ (HTTP)   ingest/ (engine feeds)   health.rs (probes, scrapes)   replica/ (Redis)
//!        \              |                         |                        /   ▲
//!         ▼             ▼                         ▼                       ▼    │ Replication
//!   ┌──────────────────────────── fleet ──────────────────────────────────────┴──┐
//!   │ install / replace / remove a rule · apply index operations · route (decide │
//!   │ and commit) · per-endpoint state behind methods                            │
//!   └──────────────┬────────────────────┬───────────────────┬────────────────────┘
//!                  ▼                    ▼                   ▼
//!        index/ (blocks)        score/ (pure policy)   rules.rs, settings.rs, metrics.rs
//! ```
//!
//! Invariants the methods keep:
//! * a rule's name identifies it; replacing it keeps its numeric id, stops the old runtime's
//!   tasks, and keeps the old inventory only when the new rule keys blocks the same way;
//!   re-installing an identical rule changes nothing;
//! * every change of live state another replica must know goes through one [`Replication`]
//!   call made here ([`Standalone`] when there is no Redis), never from a handler;
//! * an endpoint's index holds at most its key cap (stores past it are refused and counted),
//!   and its block gauge follows every applied operation while the rule is installed;
//! * a removed rule's metric series are dropped, and its tasks never bring them back.

mod canary;
mod decide;
mod endpoint;
mod outcomes;
mod replication;
mod rule;
mod shadow;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use kvroute_core::rule::RuleErrors;
use tokio_util::sync::CancellationToken;

use crate::index::{EndpointId, IndexOp, Lower, Rank};
use crate::metrics::Metrics;
use crate::rules::RuleSpec;
use crate::score::{PlacementMemory, SessionTable};
use crate::settings::Settings;

pub use canary::{CanaryVerdict, Leg, Probe, ProbeReport};
pub use decide::{Question, RouteError, Routed, MAX_KEYS};
pub use endpoint::{EpRuntime, ParityReport, ParityStatus};
pub use outcomes::{divergence_cause, ReportApplied, DIVERGED_PERCENT};
pub use replication::{Origin, Replication, Standalone, StartFeeds};
pub use rule::RuleRuntime;

/// Starts a rule's tasks (event feeds, health checks, scrapes) once it is installed.
pub type StartTasks = fn(&Arc<Fleet>, &Arc<RuleRuntime>);

/// The result of installing a rule.
pub struct Installed {
    pub rule: Arc<RuleRuntime>,
    /// The same rule was already installed: nothing was restarted, replaced or shared.
    pub unchanged: bool,
}

/// Process-wide live state: the rules and what every edge shares (settings, metrics, the engine
/// HTTP client, the root cancellation token).
pub struct Fleet {
    rules: RwLock<BTreeMap<u32, Arc<RuleRuntime>>>,
    next_id: AtomicU32,
    pub metrics: Arc<Metrics>,
    pub settings: Settings,
    /// The root token: the service drains when it is cancelled; every rule's token is a child.
    pub cancel: CancellationToken,
    tokenizer_dir: Option<PathBuf>,
    /// The tokenizers loaded from `tokenizer_dir`, shared by every door that tokenizes (route
    /// offload, the endpoint picker, the parity canary).
    pub tokenizers: Arc<crate::offload::TokenizerCache>,
    /// Client for the engines (health probes, scrapes, the TensorRT-LLM drain).
    pub http: reqwest::Client,
    start_tasks: StartTasks,
    /// Set once at start when `KVROUTE_REDIS_URL` is given; [`Standalone`] otherwise.
    replication: OnceLock<Arc<dyn Replication>>,
}

impl Fleet {
    /// An empty fleet; `start_tasks` starts each installed rule's tasks.
    pub fn new(
        metrics: Arc<Metrics>,
        settings: Settings,
        cancel: CancellationToken,
        tokenizer_dir: Option<PathBuf>,
        start_tasks: StartTasks,
    ) -> Fleet {
        Fleet {
            rules: RwLock::new(BTreeMap::new()),
            next_id: AtomicU32::new(1),
            metrics,
            settings,
            cancel,
            tokenizer_dir,
            tokenizers: Arc::default(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            start_tasks,
            replication: OnceLock::new(),
        }
    }

    /// Replicates through `r` from now on. Call before installing any rule; a second call is
    /// refused (returns false).
    pub fn set_replication(&self, r: Arc<dyn Replication>) -> bool {
        self.replication.set(r).is_ok()
    }

    fn replication(&self) -> &dyn Replication {
        match self.replication.get() {
            Some(r) => r.as_ref(),
            None => &Standalone,
        }
    }

    /// This replica's name when replicated (`/healthz`).
    pub fn replica_id(&self) -> Option<&str> {
        self.replication().replica_id()
    }

    /// Where staged tokenizers live (`--tokenizer-dir`).
    pub fn tokenizer_dir(&self) -> Option<&Path> {
        self.tokenizer_dir.as_deref()
    }

    /// A snapshot of the rules.
    pub fn rules(&self) -> Vec<Arc<RuleRuntime>> {
        self.read().values().cloned().collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u32, Arc<RuleRuntime>>> {
        self.rules.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Finds a rule by id, by name (`VIP:port/protocol`) or by `VIP:port`.
    pub fn find(&self, id_or_name: &str) -> Option<Arc<RuleRuntime>> {
        let rules = self.read();
        if let Ok(id) = id_or_name.parse::<u32>() {
            if let Some(r) = rules.get(&id) {
                return Some(r.clone());
            }
        }
        let name = crate::rules::RuleName::new(id_or_name);
        rules.values().find(|r| r.spec.answers_to(&name)).cloned()
    }

    /// Installs a validated rule and starts its tasks. A rule with the same name is replaced
    /// when kvroute-core accepts the update (its tasks stop, its numeric id is kept, its
    /// inventory is kept when the new rule keys blocks the same way); an identical rule is left
    /// as it is. A [`Origin::Local`] change is shared with the other replicas.
    pub fn install(
        self: &Arc<Self>,
        spec: RuleSpec,
        origin: Origin,
    ) -> Result<Installed, RuleErrors> {
        let (rule, replaced) = {
            let mut rules = self.rules.write().unwrap_or_else(|e| e.into_inner());
            let name = spec.name();
            let old = rules.values().find(|r| r.spec.name() == name).cloned();
            if let Some(old) = old.as_ref().filter(|o| o.generation == spec.generation()) {
                return Ok(Installed {
                    rule: old.clone(),
                    unchanged: true,
                });
            }
            if let Some(old) = &old {
                spec.rule.check_update(&old.spec.rule)?;
                old.stop();
            }
            let id = old
                .as_ref()
                .map_or_else(|| self.next_id.fetch_add(1, Ordering::Relaxed), |o| o.id);
            let parts = rule::Parts {
                id,
                memory: PlacementMemory::new(
                    self.settings.memory_entries,
                    self.settings.memory_ttl,
                ),
                sessions: SessionTable::new(self.settings.sessions_max, self.settings.session_ttl),
                cancel: self.cancel.child_token(),
                tokenizer_problem: self.tokenizer_problem(&spec),
            };
            let rt = Arc::new(RuleRuntime::new(spec, parts, old.as_deref()));
            rules.insert(id, rt.clone());
            (rt, old)
        };
        (self.start_tasks)(self, &rule);
        tracing::info!(rule = %rule.spec.name(), id = rule.id, engine = %rule.spec.engine, replaced = replaced.is_some(), "rule installed");
        self.replication()
            .rule_installed(&rule, replaced.as_deref(), origin);
        Ok(Installed {
            rule,
            unchanged: false,
        })
    }

    /// Removes a rule by name (`VIP:port/protocol`), stops its tasks, drops its metric series
    /// and (for a [`Origin::Local`] change) tells the other replicas.
    pub fn uninstall(&self, name: &str, origin: Origin) -> Option<Arc<RuleRuntime>> {
        let rt = {
            let mut rules = self.rules.write().unwrap_or_else(|e| e.into_inner());
            let id = rules
                .values()
                .find(|r| r.spec.name() == name)
                .map(|r| r.id)?;
            rules.remove(&id)?
        };
        rt.stop();
        self.metrics.drop_endpoint_series(
            name,
            rt.eps().len(),
            usize::from(rt.spec.dp_ranks.max(1)),
        );
        self.metrics.drop_shadow_series(name);
        self.replication().rule_removed(&rt, origin);
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

    /// Runs the event feeds of every endpoint of `rule` that publishes KV events (none for
    /// llama.cpp or kvExactMode 0): `start(ep, token)` starts endpoint `ep`'s feeds, stopped by
    /// `token`. Standalone they start at once; replicated, while this replica holds the
    /// endpoint's ownership lease.
    pub fn run_feeds(
        self: &Arc<Self>,
        rule: &Arc<RuleRuntime>,
        start: impl Fn(EndpointId, &CancellationToken) + Clone + Send + Sync + 'static,
    ) {
        if !rule.spec.kv_enabled() {
            return;
        }
        for ep in rule.kv_endpoints() {
            for rank in rule.ranks() {
                self.set_connected(rule, ep, rank, false);
            }
            let start = start.clone();
            self.replication()
                .own(self, rule, ep, Box::new(move |token| start(ep, token)));
        }
        for ep in rule.endpoint_ids() {
            // A replaced rule may have kept its predecessor's inventory.
            self.publish_blocks(rule, ep);
        }
    }

    /// Applies operations this replica ingested to a rule's index (within the endpoint's key
    /// cap), refreshes the endpoint's gauge and replicates them.
    pub fn apply_ops(&self, rule: &Arc<RuleRuntime>, ep: EndpointId, rank: Rank, ops: &[IndexOp]) {
        if ops.is_empty() {
            return;
        }
        self.apply_replicated(rule, ep, rank, ops);
        self.replication().ops(rule, ep, rank, ops);
    }

    /// Applies operations the replication log delivered (already replicated) to a rule's index
    /// and refreshes the endpoint's gauge.
    pub fn apply_replicated(
        &self,
        rule: &RuleRuntime,
        ep: EndpointId,
        rank: Rank,
        ops: &[IndexOp],
    ) {
        if ops.is_empty() {
            return;
        }
        // At the cap, a tier's stores are refused (counted) until evictions or a clear make room,
        // so one endpoint's index is bounded by the cap plus one event whatever a publisher
        // sends. The checks and the counts come from the index under the lock of the apply.
        let cap = self.key_cap(rule, ep);
        let done = rule.index.apply_capped(ep, rank, ops, cap);
        if done.refused > 0 {
            self.metrics
                .key_cap_refusals
                .with_label_values(&[rule.spec.engine.as_str()])
                .inc_by(done.refused);
            tracing::debug!(rule = %rule.spec.name(), ep = ep.0, held = done.gpu, cap, refused = done.refused, "endpoint key cap reached");
        }
        self.set_block_gauges(rule, ep, done.gpu, done.lower);
    }

    /// Sets endpoint `ep`'s block gauges (unless the rule is gone: its series were dropped) from
    /// the index.
    fn publish_blocks(&self, rule: &RuleRuntime, ep: EndpointId) {
        let lower = Lower::ALL.map(|l| Some(rule.index.lower_block_count(l, ep)));
        self.set_block_gauges(rule, ep, rule.index.block_count(ep), lower);
    }

    /// Sets endpoint `ep`'s GPU block gauge to `gpu` and each lower tier's to `lower` where
    /// known. The series are looked up once per endpoint runtime, not per message.
    fn set_block_gauges(
        &self,
        rule: &RuleRuntime,
        ep: EndpointId,
        gpu: u64,
        lower: [Option<u64>; 2],
    ) {
        if rule.is_stopped() {
            return;
        }
        let Some(e) = rule.ep(ep) else { return };
        let gauge = e.blocks_gauge.get_or_init(|| {
            self.metrics
                .inventory_blocks
                .with_label_values(&[&rule.spec.name(), &ep.0.to_string()])
        });
        gauge.set(i64::try_from(gpu).unwrap_or(i64::MAX));
        let gauges = e.lower_gauges.get_or_init(|| {
            Lower::ALL.map(|l| {
                self.metrics.lower_blocks.with_label_values(&[
                    &rule.spec.name(),
                    &ep.0.to_string(),
                    l.as_str(),
                ])
            })
        });
        for (g, n) in gauges.iter().zip(lower) {
            if let Some(n) = n {
                g.set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    /// Blocks endpoint `ep` may hold: `KVROUTE_MAX_KEYS_PER_ENDPOINT`, else 4 x its capacity
    /// (the rule's `kvCapacityBlocks` or the scraped num_gpu_blocks; at least 65536), else
    /// [`crate::settings::DEFAULT_MAX_KEYS_PER_ENDPOINT`].
    pub fn key_cap(&self, rule: &RuleRuntime, ep: EndpointId) -> u64 {
        if self.settings.max_keys_per_endpoint > 0 {
            return self.settings.max_keys_per_endpoint;
        }
        match rule.capacity(usize::from(ep.0), 0) {
            0 => crate::settings::DEFAULT_MAX_KEYS_PER_ENDPOINT,
            c => c.saturating_mul(4).max(65_536),
        }
    }

    /// Sets the connected flag and gauge of one publisher.
    pub fn set_connected(&self, rule: &RuleRuntime, ep: EndpointId, rank: Rank, up: bool) {
        if let Some(e) = rule.ep(ep) {
            e.set_connected(rank, up);
        }
        if rule.is_stopped() {
            // The rule is gone (or replaced): do not bring its series back after they were dropped.
            return;
        }
        self.metrics
            .subscriber_connected
            .with_label_values(&[&rule.spec.name(), &ep.0.to_string(), &rank.0.to_string()])
            .set(i64::from(up));
    }

    /// Sets endpoint `ep`'s health verdict and gauge; returns the previous verdict.
    pub fn set_healthy(&self, rule: &RuleRuntime, ep: EndpointId, up: bool) -> bool {
        let was = rule.ep(ep).map(|e| e.set_healthy(up)).unwrap_or(up);
        if !rule.is_stopped() {
            self.metrics
                .endpoint_healthy
                .with_label_values(&[&rule.spec.name(), &ep.0.to_string()])
                .set(i64::from(up));
        }
        was
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::time::Instant;

    use kvroute_core::hash::BlockKey;
    use serde_json::json;

    use super::*;

    pub(super) fn spec(port: u16, weight: u32, settings: &Settings) -> RuleSpec {
        let raw = json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": port, "protocol": "tcp",
                "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16,
                "kvEngineType": "vllm", "kvZmqPort": 5557},
            "endpoints": [
                {"endpointIP": "127.0.0.2", "targetPort": 8000, "weight": weight},
                {"endpointIP": "127.0.0.3", "targetPort": 8000, "weight": 1},
            ],
        });
        crate::rules::parse_rule(&raw, settings).expect("valid rule")
    }

    pub(super) fn fleet(settings: Settings) -> Arc<Fleet> {
        let m = Arc::new(Metrics::new().unwrap());
        Arc::new(Fleet::new(
            m,
            settings,
            CancellationToken::new(),
            None,
            |_, _| {},
        ))
    }

    pub(super) fn keys(n: u64) -> Vec<BlockKey> {
        (1..=n).map(BlockKey).collect()
    }

    #[test]
    fn install_replace_and_remove_keep_the_rule_table_consistent() {
        let f = fleet(Settings::default());
        let s = Settings::default();
        let a = f.install(spec(80, 1, &s), Origin::Local).unwrap();
        assert!(!a.unchanged);
        assert_eq!(a.rule.id, 1);
        // An identical rule is a no-op: the same runtime, nothing stopped.
        let again = f.install(spec(80, 1, &s), Origin::Local).unwrap();
        assert!(again.unchanged);
        assert!(Arc::ptr_eq(&again.rule, &a.rule));
        assert!(!a.rule.is_stopped());
        // A changed rule keeps the id, stops the old runtime and keeps its inventory (same keys).
        f.apply_ops(&a.rule, EndpointId(0), Rank(0), &[IndexOp::Store(keys(3))]);
        let b = f.install(spec(80, 2, &s), Origin::Local).unwrap();
        assert!(!b.unchanged);
        assert_eq!(b.rule.id, 1);
        assert!(a.rule.is_stopped());
        assert_eq!(b.rule.block_count(EndpointId(0)), 3);
        assert_eq!(f.rules().len(), 1);
        // Another rule gets the next id; both are found by id and by VIP:port.
        let c = f.install(spec(81, 1, &s), Origin::Local).unwrap();
        assert_eq!(c.rule.id, 2);
        let id = |q: &str| f.find(q).map(|r| r.id);
        assert_eq!(id("2"), Some(2));
        assert_eq!(id("10.0.0.1:80"), Some(1));
        assert_eq!(id("10.0.0.1:81"), Some(2));
        assert_eq!(id("10.0.0.1:81/tcp"), Some(2));
        assert_eq!(id("10.0.0.1:82"), None);
        assert_eq!(id("10.0.0.2:81"), None);
        assert_eq!(id("10.0.0.1:81/udp"), None);
        // Removal stops the rule and forgets it.
        let gone = f.uninstall("10.0.0.1:80/tcp", Origin::Local).unwrap();
        assert!(gone.is_stopped());
        assert!(f.uninstall("10.0.0.1:80/tcp", Origin::Local).is_none());
        assert_eq!(f.rules().len(), 1);
    }

    /// A rule update keeps, by address, what each staying endpoint held: its blocks, its
    /// placement-memory homes and its sessions follow it to its new position in the list; a
    /// new endpoint starts empty; a removed one's are dropped.
    #[test]
    fn an_update_keeps_each_staying_endpoints_state_wherever_it_moves() {
        use crate::score::Update;
        let s = Settings::default();
        let f = fleet(s.clone());
        let with = |ips: &[&str]| {
            let eps: Vec<_> = ips
                .iter()
                .map(|ip| json!({"endpointIP": ip, "targetPort": 8000}))
                .collect();
            let raw = json!({
                "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp",
                    "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16,
                    "kvEngineType": "vllm", "kvZmqPort": 5557},
                "endpoints": eps,
            });
            crate::rules::parse_rule(&raw, &s).unwrap()
        };
        let now = Instant::now();
        let a = f
            .install(with(&["10.1.0.2", "10.1.0.3"]), Origin::Local)
            .unwrap()
            .rule;
        f.apply_ops(&a, EndpointId(0), Rank(0), &[IndexOp::Store(keys(2))]);
        f.apply_ops(&a, EndpointId(1), Rank(0), &[IndexOp::Store(keys(5))]);
        let fam = keys(8);
        a.memory.record(&fam, 1, Update::Place, now);
        a.sessions.bind(77, 1, now);
        // A pod sorting first joins: both shift down one place and keep what they held.
        let b = f
            .install(with(&["10.1.0.1", "10.1.0.2", "10.1.0.3"]), Origin::Local)
            .unwrap()
            .rule;
        let counts = |r: &RuleRuntime, n: u16| -> Vec<u64> {
            (0..n).map(|i| r.block_count(EndpointId(i))).collect()
        };
        assert_eq!(counts(&b, 3), vec![0, 2, 5]);
        assert_eq!(b.memory.recall(&fam, now).map(|r| r.ep), Some(2));
        assert_eq!(b.memory.homed_all(3), vec![0, 0, 8]);
        assert_eq!(b.sessions.get(77, now), Some(2));
        // The first two leave: the third moves to the front with its state.
        let c = f.install(with(&["10.1.0.3"]), Origin::Local).unwrap().rule;
        assert_eq!(counts(&c, 3), vec![5, 0, 0]);
        assert_eq!(c.memory.recall(&fam, now).map(|r| r.ep), Some(0));
        assert_eq!(c.sessions.get(77, now), Some(0));
        // It leaves too: nothing of it is kept for the newcomer at its position.
        let d = f.install(with(&["10.1.0.9"]), Origin::Local).unwrap().rule;
        assert_eq!(counts(&d, 3), vec![0, 0, 0]);
        assert_eq!(d.memory.recall(&fam, now), None);
        assert_eq!(d.sessions.get(77, now), None);
    }

    #[test]
    fn stores_past_the_key_cap_are_refused_and_counted() {
        let s = Settings {
            max_keys_per_endpoint: 4,
            ..Settings::default()
        };
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(0), Rank(0), &[IndexOp::Store(keys(4))]);
        assert_eq!(r.block_count(EndpointId(0)), 4);
        // At the cap: a store is refused and counted.
        f.apply_ops(
            &r,
            EndpointId(0),
            Rank(0),
            &[IndexOp::Store(vec![BlockKey(20)])],
        );
        assert_eq!(r.block_count(EndpointId(0)), 4);
        // A removal before a store makes room for it; the one after it is refused.
        let more: Vec<BlockKey> = (10..13).map(BlockKey).collect();
        f.apply_ops(
            &r,
            EndpointId(0),
            Rank(0),
            &[
                IndexOp::Remove(vec![BlockKey(1)]),
                IndexOp::Store(more),
                IndexOp::Store(vec![BlockKey(21)]),
            ],
        );
        assert_eq!(r.block_count(EndpointId(0)), 6);
        assert_eq!(
            f.metrics
                .key_cap_refusals
                .with_label_values(&["vllm"])
                .get(),
            2
        );
        assert_eq!(
            f.metrics
                .inventory_blocks
                .with_label_values(&["10.0.0.1:80/tcp", "0"])
                .get(),
            6
        );
    }

    /// A candidate subset excludes the endpoint holding the prefix: the decision stays inside
    /// it; a subset naming no endpoint has no answer.
    #[test]
    fn a_candidate_subset_bounds_the_choice() {
        let s = Settings::default();
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(1), Rank(0), &[IndexOp::Store(keys(4))]);
        let k = keys(6);
        let q = |only| Question {
            keys: &k,
            token_count: 96,
            affinity_key: None,
            model: None,
            session: None,
            explain: true,
            only,
        };
        let now = Instant::now();
        assert_eq!(f.route(&r, &q(None), now).unwrap().ep, 1);
        assert_eq!(f.route(&r, &q(Some(&[true, false])), now).unwrap().ep, 0);
        assert_eq!(
            f.route(&r, &q(Some(&[false, false])), now).err(),
            Some(RouteError::NoEndpoint)
        );
    }

    /// A named conversation goes where it went before, ahead of a longer match elsewhere; while
    /// that endpoint is down it detours without moving, and comes home once it is back.
    #[test]
    fn a_session_returns_to_its_endpoint_and_comes_home_after_a_detour() {
        use crate::metrics::SessionOutcome;
        use crate::score::Tier;
        let s = Settings::default();
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        fn q<'a>(keys: &'a [BlockKey], session: Option<&'a str>) -> Question<'a> {
            Question {
                keys,
                token_count: 96,
                affinity_key: None,
                model: None,
                session,
                explain: false,
                only: None,
            }
        }
        let (short, long) = (keys(2), keys(6));
        let (short, long) = (short.as_slice(), long.as_slice());
        let now = Instant::now();
        // Its first request is placed (no overlap anywhere); the prefix then shows up on the
        // other endpoint only.
        let first = f.route(&r, &q(short, Some("conv-1")), now).unwrap();
        let home = first.ep;
        let other = 1 - home;
        f.apply_ops(
            &r,
            EndpointId(other as u16),
            Rank(0),
            &[IndexOp::Store(keys(6))],
        );
        let d = f.route(&r, &q(long, Some("conv-1")), now).unwrap();
        assert_eq!(
            (d.ep, d.decision.tier, d.session),
            (home, Tier::Session, Some(home))
        );
        // Ahead of the longer match.
        assert_eq!((d.views[home].matched, d.views[other].matched), (2, 6));
        r.eps()[home].set_healthy(false);
        let d = f.route(&r, &q(long, Some("conv-1")), now).unwrap();
        assert_eq!((d.ep, d.decision.tier), (other, Tier::Tier15));
        r.eps()[home].set_healthy(true);
        let d = f.route(&r, &q(long, Some("conv-1")), now).unwrap();
        assert_eq!((d.ep, d.decision.tier), (home, Tier::Session));
        let count = |o| f.metrics.session(o).get();
        assert_eq!(
            [
                SessionOutcome::New,
                SessionOutcome::Kept,
                SessionOutcome::Detour
            ]
            .map(count),
            [1, 2, 1]
        );
        let gauge = f.metrics.sessions.with_label_values(&[r.spec.name()]).get();
        assert_eq!(gauge, 1);
        assert_eq!(
            f.metrics
                .route_decisions
                .with_label_values(&["session", "session"])
                .get(),
            2
        );
    }

    #[test]
    fn explaining_commits_nothing_and_routing_commits_everything() {
        let s = Settings::default();
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        f.apply_ops(&r, EndpointId(1), Rank(0), &[IndexOp::Store(keys(4))]);
        let k = keys(6);
        let q = |explain| Question {
            keys: &k,
            token_count: 96,
            affinity_key: None,
            model: None,
            session: None,
            explain,
            only: None,
        };
        let now = Instant::now();
        let peek = f.route(&r, &q(true), now).unwrap();
        assert_eq!((peek.ep, peek.decision.matched), (1, 4));
        assert_eq!(r.hit_seq.load(Ordering::Relaxed), 0);
        assert_eq!(r.eps()[1].load(now, s.inflight_window, Duration::ZERO), 0);
        assert_eq!(r.match_prefix(&k, now), vec![0, 4], "no speculative credit");
        assert_eq!(
            f.metrics
                .route_decisions
                .with_label_values(&["tier15", "hit"])
                .get(),
            0
        );
        let real = f.route(&r, &q(false), now).unwrap();
        assert_eq!(
            real.decision, peek.decision,
            "explain answers what a request gets"
        );
        assert_eq!(
            f.metrics
                .route_decisions
                .with_label_values(&["tier15", "hit"])
                .get(),
            1
        );
        assert_eq!(r.eps()[1].load(now, s.inflight_window, Duration::ZERO), 1);
        assert_eq!(
            r.match_prefix(&k, now),
            vec![0, 6],
            "the 2 unheld keys are credited"
        );
        assert!(r.memory.peek(&k, now).is_some(), "the family is remembered");
    }

    #[test]
    fn too_many_keys_and_no_healthy_endpoint_are_refused() {
        let s = Settings::default();
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        let many = vec![BlockKey(1); MAX_KEYS + 1];
        let q = Question {
            keys: &many,
            token_count: 0,
            affinity_key: None,
            model: None,
            session: None,
            explain: false,
            only: None,
        };
        assert_eq!(
            f.route(&r, &q, Instant::now()).err(),
            Some(RouteError::TooManyKeys(MAX_KEYS + 1))
        );
        for ep in r.endpoint_ids() {
            f.set_healthy(&r, ep, false);
        }
        let q = Question { keys: &[], ..q };
        assert_eq!(
            f.route(&r, &q, Instant::now()).err(),
            Some(RouteError::NoEndpoint)
        );
    }

    /// A family whose home fails its health check is served elsewhere without being re-homed,
    /// and goes home once the engine is healthy again (both copies then match: the tie goes home).
    #[test]
    fn a_family_detours_while_its_home_is_down_and_comes_back() {
        let s = Settings {
            spec_ttl: Duration::ZERO,
            ..Settings::default()
        };
        let f = fleet(s.clone());
        let r = f.install(spec(80, 1, &s), Origin::Local).unwrap().rule;
        let k = keys(8);
        let q = Question {
            keys: &k,
            token_count: 128,
            affinity_key: None,
            model: None,
            session: None,
            explain: false,
            only: None,
        };
        let now = Instant::now();
        let home = f.route(&r, &q, now).unwrap().ep;
        let other = 1 - home;
        let id = |i: usize| EndpointId(i as u16);
        f.apply_ops(&r, id(home), Rank(0), &[IndexOp::Store(k.clone())]);

        f.set_healthy(&r, id(home), false);
        let away = f.route(&r, &q, now).unwrap();
        assert_eq!(away.ep, other);
        assert!(away.decision.detour);
        assert_eq!(f.metrics.tier15_detours.get(), 1);
        assert_eq!(
            r.memory.peek(&k, now).map(|m| m.ep),
            Some(home),
            "still homed"
        );
        f.apply_ops(&r, id(other), Rank(0), &[IndexOp::Store(k.clone())]);

        f.set_healthy(&r, id(home), true);
        let back = f.route(&r, &q, now).unwrap();
        assert_eq!(back.ep, home, "{:?}", back.decision);
        assert!(!back.decision.detour);
    }
}
