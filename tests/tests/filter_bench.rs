//! The filter's latency benchmark, run by scripts/bench-filter.sh (ignored as a test: it takes
//! minutes and its numbers depend on the machine).
//!
//! Added latency = a request's round trip through Envoy with the kvroute filter minus the same
//! through Envoy without it (same engines, same client; every setup runs at once and each sample
//! goes through all of them, interleaved), at p50 and p99 and as paired per-sample differences,
//! per engine contract (vLLM sha256_cbor, SGLang, TensorRT-LLM), for chat prompts of about 1k and
//! 8k tokens:
//! * cold: every request is a new conversation (text never seen by the filter);
//! * follow-up: a long conversation plus a new short user turn (earlier turns are byte-identical,
//!   so the segment cache serves them);
//!
//! with the filter tokenizing (`tokenize: filter`) and with offload (`tokenize: service`).
//! The inventory is the real service; the engines are echo stand-ins. Results go to the Markdown
//! file named by `KVROUTE_BENCH_OUT` (default docs/filter-bench.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use kvroute_core::chat::ChatTemplate;
use kvroute_core::tokenize::Tokenizer;
use kvroute_test_support::{Poll, Probe};
use kvroute_tests::envoy::{Bootstrap, Contract, Engine, Gateway, Inventory, Variant};
use kvroute_tests::harness;
use kvroute_tests::workload::{conversation, percentile, turns_for, Counter, Prose};
use serde_json::{json, Value};

/// Chat requests through each setup before the measured ones.
const WARM_UP: u64 = 10;

/// Another build of the filter: its module and its label.
type Baseline = (std::path::PathBuf, String);

/// One round trip of `body` through `gw`, in ms.
async fn one(gw: &Gateway, body: &[u8]) -> f64 {
    let t0 = Instant::now();
    let r = gw
        .post("/v1/chat/completions", body.to_vec(), &[])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    t0.elapsed().as_secs_f64() * 1000.0
}

/// One setup's figures for one case.
#[derive(Clone, Copy, Debug)]
struct Stats {
    p50: f64,
    p99: f64,
    /// Median and quartiles of the per-sample difference against the no-filter setup.
    added_median: f64,
    added_q1: f64,
    added_q3: f64,
}

impl Stats {
    /// `lat[i]` and `base[i]` are the same sample through this setup and without the filter.
    fn of(lat: &[f64], base: &[f64]) -> Stats {
        let mut sorted = lat.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let mut diff: Vec<f64> = lat.iter().zip(base).map(|(l, b)| l - b).collect();
        diff.sort_by(|a, b| a.total_cmp(b));
        Stats {
            p50: percentile(&sorted, 0.5),
            p99: percentile(&sorted, 0.99),
            added_median: percentile(&diff, 0.5),
            added_q1: percentile(&diff, 0.25),
            added_q3: percentile(&diff, 0.75),
        }
    }
}

/// Waits until `gw`'s filter has the rule's contract and its tokenizer (or, offloading, until
/// the service has loaded its tokenizer: the first offloaded request does that, here without the
/// filter's 25 ms timeout, so the run measures steady state).
async fn warm_filter(gw: &Gateway, inv: &Inventory, rule: &str, tokenize_in_filter: bool) {
    gw.wait_for_log("rule contract loaded", 2, Duration::from_secs(60))
        .await
        .unwrap();
    let warm = gw
        .client
        .get(format!("{}/warmup", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(warm.status(), 200);
    if tokenize_in_filter {
        gw.wait_for_log("tokenizer loaded", 1, Duration::from_secs(60))
            .await
            .unwrap();
    } else {
        let msgs = json!([{"role": "user", "content": "warm up"}]);
        let r = gw
            .client
            .post(format!("http://{}/v1/route", inv.addr))
            .json(&json!({"rule": rule, "model": "Qwen/Qwen3-0.6B", "messages": msgs}))
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            200,
            "offload warm-up: {}",
            r.text().await.unwrap_or_default()
        );
    }
}

/// The fail-open count, then the filter's own timings and cache counters over the whole setup
/// (all cases). Envoy's histograms show what its last stats flush merged, so they are read once
/// `duration_us` holds a sample for each of the `requests` the filter saw, less the ones that
/// failed open: polled, bounded.
async fn filter_stats(gw: &Gateway, requests: u64) -> String {
    let stats = gw.envoy.stats("kvroute_filter_fail_open").await.unwrap();
    let total: u64 = stats.values().sum();
    let want = requests.saturating_sub(total);
    Poll::new(
        format!("Envoy's duration histogram holding {want} requests"),
        Duration::from_secs(30),
    )
    .every(Duration::from_millis(250))
    .until(async || {
        let counts = harness::body_text(
            gw.client
                .get(format!("http://{}/stats", gw.envoy.admin))
                .query(&[
                    ("filter", "kvroute_filter_duration_us"),
                    ("histogram_buckets", "cumulative"),
                ]),
        )
        .await?;
        let seen = histogram_count(&counts);
        Ok(if seen >= want {
            Probe::Ready(())
        } else {
            Probe::Pending(format!("{seen} samples"))
        })
    })
    .await
    .unwrap();
    let text = harness::body_text(
        gw.client
            .get(format!("http://{}/stats", gw.envoy.admin))
            .query(&[(
                "filter",
                "kvroute_filter_(tokenize_us|keys_us|prepare_us|callout_us|duration_us|.*cache_(hits|misses)_total)",
            )]),
    )
    .await
    .unwrap();
    let mut out = format!("{total}.\n\n```\n");
    for line in text.lines() {
        out.push_str(line.trim());
        out.push('\n');
    }
    out.push_str("```");
    out
}

/// The samples a histogram's cumulative bucket line counts (`B<bound>(interval,cumulative)`, the
/// last bucket the largest count); 0 before the first flush.
fn histogram_count(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.rsplit(" B").next())
        .filter_map(|b| b.split_once('(')?.1.strip_suffix(')')?.split_once(','))
        .filter_map(|(_, cumulative)| cumulative.trim().parse::<f64>().ok())
        .map(|c| c as u64)
        .max()
        .unwrap_or(0)
}

/// One setup's measurements: (case, p50 ms, p99 ms) rows.
struct Case {
    name: String,
    cold: Vec<Vec<u8>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench-filter.sh"]
async fn bench_filter_latency() {
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let samples: usize = std::env::var("KVROUTE_BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let dir = harness::tokenizer_dir().unwrap();
    let counter = Counter {
        tok: Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap(),
        tpl: ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap(),
    };
    let body = |msgs: &[Value]| {
        serde_json::to_vec(&json!({"model": "Qwen/Qwen3-0.6B", "messages": msgs, "max_tokens": 1}))
            .unwrap()
    };

    // Workloads: for each size, `samples` cold conversations and `samples` follow-ups of one.
    let mut cases = Vec::new();
    let mut sizes = Vec::new();
    // KVROUTE_BENCH_ONLY="8k follow-up" measures only the cases whose name contains it.
    let only = std::env::var("KVROUTE_BENCH_ONLY").unwrap_or_default();
    for target in [1000usize, 8000] {
        let turns = turns_for(&counter, target);
        let cold: Vec<Vec<u8>> = (0..samples as u64)
            .map(|i| body(&conversation(1000 + i * 7919 + target as u64, turns)))
            .collect();
        let base = conversation(42 + target as u64, turns);
        let n = counter.tokens(&Value::Array(base.clone()));
        let mut p = Prose(99);
        let follow: Vec<Vec<u8>> = (0..samples)
            .map(|_| {
                let mut m = base.clone();
                m.push(json!({"role": "assistant", "content": "Understood."}));
                m.push(json!({"role": "user", "content": p.words(25)}));
                body(&m)
            })
            .collect();
        sizes.push((target, n));
        cases.push(Case {
            name: format!("{}k cold", target / 1000),
            cold,
        });
        cases.push(Case {
            name: format!("{}k follow-up", target / 1000),
            cold: follow,
        });
    }

    cases.retain(|c: &Case| c.name.contains(only.as_str()));

    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let engines = [&a, &b];
    let inv = Inventory::start().await.unwrap();
    let mk = |plugin: Value, without_filter: bool, wasm: Option<std::path::PathBuf>| Bootstrap {
        engines: &engines,
        inventory: inv.addr,
        plugin,
        variant: Variant::EnvoyFilter,
        without_filter,
        wasm,
    };
    // KVROUTE_BENCH_BASELINE_WASM: another build of the filter (vLLM contract, tokenize: filter)
    // measured in the same interleaved run, labelled KVROUTE_BENCH_BASELINE_LABEL.
    let baseline = std::env::var_os("KVROUTE_BENCH_BASELINE_WASM").map(|w| {
        let label =
            std::env::var("KVROUTE_BENCH_BASELINE_LABEL").unwrap_or_else(|_| "baseline".into());
        (std::path::PathBuf::from(w), label)
    });
    // One rule per filtered setup (VIP ports 8080...), so no setup's decisions credit another's
    // keys; the production callout timeout (a slow answer shows as a fail-open, which is counted).
    let mut plans: Vec<(String, Bootstrap<'_>, Option<String>)> =
        vec![("no filter".to_owned(), mk(json!({}), true, None), None)];
    let mut setups_wanted: Vec<(Contract, &str, Option<&Baseline>)> = Contract::ALL
        .iter()
        .map(|c| (*c, "filter", None))
        .chain([(Contract::VllmSha256Cbor, "service", None)])
        .collect();
    if let Some(b) = &baseline {
        setups_wanted.push((Contract::VllmSha256Cbor, "filter", Some(b)));
    }
    for (port, (contract, tokenize, other)) in (8080u16..).zip(setups_wanted) {
        inv.add_rule_for(&[&a, &b], contract, port).await.unwrap();
        let rule = format!("10.0.0.1:{port}");
        let plugin = json!({"timeout_ms": 25, "tokenize": tokenize, "rule": rule});
        let mut label = format!("{}, tokenize: {tokenize}", contract.label());
        if let Some((_, name)) = other {
            label.push_str(&format!(", filter built from {name}"));
        }
        let wasm = other.map(|(w, _)| w.clone());
        plans.push((label, mk(plugin, false, wasm), Some(rule)));
    }
    let mut setups = Vec::new();
    for (label, bootstrap, rule) in plans {
        let gw = Gateway::start(bootstrap).await.unwrap();
        if let Some(rule) = &rule {
            warm_filter(&gw, &inv, rule, label.contains("tokenize: filter")).await;
        }
        // Warm-up: first calls in a VM are slower (V8 tiers up).
        let warm: Vec<Vec<u8>> = (0..WARM_UP)
            .map(|i| body(&conversation(5 + i, 2)))
            .collect();
        for w in &warm {
            let _ = one(&gw, w).await;
        }
        setups.push((label, gw, rule.is_some()));
    }

    // Paired and interleaved: sample i of a case goes through every setup before sample i + 1,
    // in an order rotated by i, so drift on the machine spreads over all setups alike.
    let n = setups.len();
    let mut table: Vec<Vec<Stats>> = vec![Vec::new(); n];
    // Per case, the paired difference of this build's vLLM filter against the baseline build's.
    let mut builds: Vec<Stats> = Vec::new();
    for c in &cases {
        let mut lat: Vec<Vec<f64>> = vec![Vec::with_capacity(c.cold.len()); n];
        for (i, body) in c.cold.iter().enumerate() {
            for k in 0..n {
                let j = (i + k) % n;
                lat[j].push(one(&setups[j].1, body).await);
            }
        }
        if baseline.is_some() {
            // Setup 1 is this build's vLLM filter, the last one the baseline build's.
            builds.push(Stats::of(&lat[1], &lat[n - 1]));
        }
        for j in 0..n {
            let st = Stats::of(&lat[j], &lat[0]);
            eprintln!(
                "{:>44} | {:>13} | p50 {:7.3} ms | p99 {:7.3} ms | paired added median {:7.3} ms",
                setups[j].0, c.name, st.p50, st.p99, st.added_median
            );
            table[j].push(st);
        }
    }
    // Chat requests each filter routed: the warm-up ones and every sample.
    let sent = WARM_UP + cases.iter().map(|c| c.cold.len() as u64).sum::<u64>();
    let mut results: Vec<(String, Vec<Stats>, String)> = Vec::new();
    for ((label, gw, filtered), rows) in setups.iter().zip(table) {
        let fail = if *filtered {
            filter_stats(gw, sent).await
        } else {
            String::new()
        };
        results.push((label.clone(), rows, fail));
    }

    let base = &results[0].1;
    let mut md = String::new();
    md.push_str("# Filter latency benchmark\n\n");
    md.push_str("Generated by `scripts/bench-filter.sh` (tests/tests/filter_bench.rs). Round trips through Envoy 1.40\n");
    md.push_str("(1 worker, V8) to echo engines, measured by the client. Every setup runs at once (its own Envoy)\n");
    md.push_str("and requests are paired and interleaved: sample i of a case goes through every setup, in an order\n");
    md.push_str("rotated by i, before sample i + 1. **added** = with the filter minus without it at the same\n");
    md.push_str("percentile; **paired added** = the median (and interquartile range) of the per-sample differences\n");
    md.push_str("against the no-filter request of the same sample. One rule per setup: vLLM `sha256_cbor` (what\n");
    md.push_str("most users run; no SHA instructions inside Wasm), SGLang and TensorRT-LLM; the inventory is the\n");
    md.push_str("real `kvroute-inventory` (release build) on 127.0.0.1, its inventories empty (routes are misses);\n");
    md.push_str("the callout timeout is the production 25 ms. Cold = a new conversation per request (unseen\n");
    md.push_str(
        "synthetic prose); follow-up = one long conversation plus a new short user turn.\n\n",
    );
    md.push_str(&format!(
        "Date: {}. Machine: {}. Samples per cell: {samples}. Prompt sizes (Qwen3 tokens, chat template applied): ",
        kvroute_test_support::machine::today(),
        kvroute_test_support::machine::machine()
    ));
    md.push_str(
        &sizes
            .iter()
            .map(|(t, n)| format!("~{}k = {n}", t / 1000))
            .collect::<Vec<_>>()
            .join(", "),
    );
    md.push_str(".\n\n| setup | prompt | p50 ms | p99 ms | added p50 ms | added p99 ms | paired added median ms (IQR) |\n|---|---|---|---|---|---|---|\n");
    for (label, rows, _) in &results {
        for (i, (c, st)) in cases.iter().zip(rows).enumerate() {
            let (b50, b99) = (base[i].p50, base[i].p99);
            let added = if label == "no filter" {
                ("-".to_owned(), "-".to_owned(), "-".to_owned())
            } else {
                (
                    format!("{:.2}", st.p50 - b50),
                    format!("{:.2}", st.p99 - b99),
                    format!(
                        "{:.2} ({:.2}-{:.2})",
                        st.added_median, st.added_q1, st.added_q3
                    ),
                )
            };
            md.push_str(&format!(
                "| {label} | {} | {:.2} | {:.2} | {} | {} | {} |\n",
                c.name, st.p50, st.p99, added.0, added.1, added.2
            ));
        }
    }
    md.push('\n');
    if let Some((_, name)) = &baseline {
        md.push_str(&format!(
            "This build's filter against the filter built from {name} (vLLM `sha256_cbor`, tokenize: filter, \
             the same inventory; its callout asks in JSON unless that build reads the contract's binary form), \
             paired difference per sample, median (IQR); negative = this build is faster:\n\n\
             | prompt | this build minus {name}, ms |\n|---|---|\n"
        ));
        for (c, st) in cases.iter().zip(&builds) {
            md.push_str(&format!(
                "| {} | {:.2} ({:.2} to {:.2}) |\n",
                c.name, st.added_median, st.added_q1, st.added_q3
            ));
        }
        md.push('\n');
    }
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    md.push_str(&format!(
        "/proc/loadavg before `{}`, after `{}` (other work on the machine inflates every cell).\n\n",
        load_before.trim(),
        load_after.trim()
    ));
    for (label, _, fail) in &results[1..] {
        md.push_str(&format!(
            "Fail-open requests during the run ({label}), then the filter's own stats (histograms in \
             microseconds, cumulative over all cases of the setup): {fail}\n\n"
        ));
    }
    let out = std::env::var_os("KVROUTE_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| harness::repo_root().join("docs/filter-bench.md"));
    std::fs::write(&out, md).unwrap();
    eprintln!("wrote {}", out.display());
}
