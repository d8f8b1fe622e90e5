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

    // Match latency percentiles over 20k queries of 512 present keys.
    let mut lat = Vec::with_capacity(20_000);
    let mut out = Vec::new();
    let now = Instant::now();
    for q in 0..20_000u64 {
        let start = (q * 7919) % (KEYS - 512);
        let keys: Vec<BlockKey> = (start..start + 512).map(key).collect();
        let t = Instant::now();
        ix.match_prefix(&keys, now, &mut out);
        lat.push(t.elapsed());
        black_box(&out);
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "match 512 keys vs 1M keys x 16 eps: p50 {:?} p99 {:?} max {:?}",
        pct(0.5),
        pct(0.99),
        lat[lat.len() - 1]
    );
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
