//! Parity diagnosis: when the engine's published key differs from the one the rule's contract
//! computes, find which leg (algorithm, seed, block size) is probably wrong.
//!
//! A wrong leg means a silent 0% hit rate, so the answer goes to one log line, `/healthz` and a
//! metric. Candidates tried: the engine's algorithms, the seeds "0" and "vllm-none-hash" (plus the
//! configured one and unset), and the block sizes found in the event.

use super::decode::Stored;
use crate::fleet::ParityReport;
use kvroute_core::hash::{
    BlockKey, BlockSize, Engine, ExtraKeys, HashAlgo, HashContract, DEFAULT_NONE_HASH_SEED,
};

/// Searches the plausible contracts for one that reproduces the event's first key.
///
/// TensorRT-LLM's events give each block's tokens, so its block size is read from them: blocks
/// of another size name `kvBlockSize` whether or not the engine's keys are reproducible.
pub fn diagnose(engine: Engine, c: &HashContract, s: &Stored) -> ParityReport {
    if let Some(b) = s.block_size.filter(|b| {
        engine == Engine::Trtllm && *b != u32::from(c.block_size) && BlockSize::new(*b).is_some()
    }) {
        return ParityReport {
            message: format!(
                "{engine} blocks hold {b} tokens (tokens_per_block), the rule's kvBlockSize is {}: kvBlockSize should be {b}",
                u32::from(c.block_size)
            ),
            suggested_algo: None,
            suggested_seed: None,
            suggested_block_size: Some(b),
        };
    }
    let n = s.block_hashes.len().max(1);
    let mut sizes: Vec<u32> = vec![u32::from(c.block_size)];
    if let Some(b) = s.block_size {
        sizes.push(b);
    }
    if s.token_ids.len() % n == 0 {
        sizes.push((s.token_ids.len() / n) as u32);
    }
    sizes.dedup();
    let mut seeds: Vec<Option<String>> = vec![
        c.seed.clone(),
        Some("0".into()),
        Some(DEFAULT_NONE_HASH_SEED.into()),
        None,
    ];
    seeds.dedup();
    let mut algos: Vec<HashAlgo> = vec![c.algo];
    algos.extend(engine.algos().iter().copied().filter(|a| *a != c.algo));
    let want = s.block_hashes.first().copied();
    let current = format!(
        "kvHashAlgo={} seed={:?} kvBlockSize={}",
        c.algo,
        c.seed.as_deref().unwrap_or("(unset)"),
        u32::from(c.block_size)
    );
    for &algo in &algos {
        for &bs in &sizes {
            let Some(bsz) = BlockSize::new(bs) else {
                continue;
            };
            if s.token_ids.len() < bsz.get() {
                continue;
            }
            let seed_list: &[Option<String>] =
                if matches!(algo, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor) {
                    &seeds
                } else {
                    &[None]
                };
            for seed in seed_list {
                let mut cand = HashContract::new(algo, bsz);
                cand.seed = seed.clone();
                let Ok(mut h) = cand.hasher(&ExtraKeys::default()) else {
                    continue;
                };
                let got = h.push_block(&s.token_ids[..bsz.get()]).map(|k| k.0);
                if got.is_some() && got == want {
                    let mut legs = Vec::new();
                    if algo != c.algo {
                        legs.push(format!("kvHashAlgo should be {algo}"));
                    }
                    if bs != u32::from(c.block_size) {
                        legs.push(format!("kvBlockSize should be {bs}"));
                    }
                    if *seed != c.seed && seed_list.len() > 1 {
                        legs.push(format!(
                            "the seed should be {} (the engine's PYTHONHASHSEED; set LLB_KV_NONE_HASH_SEED on the service and the filter)",
                            seed.as_deref().map_or("unset".to_owned(), |s| format!("{s:?}"))
                        ));
                    }
                    return ParityReport {
                        message: format!(
                            "{engine} keys do not match {current}; they match when {}",
                            legs.join(" and ")
                        ),
                        suggested_algo: (algo != c.algo).then(|| algo.to_string()),
                        suggested_seed: if *seed != c.seed { seed.clone() } else { None },
                        suggested_block_size: (bs != u32::from(c.block_size)).then_some(bs),
                    };
                }
            }
        }
    }
    ParityReport {
        message: format!(
            "{engine} keys do not match {current}, nor any tried algorithm ({}), seed (\"0\", \"{DEFAULT_NONE_HASH_SEED}\", unset) or block size ({:?}): \
             the engine probably uses a non-reproducible hash (vLLM's default pickle sha256/xxhash, or xxhash without PYTHONHASHSEED); \
             start it with --prefix-caching-hash-algo sha256_cbor and PYTHONHASHSEED, or set kvKeyMode tokens",
            algos.iter().map(|a| a.as_str()).collect::<Vec<_>>().join(", "),
            sizes
        ),
        suggested_algo: None,
        suggested_seed: None,
        suggested_block_size: None,
    }
}

/// How one `BlockStored` compares with a prompt's own tokens and keys ([`place`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Placed {
    /// Token `position` of the prompt differs: kvroute has `ours`, the engine `engine`.
    TokenMismatch {
        position: usize,
        ours: u32,
        engine: u32,
    },
    /// Tokens agree and the engine's `blocks` keys from block `first_block` equal the prompt's.
    Match { first_block: usize, blocks: usize },
    /// Tokens agree but the keys differ; `report` is the diagnosis.
    KeyMismatch {
        first_block: usize,
        engine_keys: Vec<u64>,
        report: ParityReport,
    },
}

/// Where `s` falls in a prompt of `tokens` whose keys are `keys`, or `None` when it is not this
/// prompt's: a chain start (no parent) must share at least half of its first block's tokens
/// with the prompt, a continuation must have one of the prompt's keys as parent. Everything else
/// is other traffic on the engine.
pub fn place(
    engine: Engine,
    contract: &HashContract,
    tokens: &[u32],
    keys: &[BlockKey],
    s: &Stored,
) -> Option<Placed> {
    let bs = contract.block_size.get();
    let first_block = match s.parent {
        None => 0,
        Some(p) => keys.iter().position(|k| k.0 == p)? + 1,
    };
    let offset = first_block * bs;
    let ours = tokens.get(offset..).unwrap_or(&[]);
    let theirs = &s.token_ids;
    if s.parent.is_none() && theirs.get(..bs) != ours.get(..bs) && !theirs.is_empty() {
        let shared = ours.iter().zip(theirs).take_while(|(a, b)| a == b).count();
        if shared < bs.min(theirs.len()) / 2 {
            return None;
        }
    }
    if let Some(at) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
        return Some(Placed::TokenMismatch {
            position: offset + at,
            ours: ours[at],
            engine: theirs[at],
        });
    }
    let n = s.block_hashes.len();
    match keys.get(first_block..first_block + n) {
        Some(w) if w.iter().map(|k| k.0).eq(s.block_hashes.iter().copied()) => {
            Some(Placed::Match {
                first_block,
                blocks: n,
            })
        }
        _ => Some(Placed::KeyMismatch {
            first_block,
            engine_keys: s.block_hashes.clone(),
            report: diagnose(engine, contract, s),
        }),
    }
}
