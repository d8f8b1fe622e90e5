//! The binary form of the route question: the same [`RouteRequest`], its keys as raw 64-bit
//! words instead of decimal JSON. A 512-key question is 4.1 KB of keys instead of ~10.6 KB, and
//! the service reads them without parsing a number.
//!
//! Content type [`CONTENT_TYPE`]; layout (little-endian):
//!
//! | bytes | what |
//! |---|---|
//! | 0..4 | [`MAGIC`]: `KVR` and the format version `1` |
//! | 4..8 | `n`: length of the JSON head, u32 |
//! | 8..8+n | the JSON head: a [`RouteRequest`] whose `keys` are absent or `[]` |
//! | 8+n.. | the keys in prompt order, 8 bytes each (u64), to the end of the body |
//!
//! Everything but the keys stays JSON, so a field added to the question reaches both forms at
//! once. The service advertises the form in every rule contract
//! ([`super::RuleContract::route_content_types`]); a filter uses it only when advertised, so a
//! newer filter in front of an older service keeps asking in JSON. The JSON form stays for
//! humans and tools (`curl`, `kvroutectl`).

use super::{RouteRequest, WireKey};

/// The content type of the binary question.
pub const CONTENT_TYPE: &str = "application/vnd.kvroute.route.v1";

/// The first four bytes of every binary question: `KVR` and the format version.
pub const MAGIC: [u8; 4] = *b"KVR1";

/// Why a binary question could not be read; each message names the part and what was expected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BinaryError {
    #[error("binary route body: first 4 bytes must be \"KVR1\" ({CONTENT_TYPE})")]
    Magic,
    #[error("binary route body: the JSON head length (bytes 4..8) is {0}, past the body's end")]
    HeadLength(u64),
    #[error("binary route body: JSON head: {0}")]
    Head(String),
    #[error("binary route body: the JSON head carries keys; in this form keys follow the head as 8-byte words")]
    KeysInHead,
    #[error("binary route body: {0} bytes of keys after the head, expected a multiple of 8")]
    KeyBytes(usize),
}

/// Encodes `req` in the binary form (its keys leave the JSON head).
pub fn encode(mut req: RouteRequest) -> Vec<u8> {
    let keys = std::mem::take(&mut req.keys);
    // A RouteRequest always serializes (strings, integers, an optional JSON value).
    let json = serde_json::to_vec(&req).unwrap_or_default();
    let mut out = Vec::with_capacity(8 + json.len() + 8 * keys.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&json);
    for k in &keys {
        out.extend_from_slice(&k.key().0.to_le_bytes());
    }
    out
}

/// Decodes a binary question; keys come back unsigned (the same 64 bits).
pub fn decode(body: &[u8]) -> Result<RouteRequest, BinaryError> {
    let (magic, rest) = body.split_at_checked(4).ok_or(BinaryError::Magic)?;
    if magic != MAGIC {
        return Err(BinaryError::Magic);
    }
    let (len, rest) = rest
        .split_first_chunk::<4>()
        .ok_or(BinaryError::HeadLength(0))?;
    let n = u32::from_le_bytes(*len);
    let (head, keys) = usize::try_from(n)
        .ok()
        .and_then(|n| rest.split_at_checked(n))
        .ok_or(BinaryError::HeadLength(u64::from(n)))?;
    let mut req: RouteRequest =
        serde_json::from_slice(head).map_err(|e| BinaryError::Head(e.to_string()))?;
    if !req.keys.is_empty() {
        return Err(BinaryError::KeysInHead);
    }
    if keys.len() % 8 != 0 {
        return Err(BinaryError::KeyBytes(keys.len()));
    }
    req.keys = keys
        .chunks_exact(8)
        .map(|w| {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            WireKey::Unsigned(u64::from_le_bytes(b))
        })
        .collect();
    Ok(req)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hash::BlockKey;

    fn question() -> RouteRequest {
        RouteRequest {
            rule: "10.0.0.1:8080".into(),
            model: Some("Qwen/Qwen3-0.6B".into()),
            keys: vec![
                BlockKey(7).into(),
                WireKey::Signed(-1),
                BlockKey(u64::MAX - 3).into(),
            ],
            token_count: 48,
            affinity_key: Some("user:a|chat|completions".into()),
            ..Default::default()
        }
    }

    #[test]
    fn layout_is_magic_head_length_head_then_key_words() {
        let body = encode(question());
        assert_eq!(&body[..4], b"KVR1");
        let n = u32::from_le_bytes(body[4..8].try_into().unwrap()) as usize;
        assert_eq!(
            std::str::from_utf8(&body[8..8 + n]).unwrap(),
            r#"{"rule":"10.0.0.1:8080","model":"Qwen/Qwen3-0.6B","keys":[],"token_count":48,"affinity_key":"user:a|chat|completions"}"#
        );
        let keys = &body[8 + n..];
        assert_eq!(keys.len(), 24);
        assert_eq!(keys[..8], 7u64.to_le_bytes());
        assert_eq!(keys[8..16], u64::MAX.to_le_bytes());
    }

    #[test]
    fn decodes_to_the_same_question_with_the_same_key_bits() {
        let q = question();
        let back = decode(&encode(q.clone())).unwrap();
        let bits = |r: &RouteRequest| r.keys.iter().map(|k| k.key()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&q));
        assert_eq!(
            RouteRequest {
                keys: Vec::new(),
                ..back
            },
            RouteRequest {
                keys: Vec::new(),
                ..q
            }
        );
        // No keys at all is a valid question too.
        let empty = RouteRequest {
            rule: "1".into(),
            ..Default::default()
        };
        assert_eq!(decode(&encode(empty.clone())).unwrap(), empty);
    }

    #[test]
    fn every_malformed_body_names_its_problem() {
        let good = encode(question());
        let n = u32::from_le_bytes(good[4..8].try_into().unwrap()) as usize;
        assert_eq!(decode(b""), Err(BinaryError::Magic));
        assert_eq!(decode(b"KVR2\0\0\0\0"), Err(BinaryError::Magic));
        assert_eq!(decode(b"KVR1\x01"), Err(BinaryError::HeadLength(0)));
        let mut long = good.clone();
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode(&long),
            Err(BinaryError::HeadLength(u64::from(u32::MAX)))
        );
        let mut ragged = good.clone();
        ragged.push(0);
        assert_eq!(decode(&ragged), Err(BinaryError::KeyBytes(25)));
        let mut bad_head = good.clone();
        bad_head[8] = b'[';
        assert!(matches!(decode(&bad_head), Err(BinaryError::Head(_))));
        let head = br#"{"rule":"1","keys":[5]}"#;
        let mut keyed = b"KVR1".to_vec();
        keyed.extend_from_slice(&(head.len() as u32).to_le_bytes());
        keyed.extend_from_slice(head);
        assert_eq!(decode(&keyed), Err(BinaryError::KeysInHead));
        // An unknown head field is refused, as in the JSON form.
        let head = br#"{"rule":"1","nope":1}"#;
        let mut unknown = b"KVR1".to_vec();
        unknown.extend_from_slice(&(head.len() as u32).to_le_bytes());
        unknown.extend_from_slice(head);
        let e = decode(&unknown).unwrap_err().to_string();
        assert!(e.contains("unknown field `nope`"), "{e}");
        assert!(decode(&good[..8 + n]).unwrap().keys.is_empty());
    }
}
