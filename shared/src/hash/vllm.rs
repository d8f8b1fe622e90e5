//! vLLM's `sha256_cbor` and `xxhash_cbor` block hashes (V1 engine, `vllm/v1/core/kv_cache_utils.py`).
//!
//! `h_i = H(cbor([h_{i-1}, [tokens of block i], extra_keys_or_null]))` with `h_{-1} = NONE_HASH =
//! H(cbor(seed_string))`. The parent enters as its full digest, so the chain state is the digest,
//! not the 8-byte key. The event key is the digest's last 8 bytes, big-endian.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use super::{cbor, BlockKey, ExtraKeys, ExtraKeysLayout, HashAlgo, HashError};

/// NONE_HASH seed vLLM 0.29+ uses for the sha256 family when PYTHONHASHSEED is unset.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// A digest of either family: 32 bytes for SHA-256, 16 for XXH3-128 (big-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NoneHash {
    bytes: [u8; 32],
    len: usize,
}

impl NoneHash {
    /// NONE_HASH for `algo` from the engine's PYTHONHASHSEED (`None` = unset).
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Result<NoneHash, HashError> {
        let seed = match (algo, seed) {
            (_, Some(s)) => s,
            (HashAlgo::Sha256Cbor, None) => DEFAULT_NONE_HASH_SEED,
            (HashAlgo::XxhashCbor, None) => return Err(HashError::XxhashNeedsSeed),
            (other, None) => {
                return Err(HashError::Unsupported {
                    algo: other,
                    what: "a vLLM NONE_HASH",
                })
            }
        };
        let mut buf = Vec::with_capacity(seed.len() + 9);
        cbor::text(&mut buf, seed);
        digest(algo, &buf)
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

fn digest(algo: HashAlgo, input: &[u8]) -> Result<NoneHash, HashError> {
    let mut bytes = [0u8; 32];
    let len = match algo {
        HashAlgo::Sha256Cbor => {
            bytes.copy_from_slice(&Sha256::digest(input));
            32
        }
        HashAlgo::XxhashCbor => {
            bytes[..16].copy_from_slice(&xxh3_128(input).to_be_bytes());
            16
        }
        other => {
            return Err(HashError::Unsupported {
                algo: other,
                what: "CBOR block hashing",
            })
        }
    };
    Ok(NoneHash { bytes, len })
}

/// Streaming vLLM hasher: holds the parent digest and a reusable CBOR buffer.
#[derive(Clone)]
pub(crate) struct VllmHasher {
    algo: HashAlgo,
    parent: NoneHash,
    /// Pre-encoded extra keys for block 0 and for later blocks (`None` = CBOR null).
    extra_first: Option<Vec<u8>>,
    extra_rest: Option<Vec<u8>>,
    first_done: bool,
    buf: Vec<u8>,
}

impl VllmHasher {
    pub(crate) fn new(
        algo: HashAlgo,
        seed: Option<&str>,
        extra: &ExtraKeys,
        layout: ExtraKeysLayout,
    ) -> Result<Self, HashError> {
        if extra.lora_task_id.is_some() {
            return Err(HashError::Unsupported {
                algo,
                what: "lora_task_id (a TensorRT-LLM key): give the LoRA (name, path)",
            });
        }
        let parent = NoneHash::new(algo, seed)?;
        Ok(VllmHasher {
            algo,
            parent,
            extra_first: encode_extra(extra, true, layout),
            extra_rest: encode_extra(extra, false, layout),
            first_done: false,
            buf: Vec::with_capacity(256),
        })
    }

    pub(crate) fn push(&mut self, tokens: &[u32]) -> BlockKey {
        let extra = if self.is_first() {
            &self.extra_first
        } else {
            &self.extra_rest
        };
        self.buf.clear();
        cbor::array(&mut self.buf, 3);
        cbor::bytes(&mut self.buf, self.parent.as_bytes());
        cbor::array(&mut self.buf, tokens.len());
        for &t in tokens {
            cbor::uint(&mut self.buf, u64::from(t));
        }
        match extra {
            Some(e) => self.buf.extend_from_slice(e),
            None => cbor::null(&mut self.buf),
        }
        // Only the CBOR algorithms reach here (checked in `new`), so `digest` cannot fail;
        // keep the previous parent rather than panic if that ever changes.
        if let Ok(d) = digest(self.algo, &self.buf) {
            self.parent = d;
        }
        let b = self.parent.as_bytes();
        let mut last = [0u8; 8];
        last.copy_from_slice(&b[b.len() - 8..]);
        self.first_done = true;
        BlockKey(u64::from_be_bytes(last))
    }

    fn is_first(&self) -> bool {
        !self.first_done
    }
}

/// vLLM's extra keys for one block, in its order: the LoRA on every block, then the cache salt
/// on block 0 only; tagged (`("lora", name, path)`, `("cache_salt", salt)`) or flat (the
/// adapter's name, the salt) as `layout` says. `None` when the block has none (CBOR null).
fn encode_extra(extra: &ExtraKeys, first_block: bool, layout: ExtraKeysLayout) -> Option<Vec<u8>> {
    let salt = extra.cache_salt.as_deref().filter(|_| first_block);
    let n = usize::from(extra.lora.is_some()) + usize::from(salt.is_some());
    if n == 0 {
        return None;
    }
    let mut out = Vec::new();
    cbor::array(&mut out, n);
    if layout == ExtraKeysLayout::Flat {
        if let Some((name, _)) = &extra.lora {
            cbor::text(&mut out, name);
        }
        if let Some(salt) = salt {
            cbor::text(&mut out, salt);
        }
        return Some(out);
    }
    if let Some((name, path)) = &extra.lora {
        cbor::array(&mut out, 3);
        cbor::text(&mut out, "lora");
        cbor::text(&mut out, name);
        cbor::text(&mut out, path);
    }
    if let Some(salt) = salt {
        cbor::array(&mut out, 2);
        cbor::text(&mut out, "cache_salt");
        cbor::text(&mut out, salt);
    }
    Some(out)
}
