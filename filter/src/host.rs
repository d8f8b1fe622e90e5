//! The filter's only window onto Envoy.
//!
//! The routing logic ([`crate::plugin`], [`crate::request`]) sees the [`Host`] trait and never
//! `proxy_wasm`, so it runs in native unit tests against a fake host. [`ProxyHost`] is the real
//! implementation over the proxy-wasm hostcalls; together with `lib.rs` it is the only code that
//! touches the SDK. Every hostcall failure is swallowed here and reported as `None`/nothing:
//! a filter that cannot log or count must still pass the request through (fail open).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, MetricType};

/// Severity of a log line, mapped onto Envoy's levels by [`ProxyHost`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// Handle of a counter defined in the host's stats store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterId(pub u32);

/// What the filter's logic may ask of the proxy.
pub trait Host {
    /// Writes one line to the proxy's log.
    fn log(&self, level: Level, message: &str);

    /// Defines (or looks up) a counter; `None` when the host refuses, in which case counting is skipped.
    fn define_counter(&self, name: &str) -> Option<CounterId>;

    /// Adds `delta` to a counter; failures are ignored (metrics never fail a request).
    fn increment(&self, counter: CounterId, delta: u64);
}

/// [`Host`] over the proxy-wasm ABI: valid only inside a proxy-wasm VM.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyHost;

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

    fn define_counter(&self, name: &str) -> Option<CounterId> {
        hostcalls::define_metric(MetricType::Counter, name)
            .ok()
            .map(CounterId)
    }

    fn increment(&self, counter: CounterId, delta: u64) {
        let delta = i64::try_from(delta).unwrap_or(i64::MAX);
        let _ = hostcalls::increment_metric(counter.0, delta);
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
pub(crate) mod testing {
    use std::cell::RefCell;

    use super::{CounterId, Host, Level};

    /// Records logs and counters; `refuse_counters` makes `define_counter` fail.
    #[derive(Default)]
    pub(crate) struct FakeHost {
        refuse_counters: bool,
        logs: RefCell<Vec<(Level, String)>>,
        counters: RefCell<Vec<(String, u64)>>,
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
    }

    impl Host for FakeHost {
        fn log(&self, level: Level, message: &str) {
            self.logs.borrow_mut().push((level, message.to_string()));
        }

        fn define_counter(&self, name: &str) -> Option<CounterId> {
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
    }
}
