//! Request bodies to prompt tokens, and the deterministic fake output.
//!
//! With `--tokenizer-dir` the simulator tokenizes exactly as the engine would, through
//! kvroute-core ([`Request`], [`PromptTokens`], the model's chat template): the keys it publishes
//! then equal the keys the filter computes. Without one it falls back to a word tokenizer (one
//! token per whitespace-separated word, id from a hash of the word; chat messages rendered as
//! `<|role|>\ncontent\n`), which is fast and deterministic for benchmarks; the driver's "direct"
//! strategy uses this same module, so both sides agree either way.

use std::path::Path;

use kvroute_core::chat::ChatTemplate;
use kvroute_core::prompt::{Endpoint, Prompt, PromptError, PromptTokens, Request, RequestBody};
use kvroute_core::tokenize::Tokenizer;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Why a tokenizer directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("--tokenizer-dir: cannot read {path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// `tokenizer.json` is invalid.
    #[error("--tokenizer-dir: {0}")]
    Tokenizer(#[from] kvroute_core::tokenize::TokenizeError),
}

/// Prompt tokens plus the request options the simulator honours.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// `model` as sent.
    pub model: Option<String>,
    /// `cache_salt`.
    pub cache_salt: Option<String>,
    /// `max_tokens` / `max_completion_tokens`.
    pub max_tokens: Option<usize>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage` (`None` when absent).
    pub include_usage: Option<bool>,
}

/// Turns bodies into tokens, with the model's tokenizer or the word fallback.
pub enum Encoder {
    /// HuggingFace tokenizer and, if the directory has one, the chat template.
    Hf {
        /// The tokenizer.
        tokenizer: Box<Tokenizer>,
        /// The chat template from `tokenizer_config.json`.
        template: Option<Box<ChatTemplate>>,
    },
    /// One token per word.
    Words,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Encoder::Hf { template, .. } => {
                write!(f, "Encoder::Hf(template: {})", template.is_some())
            }
            Encoder::Words => f.write_str("Encoder::Words"),
        }
    }
}

impl Encoder {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` (optional) from `dir`.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|e| LoadError::Read {
                path: p.display().to_string(),
                reason: e.to_string(),
            })
        };
        let tokenizer = Tokenizer::from_bytes(&read("tokenizer.json")?)?;
        let template = match read("tokenizer_config.json") {
            Ok(bytes) => match ChatTemplate::new(&bytes) {
                Ok(mut t) => {
                    t.set_clock(std::sync::Arc::new(|| {
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_secs() as i64)
                            .unwrap_or(0)
                    }));
                    Some(Box::new(t))
                }
                Err(e) => {
                    tracing::warn!("no chat template: {e}");
                    None
                }
            },
            Err(_) => None,
        };
        Ok(Encoder::Hf {
            tokenizer: Box::new(tokenizer),
            template,
        })
    }

    /// Parses and tokenizes a body sent to `endpoint`.
    pub fn encode(&self, body: &[u8], endpoint: Endpoint) -> Result<Encoded, PromptError> {
        let req = Request::from_json_for(body, endpoint)?;
        let tokens = match self {
            Encoder::Hf {
                tokenizer,
                template,
            } => PromptTokens::from_request(&req, &**tokenizer, template.as_deref())?,
            Encoder::Words => words_tokens(&req),
        };
        let opts: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let max_tokens = opts
            .get("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| opts.get("max_tokens").and_then(Value::as_u64))
            .map(|n| n as usize);
        Ok(Encoded {
            tokens,
            model: req.model.clone(),
            cache_salt: req.cache_salt.clone(),
            max_tokens,
            stream: opts.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: opts
                .get("stream_options")
                .and_then(|s| s.get("include_usage"))
                .and_then(Value::as_bool),
        })
    }

    /// Token ids of plain text (no special tokens), for the generated output.
    pub fn encode_text(&self, text: &str) -> Vec<u32> {
        match self {
            Encoder::Hf { tokenizer, .. } => tokenizer.encode(text, false).unwrap_or_default(),
            Encoder::Words => text.split_whitespace().map(word_id).collect(),
        }
    }
}

/// The word tokenizer's id for one word.
pub fn word_id(w: &str) -> u32 {
    (xxh3_64(w.as_bytes()) % 150_000) as u32 + 1000
}

fn words_tokens(req: &Request) -> Vec<u32> {
    match &req.body {
        RequestBody::Completion(Prompt::TokenIds(ids)) => ids.clone(),
        RequestBody::Completion(Prompt::Text(t)) => t.split_whitespace().map(word_id).collect(),
        RequestBody::Chat(chat) => {
            let mut out = Vec::new();
            for m in &chat.messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
                out.push(word_id(&format!("<|{role}|>")));
                match m.get("content") {
                    Some(Value::String(s)) => out.extend(s.split_whitespace().map(word_id)),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                out.extend(t.split_whitespace().map(word_id));
                            }
                        }
                    }
                    _ => {}
                }
                out.push(word_id("<|end|>"));
            }
            if chat.add_generation_prompt {
                out.push(word_id("<|assistant|>"));
            }
            out
        }
    }
}

const WORDS: &[&str] = &[
    "the", "model", "cache", "block", "prefix", "router", "token", "answer", "is", "a", "of",
    "and", "to", "in", "that", "it", "with", "as", "for", "on", "this", "be", "by", "are", "we",
    "can", "from", "at", "which", "or", "an", "more", "will", "one", "all", "would", "there",
    "their", "what", "so", "up", "out", "if", "about", "who", "get", "when", "make", "time",
    "just", "know", "take", "people", "into", "year", "good", "some", "could", "them", "see",
    "other", "than", "then", "now",
];

/// Deterministic fake output of `n` words, derived from the prompt (same prompt, same answer).
pub fn fake_output(prompt: &[u32], n: usize) -> String {
    let mut seed = xxh3_64(
        &prompt
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let mut out = String::with_capacity(n * 6);
    for i in 0..n {
        // splitmix64 step: cheap, deterministic, well mixed.
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(z % WORDS.len() as u64) as usize]);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn words_encoder_handles_both_endpoints() {
        let e = Encoder::Words;
        let c = e
            .encode(
                br#"{"prompt": "a b c", "max_tokens": 3, "stream": true}"#,
                Endpoint::Completions,
            )
            .unwrap();
        assert_eq!(c.tokens, vec![word_id("a"), word_id("b"), word_id("c")]);
        assert_eq!(c.max_tokens, Some(3));
        assert!(c.stream);
        let ch = e
            .encode(br#"{"messages": [{"role": "system", "content": "x y"}, {"role": "user", "content": "z"}]}"#, Endpoint::ChatCompletions)
            .unwrap();
        assert_eq!(ch.tokens.len(), 2 + 2 + 1 + 2 + 1);
        assert_eq!(fake_output(&[1, 2], 4), fake_output(&[1, 2], 4));
        assert_eq!(fake_output(&[1, 2], 4).split(' ').count(), 4);
    }
}
