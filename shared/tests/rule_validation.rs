//! Rule and settings validation, one table row per row of the KV-exact issue: the default is
//! applied, every boundary is accepted, every out-of-range value is rejected with its exact message.
//! Plus llama.cpp rejections, several errors at once, engine immutability and the loxilb JSON
//! round trip (fixtures in `tests/fixtures/rules/`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::hash::{BlockSize, Engine, HashAlgo, HashContract};
use kvroute_core::rule::{
    EndpointRole, KeyMode, KvMode, LbMode, RawRule, Rule, RuleErrors, RuleParseError, Sel,
};
use kvroute_core::settings::{Settings, SettingsErrors, SpillRelief};
use rstest::rstest;
use serde_json::{json, Value};

const MODES: &str =
    "0 (off), 1 (P/D role-partitioned pool), 3 (role-less single pool); 2 is reserved";
const SEL: &str = "0 (rr), 1 (hash), 2 (priority), 3 (persist), 4 (lc)";
const LB_MODES: &str = "0 (dnat), 1 (onearm), 2 (fullnat), 3 (dsr), 4 (fullproxy), 5 (hostonearm)";
const ALGOS: &str =
    "sha256_cbor, xxhash_cbor (vllm); sha256_sglang (sglang); blockhash_trtllm (trtllm)";
const LLAMA: &str = "kvEngineType llamacpp supports plain load balancing only";

/// A valid KV rule (single pool, vLLM defaults) with `patch` merged into `serviceArguments`.
fn body(patch: Value) -> Value {
    let mut b = json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4, "kvExactMode": 3},
        "endpoints": [
            {"endpointIP": "10.0.1.1", "targetPort": 8000, "weight": 1},
            {"endpointIP": "10.0.1.2", "targetPort": 8000}
        ]
    });
    merge(&mut b["serviceArguments"], patch);
    b
}

/// A P/D pool: one prefill, one decode endpoint.
fn pd_body(patch: Value) -> Value {
    let mut b = body(json!({"kvExactMode": 1}));
    b["endpoints"] = json!([
        {"endpointIP": "10.0.1.1", "targetPort": 8000, "ep_role": 1},
        {"endpointIP": "10.0.1.2", "targetPort": 8000, "ep_role": 2}
    ]);
    merge(&mut b["serviceArguments"], patch);
    b
}

/// Sets (or, for `null`, removes) each key of `patch` in `target`.
fn merge(target: &mut Value, patch: Value) {
    let (Some(t), Value::Object(p)) = (target.as_object_mut(), patch) else {
        panic!("objects only")
    };
    for (k, v) in p {
        if v.is_null() {
            t.remove(&k);
        } else {
            t.insert(k, v);
        }
    }
}

fn parse_with(b: &Value, settings: &Settings) -> Result<Rule, RuleErrors> {
    let raw: RawRule = serde_json::from_value(b.clone()).expect("well-formed RawRule");
    Rule::try_from((raw, settings))
}

fn parse(b: &Value) -> Result<Rule, RuleErrors> {
    parse_with(b, &Settings::default())
}

fn seeded() -> Settings {
    Settings::default().with_none_hash_seed("0")
}

/// The rule as `GET .../all` lists it.
fn listed(r: &Rule) -> Value {
    serde_json::to_value(r).unwrap()
}

/// Exactly one error, with this message.
fn assert_one_error(result: Result<Rule, RuleErrors>, message: &str) {
    let errors = result.expect_err("rule must be rejected").0;
    let got: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(got, vec![message.to_owned()]);
}

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/rules/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn defaults_are_applied() {
    let plain = json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 80},
        "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000}]
    });
    let r = parse(&plain).unwrap();
    assert_eq!(r.id().as_str(), "10.0.0.1:80/tcp");
    assert_eq!(
        (r.kv_mode(), r.engine(), r.sel(), r.mode()),
        (KvMode::Off, Engine::Vllm, Sel::RoundRobin, LbMode::Dnat)
    );
    assert_eq!(r.contract(), None, "KV off: no contract");
    let kv = r.kv().unwrap();
    assert_eq!(u32::from(kv.block_size()), 16);
    assert_eq!(kv.engine_algo(), HashAlgo::Sha256Cbor);
    assert_eq!(
        (kv.zmq_port(), kv.warmup_sec(), kv.dp_rank_count()),
        (5557, 30, 1)
    );
    assert_eq!(
        (kv.key_mode(), kv.replay_port(), kv.model()),
        (KeyMode::Engine, None, None)
    );
    assert_eq!(r.endpoints()[0].weight(), 1);
    assert_eq!(r.endpoints()[0].role(), None);
    assert_eq!(
        listed(&r),
        json!({
            "serviceArguments": {
                "externalIP": "10.0.0.1", "port": 80, "protocol": "tcp", "sel": 0, "mode": 0,
                "kvExactMode": 0, "kvBlockSize": 16, "kvHashAlgo": "sha256_cbor", "kvZmqPort": 5557,
                "kvWarmupSec": 30, "kvEngineType": "vllm", "kvDpRankCount": 1, "kvKeyMode": "engine"
            },
            "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000, "weight": 1}]
        })
    );
}

#[test]
fn kv_contract_follows_engine_seed_and_key_mode() {
    let bs16 = BlockSize::new(16).unwrap();
    let r = parse(&body(json!({}))).unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(HashAlgo::Sha256Cbor, bs16).with_seed("vllm-none-hash"))
    );
    let r = parse_with(&body(json!({})), &seeded()).unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(HashAlgo::Sha256Cbor, bs16).with_seed("0"))
    );
    let r = parse_with(&body(json!({"kvHashAlgo": "xxhash_cbor"})), &seeded()).unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(HashAlgo::XxhashCbor, bs16).with_seed("0"))
    );
    let r = parse(&body(json!({"kvEngineType": "sglang"}))).unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(HashAlgo::Sha256Sglang, bs16))
    );
    let r = parse(&body(json!({"kvEngineType": "trtllm", "kvBlockSize": 32}))).unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(
            HashAlgo::BlockhashTrtllm,
            BlockSize::new(32).unwrap()
        ))
    );
    // tokens key mode: kvroute's content key, no seed needed even for xxhash_cbor.
    let r = parse(&body(
        json!({"kvHashAlgo": "xxhash_cbor", "kvKeyMode": "tokens"}),
    ))
    .unwrap();
    assert_eq!(
        r.contract(),
        Some(&HashContract::new(HashAlgo::Tokens, bs16))
    );
    assert_eq!(r.kv().unwrap().engine_algo(), HashAlgo::XxhashCbor);
}

/// Accepted values: `patch` into a valid single-pool rule, then `serviceArguments[field]` as listed.
#[rstest]
// kvExactMode: default 0, 3 (1 is covered with a P/D pool below)
#[case::exact_mode_default(json!({"kvExactMode": null}), "kvExactMode", json!(0))]
#[case::exact_mode_0(json!({"kvExactMode": 0, "mode": 0}), "kvExactMode", json!(0))]
#[case::exact_mode_3(json!({"kvExactMode": 3}), "kvExactMode", json!(3))]
// kvBlockSize: default 16, >= 1
#[case::block_size_default(json!({}), "kvBlockSize", json!(16))]
#[case::block_size_min(json!({"kvBlockSize": 1}), "kvBlockSize", json!(1))]
#[case::block_size_max(json!({"kvBlockSize": 8192}), "kvBlockSize", json!(8192))]
// kvHashAlgo: derived from the engine when omitted; each coherent pair
#[case::algo_vllm_default(json!({}), "kvHashAlgo", json!("sha256_cbor"))]
#[case::algo_sglang_default(json!({"kvEngineType": "sglang"}), "kvHashAlgo", json!("sha256_sglang"))]
#[case::algo_trtllm_default(json!({"kvEngineType": "trtllm"}), "kvHashAlgo", json!("blockhash_trtllm"))]
#[case::algo_sha256_cbor(json!({"kvHashAlgo": "sha256_cbor"}), "kvHashAlgo", json!("sha256_cbor"))]
#[case::algo_sglang(json!({"kvEngineType": "sglang", "kvHashAlgo": "sha256_sglang"}), "kvHashAlgo", json!("sha256_sglang"))]
#[case::algo_trtllm(json!({"kvEngineType": "trtllm", "kvHashAlgo": "blockhash_trtllm"}), "kvHashAlgo", json!("blockhash_trtllm"))]
#[case::algo_xxhash_tokens_mode(json!({"kvHashAlgo": "xxhash_cbor", "kvKeyMode": "tokens"}), "kvHashAlgo", json!("xxhash_cbor"))]
// kvZmqPort: default 5557, 1-65535, trtllm accepts only the default
#[case::zmq_default(json!({}), "kvZmqPort", json!(5557))]
#[case::zmq_min(json!({"kvZmqPort": 1}), "kvZmqPort", json!(1))]
#[case::zmq_max(json!({"kvZmqPort": 65535}), "kvZmqPort", json!(65535))]
#[case::zmq_trtllm_default(json!({"kvEngineType": "trtllm", "kvZmqPort": 5557}), "kvZmqPort", json!(5557))]
#[case::zmq_max_with_ranks(json!({"kvEngineType": "sglang", "kvZmqPort": 65528, "kvDpRankCount": 8}), "kvZmqPort", json!(65528))]
// kvWarmupSec: default 30, >= 0
#[case::warmup_default(json!({}), "kvWarmupSec", json!(30))]
#[case::warmup_min(json!({"kvWarmupSec": 0}), "kvWarmupSec", json!(0))]
#[case::warmup_max(json!({"kvWarmupSec": 4294967295_u64}), "kvWarmupSec", json!(4294967295_u64))]
// kvEngineType: default vllm, each engine
#[case::engine_default(json!({}), "kvEngineType", json!("vllm"))]
#[case::engine_vllm(json!({"kvEngineType": "vllm"}), "kvEngineType", json!("vllm"))]
#[case::engine_sglang(json!({"kvEngineType": "sglang"}), "kvEngineType", json!("sglang"))]
#[case::engine_trtllm(json!({"kvEngineType": "trtllm"}), "kvEngineType", json!("trtllm"))]
#[case::engine_llamacpp(json!({"kvEngineType": "llamacpp", "kvExactMode": null}), "kvEngineType", json!("llamacpp"))]
// kvDpRankCount: default 1, 1-8 for sglang, 1 for the others
#[case::dp_default(json!({}), "kvDpRankCount", json!(1))]
#[case::dp_min(json!({"kvEngineType": "sglang", "kvDpRankCount": 1}), "kvDpRankCount", json!(1))]
#[case::dp_max(json!({"kvEngineType": "sglang", "kvDpRankCount": 8}), "kvDpRankCount", json!(8))]
#[case::dp_vllm_one(json!({"kvDpRankCount": 1}), "kvDpRankCount", json!(1))]
// mode: 4 with KV on; any loxilb mode with KV off
#[case::mode_fullproxy(json!({"mode": 4}), "mode", json!(4))]
#[case::mode_kv_off_dnat(json!({"kvExactMode": 0, "mode": null}), "mode", json!(0))]
#[case::mode_kv_off_hostonearm(json!({"kvExactMode": 0, "mode": 5}), "mode", json!(5))]
// sel: default 0, every supported algorithm
#[case::sel_default(json!({}), "sel", json!(0))]
#[case::sel_rr(json!({"sel": 0}), "sel", json!(0))]
#[case::sel_hash(json!({"sel": 1}), "sel", json!(1))]
#[case::sel_priority(json!({"sel": 2}), "sel", json!(2))]
#[case::sel_persist(json!({"sel": 3}), "sel", json!(3))]
#[case::sel_lc(json!({"sel": 4}), "sel", json!(4))]
// kvroute's own fields
#[case::key_mode_default(json!({}), "kvKeyMode", json!("engine"))]
#[case::key_mode_tokens(json!({"kvKeyMode": "tokens"}), "kvKeyMode", json!("tokens"))]
#[case::model(json!({"kvModel": "Qwen/Qwen3-0.6B"}), "kvModel", json!("Qwen/Qwen3-0.6B"))]
#[case::extra_keys_flat(json!({"kvVllmExtraKeys": "flat"}), "kvVllmExtraKeys", json!("flat"))]
#[case::extra_keys_tagged_is_the_default(json!({"kvVllmExtraKeys": "tagged"}), "kvVllmExtraKeys", Value::Null)]
#[case::replay_min(json!({"kvReplayPort": 1}), "kvReplayPort", json!(1))]
#[case::replay_max(json!({"kvReplayPort": 65535}), "kvReplayPort", json!(65535))]
#[case::protocol_tcp(json!({"protocol": "tcp"}), "protocol", json!("tcp"))]
#[case::port_min(json!({"port": 1}), "port", json!(1))]
#[case::port_max(json!({"port": 65535}), "port", json!(65535))]
#[case::external_ipv6(json!({"externalIP": "fd00::1"}), "externalIP", json!("fd00::1"))]
fn accepted(#[case] patch: Value, #[case] field: &str, #[case] want: Value) {
    let r = parse(&body(patch)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(listed(&r)["serviceArguments"][field], want);
}

/// Rejected values: exactly one error, with the exact message.
#[rstest]
#[case::exact_mode_reserved(json!({"kvExactMode": 2}), format!("kvExactMode: got 2, allowed: {MODES}"))]
#[case::exact_mode_4(json!({"kvExactMode": 4}), format!("kvExactMode: got 4, allowed: {MODES}"))]
#[case::exact_mode_negative(json!({"kvExactMode": -1}), format!("kvExactMode: got -1, allowed: {MODES}"))]
#[case::block_size_0(json!({"kvBlockSize": 0}), "kvBlockSize: got 0, allowed: >= 1".into())]
#[case::block_size_negative(json!({"kvBlockSize": -16}), "kvBlockSize: got -16, allowed: >= 1".into())]
#[case::block_size_too_big(json!({"kvBlockSize": 8193}), "kvBlockSize: got 8193, allowed: <= 8192".into())]
#[case::block_size_billion(json!({"kvBlockSize": 1_000_000_000}), "kvBlockSize: got 1000000000, allowed: <= 8192".into())]
#[case::block_size_past_u32(json!({"kvBlockSize": 4294967296_u64}), "kvBlockSize: got 4294967296, allowed: <= 8192".into())]
#[case::algo_unknown(json!({"kvHashAlgo": "md5"}), format!("kvHashAlgo: got \"md5\", allowed: {ALGOS}"))]
#[case::algo_pickle_sha256(json!({"kvHashAlgo": "sha256"}), format!("kvHashAlgo: got \"sha256\", allowed: {ALGOS}"))]
#[case::algo_tokens(
    json!({"kvHashAlgo": "tokens"}),
    format!("kvHashAlgo: got \"tokens\", allowed: {ALGOS}; kvroute's content key is kvKeyMode \"tokens\"")
)]
#[case::algo_vllm_sglang(
    json!({"kvHashAlgo": "sha256_sglang"}),
    "kvHashAlgo: got \"sha256_sglang\", allowed: sha256_cbor, xxhash_cbor (kvEngineType is vllm)".into()
)]
#[case::algo_sglang_cbor(
    json!({"kvEngineType": "sglang", "kvHashAlgo": "sha256_cbor"}),
    "kvHashAlgo: got \"sha256_cbor\", allowed: sha256_sglang (kvEngineType is sglang)".into()
)]
#[case::algo_trtllm_xxhash(
    json!({"kvEngineType": "trtllm", "kvHashAlgo": "xxhash_cbor"}),
    "kvHashAlgo: got \"xxhash_cbor\", allowed: blockhash_trtllm (kvEngineType is trtllm)".into()
)]
#[case::algo_xxhash_without_seed(
    json!({"kvHashAlgo": "xxhash_cbor"}),
    format!(
        "kvHashAlgo: got \"xxhash_cbor\", allowed: sha256_cbor, xxhash_cbor with LLB_KV_NONE_HASH_SEED set, \
         or kvKeyMode \"tokens\" ({})",
        kvroute_core::hash::HashError::XxhashNeedsSeed
    )
)]
#[case::zmq_0(json!({"kvZmqPort": 0}), "kvZmqPort: got 0, allowed: 1-65535".into())]
#[case::zmq_65536(json!({"kvZmqPort": 65536}), "kvZmqPort: got 65536, allowed: 1-65535".into())]
#[case::zmq_trtllm(
    json!({"kvEngineType": "trtllm", "kvZmqPort": 6000}),
    "kvZmqPort: got 6000, allowed: 5557 (trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events)".into()
)]
#[case::zmq_ranks_overflow(
    json!({"kvEngineType": "sglang", "kvZmqPort": 65529, "kvDpRankCount": 8}),
    "kvZmqPort: got 65529, allowed: 1-65528 (rank r publishes on kvZmqPort + r; kvDpRankCount is 8)".into()
)]
#[case::warmup_negative(json!({"kvWarmupSec": -1}), "kvWarmupSec: got -1, allowed: >= 0".into())]
#[case::warmup_too_big(json!({"kvWarmupSec": 4294967296_u64}), "kvWarmupSec: got 4294967296, allowed: <= 4294967295".into())]
#[case::engine_unknown(json!({"kvEngineType": "ollama"}), "kvEngineType: got \"ollama\", allowed: vllm, sglang, trtllm, llamacpp".into())]
#[case::engine_case(json!({"kvEngineType": "VLLM"}), "kvEngineType: got \"VLLM\", allowed: vllm, sglang, trtllm, llamacpp".into())]
#[case::dp_0(json!({"kvEngineType": "sglang", "kvDpRankCount": 0}), "kvDpRankCount: got 0, allowed: 1-8".into())]
#[case::dp_9(json!({"kvEngineType": "sglang", "kvDpRankCount": 9}), "kvDpRankCount: got 9, allowed: 1-8".into())]
#[case::dp_vllm(
    json!({"kvDpRankCount": 2}),
    "kvDpRankCount: got 2, allowed: 1 (only meaningful for sglang; kvEngineType is vllm)".into()
)]
#[case::dp_trtllm(
    json!({"kvEngineType": "trtllm", "kvDpRankCount": 8}),
    "kvDpRankCount: got 8, allowed: 1 (only meaningful for sglang; kvEngineType is trtllm)".into()
)]
#[case::mode_not_fullproxy(json!({"mode": 0}), "mode: got 0, allowed: 4 (fullproxy) when kvExactMode is not 0".into())]
#[case::mode_default_with_kv(json!({"mode": null}), "mode: got 0, allowed: 4 (fullproxy) when kvExactMode is not 0".into())]
#[case::mode_fullnat_with_kv(json!({"mode": 2}), "mode: got 2, allowed: 4 (fullproxy) when kvExactMode is not 0".into())]
#[case::mode_unknown(json!({"kvExactMode": 0, "mode": 6}), format!("mode: got 6, allowed: {LB_MODES}"))]
#[case::sel_n2(json!({"sel": 5}), format!("sel: got 5, allowed: {SEL}"))]
#[case::sel_n3(json!({"sel": 6}), format!("sel: got 6, allowed: {SEL}"))]
#[case::sel_negative(json!({"sel": -1}), format!("sel: got -1, allowed: {SEL}"))]
#[case::key_mode(json!({"kvKeyMode": "content"}), "kvKeyMode: got \"content\", allowed: engine, tokens".into())]
#[case::extra_keys_unknown(
    json!({"kvVllmExtraKeys": "v2"}),
    "kvVllmExtraKeys: got \"v2\", allowed: tagged (vLLM 0.31 and later), flat (vLLM before 0.31)".into()
)]
#[case::extra_keys_sglang(
    json!({"kvEngineType": "sglang", "kvVllmExtraKeys": "flat"}),
    "kvVllmExtraKeys: got \"flat\", allowed: absent (vLLM's extra-keys layout; kvEngineType is sglang)".into()
)]
#[case::model_escape(
    json!({"kvModel": "../secrets"}),
    "kvModel: got \"../secrets\", allowed: a served model name usable as one directory name \
     (model name \"../secrets\" has a \"..\" segment, which would leave the tokenizer directory)".into()
)]
#[case::model_absolute(
    json!({"kvModel": "/etc"}),
    "kvModel: got \"/etc\", allowed: a served model name usable as one directory name \
     (model name \"/etc\" starts with '/': absolute paths are not model names)".into()
)]
#[case::model_empty(
    json!({"kvModel": ""}),
    "kvModel: got \"\", allowed: a served model name usable as one directory name (model name is empty)".into()
)]
#[case::replay_0(json!({"kvReplayPort": 0}), "kvReplayPort: got 0, allowed: 1-65535".into())]
#[case::replay_65536(json!({"kvReplayPort": 65536}), "kvReplayPort: got 65536, allowed: 1-65535".into())]
#[case::replay_is_zmq(json!({"kvReplayPort": 5557}), "kvReplayPort: got 5557, allowed: 1-65535 other than kvZmqPort 5557".into())]
#[case::replay_sglang(
    json!({"kvEngineType": "sglang", "kvReplayPort": 5600}),
    "kvReplayPort: got 5600, allowed: absent (replay is a vLLM feature; kvEngineType is sglang)".into()
)]
#[case::protocol_udp(json!({"protocol": "udp"}), "protocol: got \"udp\", allowed: tcp (kvroute proxies HTTP)".into())]
#[case::port_0(json!({"port": 0}), "port: got 0, allowed: 1-65535".into())]
#[case::port_65536(json!({"port": 65536}), "port: got 65536, allowed: 1-65535".into())]
#[case::port_missing(json!({"port": null}), "port: got (missing), allowed: 1-65535".into())]
#[case::external_ip_missing(json!({"externalIP": null}), "externalIP: got (missing), allowed: an IPv4 or IPv6 address".into())]
#[case::external_ip_bad(json!({"externalIP": "10.0.0.256"}), "externalIP: got \"10.0.0.256\", allowed: an IPv4 or IPv6 address".into())]
fn rejected(#[case] patch: Value, #[case] message: String) {
    assert_one_error(parse(&body(patch)), &message);
}

#[test]
fn xxhash_with_seed_is_accepted() {
    let r = parse_with(&body(json!({"kvHashAlgo": "xxhash_cbor"})), &seeded()).unwrap();
    assert_eq!(r.kv().unwrap().engine_algo(), HashAlgo::XxhashCbor);
}

#[test]
fn prefill_decode_pool() {
    let r = parse(&pd_body(json!({}))).unwrap();
    assert_eq!(r.kv_mode(), KvMode::PrefillDecode);
    let roles: Vec<_> = r.endpoints().iter().map(|e| e.role()).collect();
    assert_eq!(
        roles,
        [Some(EndpointRole::Prefill), Some(EndpointRole::Decode)]
    );
    assert_eq!(listed(&r)["endpoints"][1]["ep_role"], json!(2));
    // `epRole` is accepted as an alias.
    let mut b = pd_body(json!({}));
    b["endpoints"][0] = json!({"endpointIP": "10.0.1.1", "targetPort": 8000, "epRole": 1});
    assert!(parse(&b).is_ok());
}

/// Endpoint rows: `endpoints` replaced wholesale; `kv_mode` set in serviceArguments.
#[rstest]
#[case::empty(3, json!([]), "endpoints: got [], allowed: at least 1 endpoint")]
#[case::missing(
    3,
    Value::Null,
    "endpoints: got (missing), allowed: at least 1 endpoint"
)]
#[case::ip_bad(3, json!([{"endpointIP": "host.local", "targetPort": 80}]), "endpoints[0].endpointIP: got \"host.local\", allowed: an IPv4 or IPv6 address")]
#[case::ip_missing(3, json!([{"targetPort": 80}]), "endpoints[0].endpointIP: got (missing), allowed: an IPv4 or IPv6 address")]
#[case::port_0(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 0}]), "endpoints[0].targetPort: got 0, allowed: 1-65535")]
#[case::port_65536(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 65536}]), "endpoints[0].targetPort: got 65536, allowed: 1-65535")]
#[case::port_missing(3, json!([{"endpointIP": "10.0.1.1"}]), "endpoints[0].targetPort: got (missing), allowed: 1-65535")]
#[case::weight_0(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "weight": 0}]), "endpoints[0].weight: got 0, allowed: 1-65535")]
#[case::weight_65536(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "weight": 65536}]), "endpoints[0].weight: got 65536, allowed: 1-65535")]
#[case::duplicate(
    3,
    json!([{"endpointIP": "10.0.1.1", "targetPort": 80}, {"endpointIP": "10.0.1.2", "targetPort": 80}, {"endpointIP": "10.0.1.1", "targetPort": 80}]),
    "endpoints[2]: got 10.0.1.1:80, allowed: each endpointIP:targetPort once (endpoints[0] is the same)"
)]
#[case::duplicate_ipv6_spelling(
    3,
    json!([{"endpointIP": "fd00::1", "targetPort": 80}, {"endpointIP": "fd00:0::0:1", "targetPort": 80}]),
    "endpoints[1]: got [fd00::1]:80, allowed: each endpointIP:targetPort once (endpoints[0] is the same)"
)]
#[case::role_in_single_pool(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 1}]), "endpoints[0].ep_role: got 1, allowed: absent or 0 (roles need kvExactMode 1)")]
#[case::role_with_kv_off(0, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 2}]), "endpoints[0].ep_role: got 2, allowed: absent or 0 (roles need kvExactMode 1)")]
#[case::role_unknown(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 3}]), "endpoints[0].ep_role: got 3, allowed: 1 (prefill), 2 (decode)")]
#[case::pd_role_missing(
    1,
    json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 1}, {"endpointIP": "10.0.1.2", "targetPort": 80, "ep_role": 2}, {"endpointIP": "10.0.1.3", "targetPort": 80}]),
    "endpoints[2].ep_role: got (missing), allowed: 1 (prefill), 2 (decode) (kvExactMode 1 partitions endpoints by role)"
)]
#[case::pd_role_zero(
    1,
    json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 1}, {"endpointIP": "10.0.1.2", "targetPort": 80, "ep_role": 2}, {"endpointIP": "10.0.1.3", "targetPort": 80, "ep_role": 0}]),
    "endpoints[2].ep_role: got 0, allowed: 1 (prefill), 2 (decode) (kvExactMode 1 partitions endpoints by role)"
)]
#[case::pd_no_decode(
    1,
    json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 1}, {"endpointIP": "10.0.1.2", "targetPort": 80, "ep_role": 1}]),
    "endpoints: got 2 prefill and 0 decode, allowed: at least 1 prefill (ep_role 1) and 1 decode (ep_role 2) endpoint when kvExactMode is 1"
)]
#[case::pd_no_prefill(
    1,
    json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 2}]),
    "endpoints: got 0 prefill and 1 decode, allowed: at least 1 prefill (ep_role 1) and 1 decode (ep_role 2) endpoint when kvExactMode is 1"
)]
#[case::capacity_0(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvCapacityBlocks": 0}]), "endpoints[0].kvCapacityBlocks: got 0, allowed: 1-4294967295 (blocks of kvBlockSize; absent: the engine's num_gpu_blocks)")]
#[case::capacity_negative(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvCapacityBlocks": -5}]), "endpoints[0].kvCapacityBlocks: got -5, allowed: 1-4294967295 (blocks of kvBlockSize; absent: the engine's num_gpu_blocks)")]
#[case::capacity_too_large(3, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvCapacityBlocks": 4294967296_u64}]), "endpoints[0].kvCapacityBlocks: got 4294967296, allowed: 1-4294967295 (blocks of kvBlockSize; absent: the engine's num_gpu_blocks)")]
#[case::capacity_with_kv_off(0, json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvCapacityBlocks": 256}]), "endpoints[0].kvCapacityBlocks: got 256, allowed: absent (placement needs kvExactMode 1 or 3)")]
fn endpoint_rejected(#[case] kv_mode: i64, #[case] endpoints: Value, #[case] message: &str) {
    let mut b = body(json!({"kvExactMode": kv_mode}));
    if endpoints.is_null() {
        b.as_object_mut().unwrap().remove("endpoints");
    } else {
        b["endpoints"] = endpoints;
    }
    assert_one_error(parse(&b), message);
}

#[rstest]
#[case::weight_default(json!({"endpointIP": "10.0.1.1", "targetPort": 1}), 1)]
#[case::weight_min(json!({"endpointIP": "10.0.1.1", "targetPort": 65535, "weight": 1}), 1)]
#[case::weight_max(json!({"endpointIP": "10.0.1.1", "targetPort": 80, "weight": 65535}), 65535)]
#[case::role_zero_is_none(json!({"endpointIP": "10.0.1.1", "targetPort": 80, "ep_role": 0}), 1)]
fn endpoint_accepted(#[case] endpoint: Value, #[case] weight: u16) {
    let mut b = body(json!({}));
    b["endpoints"] = json!([endpoint]);
    let r = parse(&b).unwrap();
    assert_eq!(r.endpoints()[0].weight(), weight);
    assert_eq!(r.endpoints()[0].role(), None);
    assert_eq!(r.endpoints()[0].capacity_blocks(), None);
}

/// `n` distinct endpoints (10.1.x.y:8000).
fn many_endpoints(n: usize) -> Value {
    Value::Array(
        (0..n)
            .map(|i| json!({"endpointIP": format!("10.1.{}.{}", i / 250, i % 250 + 1), "targetPort": 8000}))
            .collect(),
    )
}

/// A rule holds up to `MAX_ENDPOINTS` (1,024) endpoints; one more is rejected naming the field
/// and the limit.
#[test]
fn endpoint_count_limit() {
    assert_eq!(kvroute_core::rule::MAX_ENDPOINTS, 1024);
    let mut b = body(json!({}));
    b["endpoints"] = many_endpoints(1024);
    assert_eq!(parse(&b).unwrap().endpoints().len(), 1024);
    b["endpoints"] = many_endpoints(1025);
    assert_one_error(
        parse(&b),
        "endpoints: got 1025 entries, allowed: at most 1024 endpoints per rule",
    );
}

/// `kvCapacityBlocks`: the bounds are accepted, kept per endpoint, and listed back.
#[rstest]
#[case::min(1)]
#[case::typical(256)]
#[case::max(u32::MAX)]
fn endpoint_capacity_accepted(#[case] blocks: u32) {
    let mut b = body(json!({}));
    b["endpoints"][1]["kvCapacityBlocks"] = json!(blocks);
    let r = parse(&b).unwrap();
    let caps: Vec<_> = r.endpoints().iter().map(|e| e.capacity_blocks()).collect();
    assert_eq!(caps, [None, Some(blocks)]);
    assert_eq!(
        listed(&r)["endpoints"][1]["kvCapacityBlocks"],
        json!(blocks)
    );
    assert!(listed(&r)["endpoints"][0].get("kvCapacityBlocks").is_none());
}

/// llama.cpp: plain load balancing only; every KV-exact or P/D control is rejected.
#[rstest]
#[case::exact_mode_1(json!({"kvExactMode": 1}), format!("kvExactMode: got 1, allowed: 0 ({LLAMA})"))]
#[case::exact_mode_3(json!({"kvExactMode": 3}), format!("kvExactMode: got 3, allowed: 0 ({LLAMA})"))]
#[case::exact_mode_reserved(json!({"kvExactMode": 2}), format!("kvExactMode: got 2, allowed: 0 ({LLAMA})"))]
#[case::block_size(json!({"kvBlockSize": 16}), format!("kvBlockSize: got 16, allowed: absent ({LLAMA})"))]
#[case::hash_algo(json!({"kvHashAlgo": "sha256_cbor"}), format!("kvHashAlgo: got \"sha256_cbor\", allowed: absent ({LLAMA})"))]
#[case::zmq_port(json!({"kvZmqPort": 5557}), format!("kvZmqPort: got 5557, allowed: absent ({LLAMA})"))]
#[case::warmup(json!({"kvWarmupSec": 30}), format!("kvWarmupSec: got 30, allowed: absent ({LLAMA})"))]
#[case::dp_ranks(json!({"kvDpRankCount": 1}), format!("kvDpRankCount: got 1, allowed: absent ({LLAMA})"))]
#[case::key_mode(json!({"kvKeyMode": "tokens"}), format!("kvKeyMode: got \"tokens\", allowed: absent ({LLAMA})"))]
#[case::model(json!({"kvModel": "m"}), format!("kvModel: got \"m\", allowed: absent ({LLAMA})"))]
#[case::replay(json!({"kvReplayPort": 5558}), format!("kvReplayPort: got 5558, allowed: absent ({LLAMA})"))]
fn llamacpp_rejects_kv_controls(#[case] patch: Value, #[case] message: String) {
    let mut b = body(json!({"kvEngineType": "llamacpp", "kvExactMode": null, "mode": 0}));
    merge(&mut b["serviceArguments"], patch);
    assert_one_error(parse(&b), &message);
}

#[test]
fn llamacpp_rejects_roles_and_accepts_plain_rules() {
    let mut b = body(json!({"kvEngineType": "llamacpp", "kvExactMode": 0}));
    let r = parse(&b).unwrap();
    assert_eq!(
        (r.engine(), r.kv_mode(), r.kv(), r.contract()),
        (Engine::Llamacpp, KvMode::Off, None, None)
    );
    b["endpoints"][1]["ep_role"] = json!(2);
    assert_one_error(
        parse(&b),
        &format!("endpoints[1].ep_role: got 2, allowed: absent or 0 ({LLAMA})"),
    );
    b["endpoints"][1]["ep_role"] = json!(0);
    b["endpoints"][0]["kvCapacityBlocks"] = json!(512);
    assert_one_error(
        parse(&b),
        &format!("endpoints[0].kvCapacityBlocks: got 512, allowed: absent ({LLAMA})"),
    );
}

#[test]
fn every_error_at_once() {
    let errors = parse(&fixture("everything_wrong.json")).unwrap_err();
    let got: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
    let want = [
        "externalIP: got \"10.10.0.300\", allowed: an IPv4 or IPv6 address",
        "port: got 0, allowed: 1-65535",
        "protocol: got \"udp\", allowed: tcp (kvroute proxies HTTP)",
        &format!("sel: got 5, allowed: {SEL}"),
        "kvBlockSize: got 0, allowed: >= 1",
        "kvHashAlgo: got \"sha256_cbor\", allowed: sha256_sglang (kvEngineType is sglang)",
        "kvZmqPort: got 70000, allowed: 1-65535",
        "kvWarmupSec: got -5, allowed: >= 0",
        "kvDpRankCount: got 9, allowed: 1-8",
        "kvModel: got \"../../etc/passwd\", allowed: a served model name usable as one directory name \
         (model name \"../../etc/passwd\" has a \"..\" segment, which would leave the tokenizer directory)",
        "mode: got 2, allowed: 4 (fullproxy) when kvExactMode is not 0",
        "endpoints[0].weight: got 0, allowed: 1-65535",
        "endpoints[1]: got 10.20.0.1:8000, allowed: each endpointIP:targetPort once (endpoints[0] is the same)",
        "endpoints[2].endpointIP: got \"not-an-ip\", allowed: an IPv4 or IPv6 address",
        "endpoints[2].targetPort: got 65536, allowed: 1-65535",
        "endpoints[2].ep_role: got 7, allowed: 1 (prefill), 2 (decode)",
        "endpoints: got 2 prefill and 0 decode, allowed: at least 1 prefill (ep_role 1) and 1 decode (ep_role 2) \
         endpoint when kvExactMode is 1",
    ];
    assert_eq!(got, want);
    let shown = errors.to_string();
    assert!(
        shown.starts_with("invalid rule (17 errors): externalIP: got \"10.10.0.300\""),
        "{shown}"
    );
    assert_eq!(
        shown,
        format!("invalid rule (17 errors): {}", want.join("; "))
    );
}

#[test]
fn unknown_or_mistyped_fields_fail_as_json() {
    let mut b = body(json!({}));
    b["serviceArguments"]["kvBlocksize"] = json!(16);
    match Rule::from_json(&b.to_string(), &Settings::default()) {
        Err(RuleParseError::Json(m)) => assert!(m.contains("unknown field `kvBlocksize`"), "{m}"),
        other => panic!("{other:?}"),
    }
    let mut b = body(json!({}));
    b["endpoints"][0]["state"] = json!("active");
    assert!(matches!(
        Rule::from_json(&b.to_string(), &Settings::default()),
        Err(RuleParseError::Json(_))
    ));
    let b = body(json!({"kvBlockSize": "16"}));
    assert!(matches!(
        Rule::from_json(&b.to_string(), &Settings::default()),
        Err(RuleParseError::Json(_))
    ));
    // A valid body through the same entry point.
    assert!(Rule::from_json(&body(json!({})).to_string(), &Settings::default()).is_ok());
}

#[test]
fn engine_is_immutable_after_create() {
    let old = parse(&body(json!({}))).unwrap();
    let same = parse(&body(json!({"kvBlockSize": 32, "kvEngineType": "vllm"}))).unwrap();
    assert_eq!(same.check_update(&old), Ok(()));
    let changed = parse(&body(json!({"kvEngineType": "sglang"}))).unwrap();
    let err = changed.check_update(&old).unwrap_err();
    assert_eq!(err.to_string(), "invalid rule (1 error): kvEngineType: got \"sglang\", allowed: vllm (immutable after create)");
    assert_eq!(err.fields(), ["kvEngineType"]);
}

#[rstest]
#[case::vllm_pd("vllm_pd.json", "10.10.0.1:8080/tcp")]
#[case::sglang_dp("sglang_dp.json", "[fd00::10]:30000/tcp")]
#[case::trtllm("trtllm_single_pool.json", "10.10.0.2:8000/tcp")]
#[case::llamacpp("llamacpp_plain.json", "10.10.0.3:8081/tcp")]
fn fixtures_round_trip_through_the_listed_shape(#[case] file: &str, #[case] id: &str) {
    let r = parse(&fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(r.id().as_str(), id);
    let again = parse(&listed(&r)).unwrap();
    assert_eq!(again, r);
    assert_eq!(listed(&again), listed(&r));
}

#[test]
fn fixture_details() {
    let r = parse(&fixture("vllm_pd.json")).unwrap();
    let kv = r.kv().unwrap();
    assert_eq!(
        (kv.replay_port(), kv.model().map(|m| m.as_str())),
        (Some(5558), Some("Qwen__Qwen3-0.6B"))
    );
    assert_eq!(r.name(), Some("qwen-pd"));
    assert_eq!(r.sel(), Sel::LeastConnections);
    let r = parse(&fixture("sglang_dp.json")).unwrap();
    assert_eq!(
        (r.kv().unwrap().dp_rank_count(), r.kv().unwrap().key_mode()),
        (4, KeyMode::Tokens)
    );
    let prefixes: Vec<String> = r
        .allowed_sources()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(prefixes, ["fd00::/16", "10.0.0.0/8"]);
    assert_eq!(
        r.secondary_ips(),
        ["fd00::11".parse::<std::net::IpAddr>().unwrap()]
    );
}

#[rstest]
#[case::secondary_ip(json!({"secondaryIPs": [{"secondaryIP": "x"}]}), "secondaryIPs[0].secondaryIP: got \"x\", allowed: an IPv4 or IPv6 address")]
#[case::prefix_len(json!({"allowedSources": [{"prefix": "10.0.0.0/33"}]}), "allowedSources[0].prefix: got \"10.0.0.0/33\", allowed: an IPv4 or IPv6 prefix (10.0.0.0/8) or address")]
#[case::prefix_missing(json!({"allowedSources": [{}]}), "allowedSources[0].prefix: got (missing), allowed: an IPv4 or IPv6 prefix (10.0.0.0/8) or address")]
fn secondary_ips_and_sources_rejected(#[case] extra: Value, #[case] message: &str) {
    let mut b = body(json!({}));
    merge(&mut b, extra);
    assert_one_error(parse(&b), message);
}

// ---- process-wide settings ----

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let owned: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |name| {
        owned
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
}

#[test]
fn settings_defaults() {
    let s = Settings::from_env(env(&[])).unwrap();
    assert_eq!(s, Settings::default());
    assert_eq!(
        (
            s.min_match_tokens(),
            s.coldstart_seed_n(),
            s.coldstart_min_blocks()
        ),
        (16, 16, 16)
    );
    assert_eq!(
        (s.none_hash_seed(), s.spill_relief()),
        (None, SpillRelief::Unset)
    );
}

#[rstest]
#[case::min_match_min("LLB_KV_MIN_MATCH_TOKENS", "0", |s: &Settings| s.min_match_tokens() == 0)]
#[case::min_match_max("LLB_KV_MIN_MATCH_TOKENS", "4096", |s: &Settings| s.min_match_tokens() == 4096)]
#[case::seed_zero("LLB_KV_NONE_HASH_SEED", "0", |s: &Settings| s.none_hash_seed() == Some("0"))]
#[case::seed_text("LLB_KV_NONE_HASH_SEED", "vllm-none-hash", |s: &Settings| s.none_hash_seed() == Some("vllm-none-hash"))]
#[case::seed_empty("LLB_KV_NONE_HASH_SEED", "", |s: &Settings| s.none_hash_seed() == Some(""))]
#[case::spill_on("LOXILB_KV_SPILL_RELIEF", "on", |s: &Settings| s.spill_relief() == SpillRelief::On)]
#[case::spill_off("LOXILB_KV_SPILL_RELIEF", "off", |s: &Settings| s.spill_relief() == SpillRelief::Off)]
#[case::seed_n_min("LOXILB_KV_COLDSTART_SEED_N", "0", |s: &Settings| s.coldstart_seed_n() == 0)]
#[case::seed_n_max("LOXILB_KV_COLDSTART_SEED_N", "4294967295", |s: &Settings| s.coldstart_seed_n() == u32::MAX)]
#[case::min_blocks_min("LOXILB_KV_COLDSTART_MIN_BLOCKS", "0", |s: &Settings| s.coldstart_min_blocks() == 0)]
#[case::min_blocks_max("LOXILB_KV_COLDSTART_MIN_BLOCKS", "4294967295", |s: &Settings| s.coldstart_min_blocks() == u32::MAX)]
fn settings_accepted(#[case] var: &str, #[case] value: &str, #[case] check: fn(&Settings) -> bool) {
    let s = Settings::from_env(env(&[(var, value)])).unwrap();
    assert!(check(&s), "{var}={value:?} gave {s:?}");
}

#[rstest]
#[case::min_match_over(
    "LLB_KV_MIN_MATCH_TOKENS",
    "4097",
    "LLB_KV_MIN_MATCH_TOKENS: got \"4097\", allowed: 0-4096"
)]
#[case::min_match_negative(
    "LLB_KV_MIN_MATCH_TOKENS",
    "-1",
    "LLB_KV_MIN_MATCH_TOKENS: got \"-1\", allowed: 0-4096"
)]
#[case::min_match_text(
    "LLB_KV_MIN_MATCH_TOKENS",
    "sixteen",
    "LLB_KV_MIN_MATCH_TOKENS: got \"sixteen\", allowed: 0-4096"
)]
#[case::min_match_empty(
    "LLB_KV_MIN_MATCH_TOKENS",
    "",
    "LLB_KV_MIN_MATCH_TOKENS: got \"\", allowed: 0-4096"
)]
#[case::min_match_plus(
    "LLB_KV_MIN_MATCH_TOKENS",
    "+16",
    "LLB_KV_MIN_MATCH_TOKENS: got \"+16\", allowed: 0-4096"
)]
#[case::spill_other(
    "LOXILB_KV_SPILL_RELIEF",
    "true",
    "LOXILB_KV_SPILL_RELIEF: got \"true\", allowed: on, off (or unset)"
)]
#[case::spill_case(
    "LOXILB_KV_SPILL_RELIEF",
    "ON",
    "LOXILB_KV_SPILL_RELIEF: got \"ON\", allowed: on, off (or unset)"
)]
#[case::seed_n_over(
    "LOXILB_KV_COLDSTART_SEED_N",
    "4294967296",
    "LOXILB_KV_COLDSTART_SEED_N: got \"4294967296\", allowed: 0-4294967295"
)]
#[case::seed_n_negative(
    "LOXILB_KV_COLDSTART_SEED_N",
    "-1",
    "LOXILB_KV_COLDSTART_SEED_N: got \"-1\", allowed: 0-4294967295"
)]
#[case::min_blocks_text(
    "LOXILB_KV_COLDSTART_MIN_BLOCKS",
    "1e3",
    "LOXILB_KV_COLDSTART_MIN_BLOCKS: got \"1e3\", allowed: 0-4294967295"
)]
fn settings_rejected(#[case] var: &str, #[case] value: &str, #[case] message: &str) {
    let errors = Settings::from_env(env(&[(var, value)])).unwrap_err().0;
    let got: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(got, [message]);
}

#[test]
fn settings_report_every_error_at_once() {
    let err: SettingsErrors = Settings::from_env(env(&[
        ("LLB_KV_MIN_MATCH_TOKENS", "5000"),
        ("LLB_KV_NONE_HASH_SEED", "0"),
        ("LOXILB_KV_SPILL_RELIEF", "maybe"),
        ("LOXILB_KV_COLDSTART_SEED_N", "x"),
        ("LOXILB_KV_COLDSTART_MIN_BLOCKS", "-2"),
    ]))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid environment (4 errors): LLB_KV_MIN_MATCH_TOKENS: got \"5000\", allowed: 0-4096; \
         LOXILB_KV_SPILL_RELIEF: got \"maybe\", allowed: on, off (or unset); \
         LOXILB_KV_COLDSTART_SEED_N: got \"x\", allowed: 0-4294967295; \
         LOXILB_KV_COLDSTART_MIN_BLOCKS: got \"-2\", allowed: 0-4294967295"
    );
}

#[test]
fn settings_seed_reaches_the_rule_contract() {
    let s = Settings::from_env(env(&[("LLB_KV_NONE_HASH_SEED", "42")])).unwrap();
    let r = parse_with(&body(json!({"kvHashAlgo": "xxhash_cbor"})), &s).unwrap();
    assert_eq!(r.contract().unwrap().seed.as_deref(), Some("42"));
}

/// `kvZmqEndpoint` / `kvReplayEndpoint` per endpoint and `kvZmqBind`: accepted where a ZMQ
/// engine publishes, kept per endpoint, listed back, and parsed again to an equal rule.
#[test]
fn event_addresses_per_endpoint_round_trip() {
    let mut b = body(json!({"kvZmqBind": true, "kvReplayPort": 5600}));
    b["endpoints"] = json!([
        {"endpointIP": "10.0.1.1", "targetPort": 8000, "kvZmqEndpoint": "tcp://127.0.0.1:5601",
         "kvReplayEndpoint": "tcp://10.0.1.1:5701"},
        {"endpointIP": "10.0.1.1", "targetPort": 8001, "kvZmqEndpoint": "tcp://[::1]:5601"}
    ]);
    let r = parse(&b).unwrap();
    let kv = r.kv().unwrap();
    assert!(kv.zmq_bind());
    let eps = r.endpoints();
    assert_eq!(
        eps[0].zmq_endpoint().map(|a| a.to_string()).as_deref(),
        Some("tcp://127.0.0.1:5601")
    );
    assert_eq!(
        eps[0].replay_endpoint().map(|a| a.to_string()).as_deref(),
        Some("tcp://10.0.1.1:5701")
    );
    assert_eq!(
        eps[1].zmq_endpoint().map(|a| a.to_string()).as_deref(),
        Some("tcp://[::1]:5601")
    );
    assert_eq!(eps[1].replay_endpoint(), None);
    let l = listed(&r);
    assert_eq!(l["serviceArguments"]["kvZmqBind"], json!(true));
    assert_eq!(
        l["endpoints"][1]["kvZmqEndpoint"],
        json!("tcp://[::1]:5601")
    );
    assert_eq!(parse(&l).unwrap(), r);
    // Without the flag: connect mode, nothing listed.
    let plain = parse(&body(json!({}))).unwrap();
    assert!(!plain.kv().unwrap().zmq_bind());
    assert!(listed(&plain)["serviceArguments"]
        .get("kvZmqBind")
        .is_none());
}

const ZMQ_ALLOWED: &str = "tcp://IP:PORT (an IPv4 address or a bracketed IPv6 one, port 1-65535)";

#[rstest]
#[case::not_tcp(json!({}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "ipc:///tmp/kv"}]),
    format!("endpoints[0].kvZmqEndpoint: got \"ipc:///tmp/kv\", allowed: {ZMQ_ALLOWED}"))]
#[case::host_name(json!({}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "tcp://engine-0:5557"}]),
    format!("endpoints[0].kvZmqEndpoint: got \"tcp://engine-0:5557\", allowed: {ZMQ_ALLOWED}"))]
#[case::port_0(json!({}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvReplayEndpoint": "tcp://10.0.1.1:0"}]),
    format!("endpoints[0].kvReplayEndpoint: got \"tcp://10.0.1.1:0\", allowed: {ZMQ_ALLOWED}"))]
#[case::bind_needs_an_address(json!({"kvZmqBind": true}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80}]),
    format!("endpoints[0].kvZmqEndpoint: got (missing), allowed: {ZMQ_ALLOWED} that the inventory binds for this engine's publisher to connect to (kvZmqBind is true)"))]
#[case::bind_overlap(json!({"kvZmqBind": true, "kvEngineType": "sglang", "kvDpRankCount": 2}), json!([
        {"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "tcp://127.0.0.1:5601"},
        {"endpointIP": "10.0.1.2", "targetPort": 80, "kvZmqEndpoint": "tcp://127.0.0.1:5602"}]),
    "endpoints[1].kvZmqEndpoint: got \"tcp://127.0.0.1:5602\", allowed: an address no other endpoint binds (endpoints[0].kvZmqEndpoint overlaps; rank r binds PORT + r)".to_owned())]
#[case::last_rank_port(json!({"kvEngineType": "sglang", "kvDpRankCount": 4}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "tcp://127.0.0.1:65534"}]),
    "endpoints[0].kvZmqEndpoint: got \"tcp://127.0.0.1:65534\", allowed: a port of 1-65532 (rank r uses PORT + r; kvDpRankCount is 4)".to_owned())]
#[case::replay_not_vllm(json!({"kvEngineType": "sglang"}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvReplayEndpoint": "tcp://10.0.1.1:5600"}]),
    "endpoints[0].kvReplayEndpoint: got \"tcp://10.0.1.1:5600\", allowed: absent (replay is a vLLM feature; kvEngineType is sglang)".to_owned())]
#[case::trtllm_address(json!({"kvEngineType": "trtllm"}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "tcp://10.0.1.1:5557"}]),
    "endpoints[0].kvZmqEndpoint: got \"tcp://10.0.1.1:5557\", allowed: absent (trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events)".to_owned())]
#[case::trtllm_bind(json!({"kvEngineType": "trtllm", "kvZmqBind": true}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80}]),
    "kvZmqBind: got true, allowed: false or absent (trtllm publishes no ZMQ events: the inventory drains POST /kv_cache_events)".to_owned())]
#[case::llamacpp_bind(json!({"kvEngineType": "llamacpp", "kvExactMode": 0, "mode": 0, "kvZmqBind": false}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80}]),
    format!("kvZmqBind: got false, allowed: absent ({LLAMA})"))]
#[case::llamacpp_address(json!({"kvEngineType": "llamacpp", "kvExactMode": 0, "mode": 0}), json!([{"endpointIP": "10.0.1.1", "targetPort": 80, "kvZmqEndpoint": "tcp://10.0.1.1:5557"}]),
    format!("endpoints[0].kvZmqEndpoint: got \"tcp://10.0.1.1:5557\", allowed: absent ({LLAMA})"))]
fn event_addresses_rejected(
    #[case] args: Value,
    #[case] endpoints: Value,
    #[case] message: String,
) {
    let mut b = body(args);
    b["endpoints"] = endpoints;
    assert_one_error(parse(&b), &message);
}
