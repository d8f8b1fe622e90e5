//! The load-balancer rule model: loxilb's API shape in, a fully validated [`Rule`] out.
//!
//! kvroute's configuration API mirrors loxilb's (loxilb-io/loxilb, `api/swagger.yml`,
//! `api/models/loadbalance_entry.go`, `common/common.go`): a rule is posted to
//! `POST /netlox/v1/config/loadbalancer` as `{serviceArguments, endpoints, secondaryIPs?,
//! allowedSources?}` and listed by `GET .../all` as `{"lbAttr": [...]}`. The KV-exact fields are
//! added to `serviceArguments` and `ep_role` to each endpoint.
//!
//! Parse, don't validate: [`RawRule`] (serde) becomes a [`Rule`] only through
//! [`Rule::from_raw`] / `TryFrom<(RawRule, &Settings)>`, which checks every field and returns
//! every problem at once ([`RuleErrors`]); a `Rule` therefore always holds a coherent
//! configuration and is the only form that travels further. Validation needs the process
//! [`Settings`] because the vLLM NONE_HASH seed (`LLB_KV_NONE_HASH_SEED`) is process-wide.
//!
//! Decisions the issue left open (each enforced by validation and tested):
//! * Roles: `kvExactMode` 1 needs a role on every endpoint and at least one prefill and one
//!   decode endpoint; every other mode rejects roles (`ep_role` 0 counts as "no role") instead
//!   of silently ignoring them, so a P/D fleet is never routed as one pool by mistake.
//! * KV fields with `kvExactMode` 0 are validated and kept but inert (an operator can stage them
//!   and flip the mode); llama.cpp, which publishes no KV events, rejects them all.
//! * `kvDpRankCount` other than 1 is rejected for engines other than sglang (the issue: "only
//!   meaningful for sglang").
//! * `weight` defaults to 1 and is capped at 65535 so a pool's total fits Envoy's u32 weight sum.
//! * Rule id: `"<externalIP>:<port>/<protocol>"` (IPv6 in brackets), loxilb's key for a rule
//!   (`/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}`).

mod error;
mod raw;
mod validate;

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Serialize, Serializer};

use crate::hash::{BlockSize, Engine, ExtraKeysLayout, HashAlgo, HashContract};
use crate::settings::Settings;
use crate::slug::ModelSlug;

pub use error::{quoted, FieldError, RuleErrors, RuleParseError, MISSING};
pub use raw::{RawAllowedSource, RawEndpoint, RawRule, RawSecondaryIp, RawServiceArguments};

pub(crate) use error::{write_list, Collector};

/// `kvBlockSize` when omitted (vLLM's default `--block-size`).
pub const DEFAULT_KV_BLOCK_SIZE: u32 = 16;
/// Largest `kvBlockSize` accepted. Engines use 1-256 tokens per block (vLLM 1-128 on CUDA, SGLang
/// `page_size`, TensorRT-LLM `tokens_per_block`); vLLM's hybrid (Mamba) models raise the attention
/// block to a few thousand. A larger value can never match an engine's keys.
pub const MAX_KV_BLOCK_SIZE: u32 = 8192;
/// `kvZmqPort` when omitted (vLLM/SGLang default `tcp://*:5557`).
pub const DEFAULT_KV_ZMQ_PORT: u16 = 5557;
/// `kvWarmupSec` when omitted (accepted and inert).
pub const DEFAULT_KV_WARMUP_SEC: u32 = 30;
/// `kvDpRankCount` when omitted.
pub const DEFAULT_KV_DP_RANK_COUNT: u8 = 1;
/// Largest `kvDpRankCount`.
pub const MAX_KV_DP_RANK_COUNT: u8 = 8;
/// Endpoint `weight` when omitted.
pub const DEFAULT_WEIGHT: u16 = 1;
/// Largest endpoint `weight`: keeps a pool's total within Envoy's u32 weight sum.
pub const MAX_WEIGHT: u16 = u16::MAX;
/// Most endpoints one rule can have: the inventory indexes a rule's endpoints by position with
/// 10-bit ids (its holder sets, the replication codec's `u16`).
pub const MAX_ENDPOINTS: usize = 1024;

/// `kvExactMode`: how requests are matched to cached prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvMode {
    /// 0: plain load balancing with `sel`.
    Off,
    /// 1: prefill/decode role-partitioned pool (endpoints carry `ep_role`).
    PrefillDecode,
    /// 3: one role-less pool; `sel` is the fallback when no prefix matches.
    SinglePool,
}

impl KvMode {
    /// The wire number (`0`, `1`, `3`; `2` is reserved).
    pub fn code(self) -> u8 {
        match self {
            KvMode::Off => 0,
            KvMode::PrefillDecode => 1,
            KvMode::SinglePool => 3,
        }
    }

    /// Whether KV-aware routing is on.
    pub fn is_on(self) -> bool {
        self != KvMode::Off
    }
}

/// `mode`, loxilb's `LBMode` numbering (`common/common.go`). kvroute always proxies at L7; the
/// value is kept for loxilb compatibility and must be `FullProxy` when `kvExactMode` is not 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LbMode {
    /// 0 (loxilb `LBModeDefault`, DNAT).
    Dnat,
    /// 1 (`LBModeOneArm`).
    OneArm,
    /// 2 (`LBModeFullNAT`).
    FullNat,
    /// 3 (`LBModeDSR`).
    Dsr,
    /// 4 (`LBModeFullProxy`): the only mode KV-exact routing works in.
    FullProxy,
    /// 5 (`LBModeHostOneArm`).
    HostOneArm,
}

impl LbMode {
    const ALL: [LbMode; 6] = [
        LbMode::Dnat,
        LbMode::OneArm,
        LbMode::FullNat,
        LbMode::Dsr,
        LbMode::FullProxy,
        LbMode::HostOneArm,
    ];

    /// The wire number.
    pub fn code(self) -> u8 {
        match self {
            LbMode::Dnat => 0,
            LbMode::OneArm => 1,
            LbMode::FullNat => 2,
            LbMode::Dsr => 3,
            LbMode::FullProxy => 4,
            LbMode::HostOneArm => 5,
        }
    }

    fn from_code(n: u8) -> Option<LbMode> {
        LbMode::ALL.into_iter().find(|m| m.code() == n)
    }
}

/// `sel`, loxilb's `EpSelect` numbering (`common/common.go`): the plain load-balancing algorithm,
/// and the fallback when KV-exact routing finds no usable prefix. loxilb's 5 (`n2`) and 6 (`n3`)
/// select 5G SCTP interfaces and are rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sel {
    /// 0 (`LbSelRr`): round robin.
    RoundRobin,
    /// 1 (`LbSelHash`): consistent hash.
    Hash,
    /// 2 (`LbSelPrio`): weighted by endpoint `weight` (loxilb: "weighted round-robin").
    Priority,
    /// 3 (`LbSelRrPersist`): the same client sticks to the same endpoint.
    Persist,
    /// 4 (`LbSelLeastConnections`): least connections (least outstanding requests).
    LeastConnections,
}

impl Sel {
    const ALL: [Sel; 5] = [
        Sel::RoundRobin,
        Sel::Hash,
        Sel::Priority,
        Sel::Persist,
        Sel::LeastConnections,
    ];

    /// The wire number.
    pub fn code(self) -> u8 {
        match self {
            Sel::RoundRobin => 0,
            Sel::Hash => 1,
            Sel::Priority => 2,
            Sel::Persist => 3,
            Sel::LeastConnections => 4,
        }
    }

    fn from_code(n: u8) -> Option<Sel> {
        Sel::ALL.into_iter().find(|s| s.code() == n)
    }
}

/// `protocol`: kvroute proxies HTTP, so only TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    Tcp,
}

impl Protocol {
    /// The wire name (`tcp`).
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
        }
    }
}

/// `kvKeyMode`: which block keys the index holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyMode {
    /// `engine` (default): keys as the engine publishes them; the filter computes the same with
    /// the engine's algorithm and seed.
    Engine,
    /// `tokens`: the inventory re-hashes each event's `token_ids` into kvroute's content key
    /// ([`HashAlgo::Tokens`]); needs no seed or algorithm parity with the engine.
    Tokens,
}

impl KeyMode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyMode::Engine => "engine",
            KeyMode::Tokens => "tokens",
        }
    }

    fn parse(s: &str) -> Option<KeyMode> {
        [KeyMode::Engine, KeyMode::Tokens]
            .into_iter()
            .find(|m| m.as_str() == s)
    }
}

/// `ep_role`: an endpoint's part in a prefill/decode pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointRole {
    /// 1.
    Prefill,
    /// 2.
    Decode,
}

impl EndpointRole {
    /// The wire number.
    pub fn code(self) -> u8 {
        match self {
            EndpointRole::Prefill => 1,
            EndpointRole::Decode => 2,
        }
    }
}

/// One validated backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    addr: SocketAddr,
    weight: u16,
    role: Option<EndpointRole>,
    capacity_blocks: Option<u32>,
    zmq_endpoint: Option<ZmqAddr>,
    replay_endpoint: Option<ZmqAddr>,
}

/// A ZMQ TCP address of a KV event or replay socket, written `tcp://IP:PORT` (IPv6 bracketed);
/// data-parallel rank r uses `PORT + r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ZmqAddr(SocketAddr);

impl ZmqAddr {
    /// What `kvZmqEndpoint` and `kvReplayEndpoint` accept.
    pub const ALLOWED: &'static str =
        "tcp://IP:PORT (an IPv4 address or a bracketed IPv6 one, port 1-65535)";

    /// Parses `tcp://IP:PORT`; `None` for any other form (no host names: the inventory binds or
    /// connects exactly this address).
    pub fn parse(s: &str) -> Option<ZmqAddr> {
        let a: SocketAddr = s.strip_prefix("tcp://")?.parse().ok()?;
        (a.port() != 0).then_some(ZmqAddr(a))
    }

    /// `tcp://addr` (port 0 is kept as given; rules never hold one).
    pub fn from_socket(addr: SocketAddr) -> ZmqAddr {
        ZmqAddr(addr)
    }

    /// The address of `tcp://IP:PORT`.
    pub fn socket_addr(&self) -> SocketAddr {
        self.0
    }

    /// Rank `rank`'s address (`PORT + rank`), `None` past port 65535.
    pub fn for_rank(&self, rank: u8) -> Option<ZmqAddr> {
        let port = self.0.port().checked_add(u16::from(rank))?;
        Some(ZmqAddr(SocketAddr::new(self.0.ip(), port)))
    }
}

impl fmt::Display for ZmqAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp://{}", self.0)
    }
}

impl Endpoint {
    /// `endpointIP:targetPort`; unique within a rule.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Load-balancing weight, 1..=[`MAX_WEIGHT`].
    pub fn weight(&self) -> u16 {
        self.weight
    }

    /// P/D role; always `Some` under [`KvMode::PrefillDecode`], always `None` otherwise.
    pub fn role(&self) -> Option<EndpointRole> {
        self.role
    }

    /// `kvCapacityBlocks`: the operator's statement of the endpoint's KV cache size in blocks,
    /// which placement uses instead of the engine's published `num_gpu_blocks`.
    pub fn capacity_blocks(&self) -> Option<u32> {
        self.capacity_blocks
    }

    /// `kvZmqEndpoint`: this engine's KV event address (rank 0), if given.
    pub fn zmq_endpoint(&self) -> Option<ZmqAddr> {
        self.zmq_endpoint
    }

    /// `kvReplayEndpoint`: this engine's replay ROUTER (rank 0), if given.
    pub fn replay_endpoint(&self) -> Option<ZmqAddr> {
        self.replay_endpoint
    }
}

/// An `allowedSources` prefix (`10.0.0.0/8`; a bare address is a host prefix).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpPrefix {
    addr: IpAddr,
    len: u8,
}

impl IpPrefix {
    /// Parses `addr/len` or a bare address (`/32`, `/128`).
    pub fn parse(s: &str) -> Option<IpPrefix> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a.parse::<IpAddr>().ok()?, Some(l)),
            None => (s.parse::<IpAddr>().ok()?, None),
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            // Digits only: `u8::from_str` would also take "+8".
            Some(l) if !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()) => {
                l.parse::<u8>().ok()?
            }
            Some(_) => return None,
            None => max,
        };
        (len <= max).then_some(IpPrefix { addr, len })
    }

    /// The network address as written.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// Prefix length in bits.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }
}

impl fmt::Display for IpPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// A rule's stable identity: `"<externalIP>:<port>/<protocol>"`, e.g. `10.0.0.1:8080/tcp` or
/// `[fd00::1]:8080/tcp` — loxilb's key for a rule (its delete path names exactly these three).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct RuleId(String);

impl RuleId {
    /// The id of the rule serving `ip:port` over `protocol`.
    pub fn new(ip: IpAddr, port: u16, protocol: Protocol) -> RuleId {
        RuleId(format!(
            "{}/{}",
            SocketAddr::new(ip, port),
            protocol.as_str()
        ))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The KV-exact settings of a rule whose engine publishes KV events (every engine but llama.cpp).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvConfig {
    block_size: BlockSize,
    engine_algo: HashAlgo,
    key_mode: KeyMode,
    zmq_port: u16,
    replay_port: Option<u16>,
    zmq_bind: bool,
    warmup_sec: u32,
    dp_rank_count: u8,
    model: Option<ModelSlug>,
    contract: HashContract,
}

impl KvConfig {
    /// `kvBlockSize`: tokens per block, as the engine is configured.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// `kvHashAlgo`, or the engine's default when omitted: how the engine computes its keys.
    pub fn engine_algo(&self) -> HashAlgo {
        self.engine_algo
    }

    /// `kvKeyMode`.
    pub fn key_mode(&self) -> KeyMode {
        self.key_mode
    }

    /// `kvZmqPort`: data-parallel rank r publishes on this port + r (vLLM, SGLang).
    pub fn zmq_port(&self) -> u16 {
        self.zmq_port
    }

    /// `kvReplayPort`: vLLM's replay ROUTER, if configured.
    pub fn replay_port(&self) -> Option<u16> {
        self.replay_port
    }

    /// `kvZmqBind`: the inventory binds each endpoint's `kvZmqEndpoint` and the engine's
    /// publisher connects to it (instead of the inventory connecting to the engine).
    pub fn zmq_bind(&self) -> bool {
        self.zmq_bind
    }

    /// `kvWarmupSec`: accepted and inert.
    pub fn warmup_sec(&self) -> u32 {
        self.warmup_sec
    }

    /// `kvDpRankCount`: publishers per endpoint (SGLang data-parallel ranks), 1..=8.
    pub fn dp_rank_count(&self) -> u8 {
        self.dp_rank_count
    }

    /// `kvModel`: the served model name and its tokenizer directory slug.
    pub fn model(&self) -> Option<&ModelSlug> {
        self.model.as_ref()
    }

    /// The keys the index holds and the filter computes: the engine's contract (algorithm,
    /// block size, NONE_HASH seed for vLLM) in `engine` key mode, [`HashAlgo::Tokens`] in `tokens`.
    pub fn contract(&self) -> &HashContract {
        &self.contract
    }
}

/// A validated load-balancer rule. Built only by [`Rule::from_raw`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    id: RuleId,
    name: Option<String>,
    external_ip: IpAddr,
    port: u16,
    protocol: Protocol,
    sel: Sel,
    mode: LbMode,
    engine: Engine,
    kv_mode: KvMode,
    kv: Option<KvConfig>,
    endpoints: Vec<Endpoint>,
    secondary_ips: Vec<IpAddr>,
    allowed_sources: Vec<IpPrefix>,
}

impl TryFrom<(RawRule, &Settings)> for Rule {
    type Error = RuleErrors;
    fn try_from((raw, settings): (RawRule, &Settings)) -> Result<Rule, RuleErrors> {
        Rule::from_raw(&raw, settings)
    }
}

impl Rule {
    /// Validates a raw rule against the process settings, reporting every bad field at once.
    pub fn from_raw(raw: &RawRule, settings: &Settings) -> Result<Rule, RuleErrors> {
        validate::validate(raw, settings)
    }

    /// Parses and validates a JSON body.
    pub fn from_json(body: &str, settings: &Settings) -> Result<Rule, RuleParseError> {
        let raw: RawRule =
            serde_json::from_str(body).map_err(|e| RuleParseError::Json(e.to_string()))?;
        Ok(Rule::from_raw(&raw, settings)?)
    }

    /// Rejects an update that changes what cannot change after create (`kvEngineType`: the
    /// inventory's event decoding and stored keys are engine-specific). `self` is the new rule.
    pub fn check_update(&self, old: &Rule) -> Result<(), RuleErrors> {
        if self.engine != old.engine {
            return Err(RuleErrors(vec![FieldError::new(
                "kvEngineType",
                quoted(self.engine.as_str()),
                format!("{} (immutable after create)", old.engine.as_str()),
            )]));
        }
        Ok(())
    }

    /// The rule's identity (see [`RuleId`]).
    pub fn id(&self) -> &RuleId {
        &self.id
    }

    /// loxilb's optional service `name`.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// `externalIP`.
    pub fn external_ip(&self) -> IpAddr {
        self.external_ip
    }

    /// `port`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `protocol`.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// `sel`: plain algorithm and KV fallback.
    pub fn sel(&self) -> Sel {
        self.sel
    }

    /// `mode`.
    pub fn mode(&self) -> LbMode {
        self.mode
    }

    /// `kvEngineType` (immutable after create).
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// `kvExactMode`.
    pub fn kv_mode(&self) -> KvMode {
        self.kv_mode
    }

    /// KV settings; `None` for llama.cpp. Present but inert when [`Rule::kv_mode`] is `Off`.
    pub fn kv(&self) -> Option<&KvConfig> {
        self.kv.as_ref()
    }

    /// The hash contract when KV-exact routing is on; `None` when it is off.
    pub fn contract(&self) -> Option<&HashContract> {
        match (&self.kv, self.kv_mode.is_on()) {
            (Some(kv), true) => Some(&kv.contract),
            _ => None,
        }
    }

    /// The backends, in configuration order.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// loxilb `secondaryIPs`.
    pub fn secondary_ips(&self) -> &[IpAddr] {
        &self.secondary_ips
    }

    /// loxilb `allowedSources`; empty means every source.
    pub fn allowed_sources(&self) -> &[IpPrefix] {
        &self.allowed_sources
    }

    /// The loxilb JSON shape with every default made explicit (what `GET .../all` lists).
    /// Parsing it again yields an equal rule.
    pub fn to_raw(&self) -> RawRule {
        let mut args = RawServiceArguments {
            external_ip: Some(self.external_ip.to_string()),
            port: Some(i64::from(self.port)),
            protocol: Some(self.protocol.as_str().to_owned()),
            sel: Some(i64::from(self.sel.code())),
            mode: Some(i64::from(self.mode.code())),
            name: self.name.clone(),
            kv_exact_mode: Some(i64::from(self.kv_mode.code())),
            kv_engine_type: Some(self.engine.as_str().to_owned()),
            ..RawServiceArguments::default()
        };
        if let Some(kv) = &self.kv {
            args.kv_block_size = Some(i64::from(u32::from(kv.block_size)));
            args.kv_hash_algo = Some(kv.engine_algo.as_str().to_owned());
            args.kv_zmq_port = Some(i64::from(kv.zmq_port));
            args.kv_warmup_sec = Some(i64::from(kv.warmup_sec));
            args.kv_dp_rank_count = Some(i64::from(kv.dp_rank_count));
            args.kv_key_mode = Some(kv.key_mode.as_str().to_owned());
            args.kv_model = kv.model.as_ref().map(|m| m.name().to_owned());
            args.kv_vllm_extra_keys = (kv.contract.extra_layout != ExtraKeysLayout::Tagged)
                .then(|| kv.contract.extra_layout.as_str().to_owned());
            args.kv_replay_port = kv.replay_port.map(i64::from);
            args.kv_zmq_bind = kv.zmq_bind.then_some(true);
        }
        let endpoints = self
            .endpoints
            .iter()
            .map(|e| RawEndpoint {
                endpoint_ip: Some(e.addr.ip().to_string()),
                target_port: Some(i64::from(e.addr.port())),
                weight: Some(i64::from(e.weight)),
                ep_role: e.role.map(|r| i64::from(r.code())),
                kv_capacity_blocks: e.capacity_blocks.map(i64::from),
                kv_zmq_endpoint: e.zmq_endpoint.map(|a| a.to_string()),
                kv_replay_endpoint: e.replay_endpoint.map(|a| a.to_string()),
            })
            .collect();
        let secondary_ips = (!self.secondary_ips.is_empty()).then(|| {
            self.secondary_ips
                .iter()
                .map(|ip| RawSecondaryIp {
                    secondary_ip: Some(ip.to_string()),
                })
                .collect()
        });
        let allowed_sources = (!self.allowed_sources.is_empty()).then(|| {
            self.allowed_sources
                .iter()
                .map(|p| RawAllowedSource {
                    prefix: Some(p.to_string()),
                })
                .collect()
        });
        RawRule {
            service_arguments: args,
            endpoints: Some(endpoints),
            secondary_ips,
            allowed_sources,
        }
    }
}

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_raw().serialize(s)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn prefix_parsing() {
        assert_eq!(
            IpPrefix::parse("10.0.0.0/8").unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert_eq!(
            IpPrefix::parse("10.1.2.3").unwrap().to_string(),
            "10.1.2.3/32"
        );
        assert_eq!(IpPrefix::parse("fd00::/16").unwrap().prefix_len(), 16);
        assert_eq!(IpPrefix::parse("::1").unwrap().prefix_len(), 128);
        assert_eq!(IpPrefix::parse("0.0.0.0/0").unwrap().prefix_len(), 0);
        for bad in [
            "10.0.0.0/33",
            "fd00::/129",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "10.0.0/8",
            "x",
            "",
        ] {
            assert_eq!(IpPrefix::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn rule_id_brackets_ipv6() {
        let v4 = RuleId::new("10.0.0.1".parse().unwrap(), 8080, Protocol::Tcp);
        assert_eq!(v4.as_str(), "10.0.0.1:8080/tcp");
        let v6 = RuleId::new("fd00::1".parse().unwrap(), 80, Protocol::Tcp);
        assert_eq!(v6.to_string(), "[fd00::1]:80/tcp");
    }

    #[test]
    fn codes_match_loxilb_numbering() {
        assert_eq!(LbMode::ALL.map(LbMode::code), [0, 1, 2, 3, 4, 5]);
        assert_eq!(Sel::ALL.map(Sel::code), [0, 1, 2, 3, 4]);
        assert_eq!(
            [KvMode::Off, KvMode::PrefillDecode, KvMode::SinglePool].map(KvMode::code),
            [0, 1, 3]
        );
        assert_eq!(LbMode::from_code(4), Some(LbMode::FullProxy));
        assert_eq!(Sel::from_code(5), None);
    }
}
