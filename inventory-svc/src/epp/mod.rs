//! The endpoint picker (EPP) of the Gateway API Inference Extension: Envoy's external
//! processing service (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC) as a second front
//! door of the inventory, next to the filter's HTTP callout.
//!
//! Per request (one ext_proc stream, driven by [`exchange::Exchange`]): the proxy sends the
//! request headers and the body (buffered or full-duplex streamed); the picker finds the rule it
//! serves (`--epp-rule`), renders the chat template, tokenizes with the rule's staged tokenizer,
//! hashes with the rule's contract and decides with the same function as `POST /v1/route`
//! ([`crate::question`]: one decision function, one in-flight / speculative / placement state).
//! The answer sets the `x-gateway-destination-endpoint` request header (overwriting any value
//! the client sent) and the same value under the `envoy.lb` dynamic metadata namespace, and
//! asks the proxy to route again. The proxy's candidate subset
//! (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the filter metadata)
//! bounds the choice. The body is never changed.
//!
//! Every failure (no rule, no tokenizer, bad body, body over the cap, no healthy endpoint, the
//! decision over `--epp-timeout-ms`) is answered at once under the configured [`FailureMode`]
//! and counted by reason (`kvroute_epp_failures_total`); a subset with no eligible endpoint is
//! a 503 in either mode, as the protocol requires. gRPC health (`grpc.health.v1`) serves
//! `liveness` (always) and `readiness` and the ext_proc service name (once the rule is installed
//! and its tokenizer loaded: the picker loads it ahead of the first request).
//!
//! When the proxy streams the response body to the picker (`response_body_mode: STREAMED`), the
//! picker reads a picked response's `usage` as the filter does (kvroute-core `usage`, the last
//! 256 KiB kept): a response served by the picked endpoint is judged against the decision's
//! matched blocks into that endpoint's outcomes and divergence verdict, and every picked
//! response's tokens go to its tenant's account (`kvroute_epp_usage_total{outcome}`). The body
//! goes back unchanged.

pub mod exchange;
pub mod kube;
pub mod pool;
pub mod reply;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{Stream, StreamExt};
use kvroute_core::prompt::Endpoint;
use kvroute_core::usage::{self, outcome_of, Account, Prediction, Tail};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::fleet::{Fleet, RouteError};
use crate::metrics::{EppFailure, EppServed};
use crate::offload::TokenizerCache;
use crate::question::{self, Ask, KeyingError, Text};
use exchange::{Exchange, Input, Next, Verdict};

/// What the picker does when it cannot pick (the InferencePool's `endpointPickerRef.failureMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureMode {
    /// Let the request through unpinned: the proxy's own load balancing serves it.
    FailOpen,
    /// Reject it (503; 400 for a bad body, 413 for a body over the cap).
    FailClose,
}

impl std::str::FromStr for FailureMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "FailOpen" => Ok(FailureMode::FailOpen),
            "FailClose" => Ok(FailureMode::FailClose),
            other => Err(format!(
                "failure mode {other:?}: expected FailOpen or FailClose"
            )),
        }
    }
}

/// Largest body the picker holds by default (a 16k-token chat is ~100 KiB; 4 MiB is the
/// proxies' default gRPC message cap).
pub const DEFAULT_MAX_BODY: usize = 4 << 20;
/// Default bound on one decision (tokenization included): under Envoy's default ext_proc
/// `message_timeout` of 200 ms, so the picker's failure mode answers before the proxy's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(150);
/// Streams answered at once per connection (each is one HTTP request in flight).
const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// What a proxy's message may hold past `--epp-max-body-bytes` (headers, metadata): a buffered
/// body comes in one message, so the gRPC limit is the cap plus this, and every body up to the
/// cap reaches the picker (one over it is `body_too_large`, under the failure mode).
const MESSAGE_HEADROOM: usize = 1 << 20;

/// The `serve --epp-*` options.
#[derive(Clone, Debug)]
pub struct EppOptions {
    /// The ext_proc gRPC listener.
    pub listen: SocketAddr,
    /// The rule this picker serves: its id, name (`VIP:port/protocol`) or `VIP:port`.
    pub rule: String,
    pub failure_mode: FailureMode,
    /// Bound on one decision.
    pub timeout: Duration,
    /// Largest request body held.
    pub max_body: usize,
    /// Fallback endpoints listed after the chosen one (0: the chosen one only).
    pub fallbacks: usize,
    /// `--epp-pool`: the InferencePool whose ready pods are the rule's endpoints.
    pub pool: Option<pool::PoolOptions>,
}

/// Who sent a request, from its headers: the API key (for the affinity key) and the
/// conversation id (`x-conversation-id`, for the session tier).
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller<'a> {
    pub api_key: Option<&'a [u8]>,
    pub session: Option<&'a str>,
}

/// What a picked request's response is judged against.
#[derive(Clone, Debug)]
struct Judging {
    /// The chosen endpoint's matched blocks (the prefill endpoint's in P/D mode); `None` when the
    /// rule has no KV contract (only the tenant's tokens are counted).
    prediction: Option<Prediction>,
    account: Option<Account>,
}

/// One stream's picked response as it is read.
#[derive(Debug, Default)]
struct Reading {
    judging: Option<Judging>,
    sse: bool,
    tail: Tail,
    /// The proxy reported another endpoint than the picked one as serving it.
    served_elsewhere: bool,
}

/// The picker: the fleet, the shared tokenizers and its options.
pub struct Picker {
    pub fleet: Arc<Fleet>,
    pub tokenizers: Arc<TokenizerCache>,
    pub opts: EppOptions,
    /// The followed pool (`--epp-pool`), as [`pool::PoolWatch`] last read it.
    pub pool: Option<Arc<pool::PoolView>>,
}

impl Picker {
    /// Decides one request: the rule, its candidates, the keys of `input`, [`question::answer`].
    pub async fn pick(
        &self,
        input: Input,
        subset: Option<&[String]>,
        caller: Caller<'_>,
        endpoint: Option<Endpoint>,
    ) -> Verdict {
        self.pick_judged(input, subset, caller, endpoint).await.0
    }

    /// [`Picker::pick`], and what the response is judged against when the request was picked.
    async fn pick_judged(
        &self,
        input: Input,
        subset: Option<&[String]>,
        caller: Caller<'_>,
        endpoint: Option<Endpoint>,
    ) -> (Verdict, Option<Judging>) {
        let body = match input {
            Input::TooLarge => return (Verdict::Fail(EppFailure::BodyTooLarge), None),
            Input::NoBody => None,
            Input::Body(b) => Some(b),
        };
        let decision = self.decide(body.map(|b| (b, endpoint)), subset, caller);
        match tokio::time::timeout(self.opts.timeout, decision).await {
            Ok(v) => v,
            Err(_) => (Verdict::Fail(EppFailure::Timeout), None),
        }
    }

    async fn decide(
        &self,
        body: Option<(bytes::Bytes, Option<Endpoint>)>,
        subset: Option<&[String]>,
        caller: Caller<'_>,
    ) -> (Verdict, Option<Judging>) {
        let fail = |v: Verdict| (v, None);
        // The followed pool has no ready pod: its rule still lists the last ones (a rule cannot
        // be empty), which must not be picked.
        if self.pool.as_ref().is_some_and(|p| p.empty()) {
            return fail(Verdict::Fail(EppFailure::NoEndpoint));
        }
        let Some(rule) = self.fleet.find(&self.opts.rule) else {
            return fail(Verdict::Fail(EppFailure::NoRule));
        };
        let only: Option<Vec<bool>> = subset.map(|s| {
            let wanted: Vec<SocketAddr> = s.iter().filter_map(|a| a.parse().ok()).collect();
            rule.spec
                .endpoints
                .iter()
                .map(|e| wanted.contains(&SocketAddr::new(e.ip, e.port)))
                .collect()
        });
        if only.as_ref().is_some_and(|o| !o.contains(&true)) {
            return fail(Verdict::SubsetUnavailable);
        }
        let t = match body {
            Some((b, endpoint)) => {
                let text = Text::Body(b, endpoint);
                match question::tokenize(&self.fleet, &self.tokenizers, &rule, text, true).await {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::debug!(rule = %rule.spec.name(), "epp: {e}");
                        return fail(Verdict::Fail(match e {
                            KeyingError::NotConfigured | KeyingError::NoTokenizer(_) => {
                                EppFailure::NoTokenizer
                            }
                            KeyingError::BadBody(_) => EppFailure::BadBody,
                            KeyingError::Failed(_) => EppFailure::Tokenize,
                        }));
                    }
                }
            }
            None => None,
        };
        // As the filter forms it, without the client IP (the picker does not see the peer).
        let affinity = t.as_ref().and_then(|t| {
            kvroute_core::affinity::affinity_key(
                t.user.as_deref(),
                caller.api_key,
                None,
                t.endpoint?,
            )
        });
        let ask = Ask {
            keys: t.as_ref().map_or(&[], |t| &t.keyed.keys),
            token_count: t.as_ref().map_or(0, |t| t.keyed.token_count),
            affinity_key: affinity.as_deref(),
            model: t.as_ref().and_then(|t| t.model.as_deref()),
            session: caller.session,
            explain: false,
            only: only.as_deref(),
            fallbacks: self.opts.fallbacks,
            truncated: t.as_ref().and_then(|t| t.keyed.truncated),
        };
        match question::answer(&self.fleet, &rule, &ask, Instant::now()) {
            Ok(a) => {
                let block_size = rule.spec.contract().map(|c| c.block_size.get());
                let judging = Judging {
                    prediction: match (block_size, a.response.endpoint.parse()) {
                        (Some(bs), Ok(endpoint)) => Some(Prediction {
                            blocks: a.response.matched_blocks,
                            block_size: u32::try_from(bs).unwrap_or(u32::MAX),
                            endpoint,
                        }),
                        _ => None,
                    },
                    account: affinity.as_deref().map(|k| Account::new(k, ask.model)),
                };
                let verdict = match a.response.decode_endpoint {
                    // Prefill/decode: the request goes to the decode endpoint, which pulls the KV
                    // from the prefill one (the fallbacks are prefill endpoints: none are listed).
                    Some(decode) => Verdict::PickPd {
                        decode,
                        prefill: a.response.endpoint,
                    },
                    None => {
                        // The protocol's ordered list: the chosen endpoint, then fallbacks for
                        // retries.
                        let mut list = vec![a.response.endpoint];
                        list.extend(a.fallbacks);
                        Verdict::Pick(list.join(","))
                    }
                };
                (verdict, Some(judging))
            }
            Err(RouteError::NoEndpoint) if only.is_some() => fail(Verdict::SubsetUnavailable),
            Err(RouteError::NoEndpoint) => fail(Verdict::Fail(EppFailure::NoEndpoint)),
            Err(RouteError::TooManyKeys(_)) => fail(Verdict::Fail(EppFailure::BadBody)),
        }
    }

    /// Whether the picker can pick for its rule: the rule is installed and, when it routes on
    /// KV blocks, its tokenizer is loaded (loading it now if not, on the blocking pool), so the
    /// first request does not pay for the load inside its decision bound.
    pub async fn warm(&self) -> bool {
        // A followed pool: not before its pods were read and the rule follows them.
        match &self.pool {
            Some(p) if !p.synced() => return false,
            Some(p) if p.empty() => return true,
            _ => {}
        }
        let Some(rule) = self.fleet.find(&self.opts.rule) else {
            return false;
        };
        if rule.spec.contract().is_none() {
            return true;
        }
        let (Some(slug), Some(dir)) = (
            rule.spec.slug.clone(),
            self.fleet.tokenizer_dir().map(|d| d.to_path_buf()),
        ) else {
            return false;
        };
        let cache = self.tokenizers.clone();
        matches!(
            tokio::task::spawn_blocking(move || cache.get(&dir, &slug).is_ok()).await,
            Ok(true)
        )
    }

    /// Runs one stream to its end, sending every answer into `tx`.
    async fn run(
        self: Arc<Self>,
        mut inbound: Streaming<ProcessingRequest>,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) {
        let m = &self.fleet.metrics;
        let mut x = Exchange::new(self.opts.max_body);
        let mut reading = Reading::default();
        loop {
            let msg = match inbound.next().await {
                Some(Ok(msg)) => msg,
                // A message over the gRPC limit: a buffered body far past the cap, answered as
                // one over the cap (a full-duplex chunk that size cannot be sent back: the
                // stream ends with the error).
                Some(Err(s)) if matches!(s.code(), Code::OutOfRange | Code::ResourceExhausted) => {
                    match x.message_too_large() {
                        Some(Next::Decide(input)) => {
                            if !self.decide_and_send(&mut x, &mut reading, input, &tx).await {
                                return;
                            }
                            continue;
                        }
                        _ => {
                            let _ = tx.send(Err(s)).await;
                            return;
                        }
                    }
                }
                // The proxy ended the stream or it broke (a reset request): nothing to answer.
                Some(Err(_)) | None => return,
            };
            // Only pinned requests are reported on: the chosen endpoint is the list's first, a
            // served fallback counts as other.
            let chosen = x.picked.as_deref().and_then(|p| p.split(',').next());
            if let (Some(served), Some(chosen)) =
                (reply::served(msg.metadata_context.as_ref()), chosen)
            {
                let o = match chosen == served {
                    true => EppServed::Picked,
                    false => EppServed::Other,
                };
                reading.served_elsewhere |= o == EppServed::Other;
                m.epp_served(o).inc();
            }
            self.read_response(&mut reading, &msg);
            let replies = match x.on_message(msg) {
                Ok(Next::Reply(r)) => r,
                Ok(Next::Decide(input)) => {
                    if !self.decide_and_send(&mut x, &mut reading, input, &tx).await {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
                    return;
                }
            };
            for r in replies {
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        }
    }

    /// Decides `input`, counts it and sends the answers; false when the stream is over.
    async fn decide_and_send(
        &self,
        x: &mut Exchange,
        reading: &mut Reading,
        input: Input,
        tx: &mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> bool {
        let m = &self.fleet.metrics;
        let start = Instant::now();
        let (verdict, judging) = self
            .pick_judged(input, x.subset.as_deref(), x.caller(), x.endpoint)
            .await;
        reading.judging = judging;
        if let Verdict::Fail(why) = &verdict {
            m.epp_failure(*why).inc();
        }
        let replies = match x.decided(&verdict, self.opts.failure_mode) {
            Ok((r, outcome)) => {
                m.epp_outcome(outcome).inc();
                m.epp_latency.observe(start.elapsed().as_secs_f64());
                r
            }
            Err(e) => {
                let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                return false;
            }
        };
        for r in replies {
            if tx.send(Ok(r)).await.is_err() {
                return false;
            }
        }
        true
    }
}

impl Picker {
    /// Reads a picked response's headers and body as they pass; at its end, judges its usage.
    fn read_response(&self, r: &mut Reading, msg: &ProcessingRequest) {
        use processing_request::Request as R;
        if r.judging.is_none() {
            return;
        }
        let end = match &msg.request {
            Some(R::ResponseHeaders(h)) => {
                r.sse = reply::header(h.headers.as_ref(), "content-type").is_some_and(|ct| {
                    String::from_utf8_lossy(ct)
                        .to_ascii_lowercase()
                        .contains("text/event-stream")
                });
                h.end_of_stream
            }
            Some(R::ResponseBody(b)) => {
                r.tail.push(&b.body);
                b.end_of_stream
            }
            Some(R::ResponseTrailers(_)) => true,
            _ => false,
        };
        if end {
            if let Some(j) = r.judging.take() {
                self.judge(&j, r);
            }
        }
    }

    fn judge(&self, j: &Judging, r: &Reading) {
        let m = &self.fleet.metrics;
        let Some(u) = usage::parse(r.tail.bytes(), r.sse) else {
            m.epp_usage.with_label_values(&["missing"]).inc();
            return;
        };
        m.epp_usage.with_label_values(&["parsed"]).inc();
        let Some(rule) = self.fleet.find(&self.opts.rule) else {
            return;
        };
        let tenant = j.account.as_ref().map(|a| a.response(&u));
        // Only a response the picked endpoint served says how good the prediction was.
        let judged = j
            .prediction
            .filter(|_| !r.served_elsewhere)
            .and_then(|p| Some((p, p.judge(&u)?)));
        let now = Instant::now();
        match judged {
            Some((p, jd)) => {
                let outcome = outcome_of(&p.endpoint.to_string(), &jd);
                self.fleet
                    .record_response(&rule, &outcome, tenant.as_ref(), now);
            }
            None => {
                if let Some(t) = &tenant {
                    self.fleet.record_tenants(&rule, std::slice::from_ref(t));
                }
            }
        }
    }
}

/// The tonic service over a [`Picker`].
struct Service(Arc<Picker>);

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.0.clone().run(request.into_inner(), tx));
        let out = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(out)))
    }
}

/// gRPC health: the process answers (always serving while it runs).
pub const LIVENESS: &str = "liveness";
/// gRPC health: the picker can pick ([`Picker::warm`]); the ext_proc service name reports the same.
pub const READINESS: [&str; 2] = ["readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];
/// How often readiness is re-checked while not ready, and once ready.
const WARM_EVERY: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(2));

/// Keeps readiness true to [`Picker::warm`] until `cancel`.
async fn keep_ready(
    picker: Arc<Picker>,
    health: tonic_health::server::HealthReporter,
    cancel: CancellationToken,
) {
    use tonic_health::ServingStatus;
    let mut ready = None;
    loop {
        let now = picker.warm().await;
        if ready != Some(now) {
            let status = match now {
                true => ServingStatus::Serving,
                false => ServingStatus::NotServing,
            };
            for s in READINESS {
                health.set_service_status(s, status).await;
            }
            tracing::info!(rule = %picker.opts.rule, ready = now, "endpoint picker readiness");
            ready = Some(now);
        }
        let every = if now { WARM_EVERY.1 } else { WARM_EVERY.0 };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Serves the ext_proc and health services on `listener` until `cancel`, then drains the
/// streams in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    picker: Arc<Picker>,
    cancel: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_service_status(LIVENESS, tonic_health::ServingStatus::Serving)
        .await;
    for s in READINESS {
        health
            .set_service_status(s, tonic_health::ServingStatus::NotServing)
            .await;
    }
    tokio::spawn(keep_ready(picker.clone(), health, cancel.clone()));
    // No Nagle delay: every answer is a small message the proxy waits for.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .add_service(health_svc)
        .add_service(
            ExternalProcessorServer::new(Service(picker.clone()))
                .max_decoding_message_size(picker.opts.max_body.saturating_add(MESSAGE_HEADROOM)),
        )
        .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
        .await
}
