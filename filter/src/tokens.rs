//! Prompt token ids inside the filter: chat template, tokenizer and the segment cache.
//!
//! The hot path is kvroute-core's exact [`FastBpe`] when the tokenizer's shape allows it, else HF
//! `tokenizers`. On the fast path the rendered prompt is encoded by kvroute-core's
//! [`SegmentEncoder`]: cut at added (special) tokens, exactly where `FastBpe` itself cuts it, each
//! segment's ids cached by the segment's full text, so a multi-turn follow-up or a shared system
//! prompt re-encodes only the new segments (the reuse argument is on `kvroute_core::segments`).
//! The segment cache and the encoder's piece cache are bounded ([`CacheLimits`]).
//!
//! The work of one request is bounded too: only the first `max_prefix_tokens` ids are produced
//! ([`PromptEncoder::set_max_prefix_tokens`]), each exactly the engine's, and a pre-token piece
//! over [`MAX_PIECE_BYTES`] ends the ids before it instead of being merged; [`SegmentStats`]'s
//! `truncated` says which bound cut a request. Routing on a prefix loses nothing the first ids
//! decide: the text past them cannot change which endpoint holds the longest prefix of them. On
//! the HF fallback path the ids are cut after a full encode (HF's merge is O(n log n) too).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use kvroute_core::bpe::{FastBpe, PrefixCap, Truncation};
use kvroute_core::chat::anthropic::Breakpoints;
use kvroute_core::chat::{ChatTemplate, Renderer};
use kvroute_core::prompt::{stop_before_media, Prompt, PromptError, Request, RequestBody};
use kvroute_core::tokenize::Tokenizer;
use serde_json::Value;

pub use kvroute_core::bpe::{MAX_PIECE_BYTES, MAX_PREFIX_TOKENS, MAX_PREFIX_TOKENS_LIMIT};
use kvroute_core::segments::SegmentEncoder;
pub use kvroute_core::segments::{CacheLimits, SegmentStats};

/// Unix seconds for `strftime_now` in templates; set by the caller before rendering.
static CLOCK_SECS: AtomicI64 = AtomicI64::new(0);

/// Sets the clock templates read (the request path passes the host's time).
pub fn set_clock(unix_secs: i64) {
    CLOCK_SECS.store(unix_secs, Ordering::Relaxed);
}

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("tokenizer.json could not be loaded: {0}")]
    Tokenizer(String),
    #[error("tokenizer_config.json chat template could not be loaded: {0}")]
    Template(String),
}

enum Encoder {
    /// The fast exact path, with its segment cache.
    Fast(RefCell<SegmentEncoder>),
    Hf(Tokenizer),
}

/// Where an Anthropic request's `cache_control` breakpoints fall in its prompt tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Located {
    /// The prompt's token count through each breakpoint found, in order.
    pub tokens: Vec<u32>,
    /// Breakpoints not placed: marks on tools or on blocks other than text, text the rendered
    /// prompt does not contain (cut before it at a media item, or changed by the template), and
    /// breakpoints past the tokens routed on (`max_prefix_tokens`).
    pub unlocated: u32,
}

/// A model's tokenizer and chat template, with the segment cache.
pub struct PromptEncoder {
    enc: Encoder,
    template: Option<ChatTemplate>,
    /// The bound of every encode (`max_prefix_tokens`).
    cap: Cell<PrefixCap>,
}

impl std::fmt::Debug for PromptEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptEncoder")
            .field("fast", &self.is_fast())
            .field("template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

impl PromptEncoder {
    /// Loads `tokenizer.json` and, when given, the chat template of `tokenizer_config.json`.
    pub fn load(
        tokenizer_json: &[u8],
        config_json: Option<&[u8]>,
    ) -> Result<PromptEncoder, LoadError> {
        let t: Value = serde_json::from_slice(tokenizer_json)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        let fast = FastBpe::for_requests(&t).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        let enc = match fast {
            Some(bpe) => {
                Encoder::Fast(RefCell::new(SegmentEncoder::new(bpe, CacheLimits::DEFAULT)))
            }
            None => Encoder::Hf(
                Tokenizer::from_bytes(tokenizer_json)
                    .map_err(|e| LoadError::Tokenizer(e.to_string()))?,
            ),
        };
        let template = match config_json {
            None => None,
            Some(c) => {
                let mut tpl =
                    ChatTemplate::new(c).map_err(|e| LoadError::Template(e.to_string()))?;
                tpl.set_clock(Arc::new(|| CLOCK_SECS.load(Ordering::Relaxed)));
                Some(tpl)
            }
        };
        Ok(PromptEncoder {
            enc,
            template,
            cap: Cell::new(PrefixCap::tokens(MAX_PREFIX_TOKENS)),
        })
    }

    /// Routes on at most the first `n` ids of each prompt (default [`MAX_PREFIX_TOKENS`]).
    pub fn set_max_prefix_tokens(&self, n: usize) {
        self.cap.set(PrefixCap::tokens(n));
    }

    /// Bounds (and empties) the segment and piece caches.
    pub fn set_cache_limits(&self, limits: CacheLimits) {
        if let Encoder::Fast(enc) = &self.enc {
            enc.borrow_mut().set_limits(limits);
        }
    }

    /// True when the fast exact encoder (and the segment cache) is in use.
    pub fn is_fast(&self) -> bool {
        matches!(self.enc, Encoder::Fast(_))
    }

    /// True when chat requests can be rendered.
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// The first token ids the engine computes for `request` (vLLM defaults: completions with
    /// special tokens, chat without), at most `max_prefix_tokens` and none past a chat's first
    /// media item, and how the segment cache did (`truncated`: why ids are missing).
    pub fn tokens(
        &self,
        request: &Request,
    ) -> Result<(Vec<u32>, SegmentStats, Option<Renderer>), PromptError> {
        self.tokens_located(request, None)
    }

    /// [`PromptEncoder::tokens`], also placing an Anthropic request's `cache_control`
    /// breakpoints in `located` (see [`Located`]).
    pub fn tokens_located(
        &self,
        request: &Request,
        located: Option<&mut Located>,
    ) -> Result<(Vec<u32>, SegmentStats, Option<Renderer>), PromptError> {
        match &request.body {
            RequestBody::Completion(Prompt::TokenIds(ids)) => {
                let n = ids.len().min(self.cap.get().max_tokens);
                let stats = SegmentStats {
                    truncated: (n < ids.len()).then_some(Truncation::MaxTokens),
                    ..SegmentStats::default()
                };
                Ok((ids.get(..n).unwrap_or(&[]).to_vec(), stats, None))
            }
            RequestBody::Completion(Prompt::Text(text)) => {
                let (ids, stats) = self.encode(text, request.add_special_tokens.unwrap_or(true))?;
                Ok((ids, stats, None))
            }
            RequestBody::Chat(chat) => {
                let template = self.template.as_ref().ok_or(PromptError::NoChatTemplate)?;
                let rendered = template.render_prefix(chat)?;
                let special = request.add_special_tokens.unwrap_or(false);
                let (mut ids, mut stats) = self.encode(&rendered.text, special)?;
                if rendered.media.is_some() {
                    stats.truncated = stop_before_media(&mut ids, stats.truncated);
                }
                if let Some(out) = located {
                    *out = self.locate(&rendered.text, special, &request.breakpoints, ids.len());
                }
                Ok((ids, stats, Some(rendered.renderer)))
            }
        }
    }

    /// Each breakpoint's end in `text` (searched in order, each after the one before) and the
    /// token count of `text` up to it. The prefix is encoded like the prompt, so its segments
    /// come from the segment cache (a breakpoint that ends a message ends a segment: the
    /// template's special token follows). A breakpoint past the `routed` ids is not located.
    fn locate(
        &self,
        text: &str,
        add_special_tokens: bool,
        bp: &Breakpoints,
        routed: usize,
    ) -> Located {
        let mut out = Located {
            tokens: Vec::with_capacity(bp.texts.len()),
            unlocated: bp.elsewhere,
        };
        let mut at = 0;
        for t in &bp.texts {
            let found = text
                .get(at..)
                .and_then(|rest| rest.find(t.as_str()))
                .map(|i| at + i + t.len());
            let ids = found
                .and_then(|end| text.get(..end))
                .and_then(|head| self.encode(head, add_special_tokens).ok())
                .filter(|(ids, stats)| stats.truncated.is_none() && ids.len() <= routed);
            match (found, ids) {
                (Some(end), Some((ids, _))) => {
                    at = end;
                    out.tokens
                        .push(u32::try_from(ids.len()).unwrap_or(u32::MAX));
                }
                _ => out.unlocated += 1,
            }
        }
        out
    }

    fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, SegmentStats), PromptError> {
        let cap = self.cap.get();
        match &self.enc {
            Encoder::Hf(t) => {
                let mut ids = t.encode(text, add_special_tokens)?;
                let stats = SegmentStats {
                    truncated: (ids.len() > cap.max_tokens).then_some(Truncation::MaxTokens),
                    ..SegmentStats::default()
                };
                ids.truncate(cap.max_tokens);
                Ok((ids, stats))
            }
            Encoder::Fast(enc) => Ok(enc.borrow_mut().encode_prefix(text, cap)),
        }
    }

    /// Entries and bytes held by the segment cache.
    pub fn segment_cache_usage(&self) -> (usize, usize) {
        match &self.enc {
            Encoder::Fast(enc) => enc.borrow().usage(),
            Encoder::Hf(_) => (0, 0),
        }
    }

    /// Empties the segment cache and the encoder's piece cache (the bench's "cold" case).
    pub fn clear_caches(&self) {
        if let Encoder::Fast(enc) = &self.enc {
            enc.borrow_mut().clear();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod tests {
    use super::*;

    /// A byte-level BPE tokenizer small enough to inline: vocabulary = the 256 byte symbols plus a
    /// few merges and two added tokens.
    pub(crate) fn tiny_tokenizer_json() -> String {
        let mut vocab = serde_json::Map::new();
        let mut n = 0u32;
        // GPT-2 byte table: printable ranges map to themselves, the rest to 256+.
        let mut extra = 0u32;
        for b in 0..=255u32 {
            let printable = matches!(b, 33..=126 | 0xA1..=0xAC | 0xAE..=0xFF);
            let c = if printable {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            };
            vocab.insert(c.to_string(), n.into());
            n += 1;
        }
        for m in ["he", "ll", "hell", "hello"] {
            vocab.insert(m.into(), n.into());
            n += 1;
        }
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [
                {"id": 1000, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1001, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": ["h e", "l l", "he ll", "hell o"]}
        })
        .to_string()
    }

    pub(crate) const TINY_CONFIG: &str = r#"{"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "eos_token": "<|im_end|>"}"#;

    fn chat(messages: serde_json::Value) -> Request {
        Request::from_json(
            serde_json::json!({"model": "m", "messages": messages})
                .to_string()
                .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn segment_cache_reuses_earlier_turns_and_matches_uncached_ids() {
        let tok = tiny_tokenizer_json();
        let enc = PromptEncoder::load(tok.as_bytes(), Some(TINY_CONFIG.as_bytes())).unwrap();
        assert!(enc.is_fast() && enc.has_template());
        let first = chat(
            serde_json::json!([{"role": "system", "content": "hello hello"}, {"role": "user", "content": "hello there"}]),
        );
        let (ids1, s1, _) = enc.tokens(&first).unwrap();
        // Within one prompt only the repeated special tokens and separators hit.
        assert!(s1.misses >= 4, "{s1:?}");
        let follow = chat(serde_json::json!([
            {"role": "system", "content": "hello hello"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]));
        let (ids2, s2, _) = enc.tokens(&follow).unwrap();
        assert!(s2.hits > s2.misses, "{s2:?}");
        // The cached result equals a cold encode, and the first turns are a prefix.
        enc.clear_caches();
        let (cold, _, _) = enc.tokens(&follow).unwrap();
        assert_eq!(ids2, cold);
        assert_eq!(&ids2[..ids1.len() - 3], &ids1[..ids1.len() - 3]);
        assert!(ids2.contains(&1000) && ids2.contains(&1001));
        // The hello merges applied.
        assert!(ids2.contains(&259), "{ids2:?}");
    }

    /// An Anthropic request's marked text blocks are placed at the token count of the rendered
    /// prompt through them; a mark the prompt does not show (a dropped billing block, a tool)
    /// is counted as not located; other requests place nothing.
    #[test]
    fn breakpoints_are_placed_in_the_prompt_tokens() {
        let tok = tiny_tokenizer_json();
        let enc = PromptEncoder::load(tok.as_bytes(), Some(TINY_CONFIG.as_bytes())).unwrap();
        let cc = serde_json::json!({"type": "ephemeral"});
        let body = serde_json::json!({"model": "m", "max_tokens": 1,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1", "cache_control": cc},
                {"type": "text", "text": "hello hello", "cache_control": cc}],
            "tools": [{"name": "t", "input_schema": {}, "cache_control": cc}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello there", "cache_control": cc}]}]});
        let r = Request::from_json_for(
            body.to_string().as_bytes(),
            kvroute_core::prompt::Endpoint::Messages,
        )
        .unwrap();
        let mut located = Located::default();
        let (ids, _, _) = enc.tokens_located(&r, Some(&mut located)).unwrap();
        let head = |text: &str| {
            let p = serde_json::json!({"prompt": text, "add_special_tokens": false});
            enc.tokens(&Request::from_json(p.to_string().as_bytes()).unwrap())
                .unwrap()
                .0
        };
        let system = head("<|im_start|>system\nhello hello");
        let user = head("<|im_start|>system\nhello hello<|im_end|>\n<|im_start|>user\nhello there");
        assert!(ids.starts_with(&user) && user.starts_with(&system));
        assert_eq!(
            located,
            Located {
                tokens: vec![system.len() as u32, user.len() as u32],
                unlocated: 2,
            }
        );
        // Past the routed tokens: not located.
        enc.set_max_prefix_tokens(system.len() + 1);
        enc.tokens_located(&r, Some(&mut located)).unwrap();
        assert_eq!((located.tokens.len(), located.unlocated), (1, 3));
        let (_, _, _) = enc
            .tokens_located(
                &chat(serde_json::json!([{"role": "user", "content": "x"}])),
                Some(&mut located),
            )
            .unwrap();
        assert_eq!(located, Located::default());
    }

    #[test]
    fn token_id_prompts_need_no_tokenizer_work_and_chat_needs_a_template() {
        let tok = tiny_tokenizer_json();
        let enc = PromptEncoder::load(tok.as_bytes(), None).unwrap();
        let r = Request::from_json(br#"{"prompt": [5, 6, 7]}"#).unwrap();
        assert_eq!(enc.tokens(&r).unwrap().0, vec![5, 6, 7]);
        let r = Request::from_json(br#"{"prompt": "hello"}"#).unwrap();
        assert_eq!(enc.tokens(&r).unwrap().0, vec![259]);
        assert!(matches!(
            enc.tokens(&chat(serde_json::json!([{"role": "user", "content": "x"}]))),
            Err(PromptError::NoChatTemplate)
        ));
        assert!(PromptEncoder::load(b"nope", None).is_err());
    }
}

/// Parity with the reference path (HF tokenizers + the same template) on the real Qwen3
/// tokenizer, when the fixture is installed (scripts/setup.sh); skipped otherwise.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod fixture_parity {
    use super::*;
    use kvroute_core::prompt::PromptTokens;

    fn fixture() -> Option<std::path::PathBuf> {
        let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../.cache/fixtures/qwen3")
            });
        dir.join("tokenizer.json").is_file().then_some(dir)
    }

    #[test]
    fn matches_hf_on_chat_and_completions() {
        let Some(dir) = fixture() else {
            eprintln!("skipped: no Qwen3 tokenizer fixture");
            return;
        };
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
        let enc = PromptEncoder::load(&json, Some(&config)).unwrap();
        assert!(enc.is_fast());
        let hf = Tokenizer::from_bytes(&json).unwrap();
        let tpl = ChatTemplate::new(&config).unwrap();
        let bodies = [
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": "You are a careful assistant. Réponds en français. 你好 🚀"},
                {"role": "user", "content": "Explain, step by step, how a paged KV cache works.\n\n  Indented   text\ttabs."},
                {"role": "assistant", "content": "Sure: blocks <|im_end|> are hashed."},
                {"role": "user", "content": "And again?"}]}),
            serde_json::json!({"prompt": "Plain completion text with <|endoftext|> inside and numbers 12345."}),
        ];
        for b in bodies {
            let req = Request::from_json(b.to_string().as_bytes()).unwrap();
            let want = PromptTokens::from_request(&req, &hf, Some(&tpl)).unwrap();
            for round in 0..2 {
                let (got, _, _) = enc.tokens(&req).unwrap();
                assert_eq!(got, want, "round {round}: {b}");
            }
        }
    }
}

/// The prefix cap on the real Qwen3 tokenizer: 1 MB of prose and a 1M-character word in a chat
/// request give exactly HF's first ids, within the cap; skipped without the fixture.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod fixture_prefix_cap {
    use super::*;

    #[test]
    fn huge_prompts_give_hf_first_ids_within_the_cap() {
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3");
        let (Ok(json), Ok(config)) = (
            std::fs::read(dir.join("tokenizer.json")),
            std::fs::read(dir.join("tokenizer_config.json")),
        ) else {
            eprintln!("skipped: no Qwen3 tokenizer fixture");
            return;
        };
        let enc = PromptEncoder::load(&json, Some(&config)).unwrap();
        assert!(enc.is_fast());
        let hf = Tokenizer::from_bytes(&json).unwrap();
        let tpl = ChatTemplate::new(&config).unwrap();
        let sentence = "The router sends each request to the backend whose cache holds its prefix, 42 times.\n";
        let prose = sentence.repeat((1 << 20) / sentence.len());
        let word = "a".repeat(1_000_000);
        for (content, why) in [
            (prose, Truncation::MaxTokens),
            (word, Truncation::LongPiece),
        ] {
            let body = serde_json::json!({"messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]});
            let req = Request::from_json(body.to_string().as_bytes()).unwrap();
            let (ids, stats, _) = enc.tokens(&req).unwrap();
            assert_eq!(stats.truncated, Some(why));
            let RequestBody::Chat(chat) = &req.body else {
                panic!()
            };
            let text = tpl.render(chat).unwrap();
            // HF's ids of a head of the text long enough to hold the ids routed on.
            let head = match why {
                Truncation::MaxTokens => &text[..200_000],
                Truncation::LongPiece => &text[..text.find("aaaa").unwrap()],
                Truncation::Media => panic!("not a case of this test"),
            };
            let want = hf.encode(head, false).unwrap();
            match why {
                Truncation::MaxTokens => {
                    assert_eq!(ids.len(), MAX_PREFIX_TOKENS);
                    assert_eq!(ids[..], want[..MAX_PREFIX_TOKENS]);
                }
                Truncation::LongPiece => {
                    assert!(ids.len() > 3 && ids.len() < 40, "{}", ids.len());
                    assert_eq!(ids, want);
                }
                Truncation::Media => panic!("not a case of this test"),
            }
        }
    }
}

/// Stage timings on the real tokenizer (`cargo test --release -p kvroute-filter stage_timings --
/// --ignored --nocapture`): where a request's filter time goes, natively. For a profiler,
/// `KVROUTE_STAGE=render|parse|encode KVROUTE_STAGE_REPEAT=n` repeats one stage n times (`encode`
/// is a cold encode).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod stage_timings {
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore = "timing report, not a test"]
    fn stage_timings() {
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3");
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
        let enc = PromptEncoder::load(&json, Some(&config)).unwrap();
        let mut seed = 7u64;
        let mut word = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            [
                "ka", "lo", "mi", "tren", "sor", "vel", "di", "ux", "pra", "ne", "qui", "shal",
            ][(seed % 12) as usize]
                .repeat(1 + (seed % 3) as usize)
        };
        let mut msgs = vec![serde_json::json!({"role": "system", "content": "You are helpful."})];
        for i in 0..40 {
            let text: Vec<String> = (0..150).map(|_| word()).collect();
            msgs.push(serde_json::json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": text.join(" ")}));
        }
        let body = serde_json::json!({"model": "m", "messages": msgs}).to_string();
        let t = Instant::now();
        let req = Request::from_json(body.as_bytes()).unwrap();
        let parse = t.elapsed();
        let RequestBody::Chat(chat) = &req.body else {
            panic!()
        };
        let t = Instant::now();
        let text = enc.template.as_ref().unwrap().render(chat).unwrap();
        let render = t.elapsed();
        enc.clear_caches();
        let t = Instant::now();
        let (ids, _) = enc.encode(&text, false).unwrap();
        let cold = t.elapsed();
        let t = Instant::now();
        let _ = enc.encode(&text, false).unwrap();
        let warm = t.elapsed();
        // KVROUTE_STAGE_REPEAT=n repeats the cold encode (for a profiler).
        let repeat: usize = std::env::var("KVROUTE_STAGE_REPEAT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let stage = std::env::var("KVROUTE_STAGE").unwrap_or_default();
        for _ in 0..repeat {
            match stage.as_str() {
                "render" => {
                    let _ = enc.template.as_ref().unwrap().render(chat).unwrap();
                }
                "parse" => {
                    let _ = Request::from_json(body.as_bytes()).unwrap();
                }
                _ => {
                    enc.clear_caches();
                    let _ = enc.encode(&text, false).unwrap();
                }
            }
        }
        let contract = kvroute_core::hash::HashContract::new(
            kvroute_core::hash::HashAlgo::Sha256Cbor,
            kvroute_core::hash::BlockSize::new(16).unwrap(),
        )
        .with_seed("0");
        let t = Instant::now();
        let keys = contract.keys(&ids, &Default::default()).unwrap();
        let hash = t.elapsed();
        let mut cache = crate::cache::KeyCache::default();
        let none = Default::default();
        let t = Instant::now();
        let _ = cache.keys(&contract, &none, &ids).unwrap();
        let hash_fill = t.elapsed();
        let mut follow = ids.clone();
        follow.extend(1000..1100);
        let t = Instant::now();
        let _ = cache.keys(&contract, &none, &follow).unwrap();
        let hash_follow = t.elapsed();
        eprintln!("{} bytes body, {} tokens, {} keys: parse {parse:?}, render {render:?}, encode cold {cold:?}, encode cached {warm:?}, hash {hash:?}, hash into the key cache {hash_fill:?}, hash a follow-up (+100 tokens) {hash_follow:?}", body.len(), ids.len(), keys.len());
    }
}
