//! Endpoint ownership: one lease per endpoint, held by the replica that ingests its events.
//!
//! One script both acquires (the key is absent) and renews (the key is ours), every third of the
//! lease (after a failed call sooner: 250 ms, doubling up to that), so a lease lost to a Redis
//! restart is taken back at the next renewal. While Redis is unreachable an owner keeps
//! its lease and keeps ingesting (nobody else can take it over), and a non-owner stays idle.
//!
//! A Redis that restarted empty has lost every lease, and the replica that ingested through the
//! outage holds events the others never heard of. So the first script call to find the lease's
//! `:epoch` marker missing (a new or restarted Redis) sets it and opens a grace period of one
//! lease (`:grace`, expiring): until it ends only the replica that still ingests the endpoint
//! may take the absent lease back; another takes an absent lease only after it. A new
//! deployment's first owner is therefore chosen one lease after start.
//! On takeover the new owner resumes the engine's sequence from the replicated state: in order
//! continues, a gap is replayed (or cleared), a restart is cleared. Keys re-derived from tokens
//! (tokens key mode, TensorRT-LLM) need the engine-key map the previous owner held, so those
//! endpoints are cleared and rebuilt instead.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::Engine;
use tokio_util::sync::CancellationToken;

use super::Replica;
use crate::fleet::{Fleet, RuleRuntime, StartFeeds};
use crate::index::{EndpointId, IndexOp};
use crate::metrics::{ClearCause, LeaseChange, RedisOp};
use crate::rules::KeyMode;

/// The wait after a first failed lease call; it doubles on each failure up to the renewal period.
const RETRY_FIRST: Duration = Duration::from_millis(250);

/// KEYS[1] lease, KEYS[2] its epoch marker, KEYS[3] its grace marker; ARGV[1] replica id,
/// ARGV[2] ms, ARGV[3] `1` when this replica still ingests the endpoint: 1 if we hold the lease
/// afterwards, else 0 (see the module docs for the grace period).
const ACQUIRE_OR_RENEW: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[2], '1', 'NX') then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
end
if not v then
  if ARGV[3] == '1' or redis.call('EXISTS', KEYS[3]) == 0 then
    if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
  end
end
return 0
";

/// KEYS[1] lease, ARGV[1] replica id: deletes the lease if it is ours.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// Runs until the rule is cancelled (deleted, replaced, or the service drains); `start` starts
/// the endpoint's feeds while the lease is held.
pub(super) async fn run(
    rep: Arc<Replica>,
    state: Arc<Fleet>,
    rule: Arc<RuleRuntime>,
    ep: EndpointId,
    start: StartFeeds,
) {
    let Some(endpoint) = rule.ep(ep) else {
        return;
    };
    let key = rep.lease_key(&rule, usize::from(ep.0));
    let name = rule.spec.name();
    let ep_label = ep.0.to_string();
    let owned_gauge = state
        .metrics
        .lease_owned
        .with_label_values(&[&name, &ep_label]);
    owned_gauge.set(0);
    let acquire = redis::Script::new(ACQUIRE_OR_RENEW);
    let lease_ms = rep.cfg.lease.as_millis() as u64;
    let period = (rep.cfg.lease / 3).max(Duration::from_millis(50));
    let mut conn = rep.conn.clone();
    let mut ingest: Option<CancellationToken> = None;
    // After a failed call the next comes sooner (250 ms, doubling up to the period): a failover
    // or a brief outage is bridged well within the lease instead of one period later.
    let mut retry = RETRY_FIRST;
    loop {
        let held: Result<i64, _> = acquire
            .key(&key)
            .key(format!("{key}:epoch"))
            .key(format!("{key}:grace"))
            .arg(&rep.origin)
            .arg(lease_ms)
            .arg(u8::from(ingest.is_some()))
            .invoke_async(&mut conn)
            .await;
        let wait = if held.is_err() {
            let w = retry.min(period);
            retry = retry.saturating_mul(2);
            w
        } else {
            retry = RETRY_FIRST;
            period
        };
        match (held, ingest.is_some()) {
            (Ok(1), false) => {
                let token = rule.child_token();
                take_over(&state, &rule, ep);
                start(&token);
                ingest = Some(token);
                owned_gauge.set(1);
                state.metrics.lease_change(LeaseChange::Acquired).inc();
                tracing::info!(rule = %name, ep = ep.0, replica = %rep.id, "endpoint lease acquired: ingesting");
            }
            (Ok(1), true) => {}
            (Ok(_), true) => {
                if let Some(t) = ingest.take() {
                    t.cancel();
                }
                endpoint.set_owned(false);
                for rank in rule.ranks() {
                    state.set_connected(&rule, ep, rank, false);
                }
                owned_gauge.set(0);
                state.metrics.lease_change(LeaseChange::Lost).inc();
                tracing::warn!(rule = %name, ep = ep.0, replica = %rep.id, "endpoint lease held by another replica: ingestion stopped here");
            }
            (Ok(_), false) => {}
            (Err(e), owned) => {
                state.metrics.redis_error(RedisOp::Lease).inc();
                if owned {
                    tracing::warn!(rule = %name, ep = ep.0, retry_ms = wait.as_millis() as u64, "lease renewal failed: {e}");
                } else {
                    tracing::debug!(rule = %name, ep = ep.0, "lease call failed: {e}");
                }
            }
        }
        tokio::select! {
            _ = rule.stopped() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    if ingest.is_some() {
        endpoint.set_owned(false);
        // Hand over at once on a graceful stop instead of after the lease expires.
        let release = redis::Script::new(RELEASE);
        let r = tokio::time::timeout(
            Duration::from_secs(1),
            release
                .key(&key)
                .arg(&rep.origin)
                .invoke_async::<i64>(&mut conn),
        )
        .await;
        if matches!(r, Ok(Ok(1))) {
            state.metrics.lease_change(LeaseChange::Released).inc();
        }
    }
    // The series stays: a replacing rule's loop owns it now, and a deleted rule's series are
    // dropped by `Fleet::uninstall`.
}

/// Marks the endpoint owned, schedules its snapshot, and clears what cannot be continued.
fn take_over(state: &Fleet, rule: &Arc<RuleRuntime>, ep: EndpointId) {
    let Some(e) = rule.ep(ep) else { return };
    e.set_owned(true);
    e.mark_dirty();
    let rederived = rule.spec.key_mode == KeyMode::Tokens || rule.spec.engine == Engine::Trtllm;
    if rederived && rule.block_count(ep) > 0 {
        state
            .metrics
            .clear(rule.spec.engine.as_str(), ClearCause::Takeover)
            .inc();
        for rank in rule.ranks() {
            state.apply_ops(rule, ep, rank, &[IndexOp::Clear]);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kvroute_test_support::redis::Redis;

    /// The script's rules on a real Redis: a restarted Redis gives the lease back to the replica
    /// that kept ingesting and makes the others wait one lease; renewal and expiry as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_restart_only_the_ingesting_replica_takes_the_lease_back_at_once() {
        let mut redis = Redis::start().unwrap();
        let client = redis::Client::open(redis.url()).unwrap();
        let script = redis::Script::new(ACQUIRE_OR_RENEW);
        let ms = 400u64;
        let call = |who: &'static str, ingesting: bool| {
            let client = client.clone();
            let script = script.clone();
            async move {
                let mut c = client.get_multiplexed_async_connection().await.unwrap();
                script
                    .key("L")
                    .key("L:epoch")
                    .key("L:grace")
                    .arg(who)
                    .arg(ms)
                    .arg(u8::from(ingesting))
                    .invoke_async::<i64>(&mut c)
                    .await
                    .unwrap()
            }
        };
        // A new Redis: nobody takes the lease during the grace period, then the first asker.
        assert_eq!(call("b", false).await, 0);
        assert_eq!(call("a", false).await, 0);
        tokio::time::sleep(Duration::from_millis(ms + 100)).await;
        assert_eq!(call("a", false).await, 1);
        assert_eq!(call("b", false).await, 0, "held by a");
        assert_eq!(call("a", true).await, 1, "renewed");
        // Redis restarts empty while a ingests: b asks first and is refused, a takes it back.
        redis.restart().unwrap();
        assert_eq!(
            redis.cli(&["DBSIZE"]).trim(),
            "0",
            "a restarted Redis is empty"
        );
        assert_eq!(call("b", false).await, 0);
        assert_eq!(call("a", true).await, 1);
        assert_eq!(call("b", false).await, 0);
        // a dies: its lease expires and b takes over without a grace period (Redis kept it).
        tokio::time::sleep(Duration::from_millis(ms + 100)).await;
        assert_eq!(call("b", false).await, 1);
    }
}
