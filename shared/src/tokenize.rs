//! HuggingFace tokenizers loaded from `tokenizer.json` bytes, encoding text to the ids the
//! engine computes.
//!
//! vLLM tokenizes with the same `tokenizers` library (through transformers' fast tokenizer),
//! so loading the model's own `tokenizer.json` gives identical ids. Invariants:
//! * truncation and padding stored in the file are switched off, as transformers does for a
//!   plain `tokenizer(text)` call: the router must see every prompt token;
//! * parallelism is off (`set_parallelism(false)`): the filter runs single-threaded in a Wasm
//!   VM, and the service tokenizes on its own worker threads;
//! * loading takes bytes, never a path: this crate does no I/O.

use tokenizers::utils::parallelism::set_parallelism;

/// Why a tokenizer could not be loaded or could not encode.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The bytes are not a valid HuggingFace `tokenizer.json`.
    #[error("tokenizer.json could not be loaded: {0}")]
    Load(String),
    /// The tokenizer's pipeline failed on this text.
    #[error("tokenizer failed to encode {chars} characters: {reason}")]
    Encode {
        /// Length of the input, in characters.
        chars: usize,
        /// The library's message.
        reason: String,
    },
    /// Token ids the vocabulary cannot turn back into text.
    #[error("tokenizer failed to decode: {0}")]
    Decode(String),
}

/// A loaded HuggingFace tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads a tokenizer from the bytes of its `tokenizer.json`.
    pub fn from_bytes(json: &[u8]) -> Result<Self, TokenizeError> {
        set_parallelism(false);
        let mut inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| TokenizeError::Load(e.to_string()))?;
        inner
            .with_truncation(None)
            .map_err(|e| TokenizeError::Load(format!("cannot disable truncation: {e}")))?;
        inner.with_padding(None);
        Ok(Self { inner })
    }

    /// Encodes `text`. `add_special_tokens` applies the tokenizer's post-processor (BOS/EOS
    /// templates): vLLM uses true for `/v1/completions` and false for chat, whose template
    /// already writes the special tokens. Special tokens spelled in the text are matched either
    /// way, as in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode {
                chars: text.chars().count(),
                reason: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The id of a token string (`"<|im_end|>"`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of `ids`, special tokens included (for showing where two tokenizations part).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A word-level tokenizer small enough to inline, with a BOS post-processor.
    const TINY: &str = r#"{
      "version": "1.0", "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
      "padding": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"<s>": 0, "hello": 1, "world": 2, "again": 3, "[UNK]": 4}, "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn encodes_with_and_without_special_tokens_and_never_truncates() {
        let t = Tokenizer::from_bytes(TINY.as_bytes()).unwrap();
        assert_eq!(t.encode("hello world again", false).unwrap(), vec![1, 2, 3]);
        assert_eq!(
            t.encode("hello world again", true).unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(t.encode("<s>hello zzz", false).unwrap(), vec![0, 1, 4]);
        assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
        assert_eq!(t.token_to_id("world"), Some(2));
        assert_eq!(t.vocab_size(), 5);
    }

    #[test]
    fn rejects_garbage() {
        assert!(matches!(
            Tokenizer::from_bytes(b"not json"),
            Err(TokenizeError::Load(_))
        ));
        assert!(matches!(
            Tokenizer::from_bytes(b"\xff\xfe"),
            Err(TokenizeError::Load(_))
        ));
        assert!(matches!(
            Tokenizer::from_bytes(b"{}"),
            Err(TokenizeError::Load(_))
        ));
    }
}
