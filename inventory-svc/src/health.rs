//! Active endpoint health checks and engine load scraping, one task each per rule.
//!
//! Health: `GET http://<ep><KVROUTE_HEALTH_PATH>`; anything but 2xx (or no answer within 2 s)
//! marks the endpoint unhealthy and the scorer never picks it. Load: the engine's Prometheus text
//! (`vllm:num_requests_running` + `vllm:num_requests_waiting`, SGLang `sglang:num_running_reqs`
//! + `sglang:num_queue_reqs`) corrects the in-flight estimate kept from routing decisions.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::state::{AppState, RuleRuntime};

/// Series summed into an endpoint's load.
const LOAD_SERIES: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// Starts the rule's health and scrape tasks (when enabled in settings).
pub fn spawn_rule(state: &Arc<AppState>, rule: &Arc<RuleRuntime>) {
    let name = rule.spec.name();
    for i in 0..rule.eps.len() {
        state
            .metrics
            .endpoint_healthy
            .with_label_values(&[&name, &i.to_string()])
            .set(1);
    }
    if !state.settings.health_interval.is_zero() {
        tokio::spawn(health_loop(state.clone(), rule.clone()));
    }
    if !state.settings.scrape_interval.is_zero() {
        tokio::spawn(scrape_loop(state.clone(), rule.clone()));
    }
}

async fn health_loop(state: Arc<AppState>, rule: Arc<RuleRuntime>) {
    let name = rule.spec.name();
    loop {
        for (i, ep) in rule.spec.endpoints.iter().enumerate() {
            let url = format!("http://{}{}", ep.addr(), state.settings.health_path);
            let ok = tokio::select! {
                _ = rule.cancel.cancelled() => return,
                r = state.http.get(&url).timeout(Duration::from_secs(2)).send() => matches!(r, Ok(r) if r.status().is_success()),
            };
            let was = rule.eps[i].healthy.swap(ok, Ordering::Relaxed);
            if was != ok {
                tracing::info!(rule = %name, ep = i, healthy = ok, "endpoint health changed");
            }
            if rule.cancel.is_cancelled() {
                return;
            }
            state
                .metrics
                .endpoint_healthy
                .with_label_values(&[&name, &i.to_string()])
                .set(i64::from(ok));
        }
        tokio::select! {
            _ = rule.cancel.cancelled() => return,
            _ = tokio::time::sleep(state.settings.health_interval) => {}
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

async fn scrape_loop(state: Arc<AppState>, rule: Arc<RuleRuntime>) {
    loop {
        for (i, ep) in rule.spec.endpoints.iter().enumerate() {
            let url = format!("http://{}/metrics", ep.addr());
            let text = tokio::select! {
                _ = rule.cancel.cancelled() => return,
                r = state.http.get(&url).timeout(Duration::from_secs(2)).send() => match r {
                    Ok(r) if r.status().is_success() => r.text().await.ok(),
                    _ => None,
                },
            };
            // Placement compares free cache: the engine's own capacity when it publishes one.
            if let Some(cap) = text.as_deref().and_then(crate::score::parse_num_gpu_blocks) {
                rule.eps[i]
                    .capacity
                    .store(cap, std::sync::atomic::Ordering::Relaxed);
            }
            if let Some(load) = text.as_deref().and_then(parse_load) {
                rule.eps[i].record_scrape(Instant::now(), load);
                if rule.cancel.is_cancelled() {
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
            _ = rule.cancel.cancelled() => return,
            _ = tokio::time::sleep(state.settings.scrape_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
