//! `kvroute-core`: everything the filter (wasm32) and the inventory service (native) must agree on.
//!
//! * [`hash`] — block keys for every engine contract (vLLM `sha256_cbor`/`xxhash_cbor`, SGLang
//!   `sha256_sglang`, TensorRT-LLM `blockhash_trtllm`) and kvroute's own content key (`tokens`).
//! * [`tokenize`], [`chat`], [`prompt`] — HuggingFace tokenizers, chat templates and OpenAI bodies
//!   turned into the token ids the engine would see.
//! * [`slug`] — model name to tokenizer directory name.
//! * [`affinity`] — the affinity key the sticky fallback keeps together.
//! * [`rule`] — the load-balancer rule model and its validation.
//! * [`wire`] — the service's JSON contracts with the filter: rule contract, route question and answer.
//!
//! No tokio and no I/O: the crate compiles for `wasm32-unknown-unknown` and native alike.

pub mod affinity;
pub mod bpe;
pub mod chat;
pub mod hash;
pub mod prompt;
pub mod rule;
pub mod segments;
pub mod settings;
pub mod slug;
pub mod tokenize;
pub mod usage;
pub mod wire;
