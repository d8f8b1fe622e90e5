//! TensorRT-LLM's `BlockKeyHasher` (v1 block key, `cpp/tensorrt_llm/batch_manager/blockKey.cpp`).
//!
//! All arithmetic is mod 2^64 except the per-token mix, which wraps at 32 bits. The parent is the
//! previous block's 64-bit key (0 for the first block); the cache salt mixes in only there.

use super::{BlockKey, ExtraKeys};

const MIX_PARENT: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX_TOKEN: u32 = 0x045d_9f3b;
const GOLDEN: u64 = 0x9e37_79b9;

fn hash64_mix(b: u64, seed: u64) -> u64 {
    let mut b = (b ^ (b >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    b = (b ^ (b >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    b ^= b >> 31;
    seed ^ b
        .wrapping_add(GOLDEN)
        .wrapping_add(seed << 6)
        .wrapping_add(seed >> 2)
}

/// The key of one block given its parent key (0 for the first block) and its tokens.
///
/// Exposed because TensorRT-LLM events carry each block's tokens and parent, so the inventory
/// re-hashes them one by one; partial blocks hash too (the engine publishes them), callers skip them.
pub fn block_key(
    parent: u64,
    tokens: &[u32],
    cache_salt_id: Option<u64>,
    lora_task_id: Option<u64>,
) -> u64 {
    let mut seed = (tokens.len() as u64) ^ parent.wrapping_mul(MIX_PARENT);
    if parent == 0 {
        if let Some(salt) = cache_salt_id {
            seed = hash64_mix(salt, seed);
        }
    }
    for &t in tokens {
        let mut a = t;
        a = ((a >> 16) ^ a).wrapping_mul(MIX_TOKEN);
        a = ((a >> 16) ^ a).wrapping_mul(MIX_TOKEN);
        a ^= a >> 16;
        let mixed = u64::from(a.wrapping_add(GOLDEN as u32));
        seed ^= mixed.wrapping_add(seed << 6).wrapping_add(seed >> 2);
    }
    if let Some(lora) = lora_task_id {
        seed = hash64_mix(lora, seed);
    }
    seed
}

/// TensorRT-LLM's cache-salt id: the first 8 bytes of BLAKE3(salt), little-endian.
pub fn cache_salt_id(salt: &str) -> u64 {
    let h = blake3::hash(salt.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

#[derive(Clone)]
pub(crate) struct TrtllmHasher {
    parent: u64,
    salt: Option<u64>,
    lora: Option<u64>,
}

impl TrtllmHasher {
    pub(crate) fn new(extra: &ExtraKeys) -> Self {
        TrtllmHasher {
            parent: 0,
            salt: extra.cache_salt.as_deref().map(cache_salt_id),
            lora: extra.lora_task_id,
        }
    }

    pub(crate) fn push(&mut self, tokens: &[u32]) -> BlockKey {
        self.parent = block_key(self.parent, tokens, self.salt, self.lora);
        BlockKey(self.parent)
    }
}
