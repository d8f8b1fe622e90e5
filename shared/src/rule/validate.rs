//! [`RawRule`] -> [`Rule`]: every field checked, every error collected, cross-field rules applied.
//!
//! Each field parser returns `Option<T>` and pushes exactly one [`FieldError`] when it returns
//! `None`, so "no errors" implies "every field present". Cross-field checks run only on fields
//! that parsed, so one mistake is reported once (an unknown engine does not also make every
//! `kvHashAlgo` "incoherent").

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use super::{
    quoted, Collector, Endpoint, EndpointRole, IpPrefix, KeyMode, KvConfig, KvMode, LbMode,
    Protocol, RawEndpoint, RawRule, RawServiceArguments, Rule, RuleErrors, RuleId, Sel, ZmqAddr,
    DEFAULT_KV_BLOCK_SIZE, DEFAULT_KV_DP_RANK_COUNT, DEFAULT_KV_WARMUP_SEC, DEFAULT_KV_ZMQ_PORT,
    DEFAULT_WEIGHT, MAX_ENDPOINTS, MAX_KV_BLOCK_SIZE, MAX_KV_DP_RANK_COUNT, MAX_WEIGHT, MISSING,
};
use crate::hash::{
    BlockSize, Engine, ExtraKeysLayout, HashAlgo, HashContract, HashError, DEFAULT_NONE_HASH_SEED,
};
use crate::settings::{Settings, NONE_HASH_SEED_VAR};
use crate::slug::ModelSlug;

const PORT_RANGE: (i64, i64) = (1, 65535);
const PORT_ALLOWED: &str = "1-65535";
const IP_ALLOWED: &str = "an IPv4 or IPv6 address";
const KV_MODE_ALLOWED: &str =
    "0 (off), 1 (P/D role-partitioned pool), 3 (role-less single pool); 2 is reserved";
const MODE_ALLOWED: &str =
    "0 (dnat), 1 (onearm), 2 (fullnat), 3 (dsr), 4 (fullproxy), 5 (hostonearm)";
const SEL_ALLOWED: &str = "0 (rr), 1 (hash), 2 (priority), 3 (persist), 4 (lc)";
const ROLE_ALLOWED: &str = "1 (prefill), 2 (decode)";
const LLAMACPP: &str = "kvEngineType llamacpp supports plain load balancing only";

pub(super) fn validate(raw: &RawRule, settings: &Settings) -> Result<Rule, RuleErrors> {
    let mut c = Collector::default();
    let a = &raw.service_arguments;

    let external_ip = ip(&mut c, "externalIP", a.external_ip.as_deref());
    let port = c.required_int::<u16>("port", a.port, PORT_RANGE, PORT_ALLOWED);
    let protocol = protocol(&mut c, a.protocol.as_deref());
    let sel = a.sel.map_or(Some(Sel::RoundRobin), |v| {
        coded(&mut c, "sel", v, Sel::from_code, SEL_ALLOWED)
    });
    let mode = a.mode.map_or(Some(LbMode::Dnat), |v| {
        coded(&mut c, "mode", v, LbMode::from_code, MODE_ALLOWED)
    });
    let engine = engine(&mut c, a.kv_engine_type.as_deref());
    let llamacpp = engine == Some(Engine::Llamacpp);

    // `kv`: Some(None) for llama.cpp (no KV settings), None when a KV field is invalid.
    let (kv_mode, kv) = if llamacpp {
        reject_kv_fields(&mut c, a);
        (Some(KvMode::Off), Some(None))
    } else {
        (
            kv_mode(&mut c, a.kv_exact_mode),
            kv_config(&mut c, a, engine, settings).map(Some),
        )
    };
    if let (Some(k), Some(m)) = (kv_mode, mode) {
        if k.is_on() && m != LbMode::FullProxy {
            c.push(
                "mode",
                m.code().to_string(),
                "4 (fullproxy) when kvExactMode is not 0",
            );
        }
    }

    let endpoints = endpoints(&mut c, raw.endpoints.as_deref(), kv_mode, llamacpp).filter(|eps| {
        match (engine, &kv) {
            (Some(e), Some(kv)) => event_addresses(&mut c, eps, e, kv.as_ref()),
            _ => true,
        }
    });
    let secondary_ips = list(&mut c, raw.secondary_ips.as_deref(), |c, i, s| {
        ip(
            c,
            &format!("secondaryIPs[{i}].secondaryIP"),
            s.secondary_ip.as_deref(),
        )
    });
    let allowed_sources = list(&mut c, raw.allowed_sources.as_deref(), |c, i, s| {
        prefix(
            c,
            &format!("allowedSources[{i}].prefix"),
            s.prefix.as_deref(),
        )
    });

    // Every parser that returned None pushed its error, so a missing field means `c` is not empty.
    let rule = (|| {
        let (external_ip, port, protocol) = (external_ip?, port?, protocol?);
        Some(Rule {
            id: RuleId::new(external_ip, port, protocol),
            name: a.name.clone(),
            external_ip,
            port,
            protocol,
            sel: sel?,
            mode: mode?,
            engine: engine?,
            kv_mode: kv_mode?,
            kv: kv?,
            endpoints: endpoints?,
            secondary_ips: secondary_ips?,
            allowed_sources: allowed_sources?,
        })
    })();
    match rule {
        Some(rule) if c.0.is_empty() => Ok(rule),
        _ => Err(RuleErrors(c.0)),
    }
}

/// A field whose wire value is a small number naming an enum variant.
fn coded<T>(
    c: &mut Collector,
    field: &str,
    v: i64,
    from_code: fn(u8) -> Option<T>,
    allowed: &str,
) -> Option<T> {
    let parsed = u8::try_from(v).ok().and_then(from_code);
    if parsed.is_none() {
        c.push(field, v.to_string(), allowed);
    }
    parsed
}

fn ip(c: &mut Collector, field: &str, raw: Option<&str>) -> Option<IpAddr> {
    let Some(s) = raw else {
        c.push(field, MISSING, IP_ALLOWED);
        return None;
    };
    let parsed = s.parse::<IpAddr>().ok();
    if parsed.is_none() {
        c.push(field, quoted(s), IP_ALLOWED);
    }
    parsed
}

fn prefix(c: &mut Collector, field: &str, raw: Option<&str>) -> Option<IpPrefix> {
    const ALLOWED: &str = "an IPv4 or IPv6 prefix (10.0.0.0/8) or address";
    let Some(s) = raw else {
        c.push(field, MISSING, ALLOWED);
        return None;
    };
    let parsed = IpPrefix::parse(s);
    if parsed.is_none() {
        c.push(field, quoted(s), ALLOWED);
    }
    parsed
}

/// Validates every item of an optional list; `None` when any item failed.
fn list<R, T>(
    c: &mut Collector,
    raw: Option<&[R]>,
    mut item: impl FnMut(&mut Collector, usize, &R) -> Option<T>,
) -> Option<Vec<T>> {
    let raw = raw.unwrap_or(&[]);
    let parsed: Vec<Option<T>> = raw.iter().enumerate().map(|(i, r)| item(c, i, r)).collect();
    parsed.into_iter().collect()
}

fn protocol(c: &mut Collector, raw: Option<&str>) -> Option<Protocol> {
    match raw {
        None | Some("tcp") => Some(Protocol::Tcp),
        Some(s) => {
            c.push("protocol", quoted(s), "tcp (kvroute proxies HTTP)");
            None
        }
    }
}

fn engine(c: &mut Collector, raw: Option<&str>) -> Option<Engine> {
    let Some(s) = raw else {
        return Some(Engine::Vllm);
    };
    let parsed = Engine::parse(s);
    if parsed.is_none() {
        let names: Vec<&str> = Engine::ALL.iter().map(|e| e.as_str()).collect();
        c.push("kvEngineType", quoted(s), names.join(", "));
    }
    parsed
}

fn kv_mode(c: &mut Collector, raw: Option<i64>) -> Option<KvMode> {
    match raw {
        None | Some(0) => Some(KvMode::Off),
        Some(1) => Some(KvMode::PrefillDecode),
        Some(3) => Some(KvMode::SinglePool),
        Some(v) => {
            c.push("kvExactMode", v.to_string(), KV_MODE_ALLOWED);
            None
        }
    }
}

/// llama.cpp publishes no KV events: every KV-exact control is an error, whatever its value
/// (except an explicit `kvExactMode: 0`, which asks for nothing).
fn reject_kv_fields(c: &mut Collector, a: &RawServiceArguments) {
    if let Some(v) = a.kv_exact_mode.filter(|v| *v != 0) {
        c.push("kvExactMode", v.to_string(), format!("0 ({LLAMACPP})"));
    }
    let absent = format!("absent ({LLAMACPP})");
    let ints = [
        ("kvBlockSize", a.kv_block_size),
        ("kvZmqPort", a.kv_zmq_port),
        ("kvWarmupSec", a.kv_warmup_sec),
        ("kvDpRankCount", a.kv_dp_rank_count),
        ("kvReplayPort", a.kv_replay_port),
    ];
    if let Some(v) = a.kv_zmq_bind {
        c.push("kvZmqBind", v.to_string(), absent.as_str());
    }
    let texts = [
        ("kvHashAlgo", a.kv_hash_algo.as_deref()),
        ("kvKeyMode", a.kv_key_mode.as_deref()),
        ("kvModel", a.kv_model.as_deref()),
        ("kvVllmExtraKeys", a.kv_vllm_extra_keys.as_deref()),
    ];
    for (field, v) in ints {
        if let Some(v) = v {
            c.push(field, v.to_string(), absent.as_str());
        }
    }
    for (field, v) in texts {
        if let Some(v) = v {
            c.push(field, quoted(v), absent.as_str());
        }
    }
}

/// "sha256_cbor, xxhash_cbor (vllm); sha256_sglang (sglang); blockhash_trtllm (trtllm)".
fn all_engine_algos() -> String {
    let per_engine: Vec<String> = Engine::ALL
        .iter()
        .filter(|e| !e.algos().is_empty())
        .map(|e| format!("{} ({e})", algo_names(e.algos())))
        .collect();
    per_engine.join("; ")
}

fn algo_names(algos: &[HashAlgo]) -> String {
    algos
        .iter()
        .map(|a| a.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn hash_algo(c: &mut Collector, raw: Option<&str>, engine: Option<Engine>) -> Option<HashAlgo> {
    let Some(s) = raw else {
        return engine.and_then(Engine::default_algo);
    };
    // `tokens` is kvroute's own key, chosen with kvKeyMode, not something an engine publishes.
    let Some(algo) = HashAlgo::parse(s).filter(|a| a.engine().is_some()) else {
        let hint = if s == HashAlgo::Tokens.as_str() {
            "; kvroute's content key is kvKeyMode \"tokens\""
        } else {
            ""
        };
        c.push(
            "kvHashAlgo",
            quoted(s),
            format!("{}{hint}", all_engine_algos()),
        );
        return None;
    };
    match engine {
        Some(e) if algo.engine() != Some(e) => {
            c.push(
                "kvHashAlgo",
                quoted(s),
                format!("{} (kvEngineType is {e})", algo_names(e.algos())),
            );
            None
        }
        _ => Some(algo),
    }
}

fn kv_config(
    c: &mut Collector,
    a: &RawServiceArguments,
    engine: Option<Engine>,
    settings: &Settings,
) -> Option<KvConfig> {
    let block_size = c
        .at_least::<u32>(
            "kvBlockSize",
            a.kv_block_size,
            DEFAULT_KV_BLOCK_SIZE,
            1,
            i64::from(MAX_KV_BLOCK_SIZE),
        )
        .and_then(BlockSize::new);
    let key_mode = match a.kv_key_mode.as_deref() {
        None => Some(KeyMode::Engine),
        Some(s) => {
            let parsed = KeyMode::parse(s);
            if parsed.is_none() {
                c.push("kvKeyMode", quoted(s), "engine, tokens");
            }
            parsed
        }
    };
    let mut algo = hash_algo(c, a.kv_hash_algo.as_deref(), engine);
    let extra_layout = match (a.kv_vllm_extra_keys.as_deref(), engine) {
        (None, _) => Some(ExtraKeysLayout::Tagged),
        (Some(s), Some(Engine::Vllm)) => {
            let parsed = ExtraKeysLayout::parse(s);
            if parsed.is_none() {
                c.push(
                    "kvVllmExtraKeys",
                    quoted(s),
                    "tagged (vLLM 0.31 and later), flat (vLLM before 0.31)",
                );
            }
            parsed
        }
        (Some(s), e) => {
            c.push(
                "kvVllmExtraKeys",
                quoted(s),
                format!(
                    "absent (vLLM's extra-keys layout; kvEngineType is {})",
                    e.map_or("not a known engine", |e| e.as_str())
                ),
            );
            None
        }
    };
    // Only engine-key mode must reproduce the engine's keys; tokens mode never computes them.
    if algo == Some(HashAlgo::XxhashCbor)
        && key_mode == Some(KeyMode::Engine)
        && settings.none_hash_seed().is_none()
    {
        c.push(
            "kvHashAlgo",
            quoted(HashAlgo::XxhashCbor.as_str()),
            format!(
                "sha256_cbor, xxhash_cbor with {NONE_HASH_SEED_VAR} set, or kvKeyMode \"tokens\" ({})",
                HashError::XxhashNeedsSeed
            ),
        );
        algo = None;
    }

    let mut zmq_port = c.int::<u16>(
        "kvZmqPort",
        a.kv_zmq_port,
        DEFAULT_KV_ZMQ_PORT,
        PORT_RANGE,
        PORT_ALLOWED,
    );
    if let (Some(Engine::Trtllm), Some(p)) = (engine, zmq_port) {
        if p != DEFAULT_KV_ZMQ_PORT {
            c.push(
                "kvZmqPort",
                p.to_string(),
                format!(
                    "{DEFAULT_KV_ZMQ_PORT} (trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events)"
                ),
            );
            zmq_port = None;
        }
    }
    let warmup_sec = c.at_least::<u32>(
        "kvWarmupSec",
        a.kv_warmup_sec,
        DEFAULT_KV_WARMUP_SEC,
        0,
        i64::from(u32::MAX),
    );
    let dp_allowed = format!("1-{MAX_KV_DP_RANK_COUNT}");
    let range = (1, i64::from(MAX_KV_DP_RANK_COUNT));
    let mut dp = c.int::<u8>(
        "kvDpRankCount",
        a.kv_dp_rank_count,
        DEFAULT_KV_DP_RANK_COUNT,
        range,
        &dp_allowed,
    );
    if let (Some(e), Some(n)) = (engine, dp) {
        if e != Engine::Sglang && n != 1 {
            c.push(
                "kvDpRankCount",
                n.to_string(),
                format!("1 (only meaningful for sglang; kvEngineType is {e})"),
            );
            dp = None;
        }
    }
    // Rank r publishes on kvZmqPort + r: the last rank's port must exist.
    if let (Some(p), Some(n)) = (zmq_port, dp) {
        let last = u32::from(p) + u32::from(n) - 1;
        if last > u32::from(u16::MAX) {
            let max = u32::from(u16::MAX) + 1 - u32::from(n);
            let allowed =
                format!("1-{max} (rank r publishes on kvZmqPort + r; kvDpRankCount is {n})");
            c.push("kvZmqPort", p.to_string(), allowed);
            zmq_port = None;
        }
    }
    let replay_port = replay_port(c, a.kv_replay_port, engine, zmq_port);
    let zmq_bind = match (a.kv_zmq_bind, engine) {
        (Some(true), Some(Engine::Trtllm)) => {
            c.push(
                "kvZmqBind",
                "true",
                "false or absent (trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events)",
            );
            None
        }
        (b, _) => Some(b.unwrap_or(false)),
    };
    let model = match a.kv_model.as_deref() {
        None => Some(None),
        Some(name) => match ModelSlug::new(name) {
            Ok(m) => Some(Some(m)),
            Err(e) => {
                c.push(
                    "kvModel",
                    quoted(name),
                    format!("a served model name usable as one directory name ({e})"),
                );
                None
            }
        },
    };

    let (
        Some(block_size),
        Some(engine_algo),
        Some(key_mode),
        Some(zmq_port),
        Some(warmup_sec),
        Some(dp),
        Some(replay_port),
        Some(model),
        Some(zmq_bind),
        Some(extra_layout),
    ) = (
        block_size,
        algo,
        key_mode,
        zmq_port,
        warmup_sec,
        dp,
        replay_port,
        model,
        zmq_bind,
        extra_layout,
    )
    else {
        return None;
    };
    let contract = match key_mode {
        KeyMode::Tokens => HashContract::new(HashAlgo::Tokens, block_size),
        KeyMode::Engine => {
            // vLLM 0.29+ seeds the sha256 family with "vllm-none-hash" when PYTHONHASHSEED is unset.
            let seed = match engine_algo {
                HashAlgo::Sha256Cbor => {
                    Some(settings.none_hash_seed().unwrap_or(DEFAULT_NONE_HASH_SEED))
                }
                HashAlgo::XxhashCbor => settings.none_hash_seed(),
                _ => None,
            };
            HashContract {
                algo: engine_algo,
                block_size,
                seed: seed.map(str::to_owned),
                extra_layout,
            }
        }
    };
    Some(KvConfig {
        block_size,
        engine_algo,
        key_mode,
        zmq_port,
        replay_port,
        zmq_bind,
        warmup_sec,
        dp_rank_count: dp,
        model,
        contract,
    })
}

/// `kvReplayPort`: vLLM only, a real port, not the publisher port (the engine binds both).
/// vLLM always has one publisher here (`kvDpRankCount` is sglang-only), so one port to avoid.
fn replay_port(
    c: &mut Collector,
    raw: Option<i64>,
    engine: Option<Engine>,
    zmq_port: Option<u16>,
) -> Option<Option<u16>> {
    let Some(v) = raw else { return Some(None) };
    if let Some(e) = engine.filter(|e| *e != Engine::Vllm) {
        c.push(
            "kvReplayPort",
            v.to_string(),
            format!("absent (replay is a vLLM feature; kvEngineType is {e})"),
        );
        return None;
    }
    let port = c.required_int::<u16>("kvReplayPort", raw, PORT_RANGE, PORT_ALLOWED)?;
    if zmq_port == Some(port) {
        c.push(
            "kvReplayPort",
            port.to_string(),
            format!("1-65535 other than kvZmqPort {port}"),
        );
        return None;
    }
    Some(Some(port))
}

fn endpoints(
    c: &mut Collector,
    raw: Option<&[RawEndpoint]>,
    kv_mode: Option<KvMode>,
    llamacpp: bool,
) -> Option<Vec<Endpoint>> {
    let list = raw.unwrap_or(&[]);
    if list.is_empty() {
        c.push(
            "endpoints",
            if raw.is_none() { MISSING } else { "[]" },
            "at least 1 endpoint",
        );
        return None;
    }
    if list.len() > MAX_ENDPOINTS {
        c.push(
            "endpoints",
            format!("{} entries", list.len()),
            format!("at most {MAX_ENDPOINTS} endpoints per rule"),
        );
        return None;
    }
    let mut out = Vec::with_capacity(list.len());
    let mut seen: HashMap<SocketAddr, usize> = HashMap::new();
    let (mut prefill, mut decode) = (0usize, 0usize);
    let mut ok = true;
    for (i, e) in list.iter().enumerate() {
        let field = |name: &str| format!("endpoints[{i}].{name}");
        let ip = ip(c, &field("endpointIP"), e.endpoint_ip.as_deref());
        let port = c.required_int::<u16>(
            &field("targetPort"),
            e.target_port,
            PORT_RANGE,
            PORT_ALLOWED,
        );
        let weight = c.int::<u16>(
            &field("weight"),
            e.weight,
            DEFAULT_WEIGHT,
            (1, i64::from(MAX_WEIGHT)),
            "1-65535",
        );
        let role = role(c, &field("ep_role"), e.ep_role, kv_mode, llamacpp);
        let capacity = capacity(
            c,
            &field("kvCapacityBlocks"),
            e.kv_capacity_blocks,
            kv_mode,
            llamacpp,
        );
        match role {
            Some(Some(EndpointRole::Prefill)) => prefill += 1,
            Some(Some(EndpointRole::Decode)) => decode += 1,
            _ => {}
        }
        let addr = match (ip, port) {
            (Some(ip), Some(port)) => {
                let addr = SocketAddr::new(ip, port);
                if let Some(first) = seen.insert(addr, i) {
                    let allowed =
                        format!("each endpointIP:targetPort once (endpoints[{first}] is the same)");
                    c.push(format!("endpoints[{i}]"), addr.to_string(), allowed);
                    // Keep the first index so a third copy names it too.
                    seen.insert(addr, first);
                    None
                } else {
                    Some(addr)
                }
            }
            _ => None,
        };
        let zmq = zmq_addr(c, &field("kvZmqEndpoint"), e.kv_zmq_endpoint.as_deref());
        let replay = zmq_addr(
            c,
            &field("kvReplayEndpoint"),
            e.kv_replay_endpoint.as_deref(),
        );
        match (addr, weight, role, capacity, zmq, replay) {
            (
                Some(addr),
                Some(weight),
                Some(role),
                Some(capacity_blocks),
                Some(zmq_endpoint),
                Some(replay_endpoint),
            ) => out.push(Endpoint {
                addr,
                weight,
                role,
                capacity_blocks,
                zmq_endpoint,
                replay_endpoint,
            }),
            _ => ok = false,
        }
    }
    if kv_mode == Some(KvMode::PrefillDecode) && !llamacpp && (prefill == 0 || decode == 0) {
        c.push(
            "endpoints",
            format!("{prefill} prefill and {decode} decode"),
            "at least 1 prefill (ep_role 1) and 1 decode (ep_role 2) endpoint when kvExactMode is 1",
        );
        ok = false;
    }
    ok.then_some(out)
}

/// An optional `tcp://IP:PORT` field: `Some(None)` when absent, `None` after pushing an error.
fn zmq_addr(c: &mut Collector, field: &str, raw: Option<&str>) -> Option<Option<ZmqAddr>> {
    let Some(s) = raw else { return Some(None) };
    let parsed = ZmqAddr::parse(s);
    if parsed.is_none() {
        c.push(field, quoted(s), ZmqAddr::ALLOWED);
        return None;
    }
    Some(parsed)
}

/// Per-endpoint event and replay addresses against the engine and the rule's KV settings:
/// only ZMQ engines have them (replay only vLLM), `kvZmqBind` needs one per endpoint, every
/// rank's port must exist, and bound addresses must not overlap. False after pushing errors.
fn event_addresses(
    c: &mut Collector,
    eps: &[Endpoint],
    engine: Engine,
    kv: Option<&KvConfig>,
) -> bool {
    let before = c.0.len();
    let field = |i: usize, name: &str| format!("endpoints[{i}].{name}");
    let no_zmq = match engine {
        Engine::Llamacpp => Some(LLAMACPP.to_owned()),
        Engine::Trtllm => Some(
            "trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events".to_owned(),
        ),
        _ => None,
    };
    let ranks = kv.map_or(1, |k| k.dp_rank_count);
    let bind = kv.is_some_and(|k| k.zmq_bind);
    // Bound (ip, first port, last port) ranges seen so far, with their endpoint index.
    let mut bound: Vec<(std::net::IpAddr, u32, u32, usize)> = Vec::new();
    for (i, e) in eps.iter().enumerate() {
        for (name, a) in [
            ("kvZmqEndpoint", e.zmq_endpoint),
            ("kvReplayEndpoint", e.replay_endpoint),
        ] {
            let Some(a) = a else { continue };
            if let Some(why) = &no_zmq {
                c.push(
                    field(i, name),
                    quoted(&a.to_string()),
                    format!("absent ({why})"),
                );
            } else if name == "kvReplayEndpoint" && engine != Engine::Vllm {
                c.push(
                    field(i, name),
                    quoted(&a.to_string()),
                    format!("absent (replay is a vLLM feature; kvEngineType is {engine})"),
                );
            } else if a.for_rank(ranks - 1).is_none() {
                let max = u32::from(u16::MAX) + 1 - u32::from(ranks);
                c.push(
                    field(i, name),
                    quoted(&a.to_string()),
                    format!("a port of 1-{max} (rank r uses PORT + r; kvDpRankCount is {ranks})"),
                );
            }
        }
        if no_zmq.is_some() || !bind {
            continue;
        }
        let Some(a) = e.zmq_endpoint else {
            c.push(
                field(i, "kvZmqEndpoint"),
                MISSING,
                format!("{} that the inventory binds for this engine's publisher to connect to (kvZmqBind is true)", ZmqAddr::ALLOWED),
            );
            continue;
        };
        let sa = a.socket_addr();
        let (lo, hi) = (
            u32::from(sa.port()),
            u32::from(sa.port()) + u32::from(ranks) - 1,
        );
        if let Some(&(_, _, _, j)) = bound
            .iter()
            .find(|(ip, l, h, _)| *ip == sa.ip() && lo <= *h && *l <= hi)
        {
            c.push(
                field(i, "kvZmqEndpoint"),
                quoted(&a.to_string()),
                format!("an address no other endpoint binds (endpoints[{j}].kvZmqEndpoint overlaps; rank r binds PORT + r)"),
            );
        } else {
            bound.push((sa.ip(), lo, hi, i));
        }
    }
    c.0.len() == before
}

/// `kvCapacityBlocks`: optional, 1..=u32::MAX blocks; only where KV scoring runs (placement
/// reads it), so a rule without kvExactMode (or on llama.cpp) rejects it instead of ignoring it.
/// `Some(capacity)` when valid; `None` after pushing an error.
fn capacity(
    c: &mut Collector,
    field: &str,
    raw: Option<i64>,
    kv_mode: Option<KvMode>,
    llamacpp: bool,
) -> Option<Option<u32>> {
    let Some(v) = raw else {
        return Some(None);
    };
    if llamacpp {
        c.push(field, v.to_string(), format!("absent ({LLAMACPP})"));
        return None;
    }
    if kv_mode == Some(KvMode::Off) {
        c.push(
            field,
            v.to_string(),
            "absent (placement needs kvExactMode 1 or 3)",
        );
        return None;
    }
    c.required_int::<u32>(
        field,
        raw,
        (1, i64::from(u32::MAX)),
        "1-4294967295 (blocks of kvBlockSize; absent: the engine's num_gpu_blocks)",
    )
    .map(Some)
}

/// `ep_role`: required (1 or 2) under kvExactMode 1, absent or 0 under every other mode.
/// `Some(role)` when valid; `None` after pushing an error.
fn role(
    c: &mut Collector,
    field: &str,
    raw: Option<i64>,
    kv_mode: Option<KvMode>,
    llamacpp: bool,
) -> Option<Option<EndpointRole>> {
    let pd = kv_mode == Some(KvMode::PrefillDecode);
    match raw {
        None | Some(0) if pd && !llamacpp => {
            let value = raw.map_or(MISSING.to_owned(), |v| v.to_string());
            c.push(
                field,
                value,
                format!("{ROLE_ALLOWED} (kvExactMode 1 partitions endpoints by role)"),
            );
            None
        }
        None | Some(0) => Some(None),
        Some(v) if llamacpp => {
            c.push(field, v.to_string(), format!("absent or 0 ({LLAMACPP})"));
            None
        }
        Some(v @ (1 | 2)) => {
            if matches!(kv_mode, Some(KvMode::Off | KvMode::SinglePool)) {
                c.push(
                    field,
                    v.to_string(),
                    "absent or 0 (roles need kvExactMode 1)",
                );
                return None;
            }
            Some(Some(if v == 1 {
                EndpointRole::Prefill
            } else {
                EndpointRole::Decode
            }))
        }
        Some(v) => {
            c.push(field, v.to_string(), ROLE_ALLOWED);
            None
        }
    }
}
