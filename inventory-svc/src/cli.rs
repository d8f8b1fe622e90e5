//! The command line of `kvroute-inventory`: the `serve` flags (each also read from its
//! environment variable) and the `hash` preflight, which parses its own arguments.
//!
//! The flags table of docs/inventory.md is generated from these definitions (the test below
//! fails when it differs); `serve --help` prints the same text.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::settings::env_help;

#[derive(Parser)]
#[command(
    name = "kvroute-inventory",
    version,
    about = "KV-cache inventory and routing service for kvroute"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
// Parsed once at start: the size of `Serve` costs nothing worth boxing it for.
#[allow(clippy::large_enum_variant)]
pub enum Cmd {
    /// Serve every HTTP API (routing, rules, inventory, tokenizers, health, metrics) on one listener.
    #[command(after_help = env_help())]
    Serve {
        /// Every HTTP API on this address (port 0 picks one; the line `kvroute-inventory
        /// listening on ADDR` is printed on stdout).
        #[arg(long, env = "KVROUTE_LISTEN", default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
        /// Rules loaded at start: YAML or JSON, a list of loxilb rules or `{lbAttr: [...]}` (the
        /// output of `GET .../all`).
        #[arg(long, env = "KVROUTE_CONFIG")]
        config: Option<PathBuf>,
        /// Serves `DIR/tokenizers/<slug>/tokenizer.json` (+ `tokenizer_config.json`) to filters.
        #[arg(long, env = "KVROUTE_TOKENIZER_DIR", value_name = "DIR")]
        tokenizer_dir: Option<PathBuf>,
        /// File holding the bearer token management writes require; without it every write is
        /// refused (401).
        #[arg(long, env = "KVROUTE_AUTH_TOKEN_FILE")]
        auth_token_file: Option<PathBuf>,
        /// File holding the bearer token `POST /v1/route` and `POST /v1/rules/{id}/outcomes`
        /// require (`Authorization: Bearer <token>`, compared in constant time; 401 otherwise);
        /// unset leaves them open to anyone who reaches the listener. The filter sends it with
        /// its `route_token` setting.
        #[arg(long, env = "KVROUTE_ROUTE_TOKEN_FILE")]
        route_token_file: Option<PathBuf>,
        /// PEM certificate chain: serve HTTPS (rustls, HTTP/1.1 and HTTP/2) instead of HTTP, with
        /// `--tls-key`; the printed line ends in `(tls)`.
        #[arg(long, env = "KVROUTE_TLS_CERT", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of `--tls-cert`.
        #[arg(long, env = "KVROUTE_TLS_KEY", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Also serve the Gateway API Inference Extension endpoint picker (Envoy ext_proc over
        /// plaintext gRPC, with gRPC health) on this address, for the rule `--epp-rule`; the line
        /// `kvroute-inventory epp listening on ADDR` is printed on stdout first (docs/epp.md).
        #[arg(long, env = "KVROUTE_EPP_LISTEN", requires = "epp_rule")]
        epp_listen: Option<SocketAddr>,
        /// The rule the endpoint picker routes for (its InferencePool): id, `VIP:port/protocol`
        /// or `VIP:port`. It may be installed after start; until then requests fail with
        /// reason `no_rule`.
        #[arg(long, env = "KVROUTE_EPP_RULE", requires = "epp_listen")]
        epp_rule: Option<String>,
        /// What the endpoint picker does when it cannot pick: `FailOpen` lets the request
        /// through unpinned (the proxy balances it), `FailClose` rejects it (503; 400 for a bad
        /// body, 413 for one over `--epp-max-body-bytes`). Match the InferencePool's
        /// `endpointPickerRef.failureMode`.
        #[arg(long, env = "KVROUTE_EPP_FAILURE_MODE", default_value = "FailOpen", value_parser = ["FailOpen", "FailClose"])]
        epp_failure_mode: String,
        /// Bound on one endpoint picker decision (tokenization included), in milliseconds;
        /// past it the failure mode answers. Keep it under the proxy's ext_proc
        /// `message_timeout` (Envoy's default: 200 ms).
        #[arg(long, env = "KVROUTE_EPP_TIMEOUT_MS", default_value_t = 150, value_parser = clap::value_parser!(u64).range(1..=60_000))]
        epp_timeout_ms: u64,
        /// Largest request body the endpoint picker holds; a larger one is a failure
        /// (`body_too_large`) and, failing open, streams through unpinned.
        #[arg(long, env = "KVROUTE_EPP_MAX_BODY_BYTES", default_value_t = 4_194_304, value_parser = clap::value_parser!(u64).range(1024..=67_108_864))]
        epp_max_body_bytes: u64,
        /// Fallback endpoints the endpoint picker lists after the chosen one
        /// (`x-gateway-destination-endpoint: chosen,fallback,...`, best first), for the proxy
        /// to retry when the chosen one cannot be reached. Envoy's `override_host` load
        /// balancing policy and the GIE gateways read the list; an `ORIGINAL_DST` cluster needs 0.
        #[arg(long, env = "KVROUTE_EPP_FALLBACKS", default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=16))]
        epp_fallbacks: u64,
        /// Follow this InferencePool (`inference.networking.k8s.io/v1`): the picker's rule gets
        /// the pool's ready pods (pod IP x each `targetPorts` number) as its endpoints, updated
        /// as pods come, go and change readiness. The rule's other fields come from `--config`
        /// (a rule written without `endpoints`) or the management API (docs/epp.md).
        #[arg(long, env = "KVROUTE_EPP_POOL", requires = "epp_listen")]
        epp_pool: Option<String>,
        /// The InferencePool's namespace (its pods'); default: this pod's own namespace (the
        /// service account's), else `default`.
        #[arg(long, env = "KVROUTE_EPP_POOL_NAMESPACE", requires = "epp_pool")]
        epp_pool_namespace: Option<String>,
        /// Kubernetes API server URL for `--epp-pool` (e.g. `kubectl proxy`'s
        /// `http://127.0.0.1:8001`); default: in-cluster (`KUBERNETES_SERVICE_HOST`/`_PORT`,
        /// the service account's CA and token).
        #[arg(long, env = "KVROUTE_KUBE_API", requires = "epp_pool")]
        kube_api: Option<String>,
        /// PEM CA bundle the API server's certificate must chain to; default in a pod: the
        /// service account's `ca.crt`.
        #[arg(long, env = "KVROUTE_KUBE_CA_FILE", requires = "epp_pool")]
        kube_ca_file: Option<PathBuf>,
        /// Bearer token file for the API server, read again for every request (rotated tokens
        /// are followed); default in a pod: the service account's `token`.
        #[arg(long, env = "KVROUTE_KUBE_TOKEN_FILE", requires = "epp_pool")]
        kube_token_file: Option<PathBuf>,
    },
    /// Print the block keys kvroute computes for a prompt (parity preflight); see `hash --help`.
    Hash {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Where the flags table starts in docs/inventory.md.
pub const FLAGS_BEGIN: &str = "<!-- flags table: generated from inventory-svc/src/cli.rs (KVROUTE_WRITE_DOCS=1 cargo test -p kvroute-inventory --lib cli) -->";
/// Where it ends.
pub const FLAGS_END: &str = "<!-- end of flags table -->";

/// The `serve` flags as a markdown table: flag, environment variable, default, meaning.
pub fn flags_table() -> String {
    use clap::CommandFactory;
    let cmd = Cli::command();
    let mut out = String::from("| flag | env | default | meaning |\n|---|---|---|---|\n");
    let Some(serve) = cmd.find_subcommand("serve") else {
        return out;
    };
    for arg in serve.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" {
            continue;
        }
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default = arg
            .get_default_values()
            .iter()
            .map(|d| format!("`{}`", d.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ");
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| {
                h.to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        let default = if default.is_empty() {
            "unset".into()
        } else {
            default
        };
        out.push_str(&format!("| `--{long}` | {env} | {default} | {help} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn docs_flags_table_matches_the_cli() {
        crate::docgen::check(
            "inventory.md",
            FLAGS_BEGIN,
            FLAGS_END,
            &flags_table(),
            "KVROUTE_WRITE_DOCS=1 cargo test -p kvroute-inventory --lib cli",
        );
    }
}
