//! Per-tenant accounting: each tenant's prompt and cached tokens from the filters' reports
//! (`POST /v1/rules/{rule}/outcomes` `tenants`), summed since the rule was installed and read
//! with `GET /v1/rules/{rule}/tenants`.
//!
//! A tenant is the tenant part of the affinity key ([`kvroute_core::affinity`]) and, under
//! `KVROUTE_AFFINITY_SCOPE=tenant_model`, the model. The book holds at most
//! `KVROUTE_TENANTS_MAX` tenants: once full, a tenant it does not hold is added to
//! [`OTHER_TENANT`] (counted by `kvroute_tenant_folded_total`), so the tenants already held keep
//! exact sums and nothing is lost from the totals.

use std::collections::HashMap;

use kvroute_core::wire::{TenantUsage, OTHER_TENANT};

/// One rule's tenants.
#[derive(Debug, Default)]
pub struct TenantBook {
    by: HashMap<(String, Option<String>), TenantUsage>,
}

impl TenantBook {
    /// Adds `t`'s sums; the model is kept only when `with_model`. Returns false when `t` went to
    /// [`OTHER_TENANT`] because the book already holds `max` tenants (the last place is kept for
    /// that entry).
    pub fn add(&mut self, t: &TenantUsage, with_model: bool, max: usize) -> bool {
        let model = t.model.clone().filter(|_| with_model);
        let key = (t.tenant.clone(), model);
        let (key, held) = match self.by.contains_key(&key) || self.by.len() + 1 < max {
            true => (key, true),
            false => ((OTHER_TENANT.to_owned(), None), false),
        };
        let sum = self
            .by
            .entry(key)
            .or_insert_with_key(|(tenant, model)| TenantUsage {
                tenant: tenant.clone(),
                model: model.clone(),
                ..TenantUsage::default()
            });
        sum.add(t);
        held
    }

    /// Every tenant, most prompt tokens first.
    pub fn list(&self) -> Vec<TenantUsage> {
        let mut v: Vec<TenantUsage> = self.by.values().cloned().collect();
        v.sort_by(|a, b| {
            b.prompt_tokens
                .cmp(&a.prompt_tokens)
                .then_with(|| a.tenant.cmp(&b.tenant))
                .then_with(|| a.model.cmp(&b.model))
        });
        v
    }

    pub fn len(&self) -> usize {
        self.by.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn usage(tenant: &str, model: Option<&str>, prompt: u64, cached: u64) -> TenantUsage {
        TenantUsage {
            tenant: tenant.into(),
            model: model.map(str::to_owned),
            requests: 1,
            prompt_tokens: prompt,
            cached_tokens: cached,
        }
    }

    #[test]
    fn sums_per_tenant_with_or_without_the_model_and_folds_past_the_bound() {
        let mut b = TenantBook::default();
        assert!(b.add(&usage("user:a", Some("m1"), 100, 60), false, 3));
        assert!(b.add(&usage("user:a", Some("m2"), 50, 10), false, 3));
        assert!(b.add(&usage("user:b", None, 500, 0), false, 3));
        // Full (two tenants and the place kept for "(other)"): a new tenant is folded.
        assert!(!b.add(&usage("user:c", None, 7, 7), false, 3));
        assert!(!b.add(&usage("user:d", None, 3, 0), false, 3));
        assert!(
            b.add(&usage("user:a", None, 1, 1), false, 3),
            "a held tenant still adds"
        );
        let l = b.list();
        let names: Vec<&str> = l.iter().map(|t| t.tenant.as_str()).collect();
        assert_eq!(names, ["user:b", "user:a", OTHER_TENANT]);
        assert_eq!(
            (l[1].requests, l[1].prompt_tokens, l[1].cached_tokens),
            (3, 151, 71)
        );
        assert_eq!((l[2].requests, l[2].prompt_tokens), (2, 10));
        let mut by_model = TenantBook::default();
        by_model.add(&usage("user:a", Some("m1"), 100, 60), true, 10);
        by_model.add(&usage("user:a", Some("m2"), 50, 10), true, 10);
        assert_eq!(by_model.len(), 2);
    }
}
