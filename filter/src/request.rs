//! Per-request logic (the proxy-wasm HTTP context's behaviour), driven by [`RequestState`].
//!
//! ```text
//! Start ──headers──► Passthrough                      (not POST /v1/{chat/,}completions, no rule, no body)
//!   │
//!   └──headers (Pause)──► ReadingBody ──end of body──► AwaitingRoute ──answer──► Forwarded (pinned)
//!                             │                            │
//!                             └──any failure──────────────┴──────────────────► Forwarded (unpinned, counted)
//! ```
//! With `pin_mode: filter_state` (Istio WasmPlugin) the headers are released at once and the body
//! is held instead; the decision goes out as filter state (see [`crate::config::PinMode`]).
//! (Envoy does not expose the body at the headers callback, not even with a buffer filter ahead:
//! measured, so the body callbacks are the only way to read it.)
//!
//! Every step goes through [`RequestFilter::fail_open`] on failure: the request continues (or is
//! resumed if the callout holds it) without a pin and the reason is counted. Client-supplied
//! routing headers are removed before anything else, and the body is never modified.

use std::rc::Rc;

use base64::Engine as _;
use kvroute_core::hash::{BlockKey, ExtraKeys};
use kvroute_core::prompt::{Endpoint, Prompt, Request, RequestBody};

use crate::config::{PinMode, TokenizeMode};
use crate::host::{Body, Callout, Headers, Host, Level};
use crate::plugin::VmState;
use crate::stats::{FailReason, Stat};
use crate::usage::{self, Tail};
use crate::wire::{RouteAnswer, RouteRequest, Tier};
use kvroute_core::wire::WireKey;

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

/// Where one request is in the filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    /// Nothing seen yet.
    Start,
    /// Not a request the filter routes: released at the headers.
    Passthrough,
    /// Held at the headers while the body is buffered.
    ReadingBody,
    /// Held while the route callout with this token is in flight.
    AwaitingRoute { token: u32 },
    /// Released upstream after a decision (pinned) or a failure (unpinned).
    Forwarded { pinned: bool },
}

/// State of one HTTP request.
#[derive(Debug)]
pub struct RequestFilter {
    vm: Rc<VmState>,
    state: RequestState,
    endpoint: Option<Endpoint>,
    started_ns: u64,
    /// When the route callout was sent (0 before).
    dispatched_ns: u64,
    /// The `ip:port` this request was pinned to, checked against the upstream Envoy chose.
    pinned_to: Option<String>,
    /// Parse `usage` from the response (routed paths only).
    track_usage: bool,
    sse: bool,
    tail: Tail,
}

fn duration_ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn routed_endpoint(path: &str) -> Option<Endpoint> {
    let path = path.split(['?', '#']).next().unwrap_or(path);
    match path {
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
        _ => None,
    }
}

impl RequestFilter {
    /// A request that has not been seen yet.
    pub fn new(vm: Rc<VmState>) -> Self {
        RequestFilter {
            vm,
            state: RequestState::Start,
            endpoint: None,
            started_ns: 0,
            dispatched_ns: 0,
            pinned_to: None,
            track_usage: false,
            sse: false,
            tail: Tail::default(),
        }
    }

    /// Current state.
    pub fn state(&self) -> RequestState {
        self.state
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
        if self.state != RequestState::Start {
            return Step::Continue;
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
            return Step::Continue;
        }
        let method = host.header(Headers::Request, ":method");
        let endpoint = host
            .header(Headers::Request, ":path")
            .as_deref()
            .and_then(routed_endpoint);
        let (Some("POST"), Some(endpoint)) = (method.as_deref(), endpoint) else {
            return Step::Continue;
        };
        if let Some(ct) = host.header_bytes(Headers::Request, "content-type") {
            let Ok(ct) = String::from_utf8(ct) else {
                return self.fail_open(host, FailReason::BadHeader, "content-type is not UTF-8");
            };
            if !ct.to_ascii_lowercase().contains("json") {
                return Step::Continue;
            }
        }
        self.endpoint = Some(endpoint);
        self.track_usage = true;
        self.started_ns = host.now_nanos();
        stats.inc(host, Stat::Considered);
        if end_of_stream {
            return self.fail_open(host, FailReason::BadRequest, "no body");
        }
        let declared = host
            .header(Headers::Request, "content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.vm.config.max_body_bytes) {
            return self.fail_open(
                host,
                FailReason::BodyTooLarge,
                "content-length over max_body_bytes",
            );
        }
        self.state = RequestState::ReadingBody;
        match self.vm.config.pin_mode {
            PinMode::Header => Step::Pause,
            // The headers go on to the buffer filter, which holds them from the router.
            PinMode::FilterState => Step::Continue,
        }
    }

    /// A request body chunk arrived (`body_size` is everything buffered so far).
    pub fn on_request_body(
        &mut self,
        host: &dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Step {
        if self.state != RequestState::ReadingBody {
            return Step::Continue;
        }
        if body_size > self.vm.config.max_body_bytes {
            return self.fail_open(host, FailReason::BodyTooLarge, "body over max_body_bytes");
        }
        if !end_of_stream {
            return Step::Pause;
        }
        let Some(body) = host.body(Body::Request, body_size) else {
            return self.fail_open(host, FailReason::BadRequest, "body unavailable");
        };
        self.ask(host, &body)
    }

    /// Builds the route question for a complete body and sends it.
    fn ask(&mut self, host: &dyn Host, body: &[u8]) -> Step {
        let vm = self.vm.clone();
        let prepare_ns = host.now_nanos();
        let Some(endpoint) = self.endpoint else {
            return self.fail_open(host, FailReason::BadRequest, "no endpoint");
        };
        let request = match Request::from_json_for(body, endpoint) {
            Ok(r) => r,
            Err(e) => return self.fail_open(host, FailReason::BadRequest, &e.to_string()),
        };
        let Some(contract) = vm.contract.borrow().clone() else {
            return self.fail_open(host, FailReason::NoContract, "rule contract not loaded");
        };
        let Some(rule) = vm.config.rule.as_deref() else {
            return self.fail_open(host, FailReason::NoContract, "no rule");
        };
        let mut route = RouteRequest {
            rule: rule.to_owned(),
            model: request.model.clone(),
            affinity_key: request.user.clone(),
            ..Default::default()
        };
        let offload = vm.config.tokenize == TokenizeMode::Service;
        let tokens: Option<Vec<u32>> = match (&contract.hash, &request.body) {
            // KV off for the rule: the service applies its fallback.
            (None, _) => None,
            (Some(_), RequestBody::Completion(Prompt::TokenIds(ids))) => Some(ids.clone()),
            (Some(_), RequestBody::Completion(Prompt::Text(t))) if offload => {
                route.prompt = Some(t.clone());
                None
            }
            (Some(_), RequestBody::Chat(_)) if offload => None,
            (Some(_), _) => {
                let encoder = vm.encoder.borrow().clone();
                match encoder {
                    None => {
                        vm.stats.inc(host, Stat::NoTokenizer);
                        None
                    }
                    Some(enc) => {
                        let t0 = host.now_nanos();
                        crate::tokens::set_clock(i64::try_from(t0 / 1_000_000_000).unwrap_or(0));
                        let res = enc.tokens(&request);
                        vm.stats.record(
                            host,
                            Stat::TokenizeUs,
                            host.now_nanos().saturating_sub(t0) / 1000,
                        );
                        match res {
                            Ok((ids, seg)) => {
                                vm.stats.add(host, Stat::SegmentHits, seg.hits);
                                vm.stats.add(host, Stat::SegmentMisses, seg.misses);
                                vm.stats.add(host, Stat::PieceHits, seg.piece_hits);
                                vm.stats.add(host, Stat::PieceMisses, seg.piece_misses);
                                if let Some(t) = seg.truncated {
                                    vm.stats.inc(host, Stat::truncated(t));
                                }
                                Some(ids)
                            }
                            Err(e) => {
                                return self.fail_open(host, FailReason::Tokenize, &e.to_string())
                            }
                        }
                    }
                }
            }
        };
        // Offloaded chat: the messages travel as the client sent them (re-read from the body).
        let messages_holder: Option<serde_json::Value> =
            match (&request.body, offload && contract.hash.is_some()) {
                (RequestBody::Chat(_), true) => serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|mut v| v.get_mut("messages").map(serde_json::Value::take)),
                _ => None,
            };
        route.messages = messages_holder;
        if let (Some(ids), Some(hash)) = (&tokens, &contract.hash) {
            let extra = ExtraKeys {
                cache_salt: request.cache_salt.clone(),
                ..ExtraKeys::default()
            };
            // Keys of a prefix seen before come from the cache (exactly the hasher's keys).
            let t0 = host.now_nanos();
            let keys = vm.keys.borrow_mut().keys(hash, &extra, ids);
            vm.stats.record(
                host,
                Stat::KeysUs,
                host.now_nanos().saturating_sub(t0) / 1000,
            );
            let keys: Vec<BlockKey> = match keys {
                Ok((keys, stats)) => {
                    vm.stats.add(host, Stat::KeyCacheHits, stats.hits);
                    vm.stats.add(host, Stat::KeyCacheMisses, stats.misses);
                    keys
                }
                Err(e) => return self.fail_open(host, FailReason::Hash, &e.to_string()),
            };
            route.keys = keys.into_iter().map(WireKey::from).collect();
            route.token_count = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        }
        let json = match serde_json::to_vec(&route) {
            Ok(j) => j,
            Err(e) => return self.fail_open(host, FailReason::BadRequest, &e.to_string()),
        };
        let c = &vm.config;
        let call = Callout {
            cluster: &c.inventory_cluster,
            method: "POST",
            path: "/v1/route",
            authority: &c.inventory_authority,
            body: Some(&json),
            timeout: c.timeout,
            bearer: c.route_token.as_ref().map(|t| t.as_str()),
        };
        match host.dispatch(&call) {
            Some(token) => {
                self.dispatched_ns = host.now_nanos();
                vm.stats.record(
                    host,
                    Stat::PrepareUs,
                    self.dispatched_ns.saturating_sub(prepare_ns) / 1000,
                );
                self.state = RequestState::AwaitingRoute { token };
                Step::Pause
            }
            None => self.fail_open(host, FailReason::Dispatch, "dispatch_http_call refused"),
        }
    }

    /// The route callout answered (`status` is its `:status`). Resumes the request in every case.
    pub fn on_route_response(
        &mut self,
        host: &dyn Host,
        token: u32,
        status: Option<&str>,
        body: &[u8],
    ) {
        if self.state != (RequestState::AwaitingRoute { token }) {
            return;
        }
        let elapsed_ns = host.now_nanos().saturating_sub(self.dispatched_ns);
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
        match answer {
            Ok(a) => {
                self.pin(host, &a);
                host.resume_request();
            }
            Err(reason) => {
                self.fail_open(
                    host,
                    reason,
                    &format!(
                        "route answer status {} after {} us",
                        status.unwrap_or("none"),
                        elapsed_ns / 1000
                    ),
                );
                host.resume_request();
            }
        }
    }

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
        if pinned {
            self.pinned_to = Some(target);
        }
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
                Some(Tier::Tier15) => Stat::DecisionTier15,
                Some(Tier::Fallback) => Stat::DecisionFallback,
                None => Stat::DecisionOther,
            },
        );
        self.finish(host, pinned);
    }

    fn finish(&mut self, host: &dyn Host, pinned: bool) {
        self.state = RequestState::Forwarded { pinned };
        if self.started_ns > 0 {
            self.vm.stats.record(
                host,
                Stat::FilterUs,
                host.now_nanos().saturating_sub(self.started_ns) / 1000,
            );
        }
    }

    /// The failure policy, applied by every step: count, log at debug, release unpinned.
    /// (A request held by the callout is resumed by the caller.)
    fn fail_open(&mut self, host: &dyn Host, reason: FailReason, detail: &str) -> Step {
        self.vm.stats.inc(host, Stat::FailOpen(reason));
        host.log(
            Level::Debug,
            &format!("kvroute-filter: unpinned ({}): {detail}", reason.as_str()),
        );
        self.finish(host, false);
        Step::Continue
    }

    /// Response headers: drop the stateful-session echo (it names a backend), note SSE, and
    /// count whether Envoy sent a pinned request where it was pinned (a silent fallback would
    /// otherwise look like a cache that evicts).
    pub fn on_response_headers(&mut self, host: &dyn Host) -> Step {
        let pin = self.vm.config.pin_header.clone();
        if host.header_bytes(Headers::Response, &pin).is_some() {
            host.set_header(Headers::Response, &pin, None);
        }
        if let Some(target) = self.pinned_to.take() {
            if let Some(upstream) = host.property(&["upstream", "address"]) {
                let honored = upstream == target.as_bytes();
                self.vm.stats.inc(
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
        if self.track_usage {
            self.sse = host
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
        if !self.track_usage {
            return Step::Continue;
        }
        if body_size > 0 {
            if let Some(chunk) = host.body(Body::Response, body_size) {
                self.tail.push(&chunk);
            }
        }
        if end_of_stream {
            self.track_usage = false;
            if let Some(u) = usage::parse(self.tail.bytes(), self.sse) {
                let s = &self.vm.stats;
                s.inc(host, Stat::UsageParsed);
                s.add(host, Stat::CacheHitTokens, u.hit_tokens);
                s.add(host, Stat::CacheMissTokens, u.miss_tokens);
            }
            self.tail = Tail::default();
        }
        Step::Continue
    }

    /// The stream ended: a request still held was abandoned by the client.
    pub fn on_done(&mut self, host: &dyn Host) {
        if matches!(
            self.state,
            RequestState::ReadingBody | RequestState::AwaitingRoute { .. }
        ) {
            self.vm.stats.inc(host, Stat::FailOpen(FailReason::Aborted));
            self.state = RequestState::Forwarded { pinned: false };
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
    use kvroute_core::hash::{BlockSize, HashAlgo, HashContract};
    use serde_json::{json, Value};

    const CONTRACT: &[u8] = br#"{"rule_id":1,"engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":2,"key_mode":"engine","model":"Org/M","kv_enabled":true}"#;
    const HIT: &[u8] = br#"{"rule_id":1,"endpoint":"127.0.0.1:8001","matched_blocks":3,"tier":"tier15","reason":"hit","decode_endpoint":null}"#;

    /// A plugin with the contract and the tiny tokenizer loaded.
    fn ready(host: &FakeHost, config: &str) -> Plugin {
        let mut p = Plugin::new();
        p.configure(host, config.as_bytes());
        p.note_traffic();
        p.on_tick(host);
        p.on_call_response(host, 1, Some("200"), CONTRACT);
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

    #[test]
    fn pins_the_chosen_endpoint_with_base64_and_observability_headers() {
        let host = FakeHost::default();
        let p = ready(&host, CFG);
        let body = json!({"model": "Org/M", "messages": [{"role": "user", "content": "hello hello hello"}], "user": "t1"}).to_string();
        let (mut r, sent) = to_callout(&host, &p, "/v1/chat/completions", body.as_bytes());
        assert_eq!(sent["rule"], "10.0.0.1:8080");
        assert_eq!(sent["affinity_key"], "t1");
        let n = sent["token_count"].as_u64().unwrap();
        assert!(n > 4, "{sent}");
        assert_eq!(sent["keys"].as_array().unwrap().len() as u64, n / 2);
        assert_eq!(host.calls.borrow()[0].timeout_ms, 25);
        host.answer(200, HIT);
        let token = match r.state() {
            RequestState::AwaitingRoute { token } => token,
            s => panic!("{s:?}"),
        };
        r.on_route_response(&host, token, Some("200"), HIT);
        assert_eq!(host.resumed.get(), 1);
        assert_eq!(r.state(), RequestState::Forwarded { pinned: true });
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
            let (ids, _) = cold.tokens(&request).unwrap();
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
            assert_eq!(r.state(), RequestState::Forwarded { pinned: false });
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
        assert_eq!(r.state(), RequestState::Forwarded { pinned: false });
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
        assert_eq!(r.state(), RequestState::Forwarded { pinned: true });
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
        assert_eq!(r.state(), RequestState::Forwarded { pinned: false });
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
        assert_eq!(r.state(), RequestState::Passthrough);
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
            assert_eq!(r.state(), RequestState::Forwarded { pinned: false });
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
