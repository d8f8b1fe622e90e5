//! The simulated engine: ranks with their caches, the scheduler (concurrency limit, queue, KV
//! admission) and simulated time.
//!
//! A request's life: tokenize (off the reactor) -> wait for a running slot and for enough free
//! KV blocks -> with a CPU tier, load its CPU hits (`cpu_load_per_token` x their tokens; they
//! are cached on the GPU once loaded) -> prefill (sleep `prefill_base` + `prefill_per_token` x
//! uncached prompt tokens; the prompt's full blocks become cached and are published after it, or
//! before it with `--cache-prompt-at schedule`) -> decode
//! (`decode_per_token` per output token) -> the output's full blocks are cached too -> blocks
//! released tail first. So TTFT responds to cache hits and to load as on a real engine.
//! [`Admitted`] releases its blocks and counters on drop, so an abandoned request never leaks
//! capacity.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_core::hash::{BlockHasher, BlockKey, Engine as EngineKind, ExtraKeys};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::config::{CacheAt, SimConfig};
use crate::events::KvEvent;
use crate::kv::{Allocation, Hit, KvCache, KvError};
use crate::prompt::{fake_output, hash_view, Encoded, Encoder, MediaItem};

/// Locks a mutex, taking the data even if a panicking thread poisoned it (the cache stays
/// consistent between calls: every mutation completes under one lock).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a request fails.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The body is not a valid request.
    #[error(transparent)]
    Prompt(#[from] kvroute_core::prompt::PromptError),
    /// The request can never fit in the cache.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The hasher rejected the request's extras.
    #[error("cannot hash this request: {0}")]
    Hash(#[from] kvroute_core::hash::HashError),
    /// The engine is shutting down.
    #[error("engine is shutting down")]
    Shutdown,
}

/// One data-parallel rank: its cache and its wake-ups.
#[derive(Debug)]
pub struct Rank {
    /// Rank index (port offset, `dp_rank` in batches).
    pub idx: u32,
    /// The paged cache.
    pub kv: Mutex<KvCache>,
    /// Signalled when blocks are released (waiting requests retry admission).
    pub freed: Notify,
    /// Signalled when events are pending (the publisher takes them: one batch per step).
    pub step: Notify,
    /// TensorRT-LLM with a sliding window: the next envelope's `event_id` (one cache event
    /// becomes an envelope per window, all numbered in one sequence as the engine numbers them).
    pub trtllm_next_id: std::sync::atomic::AtomicU64,
}

/// Totals for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests finished.
    pub requests: AtomicU64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: AtomicU64,
    /// Of which served from the cache (GPU hits and CPU-tier loads, as reported in usage).
    pub cached_tokens: AtomicU64,
    /// Prompt tokens hit in the GPU cache (vLLM's `prefix_cache_hits`).
    pub local_hit_tokens: AtomicU64,
    /// With a CPU tier: prompt tokens looked up there, i.e. past the GPU hits (vLLM's
    /// `external_prefix_cache_queries`).
    pub cpu_query_tokens: AtomicU64,
    /// With a CPU tier: prompt tokens loaded from it (vLLM's `external_prefix_cache_hits`).
    pub cpu_hit_tokens: AtomicU64,
    /// Output tokens.
    pub generation_tokens: AtomicU64,
}

/// The engine shared by every handler.
#[derive(Debug)]
pub struct Engine {
    /// Configuration.
    pub cfg: SimConfig,
    /// Name in `x-kvroute-sim`.
    pub name: String,
    /// Tokenizer.
    pub encoder: Encoder,
    /// Ranks (one unless `--dp-ranks`).
    pub ranks: Vec<Rank>,
    rr: AtomicUsize,
    slots: Arc<Semaphore>,
    /// Requests prefilling or decoding.
    pub running: AtomicU64,
    /// Requests queued for a slot or for KV space.
    pub waiting: AtomicU64,
    /// Totals.
    pub counters: Counters,
    next_id: AtomicU64,
    /// Process start, for `created` fields.
    pub started: Instant,
}

/// What one finished request reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
}

/// A request holding a running slot and its KV blocks.
pub struct Admitted {
    engine: Arc<Engine>,
    rank: usize,
    alloc: Option<Allocation>,
    hasher: BlockHasher,
    keys: Vec<BlockKey>,
    /// Prompt then output tokens.
    seq: Vec<u32>,
    prompt_len: usize,
    /// Generated text, word by word.
    words: Vec<String>,
    /// Output token ids.
    output_ids: Vec<u32>,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Where the prompt hit (GPU blocks, then CPU-tier blocks loaded).
    hit: Hit,
    salt: Option<String>,
    /// The prompt's media items (their blocks are hashed and published with them).
    media: Vec<MediaItem>,
    _permit: OwnedSemaphorePermit,
}

impl Admitted {
    /// Usage so far (complete once decoded).
    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.output_ids.len(),
            cached_tokens: self.cached_tokens,
        }
    }

    /// Runs prefill: the CPU-tier hits are loaded (simulated time for their tokens, then they
    /// are cached on the GPU), then simulated time for the uncached tokens, then the prompt's
    /// full blocks are cached. With `--cache-prompt-at schedule` and no CPU-tier load they are
    /// cached before the prefill's time, as vLLM's scheduler caches them when it schedules the
    /// prefill (a load delays caching there too).
    pub async fn prefill(&mut self) {
        let bs = self.engine.cfg.contract.block_size.get();
        let at_schedule = self.hit.cpu == 0 && self.engine.cfg.cache_prompt_at == CacheAt::Schedule;
        if self.hit.cpu > 0 {
            let loaded = (self.hit.cpu * bs) as u32;
            tokio::time::sleep(self.engine.cfg.cpu_load_per_token * loaded).await;
            self.commit((self.hit.gpu + self.hit.cpu) * bs);
        } else if at_schedule {
            self.commit(self.prompt_len);
        }
        let uncached = (self.prompt_len - self.cached_tokens) as u32;
        let cfg = &self.engine.cfg;
        tokio::time::sleep(cfg.prefill_base + cfg.prefill_per_token * uncached).await;
        if !at_schedule {
            self.commit(self.prompt_len);
        }
    }

    /// Takes the output's words with the time each one is decoded, decode starting at `start`:
    /// the words share the decode time of every output token, the last one ending it.
    pub fn take_words(
        &mut self,
        start: tokio::time::Instant,
    ) -> Vec<(String, tokio::time::Instant)> {
        let total = self.engine.decode_time(self.output_ids.len());
        let words = std::mem::take(&mut self.words);
        let n = words.len().max(1) as u32;
        words
            .into_iter()
            .enumerate()
            .map(|(i, w)| (w, start + total * (i as u32 + 1) / n))
            .collect()
    }

    /// Caches the output's full blocks, releases everything and counts the request.
    pub fn finish(mut self) -> Usage {
        self.commit(self.seq.len());
        let usage = self.usage();
        let c = &self.engine.counters;
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        c.cached_tokens
            .fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
        let bs = self.engine.cfg.contract.block_size.get();
        let local = self.hit.gpu * bs;
        c.local_hit_tokens
            .fetch_add(local as u64, Ordering::Relaxed);
        if self.engine.cfg.cpu_blocks > 0 {
            c.cpu_query_tokens
                .fetch_add((usage.prompt_tokens - local) as u64, Ordering::Relaxed);
            c.cpu_hit_tokens
                .fetch_add((self.hit.cpu * bs) as u64, Ordering::Relaxed);
        }
        c.generation_tokens
            .fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
        usage
    }

    /// Hashes and caches the full blocks of `seq[..upto]` (and writes them to the CPU tier).
    fn commit(&mut self, upto: usize) {
        let bs = self.hasher.block_size().get();
        let full = upto / bs;
        while self.keys.len() < full {
            let i = self.keys.len();
            let view = hash_view(&self.seq[i * bs..(i + 1) * bs], i * bs, &self.media);
            match self.hasher.push_block(&view) {
                Some(k) => self.keys.push(k),
                None => break,
            }
        }
        let rank = &self.engine.ranks[self.rank];
        let keys = &self.keys[..full.min(self.keys.len())];
        if let Some(alloc) = self.alloc.as_mut() {
            lock(&rank.kv).commit_with_media(
                alloc,
                keys,
                &self.seq,
                self.salt.as_deref(),
                &self.media,
            );
        }
        rank.step.notify_one();
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let rank = &self.engine.ranks[self.rank];
        if let Some(alloc) = self.alloc.take() {
            lock(&rank.kv).release(alloc);
        }
        self.engine.running.fetch_sub(1, Ordering::Relaxed);
        rank.freed.notify_waiters();
    }
}

/// Decrements a gauge when dropped (a cancelled wait still leaves the queue).
struct GaugeGuard<'a>(&'a AtomicU64);

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Engine {
    /// Builds the engine; ranks start empty (SGLang and TensorRT-LLM record their start event).
    pub fn new(cfg: SimConfig, name: String, encoder: Encoder) -> Arc<Self> {
        let record = match cfg.engine {
            EngineKind::Llamacpp => 0,
            _ => cfg.event_buffer,
        };
        let ranks = (0..cfg.dp_ranks)
            .map(|idx| {
                let mut kv = KvCache::new(cfg.kv_blocks, cfg.contract.block_size.get(), record)
                    .with_cpu_tier(cfg.cpu_blocks);
                if matches!(cfg.engine, EngineKind::Sglang | EngineKind::Trtllm) {
                    kv.push_event(KvEvent::Cleared);
                }
                Rank {
                    idx,
                    kv: Mutex::new(kv),
                    trtllm_next_id: Default::default(),
                    freed: Notify::new(),
                    step: Notify::new(),
                }
            })
            .collect();
        Arc::new(Engine {
            slots: Arc::new(Semaphore::new(cfg.max_concurrency)),
            cfg,
            name,
            encoder,
            ranks,
            rr: AtomicUsize::new(0),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            counters: Counters::default(),
            next_id: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Unix seconds now.
    pub fn unix_now() -> f64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    }

    /// The request's block keys under the engine's contract.
    pub fn keys_for(
        &self,
        tokens: &[u32],
        cache_salt: Option<&str>,
    ) -> Result<Vec<BlockKey>, SimError> {
        let extra = ExtraKeys {
            cache_salt: cache_salt.map(str::to_string),
            lora: self.cfg.lora.clone(),
            ..Default::default()
        };
        Ok(self.cfg.contract.keys(tokens, &extra)?)
    }

    /// Queues the request for a slot and KV space, then holds both.
    pub async fn admit(self: &Arc<Self>, enc: Encoded) -> Result<Admitted, SimError> {
        let salt = enc.cache_salt.clone();
        let extra = ExtraKeys {
            cache_salt: salt.clone(),
            lora: self.cfg.lora.clone(),
            ..Default::default()
        };
        let mut hasher = self.cfg.contract.hasher(&extra)?;
        let keys = hasher.push_tokens(&hash_view(&enc.tokens, 0, &enc.media));
        let n_out = enc.max_tokens.unwrap_or(self.cfg.default_max_tokens);
        let text = fake_output(&enc.tokens, n_out);
        let words: Vec<String> = if n_out == 0 {
            Vec::new()
        } else {
            text.split(' ').map(str::to_string).collect()
        };
        let output_ids = if n_out == 0 {
            Vec::new()
        } else {
            self.encoder.encode_text(&text)
        };
        let prompt_len = enc.tokens.len();
        let mut seq = enc.tokens;
        seq.extend_from_slice(&output_ids);
        let rank = self.rr.fetch_add(1, Ordering::Relaxed) % self.ranks.len();
        let r = &self.ranks[rank];

        self.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = GaugeGuard(&self.waiting);
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| SimError::Shutdown)?;
        let alloc = loop {
            let notified = r.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(a) = lock(&r.kv).try_admit(&keys, prompt_len, seq.len())? {
                break a;
            }
            notified.await;
        };
        drop(waiting);
        self.running.fetch_add(1, Ordering::Relaxed);
        // Evictions made room: publish them with this step.
        r.step.notify_one();
        let hit = alloc.hit();
        let cached_tokens = hit.cached_tokens(self.cfg.contract.block_size.get(), prompt_len);
        // The hasher has consumed every full prompt block: commit continues from there.
        Ok(Admitted {
            engine: self.clone(),
            rank,
            alloc: Some(alloc),
            hasher,
            keys,
            seq,
            prompt_len,
            words,
            output_ids,
            cached_tokens,
            hit,
            salt,
            media: enc.media,
            _permit: permit,
        })
    }

    /// Per rank: leading blocks of `keys` cached on the GPU, and the blocks right after them
    /// that the CPU tier holds.
    pub fn match_keys(&self, keys: &[BlockKey]) -> Vec<(usize, usize)> {
        self.ranks
            .iter()
            .map(|r| {
                let kv = lock(&r.kv);
                let gpu = kv.match_prefix(keys);
                (gpu, kv.cpu_match(keys, gpu))
            })
            .collect()
    }

    /// Per rank: where a prompt of `prompt_len` tokens with these keys would hit now.
    pub fn plan(&self, keys: &[BlockKey], prompt_len: usize) -> Vec<Hit> {
        self.ranks
            .iter()
            .map(|r| lock(&r.kv).plan(keys, prompt_len))
            .collect()
    }

    /// Mean KV usage over ranks, 0..1.
    pub fn kv_usage(&self) -> f64 {
        let n = self.ranks.len().max(1) as f64;
        self.ranks.iter().map(|r| lock(&r.kv).usage()).sum::<f64>() / n
    }

    /// Forgets every cached block on every rank (vLLM `/reset_prefix_cache`); `external`
    /// (vLLM's `reset_external`) forgets the CPU tier's blocks too.
    pub fn reset_prefix_cache(&self, external: bool) {
        let as_removals = self.cfg.engine == EngineKind::Trtllm;
        for r in &self.ranks {
            let mut kv = lock(&r.kv);
            kv.clear(as_removals);
            if external {
                kv.clear_cpu();
            }
            drop(kv);
            r.step.notify_one();
        }
    }

    /// The simulated duration of decoding `n` tokens.
    pub fn decode_time(&self, n: usize) -> Duration {
        self.cfg.decode_per_token * n as u32
    }
}
