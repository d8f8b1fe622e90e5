//! Replication through a real Redis Cluster started by the test (3 primaries + 3 replicas of
//! `redis-server --cluster-enabled yes` on free ports, `cluster-node-timeout` 1 s): two inventory
//! replicas replicate a rule and engine events through it; the primary holding the rule's slot
//! is killed while the owner ingests. What must hold once the failover has completed:
//!
//! * every event the owner ingested before, during and after the failover is in the other
//!   replica's index (nothing lost: entries dropped while the slot had no primary, or
//!   acknowledged by the dead primary and never replicated, come back with the owner's snapshot);
//! * the owner keeps its endpoint (the lease outlives the failover), renews it on the promoted
//!   primary and resumes without a gap;
//! * both sides report it: the owner's failed writes and its resynchronisation, the other
//!   replica's failed read and its resynchronisation;
//! * rule changes still replicate (the rule keys live in their own slot).
//!
//! A second test moves the rule's slot to another primary while the owner ingests (a
//! resharding): both replicas converge with no failed command and no resynchronisation, and the
//! owner's snapshot and lease are then on the new primary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{batch, bind_same_port, metric, rule, stored, Publisher, Service};
use kvroute_test_support::{wait_until, Poll, Probe, RedisCluster};
use serde_json::{json, Value};

const RULE: &str = "10.0.0.1:8080";
const RULE_ID: &str = "10.0.0.1:8080/tcp";
/// The endpoint's publisher address (each vLLM endpoint publishes on its own IP).
const EP_IP: &str = "127.0.0.57";
/// Block keys of the events published while the primary is killed and failed over.
const DURING: u64 = 0x5_0000;

fn replica(tag: &str, cluster: &RedisCluster, id: &str, rules: &Value) -> Service {
    let urls = cluster.urls();
    let env = [
        ("KVROUTE_REDIS_URL", urls.as_str()),
        ("KVROUTE_REDIS_MODE", "cluster"),
        ("KVROUTE_REPLICA_ID", id),
        // Longer than the failover (node timeout + election): the owner keeps its lease.
        ("KVROUTE_LEASE_MS", "15000"),
        ("KVROUTE_SNAPSHOT_INTERVAL_MS", "1000"),
        ("KVROUTE_SPEC_TTL_MS", "0"),
    ];
    Service::start(tag, rules, &env)
}

/// The replica whose subscriber for endpoint 0 is connected and holds the lease (bounded).
async fn owner(svcs: &[&Service]) -> usize {
    let lease = format!(r#"kvroute_replication_lease_owned{{ep="0",rule="{RULE_ID}"}}"#);
    let conn =
        format!(r#"kvroute_ingest_subscriber_connected{{ep="0",rank="0",rule="{RULE_ID}"}}"#);
    let found = Poll::new("exactly one connected owner", Duration::from_secs(30))
        .every(Duration::from_millis(20))
        .until(async || {
            let mut own = Vec::new();
            for (i, s) in svcs.iter().enumerate() {
                let m = s.metrics().await;
                if metric(&m, &lease) == Some(1.0) && metric(&m, &conn) == Some(1.0) {
                    own.push(i);
                }
            }
            Ok(match own.as_slice() {
                [o] => Probe::Ready(*o),
                _ => Probe::Pending(format!("owners {own:?}")),
            })
        })
        .await;
    found.unwrap_or_else(|e| panic!("{e}\n{}", svcs[0].stderr()))
}

/// The endpoint's inventory, empty while the replica does not know the rule yet.
async fn inv(svc: &Service) -> BTreeSet<u64> {
    let keys = svc.try_inventory(RULE, 0).await.unwrap_or_default();
    keys.into_iter().collect()
}

/// Waits until every replica's inventory equals `want`.
async fn converge(svcs: &[&Service], want: &BTreeSet<u64>, secs: u64, what: &str) {
    let all = wait_until(what, Duration::from_secs(secs), async || {
        for s in svcs {
            if inv(s).await != *want {
                return false;
            }
        }
        true
    })
    .await;
    if all.is_ok() {
        return;
    }
    let mut missing = Vec::new();
    for s in svcs {
        let have = inv(s).await;
        missing.push(want.difference(&have).count());
    }
    panic!(
        "{what}: keys missing per replica {missing:?} of {}\n{}\n-----\n{}",
        want.len(),
        svcs[0].stderr(),
        svcs[1].stderr()
    );
}

/// Sends one batch storing `key` until `svc` shows it (PUB/SUB readiness without a sleep).
async fn send_until_seen(svc: &Service, p: &mut Publisher, key: u64) {
    let payload = batch(vec![stored(&[key], &[], false)]);
    let seq = p.seq;
    let seen = wait_until(
        "the owner to see the probe",
        Duration::from_secs(20),
        async || {
            p.send_seq(seq, &payload).await;
            inv(svc).await.contains(&key)
        },
    )
    .await;
    if seen.is_err() {
        panic!("the owner never saw the probe; stderr:\n{}", svc.stderr());
    }
    p.seq = seq + 1;
}

/// The sum of a counter over the given label values.
fn sum(m: &str, name: &str, label: &str, values: &[&str]) -> f64 {
    values
        .iter()
        .filter_map(|v| metric(m, &format!(r#"{name}{{{label}="{v}"}}"#)))
        .sum()
}

/// The primary holding the rule's log, snapshot and lease (one slot: all on one primary; KEYS
/// lists a node's own keys), and the log's key. The owner writes the snapshot at its first tick.
async fn rule_slot(cluster: &RedisCluster, own: &Service) -> (usize, String) {
    let tagged = |k: &str| k.contains(&format!("{{{RULE_ID}#"));
    let found = Poll::new(
        "the rule's log, snapshot and lease",
        Duration::from_secs(10),
    )
    .until(async || {
        let mut on = Vec::new();
        for m in cluster.masters() {
            let keys: Vec<String> = cluster
                .cli(m, &["KEYS", "kvroute:*"])
                .lines()
                .map(str::to_owned)
                .filter(|k| tagged(k))
                .collect();
            if !keys.is_empty() {
                on.push((m, keys));
            }
        }
        let all = |keys: &[String]| {
            [":log", ":snap:0", ":lease:0"]
                .iter()
                .all(|s| keys.iter().any(|k| k.ends_with(s)))
        };
        Ok(match on.as_slice() {
            [(m, keys)] if all(keys) => Probe::Ready((*m, keys.clone())),
            _ => Probe::Pending(format!("{on:?}")),
        })
    })
    .await;
    let (at, keys) = found.unwrap_or_else(|e| panic!("{e}\n{}", own.stderr()));
    let log_key = keys.iter().find(|k| k.ends_with(":log")).unwrap().clone();
    assert_eq!(cluster.master_of(&log_key), Some(at));
    (at, log_key)
}

/// Two replicas of one vLLM rule whose endpoint publishes on `ep_ip`, the owner of its endpoint,
/// and the keys both hold once 21 events went through.
struct Pair {
    a: Service,
    b: Service,
    /// The owner's index in `[a, b]`.
    o: usize,
    p: Publisher,
    want: BTreeSet<u64>,
}

impl Pair {
    async fn start(cluster: &RedisCluster, tag: &str, ep_ip: &str, port_base: u16) -> Pair {
        let (mut pubs, port) = bind_same_port(&[ep_ip], port_base).await;
        let r = rule(
            8080,
            "vllm",
            port,
            &[(ep_ip.to_string(), 9)],
            json!({"kvHashAlgo": "sha256_cbor"}),
        );
        let rules = json!([r]);
        let a = replica(&format!("{tag}-a"), cluster, "a", &rules);
        let b = replica(&format!("{tag}-b"), cluster, "b", &rules);
        let o = owner(&[&a, &b]).await;
        let mut p = pubs.remove(0);
        let own = [&a, &b][o];
        send_until_seen(own, &mut p, 0xC0).await;
        let mut want: BTreeSet<u64> = [0xC0].into_iter().collect();
        send(&mut p, &mut want, 0xC1..=0xD4).await;
        converge(&[&a, &b], &want, 10, "both replicas at start").await;
        Pair { a, b, o, p, want }
    }
}

/// Publishes `n` events (keys from `DURING`), one every 10 ms, and runs `during` once the owner
/// has ingested 40 of them; returns what `during` returned once all `n` are sent (and in `want`).
async fn ingest_around<T>(
    mut p: Publisher,
    own: &Service,
    want: &mut BTreeSet<u64>,
    n: u64,
    during: impl FnOnce() -> T,
) -> (T, Publisher) {
    let ingest = tokio::spawn(async move {
        for i in 0..n {
            p.send(&batch(vec![stored(&[DURING + i], &[], false)]))
                .await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        p
    });
    wait_until("the owner ingesting", Duration::from_secs(10), async || {
        inv(own).await.contains(&(DURING + 40))
    })
    .await
    .unwrap();
    let out = tokio::task::block_in_place(during);
    let p = ingest.await.unwrap();
    want.extend((0..n).map(|i| DURING + i));
    (out, p)
}

/// Publishes one event per key, each key recorded in `want`. The caller keeps the publisher:
/// the owner's subscriber stays connected.
async fn send(p: &mut Publisher, want: &mut BTreeSet<u64>, keys: impl IntoIterator<Item = u64>) {
    for k in keys {
        p.send(&batch(vec![stored(&[k], &[], false)])).await;
        want.insert(k);
    }
}

/// A replica's metrics `m` show no lease lost and no sequence gap cleared (the owner resumed
/// without one).
fn kept_the_endpoint(m: &str) {
    assert_eq!(
        metric(
            m,
            r#"kvroute_ingest_clears_total{cause="gap",engine="vllm"}"#
        ),
        None,
        "{m}"
    );
    assert_eq!(
        metric(
            m,
            r#"kvroute_replication_lease_changes_total{event="lost"}"#
        )
        .unwrap_or(0.0),
        0.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_through_a_cluster_survives_a_primary_failover() {
    let mut cluster = RedisCluster::start(3, 1000).unwrap();
    let Pair {
        a,
        b,
        o,
        p,
        mut want,
    } = Pair::start(&cluster, "cl", EP_IP, 33000).await;
    let svcs = [&a, &b];
    let (own, other) = (svcs[o], svcs[1 - o]);

    let (victim, log_key) = rule_slot(&cluster, own).await;

    // Ingest continuously; kill the rule's primary in the middle; keep ingesting through the
    // failover (every 10 ms, 400 events: ~4 s, longer than detection + election).
    let (promoted, mut p) = ingest_around(p, own, &mut want, 400, || {
        cluster.kill(victim);
        cluster.wait_failover(&log_key, victim, Duration::from_secs(30))
    })
    .await;
    let promoted = promoted.unwrap();
    assert_ne!(promoted, victim);
    // The owner itself lost nothing (ingestion does not depend on Redis).
    converge(&[own], &want, 10, "the owner's own ingestion").await;
    // After the failover: new events, and everything converges.
    send(&mut p, &mut want, 0x6_0000..0x6_0014).await;
    converge(&svcs, &want, 20, "both replicas after the failover").await;

    // The owner kept its lease and renews it on the promoted primary (its script cache starts
    // empty: the renewal reloads the script); it resumed without a gap.
    assert_eq!(owner(&svcs).await, o);
    let lease_key = log_key.replace(":log", ":lease:0");
    let pttl = |c: &RedisCluster| c.cli_int(promoted, &["PTTL", &lease_key]).unwrap_or(-3);
    let t1 = pttl(&cluster);
    assert!(t1 > 0, "the lease is on the promoted primary: PTTL {t1}");
    // Renewals come every third of the 15 s lease: 20 s leave room for one that fails while the
    // cluster client still follows the failover (seen under the full suite's load).
    let renewed = tokio::task::block_in_place(|| {
        Poll::new(
            "a lease renewal on the promoted primary",
            Duration::from_secs(20),
        )
        .until_blocking(|| Ok(Probe::from(pttl(&cluster) > t1)))
    });
    assert!(renewed.is_ok(), "{renewed:?}\n{}", own.stderr());
    let m = own.metrics().await;
    kept_the_endpoint(&m);
    let errors = sum(
        &m,
        "kvroute_redis_errors_total",
        "op",
        &["write", "snapshot", "verify", "ping"],
    );
    let resyncs = sum(
        &m,
        "kvroute_replication_resyncs_total",
        "reason",
        &["writer_reconnect", "lost_writes"],
    );
    assert!(
        errors >= 1.0 && resyncs >= 1.0,
        "owner: errors {errors}, resyncs {resyncs}\n{m}"
    );
    let m = other.metrics().await;
    assert!(
        metric(&m, r#"kvroute_redis_errors_total{op="read"}"#).is_some_and(|v| v >= 1.0)
            && metric(
                &m,
                r#"kvroute_replication_resyncs_total{reason="tailer_reconnect"}"#
            )
            .is_some_and(|v| v >= 1.0),
        "{m}"
    );
    for s in svcs {
        assert_eq!(
            metric(&s.metrics().await, "kvroute_redis_connected"),
            Some(1.0)
        );
    }

    // A rule added on one replica appears on the other (the rule keys' slot is elsewhere).
    let extra = rule(8081, "llamacpp", 0, &[("127.0.0.61".into(), 9)], json!({}));
    let (s, v) = own.post_rule(&extra).await;
    assert_eq!(s, 200, "{v}");
    other
        .wait_for("the added rule on the other replica", 10, || async {
            other
                .get("/netlox/v1/config/loadbalancer/all")
                .await
                .1
                .contains("8081")
        })
        .await;

    let (mut a, mut b) = (a, b);
    assert_eq!(a.terminate(), Some(0), "{}", a.stderr());
    assert_eq!(b.terminate(), Some(0), "{}", b.stderr());
    drop(cluster);
}

/// The endpoint address of the resharding test (its own, so both tests of this file can run at
/// once).
const RESHARD_EP_IP: &str = "127.0.0.91";

/// A resharding moves the rule's slot (its log, snapshots and leases) to another primary while the
/// owner ingests: nothing is lost, the owner keeps its endpoint, and its snapshots and lease
/// renewals follow the slot to the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_through_a_cluster_follows_the_rules_slot_to_another_primary() {
    let cluster = RedisCluster::start(3, 1000).unwrap();
    let Pair {
        a,
        b,
        o,
        p,
        mut want,
    } = Pair::start(&cluster, "rs", RESHARD_EP_IP, 34000).await;
    let svcs = [&a, &b];
    let own = svcs[o];
    let (from, log_key) = rule_slot(&cluster, own).await;
    let to = cluster.masters().into_iter().find(|&m| m != from).unwrap();

    let (moved, mut p) =
        ingest_around(p, own, &mut want, 200, || cluster.move_slot(&log_key, to)).await;
    moved.unwrap();
    let written = |m: &str| metric(m, "kvroute_replication_snapshots_written_total");
    let after_move = written(&own.metrics().await).unwrap_or(0.0);
    send(&mut p, &mut want, 0x6_0000..0x6_0014).await;
    converge(&svcs, &want, 20, "both replicas after the move").await;

    // A snapshot written since the move is on the new primary, and so is the renewed lease.
    let snapped = wait_until(
        "a snapshot written after the move",
        Duration::from_secs(10),
        async || written(&own.metrics().await).is_some_and(|n| n > after_move),
    )
    .await;
    assert!(snapped.is_ok(), "{}", own.stderr());
    let snap_key = log_key.replace(":log", ":snap:0");
    let lease_key = log_key.replace(":log", ":lease:0");
    let len = cluster.cli_int(to, &["STRLEN", &snap_key]);
    assert!(len > Some(0), "the snapshot is on the new primary: {len:?}");
    let pttl = cluster.cli_int(to, &["PTTL", &lease_key]);
    assert!(
        pttl > Some(0),
        "the lease is on the new primary: PTTL {pttl:?}"
    );
    assert_eq!(owner(&svcs).await, o);
    for s in svcs {
        let m = s.metrics().await;
        assert_eq!(metric(&m, "kvroute_redis_connected"), Some(1.0), "{m}");
        // Every command followed the slot: nothing failed, nothing was resynchronised.
        let errors = sum(
            &m,
            "kvroute_redis_errors_total",
            "op",
            &["write", "snapshot", "verify", "ping", "read"],
        );
        assert_eq!(errors, 0.0, "{m}\n{}", s.stderr());
        let resyncs = sum(
            &m,
            "kvroute_replication_resyncs_total",
            "reason",
            &["writer_reconnect", "lost_writes", "tailer_reconnect"],
        );
        assert_eq!(resyncs, 0.0, "{m}\n{}", s.stderr());
        kept_the_endpoint(&m);
    }

    let (mut a, mut b) = (a, b);
    assert_eq!(a.terminate(), Some(0), "{}", a.stderr());
    assert_eq!(b.terminate(), Some(0), "{}", b.stderr());
    drop(cluster);
}
