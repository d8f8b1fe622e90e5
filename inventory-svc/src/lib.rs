//! `kvroute-inventory`: the service that knows which endpoint holds which KV blocks and answers
//! the filter's routing question.
//!
//! * [`ingest`] — engine event ingestion (vLLM/SGLang ZMQ, TensorRT-LLM drain), key modes, parity.
//! * [`index`] — the block inventory behind the [`index::BlockIndex`] trait (sync, no I/O).
//! * [`score`] — Tier 1.5 scoring (pure).
//! * [`api`] — axum routes; [`metrics`] — Prometheus; [`health`] — health checks and load scrapes.
//! * [`rules`], [`settings`], [`state`] — validated configuration and shared runtime state.
//! * [`server`] — wiring for the `serve` subcommand; [`listener`] — the bounded accept loop
//!   ([`tls`] when a certificate is given);
//!   [`preflight`] — the `hash` subcommand.

pub mod api;
pub mod health;
pub mod index;
pub mod ingest;
pub mod listener;
pub mod metrics;
pub mod preflight;
pub mod replica;
pub mod rules;
pub mod score;
pub mod server;
pub mod settings;
pub mod state;
pub mod tls;
