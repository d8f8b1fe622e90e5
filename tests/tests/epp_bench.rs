//! The endpoint picker's latency benchmark, run by scripts/bench-epp.sh (ignored as a test: it
//! takes minutes and its numbers depend on the machine).
//!
//! Added latency = a request's round trip through Envoy with the ext_proc filter pointed at the
//! picker (full-duplex streamed body, `override_host`; `envoy::epp_bootstrap`) minus the same
//! through that Envoy without the ext_proc filter (same engines, same client, sequential
//! requests), at p50 and p99, for chat prompts of about 8k tokens, cold (a new conversation per
//! request) and follow-up (a long conversation plus a new short user turn). The inventory is the
//! real service; the engines are echo stand-ins. Results go to the Markdown file named by
//! `KVROUTE_BENCH_OUT` (default docs/epp-bench.md), next to the filter's in docs/filter-bench.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvroute_core::chat::ChatTemplate;
use kvroute_core::tokenize::Tokenizer;
use kvroute_tests::envoy::{epp_bootstrap, Engine, EppBootstrap, Gateway, Inventory};
use kvroute_tests::harness;
use kvroute_tests::workload::{conversation, measure, percentile, turns_for, Counter, Prose};
use serde_json::{json, Value};

async fn gateway(engines: &[&Engine], inv: &Inventory, with_picker: bool) -> Gateway {
    let b = EppBootstrap {
        listener_port: harness::free_port().unwrap(),
        admin_port: harness::free_port().unwrap(),
        engines,
        epp: inv.epp.unwrap(),
        message_timeout: Duration::from_millis(200),
        body_mode: "FULL_DUPLEX_STREAMED",
    };
    let mut config = epp_bootstrap(&b);
    if !with_picker {
        let filters = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]
            ["filters"][0]["typed_config"]["http_filters"];
        filters
            .as_array_mut()
            .unwrap()
            .retain(|f| f["name"] != "envoy.filters.http.ext_proc");
    }
    let envoy = harness::Envoy::start(&config, b.admin_port).await.unwrap();
    harness::wait_for_tcp(
        harness::local(b.listener_port),
        Duration::from_secs(10),
        None,
    )
    .await
    .unwrap();
    Gateway {
        envoy,
        base: format!("http://{}", harness::local(b.listener_port)),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench-epp.sh"]
async fn bench_epp_latency() {
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
    let turns = turns_for(&counter, 8000);
    let cold: Vec<Vec<u8>> = (0..samples as u64)
        .map(|i| body(&conversation(1000 + i * 7919 + 8000, turns)))
        .collect();
    let base = conversation(42 + 8000, turns);
    let tokens = counter.tokens(&Value::Array(base.clone()));
    let mut p = Prose(99);
    let follow: Vec<Vec<u8>> = (0..samples)
        .map(|_| {
            let mut m = base.clone();
            m.push(json!({"role": "assistant", "content": "Understood."}));
            m.push(json!({"role": "user", "content": p.words(25)}));
            body(&m)
        })
        .collect();
    let cases = [("8k cold", cold), ("8k follow-up", follow)];

    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let inv = Inventory::start_with_epp(&[]).await.unwrap();
    inv.add_rule(&[&a, &b]).await.unwrap();
    inv.wait_for_epp_ready().await.unwrap();
    let mut results: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
    for (label, with_picker) in [("no picker", false), ("kvroute picker", true)] {
        let gw = gateway(&[&a, &b], &inv, with_picker).await;
        let warm: Vec<Vec<u8>> = (0..10u64).map(|i| body(&conversation(5 + i, 2))).collect();
        let _ = measure(&gw, &warm).await;
        let mut rows = Vec::new();
        for (name, bodies) in &cases {
            let lat = measure(&gw, bodies).await;
            let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
            eprintln!("{label:>16} | {name:>13} | p50 {p50:7.3} ms | p99 {p99:7.3} ms");
            rows.push((p50, p99));
        }
        results.push((label, rows));
    }
    let metrics = reqwest::get(format!("http://{}/metrics", inv.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvroute_epp_requests_total")
                || l.starts_with("kvroute_epp_failures_total")
        })
        .filter(|l| !l.ends_with(" 0"))
        .collect();

    let mut md = String::new();
    md.push_str("# Endpoint picker latency benchmark\n\n");
    md.push_str("Generated by `scripts/bench-epp.sh` (tests/tests/epp_bench.rs). Round trips through Envoy 1.40\n");
    md.push_str("(1 worker) to echo engines, sequential, measured by the client; **added** = with the ext_proc filter\n");
    md.push_str("pointed at the kvroute picker (full-duplex streamed body, `override_host`) minus the same Envoy\n");
    md.push_str("without the filter, at the same percentile. The picker is the real `kvroute-inventory serve\n");
    md.push_str("--epp-listen` (release build) on 127.0.0.1. Cold = a new conversation per request; follow-up = one\n");
    md.push_str("long conversation plus a new short user turn. The filter's figures for the same workload are in\n");
    md.push_str("[filter-bench.md](filter-bench.md).\n\n");
    md.push_str(&format!(
        "Samples per cell: {samples}. Prompt size (Qwen3 tokens, chat template applied): ~8k = {tokens}.\n"
    ));
    md.push_str(&format!(
        "Machine: {} cores; load average before the run: {}.\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    ));
    md.push_str("| setup | prompt | p50 ms | p99 ms | added p50 ms | added p99 ms |\n|---|---|---|---|---|---|\n");
    let base_rows = results[0].1.clone();
    for (label, rows) in &results {
        for (i, (p50, p99)) in rows.iter().enumerate() {
            let added = match *label == "no picker" {
                true => ("-".to_owned(), "-".to_owned()),
                false => (
                    format!("{:.2}", p50 - base_rows[i].0),
                    format!("{:.2}", p99 - base_rows[i].1),
                ),
            };
            md.push_str(&format!(
                "| {label} | {} | {p50:.2} | {p99:.2} | {} | {} |\n",
                cases[i].0, added.0, added.1
            ));
        }
    }
    md.push_str(&format!(
        "\nPicker answers over the run: `{}`.\n",
        counted.join("`, `")
    ));
    let out = std::env::var_os("KVROUTE_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| harness::repo_root().join("docs/epp-bench.md"));
    std::fs::write(&out, md).unwrap();
}
