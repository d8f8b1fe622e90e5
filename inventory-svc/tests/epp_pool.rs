//! The endpoint picker following its InferencePool (`--epp-pool`): the built service, an API
//! server that serves pods and InferencePools by the Kubernetes list/watch protocol
//! (`common/fake_kube.rs`: no kube-apiserver can run here), and a real ext_proc client. The rule
//! gets the pool's ready pods as endpoints as they come, go and change readiness; an empty pool is
//! `no_endpoint`; watch ends, 410s and an API server outage keep the last endpoints and converge
//! once it answers again; HTTPS with a CA and a token file that rotates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fake_kube.rs"]
mod fake_kube;

use std::time::Duration;

use common::{rule, tempdir, Service};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpHeaders, ProcessingRequest,
};
use fake_kube::FakeKube;
use serde_json::{json, Value};

const NS: &str = "llm";
const POOL: &str = "vllm-qwen3";
const RULE: &str = "10.0.0.1:9000";
const APP: (&str, &str) = ("app", "vllm-qwen3");
const DEST: &str = "x-gateway-destination-endpoint";

/// The picker's rule without endpoints: the pool's pods will be. A llama.cpp rule routes by
/// `sel` alone (no tokenizer to stage, ready at once).
fn template() -> Value {
    let mut r = rule(9000, "llamacpp", 5557, &[], json!({}));
    r.as_object_mut().unwrap().remove("endpoints");
    r
}

/// The service following the pool, with `env` and `extra` arguments; the API server is
/// `--kube-api` unless `extra` gives a CA file (then it is found from `env`, as in a pod).
fn start(
    tag: &str,
    kube: &FakeKube,
    rules: Value,
    (env, extra): (&[(&str, &str)], &[&str]),
) -> Service {
    let url = kube.url();
    let mut args = vec![
        "--epp-listen",
        "127.0.0.1:0",
        "--epp-rule",
        RULE,
        "--epp-pool",
        POOL,
        "--epp-pool-namespace",
        NS,
    ];
    if !extra.contains(&"--kube-ca-file") {
        args.extend(["--kube-api", url.as_str()]);
    }
    args.extend_from_slice(extra);
    Service::start_with_args(tag, &rules, env, &args)
}

/// The rule's endpoints as `ip:port`, sorted (empty when the rule is not installed).
async fn endpoints(svc: &Service) -> Vec<String> {
    let all = svc.get_json("/netlox/v1/config/loadbalancer/all").await;
    let mut out: Vec<String> = all["lbAttr"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["serviceArguments"]["port"] == json!(9000))
        .flat_map(|r| r["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| format!("{}:{}", e["endpointIP"].as_str().unwrap(), e["targetPort"]))
        .collect();
    out.sort();
    out
}

/// Waits until the picker has opened its `n`th watch of pods (so ending watches reaches it).
async fn wait_watches(svc: &Service, kube: &FakeKube, n: usize) {
    svc.wait_for(&format!("pod watch {n} to open"), 20, async || {
        kube.watches("pods") >= n
    })
    .await;
}

/// Waits until the pod watch has restarted at least once for `reason`.
async fn wait_restart(svc: &Service, reason: &str) {
    let series =
        format!("kvroute_epp_pool_watch_restarts_total{{collection=\"pods\",reason=\"{reason}\"}}");
    svc.wait_for(&format!("a pod watch restart ({reason})"), 20, async || {
        common::metric(&svc.metrics().await, &series).is_some_and(|v| v >= 1.0)
    })
    .await;
}

async fn wait_endpoints(svc: &Service, want: &[&str]) {
    let want: Vec<String> = want.iter().map(|s| (*s).to_owned()).collect();
    svc.wait_for(
        &format!("the rule's endpoints to be {want:?}"),
        20,
        async || endpoints(svc).await == want,
    )
    .await;
}

/// One header-only request through the picker: the destination it sets, if any.
async fn pick(svc: &Service) -> Option<String> {
    let url = format!("http://{}", svc.epp.clone().unwrap());
    let mut client = ExternalProcessorClient::connect(url).await.unwrap();
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    let req = ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![header(":path", "/v1/completions"), header(":method", "GET")],
            }),
            end_of_stream: true,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    };
    let mut answers = client
        .process(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let answer = tokio::time::timeout(Duration::from_secs(10), answers.message())
        .await
        .expect("an answer in time")
        .unwrap()
        .unwrap();
    let Some(processing_response::Response::RequestHeaders(h)) = answer.response else {
        panic!("a request headers answer: {answer:?}");
    };
    h.response
        .and_then(|c| c.header_mutation)
        .into_iter()
        .flat_map(|m| m.set_headers)
        .filter_map(|s| s.header)
        .find(|h| h.key == DEST)
        .map(|h| String::from_utf8(h.raw_value).unwrap())
}

async fn readiness(svc: &Service) -> i32 {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let url = format!("http://{}", svc.epp.clone().unwrap());
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = HealthClient::new(channel);
    c.check(HealthCheckRequest {
        service: "readiness".into(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
}

/// Pods come, go, change readiness and labels; the pool's selector and ports change; the pool
/// empties and is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rule_follows_the_pools_ready_pods() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let kube = FakeKube::start("127.0.0.1").await;
    kube.pool(NS, POOL, &[APP], &[8000, 8001]);
    kube.pod(NS, "a", "10.1.0.1", &[APP], true);
    kube.pod(NS, "b", "10.1.0.2", &[APP], false);
    kube.pod(NS, "c", "10.1.0.3", &[("app", "other")], true);
    kube.pod("elsewhere", "d", "10.1.0.4", &[APP], true);
    kube.pod(NS, "e", "", &[APP], false);
    let svc = start("pool-follow", &kube, json!([template()]), (&[], &[]));
    wait_endpoints(&svc, &["10.1.0.1:8000", "10.1.0.1:8001"]).await;
    svc.wait_for("readiness", 20, async || {
        readiness(&svc).await == ServingStatus::Serving as i32
    })
    .await;
    let p = pick(&svc).await.expect("a pick");
    assert!(p.starts_with("10.1.0.1:800"), "{p}");
    svc.assert_metrics(
        "kvroute_epp_pool_present 1
         kvroute_epp_pool_endpoints 2
         kvroute_epp_pool_pods{state=\"ready\"} 1
         kvroute_epp_pool_pods{state=\"not_ready\"} 2",
    )
    .await;

    // b turns ready; a starts terminating (still Ready: it must go anyway).
    kube.pod(NS, "b", "10.1.0.2", &[APP], true);
    wait_endpoints(
        &svc,
        &[
            "10.1.0.1:8000",
            "10.1.0.1:8001",
            "10.1.0.2:8000",
            "10.1.0.2:8001",
        ],
    )
    .await;
    kube.terminating("a");
    wait_endpoints(&svc, &["10.1.0.2:8000", "10.1.0.2:8001"]).await;
    // A pod that leaves the selector is gone from the pool.
    kube.pod(NS, "b", "10.1.0.2", &[("app", "moved")], true);
    svc.wait_metric("kvroute_epp_pool_endpoints", 0.0).await;
    // No ready pod: the rule keeps its last endpoints (it cannot be empty), the picker pins none.
    assert_eq!(endpoints(&svc).await, ["10.1.0.2:8000", "10.1.0.2:8001"]);
    assert_eq!(pick(&svc).await, None);
    svc.assert_metrics(
        "kvroute_epp_failures_total{reason=\"no_endpoint\"} 1
         kvroute_epp_requests_total{outcome=\"fail_open\"} 1
         kvroute_epp_pool_syncs_total{outcome=\"empty\"} 1",
    )
    .await;
    kube.delete_pod("a");
    kube.pod(NS, "e", "10.1.0.5", &[APP], true);
    wait_endpoints(&svc, &["10.1.0.5:8000", "10.1.0.5:8001"]).await;
    assert!(pick(&svc).await.unwrap().starts_with("10.1.0.5:"));

    // The pool's selector and ports change: its pods are listed again.
    kube.pool(NS, POOL, &[("app", "other")], &[9100]);
    wait_endpoints(&svc, &["10.1.0.3:9100"]).await;
    // The pool is deleted: the rule stays as it is.
    kube.delete_pool(POOL);
    svc.wait_metric("kvroute_epp_pool_present", 0.0).await;
    assert_eq!(endpoints(&svc).await, ["10.1.0.3:9100"]);
    let m = svc.metrics().await;
    // One install per distinct endpoint set above.
    common::assert_metrics(
        &m,
        "kvroute_epp_pool_syncs_total{outcome=\"installed\"} 5
         kvroute_epp_pool_syncs_total{outcome=\"rejected\"} 0
         kvroute_epp_pool_syncs_total{outcome=\"empty\"} 1",
    );
}

/// Watches the server ends are resumed, a compacted version is listed again, and an outage keeps
/// the last endpoints until the server answers again; then what changed meanwhile is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_faults_keep_the_last_endpoints_and_converge() {
    let mut kube = FakeKube::start("127.0.0.1").await;
    kube.pool(NS, POOL, &[APP], &[8000]);
    kube.pod(NS, "a", "10.2.0.1", &[APP], true);
    kube.pod(NS, "b", "10.2.0.2", &[APP], true);
    let svc = start("pool-faults", &kube, json!([template()]), (&[], &[]));
    wait_endpoints(&svc, &["10.2.0.1:8000", "10.2.0.2:8000"]).await;

    wait_watches(&svc, &kube, 1).await;
    kube.end_watches();
    wait_restart(&svc, "closed").await;
    kube.pod(NS, "c", "10.2.0.3", &[APP], true);
    wait_endpoints(&svc, &["10.2.0.1:8000", "10.2.0.2:8000", "10.2.0.3:8000"]).await;

    // The history is compacted: the resumed watch gets 410 and the pods are listed again.
    wait_watches(&svc, &kube, 2).await;
    kube.compact();
    wait_watches(&svc, &kube, 3).await;
    kube.pod(NS, "d", "10.2.0.4", &[APP], true);
    wait_endpoints(
        &svc,
        &[
            "10.2.0.1:8000",
            "10.2.0.2:8000",
            "10.2.0.3:8000",
            "10.2.0.4:8000",
        ],
    )
    .await;
    wait_restart(&svc, "expired").await;

    // An outage: nothing answers; the endpoints stay while the server is away.
    kube.stop().await;
    wait_restart(&svc, "error").await;
    kube.delete_pod("a");
    kube.pod(NS, "b", "10.2.0.2", &[APP], false);
    assert_eq!(endpoints(&svc).await.len(), 4, "kept through the outage");
    let p = pick(&svc).await.expect("still picking");
    assert!(p.starts_with("10.2.0."), "{p}");
    kube.resume().await;
    wait_endpoints(&svc, &["10.2.0.3:8000", "10.2.0.4:8000"]).await;
}

/// In-cluster addressing (`KUBERNETES_SERVICE_HOST`/`_PORT`) over HTTPS with a CA file and a
/// bearer token read from its file for every request: a rotated token is followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_a_ca_and_a_rotating_token() {
    let d = tempdir("pool-tls");
    let (ca, cert, key) = common::test_ca(&d);
    let kube = FakeKube::start_tls("127.0.0.1", &cert, &key).await;
    kube.require_token("first-token");
    kube.pool(NS, POOL, &[APP], &[8000]);
    kube.pod(NS, "a", "10.3.0.1", &[APP], true);
    let token = d.join("token");
    std::fs::write(&token, "first-token\n").unwrap();
    let (ca, token_arg) = (
        ca.to_string_lossy().into_owned(),
        token.to_string_lossy().into_owned(),
    );
    let port = kube.addr.port().to_string();
    let svc = start(
        "pool-tls",
        &kube,
        json!([template()]),
        (
            &[
                ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
                ("KUBERNETES_SERVICE_PORT", port.as_str()),
            ],
            &["--kube-ca-file", &ca, "--kube-token-file", &token_arg],
        ),
    );
    wait_endpoints(&svc, &["10.3.0.1:8000"]).await;

    // The server now wants another token: requests fail (401) until the file holds it.
    wait_watches(&svc, &kube, 1).await;
    kube.require_token("second-token");
    kube.end_watches();
    wait_restart(&svc, "error").await;
    assert!(svc.stderr().contains("HTTP 401"), "{}", svc.stderr());
    std::fs::write(&token, "second-token\n").unwrap();
    kube.pod(NS, "b", "10.3.0.2", &[APP], true);
    wait_endpoints(&svc, &["10.3.0.1:8000", "10.3.0.2:8000"]).await;
}

/// Without a template in `--config`, the picker waits for the rule; one posted to the
/// management API (with any endpoints) is its template from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_from_the_management_api_gets_the_pools_endpoints() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let kube = FakeKube::start("127.0.0.1").await;
    kube.pool(NS, POOL, &[APP], &[8000]);
    kube.pod(NS, "a", "10.4.0.1", &[APP], true);
    let svc = start("pool-api", &kube, json!([]), (&[], &[]));
    svc.wait_metric("kvroute_epp_pool_syncs_total{outcome=\"waiting\"}", 1.0)
        .await;
    assert_ne!(readiness(&svc).await, ServingStatus::Serving as i32);
    let posted = rule(9000, "llamacpp", 5557, &[("10.9.9.9".into(), 1)], json!({}));
    let (s, b) = svc.post_rule(&posted).await;
    assert_eq!(s, 200, "{b}");
    wait_endpoints(&svc, &["10.4.0.1:8000"]).await;
    svc.wait_for("readiness", 20, async || {
        readiness(&svc).await == ServingStatus::Serving as i32
    })
    .await;
}

/// An endpoint-less rule in `--config` is the pool's template only for the picker's rule.
#[test]
fn an_endpointless_rule_must_be_the_pickers() {
    let d = tempdir("pool-config");
    let cfg = d.join("rules.json");
    let mut other = template();
    other["serviceArguments"]["port"] = json!(9001);
    std::fs::write(&cfg, json!([other]).to_string()).unwrap();
    let run = |extra: &[&str]| {
        let err = d.join("stderr.log");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"))
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .args(["--epp-listen", "127.0.0.1:0", "--epp-rule", RULE])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let status = kvroute_test_support::wait_exit(&mut child, Duration::from_secs(20));
        assert_eq!(status.unwrap().code(), Some(1));
        std::fs::read_to_string(&err).unwrap()
    };
    let e = run(&["--epp-pool", POOL, "--kube-api", "http://127.0.0.1:1"]);
    assert!(
        e.contains("10.0.0.1:9001/tcp") && e.contains("not the --epp-rule"),
        "{e}"
    );
    let e = run(&[]);
    assert!(e.contains("endpoints"), "{e}");
}

/// A prefill/decode pool (`kvExactMode` 1): each pod's `llm-d.ai/role` label gives its endpoint's
/// `ep_role`; a ready pod without one makes the rule invalid, which is refused and counted, and
/// the rule stays as it was until the pod is labelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_decode_pool_takes_roles_from_the_llm_d_label() {
    let kube = FakeKube::start("127.0.0.1").await;
    kube.pool(NS, POOL, &[APP], &[8000]);
    let role = |r| [APP, ("llm-d.ai/role", r)];
    kube.pod(NS, "p", "10.5.0.1", &role("prefill"), true);
    kube.pod(NS, "d", "10.5.0.2", &role("decode"), true);
    let mut pd = rule(9000, "vllm", 5557, &[], json!({"kvExactMode": 1}));
    pd.as_object_mut().unwrap().remove("endpoints");
    let svc = start("pool-pd", &kube, json!([pd]), (&[], &[]));
    let roles = async || -> Vec<(String, i64)> {
        let all = svc.get_json("/netlox/v1/config/loadbalancer/all").await;
        all["lbAttr"][0]["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["endpointIP"].as_str().unwrap().to_owned(),
                    e["ep_role"].as_i64().unwrap_or(0),
                )
            })
            .collect()
    };
    wait_endpoints(&svc, &["10.5.0.1:8000", "10.5.0.2:8000"]).await;
    assert_eq!(
        roles().await,
        [("10.5.0.1".to_owned(), 1), ("10.5.0.2".to_owned(), 2)]
    );
    // An unlabelled pod: no role, so no valid rule; the last one stays.
    kube.pod(NS, "x", "10.5.0.3", &[APP], true);
    svc.wait_metric("kvroute_epp_pool_syncs_total{outcome=\"rejected\"}", 1.0)
        .await;
    assert_eq!(endpoints(&svc).await, ["10.5.0.1:8000", "10.5.0.2:8000"]);
    assert!(svc.stderr().contains("ep_role"), "{}", svc.stderr());
    kube.pod(NS, "x", "10.5.0.3", &role("decode"), true);
    wait_endpoints(&svc, &["10.5.0.1:8000", "10.5.0.2:8000", "10.5.0.3:8000"]).await;
    assert_eq!(roles().await[2], ("10.5.0.3".to_owned(), 2));
}
