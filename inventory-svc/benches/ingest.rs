//! Ingest benches without ZMQ: one vLLM `BlockStored` of 16 keys (the message of
//! tests/ingest_bench.rs: no token ids, parent nil; and, for the whole path, as engines send it
//! mid-prompt: a parent and 16 token ids per block) decoded by the streaming decoder and by the
//! tree decoder it replaced (`reference`), and the whole per-message path after the socket:
//! decode, keying (`Keyer::take_ops`, into a reused vector, as the subscriber does) and `Fleet::apply_ops` (index, key cap, gauge).
//! Throughput is in block events (keys). `ingest_index` stores held keys into a 3M-key index
//! (a table far past the caches): the index part when every key misses.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput};
use kvroute_core::hash::BlockKey;
use kvroute_core::hash::Engine;
use kvroute_inventory::fleet::{Fleet, Origin};
use kvroute_inventory::index::{BlockIndex, EndpointId, IndexOp, MemIndex, Rank};
use kvroute_inventory::ingest::decode::{
    decode_batch, decode_batch_into, BytesKey, EventBatch, Spare,
};
use kvroute_inventory::ingest::keyer::Keyer;
use kvroute_inventory::ingest::reference;
use kvroute_inventory::metrics::Metrics;
use kvroute_inventory::rules::KeyMode;
use kvroute_inventory::settings::Settings;
use rmpv::Value as Mp;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Keys per message, as in the end-to-end bench.
const PER: u64 = 16;
/// Distinct messages cycled through (16 x 4,096 keys: the index stays cache-sized).
const MESSAGES: u64 = 4096;

fn message(first: u64) -> Vec<u8> {
    message_of(first, false)
}

/// A message as a vLLM engine sends it mid-prompt: a parent, and the 16 token ids of each block.
fn message_with_tokens(first: u64) -> Vec<u8> {
    message_of(first, true)
}

fn message_of(first: u64, tokens: bool) -> Vec<u8> {
    let keys = (first..first + PER).map(Mp::from).collect();
    let (parent, ids) = match tokens {
        // Token ids of a 151k vocabulary, as the Qwen3 tokenizer's.
        true => (
            Mp::from(first.wrapping_sub(1)),
            (0..PER * 16)
                .map(|t| Mp::from((first * 7919 + t * 104_729) % 151_000))
                .collect(),
        ),
        false => (Mp::Nil, vec![]),
    };
    let ev = Mp::Map(vec![
        (Mp::from("type"), Mp::from("BlockStored")),
        (Mp::from("block_hashes"), Mp::Array(keys)),
        (Mp::from("parent_block_hash"), parent),
        (Mp::from("token_ids"), Mp::Array(ids)),
        (Mp::from("block_size"), Mp::from(16)),
        (Mp::from("lora_id"), Mp::Nil),
        (Mp::from("medium"), Mp::from("GPU")),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(
        &mut buf,
        &Mp::Array(vec![Mp::F64(1.0), Mp::Array(vec![ev]), Mp::Nil]),
    )
    .unwrap();
    buf
}

fn decode(c: &mut Criterion) {
    // Keys of the size the end-to-end bench reaches (a few million: uint32 on the wire) and
    // full 64-bit hashes (uint64), as engines publish them.
    let small = message(3_000_000);
    let wide = message(0x9E37_79B9_7F4A_7C15);
    let mut g = c.benchmark_group("ingest_decode");
    g.throughput(Throughput::Elements(PER));
    for (name, payload) in [("u32_keys", &small), ("u64_keys", &wide)] {
        g.bench_function(format!("stream/{name}"), |b| {
            b.iter(|| decode_batch(black_box(payload), BytesKey::Last8).unwrap())
        });
        g.bench_function(format!("reference/{name}"), |b| {
            b.iter(|| reference::decode_batch(black_box(payload), BytesKey::Last8).unwrap())
        });
    }
    g.finish();
}

fn path(c: &mut Criterion) {
    let settings = Settings::default();
    let metrics = Arc::new(Metrics::new().unwrap());
    let fleet = Arc::new(Fleet::new(
        metrics.clone(),
        settings.clone(),
        CancellationToken::new(),
        None,
        |_, _| {},
    ));
    let raw = json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp",
            "sel": 0, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16,
            "kvEngineType": "vllm", "kvZmqPort": 5557},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000, "weight": 1}],
    });
    let spec = kvroute_inventory::rules::parse_rule(&raw, &settings).unwrap();
    let rule = fleet.install(spec, Origin::Local).unwrap().rule;
    let mut keyer = Keyer::new(Engine::Vllm, KeyMode::Engine, 16, None, metrics);
    let mut g = c.benchmark_group("ingest_path");
    g.throughput(Throughput::Elements(PER));
    let (mut ops, mut batch, mut spare) = (Vec::new(), EventBatch::default(), Spare::default());
    for (name, make) in [
        ("decode_key_apply", message as fn(u64) -> Vec<u8>),
        ("decode_key_apply_with_tokens", message_with_tokens),
    ] {
        let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(|i| make(1 + i * PER)).collect();
        let mut i = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                let p = &payloads[i % payloads.len()];
                i += 1;
                decode_batch_into(black_box(p), BytesKey::Last8, &mut batch, &mut spare).unwrap();
                keyer.take_ops(&mut batch, &mut ops, &mut spare);
                fleet.apply_ops(&rule, EndpointId(0), Rank(0), &ops);
                spare.recycle(&mut ops);
            })
        });
    }
    g.finish();
}

/// Keys held before the large-index store bench: a 64 MiB table, far past the caches.
const HELD: u64 = 3 << 20;

/// Stores of 16 keys the endpoint already holds, spread over a large index: the index part of
/// the path when it is bound by one cache miss per key.
fn large_index(c: &mut Criterion) {
    let spread = |i: u64| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555);
    let index = MemIndex::new();
    let all: Vec<BlockKey> = (0..HELD).map(spread).collect();
    for chunk in all.chunks(4096) {
        index.apply(EndpointId(0), Rank(0), &[IndexOp::Store(chunk.to_vec())]);
    }
    let mut g = c.benchmark_group("ingest_index");
    g.throughput(Throughput::Elements(PER));
    let mut n = 0u64;
    g.bench_function("store_16_held_of_3m", |b| {
        b.iter(|| {
            // A different, scattered set of held keys every message.
            let keys: Vec<BlockKey> = (0..PER)
                .map(|k| spread((n * PER + k).wrapping_mul(0x2545_F491) % HELD))
                .collect();
            n += 1;
            index.apply(EndpointId(0), Rank(0), &[IndexOp::Store(keys)]);
        })
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    decode(&mut c);
    path(&mut c);
    large_index(&mut c);
    c.final_summary();
}
