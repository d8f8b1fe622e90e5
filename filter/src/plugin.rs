//! Per-VM plugin state (the proxy-wasm root context's logic).
//!
//! One [`Plugin`] lives for the life of a Wasm VM (one per Envoy worker). It logs once at start,
//! defines the stats, reads the plugin configuration and loads what requests need, all through
//! HTTP callouts to the inventory service driven by the root context's tick:
//!
//! 1. the rule's hash contract, `GET /v1/rules/{rule}/contract` (re-read every `refresh_ms`), so
//!    engine, algorithm, seed, block size and key mode are configured in one place;
//! 2. with `tokenize: filter` and `tokenizer: inventory`, the model's `tokenizer.json` and then its
//!    `tokenizer_config.json` (chat template) from `GET /v1/tokenizers/<slug>[/tokenizer_config.json]`.
//!
//! A failed load is counted and retried with capped exponential backoff; until it succeeds,
//! requests are routed without keys (no tokenizer) or pass unpinned (no contract). Requests share
//! the loaded state through an `Rc<VmState>` (a VM is single-threaded).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use kvroute_core::hash::HashContract;

use crate::cache::KeyCache;
use crate::config::{Config, TokenizeMode, TokenizerSource};
use crate::host::{Callout, Host, Level};
use crate::outcomes::Outcomes;
use crate::request::RequestFilter;
use crate::stats::{Stat, Stats};
use crate::tokens::PromptEncoder;
use crate::wire::RuleContract;
use kvroute_core::wire::OutcomeReport;

/// Counter of HTTP requests the filter saw. Envoy exposes it as `wasmcustom.kvroute_filter_requests_total`.
pub const REQUESTS_TOTAL: &str = "kvroute_filter_requests_total";

/// The line logged once when the VM starts; the Envoy smoke test looks for it.
pub const START_MESSAGE: &str = concat!("kvroute-filter ", env!("CARGO_PKG_VERSION"), " started");

/// How often the root context ticks while something is still loading.
pub const LOADING_TICK: Duration = Duration::from_millis(100);
/// Tick once everything is loaded (contract refresh granularity).
pub const IDLE_TICK: Duration = Duration::from_secs(1);
/// Timeout of the start-up callouts (the tokenizer is several MiB).
const LOAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout of an outcome report.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Retry backoff bounds after a failed load.
const BACKOFF_MIN_NS: u64 = 200_000_000;
const BACKOFF_MAX_NS: u64 = 30_000_000_000;

/// The contract of the configured rule, as loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedContract {
    pub raw: RuleContract,
    /// `None`: KV routing is off for the rule (ask without keys).
    pub hash: Option<HashContract>,
}

/// What every request of this VM shares.
#[derive(Debug, Default)]
pub struct VmState {
    pub config: Config,
    pub stats: Stats,
    pub contract: RefCell<Option<LoadedContract>>,
    pub encoder: RefCell<Option<Rc<PromptEncoder>>>,
    /// Block keys of token prefixes seen before (bounded by `config.key_cache`).
    pub keys: RefCell<KeyCache>,
    /// Predicted against realised reuse since the last report.
    pub outcomes: RefCell<Outcomes>,
}

/// Which load a root callout serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    Contract,
    Tokenizer,
    TokenizerConfig,
    /// An outcome report (held in [`Plugin::unsent`] until answered).
    Report,
}

/// Root-context state of one VM.
#[derive(Debug, Default)]
pub struct Plugin {
    vm: Rc<VmState>,
    started: bool,
    pending: Option<(u32, Load)>,
    /// tokenizer.json bytes waiting for their tokenizer_config.json.
    tokenizer_json: Option<Vec<u8>>,
    next_contract_ns: u64,
    next_tokenizer_ns: u64,
    backoff_ns: u64,
    /// The "no tokenizer" condition is logged once per VM.
    warned_no_tokenizer: bool,
    next_report_ns: u64,
    /// The outcome report in flight, added back to the table if it fails.
    unsent: Option<OutcomeReport>,
    /// Set by the first HTTP context. Only worker VMs serve requests; the main thread's VM
    /// never does, and parsing a tokenizer there would block Envoy's main thread (health
    /// checks, xDS) for a second: tokenizers load only where traffic is seen.
    traffic_seen: Cell<bool>,
}

impl Plugin {
    /// A plugin that has not started yet.
    pub fn new() -> Self {
        Plugin::default()
    }

    /// The shared state (tests and lib.rs).
    pub fn vm(&self) -> &Rc<VmState> {
        &self.vm
    }

    /// Called when the VM starts: logs once and defines the stats. Always succeeds: a refused
    /// metric only disables counting.
    pub fn start(&mut self, host: &dyn Host) -> bool {
        if !self.started {
            self.started = true;
            host.log(Level::Info, START_MESSAGE);
            let stats = Stats::define(host);
            if !stats.counts_requests() {
                host.log(
                    Level::Warn,
                    "cannot define counter kvroute_filter_requests_total; not counting",
                );
            }
            self.vm = Rc::new(VmState {
                stats,
                ..VmState::default()
            });
        }
        true
    }

    /// Reads the plugin configuration. A bad configuration is logged with every problem and the
    /// filter runs as a pass-through (it never takes the gateway down); always returns true.
    pub fn configure(&mut self, host: &dyn Host, bytes: &[u8]) -> bool {
        self.start(host);
        let config = match Config::parse(bytes) {
            Ok(c) => c,
            Err(e) => {
                host.log(
                    Level::Error,
                    &format!("kvroute-filter: {e}; passing requests through unrouted"),
                );
                Config::default()
            }
        };
        let encoder = match config.tokenizer {
            TokenizerSource::Embedded => embedded_encoder(host),
            _ => None,
        };
        match &config.rule {
            Some(rule) => host.log(
                Level::Info,
                &format!(
                    "kvroute-filter: rule {rule:?} via cluster {:?}, timeout {:?}, tokenize {:?}, tokenizer {:?}",
                    config.inventory_cluster, config.timeout, config.tokenize, config.tokenizer
                ),
            ),
            None => host.log(Level::Info, "kvroute-filter: no rule configured; passing requests through"),
        }
        if let Some(enc) = &encoder {
            enc.set_cache_limits(config.caches);
            enc.set_max_prefix_tokens(config.max_prefix_tokens);
        }
        let keys = RefCell::new(KeyCache::new(config.key_cache));
        self.vm = Rc::new(VmState {
            config,
            stats: self.vm.stats.clone(),
            contract: RefCell::new(None),
            encoder: RefCell::new(encoder),
            keys,
            outcomes: RefCell::default(),
        });
        self.pending = None;
        self.tokenizer_json = None;
        self.next_contract_ns = 0;
        self.next_tokenizer_ns = 0;
        self.backoff_ns = BACKOFF_MIN_NS;
        true
    }

    /// State for one new HTTP request.
    pub fn new_request(&self) -> RequestFilter {
        RequestFilter::new(self.vm.clone())
    }

    /// Notes that this VM serves traffic; true the first time while a tokenizer is still
    /// needed (the caller then shortens the tick so loading starts at once).
    pub fn note_traffic(&self) -> bool {
        !self.traffic_seen.replace(true) && self.needs_tokenizer()
    }

    fn needs_tokenizer(&self) -> bool {
        let c = &self.vm.config;
        c.tokenize == TokenizeMode::Filter
            && c.tokenizer == TokenizerSource::Inventory
            && self.vm.encoder.borrow().is_none()
    }

    /// The model whose tokenizer to load: configured, else the rule's `kvModel`.
    fn model(&self) -> Option<String> {
        self.vm.config.model.clone().or_else(|| {
            self.vm
                .contract
                .borrow()
                .as_ref()
                .and_then(|c| c.raw.model.clone())
        })
    }

    /// Root tick: starts the next due load; returns the tick period wanted next.
    pub fn on_tick(&mut self, host: &dyn Host) -> Duration {
        let Some(rule) = self.vm.config.rule.clone() else {
            return IDLE_TICK;
        };
        if self.pending.is_some() {
            return LOADING_TICK;
        }
        let now = host.now_nanos();
        let have_contract = self.vm.contract.borrow().is_some();
        if now >= self.next_contract_ns {
            let path = format!("/v1/rules/{}/contract", path_segment(&rule));
            self.dispatch(host, &path, Load::Contract);
            return LOADING_TICK;
        }
        let wants_tokenizer = self.needs_tokenizer() && self.traffic_seen.get();
        if have_contract && wants_tokenizer && now >= self.next_tokenizer_ns {
            let Some(slug) = self.model().and_then(|m| kvroute_core::slug::slug(&m).ok()) else {
                self.no_tokenizer(
                    host,
                    "the rule names no model (kvModel) and the plugin config sets none",
                );
                self.next_tokenizer_ns = now.saturating_add(BACKOFF_MAX_NS);
                return IDLE_TICK;
            };
            let (path, what) = match self.tokenizer_json {
                None => (format!("/v1/tokenizers/{slug}"), Load::Tokenizer),
                Some(_) => (
                    format!("/v1/tokenizers/{slug}/tokenizer_config.json"),
                    Load::TokenizerConfig,
                ),
            };
            self.dispatch(host, &path, what);
            return LOADING_TICK;
        }
        if let Some(period) = self.vm.config.report {
            if now >= self.next_report_ns && !self.vm.outcomes.borrow().is_empty() {
                self.next_report_ns = now.saturating_add(nanos(period));
                self.report(host, &rule);
            }
        }
        if !have_contract || wants_tokenizer {
            LOADING_TICK
        } else {
            IDLE_TICK
        }
    }

    /// Sends what was judged since the last report to `POST /v1/rules/{rule}/outcomes`.
    fn report(&mut self, host: &dyn Host, rule: &str) {
        let report = self.vm.outcomes.borrow_mut().take();
        let Ok(body) = serde_json::to_vec(&report) else {
            return;
        };
        let path = format!("/v1/rules/{}/outcomes", path_segment(rule));
        let c = &self.vm.config;
        let call = Callout {
            cluster: &c.inventory_cluster,
            method: "POST",
            path: &path,
            authority: &c.inventory_authority,
            body: Some(&body),
            content_type: "application/json",
            timeout: REPORT_TIMEOUT,
            bearer: c.route_token.as_ref().map(|t| t.as_str()),
        };
        match host.dispatch(&call) {
            Some(token) => {
                self.pending = Some((token, Load::Report));
                self.unsent = Some(report);
            }
            None => self.report_failed(host, report),
        }
    }

    /// A report that did not arrive goes back into the table for the next one.
    fn report_failed(&mut self, host: &dyn Host, report: OutcomeReport) {
        let s = &self.vm.stats;
        s.inc(host, Stat::OutcomeReportFailures);
        let dropped = self.vm.outcomes.borrow_mut().restore(report);
        s.add(host, Stat::OutcomesDropped, dropped as u64);
    }

    fn dispatch(&mut self, host: &dyn Host, path: &str, what: Load) {
        let c = &self.vm.config;
        let call = Callout {
            cluster: &c.inventory_cluster,
            method: "GET",
            path,
            authority: &c.inventory_authority,
            body: None,
            content_type: "application/json",
            timeout: LOAD_TIMEOUT,
            bearer: c.route_token.as_ref().map(|t| t.as_str()),
        };
        match host.dispatch(&call) {
            Some(token) => self.pending = Some((token, what)),
            None => self.failed(
                host,
                what,
                &format!("cannot call cluster {:?} for {path}", c.inventory_cluster),
            ),
        }
    }

    fn failed(&mut self, host: &dyn Host, what: Load, why: &str) {
        self.vm.stats.inc(host, Stat::LoadFailures);
        let now = host.now_nanos();
        let at = now.saturating_add(self.backoff_ns);
        self.backoff_ns = (self.backoff_ns.saturating_mul(2)).min(BACKOFF_MAX_NS);
        match what {
            Load::Contract => {
                self.next_contract_ns = at;
                host.log(
                    Level::Warn,
                    &format!("kvroute-filter: loading the rule contract failed ({why}); retrying"),
                );
            }
            Load::Tokenizer | Load::TokenizerConfig => {
                self.next_tokenizer_ns = at;
                self.no_tokenizer(host, why);
            }
            Load::Report => {}
        }
    }

    fn no_tokenizer(&mut self, host: &dyn Host, why: &str) {
        if !self.warned_no_tokenizer {
            self.warned_no_tokenizer = true;
            host.log(
                Level::Warn,
                &format!("kvroute-filter: no tokenizer ({why}); KV scoring is skipped until it loads (fallback routing still applies)"),
            );
        }
    }

    /// The answer to a root callout: `status` is `:status`, `body` the response body.
    pub fn on_call_response(
        &mut self,
        host: &dyn Host,
        token: u32,
        status: Option<&str>,
        body: &[u8],
    ) {
        let Some((want, what)) = self.pending else {
            return;
        };
        if want != token {
            return;
        }
        self.pending = None;
        if what == Load::Report {
            match (status, self.unsent.take()) {
                (Some("200"), _) => self.vm.stats.inc(host, Stat::OutcomeReports),
                (_, Some(report)) => self.report_failed(host, report),
                (_, None) => {}
            }
            return;
        }
        if status != Some("200") {
            let why = format!("the inventory answered status {}", status.unwrap_or("none"));
            self.failed(host, what, &why);
            return;
        }
        match what {
            Load::Contract => match RuleContract::parse(body)
                .and_then(|raw| Ok((raw.hash_contract()?, raw)))
            {
                Ok((hash, raw)) => {
                    let changed = self.vm.contract.borrow().as_ref().map(|c| &c.raw) != Some(&raw);
                    if changed {
                        host.log(
                            Level::Info,
                            &format!(
                                "kvroute-filter: rule contract loaded: {}",
                                String::from_utf8_lossy(body)
                            ),
                        );
                    }
                    *self.vm.contract.borrow_mut() = Some(LoadedContract { raw, hash });
                    self.backoff_ns = BACKOFF_MIN_NS;
                    self.next_contract_ns = host
                        .now_nanos()
                        .saturating_add(nanos(self.vm.config.refresh));
                }
                Err(e) => self.failed(host, what, &e.to_string()),
            },
            Load::Tokenizer => {
                self.tokenizer_json = Some(body.to_vec());
                self.next_tokenizer_ns = 0;
            }
            Load::TokenizerConfig => {
                let Some(json) = self.tokenizer_json.take() else {
                    return;
                };
                let start = host.now_nanos();
                match PromptEncoder::load(&json, Some(body)) {
                    Ok(enc) => {
                        enc.set_cache_limits(self.vm.config.caches);
                        enc.set_max_prefix_tokens(self.vm.config.max_prefix_tokens);
                        host.log(
                            Level::Info,
                            &format!(
                                "kvroute-filter: tokenizer loaded ({} bytes, fast path {}) in {} ms",
                                json.len(),
                                enc.is_fast(),
                                host.now_nanos().saturating_sub(start) / 1_000_000
                            ),
                        );
                        *self.vm.encoder.borrow_mut() = Some(Rc::new(enc));
                        self.vm.stats.inc(host, Stat::TokenizersLoaded);
                        self.backoff_ns = BACKOFF_MIN_NS;
                    }
                    Err(e) => self.failed(host, what, &e.to_string()),
                }
            }
            // Answered before the status check.
            Load::Report => {}
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The tokenizer compiled into the module (cargo feature `embedded-tokenizer`, paths in
/// `KVROUTE_EMBED_TOKENIZER_JSON` / `KVROUTE_EMBED_TOKENIZER_CONFIG` at build time).
#[cfg(feature = "embedded-tokenizer")]
fn embedded_encoder(host: &dyn Host) -> Option<Rc<PromptEncoder>> {
    const JSON: &[u8] = include_bytes!(env!("KVROUTE_EMBED_TOKENIZER_JSON"));
    const CONFIG: &[u8] = include_bytes!(env!("KVROUTE_EMBED_TOKENIZER_CONFIG"));
    match PromptEncoder::load(JSON, Some(CONFIG)) {
        Ok(e) => Some(Rc::new(e)),
        Err(e) => {
            host.log(
                Level::Error,
                &format!("kvroute-filter: embedded tokenizer: {e}"),
            );
            None
        }
    }
}

#[cfg(not(feature = "embedded-tokenizer"))]
fn embedded_encoder(host: &dyn Host) -> Option<Rc<PromptEncoder>> {
    host.log(
        Level::Error,
        "kvroute-filter: tokenizer \"embedded\" needs a module built with the cargo feature embedded-tokenizer; KV scoring is skipped",
    );
    None
}

/// Percent-encodes a rule id for one URL path segment: ids look like `10.0.0.1:8080/tcp` or
/// `[fd00::1]:80/tcp`, whose `/` and brackets must not split or break the path.
fn path_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len() + 6);
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::host::testing::FakeHost;
    use crate::tokens::tests::{tiny_tokenizer_json, TINY_CONFIG};

    const CONTRACT: &[u8] = br#"{"rule_id":1,"engine":"vllm","algo":"sha256_cbor","seed":"0","block_size":4,"key_mode":"engine","model":"Org/M","kv_enabled":true}"#;

    #[test]
    fn start_logs_once_and_defines_counters() {
        let host = FakeHost::default();
        let mut plugin = Plugin::new();
        assert!(plugin.start(&host));
        assert!(plugin.start(&host));
        assert_eq!(host.logs(), vec![(Level::Info, START_MESSAGE.to_string())]);
        assert!(host.counter_names().contains(&REQUESTS_TOTAL.to_string()));
    }

    #[test]
    fn start_survives_refused_counter() {
        let host = FakeHost::refusing_counters();
        let mut plugin = Plugin::new();
        assert!(plugin.start(&host));
        assert!(!plugin.vm().stats.counts_requests());
        assert_eq!(host.logs().len(), 3, "{:?}", host.logs());
    }

    #[test]
    fn loads_contract_then_tokenizer_then_template() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(
            &host,
            br#"{"rule":"10.0.0.1:8080","inventory_cluster":"inv"}"#,
        );
        assert_eq!(p.on_tick(&host), LOADING_TICK);
        assert_eq!(
            host.calls.borrow()[0].path,
            "/v1/rules/10.0.0.1:8080/contract"
        );
        assert_eq!(path_segment("10.0.0.1:8080/tcp"), "10.0.0.1:8080%2Ftcp");
        assert_eq!(path_segment("[fd00::1]:80/tcp"), "%5Bfd00::1%5D:80%2Ftcp");
        // A second tick while the call is pending starts nothing.
        p.on_tick(&host);
        assert_eq!(host.calls.borrow().len(), 1);
        p.on_call_response(&host, 1, Some("200"), CONTRACT);
        assert!(p.vm().contract.borrow().as_ref().unwrap().hash.is_some());
        // No traffic yet (e.g. the main thread's VM): no tokenizer is fetched.
        assert_eq!(p.on_tick(&host), IDLE_TICK);
        assert_eq!(host.calls.borrow().len(), 1);
        assert!(p.note_traffic());
        assert!(!p.note_traffic());
        p.on_tick(&host);
        assert_eq!(host.calls.borrow()[1].path, "/v1/tokenizers/Org__M");
        p.on_call_response(&host, 2, Some("200"), tiny_tokenizer_json().as_bytes());
        p.on_tick(&host);
        assert_eq!(
            host.calls.borrow()[2].path,
            "/v1/tokenizers/Org__M/tokenizer_config.json"
        );
        assert_eq!(
            host.counter("kvroute_filter_tokenizers_loaded_total"),
            Some(0)
        );
        p.on_call_response(&host, 3, Some("200"), TINY_CONFIG.as_bytes());
        assert!(p.vm().encoder.borrow().is_some());
        assert_eq!(
            host.counter("kvroute_filter_tokenizers_loaded_total"),
            Some(1)
        );
        assert_eq!(p.on_tick(&host), IDLE_TICK);
        assert_eq!(host.calls.borrow().len(), 3);
    }

    #[test]
    fn failed_loads_are_counted_logged_once_and_retried_later() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        p.configure(&host, br#"{"rule":"1"}"#);
        p.on_tick(&host);
        p.on_call_response(&host, 1, Some("504"), b"");
        assert_eq!(host.counter("kvroute_filter_load_failures_total"), Some(1));
        // Backoff: the next tick (1 us later on the fake clock) does not retry yet.
        p.on_tick(&host);
        assert_eq!(host.calls.borrow().len(), 1);
        host.clock.set(host.clock.get() + 1_000_000_000);
        p.on_tick(&host);
        assert_eq!(host.calls.borrow().len(), 2);
        p.on_call_response(&host, 2, Some("200"), CONTRACT);
        p.note_traffic();
        p.on_tick(&host);
        p.on_call_response(&host, 3, Some("404"), b"not staged");
        p.on_tick(&host);
        host.clock.set(host.clock.get() + 100_000_000_000);
        p.on_tick(&host);
        p.on_call_response(&host, 4, Some("404"), b"not staged");
        let warns = host
            .logs()
            .iter()
            .filter(|(_, m)| m.contains("no tokenizer"))
            .count();
        assert_eq!(warns, 1);
    }

    #[test]
    fn bad_config_passes_through_and_says_why() {
        let host = FakeHost::default();
        let mut p = Plugin::new();
        assert!(p.configure(&host, br#"{"timeout_ms": 0}"#));
        assert_eq!(p.vm().config.rule, None);
        assert!(host
            .logs()
            .iter()
            .any(|(l, m)| *l == Level::Error && m.contains("timeout_ms: got 0")));
        assert_eq!(p.on_tick(&host), IDLE_TICK);
        assert!(host.calls.borrow().is_empty());
    }
}
