//! Active endpoint health checks and engine load scraping, one task each per rule.
//!
//! Health: `GET http://<ep><KVROUTE_HEALTH_PATH>` every `KVROUTE_HEALTH_INTERVAL_MS` per endpoint
//! ([`Health`]): a refused connection marks the endpoint unhealthy at once; a timeout (1 s) or a
//! non-2xx is re-probed after 100 ms and marks it after [`FALL`] in a row; one 2xx restores it.
//! The scorer never picks an unhealthy endpoint. Load: the engine's Prometheus text
//! (`vllm:num_requests_running` + `vllm:num_requests_waiting`, SGLang `sglang:num_running_reqs`
//! + `sglang:num_queue_reqs`) corrects the in-flight estimate kept from routing decisions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fleet::{Fleet, RuleRuntime};
use crate::index::EndpointId;

/// Series summed into an endpoint's load.
const LOAD_SERIES: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// Consecutive failed probes (timeouts, non-2xx) that mark an endpoint unhealthy: one slow probe
/// does not flip it. A refused connection marks it at once (nothing listens: the engine is gone).
pub const FALL: u32 = 2;

/// How soon a probe follows a failed one (the next one confirms or clears the failure).
pub const RETRY: Duration = Duration::from_millis(100);

/// How long one probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1000);

/// The outcome of one health probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Ok,
    /// Connection refused (or unreachable): nothing serves the port.
    Refused,
    /// Timed out, non-2xx, or failed mid-exchange.
    Failed,
}

impl Probe {
    fn as_str(self) -> &'static str {
        match self {
            Probe::Ok => "ok",
            Probe::Refused => "refused",
            Probe::Failed => "failed",
        }
    }
}

/// Per-endpoint health: a small state machine over consecutive failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Up,
    /// Up, with this many consecutive failed probes (`< FALL`): re-probed after [`RETRY`].
    Suspect(u32),
    Down,
}

impl Health {
    /// The state after `probe`.
    pub fn next(self, probe: Probe) -> Health {
        match (self, probe) {
            (_, Probe::Ok) => Health::Up,
            (_, Probe::Refused) | (Health::Down, Probe::Failed) => Health::Down,
            (Health::Up, Probe::Failed) if FALL <= 1 => Health::Down,
            (Health::Up, Probe::Failed) => Health::Suspect(1),
            (Health::Suspect(n), Probe::Failed) if n + 1 >= FALL => Health::Down,
            (Health::Suspect(n), Probe::Failed) => Health::Suspect(n + 1),
        }
    }

    /// Whether the scorer may choose the endpoint.
    pub fn routable(self) -> bool {
        self != Health::Down
    }

    /// How long until the next probe.
    pub fn wait(self, interval: Duration) -> Duration {
        match self {
            Health::Suspect(_) => RETRY.min(interval),
            _ => interval,
        }
    }
}

/// Starts the rule's health and scrape tasks (when enabled in settings): one health task per
/// endpoint, so a slow endpoint never delays another's verdict.
pub fn spawn_rule(state: &Arc<Fleet>, rule: &Arc<RuleRuntime>) {
    for (ep, e) in rule.endpoint_ids().zip(rule.eps()) {
        state.set_healthy(rule, ep, e.healthy());
    }
    if !state.settings.health_interval.is_zero() {
        for ep in rule.endpoint_ids() {
            tokio::spawn(health_loop(state.clone(), rule.clone(), ep));
        }
    }
    if !state.settings.scrape_interval.is_zero() {
        tokio::spawn(scrape_loop(state.clone(), rule.clone()));
    }
}

async fn probe(state: &Fleet, url: &str) -> Probe {
    match state.http.get(url).timeout(PROBE_TIMEOUT).send().await {
        Ok(r) if r.status().is_success() => Probe::Ok,
        Err(e) if e.is_connect() && !e.is_timeout() => Probe::Refused,
        _ => Probe::Failed,
    }
}

async fn health_loop(state: Arc<Fleet>, rule: Arc<RuleRuntime>, ep: EndpointId) {
    let (Some(e), Some(spec)) = (rule.ep(ep), rule.spec.endpoints.get(usize::from(ep.0))) else {
        return;
    };
    let name = rule.spec.name();
    let url = format!("http://{}{}", spec.addr(), state.settings.health_path);
    let mut health = if e.healthy() {
        Health::Up
    } else {
        Health::Down
    };
    loop {
        let p = tokio::select! {
            _ = rule.stopped() => return,
            p = probe(&state, &url) => p,
        };
        if rule.is_stopped() {
            return;
        }
        state
            .metrics
            .health_probes
            .with_label_values(&[p.as_str()])
            .inc();
        health = health.next(p);
        let ok = health.routable();
        let was = state.set_healthy(&rule, ep, ok);
        if was != ok {
            tracing::info!(rule = %name, ep = ep.0, healthy = ok, probe = p.as_str(), "endpoint health changed");
        }
        tokio::select! {
            _ = rule.stopped() => return,
            _ = tokio::time::sleep(health.wait(state.settings.health_interval)) => {}
        }
    }
}

/// Sums the load series in a Prometheus text exposition; `None` if none is present.
pub fn parse_load(text: &str) -> Option<u64> {
    let mut total = 0f64;
    let mut seen = false;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if LOAD_SERIES.contains(&&line[..name_end]) {
            if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                if v.is_finite() && v >= 0.0 {
                    total += v;
                    seen = true;
                }
            }
        }
    }
    seen.then_some(total.round() as u64)
}

async fn scrape_loop(state: Arc<Fleet>, rule: Arc<RuleRuntime>) {
    loop {
        for (i, (ep, rt)) in rule.spec.endpoints.iter().zip(rule.eps()).enumerate() {
            let url = format!("http://{}/metrics", ep.addr());
            let text = tokio::select! {
                _ = rule.stopped() => return,
                r = state.http.get(&url).timeout(Duration::from_secs(2)).send() => match r {
                    Ok(r) if r.status().is_success() => r.text().await.ok(),
                    _ => None,
                },
            };
            // Placement compares free cache: the engine's own capacity when it publishes one.
            if let Some(cap) = text.as_deref().and_then(crate::score::parse_num_gpu_blocks) {
                rt.set_capacity(cap);
            }
            if let Some(load) = text.as_deref().and_then(parse_load) {
                rt.record_scrape(Instant::now(), load);
                if rule.is_stopped() {
                    return;
                }
                state
                    .metrics
                    .endpoint_scraped_load
                    .with_label_values(&[&rule.spec.name(), &i.to_string()])
                    .set(load as i64);
            }
        }
        tokio::select! {
            _ = rule.stopped() => return,
            _ = tokio::time::sleep(state.settings.scrape_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_hysteresis() {
        let h = Health::Up;
        assert_eq!(h.next(Probe::Refused), Health::Down);
        let s = h.next(Probe::Failed);
        assert_eq!(s, Health::Suspect(1));
        assert!(s.routable(), "one slow probe does not flip it");
        assert_eq!(s.wait(Duration::from_secs(5)), RETRY);
        assert_eq!(s.next(Probe::Ok), Health::Up);
        assert_eq!(s.next(Probe::Failed), Health::Down);
        assert!(!Health::Down.routable());
        assert_eq!(Health::Down.next(Probe::Failed), Health::Down);
        assert_eq!(Health::Down.next(Probe::Ok), Health::Up);
    }

    #[test]
    fn sums_vllm_and_sglang_series() {
        let t = "# HELP x\nvllm:num_requests_running{model_name=\"m\"} 3.0\nvllm:num_requests_waiting{model_name=\"m\"} 2\nother 9\n";
        assert_eq!(parse_load(t), Some(5));
        assert_eq!(
            parse_load("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n"),
            Some(5)
        );
        assert_eq!(parse_load("nothing 1\n"), None);
    }
}
