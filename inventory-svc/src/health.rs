//! Active endpoint health checks and engine load scraping, one task each per rule.
//!
//! Health: `GET http://<ep><KVROUTE_HEALTH_PATH>` every `KVROUTE_HEALTH_INTERVAL_MS` per endpoint
//! ([`Health`]): a refused connection marks the endpoint unhealthy at once; a timeout
//! (`KVROUTE_HEALTH_TIMEOUT_MS`) or a non-2xx is re-probed after [`RETRY`] and marks it after
//! `KVROUTE_HEALTH_FALL` in a row; `KVROUTE_HEALTH_RISE` 2xx in a row restore it. The scorer never
//! picks an unhealthy endpoint, and a request whose family's home is unhealthy is a detour that
//! does not re-home the family (`score::Decision::detour`): it goes home once its engine is back. Load: the engine's Prometheus text
//! (`vllm:num_requests_running` + `vllm:num_requests_waiting`, SGLang `sglang:num_running_reqs`
//! + `sglang:num_queue_reqs`) corrects the in-flight estimate kept from routing decisions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fleet::{Fleet, RuleRuntime};
use crate::index::EndpointId;
use crate::settings::HealthThresholds;

/// Series summed into an endpoint's load.
const LOAD_SERIES: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// How soon a probe follows a failed one, or a good one while recovering (the next one confirms
/// or clears the verdict in the making).
pub const RETRY: Duration = Duration::from_millis(100);

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

/// Per-endpoint health: a small state machine with hysteresis both ways. `fall` failed probes in
/// a row mark an endpoint down (a refused connection at once: nothing listens, the engine is
/// gone); `rise` good probes in a row bring it back, so one slow probe does not re-home traffic
/// and one lucky probe does not send traffic to an engine that is still failing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Up,
    /// Up, with this many consecutive failed probes (`< fall`): re-probed after [`RETRY`].
    Suspect(u32),
    Down,
    /// Down, with this many consecutive good probes (`< rise`): re-probed after [`RETRY`].
    Recovering(u32),
}

impl Health {
    /// The state after `probe`.
    pub fn next(self, probe: Probe, t: &HealthThresholds) -> Health {
        let failed = |n: u32| {
            if n >= t.fall {
                Health::Down
            } else {
                Health::Suspect(n)
            }
        };
        let good = |n: u32| {
            if n >= t.rise {
                Health::Up
            } else {
                Health::Recovering(n)
            }
        };
        match (self, probe) {
            (_, Probe::Refused) => Health::Down,
            (Health::Up | Health::Suspect(_), Probe::Ok) => Health::Up,
            (Health::Up, Probe::Failed) => failed(1),
            (Health::Suspect(n), Probe::Failed) => failed(n + 1),
            (Health::Down, Probe::Ok) => good(1),
            (Health::Recovering(n), Probe::Ok) => good(n + 1),
            (Health::Down | Health::Recovering(_), Probe::Failed) => Health::Down,
        }
    }

    /// Whether the scorer may choose the endpoint.
    pub fn routable(self) -> bool {
        matches!(self, Health::Up | Health::Suspect(_))
    }

    /// How long until the next probe.
    pub fn wait(self, interval: Duration) -> Duration {
        match self {
            Health::Suspect(_) | Health::Recovering(_) => RETRY.min(interval),
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
    let timeout = state.settings.health_thresholds.timeout;
    match state.http.get(url).timeout(timeout).send().await {
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
        health = health.next(p, &state.settings.health_thresholds);
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

    fn walk(t: &HealthThresholds, probes: &[Probe]) -> Vec<Health> {
        probes
            .iter()
            .scan(Health::Up, |h, &p| {
                *h = h.next(p, t);
                Some(*h)
            })
            .collect()
    }

    fn thresholds(fall: u32, rise: u32) -> HealthThresholds {
        HealthThresholds {
            fall,
            rise,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn health_hysteresis() {
        use Health::*;
        use Probe::{Failed as F, Ok as K, Refused as R};
        let t = thresholds(3, 2);
        // Two slow probes do not flip it; the third does; one good probe does not restore it.
        assert_eq!(
            walk(&t, &[F, F, K, F, F, F, K, F, K, K]),
            [
                Suspect(1),
                Suspect(2),
                Up,
                Suspect(1),
                Suspect(2),
                Down,
                Recovering(1),
                Down,
                Recovering(1),
                Up
            ]
        );
        // Nothing listening: down at once, whatever the state.
        assert_eq!(walk(&t, &[R]), [Down]);
        assert_eq!(walk(&t, &[F, R]), [Suspect(1), Down]);
        assert_eq!(walk(&t, &[R, K, R]), [Down, Recovering(1), Down]);
        // Thresholds of one: the old one-probe verdicts.
        assert_eq!(walk(&thresholds(1, 1), &[F, K]), [Down, Up]);
        assert!(Suspect(2).routable() && Up.routable());
        assert!(!Down.routable() && !Recovering(1).routable());
        let i = Duration::from_secs(5);
        assert_eq!(Suspect(1).wait(i), RETRY);
        assert_eq!(Recovering(1).wait(i), RETRY);
        assert_eq!(Up.wait(i), i);
        assert_eq!(Down.wait(i), i);
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
