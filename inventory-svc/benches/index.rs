//! Index benches: block events applied per second, 512-key prefix matches against 1M keys x 16
//! endpoints, memory per (key, endpoint) entry at 16 and 1,024 endpoints, and a fleet of 16 to
//! 1,024 endpoints: the 512-key match and the whole route decision (observe, score, commit)
//! through `Fleet::route`, a hit against a miss. Prints the percentiles and memory lines
//! docs/inventory.md and docs/scale.md quote.
//!
//! `KVROUTE_BENCH_REPORT` picks the printed reports (comma-separated: `memory`, `cold`, `wide`,
//! `fleet`; default all; `none` skips them), so a run of one criterion group stays short.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kvroute_core::hash::BlockKey;
use kvroute_inventory::fleet::{Fleet, Origin, Question, RuleRuntime};
use kvroute_inventory::index::{BlockIndex, EndpointId, IndexOp, MemIndex, Rank};
use kvroute_inventory::metrics::Metrics;
use kvroute_inventory::settings::Settings;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const KEYS: u64 = 1_000_000;
const EPS: u64 = 16;

fn key(i: u64) -> BlockKey {
    // Spread like real hashes.
    BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555)
}

/// Endpoint `i` (the id's width is inferred, so this file also builds against a `u8` id).
fn ep(i: u64) -> EndpointId {
    EndpointId(i as _)
}

fn wants(part: &str) -> bool {
    match std::env::var("KVROUTE_BENCH_REPORT") {
        Ok(v) => v.split(',').any(|p| p.trim() == part),
        Err(_) => true,
    }
}

/// 1M distinct keys, every key held by all 16 endpoints (16M entries: the worst case for matching).
fn full_index() -> MemIndex {
    let ix = MemIndex::with_capacity(KEYS as usize);
    let keys: Vec<BlockKey> = (0..KEYS).map(key).collect();
    for e in 0..EPS {
        for chunk in keys.chunks(4096) {
            ix.apply(ep(e), Rank(0), &[IndexOp::Store(chunk.to_vec())]);
        }
    }
    ix
}

fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<usize>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

fn mib(b: usize) -> f64 {
    b as f64 / 1048576.0
}

fn memory_report(ix: &MemIndex, before: usize, after: usize) {
    let entries = KEYS * EPS;
    println!(
        "memory: 1M keys held by all 16 endpoints: heap {:.1} MiB, rss +{:.1} MiB, {:.2} bytes per (key, endpoint) entry",
        mib(ix.heap_bytes()),
        mib(after.saturating_sub(before)),
        ix.heap_bytes() as f64 / entries as f64
    );
    let one = MemIndex::new();
    for i in (0..KEYS).step_by(4096) {
        let ks: Vec<BlockKey> = (i..(i + 4096).min(KEYS)).map(key).collect();
        one.apply(ep(i / 4096 % EPS), Rank(0), &[IndexOp::Store(ks)]);
    }
    println!(
        "memory: 1M keys each held by one of 16 endpoints: heap {:.1} MiB, {:.2} bytes per entry",
        mib(one.heap_bytes()),
        one.heap_bytes() as f64 / KEYS as f64
    );
}

/// Memory per (key, endpoint) at 1,024 endpoints: `keys` keys, key `i` held by `per_key`
/// endpoints starting at `i * stride`.
fn wide_memory(label: &str, keys: u64, per_key: u64, stride: u64) {
    let ix = MemIndex::new();
    // Store in per-endpoint batches as engines do.
    let mut by_ep: Vec<Vec<BlockKey>> = vec![Vec::new(); 1024];
    for i in 0..keys {
        for r in 0..per_key {
            let e = ((i * stride + r) % 1024) as usize;
            by_ep[e].push(key(i));
            if by_ep[e].len() == 4096 {
                ix.apply(
                    ep(e as u64),
                    Rank(0),
                    &[IndexOp::Store(std::mem::take(&mut by_ep[e]))],
                );
            }
        }
    }
    for (e, ks) in by_ep.into_iter().enumerate() {
        ix.apply(ep(e as u64), Rank(0), &[IndexOp::Store(ks)]);
    }
    let stored: u64 = (0..1024).map(|e| ix.block_count(ep(e))).sum();
    if stored != keys * per_key {
        println!("memory at 1024 endpoints: skipped (this build ignores endpoints past 64)");
        return;
    }
    println!(
        "memory: 1024 endpoints, {label}: heap {:.1} MiB, {:.2} bytes per (key, endpoint) entry",
        mib(ix.heap_bytes()),
        ix.heap_bytes() as f64 / stored as f64
    );
}

/// `p50 .. p99 .. max` of the sorted `lat`.
fn percentiles(lat: &[Duration]) -> String {
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    format!(
        "p50 {:?} p99 {:?} max {:?}",
        pct(0.5),
        pct(0.99),
        lat[lat.len() - 1]
    )
}

/// Times `f(q)` for every query `0..n`, `passes` times in the same order; returns the first
/// pass's latencies and the per-query minimum over the passes, both sorted.
fn timed(n: usize, passes: usize, mut f: impl FnMut(usize)) -> (Vec<Duration>, Vec<Duration>) {
    let mut raw = Vec::with_capacity(n);
    let mut best = vec![Duration::MAX; n];
    for pass in 0..passes {
        for (q, b) in best.iter_mut().enumerate() {
            let t = Instant::now();
            f(q);
            let d = t.elapsed();
            if pass == 0 {
                raw.push(d);
            }
            *b = (*b).min(d);
        }
    }
    raw.sort_unstable();
    best.sort_unstable();
    (raw, best)
}

fn cold_report(ix: &MemIndex) {
    // Match latency over 20k queries of 512 present keys at random places (cold caches: the
    // 32 MiB table is the size of this machine's L3). Each query runs once per pass, in the same
    // order, so its cache state is alike in every pass; the per-query minimum over the passes
    // removes interruptions of the virtual CPU, which the calibration below measures on its own.
    const QUERIES: usize = 20_000;
    const PASSES: usize = 5;
    let mut out = Vec::new();
    let now = Instant::now();
    let queries: Vec<Vec<BlockKey>> = (0..QUERIES as u64)
        .map(|q| {
            let start = (q * 7919) % (KEYS - 512);
            (start..start + 512).map(key).collect()
        })
        .collect();
    let (raw, best) = timed(QUERIES, PASSES, |q| {
        ix.match_prefix(&queries[q], now, &mut out);
        black_box(&out);
    });
    let raw_p50 = raw[raw.len() / 2];
    println!(
        "match 512 keys vs 1M keys x 16 eps, cold: {}",
        percentiles(&raw)
    );
    println!(
        "match 512 keys vs 1M keys x 16 eps, cold, per-query min of {PASSES} passes: {}",
        percentiles(&best)
    );
    // Calibration: a fixed computation as long as a cold match's p50, timed the same way. Its
    // tail is the machine's (timer ticks, the hypervisor), not the index's.
    let spin = |n: u64| {
        let mut x = 1u64;
        for i in 0..n {
            x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
        }
        x
    };
    let t = Instant::now();
    black_box(spin(1_000_000));
    let per_iter = t.elapsed().as_secs_f64() / 1e6;
    let iters = (raw_p50.as_secs_f64() / per_iter) as u64;
    let mut fixed = Vec::with_capacity(QUERIES);
    for _ in 0..QUERIES {
        let t = Instant::now();
        black_box(spin(iters));
        fixed.push(t.elapsed());
    }
    fixed.sort_unstable();
    println!("calibration, fixed computation: {}", percentiles(&fixed));
}

/// The fleet workload: `CHAINS` request prefixes of `LEN` keys; the first `SYS` keys of every
/// prefix are one system prompt held by every endpoint, the rest of prefix `c` is held by
/// `REPLICAS` endpoints (`4c .. 4c + 3` modulo the endpoint count). 1M keys in all.
const CHAINS: u64 = 2048;
const LEN: u64 = 512;
const SYS: u64 = 32;
const REPLICAS: u64 = 4;

fn chain(c: u64) -> Vec<BlockKey> {
    (0..LEN)
        .map(|p| {
            if p < SYS {
                key(10_000_000 + p)
            } else {
                key(20_000_000 + c * LEN + p)
            }
        })
        .collect()
}

/// A prefix no endpoint holds (a route miss), the `n`th of its kind.
fn fresh(n: u64) -> Vec<BlockKey> {
    (0..LEN).map(|p| key(1 << 40 | (n * LEN + p))).collect()
}

struct Bench {
    fleet: Arc<Fleet>,
    rule: Arc<RuleRuntime>,
}

/// A fleet with one rule of `n` endpoints fed the workload through `Fleet::apply_ops` (the
/// ingestion path); `None` when this build rejects the rule.
fn fleet(n: u64) -> Option<Bench> {
    // Decisions leave the in-flight estimate at once: load caps stay out of a hit's way.
    let settings = Settings {
        inflight_window: Duration::from_millis(1),
        ..Settings::default()
    };
    let fleet = Arc::new(Fleet::new(
        Arc::new(Metrics::new().unwrap()),
        settings.clone(),
        CancellationToken::new(),
        None,
        |_, _| {},
    ));
    let endpoints: Vec<_> = (0..n).map(endpoint).collect();
    let raw = json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp",
            "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16, "kvEngineType": "vllm"},
        "endpoints": endpoints,
    });
    let spec = match kvroute_inventory::rules::parse_rule(&raw, &settings) {
        Ok(s) => s,
        Err(e) => {
            println!("fleet of {n} endpoints: skipped ({e})");
            return None;
        }
    };
    let rule = fleet.install(spec, Origin::Local).unwrap().rule;
    let sys: Vec<BlockKey> = chain(0)[..SYS as usize].to_vec();
    for e in 0..n {
        fleet.apply_ops(&rule, ep(e), Rank(0), &[IndexOp::Store(sys.clone())]);
    }
    for c in 0..CHAINS {
        let own = chain(c)[SYS as usize..].to_vec();
        for r in 0..REPLICAS {
            let e = (c * REPLICAS + r) % n;
            fleet.apply_ops(&rule, ep(e), Rank(0), &[IndexOp::Store(own.clone())]);
        }
    }
    Some(Bench { fleet, rule })
}

/// Whether this build rejects a rule of `n` endpoints (checked without building the fleet).
fn fleet_rejected(n: u64) -> bool {
    let endpoints: Vec<_> = (0..n).map(endpoint).collect();
    let raw = json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp",
            "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16, "kvEngineType": "vllm"},
        "endpoints": endpoints,
    });
    kvroute_inventory::rules::parse_rule(&raw, &Settings::default()).is_err()
}

fn endpoint(i: u64) -> serde_json::Value {
    json!({"endpointIP": format!("10.1.{}.{}", i / 250, i % 250 + 1), "targetPort": 8000})
}

impl Bench {
    fn question<'a>(keys: &'a [BlockKey]) -> Question<'a> {
        Question {
            keys,
            token_count: (keys.len() * 16) as u32,
            affinity_key: None,
            model: None,
            session: None,
            explain: false,
            only: None,
        }
    }

    fn route(&self, keys: &[BlockKey]) {
        let r = self
            .fleet
            .route(&self.rule, &Bench::question(keys), Instant::now());
        black_box(r.map(|r| r.ep).ok());
    }
}

fn fleet_report() {
    const QUERIES: usize = 20_000;
    const PASSES: usize = 5;
    for n in [16u64, 64, 256, 1024] {
        let Some(b) = fleet(n) else { continue };
        let queries: Vec<Vec<BlockKey>> = (0..QUERIES as u64)
            .map(|q| chain((q * 7919) % CHAINS))
            .collect();
        let now = Instant::now();
        let m = b.rule.match_prefix(&queries[0], now);
        let full = m.iter().filter(|&&x| x == LEN as u32).count();
        let (raw, best) = timed(QUERIES, PASSES, |q| {
            black_box(b.rule.match_prefix(&queries[q], now));
        });
        println!(
            "fleet {n} eps, match 512 keys (held fully by {full}), raw: {}; per-query min of {PASSES}: {}",
            percentiles(&raw),
            percentiles(&best)
        );
        let (raw, best) = timed(QUERIES, PASSES, |q| b.route(&queries[q]));
        println!(
            "fleet {n} eps, route decision (hit), raw: {}; per-query min of {PASSES}: {}",
            percentiles(&raw),
            percentiles(&best)
        );
        // Misses: every query a new prefix, so each credits its 512 keys.
        let misses: Vec<Vec<BlockKey>> = (0..QUERIES as u64).map(fresh).collect();
        let (raw, _) = timed(QUERIES, 1, |q| b.route(&misses[q]));
        println!(
            "fleet {n} eps, route decision (miss, a new prefix each), raw: {}",
            percentiles(&raw)
        );
    }
}

fn report() {
    if wants("memory") || wants("cold") {
        let before = rss_bytes();
        let ix = full_index();
        let after = rss_bytes();
        if wants("memory") {
            memory_report(&ix, before, after);
        }
        if wants("cold") {
            cold_report(&ix);
        }
    }
    if wants("wide") {
        wide_memory("1M keys each held by one endpoint", KEYS, 1, 1);
        wide_memory("1M keys each held by 4 endpoints", KEYS, 4, 4);
        wide_memory(
            "1M keys each held by 7 endpoints (the first overflow size)",
            KEYS,
            7,
            7,
        );
        wide_memory("64k keys held by all 1024 endpoints", 65_536, 1024, 0);
    }
    if wants("fleet") {
        fleet_report();
    }
}

fn events(c: &mut Criterion) {
    // Built on first use: a run filtered to other groups does not pay for it.
    let ix = std::cell::OnceCell::new();
    let mut g = c.benchmark_group("index_events");
    for batch in [1u64, 16, 256] {
        g.throughput(Throughput::Elements(2 * batch));
        let mut next = KEYS;
        g.bench_with_input(
            BenchmarkId::new("store_then_remove", batch),
            &batch,
            |b, &n| {
                let ix = ix.get_or_init(full_index);
                b.iter(|| {
                    let ks: Vec<BlockKey> = (next..next + n).map(key).collect();
                    next += n;
                    let e = ep(next % EPS);
                    ix.apply(e, Rank(0), &[IndexOp::Store(ks.clone())]);
                    ix.apply(e, Rank(0), &[IndexOp::Remove(ks)]);
                })
            },
        );
    }
    g.finish();
}

fn matching(c: &mut Criterion) {
    let ix = std::cell::OnceCell::new();
    let mut g = c.benchmark_group("index_match");
    g.throughput(Throughput::Elements(512));
    let now = Instant::now();
    let present: Vec<BlockKey> = (1000..1512).map(key).collect();
    let absent: Vec<BlockKey> = (KEYS + 10..KEYS + 522).map(key).collect();
    let mut out = Vec::new();
    g.bench_function("512_present_1M_x16", |b| {
        let ix = ix.get_or_init(full_index);
        b.iter(|| ix.match_prefix(black_box(&present), now, &mut out))
    });
    g.bench_function("512_absent_1M_x16", |b| {
        let ix = ix.get_or_init(full_index);
        b.iter(|| ix.match_prefix(black_box(&absent), now, &mut out))
    });
    // With speculative credits live (the table is consulted per key).
    g.bench_function("512_present_with_spec", |b| {
        let ix = ix.get_or_init(full_index);
        ix.speculate(ep(3), &present[..64], now, Duration::from_secs(3600));
        b.iter(|| ix.match_prefix(black_box(&present), now, &mut out))
    });
    g.finish();
}

/// The whole decision through `Fleet::route` (observe, score, commit), a hit (every key held by
/// 4 endpoints) against a miss (a new prefix each time: the chosen endpoint is credited with
/// all 512 keys), and the 512-key match alone, at 16, 256 and 1,024 endpoints.
fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("fleet");
    for n in [16u64, 256, 1024] {
        let built = std::cell::OnceCell::new();
        let get = || built.get_or_init(|| fleet(n)).as_ref();
        if n > 64 && fleet_rejected(n) {
            println!("fleet of {n} endpoints: skipped (rule rejected by this build)");
            continue;
        }
        let now = Instant::now();
        let mut i = 0u64;
        g.bench_with_input(BenchmarkId::new("match_512", n), &n, |bch, _| {
            let Some(b) = get() else { return };
            bch.iter(|| {
                i += 1;
                black_box(b.rule.match_prefix(&chain(i % CHAINS), now))
            })
        });
        g.bench_with_input(BenchmarkId::new("route_hit_512", n), &n, |bch, _| {
            let Some(b) = get() else { return };
            bch.iter(|| {
                i += 1;
                b.route(&chain(i % CHAINS))
            })
        });
        g.bench_with_input(BenchmarkId::new("route_miss_512", n), &n, |bch, _| {
            let Some(b) = get() else { return };
            bch.iter(|| {
                i += 1;
                b.route(&fresh(i))
            })
        });
    }
    g.finish();
}

fn main() {
    report();
    let mut c = Criterion::default().configure_from_args();
    events(&mut c);
    matching(&mut c);
    decisions(&mut c);
    c.final_summary();
}
