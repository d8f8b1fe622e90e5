//! The accept loop of the service's listener, plain HTTP or TLS, with the bounds a port reachable
//! by untrusted clients needs.
//!
//! * At most `KVROUTE_MAX_CONNECTIONS` connections are open; past it the loop stops accepting
//!   (new connections wait in the kernel backlog) until one closes, so descriptors are never
//!   exhausted by clients.
//! * Header timeout: once a request's first byte arrives (no request in flight), its headers must
//!   be complete within `KVROUTE_HTTP_HEADER_TIMEOUT_MS`, however slowly the bytes trickle.
//! * Idle timeout: a connection with no request in flight and no byte read or written for
//!   `KVROUTE_HTTP_IDLE_TIMEOUT_MS` is closed (a silent connection, a stalled TLS handshake).
//!
//! Each connection has a watchdog fed by its I/O (bytes read or written) and by its service
//! (a request's headers parsed, its response produced); hyper's own header timer is not used
//! because it also fires on idle keep-alive connections and not before the HTTP version is known.
//! On cancellation the loop stops accepting and open connections finish their in-flight requests
//! (hyper's graceful shutdown) under the caller's grace timeout.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::metrics::Metrics;
use crate::settings::HttpLimits;

/// No request head is being read.
const NOT_READING: u64 = u64::MAX;

/// What a connection's watchdog sees: written by its I/O and its service, read by the watchdog.
struct Activity {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last byte read or written.
    last_io: AtomicU64,
    /// When the first byte of the request head being read arrived, or [`NOT_READING`].
    head_since: AtomicU64,
    /// Requests whose response is not produced yet.
    in_flight: AtomicU32,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            epoch: Instant::now(),
            last_io: AtomicU64::new(0),
            head_since: AtomicU64::new(NOT_READING),
            in_flight: AtomicU32::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        if self.in_flight.load(Ordering::Relaxed) == 0 {
            let _ = self.head_since.compare_exchange(
                NOT_READING,
                now,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    /// A request's headers were parsed: the head timer stops until the response is produced.
    fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(NOT_READING, Ordering::Relaxed);
    }

    fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    /// Resolves with the reason once the connection broke a bound.
    async fn watchdog(&self, limits: HttpLimits) -> &'static str {
        let header = limits.header_timeout.as_millis() as u64;
        let idle = limits.idle_timeout.as_millis() as u64;
        let tick =
            (limits.header_timeout.min(limits.idle_timeout) / 4).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(tick).await;
            let now = self.now();
            let head = self.head_since.load(Ordering::Relaxed);
            if head != NOT_READING && now.saturating_sub(head) >= header {
                return "header_timeout";
            }
            if self.in_flight.load(Ordering::Relaxed) == 0
                && now.saturating_sub(self.last_io.load(Ordering::Relaxed)) >= idle
            {
                return "idle_timeout";
            }
        }
    }
}

/// A connection's byte stream, reporting reads and writes to its [`Activity`].
struct Tracked<T> {
    inner: T,
    act: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.act.read();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.act.wrote();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Decrements the open-connection gauge when a connection task ends, however it ends.
struct Open(Arc<Metrics>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.http_connections.dec();
    }
}

/// Serves `app` on `listener` (over TLS with `tls`) until `cancel`, then lets open connections
/// finish their requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let graceful = GracefulShutdown::new();
    let builder = Builder::new(TokioExecutor::new());
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                metrics.http_limit_waits.inc();
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    p = slots.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                }
            }
        };
        let tcp = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors or similar: back off instead of spinning on accept.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // The route answer is one small write per callout; never hold it back.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY not set: {e}");
        }
        metrics.http_connections.inc();
        let conn = Conn {
            app: app.clone(),
            builder: builder.clone(),
            watcher: graceful.watcher(),
            act: Arc::new(Activity::new()),
            limits,
            metrics: metrics.clone(),
        };
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = permit;
            let _open = Open(conn.metrics.clone());
            match tls {
                None => conn.run(tcp).await,
                Some(acc) => {
                    let hs = tokio::time::timeout(limits.header_timeout, acc.accept(tcp)).await;
                    match hs {
                        Ok(Ok(stream)) => conn.run(stream).await,
                        Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                        Err(_) => {
                            conn.metrics
                                .http_closes
                                .with_label_values(&["tls_handshake"])
                                .inc();
                        }
                    }
                }
            }
        });
    }
    graceful.shutdown().await;
}

/// One accepted connection.
struct Conn {
    app: Router,
    builder: Builder<TokioExecutor>,
    watcher: Watcher,
    act: Arc<Activity>,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
}

impl Conn {
    async fn run<T>(self, io: T)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let act = self.act.clone();
        let app = self.app;
        let svc = tower::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
            act.begin();
            let act = act.clone();
            let app = app.clone();
            async move {
                let r = app.oneshot(req).await;
                act.end();
                r
            }
        });
        let io = Tracked {
            inner: io,
            act: self.act.clone(),
        };
        let conn = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(svc))
            .into_owned();
        tokio::select! {
            r = self.watcher.watch(conn) => {
                if let Err(e) = r {
                    tracing::debug!("connection ended with an error: {e}");
                }
            }
            reason = self.act.watchdog(self.limits) => {
                self.metrics.http_closes.with_label_values(&[reason]).inc();
                tracing::debug!(reason, "connection closed");
            }
        }
    }
}
