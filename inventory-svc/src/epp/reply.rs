//! The ext_proc messages the endpoint picker sends, and the fields it reads from the proxy's
//! (`envoy.service.ext_proc.v3`, as the Gateway API Inference Extension's endpoint picker
//! protocol uses them).

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The request header (and dynamic metadata key) that carries the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The request header naming the prefill endpoint of a prefill/decode rule (as llm-d's
/// deployments and kvroute's filter set it).
pub const PREFILLER: &str = "x-prefiller-host-port";
/// The dynamic metadata namespace of the picked endpoint.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the candidate subset.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the candidate subset (a list of `ip:port`).
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The key (in [`DESTINATION_NAMESPACE`]) of the endpoint that served the request.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// Streamed body chunks are cut at this size: some proxies cap a streamed chunk at 64 KiB (the
/// reference endpoint picker cuts at the same 62 000 bytes).
pub const BODY_CHUNK: usize = 62_000;

/// What a request-path answer does to the request's headers.
pub enum Pin<'a> {
    /// Sets the destination to this `ip:port` (overwriting any value the client sent) and
    /// asks the proxy to route again; in prefill/decode mode (the destination is then the decode
    /// endpoint) also [`PREFILLER`] to the prefill endpoint, which a client's value never is.
    To(&'a str, Option<&'a str>),
    /// Removes any client-sent destination: the proxy load-balances as it would without us.
    Unpinned,
}

fn common(pin: &Pin<'_>) -> CommonResponse {
    let set = |key: &str, value: &str| HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    };
    let header_mutation = match pin {
        Pin::To(ep, prefill) => HeaderMutation {
            set_headers: std::iter::once(set(DESTINATION, ep))
                .chain(prefill.map(|p| set(PREFILLER, p)))
                .collect(),
            remove_headers: match prefill {
                Some(_) => Vec::new(),
                None => vec![PREFILLER.into()],
            },
        },
        Pin::Unpinned => HeaderMutation {
            set_headers: Vec::new(),
            remove_headers: vec![DESTINATION.into(), PREFILLER.into()],
        },
    };
    CommonResponse {
        header_mutation: Some(header_mutation),
        clear_route_cache: matches!(pin, Pin::To(..)),
        ..CommonResponse::default()
    }
}

/// `envoy.lb: {x-gateway-destination-endpoint: ep}`.
fn destination_metadata(ep: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION.to_owned(), string(ep))].into(),
    };
    Struct {
        fields: [(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

fn message(r: processing_response::Response, pin: &Pin<'_>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        dynamic_metadata: match pin {
            Pin::To(ep, _) => Some(destination_metadata(ep)),
            Pin::Unpinned => None,
        },
        ..ProcessingResponse::default()
    }
}

/// The answer to the request headers.
pub fn request_headers(pin: &Pin<'_>) -> ProcessingResponse {
    message(
        processing_response::Response::RequestHeaders(HeadersResponse {
            response: Some(common(pin)),
        }),
        pin,
    )
}

/// The answer to a buffered request body (headers can still be changed there).
pub fn request_body(pin: &Pin<'_>) -> ProcessingResponse {
    message(
        processing_response::Response::RequestBody(BodyResponse {
            response: Some(common(pin)),
        }),
        pin,
    )
}

/// `body` sent back unchanged as streamed chunks (full-duplex streaming: the proxy forwards
/// what the processor returns); `end` marks the last chunk as the end of the body.
pub fn streamed_body(body: &[u8], end: bool, response_path: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let b = BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: c.to_vec(),
                                end_of_stream: end && i + 1 == n,
                                ..StreamedBodyResponse::default()
                            },
                        )),
                    }),
                    ..CommonResponse::default()
                }),
            };
            ProcessingResponse {
                response: Some(match response_path {
                    false => processing_response::Response::RequestBody(b),
                    true => processing_response::Response::ResponseBody(b),
                }),
                ..ProcessingResponse::default()
            }
        })
        .collect()
}

/// An answer that changes nothing, for a message of the response path or trailers.
pub fn pass(kind: Passed) -> ProcessingResponse {
    let r = match kind {
        Passed::RequestBody => processing_response::Response::RequestBody(BodyResponse::default()),
        Passed::RequestTrailers => {
            processing_response::Response::RequestTrailers(TrailersResponse::default())
        }
        Passed::ResponseHeaders => {
            processing_response::Response::ResponseHeaders(HeadersResponse::default())
        }
        Passed::ResponseBody => {
            processing_response::Response::ResponseBody(BodyResponse::default())
        }
        Passed::ResponseTrailers => {
            processing_response::Response::ResponseTrailers(TrailersResponse::default())
        }
    };
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

/// Which message [`pass`] answers.
#[derive(Clone, Copy, Debug)]
pub enum Passed {
    RequestBody,
    RequestTrailers,
    ResponseHeaders,
    ResponseBody,
    ResponseTrailers,
}

/// Rejects the request with `status` (and a one-line plain-text body naming why).
pub fn reject(status: u16, why: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                body: format!("kvroute endpoint picker: {why}\n").into_bytes(),
                details: format!("kvroute_epp_{}", why.replace(' ', "_")),
                ..ImmediateResponse::default()
            },
        )),
        ..ProcessingResponse::default()
    }
}

/// The candidate subset in `md` (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`):
/// a list of `ip:port` strings (a single string is read as a comma-separated list). `None` when
/// the proxy set no subset.
pub fn subset(md: Option<&Metadata>) -> Option<Vec<String>> {
    let v = md?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET)?;
    Some(match &v.kind {
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => split_list(s),
        _ => Vec::new(),
    })
}

/// The API key of the request headers (`authorization: Bearer` or `x-api-key`), for the affinity
/// key ([`kvroute_core::affinity`]); Envoy sends header values as `raw_value`.
pub fn api_key(headers: Option<&HeaderMap>) -> Option<Vec<u8>> {
    let value = |name: &str| header(headers, name);
    kvroute_core::affinity::api_key(value("authorization"), value("x-api-key")).map(<[u8]>::to_vec)
}

/// A request header's bytes (its raw value when the proxy sends one).
pub fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| match h.raw_value.is_empty() {
            true => h.value.as_bytes(),
            false => h.raw_value.as_slice(),
        })
}

/// The endpoint the proxy reports as having served the request, if it does.
pub fn served(md: Option<&Metadata>) -> Option<String> {
    let v = md?
        .filter_metadata
        .get(DESTINATION_NAMESPACE)?
        .fields
        .get(SERVED)?;
    match &v.kind {
        Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
        _ => None,
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn the_api_key_comes_from_raw_or_plain_header_values() {
        let h = |k: &str, raw: &[u8], value: &str| HeaderValue {
            key: k.into(),
            raw_value: raw.to_vec(),
            value: value.into(),
        };
        let map = |hs: Vec<HeaderValue>| HeaderMap { headers: hs };
        let bearer = map(vec![
            h(":path", b"/v1/chat/completions", ""),
            h("Authorization", b"Bearer sk-1", ""),
        ]);
        assert_eq!(api_key(Some(&bearer)).as_deref(), Some(&b"sk-1"[..]));
        let plain = map(vec![h("x-api-key", b"", "sk-2")]);
        assert_eq!(api_key(Some(&plain)).as_deref(), Some(&b"sk-2"[..]));
        assert_eq!(
            api_key(Some(&map(vec![h("authorization", b"Basic x", "")]))),
            None
        );
        assert_eq!(api_key(None), None);
    }
}
