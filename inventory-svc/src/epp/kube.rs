//! The little of the Kubernetes API the endpoint picker needs to follow its InferencePool: list
//! one collection, then watch it from the list's `resourceVersion`, as client-go's reflector
//! does.
//!
//! - [`ApiServer`]: where the API is and how to authenticate. In a pod (no `--kube-api`): the
//!   `KUBERNETES_SERVICE_HOST`/`_PORT` address over HTTPS, the service account's CA and bearer
//!   token (the token file is read again for every request, so kubelet's rotation is followed).
//!   Outside a cluster: any URL, e.g. `kubectl proxy`'s plaintext `http://127.0.0.1:8001`.
//! - [`reflect`]: list (in pages of [`PAGE`]), hand the whole set to the caller, then apply watch
//!   events to it one by one; a watch the server ends is resumed from the last version seen
//!   (bookmarks included); `410 Gone` (the version was compacted) lists again; any other failure
//!   lists again after a capped exponential backoff. Nothing is handed over while the server
//!   cannot be read: a caller keeps acting on the last set it was given.
//!
//! Everything read is bounded: one watch event or list page is at most [`MAX_OBJECT_BYTES`], a
//! list at most [`MAX_ITEMS`] objects, and a request's whole exchange at most
//! [`WATCH_SECONDS`] plus a grace. Objects are decoded into the few fields used; anything else in
//! them is ignored.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

/// The service account's files in a pod.
pub const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Items per list page (`limit`).
pub const PAGE: usize = 500;
/// Largest list page or watch event read.
pub const MAX_OBJECT_BYTES: usize = 16 << 20;
/// Most objects one list may hold.
pub const MAX_ITEMS: usize = 100_000;
/// `timeoutSeconds` of each watch: the server ends it then, and it is resumed.
pub const WATCH_SECONDS: u64 = 240;
/// How long a list page or a watch may take past what the server was asked for.
const GRACE: Duration = Duration::from_secs(30);
/// Connecting to the API server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Backoff between failed attempts: doubles from the first to the last.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(10));

/// Why talking to the API server failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KubeError {
    /// The settings do not describe a usable API server.
    #[error("{0}")]
    Config(String),
    /// Connecting, sending or reading failed (including timeouts).
    #[error("{0}")]
    Transport(String),
    /// The server answered with an error status.
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    /// The server's `resourceVersion` is gone (`410 Gone`, or a watch `ERROR` event with code 410).
    #[error("resource version expired")]
    Expired,
    /// What the server sent is not what the API defines (or is over a bound).
    #[error("{0}")]
    Decode(String),
}

/// Where the API server is and how this process authenticates to it.
#[derive(Clone, Debug, Default)]
pub struct ApiSettings {
    /// `--kube-api`: the server's base URL; unset: in-cluster from `KUBERNETES_SERVICE_HOST`.
    pub url: Option<String>,
    /// `--kube-ca-file`: PEM CA bundle the server's certificate must chain to; in-cluster default:
    /// the service account's `ca.crt`.
    pub ca_file: Option<PathBuf>,
    /// `--kube-token-file`: bearer token file, read for every request; in-cluster default: the
    /// service account's `token`.
    pub token_file: Option<PathBuf>,
}

/// A client of one API server.
#[derive(Clone, Debug)]
pub struct ApiServer {
    base: String,
    client: reqwest::Client,
    token_file: Option<PathBuf>,
}

impl ApiServer {
    /// Builds the client: the URL from the settings or the in-cluster environment, the CA bundle
    /// when one is given or found, the token file when one is given or found.
    pub fn new(s: &ApiSettings) -> Result<ApiServer, KubeError> {
        let sa = |f: &str| PathBuf::from(SA_DIR).join(f);
        let (base, ca, token) = match &s.url {
            Some(url) => (url.clone(), s.ca_file.clone(), s.token_file.clone()),
            None => {
                let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
                    KubeError::Config(
                        "no --kube-api and KUBERNETES_SERVICE_HOST is unset (not in a pod)".into(),
                    )
                })?;
                let port =
                    std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
                let host = match host.parse::<IpAddr>() {
                    Ok(IpAddr::V6(v6)) => format!("[{v6}]"),
                    _ => host,
                };
                let ca = s.ca_file.clone().unwrap_or_else(|| sa("ca.crt"));
                let token = s.token_file.clone().unwrap_or_else(|| sa("token"));
                (format!("https://{host}:{port}"), Some(ca), Some(token))
            }
        };
        let base = base.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(KubeError::Config(format!(
                "--kube-api {base:?}: expected an http:// or https:// URL"
            )));
        }
        let mut b = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .http1_only();
        if let Some(ca) = &ca {
            let pem = std::fs::read(ca).map_err(|e| {
                KubeError::Config(format!("--kube-ca-file {}: unreadable: {e}", ca.display()))
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                KubeError::Config(format!("--kube-ca-file {}: not PEM: {e}", ca.display()))
            })?;
            if certs.is_empty() {
                return Err(KubeError::Config(format!(
                    "--kube-ca-file {}: no certificate in the file",
                    ca.display()
                )));
            }
            b = b.tls_built_in_root_certs(false);
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        let client = b
            .build()
            .map_err(|e| KubeError::Config(format!("HTTP client: {e}")))?;
        Ok(ApiServer {
            base,
            client,
            token_file: token,
        })
    }

    /// The base URL requests go to.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn get(
        &self,
        path: &str,
        query: &[(&str, String)],
        timeout: Duration,
    ) -> Result<reqwest::RequestBuilder, KubeError> {
        let mut r = self
            .client
            .get(format!("{}{path}", self.base))
            .query(query)
            .header("accept", "application/json")
            .timeout(timeout);
        if let Some(f) = &self.token_file {
            let token = std::fs::read_to_string(f).map_err(|e| {
                KubeError::Config(format!("token file {}: unreadable: {e}", f.display()))
            })?;
            r = r.bearer_auth(token.trim());
        }
        Ok(r)
    }
}

/// One watched collection: its path and selectors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Collection {
    /// e.g. `/api/v1/namespaces/NS/pods`.
    pub path: String,
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
}

impl Collection {
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut q = Vec::new();
        if let Some(l) = &self.label_selector {
            q.push(("labelSelector", l.clone()));
        }
        if let Some(f) = &self.field_selector {
            q.push(("fieldSelector", f.clone()));
        }
        q
    }
}

/// `matchLabels` as a label selector (`k=v,k2=v2`, sorted by key).
pub fn label_selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// An object's `metadata`, as far as it is read.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub resource_version: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Set once the object is being deleted (a terminating pod).
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
}

/// An object that carries [`Meta`].
pub trait Object: DeserializeOwned + Send + 'static {
    fn meta(&self) -> &Meta;
}

#[derive(Deserialize)]
struct ListMeta {
    #[serde(default, rename = "resourceVersion")]
    resource_version: String,
    #[serde(default, rename = "continue")]
    cont: Option<String>,
}

#[derive(Deserialize)]
struct List<T> {
    #[serde(default = "no_list_meta")]
    metadata: ListMeta,
    #[serde(default = "Vec::new")]
    items: Vec<T>,
}

fn no_list_meta() -> ListMeta {
    ListMeta {
        resource_version: String::new(),
        cont: None,
    }
}

/// A `Status` object (error answers and watch `ERROR` events).
#[derive(Deserialize, Default)]
struct Status {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    message: String,
}

/// One watch event, decoded.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<T> {
    Added(T),
    Modified(T),
    Deleted(T),
    /// A bookmark: nothing changed up to this version.
    Bookmark(String),
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    object: serde_json::Value,
}

/// Decodes one line of a watch stream. `ERROR` events become errors: code 410 is
/// [`KubeError::Expired`].
pub fn decode_event<T: Object>(line: &[u8]) -> Result<Event<T>, KubeError> {
    let raw: RawEvent =
        serde_json::from_slice(line).map_err(|e| KubeError::Decode(format!("watch event: {e}")))?;
    let object = |v: serde_json::Value| {
        serde_json::from_value::<T>(v)
            .map_err(|e| KubeError::Decode(format!("watch event object: {e}")))
    };
    match raw.kind.as_str() {
        "ADDED" => Ok(Event::Added(object(raw.object)?)),
        "MODIFIED" => Ok(Event::Modified(object(raw.object)?)),
        "DELETED" => Ok(Event::Deleted(object(raw.object)?)),
        "BOOKMARK" => {
            let m: Bookmark = serde_json::from_value(raw.object)
                .map_err(|e| KubeError::Decode(format!("bookmark: {e}")))?;
            Ok(Event::Bookmark(m.metadata.resource_version))
        }
        "ERROR" => {
            let s: Status = serde_json::from_value(raw.object).unwrap_or_default();
            Err(match s.code {
                410 => KubeError::Expired,
                code => KubeError::Status {
                    status: code,
                    message: s.message,
                },
            })
        }
        other => Err(KubeError::Decode(format!(
            "watch event type {other:?}: expected ADDED, MODIFIED, DELETED, BOOKMARK or ERROR"
        ))),
    }
}

#[derive(Deserialize)]
struct Bookmark {
    #[serde(default)]
    metadata: Meta,
}

/// Splits a byte stream into lines of at most [`MAX_OBJECT_BYTES`].
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
}

impl Lines {
    /// Adds `chunk` and returns every complete line (without its newline; empty lines skipped).
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, KubeError> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(n) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[start..start + n];
            if !line.iter().all(u8::is_ascii_whitespace) {
                out.push(line.to_vec());
            }
            start += n + 1;
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_OBJECT_BYTES {
            return Err(KubeError::Decode(format!(
                "watch event over {MAX_OBJECT_BYTES} bytes"
            )));
        }
        Ok(out)
    }
}

async fn check(resp: reqwest::Response) -> Result<reqwest::Response, KubeError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let code = status.as_u16();
    if code == 410 {
        return Err(KubeError::Expired);
    }
    let body = read_capped(resp, 4096).await.unwrap_or_default();
    let message = serde_json::from_slice::<Status>(&body)
        .map(|s| s.message)
        .ok()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    Err(KubeError::Status {
        status: code,
        message,
    })
}

async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, KubeError> {
    let mut out = Vec::new();
    while let Some(c) = resp.chunk().await.map_err(transport)? {
        if out.len() + c.len() > cap {
            return Err(KubeError::Decode(format!("answer over {cap} bytes")));
        }
        out.extend_from_slice(&c);
    }
    Ok(out)
}

fn transport(e: reqwest::Error) -> KubeError {
    KubeError::Transport(format!("{e}"))
}

/// Lists the collection (every page): its objects and the list's `resourceVersion`.
pub async fn list<T: Object>(
    api: &ApiServer,
    coll: &Collection,
) -> Result<(Vec<T>, String), KubeError> {
    let mut items = Vec::new();
    let mut cont: Option<String> = None;
    loop {
        let mut q = coll.query();
        q.push(("limit", PAGE.to_string()));
        if let Some(c) = &cont {
            q.push(("continue", c.clone()));
        }
        let resp = api
            .get(&coll.path, &q, GRACE)?
            .send()
            .await
            .map_err(transport)?;
        let body = read_capped(check(resp).await?, MAX_OBJECT_BYTES).await?;
        let page: List<T> = serde_json::from_slice(&body)
            .map_err(|e| KubeError::Decode(format!("list {}: {e}", coll.path)))?;
        items.extend(page.items);
        if items.len() > MAX_ITEMS {
            return Err(KubeError::Decode(format!(
                "list {}: over {MAX_ITEMS} objects",
                coll.path
            )));
        }
        match page.metadata.cont.filter(|c| !c.is_empty()) {
            Some(c) => cont = Some(c),
            None => return Ok((items, page.metadata.resource_version)),
        }
    }
}

/// Watches the collection from `version`, handing each event to `on_event`, until the server
/// ends the watch (`Ok` with the last version seen) or it fails.
pub async fn watch<T: Object>(
    api: &ApiServer,
    coll: &Collection,
    version: &str,
    mut on_event: impl FnMut(Event<T>),
) -> Result<String, KubeError> {
    let mut q = coll.query();
    q.extend([
        ("watch", "true".to_owned()),
        ("resourceVersion", version.to_owned()),
        ("allowWatchBookmarks", "true".to_owned()),
        ("timeoutSeconds", WATCH_SECONDS.to_string()),
    ]);
    let timeout = Duration::from_secs(WATCH_SECONDS) + GRACE;
    let resp = api
        .get(&coll.path, &q, timeout)?
        .send()
        .await
        .map_err(transport)?;
    let mut resp = check(resp).await?;
    let mut lines = Lines::default();
    let mut last = version.to_owned();
    while let Some(chunk) = resp.chunk().await.map_err(transport)? {
        for line in lines.push(&chunk)? {
            let ev = decode_event::<T>(&line)?;
            let v = match &ev {
                Event::Added(o) | Event::Modified(o) | Event::Deleted(o) => {
                    o.meta().resource_version.clone()
                }
                Event::Bookmark(v) => v.clone(),
            };
            if !v.is_empty() {
                last = v;
            }
            on_event(ev);
        }
    }
    Ok(last)
}

/// Why [`reflect`] listed again or resumed a watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// The server ended a watch (its `timeoutSeconds`, or a restart): resumed.
    Closed,
    /// The version was compacted away (410): listed again.
    Expired,
    /// A request failed: listed again after a backoff.
    Error,
}

/// Waits `backoff` (false when cancelled first) and doubles it up to the cap.
async fn pause(cancel: &CancellationToken, backoff: &mut Duration) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => return false,
        _ = tokio::time::sleep(*backoff) => {}
    }
    *backoff = (*backoff * 2).min(BACKOFF.1);
    true
}

/// Keeps `coll`'s objects by name, from a list and then a watch, until `cancel`: after the list
/// and after every event, `on_change` gets the whole set; `on_restart` is told of every resumed
/// watch and relist (with the error, for [`Restart::Error`]). A failed list hands nothing over.
pub async fn reflect<T: Object>(
    api: &ApiServer,
    coll: &Collection,
    cancel: &CancellationToken,
    mut on_change: impl FnMut(&BTreeMap<String, T>),
    mut on_restart: impl FnMut(Restart, Option<&KubeError>),
) {
    let mut backoff = BACKOFF.0;
    loop {
        let listed = tokio::select! {
            _ = cancel.cancelled() => return,
            r = list::<T>(api, coll) => r,
        };
        let (mut set, mut version): (BTreeMap<String, T>, String) = match listed {
            Ok((items, version)) => {
                let set = items
                    .into_iter()
                    .map(|o| (o.meta().name.clone(), o))
                    .collect();
                on_change(&set);
                backoff = BACKOFF.0;
                (set, version)
            }
            Err(e) => {
                on_restart(Restart::Error, Some(&e));
                if !pause(cancel, &mut backoff).await {
                    return;
                }
                continue;
            }
        };
        loop {
            let watched = tokio::select! {
                _ = cancel.cancelled() => return,
                r = watch::<T>(api, coll, &version, |ev| {
                    match ev {
                        Event::Added(o) | Event::Modified(o) => {
                            set.insert(o.meta().name.clone(), o);
                        }
                        Event::Deleted(o) => {
                            set.remove(&o.meta().name);
                        }
                        Event::Bookmark(_) => return,
                    }
                    on_change(&set);
                }) => r,
            };
            match watched {
                Ok(v) => {
                    on_restart(Restart::Closed, None);
                    version = v;
                }
                Err(KubeError::Expired) => {
                    on_restart(Restart::Expired, None);
                    break;
                }
                Err(e) => {
                    on_restart(Restart::Error, Some(&e));
                    if !pause(cancel, &mut backoff).await {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq, Eq)]
    struct Thing {
        metadata: Meta,
    }

    impl Object for Thing {
        fn meta(&self) -> &Meta {
            &self.metadata
        }
    }

    fn thing(line: &str) -> Result<Event<Thing>, KubeError> {
        decode_event::<Thing>(line.as_bytes())
    }

    #[test]
    fn events_decode_by_type() {
        let Ok(Event::Added(t)) = thing(
            r#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"7","labels":{"app":"x"}},"spec":{"ignored":1}}}"#,
        ) else {
            panic!("added");
        };
        assert_eq!(t.metadata.name, "a");
        assert_eq!(t.metadata.resource_version, "7");
        assert_eq!(t.metadata.labels.get("app").map(String::as_str), Some("x"));
        assert!(matches!(
            thing(r#"{"type":"DELETED","object":{"metadata":{"name":"a","deletionTimestamp":"2026-01-01T00:00:00Z"}}}"#),
            Ok(Event::Deleted(t)) if t.metadata.deletion_timestamp.is_some()
        ));
        assert_eq!(
            thing(
                r#"{"type":"BOOKMARK","object":{"kind":"Pod","metadata":{"resourceVersion":"99"}}}"#
            ),
            Ok(Event::Bookmark("99".into()))
        );
    }

    #[test]
    fn error_events_name_their_code() {
        assert_eq!(
            thing(
                r#"{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old resource version"}}"#
            ),
            Err(KubeError::Expired)
        );
        assert_eq!(
            thing(r#"{"type":"ERROR","object":{"kind":"Status","code":500,"message":"boom"}}"#),
            Err(KubeError::Status {
                status: 500,
                message: "boom".into()
            })
        );
        for bad in [
            "",
            "{",
            "[]",
            r#"{"type":"SOMETHING","object":{}}"#,
            r#"{"type":"ADDED","object":{"metadata":{"name":7}}}"#,
            r#"{"object":{}}"#,
        ] {
            assert!(
                matches!(thing(bad), Err(KubeError::Decode(_))),
                "{bad:?} is a decode error"
            );
        }
    }

    #[test]
    fn lines_split_across_chunks_and_are_bounded() {
        let mut l = Lines::default();
        assert_eq!(l.push(b"{\"a\"").unwrap(), Vec::<Vec<u8>>::new());
        assert_eq!(
            l.push(b":1}\n\n{\"b\":2}\n{\"c\"").unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]
        );
        assert_eq!(l.push(b":3}\n").unwrap(), vec![b"{\"c\":3}".to_vec()]);
        let big = vec![b'x'; MAX_OBJECT_BYTES + 1];
        assert!(matches!(l.push(&big), Err(KubeError::Decode(_))));
    }

    #[test]
    fn selectors_are_sorted_key_value_pairs() {
        let m: BTreeMap<String, String> = [("b", "2"), ("a", "1")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(label_selector(&m), "a=1,b=2");
        let c = Collection {
            path: "/p".into(),
            label_selector: Some("a=1".into()),
            field_selector: Some("metadata.name=x".into()),
        };
        assert_eq!(
            c.query(),
            vec![
                ("labelSelector", "a=1".to_owned()),
                ("fieldSelector", "metadata.name=x".to_owned())
            ]
        );
    }

    #[test]
    fn settings_without_a_url_outside_a_pod_name_the_problem() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return;
        }
        let e = ApiServer::new(&ApiSettings::default()).unwrap_err();
        assert!(e.to_string().contains("KUBERNETES_SERVICE_HOST"), "{e}");
        let e = ApiServer::new(&ApiSettings {
            url: Some("ftp://x".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("--kube-api"), "{e}");
    }
}
