//! One ext_proc stream (one HTTP request) as a state machine: which message comes in, in which
//! processing mode, and what goes back. Synchronous and I/O-free; the decision itself is asked
//! of the caller ([`Next::Decide`]) and handed back through [`Exchange::decided`].
//!
//! Processing modes (`request_body_mode`, read from the proxy's `protocol_config`):
//!
//! | mode | request headers | request body | decision answered in |
//! |---|---|---|---|
//! | `BUFFERED`, `BUFFERED_PARTIAL` (the default when the proxy does not say) | answered at once, removing a client-sent destination | one message | the body answer (header mutation + dynamic metadata) |
//! | `FULL_DUPLEX_STREAMED` | held | collected up to the body cap, then sent back unchanged as streamed chunks | the held headers answer, then the body |
//! | `NONE`, `STREAMED` | decided on the headers alone (no keys) | passed | the headers answer |
//!
//! A request without a body (headers with end of stream) is decided on its headers alone.
//! The body is never changed: buffered bodies are not touched, streamed ones are returned byte for
//! byte in order. Over the cap, a full-duplex body is a failure: fail open returns what was
//! held and streams every further chunk straight back ([`Phase::Passthrough`]), so memory stays
//! bounded by the cap.

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{processing_request, ProcessingRequest};

use super::reply::{self, Passed, Pin};
use super::FailureMode;
use crate::metrics::{EppFailure, EppOutcome};

/// How the proxy sends the request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One body message after our headers answer; headers may still change in the body answer.
    Buffered,
    /// Body chunks flow before we answer the headers; we send the body back.
    FullDuplex,
    /// The body does not reach us before the request is routed.
    HeadersOnly,
}

impl Mode {
    fn of(body_mode: i32) -> Mode {
        match BodySendMode::try_from(body_mode) {
            Ok(BodySendMode::FullDuplexStreamed) => Mode::FullDuplex,
            Ok(BodySendMode::None | BodySendMode::Streamed) => Mode::HeadersOnly,
            _ => Mode::Buffered,
        }
    }
}

/// Where the exchange stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing received yet.
    Start,
    /// Headers received; collecting the body.
    Body,
    /// Waiting for the caller's decision.
    Deciding(At),
    /// Decided, unpinned, and the rest of an over-cap full-duplex body streams straight back.
    Passthrough,
    /// The request path is answered; only response-path messages remain.
    Answered,
    /// Rejected with an immediate response: whatever still comes is ignored.
    Rejected,
}

/// Which message the decision answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    Headers,
    BufferedBody,
    DuplexBody,
}

/// What the caller decides on.
#[derive(Debug, PartialEq, Eq)]
pub enum Input {
    /// The request had no body (or the body is not sent before routing).
    NoBody,
    /// The whole body (shared with the exchange, which may have to send it back).
    Body(Bytes),
    /// The body passed the cap: no decision to make, a failure.
    TooLarge,
}

/// The caller's decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Pin to this `ip:port` (a comma-separated list: the chosen endpoint, then fallbacks).
    Pick(String),
    /// Prefill/decode: pin to the decode endpoint and name the prefill one in [`reply::PREFILLER`].
    PickPd { decode: String, prefill: String },
    /// No endpoint could be picked; the failure mode says what happens.
    Fail(EppFailure),
    /// The candidate subset held no eligible endpoint: 503 in either failure mode.
    SubsetUnavailable,
}

/// What the caller does next.
#[derive(Debug)]
pub enum Next {
    /// Send these (possibly none) and read the next message.
    Reply(Vec<ProcessingResponse>),
    /// Decide on this input, then call [`Exchange::decided`].
    Decide(Input),
}

/// A message that breaks the protocol (the stream is ended with an error).
#[derive(Debug, thiserror::Error)]
#[error("ext_proc protocol: {0}")]
pub struct ProtocolError(pub &'static str);

/// One request's exchange.
pub struct Exchange {
    mode: Mode,
    /// The response body comes in full-duplex mode too (we send it back).
    response_duplex: bool,
    phase: Phase,
    body: Vec<u8>,
    /// The body handed to the decision, kept to send back in full-duplex mode.
    held: Bytes,
    max_body: usize,
    /// The request's end of stream came with the body (not with trailers).
    body_ended: bool,
    /// Request trailers arrived while the body was collected: answered after the decision.
    trailers_pending: bool,
    /// The candidate subset from the request headers' metadata.
    pub subset: Option<Vec<String>>,
    /// The request's API key (for the affinity key), from its headers.
    pub api_key: Option<Vec<u8>>,
    /// The request's conversation id ([`kvroute_core::affinity::SESSION_HEADER`]), for the
    /// session tier.
    pub session: Option<String>,
    /// The API the request's `:path` names (completions, chat completions, Anthropic
    /// messages); `None` for another path (the body tells chat from completions).
    pub endpoint: Option<kvroute_core::prompt::Endpoint>,
    /// The endpoint picked, once decided.
    pub picked: Option<String>,
}

impl Exchange {
    /// A new exchange whose bodies may hold at most `max_body` bytes.
    pub fn new(max_body: usize) -> Exchange {
        Exchange {
            mode: Mode::Buffered,
            response_duplex: false,
            phase: Phase::Start,
            body: Vec::new(),
            held: Bytes::new(),
            max_body,
            body_ended: false,
            trailers_pending: false,
            subset: None,
            api_key: None,
            session: None,
            endpoint: None,
            picked: None,
        }
    }

    /// Who sent the request, from its headers.
    pub fn caller(&self) -> super::Caller<'_> {
        super::Caller {
            api_key: self.api_key.as_deref(),
            session: self.session.as_deref(),
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Moves the collected body into `held` and returns a shared handle on it.
    fn hold(&mut self) -> Bytes {
        self.held = Bytes::from(std::mem::take(&mut self.body));
        self.held.clone()
    }

    /// Takes one message from the proxy.
    pub fn on_message(&mut self, req: ProcessingRequest) -> Result<Next, ProtocolError> {
        if let Some(pc) = &req.protocol_config {
            if self.phase == Phase::Start {
                self.mode = Mode::of(pc.request_body_mode);
                self.response_duplex =
                    pc.response_body_mode == BodySendMode::FullDuplexStreamed as i32;
            }
        }
        let Some(r) = req.request else {
            return Err(ProtocolError("a message without a request"));
        };
        if self.phase == Phase::Rejected {
            return Ok(Next::Reply(Vec::new()));
        }
        use processing_request::Request as R;
        match r {
            R::RequestHeaders(h) => {
                if self.phase != Phase::Start {
                    return Err(ProtocolError("request headers twice"));
                }
                self.subset = reply::subset(req.metadata_context.as_ref());
                self.api_key = reply::api_key(h.headers.as_ref());
                self.session =
                    reply::header(h.headers.as_ref(), kvroute_core::affinity::SESSION_HEADER)
                        .and_then(kvroute_core::affinity::session_id);
                self.endpoint = reply::header(h.headers.as_ref(), ":path")
                    .and_then(|p| std::str::from_utf8(p).ok())
                    .and_then(kvroute_core::prompt::Endpoint::from_path);
                if h.end_of_stream || self.mode == Mode::HeadersOnly {
                    self.phase = Phase::Deciding(At::Headers);
                    return Ok(Next::Decide(Input::NoBody));
                }
                self.phase = Phase::Body;
                Ok(Next::Reply(match self.mode {
                    // Answered now so the body comes; the client's destination goes now.
                    Mode::Buffered => vec![reply::request_headers(&Pin::Unpinned)],
                    _ => Vec::new(),
                }))
            }
            R::RequestBody(b) => match self.phase {
                Phase::Body => {
                    let at = match self.mode {
                        Mode::FullDuplex => At::DuplexBody,
                        _ => At::BufferedBody,
                    };
                    if self.body.len().saturating_add(b.body.len()) > self.max_body {
                        // What was held goes back first, then this chunk: order is kept.
                        self.body.extend_from_slice(&b.body);
                        self.hold();
                        self.body_ended = b.end_of_stream;
                        self.phase = Phase::Deciding(at);
                        return Ok(Next::Decide(Input::TooLarge));
                    }
                    self.body.extend_from_slice(&b.body);
                    // A buffered body comes in one message (BUFFERED_PARTIAL: what fit).
                    if b.end_of_stream || at == At::BufferedBody {
                        self.body_ended = b.end_of_stream;
                        self.phase = Phase::Deciding(at);
                        return Ok(Next::Decide(Input::Body(self.hold())));
                    }
                    Ok(Next::Reply(Vec::new()))
                }
                Phase::Passthrough => {
                    if b.end_of_stream {
                        self.phase = Phase::Answered;
                    }
                    Ok(Next::Reply(reply::streamed_body(
                        &b.body,
                        b.end_of_stream,
                        false,
                    )))
                }
                Phase::Answered if self.mode == Mode::FullDuplex => Ok(Next::Reply(
                    reply::streamed_body(&b.body, b.end_of_stream, false),
                )),
                Phase::Answered => Ok(Next::Reply(vec![reply::pass(Passed::RequestBody)])),
                _ => Err(ProtocolError("a request body before the headers")),
            },
            R::RequestTrailers(_) => match self.phase {
                Phase::Body if self.mode == Mode::FullDuplex => {
                    self.trailers_pending = true;
                    self.phase = Phase::Deciding(At::DuplexBody);
                    Ok(Next::Decide(Input::Body(self.hold())))
                }
                _ => Ok(Next::Reply(vec![reply::pass(Passed::RequestTrailers)])),
            },
            R::ResponseHeaders(_) => Ok(Next::Reply(vec![reply::pass(Passed::ResponseHeaders)])),
            R::ResponseBody(b) if self.response_duplex => Ok(Next::Reply(reply::streamed_body(
                &b.body,
                b.end_of_stream,
                true,
            ))),
            R::ResponseBody(_) => Ok(Next::Reply(vec![reply::pass(Passed::ResponseBody)])),
            R::ResponseTrailers(_) => Ok(Next::Reply(vec![reply::pass(Passed::ResponseTrailers)])),
        }
    }

    /// The proxy's next message could not be read: it is over the gRPC message limit. While a
    /// buffered body is awaited that is the body (it comes in one message), too large to pick
    /// on; anything else cannot be answered.
    pub fn message_too_large(&mut self) -> Option<Next> {
        if self.phase != Phase::Body || self.mode == Mode::FullDuplex {
            return None;
        }
        self.body_ended = true;
        self.phase = Phase::Deciding(At::BufferedBody);
        Some(Next::Decide(Input::TooLarge))
    }

    /// The answer to a decision under `mode`, and the outcome to count. Call only after
    /// [`Next::Decide`].
    pub fn decided(
        &mut self,
        verdict: &Verdict,
        mode: FailureMode,
    ) -> Result<(Vec<ProcessingResponse>, EppOutcome), ProtocolError> {
        let Phase::Deciding(at) = self.phase else {
            return Err(ProtocolError("a decision nobody asked for"));
        };
        let (pin, outcome) = match verdict {
            Verdict::Pick(ep) => (Pin::To(ep, None), EppOutcome::Picked),
            Verdict::PickPd { decode, prefill } => {
                (Pin::To(decode, Some(prefill)), EppOutcome::Picked)
            }
            Verdict::Fail(_) if mode == FailureMode::FailOpen => {
                (Pin::Unpinned, EppOutcome::FailOpen)
            }
            Verdict::Fail(why) => {
                self.phase = Phase::Rejected;
                let status = match why {
                    EppFailure::BadBody => 400,
                    EppFailure::BodyTooLarge => 413,
                    _ => 503,
                };
                let r = reply::reject(status, why.as_str());
                return Ok((vec![r], EppOutcome::FailClose));
            }
            Verdict::SubsetUnavailable => {
                self.phase = Phase::Rejected;
                let r = reply::reject(503, "subset_unavailable");
                return Ok((vec![r], EppOutcome::SubsetUnavailable));
            }
        };
        let mut out = Vec::new();
        match at {
            At::Headers => out.push(reply::request_headers(&pin)),
            At::BufferedBody => out.push(reply::request_body(&pin)),
            At::DuplexBody => {
                out.push(reply::request_headers(&pin));
                let body = std::mem::take(&mut self.held);
                out.extend(reply::streamed_body(&body, self.body_ended, false));
                if self.trailers_pending {
                    out.push(reply::pass(Passed::RequestTrailers));
                }
            }
        }
        if let Pin::To(ep, _) = pin {
            self.picked = Some(ep.to_owned());
        }
        let open_body = at == At::DuplexBody && !self.body_ended && !self.trailers_pending;
        self.phase = match open_body {
            true => Phase::Passthrough,
            false => Phase::Answered,
        };
        Ok((out, outcome))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation, processing_response, HttpBody, HttpHeaders, HttpTrailers,
        ProtocolConfiguration,
    };
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

    fn headers(eos: bool, mode: Option<BodySendMode>, spoof: bool) -> ProcessingRequest {
        let mut hs = vec![HeaderValue {
            key: ":path".into(),
            raw_value: b"/v1/chat/completions".to_vec(),
            ..HeaderValue::default()
        }];
        if spoof {
            hs.push(HeaderValue {
                key: reply::DESTINATION.into(),
                raw_value: b"10.9.9.9:1".to_vec(),
                ..HeaderValue::default()
            });
        }
        ProcessingRequest {
            protocol_config: mode.map(|m| ProtocolConfiguration {
                request_body_mode: m as i32,
                ..ProtocolConfiguration::default()
            }),
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers: hs }),
                end_of_stream: eos,
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

    fn replies(n: Next) -> Vec<ProcessingResponse> {
        match n {
            Next::Reply(r) => r,
            Next::Decide(i) => panic!("asked to decide on {i:?}"),
        }
    }

    fn input(n: Next) -> Input {
        match n {
            Next::Decide(i) => i,
            Next::Reply(r) => panic!("replied {r:?}"),
        }
    }

    /// The bytes of every streamed request-body chunk, and whether the last one ends the body.
    fn streamed(rs: &[ProcessingResponse]) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        let mut end = false;
        for r in rs {
            if let Some(processing_response::Response::RequestBody(b)) = &r.response {
                if let Some(body_mutation::Mutation::StreamedResponse(s)) = b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
                {
                    out.extend_from_slice(&s.body);
                    end = s.end_of_stream;
                }
            }
        }
        (out, end)
    }

    fn mutation(
        r: &ProcessingResponse,
    ) -> &envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation {
        let c = match r.response.as_ref().unwrap() {
            processing_response::Response::RequestHeaders(h) => h.response.as_ref(),
            processing_response::Response::RequestBody(b) => b.response.as_ref(),
            other => panic!("not a request answer: {other:?}"),
        };
        c.unwrap().header_mutation.as_ref().unwrap()
    }

    fn pinned_to(r: &ProcessingResponse) -> Option<String> {
        let m = mutation(r);
        let set = m.set_headers.first()?;
        let h = set.header.as_ref().unwrap();
        assert_eq!(h.key, reply::DESTINATION);
        let ep = String::from_utf8(h.raw_value.clone()).unwrap();
        let md = r.dynamic_metadata.as_ref().unwrap();
        let Some(Kind::StructValue(ns)) = &md.fields[reply::DESTINATION_NAMESPACE].kind else {
            panic!("no envoy.lb namespace");
        };
        assert_eq!(
            ns.fields[reply::DESTINATION].kind,
            Some(Kind::StringValue(ep.clone())),
            "header and metadata agree"
        );
        Some(ep)
    }

    fn status(r: &ProcessingResponse) -> i32 {
        match r.response.as_ref().unwrap() {
            processing_response::Response::ImmediateResponse(i) => i.status.unwrap().code,
            other => panic!("not a rejection: {other:?}"),
        }
    }

    #[test]
    fn buffered_unpins_at_the_headers_and_pins_in_the_body_answer() {
        let mut x = Exchange::new(1024);
        let r = replies(x.on_message(headers(false, None, true)).unwrap());
        // The path names the API the body is parsed for.
        assert_eq!(
            x.endpoint,
            Some(kvroute_core::prompt::Endpoint::ChatCompletions)
        );
        assert_eq!(
            mutation(&r[0]).remove_headers,
            vec![reply::DESTINATION, reply::PREFILLER]
        );
        assert_eq!(x.mode(), Mode::Buffered);
        assert_eq!(
            input(x.on_message(body(b"{}", true)).unwrap()),
            Input::Body(Bytes::from_static(b"{}"))
        );
        let (r, o) = x
            .decided(
                &Verdict::Pick("10.0.0.2:8000".into()),
                FailureMode::FailOpen,
            )
            .unwrap();
        assert_eq!(o, EppOutcome::Picked);
        assert!(matches!(
            r[0].response,
            Some(processing_response::Response::RequestBody(_))
        ));
        assert_eq!(pinned_to(&r[0]).as_deref(), Some("10.0.0.2:8000"));
        assert!(
            mutation(&r[0]).set_headers[0].append_action == 2,
            "overwrite"
        );
        assert_eq!(mutation(&r[0]).remove_headers, vec![reply::PREFILLER]);
        assert_eq!(x.phase(), Phase::Answered);
    }

    /// Prefill/decode: the destination is the decode endpoint, and the prefill endpoint goes in
    /// `x-prefiller-host-port`, overwriting whatever the client sent.
    #[test]
    fn a_prefill_decode_pick_names_both_endpoints() {
        let mut x = Exchange::new(1024);
        x.on_message(headers(false, None, true)).unwrap();
        x.on_message(body(b"{}", true)).unwrap();
        let pd = Verdict::PickPd {
            decode: "10.0.0.9:8000".into(),
            prefill: "10.0.0.2:8000".into(),
        };
        let (r, o) = x.decided(&pd, FailureMode::FailOpen).unwrap();
        assert_eq!(o, EppOutcome::Picked);
        assert_eq!(pinned_to(&r[0]).as_deref(), Some("10.0.0.9:8000"));
        let m = mutation(&r[0]);
        let prefiller = m.set_headers[1].header.as_ref().unwrap();
        assert_eq!(
            (prefiller.key.as_str(), prefiller.raw_value.as_slice()),
            (reply::PREFILLER, &b"10.0.0.2:8000"[..])
        );
        assert_eq!(m.set_headers[1].append_action, 2, "overwrite");
        assert!(m.remove_headers.is_empty());
        assert_eq!(x.picked.as_deref(), Some("10.0.0.9:8000"));
    }

    #[test]
    fn full_duplex_holds_the_headers_then_sets_them_and_streams_the_body_back() {
        let mut x = Exchange::new(1 << 20);
        let r = replies(
            x.on_message(headers(false, Some(BodySendMode::FullDuplexStreamed), true))
                .unwrap(),
        );
        assert!(r.is_empty(), "headers are held until the decision");
        let big: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
        assert!(replies(x.on_message(body(&big[..70_000], false)).unwrap()).is_empty());
        let Input::Body(got) = input(x.on_message(body(&big[70_000..], true)).unwrap()) else {
            panic!("no body")
        };
        assert_eq!(got, big);
        let (r, o) = x
            .decided(
                &Verdict::Pick("10.0.0.3:8000".into()),
                FailureMode::FailOpen,
            )
            .unwrap();
        assert_eq!(o, EppOutcome::Picked);
        assert_eq!(pinned_to(&r[0]).as_deref(), Some("10.0.0.3:8000"));
        assert_eq!(streamed(&r[1..]), (big, true));
        assert!(r[1..].len() >= 3, "cut in chunks of at most 62000 bytes");
    }

    #[test]
    fn over_the_cap_fails_open_and_streams_the_rest_through() {
        let mut x = Exchange::new(100);
        x.on_message(headers(
            false,
            Some(BodySendMode::FullDuplexStreamed),
            false,
        ))
        .unwrap();
        assert!(replies(x.on_message(body(&[1; 60], false)).unwrap()).is_empty());
        assert_eq!(
            input(x.on_message(body(&[2; 60], false)).unwrap()),
            Input::TooLarge
        );
        let (r, o) = x
            .decided(
                &Verdict::Fail(EppFailure::BodyTooLarge),
                FailureMode::FailOpen,
            )
            .unwrap();
        assert_eq!(o, EppOutcome::FailOpen);
        assert_eq!(pinned_to(&r[0]), None);
        assert_eq!(
            mutation(&r[0]).remove_headers,
            vec![reply::DESTINATION, reply::PREFILLER]
        );
        let mut want = vec![1; 60];
        want.extend([2; 60]);
        assert_eq!(streamed(&r[1..]), (want, false));
        assert_eq!(x.phase(), Phase::Passthrough);
        let r = replies(x.on_message(body(&[3; 10], true)).unwrap());
        assert_eq!(streamed(&r), (vec![3; 10], true));
        assert_eq!(x.phase(), Phase::Answered);
    }

    #[test]
    fn fail_close_rejects_with_the_reasons_status() {
        for (why, want) in [
            (EppFailure::NoEndpoint, 503),
            (EppFailure::BadBody, 400),
            (EppFailure::BodyTooLarge, 413),
            (EppFailure::Timeout, 503),
        ] {
            let mut x = Exchange::new(100);
            x.on_message(headers(false, None, false)).unwrap();
            x.on_message(body(b"x", true)).unwrap();
            let (r, o) = x
                .decided(&Verdict::Fail(why), FailureMode::FailClose)
                .unwrap();
            assert_eq!((status(&r[0]), o), (want, EppOutcome::FailClose));
        }
    }

    #[test]
    fn an_unavailable_subset_is_503_even_failing_open() {
        let mut x = Exchange::new(100);
        x.on_message(headers(true, None, false)).unwrap();
        let (r, o) = x
            .decided(&Verdict::SubsetUnavailable, FailureMode::FailOpen)
            .unwrap();
        assert_eq!((status(&r[0]), o), (503, EppOutcome::SubsetUnavailable));
    }

    #[test]
    fn a_request_without_body_is_decided_on_its_headers() {
        for mode in [None, Some(BodySendMode::FullDuplexStreamed)] {
            let mut x = Exchange::new(100);
            assert_eq!(
                input(x.on_message(headers(true, mode, false)).unwrap()),
                Input::NoBody
            );
            let (r, _) = x
                .decided(
                    &Verdict::Pick("10.0.0.2:8000".into()),
                    FailureMode::FailOpen,
                )
                .unwrap();
            assert_eq!(r.len(), 1);
            assert!(matches!(
                r[0].response,
                Some(processing_response::Response::RequestHeaders(_))
            ));
            assert_eq!(pinned_to(&r[0]).as_deref(), Some("10.0.0.2:8000"));
        }
        // Streamed bodies are forwarded before we could read them: decided on the headers.
        let mut x = Exchange::new(100);
        assert_eq!(
            input(
                x.on_message(headers(false, Some(BodySendMode::Streamed), false))
                    .unwrap()
            ),
            Input::NoBody
        );
    }

    #[test]
    fn trailers_end_a_full_duplex_body() {
        let mut x = Exchange::new(100);
        x.on_message(headers(
            false,
            Some(BodySendMode::FullDuplexStreamed),
            false,
        ))
        .unwrap();
        x.on_message(body(b"abc", false)).unwrap();
        let trailers = ProcessingRequest {
            request: Some(processing_request::Request::RequestTrailers(
                HttpTrailers::default(),
            )),
            ..ProcessingRequest::default()
        };
        let Input::Body(b) = input(x.on_message(trailers).unwrap()) else {
            panic!()
        };
        assert_eq!(b, Bytes::from_static(b"abc"));
        let (r, _) = x
            .decided(
                &Verdict::Pick("10.0.0.2:8000".into()),
                FailureMode::FailOpen,
            )
            .unwrap();
        assert_eq!(streamed(&r[1..r.len() - 1]), (b"abc".to_vec(), false));
        assert!(matches!(
            r.last().unwrap().response,
            Some(processing_response::Response::RequestTrailers(_))
        ));
    }

    #[test]
    fn protocol_breaks_are_errors() {
        let mut x = Exchange::new(100);
        assert!(x.on_message(body(b"x", true)).is_err());
        assert!(x.on_message(ProcessingRequest::default()).is_err());
        let mut x = Exchange::new(100);
        x.on_message(headers(false, None, false)).unwrap();
        assert!(x.on_message(headers(false, None, false)).is_err());
        assert!(x
            .decided(&Verdict::Fail(EppFailure::NoRule), FailureMode::FailOpen)
            .is_err());
    }

    #[test]
    fn the_subset_is_read_from_filter_metadata() {
        let list = |v: Vec<&str>| Value {
            kind: Some(Kind::ListValue(ListValue {
                values: v
                    .into_iter()
                    .map(|s| Value {
                        kind: Some(Kind::StringValue(s.into())),
                    })
                    .collect(),
            })),
        };
        let md = |v: Value| Metadata {
            filter_metadata: [(
                reply::SUBSET_NAMESPACE.to_owned(),
                Struct {
                    fields: [(reply::SUBSET.to_owned(), v)].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        };
        let mut h = headers(true, None, false);
        h.metadata_context = Some(md(list(vec!["10.0.0.2:8000", "10.0.0.3:8000"])));
        let mut x = Exchange::new(100);
        x.on_message(h).unwrap();
        assert_eq!(
            x.subset,
            Some(vec!["10.0.0.2:8000".into(), "10.0.0.3:8000".into()])
        );
        let one = md(Value {
            kind: Some(Kind::StringValue("10.0.0.2:8000, 10.0.0.3:8000".into())),
        });
        assert_eq!(reply::subset(Some(&one)).unwrap().len(), 2);
        assert_eq!(reply::subset(None), None);
        let empty = md(list(vec![]));
        assert_eq!(reply::subset(Some(&empty)), Some(vec![]));
    }

    /// An unreadable (oversize) message is a body over the cap while a buffered body is
    /// awaited, and nothing to answer otherwise.
    #[test]
    fn an_oversize_message_is_a_body_over_the_cap_only_in_buffered_mode() {
        let mut x = Exchange::new(100);
        x.on_message(headers(false, Some(BodySendMode::Buffered), false))
            .unwrap();
        assert!(matches!(
            x.message_too_large(),
            Some(Next::Decide(Input::TooLarge))
        ));
        let (r, outcome) = x
            .decided(
                &Verdict::Fail(EppFailure::BodyTooLarge),
                FailureMode::FailOpen,
            )
            .unwrap();
        assert_eq!(outcome, EppOutcome::FailOpen);
        assert!(matches!(
            r[0].response,
            Some(processing_response::Response::RequestBody(_))
        ));
        assert!(x.message_too_large().is_none(), "answered already");
        let mut d = Exchange::new(100);
        d.on_message(headers(
            false,
            Some(BodySendMode::FullDuplexStreamed),
            false,
        ))
        .unwrap();
        assert!(
            d.message_too_large().is_none(),
            "a duplex chunk cannot be sent back"
        );
        assert!(
            Exchange::new(100).message_too_large().is_none(),
            "before the headers"
        );
    }
}
