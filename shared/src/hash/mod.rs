//! Block keys, bit-for-bit as each engine computes them.
//!
//! A prompt's token ids are cut into fixed-size blocks; block `i`'s key depends only on block `i`'s
//! tokens and the state left by block `i-1` ([`BlockHasher::push_block`]), so callers hash as they
//! go and may stop early. A partial trailing block never has a key (engines only publish full blocks).
//!
//! Contracts ([`HashAlgo`]):
//! * `sha256_cbor` / `xxhash_cbor` (vLLM): `H(cbor([parent digest, [tokens], extra_keys|null]))`,
//!   chain seeded by `NONE_HASH = H(cbor(seed string))`; wire key = last 8 digest bytes, big-endian.
//! * `sha256_sglang` (SGLang): `SHA-256(parent digest || tokens as LE u32)`; wire key = first 8
//!   digest bytes big-endian, read as i64.
//! * `blockhash_trtllm` (TensorRT-LLM): `BlockKeyHasher` v1 over each block's tokens and parent key.
//! * `tokens` (kvroute's content key): engine-independent XXH3-64 chain, for the re-hash key mode.

mod cbor;
mod content;
mod sglang;
pub mod trtllm;
mod vllm;

use std::fmt;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

pub use content::content_keys;
pub use vllm::{NoneHash, DEFAULT_NONE_HASH_SEED};

/// One block's key in the canonical u64 form kvroute stores and compares.
///
/// SGLang publishes signed i64 keys; they are stored here as the same 64 bits ([`BlockKey::from_i64`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// Reinterprets a signed wire key (SGLang, negative msgpack ints) as its 64 bits.
    pub fn from_i64(v: i64) -> Self {
        BlockKey(v as u64)
    }

    /// The same 64 bits read as signed, as SGLang puts them on the wire.
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Tokens per block (vLLM `--block-size`, SGLang page size, TensorRT-LLM `tokens_per_block`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockSize(NonZeroU32);

impl BlockSize {
    /// `None` for 0.
    pub fn new(n: u32) -> Option<Self> {
        NonZeroU32::new(n).map(BlockSize)
    }

    /// The size as `usize`, for slicing token arrays.
    pub fn get(self) -> usize {
        self.0.get() as usize
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = HashError;
    fn try_from(n: u32) -> Result<Self, HashError> {
        BlockSize::new(n).ok_or(HashError::ZeroBlockSize)
    }
}

impl From<BlockSize> for u32 {
    fn from(b: BlockSize) -> u32 {
        b.0.get()
    }
}

/// Inference engines kvroute knows the event and hash contracts of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Vllm,
    Sglang,
    Trtllm,
    /// No KV events: plain load balancing only.
    Llamacpp,
}

impl Engine {
    /// Every engine, in the order error messages list them.
    pub const ALL: [Engine; 4] = [
        Engine::Vllm,
        Engine::Sglang,
        Engine::Trtllm,
        Engine::Llamacpp,
    ];

    /// The name used in configuration and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
            Engine::Llamacpp => "llamacpp",
        }
    }

    /// Parses a configuration name (`vllm`, `sglang`, `trtllm`, `llamacpp`).
    pub fn parse(s: &str) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.as_str() == s)
    }

    /// The algorithm used when a rule names the engine but no `kvHashAlgo`.
    /// `None` for llama.cpp, which publishes no events.
    pub fn default_algo(self) -> Option<HashAlgo> {
        match self {
            Engine::Vllm => Some(HashAlgo::Sha256Cbor),
            Engine::Sglang => Some(HashAlgo::Sha256Sglang),
            Engine::Trtllm => Some(HashAlgo::BlockhashTrtllm),
            Engine::Llamacpp => None,
        }
    }

    /// Engine-contract algorithms this engine can publish keys with.
    pub fn algos(self) -> &'static [HashAlgo] {
        match self {
            Engine::Vllm => &[HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor],
            Engine::Sglang => &[HashAlgo::Sha256Sglang],
            Engine::Trtllm => &[HashAlgo::BlockhashTrtllm],
            Engine::Llamacpp => &[],
        }
    }

    /// Whether keys on this engine's wire are signed (SGLang) rather than unsigned.
    pub fn signed_keys(self) -> bool {
        matches!(self, Engine::Sglang)
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Block-hash algorithms: the engines' contracts plus kvroute's own content key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HashAlgo {
    #[serde(rename = "sha256_cbor")]
    Sha256Cbor,
    #[serde(rename = "xxhash_cbor")]
    XxhashCbor,
    #[serde(rename = "sha256_sglang")]
    Sha256Sglang,
    #[serde(rename = "blockhash_trtllm")]
    BlockhashTrtllm,
    /// kvroute's engine-independent content key (see [`content_keys`]).
    #[serde(rename = "tokens")]
    Tokens,
}

impl HashAlgo {
    /// Every algorithm, in the order error messages list them.
    pub const ALL: [HashAlgo; 5] = [
        HashAlgo::Sha256Cbor,
        HashAlgo::XxhashCbor,
        HashAlgo::Sha256Sglang,
        HashAlgo::BlockhashTrtllm,
        HashAlgo::Tokens,
    ];

    /// The configuration name (`sha256_cbor`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
            HashAlgo::Sha256Sglang => "sha256_sglang",
            HashAlgo::BlockhashTrtllm => "blockhash_trtllm",
            HashAlgo::Tokens => "tokens",
        }
    }

    /// Parses a configuration name.
    pub fn parse(s: &str) -> Option<HashAlgo> {
        HashAlgo::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// The engine whose contract this is; `None` for the content key.
    pub fn engine(self) -> Option<Engine> {
        match self {
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => Some(Engine::Vllm),
            HashAlgo::Sha256Sglang => Some(Engine::Sglang),
            HashAlgo::BlockhashTrtllm => Some(Engine::Trtllm),
            HashAlgo::Tokens => None,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-request inputs that enter the hash besides tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraKeys {
    /// vLLM LoRA adapter `(name, path)`: enters every block's extra keys.
    /// TensorRT-LLM uses [`ExtraKeys::lora_task_id`] instead.
    pub lora: Option<(String, String)>,
    /// TensorRT-LLM LoRA task id.
    pub lora_task_id: Option<u64>,
    /// Cache salt (vLLM: block 0's extra keys; SGLang: chain seed; TensorRT-LLM: seed mix).
    pub cache_salt: Option<String>,
}

impl ExtraKeys {
    /// True when nothing but tokens enters the hash.
    pub fn is_empty(&self) -> bool {
        self.lora.is_none() && self.lora_task_id.is_none() && self.cache_salt.is_none()
    }
}

/// What goes wrong building a hasher; every message names the setting and what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    #[error("kvBlockSize must be >= 1, got 0")]
    ZeroBlockSize,
    #[error(
        "xxhash_cbor needs the engine's PYTHONHASHSEED: vLLM seeds NONE_HASH for the xxhash family with a \
         random value when PYTHONHASHSEED is unset, so no router can reproduce its keys; start the engine \
         with PYTHONHASHSEED set and give kvroute the same value in LLB_KV_NONE_HASH_SEED"
    )]
    XxhashNeedsSeed,
    #[error("{algo} does not support {what}")]
    Unsupported { algo: HashAlgo, what: &'static str },
}

/// Everything that decides a rule's block keys: one mismatched leg means a 0% hit rate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashContract {
    pub algo: HashAlgo,
    pub block_size: BlockSize,
    /// vLLM: the engine's PYTHONHASHSEED (`None` = unset). Ignored by the other algorithms.
    pub seed: Option<String>,
    /// vLLM: how a block's extra keys (LoRA, cache salt) are written. Ignored by the other
    /// algorithms.
    #[serde(default)]
    pub extra_layout: ExtraKeysLayout,
}

/// How vLLM writes a block's extra keys into its hash (`kvVllmExtraKeys`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtraKeysLayout {
    /// vLLM 0.31 and later: tagged tuples, `("lora", name, path)`, `("cache_salt", salt)`.
    #[default]
    Tagged,
    /// vLLM before 0.31 (0.28 checked against the engine's own code): bare values, the LoRA
    /// adapter's name, then the salt.
    Flat,
}

impl ExtraKeysLayout {
    pub const ALL: [ExtraKeysLayout; 2] = [ExtraKeysLayout::Tagged, ExtraKeysLayout::Flat];

    pub fn as_str(self) -> &'static str {
        match self {
            ExtraKeysLayout::Tagged => "tagged",
            ExtraKeysLayout::Flat => "flat",
        }
    }

    pub fn parse(s: &str) -> Option<ExtraKeysLayout> {
        Self::ALL.into_iter().find(|l| l.as_str() == s)
    }

    /// The other layout (what a mismatch is checked against).
    pub fn other(self) -> ExtraKeysLayout {
        match self {
            ExtraKeysLayout::Tagged => ExtraKeysLayout::Flat,
            ExtraKeysLayout::Flat => ExtraKeysLayout::Tagged,
        }
    }
}

impl HashContract {
    /// A contract with no seed.
    pub fn new(algo: HashAlgo, block_size: BlockSize) -> Self {
        HashContract {
            algo,
            block_size,
            seed: None,
            extra_layout: ExtraKeysLayout::Tagged,
        }
    }

    /// Sets the vLLM NONE_HASH seed.
    pub fn with_seed(mut self, seed: impl Into<String>) -> Self {
        self.seed = Some(seed.into());
        self
    }

    /// A hasher for one request, validated against the contract.
    pub fn hasher(&self, extra: &ExtraKeys) -> Result<BlockHasher, HashError> {
        let inner = match self.algo {
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => Inner::Vllm(vllm::VllmHasher::new(
                self.algo,
                self.seed.as_deref(),
                extra,
                self.extra_layout,
            )?),
            HashAlgo::Sha256Sglang => {
                reject_lora(self.algo, extra)?;
                Inner::Sglang(sglang::SglangHasher::new(extra.cache_salt.as_deref()))
            }
            HashAlgo::BlockhashTrtllm => {
                if extra.lora.is_some() {
                    return Err(HashError::Unsupported {
                        algo: self.algo,
                        what: "a LoRA (name, path): give lora_task_id",
                    });
                }
                Inner::Trtllm(trtllm::TrtllmHasher::new(extra))
            }
            HashAlgo::Tokens => {
                reject_lora(self.algo, extra)?;
                Inner::Content(content::ContentHasher::new(extra.cache_salt.as_deref()))
            }
        };
        Ok(BlockHasher {
            block_size: self.block_size,
            inner,
        })
    }

    /// Keys of every full block of `tokens`.
    pub fn keys(&self, tokens: &[u32], extra: &ExtraKeys) -> Result<Vec<BlockKey>, HashError> {
        let mut h = self.hasher(extra)?;
        Ok(h.push_tokens(tokens))
    }
}

fn reject_lora(algo: HashAlgo, extra: &ExtraKeys) -> Result<(), HashError> {
    if extra.lora.is_some() || extra.lora_task_id.is_some() {
        return Err(HashError::Unsupported {
            algo,
            what: "LoRA extra keys",
        });
    }
    Ok(())
}

#[derive(Clone)]
enum Inner {
    Vllm(vllm::VllmHasher),
    Sglang(sglang::SglangHasher),
    Trtllm(trtllm::TrtllmHasher),
    Content(content::ContentHasher),
}

/// Streaming block hasher for one request: block `i`'s key from block `i` and the chain state.
/// Cloning snapshots the chain state, so a caller can cache the state after a shared prefix.
#[derive(Clone)]
pub struct BlockHasher {
    block_size: BlockSize,
    inner: Inner,
}

impl BlockHasher {
    /// The configured block size.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Hashes the next full block. `tokens.len()` must equal the block size; a partial block is
    /// not hashed and yields `None` (engines never publish one).
    pub fn push_block(&mut self, tokens: &[u32]) -> Option<BlockKey> {
        if tokens.len() != self.block_size.get() {
            return None;
        }
        Some(match &mut self.inner {
            Inner::Vllm(h) => h.push(tokens),
            Inner::Sglang(h) => h.push(tokens),
            Inner::Trtllm(h) => h.push(tokens),
            Inner::Content(h) => h.push(tokens),
        })
    }

    /// Keys of every full block of `tokens` (a trailing partial block is ignored).
    pub fn push_tokens(&mut self, tokens: &[u32]) -> Vec<BlockKey> {
        let bs = self.block_size.get();
        let mut keys = Vec::with_capacity(tokens.len() / bs);
        for block in tokens.chunks_exact(bs) {
            if let Some(k) = self.push_block(block) {
                keys.push(k);
            }
        }
        keys
    }
}
