//! The tree decoder [`super::decode::decode_batch`] replaced: the whole payload read into an
//! `rmpv::Value`, then interpreted. Kept as the reference the streaming decoder is checked
//! against (the unit tests in `decode` and the `zmq_events` fuzz target assert equal results on
//! every input); not used on the ingest path.

use rmpv::Value;

use super::decode::{BytesKey, DecodeError, EventBatch, GroupKind, KvEvent, Medium, Skip, Stored};

fn medium(v: Option<&Value>) -> Medium {
    Medium::from_name(v.and_then(Value::as_str))
}

fn kind(v: Option<&Value>) -> Option<GroupKind> {
    GroupKind::from_name(v?.as_str()?)
}

/// `group_idx` when present and a small non-negative integer.
fn group(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

/// Decodes one msgpack payload through an `rmpv::Value` tree.
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
                medium: medium(f("medium")),
                has_lora,
                has_extra_keys,
                cache_salt: f("cache_salt").and_then(Value::as_str).map(str::to_owned),
                group: group(f("group_idx")),
                kind: kind(f("kv_cache_spec_kind")),
            }))
        }
        "BlockRemoved" => Ok(KvEvent::Removed {
            block_hashes: f("block_hashes")
                .and_then(|v| keys(v, bk))
                .ok_or(Skip::BadKeys)?,
            medium: medium(f("medium")),
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
