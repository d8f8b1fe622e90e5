//! The filter's plugin configuration (the Envoy `configuration` bytes), parsed and validated.
#![no_main]

use kvroute_filter::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Config::parse(data);
});
