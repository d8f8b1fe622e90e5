//! The one seam between the fleet and replication across replicas.
//!
//! The fleet calls a [`Replication`] at each point where another replica must learn something:
//! a rule installed or removed, index operations this replica ingested, a routing decision, and
//! the ownership of an endpoint's event feed. Standalone ([`Standalone`]) every call is a no-op
//! and every endpoint is owned here; with `KVROUTE_REDIS_URL` the Redis implementation
//! (`crate::replica::Replica`) logs, leases and snapshots. Nothing else calls replication.

use std::sync::Arc;

use kvroute_core::hash::BlockKey;
use tokio_util::sync::CancellationToken;

use super::rule::RuleRuntime;
use super::Fleet;
use crate::index::{EndpointId, IndexOp, Rank};
use crate::score::Update;

/// Where a rule change came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The management API or the rules file of this replica: the others must be told.
    Local,
    /// Another replica, through the replication log: already known there.
    Peer,
}

/// Starts an endpoint's event feeds (every rank), stopped by the token it is given.
pub type StartFeeds = Box<dyn Fn(&CancellationToken) + Send + Sync>;

/// What replication is told, by the fleet only.
pub trait Replication: Send + Sync {
    /// A rule was installed (`replaced`: the runtime it replaced).
    fn rule_installed(&self, rule: &RuleRuntime, replaced: Option<&RuleRuntime>, origin: Origin);
    /// A rule was removed.
    fn rule_removed(&self, rule: &RuleRuntime, origin: Origin);
    /// This replica (the owner) applied `ops` for `(ep, rank)`.
    fn ops(&self, rule: &Arc<RuleRuntime>, ep: EndpointId, rank: Rank, ops: &[IndexOp]);
    /// A routing decision: speculative credit for `keys`, placement memory, in-flight load, and
    /// the session bound to `ep` (its hash), if any.
    fn decision(
        &self,
        rule: &Arc<RuleRuntime>,
        ep: EndpointId,
        update: Option<Update>,
        keys: &[BlockKey],
        session: Option<u64>,
    );
    /// Runs endpoint `ep`'s feeds while this replica owns it: `start` is called with a token
    /// cancelled when ownership ends (or the rule stops).
    fn own(&self, fleet: &Arc<Fleet>, rule: &Arc<RuleRuntime>, ep: EndpointId, start: StartFeeds);
    /// This replica's name, for `/healthz`; `None` standalone.
    fn replica_id(&self) -> Option<&str>;
}

/// One replica alone: nothing to tell, every endpoint owned here.
pub struct Standalone;

impl Replication for Standalone {
    fn rule_installed(&self, _: &RuleRuntime, _: Option<&RuleRuntime>, _: Origin) {}

    fn rule_removed(&self, _: &RuleRuntime, _: Origin) {}

    fn ops(&self, _: &Arc<RuleRuntime>, _: EndpointId, _: Rank, _: &[IndexOp]) {}

    fn decision(
        &self,
        _: &Arc<RuleRuntime>,
        _: EndpointId,
        _: Option<Update>,
        _: &[BlockKey],
        _: Option<u64>,
    ) {
    }

    fn own(&self, _: &Arc<Fleet>, rule: &Arc<RuleRuntime>, ep: EndpointId, start: StartFeeds) {
        if let Some(e) = rule.ep(ep) {
            e.set_owned(true);
            start(&rule.child_token());
        }
    }

    fn replica_id(&self) -> Option<&str> {
        None
    }
}
