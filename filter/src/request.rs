//! Per-request logic (the proxy-wasm HTTP context's behaviour), driven by [`RequestState`].
//!
//! ```text
//! Start ──headers──► Passthrough                      (not POST /v1/{chat/,}completions, no rule, no body)
//!   │
//!   └──headers (Pause)──► ReadingBody ──end of body──► AwaitingRoute ──answer──► Forwarded (pinned)
//!                             │                            │
//!                             └──any failure──────────────┴──────────────────► Forwarded (unpinned, counted)
//! ```
//! Each state carries what it needs (the endpoint and start time while reading, the callout's
//! token while waiting, the pin to check and the usage reader once forwarded), nothing more.
//! With `pin_mode: filter_state` (Istio WasmPlugin) the headers are released at once and the body
//! is held instead; the decision goes out as filter state (see [`crate::config::PinMode`]).
//! (Envoy does not expose the body at the headers callback, not even with a buffer filter ahead:
//! measured, so the body callbacks are the only way to read it.)
//!
//! A complete body becomes a question ([`crate::question::build`]), which is sent as the route
//! callout; its answer, in the paused continuation, pins the request. Every step that can fail
//! returns [`Unpinned`] and runs inside one wrapper, [`RequestFilter::guarded`], which applies the
//! failure policy: the reason is counted, the request goes on without a pin, and a request the
//! callout holds is resumed. Client-supplied routing headers are removed before anything else,
//! and the body is never modified.

use std::rc::Rc;

use base64::Engine as _;
use kvroute_core::prompt::Endpoint;

use crate::config::PinMode;
use crate::host::{Body, Callout, Headers, Host, Level};
use crate::outcomes::Account;
use crate::plugin::VmState;
use crate::stats::{FailReason, Stat};
use crate::usage::{self, Prediction, Tail, Verdict};
use crate::wire::{binary, RouteAnswer, RouteRequest, Tier};

/// Upstream header naming the KV-chosen prefill endpoint in P/D mode (llm-d routing sidecar).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Upstream header with the decision's tier (observability).
pub const TIER_HEADER: &str = "x-kvroute-tier";
/// Upstream header with the number of matched blocks (observability).
pub const MATCHED_HEADER: &str = "x-kvroute-matched-blocks";

/// What the proxy should do after a callback, mapped to `proxy_wasm::types::Action` in lib.rs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Let the request go on.
    Continue,
    /// Hold the request (at the headers, or buffer the body) until the filter resumes it.
    Pause,
}

/// Where one request is in the filter, with the data that state needs.
#[derive(Debug)]
pub enum RequestState {
    /// Nothing seen yet.
    Start,
    /// Not a request the filter routes: released at the headers.
    Passthrough,
    /// A routed request, held while its body is buffered.
    ReadingBody {
        endpoint: Endpoint,
        /// When the headers arrived (0 if the clock was unavailable).
        started_ns: u64,
    },
    /// Held while the route callout with this token is in flight.
    AwaitingRoute {
        token: u32,
        started_ns: u64,
        /// When the callout was sent.
        dispatched_ns: u64,
        /// Whom the response's tokens are accounted to (with reports on).
        account: Option<Account>,
        /// The prompt's token count through each placed `cache_control` breakpoint.
        breakpoints: Vec<u32>,
    },
    /// Released upstream after a decision (pinned) or a failure (unpinned).
    Forwarded {
        pinned: bool,
        /// The `ip:port` pinned to, until it is checked against the upstream Envoy chose.
        check_pin: Option<String>,
        /// Reads the response's `usage` (routed requests only).
        usage: Option<UsageReader>,
    },
}

/// The response of a routed request, read for its `usage`.
#[derive(Clone, Debug, Default)]
pub struct UsageReader {
    sse: bool,
    tail: Tail,
    account: Option<Account>,
    /// What the pin's answer predicted the engine reuses (pinned requests only).
    predicted: Option<Prediction>,
    /// The prompt's token count through each placed `cache_control` breakpoint.
    breakpoints: Vec<u32>,
}

/// The whole blocks before each breakpoint (its token count), for those past the first block:
/// what an engine must reuse for the breakpoint's prefix to count as cached.
fn whole_blocks(breakpoints: &[u32], block_size: u32) -> impl Iterator<Item = u32> + '_ {
    let bs = block_size.max(1);
    breakpoints.iter().map(move |t| t / bs).filter(|&b| b > 0)
}

/// Why a step releases the request without a pin: the counted reason, and a detail for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unpinned {
    pub reason: FailReason,
    pub detail: String,
}

impl Unpinned {
    pub fn new(reason: FailReason, detail: impl Into<String>) -> Self {
        Unpinned {
            reason,
            detail: detail.into(),
        }
    }
}

/// How a step's outcome reaches Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// As the callback's return value.
    Return,
    /// The paused continuation (the callout's answer): a request released there is resumed.
    Resume,
}

/// State of one HTTP request.
#[derive(Debug)]
pub struct RequestFilter {
    vm: Rc<VmState>,
    state: RequestState,
}

fn duration_ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl RequestFilter {
    /// A request that has not been seen yet.
    pub fn new(vm: Rc<VmState>) -> Self {
        RequestFilter {
            vm,
            state: RequestState::Start,
        }
    }

    /// Current state.
    pub fn state(&self) -> &RequestState {
        &self.state
    }

    /// Headers a client may not set: the pin and what the filter itself writes upstream.
    fn routing_headers(&self) -> [&str; 4] {
        [
            self.vm.config.pin_header.as_str(),
            PREFILLER_HEADER,
            TIER_HEADER,
            MATCHED_HEADER,
        ]
    }

    /// Request headers arrived: strip routing headers, decide whether to read the body.
    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Step {
        self.guarded(host, Via::Return, |r, host| r.headers(host, end_of_stream))
    }

    /// A request body chunk arrived (`body_size` is everything buffered so far).
    pub fn on_request_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Step {
        self.guarded(host, Via::Return, |r, host| {
            r.body(host, body_size, end_of_stream)
        })
    }

    /// The route callout answered (`status` is its `:status`). Resumes the request in every case.
    pub fn on_route_response(
        &mut self,
        host: &dyn Host,
        token: u32,
        status: Option<&str>,
        body: &[u8],
    ) {
        self.guarded(host, Via::Resume, |r, host| {
            r.answered(host, token, status, body)
        });
    }

    /// The failure policy, around every step that can fail: an [`Unpinned`] is counted, logged
    /// at debug and the request released without a pin; in the paused continuation a released
    /// request is resumed (pinned or not).
    fn guarded(
        &mut self,
        host: &dyn Host,
        via: Via,
        step: impl FnOnce(&mut Self, &dyn Host) -> Result<Step, Unpinned>,
    ) -> Step {
        let step = match step(self, host) {
            Ok(step) => step,
            Err(u) => {
                self.vm.stats.inc(host, Stat::FailOpen(u.reason));
                host.log(
                    Level::Debug,
                    &format!(
                        "kvroute-filter: unpinned ({}): {}",
                        u.reason.as_str(),
                        u.detail
                    ),
                );
                self.finish(host, false, None, None);
                Step::Continue
            }
        };
        if via == Via::Resume && step == Step::Continue {
            host.resume_request();
        }
        step
    }

    fn headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Result<Step, Unpinned> {
        if !matches!(self.state, RequestState::Start) {
            return Ok(Step::Continue);
        }
        let stats = &self.vm.stats;
        stats.inc(host, Stat::Requests);
        for name in self.routing_headers() {
            // By presence, as bytes: a value that is not UTF-8 is removed like any other.
            if host.header_bytes(Headers::Request, name).is_some() {
                host.set_header(Headers::Request, name, None);
                stats.inc(host, Stat::SpoofedHeaders);
            }
        }
        self.state = RequestState::Passthrough;
        if self.vm.config.rule.is_none() {
            return Ok(Step::Continue);
        }
        let method = host.header(Headers::Request, ":method");
        let endpoint = host
            .header(Headers::Request, ":path")
            .as_deref()
            .and_then(Endpoint::from_path);
        let (Some("POST"), Some(endpoint)) = (method.as_deref(), endpoint) else {
            return Ok(Step::Continue);
        };
        if let Some(ct) = host.header_bytes(Headers::Request, "content-type") {
            let Ok(ct) = String::from_utf8(ct) else {
                return Err(Unpinned::new(
                    FailReason::BadHeader,
                    "content-type is not UTF-8",
                ));
            };
            if !ct.to_ascii_lowercase().contains("json") {
                return Ok(Step::Continue);
            }
        }
        self.state = RequestState::ReadingBody {
            endpoint,
            started_ns: host.now_nanos(),
        };
        let stats = &self.vm.stats;
        stats.inc(host, Stat::Considered);
        if end_of_stream {
            return Err(Unpinned::new(FailReason::BadRequest, "no body"));
        }
        let declared = host
            .header(Headers::Request, "content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.vm.config.max_body_bytes) {
            return Err(Unpinned::new(
                FailReason::BodyTooLarge,
                "content-length over max_body_bytes",
            ));
        }
        Ok(match self.vm.config.pin_mode {
            PinMode::Header => Step::Pause,
            // The headers go on to the buffer filter, which holds them from the router.
            PinMode::FilterState => Step::Continue,
        })
    }

    fn body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Result<Step, Unpinned> {
        let RequestState::ReadingBody {
            endpoint,
            started_ns,
        } = self.state
        else {
            return Ok(Step::Continue);
        };
        if body_size > self.vm.config.max_body_bytes {
            return Err(Unpinned::new(
                FailReason::BodyTooLarge,
                "body over max_body_bytes",
            ));
        }
        if !end_of_stream {
            return Ok(Step::Pause);
        }
        let body = host
            .body(Body::Request, body_size)
            .ok_or_else(|| Unpinned::new(FailReason::BadRequest, "body unavailable"))?;
        let prepare_ns = host.now_nanos();
        let (question, breakpoints) =
            crate::question::build_located(&self.vm, host, endpoint, &body)?;
        self.send(host, question, breakpoints, (started_ns, prepare_ns))
    }

    /// Sends the question as the route callout and holds the request until it answers: in the
    /// binary form when the service advertises it and there are keys to carry, else JSON.
    /// `times`: when the request started and when its question began to be prepared.
    fn send(
        &mut self,
        host: &dyn Host,
        question: RouteRequest,
        breakpoints: Vec<u32>,
        (started_ns, prepare_ns): (u64, u64),
    ) -> Result<Step, Unpinned> {
        let vm = self.vm.clone();
        let account = match (&vm.config.report, &question.affinity_key) {
            (Some(_), Some(key)) => Some(Account::new(key, question.model.as_deref())),
            _ => None,
        };
        let binary = !question.keys.is_empty()
            && vm
                .contract
                .borrow()
                .as_ref()
                .is_some_and(|c| c.raw.accepts_binary_route());
        let (body, content_type) = if binary {
            (binary::encode(question), binary::CONTENT_TYPE)
        } else {
            let json = serde_json::to_vec(&question)
                .map_err(|e| Unpinned::new(FailReason::BadRequest, e.to_string()))?;
            (json, "application/json")
        };
        let c = &vm.config;
        let call = Callout {
            cluster: &c.inventory_cluster,
            method: "POST",
            path: "/v1/route",
            authority: &c.inventory_authority,
            body: Some(&body),
            content_type,
            timeout: c.timeout,
            bearer: c.route_token.as_ref().map(|t| t.as_str()),
        };
        let token = host
            .dispatch(&call)
            .ok_or_else(|| Unpinned::new(FailReason::Dispatch, "dispatch_http_call refused"))?;
        let dispatched_ns = host.now_nanos();
        vm.stats.record(
            host,
            Stat::PrepareUs,
            dispatched_ns.saturating_sub(prepare_ns) / 1000,
        );
        self.state = RequestState::AwaitingRoute {
            token,
            started_ns,
            dispatched_ns,
            account,
            breakpoints,
        };
        Ok(Step::Pause)
    }

    /// The paused continuation: the answer to callout `token` pins the request. `Pause` when the
    /// answer is not this request's (nothing to resume).
    fn answered(
        &mut self,
        host: &dyn Host,
        token: u32,
        status: Option<&str>,
        body: &[u8],
    ) -> Result<Step, Unpinned> {
        let RequestState::AwaitingRoute {
            token: awaited,
            dispatched_ns,
            ..
        } = self.state
        else {
            return Ok(Step::Pause);
        };
        if awaited != token {
            return Ok(Step::Pause);
        }
        let elapsed_ns = host.now_nanos().saturating_sub(dispatched_ns);
        self.vm
            .stats
            .record(host, Stat::CalloutUs, elapsed_ns / 1000);
        let answer = match status {
            Some("200") => RouteAnswer::parse(body).ok_or(FailReason::BadResponse),
            Some("504") => Err(FailReason::Timeout),
            Some("503") => Err(FailReason::Unavailable),
            // No response at all: Envoy reset the callout (connection closed, or its timeout
            // fired after the headers, while the body trickled in). Envoy arms that timer from
            // its event loop's cached clock, which can lag the filter's clock by a loop
            // iteration under load, so from half the timeout on it counts as the timeout.
            None if elapsed_ns.saturating_mul(2) >= duration_ns(self.vm.config.timeout) => {
                Err(FailReason::Timeout)
            }
            None => Err(FailReason::Unavailable),
            Some(_) => Err(FailReason::Status),
        };
        let answer = answer.map_err(|reason| {
            Unpinned::new(
                reason,
                format!(
                    "route answer status {} after {} us",
                    status.unwrap_or("none"),
                    elapsed_ns / 1000
                ),
            )
        })?;
        self.pin(host, &answer);
        Ok(Step::Continue)
    }

    /// Applies an answer: the pin (and, in P/D mode, the prefiller) and the observability
    /// headers or properties.
    fn pin(&mut self, host: &dyn Host, a: &RouteAnswer) {
        let vm = self.vm.clone();
        let target = a.decode_endpoint.unwrap_or(a.endpoint).to_string();
        let value = base64::engine::general_purpose::STANDARD.encode(&target);
        let prefiller = a.decode_endpoint.map(|_| a.endpoint.to_string());
        let matched = a.matched_blocks.to_string();
        let pinned = match vm.config.pin_mode {
            PinMode::Header => {
                let pinned = host.set_header(Headers::Request, &vm.config.pin_header, Some(&value));
                if let Some(p) = &prefiller {
                    host.set_header(Headers::Request, PREFILLER_HEADER, Some(p));
                }
                host.set_header(Headers::Request, TIER_HEADER, Some(&a.tier));
                host.set_header(Headers::Request, MATCHED_HEADER, Some(&matched));
                pinned
            }
            PinMode::FilterState => {
                let pinned = host.set_property("kvroute_pin", &value);
                if let Some(p) = &prefiller {
                    host.set_property("kvroute_prefiller", p);
                }
                host.set_property("kvroute_tier", &a.tier);
                host.set_property("kvroute_matched_blocks", &matched);
                pinned
            }
        };
        vm.stats.inc(
            host,
            if pinned {
                Stat::Pinned
            } else {
                Stat::FailOpen(FailReason::Status)
            },
        );
        vm.stats.inc(
            host,
            match a.known_tier() {
                Some(Tier::Session) => Stat::DecisionSession,
                Some(Tier::Tier15) => Stat::DecisionTier15,
                Some(Tier::Fallback) => Stat::DecisionFallback,
                None => Stat::DecisionOther,
            },
        );
        let block_size = vm
            .contract
            .borrow()
            .as_ref()
            .and_then(|c| c.hash.as_ref())
            .map(|h| u32::try_from(h.block_size.get()).unwrap_or(u32::MAX));
        let predicted = block_size.map(|block_size| Prediction {
            blocks: a.matched_blocks,
            block_size,
            endpoint: a.endpoint,
        });
        if let (Some(p), true, RequestState::AwaitingRoute { breakpoints, .. }) =
            (predicted, pinned, &self.state)
        {
            let covered = whole_blocks(breakpoints, p.block_size)
                .filter(|&b| b <= p.blocks)
                .count();
            vm.stats
                .add(host, Stat::BreakpointsPredicted, covered as u64);
        }
        self.finish(
            host,
            pinned,
            pinned.then_some(target),
            predicted.filter(|_| pinned),
        );
    }

    /// Releases the request upstream: a routed request's filter time is recorded and its
    /// response read for usage.
    fn finish(
        &mut self,
        host: &dyn Host,
        pinned: bool,
        check_pin: Option<String>,
        predicted: Option<Prediction>,
    ) {
        let (started_ns, account, breakpoints) = match &mut self.state {
            RequestState::ReadingBody { started_ns, .. } => (Some(*started_ns), None, Vec::new()),
            RequestState::AwaitingRoute {
                started_ns,
                account,
                breakpoints,
                ..
            } => (
                Some(*started_ns),
                account.take(),
                std::mem::take(breakpoints),
            ),
            _ => (None, None, Vec::new()),
        };
        if let Some(t0) = started_ns.filter(|&t| t > 0) {
            self.vm.stats.record(
                host,
                Stat::FilterUs,
                host.now_nanos().saturating_sub(t0) / 1000,
            );
        }
        self.state = RequestState::Forwarded {
            pinned,
            check_pin,
            usage: started_ns.map(|_| UsageReader {
                predicted,
                account,
                breakpoints,
                ..UsageReader::default()
            }),
        };
    }

    /// Response headers: drop the stateful-session echo (it names a backend), note SSE, and
    /// count whether Envoy sent a pinned request where it was pinned (a silent fallback would
    /// otherwise look like a cache that evicts).
    pub fn on_response_headers(&mut self, host: &dyn Host) -> Step {
        let vm = self.vm.clone();
        let pin = &vm.config.pin_header;
        if host.header_bytes(Headers::Response, pin).is_some() {
            host.set_header(Headers::Response, pin, None);
        }
        let RequestState::Forwarded {
            check_pin, usage, ..
        } = &mut self.state
        else {
            return Step::Continue;
        };
        if let Some(target) = check_pin.take() {
            if let Some(upstream) = host.property(&["upstream", "address"]) {
                let honored = upstream == target.as_bytes();
                vm.stats.inc(
                    host,
                    if honored {
                        Stat::PinHonored
                    } else {
                        Stat::PinOverridden
                    },
                );
                if !honored {
                    host.log(
                        Level::Debug,
                        &format!(
                            "kvroute-filter: pinned to {target}, Envoy sent it to {}",
                            String::from_utf8_lossy(&upstream)
                        ),
                    );
                }
            }
        }
        if let Some(reader) = usage {
            reader.sse = host
                .header(Headers::Response, "content-type")
                .is_some_and(|ct| ct.to_ascii_lowercase().contains("text/event-stream"));
        }
        Step::Continue
    }

    /// A response body chunk (never held): keep the tail, parse usage at the end.
    pub fn on_response_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Step {
        let RequestState::Forwarded { usage, .. } = &mut self.state else {
            return Step::Continue;
        };
        let Some(reader) = usage else {
            return Step::Continue;
        };
        if body_size > 0 {
            if let Some(chunk) = host.body(Body::Response, body_size) {
                reader.tail.push(&chunk);
            }
        }
        if end_of_stream {
            if let Some(u) = usage::parse(reader.tail.bytes(), reader.sse) {
                let s = &self.vm.stats;
                s.inc(host, Stat::UsageParsed);
                s.add(host, Stat::CacheHitTokens, u.hit_tokens);
                s.add(host, Stat::CacheMissTokens, u.miss_tokens);
                if let Some(a) = &reader.account {
                    self.vm.outcomes.borrow_mut().account(a, &u);
                }
                if let Some(p) = reader.predicted {
                    // A breakpoint is hit when the engine reused every whole block before it.
                    let bs = u64::from(p.block_size);
                    let hit = whole_blocks(&reader.breakpoints, p.block_size)
                        .filter(|&b| u.hit_tokens >= u64::from(b) * bs)
                        .count();
                    s.add(host, Stat::BreakpointsHit, hit as u64);
                }
                if let Some((p, j)) = reader.predicted.and_then(|p| Some((p, p.judge(&u)?))) {
                    if self.vm.config.report.is_some()
                        && !self
                            .vm
                            .outcomes
                            .borrow_mut()
                            .record(&p.endpoint.to_string(), &j)
                    {
                        s.inc(host, Stat::OutcomesDropped);
                    }
                    s.inc(
                        host,
                        match j.verdict {
                            Verdict::Exact => Stat::PredictionExact,
                            Verdict::Under => Stat::PredictionUnder,
                            Verdict::Over => Stat::PredictionOver,
                        },
                    );
                    s.add(host, Stat::PredictedTokens, j.predicted_tokens);
                    if j.verdict == Verdict::Over {
                        s.add(
                            host,
                            Stat::OverPredictedTokens,
                            j.predicted_tokens.saturating_sub(j.realised_tokens),
                        );
                    }
                }
            }
            *usage = None;
        }
        Step::Continue
    }

    /// The stream ended: a request still held was abandoned by the client.
    pub fn on_done(&mut self, host: &dyn Host) {
        if matches!(
            self.state,
            RequestState::ReadingBody { .. } | RequestState::AwaitingRoute { .. }
        ) {
            self.vm.stats.inc(host, Stat::FailOpen(FailReason::Aborted));
            self.state = RequestState::Forwarded {
                pinned: false,
                check_pin: None,
                usage: None,
            };
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::host::testing::FakeHost;
    use crate::plugin::{Plugin, REQUESTS_TOTAL};
    use crate::tokens::tests::{tiny_tokenizer_json, TINY_CONFIG};
    use crate::tokens::PromptEncoder;
    use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
    use kvroute_core::prompt::Request;
    use serde_json::{json, Value};

    const CONTRACT: &[u8] = br#"{"rule_id":1,"engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":2,"key_mode":"engine","model":"Org/M","kv_enabled":true}"#;
    const HIT: &[u8] = br#"{"rule_id":1,"endpoint":"127.0.0.1:8001","matched_blocks":3,"tier":"tier15","reason":"hit","decode_endpoint":null}"#;

    /// A plugin with the contract and the tiny tokenizer loaded.
    fn ready(host: &FakeHost, config: &str) -> Plugin {
        ready_with(host, config, CONTRACT)
    }

    /// [`ready`] with another contract answer.
    fn ready_with(host: &FakeHost, config: &str, contract: &[u8]) -> Plugin {
        let mut p = Plugin::new();
        p.configure(host, config.as_bytes());
        p.note_traffic();
        p.on_tick(host);
        p.on_call_response(host, 1, Some("200"), contract);
        p.on_tick(host);
        p.on_call_response(host, 2, Some("200"), tiny_tokenizer_json().as_bytes());
        p.on_tick(host);
        p.on_call_response(host, 3, Some("200"), TINY_CONFIG.as_bytes());
        host.calls.borrow_mut().clear();
        p
    }

    fn post(host: &FakeHost, path: &str, body: &[u8]) {
        let mut h = host.request_headers.borrow_mut();
        h.clear();
        h.insert(":method".into(), "POST".into());
        h.insert(":path".into(), path.into());
        h.insert("content-type".into(), "application/json".into());
        *host.request_body.borrow_mut() = body.to_vec();
    }

    /// Drives one request to its callout; returns the filter and the route request sent.
    fn to_callout(host: &FakeHost, p: &Plugin, path: &str, body: &[u8]) -> (RequestFilter, Value) {
        post(host, path, body);
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(host, false), Step::Pause);
        assert_eq!(r.on_request_body(host, body.len() / 2, false), Step::Pause);
        assert_eq!(r.on_request_body(host, body.len(), true), Step::Pause);
        let call = host.calls.borrow().last().cloned().unwrap();
        assert_eq!(
            (
                call.cluster.as_str(),
                call.method.as_str(),
                call.path.as_str()
            ),
            ("kvroute_inventory", "POST", "/v1/route")
        );
        (r, serde_json::from_slice(&call.body).unwrap())
    }

    const CFG: &str = r#"{"rule":"10.0.0.1:8080"}"#;

    /// `Some(pinned)` once the request is forwarded.
    fn pinned(r: &RequestFilter) -> Option<bool> {
        match r.state() {
            RequestState::Forwarded { pinned, .. } => Some(*pinned),
            _ => None,
        }
    }

    #[test]
    fn asks_in_the_binary_form_only_when_the_contract_advertises_it() {
        let body = json!({"model": "Org/M", "messages": [{"role": "user", "content": "hello hello hello"}], "user": "t1"}).to_string();
        // The JSON question (the contract names no content types: an older service).
        let host = FakeHost::default();
        let (_, json_q) = to_callout(
            &host,
            &ready(&host, CFG),
            "/v1/chat/completions",
            body.as_bytes(),
        );
        assert_eq!(host.calls.borrow()[0].content_type, "application/json");
        let want: RouteRequest = serde_json::from_value(json_q).unwrap();
        assert!(!want.keys.is_empty());
        // The same request to a service that reads the binary form.
        let advertised = br#"{"rule_id":1,"engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":2,"key_mode":"engine","model":"Org/M","kv_enabled":true,"route_content_types":["application/json","application/vnd.kvroute.route.v1"]}"#;
        let host = FakeHost::default();
        let p = ready_with(&host, CFG, advertised);
        post(&host, "/v1/chat/completions", body.as_bytes());
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Pause);
        assert_eq!(r.on_request_body(&host, body.len(), true), Step::Pause);
        let call = host.calls.borrow().last().cloned().unwrap();
        assert_eq!(call.content_type, binary::CONTENT_TYPE);
        assert_eq!(&call.body[..4], b"KVR1");
        assert_eq!(binary::decode(&call.body).unwrap(), want);
        // A question without keys (no token ids to hash: a KV-off rule) stays JSON.
        let off = br#"{"rule_id":1,"engine":"vllm","algo":null,"seed":null,"block_size":16,"key_mode":"engine","model":"Org/M","kv_enabled":false,"route_content_types":["application/vnd.kvroute.route.v1"]}"#;
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(&host, CFG.as_bytes());
        p.note_traffic();
        p.on_tick(&host);
        p.on_call_response(&host, 1, Some("200"), off);
        host.calls.borrow_mut().clear();
        let (_, q) = to_callout(&host, &p, "/v1/chat/completions", body.as_bytes());
        assert_eq!(q["keys"], json!([]));
        assert_eq!(host.calls.borrow()[0].content_type, "application/json");
    }

    #[test]
    fn pins_the_chosen_endpoint_with_base64_and_observability_headers() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let body = json!({"model": "Org/M", "messages": [{"role": "user", "content": "hello hello hello"}], "user": "t1"}).to_string();
        let (mut r, sent) = to_callout(&host, &p, "/v1/chat/completions", body.as_bytes());
        assert_eq!(sent["rule"], "10.0.0.1:8080");
        assert_eq!(sent["affinity_key"], "user:t1|chat");
        let n = sent["token_count"].as_u64().unwrap();
        assert!(n > 4, "{sent}");
        assert_eq!(sent["keys"].as_array().unwrap().len() as u64, n / 2);
        assert_eq!(host.calls.borrow()[0].timeout_ms, 25);
        host.answer(200, HIT);
        let token = match r.state() {
            RequestState::AwaitingRoute { token, .. } => *token,
            s => panic!("{s:?}"),
        };
        r.on_route_response(&host, token, Some("200"), HIT);
        assert_eq!(host.resumed.get(), 1);
        assert_eq!(pinned(&r), Some(true));
        assert_eq!(
            host.req_header("x-kvroute-pin").as_deref(),
            Some("MTI3LjAuMC4xOjgwMDE=")
        );
        assert_eq!(host.req_header(TIER_HEADER).as_deref(), Some("tier15"));
        assert_eq!(host.req_header(MATCHED_HEADER).as_deref(), Some("3"));
        assert_eq!(host.req_header(PREFILLER_HEADER), None);
        assert_eq!(host.counter("kvroute_filter_pinned_total"), Some(1));
        assert_eq!(
            host.counter("kvroute_filter_decisions_tier15_total"),
            Some(1)
        );
        assert_eq!(host.samples("kvroute_filter_tokenize_us").len(), 1);
        assert_eq!(host.samples("kvroute_filter_duration_us").len(), 1);
        // The fake clock ticks 1 µs per read: both phases were timed, each at least one tick.
        for phase in ["kvroute_filter_prepare_us", "kvroute_filter_callout_us"] {
            let s = host.samples(phase);
            assert!(s.len() == 1 && s[0] >= 1, "{phase}: {s:?}");
        }
        // The request body was never written.
        assert_eq!(host.request_body.borrow().as_slice(), body.as_bytes());
    }

    /// An image in the second user turn: the question carries the keys of the text before it
    /// (the first turn's keys, a prefix of them), says why they stop, and is pinned as usual.
    #[test]
    fn a_media_request_is_routed_on_the_keys_before_its_first_item() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let history = vec![
            json!({"role": "system", "content": "hello hello, you help"}),
            json!({"role": "user", "content": "hello there hello there"}),
            json!({"role": "assistant", "content": "hello back"}),
        ];
        // The same turn with text only: its prompt has the image request's text before the
        // image, and more.
        let mut text_turn = history.clone();
        text_turn.push(json!({"role": "user", "content": "what is this"}));
        let text_only = json!({"model": "m", "messages": text_turn}).to_string();
        let (_, whole) = to_callout(&host, &p, "/v1/chat/completions", text_only.as_bytes());
        assert_eq!(whole.get("truncated"), None);
        let history_only =
            json!({"model": "m", "messages": history, "add_generation_prompt": false}).to_string();
        let (_, old) = to_callout(&host, &p, "/v1/chat/completions", history_only.as_bytes());
        let mut with_image = history.clone();
        with_image.push(json!({"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}));
        let body = json!({"model": "m", "messages": with_image}).to_string();
        let (mut r, sent) = to_callout(&host, &p, "/v1/chat/completions", body.as_bytes());
        assert_eq!(sent["truncated"], "media");
        let keys = sent["keys"].as_array().unwrap();
        let whole = whole["keys"].as_array().unwrap();
        assert!(keys.len() < whole.len(), "{sent}");
        assert_eq!(keys[..], whole[..keys.len()]);
        // At least every block of the earlier turns.
        assert!(
            keys.len() >= old["keys"].as_array().unwrap().len(),
            "{sent} / {old}"
        );
        assert_eq!(
            host.counter("kvroute_filter_prefix_truncated_media_total"),
            Some(1)
        );
        let token = match r.state() {
            RequestState::AwaitingRoute { token, .. } => *token,
            s => panic!("{s:?}"),
        };
        r.on_route_response(&host, token, Some("200"), HIT);
        assert_eq!(pinned(&r), Some(true));
        // An unknown part type is still a request the filter cannot key: it fails open.
        let bad = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}).to_string();
        post(&host, "/v1/chat/completions", bad.as_bytes());
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Pause);
        assert_eq!(r.on_request_body(&host, bad.len(), true), Step::Continue);
        assert_eq!(pinned(&r), Some(false));
    }

    /// An Anthropic request's `cache_control` breakpoints are placed in its tokens, counted as
    /// predicted when the pinned answer's matched blocks cover their whole blocks, and as hit
    /// when the engine reports those blocks cached; marks it cannot place are counted apart.
    #[test]
    fn cache_control_breakpoints_are_counted_predicted_and_hit() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let cc = json!({"type": "ephemeral"});
        let body = json!({"model": "m", "max_tokens": 16,
            "system": [{"type": "text", "text": "hello", "cache_control": cc}],
            "tools": [{"name": "t", "input_schema": {}, "cache_control": cc}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello there hello there hello there", "cache_control": cc}]}]})
        .to_string();
        let count = |name: &str| host.counter(name).unwrap_or(0);
        // (the engine's cached tokens, in whole blocks of the first breakpoint or all) -> hit
        for (cached, hit) in [(None, 0), (Some(0), 1), (Some(1), 2)] {
            let (mut r, _) = to_callout(&host, &p, "/v1/messages", body.as_bytes());
            let (token, at) = match r.state() {
                RequestState::AwaitingRoute {
                    token, breakpoints, ..
                } => (*token, breakpoints.clone()),
                s => panic!("{s:?}"),
            };
            // Block size 2; the answer covers the system text's blocks, not the user turn's.
            let matched = at[0] / 2 + 1;
            assert!(at.len() == 2 && at[0] >= 2 && at[1] / 2 > matched, "{at:?}");
            let answer = format!(
                r#"{{"rule_id":1,"endpoint":"127.0.0.1:8001","matched_blocks":{matched},"tier":"tier15","reason":"hit","decode_endpoint":null}}"#
            );
            let before = count("kvroute_filter_cache_breakpoints_hit_total");
            r.on_route_response(&host, token, Some("200"), answer.as_bytes());
            r.on_response_headers(&host);
            let cached = cached.map_or(0, |i: usize| at[i] / 2 * 2);
            let usage = format!(
                r#"{{"usage":{{"input_tokens":1,"cache_read_input_tokens":{cached},"output_tokens":1}}}}"#
            );
            *host.response_body.borrow_mut() = usage.clone().into_bytes();
            r.on_response_body(&host, usage.len(), true);
            assert_eq!(
                count("kvroute_filter_cache_breakpoints_hit_total") - before,
                hit,
                "{at:?} {cached}"
            );
        }
        assert_eq!(
            (
                count("kvroute_filter_cache_breakpoints_total"),
                count("kvroute_filter_cache_breakpoints_unlocated_total"),
                count("kvroute_filter_cache_breakpoints_predicted_total"),
            ),
            (6, 3, 3)
        );
    }

    /// An Anthropic Messages request is routed like the chat completions request vLLM converts
    /// it to: the same keys, its own affinity service type.
    #[test]
    fn an_anthropic_messages_request_is_routed_like_its_chat_conversion() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let anthropic = json!({"model": "m", "max_tokens": 16, "metadata": {"user_id": "t1"},
            "system": [{"type": "text", "text": "hello hello, you help", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there hello there"}]}]})
        .to_string();
        let chat = json!({"model": "m", "messages": [
            {"role": "system", "content": "hello hello, you help"},
            {"role": "user", "content": "hello there hello there"}]})
        .to_string();
        let (_, a) = to_callout(&host, &p, "/v1/messages", anthropic.as_bytes());
        let (_, c) = to_callout(&host, &p, "/v1/chat/completions", chat.as_bytes());
        assert!(a["keys"].as_array().is_some_and(|k| k.len() > 4), "{a}");
        assert_eq!(a["keys"], c["keys"]);
        assert_eq!(a["affinity_key"], "user:t1|messages");
        // A malformed one fails open, counted as a bad request.
        let bad = br#"{"model": "m", "messages": [{"role": "user", "content": []}]}"#;
        post(&host, "/v1/messages", bad);
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Pause);
        assert_eq!(r.on_request_body(&host, bad.len(), true), Step::Continue);
        assert_eq!(pinned(&r), Some(false));
    }

    /// A conversation growing turn by turn (and a fork inside it, with and without a salt): the
    /// keys sent with the caches warm are exactly the keys of a cold encoder and a fresh hasher.
    #[test]
    fn cached_keys_equal_uncached_keys_over_a_multi_turn_conversation() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let cold = PromptEncoder::load(
            tiny_tokenizer_json().as_bytes(),
            Some(TINY_CONFIG.as_bytes()),
        )
        .unwrap();
        let contract =
            HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(2).unwrap()).with_seed("0");
        let mut messages = vec![json!({"role": "system", "content": "hello hello, you help"})];
        let mut bodies = Vec::new();
        for turn in 0..6 {
            messages.push(json!({"role": "user", "content": format!("hello {turn} there {}", "hell ".repeat(turn))}));
            bodies.push(json!({"model": "m", "messages": messages}));
            messages.push(json!({"role": "assistant", "content": format!("hello back {turn}")}));
        }
        let mut fork = bodies[3].clone();
        fork["messages"][3]["content"] = json!("hello back, forked");
        bodies.push(fork.clone());
        fork["cache_salt"] = json!("tenant");
        bodies.push(fork);
        bodies.push(bodies[4].clone());
        for body in &bodies {
            let bytes = body.to_string();
            let (_, sent) = to_callout(&host, &p, "/v1/chat/completions", bytes.as_bytes());
            let request = Request::from_json(bytes.as_bytes()).unwrap();
            cold.clear_caches();
            let (ids, _, _) = cold.tokens(&request).unwrap();
            let extra = ExtraKeys {
                cache_salt: request.cache_salt.clone(),
                ..ExtraKeys::default()
            };
            let want: Vec<u64> = contract
                .keys(&ids, &extra)
                .unwrap()
                .iter()
                .map(|k| k.0)
                .collect();
            let got: Vec<u64> = sent["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_u64().unwrap())
                .collect();
            assert_eq!(got, want, "{body}");
            assert_eq!(sent["token_count"].as_u64(), Some(ids.len() as u64));
        }
        assert!(host.counter("kvroute_filter_key_cache_hits_total").unwrap() > 0);
        // The tiny test template is not one kvroute renders natively.
        assert!(host.counter("kvroute_filter_render_jinja_total").unwrap() > 0);
        assert_eq!(host.counter("kvroute_filter_render_native_total"), Some(0));
        assert!(
            host.counter("kvroute_filter_key_cache_misses_total")
                .unwrap()
                > 0
        );
        assert!(
            host.counter("kvroute_filter_segment_cache_hits_total")
                .unwrap()
                > 0
        );
        assert!(
            host.counter("kvroute_filter_piece_cache_misses_total")
                .unwrap()
                > 0
        );
        assert!(!host.samples("kvroute_filter_keys_us").is_empty());
    }

    #[test]
    fn pd_mode_pins_decode_and_names_the_prefiller() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":[1,2,3,4,5]}"#);
        let pd = br#"{"endpoint":"127.0.0.1:8001","matched_blocks":2,"tier":"tier15","decode_endpoint":"127.0.0.1:9001"}"#;
        r.on_route_response(&host, 1, Some("200"), pd);
        assert_eq!(
            host.req_header("x-kvroute-pin").as_deref(),
            Some("MTI3LjAuMC4xOjkwMDE=")
        );
        assert_eq!(
            host.req_header(PREFILLER_HEADER).as_deref(),
            Some("127.0.0.1:8001")
        );
    }

    #[test]
    fn every_callout_failure_resumes_unpinned_and_is_counted() {
        for (status, body, stat) in [
            (Some("504"), &b""[..], "timeout"),
            (Some("503"), b"", "unavailable"),
            (Some("500"), b"boom", "status"),
            (Some("200"), b"garbage", "bad_response"),
            (Some("401"), b"", "status"),
            (Some("\u{fffd}"), b"", "status"),
            (None, b"", "unavailable"),
        ] {
            let host = FakeHost::default();
            let p = ready(&host, CFG);
            let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
            r.on_route_response(&host, 99, status, body); // wrong token: ignored
            assert_eq!(host.resumed.get(), 0);
            r.on_route_response(&host, 1, status, body);
            assert_eq!(host.resumed.get(), 1, "{stat}");
            assert_eq!(pinned(&r), Some(false));
            assert_eq!(host.req_header("x-kvroute-pin"), None);
            assert_eq!(
                host.counter(&format!("kvroute_filter_fail_open_{stat}_total")),
                Some(1),
                "{stat}"
            );
        }
    }

    #[test]
    fn a_callout_without_an_answer_past_its_timeout_counts_as_a_timeout() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
        // Envoy reset the callout 30 ms later (its 25 ms timeout fired mid-body).
        host.clock.set(host.clock.get() + 30_000_000);
        host.no_answer();
        r.on_route_response(&host, 1, None, b"");
        assert_eq!(host.resumed.get(), 1);
        assert_eq!(pinned(&r), Some(false));
        assert_eq!(
            host.counter("kvroute_filter_fail_open_timeout_total"),
            Some(1)
        );
        assert_eq!(
            host.counter("kvroute_filter_fail_open_unavailable_total"),
            Some(0)
        );
    }

    #[test]
    fn routing_headers_that_are_not_utf8_are_removed_and_the_request_still_routes() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let body = br#"{"prompt":"hello"}"#;
        post(&host, "/v1/completions", body);
        for name in [
            "x-kvroute-pin",
            PREFILLER_HEADER,
            TIER_HEADER,
            MATCHED_HEADER,
        ] {
            host.raw_request_headers
                .borrow_mut()
                .insert(name.into(), b"\xff\xfe".to_vec());
        }
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Pause);
        assert!(host.raw_request_headers.borrow().is_empty());
        assert_eq!(
            host.counter("kvroute_filter_spoofed_headers_total"),
            Some(4)
        );
        assert_eq!(r.on_request_body(&host, body.len(), true), Step::Pause);
        r.on_route_response(&host, 1, Some("200"), HIT);
        assert_eq!(pinned(&r), Some(true));
        assert_eq!(host.req_header(TIER_HEADER).as_deref(), Some("tier15"));
    }

    #[test]
    fn a_content_type_that_is_not_utf8_fails_open_and_is_counted() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        post(&host, "/v1/completions", br#"{"prompt":"hello"}"#);
        host.raw_request_headers
            .borrow_mut()
            .insert("content-type".into(), b"application/json\xff".to_vec());
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Continue);
        assert_eq!(pinned(&r), Some(false));
        assert!(host.calls.borrow().is_empty());
        assert_eq!(
            host.counter("kvroute_filter_fail_open_bad_header_total"),
            Some(1)
        );
    }

    #[test]
    fn route_token_goes_out_as_a_bearer_header_on_every_callout() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(&host, br#"{"rule":"10.0.0.1:8080","route_token":"t0k3n"}"#);
        p.note_traffic();
        p.on_tick(&host);
        p.on_call_response(&host, 1, Some("200"), CONTRACT);
        p.on_tick(&host);
        let (_r, _) = {
            p.on_call_response(&host, 2, Some("200"), tiny_tokenizer_json().as_bytes());
            p.on_tick(&host);
            p.on_call_response(&host, 3, Some("200"), TINY_CONFIG.as_bytes());
            to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#)
        };
        let calls = host.calls.borrow();
        assert_eq!(calls.len(), 4, "{calls:?}");
        for c in calls.iter() {
            assert_eq!(
                c.authorization.as_deref(),
                Some("Bearer t0k3n"),
                "{}",
                c.path
            );
        }
        drop(calls);
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let _ = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
        assert_eq!(host.calls.borrow()[0].authorization, None);
    }

    #[test]
    fn spoofed_headers_are_removed_on_every_request() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        {
            let mut h = host.request_headers.borrow_mut();
            h.insert(":method".into(), "GET".into());
            h.insert(":path".into(), "/v1/models".into());
            h.insert("x-kvroute-pin".into(), "MTI3LjAuMC4xOjE=".into());
            h.insert(PREFILLER_HEADER.into(), "evil:1".into());
        }
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, true), Step::Continue);
        assert!(matches!(r.state(), RequestState::Passthrough));
        assert_eq!(host.req_header("x-kvroute-pin"), None);
        assert_eq!(host.req_header(PREFILLER_HEADER), None);
        assert_eq!(
            host.counter("kvroute_filter_spoofed_headers_total"),
            Some(2)
        );
    }

    #[test]
    fn unroutable_requests_pass_without_a_callout() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        // Wrong method, unknown path, non-JSON content type: released at the headers.
        for (method, path, ct) in [
            ("GET", "/v1/chat/completions", "application/json"),
            ("POST", "/v2/x", "application/json"),
            ("POST", "/v1/completions", "text/plain"),
        ] {
            post(&host, path, b"{}");
            host.request_headers
                .borrow_mut()
                .insert(":method".into(), method.into());
            host.request_headers
                .borrow_mut()
                .insert("content-type".into(), ct.into());
            let mut r = p.new_request();
            assert_eq!(
                r.on_request_headers(&host, false),
                Step::Continue,
                "{method} {path} {ct}"
            );
            assert_eq!(r.on_request_body(&host, 2, true), Step::Continue);
        }
        // Malformed, non-UTF-8, missing fields: read, then released unpinned.
        for body in [
            &b"{not json"[..],
            b"\xff\xfe\x00",
            br#"{"model":"m"}"#,
            br#"{"messages":"x"}"#,
            b"[]",
        ] {
            post(&host, "/v1/chat/completions", body);
            let mut r = p.new_request();
            assert_eq!(r.on_request_headers(&host, false), Step::Pause);
            assert_eq!(r.on_request_body(&host, body.len(), true), Step::Continue);
            assert_eq!(pinned(&r), Some(false));
        }
        assert_eq!(
            host.counter("kvroute_filter_fail_open_bad_request_total"),
            Some(5)
        );
        // Too large, by content-length or by size.
        post(&host, "/v1/completions", b"{}");
        host.request_headers
            .borrow_mut()
            .insert("content-length".into(), "999999999".into());
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Continue);
        post(&host, "/v1/completions", b"{}");
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Pause);
        assert_eq!(
            r.on_request_body(&host, (4 << 20) + 1, false),
            Step::Continue
        );
        assert_eq!(
            host.counter("kvroute_filter_fail_open_body_too_large_total"),
            Some(2)
        );
        assert!(host.calls.borrow().is_empty());
        assert_eq!(host.counter(REQUESTS_TOTAL), Some(10));
    }

    #[test]
    fn no_contract_fails_open_and_no_tokenizer_asks_without_keys() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(&host, CFG.as_bytes());
        post(&host, "/v1/completions", br#"{"prompt":"hello"}"#);
        let mut r = p.new_request();
        r.on_request_headers(&host, false);
        assert_eq!(r.on_request_body(&host, 18, true), Step::Continue);
        assert_eq!(
            host.counter("kvroute_filter_fail_open_no_contract_total"),
            Some(1)
        );
        p.on_tick(&host);
        p.on_call_response(&host, 1, Some("200"), CONTRACT);
        let (_, sent) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
        assert_eq!(sent["keys"], json!([]));
        assert_eq!(host.counter("kvroute_filter_no_tokenizer_total"), Some(1));
        // Token-id prompts need no tokenizer.
        let (_, sent) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":[1,2,3,4]}"#);
        assert_eq!(sent["keys"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn offload_sends_text_and_messages_instead_of_keys() {
        let host = FakeHost::default();
        let p = ready(&host, r#"{"rule":"1","tokenize":"service"}"#);
        let (_, sent) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello there"}"#);
        assert_eq!(
            (
                sent["prompt"].as_str(),
                sent["keys"].as_array().map(Vec::len)
            ),
            (Some("hello there"), Some(0))
        );
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let (_, sent) = to_callout(
            &host,
            &p,
            "/v1/chat/completions",
            json!({"messages": msgs}).to_string().as_bytes(),
        );
        assert_eq!(sent["messages"], msgs);
        assert!(host.samples("kvroute_filter_tokenize_us").is_empty());
    }

    #[test]
    fn filter_state_mode_releases_headers_and_publishes_the_pin_as_properties() {
        let host = FakeHost::default();
        let p = ready(&host, r#"{"rule":"1","pin_mode":"filter_state"}"#);
        let body = br#"{"prompt":[1,2,3,4]}"#;
        post(&host, "/v1/completions", body);
        let mut r = p.new_request();
        assert_eq!(r.on_request_headers(&host, false), Step::Continue);
        assert_eq!(r.on_request_body(&host, 4, false), Step::Pause);
        assert_eq!(r.on_request_body(&host, body.len(), true), Step::Pause);
        r.on_route_response(&host, 1, Some("200"), HIT);
        assert_eq!(host.resumed.get(), 1);
        assert_eq!(host.req_header("x-kvroute-pin"), None);
        let props = host.properties.borrow();
        assert_eq!(
            props.get("kvroute_pin").map(String::as_str),
            Some("MTI3LjAuMC4xOjgwMDE=")
        );
        assert_eq!(
            props.get("kvroute_tier").map(String::as_str),
            Some("tier15")
        );
        assert_eq!(
            props.get("kvroute_matched_blocks").map(String::as_str),
            Some("3")
        );
    }

    #[test]
    fn dispatch_refusal_fails_open() {
        let mut host = FakeHost::default();
        let p = ready(&host, CFG);
        host.refuse_dispatch = true;
        post(&host, "/v1/completions", br#"{"prompt":"hello"}"#);
        let mut r = p.new_request();
        r.on_request_headers(&host, false);
        assert_eq!(r.on_request_body(&host, 18, true), Step::Continue);
        assert_eq!(
            host.counter("kvroute_filter_fail_open_dispatch_total"),
            Some(1)
        );
    }

    #[test]
    fn response_strips_session_header_and_counts_usage() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
        r.on_route_response(&host, 1, Some("200"), HIT);
        host.response_headers
            .borrow_mut()
            .insert("x-kvroute-pin".into(), "MTI3LjAuMC4xOjgwMDE=".into());
        host.response_headers
            .borrow_mut()
            .insert("content-type".into(), "text/event-stream".into());
        r.on_response_headers(&host);
        assert_eq!(host.response_headers.borrow().get("x-kvroute-pin"), None);
        for (chunk, eos) in [
            (&b"data: {\"choices\":[],\"usage\":null}\n\n"[..], false),
            (b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":48,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n", true),
        ] {
            *host.response_body.borrow_mut() = chunk.to_vec();
            r.on_response_body(&host, chunk.len(), eos);
        }
        assert_eq!(
            host.counter("kvroute_filter_cache_hit_tokens_total"),
            Some(32)
        );
        assert_eq!(
            host.counter("kvroute_filter_cache_miss_tokens_total"),
            Some(16)
        );
    }

    /// One request routed with `answer` (`None`: the callout fails, so it goes unpinned) whose
    /// response reports `prompt` tokens, `cached` of them reused.
    fn respond(host: &FakeHost, p: &Plugin, answer: Option<&[u8]>, prompt: u32, cached: u32) {
        let (mut r, _) = to_callout(host, p, "/v1/completions", br#"{"prompt":"hello"}"#);
        let token = match r.state() {
            RequestState::AwaitingRoute { token, .. } => *token,
            s => panic!("{s:?}"),
        };
        match answer {
            Some(a) => r.on_route_response(host, token, Some("200"), a),
            None => r.on_route_response(host, token, Some("503"), b""),
        }
        r.on_response_headers(host);
        let body = format!(
            r#"{{"usage":{{"prompt_tokens":{prompt},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
        );
        *host.response_body.borrow_mut() = body.clone().into_bytes();
        r.on_response_body(host, body.len(), true);
    }

    /// Each pinned response's reuse is judged against the answer's matched blocks (block size 2
    /// in this contract); an unpinned (fail-open) response is not judged.
    #[test]
    fn responses_judge_the_predicted_reuse() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let respond = |answer, prompt, cached| respond(&host, &p, answer, prompt, cached);
        let count = |name: &str| host.counter(name).unwrap_or(0);
        // HIT predicts 3 blocks = 6 tokens.
        respond(Some(HIT), 20, 6);
        respond(Some(HIT), 20, 2);
        respond(Some(HIT), 20, 10);
        // 7 tokens: only 3 full blocks precede the last token, so 3 is exact.
        respond(Some(HIT), 7, 6);
        respond(None, 20, 0);
        assert_eq!(
            (
                count("kvroute_filter_prediction_exact_total"),
                count("kvroute_filter_prediction_under_total"),
                count("kvroute_filter_prediction_over_total"),
            ),
            (2, 1, 1)
        );
        assert_eq!(count("kvroute_filter_predicted_tokens_total"), 24);
        assert_eq!(count("kvroute_filter_over_predicted_tokens_total"), 4);
        assert_eq!(count("kvroute_filter_usage_parsed_total"), 5);
    }

    /// Judged responses are reported per endpoint on the first tick after `report_ms`; a failed
    /// report is added back and goes out with the next one.
    #[test]
    fn judged_responses_are_reported_and_a_failed_report_is_sent_again() {
        let host = FakeHost::default();
        let mut p = ready(&host, CFG);
        respond(&host, &p, Some(HIT), 20, 6);
        respond(&host, &p, Some(HIT), 20, 0);
        respond(&host, &p, None, 20, 0);
        let later = |host: &FakeHost| host.clock.set(host.clock.get() + 6_000_000_000);
        let sent = |host: &FakeHost, p: &mut Plugin| {
            host.calls.borrow_mut().clear();
            later(host);
            p.on_tick(host);
            let calls = host.calls.borrow();
            let call = calls.last()?;
            assert_eq!(
                (call.method.as_str(), call.path.as_str()),
                ("POST", "/v1/rules/10.0.0.1:8080/outcomes")
            );
            let report: kvroute_core::wire::OutcomeReport =
                serde_json::from_slice(&call.body).unwrap();
            Some(report)
        };
        let report = sent(&host, &mut p).unwrap();
        assert_eq!(report.endpoints.len(), 1);
        let e = &report.endpoints[0];
        assert_eq!(
            (e.endpoint.as_str(), e.judged, e.exact, e.over),
            ("127.0.0.1:8001", 2, 1, 1)
        );
        assert_eq!((e.qualifying, e.missed), (2, 1));
        assert_eq!((e.predicted_blocks, e.realised_blocks), (6, 3));
        p.on_call_response(&host, 1, Some("503"), b"");
        let count = |name: &str| host.counter(name).unwrap_or(0);
        assert_eq!(count("kvroute_filter_outcome_report_failures_total"), 1);
        respond(&host, &p, Some(HIT), 20, 6);
        let again = sent(&host, &mut p).unwrap();
        assert_eq!(
            (again.endpoints[0].judged, again.endpoints[0].exact),
            (3, 2)
        );
        p.on_call_response(&host, 1, Some("200"), b"{}");
        assert_eq!(count("kvroute_filter_outcome_reports_total"), 1);
        assert!(sent(&host, &mut p).is_none(), "nothing new to report");
    }

    /// Each routed response's prompt and cached tokens go to its tenant, pinned or failed open,
    /// in the next report.
    #[test]
    fn responses_are_accounted_to_their_tenant() {
        let host = FakeHost::default();
        let mut p = ready(&host, CFG);
        for (answer, cached) in [(Some(HIT), 6), (None, 0)] {
            let body = br#"{"prompt":"hello","user":"t1","model":"m"}"#;
            let (mut r, _) = to_callout(&host, &p, "/v1/completions", body);
            let token = match r.state() {
                RequestState::AwaitingRoute { token, .. } => *token,
                s => panic!("{s:?}"),
            };
            match answer {
                Some(a) => r.on_route_response(&host, token, Some("200"), a),
                None => r.on_route_response(&host, token, Some("503"), b""),
            };
            r.on_response_headers(&host);
            let usage = format!(
                r#"{{"usage":{{"prompt_tokens":20,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
            );
            *host.response_body.borrow_mut() = usage.clone().into_bytes();
            r.on_response_body(&host, usage.len(), true);
        }
        host.calls.borrow_mut().clear();
        host.clock.set(host.clock.get() + 6_000_000_000);
        p.on_tick(&host);
        let calls = host.calls.borrow();
        let call = calls
            .iter()
            .find(|c| c.path.ends_with("/outcomes"))
            .unwrap();
        let report: kvroute_core::wire::OutcomeReport = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            report.tenants,
            vec![kvroute_core::wire::TenantUsage {
                tenant: "user:t1".into(),
                model: Some("m".into()),
                requests: 2,
                prompt_tokens: 40,
                cached_tokens: 6,
            }]
        );
    }

    /// `report_ms: 0` turns reporting off: nothing is summed, and a tick that would report
    /// (past the default 5 s, before the contract's 30 s refresh) sends nothing.
    #[test]
    fn reporting_can_be_turned_off() {
        let host = FakeHost::default();
        let mut p = ready(&host, r#"{"rule":"10.0.0.1:8080","report_ms":0}"#);
        respond(&host, &p, Some(HIT), 20, 6);
        host.calls.borrow_mut().clear();
        host.clock.set(host.clock.get() + 6_000_000_000);
        p.on_tick(&host);
        assert!(!host
            .calls
            .borrow()
            .iter()
            .any(|c| c.path.ends_with("/outcomes")));
        assert!(p.vm().outcomes.borrow().is_empty());
    }

    /// Where Envoy sent a pinned request is checked against the pin: honored, overridden (Envoy
    /// fell back), or not counted without an upstream address; unpinned requests are not counted.
    #[test]
    fn pins_are_checked_against_the_upstream_envoy_chose() {
        let count = |host: &FakeHost| {
            (
                host.counter("kvroute_filter_pin_honored_total")
                    .unwrap_or(0),
                host.counter("kvroute_filter_pin_overridden_total")
                    .unwrap_or(0),
            )
        };
        for (upstream, pinned, want) in [
            (Some("127.0.0.1:8001"), true, (1, 0)),
            (Some("127.0.0.1:8002"), true, (0, 1)),
            (None, true, (0, 0)),
            (Some("127.0.0.1:8002"), false, (0, 0)),
        ] {
            let host = FakeHost::default();
            let p = ready(&host, CFG);
            let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
            match pinned {
                true => r.on_route_response(&host, 1, Some("200"), HIT),
                false => r.on_route_response(&host, 1, Some("500"), b""),
            }
            if let Some(u) = upstream {
                host.properties
                    .borrow_mut()
                    .insert("upstream.address".into(), u.into());
            }
            r.on_response_headers(&host);
            assert_eq!(count(&host), want, "{upstream:?} pinned {pinned}");
        }
    }

    #[test]
    fn no_rule_passes_through_and_counts() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(&host, b"{}");
        for _ in 0..3 {
            post(&host, "/v1/completions", br#"{"prompt":"x"}"#);
            let mut r = p.new_request();
            assert_eq!(r.on_request_headers(&host, false), Step::Continue);
            assert_eq!(r.on_request_body(&host, 14, true), Step::Continue);
        }
        assert_eq!(host.counter(REQUESTS_TOTAL), Some(3));
    }

    #[test]
    fn abandoned_requests_are_counted() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let (mut r, _) = to_callout(&host, &p, "/v1/completions", br#"{"prompt":"hello"}"#);
        r.on_done(&host);
        assert_eq!(
            host.counter("kvroute_filter_fail_open_aborted_total"),
            Some(1)
        );
        r.on_route_response(&host, 1, Some("200"), HIT);
        assert_eq!(host.resumed.get(), 0);
    }

    /// `max_prefix_tokens` bounds the ids routed on, and a pre-token piece over the piece bound
    /// (a 1M-character word) ends them; each cut is counted.
    #[test]
    fn long_prompts_route_on_their_first_tokens_and_count_the_cut() {
        let host = FakeHost::default();
        let p = ready(&host, r#"{"rule":"10.0.0.1:8080","max_prefix_tokens":8}"#);
        let body = json!({"prompt": "hello ".repeat(100)}).to_string();
        let (_, sent) = to_callout(&host, &p, "/v1/completions", body.as_bytes());
        assert_eq!(sent["token_count"], 8, "{sent}");
        assert_eq!(sent["keys"].as_array().unwrap().len(), 4);
        let max = "kvroute_filter_prefix_truncated_max_tokens_total";
        let long = "kvroute_filter_prefix_truncated_long_piece_total";
        assert_eq!(host.counter(max), Some(1));
        let body = json!({"prompt": format!("hello {}", "x".repeat(1_000_000))}).to_string();
        let (_, sent) = to_callout(&host, &p, "/v1/completions", body.as_bytes());
        assert_eq!(sent["token_count"], 1, "{sent}");
        assert_eq!((host.counter(max), host.counter(long)), (Some(1), Some(1)));
    }
}
