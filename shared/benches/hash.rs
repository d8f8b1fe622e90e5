//! Block-key throughput per contract, for 1k- and 32k-token prompts.
//!
//! Throughput is reported in tokens; keys/s = tokens/s / 16. `sha256_raw` hashes the exact CBOR
//! bytes `sha256_cbor` feeds SHA-256, without encoding, so the encoding overhead is visible and the
//! figure can be set beside `openssl speed -evp sha256` (scripts/bench-hash.sh does both).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use sha2::{Digest, Sha256};

fn prompt(n: usize) -> Vec<u32> {
    // Spread ids over Qwen3's vocabulary so CBOR heads take their realistic 3- and 5-byte forms.
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_643)
        .collect()
}

fn contracts() -> Vec<HashContract> {
    let bs = BlockSize::new(16).unwrap();
    vec![
        HashContract::new(HashAlgo::Sha256Cbor, bs).with_seed("0"),
        HashContract::new(HashAlgo::XxhashCbor, bs).with_seed("0"),
        HashContract::new(HashAlgo::Sha256Sglang, bs),
        HashContract::new(HashAlgo::BlockhashTrtllm, bs),
        HashContract::new(HashAlgo::Tokens, bs),
    ]
}

fn bench_contracts(c: &mut Criterion) {
    let extra = ExtraKeys::default();
    for n in [1024usize, 32 * 1024] {
        let tokens = prompt(n);
        let mut g = c.benchmark_group(format!("keys_{}k_tokens", n / 1024));
        g.throughput(Throughput::Elements(n as u64));
        for contract in contracts() {
            g.bench_with_input(
                BenchmarkId::from_parameter(contract.algo),
                &tokens,
                |b, t| b.iter(|| contract.keys(black_box(t), &extra).unwrap()),
            );
        }
        g.finish();
    }
}

/// SHA-256 over the same bytes sha256_cbor hashes (one 32-byte parent + 16 CBOR ints per block).
fn bench_sha256_raw(c: &mut Criterion) {
    let n = 32 * 1024;
    let tokens = prompt(n);
    // Rebuild the per-block CBOR inputs once: 0x83, bytes(32), array(16) of uints, null.
    let mut blocks = Vec::new();
    for chunk in tokens.chunks_exact(16) {
        let mut b = vec![0x83, 0x58, 0x20];
        b.extend_from_slice(&[0xab; 32]);
        b.push(0x90);
        for &t in chunk {
            match t {
                0..=23 => b.push(t as u8),
                24..=255 => b.extend_from_slice(&[0x18, t as u8]),
                256..=65535 => {
                    b.push(0x19);
                    b.extend_from_slice(&(t as u16).to_be_bytes())
                }
                _ => {
                    b.push(0x1a);
                    b.extend_from_slice(&t.to_be_bytes())
                }
            }
        }
        b.push(0xf6);
        blocks.push(b);
    }
    let bytes: usize = blocks.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("sha256_raw_32k_tokens");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("sha256_cbor_input_bytes", |b| {
        b.iter(|| {
            let mut last = [0u8; 32];
            for blk in &blocks {
                last = Sha256::digest(black_box(blk)).into();
            }
            last
        })
    });
    g.finish();
    let mut g = c.benchmark_group("sha256_cbor_32k_tokens_bytes");
    g.throughput(Throughput::Bytes(bytes as u64));
    let contract =
        HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap()).with_seed("0");
    g.bench_function("sha256_cbor", |b| {
        b.iter(|| {
            contract
                .keys(black_box(&tokens), &ExtraKeys::default())
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench_contracts, bench_sha256_raw);
criterion_main!(benches);
