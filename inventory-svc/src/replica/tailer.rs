//! Tails every rule's replication log (and the rule log) into this replica's memory.
//!
//! Bootstrapping a rule loads each endpoint's snapshot and tails from the oldest position they
//! include; entries of an endpoint at or before its snapshot's position are skipped. An entry this
//! replica wrote about an endpoint it owns is skipped (it was applied when ingested). A snapshot
//! marker written by another replica reloads that endpoint. A failed read resynchronises every
//! rule (snapshots + tail) once Redis answers again, and the outage is reported as the gap.
//!
//! Reads block on the server (`XREAD BLOCK`). On a single server one read covers every log; in
//! a cluster the logs are read per slot group (each rule generation's hash tag, and the rule
//! log's), concurrently, each on its own connection ([`Reads`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use kvroute_core::hash::BlockKey;
use redis::streams::StreamReadReply;
use redis::Value;

use super::codec::{decode_batch, Entry, Snapshot, StreamId};
use super::conn::Conn;
use super::{lock, now_ms, Replica};
use crate::fleet::{Fleet, Origin, RuleRuntime};
use crate::index::{EndpointId, IndexOp, Rank};
use crate::metrics::{RedisOp, ReplEntry, Resync, SnapshotLoad};

/// Entries read per call and how long one read blocks.
const COUNT: usize = 1000;
const BLOCK_MS: u64 = 500;

struct Tail {
    rule: Arc<RuleRuntime>,
    pos: StreamId,
    /// Per endpoint: entries at or before this are in the loaded snapshot.
    skip: Vec<StreamId>,
}

pub(super) async fn run(rep: Arc<Replica>, state: Arc<Fleet>) {
    // Its own connections: a blocking XREAD would stall the writer's pipeline. `conn` loads
    // snapshots and positions; the reads block on connections of their own.
    let Ok(mut conn) = rep.backend.connect(READ_TIMEOUT) else {
        tracing::error!("replication tailer: cannot create a Redis connection");
        return;
    };
    let cancel = state.cancel.clone();
    let mut tails: HashMap<String, Tail> = HashMap::new();
    let mut reads = Reads::default();
    let mut rules_pos: Option<StreamId> = None;
    let mut outage: Option<Instant> = None;
    let mut backoff = Duration::from_millis(100);
    while !cancel.is_cancelled() {
        let step = async {
            if rules_pos.is_none() {
                rules_pos = Some(bootstrap_rules(&rep, &state, &mut conn).await?);
            }
            sync_tails(&rep, &state, &mut conn, &mut tails).await?;
            reads.issue(&rep, &tails, rules_pos)?;
            let reply = reads.next().await?;
            apply_read(&rep, &state, &mut conn, &mut tails, &mut rules_pos, reply).await
        };
        let res = tokio::select! {
            _ = cancel.cancelled() => break,
            r = step => r,
        };
        match res {
            Ok(()) => {
                backoff = Duration::from_millis(100);
                if let Some(t) = outage.take() {
                    let gap = t.elapsed();
                    let m = &state.metrics;
                    m.resync(Resync::TailerReconnect).inc();
                    m.repl_last_gap_seconds.set(gap.as_secs_f64());
                    tracing::info!(replica = %rep.id, gap_ms = gap.as_millis() as u64, "replication resynchronised (snapshots + tail)");
                }
            }
            Err(e) => {
                state.metrics.redis_error(RedisOp::Read).inc();
                if outage.is_none() {
                    tracing::warn!(replica = %rep.id, "replication log unreadable: serving from memory until Redis answers ({e})");
                    outage = Some(Instant::now());
                }
                // Resynchronise everything once Redis answers: the log may have been lost.
                reads.clear();
                tails.clear();
                rules_pos = None;
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// A blocking read's connection gives up this long after the read would have returned.
const READ_TIMEOUT: Duration = Duration::from_millis(BLOCK_MS + 2000);

/// A finished read: the keys it covered, its connection (back to the pool) and what it returned.
type Done = (
    Vec<String>,
    Conn,
    redis::RedisResult<Option<StreamReadReply>>,
);

/// The blocking reads in flight, one per slot group of logs (one on a single server: every log
/// and the rule log in one `XREAD`; in a cluster an `XREAD` may only name keys of one slot, so
/// each rule's log and the rule log are read apart, concurrently, each on its own connection
/// so that one group's block does not delay another's).
#[derive(Default)]
struct Reads {
    inflight: FuturesUnordered<BoxFuture<'static, Done>>,
    /// Keys some read in flight covers.
    covered: HashSet<String>,
    /// Idle read connections.
    idle: Vec<Conn>,
}

impl Reads {
    /// Starts a read for every group of keys no read in flight covers.
    fn issue(
        &mut self,
        rep: &Replica,
        tails: &HashMap<String, Tail>,
        rules_pos: Option<StreamId>,
    ) -> redis::RedisResult<()> {
        let rules_key = rep.rules_log_key();
        let mut want = vec![(rules_key, rules_pos.unwrap_or_default())];
        want.extend(tails.iter().map(|(k, t)| (k.clone(), t.pos)));
        let mut groups: Vec<(String, Vec<(String, StreamId)>)> = Vec::new();
        for (key, pos) in want {
            if self.covered.contains(&key) {
                continue;
            }
            let tag = rep.backend.group(&key).to_owned();
            match groups.iter_mut().find(|(t, _)| *t == tag) {
                Some((_, g)) => g.push((key, pos)),
                None => groups.push((tag, vec![(key, pos)])),
            }
        }
        for (_, group) in groups {
            let mut c = match self.idle.pop() {
                Some(c) => c,
                None => rep.backend.connect(READ_TIMEOUT).map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "replication tailer connection",
                        e.to_string(),
                    ))
                })?,
            };
            let mut cmd = redis::cmd("XREAD");
            cmd.arg("COUNT")
                .arg(COUNT)
                .arg("BLOCK")
                .arg(BLOCK_MS)
                .arg("STREAMS");
            for (k, _) in &group {
                cmd.arg(k);
            }
            for (_, pos) in &group {
                cmd.arg(pos.to_string());
            }
            let keys: Vec<String> = group.into_iter().map(|(k, _)| k).collect();
            self.covered.extend(keys.iter().cloned());
            self.inflight.push(Box::pin(async move {
                let r = cmd.query_async(&mut c).await;
                (keys, c, r)
            }));
        }
        Ok(())
    }

    /// The next read to finish; its keys are uncovered and its connection idle again.
    async fn next(&mut self) -> redis::RedisResult<Option<StreamReadReply>> {
        let Some((keys, conn, res)) = self.inflight.next().await else {
            return Ok(None);
        };
        for k in &keys {
            self.covered.remove(k);
        }
        self.idle.push(conn);
        res
    }

    /// Forgets every read in flight (their connections close with them).
    fn clear(&mut self) {
        self.inflight.clear();
        self.covered.clear();
    }
}
/// Installs the stored rules this replica does not hold yet; returns where to tail the rule log.
async fn bootstrap_rules(
    rep: &Replica,
    state: &Arc<Fleet>,
    conn: &mut Conn,
) -> redis::RedisResult<StreamId> {
    // Position first, then the set: a change in between is seen twice, which is harmless.
    let pos = last_id(conn, &rep.rules_log_key()).await?;
    let all: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(rep.rules_set_key())
        .query_async(conn)
        .await?;
    for (name, raw) in all {
        if lock(&rep.known_rules).contains_key(&name) {
            // Installed here (config or API): ours is queued for Redis, or already there.
            continue;
        }
        put_rule(rep, state, &name, &raw);
    }
    Ok(pos)
}

/// Applies a rule stored by another replica (unless this replica already holds that generation).
fn put_rule(rep: &Replica, state: &Arc<Fleet>, name: &str, raw: &str) {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(raw) else {
        tracing::warn!(rule = name, "replicated rule is not JSON: ignored");
        return;
    };
    match crate::rules::parse_rule(&v, &state.settings) {
        Ok(spec) => {
            let gen = spec.generation();
            if lock(&rep.known_rules).get(name) == Some(&gen) {
                return;
            }
            match state.install(spec, Origin::Peer) {
                Ok(done) => {
                    lock(&rep.known_rules).insert(name.to_owned(), done.rule.generation);
                    tracing::info!(rule = name, "rule replicated from another replica");
                }
                Err(e) => tracing::warn!(rule = name, "replicated rule rejected here: {e:?}"),
            }
        }
        Err(e) => tracing::warn!(rule = name, "replicated rule rejected here: {e}"),
    }
}

/// Starts tailing new rules (bootstrapping them from snapshots) and forgets deleted ones.
async fn sync_tails(
    rep: &Replica,
    state: &Fleet,
    conn: &mut Conn,
    tails: &mut HashMap<String, Tail>,
) -> redis::RedisResult<()> {
    let rules: Vec<Arc<RuleRuntime>> = state
        .rules()
        .into_iter()
        .filter(|r| r.spec.kv_enabled())
        .collect();
    tails.retain(|k, t| {
        rules
            .iter()
            .any(|r| Arc::ptr_eq(r, &t.rule) && rep.log_key(r) == *k)
    });
    for rule in rules {
        let key = rep.log_key(&rule);
        if tails.contains_key(&key) {
            continue;
        }
        let head = last_id(conn, &key).await?;
        let mut skip = vec![head; rule.eps().len()];
        let mut pos = head;
        for ep in rule.kv_endpoints() {
            let owned = rule.ep(ep).is_some_and(|e| e.owned());
            let at = if owned {
                // Ours: live and newer than anything logged so far; only new entries apply.
                head
            } else {
                load_snapshot(rep, state, conn, &rule, ep, SnapshotLoad::Bootstrap)
                    .await?
                    .unwrap_or_default()
            };
            skip[usize::from(ep.0)] = at;
            pos = pos.min(at);
        }
        lock(&rep.tailed).insert(key.clone(), pos);
        tails.insert(key, Tail { rule, pos, skip });
    }
    Ok(())
}

/// The id of the newest entry of a stream (`0-0` when empty or absent).
async fn last_id(conn: &mut Conn, key: &str) -> redis::RedisResult<StreamId> {
    let last: Vec<(String, HashMap<String, Value>)> = redis::cmd("XREVRANGE")
        .arg(key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await?;
    Ok(last
        .first()
        .and_then(|(id, _)| StreamId::parse(id))
        .unwrap_or_default())
}

/// Loads endpoint `ep`'s snapshot into the index; returns the log position it includes
/// (`None` if there is none: the endpoint keeps what it has).
async fn load_snapshot(
    rep: &Replica,
    state: &Fleet,
    conn: &mut Conn,
    rule: &RuleRuntime,
    ep: EndpointId,
    cause: SnapshotLoad,
) -> redis::RedisResult<Option<StreamId>> {
    let Some(e) = rule.ep(ep) else {
        return Ok(None);
    };
    let bytes: Option<Vec<u8>> = redis::cmd("GET")
        .arg(rep.snap_key(rule, usize::from(ep.0)))
        .query_async(conn)
        .await?;
    let Some(bytes) = bytes else { return Ok(None) };
    let snap = match Snapshot::decode(&bytes) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(rule = %rule.spec.name(), ep = ep.0, "undecodable snapshot ignored: {e}");
            return Ok(None);
        }
    };
    // Apply the difference, not clear-and-store: queries keep a whole view, and the write lock
    // is held for what changed (usually little) instead of the endpoint's whole inventory.
    let mut have: HashMap<u8, Vec<BlockKey>> =
        rule.export(ep).into_iter().map(|(r, k)| (r.0, k)).collect();
    for r in snap.ranks {
        let rank = Rank(r.rank);
        if let Some(seq) = r.seq {
            e.note_seq(rank, seq);
        }
        let old = have.remove(&r.rank).unwrap_or_default();
        let (gone, new) = diff(old, r.keys);
        state.apply_replicated(
            rule,
            ep,
            rank,
            &[IndexOp::Remove(gone), IndexOp::Store(new)],
        );
    }
    for (rank, old) in have {
        state.apply_replicated(rule, ep, Rank(rank), &[IndexOp::Remove(old)]);
    }
    let m = &state.metrics;
    m.snapshot_load(cause).inc();
    m.snapshot_age
        .with_label_values(&[&rule.spec.name(), &ep.0.to_string()])
        .set(now_ms().saturating_sub(snap.taken_ms) as f64 / 1000.0);
    Ok(StreamId::parse(&snap.upto))
}

/// Keys only in `old` and keys only in `new`.
fn diff(mut old: Vec<BlockKey>, mut new: Vec<BlockKey>) -> (Vec<BlockKey>, Vec<BlockKey>) {
    old.sort_unstable_by_key(|k| k.0);
    new.sort_unstable_by_key(|k| k.0);
    let (mut gone, mut added) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a.0 == b.0 => {
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a.0 < b.0 => {
                gone.push(*a);
                i += 1;
            }
            (Some(a), None) => {
                gone.push(*a);
                i += 1;
            }
            (_, Some(b)) => {
                added.push(*b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (gone, added)
}

/// Applies what one read returned (entries at or before a log's position were applied already).
async fn apply_read(
    rep: &Replica,
    state: &Arc<Fleet>,
    conn: &mut Conn,
    tails: &mut HashMap<String, Tail>,
    rules_pos: &mut Option<StreamId>,
    reply: Option<StreamReadReply>,
) -> redis::RedisResult<()> {
    let Some(reply) = reply else { return Ok(()) };
    let rules_key = rep.rules_log_key();
    let now = now_ms();
    let m = &state.metrics;
    let mut read = 0usize;
    for sk in reply.keys {
        read += sk.ids.len();
        if sk.key == rules_key {
            for e in sk.ids {
                if let Some(id) = StreamId::parse(&e.id) {
                    *rules_pos = Some(id);
                }
                apply_rule_entry(rep, state, &e);
            }
            continue;
        }
        let Some(t) = tails.get_mut(&sk.key) else {
            continue;
        };
        for e in sk.ids {
            let Some(id) = StreamId::parse(&e.id) else {
                continue;
            };
            if id <= t.pos {
                continue;
            }
            t.pos = id;
            let origin: Option<String> = e.get("o");
            if origin.as_deref() == Some(rep.origin.as_str()) {
                // Written by this process: applied when it happened.
                continue;
            }
            let data: Option<Vec<u8>> = e.get("d");
            let Some(entries) = data.and_then(|d| decode_batch(&d).ok()) else {
                m.repl_entry(ReplEntry::Undecodable).inc();
                continue;
            };
            m.repl_lag_seconds
                .observe(now.saturating_sub(id.ms) as f64 / 1000.0);
            for entry in entries {
                let ep = entry.ep() as usize;
                if ep >= t.rule.eps().len() || id <= t.skip[ep] {
                    continue;
                }
                m.repl_entry(ReplEntry::Applied).inc();
                apply_entry(rep, state, conn, t, id, entry).await?;
            }
        }
        lock(&rep.tailed).insert(sk.key.clone(), t.pos);
    }
    m.repl_lag_entries.set(read as i64);
    Ok(())
}

async fn apply_entry(
    rep: &Replica,
    state: &Fleet,
    conn: &mut Conn,
    t: &mut Tail,
    id: StreamId,
    entry: Entry,
) -> redis::RedisResult<()> {
    let rule = &t.rule;
    match entry {
        Entry::Ops { ep, rank, seq, ops } => {
            let (ep, rank) = (EndpointId(ep), Rank(rank));
            if let (Some(s), Some(e)) = (seq, rule.ep(ep)) {
                e.note_seq(rank, s);
            }
            state.apply_replicated(rule, ep, rank, &ops);
        }
        Entry::Decision {
            ep,
            update,
            ttl_ms,
            keys,
            session,
        } => {
            // Credit only what is left of the decision's time to live.
            let age = now_ms().saturating_sub(id.ms);
            let left = u64::from(ttl_ms).saturating_sub(age);
            state.apply_peer_decision(
                rule,
                EndpointId(ep),
                update,
                &keys,
                session,
                Duration::from_millis(age),
                Duration::from_millis(left),
            );
        }
        Entry::Snapshot { ep, resync } => {
            let ep = EndpointId(ep);
            let owned = rule.ep(ep).is_some_and(|e| e.owned());
            if resync && !owned {
                if let Some(at) =
                    load_snapshot(rep, state, conn, rule, ep, SnapshotLoad::Marker).await?
                {
                    t.skip[usize::from(ep.0)] = at.max(id);
                }
            }
        }
    }
    Ok(())
}

fn apply_rule_entry(rep: &Replica, state: &Arc<Fleet>, e: &redis::streams::StreamId) {
    let origin: Option<String> = e.get("o");
    if origin.as_deref() == Some(rep.origin.as_str()) {
        return;
    }
    let (Some(op), Some(name)) = (e.get::<String>("op"), e.get::<String>("name")) else {
        return;
    };
    match op.as_str() {
        "put" => {
            if let Some(raw) = e.get::<String>("rule") {
                put_rule(rep, state, &name, &raw);
            }
        }
        "del" => {
            lock(&rep.known_rules).remove(&name);
            if state.uninstall(&name, Origin::Peer).is_some() {
                tracing::info!(rule = %name, "rule deletion replicated from another replica");
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().map(|x| BlockKey(*x)).collect()
    }

    #[test]
    fn snapshot_diff() {
        assert_eq!(diff(k(&[5, 1, 3]), k(&[3, 4, 1, 9])), (k(&[5]), k(&[4, 9])));
        assert_eq!(diff(vec![], k(&[2])), (vec![], k(&[2])));
        assert_eq!(diff(k(&[2]), vec![]), (k(&[2]), vec![]));
    }
}
