//! The single writer of this replica: log entries, rule changes and the snapshots of the
//! endpoints it owns, in the order they were applied locally.
//!
//! Ordering is what makes snapshots exact: a snapshot is taken here, between two writes, so the
//! log position it records covers everything this replica appended for the endpoint, and what it
//! applied since is still queued and lands after the marker.
//!
//! While Redis is unreachable, entries are dropped (the endpoint is marked dirty) instead of
//! piling up; once a PING answers again every owned endpoint's snapshot is rewritten and the
//! rules re-stored (an empty, restarted Redis is rebuilt from the replicas' memory).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::codec::{encode_batch, Entry, RankSnap, Snapshot, StreamId};
use super::conn::{Backend, Conn};
use super::{now_ms, Out, Replica};
use crate::fleet::{Fleet, RuleRuntime};
use crate::index::EndpointId;
use crate::metrics::{RedisOp, ReplEntry, Resync};

/// Entries written per pipeline round trip.
const BATCH: usize = 512;

/// How long a small batch waits for company before it is written.
const COALESCE: Duration = Duration::from_millis(1);

struct Writer {
    rep: Arc<Replica>,
    state: Arc<Fleet>,
    conn: Conn,
    /// (log key, ep) -> id of the last entry this replica appended for the endpoint.
    appended: HashMap<(String, u16), StreamId>,
    /// Log key -> id of the last entry this replica appended to it (checked every tick).
    last: HashMap<String, StreamId>,
    down_since: Option<Instant>,
}

/// One pipeline per slot group, in the order the groups first appear in a batch.
#[derive(Default)]
struct Groups(Vec<Group>);

struct Group {
    tag: String,
    pipe: redis::Pipeline,
    /// Per XADD of the pipeline: its log key ("" for the rule log) and the endpoints with
    /// inventory entries in it.
    replies: Vec<(String, Vec<u16>)>,
    /// Queued items it carries (for the sent/dropped counters).
    outs: u64,
}

impl Groups {
    /// The group `key` belongs to.
    fn of(&mut self, backend: &Backend, key: &str) -> &mut Group {
        let tag = backend.group(key);
        let at = match self.0.iter().position(|g| g.tag == tag) {
            Some(i) => i,
            None => {
                self.0.push(Group {
                    tag: tag.to_owned(),
                    pipe: redis::pipe(),
                    replies: Vec::new(),
                    outs: 0,
                });
                self.0.len() - 1
            }
        };
        &mut self.0[at]
    }
}

/// Sends every group's pipeline at once (each to its slot's primary); one result per group.
async fn query_all<T: redis::FromRedisValue>(
    conn: &Conn,
    groups: &[Group],
) -> Vec<redis::RedisResult<T>> {
    futures::future::join_all(groups.iter().map(|g| {
        let mut c = conn.clone();
        async move { g.pipe.query_async::<T>(&mut c).await }
    }))
    .await
}

pub(super) async fn run(rep: Arc<Replica>, state: Arc<Fleet>, mut rx: mpsc::Receiver<Out>) {
    let mut w = Writer {
        conn: rep.conn.clone(),
        rep,
        state,
        appended: HashMap::new(),
        last: HashMap::new(),
        down_since: None,
    };
    w.state.metrics.redis_connected.set(1);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let cancel = w.state.cancel.clone();
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            n = rx.recv_many(&mut batch, BATCH) => {
                if n == 0 {
                    break;
                }
                if batch.len() < BATCH / 4 {
                    // Let a burst of decisions gather: one XADD (and one read on every other
                    // replica) per millisecond instead of one per request, for 1 ms of lag.
                    tokio::time::sleep(COALESCE).await;
                    while batch.len() < BATCH {
                        match rx.try_recv() {
                            Ok(o) => batch.push(o),
                            Err(_) => break,
                        }
                    }
                }
                w.write(std::mem::take(&mut batch)).await;
            }
            _ = tick.tick() => w.tick().await,
        }
    }
    // Draining: write what is queued (bounded), so a graceful stop loses nothing.
    let end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < end && w.down_since.is_none() {
        let mut rest = Vec::new();
        if rx.try_recv().map(|o| rest.push(o)).is_err() {
            break;
        }
        while rest.len() < BATCH {
            match rx.try_recv() {
                Ok(o) => rest.push(o),
                Err(_) => break,
            }
        }
        w.write(rest).await;
    }
}

impl Writer {
    fn maxlen(&self) -> u64 {
        self.rep.cfg.stream_maxlen
    }

    /// Appends a batch in one pipeline per slot group (one on a single server); on failure marks
    /// the endpoints dirty and goes down.
    async fn write(&mut self, batch: Vec<Out>) {
        let m = &self.state.metrics;
        let n = batch.len() as u64;
        // Endpoints whose inventory changes are in the batch: dirty if it cannot be written.
        let touched: Vec<(Arc<RuleRuntime>, u16)> = batch
            .iter()
            .filter_map(|o| match o {
                Out::Entry {
                    rule,
                    entry: Entry::Ops { ep, .. },
                } => Some((rule.clone(), *ep)),
                _ => None,
            })
            .collect();
        if self.down_since.is_some() {
            m.repl_entry(ReplEntry::Dropped).inc_by(n);
            mark_dirty(&touched);
            return;
        }
        let rules_log = self.rep.rules_log_key();
        let rules_set = self.rep.rules_set_key();
        let mut groups = Groups::default();
        let mut outs = batch.into_iter().peekable();
        while let Some(o) = outs.next() {
            match o {
                Out::Entry { rule, entry } => {
                    // Consecutive entries of one rule go out as one log entry (one XADD, one
                    // read and parse per replica instead of one per decision).
                    let mut group = vec![entry];
                    while matches!(outs.peek(), Some(Out::Entry { rule: r, .. }) if Arc::ptr_eq(r, &rule))
                    {
                        if let Some(Out::Entry { entry, .. }) = outs.next() {
                            group.push(entry);
                        }
                    }
                    let key = self.rep.log_key(&rule);
                    let g = groups.of(&self.rep.backend, &key);
                    g.outs += group.len() as u64;
                    xadd(&mut g.pipe, &key, self.maxlen())
                        .arg("o")
                        .arg(&self.rep.origin)
                        .arg("d")
                        .arg(encode_batch(&group));
                    let mut eps: Vec<u16> = group
                        .iter()
                        .filter(|e| matches!(e, Entry::Ops { .. } | Entry::Snapshot { .. }))
                        .map(Entry::ep)
                        .collect();
                    eps.sort_unstable();
                    eps.dedup();
                    g.replies.push((key, eps));
                }
                Out::RulePut { name, raw, garbage } => {
                    self.drop_keys(&mut groups, &garbage);
                    let g = groups.of(&self.rep.backend, &rules_set);
                    g.outs += 1;
                    g.pipe
                        .cmd("HSET")
                        .arg(&rules_set)
                        .arg(&name)
                        .arg(&raw)
                        .ignore();
                    self.rule_entry(&mut g.pipe, &rules_log, "put", &name, Some(&raw));
                    g.replies.push((String::new(), Vec::new()));
                }
                Out::RuleDel { name, garbage } => {
                    self.drop_keys(&mut groups, &garbage);
                    let g = groups.of(&self.rep.backend, &rules_set);
                    g.outs += 1;
                    g.pipe.cmd("HDEL").arg(&rules_set).arg(&name).ignore();
                    self.rule_entry(&mut g.pipe, &rules_log, "del", &name, None);
                    g.replies.push((String::new(), Vec::new()));
                }
            }
        }
        let results = query_all::<Vec<String>>(&self.conn, &groups.0).await;
        let mut failed = None;
        let (mut sent, mut dropped) = (0, 0);
        for (g, res) in groups.0.into_iter().zip(results) {
            match res {
                Ok(ids) => {
                    for ((key, eps), id) in g.replies.into_iter().zip(ids) {
                        let Some(id) = StreamId::parse(&id) else {
                            continue;
                        };
                        if !key.is_empty() {
                            self.last.insert(key.clone(), id);
                        }
                        for ep in eps {
                            self.appended.insert((key.clone(), ep), id);
                        }
                    }
                    sent += g.outs;
                }
                Err(e) => {
                    dropped += g.outs;
                    failed = Some(e);
                }
            }
        }
        m.repl_entry(ReplEntry::Sent).inc_by(sent);
        if let Some(e) = failed {
            m.redis_error(RedisOp::Write).inc();
            m.repl_entry(ReplEntry::Dropped).inc_by(dropped);
            // Which group failed does not matter: the snapshots rewritten on recovery carry
            // every owned endpoint's complete state.
            mark_dirty(&touched);
            self.went_down(&e);
        }
    }

    /// `DEL` of a replaced or deleted generation's keys, in their own group.
    fn drop_keys(&self, groups: &mut Groups, garbage: &[String]) {
        for k in garbage {
            groups
                .of(&self.rep.backend, k)
                .pipe
                .cmd("DEL")
                .arg(k)
                .ignore();
        }
    }

    /// Appends a rule change to the rule log.
    fn rule_entry(
        &self,
        pipe: &mut redis::Pipeline,
        log: &str,
        op: &str,
        name: &str,
        rule: Option<&str>,
    ) {
        xadd(pipe, log, 10_000)
            .arg("o")
            .arg(&self.rep.origin)
            .arg("op")
            .arg(op)
            .arg("name")
            .arg(name);
        if let Some(r) = rule {
            pipe.arg("rule").arg(r);
        }
    }

    fn went_down(&mut self, e: &redis::RedisError) {
        if self.down_since.is_none() {
            tracing::warn!(replica = %self.rep.id, "Redis unavailable: serving from memory, owners keep ingesting; will resynchronise ({e})");
            self.down_since = Some(Instant::now());
            self.state.metrics.redis_connected.set(0);
        }
    }

    async fn tick(&mut self) {
        if let Some(since) = self.down_since {
            if !self.probe().await {
                self.state.metrics.redis_error(RedisOp::Ping).inc();
                return;
            }
            let gap = since.elapsed();
            self.down_since = None;
            let m = &self.state.metrics;
            m.redis_connected.set(1);
            m.resync(Resync::WriterReconnect).inc();
            m.repl_last_gap_seconds.set(gap.as_secs_f64());
            tracing::info!(replica = %self.rep.id, gap_ms = gap.as_millis() as u64, "Redis back: rewriting owned snapshots and rules");
            self.restore_rules().await;
            for rule in self.state.rules() {
                for e in rule.eps() {
                    if e.owned() {
                        e.mark_dirty();
                    }
                }
            }
        } else {
            self.verify().await;
        }
        self.snapshots().await;
    }

    /// Whether Redis answers again: `PING` on a single server; in a cluster, a keyed command
    /// in every slot this replica writes (a primary that failed over answers only once the
    /// client follows the new slot map).
    async fn probe(&mut self) -> bool {
        if matches!(self.rep.backend, Backend::Single(_)) {
            let pong: Result<String, _> = redis::cmd("PING").query_async(&mut self.conn).await;
            return pong.is_ok();
        }
        let mut groups = Groups::default();
        let mut keys = vec![self.rep.rules_set_key()];
        keys.extend(self.state.rules().iter().map(|r| self.rep.log_key(r)));
        for k in &keys {
            groups.of(&self.rep.backend, k).pipe.cmd("EXISTS").arg(k);
        }
        query_all::<Vec<i64>>(&self.conn, &groups.0)
            .await
            .iter()
            .all(Result::is_ok)
    }

    /// Checks that the last entry this replica appended to each rule log is still there. A
    /// failover to a replica that had not received it yet (Redis replication is asynchronous),
    /// or a restart that went unnoticed, loses acknowledged entries: the owned endpoints of that
    /// log are then snapshotted again, and the marker makes the other replicas reload them. A
    /// log of at least `KVROUTE_STREAM_MAXLEN` entries may have trimmed it instead: not a loss.
    async fn verify(&mut self) {
        let rules = self.state.rules();
        let logs: HashMap<String, Arc<RuleRuntime>> = rules
            .iter()
            .map(|r| (self.rep.log_key(r), r.clone()))
            .collect();
        self.last.retain(|k, _| logs.contains_key(k));
        if self.last.is_empty() {
            return;
        }
        let maxlen = self.maxlen();
        let checks = futures::future::join_all(self.last.iter().map(|(key, id)| {
            let mut c = self.conn.clone();
            async move { (key.clone(), *id, lost(&mut c, key, *id, maxlen).await) }
        }))
        .await;
        let m = &self.state.metrics;
        for (key, id, res) in checks {
            match res {
                Err(e) => {
                    m.redis_error(RedisOp::Verify).inc();
                    self.went_down(&e);
                    return;
                }
                Ok(false) => continue,
                Ok(true) => {}
            }
            self.last.remove(&key);
            let Some(rule) = logs.get(&key) else { continue };
            m.resync(Resync::LostWrites).inc();
            tracing::warn!(replica = %self.rep.id, rule = %rule.spec.name(), entry = %id, "acknowledged replication entries are gone (failover or restart): rewriting owned snapshots");
            for e in rule.eps() {
                if e.owned() {
                    e.mark_dirty();
                }
            }
        }
    }

    /// Re-stores every rule this replica holds (HSETNX: a newer version stored meanwhile wins).
    async fn restore_rules(&mut self) {
        let set = self.rep.rules_set_key();
        let mut pipe = redis::pipe();
        for r in self.state.rules() {
            pipe.cmd("HSETNX")
                .arg(&set)
                .arg(r.spec.name())
                .arg(r.spec.raw_json().to_string())
                .ignore();
        }
        if let Err(e) = pipe.query_async::<()>(&mut self.conn).await {
            self.state.metrics.redis_error(RedisOp::Write).inc();
            self.went_down(&e);
        }
    }

    /// Writes the snapshots that are due: dirty, or older than the interval.
    async fn snapshots(&mut self) {
        let interval = self.rep.cfg.snapshot_interval;
        for rule in self.state.rules() {
            if !rule.spec.kv_enabled() {
                continue;
            }
            for ep in rule.kv_endpoints() {
                let Some(e) = rule.ep(ep) else { continue };
                if !e.owned() {
                    continue;
                }
                let due = e.is_dirty() || e.snapshot_at().is_none_or(|t| t.elapsed() >= interval);
                if due && self.down_since.is_none() {
                    self.snapshot(&rule, ep).await;
                }
                if let Some(t) = e.snapshot_at() {
                    self.state
                        .metrics
                        .snapshot_age
                        .with_label_values(&[&rule.spec.name(), &ep.0.to_string()])
                        .set(t.elapsed().as_secs_f64());
                }
            }
        }
    }

    /// Writes endpoint `ep`'s snapshot and its marker atomically.
    async fn snapshot(&mut self, rule: &Arc<RuleRuntime>, ep: EndpointId) {
        let Some(e) = rule.ep(ep) else { return };
        // Clear before exporting: a change racing with the export marks it dirty again.
        let resync = e.take_dirty();
        let log = self.rep.log_key(rule);
        let mine = self.appended.get(&(log.clone(), ep.0)).copied();
        let tailed = self.rep.tailed_to(&log);
        let upto = mine.max(tailed).unwrap_or_default();
        let mut ranks: Vec<RankSnap> = rule
            .export(ep)
            .into_iter()
            .map(|(r, keys)| RankSnap {
                rank: r.0,
                seq: e.last_seq(r),
                keys,
            })
            .collect();
        for rank in rule.ranks() {
            if !ranks.iter().any(|r| r.rank == rank.0) {
                ranks.push(RankSnap {
                    rank: rank.0,
                    seq: e.last_seq(rank),
                    keys: Vec::new(),
                });
            }
        }
        let snap = Snapshot {
            upto: upto.to_string(),
            taken_ms: now_ms(),
            ranks,
        };
        let bytes = snap.encode();
        let size = bytes.len();
        let maxlen = self.maxlen();
        let written = write_snapshot(
            &mut self.conn,
            &self.rep.snap_key(rule, usize::from(ep.0)),
            &log,
            &bytes,
            maxlen,
            &self.rep.origin,
            &Entry::Snapshot { ep: ep.0, resync }.encode(),
        )
        .await;
        let m = &self.state.metrics;
        match written {
            Ok(id) => {
                if let Some(id) = StreamId::parse(&id) {
                    self.last.insert(log.clone(), id);
                    self.appended.insert((log, ep.0), id);
                }
                e.snapshot_written(Instant::now());
                let labels = [rule.spec.name(), ep.0.to_string()];
                m.snapshot_bytes
                    .with_label_values(&[&labels[0], &labels[1]])
                    .set(size as i64);
                m.snapshots_written.inc();
            }
            Err(err) => {
                e.mark_dirty();
                m.redis_error(RedisOp::Snapshot).inc();
                self.went_down(&err);
            }
        }
    }
}

/// KEYS[1] an endpoint's snapshot, KEYS[2] its rule's log; ARGV[1] the snapshot, ARGV[2] the
/// log's MAXLEN, ARGV[3] this replica's origin, ARGV[4] the marker entry: stores the snapshot
/// and appends its marker at once, and returns the marker's id.
const SNAPSHOT: &str = r"
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'o', ARGV[3], 'd', ARGV[4])
";

/// Writes a snapshot and its log marker atomically; the marker's stream id.
///
/// One script call rather than a `MULTI`: a cluster client follows a `MOVED` or `ASK` reply to
/// a single command (and reloads its slot map), while inside a transaction the redirected
/// commands are refused, `EXEC` fails and the client keeps the stale map.
async fn write_snapshot(
    conn: &mut Conn,
    snap_key: &str,
    log_key: &str,
    snapshot: &[u8],
    maxlen: u64,
    origin: &str,
    marker: &[u8],
) -> redis::RedisResult<String> {
    static SCRIPT: std::sync::LazyLock<redis::Script> =
        std::sync::LazyLock::new(|| redis::Script::new(SNAPSHOT));
    SCRIPT
        .key(snap_key)
        .key(log_key)
        .arg(snapshot)
        .arg(maxlen)
        .arg(origin)
        .arg(marker)
        .invoke_async(conn)
        .await
}

/// `XADD key MAXLEN ~ n *` (fields follow).
fn xadd<'a>(pipe: &'a mut redis::Pipeline, key: &str, maxlen: u64) -> &'a mut redis::Pipeline {
    pipe.cmd("XADD")
        .arg(key)
        .arg("MAXLEN")
        .arg("~")
        .arg(maxlen)
        .arg("*")
}

/// Whether entry `id` is gone from log `key` (a log of `maxlen` entries or more may have trimmed
/// it: not a loss). Single commands, not a pipeline: while a slot migrates, the new owner serves
/// only the one command after an `ASKING`, so a pipeline of two for a moved key bounces between
/// the nodes until the client's retries run out; a single command follows `ASK` and `MOVED`.
async fn lost(conn: &mut Conn, key: &str, id: StreamId, maxlen: u64) -> redis::RedisResult<bool> {
    let at = id.to_string();
    let entry: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(key)
        .arg(&at)
        .arg(&at)
        .query_async(conn)
        .await?;
    if !entry.is_empty() {
        return Ok(false);
    }
    let len: u64 = redis::cmd("XLEN").arg(key).query_async(conn).await?;
    Ok(len < maxlen)
}

fn mark_dirty(touched: &[(Arc<RuleRuntime>, u16)]) {
    for (rule, ep) in touched {
        if let Some(e) = rule.ep(EndpointId(*ep)) {
            e.mark_dirty();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kvroute_test_support::redis::RedisCluster;

    /// A 3-primary cluster (one replica each) and a cluster connection to it.
    async fn cluster() -> (RedisCluster, Conn) {
        let cluster = RedisCluster::start(3, 1000).unwrap();
        let urls: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
        let client = redis::cluster::ClusterClient::new(urls).unwrap();
        let conn = Conn::Cluster(client.get_async_connection().await.unwrap());
        (cluster, conn)
    }

    /// After a slot moved to another primary (twice), a client still holding the old slot map
    /// gets `MOVED`: a `MULTI` of the same two commands fails and leaves the map stale, and the
    /// snapshot script, sent next on the same connection, follows the redirect and lands on the
    /// new primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_follows_its_slot_to_a_new_primary() {
        let (cluster, mut conn) = cluster().await;
        let (snap, log) = ("kvroute:{t#1}:snap:0", "kvroute:{t#1}:log");
        let write = async |conn: &mut Conn, n: u8| {
            write_snapshot(conn, snap, log, &[n; 64], 1000, "a", b"marker").await
        };
        let first = write(&mut conn, 1).await.unwrap();
        assert!(StreamId::parse(&first).is_some(), "{first}");

        let masters = cluster.masters();
        let mut owners = vec![cluster.master_of(log).unwrap()];
        for n in 2..=3u8 {
            let to = *masters.iter().find(|m| !owners.contains(m)).unwrap();
            tokio::task::block_in_place(|| cluster.move_slot(log, to)).unwrap();
            owners.push(to);
            let mut multi = redis::pipe();
            multi.atomic().cmd("SET").arg(snap).arg("x").ignore();
            xadd(&mut multi, log, 1000).arg("o").arg("a");
            let refused = multi.query_async::<Vec<String>>(&mut conn).await;
            assert!(refused.is_err(), "a MULTI after the move: {refused:?}");
            let id = write(&mut conn, n).await.unwrap();
            assert!(StreamId::parse(&id).is_some(), "{id}");
            assert_eq!(
                cluster.cli_int(to, &["XLEN", log]),
                Some(i64::from(n)),
                "every marker is in the log on the new primary"
            );
            let stored = cluster.cli_int(to, &["STRLEN", snap]);
            assert_eq!(stored, Some(64), "the snapshot is on the new primary");
        }
    }

    /// While the log's slot migrates (its keys already on the new primary, the old one answering
    /// `ASK`), the check of the last appended entry answers; a pipeline of its two commands
    /// bounces between the two nodes and fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_last_entry_is_checked_while_its_slot_migrates() {
        let (cluster, mut conn) = cluster().await;
        let log = "kvroute:{t#2}:log";
        let mut add = redis::pipe();
        xadd(&mut add, log, 1000).arg("o").arg("a");
        let ids: Vec<String> = add.query_async(&mut conn).await.unwrap();
        let id = StreamId::parse(&ids[0]).unwrap();
        let never = StreamId::parse("1-1").unwrap();

        let from = cluster.master_of(log).unwrap();
        let to = *cluster.masters().iter().find(|&&m| m != from).unwrap();
        let open = tokio::task::block_in_place(|| cluster.begin_move(log, to)).unwrap();
        let mut both = redis::pipe();
        let at = id.to_string();
        both.cmd("XRANGE").arg(log).arg(&at).arg(&at);
        both.cmd("XLEN").arg(log);
        let bounced = both.query_async::<Vec<redis::Value>>(&mut conn).await;
        assert!(
            bounced.is_err(),
            "a pipeline of two while the slot migrates: {bounced:?}"
        );
        assert!(
            !lost(&mut conn, log, id, 1000).await.unwrap(),
            "the appended entry"
        );
        assert!(
            lost(&mut conn, log, never, 1000).await.unwrap(),
            "an entry never appended"
        );
        assert!(
            !lost(&mut conn, log, never, 1).await.unwrap(),
            "a log at its length limit may have trimmed it"
        );

        tokio::task::block_in_place(|| cluster.finish_move(open)).unwrap();
        assert!(
            !lost(&mut conn, log, id, 1000).await.unwrap(),
            "after the move"
        );
        assert_eq!(
            cluster.cli_int(to, &["XLEN", log]),
            Some(1),
            "the log is on the new primary"
        );
    }
}
