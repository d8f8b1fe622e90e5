//! Following the InferencePool (`--epp-pool`): the picker's rule gets the pool's ready pods as
//! its endpoints, as they come and go.
//!
//! Two reflectors ([`super::kube::reflect`]) keep the InferencePool object
//! (`inference.networking.k8s.io/v1`, its `spec.selector.matchLabels` and `spec.targetPorts`) and
//! the pods its selector names. After changes (a burst of watch events is one reconcile), and
//! every [`TICK`] in case the rule was changed from elsewhere, [`PoolWatch::reconcile`] derives
//! the rule:
//!
//! - **the template**: the rule the picker serves (`--epp-rule`) as last installed by someone
//!   else (the management API, a peer replica), else the `--config` rule written without
//!   `endpoints`. Its `serviceArguments` (engine, block size, model...) are kept as they are.
//! - **the endpoints**: one per ready pod (a pod IP, the `Ready` condition `True`, not being
//!   deleted) and target port, sorted by address. A pod that the template already lists keeps its
//!   entry (weight, capacity, event addresses); under `kvExactMode` 1 a pod's `llm-d.ai/role`
//!   label (`prefill`, `decode`) sets its `ep_role`.
//!
//! The derived rule is installed like any rule update ([`Fleet::install`]): endpoints that stay
//! keep their inventory, new ones start their event feeds, replicas are told. A pool with no
//! ready pod leaves the rule as it is and makes the picker answer `no_endpoint` (a rule cannot be
//! empty). An API server that cannot be reached leaves everything as it is until it can be:
//! nothing is removed on a fault.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::kube::{self, ApiServer, ApiSettings, Collection, KubeError, Meta, Object, Restart};
use crate::fleet::{Fleet, Origin};
use crate::metrics::{PodState, PoolRestart, PoolSync};
use crate::rules::parse_rule;

/// How often the rule is compared with the pool when nothing was heard from the API server.
pub const TICK: Duration = Duration::from_secs(2);
/// The pod label that gives a pod's part in a prefill/decode pool (llm-d's).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// The `serve --epp-pool*` / `--kube-*` options.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// The InferencePool's name.
    pub name: String,
    /// Its namespace (the pods' too).
    pub namespace: String,
    pub api: ApiSettings,
}

impl PoolOptions {
    /// This pod's namespace (the service account's `namespace` file), else `default`.
    pub fn own_namespace() -> String {
        std::fs::read_to_string(std::path::Path::new(kube::SA_DIR).join("namespace"))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".to_owned())
    }
}

/// A pod, as far as it is read.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Pod {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct PodStatus {
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Condition {
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub status: String,
}

impl Object for Pod {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl Pod {
    /// The pod's IP when it can serve: an IP, the `Ready` condition `True`, not being deleted.
    pub fn ready_ip(&self) -> Option<IpAddr> {
        let ready = self
            .status
            .conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True");
        if !ready || self.metadata.deletion_timestamp.is_some() {
            return None;
        }
        self.status.pod_ip.as_deref()?.parse().ok()
    }
}

/// An InferencePool, as far as it is read.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct InferencePool {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default)]
    pub spec: PoolSpec,
}

impl Object for InferencePool {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    #[serde(default)]
    pub selector: Selector,
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct TargetPort {
    pub number: u16,
}

impl PoolSpec {
    /// What makes the spec unusable (a selector that names no label would take every pod of the
    /// namespace; no port, no endpoint).
    pub fn problem(&self) -> Option<&'static str> {
        if self.selector.match_labels.is_empty() {
            Some("spec.selector.matchLabels is empty")
        } else if self.target_ports.iter().all(|p| p.number == 0) {
            Some("spec.targetPorts has no port")
        } else {
            None
        }
    }
}

/// What the picker reads of the pool.
#[derive(Debug, Default)]
pub struct PoolView {
    synced: AtomicBool,
    endpoints: AtomicUsize,
}

impl PoolView {
    /// Whether the pool's pods were read and the rule brought in line with them at least once.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Whether the pool was read and holds no ready endpoint.
    pub fn empty(&self) -> bool {
        self.synced() && self.endpoints.load(Ordering::Acquire) == 0
    }
}

/// What the last reconcile worked from, to count a sync only when something changed.
#[derive(Debug, Default)]
struct Last {
    /// The template: an endpoint-less rule (from `--config`) or a rule installed elsewhere.
    template: Option<Value>,
    /// The generation of the rule as this watcher last saw or installed it.
    generation: Option<u64>,
    /// The (template, endpoints) of the last attempt: the same again is not retried (parsing
    /// and installing give the same result), nor counted.
    attempt: Option<Value>,
}

/// Keeps the rule `--epp-rule` in line with the pool's ready pods.
pub struct PoolWatch {
    fleet: Arc<Fleet>,
    /// `--epp-rule`.
    rule: String,
    opts: PoolOptions,
    api: ApiServer,
    view: Arc<PoolView>,
    last: Mutex<Last>,
}

impl PoolWatch {
    /// A watcher of `opts`' pool for the rule `rule`, starting from `template` (the `--config`
    /// rule without endpoints) when there is one. Fails when the API server settings are unusable.
    pub fn new(
        fleet: Arc<Fleet>,
        rule: String,
        opts: PoolOptions,
        template: Option<Value>,
    ) -> Result<PoolWatch, KubeError> {
        let api = ApiServer::new(&opts.api)?;
        Ok(PoolWatch {
            fleet,
            rule,
            opts,
            api,
            view: Arc::default(),
            last: Mutex::new(Last {
                template,
                ..Last::default()
            }),
        })
    }

    /// What the picker reads.
    pub fn view(&self) -> Arc<PoolView> {
        self.view.clone()
    }

    fn ns_path(&self, group: &str, resource: &str) -> String {
        format!("{group}/namespaces/{}/{resource}", self.opts.namespace)
    }

    /// Follows the pool and its pods until `cancel`.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        tracing::info!(pool = %self.opts.name, namespace = %self.opts.namespace, api = %self.api.base(), rule = %self.rule, "following the InferencePool's pods");
        let (tx, mut rx) = tokio::sync::watch::channel::<Option<PoolSpec>>(None);
        let pools = Collection {
            path: self.ns_path("/apis/inference.networking.k8s.io/v1", "inferencepools"),
            label_selector: None,
            field_selector: Some(format!("metadata.name={}", self.opts.name)),
        };
        let me = self.clone();
        let c = cancel.clone();
        tokio::spawn(async move {
            let m = &me.fleet.metrics;
            kube::reflect::<InferencePool>(
                &me.api,
                &pools,
                &c,
                |set| {
                    let spec = set.get(&me.opts.name).map(|p| p.spec.clone());
                    m.epp_pool_present.set(i64::from(spec.is_some()));
                    tx.send_if_modified(|old| {
                        let changed = *old != spec;
                        *old = spec;
                        changed
                    });
                },
                |r, e| me.restarted("inferencepools", r, e),
            )
            .await;
        });
        // `None` until the selector's pods were listed; `changed` wakes the reconciler, once for
        // however many events arrived since it last ran.
        let pods: Mutex<Option<BTreeMap<String, Pod>>> = Mutex::default();
        let changed = tokio::sync::Notify::new();
        loop {
            let spec = rx.borrow_and_update().clone();
            let spec = match spec {
                Some(s) => match s.problem() {
                    None => Some(s),
                    Some(p) => {
                        tracing::warn!(pool = %self.opts.name, "InferencePool not followed: {p}");
                        None
                    }
                },
                None => None,
            };
            let Some(spec) = spec else {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return,
                    r = rx.changed() => if r.is_err() { return } else { continue },
                }
            };
            let coll = Collection {
                path: self.ns_path("/api/v1", "pods"),
                label_selector: Some(kube::label_selector(&spec.selector.match_labels)),
                field_selector: None,
            };
            let reflector = kube::reflect::<Pod>(
                &self.api,
                &coll,
                &cancel,
                |set| {
                    *pods.lock().unwrap_or_else(|e| e.into_inner()) = Some(set.clone());
                    changed.notify_one();
                },
                |r, e| self.restarted("pods", r, e),
            );
            let reconciler = async {
                let mut t = tokio::time::interval(TICK);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = changed.notified() => {}
                        _ = t.tick() => {}
                    }
                    let p = pods.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(p) = p.as_ref() {
                        self.reconcile(&spec, p);
                    }
                }
            };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                r = rx.changed() => if r.is_err() { return },
                _ = reflector => return,
                _ = reconciler => {}
            }
            // The pool changed: the next selector's pods are listed afresh.
            *pods.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    fn restarted(&self, collection: &str, r: Restart, e: Option<&KubeError>) {
        let reason = match r {
            Restart::Closed => PoolRestart::Closed,
            Restart::Expired => PoolRestart::Expired,
            Restart::Error => PoolRestart::Error,
        };
        self.fleet
            .metrics
            .epp_pool_restart(collection, reason)
            .inc();
        if let Some(e) = e {
            tracing::warn!(pool = %self.opts.name, collection, "Kubernetes API: {e}; keeping the last known set and trying again");
        }
    }

    /// Brings the rule in line with `pods` under `spec` (see the module docs).
    pub fn reconcile(&self, spec: &PoolSpec, pods: &BTreeMap<String, Pod>) {
        let m = &self.fleet.metrics;
        let ready: Vec<&Pod> = pods.values().filter(|p| p.ready_ip().is_some()).collect();
        let ports: Vec<u16> = spec
            .target_ports
            .iter()
            .map(|p| p.number)
            .filter(|&p| p != 0)
            .collect();
        m.epp_pool_pods(PodState::Ready).set(ready.len() as i64);
        m.epp_pool_pods(PodState::NotReady)
            .set((pods.len() - ready.len()) as i64);
        let count = ready.len() * ports.len();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.fleet.find(&self.rule);
        if let Some(rt) = &current {
            if last.generation != Some(rt.generation) {
                // Installed or changed by someone else: its serviceArguments are the template now.
                last.template = Some(rt.spec.raw_json());
                last.generation = Some(rt.generation);
            }
        }
        let (outcome, endpoints) = match &last.template {
            _ if count == 0 => (PoolSync::Empty, Value::Null),
            None => (PoolSync::Waiting, Value::Null),
            Some(t) => {
                let at: Vec<SocketAddr> = current.as_ref().map_or_else(Vec::new, |rt| {
                    rt.spec
                        .endpoints
                        .iter()
                        .map(|e| SocketAddr::new(e.ip, e.port))
                        .collect()
                });
                (PoolSync::Installed, endpoints_for(t, &at, &ready, &ports))
            }
        };
        let attempt = json!([last.template, endpoints]);
        if last.attempt.as_ref() == Some(&attempt) {
            return;
        }
        last.attempt = Some(attempt);
        if outcome != PoolSync::Installed {
            self.view.endpoints.store(0, Ordering::Release);
            self.view
                .synced
                .store(outcome == PoolSync::Empty, Ordering::Release);
            m.epp_pool_endpoints.set(0);
            m.epp_pool_sync(outcome).inc();
            return;
        }
        let mut raw = last.template.clone().unwrap_or(Value::Null);
        if let Some(o) = raw.as_object_mut() {
            o.insert("endpoints".into(), endpoints);
        }
        let result = parse_rule(&raw, &self.fleet.settings)
            .map_err(|e| e.to_string())
            .and_then(|s| {
                self.fleet
                    .install(s, Origin::Local)
                    .map_err(|e| e.to_string())
            });
        let outcome = match result {
            Ok(installed) => {
                last.generation = Some(installed.rule.generation);
                let n = installed.rule.eps().len();
                self.view.endpoints.store(n, Ordering::Release);
                self.view.synced.store(true, Ordering::Release);
                m.epp_pool_endpoints.set(n as i64);
                if !installed.unchanged {
                    tracing::info!(pool = %self.opts.name, rule = %installed.rule.spec.name(), endpoints = n, "rule follows the pool");
                }
                PoolSync::Installed
            }
            Err(e) => {
                tracing::warn!(pool = %self.opts.name, rule = %self.rule, "the pool's endpoints cannot be installed: {e}");
                PoolSync::Rejected
            }
        };
        m.epp_pool_sync(outcome).inc();
    }
}

/// Whether a rule template serves prefill/decode pools (`kvExactMode` 1): its endpoints then carry
/// roles.
pub fn prefill_decode(template: &Value) -> bool {
    template
        .pointer("/serviceArguments/kvExactMode")
        .and_then(Value::as_i64)
        == Some(1)
}

/// The rule's `endpoints` for the ready pods and ports: a template entry for the same address
/// is kept; under `kvExactMode` 1 the pod's [`ROLE_LABEL`] sets `ep_role`. Addresses the rule
/// lists now (`current`, in its order) keep their places, so their inventory stays where it is
/// (a moved endpoint's blocks are copied over by a scan of the index): new addresses fill the
/// places of gone ones first, then the list's tail moves into the places still empty, then new
/// ones are appended, sorted by address.
pub fn endpoints_for(
    template: &Value,
    current: &[SocketAddr],
    ready: &[&Pod],
    ports: &[u16],
) -> Value {
    let pd = prefill_decode(template);
    let known: BTreeMap<SocketAddr, &Value> = template
        .get("endpoints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let ip: IpAddr = e.get("endpointIP")?.as_str()?.parse().ok()?;
            let port = u16::try_from(e.get("targetPort")?.as_i64()?).ok()?;
            Some((SocketAddr::new(ip, port), e))
        })
        .collect();
    let mut out: BTreeMap<SocketAddr, Value> = BTreeMap::new();
    for pod in ready {
        let Some(ip) = pod.ready_ip() else { continue };
        let role = match pod.metadata.labels.get(ROLE_LABEL).map(String::as_str) {
            Some("prefill") => Some(1),
            Some("decode") => Some(2),
            _ => None,
        };
        for &port in ports {
            let addr = SocketAddr::new(ip, port);
            let mut e = known
                .get(&addr)
                .map(|v| (*v).clone())
                .unwrap_or_else(|| json!({"endpointIP": ip.to_string(), "targetPort": port}));
            if let (true, Some(r), Some(o)) = (pd, role, e.as_object_mut()) {
                o.insert("ep_role".into(), json!(r));
            }
            out.insert(addr, e);
        }
    }
    Value::Array(
        places(current, &out)
            .into_iter()
            .filter_map(|a| out.remove(&a))
            .collect(),
    )
}

/// The order of `wanted`'s addresses that moves the fewest of `current`'s (see
/// [`endpoints_for`]).
fn places(current: &[SocketAddr], wanted: &BTreeMap<SocketAddr, Value>) -> Vec<SocketAddr> {
    let mut slots: Vec<Option<SocketAddr>> = current
        .iter()
        .map(|a| wanted.contains_key(a).then_some(*a))
        .collect();
    let mut new = wanted.keys().filter(|a| !current.contains(a)).copied();
    for s in slots.iter_mut().filter(|s| s.is_none()) {
        *s = new.next();
    }
    // Places still empty take the list's last endpoints.
    let mut i = 0;
    while i < slots.len() {
        if slots[i].is_none() {
            while slots.last().is_some_and(Option::is_none) {
                slots.pop();
            }
            if let Some(last) = slots.pop().flatten() {
                if i < slots.len() {
                    slots[i] = Some(last);
                } else {
                    slots.push(Some(last));
                }
            }
        }
        i += 1;
    }
    slots.into_iter().flatten().chain(new).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: &str, labels: &[(&str, &str)]) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}, {"type": "ContainersReady", "status": "True"}]},
        }))
        .unwrap()
    }

    #[test]
    fn only_ready_pods_with_an_ip_that_are_not_being_deleted_serve() {
        assert_eq!(
            pod("a", "10.0.0.1", "True", &[]).ready_ip(),
            Some("10.0.0.1".parse().unwrap())
        );
        assert_eq!(pod("a", "10.0.0.1", "False", &[]).ready_ip(), None);
        assert_eq!(pod("a", "", "True", &[]).ready_ip(), None);
        assert_eq!(pod("a", "not-an-ip", "True", &[]).ready_ip(), None);
        let mut p = pod("a", "fd00::1", "True", &[]);
        assert_eq!(p.ready_ip(), Some("fd00::1".parse().unwrap()));
        p.metadata.deletion_timestamp = Some("2026-12-06T00:00:00Z".into());
        assert_eq!(p.ready_ip(), None);
        let pending: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}})).unwrap();
        assert_eq!(pending.ready_ip(), None);
    }

    #[test]
    fn endpoints_are_ready_pods_times_ports_sorted_keeping_known_entries() {
        let template = json!({
            "serviceArguments": {"kvExactMode": 3},
            "endpoints": [{"endpointIP": "10.0.0.2", "targetPort": 8000, "weight": 5, "kvZmqEndpoint": "tcp://10.0.0.2:6000"}],
        });
        let (a, b, c) = (
            pod("a", "10.0.0.2", "True", &[]),
            pod("b", "10.0.0.1", "True", &[(ROLE_LABEL, "prefill")]),
            pod("c", "10.0.0.3", "False", &[]),
        );
        let got = endpoints_for(&template, &[], &[&a, &b, &c], &[8000, 8001]);
        assert_eq!(
            got,
            json!([
                {"endpointIP": "10.0.0.1", "targetPort": 8000},
                {"endpointIP": "10.0.0.1", "targetPort": 8001},
                {"endpointIP": "10.0.0.2", "targetPort": 8000, "weight": 5, "kvZmqEndpoint": "tcp://10.0.0.2:6000"},
                {"endpointIP": "10.0.0.2", "targetPort": 8001},
            ])
        );
    }

    #[test]
    fn roles_come_from_the_llm_d_label_under_prefill_decode_only() {
        let pd = json!({"serviceArguments": {"kvExactMode": 1}});
        let (p, d, both) = (
            pod("p", "10.0.0.1", "True", &[(ROLE_LABEL, "prefill")]),
            pod("d", "10.0.0.2", "True", &[(ROLE_LABEL, "decode")]),
            pod("x", "10.0.0.3", "True", &[(ROLE_LABEL, "prefill-decode")]),
        );
        assert_eq!(
            endpoints_for(&pd, &[], &[&p, &d, &both], &[8000]),
            json!([
                {"endpointIP": "10.0.0.1", "targetPort": 8000, "ep_role": 1},
                {"endpointIP": "10.0.0.2", "targetPort": 8000, "ep_role": 2},
                {"endpointIP": "10.0.0.3", "targetPort": 8000},
            ])
        );
        let plain = json!({"serviceArguments": {"kvExactMode": 3}});
        assert_eq!(
            endpoints_for(&plain, &[], &[&p], &[8000]),
            json!([{"endpointIP": "10.0.0.1", "targetPort": 8000}])
        );
    }

    /// Endpoints the rule lists keep their places: new ones fill gone ones' places, then the
    /// tail moves into the holes left, then the rest is appended in address order.
    #[test]
    fn listed_endpoints_keep_their_places() {
        let a = |n: u8| -> SocketAddr { SocketAddr::new([10, 0, 0, n].into(), 8000) };
        let want = |ns: &[u8]| -> BTreeMap<SocketAddr, Value> {
            ns.iter().map(|&n| (a(n), Value::Null)).collect()
        };
        let cur = [a(5), a(3), a(9), a(7)];
        // Nothing changes: the current order, not the sorted one.
        assert_eq!(places(&cur, &want(&[3, 5, 7, 9])), cur);
        // 3 goes, 1 and 2 come: 1 takes 3's place, 2 is appended.
        assert_eq!(
            places(&cur, &want(&[1, 2, 5, 7, 9])),
            [a(5), a(1), a(9), a(7), a(2)]
        );
        // 5 and 9 go, nothing comes: 7 (the tail) moves into 5's place; one endpoint moves.
        assert_eq!(places(&cur, &want(&[3, 7])), [a(7), a(3)]);
        // Everything goes: the new ones in address order.
        assert_eq!(places(&cur, &want(&[2, 1])), [a(1), a(2)]);
        assert_eq!(places(&[], &want(&[2, 1])), [a(1), a(2)]);
    }

    #[test]
    fn a_pool_spec_needs_labels_and_a_port() {
        let spec: PoolSpec = serde_json::from_value(json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 8000}], "endpointPickerRef": {"name": "e"}})).unwrap();
        assert_eq!(spec.problem(), None);
        let spec: PoolSpec = serde_json::from_value(
            json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}),
        )
        .unwrap();
        assert!(spec.problem().unwrap().contains("matchLabels"));
        let spec: PoolSpec =
            serde_json::from_value(json!({"selector": {"matchLabels": {"a": "b"}}})).unwrap();
        assert!(spec.problem().unwrap().contains("targetPorts"));
    }
}
