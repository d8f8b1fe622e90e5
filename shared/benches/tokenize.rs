//! Tokenization cost per prompt: HF tokenizers versus the fast BPE path, cold and warm, and the
//! Qwen3 chat template's render of a multi-turn conversation (the filter renders every request),
//! by the native renderer (`render`) and by the Jinja VM (`render_jinja`).
//!
//! "cold" clears the piece cache before every encode; "warm" repeats a prompt whose pieces are all
//! cached (a multi-turn follow-up).
//!
//! `single_word_vs_prose_<n>_chars`: one word of `n` letters (one pre-token piece) against prose of
//! the same size, cold, encoded whole (`encode`: the merge's own cost, O(n log n)) and as the
//! filter and the offload path do (`encode_prefix`, 16384 tokens, 8 KiB piece bound).
//! Needs the Qwen3 fixture (`scripts/setup.sh`); without it the bench says so and exits.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::bpe::{FastBpe, PrefixCap, MAX_PREFIX_TOKENS};
use kvroute_core::chat::{ChatRequest, ChatTemplate};
use serde_json::json;

fn fixture(file: &str) -> Option<Vec<u8>> {
    let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        });
    std::fs::read(dir.join(file)).ok()
}

/// English-and-code prose of roughly `words` words, deterministic.
fn prose(words: usize, salt: u64) -> String {
    const W: &[&str] = &[
        "the",
        "router",
        "sends",
        "each",
        "request",
        "to",
        "backend",
        "whose",
        "cache",
        "already",
        "holds",
        "prefix,",
        "so",
        "prefill",
        "is",
        "skipped.",
        "Configure",
        "--block-size",
        "16",
        "and",
        "PYTHONHASHSEED=0;",
        "then",
        "compare",
        "keys:",
        "0x7f3a",
        "(see",
        "docs/contracts.md)",
        "for",
        "details.\n",
        "Latency",
        "p99",
        "≤",
        "5ms",
    ];
    let mut s = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(words * 7);
    for _ in 0..words {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.push_str(W[(s % W.len() as u64) as usize]);
        out.push(' ');
    }
    out
}

fn bench(c: &mut Criterion) {
    let Some(bytes) = fixture("tokenizer.json") else {
        eprintln!("tokenizer fixture missing: run scripts/setup.sh");
        return;
    };
    let hf = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
    for words in [700usize, 5600] {
        let text = prose(words, 1);
        let n = hf.encode(text.as_str(), false).unwrap().len();
        let mut g = c.benchmark_group(format!("tokenize_{}_tokens", n));
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("hf_tokenizers", "cold"), |b| {
            b.iter(|| hf.encode(black_box(text.as_str()), false).unwrap().len())
        });
        let fast = FastBpe::from_tokenizer_json(&bytes).unwrap().unwrap();
        g.bench_function(BenchmarkId::new("fast_bpe", "cold"), |b| {
            b.iter(|| {
                fast.clear_cache();
                fast.encode(black_box(&text)).len()
            })
        });
        fast.encode(&text);
        g.bench_function(BenchmarkId::new("fast_bpe", "warm"), |b| {
            b.iter(|| fast.encode(black_box(&text)).len())
        });
        g.finish();
    }
    single_word(c, &bytes);
    render(c, &hf);
}

/// One long word versus prose of the same byte size, cold.
fn single_word(c: &mut Criterion, bytes: &[u8]) {
    let fast = FastBpe::from_tokenizer_json(bytes).unwrap().unwrap();
    let cap = PrefixCap::tokens(MAX_PREFIX_TOKENS);
    for n in [10_000usize, 100_000, 1_000_000] {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let word: String = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                char::from(b'a' + (s % 26) as u8)
            })
            .collect();
        let mut text = prose(n / 5, 3);
        let end = (0..=n)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text.truncate(end);
        let mut g = c.benchmark_group(format!("single_word_vs_prose_{n}_chars"));
        g.throughput(Throughput::Bytes(n as u64));
        for (name, input) in [("word", &word), ("prose", &text)] {
            g.bench_function(BenchmarkId::new("encode", name), |b| {
                b.iter(|| {
                    fast.clear_cache();
                    fast.encode(black_box(input)).len()
                })
            });
            g.bench_function(BenchmarkId::new("encode_prefix_16384", name), |b| {
                b.iter(|| {
                    fast.clear_cache();
                    fast.encode_prefix(black_box(input), cap).0.len()
                })
            });
        }
        g.finish();
    }
}

/// Renders a conversation of a system prompt and `turns` alternating turns of 150 words (the
/// filter bench's shape), ending on a user turn.
fn render(c: &mut Criterion, hf: &tokenizers::Tokenizer) {
    let Some(config) = fixture("tokenizer_config.json") else {
        return;
    };
    let template = ChatTemplate::new(&config).unwrap();
    let mut jinja = ChatTemplate::new(&config).unwrap();
    jinja.set_native(false);
    for turns in [4usize, 32] {
        let mut messages = vec![json!({"role": "system", "content": prose(40, 7)})];
        for i in 0..turns {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": prose(150, i as u64)}));
        }
        messages.push(json!({"role": "user", "content": prose(20, 99)}));
        let request = ChatRequest::new(messages);
        let text = template.render(&request).unwrap();
        let n = hf.encode(text.as_str(), false).unwrap().len();
        let mut g = c.benchmark_group(format!("chat_template_{}_tokens", n));
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(
            BenchmarkId::new("render", format!("{} messages", turns + 2)),
            |b| b.iter(|| template.render(black_box(&request)).unwrap().len()),
        );
        g.bench_function(
            BenchmarkId::new("render_jinja", format!("{} messages", turns + 2)),
            |b| b.iter(|| jinja.render(black_box(&request)).unwrap().len()),
        );
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
