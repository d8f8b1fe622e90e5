//! Per-strategy summaries and the markdown table.
//!
//! * cached-token ratio: sum of `cached_tokens` / sum of `prompt_tokens` (what prefill was saved);
//! * TTFT p50/p90/p99 (ms, including the routing decision);
//! * throughput: completed requests per second of wall time;
//! * load spread: busiest simulator's request count / mean (1.00 = even);
//! * engines per prefix: distinct simulators that served each shared prefix, averaged (1 = perfect affinity);
//! * router overhead: p50/p99 of the routing decision (kvroute: tokenize + hash + `/v1/route`);
//! * prediction accuracy (strategies that predict, see [`super::driver`]; `-` for the others):
//!   shares of the judged requests whose engine reused, in whole blocks, exactly / fewer than
//!   (over-predicted) / more than (under-predicted) the prediction capped before the last
//!   token, and the over-predicted tokens: predicted minus `cached_tokens`, summed over the
//!   over-predicted requests (prefill the strategy counted on and the engine computed);
//! * the inventory's alarms (kvroute strategies, see [`super::signals`]; `-` for the others): the
//!   parity canary's runs and, in brackets, those that named a failing leg; the endpoints the
//!   divergence check judged divergent at the end of the run.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::time::Duration;

use super::driver::{Record, Verdict};
use super::signals::Signals;

/// One row.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    /// Workload name.
    pub workload: String,
    /// Strategy name.
    pub strategy: String,
    /// Simulated endpoints.
    pub endpoints: usize,
    /// Requests completed.
    pub requests: usize,
    /// Requests failed.
    pub errors: usize,
    /// Sum cached / sum prompt tokens.
    pub cached_ratio: f64,
    /// TTFT percentiles, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p90, ms.
    pub ttft_p90_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// Requests per second.
    pub throughput_rps: f64,
    /// Max / mean requests per simulator.
    pub load_spread: f64,
    /// Mean distinct simulators per shared prefix.
    pub engines_per_prefix: f64,
    /// Completed requests whose serving simulator is unknown (no `x-kvroute-sim` header and no
    /// `system_fingerprint`): they count as one pseudo-simulator "?" in the spread figures.
    pub unattributed: usize,
    /// Routing decision p50, ms (strategies that decide remotely).
    pub route_p50_ms: Option<f64>,
    /// Routing decision p99, ms.
    pub route_p99_ms: Option<f64>,
    /// kvroute reasons and their counts.
    pub reasons: HashMap<String, usize>,
    /// Completed requests whose prediction was judged (0 for strategies that do not predict).
    pub predictions_judged: usize,
    /// Judged requests whose engine reused exactly the predicted blocks.
    pub prediction_exact: usize,
    /// Judged requests whose engine reused fewer blocks than predicted.
    pub prediction_over: usize,
    /// Judged requests whose engine reused more blocks than predicted.
    pub prediction_under: usize,
    /// `prediction_exact` / `predictions_judged` (`None` when nothing was judged).
    pub prediction_exact_share: Option<f64>,
    /// `prediction_over` / `predictions_judged`.
    pub prediction_over_share: Option<f64>,
    /// `prediction_under` / `predictions_judged`.
    pub prediction_under_share: Option<f64>,
    /// Predicted reusable tokens, summed over the judged requests.
    pub predicted_tokens: Option<u64>,
    /// Predicted minus cached tokens, summed over the over-predicted requests.
    pub over_predicted_tokens: Option<u64>,
    /// The inventory's alarms over the run (kvroute strategies).
    pub signals: Option<Signals>,
    /// Wall time, s.
    pub wall_s: f64,
}

/// The `q` quantile (nearest rank) of sorted values.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Summarises one run.
pub fn summarize(
    workload: &str,
    strategy: &str,
    endpoints: usize,
    records: &[Record],
    wall: Duration,
) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let ttft = sorted(ok.iter().map(|r| r.ttft_ms).collect());
    let route = sorted(ok.iter().filter_map(|r| r.route_ms).collect());
    let mut per_sim: HashMap<&str, usize> = HashMap::new();
    let mut per_group: HashMap<usize, HashSet<&str>> = HashMap::new();
    let mut reasons = HashMap::new();
    for r in &ok {
        let s = r.served_by.as_deref().unwrap_or("?");
        *per_sim.entry(s).or_default() += 1;
        per_group.entry(r.group).or_default().insert(s);
        if let Some(reason) = &r.reason {
            *reasons.entry(reason.clone()).or_default() += 1;
        }
    }
    let judged: Vec<(&Record, Verdict, u64)> = ok
        .iter()
        .filter_map(|r| r.prediction.map(|p| (*r, p.verdict, p.predicted_tokens)))
        .collect();
    let count = |v: Verdict| judged.iter().filter(|j| j.1 == v).count();
    let (exact, over, under) = (
        count(Verdict::Exact),
        count(Verdict::Over),
        count(Verdict::Under),
    );
    let share = |c: usize| (!judged.is_empty()).then(|| c as f64 / judged.len() as f64);
    let some = |v: u64| (!judged.is_empty()).then_some(v);
    let over_tokens: u64 = judged
        .iter()
        .filter(|j| j.1 == Verdict::Over)
        .map(|(r, _, p)| p.saturating_sub(r.cached_tokens))
        .sum();
    let n = endpoints.max(1) as f64;
    let max = per_sim.values().copied().max().unwrap_or(0) as f64;
    let mean = ok.len() as f64 / n;
    Summary {
        workload: workload.to_string(),
        strategy: strategy.to_string(),
        endpoints,
        requests: ok.len(),
        errors: records.len() - ok.len(),
        cached_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p90_ms: quantile(&ttft, 0.9),
        ttft_p99_ms: quantile(&ttft, 0.99),
        throughput_rps: if wall.is_zero() {
            0.0
        } else {
            ok.len() as f64 / wall.as_secs_f64()
        },
        load_spread: if mean == 0.0 { 0.0 } else { max / mean },
        unattributed: ok.iter().filter(|r| r.served_by.is_none()).count(),
        engines_per_prefix: if per_group.is_empty() {
            0.0
        } else {
            per_group.values().map(|s| s.len() as f64).sum::<f64>() / per_group.len() as f64
        },
        route_p50_ms: (!route.is_empty()).then(|| quantile(&route, 0.5)),
        route_p99_ms: (!route.is_empty()).then(|| quantile(&route, 0.99)),
        reasons,
        predictions_judged: judged.len(),
        prediction_exact: exact,
        prediction_over: over,
        prediction_under: under,
        prediction_exact_share: share(exact),
        prediction_over_share: share(over),
        prediction_under_share: share(under),
        predicted_tokens: some(judged.iter().map(|j| j.2).sum()),
        over_predicted_tokens: some(over_tokens),
        signals: None,
        wall_s: wall.as_secs_f64(),
    }
}

/// The markdown table header.
pub const HEADER: &str = "| workload | strategy | endpoints | requests | errors | cached-token ratio | vs round robin | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | load spread | engines/prefix | route p50 ms | route p99 ms | pred exact/over/under | over-pred tokens | canary runs (failing) | divergent eps |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

/// One markdown row; `rr` is the round-robin cached ratio of the same workload, when measured.
pub fn row(s: &Summary, rr: Option<f64>) -> String {
    let mut out = String::new();
    let vs = match rr {
        Some(r) if r > 0.0 => format!("{:.2}x", s.cached_ratio / r),
        _ => "-".to_string(),
    };
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    let shares = match (
        s.prediction_exact_share,
        s.prediction_over_share,
        s.prediction_under_share,
    ) {
        (Some(e), Some(o), Some(u)) => format!("{e:.2}/{o:.2}/{u:.2}"),
        _ => "-".to_string(),
    };
    let over_tokens = s
        .over_predicted_tokens
        .map_or("-".to_string(), |t| t.to_string());
    let (canary, divergent) = match &s.signals {
        Some(g) => (
            format!("{} ({})", g.canary_runs, g.canary_failing),
            g.divergent_endpoints.to_string(),
        ),
        None => ("-".to_string(), "-".to_string()),
    };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {} | {} | {:.1}% | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} |",
        s.workload,
        s.strategy,
        s.endpoints,
        s.requests,
        s.errors,
        s.cached_ratio * 100.0,
        vs,
        s.ttft_p50_ms,
        s.ttft_p90_ms,
        s.ttft_p99_ms,
        s.throughput_rps,
        s.load_spread,
        s.engines_per_prefix,
        opt(s.route_p50_ms),
        opt(s.route_p99_ms),
        shares,
        over_tokens,
        canary,
        divergent,
    );
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::bench::driver::judge;
    use kvroute_core::hash::BlockSize;

    fn record(prompt: u64, cached: u64) -> Record {
        Record {
            session: 0,
            group: 0,
            turn: 0,
            request_id: String::new(),
            served_by: Some("a".into()),
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft_ms: 10.0,
            latency_ms: 20.0,
            route_ms: None,
            reason: None,
            prediction: None,
            error: None,
        }
    }

    /// A completed request whose strategy predicted `matched` blocks of 16 tokens.
    fn predicted(matched: u64, prompt: u64, cached: u64) -> Record {
        Record {
            prediction: judge(matched, BlockSize::new(16).unwrap(), prompt, cached),
            ..record(prompt, cached)
        }
    }

    #[test]
    fn prediction_shares_and_over_predicted_tokens() {
        let mut failed = predicted(4, 100, 0);
        failed.error = Some("HTTP 500".into());
        let records = [
            predicted(4, 100, 64),
            // A partial block reported is not a block reused.
            predicted(4, 100, 79),
            // 64 tokens: the last one is computed, so 3 blocks is all the engine can reuse.
            predicted(4, 64, 48),
            predicted(2, 100, 32),
            predicted(1, 100, 16),
            predicted(5, 100, 80),
            // Over: 64 - 48, 96 - 0, 48 - 32.
            predicted(4, 100, 48),
            predicted(6, 100, 0),
            predicted(3, 100, 32),
            // Under.
            predicted(0, 100, 32),
            // Not judged: no prediction, or the request failed.
            record(100, 32),
            failed,
        ];
        let s = summarize("w", "kvroute-engine", 1, &records, Duration::from_secs(1));
        assert_eq!(s.requests, 11);
        assert_eq!(s.predictions_judged, 10);
        assert_eq!(
            (s.prediction_exact, s.prediction_over, s.prediction_under),
            (6, 3, 1)
        );
        assert_eq!(s.prediction_exact_share, Some(0.6));
        assert_eq!(s.prediction_over_share, Some(0.3));
        assert_eq!(s.prediction_under_share, Some(0.1));
        assert_eq!(s.over_predicted_tokens, Some(128));
        assert_eq!(
            s.predicted_tokens,
            Some(64 + 64 + 48 + 32 + 16 + 80 + 64 + 96 + 48)
        );
        let line = row(&s, None);
        assert!(
            line.ends_with("| 0.60/0.30/0.10 | 128 | - | - |\n"),
            "{line}"
        );
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["prediction_over"], 3);
        assert_eq!(json["over_predicted_tokens"], 128);
        let columns = |l: &str| l.matches('|').count();
        assert_eq!(HEADER.lines().map(columns).collect::<Vec<_>>(), [20, 20]);
        assert_eq!(columns(&line), 20);
        let alarmed = Summary {
            signals: Some(Signals {
                canary_runs: 12,
                canary_failing: 1,
                divergent_endpoints: 2,
                ..Signals::default()
            }),
            ..s
        };
        assert!(row(&alarmed, None).ends_with("| 12 (1) | 2 |\n"));
    }

    #[test]
    fn strategies_that_do_not_predict_show_a_dash() {
        let s = summarize(
            "w",
            "round-robin",
            1,
            &[record(100, 32)],
            Duration::from_secs(1),
        );
        assert_eq!(s.predictions_judged, 0);
        assert_eq!(s.prediction_exact_share, None);
        assert_eq!(s.over_predicted_tokens, None);
        assert!(row(&s, None).ends_with("| - | - |\n"));
        let json = serde_json::to_value(&s).unwrap();
        assert!(json["prediction_exact_share"].is_null());
        assert!(json["over_predicted_tokens"].is_null());
    }

    #[test]
    fn quantiles_and_summary() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        let rec = |sim: &str, group, p, c| Record {
            session: 0,
            group,
            turn: 0,
            request_id: String::new(),
            served_by: Some(sim.into()),
            prompt_tokens: p,
            cached_tokens: c,
            ttft_ms: 10.0,
            latency_ms: 20.0,
            route_ms: None,
            reason: None,
            prediction: None,
            error: None,
        };
        let s = summarize(
            "w",
            "s",
            2,
            &[
                rec("a", 0, 100, 50),
                rec("b", 0, 100, 0),
                rec("a", 1, 200, 150),
            ],
            Duration::from_secs(1),
        );
        assert!((s.cached_ratio - 0.5).abs() < 1e-9);
        assert!((s.load_spread - 2.0 / 1.5).abs() < 1e-9);
        assert!((s.engines_per_prefix - 1.5).abs() < 1e-9);
        assert!(row(&s, Some(0.25)).contains("| 2.00x |"));
    }
}
