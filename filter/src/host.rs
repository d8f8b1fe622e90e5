//! The filter's only window onto Envoy.
//!
//! The routing logic ([`crate::plugin`], [`crate::request`]) sees the [`Host`] trait and never
//! `proxy_wasm`, so it runs in native unit tests against a fake host ([`testing::FakeHost`]).
//! [`ProxyHost`] is the real implementation over the proxy-wasm hostcalls; together with `lib.rs`
//! it is the only code that touches the SDK. Every hostcall failure is swallowed here and reported
//! as `None`/`false`: a filter that cannot log or count must still pass the request through
//! (fail open).

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

/// Severity of a log line, mapped onto Envoy's levels by [`ProxyHost`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// Kind of a metric defined in the host's stats store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Histogram,
}

/// Handle of a metric defined in the host's stats store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterId(pub u32);

/// Which header map a header operation addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Headers {
    /// The downstream request's headers (before they go upstream).
    Request,
    /// The upstream response's headers (before they go to the client).
    Response,
    /// The headers of the answer to the last HTTP callout (only inside its callback).
    CallResponse,
}

/// Which body an operation reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// The request body buffered so far.
    Request,
    /// The current response body chunk.
    Response,
    /// The body of the answer to an HTTP callout (only inside its callback).
    CallResponse,
}

/// One HTTP callout to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Callout<'a> {
    /// The Envoy cluster to call.
    pub cluster: &'a str,
    /// `:method`.
    pub method: &'a str,
    /// `:path`.
    pub path: &'a str,
    /// `:authority`.
    pub authority: &'a str,
    /// Request body (JSON) or none.
    pub body: Option<&'a [u8]>,
    /// Envoy answers a synthetic 504 after this long.
    pub timeout: Duration,
}

/// What the filter's logic may ask of the proxy.
pub trait Host {
    /// Writes one line to the proxy's log.
    fn log(&self, level: Level, message: &str);

    /// Defines (or looks up) a counter; `None` when the host refuses, in which case counting is skipped.
    fn define_counter(&self, name: &str) -> Option<CounterId> {
        self.define_metric(MetricKind::Counter, name)
    }

    /// Defines (or looks up) a metric of `kind`; `None` when the host refuses.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<CounterId>;

    /// Adds `delta` to a counter; failures are ignored (metrics never fail a request).
    fn increment(&self, counter: CounterId, delta: u64);

    /// Records one histogram sample; failures are ignored.
    fn record(&self, metric: CounterId, value: u64);

    /// Host clock in nanoseconds since the Unix epoch (0 when unavailable).
    fn now_nanos(&self) -> u64;

    /// One header's value (`None` when absent or not valid UTF-8).
    fn header(&self, map: Headers, name: &str) -> Option<String>;

    /// Sets (`Some`) or removes (`None`) a header; false when the host refused.
    fn set_header(&self, map: Headers, name: &str, value: Option<&str>) -> bool;

    /// `size` bytes of a body from offset 0 (`None` when unavailable).
    fn body(&self, which: Body, size: usize) -> Option<Vec<u8>>;

    /// Starts an HTTP callout; its token, or `None` when the host refused (unknown cluster, ...).
    fn dispatch(&self, call: &Callout<'_>) -> Option<u32>;

    /// Releases a request paused at its headers or body.
    fn resume_request(&self);

    /// Sets a Wasm property (Envoy filter state `wasm.<name>`); false when refused.
    fn set_property(&self, name: &str, value: &str) -> bool;

    /// Reads an Envoy attribute by path (`["upstream", "address"]`); `None` when absent.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
}

/// [`Host`] over the proxy-wasm ABI: valid only inside a proxy-wasm VM.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyHost;

fn map_type(map: Headers) -> MapType {
    match map {
        Headers::Request => MapType::HttpRequestHeaders,
        Headers::Response => MapType::HttpResponseHeaders,
        Headers::CallResponse => MapType::HttpCallResponseHeaders,
    }
}

impl Host for ProxyHost {
    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        // Nothing sensible to do if logging itself fails.
        let _ = hostcalls::log(level, message);
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<CounterId> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).ok().map(CounterId)
    }

    fn increment(&self, counter: CounterId, delta: u64) {
        let delta = i64::try_from(delta).unwrap_or(i64::MAX);
        let _ = hostcalls::increment_metric(counter.0, delta);
    }

    fn record(&self, metric: CounterId, value: u64) {
        let _ = hostcalls::record_metric(metric.0, value);
    }

    fn now_nanos(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    fn header(&self, map: Headers, name: &str) -> Option<String> {
        hostcalls::get_map_value(map_type(map), name).ok().flatten()
    }

    fn set_header(&self, map: Headers, name: &str, value: Option<&str>) -> bool {
        hostcalls::set_map_value(map_type(map), name, value).is_ok()
    }

    fn body(&self, which: Body, size: usize) -> Option<Vec<u8>> {
        let kind = match which {
            Body::Request => BufferType::HttpRequestBody,
            Body::Response => BufferType::HttpResponseBody,
            Body::CallResponse => BufferType::HttpCallResponseBody,
        };
        hostcalls::get_buffer(kind, 0, size).ok().flatten()
    }

    fn dispatch(&self, call: &Callout<'_>) -> Option<u32> {
        let headers = vec![
            (":method", call.method),
            (":path", call.path),
            (":authority", call.authority),
            ("content-type", "application/json"),
        ];
        hostcalls::dispatch_http_call(call.cluster, headers, call.body, vec![], call.timeout).ok()
    }

    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }

    fn set_property(&self, name: &str, value: &str) -> bool {
        hostcalls::set_property(vec![name], Some(value.as_bytes())).is_ok()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}

/// getrandom's "custom" backend for `wasm32-unknown-unknown` (selected by
/// `--cfg getrandom_backend="custom"` in scripts/build-wasm.sh).
///
/// proxy-wasm offers no entropy source. Dependencies only use randomness for hash-map seeds and
/// optional sampling, never for secrets, so a splitmix64 stream seeded from the host clock and a
/// per-VM counter is adequate; it avoids a failing call aborting the VM.
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
mod entropy {
    use std::cell::Cell;
    use std::time::UNIX_EPOCH;

    thread_local! {
        static STATE: Cell<u64> = const { Cell::new(0x9e37_79b9_7f4a_7c15) };
    }

    fn clock_nanos() -> u64 {
        proxy_wasm::hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    }

    fn next(state: &Cell<u64>) -> u64 {
        let s = state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        state.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// # Safety
    /// `dest` must be valid for writes of `len` bytes (getrandom guarantees it).
    #[no_mangle]
    unsafe extern "Rust" fn __getrandom_v03_custom(
        dest: *mut u8,
        len: usize,
    ) -> Result<(), getrandom::Error> {
        let seed = clock_nanos();
        STATE.with(|state| {
            state.set(state.get() ^ seed);
            let mut i = 0;
            while i < len {
                let word = next(state).to_le_bytes();
                let n = (len - i).min(word.len());
                // SAFETY: i + n <= len, and dest is valid for len bytes.
                unsafe { std::ptr::copy_nonoverlapping(word.as_ptr(), dest.add(i), n) };
                i += n;
            }
        });
        Ok(())
    }
}

/// A recording [`Host`] for native unit tests.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod testing {
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;

    use super::{Body, Callout, CounterId, Headers, Host, Level, MetricKind};

    /// A callout the fake host recorded.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub(crate) struct Recorded {
        pub cluster: String,
        pub method: String,
        pub path: String,
        pub body: Vec<u8>,
        pub timeout_ms: u128,
    }

    /// Records logs, metrics, headers and callouts; tests set bodies and call answers.
    #[derive(Default)]
    pub(crate) struct FakeHost {
        pub refuse_counters: bool,
        pub refuse_dispatch: bool,
        logs: RefCell<Vec<(Level, String)>>,
        counters: RefCell<Vec<(String, u64)>>,
        samples: RefCell<Vec<(String, u64)>>,
        pub request_headers: RefCell<BTreeMap<String, String>>,
        pub response_headers: RefCell<BTreeMap<String, String>>,
        pub call_headers: RefCell<BTreeMap<String, String>>,
        pub request_body: RefCell<Vec<u8>>,
        pub response_body: RefCell<Vec<u8>>,
        pub call_body: RefCell<Vec<u8>>,
        pub calls: RefCell<Vec<Recorded>>,
        pub resumed: Cell<u32>,
        pub clock: Cell<u64>,
        pub properties: RefCell<BTreeMap<String, String>>,
    }

    impl FakeHost {
        /// A host whose `define_counter` always fails.
        pub(crate) fn refusing_counters() -> Self {
            FakeHost {
                refuse_counters: true,
                ..FakeHost::default()
            }
        }

        pub(crate) fn logs(&self) -> Vec<(Level, String)> {
            self.logs.borrow().clone()
        }

        pub(crate) fn counter_names(&self) -> Vec<String> {
            self.counters
                .borrow()
                .iter()
                .map(|(n, _)| n.clone())
                .collect()
        }

        pub(crate) fn counter(&self, name: &str) -> Option<u64> {
            self.counters
                .borrow()
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| *v)
        }

        /// Samples recorded into histogram `name`.
        pub(crate) fn samples(&self, name: &str) -> Vec<u64> {
            self.samples
                .borrow()
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| *v)
                .collect()
        }

        /// Sets the answer the next call-response callback sees.
        pub(crate) fn answer(&self, status: u16, body: &[u8]) {
            let mut h = self.call_headers.borrow_mut();
            h.clear();
            h.insert(":status".into(), status.to_string());
            *self.call_body.borrow_mut() = body.to_vec();
        }

        pub(crate) fn req_header(&self, name: &str) -> Option<String> {
            self.request_headers.borrow().get(name).cloned()
        }
    }

    impl Host for FakeHost {
        fn log(&self, level: Level, message: &str) {
            self.logs.borrow_mut().push((level, message.to_string()));
        }

        fn define_metric(&self, _kind: MetricKind, name: &str) -> Option<CounterId> {
            if self.refuse_counters {
                return None;
            }
            let mut counters = self.counters.borrow_mut();
            if let Some(i) = counters.iter().position(|(n, _)| n == name) {
                return Some(CounterId(i as u32));
            }
            counters.push((name.to_string(), 0));
            Some(CounterId(counters.len() as u32 - 1))
        }

        fn increment(&self, counter: CounterId, delta: u64) {
            if let Some((_, v)) = self.counters.borrow_mut().get_mut(counter.0 as usize) {
                *v += delta;
            }
        }

        fn record(&self, metric: CounterId, value: u64) {
            let name = self
                .counters
                .borrow()
                .get(metric.0 as usize)
                .map(|(n, _)| n.clone());
            if let Some(name) = name {
                self.samples.borrow_mut().push((name, value));
            }
        }

        fn now_nanos(&self) -> u64 {
            let t = self.clock.get() + 1_000;
            self.clock.set(t);
            t
        }

        fn header(&self, map: Headers, name: &str) -> Option<String> {
            let m = match map {
                Headers::Request => &self.request_headers,
                Headers::Response => &self.response_headers,
                Headers::CallResponse => &self.call_headers,
            };
            m.borrow().get(name).cloned()
        }

        fn set_header(&self, map: Headers, name: &str, value: Option<&str>) -> bool {
            let m = match map {
                Headers::Request => &self.request_headers,
                Headers::Response => &self.response_headers,
                Headers::CallResponse => return false,
            };
            match value {
                Some(v) => m.borrow_mut().insert(name.into(), v.into()),
                None => m.borrow_mut().remove(name),
            };
            true
        }

        fn body(&self, which: Body, size: usize) -> Option<Vec<u8>> {
            let b = match which {
                Body::Request => self.request_body.borrow(),
                Body::Response => self.response_body.borrow(),
                Body::CallResponse => self.call_body.borrow(),
            };
            Some(b[..size.min(b.len())].to_vec())
        }

        fn dispatch(&self, call: &Callout<'_>) -> Option<u32> {
            if self.refuse_dispatch {
                return None;
            }
            let mut calls = self.calls.borrow_mut();
            calls.push(Recorded {
                cluster: call.cluster.into(),
                method: call.method.into(),
                path: call.path.into(),
                body: call.body.unwrap_or_default().to_vec(),
                timeout_ms: call.timeout.as_millis(),
            });
            Some(calls.len() as u32)
        }

        fn resume_request(&self) {
            self.resumed.set(self.resumed.get() + 1);
        }

        fn set_property(&self, name: &str, value: &str) -> bool {
            self.properties
                .borrow_mut()
                .insert(name.into(), value.into());
            true
        }

        /// Attributes are kept by their dotted path (`upstream.address`).
        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            self.properties
                .borrow()
                .get(&path.join("."))
                .map(|v| v.clone().into_bytes())
        }
    }
}
