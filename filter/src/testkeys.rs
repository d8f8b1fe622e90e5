//! `kvroute_test_keys`: block keys computed inside the built `.wasm`, for the test host.
//!
//! The golden-vector tests run every engine's vectors both natively and through the module Envoy
//! loads, so a wasm32-only difference (usize width, float formatting, a dependency's cfg) cannot
//! hide. The wire format is JSON in, JSON out:
//!
//! ```json
//! {"algo":"sha256_cbor","block_size":16,"seed":"0","extra":{"lora":["name","path"],
//!  "lora_task_id":7,"cache_salt":"s"},"tokens":[1,2,3]}
//! ```
//! answers `{"keys":[u64,...]}` or `{"error":"..."}`. `seed` and `extra` (and each of its fields)
//! may be null or absent.
//!
//! ABI (wasm32 only): the host allocates `len` bytes with the SDK's exported allocator
//! (`proxy_on_memory_allocate`, exported as `malloc` on wasm32-unknown-unknown), writes the request
//! there and calls `kvroute_test_keys(ptr, len)`; the result is `(out_ptr << 32) | out_len`. The
//! input stays the host's; the output buffer is leaked (a test-only export, called a bounded
//! number of times per VM).

use kvroute_core::hash::{
    BlockKey, BlockSize, ExtraKeys, ExtraKeysLayout, HashAlgo, HashContract, HashError,
};
use serde::{Deserialize, Serialize};

/// A `kvroute_test_keys` request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysRequest {
    pub algo: HashAlgo,
    pub block_size: BlockSize,
    #[serde(default)]
    pub seed: Option<String>,
    #[serde(default)]
    pub extra: Option<ExtraKeys>,
    /// vLLM's extra-keys layout, `tagged` (default) or `flat`.
    #[serde(default)]
    pub extra_layout: ExtraKeysLayout,
    pub tokens: Vec<u32>,
}

/// A `kvroute_test_keys` answer.
#[derive(Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum KeysResponse {
    Keys { keys: Vec<BlockKey> },
    Error { error: String },
}

/// Why a request produced no keys.
#[derive(Debug, thiserror::Error)]
pub enum TestKeysError {
    #[error(
        "request must be JSON {{\"algo\": one of sha256_cbor|xxhash_cbor|sha256_sglang|blockhash_trtllm|tokens, \
         \"block_size\": integer >= 1, \"seed\": string|null, \"extra\": {{\"lora\": [name, path]|null, \
         \"lora_task_id\": integer|null, \"cache_salt\": string|null}}|null, \"extra_layout\": tagged|flat|null, \"tokens\": [u32...]}}: {0}"
    )]
    BadRequest(#[from] serde_json::Error),
    #[error(transparent)]
    Hash(#[from] HashError),
}

/// Parses a request and computes its keys.
pub fn compute(input: &[u8]) -> Result<Vec<BlockKey>, TestKeysError> {
    let req: KeysRequest = serde_json::from_slice(input)?;
    let contract = HashContract {
        algo: req.algo,
        block_size: req.block_size,
        seed: req.seed,
        extra_layout: req.extra_layout,
    };
    Ok(contract.keys(&req.tokens, &req.extra.unwrap_or_default())?)
}

/// The JSON answer for a request; never fails (errors become `{"error": ...}`).
pub fn answer(input: &[u8]) -> Vec<u8> {
    let response = match compute(input) {
        Ok(keys) => KeysResponse::Keys { keys },
        Err(e) => KeysResponse::Error {
            error: e.to_string(),
        },
    };
    serde_json::to_vec(&response)
        .unwrap_or_else(|_| br#"{"error":"cannot serialise the answer"}"#.to_vec())
}

/// The wasm export; see the module docs for the ABI.
///
/// # Safety
/// `ptr` must point to `len` readable bytes (or `len` must be 0).
#[cfg(target_arch = "wasm32")]
#[no_mangle]
pub unsafe extern "C" fn kvroute_test_keys(ptr: *const u8, len: usize) -> u64 {
    let input: &[u8] = if ptr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller guarantees ptr..ptr+len is readable.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    };
    let out = answer(input).into_boxed_slice();
    let out_len = out.len() as u64;
    let out_ptr = Box::into_raw(out) as *mut u8 as usize as u64;
    (out_ptr << 32) | out_len
}

/// Hashes a synthetic `n_tokens`-token prompt `reps` times with algorithm number `algo`
/// (the index in [`HashAlgo::ALL`]), block size 16, seed "0"; returns the xor of every last key
/// (0 on a bad argument). Used by `scripts/bench-hash.sh` to time hashing inside V8 without
/// JSON in the loop.
pub fn bench(algo: u32, n_tokens: u32, reps: u32) -> u64 {
    let (Some(&algo), Some(bs)) = (HashAlgo::ALL.get(algo as usize), BlockSize::new(16)) else {
        return 0;
    };
    let contract = HashContract {
        algo,
        block_size: bs,
        seed: Some("0".into()),
        extra_layout: ExtraKeysLayout::Tagged,
    };
    let tokens: Vec<u32> = (0..n_tokens)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_643)
        .collect();
    let mut acc = 0u64;
    for _ in 0..reps {
        if let Ok(keys) = contract.keys(&tokens, &ExtraKeys::default()) {
            acc ^= keys.last().map_or(0, |k| k.0);
        }
    }
    acc
}

/// The wasm export of [`bench`].
#[cfg(target_arch = "wasm32")]
#[no_mangle]
pub extern "C" fn kvroute_bench_keys(algo: u32, n_tokens: u32, reps: u32) -> u64 {
    bench(algo, n_tokens, reps)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn ask(v: Value) -> Value {
        serde_json::from_slice(&answer(v.to_string().as_bytes())).unwrap()
    }

    #[test]
    fn bench_export_hashes_and_rejects_unknown_algos() {
        assert_ne!(bench(0, 64, 1), 0);
        assert_eq!(bench(0, 64, 2), 0, "xor of the same key twice");
        assert_eq!(bench(99, 64, 1), 0);
    }

    #[test]
    fn full_blocks_only() {
        let tokens: Vec<u32> = (0..70).collect();
        let out = ask(json!({"algo": "tokens", "block_size": 16, "seed": null, "tokens": tokens}));
        assert_eq!(out["keys"].as_array().map(Vec::len), Some(4), "{out}");
    }

    #[test]
    fn accepts_every_extra_field() {
        let out = ask(json!({
            "algo": "sha256_cbor", "block_size": 16, "seed": "0",
            "extra": {"lora": ["a", "/p"], "lora_task_id": null, "cache_salt": "s"},
            "tokens": (0..32).collect::<Vec<u32>>()
        }));
        assert_eq!(out["keys"].as_array().map(Vec::len), Some(2), "{out}");
    }

    #[test]
    fn bad_requests_answer_an_error() {
        for bad in [
            json!({"algo": "md5", "block_size": 16, "tokens": []}),
            json!({"algo": "tokens", "block_size": 0, "tokens": []}),
            json!({"algo": "tokens", "block_size": 16}),
            json!({"algo": "tokens", "block_size": 16, "tokens": [], "extra": {"lora": ["a", "p"]}}),
        ] {
            let out = ask(bad.clone());
            assert!(out["error"].is_string(), "{bad} -> {out}");
        }
        let out: Value = serde_json::from_slice(&answer(b"not json")).unwrap();
        assert!(out["error"].as_str().unwrap().contains("block_size"));
    }
}
