//! Optional TLS for the service's listener (`--tls-cert` / `--tls-key`, PEM), with rustls.
//!
//! The accept loop is [`crate::listener`]'s (shared with plain HTTP): each connection's handshake
//! runs in its own task under the header timeout (a slow client cannot stall accepts or hold a
//! slot), then hyper serves HTTP/1 or HTTP/2 over it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

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
