//! A stand-in for the Kubernetes API server's pods and InferencePools, for the endpoint picker's
//! pool-following tests. No kube-apiserver can run on this machine (no Debian package, PyPI or
//! npm release ships one, and no other registry is reachable), so this serves the parts of the
//! API the picker uses, as the API documents them:
//!
//! - `GET /api/v1/namespaces/{ns}/pods` and
//!   `GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`: lists with
//!   `labelSelector` / `fieldSelector` (equality terms, `metadata.name` only for fields),
//!   `limit` / `continue` paging and the list's `resourceVersion`;
//! - the same with `watch=true&resourceVersion=N`: newline-delimited `{"type", "object"}` events
//!   after version N, a version below the compaction point answered by an `ERROR` event with a
//!   410 `Status`, an object leaving the selector sent as `DELETED` and one entering it as
//!   `ADDED` (as the watch cache does), the stream ended at `timeoutSeconds`;
//! - bearer-token checks (401 `Status`), plaintext or TLS.
//!
//! The test drives it: pods and pools are applied and deleted, watches are ended, versions
//! compacted, and the server stopped and started again on the same address.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

/// What a collection holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Pod,
    Pool,
}

/// One change, as the watch sends it: the object before (if any) and after (if any).
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    kind: Kind,
    before: Option<Value>,
    after: Option<Value>,
}

#[derive(Default)]
struct Cluster {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    log: Vec<Change>,
    /// Watches from a version below this get 410.
    compacted: u64,
    token: Option<String>,
    /// Requests seen: (path, watch?).
    requests: Vec<(String, bool)>,
}

struct Shared {
    cluster: Mutex<Cluster>,
    changes: broadcast::Sender<Change>,
    /// Cancelled to end every watch in flight (replaced by a fresh one).
    cut: Mutex<CancellationToken>,
}

/// The fake API server.
pub struct FakeKube {
    pub addr: SocketAddr,
    tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
    shared: Arc<Shared>,
    server: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

impl FakeKube {
    /// Serves plaintext HTTP on `ip` and a kernel-picked port.
    pub async fn start(ip: &str) -> FakeKube {
        FakeKube::start_on(format!("{ip}:0").parse().unwrap(), None).await
    }

    /// Serves HTTPS with `cert`/`key` (PEM) on `ip`.
    pub async fn start_tls(ip: &str, cert: &std::path::Path, key: &std::path::Path) -> FakeKube {
        FakeKube::start_on(
            format!("{ip}:0").parse().unwrap(),
            Some((cert.to_path_buf(), key.to_path_buf())),
        )
        .await
    }

    async fn start_on(
        addr: SocketAddr,
        tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
    ) -> FakeKube {
        let (changes, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            cluster: Mutex::new(Cluster {
                rv: 100,
                ..Cluster::default()
            }),
            changes,
            cut: Mutex::new(CancellationToken::new()),
        });
        let mut k = FakeKube {
            addr,
            tls,
            shared,
            server: None,
        };
        k.serve().await;
        k
    }

    async fn serve(&mut self) {
        let listener = tokio::net::TcpListener::bind(self.addr).await.unwrap();
        self.addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route(&path_of(Kind::Pod, "{ns}"), get(collection(Kind::Pod)))
            .route(&path_of(Kind::Pool, "{ns}"), get(collection(Kind::Pool)))
            .with_state(self.shared.clone());
        let stop = CancellationToken::new();
        let acceptor = self
            .tls
            .as_ref()
            .map(|(c, k)| kvroute_inventory::tls::acceptor(c, k).unwrap());
        let metrics = Arc::new(kvroute_inventory::metrics::Metrics::new().unwrap());
        let task = tokio::spawn(kvroute_inventory::listener::serve(
            listener,
            app,
            acceptor,
            kvroute_inventory::settings::HttpLimits::default(),
            metrics,
            stop.clone(),
        ));
        self.server = Some((stop, task));
    }

    /// The base URL (`http://` or `https://`).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Requires `Authorization: Bearer token` from now on.
    pub fn require_token(&self, token: &str) {
        self.shared.cluster.lock().unwrap().token = Some(token.to_owned());
    }

    /// Requests seen so far: (collection path, whether it was a watch).
    pub fn requests(&self) -> Vec<(String, bool)> {
        self.shared.cluster.lock().unwrap().requests.clone()
    }

    /// Watches of `resource` (`pods`, `inferencepools`) opened so far. Once one is counted it
    /// is registered: [`FakeKube::end_watches`] ends it.
    pub fn watches(&self, resource: &str) -> usize {
        self.requests()
            .iter()
            .filter(|(p, w)| *w && p.ends_with(&format!("/{resource}")))
            .count()
    }

    fn change(&self, kind: Kind, name: &str, after: Option<Value>) {
        let mut c = self.shared.cluster.lock().unwrap();
        c.rv += 1;
        let rv = c.rv;
        let after = after.map(|mut o| {
            o["metadata"]["resourceVersion"] = json!(rv.to_string());
            o
        });
        let before = match &after {
            Some(a) => c.objects.insert((kind, name.to_owned()), a.clone()),
            None => c.objects.remove(&(kind, name.to_owned())),
        };
        let ch = Change {
            rv,
            kind,
            before,
            after,
        };
        c.log.push(ch.clone());
        let _ = self.shared.changes.send(ch);
    }

    /// Creates or replaces pod `name` in namespace `ns` with `ip` (empty: none yet), `labels`
    /// and its `Ready` condition.
    pub fn pod(&self, ns: &str, name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let mut status = json!({
            "phase": if ready { "Running" } else { "Pending" },
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": if ready { "True" } else { "False" }},
            ],
        });
        if !ip.is_empty() {
            status["podIP"] = json!(ip);
            status["podIPs"] = json!([{"ip": ip}]);
        }
        self.change(
            Kind::Pod,
            name,
            Some(json!({
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"name": name, "namespace": ns, "labels": labels, "uid": format!("uid-{name}")},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                "status": status,
            })),
        );
    }

    /// Marks pod `name` as being deleted (a terminating pod keeps its IP and may stay Ready).
    pub fn terminating(&self, name: &str) {
        let obj = self
            .shared
            .cluster
            .lock()
            .unwrap()
            .objects
            .get(&(Kind::Pod, name.to_owned()))
            .cloned();
        let mut o = obj.expect("the pod exists");
        o["metadata"]["deletionTimestamp"] = json!("2026-12-06T00:00:00Z");
        self.change(Kind::Pod, name, Some(o));
    }

    /// Deletes pod `name`.
    pub fn delete_pod(&self, name: &str) {
        self.change(Kind::Pod, name, None);
    }

    /// Creates or replaces InferencePool `name` selecting `labels` on `ports`.
    pub fn pool(&self, ns: &str, name: &str, labels: &[(&str, &str)], ports: &[u16]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        self.change(
            Kind::Pool,
            name,
            Some(json!({
                "apiVersion": "inference.networking.k8s.io/v1",
                "kind": "InferencePool",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                    "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}, "failureMode": "FailOpen"},
                },
            })),
        );
    }

    /// Deletes InferencePool `name`.
    pub fn delete_pool(&self, name: &str) {
        self.change(Kind::Pool, name, None);
    }

    /// Ends every watch in flight (as an API server restart or its timeout does).
    pub fn end_watches(&self) {
        let mut cut = self.shared.cut.lock().unwrap();
        cut.cancel();
        *cut = CancellationToken::new();
    }

    /// Forgets the history up to now: a watch resumed from an older version gets 410. Ends
    /// the watches in flight, so the picker's next watch finds out.
    pub fn compact(&self) {
        {
            let mut c = self.shared.cluster.lock().unwrap();
            c.compacted = c.rv + 1;
            c.log.clear();
        }
        self.end_watches();
    }

    /// Stops serving: no new connection is accepted and watches in flight end.
    pub async fn stop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            self.end_watches();
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }

    /// Serves again on the same address, with everything it held.
    pub async fn resume(&mut self) {
        self.serve().await;
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            task.abort();
        }
        self.end_watches();
    }
}

/// The collection's path for `kind` in namespace `ns`.
fn path_of(kind: Kind, ns: &str) -> String {
    match kind {
        Kind::Pod => format!("/api/v1/namespaces/{ns}/pods"),
        Kind::Pool => {
            format!("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools")
        }
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        [("content-type", "application/json")],
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message, "code": code.as_u16()}).to_string(),
    )
        .into_response()
}

/// Equality terms `k=v` (or `k==v`), comma-separated.
fn terms(sel: Option<&String>) -> Vec<(String, String)> {
    sel.map(|s| {
        s.split(',')
            .filter(|t| !t.is_empty())
            .filter_map(|t| {
                let (k, v) = t.split_once("==").or_else(|| t.split_once('='))?;
                Some((k.to_owned(), v.to_owned()))
            })
            .collect()
    })
    .unwrap_or_default()
}

fn matches(o: &Value, ns: &str, labels: &[(String, String)], fields: &[(String, String)]) -> bool {
    o["metadata"]["namespace"] == json!(ns)
        && labels
            .iter()
            .all(|(k, v)| o["metadata"]["labels"][k].as_str() == Some(v))
        && fields.iter().all(|(k, v)| match k.as_str() {
            "metadata.name" => o["metadata"]["name"].as_str() == Some(v),
            _ => false,
        })
}

/// The handler of `kind`'s collection.
#[allow(clippy::type_complexity)]
fn collection(
    kind: Kind,
) -> impl Fn(
    State<Arc<Shared>>,
    Path<String>,
    Query<BTreeMap<String, String>>,
    HeaderMap,
) -> std::future::Ready<Response>
       + Clone {
    move |State(s), Path(ns), Query(q), headers| {
        std::future::ready(serve_collection(s, kind, ns, q, headers))
    }
}

fn serve_collection(
    s: Arc<Shared>,
    kind: Kind,
    ns: String,
    q: BTreeMap<String, String>,
    headers: HeaderMap,
) -> Response {
    let path = &path_of(kind, &ns);
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let labels = terms(q.get("labelSelector"));
    let fields = terms(q.get("fieldSelector"));
    if fields.iter().any(|(k, _)| k != "metadata.name") {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "field label not supported",
        );
    }
    let mut c = s.cluster.lock().unwrap();
    c.requests.push((path.to_owned(), watch));
    if let Some(t) = &c.token {
        let want = format!("Bearer {t}");
        if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(want.as_str()) {
            return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        }
    }
    let kind_name = match kind {
        Kind::Pod => ("PodList", "v1"),
        Kind::Pool => ("InferencePoolList", "inference.networking.k8s.io/v1"),
    };
    if !watch {
        let all: Vec<Value> = c
            .objects
            .iter()
            .filter(|((k, _), o)| *k == kind && matches(o, &ns, &labels, &fields))
            .map(|(_, o)| o.clone())
            .collect();
        let offset: usize = q.get("continue").and_then(|c| c.parse().ok()).unwrap_or(0);
        let limit: usize = q
            .get("limit")
            .and_then(|l| l.parse().ok())
            .unwrap_or(usize::MAX);
        let page: Vec<Value> = all.iter().skip(offset).take(limit).cloned().collect();
        let mut meta = json!({"resourceVersion": c.rv.to_string()});
        if offset + page.len() < all.len() {
            meta["continue"] = json!((offset + page.len()).to_string());
        }
        let body = json!({"kind": kind_name.0, "apiVersion": kind_name.1, "metadata": meta, "items": page});
        return ([("content-type", "application/json")], body.to_string()).into_response();
    }
    let from: u64 = match q.get("resourceVersion").map(|v| v.parse()) {
        Some(Ok(v)) => v,
        _ => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "resourceVersion required",
            )
        }
    };
    let timeout = Duration::from_secs(
        q.get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300),
    );
    let (tx, rx) = mpsc::channel::<Result<bytes::Bytes, std::convert::Infallible>>(256);
    let line = |v: Value| Ok(bytes::Bytes::from(format!("{v}\n")));
    if from < c.compacted {
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": format!("too old resource version: {from} ({})", c.compacted), "reason": "Expired", "code": 410}});
        let _ = tx.try_send(line(gone));
        drop(tx);
    } else {
        let mut live = s.changes.subscribe();
        let backlog: Vec<Change> = c.log.iter().filter(|ch| ch.rv > from).cloned().collect();
        let cut = s.cut.lock().unwrap().clone();
        let sel = move |ch: &Change| -> Option<Value> {
            if ch.kind != kind {
                return None;
            }
            let was = ch
                .before
                .as_ref()
                .filter(|o| matches(o, &ns, &labels, &fields));
            let is = ch
                .after
                .as_ref()
                .filter(|o| matches(o, &ns, &labels, &fields));
            let (t, o) = match (was, is) {
                (None, None) => return None,
                (None, Some(o)) => ("ADDED", o.clone()),
                (Some(_), Some(o)) => ("MODIFIED", o.clone()),
                (Some(o), None) => {
                    let mut o = o.clone();
                    o["metadata"]["resourceVersion"] = json!(ch.rv.to_string());
                    ("DELETED", o)
                }
            };
            Some(json!({"type": t, "object": o}))
        };
        tokio::spawn(async move {
            let mut last = from;
            for ch in backlog {
                last = ch.rv;
                if let Some(ev) = sel(&ch) {
                    if tx.send(line(ev)).await.is_err() {
                        return;
                    }
                }
            }
            let end = tokio::time::sleep(timeout);
            tokio::pin!(end);
            loop {
                let ch = tokio::select! {
                    biased;
                    _ = cut.cancelled() => return,
                    _ = &mut end => return,
                    ch = live.recv() => match ch {
                        Ok(ch) => ch,
                        Err(_) => return,
                    },
                };
                if ch.rv <= last {
                    continue;
                }
                last = ch.rv;
                if let Some(ev) = sel(&ch) {
                    if tx.send(line(ev)).await.is_err() {
                        return;
                    }
                }
            }
        });
    }
    drop(c);
    (
        [("content-type", "application/json")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}
