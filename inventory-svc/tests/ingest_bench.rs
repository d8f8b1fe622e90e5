//! Ingestion benchmark (ignored; `scripts/bench-ingest.sh` runs it in release and writes
//! docs/bench-ingest.md): one real ZMQ publisher per endpoint on loopback (each at its own
//! `kvZmqEndpoint`), the service subscribed to all of them, block events pushed through the
//! real path (decode, key, apply). Reports events/s, the service's CPU per event, and the lag
//! from a window's last publish to its last event in the index, for every endpoint and with one
//! hot publisher sending ten times the others' volume (does one backlog delay the rest?).
//! With `KVROUTE_BENCH_BASELINE_BIN` (`scripts/bench-ingest.sh --baseline REV`) another build of
//! the service runs beside this one, the two alternating run by run, and the paired ratios of
//! their CPU per event are reported.
//! Measurements, not assertions: only correctness (counts reached) is checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{
    batch, cpu_secs, metric, pid_cpu_secs, removed, rule, spread, stored, Publisher, Service,
};
use kvroute_test_support::machine;
use rmpv::Value as Mp;
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

/// `/metrics` reads made by the bench (each is work for the service, subtracted from its CPU at
/// the cost a calibration measures).
static SCRAPES: AtomicU64 = AtomicU64::new(0);

/// Scrapes of the calibration that prices one `/metrics` read on an idle service.
const CALIBRATION_SCRAPES: u64 = 300;

/// Blocks per endpoint from one `/metrics` read.
async fn blocks(svc: &Service, eps: usize) -> Vec<u64> {
    SCRAPES.fetch_add(1, Ordering::Relaxed);
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

/// One run's figures.
struct Row {
    events: u64,
    secs: f64,
    cpu: f64,
    /// The service's CPU for the bench's `/metrics` reads during the windows (their count times
    /// the calibrated cost of one).
    scrape_cpu: f64,
    /// CPU of the bench process itself (publishers and polling).
    bench_cpu: f64,
    lag: Vec<f64>,
    hot_lag: Vec<f64>,
    cold_lag: Vec<f64>,
}

impl Row {
    /// Block events per CPU-second of the service, the bench's `/metrics` reads excluded.
    fn per_cpu(&self) -> f64 {
        self.events as f64 / (self.cpu - self.scrape_cpu).max(0.01)
    }
}

/// What the publishers send.
#[derive(Clone, Copy)]
enum Workload {
    /// Every message stores 16 new keys: the index grows all run long (the worst case per event:
    /// every store a new table entry, the table growing past the caches).
    Growth,
    /// Engines at capacity: each endpoint is first filled with `held` blocks (untimed), then its
    /// messages alternate storing 16 new keys and removing its 16 oldest, as an engine's KV cache
    /// does once full. `tokens`: each store as vLLM sends it mid-prompt, with a parent and the 16
    /// token ids of each block ([`stored_mid_prompt`]).
    Steady { held: u64, tokens: bool },
}

impl Workload {
    fn name(self) -> String {
        match self {
            Workload::Growth => "growth".into(),
            Workload::Steady {
                held,
                tokens: false,
            } => format!("steady, {held} blocks per endpoint"),
            Workload::Steady { held, tokens: true } => {
                format!("steady, {held} blocks per endpoint, token ids")
            }
        }
    }
}

/// How many times the other publishers' batches the hot one sends. With token ids (~1.2 KB a
/// message instead of ~190 bytes) twice, not ten times: a hot window's batches stay under the
/// test PUB's 128 KiB send buffer.
fn hot_factor(workload: Workload) -> u64 {
    match workload {
        Workload::Steady { tokens: true, .. } => 2,
        _ => 10,
    }
}

/// A `BlockStored` of `keys` as vLLM sends it mid-prompt: after `parent`, with the 16 token ids of
/// each block (ids of a 151k vocabulary, as Qwen3's, in the mixed msgpack widths real ids take).
fn stored_mid_prompt(keys: &[u64], parent: u64) -> Mp {
    let first = keys.first().copied().unwrap_or(0);
    let ids: Vec<u32> = (0..keys.len() as u64 * 16)
        .map(|t| ((first.wrapping_mul(7919) + t * 104_729) % 151_000) as u32)
        .collect();
    let mut ev = stored(keys, &ids, false);
    if let Mp::Map(fields) = &mut ev {
        for (k, v) in fields.iter_mut() {
            if k.as_str() == Some("parent_block_hash") {
                *v = Mp::from(parent);
            }
        }
    }
    ev
}

/// Fills every endpoint with `held` blocks of fresh keys (256 per message, bursts the PUB's send
/// buffer holds), remembering each endpoint's keys oldest first in runs of [`PER`].
async fn preload(
    svc: &Service,
    pubs: &mut [Publisher],
    expect: &mut [u64],
    held: u64,
    next_key: &mut u64,
) -> Vec<std::collections::VecDeque<u64>> {
    const WIDE: u64 = 256;
    let mut fifo = vec![std::collections::VecDeque::new(); pubs.len()];
    let mut left = held;
    while left > 0 {
        for _ in 0..32 {
            if left == 0 {
                break;
            }
            let n = left.min(WIDE).div_ceil(PER) * PER;
            left = left.saturating_sub(n);
            for (i, p) in pubs.iter_mut().enumerate() {
                let keys: Vec<u64> = (*next_key..*next_key + n).collect();
                fifo[i].extend(keys.iter().step_by(PER as usize).copied());
                *next_key += n;
                p.send(&batch(vec![stored(&keys, &[], false)])).await;
                expect[i] += n;
            }
        }
        wait_all(svc, pubs, expect, Instant::now(), 120).await;
    }
    fifo
}

async fn run_fleet(
    program: Option<&Path>,
    eps: usize,
    workload: Workload,
    windows: u64,
    per_window: u64,
) -> Row {
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
    let tag = format!("ingest-bench-{eps}");
    let env = [("RUST_LOG", "warn")];
    let svc = match program {
        Some(p) => Service::start_program(p, &tag, (&json!([r]), &env, &[])),
        None => Service::start(&tag, &json!([r]), &env),
    };
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
    let mut next_key = 1u64;
    let mut fifo = match workload {
        Workload::Growth => Vec::new(),
        Workload::Steady { held, .. } => {
            preload(&svc, &mut pubs, &mut expect, held, &mut next_key).await
        }
    };
    let (mut events, mut lag, mut hot_lag, mut cold_lag) = (0u64, vec![], vec![], vec![]);
    let (c0, b0, t0, s0) = (
        cpu_secs(&svc),
        pid_cpu_secs(std::process::id()),
        Instant::now(),
        SCRAPES.load(Ordering::Relaxed),
    );
    // Steady: an odd number of messages per endpoint and window (remove, store, ..., remove,
    // store, store): only the last leaves the endpoint 16 blocks above where it began, so the count
    // the bench waits for is reached once the window's last message is applied, not before.
    let per_window = match workload {
        Workload::Growth => per_window,
        Workload::Steady { .. } => per_window | 1,
    };
    for w in 0..windows {
        // Odd windows: endpoint 0 is hot (ten times the batches of every other endpoint, twice
        // with token ids).
        let hot = w % 2 == 1;
        let ws = Instant::now();
        let n = if hot {
            per_window * hot_factor(workload) + 1
        } else {
            per_window
        };
        for b in 0..n {
            for (i, p) in pubs.iter_mut().enumerate() {
                if b >= per_window && i != 0 {
                    continue;
                }
                let last = if i == 0 { n - 1 } else { per_window - 1 };
                let remove = matches!(workload, Workload::Steady { .. }) && b != last && b % 2 == 0;
                let event = match (remove, fifo.get_mut(i).and_then(|f| f.pop_front())) {
                    (true, Some(first)) => {
                        let keys: Vec<u64> = (first..first + PER).collect();
                        expect[i] -= PER;
                        removed(&keys)
                    }
                    _ => {
                        let keys: Vec<u64> = (next_key..next_key + PER).collect();
                        if let Some(f) = fifo.get_mut(i) {
                            f.push_back(next_key);
                        }
                        next_key += PER;
                        expect[i] += PER;
                        match workload {
                            Workload::Steady { tokens: true, .. } => {
                                stored_mid_prompt(&keys, keys[0] - 1)
                            }
                            _ => stored(&keys, &[], false),
                        }
                    }
                };
                p.send(&batch(vec![event])).await;
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
    let scrapes = SCRAPES.load(Ordering::Relaxed) - s0;
    // The price of one scrape: back to back on the now idle service, the index as full.
    let c1 = cpu_secs(&svc);
    for _ in 0..CALIBRATION_SCRAPES {
        blocks(&svc, eps).await;
    }
    let per_scrape = (cpu_secs(&svc) - c1) / CALIBRATION_SCRAPES as f64;
    Row {
        events,
        secs,
        cpu,
        scrape_cpu: scrapes as f64 * per_scrape,
        bench_cpu,
        lag,
        hot_lag,
        cold_lag,
    }
}

/// The runs of one build at one fleet size, over the rounds.
struct Runs {
    eps: usize,
    workload: Workload,
    label: String,
    rows: Vec<Row>,
}

impl Runs {
    /// Every run's value of `f`.
    fn each(&self, f: impl Fn(&Row) -> f64) -> Vec<f64> {
        self.rows.iter().map(f).collect()
    }

    /// Lags of every run pooled and sorted.
    fn lags(&self, f: impl Fn(&Row) -> &Vec<f64>) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .rows
            .iter()
            .flat_map(|r| f(r).iter().copied())
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
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
    let min_events = n("KVROUTE_BENCH_MIN_EVENTS", 8_000_000);
    let rounds = n("KVROUTE_BENCH_ROUNDS", 5).max(1) as usize;
    // This build, and optionally an earlier one measured beside it, run by run.
    let mut builds: Vec<(String, Option<PathBuf>)> = vec![("this build".into(), None)];
    if let Ok(bin) = std::env::var("KVROUTE_BENCH_BASELINE_BIN") {
        let label = std::env::var("KVROUTE_BENCH_BASELINE_LABEL").unwrap_or_else(|_| bin.clone());
        builds.insert(0, (label, Some(PathBuf::from(bin))));
    }
    // Keys the whole fleet holds in the steady workload (a GPU's worth per endpoint: 65,536
    // blocks at 16 endpoints), and the growth workload at the first size.
    let fleet_keys = n("KVROUTE_BENCH_FLEET_KEYS", 1 << 20);
    let mut cases: Vec<(usize, Workload)> = sizes
        .iter()
        .map(|&eps| {
            let held = (fleet_keys / eps.max(1) as u64).max(PER);
            (
                eps,
                Workload::Steady {
                    held,
                    tokens: false,
                },
            )
        })
        .collect();
    if let Some(&eps) = sizes.first() {
        cases.push((eps, Workload::Growth));
        // What engines send: the same steady fleet, its stores with parents and token ids.
        let held = (fleet_keys / eps.max(1) as u64).max(PER);
        cases.push((eps, Workload::Steady { held, tokens: true }));
    }
    let mut all: Vec<Runs> = Vec::new();
    for (eps, workload) in cases {
        let per_cold_window = (eps as u64 * per_window * PER).max(1);
        let windows = min_windows.max(min_events.div_ceil(per_cold_window));
        let first = all.len();
        for (label, _) in &builds {
            all.push(Runs {
                eps,
                workload,
                label: label.clone(),
                rows: Vec::new(),
            });
        }
        for round in 0..rounds {
            // The order alternates round by round, so neither build always runs first.
            for k in 0..builds.len() {
                let b = (k + round) % builds.len();
                let r = run_fleet(builds[b].1.as_deref(), eps, workload, windows, per_window).await;
                eprintln!(
                    "{eps:>5} publishers, {}, {}, round {round}: {} events in {:.2} s, service CPU {:.2} s ({:.2} s scrapes), {:.0} events per CPU-s",
                    workload.name(),
                    builds[b].0,
                    r.events,
                    r.secs,
                    r.cpu,
                    r.scrape_cpu,
                    r.per_cpu()
                );
                all[first + b].rows.push(r);
            }
        }
    }
    let mut md = String::new();
    md.push_str("# Ingestion benchmark\n\n");
    let _ = write!(
        md,
        "Generated by `scripts/bench-ingest.sh{}` (inventory-svc/tests/ingest_bench.rs, release build). One real\n\
         ZMQ PUB per endpoint on 127.0.0.1, each at its own `kvZmqEndpoint`; the service subscribes to all of\n\
         them and every event goes through the real path (frame split, msgpack decode, keying, index apply).\n\
         Each message is one vLLM event of 16 keys. **steady**: engines at capacity, the fleet\n\
         holding {fleet_keys} keys (each endpoint is filled first, untimed; then its messages alternate a\n\
         `BlockStored` of 16 new keys and a `BlockRemoved` of its 16 oldest, as a full KV cache does);\n\
         its stores carry no token ids, except in the **token ids** row, where each store is what vLLM\n\
         sends mid-prompt: a parent and the 16 token ids of each block (256 ids of a 151k vocabulary, ~1.2 KB),\n\
         and the hot publisher sends twice, not ten times, the batches (the test PUB's 128 KiB buffer).\n\
         **growth**: every message a `BlockStored` of 16 new keys, the index growing all run long (each\n\
         store a new table entry). The publishers run in the\n\
         benchmark process on the same cores as the service. Windows: every publisher sends its batches,\n\
         then the bench waits until the index holds them all (a ZMQ PUB drops what a slow subscriber has not\n\
         taken, and a dropped batch would be a gap); every other window endpoint 0 is hot and sends ten\n\
         times the batches. **lag** = last publish of a window to the last of its events visible in the\n\
         index (`kvroute_index_blocks`, polled every 2 ms plus 1 ms per 64 endpoints); hot/cold = endpoint 0 / the slowest other\n\
         endpoint in the hot windows. **bench CPU s** is the benchmark process (publishers and polling) on the\n\
         same cores: where it nears the wall time, the publishers, not the service, set the rate and the lag.\n\
         **events per service CPU-s** is the service's own cost of ingestion: its CPU over the windows less\n\
         what the bench's `/metrics` reads cost it (their number times the CPU of one read, measured after the\n\
         windows by {CALIBRATION_SCRAPES} reads back to back; the **scrapes** column). Each build runs {rounds} times per fleet size,\n\
         builds alternating run by run; figures are the median (min-max) over the runs, lags pooled.\n\n",
        match builds.first() {
            Some((label, Some(_))) => format!(" --baseline {label}"),
            _ => String::new(),
        }
    );
    let _ = writeln!(
        md,
        "Date: {}. Machine: {}. Batches per endpoint per window {per_window}; at least {min_windows} windows and {min_events} events per fleet size and run.\n",
        machine::today(),
        machine::machine()
    );
    md.push_str("| publishers | workload | build | block events per run | events/s | service CPU s | scrapes, service CPU s | bench CPU s | events per service CPU-s | lag p50 ms | lag p99 ms | hot lag p50 ms | cold lag p50 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &all {
        let lag = r.lags(|x| &x.lag);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.eps,
            r.workload.name(),
            r.label,
            r.rows[0].events,
            spread(&r.each(|x| x.events as f64 / x.secs), 0),
            spread(&r.each(|x| x.cpu), 2),
            spread(&r.each(|x| x.scrape_cpu), 2),
            spread(&r.each(|x| x.bench_cpu), 2),
            spread(&r.each(Row::per_cpu), 0),
            pct(&lag, 0.5),
            pct(&lag, 0.99),
            pct(&r.lags(|x| &x.hot_lag), 0.5),
            pct(&r.lags(|x| &x.cold_lag), 0.5),
        );
    }
    if builds.len() == 2 {
        md.push_str("\nPaired ratios of events per service CPU-s, this build / baseline (median and range over the rounds; each ratio compares the two runs of one round):\n\n");
        for pair in all.chunks(2) {
            let ratios: Vec<f64> = pair[0]
                .rows
                .iter()
                .zip(&pair[1].rows)
                .map(|(base, this)| this.per_cpu() / base.per_cpu())
                .collect();
            let _ = writeln!(
                md,
                "- {} publishers, {}: x{}",
                pair[0].eps,
                pair[0].workload.name(),
                spread(&ratios, 2)
            );
        }
    }
    let out = std::env::var_os("KVROUTE_BENCH_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/bench-ingest.md")
        });
    std::fs::write(&out, md).unwrap();
    eprintln!("wrote {}", out.display());
}
