//! The endpoint picker at the gRPC level: the built service with `--epp-listen`, driven by a
//! real ext_proc client (envoy-types' generated client over tonic) as Envoy drives it, in both
//! body modes. Checks the protocol's answers (header and `envoy.lb` metadata, the subset, the
//! client's destination overwritten, the body returned byte for byte), every failure per mode
//! with its metric, gRPC health, and that the HTTP callout and the picker make the same decisions
//! on the same state.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{rule, Service};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, CommonResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value as PbValue};
use serde_json::{json, Value};
use tokio::sync::mpsc;

const DEST: &str = "x-gateway-destination-endpoint";
/// Bound on any one answer (a hung picker fails the test instead of hanging it).
const ANSWER: Duration = Duration::from_secs(10);

fn qwen3_fixture() -> std::path::PathBuf {
    let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").exists(),
        "tokenizer fixture missing at {}: run ./scripts/setup.sh",
        dir.display()
    );
    dir
}

/// A two-endpoint vLLM rule routing on Qwen3's tokens.
fn qwen_rule(model: bool) -> Value {
    let mut r = rule(
        9000,
        "vllm",
        5557,
        &[("127.0.0.2".into(), 8000), ("127.0.0.3".into(), 8000)],
        json!({}),
    );
    if model {
        r["serviceArguments"]["kvModel"] = json!("Qwen/Qwen3-0.6B");
    }
    r
}

/// The service with the picker on a free port, the Qwen3 tokenizer staged when `stage`.
struct Picker {
    svc: Service,
    url: String,
}

impl Picker {
    fn start(tag: &str, rules: Value, stage: bool, extra: &[&str]) -> Picker {
        let mut args = vec!["--epp-listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        if !extra.contains(&"--epp-rule") {
            args.extend(["--epp-rule", "1"]);
        }
        // A loaded debug build must not turn a decision into a timeout failure.
        args.extend(["--epp-timeout-ms", "20000"]);
        let env = [
            ("LOXILB_KV_SPILL_RELIEF", "off"),
            ("KVROUTE_SPEC_TTL_MS", "600000"),
        ];
        let svc = Service::start_with_args(tag, &rules, &env, &args);
        if stage {
            let staged = svc.dir.join("tokenizers").join("Qwen__Qwen3-0.6B");
            std::fs::create_dir_all(&staged).unwrap();
            for f in ["tokenizer.json", "tokenizer_config.json"] {
                std::fs::copy(qwen3_fixture().join(f), staged.join(f)).unwrap();
            }
        }
        let url = format!("http://{}", svc.epp.clone().expect("the picker's address"));
        Picker { svc, url }
    }

    async fn client(&self) -> ExternalProcessorClient<tonic::transport::Channel> {
        let url = self.url.clone();
        kvroute_test_support::Poll::new("the picker to accept gRPC", Duration::from_secs(10))
            .every(Duration::from_millis(20))
            .until(async || {
                Ok(match ExternalProcessorClient::connect(url.clone()).await {
                    Ok(c) => kvroute_test_support::Probe::Ready(c),
                    Err(e) => kvroute_test_support::Probe::Pending(e.to_string()),
                })
            })
            .await
            .unwrap()
    }

    /// The gRPC health status of `service`.
    async fn health(&self, service: &str) -> i32 {
        use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
        let _ = self.client().await;
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
    }

    /// Waits until the picker reports ready (its rule's tokenizer loaded).
    async fn wait_ready(&self) {
        use tonic_health::pb::health_check_response::ServingStatus;
        self.svc
            .wait_for("the picker's readiness", 20, async || {
                self.health("readiness").await == ServingStatus::Serving as i32
            })
            .await;
    }

    /// Opens one ext_proc stream.
    async fn open(&self) -> Exchange {
        let (tx, rx) = mpsc::channel(64);
        let out = self
            .client()
            .await
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Exchange { tx, rx: out }
    }

    /// One request through the picker in `mode`: what the proxy would do with the answers.
    async fn ask(&self, mode: BodySendMode, req: &Req<'_>) -> Seen {
        let mut x = self.open().await;
        x.send(headers(mode, req)).await;
        let mut seen = Seen::default();
        match mode {
            BodySendMode::FullDuplexStreamed => {
                for (i, chunk) in req.body.chunks(req.chunk).enumerate() {
                    let last = (i + 1) * req.chunk >= req.body.len();
                    x.send(body(chunk, last)).await;
                }
                loop {
                    let r = x.recv().await;
                    if seen.take(r) {
                        break;
                    }
                }
            }
            _ => {
                let r = x.recv().await;
                if seen.take(r) {
                    return seen;
                }
                x.send(body(req.body, true)).await;
                let r = x.recv().await;
                seen.take(r);
            }
        }
        seen
    }

    /// The same request as an HTTP callout question (offloaded messages), with `explain` or not.
    async fn http(&self, messages: &Value, explain: bool) -> Value {
        let (s, a) = self
            .svc
            .post(
                "/v1/route",
                &json!({"rule": "1", "model": "Qwen/Qwen3-0.6B", "messages": messages, "explain": explain})
                    .to_string(),
                None,
            )
            .await;
        assert_eq!(s, 200, "{a}\n{}", self.svc.stderr());
        a
    }
}

struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Exchange {
    async fn send(&mut self, r: ProcessingRequest) {
        self.tx.send(r).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(ANSWER, self.rx.message())
            .await
            .expect("an answer in time")
            .expect("no gRPC error")
            .expect("the stream stays open")
    }
}

/// One request as the proxy sends it.
struct Req<'a> {
    body: &'a [u8],
    /// Full-duplex chunk size.
    chunk: usize,
    /// A destination the client set itself.
    spoof: Option<&'a str>,
    subset: Option<Vec<&'a str>>,
    /// The conversation id (`x-conversation-id`).
    session: Option<&'a str>,
}

impl<'a> Req<'a> {
    fn new(body: &'a [u8]) -> Req<'a> {
        Req {
            body,
            chunk: 4096,
            spoof: None,
            subset: None,
            session: None,
        }
    }
}

fn headers(mode: BodySendMode, req: &Req<'_>) -> ProcessingRequest {
    let mut hs = vec![
        HeaderValue {
            key: ":path".into(),
            raw_value: b"/v1/chat/completions".to_vec(),
            ..HeaderValue::default()
        },
        HeaderValue {
            key: ":method".into(),
            raw_value: b"POST".to_vec(),
            ..HeaderValue::default()
        },
    ];
    if let Some(s) = req.spoof {
        hs.push(HeaderValue {
            key: DEST.into(),
            raw_value: s.as_bytes().to_vec(),
            ..HeaderValue::default()
        });
    }
    if let Some(s) = req.session {
        hs.push(HeaderValue {
            key: "x-conversation-id".into(),
            raw_value: s.as_bytes().to_vec(),
            ..HeaderValue::default()
        });
    }
    let metadata_context = req.subset.as_ref().map(|s| Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    PbValue {
                        kind: Some(Kind::ListValue(ListValue {
                            values: s
                                .iter()
                                .map(|a| PbValue {
                                    kind: Some(Kind::StringValue((*a).into())),
                                })
                                .collect(),
                        })),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Metadata::default()
    });
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            ..ProtocolConfiguration::default()
        }),
        metadata_context,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers: hs }),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body(b: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// What the proxy would have done with the picker's answers.
#[derive(Debug, Default)]
struct Seen {
    /// The destination header's value after every mutation (`None`: removed or never set).
    header: Option<String>,
    /// Whether the client's destination was removed or overwritten.
    client_header_dropped: bool,
    /// `envoy.lb` / `x-gateway-destination-endpoint`.
    metadata: Option<String>,
    /// Streamed body chunks, concatenated.
    body: Vec<u8>,
    body_ended: bool,
    /// An immediate response's status.
    rejected: Option<i32>,
    route_cleared: bool,
    /// `x-prefiller-host-port` as set (a prefill/decode pick).
    prefiller: Option<String>,
}

impl Seen {
    /// Applies one answer; true once the request path is fully answered.
    fn take(&mut self, r: ProcessingResponse) -> bool {
        if let Some(md) = &r.dynamic_metadata {
            if let Some(Kind::StructValue(ns)) =
                md.fields.get("envoy.lb").and_then(|v| v.kind.clone())
            {
                if let Some(Kind::StringValue(ep)) =
                    ns.fields.get(DEST).and_then(|v| v.kind.clone())
                {
                    self.metadata = Some(ep);
                }
            }
        }
        match r.response.unwrap() {
            processing_response::Response::RequestHeaders(h) => {
                self.common(h.response);
                false
            }
            processing_response::Response::RequestBody(b) => {
                let streamed = b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.clone());
                self.common(b.response);
                match streamed {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => {
                        self.body.extend_from_slice(&s.body);
                        self.body_ended = s.end_of_stream;
                        s.end_of_stream
                    }
                    Some(other) => panic!("the body was mutated: {other:?}"),
                    // A buffered body answer ends the request path.
                    None => true,
                }
            }
            processing_response::Response::ImmediateResponse(i) => {
                self.rejected = Some(i.status.unwrap().code);
                true
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }

    fn common(&mut self, c: Option<CommonResponse>) {
        let Some(c) = c else { return };
        self.route_cleared |= c.clear_route_cache;
        if let Some(m) = c.header_mutation {
            if m.remove_headers.iter().any(|h| h == DEST) {
                self.header = None;
                self.client_header_dropped = true;
            }
            for s in m.set_headers {
                let h = s.header.unwrap();
                if h.key == "x-prefiller-host-port" {
                    assert_eq!(s.append_action, 2, "OVERWRITE_IF_EXISTS_OR_ADD");
                    self.prefiller = Some(String::from_utf8(h.raw_value.clone()).unwrap());
                }
                if h.key == DEST {
                    assert_eq!(s.append_action, 2, "OVERWRITE_IF_EXISTS_OR_ADD");
                    self.header = Some(String::from_utf8(h.raw_value).unwrap());
                    self.client_header_dropped = true;
                }
            }
        }
    }

    /// The pinned endpoint (the list's first); header and metadata must agree.
    fn pinned(&self) -> Option<&str> {
        self.list().map(|l| l.split(',').next().unwrap_or(l))
    }

    /// The whole destination list (`chosen,fallback,...`).
    fn list(&self) -> Option<&str> {
        assert_eq!(
            self.header, self.metadata,
            "header and metadata agree: {self:?}"
        );
        if self.header.is_some() {
            assert!(self.route_cleared, "the proxy is asked to route again");
        }
        self.header.as_deref()
    }
}

fn chat(messages: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "Qwen/Qwen3-0.6B", "messages": messages})).unwrap()
}

fn conversation(topic: &str, turns: usize) -> Value {
    let mut m = vec![
        json!({"role": "system", "content": format!("You are an expert on {topic}. {}", "Answer with care and cite the relevant standard where one exists. ".repeat(12))}),
    ];
    for t in 0..turns {
        m.push(json!({"role": "user", "content": format!("Question {t} about {topic}: explain the part that matters most.")}));
        m.push(json!({"role": "assistant", "content": format!("Answer {t} about {topic}: it depends on the block size and on eviction.")}));
    }
    m.push(json!({"role": "user", "content": format!("And one more thing about {topic}?")}));
    Value::Array(m)
}

/// The same conversations asked alternately through the HTTP callout and the picker: before each
/// request, the callout's explain (no side effects) predicts the decision, and the door that then
/// really asks gets exactly that endpoint; a follow-up asked through the other door hits the
/// blocks its first turn was credited with. One decision function, one state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callout_and_the_picker_make_the_same_decisions() {
    let p = Picker::start("epp-same", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    let topics = ["routers", "tokenizers", "caches", "schedulers"];
    let mut first: Vec<Option<String>> = vec![None; topics.len()];
    let mut n = 0;
    for turns in 0..3 {
        for (ti, topic) in topics.iter().enumerate() {
            let messages = conversation(topic, turns);
            let predicted = p.http(&messages, true).await;
            let want = predicted["endpoint"].as_str().unwrap().to_owned();
            let (got, reason) = match n % 3 {
                0 => {
                    let a = p.http(&messages, false).await;
                    (
                        a["endpoint"].as_str().unwrap().to_owned(),
                        a["reason"].clone(),
                    )
                }
                1 => {
                    let s = p
                        .ask(
                            BodySendMode::FullDuplexStreamed,
                            &Req::new(&chat(&messages)),
                        )
                        .await;
                    (s.pinned().unwrap().to_owned(), predicted["reason"].clone())
                }
                _ => {
                    let s = p
                        .ask(BodySendMode::Buffered, &Req::new(&chat(&messages)))
                        .await;
                    (s.pinned().unwrap().to_owned(), predicted["reason"].clone())
                }
            };
            assert_eq!(
                got, want,
                "request {n} ({topic}, {turns} turns): {predicted}"
            );
            match &first[ti] {
                None => first[ti] = Some(got),
                Some(home) => {
                    assert_eq!(&got, home, "{topic} stays on its endpoint");
                    assert_eq!(
                        reason, "hit",
                        "a follow-up hits its credited prefix: {predicted}"
                    );
                    assert!(predicted["matched_blocks"].as_u64().unwrap() > 0);
                }
            }
            n += 1;
        }
    }
    p.svc
        .assert_metrics(&format!(
            "kvroute_epp_requests_total{{outcome=\"picked\"}} {}",
            (0..n).filter(|i| i % 3 != 0).count()
        ))
        .await;
}

/// A conversation bound through the HTTP callout is pinned by the picker to the same endpoint
/// (its `x-conversation-id` header), ahead of the prefix another endpoint holds: one session
/// table behind both doors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_bound_through_the_callout_holds_through_the_picker() {
    let p = Picker::start("epp-session", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    let route = async |messages: &Value, session: &str, explain: bool| {
        let (s, a) = p
            .svc
            .post(
                "/v1/route",
                &json!({"rule": "1", "model": "Qwen/Qwen3-0.6B", "messages": messages,
                        "session": session, "explain": explain})
                .to_string(),
                None,
            )
            .await;
        assert_eq!(s, 200, "{a}");
        a
    };
    // The prefix of `b` is credited to one endpoint; `s1` is bound to the other through a
    // conversation that was placed there.
    let b = conversation("compilers", 1);
    let held = p.http(&b, false).await["endpoint"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut home = None;
    for topic in ["routers", "tokenizers", "caches", "schedulers"] {
        let s = format!("s-{topic}");
        let a = route(&conversation(topic, 0), &s, false).await;
        if a["endpoint"] != held.as_str() {
            home = Some((s, a["endpoint"].as_str().unwrap().to_owned()));
            break;
        }
    }
    let (session, home) = home.expect("a conversation placed on the other endpoint");
    // Without the session, `b`'s follow-up goes where its prefix is.
    let b2 = conversation("compilers", 2);
    assert_eq!(p.http(&b2, true).await["endpoint"], held.as_str());
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let body = chat(&b2);
        let req = Req {
            session: Some(&session),
            ..Req::new(&body)
        };
        let seen = p.ask(mode, &req).await;
        if seen.pinned() != Some(home.as_str()) {
            panic!(
                "{mode:?}: pinned {:?}, the session's home {home}: {seen:?}\n{}\n{}",
                seen.pinned(),
                p.svc.metrics().await,
                p.svc.stderr()
            );
        }
    }
    let a = route(&b2, &session, true).await;
    assert_eq!(
        (a["endpoint"].as_str(), a["tier"].as_str()),
        (Some(home.as_str()), Some("session")),
        "{a}"
    );
    p.svc
        .assert_metrics(r#"kvroute_route_decisions_total{reason="session",tier="session"} 2"#)
        .await;
}

/// A client-sent destination never survives: the buffered headers answer removes it, and every
/// pinned answer overwrites it; the full-duplex body comes back byte for byte (chunked over
/// several messages, cut at odd sizes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_destination_is_dropped_and_the_body_comes_back_unchanged() {
    let p = Picker::start("epp-spoof", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    let messages = conversation("spoofing", 4);
    let mut b = chat(&messages);
    // Bytes JSON allows but a re-encoder would change: spacing and an escaped character.
    b.splice(1..1, b"  \"x\" : \"\\u00e9\" ,".iter().copied());
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let req = Req {
            chunk: 1000,
            spoof: Some("10.9.9.9:9"),
            ..Req::new(&b)
        };
        let s = p.ask(mode, &req).await;
        assert!(s.client_header_dropped, "{mode:?}: {s:?}");
        let Some(ep) = s.pinned() else {
            panic!(
                "{mode:?}: not pinned: {s:?}\n{}\n{}",
                p.svc.metrics().await,
                p.svc.stderr()
            );
        };
        let other = match ep {
            "127.0.0.2:8000" => "127.0.0.3:8000",
            "127.0.0.3:8000" => "127.0.0.2:8000",
            _ => panic!("{ep}"),
        };
        assert_eq!(
            s.list(),
            Some(format!("{ep},{other}").as_str()),
            "one fallback by default"
        );
        if mode == BodySendMode::FullDuplexStreamed {
            assert_eq!(s.body, b, "the body comes back byte for byte");
            assert!(s.body_ended);
        }
    }
}

/// A prefill/decode rule (kvExactMode 1): the destination is the decode endpoint and
/// `x-prefiller-host-port` names the prefill endpoint holding the prefix, as the filter pins them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_decode_rule_pins_the_decode_endpoint_and_names_the_prefiller() {
    let mut r = rule(
        9000,
        "vllm",
        5557,
        &[
            ("127.0.0.2".into(), 8000),
            ("127.0.0.3".into(), 8000),
            ("127.0.0.4".into(), 8000),
        ],
        json!({"kvExactMode": 1, "kvModel": "Qwen/Qwen3-0.6B"}),
    );
    for (i, role) in [1, 1, 2].into_iter().enumerate() {
        r["endpoints"][i]["ep_role"] = json!(role);
    }
    let p = Picker::start("epp-pd", json!([r]), true, &[]);
    p.wait_ready().await;
    let b = chat(&conversation("disaggregation", 2));
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let s = p.ask(mode, &Req::new(&b)).await;
        assert_eq!(s.list(), Some("127.0.0.4:8000"), "{mode:?}: {s:?}");
        let prefill = s.prefiller.as_deref().unwrap_or_default();
        assert!(
            ["127.0.0.2:8000", "127.0.0.3:8000"].contains(&prefill),
            "{mode:?}: {s:?}"
        );
    }
}

/// The proxy's candidate subset bounds the choice; a subset with no endpoint of the rule is a 503
/// even failing open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_candidate_subset_bounds_the_choice() {
    let p = Picker::start("epp-subset", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        // A conversation of its own per mode: each answer credits the endpoint it picks.
        let b = chat(&conversation(&format!("subsets in {mode:?}"), 1));
        let home = p
            .ask(mode, &Req::new(&b))
            .await
            .pinned()
            .unwrap()
            .to_owned();
        let other = if home == "127.0.0.2:8000" {
            "127.0.0.3:8000"
        } else {
            "127.0.0.2:8000"
        };
        let with_home = Req {
            subset: Some(vec![other, &home]),
            ..Req::new(&b)
        };
        assert_eq!(p.ask(mode, &with_home).await.pinned(), Some(home.as_str()));
        let only_other = Req {
            subset: Some(vec![other]),
            ..Req::new(&b)
        };
        assert_eq!(
            p.ask(mode, &only_other).await.list(),
            Some(other),
            "{mode:?}: no fallback outside the subset"
        );
        let none = Req {
            subset: Some(vec!["10.1.1.1:8000"]),
            ..Req::new(&b)
        };
        assert_eq!(p.ask(mode, &none).await.rejected, Some(503), "{mode:?}");
    }
    p.svc
        .assert_metrics("kvroute_epp_requests_total{outcome=\"subset_unavailable\"} 2")
        .await;
}

/// Failing open: every failure lets the request through unpinned (the client's destination
/// removed, the body returned), counted by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_fail_open_and_are_counted() {
    // Rule 1 has no staged tokenizer; rule 2 does not exist until the end.
    let p = Picker::start(
        "epp-open",
        json!([qwen_rule(true)]),
        false,
        &["--epp-max-body-bytes", "2048"],
    );
    let good = chat(&conversation("failures", 0));
    let big = chat(&conversation("failures", 40));
    assert!(good.len() < 2048 && big.len() > 2048);
    let cases: [(&[u8], &str); 3] = [
        (b"{\"model\": \"m\", \"messages\": 7}", "bad_body"),
        (&good, "no_tokenizer"),
        (&big, "body_too_large"),
    ];
    for (b, why) in cases {
        for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
            let req = Req {
                spoof: Some("10.9.9.9:9"),
                chunk: 700,
                ..Req::new(b)
            };
            let s = p.ask(mode, &req).await;
            assert_eq!(
                (s.pinned(), s.rejected),
                (None, None),
                "{why} {mode:?}: {s:?}"
            );
            assert!(s.client_header_dropped, "{why} {mode:?}");
            if mode == BodySendMode::FullDuplexStreamed {
                assert_eq!((s.body.as_slice(), s.body_ended), (b, true), "{why}");
            }
        }
    }
    p.svc
        .assert_metrics(
            "kvroute_epp_failures_total{reason=\"bad_body\"} 2
             kvroute_epp_failures_total{reason=\"no_tokenizer\"} 2
             kvroute_epp_failures_total{reason=\"body_too_large\"} 2
             kvroute_epp_requests_total{outcome=\"fail_open\"} 6
             kvroute_epp_requests_total{outcome=\"picked\"} 0",
        )
        .await;
}

/// Failing closed: each failure is rejected with its status; a rule the picker is configured for
/// but that is not installed is `no_rule`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_fail_closed_with_their_status() {
    let p = Picker::start(
        "epp-close",
        json!([qwen_rule(true)]),
        true,
        &[
            "--epp-failure-mode",
            "FailClose",
            "--epp-max-body-bytes",
            "2048",
        ],
    );
    p.wait_ready().await;
    let good = chat(&conversation("failures", 0));
    let big = chat(&conversation("failures", 40));
    for (b, want) in [(&b"not json"[..], 400), (&big[..], 413)] {
        for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
            assert_eq!(
                p.ask(mode, &Req::new(b)).await.rejected,
                Some(want),
                "{mode:?}"
            );
        }
    }
    let s = p.ask(BodySendMode::Buffered, &Req::new(&good)).await;
    assert!(s.pinned().is_some(), "{s:?}\n{}", p.svc.metrics().await);
    p.svc
        .assert_metrics(
            "kvroute_epp_failures_total{reason=\"bad_body\"} 2
             kvroute_epp_failures_total{reason=\"body_too_large\"} 2
             kvroute_epp_requests_total{outcome=\"fail_close\"} 4
             kvroute_epp_requests_total{outcome=\"picked\"} 1",
        )
        .await;

    let q = Picker::start(
        "epp-norule",
        json!([qwen_rule(true)]),
        true,
        &[
            "--epp-failure-mode",
            "FailClose",
            "--epp-rule",
            "10.0.0.1:9999",
        ],
    );
    assert_eq!(
        q.ask(BodySendMode::Buffered, &Req::new(&good))
            .await
            .rejected,
        Some(503)
    );
    q.svc
        .assert_metrics("kvroute_epp_failures_total{reason=\"no_rule\"} 1")
        .await;
}

/// A buffered body comes in one gRPC message: one past the picker's message limit
/// (`--epp-max-body-bytes` plus 1 MiB) is answered as a body over the cap, counted and under the
/// failure mode, not dropped uncounted by the gRPC layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_past_the_grpc_message_limit_is_body_too_large() {
    // Past the default cap (4 MiB, gRPC's usual message limit): inside the picker's message limit
    // (the cap plus 1 MiB) and past it.
    let over = chat(&json!([{"role": "user", "content": "x".repeat(4_500_000)}]));
    let huge = chat(&json!([{"role": "user", "content": "x".repeat(6_000_000)}]));
    for (mode, rejected, outcome) in [
        ("FailOpen", None, "fail_open"),
        ("FailClose", Some(413), "fail_close"),
    ] {
        let p = Picker::start(
            "epp-huge",
            json!([qwen_rule(true)]),
            false,
            &["--epp-failure-mode", mode],
        );
        for b in [&over, &huge] {
            let s = p.ask(BodySendMode::Buffered, &Req::new(b)).await;
            assert_eq!((s.pinned(), s.rejected), (None, rejected), "{mode}: {s:?}");
        }
        p.svc
            .assert_metrics(&format!(
                "kvroute_epp_failures_total{{reason=\"body_too_large\"}} 2
                 kvroute_epp_requests_total{{outcome=\"{outcome}\"}} 2"
            ))
            .await;
    }
}

/// gRPC health: liveness from the start; readiness (and the ext_proc service name) once the
/// rule's tokenizer is loaded, never without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_reports_liveness_and_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let p = Picker::start("epp-health", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(
            p.health(service).await,
            ServingStatus::Serving as i32,
            "{service}"
        );
    }
    let q = Picker::start("epp-unready", json!([qwen_rule(true)]), false, &[]);
    assert_eq!(q.health("liveness").await, ServingStatus::Serving as i32);
    assert_eq!(
        q.health("readiness").await,
        ServingStatus::NotServing as i32
    );
}

fn response_headers(content_type: &str) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: "content-type".into(),
                    raw_value: content_type.as_bytes().to_vec(),
                    ..HeaderValue::default()
                }],
            }),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_body(b: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// With the response body streamed to it (`response_body_mode: STREAMED`), the picker reads each
/// picked response's usage, JSON or SSE: the picked endpoint's outcomes are judged against the
/// decision's matched blocks and the tenant's tokens are accounted, as the filter's reports
/// would; every response message is passed on unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_responses_are_judged_and_accounted_to_their_tenant() {
    let p = Picker::start("epp-usage", json!([qwen_rule(true)]), true, &[]);
    p.wait_ready().await;
    let mut body: Value = serde_json::from_slice(&chat(&conversation("usage", 1))).unwrap();
    body["user"] = json!("team-e");
    let body = serde_json::to_vec(&body).unwrap();
    let sse_usage = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".to_vec();
    let sse_end = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":150,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\ndata: [DONE]\n\n".to_vec();
    let answers: [(&str, Vec<Vec<u8>>); 2] = [
        (
            "application/json",
            vec![
                br#"{"usage":{"prompt_tokens":150,"prompt_tokens_details":{"cached_tokens":0}}}"#
                    .to_vec(),
            ],
        ),
        ("text/event-stream", vec![sse_usage, sse_end]),
    ];
    let mut picked = Vec::new();
    for (content_type, chunks) in &answers {
        let mut x = p.open().await;
        x.send(headers(BodySendMode::Buffered, &Req::new(&body)))
            .await;
        let mut seen = Seen::default();
        assert!(!seen.take(x.recv().await));
        x.send(self::body(&body, true)).await;
        seen.take(x.recv().await);
        picked.push(seen.pinned().expect("picked").to_owned());
        x.send(response_headers(content_type)).await;
        let r = x.recv().await;
        assert!(
            matches!(
                r.response,
                Some(processing_response::Response::ResponseHeaders(_))
            ),
            "{r:?}"
        );
        for (i, c) in chunks.iter().enumerate() {
            x.send(response_body(c, i + 1 == chunks.len())).await;
            let r = x.recv().await;
            match r.response {
                Some(processing_response::Response::ResponseBody(b)) => {
                    assert!(
                        b.response.unwrap_or_default().body_mutation.is_none(),
                        "unchanged"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
    }
    // The second turn went where the first was credited, so both judge one endpoint.
    assert_eq!(picked[0], picked[1]);
    let h = p.svc.get_json("/healthz").await;
    let ep = h["rules"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["endpoint"] == picked[0].as_str())
        .unwrap()
        .clone();
    let o = &ep["outcomes"];
    assert_eq!(
        (
            o["judged"].as_u64(),
            o["prompt_tokens"].as_u64(),
            o["cached_tokens"].as_u64()
        ),
        (Some(2), Some(300), Some(48)),
        "{ep}"
    );
    let r = p
        .svc
        .call(
            reqwest::Method::GET,
            "/v1/rules/1/tenants",
            Some(common::TOKEN),
        )
        .await;
    let t: Value = r.json().await.unwrap();
    let t = &t["tenants"][0];
    assert_eq!(
        (
            t["tenant"].as_str(),
            t["requests"].as_u64(),
            t["prompt_tokens"].as_u64(),
            t["cached_tokens"].as_u64()
        ),
        (Some("user:team-e"), Some(2), Some(300), Some(48)),
        "{t}"
    );
    p.svc
        .assert_metrics("kvroute_epp_usage_total{outcome=\"parsed\"} 2")
        .await;
}
