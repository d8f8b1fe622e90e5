//! Offloaded tokenization: a filter that cannot tokenize (no staged tokenizer in the proxy, or a
//! prompt too large for its budget) sends `prompt` / `messages` instead of keys, and the service
//! computes the keys exactly as the filter would: kvroute-core's tokenizer and chat template from
//! `<tokenizer-dir>/tokenizers/<slug>/`, then the rule's hash contract.
//!
//! Tokenizers are loaded once per slug and cached; the CPU work runs on the blocking pool, off
//! the reactor. Any failure is logged and answered as "no keys" so routing still falls back.
//!
//! Encoding uses kvroute-core's exact fast BPE when the tokenizer's shape allows it (as the filter
//! does; HF tokenizers otherwise): an 8k-token prompt takes milliseconds instead of the ~25 ms that
//! made the filter's 25 ms callout time out. As in the filter, a [`SegmentEncoder`] caches each
//! segment's ids (the text between special tokens), so a follow-up turn encodes only its new
//! segments. Its caches are not thread-safe, so requests of one slug take turns on it (a mutex);
//! the template is rendered before the lock is taken.
//!
//! The work is bounded as in the filter: only the first `KVROUTE_MAX_PREFIX_TOKENS` ids are
//! produced (each exactly the engine's), and a pre-token piece over
//! [`kvroute_core::bpe::MAX_PIECE_BYTES`] ends the ids before it instead of being merged, so one
//! huge word cannot hold the slug's encoder (and every request queued on its mutex). [`Keyed`]
//! says which bound cut a prompt; the caller counts it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kvroute_core::bpe::{FastBpe, PrefixCap, Truncation};
use kvroute_core::chat::ChatTemplate;
use kvroute_core::hash::{BlockKey, ExtraKeys, HashContract};
use kvroute_core::prompt::{PromptTokens, Request, TextEncoder};
use kvroute_core::segments::{CacheLimits, SegmentEncoder};
use kvroute_core::tokenize::{TokenizeError, Tokenizer};
use serde_json::{json, Value};

use crate::sync::lock;

/// A staged tokenizer and its chat template (absent when the config has none).
pub struct Loaded {
    pub tokenizer: Tokenizer,
    /// The exact fast encoder with its segment cache, when the tokenizer's shape allows it.
    pub fast: Option<Mutex<SegmentEncoder>>,
    pub template: Option<ChatTemplate>,
}

impl Loaded {
    /// Loads `tokenizer.json` and the chat template of `tokenizer_config.json` (when given and
    /// valid); `fast: false` keeps HF tokenizers only (the reference in tests).
    pub fn new(
        tokenizer_json: &[u8],
        config_json: Option<&[u8]>,
        fast: bool,
    ) -> Result<Loaded, String> {
        let tokenizer = Tokenizer::from_bytes(tokenizer_json).map_err(|e| e.to_string())?;
        let parsed: Value = serde_json::from_slice(tokenizer_json).map_err(|e| e.to_string())?;
        let fast = match fast {
            true => FastBpe::for_requests(&parsed).map_err(|e| e.to_string())?,
            false => None,
        };
        let fast = fast.map(|bpe| Mutex::new(SegmentEncoder::new(bpe, CacheLimits::DEFAULT)));
        let template = config_json.and_then(|c| ChatTemplate::new(c).ok());
        Ok(Loaded {
            tokenizer,
            fast,
            template,
        })
    }
}

/// Only encoders built by `FastBpe::for_requests` take the fast path: their post-processor adds
/// nothing, so `add_special_tokens` changes nothing there.
impl TextEncoder for Loaded {
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.fast {
            Some(fast) => Ok(lock(fast).encode(text).0),
            None => self.tokenizer.encode(text, add_special_tokens),
        }
    }

    fn encode_text_prefix(
        &self,
        text: &str,
        add_special_tokens: bool,
        cap: PrefixCap,
    ) -> Result<(Vec<u32>, Option<Truncation>), TokenizeError> {
        match &self.fast {
            Some(fast) => {
                let (ids, stats) = lock(fast).encode_prefix(text, cap);
                Ok((ids, stats.truncated))
            }
            None => self
                .tokenizer
                .encode_text_prefix(text, add_special_tokens, cap),
        }
    }
}

/// Per-slug cache of loaded tokenizers. A slug loads once however many callers ask at the same
/// time (a rule's endpoints all start their canary together): the others wait for that load.
#[derive(Default)]
pub struct TokenizerCache {
    inner: Mutex<HashMap<String, Slot>>,
}

/// One slug's tokenizer once loaded; its lock is held while it loads.
type Slot = Arc<Mutex<Option<Arc<Loaded>>>>;

impl TokenizerCache {
    /// The tokenizer of `slug` under `dir`, loading it on first use (a failed load is tried again
    /// by the next caller: the tokenizer may be staged later).
    pub fn get(&self, dir: &Path, slug: &str) -> Result<Arc<Loaded>, String> {
        let slot = lock(&self.inner)
            .entry(slug.to_owned())
            .or_default()
            .clone();
        let mut slot = lock(&slot);
        if let Some(l) = &*slot {
            return Ok(l.clone());
        }
        let base = dir.join("tokenizers").join(slug);
        let tj = std::fs::read(base.join("tokenizer.json"))
            .map_err(|e| format!("{}: {e}", base.join("tokenizer.json").display()))?;
        let config = std::fs::read(base.join("tokenizer_config.json")).ok();
        let l = Arc::new(
            Loaded::new(&tj, config.as_deref(), true)
                .map_err(|e| format!("tokenizer {slug}: {e}"))?,
        );
        *slot = Some(l.clone());
        Ok(l)
    }
}

/// What the filter sent instead of keys.
pub struct Offload {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Value>,
}

/// The keys of an offloaded prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyed {
    pub keys: Vec<BlockKey>,
    /// Tokens the keys cover (at most the cap).
    pub token_count: u32,
    /// Why tokens past `token_count` were not routed on (`None`: the prompt has no more).
    pub truncated: Option<Truncation>,
}

/// Tokenizes at most `max_prefix_tokens` tokens of the prompt and hashes them.
pub fn keys_for(
    loaded: &Loaded,
    contract: &HashContract,
    o: &Offload,
    max_prefix_tokens: usize,
) -> Result<Keyed, String> {
    let mut body = match (&o.prompt, &o.messages) {
        (Some(p), None) => json!({"prompt": p}),
        (None, Some(m)) => json!({"messages": m}),
        _ => return Err("give exactly one of prompt, messages".into()),
    };
    if let (Some(m), Value::Object(obj)) = (&o.model, &mut body) {
        obj.insert("model".into(), json!(m));
    }
    let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let req = Request::from_json(&bytes).map_err(|e| e.to_string())?;
    keys_for_request(loaded, contract, &req, max_prefix_tokens)
}

/// The token ids kvroute routes a parsed request on (at most `max_prefix_tokens`, its chat
/// template for messages), and why it stopped short of the whole prompt.
pub fn prompt_tokens(
    loaded: &Loaded,
    req: &Request,
    max_prefix_tokens: usize,
) -> Result<(Vec<u32>, Option<Truncation>), String> {
    PromptTokens::prefix_from_request(
        req,
        loaded,
        loaded.template.as_ref(),
        PrefixCap::tokens(max_prefix_tokens),
    )
    .map_err(|e| e.to_string())
}

/// Tokenizes at most `max_prefix_tokens` tokens of a parsed OpenAI request (its chat template
/// for messages, its `cache_salt` in the first key) and hashes them, as the filter does.
pub fn keys_for_request(
    loaded: &Loaded,
    contract: &HashContract,
    req: &Request,
    max_prefix_tokens: usize,
) -> Result<Keyed, String> {
    let (tokens, truncated) = prompt_tokens(loaded, req, max_prefix_tokens)?;
    let extra = ExtraKeys {
        cache_salt: req.cache_salt.clone(),
        ..ExtraKeys::default()
    };
    let keys = contract.keys(&tokens, &extra).map_err(|e| e.to_string())?;
    Ok(Keyed {
        keys,
        token_count: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        truncated,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kvroute_core::hash::{BlockSize, HashAlgo};

    /// 1 MB of prose and a 1M-character word, fast path and HF path: the keys cover at most the
    /// cap, the fast path equals HF on the tokens it keeps, and the cut is reported.
    #[test]
    fn huge_prompts_stay_within_the_cap() {
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3");
        let (Ok(tj), Ok(config)) = (
            std::fs::read(dir.join("tokenizer.json")),
            std::fs::read(dir.join("tokenizer_config.json")),
        ) else {
            eprintln!("skipped: no Qwen3 tokenizer fixture");
            return;
        };
        let fast = Loaded::new(&tj, Some(&config), true).unwrap();
        let hf = Loaded::new(&tj, Some(&config), false).unwrap();
        let contract =
            HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap()).with_seed("0");
        let sentence = "Routers route requests to the engine holding their prefix, 7 times. ";
        let prose = Offload {
            model: None,
            prompt: Some(sentence.repeat((1 << 20) / sentence.len())),
            messages: None,
        };
        let a = keys_for(&fast, &contract, &prose, 16_384).unwrap();
        assert_eq!(
            (a.token_count, a.keys.len(), a.truncated),
            (16_384, 1024, Some(Truncation::MaxTokens))
        );
        // HF on a head that holds well over the cap's tokens: the same first 16384 tokens.
        let head = Offload {
            prompt: Some(sentence.repeat(200_000 / sentence.len())),
            ..prose
        };
        assert_eq!(keys_for(&hf, &contract, &head, 16_384).unwrap(), a);
        let word = Offload {
            model: None,
            prompt: None,
            messages: Some(
                json!([{"role": "user", "content": format!("Hi {}", "a".repeat(1_000_000))}]),
            ),
        };
        let w = keys_for(&fast, &contract, &word, 16_384).unwrap();
        assert_eq!(w.truncated, Some(Truncation::LongPiece));
        assert!(w.token_count > 0 && w.token_count < 16, "{}", w.token_count);
        // An image after a long system prompt: the keys of the text before it, fast path and HF
        // path alike, a prefix of the same turn's keys without the image.
        let system = json!({"role": "system", "content": sentence.repeat(20)});
        let image =
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}});
        let with_image = Offload {
            model: None,
            prompt: None,
            messages: Some(
                json!([system, {"role": "user", "content": [image, {"type": "text", "text": "What is it? ".repeat(8)}]}]),
            ),
        };
        let text_only = Offload {
            model: None,
            prompt: None,
            messages: Some(json!([system, {"role": "user", "content": "What is it? ".repeat(8)}])),
        };
        let m = keys_for(&fast, &contract, &with_image, 16_384).unwrap();
        assert_eq!(m.truncated, Some(Truncation::Media));
        assert_eq!(keys_for(&hf, &contract, &with_image, 16_384).unwrap(), m);
        let t = keys_for(&fast, &contract, &text_only, 16_384).unwrap();
        assert!(
            m.keys.len() >= 15 && m.keys.len() < t.keys.len(),
            "{} / {}",
            m.keys.len(),
            t.keys.len()
        );
        assert_eq!(m.keys[..], t.keys[..m.keys.len()]);
    }
}
