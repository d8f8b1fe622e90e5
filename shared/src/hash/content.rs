//! kvroute's own content key: an engine-independent chain over token blocks.
//!
//! `k_i = XXH3-64(tokens of block i as little-endian u32, seed = k_{i-1})`, with `k_{-1}` a fixed
//! constant (or XXH3-64 of the cache salt). The inventory's `tokens` key mode re-hashes the
//! `token_ids` carried by engine events into this key, so routing works even when the engine's own
//! hash cannot be reproduced (pickle hashes, unseeded xxhash, LoRA paths missing from events).
//! Not an engine contract: it may change only together with both the filter and the inventory.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{BlockKey, BlockSize};

/// `k_{-1}`: "kvroute1" as big-endian bytes.
const ROOT: u64 = u64::from_be_bytes(*b"kvroute1");

#[derive(Clone)]
pub(crate) struct ContentHasher {
    parent: u64,
    buf: Vec<u8>,
}

impl ContentHasher {
    pub(crate) fn new(cache_salt: Option<&str>) -> Self {
        let parent = match cache_salt {
            Some(s) => xxh3_64_with_seed(s.as_bytes(), ROOT),
            None => ROOT,
        };
        ContentHasher {
            parent,
            buf: Vec::with_capacity(4 * 64),
        }
    }

    pub(crate) fn push(&mut self, tokens: &[u32]) -> BlockKey {
        self.buf.clear();
        for &t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        self.parent = xxh3_64_with_seed(&self.buf, self.parent);
        BlockKey(self.parent)
    }

    /// The chain state after a given key, so an event's blocks can be re-hashed from the
    /// content key of their parent (the inventory keeps engine-key -> content-key maps).
    pub(crate) fn resume(parent: BlockKey) -> Self {
        ContentHasher {
            parent: parent.0,
            buf: Vec::with_capacity(4 * 64),
        }
    }
}

/// Content keys of every full block of `tokens`, continuing from `parent` (`None` = prompt start).
pub fn content_keys(
    tokens: &[u32],
    block_size: BlockSize,
    parent: Option<BlockKey>,
) -> Vec<BlockKey> {
    let mut h = match parent {
        Some(p) => ContentHasher::resume(p),
        None => ContentHasher::new(None),
    };
    tokens
        .chunks_exact(block_size.get())
        .map(|b| h.push(b))
        .collect()
}
