//! SGLang's radix-cache page hash (`sglang/srt/mem_cache`, 0.5.x).
//!
//! `d_i = SHA-256(d_{i-1} || tokens of page i as little-endian u32)`; page 0 has no parent bytes
//! unless a cache salt seeds the chain with `SHA-256("sglang-cache-salt-v1\0" || salt)`.
//! The wire key is the digest's first 8 bytes, big-endian, as a signed i64.

use sha2::{Digest, Sha256};

use super::BlockKey;

const SALT_PREFIX: &[u8] = b"sglang-cache-salt-v1\0";

#[derive(Clone)]
pub(crate) struct SglangHasher {
    parent: Option<[u8; 32]>,
    buf: Vec<u8>,
}

impl SglangHasher {
    pub(crate) fn new(cache_salt: Option<&str>) -> Self {
        let parent = cache_salt.map(|salt| {
            let mut h = Sha256::new();
            h.update(SALT_PREFIX);
            h.update(salt.as_bytes());
            h.finalize().into()
        });
        SglangHasher {
            parent,
            buf: Vec::with_capacity(32 + 4 * 64),
        }
    }

    pub(crate) fn push(&mut self, tokens: &[u32]) -> BlockKey {
        self.buf.clear();
        if let Some(p) = &self.parent {
            self.buf.extend_from_slice(p);
        }
        for &t in tokens {
            self.buf.extend_from_slice(&t.to_le_bytes());
        }
        let d: [u8; 32] = Sha256::digest(&self.buf).into();
        self.parent = Some(d);
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        BlockKey(u64::from_be_bytes(first))
    }
}
