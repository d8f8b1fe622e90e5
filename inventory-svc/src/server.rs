//! Wiring for `kvroute-inventory serve`: settings, rules file, listener, graceful drain.
//!
//! One root [`CancellationToken`]: SIGTERM/SIGINT cancels it, the listener stops accepting,
//! in-flight requests finish under a grace timeout, every rule's tasks (children of the root)
//! stop, and the process exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiState};
pub use crate::epp::kube::ApiSettings;
pub use crate::epp::pool::PoolOptions;
use crate::epp::pool::PoolWatch;
pub use crate::epp::EppOptions;
use crate::epp::Picker;
use crate::fleet::{Fleet, Origin, RuleRuntime};
use crate::metrics::Metrics;
use crate::rules::{parse_rule, parse_rules_file};
use crate::settings::Settings;

/// How long in-flight requests may take after SIGTERM.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Options of the `serve` subcommand.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub config: Option<PathBuf>,
    pub tokenizer_dir: Option<PathBuf>,
    pub auth_token_file: Option<PathBuf>,
    /// PEM certificate chain and key: serve HTTPS instead of HTTP.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// File holding the bearer token `POST /v1/route` requires; `None` leaves it open.
    pub route_token_file: Option<PathBuf>,
    /// Also serve the endpoint picker (ext_proc gRPC).
    pub epp: Option<EppOptions>,
}

/// Starts an installed rule's tasks: its event feeds, its health checks and scrapes, and its
/// parity canary.
fn start_tasks(fleet: &Arc<Fleet>, rule: &Arc<RuleRuntime>) {
    let taps = crate::ingest::spawn_rule(fleet, rule);
    crate::health::spawn_rule(fleet, rule);
    crate::canary::spawn_rule(fleet, rule, taps);
}

/// Reads a token file (trailing whitespace dropped); `flag` names it in errors.
fn read_token(flag: &str, path: &Option<PathBuf>) -> anyhow::Result<Option<String>> {
    let Some(p) = path else { return Ok(None) };
    let t = std::fs::read_to_string(p)
        .with_context(|| format!("{flag} {}: unreadable", p.display()))?;
    let t = t.trim().to_owned();
    anyhow::ensure!(!t.is_empty(), "{flag} {}: empty", p.display());
    Ok(Some(t))
}

/// Runs the service until SIGTERM/SIGINT (or `cancel`), then drains.
pub async fn serve(
    opts: ServeOptions,
    settings: Settings,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let auth_token = read_token("--auth-token-file", &opts.auth_token_file)?;
    let route_token = read_token("--route-token-file", &opts.route_token_file)?;
    let signals = terminate();
    let metrics = Arc::new(Metrics::new().context("registering metrics")?);
    let fleet = Arc::new(Fleet::new(
        metrics,
        settings,
        cancel.clone(),
        opts.tokenizer_dir.clone(),
        start_tasks,
    ));
    let replica = match fleet.settings.redis.clone() {
        Some(redis) => {
            let rep = crate::replica::Replica::start(&fleet, redis)?;
            fleet.set_replication(rep.clone());
            Some(rep)
        }
        None => None,
    };
    let mut template = None;
    if let Some(path) = &opts.config {
        template = load_config(&fleet, path, opts.epp.as_ref())?;
    }
    if let Some(rep) = &replica {
        rep.start_tailer(&fleet);
    }
    let state = Arc::new(ApiState::new(fleet.clone(), auth_token, route_token));
    let acceptor = match &opts.tls {
        Some((cert, key)) => Some(crate::tls::acceptor(cert, key)?),
        None => None,
    };
    // The endpoint picker binds and prints first, so one stdout reader sees both lines.
    let epp = match &opts.epp {
        Some(e) => {
            let l = tokio::net::TcpListener::bind(e.listen)
                .await
                .with_context(|| format!("--epp-listen {}: cannot bind", e.listen))?;
            println!("kvroute-inventory epp listening on {}", l.local_addr()?);
            let pool = match &e.pool {
                Some(p) => {
                    let watch = PoolWatch::new(fleet.clone(), e.rule.clone(), p.clone(), template)
                        .map_err(|err| anyhow::anyhow!("--epp-pool {}: {err}", p.name))?;
                    fleet.metrics.epp_pool_series();
                    let watch = Arc::new(watch);
                    let view = watch.view();
                    tokio::spawn(watch.run(cancel.child_token()));
                    Some(view)
                }
                None => None,
            };
            let picker = Arc::new(Picker {
                fleet: fleet.clone(),
                tokenizers: state.tokenizers.clone(),
                opts: e.clone(),
                pool,
            });
            Some(tokio::spawn(crate::epp::serve(l, picker, cancel.clone())))
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("--listen {}: cannot bind", opts.listen))?;
    let local = listener.local_addr()?;
    // The exact line tests and scripts wait for (port 0 resolves here).
    println!(
        "kvroute-inventory listening on {local}{}",
        if acceptor.is_some() { " (tls)" } else { "" }
    );
    tracing::info!(%local, "listening");
    state.ready.store(true, Ordering::Relaxed);
    let app = api::router(state.clone());
    let shutdown = {
        let cancel = cancel.clone();
        async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = signals => { tracing::info!("signal received: draining"); cancel.cancel(); }
            }
        }
    };
    tokio::spawn(shutdown);
    let handle = tokio::spawn(crate::listener::serve(
        listener,
        app,
        acceptor,
        fleet.settings.http,
        fleet.metrics.clone(),
        cancel.clone(),
    ));
    cancel.cancelled().await;
    state.ready.store(false, Ordering::Relaxed);
    match tokio::time::timeout(DRAIN_GRACE, handle).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("server task failed: {e}"),
        Err(_) => tracing::warn!(
            "drain grace of {DRAIN_GRACE:?} elapsed; exiting with requests in flight"
        ),
    }
    if let Some(epp) = epp {
        match tokio::time::timeout(DRAIN_GRACE, epp).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!("endpoint picker failed: {e}"),
            Ok(Err(e)) => tracing::warn!("endpoint picker task failed: {e}"),
            Err(_) => tracing::warn!(
                "drain grace of {DRAIN_GRACE:?} elapsed; endpoint picker streams in flight"
            ),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Installs the rules of `--config`. With `--epp-pool`, the picker's rule may be written without
/// `endpoints` (the pool's pods will be): it is not installed but returned, as the template the
/// pool's watcher installs the rule from.
fn load_config(
    fleet: &Arc<Fleet>,
    path: &std::path::Path,
    epp: Option<&EppOptions>,
) -> anyhow::Result<Option<serde_json::Value>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config {}: unreadable", path.display()))?;
    let raws = parse_rules_file(&text).map_err(anyhow::Error::msg)?;
    let mut problems = Vec::new();
    let mut specs = Vec::new();
    let mut template = None;
    let following = epp.filter(|e| e.pool.is_some());
    // The rule the endpoint picker follows, as a name to compare rules with.
    let followed = following.map(|e| crate::rules::RuleName::new(&e.rule));
    for (i, raw) in raws.iter().enumerate() {
        let endpointless = raw
            .get("endpoints")
            .is_none_or(|e| e.as_array().is_some_and(Vec::is_empty));
        if let (Some(e), Some(name), true) = (following, &followed, endpointless) {
            match pool_template(raw, &fleet.settings) {
                Ok(s) if s.answers_to(name) => {
                    template = Some(raw.clone());
                    continue;
                }
                Ok(s) => problems.push(format!(
                    "rule {i} ({}): no endpoints, but it is not the --epp-rule {:?} whose endpoints --epp-pool gives",
                    s.name(),
                    e.rule
                )),
                Err(err) => problems.push(format!("rule {i}: {err}")),
            }
            continue;
        }
        match parse_rule(raw, &fleet.settings) {
            Ok(s) => specs.push(s),
            Err(e) => problems.push(format!("rule {i}: {e}")),
        }
    }
    anyhow::ensure!(
        problems.is_empty(),
        "--config {}: {}",
        path.display(),
        problems.join("; ")
    );
    for s in specs {
        let name = s.name();
        if template.is_some() && followed.as_ref().is_some_and(|n| s.answers_to(n)) {
            anyhow::bail!("--config {}: rule {name} is given twice", path.display());
        }
        fleet
            .install(s, Origin::Local)
            .map_err(|e| anyhow::anyhow!("--config {}: rule {name}: {e}", path.display()))?;
    }
    Ok(template)
}

/// Validates an endpoint-less rule as the pool's template: every field but `endpoints`, with
/// stand-in endpoints (TEST-NET-1, never installed): a prefill and a decode one under
/// `kvExactMode` 1, as the pool's role labels will give.
fn pool_template(
    raw: &serde_json::Value,
    settings: &crate::settings::Settings,
) -> Result<crate::rules::RuleSpec, crate::rules::RuleRejected> {
    let stand_ins = match crate::epp::pool::prefill_decode(raw) {
        true => serde_json::json!([
            {"endpointIP": "192.0.2.1", "targetPort": 1, "ep_role": 1},
            {"endpointIP": "192.0.2.2", "targetPort": 1, "ep_role": 2},
        ]),
        false => serde_json::json!([{"endpointIP": "192.0.2.1", "targetPort": 1}]),
    };
    let mut probe = raw.clone();
    if let Some(o) = probe.as_object_mut() {
        o.insert("endpoints".into(), stand_ins);
    }
    parse_rule(&probe, settings)
}

/// Installs the SIGTERM/SIGINT handlers now (before the listening line is printed, so a signal
/// sent right after start drains instead of killing) and returns a future that resolves on either.
fn terminate() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut t), Ok(mut i)) => Box::pin(async move {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }),
            _ => Box::pin(std::future::pending::<()>()),
        }
    }
    #[cfg(not(unix))]
    {
        Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
