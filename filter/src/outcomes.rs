//! Predicted against realised reuse, per endpoint, summed between reports to the inventory.
//!
//! Every pinned response whose `usage` is read is judged ([`crate::usage::Prediction::judge`])
//! and added here under the endpoint it was pinned to. The root context's tick sends the sums to
//! `POST /v1/rules/{rule}/outcomes` every `report_ms` ([`crate::plugin::Plugin::on_tick`]); a
//! report that fails is added back, so a slow or restarting inventory loses nothing. The table is
//! bounded by [`MAX_OUTCOME_ENDPOINTS`] (the most endpoints a rule has): past it a judgement is
//! dropped and counted.
//!
//! Beside it, every routed response whose `usage` is read adds its prompt and cached tokens to its
//! tenant's sums (the tenant of its affinity key and its model), reported with the same report:
//! at most [`MAX_OUTCOME_TENANTS`] entries, the last one [`OTHER_TENANT`] for every tenant past
//! the bound, so a report stays bounded however many tenants a gateway sees.

use std::collections::BTreeMap;

use kvroute_core::wire::{
    EndpointOutcomes, OutcomeReport, MAX_OUTCOME_ENDPOINTS, MAX_OUTCOME_TENANTS,
};

pub use crate::usage::Account;
use crate::usage::{outcome_of, Judged, TenantBook, Usage};

/// The sums since the last report.
#[derive(Debug, Default)]
pub struct Outcomes {
    by_endpoint: BTreeMap<String, EndpointOutcomes>,
    by_tenant: TenantBook,
}

impl Outcomes {
    /// Adds one judged response of `endpoint`; false when the table is full and it was dropped.
    pub fn record(&mut self, endpoint: &str, j: &Judged) -> bool {
        self.add(outcome_of(endpoint, j))
    }

    fn add(&mut self, o: EndpointOutcomes) -> bool {
        if let Some(sum) = self.by_endpoint.get_mut(&o.endpoint) {
            sum.add(&o);
            return true;
        }
        if self.by_endpoint.len() >= MAX_OUTCOME_ENDPOINTS {
            return false;
        }
        self.by_endpoint.insert(o.endpoint.clone(), o);
        true
    }

    /// Adds one response's tokens to its account.
    pub fn account(&mut self, a: &Account, u: &Usage) {
        self.by_tenant.add(a.response(u), true, MAX_OUTCOME_TENANTS);
    }

    /// Whether nothing was judged or accounted since the last report.
    pub fn is_empty(&self) -> bool {
        self.by_endpoint.is_empty() && self.by_tenant.is_empty()
    }

    /// The report of everything since the last one, emptying the table.
    pub fn take(&mut self) -> OutcomeReport {
        OutcomeReport {
            endpoints: std::mem::take(&mut self.by_endpoint)
                .into_values()
                .collect(),
            tenants: self.by_tenant.take(),
        }
    }

    /// Adds back a report that could not be delivered; returns how many endpoints' sums were
    /// dropped because the table filled up meanwhile (tenants past the bound join the other
    /// tenants' sum).
    pub fn restore(&mut self, r: OutcomeReport) -> usize {
        for t in r.tenants {
            self.by_tenant.add(t, true, MAX_OUTCOME_TENANTS);
        }
        r.endpoints
            .into_iter()
            .filter(|o| !self.add(o.clone()))
            .count()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::usage::Verdict;
    use kvroute_core::wire::{MAX_TENANT_NAME, OTHER_TENANT};

    fn judged(predicted_blocks: u64, realised_blocks: u64) -> Judged {
        let verdict = match realised_blocks.cmp(&predicted_blocks) {
            std::cmp::Ordering::Equal => Verdict::Exact,
            std::cmp::Ordering::Greater => Verdict::Under,
            std::cmp::Ordering::Less => Verdict::Over,
        };
        Judged {
            verdict,
            predicted_tokens: predicted_blocks * 16,
            realised_tokens: realised_blocks * 16,
            predicted_blocks,
            realised_blocks,
            prompt_tokens: 40,
        }
    }

    #[test]
    fn sums_per_endpoint_and_counts_qualifying_misses() {
        let mut o = Outcomes::default();
        for (ep, p, r) in [("a:1", 3, 3), ("a:1", 3, 0), ("a:1", 1, 0), ("b:2", 0, 2)] {
            assert!(o.record(ep, &judged(p, r)));
        }
        let r = o.take();
        assert!(o.is_empty());
        let a = &r.endpoints[0];
        assert_eq!(
            (a.endpoint.as_str(), a.judged, a.exact, a.under, a.over),
            ("a:1", 3, 1, 0, 2)
        );
        assert_eq!((a.qualifying, a.missed), (2, 1));
        assert_eq!((a.predicted_blocks, a.realised_blocks), (7, 3));
        assert_eq!((a.prompt_tokens, a.cached_tokens), (120, 48));
        let b = &r.endpoints[1];
        assert_eq!((b.judged, b.under, b.qualifying, b.missed), (1, 1, 0, 0));
    }

    fn usage(prompt: u64, cached: u64) -> Usage {
        Usage {
            hit_tokens: cached,
            miss_tokens: prompt - cached,
        }
    }

    #[test]
    fn tenants_are_summed_bounded_and_come_back_with_a_failed_report() {
        let mut o = Outcomes::default();
        let a = Account::new("user:a|chat", Some("m"));
        assert_eq!(a.tenant, "user:a");
        o.account(&a, &usage(100, 64));
        o.account(&a, &usage(50, 48));
        o.account(
            &Account::new("ip:10.0.0.9|completions", None),
            &usage(10, 0),
        );
        for i in 0..MAX_OUTCOME_TENANTS {
            o.account(
                &Account::new(&format!("user:u{i}|chat"), None),
                &usage(1, 1),
            );
        }
        let r = o.take();
        assert_eq!(r.tenants.len(), MAX_OUTCOME_TENANTS);
        let get = |t: &str| r.tenants.iter().find(|x| x.tenant == t).unwrap().clone();
        let sum = get("user:a");
        assert_eq!(
            (
                sum.model.as_deref(),
                sum.requests,
                sum.prompt_tokens,
                sum.cached_tokens
            ),
            (Some("m"), 2, 150, 112)
        );
        assert_eq!(get("ip:10.0.0.9").prompt_tokens, 10);
        // 256 entries: 2 named above, 253 of the u-tenants, the other 3 in "(other)".
        let other = get(OTHER_TENANT);
        assert_eq!((other.requests, other.prompt_tokens), (3, 3));
        let total: u64 = r.tenants.iter().map(|t| t.requests).sum();
        assert_eq!(total, 3 + MAX_OUTCOME_TENANTS as u64, "nothing lost");
        assert!(o.is_empty());
        o.account(&a, &usage(1, 1));
        o.restore(r);
        assert_eq!(
            o.take()
                .tenants
                .iter()
                .find(|x| x.tenant == "user:a")
                .unwrap()
                .requests,
            3
        );
        let long = format!("user:{}é|chat", "x".repeat(MAX_TENANT_NAME));
        assert!(Account::new(&long, None).tenant.len() <= MAX_TENANT_NAME);
    }

    #[test]
    fn the_table_is_bounded_and_a_failed_report_comes_back() {
        let mut o = Outcomes::default();
        for i in 0..MAX_OUTCOME_ENDPOINTS {
            assert!(o.record(&format!("10.0.0.1:{i}"), &judged(2, 2)));
        }
        assert!(!o.record("10.0.0.2:1", &judged(2, 2)));
        assert!(o.record("10.0.0.1:0", &judged(2, 0)));
        let sent = o.take();
        assert_eq!(sent.endpoints.len(), MAX_OUTCOME_ENDPOINTS);
        assert!(o.record("10.0.0.1:0", &judged(2, 2)));
        assert_eq!(o.restore(sent), 0);
        let back = o.take();
        let first = back
            .endpoints
            .iter()
            .find(|e| e.endpoint == "10.0.0.1:0")
            .unwrap();
        assert_eq!((first.judged, first.missed), (3, 1));
    }
}
