//! The configurations shipped in envoy/ parse and carry what the filter needs: envoy.yaml (also
//! validated by Envoy itself), the Istio EnvoyFilter pair, the WasmPlugin with its companion
//! filters (compared with the exact filters the WasmPlugin e2e test runs), the engines' Service and
//! DestinationRule, and the inventory Deployment/Service.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use kvroute_tests::envoy::{
    reload_config, strip_filter, wasmplugin_companions, FAILURE_POLICY, PIN_HEADER,
};
use kvroute_tests::harness::{self, TempDir};
use serde_json::Value;

/// Every plugin configuration field the filter accepts (filter/src/config.rs; unknown ones are refused).
const PLUGIN_FIELDS: [&str; 13] = [
    "rule",
    "inventory_cluster",
    "inventory_authority",
    "timeout_ms",
    "max_body_bytes",
    "pin_header",
    "tokenize",
    "tokenizer",
    "model",
    "refresh_ms",
    "pin_mode",
    "route_token",
    "_comment",
];

fn path(rel: &str) -> PathBuf {
    harness::repo_root().join("envoy").join(rel)
}

/// All YAML documents of a file, as JSON values.
fn docs(rel: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(path(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            serde_json::to_value(<serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap())
                .unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn check_plugin_config(cfg: &Value, what: &str) {
    let obj = cfg
        .as_object()
        .unwrap_or_else(|| panic!("{what}: plugin configuration is not an object: {cfg}"));
    for k in obj.keys() {
        assert!(
            PLUGIN_FIELDS.contains(&k.as_str()),
            "{what}: unknown plugin field {k}"
        );
    }
    for required in ["rule", "inventory_cluster", "pin_header"] {
        assert!(obj.contains_key(required), "{what}: {required} missing");
    }
    assert_eq!(cfg["pin_header"], PIN_HEADER, "{what}");
}

#[test]
fn envoy_yaml_has_the_filter_pinning_and_health_checks() {
    let d = docs("envoy.yaml");
    let bootstrap = &d[0];
    let hcm = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let filters: Vec<&str> = hcm["http_filters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.http.header_mutation",
            "envoy.filters.http.wasm",
            "envoy.filters.http.stateful_session",
            "envoy.filters.http.router"
        ]
    );
    let f = &hcm["http_filters"];
    // The strip filter and the failure policy are exactly what the e2e tests run.
    assert_eq!(f[0], strip_filter());
    let wasm = &f[1]["typed_config"]["config"];
    assert_eq!(wasm["failure_policy"], FAILURE_POLICY);
    assert_eq!(wasm["reload_config"], reload_config());
    assert_eq!(wasm["allow_on_headers_stop_iteration"], true);
    assert_eq!(wasm["vm_config"]["runtime"], "envoy.wasm.runtime.v8");
    let plugin: Value =
        serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
    check_plugin_config(&plugin, "envoy.yaml");
    let session = &f[2]["typed_config"];
    assert_eq!(session["strict"], false);
    assert_eq!(session["session_state"]["typed_config"]["name"], PIN_HEADER);
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    assert!(route["request_body_buffer_limit"].as_u64().unwrap() >= 4 << 20);
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array()
        .unwrap();
    let engines = clusters.iter().find(|c| c["name"] == "engines").unwrap();
    assert!(engines["health_checks"][0]["http_health_check"]["path"].is_string());
    assert_eq!(
        engines["outlier_detection"]["successful_active_health_check_uneject_host"],
        false
    );
    // A killed engine: its refused connections eject it and are retried elsewhere
    // (stack_e2e.rs measures the client errors under load).
    assert_eq!(
        engines["outlier_detection"]["split_external_local_origin_errors"],
        true
    );
    assert_eq!(
        engines["outlier_detection"]["consecutive_local_origin_failure"],
        2
    );
    let retry = &route["route"]["retry_policy"];
    assert_eq!(
        retry["retry_on"],
        "connect-failure,refused-stream,reset-before-request"
    );
    assert_eq!(
        retry["retry_host_predicate"][0]["name"],
        "envoy.retry_host_predicates.previous_hosts"
    );
    assert!(
        clusters
            .iter()
            .any(|c| c["name"] == plugin["inventory_cluster"]),
        "inventory cluster missing"
    );
}

/// `envoy --mode validate` on `cfg`; panics with Envoy's output when it refuses.
fn envoy_accepts(cfg: &std::path::Path) {
    let Ok(envoy) = harness::envoy_bin() else {
        panic!("Envoy missing: {}", harness::SETUP_HINT);
    };
    let out = Command::new(envoy)
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "--config-path",
        ])
        .arg(cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "envoy --mode validate failed on {}:\n{}{}",
        cfg.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Envoy 1.40 itself accepts envoy.yaml (with the module path pointed at the built .wasm).
#[test]
fn envoy_validates_envoy_yaml() {
    let Ok(wasm) = harness::wasm_module() else {
        panic!("the .wasm is missing: {}", harness::SETUP_HINT);
    };
    let text = std::fs::read_to_string(path("envoy.yaml")).unwrap();
    let text = text.replace(
        "/etc/kvroute/kvroute_filter.wasm",
        &wasm.display().to_string(),
    );
    let dir = TempDir::new("validate").unwrap();
    let cfg = dir.path().join("envoy.yaml");
    std::fs::write(&cfg, text).unwrap();
    envoy_accepts(&cfg);
}

/// scripts/local_envoy.py (what stack.sh and bench_gateways.sh run) puts every simulator in the
/// engines cluster — the shipped file has two examples, and a demo once ran on two of three — and
/// Envoy accepts the result.
#[test]
fn local_envoy_config_lists_every_engine() {
    let Ok(wasm) = harness::wasm_module() else {
        panic!("the .wasm is missing: {}", harness::SETUP_HINT);
    };
    let dir = TempDir::new("local-envoy").unwrap();
    let cfg = dir.path().join("envoy.yaml");
    let sims = ["127.0.0.10", "127.0.0.11", "127.0.0.12"];
    let out = Command::new("python3")
        .arg(harness::repo_root().join("scripts/local_envoy.py"))
        .arg(path("envoy.yaml"))
        .arg(&cfg)
        .args([
            "--wasm",
            &wasm.display().to_string(),
            "--rule",
            "3",
            "--timeout-ms",
            "100",
        ])
        .args([
            "--listen",
            "10000",
            "--admin",
            "9901",
            "--inventory",
            "8090",
        ])
        .args(["--sim-port", "8000", "--sims", &sims.join(",")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    let y: Value = serde_yaml::from_str(&text).unwrap();
    let clusters = y["static_resources"]["clusters"].as_array().unwrap();
    let engines = clusters.iter().find(|c| c["name"] == "engines").unwrap();
    let hosts: Vec<String> = engines["load_assignment"]["endpoints"][0]["lb_endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let a = &e["endpoint"]["address"]["socket_address"];
            format!("{}:{}", a["address"].as_str().unwrap(), a["port_value"])
        })
        .collect();
    assert_eq!(
        hosts,
        sims.iter()
            .map(|ip| format!("{ip}:8000"))
            .collect::<Vec<_>>()
    );
    assert!(text.contains(r#""rule": "3""#) && text.contains(r#""timeout_ms": 100,"#));
    assert!(!text.contains("10.0.0."), "an example address was left");
    envoy_accepts(&cfg);
}

#[test]
fn istio_envoyfilter_pair_is_complete() {
    let d = docs("istio/envoyfilter.yaml");
    let ext = find(&d, "EnvoyFilter", "kvroute-filter-config");
    let patch = &ext["spec"]["configPatches"][0];
    assert_eq!(patch["applyTo"], "EXTENSION_CONFIG");
    let value = &patch["patch"]["value"];
    let cfg = &value["typed_config"]["config"];
    assert_eq!(cfg["allow_on_headers_stop_iteration"], true);
    assert_eq!(cfg["failure_policy"], FAILURE_POLICY);
    assert_eq!(cfg["reload_config"], reload_config());
    check_strip(&d);
    let remote = &cfg["vm_config"]["code"]["remote"];
    assert!(remote["http_uri"]["uri"]
        .as_str()
        .unwrap()
        .starts_with("https://"));
    let sha = remote["sha256"].as_str().unwrap();
    assert!(
        sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
        "sha256 {sha}"
    );
    let plugin: Value =
        serde_json::from_str(cfg["configuration"]["value"].as_str().unwrap()).unwrap();
    check_plugin_config(&plugin, "envoyfilter.yaml");
    check_inventory_cluster(plugin["inventory_cluster"].as_str().unwrap());

    let insert = find(&d, "EnvoyFilter", "kvroute-filter-insert");
    let p = &insert["spec"]["configPatches"][0];
    assert_eq!(p["applyTo"], "HTTP_FILTER");
    assert_eq!(p["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(
        p["patch"]["value"]["name"], value["name"],
        "the insert must name the extension config"
    );
    assert_eq!(
        p["patch"]["value"]["config_discovery"]["type_urls"][0],
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    );
}

/// The EnvoyFilter that puts the tested strip filter first in the gateway's chain.
fn check_strip(docs: &[Value]) {
    let ef = find(docs, "EnvoyFilter", "kvroute-strip-routing-headers");
    let p = &ef["spec"]["configPatches"][0];
    assert_eq!(p["applyTo"], "HTTP_FILTER");
    assert_eq!(p["patch"]["operation"], "INSERT_FIRST");
    assert_eq!(p["patch"]["value"], strip_filter());
}

/// `outbound|PORT||SERVICE.NAMESPACE.svc.cluster.local` must name the shipped inventory Service.
fn check_inventory_cluster(cluster: &str) {
    let parts: Vec<&str> = cluster.split('|').collect();
    assert_eq!(
        (parts.len(), parts[0], parts[2]),
        (4, "outbound", ""),
        "{cluster}"
    );
    let host: Vec<&str> = parts[3].split('.').collect();
    assert_eq!(&host[2..], ["svc", "cluster", "local"], "{cluster}");
    let inv = docs("istio/inventory.yaml");
    let svc = find(&inv, "Service", host[0]);
    assert_eq!(svc["metadata"]["namespace"], host[1]);
    let port: u64 = parts[1].parse().unwrap();
    assert!(
        svc["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == port),
        "{cluster}"
    );
}

#[test]
fn istio_wasmplugin_and_companions_match_the_tested_filters() {
    let d = docs("istio/wasmplugin.yaml");
    let wp = find(&d, "WasmPlugin", "kvroute");
    let spec = &wp["spec"];
    assert!(
        spec["url"].as_str().unwrap().starts_with("oci://")
            || spec["url"].as_str().unwrap().starts_with("https://")
    );
    assert_eq!(spec["sha256"].as_str().unwrap().len(), 64);
    assert_eq!(spec["failStrategy"], "FAIL_OPEN");
    check_plugin_config(&spec["pluginConfig"], "wasmplugin.yaml");
    assert_eq!(
        spec["pluginConfig"]["pin_mode"], "filter_state",
        "a WasmPlugin cannot hold the headers"
    );
    check_inventory_cluster(spec["pluginConfig"]["inventory_cluster"].as_str().unwrap());

    // The companion filters are exactly those the WasmPlugin e2e test runs, in the same order.
    let c = docs("istio/wasmplugin-companions.yaml");
    check_strip(&c);
    let ef = find(&c, "EnvoyFilter", "kvroute-wasmplugin-companions");
    let shipped: Vec<Value> = ef["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert_eq!(p["patch"]["operation"], "INSERT_BEFORE");
            assert_eq!(
                p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
                "envoy.filters.http.stateful_session"
            );
            p["patch"]["value"].clone()
        })
        .collect();
    assert_eq!(shipped, wasmplugin_companions());
}

#[test]
fn istio_engines_service_and_destination_rule() {
    let d = docs("istio/engines.yaml");
    let svc = d.iter().find(|x| x["kind"] == "Service").unwrap();
    assert_eq!(
        svc["metadata"]["labels"]["istio.io/persistent-session-header"],
        PIN_HEADER
    );
    let dr = d.iter().find(|x| x["kind"] == "DestinationRule").unwrap();
    let ns = svc["metadata"]["namespace"].as_str().unwrap();
    let name = svc["metadata"]["name"].as_str().unwrap();
    assert_eq!(dr["spec"]["host"], format!("{name}.{ns}.svc.cluster.local"));
    assert!(
        dr["spec"]["trafficPolicy"]["outlierDetection"]["consecutive5xxErrors"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(dr["spec"]["trafficPolicy"]["loadBalancer"]["simple"].is_string());
    let od = &dr["spec"]["trafficPolicy"]["outlierDetection"];
    assert_eq!(od["splitExternalLocalOriginErrors"], true);
    assert_eq!(od["consecutiveLocalOriginFailures"], 2);
    let vs = d.iter().find(|x| x["kind"] == "VirtualService").unwrap();
    assert_eq!(vs["spec"]["hosts"][0], dr["spec"]["host"]);
    assert_eq!(
        vs["spec"]["http"][0]["retries"]["retryOn"],
        "connect-failure,refused-stream,reset-before-request"
    );

    let inv = docs("istio/inventory.yaml");
    let dep = find(&inv, "Deployment", "kvroute-inventory");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "serve");
    for flag in ["--listen", "--tokenizer-dir"] {
        assert!(args.contains(&flag), "{flag} missing");
    }
    let rules = find(&inv, "ConfigMap", "kvroute-rules");
    let parsed: Value =
        serde_yaml::from_str(rules["data"]["rules.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(parsed[0]["serviceArguments"]["kvBlockSize"], 16);
}
