//! `kvroute-filter`: the proxy-wasm HTTP filter Envoy runs in front of an inference fleet.
//!
//! The finished filter tokenizes OpenAI request bodies, hashes token blocks exactly as the engine
//! does, asks the inventory service which endpoint holds the longest cached prefix and pins the
//! upstream; every failure fails open. This version is the skeleton: it loads, logs once at start,
//! counts requests and passes them through.
//!
//! Layout: this file and [`host`] are the only code that touches `proxy_wasm`. They adapt the SDK's
//! root/HTTP contexts onto [`plugin::Plugin`] and [`request::RequestFilter`], which see only the
//! [`host::Host`] trait and are unit-tested natively. [`testkeys`] exports `kvroute_test_keys`
//! for the wasm test host.

pub mod host;
pub mod plugin;
pub mod request;
pub mod testkeys;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::host::ProxyHost;
use crate::plugin::Plugin;
use crate::request::{RequestFilter, Step};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_context_id| -> Box<dyn RootContext> {
        Box::new(Root { plugin: Plugin::new() })
    });
}}

/// The root context: one per VM, owns the [`Plugin`].
struct Root {
    plugin: Plugin,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        self.plugin.start(&ProxyHost)
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        // Covers hosts that skip on_vm_start for an already running VM; `start` runs once.
        self.plugin.start(&ProxyHost)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
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

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.request.on_request_headers(&ProxyHost, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.request
                .on_request_body(&ProxyHost, body_size, end_of_stream),
        )
    }
}

fn action(step: Step) -> Action {
    match step {
        Step::Continue => Action::Continue,
        Step::Pause => Action::Pause,
    }
}
