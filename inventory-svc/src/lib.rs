//! `kvroute-inventory`: the service that knows which endpoint holds which KV blocks and answers
//! the filter's routing question.
//!
//! * [`fleet`] — the rule table and each rule's lifecycle: the one layer that changes live state
//!   (install, replace, remove, apply index operations, route and commit), with replication
//!   behind its [`fleet::Replication`] seam.
//! * [`ingest`] — engine event ingestion (vLLM/SGLang ZMQ, TensorRT-LLM drain), key modes, parity.
//! * [`index`] — the block inventory behind the [`index::BlockIndex`] trait (sync, no I/O).
//! * [`score`] — Tier 1.5 scoring (pure).
//! * [`api`] — axum routes; [`epp`] — the Gateway API Inference Extension endpoint picker
//!   (Envoy ext_proc over gRPC); both ask [`question`], the one routing question (tokenize,
//!   `Fleet::route`, the answer); [`metrics`] — Prometheus; [`health`] — health checks and load scrapes.
//! * [`replica`] — replication through Redis (the Redis [`fleet::Replication`]).
//! * [`rules`], [`settings`] — validated configuration; [`offload`] — offloaded tokenization.
//! * [`cli`] — the command line; [`server`] — wiring for the `serve` subcommand;
//!   [`listener`] — the bounded accept loop
//!   ([`tls`] when a certificate is given);
//!   [`preflight`] — the `hash` subcommand.

pub mod api;
pub mod canary;
pub mod cli;
pub mod epp;
pub mod fleet;
pub mod health;
pub mod index;
pub mod ingest;
pub mod listener;
pub mod metrics;
pub mod offload;
pub mod preflight;
pub mod question;
pub mod replica;
pub mod rules;
pub mod score;
pub mod server;
pub mod settings;
pub mod sync;
pub mod tls;

/// Test support: docs sections generated from code.
#[cfg(test)]
pub(crate) mod docgen {
    /// Checks that the text between `begin` and `end` in `docs/<file>` is `generated`; with
    /// `KVROUTE_WRITE_DOCS` set, writes it there instead. `regen` names the command that does.
    #[allow(clippy::unwrap_used, clippy::panic)]
    pub fn check(file: &str, begin: &str, end: &str, generated: &str, regen: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../docs")
            .join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let a = text.find(begin).map(|i| i + begin.len() + 1);
        let (Some(a), Some(b)) = (a, text.find(end)) else {
            panic!("docs/{file} lacks the {begin} ... {end} markers");
        };
        if std::env::var_os("KVROUTE_WRITE_DOCS").is_some() {
            std::fs::write(&path, format!("{}{generated}{}", &text[..a], &text[b..])).unwrap();
            return;
        }
        assert_eq!(
            &text[a..b],
            generated,
            "docs/{file}'s generated section differs from the code; regenerate with {regen}"
        );
    }
}
