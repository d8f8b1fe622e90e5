//! Smoke tests of the built filter: real Envoy 1.40 (V8) loads it and passes traffic through, and
//! the wasmi host can call its test export.
//!
//! The Envoy test cannot pass with the filter missing from the chain: it asserts the filter's own
//! start log line and its request counter (`wasmcustom.kvroute_filter_requests_total`), which only
//! the module running on the request path can produce.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use kvroute_tests::envoy;
use kvroute_tests::harness::{self, Backend, Envoy, BACKEND_HEADER};
use kvroute_tests::wasm::FilterModule;
use serde_json::{json, Value};

/// The filter's start line (filter/src/plugin.rs START_MESSAGE).
const START_MESSAGE: &str = concat!("kvroute-filter ", env!("CARGO_PKG_VERSION"), " started");
const REQUESTS_STAT: &str = "wasmcustom.kvroute_filter_requests_total";

/// A bootstrap with one listener running the kvroute Wasm filter in front of a STATIC cluster.
fn smoke_config(backend: &Backend) -> Value {
    let wasm = harness::wasm_module().expect("filter .wasm");
    let addr = |port: u16| json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
    let http_filters = json!([
        {
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "kvroute",
                    "failure_policy": "FAIL_OPEN",
                    "allow_on_headers_stop_iteration": true,
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": "{}"
                    },
                    "vm_config": {
                        "vm_id": "kvroute",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": {"local": {"filename": wasm}}
                    }
                }
            }
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
        }
    ]);
    let route = json!({"match": {"prefix": "/"}, "route": {"cluster": "engines"}});
    json!({
        "admin": {"address": addr(0)},
        "static_resources": {
            "listeners": [envoy::ingress_listener(0, route, http_filters)],
            "clusters": [{
                "name": "engines",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": "engines",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                        "address": "127.0.0.1", "port_value": backend.addr.port()
                    }}}}]}]
                }
            }]
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_loads_filter_and_passes_requests_through() {
    let backend = Backend::start("engine-a").await.unwrap();
    let mut envoy = Envoy::start(&smoke_config(&backend)).await.unwrap();
    let base = format!("http://{}", envoy.listener("ingress").unwrap());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    let get = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200);
    assert_eq!(get.headers()[BACKEND_HEADER], "engine-a");

    // A chat body with non-ASCII text and a long tail, so it crosses several body chunks.
    let body = serde_json::to_vec(&json!({
        "model": "Qwen/Qwen3-0.6B",
        "messages": [
            {"role": "system", "content": "Tu es un assistant précis. 你好 🚀"},
            {"role": "user", "content": "x".repeat(200_000)}
        ],
        "max_tokens": 1
    }))
    .unwrap();
    let post = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(post.status(), 200);
    assert_eq!(post.headers()[BACKEND_HEADER], "engine-a");
    let echoed = post.bytes().await.unwrap();
    assert!(
        echoed.as_ref() == body.as_slice(),
        "response body differs from the request body"
    );

    let received = backend.received();
    assert_eq!(received.len(), 2, "backend saw {} requests", received.len());
    assert_eq!(
        (received[0].method.as_str(), received[0].path.as_str()),
        ("GET", "/v1/models")
    );
    assert_eq!(
        (received[1].method.as_str(), received[1].path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert!(
        received[1].body.as_ref() == body.as_slice(),
        "backend received a different body"
    );

    // Proof the filter ran: its counter saw both requests, and its start line is in the log.
    let counted = envoy
        .wait_for_stat(REQUESTS_STAT, Duration::from_secs(10), |v| v >= 2)
        .await
        .unwrap();
    assert_eq!(counted, 2, "{REQUESTS_STAT}");
    envoy.ensure_running().unwrap();
    let log = envoy.log();
    assert!(
        log.contains(START_MESSAGE),
        "Envoy log lacks {START_MESSAGE:?}:\n{log}"
    );
    assert!(
        !log.contains("Wasm VM failed"),
        "Wasm VM failure in Envoy log:\n{log}"
    );
}

#[test]
fn wasm_host_computes_content_keys() {
    let mut module = FilterModule::load().unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let resp = module
        .test_keys(&json!({"algo": "tokens", "block_size": 16, "seed": null, "extra": null, "tokens": tokens}))
        .unwrap();
    let keys = resp["keys"]
        .as_array()
        .unwrap_or_else(|| panic!("no keys in {resp}"));
    assert_eq!(keys.len(), 4, "{resp}");
    assert!(keys.iter().all(Value::is_u64), "{resp}");

    // The same request twice gives the same keys: no hidden per-call state in the export.
    let again = module
        .test_keys(
            &json!({"algo": "tokens", "block_size": 16, "tokens": (0..64).collect::<Vec<u32>>()}),
        )
        .unwrap();
    assert_eq!(again, resp);

    let err = module
        .test_keys(&json!({"algo": "nope", "block_size": 16, "tokens": []}))
        .unwrap();
    assert!(err["error"].is_string(), "{err}");
}

#[test]
fn wasm_module_imports_only_the_proxy_wasm_abi() {
    let module = FilterModule::load().unwrap();
    let foreign: Vec<_> = module
        .imports()
        .iter()
        .filter(|i| !(i.module == "env" && i.name.starts_with("proxy_") && i.kind == "func"))
        .collect();
    assert!(
        foreign.is_empty(),
        "imports Envoy may not provide: {foreign:?}"
    );
    let exports = module.exports();
    for name in [
        "_initialize",
        "proxy_on_context_create",
        "proxy_on_request_headers",
        "kvroute_test_keys",
    ] {
        assert!(
            exports.iter().any(|e| e == name),
            "missing export {name}; exports: {exports:?}"
        );
    }
    // The crash hook exists only in the test build (`test-crash-hook`), never in this module.
    let bytes = std::fs::read(harness::wasm_module().unwrap()).unwrap();
    assert!(
        !bytes.windows(15).any(|w| w == b"x-test-crash-vm"),
        "the shipped module carries the test crash hook: rebuild it with scripts/build-wasm.sh"
    );
}
