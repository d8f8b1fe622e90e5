//! Shared state across inventory replicas through Redis (or Valkey): see docs/replication.md.
//!
//! * Ownership ([`lease`]): each endpoint's subscription (ZMQ or the TensorRT-LLM drain) runs on
//!   exactly one replica, the holder of a Redis lease (`SET NX PX`, renewed at a third of its
//!   length). A replica taking an endpoint over resumes the engine's sequence from the replicated
//!   state, so a gap is replayed or cleared like after any reconnect.
//! * Replication log ([`writer`], [`tailer`]): the owner appends what it applied to a Redis Stream
//!   per rule (`MAXLEN ~`, keys hash-tagged by rule generation so a Redis Cluster keeps a rule's
//!   log, snapshots and leases on one slot; [`conn`] makes single-server and cluster connections
//!   and groups keys by slot for every multi-key command);
//!   every replica tails the streams into its in-memory index. Routing decisions (speculative
//!   credit, placement memory, in-flight load) and rule changes travel the same way.
//! * Snapshots: the owner periodically writes each endpoint's inventory with the log position it
//!   includes and appends a marker; a new or resynchronising replica loads snapshots and tails
//!   from there. Every log operation sets or clears keys, so re-applying a suffix of the log on a
//!   snapshot that already contains it is harmless: that is what makes the hand-offs exact.
//! * Redis down: queries are answered from memory, owners keep ingesting; writes are dropped and
//!   the endpoint marked dirty, and on reconnect the owner rewrites its snapshots (the complete
//!   state), so nothing the engines still hold is lost. Tailers resynchronise and report the gap.

pub mod codec;
mod conn;
mod lease;
mod tailer;
mod writer;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvroute_core::hash::BlockKey;
use tokio::sync::mpsc;

use crate::fleet::{Fleet, Origin, Replication, RuleRuntime, StartFeeds};
use crate::index::{EndpointId, IndexOp, Rank};
use crate::metrics::{Metrics, ReplEntry};
use crate::score::Update;
use crate::settings::RedisSettings;
use crate::sync::lock;
use codec::{Entry, StreamId};
use conn::{Backend, Conn};

/// Entries waiting for the writer; past this an endpoint is marked dirty instead (its next
/// snapshot carries the state).
const OUTBOX: usize = 100_000;

/// What the writer sends to Redis.
pub(crate) enum Out {
    /// A log entry of a rule.
    Entry {
        rule: Arc<RuleRuntime>,
        entry: Entry,
    },
    /// A rule was installed through this replica: store it and tell the others.
    RulePut {
        name: String,
        raw: String,
        /// Keys of the rule's previous generation, no longer meaningful.
        garbage: Vec<String>,
    },
    /// A rule was deleted through this replica.
    RuleDel { name: String, garbage: Vec<String> },
}

/// This replica's handle on the shared state.
pub struct Replica {
    pub id: String,
    /// `id#nonce`, unique to this process: lease values and the origin of log entries (a
    /// restarted replica with the same id must not mistake its predecessor's entries for its own).
    pub origin: String,
    pub cfg: RedisSettings,
    /// Single server or cluster (`KVROUTE_REDIS_MODE`): how connections are made and which
    /// keys may share a command.
    backend: Backend,
    /// The writer's and the leases' connection (the tailer has its own).
    conn: Conn,
    tx: mpsc::Sender<Out>,
    /// Rule name -> generation this replica holds (installed locally or from Redis).
    known_rules: Mutex<HashMap<String, u64>>,
    /// Log key -> position the tailer has applied up to.
    tailed: Mutex<HashMap<String, StreamId>>,
    metrics: Arc<Metrics>,
    /// `KVROUTE_SPEC_TTL_MS`: how long a replicated decision's speculative credit lasts.
    spec_ttl: Duration,
    /// This replica's own handle, for the lease tasks it spawns.
    me: Weak<Replica>,
}

impl Replica {
    /// Connects (lazily: a Redis that is down at start is retried) and starts the writer. Call
    /// before installing rules and hand it to [`Fleet::set_replication`], so their endpoints
    /// start under leases; then [`Self::start_tailer`].
    pub fn start(fleet: &Arc<Fleet>, cfg: RedisSettings) -> anyhow::Result<Arc<Replica>> {
        let backend = Backend::open(&cfg)?;
        let conn = backend.connect(Duration::from_secs(2))?;
        let id = cfg.replica_id.clone().unwrap_or_else(default_id);
        let origin = format!("{id}#{:08x}", nonce());
        let (tx, rx) = mpsc::channel(OUTBOX);
        let rep = Arc::new_cyclic(|me| Replica {
            id,
            origin,
            cfg,
            backend,
            conn,
            tx,
            known_rules: Mutex::new(HashMap::new()),
            tailed: Mutex::new(HashMap::new()),
            metrics: fleet.metrics.clone(),
            spec_ttl: fleet.settings.spec_ttl,
            me: me.clone(),
        });
        let urls: Vec<String> = rep.cfg.urls().into_iter().map(redact).collect();
        tracing::info!(replica = %rep.id, urls = %urls.join(","), mode = ?rep.cfg.mode, prefix = %rep.cfg.prefix, "replication through Redis");
        tokio::spawn(writer::run(rep.clone(), fleet.clone(), rx));
        Ok(rep)
    }

    /// Starts tailing the logs. Call after the rules file is installed, so a rule this replica
    /// was configured with is not first installed from Redis and then replaced.
    pub fn start_tailer(self: &Arc<Self>, fleet: &Arc<Fleet>) {
        tokio::spawn(tailer::run(self.clone(), fleet.clone()));
    }

    /// `PREFIX:{RULE#GEN}`: every key of one rule generation shares the hash tag.
    pub fn rule_tag(&self, rule: &RuleRuntime) -> String {
        format!(
            "{}:{{{}#{:016x}}}",
            self.cfg.prefix,
            rule.spec.name(),
            rule.generation
        )
    }

    /// The rule's replication log.
    pub fn log_key(&self, rule: &RuleRuntime) -> String {
        format!("{}:log", self.rule_tag(rule))
    }

    /// Endpoint `ep`'s snapshot.
    pub fn snap_key(&self, rule: &RuleRuntime, ep: usize) -> String {
        format!("{}:snap:{ep}", self.rule_tag(rule))
    }

    /// Endpoint `ep`'s ownership lease.
    pub fn lease_key(&self, rule: &RuleRuntime, ep: usize) -> String {
        format!("{}:lease:{ep}", self.rule_tag(rule))
    }

    /// The log of rule changes.
    pub fn rules_log_key(&self) -> String {
        format!("{}:{{rules}}:log", self.cfg.prefix)
    }

    /// Rule name -> canonical rule JSON, for replicas that start later.
    pub fn rules_set_key(&self) -> String {
        format!("{}:{{rules}}:set", self.cfg.prefix)
    }

    /// Keys of a rule generation (log, snapshots, leases and their epoch and grace markers).
    fn rule_keys(&self, rule: &RuleRuntime) -> Vec<String> {
        let mut v = vec![self.log_key(rule)];
        for ep in 0..rule.eps().len() {
            v.push(self.snap_key(rule, ep));
            let lease = self.lease_key(rule, ep);
            v.push(format!("{lease}:epoch"));
            v.push(format!("{lease}:grace"));
            v.push(lease);
        }
        v
    }

    fn send(&self, rule: Option<(&RuleRuntime, EndpointId)>, out: Out) {
        if self.tx.try_send(out).is_err() {
            self.metrics.repl_entry(ReplEntry::Dropped).inc();
            if let Some(e) = rule.and_then(|(rule, ep)| rule.ep(ep)) {
                e.mark_dirty();
            }
        }
    }

    /// Where the tailer stands in `log_key` (entries up to it are applied here).
    fn tailed_to(&self, log_key: &str) -> Option<StreamId> {
        lock(&self.tailed).get(log_key).copied()
    }
}

impl Replication for Replica {
    /// Stores a rule installed through this replica (API or config file) and tells the others;
    /// the keys of the generation it replaced are dropped.
    fn rule_installed(&self, rule: &RuleRuntime, replaced: Option<&RuleRuntime>, origin: Origin) {
        let name = rule.spec.name();
        lock(&self.known_rules).insert(name.clone(), rule.generation);
        if origin == Origin::Peer {
            return;
        }
        let garbage = replaced
            .filter(|old| old.generation != rule.generation)
            .map(|old| self.rule_keys(old))
            .unwrap_or_default();
        let raw = rule.spec.raw_json().to_string();
        self.send(None, Out::RulePut { name, raw, garbage });
    }

    fn rule_removed(&self, rule: &RuleRuntime, origin: Origin) {
        let name = rule.spec.name();
        lock(&self.known_rules).remove(&name);
        if origin == Origin::Peer {
            return;
        }
        let garbage = self.rule_keys(rule);
        self.send(None, Out::RuleDel { name, garbage });
    }

    fn ops(&self, rule: &Arc<RuleRuntime>, ep: EndpointId, rank: Rank, ops: &[IndexOp]) {
        let seq = rule.ep(ep).and_then(|e| e.last_seq(rank));
        let entry = Entry::Ops {
            ep: ep.0,
            rank: rank.0,
            seq,
            ops: ops.to_vec(),
        };
        self.send(
            Some((rule, ep)),
            Out::Entry {
                rule: rule.clone(),
                entry,
            },
        );
    }

    fn decision(
        &self,
        rule: &Arc<RuleRuntime>,
        ep: EndpointId,
        update: Option<Update>,
        keys: &[BlockKey],
        session: Option<u64>,
    ) {
        let entry = Entry::Decision {
            ep: ep.0,
            update,
            ttl_ms: u32::try_from(self.spec_ttl.as_millis()).unwrap_or(u32::MAX),
            keys: keys.to_vec(),
            session,
        };
        self.send(
            None,
            Out::Entry {
                rule: rule.clone(),
                entry,
            },
        );
    }

    /// Runs the endpoint's ownership loop: its feeds run while this replica holds the lease.
    fn own(&self, fleet: &Arc<Fleet>, rule: &Arc<RuleRuntime>, ep: EndpointId, start: StartFeeds) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(lease::run(me, fleet.clone(), rule.clone(), ep, start));
        }
    }

    fn replica_id(&self) -> Option<&str> {
        Some(&self.id)
    }
}

/// `host-pid`: readable in lease values and logs.
fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}

/// A per-process nonce (clock nanoseconds mixed with the pid).
fn nonce() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16)
}

/// The URL without its password, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// Milliseconds since the Unix epoch (the clock of stream ids).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redact("rediss://h:1"), "rediss://h:1");
    }
}
