//! Rule JSON bodies (`POST/PUT /v1/rules`): `RawRule` (serde) -> `Rule` validation.
//!
//! Besides "no panic": a valid rule survives `to_raw` -> `from_raw` unchanged, and an update to
//! itself is allowed.
#![no_main]

use kvroute_core::rule::Rule;
use kvroute_core::settings::Settings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(body) = std::str::from_utf8(data) else {
        return;
    };
    for settings in [
        Settings::default(),
        Settings::default().with_none_hash_seed("0"),
    ] {
        if let Ok(rule) = Rule::from_json(body, &settings) {
            let again = Rule::from_raw(&rule.to_raw(), &settings);
            assert_eq!(again.as_ref(), Ok(&rule), "to_raw -> from_raw round trip");
            assert!(
                rule.check_update(&rule).is_ok(),
                "a rule is a valid update of itself"
            );
        }
    }
});
