//! The route question the service reads: `POST /v1/route` as JSON and in the binary form
//! (`kvroute_core::wire::binary`).
//!
//! Besides "no panic": a binary question that decodes re-encodes to a body that decodes to the
//! same question (the filter's encoder and the service's decoder agree), and a JSON question
//! that parses reads the same in the binary form.
#![no_main]

use kvroute_core::wire::{binary, RouteRequest};
use libfuzzer_sys::fuzz_target;

/// The question with its keys as their 64 bits (the binary form carries keys unsigned).
fn bits(mut q: RouteRequest) -> (RouteRequest, Vec<u64>) {
    let keys = std::mem::take(&mut q.keys);
    (q, keys.into_iter().map(|k| k.key().0).collect())
}

fuzz_target!(|data: &[u8]| {
    if let Ok(q) = binary::decode(data) {
        let again = binary::decode(&binary::encode(q.clone()));
        assert_eq!(again.as_ref(), Ok(&q), "binary round trip");
    }
    if let Ok(q) = serde_json::from_slice::<RouteRequest>(data) {
        let back = binary::decode(&binary::encode(q.clone())).map(bits);
        assert_eq!(back, Ok(bits(q)), "JSON question in the binary form");
    }
});
