//! Per-VM plugin state (the proxy-wasm root context's logic).
//!
//! One [`Plugin`] lives for the life of a Wasm VM (one per Envoy worker). It announces itself once
//! at start, owns the handles of the filter's counters and hands each request a
//! [`RequestFilter`]. Configuration parsing and the tokenizer land here in a later issue.

use crate::host::{CounterId, Host, Level};
use crate::request::RequestFilter;

/// Counter of HTTP requests the filter saw. Envoy exposes it as `wasmcustom.kvroute_filter_requests_total`.
pub const REQUESTS_TOTAL: &str = "kvroute_filter_requests_total";

/// The line logged once when the VM starts; the Envoy smoke test looks for it.
pub const START_MESSAGE: &str = concat!("kvroute-filter ", env!("CARGO_PKG_VERSION"), " started");

/// Counters the requests update.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// [`REQUESTS_TOTAL`]; `None` when the host refused to define it.
    pub requests: Option<CounterId>,
}

/// Root-context state of one VM.
#[derive(Debug, Default)]
pub struct Plugin {
    counters: Counters,
    started: bool,
}

impl Plugin {
    /// A plugin that has not started yet.
    pub fn new() -> Self {
        Plugin::default()
    }

    /// Called when the VM (or a plugin config) starts: logs once and defines the counters.
    /// Always succeeds: a refused counter only disables counting.
    pub fn start(&mut self, host: &dyn Host) -> bool {
        if !self.started {
            self.started = true;
            host.log(Level::Info, START_MESSAGE);
            self.counters.requests = host.define_counter(REQUESTS_TOTAL);
            if self.counters.requests.is_none() {
                host.log(
                    Level::Warn,
                    "cannot define counter kvroute_filter_requests_total; not counting",
                );
            }
        }
        true
    }

    /// State for one new HTTP request.
    pub fn new_request(&self) -> RequestFilter {
        RequestFilter::new(self.counters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::testing::FakeHost;

    #[test]
    fn start_logs_once_and_defines_counter() {
        let host = FakeHost::default();
        let mut plugin = Plugin::new();
        assert!(plugin.start(&host));
        assert!(plugin.start(&host));
        assert_eq!(host.logs(), vec![(Level::Info, START_MESSAGE.to_string())]);
        assert_eq!(host.counter_names(), vec![REQUESTS_TOTAL.to_string()]);
    }

    #[test]
    fn start_survives_refused_counter() {
        let host = FakeHost::refusing_counters();
        let mut plugin = Plugin::new();
        assert!(plugin.start(&host));
        assert_eq!(plugin.new_request().counters(), Counters { requests: None });
        assert_eq!(host.logs().len(), 2);
    }
}
