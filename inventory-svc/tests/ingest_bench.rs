//! Ingestion benchmark (ignored; `scripts/bench-ingest.sh` runs it in release and writes
//! docs/bench-ingest.md): one real ZMQ publisher per endpoint on loopback (each at its own
//! `kvZmqEndpoint`), the service subscribed to all of them, block events pushed through the
//! real path (decode, key, apply). Reports events/s, the service's CPU per event, and the lag
//! from a window's last publish to its last event in the index, for every endpoint and with one
//! hot publisher sending ten times the others' volume (does one backlog delay the rest?).
//! Measurements, not assertions: only correctness (counts reached) is checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use common::{batch, cpu_secs, metric, pid_cpu_secs, rule, stored, Publisher, Service};
use kvroute_test_support::machine;
use serde_json::json;

const RULE_ID: &str = "10.0.0.1:8080/tcp";

/// Keys per BlockStored message.
const PER: u64 = 16;

fn env_list(var: &str, default: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn n(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Blocks per endpoint from one `/metrics` read.
async fn blocks(svc: &Service, eps: usize) -> Vec<u64> {
    let m = svc.metrics().await;
    (0..eps)
        .map(|ep| {
            metric(
                &m,
                &format!(r#"kvroute_index_blocks{{ep="{ep}",rule="{RULE_ID}"}}"#),
            )
            .unwrap_or(0.0) as u64
        })
        .collect()
}

/// Polls until every endpoint `i` holds at least `want[i]` blocks; returns when each endpoint
/// got there (relative to `t0`), bounded.
///
/// The test's PUB (the `zeromq` crate) flushes what a full socket left in its buffer only on its
/// next send, so a publisher still short gets an empty batch (no events) now and then: without
/// it the end of a burst could sit in the bench's own buffer, which is not the service's lag.
async fn wait_all(
    svc: &Service,
    pubs: &mut [Publisher],
    want: &[u64],
    t0: Instant,
    secs: u64,
) -> Vec<Duration> {
    let end = Instant::now() + Duration::from_secs(secs);
    let mut done: Vec<Option<Duration>> = vec![None; want.len()];
    loop {
        let have = blocks(svc, want.len()).await;
        let now = t0.elapsed();
        for (i, d) in done.iter_mut().enumerate() {
            if d.is_none() && have[i] >= want[i] {
                *d = Some(now);
            }
        }
        if done.iter().all(Option::is_some) {
            return done.into_iter().flatten().collect();
        }
        let short: Vec<usize> = (0..want.len()).filter(|&i| done[i].is_none()).collect();
        assert!(
            Instant::now() < end,
            "endpoints {:?} short of their blocks: have {:?}, want {:?}\n{}",
            &short[..short.len().min(8)],
            &have[..have.len().min(8)],
            &want[..want.len().min(8)],
            svc.stderr()
        );
        for &i in &short {
            pubs[i].send(&batch(vec![])).await;
        }
        // A scrape of a large fleet's /metrics is itself work for the service: poll it less often.
        tokio::time::sleep(poll_interval(want.len())).await;
    }
}

/// How often the index is polled: 2 ms, and 1 ms more per 64 endpoints.
fn poll_interval(eps: usize) -> Duration {
    Duration::from_millis(2 + eps as u64 / 64)
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// One fleet size's figures.
struct Row {
    eps: usize,
    windows: u64,
    events: u64,
    secs: f64,
    cpu: f64,
    /// CPU of the bench process itself (publishers and polling).
    bench_cpu: f64,
    lag: Vec<f64>,
    hot_lag: Vec<f64>,
    cold_lag: Vec<f64>,
}

async fn run_fleet(eps: usize, windows: u64, per_window: u64) -> Row {
    let mut pubs = Vec::with_capacity(eps);
    for _ in 0..eps {
        pubs.push(Publisher::bind(0).await.unwrap());
    }
    let targets: Vec<(String, u16)> = (0..eps)
        .map(|i| ("127.0.0.1".to_owned(), 10_000 + i as u16))
        .collect();
    let mut r = rule(8080, "vllm", 5557, &targets, json!({}));
    for (i, p) in pubs.iter().enumerate() {
        r["endpoints"][i]["kvZmqEndpoint"] = json!(format!("tcp://127.0.0.1:{}", p.port));
    }
    let svc = Service::start(
        &format!("ingest-bench-{eps}"),
        &json!([r]),
        &[("RUST_LOG", "warn")],
    );
    // Subscribed: every publisher sends a probe block each round until every endpoint holds one.
    let end = Instant::now() + Duration::from_secs(120);
    let mut probe = 1u64 << 40;
    loop {
        let have = blocks(&svc, eps).await;
        if have.iter().all(|&b| b >= 1) {
            break;
        }
        assert!(
            Instant::now() < end,
            "not every endpoint subscribed\n{}",
            svc.stderr()
        );
        for (i, p) in pubs.iter_mut().enumerate() {
            if have[i] == 0 {
                probe += 1;
                p.send(&batch(vec![stored(&[probe], &[], false)])).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut expect = blocks(&svc, eps).await;
    let (mut events, mut lag, mut hot_lag, mut cold_lag) = (0u64, vec![], vec![], vec![]);
    let (c0, b0, t0) = (
        cpu_secs(&svc),
        pid_cpu_secs(std::process::id()),
        Instant::now(),
    );
    let mut next_key = 1u64;
    for w in 0..windows {
        // Odd windows: endpoint 0 is hot (ten times the batches of every other endpoint).
        let hot = w % 2 == 1;
        let ws = Instant::now();
        for b in 0..per_window * if hot { 10 } else { 1 } {
            for (i, p) in pubs.iter_mut().enumerate() {
                if b >= per_window && i != 0 {
                    continue;
                }
                let keys: Vec<u64> = (0..PER).map(|k| next_key + k).collect();
                next_key += PER;
                p.send(&batch(vec![stored(&keys, &[], false)])).await;
                expect[i] += PER;
                events += PER;
            }
        }
        let sent = ws.elapsed();
        let at = wait_all(&svc, &mut pubs, &expect, ws, 60).await;
        let lags: Vec<f64> = at
            .iter()
            .map(|d| d.saturating_sub(sent).as_secs_f64() * 1e3)
            .collect();
        let worst = lags.iter().copied().fold(0.0, f64::max);
        if hot {
            hot_lag.push(lags[0]);
            cold_lag.push(lags[1..].iter().copied().fold(0.0, f64::max));
        } else {
            lag.push(worst);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_secs(&svc) - c0;
    let bench_cpu = pid_cpu_secs(std::process::id()) - b0;
    for v in [&mut lag, &mut hot_lag, &mut cold_lag] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    Row {
        eps,
        windows,
        events,
        secs,
        cpu,
        bench_cpu,
        lag,
        hot_lag,
        cold_lag,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench-ingest.sh"]
async fn bench_ingest_publishers() {
    let sizes = env_list("KVROUTE_BENCH_ENDPOINTS", "16,256,1024");
    let min_windows = n("KVROUTE_BENCH_WINDOWS", 20);
    // Batches per endpoint per window: the hot publisher's ten times that (~190 bytes each) stay
    // under the test PUB's 128 KiB send buffer, past which it drops (a dropped batch is a gap,
    // not a benchmark).
    let per_window = n("KVROUTE_BENCH_BATCHES", 50);
    // Small fleets run more windows, so that every size ingests at least this many events.
    let min_events = n("KVROUTE_BENCH_MIN_EVENTS", 2_000_000);
    let mut rows = Vec::new();
    for eps in sizes {
        let per_cold_window = (eps as u64 * per_window * PER).max(1);
        let windows = min_windows.max(min_events.div_ceil(per_cold_window));
        let r = run_fleet(eps, windows, per_window).await;
        eprintln!(
            "{eps:>5} publishers: {} events in {:.2} s = {:.0}/s, service CPU {:.2} s",
            r.events,
            r.secs,
            r.events as f64 / r.secs,
            r.cpu
        );
        rows.push(r);
    }
    let mut md = String::new();
    md.push_str("# Ingestion benchmark\n\n");
    md.push_str(
        "Generated by `scripts/bench-ingest.sh` (inventory-svc/tests/ingest_bench.rs, release build). One real\n\
         ZMQ PUB per endpoint on 127.0.0.1, each at its own `kvZmqEndpoint`; the service subscribes to all of\n\
         them and every event goes through the real path (frame split, msgpack decode, keying, index apply).\n\
         Each message is one vLLM `BlockStored` of 16 fresh keys (no token ids). The publishers run in the\n\
         benchmark process on the same cores as the service. Windows: every publisher sends its batches,\n\
         then the bench waits until the index holds them all (a ZMQ PUB drops what a slow subscriber has not\n\
         taken, and a dropped batch would be a gap); every other window endpoint 0 is hot and sends ten\n\
         times the batches. **lag** = last publish of a window to the last of its events visible in the\n\
         index (`kvroute_index_blocks`, polled every 2 ms plus 1 ms per 64 endpoints); hot/cold = endpoint 0 / the slowest other\n\
         endpoint in the hot windows. **bench CPU s** is the benchmark process (publishers and polling) on the\n\
         same cores: where it nears the wall time, the publishers, not the service, set the rate and the lag;\n\
         **events per service CPU-s** is the service's own cost.\n\n",
    );
    let _ = writeln!(
        md,
        "Date: {}. Machine: {}. Batches per endpoint per window {per_window}; at least {min_windows} windows and {min_events} events per fleet size.\n",
        machine::today(),
        machine::machine()
    );
    md.push_str("| publishers | windows | block events | wall s | events/s | service CPU s | bench CPU s | events per service CPU-s | lag p50 ms | lag p99 ms | hot lag p50 ms | cold lag p50 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.0} | {:.2} | {:.2} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.eps,
            r.windows,
            r.events,
            r.secs,
            r.events as f64 / r.secs,
            r.cpu,
            r.bench_cpu,
            r.events as f64 / r.cpu.max(0.01),
            pct(&r.lag, 0.5),
            pct(&r.lag, 0.99),
            pct(&r.hot_lag, 0.5),
            pct(&r.cold_lag, 0.5),
        );
    }
    let out = std::env::var_os("KVROUTE_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/bench-ingest.md")
        });
    std::fs::write(&out, md).unwrap();
    eprintln!("wrote {}", out.display());
}
