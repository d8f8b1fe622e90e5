//! The filter's only window onto Envoy.
//!
//! The routing logic ([`crate::plugin`], [`crate::request`]) sees the [`Host`] trait and never
//! `proxy_wasm`, so it runs in native unit tests against a fake host ([`testing::FakeHost`]).
//! [`ProxyHost`] is the real implementation over the proxy-wasm ABI imports; together with `lib.rs`
//! it is the only code that touches the SDK. Every hostcall failure is swallowed here and reported
//! as `None`/`false`: a filter that cannot log or count must still pass the request through
//! (fail open).

use std::time::Duration;

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
    /// Request body or none.
    pub body: Option<&'a [u8]>,
    /// The body's `content-type`.
    pub content_type: &'a str,
    /// Envoy answers a synthetic 504 after this long.
    pub timeout: Duration,
    /// Sent as `authorization: Bearer <token>` when set (the inventory's route credential).
    pub bearer: Option<&'a str>,
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

    /// One header's value as bytes (`None` when absent or unreadable). Header values are
    /// attacker-controlled bytes: Envoy passes obs-text (0x80-0xff) through.
    fn header_bytes(&self, map: Headers, name: &str) -> Option<Vec<u8>>;

    /// One header's value if it is valid UTF-8 (`None` when absent, unreadable or not UTF-8).
    fn header(&self, map: Headers, name: &str) -> Option<String> {
        self.header_bytes(map, name)
            .and_then(|b| String::from_utf8(b).ok())
    }

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
///
/// Every call but one goes straight to the ABI import ([`abi`]): the SDK's wrappers in
/// `proxy_wasm::hostcalls` panic on a status other than the few they expect, and
/// `get_map_value` panics on a header value that is not UTF-8, which an attacker controls
/// (a panic kills the VM for every later request on that worker). The exception is
/// [`Host::dispatch`]: the SDK's dispatcher must register the callout token or it panics when the
/// answer arrives, so it goes through `hostcalls::dispatch_http_call`, whose panic arm covers only
/// statuses Envoy's `proxy_http_call` does not return for valid memory (it returns Ok,
/// BadArgument for an unknown cluster or missing pseudo-headers, InternalFailure when the request
/// cannot start).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyHost;

fn map_type(map: Headers) -> abi::MapType {
    match map {
        Headers::Request => abi::MAP_REQUEST_HEADERS,
        Headers::Response => abi::MAP_RESPONSE_HEADERS,
        Headers::CallResponse => abi::MAP_CALL_RESPONSE_HEADERS,
    }
}

impl Host for ProxyHost {
    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => abi::LOG_DEBUG,
            Level::Info => abi::LOG_INFO,
            Level::Warn => abi::LOG_WARN,
            Level::Error => abi::LOG_ERROR,
        };
        // Nothing sensible to do if logging itself fails.
        abi::log(level, message);
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<CounterId> {
        let kind = match kind {
            MetricKind::Counter => abi::METRIC_COUNTER,
            MetricKind::Histogram => abi::METRIC_HISTOGRAM,
        };
        abi::define_metric(kind, name).map(CounterId)
    }

    fn increment(&self, counter: CounterId, delta: u64) {
        let delta = i64::try_from(delta).unwrap_or(i64::MAX);
        abi::increment_metric(counter.0, delta);
    }

    fn record(&self, metric: CounterId, value: u64) {
        abi::record_metric(metric.0, value);
    }

    fn now_nanos(&self) -> u64 {
        abi::now_nanos()
    }

    fn header_bytes(&self, map: Headers, name: &str) -> Option<Vec<u8>> {
        abi::header(map_type(map), name)
    }

    fn set_header(&self, map: Headers, name: &str, value: Option<&str>) -> bool {
        abi::set_header(map_type(map), name, value)
    }

    fn body(&self, which: Body, size: usize) -> Option<Vec<u8>> {
        let kind = match which {
            Body::Request => abi::BUFFER_REQUEST_BODY,
            Body::Response => abi::BUFFER_RESPONSE_BODY,
            Body::CallResponse => abi::BUFFER_CALL_RESPONSE_BODY,
        };
        abi::buffer(kind, size)
    }

    fn dispatch(&self, call: &Callout<'_>) -> Option<u32> {
        let bearer = call.bearer.map(|t| format!("Bearer {t}"));
        let mut headers = vec![
            (":method", call.method),
            (":path", call.path),
            (":authority", call.authority),
            ("content-type", call.content_type),
        ];
        if let Some(b) = &bearer {
            headers.push(("authorization", b.as_str()));
        }
        proxy_wasm::hostcalls::dispatch_http_call(
            call.cluster,
            headers,
            call.body,
            vec![],
            call.timeout,
        )
        .ok()
    }

    fn resume_request(&self) {
        abi::resume_request();
    }

    fn set_property(&self, name: &str, value: &str) -> bool {
        abi::set_property(&[name], value.as_bytes())
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        abi::property(path)
    }
}

/// The plugin configuration buffer (empty when the host has none or refuses).
pub fn plugin_configuration() -> Vec<u8> {
    abi::buffer(abi::BUFFER_PLUGIN_CONFIGURATION, usize::MAX).unwrap_or_default()
}

/// Sets the root context's tick period; failures are ignored (the next callback re-arms it).
pub fn set_tick_period(period: Duration) {
    abi::set_tick_period(period);
}

/// The proxy-wasm ABI imports the filter calls, declared as the SDK declares them but returning
/// the raw status word, so no status value can panic or be read as an out-of-range enum.
/// Buffers the host returns were allocated through the module's `proxy_on_memory_allocate`
/// (the SDK's, a `Vec<u8>` of that capacity) and are taken back as one.
mod abi {
    use std::ptr::{null, null_mut};
    use std::time::Duration;

    pub type MapType = u32;
    pub type BufferType = u32;

    pub const MAP_REQUEST_HEADERS: MapType = 0;
    pub const MAP_RESPONSE_HEADERS: MapType = 2;
    pub const MAP_CALL_RESPONSE_HEADERS: MapType = 6;
    pub const BUFFER_REQUEST_BODY: BufferType = 0;
    pub const BUFFER_RESPONSE_BODY: BufferType = 1;
    pub const BUFFER_CALL_RESPONSE_BODY: BufferType = 4;
    pub const BUFFER_PLUGIN_CONFIGURATION: BufferType = 7;
    pub const LOG_DEBUG: u32 = 1;
    pub const LOG_INFO: u32 = 2;
    pub const LOG_WARN: u32 = 3;
    pub const LOG_ERROR: u32 = 4;
    pub const METRIC_COUNTER: u32 = 0;
    pub const METRIC_HISTOGRAM: u32 = 2;
    const STREAM_HTTP_REQUEST: u32 = 0;
    const OK: u32 = 0;

    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
        fn proxy_get_buffer_bytes(
            buffer_type: BufferType,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        fn proxy_get_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_remove_header_map_value(
            map_type: MapType,
            key_data: *const u8,
            key_size: usize,
        ) -> u32;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_continue_stream(stream_type: u32) -> u32;
        fn proxy_define_metric(
            metric_type: u32,
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    }

    /// Takes ownership of a host-returned buffer (`None` for a null pointer).
    ///
    /// # Safety
    /// `data` is null or was allocated by the module's allocator with capacity `size`.
    unsafe fn owned(data: *mut u8, size: usize) -> Option<Vec<u8>> {
        if data.is_null() {
            None
        } else {
            // SAFETY: guaranteed by the caller (the host allocated it through
            // proxy_on_memory_allocate, a Vec<u8> with capacity `size`).
            Some(unsafe { Vec::from_raw_parts(data, size, size) })
        }
    }

    /// A property path as the ABI takes it: the segments joined by NUL (`upstream\0address`),
    /// no trailing NUL (Envoy then looks up a name ending in an empty segment).
    fn property_path(path: &[&str]) -> Vec<u8> {
        path.join("\0").into_bytes()
    }

    #[cfg(test)]
    #[test]
    fn property_paths_are_nul_separated() {
        assert_eq!(
            property_path(&["upstream", "address"]),
            b"upstream\0address"
        );
        assert_eq!(property_path(&["kvroute_pin"]), b"kvroute_pin");
        assert_eq!(property_path(&[]), b"");
    }

    pub fn log(level: u32, message: &str) {
        // SAFETY: message is a valid slice for the duration of the call.
        let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
    }

    pub fn now_nanos() -> u64 {
        let mut t: u64 = 0;
        // SAFETY: t is a valid u64 to write.
        match unsafe { proxy_get_current_time_nanoseconds(&mut t) } {
            OK => t,
            _ => 0,
        }
    }

    pub fn set_tick_period(period: Duration) {
        let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
        // SAFETY: no pointers.
        let _ = unsafe { proxy_set_tick_period_milliseconds(ms) };
    }

    pub fn buffer(kind: BufferType, max_size: usize) -> Option<Vec<u8>> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: data and size are valid to write; a returned buffer is ours (see `owned`).
        unsafe {
            match proxy_get_buffer_bytes(kind, 0, max_size, &mut data, &mut size) {
                OK => owned(data, size),
                _ => None,
            }
        }
    }

    pub fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: name is valid for the call, data and size are valid to write.
        unsafe {
            match proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) {
                // Present but empty: the host may return no buffer at all.
                OK => Some(owned(data, size).unwrap_or_default()),
                _ => None,
            }
        }
    }

    pub fn set_header(map: MapType, name: &str, value: Option<&str>) -> bool {
        // SAFETY: name and value are valid slices for the duration of the call.
        let status = unsafe {
            match value {
                Some(v) => proxy_replace_header_map_value(
                    map,
                    name.as_ptr(),
                    name.len(),
                    v.as_ptr(),
                    v.len(),
                ),
                None => proxy_remove_header_map_value(map, name.as_ptr(), name.len()),
            }
        };
        status == OK
    }

    pub fn property(path: &[&str]) -> Option<Vec<u8>> {
        let path = property_path(path);
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: path is valid for the call, data and size are valid to write.
        unsafe {
            match proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) {
                OK => owned(data, size),
                _ => None,
            }
        }
    }

    pub fn set_property(path: &[&str], value: &[u8]) -> bool {
        let path = property_path(path);
        let value_ptr = if value.is_empty() {
            null()
        } else {
            value.as_ptr()
        };
        // SAFETY: path and value are valid slices for the duration of the call.
        let status =
            unsafe { proxy_set_property(path.as_ptr(), path.len(), value_ptr, value.len()) };
        status == OK
    }

    pub fn resume_request() {
        // SAFETY: no pointers.
        let _ = unsafe { proxy_continue_stream(STREAM_HTTP_REQUEST) };
    }

    pub fn define_metric(kind: u32, name: &str) -> Option<u32> {
        let mut id: u32 = 0;
        // SAFETY: name is valid for the call, id is valid to write.
        match unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) } {
            OK => Some(id),
            _ => None,
        }
    }

    pub fn increment_metric(id: u32, delta: i64) {
        // SAFETY: no pointers.
        let _ = unsafe { proxy_increment_metric(id, delta) };
    }

    pub fn record_metric(id: u32, value: u64) {
        // SAFETY: no pointers.
        let _ = unsafe { proxy_record_metric(id, value) };
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

    thread_local! {
        static STATE: Cell<u64> = const { Cell::new(0x9e37_79b9_7f4a_7c15) };
    }

    fn clock_nanos() -> u64 {
        super::abi::now_nanos()
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
        pub content_type: String,
        pub timeout_ms: u128,
        /// The `authorization` header the real host would send.
        pub authorization: Option<String>,
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
        /// Request header values that are not UTF-8 (read only through `header_bytes`).
        pub raw_request_headers: RefCell<BTreeMap<String, Vec<u8>>>,
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

        /// No answer at all (reset, refused): the call-response headers are unavailable.
        pub(crate) fn no_answer(&self) {
            self.call_headers.borrow_mut().clear();
            self.call_body.borrow_mut().clear();
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

        fn header_bytes(&self, map: Headers, name: &str) -> Option<Vec<u8>> {
            if map == Headers::Request {
                if let Some(raw) = self.raw_request_headers.borrow().get(name) {
                    return Some(raw.clone());
                }
            }
            let m = match map {
                Headers::Request => &self.request_headers,
                Headers::Response => &self.response_headers,
                Headers::CallResponse => &self.call_headers,
            };
            m.borrow().get(name).map(|v| v.clone().into_bytes())
        }

        fn set_header(&self, map: Headers, name: &str, value: Option<&str>) -> bool {
            let m = match map {
                Headers::Request => &self.request_headers,
                Headers::Response => &self.response_headers,
                Headers::CallResponse => return false,
            };
            if map == Headers::Request {
                self.raw_request_headers.borrow_mut().remove(name);
            }
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
                content_type: call.content_type.into(),
                timeout_ms: call.timeout.as_millis(),
                authorization: call.bearer.map(|t| format!("Bearer {t}")),
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
