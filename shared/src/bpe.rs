//! A fast, exact encoder for byte-level BPE tokenizers (GPT-2/Qwen/Llama-3 style `tokenizer.json`).
//!
//! HF `tokenizers` is the reference; this path exists because tokenizing dominates the filter's
//! cost inside the Envoy worker (see ENVOY.md: ~16 ms per 7.4k tokens in Wasm). It does the same
//! steps with fewer allocations and a per-piece cache, so repeated words and whole repeated
//! segments cost a hash lookup:
//!
//! 1. split the text on added tokens (leftmost-longest, as HF's added vocabulary does);
//! 2. NFC-normalise each remaining segment (only when the tokenizer declares NFC);
//! 3. split it with the pre-tokenizer's regex (`Split`, behaviour `Isolated`);
//! 4. map each piece's bytes to byte-level symbols and apply merges lowest rank first,
//!    ties to the leftmost pair, exactly like HF's `Word::merge_all`.
//!
//! Step 3 is most of a cold encode. The byte-level patterns (GPT-2, Llama-3, Qwen) end in
//! `\s+(?!\S)|\s+`, the only lookaround in them, which forces a backtracking engine on the whole
//! pattern. [`Splitter::Dfa`] runs `head|\s+` on regex-automata's lazy DFA instead and applies the
//! lookahead itself, exactly (the argument is on [`Splitter`]); any other pattern keeps
//! fancy-regex. The per-piece cache is bounded in entries and bytes ([`FastBpe::set_piece_cache_limits`])
//! and counts its hits and misses ([`FastBpe::piece_cache_stats`]).
//!
//! [`FastBpe::from_tokenizer_json`] accepts only configurations whose semantics it reproduces
//! and answers `Ok(None)` for anything else, so callers fall back to HF tokenizers; exactness is
//! proven against HF on a corpus in `tests/bpe_parity.rs`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use regex_automata::{meta, Anchored, Input};
use serde_json::Value;
use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};

/// Why a tokenizer.json could not be loaded by the fast path although its shape is supported.
#[derive(Debug, thiserror::Error)]
pub enum BpeError {
    #[error("tokenizer.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("tokenizer.json pre-tokenizer regex does not compile: {0}")]
    Regex(String),
    #[error("tokenizer.json merge {0:?} names a token missing from the vocabulary")]
    Merge(String),
    #[error("tokenizer.json added tokens cannot be indexed: {0}")]
    Added(String),
}

/// A fast (non-SipHash) map: keys are token ids and pre-token bytes, hashed per piece.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Pre-token bytes -> their token ids.
type PieceCache = FastMap<Box<[u8]>, Box<[u32]>>;

/// Default bound on distinct pieces kept in the per-encoder cache (it is emptied when full).
pub const PIECE_CACHE_ENTRIES: usize = 200_000;
/// Default bound on the cache's bytes (piece bytes + 4 per id + a per-entry overhead).
pub const PIECE_CACHE_BYTES: usize = 16 << 20;
/// Bytes charged per cache entry besides its key and ids (two boxed slices and the table slot).
const PIECE_ENTRY_OVERHEAD: usize = 48;

/// The tail of every byte-level BPE pattern: the pattern's only lookaround.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// The pre-tokenizer's `Split` regex, as run.
///
/// `Dfa` runs a pattern `head|\s+(?!\S)|\s+` (no lookaround in `head`) as `all = (?:head)|\s+`.
/// Both are leftmost-first, so they match at the same leftmost positions (`\s+` matches wherever
/// `\s+(?!\S)` does) and, at such a position, agree whenever `head` matches there (it is tried
/// first in both). Otherwise `all`'s match is the whole whitespace run at that position, so the
/// run is followed by a non-space or by the end of the text. The original then tries
/// `\s+(?!\S)`: it backtracks off the run's last character when a non-space follows and that
/// leaves at least one character, else it fails and `\s+` takes the whole run. `head`, anchored
/// at the match, tells the two cases apart (only for matches starting with whitespace).
enum Splitter {
    Dfa { all: meta::Regex, head: meta::Regex },
    Fancy(fancy_regex::Regex),
}

impl Splitter {
    fn new(pattern: &str) -> Result<Splitter, BpeError> {
        if let Some(head) = pattern.strip_suffix(LOOKAHEAD_TAIL) {
            let all = meta::Regex::new(&format!(r"(?:{head})|\s+"));
            let head = meta::Regex::new(&format!("(?:{head})"));
            if let (Ok(all), Ok(head)) = (all, head) {
                return Ok(Splitter::Dfa { all, head });
            }
        }
        fancy_regex::Regex::new(pattern)
            .map(Splitter::Fancy)
            .map_err(|e| BpeError::Regex(e.to_string()))
    }

    /// Calls `piece` for every match and every gap between matches, in order (`Isolated`).
    fn split(&self, seg: &str, mut piece: impl FnMut(&[u8])) {
        let bytes = seg.as_bytes();
        let mut at = 0;
        match self {
            Splitter::Fancy(re) => {
                for m in re.find_iter(seg) {
                    let Ok(m) = m else {
                        // The backtracking limit was hit: treat the rest as one piece rather than fail.
                        break;
                    };
                    if m.start() > at {
                        piece(&bytes[at..m.start()]);
                    }
                    piece(m.as_str().as_bytes());
                    at = m.end();
                }
            }
            Splitter::Dfa { all, head } => {
                let mut pos = 0;
                while pos < bytes.len() {
                    let Some(m) = all.search(&Input::new(seg).range(pos..)) else {
                        break;
                    };
                    let (start, mut end) = (m.start(), m.end());
                    if end == start {
                        // No branch matches empty text; step over a character if one ever did.
                        pos = seg
                            .get(start..)
                            .and_then(|r| r.chars().next())
                            .map_or(bytes.len(), |c| start + c.len_utf8());
                        continue;
                    }
                    // Printable ASCII is never whitespace; anything else may be.
                    let maybe_space = bytes.get(start).is_some_and(|b| !b.is_ascii_graphic());
                    if end < bytes.len()
                        && maybe_space
                        && !head.is_match(Input::new(seg).range(start..).anchored(Anchored::Yes))
                    {
                        let last = seg
                            .get(start..end)
                            .and_then(|run| run.chars().next_back())
                            .map_or(0, char::len_utf8);
                        if end - start > last {
                            end -= last;
                        }
                    }
                    if start > at {
                        piece(&bytes[at..start]);
                    }
                    piece(&bytes[start..end]);
                    at = end;
                    pos = end;
                }
            }
        }
        if at < bytes.len() {
            piece(&bytes[at..]);
        }
    }
}

/// A piece of text as [`FastBpe::segments`] cuts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'t> {
    /// Text between added tokens (none inside).
    Text(&'t str),
    /// An added token, as its id.
    Added(u32),
}

/// Exact byte-level BPE encoder built from a HuggingFace `tokenizer.json`.
pub struct FastBpe {
    /// `(left id, right id)` -> `(merge rank, merged id)`.
    merges: FastMap<(u32, u32), (u32, u32)>,
    /// Token id of each single byte's byte-level symbol.
    byte_ids: [u32; 256],
    /// Added tokens, matched leftmost-longest on the raw text.
    added: Option<(AhoCorasick, Vec<u32>)>,
    nfc: bool,
    split: Splitter,
    cache: RefCell<PieceCache>,
    cache_bytes: Cell<usize>,
    /// Bounds: (entries, bytes).
    cache_limits: Cell<(usize, usize)>,
    hits: Cell<u64>,
    misses: Cell<u64>,
}

/// GPT-2's reversible byte -> printable char table used by byte-level BPE vocabularies.
fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + extra).unwrap_or('\0');
            extra += 1;
            c
        };
    }
    table
}

fn is_type(v: &Value, ty: &str) -> bool {
    v.get("type").and_then(Value::as_str) == Some(ty)
}

fn flag(v: &Value, name: &str) -> Option<bool> {
    v.get(name).and_then(Value::as_bool)
}

/// The pre-tokenizer's split regex when the chain is exactly `Split(Isolated) + ByteLevel(no regex)`,
/// or a lone `ByteLevel` with its GPT-2 regex.
fn split_pattern(pre: &Value) -> Option<String> {
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    let byte_level_ok =
        |b: &Value| is_type(b, "ByteLevel") && flag(b, "add_prefix_space") == Some(false);
    if is_type(pre, "ByteLevel") && byte_level_ok(pre) && flag(pre, "use_regex") != Some(false) {
        return Some(GPT2.to_owned());
    }
    let list = pre.get("pretokenizers")?.as_array()?;
    match list.as_slice() {
        [split, bl] if is_type(pre, "Sequence") && is_type(split, "Split") && byte_level_ok(bl) => {
            if flag(bl, "use_regex") != Some(false)
                || split.get("behavior").and_then(Value::as_str) != Some("Isolated")
                || flag(split, "invert") != Some(false)
            {
                return None;
            }
            split
                .pointer("/pattern/Regex")
                .and_then(Value::as_str)
                .map(str::to_owned)
        }
        _ => None,
    }
}

impl FastBpe {
    /// [`FastBpe::from_tokenizer_json`] for whole requests: also `Ok(None)` when the tokenizer's
    /// post-processor adds tokens around the text (BOS/EOS templates), so the encoder's ids are
    /// the engine's whatever `add_special_tokens` says (completions default it to true, chat to
    /// false). The filter and the service's offloaded tokenization both build theirs here.
    /// Takes the parsed `tokenizer.json` (callers that read other parts of it parse it once).
    pub fn for_requests(t: &Value) -> Result<Option<FastBpe>, BpeError> {
        let adds_nothing = match &t["post_processor"] {
            Value::Null => true,
            p => is_type(p, "ByteLevel"),
        };
        if !adds_nothing {
            return Ok(None);
        }
        FastBpe::from_value(t)
    }

    /// Builds the encoder, or `Ok(None)` when the tokenizer uses a feature this path does not
    /// reproduce exactly (then use HF tokenizers).
    pub fn from_tokenizer_json(json: &[u8]) -> Result<Option<FastBpe>, BpeError> {
        FastBpe::from_value(&serde_json::from_slice(json)?)
    }

    fn from_value(t: &Value) -> Result<Option<FastBpe>, BpeError> {
        let nfc = match &t["normalizer"] {
            Value::Null => false,
            n if is_type(n, "NFC") => true,
            _ => return Ok(None),
        };
        let Some(pattern) = split_pattern(&t["pre_tokenizer"]) else {
            return Ok(None);
        };
        let model = &t["model"];
        let simple_model = is_type(model, "BPE")
            && model["dropout"].is_null()
            && flag(model, "byte_fallback") != Some(true)
            && flag(model, "ignore_merges") != Some(true)
            && model["continuing_subword_prefix"]
                .as_str()
                .unwrap_or("")
                .is_empty()
            && model["end_of_word_suffix"]
                .as_str()
                .unwrap_or("")
                .is_empty();
        if !simple_model {
            return Ok(None);
        }
        let Some(vocab) = model["vocab"].as_object() else {
            return Ok(None);
        };
        let vocab: HashMap<&str, u32> = vocab
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), u32::try_from(v.as_u64()?).ok()?)))
            .collect();
        let chars = byte_level_chars();
        let mut byte_ids = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            let mut buf = [0u8; 4];
            match vocab.get(&*c.encode_utf8(&mut buf)) {
                Some(id) => byte_ids[b] = *id,
                None => return Ok(None),
            }
        }
        let Some(merge_list) = model["merges"].as_array() else {
            return Ok(None);
        };
        let mut merges = FastMap::with_capacity_and_hasher(merge_list.len(), Default::default());
        for (rank, m) in merge_list.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => match s.split_once(' ') {
                    Some(p) => p,
                    None => return Err(BpeError::Merge(s.clone())),
                },
                Value::Array(p) => match (
                    p.first().and_then(Value::as_str),
                    p.get(1).and_then(Value::as_str),
                ) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(BpeError::Merge(m.to_string())),
                },
                _ => return Err(BpeError::Merge(m.to_string())),
            };
            let joined = format!("{a}{b}");
            match (vocab.get(a), vocab.get(b), vocab.get(joined.as_str())) {
                (Some(&ia), Some(&ib), Some(&ij)) => {
                    merges.entry((ia, ib)).or_insert((rank as u32, ij));
                }
                _ => return Err(BpeError::Merge(format!("{a} {b}"))),
            }
        }
        let mut patterns = Vec::new();
        let mut ids = Vec::new();
        for tok in t["added_tokens"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let plain = flag(tok, "lstrip") == Some(false)
                && flag(tok, "rstrip") == Some(false)
                && flag(tok, "single_word") == Some(false)
                && flag(tok, "normalized") == Some(false);
            let (Some(content), Some(id)) = (tok["content"].as_str(), tok["id"].as_u64()) else {
                return Ok(None);
            };
            if !plain {
                return Ok(None);
            }
            patterns.push(content.to_owned());
            ids.push(u32::try_from(id).map_err(|e| BpeError::Added(e.to_string()))?);
        }
        let added = match patterns.is_empty() {
            true => None,
            false => Some((
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .map_err(|e| BpeError::Added(e.to_string()))?,
                ids,
            )),
        };
        let split = Splitter::new(&pattern)?;
        Ok(Some(FastBpe {
            merges,
            byte_ids,
            added,
            nfc,
            split,
            cache: RefCell::new(PieceCache::default()),
            cache_bytes: Cell::new(0),
            cache_limits: Cell::new((PIECE_CACHE_ENTRIES, PIECE_CACHE_BYTES)),
            hits: Cell::new(0),
            misses: Cell::new(0),
        }))
    }

    /// Token ids of `text`, without special tokens added around it (`add_special_tokens=false`;
    /// byte-level BPE tokenizers of this shape add none anyway).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        self.encode_into(text, &mut out);
        out
    }

    /// [`FastBpe::encode`], appending the ids to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        self.segments(text, |seg| match seg {
            Segment::Text(t) => self.encode_segment(t, out),
            Segment::Added(id) => out.push(id),
        });
    }

    /// Cuts `text` at added tokens (leftmost-longest), exactly where [`FastBpe::encode`] does,
    /// and calls `f` on each non-empty piece in order. Ids never depend on text across a cut.
    pub fn segments<'t>(&self, text: &'t str, mut f: impl FnMut(Segment<'t>)) {
        let mut at = 0;
        if let Some((ac, ids)) = &self.added {
            for m in ac.find_iter(text) {
                if m.start() > at {
                    f(Segment::Text(&text[at..m.start()]));
                }
                if let Some(id) = ids.get(m.pattern().as_usize()) {
                    f(Segment::Added(*id));
                }
                at = m.end();
            }
        }
        if at < text.len() {
            f(Segment::Text(&text[at..]));
        }
    }

    /// Appends the ids of a [`Segment::Text`] (text with no added token inside).
    pub fn encode_text_segment_into(&self, seg: &str, out: &mut Vec<u32>) {
        self.encode_segment(seg, out);
    }

    /// Forgets every cached piece (benchmarks use it to measure a cold encoder).
    pub fn clear_cache(&self) {
        self.cache.borrow_mut().clear();
        self.cache_bytes.set(0);
    }

    /// Bounds the per-piece cache: at most `entries` pieces and `bytes` bytes (piece bytes, 4 per
    /// id and a fixed per-entry overhead); it is emptied when a new piece would pass either.
    /// Zero for either disables it. Defaults: [`PIECE_CACHE_ENTRIES`], [`PIECE_CACHE_BYTES`].
    pub fn set_piece_cache_limits(&self, entries: usize, bytes: usize) {
        self.cache_limits.set((entries, bytes));
        self.clear_cache();
    }

    /// Cumulative `(hits, misses)` of the per-piece cache.
    pub fn piece_cache_stats(&self) -> (u64, u64) {
        (self.hits.get(), self.misses.get())
    }

    /// Whether the pre-tokenizer regex runs on the lookaround-free DFA path.
    pub fn splits_without_backtracking(&self) -> bool {
        matches!(self.split, Splitter::Dfa { .. })
    }

    fn encode_segment(&self, seg: &str, out: &mut Vec<u32>) {
        if seg.is_empty() {
            return;
        }
        // Text already in NFC (all ASCII, or a quick-check "yes") is its own normal form:
        // normalizing it would only copy it.
        if self.nfc && !seg.is_ascii() && is_nfc_quick(seg.chars()) != IsNormalized::Yes {
            let normalized: String = seg.nfc().map(|(c, _)| c).collect();
            self.split_and_merge(&normalized, out);
        } else {
            self.split_and_merge(seg, out);
        }
    }

    fn split_and_merge(&self, seg: &str, out: &mut Vec<u32>) {
        // Isolated split: matches become pieces, and so do the gaps between them.
        self.split.split(seg, |piece| self.piece(piece, out));
    }

    fn piece(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if bytes.is_empty() {
            return;
        }
        if let Some(ids) = self.cache.borrow().get(bytes) {
            out.extend_from_slice(ids);
            self.hits.set(self.hits.get() + 1);
            return;
        }
        self.misses.set(self.misses.get() + 1);
        let ids = self.merge(bytes);
        out.extend_from_slice(&ids);
        let (max_entries, max_bytes) = self.cache_limits.get();
        let size = bytes.len() + 4 * ids.len() + PIECE_ENTRY_OVERHEAD;
        if size > max_bytes || max_entries == 0 {
            return;
        }
        let mut cache = self.cache.borrow_mut();
        if cache.len() >= max_entries || self.cache_bytes.get() + size > max_bytes {
            cache.clear();
            self.cache_bytes.set(0);
        }
        self.cache_bytes.set(self.cache_bytes.get() + size);
        cache.insert(bytes.into(), ids.into_boxed_slice());
    }

    /// HF `Word::merge_all`: repeatedly merge the adjacent pair of lowest rank, leftmost on ties.
    fn merge(&self, bytes: &[u8]) -> Vec<u32> {
        let mut syms: Vec<u32> = bytes.iter().map(|&b| self.byte_ids[b as usize]).collect();
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(&(rank, id)) = self.merges.get(&(syms[i], syms[i + 1])) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, id));
                    }
                }
            }
            let Some((_, i, id)) = best else { break };
            syms[i] = id;
            syms.remove(i + 1);
        }
        syms
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_onto_printables() {
        let t = byte_level_chars();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(!c.is_control() && c != ' ', "{c:?}");
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }

    fn tiny() -> FastBpe {
        let json = serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "added_tokens": [{"id": 1000, "content": "<|x|>", "lstrip": false, "rstrip": false,
                              "single_word": false, "normalized": false, "special": true}],
            "model": {"type": "BPE", "dropout": null, "byte_fallback": false, "ignore_merges": false,
                      "vocab": byte_vocab(&["ab", "abc", "Ġab"]), "merges": ["a b", "ab c", "Ġ ab"]}
        });
        FastBpe::from_tokenizer_json(json.to_string().as_bytes())
            .ok()
            .flatten()
            .unwrap_or_else(|| unreachable!())
    }

    fn byte_vocab(extra: &[&str]) -> serde_json::Map<String, Value> {
        let mut v = serde_json::Map::new();
        for (i, c) in byte_level_chars().iter().enumerate() {
            v.insert(c.to_string(), Value::from(i));
        }
        for (i, e) in extra.iter().enumerate() {
            v.insert((*e).to_owned(), Value::from(256 + i));
        }
        v
    }

    #[test]
    fn merges_by_rank_and_splits_on_added_tokens() {
        let bpe = tiny();
        // "abc" -> a b c -> (ab) c -> abc; " ab" -> Ġ a b -> Ġ ab -> Ġab.
        assert_eq!(bpe.encode("abc ab"), vec![257, 258]);
        assert_eq!(bpe.encode("ab<|x|>c"), vec![256, 1000, u32::from(b'c')]);
        // Cached piece gives the same ids.
        assert_eq!(bpe.encode("abc ab"), vec![257, 258]);
        // The cuts: text around and between added tokens, nothing empty.
        let mut cuts = Vec::new();
        bpe.segments("<|x|>ab<|x|><|x|>c", |s| cuts.push(s));
        use Segment::{Added, Text};
        assert_eq!(
            cuts,
            [Added(1000), Text("ab"), Added(1000), Added(1000), Text("c")]
        );
    }

    /// The pieces `split` yields for `text`.
    fn pieces(split: &Splitter, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split.split(text, |p| out.push(String::from_utf8_lossy(p).into_owned()));
        out
    }

    #[test]
    fn dfa_split_equals_the_lookahead_regex() {
        const QWEN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        const GPT2: &str =
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
        // Characters that exercise every branch: ASCII and Unicode whitespace (incl. U+0085,
        // U+00A0, U+3000, VT, FF), newlines, letters, digits, marks, punctuation, contractions.
        const ALPHABET: &[&str] = &[
            " ", "  ", "\t", "\n", "\r", "\u{0B}", "\u{0C}", "\u{85}", "\u{a0}", "\u{3000}",
            "\u{2028}", "a", "Z", "é", "中", "ж", "1", "٣", "²", "!", "?.", "'s", "'LL", "-",
            "\u{301}", "🚀", "_", "\u{1c}",
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut texts: Vec<String> = vec![
            String::new(),
            " ".into(),
            "  ".into(),
            "a  b".into(),
            "a \u{a0}b".into(),
            "x   ".into(),
            "  \n  x".into(),
            "\t\tword".into(),
            "\u{3000}\u{3000}中".into(),
            "a\u{85}\u{85}b".into(),
            "123  456".into(),
            "foo!!  \n\n bar  ".into(),
        ];
        for _ in 0..3000 {
            let mut t = String::new();
            for _ in 0..(seed % 12) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                t.push_str(ALPHABET[(seed % ALPHABET.len() as u64) as usize]);
            }
            seed = seed.wrapping_add(0x632b_e59b_d9b4_e019);
            texts.push(t);
        }
        for pattern in [QWEN, LLAMA3, GPT2] {
            let dfa = Splitter::new(pattern).unwrap();
            assert!(matches!(dfa, Splitter::Dfa { .. }), "{pattern}");
            let fancy = Splitter::Fancy(fancy_regex::Regex::new(pattern).unwrap());
            for t in &texts {
                assert_eq!(pieces(&dfa, t), pieces(&fancy, t), "{pattern} on {t:?}");
            }
        }
        // A pattern with other lookaround keeps the backtracking engine.
        assert!(matches!(
            Splitter::new(r"a(?=b)|\s+(?!\S)|\s+").unwrap(),
            Splitter::Fancy(_)
        ));
    }

    #[test]
    fn piece_cache_is_bounded_and_counted() {
        let bpe = tiny();
        bpe.set_piece_cache_limits(2, 1 << 20);
        // Pieces "abc", " abc", " abc" (a hit), " x" (the cache is full: emptied first).
        let _ = bpe.encode("abc abc abc x");
        assert_eq!(bpe.piece_cache_stats(), (1, 3));
        assert_eq!(bpe.cache.borrow().len(), 1);
        bpe.set_piece_cache_limits(0, 0);
        assert_eq!(bpe.encode("abc ab"), vec![257, 258]);
        assert!(bpe.cache.borrow().is_empty());
    }

    #[test]
    fn unsupported_shapes_fall_back() {
        let json =
            serde_json::json!({"normalizer": {"type": "NFKC"}, "pre_tokenizer": null, "model": {}});
        assert!(matches!(
            FastBpe::from_tokenizer_json(json.to_string().as_bytes()),
            Ok(None)
        ));
    }
}
