//! Command-line flags of `kvroute-engine-sim`, validated into a [`SimConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvroute_core::hash::{BlockSize, Engine, ExtraKeysLayout, HashAlgo, HashContract};

/// Flags, as typed.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvroute-engine-sim",
    about = "An LLM inference engine simulator with a real paged KV cache and real KV events"
)]
pub struct SimArgs {
    /// HTTP address to serve the OpenAI API on (port 0 picks a free port; the bound address is
    /// printed as `listening on ADDR`).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Engine to imitate: vllm, sglang, trtllm, llamacpp.
    #[arg(long, default_value = "vllm")]
    pub engine: String,
    /// Tokens per KV block (vLLM --block-size, SGLang page size).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Block hash algorithm; default: the engine's (sha256_cbor, sha256_sglang, blockhash_trtllm).
    #[arg(long)]
    pub hash_algo: Option<String>,
    /// vLLM PYTHONHASHSEED (NONE_HASH seed); unset = vLLM's default.
    #[arg(long)]
    pub seed: Option<String>,
    /// KV cache capacity in blocks (per data-parallel rank).
    #[arg(long, default_value_t = 2048)]
    pub kv_blocks: usize,
    /// vLLM/SGLang: bind a ZMQ PUB on tcp://LISTEN_IP:PORT (rank r on PORT + r). Unset: no events.
    #[arg(long)]
    pub zmq_port: Option<u16>,
    /// vLLM: bind the replay ROUTER on tcp://LISTEN_IP:PORT (rank r on PORT + r).
    #[arg(long)]
    pub replay_port: Option<u16>,
    /// ZMQ topic (first frame).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Data-parallel ranks, each with its own cache and publisher; requests go round robin.
    #[arg(long, default_value_t = 1)]
    pub dp_ranks: u32,
    /// Directory with tokenizer.json (and tokenizer_config.json for chat); unset: word tokenizer.
    #[arg(long)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Simulated prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 20.0)]
    pub prefill_us_per_token: f64,
    /// Simulated decode cost per output token, microseconds.
    #[arg(long, default_value_t = 500.0)]
    pub decode_us_per_token: f64,
    /// Simulated cost of every prefill, cached or not, microseconds: the scheduler step the
    /// prefill runs in and the server's own work before the first token (real vLLM on CPU: about
    /// 50 ms; see docs/simulator.md).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_base_us: f64,
    /// Requests running at once; the rest wait in a queue.
    #[arg(long, default_value_t = 8)]
    pub max_concurrency: usize,
    /// Output tokens when the request gives no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Replay buffer (vLLM buffer_steps) and TensorRT-LLM event buffer size.
    #[arg(long, default_value_t = 10_000)]
    pub event_buffer: usize,
    /// Name in the `x-kvroute-sim` response header; default: the bound address.
    #[arg(long)]
    pub name: Option<String>,
    /// Publish as a hybrid-attention model whose sliding-window KV cache keeps the last N blocks
    /// of each stored run (0: full attention only): vLLM as a second KV-cache group, TensorRT-LLM
    /// as a second attention window (`window_size` N x block size) beside the full one.
    #[arg(long, default_value_t = 0)]
    pub sliding_window_blocks: usize,
    /// vLLM only: serve every request through the LoRA adapter `NAME=PATH` (vLLM's
    /// `--lora-modules NAME=PATH` with clients naming the adapter): block keys mix in the
    /// adapter and events name it (`lora_id` 1, `lora_name` NAME).
    #[arg(long)]
    pub lora_adapter: Option<String>,
    /// Drop each request's `cache_salt`, as an engine without cache_salt support does: salted
    /// requests get the unsalted keys and share their cache.
    #[arg(long)]
    pub ignore_cache_salt: bool,
    /// vLLM: how block extra keys (LoRA, cache salt) enter the hash: tagged (vLLM 0.31 and
    /// later) or flat (before 0.31).
    #[arg(long, default_value = "tagged")]
    pub extra_keys: String,
    /// vLLM only: a CPU (host-memory) KV tier of N blocks per rank, as vLLM's KV offloading
    /// (`OffloadingConnector` with `num_cpu_blocks` N): computed blocks are written to it, a
    /// lookup continues there after the GPU hits, and its changes are published with medium
    /// CPU. 0: none.
    #[arg(long, default_value_t = 0)]
    pub cpu_blocks: usize,
    /// Simulated cost of loading one prompt token's KV from the CPU tier, microseconds.
    #[arg(long, default_value_t = 5.0)]
    pub cpu_load_us_per_token: f64,
    /// When a prompt's new full blocks are cached (and published): `prefill-end`, once its
    /// prefill has run, or `schedule`, when the request is admitted, as vLLM's scheduler caches
    /// the blocks it schedules a prefill for (requests admitted after it hit them at once).
    #[arg(long, default_value = "prefill-end")]
    pub cache_prompt_at: String,
}

/// When a prompt's new full blocks are cached (`--cache-prompt-at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheAt {
    /// Once the prefill's simulated time has passed.
    PrefillEnd,
    /// When the request is admitted (vLLM v1 `KVCacheManager.allocate_slots`).
    Schedule,
}

impl CacheAt {
    /// The flag's value: `prefill-end` or `schedule`.
    pub fn parse(s: &str) -> Result<CacheAt, ConfigError> {
        match s {
            "prefill-end" => Ok(CacheAt::PrefillEnd),
            "schedule" => Ok(CacheAt::Schedule),
            _ => Err(ConfigError::CacheAt(s.to_string())),
        }
    }

    /// The flag's value for this moment.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheAt::PrefillEnd => "prefill-end",
            CacheAt::Schedule => "schedule",
        }
    }
}

/// Why flags are invalid; each message names the flag, the value and what is allowed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// Unknown engine.
    #[error("--engine {0:?} is not an engine; allowed: vllm, sglang, trtllm, llamacpp")]
    Engine(String),
    /// Unknown algorithm.
    #[error("--hash-algo {0:?} is not an algorithm; allowed: sha256_cbor, xxhash_cbor, sha256_sglang, blockhash_trtllm, tokens")]
    Algo(String),
    /// Algorithm not published by the engine.
    #[error("--hash-algo {algo} is not what --engine {engine} publishes; allowed: {allowed}")]
    AlgoForEngine {
        /// The algorithm.
        algo: String,
        /// The engine.
        engine: String,
        /// The engine's algorithms.
        allowed: String,
    },
    /// Zero where at least one is needed.
    #[error("--{flag} must be >= 1, got 0")]
    Zero {
        /// The flag.
        flag: &'static str,
    },
    /// Unknown `--cache-prompt-at`.
    #[error("--cache-prompt-at {0:?} is not a moment; allowed: prefill-end, schedule")]
    CacheAt(String),
    /// A cost that is not a finite non-negative number.
    #[error("--{flag} must be a finite number >= 0, got {value}")]
    Cost {
        /// The flag.
        flag: &'static str,
        /// The value.
        value: f64,
    },
    /// Ports must leave room for every rank.
    #[error("--{flag} {port} + --dp-ranks {ranks} exceeds 65535")]
    PortRange {
        /// The flag.
        flag: &'static str,
        /// The port.
        port: u16,
        /// Ranks.
        ranks: u32,
    },
    /// `--extra-keys` not a layout.
    #[error("--extra-keys {0:?} is not a layout; allowed: tagged, flat")]
    ExtraKeys(String),
    /// `--lora-adapter` malformed or given for another engine.
    #[error("--lora-adapter {0:?}: give NAME=PATH, with --engine vllm")]
    Lora(String),
    /// A CPU tier asked of an engine that has none here.
    #[error("--cpu-blocks {blocks} needs --engine vllm (vLLM's KV offloading); allowed engines: vllm; got --engine {engine}")]
    CpuTier {
        /// The flag's value.
        blocks: usize,
        /// The engine.
        engine: String,
    },
    /// The hash contract is unusable (e.g. xxhash_cbor without a seed).
    #[error("--hash-algo/--seed: {0}")]
    Contract(String),
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// HTTP address.
    pub listen: SocketAddr,
    /// Engine imitated.
    pub engine: Engine,
    /// Contract of the published keys (llama.cpp: kvroute's content key, kept internal).
    pub contract: HashContract,
    /// Blocks per rank.
    pub kv_blocks: usize,
    /// PUB base port.
    pub zmq_port: Option<u16>,
    /// Replay base port.
    pub replay_port: Option<u16>,
    /// ZMQ topic.
    pub topic: String,
    /// Data-parallel ranks.
    pub dp_ranks: u32,
    /// Tokenizer directory.
    pub tokenizer_dir: Option<PathBuf>,
    /// Served model name.
    pub model: String,
    /// Prefill cost per uncached token.
    pub prefill_per_token: Duration,
    /// Decode cost per output token.
    pub decode_per_token: Duration,
    /// Cost of every prefill on top of its uncached tokens.
    pub prefill_base: Duration,
    /// Running requests at most.
    pub max_concurrency: usize,
    /// Default output length.
    pub default_max_tokens: usize,
    /// Replay / TensorRT-LLM buffer.
    pub event_buffer: usize,
    /// Header name; `None` until the listener is bound.
    pub name: Option<String>,
    /// Hybrid-attention imitation: the sliding-window group's window in blocks (`None`: off).
    pub sliding_window: Option<usize>,
    /// `--lora-adapter`: the adapter's (name, path).
    pub lora: Option<(String, String)>,
    /// `--ignore-cache-salt`.
    pub ignore_cache_salt: bool,
    /// CPU-tier blocks per rank (0: no CPU tier).
    pub cpu_blocks: usize,
    /// Cost of loading one token's KV from the CPU tier.
    pub cpu_load_per_token: Duration,
    /// When a prompt's new full blocks are cached.
    pub cache_prompt_at: CacheAt,
}

impl TryFrom<SimArgs> for SimConfig {
    type Error = ConfigError;

    fn try_from(a: SimArgs) -> Result<Self, ConfigError> {
        let engine =
            Engine::parse(&a.engine).ok_or_else(|| ConfigError::Engine(a.engine.clone()))?;
        let algo = match &a.hash_algo {
            Some(s) => HashAlgo::parse(s).ok_or_else(|| ConfigError::Algo(s.clone()))?,
            None => engine.default_algo().unwrap_or(HashAlgo::Tokens),
        };
        if engine != Engine::Llamacpp && !engine.algos().contains(&algo) {
            return Err(ConfigError::AlgoForEngine {
                algo: algo.as_str().to_string(),
                engine: engine.as_str().to_string(),
                allowed: engine
                    .algos()
                    .iter()
                    .map(|a| a.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let block_size =
            BlockSize::new(a.block_size).ok_or(ConfigError::Zero { flag: "block-size" })?;
        let mut contract = HashContract::new(algo, block_size);
        contract.seed = a.seed.clone();
        contract.extra_layout = ExtraKeysLayout::parse(&a.extra_keys)
            .ok_or_else(|| ConfigError::ExtraKeys(a.extra_keys.clone()))?;
        contract
            .hasher(&Default::default())
            .map_err(|e| ConfigError::Contract(e.to_string()))?;
        let lora = match &a.lora_adapter {
            None => None,
            Some(s) => match s.split_once('=') {
                Some((name, path))
                    if engine == Engine::Vllm && !name.is_empty() && !path.is_empty() =>
                {
                    Some((name.to_string(), path.to_string()))
                }
                _ => return Err(ConfigError::Lora(s.clone())),
            },
        };
        for (flag, v) in [
            ("kv-blocks", a.kv_blocks),
            ("max-concurrency", a.max_concurrency),
            ("event-buffer", a.event_buffer),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { flag });
            }
        }
        if a.cpu_blocks > 0 && engine != Engine::Vllm {
            return Err(ConfigError::CpuTier {
                blocks: a.cpu_blocks,
                engine: engine.as_str().to_string(),
            });
        }
        if a.dp_ranks == 0 {
            return Err(ConfigError::Zero { flag: "dp-ranks" });
        }
        for (flag, port) in [("zmq-port", a.zmq_port), ("replay-port", a.replay_port)] {
            if let Some(p) = port {
                if u32::from(p) + a.dp_ranks - 1 > 65_535 {
                    return Err(ConfigError::PortRange {
                        flag,
                        port: p,
                        ranks: a.dp_ranks,
                    });
                }
            }
        }
        let cost = |flag: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(Duration::from_nanos((v * 1000.0) as u64))
            } else {
                Err(ConfigError::Cost { flag, value: v })
            }
        };
        Ok(SimConfig {
            listen: a.listen,
            engine,
            contract,
            kv_blocks: a.kv_blocks,
            zmq_port: a.zmq_port,
            replay_port: a.replay_port,
            topic: a.topic,
            dp_ranks: a.dp_ranks,
            tokenizer_dir: a.tokenizer_dir,
            model: a.model,
            prefill_per_token: cost("prefill-us-per-token", a.prefill_us_per_token)?,
            decode_per_token: cost("decode-us-per-token", a.decode_us_per_token)?,
            prefill_base: cost("prefill-base-us", a.prefill_base_us)?,
            max_concurrency: a.max_concurrency,
            default_max_tokens: a.default_max_tokens,
            event_buffer: a.event_buffer,
            name: a.name,
            sliding_window: (a.sliding_window_blocks > 0).then_some(a.sliding_window_blocks),
            lora,
            ignore_cache_salt: a.ignore_cache_salt,
            cpu_blocks: a.cpu_blocks,
            cpu_load_per_token: cost("cpu-load-us-per-token", a.cpu_load_us_per_token)?,
            cache_prompt_at: CacheAt::parse(&a.cache_prompt_at)?,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(args: &[&str]) -> Result<SimConfig, ConfigError> {
        let mut v = vec!["sim"];
        v.extend_from_slice(args);
        SimConfig::try_from(SimArgs::parse_from(v))
    }

    #[test]
    fn defaults_and_errors() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.engine, Engine::Vllm);
        assert_eq!(c.contract.algo, HashAlgo::Sha256Cbor);
        assert_eq!(
            parse(&["--engine", "sglang"]).unwrap().contract.algo,
            HashAlgo::Sha256Sglang
        );
        assert_eq!(
            parse(&["--engine", "llamacpp"]).unwrap().contract.algo,
            HashAlgo::Tokens
        );
        assert_eq!(
            parse(&["--engine", "sglang", "--hash-algo", "sha256_cbor"])
                .unwrap_err()
                .to_string(),
            "--hash-algo sha256_cbor is not what --engine sglang publishes; allowed: sha256_sglang"
        );
        assert_eq!(
            parse(&["--engine", "x"]).unwrap_err(),
            ConfigError::Engine("x".into())
        );
        assert_eq!(
            parse(&["--kv-blocks", "0"]).unwrap_err(),
            ConfigError::Zero { flag: "kv-blocks" }
        );
        assert!(matches!(
            parse(&["--hash-algo", "xxhash_cbor"]),
            Err(ConfigError::Contract(_))
        ));
        assert!(parse(&["--hash-algo", "xxhash_cbor", "--seed", "0"]).is_ok());
        assert!(matches!(
            parse(&["--zmq-port", "65535", "--dp-ranks", "2"]),
            Err(ConfigError::PortRange { .. })
        ));
        assert_eq!(
            parse(&["--lora-adapter", "a=/p"]).unwrap().lora,
            Some(("a".into(), "/p".into()))
        );
        assert_eq!(
            parse(&["--extra-keys", "flat"])
                .unwrap()
                .contract
                .extra_layout,
            ExtraKeysLayout::Flat
        );
        assert_eq!(
            parse(&["--extra-keys", "x"]).unwrap_err(),
            ConfigError::ExtraKeys("x".into())
        );
        let c = parse(&["--cpu-blocks", "64", "--cpu-load-us-per-token", "2.5"]).unwrap();
        assert_eq!(c.cpu_blocks, 64);
        assert_eq!(c.cpu_load_per_token, Duration::from_nanos(2500));
        assert_eq!(parse(&[]).unwrap().cpu_blocks, 0);
        assert_eq!(
            parse(&[]).unwrap().cpu_load_per_token,
            Duration::from_micros(5)
        );
        for engine in ["sglang", "trtllm", "llamacpp"] {
            assert_eq!(
                parse(&["--engine", engine, "--cpu-blocks", "8"])
                    .unwrap_err()
                    .to_string(),
                format!("--cpu-blocks 8 needs --engine vllm (vLLM's KV offloading); allowed engines: vllm; got --engine {engine}")
            );
            assert!(parse(&["--engine", engine, "--cpu-blocks", "0"]).is_ok());
        }
        assert_eq!(parse(&[]).unwrap().cache_prompt_at, CacheAt::PrefillEnd);
        assert_eq!(
            parse(&["--cache-prompt-at", "schedule"])
                .unwrap()
                .cache_prompt_at,
            CacheAt::Schedule
        );
        assert_eq!(
            parse(&["--cache-prompt-at", "later"])
                .unwrap_err()
                .to_string(),
            "--cache-prompt-at \"later\" is not a moment; allowed: prefill-end, schedule"
        );
        assert_eq!(
            parse(&["--prefill-base-us", "50000"]).unwrap().prefill_base,
            Duration::from_millis(50)
        );
        assert!(matches!(
            parse(&["--prefill-base-us=-1"]),
            Err(ConfigError::Cost {
                flag: "prefill-base-us",
                ..
            })
        ));
        assert!(matches!(
            parse(&["--cpu-load-us-per-token=-1"]),
            Err(ConfigError::Cost {
                flag: "cpu-load-us-per-token",
                ..
            })
        ));
        for bad in [
            &["--lora-adapter", "a"][..],
            &["--lora-adapter", "=/p"],
            &["--engine", "sglang", "--lora-adapter", "a=/p"],
        ] {
            assert!(matches!(parse(bad), Err(ConfigError::Lora(_))), "{bad:?}");
        }
    }
}
