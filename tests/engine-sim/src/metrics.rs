//! `/metrics` in each engine's own names, so scrapers written for the real engine work unchanged.
//!
//! * vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
//!   (and the pre-0.10 `vllm:gpu_cache_usage_perc`), `vllm:cache_config_info{num_gpu_blocks,block_size}`,
//!   `vllm:prefix_cache_queries_total`/`_hits_total` (tokens; hits in the GPU cache),
//!   `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total`;
//!   with a CPU tier also `vllm:external_prefix_cache_queries_total`/`_hits_total` (tokens looked
//!   up in and loaded from the tier, as vLLM counts its KV connector's hits).
//! * SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
//!   `sglang:cache_hit_rate`, `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`.
//! * llama.cpp: `llamacpp:requests_processing`, `llamacpp:requests_deferred`, `llamacpp:kv_cache_usage_ratio`.
//! * TensorRT-LLM (`trtllm-serve` answers JSON iteration stats): `numActiveRequests`,
//!   `numQueuedRequests`, `kvCacheStats`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use kvroute_core::hash::Engine as EngineKind;
use serde_json::json;

use crate::engine::{lock, Engine};

/// The body and its content type.
pub fn render(e: &Engine) -> (&'static str, String) {
    let running = e.running.load(Ordering::Relaxed);
    let waiting = e.waiting.load(Ordering::Relaxed);
    let usage = e.kv_usage();
    let c = &e.counters;
    let prompt = c.prompt_tokens.load(Ordering::Relaxed);
    let cached = c.cached_tokens.load(Ordering::Relaxed);
    let local_hits = c.local_hit_tokens.load(Ordering::Relaxed);
    let gen = c.generation_tokens.load(Ordering::Relaxed);
    let reqs = c.requests.load(Ordering::Relaxed);
    let model = &e.cfg.model;
    let mut s = String::new();
    match e.cfg.engine {
        EngineKind::Vllm => {
            let l = format!("engine=\"0\",model_name=\"{model}\"");
            gauge(
                &mut s,
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                &l,
                running as f64,
            );
            gauge(
                &mut s,
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                &l,
                waiting as f64,
            );
            gauge(
                &mut s,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                &l,
                usage,
            );
            gauge(
                &mut s,
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                &l,
                usage,
            );
            let info = format!(
                "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"",
                e.cfg.contract.block_size.get(),
                e.cfg.kv_blocks * e.ranks.len(),
                e.cfg.contract.algo
            );
            gauge(
                &mut s,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                &info,
                1.0,
            );
            counter(
                &mut s,
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                &l,
                prompt,
            );
            counter(
                &mut s,
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                &l,
                local_hits,
            );
            if e.cfg.cpu_blocks > 0 {
                counter(
                    &mut s,
                    "vllm:external_prefix_cache_queries",
                    "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
                    &l,
                    c.cpu_query_tokens.load(Ordering::Relaxed),
                );
                counter(
                    &mut s,
                    "vllm:external_prefix_cache_hits",
                    "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
                    &l,
                    c.cpu_hit_tokens.load(Ordering::Relaxed),
                );
            }
            counter(
                &mut s,
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                &l,
                prompt,
            );
            counter(
                &mut s,
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                &l,
                gen,
            );
            let ls = format!("{l},finished_reason=\"length\"");
            counter(
                &mut s,
                "vllm:request_success",
                "Count of successfully processed requests.",
                &ls,
                reqs,
            );
        }
        EngineKind::Sglang => {
            let l = format!("model_name=\"{model}\"");
            gauge(
                &mut s,
                "sglang:num_running_reqs",
                "The number of running requests.",
                &l,
                running as f64,
            );
            gauge(
                &mut s,
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                &l,
                waiting as f64,
            );
            gauge(&mut s, "sglang:token_usage", "The token usage.", &l, usage);
            let rate = if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            };
            gauge(
                &mut s,
                "sglang:cache_hit_rate",
                "The prefix cache hit rate.",
                &l,
                rate,
            );
            counter(
                &mut s,
                "sglang:prompt_tokens",
                "Number of prefill tokens processed.",
                &l,
                prompt,
            );
            counter(
                &mut s,
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                &l,
                gen,
            );
            counter(
                &mut s,
                "sglang:num_requests",
                "Number of requests processed.",
                &l,
                reqs,
            );
        }
        EngineKind::Llamacpp => {
            gauge(
                &mut s,
                "llamacpp:requests_processing",
                "Number of requests processing.",
                "",
                running as f64,
            );
            gauge(
                &mut s,
                "llamacpp:requests_deferred",
                "Number of requests deferred.",
                "",
                waiting as f64,
            );
            gauge(
                &mut s,
                "llamacpp:kv_cache_usage_ratio",
                "KV-cache usage. 1 means 100 percent usage.",
                "",
                usage,
            );
            counter(
                &mut s,
                "llamacpp:prompt_tokens",
                "Number of prompt tokens processed.",
                "",
                prompt,
            );
            counter(
                &mut s,
                "llamacpp:tokens_predicted",
                "Number of generation tokens processed.",
                "",
                gen,
            );
        }
        EngineKind::Trtllm => {
            let (max, free) = e.ranks.iter().fold((0, 0), |(m, f), r| {
                let st = lock(&r.kv).stats();
                (m + st.capacity, f + st.free)
            });
            let body = json!([{
                "numActiveRequests": running,
                "numQueuedRequests": waiting,
                "kvCacheStats": {"maxNumBlocks": max, "freeNumBlocks": free, "usedNumBlocks": max - free,
                                 "tokensPerBlock": e.cfg.contract.block_size.get()},
            }]);
            return ("application/json", body.to_string());
        }
    }
    ("text/plain; version=0.0.4; charset=utf-8", s)
}

fn braces(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

fn gauge(s: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let l = braces(labels);
    let _ = writeln!(
        s,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{l} {v:?}"
    );
}

fn counter(s: &mut String, name: &str, help: &str, labels: &str, v: u64) {
    let l = braces(labels);
    let _ = writeln!(
        s,
        "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{l} {v}.0"
    );
}
