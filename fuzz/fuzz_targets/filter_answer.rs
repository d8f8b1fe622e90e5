//! The inventory answers the filter parses: `POST /v1/route` (`RouteAnswer`) and
//! `GET /v1/rules/{rule}/contract` (`RuleContract` -> hash contract).
//!
//! Besides "no panic": an accepted answer's tier is a short header-safe token.
#![no_main]

use kvroute_filter::wire::{RouteAnswer, RuleContract};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(answer) = RouteAnswer::parse(data) {
        let t = &answer.tier;
        assert!(
            !t.is_empty()
                && t.len() <= 32
                && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "tier {t:?} is not a header-safe token"
        );
    }
    if let Ok(contract) = RuleContract::parse(data) {
        let _ = contract.hash_contract();
    }
});
