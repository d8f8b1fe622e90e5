//! KV-cache events as the engines put them on the wire.
//!
//! The cache ([`crate::kv`]) records engine-neutral [`KvEvent`]s; this module writes them the way
//! each engine does:
//! * vLLM and SGLang: one msgpack `EventBatch` per scheduler step, `[ts, [events...], dp_rank]`,
//!   events as maps with `"type"` first, byte-identical to msgspec's output (the golden vectors in
//!   `shared/tests/vectors/` prove it in `tests/wire.rs`).
//! * TensorRT-LLM: JSON envelopes `{event_id, data, window_size}` returned by `POST /kv_cache_events`.
//! * vLLM's CPU tier (KV offloading): what its offloading connector publishes by default, one
//!   placeholder `BlockStored` per block written (key, `medium` `"CPU"`, no tokens, no parent,
//!   `block_size` 0, `group_idx`) and one `BlockRemoved` per eviction batch (`medium` `"CPU"`).
//!
//! msgspec details reproduced here because a byte-exact payload is the proof that the simulator
//! speaks the real protocol: integers take their smallest msgpack form (non-negative ones as
//! unsigned), vLLM's `BlockStored` struct has more than 15 fields so msgspec always writes a map16
//! header for it, fields whose value is the declared default are omitted (`omit_defaults`).

use kvroute_core::hash::BlockKey;
use serde_json::{json, Value};

/// One cache event, engine-neutral.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks became cached. `keys[i]` holds `token_ids[i*bs..(i+1)*bs]`.
    Stored {
        /// Keys of the newly cached blocks, in sequence order.
        keys: Vec<BlockKey>,
        /// Key of the block before `keys[0]` in its sequence (`None` for a prompt's first block).
        parent: Option<BlockKey>,
        /// The blocks' tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The request's `cache_salt`: vLLM puts `[salt]` in the first block's `extra_keys`,
        /// SGLang adds a `cache_salt` field.
        salt: Option<String>,
        /// vLLM: per block (empty: none in this run), the media items it overlaps as vLLM puts
        /// them in `extra_keys`: `(identifier, item offset minus the block's first position)`.
        media: Vec<Vec<(String, i64)>>,
    },
    /// Cached blocks were evicted.
    Removed {
        /// Keys of the evicted blocks.
        keys: Vec<BlockKey>,
    },
    /// The whole cache was reset (prefix-cache reset, SGLang start).
    Cleared,
    /// vLLM KV offloading: blocks written to the CPU tier. Published as vLLM's offloading
    /// connector does by default: one placeholder `BlockStored` per block, `medium` `"CPU"`,
    /// no tokens, no parent, `block_size` 0.
    CpuStored {
        /// Keys of the blocks written, in sequence order.
        keys: Vec<BlockKey>,
    },
    /// vLLM KV offloading: blocks evicted from the CPU tier (`BlockRemoved`, `medium` `"CPU"`).
    CpuRemoved {
        /// Keys of the evicted blocks.
        keys: Vec<BlockKey>,
    },
}

impl KvEvent {
    /// Whether the event is about the CPU tier rather than the GPU cache.
    pub fn is_cpu(&self) -> bool {
        matches!(self, KvEvent::CpuStored { .. } | KvEvent::CpuRemoved { .. })
    }
}

/// `medium` of the CPU tier's events (vLLM's `MEDIUM_CPU`).
pub const MEDIUM_CPU: &str = "CPU";

/// Which engine's map layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// vLLM 0.31+: `BlockStored` with `extra_keys`, `group_idx`, `kv_cache_spec_kind`;
    /// `BlockRemoved` with `group_idx`.
    Vllm,
    /// vLLM 0.24-0.30: the eight base `BlockStored` fields only.
    VllmBase,
    /// SGLang 0.5: seven `BlockStored` fields, keys as signed i64.
    Sglang,
}

/// Per-event fields the engines fill from their configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireOptions {
    /// Map layout.
    pub layout: Layout,
    /// `medium` (`"GPU"`); `None` writes nil.
    pub medium: Option<String>,
    /// vLLM layout only: imitate a hybrid-attention model whose sliding-window group (1) keeps
    /// the last `n` blocks of each stored run. Every store is published for the full-attention
    /// group (0) and again for group 1, followed by group 1's removal of the run's blocks before
    /// the window (at once: the worst case; vLLM removes them when their slots are reused).
    /// Removals of evicted blocks are published for both groups.
    pub sliding_window: Option<usize>,
    /// vLLM layouts: the LoRA adapter every store names (`lora_id` 1, `lora_name`); `None`
    /// writes nil for both.
    pub lora_name: Option<String>,
}

impl WireOptions {
    /// What a GPU engine of this layout writes.
    pub fn gpu(layout: Layout) -> Self {
        WireOptions {
            layout,
            medium: Some("GPU".to_string()),
            sliding_window: None,
            lora_name: None,
        }
    }
}

/// Encodes one batch `[ts, [events...], dp_rank]` as msgpack.
pub fn encode_batch(
    opts: &WireOptions,
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    // (event, group): the full-attention group 0, and a hybrid model's sliding-window group 1.
    let mut wire: Vec<(std::borrow::Cow<'_, KvEvent>, u64)> = Vec::with_capacity(events.len());
    for e in events {
        wire.push((std::borrow::Cow::Borrowed(e), 0));
        if e.is_cpu() {
            // The CPU tier holds the full-attention group's blocks only.
            continue;
        }
        let Some(window) = opts.sliding_window.filter(|_| opts.layout == Layout::Vllm) else {
            continue;
        };
        wire.push((std::borrow::Cow::Borrowed(e), 1));
        if let KvEvent::Stored { keys, .. } = e {
            let outside = keys.len().saturating_sub(window);
            if outside > 0 {
                let gone = KvEvent::Removed {
                    keys: keys[..outside].to_vec(),
                };
                wire.push((std::borrow::Cow::Owned(gone), 1));
            }
        }
    }
    let n: usize = wire
        .iter()
        .map(|(e, _)| match e.as_ref() {
            // One placeholder BlockStored per block.
            KvEvent::CpuStored { keys } => keys.len(),
            _ => 1,
        })
        .sum();
    array_len(&mut out, n);
    for (e, group) in &wire {
        encode_event(&mut out, opts, e, *group);
    }
    match dp_rank {
        Some(r) => uint(&mut out, u64::from(r)),
        None => out.push(0xc0),
    }
    out
}

fn encode_event(out: &mut Vec<u8>, opts: &WireOptions, e: &KvEvent, group: u64) {
    match e {
        KvEvent::Stored {
            keys,
            parent,
            token_ids,
            block_size,
            salt,
            media,
        } => {
            let n = match opts.layout {
                Layout::Vllm => 11,
                Layout::VllmBase => 8,
                Layout::Sglang => 7 + usize::from(salt.is_some()),
            };
            match opts.layout {
                // msgspec reserves a map16 header for structs with more than 15 fields.
                Layout::Vllm | Layout::VllmBase => {
                    out.push(0xde);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                Layout::Sglang => map_len(out, n),
            }
            type_and_hashes(out, opts.layout, "BlockStored", keys);
            str_(out, "parent_block_hash");
            match parent {
                Some(p) => key(out, opts.layout, *p),
                None => out.push(0xc0),
            }
            str_(out, "token_ids");
            array_len(out, token_ids.len());
            for t in token_ids {
                uint(out, u64::from(*t));
            }
            str_(out, "block_size");
            uint(out, u64::from(*block_size));
            let lora = opts
                .lora_name
                .as_deref()
                .filter(|_| opts.layout != Layout::Sglang);
            str_(out, "lora_id");
            match lora {
                Some(_) => uint(out, 1),
                None => out.push(0xc0),
            }
            str_(out, "medium");
            opt_str(out, opts.medium.as_deref());
            if opts.layout != Layout::Sglang {
                str_(out, "lora_name");
                opt_str(out, lora);
            }
            if opts.layout == Layout::Vllm {
                str_(out, "extra_keys");
                array_len(out, keys.len());
                for i in 0..keys.len() {
                    // vLLM's order: media items, then the cache_salt (block 0 of a prompt only).
                    let items = media.get(i).map_or(&[][..], Vec::as_slice);
                    let salt = salt.as_deref().filter(|_| i == 0 && parent.is_none());
                    let n = items.len() + usize::from(salt.is_some());
                    if n == 0 {
                        out.push(0xc0);
                        continue;
                    }
                    array_len(out, n);
                    for (id, offset) in items {
                        array_len(out, 2);
                        str_(out, id);
                        int(out, *offset);
                    }
                    if let Some(salt) = salt {
                        str_(out, salt);
                    }
                }
                str_(out, "group_idx");
                uint(out, group);
                let kind = if group == 0 {
                    "full_attention"
                } else {
                    "sliding_window"
                };
                kv_str(out, "kv_cache_spec_kind", kind);
            }
            if let (Layout::Sglang, Some(salt)) = (opts.layout, salt) {
                kv_str(out, "cache_salt", salt);
            }
        }
        KvEvent::Removed { keys } => {
            map_len(out, if opts.layout == Layout::Vllm { 4 } else { 3 });
            type_and_hashes(out, opts.layout, "BlockRemoved", keys);
            str_(out, "medium");
            opt_str(out, opts.medium.as_deref());
            if opts.layout == Layout::Vllm {
                str_(out, "group_idx");
                uint(out, group);
            }
        }
        KvEvent::Cleared => {
            map_len(out, 1);
            kv_str(out, "type", "AllBlocksCleared");
        }
        KvEvent::CpuStored { keys } => {
            for k in keys {
                cpu_placeholder(out, opts.layout, *k, group);
            }
        }
        KvEvent::CpuRemoved { keys } => {
            map_len(out, if opts.layout == Layout::Vllm { 4 } else { 3 });
            type_and_hashes(out, opts.layout, "BlockRemoved", keys);
            kv_str(out, "medium", MEDIUM_CPU);
            if opts.layout == Layout::Vllm {
                str_(out, "group_idx");
                uint(out, group);
            }
        }
    }
}

/// vLLM's offloading connector's default `BlockStored` for one block written to the CPU tier
/// (its events carry no request metadata unless `self_describing_kv_events` is set): the
/// block's key, nil parent, no tokens, `block_size` 0, nil LoRA, `medium` `"CPU"` and (0.31+
/// layout) the key's `group_idx`; `extra_keys` and `kv_cache_spec_kind` keep their defaults and
/// are omitted.
fn cpu_placeholder(out: &mut Vec<u8>, layout: Layout, k: BlockKey, group: u64) {
    let n: u16 = if layout == Layout::Vllm { 9 } else { 8 };
    // msgspec reserves a map16 header for BlockStored (more than 15 fields).
    out.push(0xde);
    out.extend_from_slice(&n.to_be_bytes());
    type_and_hashes(out, layout, "BlockStored", &[k]);
    str_(out, "parent_block_hash");
    out.push(0xc0);
    str_(out, "token_ids");
    array_len(out, 0);
    str_(out, "block_size");
    uint(out, 0);
    str_(out, "lora_id");
    out.push(0xc0);
    kv_str(out, "medium", MEDIUM_CPU);
    str_(out, "lora_name");
    out.push(0xc0);
    if layout == Layout::Vllm {
        str_(out, "group_idx");
        uint(out, group);
    }
}

/// TensorRT-LLM's JSON envelope for one event (`POST /kv_cache_events` returns a list of them);
/// `None` for the CPU tier's events, which only vLLM publishes.
pub fn trtllm_envelope(
    event_id: u64,
    event: &KvEvent,
    window_size: u32,
    dp_rank: Option<u32>,
) -> Option<Value> {
    let data = match event {
        KvEvent::Stored {
            keys,
            parent,
            token_ids,
            block_size,
            ..
        } => {
            let bs = (*block_size as usize).max(1);
            let blocks: Vec<Value> = keys
                .iter()
                .zip(token_ids.chunks(bs))
                .map(|(k, toks)| {
                    let tokens: Vec<Value> =
                        toks.iter().map(|t| json!({"type": "unique_token", "token_id": t, "token_extra_id": 0})).collect();
                    json!({"type": "stored_block", "block_hash": k.0, "tokens": tokens, "lora_id": null,
                           "cache_level": 0, "priority": 35, "mm_keys": []})
                })
                .collect();
            json!({"type": "stored", "parent_hash": parent.map(|p| p.0), "blocks": blocks})
        }
        KvEvent::Removed { keys } => {
            json!({"type": "removed", "block_hashes": keys.iter().map(|k| k.0).collect::<Vec<u64>>()})
        }
        KvEvent::Cleared => json!({"type": "created", "num_blocks_per_cache_level": []}),
        KvEvent::CpuStored { .. } | KvEvent::CpuRemoved { .. } => return None,
    };
    let mut env = json!({"event_id": event_id, "data": data, "window_size": window_size});
    if let (Some(r), Value::Object(m)) = (dp_rank, &mut env) {
        m.insert("attention_dp_rank".to_string(), json!(r));
    }
    Some(env)
}

/// TensorRT-LLM's first event: the cache's geometry.
pub fn trtllm_created(
    event_id: u64,
    num_blocks: usize,
    window_size: u32,
    dp_rank: Option<u32>,
) -> Value {
    let mut env = json!({"event_id": event_id, "data": {"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]},
                         "window_size": window_size});
    if let (Some(r), Value::Object(m)) = (dp_rank, &mut env) {
        m.insert("attention_dp_rank".to_string(), json!(r));
    }
    env
}

/// `"type": name, "block_hashes": [keys]`: how both block events begin.
fn type_and_hashes(out: &mut Vec<u8>, layout: Layout, name: &str, keys: &[BlockKey]) {
    kv_str(out, "type", name);
    str_(out, "block_hashes");
    array_len(out, keys.len());
    for k in keys {
        key(out, layout, *k);
    }
}

fn key(out: &mut Vec<u8>, layout: Layout, k: BlockKey) {
    match layout {
        Layout::Sglang => int(out, k.as_i64()),
        Layout::Vllm | Layout::VllmBase => uint(out, k.0),
    }
}

// rmp's encoders write the smallest form, as msgspec does; writing into a Vec cannot fail.

fn int(out: &mut Vec<u8>, v: i64) {
    let _ = rmp::encode::write_sint(out, v);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(out, v);
}

fn array_len(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(out, n as u32);
}

fn map_len(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_map_len(out, n as u32);
}

fn str_(out: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(out, s);
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => str_(out, s),
        None => out.push(0xc0),
    }
}

fn kv_str(out: &mut Vec<u8>, k: &str, v: &str) {
    str_(out, k);
    str_(out, v);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The offloading connector's default payloads: one placeholder `BlockStored` per block
    /// (map16 header, nine fields in vLLM's declaration order), one `BlockRemoved` per batch of
    /// evictions; never copied to a sliding-window group.
    #[test]
    fn cpu_tier_events_are_vllms_offloading_placeholders() {
        let opts = WireOptions {
            sliding_window: Some(1),
            ..WireOptions::gpu(Layout::Vllm)
        };
        let events = [
            KvEvent::CpuRemoved {
                keys: vec![BlockKey(3)],
            },
            KvEvent::CpuStored {
                keys: vec![BlockKey(1), BlockKey(u64::MAX)],
            },
        ];
        let payload = encode_batch(&opts, 1.5, &events, Some(0));
        let batch = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
        let evs = batch[1].as_array().unwrap();
        assert_eq!(evs.len(), 3);
        let fields = |e: &rmpv::Value| -> Vec<(String, rmpv::Value)> {
            e.as_map()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.as_str().unwrap().to_string(), v.clone()))
                .collect()
        };
        use rmpv::Value as V;
        assert_eq!(
            fields(&evs[0]),
            vec![
                ("type".into(), V::from("BlockRemoved")),
                ("block_hashes".into(), V::Array(vec![V::from(3u64)])),
                ("medium".into(), V::from("CPU")),
                ("group_idx".into(), V::from(0u64)),
            ]
        );
        for (ev, key) in evs[1..].iter().zip([1u64, u64::MAX]) {
            assert_eq!(
                fields(ev),
                vec![
                    ("type".into(), V::from("BlockStored")),
                    ("block_hashes".into(), V::Array(vec![V::from(key)])),
                    ("parent_block_hash".into(), V::Nil),
                    ("token_ids".into(), V::Array(vec![])),
                    ("block_size".into(), V::from(0u64)),
                    ("lora_id".into(), V::Nil),
                    ("medium".into(), V::from("CPU")),
                    ("lora_name".into(), V::Nil),
                    ("group_idx".into(), V::from(0u64)),
                ]
            );
        }
        // msgspec's headers: fixmap for BlockRemoved, map16 for BlockStored.
        let stored_at = payload
            .windows(3)
            .position(|w| w == [0xde, 0x00, 0x09])
            .unwrap();
        assert!(payload[..stored_at].contains(&0x84));
        assert!(trtllm_envelope(0, &events[0], 16, None).is_none());
    }

    #[test]
    fn ints_take_their_smallest_form() {
        // msgspec's forms: non-negative values unsigned, each in the fewest bytes.
        for (v, hex) in [
            (0i64, "00"),
            (127i64, "7f"),
            (128i64, "cc80"),
            (65_536i64, "ce00010000"),
            (-1i64, "ff"),
            (-33i64, "d0df"),
            (-129i64, "d1ff7f"),
            (-40_000i64, "d2ffff63c0"),
            (-3_000_000_000i64, "d3ffffffff4d2fa200"),
        ] {
            let mut o = Vec::new();
            int(&mut o, v);
            assert_eq!(hex::encode(&o), hex, "{v}");
        }
    }
}
