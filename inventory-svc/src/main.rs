//! `kvroute-inventory`: thin entry point. `serve` runs the service ([`kvroute_inventory::server`]);
//! `hash` is the parity preflight ([`kvroute_inventory::preflight`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvroute_inventory::server::{serve, ServeOptions};
use kvroute_inventory::settings::{env_help, Settings};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "kvroute-inventory",
    version,
    about = "KV-cache inventory and routing service for kvroute"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve every HTTP API (routing, rules, inventory, tokenizers, health, metrics) on one listener.
    #[command(after_help = env_help())]
    Serve {
        /// Address to listen on (port 0 picks a free port; the chosen address is printed on stdout).
        #[arg(long, env = "KVROUTE_LISTEN", default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
        /// Rules to load at start: YAML or JSON, a list of loxilb rules or {lbAttr: [...]}.
        #[arg(long, env = "KVROUTE_CONFIG")]
        config: Option<PathBuf>,
        /// Directory holding tokenizers/<slug>/tokenizer.json (+ tokenizer_config.json) served to filters.
        #[arg(long, env = "KVROUTE_TOKENIZER_DIR")]
        tokenizer_dir: Option<PathBuf>,
        /// File holding the bearer token management writes require; without it writes are refused (401).
        #[arg(long, env = "KVROUTE_AUTH_TOKEN_FILE")]
        auth_token_file: Option<PathBuf>,
        /// File holding the bearer token POST /v1/route requires (`Authorization: Bearer <token>`);
        /// without it /v1/route is open to anyone who reaches the listener.
        #[arg(long, env = "KVROUTE_ROUTE_TOKEN_FILE")]
        route_token_file: Option<PathBuf>,
        /// PEM certificate chain: serve HTTPS (with --tls-key).
        #[arg(long, env = "KVROUTE_TLS_CERT", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of --tls-cert.
        #[arg(long, env = "KVROUTE_TLS_KEY", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
    },
    /// Print the block keys kvroute computes for a prompt (parity preflight); see `hash --help`.
    Hash {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

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
    let opts = ServeOptions {
        listen,
        config,
        tokenizer_dir,
        auth_token_file,
        tls,
        route_token_file,
    };
    match rt.block_on(serve(opts, settings, CancellationToken::new())) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("kvroute-inventory: {e:#}");
            std::process::exit(1);
        }
    }
}
