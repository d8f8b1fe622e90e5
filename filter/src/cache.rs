//! The block-key cache [`KeyCache`], bounded per VM, built on kvroute-core's [`Generational`] (two
//! generations approximating LRU; its tests are in `kvroute_core::segments`).
//!
//! Invariants:
//! * every cache is bounded in entries and in bytes (the caller states each entry's size); a
//!   limit of zero disables the cache, and an entry larger than half the byte limit is not kept
//!   (beside the trie, the key cache keeps the last request's chain: its full blocks' tokens and
//!   one node per block, bounded by the tokens a request is routed on, `max_prefix_tokens`);
//! * a hit is exact: keys are compared in full (text, token ids), never by a hash alone, so a
//!   cached answer is the answer the uncached path computes.

use std::rc::Rc;

use kvroute_core::hash::{BlockHasher, BlockKey, ExtraKeys, HashAlgo, HashContract, HashError};

pub use kvroute_core::segments::{FastMap, Generational, Limits};

/// The hasher state is kept on every `SNAPSHOT_EVERY`-th block of a chain; resuming re-hashes at
/// most `SNAPSHOT_EVERY - 1` known blocks (cheaper than cloning the state at every block).
const SNAPSHOT_EVERY: usize = 8;

/// One hashed block: the key of the chain ending with it.
#[derive(Clone)]
struct Node {
    id: u64,
    key: BlockKey,
    /// The hasher state after this block (every `SNAPSHOT_EVERY`-th block).
    state: Option<Rc<BlockHasher>>,
}

/// Block keys of token prefixes seen before, per hash contract.
///
/// A trie of blocks: a node is found by (its parent node's id, the block's token ids), and the
/// root by the request's extra keys (cache salt, ...). A walk from the root that matches block
/// after block by full token comparison reaches exactly the chain the uncached hasher would
/// compute, so its keys are reused; hashing resumes from the deepest state snapshot. Node ids are
/// never reused, so a node whose parent was evicted is unreachable, never wrong. A contract
/// change empties the cache.
///
/// The chain of the last request is kept beside the trie ([`LastChain`]): a follow-up of the same
/// conversation takes the blocks it shares with it by comparing token ids block by block, without
/// a trie lookup per block, and walks the trie from there.
///
/// Only algorithms whose per-block hash costs more than a cache step use it (sha256 and CBOR
/// encodings); `blockhash_trtllm` and `tokens` hash a block faster than the walk looks it up
/// (measured natively, `key_cache_timings`: 21 µs plain vs 36 µs walked for 8k tokens), so their
/// keys are always hashed.
pub struct KeyCache {
    contract: Option<HashContract>,
    roots: Vec<(ExtraKeys, u64)>,
    nodes: Generational<Box<[u32]>, Node>,
    next_id: u64,
    /// Scratch lookup key: parent id (two u32) + the block's tokens.
    probe: Vec<u32>,
    last: LastChain,
}

/// The last request's chain: its root, the tokens of its full blocks and the node of each block.
/// Its keys are exact for any request with the same root whose blocks equal a prefix of these
/// (the nodes hold the keys and hasher snapshots the uncached path computes for these tokens);
/// a node evicted from the trie since only stops the walk there.
#[derive(Default)]
struct LastChain {
    root: u64,
    tokens: Vec<u32>,
    nodes: Vec<Node>,
}

impl std::fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyCache")
            .field("contract", &self.contract)
            .field("usage", &self.nodes.usage())
            .finish_non_exhaustive()
    }
}

impl Default for KeyCache {
    fn default() -> Self {
        KeyCache::new(crate::config::Config::default().key_cache)
    }
}

/// What a [`KeyCache::keys`] call did, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStats {
    /// Blocks whose key came from the cache.
    pub hits: u64,
    /// Blocks hashed.
    pub misses: u64,
}

/// Most distinct extra-key roots remembered (cache salts); past it, roots are forgotten.
const MAX_ROOTS: usize = 1024;

impl KeyCache {
    /// An empty cache bounded by `limits` (entries = blocks).
    pub fn new(limits: Limits) -> Self {
        KeyCache {
            contract: None,
            roots: Vec::new(),
            nodes: Generational::new(limits),
            next_id: 1,
            probe: Vec::new(),
            last: LastChain::default(),
        }
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn root(&mut self, extra: &ExtraKeys) -> u64 {
        if let Some((_, id)) = self.roots.iter().find(|(e, _)| e == extra) {
            return *id;
        }
        if self.roots.len() >= MAX_ROOTS {
            self.roots.clear();
        }
        let id = self.fresh_id();
        self.roots.push((extra.clone(), id));
        id
    }

    fn set_probe(&mut self, parent: u64, block: &[u32]) {
        self.probe.clear();
        // Split in two u32 on purpose: the id is part of the compared key.
        self.probe.push((parent >> 32) as u32);
        self.probe.push(parent as u32);
        self.probe.extend_from_slice(block);
    }

    /// Bytes charged for a node: its key, the entry, and the snapshot when it has one.
    fn node_size(block_size: usize, snapshot: bool) -> usize {
        let base = 4 * (block_size + 2) + std::mem::size_of::<Node>() + 64;
        // A hasher snapshot: the state plus its scratch and extra-key buffers.
        base + if snapshot {
            std::mem::size_of::<BlockHasher>() + 320
        } else {
            0
        }
    }

    /// True when `algo`'s keys go through the cache (see the type's docs).
    pub fn caches(algo: HashAlgo) -> bool {
        matches!(
            algo,
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor | HashAlgo::Sha256Sglang
        )
    }

    /// The keys of every full block of `tokens` under `contract` and `extra`: exactly
    /// `contract.keys(tokens, extra)`, reusing the keys of a prefix seen before.
    pub fn keys(
        &mut self,
        contract: &HashContract,
        extra: &ExtraKeys,
        tokens: &[u32],
    ) -> Result<(Vec<BlockKey>, KeyStats), HashError> {
        if !Self::caches(contract.algo) {
            return Ok((contract.keys(tokens, extra)?, KeyStats::default()));
        }
        if self.contract.as_ref() != Some(contract) {
            self.nodes.clear();
            self.roots.clear();
            self.last = LastChain::default();
            self.contract = Some(contract.clone());
        }
        let fresh = contract.hasher(extra)?;
        let bs = fresh.block_size().get();
        let blocks: Vec<&[u32]> = tokens.chunks_exact(bs).collect();
        let root = self.root(extra);
        // This request's chain, started from the last one's: the blocks they share are taken
        // from it (the vectors are reused, not copied).
        let mut chain = std::mem::take(&mut self.last);
        let shared = if chain.root == root {
            blocks
                .iter()
                .zip(chain.tokens.chunks_exact(bs))
                .take_while(|(a, b)| **a == *b)
                .count()
                .min(chain.nodes.len())
        } else {
            0
        };
        chain.root = root;
        chain.tokens.truncate(shared * bs);
        chain.nodes.truncate(shared);
        // Then the trie, from the last shared block on.
        let mut parent = chain.nodes.last().map_or(root, |n| n.id);
        for block in blocks.iter().skip(shared) {
            self.set_probe(parent, block);
            let probe = std::mem::take(&mut self.probe);
            let node = self.nodes.get_with(probe.as_slice(), Node::clone);
            self.probe = probe;
            let Some(node) = node else { break };
            parent = node.id;
            chain.tokens.extend_from_slice(block);
            chain.nodes.push(node);
        }
        let matched = chain.nodes.len();
        let mut keys = Vec::with_capacity(blocks.len());
        keys.extend(chain.nodes.iter().map(|n| n.key));
        // Hashing resumes from the deepest snapshot on the matched path (and the blocks it covers).
        let (mut hasher, from) = chain
            .nodes
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, n)| Some((BlockHasher::clone(n.state.as_deref()?), i + 1)))
            .unwrap_or((fresh, 0));
        // Bring the state to the end of the matched prefix (keys already known).
        for block in blocks.get(from..matched).unwrap_or(&[]) {
            let _ = hasher.push_block(block);
        }
        for (i, block) in blocks.iter().enumerate().skip(matched) {
            let Some(key) = hasher.push_block(block) else {
                break;
            };
            keys.push(key);
            let id = self.fresh_id();
            let snap = (i + 1) % SNAPSHOT_EVERY == 0;
            let node = Node {
                id,
                key,
                state: snap.then(|| Rc::new(hasher.clone())),
            };
            self.set_probe(parent, block);
            let size = Self::node_size(bs, snap);
            self.nodes
                .insert(self.probe.clone().into_boxed_slice(), node.clone(), size);
            chain.tokens.extend_from_slice(block);
            chain.nodes.push(node);
            parent = id;
        }
        self.last = chain;
        let stats = KeyStats {
            hits: matched as u64,
            misses: (keys.len() - matched) as u64,
        };
        Ok((keys, stats))
    }

    /// Entries (blocks) and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        self.nodes.usage()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use kvroute_core::hash::{BlockSize, HashAlgo};

    /// Conversations that grow turn by turn, share a system prompt, diverge mid-block, and use
    /// salts: every answer equals the uncached keys, for every algorithm and for tiny caches.
    #[test]
    fn cached_keys_equal_uncached_keys_on_multi_turn_conversations() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % 50_000) as u32
                })
                .collect()
        };
        let system = rnd(37);
        let mut requests: Vec<Vec<u32>> = Vec::new();
        for conv in 0..4 {
            let mut history = system.clone();
            for turn in 0..6 {
                history.extend(rnd(13 + 29 * turn + conv));
                requests.push(history.clone());
            }
        }
        // A request diverging inside a block of an earlier one, and a repeat.
        let mut fork = requests[3].clone();
        fork.truncate(fork.len() - 5);
        fork.extend(rnd(40));
        requests.push(fork);
        requests.push(requests[5].clone());
        let salts = [None, Some("tenant-a".to_owned())];
        for algo in HashAlgo::ALL {
            for bs in [1u32, 4, 16] {
                let contract = HashContract::new(algo, BlockSize::new(bs).unwrap()).with_seed("0");
                for limits in [
                    Limits {
                        entries: 1 << 20,
                        bytes: 1 << 30,
                    },
                    Limits {
                        entries: 10,
                        bytes: 4000,
                    },
                ] {
                    let mut cache = KeyCache::new(limits);
                    let mut hits = 0;
                    for round in 0..2 {
                        for (i, tokens) in requests.iter().enumerate() {
                            let extra = ExtraKeys {
                                cache_salt: salts[(i + round) % 2].clone(),
                                ..ExtraKeys::default()
                            };
                            let want = contract.keys(tokens, &extra).unwrap();
                            let (got, stats) = cache.keys(&contract, &extra, tokens).unwrap();
                            assert_eq!(got, want, "{algo} bs {bs} {limits:?} request {i}");
                            if KeyCache::caches(algo) {
                                assert_eq!(stats.hits + stats.misses, want.len() as u64);
                            }
                            hits += stats.hits;
                            let (n, b) = cache.usage();
                            assert!(n <= limits.entries && b <= limits.bytes);
                        }
                    }
                    if limits.entries > 10 && KeyCache::caches(algo) {
                        assert!(hits > 0, "{algo} bs {bs}: the prefixes were reused");
                    }
                }
            }
        }
    }

    /// Native cost of the cache per algorithm (`cargo test --release -p kvroute-filter
    /// key_cache_timings -- --ignored --nocapture`): plain hashing vs filling vs a follow-up.
    #[test]
    #[ignore = "timing report, not a test"]
    fn key_cache_timings() {
        let tokens: Vec<u32> = (0..8192u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
            .collect();
        let mut follow = tokens.clone();
        follow.extend(200_000..200_100);
        let none = ExtraKeys::default();
        for algo in HashAlgo::ALL {
            let contract = HashContract::new(algo, BlockSize::new(16).unwrap()).with_seed("0");
            let t = std::time::Instant::now();
            for _ in 0..20 {
                let _ = contract.keys(&follow, &none).unwrap();
            }
            let plain = t.elapsed() / 20;
            let mut cache = KeyCache::default();
            let t = std::time::Instant::now();
            let _ = cache.keys(&contract, &none, &tokens).unwrap();
            let fill = t.elapsed();
            let t = std::time::Instant::now();
            for _ in 0..20 {
                let _ = cache.keys(&contract, &none, &follow).unwrap();
            }
            let hit = t.elapsed() / 20;
            eprintln!("{algo}: plain {plain:?}, fill {fill:?}, follow-up {hit:?}");
        }
    }

    /// With the trie holding nothing (zero bounds), a follow-up still takes the blocks it
    /// shares with the last request from its chain, and only those: another root (a cache salt)
    /// or a block that differs ends the shared part; the keys stay the uncached keys.
    #[test]
    fn a_follow_up_takes_the_blocks_it_shares_with_the_last_chain() {
        let contract = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap());
        let mut cache = KeyCache::new(Limits {
            entries: 0,
            bytes: 0,
        });
        let none = ExtraKeys::default();
        let salted = ExtraKeys {
            cache_salt: Some("tenant".into()),
            ..ExtraKeys::default()
        };
        let first: Vec<u32> = (0..64).collect();
        let follow: Vec<u32> = (0..100).collect();
        let mut fork = follow.clone();
        fork[20] = 7;
        let cases: [(&[u32], &ExtraKeys, (u64, u64)); 5] = [
            (&first, &none, (0, 4)),
            (&follow, &none, (4, 2)),
            (&follow, &salted, (0, 6)),
            (&follow, &salted, (6, 0)),
            (&fork, &salted, (1, 5)),
        ];
        for (i, (tokens, extra, want)) in cases.into_iter().enumerate() {
            let (got, stats) = cache.keys(&contract, extra, tokens).unwrap();
            assert_eq!(got, contract.keys(tokens, extra).unwrap(), "request {i}");
            assert_eq!((stats.hits, stats.misses), want, "request {i}");
        }
        assert_eq!(cache.usage(), (0, 0));
    }

    #[test]
    fn a_contract_change_empties_the_cache() {
        let tokens: Vec<u32> = (0..64).collect();
        let a = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap());
        let b = a.clone().with_seed("1");
        let mut cache = KeyCache::new(Limits {
            entries: 1000,
            bytes: 1 << 20,
        });
        let none = ExtraKeys::default();
        cache.keys(&a, &none, &tokens).unwrap();
        let (got, stats) = cache.keys(&b, &none, &tokens).unwrap();
        assert_eq!(stats.hits, 0);
        assert_eq!(got, b.keys(&tokens, &none).unwrap());
        let (_, stats) = cache.keys(&b, &none, &tokens).unwrap();
        assert_eq!((stats.hits, stats.misses), (4, 0));
    }
}
