//! `kvroute-filter`: the proxy-wasm HTTP filter Envoy runs in front of an inference fleet.
//!
//! Per request it turns an OpenAI body into block keys (chat template, tokenizer, the rule's hash
//! contract), asks the inventory service which endpoint holds the longest cached prefix
//! (`POST /v1/route`, short timeout) and pins the upstream through Envoy's header-based
//! stateful_session; every failure fails open. See docs/filter.md.
//!
//! Layout: this file and [`host`] are the only code that touches `proxy_wasm`. They adapt the
//! SDK's root/HTTP contexts onto [`plugin::Plugin`] (per VM: configuration, contract and tokenizer
//! loading) and [`request::RequestFilter`] (per request: a state enum carrying each state's data
//! drives pause/resume, and one wrapper applies the fail-open policy to every step), which see
//! only the [`host::Host`] trait and are unit-tested natively. [`question`] builds the route
//! question from a body, [`config`] parses the plugin configuration, [`tokens`] tokenizes with a
//! segment cache, [`wire`] reads the inventory contracts ([`kvroute_core::wire`]), [`usage`] reads
//! response usage, [`outcomes`] sums predicted against realised reuse for the inventory, [`stats`]
//! names the Envoy stats. [`testkeys`] exports `kvroute_test_keys` for
//! the wasm test host.

pub mod cache;
pub mod config;
pub mod host;
pub mod mem;
pub mod outcomes;
pub mod plugin;
pub mod question;
pub mod request;
pub mod stats;
pub mod testkeys;
pub mod tokens;
pub use kvroute_core::usage;
pub mod wire;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::host::{Body, Headers, Host, ProxyHost};
use crate::plugin::Plugin;
use crate::request::{RequestFilter, Step};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_context_id| -> Box<dyn RootContext> {
        Box::new(Root { plugin: Plugin::new() })
    });
}}

/// Hands the callout response being delivered to `deliver`: the host, its `:status` and its body
/// (empty if unreadable).
fn deliver_call_response(body_size: usize, deliver: impl FnOnce(&ProxyHost, Option<&str>, &[u8])) {
    let host = ProxyHost;
    let status = host.header(Headers::CallResponse, ":status");
    let body = host.body(Body::CallResponse, body_size).unwrap_or_default();
    deliver(&host, status.as_deref(), &body);
}

/// The root context: one per VM, owns the [`Plugin`].
struct Root {
    plugin: Plugin,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        deliver_call_response(body_size, |host, status, body| {
            self.plugin.on_call_response(host, token_id, status, body);
        });
        self.tick_soon();
    }
}

impl Root {
    /// Re-arms the tick so the next load starts without waiting for a long idle period.
    fn tick_soon(&self) {
        host::set_tick_period(plugin::LOADING_TICK);
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        self.plugin.start(&ProxyHost)
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = host::plugin_configuration();
        let ok = self.plugin.configure(&ProxyHost, &bytes);
        // Loads start from the first tick: callouts are not reliable inside on_configure.
        self.tick_soon();
        ok
    }

    fn on_tick(&mut self) {
        let period = self.plugin.on_tick(&ProxyHost);
        host::set_tick_period(period);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        if self.plugin.note_traffic() {
            self.tick_soon();
        }
        Some(Box::new(Http {
            request: self.plugin.new_request(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP request's context, adapting SDK callbacks onto [`RequestFilter`].
struct Http {
    request: RequestFilter,
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        deliver_call_response(body_size, |host, status, body| {
            self.request.on_route_response(host, token_id, status, body);
        });
    }

    fn on_done(&mut self) -> bool {
        self.request.on_done(&ProxyHost);
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "test-crash-hook")]
        if ProxyHost
            .header_bytes(Headers::Request, "x-test-crash-vm")
            .is_some()
        {
            crash_vm();
        }
        action(self.request.on_request_headers(&ProxyHost, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.request
                .on_request_body(&ProxyHost, body_size, end_of_stream),
        )
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        action(self.request.on_response_headers(&ProxyHost))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.request
                .on_response_body(&ProxyHost, body_size, end_of_stream),
        )
    }
}

/// Traps the VM (test builds only, see the `test-crash-hook` feature).
#[cfg(feature = "test-crash-hook")]
fn crash_vm() -> ! {
    #[cfg(target_arch = "wasm32")]
    core::arch::wasm32::unreachable();
    #[cfg(not(target_arch = "wasm32"))]
    std::process::abort();
}

fn action(step: Step) -> Action {
    match step {
        Step::Continue => Action::Continue,
        Step::Pause => Action::Pause,
    }
}
