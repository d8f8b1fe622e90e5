//! The filter's latency benchmark, run by scripts/bench-filter.sh (ignored as a test: it takes
//! minutes and its numbers depend on the machine).
//!
//! Added latency = a request's round trip through Envoy with the kvroute filter minus the same
//! through Envoy without it (same engines, same client, sequential requests), at p50 and p99, for
//! chat prompts of about 1k and 8k tokens:
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
use kvroute_tests::envoy::{Bootstrap, Engine, Gateway, Inventory, Variant};
use kvroute_tests::harness;
use kvroute_tests::workload::{conversation, measure, percentile, turns_for, Counter, Prose};
use serde_json::{json, Value};

/// One setup's measurements: (case, p50 ms, p99 ms) rows.
type Rows = Vec<(String, f64, f64)>;

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
    inv.add_rule(&[&a, &b]).await.unwrap();
    let mk = |plugin: Value, without_filter: bool| Bootstrap {
        listener_port: 0,
        admin_port: 0,
        engines: &engines,
        inventory: inv.addr,
        plugin,
        variant: Variant::EnvoyFilter,
        without_filter,
    };
    // The production callout timeout; a slow answer would show as fail-open, which is counted.
    let setups = [
        ("no filter", mk(json!({}), true)),
        (
            "filter, tokenize: filter",
            mk(json!({"timeout_ms": 25}), false),
        ),
        (
            "filter, tokenize: service",
            mk(json!({"timeout_ms": 25, "tokenize": "service"}), false),
        ),
    ];
    let mut results: Vec<(String, Rows, String)> = Vec::new();
    for (label, bootstrap) in setups {
        let gw = Gateway::start(bootstrap).await.unwrap();
        if label != "no filter" {
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
            if label.contains("tokenize: filter") {
                gw.wait_for_log("tokenizer loaded", 1, Duration::from_secs(60))
                    .await
                    .unwrap();
            } else {
                // The service loads its tokenizer on the first offloaded request; do that once
                // here, without the filter's 25 ms timeout, so the run measures steady state.
                let msgs = json!([{"role": "user", "content": "warm up"}]);
                let r = gw.client.post(format!("http://{}/v1/route", inv.addr))
                    .json(&json!({"rule": "10.0.0.1:8080", "model": "Qwen/Qwen3-0.6B", "messages": msgs}))
                    .timeout(Duration::from_secs(60)).send().await.unwrap();
                assert_eq!(
                    r.status(),
                    200,
                    "offload warm-up: {}",
                    r.text().await.unwrap_or_default()
                );
            }
        }
        // Warm-up: first calls in a VM are slower (V8 tiers up).
        let warm: Vec<Vec<u8>> = (0..10u64).map(|i| body(&conversation(5 + i, 2))).collect();
        let _ = measure(&gw, &warm).await;
        let mut rows = Vec::new();
        for c in &cases {
            let lat = measure(&gw, &c.cold).await;
            rows.push((
                c.name.clone(),
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
            ));
            eprintln!(
                "{label:>28} | {:>13} | p50 {:7.3} ms | p99 {:7.3} ms",
                c.name,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99)
            );
        }
        let mut fail = String::new();
        if label != "no filter" {
            let stats = gw.envoy.stats("kvroute_filter_fail_open").await.unwrap();
            let total: u64 = stats.values().sum();
            fail = format!("{total}");
            // The filter's own timings and cache counters over the whole setup (all cases).
            // Histograms show up after Envoy's next stats flush: poll, bounded.
            let deadline = Instant::now() + Duration::from_secs(20);
            let text = loop {
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
                if text.contains("duration_us: P0") || Instant::now() > deadline {
                    break text;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            };
            fail.push_str(".\n\n```\n");
            for line in text.lines() {
                fail.push_str(line.trim());
                fail.push('\n');
            }
            fail.push_str("```");
        }
        results.push((label.to_owned(), rows, fail));
    }

    let base = &results[0].1;
    let mut md = String::new();
    md.push_str("# Filter latency benchmark\n\n");
    md.push_str("Generated by `scripts/bench-filter.sh` (tests/tests/filter_bench.rs). Round trips through Envoy 1.40\n");
    md.push_str("(1 worker, V8) to echo engines, sequential, measured by the client; **added** = with the filter minus\n");
    md.push_str("without it at the same percentile. The inventory is the real `kvroute-inventory` (release build) on\n");
    md.push_str("127.0.0.1; the callout timeout is the production 25 ms. Cold = a new conversation per request\n");
    md.push_str("(unseen synthetic prose); follow-up = one long conversation plus a new short user turn.\n\n");
    md.push_str(&format!(
        "Samples per cell: {samples}. Prompt sizes (Qwen3 tokens, chat template applied): "
    ));
    md.push_str(
        &sizes
            .iter()
            .map(|(t, n)| format!("~{}k = {n}", t / 1000))
            .collect::<Vec<_>>()
            .join(", "),
    );
    md.push_str(".\n\n| setup | prompt | p50 ms | p99 ms | added p50 ms | added p99 ms |\n|---|---|---|---|---|---|\n");
    for (label, rows, _) in &results {
        for (i, (name, p50, p99)) in rows.iter().enumerate() {
            let (b50, b99) = (base[i].1, base[i].2);
            let added = if label == "no filter" {
                ("-".to_owned(), "-".to_owned())
            } else {
                (format!("{:.2}", p50 - b50), format!("{:.2}", p99 - b99))
            };
            md.push_str(&format!(
                "| {label} | {name} | {p50:.2} | {p99:.2} | {} | {} |\n",
                added.0, added.1
            ));
        }
    }
    md.push('\n');
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    md.push_str(&format!(
        "Machine: {} cores; /proc/loadavg before `{}`, after `{}` (other work on the machine inflates every cell).\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
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
