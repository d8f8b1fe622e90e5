//! `kvroute-tests`: shared helpers for kvroute's end-to-end tests.
//!
//! * [`harness`] — real processes on 127.0.0.1: free ports, child guards and bounded readiness
//!   waits (from `kvroute-test-support`, shared with every suite), locating the cached Envoy /
//!   filter `.wasm` / tokenizer fixture, the reference prompt tokens, Envoy itself, an echo backend.
//! * [`wasm`] — a wasmi host that loads the built filter module and calls its test export.
//! * [`golden`] — the engines' golden block-key vectors as uniform cases.
//! * [`workload`] — the latency benchmarks' conversations and round-trip timing.
//!
//! Everything the tests need beyond cargo is installed by `scripts/setup.sh` (run by
//! `scripts/test.sh`); helpers fail with a message saying so when something is missing.

pub mod envoy;
pub mod golden;
pub mod harness;
pub mod wasm;
pub mod workload;
