//! Replication across inventory replicas through a real `redis-server` (started by the tests on
//! free ports): three replicas agree on routes within a measured lag, ownership moves when the
//! owner is killed, a Redis restart converges, and a late replica bootstraps from snapshots.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{
    batch, bind_same_port, metric, removed, rule, stored, stored_on, Publisher, Redis, Service,
    TOKEN,
};
use kvroute_test_support::{wait_until, Poll, Probe};
use serde_json::{json, Value};

const RULE: &str = "10.0.0.1:8080";
const RULE_ID: &str = "10.0.0.1:8080/tcp";
/// Endpoint IPs: each vLLM endpoint publishes on its own address, same port.
const EP_IPS: [&str; 2] = ["127.0.0.51", "127.0.0.52"];

fn env(redis: &Redis, id: &str) -> Vec<(String, String)> {
    [
        ("KVROUTE_REDIS_URL", redis.url()),
        ("KVROUTE_REPLICA_ID", id.to_owned()),
        ("KVROUTE_LEASE_MS", "1000".to_owned()),
        ("KVROUTE_SNAPSHOT_INTERVAL_MS", "1000".to_owned()),
        ("KVROUTE_SPEC_TTL_MS", "0".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn replica(tag: &str, redis: &Redis, id: &str, rules: &Value) -> Service {
    let e = env(redis, id);
    let refs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Service::start(tag, rules, &refs)
}

async fn publishers() -> (Vec<Publisher>, Value) {
    let (ps, port) = bind_same_port(&EP_IPS, 30000).await;
    let eps: Vec<(String, u16)> = EP_IPS.iter().map(|ip| (ip.to_string(), 9)).collect();
    let r = rule(
        8080,
        "vllm",
        port,
        &eps,
        json!({"kvHashAlgo": "sha256_cbor"}),
    );
    (ps, json!([r]))
}

/// Which replicas hold endpoint `ep`'s lease.
async fn owners(svcs: &[&Service], ep: usize) -> Vec<usize> {
    let series = format!(r#"kvroute_replication_lease_owned{{ep="{ep}",rule="{RULE_ID}"}}"#);
    let mut out = Vec::new();
    for (i, s) in svcs.iter().enumerate() {
        if metric(&s.metrics().await, &series) == Some(1.0) {
            out.push(i);
        }
    }
    out
}

/// Waits until exactly one replica owns `ep` and its subscriber is connected; returns it.
async fn single_owner(svcs: &[&Service], ep: usize, secs: u64) -> usize {
    let conn =
        format!(r#"kvroute_ingest_subscriber_connected{{ep="{ep}",rank="0",rule="{RULE_ID}"}}"#);
    let one = Poll::new("exactly one connected owner", Duration::from_secs(secs))
        .every(Duration::from_millis(20))
        .until(async || {
            let o = owners(svcs, ep).await;
            Ok(
                match o.len() == 1 && metric(&svcs[o[0]].metrics().await, &conn) == Some(1.0) {
                    true => Probe::Ready(o[0]),
                    false => Probe::Pending(String::new()),
                },
            )
        })
        .await;
    if let Ok(o) = one {
        return o;
    }
    let logs: Vec<String> = svcs.iter().map(|s| s.stderr()).collect();
    panic!(
        "endpoint {ep} never had exactly one connected owner: {:?}\n{}",
        owners(svcs, ep).await,
        logs.join("\n-----\n")
    );
}

/// Sends `payload` with sequence `seq` until `svc` shows `key` (repeats are duplicates to the
/// subscriber, so nothing is lost and no gap is created): PUB/SUB readiness without a sleep.
async fn send_until_seen(svc: &Service, p: &mut Publisher, ep: usize, seq: u64, key: u64) {
    let payload = batch(vec![stored(&[key], &[], false)]);
    let seen = wait_until(
        "the owner to see the sequence",
        Duration::from_secs(20),
        async || {
            p.send_seq(seq, &payload).await;
            svc.inventory(RULE, ep).await.contains(&key)
        },
    )
    .await;
    if seen.is_err() {
        panic!("the owner never saw seq {seq}; stderr:\n{}", svc.stderr());
    }
    p.seq = seq + 1;
}

/// The endpoint's inventory, empty while the replica does not know the rule yet.
async fn inv(svc: &Service, ep: usize) -> BTreeSet<u64> {
    let keys = svc.try_inventory(RULE, ep).await.unwrap_or_default();
    keys.into_iter().collect()
}

/// Waits until every replica's inventory of `ep` equals `want`.
async fn converge(svcs: &[&Service], ep: usize, want: &BTreeSet<u64>, secs: u64) {
    let all = wait_until(
        "every replica's inventory",
        Duration::from_secs(secs),
        async || {
            for s in svcs {
                if inv(s, ep).await != *want {
                    return false;
                }
            }
            true
        },
    )
    .await;
    if all.is_ok() {
        return;
    }
    let mut got = Vec::new();
    for s in svcs {
        got.push(inv(s, ep).await);
    }
    panic!(
        "endpoint {ep} did not converge to {want:?}: {got:?}\n{}",
        svcs[0].stderr()
    );
}

async fn route(svc: &Service, keys: &[u64]) -> String {
    let body = json!({"rule": RULE, "keys": keys, "token_count": 16 * keys.len()});
    let (s, v) = svc.post("/v1/route", &body.to_string(), None).await;
    assert_eq!(s, 200, "{v}");
    v["endpoint"].as_str().unwrap().to_owned()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_agree_survive_the_owner_and_bootstrap_a_late_one() {
    let redis = Redis::start().unwrap();
    let (mut pubs, rules) = publishers().await;
    let a = replica("repl-a", &redis, "a", &rules);
    let b = replica("repl-b", &redis, "b", &rules);
    let c = replica("repl-c", &redis, "c", &rules);
    let mut owner = [0usize; 2];
    {
        let svcs = [&a, &b, &c];
        for (ep, o) in owner.iter_mut().enumerate() {
            *o = single_owner(&svcs, ep, 20).await;
            send_until_seen(svcs[*o], &mut pubs[ep], ep, 0, 0xE0 + ep as u64).await;
        }
    }

    // Lag: from publishing a block to every replica showing it, 40 times per endpoint.
    let mut lag_ms = Vec::new();
    let mut want: [BTreeSet<u64>; 2] = [[0xE0].into_iter().collect(), [0xE1].into_iter().collect()];
    {
        let svcs = [&a, &b, &c];
        for i in 0..40u64 {
            for (ep, p) in pubs.iter_mut().enumerate() {
                let key = 0x1000 * (ep as u64 + 1) + i;
                let t0 = Instant::now();
                p.send(&batch(vec![stored(&[key], &[], false)])).await;
                want[ep].insert(key);
                let mut seen = [false; 3];
                let end = t0 + Duration::from_secs(5);
                while seen.iter().any(|s| !s) {
                    assert!(
                        Instant::now() < end,
                        "replica lag over 5 s for key {key:#x}"
                    );
                    for (r, s) in svcs.iter().enumerate() {
                        if !seen[r] && s.inventory(RULE, ep).await.contains(&key) {
                            seen[r] = true;
                            if r != owner[ep] {
                                lag_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                            }
                        }
                    }
                }
            }
        }
        for (ep, w) in want.iter().enumerate() {
            converge(&svcs, ep, w, 5).await;
        }
        // Every replica routes a prefix to the endpoint holding it, and a miss the same way.
        for s in svcs {
            assert_eq!(route(s, &[0x1000, 0x1001]).await, "127.0.0.51:9");
            assert_eq!(route(s, &[0x2000]).await, "127.0.0.52:9");
        }
        let n = lag_ms.len();
        let p50 = percentile(&mut lag_ms, 0.5);
        let p99 = percentile(&mut lag_ms, 0.99);
        println!("replication lag publish->every replica (non-owners, {n} samples): p50 {p50:.2} ms, p99 {p99:.2} ms");
        for s in svcs {
            let m = s.metrics().await;
            assert!(metric(&m, "kvroute_redis_connected") == Some(1.0), "{m}");
        }
    }

    // Kill the owner of endpoint 0 without a goodbye: the lease expires and another takes over.
    let victim = owner[0];
    let t_kill = Instant::now();
    let mut all = vec![Some(a), Some(b), Some(c)];
    let mut dead = all[victim].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let alive: Vec<Service> = all.into_iter().flatten().collect();
    let survivors: Vec<&Service> = alive.iter().collect();
    let new_owner = single_owner(&survivors, 0, 10).await;
    let takeover = t_kill.elapsed();
    println!(
        "takeover after SIGKILL of the owner: {} ms (lease 1000 ms)",
        takeover.as_millis()
    );
    assert!(takeover < Duration::from_secs(5), "{takeover:?}");
    // The new owner resumes the sequence: in-order events continue the same inventory.
    let next = pubs[0].seq;
    send_until_seen(survivors[new_owner], &mut pubs[0], 0, next, 0x3000).await;
    want[0].insert(0x3000);
    pubs[0]
        .send(&batch(vec![
            removed(&[0x1000, 0x1001]),
            stored(&[0x3001], &[], false),
        ]))
        .await;
    want[0].remove(&0x1000);
    want[0].remove(&0x1001);
    want[0].insert(0x3001);
    converge(&survivors, 0, &want[0], 10).await;
    converge(&survivors, 1, &want[1], 10).await;
    let m = survivors[new_owner].metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"kvroute_ingest_clears_total{cause="gap",engine="vllm"}"#
        ),
        None,
        "the takeover resumed without a gap: {m}"
    );
    for s in &survivors {
        assert_eq!(route(s, &[0x1002, 0x1003]).await, "127.0.0.51:9");
    }

    // A late replica with no rules file learns the rule and the inventory from Redis.
    let late = replica("repl-late", &redis, "late", &json!([]));
    let mut everyone: Vec<&Service> = survivors.clone();
    everyone.push(&late);
    converge(&everyone, 0, &want[0], 15).await;
    converge(&everyone, 1, &want[1], 15).await;
    let m = late.metrics().await;
    assert!(
        metric(
            &m,
            r#"kvroute_replication_snapshot_loads_total{cause="bootstrap"}"#
        )
        .is_some_and(|v| v >= 1.0)
            || metric(
                &m,
                r#"kvroute_replication_snapshot_loads_total{cause="marker"}"#
            )
            .is_some_and(|v| v >= 1.0),
        "{m}"
    );
    assert_eq!(route(&late, &[0x2000, 0x2001]).await, "127.0.0.52:9");
    drop(dead);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_converges_and_rules_replicate() {
    let mut redis = Redis::start().unwrap();
    let (mut pubs, rules) = publishers().await;
    let a = replica("rr-a", &redis, "a", &rules);
    let b = replica("rr-b", &redis, "b", &rules);
    let svcs = [&a, &b];
    let o = single_owner(&svcs, 0, 20).await;
    send_until_seen(svcs[o], &mut pubs[0], 0, 0, 0xA0).await;
    pubs[0]
        .send(&batch(vec![stored(&[0xA1, 0xA2, 0xA3], &[], false)]))
        .await;
    let mut want: BTreeSet<u64> = [0xA0, 0xA1, 0xA2, 0xA3].into_iter().collect();
    converge(&svcs, 0, &want, 10).await;
    // /healthz says which replica ingests the endpoint.
    for (i, s) in svcs.iter().enumerate() {
        let hz = s.get_json("/healthz").await;
        assert_eq!(hz["replication"]["replica"], ["a", "b"][i], "{hz}");
        assert_eq!(hz["replication"]["redis_connected"], true, "{hz}");
        assert_eq!(hz["rules"][0]["endpoints"][0]["owned"], i == o, "{hz}");
    }

    // Redis dies: both keep answering from memory; the owner keeps ingesting.
    redis.kill();
    pubs[0]
        .send(&batch(vec![
            removed(&[0xA1]),
            stored(&[0xB1, 0xB2], &[], false),
        ]))
        .await;
    want.remove(&0xA1);
    want.insert(0xB1);
    want.insert(0xB2);
    converge(&[svcs[o]], 0, &want, 10).await;
    assert!(
        !inv(svcs[1 - o], 0).await.contains(&0xB1),
        "the other replica cannot have heard of 0xB1 while Redis is down"
    );
    for s in svcs {
        assert_eq!(route(s, &[0xA2]).await, "127.0.0.51:9");
    }

    // Redis comes back empty: the owner rewrites its snapshot, the other converges.
    redis.restart().unwrap();
    converge(&svcs, 0, &want, 20).await;
    for s in svcs {
        // Both sides report the resynchronisation once their next Redis call succeeds.
        s.wait_for("resync reported", 10, || async {
            let m = s.metrics().await;
            let resyncs: f64 = ["writer_reconnect", "tailer_reconnect"]
                .iter()
                .filter_map(|r| {
                    metric(
                        &m,
                        &format!(r#"kvroute_replication_resyncs_total{{reason="{r}"}}"#),
                    )
                })
                .sum();
            resyncs >= 1.0
                && metric(&m, r#"kvroute_redis_errors_total{op="read"}"#).is_some()
                && metric(&m, "kvroute_redis_connected") == Some(1.0)
        })
        .await;
    }
    // Rules are back in Redis too (a replica starting now would find them).
    let restored = wait_until(
        "the rules back in Redis",
        Duration::from_secs(10),
        async || {
            redis
                .cli(&["HKEYS", "kvroute:{rules}:set"])
                .contains(RULE_ID)
        },
    )
    .await;
    assert!(restored.is_ok(), "rules not restored to Redis");

    // A rule added on one replica appears on the other; deleted, it disappears.
    let extra = rule(8081, "llamacpp", 0, &[("127.0.0.61".into(), 9)], json!({}));
    let (s, v) = a.post_rule(&extra).await;
    assert_eq!(s, 200, "{v}");
    b.wait_for("the added rule on the other replica", 10, || async {
        b.get("/netlox/v1/config/loadbalancer/all")
            .await
            .1
            .contains("8081")
    })
    .await;
    let extra_path =
        "/netlox/v1/config/loadbalancer/externalipaddress/10.0.0.1/port/8081/protocol/tcp";
    assert_eq!(a.delete(extra_path, Some(TOKEN)).await, 200);
    b.wait_for(
        "the deleted rule gone from the other replica",
        10,
        || async {
            !b.get("/netlox/v1/config/loadbalancer/all")
                .await
                .1
                .contains("8081")
        },
    )
    .await;
    let mut a = a;
    let mut b = b;
    assert_eq!(a.terminate(), Some(0), "{}", a.stderr());
    assert_eq!(b.terminate(), Some(0), "{}", b.stderr());
}

/// An owner whose lease call fails retries well before the next renewal period: with a 9 s lease
/// (renewals every 3 s) and Redis killed right after a renewal and back 3.5 s later (so the
/// renewal due at 3 s fails), the owner holds its lease on the restarted Redis within 1.8 s (a
/// retry one period later would come 2.5 s after the restart), and its failed renewal is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_retakes_its_lease_soon_after_redis_returns() {
    let mut redis = Redis::start().unwrap();
    let (_pubs, rules) = publishers().await;
    let mut e = env(&redis, "a");
    for (k, v) in &mut e {
        if k == "KVROUTE_LEASE_MS" {
            *v = "9000".to_owned();
        }
    }
    let refs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let a = Service::start("lease-retry", &rules, &refs);
    // A new Redis's first owner is chosen one lease after start.
    single_owner(&[&a], 0, 30).await;
    let key = redis
        .cli(&["KEYS", "*:lease:0"])
        .lines()
        .next()
        .expect("the lease key")
        .to_owned();
    let pttl = |r: &Redis| r.cli(&["PTTL", &key]).trim().parse::<i64>().unwrap_or(-3);
    let before = pttl(&redis);
    let renewed = tokio::task::block_in_place(|| {
        Poll::new("a renewal", Duration::from_secs(10))
            .every(Duration::from_millis(5))
            .until_blocking(|| Ok(Probe::from(pttl(&redis) > before)))
    });
    assert!(renewed.is_ok(), "{}", a.stderr());
    redis.kill();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    redis.restart().unwrap();
    let back = std::time::Instant::now();
    let held = tokio::task::block_in_place(|| {
        Poll::new(
            "the lease back on the restarted Redis",
            Duration::from_secs(10),
        )
        .every(Duration::from_millis(10))
        .until_blocking(|| Ok(Probe::from(pttl(&redis) > 0)))
    });
    let took = back.elapsed();
    assert!(held.is_ok(), "{}", a.stderr());
    assert!(
        took < Duration::from_millis(1800),
        "lease back {took:?} after Redis returned\n{}",
        a.stderr()
    );
    assert!(
        a.stderr().contains("lease renewal failed"),
        "{}",
        a.stderr()
    );
    assert_eq!(owners(&[&a], 0).await, vec![0]);
}

/// Blocks the owner ingests on an engine's host-memory tier reach the other replica through the
/// log: its answer counts them past the GPU match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lower_tier_blocks_replicate() {
    let redis = Redis::start().unwrap();
    let (mut pubs, rules) = publishers().await;
    let a = replica("lt-a", &redis, "a", &rules);
    let b = replica("lt-b", &redis, "b", &rules);
    let svcs = [&a, &b];
    let o = single_owner(&svcs, 0, 20).await;
    send_until_seen(svcs[o], &mut pubs[0], 0, 0, 0xA0).await;
    pubs[0]
        .send(&batch(vec![stored_on(&[0xA0, 0xA1, 0xA2], "CPU")]))
        .await;
    let ask = json!({"rule": RULE, "keys": [0xA0, 0xA1, 0xA2, 0xA3], "token_count": 64,
                     "explain": true})
    .to_string();
    for s in svcs {
        let seen = wait_until(
            "the host-memory blocks in the answer",
            Duration::from_secs(15),
            async || {
                let (_, v) = s.post("/v1/route", &ask, None).await;
                v["matched_blocks"] == json!(3) && v["endpoint"] == json!("127.0.0.51:9")
            },
        )
        .await;
        assert!(seen.is_ok(), "{}", s.stderr());
    }
    let (mut a, mut b) = (a, b);
    assert_eq!(a.terminate(), Some(0), "{}", a.stderr());
    assert_eq!(b.terminate(), Some(0), "{}", b.stderr());
}

/// A conversation bound on one replica is routed to the same endpoint by the other, from the
/// session tier: the binding travels with the decision's replication entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_bound_on_one_replica_holds_on_the_other() {
    let redis = Redis::start().unwrap();
    let (_pubs, rules) = publishers().await;
    let a = replica("ss-a", &redis, "a", &rules);
    let b = replica("ss-b", &redis, "b", &rules);
    single_owner(&[&a, &b], 0, 20).await;
    let ask = |explain: bool| {
        json!({"rule": RULE, "keys": [], "token_count": 0, "session": "conv-9", "explain": explain})
            .to_string()
    };
    // The first request has no keys: the rule's sel chooses, and the session is bound there.
    let (s, first) = a.post("/v1/route", &ask(false), None).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["tier"], "fallback", "{first}");
    let home = first["endpoint"].as_str().unwrap().to_owned();
    let idx = EP_IPS.iter().position(|ip| home.starts_with(ip)).unwrap();
    // `b` has not decided for this session itself (explain binds nothing): what it shows came
    // from `a`. Each round asks `a` again (its session tier keeps the same endpoint), so the
    // entry is written after `b` tails the log.
    let seen = wait_until(
        "the binding on the other replica",
        Duration::from_secs(15),
        async || {
            let (_, again) = a.post("/v1/route", &ask(false), None).await;
            assert_eq!(again["endpoint"].as_str(), Some(home.as_str()), "{again}");
            let (s, v) = b.post("/v1/route", &ask(true), None).await;
            s == 200 && v["explain"]["session"] == json!(idx)
        },
    )
    .await;
    assert!(seen.is_ok(), "b never learnt the binding:\n{}", b.stderr());
    let (s, v) = b.post("/v1/route", &ask(false), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["endpoint"].as_str(), v["tier"].as_str()),
        (Some(home.as_str()), Some("session")),
        "{v}"
    );
    let m = b.metrics().await;
    assert_eq!(
        metric(&m, &format!(r#"kvroute_sessions{{rule="{RULE_ID}"}}"#)),
        Some(1.0),
        "{m}"
    );
    let (mut a, mut b) = (a, b);
    assert_eq!(a.terminate(), Some(0), "{}", a.stderr());
    assert_eq!(b.terminate(), Some(0), "{}", b.stderr());
}

/// A rule of 1,024 endpoints installed on one replica reaches the other, and a block endpoint
/// 1000 stores (ingested by whichever replica owns its lease) shows in both indexes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_of_1024_endpoints_replicates_past_index_255() {
    const WIDE: &str = "10.0.0.1:8090";
    const WIDE_ID: &str = "10.0.0.1:8090/tcp";
    let redis = Redis::start().unwrap();
    // Endpoint i is 127.1.(i / 250).(i % 250 + 1): endpoint 1000 is 127.1.4.1.
    let mut p = Publisher::bind_on("127.1.4.1", 0).await.unwrap();
    let eps: Vec<(String, u16)> = (0..1024)
        .map(|i| (format!("127.1.{}.{}", i / 250, i % 250 + 1), 9))
        .collect();
    let wide = rule(8090, "vllm", p.port, &eps, json!({}));
    // Nothing serves the endpoints: no health probes; leases long enough not to churn.
    let start = |tag: &str, id: &str| {
        let mut e = env(&redis, id);
        e.push(("KVROUTE_HEALTH_INTERVAL_MS".into(), "0".into()));
        e.retain(|(k, _)| k != "KVROUTE_LEASE_MS");
        e.push(("KVROUTE_LEASE_MS".into(), "5000".into()));
        let refs: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Service::start(tag, &json!([]), &refs)
    };
    let a = start("wide-a", "a");
    let b = start("wide-b", "b");
    let (s, v) = a.post_rule(&wide).await;
    assert_eq!(s, 200, "{v}");
    b.wait_for(
        "the 1024-endpoint rule on the other replica",
        20,
        || async { b.try_inventory(WIDE, 1023).await.is_some() },
    )
    .await;
    let key = 0xD000u64;
    let payload = batch(vec![stored(&[key, key + 1], &[], false)]);
    let seen = wait_until(
        "endpoint 1000's block in both replicas",
        Duration::from_secs(30),
        async || {
            p.send_seq(0, &payload).await;
            for s in [&a, &b] {
                if !s
                    .try_inventory(WIDE, 1000)
                    .await
                    .unwrap_or_default()
                    .contains(&key)
                {
                    return false;
                }
            }
            true
        },
    )
    .await;
    if seen.is_err() {
        panic!("not replicated:\n{}\n-----\n{}", a.stderr(), b.stderr());
    }
    // Exactly one replica ingests endpoint 1000; the other has the block from the log.
    let series = format!(r#"kvroute_replication_lease_owned{{ep="1000",rule="{WIDE_ID}"}}"#);
    let mut owners = Vec::new();
    for (i, s) in [&a, &b].iter().enumerate() {
        if metric(&s.metrics().await, &series) == Some(1.0) {
            owners.push(i);
        }
    }
    assert_eq!(owners.len(), 1, "{owners:?}");
    let other = [&a, &b][1 - owners[0]];
    let mut held = other.inventory(WIDE, 1000).await;
    held.sort_unstable();
    assert_eq!(held, [key, key + 1]);
    let body = json!({"rule": WIDE, "keys": [key, key + 1], "token_count": 32});
    let (s, v) = other.post("/v1/route", &body.to_string(), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["endpoint"].as_str(), v["matched_blocks"].as_u64()),
        (Some("127.1.4.1:9"), Some(2)),
        "{v}"
    );
}
