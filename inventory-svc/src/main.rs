//! `kvroute-inventory`: thin entry point. `serve` runs the service ([`kvroute_inventory::server`]);
//! `hash` is the parity preflight ([`kvroute_inventory::preflight`]).

use clap::Parser;
use kvroute_inventory::cli::{Cli, Cmd};
use kvroute_inventory::server::{serve, ApiSettings, EppOptions, PoolOptions, ServeOptions};
use kvroute_inventory::settings::Settings;
use tokio_util::sync::CancellationToken;

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // `hash` parses its own arguments (the preflight module owns its flags and exit codes).
    if argv.get(1).map(String::as_str) == Some("hash") {
        std::process::exit(kvroute_inventory::preflight::run(argv[2..].to_vec()));
    }
    let cli = Cli::parse();
    let Cmd::Serve {
        listen,
        config,
        tokenizer_dir,
        auth_token_file,
        route_token_file,
        tls_cert,
        tls_key,
        epp_listen,
        epp_rule,
        epp_failure_mode,
        epp_timeout_ms,
        epp_max_body_bytes,
        epp_fallbacks,
        epp_pool,
        epp_pool_namespace,
        kube_api,
        kube_ca_file,
        kube_token_file,
    } = cli.cmd
    else {
        std::process::exit(2);
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let settings = match Settings::from_env(|k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvroute-inventory: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-inventory: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let tls = tls_cert.zip(tls_key);
    let pool = epp_pool.map(|name| PoolOptions {
        name,
        namespace: epp_pool_namespace.unwrap_or_else(PoolOptions::own_namespace),
        api: ApiSettings {
            url: kube_api,
            ca_file: kube_ca_file,
            token_file: kube_token_file,
        },
    });
    let epp = match epp_listen.zip(epp_rule) {
        None => None,
        Some((listen, rule)) => match epp_failure_mode.parse() {
            Ok(failure_mode) => Some(EppOptions {
                listen,
                rule,
                failure_mode,
                timeout: std::time::Duration::from_millis(epp_timeout_ms),
                max_body: usize::try_from(epp_max_body_bytes).unwrap_or(usize::MAX),
                fallbacks: usize::try_from(epp_fallbacks).unwrap_or(0),
                pool,
            }),
            Err(e) => {
                eprintln!("kvroute-inventory: --epp-failure-mode: {e}");
                std::process::exit(2);
            }
        },
    };
    let opts = ServeOptions {
        listen,
        config,
        tokenizer_dir,
        auth_token_file,
        tls,
        route_token_file,
        epp,
    };
    match rt.block_on(serve(opts, settings, CancellationToken::new())) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("kvroute-inventory: {e:#}");
            std::process::exit(1);
        }
    }
}
