//! The affinity key: who the sticky fallback keeps together. The filter and the endpoint picker
//! form it the same way; the service hashes it onto the rule's ring (joined with the model under
//! `KVROUTE_AFFINITY_SCOPE=tenant_model`).
//!
//! The key is `<tenant>|<service type>`:
//!
//! * the tenant is the OpenAI `user` field when the body has one (`user:<value>`, or `user#<hash>`
//!   past [`MAX_USER_BYTES`]), else the API key's id (`key:<hash>`: the credential's SHA-256, so
//!   the secret never leaves the gateway) from `authorization: Bearer` or `x-api-key`, else the
//!   client's IP (`ip:<addr>`); none of the three gives no key, and the service applies its
//!   plain fallback;
//! * the service type is `chat` or `completions`.
//!
//! JAiRouter's `AffinityKeyResolver` forms `apiKeyId|serviceType|modelName`, with the client IP
//! when there is no key. kvroute puts the end user first: one tenant's key often serves many
//! users, and keeping each conversation together (not each tenant) is what saves prefill without
//! piling a large tenant onto one engine.
//!
//! The session id ([`session_id`]) is separate: a conversation id the client sends (the
//! [`SESSION_HEADER`], or the `user` field where the gateway is configured so), which the
//! service's session tier routes on ahead of prefix scoring.

use std::net::IpAddr;

use sha2::Digest;

use crate::prompt::Endpoint;

/// Longest `user` value used as it is; a longer one is replaced by its hash.
pub const MAX_USER_BYTES: usize = 128;

/// The affinity key of a request (see the module docs).
pub fn affinity_key(
    user: Option<&str>,
    api_key: Option<&[u8]>,
    client_ip: Option<IpAddr>,
    endpoint: Endpoint,
) -> Option<String> {
    let user =
        user.map(str::trim)
            .filter(|u| !u.is_empty())
            .map(|u| match u.len() <= MAX_USER_BYTES {
                true => format!("user:{u}"),
                false => format!("user#{}", short_hash(u.as_bytes())),
            });
    let tenant = user
        .or_else(|| api_key.map(|k| format!("key:{}", short_hash(k))))
        .or_else(|| client_ip.map(|ip| format!("ip:{ip}")))?;
    let service = match endpoint {
        Endpoint::ChatCompletions => "chat",
        Endpoint::Completions => "completions",
        Endpoint::Messages => "messages",
    };
    Some(format!("{tenant}|{service}"))
}

/// The tenant part of an affinity key (what precedes the service type).
pub fn tenant_of(key: &str) -> &str {
    key.rsplit_once('|').map_or(key, |(tenant, _)| tenant)
}

/// The credential of an `authorization: Bearer <key>` or an `x-api-key: <key>` header value.
pub fn api_key<'a>(
    authorization: Option<&'a [u8]>,
    x_api_key: Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    let bearer = authorization.and_then(|v| {
        let (scheme, rest) = v.split_at_checked(7)?;
        scheme
            .eq_ignore_ascii_case(b"bearer ")
            .then(|| rest.trim_ascii())
    });
    bearer
        .or_else(|| x_api_key.map(<[u8]>::trim_ascii))
        .filter(|k| !k.is_empty())
}

/// Header a conversation id is read from: the filter's default `session_header`, and the one
/// the endpoint picker reads.
pub const SESSION_HEADER: &str = "x-conversation-id";

/// Longest session id sent as it is; a longer one (or one with bytes outside printable ASCII) is
/// sent as `#<hash>`.
pub const MAX_SESSION_BYTES: usize = 128;

/// The session id of a request from a conversation-id header value or, where the gateway is
/// configured to, the OpenAI `user` field: trimmed, `None` when empty. Ids are never secrets
/// here, but they are client input: a long or binary one is replaced by the hash of its bytes,
/// so the question stays small and printable.
pub fn session_id(raw: &[u8]) -> Option<String> {
    let raw = raw.trim_ascii();
    if raw.is_empty() {
        return None;
    }
    let printable = raw.iter().all(|b| (0x20..0x7f).contains(b));
    match (printable, raw.len() <= MAX_SESSION_BYTES) {
        // Printable ASCII is UTF-8.
        (true, true) => Some(String::from_utf8_lossy(raw).into_owned()),
        _ => Some(format!("#{}", short_hash(raw))),
    }
}

/// First 8 bytes of the SHA-256 of `bytes`, in hex.
fn short_hash(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    #[test]
    fn session_ids_are_trimmed_printable_and_bounded() {
        assert_eq!(session_id(b"  conv-42 \t").as_deref(), Some("conv-42"));
        assert_eq!(session_id(b"   "), None);
        assert_eq!(session_id(b""), None);
        let long = "a".repeat(MAX_SESSION_BYTES + 1);
        let hashed = session_id(long.as_bytes()).unwrap();
        assert!(hashed.starts_with('#') && hashed.len() == 17, "{hashed}");
        assert_eq!(session_id(long.as_bytes()), Some(hashed));
        let exact = "b".repeat(MAX_SESSION_BYTES);
        assert_eq!(
            session_id(exact.as_bytes()).as_deref(),
            Some(exact.as_str())
        );
        // Control and non-ASCII bytes never reach the question as they are.
        assert!(session_id(b"a\x00b").unwrap().starts_with('#'));
        assert!(session_id("é".as_bytes()).unwrap().starts_with('#'));
    }

    #[test]
    fn the_user_then_the_key_then_the_client_and_the_service_type() {
        let ip: Option<IpAddr> = Some("10.1.2.3".parse().unwrap());
        let key = Some(&b"sk-secret-1"[..]);
        let chat = Endpoint::ChatCompletions;
        assert_eq!(
            affinity_key(Some(" u-1 "), key, ip, chat).as_deref(),
            Some("user:u-1|chat")
        );
        let by_key = affinity_key(Some(" "), key, ip, Endpoint::Completions).unwrap();
        assert_eq!(
            by_key,
            format!("key:{}|completions", short_hash(b"sk-secret-1"))
        );
        assert_eq!(short_hash(b"sk-secret-1").len(), 16);
        assert!(!by_key.contains("secret"), "{by_key}");
        assert_eq!(
            affinity_key(None, None, ip, chat).as_deref(),
            Some("ip:10.1.2.3|chat")
        );
        assert_eq!(affinity_key(None, None, None, chat), None);
        let long = "x".repeat(MAX_USER_BYTES + 1);
        let hashed = affinity_key(Some(&long), None, None, chat).unwrap();
        assert_eq!(hashed, format!("user#{}|chat", short_hash(long.as_bytes())));
        // A `user` holding the separator keeps it in the tenant.
        let piped = affinity_key(Some("a|b"), None, None, chat).unwrap();
        assert_eq!(tenant_of(&piped), "user:a|b");
        assert_eq!(tenant_of("ip:10.1.2.3"), "ip:10.1.2.3");
    }

    #[test]
    fn api_keys_come_from_bearer_or_x_api_key() {
        assert_eq!(api_key(Some(b"Bearer  k1 "), None), Some(&b"k1"[..]));
        assert_eq!(api_key(Some(b"bearer k1"), Some(b"k2")), Some(&b"k1"[..]));
        assert_eq!(
            api_key(Some(b"Basic dTpw"), Some(b" k2 ")),
            Some(&b"k2"[..])
        );
        assert_eq!(api_key(Some(b"Bearer "), None), None);
        assert_eq!(api_key(Some(b"Bear"), None), None);
        assert_eq!(api_key(None, None), None);
    }
}
