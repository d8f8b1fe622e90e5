//! Per-request logic (the proxy-wasm HTTP context's behaviour), driven by a state enum.
//!
//! Today the filter passes every request through untouched and only counts it. The routing issue
//! extends [`RequestState`] with the paused states (reading the body, waiting for the inventory
//! callout) and their resume paths; every step keeps the fail-open rule: any failure continues
//! the request without a pin.

use crate::host::Host;
use crate::plugin::Counters;

/// What the proxy should do after a callback, mapped to `proxy_wasm::types::Action` in lib.rs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Let the request go on.
    Continue,
    /// Hold the request until the filter resumes it.
    Pause,
}

/// Where one request is in the filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    /// Nothing seen yet.
    Start,
    /// Headers seen and the request released upstream: nothing left to do.
    Forwarded,
}

/// State of one HTTP request.
#[derive(Debug)]
pub struct RequestFilter {
    counters: Counters,
    state: RequestState,
}

impl RequestFilter {
    /// A request that has not been seen yet.
    pub fn new(counters: Counters) -> Self {
        RequestFilter {
            counters,
            state: RequestState::Start,
        }
    }

    /// The counters this request updates.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Current state.
    pub fn state(&self) -> RequestState {
        self.state
    }

    /// Request headers arrived: count the request and release it.
    pub fn on_request_headers(&mut self, host: &dyn Host, _end_of_stream: bool) -> Step {
        if self.state == RequestState::Start {
            if let Some(id) = self.counters.requests {
                host.increment(id, 1);
            }
            self.state = RequestState::Forwarded;
        }
        Step::Continue
    }

    /// A request body chunk arrived: already released, so pass it on.
    pub fn on_request_body(
        &mut self,
        _host: &dyn Host,
        _body_size: usize,
        _end_of_stream: bool,
    ) -> Step {
        Step::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::testing::FakeHost;
    use crate::plugin::{Plugin, REQUESTS_TOTAL};

    #[test]
    fn passes_through_and_counts_each_request_once() {
        let host = FakeHost::default();
        let mut plugin = Plugin::new();
        plugin.start(&host);
        for _ in 0..3 {
            let mut req = plugin.new_request();
            assert_eq!(req.state(), RequestState::Start);
            assert_eq!(req.on_request_headers(&host, false), Step::Continue);
            assert_eq!(req.on_request_headers(&host, false), Step::Continue);
            assert_eq!(req.on_request_body(&host, 10, true), Step::Continue);
            assert_eq!(req.state(), RequestState::Forwarded);
        }
        assert_eq!(host.counter(REQUESTS_TOTAL), Some(3));
    }

    #[test]
    fn passes_through_without_counter() {
        let host = FakeHost::default();
        let mut req = RequestFilter::new(Counters::default());
        assert_eq!(req.on_request_headers(&host, true), Step::Continue);
        assert_eq!(host.counter(REQUESTS_TOTAL), None);
    }
}
