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
//! Step 4 is O(L log L) in the piece's length L: a linked list of symbols and a min-heap of
//! candidate pairs keyed `(rank, position)` (the argument that this merges in exactly the order of
//! the rescan-every-step definition is on [`FastBpe::merge`]). One run of letters is one piece,
//! so a quadratic merge would let one long word hold the encoder for seconds.
//!
//! [`FastBpe::encode_prefix`] bounds the work of one encode ([`PrefixCap`]): it stops once the cap's
//! token count is reached, cutting only between pieces, so every id it returns is the id the full
//! encode has at that position; and it stops before a piece longer than
//! [`MAX_PIECE_BYTES`] instead of merging it (a piece's ids depend on all of its bytes, so no
//! prefix of such a piece can be encoded exactly without merging all of it). It says why it
//! stopped ([`Truncation`]).
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
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::ops::ControlFlow;

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

/// Pre-token bytes -> their token ids. A piece of at most [`SHORT_PIECE`] bytes (most words
/// of prose, with their leading space) is keyed by its bytes packed into one integer and keeps
/// its ids inline: a hit hashes and compares one integer and follows no pointer. Longer pieces
/// are keyed by their bytes. Exact either way: the packed key holds every byte and the length.
#[derive(Default)]
struct PieceCache {
    short: FastMap<u64, ShortIds>,
    long: FastMap<Box<[u8]>, Box<[u32]>>,
}

/// The longest piece kept in [`PieceCache`]'s packed map.
const SHORT_PIECE: usize = 7;

/// The ids of a piece of at most [`SHORT_PIECE`] bytes (BPE gives at most one id per byte).
#[derive(Clone, Copy)]
struct ShortIds {
    len: u8,
    ids: [u32; SHORT_PIECE],
}

impl PieceCache {
    /// The bytes of a short piece and its length in one integer (distinct pieces, distinct keys).
    fn packed(bytes: &[u8]) -> Option<u64> {
        let n = bytes.len();
        if n > SHORT_PIECE {
            return None;
        }
        let mut word = [0u8; 8];
        word.get_mut(..n)?.copy_from_slice(bytes);
        word[7] = n as u8;
        Some(u64::from_le_bytes(word))
    }

    /// Appends the cached ids of `bytes` to `out`; false when it is not cached.
    fn extend(&self, bytes: &[u8], out: &mut Vec<u32>) -> bool {
        let ids = match Self::packed(bytes) {
            Some(key) => self
                .short
                .get(&key)
                .and_then(|s| s.ids.get(..usize::from(s.len))),
            None => self.long.get(bytes).map(|ids| &ids[..]),
        };
        ids.map(|ids| out.extend_from_slice(ids)).is_some()
    }

    fn insert(&mut self, bytes: &[u8], ids: &[u32]) {
        let Some(key) = Self::packed(bytes) else {
            self.long.insert(bytes.into(), ids.into());
            return;
        };
        let mut short = ShortIds {
            len: ids.len() as u8,
            ids: [0; SHORT_PIECE],
        };
        // At most one id per byte, so a short piece's ids always fit.
        if let Some(slot) = short.ids.get_mut(..ids.len()) {
            slot.copy_from_slice(ids);
            self.short.insert(key, short);
        }
    }

    fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }

    fn clear(&mut self) {
        self.short.clear();
        self.long.clear();
    }
}

/// Default bound on distinct pieces kept in the per-encoder cache (it is emptied when full).
pub const PIECE_CACHE_ENTRIES: usize = 200_000;
/// Default bound on the cache's bytes (piece bytes + 4 per id + a per-entry overhead).
pub const PIECE_CACHE_BYTES: usize = 16 << 20;
/// Bytes charged per cache entry besides its key and ids (two boxed slices and the table slot).
const PIECE_ENTRY_OVERHEAD: usize = 48;

/// Default bound on one pre-token piece in [`PrefixCap::tokens`]: 8 KiB. Pieces of ordinary
/// text are words, numbers, punctuation and whitespace runs (tens of bytes; a long CJK clause a
/// few hundred; HF itself caches only words under 256 characters), so 8 KiB is far above any
/// piece worth routing on, and merging one costs well under a millisecond.
pub const MAX_PIECE_BYTES: usize = 8 << 10;

/// Default number of prompt ids routed on (the filter's `max_prefix_tokens`, the service's
/// `KVROUTE_MAX_PREFIX_TOKENS`): 1024 blocks of 16 tokens. Endpoints that all hold a prompt's
/// first 16384 tokens are not told apart by the rest, and a cold encode of that many costs the
/// filter's Wasm VM tens of milliseconds at most (ENVOY.md: ~16 ms per 7.4k tokens with HF).
pub const MAX_PREFIX_TOKENS: usize = 16_384;
/// Largest allowed cap: about the filter's default `max_body_bytes` (4 MiB) of text.
pub const MAX_PREFIX_TOKENS_LIMIT: usize = 1 << 20;

/// Bounds on the work of one [`FastBpe::encode_prefix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixCap {
    /// Most ids returned: the first `max_tokens` ids of the full encode.
    pub max_tokens: usize,
    /// A piece longer than this (in bytes) is not merged: the encode stops before it.
    pub max_piece_bytes: usize,
}

impl PrefixCap {
    /// No bound: the full encode.
    pub const NONE: PrefixCap = PrefixCap {
        max_tokens: usize::MAX,
        max_piece_bytes: usize::MAX,
    };

    /// At most `max_tokens` ids, pieces up to [`MAX_PIECE_BYTES`].
    pub const fn tokens(max_tokens: usize) -> PrefixCap {
        PrefixCap {
            max_tokens,
            max_piece_bytes: MAX_PIECE_BYTES,
        }
    }
}

/// Why the ids of a prompt stop before its end: a bound of a [`PrefixCap`], or a media item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// The cap's token count was reached.
    MaxTokens,
    /// A piece longer than the cap's piece bound came next; the ids stop before it.
    LongPiece,
    /// A chat message holds a media part (image, audio, video, prompt embeddings): the ids are
    /// those of the text before its placeholder, less the last one (whose piece the
    /// placeholder may change), so every full block of them is hashed as the engine hashes it.
    Media,
}

impl Truncation {
    /// Every case, in counter order.
    pub const ALL: [Truncation; 3] = [
        Truncation::MaxTokens,
        Truncation::LongPiece,
        Truncation::Media,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Truncation::MaxTokens => "max_tokens",
            Truncation::LongPiece => "long_piece",
            Truncation::Media => "media",
        }
    }
}

/// The tail of every byte-level BPE pattern: the pattern's only lookaround.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// The heads (the pattern less [`LOOKAHEAD_TAIL`]) the ASCII path knows, with the longest digit
/// run each takes as one piece: Qwen2 and Qwen3 (`\p{N}`), Llama 3 and cl100k (`\p{N}{1,3}`).
const ASCII_HEADS: [(&str, usize); 2] = [
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
        1,
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
        3,
    ),
];

/// What the pattern's classes say of one byte.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`: A-Z, a-z.
    Letter,
    /// `\p{N}`: 0-9.
    Digit,
    /// `[\r\n]`.
    Newline,
    /// The rest of `\s` in ASCII: space, tab, VT, FF.
    Space,
    /// Every other ASCII byte (punctuation and controls): outside `\s`, `\p{L}` and `\p{N}`.
    Other,
    /// A byte of a non-ASCII character, which may be a letter, a digit, whitespace or none.
    Wide,
}

fn class(b: u8) -> Class {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b'\r' | b'\n' => Class::Newline,
        b' ' | b'\t' | 0x0b | 0x0c => Class::Space,
        0x80..=0xff => Class::Wide,
        _ => Class::Other,
    }
}

/// The ASCII path of the byte-level patterns of [`ASCII_HEADS`]: where the piece the whole pattern
/// (its lookahead tail included) matches at a position ends, decided from ASCII bytes alone.
/// A position whose piece depends on a non-ASCII character gets `None` and goes to the regex.
/// The branches are tried in the pattern's order, as its leftmost-first alternation does.
#[derive(Clone, Copy, Debug)]
struct AsciiSplit {
    /// Digits in one piece at most (`\p{N}` is 1, `\p{N}{1,3}` is 3).
    max_digits: usize,
}

impl AsciiSplit {
    fn for_head(head: &str) -> Option<AsciiSplit> {
        ASCII_HEADS
            .iter()
            .find(|(h, _)| *h == head)
            .map(|&(_, max_digits)| AsciiSplit { max_digits })
    }

    /// The end of the piece starting at `at` (`at < bytes.len()`), or `None`.
    fn piece_end(self, bytes: &[u8], at: usize) -> Option<usize> {
        let cls = |i: usize| bytes.get(i).map(|&b| class(b));
        let first = cls(at)?;
        let next = cls(at + 1);
        if first == Class::Wide {
            return None;
        }
        // Below, every run that meets a non-ASCII character gives up (it may be a letter, a
        // digit, whitespace or punctuation that continues the run, or after an apostrophe the
        // long s a case-insensitive `'s` matches).
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if bytes[at] == b'\'' {
            let lower = |i: usize| bytes.get(at + i).map(u8::to_ascii_lowercase);
            match (lower(1), lower(2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return Some(at + 2),
                (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return Some(at + 3),
                _ => {}
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        match (first, next) {
            (Class::Other | Class::Space, Some(Class::Letter)) => {
                return self.run_end(bytes, at + 1, Class::Letter)
            }
            (Class::Letter, _) => return self.run_end(bytes, at, Class::Letter),
            _ => {}
        }
        // \p{N} or \p{N}{1,3}
        if first == Class::Digit {
            let mut end = at + 1;
            while end < at + self.max_digits {
                match cls(end) {
                    Some(Class::Digit) => end += 1,
                    Some(Class::Wide) => return None,
                    _ => break,
                }
            }
            return Some(end);
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let punct = match (bytes[at], first, next) {
            (b' ', _, Some(Class::Other)) => Some(at + 1),
            (_, Class::Other, _) => Some(at),
            _ => None,
        };
        if let Some(start) = punct {
            let mut end = self.run_end(bytes, start, Class::Other)?;
            while cls(end) == Some(Class::Newline) {
                end += 1;
            }
            return Some(end);
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+ : `first` is whitespace here.
        let mut end = at;
        let mut last_newline = None;
        loop {
            match cls(end) {
                Some(Class::Newline) => last_newline = Some(end),
                Some(Class::Space) => {}
                Some(Class::Wide) => return None,
                _ => break,
            }
            end += 1;
        }
        if let Some(nl) = last_newline {
            return Some(nl + 1);
        }
        if end == bytes.len() || end - at == 1 {
            return Some(end);
        }
        // Followed by a non-space: the run's last whitespace starts the next piece.
        Some(end - 1)
    }

    /// The end of the run of `want` bytes from `from`; `None` when a non-ASCII character
    /// follows it (it may continue the run).
    fn run_end(self, bytes: &[u8], from: usize, want: Class) -> Option<usize> {
        let mut end = from;
        loop {
            match bytes.get(end).map(|&b| class(b)) {
                Some(c) if c == want => end += 1,
                Some(Class::Wide) => return None,
                _ => return Some(end),
            }
        }
    }
}

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
///
/// For Qwen's and Llama 3's patterns, `Dfa` first asks [`AsciiSplit`] for the piece at each
/// position (plain byte tests where ASCII decides it, no regex call) and runs the regex only
/// where a non-ASCII character may change the piece.
enum Splitter {
    Dfa {
        all: meta::Regex,
        head: meta::Regex,
        /// The ASCII path, for the patterns it knows.
        ascii: Option<AsciiSplit>,
    },
    Fancy(fancy_regex::Regex),
}

impl Splitter {
    fn new(pattern: &str) -> Result<Splitter, BpeError> {
        if let Some(head) = pattern.strip_suffix(LOOKAHEAD_TAIL) {
            let all = meta::Regex::new(&format!(r"(?:{head})|\s+"));
            let head_re = meta::Regex::new(&format!("(?:{head})"));
            if let (Ok(all), Ok(head_re)) = (all, head_re) {
                return Ok(Splitter::Dfa {
                    all,
                    head: head_re,
                    ascii: AsciiSplit::for_head(head),
                });
            }
        }
        fancy_regex::Regex::new(pattern)
            .map(Splitter::Fancy)
            .map_err(|e| BpeError::Regex(e.to_string()))
    }

    /// Calls `piece` for every match and every gap between matches, in order (`Isolated`),
    /// until it breaks. The pieces are found left to right, so stopping early costs nothing
    /// past the last piece taken.
    fn split(&self, seg: &str, mut piece: impl FnMut(&[u8]) -> ControlFlow<()>) -> ControlFlow<()> {
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
                        piece(&bytes[at..m.start()])?;
                    }
                    piece(m.as_str().as_bytes())?;
                    at = m.end();
                }
            }
            Splitter::Dfa { all, head, ascii } => {
                let mut pos = 0;
                while pos < bytes.len() {
                    if let Some(end) = ascii.and_then(|a| a.piece_end(bytes, pos)) {
                        if pos > at {
                            piece(&bytes[at..pos])?;
                        }
                        piece(&bytes[pos..end])?;
                        at = end;
                        pos = end;
                        continue;
                    }
                    // The byte-level patterns match every character, so the next match nearly
                    // always starts where the last ended: an anchored search there finds it
                    // without the reverse scan an unanchored one needs for the start. A match
                    // starting at `pos` is the leftmost one, and among matches starting there
                    // the anchored search picks the one the unanchored search would.
                    let here = Input::new(seg).range(pos..).anchored(Anchored::Yes);
                    let found = all
                        .search(&here)
                        .or_else(|| all.search(&Input::new(seg).range(pos..)));
                    let Some(m) = found else {
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
                        piece(&bytes[at..start])?;
                    }
                    piece(&bytes[start..end])?;
                    at = end;
                    pos = end;
                }
            }
        }
        if at < bytes.len() {
            piece(&bytes[at..])?;
        }
        ControlFlow::Continue(())
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
    /// Buffers of [`FastBpe::merge`], kept between pieces.
    scratch: RefCell<MergeScratch>,
}

/// No neighbour (a symbol index past every piece: pieces are bounded by the body size).
const NO_SYM: u32 = u32::MAX;

/// One symbol of a piece being merged: its id and its live neighbours.
#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
    /// False once merged into its left neighbour.
    alive: bool,
}

/// The symbol list and the candidate heap of [`FastBpe::merge`], reused across pieces.
#[derive(Default)]
struct MergeScratch {
    syms: Vec<Sym>,
    /// `Reverse((rank << 32) | left position)`: the lowest rank first, then the leftmost.
    heap: BinaryHeap<Reverse<u64>>,
}

/// Drops the ids past `max_tokens` (the last piece taken may pass it) and says whether any ids
/// are missing: `stop` when the encode stopped early, else `MaxTokens` when ids were dropped.
pub(crate) fn cut_to(
    out: &mut Vec<u32>,
    max_tokens: usize,
    stop: Option<Truncation>,
) -> Option<Truncation> {
    if out.len() > max_tokens {
        out.truncate(max_tokens);
        return stop.or(Some(Truncation::MaxTokens));
    }
    stop
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
                    // A pair listed twice takes its last rank, as HF's map (collected in order) does.
                    merges.insert((ia, ib), (rank as u32, ij));
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
            scratch: RefCell::new(MergeScratch::default()),
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
        let _ = self.segments(text, |seg| {
            match seg {
                Segment::Text(t) => {
                    let _ = self.encode_segment(t, PrefixCap::NONE, out);
                }
                Segment::Added(id) => out.push(id),
            }
            ControlFlow::Continue(())
        });
    }

    /// The first ids of `text` under `cap`: exactly the first `min(cap.max_tokens, n)` of
    /// [`FastBpe::encode`]'s `n` ids, unless a piece longer than `cap.max_piece_bytes` comes
    /// first (then the ids before it), and why ids are missing (`None`: none are). Splitting and
    /// merging stop at the first piece not needed, so the cost is bounded by the cap, not the
    /// text (NFC normalisation, when the tokenizer declares it, still reads a whole segment).
    pub fn encode_prefix(&self, text: &str, cap: PrefixCap) -> (Vec<u32>, Option<Truncation>) {
        let mut out = Vec::with_capacity(text.len().min(cap.max_tokens.saturating_mul(4)) / 3 + 8);
        let mut stop = None;
        let _ = self.segments(text, |seg| {
            if out.len() >= cap.max_tokens {
                stop = Some(Truncation::MaxTokens);
                return ControlFlow::Break(());
            }
            match seg {
                Segment::Text(t) => {
                    stop = self.encode_segment(t, cap, &mut out);
                    if stop.is_some() {
                        return ControlFlow::Break(());
                    }
                }
                Segment::Added(id) => out.push(id),
            }
            ControlFlow::Continue(())
        });
        let stop = cut_to(&mut out, cap.max_tokens, stop);
        (out, stop)
    }

    /// Cuts `text` at added tokens (leftmost-longest), exactly where [`FastBpe::encode`] does,
    /// and calls `f` on each non-empty piece in order until it breaks. Ids never depend on text
    /// across a cut.
    pub fn segments<'t>(
        &self,
        text: &'t str,
        mut f: impl FnMut(Segment<'t>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let mut at = 0;
        if let Some((ac, ids)) = &self.added {
            for m in ac.find_iter(text) {
                if m.start() > at {
                    f(Segment::Text(&text[at..m.start()]))?;
                }
                if let Some(id) = ids.get(m.pattern().as_usize()) {
                    f(Segment::Added(*id))?;
                }
                at = m.end();
            }
        }
        if at < text.len() {
            f(Segment::Text(&text[at..]))?;
        }
        ControlFlow::Continue(())
    }

    /// Appends the ids of a [`Segment::Text`] (text with no added token inside).
    pub fn encode_text_segment_into(&self, seg: &str, out: &mut Vec<u32>) {
        let _ = self.encode_segment(seg, PrefixCap::NONE, out);
    }

    /// [`FastBpe::encode_text_segment_into`] under `cap`, whose token count includes the ids
    /// already in `out`: appends the segment's pieces while `out` holds fewer than
    /// `cap.max_tokens` ids (the last piece may pass it; the caller cuts), and stops before a
    /// piece longer than `cap.max_piece_bytes`. `Some` when it stopped before the segment's end.
    pub fn encode_text_segment_prefix_into(
        &self,
        seg: &str,
        cap: PrefixCap,
        out: &mut Vec<u32>,
    ) -> Option<Truncation> {
        self.encode_segment(seg, cap, out)
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

    fn encode_segment(&self, seg: &str, cap: PrefixCap, out: &mut Vec<u32>) -> Option<Truncation> {
        if seg.is_empty() {
            return None;
        }
        // Text already in NFC (all ASCII, or a quick-check "yes") is its own normal form:
        // normalizing it would only copy it.
        if self.nfc && !seg.is_ascii() && is_nfc_quick(seg.chars()) != IsNormalized::Yes {
            let normalized: String = seg.nfc().map(|(c, _)| c).collect();
            self.split_and_merge(&normalized, cap, out)
        } else {
            self.split_and_merge(seg, cap, out)
        }
    }

    fn split_and_merge(&self, seg: &str, cap: PrefixCap, out: &mut Vec<u32>) -> Option<Truncation> {
        // Isolated split: matches become pieces, and so do the gaps between them.
        let mut stop = None;
        let _ = self.split.split(seg, |piece| {
            if out.len() >= cap.max_tokens {
                stop = Some(Truncation::MaxTokens);
            } else if piece.len() > cap.max_piece_bytes {
                stop = Some(Truncation::LongPiece);
            } else {
                self.piece(piece, out);
                return ControlFlow::Continue(());
            }
            ControlFlow::Break(())
        });
        stop
    }

    fn piece(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if bytes.is_empty() {
            return;
        }
        if self.cache.borrow().extend(bytes, out) {
            self.hits.set(self.hits.get() + 1);
            return;
        }
        self.misses.set(self.misses.get() + 1);
        let start = out.len();
        self.merge(bytes, out);
        let ids = out.get(start..).unwrap_or(&[]);
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
        cache.insert(bytes, ids);
    }

    /// Appends the ids of one piece: HF `Word::merge_all`, the adjacent pair of lowest rank
    /// merged first, the leftmost among equal ranks, until no adjacent pair has a merge.
    ///
    /// Symbols stay in place (a merge keeps the left one and unlinks the right one), so a
    /// symbol's index orders it among the live ones. The heap holds an entry `(rank, left
    /// index)` for every adjacent live pair with a merge (pushed when the pair forms), plus stale
    /// ones. An entry is live iff its left symbol is alive, has a right neighbour, and that pair's
    /// merge has this rank (a rank names one pair); a stale entry is skipped. So each pop of a
    /// live entry is the minimum `(rank, index)` over the current pairs: the pair the
    /// rescan-every-step definition (`merge_reference` in the tests) picks. HF orders its queue
    /// the same way (`Merge::cmp`: rank, then position). O(L log L) for L bytes.
    fn merge(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let Ok(len) = u32::try_from(bytes.len()) else {
            return;
        };
        if len == 1 {
            out.push(self.byte_ids[bytes[0] as usize]);
            return;
        }
        let mut scratch = self.scratch.borrow_mut();
        let MergeScratch { syms, heap } = &mut *scratch;
        syms.clear();
        heap.clear();
        syms.extend(bytes.iter().zip(0u32..).map(|(&b, i)| Sym {
            id: self.byte_ids[b as usize],
            prev: if i == 0 { NO_SYM } else { i - 1 },
            next: if i + 1 == len { NO_SYM } else { i + 1 },
            alive: true,
        }));
        let key = |rank: u32, pos: u32| Reverse((u64::from(rank) << 32) | u64::from(pos));
        for (pos, pair) in (0u32..).zip(syms.windows(2)) {
            if let Some(&(rank, _)) = self.merges.get(&(pair[0].id, pair[1].id)) {
                heap.push(key(rank, pos));
            }
        }
        while let Some(Reverse(top)) = heap.pop() {
            let (rank, pos) = ((top >> 32) as u32, top as u32 as usize);
            let Some(&left) = syms.get(pos) else { continue };
            let Some(&right) = syms.get(left.next as usize) else {
                continue;
            };
            if !left.alive {
                continue;
            }
            let Some(&(r, merged)) = self.merges.get(&(left.id, right.id)) else {
                continue;
            };
            if r != rank {
                continue;
            }
            let next = right.next;
            if let Some(s) = syms.get_mut(left.next as usize) {
                s.alive = false;
            }
            if let Some(s) = syms.get_mut(pos) {
                s.id = merged;
                s.next = next;
            }
            if let Some(s) = syms.get_mut(next as usize) {
                s.prev = pos as u32;
                if let Some(&(r, _)) = self.merges.get(&(merged, s.id)) {
                    heap.push(key(r, pos as u32));
                }
            }
            if let Some(p) = syms.get(left.prev as usize) {
                if let Some(&(r, _)) = self.merges.get(&(p.id, merged)) {
                    heap.push(key(r, left.prev));
                }
            }
        }
        let mut at = 0usize;
        while let Some(s) = syms.get(at) {
            out.push(s.id);
            at = s.next as usize;
        }
    }

    /// The rescan-every-step definition [`FastBpe::merge`] must equal (O(L^2)): find the
    /// lowest-rank adjacent pair, leftmost on ties, merge it, repeat.
    #[cfg(test)]
    fn merge_reference(&self, bytes: &[u8]) -> Vec<u32> {
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
        let _ = bpe.segments("<|x|>ab<|x|><|x|>c", |s| {
            cuts.push(s);
            ControlFlow::Continue(())
        });
        use Segment::{Added, Text};
        assert_eq!(
            cuts,
            [Added(1000), Text("ab"), Added(1000), Added(1000), Text("c")]
        );
    }

    /// The pieces `split` yields for `text`.
    fn pieces(split: &Splitter, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let _ = split.split(text, |p| {
            out.push(String::from_utf8_lossy(p).into_owned());
            ControlFlow::Continue(())
        });
        out
    }

    /// The DFA split (with the ASCII path for Qwen's and Llama 3's patterns) yields the pieces
    /// the backtracking engine yields for the original pattern.
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
            "\u{301}", "🚀", "_", "\u{1c}", "'", "'re", "'Ve", "'r", "'x", ",", " ,", "\r\n",
            "\u{7f}", "\u{0}", "ſ", "'ſ", "\u{212a}", "123", "4567", " '", "a'", "1a", " 9", "'d",
            "'M", "'T", "'ll", "'S",
        ];
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
        let mut next = rng(0x9e37_79b9_7f4a_7c15);
        // Up to `parts` alphabet entries per text; with `mostly_ascii` (the ASCII path's ground)
        // a non-ASCII entry is kept one time in eight, else replaced by a space.
        let mut generate = |count: usize, parts: u64, mostly_ascii: bool| {
            for _ in 0..count {
                let mut t = String::new();
                for _ in 0..next() % parts {
                    let r = next();
                    let part = ALPHABET[(r >> 8) as usize % ALPHABET.len()];
                    let keep = !mostly_ascii || part.is_ascii() || r % 8 == 0;
                    t.push_str(if keep { part } else { " " });
                }
                texts.push(t);
            }
        };
        generate(3000, 12, false);
        generate(3000, 40, true);
        for (pattern, ascii_digits) in [(QWEN, Some(1)), (LLAMA3, Some(3)), (GPT2, None)] {
            let dfa = Splitter::new(pattern).unwrap();
            let Splitter::Dfa { ascii, .. } = &dfa else {
                panic!("{pattern} runs on the backtracking engine");
            };
            assert_eq!(ascii.map(|a| a.max_digits), ascii_digits, "{pattern}");
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
        assert_eq!(bpe.cache.borrow().len(), 0);
    }

    /// Pieces of up to 7 bytes (the packed map) and longer ones (keyed by their bytes) are
    /// served from the cache with the ids an uncached encode gives, and pieces that differ only
    /// past a short one's length, or by length, are told apart.
    #[test]
    fn short_and_long_pieces_are_cached_exactly() {
        let bpe = tiny();
        let text = "ab abcab abcabc abcabca abcabcab a\0 a\0\0 abc abcabc abcabca";
        bpe.set_piece_cache_limits(0, 0);
        let uncached = bpe.encode(text);
        bpe.set_piece_cache_limits(1000, 1 << 20);
        assert_eq!(bpe.encode(text), uncached);
        let (hits, misses) = bpe.piece_cache_stats();
        assert_eq!(bpe.encode(text), uncached);
        let (hits2, misses2) = bpe.piece_cache_stats();
        assert_eq!(misses2, misses, "every piece cached after one encode");
        assert_eq!(hits2 - hits, 12, "each of the 12 pieces a hit");
        let cache = bpe.cache.borrow();
        assert!(!cache.short.is_empty() && !cache.long.is_empty());
        assert_eq!(cache.len(), 9, "distinct pieces");
    }

    /// xorshift64: deterministic pseudo-random numbers for the property tests.
    fn rng(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// A random byte-level BPE over the letters `a..=e`: merges of random pairs of existing
    /// tokens, some of whose results already exist (so one token is reachable by several merge
    /// orders, the case where stale heap entries and ties matter). The tokenizer.json text.
    fn random_bpe(seed: u64, merges: usize) -> String {
        let mut next = rng(seed);
        let mut tokens: Vec<String> = ('a'..='e').map(String::from).collect();
        let mut extra: Vec<String> = Vec::new();
        let mut list: Vec<String> = Vec::new();
        let mut pairs = std::collections::HashSet::new();
        while list.len() < merges {
            let a = tokens[(next() % tokens.len() as u64) as usize].clone();
            let b = tokens[(next() % tokens.len() as u64) as usize].clone();
            if a.len() + b.len() > 12 || !pairs.insert((a.clone(), b.clone())) {
                continue;
            }
            let joined = format!("{a}{b}");
            if !tokens.contains(&joined) {
                tokens.push(joined.clone());
                extra.push(joined);
            }
            list.push(format!("{a} {b}"));
        }
        let refs: Vec<&str> = extra.iter().map(String::as_str).collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": byte_vocab(&refs), "merges": list}
        })
        .to_string()
    }

    /// The heap merge equals the rescan-every-step definition and HF tokenizers on random
    /// vocabularies and random words (long ones and runs of one letter included).
    #[test]
    fn heap_merge_equals_reference_and_hf_on_random_vocabularies() {
        let mut next = rng(0x2545_f491_4f6c_dd1d);
        let mut checked = 0;
        for v in 0..24u64 {
            let json = random_bpe(v + 1, 20 + (v as usize * 7) % 90);
            let bpe = FastBpe::from_tokenizer_json(json.as_bytes())
                .unwrap()
                .unwrap();
            let hf = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
            for w in 0..60 {
                let len = match w % 4 {
                    0 => 1 + (next() % 8) as usize,
                    1 => 1 + (next() % 64) as usize,
                    2 => 200 + (next() % 800) as usize,
                    _ => 1 + (next() % 300) as usize,
                };
                let word: String = match w % 10 {
                    // Runs of one letter and of a repeated short pattern.
                    9 => "a".repeat(len),
                    8 => "ab".repeat(len / 2 + 1),
                    _ => (0..len)
                        .map(|_| char::from(b'a' + (next() % 5) as u8))
                        .collect(),
                };
                let mut heap = Vec::new();
                bpe.merge(word.as_bytes(), &mut heap);
                assert_eq!(
                    heap,
                    bpe.merge_reference(word.as_bytes()),
                    "vocab {v} word {word:?}"
                );
                let want = hf.encode(word.as_str(), false).unwrap().get_ids().to_vec();
                assert_eq!(heap, want, "vocab {v} word {word:?} against HF");
                checked += 1;
            }
        }
        assert_eq!(checked, 24 * 60);
    }

    /// A merge pair listed twice takes the rank HF gives it.
    #[test]
    fn duplicate_merge_pairs_rank_as_hf() {
        let json = serde_json::json!({
            "version": "1.0", "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "byte_fallback": false, "ignore_merges": false,
                      "vocab": byte_vocab(&["ab", "bc"]), "merges": ["a b", "b c", "a b"]}
        })
        .to_string();
        let bpe = FastBpe::from_tokenizer_json(json.as_bytes())
            .unwrap()
            .unwrap();
        let hf = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let want = hf.encode("abc", false).unwrap().get_ids().to_vec();
        assert_eq!(bpe.encode("abc"), want);
    }

    #[test]
    fn prefix_cap_cuts_between_pieces_and_before_long_pieces() {
        let bpe = tiny();
        let full = bpe.encode("abc ab abc ab x");
        assert_eq!(full.len(), 7, "{full:?}");
        for n in 0..=full.len() + 1 {
            let (ids, why) = bpe.encode_prefix("abc ab abc ab x", PrefixCap::tokens(n));
            assert_eq!(ids, full[..n.min(full.len())], "cap {n}");
            let want = (n < full.len()).then_some(Truncation::MaxTokens);
            assert_eq!(why, want, "cap {n}");
        }
        // A piece longer than the bound is not merged: the ids stop before it.
        let cap = PrefixCap {
            max_tokens: 100,
            max_piece_bytes: 4,
        };
        let (ids, why) = bpe.encode_prefix("abc ab<|x|> abcabc ab", cap);
        assert_eq!(ids, vec![257, 258, 1000]);
        assert_eq!(why, Some(Truncation::LongPiece));
        // Exactly at the bound is merged.
        assert_eq!(
            bpe.encode_prefix("abca", cap),
            (vec![257, u32::from(b'a')], None)
        );
        assert_eq!(bpe.encode_prefix("", cap), (vec![], None));
        assert_eq!(
            bpe.encode_prefix("abc ab", PrefixCap::NONE),
            (bpe.encode("abc ab"), None)
        );
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
