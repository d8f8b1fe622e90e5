//! `kvroute-bench`: drives workloads through routing strategies over simulated engines and
//! prints the results table; flags in [`kvroute_engine_sim::bench::BenchArgs`].

use clap::Parser;
use kvroute_engine_sim::bench::{main as bench_main, BenchArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    bench_main(BenchArgs::parse()).await.map(|_| ())
}
