//! The rule exactly as it travels: loxilb's `LoadbalanceEntry` JSON shape plus kvroute's KV fields.
//!
//! Field names follow loxilb's API (`api/swagger.yml`, `api/models/loadbalance_entry.go` in
//! loxilb-io/loxilb): `serviceArguments` {`externalIP`, `port`, `protocol`, `sel`, `mode`, `name`},
//! `endpoints` [{`endpointIP`, `targetPort`, `weight`}], `secondaryIPs` [{`secondaryIP`}],
//! `allowedSources` [{`prefix`}]. The KV-exact fields (`kvExactMode`, `kvBlockSize`, ...) and the
//! endpoint's `ep_role` come from the KV-exact issue; `kvKeyMode`, `kvModel` and `kvReplayPort`
//! are kvroute's own.
//!
//! Everything is optional and numbers are `i64` on purpose: a missing or out-of-range value must
//! reach validation (which reports every error at once) instead of stopping serde at the first.
//! Unknown fields are still refused by serde (`deny_unknown_fields`): a typo must not silently
//! fall back to a default. loxilb fields kvroute does not implement (`bgp`, `monitor`, probes,
//! `security`, `oper`, ...) are unknown fields here; loxilb's clients omit them at their zero values.

use serde::{Deserialize, Serialize};

/// `POST /netlox/v1/config/loadbalancer` body, and one element of `GET .../all`'s `lbAttr`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawRule {
    #[serde(default)]
    pub service_arguments: RawServiceArguments,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<RawEndpoint>>,
    #[serde(
        default,
        rename = "secondaryIPs",
        skip_serializing_if = "Option::is_none"
    )]
    pub secondary_ips: Option<Vec<RawSecondaryIp>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_sources: Option<Vec<RawAllowedSource>>,
}

/// loxilb's `serviceArguments` subset kvroute implements, plus the KV-exact fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawServiceArguments {
    /// loxilb: "IP address for external access" (required).
    #[serde(
        rename = "externalIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub external_ip: Option<String>,
    /// loxilb: "(Min) port number for the access" (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i64>,
    /// loxilb enum `tcp udp sctp icmp`; kvroute proxies HTTP, so `tcp` only (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// loxilb "load balance algorithm (0-rr, 1-hash, 2-priority, 3-persist, 4-lc, 5-n2, 6-n3)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sel: Option<i64>,
    /// loxilb "NAT mode (0-DNAT, 1-onearm, 2-fullnat, 3-dsr, 4-fullproxy, 5-hostonearm)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<i64>,
    /// loxilb "service name".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_exact_mode: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_block_size: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_hash_algo: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_zmq_port: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_warmup_sec: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_engine_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_dp_rank_count: Option<i64>,
    /// kvroute: `engine` (default) or `tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_key_mode: Option<String>,
    /// kvroute: served model name, used to find the tokenizer directory (see [`crate::slug`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_model: Option<String>,
    /// kvroute, vLLM only: how the engine writes a block's extra keys (LoRA, cache salt) into
    /// its hash: `tagged` (vLLM 0.31 and later, the default) or `flat` (before 0.31).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_vllm_extra_keys: Option<String>,
    /// kvroute: vLLM `replay_endpoint` ROUTER port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_replay_port: Option<i64>,
    /// kvroute: `true` makes the inventory bind each endpoint's `kvZmqEndpoint` and the engine's
    /// publisher connect to it (vLLM connects unless its endpoint has a wildcard host); `false`
    /// (default) connects to the engine's bound publisher.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_zmq_bind: Option<bool>,
}

/// One loxilb endpoint (`endpointIP`, `targetPort`, `weight`) plus the P/D role.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawEndpoint {
    #[serde(
        rename = "endpointIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub endpoint_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_port: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i64>,
    /// `1` prefill, `2` decode; `0` or absent: no role. Spelled as in the KV-exact issue.
    #[serde(
        rename = "ep_role",
        alias = "epRole",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub ep_role: Option<i64>,
    /// KV cache capacity in blocks of `kvBlockSize`, for placement (kvroute). Absent: the
    /// engine's published `num_gpu_blocks`, else the service default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_blocks: Option<i64>,
    /// The engine's KV event address, `tcp://IP:PORT` (rank r on PORT + r): connected to, or with
    /// `kvZmqBind` the address the inventory binds. Absent: `tcp://endpointIP:kvZmqPort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_zmq_endpoint: Option<String>,
    /// vLLM's replay ROUTER of this engine, `tcp://IP:PORT` (rank r on PORT + r). Absent:
    /// `tcp://endpointIP:kvReplayPort` when the rule has `kvReplayPort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_replay_endpoint: Option<String>,
}

/// loxilb `secondaryIPs` item.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RawSecondaryIp {
    #[serde(
        rename = "secondaryIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub secondary_ip: Option<String>,
}

/// loxilb `allowedSources` item: a source prefix allowed to reach the service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RawAllowedSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}
