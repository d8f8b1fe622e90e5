//! The route question for one complete request body: body → prompt → token ids → block keys →
//! [`RouteRequest`]. No callout and no request state: [`crate::request`] sends the question and
//! applies the answer. The only effects are the VM's caches and the timing and cache stats.
//!
//! Which way the prompt travels depends on the rule and the configuration:
//!
//! | rule | `tokenize` | prompt | question carries |
//! |---|---|---|---|
//! | KV off (no hash contract) | any | any | no keys (the service applies its fallback) |
//! | KV on | any | token ids | their keys |
//! | KV on | `service` | text or chat | the text or the client's `messages` |
//! | KV on | `filter` | text or chat | the keys of its tokens (none without a tokenizer) |

use kvroute_core::bpe::Truncation;
use kvroute_core::chat::Renderer;
use kvroute_core::hash::{BlockKey, ExtraKeys, HashContract};
use kvroute_core::prompt::{Endpoint, Prompt, Request, RequestBody};
use kvroute_core::wire::WireKey;

use crate::config::TokenizeMode;
use crate::host::{Headers, Host};
use crate::plugin::VmState;
use crate::request::Unpinned;
use crate::stats::{FailReason, Stat};
use crate::tokens::Located;
use crate::wire::RouteRequest;

/// Builds the question for `body`, a complete request to `endpoint`.
pub fn build(
    vm: &VmState,
    host: &dyn Host,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<RouteRequest, Unpinned> {
    Ok(build_located(vm, host, endpoint, body)?.0)
}

/// [`build`], and the prompt's token count through each `cache_control` breakpoint of an
/// Anthropic request the filter tokenized and placed (counted in the breakpoint stats).
pub fn build_located(
    vm: &VmState,
    host: &dyn Host,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(RouteRequest, Vec<u32>), Unpinned> {
    let mut request = Request::from_json_for(body, endpoint)
        .map_err(|e| Unpinned::new(FailReason::BadRequest, e.to_string()))?;
    let hash = vm
        .contract
        .borrow()
        .as_ref()
        .map(|c| c.hash.clone())
        .ok_or_else(|| Unpinned::new(FailReason::NoContract, "rule contract not loaded"))?;
    let rule = vm
        .config
        .rule
        .clone()
        .ok_or_else(|| Unpinned::new(FailReason::NoContract, "no rule"))?;
    let mut route = RouteRequest {
        rule,
        model: request.model.clone(),
        affinity_key: affinity_key(host, endpoint, request.user.as_deref()),
        session: session(vm, host, request.user.as_deref()),
        ..Default::default()
    };
    // KV off for the rule: the service applies its fallback.
    let Some(hash) = hash else {
        return Ok((route, Vec::new()));
    };
    let mut located = Located::default();
    let offload = vm.config.tokenize == TokenizeMode::Service;
    let tokens = match &mut request.body {
        RequestBody::Completion(Prompt::TokenIds(ids)) => Some((std::mem::take(ids), None)),
        RequestBody::Completion(Prompt::Text(t)) if offload => {
            route.prompt = Some(std::mem::take(t));
            None
        }
        // Offloaded chat: the messages travel as the client sent them (re-read from the body);
        // an Anthropic conversation as the chat messages vLLM converts it to.
        RequestBody::Chat(chat) if offload && endpoint == Endpoint::Messages => {
            route.messages = Some(serde_json::Value::Array(std::mem::take(&mut chat.messages)));
            None
        }
        RequestBody::Chat(_) if offload => {
            route.messages = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|mut v| v.get_mut("messages").map(serde_json::Value::take));
            None
        }
        _ => tokenize(vm, host, &request, &mut located)?,
    };
    if let Some((ids, truncated)) = tokens {
        route.truncated = truncated;
        route.keys = keys(vm, host, &hash, &request, &ids)?
            .into_iter()
            .map(WireKey::from)
            .collect();
        route.token_count = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    }
    Ok((route, located.tokens))
}

/// A prompt's token ids, and why they stop before its end when they do.
type Ids = (Vec<u32>, Option<Truncation>);

/// The prompt's token ids with the VM's encoder, and why they stop before its end when they do;
/// `None` (counted) while no tokenizer is loaded. An Anthropic request's breakpoints are placed
/// in `located` and counted.
fn tokenize(
    vm: &VmState,
    host: &dyn Host,
    request: &Request,
    located: &mut Located,
) -> Result<Option<Ids>, Unpinned> {
    let encoder = vm.encoder.borrow().clone();
    let Some(enc) = encoder else {
        vm.stats.inc(host, Stat::NoTokenizer);
        return Ok(None);
    };
    let res = timed(vm, host, Stat::TokenizeUs, |t0| {
        crate::tokens::set_clock(i64::try_from(t0 / 1_000_000_000).unwrap_or(0));
        enc.tokens_located(request, Some(located))
    });
    let (ids, seg, render) = res.map_err(|e| Unpinned::new(FailReason::Tokenize, e.to_string()))?;
    match render {
        Some(Renderer::Native) => vm.stats.inc(host, Stat::RenderNative),
        Some(Renderer::Jinja) => vm.stats.inc(host, Stat::RenderJinja),
        None => {}
    }
    vm.stats.add(host, Stat::SegmentHits, seg.hits);
    vm.stats.add(host, Stat::SegmentMisses, seg.misses);
    vm.stats.add(host, Stat::PieceHits, seg.piece_hits);
    vm.stats.add(host, Stat::PieceMisses, seg.piece_misses);
    if let Some(t) = seg.truncated {
        vm.stats.inc(host, Stat::truncated(t));
    }
    vm.stats
        .add(host, Stat::Breakpoints, located.tokens.len() as u64);
    vm.stats.add(
        host,
        Stat::BreakpointsUnlocated,
        u64::from(located.unlocated),
    );
    Ok(Some((ids, seg.truncated)))
}

/// The block keys of `ids`; a prefix seen before comes from the key cache (exactly the hasher's
/// keys).
fn keys(
    vm: &VmState,
    host: &dyn Host,
    hash: &HashContract,
    request: &Request,
    ids: &[u32],
) -> Result<Vec<BlockKey>, Unpinned> {
    let extra = ExtraKeys {
        cache_salt: request.cache_salt.clone(),
        ..ExtraKeys::default()
    };
    let keys = timed(vm, host, Stat::KeysUs, |_| {
        vm.keys.borrow_mut().keys(hash, &extra, ids)
    });
    let (keys, stats) = keys.map_err(|e| Unpinned::new(FailReason::Hash, e.to_string()))?;
    vm.stats.add(host, Stat::KeyCacheHits, stats.hits);
    vm.stats.add(host, Stat::KeyCacheMisses, stats.misses);
    Ok(keys)
}

/// Runs `f` (given the start time), recording how long it took in microseconds as `stat`.
/// The request's affinity key ([`kvroute_core::affinity`]): the `user` field, else the API
/// key's hash, else the client IP (Envoy's `source.address`).
fn affinity_key(host: &dyn Host, endpoint: Endpoint, user: Option<&str>) -> Option<String> {
    let authorization = host.header_bytes(Headers::Request, "authorization");
    let x_api_key = host.header_bytes(Headers::Request, "x-api-key");
    let key = kvroute_core::affinity::api_key(authorization.as_deref(), x_api_key.as_deref());
    kvroute_core::affinity::affinity_key(user, key, client_ip(host), endpoint)
}

/// The request's conversation id: the configured header's value, else (with
/// `session_from_user`) the `user` field.
fn session(vm: &VmState, host: &dyn Host, user: Option<&str>) -> Option<String> {
    let header = vm.config.session_header.as_deref();
    header
        .and_then(|h| host.header_bytes(Headers::Request, h))
        .and_then(|v| kvroute_core::affinity::session_id(&v))
        .or_else(|| {
            user.filter(|_| vm.config.session_from_user)
                .and_then(|u| kvroute_core::affinity::session_id(u.as_bytes()))
        })
}

/// The downstream peer's IP (`source.address` is `ip:port`).
fn client_ip(host: &dyn Host) -> Option<std::net::IpAddr> {
    let raw = host.property(&["source", "address"])?;
    let text = std::str::from_utf8(&raw).ok()?;
    text.parse::<std::net::SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| text.parse())
        .ok()
}

fn timed<T>(vm: &VmState, host: &dyn Host, stat: Stat, f: impl FnOnce(u64) -> T) -> T {
    let t0 = host.now_nanos();
    let out = f(t0);
    vm.stats
        .record(host, stat, host.now_nanos().saturating_sub(t0) / 1000);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::host::testing::FakeHost;
    use crate::plugin::Plugin;

    const KV_ON: &[u8] = br#"{"rule_id":1,"engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":2,"key_mode":"engine","kv_enabled":true}"#;

    /// A plugin with `contract` loaded and no tokenizer.
    fn loaded(host: &FakeHost, config: &str, contract: &[u8]) -> Plugin {
        let mut p = Plugin::new();
        p.configure(host, config.as_bytes());
        p.on_tick(host);
        p.on_call_response(host, 1, Some("200"), contract);
        host.calls.borrow_mut().clear();
        p
    }

    /// Building a question sends nothing: it only reads the body and the VM's contract.
    #[test]
    fn questions_carry_keys_text_or_nothing_and_send_nothing() {
        let host = FakeHost::default();
        let p = loaded(&host, r#"{"rule":"1"}"#, KV_ON);
        let body = br#"{"model":"m","prompt":[1,2,3,4,5],"user":"t"}"#;
        let q = build(p.vm(), &host, Endpoint::Completions, body).unwrap();
        assert_eq!(
            (
                q.rule.as_str(),
                q.model.as_deref(),
                q.affinity_key.as_deref()
            ),
            ("1", Some("m"), Some("user:t|completions"))
        );
        assert_eq!((q.keys.len(), q.token_count), (2, 5));
        assert!(host.calls.borrow().is_empty());

        let off = loaded(
            &host,
            r#"{"rule":"1"}"#,
            br#"{"rule_id":1,"engine":"llamacpp","block_size":2,"kv_enabled":false}"#,
        );
        let q = build(off.vm(), &host, Endpoint::Completions, body).unwrap();
        assert_eq!((q.keys.len(), q.token_count), (0, 0));

        let offload = loaded(&host, r#"{"rule":"1","tokenize":"service"}"#, KV_ON);
        let q = build(
            offload.vm(),
            &host,
            Endpoint::Completions,
            br#"{"prompt":"hi"}"#,
        )
        .unwrap();
        assert_eq!((q.prompt.as_deref(), q.keys.len()), (Some("hi"), 0));
        assert!(host.calls.borrow().is_empty());
    }

    /// The session is the configured header's value, else (only when configured) the `user`
    /// field; an empty `session_header` reads no header.
    #[test]
    fn sessions_come_from_the_header_then_optionally_the_user() {
        let host = FakeHost::default();
        let body = br#"{"model":"m","prompt":[1,2,3],"user":"u-1"}"#;
        let ask = |config: &str| {
            let p = loaded(&host, config, KV_ON);
            build(p.vm(), &host, Endpoint::Completions, body)
                .unwrap()
                .session
        };
        assert_eq!(ask(r#"{"rule":"1"}"#), None);
        assert_eq!(
            ask(r#"{"rule":"1","session_from_user":true}"#).as_deref(),
            Some("u-1")
        );
        host.request_headers
            .borrow_mut()
            .insert("x-conversation-id".into(), " conv-7 ".into());
        assert_eq!(ask(r#"{"rule":"1"}"#).as_deref(), Some("conv-7"));
        assert_eq!(
            ask(r#"{"rule":"1","session_from_user":true}"#).as_deref(),
            Some("conv-7")
        );
        assert_eq!(ask(r#"{"rule":"1","session_header":""}"#), None);
        host.request_headers
            .borrow_mut()
            .insert("x-chat".into(), "c".repeat(500));
        let long = ask(r#"{"rule":"1","session_header":"x-chat"}"#).unwrap();
        assert!(long.starts_with('#') && long.len() == 17, "{long}");
    }

    /// The tenant is the `user` field, else the API key's hash (never the key), else the client
    /// IP; the service type follows.
    #[test]
    fn affinity_keys_name_the_user_the_key_or_the_client() {
        let host = FakeHost::default();
        let p = loaded(&host, r#"{"rule":"1"}"#, KV_ON);
        let ask =
            |body: &[u8], endpoint| build(p.vm(), &host, endpoint, body).unwrap().affinity_key;
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"user":" u-1 "}"#;
        let anon = br#"{"model":"m","prompt":[1,2,3]}"#;
        host.properties
            .borrow_mut()
            .insert("source.address".into(), "10.1.2.3:40000".into());
        host.request_headers
            .borrow_mut()
            .insert("authorization".into(), "Bearer sk-secret-1".into());
        assert_eq!(
            ask(chat, Endpoint::ChatCompletions).as_deref(),
            Some("user:u-1|chat")
        );
        let by_key = ask(anon, Endpoint::Completions).unwrap();
        assert!(
            by_key.starts_with("key:") && by_key.ends_with("|completions"),
            "{by_key}"
        );
        assert!(!by_key.contains("secret"), "{by_key}");
        host.request_headers.borrow_mut().remove("authorization");
        host.request_headers
            .borrow_mut()
            .insert("x-api-key".into(), "sk-secret-1".into());
        assert_eq!(ask(anon, Endpoint::Completions), Some(by_key));
        host.request_headers.borrow_mut().remove("x-api-key");
        host.request_headers
            .borrow_mut()
            .insert("authorization".into(), "Basic dTpw".into());
        assert_eq!(
            ask(anon, Endpoint::Completions).as_deref(),
            Some("ip:10.1.2.3|completions")
        );
        host.properties.borrow_mut().clear();
        assert_eq!(ask(anon, Endpoint::Completions), None);
    }

    #[test]
    fn failures_name_their_reason() {
        let host = FakeHost::default();
        let p = loaded(&host, r#"{"rule":"1"}"#, KV_ON);
        let bad = build(p.vm(), &host, Endpoint::Completions, b"{not json").unwrap_err();
        assert_eq!(bad.reason, FailReason::BadRequest);
        let mut cold = Plugin::new();
        cold.configure(&host, br#"{"rule":"1"}"#);
        let none = build(
            cold.vm(),
            &host,
            Endpoint::Completions,
            br#"{"prompt":[1]}"#,
        );
        assert_eq!(none.unwrap_err().reason, FailReason::NoContract);
    }
}
