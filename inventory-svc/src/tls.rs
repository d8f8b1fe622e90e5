//! Optional TLS for the service's listener (`--tls-cert` / `--tls-key`, PEM), with rustls.
//!
//! axum's `serve` speaks plain TCP only, so with TLS the accept loop is ours: each connection's
//! handshake runs in its own task (a slow client cannot stall accepts), then hyper serves HTTP/1
//! or HTTP/2 over it. On cancellation the loop stops accepting and open connections are asked to
//! finish their in-flight requests (hyper's graceful shutdown) under the caller's grace timeout.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Loads a PEM certificate chain and private key into a rustls acceptor (HTTP/2 and HTTP/1.1).
pub fn acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("--tls-cert {}: unreadable", cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("--tls-cert {}: not a PEM certificate chain", cert.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "--tls-cert {}: no certificate in the file",
        cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key {}: not a PEM private key", key.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("--tls-cert/--tls-key: the key does not match the certificate")?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Serves `app` over TLS until `cancel`, then waits for open connections to drain.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    acceptor: TlsAcceptor,
    cancel: CancellationToken,
) {
    let graceful = GracefulShutdown::new();
    let builder = Builder::new(TokioExecutor::new());
    loop {
        let tcp = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok((tcp, _)) => {
                    // As on the plain listener: the route answer is one small write.
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!("TCP_NODELAY not set: {e}");
                    }
                    tcp
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let svc = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!("TLS handshake failed: {e}");
                    return;
                }
            };
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(tls), svc)
                .into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!("connection ended with an error: {e}");
            }
        });
    }
    graceful.shutdown().await;
}
