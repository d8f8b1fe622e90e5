//! Request bodies to prompt tokens, and the deterministic fake output.
//!
//! With `--tokenizer-dir` the simulator tokenizes exactly as the engine would, through
//! kvroute-core ([`Request`], [`PromptTokens`], the model's chat template): the keys it publishes
//! then equal the keys the filter computes. Without one it falls back to a word tokenizer (one
//! token per whitespace-separated word, id from a hash of the word; chat messages rendered as
//! `<|role|>\ncontent\n`), which is fast and deterministic for benchmarks; the driver's "direct"
//! strategy uses this same module, so both sides agree either way.
//!
//! Chat requests with images, audio or video (with a tokenizer that has Qwen-VL's vision tokens)
//! become what vLLM makes of them for a Qwen-VL model: each item's placeholder
//! [`MEDIA_PLACEHOLDER`] where vLLM puts it (the chat template renders it), its `<|image_pad|>`
//! expanded to [`MEDIA_TOKENS`] tokens, and the item tracked ([`MediaItem`]) so the blocks it
//! overlaps are hashed with it and published with it in their `extra_keys`, as vLLM does. The
//! items' identifiers are a hash of the part as sent (vLLM hashes the decoded media).

use std::path::Path;

use kvroute_core::chat::conversation::{first_media, media_type};
use kvroute_core::chat::{ChatRequest, ChatTemplate};
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
    /// The media items of the prompt, in order.
    pub media: Vec<MediaItem>,
}

/// The placeholder vLLM renders for an image of a Qwen-VL model; the simulator uses it for every
/// media item.
pub const MEDIA_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// Prompt tokens one media item becomes (its `<|image_pad|>` repeated).
pub const MEDIA_TOKENS: usize = 64;

/// One media item of a prompt, as vLLM tracks it for block hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaItem {
    /// Position of its first token in the prompt.
    pub offset: usize,
    /// Its tokens.
    pub len: usize,
    /// Its identifier (vLLM: the media hash).
    pub id: String,
}

/// The items overlapping the `len` tokens from `start`, as vLLM lists them in a block's
/// `extra_keys`: `(identifier, item offset - start)`.
pub fn overlapping(media: &[MediaItem], start: usize, len: usize) -> Vec<(String, i64)> {
    media
        .iter()
        .filter(|m| m.offset < start + len && start < m.offset + m.len)
        .map(|m| (m.id.clone(), m.offset as i64 - start as i64))
        .collect()
}

/// The ids the simulator hashes for the `tokens` from `start`: a media item's tokens stand for
/// the item itself, so blocks holding different items get different keys (vLLM mixes the
/// identifier in through the block's extra keys).
pub fn hash_view<'a>(
    tokens: &'a [u32],
    start: usize,
    media: &[MediaItem],
) -> std::borrow::Cow<'a, [u32]> {
    if overlapping(media, start, tokens.len()).is_empty() {
        return std::borrow::Cow::Borrowed(tokens);
    }
    let mut out = tokens.to_vec();
    for m in media {
        for (i, t) in out.iter_mut().enumerate() {
            let pos = start + i;
            if (m.offset..m.offset + m.len).contains(&pos) {
                let mix = format!("{}:{}", m.id, pos - m.offset);
                *t = (xxh3_64(mix.as_bytes()) as u32) | 0x8000_0000;
            }
        }
    }
    std::borrow::Cow::Owned(out)
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
        let (tokens, media) = match (self, &req.body) {
            (
                Encoder::Hf {
                    tokenizer,
                    template: Some(template),
                },
                RequestBody::Chat(chat),
            ) if first_media(&chat.messages).is_some() => media_tokens(
                chat,
                tokenizer,
                template,
                req.add_special_tokens.unwrap_or(false),
            )?,
            (
                Encoder::Hf {
                    tokenizer,
                    template,
                },
                _,
            ) => (
                PromptTokens::from_request(&req, &**tokenizer, template.as_deref())?,
                Vec::new(),
            ),
            (Encoder::Words, _) => (words_tokens(&req), Vec::new()),
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
            media,
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

/// A chat with media parts as vLLM tokenizes it for a Qwen-VL model (see the module docs).
fn media_tokens(
    chat: &ChatRequest,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    add_special_tokens: bool,
) -> Result<(Vec<u32>, Vec<MediaItem>), PromptError> {
    let text = template.render_with_media(chat, MEDIA_PLACEHOLDER)?;
    let ids = tokenizer.encode(&text, add_special_tokens)?;
    // Identifiers in the order the placeholders appear (vLLM keeps each message's items in
    // part order; the messages come in order).
    let ids_of_items: Vec<String> = chat
        .messages
        .iter()
        .filter_map(|m| m.get("content")?.as_array())
        .flatten()
        .filter(|p| media_type(p).is_some())
        .map(|p| format!("{:016x}", xxh3_64(p.to_string().as_bytes())))
        .collect();
    let Some(pad) = tokenizer.token_to_id("<|image_pad|>") else {
        return Ok((ids, Vec::new()));
    };
    let mut out = Vec::with_capacity(ids.len() + ids_of_items.len() * MEDIA_TOKENS);
    let mut media = Vec::new();
    for t in ids {
        match ids_of_items.get(media.len()) {
            Some(id) if t == pad => {
                media.push(MediaItem {
                    offset: out.len(),
                    len: MEDIA_TOKENS,
                    id: id.clone(),
                });
                out.extend(std::iter::repeat_n(pad, MEDIA_TOKENS));
            }
            _ => out.push(t),
        }
    }
    Ok((out, media))
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
    fn media_items_change_the_blocks_they_overlap_and_only_those() {
        let media = vec![
            MediaItem {
                offset: 5,
                len: 8,
                id: "a".into(),
            },
            MediaItem {
                offset: 20,
                len: 4,
                id: "b".into(),
            },
        ];
        // Blocks of 4: [0,4) none, [4,8) a at +1, [12,16) a at -7, [16,20) none, [20,24) b.
        assert!(overlapping(&media, 0, 4).is_empty());
        assert_eq!(overlapping(&media, 4, 4), vec![("a".to_string(), 1)]);
        assert_eq!(overlapping(&media, 12, 4), vec![("a".to_string(), -7)]);
        assert!(overlapping(&media, 16, 4).is_empty());
        assert_eq!(overlapping(&media, 20, 4), vec![("b".to_string(), 0)]);
        let tokens: Vec<u32> = (0..24).collect();
        let view = hash_view(&tokens, 0, &media);
        assert_eq!(view[..5], tokens[..5]);
        assert_eq!(view[13..20], tokens[13..20]);
        assert!(view[5..13].iter().all(|t| t & 0x8000_0000 != 0));
        // Another image at the same place: other ids; the same image: the same ids.
        let other = vec![MediaItem {
            offset: 5,
            len: 8,
            id: "c".into(),
        }];
        assert_ne!(hash_view(&tokens, 0, &other)[5..13], view[5..13]);
        assert_eq!(hash_view(&tokens[4..8], 4, &media)[..], view[4..8]);
    }

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
