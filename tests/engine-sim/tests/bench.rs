//! `kvroute-bench` end to end on a tiny workload: it starts its own simulators (and the inventory
//! service when `kvroute-inventory` is built next to it), drives every strategy and writes JSON.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;

fn inventory_built() -> bool {
    PathBuf::from(env!("CARGO_BIN_EXE_kvroute-bench"))
        .with_file_name("kvroute-inventory")
        .is_file()
}

/// Runs the bench with `args` (bounded: the child is killed after 120 s) and returns its JSON.
fn bench(args: &[&str]) -> Value {
    // Tests run in parallel in this process: one output file each.
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let out = std::env::temp_dir().join(format!(
        "kvroute-bench-test-{}-{}.json",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .args([
            "--users",
            "6",
            "--turns",
            "2",
            "--groups",
            "2",
            "--prefix-words",
            "120",
            "--ramp-ms",
            "200",
            "--endpoints",
            "2",
        ])
        .args(args)
        .arg("--json")
        .arg(&out)
        .spawn()
        .unwrap();
    let status = kvroute_test_support::wait_exit(&mut child, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("kvroute-bench: {e}"));
    assert!(status.success(), "kvroute-bench failed: {status}");
    let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    v
}

/// Every completed request of a predicting strategy was judged, and the shares add up.
fn assert_judged(s: &Value) {
    assert_eq!(s["predictions_judged"], s["requests"], "{s}");
    let counts =
        ["prediction_exact", "prediction_over", "prediction_under"].map(|k| s[k].as_u64().unwrap());
    assert_eq!(counts.iter().sum::<u64>(), s["requests"].as_u64().unwrap());
    let shares: f64 = [
        "prediction_exact_share",
        "prediction_over_share",
        "prediction_under_share",
    ]
    .iter()
    .map(|k| s[k].as_f64().unwrap())
    .sum();
    assert!((shares - 1.0).abs() < 1e-9, "{s}");
    assert!(s["over_predicted_tokens"].as_u64().is_some(), "{s}");
}

fn find<'a>(v: &'a Value, workload: &str, strategy: &str) -> &'a Value {
    v["summaries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["workload"] == workload && s["strategy"] == strategy)
        .unwrap()
}

#[test]
fn bench_runs_baselines_and_oracle() {
    let v = bench(&[
        "--workloads",
        "multi-turn,one-shot",
        "--strategies",
        "round-robin,sticky,oracle",
    ]);
    for strategy in ["round-robin", "sticky", "oracle"] {
        let mt = find(&v, "multi-turn", strategy);
        assert_eq!(mt["errors"], 0, "{strategy}: {mt}");
        assert_eq!(mt["requests"], 12);
        let os = find(&v, "one-shot", strategy);
        assert_eq!(os["cached_ratio"], 0.0, "unique prompts never hit");
    }
    let oracle = find(&v, "multi-turn", "oracle");
    assert!(oracle["cached_ratio"].as_f64().unwrap() > 0.3, "{oracle}");
    assert!(oracle["route_p50_ms"].as_f64().is_some());
    assert_judged(oracle);
    for strategy in ["round-robin", "sticky"] {
        let s = find(&v, "multi-turn", strategy);
        assert_eq!(s["predictions_judged"], 0, "{strategy}: {s}");
        assert!(s["prediction_exact_share"].is_null(), "{strategy}: {s}");
        assert!(s["over_predicted_tokens"].is_null(), "{strategy}: {s}");
    }
}

#[test]
fn bench_routes_through_the_inventory() {
    assert!(
        inventory_built(),
        "kvroute-inventory is not built next to kvroute-bench: run ./scripts/test.sh (it builds every binary first)"
    );
    // vLLM over ZMQ (one 127.0.0.x per simulator) and TensorRT-LLM over the HTTP drain.
    for engine in ["vllm", "trtllm"] {
        let v = bench(&[
            "--engine",
            engine,
            "--workloads",
            "multi-turn",
            "--strategies",
            "kvroute-engine,kvroute-tokens",
        ]);
        for strategy in ["kvroute-engine", "kvroute-tokens"] {
            let s = find(&v, "multi-turn", strategy);
            assert_eq!(s["errors"], 0, "{engine} {strategy}: {s}");
            assert!(
                s["cached_ratio"].as_f64().unwrap() > 0.3,
                "{engine} {strategy}: {s}"
            );
            assert!(
                s["reasons"]["hit"].as_u64().unwrap_or(0) > 0,
                "{engine} {strategy}: the inventory found hits: {s}"
            );
            assert_judged(s);
            // The driver sent every judgement to the inventory as the filter's outcome
            // reports, and the divergence check stayed quiet on this correct fleet.
            let g = &s["signals"];
            assert_eq!(g["judged"], s["requests"], "{engine} {strategy}: {s}");
            assert_eq!(g["divergent_endpoints"], 0, "{engine} {strategy}: {s}");
            assert_eq!(g["canary_runs"], 0, "the canary is off by default: {s}");
        }
    }
}

/// The Anthropic Messages shape: the simulators serve `/v1/messages`, the oracle and kvroute
/// key the body through the same conversion, the usage comes from the `message_delta` event.
#[test]
fn bench_sends_anthropic_messages() {
    assert!(
        inventory_built(),
        "kvroute-inventory is not built next to kvroute-bench: run ./scripts/test.sh (it builds every binary first)"
    );
    let v = bench(&[
        "--api",
        "anthropic",
        "--workloads",
        "multi-turn",
        "--strategies",
        "round-robin,kvroute-engine,oracle",
    ]);
    for strategy in ["round-robin", "kvroute-engine", "oracle"] {
        let s = find(&v, "multi-turn", strategy);
        assert_eq!(s["errors"], 0, "{strategy}: {s}");
        assert!(s["cached_ratio"].as_f64().unwrap() > 0.1, "{strategy}: {s}");
    }
    let kv = find(&v, "multi-turn", "kvroute-engine");
    assert!(
        kv["reasons"]["hit"].as_u64().unwrap_or(0) > 0,
        "the inventory found hits: {kv}"
    );
    assert!(
        kv["cached_ratio"].as_f64().unwrap()
            > find(&v, "multi-turn", "round-robin")["cached_ratio"]
                .as_f64()
                .unwrap(),
        "kvroute beats round robin on Anthropic requests: {v}"
    );
}

/// The sglang-router peer: the real router (sglang-router 0.3.2, installed by
/// scripts/setup.sh into .cache/sglang-router-venv) proxies the workload to the simulators;
/// the bench reads cached tokens and the serving simulator through it, and stops it afterwards.
#[test]
fn bench_runs_the_sglang_router_peer() {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/sglang-router-venv/bin/python");
    let python = std::env::var_os("KVROUTE_SGLANG_ROUTER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or(venv);
    assert!(
        python.is_file(),
        "sglang-router is not installed ({}): run scripts/setup.sh",
        python.display()
    );
    let tokenizer = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/fixtures/qwen3");
    let mut args = vec![
        "--workloads".to_string(),
        "multi-turn".into(),
        "--strategies".into(),
        "sglang-router".into(),
        "--sglang-router-python".into(),
        python.display().to_string(),
    ];
    if tokenizer.join("tokenizer.json").is_file() {
        args.extend(["--tokenizer-dir".into(), tokenizer.display().to_string()]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let v = bench(&refs);
    let s = find(&v, "multi-turn", "sglang-router");
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(s["requests"], 12);
    assert!(s["cached_ratio"].as_f64().unwrap() > 0.3, "{s}");
    // The serving simulator is known for every request (header or system_fingerprint).
    assert_eq!(s["unattributed"], 0, "{s}");
}

/// Runs the bench with `args`, which must fail within 120 s; returns its stderr.
fn bench_fails(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .args([
            "--endpoints",
            "2",
            "--users",
            "2",
            "--turns",
            "1",
            "--groups",
            "1",
        ])
        .args(["--prefix-words", "40", "--ramp-ms", "100"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drained on a thread: the child never blocks on a full pipe.
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = kvroute_test_support::wait_exit(&mut child, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("kvroute-bench {args:?}: {e}"));
    let err = reader.join().unwrap();
    assert!(
        !status.success(),
        "kvroute-bench {args:?} succeeded:\n{err}"
    );
    err
}

/// `--cpu-blocks` starts every simulator with the CPU tier: the bench checks each one reports
/// it before measuring (and fails otherwise), and the cached-token ratio reads the engines'
/// usage, CPU-tier loads included. `--inventory-env` reaches the inventory.
#[test]
fn bench_runs_simulators_with_the_cpu_tier() {
    assert!(
        inventory_built(),
        "kvroute-inventory is not built next to kvroute-bench: run ./scripts/test.sh (it builds every binary first)"
    );
    let v = bench(&[
        "--cpu-blocks",
        "512",
        "--kv-blocks",
        "48",
        "--workloads",
        "multi-turn",
        "--strategies",
        "round-robin,kvroute-engine,oracle",
        "--inventory-env",
        "KVROUTE_CPU_TIER_WEIGHT=0",
    ]);
    assert_eq!(v["cpu_blocks"], 512);
    for strategy in ["round-robin", "kvroute-engine", "oracle"] {
        let s = find(&v, "multi-turn", strategy);
        assert_eq!(s["errors"], 0, "{strategy}: {s}");
        assert!(s["cached_ratio"].as_f64().unwrap() > 0.3, "{strategy}: {s}");
    }
    assert_judged(find(&v, "multi-turn", "oracle"));
}

#[test]
fn bench_refuses_a_misused_cpu_tier_and_passes_inventory_env_through() {
    let err = bench_fails(&["--engine", "sglang", "--cpu-blocks", "8"]);
    assert!(err.contains("--cpu-blocks needs --engine vllm"), "{err}");
    let err = bench_fails(&["--inventory-env", "KVROUTE_CPU_TIER_WEIGHT"]);
    assert!(
        err.contains("--inventory-env \"KVROUTE_CPU_TIER_WEIGHT\": give NAME=VALUE"),
        "{err}"
    );
    assert!(
        inventory_built(),
        "kvroute-inventory is not built next to kvroute-bench: run ./scripts/test.sh (it builds every binary first)"
    );
    // The inventory refuses to start on a bad value: the variable got there.
    let err = bench_fails(&[
        "--workloads",
        "one-shot",
        "--strategies",
        "kvroute-engine",
        "--inventory-env",
        "LOXILB_KV_LB_MODE=bogus",
    ]);
    assert!(err.contains("exited before it was ready"), "{err}");
    assert!(err.contains("LOXILB_KV_LB_MODE"), "{err}");
}
