//! The parity canary's verdict on an endpoint (`/healthz` `canary`), kept in [`super::EpRuntime`];
//! the canary itself is `crate::canary`.

use serde::Serialize;

/// The requests of one run, in the order they are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// `POST /v1/completions` of a plain text: no chat template, so its tokens check the tokenizer.
    Completion,
    /// `POST /v1/chat/completions`: its tokens check the chat template.
    Chat,
    /// The same chat again: the engine's `cached_tokens` against the inventory's prediction.
    ChatRepeat,
    /// Another chat with a `cache_salt`: the salt's place in the keys.
    Salted,
}

impl Probe {
    pub fn as_str(self) -> &'static str {
        match self {
            Probe::Completion => "completion",
            Probe::Chat => "chat",
            Probe::ChatRepeat => "chat_repeat",
            Probe::Salted => "salted",
        }
    }
}

/// The verdict: healthy, or the leg of the contract the run found wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Leg {
    /// Tokens, keys and reuse agree with the rule's contract.
    Healthy,
    /// The completion's tokens differ: the rule's tokenizer is not the engine's.
    Tokenizer,
    /// The completion's tokens agree, the chat's differ: the chat template is not the engine's.
    ChatTemplate,
    /// Tokens agree, keys differ, and they match with another block size.
    BlockSize,
    /// ... with another seed (the engine's `PYTHONHASHSEED`).
    Seed,
    /// ... with another algorithm.
    Algorithm,
    /// ... and the engine served the request through a LoRA adapter, whose keys mix in the adapter.
    Lora,
    /// The unsalted chat's keys agree, the salted one's differ.
    CacheSalt,
    /// Tokens agree, keys differ, and no tried contract explains them.
    Hash,
    /// The engine reused none of the repeated chat's tokens the inventory predicted it holds.
    NoReuse,
    /// No event of the canary's prompts arrived: KV events off, prefix caching off or the
    /// subscriber not connected.
    NoEvents,
    /// The engine did not answer a request (the run is inconclusive, not failing).
    Unreachable,
}

impl Leg {
    pub const ALL: [Leg; 12] = [
        Leg::Healthy,
        Leg::Tokenizer,
        Leg::ChatTemplate,
        Leg::BlockSize,
        Leg::Seed,
        Leg::Algorithm,
        Leg::Lora,
        Leg::CacheSalt,
        Leg::Hash,
        Leg::NoReuse,
        Leg::NoEvents,
        Leg::Unreachable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Healthy => "healthy",
            Leg::Tokenizer => "tokenizer",
            Leg::ChatTemplate => "chat_template",
            Leg::BlockSize => "block_size",
            Leg::Seed => "seed",
            Leg::Algorithm => "algorithm",
            Leg::Lora => "lora",
            Leg::CacheSalt => "cache_salt",
            Leg::Hash => "hash",
            Leg::NoReuse => "no_reuse",
            Leg::NoEvents => "no_events",
            Leg::Unreachable => "unreachable",
        }
    }

    /// A leg of the contract is wrong (`/healthz` degraded, `kvroute_endpoint_canary_failing`).
    pub fn failing(self) -> bool {
        !matches!(self, Leg::Healthy | Leg::Unreachable)
    }
}

/// One run's verdict on one endpoint (`/healthz` `canary`).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct CanaryVerdict {
    pub verdict: Leg,
    /// What was seen and what to change.
    pub message: String,
    /// When the run ended, Unix seconds.
    pub at: u64,
    pub probes: Vec<ProbeReport>,
}

/// One request of a run.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ProbeReport {
    pub probe: Probe,
    /// Prompt tokens as kvroute tokenized them.
    pub tokens: usize,
    /// `usage.prompt_tokens` of the engine's answer.
    pub engine_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `chat_repeat`: the tokens the inventory predicted the engine to reuse.
    pub predicted_tokens: Option<u64>,
    /// `match`, `tokens`, `count`, `keys`, `tokens_only` (TensorRT-LLM: tokens and tokens per
    /// block agree, the engine's keys are not kvroute's and were not compared), `no_event`, or
    /// `not_sent`.
    pub finding: String,
}
