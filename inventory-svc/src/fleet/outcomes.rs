//! Predicted against realised reuse per endpoint, from the filters' reports
//! (`POST /v1/rules/{rule}/outcomes`): a sliding window of reports and the divergence verdict.
//!
//! An endpoint diverges when, within the window, at least `min_requests` responses were predicted
//! to reuse 2 blocks or more and the engine reused no block at all for [`DIVERGED_PERCENT`] of
//! them. That is what a mismatched leg of the hash contract looks like from outside (a chat
//! template, tokenizer, block size, seed or LoRA/salt key the engine does not share): the
//! inventory's keys say the prefix is there, the engine computes it from scratch every time. A
//! missed eviction only over-states by some blocks and rarely reuses nothing at all.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvroute_core::wire::{EndpointOutcomes, OutcomeReport, TenantUsage};

use super::{EpRuntime, Fleet, RuleRuntime};

/// Share of qualifying responses with no reuse at all that makes an endpoint divergent.
pub const DIVERGED_PERCENT: u64 = 80;

/// The window is kept as this many slots: reports within one slot are summed, so an endpoint
/// holds at most `SLOTS + 1` sums whatever the report rate, and a report leaves the window at
/// most one slot (1/16 of the window) late.
const SLOTS: u32 = 16;

/// One endpoint's reports, summed per slot, newest last.
#[derive(Debug, Default)]
pub struct OutcomeWindow {
    slots: VecDeque<(Instant, EndpointOutcomes)>,
}

impl OutcomeWindow {
    /// Adds a report received at `now`, dropping the slots older than `window`.
    pub fn add(&mut self, now: Instant, o: &EndpointOutcomes, window: Duration) {
        self.prune(now, window);
        let slot = window / SLOTS;
        match self.slots.back_mut() {
            Some((start, sum)) if now.saturating_duration_since(*start) < slot => sum.add(o),
            _ => {
                // The sums carry no endpoint name: `add` leaves it empty (no allocation).
                let mut sum = EndpointOutcomes::default();
                sum.add(o);
                self.slots.push_back((now, sum));
            }
        }
    }

    fn prune(&mut self, now: Instant, window: Duration) {
        while let Some((at, _)) = self.slots.front() {
            if now.saturating_duration_since(*at) <= window {
                break;
            }
            self.slots.pop_front();
        }
    }

    /// The sum of the slots that started within `window` of `now`.
    pub fn sum(&self, now: Instant, window: Duration) -> EndpointOutcomes {
        let mut sum = EndpointOutcomes::default();
        for (at, o) in &self.slots {
            if now.saturating_duration_since(*at) <= window {
                sum.add(o);
            }
        }
        sum
    }
}

/// Whether `sum` shows a divergent endpoint (see the module docs).
pub fn diverges(sum: &EndpointOutcomes, min_requests: u64) -> bool {
    sum.qualifying >= min_requests.max(1)
        && sum.missed.saturating_mul(100) >= sum.qualifying.saturating_mul(DIVERGED_PERCENT)
}

/// What one report changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportApplied {
    /// Endpoints of the rule the report named.
    pub endpoints: usize,
    /// Endpoints it named that the rule does not have (a filter with an older rule), ignored.
    pub unknown: usize,
}

impl Fleet {
    /// Applies a filter's outcome report for `rule` received at `now`: each named endpoint's
    /// window, its counters and divergence gauge, and a log line when its verdict changes; and
    /// the report's tenants.
    pub fn record_outcomes(
        &self,
        rule: &RuleRuntime,
        report: &OutcomeReport,
        now: Instant,
    ) -> ReportApplied {
        let mut applied = ReportApplied::default();
        // A removed rule's series are gone and must not come back (fleet invariants).
        if rule.is_stopped() {
            return applied;
        }
        let by_addr: HashMap<String, usize> = rule
            .spec
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| (e.addr(), i))
            .collect();
        let name = rule.spec.name();
        for o in &report.endpoints {
            match by_addr.get(&o.endpoint) {
                Some(&i) if self.endpoint_outcome(rule, &name, i, o, now) => applied.endpoints += 1,
                _ => applied.unknown += 1,
            }
        }
        self.tenant_usage(rule, &name, &report.tenants);
        self.metrics.outcome_reports.inc();
        self.metrics
            .outcome_unknown_endpoints
            .inc_by(applied.unknown as u64);
        applied
    }

    /// Applies one response's outcome on `endpoint` and its tenant's tokens, as the endpoint
    /// picker judges them itself; false when the rule has no such endpoint.
    pub fn record_response(
        &self,
        rule: &RuleRuntime,
        outcome: &EndpointOutcomes,
        tenant: Option<&TenantUsage>,
        now: Instant,
    ) -> bool {
        if rule.is_stopped() {
            return false;
        }
        let name = rule.spec.name();
        let i = (0..rule.spec.endpoints.len()).find(|&i| rule.addr(i) == outcome.endpoint);
        let known = i.is_some_and(|i| self.endpoint_outcome(rule, &name, i, outcome, now));
        if let Some(t) = tenant {
            self.tenant_usage(rule, &name, std::slice::from_ref(t));
        }
        known
    }

    /// Endpoint `i`'s share of a report: its counters, window and divergence verdict.
    fn endpoint_outcome(
        &self,
        rule: &RuleRuntime,
        name: &str,
        i: usize,
        o: &EndpointOutcomes,
        now: Instant,
    ) -> bool {
        let Some(rt) = rule.eps().get(i) else {
            return false;
        };
        let m = &self.metrics;
        let ep = i.to_string();
        let labels = [name, ep.as_str()];
        for (verdict, n) in [("exact", o.exact), ("under", o.under), ("over", o.over)] {
            m.endpoint_outcomes
                .with_label_values(&[name, &ep, verdict])
                .inc_by(n);
        }
        for (counter, n) in [
            (&m.endpoint_predicted_blocks, o.predicted_blocks),
            (&m.endpoint_realised_blocks, o.realised_blocks),
            (&m.endpoint_prompt_tokens, o.prompt_tokens),
            (&m.endpoint_cached_tokens, o.cached_tokens),
        ] {
            counter.with_label_values(&labels).inc_by(n);
        }
        let (was, is, s) = rt.record_outcomes(o, now, &self.settings.divergence);
        m.endpoint_divergent
            .with_label_values(&labels)
            .set(i64::from(is));
        match (was, is) {
            (false, true) => {
                tracing::warn!(rule = %name, ep = i, endpoint = %o.endpoint, qualifying = s.qualifying,
                    missed = s.missed, cause = %divergence_cause(rt), "endpoint diverges: its engine reuses none of the predicted blocks");
            }
            (true, false) => {
                tracing::info!(rule = %name, ep = i, endpoint = %o.endpoint, "endpoint no longer diverges")
            }
            _ => {}
        }
        true
    }

    /// Adds tenants' tokens to `rule`'s accounting (a response the endpoint picker read whose
    /// prediction cannot be judged).
    pub fn record_tenants(&self, rule: &RuleRuntime, tenants: &[TenantUsage]) {
        if !rule.is_stopped() {
            self.tenant_usage(rule, &rule.spec.name(), tenants);
        }
    }

    /// Adds tenants' tokens to the rule's accounting (off with `KVROUTE_TENANTS_MAX=0`).
    fn tenant_usage(&self, rule: &RuleRuntime, name: &str, tenants: &[TenantUsage]) {
        let max = self.settings.tenants_max;
        if max == 0 || tenants.is_empty() {
            return;
        }
        let (folded, held) = rule.account(tenants, self.settings.affinity_scope_model, max);
        let m = &self.metrics;
        m.tenant_folded.with_label_values(&[name]).inc_by(folded);
        m.tenants
            .with_label_values(&[name])
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }
}

/// The probable cause of a divergent endpoint, for `/healthz` and the log: the parity
/// self-check's report when it found a mismatch, else the legs events cannot show.
pub fn divergence_cause(rt: &EpRuntime) -> String {
    match rt.parity() {
        Some(p) => format!("the parity self-check names it: {}", p.message),
        None => "the engine reused no block of most requests predicted to reuse 2 or more: the \
                 gateway's tokens or block keys differ from the engine's (chat template, tokenizer, \
                 LoRA or cache-salt keys, the model served), or the engine evicts before its \
                 events arrive"
            .to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn report(qualifying: u64, missed: u64) -> EndpointOutcomes {
        EndpointOutcomes {
            endpoint: "10.0.0.1:8000".into(),
            judged: qualifying,
            over: missed,
            exact: qualifying - missed,
            qualifying,
            missed,
            predicted_blocks: qualifying * 4,
            realised_blocks: (qualifying - missed) * 4,
            ..EndpointOutcomes::default()
        }
    }

    #[test]
    fn the_verdict_needs_enough_requests_and_mostly_nothing_reused() {
        for (q, m, min, want) in [
            (20, 16, 20, true),
            (20, 15, 20, false),
            (19, 19, 20, false),
            (100, 100, 20, true),
            (0, 0, 0, false),
            (1, 1, 0, true),
        ] {
            assert_eq!(diverges(&report(q, m), min), want, "{q} {m} {min}");
        }
    }

    #[test]
    fn old_reports_leave_the_window() {
        let t0 = Instant::now();
        let window = Duration::from_secs(60);
        let mut w = OutcomeWindow::default();
        w.add(t0, &report(10, 10), window);
        w.add(t0 + Duration::from_secs(30), &report(10, 0), window);
        assert_eq!(w.sum(t0 + Duration::from_secs(59), window).qualifying, 20);
        let later = w.sum(t0 + Duration::from_secs(61), window);
        assert_eq!((later.qualifying, later.missed), (10, 0));
        w.add(t0 + Duration::from_secs(200), &report(2, 2), window);
        assert_eq!(w.slots.len(), 1);
    }

    #[test]
    fn any_report_rate_keeps_at_most_one_sum_per_slot() {
        let t0 = Instant::now();
        let window = Duration::from_secs(16);
        let mut w = OutcomeWindow::default();
        for ms in (0..20_000).step_by(10) {
            w.add(t0 + Duration::from_millis(ms), &report(1, 1), window);
        }
        assert!(w.slots.len() <= SLOTS as usize + 1, "{}", w.slots.len());
        let end = t0 + Duration::from_millis(19_990);
        let q = w.sum(end, window).qualifying;
        assert!((1600..=1700).contains(&q), "{q}");
        assert!(w.slots.iter().all(|(_, s)| s.endpoint.is_empty()));
    }
}
