//! `kvroute-engine-sim`: flags in [`kvroute_engine_sim::config::SimArgs`]; prints
//! `listening on ADDR` once every socket is bound; stops on Ctrl-C or SIGTERM.

use std::io::Write;

use clap::Parser;
use kvroute_engine_sim::config::{SimArgs, SimConfig};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_engine_sim::init_logging();
    let cfg = SimConfig::try_from(SimArgs::parse())?;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        c.cancel();
    });
    kvroute_engine_sim::run(cfg, cancel, |r| {
        let mut out = std::io::stdout();
        let _ = writeln!(
            out,
            "listening on {} name={} engine={}",
            r.addr, r.engine.name, r.engine.cfg.engine
        );
        let _ = out.flush();
    })
    .await
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
