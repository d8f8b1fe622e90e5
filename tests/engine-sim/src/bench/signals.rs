//! What the inventory's alarms said over one kvroute run: the parity canary's runs and the
//! divergence verdicts, read from `/metrics` and `/healthz` once the run's last outcome report
//! is in. On a correctly configured fleet both stay quiet; the report shows that they did.

use anyhow::Context;
use serde_json::Value;

/// The inventory's alarms over one run.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Signals {
    /// Parity canary runs, every verdict (0 with the canary off).
    pub canary_runs: u64,
    /// Of which a failing leg named (neither `healthy` nor `unreachable`).
    pub canary_failing: u64,
    /// Of which `unreachable` (the engine did not answer in time).
    pub canary_unreachable: u64,
    /// The failing verdicts seen, `leg=count`, for the report.
    pub canary_failures: Vec<String>,
    /// Endpoints `/healthz` judges divergent at the end of the run.
    pub divergent_endpoints: usize,
    /// Responses the outcome reports judged, over every endpoint.
    pub judged: u64,
    /// Of which predicted to reuse 2 blocks or more (the divergence check's sample).
    pub qualifying: u64,
    /// Of those, the responses whose engine reused no block.
    pub missed: u64,
}

/// Reads the signals of the inventory at `inv_url`.
pub async fn read(http: &reqwest::Client, inv_url: &str) -> anyhow::Result<Signals> {
    let metrics = http
        .get(format!("{inv_url}/metrics"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .context("GET /metrics")?
        .text()
        .await?;
    let health: Value = http
        .get(format!("{inv_url}/healthz"))
        .send()
        .await
        .context("GET /healthz")?
        .json()
        .await
        .context("/healthz is not JSON")?;
    Ok(from(&metrics, &health))
}

/// [`read`], once the outcome reports hold at least `judged` responses (a gateway's filters
/// report every `report_ms`), or after 10 s with what they hold then.
pub async fn settled(
    http: &reqwest::Client,
    inv_url: &str,
    judged: u64,
) -> anyhow::Result<Signals> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = read(http, inv_url).await?;
        if s.judged >= judged || std::time::Instant::now() > deadline {
            return Ok(s);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The signals in a `/metrics` text and a `/healthz` answer.
pub fn from(metrics: &str, health: &Value) -> Signals {
    let mut s = Signals::default();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("kvroute_canary_runs_total{outcome=\"") else {
            continue;
        };
        let Some((leg, value)) = rest.split_once("\"}") else {
            continue;
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        s.canary_runs += n;
        match leg {
            "healthy" => {}
            "unreachable" => s.canary_unreachable += n,
            _ if n > 0 => {
                s.canary_failing += n;
                s.canary_failures.push(format!("{leg}={n}"));
            }
            _ => {}
        }
    }
    let endpoints = health["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["endpoints"].as_array().into_iter().flatten());
    for e in endpoints {
        if !e["divergence"].is_null() {
            s.divergent_endpoints += 1;
        }
        let o = &e["outcomes"];
        s.judged += o["judged"].as_u64().unwrap_or(0);
        s.qualifying += o["qualifying"].as_u64().unwrap_or(0);
        s.missed += o["missed"].as_u64().unwrap_or(0);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canary_runs_and_divergent_endpoints_are_counted() {
        let metrics = "# HELP kvroute_canary_runs_total x\n\
            kvroute_canary_runs_total{outcome=\"healthy\"} 6\n\
            kvroute_canary_runs_total{outcome=\"seed\"} 2\n\
            kvroute_canary_runs_total{outcome=\"unreachable\"} 1\n\
            kvroute_canary_runs_total{outcome=\"lora\"} 0\n\
            kvroute_canary_runs_totalx{outcome=\"seed\"} 9\n";
        let health = json!({"rules": [{"endpoints": [
            {"divergence": null, "outcomes": {"judged": 10, "qualifying": 8, "missed": 0}},
            {"divergence": "the engine reused none", "outcomes": {"judged": 5, "qualifying": 5, "missed": 5}},
            {"divergence": null, "outcomes": null},
        ]}]});
        let s = from(metrics, &health);
        assert_eq!(
            s,
            Signals {
                canary_runs: 9,
                canary_failing: 2,
                canary_unreachable: 1,
                canary_failures: vec!["seed=2".into()],
                divergent_endpoints: 1,
                judged: 15,
                qualifying: 13,
                missed: 5,
            }
        );
    }
}
