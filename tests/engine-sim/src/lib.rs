//! `kvroute-engine-sim`: an inference engine as a router sees it, without a GPU.
//!
//! It serves the OpenAI API with real tokenization (kvroute-core), keeps a paged KV cache with
//! prefix sharing and LRU eviction ([`kv`]) and, for vLLM, an optional CPU tier as vLLM's KV
//! offloading keeps one ([`cpu`]), hashes blocks under the engine's real contract and
//! publishes the engine's real KV events ([`events`], [`publish`]): vLLM and SGLang over ZMQ
//! (map layout, sequence numbers, replay), TensorRT-LLM through `POST /kv_cache_events`;
//! llama.cpp mode publishes nothing. Simulated time ([`engine`]) makes TTFT depend on cache hits
//! and load. [`bench`] is the workload driver behind `kvroute-bench`.

pub mod bench;
pub mod config;
pub mod cpu;
pub mod engine;
pub mod events;
pub mod kv;
pub mod metrics;
pub mod prompt;
pub mod publish;
pub mod server;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::SimConfig;
use crate::engine::Engine;
use crate::prompt::Encoder;

/// A started simulator: its bound address and the engine.
#[derive(Debug, Clone)]
pub struct Running {
    /// Bound HTTP address.
    pub addr: std::net::SocketAddr,
    /// The engine.
    pub engine: Arc<Engine>,
}

/// Logs to stderr at `RUST_LOG`'s level (default `warn`): what both binaries start with.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Binds every socket, then serves until `cancel` fires. `on_ready` runs once everything is bound.
pub async fn run(
    cfg: SimConfig,
    cancel: CancellationToken,
    on_ready: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    let encoder = match &cfg.tokenizer_dir {
        Some(dir) => Encoder::load(dir)?,
        None => Encoder::Words,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let name = cfg.name.clone().unwrap_or_else(|| addr.to_string());
    let engine = Engine::new(cfg, name, encoder);
    for rank in 0..engine.ranks.len() {
        publish::start(engine.clone(), rank, cancel.clone()).await?;
    }
    let running = Running {
        addr,
        engine: engine.clone(),
    };
    on_ready(&running);
    let app = server::router(engine);
    // Streamed chunks are small writes: without TCP_NODELAY, Nagle holds each one until the
    // client's delayed ACK (~40 ms), which would swamp the simulated TTFT.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set_nodelay: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await?;
    Ok(())
}
