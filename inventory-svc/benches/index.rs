//! Index benches: block events applied per second, and 512-key prefix matches against 1M keys x
//! 16 endpoints. Also prints match latency percentiles and bytes per (key, endpoint) entry, the
//! numbers docs/inventory.md quotes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kvroute_core::hash::BlockKey;
use kvroute_inventory::index::{BlockIndex, EndpointId, IndexOp, MemIndex, Rank};

const KEYS: u64 = 1_000_000;
const EPS: u8 = 16;

fn key(i: u64) -> BlockKey {
    // Spread like real hashes.
    BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555)
}

/// 1M distinct keys, every key held by all 16 endpoints (16M entries: the worst case for matching).
fn full_index() -> MemIndex {
    let ix = MemIndex::with_capacity(KEYS as usize);
    let keys: Vec<BlockKey> = (0..KEYS).map(key).collect();
    for ep in 0..EPS {
        for chunk in keys.chunks(4096) {
            ix.apply(EndpointId(ep), Rank(0), &[IndexOp::Store(chunk.to_vec())]);
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

fn report() {
    // Memory, two layouts of "1M keys x 16 endpoints".
    let before = rss_bytes();
    let ix = full_index();
    let after = rss_bytes();
    let entries = KEYS * u64::from(EPS);
    println!(
        "memory: 1M keys held by all 16 endpoints: heap {:.1} MiB, rss +{:.1} MiB, {:.2} bytes per (key, endpoint) entry",
        ix.heap_bytes() as f64 / 1048576.0,
        after.saturating_sub(before) as f64 / 1048576.0,
        ix.heap_bytes() as f64 / entries as f64
    );
    let one = MemIndex::new();
    for i in 0..KEYS {
        if i % 4096 == 0 {
            let ks: Vec<BlockKey> = (i..(i + 4096).min(KEYS)).map(key).collect();
            one.apply(
                EndpointId((i / 4096 % u64::from(EPS)) as u8),
                Rank(0),
                &[IndexOp::Store(ks)],
            );
        }
    }
    println!(
        "memory: 1M keys each held by one of 16 endpoints: heap {:.1} MiB, {:.2} bytes per entry",
        one.heap_bytes() as f64 / 1048576.0,
        one.heap_bytes() as f64 / KEYS as f64
    );
    drop(one);

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
    let mut raw: Vec<Duration> = Vec::with_capacity(QUERIES);
    let mut best = vec![Duration::MAX; QUERIES];
    for pass in 0..PASSES {
        for (q, keys) in queries.iter().enumerate() {
            let t = Instant::now();
            ix.match_prefix(keys, now, &mut out);
            let d = t.elapsed();
            black_box(&out);
            if pass == 0 {
                raw.push(d);
            }
            best[q] = best[q].min(d);
        }
    }
    raw.sort_unstable();
    best.sort_unstable();
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

fn events(c: &mut Criterion) {
    let ix = full_index();
    let mut g = c.benchmark_group("index_events");
    for batch in [1u64, 16, 256] {
        g.throughput(Throughput::Elements(2 * batch));
        let mut next = KEYS;
        g.bench_with_input(
            BenchmarkId::new("store_then_remove", batch),
            &batch,
            |b, &n| {
                b.iter(|| {
                    let ks: Vec<BlockKey> = (next..next + n).map(key).collect();
                    next += n;
                    let ep = EndpointId((next % u64::from(EPS)) as u8);
                    ix.apply(ep, Rank(0), &[IndexOp::Store(ks.clone())]);
                    ix.apply(ep, Rank(0), &[IndexOp::Remove(ks)]);
                })
            },
        );
    }
    g.finish();
}

fn matching(c: &mut Criterion) {
    let ix = full_index();
    let mut g = c.benchmark_group("index_match");
    g.throughput(Throughput::Elements(512));
    let now = Instant::now();
    let present: Vec<BlockKey> = (1000..1512).map(key).collect();
    let absent: Vec<BlockKey> = (KEYS + 10..KEYS + 522).map(key).collect();
    let mut out = Vec::new();
    g.bench_function("512_present_1M_x16", |b| {
        b.iter(|| ix.match_prefix(black_box(&present), now, &mut out))
    });
    g.bench_function("512_absent_1M_x16", |b| {
        b.iter(|| ix.match_prefix(black_box(&absent), now, &mut out))
    });
    // With speculative credits live (the table is consulted per key).
    ix.speculate(
        EndpointId(3),
        &present[..64],
        now,
        Duration::from_secs(3600),
    );
    g.bench_function("512_present_with_spec", |b| {
        b.iter(|| ix.match_prefix(black_box(&present), now, &mut out))
    });
    g.finish();
}

fn main() {
    report();
    let mut c = Criterion::default().configure_from_args();
    events(&mut c);
    matching(&mut c);
    c.final_summary();
}
