//! Monitoring for real: a real Prometheus (Debian's, installed by scripts/setup.sh) scrapes the
//! real inventory service's `/metrics` and a real Envoy's admin `/stats/prometheus` running the
//! built filter, with the shipped rules of `deploy/prometheus/` loaded.
//!
//! What must hold:
//! * a kvroute series of each target is queryable through `/api/v1/query` with the value the
//!   target itself reports, and every shipped rule evaluates without error;
//! * `promtool check metrics` finds nothing in either scrape but the [`KNOWN`] problems (each with
//!   its reason; a known problem that no longer occurs must be removed, so the list only shrinks),
//!   and every kvroute series has labels from the bounded set [`LABELS`];
//! * `promtool check rules` and `promtool test rules` pass on `deploy/prometheus/`;
//! * every metric the rules and the Grafana dashboard (`deploy/grafana/kvroute.json`) name exists:
//!   seen on the real scrapes, recorded by the rules, or (rules only) defined in the code; every
//!   dashboard expression is valid PromQL to the real Prometheus.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "prometheus/names.rs"]
mod names;
#[path = "prometheus/server.rs"]
mod server;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvroute_tests::envoy::{self, Bootstrap, Engine, Gateway, Inventory, Variant, SSE_HEADER};
use kvroute_tests::harness::{self, ChildGuard, TempDir, BACKEND_HEADER};
use serde_json::json;

use names::{
    code_names, dashboard_exprs, deploy_dir, kvroute_samples, metric_names, recorded_names,
    rule_files, rules,
};
use server::{lint, promtool, Prometheus};

/// Job names the rules and docs/monitoring.md use.
const JOB_INVENTORY: &str = "kvroute-inventory";
const JOB_ENVOY: &str = "kvroute-envoy";
/// The engines' own `/metrics` (the dashboard's per-endpoint cache ratio reads vLLM's names).
const JOB_ENGINE: &str = "vllm";

/// A `promtool check metrics` problem we know of and cannot fix by renaming alone.
struct Known {
    /// Exact metric name, or a prefix ending in `*`.
    name: &'static str,
    /// promtool's problem text.
    problem: &'static str,
    /// Why it stays.
    reason: &'static str,
}

const NO_HELP: &str = "Envoy's /stats/prometheus writes no # HELP line for any stat, and \
    proxy-wasm's define_metric takes no help text: not fixable from the filter";
const MICROS: &str = "proxy-wasm histograms take integer samples, so the filter records \
    microseconds; promtool flags `_microseconds` too (\"use base unit seconds\"), and \
    `_seconds` would round every sample to 0";

/// The only problems `promtool check metrics` may report on kvroute series.
const KNOWN: &[Known] = &[
    Known {
        name: "kvroute_filter_*",
        problem: "no help text",
        reason: NO_HELP,
    },
    Known {
        name: "kvroute_filter_tokenize_us",
        problem: "metric names should not contain abbreviated units",
        reason: MICROS,
    },
    Known {
        name: "kvroute_filter_keys_us",
        problem: "metric names should not contain abbreviated units",
        reason: MICROS,
    },
    Known {
        name: "kvroute_filter_prepare_us",
        problem: "metric names should not contain abbreviated units",
        reason: MICROS,
    },
    Known {
        name: "kvroute_filter_callout_us",
        problem: "metric names should not contain abbreviated units",
        reason: MICROS,
    },
    Known {
        name: "kvroute_filter_duration_us",
        problem: "metric names should not contain abbreviated units",
        reason: MICROS,
    },
];

/// Label names kvroute series may carry: enums (engine, type, medium, outcome, cause, tier,
/// reason, direction, event, op), configuration (rule, ep, rank) and histogram buckets.
const LABELS: &[&str] = &[
    "engine",
    "type",
    "medium",
    "outcome",
    "cause",
    "tier",
    "reason",
    "direction",
    "event",
    "op",
    "rule",
    "ep",
    "rank",
    "le",
];

/// Series per metric name this test's fleet (one rule, two endpoints) may produce.
const MAX_SERIES_PER_NAME: usize = 32;

fn known_matches(k: &Known, name: &str, problem: &str) -> bool {
    let name_ok = match k.name.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == k.name,
    };
    name_ok && problem == k.problem
}

// ---------------------------------------------------------------------------------------------
// The fleet
// ---------------------------------------------------------------------------------------------

fn chat_body() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": envoy::MODEL,
        "messages": [
            {"role": "system", "content": "You watch a fleet of inference engines and their KV caches."},
            {"role": "user", "content": "Which metrics say that routing by prefix saves prefill, and which say that it does not?"},
        ],
        "max_tokens": 1
    }))
    .unwrap()
}

/// A vLLM simulator serving nothing but its `/metrics` (the engines' own names).
async fn engine_sim(dir: &TempDir) -> Result<(ChildGuard, SocketAddr)> {
    let bin = harness::repo_root().join("target/debug/kvroute-engine-sim");
    if !bin.is_file() {
        bail!("{} is not built: {}", bin.display(), harness::SETUP_HINT);
    }
    let mut cmd = Command::new(bin);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "vllm",
        "--name",
        "sim-metrics",
    ]);
    let mut child = ChildGuard::spawn("engine-sim", cmd, &dir.path().join("sim.log"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        child.ensure_running()?;
        if let Some(a) = child.log().lines().find_map(|l| {
            l.strip_prefix("listening on ")
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_owned)
        }) {
            return Ok((child, a.parse()?));
        }
        if Instant::now() >= deadline {
            bail!(
                "the simulator never printed its address:\n{}",
                child.log_tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn get_text(url: &str) -> String {
    reqwest::get(url)
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Asserts `promtool check metrics` reports only [`KNOWN`] problems on the kvroute series of
/// `text`, and that every known problem still occurs on some scrape.
fn assert_lint(scrapes: &[(&str, &str)]) {
    let mut unknown = Vec::new();
    let mut used = vec![false; KNOWN.len()];
    for (what, text) in scrapes {
        for (name, problem) in lint(text) {
            if !name.starts_with("kvroute_") {
                continue; // Envoy's own stats
            }
            match KNOWN.iter().position(|k| known_matches(k, &name, &problem)) {
                Some(i) => used[i] = true,
                None => unknown.push(format!("{what}: {name} {problem}")),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "promtool check metrics found problems not in KNOWN (fix the metric definition, or \
         add it to KNOWN with its reason if no rename can fix it):\n{}",
        unknown.join("\n")
    );
    let stale: Vec<String> = KNOWN
        .iter()
        .zip(&used)
        .filter(|(_, u)| !**u)
        .map(|(k, _)| format!("{} {} ({})", k.name, k.problem, k.reason))
        .collect();
    assert!(
        stale.is_empty(),
        "known problems that no longer occur (remove them from KNOWN):\n{}",
        stale.join("\n")
    );
}

/// Asserts every kvroute series carries only [`LABELS`], a bounded number of series per name,
/// and (filter stats) no labels at all.
fn assert_bounded_labels(what: &str, text: &str) {
    let samples = kvroute_samples(text);
    assert!(!samples.is_empty(), "{what}: no kvroute series");
    let mut per_name: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, labels) in &samples {
        *per_name.entry(name.as_str()).or_default() += 1;
        for (k, v) in labels {
            assert!(
                LABELS.contains(&k.as_str()),
                "{what}: {name} has label {k}={v:?}, not one of {LABELS:?}"
            );
            assert!(
                v.len() <= 64 && !v.contains(' '),
                "{what}: {name} {k}={v:?} does not look like an enum or config value"
            );
            if name.starts_with("kvroute_filter_") {
                assert_eq!(
                    k, "le",
                    "{what}: proxy-wasm stats have no labels: {name} {k}"
                );
            }
        }
    }
    for (name, n) in per_name {
        assert!(
            n <= MAX_SERIES_PER_NAME,
            "{what}: {name} has {n} series (more than {MAX_SERIES_PER_NAME})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn rules_pass_promtool_check_and_unit_tests() {
    let dir = deploy_dir().join("prometheus");
    let files: Vec<String> = rule_files()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    assert!(files.len() >= 2, "rule files: {files:?}");
    let mut args = vec!["check", "rules"];
    args.extend(files.iter().map(String::as_str));
    let (code, out) = promtool(&args, None, &dir).unwrap();
    assert_eq!(code, 0, "promtool check rules:\n{out}");

    let mut tests: Vec<String> = std::fs::read_dir(dir.join("tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| p.display().to_string())
        .collect();
    tests.sort();
    assert!(!tests.is_empty(), "no rule unit tests in {}", dir.display());
    let mut args = vec!["test", "rules"];
    args.extend(tests.iter().map(String::as_str));
    let (code, out) = promtool(&args, None, &dir).unwrap();
    assert!(
        code == 0 && !out.contains("FAILED"),
        "promtool test rules:\n{out}"
    );

    // Every alert has a unit test that fires it and one where it stays quiet.
    let cases: Vec<serde_yaml::Value> = tests
        .iter()
        .map(|t| {
            serde_yaml::from_str::<serde_yaml::Value>(&std::fs::read_to_string(t).unwrap()).unwrap()
        })
        .flat_map(|d| d["tests"].as_sequence().cloned().unwrap_or_default())
        .collect();
    let docs = std::fs::read_to_string(harness::repo_root().join("docs/monitoring.md")).unwrap();
    for rule in rules() {
        let Some(alert) = rule["alert"].as_str() else {
            continue;
        };
        let checks: Vec<&serde_yaml::Value> = cases
            .iter()
            .flat_map(|t| t["alert_rule_test"].as_sequence().into_iter().flatten())
            .filter(|c| c["alertname"].as_str() == Some(alert))
            .collect();
        let fires = checks
            .iter()
            .any(|c| c["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty()));
        let quiet = checks
            .iter()
            .any(|c| c["exp_alerts"].as_sequence().is_some_and(|a| a.is_empty()));
        assert!(
            fires && quiet,
            "{alert}: needs a unit test that fires it and one that does not"
        );
        assert!(
            docs.contains(&format!("### {alert}")),
            "docs/monitoring.md has no section for {alert}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_inventory_and_envoy_and_every_name_exists() {
    let body = chat_body();
    let a = Engine::start("engine-a").await.unwrap();
    let b = Engine::start("engine-b").await.unwrap();
    let tokens = harness::prompt_tokens(&body).unwrap();
    b.store_blocks(&tokens);
    let inv = Inventory::start().await.unwrap();
    let rule = inv.add_rule(&[&a, &b]).await.unwrap();
    inv.wait_for_blocks(rule, 1, tokens.len() / envoy::BLOCK)
        .await
        .unwrap();
    let engines = [&a, &b];
    let gw = Gateway::start(Bootstrap {
        engines: &engines,
        inventory: inv.addr,
        plugin: json!({}),
        variant: Variant::EnvoyFilter,
        without_filter: false,
        wasm: None,
    })
    .await
    .unwrap();
    gw.wait_until_routing(Duration::from_secs(60))
        .await
        .unwrap();

    // Three routed requests, answered as SSE with a usage chunk of 32 cached tokens each.
    const N: u64 = 3;
    for _ in 0..N {
        let r = gw
            .post("/v1/chat/completions", body.clone(), &[(SSE_HEADER, "1")])
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()[BACKEND_HEADER], "engine-b");
        r.bytes().await.unwrap();
    }
    // The usage chunk is counted when the response ends: wait for Envoy's own stat first.
    gw.envoy
        .wait_for_stat(
            "wasmcustom.kvroute_filter_cache_hit_tokens_total",
            Duration::from_secs(10),
            |v| v == 32 * N,
        )
        .await
        .unwrap();

    let dir = TempDir::new("prometheus-test").unwrap();
    let (_sim, sim_addr) = engine_sim(&dir).await.unwrap();
    let mut prom = Prometheus::start(&[
        (JOB_INVENTORY, "/metrics", inv.addr),
        (JOB_ENVOY, "/stats/prometheus", gw.envoy.admin),
        (JOB_ENGINE, "/metrics", sim_addr),
    ])
    .await
    .unwrap();

    // A kvroute series from each target, through the query API, equal to the target's own value.
    let inv_metrics = get_text(&format!("http://{}/metrics", inv.addr)).await;
    let hits_line = "kvroute_route_decisions_total{reason=\"hit\",tier=\"tier15\"} ";
    let hits: f64 = inv_metrics
        .lines()
        .find_map(|l| l.strip_prefix(hits_line))
        .unwrap_or_else(|| panic!("no {hits_line} in /metrics:\n{inv_metrics}"))
        .trim()
        .parse()
        .unwrap();
    assert!(hits >= N as f64, "{hits} tier15 hits for {N} requests");
    let timeout = Duration::from_secs(30);
    prom.wait_for_value(
        &format!(
            r#"kvroute_route_decisions_total{{job="{JOB_INVENTORY}", tier="tier15", reason="hit"}}"#
        ),
        hits,
        timeout,
    )
    .await
    .unwrap();
    prom.wait_for_value(
        &format!(r#"kvroute_filter_cache_hit_tokens_total{{job="{JOB_ENVOY}"}}"#),
        (32 * N) as f64,
        timeout,
    )
    .await
    .unwrap();
    let pinned = gw.stat("kvroute_filter_pinned_total").await.unwrap();
    assert!(pinned >= N, "{pinned} pins for {N} requests");
    prom.wait_for_value(
        &format!(r#"kvroute_filter_pinned_total{{job="{JOB_ENVOY}"}}"#),
        pinned as f64,
        timeout,
    )
    .await
    .unwrap();
    prom.wait_for_value(&format!(r#"up{{job="{JOB_ENGINE}"}}"#), 1.0, timeout)
        .await
        .unwrap();

    // The shipped rules load into a real Prometheus and evaluate without error.
    let loaded = prom.wait_for_rules(timeout).await.unwrap();
    assert_eq!(loaded, rules().len(), "rules loaded");

    // promtool on both scrapes; bounded labels.
    let envoy_metrics = get_text(&format!("http://{}/stats/prometheus", gw.envoy.admin)).await;
    assert!(
        envoy_metrics.contains("\nkvroute_filter_pinned_total"),
        "Envoy shows the filter's stats without the wasmcustom prefix:\n{}",
        envoy_metrics
            .lines()
            .filter(|l| l.contains("kvroute"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_lint(&[
        ("inventory /metrics", &inv_metrics),
        ("envoy /stats/prometheus", &envoy_metrics),
    ]);
    assert_bounded_labels("inventory /metrics", &inv_metrics);
    assert_bounded_labels("envoy /stats/prometheus", &envoy_metrics);

    // Names: what the real Prometheus saw, plus the recording rules (plus, for rules, the code).
    let seen: BTreeSet<String> = prom
        .api("label/__name__/values", &[])
        .await
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let recorded = recorded_names();
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 10, "dashboard expressions: {exprs:?}");
    for expr in &exprs {
        for name in metric_names(expr) {
            assert!(
                seen.contains(&name) || recorded.contains(&name),
                "deploy/grafana/kvroute.json: {name} (in {expr:?}) is neither scraped nor recorded"
            );
        }
        let q = expr.replace("$__rate_interval", "1m");
        prom.api("query", &[("query", q.as_str())])
            .await
            .unwrap_or_else(|e| panic!("dashboard expression {expr:?} is not valid PromQL: {e:#}"));
    }
    let defined = code_names();
    for rule in rules() {
        let expr = rule["expr"].as_str().unwrap();
        for name in metric_names(expr) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(
                seen.contains(&name) || recorded.contains(&name) || defined.contains(base),
                "deploy/prometheus: {name} (in {expr:?}) is not scraped, recorded or defined in the code"
            );
        }
    }
    prom.child.ensure_running().unwrap();
}
