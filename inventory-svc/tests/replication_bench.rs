//! Replication benchmark (ignored; `scripts/bench-replication.sh` runs it in release and writes
//! docs/bench-replication.md): route queries/s on one replica standalone vs replicated, block
//! events/s through the replication log, replication lag (`kvroute_replication_lag_seconds` of
//! every replica during that load), and bootstrap time of a late replica for 1M keys; then the
//! replicated load again through a Redis Cluster (3 primaries + 3 replicas).
//! Measurements, not assertions: only correctness (counts reached) is checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{batch, bind_same_port, cpu_secs, metric, rule, stored, Publisher, Redis, Service};
use kvroute_test_support::RedisCluster;
use serde_json::{json, Value};

const RULE: &str = "10.0.0.1:8080";
const RULE_ID: &str = "10.0.0.1:8080/tcp";
const IPS: [&str; 2] = ["127.0.0.71", "127.0.0.72"];

fn n(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn publishers() -> (Vec<Publisher>, Value) {
    let (ps, port) = bind_same_port(&IPS, 40000).await;
    let eps: Vec<(String, u16)> = IPS.iter().map(|ip| (ip.to_string(), 9)).collect();
    let r = rule(8080, "vllm", port, &eps, json!({}));
    (ps, json!([r]))
}

/// The service's Redis variables for a single server.
fn single(r: &Redis) -> Vec<(String, String)> {
    vec![("KVROUTE_REDIS_URL".into(), r.url())]
}

/// The service's Redis variables for a cluster (every node a seed).
fn cluster(c: &RedisCluster) -> Vec<(String, String)> {
    vec![
        ("KVROUTE_REDIS_URL".into(), c.urls()),
        ("KVROUTE_REDIS_MODE".into(), "cluster".into()),
    ]
}

fn start(tag: &str, rules: &Value, redis: Option<&[(String, String)]>, id: &str) -> Service {
    let mut env: Vec<(String, String)> = vec![
        ("KVROUTE_SPEC_TTL_MS".into(), "2000".into()),
        (
            "RUST_LOG".into(),
            std::env::var("KVROUTE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        ),
    ];
    if let Some(r) = redis {
        env.extend(r.iter().cloned());
        env.push(("KVROUTE_REPLICA_ID".into(), id.into()));
        env.push(("KVROUTE_LEASE_MS".into(), "2000".into()));
        env.push(("KVROUTE_SNAPSHOT_INTERVAL_MS".into(), "2000".into()));
        env.push(("KVROUTE_STREAM_MAXLEN".into(), "1000000".into()));
    }
    let refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Service::start(tag, rules, &refs)
}

async fn blocks(svc: &Service, ep: usize) -> u64 {
    let m = svc.metrics().await;
    metric(
        &m,
        &format!(r#"kvroute_index_blocks{{ep="{ep}",rule="{RULE_ID}"}}"#),
    )
    .unwrap_or(0.0) as u64
}

async fn wait_blocks(svc: &Service, ep: usize, want: u64, secs: u64) -> Duration {
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    while blocks(svc, ep).await < want {
        assert!(
            Instant::now() < end,
            "endpoint {ep} stuck at {} of {want} blocks\n{}",
            blocks(svc, ep).await,
            svc.stderr()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    t0.elapsed()
}

/// Publishes `batches` batches of `per` fresh keys on `p` (keys start at `base`), in windows of
/// 50 batches that `owner` must have applied before the next: a ZMQ PUB drops what a slow
/// subscriber has not taken (like an engine would), and a dropped batch is a gap, not a benchmark.
async fn publish(owner: &Service, ep: usize, p: &mut Publisher, base: u64, batches: u64, per: u64) {
    let start = blocks(owner, ep).await;
    for b in 0..batches {
        let keys: Vec<u64> = (0..per).map(|i| base + b * per + i).collect();
        p.send(&batch(vec![stored(&keys, &[], false)])).await;
        if (b + 1) % 50 == 0 || b + 1 == batches {
            wait_blocks(owner, ep, start + (b + 1) * per, 120).await;
        }
    }
}

/// The replica whose subscriber for endpoint `ep` is connected (the lease holder), bounded wait.
async fn owner_of(reps: &[Service], ep: usize) -> usize {
    let series =
        format!(r#"kvroute_ingest_subscriber_connected{{ep="{ep}",rank="0",rule="{RULE_ID}"}}"#);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        for (i, r) in reps.iter().enumerate() {
            if metric(&r.metrics().await, &series) == Some(1.0) {
                return i;
            }
        }
        assert!(Instant::now() < end, "no owner of endpoint {ep}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Makes sure the owner's subscription is live: a probe until `svc` shows it.
async fn probe(svc: &Service, p: &mut Publisher, ep: usize, key: u64) {
    let end = Instant::now() + Duration::from_secs(30);
    while !svc.inventory(RULE, ep).await.contains(&key) {
        assert!(Instant::now() < end, "no subscriber\n{}", svc.stderr());
        p.send(&batch(vec![stored(&[key], &[], false)])).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Runs `route_qps` and returns (queries/s, CPU microseconds per query of `svc`, of `others`).
async fn measured(svc: &Service, others: &[&Service], conc: usize, secs: f64) -> (f64, f64, f64) {
    let c0 = cpu_secs(svc);
    let o0: f64 = others.iter().map(|o| cpu_secs(o)).sum();
    let qps = route_qps(svc, conc, secs).await;
    let n = qps * secs;
    let c = (cpu_secs(svc) - c0) / n * 1e6;
    let o = (others.iter().map(|o| cpu_secs(o)).sum::<f64>() - o0) / n * 1e6;
    (qps, c, o)
}

/// Route queries/s against `svc` for `secs` with `conc` concurrent clients (64-key queries).
async fn route_qps(svc: &Service, conc: usize, secs: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for c in 0..conc {
        let http = svc.http.clone();
        let url = format!("{}/v1/route", svc.base);
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < end {
                let start = (c as u64 * 7919 + i * 64) % 50_000;
                let keys: Vec<u64> = (start..start + 64).collect();
                let body = json!({"rule": RULE, "keys": keys, "token_count": 1024}).to_string();
                let r = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_success());
                let _ = r.bytes().await;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / secs
}

/// Cumulative bucket counts of `kvroute_replication_lag_seconds` summed over `reps`, by `le`.
async fn lag_buckets(reps: &[Service]) -> Vec<(f64, f64)> {
    let mut sum: Vec<(f64, f64)> = Vec::new();
    for r in reps {
        let m = r.metrics().await;
        for l in m.lines() {
            let Some(rest) = l.strip_prefix(r#"kvroute_replication_lag_seconds_bucket{le=""#)
            else {
                continue;
            };
            let Some((le, count)) = rest.split_once(r#""} "#) else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            let count: f64 = count.trim().parse().unwrap();
            match sum.iter_mut().find(|(b, _)| *b == le) {
                Some((_, c)) => *c += count,
                None => sum.push((le, count)),
            }
        }
    }
    sum.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    sum
}

/// The `q` quantile in ms of the observations between two bucket readings, interpolated within
/// its bucket as Prometheus' `histogram_quantile` does; and the number of observations.
fn lag_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> (f64, u64) {
    let d: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            let b = before.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1);
            (*le, c - b)
        })
        .collect();
    let total = d.last().map_or(0.0, |x| x.1);
    if total == 0.0 {
        return (f64::NAN, 0);
    }
    let rank = q * total;
    let mut lo = (0.0, 0.0);
    for &(le, c) in &d {
        if c >= rank {
            if le.is_infinite() {
                return (lo.0 * 1e3, total as u64);
            }
            let frac = if c > lo.1 {
                (rank - lo.1) / (c - lo.1)
            } else {
                1.0
            };
            return ((lo.0 + (le - lo.0) * frac) * 1e3, total as u64);
        }
        lo = (le, c);
    }
    (lo.0 * 1e3, total as u64)
}

/// What the replicated phases measure.
struct Replicated {
    qps_repl: f64,
    cpu_repl: f64,
    cpu_apply: f64,
    qps_owner: f64,
    events_s: f64,
    total: u64,
    lag_p50: f64,
    lag_p99: f64,
    lag_n: u64,
}

/// Three replicas loaded with 50k blocks on endpoint 0: route queries on a non-owner (its
/// decisions replicated to the two others), then on the owner, then block events streamed
/// through the owner until a non-owner holds them. Lag is every replica's histogram over all of it.
async fn replicated_phases(
    reps: &[Service],
    pubs: &mut [Publisher],
    conc: usize,
    secs: f64,
    stream_batches: u64,
) -> Replicated {
    let owner_ep0 = owner_of(reps, 0).await;
    probe(&reps[owner_ep0], &mut pubs[0], 0, 1 << 50).await;
    publish(&reps[owner_ep0], 0, &mut pubs[0], 0, 50, 1000).await;
    for r in reps {
        wait_blocks(r, 0, 50_000, 60).await;
    }
    let lag0 = lag_buckets(reps).await;
    let target = (owner_ep0 + 1) % reps.len();
    let others: Vec<&Service> = reps
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != target)
        .map(|(_, r)| r)
        .collect();
    let (qps_repl, cpu_repl, cpu_apply) = measured(&reps[target], &others, conc, secs).await;
    if std::env::var("KVROUTE_BENCH_DEBUG").is_ok() {
        let m = reps[target].metrics().await;
        for l in m.lines().filter(|l| {
            l.contains("replication") || l.contains("redis") || l.contains("route_duration")
        }) {
            println!("target: {l}");
        }
    }
    let qps_owner = route_qps(&reps[owner_ep0], conc, secs).await;

    let per = 64u64;
    let before = blocks(&reps[target], 0).await;
    let total = stream_batches * per;
    let t0 = Instant::now();
    publish(
        &reps[owner_ep0],
        0,
        &mut pubs[0],
        10_000_000,
        stream_batches,
        per,
    )
    .await;
    wait_blocks(&reps[target], 0, before + total, 120).await;
    let stream_s = t0.elapsed().as_secs_f64();
    let lag1 = lag_buckets(reps).await;
    if std::env::var("KVROUTE_BENCH_DEBUG").is_ok() {
        println!("lag buckets before {lag0:?}\nafter {lag1:?}");
    }
    let (lag_p50, lag_n) = lag_quantile(&lag0, &lag1, 0.5);
    let (lag_p99, _) = lag_quantile(&lag0, &lag1, 0.99);
    println!(
        "replicated: non-owner {qps_repl:.0} q/s, owner {qps_owner:.0} q/s; {:.0} block events/s; lag p50 {lag_p50:.2} ms p99 {lag_p99:.2} ms ({lag_n} entries)",
        total as f64 / stream_s
    );
    Replicated {
        qps_repl,
        cpu_repl,
        cpu_apply,
        qps_owner,
        events_s: total as f64 / stream_s,
        total,
        lag_p50,
        lag_p99,
        lag_n,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: scripts/bench-replication.sh"]
async fn replication_benchmark() {
    let secs = n("KVROUTE_BENCH_SECS", 5) as f64;
    let conc = n("KVROUTE_BENCH_CONC", 8) as usize;
    let boot_keys = n("KVROUTE_BENCH_BOOT_KEYS", 1_000_000);
    let stream_batches = n("KVROUTE_BENCH_BATCHES", 2000);
    let mut out = String::new();

    // 1. Route queries/s on one replica: standalone vs one of three replicas sharing Redis.
    let (mut pubs, rules) = publishers().await;
    let solo = start("bench-solo", &rules, None, "solo");
    probe(&solo, &mut pubs[0], 0, 1 << 50).await;
    publish(&solo, 0, &mut pubs[0], 0, 50, 1000).await;
    wait_blocks(&solo, 0, 50_000, 60).await;
    let (qps_solo, cpu_solo, _) = measured(&solo, &[], conc, secs).await;
    println!("standalone: {qps_solo:.0} q/s, {cpu_solo:.1} us CPU/query");
    drop(solo);
    drop(pubs);

    let redis = Redis::start().unwrap();
    let env = single(&redis);
    let (mut pubs, rules) = publishers().await;
    let reps: Vec<Service> = ["a", "b", "c"]
        .iter()
        .map(|id| start(&format!("bench-{id}"), &rules, Some(&env), id))
        .collect();
    // 2. Replicated: route queries/s, replication throughput and lag.
    let r = replicated_phases(&reps, &mut pubs, conc, secs, stream_batches).await;
    let Replicated {
        qps_repl,
        cpu_repl,
        cpu_apply,
        qps_owner,
        total,
        ..
    } = r;

    // 3. Bootstrap: 1M keys on endpoint 1, snapshotted; a late replica starts and loads them.
    let owner_ep1 = owner_of(&reps, 1).await;
    probe(&reps[owner_ep1], &mut pubs[1], 1, 1 << 40).await;
    publish(
        &reps[owner_ep1],
        1,
        &mut pubs[1],
        1 << 41,
        boot_keys / 1000,
        1000,
    )
    .await;
    wait_blocks(&reps[owner_ep1], 1, boot_keys + 1, 300).await;
    // Wait for a snapshot written after the last key (the snapshot interval is 2 s).
    let written = |m: &str| metric(m, "kvroute_replication_snapshots_written_total").unwrap_or(0.0);
    let w0 = written(&reps[owner_ep1].metrics().await);
    let end = Instant::now() + Duration::from_secs(30);
    while written(&reps[owner_ep1].metrics().await) < w0 + 2.0 {
        assert!(Instant::now() < end, "no snapshot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let snap_bytes = metric(
        &reps[owner_ep1].metrics().await,
        &format!(r#"kvroute_replication_snapshot_bytes{{ep="1",rule="{RULE_ID}"}}"#),
    )
    .unwrap_or(0.0);
    let t0 = Instant::now();
    let late = start("bench-late", &json!([]), Some(&env), "late");
    let started = t0.elapsed();
    wait_blocks(&late, 1, boot_keys + 1, 300).await;
    let boot = t0.elapsed();

    let _ = writeln!(
        out,
        "| measure | value |\n|---|---|\n\
         | route queries/s, standalone (64-key queries, {conc} clients) | {qps_solo:.0} |\n\
         | route queries/s, replicated, non-owner replica | {qps_repl:.0} ({:+.1}%) |\n\
         | CPU per route query on the replica answering it: standalone / replicated | {cpu_solo:.1} us / {cpu_repl:.1} us ({:+.1}%) |\n\
         | CPU per route query spent by the two other replicas applying its decision | {cpu_apply:.1} us (both together) |\n\
         | route queries/s, replicated, owner replica | {qps_owner:.0} ({:+.1}%) |\n\
         | replication throughput, owner ingest -> non-owner index ({total} block events in {stream_batches} batches) | {:.0} block events/s |\n\
         | replication lag, entry age when another replica applies it (`kvroute_replication_lag_seconds` of the three replicas over the route and streaming load, {} entries): p50 / p99 | {:.2} ms / **{:.2} ms** |\n\
         | bootstrap of a late replica, {boot_keys} keys (snapshot {:.1} MB) | {:.2} s (process up in {:.2} s) |",
        (qps_repl / qps_solo - 1.0) * 100.0,
        (cpu_repl / cpu_solo - 1.0) * 100.0,
        (qps_owner / qps_solo - 1.0) * 100.0,
        r.events_s,
        r.lag_n,
        r.lag_p50,
        r.lag_p99,
        snap_bytes / 1e6,
        boot.as_secs_f64(),
        started.as_secs_f64(),
    );
    if std::env::var("KVROUTE_BENCH_DEBUG").is_ok() {
        println!("{}", late.stderr());
    }
    drop(late);
    drop(reps);
    drop(pubs);
    drop(redis);

    // 4. The replicated load again, through a Redis Cluster (3 primaries + 3 replicas).
    let c = RedisCluster::start(3, 5000).unwrap();
    let env = cluster(&c);
    let (mut pubs, rules) = publishers().await;
    let reps: Vec<Service> = ["a", "b", "c"]
        .iter()
        .map(|id| start(&format!("bench-cl-{id}"), &rules, Some(&env), id))
        .collect();
    let rc = replicated_phases(&reps, &mut pubs, conc, secs, stream_batches).await;
    let _ = writeln!(
        out,
        "\nThe replicated rows again through a Redis Cluster (3 primaries + 3 replicas, every node a \
         `redis-server` on this machine, `KVROUTE_REDIS_MODE=cluster`):\n\n\
         | measure | single redis-server | Redis Cluster |\n|---|---|---|\n\
         | route queries/s, replicated, non-owner replica | {:.0} | {:.0} |\n\
         | route queries/s, replicated, owner replica | {:.0} | {:.0} |\n\
         | replication throughput, owner ingest -> non-owner index | {:.0} block events/s | {:.0} block events/s |\n\
         | replication lag p50 / p99 ({} / {} entries) | {:.2} / **{:.2} ms** | {:.2} / **{:.2} ms** |",
        r.qps_repl,
        rc.qps_repl,
        r.qps_owner,
        rc.qps_owner,
        r.events_s,
        rc.events_s,
        r.lag_n,
        rc.lag_n,
        r.lag_p50,
        r.lag_p99,
        rc.lag_p50,
        rc.lag_p99,
    );
    drop(reps);
    drop(c);
    println!("{out}");
    if let Ok(path) = std::env::var("KVROUTE_BENCH_OUT") {
        std::fs::write(path, &out).unwrap();
    }
}
