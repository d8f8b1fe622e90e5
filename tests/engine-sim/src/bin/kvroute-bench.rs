//! `kvroute-bench`: drives workloads through routing strategies over simulated engines and
//! prints the results table; flags in [`kvroute_engine_sim::bench::BenchArgs`].

use clap::Parser;
use kvroute_engine_sim::bench::{main as bench_main, BenchArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_engine_sim::init_logging();
    bench_main(BenchArgs::parse()).await.map(|_| ())
}
