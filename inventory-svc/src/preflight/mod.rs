//! `kvroute-inventory hash`: the parity preflight users run against their engine's settings.
//!
//! It prints the tokens and block keys kvroute would compute for a prompt, with keys exactly as
//! the engine puts them on the wire (vLLM and TensorRT-LLM unsigned, SGLang signed), so an
//! operator can compare them with one real event from the engine before routing any traffic.
//! With `--events tcp://HOST:PORT` (or `--events-bind tcp://IP:PORT`) it also subscribes to the
//! engine's KV events and compares the engine's own tokens and keys for the prompt with its own
//! ([`events`]): exit 0 when they match, 1 on a mismatch or when no event of the prompt arrived
//! within `--wait-ms`. Bad arguments exit 2 with a one-line reason naming the flag and the
//! allowed values.

mod events;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_core::hash::{
    BlockKey, BlockSize, Engine, ExtraKeys, ExtraKeysLayout, HashAlgo, HashContract,
};
use serde_json::{json, Value};

/// Usage line printed with `--help`.
pub const USAGE: &str = "usage: kvroute-inventory hash --engine vllm|sglang|trtllm [--algo A] [--seed S] [--cache-salt S] [--extra-keys tagged|flat] \
--block-size N (--tokens 1,2,3 | --text T --tokenizer DIR | --chat FILE.json --tokenizer DIR) \
[--events tcp://HOST:PORT | --events-bind tcp://IP:PORT] [--wait-ms N (default 60000)]";

/// How long `--events` waits for the prompt's event by default.
const DEFAULT_WAIT_MS: u64 = 60_000;

/// What the prompt is given as.
enum Input {
    Tokens(Vec<u32>),
    Text { text: String, tokenizer: PathBuf },
    Chat { file: PathBuf, tokenizer: PathBuf },
}

struct Args {
    engine: Engine,
    contract: HashContract,
    extra: ExtraKeys,
    input: Input,
    watch: Option<events::Watch>,
}

/// Runs the subcommand on its arguments (without `hash`); returns the process exit code.
pub fn run(args: Vec<String>) -> i32 {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return 0;
    }
    let parsed = match parse(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvroute-inventory hash: {e}");
            return 2;
        }
    };
    match compute(&parsed) {
        Ok((mut v, tokens, keys)) => {
            let mut code = 0;
            if let Some(w) = &parsed.watch {
                match events::check(w, parsed.engine, &parsed.contract, &tokens, &keys) {
                    Ok(verdict) => {
                        code = if verdict.ok { 0 } else { 1 };
                        v["events"] = verdict.json;
                    }
                    Err(e) => {
                        eprintln!("kvroute-inventory hash: {e}");
                        return 1;
                    }
                }
            }
            println!("{v}");
            code
        }
        Err(e) => {
            eprintln!("kvroute-inventory hash: {e}");
            2
        }
    }
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut engine = None;
    let mut algo = None;
    let mut seed = None;
    let mut salt = None;
    let mut extra_keys = None;
    let mut block_size = None;
    let mut tokens = None;
    let mut text = None;
    let mut chat = None;
    let mut tokenizer = None;
    let mut events = None;
    let mut events_bind = None;
    let mut wait_ms = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--engine" => engine = Some(value()?),
            "--algo" => algo = Some(value()?),
            "--seed" => seed = Some(value()?),
            "--cache-salt" => salt = Some(value()?),
            "--extra-keys" => extra_keys = Some(value()?),
            "--block-size" => block_size = Some(value()?),
            "--tokens" => tokens = Some(value()?),
            "--text" => text = Some(value()?),
            "--chat" => chat = Some(value()?),
            "--tokenizer" => tokenizer = Some(value()?),
            "--events" => events = Some(value()?),
            "--events-bind" => events_bind = Some(value()?),
            "--wait-ms" => wait_ms = Some(value()?),
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    let engine_name = engine.ok_or("--engine is required (vllm, sglang, trtllm)")?;
    let engine = Engine::parse(&engine_name)
        .filter(|e| !e.algos().is_empty())
        .ok_or_else(|| format!("--engine {engine_name:?} is not one of vllm, sglang, trtllm"))?;
    let algo = match algo {
        None => engine
            .default_algo()
            .ok_or("--engine has no hash contract")?,
        Some(a) => {
            let allowed: Vec<&str> = engine
                .algos()
                .iter()
                .map(|a| a.as_str())
                .chain(["tokens"])
                .collect();
            HashAlgo::parse(&a)
                .filter(|h| engine.algos().contains(h) || *h == HashAlgo::Tokens)
                .ok_or_else(|| {
                    format!(
                        "--algo {a:?} does not fit --engine {engine}; allowed: {}",
                        allowed.join(", ")
                    )
                })?
        }
    };
    let bs_raw = block_size.ok_or("--block-size is required (>= 1)")?;
    let block_size = bs_raw
        .parse::<u32>()
        .ok()
        .and_then(BlockSize::new)
        .ok_or_else(|| format!("--block-size {bs_raw:?} must be an integer >= 1"))?;
    let input = match (tokens, text, chat, tokenizer) {
        (Some(t), None, None, None) => Input::Tokens(parse_tokens(&t)?),
        (None, Some(text), None, Some(dir)) => Input::Text {
            text,
            tokenizer: dir.into(),
        },
        (None, None, Some(file), Some(dir)) => Input::Chat {
            file: file.into(),
            tokenizer: dir.into(),
        },
        (None, Some(_), None, None) | (None, None, Some(_), None) => {
            return Err("--text and --chat need --tokenizer DIR (holding tokenizer.json)".into())
        }
        _ => return Err(
            "give exactly one of --tokens, --text (with --tokenizer) or --chat (with --tokenizer)"
                .into(),
        ),
    };
    let extra_layout = match extra_keys.as_deref() {
        None => ExtraKeysLayout::Tagged,
        Some(s) => ExtraKeysLayout::parse(s).ok_or_else(|| {
            format!("--extra-keys {s:?}: allowed tagged (vLLM 0.31 and later), flat (before 0.31)")
        })?,
    };
    let contract = HashContract {
        algo,
        block_size,
        seed,
        extra_layout,
    };
    let wait = match wait_ms {
        None => Duration::from_millis(DEFAULT_WAIT_MS),
        Some(w) => w
            .parse::<u64>()
            .ok()
            .filter(|ms| (1..=3_600_000).contains(ms))
            .map(Duration::from_millis)
            .ok_or_else(|| format!("--wait-ms {w:?} must be 1-3600000"))?,
    };
    let watch = match (events, events_bind) {
        (None, None) => None,
        (Some(_), Some(_)) => return Err("give one of --events and --events-bind".into()),
        (Some(addr), None) | (None, Some(addr)) if engine == Engine::Trtllm => {
            return Err(format!(
                "--events {addr:?}: trtllm publishes no ZMQ events (its KV events are drained from POST /kv_cache_events); allowed with --engine vllm or sglang"
            ))
        }
        (e, b) => {
            let bind = b.is_some();
            let addr = e.or(b).unwrap_or_default();
            let flag = if bind { "--events-bind" } else { "--events" };
            if kvroute_core::rule::ZmqAddr::parse(&addr).is_none() {
                return Err(format!(
                    "{flag} {addr:?}: allowed: {}",
                    kvroute_core::rule::ZmqAddr::ALLOWED
                ));
            }
            Some(events::Watch { addr, bind, wait })
        }
    };
    Ok(Args {
        engine,
        contract,
        extra: ExtraKeys {
            cache_salt: salt,
            ..ExtraKeys::default()
        },
        input,
        watch,
    })
}

fn parse_tokens(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("--tokens: {t:?} is not a token id (0..4294967295)"))
        })
        .collect()
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn tokens_of(input: &Input) -> Result<Vec<u32>, String> {
    use kvroute_core::chat::ChatTemplate;
    use kvroute_core::prompt::{Endpoint, PromptTokens, Request};
    use kvroute_core::tokenize::Tokenizer;
    let load = |dir: &Path| -> Result<(Tokenizer, Option<ChatTemplate>), String> {
        let tok = Tokenizer::from_bytes(&read(&dir.join("tokenizer.json"))?)
            .map_err(|e| e.to_string())?;
        let cfg = dir.join("tokenizer_config.json");
        let tpl = match cfg.exists() {
            true => Some(ChatTemplate::new(&read(&cfg)?).map_err(|e| e.to_string())?),
            false => None,
        };
        Ok((tok, tpl))
    };
    match input {
        Input::Tokens(t) => Ok(t.clone()),
        Input::Text { text, tokenizer } => {
            let (tok, _) = load(tokenizer)?;
            let body = json!({"model": "preflight", "prompt": text}).to_string();
            let req = Request::from_json_for(body.as_bytes(), Endpoint::Completions)
                .map_err(|e| e.to_string())?;
            PromptTokens::from_request(&req, &tok, None).map_err(|e| e.to_string())
        }
        Input::Chat { file, tokenizer } => {
            let (tok, tpl) = load(tokenizer)?;
            let mut body: Value = serde_json::from_slice(&read(file)?)
                .map_err(|e| format!("{}: {e}", file.display()))?;
            if body.get("model").is_none() {
                body["model"] = json!("preflight");
            }
            let req =
                Request::from_json_for(body.to_string().as_bytes(), Endpoint::ChatCompletions)
                    .map_err(|e| e.to_string())?;
            PromptTokens::from_request(&req, &tok, tpl.as_ref()).map_err(|e| e.to_string())
        }
    }
}

/// The printed answer, with the tokens and keys it was made from.
fn compute(args: &Args) -> Result<(Value, Vec<u32>, Vec<BlockKey>), String> {
    let tokens = tokens_of(&args.input)?;
    let block_keys = args
        .contract
        .keys(&tokens, &args.extra)
        .map_err(|e| e.to_string())?;
    let signed = args.engine.signed_keys() && args.contract.algo != HashAlgo::Tokens;
    let keys: Vec<Value> = block_keys
        .iter()
        .map(|k| {
            if signed {
                json!(k.as_i64())
            } else {
                json!(k.0)
            }
        })
        .collect();
    let v = json!({
        "engine": args.engine,
        "algo": args.contract.algo,
        "block_size": args.contract.block_size,
        "tokens": tokens,
        "keys": keys,
    });
    Ok((v, tokens, block_keys))
}
